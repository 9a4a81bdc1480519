"""Sampler (seeded order, resume, sharding) and split_indices."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders import Sampler, SamplerState, split_indices


def _all_batches(sampler: Sampler, epoch: int) -> list[np.ndarray]:
    return [b for _, b in sampler.batches(SamplerState(epoch, 0))]


def test_epoch_order_is_the_documented_permutation() -> None:
    indices = np.arange(100, 150)
    s = Sampler(indices, batch_size=8, shuffle=True, seed=7, drop_last=False)
    expected = indices[np.random.default_rng((7, 3)).permutation(50)]
    np.testing.assert_array_equal(s.epoch_order(3), expected)
    assert not np.array_equal(s.epoch_order(3), s.epoch_order(4))
    np.testing.assert_array_equal(np.sort(s.epoch_order(4)), indices)


def test_same_arguments_give_same_batches_in_a_fresh_sampler() -> None:
    make = lambda: Sampler(np.arange(37), batch_size=5, shuffle=True, seed=1, drop_last=False)  # noqa: E731
    first, second = _all_batches(make(), 2), _all_batches(make(), 2)
    assert len(first) == len(second) == 8
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    other_seed = _all_batches(Sampler(np.arange(37), 5, True, 2, False), 2)
    assert not all(np.array_equal(a, b) for a, b in zip(first, other_seed, strict=True))


def test_batches_cover_the_epoch_once_with_a_final_partial_batch() -> None:
    s = Sampler(np.arange(37), batch_size=5, shuffle=True, seed=0, drop_last=False)
    batches = _all_batches(s, 0)
    assert [len(b) for b in batches] == [5] * 7 + [2]
    assert s.batches_per_epoch() == 8
    np.testing.assert_array_equal(np.concatenate(batches), s.epoch_order(0))


def test_drop_last_leaves_out_the_partial_batch_and_never_pads() -> None:
    s = Sampler(np.arange(37), batch_size=5, shuffle=False, seed=0, drop_last=True)
    batches = _all_batches(s, 0)
    assert s.batches_per_epoch() == 7
    assert [len(b) for b in batches] == [5] * 7
    np.testing.assert_array_equal(np.concatenate(batches), np.arange(35))


def test_states_count_batches_and_resume_mid_epoch_exactly() -> None:
    s = Sampler(np.arange(50), batch_size=6, shuffle=True, seed=3, drop_last=False)
    run = list(s.batches(SamplerState(4, 0)))
    assert [st.position for st, _ in run] == list(range(1, 10))
    assert all(st.epoch == 4 for st, _ in run)
    resume_from = run[3][0]
    fresh = Sampler(np.arange(50), batch_size=6, shuffle=True, seed=3, drop_last=False)
    resumed = list(fresh.batches(resume_from))
    assert len(resumed) == len(run) - 4
    for (sa, a), (sb, b) in zip(run[4:], resumed, strict=True):
        assert sa == sb
        np.testing.assert_array_equal(a, b)
    assert list(s.batches(SamplerState(4, 9))) == []
    with pytest.raises(ValueError, match="position 10 outside 0..9 for epoch 4"):
        list(s.batches(SamplerState(4, 10)))


def test_shards_are_disjoint_equal_and_cover_all_but_the_documented_tail() -> None:
    n, world = 101, 4
    shards = [Sampler(np.arange(n), 8, True, 11, False, rank=r, world=world).shard(5) for r in range(world)]
    assert {len(sh) for sh in shards} == {25}
    union = np.concatenate(shards)
    assert len(np.unique(union)) == len(union)
    order = Sampler(np.arange(n), 8, True, 11, False).epoch_order(5)
    np.testing.assert_array_equal(np.sort(union), np.sort(order[:100]))
    np.testing.assert_array_equal(shards[1], order[1:100:4])


def test_shards_cover_everything_when_world_divides_n() -> None:
    shards = [
        np.concatenate(_all_batches(Sampler(np.arange(60), 7, True, 2, False, rank=r, world=3), 1))
        for r in range(3)
    ]
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(60))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 200),
    world=st.integers(1, 6),
    batch=st.integers(1, 17),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_every_rank_emits_the_same_number_of_batches(
    n: int, world: int, batch: int, drop_last: bool, seed: int
) -> None:
    counts, seen = set(), []
    for r in range(world):
        s = Sampler(np.arange(n), batch, True, seed, drop_last, rank=r, world=world)
        bs = _all_batches(s, 0)
        assert len(bs) == s.batches_per_epoch()
        assert all(0 < len(b) <= batch for b in bs)
        counts.add(len(bs))
        seen.extend(np.concatenate(bs).tolist() if bs else [])
    assert len(counts) == 1
    assert len(seen) == len(set(seen))


def test_sampler_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        Sampler(np.arange(5), 0, False, 0, False)
    with pytest.raises(ValueError, match="need 0 <= rank < world, got rank=2, world=2"):
        Sampler(np.arange(5), 2, False, 0, False, rank=2, world=2)


def test_split_is_deterministic_disjoint_and_covering() -> None:
    a = split_indices(1000, None, 0.7, 0.2, 0.1, seed=5, stratify=False)
    b = split_indices(1000, None, 0.7, 0.2, 0.1, seed=5, stratify=False)
    c = split_indices(1000, None, 0.7, 0.2, 0.1, seed=6, stratify=False)
    for k in ("train", "val", "test"):
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["val"], c["val"])
    assert [len(a[k]) for k in ("train", "val", "test")] == [700, 200, 100]
    together = np.concatenate([a["train"], a["val"], a["test"]])
    np.testing.assert_array_equal(np.sort(together), np.arange(1000))


def test_sizes_add_up_when_fractions_do_not_divide_n() -> None:
    parts = split_indices(10, None, 1 / 3, 1 / 3, 1 / 3, seed=0, stratify=False)
    assert sorted(len(p) for p in parts.values()) == [3, 3, 4]


def test_stratified_split_keeps_class_proportions() -> None:
    rng = np.random.default_rng(0)
    labels = rng.choice(4, size=2000, p=[0.55, 0.3, 0.1, 0.05]).astype(np.int32)
    parts = split_indices(len(labels), labels, 0.6, 0.2, 0.2, seed=9, stratify=True)
    together = np.concatenate(list(parts.values()))
    np.testing.assert_array_equal(np.sort(together), np.arange(2000))
    overall = np.bincount(labels, minlength=4)
    for name, frac in (("train", 0.6), ("val", 0.2), ("test", 0.2)):
        counts = np.bincount(labels[parts[name]], minlength=4)
        # Per class, the split holds its fraction of that class to within one sample.
        assert np.all(np.abs(counts - frac * overall) <= 1), (name, counts, frac * overall)
    assert split_indices(len(labels), labels, 0.6, 0.2, 0.2, 9, True)["val"].tolist() == parts["val"].tolist()


def test_stratified_split_gives_a_rare_class_its_share() -> None:
    labels = np.array([0] * 95 + [1] * 5, dtype=np.int32)
    stratified = split_indices(100, labels, 0.8, 0.0, 0.2, seed=1, stratify=True)
    assert np.bincount(labels[stratified["test"]], minlength=2).tolist() == [19, 1]


def test_split_rejects_bad_fractions_and_float_labels() -> None:
    with pytest.raises(ValueError, match="must be >= 0 and add up to 1, got 0.5, 0.2, 0.2"):
        split_indices(10, None, 0.5, 0.2, 0.2, seed=0, stratify=False)
    with pytest.raises(ValueError, match="stratify=True needs class labels"):
        split_indices(10, np.linspace(0, 1, 10, dtype=np.float32), 0.5, 0.25, 0.25, seed=0, stratify=True)

"""Data larger than memory, streamed by blocks: the block order (loaders.sampler, data.shuffle=
"blocks") and its read-ahead buffer (loaders.blocks.BlockSource) over memory-mapped IDX files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from run_checks import InterruptAt, assert_same_weights, thread_snapshot, vkflow_threads
from specs import ROOT

import flow
import flow.data_plan
from actors.cpu_backend import CpuBackend
from actors.loader import Read, jobs
from actors.messages import Cursor, StepDone
from actors.meter import Hooks
from flow.codec import save
from flow.data_plan import StepSchedule, header_of, plan_data
from flow.spec import IDX, Adam, CrossEntropy, Data, Devices, Flatten, Linear, Model, RunSettings, Spec, Split
from loaders import IDXSource, LoaderError, Sampler, SamplerState, read_idx, write_idx
from loaders.blocks import BlockSource

SHAPE = (1, 5, 7)


def _idx_files(tmp: Path, n: int, dtype=np.uint8, seed: int = 0) -> tuple[Path, Path]:
    """n learnable samples: class c lights up row c of a noisy image."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, n).astype(np.uint8)
    images = rng.integers(0, 60, (n, *SHAPE[1:])).astype(dtype)
    images[np.arange(n), labels] += 150
    write_idx(tmp / "images.idx", images)
    write_idx(tmp / "labels.idx", labels)
    return tmp / "images.idx", tmp / "labels.idx"


def _train_reads(sampler: Sampler, epochs: int, start: Cursor | None = None) -> list[Read]:
    per_epoch = sampler.batches_per_epoch()
    schedule = StepSchedule(per_epoch, epochs * per_epoch)
    return [j for j in jobs(start or Cursor(), schedule, sampler, None) if isinstance(j, Read)]


# -- the order -------------------------------------------------------------------------------------


def test_the_block_order_is_a_new_permutation_each_epoch_and_a_function_of_seed_and_epoch():
    make = lambda seed=7: Sampler(np.arange(1003), 16, True, seed, False, block=50, window=3)  # noqa: E731
    orders = [make().epoch_order(e) for e in range(3)]
    for order in orders:
        assert np.array_equal(np.sort(order), np.arange(1003))
    assert all(np.array_equal(make().epoch_order(e), orders[e]) for e in range(3))
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    assert not np.array_equal(make(8).epoch_order(0), orders[0])


def test_blocks_are_contiguous_windows_come_whole_and_batches_mix_blocks():
    sampler = Sampler(np.arange(1003), 16, True, 3, False, block=50, window=3)
    for epoch in range(2):
        order, at = sampler.epoch_order(epoch), 0
        windows = sampler.windows(epoch)
        assert sorted(b for w in windows for b in w.tolist()) == list(range(21))  # 20 whole, 1 partial
        for window in windows:
            members = [sampler.block_members(b) for b in window.tolist()]
            assert all(np.array_equal(m, np.arange(m[0], m[0] + m.size)) for m in members)
            size = sum(m.size for m in members)
            assert np.array_equal(np.sort(order[at : at + size]), np.sort(np.concatenate(members)))
            at += size
        mixed = [len(np.unique(batch // 50)) for _, batch in sampler.batches(SamplerState(epoch, 0))]
        assert np.mean(mixed) > 2  # a batch of 16 from a window of 3 blocks holds most of them


def test_resuming_mid_epoch_gives_the_tail_of_the_uninterrupted_stream():
    sampler = Sampler(np.arange(1003), 16, True, 3, False, block=50, window=3)
    whole = _train_reads(sampler, 3)
    cut = 80  # epoch 1, batch 17
    tail = _train_reads(sampler, 3, Cursor(cut, whole[cut].epoch, whole[cut].position))
    assert [(r.epoch, r.position) for r in tail] == [(r.epoch, r.position) for r in whole[cut:]]
    assert all(np.array_equal(a.indices, b.indices) for a, b in zip(tail, whole[cut:], strict=True))


# -- the read-ahead buffer -------------------------------------------------------------------------


class _Counting:
    """Counts the reads that reach the source itself (not served from the buffer)."""

    def __init__(self, source) -> None:
        self.direct, self.read = 0, source.read

        def read(indices):
            self.direct += 1
            return self.read(indices)

        source.read = read


@pytest.mark.parametrize("split", ["all", "every 7th left out"])
def test_reads_through_the_buffer_equal_direct_reads_bit_for_bit(tmp_path, split):
    images, labels = _idx_files(tmp_path, 1003)
    indices = np.arange(1003) if split == "all" else np.flatnonzero(np.arange(1003) % 7)
    sampler = Sampler(indices, 24, True, 5, False, block=64, window=2)  # a partial last block
    before = thread_snapshot()
    direct = IDXSource(images, labels)
    blocks = BlockSource(IDXSource(images, labels), sampler)
    counting = _Counting(blocks.source)
    assert blocks.record_bytes == 35 and len(blocks) == 1003 and blocks.num_classes == 4
    reads = _train_reads(sampler, 2)
    for job in blocks.follow(iter(reads)):
        got, want = blocks.read(job.indices), direct.read(job.indices)
        assert np.array_equal(got[0], want[0]) and got[0].dtype == np.float32
        assert np.array_equal(got[1], want[1]) and got[2] == want[2] == 0
    assert counting.direct == 0  # every training read came from RAM
    outside = np.flatnonzero(np.arange(1003) % 7 == 0) if split != "all" else np.array([5, 3])
    assert np.array_equal(blocks.read(outside)[0], direct.read(outside)[0])  # a validation batch
    assert blocks.statistics().bytes_read >= 2 * indices.size * 35  # every block, once an epoch
    assert vkflow_threads(before) == ["vkflow-blocks"]
    blocks.close()
    assert vkflow_threads(before) == []


def test_bad_records_are_skipped_or_raised_as_a_direct_read_does(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(203, 3)).astype(np.float32)
    x[[17, 150]] = np.nan
    write_idx(tmp_path / "x.idx", x)
    write_idx(tmp_path / "y.idx", rng.integers(0, 3, 203).astype(np.uint8))
    sampler = Sampler(np.arange(203), 32, True, 2, False, block=40, window=2)
    for on_error in ("skip", "raise"):
        direct = IDXSource(tmp_path / "x.idx", tmp_path / "y.idx", on_error=on_error)
        blocks = BlockSource(IDXSource(tmp_path / "x.idx", tmp_path / "y.idx", on_error=on_error), sampler)
        for job in blocks.follow(iter(_train_reads(sampler, 1))):
            if on_error == "raise" and np.isin([17, 150], job.indices).any():
                with pytest.raises(LoaderError, match="NaN or infinity"):
                    blocks.read(job.indices)
                continue
            got, want = blocks.read(job.indices), direct.read(job.indices)
            assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
        assert blocks.statistics().skipped == (2 if on_error == "skip" else 0)
        blocks.close()


def test_the_thread_is_gone_after_a_failed_block_read_and_after_close(tmp_path):
    images, labels = _idx_files(tmp_path, 300)
    sampler = Sampler(np.arange(300), 20, True, 0, False, block=32, window=2)
    before = thread_snapshot()
    blocks = BlockSource(IDXSource(images, labels), sampler)

    def broken(start, stop):
        raise OSError("disk gone")

    blocks.source.read_rows = broken
    reads = blocks.follow(iter(_train_reads(sampler, 1)))
    with pytest.raises(OSError, match="disk gone"):
        blocks.read(next(reads).indices)
    blocks._thread.join(timeout=5)
    assert vkflow_threads(before) == []  # it stopped at the error
    later = next(job for job in reads if job.position > 8)  # a later window fails too, never hangs
    with pytest.raises(OSError, match="disk gone"):
        blocks.read(later.indices)
    blocks.close()
    assert vkflow_threads(before) == []


# -- whole runs ------------------------------------------------------------------------------------


class _Losses(Hooks):
    def __init__(self) -> None:
        self.losses: list[float] = []

    async def received(self, actor, item) -> None:
        if actor == "sink" and isinstance(item, StepDone):
            self.losses.append(item.loss)


class _Spy(BlockSource):
    made: list[_Spy] = []

    def __init__(self, source, sampler) -> None:
        super().__init__(source, sampler)
        self.counting = _Counting(source)
        _Spy.made.append(self)


def _spec(images: Path, labels: Path, tmp: Path | None = None, **run) -> Spec:
    settings = {"epochs": 3, "in_flight": 2, **run}
    if tmp is not None:
        settings.update(checkpoint_dir=str(tmp / "ckpt"), metrics_file=str(tmp / "metrics.jsonl"))
    return Spec(
        model=Model(input_shape=SHAPE, layers=(Flatten(), Linear(16, activation="relu"), Linear(4)),
                    loss=CrossEntropy()),
        optimiser=Adam(0.01),
        data=Data(IDX(str(images), str(labels)), batch_size=32, seed=5, shuffle="blocks",
                  split=Split(train=0.9, val=0.1), placement="host"),
        devices=Devices("cpu"),
        run=RunSettings(**settings),
    )  # fmt: skip


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 64 samples of 35 bytes, so a small file has many, and a spy on the buffer."""
    monkeypatch.setattr(flow.data_plan, "BLOCK_BYTES", 64 * 35)
    monkeypatch.setattr(flow.data_plan, "BlockSource", _Spy)
    _Spy.made.clear()


@pytest.mark.parametrize("kind", ["cpu", "vulkan"])
def test_a_run_in_the_block_order_trains_from_the_buffer(tmp_path, small_blocks, kind, request):
    images, labels = _idx_files(tmp_path, 1501)
    spec = _spec(images, labels)
    backend = CpuBackend() if kind == "cpu" else request.getfixturevalue("vulkan_backend")
    before, losses = thread_snapshot(), _Losses()
    result = flow.run(spec, backend=backend, hooks=[losses])
    assert result.steps == 3 * 43 and len(losses.losses) == result.steps
    assert np.mean(losses.losses[-10:]) < 0.5 * np.mean(losses.losses[:5])
    assert result.accuracy > 0.9
    (spy,) = _Spy.made
    assert spy.counting.direct < 0.2 * result.steps  # validation rounds and reads behind the window
    assert vkflow_threads(before) == []


def test_a_resumed_run_in_the_block_order_matches_an_uninterrupted_one(tmp_path, small_blocks):
    images, labels = _idx_files(tmp_path, 1501)
    reference = flow.run(_spec(images, labels, tmp_path / "a"))
    spec = _spec(images, labels, tmp_path / "b", checkpoint_every=10)
    with pytest.raises(KeyboardInterrupt):
        flow.run(spec, hooks=[InterruptAt(57)])  # epoch 1, mid-window
    resumed = flow.run(spec, resume=spec.run.checkpoint_dir)
    assert 0 < resumed.resumed_from < reference.steps == resumed.steps
    assert_same_weights(resumed.parameters, reference.parameters)
    assert resumed.accuracy == reference.accuracy


def test_the_plan_says_when_the_buffer_applies(tmp_path, user_cache):
    images, labels = _idx_files(tmp_path, 1501)
    spec = _spec(images, labels)
    with IDXSource(images, labels) as source:
        data = plan_data(spec, header_of(source))
    assert data.as_dict()["blocks"] == {
        "samples": (32 << 20) // 35,
        "count": 1,
        "window": 4,
        "read_ahead": True,
    }
    write_idx(tmp_path / "images.idx.gz", read_idx(images))  # read into memory: no read-ahead
    with IDXSource(tmp_path / "images.idx.gz", labels) as source:
        in_memory = plan_data(spec, header_of(source))
    assert in_memory.block == data.block and not in_memory.reads_ahead  # the same order, read directly
    save(spec, tmp_path / "spec.json")
    done = subprocess.run([sys.executable, "-m", "flow", "plan", str(tmp_path / "spec.json")],
                          capture_output=True, text=True, cwd=ROOT, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "shuffle blocks" in done.stdout
    assert "block order: 1 block(s) of 958,698 samples, shuffled within windows of 4; read a window" in (
        done.stdout
    )
    done = subprocess.run([sys.executable, "-m", "flow", "plan", str(tmp_path / "spec.json"), "--json"],
                          capture_output=True, text=True, cwd=ROOT, check=False)  # fmt: skip
    assert json.loads(done.stdout)["data"]["blocks"]["read_ahead"] is True

"""The synthetic source: samples depend only on the seed and the index, its tasks are learnable, its
cache gives exactly the generated samples, and ``read_into`` gives what ``read`` gives."""

from __future__ import annotations

import numpy as np
import pytest

from loaders import SyntheticSource


def test_synthetic_samples_depend_only_on_seed_and_index() -> None:
    a = SyntheticSource("classification", 200, (6,), classes=4, seed=1)
    b = SyntheticSource("classification", 200, (6,), classes=4, seed=1)
    xa, ya, _ = a.read([5, 17, 3])
    xb, yb, _ = b.read([3, 17, 5])
    np.testing.assert_array_equal(xa, xb[::-1])
    np.testing.assert_array_equal(ya, yb[::-1])
    assert np.bincount(a.labels).tolist() == [50, 50, 50, 50]
    other = SyntheticSource("classification", 200, (6,), classes=4, seed=2)
    assert not np.array_equal(other.read([5])[0], xa[:1])


def test_synthetic_tasks_are_learnable() -> None:
    cls = SyntheticSource("classification", 400, (8,), classes=5, seed=0)
    x, y, _ = cls.read(range(400))
    centroids = np.stack([x[y == c].mean(axis=0) for c in range(5)])
    predicted = np.argmin(((x[:, None, :] - centroids[None]) ** 2).sum(-1), axis=1)
    assert (predicted == y).mean() > 0.9
    reg = SyntheticSource("regression", 300, (5,), seed=0)
    x, y, _ = reg.read(range(300))
    assert reg.label_dtype == np.float32 and reg.num_classes is None
    w, *_ = np.linalg.lstsq(x, y, rcond=None)
    r2 = 1 - np.var(x @ w - y) / np.var(y)
    assert r2 > 0.95


def test_the_synthetic_cache_gives_exactly_the_generated_samples(rng):
    for task in ("classification", "regression"):
        cached = SyntheticSource(task, 300, (2, 3), classes=4, seed=7)
        generated = SyntheticSource(task, 300, (2, 3), classes=4, seed=7, cache_bytes=0)
        for _ in range(4):
            indices = rng.integers(0, 300, 64)
            (xa, ya, _), (xb, yb, _) = cached.read(indices), generated.read(indices)
            assert xa.tobytes() == xb.tobytes() and ya.tobytes() == yb.tobytes()
        xa[:] = 0  # the caller owns what it read: the cache is not touched
        assert cached.read(indices)[0].tobytes() == xb.tobytes()


def test_a_synthetic_read_into_gives_what_read_gives(rng):
    for task in ("classification", "regression"):
        for cache in (None, 0):
            kwargs = {} if cache is None else {"cache_bytes": cache}
            source = SyntheticSource(task, 300, (2, 3), classes=4, seed=7, **kwargs)
            indices = rng.integers(0, 300, 20)
            x, y, _ = source.read(indices)
            into_x = np.full((32, 2, 3), np.nan, np.float32)
            into_y = np.zeros(32, y.dtype)
            assert source.read_into(indices, into_x, into_y) == (20, 0)
            assert into_x[:20].tobytes() == x.tobytes() and into_y[:20].tobytes() == y.tobytes()
            assert np.isnan(into_x[20:]).all()
            with pytest.raises(IndexError):
                source.read_into([300], into_x, into_y)
            with pytest.raises(ValueError, match=r"40 samples of shape \(2, 3\) do not fit"):
                source.read_into(np.arange(40), into_x, into_y)

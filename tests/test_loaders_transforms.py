"""Batch transforms: values, purity (input untouched) and reproducible randomness."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from loaders import apply_transforms, batch_rng, horizontal_flip, normalize, random_crop, resize, scale


@dataclass(frozen=True)
class Normalize:
    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass(frozen=True)
class Scale:
    factor: float


@dataclass(frozen=True)
class RandomCrop:
    size: int
    padding: int


@dataclass(frozen=True)
class HorizontalFlip:
    p: float


@dataclass(frozen=True)
class Resize:
    size: tuple[int, int]


@dataclass(frozen=True)
class Blur:
    radius: float


def _batch(seed: int = 0, shape: tuple[int, ...] = (5, 3, 6, 7)) -> np.ndarray:
    return np.random.default_rng(seed).random(shape, dtype=np.float32)


def test_normalize_is_per_channel() -> None:
    x = _batch()
    before = x.copy()
    out = normalize(x, (0.1, 0.5, 0.9), (0.5, 2.0, 0.25))
    np.testing.assert_allclose(out[:, 1], (x[:, 1] - 0.5) / 2.0, rtol=1e-6)
    np.testing.assert_allclose(out[:, 2], (x[:, 2] - 0.9) / 0.25, rtol=1e-6)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(x, before)
    flat = normalize(_batch(shape=(4, 3)), 0.5, 0.5)
    assert flat.shape == (4, 3)
    with pytest.raises(ValueError, match="std has 2 values for 3 channels"):
        normalize(x, (0.1, 0.2), (1.0, 1.0))
    with pytest.raises(ValueError, match=r"std must be > 0, got \(1.0, 0.0, 1.0\)"):
        normalize(x, 0.0, (1.0, 0.0, 1.0))


def test_scale_multiplies() -> None:
    x = _batch(shape=(2, 3))
    np.testing.assert_allclose(scale(x, 255.0), x * 255.0, rtol=1e-6)


def test_random_crop_takes_windows_of_the_padded_image_reproducibly() -> None:
    x = _batch(shape=(6, 2, 5, 5))
    a = random_crop(x, 5, 2, batch_rng(1, 2, 3))
    b = random_crop(x, 5, 2, batch_rng(1, 2, 3))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (6, 2, 5, 5)
    padded = np.pad(x, ((0, 0), (0, 0), (2, 2), (2, 2)))
    for i in range(6):
        windows = [padded[i, :, t : t + 5, s : s + 5] for t in range(5) for s in range(5)]
        assert any(np.array_equal(a[i], w) for w in windows)
    c = random_crop(x, 5, 2, batch_rng(1, 2, 4))
    assert not np.array_equal(a, c)
    with pytest.raises(ValueError, match="crop 10x10 larger than the padded image 9x9"):
        random_crop(x, 10, 2, batch_rng(0, 0, 0))


def test_horizontal_flip_probability_extremes_and_mix() -> None:
    x = _batch()
    np.testing.assert_array_equal(horizontal_flip(x, 1.0, batch_rng(0, 0, 0)), x[..., ::-1])
    np.testing.assert_array_equal(horizontal_flip(x, 0.0, batch_rng(0, 0, 0)), x)
    big = _batch(shape=(200, 1, 2, 3))
    out = horizontal_flip(big, 0.5, batch_rng(0, 0, 0))
    flipped = np.array([np.array_equal(o, b[..., ::-1]) for o, b in zip(out, big, strict=True)])
    assert 60 < flipped.sum() < 140


def test_resize_shapes_and_keeps_a_constant_image_constant() -> None:
    x = np.full((2, 3, 8, 8), 0.25, dtype=np.float32)
    x[1] = 0.75
    out = resize(x, (4, 6))
    assert out.shape == (2, 3, 4, 6)
    np.testing.assert_allclose(out[0], 0.25, atol=1e-6)
    np.testing.assert_allclose(out[1], 0.75, atol=1e-6)


def test_apply_transforms_dispatches_on_class_name_in_order() -> None:
    x = _batch(shape=(4, 3, 8, 8))
    specs = [Scale(2.0), Normalize((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)), RandomCrop(6, 0), HorizontalFlip(1.0)]
    out = apply_transforms(x, specs, batch_rng(5, 0, 0))
    rng = batch_rng(5, 0, 0)
    expected = horizontal_flip(random_crop((x * 2.0 - 1.0) / 2.0, 6, 0, rng), 1.0, rng)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert apply_transforms(x, [Resize((2, 2))], batch_rng(0, 0, 0)).shape == (4, 3, 2, 2)
    with pytest.raises(ValueError, match="Blur"):
        apply_transforms(x, [Blur(1.0)], batch_rng(0, 0, 0))


def test_batch_rng_depends_on_every_coordinate() -> None:
    draws = {
        tuple(batch_rng(*args).integers(0, 2**31, 4).tolist())
        for args in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 0, 0, 1)]
    }
    assert len(draws) == 5
    assert batch_rng(3, 4, 5).random() == batch_rng(3, 4, 5).random()

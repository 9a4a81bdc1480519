"""Preprocessing and augmentation of batches: pure functions of (batch, parameters, rng).

Batches are float32 ``[n, C, H, W]`` (CHW samples; ``normalize`` and ``scale`` also take
``[n, features]``). Functions never change their input. Randomness comes only from the ``rng``
argument, made by :func:`batch_rng` from (seed, epoch, batch position, rank), so a resumed run
draws the same crops and flips as an uninterrupted one. :func:`apply_transforms` runs a list of
transform specs (records from ``flow/spec_data.py``, matched by class name, so this layer need not
import ``flow``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image


def batch_rng(seed: int, epoch: int, position: int, rank: int = 0) -> np.random.Generator:
    """The generator for one batch's augmentation.

    Args:
        seed: the run's seed.
        epoch: the epoch.
        position: the batch's position in the epoch (``SamplerState.position`` before it).
        rank: the shard, so that ranks do not draw identical augmentations.

    Returns:
        ``np.random.default_rng((seed, epoch, position, rank))``.
    """
    return np.random.default_rng((seed, epoch, position, rank))


def _per_channel(values: float | Sequence[float], x: np.ndarray, name: str) -> np.ndarray:
    v = np.asarray(values, dtype=np.float32).reshape(-1)
    channels = x.shape[1]
    if v.size == 1:
        v = np.repeat(v, channels)
    if v.size != channels:
        raise ValueError(f"{name} has {v.size} values for {channels} channels")
    return v.reshape((1, channels) + (1,) * (x.ndim - 2))


def normalize(x: np.ndarray, mean: float | Sequence[float], std: float | Sequence[float]) -> np.ndarray:
    """``(x - mean) / std`` per channel (axis 1).

    Args:
        x: batch [n, C, ...].
        mean: one value, or one per channel.
        std: one value, or one per channel; all > 0.

    Returns:
        A new float32 batch.
    """
    s = _per_channel(std, x, "std")
    if (s <= 0).any():
        raise ValueError(f"std must be > 0, got {std}")
    return ((x - _per_channel(mean, x, "mean")) / s).astype(np.float32, copy=False)


def scale(x: np.ndarray, factor: float) -> np.ndarray:
    """Multiply by a constant. Not for 8-bit data: every source already gives it in [0, 1], and
    a further 1/255 leaves [0, 1/255], where a model trains at chance (see ``flow.spec.Scale``).

    Args:
        x: batch.
        factor: the multiplier.

    Returns:
        A new float32 batch.
    """
    return (x * np.float32(factor)).astype(np.float32, copy=False)


def _hw(size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(size, int | np.integer):
        return int(size), int(size)
    h, w = size
    return int(h), int(w)


def _check_images(x: np.ndarray, name: str) -> None:
    if x.ndim != 4:
        raise ValueError(f"{name} needs a CHW image batch [n, C, H, W], got shape {x.shape}")


def random_crop(
    x: np.ndarray, size: int | Sequence[int], padding: int, rng: np.random.Generator
) -> np.ndarray:
    """Zero-pad each side by ``padding``, then cut a random ``size`` window from each sample.

    Args:
        x: batch [n, C, H, W].
        size: crop (h, w), or one int for a square.
        padding: zeros added on each side first.
        rng: the batch's generator.

    Returns:
        A new batch [n, C, h, w].
    """
    _check_images(x, "random_crop")
    h, w = _hw(size)
    p = int(padding)
    padded = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p))) if p else x
    ph, pw = padded.shape[2:]
    if h > ph or w > pw:
        raise ValueError(f"crop {h}x{w} larger than the padded image {ph}x{pw}")
    tops = rng.integers(0, ph - h + 1, size=x.shape[0])
    lefts = rng.integers(0, pw - w + 1, size=x.shape[0])
    out = np.empty((x.shape[0], x.shape[1], h, w), dtype=np.float32)
    for i, (t, left) in enumerate(zip(tops.tolist(), lefts.tolist(), strict=True)):
        out[i] = padded[i, :, t : t + h, left : left + w]
    return out


def horizontal_flip(x: np.ndarray, p: float, rng: np.random.Generator) -> np.ndarray:
    """Mirror each sample left-right with probability ``p``.

    Args:
        x: batch [n, C, H, W].
        p: probability per sample.
        rng: the batch's generator.

    Returns:
        A new batch.
    """
    _check_images(x, "horizontal_flip")
    flip = rng.random(x.shape[0]) < p
    out = np.array(x, dtype=np.float32, copy=True)
    out[flip] = out[flip][..., ::-1]
    return out


def resize(x: np.ndarray, size: int | Sequence[int]) -> np.ndarray:
    """Resize each image to ``size`` with Pillow's bilinear filter (antialiased when shrinking).

    Args:
        x: batch [n, C, H, W].
        size: (h, w), or one int for a square.

    Returns:
        A new batch [n, C, h, w].
    """
    _check_images(x, "resize")
    h, w = _hw(size)
    out = np.empty((x.shape[0], x.shape[1], h, w), dtype=np.float32)
    for i in range(x.shape[0]):
        for c in range(x.shape[1]):
            plane = Image.fromarray(np.ascontiguousarray(x[i, c], dtype=np.float32))
            out[i, c] = np.asarray(plane.resize((w, h), Image.Resampling.BILINEAR))
    return out


def call_lambda(t: Any, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A Lambda record's function on a batch, its result checked: as many samples, real numbers.

    Raises:
        ValueError: naming the transform, when the result breaks that contract.
    """
    n = x.shape[0]
    out = np.asarray(t.fn(x, rng) if t.random else t.fn(x))
    if out.dtype.kind not in "biuf" or out.ndim < 1 or out.shape[0] != n:
        raise ValueError(
            f"transform {t.name!r} ({t.fn!r:.60}) must return {n} samples of real numbers for a batch "
            f"of {n}, got shape {out.shape} dtype {out.dtype}"
        )
    return out.astype(np.float32, copy=False)


def apply_transforms(x: np.ndarray, transforms: Sequence[Any], rng: np.random.Generator) -> np.ndarray:
    """Apply transform specs in order, dispatching on their class name.

    Args:
        x: batch.
        transforms: records named Normalize(mean, std), Scale(factor), RandomCrop(size, padding),
            HorizontalFlip(p), Resize(size) or Lambda(fn).
        rng: the batch's generator (see :func:`batch_rng`), shared by the random transforms in order.

    Returns:
        The transformed batch.
    """
    for t in transforms:
        kind = type(t).__name__
        if kind == "Normalize":
            x = normalize(x, t.mean, t.std)
        elif kind == "Scale":
            x = scale(x, t.factor)
        elif kind == "RandomCrop":
            x = random_crop(x, t.size, getattr(t, "padding", 0), rng)
        elif kind == "HorizontalFlip":
            x = horizontal_flip(x, getattr(t, "p", 0.5), rng)
        elif kind == "Resize":
            x = resize(x, t.size)
        elif kind == "Lambda":
            x = call_lambda(t, x, rng)
        else:
            raise ValueError(f"unknown transform {kind}")
    return x

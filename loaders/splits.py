"""Split sample indices into train/val/test: deterministic, disjoint, covering, optionally stratified.

Sizes are the fractions times n, rounded by largest remainder so that they add up to n exactly.
Stratified splitting does that per class, so each split keeps the class proportions (to within one
sample per class). :func:`split_contiguous` keeps file order instead, for samples that share data
with their neighbours (text windows): a shuffled split would leak it between the parts.
"""

from __future__ import annotations

import numpy as np


def _allocate(n: int, fractions: np.ndarray) -> np.ndarray:
    """Integer sizes summing to n, closest to n * fractions (largest remainder; ties to the first)."""
    exact = n * fractions
    sizes = np.floor(exact).astype(np.int64)
    short = n - int(sizes.sum())
    order = np.argsort(-(exact - sizes), kind="stable")
    sizes[order[:short]] += 1
    return sizes


def split_indices(
    n: int,
    labels: np.ndarray | None,
    train: float,
    val: float,
    test: float,
    seed: int,
    stratify: bool,
) -> dict[str, np.ndarray]:
    """Split ``range(n)`` into train, val and test.

    Args:
        n: number of samples.
        labels: class labels (needed with ``stratify``; int or str dtype, not float targets).
        train: fraction for training.
        val: fraction for validation.
        test: fraction for testing; the three must add up to 1.
        seed: the shuffle's seed (``np.random.default_rng(seed)``).
        stratify: keep each class's proportion in every split.

    Returns:
        {"train": ..., "val": ..., "test": ...}: sorted int64 index arrays, disjoint, covering
        ``range(n)``.
    """
    fractions = np.array([train, val, test], dtype=np.float64)
    if (fractions < 0).any() or abs(fractions.sum() - 1.0) > 1e-6:
        raise ValueError(f"train, val, test must be >= 0 and add up to 1, got {train}, {val}, {test}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[], [], []]
    if stratify:
        if labels is None:
            raise ValueError("stratify=True needs labels")
        labels = np.asarray(labels)
        if labels.shape != (n,):
            raise ValueError(f"labels must have shape ({n},), got {labels.shape}")
        if labels.dtype.kind == "f":
            raise ValueError("stratify=True needs class labels, got float (regression) targets")
        groups = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    else:
        groups = [np.arange(n, dtype=np.int64)]
    for members in groups:
        members = members[rng.permutation(members.size)]
        bounds = np.concatenate(([0], np.cumsum(_allocate(members.size, fractions))))
        for k in range(3):
            parts[k].append(members[bounds[k] : bounds[k + 1]])
    return {
        name: np.sort(np.concatenate(p)).astype(np.int64) if p else np.empty(0, np.int64)
        for name, p in zip(("train", "val", "test"), parts, strict=True)
    }


def split_contiguous(n: int, train: float, val: float, test: float, gap: int) -> dict[str, np.ndarray]:
    """Split ``range(n)`` into runs in order: train first, then val, then test.

    Args:
        n: number of samples.
        train: fraction for training.
        val: fraction for validation.
        test: fraction for testing; the three must add up to 1.
        gap: samples left out at the end of a part that a non-empty part follows: sample i shares
            data with samples up to i + gap, so none of a part's data is in the next one.

    Returns:
        {"train": ..., "val": ..., "test": ...}: ascending int64 index arrays, disjoint; together
        they cover ``range(n)`` but for the gaps.
    """
    fractions = np.array([train, val, test], dtype=np.float64)
    if (fractions < 0).any() or abs(fractions.sum() - 1.0) > 1e-6:
        raise ValueError(f"train, val, test must be >= 0 and add up to 1, got {train}, {val}, {test}")
    sizes = _allocate(n, fractions)
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    parts = {}
    for k, name in enumerate(("train", "val", "test")):
        start, stop = int(bounds[k]), int(bounds[k + 1])
        if sizes[k + 1 :].sum() > 0:
            stop = max(start, stop - gap)
        parts[name] = np.arange(start, stop, dtype=np.int64)
    return parts

"""Samples from a Python object of the user's: the ``Custom`` source (flow.spec_data.Custom).

The object needs two things: ``len(obj)``, the number of samples, and ``obj.read(indices) -> (x,
y)``, the samples at those indices: x ``[len(indices), *sample_shape]`` of real numbers, y
``[len(indices)]`` integer class ids >= 0 or ``[len(indices), k]`` float targets. Its labels are
read once when the source opens (in chunks, y only kept), for splits and the class count, unless
it offers them all at once as ``obj.labels`` (an array, or a method returning one). Values follow
every source's convention: uint8 x is divided by 255, other real dtypes are cast to float32. A
read that breaks the contract (a wrong shape, NaN) is a LoaderError naming the object and indices.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from loaders.errors import LoaderError
from loaders.source import SourceStatistics, StatsRecorder, check_indices, readonly

LABEL_CHUNK = 4096  # samples per read while gathering the labels of an object that has no labels


class CustomSource:
    """A :class:`loaders.source.Source` over a user's object (see the module docstring).

    Args:
        obj: the object, with ``__len__`` and ``read(indices)``.
        where: its name in messages.

    Raises:
        LoaderError: the object has no samples, or its first read or its labels break the contract.
    """

    in_memory = False  # a user's read may decode or wait: the loader runs it in a worker thread

    def __init__(self, obj: Any, where: str = "custom") -> None:
        self._obj, self.path = obj, where
        self._stats = StatsRecorder()
        self._length = int(len(obj))
        if self._length <= 0:
            raise LoaderError(where, f"len() is {self._length}: it must hold at least one sample")
        self.sample_shape: tuple[int, ...] = ()
        first, _ = self._read(np.zeros(1, np.int64))
        self.sample_shape = tuple(int(d) for d in first.shape[1:])
        labels = getattr(obj, "labels", None)
        labels = labels() if callable(labels) else labels
        if labels is None:
            starts = range(0, self._length, LABEL_CHUNK)
            ranges = (np.arange(i, min(i + LABEL_CHUNK, self._length)) for i in starts)
            labels = np.concatenate([self._read(chunk)[1] for chunk in ranges])
        labels = self._check_labels(np.asarray(labels), self._length, "labels")
        self.labels = readonly(labels.astype(np.int32) if labels.ndim == 1 else labels.astype(np.float32))
        self.label_dtype = self.labels.dtype
        self.num_classes: int | None = int(self.labels.max()) + 1 if self.labels.ndim == 1 else None

    def __len__(self) -> int:
        return self._length

    def _check_labels(self, y: np.ndarray, n: int, what: str) -> np.ndarray:
        if y.ndim == 1 and y.dtype.kind in "iu" and y.shape[0] == n and (not n or y.min() >= 0):
            return y
        if y.ndim == 2 and y.dtype.kind == "f" and y.shape[0] == n and np.isfinite(y).all():
            return y
        raise LoaderError(
            self.path,
            f"{what}: expected [{n}] integer class ids >= 0 or [{n}, k] finite float targets, "
            f"got shape {y.shape} dtype {y.dtype}",
        )

    def _read(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The object's read, checked against the contract and cast to float32."""
        where = f"read({idx[:4].tolist()}{', ...' if idx.size > 4 else ''})"
        try:
            x, y = self._obj.read(idx)
        except (TypeError, ValueError) as error:  # not a pair, or a read that cannot take the indices
            raise LoaderError(self.path, f"{where} must return (x, y): {error}") from error
        x, y = np.asarray(x), np.asarray(y)
        shape = (idx.size, *self.sample_shape) if self.sample_shape else None
        if x.dtype.kind not in "biuf" or x.ndim < 2 or x.shape[0] != idx.size or (shape and x.shape != shape):
            expected = f"[{idx.size}, *{self.sample_shape}]" if shape else f"[{idx.size}, *sample_shape]"
            got = f"got {x.shape} {x.dtype}"
            raise LoaderError(self.path, f"{where}: x must be {expected} real numbers, {got}")
        y = self._check_labels(y, idx.size, f"{where}: y")
        x = x.astype(np.float32) * np.float32(1 / 255) if x.dtype == np.uint8 else x.astype(np.float32)
        bad = np.flatnonzero(~np.isfinite(x.reshape(idx.size, -1)).all(axis=1))
        if bad.size:
            raise LoaderError(self.path, f"{where}: sample {int(idx[bad[0]])} holds NaN or infinity")
        return x, y

    def read(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """The samples at ``indices``, from the object.

        Returns:
            (x float32 [n, *sample_shape], y [n] or [n, k], 0 skipped).
        """
        idx = check_indices(indices, self._length, self.path)
        t0 = time.perf_counter()
        x, y = self._read(idx)
        self._stats.add(samples=idx.size, bytes_read=x.nbytes, seconds=time.perf_counter() - t0)
        return x, y.astype(self.label_dtype), 0

    def statistics(self) -> SourceStatistics:
        """Frozen counters."""
        return self._stats.snapshot(0)

    def close(self) -> None:
        """Nothing to release: the object is the caller's, who closes it."""

"""Samples held by numpy arrays: in memory (a run from Python) or in ``.npy`` / ``.npz`` files.

:func:`array_problems` says what is wrong with a pair of arrays (the spec's validator reports it
under ``data.source``; :class:`ArraysSource` raises it for arrays read from files). Values follow
every source's convention: uint8 ``x`` is divided by 255, other real dtypes are cast to float32.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np

from loaders.binary import _ArraySource
from loaders.errors import ErrorPolicy, LoaderError
from loaders.source import check_indices


def array_problems(x: np.ndarray, y: np.ndarray) -> list[tuple[str, str]]:
    """What is wrong with training arrays, as (``"x"`` or ``"y"``, message) pairs.

    Args:
        x: the samples, [n, *sample_shape] of a real dtype, every value finite.
        y: [n] integer class ids >= 0, or [n, k] finite float targets.

    Returns:
        The problems; [] when the arrays are fine.
    """
    found = [
        (name, f"must hold real numbers, got dtype {a.dtype}")
        for name, a in (("x", x), ("y", y))
        if a.dtype.kind not in "biuf"
    ]
    if found:
        return found
    if x.ndim < 2 or x.shape[0] == 0:
        found.append(("x", f"must be [n, *sample_shape] with n > 0, got shape {x.shape}"))
    if y.ndim not in (1, 2):
        found.append(("y", f"must be [n] class ids or [n, k] targets, got shape {y.shape}"))
    if x.ndim and y.ndim and x.shape[0] != y.shape[0]:
        found.append(("y", f"has {y.shape[0]} labels for {x.shape[0]} samples in x"))
    if x.dtype.kind == "f" and x.ndim >= 1 and x.shape[0]:
        bad = np.flatnonzero(~np.isfinite(x.reshape(x.shape[0], -1)).all(axis=1))
        if bad.size:
            found.append(("x", f"{bad.size} samples hold NaN or infinity, the first sample {bad[0]}"))
    if y.ndim == 1 and y.dtype.kind not in "iu":
        hint = " (for regression give float targets the shape [n, k])" if y.dtype.kind == "f" else ""
        found.append(("y", f"class ids must be integers, got dtype {y.dtype}{hint}"))
    elif y.ndim == 1 and y.size and y.min() < 0:
        found.append(("y", f"class ids must be >= 0, got {y.min()} at sample {int(np.argmin(y))}"))
    elif y.ndim == 2 and y.dtype.kind == "f" and not np.isfinite(y).all():
        found.append(("y", "targets hold NaN or infinity"))
    return found


def _load(path: str, key: str | None = None) -> np.ndarray:
    """An array from a ``.npy`` file (mapped) or one array of a ``.npz`` file (read)."""
    try:
        if key is None:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        with np.load(path, allow_pickle=False) as z:
            if key not in z.files:
                raise LoaderError(path, f"has no array {key!r} (it holds {', '.join(z.files) or 'none'})")
            return z[key]
    except (OSError, ValueError, EOFError) as exc:
        raise LoaderError(path, f"cannot read as numpy data ({exc})") from exc


class ArraysSource(_ArraySource):
    """Samples from arrays (see the module docstring): a gather from RAM, or from a mapped ``.npy``.

    Args:
        x: the samples [n, *sample_shape].
        y: [n] integer class ids or [n, k] float targets.
        where: the name in messages ("arrays", or the file).

    Raises:
        LoaderError: every problem :func:`array_problems` finds.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, where: str = "arrays") -> None:
        problems = array_problems(x, y)
        if problems:
            raise LoaderError(where, "; ".join(f"{name} {message}" for name, message in problems))
        y = np.asarray(y, np.float32) if y.ndim == 2 else np.asarray(y)
        scale = 1.0 / 255.0 if x.dtype == np.uint8 else 1.0
        super().__init__(where, x, y, scale, ErrorPolicy("raise", where))

    def read_into(self, indices: Sequence[int], x: np.ndarray, y: np.ndarray) -> tuple[int, int]:
        """The same values as ``read``, written into the caller's arrays (rows ``[:n]``).

        Returns:
            (rows written, 0 skipped): the arrays were checked finite when opened.
        """
        idx = check_indices(indices, len(self), self.path)
        n = int(idx.size)
        if n > x.shape[0] or n > y.shape[0] or tuple(x.shape[1:]) != self.sample_shape:
            raise ValueError(f"{self.path}: {n} samples of {self.sample_shape} do not fit {x.shape}")
        t0 = time.perf_counter()
        raw = self._records[idx]
        x[:n] = raw.astype(np.float32) * self._scale if self._scale != 1 else raw
        y[:n] = self.labels[idx]
        self._stats.add(samples=n, bytes_read=raw.nbytes, seconds=time.perf_counter() - t0)
        return n, 0


def open_arrays(
    x: np.ndarray | str | os.PathLike | None, y: np.ndarray | str | os.PathLike | None, path: str | None
) -> ArraysSource:
    """Open arrays given in memory, as ``.npy`` files (x and y) or as one ``.npz`` file (path).

    Returns:
        The source.
    """
    if path is not None:
        return ArraysSource(_load(str(path), "x"), _load(str(path), "y"), str(path))
    if isinstance(x, str | os.PathLike) and isinstance(y, str | os.PathLike):
        return ArraysSource(_load(str(x)), _load(str(y)), str(x))
    return ArraysSource(np.asarray(x), np.asarray(y))

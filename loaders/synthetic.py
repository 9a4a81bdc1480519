"""Generated data with a known answer, for tests and demos that need no files.

Each sample is a pure function of (seed, index): sample ``i`` comes from its own generator, so any
subset, in any order, on any machine, reads the same values. A sample's own generator costs ~15 µs,
so a batch of 256 costs ~4 ms, ten times a small training step on a GPU: each sample is generated
once, on its first read, and kept (a later read is a gather from memory, straight into the
caller's arrays with ``read_into``). A dataset larger than ``cache_bytes`` keeps nothing and is
generated on every read (the same values, slower).
Classification: balanced labels, each class a Gaussian blob around its own random centre.
Regression: a standard-normal target ``y`` and ``x = y * direction + noise``, so ``y`` is linearly
recoverable from ``x``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from loaders.source import SourceStatistics, StatsRecorder, StoredData, check_indices, readonly

NOISE = 0.5
CACHE_BYTES = 256 * 2**20


class SyntheticSource:
    """A generated dataset (see the module docstring).

    Args:
        task: "classification" or "regression".
        samples: number of samples.
        features: shape of one sample.
        classes: number of classes (classification only).
        seed: the data's seed.
        cache_bytes: keep generated samples when the whole dataset fits in this many bytes.

    Attributes:
        in_memory: True when the samples are kept (the dataset fits ``cache_bytes``): a read is
            then a gather from RAM, which the loader runs on its event loop, never in a thread
            (see actors.loader). The first read of each sample generates it; that too holds the
            GIL for most of its time (a Python loop over samples), so a thread would not free
            the loop either. False when every read generates.
    """

    def __init__(
        self,
        task: str = "classification",
        samples: int = 1000,
        features: Sequence[int] = (16,),
        classes: int = 10,
        seed: int = 0,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        if task not in ("classification", "regression"):
            raise ValueError(f"task must be 'classification' or 'regression', got {task!r}")
        if samples < 1 or (task == "classification" and classes < 2):
            raise ValueError(f"need samples >= 1 and classes >= 2, got {samples}, {classes}")
        self.task = task
        self.seed = int(seed)
        self.sample_shape: tuple[int, ...] = tuple(int(f) for f in features)
        self._n = int(samples)
        self._stats = StatsRecorder()
        # The class centres (or the regression direction) are made on the first read, not here:
        # opening stays as cheap as reading a file's header (a run opens its source before the
        # device plan can refuse a model too big for it, and 10 centres of 3 x 2048 x 2048 are
        # 500 MB).
        self._classes = int(classes)
        self._basis: np.ndarray | None = None
        if task == "classification":
            labels = np.arange(self._n, dtype=np.int32) % classes
            np.random.default_rng([self.seed, 1]).shuffle(labels)
            self.num_classes: int | None = int(classes)
        else:
            labels = np.random.default_rng([self.seed, 1]).standard_normal(self._n).astype(np.float32)
            self.num_classes = None
        self.labels = readonly(labels)
        self.label_dtype = self.labels.dtype
        nbytes = self._n * int(np.prod(self.sample_shape)) * 4
        # np.empty only reserves: pages are committed as samples are first generated.
        self._cache = np.empty((self._n, *self.sample_shape), np.float32) if nbytes <= cache_bytes else None
        self.in_memory = self._cache is not None
        self._ready = np.zeros(self._n, dtype=bool)
        self._missing = self._n  # samples not generated yet
        self._lock = threading.Lock()  # concurrent loader threads generate each sample once
        self._basis_lock = threading.Lock()  # taken inside _lock, so a lock of its own

    def __len__(self) -> int:
        return self._n

    def close(self) -> None:
        """Nothing to release."""

    def statistics(self) -> SourceStatistics:
        """Frozen counters (bytes_read stays 0: nothing is read).

        Returns:
            The statistics so far.
        """
        return self._stats.snapshot(0)

    def read(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """Generate samples.

        Args:
            indices: sample indices, any order, repeats allowed.

        Returns:
            (x float32 [n, *sample_shape], y [n], 0).
        """
        idx = check_indices(indices, self._n, "synthetic")
        t0 = time.perf_counter()
        if self._cache is None:
            x = self._generate(idx)
        else:
            self._fill_cache(idx)
            x = self._cache[idx]  # a gather: a new array, the cache stays private
        self._stats.add(samples=int(idx.size), seconds=time.perf_counter() - t0)
        return x, self.labels[idx], 0

    def read_into(self, indices: Sequence[int], x: np.ndarray, y: np.ndarray) -> tuple[int, int]:
        """Generate samples straight into the caller's arrays (e.g. a device's mapped input slot):
        the same values as :meth:`read`, without an array in between.

        Args:
            indices: sample indices, any order, repeats allowed.
            x: float32 [>= n, *sample_shape]; rows ``[:n]`` are written.
            y: [>= n] (flat); elements ``[:n]`` get the labels, cast to its dtype.

        Returns:
            (rows written, 0 skipped).
        """
        idx = check_indices(indices, self._n, "synthetic")
        n = int(idx.size)
        if n > x.shape[0] or n > y.shape[0] or tuple(x.shape[1:]) != self.sample_shape:
            raise ValueError(
                f"synthetic: {n} samples of shape {self.sample_shape} do not fit arrays "
                f"{tuple(x.shape)} and {tuple(y.shape)}"
            )
        t0 = time.perf_counter()
        if self._cache is None:
            x[:n] = self._generate(idx)
        else:
            self._fill_cache(idx)
            # mode="clip" gathers straight into ``out``: the default "raise" mode first gathers into
            # a temporary (three times slower); the indices are checked above.
            np.take(self._cache, idx, axis=0, out=x[:n], mode="clip")
        y[:n] = self.labels[idx]
        self._stats.add(samples=n, seconds=time.perf_counter() - t0)
        return n, 0

    @property
    def stored_dtype(self) -> str | None:
        """What :meth:`stored` gives: "float32" for classification that fits the cache, else None."""
        return "float32" if self.task == "classification" and self._cache is not None else None

    def stored(self) -> StoredData | None:
        """Every sample, generated now, for keeping on a device (see loaders.source.StoredData).
        None for regression (its targets are not class ids) and for a dataset larger than the
        cache, which would be generated twice.

        Returns:
            The data, or None.
        """
        if self.task != "classification" or self._cache is None:
            return None
        self._fill_cache(np.arange(self._n))
        view = self._cache.view()
        view.setflags(write=False)  # the cache stays the source's own
        return StoredData(view, np.asarray(self.labels), 1.0)

    def _fill_cache(self, idx: np.ndarray) -> None:
        """Generate the samples of ``idx`` the cache does not hold yet."""
        if self._missing:
            with self._lock:
                missing = np.unique(idx[~self._ready[idx]])
                if missing.size:
                    self._cache[missing] = self._generate(missing)
                    self._ready[missing] = True
                    self._missing -= int(missing.size)

    def _centres_or_direction(self) -> np.ndarray:
        """The class centres [classes, *sample_shape] (classification) or the direction
        [*sample_shape] (regression), made once from the data's seed."""
        if self._basis is None:
            with self._basis_lock:
                if self._basis is None:
                    base = np.random.default_rng([self.seed, 0])
                    classification = self.task == "classification"
                    shape = (self._classes, *self.sample_shape) if classification else self.sample_shape
                    self._basis = base.standard_normal(shape).astype(np.float32)
        return self._basis

    def _generate(self, idx: np.ndarray) -> np.ndarray:
        """Samples ``idx`` from their own generators (the values that define the dataset)."""
        noise = np.empty((idx.size, *self.sample_shape), dtype=np.float32)
        for k, i in enumerate(idx.tolist()):
            np.random.default_rng([self.seed, 2, i]).standard_normal(dtype=np.float32, out=noise[k])
        y = self.labels[idx]
        basis = self._centres_or_direction()
        if self.task == "classification":
            return basis[y] + NOISE * noise
        return y.reshape(-1, *(1,) * len(self.sample_shape)) * basis + 0.1 * noise

"""Generated data with a known answer, for tests and demos that need no files.

Each sample is a pure function of (seed, index): sample ``i`` comes from its own generator, so any
subset, in any order, on any machine, reads the same values, and nothing is held in memory.
Classification: balanced labels, each class a Gaussian blob around its own random centre.
Regression: a standard-normal target ``y`` and ``x = y * direction + noise``, so ``y`` is linearly
recoverable from ``x``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from loaders.source import SourceStatistics, StatsRecorder, check_indices, readonly

NOISE = 0.5


class SyntheticSource:
    """A generated dataset (see the module docstring).

    Args:
        task: "classification" or "regression".
        samples: number of samples.
        features: shape of one sample.
        classes: number of classes (classification only).
        seed: the data's seed.
    """

    def __init__(
        self,
        task: str = "classification",
        samples: int = 1000,
        features: Sequence[int] = (16,),
        classes: int = 10,
        seed: int = 0,
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
        base = np.random.default_rng([self.seed, 0])
        if task == "classification":
            self._centres = base.standard_normal((classes, *self.sample_shape)).astype(np.float32)
            labels = np.arange(self._n, dtype=np.int32) % classes
            np.random.default_rng([self.seed, 1]).shuffle(labels)
            self.num_classes: int | None = int(classes)
        else:
            self._direction = base.standard_normal(self.sample_shape).astype(np.float32)
            labels = np.random.default_rng([self.seed, 1]).standard_normal(self._n).astype(np.float32)
            self.num_classes = None
        self.labels = readonly(labels)
        self.label_dtype = self.labels.dtype

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
        x = np.empty((idx.size, *self.sample_shape), dtype=np.float32)
        y = self.labels[idx]
        for k, i in enumerate(idx.tolist()):
            noise = np.random.default_rng([self.seed, 2, i]).standard_normal(
                self.sample_shape, dtype=np.float32
            )
            if self.task == "classification":
                x[k] = self._centres[y[k]] + NOISE * noise
            else:
                x[k] = y[k] * self._direction + 0.1 * noise
        self._stats.add(samples=int(idx.size), seconds=time.perf_counter() - t0)
        return x, y, 0

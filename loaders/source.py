"""The contract every data source meets, and the statistics record it reports.

The runtime sees sources only through :class:`Source`: a length, the shape and dtype of one decoded
sample, all labels (cheap, for stratified splits) and ``read(indices)`` returning a float32 batch.
A source may also offer ``read_into(indices, x, y) -> (rows, skipped)``, which writes the same
batch into the caller's arrays (the rows kept first); the loader then reads straight into a
device's mapped input slot, with no array in between. In-memory sources offer it, where a read is
little more than that copy. A source whose whole data is an array may also offer ``stored()``
(:class:`StoredData`): the samples as stored, so a run can keep them on the device and read a batch
there by index. A source whose reads are a gather or copy from RAM says so with ``in_memory =
True``; the loader then runs its reads on the event loop and never in a thread (a hop costs more
than such a read). A source that decodes, parses or may wait on a disk leaves it out (False).
:class:`StatsRecorder` is the thread-safe counter behind each source's frozen ``statistics()``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class SourceStatistics:
    """What a source has done so far.

    Attributes:
        samples_read: samples returned by ``read``.
        skipped: bad items left out under ``on_error="skip"`` (each time one is met).
        bytes_read: bytes taken from storage.
        decode_seconds: time spent decoding/parsing, summed over worker threads.
        skipped_items: distinct bad items left out (a bad file met in every epoch counts once).
        skipped_examples: where the first few of them are (file, or file and row), in the order met.
    """

    samples_read: int = 0
    skipped: int = 0
    bytes_read: int = 0
    decode_seconds: float = 0.0
    skipped_items: int = 0
    skipped_examples: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class StoredData:
    """A whole dataset as a source stores it, for keeping on a device.

    Attributes:
        x: every sample [n, *sample_shape], uint8 (8-bit data, stored as it is) or float32.
        labels: every label [n] (int32 class ids).
        scale: what the source multiplies ``x`` by to emit a sample (1/255 for 8-bit data, so it
            arrives in [0, 1]; 1.0 otherwise): ``read`` gives ``float32(x) * float32(scale)``.
    """

    x: np.ndarray
    labels: np.ndarray
    scale: float


@runtime_checkable
class Source(Protocol):
    """A random-access set of samples (see the module docstring)."""

    sample_shape: tuple[int, ...]
    label_dtype: np.dtype
    num_classes: int | None
    labels: np.ndarray

    def __len__(self) -> int: ...

    def read(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray, int]: ...

    def statistics(self) -> SourceStatistics: ...

    def close(self) -> None: ...


class StatsRecorder:
    """Thread-safe accumulator that snapshots into a frozen :class:`SourceStatistics`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples = 0
        self._bytes = 0
        self._seconds = 0.0

    def add(self, samples: int = 0, bytes_read: int = 0, seconds: float = 0.0) -> None:
        """Add one unit of work.

        Args:
            samples: samples returned.
            bytes_read: bytes read from storage.
            seconds: decode time.
        """
        with self._lock:
            self._samples += samples
            self._bytes += bytes_read
            self._seconds += seconds

    def snapshot(
        self, skipped: int, skipped_items: int = 0, skipped_examples: tuple[str, ...] = ()
    ) -> SourceStatistics:
        """Freeze the counters.

        Args:
            skipped: the error policy's skip count.
            skipped_items: its count of distinct bad items.
            skipped_examples: where its first few bad items are.

        Returns:
            The statistics so far.
        """
        with self._lock:
            return SourceStatistics(
                self._samples, skipped, self._bytes, self._seconds, skipped_items, skipped_examples
            )


def check_indices(indices: Sequence[int], n: int, where: str) -> np.ndarray:
    """Turn ``indices`` into an int64 array, rejecting out-of-range values.

    Args:
        indices: sample indices asked for.
        n: the source's length.
        where: the source's name for the message.

    Returns:
        The indices as a 1-D int64 array.
    """
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        bad = idx[(idx < 0) | (idx >= n)][0]
        raise IndexError(f"{where}: index {bad} out of range for {n} samples")
    return idx


def readonly(array: np.ndarray) -> np.ndarray:
    """Mark an array read-only so callers cannot corrupt a source's labels by accident.

    Args:
        array: the array (changed in place).

    Returns:
        The same array.
    """
    array.setflags(write=False)
    return array

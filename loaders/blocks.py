"""Streaming by blocks: a memory-mapped source (IDX, raw binary) read in the sampler's block order.

One background thread, "vkflow-blocks", copies whole blocks out of the map by contiguous slices
(sequential I/O) into RAM a window ahead; a batch's read is then a gather from RAM, decoded by the
source itself (``decode``), so values and bad items are those of a direct read. :meth:`follow`
learns from the loader's job stream where the run stands (epoch, batch position), which says the
window to load next; the order being a pure function of (seed, epoch), a resumed run follows it the
same way. A read of samples not buffered (validation and test batches, a read lagging behind the
windows kept) goes straight to the source: the buffer changes where bytes come from, never what.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any

import numpy as np

from loaders.sampler import RankSlices, Sampler
from loaders.source import check_indices


class BlockSource:
    """A source read by blocks (module docstring) for ``sampler`` (the training sampler, in the
    block order over sorted indices). ``source`` offers ``read_rows`` and ``decode`` (loaders.binary)
    and is closed with it."""

    in_memory = False  # a read may wait for its window: the loader's measurement decides

    def __init__(self, source: Any, sampler: Sampler | RankSlices) -> None:
        self.source = source
        self.sampler = sampler.sampler if isinstance(sampler, RankSlices) else sampler
        if self.sampler.block is None or np.any(np.diff(self.sampler.indices) < 0):
            raise ValueError("BlockSource needs a sampler in the block order over sorted indices")
        self._blocks: dict[int, Future] = {}  # block id -> its rows as stored, loaded or on their way
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._at: tuple[int, int] | None = None  # (epoch, window) of the last training read seen
        self._windows: dict[int, tuple[list[np.ndarray], np.ndarray]] = {}

    def __getattr__(self, name: str) -> Any:  # labels, sample_shape, statistics, ...: the source's
        return getattr(self.source, name)

    def __len__(self) -> int:
        return len(self.source)

    def close(self) -> None:
        """Stop the thread (after the block it is copying), then close the source."""
        with self._lock:  # first, so that the thread skips the blocks queued before its stop
            for future in self._blocks.values():
                future.cancel()
            self._blocks.clear()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self.source.close()

    def follow(self, jobs: Iterator[Any]) -> Iterator[Any]:
        """``jobs`` (actors.loader.jobs) unchanged; each training read keeps its window, the next
        and the one before (reads still in flight) buffered, and drops the rest."""
        for job in jobs:
            if getattr(job, "split", None) == "train":
                self._advance(job.epoch, job.position)
            yield job

    def _epoch(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        """An epoch's windows and where each ends in its order (one epoch kept at a time)."""
        if epoch not in self._windows:
            windows = self.sampler.windows(epoch)
            sizes = [sum(self.sampler.block_members(b).size for b in w) for w in windows]
            self._windows = {epoch: (windows, np.cumsum(sizes))}
        return self._windows[epoch]

    def _advance(self, epoch: int, position: int) -> None:
        windows, ends = self._epoch(epoch)
        first = position * self.sampler.batch_size
        last = min(first + self.sampler.batch_size, int(ends[-1])) - 1
        lo, hi = (int(np.searchsorted(ends, v, side="right")) for v in (first, last))
        if self._at == (epoch, hi):
            return
        keep = [b for w in windows[lo : hi + 1] for b in w.tolist()]
        if self._at is not None and self._at[0] == epoch:
            keep = windows[self._at[1]].tolist() + keep
        nxt = windows[hi + 1] if hi + 1 < len(windows) else self.sampler.windows(epoch + 1)[0]
        self._at = (epoch, hi)
        self._want(keep + nxt.tolist())

    def _want(self, blocks: list[int]) -> None:
        """Keep exactly ``blocks`` buffered, loading the missing ones in order."""
        with self._lock:
            kept = {b: self._blocks[b] for b in blocks if b in self._blocks}
            for b in self._blocks.keys() - kept.keys():
                self._blocks[b].cancel()
            for b in blocks:
                if b not in kept:
                    kept[b] = Future()
                    if self._error is not None:
                        kept[b].set_exception(self._error)
                    else:
                        self._queue.put(b)
            self._blocks = kept
            if self._thread is None and self._error is None:
                self._thread = threading.Thread(target=self._load, name="vkflow-blocks", daemon=True)
                self._thread.start()

    def _load(self) -> None:
        """The background thread: copy the blocks asked for; stop at close or on the first error."""
        while (block := self._queue.get()) is not None:
            with self._lock:
                future = self._blocks.get(block)
            if future is None or not future.set_running_or_notify_cancel():
                continue  # dropped before its turn
            members = self.sampler.block_members(block)
            try:
                rows = self.source.read_rows(int(members[0]), int(members[-1]) + 1)
                future.set_result(rows[members - members[0]] if rows.shape[0] != members.size else rows)
            except BaseException as exc:  # handed to every read that waits for a block, now or later
                with self._lock:
                    self._error = exc
                    for waiting in (future, *self._blocks.values()):
                        if not waiting.done():
                            waiting.set_exception(exc)
                return

    def read(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """As the source's ``read``, from the buffer where every sample asked for is in it."""
        idx = check_indices(indices, len(self), self.source.path)
        order = self.sampler.indices
        pos = np.minimum(np.searchsorted(order, idx), max(order.size - 1, 0))
        blocks = pos // self.sampler.block
        with self._lock:
            wanted = {b: self._blocks.get(b) for b in np.unique(blocks).tolist()}
        if not idx.size or (order[pos] != idx).any() or any(f is None for f in wanted.values()):
            return self.source.read(idx)
        try:
            parts = {b: future.result() for b, future in wanted.items()}  # waits for blocks on their way
        except CancelledError:  # dropped meanwhile: the run has moved on
            return self.source.read(idx)
        first = next(iter(parts.values()))
        raw = np.empty((idx.size, *first.shape[1:]), first.dtype)
        for b, rows in parts.items():
            mask = blocks == b
            raw[mask] = rows[pos[mask] - b * self.sampler.block]
        return self.source.decode(idx, raw)

"""The loader actor: turns a source and a sampler into the run's stream of messages.

The loader is the one place that knows the run's schedule, so it emits all of it, in order:
training batches, an evaluation round (the whole validation split) where one is due, one round
over the test split after the last step, a
:class:`CheckpointMark` where a checkpoint is due, and a final mark at the end. Deciding what comes
next is pure (:class:`Schedule`, :func:`next_cursor`, :func:`after_step`, :func:`jobs`); the actor
only reads and sends. Because every actor keeps stream order, a mark reaches the device exactly
after the last training batch before it, which is what makes a snapshot there consistent without
draining or reordering anything.

Reads run in worker threads under the loader's own CapacityLimiter (``workers`` at once, so a
slow disk overlaps with the device); results leave in stream order whatever order they finish in.
A read measured to cost less than a hop to a thread runs on the event loop instead
(:class:`actors.inline.InlinePolicy`). A source that declares ``in_memory = True`` (its reads are a
gather or a copy from RAM: Synthetic, an IDX file decompressed into memory) is not measured at all:
its reads always run on the event loop, because a measurement taken on a busy host could send
them to threads, where each costs the loop more than the read itself. The loader's statistics
count the reads that went to threads (``thread_items``).
Given the device's :class:`actors.device.InputSlots` with views (no transform between the loader
and the device, a source with ``read_into``, device memory the host can map), the loader takes a
free slot for each batch and reads the batch straight into it: no array of its own, and no copy
into the device afterwards.
Ready batches leave at once while the channel downstream has room; while it is full (the device
is the slower side) the loader goes on reading ahead and sends up to ``MAX_CHUNK`` batches as one
:class:`actors.messages.Chunk`. When the host is the slower side, it holds a ready batch back while
the next would be ready before the event loop came back to it anyway (actors.read_ahead), so every
actor's per-message cost is paid once for several steps. So chunks grow only when one side falls
behind, and a batch waits at most one turn of the loop.
It never holds ready batches while it waits for a read or a slot.
A run resumes from a :class:`Cursor`: the sampler is stateless given (seed, epoch), so the loader
simply starts there.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import trio

from actors.inline import InlineOrThread, InlinePolicy
from actors.messages import Batch, CheckpointMark, Cursor
from actors.meter import MAX_CHUNK, Meter
from actors.read_ahead import ReadAhead
from actors.statistics import ActorStatistics
from flow.data_plan import StepSchedule
from loaders import Sampler, SamplerState

if TYPE_CHECKING:
    from actors.device import InputSlots


def next_cursor(cursor: Cursor, schedule: StepSchedule) -> Cursor | None:
    """Where the next training batch is drawn from.

    Args:
        cursor: where the run stands.
        schedule: the run's schedule.

    Returns:
        ``cursor``, or the start of the next epoch when ``cursor`` is at the end of one; None when
        the run has done all its steps.
    """
    if cursor.step >= schedule.total_steps:
        return None
    if cursor.position >= schedule.batches_per_epoch:
        return Cursor(cursor.step, cursor.epoch + 1, 0)
    return cursor


def after_step(cursor: Cursor, schedule: StepSchedule) -> tuple[str, ...]:
    """What follows a training step, in order.

    Args:
        cursor: the cursor after the step.
        schedule: the run's schedule.

    Returns:
        Some of "eval", "checkpoint", "final" (the final mark replaces a checkpoint mark) and
        "snapshot" (a best-only mark after a round with no checkpoint mark, for SaveBest).
    """
    finished = cursor.step >= schedule.total_steps
    epoch_end = cursor.position >= schedule.batches_per_epoch
    actions = []
    if schedule.has_val:
        if finished or (cursor.step % schedule.eval_every == 0 if schedule.eval_every else epoch_end):
            actions.append("eval")
    if finished:
        actions.append("final")
    elif schedule.checkpoint_every and cursor.step % schedule.checkpoint_every == 0:
        actions.append("checkpoint")
    elif schedule.snapshot_evals and "eval" in actions:
        actions.append("snapshot")
    return tuple(actions)


@dataclass(frozen=True)
class Read:
    """A batch to read: everything a Batch has but the data."""

    seq: int
    split: str
    step: int
    epoch: int
    position: int
    indices: np.ndarray
    last: bool = False


Job = Read | CheckpointMark


def jobs(
    start: Cursor, schedule: StepSchedule, train: Sampler, val: Sampler | None, test: Sampler | None = None
) -> Iterator[Job]:
    """The whole stream from ``start`` to the end of the run, as reads and marks (pure: no I/O).

    Args:
        start: where the run stands (a fresh run: Cursor()).
        schedule: the run's schedule.
        train: the training sampler.
        val: the validation sampler, when there is a validation split.
        test: the test sampler, when there is a test split: scored once, after the last training
            step (and its validation round), before the final mark.

    Yields:
        Reads and marks in stream order.
    """
    seq = 0

    def eval_round(sampler: Sampler | None, split: str, step: int, epoch: int) -> Iterator[Read]:
        nonlocal seq
        if sampler is None:
            return
        count = sampler.batches_per_epoch()
        for position, (_, indices) in enumerate(sampler.batches(SamplerState(0, 0))):
            yield Read(seq, split, step, epoch, position, indices, last=position == count - 1)
            seq += 1

    cursor = next_cursor(start, schedule)
    if cursor is None:  # resuming a finished run: report where it ended
        if schedule.has_val:
            yield from eval_round(val, "val", start.step, start.epoch)
        yield from eval_round(test, "test", start.step, start.epoch)
        yield CheckpointMark(start, final=True)
        return
    while cursor is not None:
        batches = train.batches(SamplerState(cursor.epoch, cursor.position))
        for state, indices in batches:
            yield Read(seq, "train", cursor.step, cursor.epoch, cursor.position, indices)
            seq += 1
            cursor = Cursor(cursor.step + 1, state.epoch, state.position)
            actions = after_step(cursor, schedule)
            if "eval" in actions:
                yield from eval_round(val, "val", cursor.step, cursor.epoch)
            if "final" in actions:
                yield from eval_round(test, "test", cursor.step, cursor.epoch)
            if "checkpoint" in actions or "final" in actions or "snapshot" in actions:
                yield CheckpointMark(cursor, final="final" in actions, best_only="snapshot" in actions)
            if "final" in actions:
                return
        cursor = next_cursor(cursor, schedule)


class _Pending:
    """A job's result, in flight; the consumer waits for them in stream order. A result that is
    ready when the job starts (a mark, an inline read) needs no event."""

    __slots__ = ("done", "item")

    def __init__(self, item: Batch | CheckpointMark | None = None) -> None:
        self.item = item
        self.done: trio.Event | None = trio.Event() if item is None else None

    def ready(self) -> bool:
        return self.done is None or self.done.is_set()

    def set(self, item: Batch | CheckpointMark) -> None:
        self.item = item
        if self.done is not None:
            self.done.set()


class Loader:
    """The loader actor (see the module docstring).

    Args:
        meter: its ports (no inbox; one outbox per downstream edge).
        source: an open source (loaders.Source); one with ``in_memory = True`` is read inline.
        jobs: the stream to produce (see :func:`jobs`).
        workers: reads in flight at once.
        inline: read on the event loop instead of in threads (deterministic tests; no threads).
        slots: the device's input slots (actors.device.InputSlots); when they have views, batches
            are read straight into them with ``source.read_into``.
        on_device: the dataset is kept on the device (the plan's DataPlan.resident): a batch is
            its sample indices only, which the device gathers; nothing is read here.
        prepare_epoch: computes an epoch's training order ahead (loaders.sampler.Sampler.prepare),
            called in a worker thread when the previous epoch begins: shuffled on the loop, the
            order stopped the loop ~1-2 ms at each epoch's start on the H100 host, longer than
            the steps queued on its GPU last.
    """

    def __init__(
        self,
        meter: Meter,
        source,
        jobs: Iterator[Job],
        workers: int = 1,
        inline: bool = False,
        slots: InputSlots | None = None,
        on_device: bool = False,
        prepare_epoch: Callable[[int], None] | None = None,
    ) -> None:
        self.meter = meter
        self.prepare_epoch = None if inline else prepare_epoch
        self._prepared_epoch = -1
        self.source = source
        # A source read by blocks (loaders.blocks) learns from the stream which window comes next.
        follow = getattr(source, "follow", None)
        self.jobs = follow(jobs) if callable(follow) else jobs
        self.workers = max(1, int(workers))
        self.inline = inline
        self.on_device = on_device
        # Indices cost nothing to "read", and an in-memory source's gather from RAM costs the loop
        # less than the hop and the GIL handoffs (reader threads lost on the H100 host though the
        # gather releases the GIL): never a thread for them (see the module docstring).
        pinned = inline or on_device or bool(getattr(source, "in_memory", False))
        forced = True if pinned else None
        self.offload = InlineOrThread(
            self.read, InlinePolicy(forced=forced), trio.CapacityLimiter(self.workers)
        )
        self.slots = slots if slots is not None and slots.in_place else None
        self.read_ahead = ReadAhead(MAX_CHUNK)
        self._returned = self._staged_at = time.perf_counter()

    def read(self, job: Read, slot: int = -1) -> Batch:
        """Read one batch (blocking).

        Args:
            job: what to read.
            slot: the device input slot to read it into, or -1 for arrays of its own.

        Returns:
            The batch.
        """
        if self.on_device:
            x = y = None
        elif slot < 0:
            x, y, _skipped = self.source.read(job.indices)
        else:
            x_slot, y_slot = self.slots.views[slot]
            rows, _skipped = self.source.read_into(job.indices, x_slot, y_slot)
            x, y = x_slot[:rows], y_slot[:rows]
        return Batch(
            seq=job.seq,
            epoch=job.epoch,
            position=job.position,
            indices=job.indices,
            x=x,
            y=y,
            split=job.split,
            step=job.step,
            last=job.last,
            slot=slot,
        )

    def _filled(self, batch: Batch) -> Batch:
        """A batch whose every sample was skipped holds no slot: give it back at once."""
        if batch.slot >= 0 and batch.rows == 0:
            self.slots.give(batch.slot)
            return replace(batch, slot=-1)
        return batch

    async def _read_into(self, job: Read, slot: int, pending: _Pending) -> None:
        with self.meter.busy():
            batch = await self.offload.run_in_thread(job, slot)
            pending.set(self._filled(batch))

    def _start(self, job: Job, slot: int, nursery: trio.Nursery) -> _Pending:
        """Begin a job: a mark is ready at once, a cheap read is done inline, others go to a thread."""
        if isinstance(job, CheckpointMark):
            return _Pending(job)
        if self.offload.inline():
            with self.meter.busy():
                pending = _Pending(self._filled(self.offload.run_inline(job, slot)))
            return pending
        pending = _Pending()
        nursery.start_soon(self._read_into, job, slot, pending)
        return pending

    async def _send(self, pending: _Pending) -> None:
        """Stage ``pending``'s batch (waiting for its read first) and send what is staged if the
        channel downstream has room, or the chunk is full; but hold it while the loop's turnaround
        says the next batch would be ready before the loop came back anyway (actors.read_ahead)."""
        meter = self.meter
        if pending.done is not None and not pending.done.is_set():
            await meter.flush()  # never hold ready batches while a read goes on
            await pending.done.wait()
        now = time.perf_counter()
        self.read_ahead.prepared(now - self._returned)
        if not meter.staged:
            self._staged_at = now
        await meter.stage(pending.item)
        if meter.room():
            if not self.read_ahead.hold(meter.staged, now - self._staged_at):
                await meter.flush()
                self.read_ahead.turned_around(time.perf_counter() - now)
        elif meter.staged >= MAX_CHUNK:
            await meter.flush()
        self._returned = time.perf_counter()

    async def _slot(self, window: deque[_Pending]) -> int:
        """A free device slot for the next read (-1 when batches are not read in place)."""
        if self.slots is None:
            return -1
        try:
            return self.slots.take_nowait()
        except trio.WouldBlock:
            pass
        # Every slot is held, by batches on their way to the device, staged, or by reads in the
        # window: send them all, or the device could never give a slot back.
        while window:
            await self._send(window.popleft())
        await self.meter.flush()
        with self.meter.blocked():
            return await self.slots.take()

    async def run(self) -> None:
        """Produce the whole stream, then close the outboxes.

        One task starts the jobs in order and sends their results in the same order: what is ready
        at the head of the window leaves at once, and once ``workers`` reads are in flight it waits
        for the oldest. So at most ``workers`` reads are in flight, and while a send waits for space
        downstream the reads behind it go on.
        """
        async with self.meter, trio.open_nursery() as nursery:
            window: deque[_Pending] = deque()
            for job in self.jobs:
                self._prepare_next_epoch(job, nursery)
                slot = await self._slot(window) if isinstance(job, Read) else -1
                window.append(self._start(job, slot, nursery))
                while window and (window[0].ready() or len(window) > self.workers):
                    await self._send(window.popleft())
            while window:
                await self._send(window.popleft())
            await self.meter.flush()

    def _prepare_next_epoch(self, job: Job, nursery: trio.Nursery) -> None:
        if self.prepare_epoch is None or not isinstance(job, Read) or job.split != "train":
            return
        if job.epoch + 1 > self._prepared_epoch:
            self._prepared_epoch = job.epoch + 1
            nursery.start_soon(trio.to_thread.run_sync, self.prepare_epoch, job.epoch + 1)

    def statistics(self) -> ActorStatistics:
        """The meter's counters, with the reads that went to worker threads.

        Returns:
            A frozen snapshot.
        """
        return replace(self.meter.statistics(), thread_items=self.offload.thread_items)

"""The loader actor: turns a source and a sampler into the run's stream of messages.

The loader is the one place that knows the run's schedule, so it emits all of it, in order:
training batches, an evaluation round (the whole validation split) where one is due, a
:class:`CheckpointMark` where a checkpoint is due, and a final mark at the end. Deciding what comes
next is pure (:class:`Schedule`, :func:`next_cursor`, :func:`after_step`, :func:`jobs`); the actor
only reads and sends. Because every actor keeps stream order, a mark reaches the device exactly
after the last training batch before it, which is what makes a snapshot there consistent without
draining or reordering anything.

Reads run in worker threads under the loader's own CapacityLimiter (``workers`` at once, so a
slow disk overlaps with the device); results leave in stream order whatever order they finish in.
A read measured to cost less than a hop to a thread (a gather from an in-memory source) runs on
the event loop instead (:class:`actors.statistics.InlinePolicy`).
A run resumes from a :class:`Cursor`: the sampler is stateless given (seed, epoch), so the loader
simply starts there.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import trio

from actors.messages import Batch, CheckpointMark, Cursor
from actors.statistics import InlinePolicy, Meter
from loaders import Sampler, SamplerState


@dataclass(frozen=True)
class Schedule:
    """What a training run does, in steps.

    Attributes:
        batches_per_epoch: training batches per epoch.
        total_steps: steps in the whole run.
        eval_every: evaluate every this many steps; None: at the end of each epoch.
        checkpoint_every: mark a checkpoint every this many steps; None: only at the end.
        has_val: whether there is a validation split to evaluate on.
    """

    batches_per_epoch: int
    total_steps: int
    eval_every: int | None = None
    checkpoint_every: int | None = None
    has_val: bool = False


def total_steps(epochs: int | None, steps: int | None, batches_per_epoch: int) -> int:
    """Steps in a run that stops at ``epochs`` or ``steps``, whichever comes first.

    Args:
        epochs: epochs to run, or None.
        steps: steps to run, or None.
        batches_per_epoch: training batches per epoch.

    Returns:
        The number of training steps.
    """
    limits = [s for s in (steps, None if epochs is None else epochs * batches_per_epoch) if s is not None]
    return min(limits) if limits else 0


def next_cursor(cursor: Cursor, schedule: Schedule) -> Cursor | None:
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


def after_step(cursor: Cursor, schedule: Schedule) -> tuple[str, ...]:
    """What follows a training step, in order.

    Args:
        cursor: the cursor after the step.
        schedule: the run's schedule.

    Returns:
        Some of "eval", "checkpoint" and "final" (the final mark replaces a checkpoint mark).
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


def jobs(start: Cursor, schedule: Schedule, train: Sampler, val: Sampler | None) -> Iterator[Job]:
    """The whole stream from ``start`` to the end of the run, as reads and marks (pure: no I/O).

    Args:
        start: where the run stands (a fresh run: Cursor()).
        schedule: the run's schedule.
        train: the training sampler.
        val: the validation sampler, when there is a validation split.

    Yields:
        Reads and marks in stream order.
    """
    seq = 0

    def eval_round(step: int, epoch: int) -> Iterator[Read]:
        nonlocal seq
        assert val is not None
        count = val.batches_per_epoch()
        for position, (_, indices) in enumerate(val.batches(SamplerState(0, 0))):
            yield Read(seq, "val", step, epoch, position, indices, last=position == count - 1)
            seq += 1

    cursor = next_cursor(start, schedule)
    if cursor is None:  # resuming a finished run: report where it ended
        if schedule.has_val and val is not None:
            yield from eval_round(start.step, start.epoch)
        yield CheckpointMark(start, final=True)
        return
    while cursor is not None:
        batches = train.batches(SamplerState(cursor.epoch, cursor.position))
        for state, indices in batches:
            yield Read(seq, "train", cursor.step, cursor.epoch, cursor.position, indices)
            seq += 1
            cursor = Cursor(cursor.step + 1, state.epoch, state.position)
            actions = after_step(cursor, schedule)
            if "eval" in actions and val is not None:
                yield from eval_round(cursor.step, cursor.epoch)
            if "checkpoint" in actions or "final" in actions:
                yield CheckpointMark(cursor, final="final" in actions)
            if "final" in actions:
                return
        cursor = next_cursor(cursor, schedule)


class _Pending:
    """A job's result, in flight; the consumer waits for them in stream order."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.item: Batch | CheckpointMark | None = None

    def set(self, item: Batch | CheckpointMark) -> None:
        self.item = item
        self.done.set()


class Loader:
    """The loader actor (see the module docstring).

    Args:
        meter: its ports (no inbox; one outbox per downstream edge).
        source: an open source (loaders.Source).
        jobs: the stream to produce (see :func:`jobs`).
        workers: reads in flight at once.
        inline: read on the event loop instead of in threads (deterministic tests; no threads).
    """

    def __init__(
        self, meter: Meter, source, jobs: Iterator[Job], workers: int = 1, inline: bool = False
    ) -> None:
        self.meter = meter
        self.source = source
        self.jobs = jobs
        self.workers = max(1, int(workers))
        self.inline = inline
        self.policy = InlinePolicy(forced=True if inline else None)
        self.limiter = trio.CapacityLimiter(self.workers)

    def read(self, job: Read) -> Batch:
        """Read one batch (blocking).

        Args:
            job: what to read.

        Returns:
            The batch.
        """
        x, y, _skipped = self.source.read(job.indices)
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
        )

    def _read_in_thread(self, job: Read) -> Batch:
        start = time.thread_time()
        batch = self.read(job)
        self.policy.note_thread(time.thread_time() - start)
        return batch

    async def _read_into(self, job: Read, pending: _Pending) -> None:
        with self.meter.busy():
            pending.set(await trio.to_thread.run_sync(self._read_in_thread, job, limiter=self.limiter))

    def _start(self, job: Job, nursery: trio.Nursery) -> _Pending:
        """Begin a job: a mark is ready at once, a cheap read is done inline, others go to a thread."""
        pending = _Pending()
        if isinstance(job, CheckpointMark):
            pending.set(job)
        elif self.policy.inline():
            with self.meter.busy():
                start = time.perf_counter()
                pending.set(self.read(job))
                self.policy.note_inline(time.perf_counter() - start)
        else:
            nursery.start_soon(self._read_into, job, pending)
        return pending

    async def _send(self, pending: _Pending) -> None:
        await pending.done.wait()
        await self.meter.send(pending.item)

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
                window.append(self._start(job, nursery))
                while window and (window[0].done.is_set() or len(window) > self.workers):
                    await self._send(window.popleft())
            while window:
                await self._send(window.popleft())

    def statistics(self):
        return self.meter.statistics()

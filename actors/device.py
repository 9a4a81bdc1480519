"""The device actor: owns an Engine and keeps up to K steps in flight on it.

K is the plan's slot count (``spec.run.in_flight``), which is also the capacity of the device's
inbox. Two tasks share the work so the queue never stalls on a result:

- the *feeder* takes each message from the inbox, writes a batch into a free slot and submits the
  slot's pre-recorded program (train, eval or predict; submitting never blocks), then hands the
  ticket to the completer. When every slot is busy it leaves the batch to the completer, which
  writes and submits it on the slot it frees the moment that slot's step is done, before it
  reports the step: trio runs ready tasks in random order, and the queue must not wait for the
  other actors' turns (with K = 2 on a fast GPU it would run dry);
- the *completer* waits for tickets in submission order, reads the small results (loss, correct
  count, or the predictions), frees the slot and reports downstream, in order. A fence wait
  blocks, and a hop to a worker thread costs ~50-100 µs, a third of a small step on a fast GPU.
  So while other actors have work for the event loop the completer polls (a check costs ~1 µs)
  between their turns, and it waits in a worker thread (under the device's own CapacityLimiter)
  only when the loop would otherwise sit idle.

A :class:`CheckpointMark` is a barrier: the feeder stops submitting until the completer has
reported everything before it and taken a :class:`Snapshot` of the weights, which are then exactly
those of the mark's cursor. Evaluation batches run the eval program on the same slots; the
completer sums their results and reports one :class:`EvalDone` per round.

The actor also remembers what it has submitted, so that after an interruption
:meth:`DeviceActor.snapshot_now` can wait for the device and take a consistent snapshot from
outside the (cancelled) run.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import trio
from trio.lowlevel import enable_ki_protection

from actors import optimiser as optim
from actors.engine import Engine
from actors.messages import Batch, CheckpointMark, Cursor, EvalDone, Prediction, Snapshot, StepDone
from actors.statistics import Meter
from flow.spec import CrossEntropy

_PROGRAMS = {"train": "train", "val": "eval", "predict": "predict"}


@dataclass
class _InFlight:
    slot: int
    ticket: int | None  # None: an empty batch, nothing submitted
    batch: Batch
    lr: float = 0.0


@dataclass
class _Handoff:
    """A batch the feeder holds while every slot is busy; the completer submits it."""

    batch: Batch
    done: trio.Event = field(default_factory=trio.Event)
    slot: int = -1
    ticket: int = 0


@dataclass
class _Barrier:
    mark: CheckpointMark
    done: trio.Event = field(default_factory=trio.Event)


@dataclass
class _Forward:
    message: object


@dataclass
class _EvalSums:
    loss: float = 0.0
    correct: float = 0.0
    rows: int = 0

    def add(self, loss: float, correct: float, rows: int) -> None:
        self.loss += loss * rows  # the program reports the batch mean
        self.correct += correct
        self.rows += rows


class DeviceActor:
    """The device actor (see the module docstring).

    Args:
        meter: its ports (inbox from preprocess; outboxes to the optimiser and the sink).
        engine: the engine, with weights already on the device.
        start: where the run stands (the first training step's cursor).
        inline: wait for the device on the event loop (a fake device: deterministic, no threads).
    """

    def __init__(
        self, meter: Meter, engine: Engine, start: Cursor | None = None, inline: bool = False
    ) -> None:
        self.meter = meter
        self.engine = engine
        self.optimiser = engine.plan.optimiser
        self.classifies = isinstance(engine.plan.model.loss, CrossEntropy)
        self.inline = inline
        self.limiter = trio.CapacityLimiter(1)  # fence waits get their own threads, never the shared pool's
        self.applied = start or Cursor()  # the cursor of the last training batch submitted
        self.outstanding: deque[int] = deque()  # tickets submitted and not yet waited for
        self._eval = _EvalSums()
        self._free: deque[int] = deque(range(engine.slots))  # slots with no step in flight
        self._handoff: _Handoff | None = None  # the batch waiting for a slot, if any

    # -- the feeder ------------------------------------------------------------------------------
    async def _feed(self, pending: trio.MemorySendChannel) -> None:
        async with pending:
            async for item in self.meter:
                if isinstance(item, Batch):
                    job = await self._submit(item)
                    try:
                        pending.send_nowait(job)  # usually room: it holds one job per slot
                    except trio.WouldBlock:
                        await pending.send(job)
                elif isinstance(item, CheckpointMark):
                    barrier = _Barrier(item)
                    await pending.send(barrier)
                    await barrier.done.wait()
                else:
                    await pending.send(_Forward(item))

    async def _submit(self, batch: Batch) -> _InFlight:
        if batch.rows == 0:  # every sample was skipped as bad: the step still counts, with no update
            if batch.split == "train":
                self.applied = batch.after()
            return _InFlight(-1, None, batch, math.nan)
        if self._free:
            slot = self._free.popleft()
            with self.meter.busy():
                ticket = self._submit_now(slot, batch)
        else:  # the completer submits it on the next slot it frees
            handoff = _Handoff(batch)
            self._handoff = handoff
            try:
                with self.meter.blocked():
                    await handoff.done.wait()
            finally:
                if self._handoff is handoff:  # cancelled before a slot came
                    self._handoff = None
            slot, ticket = handoff.slot, handoff.ticket
        kind = _PROGRAMS[batch.split]
        return _InFlight(
            slot, ticket, batch, optim.lr(self.optimiser, batch.step) if kind == "train" else 0.0
        )

    @enable_ki_protection
    def _submit_now(self, slot: int, batch: Batch) -> int:
        """Write, submit and record the submission as one step: a Ctrl-C cannot land between
        the submit and the bookkeeping (it waits for the next checkpoint), so an interrupted run's
        snapshot always knows every update the device has applied."""
        kind = _PROGRAMS[batch.split]
        rows = self.engine.write_batch(slot, batch.x, batch.y if kind != "predict" else None)
        ticket = self.engine.submit(kind, slot, rows, batch.step if kind == "train" else None)
        self.outstanding.append(ticket)
        if kind == "train":
            self.applied = batch.after()
        return ticket

    # -- the completer ---------------------------------------------------------------------------
    async def _wait(self, ticket: int) -> None:
        backend = self.engine.backend
        while not (self.inline or backend.is_done(ticket)):
            if trio.lowlevel.current_statistics().tasks_runnable == 0:
                await trio.to_thread.run_sync(backend.wait, ticket, limiter=self.limiter)
                break
            await trio.lowlevel.checkpoint()  # let the others run, then look again
        else:
            backend.wait(ticket)  # done: only the bookkeeping (a fence to release)
        if self.outstanding and self.outstanding[0] == ticket:
            self.outstanding.popleft()

    def _report(self, job: _InFlight):
        """The message for a finished job (None while an evaluation round is still summing)."""
        batch = job.batch
        empty = job.ticket is None
        if batch.split == "predict":
            return Prediction(batch.seq, batch.tag, batch.last, self.engine.outputs(job.slot, batch.rows))
        loss, correct = (math.nan, 0.0) if empty else self._result(job)
        if batch.split == "train":
            return StepDone(batch.step, batch.epoch, batch.position, loss, correct, batch.rows, job.lr)
        if not empty:
            self._eval.add(loss, correct, batch.rows)
        if not batch.last:
            return None
        sums, self._eval = self._eval, _EvalSums()
        rows = max(sums.rows, 1)
        accuracy = sums.correct / rows if self.classifies else math.nan
        return EvalDone(batch.step, batch.epoch, sums.loss / rows, accuracy, sums.rows)

    def _result(self, job: _InFlight) -> tuple[float, float]:
        result = self.engine.result(job.slot, job.batch.step, job.batch.rows)
        return result.loss, result.correct

    async def _snapshot(self, barrier: _Barrier) -> None:
        if self.inline:
            state = self.engine.state()
        else:
            state = await trio.to_thread.run_sync(self.engine.state, limiter=self.limiter)
        await self.meter.send(Snapshot(barrier.mark.cursor, state, final=barrier.mark.final))
        barrier.done.set()

    def _release(self, slot: int) -> None:
        """A slot's step is done and its results read: submit the waiting batch there, or free it."""
        handoff, self._handoff = self._handoff, None
        if handoff is None:
            self._free.append(slot)
            return
        handoff.slot, handoff.ticket = slot, self._submit_now(slot, handoff.batch)
        handoff.done.set()

    async def _complete(self, pending: trio.MemoryReceiveChannel) -> None:
        async with pending:
            async for job in pending:
                if isinstance(job, _Barrier):
                    await self._snapshot(job)
                    continue
                if isinstance(job, _Forward):
                    if job.message is not None:
                        await self.meter.send(job.message)
                    continue
                with self.meter.busy():  # waiting for the device counts: the device is working
                    if job.ticket is not None:
                        await self._wait(job.ticket)
                    message = self._report(job)  # reads the slot's results before it is reused
                    if job.ticket is not None:
                        self._release(job.slot)
                if message is not None:
                    await self.meter.send(message)

    async def run(self) -> None:
        """Run until the inbox ends and every submitted step is reported; then close the outboxes."""
        pending_send, pending_receive = trio.open_memory_channel(self.engine.slots)
        async with self.meter, trio.open_nursery() as nursery:
            nursery.start_soon(self._complete, pending_receive)
            await self._feed(pending_send)

    # -- outside the run -------------------------------------------------------------------------
    def snapshot_now(self) -> Snapshot:
        """Wait for everything submitted (blocking) and snapshot the weights: after an interruption,
        from outside the cancelled run.

        Returns:
            A snapshot consistent with the last training batch submitted.
        """
        while self.outstanding:
            self.engine.backend.wait(self.outstanding.popleft())
        return Snapshot(self.applied, self.engine.state(), interrupted=True)

    def statistics(self):
        return self.meter.statistics()


def predict_batches(engine: Engine, batches):
    """Synchronous streaming inference on an Engine, keeping up to K batches in flight (for
    ``flow.predict``, which runs outside trio).

    Args:
        engine: an engine with weights on the device.
        batches: an iterable of float32 arrays [rows <= batch_size, *input_shape].

    Yields:
        One output array per input batch, in order.
    """
    in_flight: deque[tuple[int, int, int]] = deque()
    free = list(range(engine.slots))
    for x in batches:
        if not free:
            slot, ticket, rows = in_flight.popleft()
            engine.backend.wait(ticket)
            yield engine.outputs(slot, rows)
            free.append(slot)
        slot = free.pop(0)
        rows = engine.write_batch(slot, np.asarray(x, dtype=np.float32))
        in_flight.append((slot, engine.submit("predict", slot, rows), rows))
    while in_flight:
        slot, ticket, rows = in_flight.popleft()
        engine.backend.wait(ticket)
        yield engine.outputs(slot, rows)

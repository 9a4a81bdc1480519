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
  between their turns. When the loop would otherwise sit idle it keeps polling for up to
  ``SPIN_S``, so a small step's end is seen at once and the next one submitted; only a longer wait
  goes to a worker thread (under the device's own CapacityLimiter). A device that is itself the
  CPU (lavapipe) needs the cores: there the completer never spins.

When the host falls behind the GPU, several steps are done by the time the completer looks and
several batches wait in the inbox. The completer then takes every finished step at once and frees
their slots together, and the batches that fit go to the device in one submission
(``Engine.submit_staged``: one ``vkQueueSubmit``, a ticket per step). So the host's cost per step
falls just when it matters (on an H100 host the submit path took 12-17 µs a step in groups of 4
against 17-23 one by one, and 4 steps submitted into an idle queue finished in 212 against 222 µs
a step), and when the host keeps up nothing waits for a group to fill.

Which slots are free is kept by :class:`InputSlots`. Where the backend maps the slots' memory and
the batches need no transform, the loader takes a free slot for each batch and reads the batch
straight into it (``Batch.slot``), and the feeder only submits: the batch is copied once, from
the source into device memory, instead of being gathered into a new array and copied again.

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
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import trio
from trio.lowlevel import ParkingLot, enable_ki_protection

from actors.engine import Engine
from actors.messages import Batch, CheckpointMark, Cursor, EvalDone, Prediction, Profile, Snapshot, StepDone
from actors.meter import MAX_CHUNK, Meter
from flow.metrics import finish, on_device, summed
from flow.optim import device_learning_rate
from flow.spec_model import CrossEntropy, Model

_PROGRAMS = {"train": "train", "val": "eval", "test": "eval", "predict": "predict"}

# The longest a device may take to finish one submission before the run stops with it named: a
# lost or hung GPU must end the run, not leave it waiting forever (VKFLOW_DEVICE_DEADLINE sets it;
# the first step of a large model compiles nothing, so minutes are ample).
DEVICE_DEADLINE_S = 600.0


class DeviceHung(RuntimeError):
    """A device did not finish a submission within its deadline."""


def wait_for_device(engine: Engine, ticket: int, deadline_s: float, member: int = 0) -> None:
    """Wait for ``ticket`` on ``engine``'s device (blocking), at most ``deadline_s``.

    Raises:
        DeviceHung: naming the device, when the deadline passes first.
    """
    try:
        engine.backend.wait(ticket, deadline_s)
    except TimeoutError as error:
        name = engine.backend.facts.name
        message = f"device {member} ({name}) did not finish its work within {deadline_s:g} s"
        raise DeviceHung(message) from error


# How long the completer polls an idle event loop before it waits in a thread. A hop to a thread
# and back costs ~50-100 µs, a quarter of a small step on a fast GPU, and with K = 2 the next
# submission waits for it; past 1 ms of waiting it is under a tenth of the wait.
SPIN_S = 1e-3


class InputSlots:
    """The device's K input slots: which are free, and where a batch can be filled in place.

    A slot is free when no step in flight uses it and its results have been read. Without
    ``views`` only the device takes free slots (it copies each batch in). With them, the one
    producer that fills batches in place takes a slot per batch (:meth:`take`) and the device gives
    it back once the step that used it is done (:meth:`give`); a batch is then never written into
    a slot the device is still running, and at most K batches are filled ahead of the device.

    Args:
        count: K.
        views: per slot, (x [batch_size, *input_shape], y flat) views of its memory; None when
            batches are not filled in place.
    """

    def __init__(self, count: int, views: Sequence[tuple[np.ndarray, np.ndarray]] | None = None) -> None:
        self.count = count
        self.views = list(views) if views is not None else None
        self._free: deque[int] = deque(range(count))
        self._waiting = ParkingLot()

    @property
    def in_place(self) -> bool:
        """Whether a producer fills batches straight into the slots."""
        return self.views is not None

    def take_nowait(self) -> int:
        """A free slot, now.

        Returns:
            The slot (it is the caller's until given back).

        Raises:
            trio.WouldBlock: every slot is in use (trio's convention for ``*_nowait``).
        """
        if not self._free:
            raise trio.WouldBlock
        return self._free.popleft()

    async def take(self) -> int:
        """A free slot, waiting for one if need be (only one task may wait at a time).

        Returns:
            The slot.
        """
        while not self._free:
            await self._waiting.park()
        return self._free.popleft()

    def give(self, slot: int) -> None:
        """Hand a slot back: it is free (its step is done and its results read, or it was never used).

        Args:
            slot: the slot.
        """
        self._free.append(slot)
        self._waiting.unpark()


class _InFlight:
    """A batch the feeder has submitted (or found empty), on its way to the completer."""

    __slots__ = ("slot", "ticket", "batch", "lr")

    def __init__(self, slot: int, ticket: int | None, batch: Batch, lr: float) -> None:
        self.slot = slot
        self.ticket = ticket  # None: an empty batch, nothing submitted
        self.batch = batch
        self.lr = lr


@dataclass
class _Handoff:
    """A batch the feeder holds while every slot is busy; the completer submits it, with the
    batches behind it that have a slot by then (``group``, ``tickets``)."""

    batch: Batch
    done: trio.Event = field(default_factory=trio.Event)
    group: list[tuple[int, Batch]] = field(default_factory=list)
    tickets: list[int] = field(default_factory=list)


@dataclass
class _Barrier:
    mark: CheckpointMark
    done: trio.Event = field(default_factory=trio.Event)


@dataclass
class _Forward:
    message: object


class EvalRound:
    """Sums an evaluation round's batches and reports the round at its last batch (the device
    actor's and the data-parallel actor's rounds alike).

    Args:
        classifies: the model counts correct answers (CrossEntropy); else accuracy is NaN.
        model: the model, whose metrics (flow.metrics) the round sums too; None: none.
    """

    def __init__(self, classifies: bool, model: Model | None = None) -> None:
        self.classifies, self.model = classifies, model
        self._loss, self._correct, self._rows = 0.0, 0.0, 0
        self._metrics = (0.0,) * len(on_device(model)) if model else ()

    def add(
        self, batch: Batch, loss: float, correct: float, rows: int, metrics: tuple[float, ...] = ()
    ) -> EvalDone | None:
        """Add a finished batch of ``rows`` real rows (0: nothing ran, every sample skipped) whose
        program reported the batch mean ``loss`` and the device's ``metrics`` values; the round's
        EvalDone at its last batch, else None."""
        if rows:
            self._loss += loss * rows  # the program reports the batch mean
            self._correct += correct
            self._rows += rows
            if metrics:
                added = summed(self.model, metrics, rows)
                self._metrics = tuple(t + a for t, a in zip(self._metrics, added, strict=True))
        if not batch.last:
            return None
        loss_sum, correct_sum, seen, sums = self._loss, self._correct, self._rows, self._metrics
        self._loss, self._correct, self._rows, self._metrics = 0.0, 0.0, 0, (0.0,) * len(sums)
        rows = max(seen, 1)
        accuracy = correct_sum / rows if self.classifies else math.nan
        values = finish(self.model, sums, seen, loss_sum / rows) if self.model else {}
        return EvalDone(batch.step, batch.epoch, loss_sum / rows, accuracy, seen, batch.split, values)


class DeviceActor:
    """The device actor (see the module docstring).

    Args:
        meter: its ports (inbox from preprocess; outboxes to the optimiser and the sink).
        engine: the engine, with weights already on the device.
        start: where the run stands (the first training step's cursor).
        inline: wait for the device on the event loop (a fake device: deterministic, no threads).
        slots: the engine's input slots, shared with a producer that fills them in place; None: the
            actor's own, and every batch is copied in.
        deadline_s: the longest a submission may take before the run stops (DeviceHung).
        profile: after the last step, send the train program's launch times (actors.messages.Profile;
            the engine times them once ``engine.profile()`` was called).
    """

    def __init__(
        self,
        meter: Meter,
        engine: Engine,
        start: Cursor | None = None,
        inline: bool = False,
        slots: InputSlots | None = None,
        deadline_s: float = DEVICE_DEADLINE_S,
        profile: bool = False,
    ) -> None:
        self.meter = meter
        self.engine = engine
        self.profile = profile
        self.deadline_s = deadline_s
        self.thread_waits = 0  # waits for a step that outlasted the spin and went to a thread
        self.optimiser = engine.plan.optimiser
        self._eval = EvalRound(isinstance(engine.plan.model.loss, CrossEntropy), engine.plan.model)
        self.inline = inline
        self.limiter = trio.CapacityLimiter(1)  # fence waits get their own threads, never the shared pool's
        self.applied = start or Cursor()  # the cursor of the last training batch submitted
        self.outstanding: deque[int] = deque()  # tickets submitted and not yet waited for
        self.slots = slots if slots is not None else InputSlots(engine.slots)
        self._handoff: _Handoff | None = None  # the batch waiting for a slot, if any
        self.spin_s = 0.0 if engine.backend.facts.kind == "cpu" else SPIN_S

    # -- the feeder ------------------------------------------------------------------------------
    async def _feed(self, pending: trio.MemorySendChannel) -> None:
        async with pending:
            async for item in self.meter:
                if isinstance(item, Batch):
                    for job in await self._submit(item):
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

    async def _submit(self, batch: Batch) -> list[_InFlight]:
        """Submit ``batch``, with any batches behind it that can go at once (:meth:`_gather`)."""
        if batch.rows == 0:  # every sample was skipped as bad: the step still counts, with no update
            if batch.split == "train":
                self.applied = batch.after()
            return [_InFlight(-1, None, batch, math.nan)]
        slot = batch.slot  # >= 0: filled in place, the slot is this batch's already
        if slot < 0:
            try:
                slot = self.slots.take_nowait()
            except trio.WouldBlock:
                slot = -1  # every slot is busy (waited for below, outside the handler)
        if slot >= 0:
            group = self._gather([(slot, batch)])
            with self.meter.busy():
                tickets = self._submit_now(group)
        else:  # the completer submits it on the next slot it frees
            handoff = _Handoff(batch)
            self._handoff = handoff
            try:
                with self.meter.blocked():
                    await handoff.done.wait()
            finally:
                if self._handoff is handoff:  # cancelled before a slot came
                    self._handoff = None
            group, tickets = handoff.group, handoff.tickets
        optimiser = self.optimiser
        return [
            _InFlight(slot, ticket, b, device_learning_rate(optimiser, b.step) if b.split == "train" else 0.0)
            for (slot, b), ticket in zip(group, tickets, strict=True)
        ]

    def _gather(self, group: list[tuple[int, Batch]]) -> list[tuple[int, Batch]]:
        """Add to ``group`` the batches already in the inbox that have a slot now (their own, or a
        free one), to submit them together: one ``vkQueueSubmit`` for all. Batches pile up while
        the host is behind the GPU, which is when a cheaper submission matters."""
        meter = self.meter
        while True:
            waiting = meter.peek()
            if type(waiting) is not Batch or waiting.rows == 0:
                return group
            slot = waiting.slot
            if slot < 0:
                try:
                    slot = self.slots.take_nowait()
                except trio.WouldBlock:
                    return group
            group.append((slot, meter.take()))

    @enable_ki_protection
    def _submit_now(self, group: list[tuple[int, Batch]]) -> list[int]:
        """Write each (slot, batch) of ``group`` (unless it was filled in place), submit them
        together and record the submission, as one step: a Ctrl-C cannot land between the submit
        and the bookkeeping (it waits for the next checkpoint), so an interrupted run's snapshot
        always knows every update the device has applied. Returns a ticket per batch."""
        engine, handles = self.engine, []
        for slot, batch in group:
            kind = _PROGRAMS[batch.split]
            step = batch.step if kind == "train" else None
            if batch.slot >= 0:  # filled in place
                handles.append(engine.stage_filled(kind, slot, batch.rows, step))
            elif batch.x is None:  # the dataset is on the device: its first launch gathers the rows
                handles.append(engine.stage_indices(kind, slot, batch.indices, step))
            else:
                rows = engine.write_batch(slot, batch.x, batch.y if kind != "predict" else None)
                handles.append(engine.stage(kind, slot, rows, step))
        tickets = engine.submit_staged(tuple(handles))
        self.outstanding.extend(tickets)
        for _, batch in group:
            if batch.split == "train":
                self.applied = batch.after()
        return tickets

    # -- the completer ---------------------------------------------------------------------------
    async def _wait(self, ticket: int) -> None:
        backend = self.engine.backend
        spin_until = None
        while not (self.inline or backend.is_done(ticket)):
            if trio.lowlevel.current_statistics().tasks_runnable == 0:
                now = time.perf_counter()
                if spin_until is None:
                    spin_until = now + self.spin_s
                if now >= spin_until:
                    self.thread_waits += 1
                    await trio.to_thread.run_sync(
                        wait_for_device, self.engine, ticket, self.deadline_s, limiter=self.limiter
                    )
                    break
            await trio.lowlevel.checkpoint()  # let the others run, then look again
        else:
            backend.wait(ticket)  # done: only the bookkeeping (a fence to release)
        self._forget(ticket)

    def _forget(self, ticket: int) -> None:
        """``ticket`` is done: snapshot_now need not wait for it any more."""
        if self.outstanding and self.outstanding[0] == ticket:
            self.outstanding.popleft()

    def _report(self, job: _InFlight):
        """The message for a finished job (None while an evaluation round is still summing)."""
        batch = job.batch
        empty = job.ticket is None
        if batch.split == "predict":
            return Prediction(batch.seq, batch.tag, batch.last, self.engine.outputs(job.slot, batch.rows))
        loss, correct = (math.nan, 0.0) if empty else self.engine.loss_and_correct(job.slot)
        metrics = () if empty else self.engine.metric_values(job.slot)
        if batch.split == "train":
            if not empty:
                self.engine.note_step(job.slot)  # profiling: the launch times, before the slot is reused
            rows, finished = batch.rows, time.monotonic()
            position, lr = batch.position, job.lr
            return StepDone(batch.step, batch.epoch, position, loss, correct, rows, lr, finished, metrics)
        return self._eval.add(batch, loss, correct, 0 if empty else batch.rows, metrics)

    async def _snapshot(self, barrier: _Barrier) -> None:
        if self.inline:
            state = self.engine.state()
        else:
            state = await trio.to_thread.run_sync(self.engine.state, limiter=self.limiter)
        mark = barrier.mark
        await self.meter.send(Snapshot(mark.cursor, state, mark.final, best_only=mark.best_only))
        barrier.done.set()

    def _release(self, slots: list[int]) -> None:
        """Steps are done on ``slots`` and their results read: submit the waiting batch, with
        the ones behind it that fit, on them, or free them."""
        for slot in slots:
            self.slots.give(slot)
        handoff, self._handoff = self._handoff, None
        if handoff is not None:
            handoff.group = self._gather([(self.slots.take_nowait(), handoff.batch)])
            handoff.tickets = self._submit_now(handoff.group)
            handoff.done.set()

    def _finished(self, job: object) -> bool:
        """Whether ``job`` is a step the device has finished already (a check, never a wait)."""
        if type(job) is not _InFlight or job.ticket is None or not self.engine.backend.is_done(job.ticket):
            return False
        self._forget(job.ticket)
        return True

    async def _complete(self, pending: trio.MemoryReceiveChannel) -> None:
        meter = self.meter
        taken: deque = deque()  # jobs received and not yet handled, in order
        async with pending:
            while True:
                if taken:
                    job = taken.popleft()
                else:
                    try:  # a job already waiting is taken without a schedule point
                        job = pending.receive_nowait()
                    except trio.WouldBlock:
                        # Nothing more in flight: the reports staged so far leave now. While steps
                        # are in flight they wait for the next ones (up to MAX_CHUNK): one hop for several.
                        await meter.flush()
                        try:
                            job = await pending.receive()
                        except trio.EndOfChannel:
                            return await self._send_profile()
                    except trio.EndOfChannel:
                        return await self._send_profile()
                if isinstance(job, _InFlight):
                    with meter.busy():  # waiting for the device counts: the device is working
                        jobs = [job]
                        if job.ticket is not None:
                            await self._wait(job.ticket)
                            # The steps behind it that are done too: their slots come free together,
                            # so the batches waiting for them go in one submission.
                            while True:
                                if not taken:
                                    try:
                                        taken.append(pending.receive_nowait())
                                    except (trio.WouldBlock, trio.EndOfChannel):
                                        break
                                if not self._finished(taken[0]):
                                    break
                                jobs.append(taken.popleft())
                        # Each slot's results are read before the slot is reused.
                        messages = [self._report(j) for j in jobs]
                        if job.ticket is not None:
                            self._release([j.slot for j in jobs])
                    for message in messages:
                        if message is not None:
                            await meter.stage(message)
                            if meter.staged >= MAX_CHUNK:
                                await meter.flush()
                elif isinstance(job, _Barrier):
                    await self._snapshot(job)
                elif job.message is not None:
                    await meter.send(job.message)

    async def _send_profile(self) -> None:
        """RunSettings(profile=True): the launch times, after the last step (actors.messages.Profile)."""
        if not self.profile:
            return
        launches = self.engine.launch_times()
        note = "" if self.engine.profiling else f"{self.engine.backend.facts.name} has no timestamp queries"
        await self.meter.send(Profile(launches, self.engine.profiled_steps, note))

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
        # thread_items: the steps whose end was waited for in a worker thread (past SPIN_S), each
        # a hop the next submission may wait behind.
        return replace(self.meter.statistics(), thread_items=self.thread_waits)


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

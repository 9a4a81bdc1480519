"""The device actor of a model split over devices as pipeline stages (flow.stage_plan decides the
split and the schedule; this runs them). It is the pipeline's one device node, so the stream the
sink sees stays one ordered stream, as under data parallelism.

Each batch is cut into the plan's micro-batches, and every stage is an actor of its own for the
batch: a trio task that owns its device and runs its part of the 1F1B order (StagePlan.schedule),
each device call in a worker thread of its own (its CapacityLimiter), so the stages' devices work
at once. Activations go forward and gradients come back through bounded channels, copied through
the host as the data-parallel all-reduce's gradients are; the backward channels are credit edges:
a stage runs no forward past its slots until a gradient comes back (the schedule says when it
waits for one), so the cycle cannot deadlock. Then every stage applies the batch's update, summed
over its micro-batches on the device. Evaluation runs the forwards only.

A stage that fails stops the batch: its error names the stage and its device, trio cancels the
others (a device call in a thread is waited for, at most its deadline), and the run ends with
that error; checkpoints written before stay as they were. Every batch is applied on every stage
or on none, so a snapshot (the stages' states merged into the whole model's) is exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import trio

from actors.device import _PROGRAMS, DEVICE_DEADLINE_S, EvalRound, wait_for_device
from actors.engine import Engine
from actors.messages import Batch, CheckpointMark, Cursor, Prediction, Snapshot, StepDone
from actors.meter import Meter
from actors.statistics import ActorStatistics
from flow.optim import device_learning_rate
from flow.spec_model import CrossEntropy
from flow.stage_plan import StagePlan, merge_state


class StageFailed(RuntimeError):
    """A stage's device failed; the message names the stage and its device."""


class _Micro:
    """What the last stage reports of one micro-batch."""

    __slots__ = ("loss", "correct", "metrics", "outputs")

    def __init__(self, loss=0.0, correct=0.0, metrics=(), outputs=None) -> None:
        self.loss, self.correct, self.metrics, self.outputs = loss, correct, metrics, outputs


class StagedActor:
    """The device actor over a model's stages (see the module docstring).

    Args:
        meter: its ports (inbox from preprocess; outboxes to the optimiser and the sink).
        engines: one engine per stage, in order, weights on their devices.
        stages: the plan's split and schedule.
        start: where the run stands (the first training step's cursor).
        inline: run device calls on the event loop (thread-free fake devices).
        deadline_s: the longest one device call may take before the run stops, naming the device.
    """

    def __init__(
        self,
        meter: Meter,
        engines: Sequence[Engine],
        stages: StagePlan,
        start: Cursor | None = None,
        inline: bool = False,
        deadline_s: float = DEVICE_DEADLINE_S,
    ) -> None:
        self.meter = meter
        self.engines = list(engines)
        self.stages = stages
        self.inline = inline
        self.deadline_s = deadline_s
        self.optimiser = engines[0].plan.optimiser
        model = engines[-1].plan.model  # the last stage's: the loss and the metrics
        self._eval = EvalRound(isinstance(model.loss, CrossEntropy), model)
        self.limiters = [trio.CapacityLimiter(1) for _ in self.engines]
        self.applied = start or Cursor()
        self.stage_seconds = [0.0] * len(self.engines)  # each stage's device time

    async def run(self) -> None:
        """Run until the inbox ends; then close the outboxes."""
        async with self.meter:
            async for item in self.meter:
                if isinstance(item, Batch):
                    with self.meter.busy():
                        message = await self._batch(item)
                    if message is not None:
                        await self.meter.send(message)
                elif isinstance(item, CheckpointMark):
                    state = await self._call(0, self.state)
                    await self.meter.send(Snapshot(item.cursor, state, item.final, best_only=item.best_only))
                else:
                    await self.meter.send(item)

    async def _call(self, stage: int, fn, *args):
        """A blocking device call of ``stage`` (inline for thread-free fake devices); an error
        names the stage and its device."""
        started = time.perf_counter()
        try:
            if self.inline:
                return fn(*args)
            return await trio.to_thread.run_sync(fn, *args, limiter=self.limiters[stage])
        except Exception as error:
            name = self.engines[stage].backend.facts.name
            message = f"stage {stage} on device {stage} ({name}) failed: {type(error).__name__}: {error}"
            raise StageFailed(message) from error
        finally:
            self.stage_seconds[stage] += time.perf_counter() - started

    # -- one batch -------------------------------------------------------------------------------
    async def _batch(self, batch: Batch):
        kind = _PROGRAMS[batch.split]
        lr = device_learning_rate(self.optimiser, batch.step) if kind == "train" else 0.0
        rows = batch.rows
        if rows == 0:  # every sample was skipped as bad: the step counts, with no update
            return self._report(batch, math.nan, 0.0, lr, 0)
        micro = self.stages.split(rows)
        bounds = np.cumsum((0, *micro))
        results: list[_Micro] = [_Micro() for _ in micro]
        count = len(self.engines)
        forward = [trio.open_memory_channel(self.stages.slots[s]) for s in range(count - 1)]
        backward = [trio.open_memory_channel(self.stages.slots[s]) for s in range(count - 1)]
        orders = self.stages.schedule(kind, len(micro))
        step = batch.step if kind == "train" else None
        async with trio.open_nursery() as nursery:
            for s in range(count):
                ports = (
                    forward[s - 1][1] if s else None,
                    forward[s][0] if s < count - 1 else None,
                    backward[s][1] if s < count - 1 else None,
                    backward[s - 1][0] if s else None,
                )
                work = (kind, batch, bounds, step, rows, results)
                nursery.start_soon(self._stage, s, orders[s], ports, work, name=f"vkflow stage {s}")
        if kind == "train":
            with trio.CancelScope(shield=True):  # an interrupt waits: applied on every stage or none
                await self._apply(step)
                self.applied = batch.after()
        if kind == "predict":
            return Prediction(batch.seq, batch.tag, batch.last, np.concatenate([r.outputs for r in results]))
        loss = sum(r.loss for r in results)  # each micro-batch's share of the batch's mean
        correct = sum(r.correct for r in results)
        metrics = tuple(map(sum, zip(*(r.metrics for r in results), strict=True)))
        return self._report(batch, loss, correct, lr, rows, metrics)

    async def _stage(self, s: int, order, ports, work) -> None:
        """Stage ``s``'s part of one batch: its forwards and backwards in the schedule's order."""
        kind, batch, bounds, step, rows, results = work
        receive_x, send_x, receive_grad, send_grad = ports
        engine, last = self.engines[s], s == len(self.engines) - 1
        sends = s > 0 and self.stages.backward[s - 1]  # the stage before needs this one's dx
        for op, m in order:
            slot = m % engine.slots
            start, end = int(bounds[m]), int(bounds[m + 1])
            if op == "F":
                x = batch.x[start:end] if s == 0 else await receive_x.receive()
                y = batch.y[start:end] if last and batch.y is not None and kind != "predict" else None
                program = kind if last else ("forward" if kind == "train" else "eval")
                out = await self._call(s, self._forward, s, program, slot, x, y, step, rows, last and sends)
                if last:
                    results[m] = out[0]
                    if kind == "train" and sends:
                        await send_grad.send(out[1])
                else:
                    await send_x.send(out)
            elif not last and self.stages.backward[s]:
                dy = await receive_grad.receive()
                dx = await self._call(s, self._backward, s, slot, dy, step, end - start, rows, sends)
                if sends:
                    await send_grad.send(dx)

    def _forward(self, s: int, program: str, slot: int, x, y, step, divisor: int, read_dx: bool):
        """Blocking: one micro-batch's forward on stage ``s`` (the last stage's train program runs
        its loss and backward too); the output rows, or (the last stage) its results and dx."""
        engine = self.engines[s]
        rows = engine.write_batch(slot, x, y)
        ticket = engine.submit(program, slot, rows, step if program == "train" else None, divisor=divisor)
        wait_for_device(engine, ticket, self.deadline_s, s)
        if s < len(self.engines) - 1:
            return engine.outputs(slot, rows)
        if program == "predict":
            return _Micro(outputs=engine.outputs(slot, rows)), None
        loss, correct = engine.loss_and_correct(slot)
        dx = engine.backend.read("dx", slot)[:rows] if read_dx else None
        return _Micro(loss, correct, engine.metric_values(slot)), dx

    def _backward(self, s: int, slot: int, dy: np.ndarray, step: int, rows: int, divisor: int, read_dx: bool):
        """Blocking: one micro-batch's backward on stage ``s`` from its output's gradient ``dy``
        (padded with zero rows: padding rows add nothing to the weights' gradients)."""
        engine = self.engines[s]
        padded = np.zeros(engine.plan.layout.tensor("dy").shape, np.float32)
        padded[:rows] = dy
        engine.backend.write("dy", padded, slot)
        ticket = engine.submit("backward", slot, rows, step, divisor=divisor)
        wait_for_device(engine, ticket, self.deadline_s, s)
        return engine.backend.read("dx", slot)[:rows] if read_dx else None

    async def _apply(self, step: int) -> None:
        """Every stage's update from its summed gradients, on every device at once."""

        def apply(s: int) -> None:
            engine = self.engines[s]
            wait_for_device(engine, engine.submit("apply", 0, 1, step), self.deadline_s, s)

        async with trio.open_nursery() as nursery:
            for s in range(len(self.engines)):
                nursery.start_soon(self._call, s, apply, s)

    def _report(self, batch: Batch, loss: float, correct: float, lr: float, rows: int, metrics: tuple = ()):
        if batch.split == "train":
            if rows == 0:
                self.applied = batch.after()
            position, finished = batch.position, time.monotonic()
            return StepDone(batch.step, batch.epoch, position, loss, correct, rows, lr, finished, metrics)
        return self._eval.add(batch, loss, correct, rows, metrics)

    # -- the whole model -------------------------------------------------------------------------
    def state(self) -> dict[str, np.ndarray]:
        """The whole model's parameters and optimiser state, as one device's run would hold them."""
        return merge_state(self.stages, [engine.state() for engine in self.engines])

    def parameters(self) -> dict[str, np.ndarray]:
        """Every parameter of every stage, by name."""
        return {name: value for engine in self.engines for name, value in engine.parameters().items()}

    def snapshot_now(self) -> Snapshot:
        """After an interruption: every batch is applied on every stage or none, so the state is
        the last applied batch's."""
        return Snapshot(self.applied, self.state(), interrupted=True)

    def statistics(self) -> ActorStatistics:
        return self.meter.statistics()

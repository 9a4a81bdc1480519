"""The device actor of a model split over devices as pipeline stages (flow.stage_plan decides the
split and the schedule; this runs them). It is the pipeline's one device node, so the stream the
sink sees stays one ordered stream, as under data parallelism.

Every stage is a device actor of its own for the whole run (:class:`StageActor`): a trio task that
owns its device, with its own inbox (the batches' orders), its own report channel back, and its own
statistics (``stage<s>``: busy on its device, idle waiting for an order, an activation or a
gradient, blocked waiting for room in the next stage's channel). Each batch is cut into the plan's
micro-batches, and each stage runs its part of the 1F1B order (StagePlan.schedule), each device
call in a worker thread of its own (its CapacityLimiter), so the stages' devices work at once.
Activations go forward and gradients come back through bounded channels that live as long as the
stages, copied through the host as the data-parallel all-reduce's gradients are; the backward
channels are credit edges: a stage runs no forward past its slots until a gradient comes back (the
schedule says when it waits for one), so the cycle cannot deadlock. Every message a batch sends is
received within it, so the channels are empty between batches. Then the batch's update, summed
over its micro-batches on each device, is applied on every stage by the node itself, on each
stage's device lane (its limiter): shielded from cancellation, so it happens on every stage or on
none. Evaluation runs the forwards only.

Clipping by the global norm and loss scaling make the update one decision for the whole model:
every stage writes its partial sums of squares (its ``norm`` program), the host joins them in
stage order with the CPU backend's own kernels (so the rule is the device's), and writes the one
clip factor, skip flag and loss scale to every stage before its ``apply`` (see flow.stage_plan).
BatchNorm's running statistics over micro-batches are one device's too: each stage keeps every
training micro-batch's statistics (its ``batch_stats``) and moves the running ones by the whole
batch's before its ``apply``.

In an MPI job (``ranks``: actors.collective.Ranks) every rank runs the split over its part of
every global batch: the ranks first tell each other their rows (each micro-batch's loss averages
over the global batch's), then, before the update, each stage's summed gradient is read, summed
over the ranks in rank order (the last stage's with the step's loss and metric sums) and written
back, so every rank applies the same update; at every checkpoint the ranks compare a digest of
their trainable weights.

A stage that fails stops the run: its error names the stage and its device, trio cancels the
others (a device call in a thread is waited for, at most its deadline), and the run ends with
that error; checkpoints written before stay as they were. Every batch is applied on every stage
or on none, so a snapshot (the stages' states merged into the whole model's) is exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import trio

from actors import cpu_ops
from actors.collective import Ranks
from actors.device import _PROGRAMS, DEVICE_DEADLINE_S, EvalRound, wait_for_device
from actors.engine import Engine
from actors.messages import Batch, CheckpointMark, Cursor, Prediction, Snapshot, StepDone
from actors.meter import Meter
from actors.statistics import ActorStatistics
from flow.graph import optimised_floats
from flow.optim import CLIP_TENSORS, LOSS_SCALE, LOSS_SCALE_GROWTH, device_learning_rate
from flow.spec_model import CrossEntropy
from flow.stage_plan import StagePlan, deferred_running, merge_state


class StageFailed(RuntimeError):
    """A stage's device failed; the message names the stage and its device."""


@dataclass(frozen=True)
class StageStatistics(ActorStatistics):
    """The split's device node's ActorStatistics plus each stage's, in the data-parallel node's
    terms (actors.data_parallel.DataParallelStatistics), so progress and metrics show them alike.

    Attributes:
        members: each stage's device name.
        member_rows: rows each stage has run forward (every stage runs every row).
        member_seconds: each stage's busy time on its device.
        member_idle_seconds: each stage's time waiting for an order, an activation or a gradient.
        member_blocked_seconds: each stage's time waiting for room in the next stage's channel.
        member_samples_per_s: member_rows / member_seconds.
        step_seconds: the wall time of every batch, from its orders to its update.
        all_reduce_seconds: host time joining the stages' gradient norms (clip_norm, loss scale).
        all_reduce: "norm join" where the update joins the stages' norms, else "none".
    """

    members: tuple[str, ...] = ()
    member_rows: tuple[int, ...] = ()
    member_seconds: tuple[float, ...] = ()
    member_idle_seconds: tuple[float, ...] = ()
    member_blocked_seconds: tuple[float, ...] = ()
    member_samples_per_s: tuple[float, ...] = ()
    step_seconds: float = 0.0
    all_reduce_seconds: float = 0.0
    all_reduce: str = "none"


def join_norms(
    partials: Sequence[np.ndarray], clip_norm: float | None, scale: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """One update's decision for a model split into stages, from each stage's grad_norm partial
    sums of squares, joined in stage order as the CPU backend's join kernel joins one device's (in
    float64: a Vulkan device's join adds in float32, so at the edge of overflow it may skip a step
    that this one does not).

    Args:
        partials: each stage's ``clip:partials``, in stage order.
        clip_norm: the optimiser's clip_norm, or None.
        scale: the loss scale's state [scale, streak, skipped] (flow.optim.LOSS_SCALE), or None.

    Returns:
        (clip:norm = [norm, factor, skip] for every stage, the scale's next state or None).
    """
    joined = np.concatenate(partials).astype(np.float32)
    clip = np.zeros(dict(CLIP_TENSORS)["clip:norm"], np.float32)
    max_norm = math.inf if clip_norm is None else float(clip_norm)
    if scale is None:
        cpu_ops.grad_norm([joined, clip], {"n": joined.size, "parts": 0, "max_norm": max_norm})
        return clip, None
    state = np.array(scale, np.float32)
    params = {"n": joined.size, "max_norm": max_norm, "growth_interval": LOSS_SCALE_GROWTH}
    cpu_ops.loss_scale_update([joined, state, clip], params)
    return clip, state


class _Micro:
    """What the last stage reports of one micro-batch."""

    __slots__ = ("loss", "correct", "metrics", "outputs")

    def __init__(self, loss=0.0, correct=0.0, metrics=(), outputs=None) -> None:
        self.loss, self.correct, self.metrics, self.outputs = loss, correct, metrics, outputs


class _Work:
    """One batch's part for one stage: its ops in the schedule's order and what they need."""

    __slots__ = ("kind", "batch", "bounds", "step", "rows", "results", "order")

    def __init__(self, kind: str, batch: Batch, bounds, step, rows: int, results: list, order) -> None:
        self.kind, self.batch, self.bounds, self.step = kind, batch, bounds, step
        self.rows, self.results, self.order = rows, results, order


class StageActor:
    """One stage: a device actor for the whole run (see the module docstring). The node wires
    its activation and gradient channels (``x_in``, ``x_out``, ``grad_in``, ``grad_out``).

    Args:
        index: the stage's place in the split.
        engine: its device's engine.
        stages: the plan's split.
        inline: run device calls on the event loop (thread-free fake devices).
        deadline_s: the longest one device call may take before the run stops, naming the device.
    """

    def __init__(
        self, index: int, engine: Engine, stages: StagePlan, inline: bool, deadline_s: float
    ) -> None:
        self.index, self.engine, self.inline, self.deadline_s = index, engine, inline, deadline_s
        self.last = index == len(stages.members) - 1
        self.backward = not self.last and stages.backward[index]
        self.sends = index > 0 and stages.backward[index - 1]  # the stage before needs this one's dx
        self.orders, inbox = trio.open_memory_channel(1)
        reports, self.reports = trio.open_memory_channel(1)
        self.meter = Meter(f"stage{index}", inbox, (reports,))
        self.limiter = trio.CapacityLimiter(1)
        self.x_in = self.x_out = self.grad_in = self.grad_out = None
        self.rows = 0  # rows run forward
        self.norms = stages.norms[index] if stages.norms else ()
        self.batch_stats: list[tuple[int, dict[str, np.ndarray]]] = []  # this batch's micro-batches'

    async def run(self) -> None:
        """Run each batch's order until the node closes the inbox; report each done."""
        async with self.meter:
            async for work in self.meter:
                await self._work(work)
                await self.meter.send(self.index)

    async def call(self, fn, *args):
        """A blocking call on this stage's device (inline for thread-free fake devices), counted
        as its busy time; an error names the stage and its device."""
        with self.meter.busy():
            try:
                if self.inline:
                    return fn(*args)
                return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)
            except Exception as error:
                name, s = self.engine.backend.facts.name, self.index
                raise StageFailed(
                    f"stage {s} on device {s} ({name}) failed: {type(error).__name__}: {error}"
                ) from error

    async def _receive(self, channel):
        with self.meter.idle():
            return await channel.receive()

    async def _send(self, channel, item) -> None:
        with self.meter.blocked():
            await channel.send(item)

    async def _work(self, work: _Work) -> None:
        """This stage's part of one batch: its forwards and backwards in the schedule's order."""
        kind, batch, bounds, step, rows = work.kind, work.batch, work.bounds, work.step, work.rows
        s, last, sends = self.index, self.last, self.sends
        for op, m in work.order:
            slot = m % self.engine.slots
            start, end = int(bounds[m]), int(bounds[m + 1])
            if op == "F":
                x = batch.x[start:end] if s == 0 else await self._receive(self.x_in)
                y = batch.y[start:end] if last and batch.y is not None and kind != "predict" else None
                program = kind if last else ("forward" if kind == "train" else "eval")
                out = await self.call(self._forward, program, slot, x, y, step, rows, last and sends)
                self.rows += end - start
                if last:
                    work.results[m] = out[0]
                    if kind == "train" and sends:
                        await self._send(self.grad_out, out[1])
                else:
                    await self._send(self.x_out, out)
            elif self.backward:
                dy = await self._receive(self.grad_in)
                dx = await self.call(self._backward, slot, dy, step, end - start, rows, sends)
                if sends:
                    await self._send(self.grad_out, dx)

    def _forward(self, program: str, slot: int, x, y, step, divisor: int, read_dx: bool):
        """Blocking: one micro-batch's forward (the last stage's train program runs its loss and
        backward too); the output rows, or (the last stage) its results and dx."""
        engine = self.engine
        rows = engine.write_batch(slot, x, y)
        ticket = engine.submit(program, slot, rows, step if program == "train" else None, divisor=divisor)
        wait_for_device(engine, ticket, self.deadline_s, self.index)
        if self.norms and program in ("train", "forward"):
            stats = {n[0]: engine.backend.read(f"batch_stats:{n[0]}", slot) for n in self.norms}
            self.batch_stats.append((int(x.shape[0]), stats))
        if not self.last:
            return engine.outputs(slot, rows)
        if program == "predict":
            return _Micro(outputs=engine.outputs(slot, rows)), None
        loss, correct = engine.loss_and_correct(slot)
        dx = engine.backend.read("dx", slot)[:rows] if read_dx else None
        return _Micro(loss, correct, engine.metric_values(slot)), dx

    def _backward(self, slot: int, dy: np.ndarray, step: int, rows: int, divisor: int, read_dx: bool):
        """Blocking: one micro-batch's backward from its output's gradient ``dy`` (padded with zero
        rows: padding rows add nothing to the weights' gradients)."""
        engine = self.engine
        padded = np.zeros(engine.plan.layout.tensor("dy").shape, np.float32)
        padded[:rows] = dy
        engine.backend.write("dy", padded, slot)
        ticket = engine.submit("backward", slot, rows, step, divisor=divisor)
        wait_for_device(engine, ticket, self.deadline_s, self.index)
        return engine.backend.read("dx", slot)[:rows] if read_dx else None

    def norm(self) -> np.ndarray:
        """Blocking: this stage's grad_norm partial sums of squares of its summed gradients."""
        engine = self.engine
        wait_for_device(engine, engine.submit("norm", 0, 1), self.deadline_s, self.index)
        return engine.backend.read("clip:partials")

    def apply(self, step: int, clip: np.ndarray | None, scale: np.ndarray | None) -> None:
        """Blocking: this stage's update (with the whole model's clip values and loss scale)."""
        engine = self.engine
        if clip is not None:
            engine.backend.write("clip:norm", clip)
        if scale is not None:  # every stage keeps the one scale (the last one's loss reads it)
            engine.backend.write(LOSS_SCALE, scale)
        for norm in self.norms if self.batch_stats else ():
            names = (f"{norm[0]}.running_mean", f"{norm[0]}.running_var")
            running = tuple(engine.backend.read(name) for name in names)
            parts = [(rows, stats[norm[0]]) for rows, stats in self.batch_stats]
            for name, value in zip(names, deferred_running(running, parts, norm), strict=True):
                engine.backend.write(name, value)
        self.batch_stats.clear()
        wait_for_device(engine, engine.submit("apply", 0, 1, step), self.deadline_s, self.index)


class StagedActor:
    """The device node over a model's stages (see the module docstring).

    Args:
        meter: its ports (inbox from preprocess; outboxes to the optimiser and the sink).
        engines: one engine per stage, in order, weights on their devices.
        stages: the plan's split and schedule.
        start: where the run stands (the first training step's cursor).
        inline: run device calls on the event loop (thread-free fake devices).
        deadline_s: the longest one device call may take before the run stops, naming the device.
        ranks: the other ranks of an MPI job (None: this process trains alone).
    """

    def __init__(
        self,
        meter: Meter,
        engines: Sequence[Engine],
        stages: StagePlan,
        start: Cursor | None = None,
        inline: bool = False,
        deadline_s: float = DEVICE_DEADLINE_S,
        ranks: Ranks | None = None,
    ) -> None:
        self.meter, self.ranks = meter, ranks
        self.engines = list(engines)
        self.stages = stages
        self.optimiser = engines[0].plan.optimiser
        model = engines[-1].plan.model  # the last stage's: the loss and the metrics
        self._eval = EvalRound(isinstance(model.loss, CrossEntropy), model)
        self.applied = start or Cursor()
        self.actors = [StageActor(s, engine, stages, inline, deadline_s) for s, engine in enumerate(engines)]
        for s, (before, after) in enumerate(zip(self.actors, self.actors[1:], strict=False)):  # each cut
            before.x_out, after.x_in = trio.open_memory_channel(stages.slots[s])
            after.grad_out, before.grad_in = trio.open_memory_channel(stages.slots[s])
        self.step_s = 0.0  # every batch's wall time
        self.join_s = 0.0  # the host's joins of the stages' norms

    async def run(self) -> None:
        """Start the stages; run until the inbox ends; then end the stages and close the outboxes."""
        async with self.meter, trio.open_nursery() as nursery:
            for actor in self.actors:
                nursery.start_soon(actor.run, name=f"vkflow stage {actor.index}")
            async for item in self.meter:
                if isinstance(item, Batch):
                    with self.meter.busy():
                        message = await self._batch(item)
                    if message is not None:
                        await self.meter.send(message)
                elif isinstance(item, CheckpointMark):
                    states = [await actor.call(actor.engine.state) for actor in self.actors]
                    state = merge_state(self.stages, states)
                    if self.ranks is not None:  # BatchNorm's running statistics are each rank's
                        flat = state["params:all"]
                        trained = flat[: optimised_floats(self.engines[0].plan.model, flat.size)]
                        await trio.to_thread.run_sync(self.ranks.check_weights, trained, item.cursor.step)
                    await self.meter.send(Snapshot(item.cursor, state, item.final, best_only=item.best_only))
                else:
                    await self.meter.send(item)
            for actor in self.actors:
                await actor.orders.aclose()

    # -- one batch -------------------------------------------------------------------------------
    async def _batch(self, batch: Batch):
        kind = _PROGRAMS[batch.split]
        lr = device_learning_rate(self.optimiser, batch.step) if kind == "train" else 0.0
        rows = total = batch.rows
        if self.ranks is not None and kind != "predict":  # the global batch's rows
            what = f"the rows of {batch.split} batch {batch.seq}"
            total = sum(await trio.to_thread.run_sync(self.ranks.gather, rows, what))
        if total == 0:  # every sample was skipped as bad: the step counts, with no update
            return self._report(batch, math.nan, 0.0, lr, 0)
        started = time.perf_counter()
        micro = self.stages.split(rows)  # none on a rank without rows: it still sums and applies
        bounds = np.cumsum((0, *micro))
        results: list[_Micro] = [_Micro() for _ in micro]
        orders = self.stages.schedule(kind, len(micro))
        step = batch.step if kind == "train" else None
        for actor, order in zip(self.actors, orders, strict=True):
            await actor.orders.send(_Work(kind, batch, bounds, step, total, results, order))
        for actor in self.actors:  # each stage's report that its part is done
            await actor.reports.receive()
        if kind == "predict":
            self.step_s += time.perf_counter() - started
            return Prediction(batch.seq, batch.tag, batch.last, np.concatenate([r.outputs for r in results]))
        count = len(self.engines[-1].metric_tensors)
        sums = (  # each micro-batch's share of the global batch's mean
            sum(r.loss for r in results),
            sum(r.correct for r in results),
            *(sum(r.metrics[i] for r in results) for i in range(count)),
        )
        if kind == "train":
            with trio.CancelScope(shield=True):  # an interrupt waits: applied on every stage or none
                sums = await self._apply(step, sums)
                self.applied = batch.after()
        elif self.ranks is not None:
            what = f"the sums of {batch.split} batch {batch.seq}"
            nothing = np.empty(0, np.float32)
            _, sums = await trio.to_thread.run_sync(self.ranks.sum_in_rank_order, nothing, sums, what)
        self.step_s += time.perf_counter() - started
        return self._report(batch, sums[0], sums[1], lr, total, tuple(sums[2:]))

    async def _across_ranks(self, step: int, sums: tuple) -> tuple:
        """Each stage's summed gradient summed over the ranks in rank order, stage by stage (the
        last one's with the step's sums), written back before the update; the sums over the ranks."""
        grads = [await actor.call(actor.engine.backend.read, "acc:all") for actor in self.actors]
        ranks, last = self.ranks, len(grads) - 1

        def exchange() -> tuple:
            what = f"the gradients of step {step}"
            started = [ranks.start_sum(g, sums if s == last else (), f"{what}, stage {s}")
                       for s, g in enumerate(grads)]  # fmt: skip
            return [ranks.finish_sum(one) for one in started]

        summed = await trio.to_thread.run_sync(exchange)
        for actor, (total, _) in zip(self.actors, summed, strict=True):
            await actor.call(actor.engine.backend.write, "acc:all", total)
        return summed[-1][1]

    async def _apply(self, step: int, sums: tuple) -> tuple:
        """Every stage's update from its summed gradients (over the ranks first, in an MPI job),
        on every device at once (with the whole model's norm and loss scale joined on the host
        first, where the update needs them); the step's sums (over the ranks)."""
        if self.ranks is not None:
            sums = await self._across_ranks(step, sums)
        clip, scale = None, None
        if self.stages.global_norm:
            partials: list = [None] * len(self.actors)

            async def norm(actor: StageActor) -> None:
                partials[actor.index] = await actor.call(actor.norm)

            async with trio.open_nursery() as nursery:
                for actor in self.actors:
                    nursery.start_soon(norm, actor)
            last = self.actors[-1]
            scaled = last.engine.plan.loss_scale is not None
            state = await last.call(last.engine.backend.read, LOSS_SCALE) if scaled else None
            joined = time.perf_counter()
            clip, scale = join_norms(partials, self.optimiser.clip_norm, state)
            self.join_s += time.perf_counter() - joined
        async with trio.open_nursery() as nursery:
            for actor in self.actors:
                nursery.start_soon(actor.call, actor.apply, step, clip, scale)
        return sums

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

    def statistics(self) -> StageStatistics:
        """The node's statistics with each stage's (see :class:`StageStatistics`)."""
        stages = self.stage_statistics().values()
        busy = tuple(round(s.busy_seconds, 6) for s in stages)
        pairs = zip(self.actors, busy, strict=True)
        return StageStatistics(
            **self.meter.statistics().__dict__,
            members=tuple(actor.engine.backend.facts.name for actor in self.actors),
            member_rows=tuple(actor.rows for actor in self.actors),
            member_seconds=busy,
            member_idle_seconds=tuple(round(s.idle_seconds, 6) for s in stages),
            member_blocked_seconds=tuple(round(s.blocked_seconds, 6) for s in stages),
            member_samples_per_s=tuple(round(a.rows / b, 1) if b > 0 else 0.0 for a, b in pairs),
            step_seconds=round(self.step_s, 6),
            all_reduce_seconds=round(self.join_s, 6),
            all_reduce="norm join" if self.stages.global_norm else "none",
        )

    def stage_statistics(self) -> dict[str, ActorStatistics]:
        """Each stage actor's own statistics, by its name (``stage0``, ...)."""
        return {actor.meter.name: actor.meter.statistics() for actor in self.actors}

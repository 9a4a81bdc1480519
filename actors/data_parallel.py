"""The device actor of a data-parallel run: one actor drives every member device, so the stream
the sink sees stays one ordered stream (exact resume relies on its order).

Each training batch is split into the members' shards (flow.parallel_plan.DataParallelPlan.shard;
where every member keeps the dataset, a shard is its sample indices, which the member gathers)
and every member runs its train program, which stops at the gradients, with the loss averaged over
the global batch's rows, so the members' gradients add up to the global batch's. The gradients are
all-reduced through the host: read from every member, summed in member order (a fixed order, so a
run is reproducible bit for bit), and written back, through the pinned host arena where every
member can import it (actors.host_arena: each device's own copies, the sum in place); then the
update (each member's ``apply`` program, or the leader's, whose weights are copied to the others:
see flow.parallel_plan). The members run concurrently: every shard is submitted before any is waited for.

Through the arena the gradients are summed in buckets (flow.parallel_plan.grad_buckets): each
member's train program is submitted in parts, each followed by its bucket's copy to the arena, and
the host sums bucket k (and starts its exchange with the other ranks, on the MPI thread) while the
devices run the backward of bucket k+1; the numpy backend, which runs a part as it is submitted,
runs its part k+1 after the host has summed bucket k. The reported all-reduce time is the part the
backward does not hide: the host's work after the last bucket arrived, and any bucket summed after
the devices had already finished the next.

A step's device work is one blocking call, made in a worker thread (inline for thread-free fake
devices), so the event loop stays free for the loader and the sink; a cancelled run waits for the
call to finish, so a step is always applied on every member or on none. Evaluation batches are
sharded the same way and their sums reported once per round; predictions are joined in order.

In an MPI job (``ranks``: actors.collective.Ranks) each rank holds its part of every global batch.
Before a batch the ranks tell each other their rows, so each member's loss averages over the
global batch's, and a rank without rows still takes part; the members' gradients are summed in
the rank, then across the ranks in rank order, with the step's loss and correct rows; every rank
applies the update. Every ``check_every`` steps and at every checkpoint the ranks compare a digest
of their weights and stop, naming the ranks, at the first that differ.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import trio

from actors.backend import Backend, read_into
from actors.collective import Ranks
from actors.device import _PROGRAMS, DEVICE_DEADLINE_S, EvalRound, wait_for_device
from actors.engine import Engine
from actors.host_arena import HostArena
from actors.messages import Batch, CheckpointMark, Cursor, Prediction, Snapshot, StepDone
from actors.meter import Meter
from actors.statistics import ActorStatistics
from flow.graph import optimised_floats
from flow.optim import LOSS_SCALE, device_learning_rate
from flow.parallel_plan import DataParallelPlan, train_parts
from flow.spec_model import CrossEntropy

SLOT = 0  # one step at a time: the all-reduce joins the members at every step

logger = logging.getLogger("vkflow")


@dataclass(frozen=True)
class DataParallelStatistics(ActorStatistics):
    """ActorStatistics plus each member's share of the work and the all-reduce's time.

    Attributes:
        members: each member's device name.
        member_rows: rows each member has run (training, evaluation and prediction).
        member_seconds: each member's busy time: from its shard's submit until it was seen done,
            plus its updates.
        member_idle_seconds: each member's idle time: step_seconds less its busy time, spent
            waiting for the other members and the host.
        member_samples_per_s: member_rows / member_seconds.
        step_seconds: the wall time of every batch, from its first shard's write to its update.
        all_reduce_seconds: host time summing and redistributing gradients that the backward pass
            does not hide (updates excluded; see the module docstring).
        all_reduce: the all-reduce's path: "arena" (a pinned host arena every member copies
            into and out of) or "staging" (reads and writes through each backend).
    """

    members: tuple[str, ...] = ()
    member_rows: tuple[int, ...] = ()
    member_seconds: tuple[float, ...] = ()
    member_idle_seconds: tuple[float, ...] = ()
    member_samples_per_s: tuple[float, ...] = ()
    step_seconds: float = 0.0
    all_reduce_seconds: float = 0.0
    all_reduce: str = "staging"


def host_all_reduce(
    sources: Sequence[Backend],
    targets: Sequence[Backend],
    tensor: str = "grads:all",
    across: Callable[[np.ndarray], np.ndarray] | None = None,
    scratch: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> np.ndarray:
    """Sum ``tensor`` over ``sources`` in their order (a fixed order: the same bits every time) and
    write the sum into every target. Blocking.

    Args:
        sources: the backends whose tensors are summed (at least one).
        targets: the backends that receive the sum.
        tensor: the flat tensor (every member's layout places it alike).
        across: what turns this process's sum into the one to write (the sum over the ranks of an
            MPI job), or None.
        scratch: host arrays kept between calls (a caller's own dict, filled here), so a step reads
            into memory already touched; None: fresh arrays.

    Returns:
        The sum (a host array; with ``scratch``, overwritten by the next call).
    """
    if scratch is None:
        scratch = {}
    if tensor in scratch:
        total, part = scratch[tensor]
        read_into(sources[0], tensor, total)
    else:  # the first read makes the arrays kept from then on
        total = sources[0].read(tensor)
        part = np.empty_like(total)
        scratch[tensor] = (total, part)
    for backend in sources[1:]:
        read_into(backend, tensor, part)
        total += part
    if across is not None:
        total = across(total)
    for backend in targets:
        backend.write(tensor, total)
    return total


def measure_throughput(engines: Sequence[Engine], rows: Sequence[int], repeats: int = 3) -> tuple[float, ...]:
    """Each member's training throughput on its own (samples/s: the median of ``repeats`` timed
    train programs after one untimed), for shares that keep no member waiting on another. Blocking.
    The batch is random, the loss averaged over the rows; the program writes gradients and the
    slot's results, which every step overwrites, and BatchNorm's running statistics, which live
    with the weights: those are put back as they were, so the run starts from its own state.

    Args:
        engines: every member's engine, programs recorded for at least its ``rows``.
        rows: each member's rows to time (its programs' capacity: its share, or the global batch).
        repeats: timed runs per member.

    Returns:
        Samples per second per member.
    """
    speeds = []
    rng = np.random.default_rng(0)
    for engine, count in zip(engines, rows, strict=True):
        plan = engine.plan
        x = rng.standard_normal((count, *plan.model.input_shape)).astype(np.float32)
        y = np.zeros(plan.layout.tensor("y").shape, plan.layout.tensor("y").dtype)[:count]
        engine.write_batch(SLOT, x, y)
        kept = engine.weights()
        times = []
        for repeat in range(repeats + 1):
            started = time.perf_counter()
            engine.backend.wait(engine.submit("train", SLOT, count, 0))
            if repeat:
                times.append(time.perf_counter() - started)
        engine.set_weights(kept)
        speeds.append(count / float(np.median(times)))
    return tuple(speeds)


def measure_all_reduce(engines: Sequence[Engine], repeats: int = 5) -> float:
    """The host all-reduce's bytes/s over ``engines`` (the median of ``repeats`` timed
    :func:`host_all_reduce` of the gradients into every member, as a step does, after one untimed
    that makes the kept arrays), each member's gradients counted read and written once (the
    leader's update moves as much: its weights). Blocking; it writes only gradients, which the next
    train program overwrites."""
    backends = [engine.backend for engine in engines]
    scratch: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    times = []
    for repeat in range(repeats + 1):
        started = time.perf_counter()
        host_all_reduce(backends, backends, scratch=scratch)
        if repeat:
            times.append(time.perf_counter() - started)
    return 2 * len(engines) * scratch["grads:all"][0].nbytes / max(float(np.median(times)), 1e-9)


class DataParallelActor:
    """The device actor over several members (see the module docstring).

    Args:
        meter: its ports (inbox from preprocess; outboxes to the optimiser and the sink).
        engines: one engine per member, in the plan's order, with identical weights.
        parallel: the plan's split and update rule.
        start: where the run stands (the first training step's cursor).
        inline: run each step on the event loop (thread-free fake devices).
        ranks: the other ranks of an MPI job (None: this process trains alone).
        deadline_s: the longest a member's submission may take before the run stops (DeviceHung,
            naming the member).
    """

    def __init__(
        self,
        meter: Meter,
        engines: Sequence[Engine],
        parallel: DataParallelPlan,
        start: Cursor | None = None,
        inline: bool = False,
        ranks: Ranks | None = None,
        deadline_s: float = DEVICE_DEADLINE_S,
    ) -> None:
        self.meter = meter
        self.engines = list(engines)
        self.deadline_s = deadline_s
        self.parallel = parallel
        self.optimiser = engines[0].plan.optimiser
        self._eval = EvalRound(isinstance(engines[0].plan.model.loss, CrossEntropy), engines[0].plan.model)
        self.inline = inline and ranks is None  # a collective never waits on the event loop
        self.ranks = ranks
        self.limiter = trio.CapacityLimiter(1)
        self.applied = start or Cursor()  # the cursor of the last training batch applied
        self.reduce_s = 0.0  # host time spent summing and redistributing gradients
        self.member_rows = [0] * len(self.engines)
        self._scratch: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # the all-reduce's host arrays
        # The ranks compare the trainable weights: running statistics (BatchNorm) are each rank's
        # own, from its own shards, as under DDP without buffer broadcasts.
        self._trainable = optimised_floats(engines[0].plan.model, engines[0].plan.total_params)
        self.member_seconds = [0.0] * len(self.engines)  # busy: shards and updates
        self.step_s = 0.0  # wall time of every batch: each member is busy or idle through it
        self.buckets = parallel.buckets or ((0, engines[0].plan.total_params),)
        self.arena = self._arena() if parallel.all_reduce == "arena" else None
        # Each member's train program in a part per bucket (the arena path only: staging reads whole
        # tensors), and the tickets of the step in flight: one per bucket and member.
        programs = [(e.plan.program("train"), e.plan.layout) for e in engines if self.arena is not None]
        self.parts = [train_parts(program, layout, self.buckets) for program, layout in programs]
        self._tickets: dict[int, list[int | None]] = {}
        self._submitted = 0.0

    def _arena(self) -> HostArena | None:
        """The pinned host arena every member imports; None (the staging path, said in the log)
        where a device refuses the import."""
        nbytes = self.engines[0].plan.layout.tensor("grads:all").nbytes
        buckets = self.buckets if len(self.buckets) > 1 else ()
        try:
            return HostArena([engine.backend for engine in self.engines], nbytes, buckets=buckets)
        except Exception as error:  # a driver that lists the extension, yet refuses this import
            logger.warning("vkflow: no host arena (%s); the gradients go through staging", error)
            return None

    async def run(self) -> None:
        """Run until the inbox ends; then close the outboxes."""
        async with self.meter:
            async for item in self.meter:
                if isinstance(item, Batch):
                    with self.meter.busy():
                        message = await self._blocking(self.step, item)
                    if message is not None:
                        await self.meter.send(message)
                elif isinstance(item, CheckpointMark):
                    state = await self._blocking(self._checked_state, item.cursor.step)
                    await self.meter.send(Snapshot(item.cursor, state, item.final, best_only=item.best_only))
                else:
                    await self.meter.send(item)

    async def _blocking(self, fn, *args):
        if self.inline:
            return fn(*args)
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    def _checked_state(self, step: int) -> dict[str, np.ndarray]:
        """The leader's state for a checkpoint, once every rank's weights are seen to agree."""
        state = self.engines[0].state()
        if self.ranks is not None:
            self.ranks.check_weights(state["params:all"][: self._trainable], step)
        return state

    # -- one batch, blocking ---------------------------------------------------------------------
    def step(self, batch: Batch):
        """Run one batch on every member (blocking); the message to report, or None while an
        evaluation round is still summing."""
        started = time.perf_counter()
        try:
            return self._step(batch)
        finally:
            self.step_s += time.perf_counter() - started

    def _step(self, batch: Batch):
        kind = _PROGRAMS[batch.split]
        lr = device_learning_rate(self.optimiser, batch.step) if kind == "train" else 0.0
        rows = batch.rows
        if self.ranks is not None and kind != "predict":  # the global batch's rows
            rows = sum(self.ranks.gather(rows, f"the rows of {batch.split} batch {batch.seq}"))
        if rows == 0:  # every sample was skipped as bad: the step counts, with no update
            return self._report(batch, math.nan, 0.0, lr, 0)
        step = batch.step if kind == "train" else None
        ran = self._run_shards(kind, batch, step, rows)
        if kind == "predict":
            outputs = [self.engines[i].outputs(SLOT, rows) for i, rows in ran]
            return Prediction(batch.seq, batch.tag, batch.last, np.concatenate(outputs))
        if kind == "train":
            sums = self._all_reduce_and_update(ran, step)
            self.applied = batch.after()
            if self.ranks is not None and self.applied.step % self.ranks.world.check_every == 0:
                self.ranks.check_weights(self.engines[0].weights()[: self._trainable], self.applied.step)
        else:
            sums = self._member_sums(ran)
            if self.ranks is not None:
                what = f"the sums of {batch.split} batch {batch.seq}"
                _, sums = self.ranks.sum_in_rank_order(np.empty(0, np.float32), sums, what)
        return self._report(batch, *sums[:2], lr, rows, sums[2:])

    def _member_sums(self, ran: list[tuple[int, int]]) -> tuple[float, ...]:
        """The loss, correct rows and metrics of the members that ran (their programs done): each
        member's loss (and mean metric) is its share of the global mean."""
        sums = (0.0,) * (2 + len(self.engines[0].metric_tensors))
        for i, _ in ran:
            member = (*self.engines[i].loss_and_correct(SLOT), *self.engines[i].metric_values(SLOT))
            sums = tuple(s + m for s, m in zip(sums, member, strict=True))
        return sums

    def _run_shards(self, kind: str, batch: Batch, step: int | None, divisor: int) -> list[tuple[int, int]]:
        """Write each member's shard and submit them all; then wait for them all, except a train
        step through the arena, whose buckets the all-reduce waits for one by one; (member, rows)
        of those that had rows."""
        ran, tickets = [], []
        start = 0
        buckets = self.arena is not None and kind == "train"  # each member's gradients to the arena
        self._submitted = time.perf_counter()
        for i, rows in enumerate(self.parallel.shard(batch.rows)):
            if rows == 0:
                continue
            engine, end = self.engines[i], start + rows
            y = batch.y[start:end] if batch.y is not None and kind != "predict" else None
            if batch.x is None:  # the dataset is on every member: it gathers its shard by index
                engine.write_indices(SLOT, batch.indices[start:end])
            else:
                engine.write_batch(SLOT, batch.x[start:end], y)
            if buckets:
                self._tickets[i] = self._submit_train(i, rows, step, divisor)
            else:
                tickets.append(engine.submit(kind, SLOT, rows, step, divisor=divisor))
            ran.append((i, rows))
            start = end
        for i, rows in ran:
            self.member_rows[i] += rows
        for (i, _), ticket in zip(ran, tickets, strict=not buckets):
            wait_for_device(self.engines[i], ticket, self.deadline_s, i)
            self.member_seconds[i] += time.perf_counter() - self._submitted
        return ran

    def _submit_train(self, i: int, rows: int, step: int | None, divisor: int) -> list[int | None]:
        """Submit member ``i``'s train program, each part followed by its bucket's copy to the
        arena; a ticket per bucket, None for a bucket the numpy backend is yet to run
        (:meth:`_bucket_ready` runs it)."""
        engine, parts = self.engines[i], self.parts[i]
        if len(parts) == 1:
            ticket = engine.submit("train", SLOT, rows, step, divisor=divisor)
            return [self.arena.gather(i) or ticket]  # the copy runs after the program
        engine.set_step("train", SLOT, rows, step, divisor)
        if engine.backend.facts.is_numpy:  # it runs a part as it is submitted: later, bucket by bucket
            return [None] * len(parts)
        tickets = []
        for k, part in enumerate(parts):
            ticket = engine.submit_part(part, SLOT)
            tickets.append(self.arena.gather(i, k) or ticket)  # the copy runs after the part
        return tickets

    def _bucket_ready(self, ran: list[tuple[int, int]], k: int) -> None:
        """Bucket ``k`` of every member that ran in the arena: the numpy backend's part run and
        copied now, the others' copies waited for."""
        for i, _ in ran:
            ticket = self._tickets[i][k]
            if ticket is None:
                self.engines[i].submit_part(self.parts[i][k], SLOT)
                self.arena.gather(i, k)
            else:
                wait_for_device(self.engines[i], ticket, self.deadline_s, i)

    def _hidden(self, ran: list[tuple[int, int]], k: int) -> bool:
        """Whether some device is still running the backward of bucket ``k`` (the host's work
        before now was hidden behind it): never with a numpy member, which the host runs."""
        tickets = [(self.engines[i].backend, self._tickets[i][k]) for i, _ in ran]
        pending = [not backend.is_done(t) for backend, t in tickets if t is not None]
        return len(pending) == len(tickets) and any(pending)

    def _arena_sum(self, ran: list[tuple[int, int]], step: int | None) -> tuple[float, ...]:
        """Sum every bucket in the arena as the members finish it (then over the ranks, started on
        the MPI thread as each is summed); the step's sums over the ranks."""
        members, last = [i for i, _ in ran] or [0], len(self.buckets) - 1
        if not ran:  # a rank without rows of this batch: it adds nothing, yet takes part
            self.arena.regions[0].fill(0.0)
        exchanges, exposed, sums = [], 0.0, ()
        for k in range(len(self.buckets)):
            self._bucket_ready(ran, k)
            summing = time.perf_counter()
            if k == last:
                arrived, sums = summing, self._member_sums(ran)
                for i, _ in ran:
                    self.member_seconds[i] += summing - self._submitted
            total = self.arena.sum(members, bucket=k)
            if self.ranks is not None:
                what = f"the gradients of step {step} (bucket {k + 1} of {last + 1})"
                exchanges.append(self.ranks.start_sum(total, sums if k == last else (), what))
            if k < last and not self._hidden(ran, k + 1):
                exposed += time.perf_counter() - summing
        for k, exchange in enumerate(exchanges):
            total, sums = self.ranks.finish_sum(exchange)  # the last bucket's carries the step's sums
            np.copyto(self.arena.part(0, k), total)
        self.reduce_s += exposed + time.perf_counter() - arrived
        return sums

    def _staging_sum(self, ran: list[tuple[int, int]], step: int | None, targets: range) -> tuple[float, ...]:
        """Through each backend's reads and writes (every member done): the gradients summed in
        member order, then over the ranks bucket by bucket, as every rank exchanges them, and
        written into ``targets``; the step's sums over the ranks."""
        sums, members = self._member_sums(ran), [i for i, _ in ran]
        if not members:  # a rank without rows of this batch: it adds nothing, yet takes part
            leader = self.engines[0]
            leader.backend.write("grads:all", np.zeros(leader.plan.total_params, np.float32))
            members = [0]
        across, ranks, last = None, self.ranks, len(self.buckets) - 1
        if ranks is not None:

            def across(local: np.ndarray) -> np.ndarray:
                nonlocal sums
                started = [
                    ranks.start_sum(local[a:b], sums if k == last else (), f"the gradients of step {step} "
                                    f"(bucket {k + 1} of {last + 1})")
                    for k, (a, b) in enumerate(self.buckets)
                ]  # fmt: skip
                for (a, b), exchange in zip(self.buckets, started, strict=True):
                    local[a:b], sums = ranks.finish_sum(exchange)
                return local

        sources = [self.engines[i].backend for i in members]
        backends = [self.engines[i].backend for i in targets]
        host_all_reduce(sources, backends, across=across, scratch=self._scratch)
        return sums

    def _all_reduce_and_update(self, ran: list[tuple[int, int]], step: int | None) -> tuple[float, ...]:
        """Sum the gradients of the members that ran, in member order (then over the ranks, with
        the step's sums), and apply the update; the step's sums over the ranks."""
        targets = range(len(self.engines)) if self.parallel.update == "each" else range(1)
        if self.arena is not None:
            sums = self._arena_sum(ran, step)
            started = time.perf_counter()
            for i in targets:
                self.arena.scatter(i)  # the update, submitted next, runs after the copy
        else:
            started = time.perf_counter()
            sums = self._staging_sum(ran, step, targets)
        applying = time.perf_counter()
        self.reduce_s += applying - started
        tickets = [self.engines[i].submit("apply", SLOT, 1, step) for i in targets]
        for i, ticket in zip(targets, tickets, strict=True):
            wait_for_device(self.engines[i], ticket, self.deadline_s, i)
            self.member_seconds[i] += time.perf_counter() - applying
        if self.parallel.update == "leader":
            started = time.perf_counter()
            leader = self.engines[0]
            weights = leader.weights()
            # The members never run the update, so they take the leader's loss scale as well.
            scale = leader.backend.read(LOSS_SCALE) if leader.plan.loss_scale is not None else None
            # Mixed precision: the weights' float16 copies, converted once for every member.
            halves = weights.astype(np.float16) if leader.keeps_copies else None
            for engine in self.engines[1:]:
                engine.set_weights(weights, halves)
                if scale is not None:
                    engine.backend.write(LOSS_SCALE, scale)
            self.reduce_s += time.perf_counter() - started  # the weights' copy redistributes the sum
        return sums

    def _report(self, batch: Batch, loss: float, correct: float, lr: float, rows: int, metrics: tuple = ()):
        """The message for a batch of ``rows`` (over every rank; 0: every sample skipped)."""
        if batch.split == "train":
            if rows == 0:
                self.applied = batch.after()
            finished = time.monotonic()
            position = batch.position
            return StepDone(batch.step, batch.epoch, position, loss, correct, rows, lr, finished, metrics)
        return self._eval.add(batch, loss, correct, rows, metrics)

    # -- outside the run -------------------------------------------------------------------------
    def snapshot_now(self) -> Snapshot:
        """The leader's weights after an interruption (every step is applied on all members or
        none, so they are those of the last training batch applied).

        Returns:
            The snapshot.
        """
        return Snapshot(self.applied, self.engines[0].state(), interrupted=True)

    def statistics(self) -> DataParallelStatistics:
        base = self.meter.statistics()
        pairs = zip(self.member_rows, self.member_seconds, strict=True)
        speeds = tuple(rows / seconds if seconds > 0 else 0.0 for rows, seconds in pairs)
        return DataParallelStatistics(
            **base.__dict__,
            members=tuple(engine.backend.facts.name for engine in self.engines),
            member_rows=tuple(self.member_rows),
            member_seconds=tuple(round(s, 6) for s in self.member_seconds),
            member_idle_seconds=tuple(round(max(self.step_s - s, 0.0), 6) for s in self.member_seconds),
            member_samples_per_s=tuple(round(v, 1) for v in speeds),
            step_seconds=round(self.step_s, 6),
            all_reduce_seconds=self.reduce_s,
            all_reduce="arena" if self.arena is not None else "staging",
        )

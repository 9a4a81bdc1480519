"""The runtime of one pipeline: it opens what the plan names and wires the plan's actors with
bounded channels, guards each actor, and gathers what they did into a :class:`RunResult`.

:class:`Runtime` opens in an order that refuses every mistake before it costs: a training run first
claims its checkpoint directory and metrics file (actors.outputs: another run's, or a live run's,
are refused), then reads the source's header and the device's facts without opening a device,
plans, and only then opens the device and records every program before the first step. Shutdown is
structured: at the end of the data every actor drains its inbox and closes its outboxes, so the end
flows downstream (the loader's final mark makes the device snapshot, the sink writes the final
checkpoint). An actor that raises is recorded as an :class:`ActorError` naming it; after a
KeyboardInterrupt the device is drained and a checkpoint written (:meth:`Runtime.interrupted`); a
callback that stops the run (flow.callbacks) takes the same path, and the run ends with a result.
Sources and backends opened here are closed by :meth:`Runtime.close`, and the outputs' claims are
released last. flow.runner runs a Runtime in a nursery and turns what ends it into one error.

Started by an MPI launcher (``mpiexec -n N python -m flow run spec.json``, or ``flow.run`` in each
rank of an MPI job: flow.parallel_plan.world_from_env), a training run is one rank of a data-parallel
run: each rank runs this pipeline on its own devices over its part of every global batch, and the
ranks first agree on the spec and the step they start at (actors.collective). Only rank 0 claims
and writes the checkpoints, the metrics and the progress line. An error on any rank aborts the
whole job (MPI_Abort) once it is printed: the other ranks would otherwise wait at their next
collective until its deadline.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import trio

from actors import checkpoint as checkpoints
from actors import cpu_ops, device_select
from actors import optimiser as optim
from actors.backend import Backend
from actors.collective import Ranks, RanksError
from actors.data_parallel import DataParallelActor, measure_all_reduce, measure_throughput
from actors.device import DEVICE_DEADLINE_S, DeviceActor, InputSlots
from actors.engine import Engine
from actors.loader import Loader, jobs
from actors.messages import Cursor, EvalDone, InputStatistics, Profile, Snapshot
from actors.meter import HookList, Hooks, Meter
from actors.optimiser import OptimiserActor
from actors.outputs import Outputs, open_outputs
from actors.preprocess import Preprocess
from actors.progress import Progress
from actors.sink import Sink
from actors.stages import StagedActor
from actors.statistics import ActorStatistics
from flow.callbacks import Callback, from_records
from flow.codec import digest
from flow.data_plan import header_of
from flow.device_facts import DeviceFacts
from flow.optim import describe_optimiser
from flow.parallel_plan import World, world_from_env
from flow.pipeline_plan import ActorPlan
from flow.planning import Plan, plan
from flow.safetensors_io import read_weights
from flow.spec import Devices, RunSettings, Spec
from flow.stage_plan import fresh_state, stage_state
from flow.validation import check
from shaders import gemm_tuning

logger = logging.getLogger("vkflow")

Mode = Literal["train", "predict"]


class ActorError(RuntimeError):
    """An actor failed; the run was cancelled. The original exception is ``__cause__``.

    Attributes:
        actor: the pipeline node's name.
        error: the original exception.
        callback: the callback (flow.callbacks) that raised it, as "Class.method", or None.
    """

    def __init__(self, actor: str, error: BaseException, callback: str | None = None) -> None:
        where = f" in callback {callback}" if callback else ""
        super().__init__(f"actor {actor!r} failed{where}: {type(error).__name__}: {error}")
        self.actor = actor
        self.error = error
        self.callback = callback  # "Class.method" of the user callback that raised, if one did


@dataclass(frozen=True, eq=False)
class RunResult:
    """What a run did.

    Attributes:
        steps: training steps done (the run's step counter; a resumed run counts from 0).
        epochs: epochs completed.
        loss: the last training step's loss.
        accuracy: the last validation round's accuracy (None without a validation split or for
            regression).
        evals: every evaluation of this process (validation and test rounds), in order.
        checkpoint: the last checkpoint written, if any.
        metrics_file: the metrics file, if any.
        parameters: the final weights by parameter name.
        device: the device's name.
        device_choice: why ``Devices("auto")`` chose it (flow.device_choice); "" for other choices.
        seconds: wall time of this process's run, setup included.
        statistics: every actor's final statistics.
        resumed_from: the step the run resumed at (0 for a fresh run).
        test: the test split's score after the last step (None without a test split).
        skipped: distinct bad items the source left out under ``on_error="skip"`` in this process
            (a bad file met in every epoch counts once).
        skipped_examples: where the first few of them are (file, or file and row).
        inputs: the range of the first training batch after preprocessing (None when no
            preprocess node saw one), as the ``"inputs"`` metrics event records it.
        warnings: what looked wrong, in order (inputs constant or tiny, a loss at chance, a
            non-finite loss under ``on_nonfinite="continue"``), each also logged and in the file.
        stopped_early: why a callback stopped the run (None: it was not). ``steps`` and
            ``checkpoint`` are then the stop's checkpoint's (a few steps past the decision).
        stopped_at: the training steps done when the callback asked to stop (None: not stopped).
        metrics: the last validation round's metrics by name ("top5", "mae", "rmse", "perplexity";
            empty without a validation split or metrics); every round's are in ``evals[i].metrics``.
        profile: with ``RunSettings(profile=True)``, each training launch's median GPU time
            (actors.messages.Profile); None otherwise.
        setup: seconds each part of the setup took, before the first step: ``outputs`` (the spec
            checked, the checkpoint folder and metrics file claimed), ``source`` (the source opened:
            a .gz file decompressed, a folder listed), ``plan``, ``device`` (opened), ``programs``
            (weights set, every program recorded; a data-parallel run's members measured), ``data``
            (the dataset uploaded, where the plan keeps it on the device). The metrics file's
            ``"setup"`` line holds the same.
    """

    steps: int
    epochs: int
    loss: float | None
    accuracy: float | None
    evals: tuple[EvalDone, ...]
    checkpoint: str | None
    metrics_file: str | None
    parameters: dict[str, np.ndarray] = field(repr=False)
    device: str = ""
    device_choice: str = ""
    seconds: float = 0.0
    statistics: dict[str, ActorStatistics] = field(default_factory=dict, repr=False)
    resumed_from: int = 0
    test: EvalDone | None = None
    skipped: int = 0
    skipped_examples: tuple[str, ...] = ()
    inputs: InputStatistics | None = None
    warnings: tuple[str, ...] = ()
    stopped_early: str | None = None
    stopped_at: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    profile: Profile | None = None
    setup: dict[str, float] = field(default_factory=dict)


# -- effects ---------------------------------------------------------------------------------------


def selected_group(devices: Devices) -> tuple[DeviceFacts, ...]:
    """The facts of every device ``devices.select`` asks for, without opening any: one for "cpu",
    "auto" (flow.device_choice's rule; a one-line warning when there is no Vulkan), an index or a name;
    each listed one for a list; every Vulkan device and the CPU for "all".

    Args:
        devices: the spec's devices.

    Returns:
        The facts, in the spec's order (open each with actors.device_select.open_device).

    Raises:
        LookupError: a named Vulkan device that cannot be had.
    """
    return select_devices(devices).facts


def select_devices(devices: Devices) -> device_select.Selection:
    """:func:`selected_group` with the reason for an "auto" choice (logged: as a warning when it
    fell back to the CPU for want of Vulkan, else as information).

    Raises:
        LookupError: a named Vulkan device that cannot be had.
    """
    selection = device_select.select(devices.choices)
    if selection.warning:
        logger.warning("vkflow: %s", selection.warning.splitlines()[0])
    elif selection.reason:
        logger.info("vkflow: %s", selection.reason)
    return selection


def selected_facts(devices: Devices) -> DeviceFacts:
    """The facts of the one device a single-device job (prediction) uses: the first selected.

    Raises:
        LookupError: a named Vulkan device that cannot be had.
    """
    return selected_group(devices)[0]


def plan_on(
    spec: Spec, facts: DeviceFacts | tuple[DeviceFacts, ...], world: World | None = None, **options: Any
) -> Plan:
    """The run's plan on the device(s) with ``facts``, with each device's measured GEMM tiles (the
    tables are read here, the effect; the planner only chooses from them).

    Args:
        spec: the spec.
        facts: the device's facts, or every member's (data parallel).
        world: this process's MPI world; default: the launcher's environment's (so ``mpiexec -n 2
            python -m flow plan`` shows each rank's plan).
        **options: the rest of flow.planning.plan's keywords (header, mode, maps_inputs, budget).

    Returns:
        The plan.
    """
    world = world_from_env(os.environ) if world is None else world
    if isinstance(facts, tuple):
        tuning = tuple(gemm_tuning.load_table(f.name) for f in facts)
        return plan(spec, facts=facts, tuning=tuning, world=world, **options)
    return plan(spec, facts=facts, tuning=gemm_tuning.load_table(facts.name), world=world, **options)


def start_engine(
    run_plan: Plan,
    backend: Backend,
    state: dict[str, np.ndarray] | None = None,
    cursor: Cursor | None = None,
    member: int = 0,
) -> tuple[Engine, Cursor]:
    """Bring one of the plan's devices up: its memory, its weights (fresh, or ``state`` restored)
    and every program the plan's mode launches, recorded for every slot before the first step.

    Args:
        run_plan: the plan.
        backend: the opened device.
        state: a checkpoint's parameters and optimiser state, or None for fresh weights.
        cursor: the checkpoint's cursor, or None.
        member: which of the plan's devices (data parallel); 0 for a single device.

    Returns:
        (engine, the cursor the run starts at).
    """
    spec = run_plan.spec
    device = run_plan.devices[member]
    from_file = spec.model.init.from_file if state is None else None  # read before the device
    imported = read_weights(spec.model, from_file) if from_file is not None else {}
    engine = Engine(device, backend)
    split = run_plan.stages
    if split is not None:  # a stage takes its part of the whole model's state (flow.stage_plan)
        state = stage_state(split, member, state if state is not None else fresh_state(spec, split))
        own = {p.name for p in device.parameters}
        imported = {name: value for name, value in imported.items() if name in own}
    start = optim.start(engine, spec.model.init.scheme, spec.model.init.seed, state, cursor)
    for name, value in imported.items():  # fresh weights from the file instead of drawn ones
        backend.write(name, value)
    if imported:
        engine.refresh_copies()  # the update keeps them from here on
    kinds = (run_plan.mode,)  # predict, generate
    if run_plan.mode == "train":
        data = run_plan.data  # nothing to evaluate: no eval program to record for every slot
        evaluates = data is None or any(data.sampler(s) is not None for s in ("val", "test"))
        kinds = ("train", "eval") if evaluates else ("train",)
    if run_plan.mode == "train" and device.apply is not None:
        kinds += ("apply",)
    # RunSettings(profile=True) times a single device's train steps (actors.device.DeviceActor).
    alone = len(run_plan.devices) == 1 and split is None
    engine.profile(spec.run.profile and run_plan.mode == "train" and alone)
    if split is not None:
        kinds = split.kinds(member)
        backend.write("acc:all", np.zeros(device.total_params, np.float32))  # the gradients' sum
    engine.prepare(kinds)
    return engine, start


def open_backend(devices: Devices) -> Backend:
    """Open the backend ``devices.select`` asks for: "cpu", "auto" (flow.device_choice's rule; a
    one-line warning when there is no Vulkan), or a Vulkan device by index or name.

    Args:
        devices: the spec's devices.

    Returns:
        The backend; the caller closes it.

    Raises:
        LookupError: a named Vulkan device that cannot be had.
    """
    return device_select.open_device(selected_facts(devices), devices.memory_fraction)


def device_deadline() -> float:
    """The longest a device may take over one submission (``VKFLOW_DEVICE_DEADLINE`` seconds, else
    actors.device.DEVICE_DEADLINE_S) before the run stops with the device named."""
    return float(os.environ.get("VKFLOW_DEVICE_DEADLINE", DEVICE_DEADLINE_S))


class _Relay:
    """A node that forwards everything (broadcast nodes; the optimiser when predicting)."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter

    async def run(self) -> None:
        async with self.meter:
            async for item in self.meter:
                await self.meter.pass_on(item)

    def statistics(self) -> ActorStatistics:
        return self.meter.statistics()


def metrics_file_of(run: RunSettings) -> str | None:
    """Where a run writes its metrics: ``run.metrics_file``, else ``metrics.jsonl`` in the run's own
    folder (its ``checkpoint_dir``), else nowhere."""
    if run.metrics_file is not None or run.checkpoint_dir is None:
        return run.metrics_file
    return str(Path(run.checkpoint_dir) / "metrics.jsonl")


class Laps:
    """Seconds per part of a setup: each call adds the time since the previous one (or since the
    start) to the part it names, in ``into``."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.last = into, time.perf_counter()

    def __call__(self, part: str) -> None:
        now = time.perf_counter()
        self.into[part] = self.into.get(part, 0.0) + now - self.last
        self.last = now


class Runtime:
    """Everything a pipeline holds: the opened resources, the actors and their channels."""

    def __init__(
        self,
        spec: Spec,
        mode: Mode,
        saved: checkpoints.Checkpoint | None,
        backend: Backend | None,
        hooks: Sequence[Hooks],
        progress: Progress | None,
        callbacks: Sequence[Callback] = (),
    ) -> None:
        self.spec = spec
        self.metrics_file = metrics_file_of(spec.run)
        self.mode = mode
        self.saved = saved
        self.backend = backend
        self.owns_backend = backend is None
        self.device_choice = ""  # why "auto" chose the device, for the result
        self.members: list[Backend] = []  # a data-parallel run's other devices (opened here)
        self.member_engines: list[Engine] = []  # every member's engine, the first included
        self.hooks = HookList(hooks) if hooks else None
        self.progress = progress
        self.source = None
        self.engine: Engine | None = None
        self.slots: InputSlots | None = None
        self.actors: dict[str, Any] = {}
        self.device: DeviceActor | None = None
        self.sink: Sink | None = None
        self.feed: Meter | None = None
        self.results: trio.MemoryReceiveChannel | None = None
        self.channels: dict[tuple[str, str], tuple[Any, Any]] = {}
        self.failure: ActorError | None = None
        self.running = 0
        self.finished = trio.Event()
        self.started = time.monotonic()
        self.setup: dict[str, float] = {}  # seconds per part of open() (RunResult.setup)
        self.start_cursor = Cursor()
        self.plan: Plan | None = None
        self.inline = False
        # A resumed run is the same run: its checkpoints and metrics lines carry the saved id.
        self.run_id = saved.run if saved is not None else checkpoints.new_run_id()
        self.outputs: Outputs | None = None
        self.stored = None  # the source's whole data where the plan keeps it on the device
        self.measured: dict[str, Any] | None = None  # what a data-parallel run measured (Checkpoint.measured)
        # One rank of an MPI job (flow.parallel_plan.World); only training runs across ranks.
        self.world = world_from_env(os.environ) if mode == "train" else World()
        self.ranks: Ranks | None = None
        self.done = False  # the run finished and its result was taken
        # The spec's callback records (run.callbacks) first, then the Python ones given to flow.run.
        self.callbacks = (*(from_records(spec.run.callbacks) if mode == "train" else ()), *callbacks)
        self.stopped: tuple[int, str] | None = None  # (steps done, reason) once a callback stops the run
        self.stop_cursor: Cursor | None = None  # where the stop's snapshot stands
        self.stop_checkpoint: Path | None = None
        self.cancel_scope: trio.CancelScope | None = None

    @property
    def writes(self) -> bool:
        """Whether this process writes the run's outputs: rank 0 of an MPI job, or the only one."""
        return self.world.rank == 0

    async def _blocking(self, fn, *args):
        """Setup work that may take a while (device creation, recording, opening a source): in a
        thread so the caller's event loop keeps running, except for a thread-free fake device."""
        if self.inline:
            return fn(*args)
        return await trio.to_thread.run_sync(fn, *args)

    async def open(self) -> None:
        """Open what the plan says, in an order that refuses every mistake before it costs: the
        outputs (another run's checkpoints), then the source's header (opening a source reads no
        sample) and the device's facts (no device is opened), then the plan, which checks the
        pipeline, the data against the model and the memory budget all at once. Only then is the
        device opened and its programs recorded, every one of them before the first step."""
        spec = self.spec
        lap = Laps(self.setup)
        check(spec)  # a bad spec (arrays that do not fit, say) is named by its paths, before any effect
        header = None
        if self.mode == "train":
            # Another run's checkpoints or metrics, or a live run writing them: refused at once.
            start = self.saved.cursor.step if self.saved is not None else None
            if self.world.size > 1:  # first: from here on, a failure on this rank aborts them all
                self.ranks = await trio.to_thread.run_sync(Ranks, self.world)
            if self.writes:
                paths = (spec.run.checkpoint_dir, self.metrics_file)
                self.outputs = open_outputs(self.run_id, *paths, start)
            if self.ranks is not None:
                agreed = (digest(spec), start or 0)  # arrays by their bytes: a repr elides them
                what = "the spec (its digest) and the step they start at"
                await trio.to_thread.run_sync(self.ranks.agree, agreed, what)
            from loaders import open_source

            lap("outputs")
            self.source = await self._blocking(open_source, spec.data.source)
            header = header_of(self.source)
            lap("source")
        if self.backend is not None:
            facts = self.backend.facts
            maps_inputs = callable(getattr(self.backend, "write_into", None))
        else:
            selection = await trio.to_thread.run_sync(select_devices, spec.devices)
            self.device_choice, group = selection.reason, selection.facts
            facts = group if len(group) > 1 else group[0]
            maps_inputs = None  # as the plan assumes for the facts' kind
        self.plan = plan_on(spec, facts, self.world, header=header, mode=self.mode, maps_inputs=maps_inputs)
        if self.callbacks:  # before the device: a callback that cannot work refuses the run here
            splits = frozenset(s for s in ("val", "test") if self.plan.data.sampler(s) is not None)
            for callback in self.callbacks:
                callback.stop_reason = None  # a callback object may serve several runs
                callback.on_start(spec, splits)
        lap("plan")
        if self.backend is None:
            for member in facts if isinstance(facts, tuple) else (facts,):
                fraction = spec.devices.memory_fraction
                opened = await trio.to_thread.run_sync(device_select.open_device, member, fraction)
                if self.backend is None:
                    self.backend = opened
                else:  # kept as it opens, so a later member's failure still closes it
                    self.members.append(opened)
        lap("device")
        self.inline = all(getattr(b, "runs_inline", False) for b in (self.backend, *self.members))
        state, cursor = (self.saved.state, self.saved.cursor) if self.saved else (None, None)
        # Partial batches run the same programs (see flow.planning.DevicePlan), so every one the
        # run launches is recorded here, before the first step.
        await self._start_members(state, cursor)
        parallel = self.plan.parallel
        drop = spec.devices.drop_slow and len(self.member_engines) > 1
        if parallel is not None and self.mode == "train" and (parallel.basis == "to measure" or drop):
            # Unequal devices: each takes the share of the batch its throughput earns, and records
            # its programs again for just those rows (padding rows would cost a slow device as much).
            # With the all-reduce's bandwidth, members that cost more than they save are left out.
            speeds, bandwidth = await self._measure(parallel.capacity, drop)
            options = {"header": header, "mode": self.mode, "maps_inputs": maps_inputs}
            self.plan = plan_on(spec, facts, self.world, **options, speeds=speeds, bandwidth=bandwidth)
            choice = self.plan.member_choice
            if choice is not None and choice.left_out:
                await self._leave_out(choice.kept)
            if parallel.basis == "to measure" or (choice is not None and choice.left_out):
                await self._start_members(state, cursor)
            if choice is not None:  # the kept members' shares are in the plan
                logger.info("vkflow: %s", choice.sentence())
            else:
                rows = self.plan.parallel.rows
                logger.info("vkflow: data-parallel shares %s from %s samples/s", rows, speeds)
        lap("programs")
        resident = self.plan.data.resident if self.plan.data is not None else None
        if resident is not None:
            # Once, before the first step: every sample as stored, then batches travel as indices.
            self.stored = await self._blocking(self.source.stored)
            for engine in self.member_engines or [self.engine]:  # every data-parallel member keeps it
                await self._blocking(engine.upload_dataset, self.stored.x, self.stored.labels)
        lap("data")
        self._wire()

    async def _measure(self, capacity, drop: bool) -> tuple[tuple[float, ...], float | None]:
        """Each member's samples/s and (``drop``) the all-reduce's bandwidth: measured now, or, when
        resuming a run that asked for the same devices, what it measured (Checkpoint.measured), so
        that it plans the same members and rows and the resume stays exact."""
        saved = self.saved.measured if self.saved is not None else None
        if saved is not None and self.saved.spec.devices == self.spec.devices:
            speeds, bandwidth = tuple(saved["speeds"]), saved["bandwidth"]
            if len(speeds) == len(self.member_engines) and (bandwidth is not None or not drop):
                self.measured = saved
                return speeds, bandwidth
        speeds = await self._blocking(measure_throughput, self.member_engines, capacity)
        bandwidth = await self._blocking(measure_all_reduce, self.member_engines) if drop else None
        rate = None if bandwidth is None else float(bandwidth)  # plain floats: the checkpoint packs them
        self.measured = {"speeds": [float(v) for v in speeds], "bandwidth": rate}
        return speeds, bandwidth

    async def _leave_out(self, kept: tuple[int, ...]) -> None:
        """Close the members the plan leaves out; the first one kept is the run's device now."""
        opened = (self.backend, *self.members)
        for i, backend in enumerate(opened):
            if i not in kept:
                await trio.to_thread.run_sync(backend.close)
        self.backend, *self.members = (opened[i] for i in kept)
        self.inline = all(getattr(b, "runs_inline", False) for b in (self.backend, *self.members))

    async def _start_members(self, state, cursor) -> None:
        """Start every member's engine on the plan (replacing engines started before)."""
        self.member_engines = []
        for member, backend in enumerate((self.backend, *self.members)):
            started = await self._blocking(start_engine, self.plan, backend, state, cursor, member)
            self.member_engines.append(started[0])
        self.engine, self.start_cursor = self.member_engines[0], started[1]

    @property
    def total(self) -> int:
        """Training steps in the whole run (0 when predicting)."""
        return self.plan.data.schedule.total_steps if self.plan and self.plan.data else 0

    @property
    def per_epoch(self) -> int:
        """Training batches a epoch (1 when predicting)."""
        return self.plan.data.schedule.batches_per_epoch if self.plan and self.plan.data else 1

    def _wire(self) -> None:
        """Open the plan's channels and make its actors."""
        pipeline = self.plan.pipeline
        views = self.engine.input_views() if pipeline.in_place else None
        if pipeline.in_place and views is None:
            raise AssertionError("the plan reads batches in place, but the device maps no input slots")
        self.slots = InputSlots(self.engine.slots, views)
        for src, dst, capacity in pipeline.channels:
            self.channels[(src, dst)] = trio.open_memory_channel(capacity)
        for actor in pipeline.actors:
            inbox = self.channels[(actor.inbox, actor.name)][1] if actor.inbox else None
            outboxes = [self.channels[(actor.name, dst)][0] for dst in actor.outboxes]
            if actor.kind == "sink" and self.mode == "predict":
                send, self.results = trio.open_memory_channel(max(1, self.engine.slots))
                outboxes.append(send)
            meter = Meter(actor.name, inbox, outboxes, self.hooks)
            self.actors[actor.name] = self._actor(actor, meter)
        if self.hooks is not None:
            self.hooks.attach(dict(self.channels))

    def _host_rows(self, indices: np.ndarray) -> np.ndarray:
        """Rows of the resident dataset preprocessed on the host (for the first batch's input
        statistics): the CPU backend's gather_rows run on the train program's own gather launch,
        so they are what the device computes."""
        resident = self.plan.data.resident
        gather = self.plan.devices[0].program("train").launches[0]
        rows = len(indices)
        x = np.empty((rows, *resident.sample_shape), np.float32)
        labels = np.empty(rows, np.int32)
        arrays = [self.stored.x, self.stored.labels, np.asarray(indices, np.int32),
                  np.asarray(resident.affine, np.float32), x.reshape(-1), labels]  # fmt: skip
        cpu_ops.gather_rows(arrays, {**gather.param_dict, "rows": rows})
        return x

    def _actor(self, actor: ActorPlan, meter: Meter):
        spec = self.spec
        if actor.kind == "loader":
            if self.mode == "predict":
                self.feed = meter
                return None  # the caller feeds: PipelineHandle.feed
            self.source = self.plan.data.block_source(self.source)  # read ahead by blocks, where planned
            data = self.plan.data
            train = data.sampler("train")
            stream = jobs(self.start_cursor, data.schedule, train, data.sampler("val"), data.sampler("test"))
            return Loader(
                meter,
                self.source,
                stream,
                workers=actor.workers,
                inline=self.inline,
                slots=self.slots,
                on_device=self.stored is not None,
                prepare_epoch=train.prepare if train is not None else None,
            )
        if actor.kind == "preprocess":
            return Preprocess(
                meter,
                spec.data.preprocess,
                spec.data.augment,
                spec.data.seed,
                tuple(spec.model.input_shape),
                inline=self.inline,
                host_rows=self._host_rows if self.stored is not None else None,
            )
        if actor.kind == "device" and self.plan.stages is not None:
            engines, stages, start = self.member_engines, self.plan.stages, self.start_cursor
            deadline = device_deadline()
            self.device = StagedActor(meter, engines, stages, start, self.inline, deadline, self.ranks)
            return self.device
        if actor.kind == "device" and self.plan.parallel is not None:
            self.device = DataParallelActor(
                meter, self.member_engines, self.plan.parallel, self.start_cursor, self.inline, self.ranks,
                deadline_s=device_deadline(),
            )
            return self.device
        if actor.kind == "device":
            self.device = DeviceActor(
                meter, self.engine, self.start_cursor, inline=self.inline, slots=self.slots,
                deadline_s=device_deadline(), profile=self.mode == "train" and spec.run.profile,
            )
            return self.device
        if actor.kind == "optimiser" and self.mode == "train":
            return OptimiserActor(meter, spec.optimiser, self.start_cursor.step)
        if actor.kind == "sink":
            writes = self.mode == "train" and self.writes
            self.sink = Sink(
                meter,
                spec,
                self.total,
                self.start_cursor.step,
                self.statistics,
                describe_optimiser(spec.optimiser, self.engine.plan.state_names),
                spec.run.checkpoint_dir if writes else None,
                self.metrics_file if writes else None,
                self.progress if writes else Progress(enabled=False),
                keep=spec.run.keep_checkpoints,
                run=self.run_id,
                inline=self.inline,
                skipped=self.skipped if self.mode == "train" else None,
                callbacks=self.callbacks,
                stop=self.stop,
                measured=self.measured,
                setup=self.setup if self.mode == "train" else None,
            )
            return self.sink
        return _Relay(meter)

    def statistics(self) -> dict[str, ActorStatistics]:
        stats = {name: actor.statistics() for name, actor in self.actors.items() if actor is not None}
        if self.feed is not None:
            stats[self.feed.name] = self.feed.statistics()
        if isinstance(self.device, StagedActor):  # each stage is a device actor of its own
            stats.update(self.device.stage_statistics())
        return stats

    def start(self, nursery: trio.Nursery) -> None:
        self.cancel_scope = nursery.cancel_scope
        for name, actor in self.actors.items():
            if actor is not None:
                self.running += 1
                nursery.start_soon(self._guard, name, actor, name=f"vkflow actor {name}")
        if self.running == 0:
            self.finished.set()

    async def _guard(self, name: str, actor) -> None:
        try:
            await actor.run()
        except BaseException as error:
            real = _real_error(error)
            if real is None:
                raise
            failure = ActorError(name, real, getattr(actor, "failed_callback", None))
            if self.failure is None:
                self.failure = failure
            raise failure from real
        self.running -= 1
        if self.running == 0:
            self.finished.set()

    def stop(self, step: int, reason: str) -> None:
        """A callback asked the run to stop after ``step`` steps: cancel every actor, as an interrupt
        does; the runner then takes the interrupt's checkpoint (:meth:`finish_stopped`)."""
        self.stopped = (step, reason)
        self.cancel_scope.cancel()

    async def finish_stopped(self) -> None:
        """After a callback's stop: drain the device, snapshot and checkpoint as :meth:`interrupted`
        does (in a thread: it blocks), and tell the callbacks about the checkpoint."""
        if self.device is None:
            return
        # Drained even without a checkpoint directory: the result's weights must be settled.
        snapshot = await self._blocking(self.device.snapshot_now)
        self.stop_cursor = snapshot.cursor
        self.stop_checkpoint = await self._blocking(self._save_snapshot, snapshot)
        if self.stop_checkpoint is not None:
            for callback in self.callbacks:
                callback.on_checkpoint(str(self.stop_checkpoint), self.stop_cursor.step)

    def interrupted(self) -> Path | None:
        """After a KeyboardInterrupt: drain the device and write a checkpoint (blocking)."""
        directory = self.spec.run.checkpoint_dir
        if self.mode != "train" or self.device is None or directory is None or not self.writes:
            return None
        return self._save_snapshot(self.device.snapshot_now())

    def _save_snapshot(self, snapshot: Snapshot) -> Path | None:
        """Write an interrupted run's snapshot as a checkpoint, where this process writes them."""
        directory = self.spec.run.checkpoint_dir
        if self.mode != "train" or directory is None or not self.writes:
            return None
        describe = describe_optimiser(self.spec.optimiser, self.engine.plan.state_names)
        checkpoint = checkpoints.from_snapshot(self.spec, snapshot, describe, self.run_id, self.measured)
        return checkpoints.save(directory, checkpoint, self.spec.run.keep_checkpoints)

    def result(self) -> RunResult:
        sink = self.sink
        steps = self.start_cursor.step
        epochs = self.start_cursor.epoch
        # Stopped early: what the device had applied, as the stop's checkpoint holds.
        cursor = sink.final.cursor if sink is not None and sink.final is not None else self.stop_cursor
        if cursor is not None:
            steps = cursor.step
            epochs = cursor.epoch + (1 if cursor.position >= self.per_epoch else 0)
        elif sink is not None and sink.last_step is not None:
            steps, epochs = sink.last_step.step + 1, sink.last_step.epoch
        evals = tuple(sink.evals) if sink else ()
        checkpoint = self.stop_checkpoint or (sink.checkpoint if sink else None)
        vals = [e for e in evals if e.split == "val"]
        accuracy = vals[-1].accuracy if vals and math.isfinite(vals[-1].accuracy) else None
        test = next((e for e in reversed(evals) if e.split == "test"), None)
        skipped, examples = self.skipped()
        self.done = True
        return RunResult(
            steps=steps,
            epochs=epochs,
            loss=sink.last_step.loss if sink and sink.last_step else None,
            accuracy=accuracy,
            evals=evals,
            checkpoint=str(checkpoint) if checkpoint else None,
            metrics_file=self.metrics_file,
            parameters=(self.device if isinstance(self.device, StagedActor) else self.engine).parameters()
            if self.engine
            else {},
            device=" + ".join(b.facts.name for b in (self.backend, *self.members)) if self.backend else "",
            device_choice=self.device_choice,
            seconds=time.monotonic() - self.started,
            statistics=self.statistics(),
            resumed_from=self.start_cursor.step,
            test=test,
            skipped=skipped,
            skipped_examples=examples,
            inputs=sink.inputs if sink else None,
            warnings=tuple(sink.warnings) if sink else (),
            stopped_early=self.stopped[1] if self.stopped else None,
            stopped_at=self.stopped[0] if self.stopped else None,
            metrics=dict(vals[-1].metrics) if vals else {},
            profile=sink.profile if sink else None,
            setup=dict(self.setup),
        )

    def skipped(self) -> tuple[int, tuple[str, ...]]:
        """The source's distinct bad items so far and where the first few are."""
        # A source of a test's own making may keep no statistics, or none of these counters.
        statistics = getattr(self.source, "statistics", None)
        stats = statistics() if callable(statistics) else None
        return getattr(stats, "skipped_items", 0), tuple(getattr(stats, "skipped_examples", ()))

    def close(self) -> None:
        try:
            if self.ranks is not None and not self.done:
                self._stop_job()
            if self.source is not None:
                self.source.close()
                self.source = None
            if self.owns_backend and self.backend is not None:
                for backend in (self.backend, *self.members):
                    backend.close()
        finally:
            # Last: the interrupt's checkpoint is written under the lock. Always: a claim left
            # behind would refuse every later run of this process into these outputs.
            if self.outputs is not None:
                self.outputs.close()
                self.outputs = None


    def _stop_job(self) -> None:
        """This rank failed or was interrupted: unless every rank found the same error, say so and
        stop every rank (see the module docstring). The outputs' claims need no release: their
        locks die with the process."""
        error = self.failure or sys.exc_info()[1]  # close() runs in a finally: the error in flight
        cause = error.error if isinstance(error, ActorError) else error
        if isinstance(cause, RanksError) and cause.everywhere:
            return
        failure = f": {type(error).__name__}: {error}" if error is not None else ""
        self.ranks.abort(f"vkflow: rank {self.world.rank} of {self.world.size} stopped before the end"
                         f"{failure}; aborting the MPI job")  # fmt: skip


def error_leaves(error: BaseException) -> list[BaseException]:
    """The exceptions inside ``error``, exception groups flattened, in order."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in error_leaves(inner)]
    return [error]


def _real_error(error: BaseException) -> BaseException | None:
    """The exception an actor really failed with; None for cancellation and interrupts, which must
    propagate untouched."""
    leaves = [e for e in error_leaves(error) if not isinstance(e, trio.Cancelled)]
    if not leaves or any(isinstance(e, KeyboardInterrupt | SystemExit) for e in leaves):
        return None
    return leaves[0]

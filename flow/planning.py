"""The plan: everything about a run decided before any device work, as pure data.

``plan(spec, facts=..., header=...)`` is the whole run: the data's splits, batches and schedule
(flow.data_plan), the actors and channels (flow.pipeline_plan), and for each device the programs
(flow.autodiff) with every tensor placed in an arena, buffer reuse from lifetimes (an activation's
memory is reused once its last backward reader has run) and memory checked against its budget.
The runtime (flow.runtime) opens what the plan says and decides nothing.

Arenas: ``params``, ``grads`` and one per optimiser state share one offset per parameter, so the
optimiser is a single launch over the flat arenas; ``work`` holds activations and temporaries;
``io`` is per input slot and host-visible (batch, labels, step values, loss, predictions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import msgpack
import numpy as np

from flow.autodiff import build_graph
from flow.data_plan import DataPlan, ResidentData, SourceHeader, plan_data, resident_data
from flow.device_facts import DeviceFacts, memory_budget
from flow.errors import PlanError, Problem
from flow.generation import Sampling, sample_params
from flow.graph import (
    Graph,
    ParamDecl,
    TensorDecl,
    fused_bias_grads,
    label_shape,
    optimised_floats,
    param_offsets,
    parameters,
)
from flow.metrics import metric_name, on_device
from flow.optim import (
    CLIP_TENSORS,
    LOSS_SCALE,
    LOSS_SCALE_FLOATS,
    initial_loss_scale,
    optimiser_state_names,
    update_groups,
)
from flow.parallel_plan import (
    DataParallelPlan,
    MemberChoice,
    World,
    choose_members,
    grad_buckets,
    plan_data_parallel,
)
from flow.pipeline_plan import PipelinePlan, plan_pipeline
from flow.program import (
    ITEM_BYTES,
    STEP_VALUES,
    Arena,
    Launch,
    Layout,
    Program,
    Tensor,
    align_up,
    launch,
    with_barriers,
)
from flow.shapes import infer_shapes
from flow.spec import Spec
from flow.spec_model import Model
from flow.validation import check
from flow.weight_copies import copy_tensors, keeps_copies
from shaders.registry import op as op_def
from shaders.registry import resolve_program
from shaders.tiles import GemmTable

if TYPE_CHECKING:
    from flow.stage_plan import StagePlan

PROGRAM_KINDS = ("train", "eval", "predict")


@dataclass(frozen=True)
class Lifetime:
    name: str
    nbytes: int
    first: int
    last: int


@dataclass(frozen=True)
class MemoryReport:
    arenas: tuple[tuple[str, int], ...]  # (arena, bytes; per-slot arenas counted once per slot)
    work_peak: int  # the work arena with reuse
    work_naive: int  # what it would take with no reuse
    total: int
    budget: int | None

    def as_dict(self) -> dict:
        return {
            "arenas": dict(self.arenas),
            "work_peak": self.work_peak,
            "work_naive": self.work_naive,
            "total": self.total,
            "budget": self.budget,
        }


@dataclass(frozen=True)
class DevicePlan:
    """What one device holds and runs.

    ``programs`` holds every program the device will launch: one ``train``, ``eval`` and
    ``predict`` program for the full batch. A partial batch (the end of an epoch or a split, a
    batch with skipped samples, any row count to predict on) runs the same program: the engine
    writes its row count into the slot's step values, the loss kernels average over those rows,
    and the padding rows, whose inputs the engine zeroes, add nothing. So the set is known here,
    and recorded before the first step.
    """

    device: str
    model: Model
    optimiser: object
    batch_size: int
    slots: int
    layout: Layout
    parameters: tuple[ParamDecl, ...]
    total_params: int  # floats in the flat parameter arena, padding included
    state_names: tuple[str, ...]
    memory: MemoryReport
    stages: tuple[str, ...]
    programs: tuple[Program, ...]  # one per PROGRAM_KINDS, in that order
    precision: str = "float32"
    resident: ResidentData | None = None  # the dataset kept on this device, if any
    # A data-parallel member's update, apart from its train program (which then stops at the
    # gradients): it runs once the members' gradients are summed. None on a single device.
    apply: Program | None = None
    # A generation plan's program: the forward, then the next token drawn on the device.
    generate: Program | None = None
    # The loss scale a training run starts from (flow.optim.LOSS_SCALE); None: no loss scaling.
    loss_scale: float | None = None
    # A pipeline stage's own programs by name (flow.stage_plan): forward, backward, apply.
    stage_programs: tuple[Program, ...] = ()

    @property
    def kinds(self) -> tuple[str, ...]:
        """Every program kind this device runs."""
        extra = tuple(k for k in ("apply", "generate") if getattr(self, k) is not None)
        return PROGRAM_KINDS + extra + tuple(p.name for p in self.stage_programs)

    def program(self, kind: str) -> Program:
        """The ``train``, ``eval`` or ``predict`` program (for any row count up to the batch size),
        or a data-parallel member's ``apply``."""
        if kind in ("apply", "generate") and getattr(self, kind) is not None:
            return getattr(self, kind)
        for staged in self.stage_programs:
            if staged.name == kind:
                return staged
        if kind not in PROGRAM_KINDS:
            raise ValueError(f"program kind must be one of {PROGRAM_KINDS}, got {kind!r}")
        return self.programs[PROGRAM_KINDS.index(kind)]


@dataclass(frozen=True)
class Plan:
    """Everything about a run, decided before any device work: the single source of truth the
    runtime opens resources and starts actors from.

    Attributes:
        spec: the spec it was planned from.
        mode: "train" or "predict".
        devices: what each device holds and runs: tensors, memory, and every program it launches.
        pipeline: the actors, their channels and capacities, and whether batches are read in place.
        data: the splits, batches and schedule (None where the source was not opened: ``flow plan``
            without readable data, and prediction).
    """

    spec: Spec
    mode: str
    devices: tuple[DevicePlan, ...]
    pipeline: PipelinePlan
    data: DataPlan | None = None
    parallel: DataParallelPlan | None = None
    # Which of the spec's devices a data-parallel run keeps, and why (once they are measured): a
    # single one kept trains as a plain device, so ``parallel`` is then None.
    member_choice: MemberChoice | None = None
    # A model split over the devices as pipeline stages (flow.stage_plan): one device plan a stage.
    stages: StagePlan | None = None

    def as_dict(self) -> dict:
        """The plan as plain data (for JSON, msgpack and tables)."""
        return {
            "mode": self.mode,
            "data": self.data.as_dict() if self.data is not None else None,
            "pipeline": self.pipeline.as_dict(),
            "devices": [_device_dict(d) for d in self.devices],
            "parallel": self.parallel.as_dict() if self.parallel is not None else None,
            "member_choice": self.member_choice.as_dict() if self.member_choice is not None else None,
        } | ({"stages": self.stages.as_dict()} if self.stages is not None else {})

    def dumps(self) -> bytes:
        """Canonical msgpack bytes: the same spec always gives the same bytes."""
        return msgpack.packb(self.as_dict(), use_bin_type=True)


def _device_dict(device: DevicePlan) -> dict:
    return {
        "device": device.device,
        "batch_size": device.batch_size,
        "slots": device.slots,
        "stages": list(device.stages),
        "memory": device.memory.as_dict(),
        "arenas": [
            {"name": a.name, "bytes": a.nbytes, "per_slot": a.per_slot, "host_visible": a.host_visible}
            for a in device.layout.arenas
        ],
        "tensors": [
            {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": t.dtype,
                "arena": t.arena,
                "offset": t.offset,
                "bytes": t.nbytes,
            }
            for t in device.layout.tensors
        ],
        "programs": [
            {
                "name": p.name,
                "steps": [
                    {
                        "op": s.op,
                        "args": list(s.args),
                        "params": dict(s.params),
                        "constants": dict(s.constants),
                    }
                    if isinstance(s, Launch)
                    else "barrier"
                    for s in p.steps
                ],
            }
            for p in (*device.programs, *((device.apply,) if device.apply else ()), *device.stage_programs)
        ],
    }


def lifetimes(graph: Graph, role: str = "work") -> list[Lifetime]:
    """First and last group that touches each tensor of ``role`` (views count for their base).

    Args:
        graph: the program's groups.
        role: which tensors to track.

    Returns:
        One Lifetime per base tensor, in order of first use.
    """
    spans: dict[str, list[int]] = {}
    for index, group in enumerate(graph.groups):
        for item in group:
            for name in item.args:
                decl = graph.tensors.get(name)
                if decl is None:
                    continue
                base = graph.tensors.get(decl.view_of) if decl.view_of else decl
                if base is None or base.role != role:
                    continue
                span = spans.setdefault(base.name, [index, index])
                span[0], span[1] = min(span[0], index), max(span[1], index)
    result = []
    for name, (first, last) in spans.items():
        decl = graph.tensors[name]
        result.append(Lifetime(name, align_up(decl.size * ITEM_BYTES[decl.dtype]), first, last))
    return sorted(result, key=lambda life: (life.first, life.name))


def assign_offsets(lives: list[Lifetime]) -> tuple[dict[str, int], int]:
    """Place tensors so that two share bytes only when their lifetimes do not overlap.

    Greedy first fit in order of first use, largest first among equals; groups are separated by
    barriers, so a tensor may take memory whose last reader ran in an earlier group.

    Returns:
        (offset per tensor, peak bytes).
    """
    placed: list[tuple[int, int, Lifetime]] = []  # (offset, end, life)
    offsets: dict[str, int] = {}
    peak = 0
    for life in sorted(lives, key=lambda x: (x.first, -x.nbytes, x.name)):
        busy = sorted(
            (o, e) for o, e, other in placed if not (other.last < life.first or life.last < other.first)
        )
        offset = 0
        for start, end in busy:
            if offset + life.nbytes <= start:
                break
            offset = max(offset, end)
        offsets[life.name] = offset
        placed.append((offset, offset + life.nbytes, life))
        peak = max(peak, offset + life.nbytes)
    return offsets, peak


def _io_tensors(model: Model, batch: int) -> list[TensorDecl]:
    out_shape = infer_shapes(model)[-1] if model.layers else tuple(model.input_shape)
    y_shape, y_dtype = label_shape(model, batch)
    return [
        TensorDecl("x", (batch, *model.input_shape), "float32", "io"),
        TensorDecl("y", y_shape, y_dtype, "io"),
        TensorDecl("stepvals", (len(STEP_VALUES),), "float32", "io"),
        TensorDecl("loss", (1,), "float32", "io"),
        TensorDecl("correct", (1,), "float32", "io"),
        TensorDecl("output", (batch, *out_shape), "float32", "io"),
        *(TensorDecl(f"metric:{metric_name(m)}", (1,), "float32", "io") for m in on_device(model)),
    ]


def _dataset_tensors(resident: ResidentData) -> tuple[list[Tensor], int]:
    """The ``dataset`` arena's tensors (samples as stored, labels, the fused preprocessing) and
    its size."""
    decls = [
        ("data:x", (resident.samples, *resident.sample_shape), resident.dtype),
        ("data:y", (resident.samples,), "int32"),
        ("data:affine", (len(resident.affine),), "float32"),
    ]
    tensors, offset = [], 0
    for name, shape, dtype in decls:
        tensors.append(Tensor(name, shape, dtype, "dataset", offset))
        offset = align_up(offset + math.prod(shape) * ITEM_BYTES[dtype])
    return tensors, offset


def _gather_launch(resident: ResidentData, batch: int) -> Launch:
    """The launch that fills the slot's x and y from the resident dataset by the slot's indices."""
    row_elems = math.prod(resident.sample_shape)
    return launch(
        "gather_rows",
        ("data:x", "data:y", "idx", "data:affine", "x", "y"),
        rows=batch,
        row_elems=row_elems,
        channel_elems=row_elems // resident.channels,
        bytes=int(resident.dtype == "uint8"),
    )


def plan_device(
    spec: Spec,
    device: str,
    budget: int | None = None,
    features: tuple[str, ...] | None = None,
    facts: DeviceFacts | None = None,
    tuning: GemmTable | None = None,
    resident: ResidentData | None = None,
    *,
    batch: int | None = None,
    separate_update: bool = False,
    sampling: Sampling | None = None,
) -> DevicePlan:
    """Plan one device that runs the whole model (data parallel replicas get one each).

    Args:
        spec: a valid spec.
        device: the device it runs on (as the spec names it).
        budget: bytes available on that device; None skips the check.
        features: the device's features (DeviceFacts.features); None skips feature checks.
        facts: the device, for the launches' tiles (None: the defaults every device runs).
        tuning: the device's GEMM tuning table (shaders.gemm_tuning.load_table), or None.
        resident: the dataset to keep on the device (flow.data_plan.resident_data), or None: then
            a ``dataset`` arena holds it, each slot's io an ``idx`` of the batch's sample indices,
            and the train and eval programs start with the launch that gathers the batch.
        batch: the rows the programs are recorded for (None: the spec's batch size).
        separate_update: a data-parallel member: the train program stops at the gradients, and
            the update is the ``apply`` program.
        sampling: generation: the ``generate`` program draws a token from the logits at position
            ``cursor[0]`` (io [position, step]) into io ``token`` (flow.generation).

    Returns:
        The device plan.

    Raises:
        PlanError: a model that cannot be trained as specified, or one over the budget.
    """
    model = spec.model
    batch = spec.data.batch_size if batch is None else batch
    slots = max(1, spec.run.in_flight)
    params = parameters(model)

    # Parameters, gradients and optimiser state: one offset per parameter in each arena.
    tensors: list[Tensor] = []
    floats, total_params = param_offsets(params)
    param_bytes = total_params * 4
    offset_of = {name: at * 4 for name, at in floats.items()}  # in bytes
    state_names = optimiser_state_names(spec.optimiser)
    for p in params:
        tensors.append(Tensor(p.name, p.shape, "float32", "params", offset_of[p.name]))
        if p.trainable:  # running statistics have no gradient
            tensors.append(Tensor(f"grad:{p.name}", p.shape, "float32", "grads", offset_of[p.name]))
    # [dW; db] views for the dense layers whose backward writes both in one GEMM.
    for view, (weight, shape) in fused_bias_grads(model).items():
        tensors.append(Tensor(view, shape, "float32", "grads", offset_of[weight]))
    tensors.append(Tensor("params:all", (total_params,), "float32", "params", 0))
    tensors.append(Tensor("grads:all", (total_params,), "float32", "grads", 0))
    for state in state_names:
        tensors.append(Tensor(f"state:{state}", (total_params,), "float32", f"state:{state}", 0))
    # Clipping by global norm and loss scaling: the partial sums, [norm, factor, skip] and the
    # scale's state (flow.optim).
    loss_scale = initial_loss_scale(spec.run.loss_scale, spec.run.precision)
    clip_bytes = 0
    clipping = CLIP_TENSORS if spec.optimiser.clip_norm is not None or loss_scale is not None else ()
    for name, floats in (*clipping, *(((LOSS_SCALE, LOSS_SCALE_FLOATS),) if loss_scale else ())):
        tensors.append(Tensor(name, (floats,), "float32", "clip", clip_bytes))
        clip_bytes = align_up(clip_bytes + floats * 4)

    # io: one copy per slot.
    io_offset = 0
    io_offsets: dict[str, int] = {}
    io = _io_tensors(model, batch)
    if resident is not None:  # the batch's sample indices, from which the first launch gathers it
        io.append(TensorDecl("idx", (batch,), "int32", "io"))
    if sampling is not None:
        io += [TensorDecl("cursor", (2,), "int32", "io"), TensorDecl("token", (1,), "int32", "io")]
    for decl in io:
        tensors.append(Tensor(decl.name, decl.shape, decl.dtype, "io", io_offset))
        io_offsets[decl.name] = io_offset
        io_offset = align_up(io_offset + decl.size * ITEM_BYTES[decl.dtype])

    # work: the train graph holds every work tensor eval and predict use, with lifetimes that
    # contain theirs (same forward order, more readers), so one placement serves all three.
    precision = spec.run.precision
    if precision == "mixed" and features is not None and "cooperative_matrix" not in features:
        raise PlanError(
            [
                Problem(
                    "run.precision",
                    f"'mixed' runs GEMMs on cooperative matrices, which device {device} does not have; "
                    "use 'float32'",
                )
            ]
        )
    update = not separate_update
    kept = keeps_copies(precision, facts)  # the weights' fp16 copies, written by the update
    graphs = {
        kind: build_graph(
            model,
            spec.optimiser,
            batch,
            kind,
            total_params,
            precision,
            update,
            loss_scaled=bool(loss_scale),
            kept_copies=kept,
        )
        for kind in PROGRAM_KINDS
    }
    if sampling is not None:
        sample = sample_params(sampling, infer_shapes(model)[-1][-1])
        graphs["generate"] = build_graph(
            model, None, batch, "generate", total_params, precision, sample=sample, kept_copies=kept
        )
    if resident is not None:
        for kind in ("train", "eval"):
            graphs[kind].groups.insert(0, [_gather_launch(resident, batch)])
    declared: dict[str, TensorDecl] = {}
    for graph in graphs.values():
        declared.update(graph.tensors)
    lives = lifetimes(graphs["train"])
    offsets, work_peak = assign_offsets(lives)
    for name, decl in sorted(declared.items()):
        if decl.role != "work":
            continue
        base = decl.view_of or name
        if base in io_offsets:  # e.g. Flatten straight after the input: a view of the batch
            tensors.append(Tensor(name, decl.shape, decl.dtype, "io", io_offsets[base]))
            continue
        if base not in offsets:
            raise AssertionError(f"work tensor {base!r} is never used by the train program")
        tensors.append(Tensor(name, decl.shape, decl.dtype, "work", offsets[base]))
    work_naive = sum(life.nbytes for life in lives)
    copies, copy_arena = copy_tensors(declared, offset_of, total_params)
    tensors += copies

    arenas = [Arena("params", param_bytes), Arena("grads", param_bytes)]
    arenas += [Arena(f"state:{s}", param_bytes) for s in state_names]
    arenas += [Arena("clip", clip_bytes)] if clip_bytes else []
    arenas += copy_arena
    arenas += [
        Arena("work", max(work_peak, 256)),
        Arena("io", max(io_offset, 256), per_slot=True, host_visible=True),
    ]
    if resident is not None:
        dataset, dataset_bytes = _dataset_tensors(resident)
        tensors += dataset
        arenas.append(Arena("dataset", dataset_bytes))
    layout = Layout(arenas=tuple(arenas), tensors=tuple(tensors))
    _check_bindings(layout, graphs)

    sized = [(a.name, a.nbytes * (slots if a.per_slot else 1)) for a in arenas]
    total = sum(size for _, size in sized)
    memory = MemoryReport(tuple(sized), work_peak, work_naive, total, budget)
    if budget is not None and total > budget:
        largest = sorted(layout.tensors, key=lambda t: -t.nbytes)[:5]
        detail = ", ".join(f"{t.name} {t.shape} {t.nbytes:,} B" for t in largest)
        raise PlanError(
            [
                Problem(
                    f"devices[{device}]",
                    f"the plan needs {total:,} bytes but the memory budget is {budget:,} bytes; "
                    f"largest tensors: {detail}",
                )
            ]
        )
    names = tuple(f"layers[{i}] {type(layer).__name__}" for i, layer in enumerate(model.layers))
    # Each launch carries the specialisation constants (GEMM tiles) this device will run.
    programs = tuple(
        resolve_program(Program(f"{kind}[{batch}]", with_barriers(graphs[kind].groups)), facts, tuning)
        for kind in PROGRAM_KINDS
    )
    apply = None
    if separate_update:
        # The optimised range stops before BatchNorm's running statistics (flow.graph).
        optimised = optimised_floats(model, total_params)
        groups = update_groups(spec.optimiser, optimised, bool(loss_scale), bool(copies))
        updating = Program("apply", with_barriers(groups))
        apply = resolve_program(updating, facts, tuning)
    generate = None
    if sampling is not None:
        drawing = Program("generate", with_barriers(graphs["generate"].groups))
        generate = resolve_program(drawing, facts, tuning)
    return DevicePlan(
        device,
        model,
        spec.optimiser,
        batch,
        slots,
        layout,
        tuple(params),
        total_params,
        state_names,
        memory,
        names,
        programs,
        precision,
        resident,
        apply,
        generate,
        loss_scale,
    )


def _check_bindings(layout: Layout, graphs: dict[str, Graph]) -> None:
    """Every launch binds tensors the layout has, as many as its op needs."""
    for kind, graph in graphs.items():
        for group in graph.groups:
            for item in group:
                definition = op_def(item.op)
                if len(item.args) != len(definition.bindings):
                    raise AssertionError(f"{kind}: {item.op} binds {item.args}, needs {definition.bindings}")
                for name in item.args:
                    layout.tensor(name)


def plan(
    spec: Spec,
    budget: int | None = None,
    features: tuple[str, ...] | None = None,
    *,
    facts: DeviceFacts | tuple[DeviceFacts, ...] | None = None,
    header: SourceHeader | None = None,
    mode: str = "train",
    maps_inputs: bool | None = None,
    tuning: GemmTable | tuple[GemmTable | None, ...] | None = None,
    world: World | None = None,
    speeds: tuple[float, ...] | None = None,
    bandwidth: float | None = None,
    sampling: Sampling | None = None,
) -> Plan:
    """Turn a valid spec into the whole run's plan, before any device work.

    Args:
        spec: the spec (validated here).
        budget: the device memory budget in bytes; default: from ``facts`` (flow.device_facts.
            memory_budget with the spec's memory_fraction), or no check without facts.
        features: the device's features; default: ``facts.features`` (checked against
            ``run.precision``).
        facts: the device the run will use, when known; several (in the spec's order): the run
            trains data parallel over them (flow.parallel_plan), each with its own device plan.
        header: the source's header, when it has been opened: the data is then checked against
            the model and split, batched and scheduled (``Plan.data``).
        mode: "train", "predict" or "generate" (with ``sampling``: see flow.generation).
        maps_inputs: whether the device maps its input slots into host memory (so batches can be
            read in place); default: any Vulkan device (the CPU backend copies).
        tuning: the device's measured GEMM tiles (shaders.gemm_tuning.load_table(facts.name)),
            which the programs' launches use where they list the launch's shape; one per device
            where there are several.
        world: the ranks of an MPI job this process is one of (None: none). A training run over
            several ranks is data parallel even on one local device: this rank's plan takes its
            part of every global batch.
        speeds: data parallel over unequal devices without the spec's shares: each member's
            measured samples/s (actors.data_parallel.measure_throughput), which set the shares;
            None: the plan records every member's programs for the whole batch, to measure them.
        bandwidth: with ``speeds``, the host all-reduce's bytes/s: members that would slow each step
            are left out (flow.parallel_plan.choose_members), and ``Plan.member_choice`` says why.
        sampling: how a ``generate`` plan draws each token.

    Returns:
        The plan.

    Raises:
        SpecError: the spec is not valid, or the data does not fit the model.
        PlanError: it cannot be planned (a wiring mistake, a split with no training batch, a model
            over the memory budget, a feature the device lacks).
    """
    if mode not in ("train", "predict", "generate") or (mode == "generate") != (sampling is not None):
        raise ValueError(f"mode must be 'train', 'predict' or 'generate' (with sampling), got {mode!r}")
    check(spec)
    world = world if world is not None and mode == "train" else World()
    if spec.devices.stages is not None and mode == "train" and not isinstance(facts, DeviceFacts):
        from flow.stage_plan import plan_stages  # it plans each stage with this module's parts

        return plan_stages(spec, facts, tuning if isinstance(tuning, tuple) else None, budget, header, world)
    if isinstance(facts, tuple) and len(facts) > 1 and speeds is not None and bandwidth is not None:
        moved = 4 * sum(math.prod(p.shape) for p in parameters(spec.model))  # a member's gradients
        choice = choose_members(facts, spec.data.batch_size, spec.devices, world, speeds, bandwidth, moved)
        tables = tuple(tuning[i] for i in choice.kept) if isinstance(tuning, tuple) else tuning
        options = {"header": header, "mode": mode, "maps_inputs": maps_inputs, "world": world}
        group, speeds = tuple(facts[i] for i in choice.kept), tuple(speeds[i] for i in choice.kept)
        chosen = plan(spec, budget, features, facts=group, tuning=tables, speeds=speeds, **options)
        return replace(chosen, member_choice=choice)
    if world.size > 1 and isinstance(facts, DeviceFacts):
        facts, tuning = (facts,), tuning if isinstance(tuning, tuple) else (tuning,)
    if isinstance(facts, tuple) and len(facts) == 1 and world.size == 1:
        facts, tuning = facts[0], tuning[0] if isinstance(tuning, tuple) else tuning
    if isinstance(facts, tuple):
        tables = tuning if isinstance(tuning, tuple) else (tuning,) * len(facts)
        return _plan_data_parallel(spec, facts, tables, budget, header, mode, world, speeds)
    assert not isinstance(tuning, tuple)
    if facts is not None:
        budget = memory_budget(facts, spec.devices.memory_fraction) if budget is None else budget
        features = facts.features if features is None else features
        maps_inputs = not facts.is_numpy if maps_inputs is None else maps_inputs
    data = plan_data(spec, header) if header is not None and mode == "train" else None
    device = facts.name if facts is not None else str(spec.devices.select)
    resident, why = resident_data(spec, header) if data is not None else (None, "no data to train on")
    if resident is None and spec.data.placement == "device" and mode == "train":
        raise PlanError([Problem("data.placement", f"'device' asked for, but {why}")])
    try:
        device_plan = plan_device(spec, device, budget, features, facts, tuning, resident, sampling=sampling)
    except PlanError:
        if resident is None or spec.data.placement == "device":
            raise
        # "auto": the data does not fit beside the model, so it streams from the host.
        resident, device_plan = None, plan_device(spec, device, budget, features, facts, tuning)
    if data is not None:
        data = replace(data, resident=resident)
    pipeline = plan_pipeline(
        spec,
        mode=mode,
        sample_shape=header.sample_shape if header is not None else None,
        # A batch from resident data is gathered on the device: the loader reads nothing.
        reads_in_place=header is not None and header.reads_in_place and resident is None,
        maps_inputs=bool(maps_inputs),
    )
    return Plan(spec=spec, mode=mode, devices=(device_plan,), pipeline=pipeline, data=data)


def _plan_data_parallel(
    spec: Spec,
    group: tuple[DeviceFacts, ...],
    tables: tuple[GemmTable | None, ...],
    budget: int | None,
    header: SourceHeader | None,
    mode: str,
    world: World,
    speeds: tuple[float, ...] | None = None,
) -> Plan:
    """:func:`plan` over several devices: a device plan per member for the rows it takes, each
    with the update apart (``apply``) to run after the all-reduce. Shards are gathered on the host
    and written into each member's slots, so nothing is read in place; with data.placement
    "device" every member keeps the whole dataset and gathers its shard by the indices the loader
    sends. In an MPI job the members share this rank's part of each global batch."""
    resident = None
    if spec.data.placement == "device" and mode == "train":
        resident, why = resident_data(spec, header) if header is not None else (None, "no data to train on")
        if resident is None:
            raise PlanError([Problem("data.placement", f"'device' asked for, but {why}")])
    if spec.data.batch_size < world.size:
        message = f"{spec.data.batch_size} rows cannot be shared by {world.size} ranks: each needs one"
        raise PlanError([Problem("data.batch_size", message)])
    running = any(not p.trainable for p in parameters(spec.model))
    parallel = plan_data_parallel(group, spec.data.batch_size, spec.devices.shares, world, speeds, running)
    devices = tuple(
        plan_device(
            spec,
            facts.name,
            memory_budget(facts, spec.devices.memory_fraction) if budget is None else budget,
            facts.features,
            facts,
            table,
            resident,
            batch=capacity,
            separate_update=True,
        )
        for facts, table, capacity in zip(group, tables, parallel.capacity, strict=True)
    )
    buckets = grad_buckets(devices[0].layout, round(spec.devices.bucket_mb * 2**20))
    parallel = replace(parallel, buckets=buckets)
    data = plan_data(spec, header, world.rank, world.size) if header is not None and mode == "train" else None
    data = replace(data, resident=resident) if data is not None else None
    sample_shape = header.sample_shape if header is not None else None
    pipeline = plan_pipeline(spec, mode=mode, sample_shape=sample_shape)
    return Plan(spec=spec, mode=mode, devices=devices, pipeline=pipeline, data=data, parallel=parallel)


def init_parameters(device: DevicePlan | list[ParamDecl], scheme: str, seed: int) -> dict[str, np.ndarray]:
    """Initial values of every parameter, seeded, identical on every backend.

    He: normal(0, sqrt(2 / fan_in)); Xavier: uniform(+-sqrt(6 / (fan_in + fan_out))). Biases start
    at zero, as is usual for ReLU networks.
    """
    rng = np.random.default_rng(seed)
    values = {}
    for p in device.parameters if isinstance(device, DevicePlan) else device:
        if p.values is not None:  # a CrossEntropy's class weights
            values[p.name] = np.asarray(p.values, np.float32).reshape(p.shape)
        elif p.constant is not None:  # BatchNorm's scale and running statistics: no draw
            values[p.name] = np.full(p.shape, p.constant, np.float32)
        elif p.is_bias:
            values[p.name] = np.zeros(p.shape, np.float32)
        elif p.std is not None:  # an Embedding's table: N(0, 1) as in PyTorch, whatever the scheme
            values[p.name] = (rng.standard_normal(p.shape) * p.std).astype(np.float32)
        elif scheme == "xavier":
            limit = math.sqrt(6.0 / (p.fan_in + p.fan_out))
            values[p.name] = rng.uniform(-limit, limit, p.shape).astype(np.float32)
        else:
            values[p.name] = (rng.standard_normal(p.shape) * math.sqrt(2.0 / p.fan_in)).astype(np.float32)
    return values

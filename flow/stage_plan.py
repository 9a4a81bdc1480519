"""A model split over devices as pipeline stages, as plain data: which top-level layers each
device holds, the micro-batches and their 1F1B schedule, each stage's device plan (its programs,
memory and budget check) and where the stages' parameters lie in the whole model's flat arenas
(a checkpoint holds the whole model's, as one device's run would). Pure: actors.stages runs it.

Cuts. Stages meet between two top-level layers where one tensor alone crosses: the output of the
layer before the cut, which any layer after it may read. A cut is refused, naming the layer, where
a later layer reads an earlier one (a graph join across the cut) or where an activation layer is
fused into the epilogue of the layer before it.

Placement. ``Devices(stages="auto")`` places the layers in order: each device takes layers until its
part reaches an equal share of what is left (by parameter and activation bytes) or would pass its
memory budget, keeping a layer for every later device; ``stages=(0, 0, 1, ...)`` gives each layer's
device. Every stage's plan is checked against its device's budget before any device work: the
error names the device, its largest tensors and their bytes.

Schedule. A batch is cut into ``micro_batches`` parts that go through the stages in a 1F1B order
(PipeDream-flush): stage s of S runs min(S - s - 1, M) forwards, then a forward and a backward in
turn, then its last backwards, so it keeps at most min(S - s, M) micro-batches' activations (its
input slots, each with its own work arena). Activations go forward and gradients come back through
the host; the gradients are the credits a stage waits for before its next forward past that cap,
so the cycle of bounded channels cannot deadlock. Each micro-batch's loss is averaged over the
whole batch's rows and each backward adds the gradients into an ``acc`` arena, so their sum is the
batch's gradient; then every stage's ``apply`` copies it into its gradients, updates once and
zeroes the sum.

BatchNorm over micro-batches (torchgpipe's deferred_batch_norm). Each micro-batch is normalised by
its own statistics, as GPipe does (so the loss and gradients are those of M smaller batches, not
one device's), but the running mean and variance move once per batch, by the whole batch's
statistics: each micro-batch's forward leaves the running statistics as they are (momentum 0) and
copies its (mean, 1 / std) to io ``batch_stats:<layer>``; the host joins them into the batch's
mean and unbiased variance (:func:`deferred_running`) and writes the running statistics before the
stage's ``apply``. So the running statistics, and evaluation, are one device's with the batch.

Ranks. In an MPI job every rank runs the same split on its own devices over its part of every
global batch (loaders.sampler.rank_bounds), each micro-batch's loss averaged over the global
batch's rows; before the update each stage's summed gradient (the last stage's with the step's
loss and metric sums) is summed over the ranks in rank order (actors.collective), so every rank
applies the same update and the clip factor and loss scale stay one decision for the whole job.
``mpiexec -n 2`` with one micro-batch a rank computes the bits of one process with two. BatchNorm's
running statistics are each rank's own, from its part, as DDP's without buffer broadcasts.

One model, one update. Clipping by the global norm and loss scaling need the whole model's
gradients: each stage's ``norm`` program copies its sum into its gradients and writes grad_norm's
partial sums of squares; the host joins every stage's partials in stage order (actors.stages) into
one clip factor, one skip decision (any stage's gradients not finite) and one loss scale, writes
them to every stage, and each ``apply`` then updates with the ``_clip`` variant. In "mixed"
precision each stage runs its GEMMs on cooperative matrices where its device has them, and in
float32 where it does not (its plan says which); the loss scale is the run's, one for all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from flow.autodiff import backward_needs, build_graph
from flow.data_plan import SourceHeader, plan_data
from flow.device_facts import DeviceFacts, memory_budget
from flow.errors import PlanError, Problem
from flow.graph import ParamDecl, fused_bias_grads, label_shape, param_offsets, parameters, stages
from flow.metrics import metric_name, on_device
from flow.model_graph import MODEL_INPUT, expand
from flow.optim import (
    CLIP_PARTS,
    CLIP_TENSORS,
    LOSS_SCALE,
    LOSS_SCALE_FLOATS,
    initial_loss_scale,
    optimiser_state_names,
    update_groups,
    update_launch,
)
from flow.parallel_plan import World, split_rows
from flow.pipeline_plan import plan_pipeline
from flow.planning import (
    DevicePlan,
    MemoryReport,
    Plan,
    _check_bindings,
    assign_offsets,
    init_parameters,
    lifetimes,
)
from flow.program import (
    ITEM_BYTES,
    STEP_VALUES,
    Arena,
    Layout,
    Program,
    Tensor,
    align_up,
    launch,
    with_barriers,
)
from flow.shapes import infer_shapes
from flow.spec import Spec
from flow.spec_model import BatchNorm1d, BatchNorm2d
from flow.weight_copies import copy_tensors, keeps_copies
from shaders.registry import BINARY, resolve_program
from shaders.tiles import GemmTable

# What each stage's engine runs: a stage before the last its forward and backward apart (the
# backward waits for the gradient the next stage sends back); the last one forward, loss and
# backward in one program.
STAGE_KINDS = {
    "first or middle": ("forward", "backward", "eval", "apply"),
    "last": ("train", "eval", "apply"),
}

Op = tuple[str, int]  # ("F" or "B", micro-batch)
BatchNormStat = tuple[str, int, int, float, float]  # a BatchNorm's path, C, H*W, momentum, eps


def one_f_one_b(stage_count: int, micro: int) -> tuple[tuple[Op, ...], ...]:
    """Each stage's order of forwards and backwards over ``micro`` micro-batches (see the module
    docstring): stage s warms up with min(S - s - 1, M) forwards.

    Args:
        stage_count: S, the stages.
        micro: M, the micro-batches (>= 1).

    Returns:
        One tuple of ("F", m) and ("B", m) per stage.
    """
    orders = []
    for s in range(stage_count):
        warm = min(stage_count - s - 1, micro)
        ops: list[Op] = [("F", m) for m in range(warm)]
        for m in range(micro - warm):
            ops += [("F", warm + m), ("B", m)]
        ops += [("B", m) for m in range(micro - warm, micro)]
        orders.append(tuple(ops))
    return tuple(orders)


def forward_only(stage_count: int, micro: int) -> tuple[tuple[Op, ...], ...]:
    """Evaluation and prediction: each stage's forwards in order."""
    return tuple(tuple(("F", m) for m in range(micro)) for _ in range(stage_count))


def peak_in_flight(order: tuple[Op, ...]) -> int:
    """The most micro-batches a stage holds activations for at once (forwards not yet backward)."""
    held = peak = 0
    for op, _ in order:
        held += 1 if op == "F" else -1
        peak = max(peak, held)
    return peak


@dataclass(frozen=True)
class StagePlan:
    """How a model is split over devices (see the module docstring).

    Attributes:
        members: each stage's device name, in order.
        layers: each stage's top-level layers [start, stop).
        positions: each stage's positions in the model's stage list (flow.graph.stages) [lo, hi).
        placement: "auto" or "spec".
        batch: the batch's rows.
        micro_batches: M.
        micro_rows: the rows each stage's programs are recorded for (the largest micro-batch).
        slots: each stage's input slots: the micro-batches whose activations it holds at once.
        backward: whether each stage runs a backward (it has trained layers, or a later stage's
            gradient passes through it to one).
        crossing: the shape (without rows) of the activation each cut carries.
        params: per stage, (name, offset in the stage's arenas, offset in the whole model's, floats)
            of each parameter, offsets in floats.
        total_params: floats in the whole model's flat arenas (a checkpoint's).
        stage_floats: floats in each stage's flat arenas.
        global_norm: the update needs the whole model's gradient norm (clip_norm or a loss
            scale): every stage runs a ``norm`` program before its ``apply``, and the host joins them.
        precisions: each stage's precision ("mixed" falls back to "float32" per device).
        norms: each stage's BatchNorm layers whose running statistics move once per batch
            (micro_batches > 1; see the module docstring); empty otherwise.
        ranks: the ranks of an MPI job, each running the split over its part of every batch.
    """

    members: tuple[str, ...]
    layers: tuple[tuple[int, int], ...]
    positions: tuple[tuple[int, int], ...]
    placement: str
    batch: int
    micro_batches: int
    micro_rows: int
    slots: tuple[int, ...]
    backward: tuple[bool, ...]
    crossing: tuple[tuple[int, ...], ...]
    params: tuple[tuple[tuple[str, int, int, int], ...], ...]
    total_params: int
    stage_floats: tuple[int, ...]
    global_norm: bool = False
    precisions: tuple[str, ...] = ()
    norms: tuple[tuple[BatchNormStat, ...], ...] = ()
    ranks: int = 1

    def split(self, rows: int) -> tuple[int, ...]:
        """The rows of each micro-batch of a batch of ``rows`` (none empty)."""
        return tuple(r for r in split_rows(rows, (1.0,) * self.micro_batches) if r)

    def schedule(self, kind: str, micro: int) -> tuple[tuple[Op, ...], ...]:
        """Each stage's order for ``micro`` micro-batches of a ``train`` batch (1F1B) or another."""
        count = len(self.members)
        return one_f_one_b(count, micro) if kind == "train" else forward_only(count, micro)

    def kinds(self, stage: int) -> tuple[str, ...]:
        """The programs stage ``stage`` records."""
        kinds = STAGE_KINDS["last" if stage == len(self.members) - 1 else "first or middle"]
        return (*kinds, "norm") if self.global_norm else kinds

    def as_dict(self) -> dict:
        count = len(self.members)
        orders = one_f_one_b(count, self.micro_batches)
        return {
            "members": list(self.members),
            "layers": [list(span) for span in self.layers],
            "placement": self.placement,
            "batch": self.batch,
            "micro_batches": self.micro_batches,
            "micro_rows": self.micro_rows,
            "slots": list(self.slots),
            "backward": list(self.backward),
            "schedule": [" ".join(f"{op}{m}" for op, m in order) for order in orders],
            "channels": [
                *(
                    {
                        "src": f"stage{s}",
                        "dst": f"stage{s + 1}",
                        "carries": f"activations {list(shape)}",
                        "capacity": self.slots[s],
                        "credit": False,
                    }
                    for s, shape in enumerate(self.crossing)
                ),
                *(
                    {
                        "src": f"stage{s + 1}",
                        "dst": f"stage{s}",
                        "carries": "gradients",
                        "capacity": self.slots[s],
                        "credit": True,
                    }
                    for s in range(count - 1)
                    if self.backward[s]
                ),
            ],  # fmt: skip
            "total_params": self.total_params,
            "ranks": self.ranks,
        } | ({"global_norm": True} if self.global_norm else {})


# -- where a model can be cut ------------------------------------------------------------------


def cuts(spec: Spec) -> tuple[list[str | None], list[int]]:
    """Where the model can be cut: for each top-level layer c >= 1, None when stages may meet
    before it, else why not; and each top-level layer's first stage position (the model's stage
    count last), so a cut before layer c starts a stage at that position."""
    model = spec.model
    expansion, model_stages = expand(model), stages(model)
    stage_of: dict[int, int] = {MODEL_INPUT: MODEL_INPUT}
    own = {stage.index: position for position, stage in enumerate(model_stages)}
    for node in expansion.nodes:  # a fused activation's node lies in the stage it reads
        stage_of[node.index] = own.get(node.index, stage_of[node.inputs[0]])
    layer_of = {n: c for c, span in enumerate(expansion.spans) for n in span}
    starts, reasons = [], []
    for c, span in enumerate(expansion.spans):
        before = {stage_of[n] for n in range(span.start)}
        after = {stage_of[n] for n in range(span.start, len(expansion.nodes))}
        starts.append(len(before))
        if c == 0:
            continue
        name = f"layers[{c}] {type(model.layers[c]).__name__}"
        crossing = stage_of[expansion.outputs[c - 1]]
        if before & after:
            reasons.append(f"{name} is fused into the epilogue of layers[{c - 1}]; place them on one device")
            continue
        why = None
        for position in sorted(after):
            for source in model_stages[position].inputs:
                if source not in after and source != crossing:
                    reader = layer_of[model_stages[position].index]
                    read = (
                        "the model's input"
                        if source == MODEL_INPUT
                        else f"layers[{layer_of[model_stages[source].index]}]"
                    )
                    why = (
                        f"layers[{reader}] reads {read}, so more than layers[{c - 1}]'s output would "
                        f"cross between devices before {name}; cut where one layer's output is all "
                        "that flows on"
                    )
                    break
            if why:
                break
        reasons.append(why)
    return [None, *reasons], [*starts, len(model_stages)]


def _layer_bytes(spec: Spec, rows: int) -> list[int]:
    """A rough size of each top-level layer on a device, to share the layers out: its parameters
    with their gradients, sum and optimiser state, and its output for ``rows`` rows."""
    model = spec.model
    expansion, model_stages = expand(model), stages(model)
    copies = 3 + len(optimiser_state_names(spec.optimiser))
    floats = {p.name.rsplit(".", 1)[0]: 0 for p in parameters(model)}
    for p in parameters(model):
        floats[p.name.rsplit(".", 1)[0]] += math.prod(p.shape)
    sizes = []
    shapes = infer_shapes(model)
    for c, span in enumerate(expansion.spans):
        paths = {stage.path for stage in model_stages if stage.index in span}
        weights = sum(floats.get(path, 0) for path in paths) * 4 * copies
        sizes.append(weights + 2 * rows * math.prod(shapes[c]) * 4)
    return sizes


def place(
    count: int, layers: int, allowed: list[int], sizes: list[int], fits: Callable[[int, int, int], bool]
) -> tuple[int, ...]:
    """Stage bounds over the top-level layers (see "Placement" in the module docstring).

    Args:
        count: the devices, S >= 2.
        layers: the model's top-level layers.
        allowed: the cuts (layer indices) the model allows, ascending.
        sizes: each layer's rough bytes.
        fits: fits(stage, start, stop) whether layers [start, stop) fit stage's device.

    Returns:
        S + 1 bounds, 0 first and ``layers`` last.

    Raises:
        PlanError: fewer places to cut than the devices need.
    """
    if len(allowed) < count - 1:
        where = ", ".join(f"layers[{c}]" for c in allowed) or "nowhere"
        message = f"{count} stages need {count - 1} cuts, but the model can be cut only before {where}"
        raise PlanError([Problem("devices.stages", message)])
    bounds = [0]
    for stage in range(count - 1):
        start = bounds[-1]
        options = [c for c in allowed if c > start and sum(a > c for a in allowed) >= count - 2 - stage]
        share = sum(sizes[start:]) / (count - stage)
        chosen = options[0]  # at least one layer; over budget, its plan says so below
        for c in options[1:]:
            if not fits(stage, start, c):
                break
            if abs(sum(sizes[start:c]) - share) < abs(sum(sizes[start:chosen]) - share):
                chosen = c
        bounds.append(chosen)
    return (*bounds, layers)


def _explicit(devices: tuple[int, ...], reasons: list[str | None], layers: int) -> tuple[int, ...]:
    if len(devices) != layers:
        message = f"gives a device to {len(devices)} layers; the model has {layers} top-level layers"
        raise PlanError([Problem("devices.stages", message)])
    bounds = [0] + [c for c in range(1, layers) if devices[c] != devices[c - 1]] + [layers]
    problems = [
        Problem(f"devices.stages[{c}]", f"cannot cut here: {reasons[c]}") for c in bounds[1:-1] if reasons[c]
    ]
    if problems:
        raise PlanError(problems)
    return tuple(bounds)


# -- one stage's device plan -------------------------------------------------------------------


def _stage_params(spec: Spec, part: tuple[int, int], last: bool) -> list[ParamDecl]:
    """The parameters of the stages at positions [lo, hi) (the loss's class weights with the
    last), trainable first, as :func:`flow.graph.parameters` orders them."""
    paths = {stage.path for stage in stages(spec.model)[part[0] : part[1]]}
    return [
        p
        for p in parameters(spec.model)
        if p.name.rsplit(".", 1)[0] in paths or (last and p.name.startswith("loss."))
    ]


def plan_stage_device(
    spec: Spec,
    device: str,
    part: tuple[int, int],
    rows: int,
    slots: int,
    budget: int | None = None,
    facts: DeviceFacts | None = None,
    tuning: GemmTable | None = None,
    layers: str = "",
) -> DevicePlan:
    """The device plan of one stage: the model's stage positions [lo, hi) for micro-batches of
    ``rows``, with ``slots`` input slots, each with its own work arena. In "mixed" precision on a
    device without cooperative matrices the stage runs in float32.

    Raises:
        PlanError: over the device's budget, naming it and its largest tensors.
    """
    model = spec.model
    model_stages = stages(model)
    first, last = part[0] == 0, part[1] == len(model_stages)
    params = _stage_params(spec, part, last)
    tensors: list[Tensor] = []
    floats, total = param_offsets(params)
    offsets = {name: at * 4 for name, at in floats.items()}
    param_bytes = total * 4
    state_names = optimiser_state_names(spec.optimiser)
    for p in params:
        tensors.append(Tensor(p.name, p.shape, "float32", "params", offsets[p.name]))
        if p.trainable:
            tensors.append(Tensor(f"grad:{p.name}", p.shape, "float32", "grads", offsets[p.name]))
    for view, (weight, shape) in fused_bias_grads(model).items():
        if weight in offsets:
            tensors.append(Tensor(view, shape, "float32", "grads", offsets[weight]))
    flat = [("params", "params:all"), ("grads", "grads:all"), ("acc", "acc:all")]
    flat += [(f"state:{s}", f"state:{s}") for s in state_names]
    tensors += [Tensor(name, (total,), "float32", arena, 0) for arena, name in flat]
    # The whole model's norm and loss scale (see the module docstring): the partial sums, [norm,
    # factor, skip] and the scale's state, as one device's "clip" arena holds them.
    loss_scale = initial_loss_scale(spec.run.loss_scale, spec.run.precision)
    global_norm = spec.optimiser.clip_norm is not None or loss_scale is not None
    clip_bytes = 0
    scaling = ((LOSS_SCALE, LOSS_SCALE_FLOATS),) if loss_scale is not None else ()
    for name, floats in (*(CLIP_TENSORS if global_norm else ()), *scaling):
        tensors.append(Tensor(name, (floats,), "float32", "clip", clip_bytes))
        clip_bytes = align_up(clip_bytes + floats * 4)
    mixed = spec.run.precision == "mixed" and (facts is None or facts.has("cooperative_matrix"))
    precision = "mixed" if mixed else "float32"

    lo_stage, hi_stage = model_stages[part[0]], model_stages[part[1] - 1]
    in_shape = tuple(model.input_shape) if first else lo_stage.in_shape
    out_shape = infer_shapes(model)[-1] if last else hi_stage.out_shape
    y_shape, y_dtype = label_shape(model, rows)
    # Every stage has the io of a whole model's program (the engine reads them alike), and its
    # own: the gradient of its output that comes back (dy) and of its input that it sends (dx).
    io = [
        ("x", (rows, *in_shape), "float32"),
        ("y", y_shape, y_dtype),
        ("stepvals", (len(STEP_VALUES),), "float32"),
        ("loss", (1,), "float32"),
        ("correct", (1,), "float32"),
        ("output", (rows, *out_shape), "float32"),
        *((f"metric:{metric_name(m)}", (1,), "float32") for m in on_device(model)),
    ]
    io += [("dy", (rows, *out_shape), "float32")] if not last else []
    io += [("dx", (rows, *in_shape), "float32")] if not first else []
    norms = stage_norms(spec, part)
    io += [(f"batch_stats:{path}", (2, c), "float32") for path, c, *_ in norms]
    io_offsets, io_offset = {}, 0
    for name, shape, dtype in io:
        tensors.append(Tensor(name, shape, dtype, "io", io_offset))
        io_offsets[name], io_offset = io_offset, align_up(io_offset + math.prod(shape) * ITEM_BYTES[dtype])

    build = {"optimiser": spec.optimiser, "batch": rows, "total_params": total, "update": False, "part": part,
             "precision": precision, "loss_scaled": loss_scale is not None,
             "kept_copies": keeps_copies(precision, facts)}  # fmt: skip
    graphs = {kind: build_graph(model, program=kind, **build) for kind in ("train", "eval", "predict")}
    accumulate = [
        launch("binary", ("acc:all", "grads:all", "acc:all"), n=total, fn=BINARY["add"], a=1.0, b=0.0)
    ]
    graphs["train"].groups.append(accumulate)  # this micro-batch's gradients into the batch's sum
    if norms:
        _defer_running_statistics(graphs["train"])
    lives = lifetimes(graphs["train"])
    work, work_peak = assign_offsets(lives)
    declared = {}
    for graph in graphs.values():
        declared.update(graph.tensors)
    for name, decl in sorted(declared.items()):
        base = decl.view_of or name
        if decl.role != "work":
            continue
        if base in io_offsets:
            tensors.append(Tensor(name, decl.shape, decl.dtype, "io", io_offsets[base]))
        else:
            tensors.append(Tensor(name, decl.shape, decl.dtype, "work", work[base]))
    copies, copy_arena = copy_tensors(declared, offsets, total)  # the weights' fp16 copies, if kept
    tensors += copies
    arenas = [Arena("params", param_bytes), Arena("grads", param_bytes), Arena("acc", param_bytes)]
    arenas += [Arena(f"state:{s}", param_bytes) for s in state_names]
    arenas += [Arena("clip", clip_bytes)] if clip_bytes else []
    arenas += copy_arena
    # Each slot is a micro-batch in flight: its activations live until its backward.
    arenas += [Arena("work", max(work_peak, 256), per_slot=True),
               Arena("io", max(io_offset, 256), per_slot=True, host_visible=True)]  # fmt: skip
    layout = Layout(arenas=tuple(arenas), tensors=tuple(tensors))
    _check_bindings(layout, graphs)
    sized = tuple((a.name, a.nbytes * (slots if a.per_slot else 1)) for a in arenas)
    used = sum(size for _, size in sized)
    memory = MemoryReport(sized, work_peak, sum(life.nbytes for life in lives), used, budget)
    if budget is not None and used > budget:
        largest = sorted(layout.tensors, key=lambda t: -t.nbytes)[:5]
        detail = ", ".join(f"{t.name} {t.shape} {t.nbytes:,} B" for t in largest)
        layers = layers or f"stage positions {part[0]}..{part[1] - 1}"
        message = (f"the stage of {layers} needs {used:,} bytes but the memory budget is {budget:,} bytes; "
                   f"largest tensors: {detail}")  # fmt: skip
        raise PlanError([Problem(f"devices[{device}]", message)])

    def program(name: str, groups: list) -> Program:
        return resolve_program(Program(name, with_barriers(groups)), facts, tuning)

    optimised = sum(align_up(math.prod(p.shape) * 4) for p in params if p.trainable) // 4
    if all(p.trainable for p in params):
        optimised = total
    copy_in = [launch("copy", ("acc:all", "grads:all"), n=total)]
    zero = [launch("fill", ("acc:all",), n=total, value=0.0)]
    if global_norm:  # the host joins the stages' partials into clip:norm between the two
        squares = launch("grad_norm", ("grads:all", "clip:partials"), n=optimised, parts=CLIP_PARTS)
        update = update_launch(spec.optimiser, optimised, loss_scale is not None, bool(copies))
        extra = (program("norm", [copy_in, [squares]]), program("apply", [[update], zero]))
    else:
        updating = update_groups(spec.optimiser, optimised, halves=bool(copies))
        extra = (program("apply", [copy_in, *updating, zero]),)
    train = graphs["train"]
    if not last:
        split = train.backward_from
        extra += (program("forward", train.groups[:split]), program("backward", train.groups[split:]))
    names = tuple(f"layers[{i}] {type(layer).__name__}" for i, layer in enumerate(model.layers))
    programs = tuple(program(f"{kind}[{rows}]", graphs[kind].groups) for kind in ("train", "eval", "predict"))
    # The engine checks token ids against an Embedding only where the model's input comes in.
    seen = model if first else replace(model, input_shape=in_shape, layers=())
    return DevicePlan(
        device, seen, spec.optimiser, rows, slots, layout, tuple(params), total, state_names, memory, names,
        programs, precision, loss_scale=loss_scale, stage_programs=extra,
    )  # fmt: skip


# -- BatchNorm's running statistics over micro-batches ------------------------------------------


def stage_norms(spec: Spec, part: tuple[int, int]) -> tuple[BatchNormStat, ...]:
    """The BatchNorm layers at stage positions [lo, hi) whose running statistics the host moves
    once per batch: every one where a batch is cut into several micro-batches, else none."""
    if spec.devices.micro_batches <= 1:
        return ()
    return tuple(
        (stage.path, stage.in_shape[0], math.prod(stage.in_shape[1:]), float(stage.layer.momentum),
         float(stage.layer.eps))
        for stage in stages(spec.model)[part[0] : part[1]]
        if isinstance(stage.layer, BatchNorm1d | BatchNorm2d)
    )  # fmt: skip


def _defer_running_statistics(graph) -> None:
    """Each training BatchNorm's statistics leave the running ones as they are (momentum 0: 1 * r +
    0 * s is r, bit for bit) and are copied, (mean, 1 / std), to io ``batch_stats:<layer>``, beside
    the normalisation that reads them (after the barrier that follows the statistics)."""
    copies = {}
    for group in graph.groups:
        for i, item in enumerate(group):
            if item.op == "batchnorm_stats":
                still = tuple((k, 0.0 if k == "momentum" else v) for k, v in item.params)
                group[i] = replace(item, params=still)
                path, stats = item.args[1].rsplit(".", 1)[0], item.args[3]
                channels = graph.tensors[stats].shape[1]
                copies[stats] = launch("copy", (stats, f"batch_stats:{path}"), n=2 * channels)
    for group in graph.groups:
        reads = [item.args[1] for item in group if item.op == "batchnorm" and item.args[1] in copies]
        group += [copies.pop(stats) for stats in reads]


def deferred_running(
    running: tuple[np.ndarray, np.ndarray], parts: list[tuple[int, np.ndarray]], norm: BatchNormStat
) -> tuple[np.ndarray, np.ndarray]:
    """A BatchNorm's running (mean, variance) after a batch cut into micro-batches, as one device
    moves them with the whole batch: its mean and unbiased variance, joined from each micro-batch's
    in float64 (the CPU backend's batchnorm_stats rule).

    Args:
        running: the running mean and variance before the batch.
        parts: each micro-batch's real rows and its ``batch_stats`` [(mean, 1 / std), C].
        norm: the layer (flow.stage_plan.BatchNormStat).

    Returns:
        The running mean and variance after the batch, float32.
    """
    _, c, hw, momentum, eps = norm
    counts = np.array([rows * hw for rows, _ in parts], np.float64)[:, None]
    means = np.stack([stats[0, :c] for _, stats in parts]).astype(np.float64)
    variances = 1.0 / np.stack([stats[1, :c] for _, stats in parts]).astype(np.float64) ** 2 - eps
    total = counts.sum()
    mean = (counts * means).sum(axis=0) / total
    variance = (counts * (variances + (means - mean) ** 2)).sum(axis=0) / total
    unbiased = variance * (total / (total - 1)) if total > 1 else variance
    moved = (1 - momentum) * np.stack([r[:c] for r in running]).astype(np.float64) + momentum * np.stack(
        [mean, unbiased]
    )
    return moved[0].astype(np.float32), moved[1].astype(np.float32)


# -- the whole split ---------------------------------------------------------------------------


def _refusals(spec: Spec, count: int, ranks: int) -> list[Problem]:
    """What a model split into stages cannot do (yet), each said once."""
    problems = []
    if spec.data.batch_size < ranks:
        message = f"{spec.data.batch_size} rows cannot be shared by {ranks} ranks: each needs one"
        problems.append(Problem("data.batch_size", message))
    model, devices = spec.model, spec.devices
    if spec.data.placement == "device":
        problems.append(
            Problem("data.placement", "'device' asked for, but the stages take their batches from the host")
        )
    if devices.micro_batches > spec.data.batch_size:
        message = (
            f"{devices.micro_batches} micro-batches of a batch of {spec.data.batch_size} rows: each needs one"
        )
        problems.append(Problem("devices.micro_batches", message))
    if len(model.layers) < count:
        problems.append(
            Problem("devices.stages", f"{count} stages need a layer each; the model has {len(model.layers)}")
        )
    return problems


def plan_stages(
    spec: Spec,
    group: tuple[DeviceFacts, ...] | None,
    tables: tuple[GemmTable | None, ...] | None = None,
    budget: int | None = None,
    header: SourceHeader | None = None,
    world: World | None = None,
) -> Plan:
    """The training plan of a model split over ``group`` (the spec's devices in order; None: the
    spec's names, with no budget to check). In an MPI job (``world``) every rank runs this split
    on its own devices over its part of every global batch (see "Ranks" in the module docstring).

    Raises:
        PlanError: a cut the model does not allow, more stages than places to cut, a stage over its
            device's budget, or what stages cannot do (a dataset kept on the device).
    """
    names = tuple(f.name for f in group) if group is not None else tuple(str(c) for c in spec.devices.choices)
    count, world = len(names), world or World()
    problems = _refusals(spec, count, world.size)
    if problems:
        raise PlanError(problems)
    micro = spec.devices.micro_batches
    rows = math.ceil(math.ceil(spec.data.batch_size / world.size) / micro)  # the largest rank's part's
    slots = tuple(min(count - s, micro) for s in range(count))
    budgets = tuple(
        budget if budget is not None or group is None else memory_budget(f, spec.devices.memory_fraction)
        for f in (group or (None,) * count)
    )
    tables = tables or (None,) * count
    reasons, starts = cuts(spec)
    layers = len(spec.model.layers)
    cache: dict[tuple[int, int, int], DevicePlan | PlanError] = {}

    def stage_plan(stage: int, start: int, stop: int) -> DevicePlan:
        key = (stage, start, stop)
        if key not in cache:
            facts = group[stage] if group is not None else None
            try:
                part = (starts[start], starts[stop])
                cache[key] = plan_stage_device(
                    spec, names[stage], part, rows, slots[stage], budgets[stage], facts, tables[stage],
                    f"layers[{start}:{stop}]",
                )
            except PlanError as error:
                cache[key] = error
        return cache[key]

    if isinstance(spec.devices.stages, tuple):
        bounds, placement = _explicit(spec.devices.stages, reasons, layers), "spec"
    else:
        allowed = [c for c in range(1, layers) if reasons[c] is None]
        sizes = _layer_bytes(spec, rows)
        bounds = place(
            count, layers, allowed, sizes, lambda s, a, b: isinstance(stage_plan(s, a, b), DevicePlan)
        )
        placement = "auto"
    devices = []
    for s in range(count):
        planned = stage_plan(s, bounds[s], bounds[s + 1])
        if isinstance(planned, PlanError):
            raise planned
        devices.append(planned)
    model_stages = stages(spec.model)
    needs = backward_needs(model_stages)
    positions = tuple((starts[bounds[s]], starts[bounds[s + 1]]) for s in range(count))
    full, total = param_offsets(parameters(spec.model))
    params = tuple(_param_map(device, full) for device in devices)
    stage_plan_ = StagePlan(
        members=names,
        layers=tuple((bounds[s], bounds[s + 1]) for s in range(count)),
        positions=positions,
        placement=placement,
        batch=spec.data.batch_size,
        micro_batches=micro,
        micro_rows=rows,
        slots=slots,
        backward=tuple(needs[hi - 1] for _, hi in positions),
        crossing=tuple(model_stages[hi - 1].out_shape for _, hi in positions[:-1]),
        params=params,
        total_params=total,
        stage_floats=tuple(device.total_params for device in devices),
        global_norm=any("norm" in device.kinds for device in devices),
        precisions=tuple(device.precision for device in devices),
        norms=tuple(stage_norms(spec, part) for part in positions),
        ranks=world.size,
    )
    data = plan_data(spec, header, world.rank, world.size) if header is not None else None
    pipeline = plan_pipeline(
        spec, mode="train", sample_shape=header.sample_shape if header is not None else None
    )
    return Plan(
        spec=spec, mode="train", devices=tuple(devices), pipeline=pipeline, data=data, stages=stage_plan_
    )


# -- the whole model's state from the stages', and back -----------------------------------------


def _param_map(device: DevicePlan, full: dict[str, int]) -> tuple[tuple[str, int, int, int], ...]:
    own, _ = param_offsets(list(device.parameters))
    return tuple((p.name, own[p.name], full[p.name], math.prod(p.shape)) for p in device.parameters)


def merge_state(plan: StagePlan, states: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The whole model's flat state (what one device's run would checkpoint) from each stage's; the
    loss scale's state, the same on every stage, once."""
    merged = {name: np.zeros(plan.total_params, np.float32) for name in states[0] if name != LOSS_SCALE}
    for mapping, state in zip(plan.params, states, strict=True):
        for _, own, full, floats in mapping:
            for name in merged:
                merged[name][full : full + floats] = state[name][own : own + floats]
    return merged | ({LOSS_SCALE: states[-1][LOSS_SCALE]} if LOSS_SCALE in states[-1] else {})


def stage_state(plan: StagePlan, stage: int, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stage ``stage``'s part of the whole model's flat state (a checkpoint's); every stage takes
    the loss scale's state whole."""
    mapping = plan.params[stage]
    parts = {name: np.zeros(plan.stage_floats[stage], np.float32) for name in state if name != LOSS_SCALE}
    for _, own, full, floats in mapping:
        for name in parts:
            flat = state[name]
            if flat.size < full + floats:
                raise ValueError(f"{name} holds {flat.size} floats; the model needs {plan.total_params}")
            parts[name][own : own + floats] = flat[full : full + floats]
    return parts | ({LOSS_SCALE: state[LOSS_SCALE]} if LOSS_SCALE in state else {})


def fresh_state(spec: Spec, plan: StagePlan) -> dict[str, np.ndarray]:
    """A fresh run's whole state: the weights one device would draw (the same draws in the same
    order, so a split model starts where one device would), and zeroed optimiser state."""
    params = parameters(spec.model)
    values = init_parameters(params, spec.model.init.scheme, spec.model.init.seed)
    offsets, total = param_offsets(params)
    flat = np.zeros(total, np.float32)
    for p in params:
        flat[offsets[p.name] : offsets[p.name] + math.prod(p.shape)] = values[p.name].reshape(-1)
    state = {"params:all": flat}
    for name in optimiser_state_names(spec.optimiser):
        state[f"state:{name}"] = np.zeros(total, np.float32)
    return state

"""Each spec record's own rules, as the validator applies them once a record's fields have passed
their type checks (:mod:`flow.validation`): ranges, fields that must agree, and what spans records
(layer shapes and the loss against the last layer, the pipeline's graph and its cycles, the schema
version). A rule sees a :class:`Rule`: the record, its path, and which fields passed; it checks only
those, so one mistake is reported once and never crashes a later rule. Pure.
"""

import math
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from flow.errors import did_you_mean
from flow.metrics import metric_name
from flow.model_graph import expand
from flow.shapes import count_parameters
from flow.spec import (
    SCHEMA_VERSION,
    SGD,
    Adam,
    AdamW,
    Constant,
    Cosine,
    Devices,
    EarlyStopping,
    Edge,
    Node,
    Pipeline,
    RunSettings,
    SaveBest,
    Spec,
    StepLR,
    file_key,
)
from flow.spec_data import (
    CSV,
    IDX,
    Arrays,
    Custom,
    Data,
    HorizontalFlip,
    ImageFolder,
    Lambda,
    Normalize,
    RandomCrop,
    RawBinary,
    Resize,
    Split,
    Synthetic,
    Text,
)
from flow.spec_model import (
    L1,
    MAX_EMBEDDINGS,
    MSE,
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    Conv1d,
    Conv2d,
    CrossEntropy,
    Dropout,
    Embedding,
    Huber,
    Init,
    LayerNorm,
    Linear,
    MaxPool2d,
    Model,
    Perplexity,
    Repeat,
    Reshape,
    Residual,
    SelfAttention,
    Softmax,
    TopK,
)


def join(path: str, name: str) -> str:
    """The path of ``name`` inside ``path`` ('' is the spec itself)."""
    return f"{path}.{name}" if path else name


def show(value: Any) -> str:
    """A value for a problem's message, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Walk(Protocol):
    """What the rules report to: the validator's walk over a spec (flow.validation)."""

    def add(self, path: str, message: str) -> None: ...

    def bad(self, path: str) -> bool: ...


class Rule:
    """What a record's rule sees: the record, its path, and which fields passed their checks."""

    def __init__(self, walk: Walk, obj: Any, path: str, clean: set[str]) -> None:
        self.walk, self.obj, self.path, self.clean = walk, obj, path, clean

    def good(self, *names: str) -> bool:
        """Whether these fields passed their checks and no rule has found a problem in them yet."""
        return all(n in self.clean and not self.walk.bad(self.where(n)) for n in names)

    def where(self, name: str) -> str:
        """The path of a field (or of something inside it, e.g. 'layers[2]')."""
        return join(self.path, file_key(type(self.obj), name)) if name else self.path

    def need(self, name: str, test: Callable[[Any], bool], message: str) -> None:
        """Add '<message>, got <value>' unless the field is unchecked, None, or passes the test."""
        value = getattr(self.obj, name)
        if name in self.clean and value is not None and not test(value):
            self.add(name, f"{message}, got {show(value)}")

    def add(self, name: str, message: str) -> None:
        self.walk.add(self.where(name), message)


def _positive(v: Any) -> bool:
    return v > 0


def _non_negative(v: Any) -> bool:
    return v >= 0


def _filled(v: Any) -> bool:
    return len(v) > 0


def _sizes(v: Any) -> bool:
    return all(d > 0 for d in v)


def _column(v: Any) -> bool:
    return v >= 0 if isinstance(v, int) else v != ""


def layer_links(r: Rule) -> None:
    """Every layer's name and inputs (whether they name layers that exist is the model's rule)."""
    r.need("name", _filled, "must not be empty")
    r.need("inputs", _filled, "must name at least one layer, or be None for the previous one")
    if r.good("inputs") and r.obj.inputs is not None:
        for i, name in enumerate(r.obj.inputs):
            if name == "":
                r.add(f"inputs[{i}]", "must not be empty")


def _block(r: Rule) -> None:
    r.need("layers", _filled, "must hold at least one layer")
    if isinstance(r.obj, Repeat):
        r.need("times", _positive, "must be > 0")


def _reshape(r: Rule) -> None:
    r.need("shape", _filled, "must not be empty")
    r.need("shape", lambda s: all(d > 0 or d == -1 for d in s), "sizes must be > 0, or -1")
    r.need("shape", lambda s: list(s).count(-1) <= 1, "may hold one -1 at most")


def _attention(r: Rule) -> None:
    r.need("heads", _positive, "must be > 0")


def _linear(r: Rule) -> None:
    r.need("units", _positive, "must be > 0")


def _conv2d(r: Rule) -> None:
    for name in ("channels", "kernel", "stride"):
        r.need(name, _positive, "must be > 0")
    r.need("padding", _non_negative, "must be >= 0")


def _conv1d(r: Rule) -> None:
    for name in ("channels", "kernel", "stride"):
        r.need(name, _positive, "must be > 0")
    r.need("padding", _non_negative, "must be >= 0")


def _max_pool(r: Rule) -> None:
    r.need("kernel", _positive, "must be > 0")
    r.need("stride", _positive, "must be > 0")


def _avg_pool(r: Rule) -> None:
    _max_pool(r)
    r.need("padding", _non_negative, "must be >= 0")
    # As PyTorch: more padding would let a window lie wholly in the zeros.
    if r.good("kernel", "padding") and r.obj.padding > r.obj.kernel // 2:
        r.add("padding", f"must be at most kernel // 2 ({r.obj.kernel // 2}), got {r.obj.padding}")


def _batch_norm(r: Rule) -> None:
    r.need("momentum", lambda m: 0 <= m <= 1, "must be in [0, 1]")
    r.need("eps", _positive, "must be > 0")


def _layer_norm(r: Rule) -> None:
    r.need("eps", _positive, "must be > 0")


def _dropout(r: Rule) -> None:
    # p = 1 would zero everything and scale by 1 / 0; PyTorch allows it, but it cannot learn.
    r.need("p", lambda p: 0 <= p < 1, "must be in [0, 1)")


def _embedding(r: Rule) -> None:
    r.need("dim", _positive, "must be > 0")
    r.need("num_embeddings", _positive, "must be > 0")
    r.need(
        "num_embeddings",
        lambda v: v <= MAX_EMBEDDINGS,
        f"must be at most 2**24 = {MAX_EMBEDDINGS} (ids come as float32, exact only up to 2**24)",
    )


def _init(r: Rule) -> None:
    r.need("seed", _non_negative, "must be >= 0")
    r.need("from_file", lambda v: v.endswith(".safetensors"), "must name a .safetensors file")


def _metrics(r: Rule, model: Model) -> None:
    """Each metric against the loss (TopK and Perplexity: CrossEntropy; MAE, RMSE: a float target's
    MSE, L1 or Huber), each once."""
    seen: set[str] = set()
    for i, metric in enumerate(model.metrics if "metrics" in r.clean and r.good("loss") else ()):
        name = metric_name(metric)
        wants = (CrossEntropy,) if isinstance(metric, TopK | Perplexity) else (MSE, L1, Huber)
        if not isinstance(model.loss, wants):
            needed = "a CrossEntropy" if CrossEntropy in wants else "an MSE, L1 or Huber"
            r.add(f"metrics[{i}]", f"{type(metric).__name__} needs {needed} loss, got {show(model.loss)}")
        if name in seen:
            r.add(f"metrics[{i}]", f"{name} is already among the metrics")
        seen.add(name)


def _model(r: Rule) -> None:
    model: Model = r.obj
    _metrics(r, model)
    r.need("input_shape", _filled, "must not be empty")
    r.need("input_shape", _sizes, "every size must be > 0")
    if not r.good("input_shape") or not isinstance(model.layers, tuple):
        return
    # Shapes are only traced through layers that are themselves fine.
    layers = model.layers
    fine = next((i for i in range(len(layers)) if r.walk.bad(r.where(f"layers[{i}]"))), len(layers))
    expansion = expand(replace(model, layers=layers[:fine]), check_unused=fine == len(layers))
    for problem in expansion.problems:
        r.add(problem.path, problem.message)
    if expansion.problems or fine < len(layers) or not isinstance(model.loss, CrossEntropy):
        return
    output = expansion.output
    last = expansion.nodes[output].out_shape if output >= 0 else tuple(model.input_shape)
    where = f"layers[{len(layers) - 1}]" if layers else "loss"
    if len(last) < 1 or last[-1] < 2:
        r.add(where, f"CrossEntropy needs an output whose last dimension has >= 2 classes, got shape {last}")
    weights = model.loss.class_weights
    if last and r.good("loss") and weights is not None and len(weights) != last[-1]:
        r.add("loss.class_weights", f"must hold one weight per class ({last[-1]}), got {len(weights)}")
    for i, metric in enumerate(model.metrics if "metrics" in r.clean and last else ()):
        if isinstance(metric, TopK) and metric.k > last[-1]:
            r.add(f"metrics[{i}].k", f"must be <= the classes ({last[-1]}), got {metric.k}")
    if layers and isinstance(layers[-1], Softmax):
        r.add(where, "remove this Softmax: CrossEntropy applies softmax itself, fused with the loss")


def _cross_entropy(r: Rule) -> None:
    r.need("label_smoothing", lambda s: 0 <= s <= 1, "must be in [0, 1]")
    r.need("class_weights", _filled, "must not be empty (None weighs every class 1)")
    r.need("class_weights", lambda ws: all(0 <= w < math.inf for w in ws), "each must be finite and >= 0")


def _top_k(r: Rule) -> None:
    r.need("k", _positive, "must be >= 1")


def _huber(r: Rule) -> None:
    r.need("delta", lambda d: 0 < d < math.inf, "must be finite and > 0")


def _warmup(r: Rule) -> None:
    r.need("warmup_steps", _non_negative, "must be >= 0")


def _step_lr(r: Rule) -> None:
    r.need("step_size", _positive, "must be > 0")
    r.need("gamma", _positive, "must be > 0")
    _warmup(r)


def _cosine(r: Rule) -> None:
    r.need("total_steps", _positive, "must be > 0")
    r.need("min_lr", _non_negative, "must be >= 0")
    _warmup(r)
    if r.good("total_steps", "warmup_steps") and r.obj.warmup_steps >= r.obj.total_steps:
        r.add("warmup_steps", f"must be < total_steps ({r.obj.total_steps}), got {r.obj.warmup_steps}")


def _optimiser(r: Rule) -> None:
    r.need("lr", _positive, "must be > 0")
    r.need("weight_decay", _non_negative, "must be >= 0")
    r.need("clip_norm", _positive, "must be > 0 (or null: no clipping)")
    if isinstance(r.obj, SGD):
        r.need("momentum", lambda m: 0 <= m < 1, "must be in [0, 1)")
        if r.good("momentum", "nesterov") and r.obj.nesterov and r.obj.momentum == 0:
            r.add("nesterov", "needs momentum > 0")
    else:
        r.need("betas", lambda b: all(0 <= x < 1 for x in b), "each must be in [0, 1)")
        r.need("eps", _positive, "must be > 0")
    schedule = r.obj.schedule
    if (
        r.good("lr")
        and isinstance(schedule, Cosine)
        and not r.walk.bad(r.where("schedule.min_lr"))
        and schedule.min_lr > r.obj.lr
    ):
        r.add("schedule.min_lr", f"must be <= lr ({r.obj.lr}), got {schedule.min_lr}")


def _path(r: Rule, name: str) -> None:
    # Only the string: whether the file exists is for the loader to say, at load time.
    r.need(name, _filled, "must not be empty")


def _image_folder(r: Rule) -> None:
    _path(r, "root")
    _path(r, "labels_csv")
    r.need("size", _sizes, "every size must be > 0")
    r.need("workers", _positive, "must be > 0")


def _csv(r: Rule) -> None:
    _path(r, "path")
    r.need("label_column", _column, "must be a column index >= 0 or a non-empty name")
    r.need("feature_columns", _filled, "must not be empty (None means every other column)")
    r.need("feature_columns", lambda cs: all(_column(c) for c in cs), "must be indices >= 0 or names")
    r.need("chunk_rows", _positive, "must be > 0")
    obj = r.obj
    if r.good("header", "label_column", "feature_columns") and not obj.header:
        named = [c for c in (obj.label_column, *(obj.feature_columns or ())) if isinstance(c, str)]
        if named:
            r.add("header", f"columns named {named} need header=True; without one use column indices")
    if r.good("label_column", "feature_columns") and obj.label_column in (obj.feature_columns or ()):
        r.add("feature_columns", f"must not include the label column {obj.label_column!r}")


def _raw_binary(r: Rule) -> None:
    _path(r, "path")
    _path(r, "labels_path")
    r.need("shape", _filled, "must not be empty")
    r.need("shape", _sizes, "every size must be > 0")


def _idx(r: Rule) -> None:
    _path(r, "images")
    _path(r, "labels")


def _synthetic(r: Rule) -> None:
    r.need("samples", _positive, "must be > 0")
    r.need("features", _filled, "must not be empty")
    r.need("features", _sizes, "every size must be > 0")
    r.need("seed", _non_negative, "must be >= 0")
    if r.good("task") and r.obj.task == "classification":
        r.need("classes", lambda c: c >= 2, "must be >= 2")


def _text(r: Rule) -> None:
    # Whether the file exists, decodes and holds a window is for the loader (flow check opens it).
    _path(r, "path")
    r.need("context", _positive, "must be > 0")
    r.need("stride", _positive, "must be > 0")


def _arrays(r: Rule) -> None:
    obj = r.obj
    if not r.good("x", "y", "path"):
        return
    if obj.path is not None:
        _path(r, "path")
        for name in ("x", "y"):
            if getattr(obj, name) is not None:
                r.add(name, "must be None when path is given (the .npz file holds x and y)")
        return
    missing = [name for name in ("x", "y") if getattr(obj, name) is None]
    for name in missing:
        r.add(name, "is required: an array or a .npy file (or give path, a .npz file of x and y)")
    if missing:
        return
    if isinstance(obj.x, str) != isinstance(obj.y, str):
        r.add("", "x and y must both be arrays or both be file names")
    elif isinstance(obj.x, str):
        _path(r, "x")
        _path(r, "y")
    else:
        from loaders.arrays import array_problems  # numpy is loaded already: these are its arrays

        for name, message in array_problems(obj.x, obj.y):
            r.add(name, message)


def _normalize(r: Rule) -> None:
    r.need("mean", _filled, "must not be empty")
    r.need("std", _filled, "must not be empty")
    r.need("std", lambda s: all(x > 0 for x in s), "every value must be > 0")
    if r.good("mean", "std") and len(r.obj.mean) != len(r.obj.std):
        r.add("std", f"must have as many values as mean ({len(r.obj.mean)}), got {len(r.obj.std)}")


def _random_crop(r: Rule) -> None:
    r.need("size", _sizes, "every size must be > 0")
    r.need("padding", _non_negative, "must be >= 0")


def _flip(r: Rule) -> None:
    r.need("p", lambda p: 0 <= p <= 1, "must be in [0, 1]")


def _resize(r: Rule) -> None:
    r.need("size", _sizes, "every size must be > 0")


def _split(r: Rule) -> None:
    for name in ("train", "val", "test"):
        r.need(name, lambda f: 0 <= f <= 1, "must be in [0, 1]")
    r.need("train", _positive, "must be > 0")
    if r.good("train", "val", "test"):
        total = r.obj.train + r.obj.val + r.obj.test
        if abs(total - 1.0) > 1e-6:
            r.add("", f"train + val + test must be 1, got {total:g}")


def _data(r: Rule) -> None:
    r.need("batch_size", _positive, "must be > 0")
    r.need("seed", _non_negative, "must be >= 0")
    if r.good("source", "split") and isinstance(r.obj.source, Text) and r.obj.split.stratify:
        r.add("split.stratify", "must be false for a Text source: its splits are contiguous runs of the file")


_ONE_DEVICE = "must be 'auto', 'cpu', 'all', a device index >= 0 or a non-empty device name"


def _devices(r: Rule) -> None:
    select = r.obj.select if r.good("select") else None
    if isinstance(select, tuple):
        if not select:
            r.add("select", "must name at least one device")
        for i, choice in enumerate(select):
            if choice in ("auto", "all"):
                r.add(f"select[{i}]", f"{choice!r} stands alone, not inside a list of devices")
            elif not _column(choice):
                r.add(f"select[{i}]", _ONE_DEVICE.replace("'all', ", ""))
    else:
        r.need("select", _column, _ONE_DEVICE)
    shares = r.obj.shares if r.good("shares") else None
    if shares is not None and select is not None:
        if not isinstance(select, tuple):
            r.add("shares", "needs a list of devices in select, one share each")
        elif len(shares) != len(select):
            r.add("shares", f"has {len(shares)} entries for {len(select)} devices; give one per device")
        for i, share in enumerate(shares):
            if not share > 0:
                r.add(f"shares[{i}]", f"must be > 0, got {share!r}")
    r.need("memory_fraction", lambda f: 0 < f <= 1, "must be in (0, 1]")
    r.need("bucket_mb", lambda mb: mb > 0, "must be > 0 (MiB of gradients summed at a time)")
    _stages(r, select)


def _stages(r: Rule, select) -> None:
    """A model split over the devices (flow.stage_plan): what the devices alone can say; the
    layers' count and the places a model can be cut are checked where the model is planned."""
    stages = r.obj.stages if r.good("stages") else None
    r.need("micro_batches", lambda m: m >= 1, "must be >= 1")
    if stages is None:
        if r.good("micro_batches") and r.obj.micro_batches != 1:
            r.add("micro_batches", "needs stages: micro-batches go through a model split over devices")
        return
    if not (isinstance(select, tuple) and len(select) > 1) and select != "all":
        r.add("stages", "needs a list of two or more devices in select (or 'all'), one a stage")
    if r.obj.shares is not None:
        r.add("shares", "is for data parallel; a model split into stages shares no batch")
    if isinstance(stages, tuple):
        for i, device in enumerate(stages):
            if isinstance(select, tuple) and not 0 <= device < len(select):
                r.add(f"stages[{i}]", f"must be a place in select's list of devices, got {device!r}")
            elif i and device < stages[i - 1]:
                r.add(f"stages[{i}]", f"must not go back to an earlier device ({stages[i - 1]} before it)")
        if isinstance(select, tuple) and set(stages) != set(range(len(select))):
            unused = sorted(set(range(len(select))) - set(stages))
            r.add("stages", f"gives no layer to device {unused[0] if unused else '?'} of select")


def _node(r: Rule) -> None:
    r.need("name", _filled, "must not be empty")
    r.need("device", _non_negative, "must be >= 0")
    r.need("workers", _positive, "must be > 0")


def _edge(r: Rule) -> None:
    r.need("capacity", _positive, "must be > 0 (channels are always bounded)")


def _pipeline(r: Rule) -> None:
    nodes, edges = r.obj.nodes, r.obj.edges
    if not isinstance(nodes, tuple) or not isinstance(edges, tuple):
        return
    names: list[str] = []
    for i, node in enumerate(nodes):
        if isinstance(node, Node) and isinstance(node.name, str):
            if node.name in names:
                r.add(f"nodes[{i}].name", f"duplicate node name {node.name!r}")
            names.append(node.name)
    for i, edge in enumerate(edges):
        for end in ("src", "dst"):
            name = getattr(edge, end, None)
            if isinstance(edge, Edge) and isinstance(name, str) and name not in names:
                hint = did_you_mean(name, names) or f"; nodes are {', '.join(dict.fromkeys(names))}"
                r.add(f"edges[{i}].{end}", f"unknown node {name!r}{hint}")
    # Credit edges are left out: a cycle is only a deadlock risk if none of its edges has credits.
    links = [e for e in edges if isinstance(e, Edge) and not e.credit and e.src in names and e.dst in names]
    for cycle in _cycles(names, links):
        r.add(
            "edges",
            f"cycle {' -> '.join(cycle)} has no credit edge; bounded channels in a cycle can deadlock: "
            "mark one of its edges credit=True",
        )


def _cycles(names: list[str], edges: list[Edge]) -> list[list[str]]:
    """One cycle for each set of nodes that forms one, found by depth-first search."""
    graph: dict[str, list[str]] = {n: [] for n in names}
    for edge in edges:
        graph[edge.src].append(edge.dst)
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()
    state: dict[str, str] = {}  # "open" while on the current path, then "done"
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt) :]
                if frozenset(cycle) not in seen:
                    seen.add(frozenset(cycle))
                    found.append([*cycle, nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for name in graph:
        if name not in state:
            visit(name)
    return found


def _run(r: Rule) -> None:
    for name in ("epochs", "steps", "eval_every", "checkpoint_every", "in_flight", "metrics_every"):
        r.need(name, _positive, "must be > 0")
    r.need("keep_checkpoints", _positive, "must be > 0 (or null to keep every checkpoint)")
    limit = "must be an int > 0 (batches) or a float in (0, 1] (a fraction of the batches)"
    r.need("limit_val_batches", lambda v: v > 0 and (isinstance(v, int) or v <= 1), limit)
    _path(r, "checkpoint_dir")
    _path(r, "metrics_file")
    r.need(
        "loss_scale",
        lambda v: isinstance(v, str) or (v > 0 and math.isfinite(v)),
        'must be "auto", "off" or a finite number > 0',
    )
    obj = r.obj
    if r.good("epochs", "steps") and obj.epochs is None and obj.steps is None:
        r.add("", "set epochs or steps: with neither the run never ends")
    if r.good("checkpoint_every", "checkpoint_dir") and obj.checkpoint_every and obj.checkpoint_dir is None:
        r.add("checkpoint_every", "needs checkpoint_dir")


MONITOR = re.compile(r"val_(loss|accuracy|top[0-9]+|mae|rmse|perplexity)")


def monitor_problem(monitor: str, model: Model, has_val: bool, val: str) -> str | None:
    """Why a run would never produce ``monitor`` (None when it does): shared by the spec's callback
    records and the Python callbacks (flow.callbacks), which check it before any device work.

    Args:
        monitor: "val_loss", "val_accuracy" or "val_" and a metric's name.
        model: the run's model.
        has_val: whether the run has validation samples.
        val: where the validation split is set and its value, for the message.
    """
    if not MONITOR.fullmatch(monitor):
        return (
            f"must be 'val_loss' or 'val_accuracy', got {monitor!r} (or 'val_' and one of the "
            "model's metrics: 'val_top5', 'val_mae', 'val_rmse', 'val_perplexity')"
        )
    if not has_val:
        return (
            f"{monitor!r} watches the validation split, but this run has no validation samples "
            f"({val}): give it > 0"
        )
    if monitor == "val_accuracy" and not isinstance(model.loss, CrossEntropy):
        return f"{monitor!r} needs a classifier (CrossEntropy), got {show(model.loss)}"
    named = {f"val_{metric_name(m)}" for m in model.metrics}
    if monitor not in ("val_loss", "val_accuracy", *named):
        return f"{monitor!r} names none of model.metrics {sorted(named) or '(none)'}"
    return None


def _early_stopping(r: Rule) -> None:
    r.need("patience", lambda v: v >= 0, "must be an int >= 0")
    r.need("min_delta", lambda v: math.isfinite(v) and v >= 0, "must be finite and >= 0")


def _callbacks(r: Rule) -> None:
    """Each callback record against the run: a monitor it produces, a folder for best.ckpt."""
    spec = r.obj
    split = spec.data.split if r.good("data") else None
    has_val = split is None or not isinstance(split.val, float | int) or split.val > 0
    val = f"data.split.val is {show(split.val) if split is not None else '?'}"
    for i, record in enumerate(spec.run.callbacks if r.good("run") else ()):
        where = f"run.callbacks[{i}]"
        if r.good("model") and isinstance(spec.model, Model):
            problem = monitor_problem(record.monitor, spec.model, has_val, val)
            if problem is not None:
                r.add(f"{where}.monitor", problem)
        if isinstance(record, SaveBest) and spec.run.checkpoint_dir is None:
            r.add(where, "SaveBest writes best.ckpt into run.checkpoint_dir, which is None: set it")
        elif isinstance(record, SaveBest) and any(isinstance(c, SaveBest) for c in spec.run.callbacks[:i]):
            r.add(where, "a second SaveBest: one best.ckpt holds one monitor's best round")


def _spec(r: Rule) -> None:
    r.need("version", lambda v: v == SCHEMA_VERSION, f"must be {SCHEMA_VERSION}")
    model = r.obj.model
    if r.good("model") and count_parameters(model) == 0:
        r.add("model.layers", "the model has no parameters to train")
    if isinstance(model, Model) and model.loss is None:
        r.add("model.loss", "a training spec needs a loss: CrossEntropy() or MSE()")
    _callbacks(r)
    held = _in_python(r.obj.data) if r.good("data", "run") else []
    if held and r.obj.run.checkpoint_dir is not None:  # refused now, not at the first checkpoint
        r.add(
            "run.checkpoint_dir",
            f"cannot be written: a checkpoint holds its spec, and {held[0]} is data or a function in "
            "memory, which a file cannot hold (set checkpoint_dir=None, or use data in files)",
        )


def _in_python(data: Data) -> list[str]:
    """The paths of a Data's parts that live only in this process: arrays or objects in memory, and
    functions."""
    source = data.source
    found = ["data.source"] if isinstance(source, Custom) else []
    if isinstance(source, Arrays) and source.path is None and not isinstance(source.x, str):
        found.append("data.source")
    for field in ("preprocess", "augment"):
        found += [f"data.{field}[{i}]" for i, t in enumerate(getattr(data, field)) if isinstance(t, Lambda)]
    return found


RULES: dict[type, Callable[[Rule], None]] = {
    Linear: _linear,
    Conv2d: _conv2d,
    Conv1d: _conv1d,
    MaxPool2d: _max_pool,
    AvgPool2d: _avg_pool,
    BatchNorm1d: _batch_norm,
    BatchNorm2d: _batch_norm,
    LayerNorm: _layer_norm,
    Dropout: _dropout,
    Embedding: _embedding,
    SelfAttention: _attention,
    Reshape: _reshape,
    Residual: _block,
    Repeat: _block,
    Init: _init,
    CrossEntropy: _cross_entropy,
    Huber: _huber,
    TopK: _top_k,
    Model: _model,
    Constant: _warmup,
    StepLR: _step_lr,
    Cosine: _cosine,
    SGD: _optimiser,
    Adam: _optimiser,
    AdamW: _optimiser,
    ImageFolder: _image_folder,
    CSV: _csv,
    RawBinary: _raw_binary,
    IDX: _idx,
    Synthetic: _synthetic,
    Arrays: _arrays,
    Text: _text,
    Normalize: _normalize,
    RandomCrop: _random_crop,
    HorizontalFlip: _flip,
    Resize: _resize,
    Split: _split,
    Data: _data,
    Devices: _devices,
    Node: _node,
    Edge: _edge,
    Pipeline: _pipeline,
    EarlyStopping: _early_stopping,
    RunSettings: _run,
    Spec: _spec,
}

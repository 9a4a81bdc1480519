"""Validation of a spec: pure, and it returns every problem, each with its path.

A spec may come from a file or be built in Python with any object in any field, so validation
first checks each value against its field's annotation (types, literals, tuple lengths, finite
numbers), then each record's own rules (ranges, fields that must agree), then what spans records:
layer shapes, the loss against the last layer, the pipeline's graph. A rule only looks at fields
that passed the checks before it, so one mistake is reported once and never crashes a later rule.
"""

import math
from collections.abc import Callable
from dataclasses import MISSING, fields, is_dataclass
from types import NoneType, UnionType
from typing import Any, Literal, Union, get_args, get_origin

from flow.errors import Problem, SpecError, did_you_mean
from flow.shapes import count_parameters, infer_shapes, layer_parameters, trace
from flow.spec import (
    CSV,
    IDX,
    SCHEMA_VERSION,
    SGD,
    Adam,
    AdamW,
    Constant,
    Conv2d,
    Cosine,
    CrossEntropy,
    Data,
    Devices,
    Edge,
    HorizontalFlip,
    ImageFolder,
    Init,
    Linear,
    MaxPool2d,
    Model,
    Node,
    Normalize,
    Pipeline,
    RandomCrop,
    RawBinary,
    Resize,
    RunSettings,
    Softmax,
    Spec,
    Split,
    StepLR,
    Synthetic,
    file_key,
)


def alternatives(annotation: Any) -> tuple[Any, ...]:
    """The alternatives a field annotation allows: the members of a union, else the annotation.

    Args:
        annotation: a field's type, e.g. ``int | None`` or ``tuple[Layer, ...]``.

    Returns:
        The alternatives, in order, with None as ``NoneType``.
    """
    if isinstance(annotation, UnionType) or get_origin(annotation) is Union:
        return tuple(a for member in get_args(annotation) for a in alternatives(member))
    return (annotation,)


def validate(spec: Spec) -> list[Problem]:
    """Every problem with a spec.

    Args:
        spec: the spec, from a file or built in Python.

    Returns:
        The problems, in the order of the spec's fields; empty when the spec is valid.
    """
    walk = _Walk()
    walk.check(spec, Spec, "")
    return walk.problems


def check(spec: Spec) -> None:
    """Raise unless a spec is valid.

    Args:
        spec: the spec.

    Raises:
        SpecError: listing every problem, one per line.
    """
    problems = validate(spec)
    if problems:
        raise SpecError(problems)


def data_problems(
    spec: Spec,
    sample_shape: tuple[int, ...],
    num_classes: int | None,
    label_shape: tuple[int, ...] = (),
) -> list[Problem]:
    """What is wrong between an opened source and the model, found before any device work.

    Args:
        spec: a valid spec.
        sample_shape: the source's decoded sample shape.
        num_classes: how many classes its labels hold (None for regression targets).
        label_shape: the shape of one sample's label (every source today gives one number: ()).

    Returns:
        Every problem: a sample shape the model cannot take (checked when no transform resizes or
        crops), class labels beyond the last layer's units for CrossEntropy, and labels that are
        not one target per output for MSE.
    """
    problems = []
    transforms = (*spec.data.preprocess, *spec.data.augment)
    reshaping = any(type(t).__name__ in ("Resize", "RandomCrop") for t in transforms)
    if not reshaping and tuple(sample_shape) != tuple(spec.model.input_shape):
        problems.append(
            Problem(
                "model.input_shape",
                f"the source gives samples of shape {tuple(sample_shape)}, "
                f"but the model takes {tuple(spec.model.input_shape)}",
            )
        )
    shapes = infer_shapes(spec.model)
    outputs = shapes[-1] if shapes else tuple(spec.model.input_shape)
    if (
        type(spec.model.loss).__name__ == "CrossEntropy"
        and num_classes is not None
        and num_classes > outputs[-1]
    ):
        problems.append(
            Problem(
                f"model.layers[{len(spec.model.layers) - 1}]",
                f"the source has {num_classes} classes, but the model ends in {outputs[-1]} outputs",
            )
        )
    # MSE compares each output with its own target. One label a sample against 10 outputs would
    # fill only the first rows' targets and train on nonsense without a word, so it is an error.
    if type(spec.model.loss).__name__ == "MSE" and math.prod(label_shape) != math.prod(outputs):
        labels = math.prod(label_shape)
        given = "one label" if labels == 1 else f"{labels} labels"
        kind = f"class ids of {num_classes} classes" if num_classes is not None else "targets"
        hint = "; for class labels use CrossEntropy()" if num_classes is not None else ""
        problems.append(
            Problem(
                "model.loss",
                f"MSE needs one target per output, but the model ends in {math.prod(outputs)} outputs "
                f"and the source gives {given} a sample ({kind}){hint}",
            )
        )
    return problems


def summarize(spec: Spec) -> str:
    """A few lines for people: each layer with its output shape and parameters, and the totals.

    Args:
        spec: a valid spec.

    Returns:
        The summary, without a trailing newline.
    """
    model = spec.model
    shapes = infer_shapes(model)
    inputs = [tuple(model.input_shape), *shapes]
    rows = [
        (f"[{i}] {_brief(layer)}", str(shape), f"{layer_parameters(layer, inputs[i]):,}")
        for i, (layer, shape) in enumerate(zip(model.layers, shapes, strict=True))
    ]
    rows.insert(0, ("layer", "output", "parameters"))
    wide = [max(len(row[c]) for row in rows) for c in range(3)]
    total = count_parameters(model)
    lines = [f"model: input {tuple(model.input_shape)} {model.input_dtype}, loss {_brief(model.loss)}"]
    lines += [f"  {a:<{wide[0]}}  {b:<{wide[1]}}  {c:>{wide[2]}}" for a, b, c in rows]
    # Master weights are float32 whatever the input dtype, so 4 bytes per parameter.
    lines.append(f"parameters: {total:,} ({4 * total:,} bytes as float32)")
    lines.append(f"optimiser: {_brief(spec.optimiser)}")
    lines.append(f"data: {_brief(spec.data)}")
    return "\n".join(lines)


def _brief(value: Any) -> str:
    """A record as Python would write it, leaving out keyword fields at their defaults."""
    if isinstance(value, tuple):
        inner = ", ".join(_brief(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if not is_dataclass(value):
        return repr(value)
    parts = []
    for f in fields(value):
        item = getattr(value, f.name)
        if not f.kw_only:
            parts.append(_brief(item))
        elif f.default is MISSING or item != f.default:
            parts.append(f"{f.name}={_brief(item)}")
    return f"{type(value).__name__}({', '.join(parts)})"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(annotation: Any) -> str:
    """An annotation in words, for 'must be ...' messages."""
    options = alternatives(annotation)
    records = [o.__name__ for o in options if is_dataclass(o)]
    words = []
    if records:
        words.append(f"a {records[0]}" if len(records) == 1 else "one of " + ", ".join(records))
    for option in options:
        if option is NoneType:
            words.append("None")
        elif get_origin(option) is Literal:
            words.append("one of " + ", ".join(repr(a) for a in get_args(option)))
        elif get_origin(option) is tuple:
            args = get_args(option)
            words.append("a tuple" if args[-1] is Ellipsis else f"a tuple of {len(args)}")
        elif not is_dataclass(option):
            words.append({int: "an int", float: "a number", str: "a string", bool: "a bool"}[option])
    return " or ".join(words)


def _hint(value: Any, annotation: Any) -> str:
    """'; did you mean ...?' for a string close to one of the literals allowed."""
    allowed = [a for o in alternatives(annotation) if get_origin(o) is Literal for a in get_args(o)]
    return did_you_mean(value, allowed)


def _matches(value: Any, option: Any) -> bool:
    """Whether a value has the shape of one alternative (its contents are checked afterwards)."""
    if option is NoneType:
        return value is None
    if get_origin(option) is Literal:
        return any(type(value) is type(a) and value == a for a in get_args(option))
    if get_origin(option) is tuple:
        return isinstance(value, tuple)
    if option is float:  # an int is a fine float; bool is an int to Python but never a number here
        return isinstance(value, int | float) and not isinstance(value, bool)
    if option is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, option)


class _Walk:
    """Walks a spec against its annotations, collecting problems."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def add(self, path: str, message: str) -> None:
        self.problems.append(Problem(path, message))

    def bad(self, path: str) -> bool:
        return any(p.within(path) for p in self.problems)

    def check(self, value: Any, annotation: Any, path: str) -> bool:
        """Check a value and everything inside it; True when that added no problem."""
        start = len(self.problems)
        option = next((o for o in alternatives(annotation) if _matches(value, o)), None)
        if option is None:
            self.add(path, f"must be {_describe(annotation)}, got {_show(value)}{_hint(value, annotation)}")
        elif isinstance(value, float) and not math.isfinite(value):
            self.add(path, f"must be finite, got {value}")
        elif isinstance(value, int) and not -(2**63) <= value < 2**63:
            self.add(path, f"must fit in 64 bits (msgpack's limit), got {_show(value)}")
        elif get_origin(option) is tuple:
            args = get_args(option)
            if args[-1] is Ellipsis:
                for i, item in enumerate(value):
                    self.check(item, args[0], f"{path}[{i}]")
            elif len(value) != len(args):
                self.add(path, f"must have {len(args)} items, got {len(value)}")
            else:
                for i, (item, arg) in enumerate(zip(value, args, strict=True)):
                    self.check(item, arg, f"{path}[{i}]")
        elif is_dataclass(option):
            self.record(value, path)
        return len(self.problems) == start

    def record(self, obj: Any, path: str) -> None:
        cls = type(obj)
        clean = {
            f.name
            for f in fields(obj)
            if self.check(getattr(obj, f.name), f.type, _join(path, file_key(cls, f.name)))
        }
        rule = _RULES.get(cls)
        if rule is not None:
            rule(_Rule(self, obj, path, clean))


class _Rule:
    """What a record's rule sees: the record, its path, and which fields passed their checks."""

    def __init__(self, walk: _Walk, obj: Any, path: str, clean: set[str]) -> None:
        self.walk, self.obj, self.path, self.clean = walk, obj, path, clean

    def good(self, *names: str) -> bool:
        """Whether these fields passed their checks and no rule has found a problem in them yet."""
        return all(n in self.clean and not self.walk.bad(self.where(n)) for n in names)

    def where(self, name: str) -> str:
        """The path of a field (or of something inside it, e.g. 'layers[2]')."""
        return _join(self.path, file_key(type(self.obj), name)) if name else self.path

    def need(self, name: str, test: Callable[[Any], bool], message: str) -> None:
        """Add '<message>, got <value>' unless the field is unchecked, None, or passes the test."""
        value = getattr(self.obj, name)
        if name in self.clean and value is not None and not test(value):
            self.add(name, f"{message}, got {_show(value)}")

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


def _linear(r: _Rule) -> None:
    r.need("units", _positive, "must be > 0")


def _conv2d(r: _Rule) -> None:
    for name in ("channels", "kernel", "stride"):
        r.need(name, _positive, "must be > 0")
    r.need("padding", _non_negative, "must be >= 0")


def _max_pool(r: _Rule) -> None:
    r.need("kernel", _positive, "must be > 0")
    r.need("stride", _positive, "must be > 0")


def _init(r: _Rule) -> None:
    r.need("seed", _non_negative, "must be >= 0")


def _model(r: _Rule) -> None:
    model: Model = r.obj
    r.need("input_shape", _filled, "must not be empty")
    r.need("input_shape", _sizes, "every size must be > 0")
    if not r.good("input_shape") or not isinstance(model.layers, tuple):
        return
    # Shapes are only traced through layers that are themselves fine.
    layers = model.layers
    fine = next((i for i in range(len(layers)) if r.walk.bad(r.where(f"layers[{i}]"))), len(layers))
    shapes, failure = trace(model.input_shape, layers[:fine])
    if failure is not None:
        r.add(f"layers[{failure[0]}]", failure[1])
        return
    if fine < len(layers) or not isinstance(model.loss, CrossEntropy):
        return
    last = shapes[-1] if shapes else tuple(model.input_shape)
    where = f"layers[{len(layers) - 1}]" if layers else "loss"
    if len(last) != 1 or last[0] < 2:
        r.add(where, f"CrossEntropy needs a 1-D output of at least 2 classes, got shape {last}")
    if layers and isinstance(layers[-1], Softmax):
        r.add(where, "remove this Softmax: CrossEntropy applies softmax itself, fused with the loss")


def _warmup(r: _Rule) -> None:
    r.need("warmup_steps", _non_negative, "must be >= 0")


def _step_lr(r: _Rule) -> None:
    r.need("step_size", _positive, "must be > 0")
    r.need("gamma", _positive, "must be > 0")
    _warmup(r)


def _cosine(r: _Rule) -> None:
    r.need("total_steps", _positive, "must be > 0")
    r.need("min_lr", _non_negative, "must be >= 0")
    _warmup(r)
    if r.good("total_steps", "warmup_steps") and r.obj.warmup_steps >= r.obj.total_steps:
        r.add("warmup_steps", f"must be < total_steps ({r.obj.total_steps}), got {r.obj.warmup_steps}")


def _optimiser(r: _Rule) -> None:
    r.need("lr", _positive, "must be > 0")
    r.need("weight_decay", _non_negative, "must be >= 0")
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


def _path(r: _Rule, name: str) -> None:
    # Only the string: whether the file exists is for the loader to say, at load time.
    r.need(name, _filled, "must not be empty")


def _image_folder(r: _Rule) -> None:
    _path(r, "root")
    _path(r, "labels_csv")
    r.need("size", _sizes, "every size must be > 0")
    r.need("workers", _positive, "must be > 0")


def _csv(r: _Rule) -> None:
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


def _raw_binary(r: _Rule) -> None:
    _path(r, "path")
    _path(r, "labels_path")
    r.need("shape", _filled, "must not be empty")
    r.need("shape", _sizes, "every size must be > 0")


def _idx(r: _Rule) -> None:
    _path(r, "images")
    _path(r, "labels")


def _synthetic(r: _Rule) -> None:
    r.need("samples", _positive, "must be > 0")
    r.need("features", _filled, "must not be empty")
    r.need("features", _sizes, "every size must be > 0")
    r.need("seed", _non_negative, "must be >= 0")
    if r.good("task") and r.obj.task == "classification":
        r.need("classes", lambda c: c >= 2, "must be >= 2")


def _normalize(r: _Rule) -> None:
    r.need("mean", _filled, "must not be empty")
    r.need("std", _filled, "must not be empty")
    r.need("std", lambda s: all(x > 0 for x in s), "every value must be > 0")
    if r.good("mean", "std") and len(r.obj.mean) != len(r.obj.std):
        r.add("std", f"must have as many values as mean ({len(r.obj.mean)}), got {len(r.obj.std)}")


def _random_crop(r: _Rule) -> None:
    r.need("size", _sizes, "every size must be > 0")
    r.need("padding", _non_negative, "must be >= 0")


def _flip(r: _Rule) -> None:
    r.need("p", lambda p: 0 <= p <= 1, "must be in [0, 1]")


def _resize(r: _Rule) -> None:
    r.need("size", _sizes, "every size must be > 0")


def _split(r: _Rule) -> None:
    for name in ("train", "val", "test"):
        r.need(name, lambda f: 0 <= f <= 1, "must be in [0, 1]")
    r.need("train", _positive, "must be > 0")
    if r.good("train", "val", "test"):
        total = r.obj.train + r.obj.val + r.obj.test
        if abs(total - 1.0) > 1e-6:
            r.add("", f"train + val + test must be 1, got {total:g}")


def _data(r: _Rule) -> None:
    r.need("batch_size", _positive, "must be > 0")
    r.need("seed", _non_negative, "must be >= 0")


def _devices(r: _Rule) -> None:
    r.need("select", _column, "must be 'auto', 'cpu', a device index >= 0 or a non-empty device name")
    r.need("memory_fraction", lambda f: 0 < f <= 1, "must be in (0, 1]")


def _node(r: _Rule) -> None:
    r.need("name", _filled, "must not be empty")
    r.need("device", _non_negative, "must be >= 0")
    r.need("workers", _positive, "must be > 0")


def _edge(r: _Rule) -> None:
    r.need("capacity", _positive, "must be > 0 (channels are always bounded)")


def _pipeline(r: _Rule) -> None:
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


def _run(r: _Rule) -> None:
    for name in ("epochs", "steps", "eval_every", "checkpoint_every", "in_flight"):
        r.need(name, _positive, "must be > 0")
    r.need("keep_checkpoints", _positive, "must be > 0 (or null to keep every checkpoint)")
    _path(r, "checkpoint_dir")
    _path(r, "metrics_file")
    obj = r.obj
    if r.good("epochs", "steps") and obj.epochs is None and obj.steps is None:
        r.add("", "set epochs or steps: with neither the run never ends")
    if r.good("checkpoint_every", "checkpoint_dir") and obj.checkpoint_every and obj.checkpoint_dir is None:
        r.add("checkpoint_every", "needs checkpoint_dir")


def _spec(r: _Rule) -> None:
    r.need("version", lambda v: v == SCHEMA_VERSION, f"must be {SCHEMA_VERSION}")
    model = r.obj.model
    if r.good("model") and count_parameters(model) == 0:
        r.add("model.layers", "the model has no parameters to train")
    if isinstance(model, Model) and model.loss is None:
        r.add("model.loss", "a training spec needs a loss: CrossEntropy() or MSE()")


_RULES: dict[type, Callable[[_Rule], None]] = {
    Linear: _linear,
    Conv2d: _conv2d,
    MaxPool2d: _max_pool,
    Init: _init,
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
    RunSettings: _run,
    Spec: _spec,
}

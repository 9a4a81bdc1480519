"""A model as the graph its layers make, pure: every layer of the spec (each repetition of a
:class:`Repeat` on its own, a :class:`Residual` as its layers and the :class:`Add` that joins
them) becomes a :class:`Node` that reads the outputs of earlier nodes, with its input and output
shapes. Validation reports what :func:`expand` finds; the shapes, the parameters and autodiff walk
its nodes.

A sequential model expands to one node per layer, node i reading node i - 1, with the names its
tensors and parameters always had (``layers[i]``).
"""

from __future__ import annotations

from dataclasses import dataclass

from flow.errors import Problem, did_you_mean
from flow.spec_base import Shape
from flow.spec_model import (
    Add,
    Concat,
    Embedding,
    MatMul,
    Model,
    PositionalEmbedding,
    Repeat,
    Residual,
    SelfAttention,
)

# The name by which any layer reads the model's input; no layer may take it.
INPUT = "input"
# A node's input that is the model's input rather than another node.
MODEL_INPUT = -1

_NOT_FIRST = (
    "Embedding must be the first layer, or read 'input': it looks up integer token ids, which only "
    "the model's input holds (a layer before it gives floats, and ids have no gradient to pass back)"
)


@dataclass(frozen=True)
class Node:
    """One layer application.

    Attributes:
        index: the node's position in evaluation order (its tensors' names say it).
        path: the names of its parameters start with it: ``layers[2]``, ``layers[2].layers[0]``
            inside a Residual, ``layers[2][1].layers[0]`` in a Repeat's second repetition.
        where: the spec path of its record, for problems (every repetition shares it).
        layer: the layer record (a Residual's join is an :class:`Add` the spec does not hold).
        inputs: the nodes it reads, in order; :data:`MODEL_INPUT` for the model's input.
        in_shapes: their shapes, without the batch dimension.
        out_shape: its output's shape.
    """

    index: int
    path: str
    where: str
    layer: object
    inputs: tuple[int, ...]
    in_shapes: tuple[Shape, ...]
    out_shape: Shape


@dataclass(frozen=True)
class Expansion:
    """What :func:`expand` found: the nodes, the node that gives each top-level layer's output
    and the range of nodes each made, and the problems (nodes stop at the first one)."""

    nodes: list[Node]
    outputs: list[int]
    spans: list[range]
    problems: list[Problem]

    @property
    def output(self) -> int:
        """The node whose output is the model's (the model's input for a model of no layers)."""
        return self.outputs[-1] if self.outputs else MODEL_INPUT


class _Failed(Exception):
    def __init__(self, problem: Problem) -> None:
        self.problem = problem


def expand(model: Model, check_unused: bool = True) -> Expansion:
    """The model's nodes, or the first problem that stops them.

    Args:
        model: a model whose records are each well typed (see flow.validation).
        check_unused: also report a layer whose output nothing reads (off while only part of the
            model is traced).

    Returns:
        The expansion; its ``problems`` name the layer (``layers[i]...``) and say what is wrong.
    """
    expander = _Expander(tuple(model.input_shape))
    outputs: list[int] = []
    spans: list[range] = []
    try:
        expander.sequence(model.layers, "", "", MODEL_INPUT, {}, "", outputs, spans)
        if check_unused:
            expander.check_used()
    except _Failed as failure:
        return Expansion(expander.nodes, outputs, spans, [failure.problem])
    return Expansion(expander.nodes, outputs, spans, [])


class _Expander:
    def __init__(self, input_shape: Shape) -> None:
        self.input_shape = input_shape
        self.nodes: list[Node] = []

    def shape(self, node: int) -> Shape:
        return self.input_shape if node == MODEL_INPUT else self.nodes[node].out_shape

    def sequence(
        self,
        layers: tuple,
        path: str,
        where: str,
        entry: int,
        scope: dict[str, int],
        note: str,
        outputs: list[int] | None = None,
        spans: list[range] | None = None,
    ) -> int:
        """Expand a block's layers, reading ``entry`` first; returns its last node."""
        visible = dict(scope)
        own_names: dict[str, int] = {}
        previous = entry
        for j, layer in enumerate(layers):
            here, at = f"{path}layers[{j}]", f"{where}layers[{j}]"
            name = layer.name
            if name == INPUT:
                raise _Failed(Problem(f"{at}.name", f"{INPUT!r} is the model's input; choose another name"))
            if name is not None and name in own_names:
                raise _Failed(
                    Problem(f"{at}.name", f"{name!r} is already the name of {where}layers[{own_names[name]}]")
                )
            if name is not None:
                own_names[name] = j
            first = len(self.nodes)
            inputs = self._inputs(layers, j, at, previous, visible, where)
            previous = self.layer(layer, here, at, inputs, visible, note)
            if name is not None:
                visible[name] = previous
            if outputs is not None and spans is not None:
                outputs.append(previous)
                spans.append(range(first, len(self.nodes)))
        return previous

    def _inputs(self, layers: tuple, j: int, at: str, previous: int, visible: dict[str, int], where: str):
        layer = layers[j]
        joins = isinstance(layer, Add | Concat)
        if isinstance(layer, MatMul) and (layer.inputs is None or len(layer.inputs) != 2):
            got = "none" if layer.inputs is None else len(layer.inputs)
            raise _Failed(Problem(f"{at}.inputs", f"MatMul multiplies two layers: name them, got {got}"))
        if isinstance(layer, MatMul):
            return tuple(self._resolve(layers, j, at, name, visible, where) for name in layer.inputs)
        if layer.inputs is None:
            if joins:
                raise _Failed(
                    Problem(f"{at}.inputs", f"{type(layer).__name__} joins two or more layers: name them")
                )
            return (previous,)
        count = len(layer.inputs)
        if joins and count < 2:
            raise _Failed(
                Problem(f"{at}.inputs", f"{type(layer).__name__} joins two or more layers, got {count}")
            )
        if not joins and count != 1:
            raise _Failed(Problem(f"{at}.inputs", f"{type(layer).__name__} reads one layer, got {count}"))
        return tuple(self._resolve(layers, j, at, name, visible, where) for name in layer.inputs)

    def _resolve(self, layers: tuple, j: int, at: str, name: str, visible: dict[str, int], where: str) -> int:
        if name == INPUT:
            return MODEL_INPUT
        if name in visible:
            return visible[name]
        later = next((k for k in range(j, len(layers)) if layers[k].name == name), None)
        if later is not None:
            cycle = _reads(layers, later, j)
            what = (
                f"a cycle: {where}layers[{later}] ({name!r}) reads this layer's output back"
                if cycle
                else f"{name!r} is {where}layers[{later}], which comes later: a layer reads only earlier ones"
            )
            raise _Failed(Problem(f"{at}.inputs", what))
        known = sorted(visible) + [INPUT]
        raise _Failed(
            Problem(f"{at}.inputs", f"no earlier layer is named {name!r}{did_you_mean(name, known)}")
        )

    def layer(
        self, layer, path: str, where: str, inputs: tuple[int, ...], scope: dict[str, int], note: str
    ) -> int:
        if isinstance(layer, Residual):
            inner = self.sequence(layer.layers, f"{path}.", f"{where}.", inputs[0], scope, note)
            if self.shape(inner) != self.shape(inputs[0]):
                why = f"the block gives shape {self.shape(inner)}, not its input's {self.shape(inputs[0])}"
                raise _Failed(Problem(where, why + note))
            return self.node(Add(), path, where, (inner, inputs[0]), note)
        if isinstance(layer, Repeat):
            out = inputs[0]
            for r in range(layer.times):
                repetition = f" (repetition {r + 1} of {layer.times})"
                out = self.sequence(layer.layers, f"{path}[{r}].", f"{where}.", out, scope, note + repetition)
            return out
        return self.node(layer, path, where, inputs, note)

    def node(self, layer, path: str, where: str, inputs: tuple[int, ...], note: str) -> int:
        in_shapes = tuple(self.shape(i) for i in inputs)
        out = node_shape(layer, in_shapes, inputs)
        if isinstance(out, str):
            raise _Failed(Problem(where, out + note))
        index = len(self.nodes)
        self.nodes.append(Node(index, path, where, layer, inputs, in_shapes, out))
        return index

    def check_used(self) -> None:
        read = {i for node in self.nodes for i in node.inputs}
        for node in self.nodes[:-1]:  # the last node's output is the model's
            if node.index not in read:
                why = "nothing reads this layer's output, and only the last layer gives the model's output"
                raise _Failed(Problem(node.where, why))


def _reads(layers: tuple, start: int, target: int) -> bool:
    """Whether layer ``start`` of a block reads layer ``target``'s output, directly or not."""
    names = {layer.name: k for k, layer in enumerate(layers) if layer.name is not None}
    seen, stack = set(), [start]
    while stack:
        k = stack.pop()
        if k in seen:
            continue
        seen.add(k)
        reads = [k - 1] if layers[k].inputs is None else [names[n] for n in layers[k].inputs if n in names]
        if target in reads:
            return True
        stack += [r for r in reads if r >= 0]
    return False


def node_shape(layer, in_shapes: tuple[Shape, ...], inputs: tuple[int, ...]) -> Shape | str:
    """A node's output shape, or why its inputs do not fit it."""
    from flow.shapes import output_shape  # flow.shapes builds on this module

    first = in_shapes[0]
    if isinstance(layer, Add):
        odd = next((s for s in in_shapes if s != first), None)
        return (
            first
            if odd is None
            else f"Add needs inputs of one shape, got {' and '.join(map(str, in_shapes))}"
        )
    if isinstance(layer, Concat):
        rank = len(first)
        axis = concat_axis(layer, rank)
        if not 0 <= axis < rank:
            return f"Concat's axis {layer.axis} is outside inputs of {rank} dimensions"
        others = [tuple(s[:axis] + s[axis + 1 :]) for s in in_shapes]
        if any(len(s) != rank for s in in_shapes) or len(set(others)) != 1:
            shapes = " and ".join(map(str, in_shapes))
            return f"Concat along axis {layer.axis} needs inputs that agree elsewhere, got {shapes}"
        return (*first[:axis], sum(s[axis] for s in in_shapes), *first[axis + 1 :])
    if isinstance(layer, MatMul):
        return matmul_shape(layer, in_shapes)
    if isinstance(layer, Embedding) and inputs[0] != MODEL_INPUT:
        return _NOT_FIRST
    if isinstance(layer, PositionalEmbedding | SelfAttention) and len(first) != 2:
        return f"{type(layer).__name__} needs a (positions, features) input, got shape {first}"
    if isinstance(layer, SelfAttention) and first[1] % layer.heads:
        return f"SelfAttention's {layer.heads} heads do not divide the {first[1]} features"
    return output_shape(layer, first)


def matmul_shape(layer: MatMul, in_shapes: tuple[Shape, ...]) -> Shape | str:
    """A MatMul's output shape, (..., M, N), or why its two inputs do not multiply."""
    a, b = in_shapes
    if len(a) < 2 or len(a) != len(b) or a[:-2] != b[:-2]:
        why = "MatMul needs two inputs (..., M, K) and (..., K, N) with equal leading dimensions"
        return f"{why}, got {a} and {b}"
    rows, inner = (b[-1], b[-2]) if layer.transpose_b else (b[-2], b[-1])
    if a[-1] != rows:
        side = "(..., N, K) under transpose_b" if layer.transpose_b else "(..., K, N)"
        return f"MatMul's inputs {a} and {b} do not multiply: the second must be {side} with K = {a[-1]}"
    return (*a[:-1], inner)


def concat_axis(layer: Concat, rank: int) -> int:
    """A Concat's axis counted from the front of inputs of ``rank`` dimensions."""
    return layer.axis + rank if layer.axis < 0 else layer.axis


def parameter_count(nodes: list[Node]) -> int:
    """Trainable parameters of some nodes."""
    from flow.shapes import layer_parameters

    return sum(layer_parameters(node.layer, node.in_shapes[0]) for node in nodes)

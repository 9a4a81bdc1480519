"""The model as its programs see it, and the records autodiff emits into: the stages (the layers
after an activation layer is folded into the Linear or Conv2d before it), the trainable parameters
in arena order with their fans, the dense layers whose weight and bias gradients one GEMM writes,
the labels' shape, and the :class:`Graph` of tensor declarations and launch groups that
:mod:`flow.autodiff` fills and :mod:`flow.planning` places in memory. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from flow.errors import Problem, SpecError
from flow.model_graph import MODEL_INPUT, expand
from flow.program import TENSOR_ALIGNMENT, Launch, TensorDType, align_up
from flow.shapes import infer_shapes
from flow.spec_model import (
    GELU,
    BatchNorm1d,
    BatchNorm2d,
    Conv,
    Conv1d,
    Embedding,
    LayerNorm,
    LeakyReLU,
    Linear,
    Model,
    PointwiseLoss,
    PositionalEmbedding,
    ReLU,
    SelfAttention,
    Sigmoid,
    Tanh,
)

# The parameter-arena tensor of a CrossEntropy's class weights (see parameters).
CLASS_WEIGHTS = "loss.class_weights"
_ACTIVATION_LAYERS = {ReLU: "relu", LeakyReLU: "leaky_relu", Sigmoid: "sigmoid", Tanh: "tanh", GELU: "gelu"}

# Where each role lives: parameters, gradients and optimiser state persist for the whole run;
# io is per input slot (host-visible); work is reused within a step once a tensor is dead.
Role = str  # "param" | "grad" | "state" | "io" | "work"


@dataclass(frozen=True)
class TensorDecl:
    name: str
    shape: tuple[int, ...]
    dtype: TensorDType
    role: Role
    view_of: str | None = None  # a reshape that shares its base tensor's memory

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParamDecl:
    """One tensor of the parameter arena and how to initialise it: a trainable parameter, or
    (``trainable`` False) state the forward pass keeps, such as BatchNorm's running statistics,
    which lies in the same arena so that checkpoints and exports carry it, past the range the
    optimiser updates (:func:`optimised_floats`)."""

    name: str
    shape: tuple[int, ...]
    fan_in: int
    fan_out: int
    is_bias: bool
    constant: float | None = None  # starts at this value instead of a random draw (BatchNorm's 1s)
    trainable: bool = True
    std: float | None = None  # drawn from N(0, std^2) whatever the scheme (Embedding's N(0, 1))
    values: tuple[float, ...] | None = None  # starts at these (a CrossEntropy's class weights)


@dataclass(frozen=True)
class Stage:
    """A node of the model's graph after fusion (flow.model_graph): its index (which its tensors'
    names carry), its parameters' path, its layer and effective activation, and the stages it
    reads (positions in the stage list; :data:`MODEL_INPUT` for the model's input)."""

    index: int
    layer: object
    activation: str | None
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    path: str = ""
    inputs: tuple[int, ...] = ()
    in_shapes: tuple[tuple[int, ...], ...] = ()


@dataclass
class Graph:
    tensors: dict[str, TensorDecl] = field(default_factory=dict)
    groups: list[list[Launch]] = field(default_factory=list)
    # A pipeline stage's train graph (flow.stage_plan): the group its backward starts at.
    backward_from: int | None = None

    def add(
        self,
        name: str,
        shape: tuple[int, ...],
        role: Role = "work",
        dtype: TensorDType = "float32",
        view_of: str | None = None,
    ) -> str:
        declared = TensorDecl(name, tuple(int(d) for d in shape), dtype, role, view_of)
        existing = self.tensors.get(name)
        if existing is not None and existing != declared:
            raise AssertionError(f"tensor {name!r} declared twice differently: {existing} vs {declared}")
        self.tensors[name] = declared
        return name

    def emit(self, *launches: Launch) -> None:
        """Append a group of independent launches."""
        group = [item for item in launches if item is not None]
        if group:
            self.groups.append(group)


def stages(model: Model) -> list[Stage]:
    """The model's nodes with each activation layer that reads a Linear or Conv2d without an
    activation, which nothing else reads, folded into that layer's epilogue."""
    expansion = expand(model)
    if expansion.problems:
        raise SpecError([Problem(f"model.{p.path}", p.message) for p in expansion.problems])
    nodes = expansion.nodes
    readers = [0] * len(nodes)
    for node in nodes:
        for i in node.inputs:
            if i != MODEL_INPUT:
                readers[i] += 1
    result: list[Stage] = []
    position: dict[int, int] = {MODEL_INPUT: MODEL_INPUT}  # node -> the stage that gives its output
    for node in nodes:
        layer = node.layer
        activation = _ACTIVATION_LAYERS.get(type(layer))
        source = node.inputs[0]
        previous = result[position[source]] if source != MODEL_INPUT else None
        if (
            activation is not None
            and previous is not None
            and isinstance(previous.layer, Linear | Conv)
            and previous.activation is None
            and readers[source] == 1
        ):
            result[position[source]] = replace(
                previous,
                activation=activation,
                layer=_with_slope(previous.layer, layer),
                out_shape=node.out_shape,
            )
            position[node.index] = position[source]
            continue
        own = getattr(layer, "activation", None) if isinstance(layer, Linear | Conv) else activation
        inputs = tuple(position[i] for i in node.inputs)
        result.append(
            Stage(
                node.index, layer, own, node.in_shapes[0], node.out_shape, node.path, inputs, node.in_shapes
            )
        )
        position[node.index] = len(result) - 1
    return result


def conv_kernel(layer: Conv) -> tuple[int, tuple[int, ...]]:
    """A convolution's output channels and kernel shape: (k, k) for Conv2d, (k,) for Conv1d."""
    if isinstance(layer, Conv1d):
        return layer.channels, (layer.kernel,)
    return layer.channels, (layer.kernel, layer.kernel)


def _with_slope(layer, activation_layer):
    # Carry a folded LeakyReLU's slope on the stage via a private attribute-free record.
    slope = getattr(activation_layer, "slope", None)
    if slope is None:
        return layer
    return _Sloped(layer, slope)


@dataclass(frozen=True)
class _Sloped:
    inner: object
    slope: float


def unwrap(layer) -> tuple[object, float]:
    """A stage's layer and its activation's slope: a folded LeakyReLU's, else the layer's own, else
    LeakyReLU's default 0.01."""
    if isinstance(layer, _Sloped):
        return layer.inner, layer.slope
    return layer, getattr(layer, "slope", 0.01)


def parameters(model: Model) -> list[ParamDecl]:
    """Every tensor of the parameter arena: the trainable ones in layer order (weights then bias),
    then the state that is not trained (BatchNorm's running mean and variance), in layer order.

    Linear weights are stored [in, out] (so the forward GEMM needs no transpose); conv weights
    [out_channels, in_channels, kh, kw]; BatchNorm's scale (``weight``) and shift (``bias``)
    [channels], as PyTorch names them; an Embedding's table [num_embeddings, dim].
    """
    params: list[ParamDecl] = []
    kept: list[ParamDecl] = []
    for stage in stages(model):
        layer, _ = unwrap(stage.layer)
        prefix = stage.path
        if isinstance(layer, Linear):
            fan_in, fan_out = stage.in_shape[-1], layer.units
            params.append(ParamDecl(f"{prefix}.weight", (fan_in, fan_out), fan_in, fan_out, False))
            if layer.bias:
                params.append(ParamDecl(f"{prefix}.bias", (fan_out,), fan_in, fan_out, True))
        elif isinstance(layer, Conv):
            c = stage.in_shape[0]
            out, kernel = conv_kernel(layer)
            area = math.prod(kernel)
            shape = (out, c, *kernel)
            params.append(ParamDecl(f"{prefix}.weight", shape, c * area, out * area, False))
            if layer.bias:
                params.append(ParamDecl(f"{prefix}.bias", (out,), c * area, out * area, True))
        elif isinstance(layer, BatchNorm1d | BatchNorm2d):
            c = stage.in_shape[0]
            params.append(ParamDecl(f"{prefix}.weight", (c,), c, c, False, constant=1.0))
            params.append(ParamDecl(f"{prefix}.bias", (c,), c, c, True))
            kept.append(ParamDecl(f"{prefix}.running_mean", (c,), c, c, False, constant=0.0, trainable=False))
            kept.append(ParamDecl(f"{prefix}.running_var", (c,), c, c, False, constant=1.0, trainable=False))
        elif isinstance(layer, Embedding):
            v, d = layer.num_embeddings, layer.dim
            params.append(ParamDecl(f"{prefix}.weight", (v, d), v, d, False, std=1.0))
        elif isinstance(layer, LayerNorm):
            d = stage.in_shape[-1]
            params.append(ParamDecl(f"{prefix}.weight", (d,), d, d, False, constant=1.0))
            params.append(ParamDecl(f"{prefix}.bias", (d,), d, d, True))
        elif isinstance(layer, PositionalEmbedding):
            t, d = stage.in_shape
            params.append(ParamDecl(f"{prefix}.weight", (t, d), t, d, False, std=0.02))
        elif isinstance(layer, SelfAttention):
            # GPT-2's layout: the query, key and value projections as one [D, 3D] matrix.
            d = stage.in_shape[-1]
            params.append(ParamDecl(f"{prefix}.qkv_weight", (d, 3 * d), d, 3 * d, False))
            if layer.bias:
                params.append(ParamDecl(f"{prefix}.qkv_bias", (3 * d,), d, 3 * d, True))
            params.append(ParamDecl(f"{prefix}.out_weight", (d, d), d, d, False))
            if layer.bias:
                params.append(ParamDecl(f"{prefix}.out_bias", (d,), d, d, True))
    weights = getattr(model.loss, "class_weights", None)
    if weights is not None:  # a weighted CrossEntropy's, which its kernels read: state, never trained
        n = len(weights)
        kept.append(ParamDecl(CLASS_WEIGHTS, (n,), n, n, False, trainable=False, values=tuple(weights)))
    return params + kept


def param_offsets(params: Sequence[ParamDecl]) -> tuple[dict[str, int], int]:
    """The flat parameter arena's layout, which the gradient and optimiser-state arenas share:
    each parameter's offset in floats, in ``params`` order at aligned offsets, and the arena's
    floats (at least 256 bytes). The one place it is decided: the planner, the pipeline stages and
    the weight files (ONNX, safetensors) all read it from here.

    Args:
        params: the parameters, as :func:`parameters` lists them.

    Returns:
        (name -> offset in floats, floats in the arena).
    """
    offsets, offset = {}, 0
    for p in params:
        offsets[p.name], offset = offset // 4, align_up(offset + math.prod(p.shape) * 4)
    return offsets, max(offset, 256) // 4


def unpack_params(model: Model, flat: np.ndarray) -> dict[str, np.ndarray]:
    """Every parameter by name (``layers[1].weight``...) from a flat arena (a checkpoint's
    ``params:all``), as views of ``flat`` in each parameter's shape."""
    params = parameters(model)
    offsets, _ = param_offsets(params)
    spans = ((p, offsets[p.name], math.prod(p.shape)) for p in params)
    return {p.name: flat[at : at + size].reshape(p.shape) for p, at, size in spans}


def pack_params(model: Model, named: dict[str, np.ndarray]) -> np.ndarray:
    """The flat float32 arena (``params:all``) from every parameter by name, padding zeroed."""
    params = parameters(model)
    offsets, total = param_offsets(params)
    flat = np.zeros(total, np.float32)
    for p in params:
        at = offsets[p.name]
        flat[at : at + math.prod(p.shape)] = np.asarray(named[p.name], np.float32).reshape(-1)
    return flat


def optimised_floats(model: Model, total_params: int) -> int:
    """How many floats at the start of the flat parameter arena the optimiser updates: all of it
    (padding included, whose gradient stays 0) unless the model keeps untrained state, which the
    planner lays out after every trainable tensor (in :func:`parameters` order, each at an aligned
    offset); then the floats before that state, so that neither an update nor weight decay (which
    moves a value even where its gradient is 0) touches it.

    Args:
        model: the model.
        total_params: floats in the flat parameter arena.

    Returns:
        The length of the range the optimiser launch covers.
    """
    params = parameters(model)
    if all(p.trainable for p in params):
        return total_params
    return sum(align_up(math.prod(p.shape) * 4) for p in params if p.trainable) // 4


def fused_bias_grads(model: Model) -> dict[str, tuple[str, tuple[int, int]]]:
    """The dense layers whose weight and bias gradients one GEMM writes (see gemm.comp ones_row):
    view name -> (weight name, view shape [in + 1, out]). A layer qualifies when its bias
    parameter directly follows its weight in the flat arenas: parameters are laid out in
    ``parameters`` order at aligned offsets, so when the weight's bytes are a multiple of the
    alignment the bias starts exactly where the weight ends, and the pair is one [in + 1, out]
    matrix. The plan declares these views; the backward pass writes them.
    """
    views: dict[str, tuple[str, tuple[int, int]]] = {}
    for stage in stages(model):
        layer, _ = unwrap(stage.layer)
        if isinstance(layer, Linear) and layer.bias:
            fan_in, fan_out = stage.in_shape[-1], layer.units
            if (fan_in * fan_out * 4) % TENSOR_ALIGNMENT == 0:
                weight = f"{stage.path}.weight"
                views[f"grad:{weight}+bias"] = (weight, (fan_in + 1, fan_out))
    return views


def label_shape(model: Model, batch: int) -> tuple[tuple[int, ...], TensorDType]:
    """Shape and dtype of a batch of labels: class ids for CrossEntropy (one a position of the
    output's leading dimensions: (batch, T) for (T, classes) logits), targets for the others."""
    out_shape = infer_shapes(model)[-1] if model.layers else tuple(model.input_shape)
    if isinstance(model.loss, PointwiseLoss):
        return (batch, *out_shape), "float32"
    return (batch, *out_shape[:-1]), "int32"

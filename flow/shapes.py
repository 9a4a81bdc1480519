"""Shape inference for a model, pure: the output shape after each layer and the parameter count.

Shapes exclude the batch dimension. The validator turns a bad layer into a problem through
:func:`flow.model_graph.expand`, which applies :func:`output_shape` node by node; the planner uses
:func:`infer_shapes`, which raises on a model that does not fit together.
Inputs are assumed well typed (see flow.validation).
"""

import math

from flow.errors import Problem, SpecError
from flow.model_graph import expand, parameter_count
from flow.spec_base import Shape
from flow.spec_model import (
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    Conv1d,
    Conv2d,
    Embedding,
    Flatten,
    GlobalAvgPool,
    Layer,
    LayerNorm,
    Linear,
    MaxPool2d,
    Model,
    PositionalEmbedding,
    Reshape,
    SelfAttention,
)


def _window(name: str, shape: Shape, kernel: int, stride: int, padding: int) -> tuple[int, int] | str:
    """Output (height, width) of a square sliding window, or why it has none."""
    if len(shape) != 3:
        return f"{name} needs a (channels, height, width) input, got shape {shape}"
    _, h, w = shape
    out_h = (h + 2 * padding - kernel) // stride + 1
    out_w = (w + 2 * padding - kernel) // stride + 1
    if out_h <= 0 or out_w <= 0:
        larger = kernel > min(h, w) + 2 * padding
        return (
            f"{name} output size {out_h}x{out_w} is not positive "
            f"(input {h}x{w}, kernel {kernel}, stride {stride}, padding {padding})"
            + (": the kernel is larger than the padded input" if larger else "")
        )
    return out_h, out_w


def output_shape(layer: Layer, shape: Shape) -> Shape | str:
    """The shape a layer produces from an input shape.

    Args:
        layer: a layer record.
        shape: its input shape, without the batch dimension.

    Returns:
        The output shape, or a message saying why the layer cannot take that input.
    """
    if isinstance(layer, Linear):
        if len(shape) not in (1, 2):
            why = f"Linear needs a flat (1-D) or (positions, features) input, got shape {shape}"
            return why + "; add Flatten() before it"
        return (*shape[:-1], layer.units)
    if isinstance(layer, Conv2d):
        size = _window("Conv2d", shape, layer.kernel, layer.stride, layer.padding)
        return size if isinstance(size, str) else (layer.channels, *size)
    if isinstance(layer, Conv1d):
        if len(shape) != 2:
            return f"Conv1d needs a (channels, length) input, got shape {shape}; add Reshape((C, L))"
        length, k, pad = shape[1], layer.kernel, layer.padding
        out = (length + 2 * pad - k) // layer.stride + 1
        if out <= 0:
            return (
                f"Conv1d output length {out} is not positive (input length {length}, kernel {k}, "
                f"stride {layer.stride}, padding {pad}): the kernel is longer than the padded input"
            )
        return (layer.channels, out)
    if isinstance(layer, MaxPool2d):
        stride = layer.kernel if layer.stride is None else layer.stride
        size = _window("MaxPool2d", shape, layer.kernel, stride, 0)
        return size if isinstance(size, str) else (shape[0], *size)
    if isinstance(layer, AvgPool2d):
        stride = layer.kernel if layer.stride is None else layer.stride
        size = _window("AvgPool2d", shape, layer.kernel, stride, layer.padding)
        return size if isinstance(size, str) else (shape[0], *size)
    if isinstance(layer, GlobalAvgPool):
        if len(shape) != 3:
            return f"GlobalAvgPool needs a (channels, height, width) input, got shape {shape}"
        return (shape[0],)
    if isinstance(layer, BatchNorm2d) and len(shape) != 3:
        return f"BatchNorm2d needs a (channels, height, width) input, got shape {shape}; use BatchNorm1d"
    if isinstance(layer, BatchNorm1d) and len(shape) not in (1, 2):
        return f"BatchNorm1d needs a (features,) or (channels, length) input, got {shape}; use BatchNorm2d"
    if isinstance(layer, LayerNorm) and len(shape) not in (1, 2):
        return f"LayerNorm needs a (features,) or (channels, length) input, got {shape}; add a Flatten"
    if isinstance(layer, Flatten):
        return (math.prod(shape),)
    if isinstance(layer, Reshape):
        return reshaped(shape, tuple(layer.shape))
    if isinstance(layer, Embedding):
        return (*shape, layer.dim)
    return shape  # activations, dropout and normalisation keep the shape


def reshaped(shape: Shape, target: Shape) -> Shape | str:
    """``target`` with its -1 filled in, or why ``shape``'s values do not fill it."""
    count, known = math.prod(shape), math.prod(d for d in target if d != -1)
    if target.count(-1) == 1 and count % known == 0:
        target = tuple(count // known if d == -1 else d for d in target)
    if target.count(-1):
        return f"Reshape to {target}: the {count} values of {shape} do not divide by {known}"
    if math.prod(target) != count:
        return f"Reshape to {target} needs {math.prod(target)} values a sample, not the {count} of {shape}"
    return target


def infer_shapes(model: Model) -> list[Shape]:
    """The output shape after each of a model's layers (a Residual's or Repeat's: the block's).

    Args:
        model: a well-typed model.

    Returns:
        One shape per layer, without the batch dimension.

    Raises:
        SpecError: a layer cannot take its input shape, or reads no layer it can.
    """
    expansion = expand(model)
    if expansion.problems:
        raise SpecError([Problem(f"model.{p.path}", p.message) for p in expansion.problems])
    return [expansion.nodes[i].out_shape for i in expansion.outputs]


def layer_parameters(layer: Layer, input_shape: Shape) -> int:
    """Trainable parameters of one layer (weights and bias).

    Args:
        layer: a layer record.
        input_shape: its input shape, which the layer must accept.

    Returns:
        The number of parameters.
    """
    if isinstance(layer, Linear):
        return input_shape[-1] * layer.units + (layer.units if layer.bias else 0)
    if isinstance(layer, Conv2d):
        weights = input_shape[0] * layer.channels * layer.kernel * layer.kernel
        return weights + (layer.channels if layer.bias else 0)
    if isinstance(layer, Conv1d):
        weights = input_shape[0] * layer.channels * layer.kernel
        return weights + (layer.channels if layer.bias else 0)
    if isinstance(layer, BatchNorm1d | BatchNorm2d):
        return 2 * input_shape[0]  # scale and shift per channel; the running statistics are not trained
    if isinstance(layer, Embedding):
        return layer.num_embeddings * layer.dim
    if isinstance(layer, LayerNorm):
        return 2 * input_shape[-1]  # scale and shift per position of the normalised (last) dimension
    if isinstance(layer, PositionalEmbedding):
        return math.prod(input_shape)
    if isinstance(layer, SelfAttention):
        d = input_shape[-1]
        return 4 * d * d + (4 * d if layer.bias else 0)  # W_qkv [d, 3d], W_out [d, d] and biases
    return 0


def count_parameters(model: Model) -> int:
    """Trainable parameters of a model.

    Args:
        model: a model whose layers fit together.

    Returns:
        The total number of parameters.

    Raises:
        SpecError: a layer cannot take its input shape.
    """
    infer_shapes(model)  # raises on a model whose layers do not fit together
    return parameter_count(expand(model).nodes)

"""A model and its weights as an ONNX graph, pure: each node of the model's graph
(flow.model_graph) becomes the ONNX ops of :data:`OPS`, the table that flow.onnx_import reads back,
so that what export writes and import reads are one list. The spec's Normalize and Scale
preprocessing lead the graph, and a CrossEntropy model ends in Softmax (a BCEWithLogits one in
Sigmoid), so the file gives what ``flow.predict`` gives for the same raw inputs.

Layouts: images are NCHW as in vkflow; Linear weights are stored [in, out], which is ONNX MatMul's
B; Conv2d weights [out, in, kh, kw] as ONNX Conv's; Flatten is row-major in both.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from flow import spec_model as vk
from flow.model_graph import MODEL_INPUT, Node, concat_axis, expand
from flow.spec import Spec

# The one table of what vkflow writes and reads: each ONNX op and the vkflow layer it stands for.
# Export writes the ops of each layer from it; import reads these ops and no others, and names
# them when it meets another. Sub, Div and Mul by constants right after the input are the
# preprocessing (Normalize, Scale); Cast only feeds an Embedding's Gather.
OPS: dict[str, str] = {
    "Gemm": "Linear", "MatMul": "Linear", "Conv": "Conv2d", "MaxPool": "MaxPool2d",
    "AveragePool": "AvgPool2d", "GlobalAveragePool": "GlobalAvgPool",
    "BatchNormalization": "BatchNorm1d/BatchNorm2d", "LayerNormalization": "LayerNorm",
    "Flatten": "Flatten", "Reshape": "Reshape", "Relu": "ReLU", "LeakyRelu": "LeakyReLU",
    "Sigmoid": "Sigmoid", "Tanh": "Tanh", "Gelu": "GELU", "Erf": "GELU (x * 0.5 * (1 + erf(x / sqrt 2)))",
    "Softmax": "Softmax", "Add": "Add, a bias or PositionalEmbedding", "Sum": "Add", "Concat": "Concat",
    "Dropout": "Dropout (identity)", "Identity": "(identity)", "Gather": "Embedding",
    "Cast": "Embedding's ids", "Constant": "(constants)", "Sub": "Normalize", "Div": "Normalize",
    "Mul": "Scale", "ReduceMean": "GlobalAvgPool (over H and W)",
}  # fmt: skip
# Activations (a Linear's or Conv2d's, or a layer of their own) and their ops.
ACTIVATION_OPS = {"relu": "Relu", "leaky_relu": "LeakyRelu", "sigmoid": "Sigmoid", "tanh": "Tanh",
                  "gelu": "Gelu"}  # fmt: skip
ACTIVATION_LAYERS = {vk.ReLU: "relu", vk.LeakyReLU: "leaky_relu", vk.Sigmoid: "sigmoid", vk.Tanh: "tanh",
                     vk.GELU: "gelu"}  # fmt: skip
# The oldest opset with each op as export writes it (Gelu before 20 is written as Erf).
MIN_OPSET = 13  # Softmax over one axis, Split's sizes as an input
LAYER_NORM_OPSET = 17
GELU_OPSET = 20
SQRT2 = math.sqrt(2.0)
INSTALL = "ONNX needs the onnx package: pip install 'vkflow-ml[onnx]' (or pip install onnx)"


class OnnxError(ValueError):
    """An ONNX file vkflow cannot read, a model it cannot write as ONNX, or no onnx package."""


def require_onnx() -> Any:
    """The onnx package, imported on first use (an optional extra).

    Returns:
        The ``onnx`` module.

    Raises:
        OnnxError: it is not installed, saying how to install it.
    """
    try:
        import onnx
    except ImportError as error:
        raise OnnxError(f"{INSTALL} ({error})") from None
    return onnx


class _Writer:
    def __init__(self, onnx: Any, opset: int) -> None:
        self.onnx, self.opset = onnx, opset
        self.nodes: list[Any] = []
        self.constants: list[Any] = []

    def const(self, name: str, value: Any, dtype: Any = np.float32) -> str:
        self.constants.append(self.onnx.numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], where: str, output: str | None = None, **attrs: Any) -> str:
        name = f"{where}/{op_type}_{len(self.nodes)}"
        output = output or name
        self.nodes.append(self.onnx.helper.make_node(op_type, inputs, [output], name=name, **attrs))
        return output

    def activation(self, x: str, activation: str | None, where: str, slope: float = 0.01) -> str:
        if activation is None:
            return x
        if activation == "leaky_relu":
            return self.op("LeakyRelu", [x], where, alpha=float(slope))
        if activation == "gelu" and self.opset < GELU_OPSET:  # torch's form, which import reads back
            scaled = self.op("Div", [x, self.const(f"{where}.sqrt2", SQRT2)], where)
            plus = self.op("Add", [self.op("Erf", [scaled], where), self.const(f"{where}.one", 1.0)], where)
            return self.op("Mul", [self.op("Mul", [x, plus], where), self.const(f"{where}.half", 0.5)], where)
        return self.op(ACTIVATION_OPS[activation], [x], where)


def to_onnx(spec: Spec, weights: dict[str, np.ndarray], opset: int = LAYER_NORM_OPSET) -> Any:
    """The spec's model with these weights as an ONNX ModelProto: input ``input`` [batch,
    *input_shape] (raw, before the spec's preprocessing), output ``output`` (what predict gives).

    Args:
        spec: the spec (its model, loss and preprocessing).
        weights: every parameter by name (flow.graph.unpack_params).
        opset: the ONNX opset to write, >= 13 (17 or more for LayerNorm; GELU is written as
            Gelu from 20, else as the Erf form torch writes).

    Returns:
        The onnx.ModelProto.

    Raises:
        OnnxError: a layer, a preprocessing step or an opset that this cannot write, named.
    """
    onnx = require_onnx()
    if opset < MIN_OPSET:
        raise OnnxError(f"opset {opset}: ONNX export writes opset {MIN_OPSET} or later")
    model, w = spec.model, _Writer(onnx, opset)
    x = _preprocess(w, spec, "input")
    outputs: dict[int, str] = {MODEL_INPUT: x}
    expansion = expand(model)
    if expansion.problems:
        raise OnnxError("; ".join(str(p) for p in expansion.problems))
    for node in expansion.nodes:
        outputs[node.index] = _write_node(w, node, [outputs[i] for i in node.inputs], weights)
    last = outputs[expansion.output]
    head = {vk.CrossEntropy: ("Softmax", {"axis": -1}), vk.BCEWithLogits: ("Sigmoid", {})}
    op_type, attrs = head.get(type(model.loss), ("Identity", {}))
    w.op(op_type, [last], "output", output="output", **attrs)
    out_shape = expansion.nodes[expansion.output].out_shape if expansion.nodes else model.input_shape
    value = onnx.helper.make_tensor_value_info
    ends = [value(name, onnx.TensorProto.FLOAT, ["batch", *shape])
            for name, shape in (("input", model.input_shape), ("output", out_shape))]  # fmt: skip
    graph = onnx.helper.make_graph(w.nodes, "vkflow", ends[:1], ends[1:], initializer=w.constants)
    opsets = [onnx.helper.make_opsetid("", opset)]
    proto = onnx.helper.make_model(graph, opset_imports=opsets, producer_name="vkflow")
    proto.ir_version = onnx.helper.find_min_ir_version_for(opsets)
    return proto


def _preprocess(w: _Writer, spec: Spec, x: str) -> str:
    rank = len(spec.model.input_shape)
    for i, step in enumerate(spec.data.preprocess):
        where = f"data.preprocess[{i}]"
        kind = type(step).__name__
        if kind == "Scale":
            x = w.op("Mul", [x, w.const(f"{where}.factor", step.factor)], where)
        elif kind == "Normalize":  # per channel: axis 1 of the batch
            shape = (-1, *(1,) * (rank - 1))
            mean = w.const(f"{where}.mean", np.reshape(step.mean, shape))
            std = w.const(f"{where}.std", np.reshape(step.std, shape))
            x = w.op("Div", [w.op("Sub", [x, mean], where), std], where)
        else:
            why = "export models whose preprocessing is Normalize or Scale"
            raise OnnxError(f"{where}: {kind} has no ONNX form here; {why}")
    return x


def _write_node(w: _Writer, node: Node, xs: list[str], weights: dict[str, np.ndarray]) -> str:
    layer, p, x = node.layer, node.path, xs[0]

    def const(name: str) -> str:
        return w.const(f"{p}.{name}", weights[f"{p}.{name}"])

    if isinstance(layer, vk.Linear):
        y = w.op("MatMul", [x, const("weight")], p)
        y = w.op("Add", [y, const("bias")], p) if layer.bias else y
        return w.activation(y, layer.activation, p)
    if isinstance(layer, vk.Conv2d):
        k, s, pad = layer.kernel, layer.stride, layer.padding
        inputs = [x, const("weight"), *([const("bias")] if layer.bias else [])]
        y = w.op("Conv", inputs, p, kernel_shape=[k, k], strides=[s, s], pads=[pad] * 4)
        return w.activation(y, layer.activation, p)
    if isinstance(layer, vk.MaxPool2d | vk.AvgPool2d):
        k = layer.kernel
        s = k if layer.stride is None else layer.stride
        if isinstance(layer, vk.AvgPool2d):
            pads = [layer.padding] * 4  # the padding counts in the mean (PyTorch's default), as in vkflow
            return w.op("AveragePool", [x], p, kernel_shape=[k, k], strides=[s, s], pads=pads,
                        count_include_pad=1)  # fmt: skip
        return w.op("MaxPool", [x], p, kernel_shape=[k, k], strides=[s, s])
    if isinstance(layer, vk.GlobalAvgPool):  # ONNX keeps (C, 1, 1); vkflow's output is flat
        return w.op("Flatten", [w.op("GlobalAveragePool", [x], p)], p, axis=1)
    if isinstance(layer, vk.BatchNorm1d | vk.BatchNorm2d):
        names = ("weight", "bias", "running_mean", "running_var")
        return w.op("BatchNormalization", [x, *map(const, names)], p, epsilon=float(layer.eps))
    if isinstance(layer, vk.LayerNorm):
        if w.opset < LAYER_NORM_OPSET:
            why = f"LayerNorm needs opset {LAYER_NORM_OPSET} or later, got {w.opset}"
            raise OnnxError(f"model.{node.where}: {why}")
        inputs = [x, const("weight"), const("bias")]
        return w.op("LayerNormalization", inputs, p, axis=-1, epsilon=float(layer.eps))
    if isinstance(layer, vk.Flatten):
        return w.op("Flatten", [x], p, axis=1)
    if isinstance(layer, vk.Reshape):
        return w.op("Reshape", [x, w.const(f"{p}.shape", [-1, *node.out_shape], np.int64)], p)
    if isinstance(layer, vk.Dropout):  # the identity at inference
        return w.op("Identity", [x], p)
    if type(layer) in ACTIVATION_LAYERS:
        return w.activation(x, ACTIVATION_LAYERS[type(layer)], p, getattr(layer, "slope", 0.01))
    if isinstance(layer, vk.Softmax):
        return w.op("Softmax", [x], p, axis=-1)
    if isinstance(layer, vk.Add):
        return w.op("Add" if len(xs) == 2 else "Sum", xs, p)
    if isinstance(layer, vk.Concat):
        return w.op("Concat", xs, p, axis=concat_axis(layer, len(node.in_shapes[0])) + 1)
    if isinstance(layer, vk.Embedding):
        ids = w.op("Cast", [x], p, to=int(w.onnx.TensorProto.INT64))
        return w.op("Gather", [const("weight"), ids], p, axis=0)
    if isinstance(layer, vk.PositionalEmbedding):
        return w.op("Add", [x, const("weight")], p)
    if isinstance(layer, vk.SelfAttention):
        return _attention(w, node, x, weights)
    raise OnnxError(f"model.{node.where}: {type(layer).__name__} has no ONNX export")


def _attention(w: _Writer, node: Node, x: str, weights: dict[str, np.ndarray]) -> str:
    # PyTorch's MultiheadAttention with GPT-2's fused [D, 3D] projection (flow.spec_model).
    layer, p = node.layer, node.path
    t, d = node.in_shapes[0]
    heads, dh = layer.heads, d // layer.heads

    def project(y: str, name: str) -> str:
        y = w.op("MatMul", [y, w.const(f"{p}.{name}_weight", weights[f"{p}.{name}_weight"])], p)
        bias = f"{p}.{name}_bias"
        return w.op("Add", [y, w.const(bias, weights[bias])], p) if layer.bias else y

    qkv = project(x, "qkv")
    sizes = w.const(f"{p}.split", [d, d, d], np.int64)
    parts = [f"{p}/{name}" for name in "qkv"]
    w.nodes.append(w.onnx.helper.make_node("Split", [qkv, sizes], parts, name=f"{p}/Split", axis=-1))
    per_head = w.const(f"{p}.heads", [0, 0, heads, dh], np.int64)
    q, k, v = (w.op("Transpose", [w.op("Reshape", [y, per_head], p)], p, perm=[0, 2, 1, 3]) for y in parts)
    scores = w.op("MatMul", [q, w.op("Transpose", [k], p, perm=[0, 1, 3, 2])], p)
    scores = w.op("Mul", [scores, w.const(f"{p}.scale", 1.0 / math.sqrt(dh))], p)
    if layer.causal:  # a position sees itself and the ones before it
        mask = np.triu(np.full((t, t), -np.inf, np.float32), 1)
        scores = w.op("Add", [scores, w.const(f"{p}.mask", mask)], p)
    attended = w.op("MatMul", [w.op("Softmax", [scores], p, axis=-1), v], p)
    joined = w.op("Transpose", [attended], p, perm=[0, 2, 1, 3])
    return project(w.op("Reshape", [joined, w.const(f"{p}.joined", [0, 0, d], np.int64)], p), "out")

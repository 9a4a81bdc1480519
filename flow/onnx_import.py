"""An ONNX graph as a vkflow model and its weights, pure: each ONNX node of the table
flow.onnx_export.OPS becomes a layer (a graph of named layers; a plain sequence when it is one), its
constants the layer's parameters in vkflow's layout, and Sub, Div and Mul by constants right after
the input the spec's preprocessing (Normalize, Scale). Anything else (an op, an attribute vkflow's
layer lacks, a shape it cannot take) is one :class:`OnnxError` naming the node, its op and what is
supported, before any device work. ``flow.predict`` then runs the spec as any other.

The graph's batch dimension is its first; vkflow shapes are per sample. ONNX's GlobalAveragePool
keeps (C, 1, 1) where vkflow's GlobalAvgPool gives (C,): each value carries both shapes, and a
Reshape layer (a view, no launch) goes in only where a reader needs the ONNX one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from flow import spec_model as vk
from flow.graph import pack_params
from flow.model_graph import INPUT, MODEL_INPUT, node_shape
from flow.onnx_export import ACTIVATION_OPS, OPS, SQRT2, OnnxError, require_onnx
from flow.shapes import reshaped
from flow.spec import MSE, SGD, Data, Normalize, Scale, Spec, Synthetic
from flow.spec_base import Shape
from flow.validation import validate

_UNARY = {"Relu": vk.ReLU, "Sigmoid": vk.Sigmoid, "Tanh": vk.Tanh, "Gelu": vk.GELU}
assert set(_UNARY) | {"LeakyRelu"} == set(ACTIVATION_OPS.values())
_FLOATS = {1, 10, 11, 16}  # TensorProto FLOAT, FLOAT16, DOUBLE, BFLOAT16: a Cast to these is a no-op


@dataclass(frozen=True)
class _Value:
    ref: str  # the vkflow layer that gives it (its name), or INPUT
    shape: Shape  # its sample shape in vkflow
    onnx: Shape  # its sample shape in the ONNX graph
    layer: int | None = None  # the index of the layer that gives it


def from_onnx(proto: Any, where: str) -> tuple[Spec, dict[str, np.ndarray]]:
    """A spec and checkpoint-style state (``params:all``) that compute what an ONNX model does.

    Args:
        proto: an onnx.ModelProto.
        where: the file's name, for messages.

    Returns:
        (spec, state): the spec's model has no loss (predictions are its raw outputs), its data a
        placeholder source with the ONNX preprocessing; state holds ``params:all``.

    Raises:
        OnnxError: naming the node (name, op) that vkflow cannot run, and why.
    """
    onnx = require_onnx()
    graph = proto.graph
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    nodes = []
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            consts[node.output[0]] = _constant(onnx, node)
        elif node.op_type == "Identity" and node.input[0] in consts:  # torch's shared weights
            consts[node.output[0]] = consts[node.input[0]]
        else:
            nodes.append(node)
    inputs = [v for v in graph.input if v.name not in consts]
    if len(inputs) != 1 or len(graph.output) != 1:
        counts = f"{len(inputs)} inputs and {len(graph.output)} outputs"
        raise OnnxError(f"{where}: vkflow runs models of one input and one output, this one has {counts}")
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)
    reader = _Reader(onnx, where, consts, _fuse_gelu(onnx, nodes, consts), opset)
    shape = _input_shape(inputs[0], where)
    reader.values[inputs[0].name] = _Value(INPUT, shape, shape)
    for node in reader.nodes:
        reader.read(node)
    layers, weights = reader.finish(graph.output[0].name)
    loss: Any = MSE()  # predictions are then the raw outputs
    if isinstance(layers[-1], vk.Softmax) and len(layers) > 1:  # predict applies it for CrossEntropy
        layers, loss = layers[:-1], vk.CrossEntropy()
    model = vk.Model(input_shape=shape, layers=layers, loss=loss)
    source = Synthetic(task="regression", samples=1, features=shape)
    spec = Spec(model=model, optimiser=SGD(), data=Data(source, preprocess=tuple(reader.preprocess)))
    if problems := validate(spec):
        raise OnnxError(f"{where}: the model read from it is not valid: " + "; ".join(map(str, problems)))
    return spec, {"params:all": pack_params(model, weights)}


def _constant(onnx: Any, node: Any) -> np.ndarray:
    attribute = node.attribute[0]
    value = onnx.helper.get_attribute_value(attribute)
    if attribute.name == "value":
        return onnx.numpy_helper.to_array(value)
    return np.asarray(value)  # value_float(s), value_int(s)


def _input_shape(value: Any, where: str) -> Shape:
    dims = value.type.tensor_type.shape.dim
    sample = [d.dim_value if d.HasField("dim_value") else 0 for d in dims][1:]
    if len(dims) < 2 or not all(d > 0 for d in sample):
        seen = [d.dim_value if d.HasField("dim_value") else d.dim_param or "?" for d in dims]
        why = "needs a batch dimension and fixed sample sizes"
        raise OnnxError(f"{where}: input {value.name!r} of shape {seen}: vkflow {why}")
    return tuple(sample)


def _fuse_gelu(onnx: Any, nodes: list, consts: dict[str, np.ndarray]) -> list:
    """The nodes with each ``x * 0.5 * (1 + erf(x / sqrt 2))`` (torch's GELU before opset 20, its
    products in any of the orders torch's exporters write) replaced by one Gelu node."""
    producer = {out: n for n in nodes for out in n.output}
    readers: dict[str, list] = defaultdict(list)
    for n in nodes:
        for name in n.input:
            readers[name].append(n)

    def sole(name: str, op: str) -> Any:
        found = readers[name]
        return found[0] if len(found) == 1 and found[0].op_type == op else None

    def other(node: Any, name: str) -> str | None:
        ins = list(node.input)
        return None if len(ins) != 2 or name not in ins else ins[1 - ins.index(name)]

    def near(name: str | None, value: float) -> bool:
        c = consts.get(name) if name else None
        return c is not None and c.size == 1 and abs(float(c.reshape(-1)[0]) - value) < 1e-5

    def chain(erf: Any) -> tuple[str, Any, tuple] | None:
        """GELU's input, the node that gives its output and the others it replaces, or None."""
        scale = producer.get(erf.input[0])
        if scale is None or scale.op_type not in ("Div", "Mul") or len(readers[scale.output[0]]) != 1:
            return None
        x, plus = scale.input[0], sole(erf.output[0], "Add")
        if not near(scale.input[1], SQRT2 if scale.op_type == "Div" else 1 / SQRT2) or plus is None:
            return None
        times = sole(plus.output[0], "Mul")
        if not near(other(plus, erf.output[0]), 1.0) or times is None:
            return None
        rest, then = other(times, plus.output[0]), sole(times.output[0], "Mul")
        group = (scale, erf, plus, times)
        if rest == x and then is not None and near(other(then, times.output[0]), 0.5):
            return x, then, group  # (x * (1 + erf)) * 0.5: torch's TorchScript exporter
        if near(rest, 0.5) and then is not None and other(then, times.output[0]) == x:
            return x, then, group  # x * (0.5 * (1 + erf)): torch's dynamo exporter
        half = producer.get(rest or "")
        if half and half.op_type == "Mul" and near(other(half, x), 0.5) and len(readers[rest]) == 1:
            return x, times, (scale, erf, plus, half)  # (x * 0.5) * (1 + erf)
        return None

    replaced, dropped = {}, set()
    for erf in (n for n in nodes if n.op_type == "Erf"):
        if found := chain(erf):
            x, last, group = found
            name = erf.name or last.name
            replaced[id(last)] = onnx.helper.make_node("Gelu", [x], [last.output[0]], name=name)
            dropped |= {id(n) for n in group if n is not last}
    return [replaced.get(id(n), n) for n in nodes if id(n) not in dropped]


class _Reader:
    def __init__(self, onnx: Any, where: str, consts: dict, nodes: list, opset: int) -> None:
        self.onnx, self.where, self.consts, self.nodes, self.opset = onnx, where, consts, nodes, opset
        self.values: dict[str, _Value] = {}
        self.layers: list[Any] = []
        self.weights: dict[str, np.ndarray] = {}
        self.preprocess: list[Any] = []  # Normalize and Scale, from the ops right after the input
        self.readers: dict[str, int] = defaultdict(int)
        for node in nodes:
            for name in node.input:
                self.readers[name] += 1

    # -- helpers ----------------------------------------------------------------------------------
    def refuse(self, node: Any, why: str) -> OnnxError:
        return OnnxError(f"{self.where}: node {node.name!r} ({node.op_type}): {why}")

    def value(self, node: Any, name: str) -> _Value:
        if name not in self.values:
            raise self.refuse(node, f"its input {name!r} is a constant or comes from no node vkflow read")
        return self.values[name]

    def const(self, node: Any, index: int, optional: bool = False) -> np.ndarray | None:
        name = node.input[index] if index < len(node.input) else ""
        if not name and optional:
            return None
        if name not in self.consts:
            raise self.refuse(node, f"input {index} ({name!r}) must be a constant (an initializer) here")
        return np.asarray(self.consts[name], np.float32)

    def x(self, node: Any) -> _Value:
        """The node's first input, with the ONNX shape."""
        return self.plain(node, self.value(node, node.input[0]))

    def attrs(self, node: Any) -> dict[str, Any]:
        found = {a.name: self.onnx.helper.get_attribute_value(a) for a in node.attribute}
        return {k: v.decode() if isinstance(v, bytes) else v for k, v in found.items()}

    def add(self, node: Any, layer: Any, inputs: list[_Value], params: dict | None = None,
            onnx_shape: Shape | None = None) -> _Value:  # fmt: skip
        index = len(self.layers)
        taken = (INPUT, *(layer.name for layer in self.layers))
        name = node.output[0] if node.output[0] not in taken else f"{node.output[0]}#{index}"
        layer = replace(layer, name=name, inputs=tuple(v.ref for v in inputs))
        ids = tuple(MODEL_INPUT if v.ref == INPUT else 0 for v in inputs)
        shape = node_shape(layer, tuple(v.shape for v in inputs), ids)
        if isinstance(shape, str):
            raise self.refuse(node, shape)
        self.layers.append(layer)
        for key, array in (params or {}).items():
            self.weights[f"layers[{index}].{key}"] = np.asarray(array, np.float32)
        value = _Value(name, shape, onnx_shape or shape, index)
        self.values[node.output[0]] = value
        return value

    def plain(self, node: Any, value: _Value) -> _Value:
        """The value with the ONNX shape, for a reader that needs it (a Reshape view where not)."""
        if value.shape == value.onnx:
            return value
        view = self.onnx.helper.make_node("Reshape", [], [f"{value.ref}/as_onnx"], name=node.name)
        return self.add(view, vk.Reshape(value.onnx), [value])

    def alias(self, node: Any, value: _Value, onnx_shape: Shape | None = None) -> None:
        self.values[node.output[0]] = replace(value, onnx=onnx_shape or value.onnx)

    # -- nodes ------------------------------------------------------------------------------------
    def read(self, node: Any) -> None:
        op = node.op_type
        method = getattr(self, f"_{op}", None)
        if node.domain not in ("", "ai.onnx") or op not in OPS or method is None:
            what = f"node {node.name!r} is a {op} (domain {node.domain or 'ai.onnx'!r})"
            supported = ", ".join(sorted(OPS))
            raise OnnxError(f"{self.where}: {what}, which vkflow does not run; it runs {supported}")
        if any(o and self.readers[o] for o in node.output[1:]):
            raise self.refuse(node, "vkflow gives only its first output, and a later node reads another")
        method(node)

    def _Gemm(self, node: Any) -> None:
        a = self.attrs(node)
        if a.get("transA", 0):
            raise self.refuse(node, "transA=1: vkflow's Linear takes the input untransposed")
        b, c = self.const(node, 1), self.const(node, 2, optional=True)
        weight = (b.T if a.get("transB", 0) else b) * a.get("alpha", 1.0)
        units = weight.shape[1]
        params = {"weight": weight}
        if c is not None:
            params["bias"] = np.broadcast_to(c * a.get("beta", 1.0), (1, units)).reshape(units)
        self.add(node, vk.Linear(units, bias=c is not None), [self.x(node)], params)

    def _MatMul(self, node: Any) -> None:
        if node.input[1] not in self.consts or node.input[0] not in self.values:
            why = "a computed input times a constant [in, out] weight"
            raise self.refuse(node, f"vkflow reads MatMul only as a Linear: {why}")
        weight = self.const(node, 1)
        if weight.ndim != 2:
            raise self.refuse(node, f"a weight of shape {weight.shape}: a Linear's is 2-D [in, out]")
        self.add(node, vk.Linear(weight.shape[1], bias=False), [self.x(node)], {"weight": weight})

    def _Add(self, node: Any) -> None:
        known = [name for name in node.input if name in self.values]
        if len(known) == 2:
            return self._Sum(node)
        constant = next((name for name in node.input if name in self.consts), None)
        if len(known) != 1 or constant is None:
            raise self.refuse(node, "vkflow adds two computed tensors, or one and a constant")
        x, c = self.values[known[0]], np.asarray(self.consts[constant], np.float32)
        layer = self.layers[x.layer] if x.layer is not None else None
        sole = self.readers[known[0]] == 1
        if isinstance(layer, vk.Linear) and not layer.bias and sole and c.size == layer.units:
            self.layers[x.layer] = replace(layer, bias=True)  # the bias of torch's MatMul + Add
            self.weights[f"layers[{x.layer}].bias"] = c.reshape(-1)
            return self.alias(node, x)
        squeezed = c.reshape(c.shape[next((i for i, d in enumerate(c.shape) if d != 1), c.ndim) :])
        if len(x.shape) == 2 and c.size == math.prod(x.shape) and squeezed.shape == x.shape:
            self.add(node, vk.PositionalEmbedding(), [x], {"weight": squeezed})
            return None
        why = "vkflow adds constants only as a Linear's bias or a PositionalEmbedding's (T, D) table"
        raise self.refuse(node, f"adds a constant of shape {c.shape} to {x.onnx}: {why}")

    def _Sum(self, node: Any) -> None:
        xs = [self.plain(node, self.value(node, name)) for name in node.input]
        if len(xs) == 1:
            return self.alias(node, xs[0])
        self.add(node, vk.Add(), xs)
        return None

    def _preprocessing(self, node: Any) -> None:
        x = self.value(node, node.input[0])
        first = x.ref == INPUT and not self.layers and self.readers[node.input[0]] == 1
        if not first or node.input[1] not in self.consts:
            why = "only by a constant right after the input, as preprocessing (Normalize, Scale)"
            raise self.refuse(node, f"vkflow reads {node.op_type} {why}")
        c = self.const(node, 1)
        if node.op_type == "Mul":
            if c.size != 1:
                raise self.refuse(node, f"by a constant of shape {c.shape}: Scale multiplies by one number")
            self.preprocess.append(Scale(float(c.reshape(-1)[0])))
            return self.alias(node, x)
        shape = (1,) * (len(x.shape) + 1 - c.ndim) + c.shape
        if c.ndim > len(x.shape) + 1 or shape[0] != 1 or any(d != 1 for d in shape[2:]):
            raise self.refuse(node, f"by a constant of shape {c.shape}: Normalize takes one or one a channel")
        values = tuple(float(v) for v in c.reshape(-1))
        previous = self.preprocess[-1] if self.preprocess else None
        if node.op_type == "Sub":
            self.preprocess.append(Normalize(values, (1.0,) * len(values)))
        elif isinstance(previous, Normalize) and set(previous.std) == {1.0} and len(previous.mean) == c.size:
            self.preprocess[-1] = Normalize(previous.mean, values)  # (x - mean) / std, exactly
        else:
            self.preprocess.append(Normalize((0.0,) * len(values), values))
        return self.alias(node, x)

    _Sub = _Div = _Mul = _preprocessing

    def _Conv(self, node: Any) -> None:
        x, weight, bias = self.x(node), self.const(node, 1), self.const(node, 2, optional=True)
        a = self.attrs(node)
        k, s, pads = self._window(node, a, weight.shape[2:])
        if a.get("group", 1) != 1:
            raise self.refuse(node, f"group={a['group']}: vkflow's Conv2d has no groups (group must be 1)")
        if len(x.shape) != 3 or weight.shape[1] != x.shape[0]:
            raise self.refuse(node, f"a weight of shape {weight.shape} for an input of shape {x.shape}")
        params = {"weight": weight, **({"bias": bias} if bias is not None else {})}
        layer = vk.Conv2d(weight.shape[0], k, stride=s, padding=pads, bias=bias is not None)
        self.add(node, layer, [x], params)

    def _window(self, node: Any, a: dict, kernel: Any) -> tuple[int, int, int]:
        """(kernel, stride, padding) of a square window, or why vkflow's layers cannot take it."""
        kernel = list(a.get("kernel_shape", kernel))
        strides, pads = list(a.get("strides", [1, 1])), list(a.get("pads", [0] * 4))
        if a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
            raise self.refuse(node, f"auto_pad={a['auto_pad']}: vkflow takes explicit pads")
        if any(d != 1 for d in a.get("dilations", [1])):
            raise self.refuse(node, f"dilations={a['dilations']}: vkflow's {OPS[node.op_type]} has none")
        if a.get("ceil_mode", 0):
            raise self.refuse(node, "ceil_mode=1: vkflow's windows round down")
        if len(kernel) != 2 or len(set(kernel)) != 1 or len(set(strides)) != 1 or len(set(pads)) != 1:
            what = f"kernel_shape={kernel}, strides={strides}, pads={pads}"
            raise self.refuse(node, f"{what}: vkflow takes square windows, one stride and one pad")
        return int(kernel[0]), int(strides[0]), int(pads[0])

    def _MaxPool(self, node: Any) -> None:
        k, s, pad = self._window(node, self.attrs(node), [])
        if pad:
            raise self.refuse(node, f"pads={pad}: vkflow's MaxPool2d has no padding")
        self.add(node, vk.MaxPool2d(k, stride=s), [self.x(node)])

    def _AveragePool(self, node: Any) -> None:
        a = self.attrs(node)
        k, s, pad = self._window(node, a, [])
        if pad and not a.get("count_include_pad", 0):
            raise self.refuse(node, "count_include_pad=0: vkflow's AvgPool2d counts the padding (as PyTorch)")
        self.add(node, vk.AvgPool2d(k, stride=s, padding=pad), [self.x(node)])

    def _GlobalAveragePool(self, node: Any) -> None:
        x = self.x(node)
        self.add(node, vk.GlobalAvgPool(), [x], onnx_shape=(x.shape[0], 1, 1) if len(x.shape) == 3 else None)

    def _BatchNormalization(self, node: Any) -> None:
        a = self.attrs(node)
        if a.get("training_mode", 0):
            raise self.refuse(node, "training_mode=1: vkflow reads batch normalisation for inference")
        x, names = self.x(node), ("weight", "bias", "running_mean", "running_var")
        params = {name: self.const(node, i + 1) for i, name in enumerate(names)}
        kind = vk.BatchNorm2d if len(x.shape) == 3 else vk.BatchNorm1d
        momentum = 1.0 - float(a.get("momentum", 0.9))  # ONNX's is the running statistics' weight
        self.add(node, kind(momentum=momentum, eps=float(a.get("epsilon", 1e-5))), [x], params)

    def _LayerNormalization(self, node: Any) -> None:
        x, a = self.x(node), self.attrs(node)
        if a.get("axis", -1) not in (-1, len(x.shape)):
            raise self.refuse(node, f"axis={a['axis']}: vkflow's LayerNorm is over the last dimension only")
        weight, bias = self.const(node, 1), self.const(node, 2, optional=True)
        params = {"weight": weight, "bias": np.zeros_like(weight) if bias is None else bias}
        self.add(node, vk.LayerNorm(eps=float(a.get("epsilon", 1e-5))), [x], params)

    def _Flatten(self, node: Any) -> None:
        x = self.value(node, node.input[0])
        if self.attrs(node).get("axis", 1) != 1:
            raise self.refuse(node, "axis must be 1: vkflow flattens each sample, keeping the batch")
        if x.shape == (math.prod(x.onnx),):
            return self.alias(node, x, x.shape)
        self.add(node, vk.Flatten(), [x])
        return None

    def _Reshape(self, node: Any) -> None:
        x, target = self.value(node, node.input[0]), [int(d) for d in self.const(node, 1)]
        batch = bool(target) and (target[0] in (0, -1) or -1 not in target[1:])
        if not batch or (self.attrs(node).get("allowzero", 0) and 0 in target):  # a size of 0: no samples
            raise self.refuse(node, f"shape {target}: vkflow reshapes each sample, keeping the batch")
        if any(d == 0 and i >= len(x.onnx) for i, d in enumerate(target[1:])):
            raise self.refuse(node, f"shape {target} copies a dimension the input {x.onnx} lacks")
        shape = reshaped(x.onnx, tuple(x.onnx[i] if d == 0 else d for i, d in enumerate(target[1:])))
        if isinstance(shape, str):
            raise self.refuse(node, shape)
        if shape == x.shape:
            return self.alias(node, x, shape)
        self.add(node, vk.Reshape(shape), [x])
        return None

    def _unary(self, node: Any) -> None:
        a = self.attrs(node)
        if a.get("approximate", "none") != "none":
            raise self.refuse(node, f"approximate={a['approximate']!r}: vkflow's GELU is the exact (erf) one")
        leaky = node.op_type == "LeakyRelu"
        layer = vk.LeakyReLU(float(a.get("alpha", 0.01))) if leaky else _UNARY[node.op_type]()
        self.add(node, layer, [self.x(node)])

    _Relu = _LeakyRelu = _Sigmoid = _Tanh = _Gelu = _unary

    def _Softmax(self, node: Any) -> None:
        x, axis = self.x(node), self.attrs(node).get("axis", -1 if self.opset >= 13 else 1)
        if axis not in (-1, len(x.shape)) or (self.opset < 13 and len(x.shape) != 1):
            raise self.refuse(node, f"axis={axis} (opset {self.opset}): vkflow's Softmax is on the last axis")
        self.add(node, vk.Softmax(), [x])

    def _ReduceMean(self, node: Any) -> None:  # torch's AdaptiveAvgPool2d(1) from its dynamo exporter
        x, a = self.x(node), self.attrs(node)
        axes = a.get("axes") or ([int(d) for d in self.const(node, 1)] if len(node.input) > 1 else [])
        if len(x.shape) != 3 or sorted(d % 4 for d in axes) != [2, 3]:
            raise self.refuse(node, f"axes={axes}: vkflow reads ReduceMean only as the mean over H and W")
        kept = (x.shape[0], 1, 1) if a.get("keepdims", 1) else None
        self.add(node, vk.GlobalAvgPool(), [x], onnx_shape=kept)

    def _Concat(self, node: Any) -> None:
        xs = [self.plain(node, self.value(node, name)) for name in node.input]
        if len(xs) == 1:
            return self.alias(node, xs[0])
        axis = self.attrs(node)["axis"]
        if axis == 0 or axis < -len(xs[0].shape):
            raise self.refuse(node, "axis=0 joins batches: vkflow's Concat joins along a sample dimension")
        self.add(node, vk.Concat(axis=axis - 1 if axis > 0 else axis), xs)
        return None

    def _Identity(self, node: Any) -> None:
        self.alias(node, self.value(node, node.input[0]))

    _Dropout = _Identity  # the identity at inference

    def _Cast(self, node: Any) -> None:
        x = self.value(node, node.input[0])
        if x.ref != INPUT and self.attrs(node).get("to") not in _FLOATS:
            raise self.refuse(node, "vkflow casts only its input (an Embedding's ids) to integers")
        self.alias(node, x)

    def _Gather(self, node: Any) -> None:
        table, ids = self.const(node, 0), self.value(node, node.input[1])
        if table.ndim != 2 or self.attrs(node).get("axis", 0) != 0 or ids.ref != INPUT:
            why = "rows of a 2-D constant table, looked up by the model's input"
            raise self.refuse(node, f"vkflow reads Gather only as an Embedding: {why}")
        self.add(node, vk.Embedding(*table.shape), [ids], {"weight": table})

    def _Erf(self, node: Any) -> None:
        raise self.refuse(node, "vkflow reads Erf only as part of GELU, x * 0.5 * (1 + erf(x / sqrt(2)))")

    # -- the model --------------------------------------------------------------------------------
    def finish(self, output: str) -> tuple[tuple, dict[str, np.ndarray]]:
        """The layers (names and inputs kept only where the graph is not a sequence) and weights."""
        if output not in self.values or self.values[output].ref == INPUT:
            raise OnnxError(f"{self.where}: the output {output!r} is no layer's: vkflow found nothing to run")
        value = self.values[output]
        if value.shape != value.onnx:
            view = self.onnx.helper.make_node("Reshape", [], [f"{output}/output"], name=output)
            value = self.plain(view, value)
        if value.layer != len(self.layers) - 1:
            why = "nodes after it compute tensors nothing reads"
            raise OnnxError(f"{self.where}: the output {output!r} is not the last node's: {why}")
        layers = list(self.layers)
        for i, layer in enumerate(layers):
            previous = layers[i - 1].name if i else INPUT
            if layer.inputs == (previous,) and not isinstance(layer, vk.Add | vk.Concat):
                layers[i] = replace(layer, inputs=None)
        read = {name for layer in layers for name in layer.inputs or ()}
        layers = [layer if layer.name in read else replace(layer, name=None) for layer in layers]
        return tuple(layers), self.weights

"""ONNX export and import (flow.onnx_io), checked against onnxruntime as an independent oracle:
models trained for a few steps on the bundled digits are exported, onnxruntime's outputs equal
``flow.predict``'s on the same raw inputs, and the file read back runs through ``flow.predict`` on
the CPU and Vulkan backends to the same values. Graphs built with onnx.helper in the forms torch
writes (Gemm with transB, Constant nodes, GELU's Erf form, Flatten after GlobalAveragePool) cover
import without torch; where torch is importable (not in CI), a torch.onnx.export round trip too.
Unsupported ops, attributes and damaged files are one clear error each."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import relative_error
from onnx import TensorProto, helper, numpy_helper
from specs import ROOT

import flow
from actors.cpu_backend import CpuBackend
from flow.onnx_io import OnnxError, export_onnx, import_onnx
from flow.spec import (
    GELU,
    Adam,
    Add,
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    Concat,
    Conv2d,
    CrossEntropy,
    Data,
    Devices,
    Digits,
    Dropout,
    Embedding,
    Flatten,
    GlobalAvgPool,
    LayerNorm,
    LeakyReLU,
    Linear,
    MaxPool2d,
    Model,
    Normalize,
    PositionalEmbedding,
    Residual,
    Resize,
    RunSettings,
    SelfAttention,
    Spec,
    Split,
    Synthetic,
    Tanh,
)
from loaders import open_source

SPECS = ROOT / "examples"

TOL = 1e-5  # float32 sums in other orders (vkflow's kernels against onnxruntime's)


@pytest.fixture(scope="module")
def digits_x() -> np.ndarray:
    """Real inputs: the first 150 bundled digits, raw (before the spec's Normalize)."""
    with contextlib.closing(open_source(Digits())) as source:
        return source.read(np.arange(150))[0]


def trained_run(folder, layers: tuple, steps: int = 8):
    """The digits trained for a few steps on the CPU backend, under ``folder``: its run directory."""
    spec = Spec(
        model=Model(input_shape=(1, 8, 8), layers=layers, loss=CrossEntropy()),
        optimiser=Adam(3e-3),
        data=Data(Digits(), batch_size=32, split=Split(train=0.8, val=0.2, stratify=True),
                  preprocess=(Normalize((0.5,), (0.5,)),)),
        devices=Devices("cpu"),
        run=RunSettings(epochs=None, steps=steps, checkpoint_dir=str(folder)),
    )  # fmt: skip
    flow.run(spec)
    return folder


def onnxruntime_outputs(path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (name,) = [i.name for i in session.get_inputs()]
    return session.run(None, {name: x})[0]


def op_types(path) -> set[str]:
    return {node.op_type for node in onnx.load(str(path)).graph.node}


def check_round_trip(run_dir, path, x: np.ndarray, backend, opset: int = 17) -> np.ndarray:
    """Export, compare onnxruntime with flow.predict, read the file back and predict with it on
    ``backend``: every one equal within TOL. Returns onnxruntime's outputs."""
    export_onnx(run_dir, path, opset=opset)
    expected = onnxruntime_outputs(path, x)
    assert relative_error(flow.predict(run_dir, x, backend=CpuBackend()), expected) < TOL
    assert relative_error(flow.predict(path, x, backend=backend), expected) < TOL
    return expected


def test_mlp_exports_and_reads_back(trained, tmp_path, digits_x, backend):
    path = tmp_path / "mlp.onnx"
    expected = check_round_trip(trained, path, digits_x, backend)
    assert np.allclose(expected.sum(1), 1.0, atol=1e-5)  # probabilities, as predict gives
    assert (expected.argmax(1) == flow.predict(trained, digits_x).argmax(1)).mean() > 0.99
    # Normalize leads the graph; Linear is MatMul + Add, its ReLU fused in vkflow but an op here.
    assert op_types(path) == {"Sub", "Div", "Flatten", "MatMul", "Add", "Relu", "Softmax"}
    spec, state = import_onnx(path)
    assert spec.data.preprocess == (Normalize((0.5,), (0.5,)),)
    assert [type(layer).__name__ for layer in spec.model.layers] == [
        "Flatten", "Linear", "ReLU", "Linear", "ReLU", "Linear"
    ]  # fmt: skip
    assert isinstance(spec.model.loss, CrossEntropy)  # the final Softmax: predictions are probabilities


def test_cnn_with_pools_and_batchnorm(tmp_path_factory, tmp_path, digits_x, rng, backend):
    layers = (
        Conv2d(8, 3, padding=1, bias=False), BatchNorm2d(), LeakyReLU(0.2), MaxPool2d(2),
        Conv2d(12, 3, stride=1, padding=1, activation="relu"), AvgPool2d(2, padding=1),
        Dropout(0.25), Conv2d(16, 2, stride=2, activation="tanh"), GlobalAvgPool(), Linear(10),
    )  # fmt: skip
    run_dir = trained_run(tmp_path_factory.mktemp("cnn") / "run", layers)
    inputs = np.concatenate([digits_x[:40], rng.random((9, 1, 8, 8), dtype=np.float32)])
    check_round_trip(run_dir, tmp_path / "cnn.onnx", inputs, backend)
    assert {"Conv", "BatchNormalization", "MaxPool", "AveragePool", "GlobalAveragePool"} <= op_types(
        tmp_path / "cnn.onnx"
    )


@pytest.mark.parametrize("opset", [17, 20])
def test_residual_graph(tmp_path_factory, tmp_path, digits_x, backend, opset):
    layers = (
        Flatten(), Linear(32, name="a"), Residual((Linear(32, activation="gelu"), LayerNorm()), name="r"),
        Linear(32, inputs=("a",)), Tanh(name="b"), Add(inputs=("r", "b")), BatchNorm1d(), GELU(name="c"),
        Linear(8, inputs=("a",), activation="sigmoid", name="d"), Concat(inputs=("c", "d")), Linear(10),
    )  # fmt: skip
    run_dir = trained_run(tmp_path_factory.mktemp(f"residual{opset}") / "run", layers)
    path = tmp_path / "residual.onnx"
    check_round_trip(run_dir, path, digits_x, backend, opset=opset)
    # GELU is Gelu from opset 20, before that the Erf form torch writes (which import reads back).
    assert ("Gelu" in op_types(path), "Erf" in op_types(path)) == (opset >= 20, opset < 20)
    spec, _ = import_onnx(path)
    kinds = [type(layer).__name__ for layer in spec.model.layers]
    assert kinds.count("GELU") == 2 and kinds.count("Add") == 2 and "Concat" in kinds


def language_model() -> Spec:
    t, v, d = 8, 12, 16
    layers = (
        Embedding(v, d), PositionalEmbedding(), Residual((LayerNorm(), SelfAttention(2))), LayerNorm(),
        Linear(v),
    )  # fmt: skip
    return Spec(
        model=Model(input_shape=(t,), layers=layers, loss=CrossEntropy()),
        optimiser=Adam(),
        data=Data(Synthetic(samples=10, features=(t,), classes=v)),
        devices=Devices("cpu"),
    )


def test_language_model_exports_and_its_attention_is_refused_on_import(tmp_path, rng):
    """Embedding, PositionalEmbedding, causal SelfAttention and LayerNorm export (seeded fresh
    weights); reading attention back is refused, naming the first op vkflow does not run."""
    spec = language_model()
    path = export_onnx(spec, tmp_path / "lm.onnx")
    ids = rng.integers(0, 12, (6, 8)).astype(np.float32)
    expected = onnxruntime_outputs(path, ids)
    assert expected.shape == (6, 8, 12)
    assert relative_error(flow.predict(spec, ids), expected) < TOL
    with pytest.raises(OnnxError) as caught:
        flow.predict(path, ids)
    message = str(caught.value)
    assert "layers[2].layers[1]/Split" in message and "is a Split" in message and "Gemm" in message


def test_export_refuses_what_onnx_cannot_hold(trained, tmp_path):
    digits_spec = flow.load(SPECS / "digits.json")
    resized = dataclasses.replace(
        digits_spec, data=dataclasses.replace(digits_spec.data, preprocess=(Resize((8, 8)),))
    )
    with pytest.raises(OnnxError, match=r"data\.preprocess\[0\]: Resize has no ONNX form"):
        export_onnx(resized, tmp_path / "x.onnx")
    with pytest.raises(OnnxError, match="opset 12: ONNX export writes opset 13 or later"):
        export_onnx(trained, tmp_path / "x.onnx", opset=12)
    with pytest.raises(OnnxError, match=r"model\.layers\[2\]\.layers\[0\]: LayerNorm needs opset 17"):
        export_onnx(language_model(), tmp_path / "x.onnx", opset=16)
    assert not (tmp_path / "x.onnx").exists()


# -- graphs as torch writes them, built with onnx.helper -------------------------------------------


def constant(name: str, value) -> onnx.NodeProto:
    array = np.asarray(value, np.int64 if isinstance(value, list) else np.float32)
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array))


# GELU's products as torch's exporters write them: TorchScript's (x * (1 + erf)) * 0.5, dynamo's
# x * (0.5 * (1 + erf)), and (x * 0.5) * (1 + erf).
GELU_FORMS = {
    "torchscript": [("Mul", ["h", "h3"], "h4"), ("Mul", ["h4", "half"], "h5")],
    "dynamo": [("Mul", ["half", "h3"], "h4"), ("Mul", ["h", "h4"], "h5")],
    "half_first": [("Mul", ["h", "half"], "h4"), ("Mul", ["h4", "h3"], "h5")],
}


def torch_like_model(rng, gelu: str = "torchscript", **conv_attrs) -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Relu -> GlobalAveragePool -> Flatten -> Gemm(transB) -> GELU
    (its Erf form, Constant nodes) -> Reshape -> MatMul + Add -> Softmax, on [N, 3, 6, 6]."""
    weights = {
        "conv.w": rng.standard_normal((8, 3, 3, 3)) * 0.4, "conv.b": rng.standard_normal(8) * 0.1,
        "bn.scale": 1 + 0.2 * rng.standard_normal(8), "bn.bias": 0.1 * rng.standard_normal(8),
        "bn.mean": 0.1 * rng.standard_normal(8), "bn.var": rng.uniform(0.5, 1.5, 8),
        "fc.w": rng.standard_normal((16, 8)) * 0.5, "fc.b": rng.standard_normal(16) * 0.1,
        "out.w": rng.standard_normal((16, 5)) * 0.5, "out.b": rng.standard_normal(5) * 0.1,
    }  # fmt: skip
    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1], **conv_attrs}
    nodes = [
        helper.make_node("Conv", ["x", "conv.w", "conv.b"], ["c"], name="/conv/Conv", **attrs),
        helper.make_node("BatchNormalization", ["c", "bn.scale", "bn.bias", "bn.mean", "bn.var"], ["n"],
                         name="/bn/BatchNormalization", epsilon=1e-3, momentum=0.8),
        helper.make_node("Relu", ["n"], ["r"], name="/relu/Relu"),
        *([constant("axes", [-1, -2]), helper.make_node("ReduceMean", ["r", "axes"], ["g"], name="/mean")]
          if gelu == "dynamo"  # as torch's dynamo exporter writes AdaptiveAvgPool2d(1)
          else [helper.make_node("GlobalAveragePool", ["r"], ["g"], name="/pool/GlobalAveragePool")]),
        helper.make_node("Flatten", ["g"], ["f"], name="/flatten/Flatten", axis=1),
        helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["h"], name="/fc/Gemm", transB=1),
        constant("sqrt2", math.sqrt(2)), constant("one", 1.0), constant("half", 0.5),
        helper.make_node("Div", ["h", "sqrt2"], ["h1"], name="/gelu/Div"),
        helper.make_node("Erf", ["h1"], ["h2"], name="/gelu/Erf"),
        helper.make_node("Add", ["h2", "one"], ["h3"], name="/gelu/Add"),
        *(helper.make_node(op, ins, [out], name=f"/gelu/{out}") for op, ins, out in GELU_FORMS[gelu]),
        constant("shape", [-1, 16]),  # dynamo's Reshape says allowzero, which matters only for a 0
        helper.make_node("Reshape", ["h5", "shape"], ["h6"], name="/R", allowzero=int(gelu == "dynamo")),
        helper.make_node("MatMul", ["h6", "out.w"], ["o1"], name="/out/MatMul"),
        helper.make_node("Add", ["o1", "out.b"], ["o2"], name="/out/Add"),
        helper.make_node("Softmax", ["o2"], ["y"], name="/Softmax", axis=-1),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "torch_like",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        initializer=[numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in weights.items()],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("gelu", sorted(GELU_FORMS))
def test_torch_like_graph_runs_on_vkflow(tmp_path, rng, backend, gelu):
    path = tmp_path / "torch_like.onnx"
    # torch's dynamo exporter keeps the weights in a file beside the graph: read from there.
    outside = {"save_as_external_data": True, "location": "torch_like.onnx.data", "size_threshold": 0}
    outside = outside if gelu == "dynamo" else {}
    onnx.save(torch_like_model(rng, gelu), str(path), **outside)
    assert (tmp_path / "torch_like.onnx.data").exists() == bool(outside)
    x = rng.standard_normal((20, 3, 6, 6)).astype(np.float32)
    expected = onnxruntime_outputs(path, x)
    assert relative_error(flow.predict(path, x, backend=backend), expected) < TOL
    spec, _ = import_onnx(path)
    assert [type(layer).__name__ for layer in spec.model.layers] == [
        "Conv2d", "BatchNorm2d", "ReLU", "GlobalAvgPool", "Linear", "GELU", "Linear"
    ]  # fmt: skip
    assert spec.model.layers[1].momentum == pytest.approx(0.2) and spec.model.layers[1].eps == pytest.approx(
        1e-3
    )


@pytest.mark.parametrize(
    "change, words",
    [
        ({"group": 1, "dilations": [2, 2]}, ["'/conv/Conv' (Conv)", "dilations=[2, 2]", "Conv2d has none"]),
        ({"group": 3}, ["'/conv/Conv' (Conv)", "group=3", "no groups"]),
        ({"strides": [1, 2]}, ["'/conv/Conv' (Conv)", "strides=[1, 2]", "square windows"]),
    ],
)
def test_conv_attributes_vkflow_lacks_are_named(tmp_path, rng, change, words):
    model = torch_like_model(rng, **change)
    path = tmp_path / "bad.onnx"
    onnx.save(model, str(path))
    with pytest.raises(OnnxError) as caught:
        flow.predict(path, rng.standard_normal((2, 3, 6, 6)).astype(np.float32))
    assert all(word in str(caught.value) for word in words), str(caught.value)


def test_an_unsupported_op_is_named_with_what_is_supported(tmp_path, rng):
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
             helper.make_node("Selu", ["h"], ["y"], name="my_selu")]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], initializer=[w],
    )  # fmt: skip
    path = tmp_path / "selu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(OnnxError) as caught:
        flow.predict(path, rng.standard_normal((2, 4)).astype(np.float32))
    message = str(caught.value)
    assert message.count("\n") == 0 and str(path) in message
    assert "node 'my_selu' is a Selu" in message
    assert all(
        op in message for op in ("Gemm", "Conv", "BatchNormalization", "LayerNormalization", "Softmax")
    )


def test_damaged_files_are_refused_naming_the_file(trained, tmp_path, rng):
    good = export_onnx(trained, tmp_path / "good.onnx").read_bytes()
    damaged = {
        "noise.onnx": rng.integers(0, 256, 4000).astype(np.uint8).tobytes(),
        "cut.onnx": good[: len(good) // 2],
        "empty.onnx": b"",
    }
    for name, data in damaged.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(OnnxError, match=rf"{name}: not a valid ONNX model"):
            flow.predict(tmp_path / name, np.ones((1, 1, 8, 8), np.float32))
    with pytest.raises(FileNotFoundError):
        import_onnx(tmp_path / "missing.onnx")
    outside = {"save_as_external_data": True, "location": "weights.bin", "size_threshold": 0}
    onnx.save(onnx.load(str(tmp_path / "good.onnx")), str(tmp_path / "split.onnx"), **outside)
    (tmp_path / "weights.bin").unlink()
    with pytest.raises(OnnxError, match=r"split\.onnx: not a valid ONNX model \(.*weights\.bin"):
        import_onnx(tmp_path / "split.onnx")


def test_without_the_onnx_package_says_how_to_install_it(trained, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)
    for call in (lambda: export_onnx(trained, tmp_path / "m.onnx"), lambda: import_onnx(tmp_path / "m.onnx")):
        with pytest.raises(OnnxError, match=r"pip install 'vkflow-ml\[onnx\]'"):
            call()
    assert not (tmp_path / "m.onnx").exists()


# torch's exporters warn about themselves (the TorchScript one is legacy, the dynamo one uses deprecated
# pytree calls): not this test's business.
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("dynamo", [False, True])
def test_torch_onnx_export_round_trip(tmp_path, rng, backend, dynamo):
    """torch.onnx.export's files (the TorchScript exporter and the dynamo one) run on vkflow as in
    torch and onnxruntime. Skipped where torch is missing (CI); it runs on the GPU machine."""
    torch = pytest.importorskip("torch", reason="torch is not installed here (it is on the GPU machine)")
    if dynamo:
        pytest.importorskip("onnxscript", reason="torch's dynamo exporter needs onnxscript")
    nn = torch.nn
    torch.manual_seed(1234)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.LeakyReLU(0.1), nn.AvgPool2d(2), nn.Flatten(),
        nn.Linear(64, 32), nn.GELU(), nn.Dropout(0.3), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 10),
        nn.Softmax(-1),
    ).eval()  # fmt: skip
    with torch.no_grad():  # running statistics that are not the defaults
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    x = rng.standard_normal((12, 1, 8, 8)).astype(np.float32)
    path = tmp_path / "torch.onnx"
    batch = (
        {"dynamic_shapes": ({0: torch.export.Dim.DYNAMIC},)} if dynamo
        else {"dynamic_axes": {"x": {0: "N"}, "y": {0: "N"}}}
    )  # fmt: skip
    torch.onnx.export(
        model, (torch.from_numpy(x[:2]),), str(path), input_names=["x"], output_names=["y"], opset_version=18,
        dynamo=dynamo, **batch,
    )  # fmt: skip
    print(sorted(op_types(path)))
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    assert relative_error(onnxruntime_outputs(path, x), expected) < TOL
    assert relative_error(flow.predict(path, x, backend=backend), expected) < TOL

"""Weights as .safetensors files named and shaped as torch.nn.Sequential's state_dict
(flow.safetensors_io): a trained run's export, an import through ``Init(from_file=...)`` /
``flow.with_weights``, both checked against an independent float64 numpy forward pass written with
torch's conventions (weights (out, in), NCHW, BatchNorm in eval mode, nn.MultiheadAttention's
packed projections), and against torch itself where it is installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from conftest import relative_error
from specs import digits

import flow
from actors.cpu_backend import CpuBackend
from flow.runtime import plan_on, start_engine
from flow.safetensors_io import read_weights, save_weights, torch_tensors
from flow.spec import (
    GELU,
    Adam,
    Add,
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
    Init,
    LayerNorm,
    Linear,
    MaxPool2d,
    Model,
    PositionalEmbedding,
    ReLU,
    Repeat,
    Residual,
    SelfAttention,
    Spec,
    Synthetic,
    Tanh,
)
from flow.testing import FakeDevice
from loaders import open_source

# -- the oracle: torch's forward pass in float64 numpy, from torch-named tensors -------------------


def _activation(x: np.ndarray, name: str | None) -> np.ndarray:
    if name is None:
        return x
    return {
        "relu": lambda v: np.maximum(v, 0.0),
        "tanh": np.tanh,
        "gelu": lambda v: 0.5 * v * (1.0 + np.vectorize(math.erf)(v / math.sqrt(2.0))),
    }[name](x)


def _conv(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int, padding: int) -> np.ndarray:
    x = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    k = w.shape[-1]
    windows = np.lib.stride_tricks.sliding_window_view(x, (k, k), axis=(2, 3))[:, :, ::stride, ::stride]
    return np.einsum("nchwij,ocij->nohw", windows, w) + b[None, :, None, None]


def _attention(x: np.ndarray, t: dict, p: str, heads: int) -> np.ndarray:
    n, length, d = x.shape
    qkv = x @ t[f"{p}.in_proj_weight"].T + t[f"{p}.in_proj_bias"]
    q, k, v = (
        qkv[..., i * d : (i + 1) * d].reshape(n, length, heads, -1).transpose(0, 2, 1, 3) for i in range(3)
    )
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // heads)
    scores = np.where(np.tri(length, dtype=bool), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    y = (weights / weights.sum(-1, keepdims=True)) @ v
    return (
        y.transpose(0, 2, 1, 3).reshape(n, length, d) @ t[f"{p}.out_proj.weight"].T + t[f"{p}.out_proj.bias"]
    )


def _layer(layer, x: np.ndarray, t: dict, p: str, scope: dict) -> np.ndarray:
    if isinstance(layer, Linear):
        return _activation(x @ t[f"{p}.weight"].T + t.get(f"{p}.bias", 0.0), layer.activation)
    if isinstance(layer, Conv2d):
        return _activation(
            _conv(x, t[f"{p}.weight"], t[f"{p}.bias"], layer.stride, layer.padding), layer.activation
        )
    if isinstance(layer, BatchNorm1d | BatchNorm2d):
        shape = (1, -1) + (1,) * (x.ndim - 2)
        mean, var = t[f"{p}.running_mean"].reshape(shape), t[f"{p}.running_var"].reshape(shape)
        scale, shift = t[f"{p}.weight"].reshape(shape), t[f"{p}.bias"].reshape(shape)
        return (x - mean) / np.sqrt(var + layer.eps) * scale + shift
    if isinstance(layer, LayerNorm):
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + layer.eps) * t[f"{p}.weight"] + t[f"{p}.bias"]
    if isinstance(layer, Embedding):
        return t[f"{p}.weight"][x.astype(int)]
    if isinstance(layer, PositionalEmbedding):
        return x + t[f"{p}.weight"]
    if isinstance(layer, SelfAttention):
        return _attention(x, t, p, layer.heads)
    if isinstance(layer, MaxPool2d):
        k = layer.kernel
        return np.lib.stride_tricks.sliding_window_view(x, (k, k), axis=(2, 3))[:, :, ::k, ::k].max(
            axis=(-1, -2)
        )
    if isinstance(layer, Flatten):
        return x.reshape(len(x), -1)
    if isinstance(layer, ReLU | Tanh | GELU):
        return _activation(x, type(layer).__name__.lower())
    if isinstance(layer, Dropout):
        return x
    if isinstance(layer, Residual):
        return x + _sequence(layer.layers, x, t, f"{p}.layers.", scope)
    if isinstance(layer, Repeat):
        for r in range(layer.times):
            x = _sequence(layer.layers, x, t, f"{p}.{r}.", scope)
        return x
    raise AssertionError(f"the oracle has no {type(layer).__name__}")


def _sequence(layers, x: np.ndarray, t: dict, prefix: str, scope: dict) -> np.ndarray:
    """An nn.Sequential-like block; a layer's activation= is a module of its own (one more index)."""
    scope = dict(scope)
    index = 0
    for layer in layers:
        if isinstance(layer, Add | Concat):
            parts = [scope[name] for name in layer.inputs]
            x = sum(parts) if isinstance(layer, Add) else np.concatenate(parts, axis=layer.axis + 1)
        else:
            source = x if layer.inputs is None else scope[layer.inputs[0]]
            x = _layer(layer, source, t, f"{prefix}{index}", scope)
        if layer.name is not None:
            scope[layer.name] = x
        index += 2 if getattr(layer, "activation", None) else 1
    return x


def oracle(model: Model, tensors: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The model's probabilities (softmax over the last axis) from torch-named tensors, in float64."""
    t = {name: value.astype(np.float64) for name, value in tensors.items()}
    logits = _sequence(model.layers, x.astype(np.float64), t, "", {"input": x.astype(np.float64)})
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# -- specs and helpers -----------------------------------------------------------------------------

CNN = Model(
    input_shape=(1, 8, 8),
    layers=(Conv2d(6, 3, padding=1, activation="relu"), BatchNorm2d(), MaxPool2d(2), Flatten(),
            Linear(32, activation="relu"), BatchNorm1d(), Dropout(0.1), Linear(10)),
    loss=CrossEntropy(),
)  # fmt: skip


def with_model(spec: Spec, model: Model) -> Spec:
    return dataclasses.replace(spec, model=model)


def trained_cnn(tmp_path: Path) -> Path:
    """One epoch of the CNN above on the bundled digits (CPU): its final checkpoint."""
    result = flow.run(with_model(digits(tmp_path), CNN), backend=FakeDevice())
    return Path(result.checkpoint)


def spec_of(model: Model, samples_shape: tuple[int, ...]) -> Spec:
    data = Data(Synthetic(samples=64, features=samples_shape, classes=4, seed=1), batch_size=16)
    return Spec(model=model, optimiser=Adam(0.01), data=data, devices=Devices("cpu"))


def random_torch_tensors(model: Model, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """What a torch model's state_dict might hold: random values (variances positive)."""
    tensors = {}
    for t in torch_tensors(model):
        if t.param is None:
            tensors[t.name] = np.array(7, np.int64)
        elif t.name.endswith("running_var"):
            tensors[t.name] = rng.uniform(0.5, 2.0, t.shape).astype(np.float32)
        else:
            tensors[t.name] = (rng.standard_normal(t.shape) * 0.5).astype(np.float32)
    return tensors


def device_parameters(spec: Spec) -> dict[str, np.ndarray]:
    """The parameters a spec starts from on the CPU backend, read back from the device."""
    backend = CpuBackend()
    engine, _ = start_engine(plan_on(spec, backend.facts, mode="predict"), backend)
    return engine.parameters()


def images(count: int = 120) -> np.ndarray:
    """The first bundled digits as the source gives them, in [0, 1]."""
    with contextlib.closing(open_source(Digits())) as source:
        return source.read(np.arange(count))[0]


def normalized(x: np.ndarray) -> np.ndarray:
    """The digits spec's preprocessing, Normalize((0.5,), (0.5,)), which flow.predict applies."""
    return (x - 0.5) / 0.5


# -- names and shapes ------------------------------------------------------------------------------


def test_names_and_shapes_are_those_of_the_equivalent_sequential():
    readme = Model(input_shape=(1, 8, 8), layers=(Flatten(), Linear(128, activation="relu"), Linear(10)),
                   loss=CrossEntropy())  # fmt: skip
    assert {t.name: t.shape for t in torch_tensors(readme)} == {
        "1.weight": (128, 64), "1.bias": (128,), "3.weight": (10, 128), "3.bias": (10,),
    }  # fmt: skip
    # Sequential(Conv2d, ReLU, BatchNorm2d, MaxPool2d, Flatten, Linear, ReLU, BatchNorm1d, Dropout, Linear)
    assert {t.name: t.shape for t in torch_tensors(CNN)} == {
        "0.weight": (6, 1, 3, 3), "0.bias": (6,),
        "2.weight": (6,), "2.bias": (6,), "2.running_mean": (6,), "2.running_var": (6,),
        "2.num_batches_tracked": (),
        "5.weight": (32, 96), "5.bias": (32,),
        "7.weight": (32,), "7.bias": (32,), "7.running_mean": (32,), "7.running_var": (32,),
        "7.num_batches_tracked": (),
        "9.weight": (10, 32), "9.bias": (10,),
    }  # fmt: skip


# -- export ----------------------------------------------------------------------------------------


def test_a_trained_cnn_exports_what_a_float64_torch_forward_pass_agrees_with(tmp_path):
    checkpoint = trained_cnn(tmp_path)
    path = flow.export_safetensors(checkpoint, tmp_path / "w.safetensors")
    tensors = safetensors.numpy.load_file(str(path))
    assert {name: value.shape for name, value in tensors.items()} == {
        t.name: t.shape for t in torch_tensors(CNN)
    }
    assert tensors["2.num_batches_tracked"].dtype == np.int64 and int(tensors["2.num_batches_tracked"]) == 23
    assert all(v.dtype == np.float32 for k, v in tensors.items() if "num_batches" not in k)
    # Training moved the running statistics away from their start (0 and 1): they are exported.
    assert (
        np.abs(tensors["7.running_mean"]).max() > 1e-3 and np.abs(tensors["7.running_var"] - 1).max() > 1e-3
    )
    x = images()
    expected = oracle(CNN, tensors, normalized(x))
    actual = flow.predict(checkpoint, x)
    assert relative_error(actual, expected) < 1e-5
    assert (actual.argmax(1) == expected.argmax(1)).mean() > 0.97


def test_export_then_import_is_bit_exact_and_predicts_the_same(tmp_path):
    checkpoint = trained_cnn(tmp_path)
    path = flow.export_safetensors(checkpoint, tmp_path / "w.safetensors")
    spec = flow.with_weights(with_model(digits(tmp_path, "b"), CNN), path)
    imported = device_parameters(spec)
    again = save_weights(spec.model, imported, tmp_path / "again.safetensors", step=23)
    first, second = safetensors.numpy.load_file(str(path)), safetensors.numpy.load_file(str(again))
    assert first.keys() == second.keys()
    for name in first:
        assert first[name].dtype == second[name].dtype and np.array_equal(first[name], second[name]), name
    x = images(200)
    assert np.array_equal(flow.predict(spec, x), flow.predict(checkpoint, x))


def test_a_run_starts_from_the_file_and_its_spec_file_keeps_it(tmp_path):
    checkpoint = trained_cnn(tmp_path)
    path = flow.export_safetensors(checkpoint, tmp_path / "w.safetensors")
    spec = flow.with_weights(with_model(digits(tmp_path, "b", epochs=1), CNN), path)
    assert spec.model.init == Init(from_file=str(path))
    flow.save(spec, tmp_path / "job.json")
    assert flow.load(tmp_path / "job.json") == spec
    fresh = with_model(digits(tmp_path, "c", epochs=1), CNN)
    flow.save(fresh, tmp_path / "fresh.json")
    assert "from_file" not in (tmp_path / "fresh.json").read_text()  # written as before the option
    tuned, scratch = (
        flow.run(tmp_path / "job.json", backend=FakeDevice()),
        flow.run(fresh, backend=FakeDevice()),
    )
    # Starting from trained weights, another epoch ends lower than one epoch from scratch.
    assert tuned.loss < scratch.loss


def test_import_of_a_graph_and_a_language_model_matches_the_oracle(tmp_path, rng):
    graph = Model(
        input_shape=(12,),
        layers=(Linear(16, activation="tanh", name="a"),
                Residual((Linear(16, activation="relu"), LayerNorm())),
                Repeat(2, (Linear(16), ReLU())), Linear(8, name="b"), Linear(8, inputs=("a",), name="c"),
                Concat(inputs=("b", "c", "input")), Linear(4)),
        loss=CrossEntropy(),
    )  # fmt: skip
    gpt = Model(
        input_shape=(6,),
        layers=(Embedding(11, 16), PositionalEmbedding(),
                Repeat(2, (Residual((LayerNorm(), SelfAttention(4))),
                           Residual((LayerNorm(), Linear(32, activation="gelu"), Linear(16))))),
                LayerNorm(), Linear(11)),
        loss=CrossEntropy(),
    )  # fmt: skip
    assert "2.1.0.layers.0.weight" in {t.name for t in torch_tensors(gpt)}
    assert "2.0.0.layers.1.in_proj_weight" in {t.name for t in torch_tensors(gpt)}
    cases = [
        (graph, rng.standard_normal((40, 12)).astype(np.float32)),
        (gpt, rng.integers(0, 11, (30, 6)).astype(np.float32)),
    ]
    for i, (model, x) in enumerate(cases):
        tensors = random_torch_tensors(model, rng)
        path = tmp_path / f"m{i}.safetensors"
        safetensors.numpy.save_file(tensors, str(path))
        spec = flow.with_weights(spec_of(model, model.input_shape), path)
        assert relative_error(flow.predict(spec, x), oracle(model, tensors, x)) < 1e-5


# -- mistakes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.pop("3.bias"), "missing tensor '3.bias' (shape (10,))"),
        (lambda t: t.update({"4.weight": t["3.weight"]}), "unexpected tensor '4.weight'"),
        (
            lambda t: t.update({"1.weight": t["1.weight"].T.copy()}),
            "tensor '1.weight' has shape (64, 128), expected (128, 64)",
        ),
        (
            lambda t: t.update({"3.weight": t["3.weight"].astype(np.float64)}),
            "tensor '3.weight' is float64, expected float32",
        ),
        (
            lambda t: t.update({"3.bias": t["3.bias"].astype(np.float16)}),
            "tensor '3.bias' is float16, expected float32",
        ),
    ],
)
def test_a_file_that_does_not_fit_is_refused_naming_the_tensor(tmp_path, rng, change, message):
    model = Model(input_shape=(64,), layers=(Dropout(0.2), Linear(128, activation="relu"), Linear(10)),
                  loss=CrossEntropy())  # fmt: skip
    tensors = random_torch_tensors(model, rng)
    change(tensors)
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    with pytest.raises(ValueError, match="does not fit the model") as caught:
        flow.predict(flow.with_weights(spec_of(model, (64,)), path), rng.standard_normal((3, 64)))
    assert message in str(caught.value) and str(path) in str(caught.value)


def test_missing_and_corrupt_files_and_bad_names_are_refused(tmp_path):
    model = Model(input_shape=(4,), layers=(Linear(3),), loss=CrossEntropy())
    with pytest.raises(FileNotFoundError, match="nope.safetensors: no such weights file"):
        read_weights(model, tmp_path / "nope.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match="bad.safetensors: not a readable safetensors file"):
        read_weights(model, tmp_path / "bad.safetensors")
    problems = flow.validate(flow.with_weights(spec_of(model, (4,)), "w.bin"))
    assert [str(p) for p in problems] == ["model.init.from_file: must name a .safetensors file, got 'w.bin'"]
    with pytest.raises(ValueError, match="a spec holds no trained weights"):
        flow.export_safetensors(tmp_path / "job.json", tmp_path / "w.safetensors")


# -- torch itself, where installed ------------------------------------------------------------------


def test_torch_sequential_loads_the_export_and_predicts_the_same(tmp_path):
    torch = pytest.importorskip("torch")
    import safetensors.torch

    nn = torch.nn
    checkpoint = trained_cnn(tmp_path)
    path = flow.export_safetensors(checkpoint, tmp_path / "w.safetensors")
    net = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(6), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(96, 32), nn.ReLU(), nn.BatchNorm1d(32), nn.Dropout(0.1),
                        nn.Linear(32, 10))  # fmt: skip
    net.load_state_dict(safetensors.torch.load_file(str(path)))
    x = images()
    with torch.no_grad():
        expected = torch.softmax(net.eval()(torch.from_numpy(normalized(x))), 1).numpy()
    assert relative_error(flow.predict(checkpoint, x), expected) < 1e-5

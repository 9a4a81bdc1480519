"""Conv1d (a convolution over (C, L), on Conv2d's implicit-GEMM kernels as height 1), MatMul (a
batched matrix product of two named layers, on bmm.comp) and ``run.limit_val_batches``.

The ops run through ``run_op`` on both backends against float64 numpy oracles written here with
explicit loops; whole models' losses and gradients against the same oracles, against central
differences (float64 CPU backend) and Vulkan partial batches against the CPU; a Conv1d model learns
the digits (each 8 x 8 image read as 8 channels of 8 values); validation names each bad field and
its value; specs round-trip; a limited validation round reads only the batches it is allowed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import relative_error
from layer_programs import (
    check_gradients_by_differences,
    check_learns_the_digits,
    check_partial_batch_matches_rows_alone,
    layer_spec,
    nudged_parameters,
    run_train_program,
)

import flow
from actors.cpu_backend import CpuBackend
from actors.single_op import run_op
from flow.codec import load, save
from flow.data_plan import val_batches
from flow.planning import plan
from flow.shapes import count_parameters, infer_shapes
from flow.spec import (
    MSE,
    Adam,
    Conv1d,
    CrossEntropy,
    Data,
    Devices,
    Digits,
    Flatten,
    Linear,
    MatMul,
    Model,
    Normalize,
    Reshape,
    RunSettings,
    Spec,
    Split,
)
from flow.validation import validate

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


def conv1d_oracle(x, w, bias, stride, pad):
    """y[n, k, o] = sum over (c, j) of x[n, c, o * stride + j - pad] w[k, c, j] + bias[k]."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    n, _, length = x.shape
    k, _, taps = w.shape
    out = (length + 2 * pad - taps) // stride + 1
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad)))
    y = np.zeros((n, k, out))
    for o in range(out):
        for j in range(taps):
            y[:, :, o] += padded[:, :, o * stride + j] @ w[:, :, j].T
    return y + (0.0 if bias is None else np.asarray(bias, np.float64)[None, :, None])


def conv1d_backward_oracle(x, w, dy, stride, pad):
    """(dx, dw): each output gradient sent back through the taps that made it (explicit loops)."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    length, taps = x.shape[2], w.shape[2]
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad)))
    dx, dw = np.zeros_like(padded), np.zeros_like(w)
    for o in range(dy.shape[2]):
        for j in range(taps):
            dx[:, :, o * stride + j] += dy[:, :, o] @ w[:, :, j]
            dw[:, :, j] += dy[:, :, o].T @ padded[:, :, o * stride + j]
    return dx[:, :, pad : pad + length], dw


def conv1d_params(n, c, length, k, taps, stride, pad, **extra):
    out = (length + 2 * pad - taps) // stride + 1
    return dict(N=n, C=c, H=1, W=length, K=k, R=1, S=taps, stride=stride, pad=pad, OH=1, OW=out,
                one_d=1, **extra)  # fmt: skip


# (N, C, L, K, kernel, stride, pad): odd sizes, padding wider than a tap, strides that leave a tail.
CONV1D_CASES = [(1, 1, 1, 1, 1, 1, 0), (2, 3, 9, 5, 3, 1, 1), (3, 5, 13, 7, 4, 2, 2), (2, 8, 8, 3, 5, 3, 3)]


@pytest.mark.parametrize("kind", ["conv2d", "conv2d_gemm"])
@pytest.mark.parametrize("case", CONV1D_CASES, ids=[str(c) for c in CONV1D_CASES])
def test_conv1d_runs_on_the_conv2d_kernels_with_padding_along_the_length_only(backend, rng, case, kind):
    n, c, length, k, taps, stride, pad = case
    params = conv1d_params(n, c, length, k, taps, stride, pad)
    x = rng.standard_normal((n, c, 1, length)).astype(np.float32)
    w = rng.standard_normal((k, c, 1, taps)).astype(np.float32)
    bias = rng.standard_normal(k).astype(np.float32)
    dy = rng.standard_normal((n, k, 1, params["OW"])).astype(np.float32)
    y = np.zeros_like(dy)
    got = run_op(backend, kind, {"X": x, "Wt": w, "bias": bias, "Y": y}, has_bias=1, **params)["Y"]
    assert relative_error(got[:, :, 0], conv1d_oracle(x[:, :, 0], w[:, :, 0], bias, stride, pad)) <= TOL
    dx_oracle, dw_oracle = conv1d_backward_oracle(x[:, :, 0], w[:, :, 0], dy[:, :, 0], stride, pad)
    bindings = {"dY": dy, "Wt": w, "dX": np.zeros_like(x)}
    dx = run_op(backend, f"{kind}_backward_data", bindings, **params)["dX"]
    assert relative_error(dx[:, :, 0], dx_oracle) <= TOL
    bindings = {"X": x, "dY": dy, "dW": np.zeros_like(w)}
    dw = run_op(backend, f"{kind}_backward_weight", bindings, **params)["dW"]
    assert relative_error(dw[:, :, 0], dw_oracle) <= TOL


def bmm_oracle(a, b, trans_a, trans_b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    a = a.transpose(0, 2, 1) if trans_a else a
    b = b.transpose(0, 2, 1) if trans_b else b
    out = np.zeros((a.shape[0], a.shape[1], b.shape[2]))
    for z in range(a.shape[0]):
        for kk in range(a.shape[2]):
            out[z] += np.outer(a[z, :, kk], b[z, kk, :])
    return out


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 17, 5, 33), (2, 16, 19, 16), (5, 7, 1, 3)])
def test_bmm_multiplies_each_matrix_of_a_batch(backend, rng, shape, trans_a, trans_b):
    z, m, n, k = shape
    a = rng.standard_normal((z, k, m) if trans_a else (z, m, k)).astype(np.float32)
    b = rng.standard_normal((z, n, k) if trans_b else (z, k, n)).astype(np.float32)
    c = np.full((z, m, n), np.nan, np.float32)
    got = run_op(backend, "bmm", {"A": a, "B": b, "C": c}, batch=z, M=m, N=n, K=k,
                 trans_a=trans_a, trans_b=trans_b)["C"]  # fmt: skip
    assert relative_error(got, bmm_oracle(a, b, trans_a, trans_b)) <= TOL


def test_bmm_keeps_nan_in_its_row_and_column_only(backend):
    a, b = np.ones((2, 3, 4), np.float32), np.ones((2, 4, 5), np.float32)
    a[1, 2, 3] = np.nan
    bindings = {"A": a, "B": b, "C": np.zeros((2, 3, 5), np.float32)}
    got = run_op(backend, "bmm", bindings, batch=2, M=3, N=5, K=4)["C"]
    assert np.isnan(got[1, 2]).all() and not np.isnan(got[0]).any() and not np.isnan(got[1, :2]).any()
    assert (got[0] == 4.0).all()


# Models whose losses and gradients are checked against oracles, central differences and Vulkan.
CONV1D_MODEL = Model(
    input_shape=(3, 11),
    layers=(
        Conv1d(4, 3, stride=2, padding=2, activation="tanh"),
        Conv1d(5, 2, bias=False),
        Flatten(),
        Linear(4),
    ),  # fmt: skip
    loss=CrossEntropy(),
)
MATMUL_MODEL = Model(
    input_shape=(2, 5, 3),
    layers=(
        Reshape((10, 3)),
        Linear(4, activation="tanh"),
        Reshape((2, 5, 4), name="a"),
        Reshape((6, 5), inputs=("input",)),
        Linear(8),
        Reshape((2, 4, 6), name="b"),
        MatMul(inputs=("a", "b")),
        Flatten(),
        Linear(4),
    ),
    loss=CrossEntropy(),
)
# x @ x^T of one layer's output: both gradients reach the same tensor and are summed.
GRAM_MODEL = Model(
    input_shape=(5, 3),
    layers=(Linear(4, name="h"), MatMul(inputs=("h", "h"), transpose_b=True), Flatten(), Linear(4)),
    loss=CrossEntropy(),
)
MODELS = [CONV1D_MODEL, MATMUL_MODEL, GRAM_MODEL]
IDS = ["conv1d", "matmul", "gram"]


def test_shapes_and_parameters():
    assert infer_shapes(CONV1D_MODEL)[:2] == [(4, 7), (5, 6)]
    assert count_parameters(CONV1D_MODEL) == (3 * 4 * 3 + 4) + 4 * 5 * 2 + (30 * 4 + 4)
    assert infer_shapes(MATMUL_MODEL)[6] == (2, 5, 6)
    assert infer_shapes(GRAM_MODEL)[1] == (5, 5)
    weight = next(p for p in plan(layer_spec(CONV1D_MODEL, batch=4)).devices[0].parameters)
    assert weight.name == "layers[0].weight" and weight.shape == (4, 3, 3)  # torch's (out, in, k)


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_gradients_match_central_differences(model, rng):
    check_gradients_by_differences(model, rng)


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_vulkan_partial_batch_matches_the_cpu(model, rng, vulkan_backend):
    check_partial_batch_matches_rows_alone(model, rng, vulkan_backend)


def _train(model, backend, params, x, y):
    device = plan(layer_spec(model, batch=x.shape[0])).devices[0]
    backend.open_layout(device.layout)
    return run_train_program(device, backend, params, x, y)


@pytest.mark.parametrize("name", ["cpu", "vulkan"])
def test_conv1d_layer_loss_and_gradients_match_the_oracle(name, rng, request):
    """Conv1d(6, 4, stride=3, padding=2) then Flatten, MSE: loss and (weight, bias) gradients."""
    model = Model(input_shape=(5, 13), layers=(Conv1d(6, 4, stride=3, padding=2), Flatten()), loss=MSE())
    rows = 3
    backend = CpuBackend(precision="float64") if name == "cpu" else request.getfixturevalue("vulkan_backend")
    device = plan(layer_spec(model, batch=rows)).devices[0]
    params = {k: v.astype(np.float32) for k, v in nudged_parameters(device, rng).items()}
    x = rng.standard_normal((rows, 5, 13)).astype(np.float32)
    target = rng.standard_normal((rows, 6 * 5)).astype(np.float32)
    loss, grads, _ = _train(model, backend, params, x, target)
    w, b = params["layers[0].weight"], params["layers[0].bias"]
    y = conv1d_oracle(x, w, b, 3, 2)
    d = y.reshape(rows, -1) - target
    dy = (2 * d / d.size).reshape(y.shape)
    _, dw = conv1d_backward_oracle(x, w, dy, 3, 2)
    assert loss == pytest.approx(np.mean(d * d), rel=1e-5)
    assert relative_error(grads["layers[0].weight"], dw) <= 1e-4
    assert relative_error(grads["layers[0].bias"], dy.sum(axis=(0, 2))) <= 1e-4


@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("name", ["cpu", "vulkan"])
def test_matmul_layer_loss_and_gradients_match_the_oracle(name, transpose_b, rng, request):
    """Per sample (3, 2, 5) @ (3, 5, 2) (or the (3, 2, 5) transposed), each operand a Linear of
    the input, MSE: the loss and both Linears' weight gradients (dA = dC B^T, dB = A^T dC)."""
    b_shape = (3, 2, 5) if transpose_b else (3, 5, 2)
    model = Model(
        input_shape=(6, 4),
        layers=(
            Linear(5, bias=False),
            Reshape((3, 2, 5), name="a"),
            Linear(5, bias=False, inputs=("input",)),
            Reshape(b_shape, name="b"),
            MatMul(inputs=("a", "b"), transpose_b=transpose_b),
            Flatten(),
        ),
        loss=MSE(),
    )
    rows = 3
    backend = CpuBackend(precision="float64") if name == "cpu" else request.getfixturevalue("vulkan_backend")
    device = plan(layer_spec(model, batch=rows)).devices[0]
    params = {k: v.astype(np.float32) for k, v in nudged_parameters(device, rng).items()}
    x = rng.standard_normal((rows, 6, 4)).astype(np.float32)
    target = rng.standard_normal((rows, 12)).astype(np.float32)
    loss, grads, _ = _train(model, backend, params, x, target)
    x64 = x.astype(np.float64).reshape(-1, 4)
    wa, wb = params["layers[0].weight"].astype(np.float64), params["layers[2].weight"].astype(np.float64)
    a = (x64 @ wa).reshape(rows * 3, 2, 5)
    b = (x64 @ wb).reshape(rows * 3, *b_shape[1:])
    c = bmm_oracle(a, b, 0, int(transpose_b))
    d = c.reshape(rows, -1) - target
    dc = (2 * d / d.size).reshape(c.shape)
    da = bmm_oracle(dc, b, 0, int(not transpose_b))
    db = bmm_oracle(dc, a, 1, 0) if transpose_b else bmm_oracle(a, dc, 1, 0)
    assert loss == pytest.approx(np.mean(d * d), rel=1e-5)
    dwa = x64.T @ da.reshape(-1, 5)
    dwb = x64.T @ db.reshape(-1, 5)
    assert relative_error(grads["layers[0].weight"], dwa) <= 1e-4
    assert relative_error(grads["layers[2].weight"], dwb) <= 1e-4


def test_a_conv1d_model_learns_the_digits_read_as_rows(vulkan_backend):
    """Each 8 x 8 digit as 8 channels (its rows) of 8 values: two Conv1d layers and a classifier."""
    model = Model(
        input_shape=(1, 8, 8),
        layers=(
            Reshape((8, 8)),
            Conv1d(32, 3, padding=1, activation="relu"),
            Conv1d(32, 3, stride=2, activation="relu"),
            Flatten(),
            Linear(10),
        ),
        loss=CrossEntropy(),
    )
    result = check_learns_the_digits(model, vulkan_backend, epochs=6)
    assert infer_shapes(model)[2] == (32, 3)
    assert result.evals[-1].loss < 0.5


def _problems(model: Model, **run) -> list[tuple[str, str]]:
    spec = layer_spec(model, batch=4)
    spec = Spec(model=spec.model, optimiser=spec.optimiser, data=spec.data, run=RunSettings(**run))
    return [(p.path, p.message) for p in validate(spec)]


def _model(*layers, shape=(3, 9)) -> Model:
    return Model(input_shape=shape, layers=(*layers, Flatten(), Linear(4)), loss=CrossEntropy())


@pytest.mark.parametrize(
    "layer, path, message",
    [
        (Conv1d(0, 3), "channels", "must be > 0, got 0"),
        (Conv1d(4, -1), "kernel", "must be > 0, got -1"),
        (Conv1d(4, 3, stride=0), "stride", "must be > 0, got 0"),
        (Conv1d(4, 3, padding=-2), "padding", "must be >= 0, got -2"),
    ],
)
def test_bad_conv1d_fields_are_named_with_their_values(layer, path, message):
    assert _problems(_model(layer)) == [(f"model.layers[0].{path}", message)]


def test_conv1d_and_matmul_shape_mistakes_name_the_layer():
    assert _problems(_model(Conv1d(4, 3), shape=(3, 9, 9))) == [
        (
            "model.layers[0]",
            "Conv1d needs a (channels, length) input, got shape (3, 9, 9); add Reshape((C, L))",
        )  # fmt: skip
    ]
    assert _problems(_model(Conv1d(4, 12, padding=1))) == [
        ("model.layers[0]", "Conv1d output length 0 is not positive (input length 9, kernel 12, "
                            "stride 1, padding 1): the kernel is longer than the padded input")
    ]  # fmt: skip
    one = _model(Linear(5, name="a"), MatMul(inputs=("a",)))
    assert _problems(one) == [("model.layers[1].inputs", "MatMul multiplies two layers: name them, got 1")]
    unnamed = _model(Linear(5), MatMul())
    none = "MatMul multiplies two layers: name them, got none"
    assert _problems(unnamed) == [("model.layers[1].inputs", none)]
    mismatch = _model(Linear(5, name="a"), MatMul(inputs=("a", "input")))
    assert _problems(mismatch) == [
        ("model.layers[1]", "MatMul's inputs (3, 5) and (3, 9) do not multiply: the second must be "
                            "(..., K, N) with K = 5")
    ]  # fmt: skip
    ranks = _model(Reshape((3, 3, 3), name="a"), MatMul(inputs=("a", "input")))
    assert "equal leading dimensions, got (3, 3, 3) and (3, 9)" in _problems(ranks)[0][1]


@pytest.mark.parametrize("value", [0, -2, 1.5, 0.0, -0.5])
def test_a_bad_limit_val_batches_is_named_with_its_value(value):
    message = "must be an int > 0 (batches) or a float in (0, 1] (a fraction of the batches)"
    assert _problems(_model(Conv1d(4, 3)), limit_val_batches=value) == [
        ("run.limit_val_batches", f"{message}, got {value!r}")
    ]


def test_specs_with_the_new_records_round_trip(tmp_path):
    spec = layer_spec(MATMUL_MODEL, batch=4)
    for limit in (3, 0.25):
        whole = Spec(model=CONV1D_MODEL, optimiser=spec.optimiser, data=spec.data,
                     run=RunSettings(limit_val_batches=limit))  # fmt: skip
        for original in (spec, whole):
            for name in ("job.json", "job.msgpack"):
                save(original, tmp_path / name)
                assert load(tmp_path / name) == original
        tree = json.loads((tmp_path / "job.json").read_text())
        assert tree["run"]["limit_val_batches"] == limit
        assert type(load(tmp_path / "job.json").run.limit_val_batches) is type(limit)
    layers = json.loads((tmp_path / "job.json").read_text())["model"]["layers"]
    assert layers[0] == {"activation": "tanh", "bias": True, "channels": 4, "kernel": 3, "kind": "Conv1d",
                         "padding": 2, "stride": 2}  # fmt: skip
    save(spec, tmp_path / "mm.json")
    matmul = json.loads((tmp_path / "mm.json").read_text())["model"]["layers"][6]
    assert matmul == {"inputs": ["a", "b"], "kind": "MatMul", "transpose_b": False}


def test_val_batches_resolves_counts_and_fractions():
    assert val_batches(None, 360, 64) is None
    assert val_batches(2, 360, 64) == 2
    assert val_batches(6, 360, 64) is None and val_batches(100, 360, 64) is None  # all of them
    assert val_batches(0.5, 360, 64) == 3
    assert val_batches(0.01, 360, 64) == 1  # at least one batch
    assert val_batches(1.0, 360, 64) is None


def _digits_spec(tmp_path: Path, limit) -> Spec:
    model = Model(input_shape=(1, 8, 8), layers=(Flatten(), Linear(10)), loss=CrossEntropy())
    return Spec(
        model=model,
        optimiser=Adam(lr=0.003),
        data=Data(Digits(), batch_size=64, split=Split(train=0.8, val=0.2, stratify=True),
                  preprocess=(Normalize((0.5,), (0.5,)),)),
        devices=Devices("cpu"),
        run=RunSettings(epochs=2, limit_val_batches=limit, metrics_file=str(tmp_path / "metrics.jsonl")),
    )  # fmt: skip


@pytest.mark.parametrize("limit, batches", [(2, 2), (0.5, 3), (None, 6)])
def test_each_validation_round_reads_only_its_limit(tmp_path, limit, batches):
    """The digits' 359 validation samples are 6 batches of 64 (the last of 39): each round scores
    the first ``batches`` of them."""
    spec = _digits_spec(tmp_path, limit)
    result = flow.run(spec)
    vals = [e for e in result.evals if e.split == "val"]
    assert len(vals) == 2
    expected = min(359, batches * 64)
    assert [e.samples for e in vals] == [expected, expected]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rounds = [e for e in map(json.loads, lines) if e.get("split") == "val" and "samples" in e]
    assert [e["samples"] for e in rounds] == [expected, expected]


def _flow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flow", *args], capture_output=True, text=True, cwd=ROOT,
                          check=False)  # fmt: skip


def test_flow_plan_shows_the_limit(tmp_path):
    save(_digits_spec(tmp_path, 0.5), tmp_path / "job.json")
    done = _flow("plan", str(tmp_path / "job.json"))
    assert done.returncode == 0, done.stderr
    assert "on the first 3 validation batches (run.limit_val_batches)" in done.stdout
    data = json.loads(_flow("plan", str(tmp_path / "job.json"), "--json").stdout)["data"]
    assert data["val_batches"] == 3
    assert data["splits"]["val"]["samples"] == 359 and data["splits"]["val"]["batches"] == 3
    bad = json.loads((tmp_path / "job.json").read_text())
    bad["run"]["limit_val_batches"] = 0
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    done = _flow("check", str(tmp_path / "bad.json"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "run.limit_val_batches: must be an int > 0" in done.stdout + done.stderr and "got 0" in done.stdout

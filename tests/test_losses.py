"""The losses (issue 16): CrossEntropy with label smoothing, class weights and one cross-entropy per
position (a language model's per token), L1, Huber and BCEWithLogits. Each kernel's loss and
gradient against a float64 numpy oracle (and torch where it is installed) on every backend, with
odd sizes and partial batches whose padding rows must take no part; then whole models: the train
program against the oracle on CPU and Vulkan, gradients against finite differences, accuracy per
token, the predict program's output, spec files, bad specs named by their path, and ``flow.run``
on the bundled digits with label smoothing.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import relative_error
from layer_programs import check_learns_the_digits, layer_spec, nudged_parameters, run_train_program

from actors.backend import run_program
from actors.cpu_backend import CpuBackend
from actors.single_op import run_op
from flow.codec import dumps, encode, load, loads, save
from flow.data_plan import data_problems
from flow.graph import CLASS_WEIGHTS, label_shape
from flow.planning import init_parameters, plan
from flow.shapes import infer_shapes
from flow.spec import (
    L1,
    MSE,
    BCEWithLogits,
    CrossEntropy,
    Embedding,
    Flatten,
    Huber,
    LayerNorm,
    Linear,
    Model,
)
from flow.validation import validate
from shaders.registry import LOSSES

try:
    import torch
except ImportError:  # torch is an optional second oracle
    torch = None

TOL = 1e-5


def stepvals(real: int) -> np.ndarray:
    return np.array([0.0, 1.0, 1.0, 1.0, real, real], np.float32)


# Oracles, float64 --------------------------------------------------------------------------------


def xent_oracle(logits, labels, smoothing=0.0, weights=None):
    """PyTorch's CrossEntropyLoss (mean) of logits [rows, C] against labels [rows]: the loss and
    d(loss)/d(logits), from d/dz sum_c a_c (-log p_c) = (sum_c a_c) p - a with a = w * q."""
    z = np.asarray(logits, np.float64)
    rows, c = z.shape
    w = np.ones(c) if weights is None else np.asarray(weights, np.float64)
    shifted = z - z.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    q = np.full((rows, c), smoothing / c)
    q[np.arange(rows), labels] += 1 - smoothing
    a = w * q
    divisor = w[labels].sum()
    loss = -(a * log_p).sum() / divisor
    grad = (a.sum(axis=1, keepdims=True) * np.exp(log_p) - a) / divisor
    return loss, grad


def pointwise_oracle(kind: str, y, t, delta=1.0):
    """The mean pointwise loss of y against t [rows, cols] and its gradient."""
    y, t = np.asarray(y, np.float64), np.asarray(t, np.float64)
    d, count = y - t, y.size
    if kind == "MSE":
        f, g = d * d, 2 * d
    elif kind == "L1":
        f, g = np.abs(d), np.sign(d)
    elif kind == "Huber":
        f = np.where(np.abs(d) < delta, 0.5 * d * d, delta * (np.abs(d) - 0.5 * delta))
        g = np.clip(d, -delta, delta)
    else:
        f = np.logaddexp(0.0, y) - y * t  # log(1 + e^y) - y t
        g = 1 / (1 + np.exp(-y)) - t
    return f.sum() / count, g / count


def torch_loss(kind: str, y, t, **options):
    """The same loss and gradient from torch, in float64."""
    z = torch.tensor(np.asarray(y, np.float64), requires_grad=True)
    if kind == "CrossEntropy":
        weights = options.get("weights")
        fn = torch.nn.CrossEntropyLoss(
            weight=None if weights is None else torch.tensor(weights, dtype=torch.float64),
            label_smoothing=options.get("smoothing", 0.0),
        )
        target = torch.tensor(np.asarray(t, np.int64))
    else:
        fn = {
            "MSE": torch.nn.MSELoss(),
            "L1": torch.nn.L1Loss(),
            "Huber": torch.nn.HuberLoss(delta=options.get("delta", 1.0)),
            "BCEWithLogits": torch.nn.BCEWithLogitsLoss(),
        }[kind]
        target = torch.tensor(np.asarray(t, np.float64))
    loss = fn(z, target)
    loss.backward()
    return loss.item(), z.grad.numpy()


def test_oracles_agree_with_torch(rng):
    if torch is None:
        pytest.skip("torch is not installed")
    z, labels = rng.standard_normal((9, 7)) * 3, rng.integers(0, 7, 9)
    weights = rng.uniform(0.2, 2.0, 7)
    for options in ({}, {"smoothing": 0.2}, {"weights": weights}, {"smoothing": 0.3, "weights": weights}):
        loss, grad = xent_oracle(z, labels, options.get("smoothing", 0.0), options.get("weights"))
        expected_loss, expected_grad = torch_loss("CrossEntropy", z, labels, **options)
        assert loss == pytest.approx(expected_loss, rel=1e-12)
        assert relative_error(grad, expected_grad) <= 1e-12
    t = rng.uniform(0, 1, (9, 7))
    for kind in LOSSES:
        loss, grad = pointwise_oracle(kind, z, t, delta=0.8)
        expected_loss, expected_grad = torch_loss(kind, z, t, delta=0.8)
        assert loss == pytest.approx(expected_loss, rel=1e-12), kind
        assert relative_error(grad, expected_grad) <= 1e-12, kind


# The kernels -------------------------------------------------------------------------------------


def run_cross_entropy(backend, logits, labels, real, per_sample, smoothing, weights, write_grad=True):
    """The launches CrossEntropy's loss emits, by hand: (loss, correct count, dlogits)."""
    rows, cols = logits.shape
    dims = dict(rows=rows, cols=cols, write_grad=int(write_grad), per_sample=per_sample)
    step = stepvals(real)
    dlogits = np.full_like(logits, np.nan)
    if smoothing == 0.0 and weights is None and cols <= 32:
        out = run_op(backend, "softmax_xent_totals", {"logits": logits, "labels": labels,
                     "loss": np.zeros(1, np.float32), "correct": np.zeros(1, np.float32),
                     "dlogits": dlogits, "stepvals": step}, **dims)  # fmt: skip
        return float(out["loss"][0]), float(out["correct"][0]) * per_sample, out["dlogits"]
    weight_sum = np.ones(1, np.float32)
    if weights is not None:
        weights = np.asarray(weights, np.float32)
        summed = {"labels": labels, "weights": weights, "stepvals": step, "weight_sum": weight_sum}
        weight_sum = run_op(backend, "class_weight_sum", summed, rows=rows, cols=cols, per_sample=per_sample)
        weight_sum = weight_sum["weight_sum"]
    blank = np.full(rows, np.nan, np.float32)
    bindings = {"logits": logits, "labels": labels, "loss_rows": blank, "correct_rows": blank.copy(),
                "dlogits": dlogits, "stepvals": step}  # fmt: skip
    if smoothing == 0.0 and weights is None:
        out = run_op(backend, "softmax_xent", bindings, **dims)
    else:
        bindings.update(
            weights=weights if weights is not None else np.ones(1, np.float32), weight_sum=weight_sum
        )
        out = run_op(backend, "softmax_xent_general", bindings, **dims,
                     weighted=int(weights is not None), smoothing=smoothing)  # fmt: skip
    assert not out["loss_rows"][real * per_sample :].any(), "padding rows must have no loss"
    return float(out["loss_rows"].sum()), float(out["correct_rows"].sum()), out["dlogits"]


# (samples, per_sample, classes, real samples, label smoothing, weighted): narrow and wide rows,
# columns past a workgroup's 64 invocations, one and several positions a sample, partial batches.
XENT_CASES = [
    (5, 1, 7, 5, 0.0, False),
    (6, 3, 9, 4, 0.0, False),
    (5, 4, 45, 3, 0.0, False),
    (7, 1, 10, 7, 0.1, False),
    (6, 1, 10, 4, 0.0, True),
    (5, 3, 13, 2, 0.25, True),
    (3, 5, 130, 3, 0.1, True),
    (70, 2, 33, 61, 0.5, True),
]


@pytest.mark.parametrize("samples,per_sample,classes,real,smoothing,weighted", XENT_CASES)
def test_cross_entropy_kernels_match_the_oracle(
    backend, rng, samples, per_sample, classes, real, smoothing, weighted
):
    rows, n = samples * per_sample, real * per_sample
    logits = (rng.standard_normal((rows, classes)) * 3).astype(np.float32)
    logits[n:] = 1e4 * rng.standard_normal(logits[n:].shape)  # padding: must change nothing
    labels = rng.integers(0, classes, rows).astype(np.int32)
    weights = rng.uniform(0.1, 3.0, classes) if weighted else None
    loss, correct, dlogits = run_cross_entropy(backend, logits, labels, real, per_sample, smoothing, weights)
    expected_loss, expected_grad = xent_oracle(logits[:n], labels[:n], smoothing, weights)
    assert loss == pytest.approx(expected_loss, rel=TOL)
    assert relative_error(dlogits[:n], expected_grad) <= TOL
    assert not dlogits[n:].any()
    assert correct == pytest.approx((logits[:n].argmax(axis=1) == labels[:n]).sum(), rel=1e-6)
    if torch is not None:
        options = {"smoothing": smoothing, "weights": weights}
        torch_value, torch_grad = torch_loss("CrossEntropy", logits[:n], labels[:n], **options)
        assert loss == pytest.approx(torch_value, rel=TOL)
        assert relative_error(dlogits[:n], torch_grad) <= TOL


def test_class_weight_sum_scales_to_the_data_parallel_divisor(backend):
    """Under data parallelism stepvals[5] is the global batch: this shard's sum is scaled to it."""
    labels, weights = np.array([0, 2, 2, 1], np.int32), np.array([1.0, 2.0, 4.0], np.float32)
    step = np.array([0.0, 1.0, 1.0, 1.0, 3, 12], np.float32)
    out = run_op(backend, "class_weight_sum", {"labels": labels, "weights": weights, "stepvals": step,
                 "weight_sum": np.zeros(1, np.float32)}, rows=4, cols=3)  # fmt: skip
    assert out["weight_sum"][0] == pytest.approx((1 + 4 + 4) * 12 / 3)


# (rows, cols, real rows)
POINTWISE_CASES = [(4, 1, 4), (5, 7, 3), (3, 300, 2), (70, 9, 65)]


@pytest.mark.parametrize("kind", list(LOSSES))
@pytest.mark.parametrize("rows,cols,real", POINTWISE_CASES)
def test_pointwise_kernels_match_the_oracle(backend, rng, kind, rows, cols, real):
    y = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    t = rng.uniform(0, 1, (rows, cols)) if kind == "BCEWithLogits" else rng.standard_normal((rows, cols))
    t = t.astype(np.float32)
    y[real:] = 1e4  # padding: must change nothing
    delta = 0.7
    out = run_op(backend, "mse", {"Y": y, "T": t, "loss_rows": np.full(rows, np.nan, np.float32),
                 "dY": np.full_like(y, np.nan), "stepvals": stepvals(real)},
                 rows=rows, cols=cols, write_grad=1, fn=LOSSES[kind], delta=delta)  # fmt: skip
    expected_loss, expected_grad = pointwise_oracle(kind, y[:real], t[:real], delta)
    assert float(out["loss_rows"].sum()) == pytest.approx(expected_loss, rel=TOL)
    assert relative_error(out["dY"][:real], expected_grad) <= TOL
    assert not out["loss_rows"][real:].any() and not out["dY"][real:].any()
    if torch is not None:
        torch_value, torch_grad = torch_loss(kind, y[:real], t[:real], delta=delta)
        assert float(out["loss_rows"].sum()) == pytest.approx(torch_value, rel=TOL)
        assert relative_error(out["dY"][:real], torch_grad) <= TOL


def test_bce_with_logits_is_stable_for_large_logits(backend):
    y = np.array([[90.0, -90.0, 0.0, 30.0]], np.float32)
    t = np.array([[1.0, 0.0, 0.5, 0.0]], np.float32)
    out = run_op(backend, "mse", {"Y": y, "T": t, "loss_rows": np.zeros(1, np.float32),
                 "dY": np.zeros_like(y), "stepvals": stepvals(1)},
                 rows=1, cols=4, write_grad=1, fn=LOSSES["BCEWithLogits"])  # fmt: skip
    assert np.isfinite(out["loss_rows"]).all() and np.isfinite(out["dY"]).all()
    assert out["loss_rows"][0] == pytest.approx((math.log(2) + 30) / 4, rel=1e-6)


# Whole models ------------------------------------------------------------------------------------

WEIGHTS = (0.5, 2.0, 1.0, 3.0, 0.25)


def spread(low: float, high: float, n: int) -> tuple[float, ...]:
    return tuple(float(w) for w in np.linspace(low, high, n))


MODELS = {
    "smoothing": Model(input_shape=(6,), layers=(Linear(7, activation="tanh"), Linear(5)),
                       loss=CrossEntropy(label_smoothing=0.2)),
    "weights": Model(input_shape=(6,), layers=(Linear(5),), loss=CrossEntropy(class_weights=WEIGHTS)),
    "both_wide": Model(input_shape=(6,), layers=(Linear(40),),
                       loss=CrossEntropy(label_smoothing=0.1, class_weights=spread(0.5, 2, 40))),
    "per_token": Model(input_shape=(5,), layers=(Embedding(7, 7),), loss=CrossEntropy()),
    "per_token_wide": Model(input_shape=(4,), layers=(Embedding(37, 37),),
                            loss=CrossEntropy(label_smoothing=0.1, class_weights=spread(1, 2, 37))),
    "per_token_norm": Model(input_shape=(3, 6), layers=(LayerNorm(),),
                            loss=CrossEntropy(label_smoothing=0.3)),
    "bce": Model(input_shape=(6,), layers=(Linear(7, activation="tanh"), Linear(4)), loss=BCEWithLogits()),
    "l1": Model(input_shape=(6,), layers=(Linear(3),), loss=L1()),
    "huber": Model(input_shape=(6,), layers=(Linear(5, activation="tanh"), Linear(3)), loss=Huber(delta=0.4)),
}  # fmt: skip


def model_batch(model: Model, rows: int, rng):
    """(x, y) for ``model``: token ids for an Embedding; class ids of the output's leading shape,
    or targets of its shape (in [0, 1] for BCEWithLogits)."""
    x = rng.standard_normal((rows, *model.input_shape)) * 2.0 + 0.5
    if isinstance(model.layers[0], Embedding):
        x = rng.integers(0, model.layers[0].num_embeddings, x.shape).astype(np.float64)
    out = infer_shapes(model)[-1]
    if isinstance(model.loss, CrossEntropy):
        return x, rng.integers(0, out[-1], (rows, *out[:-1])).astype(np.int32)
    if isinstance(model.loss, BCEWithLogits):
        return x, rng.uniform(0, 1, (rows, *out))
    return x, rng.standard_normal((rows, *out))


def model_output(model: Model, params, x):
    """The model's output in float64 for the three shapes of model above."""
    layer = model.layers[0]
    if isinstance(layer, Embedding):
        return params["layers[0].weight"][x.astype(np.int64)]
    if isinstance(layer, LayerNorm):
        mean, var = x.mean(axis=-1, keepdims=True), x.var(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(var + layer.eps) * params["layers[0].weight"] + params["layers[0].bias"]
    h = x
    for i, layer in enumerate(model.layers):
        h = h @ params[f"layers[{i}].weight"] + params[f"layers[{i}].bias"]
        h = np.tanh(h) if layer.activation == "tanh" else h
    return h


def oracle_loss(model: Model, output, y):
    loss = model.loss
    if isinstance(loss, CrossEntropy):
        classes = output.shape[-1]
        return xent_oracle(
            output.reshape(-1, classes), y.reshape(-1), loss.label_smoothing, loss.class_weights
        )[0]
    return pointwise_oracle(type(loss).__name__, output, y, getattr(loss, "delta", 1.0))[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_train_program_loss_matches_the_oracle_with_padding(name, rng, backend):
    """A partial batch (4 real rows of 7, padding of large values) on each backend: the loss is
    the oracle's over the real rows alone."""
    model, rows, real = MODELS[name], 7, 4
    device = plan(layer_spec(model, batch=rows)).devices[0]
    params = {k: v.astype(np.float32) for k, v in nudged_parameters(device, rng).items()}
    if CLASS_WEIGHTS in params:  # kept as the spec says, not nudged
        params[CLASS_WEIGHTS] = np.asarray(model.loss.class_weights, np.float32)
    x, y = model_batch(model, rows, rng)
    if not isinstance(model.layers[0], Embedding):
        x[real:] = 50.0 * rng.standard_normal(x[real:].shape)
    x = x.astype(np.float32)
    backend.open_layout(device.layout)
    loss, _, _ = run_train_program(device, backend, params, x, y, real)
    wide = {k: v.astype(np.float64) for k, v in params.items()}
    expected = oracle_loss(model, model_output(model, wide, x[:real].astype(np.float64)), y[:real])
    assert loss == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_whole_model_gradients_match_finite_differences(name, rng):
    """The train program's gradients (float64 CPU backend, 5 rows of which 3 are real) against
    central differences of its loss at 4 random elements of every trainable parameter."""
    model, rows, real = MODELS[name], 5, 3
    device = plan(layer_spec(model, batch=rows)).devices[0]
    backend = CpuBackend(precision="float64")
    backend.open_layout(device.layout)
    params = nudged_parameters(device, rng)
    x, y = model_batch(model, rows, rng)
    _, grads, kept = run_train_program(device, backend, params, x, y, real)
    if CLASS_WEIGHTS in kept:
        assert np.array_equal(kept[CLASS_WEIGHTS], params[CLASS_WEIGHTS])
    eps = 1e-6
    for param, grad in grads.items():
        for index in rng.choice(grad.size, size=min(4, grad.size), replace=False):
            shifted = {k: v.copy() for k, v in params.items()}
            shifted[param].reshape(-1)[index] += eps
            up, _, _ = run_train_program(device, backend, shifted, x, y, real)
            shifted[param].reshape(-1)[index] -= 2 * eps
            down, _, _ = run_train_program(device, backend, shifted, x, y, real)
            numeric = (up - down) / (2 * eps)
            assert grad.reshape(-1)[index] == pytest.approx(numeric, rel=1e-5, abs=1e-8), (param, index)


def test_class_weights_start_as_the_spec_says_and_are_never_trained():
    model = MODELS["weights"]
    device = plan(layer_spec(model, batch=4)).devices[0]
    weights = init_parameters(device, "he", 0)[CLASS_WEIGHTS]
    assert weights.tolist() == list(WEIGHTS)
    assert not next(p for p in device.parameters if p.name == CLASS_WEIGHTS).trainable
    ops = [launch.op for launch in device.program("train").launches]
    assert ops.index("class_weight_sum") < ops.index("softmax_xent_general")


def test_default_cross_entropy_keeps_its_fused_narrow_kernel():
    model = Model(input_shape=(6,), layers=(Linear(10),), loss=CrossEntropy())
    launches = plan(layer_spec(model, batch=4)).devices[0].program("train").launches
    assert [launch.op for launch in launches if {"loss", "correct"} & set(launch.args)] == [
        "softmax_xent_totals"
    ]


@pytest.mark.parametrize("name", ["per_token", "per_token_wide"])
def test_per_token_accuracy_counts_tokens(name, rng, backend):
    """correct / real samples is the fraction of right tokens among the real samples' tokens."""
    model, rows, real = MODELS[name], 6, 4
    device = plan(layer_spec(model, batch=rows)).devices[0]
    params = {k: v.astype(np.float32) for k, v in nudged_parameters(device, rng).items()}
    x, y = model_batch(model, rows, rng)
    table = params["layers[0].weight"]
    # Half the tokens right for sure: their label is their row's argmax.
    y[:, ::2] = table[x.astype(np.int64)].argmax(axis=-1)[:, ::2]
    backend.open_layout(device.layout)
    for name_, value in params.items():
        backend.write(name_, value)
    backend.write("x", x.astype(np.float32))
    backend.write("y", y)
    backend.write("stepvals", stepvals(real))
    run_program(backend, device.program("eval"))
    right = (table[x[:real].astype(np.int64)].argmax(axis=-1) == y[:real]).mean()
    assert float(backend.read("correct")[0]) / real == pytest.approx(right, rel=1e-6)
    assert 0.5 <= right < 1


def test_predict_outputs_probabilities(rng):
    """Softmax over the last dimension for CrossEntropy (each token's), sigmoid for BCEWithLogits."""
    for name in ("per_token", "bce", "huber"):
        model = MODELS[name]
        device = plan(layer_spec(model, batch=3)).devices[0]
        backend = CpuBackend(precision="float64")
        backend.open_layout(device.layout)
        params = nudged_parameters(device, rng)
        for key, value in params.items():
            backend.write(key, value)
        x, _ = model_batch(model, 3, rng)
        backend.write("x", x)
        backend.write("stepvals", stepvals(3))
        run_program(backend, device.program("predict"))
        raw = model_output(model, params, x)
        expected = {
            "per_token": np.exp(raw) / np.exp(raw).sum(axis=-1, keepdims=True),
            "bce": 1 / (1 + np.exp(-raw)),
            "huber": raw,
        }[name]
        assert relative_error(backend.read("output").reshape(expected.shape), expected) <= 1e-12, name


def test_label_shapes():
    assert label_shape(MODELS["per_token"], 8) == ((8, 5), "int32")
    assert label_shape(MODELS["weights"], 8) == ((8,), "int32")
    assert label_shape(MODELS["bce"], 8) == ((8, 4), "float32")
    assert label_shape(MODELS["huber"], 8) == ((8, 3), "float32")


def test_data_problems_check_labels_against_the_loss():
    per_token = layer_spec(MODELS["per_token"], 4)
    assert data_problems(per_token, (5,), 7, (5,)) == []
    assert [p.path for p in data_problems(per_token, (5,), 7, ())] == ["model.loss"]
    bce = layer_spec(MODELS["bce"], 4)
    assert data_problems(bce, (6,), None, (4,)) == []
    (problem,) = data_problems(bce, (6,), None, ())
    assert problem.path == "model.loss" and problem.message.startswith(
        "BCEWithLogits needs one target per output"
    )


# Spec files and validation -----------------------------------------------------------------------


def test_spec_files_round_trip(tmp_path):
    for name, model in MODELS.items():
        spec = layer_spec(model, 8)
        assert validate(spec) == [], name
        assert loads(dumps(spec)) == spec
        for file in ("spec.json", "spec.msgpack"):
            save(spec, tmp_path / file)
            assert load(tmp_path / file) == spec
    loss = encode(layer_spec(MODELS["weights"], 8))["model"]["loss"]
    # A field at its default is left out (it came after schema 1), a set one is written.
    assert loss == {"kind": "CrossEntropy", "class_weights": list(WEIGHTS)}
    assert encode(layer_spec(MODELS["huber"], 8))["model"]["loss"] == {"kind": "Huber", "delta": 0.4}


@pytest.mark.parametrize(
    "loss, classes, path, words",
    [
        (CrossEntropy(label_smoothing=1.5), 3, "model.loss.label_smoothing", "must be in [0, 1], got 1.5"),
        (CrossEntropy(label_smoothing=-0.1), 3, "model.loss.label_smoothing", "must be in [0, 1]"),
        (
            CrossEntropy(class_weights=(1.0, 2.0)),
            3,
            "model.loss.class_weights",
            "one weight per class (3), got 2",
        ),
        (CrossEntropy(class_weights=(1.0, -2.0, 1.0)), 3, "model.loss.class_weights", "finite and >= 0"),
        (
            CrossEntropy(class_weights=(1.0, math.inf, 1.0)),
            3,
            "model.loss.class_weights[1]",
            "must be finite",
        ),
        (CrossEntropy(class_weights=()), 3, "model.loss.class_weights", "must not be empty"),
        (Huber(delta=0.0), 3, "model.loss.delta", "must be finite and > 0, got 0.0"),
        (Huber(delta=math.nan), 3, "model.loss.delta", "must be finite, got nan"),
        (CrossEntropy(), 1, "model.layers[0]", "last dimension has >= 2 classes"),
    ],
)
def test_bad_losses_are_named_by_their_path(loss, classes, path, words):
    spec = layer_spec(Model(input_shape=(4,), layers=(Linear(classes),), loss=loss), 4)
    problems = validate(spec)
    assert len(problems) == 1 and problems[0].path == path and words in problems[0].message, problems


def test_a_per_token_cross_entropy_validates_any_leading_shape():
    assert validate(layer_spec(MODELS["per_token_norm"], 4)) == []
    flat = Model(input_shape=(3, 6), layers=(Flatten(), Linear(5)), loss=CrossEntropy())
    assert validate(layer_spec(flat, 4)) == []


# End to end --------------------------------------------------------------------------------------


def test_label_smoothing_learns_the_digits(vulkan_backend):
    model = Model(
        input_shape=(1, 8, 8),
        layers=(Flatten(), Linear(64, activation="relu"), Linear(10)),
        loss=CrossEntropy(label_smoothing=0.1),
    )
    check_learns_the_digits(model, vulkan_backend, epochs=4)


def test_mse_is_unchanged():
    """MSE's launch leaves fn at its default: existing plans keep their meaning."""
    model = Model(input_shape=(6,), layers=(Linear(3),), loss=MSE())
    launch = next(s for s in plan(layer_spec(model, 4)).devices[0].program("train").launches if s.op == "mse")
    assert launch.param_dict["fn"] == LOSSES["MSE"]

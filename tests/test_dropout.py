"""Dropout: the op forward and backward on every backend against a float64 oracle that draws the
mask from its definition (tests/oracles.py, Python integers), the GPU's mask equal to the CPU's to
the bit, the mask's statistics (the fraction dropped, a new mask each step, no pattern between
neighbours), then the layer in a model: identity in evaluation and at p = 0, gradients against
finite differences, the same programs on CPU and Vulkan, clear problems for a bad p, the spec
files and the summary, an exact resume, and an MLP with dropout learning the bundled digits.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from conftest import relative_error
from layer_programs import (
    check_gradients_by_differences,
    check_learns_the_digits,
    layer_batch,
    layer_spec,
    nudged_parameters,
    run_eval_program,
    run_train_program,
)
from oracles import dropout_keep as oracle_keep
from run_checks import InterruptAt, assert_same_weights

import flow
from actors import checkpoint as checkpoints
from actors.cpu_backend import CpuBackend
from actors.cpu_ops import dropout_keep
from actors.single_op import run_op
from flow.codec import dumps, encode, load, loads, save
from flow.planning import plan
from flow.spec import (
    MSE,
    Adam,
    CrossEntropy,
    Data,
    Devices,
    Dropout,
    Flatten,
    Linear,
    Model,
    RunSettings,
    Spec,
    Synthetic,
)
from flow.summary import summarize
from flow.validation import validate


def op_params(n: int, p: float, seed: int) -> dict[str, float]:
    return dict(n=n, seed=seed, threshold=min(math.ceil(p * 2.0**32), 2**32 - 1), scale=1.0 / (1.0 - p))


def run_dropout(backend, x: np.ndarray, p: float, seed: int, step: int) -> np.ndarray:
    stepvals = np.array([0.0, 1.0, 1.0, step, 1.0, 1.0], np.float32)
    bindings = {"X": x, "stepvals": stepvals, "Y": np.full_like(x, np.nan)}
    return run_op(backend, "dropout", bindings, **op_params(x.size, p, seed))["Y"]


def away_from_zero(rng: np.random.Generator, n: int) -> np.ndarray:
    """Values none of which is 0, so a 0 in the output can only be a dropped element."""
    x = rng.standard_normal(n) * 3.0
    return np.where(np.abs(x) < 0.1, x + 0.5, x).astype(np.float32)


# (elements, p): a single element, odd sizes around one 256-thread workgroup and past it.
OP_CASES = [(1, 0.5), (7, 0.3), (255, 0.9), (1001, 0.1), (4099, 0.5), (70_001, 0.75)]


@pytest.mark.parametrize("n,p", OP_CASES)
def test_dropout_op_forward_and_backward_match_the_oracle(backend, rng, n, p):
    seed, step = int(rng.integers(0, 2**32)), int(rng.integers(1, 10_000))
    keep = oracle_keep(n, seed, step, p)
    for x in (away_from_zero(rng, n), away_from_zero(rng, n)):  # the input, then the output's gradient
        expected = x.astype(np.float64) * keep / (1.0 - p)
        got = run_dropout(backend, x, p, seed, step)
        np.testing.assert_array_equal(got != 0, keep)
        assert relative_error(got, expected) <= 1e-6


def test_the_numpy_mask_is_the_oracle_mask(rng):
    """actors.cpu_ops.dropout_keep (numpy's wrapping uint32) against the oracle's Python integers."""
    for p in (0.0, 0.05, 0.5, 0.999):
        seed, step = int(rng.integers(0, 2**32)), int(rng.integers(1, 2**24))
        threshold = op_params(1, p, seed)["threshold"]
        np.testing.assert_array_equal(
            dropout_keep(3000, seed, step, threshold), oracle_keep(3000, seed, step, p)
        )


def test_the_gpu_mask_is_the_cpu_mask_to_the_bit(vulkan_backend, rng):
    n, p = 300_007, 0.3
    x = away_from_zero(rng, n)
    for step in (1, 2, 12_345):
        seed = int(rng.integers(0, 2**32))
        cpu = run_dropout(CpuBackend(), x, p, seed, step)
        gpu = run_dropout(vulkan_backend, x, p, seed, step)
        np.testing.assert_array_equal(gpu == 0, cpu == 0)
        np.testing.assert_array_equal(gpu, cpu)  # one correctly rounded product on each


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_fraction_dropped_is_p_and_the_mean_is_kept(vulkan_backend, rng, p):
    n = 1 << 20
    x = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    y = run_dropout(vulkan_backend, x, p, int(rng.integers(0, 2**32)), int(rng.integers(1, 1000)))
    dropped = y == 0
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(dropped.mean() - p) < 5 * sigma
    # E[y] = x: the kept values are scaled by 1 / (1 - p).
    assert float(y.astype(np.float64).mean()) == pytest.approx(
        float(x.mean()), rel=6 * math.sqrt(p / (1 - p) / n)
    )
    # Neighbours are independent: dropped pairs as often as p^2, not more or less.
    assert abs((dropped[1:] & dropped[:-1]).mean() - p * p) < 6 * math.sqrt(p * p / n)


def test_each_step_and_each_seed_draws_a_new_mask(rng):
    n, p = 200_000, 0.5
    seed = int(rng.integers(0, 2**32))
    threshold = op_params(n, p, seed)["threshold"]
    masks = [dropout_keep(n, seed, step, threshold) for step in (1, 2, 3)]
    masks.append(dropout_keep(n, seed + 1, 1, threshold))
    for i in range(len(masks)):
        for j in range(i):
            # Independent masks agree on half the elements; equal or shifted ones would not.
            assert abs((masks[i] == masks[j]).mean() - 0.5) < 0.01, (i, j)
    np.testing.assert_array_equal(dropout_keep(n, seed, 2, threshold), masks[1])  # a pure function


# ---------------------------------------------------------------------------------------------
# The layer in a model

FLAT = Model(
    input_shape=(7,),
    layers=(Linear(13, activation="tanh"), Dropout(0.4), Linear(9), Dropout(0.25), Linear(4)),
    loss=CrossEntropy(),
)
SEQUENCE = Model(
    input_shape=(3, 5),
    layers=(Dropout(0.5), Flatten(), Linear(6, activation="relu"), Dropout(0.1), Linear(2)),
    loss=MSE(),
)
MODELS, IDS = [FLAT, SEQUENCE], ["flat", "sequence"]


def with_p(model: Model, p: float) -> Model:
    return dataclasses.replace(
        model, layers=tuple(Dropout(p) if isinstance(layer, Dropout) else layer for layer in model.layers)
    )


def test_train_draws_masks_that_eval_and_predict_only_copy():
    device = plan(layer_spec(FLAT, 5)).devices[0]
    ops = {
        kind: [launch.op for launch in device.program(kind).launches] for kind in ("train", "eval", "predict")
    }
    assert ops["train"].count("dropout") == 4 and "copy" not in ops["train"]  # two layers, both ways
    for kind in ("eval", "predict"):
        assert "dropout" not in ops[kind] and ops[kind].count("copy") == 2, kind
    assert not any(p.name.startswith(("layers[1]", "layers[3]")) for p in device.parameters)
    # Each layer its own seed; the threshold and the scale from p.
    launches = [launch.param_dict for launch in device.program("train").launches if launch.op == "dropout"]
    assert len({params["seed"] for params in launches}) == 2
    assert {(params["threshold"], params["scale"]) for params in launches} == {
        (math.ceil(0.4 * 2**32), 1 / 0.6),
        (math.ceil(0.25 * 2**32), 1 / 0.75),
    }
    # p = 0 is a view of the input in every program: no launch at all.
    identity = plan(layer_spec(with_p(FLAT, 0.0), 5)).devices[0]
    for kind in ("train", "eval", "predict"):
        assert not {"dropout", "copy"} & {launch.op for launch in identity.program(kind).launches}, kind


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_dropout_is_the_identity_in_eval_and_at_p_zero(model, rng):
    """The eval loss of a model with dropout is the eval loss without it (p = 0), at any step; the
    train loss at p = 0 is that loss too, while real dropout changes it, and with each step."""
    rows = 6
    device = plan(layer_spec(model, rows)).devices[0]
    identity = plan(layer_spec(with_p(model, 0.0), rows)).devices[0]
    params = {k: v.astype(np.float32) for k, v in nudged_parameters(device, rng).items()}
    x, y = layer_batch(model, rows, rng)
    x = x.astype(np.float32)
    backend = CpuBackend()
    backend.open_layout(identity.layout)
    plain = run_eval_program(identity, backend, params, x, y)
    assert run_train_program(identity, backend, params, x, y)[0] == pytest.approx(plain, rel=1e-6)
    backend.open_layout(device.layout)
    assert run_eval_program(device, backend, params, x, y, step=1) == plain
    assert run_eval_program(device, backend, params, x, y, step=7) == plain
    dropped = [run_train_program(device, backend, params, x, y, step=step)[0] for step in (1, 2)]
    assert all(loss != pytest.approx(plain, rel=1e-3) for loss in dropped)
    assert dropped[0] != dropped[1]


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_whole_model_gradients_match_finite_differences(model, rng):
    check_gradients_by_differences(model, rng, probes=4)


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_train_programs_on_cpu_and_vulkan_agree(model, rng, vulkan_backend):
    rows = 9
    device = plan(layer_spec(model, batch=rows)).devices[0]
    params = {k: v.astype(np.float32) for k, v in nudged_parameters(device, rng).items()}
    x, y = layer_batch(model, rows, rng)
    x = x.astype(np.float32)
    for step in (1, 5):
        reference = CpuBackend(precision="float64")
        reference.open_layout(device.layout)
        loss, grads, _ = run_train_program(device, reference, params, x, y, step=step)
        vulkan_backend.open_layout(device.layout)
        got_loss, got, _ = run_train_program(device, vulkan_backend, params, x, y, step=step)
        assert got_loss == pytest.approx(loss, rel=1e-5)
        for name, value in grads.items():
            assert relative_error(got[name], value) <= 1e-4, name


@pytest.mark.parametrize(
    "p, words",
    [(1.0, "must be in [0, 1), got 1.0"), (1.5, "must be in [0, 1), got 1.5"),
     (-0.1, "must be in [0, 1), got -0.1"), (float("nan"), "must be finite, got nan")],
)  # fmt: skip
def test_a_bad_p_is_named_by_its_path_and_value(p, words):
    model = Model(input_shape=(7,), layers=(Linear(5), Dropout(p), Linear(3)), loss=CrossEntropy())
    problems = validate(layer_spec(model, 4))
    assert len(problems) == 1, problems
    assert problems[0].path == "model.layers[1].p" and words in problems[0].message


def test_spec_files_and_summary(tmp_path):
    spec = layer_spec(FLAT, 8)
    assert validate(spec) == []
    assert loads(dumps(spec)) == spec
    for name in ("spec.json", "spec.msgpack"):
        save(spec, tmp_path / name)
        assert load(tmp_path / name) == spec
    assert encode(spec)["model"]["layers"][1] == {"kind": "Dropout", "p": 0.4}
    # An int p is a float in the file, as any float field.
    assert encode(layer_spec(with_p(FLAT, 0), 8))["model"]["layers"][1] == {"kind": "Dropout", "p": 0.0}
    lines = summarize(spec).splitlines()
    row = next(line for line in lines if "[1] Dropout(0.4)" in line)
    assert row.split()[-2:] == ["(13,)", "0"]


def dropout_run_spec(tmp_path) -> Spec:
    return Spec(
        model=Model(input_shape=(12,), layers=(Linear(16, activation="relu"), Dropout(0.5), Linear(3)),
                    loss=CrossEntropy()),
        optimiser=Adam(0.01),
        data=Data(Synthetic(samples=240, features=(12,), classes=3, seed=4), batch_size=16, seed=2),
        devices=Devices("cpu"),
        run=RunSettings(epochs=2, in_flight=2, checkpoint_every=4, checkpoint_dir=str(tmp_path / "ckpt")),
    )  # fmt: skip


def test_a_resumed_run_draws_the_masks_of_an_uninterrupted_one(tmp_path):
    reference = flow.run(dropout_run_spec(tmp_path / "a"))
    spec = dropout_run_spec(tmp_path / "b")
    with pytest.raises(KeyboardInterrupt):
        flow.run(spec, hooks=[InterruptAt(13)])
    saved = checkpoints.load(tmp_path / "b" / "ckpt")
    assert 0 < saved.cursor.step < reference.steps
    resumed = flow.run(spec, resume=tmp_path / "b" / "ckpt")
    assert resumed.resumed_from == saved.cursor.step
    assert_same_weights(resumed.parameters, reference.parameters)


def test_an_mlp_with_dropout_learns_the_digits(vulkan_backend):
    model = Model(
        input_shape=(1, 8, 8),
        layers=(Flatten(), Linear(64, activation="relu"), Dropout(0.2), Linear(10)),
        loss=CrossEntropy(),
    )
    result = check_learns_the_digits(model, vulkan_backend, epochs=5)
    assert result.evals[-1].loss < 0.3 * math.log(10)  # a guess scores ln 10

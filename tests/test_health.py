"""A run that cannot learn says so (actors.health), driven as a user drives it: ``flow.run`` on the
bundled digits, ``flow.predict``, ``python -m flow run``. Inputs scaled twice warn of tiny inputs
and of a loss at ln(classes), on stderr and in the metrics file; a diverging run stops with an
error naming the step, or trains on when asked to; NaN inputs give NaN predictions on the CPU
backend and on Vulkan alike (the input convention ``help`` states is in test_spec.py). Below them,
the pure decisions' own cases.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

import flow
import flow.spec
from actors.cpu_backend import CpuBackend
from actors.health import (
    CHANCE_MIN_STEPS,
    ChanceWatch,
    NonFiniteLoss,
    input_statistics,
    input_warnings,
)
from actors.messages import Batch, InputStatistics, StepDone
from flow.codec import save as save_spec
from flow.run_command import main_run, summary
from flow.spec import (
    GELU,
    SGD,
    Conv2d,
    CrossEntropy,
    Data,
    Devices,
    Digits,
    Flatten,
    LeakyReLU,
    Linear,
    MaxPool2d,
    Model,
    ReLU,
    RunSettings,
    Scale,
    Sigmoid,
    Spec,
    Split,
    Tanh,
)

LN10 = math.log(10)
TRAIN_STEPS = 23  # 1437 training digits (a stratified 0.8 split of 1797) in batches of 64


def digits_spec(tmp_path: Path, preprocess=(), lr: float = 0.05, epochs: int = 2, **run) -> Spec:
    """The bundled digits through a 64-128-64-10 relu MLP (the shape of examples/digits.json)."""
    return Spec(
        model=Model(
            input_shape=(1, 8, 8),
            layers=(Flatten(), Linear(128, activation="relu"), Linear(64, activation="relu"), Linear(10)),
            loss=CrossEntropy(),
        ),
        optimiser=SGD(lr),
        data=Data(
            Digits(), batch_size=64, preprocess=preprocess, split=Split(train=0.8, val=0.2, stratify=True)
        ),
        devices=Devices("cpu"),
        run=RunSettings(epochs=epochs, metrics_file=str(tmp_path / "metrics.jsonl"), **run),
    )


def events(path: Path | str, kind: str) -> list[dict]:
    lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [line for line in lines if line["event"] == kind]


# -- inputs scaled twice -----------------------------------------------------------------------------


def test_scale_1_over_255_on_digits_warns_of_tiny_inputs_and_a_loss_at_chance(tmp_path, caplog):
    """The issue's trap: sources already give [0, 1], so Scale(1/255) leaves [0, 1/255] and the
    model trains at chance. The run reports the inputs' range and warns twice, on the log and in
    the metrics file; the same run without the Scale learns and warns of nothing."""
    spec = digits_spec(tmp_path / "scaled", preprocess=(Scale(1 / 255),))
    with caplog.at_level(logging.WARNING, logger="vkflow"):
        result = flow.run(spec, backend=CpuBackend())
    assert result.steps == 2 * TRAIN_STEPS
    assert result.inputs is not None and result.inputs.rows == 64
    assert result.inputs.min == 0.0 and result.inputs.max == pytest.approx(1 / 255, rel=1e-6)
    tiny, chance = result.warnings
    assert tiny.startswith("the inputs are tiny") and "Scale(1/255)" in tiny
    assert "epoch 0" in chance and f"ln(10) = {LN10:.4f}" in chance
    logged = [r.getMessage() for r in caplog.records if r.name == "vkflow" and r.levelno == logging.WARNING]
    assert logged == [f"vkflow: {tiny}", f"vkflow: {chance}"]

    (inputs,) = events(spec.run.metrics_file, "inputs")
    assert inputs["step"] == 0 and inputs["max"] == pytest.approx(1 / 255, rel=1e-6)
    assert 0 < inputs["std"] < inputs["max"]
    warnings = events(spec.run.metrics_file, "warning")
    assert [(w["kind"], w["message"]) for w in warnings] == [("inputs", tiny), ("chance", chance)]
    steps = [e["loss"] for e in events(spec.run.metrics_file, "step")]
    assert abs(np.mean(steps[:TRAIN_STEPS]) - LN10) <= 0.01 * LN10  # what the warning says
    text = summary(result)
    assert "inputs: [0, 0.003922]" in text and f"warning: {tiny}" in text

    caplog.clear()
    plain = digits_spec(tmp_path / "plain")
    with caplog.at_level(logging.WARNING, logger="vkflow"):
        healthy = flow.run(plain, backend=CpuBackend())
    assert healthy.warnings == () and not [r for r in caplog.records if r.name == "vkflow"]
    assert healthy.inputs.min == 0.0 and healthy.inputs.max == pytest.approx(1.0)
    assert events(plain.run.metrics_file, "warning") == []
    assert healthy.loss < 0.8 * LN10 and healthy.accuracy > 0.5


# -- a diverging run --------------------------------------------------------------------------------


@pytest.mark.parametrize("select", ["cpu", "vulkan"])
def test_a_diverging_run_stops_with_an_error_naming_the_step(tmp_path, vulkan_backend, select):
    backend = CpuBackend() if select == "cpu" else vulkan_backend
    spec = digits_spec(tmp_path, lr=1e4)
    with pytest.raises(flow.NonFiniteLoss) as stopped:
        flow.run(spec, backend=backend)
    error = stopped.value
    assert isinstance(error, NonFiniteLoss) and isinstance(error, FloatingPointError)
    assert 0 < error.step < TRAIN_STEPS and not math.isfinite(error.loss)
    assert f"at step {error.step} (epoch 0, learning rate 10000)" in str(error)
    assert "on_nonfinite='continue'" in str(error)
    steps = events(spec.run.metrics_file, "step")
    assert steps[-1]["step"] == error.step and steps[-1]["loss"] is None  # nothing after it
    assert all(math.isfinite(s["loss"]) for s in steps[:-1])
    (record,) = events(spec.run.metrics_file, "error")
    assert record["step"] == error.step and record["message"] == str(error)


def test_on_nonfinite_continue_trains_to_the_end_with_one_warning(tmp_path, caplog):
    spec = digits_spec(tmp_path, lr=1e4, on_nonfinite="continue")
    with caplog.at_level(logging.WARNING, logger="vkflow"):
        result = flow.run(spec, backend=CpuBackend())
    assert result.steps == 2 * TRAIN_STEPS and not math.isfinite(result.loss)
    (warning,) = result.warnings
    first = next(s for s in events(spec.run.metrics_file, "step") if s["loss"] is None)
    assert warning.startswith(f"the training loss is nan at step {first['step']} ")
    assert [w["step"] for w in events(spec.run.metrics_file, "warning")] == [first["step"]]
    assert [r.getMessage() for r in caplog.records if r.name == "vkflow"] == [f"vkflow: {warning}"]
    assert events(spec.run.metrics_file, "error") == []


def test_the_command_prints_one_line_for_a_diverging_run(tmp_path, capsys):
    spec = digits_spec(tmp_path, lr=1e4)
    save_spec(spec, tmp_path / "spec.json")
    assert main_run([str(tmp_path / "spec.json"), "--device", "cpu"]) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert line.startswith("error: the training loss is nan at step ") and "learning rate" in line


def test_on_nonfinite_is_validated():
    spec = digits_spec(Path("unused"), on_nonfinite="ignore")
    with pytest.raises(flow.SpecError) as bad:
        flow.check(spec)
    (problem,) = bad.value.problems
    assert problem.path == "run.on_nonfinite" and "'raise'" in problem.message


# -- NaN through predict ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "activation,layer",
    [
        ("relu", ReLU()),
        ("leaky_relu", LeakyReLU(0.1)),
        ("sigmoid", Sigmoid()),
        ("tanh", Tanh()),
        ("gelu", GELU()),
    ],
    ids=["relu", "leaky_relu", "sigmoid", "tanh", "gelu"],
)
def test_nan_inputs_predict_nan_on_cpu_and_vulkan_alike(vulkan_backend, rng, activation, layer):
    """A NaN pixel makes its row's probabilities NaN on both backends, through a fused conv
    epilogue, max pooling, a fused GEMM epilogue, a standalone activation and the softmax; the
    other rows agree. Before, a relu on Vulkan (GLSL max(NaN, 0) = 0) and max pooling (a '>' that
    skips NaN) turned such rows into finite probabilities."""
    spec = Spec(
        model=Model(
            input_shape=(1, 8, 8),
            layers=(
                Conv2d(4, 3, padding=1, activation=activation),
                MaxPool2d(2),
                Flatten(),
                Linear(16, activation=activation),
                layer,
                Linear(10),
            ),
            loss=CrossEntropy(),
        ),
        optimiser=SGD(),
        data=Data(Digits(), batch_size=8),
    )
    x = rng.uniform(0.0, 1.0, (13, 1, 8, 8)).astype(np.float32)
    rows = rng.choice(13, size=3, replace=False)
    x[rows, 0, rng.integers(0, 8, 3), rng.integers(0, 8, 3)] = np.nan
    cpu = flow.predict(spec, x, backend=CpuBackend())
    gpu = flow.predict(spec, x, backend=vulkan_backend)
    nan = np.zeros(13, bool)
    nan[rows] = True
    for probabilities in (cpu, gpu):
        assert np.isnan(probabilities[nan]).all()
        assert np.isfinite(probabilities[~nan]).all()
        np.testing.assert_allclose(probabilities[~nan].sum(axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(gpu[~nan], cpu[~nan], rtol=1e-4, atol=1e-6)


# -- the pure decisions ----------------------------------------------------------------------------


def _stats(values: np.ndarray) -> InputStatistics:
    x = np.asarray(values, np.float32).reshape(len(values), -1)
    batch = Batch(seq=0, epoch=0, position=0, indices=np.arange(len(x)), x=x, y=None)
    return input_statistics(batch)


def test_input_statistics_and_warnings(rng):
    healthy = rng.uniform(0, 1, (32, 64))
    stats = _stats(healthy)
    assert stats.min == pytest.approx(healthy.min()) and stats.max == pytest.approx(healthy.max())
    assert stats.mean == pytest.approx(healthy.mean(), rel=1e-6)
    assert stats.std == pytest.approx(healthy.std(), rel=1e-5)
    assert input_warnings(stats) == ()
    assert input_warnings(_stats(rng.standard_normal((32, 64)))) == ()  # normalised data
    (tiny,) = input_warnings(_stats(healthy / 255))
    assert tiny.startswith("the inputs are tiny")
    (constant,) = input_warnings(_stats(np.full((32, 64), 0.5)))
    assert constant.startswith("the inputs are constant")
    (zeros,) = input_warnings(_stats(np.zeros((32, 64))))
    assert zeros.startswith("the inputs are constant")


def _step(step: int, epoch: int, loss: float, rows: int = 64) -> StepDone:
    return StepDone(step, epoch, step, loss, 0.0, rows, 0.1)


def test_chance_watch_judges_whole_epochs(rng):
    ten = ChanceWatch(10)
    per_epoch = CHANCE_MIN_STEPS + 2
    at_chance = LN10 * (1 + rng.uniform(-0.009, 0.009, per_epoch))
    learning = np.linspace(LN10, 0.5, per_epoch)
    # Epoch 0 learns; epoch 1 sits at ln(10), and is judged when epoch 2's first step arrives.
    verdicts = [ten.add(_step(i, 0, loss)) for i, loss in enumerate(learning)]
    verdicts += [ten.add(_step(per_epoch + i, 1, loss)) for i, loss in enumerate(at_chance)]
    assert verdicts == [None] * (2 * per_epoch)
    message = ten.add(_step(2 * per_epoch, 2, 0.3))
    assert message is not None and "epoch 1 is" in message and f"{np.mean(at_chance):.4f}" in message
    # An empty batch (every sample skipped) has a NaN loss and no weight.
    watch = ChanceWatch(3)
    for i in range(per_epoch):
        assert watch.add(_step(i, 0, math.log(3))) is None
    assert watch.add(_step(per_epoch, 0, math.nan, rows=0)) is None
    assert watch.finish() is not None
    # Too few steps give no verdict; a loss 2% away from ln(classes) is not at chance.
    short = ChanceWatch(10)
    for i in range(CHANCE_MIN_STEPS - 1):
        short.add(_step(i, 0, LN10))
    assert short.finish() is None
    off = ChanceWatch(10)
    for i in range(per_epoch):
        off.add(_step(i, 0, LN10 * 1.02))
    assert off.finish() is None

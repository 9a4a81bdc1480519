"""flow.callbacks, driven as a user drives them: ``flow.run(spec, callbacks=[...])`` on the CPU
backend and on Vulkan (lavapipe in CI). Callbacks see every step in order, every evaluation and
every checkpoint, as the metrics file records them; an exception in a callback ends the run with
that exception, naming the callback; EarlyStopping stops a run whose validation loss cannot
improve at the evaluation it should, writes the ``"stopped"`` line and a checkpoint that resumes
exactly, leaves a run that keeps improving alone, and refuses a run without a validation split
before any device work."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from run_checks import assert_same_weights
from specs import digits, synthetic_spec

import flow
from actors import checkpoint as checkpoints
from actors import device_select
from actors.cpu_backend import CpuBackend
from flow.callbacks import Callback, EarlyStopping
from flow.run_command import summary
from flow.runner import open_pipeline, run
from flow.runtime import ActorError, RunResult
from flow.spec import Adam, Split


class Recorder(Callback):
    """Keeps everything the run tells its callbacks."""

    def __init__(self) -> None:
        self.splits: frozenset[str] | None = None
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.checkpoints: list[tuple[str, int]] = []
        self.ended: list[RunResult] = []

    def on_start(self, spec, splits) -> None:
        self.splits = splits

    def on_step(self, record) -> None:
        self.steps.append(record)

    def on_eval(self, record) -> None:
        self.evals.append(record)

    def on_checkpoint(self, path, step) -> None:
        self.checkpoints.append((path, step))

    def on_end(self, result) -> None:
        self.ended.append(result)


class Boom(Callback):
    """Raises in ``method`` the first time it sees ``step`` (or a later one)."""

    def __init__(self, method: str, step: int) -> None:
        self.method, self.step = method, step
        self.error = ValueError(f"boom in {method}")

    def on_step(self, record) -> None:
        if self.method == "on_step" and record["step"] >= self.step:
            raise self.error

    def on_eval(self, record) -> None:
        if self.method == "on_eval" and record["step"] >= self.step:
            raise self.error


def metrics(spec) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(spec.run.metrics_file).read_text().splitlines()]


def with_split(spec, split: Split):
    return dataclasses.replace(spec, data=dataclasses.replace(spec.data, split=split))


# -- what callbacks see ----------------------------------------------------------------------------


def test_callbacks_see_every_step_in_order_every_evaluation_and_checkpoint(tmp_path):
    spec = with_split(
        synthetic_spec(tmp_path, eval_every=5, checkpoint_every=10), Split(train=0.7, val=0.2, test=0.1)
    )
    first, second = Recorder(), Recorder()
    result = run(spec, callbacks=[first, second])

    assert result.stopped_early is None and result.stopped_at is None
    assert first.splits == {"val", "test"}
    assert [r["step"] for r in first.steps] == list(range(result.steps)) and result.steps > 20
    lines = metrics(spec)
    # The records are the metrics file's lines (less the statistics some of them carry).
    written = [
        {k: v for k, v in r.items() if k not in ("statistics", "skipped")}
        for r in lines
        if r["event"] == "step"
    ]
    assert first.steps == written
    evals = [r for r in lines if r["event"] == "eval"]
    without_time = [{k: v for k, v in r.items() if k != "elapsed"} for r in first.evals]
    assert without_time == [{k: v for k, v in r.items() if k != "elapsed"} for r in evals]
    assert [(r["split"], r["step"], r["loss"]) for r in first.evals] == [
        (e.split, e.step, pytest.approx(e.loss)) for e in result.evals
    ]
    assert first.evals[-1]["split"] == "test" and {r["split"] for r in first.evals[:-1]} == {"val"}
    assert first.checkpoints == [(r["path"], r["step"]) for r in lines if r["event"] == "checkpoint"]
    assert first.checkpoints[-1] == (result.checkpoint, result.steps)
    assert first.ended == [result]
    # Every callback sees the same records, in the order given.
    assert second.steps == first.steps and second.evals == first.evals and second.ended == [result]


@pytest.mark.parametrize("method", ["on_step", "on_eval"])
def test_an_exception_in_a_callback_stops_the_run_with_it_and_names_the_callback(tmp_path, rng, method):
    spec = synthetic_spec(tmp_path, eval_every=4)
    step = int(rng.integers(4, 30))
    seen, boom = Recorder(), Boom(method, step)
    with pytest.raises(ActorError) as caught:
        run(spec, callbacks=[seen, boom])
    error = caught.value
    assert error.actor == "sink" and error.callback == f"Boom.{method}"
    assert error.error is boom.error and error.__cause__ is boom.error
    assert f"actor 'sink' failed in callback Boom.{method}: ValueError: boom in {method}" in str(error)
    # The run ended there: nothing after the raising item reached the callbacks.
    if method == "on_step":
        assert [r["step"] for r in seen.steps] == list(range(step + 1))
    else:
        stopped = -(-step // 4) * 4  # the first evaluation at or after ``step``
        assert seen.evals[-1]["step"] == stopped and [r["step"] for r in seen.steps] == list(range(stopped))
    assert seen.ended == []


async def test_open_pipeline_takes_callbacks_and_refuses_them_for_prediction():
    recorder = Recorder()
    async with open_pipeline(
        synthetic_spec(epochs=1), backend=CpuBackend(), callbacks=[recorder]
    ) as pipeline:
        pass
    assert [r["step"] for r in recorder.steps] == list(range(pipeline.result.steps))
    assert recorder.ended == [pipeline.result]
    with pytest.raises(ValueError, match="training run"):
        async with open_pipeline(synthetic_spec(), mode="predict", callbacks=[Recorder()]):
            pass


# -- early stopping --------------------------------------------------------------------------------


def test_early_stopping_stops_a_plateau_at_the_expected_evaluation_and_resumes_exactly(tmp_path):
    reference = run(synthetic_spec(tmp_path / "a"))
    spec = synthetic_spec(tmp_path / "b", eval_every=4)
    # No round can beat the first by 100: evaluations at steps 4 (the best), 8 and 12 (two without
    # improvement) stop the run at step 12.
    stopping, recorder = EarlyStopping("val_loss", patience=2, min_delta=100.0), Recorder()
    result = run(spec, callbacks=[stopping, recorder])

    assert result.stopped_at == 12
    assert result.stopped_early.startswith("val_loss did not improve for 2 evaluation(s) (best ")
    assert [r["step"] for r in recorder.evals] == [4, 8, 12]
    # The checkpoint is the interrupt's: the device's weights after every step it had applied.
    saved = checkpoints.load(spec.run.checkpoint_dir)
    assert saved.interrupted and not saved.final
    assert (
        str(result.checkpoint).endswith(".ckpt")
        and checkpoints.load(result.checkpoint).cursor == saved.cursor
    )
    assert 12 <= saved.cursor.step == result.steps < reference.steps
    assert recorder.checkpoints[-1] == (result.checkpoint, result.steps) and recorder.ended == [result]
    lines = metrics(spec)
    assert [r for r in lines if r["event"] == "stopped"] == [
        {"event": "stopped", "step": 12, "reason": result.stopped_early}
    ]
    assert lines[-1]["event"] == "stopped"  # nothing after it
    assert f"stopped early after step 12: {result.stopped_early}" in summary(result).splitlines()

    resumed = run(spec, resume=spec.run.checkpoint_dir)
    assert resumed.resumed_from == saved.cursor.step and resumed.steps == reference.steps
    assert resumed.stopped_early is None
    assert_same_weights(resumed.parameters, reference.parameters)
    assert resumed.accuracy == reference.accuracy


def test_early_stopping_on_vulkan_stops_where_the_loss_cannot_improve_and_resumes(tmp_path, vulkan_backend):
    # A learning rate of 1e-9 moves the validation loss by far less than min_delta: a plateau.
    spec = dataclasses.replace(synthetic_spec(tmp_path, eval_every=3), optimiser=Adam(1e-9))
    recorder = Recorder()
    stopping = EarlyStopping("val_accuracy", patience=1, min_delta=1e-3)
    result = run(spec, backend=vulkan_backend, callbacks=[recorder, stopping])

    assert result.device == vulkan_backend.facts.name
    assert (
        result.stopped_at == 6 and "val_accuracy did not improve for 1 evaluation(s)" in result.stopped_early
    )
    assert [r["step"] for r in recorder.evals] == [3, 6]
    steps = [r["step"] for r in recorder.steps]
    assert steps == list(range(len(steps))) and 6 <= len(steps) <= result.steps
    assert [r for r in metrics(spec) if r["event"] == "stopped"] == [
        {"event": "stopped", "step": 6, "reason": result.stopped_early}
    ]
    resumed = run(spec, resume=result.checkpoint, backend=vulkan_backend)
    assert resumed.resumed_from == result.steps and resumed.steps == 39


def test_early_stopping_leaves_a_run_that_keeps_improving_alone(tmp_path):
    spec = digits(tmp_path, epochs=3)
    recorder = Recorder()
    # patience=0: a single round without improvement would stop it.
    result = run(spec, callbacks=[recorder, EarlyStopping("val_loss", patience=0)])
    losses = [r["loss"] for r in recorder.evals]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2]
    assert result.stopped_early is None and result.steps == 3 * 23
    assert not [r for r in metrics(spec) if r["event"] == "stopped"]
    assert checkpoints.load(spec.run.checkpoint_dir).final


def test_early_stopping_without_a_validation_split_is_refused_before_any_device_work(tmp_path, monkeypatch):
    def no_device(*args):
        raise AssertionError("a device was opened")

    monkeypatch.setattr(device_select, "open_device", no_device)
    spec = with_split(synthetic_spec(tmp_path), Split(train=0.9, test=0.1))
    with pytest.raises(
        ValueError, match=r"EarlyStopping\(monitor='val_loss'.*no validation samples"
    ) as caught:
        flow.run(spec, callbacks=[flow.EarlyStopping()])
    assert "data.split.val" in str(caught.value)
    assert not list(Path(spec.run.checkpoint_dir).glob("*.ckpt"))


@pytest.mark.parametrize(
    "options",
    [{"monitor": "loss"}, {"patience": -1}, {"patience": 1.5}, {"min_delta": -0.1}, {"mode": "up"}],
)
def test_early_stopping_refuses_bad_settings(options):
    with pytest.raises(ValueError, match="EarlyStopping"):
        EarlyStopping(**options)

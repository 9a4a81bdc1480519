"""flow.runner, the entry points, driven as a user calls them (``flow.run``, ``open_pipeline``,
``flow.predict``) on the CPU backend and on Vulkan (lavapipe in CI): training to a target, the
two backends agreeing, every batch shape a run sends has its program, the test split is scored,
and mistakes are refused in order (the plan before the source); a failing actor ends the run fast
as one error naming it; exact resume, in process and after SIGKILL / SIGINT of a subprocess."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import trio
from conftest import near_ties
from run_checks import InterruptAt, assert_same_weights, thread_snapshot, vkflow_threads
from specs import digits_spec, image_spec

import flow
from actors import checkpoint as checkpoints
from actors.cpu_backend import CpuBackend
from actors.messages import StepDone
from actors.meter import Hooks
from flow.codec import save as save_spec
from flow.errors import PlanError
from flow.inference import predict
from flow.planning import plan
from flow.runner import open_pipeline, resume_conflicts, run
from flow.runtime import ActorError
from flow.spec import (
    SGD,
    Adam,
    CrossEntropy,
    Data,
    Devices,
    Digits,
    Flatten,
    Linear,
    Model,
    RunSettings,
    Spec,
    Split,
    Synthetic,
)
from flow.testing import FailAt
from loaders import open_source, split_indices

ROOT = Path(__file__).resolve().parents[1]


def _wide_mlp_spec(checkpoint_dir=None) -> Spec:
    """The issue's crash: 784-1024-10 at batch 64. The 1024-wide GEMM needs no split-K at 64 rows but
    did at the 13-row tail of the validation split and the 5-row tail of a prediction."""
    return Spec(
        model=Model(
            input_shape=(784,),
            layers=(Flatten(), Linear(1024, activation="relu"), Linear(10)),
            loss=CrossEntropy(),
        ),
        optimiser=SGD(lr=0.01),
        data=Data(Synthetic(samples=2048, features=(784,)), batch_size=64, split=Split(train=0.8, val=0.2)),
        run=RunSettings(epochs=1, checkpoint_dir=checkpoint_dir),
    )


def test_partial_batches_train_evaluate_and_predict_alike_on_cpu_and_vulkan(vulkan_backend, tmp_path, rng):
    """Partial training, validation and prediction batches run on both backends (the plan's
    programs serve every row count) and the two agree within float32 tolerance."""
    spec = _wide_mlp_spec()
    results = {}
    for name, backend in (("cpu", CpuBackend()), ("vulkan", vulkan_backend)):
        result = flow.run(spec, backend=backend)
        assert result.steps == 26  # 1638 training rows: 25 full batches and one of 38
        assert result.evals[-1].samples == 410  # 6 full batches and one of 26
        results[name] = result
    cpu, gpu = results["cpu"], results["vulkan"]
    assert gpu.evals[-1].loss == pytest.approx(cpu.evals[-1].loss, rel=1e-3)
    for name, value in cpu.parameters.items():
        np.testing.assert_allclose(gpu.parameters[name], value, rtol=1e-3, atol=1e-5, err_msg=name)

    x = rng.standard_normal((133, 784)).astype(np.float32)  # two full batches and one of 5
    predictions = {}
    for name, backend in (("cpu", CpuBackend()), ("vulkan", vulkan_backend)):
        trained = flow.run(_wide_mlp_spec(str(tmp_path / name)), backend=backend)
        predictions[name] = flow.predict(trained.checkpoint, x, backend=backend)
    assert predictions["cpu"].shape == (133, 10)
    np.testing.assert_allclose(predictions["cpu"].sum(axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(predictions["vulkan"], predictions["cpu"], rtol=1e-3, atol=1e-5)
    # A row's prediction does not depend on the batch it came in: alone, at the end of a partial
    # batch, or in a full one.
    alone = flow.predict(trained.checkpoint, x[-1:], backend=vulkan_backend)
    np.testing.assert_allclose(alone[0], predictions["vulkan"][-1], rtol=1e-4, atol=1e-6)


def test_test_split_is_scored_after_the_last_step(tmp_path):
    """Split(test=...) is evaluated once at the end: RunResult.test and a metrics event with
    split "test", whose accuracy is that of the final weights on exactly the test rows."""
    spec = Spec(
        model=Model(input_shape=(1, 8, 8), layers=(Flatten(), Linear(32, activation="relu"), Linear(10)),
                    loss=CrossEntropy()),
        optimiser=SGD(lr=0.1, momentum=0.9),
        data=Data(Digits(), batch_size=50, split=Split(train=0.7, val=0.1, test=0.2, stratify=True)),
        devices=Devices("cpu"),
        run=RunSettings(epochs=3, checkpoint_dir=str(tmp_path / "ck"),
                        metrics_file=str(tmp_path / "m.jsonl")),
    )  # fmt: skip
    result = flow.run(spec)
    source = open_source(Digits())
    parts = split_indices(len(source), source.labels, 0.7, 0.1, 0.2, spec.data.seed, True)
    x, y, _ = source.read(parts["test"])
    assert result.test is not None and result.test.split == "test"
    assert result.test.samples == parts["test"].size == 361
    assert result.test.step == result.steps
    probabilities = flow.predict(result.checkpoint, x, backend=CpuBackend())
    expected = float((probabilities.argmax(axis=1) == y).mean())
    assert result.test.accuracy == pytest.approx(expected, abs=1.5 / parts["test"].size)
    assert result.test.accuracy > 0.8  # three epochs of a digits MLP: far from chance (0.1)
    # The validation figure stays the validation figure.
    assert result.accuracy == [e for e in result.evals if e.split == "val"][-1].accuracy
    events = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    tests = [e for e in events if e.get("event") == "eval" and e.get("split") == "test"]
    assert len(tests) == 1 and tests[0]["samples"] == 361
    assert tests[0]["accuracy"] == pytest.approx(result.test.accuracy)


def test_a_model_over_the_budget_is_refused_before_the_data_is_read():
    """The plan comes before the first read: a 3x2048x2048 Synthetic source (10 class centres of
    50 MB each, and 64 samples) is never materialised for a model the device cannot hold. The
    source is opened first (its header: shape and classes), which costs next to nothing."""
    spec = Spec(
        model=Model(input_shape=(3, 2048, 2048), layers=(Flatten(), Linear(4096), Linear(10)),
                    loss=CrossEntropy()),
        optimiser=SGD(),
        data=Data(Synthetic(samples=64, features=(3, 2048, 2048)), batch_size=8),
        devices=Devices("cpu"),
    )  # fmt: skip
    tracemalloc.start()
    try:
        with pytest.raises(PlanError, match=r"the plan needs [\d,]+ bytes but the memory budget is"):
            flow.run(spec)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"{peak:,} bytes allocated before the refusal"


# -- whole runs, on both backends ------------------------------------------------------------------


class Recorder(Hooks):
    """Keeps every StepDone the sink receives."""

    def __init__(self) -> None:
        self.steps: list[StepDone] = []

    async def received(self, actor, item) -> None:
        if actor == "sink" and isinstance(item, StepDone):
            self.steps.append(item)


def test_digits_reach_the_target_on_vulkan(vulkan_backend, tmp_path):
    spec = digits_spec(
        epochs=6, checkpoint_dir=str(tmp_path / "ckpt"), metrics_file=str(tmp_path / "m.jsonl")
    )
    recorder = Recorder()
    result = run(spec, backend=vulkan_backend, hooks=[recorder])

    losses = [s.loss for s in recorder.steps]
    assert [s.step for s in recorder.steps] == list(range(result.steps))
    assert np.mean(losses[-10:]) < 0.25 * np.mean(losses[:10])  # the loss falls
    assert result.accuracy is not None and result.accuracy >= 0.95
    assert len(result.evals) == 6 and result.evals[-1].samples == 359  # one eval per epoch, whole val split
    assert result.device == vulkan_backend.facts.name

    # The metrics file holds every step with each actor's statistics, and the evaluations.
    lines = [json.loads(line) for line in Path(spec.run.metrics_file).read_text().splitlines()]
    steps = [r for r in lines if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(result.steps))
    assert set(steps[-1]["statistics"]) == {"loader", "preprocess", "device", "optimiser", "sink"}
    assert steps[-1]["lr"] == pytest.approx(0.003) and steps[-1]["samples_per_second"] > 0
    assert [r["accuracy"] for r in lines if r["event"] == "eval"][-1] == pytest.approx(result.accuracy)

    # The final checkpoint holds the final weights, and predicting from it reproduces the accuracy.
    saved = checkpoints.load(tmp_path / "ckpt")
    assert saved.final and saved.cursor.step == result.steps and str(result.checkpoint).endswith(".ckpt")
    flat, device_plan = saved.state["params:all"], plan(spec).devices[0]
    assert result.parameters.keys() == {p.name for p in device_plan.parameters}
    for name, value in result.parameters.items():  # each parameter at its own offset in the arena
        start = device_plan.layout.tensor(name).offset // 4
        assert np.array_equal(flat[start : start + value.size], value.reshape(-1)), name
    from loaders import open_source, split_indices

    source = open_source(spec.data.source)
    parts = split_indices(len(source), source.labels, 0.8, 0.2, 0.0, spec.data.seed, True)
    x, y, _ = source.read(parts["val"])
    source.close()
    probabilities = predict(tmp_path / "ckpt", x, backend=vulkan_backend)
    assert probabilities.shape == (len(y), 10)
    # The eval and predict programs are two computations: only a row whose two best classes are
    # within rounding of each other may go either way.
    correct = int(np.sum(probabilities.argmax(axis=1) == y))
    assert abs(correct - result.accuracy * len(y)) <= near_ties(probabilities) + 1e-6


def test_cpu_and_vulkan_give_the_same_loss_curve(vulkan_backend):
    spec = image_spec(epochs=None, steps=20)
    curves = []
    for backend in (CpuBackend(), vulkan_backend):
        recorder = Recorder()
        assert run(spec, backend=backend, hooks=[recorder]).device == backend.facts.name
        curves.append(np.array([s.loss for s in recorder.steps]))
    assert len(curves[0]) == 20
    assert curves[0][-1] < curves[0][0]
    np.testing.assert_allclose(curves[1], curves[0], rtol=1e-4)


# -- failures --------------------------------------------------------------------------------------


class BrokenDevice(CpuBackend):
    """A backend whose 4th submission fails, as a lost device would."""

    def __init__(self) -> None:
        super().__init__()
        self.submits = 0

    def submit(self, handle: int) -> int:
        self.submits += 1
        if self.submits == 4:
            raise RuntimeError("device lost")
        return super().submit(handle)


@pytest.mark.parametrize("actor", ["loader", "preprocess", "device", "optimiser", "sink"])
async def test_a_failing_actor_ends_the_run_fast_with_its_name(actor):
    existing = thread_snapshot()
    injected = FailAt(actor, item=5, error=ValueError(f"boom in {actor}"))
    spec = digits_spec(epochs=20)  # far longer than the failure point; its image folder decodes in threads
    with trio.fail_after(10):
        with pytest.raises(ActorError) as caught:
            async with open_pipeline(spec, backend=CpuBackend(), hooks=[injected]):
                pass
    stopped = time.monotonic()
    error = caught.value
    assert error.actor == actor and f"actor '{actor}' failed" in str(error)
    assert error.__cause__ is injected.error
    assert stopped - injected.raised_at < 1.0
    assert vkflow_threads(existing) == []


async def test_a_real_failure_names_its_actor():
    with pytest.raises(ActorError, match="actor 'device' failed: RuntimeError: device lost") as caught:
        async with open_pipeline(image_spec(), backend=BrokenDevice()):
            pass
    assert isinstance(caught.value.__cause__, RuntimeError)


# -- exact resume ----------------------------------------------------------------------------------


def test_resume_after_an_interrupt_at_a_random_step_is_bit_exact(tmp_path, rng):
    reference = run(image_spec(tmp_path / "a"))
    assert reference.steps == 30
    stop = int(rng.integers(1, reference.steps - 2))
    spec = image_spec(tmp_path / "b", checkpoint_every=7)
    with pytest.raises(KeyboardInterrupt):
        run(spec, hooks=[InterruptAt(stop)])
    saved = checkpoints.load(tmp_path / "b" / "ckpt")
    assert saved.interrupted and not saved.final
    assert stop + 1 <= saved.cursor.step <= stop + 12  # steps applied but not yet reported are kept

    resumed = run(spec, resume=tmp_path / "b" / "ckpt")
    assert resumed.resumed_from == saved.cursor.step and resumed.steps == reference.steps
    assert_same_weights(resumed.parameters, reference.parameters)
    assert resumed.accuracy == reference.accuracy
    # The metrics file continues. Steps applied after the last one reported are not in it: the
    # interruption stopped the sink before their reports arrived.
    steps = {json.loads(line)["step"] for line in Path(spec.run.metrics_file).read_text().splitlines()}
    assert set(range(stop)) | set(range(saved.cursor.step, reference.steps)) <= steps


def test_resume_on_vulkan_matches_within_float_tolerance(tmp_path, vulkan_backend):
    reference = run(image_spec(epochs=2), backend=vulkan_backend)
    spec = image_spec(tmp_path, epochs=2, checkpoint_every=5)
    with pytest.raises(KeyboardInterrupt):
        run(spec, backend=vulkan_backend, hooks=[InterruptAt(11)])
    resumed = run(spec, resume=spec.run.checkpoint_dir, backend=vulkan_backend)
    assert resumed.resumed_from >= 12
    assert_same_weights(resumed.parameters, reference.parameters, rtol=1e-6)


def test_resume_refuses_a_different_model(tmp_path):
    spec = image_spec(tmp_path, epochs=1)
    run(spec)
    other = dataclasses.replace(spec, optimiser=Adam(0.5))
    assert resume_conflicts(other, spec) == ["optimiser"]
    with pytest.raises(ValueError, match="optimiser differ"):
        run(other, resume=spec.run.checkpoint_dir)
    # Run settings may change: more epochs continue the finished run.
    longer = dataclasses.replace(spec, run=dataclasses.replace(spec.run, epochs=2))
    assert run(longer, resume=spec.run.checkpoint_dir).steps == 20


SCRIPT = textwrap.dedent(
    """
    import sys
    from flow.runner import run
    from flow.testing import Slow
    try:
        run(sys.argv[1], resume=sys.argv[2] if len(sys.argv) > 2 else None, hooks=[Slow("sink", 0.01)])
    except KeyboardInterrupt:
        sys.exit(130)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_resume_after_the_process_is_killed_is_bit_exact(tmp_path, sig, rng):
    spec = image_spec(tmp_path, epochs=10, checkpoint_every=5)
    save_spec(spec, tmp_path / "spec.json")
    # Keep the caller's path too: packages may be installed off sys.path's defaults (PYTHONPATH).
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    child = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "spec.json")], cwd=ROOT, env=env,
                             stderr=subprocess.PIPE)  # fmt: skip
    wanted = int(rng.integers(2, 8)) * 5
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        newest = checkpoints.latest(tmp_path / "ckpt")
        if newest is not None and int(newest.stem.split("-")[1]) >= wanted:
            break
        assert child.poll() is None, child.stderr.read().decode()
        time.sleep(0.005)
    child.send_signal(sig)
    code = child.wait(timeout=20)
    assert code == (-9 if sig == signal.SIGKILL else 130), child.stderr.read().decode()
    child.stderr.close()
    saved = checkpoints.load(tmp_path / "ckpt")
    assert not saved.final and saved.cursor.step < 100
    if sig == signal.SIGINT:
        assert saved.interrupted  # the interrupt wrote one more checkpoint on its way out

    resumed = run(spec, resume=tmp_path / "ckpt")
    reference = run(image_spec(epochs=10))
    assert resumed.resumed_from == saved.cursor.step and resumed.steps == reference.steps == 100
    assert_same_weights(resumed.parameters, reference.parameters)

"""flow.runner: every batch shape a run sends has its program, the test split is scored, and
mistakes are refused in order (the plan before the source). Driven through ``flow.run`` and
``flow.predict`` as a user calls them, on the CPU backend and on Vulkan (lavapipe in CI)."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

import flow
from actors.cpu_backend import CpuBackend
from flow.errors import PlanError
from flow.spec import (
    SGD,
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
from loaders import open_source, split_indices


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

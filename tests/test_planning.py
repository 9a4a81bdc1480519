"""The plan and its programs: whole-model gradients against finite differences (float64, CPU
backend), an independent numpy training step, buffer reuse, determinism, the memory budget, and
the Vulkan backend against the CPU backend on the same programs."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import near_ties

from actors.backend import run_program
from actors.cpu_backend import CpuBackend
from actors.engine import Engine
from flow.errors import PlanError
from flow.graph import stages
from flow.planning import Lifetime, assign_offsets, init_parameters, plan
from flow.spec import (
    GELU,
    MSE,
    SGD,
    Adam,
    Conv2d,
    CrossEntropy,
    Data,
    Edge,
    Flatten,
    Linear,
    MaxPool2d,
    Model,
    Node,
    Pipeline,
    ReLU,
    RunSettings,
    Softmax,
    Spec,
    Synthetic,
    Tanh,
)

ROOT = Path(__file__).resolve().parent.parent


def _spec(model: Model, batch: int, optimiser=None, in_flight: int = 1) -> Spec:
    return Spec(
        model=model,
        optimiser=optimiser or SGD(lr=0.1),
        data=Data(Synthetic(samples=64, features=model.input_shape, classes=4), batch_size=batch),
        run=RunSettings(in_flight=in_flight),
    )


MLP = Model(
    input_shape=(7,),
    layers=(Linear(9, activation="tanh"), Linear(6), GELU(), Linear(5, activation="leaky_relu"), Linear(4)),
    loss=CrossEntropy(),
)
CNN = Model(
    input_shape=(2, 7, 6),
    layers=(
        Conv2d(3, 3, padding=1, activation="relu"),
        MaxPool2d(2),
        Conv2d(4, 2, stride=1),
        Tanh(),
        Flatten(),
        Linear(4),
    ),
    loss=CrossEntropy(),
)
# Long K with narrow outputs: the planner splits these GEMMs over K (forward and weight gradients).
SPLIT_K = Model(input_shape=(300,), layers=(Linear(6, activation="tanh"), Linear(4)), loss=CrossEntropy())
# A softmax layer trained through MSE: its backward is its own rule (CrossEntropy fuses it instead).
SOFTMAX_MSE = Model(input_shape=(6,), layers=(Linear(5, activation="tanh"), Linear(7), Softmax()), loss=MSE())
REGRESSION = Model(input_shape=(5,), layers=(Linear(8), ReLU(), Linear(3, activation="sigmoid")), loss=MSE())


def _batch(model: Model, rows: int, rng: np.random.Generator):
    x = rng.standard_normal((rows, *model.input_shape))
    if isinstance(model.loss, MSE):
        out = stages(model)[-1].out_shape
        return x, rng.standard_normal((rows, *out))
    return x, rng.integers(0, 4, rows).astype(np.int32)


def _gradients_and_loss(device, backend, params, x, y):
    for name, value in params.items():
        backend.write(name, value)
    backend.write("x", x)
    backend.write("y", y)
    # lr 0: the update leaves weights alone; every row of the batch is real.
    backend.write("stepvals", np.array([0.0, 1.0, 1.0, 1.0, x.shape[0]], np.float32))
    run_program(backend, device.program("train"))
    grads = {p.name: backend.read(f"grad:{p.name}") for p in device.parameters}
    return grads, float(backend.read("loss")[0])


def _loss(device, backend, params, x, y) -> float:
    for name, value in params.items():
        backend.write(name, value)
    backend.write("stepvals", np.array([0.0, 1.0, 1.0, 1.0, x.shape[0]], np.float32))
    run_program(backend, device.program("eval"))
    return float(backend.read("loss")[0])


@pytest.mark.parametrize(
    "model", [MLP, CNN, REGRESSION, SPLIT_K, SOFTMAX_MSE], ids=["mlp", "cnn", "mse", "split_k", "softmax_mse"]
)
def test_whole_model_gradients_match_finite_differences(model, rng):
    rows = 260 if model is SPLIT_K else 5
    device = plan(_spec(model, batch=rows)).devices[0]
    backend = CpuBackend(precision="float64")
    backend.open_layout(device.layout)
    params = {
        k: v.astype(np.float64) + 0.05 * rng.standard_normal(v.shape)
        for k, v in init_parameters(device, "xavier", int(rng.integers(1 << 30))).items()
    }
    x, y = _batch(model, rows, rng)
    grads, _ = _gradients_and_loss(device, backend, params, x, y)
    eps = 1e-6
    checked = 0
    for name, value in params.items():
        flat_indices = rng.choice(value.size, size=min(6, value.size), replace=False)
        for index in flat_indices:
            shifted = {k: v.copy() for k, v in params.items()}
            shifted[name].reshape(-1)[index] += eps
            up = _loss(device, backend, shifted, x, y)
            shifted[name].reshape(-1)[index] -= 2 * eps
            down = _loss(device, backend, shifted, x, y)
            numeric = (up - down) / (2 * eps)
            analytic = grads[name].reshape(-1)[index]
            assert analytic == pytest.approx(numeric, rel=1e-5, abs=1e-8), (name, index)
            checked += 1
    assert checked >= 4 * len(params) // 2


@pytest.mark.parametrize(
    "model", [MLP, CNN, REGRESSION, SPLIT_K, SOFTMAX_MSE], ids=["mlp", "cnn", "mse", "split_k", "softmax_mse"]
)
def test_partial_batch_runs_the_full_program_and_matches_its_rows_alone(model, rng):
    """A batch of ``real`` rows in a plan for ``rows`` (the end of an epoch, a split's tail): the
    full-batch program, told the real row count, gives the loss, gradients and correct count of a
    plan for exactly those rows; whatever sits in the padding rows (here large random values)
    changes nothing."""
    rows = 260 if model is SPLIT_K else 9
    real = int(rng.integers(1, rows))
    full = plan(_spec(model, batch=rows)).devices[0]
    exact = plan(_spec(model, batch=real)).devices[0]
    params = {
        k: v.astype(np.float64) + 0.05 * rng.standard_normal(v.shape)
        for k, v in init_parameters(full, "xavier", int(rng.integers(1 << 30))).items()
    }
    x, y = _batch(model, rows, rng)
    x[real:] *= 20.0
    results = []
    for device, count in ((full, rows), (exact, real)):
        backend = CpuBackend(precision="float64")
        backend.open_layout(device.layout)
        for name, value in params.items():
            backend.write(name, value)
        backend.write("x", x[:count])
        backend.write("y", y[:count])
        backend.write("stepvals", np.array([0.0, 1.0, 1.0, 1.0, real], np.float32))
        run_program(backend, device.program("train"))
        grads = {p.name: backend.read(f"grad:{p.name}") for p in device.parameters}
        results.append((float(backend.read("loss")[0]), float(backend.read("correct")[0]), grads))
    (loss, correct, grads), (loss_exact, correct_exact, grads_exact) = results
    assert loss == pytest.approx(loss_exact, rel=1e-12)
    if isinstance(model.loss, CrossEntropy):
        assert correct == correct_exact
    for name, value in grads_exact.items():
        np.testing.assert_allclose(grads[name], value, rtol=1e-10, atol=1e-14, err_msg=name)


def _numpy_mlp_step(params, x, y, lr):
    """An independent float64 oracle of one SGD step of Linear(relu) -> Linear(relu) -> ... -> Linear."""
    names = sorted({k.split(".")[0] for k in params}, key=lambda n: int(n[7:-1]))
    activations = [x]
    for i, name in enumerate(names):
        z = activations[-1] @ params[f"{name}.weight"] + params[f"{name}.bias"]
        activations.append(np.maximum(z, 0) if i < len(names) - 1 else z)
    logits = activations[-1]
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = -np.log(probs[rows, y]).mean()
    grad = probs.copy()
    grad[rows, y] -= 1
    grad /= len(y)
    updated = {}
    for i in range(len(names) - 1, -1, -1):
        name = names[i]
        updated[f"{name}.weight"] = params[f"{name}.weight"] - lr * activations[i].T @ grad
        updated[f"{name}.bias"] = params[f"{name}.bias"] - lr * grad.sum(axis=0)
        grad = (grad @ params[f"{name}.weight"].T) * (activations[i] > 0)
    return updated, loss


def test_buffer_reuse_beats_the_naive_sum_and_matches_a_numpy_oracle(rng):
    model = Model(
        input_shape=(13,),
        layers=tuple(Linear(u, activation="relu") for u in (31, 17, 33, 9)) + (Linear(5),),
        loss=CrossEntropy(),
    )
    device = plan(_spec(model, batch=11, optimiser=SGD(lr=0.05))).devices[0]
    assert device.memory.work_peak < device.memory.work_naive
    engine = Engine(device, CpuBackend())
    engine.initialise("he", int(rng.integers(1 << 30)))
    before = {k: v.astype(np.float64) for k, v in engine.parameters().items()}
    x = rng.standard_normal((11, 13)).astype(np.float32)
    y = rng.integers(0, 5, 11).astype(np.int32)
    result = engine.train_step(x, y, step=0)
    expected, expected_loss = _numpy_mlp_step(before, x.astype(np.float64), y, lr=0.05)
    assert result.loss == pytest.approx(expected_loss, rel=1e-5)
    for name, value in engine.parameters().items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_assign_offsets_never_overlaps_live_tensors(rng):
    lives = []
    for i in range(40):
        first = int(rng.integers(0, 20))
        lives.append(Lifetime(f"t{i}", 256 * int(rng.integers(1, 9)), first, first + int(rng.integers(0, 6))))
    offsets, peak = assign_offsets(lives)
    for a in lives:
        for b in lives:
            if a.name >= b.name or a.last < b.first or b.last < a.first:
                continue
            a0, b0 = offsets[a.name], offsets[b.name]
            assert a0 + a.nbytes <= b0 or b0 + b.nbytes <= a0, (a, b)
    assert peak <= sum(life.nbytes for life in lives)


PLAN_BYTES = (
    "import sys\n"
    "from flow.codec import loads\n"
    "from flow.planning import plan\n"
    "sys.stdout.buffer.write(plan(loads(sys.stdin.buffer.read())).dumps())\n"
)


def test_plans_are_deterministic():
    # Other processes with other hash seeds (which reorder iteration over sets of strings) must give
    # the same bytes: within one process the same code would repeat any order-dependence.
    from flow.codec import dumps

    spec = _spec(CNN, batch=3, optimiser=Adam(lr=0.01))
    here = plan(spec).dumps()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run([sys.executable, "-c", PLAN_BYTES], input=dumps(spec), capture_output=True,
                              cwd=ROOT, env=env, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr.decode()
        assert done.stdout == here, hash_seed


def test_over_budget_plan_names_the_largest_tensor_and_the_budget():
    big = Model(input_shape=(4096,), layers=(Linear(4096), Linear(10)), loss=CrossEntropy())
    with pytest.raises(PlanError) as error:
        plan(_spec(big, batch=8), budget=10_000_000)
    text = str(error.value)
    assert "10,000,000" in text and "layers[0].weight" in text and "(4096, 4096)" in text


def test_plan_refuses_every_wiring_mistake_at_once():
    spec = _spec(MLP, batch=4)
    pipeline = Pipeline(
        nodes=(Node("a", "loader"), Node("b", "loader"), Node("d", "device"), Node("s", "sink")),
        edges=(Edge("a", "d"), Edge("b", "d"), Edge("d", "s")),
    )
    with pytest.raises(PlanError) as error:
        plan(dataclasses.replace(spec, pipeline=pipeline))
    text = str(error.value)
    assert "exactly one loader node, it has 2" in text and "node 'd' has 2 inbound edges (a, b)" in text


# -- the Vulkan backend against the CPU backend, on the same programs --------------------------------------


def test_narrow_long_gemms_are_split_over_k():
    program = plan(_spec(SPLIT_K, batch=260)).devices[0].program("train")
    splits = [
        step for step in program.launches if step.op == "gemm" and step.param_dict.get("k_splits", 1) > 1
    ]
    assert len(splits) == 3  # the first forward GEMM and both weight gradients
    assert sum(step.op == "splitk_epilogue" for step in program.launches) == 3


@pytest.mark.parametrize(
    "model", [MLP, CNN, REGRESSION, SPLIT_K, SOFTMAX_MSE], ids=["mlp", "cnn", "mse", "split_k", "softmax_mse"]
)
def test_vulkan_matches_cpu_over_training_steps(model, vulkan_backend, rng):
    # SGD keeps updates proportional to gradients; Adam would turn rounding-level differences in
    # near-zero gradients into full-size steps (m / sqrt(v) ~ sign), which no tolerance can absorb.
    optimiser = SGD(lr=0.05, momentum=0.9, nesterov=model is MLP, weight_decay=0.01 if model is CNN else 0.0)
    rows = 260 if model is SPLIT_K else 6
    device = plan(_spec(model, batch=rows, optimiser=optimiser)).devices[0]
    seed = int(rng.integers(1 << 30))
    cpu, gpu = Engine(device, CpuBackend()), Engine(device, vulkan_backend)
    cpu.initialise("he", seed)
    gpu.initialise("he", seed)
    for step in range(4):
        x, y = _batch(model, rows if step < 3 else rows - 1, rng)  # the last batch is partial
        x = x.astype(np.float32)
        y = y.astype(np.float32) if isinstance(model.loss, MSE) else y
        ties = near_ties(cpu.predict(x)) if isinstance(model.loss, CrossEntropy) else 0
        a, b = cpu.train_step(x, y, step), gpu.train_step(x, y, step)
        assert b.loss == pytest.approx(a.loss, rel=1e-4), step
        if isinstance(model.loss, CrossEntropy):
            assert abs(b.correct - a.correct) <= ties, step  # only a near-tie may go either way
        else:
            assert np.isnan(a.correct) and np.isnan(b.correct)
    for name, value in cpu.parameters().items():
        np.testing.assert_allclose(gpu.parameters()[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_recorded_once_replayed_100_times_matches_100_fresh_recordings(vulkan_backend, rng):
    device = plan(_spec(MLP, batch=8, optimiser=SGD(lr=0.02, momentum=0.5))).devices[0]
    x, y = _batch(MLP, 8, rng)
    seed = int(rng.integers(1 << 30))

    def train(fresh: bool) -> tuple[list[float], dict]:
        engine = Engine(device, vulkan_backend)
        engine.initialise("he", seed)
        engine.write_batch(0, x.astype(np.float32), y)
        losses = []
        program = device.program("train")
        handle = vulkan_backend.record(program, 0)
        for step in range(100):
            if fresh:
                handle = vulkan_backend.record(program, 0)
            vulkan_backend.write("stepvals", np.array([0.02, 1, 1, step + 1, 8], np.float32))
            vulkan_backend.wait(vulkan_backend.submit(handle))
            losses.append(float(vulkan_backend.read("loss")[0]))
        return losses, engine.parameters()

    replayed_losses, replayed = train(fresh=False)
    fresh_losses, fresh = train(fresh=True)
    assert replayed_losses == fresh_losses
    assert replayed_losses[-1] < replayed_losses[0]
    for name in replayed:
        np.testing.assert_array_equal(replayed[name], fresh[name])


def _mixed(spec: Spec) -> Spec:
    from dataclasses import replace

    return replace(spec, run=replace(spec.run, precision="mixed"))


def test_mixed_precision_runs_every_gemm_on_tensor_cores_and_needs_them():
    spec = _mixed(_spec(SPLIT_K, batch=260))
    ops = {step.op for step in plan(spec).devices[0].program("train").launches}
    assert "gemm_coopmat" in ops and "gemm" not in ops and "splitk_epilogue" not in ops
    with pytest.raises(PlanError) as error:
        plan(spec, features=("timeline_semaphore",))
    assert "run.precision" in str(error.value)


def test_mixed_precision_on_vulkan_matches_the_cpu_emulation(vulkan_backend, rng):
    if "cooperative_matrix" not in vulkan_backend.facts.features:
        pytest.skip(f"{vulkan_backend.facts.name} has no cooperative matrices")
    device = plan(_mixed(_spec(MLP, batch=37, optimiser=Adam(lr=0.01)))).devices[0]
    seed = int(rng.integers(1 << 30))
    cpu, gpu = Engine(device, CpuBackend()), Engine(device, vulkan_backend)
    cpu.initialise("he", seed)
    gpu.initialise("he", seed)
    for step in range(3):
        x, y = _batch(MLP, 37, rng)
        a, b = cpu.train_step(x.astype(np.float32), y, step), gpu.train_step(x.astype(np.float32), y, step)
        assert b.loss == pytest.approx(a.loss, rel=1e-3), step
    for name, value in cpu.parameters().items():
        np.testing.assert_allclose(gpu.parameters()[name], value, rtol=1e-2, atol=1e-3, err_msg=name)


def test_adam_gets_one_minus_beta_computed_in_double_precision():
    # float32 arithmetic would give 1 - float32(0.999) = 0.00099998713..., 1.3e-5 away from 0.001.
    device = plan(_spec(MLP, batch=4, optimiser=Adam(lr=0.01, betas=(0.9, 0.999)))).devices[0]
    (update,) = [step for step in device.program("train").launches if step.op == "adam"]
    assert update.param("one_minus_beta1") == 1.0 - 0.9
    assert update.param("one_minus_beta2") == 1.0 - 0.999
    assert abs(np.float32(update.param("one_minus_beta2")) - np.float32(0.001)) == 0.0

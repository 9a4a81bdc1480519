"""Helpers that tests of whole layers share: a spec around a model, a random batch for it, nudged
starting parameters, and one train program run by hand on a backend."""

from __future__ import annotations

import numpy as np

from actors.backend import run_program
from flow.graph import label_shape
from flow.planning import init_parameters
from flow.shapes import infer_shapes
from flow.spec import MSE, SGD, Data, Embedding, Model, Spec, Synthetic


def layer_spec(model: Model, batch: int, optimiser=None) -> Spec:
    """``model`` on a small Synthetic set of 4 classes, in batches of ``batch``."""
    return Spec(
        model=model,
        optimiser=optimiser or SGD(lr=0.1),
        data=Data(Synthetic(samples=64, features=model.input_shape, classes=4), batch_size=batch),
    )


def layer_batch(model: Model, rows: int, rng: np.random.Generator):
    """(x, y) of ``rows`` rows: inputs offset and scaled away from N(0, 1) (token ids for a model
    that starts with an Embedding), class ids or targets."""
    x = rng.standard_normal((rows, *model.input_shape)) * 2.0 + 0.5
    if model.layers and isinstance(model.layers[0], Embedding):
        x = rng.integers(0, model.layers[0].num_embeddings, x.shape).astype(np.float64)
    if isinstance(model.loss, MSE):
        return x, rng.standard_normal((rows, *infer_shapes(model)[-1]))
    # One class id a sample, or one a position for a model with per-position outputs (T, classes).
    return x, rng.integers(0, 4, label_shape(model, rows)[0]).astype(np.int32)


def nudged_parameters(device, rng) -> dict[str, np.ndarray]:
    """Initial values nudged, so that every normalisation's scale and shift differs from 1 and 0."""
    return {
        name: value.astype(np.float64) + 0.1 * rng.standard_normal(value.shape)
        for name, value in init_parameters(device, "xavier", int(rng.integers(1 << 30))).items()
    }


def run_train_program(device, backend, params, x, y, real: int | None = None, step: int = 1):
    """One train program with lr 0 (the update leaves the weights alone) as training step ``step``
    (1-based, what Dropout's masks hash): the loss, the gradients of the trainable parameters and
    the values of the others (running statistics) it leaves."""
    for name, value in params.items():
        backend.write(name, value)
    backend.write("x", x)
    backend.write("y", y)
    real = x.shape[0] if real is None else real
    backend.write("stepvals", np.array([0.0, 1.0, 1.0, step, real, real], np.float32))
    run_program(backend, device.program("train"))
    grads = {p.name: backend.read(f"grad:{p.name}") for p in device.parameters if p.trainable}
    kept = {p.name: backend.read(p.name) for p in device.parameters if not p.trainable}
    return float(backend.read("loss")[0]), grads, kept


def run_eval_program(device, backend, params, x, y, step: int = 1) -> float:
    """One eval program at training step ``step`` (which it must ignore): the loss."""
    for name, value in params.items():
        backend.write(name, value)
    backend.write("x", x)
    backend.write("y", y)
    rows = x.shape[0]
    backend.write("stepvals", np.array([0.0, 1.0, 1.0, step, rows, rows], np.float32))
    run_program(backend, device.program("eval"))
    return float(backend.read("loss")[0])


def check_gradients_by_differences(model: Model, rng: np.random.Generator, probes: int = 4) -> None:
    """The train program's gradients of ``model`` (float64 CPU backend, 5 rows) against central
    differences of its loss, at ``probes`` random elements of every trainable parameter."""
    import pytest

    from actors.cpu_backend import CpuBackend
    from flow.planning import plan

    rows = 5
    device = plan(layer_spec(model, batch=rows)).devices[0]
    backend = CpuBackend(precision="float64")
    backend.open_layout(device.layout)
    params = nudged_parameters(device, rng)
    x, y = layer_batch(model, rows, rng)
    _, grads, _ = run_train_program(device, backend, params, x, y)
    eps = 1e-6
    for name in grads:
        value = params[name]
        for index in rng.choice(value.size, size=min(probes, value.size), replace=False):
            shifted = {k: v.copy() for k, v in params.items()}
            shifted[name].reshape(-1)[index] += eps
            up, _, _ = run_train_program(device, backend, shifted, x, y)
            shifted[name].reshape(-1)[index] -= 2 * eps
            down, _, _ = run_train_program(device, backend, shifted, x, y)
            numeric = (up - down) / (2 * eps)
            assert grads[name].reshape(-1)[index] == pytest.approx(numeric, rel=1e-5, abs=1e-8), (name, index)


def check_partial_batch_matches_rows_alone(model: Model, rng: np.random.Generator, vulkan_backend) -> None:
    """A batch of 4 real rows in a plan for 7, its padding full of large values (ids far out of
    range for a model that starts with an Embedding: clamped on the GPU, ignored by the CPU): the
    loss and every gradient on the float64 CPU backend and on Vulkan are those of a plan for
    exactly the real rows."""
    import pytest
    from conftest import relative_error

    from actors.cpu_backend import CpuBackend
    from flow.planning import plan

    rows, real = 7, 4
    full = plan(layer_spec(model, batch=rows)).devices[0]
    exact = plan(layer_spec(model, batch=real)).devices[0]
    params = {k: v.astype(np.float32) for k, v in nudged_parameters(full, rng).items()}
    x, y = layer_batch(model, rows, rng)
    if model.layers and isinstance(model.layers[0], Embedding):
        x[real:] = 1e6
    else:
        x[real:] = 50.0 * rng.standard_normal(x[real:].shape)
    x = x.astype(np.float32)
    reference = CpuBackend(precision="float64")
    reference.open_layout(exact.layout)
    loss, grads, _ = run_train_program(exact, reference, params, x[:real], y[:real], real)
    for backend, tol in ((CpuBackend(precision="float64"), 1e-10), (vulkan_backend, 1e-4)):
        backend.open_layout(full.layout)
        got_loss, got, _ = run_train_program(full, backend, params, x, y, real)
        assert got_loss == pytest.approx(loss, rel=max(tol, 1e-6))
        for name, value in grads.items():
            assert relative_error(got[name], value) <= tol, name


def check_learns_the_digits(model: Model, vulkan_backend, epochs: int = 4):
    """``model`` (input (1, 8, 8), 10 outputs) trained by Adam through ``flow.run`` on the bundled
    digits, normalised, on Vulkan: its validation loss falls and it reaches accuracy 0.9.

    Returns:
        The RunResult, for more checks.
    """
    import flow
    from flow.spec import Adam, Data, Devices, Digits, Normalize, RunSettings, Split

    spec = Spec(
        model=model,
        optimiser=Adam(lr=0.003),
        data=Data(Digits(), batch_size=64, split=Split(train=0.8, val=0.2, stratify=True),
                  preprocess=(Normalize((0.5,), (0.5,)),)),
        devices=Devices("cpu"),
        run=RunSettings(epochs=epochs),
    )  # fmt: skip
    result = flow.run(spec, backend=vulkan_backend)
    assert result.evals[-1].loss < result.evals[0].loss
    assert result.accuracy >= 0.9
    return result

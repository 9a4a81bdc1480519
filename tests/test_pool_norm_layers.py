"""AvgPool2d, GlobalAvgPool, BatchNorm1d and BatchNorm2d as layers of a model, end to end: shapes
and parameter counts, the spec files, clear problems for bad specs, whole-model gradients against
finite differences, partial batches, the CPU and Vulkan backends on the same programs, the running
statistics as state that the optimiser never moves and checkpoints keep, and a CNN with the new
layers learning the bundled digits through ``flow.run``.

The ops themselves are checked against float64 oracles in tests/test_ops_pool_norm.py.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from conftest import relative_error
from layer_programs import (
    check_gradients_by_differences,
    layer_batch,
    layer_spec,
    nudged_parameters,
    run_train_program,
)

import flow
from actors import checkpoint as checkpoints
from actors.backend import run_program
from actors.cpu_backend import CpuBackend
from actors.engine import Engine
from flow.codec import dumps, encode, load, loads, save
from flow.errors import SpecError
from flow.planning import init_parameters, plan
from flow.shapes import count_parameters, infer_shapes
from flow.spec import (
    MSE,
    SGD,
    Adam,
    AdamW,
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    Conv2d,
    CrossEntropy,
    Data,
    Devices,
    Digits,
    Flatten,
    GlobalAvgPool,
    Linear,
    Model,
    Normalize,
    ReLU,
    RunSettings,
    Spec,
    Split,
)
from flow.summary import summarize
from flow.validation import validate

# Every new layer, odd sizes: a 7 x 5 input of 3 channels, 5 channels later, a pooling stride
# unlike its kernel with padding. Convolutions before a BatchNorm have no bias (it would cancel).
CNN = Model(
    input_shape=(3, 7, 5),
    layers=(
        Conv2d(4, 3, padding=1, bias=False),
        BatchNorm2d(),
        ReLU(),
        AvgPool2d(3, stride=2, padding=1),
        Conv2d(5, 2, padding=1, activation="tanh"),
        GlobalAvgPool(),
        BatchNorm1d(momentum=0.3),
        Linear(4),
    ),
    loss=CrossEntropy(),
)
# A BatchNorm on the input itself: the first trainable layer, whose input needs no gradient.
NORM_FIRST = Model(
    input_shape=(2, 5, 7),
    layers=(BatchNorm2d(eps=1e-3), AvgPool2d(2, stride=1), Flatten(), Linear(4)),
    loss=CrossEntropy(),
)
# BatchNorm1d over (channels, length) rows, trained through MSE.
SEQUENCE = Model(
    input_shape=(3, 6),
    layers=(BatchNorm1d(), Flatten(), Linear(5, activation="tanh"), BatchNorm1d(), Linear(2)),
    loss=MSE(),
)
MODELS = [CNN, NORM_FIRST, SEQUENCE]
IDS = ["cnn", "norm_first", "sequence"]










# ---------------------------------------------------------------------------------------------
# Specs


def test_shapes_parameters_and_summary():
    assert infer_shapes(CNN) == [(4, 7, 5), (4, 7, 5), (4, 7, 5), (4, 4, 3), (5, 5, 4), (5,), (5,), (4,)]
    # Trainable parameters only: BatchNorm's scale and shift count, its running statistics do not.
    assert count_parameters(CNN) == 3 * 4 * 9 + 2 * 4 + (4 * 5 * 4 + 5) + 2 * 5 + (5 * 4 + 4)
    summary = summarize(layer_spec(CNN, 4))
    assert "AvgPool2d(3, stride=2, padding=1)" in summary and "BatchNorm1d(momentum=0.3)" in summary
    assert "GlobalAvgPool()" in summary and "(5,)" in summary
    device = plan(layer_spec(CNN, 4)).devices[0]
    kept = [p.name for p in device.parameters if not p.trainable]
    assert kept == [
        "layers[1].running_mean",
        "layers[1].running_var",
        "layers[6].running_mean",
        "layers[6].running_var",
    ]
    values = init_parameters(device, "he", 0)
    np.testing.assert_array_equal(values["layers[1].weight"], np.ones(4))
    np.testing.assert_array_equal(values["layers[1].bias"], np.zeros(4))
    np.testing.assert_array_equal(values["layers[6].running_mean"], np.zeros(5))
    np.testing.assert_array_equal(values["layers[6].running_var"], np.ones(5))


def test_spec_files_round_trip(tmp_path):
    model = dataclasses.replace(
        CNN, layers=(*CNN.layers[:1], BatchNorm2d(momentum=0.2, eps=1e-3), *CNN.layers[2:])
    )
    spec = layer_spec(model, 8)
    assert validate(spec) == []
    assert loads(dumps(spec)) == spec and dumps(loads(dumps(spec))) == dumps(spec)
    for name in ("spec.json", "spec.msgpack"):
        save(spec, tmp_path / name)
        assert load(tmp_path / name) == spec
    layers = encode(spec)["model"]["layers"]
    assert layers[1] == {"eps": 1e-3, "kind": "BatchNorm2d", "momentum": 0.2}
    assert layers[3] == {"kernel": 3, "kind": "AvgPool2d", "padding": 1, "stride": 2}
    assert layers[5] == {"kind": "GlobalAvgPool"}
    # Fields at their defaults may be left out of a file.
    tree = encode(spec)
    tree["model"]["layers"][3] = {"kind": "AvgPool2d", "kernel": 3}
    tree["model"]["layers"][6] = {"kind": "BatchNorm1d"}
    (tmp_path / "short.json").write_text(json.dumps(tree))
    short = load(tmp_path / "short.json").model.layers
    assert short[3] == AvgPool2d(3) and short[6] == BatchNorm1d(momentum=0.1, eps=1e-5)


@pytest.mark.parametrize(
    "layers, input_shape, path, words",
    [
        (
            (AvgPool2d(9), Flatten(), Linear(3)),
            (3, 7, 5),
            "model.layers[0]",
            "AvgPool2d output size 0x0 is not positive (input 7x5, kernel 9, stride 9, padding 0): "
            "the kernel is larger than the padded input",
        ),
        (
            (Conv2d(4, 3), AvgPool2d(4, stride=1, padding=1), Flatten(), Linear(3)),
            (3, 4, 3),
            "model.layers[1]",
            "the kernel is larger than the padded input",
        ),
        ((AvgPool2d(3, padding=2), Flatten(), Linear(3)), (3, 7, 5), "model.layers[0].padding",
         "must be at most kernel // 2 (1), got 2"),
        ((AvgPool2d(2, stride=0), Flatten(), Linear(3)), (3, 7, 5), "model.layers[0].stride", "must be > 0"),
        ((GlobalAvgPool(), Linear(3)), (35,), "model.layers[0]", "GlobalAvgPool needs a (channels, height"),
        ((BatchNorm2d(), Linear(3)), (35,), "model.layers[0]", "BatchNorm2d needs a (channels, height"),
        ((BatchNorm1d(), Flatten(), Linear(3)), (3, 7, 5), "model.layers[0]", "use BatchNorm2d"),
        ((BatchNorm1d(momentum=1.5), Linear(3)), (35,), "model.layers[0].momentum", "must be in [0, 1]"),
        ((Flatten(), BatchNorm1d(eps=0.0), Linear(3)), (3, 7, 5), "model.layers[1].eps", "must be > 0"),
    ],
)  # fmt: skip
def test_bad_layers_are_named_by_their_path(layers, input_shape, path, words):
    spec = layer_spec(Model(input_shape=input_shape, layers=layers, loss=CrossEntropy()), 4)
    problems = validate(spec)
    assert len(problems) == 1 and problems[0].path == path and words in problems[0].message, problems


def test_a_spec_file_with_a_kernel_larger_than_its_input_is_refused_with_the_path(tmp_path):
    tree = encode(layer_spec(CNN, 4))
    tree["model"]["layers"][3] = {"kind": "AvgPool2d", "kernel": 9}
    (tmp_path / "bad.json").write_text(json.dumps(tree))
    with pytest.raises(
        SpecError, match=r"model\.layers\[3\]: AvgPool2d output size .* larger than the padded"
    ):
        load(tmp_path / "bad.json")


# ---------------------------------------------------------------------------------------------
# Programs


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_whole_model_gradients_match_finite_differences(model, rng):
    """Gradients of the training loss (BatchNorm normalising by the batch, its derivative through
    the batch's mean and variance included) against central differences, in float64."""
    check_gradients_by_differences(model, rng, probes=5)


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_partial_batch_matches_its_rows_alone(model, rng):
    """A batch of ``real`` rows in a plan for 9: the batch statistics, the loss, the gradients and
    the running statistics are those of a plan for exactly those rows, whatever the padding holds."""
    rows, real = 9, int(rng.integers(2, 9))
    full = plan(layer_spec(model, batch=rows)).devices[0]
    exact = plan(layer_spec(model, batch=real)).devices[0]
    params = nudged_parameters(full, rng)
    x, y = layer_batch(model, rows, rng)
    x[real:] = 50.0 * rng.standard_normal(x[real:].shape)
    results = []
    for device, count in ((full, rows), (exact, real)):
        backend = CpuBackend(precision="float64")
        backend.open_layout(device.layout)
        results.append(run_train_program(device, backend, params, x[:count], y[:count], real))
    (loss, grads, kept), (loss_exact, grads_exact, kept_exact) = results
    assert loss == pytest.approx(loss_exact, rel=1e-12)
    for name, value in {**grads_exact, **kept_exact}.items():
        np.testing.assert_allclose({**grads, **kept}[name], value, rtol=1e-10, atol=1e-14, err_msg=name)


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_train_and_eval_programs_agree_on_cpu_and_vulkan(model, rng, vulkan_backend):
    """The same train program (with a partial batch) on Vulkan and on the float64 CPU backend:
    loss, gradients and running statistics; then the eval program, which normalises by them."""
    rows, real = 6, 5
    device = plan(layer_spec(model, batch=rows)).devices[0]
    params = {k: v.astype(np.float32) for k, v in nudged_parameters(device, rng).items()}
    x, y = layer_batch(model, rows, rng)
    x = x.astype(np.float32)
    results = []
    for backend in (CpuBackend(precision="float64"), vulkan_backend):
        backend.open_layout(device.layout)
        loss, grads, kept = run_train_program(device, backend, params, x, y, real)
        run_program(backend, device.program("eval"))
        results.append((loss, grads, kept, float(backend.read("loss")[0])))
    (loss, grads, kept, evaluated), (gpu_loss, gpu_grads, gpu_kept, gpu_evaluated) = results
    assert gpu_loss == pytest.approx(loss, rel=1e-5)
    assert gpu_evaluated == pytest.approx(evaluated, rel=1e-5)
    for name, value in grads.items():
        assert relative_error(gpu_grads[name], value) <= 1e-4, name
    for name, value in kept.items():
        assert relative_error(gpu_kept[name], value) <= 1e-5, name


@pytest.mark.parametrize(
    "optimiser",
    [
        SGD(lr=0.5, momentum=0.9, weight_decay=0.5),
        Adam(lr=0.5, weight_decay=0.5),
        AdamW(lr=0.5, weight_decay=0.5),
    ],
    ids=["sgd", "adam", "adamw"],
)
def test_running_statistics_are_state_the_optimiser_never_moves(optimiser, rng):
    """Running statistics follow the batches alone (PyTorch's momentum rule, unbiased variance),
    however hard the optimiser and its weight decay push, while the scale and shift train."""
    device = plan(layer_spec(NORM_FIRST, batch=6, optimiser=optimiser)).devices[0]
    update = device.program("train").launches[-1]
    assert update.op in ("sgd", "adam")
    for p in device.parameters:
        offset = device.layout.tensor(p.name).offset
        assert (offset >= update.param_dict["n"] * 4) == (not p.trainable), p.name
    assert not any(t.name.startswith("grad:") and "running" in t.name for t in device.layout.tensors)

    engine = Engine(device, CpuBackend())
    engine.initialise("he", 0)
    mean, var = np.zeros(2), np.ones(2)
    for step, rows in enumerate((6, 4)):
        x = (rng.standard_normal((rows, 2, 5, 7)) * 3.0 + 1.0).astype(np.float32)
        engine.train_step(x, rng.integers(0, 3, rows).astype(np.int32), step)
        mean = 0.9 * mean + 0.1 * x.astype(np.float64).mean(axis=(0, 2, 3))
        var = 0.9 * var + 0.1 * x.astype(np.float64).var(axis=(0, 2, 3), ddof=1)
    values = engine.parameters()
    assert relative_error(values["layers[0].running_mean"], mean) <= 1e-6
    assert relative_error(values["layers[0].running_var"], var) <= 1e-6
    assert not np.allclose(values["layers[0].weight"], 1.0)  # the scale did train


def test_prediction_normalises_by_the_running_statistics(rng):
    model = Model(input_shape=(5,), layers=(BatchNorm1d(eps=1e-2), Linear(3)), loss=MSE())
    device = plan(layer_spec(model, batch=4)).devices[0]
    engine = Engine(device, CpuBackend())
    values = {
        "layers[0].weight": rng.standard_normal(5),
        "layers[0].bias": rng.standard_normal(5),
        "layers[0].running_mean": rng.standard_normal(5),
        "layers[0].running_var": rng.uniform(0.5, 2.0, 5),
        "layers[1].weight": rng.standard_normal((5, 3)),
        "layers[1].bias": rng.standard_normal(3),
    }
    for name, value in values.items():
        engine.backend.write(name, value.astype(np.float32))
    x = rng.standard_normal((3, 5)).astype(np.float32)
    normalised = (x - values["layers[0].running_mean"]) / np.sqrt(values["layers[0].running_var"] + 1e-2)
    hidden = normalised * values["layers[0].weight"] + values["layers[0].bias"]
    expected = hidden @ values["layers[1].weight"] + values["layers[1].bias"]
    assert relative_error(engine.predict(x), expected) <= 1e-5


def _digits_spec(model: Model, **run) -> Spec:
    return Spec(
        model=model,
        optimiser=SGD(0.05, momentum=0.9),
        data=Data(Digits(), batch_size=64, split=Split(train=0.8, val=0.2, stratify=True),
                  preprocess=(Normalize((0.5,), (0.5,)),)),
        devices=Devices("cpu"),
        run=RunSettings(**run),
    )  # fmt: skip


DIGITS_CNN = Model(
    input_shape=(1, 8, 8),
    layers=(
        Conv2d(8, 3, padding=1, bias=False),
        BatchNorm2d(),
        ReLU(),
        AvgPool2d(3, stride=2, padding=1),
        Conv2d(16, 3, padding=1, bias=False),
        BatchNorm2d(),
        ReLU(),
        GlobalAvgPool(),
        BatchNorm1d(),
        Linear(10),
    ),
    loss=CrossEntropy(),
)


def test_checkpoints_keep_the_running_statistics(tmp_path):
    """A run interrupted and resumed ends with the same bits as one straight through, running
    statistics included (a resume that lost them would start them again from 0 and 1), and
    predicting from the checkpoint uses them."""
    spec = _digits_spec(DIGITS_CNN, epochs=1, checkpoint_dir=str(tmp_path / "a"))
    straight = flow.run(dataclasses.replace(spec, run=RunSettings(epochs=1)), backend=CpuBackend())
    flow.run(dataclasses.replace(spec, run=dataclasses.replace(spec.run, epochs=None, steps=12)),
             backend=CpuBackend())  # fmt: skip
    resumed = flow.run(spec, resume=tmp_path / "a", backend=CpuBackend())
    assert resumed.resumed_from == 12 and resumed.steps == straight.steps == 23
    for name, value in straight.parameters.items():
        np.testing.assert_array_equal(resumed.parameters[name], value, err_msg=name)
    running = resumed.parameters["layers[1].running_var"]
    assert np.isfinite(running).all() and not np.allclose(running, 1.0)

    saved = checkpoints.load(resumed.checkpoint)
    engine = Engine(plan(spec).devices[0], CpuBackend())
    engine.load_state(saved.state)
    restored = engine.parameters()
    for name, value in resumed.parameters.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)
    x = np.random.default_rng(0).uniform(0.0, 1.0, (7, 1, 8, 8)).astype(np.float32)
    from_checkpoint = flow.predict(resumed.checkpoint, x, backend=CpuBackend())
    normalised = (x - np.float32(0.5)) / np.float32(0.5)  # the spec's preprocessing
    np.testing.assert_allclose(engine.predict(normalised), from_checkpoint, rtol=1e-5, atol=1e-7)
    for name, value in init_parameters(engine.plan, "he", 0).items():
        if "running" in name:  # back to the statistics of a fresh model
            engine.backend.write(name, value)
    assert relative_error(engine.predict(normalised), from_checkpoint) > 1e-2


def test_a_cnn_with_the_new_layers_learns_the_digits(vulkan_backend):
    """Conv -> BatchNorm2d -> ReLU -> AvgPool2d -> Conv -> BatchNorm2d -> ReLU -> GlobalAvgPool ->
    BatchNorm1d -> Linear, trained on the bundled digits on the Vulkan device, evaluated with the
    running statistics."""
    result = flow.run(_digits_spec(DIGITS_CNN, epochs=4), backend=vulkan_backend)
    assert result.steps == 4 * 23
    first, last = result.evals[0], result.evals[-1]
    assert last.loss < first.loss
    assert result.accuracy >= 0.93

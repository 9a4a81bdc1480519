"""Models as graphs: layers that name their inputs, Add and Concat joining branches, Residual
blocks and Repeat. Validation names each mistake by its path; the spec files round-trip; the
gradients of whole graph models (a tensor read three times, branches from the input, concatenated
conv channels, a repeated residual stack, (T, D) sequences with a position embedding) match
central differences on the float64 CPU backend, and Vulkan matches the CPU; a residual MLP learns
the digits through ``flow.run`` and from the CLI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
from layer_programs import (
    check_gradients_by_differences,
    check_learns_the_digits,
    check_partial_batch_matches_rows_alone,
    layer_batch,
    layer_spec,
    nudged_parameters,
    run_train_program,
)

import flow
from actors.cpu_backend import CpuBackend
from flow.codec import dumps, encode, load, loads, save
from flow.planning import plan
from flow.shapes import count_parameters, infer_shapes
from flow.spec import (
    MSE,
    Add,
    Concat,
    Conv2d,
    CrossEntropy,
    Flatten,
    LayerNorm,
    Linear,
    MaxPool2d,
    Model,
    PositionalEmbedding,
    Repeat,
    Reshape,
    Residual,
    Tanh,
)
from flow.summary import summarize
from flow.validation import validate

ROOT = Path(__file__).resolve().parents[1]

RESIDUAL_MLP = Model(
    input_shape=(6,),
    layers=(Linear(8, activation="tanh"), Residual((Linear(8, activation="tanh"), Linear(8))), Linear(4)),
    loss=CrossEntropy(),
)
# "a" is read three times (twice by the Add, once by the Concat); "b" branches from the input.
BRANCHES = Model(
    input_shape=(6,),
    layers=(
        Linear(5, activation="tanh", name="a"),
        Linear(5, inputs=("input",), name="b"),
        Tanh(name="bt"),
        Add(inputs=("a", "bt", "a"), name="s"),
        Concat(inputs=("s", "a")),
        Linear(4),
    ),
    loss=CrossEntropy(),
)
CONV_CONCAT = Model(
    input_shape=(2, 6, 6),
    layers=(
        Conv2d(3, 3, padding=1, activation="relu", name="c1"),
        Conv2d(2, 1, inputs=("input",), name="c2"),
        Concat(inputs=("c1", "c2")),
        MaxPool2d(2),
        Flatten(),
        Linear(4),
    ),
    loss=CrossEntropy(),
)
REPEATED = Model(
    input_shape=(6,),
    layers=(Linear(8), Repeat(2, (Residual((LayerNorm(), Linear(8, activation="tanh"))),)), Linear(4)),
    loss=CrossEntropy(),
)
SEQUENCE = Model(
    input_shape=(5, 6),
    layers=(
        PositionalEmbedding(name="pe"),
        Linear(7, activation="gelu"),
        Residual((LayerNorm(), Linear(7)), name="r"),
        Concat(inputs=("r", "pe"), axis=-1),
        Linear(3),
    ),
    loss=MSE(),
)
# Each sample's 12 features as 3 positions of 4, a Linear per position, then flat again.
RESHAPED = Model(
    input_shape=(12,),
    layers=(Reshape((3, -1)), Linear(5, activation="tanh"), Reshape((-1,)), Linear(4)),
    loss=CrossEntropy(),
)
MODELS = [RESIDUAL_MLP, BRANCHES, CONV_CONCAT, REPEATED, SEQUENCE, RESHAPED]
IDS = ["residual_mlp", "branches", "conv_concat", "repeated", "sequence", "reshaped"]


def test_shapes_and_parameters_of_graph_models():
    assert infer_shapes(BRANCHES) == [(5,), (5,), (5,), (5,), (10,), (4,)]
    assert count_parameters(BRANCHES) == (6 * 5 + 5) * 2 + 10 * 4 + 4
    assert infer_shapes(CONV_CONCAT)[2] == (5, 6, 6)
    assert infer_shapes(SEQUENCE) == [(5, 6), (5, 7), (5, 7), (5, 13), (5, 3)]
    assert count_parameters(SEQUENCE) == 30 + (6 * 7 + 7) + (14 + 7 * 7 + 7) + (13 * 3 + 3)
    # Each repetition has parameters of its own, named by the repetition.
    names = [p.name for p in plan(layer_spec(REPEATED, batch=4)).devices[0].parameters]
    assert "layers[1][0].layers[0].layers[1].weight" in names
    assert "layers[1][1].layers[0].layers[0].bias" in names
    assert count_parameters(REPEATED) == 6 * 8 + 8 + 2 * (16 + 8 * 8 + 8) + 8 * 4 + 4


def test_reshape_fills_its_minus_one_and_names_a_count_that_does_not_fit():
    assert infer_shapes(RESHAPED)[:3] == [(3, 4), (3, 5), (15,)]
    bad = Model(input_shape=(12,), layers=(Reshape((5, 3)), Linear(4)), loss=CrossEntropy())
    assert _problems(bad) == [
        ("model.layers[0]", "Reshape to (5, 3) needs 15 values a sample, not the 12 of (12,)")
    ]


def test_the_summary_counts_a_blocks_parameters_on_its_row():
    text = summarize(layer_spec(REPEATED, batch=4))
    assert f"{2 * (16 + 72):,}" in text.splitlines()[3]
    assert "Repeat" in text.splitlines()[3]


def _problems(model: Model) -> list[tuple[str, str]]:
    return [(p.path, p.message) for p in validate(layer_spec(model, batch=4))]


@pytest.mark.parametrize(
    "layers, path, words",
    [
        (
            (Linear(4, name="a"), Linear(4, inputs=("aa",)), Linear(4)),
            "model.layers[1].inputs",
            "did you mean 'a'",
        ),
        (
            (Linear(4, inputs=("b",)), Linear(4, name="b", inputs=("input",))),
            "model.layers[0].inputs",
            "comes later",
        ),
        ((Linear(4, inputs=("b",)), Linear(4, name="b")), "model.layers[0].inputs", "a cycle"),
        ((Linear(4, name="a"), Linear(4, name="a"), Linear(4)), "model.layers[1].name", "already the name"),
        ((Linear(4, name="input"), Linear(4)), "model.layers[0].name", "model's input"),
        ((Linear(4, name="a"), Add(inputs=("a",)), Linear(4)), "model.layers[1].inputs", "two or more"),
        ((Linear(4), Add(), Linear(4)), "model.layers[1].inputs", "name them"),
        ((Linear(4, inputs=("input", "input")), Linear(4)), "model.layers[0].inputs", "reads one layer"),
        (
            (Linear(4, name="a"), Linear(3, name="b"), Add(inputs=("a", "b")), Linear(4)),
            "model.layers[2]",
            "(4,) and (3,)",
        ),
        ((Linear(4, name="a"), Linear(3), Linear(4, inputs=("a",))), "model.layers[1]", "nothing reads"),
        ((Residual((Linear(5),)), Linear(4)), "model.layers[0]", "not its input's (6,)"),
        ((Repeat(0, (Linear(6),)), Linear(4)), "model.layers[0].times", "must be > 0"),
        ((Residual(()), Linear(4)), "model.layers[0].layers", "at least one layer"),
        ((Linear(4, inputs=()), Linear(4)), "model.layers[0].inputs", "at least one"),
        (
            (Repeat(3, (Linear(6), Linear(6, inputs=("x",)))), Linear(4)),
            "model.layers[0].layers[1].inputs",
            "no earlier layer is named 'x'",
        ),
        (
            (Repeat(2, (Residual((Linear(6),)), Linear(3))), Linear(4)),
            "model.layers[0].layers[0]",
            "not its input's (3,) (repetition 2 of 2)",
        ),
    ],
)
def test_graph_mistakes_are_named_by_their_path(layers, path, words):
    model = Model(input_shape=(6,), layers=layers, loss=CrossEntropy())
    problems = _problems(model)
    assert len(problems) == 1 and problems[0][0] == path and words in problems[0][1], problems


def test_a_repetition_may_change_the_shape_the_next_one_takes():
    # Linear(3) takes (6,) in repetition 1 and (3,) in repetition 2, each with weights of its shape.
    model = Model(input_shape=(6,), layers=(Repeat(2, (Linear(3),)), Linear(4)), loss=CrossEntropy())
    assert _problems(model) == []
    bad = Model(input_shape=(1, 6, 6), layers=(Repeat(2, (Flatten(),)), Linear(4)), loss=CrossEntropy())
    assert _problems(bad) == []  # Flatten of a flat input is fine too


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_graph_specs_round_trip_through_both_formats(model, tmp_path):
    spec = layer_spec(model, batch=4)
    assert loads(dumps(spec)) == spec
    save(spec, tmp_path / "spec.json")
    assert load(tmp_path / "spec.json") == spec
    assert json.loads((tmp_path / "spec.json").read_text())["schema"] == 2


def test_a_sequential_layer_is_written_without_name_or_inputs_but_a_named_one_with_them():
    tree = encode(layer_spec(BRANCHES, batch=4))
    layers = tree["model"]["layers"]
    assert layers[0]["name"] == "a" and "inputs" not in layers[0]
    assert layers[1]["inputs"] == ["input"]
    assert "name" not in layers[5] and "inputs" not in layers[5]
    tree["model"]["layers"][4]["inputs"] = ["s", "nope"]
    with pytest.raises(flow.SpecError, match=r"model.layers\[4\].inputs: no earlier layer is named 'nope'"):
        loads(msgpack.packb(tree))


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_whole_graph_model_gradients_match_finite_differences(model, rng):
    check_gradients_by_differences(model, rng, probes=4)


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_graph_models_on_vulkan_match_the_cpu(model, rng, vulkan_backend):
    check_partial_batch_matches_rows_alone(model, rng, vulkan_backend)


def test_a_residual_block_computes_what_its_explicit_graph_does(rng):
    """Residual((f...)) is the same model as naming its input and adding it back by hand."""
    block = Model(
        input_shape=(6,),
        layers=(Linear(8, name="h"), Residual((Linear(8, activation="tanh"), Linear(8))), Linear(4)),
        loss=CrossEntropy(),
    )
    explicit = Model(
        input_shape=(6,),
        layers=(
            Linear(8, name="h"),
            Linear(8, activation="tanh"),
            Linear(8, name="f"),
            Add(inputs=("f", "h")),
            Linear(4),
        ),
        loss=CrossEntropy(),
    )
    first = plan(layer_spec(block, batch=5)).devices[0]
    second = plan(layer_spec(explicit, batch=5)).devices[0]
    values = list(nudged_parameters(first, rng).values())
    params_a = dict(zip([p.name for p in first.parameters], values, strict=True))
    params_b = dict(zip([p.name for p in second.parameters], values, strict=True))
    x, y = layer_batch(block, 5, rng)
    results = []
    for device, params in ((first, params_a), (second, params_b)):
        backend = CpuBackend(precision="float64")
        backend.open_layout(device.layout)
        results.append(run_train_program(device, backend, params, x, y))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-12)
    for got, want in zip(results[0][1].values(), results[1][1].values(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


DIGITS_RESIDUAL = ROOT / "examples" / "digits_residual.json"


def test_a_residual_mlp_learns_the_digits(vulkan_backend):
    model = Model(
        input_shape=(1, 8, 8),
        layers=(
            Flatten(),
            Linear(48, activation="relu"),
            Repeat(2, (Residual((LayerNorm(), Linear(48, activation="relu"), Linear(48))),)),
            Linear(10),
        ),
        loss=CrossEntropy(),
    )
    check_learns_the_digits(model, vulkan_backend, epochs=4)


def test_the_residual_example_trains_from_the_cli(tmp_path):
    csv = tmp_path / "m.csv"
    out = subprocess.run(
        [sys.executable, "-m", "flow", "run", str(DIGITS_RESIDUAL), "--quiet", "--csv", str(csv)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    lines = csv.read_text().splitlines()
    header = lines[0].split(",")
    accuracy = float(lines[-1].split(",")[header.index("val_accuracy")])
    assert accuracy >= 0.93, lines[-1]

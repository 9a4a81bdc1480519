"""Validation: every problem, with its path; shapes; the pipeline graph; the summary."""

import dataclasses

import pytest

from flow.errors import Problem, SpecError, did_you_mean
from flow.spec import (
    CSV,
    IDX,
    MSE,
    SGD,
    Adam,
    Conv2d,
    Cosine,
    CrossEntropy,
    Data,
    Devices,
    Digits,
    Edge,
    Flatten,
    ImageFolder,
    Linear,
    MaxPool2d,
    Model,
    Node,
    Normalize,
    Pipeline,
    RawBinary,
    RunSettings,
    Softmax,
    Spec,
    Split,
    Synthetic,
    default_pipeline,
)
from flow.summary import summarize
from flow.validation import check, validate


def mlp(**model_changes) -> Spec:
    model = Model(
        input_shape=(1, 8, 8),
        layers=(Flatten(), Linear(32, activation="relu"), Linear(10)),
        loss=CrossEntropy(),
    )
    return Spec(
        model=dataclasses.replace(model, **model_changes),
        optimiser=Adam(3e-3),
        data=Data(Digits(), split=Split(train=0.8, val=0.2)),
    )


def cnn() -> Spec:
    model = Model(
        input_shape=(3, 16, 16),
        layers=(Conv2d(8, 3, padding=1, activation="relu"), MaxPool2d(2), Flatten(), Linear(10)),
        loss=CrossEntropy(),
    )
    return Spec(
        model=model, optimiser=SGD(0.1, momentum=0.9), data=Data(ImageFolder("data/train", size=(16, 16)))
    )


def paths(spec: Spec) -> list[str]:
    return [p.path for p in validate(spec)]


def test_valid_specs_have_no_problems():
    assert validate(mlp()) == []
    assert validate(cnn()) == []
    check(mlp())


def test_check_lists_every_problem_one_per_line():
    spec = dataclasses.replace(
        mlp(layers=(Flatten(), Linear(32), Linear(-3))),
        data=Data(Digits(), batch_size=0),
        devices=Devices(memory_fraction=1.5),
    )
    with pytest.raises(SpecError) as error:
        check(spec)
    assert str(error.value).splitlines() == [
        "model.layers[2].units: must be > 0, got -3",
        "data.batch_size: must be > 0, got 0",
        "devices.memory_fraction: must be in (0, 1], got 1.5",
    ]
    assert error.value.problems[0] == Problem("model.layers[2].units", "must be > 0, got -3")


def test_a_wrong_type_is_one_problem_and_stops_nothing_else():
    spec = dataclasses.replace(mlp(layers=(Flatten(), Linear("32"), Linear(10))), optimiser=Adam(lr=-1.0))
    assert [str(p) for p in validate(spec)] == [
        "model.layers[1].units: must be an int, got '32'",
        "optimiser.lr: must be > 0, got -1.0",
    ]


def test_wrong_objects_and_literals():
    spec = mlp(layers=(Flatten(), "Linear", Linear(10, activation="rleu"), object()), input_dtype="f32")
    problems = [str(p) for p in validate(spec)]
    assert problems[0].startswith("model.layers[1]: must be one of Linear, Conv2d, MaxPool2d")
    assert problems[1] == (
        "model.layers[2].activation: must be one of 'relu', 'leaky_relu', 'sigmoid', 'tanh', 'gelu' or None, "
        "got 'rleu'; did you mean 'relu'?"
    )
    assert problems[2].startswith("model.layers[3]: must be one of Linear")
    assert problems[3].startswith("model.input_dtype: must be one of 'float32'")
    assert len(problems) == 4
    assert paths(dataclasses.replace(mlp(), optimiser=Linear(3))) == ["optimiser"]
    assert paths(dataclasses.replace(mlp(), optimiser=SGD(nesterov=1))) == ["optimiser.nesterov"]


@pytest.mark.parametrize(
    "layers, input_shape, path, words",
    [
        ((Linear(10),), (1, 8, 8), "model.layers[0]", "add Flatten()"),
        ((Flatten(), Conv2d(4, 3), Linear(10)), (1, 8, 8), "model.layers[1]", "(channels, height, width)"),
        (
            (Conv2d(4, 9), Flatten(), Linear(10)),
            (1, 8, 8),
            "model.layers[0]",
            "output size 0x0 is not positive",
        ),
        (
            (Conv2d(4, 3, stride=2), MaxPool2d(4), Flatten(), Linear(10)),
            (1, 8, 8),
            "model.layers[1]",
            "MaxPool2d output size 0x0",
        ),
        ((MaxPool2d(3), Flatten(), Linear(10)), (64,), "model.layers[0]", "got shape (64,)"),
    ],
)
def test_shape_problems(layers, input_shape, path, words):
    problems = validate(mlp(layers=layers, input_shape=input_shape))
    assert len(problems) == 1 and problems[0].path == path and words in problems[0].message


def test_shapes_stop_at_a_broken_layer():
    # Layer 1 is wrong on its own, so layer 3's shape cannot be known and is not reported.
    spec = mlp(layers=(Flatten(), Linear(0), Linear(10)), input_shape=(1, 8, 8))
    assert paths(spec) == ["model.layers[1].units"]


def test_loss_rules():
    assert paths(mlp(loss=None)) == ["model.loss"]
    assert [str(p) for p in validate(mlp(layers=(Flatten(), Linear(1))))] == [
        "model.layers[1]: CrossEntropy needs an output whose last dimension has >= 2 classes, got shape (1,)"
    ]
    assert paths(mlp(layers=(Flatten(), Linear(10), Softmax()))) == ["model.layers[2]"]
    assert validate(mlp(layers=(Flatten(), Linear(10), Softmax()), loss=MSE())) == []
    assert paths(mlp(layers=(), input_shape=(10,))) == ["model.layers"]  # nothing to train


@pytest.mark.parametrize("select", ["auto", "cpu", 0, 3, "H100"])
def test_good_devices(select):
    assert validate(dataclasses.replace(mlp(), devices=Devices(select))) == []


@pytest.mark.parametrize("select", [-1, "", 1.5, None, True])
def test_unknown_devices(select):
    assert paths(dataclasses.replace(mlp(), devices=Devices(select))) == ["devices.select"]


@pytest.mark.parametrize(
    "source, path",
    [
        (ImageFolder(""), "data.source.root"),
        (ImageFolder("x", labels_csv=""), "data.source.labels_csv"),
        (CSV("", label_column="y"), "data.source.path"),
        (CSV("a.csv", label_column=3, feature_columns=(1, 3)), "data.source.feature_columns"),
        (CSV("a.csv", label_column="y", header=False), "data.source.header"),
        (RawBinary("x.bin", dtype="float32", shape=(0, 3)), "data.source.shape"),
        (RawBinary("x.bin", dtype="float23", shape=(3,)), "data.source.dtype"),
        (IDX("images.idx", ""), "data.source.labels"),
        (IDX(None, "labels.idx"), "data.source.images"),
        (Synthetic(samples=10, features=(64,), classes=1), "data.source.classes"),
    ],
)
def test_source_problems(source, path):
    assert paths(dataclasses.replace(mlp(), data=Data(source))) == [path]


def test_source_paths_are_not_checked_on_disk():
    spec = dataclasses.replace(mlp(), data=Data(IDX("/no/such/images", "/no/such/labels")))
    assert validate(spec) == []


def test_optimiser_and_schedule_ranges():
    spec = dataclasses.replace(mlp(), optimiser=Adam(0.0, betas=(0.9, 1.0), eps=0.0))
    assert paths(spec) == ["optimiser.lr", "optimiser.betas", "optimiser.eps"]
    assert paths(dataclasses.replace(mlp(), optimiser=SGD(momentum=1.0))) == ["optimiser.momentum"]
    assert paths(dataclasses.replace(mlp(), optimiser=SGD(nesterov=True))) == ["optimiser.nesterov"]
    cosine = SGD(0.1, schedule=Cosine(100, min_lr=0.5, warmup_steps=100))
    assert paths(dataclasses.replace(mlp(), optimiser=cosine)) == [
        "optimiser.schedule.warmup_steps",
        "optimiser.schedule.min_lr",
    ]
    assert paths(dataclasses.replace(mlp(), optimiser=Adam(float("nan")))) == ["optimiser.lr"]


def test_data_ranges():
    def data_paths(**changes):
        return paths(dataclasses.replace(mlp(), data=Data(Digits(), **changes)))

    assert data_paths(split=Split(train=0.5, val=0.2)) == ["data.split"]
    assert data_paths(split=Split(train=0.5, val=0.5 + 1e-9)) == []
    assert data_paths(split=Split(train=1.2, val=-0.2)) == ["data.split.train", "data.split.val"]
    assert data_paths(split=Split(train=0.0, test=1.0)) == ["data.split.train"]
    assert data_paths(preprocess=(Normalize((0.5, 0.5), (0.5,)),)) == ["data.preprocess[0].std"]
    assert data_paths(augment=(Normalize((0.5,), (0.0,)),)) == ["data.augment[0].std"]
    assert data_paths(batch_size=2.0) == ["data.batch_size"]


def test_run_settings():
    def run_paths(**changes):
        return paths(dataclasses.replace(mlp(), run=RunSettings(**changes)))

    assert run_paths(epochs=None, steps=100) == []
    assert run_paths(epochs=None) == ["run"]
    assert run_paths(epochs=0, in_flight=0) == ["run.epochs", "run.in_flight"]
    assert run_paths(checkpoint_every=10) == ["run.checkpoint_every"]
    assert run_paths(checkpoint_every=10, checkpoint_dir="ck") == []


def pipeline(*edges: Edge) -> Pipeline:
    nodes = (
        Node("load", "loader"),
        Node("gpu", "device", device=0),
        Node("opt", "optimiser"),
        Node("out", "sink"),
    )
    return Pipeline(nodes, edges)


def test_pipeline_problems():
    def problems(p):
        return [str(x) for x in validate(dataclasses.replace(mlp(), pipeline=p))]

    assert problems(pipeline(Edge("load", "gpu"), Edge("gpu", "out"))) == []
    assert problems(pipeline(Edge("load", "gpuu"))) == [
        "pipeline.edges[0].dst: unknown node 'gpuu'; did you mean 'gpu'?"
    ]
    assert problems(pipeline(Edge("load", "gpu", capacity=0), Edge("gpu", "out", capacity=None))) == [
        "pipeline.edges[0].capacity: must be > 0 (channels are always bounded), got 0",
        "pipeline.edges[1].capacity: must be an int, got None",
    ]
    cycle = (Edge("load", "gpu"), Edge("gpu", "opt"), Edge("opt", "gpu"))
    assert problems(pipeline(*cycle)) == [
        "pipeline.edges: cycle gpu -> opt -> gpu has no credit edge; bounded channels in a cycle "
        "can deadlock: mark one of its edges credit=True"
    ]
    assert problems(pipeline(*cycle[:2], Edge("opt", "gpu", credit=True))) == []
    twice = Pipeline((Node("a", "loader"), Node("a", "device")), ())
    assert problems(twice) == ["pipeline.nodes[1].name: duplicate node name 'a'"]
    assert problems(Pipeline((Node("a", "lodaer"),), ())) == [
        "pipeline.nodes[0].node_kind: must be one of 'loader', 'preprocess', 'device', 'optimiser', "
        "'sink', 'broadcast', got 'lodaer'; did you mean 'loader'?"
    ]


def test_default_pipeline_is_valid():
    spec = cnn()
    assert validate(dataclasses.replace(spec, pipeline=default_pipeline(spec))) == []


def test_not_a_spec():
    assert [str(p) for p in validate({"model": 1})] == ["must be a Spec, got {'model': 1}"]


def test_summarize():
    text = summarize(cnn())
    assert "[0] Conv2d(8, 3, padding=1, activation='relu')  (8, 16, 16)" in text
    assert "[2] Flatten()" in text and "(512,)" in text
    # 3*8*9 + 8 = 224 and 512*10 + 10 = 5130 parameters, 4 bytes each.
    assert "parameters: 5,354 (21,416 bytes as float32)" in text


def test_mse_needs_one_target_per_output_from_the_data():
    from flow.data_plan import data_problems

    ten = mlp(loss=MSE())
    (problem,) = data_problems(ten, (1, 8, 8), 10)
    assert problem == Problem(
        "model.loss",
        "MSE needs one target per output, but the model ends in 10 outputs and the source gives one "
        "label a sample (class ids of 10 classes); for class labels use CrossEntropy()",
    )
    (problem,) = data_problems(ten, (1, 8, 8), None, (3,))
    assert "gives 3 labels a sample (targets)" in problem.message and "CrossEntropy" not in problem.message
    assert data_problems(ten, (1, 8, 8), None, (10,)) == []  # one target per output
    one = mlp(layers=(Flatten(), Linear(1)), loss=MSE())
    assert data_problems(one, (1, 8, 8), None) == []  # a regression target
    assert data_problems(one, (1, 8, 8), 10) == []  # integer targets for one output: regression too
    assert data_problems(mlp(), (1, 8, 8), 10) == []  # CrossEntropy takes class ids


def test_one_did_you_mean_for_every_unknown_name():
    """Unknown kinds, keys, literals and node names share one hint (flow.errors.did_you_mean)."""
    assert did_you_mean("rleu", ("relu", "tanh")) == "; did you mean 'relu'?"
    assert did_you_mean("zzz", ("relu", "tanh")) == ""
    assert did_you_mean(None, ("relu",)) == did_you_mean(3, ("3",)) == ""  # only a string is a name
    assert did_you_mean("rleu", (None, 1, "relu")) == "; did you mean 'relu'?"  # a Literal's non-strings

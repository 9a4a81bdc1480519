"""Spec records, their documentation (``help`` describes every field, and states the input
convention), the default pipeline and shape inference (the learning-rate schedules are in
test_optim.py)."""

import dataclasses
import pydoc
from dataclasses import fields

import pytest

import flow.spec
from flow.errors import SpecError
from flow.shapes import count_parameters, infer_shapes, layer_parameters
from flow.spec import (
    RECORDS,
    SGD,
    Adam,
    AdamW,
    Conv2d,
    CrossEntropy,
    Data,
    Digits,
    Flatten,
    ImageFolder,
    Linear,
    MaxPool2d,
    Model,
    ReLU,
    RunSettings,
    Spec,
    default_pipeline,
)
from flow.validation import validate


def test_positional_first_argument_and_defaults():
    layer = Linear(128, activation="relu")
    assert (layer.units, layer.bias, layer.activation) == (128, True, "relu")
    conv = Conv2d(16, 3, padding=1)
    assert (conv.channels, conv.kernel, conv.stride, conv.padding) == (16, 3, 1, 1)
    assert MaxPool2d(2).stride is None
    assert AdamW().weight_decay == 0.01 and Adam().weight_decay == 0.0
    with pytest.raises(TypeError):
        Linear(128, True)  # everything after the first argument is keyword-only


def test_records_are_frozen_hashable_and_lists_become_tuples():
    model = Model(input_shape=[1, 8, 8], layers=[Flatten(), Linear(10)], loss=CrossEntropy())
    assert model.input_shape == (1, 8, 8) and isinstance(model.layers, tuple)
    assert model == Model(input_shape=(1, 8, 8), layers=(Flatten(), Linear(10)), loss=CrossEntropy())
    assert hash(model) == hash(
        Model(input_shape=(1, 8, 8), layers=(Flatten(), Linear(10)), loss=CrossEntropy())
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.loss = None


def _spec(**changes) -> Spec:
    model = Model(input_shape=(3, 8, 8), layers=(Flatten(), Linear(10)), loss=CrossEntropy())
    return Spec(model=model, optimiser=SGD(), data=Data(Digits()), **changes)


def test_default_pipeline():
    spec = _spec(run=RunSettings(in_flight=3))
    pipeline = default_pipeline(spec)
    assert [(n.name, n.kind) for n in pipeline.nodes] == [
        ("loader", "loader"),
        ("preprocess", "preprocess"),
        ("device", "device"),
        ("optimiser", "optimiser"),
        ("sink", "sink"),
    ]
    edges = {(e.src, e.dst): e.capacity for e in pipeline.edges}
    assert edges == {
        ("loader", "preprocess"): 4,
        ("preprocess", "device"): 3,
        ("device", "optimiser"): 4,
        ("device", "sink"): 4,
    }
    assert ("optimiser", "device") not in edges  # the update runs inside the device's step
    assert validate(dataclasses.replace(spec, pipeline=pipeline)) == []
    folder = dataclasses.replace(spec, data=Data(ImageFolder("imgs", workers=6)))
    assert default_pipeline(folder).nodes[0].workers == 6


def test_infer_shapes_and_parameters_of_a_cnn():
    model = Model(
        input_shape=(3, 32, 32),
        layers=(
            Conv2d(8, 3, padding=1, activation="relu"),  # (8, 32, 32): 3*8*9 + 8 = 224
            MaxPool2d(2),  # (8, 16, 16)
            Conv2d(16, 5, stride=2, bias=False),  # (16, 6, 6): 8*16*25 = 3200
            MaxPool2d(3, stride=1),  # (16, 4, 4)
            Flatten(),  # (256,)
            Linear(10),  # 2570
            ReLU(),
        ),
        loss=CrossEntropy(),
    )
    assert infer_shapes(model) == [(8, 32, 32), (8, 16, 16), (16, 6, 6), (16, 4, 4), (256,), (10,), (10,)]
    assert count_parameters(model) == 224 + 3200 + 2570
    assert layer_parameters(Linear(5, bias=False), (4,)) == 20


def test_infer_shapes_names_the_layer_that_does_not_fit():
    model = Model(input_shape=(1, 8, 8), layers=(Flatten(), Linear(4), Conv2d(2, 3)), loss=None)
    with pytest.raises(SpecError) as error:
        infer_shapes(model)
    assert str(error.value) == (
        "model.layers[2]: Conv2d needs a (channels, height, width) input, got shape (4,)"
    )


def test_help_of_scale_states_the_input_convention():
    text = pydoc.render_doc(flow.spec.Scale, renderer=pydoc.plaintext)
    assert "[0, 1]" in text and "Scale(1/255)" in text and "trains at chance" in text
    assert "8-bit data is divided by 255" in flow.spec.__doc__


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.__name__)
def test_every_spec_record_documents_each_field(record):
    """help() shows a dataclass's docstring, so each field is described in its Attributes."""
    doc = record.__doc__ or ""
    assert doc and not doc.startswith(f"{record.__name__}("), "no docstring of its own"
    # Fields a base record declares (every layer's name and inputs) are documented by that base.
    inherited = {name for base in record.__mro__[1:] for name in getattr(base, "__dataclass_fields__", {})}
    names = [f.name for f in fields(record) if f.name != "_" and f.name not in inherited]
    if names:
        attributes = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
        missing = [name for name in names if f"\n        {name}: " not in attributes]
        assert not missing, f"{record.__name__} does not document {missing}"

"""What ``flow.predict`` and ``PipelineHandle.feed`` take as inputs (flow.inputs): a batch or one
sample of real numbers; bools and ints are cast to float32 and predict exactly what the same floats
predict; anything else is refused at the call, before a device is opened, naming the shape the model
takes."""

from __future__ import annotations

import numpy as np
import pytest

from actors.cpu_backend import CpuBackend
from flow.inference import predict
from flow.inputs import as_inputs, batch_bounds
from flow.runner import open_pipeline
from flow.spec import SGD, CrossEntropy, Data, Devices, Linear, Model, RunSettings, Spec, Synthetic

SHAPE_WORDS = "[n, 4] (a batch) or [4] (one sample)"


def small_spec() -> Spec:
    return Spec(
        model=Model(input_shape=(4,), layers=(Linear(3),), loss=CrossEntropy()),
        optimiser=SGD(0.1),
        data=Data(Synthetic(samples=16, features=(4,), classes=3), batch_size=8),
        devices=Devices("cpu"),
        run=RunSettings(epochs=1),
    )


@pytest.mark.parametrize(
    "data, error, words",
    [
        (np.zeros(5, np.float32), ValueError, f"predict takes inputs of shape {SHAPE_WORDS}, got shape (5,)"),
        (np.zeros((2, 5)), ValueError, "got shape (2, 5)"),
        (np.zeros((2, 2, 4)), ValueError, "got shape (2, 2, 4)"),
        (3.0, ValueError, f"predict takes inputs of shape {SHAPE_WORDS}, got shape ()"),
        (None, TypeError, f"predict takes an array of shape {SHAPE_WORDS}, got NoneType"),
        ("1,2,3,4", TypeError, "got str"),
        (np.array([["a", "b", "c", "d"]]), TypeError, "predict takes numbers, got an array of <U1"),
        ([[1, 2, 3, 4], [1, 2]], ValueError, f"{SHAPE_WORDS}; these inputs make no array"),
        (np.ones((2, 4), np.complex64), TypeError, "predict takes real inputs, got complex (complex64)"),
    ],
    ids=["1-D", "features", "3-D", "scalar", "None", "text", "strings", "ragged", "complex"],
)
def test_bad_inputs_are_refused_at_the_call_with_the_shape_expected(monkeypatch, data, error, words):
    opened = []
    monkeypatch.setattr("flow.inference.open_backend", lambda devices: opened.append(devices))
    for stream in (False, True):  # a stream fails at the call too, not at its first item
        with pytest.raises(error) as caught:
            predict(small_spec(), data, stream=stream)
        assert words in str(caught.value)
    assert opened == []  # refused before any device


def test_bools_and_ints_predict_what_the_same_floats_predict(rng):
    spec = small_spec()
    ints = rng.integers(-3, 4, (11, 4))
    expected = predict(spec, ints.astype(np.float32), backend=CpuBackend())
    assert expected.shape == (11, 3)
    for dtype in (np.int8, np.int16, np.int32, np.int64):
        assert np.array_equal(predict(spec, ints.astype(dtype), backend=CpuBackend()), expected)
    assert np.array_equal(predict(spec, ints.tolist(), backend=CpuBackend()), expected)  # nested lists
    flags = ints > 0
    assert np.array_equal(
        predict(spec, flags, backend=CpuBackend()),
        predict(spec, flags.astype(np.float32), backend=CpuBackend()),
    )
    one = predict(spec, ints[0], backend=CpuBackend())  # one sample [4] is a batch of one
    assert one.shape == (1, 3) and np.array_equal(one, expected[:1])


def test_float32_inputs_are_not_copied_and_others_become_float32(rng):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    assert as_inputs(x, (4,)) is x
    wide = as_inputs(x.astype(np.float64), (4,))
    assert wide.dtype == np.float32 and np.array_equal(wide, x)
    assert as_inputs(np.zeros((0, 4)), (4,)).shape == (0, 4)  # predict gives [0, outputs] for none
    big = as_inputs(np.array([[2**24 + 1, 0, 0, 0]], np.int64), (4,))
    assert big[0, 0] == np.float32(2**24)  # rounded as numpy and torch's .float() round it


async def test_feed_refuses_what_predict_refuses():
    async with open_pipeline(small_spec(), mode="predict", backend=CpuBackend()) as p:
        with pytest.raises(TypeError, match="feed takes real inputs, got complex"):
            await p.feed(np.ones((2, 4), np.complex128))
        with pytest.raises(ValueError, match=r"feed takes at least one sample of shape \[n, 4\]"):
            await p.feed(np.zeros((0, 4)))
        with pytest.raises(ValueError, match=r"got shape \(5,\)"):
            await p.feed(np.zeros(5))
        out = await p.predict(np.ones((2, 4), np.int32))
    assert out.shape == (2, 3)


def test_predict_and_feed_cut_inputs_into_the_same_batches():
    assert list(batch_bounds(0, 8)) == []
    assert list(batch_bounds(8, 8)) == [(0, 8)]
    assert list(batch_bounds(19, 8)) == [(0, 8), (8, 16), (16, 19)]  # the last holds what is left

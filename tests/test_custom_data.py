"""Data and transforms from Python: a ``Custom`` source over any object with ``__len__`` and
``read(indices)``, and ``Lambda`` transforms, each run by ``flow.run(spec)``. The oracle is the
same data through the built-in ``Arrays`` source and ``Normalize``: the same training, step for step.
A spec holding either cannot be saved, and says so."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_loaders_arrays import arrays_spec, digits_arrays

import flow
from actors.cpu_backend import CpuBackend
from flow.errors import SpecError
from flow.spec import Arrays, Custom, Lambda, Linear, Normalize, RunSettings
from flow.validation import validate
from loaders import LoaderError


class DigitsReader:
    """What a user might write: a dataset object that reads samples by index (uint8 images)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y, self.reads = x, y, 0

    def __len__(self) -> int:
        return len(self.y)

    def read(self, indices):
        self.reads += 1
        return self.x[indices], self.y[indices]


def test_a_custom_source_trains_exactly_as_the_same_arrays():
    x, y = digits_arrays()
    reader = DigitsReader(x, y)
    custom = flow.run(arrays_spec(Custom(reader), epochs=4), backend=CpuBackend())
    oracle = flow.run(arrays_spec(Arrays(x, y), epochs=4, placement="host"), backend=CpuBackend())
    assert reader.reads > custom.steps  # every batch came through read(indices)
    assert custom.accuracy > 0.9 and custom.accuracy == oracle.accuracy
    for name, weights in oracle.parameters.items():
        np.testing.assert_array_equal(custom.parameters[name], weights, err_msg=name)


def test_a_custom_source_on_vulkan_learns_the_digits(vulkan_backend):
    x, y = digits_arrays()
    result = flow.run(arrays_spec(Custom(DigitsReader(x, y), name="digits reader")), backend=vulkan_backend)
    assert result.accuracy > 0.9


def test_a_lambda_transform_is_the_same_as_the_built_in_one():
    x, y = digits_arrays()
    spec = arrays_spec(Arrays(x, y), epochs=3, placement="host")
    built_in = flow.run(spec, backend=CpuBackend())
    as_lambda = replace(spec, data=replace(spec.data, preprocess=(Lambda(lambda b: (b - 0.5) / 0.5),)))
    result = flow.run(as_lambda, backend=CpuBackend())
    for name, weights in built_in.parameters.items():
        np.testing.assert_allclose(result.parameters[name], weights, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_lambda_may_reshape_and_a_random_one_draws_from_the_batch_generator():
    x, y = digits_arrays()
    drawn = []

    def noise(batch, rng):
        drawn.append(type(rng).__name__)
        return batch + rng.normal(0.0, 0.05, batch.shape)

    flat = Lambda(lambda b: b.reshape(len(b), -1), name="flatten")
    spec = arrays_spec(Arrays(x, y), epochs=4, placement="host")
    spec = replace(
        spec,
        model=replace(spec.model, input_shape=(64,), layers=(Linear(64, activation="relu"), Linear(10))),
        data=replace(
            spec.data, preprocess=(Normalize((0.5,), (0.5,)), flat), augment=(Lambda(noise, random=True),)
        ),
    )
    first, again = (flow.run(spec, backend=CpuBackend()) for _ in range(2))
    assert set(drawn) == {"Generator"} and first.accuracy > 0.9
    for name, weights in first.parameters.items():  # seeded per batch: the same draws each run
        np.testing.assert_array_equal(again.parameters[name], weights, err_msg=name)


def test_a_spec_holding_python_objects_cannot_be_saved(tmp_path):
    x, y = digits_arrays()
    custom = arrays_spec(Custom(DigitsReader(x, y)))
    refused = r"data\.source\.source: holds a Python object \(.*DigitsReader.*np\.savez"
    with pytest.raises(SpecError, match=refused):
        flow.save(custom, tmp_path / "spec.json")
    in_files = replace(custom.data, source=Arrays(path="d.npz"), augment=(Lambda(abs),))
    with_lambda = replace(custom, data=in_files)
    refused = r"data\.augment\[0\]\.fn: holds a Python function .*built-in transforms"
    with pytest.raises(SpecError, match=refused):
        flow.dumps(with_lambda)
    assert not (tmp_path / "spec.json").exists()
    # Nor can it write checkpoints, which hold the spec: refused before the run opens anything.
    saving = replace(custom, run=RunSettings(epochs=1, checkpoint_dir=str(tmp_path / "runs")))
    assert [str(p) for p in validate(saving)] == [
        "run.checkpoint_dir: cannot be written: a checkpoint holds its spec, and data.source is data or a "
        "function in memory, which a file cannot hold (set checkpoint_dir=None, or use data in files)"
    ]


def test_an_object_that_breaks_the_contract_is_named():
    x, y = digits_arrays()
    spec = arrays_spec(Custom([1, 2, 3]))  # a list has a length but no read
    assert any(str(p).startswith("data.source.source: must be an object with __len__ and read(indices)")
               for p in validate(spec))  # fmt: skip
    short = DigitsReader(x, y)
    short.read = lambda indices: (x[indices][:, :, :4], y[indices])  # cropped: not the first read's shape
    short.read = _after_first(short.read, DigitsReader(x, y).read)
    wrong = r"bad reader: read\(\[0, 1, 2, 3\], \.\.\.\): x must be \[1797, \*\(1, 8, 8\)\] real numbers"
    with pytest.raises(LoaderError, match=wrong):
        flow.run(replace(spec, data=replace(spec.data, source=Custom(short, name="bad reader"))),
                 backend=CpuBackend())  # fmt: skip
    flat = Lambda(lambda b: b[:, :0])  # drops the channel axis's only channel
    spec = arrays_spec(Arrays(x, y), epochs=1, placement="host")
    with pytest.raises(flow.ActorError, match=r"samples of shape \(0, 8, 8\) after preprocessing"):
        flow.run(replace(spec, data=replace(spec.data, preprocess=(flat,))), backend=CpuBackend())


def _after_first(later, first):
    """A read that answers the first call (the source's probe) with ``first``, then with ``later``."""
    calls = []

    def read(indices):
        calls.append(1)
        return (first if len(calls) == 1 else later)(indices)

    return read

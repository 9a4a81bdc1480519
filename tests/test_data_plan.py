"""flow.data_plan: where the data lives. A dataset the source can hand over whole is kept on the
device when it fits: uploaded once as stored (8-bit data stays uint8), each step gathering its
batch by index with Scale/Normalize fused. Driven through flow.plan and flow.run on IDX files
written to disk and on Synthetic data, on the CPU backend and on Vulkan (lavapipe in CI)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from conftest import relative_error

import flow
from actors.cpu_backend import CpuBackend
from actors.messages import Batch
from actors.meter import Hooks
from flow.data_plan import fused_affine, header_of
from flow.errors import PlanError
from flow.spec import (
    IDX,
    MSE,
    SGD,
    CrossEntropy,
    Data,
    Flatten,
    HorizontalFlip,
    Linear,
    Model,
    Normalize,
    RunSettings,
    Scale,
    Spec,
    Split,
    Synthetic,
)
from loaders import open_source, write_idx


def idx_files(tmp_path, rng, samples: int = 300):
    """A small MNIST-shaped set on disk: uint8 images whose mean brightness says the class."""
    labels = rng.integers(0, 4, samples).astype(np.uint8)
    images = rng.integers(0, 120, (samples, 9, 7)).astype(np.int64) + labels[:, None, None] * 40
    write_idx(tmp_path / "images.idx", np.clip(images, 0, 255).astype(np.uint8))
    write_idx(tmp_path / "labels.idx", labels)
    return IDX(str(tmp_path / "images.idx"), str(tmp_path / "labels.idx"))


def mlp_spec(source, placement: str = "auto", preprocess=(), **run) -> Spec:
    shape = (1, 9, 7) if isinstance(source, IDX) else (12,)  # IDX images come as one channel
    return Spec(
        model=Model(input_shape=shape,
                    layers=(Flatten(), Linear(24, activation="relu"), Linear(4)), loss=CrossEntropy()),
        optimiser=SGD(lr=0.05, momentum=0.9),
        data=Data(source, batch_size=32, split=Split(train=0.8, val=0.2), preprocess=preprocess,
                  placement=placement),
        run=RunSettings(epochs=2, **run),
    )  # fmt: skip


def test_scale_and_normalize_fuse_into_one_affine_map_per_channel(rng):
    x = rng.integers(0, 256, (5, 3, 4, 2)).astype(np.uint8)
    transforms = (Scale(1.7), Normalize((0.1, 0.5, -0.2), (2.0, 0.25, 1.5)), Scale(0.9))
    affine = np.asarray(fused_affine(1 / 255, transforms, (3, 4, 2)), np.float64).reshape(3, 2)
    expected = x.astype(np.float64) / 255 * 1.7
    mean, std = np.array([0.1, 0.5, -0.2]).reshape(1, 3, 1, 1), np.array([2.0, 0.25, 1.5]).reshape(1, 3, 1, 1)
    expected = (expected - mean) / std
    expected *= 0.9
    fused = x * affine[:, 0].reshape(1, 3, 1, 1) + affine[:, 1].reshape(1, 3, 1, 1)
    assert relative_error(fused, expected) < 1e-6
    assert fused_affine(1.0, (HorizontalFlip(),), (3, 4, 2)) is None  # not an affine map


def test_the_plan_keeps_data_on_the_device_where_it_can(tmp_path, rng):
    source = idx_files(tmp_path, rng)
    header = header_of(open_source(source))
    assert header.stored_dtype == "uint8"
    planned = flow.plan(mlp_spec(source), header=header)
    on_device = planned.as_dict()["data"]["on_device"]
    assert on_device["dtype"] == "uint8" and on_device["bytes"] == 300 * 9 * 7
    assert on_device["affine"] == pytest.approx([1 / 255, 0.0])
    assert planned.devices[0].program("train").steps[0].op == "gather_rows"
    assert planned.devices[0].program("predict").steps[0].op != "gather_rows"  # fed arrays
    # Streamed: asked for, or over the budget (auto falls back; "device" says why not).
    assert flow.plan(mlp_spec(source, "host"), header=header).data.resident is None
    budget = planned.devices[0].memory.total - 1000
    assert flow.plan(mlp_spec(source), header=header, budget=budget).data.resident is None
    with pytest.raises(PlanError, match="memory budget"):
        flow.plan(mlp_spec(source, "device"), header=header, budget=budget)
    flipped = dataclasses.replace(mlp_spec(source, "device"), data=dataclasses.replace(
        mlp_spec(source).data, placement="device", augment=(HorizontalFlip(),)))  # fmt: skip
    with pytest.raises(PlanError, match="data.placement: 'device' asked for, but augmentations"):
        flow.plan(flipped, header=header)
    regression = dataclasses.replace(mlp_spec(source), model=dataclasses.replace(
        mlp_spec(source).model, layers=(Flatten(), Linear(1)), loss=MSE()))  # fmt: skip
    assert flow.plan(regression, header=header).data.resident is None


@pytest.mark.parametrize("placement_backend", ["cpu", "vulkan"])
def test_a_run_on_device_data_trains_as_the_streamed_run(tmp_path, rng, vulkan_backend, placement_backend):
    """Same steps, evaluations and weights within float32 tolerance (the device applies the
    preprocessing as one fused multiply-add, the host as a chain), on uint8 IDX data with a
    Normalize, and the resident run's metrics and result say what it saw."""
    backend = CpuBackend() if placement_backend == "cpu" else vulkan_backend
    source = idx_files(tmp_path, rng)
    preprocess = (Normalize((0.3,), (0.4,)),)
    results, arrived = {}, {}
    for placement in ("auto", "host"):
        spec = mlp_spec(source, placement, preprocess, metrics_file=str(tmp_path / f"{placement}.jsonl"))
        seen = arrived[placement] = BatchesAtTheDevice()
        results[placement] = flow.run(spec, backend=backend, hooks=[seen])
    on_device, streamed = results["auto"], results["host"]
    assert on_device.steps == streamed.steps == 16
    assert [e.samples for e in on_device.evals] == [e.samples for e in streamed.evals] == [60, 60]
    for a, b in zip(on_device.evals, streamed.evals, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-4)
    for name, value in streamed.parameters.items():
        assert relative_error(on_device.parameters[name], value) < 1e-4, name
    assert on_device.evals[-1].accuracy > 0.5  # four classes by brightness: learnt, not chance
    assert on_device.inputs.min == pytest.approx(streamed.inputs.min, abs=1e-6)
    assert on_device.inputs.mean == pytest.approx(streamed.inputs.mean, rel=1e-5)
    lines = [json.loads(line) for line in (tmp_path / "auto.jsonl").read_text().splitlines()]
    assert any(line.get("event") == "inputs" for line in lines)
    # On the device run every batch reached the device as indices alone; streamed, as rows.
    assert arrived["auto"].kinds == {"indices"} and arrived["host"].kinds == {"rows"}
    assert arrived["auto"].count == arrived["host"].count == 16 + 2 * 2


class BatchesAtTheDevice(Hooks):
    """Whether the batches the device receives carry rows or only sample indices."""

    def __init__(self) -> None:
        self.kinds: set[str] = set()
        self.count = 0

    async def received(self, actor, item) -> None:
        if actor == "device" and isinstance(item, Batch):
            self.kinds.add("indices" if item.x is None else "rows")
            self.count += 1


def test_synthetic_data_kept_on_the_device_resumes_bit_exactly(tmp_path, vulkan_backend):
    """A resident run interrupted and resumed gives the same bits as one run straight through (the
    same programs in the same order)."""
    spec = mlp_spec(Synthetic(samples=400, features=(12,), classes=4), checkpoint_dir=str(tmp_path / "a"),
                    checkpoint_every=7)  # fmt: skip
    straight = flow.run(dataclasses.replace(spec, run=dataclasses.replace(spec.run, checkpoint_dir=None,
                                                                            checkpoint_every=None)),
                        backend=vulkan_backend)  # fmt: skip
    short = dataclasses.replace(spec, run=dataclasses.replace(spec.run, epochs=None, steps=14))
    flow.run(short, backend=vulkan_backend)
    resumed = flow.run(spec, resume=tmp_path / "a", backend=vulkan_backend)
    assert resumed.resumed_from == 14 and resumed.steps == straight.steps
    for name, value in straight.parameters.items():
        np.testing.assert_array_equal(resumed.parameters[name], value, err_msg=name)

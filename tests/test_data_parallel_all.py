"""Every device at once (issue 14's heterogeneous run): ``Devices("all")`` trains over each Vulkan
device and the CPU backend together, equal to the first device alone with the same global batch.
In CI that is lavapipe and the CPU backend; on a GPU machine with lavapipe beside it, the GPU,
lavapipe and the CPU backend (the three kinds of member at once)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import flow
from actors import device_select
from flow.spec import Devices
from tests.specs import synthetic_spec


def _on(spec, select):
    # Every member kept: the planner would leave out members not worth this tiny model's all-reduce.
    return dataclasses.replace(spec, devices=Devices(select, drop_slow=False))


def test_every_device_at_once_trains_as_the_first_device_alone(vulkan_backend):
    listed, _ = device_select.every_device()
    assert len(listed) >= 2 and listed[-1].name == "cpu (numpy)"
    spec = synthetic_spec(epochs=2)
    one = flow.run(_on(spec, listed[0].index))
    every = flow.run(_on(spec, "all"))
    names = tuple(facts.name for facts in listed)
    assert every.device == " + ".join(names) and every.steps == one.steps
    for name, value in one.parameters.items():
        np.testing.assert_allclose(every.parameters[name], value, rtol=1e-3, atol=1e-4, err_msg=name)
    assert every.accuracy == pytest.approx(one.accuracy, abs=0.02)
    # Every member did its share of every global batch, and was timed doing it.
    device = every.statistics["device"]
    assert device.members == names
    assert all(rows > 0 for rows in device.member_rows), device.member_rows
    assert all(speed > 0 for speed in device.member_samples_per_s)

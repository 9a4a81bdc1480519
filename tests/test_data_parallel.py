"""Data parallelism over several devices (flow.parallel_plan, actors.data_parallel): the split of
each batch, training equal to one device's with the same global batch, identical weights on every
member, exact resume, the CLI example, and a failing member stopping the run."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import numpy as np
import pytest

import flow
from actors.cpu_backend import cpu_facts
from flow.errors import PlanError, SpecError
from flow.parallel_plan import plan_data_parallel, split_rows
from flow.planning import plan
from flow.spec import Devices
from tests.specs import ROOT, digits_spec, synthetic_spec


def _on(spec, select, shares=None, **run):
    spec = dataclasses.replace(spec, devices=Devices(select, shares=shares))
    return dataclasses.replace(spec, run=dataclasses.replace(spec.run, **run)) if run else spec


# -- the split -------------------------------------------------------------------------------------


def test_split_rows_follows_the_weights_and_keeps_every_device_in_use(rng):
    for _ in range(200):
        members = int(rng.integers(1, 5))
        weights = tuple(float(w) for w in rng.uniform(0.01, 10, members))
        total = int(rng.integers(0, 300))
        rows = split_rows(total, weights)
        assert sum(rows) == total and len(rows) == members
        if total >= members:
            assert min(rows) >= 1
        exact = np.array(weights) * total / sum(weights)
        assert np.all(np.abs(np.array(rows) - exact) < 1.0 + (total >= members) * members)
    assert split_rows(10, (1.0, 1.0, 1.0)) == (4, 3, 3)
    assert split_rows(256, (3.0, 1.0)) == (192, 64)
    assert split_rows(100, (1000.0, 1.0)) == (99, 1)  # the slow device still takes a row


def test_a_partial_batch_never_passes_a_members_capacity(rng):
    group = (cpu_facts(),) * 3
    for batch in (7, 10, 64, 65):
        parallel = plan_data_parallel(group, batch, None)
        assert parallel.basis == "equal" and parallel.update == "each"
        for rows in range(batch + 1):
            shard = parallel.shard(rows)
            assert sum(shard) == rows and all(s <= c for s, c in zip(shard, parallel.capacity, strict=True))
    uneven = plan_data_parallel((cpu_facts(),) * 2, 50, (3.0, 1.0))
    assert uneven.basis == "spec" and uneven.rows == (38, 12) == uneven.capacity


def test_unequal_devices_are_measured_and_the_leader_updates(vulkan_backend):
    spec = _on(digits_spec(), (vulkan_backend.facts.index, "cpu"))
    the_plan = plan(spec, facts=(vulkan_backend.facts, cpu_facts()))
    parallel = the_plan.parallel
    assert parallel.basis == "to measure" and parallel.update == "leader" and parallel.capacity == (64, 64)
    assert [d.batch_size for d in the_plan.devices] == [64, 64]
    # Each member's train program stops at the gradients; the update is its own program.
    for device in the_plan.devices:
        assert device.kinds[-1] == "apply" and [s.op for s in device.apply.launches] == ["adam"]
        assert "adam" not in [s.op for s in device.program("train").launches]
    # Measured: each member records its programs for its own share only.
    measured = plan(spec, facts=(vulkan_backend.facts, cpu_facts()), speeds=(3000.0, 1000.0))
    assert measured.parallel.rows == (48, 16) == measured.parallel.capacity
    assert measured.parallel.basis == "measured"
    assert [d.batch_size for d in measured.devices] == [48, 16]


def test_bad_device_lists_are_refused_with_their_place():
    spec = digits_spec()
    with pytest.raises(SpecError) as caught:
        plan(_on(spec, ("auto", 0), shares=(1.0,)))
    text = str(caught.value)
    assert "devices.select[0]: 'auto' stands alone" in text and "devices.shares: has 1 entries for 2" in text
    with pytest.raises(SpecError, match=r"devices.shares\[1\]: must be > 0"):
        plan(_on(spec, ("cpu", "cpu"), shares=(1.0, 0.0)))
    with pytest.raises(PlanError, match="data.placement"):
        plan(_on(dataclasses.replace(spec, data=dataclasses.replace(spec.data, placement="device")),
                 ("cpu", "cpu")), facts=(cpu_facts(), cpu_facts()))  # fmt: skip


# -- training --------------------------------------------------------------------------------------


def test_two_cpu_devices_train_as_one_device_with_the_same_batch():
    """The same global batch over two members: the same training within float tolerance (the
    members' weight gradients sum their rows in another order), reproducible to the bit."""
    spec = synthetic_spec(epochs=2)
    one = flow.run(_on(spec, "cpu"))
    two = flow.run(_on(spec, ("cpu", "cpu")))
    again = flow.run(_on(spec, ("cpu", "cpu")))
    assert two.steps == one.steps == 26 and two.device == "cpu (numpy) + cpu (numpy)"
    for name, value in one.parameters.items():
        np.testing.assert_allclose(two.parameters[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
        np.testing.assert_array_equal(again.parameters[name], two.parameters[name], err_msg=name)
    assert two.loss == pytest.approx(one.loss, rel=1e-4)
    assert two.accuracy == pytest.approx(one.accuracy, abs=1e-9)
    uneven = flow.run(_on(spec, ("cpu", "cpu", "cpu"), shares=(1.0, 2.0, 5.0)))
    for name, value in one.parameters.items():
        np.testing.assert_allclose(uneven.parameters[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    # Each member's share of the rows, as the shares say (train and validation batches of 16).
    device = uneven.statistics["device"]
    assert device.members == ("cpu (numpy)",) * 3 and device.all_reduce_seconds > 0
    rows = device.member_rows
    assert sum(rows) == 2 * 250 and rows[0] < rows[1] < rows[2]
    assert all(speed > 0 for speed in device.member_samples_per_s)


def test_lavapipe_twice_and_lavapipe_with_the_cpu_train_as_one_device(vulkan_backend):
    index = vulkan_backend.facts.index
    spec = _on(synthetic_spec(epochs=2), index)
    one = flow.run(spec)
    for select in ((index, index), (index, "cpu")):
        many = flow.run(_on(spec, select))
        assert many.steps == one.steps
        for name, value in one.parameters.items():
            np.testing.assert_allclose(many.parameters[name], value, rtol=1e-3, atol=1e-4, err_msg=name)
        assert many.accuracy == pytest.approx(one.accuracy, abs=0.02)


def _member_weights(spec) -> tuple[str, list[np.ndarray]]:
    """Train ``spec``; the plan's update rule and every member's final weights."""
    from flow.runtime import Runtime

    kept = {}
    original = Runtime.close

    def close(self):
        kept["weights"] = [engine.weights() for engine in self.member_engines]
        kept["update"] = self.plan.parallel.update
        original(self)

    Runtime.close = close
    try:
        flow.run(spec)
    finally:
        Runtime.close = original
    return kept["update"], kept["weights"]


@pytest.mark.parametrize("update", ["each", "leader"])
def test_every_member_holds_the_same_weights(vulkan_backend, update):
    """After training, every member's weights are bit-identical: same devices apply the same
    update; unequal ones take the leader's weights."""
    index = vulkan_backend.facts.index
    select = (index, index) if update == "each" else (index, "cpu")
    planned, weights = _member_weights(_on(synthetic_spec(epochs=1), select))
    assert planned == update and len(weights) == 2
    np.testing.assert_array_equal(weights[1], weights[0])
    assert np.abs(weights[0]).sum() > 0


def test_resume_with_two_devices_is_bit_exact(tmp_path):
    spec = _on(synthetic_spec(tmp_path, epochs=3), ("cpu", "cpu"), checkpoint_every=5)
    straight = flow.run(_on(synthetic_spec(epochs=3), ("cpu", "cpu")))
    flow.run(dataclasses.replace(spec, run=dataclasses.replace(spec.run, epochs=None, steps=15)))
    resumed = flow.run(spec, resume=tmp_path / "ckpt")
    assert resumed.resumed_from == 15 and resumed.steps == straight.steps == 39
    for name, value in straight.parameters.items():
        np.testing.assert_array_equal(resumed.parameters[name], value, err_msg=name)


def test_a_failing_member_stops_the_run_with_its_error(monkeypatch):
    from actors.cpu_backend import CpuBackend

    opened = []
    original_init = CpuBackend.__init__

    def track(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        opened.append(self)

    reads = {"n": 0}
    original_read = CpuBackend.read_into

    def read_into(self, name, out, *args, **kwargs):
        if name == "grads:all" and self is opened[1]:
            reads["n"] += 1
            if reads["n"] == 4:
                raise RuntimeError("device lost")
        return original_read(self, name, out, *args, **kwargs)

    monkeypatch.setattr(CpuBackend, "__init__", track)
    monkeypatch.setattr(CpuBackend, "read_into", read_into)
    with pytest.raises(Exception, match="device lost") as caught:
        flow.run(_on(synthetic_spec(epochs=2), ("cpu", "cpu")))
    assert "device" in str(caught.value)


def test_predict_with_a_data_parallel_spec_uses_the_first_device(tmp_path):
    spec = _on(synthetic_spec(tmp_path, epochs=1), ("cpu", "cpu"))
    result = flow.run(spec)
    x = np.random.default_rng(1).standard_normal((9, 6)).astype(np.float32)
    out = flow.predict(result.checkpoint, x)
    assert out.shape == (9, 3) and np.allclose(out.sum(axis=1), 1.0, atol=1e-5)


def test_the_data_parallel_example_trains_from_the_cli(tmp_path, vulkan_backend):
    """``python -m flow run examples/digits_data_parallel.json``: every device (lavapipe and the
    CPU backend here), data parallel, to the example's accuracy."""
    example = ROOT / "examples" / "digits_data_parallel.json"
    done = subprocess.run([sys.executable, "-m", "flow", "run", str(example)], capture_output=True,
                          text=True, cwd=tmp_path, check=False, env=None)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    accuracy = float(done.stdout.strip().splitlines()[-1].split()[-1])
    assert accuracy >= 0.95, done.stdout
    plan_text = subprocess.run([sys.executable, "-m", "flow", "plan", str(example)], capture_output=True,
                               text=True, cwd=tmp_path, check=True).stdout  # fmt: skip
    command = [sys.executable, "-m", "flow", "devices", "--json"]
    devices = subprocess.run(command, capture_output=True, text=True, check=True)
    listed = json.loads(devices.stdout)["devices"]
    assert f"data parallel over {len(listed)} devices" in plan_text and "cpu (numpy)" in plan_text


def test_a_member_over_its_memory_budget_is_refused_naming_it(vulkan_backend):
    spec = _on(digits_spec(), (vulkan_backend.facts.index, "cpu"))
    small = dataclasses.replace(cpu_facts(), heaps=(dataclasses.replace(cpu_facts().heaps[0], size=200_000,
                                                                        budget=None),))  # fmt: skip
    with pytest.raises(PlanError) as caught:
        plan(spec, facts=(vulkan_backend.facts, small))
    text = str(caught.value)
    assert "devices[cpu (numpy)]" in text and "memory budget is 180,000 bytes" in text
    assert "layers[1].weight" in text or "grads:all" in text or "params:all" in text


def test_running_statistics_come_from_the_leader_so_members_stay_identical():
    """BatchNorm's running statistics are updated by each member's own shard: the leader's weights,
    statistics included, are copied to the others, as DDP broadcasts rank 0's buffers."""
    from flow.spec import BatchNorm1d, Linear

    spec = synthetic_spec(epochs=1)
    layers = (Linear(12, activation="relu"), BatchNorm1d(), Linear(3))
    model = dataclasses.replace(spec.model, layers=layers)
    spec = _on(dataclasses.replace(spec, model=model), ("cpu", "cpu"))
    # Each member normalises by its own shard's statistics (DDP without SyncBatchNorm), so this
    # is not one device's training; but the members never drift apart.
    planned, weights = _member_weights(spec)
    assert planned == "leader" and len(weights) == 2
    np.testing.assert_array_equal(weights[1], weights[0])


def test_a_member_that_stops_answering_stops_the_run_naming_it(monkeypatch):
    """A device whose submission is not done within the deadline (the driver's wait times out)
    ends the run with the device named, instead of leaving it waiting forever."""
    from actors.cpu_backend import CpuBackend

    opened = []
    original_init = CpuBackend.__init__

    def track(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        opened.append(self)

    def wait(self, ticket, timeout_s=None):
        if self is opened[1] and timeout_s is not None:
            raise TimeoutError(f"GPU work for ticket {ticket} not done after {timeout_s} s")

    monkeypatch.setattr(CpuBackend, "__init__", track)
    monkeypatch.setattr(CpuBackend, "wait", wait)
    monkeypatch.setenv("VKFLOW_DEVICE_DEADLINE", "2.5")
    with pytest.raises(Exception, match=r"device 1 \(cpu \(numpy\)\) did not finish its work within 2.5 s"):
        flow.run(_on(synthetic_spec(epochs=1), ("cpu", "cpu")))


def test_one_device_that_stops_answering_stops_the_run_naming_it(monkeypatch, vulkan_backend):
    backend_type = type(vulkan_backend)
    original_wait = backend_type.wait

    def wait(self, ticket, timeout_s=None):
        if timeout_s is not None:  # the device actor's wait for a step: the device never answers
            raise TimeoutError(f"GPU work for ticket {ticket} not done after {timeout_s} s")
        return original_wait(self, ticket)

    monkeypatch.setattr(backend_type, "wait", wait)
    monkeypatch.setattr(backend_type, "is_done", lambda self, ticket: False)
    monkeypatch.setenv("VKFLOW_DEVICE_DEADLINE", "1.5")
    said = rf"device 0 \({re.escape(vulkan_backend.facts.name)}\) did not finish its work within 1.5 s"
    with pytest.raises(Exception, match=said):
        flow.run(_on(synthetic_spec(epochs=1), vulkan_backend.facts.index), backend=vulkan_backend)


def test_host_all_reduce_sums_in_member_order_into_kept_arrays(rng, vulkan_backend):
    """The all-reduce over a CPU backend, lavapipe and another CPU backend: the float32 sum in
    member order, written to every target, read into the caller's kept arrays."""
    from actors.cpu_backend import CpuBackend
    from actors.data_parallel import host_all_reduce
    from flow.program import Arena, Layout, Tensor

    n = 1031
    layout = Layout((Arena("grads", n * 4),), (Tensor("grads:all", (n,), "float32", "grads", 0),))
    backends = [CpuBackend(), vulkan_backend, CpuBackend()]
    parts = [rng.standard_normal(n).astype(np.float32) for _ in backends]
    for backend, part in zip(backends, parts, strict=True):
        backend.open_layout(layout, slots=1)
        backend.write("grads:all", part)
    scratch: dict = {}
    total = host_all_reduce(backends, backends[1:], scratch=scratch)
    expected = (parts[0] + parts[1]) + parts[2]
    np.testing.assert_array_equal(total, expected)
    np.testing.assert_array_equal(backends[1].read("grads:all"), expected)
    np.testing.assert_array_equal(backends[2].read("grads:all"), expected)
    np.testing.assert_array_equal(backends[0].read("grads:all"), parts[0])  # not a target
    assert host_all_reduce(backends[:1], [], scratch=scratch) is total  # the kept array, refilled
    np.testing.assert_array_equal(total, parts[0])
    for backend in backends[:2]:
        with pytest.raises(ValueError, match="grads:all"):
            backend.read_into("grads:all", np.empty(n - 1, np.float32))

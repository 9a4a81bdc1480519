"""Data parallelism over several devices (flow.parallel_plan, actors.data_parallel): the split of
each batch, training equal to one device's with the same global batch, identical weights on every
member, exact resume, the CLI example, and a failing member stopping the run."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import sys

import numpy as np
import pytest

import flow
from actors import checkpoint as checkpoints
from actors.cpu_backend import cpu_facts
from flow.errors import PlanError, SpecError
from flow.parallel_plan import plan_data_parallel, split_rows
from flow.planning import plan
from flow.spec import Devices
from tests.specs import ROOT, digits_spec, synthetic_spec


def _on(spec, select, shares=None, drop_slow=False, **run):
    """``spec`` over ``select``; every device kept unless ``drop_slow`` (these tests are about the
    members' work together, which the tiny models here would not be worth)."""
    spec = dataclasses.replace(spec, devices=Devices(select, shares=shares, drop_slow=drop_slow))
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


# -- leaving out members that would slow the run -----------------------------------------------------


def _named(*names):
    """Unequal devices (CPU facts under other names), for the pure decision."""
    return tuple(dataclasses.replace(cpu_facts(), name=name) for name in names)


def test_a_member_that_slows_each_step_is_left_out_and_the_order_kept():
    from flow.parallel_plan import MEMBER_STEP_S, choose_members

    # 4096 rows: fast alone 4.1 ms; fast + mid 2.7 ms + the all-reduce; with slow, its 3 rows take 3 ms.
    group, devices = _named("mid", "slow", "fast"), Devices((0, 1, 2))
    choice = choose_members(group, 4096, devices, None, (5e5, 1e3, 1e6), 1e12, 4_000)
    assert choice.kept == choice.best == (0, 2) and choice.left_out == ("slow",)
    assert choice.seconds_best == pytest.approx(2731 / 1e6 + 2 * 2 * 4_000 / 1e12 + 2 * MEMBER_STEP_S)
    assert choice.seconds_all > 3 / 1e3 > choice.seconds_best
    said = choice.sentence()
    assert said.startswith("data parallel over mid, fast; left out slow: predicted ") and "ms without" in said
    # The members' order is the spec's, whatever their speeds.
    again = choose_members(_named("fast", "slow", "mid"), 4096, devices, None, (1e6, 1e3, 5e5), 1e12, 4_000)
    assert again.kept == (0, 2) and again.left_out == ("slow",)


def test_equal_members_are_kept_while_the_all_reduce_is_cheap():
    from flow.parallel_plan import choose_members

    group, devices = (cpu_facts(), cpu_facts()), Devices(("cpu", "cpu"))
    cheap = choose_members(group, 4096, devices, None, (1e6, 1e6), 1e12, 1_000_000)
    assert cheap.kept == (0, 1) and cheap.left_out == () and cheap.seconds_best == cheap.seconds_all
    assert "data parallel over cpu (numpy), cpu (numpy): predicted" in cheap.sentence()
    dear = choose_members(group, 4096, devices, None, (1e6, 1e6), 1e9, 1_000_000)  # +4 ms a step
    assert dear.kept == (0,) and dear.seconds_best == pytest.approx(4096 / 1e6)
    assert dear.sentence().startswith("one device, cpu (numpy); left out cpu (numpy): predicted")
    slower_second = choose_members(group, 4096, devices, None, (1e6, 1.1e6), 1e9, 1_000_000)
    assert slower_second.kept == (1,)  # the faster of the same device


def test_the_users_word_keeps_every_member_but_the_prediction_is_still_made():
    from flow.parallel_plan import choose_members

    group = _named("fast", "slow")
    for devices, why in ((Devices((0, 1), shares=(3.0, 1.0)), "the spec's shares"),
                         (Devices((0, 1), drop_slow=False), "drop_slow=False")):  # fmt: skip
        choice = choose_members(group, 256, devices, None, (1e6, 1e3), 1e9, 100_000)
        assert choice.kept == (0, 1) and choice.best == (0,) and choice.forced == why
        assert choice.seconds_all > choice.seconds_best
        assert f"data parallel over fast, slow, every device kept ({why}): predicted" in choice.sentence()
        assert "without slow" in choice.sentence()
    # The spec's shares set the rows predicted: 64 of 256 on the slow member.
    shared = choose_members(group, 256, Devices((0, 1), shares=(3.0, 1.0)), None, (1e6, 1e3), 1e15, 4)
    assert shared.seconds_all == pytest.approx(64 / 1e3, rel=0.01)


def test_the_plan_records_who_was_left_out_and_plan_shows_it():
    from flow.plan_table import format_plan

    spec = _on(digits_spec(), (0, 1, "cpu"), drop_slow=True)
    group = _named("gpu", "igpu", "cpu (numpy)")
    alone = plan(spec, facts=group, speeds=(1e6, 1e4, 2e3), bandwidth=1e8)
    assert alone.parallel is None and [d.device for d in alone.devices] == ["gpu"]
    assert alone.devices[0].apply is None  # a plain device: the update in its train program
    assert alone.member_choice.left_out == ("igpu", "cpu (numpy)")
    assert json.loads(json.dumps(alone.as_dict()))["member_choice"]["left_out"] == ["igpu", "cpu (numpy)"]
    text = format_plan(alone)
    assert "one device, gpu; left out igpu, cpu (numpy): predicted" in text
    two = plan(spec, facts=group, speeds=(1e4, 1e4, 10.0), bandwidth=1e12)
    assert two.parallel.members == ("gpu", "igpu") and two.parallel.basis == "measured"
    assert [d.batch_size for d in two.devices] == [32, 32]
    assert "data parallel over gpu, igpu; left out cpu (numpy)" in format_plan(two)
    # Before measuring, ``flow plan`` says what the run will do.
    before = format_plan(plan(spec, facts=group))
    assert "measured before the first step: devices that would slow each step are left out" in before
    kept = plan(_on(digits_spec(), (0, 1, "cpu")), facts=group, speeds=(1e6, 1e4, 2e3))
    assert kept.member_choice is None and kept.parallel.members == ("gpu", "igpu", "cpu (numpy)")


def test_drop_slow_is_validated_and_round_trips():
    from flow.codec import dumps, loads
    from flow.validation import validate

    spec = _on(digits_spec(), ("cpu", "cpu"))
    assert spec.devices.drop_slow is False and loads(dumps(spec)) == spec
    assert Devices("all").drop_slow is True
    wrong = dataclasses.replace(spec, devices=Devices(("cpu", "cpu"), drop_slow="yes"))
    assert [p.path for p in validate(wrong)] == ["devices.drop_slow"]


def _run_keeping_the_plan(spec, monkeypatch):
    from flow.runtime import Runtime

    kept = {}
    original = Runtime.close

    def close(self):
        kept["plan"] = self.plan
        original(self)

    monkeypatch.setattr(Runtime, "close", close)
    return flow.run(spec), kept["plan"]


def test_a_run_leaves_out_the_member_not_worth_its_all_reduce(vulkan_backend, monkeypatch, caplog):
    """Lavapipe and the CPU backend, measured (here: said to be) 1,000 and 1,000,000 samples/s:
    the run trains on the CPU backend alone, and says so."""
    import flow.runtime

    caplog.set_level(logging.INFO, logger="vkflow")
    monkeypatch.setattr(flow.runtime, "measure_throughput", lambda engines, rows: (1e3, 1e6))
    monkeypatch.setattr(flow.runtime, "measure_all_reduce", lambda engines: 1e9)
    name = vulkan_backend.facts.name
    spec = _on(synthetic_spec(epochs=2), (vulkan_backend.facts.index, "cpu"), drop_slow=True)
    result, the_plan = _run_keeping_the_plan(spec, monkeypatch)
    alone = flow.run(_on(synthetic_spec(epochs=2), "cpu"))
    assert result.steps == alone.steps == 26 and result.device == "cpu (numpy)"
    for key, value in alone.parameters.items():  # the CPU backend alone: the same bits
        np.testing.assert_array_equal(result.parameters[key], value, err_msg=key)
    assert the_plan.parallel is None and the_plan.member_choice.left_out == (name,)
    said = f"vkflow: one device, cpu (numpy); left out {name}: predicted "
    assert any(r.getMessage().startswith(said) for r in caplog.records), caplog.text


def test_a_run_keeps_the_members_worth_it_in_order(vulkan_backend, monkeypatch, caplog):
    import flow.runtime

    caplog.set_level(logging.INFO, logger="vkflow")
    monkeypatch.setattr(flow.runtime, "measure_throughput", lambda engines, rows: (1e4, 10.0, 1e4))
    monkeypatch.setattr(flow.runtime, "measure_all_reduce", lambda engines: 1e12)
    index = vulkan_backend.facts.index
    spec = _on(synthetic_spec(epochs=1), ("cpu", index, "cpu"), drop_slow=True)
    result, the_plan = _run_keeping_the_plan(spec, monkeypatch)
    assert result.steps == 13 and result.device == "cpu (numpy) + cpu (numpy)"
    assert the_plan.parallel.members == ("cpu (numpy)",) * 2 and the_plan.parallel.update == "each"
    assert result.statistics["device"].members == ("cpu (numpy)",) * 2
    assert f"data parallel over cpu (numpy), cpu (numpy); left out {vulkan_backend.facts.name}" in caplog.text


def test_a_run_measures_its_members_and_says_what_it_kept(vulkan_backend, monkeypatch, caplog):
    """The real measurements (no member asserted: that is the machine's)."""
    caplog.set_level(logging.INFO, logger="vkflow")
    spec = _on(synthetic_spec(epochs=1), (vulkan_backend.facts.index, "cpu"), drop_slow=True)
    result, the_plan = _run_keeping_the_plan(spec, monkeypatch)
    choice = the_plan.member_choice
    assert result.steps == 13 and np.isfinite(result.loss)
    assert choice is not None and len(choice.members) == 2 and 0 < choice.seconds_best <= choice.seconds_all
    assert f"vkflow: {choice.sentence()}" in caplog.text
    kept = [choice.members[i] for i in choice.kept]
    assert result.device == " + ".join(kept)


def test_measure_all_reduce_times_the_real_host_sum(vulkan_backend):
    from actors.cpu_backend import CpuBackend
    from actors.data_parallel import measure_all_reduce, measure_throughput
    from flow.runtime import start_engine

    spec = _on(synthetic_spec(), (vulkan_backend.facts.index, "cpu"))
    the_plan = plan(spec, facts=(vulkan_backend.facts, cpu_facts()))
    cpu = CpuBackend()
    try:
        engines = [start_engine(the_plan, b, member=i)[0] for i, b in enumerate((vulkan_backend, cpu))]
        before = [e.weights() for e in engines]
        assert measure_all_reduce(engines, repeats=3) > 0
        speeds = measure_throughput(engines, (16, 4))
        assert len(speeds) == 2 and min(speeds) > 0
        for engine, weights in zip(engines, before, strict=True):  # the weights untouched
            np.testing.assert_array_equal(engine.weights(), weights)
    finally:
        cpu.close()


def test_measuring_throughput_leaves_batchnorm_running_statistics_as_they_were():
    # The timed train programs move BatchNorm's running statistics (they live with the weights, in
    # params:all); measured before the run, they must not start it from 4 updates on random data.
    from actors.cpu_backend import CpuBackend
    from actors.data_parallel import measure_throughput
    from flow.runtime import start_engine
    from flow.spec import BatchNorm1d, Linear, ReLU

    base = synthetic_spec()
    layers = (Linear(12), BatchNorm1d(), ReLU(), Linear(3))
    spec = dataclasses.replace(base, model=dataclasses.replace(base.model, layers=layers))
    spec = dataclasses.replace(spec, devices=Devices(select=("cpu", "cpu")))
    the_plan = plan(spec, facts=(cpu_facts(), cpu_facts()))
    backends = (CpuBackend(), CpuBackend())
    engines = [start_engine(the_plan, b, member=i)[0] for i, b in enumerate(backends)]
    before = [e.weights() for e in engines]
    assert min(measure_throughput(engines, (8, 8))) > 0
    for engine, weights in zip(engines, before, strict=True):
        np.testing.assert_array_equal(engine.weights(), weights)


def test_a_resume_plans_from_the_measurement_its_checkpoint_recorded(tmp_path, monkeypatch):
    """Measured speeds decide the members and their rows; a resume asking for the same devices
    plans from the checkpoint's measurement instead of measuring again (which may well differ), so
    it keeps the same members and is bit-exact."""
    import flow.runtime

    calls = []

    def measured(speeds):
        def measure(engines, rows):
            calls.append(speeds[: len(engines)])
            return speeds[: len(engines)]

        return measure

    monkeypatch.setattr(flow.runtime, "measure_all_reduce", lambda engines: 1e12)
    monkeypatch.setattr(flow.runtime, "measure_throughput", measured((1e4, 10.0, 1e4)))  # member 1 slow
    select = ("cpu", "cpu", "cpu")
    straight = flow.run(_on(synthetic_spec(epochs=3), select, drop_slow=True))
    spec = _on(synthetic_spec(tmp_path, epochs=3), select, drop_slow=True, checkpoint_every=5)
    flow.run(dataclasses.replace(spec, run=dataclasses.replace(spec.run, epochs=None, steps=15)))
    saved = checkpoints.load(tmp_path / "ckpt")
    assert saved.measured == {"speeds": [1e4, 10.0, 1e4], "bandwidth": 1e12}
    monkeypatch.setattr(flow.runtime, "measure_throughput", measured((1e4, 1e4, 1e4)))  # all kept now
    calls.clear()
    resumed = flow.run(spec, resume=tmp_path / "ckpt")
    assert calls == []  # planned from the checkpoint, not measured
    assert resumed.resumed_from == 15 and resumed.steps == straight.steps == 39
    assert resumed.device == straight.device == "cpu (numpy) + cpu (numpy)"
    for name, value in straight.parameters.items():
        np.testing.assert_array_equal(resumed.parameters[name], value, err_msg=name)
    # Asked for other devices, a resume measures afresh.
    other = _on(synthetic_spec(tmp_path, epochs=4), ("cpu", "cpu"), drop_slow=True)
    flow.run(other, resume=tmp_path / "ckpt")
    assert calls == [(1e4, 1e4)]


# -- per-device times and the host arena -------------------------------------------------------------


@pytest.mark.parametrize("members", ["cpu+cpu", "lavapipe+cpu"])
def test_each_epoch_writes_every_members_times_and_progress_shows_the_all_reduce(
    tmp_path, members, vulkan_backend
):
    import io

    from actors.progress import Progress

    select = ("cpu", "cpu") if members == "cpu+cpu" else (vulkan_backend.facts.index, "cpu")
    spec = _on(synthetic_spec(tmp_path, epochs=2), select)
    out = io.StringIO()
    result = flow.run(spec, progress=Progress(out, every_s=0.0))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    lines = [r for r in records if r["event"] == "devices"]
    # One line as each epoch ends, after its last step's line, naming that step.
    assert [(r["epoch"], r["step"]) for r in lines] == [(0, 12), (1, 25)]
    last_of = {r["epoch"]: r["step"] for r in steps}
    assert [r["step"] for r in lines] == [last_of[0], last_of[1]]
    device = result.statistics["device"]
    assert [d["name"] for d in lines[-1]["devices"]] == list(device.members)
    for line in lines:
        assert line["all_reduce"] == "arena" and 0 < line["all_reduce_seconds"] < line["step_seconds"]
        for member in line["devices"]:
            # Every member is busy or idle through each step; samples/s are over its busy time.
            busy, idle = member["busy_seconds"], member["idle_seconds"]
            assert busy > 0 and idle >= 0 and busy + idle == pytest.approx(line["step_seconds"], abs=2e-6)
            assert member["samples_per_second"] == pytest.approx(member["rows"] / busy, rel=1e-3)
    # Counted since the run began: the last line has every training row; only the final
    # validation round (whose samples its eval line gives) may come after it.
    rows = [sum(d["rows"] for d in line["devices"]) for line in lines]
    final_eval = [r for r in records if r["event"] == "eval"][-1]
    assert rows[0] < rows[1] <= sum(device.member_rows)
    assert rows[1] >= sum(device.member_rows) - final_eval["samples"]
    # Progress: the all-reduce's share of the step time, before each device's samples/s.
    shown = [line for line in out.getvalue().splitlines() if line.startswith("step ") and "/26" in line]
    share = re.search(r"all-reduce ([0-9]+)%  per device ([0-9]+), ([0-9]+)$", shown[-1])
    assert share is not None and 0 <= int(share.group(1)) <= 100 and int(share.group(2)) > 0


def _with_path(spec, path, monkeypatch):
    """Train ``spec`` with the all-reduce's path forced to ``path``."""
    import flow.parallel_plan as parallel_plan

    with monkeypatch.context() as patch:
        patch.setattr(parallel_plan, "all_reduce_path", lambda group: path)
        return flow.run(spec)


@pytest.mark.parametrize("members", ["cpu+cpu", "lavapipe+lavapipe"])
def test_the_host_arena_gives_the_staging_paths_bits(members, vulkan_backend, monkeypatch):
    """The same run through the pinned host arena and through each backend's reads and writes:
    the same sums in the same order, so the same weights to the bit."""
    index = vulkan_backend.facts.index
    select = ("cpu", "cpu") if members == "cpu+cpu" else (index, index)
    spec = _on(synthetic_spec(epochs=2), select)
    arena = flow.run(spec)
    staging = _with_path(spec, "staging", monkeypatch)
    paths = (arena.statistics["device"].all_reduce, staging.statistics["device"].all_reduce)
    assert paths == ("arena", "staging")
    assert arena.loss == staging.loss and arena.steps == staging.steps == 26
    for name, value in staging.parameters.items():
        np.testing.assert_array_equal(arena.parameters[name], value, err_msg=name)
    # The arena's weights are trained ones, equal to one device's within float tolerance.
    one = flow.run(_on(synthetic_spec(epochs=2), select[0]))
    for name, value in one.parameters.items():
        np.testing.assert_allclose(arena.parameters[name], value, rtol=1e-3, atol=1e-4, err_msg=name)


def test_the_host_arena_sums_in_member_order_and_copies_the_sum_back(rng, vulkan_backend):
    """The arena over a CPU backend, lavapipe and another CPU backend: each member's gradients
    copied in (lavapipe's by its own copy), the float32 sum in member order in region 0, and the
    sum copied back into each target."""
    from actors.cpu_backend import CpuBackend
    from actors.host_arena import HostArena
    from flow.program import Arena, Layout, Tensor

    n = 1031
    layout = Layout((Arena("grads", n * 4),), (Tensor("grads:all", (n,), "float32", "grads", 0),))
    lavapipe = type(vulkan_backend)(vulkan_backend.facts.index)  # its own device: the arena lives with it
    backends = [CpuBackend(), lavapipe, CpuBackend()]
    try:
        parts = [rng.standard_normal(n).astype(np.float32) for _ in backends]
        for backend, part in zip(backends, parts, strict=True):
            backend.open_layout(layout, slots=1)
            backend.write("grads:all", part)
        arena = HostArena(backends, n * 4)
        assert arena.copies[0] is None and arena.copies[1] is not None
        for i, backend in enumerate(backends):
            ticket = arena.gather(i)
            if ticket is not None:
                backend.wait(ticket)
            np.testing.assert_array_equal(arena.regions[i], parts[i])
        total = arena.sum([0, 1, 2])
        expected = (parts[0] + parts[1]) + parts[2]
        assert total is arena.regions[0]
        np.testing.assert_array_equal(total, expected)
        for i in (1, 2):
            arena.scatter(i)
        lavapipe.wait(lavapipe.submit(arena.copies[1][0]))  # a later submission: the copy back is done
        np.testing.assert_array_equal(lavapipe.read("grads:all"), expected)
        np.testing.assert_array_equal(backends[2].read("grads:all"), expected)
        np.testing.assert_array_equal(backends[0].read("grads:all"), parts[0])  # not a target
    finally:
        lavapipe.close()


def test_plan_shows_the_all_reduce_path(vulkan_backend):
    from flow.plan_table import format_plan

    spec = digits_spec()
    arena = plan(_on(spec, (vulkan_backend.facts.index, "cpu")), facts=(vulkan_backend.facts, cpu_facts()))
    assert arena.parallel.all_reduce == "arena" and arena.as_dict()["parallel"]["all_reduce"] == "arena"
    text = format_plan(arena)
    assert "gradients summed on the host in device order in a pinned host arena every device imports" in text
    plain = dataclasses.replace(vulkan_backend.facts, features=tuple(
        f for f in vulkan_backend.facts.features if f != "host_memory_import"))  # fmt: skip
    staging = plan(_on(spec, (vulkan_backend.facts.index, "cpu")), facts=(plain, cpu_facts()))
    assert staging.parallel.all_reduce == "staging"
    assert "through each device's staging reads and writes" in format_plan(staging)

"""Gradient buckets overlapped with the backward pass (flow.parallel_plan.grad_buckets and
train_parts, actors.data_parallel, actors.host_arena, actors.collective.Ranks.start_sum): the cut
of the gradient buffer and of each member's train program, and training that gives the same bits
with any bucket size, on the CPU backend, on lavapipe twice, on lavapipe + CPU and over two MPI ranks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

import flow
from actors.cpu_backend import cpu_facts
from flow.codec import save
from flow.errors import SpecError
from flow.parallel_plan import train_parts
from flow.planning import plan
from flow.program import Barrier, Launch
from flow.spec import SGD, CrossEntropy, Data, Devices, Linear, Model, RunSettings, Spec, Split, Synthetic
from tests.specs import ROOT, digits_spec
from tests.test_mpi import _final, _mpiexec, _outputs, _written, needs_mpi

TINY_MB = 0.002  # 2 KiB: the digits MLP's three layers (2.6, 33 and 33 KB of gradients) a bucket each


def _on(spec: Spec, select, bucket_mb: float | None = None, **run) -> Spec:
    devices = Devices(select, drop_slow=False, shares=(1.0,) * len(select))  # fixed shares: same rows
    if bucket_mb is not None:
        devices = dataclasses.replace(devices, bucket_mb=bucket_mb)
    return dataclasses.replace(spec, devices=devices, run=dataclasses.replace(spec.run, **run))


def _mlp(rng, bucket_mb: float) -> Spec:
    """A random MLP over two CPU members (the plan only: nothing runs)."""
    widths = [int(w) for w in rng.integers(3, 300, int(rng.integers(1, 6)))]
    layers = tuple(Linear(w, activation="relu", bias=bool(rng.integers(0, 2))) for w in widths)
    return Spec(
        model=Model(input_shape=(int(rng.integers(2, 200)),), layers=(*layers, Linear(4)),
                    loss=CrossEntropy()),
        optimiser=SGD(0.1, momentum=0.9),
        data=Data(Synthetic(samples=64, features=(8,), classes=4, seed=1), batch_size=16,
                  split=Split(train=1.0, val=0.0), placement="host"),
        devices=Devices(("cpu", "cpu"), drop_slow=False, bucket_mb=bucket_mb),
        run=RunSettings(epochs=1),
    )  # fmt: skip


def _bound(step, ranges) -> set[tuple[int, int]]:
    return {ranges[name] for name in step.args if name in ranges} if isinstance(step, Launch) else set()


def test_buckets_cut_the_gradients_from_the_last_layer_and_the_program_where_each_is_done(rng):
    for _ in range(25):
        bucket_mb = float(rng.choice([1e-4, 1e-3, 0.01, 0.1, 4.0]))
        spec = _mlp(rng, bucket_mb)
        the_plan = plan(spec, facts=(cpu_facts(), cpu_facts()))
        device, buckets = the_plan.devices[0], the_plan.parallel.buckets
        layout, program = device.layout, device.program("train")
        total = device.total_params
        # Contiguous from the buffer's end down to 0; every bucket but the last at least the size.
        assert buckets[0][1] == total and buckets[-1][0] == 0
        assert all(a[0] == b[1] for a, b in zip(buckets, buckets[1:], strict=False))
        assert all((stop - start) * 4 >= bucket_mb * 2**20 for start, stop in buckets[:-1])
        ranges = {t.name: (t.offset // 4, t.offset // 4 + t.size) for t in layout.tensors
                  if t.arena == "grads" and t.name != "grads:all"}  # fmt: skip
        for start, _ in buckets:  # never inside a gradient tensor (a layer's fused weight+bias)
            assert not any(a < start < b for a, b in ranges.values())
        if 4 * total < bucket_mb * 2**20:
            assert buckets == ((0, total),)
        parts = train_parts(program, layout, buckets)
        assert len(parts) == len(buckets)
        assert [s for p in parts for s in p.launches] == list(program.launches)  # the same launches, in order
        for k in range(len(parts)):  # after parts 0..k, no later launch touches buckets 0..k
            later = set().union(*(_bound(s, ranges) for p in parts[k + 1 :] for s in p.steps))
            for start, stop in buckets[: k + 1]:
                assert not any(a < stop and start < b for a, b in later)
            assert all(not isinstance(p.steps[0], Barrier) for p in parts if p.steps)


def test_the_plan_shows_the_buckets_and_a_bad_size_is_refused(tmp_path):
    spec = _on(digits_spec(), ("cpu", "cpu"), TINY_MB)
    save(spec, tmp_path / "spec.json")
    shown = subprocess.run([sys.executable, "-m", "flow", "plan", str(tmp_path / "spec.json")], cwd=ROOT,
                           capture_output=True, text=True)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    said = "gradients summed in 3 buckets as the backward pass finishes them, last layer first"
    assert said in shown.stdout
    one = plan(_on(digits_spec(), ("cpu", "cpu")), facts=(cpu_facts(), cpu_facts()))
    assert one.parallel.buckets == ((0, one.devices[0].total_params),)  # 69 KB: one bucket of 4 MiB
    assert one.as_dict()["parallel"]["buckets"] == [[0, one.devices[0].total_params]]
    with pytest.raises(SpecError, match=r"devices.bucket_mb: must be > 0 .*got 0"):
        plan(_on(digits_spec(), ("cpu", "cpu"), 0.0), facts=(cpu_facts(), cpu_facts()))


def _same_bits(select, epochs: int = 1) -> None:
    """Training on the digits over ``select`` gives the same bits in one bucket and in three."""
    one = flow.run(_on(digits_spec(), select, epochs=epochs))
    three = flow.run(_on(digits_spec(), select, TINY_MB, epochs=epochs))
    assert three.statistics["device"].all_reduce == "arena"
    assert one.steps == three.steps == 23 * epochs and one.loss == three.loss
    for name, value in one.parameters.items():
        np.testing.assert_array_equal(three.parameters[name], value, err_msg=name)
    assert three.accuracy == one.accuracy > 0.8  # it learned, and identically
    device = three.statistics["device"]
    assert 0 < device.all_reduce_seconds < device.step_seconds


def test_cpu_members_give_the_same_bits_with_any_bucket_size():
    _same_bits(("cpu", "cpu"))


def test_lavapipe_twice_gives_the_same_bits_with_any_bucket_size(vulkan_backend):
    _same_bits((vulkan_backend.facts.index,) * 2)


def test_lavapipe_and_cpu_give_the_same_bits_with_any_bucket_size(vulkan_backend):
    _same_bits((vulkan_backend.facts.index, "cpu"))


# A rank's script: rank 1 sums through each backend's reads and writes (the staging path), rank 0
# through the arena: both exchange the same buckets in the same order.
STAGING_ON_RANK_1 = """
import os, sys
import flow
import flow.parallel_plan as parallel_plan
if parallel_plan.world_from_env(os.environ).rank == 1:
    parallel_plan.all_reduce_path = lambda group: "staging"
flow.run(sys.argv[1])
"""


@needs_mpi
@pytest.mark.parametrize("paths", ["arena", "arena+staging"])
def test_two_ranks_in_buckets_train_as_one_process_in_one(tmp_path, paths):
    """``mpiexec -n 2``, three buckets exchanged as each is summed: the same bits as one process of
    two CPU members summing once."""
    spec = _on(digits_spec(), ("cpu",), TINY_MB, epochs=1, checkpoint_every=10)
    how = ("-m", "flow", "run") if paths == "arena" else ("-c", STAGING_ON_RANK_1)
    # The ranks import vkflow from this checkout, and its dependencies from where they are now.
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    done, _ = _mpiexec(tmp_path, 2, *how, _written(tmp_path, "mpi", spec), env={"PYTHONPATH": path})
    assert done.returncode == 0, done.stdout + done.stderr
    flow.run(tmp_path / _written(tmp_path, "one", _on(spec, ("cpu", "cpu"), 4.0)))
    np.testing.assert_array_equal(_final(tmp_path, "mpi"), _final(tmp_path, "one"))
    assert _outputs(tmp_path, "mpi") == _outputs(tmp_path, "one")

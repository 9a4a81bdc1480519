"""A dataset kept on every data-parallel member (data.placement "device" under Devices([...])):
each member holds the whole dataset and gathers its own shard by the sample indices the loader
sends, so no batch is read on the host; it trains as the streamed data-parallel run and as one
device keeping the data, on the bundled digits as an image folder (whose cache can be kept)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import flow
from actors.cpu_backend import cpu_facts
from flow.data_plan import header_of
from flow.errors import PlanError
from flow.planning import plan
from flow.spec import Devices, HorizontalFlip, ImageFolder
from loaders import ImageFolderSource, open_source
from loaders.digits import write_image_folder
from tests.specs import digits_spec
from tests.test_mpi import _final, _mpiexec, _outputs, _written, needs_mpi


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("digits"))


def _spec(folder, select, placement: str, **data):
    spec = digits_spec(epochs=2)
    data = dataclasses.replace(spec.data, source=ImageFolder(str(folder)), placement=placement, **data)
    return dataclasses.replace(spec, data=data, devices=Devices(select, drop_slow=False))


def _select(request, pair: str):
    if pair == "cpu+cpu":
        return ("cpu", "cpu")
    index = request.getfixturevalue("vulkan_backend").facts.index
    return (index, index)


def test_every_member_plans_the_whole_dataset_and_gathers_its_shard(folder):
    spec = _spec(folder, ("cpu", "cpu"), "device")
    header = header_of(open_source(spec.data.source))
    planned = plan(spec, header=header, facts=(cpu_facts(), cpu_facts()))
    assert planned.parallel is not None and planned.data.resident is not None
    assert planned.parallel.rows == (32, 32)
    for device in planned.devices:
        assert device.resident == planned.data.resident and device.batch_size == 32
        assert device.program("train").steps[0].op == "gather_rows"
        dataset = dict(device.memory.arenas)["dataset"]
        assert dataset >= 1797 * 64  # every sample, as stored (uint8), on every member
    flipped = _spec(folder, ("cpu", "cpu"), "device", augment=(HorizontalFlip(),))
    with pytest.raises(PlanError, match="data.placement: 'device' asked for, but augmentations run on the"):
        plan(flipped, header=header, facts=(cpu_facts(), cpu_facts()))


@pytest.mark.parametrize("pair", ["cpu+cpu", "lavapipe+lavapipe"])
def test_members_keeping_the_digits_train_as_streamed_members_and_as_one_device(
    folder, monkeypatch, request, pair
):
    select = _select(request, pair)
    streamed = flow.run(_spec(folder, select, "host"))
    one = flow.run(dataclasses.replace(_spec(folder, select, "device"), devices=Devices(select[0])))

    def no_host_reads(*args, **kwargs):
        raise AssertionError("a batch was read on the host")

    monkeypatch.setattr(ImageFolderSource, "_from_cache", no_host_reads)
    kept = flow.run(_spec(folder, select, "device"))
    assert kept.steps == streamed.steps == one.steps == 46
    assert kept.device == streamed.device and "+" in kept.device
    for reference in (streamed, one):  # the preprocessing fused on the device, the rows summed apart
        for name, value in reference.parameters.items():
            np.testing.assert_allclose(kept.parameters[name], value, rtol=1e-3, atol=1e-4, err_msg=name)
        assert kept.accuracy == pytest.approx(reference.accuracy, abs=0.01)
    assert kept.accuracy > 0.9


@needs_mpi
def test_two_ranks_keeping_the_digits_train_as_one_process_with_two_members(folder, tmp_path):
    """``mpiexec -n 2``, one CPU member a rank, each keeping the dataset and gathering its part of
    every global batch: the bits of one process whose two CPU members keep it."""
    spec = _spec(folder, "cpu", "device")
    open_source(spec.data.source).close()  # the folder's cache, built here once, not by both ranks at once
    done, _ = _mpiexec(tmp_path, 2, "-m", "flow", "run", _written(tmp_path, "mpi", spec))
    assert done.returncode == 0, done.stdout + done.stderr
    flow.run(flow.load(tmp_path / _written(tmp_path, "one", _spec(folder, ("cpu", "cpu"), "device"))))
    np.testing.assert_array_equal(_final(tmp_path, "mpi"), _final(tmp_path, "one"))
    assert _outputs(tmp_path, "mpi") == _outputs(tmp_path, "one")

"""A model split into pipeline stages in every rank of an MPI job (flow.stage_plan "Ranks",
actors.stages): each rank runs the split on its own two CPU stage devices over its part of every
global batch, and each stage's gradient is summed over the ranks in rank order before its update.
Under ``mpiexec -n 2`` (skipped where mpi4py or mpiexec is missing) that is bit for bit one
process with the same global batch, from the CLI, with the clip factor one decision for the job,
and a resume is exact."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import flow
from flow.parallel_plan import World
from flow.planning import plan
from flow.spec import Devices
from tests.specs import synthetic_spec
from tests.test_mpi import _final, _mpiexec, _outputs, _resumes_exactly, _written, needs_mpi


def _split(spec, micro: int, clip: float | None = None):
    devices = Devices(("cpu", "cpu"), stages="auto", micro_batches=micro, drop_slow=False)
    optimiser = dataclasses.replace(spec.optimiser, clip_norm=clip)
    return dataclasses.replace(spec, devices=devices, optimiser=optimiser)


def test_a_ranks_split_plan_takes_its_part_of_every_global_batch():
    spec = _split(synthetic_spec(), micro=2)  # 16 rows a global batch
    for rank in (0, 1, 2):
        stages = plan(spec, world=World(rank, 3)).stages
        assert stages is not None and stages.ranks == 3 and stages.micro_rows == 3  # 6 rows a rank at most
    assert plan(spec).stages.micro_rows == 8 and plan(spec).stages.as_dict()["ranks"] == 1


@needs_mpi
@pytest.mark.parametrize("clip", [None, 0.5])
def test_two_ranks_of_stages_train_as_one_process_bit_for_bit_and_resume_exactly(tmp_path, clip):
    """Two ranks with one micro-batch each add their gradients as one process adds its two
    micro-batches' (rank 0's rows are its micro-batch 0), so the weights, the checkpoints and every
    step's loss are the same bits; clipping by the global norm joins the summed gradients."""
    spec = _split(synthetic_spec(epochs=3, checkpoint_every=5), micro=1, clip=clip)
    done, _ = _mpiexec(tmp_path, 2, "-m", "flow", "run", _written(tmp_path, "mpi", spec),
                       env={"VKFLOW_CHECK_EVERY": "1"})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("steps: 39") == 1, done.stdout  # one summary, from rank 0
    one = flow.run(flow.load(tmp_path / _written(tmp_path, "one", _split(spec, micro=2, clip=clip))))
    assert one.steps == 39
    np.testing.assert_array_equal(_final(tmp_path, "mpi"), _final(tmp_path, "one"))
    files, steps = _outputs(tmp_path, "mpi")
    assert (files, steps) == _outputs(tmp_path, "one") and len(steps) == 39
    assert np.abs(_final(tmp_path, "mpi")).sum() > 0

    _resumes_exactly(tmp_path, spec)


@needs_mpi
def test_two_ranks_of_stages_with_micro_batches_train_as_one_process_within_tolerance(tmp_path):
    spec = _split(synthetic_spec(epochs=2), micro=2)
    done, _ = _mpiexec(tmp_path, 2, "-m", "flow", "run", _written(tmp_path, "mpi", spec))
    assert done.returncode == 0, done.stdout + done.stderr
    flow.run(flow.load(tmp_path / _written(tmp_path, "one", _split(spec, micro=4))))
    np.testing.assert_allclose(_final(tmp_path, "mpi"), _final(tmp_path, "one"), rtol=1e-5, atol=1e-6)

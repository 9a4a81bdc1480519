"""Data parallel across the ranks of an MPI job (flow.parallel_plan.World, loaders.sampler.RankSlices,
actors.collective): the world read from the launcher's environment, each rank's part of every global
batch, the plan of a rank, and, under ``mpiexec -n 2`` (skipped where mpi4py or mpiexec is missing:
``pip install -e '.[mpi]'``), training equal to one process, outputs from rank 0 only, exact resume,
ranks whose weights drift apart, and a rank that dies or hangs stopping the job."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import flow
from actors import checkpoint as checkpoints
from actors.cpu_backend import cpu_facts
from flow.codec import save
from flow.errors import PlanError
from flow.parallel_plan import World, divergence, split_rows, world_from_env
from flow.planning import plan
from flow.spec import Devices
from loaders.sampler import RankSlices, Sampler, SamplerState, rank_bounds
from tests.specs import ROOT, synthetic_spec

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


# MPICH's launcher: a survivor names a dead rank before it ends the job (actors.rank_watch).
HYDRA = MPIEXEC is not None and "HYDRA" in subprocess.run([MPIEXEC, "--version"], capture_output=True,
                                                          text=True).stdout  # fmt: skip


def _have_mpi4py() -> bool:
    found = subprocess.run([sys.executable, "-c", "import mpi4py"], capture_output=True)
    return found.returncode == 0


needs_mpi = pytest.mark.skipif(
    MPIEXEC is None or not _have_mpi4py(),
    reason="needs mpi4py and an mpiexec (pip install -e '.[mpi]', which CI's .ci/setup installs)",
)


def _on(spec, select, **run):
    # Every member kept: these runs compare the bits of two members with two ranks.
    spec = dataclasses.replace(spec, devices=Devices(select, drop_slow=False))
    return dataclasses.replace(spec, run=dataclasses.replace(spec.run, **run)) if run else spec


# -- pure: the world, the slices, the plan ---------------------------------------------------------


def test_the_world_comes_from_the_launchers_environment_only():
    assert world_from_env({}) == World(0, 1)
    assert world_from_env({"PMI_RANK": "1", "PMI_SIZE": "4"}) == World(1, 4)
    assert world_from_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"}) == World(2, 3)
    tuned = world_from_env({"PMI_RANK": "0", "PMI_SIZE": "2", "VKFLOW_CHECK_EVERY": "7",
                            "VKFLOW_MPI_DEADLINE": "1.5"})  # fmt: skip
    assert (tuned.check_every, tuned.deadline_s) == (7, 1.5)
    with pytest.raises(ValueError, match="PMI_RANK=2 is outside"):
        world_from_env({"PMI_RANK": "2", "PMI_SIZE": "2"})
    assert divergence([b"a", b"a", b"b", b"a", b"c"]) == (2, 4) and divergence([b"x"] * 3) == ()


def test_a_single_process_run_never_imports_mpi4py():
    code = (
        "import sys, flow; from tests.specs import synthetic_spec;"
        "flow.run(synthetic_spec(epochs=1)); print('mpi4py' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MV2_"))}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_rank_slices_cut_every_global_batch_in_rank_order(rng):
    for _ in range(50):
        rows, world = int(rng.integers(0, 40)), int(rng.integers(1, 6))
        bounds = [rank_bounds(rows, rank, world) for rank in range(world)]
        assert tuple(stop - start for start, stop in bounds) == split_rows(rows, (1.0,) * world)
        assert bounds[0][0] == 0 and bounds[-1][1] == rows
        assert all(bounds[i][1] == bounds[i + 1][0] for i in range(world - 1))
    whole = Sampler(np.arange(101), 16, True, 7, False)
    parts = [RankSlices(whole, rank, 3) for rank in range(3)]
    assert all(p.batches_per_epoch() == whole.batches_per_epoch() == 7 for p in parts)
    start = SamplerState(2, 3)  # resumable: the same states, from anywhere
    for batches in zip(whole.batches(start), *(p.batches(start) for p in parts), strict=True):
        (state, batch), *cut = batches
        assert all(s == state for s, _ in cut)
        np.testing.assert_array_equal(np.concatenate([b for _, b in cut]), batch)


def test_a_ranks_plan_shows_the_global_and_its_own_batch():
    spec = _on(synthetic_spec(), "cpu")
    for rank, rows in ((0, 6), (2, 5)):
        the_plan = plan(spec, facts=cpu_facts(), world=World(rank, 3))
        parallel = the_plan.as_dict()["parallel"]
        assert parallel["ranks"] == 3 and parallel["rank"] == rank and parallel["global_batch"] == 16
        assert parallel["batch"] == rows and parallel["rows"] == [rows]
        # One local device, yet the split programs: train to the gradients, then apply.
        assert [d.batch_size for d in the_plan.devices] == [rows] and the_plan.devices[0].apply is not None
    assert plan(spec, facts=cpu_facts()).parallel is None
    assert plan(spec, facts=cpu_facts(), world=World(1, 3), mode="predict").parallel is None
    with pytest.raises(PlanError, match="16 rows cannot be shared by 17 ranks"):
        plan(spec, facts=cpu_facts(), world=World(0, 17))


# -- under mpiexec ---------------------------------------------------------------------------------


def _mpiexec(tmp_path: Path, ranks: int, *args: str, env: dict | None = None, timeout: float = 240):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MV2_"))}
    # Open MPI refuses root and more ranks than cores unless told (CI runs as root), and wants an
    # ssh agent even for local ranks (a container has none; local ranks are forked, never run
    # through it, so /bin/false satisfies the check); MPICH ignores all of these.
    clean.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                 OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_plm_rsh_agent="false")  # fmt: skip
    command = [MPIEXEC, "-n", str(ranks), sys.executable, *args]
    started = time.monotonic()
    done = subprocess.run(command, cwd=tmp_path, env={**clean, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    return done, time.monotonic() - started


def _written(tmp_path: Path, name: str, spec) -> str:
    """``spec`` saved as ``name``.json, writing under ``tmp_path / name``."""
    where = tmp_path / name
    paths = {"checkpoint_dir": str(where / "ckpt"), "metrics_file": str(where / "m.jsonl")}
    run = dataclasses.replace(spec.run, **paths)
    save(dataclasses.replace(spec, run=run), tmp_path / f"{name}.json")
    return f"{name}.json"


def _final(tmp_path: Path, name: str) -> np.ndarray:
    return checkpoints.load(tmp_path / name / "ckpt").state["params:all"]


def _resumes_exactly(tmp_path, spec) -> None:
    """Two ranks stop ``spec`` (39 steps) at step 15 and resume to the end: the bits of the
    uninterrupted two-rank run under ``tmp_path / "mpi"``."""
    half = dataclasses.replace(spec, run=dataclasses.replace(spec.run, epochs=None, steps=15))
    done, _ = _mpiexec(tmp_path, 2, "-m", "flow", "run", _written(tmp_path, "resumed", half))
    assert done.returncode == 0, done.stdout + done.stderr
    rest = _written(tmp_path, "resumed", spec)
    done, _ = _mpiexec(tmp_path, 2, "-m", "flow", "run", rest, "--resume", str(tmp_path / "resumed" / "ckpt"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert checkpoints.load(tmp_path / "resumed" / "ckpt").cursor.step == 39
    np.testing.assert_array_equal(_final(tmp_path, "resumed"), _final(tmp_path, "mpi"))


def _outputs(tmp_path: Path, name: str) -> tuple[list[str], list[tuple[int, float]]]:
    """The checkpoint files and the metrics' (step, loss) lines of a run."""
    files = sorted(p.name for p in (tmp_path / name / "ckpt").iterdir() if not p.name.startswith("."))
    lines = [json.loads(line) for line in (tmp_path / name / "m.jsonl").read_text().splitlines()]
    return files, [(e["step"], e["loss"]) for e in lines if e.get("event") == "step"]


@needs_mpi
def test_two_ranks_train_as_one_process_and_only_rank_0_writes(tmp_path):
    """``mpiexec -n 2 python -m flow run``: the same bits as one process whose two members are the
    CPU backend (the ranks add their gradients in the same order), within float tolerance of one
    device; the checkpoints and the metrics are rank 0's alone, and a resume is exact."""
    spec = synthetic_spec(epochs=3, checkpoint_every=5)
    done, _ = _mpiexec(tmp_path, 2, "-m", "flow", "run", _written(tmp_path, "mpi", spec),
                       env={"VKFLOW_CHECK_EVERY": "1"})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    flow.run(tmp_path / _written(tmp_path, "one", _on(spec, ("cpu", "cpu"))))
    flow.run(tmp_path / _written(tmp_path, "alone", spec))
    np.testing.assert_array_equal(_final(tmp_path, "mpi"), _final(tmp_path, "one"))
    files, steps = _outputs(tmp_path, "mpi")
    assert (files, steps) == _outputs(tmp_path, "one")
    assert len(steps) == 39 and files[-1] == "step-00000039.ckpt"
    assert (tmp_path / "mpi" / "m.jsonl").read_text().count('"event": "run"') == 1  # rank 1 wrote nothing
    assert len({checkpoints.run_of(tmp_path / "mpi" / "ckpt" / name) for name in files}) == 1
    np.testing.assert_allclose(_final(tmp_path, "mpi"), _final(tmp_path, "alone"), rtol=1e-4, atol=1e-5)

    # Resume with two ranks: stop at step 15, then go on to the end: the same bits.
    _resumes_exactly(tmp_path, spec)


@needs_mpi
def test_two_ranks_on_lavapipe_train_as_one_device(tmp_path, vulkan_backend):
    spec = _on(synthetic_spec(epochs=2, checkpoint_every=13), vulkan_backend.facts.index)
    done, _ = _mpiexec(tmp_path, 2, "-m", "flow", "run", _written(tmp_path, "mpi", spec),
                       env={"VKFLOW_CHECK_EVERY": "1"})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("steps: 26") == 1, done.stdout  # one summary, from rank 0
    flow.run(tmp_path / _written(tmp_path, "one", spec))
    files, steps = _outputs(tmp_path, "mpi")
    assert len(steps) == 26 and files == _outputs(tmp_path, "one")[0]
    np.testing.assert_allclose(_final(tmp_path, "mpi"), _final(tmp_path, "one"), rtol=1e-3, atol=1e-4)


# A rank's script: train, with what goes wrong (argv[2]) on rank 1 (or argv[3]) patched in first.
SCRIPT = """
import os, signal, sys, time
import flow
from actors.data_parallel import DataParallelActor
from actors.engine import Engine

from flow.parallel_plan import world_from_env

fault, rank = sys.argv[2], world_from_env(os.environ).rank
at_fault = int(sys.argv[3]) if len(sys.argv) > 3 else 1
step = DataParallelActor.step

def faulty(self, batch):
    if rank == at_fault and batch.split == "train" and batch.step == 7:
        if fault == "dies":  # kill -9
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "hangs":
            time.sleep(600)
    return step(self, batch)

DataParallelActor.step = faulty
if fault == "drifts" and rank == 1:
    weights = Engine.weights
    Engine.weights = lambda self: weights(self) + 1.0
flow.run(sys.argv[1])
"""


@needs_mpi
@pytest.mark.parametrize("fault", ["drifts", "dies", "hangs"])
def test_a_rank_that_drifts_dies_or_hangs_stops_the_job(tmp_path, fault):
    """Weights that differ stop every rank at the next check, naming the rank; a rank that dies
    or stops answering ends the job within its deadline, and the output names it; the last
    checkpoint stays intact."""
    (tmp_path / "rank.py").write_text(SCRIPT)
    spec = _written(tmp_path, "mpi", synthetic_spec(epochs=3, checkpoint_every=5))
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = {"VKFLOW_CHECK_EVERY": "4", "VKFLOW_MPI_DEADLINE": "5", "PYTHONPATH": path}
    done, seconds = _mpiexec(tmp_path, 2, "rank.py", spec, fault, env=env, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode != 0 and seconds < 60, said
    if fault == "drifts":  # found at step 4, before any checkpoint of weights that differ
        assert "the weights of rank 1 differ from rank 0's after step 4" in said
        assert not checkpoints.checkpoints(tmp_path / "mpi" / "ckpt")
        return
    if fault == "hangs":  # rank 0 probed rank 1, which did not answer
        assert "vkflow: rank 0 of 2: rank 1 did not answer within 5 s (the rows of train batch 7): " \
               "it died or hung; aborting the MPI job" in said  # fmt: skip
        assert checkpoints.load(tmp_path / "mpi" / "ckpt").cursor.step == 5, said
        return
    # A dead rank: rank 0's watch thread sees its connection close and names it (actors.rank_watch),
    # then the launcher ends the job. Rank 0 may be stopped while its sink is still writing the
    # step-5 checkpoint (it lags the device): what is on disk is then nothing or intact.
    if checkpoints.checkpoints(tmp_path / "mpi" / "ckpt"):
        assert checkpoints.load(tmp_path / "mpi" / "ckpt").cursor.step == 5, said
    if not HYDRA:
        pytest.skip("Open MPI's daemon ends the job the moment a rank dies, before the survivors can "
                    "name it (actors.rank_watch says why); it names the rank itself")  # fmt: skip
    pid = re.search(r"vkflow: rank 0 is pid \d+ on \S+, rank 1 is (pid \d+ on [^,\s]+)", said)
    assert pid and f"vkflow: rank 0 of 2: rank 1 ({pid[1]}) died: its connection to rank 0 closed " \
                   "without a goodbye; aborting the MPI job" in said, said  # fmt: skip


@needs_mpi
def test_the_ranks_that_wait_name_the_rank_that_hangs(tmp_path):
    """Three ranks, rank 1 hangs: past the deadline, ranks 0 and 2 probe each other and rank 1, and
    name rank 1 alone (whichever aborts first may stop the other before it prints)."""
    (tmp_path / "rank.py").write_text(SCRIPT)
    spec = _written(tmp_path, "mpi", synthetic_spec(epochs=3, checkpoint_every=5))
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = {"VKFLOW_CHECK_EVERY": "4", "VKFLOW_MPI_DEADLINE": "3", "PYTHONPATH": path}
    done, seconds = _mpiexec(tmp_path, 3, "rank.py", spec, "hangs", env=env, timeout=120)
    said = done.stdout + done.stderr
    lines = re.findall(r"vkflow: rank (\d) of 3: (.*?) did not answer within 3 s", said)
    assert done.returncode != 0 and seconds < 30 and lines, said
    assert {rank for rank, _ in lines} <= {"0", "2"} and {who for _, who in lines} == {"rank 1"}, said
    assert checkpoints.load(tmp_path / "mpi" / "ckpt").cursor.step == 5, said


@needs_mpi
@pytest.mark.skipif(not HYDRA, reason="Open MPI's daemon ends the job the moment a rank dies, before the "
                    "survivors can name it (actors.rank_watch says why)")  # fmt: skip
def test_the_other_ranks_name_rank_0_when_it_dies(tmp_path):
    """Three ranks, rank 0 killed: ranks 1 and 2 each hold a connection to it, and the first to see
    it close names it (the launcher may stop the other before it prints)."""
    (tmp_path / "rank.py").write_text(SCRIPT)
    spec = _written(tmp_path, "mpi", synthetic_spec(epochs=3, checkpoint_every=5))
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = {"VKFLOW_MPI_DEADLINE": "60", "PYTHONPATH": path}  # the deadline never comes into it
    done, seconds = _mpiexec(tmp_path, 3, "rank.py", spec, "dies", "0", env=env, timeout=120)
    said = done.stdout + done.stderr
    pid = re.search(r"vkflow: rank 0 is (pid \d+ on [^,\s]+),", said)
    lines = re.findall(r"vkflow: rank (\d) of 3: rank 0 \((.*?)\) died: its connection", said)
    assert done.returncode != 0 and seconds < 30 and pid and lines, said
    assert {rank for rank, _ in lines} <= {"1", "2"} and {who for _, who in lines} == {pid[1]}, said
    if checkpoints.checkpoints(tmp_path / "mpi" / "ckpt"):
        assert checkpoints.load(tmp_path / "mpi" / "ckpt").cursor.step == 5, said


def test_plan_shows_the_ranks_part_of_each_global_batch():
    """``flow plan`` under a launcher's environment (no MPI started): this rank's rows of each
    global batch, in the text and the JSON."""
    example = str(ROOT / "examples" / "digits.json")
    env = {**os.environ, "PMI_RANK": "1", "PMI_SIZE": "3"}
    text = subprocess.run([sys.executable, "-m", "flow", "plan", example], capture_output=True, text=True,
                          env=env, cwd=ROOT, check=True).stdout  # fmt: skip
    assert "MPI rank 1 of 3: 21 rows of each global batch of 64" in text
    assert "data parallel over 1 device: rows of a batch of 21 [21]" in text


@needs_mpi
def test_two_ranks_with_running_statistics_train_and_agree_on_the_weights(tmp_path):
    """BatchNorm's running statistics come from each rank's own shards (as under DDP without buffer
    broadcasts), so the ranks compare their trainable weights only: a BatchNorm model trains to the
    end with the weights checked after every step, to the bits of one process of two CPU members."""
    from flow.spec import BatchNorm1d, Linear

    spec = synthetic_spec(epochs=2)
    layers = (Linear(12, activation="relu"), BatchNorm1d(), Linear(3))
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, layers=layers))
    done, _ = _mpiexec(tmp_path, 2, "-m", "flow", "run", _written(tmp_path, "mpi", spec),
                       env={"VKFLOW_CHECK_EVERY": "1"})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("steps: 26") == 1, done.stdout
    # Rank 0's checkpoint: the same bits as member 0's of one process (both normalise by the same
    # shards; the leader's running statistics are shard 0's there too).
    flow.run(tmp_path / _written(tmp_path, "one", _on(spec, ("cpu", "cpu"))))
    np.testing.assert_array_equal(_final(tmp_path, "mpi"), _final(tmp_path, "one"))


def test_run_failures_that_name_a_device_or_ranks_print_one_line():
    from actors.collective import RanksError
    from actors.device import DeviceHung
    from flow.run_command import user_error
    from flow.runtime import ActorError

    hung = DeviceHung("device 1 (cpu (numpy)) did not finish its work within 2.5 s")
    assert user_error(ActorError("device", hung)) == [str(hung)]
    drift = RanksError("the weights of rank 1 differ from rank 0's after step 4")
    assert user_error(ActorError("device", drift)) == [str(drift)]
    assert user_error(ActorError("device", RuntimeError("a bug"))) is None  # vkflow's own: a traceback


@needs_mpi
@pytest.mark.parametrize(
    "ranks, per_rank", [(3, ("cpu",)), (2, ("cpu", "cpu"))], ids=["3 ranks", "2 ranks x 2 devices"]
)
def test_more_ranks_and_devices_per_rank_train_as_one_process(tmp_path, ranks, per_rank):
    """Three ranks (16 rows cut 6/5/5): the same bits as one process of three members. Two ranks
    of two members each: within float tolerance of one process of four (each rank adds its own
    members' gradients first, so the sum is associated differently), with the same steps."""
    spec = _on(synthetic_spec(epochs=2), per_rank if len(per_rank) > 1 else per_rank[0])
    done, _ = _mpiexec(tmp_path, ranks, "-m", "flow", "run", _written(tmp_path, "mpi", spec),
                       env={"VKFLOW_CHECK_EVERY": "1"})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    flow.run(tmp_path / _written(tmp_path, "one", _on(spec, ("cpu",) * (ranks * len(per_rank)))))
    if len(per_rank) == 1:
        np.testing.assert_array_equal(_final(tmp_path, "mpi"), _final(tmp_path, "one"))
        assert _outputs(tmp_path, "mpi") == _outputs(tmp_path, "one")
    else:
        np.testing.assert_allclose(_final(tmp_path, "mpi"), _final(tmp_path, "one"), rtol=1e-5, atol=1e-6)
        (files, steps), (one_files, one_steps) = _outputs(tmp_path, "mpi"), _outputs(tmp_path, "one")
        assert files == one_files and [s for s, _ in steps] == [s for s, _ in one_steps]

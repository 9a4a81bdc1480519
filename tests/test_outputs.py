"""actors.outputs: a training run owns its checkpoint directory and its metrics file. Two live
runs, in one process or in two, never write one output (and a dead run's lock is gone with it); a
fresh run never mixes into another run's checkpoints; the metrics of two runs never mix."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import trio
from conftest import copy_of
from specs import DIGITS, digits

from actors import checkpoint as checkpoints
from actors.messages import StepDone
from actors.meter import Hooks
from actors.outputs import LOCK_NAME, OutputError, open_outputs
from flow.codec import load as load_spec
from flow.inference import predict
from flow.runner import run
from flow.testing import FakeDevice

ROOT = Path(__file__).resolve().parents[1]


class Hold(Hooks):
    """Holds the run at its 4th step until released."""

    def __init__(self) -> None:
        self.holding, self.release = threading.Event(), threading.Event()

    async def received(self, actor, item) -> None:
        if actor == "sink" and isinstance(item, StepDone) and item.step == 3:
            self.holding.set()
            await trio.to_thread.run_sync(self.release.wait, 30)


def test_two_live_runs_in_one_process_never_write_one_output(tmp_path):
    spec, hold, outcome = digits(tmp_path), Hold(), []
    first = threading.Thread(target=lambda: outcome.append(run(spec, hooks=[hold])))
    first.start()
    try:
        assert hold.holding.wait(30)
        same_dir = dataclasses.replace(spec, run=dataclasses.replace(spec.run, metrics_file=None))
        with pytest.raises(OutputError, match=re.escape(f"checkpoint_dir {tmp_path / 'a'} is being written")):
            run(same_dir)
        same_metrics = digits(tmp_path, "b", metrics_file=spec.run.metrics_file)
        with pytest.raises(
            OutputError, match=re.escape(f"metrics_file {spec.run.metrics_file} is being written")
        ):
            run(same_metrics)
        assert not (tmp_path / "b" / "step-00000023.ckpt").exists()
    finally:
        hold.release.set()
        first.join(60)
    assert [r.steps for r in outcome] == [23]
    # The first run's files are its own alone, and its end released them: it can be resumed.
    assert {checkpoints.run_of(p) for p in checkpoints.checkpoints(tmp_path / "a")} == {
        checkpoints.load(tmp_path / "a").run}  # fmt: skip
    longer = dataclasses.replace(spec, run=dataclasses.replace(spec.run, epochs=2))
    assert run(longer, resume=tmp_path / "a", backend=FakeDevice()).steps == 46


HOLDER = textwrap.dedent(
    """
    import sys
    import time
    from actors.outputs import open_outputs
    outputs = open_outputs("ab" * 16, sys.argv[1], None, None)
    print("held", flush=True)
    time.sleep(60)
    """
)


def test_a_live_run_in_another_process_holds_the_directory_until_it_dies(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], env=env, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"held\n"
        with pytest.raises(OutputError) as caught:
            open_outputs(checkpoints.new_run_id(), tmp_path, None, None)
        holder = f"(run {'ab' * 16}, pid {child.pid})"
        assert str(caught.value) == f"checkpoint_dir {tmp_path} is being written by another live run {holder}"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    # The kernel dropped the dead run's lock: nothing stale to clear by hand.
    with open_outputs(checkpoints.new_run_id(), tmp_path, None, None) as outputs:
        assert outputs.run


def load_spec_source_images() -> np.ndarray:
    from loaders import open_source

    source = open_source(load_spec(DIGITS).data.source)
    try:
        return source.read(np.arange(64))[0]
    finally:
        source.close()


def test_a_fresh_run_never_mixes_into_another_runs_checkpoints(trained, tmp_path):
    folder, spec = copy_of(trained, tmp_path)
    owner = checkpoints.load(folder).run
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    other = dataclasses.replace(spec, data=dataclasses.replace(spec.data, seed=spec.data.seed + 1))
    with pytest.raises(OutputError) as caught:
        run(other, backend=FakeDevice())
    assert str(caught.value).startswith(
        f"checkpoint_dir {folder} already holds checkpoints of another run (newest step-00000023.ckpt)"
    )
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != LOCK_NAME} == before
    # In its own folder the other run trains; resume and predict from each folder take its own model.
    elsewhere = dataclasses.replace(other, run=digits(tmp_path, "b").run)
    run(elsewhere, backend=FakeDevice())
    x = load_spec_source_images()
    ours, theirs = (predict(f, x, backend=FakeDevice()) for f in (folder, tmp_path / "b"))
    assert np.array_equal(ours, predict(folder / "step-00000023.ckpt", x, backend=FakeDevice()))
    assert not np.allclose(ours, theirs)
    assert checkpoints.load(folder).run == owner != checkpoints.load(tmp_path / "b").run
    # A resumed run may not write into another run's folder, nor over its own newer checkpoints.
    into_theirs = dataclasses.replace(spec, run=dataclasses.replace(elsewhere.run, epochs=2))
    with pytest.raises(
        OutputError, match=re.escape(f"checkpoint_dir {tmp_path / 'b'} holds checkpoints of another run")
    ):
        run(into_theirs, resume=folder, backend=FakeDevice())
    with pytest.raises(
        OutputError, match=re.escape(f"checkpoint_dir {folder} holds checkpoints past step 15")
    ):
        run(spec, resume=folder / "step-00000015.ckpt", backend=FakeDevice())
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != LOCK_NAME} == before


def test_the_metrics_of_two_runs_never_mix(trained, tmp_path):
    folder, spec = copy_of(trained, tmp_path)
    metrics = folder / "metrics.jsonl"
    owner, before = checkpoints.load(folder).run, metrics.read_bytes()
    fresh = digits(tmp_path, "b", metrics_file=str(metrics))
    with pytest.raises(
        OutputError, match=re.escape(f"metrics_file {metrics} already holds the metrics of run {owner}")
    ):
        run(fresh, backend=FakeDevice())
    assert metrics.read_bytes() == before and not checkpoints.checkpoints(tmp_path / "b")
    # A resume appends after a record of its own; each stint's lines follow their record.
    longer = dataclasses.replace(spec, run=dataclasses.replace(spec.run, epochs=2))
    run(longer, resume=folder, backend=FakeDevice())
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    starts = [i for i, r in enumerate(records) if r["event"] == "run"]
    assert starts == [0, starts[1]] and len(records) > starts[1] + 23
    assert [(records[i]["run"], records[i]["step"], records[i]["resumed"]) for i in starts] == [
        (owner, 0, False), (owner, 23, True)]  # fmt: skip
    steps = [
        [r["step"] for r in part if r["event"] == "step"]
        for part in (records[: starts[1]], records[starts[1] :])
    ]
    assert steps == [list(range(23)), list(range(23, 46))]
    # A file without a run record (an older vkflow's, or anything else) is another run's too.
    legacy = tmp_path / "legacy.jsonl"
    legacy.write_text('{"event": "step", "step": 0}\n')
    with pytest.raises(
        OutputError, match=re.escape(f"metrics_file {legacy} already holds the metrics of another run")
    ):
        run(digits(tmp_path, "c", metrics_file=str(legacy)), backend=FakeDevice())
    assert legacy.read_text() == '{"event": "step", "step": 0}\n'

"""Checkpoint files: a faithful round trip, corruption detected, and atomic writes (a failure or a
SIGKILL in the middle of writing never leaves a partial file under a checkpoint's name, and the
previous checkpoint stays loadable)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from actors import checkpoint as checkpoints
from actors.checkpoint import Checkpoint, CheckpointError
from actors.messages import Cursor, Snapshot
from flow.spec import SGD, CrossEntropy, Data, Linear, Model, Spec, Synthetic

ROOT = Path(__file__).resolve().parents[1]


def small_spec() -> Spec:
    return Spec(
        model=Model(input_shape=(4,), layers=(Linear(3),), loss=CrossEntropy()),
        optimiser=SGD(0.1, momentum=0.9),
        data=Data(Synthetic(samples=32, features=(4,), classes=3)),
    )


def checkpoint(step: int, rng: np.random.Generator, size: int = 64) -> Checkpoint:
    state = {"params:all": rng.standard_normal(size).astype(np.float32),
             "state:momentum": rng.standard_normal(size).astype(np.float32)}  # fmt: skip
    return Checkpoint(spec=small_spec(), cursor=Cursor(step, step // 3, step % 3), state=state,
                      optimiser={"kind": "SGD", "state": ["momentum"]})  # fmt: skip


def test_round_trip_keeps_every_bit(tmp_path, rng):
    original = checkpoint(7, rng)
    original.state["params:all"][0] = np.float32(-0.0)
    original.state["params:all"][1] = np.float32(np.nextafter(np.float32(0), np.float32(1)))  # a subnormal
    path = checkpoints.save(tmp_path, original)
    assert path.name == "step-00000007.ckpt"
    loaded = checkpoints.load(tmp_path)
    assert loaded.spec == original.spec and loaded.cursor == Cursor(7, 2, 1)
    assert loaded.optimiser == original.optimiser and not loaded.final and loaded.created > 0
    for name, value in original.state.items():
        assert loaded.state[name].dtype == np.float32
        assert loaded.state[name].tobytes() == value.tobytes()
    assert loaded.rng == {"init_seed": 0, "data_seed": 0, "epoch": 2, "position": 1}


def test_from_snapshot_carries_the_flags(rng):
    snap = Snapshot(Cursor(5, 1, 2), {"params:all": np.zeros(4, np.float32)}, final=False, interrupted=True)
    made = checkpoints.from_snapshot(small_spec(), snap, {"kind": "SGD", "state": []})
    assert made.interrupted and not made.final and made.cursor == Cursor(5, 1, 2) and made.created > 0


def test_corruption_and_missing_files_are_reported(tmp_path, rng):
    path = checkpoints.save(tmp_path, checkpoint(3, rng))
    data = bytearray(path.read_bytes())
    params = checkpoints.load(path).state["params:all"].tobytes()
    at = bytes(data).index(params[:16])
    data[at + 5] ^= 0xFF  # flip bits inside the array's bytes: msgpack still parses
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        checkpoints.load(path)
    path.write_bytes(b"not msgpack at all \xc1")
    with pytest.raises(CheckpointError):
        checkpoints.load(path)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        checkpoints.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint"):
        checkpoints.load(tmp_path / "empty")


def test_only_the_newest_are_kept(tmp_path, rng):
    for step in (5, 10, 15, 20, 25):
        checkpoints.save(tmp_path, checkpoint(step, rng), keep=3)
    assert [p.name for p in checkpoints.checkpoints(tmp_path)] == [
        "step-00000015.ckpt", "step-00000020.ckpt", "step-00000025.ckpt"]  # fmt: skip
    assert checkpoints.load(tmp_path).cursor.step == 25


def test_a_failure_while_writing_leaves_the_old_checkpoint(tmp_path, rng, monkeypatch):
    old = checkpoint(10, rng)
    checkpoints.save(tmp_path, old)

    def write_half_then_fail(file, data: bytes) -> None:
        file.write(data[: len(data) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(checkpoints, "_write_all", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        checkpoints.save(tmp_path, checkpoint(20, rng))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000010.ckpt"]  # no partial file, no temp
    assert checkpoints.load(tmp_path).state["params:all"].tobytes() == old.state["params:all"].tobytes()
    # Rewriting the same step (an interrupt right after a scheduled checkpoint) fails the same way.
    with pytest.raises(OSError, match="disk full"):
        checkpoints.save(tmp_path, checkpoint(10, rng))
    assert checkpoints.load(tmp_path).state["params:all"].tobytes() == old.state["params:all"].tobytes()

    # A failure between writing and renaming too (fsync): same outcome.
    monkeypatch.undo()
    real_fsync = os.fsync
    calls = []

    def failing_fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError("I/O error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="I/O error"):
        checkpoints.save(tmp_path, checkpoint(30, rng))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000010.ckpt"]


WRITER = textwrap.dedent(
    """
    import sys
    import time
    import numpy as np
    from actors import checkpoint as checkpoints
    from actors.messages import Cursor
    sys.path.insert(0, sys.argv[2])
    from test_checkpoint import small_spec

    def slow_write(file, data):  # a slow disk: most of each save is spent writing
        view = memoryview(data)
        for start in range(0, len(view), 1 << 20):
            file.write(view[start : start + (1 << 20)])
            time.sleep(0.02)

    checkpoints._write_all = slow_write
    step = int(sys.argv[3])
    while True:
        step += 1
        value = np.full(3_000_000, step, np.float32)  # 12 MB: a kill lands mid-write often
        state = {"params:all": value}
        ck = checkpoints.Checkpoint(spec=small_spec(), cursor=Cursor(step, 0, step), state=state)
        checkpoints.save(sys.argv[1], ck, keep=2)
    """
)


def test_sigkill_during_writes_never_leaves_a_partial_checkpoint(tmp_path, rng):
    # Keep the caller's path too: packages may be installed off sys.path's defaults (PYTHONPATH).
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    mid_write = 0
    for attempt in range(1, 5):
        first = attempt * 10_000  # each writer numbers its checkpoints above the last one's
        argv = [sys.executable, "-c", WRITER, str(tmp_path), str(ROOT / "tests"), str(first)]
        child = subprocess.Popen(argv, env=env)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                newest = checkpoints.latest(tmp_path)
                if newest is not None and int(newest.stem.split("-")[1]) > first:
                    break
                time.sleep(0.01)
            time.sleep(float(rng.uniform(0.0, 0.15)))  # somewhere in a later save
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        mid_write += any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
        found = checkpoints.checkpoints(tmp_path)
        assert found, "the writer never finished a checkpoint"
        for path in found:
            loaded = checkpoints.load(path)
            assert np.all(loaded.state["params:all"] == loaded.cursor.step)
    assert mid_write > 0  # at least one kill landed in the middle of a write
    # A later save clears the temporary files the killed writers left.
    checkpoints.save(tmp_path, checkpoint(10**6, rng))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]

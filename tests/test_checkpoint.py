"""Checkpoint files: a faithful round trip, corruption detected, and atomic writes (a failure or a
SIGKILL in the middle of writing never leaves a partial file under a checkpoint's name, and the
previous checkpoint stays loadable). Then whole runs of the bundled Digits: every flipped bit is
refused naming the file, a damaged newest checkpoint names the newest intact one, two writers in
two threads do not collide, and retention is a setting. (Which run owns a checkpoint folder or a
metrics file is test_outputs.py's.)"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from conftest import copy_of
from specs import DIGITS, digits

from actors import checkpoint as checkpoints
from actors.checkpoint import Checkpoint, CheckpointError
from actors.messages import Cursor, Snapshot
from flow.codec import load as load_spec
from flow.errors import SpecError
from flow.inference import predict
from flow.runner import run
from flow.spec import SGD, CrossEntropy, Data, Linear, Model, Spec, Synthetic
from flow.testing import FakeDevice
from flow.validation import check

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
    assert loaded.measured is None  # nothing measured: the key is not written at all
    measured = {"speeds": [1234.5, 99.0], "bandwidth": 2.5e9}
    checkpoints.save(tmp_path / "dp", dataclasses.replace(original, measured=measured))
    assert checkpoints.load(tmp_path / "dp").measured == measured


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


# -- whole runs: integrity and retention -------------------------------------------------------


def test_every_single_bit_flip_is_refused_naming_the_file(trained, tmp_path, rng):
    folder, _ = copy_of(trained, tmp_path)
    path = folder / "step-00000023.ckpt"
    original = path.read_bytes()
    saved = checkpoints.load(path)
    # Every bit of the header, of the cursor, of the embedded spec's lr and seeds, and of the
    # digest, then random bits anywhere: the places where a flip used to load as another run.
    payload_at = 36  # magic 8 + version 4 + run id 16 + length 8
    cursor_at = original.index(b"\xa6cursor", payload_at)
    lr = struct.pack(">d", saved.spec.optimiser.lr)
    spec_at = original.index(b"\xa4spec", payload_at)
    seeds = [at + 5 for at in range(spec_at, len(original)) if original.startswith(b"\xa4seed", at)]
    spans = [(0, payload_at), (cursor_at, cursor_at + 40), (original.index(lr), original.index(lr) + 8),
             *((at, at + 2) for at in seeds[:4]), (len(original) - 32, len(original))]  # fmt: skip
    bits = {byte * 8 + bit for start, end in spans for byte in range(start, end) for bit in range(8)}
    bits |= set(rng.integers(0, len(original) * 8, 400).tolist())
    assert len(seeds) >= 2 and len(bits) > 1000
    for bit in sorted(bits):
        damaged = bytearray(original)
        damaged[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(damaged))
        with pytest.raises(CheckpointError) as caught:
            checkpoints.load(path)
        message = str(caught.value)
        assert message.startswith(f"{path}: ") and "\n" not in message, (bit, message)
        assert "corrupt" in message or "not a vkflow checkpoint" in message, (bit, message)
    path.write_bytes(original)
    assert checkpoints.load(path).cursor == saved.cursor  # the same bytes, whole again, load
    # The entry points a user calls name the file too.
    path.write_bytes(original[:-1] + bytes([original[-1] ^ 4]))
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: corrupt")):
        run(resume=path, backend=FakeDevice())
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: corrupt")):
        predict(path, np.zeros((1, 1, 8, 8), np.float32), backend=FakeDevice())


def reseal(data: bytes, change=None, version: int = checkpoints.VERSION) -> bytes:
    """A checkpoint's bytes with its payload changed and a valid digest: what a bug could write."""
    header = checkpoints._HEADER
    magic, _, run_id, _ = header.unpack_from(data)
    tree = msgpack.unpackb(data[header.size : -32], raw=False)
    if change is not None:
        change(tree)
    payload = msgpack.packb(tree, use_bin_type=True)
    body = header.pack(magic, version, run_id, len(payload)) + payload
    return body + hashlib.blake2b(body, digest_size=32).digest()


def _set(*keys, value):
    def change(tree):
        for key in keys[:-1]:
            tree = tree[key]
        if value is KeyError:
            del tree[keys[-1]]
        else:
            tree[keys[-1]] = value

    return change


@pytest.mark.parametrize(
    "change, expected",
    [
        (_set("arrays", "params:all", "dtype", value="<g4"), "arrays['params:all'].dtype: must name"),
        (_set("arrays", "params:all", "shape", value=[7, 7]), "arrays['params:all'].data: 256 bytes, but"),
        (_set("arrays", "params:all", "data", value=KeyError), "arrays['params:all']: must be a map of"),
        (_set("cursor", value=KeyError), "keys: missing ['cursor']"),
        (_set("cursor", "step", value=-1), "cursor.step: must be an int >= 0, got -1"),
        (_set("cursor", "position", value=True), "cursor.position: must be an int >= 0, got True"),
        (_set("cursor", "epoch", value=3), "its rng block"),
        (_set("final", value=1), "final: must be true or false"),
        (_set("spec", value=b"\x93junk"), "its spec does not load"),
        (_set("measured", value={"speeds": [1.0, -2.0], "bandwidth": None}), "measured: must map speeds"),
        (_set("measured", value={"speeds": [1.0]}), "measured: must map speeds"),
    ],
)
def test_a_well_sealed_but_malformed_file_names_the_file_and_the_field(tmp_path, rng, change, expected):
    path = checkpoints.save(tmp_path, checkpoint(7, rng))
    path.write_bytes(reseal(path.read_bytes(), change))
    with pytest.raises(CheckpointError) as caught:
        checkpoints.load(path)
    assert str(caught.value).startswith(f"{path}: ") and expected in str(caught.value)


def test_other_files_and_formats_are_named(tmp_path, rng):
    path = checkpoints.save(tmp_path, checkpoint(7, rng))
    good = path.read_bytes()
    cases = {
        reseal(good, version=3): "checkpoint format 3; this vkflow reads format 2",
        good[: len(good) // 2]: "corrupt: its contents do not match their checksum (its header declares",
        b"": "not a vkflow checkpoint",
        b"PK\x03\x04 a zip file": "not a vkflow checkpoint",
        # What format 1 wrote: a bare msgpack map.
        msgpack.packb(
            {"format": "vkflow-checkpoint", "version": 1, "arrays": {}}
        ): "written by an older vkflow",
    }
    for data, expected in cases.items():
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=re.escape(f"{path}: ") + ".*" + re.escape(expected)):
            checkpoints.load(path)
    # A renamed file would resume at another step than its name says.
    renamed = tmp_path / checkpoints.file_name(9)
    renamed.write_bytes(good)
    with pytest.raises(
        CheckpointError, match=re.escape(f"{renamed}: its name says step 9 but it holds step 7")
    ):
        checkpoints.load(renamed)


def test_a_damaged_newest_checkpoint_names_the_newest_intact_one(trained, tmp_path):
    folder, spec = copy_of(trained, tmp_path)
    names = [p.name for p in checkpoints.checkpoints(folder)]
    assert names == ["step-00000015.ckpt", "step-00000020.ckpt", "step-00000023.ckpt"]
    newest, middle, oldest = (folder / n for n in reversed(names))
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10
    newest.write_bytes(bytes(data))
    middle.write_bytes(middle.read_bytes()[:1000])  # cut short
    x = np.zeros((2, 1, 8, 8), np.float32)
    for attempt in (
        lambda: checkpoints.load(folder),
        lambda: run(spec, resume=folder, backend=FakeDevice()),
        lambda: predict(folder, x, backend=FakeDevice()),
    ):
        with pytest.raises(CheckpointError) as caught:
            attempt()
        message = str(caught.value)
        assert message.startswith(f"{folder}: its newest checkpoint is damaged ({newest}: corrupt")
        assert f"the newest intact one is {oldest}" in message and "\n" not in message
        assert caught.value.intact == oldest
    assert checkpoints.load(oldest).cursor.step == 15  # named, and loadable when asked for by name
    oldest.unlink()
    with pytest.raises(CheckpointError, match="no older checkpoint there is intact either") as caught:
        checkpoints.load(folder)
    assert caught.value.intact is None


def test_two_writers_in_two_threads_of_one_process_do_not_collide(tmp_path, rng):
    # Large enough that the two writes overlap: both threads save the same steps at the same time.
    made = [checkpoint(step, rng, size=400_000) for step in range(1, 7)]
    barrier, errors = threading.Barrier(2), []

    def writer() -> None:
        try:
            for one in made:
                barrier.wait(timeout=30)
                checkpoints.save(tmp_path, one, keep=None)
        except BaseException as error:  # reported by the assertion below
            errors.append(error)
            barrier.abort()  # the other writer stops waiting for this one

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoints.file_name(s) for s in range(1, 7)]
    for one in made:
        loaded = checkpoints.load(tmp_path / checkpoints.file_name(one.cursor.step))
        assert loaded.state["params:all"].tobytes() == one.state["params:all"].tobytes()


@pytest.mark.parametrize("keep", [1, 2, None])
def test_keep_checkpoints_retains_that_many(tmp_path, keep):
    spec = digits(tmp_path, checkpoint_every=4, keep_checkpoints=keep)
    run(spec, backend=FakeDevice())
    every = [4, 8, 12, 16, 20, 23]
    expected = every if keep is None else every[-keep:]
    assert [p.name for p in checkpoints.checkpoints(tmp_path / "a")] == [
        checkpoints.file_name(s) for s in expected
    ]


def test_keep_checkpoints_is_validated(tmp_path, rng):
    for bad in (0, -2):
        with pytest.raises(
            SpecError,
            match=re.escape(
                f"run.keep_checkpoints: must be > 0 (or null to keep every checkpoint), got {bad}"
            ),
        ):
            check(digits(tmp_path, keep_checkpoints=bad))
    with pytest.raises(ValueError, match="keep must be an int >= 1 or None"):
        checkpoints.save(tmp_path, checkpoint(1, rng), keep=0)
    assert load_spec(DIGITS).run.keep_checkpoints == 3  # a spec file without the field keeps 3

"""Checkpoints: what a run needs to continue exactly, written so that a crash never leaves half a file.

A checkpoint holds the weights and optimiser state (``Engine.state()``: flat float32 arrays), where
the run stands (:class:`Cursor`: step counter and sampler epoch/position), the seeds the random
streams derive from (data order is ``default_rng((seed, epoch))`` and augmentation
``batch_rng(seed, epoch, position)``, so seeds plus the cursor are their exact positions), and the
spec itself (``flow.codec.dumps``). The file is msgpack; each array is raw bytes with its dtype,
shape and a CRC-32.

Writing is atomic: the bytes go to a temporary file in the same directory, which is fsynced, then
``os.replace``d onto the final name, and the directory is fsynced. A reader therefore sees either
the old set of checkpoints or the new one, never a partial file under a checkpoint's name.
Files are named ``step-<8 digits>.ckpt``; the newest (highest step) is the one a resume takes.
"""

from __future__ import annotations

import os
import re
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from actors.messages import Cursor
from flow.codec import dumps, loads
from flow.spec import Spec

FORMAT = "vkflow-checkpoint"
VERSION = 1
_NAME = re.compile(r"^step-(\d{8,})\.ckpt$")
_TEMP = re.compile(r"^\.step-\d{8,}\.ckpt\.(\d+)\.tmp$")
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A file that is not a readable vkflow checkpoint, or a directory without one."""


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """One checkpoint, in memory.

    Attributes:
        spec: the run's spec.
        cursor: where the run stands: steps done and the sampler's epoch and position.
        state: ``params:all`` and ``state:<name>`` arrays (Engine.state()).
        optimiser: {"kind", "state"} (see actors.optimiser.describe).
        final: written at the end of the run.
        interrupted: written after an interruption rather than on schedule.
        created: Unix time of writing.
    """

    spec: Spec
    cursor: Cursor
    state: dict[str, np.ndarray] = field(repr=False)
    optimiser: dict[str, Any] = field(default_factory=dict)
    final: bool = False
    interrupted: bool = False
    created: float = 0.0

    @property
    def rng(self) -> dict[str, int]:
        """The random streams' positions: seeds plus the cursor determine every draw."""
        return {
            "init_seed": self.spec.model.init.seed,
            "data_seed": self.spec.data.seed,
            "epoch": self.cursor.epoch,
            "position": self.cursor.position,
        }


def file_name(step: int) -> str:
    """The file name of the checkpoint after ``step`` steps.

    Args:
        step: steps done.

    Returns:
        ``step-<8 digits>.ckpt``.
    """
    return f"step-{step:08d}.ckpt"


def _array(value: np.ndarray) -> dict[str, Any]:
    data = np.ascontiguousarray(value).tobytes()
    return {"dtype": value.dtype.str, "shape": list(value.shape), "data": data, "crc32": zlib.crc32(data)}


def encode(checkpoint: Checkpoint) -> bytes:
    """A checkpoint as msgpack bytes.

    Args:
        checkpoint: the checkpoint.

    Returns:
        The file's bytes.
    """
    cursor = checkpoint.cursor
    return msgpack.packb(
        {
            "format": FORMAT,
            "version": VERSION,
            "spec": dumps(checkpoint.spec),
            "cursor": {"step": cursor.step, "epoch": cursor.epoch, "position": cursor.position},
            "rng": checkpoint.rng,
            "optimiser": checkpoint.optimiser,
            "arrays": {name: _array(value) for name, value in sorted(checkpoint.state.items())},
            "final": checkpoint.final,
            "interrupted": checkpoint.interrupted,
            "created": checkpoint.created or time.time(),
        },
        use_bin_type=True,
    )


def decode(data: bytes, where: str = "checkpoint") -> Checkpoint:
    """A checkpoint from its bytes, every array checked against its CRC.

    Args:
        data: the file's bytes.
        where: how errors name the file.

    Returns:
        The checkpoint.

    Raises:
        CheckpointError: the bytes are not a complete checkpoint of a version this code reads.
    """
    try:
        tree = msgpack.unpackb(data, raw=False)
    except Exception as error:  # msgpack raises several types on bad bytes; all mean "not a checkpoint"
        raise CheckpointError(f"{where}: not a checkpoint ({error})") from error
    if not isinstance(tree, dict) or tree.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a vkflow checkpoint")
    if tree.get("version") != VERSION:
        raise CheckpointError(
            f"{where}: checkpoint version {tree.get('version')!r}; this vkflow reads {VERSION}"
        )
    state = {}
    for name, item in tree["arrays"].items():
        if zlib.crc32(item["data"]) != item["crc32"]:
            raise CheckpointError(f"{where}: array {name!r} is corrupt (CRC mismatch)")
        state[name] = np.frombuffer(item["data"], dtype=np.dtype(item["dtype"])).reshape(item["shape"]).copy()
    cursor = Cursor(**tree["cursor"])
    return Checkpoint(
        spec=loads(tree["spec"]),
        cursor=cursor,
        state=state,
        optimiser=tree["optimiser"],
        final=tree["final"],
        interrupted=tree["interrupted"],
        created=tree["created"],
    )


def _write_all(file, data: bytes) -> None:
    """Write in chunks (a kill mid-write leaves a partial temporary file, never a partial checkpoint)."""
    view = memoryview(data)
    for start in range(0, len(view), _CHUNK):
        file.write(view[start : start + _CHUNK])


def _fsync_dir(directory: Path) -> None:
    # Why: the rename lives in the directory's entry; without this a power cut can undo it.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(directory: Path) -> None:
    """Temporary files left by a writer that was killed (its process is gone)."""
    for path in directory.iterdir():
        match = _TEMP.match(path.name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            path.unlink(missing_ok=True)


def checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The checkpoint files in a directory, oldest (lowest step) first.

    Args:
        directory: the checkpoint directory.

    Returns:
        Their paths; empty when the directory is missing or has none.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest checkpoint in a directory.

    Args:
        directory: the checkpoint directory.

    Returns:
        Its path, or None when there is none.
    """
    found = checkpoints(directory)
    return found[-1] if found else None


def save(directory: str | os.PathLike, checkpoint: Checkpoint, keep: int = 3) -> Path:
    """Write a checkpoint atomically (see the module docstring) and keep only the newest ``keep``.

    Args:
        directory: where (created if missing).
        checkpoint: what.
        keep: how many checkpoints to keep, the new one included; older ones are removed.

    Returns:
        The new file's path.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(directory)
    final = directory / file_name(checkpoint.cursor.step)
    temp = directory / f".{final.name}.{os.getpid()}.tmp"
    data = encode(checkpoint)
    try:
        with open(temp, "wb") as file:
            _write_all(file, data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    for old in checkpoints(directory)[:-keep] if keep > 0 else []:
        if old != final:
            old.unlink(missing_ok=True)
    return final


def load(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint file, or the newest checkpoint in a directory.

    Args:
        path: a ``.ckpt`` file or a checkpoint directory.

    Returns:
        The checkpoint.

    Raises:
        CheckpointError: no checkpoint there, or not a readable one.
    """
    path = Path(path)
    if path.is_dir():
        newest = latest(path)
        if newest is None:
            raise CheckpointError(f"{path}: no checkpoint (step-*.ckpt) in this directory")
        path = newest
    try:
        data = path.read_bytes()
    except FileNotFoundError as error:
        raise CheckpointError(f"{path}: no such checkpoint") from error
    return decode(data, str(path))


def from_snapshot(spec: Spec, snapshot, optimiser: dict[str, Any]) -> Checkpoint:
    """The checkpoint for a device snapshot.

    Args:
        spec: the run's spec.
        snapshot: an actors.messages.Snapshot.
        optimiser: what actors.optimiser.describe returned.

    Returns:
        The checkpoint, stamped with the time now.
    """
    return Checkpoint(
        spec=spec,
        cursor=snapshot.cursor,
        state=snapshot.state,
        optimiser=optimiser,
        final=snapshot.final,
        interrupted=snapshot.interrupted,
        created=time.time(),
    )

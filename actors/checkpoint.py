"""Checkpoints: what a run needs to continue exactly, written so that a crash never leaves half a
file, and read so that a damaged file is never taken for a good one.

A checkpoint holds the weights and optimiser state (``Engine.state()``: flat float32 arrays), where
the run stands (:class:`Cursor`: step counter and sampler epoch/position), the seeds the random
streams derive from (data order is ``default_rng((seed, epoch))`` and augmentation
``batch_rng(seed, epoch, position)``, so seeds plus the cursor are their exact positions), the spec
itself (``flow.codec.dumps``) and the id of the run that wrote it (a fresh run draws one; a resumed
run keeps its checkpoint's), by which actors.outputs keeps each directory to one run. Optional
keys, absent from older files: what a data-parallel run measured, and a Text source's vocabulary.

The file (format 2) is a fixed header, a msgpack payload and a digest::

    "VKFLOWCK" | format u32 | run id (16 bytes) | payload length u64 | payload | BLAKE2b-256

The digest covers every byte before it, not only the arrays: one flipped bit in a cursor field or
in the embedded spec's learning rate would otherwise load as another run. Reading checks the
digest first, then the structure (every key and its type, each array's dtype and byte count
against its shape, cursor fields ints >= 0, the rng block against spec and cursor, the step in
the file's name against its cursor), so every defect is a :class:`CheckpointError` that names the
file. BLAKE2b rather than a CRC: a CRC-32 is made to catch burst errors, a 256-bit digest any
change, and hashlib's runs at about a GB/s, small beside the fsync.

Writing is atomic: the bytes go to a temporary file in the same directory, which is fsynced, then
``os.replace``d onto the final name, and the directory is fsynced. A reader therefore sees either
the old set of checkpoints or the new one, never a partial file under a checkpoint's name. A
temporary file's name holds its writer's pid and a random id, so two writers in one process (two
runs in two threads) never share one. Files are named ``step-<8 digits>.ckpt``; the newest
(highest step) is the one a resume takes, and when it is damaged loading says so and names the
newest intact one rather than falling back silently.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import struct
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from actors.messages import Cursor
from flow.codec import dumps, loads
from flow.spec import Spec, Text
from loaders.text import opened_vocabulary

MAGIC = b"VKFLOWCK"
VERSION = 2
_HEADER = struct.Struct("<8sI16sQ")  # magic, format version, run id, payload bytes
_DIGEST = 32  # BLAKE2b-256, the file's last bytes
_LEGACY = "vkflow-checkpoint"  # format 1 was a bare msgpack map with this "format" key
_NAME = re.compile(r"^step-(\d{8,})\.ckpt$")
# Format-1 writers named temps by pid only; both kinds are cleaned up after a dead writer.
_TEMP = re.compile(r"^\.(?:step-\d{8,}|best)\.ckpt\.(\d+)(?:\.[0-9a-f]{32})?\.tmp$")
BEST = "best.ckpt"  # a SaveBest callback's (flow.spec.SaveBest): no step- name, so no retention takes it
_KEYS = ("arrays", "created", "cursor", "final", "interrupted", "optimiser", "rng", "spec")
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A file that is not a readable vkflow checkpoint, or a directory without one.

    Attributes:
        intact: when loading a directory whose newest checkpoint is damaged, the newest intact
            one (None when there is none, or for other errors).
    """

    def __init__(self, message: str, intact: Path | None = None) -> None:
        super().__init__(message)
        self.intact = intact


def new_run_id() -> str:
    """A fresh run's id.

    Returns:
        32 hex digits (a random UUID).
    """
    return uuid.uuid4().hex


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """One checkpoint, in memory.

    Attributes:
        spec: the run's spec.
        cursor: where the run stands: steps done and the sampler's epoch and position.
        state: ``params:all`` and ``state:<name>`` arrays (Engine.state()).
        optimiser: {"kind", "state"} (see flow.optim.describe_optimiser).
        final: written at the end of the run.
        interrupted: written after an interruption rather than on schedule.
        created: Unix time of writing.
        run: the id of the run that wrote it (32 hex digits); one made without an id is a run of
            its own.
        measured: what a data-parallel run measured before its first step ({"speeds": samples/s
            per member, "bandwidth": the all-reduce's bytes/s or None}), which decided its members
            and their rows; a resume asking for the same devices plans from it again instead of
            measuring anew, so it keeps them and stays exact. None: nothing was measured.
        vocabulary: a Text source's vocabulary (loaders.text: a str of characters, or the 256
            bytes), so that generation maps ids to text without the training file. None: the
            source is not text.
    """

    spec: Spec
    cursor: Cursor
    state: dict[str, np.ndarray] = field(repr=False)
    optimiser: dict[str, Any] = field(default_factory=dict)
    final: bool = False
    interrupted: bool = False
    created: float = 0.0
    run: str = field(default_factory=new_run_id)
    measured: dict[str, Any] | None = None
    vocabulary: str | bytes | None = None

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
    # The bytes as a view: msgpack packs it as it packs bytes, without a copy of the array first.
    data = memoryview(np.ascontiguousarray(value)).cast("B")
    return {"dtype": value.dtype.str, "shape": list(value.shape), "data": data}


def _run_bytes(run: str) -> bytes:
    try:
        raw = bytes.fromhex(run)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != 16:
        raise ValueError(f"a run id is 32 hex digits, got {run!r}")
    return raw


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST).digest()


def encode(checkpoint: Checkpoint) -> bytes:
    """A checkpoint as the file's bytes (see the module docstring for the layout).

    Args:
        checkpoint: the checkpoint.

    Returns:
        The file's bytes.

    Raises:
        ValueError: the checkpoint's run id is not 32 hex digits.
    """
    return b"".join(_encoded(checkpoint))


def _encoded(checkpoint: Checkpoint) -> tuple[bytes, bytes, bytes]:
    """The file's three parts, header, payload and digest: :func:`save` writes them one after the
    other rather than joining them into one more copy of the arrays."""
    cursor = checkpoint.cursor
    measured = {"measured": checkpoint.measured} if checkpoint.measured is not None else {}
    if checkpoint.vocabulary is not None:  # optional keys, so that older checkpoints still load
        measured["vocabulary"] = checkpoint.vocabulary
    payload = msgpack.packb(
        {
            **measured,
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
    header = _HEADER.pack(MAGIC, VERSION, _run_bytes(checkpoint.run), len(payload))
    digest = hashlib.blake2b(header, digest_size=_DIGEST)
    digest.update(payload)
    return header, payload, digest.digest()


def _foreign(data: bytes) -> str:
    """Why bytes without the header are not a checkpoint this code reads."""
    tree = None
    if data[:1] and (0x80 <= data[0] <= 0x8F or data[0] in (0xDE, 0xDF)):  # a msgpack map: format 1?
        try:
            tree = msgpack.unpackb(data, raw=False)
        except Exception:  # msgpack raises several types on bad bytes; all mean "not format 1"
            tree = None
    if isinstance(tree, dict) and tree.get("format") == _LEGACY:
        return (
            f"written by an older vkflow (checkpoint format {tree.get('version')!r}); this vkflow reads "
            f"format {VERSION} only: load it with the vkflow that wrote it, or train again"
        )
    return (
        "not a vkflow checkpoint (it does not begin with the VKFLOWCK header: another file, or a damaged one)"
    )


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0  # type(): a bool is an int to isinstance


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _array_problems(name: Any, item: Any) -> list[str]:
    where = f"arrays[{_show(name)}]"
    if not isinstance(name, str) or not name:
        return [f"{where}: an array's name must be a non-empty string"]
    if not isinstance(item, dict) or set(item) != {"data", "dtype", "shape"}:
        return [f"{where}: must be a map of dtype, shape and data, got {_show(item)}"]
    problems = []
    dtype = None
    try:
        dtype = np.dtype(item["dtype"]) if isinstance(item["dtype"], str) else None
    except (TypeError, ValueError):
        pass
    if dtype is None or dtype.kind not in "biuf" or not dtype.isnative:
        problems.append(f"{where}.dtype: must name a native numeric dtype, got {_show(item['dtype'])}")
    shape = item["shape"]
    if not isinstance(shape, list) or not all(_count(n) for n in shape):
        problems.append(f"{where}.shape: must be a list of ints >= 0, got {_show(shape)}")
        shape = None
    data = item["data"]
    if not isinstance(data, bytes):
        problems.append(f"{where}.data: must be bytes, got {type(data).__name__}")
    elif dtype is not None and shape is not None and len(data) != math.prod(shape) * dtype.itemsize:
        problems.append(
            f"{where}.data: {len(data)} bytes, but shape {shape} of {dtype} needs "
            f"{math.prod(shape) * dtype.itemsize}"
        )
    return problems


def _measurement(value: Any) -> bool:
    """Whether ``value`` is a Checkpoint.measured map."""

    def rate(v: Any) -> bool:
        return type(v) in (int, float) and v > 0

    return (
        isinstance(value, dict)
        and set(value) == {"speeds", "bandwidth"}
        and isinstance(value["speeds"], list)
        and all(rate(v) for v in value["speeds"])
        and (value["bandwidth"] is None or rate(value["bandwidth"]))
    )


def _problems(tree: Any) -> list[str]:
    """Everything wrong with a payload's structure (empty when a Checkpoint can be built from it)."""
    if not isinstance(tree, dict):
        return [f"the payload must be a map, got {type(tree).__name__}"]
    missing = [key for key in _KEYS if key not in tree]
    extra = sorted(str(key) for key in tree if key not in (*_KEYS, "measured", "vocabulary"))
    if missing or extra:
        return [f"keys: missing {missing}, unexpected {extra}"]
    problems = []
    if not isinstance(tree["spec"], bytes):
        problems.append(f"spec: must be bytes, got {type(tree['spec']).__name__}")
    for key, fields in (("cursor", ("epoch", "position", "step")),
                        ("rng", ("data_seed", "epoch", "init_seed", "position"))):  # fmt: skip
        value = tree[key]
        if not isinstance(value, dict) or set(value) != set(fields):
            problems.append(f"{key}: must be a map of {', '.join(fields)}, got {_show(value)}")
            continue
        problems += [
            f"{key}.{f}: must be an int >= 0, got {_show(value[f])}" for f in fields if not _count(value[f])
        ]
    optimiser = tree["optimiser"]
    if not isinstance(optimiser, dict) or not all(
        isinstance(k, str)
        and (isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)))
        for k, v in optimiser.items()
    ):
        problems.append(f"optimiser: must map names to strings or lists of strings, got {_show(optimiser)}")
    for key in ("final", "interrupted"):
        if not isinstance(tree[key], bool):
            problems.append(f"{key}: must be true or false, got {_show(tree[key])}")
    measured = tree.get("measured")
    if measured is not None and not _measurement(measured):
        problems.append(f"measured: must map speeds (each > 0) and bandwidth (> 0, null): {_show(measured)}")
    vocabulary = tree.get("vocabulary")
    if vocabulary is not None and not (isinstance(vocabulary, (str, bytes)) and vocabulary):
        problems.append(f"vocabulary: must be a non-empty string or bytes, got {_show(vocabulary)}")
    created = tree["created"]
    if type(created) not in (int, float) or not math.isfinite(created) or created < 0:
        problems.append(f"created: must be a time >= 0, got {_show(created)}")
    arrays = tree["arrays"]
    if not isinstance(arrays, dict):
        problems.append(f"arrays: must be a map, got {type(arrays).__name__}")
    else:
        for name, item in arrays.items():
            problems += _array_problems(name, item)
    return problems


def decode(data: bytes, where: str = "checkpoint") -> Checkpoint:
    """A checkpoint from its bytes: the digest checked over the whole file, then its structure.

    Args:
        data: the file's bytes.
        where: how errors name the file.

    Returns:
        The checkpoint.

    Raises:
        CheckpointError: naming ``where``: the bytes are not a checkpoint, were changed or cut
            short after writing, are of another format version, or do not hold a well-formed one.
    """
    if data[: len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{where}: {_foreign(data)}")
    view = memoryview(data)
    if len(data) < _HEADER.size + _DIGEST:
        raise CheckpointError(
            f"{where}: corrupt: {len(data)} bytes, shorter than any checkpoint (cut short?)"
        )
    if _digest(view[:-_DIGEST]) != data[-_DIGEST:]:
        declared = _HEADER.size + _HEADER.unpack_from(data)[3] + _DIGEST
        size = (
            f" (its header declares {declared} bytes, it has {len(data)}: cut short?)"
            if declared > len(data)
            else ""
        )
        raise CheckpointError(
            f"{where}: corrupt: its contents do not match their checksum{size}; the file changed after "
            "it was written"
        )
    _, version, run, length = _HEADER.unpack_from(data)
    if version != VERSION:
        raise CheckpointError(f"{where}: checkpoint format {version}; this vkflow reads format {VERSION}")
    if _HEADER.size + length + _DIGEST != len(data):
        raise CheckpointError(
            f"{where}: malformed: its header declares {length} payload bytes, the file holds "
            f"{len(data) - _HEADER.size - _DIGEST}"
        )
    try:
        tree = msgpack.unpackb(view[_HEADER.size : -_DIGEST], raw=False)
    except Exception as error:  # msgpack raises several types on bad bytes; all mean "malformed"
        raise CheckpointError(f"{where}: malformed: the payload is not msgpack ({error})") from error
    problems = _problems(tree)
    if problems:
        raise CheckpointError(f"{where}: malformed: {'; '.join(problems)}")
    try:
        spec = loads(tree["spec"])
    except ValueError as error:  # SpecError: written by a vkflow whose specs this one no longer reads
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"{where}: its spec does not load: {first}") from error
    state = {
        name: np.frombuffer(item["data"], dtype=np.dtype(item["dtype"])).reshape(item["shape"]).copy()
        for name, item in tree["arrays"].items()
    }
    checkpoint = Checkpoint(
        spec=spec,
        cursor=Cursor(**tree["cursor"]),
        state=state,
        optimiser=tree["optimiser"],
        final=tree["final"],
        interrupted=tree["interrupted"],
        created=float(tree["created"]),
        run=run.hex(),
        measured=tree.get("measured"),
        vocabulary=tree.get("vocabulary"),
    )
    if tree["rng"] != checkpoint.rng:
        raise CheckpointError(
            f"{where}: malformed: its rng block {tree['rng']} disagrees with its spec and cursor "
            f"({checkpoint.rng})"
        )
    return checkpoint


def run_of(path: str | os.PathLike) -> str | None:
    """The id of the run that wrote a checkpoint, from its header alone.

    The digest is not checked (that reads the whole file): a damaged id reads as another run's,
    which makes an owner check refuse, never mix.

    Args:
        path: a checkpoint file.

    Returns:
        32 hex digits; None when the file cannot be read or has no format-2 header.
    """
    try:
        with open(path, "rb") as file:
            head = file.read(_HEADER.size)
    except OSError:
        return None
    if len(head) < _HEADER.size:
        return None
    magic, version, run, _ = _HEADER.unpack(head)
    return run.hex() if magic == MAGIC and version == VERSION else None


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


def save(
    directory: str | os.PathLike, checkpoint: Checkpoint, keep: int | None = 3, name: str | None = None
) -> Path:
    """Write a checkpoint atomically (see the module docstring) and keep only the newest ``keep``.

    Retention goes by step number and removes older files whoever wrote them: a run claims its
    directory first (actors.outputs), so they are its own.

    Args:
        directory: where (created if missing).
        checkpoint: what.
        keep: how many checkpoints to keep, the new one included (older ones are removed); None
            keeps every one.
        name: the file's name instead of ``step-<8 digits>.ckpt`` (:data:`BEST`); such a file is
            replaced in place and no retention applies to it or removes it.

    Returns:
        The new file's path.

    Raises:
        ValueError: ``keep`` is not None or an int >= 1.
    """
    if keep is not None and not (_count(keep) and keep >= 1):
        raise ValueError(f"keep must be an int >= 1 or None (keep all), got {keep!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(directory)
    final = directory / (name or file_name(checkpoint.cursor.step))
    # Unique per writer, not per process: two runs in two threads must never rename each other's file.
    temp = directory / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    parts = _encoded(checkpoint)
    try:
        with open(temp, "wb") as file:
            for part in parts:
                _write_all(file, part)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    for old in checkpoints(directory)[:-keep] if keep is not None and name is None else []:
        if old != final:
            old.unlink(missing_ok=True)
    return final


def _read(path: Path, data: bytes) -> Checkpoint:
    checkpoint = decode(data, str(path))
    named = _NAME.match(path.name)
    if named and int(named.group(1)) != checkpoint.cursor.step:
        raise CheckpointError(
            f"{path}: its name says step {int(named.group(1))} but it holds step {checkpoint.cursor.step} "
            "(renamed?); a resume from it would not start where its name says"
        )
    return checkpoint


def _read_file(path: Path) -> Checkpoint:
    try:
        data = path.read_bytes()
    except FileNotFoundError as error:
        raise CheckpointError(f"{path}: no such checkpoint") from error
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from error
    return _read(path, data)


def newest_intact(paths: list[Path]) -> Path | None:
    """The newest of some checkpoint files that reads back whole.

    Args:
        paths: checkpoint files, oldest first (as :func:`checkpoints` lists them).

    Returns:
        Its path, or None when none does.
    """
    for path in reversed(paths):
        try:
            _read_file(path)
        except CheckpointError:
            continue
        return path
    return None


def _load_newest(directory: Path) -> Checkpoint:
    # A live run with keep_checkpoints=1 removes the newest file right after writing a newer one,
    # so a file listed a moment ago may be gone: list again rather than fail.
    for _ in range(5):
        found = checkpoints(directory)
        if not found:
            raise CheckpointError(f"{directory}: no checkpoint (step-*.ckpt) in this directory")
        try:
            data = found[-1].read_bytes()
        except FileNotFoundError:
            continue
        except OSError as error:
            data, failure = None, CheckpointError(f"{found[-1]}: cannot be read ({error.strerror or error})")
        if data is not None:
            try:
                return _read(found[-1], data)
            except CheckpointError as error:
                failure = error
        # Never fall back silently: an older checkpoint is another point of the run. Name it instead.
        intact = newest_intact(found[:-1])
        where = (
            f"the newest intact one is {intact}: resume or predict from that file, or remove the damaged one"
        )
        raise CheckpointError(
            f"{directory}: its newest checkpoint is damaged ({failure}); "
            + (where if intact else "no older checkpoint there is intact either"),
            intact=intact,
        ) from failure
    raise CheckpointError(f"{directory}: its newest checkpoint kept disappearing while being read")


def load(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint file, or the newest checkpoint in a directory.

    Args:
        path: a ``.ckpt`` file or a checkpoint directory.

    Returns:
        The checkpoint.

    Raises:
        CheckpointError: naming the file: no checkpoint there, or not a readable one. For a
            directory whose newest checkpoint is damaged, the message names the newest intact
            one (also in ``error.intact``); nothing older is loaded in its place.
    """
    path = Path(path)
    if path.is_dir():
        return _load_newest(path)
    return _read_file(path)


def from_snapshot(
    spec: Spec,
    snapshot,
    optimiser: dict[str, Any],
    run: str | None = None,
    measured: dict[str, Any] | None = None,
) -> Checkpoint:
    """The checkpoint for a device snapshot.

    Args:
        spec: the run's spec.
        snapshot: an actors.messages.Snapshot.
        optimiser: what flow.optim.describe_optimiser returned.
        run: the run's id; None draws a new one.
        measured: what the run measured before its first step (see Checkpoint.measured).

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
        run=run or new_run_id(),
        measured=measured,
        vocabulary=text_vocabulary(spec),
    )


def text_vocabulary(spec: Spec) -> str | bytes | None:
    """The vocabulary a run of ``spec`` trains on: its Text source's as this process opened it
    (the file is not read again), or None for other sources.

    Args:
        spec: the run's spec.

    Returns:
        The vocabulary, or None.
    """
    source = spec.data.source
    return opened_vocabulary(source.path, source.level) if isinstance(source, Text) else None


def read_vocabulary(path: str | os.PathLike) -> str | bytes | None:
    """The vocabulary saved in a checkpoint (see Checkpoint.vocabulary).

    Args:
        path: a ``.ckpt`` file or a checkpoint directory (its newest checkpoint).

    Returns:
        The vocabulary; None when the run's source was not text.

    Raises:
        CheckpointError: as :func:`load`.
    """
    return load(path).vocabulary

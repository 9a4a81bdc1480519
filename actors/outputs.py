"""Run outputs: a training run owns its checkpoint directory and its metrics file, and no two live
runs write one.

Every run has an id (``checkpoint.new_run_id()`` when it starts fresh; a resumed run keeps its
checkpoint's). Before a training run touches a device, :func:`open_outputs` claims what it will
write, and refuses with one :class:`OutputError` line that names the path and what to do:

- Each output is locked with ``flock`` (exclusive, non-blocking): the hidden ``.vkflow.lock`` in
  the checkpoint directory, and the metrics file itself. Why flock rather than a pid file: the
  kernel drops the lock when its holder's process dies, so a crash or a SIGKILL leaves no stale
  lock to take over; and a flock belongs to an open file, not to a process, so two runs in two
  threads of one process conflict as two processes do. A registry of this process's claims backs
  it up where flock is emulated by per-process locks (NFS). The lock file stays behind: removing
  it would let a run lock a new file while another still holds the old one.
- A checkpoint directory may hold only this run's checkpoints, none past the step it starts at. A
  fresh run takes a directory without checkpoints; a resumed one also a directory whose
  checkpoints all carry its id. A newer one would be another course of the run, and the newest
  file is what ``resume`` and ``predict`` take from a directory.
- A metrics file begins with the ``{"event": "run"}`` record of the run that began it. A fresh
  run takes a missing or empty file; a resumed run one that its own run began. Each process
  appends such a record (``run``, ``step`` it starts at, ``resumed``, ``pid``, ``time``) before its
  lines, so a reader can tell where each stint of the run begins.

Why refuse rather than number run folders (``runs/NAME/version_N``, as Lightning's loggers do): the
spec names its paths, and ``resume`` and ``predict`` take them as given, so a run that wrote
elsewhere would surprise both; an overwrite would lose a trained model, and a mix makes a resume
from the directory load the other run's newest model.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from pathlib import Path
from typing import IO

from actors import checkpoint as checkpoints

LOCK_NAME = ".vkflow.lock"

_held: set[str] = set()  # real paths that runs of this process have claimed
_held_guard = threading.Lock()


class OutputError(ValueError):
    """A checkpoint directory or metrics file that holds another run's output, or that another
    live run is writing."""


def directory_problem(
    directory: Path, run: str, start: int | None, found: list[tuple[int, Path, str | None]]
) -> str | None:
    """Why a run may not write checkpoints into a directory (pure: the caller has looked).

    Args:
        directory: the checkpoint directory.
        run: the run's id.
        start: the step a resumed run starts at; None for a fresh run.
        found: (step, path, id of the run that wrote it or None when unreadable) of each
            checkpoint there, oldest first.

    Returns:
        The refusal, one line naming the directory; None when the run may write there.
    """
    if not found:
        return None
    if start is None:
        return (
            f"checkpoint_dir {directory} already holds checkpoints of another run (newest "
            f"{found[-1][1].name}): resume from it to continue that run, give this run another "
            "checkpoint_dir, or remove them"
        )
    foreign = [path for _, path, owner in found if owner != run]
    if foreign:
        return (
            f"checkpoint_dir {directory} holds checkpoints of another run ({foreign[-1].name}); this "
            f"run (resumed at step {start}) may not write there: give it another checkpoint_dir"
        )
    newer = [path for step, path, _ in found if step > start]
    if newer:
        return (
            f"checkpoint_dir {directory} holds checkpoints past step {start}, where this run resumes "
            f"(newest {newer[-1].name}); they would shadow the resumed run's: remove them, or give it "
            "another checkpoint_dir"
        )
    return None


def metrics_problem(path: Path, run: str, resumed: bool, first_line: str) -> str | None:
    """Why a run may not append to a metrics file (pure: the caller has read its first line).

    Args:
        path: the metrics file.
        run: the run's id.
        resumed: whether the run resumes from a checkpoint.
        first_line: the file's first line; empty for a missing or empty file.

    Returns:
        The refusal, one line naming the file; None when the run may append.
    """
    if not first_line.strip():
        return None
    try:
        record = json.loads(first_line)
    except ValueError:
        record = None
    owner = record.get("run") if isinstance(record, dict) and record.get("event") == "run" else None
    if resumed and owner == run:
        return None
    what = f"run {owner}" if isinstance(owner, str) else "another run, or of an older vkflow"
    resume = "" if resumed else "resume that run, "
    return (
        f"metrics_file {path} already holds the metrics of {what}: {resume}give this run another "
        "metrics_file, or remove it"
    )


class Outputs:
    """The outputs one run has claimed; :meth:`close` releases them.

    Attributes:
        run: the run's id.
    """

    def __init__(self, run: str) -> None:
        self.run = run
        self._files: list[IO[bytes]] = []
        self._keys: list[str] = []

    def _lock(self, path: Path, shown: str) -> IO[bytes]:
        key = os.path.realpath(path)
        with _held_guard:
            if key in _held:
                raise OutputError(f"{shown} is being written by another run of this process")
            _held.add(key)
        self._keys.append(key)
        file = open(path, "a+b")  # created when missing; never truncated
        self._files.append(file)
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read(200).decode("utf-8", "replace").strip() if path.name == LOCK_NAME else ""
            raise OutputError(
                f"{shown} is being written by another live run" + (f" ({holder})" if holder else "")
            ) from None
        return file

    def close(self) -> None:
        """Release the locks (closing a file drops its flock)."""
        for file in self._files:
            file.close()
        self._files.clear()
        with _held_guard:
            _held.difference_update(self._keys)
        self._keys.clear()

    def __enter__(self) -> Outputs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_outputs(
    run: str,
    checkpoint_dir: str | os.PathLike | None,
    metrics_file: str | os.PathLike | None,
    start: int | None,
) -> Outputs:
    """Claim a run's checkpoint directory and metrics file (see the module docstring).

    Args:
        run: the run's id.
        checkpoint_dir: where its checkpoints go (created if missing); None for none.
        metrics_file: its JSON-lines file (created if missing); None for none.
        start: the step a resumed run starts at; None for a fresh run.

    Returns:
        The claimed outputs; close them when the run is over (its last checkpoint written).

    Raises:
        OutputError: another run's output is there, or another live run is writing it.
    """
    outputs = Outputs(run)
    try:
        if checkpoint_dir is not None:
            directory = Path(checkpoint_dir)
            directory.mkdir(parents=True, exist_ok=True)
            lock = outputs._lock(directory / LOCK_NAME, f"checkpoint_dir {directory}")
            found = [
                (int(path.stem.split("-")[1]), path, checkpoints.run_of(path))
                for path in checkpoints.checkpoints(directory)
            ]
            problem = directory_problem(directory, run, start, found)
            if problem:
                raise OutputError(problem)
            # Who holds the lock, for the message a refused run prints.
            lock.seek(0)
            lock.truncate()
            lock.write(f"run {run}, pid {os.getpid()}".encode())
            lock.flush()
        if metrics_file is not None:
            path = Path(metrics_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            file = outputs._lock(path, f"metrics_file {path}")
            file.seek(0)
            first = file.readline().decode("utf-8", "replace")
            problem = metrics_problem(path, run, start is not None, first)
            if problem:
                raise OutputError(problem)
            if file.seek(0, os.SEEK_END) > 0:
                file.seek(-1, os.SEEK_END)
                if file.read(1) != b"\n":
                    file.write(b"\n")  # a killed writer's partial last line stays one bad line, not two
            record = {"event": "run", "run": run, "step": start or 0, "resumed": start is not None,
                      "pid": os.getpid(), "time": round(time.time(), 3)}  # fmt: skip
            file.write((json.dumps(record) + "\n").encode())
            file.flush()
    except BaseException:
        outputs.close()
        raise
    return outputs

"""The ``python -m flow run FILE [--resume DIR] [--device SELECT] [--quiet] [--early-stopping
MONITOR:PATIENCE] [--csv PATH]`` command and the summary it prints (the demo prints it too).

A mistake in what the user gave (the spec, its data, a checkpoint, a device that is not there)
ends the command with one ``error: ...`` line per mistake on stderr and exit status 1, never a
traceback: :func:`user_error` decides which errors those are (a flag's bad value: one ``error:``
line, exit status 2). Anything else is a bug in vkflow, and its traceback is what a bug report
needs, so it is left to propagate.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import replace

from actors.collective import RanksError
from actors.device import DeviceHung
from actors.health import NonFiniteLoss
from actors.progress import Progress
from flow.callbacks import Callback, CSVLogger, EarlyStopping
from flow.codec import load as load_spec
from flow.errors import FlowError
from flow.parallel_plan import world_from_env
from flow.runner import run
from flow.runtime import ActorError, RunResult
from flow.tensorboard_logger import TensorBoardLogger
from loaders.errors import LoaderError


def summary(result: RunResult) -> str:
    """A short report of a run, whose last line is ``accuracy: 0.XXXX`` when there was an evaluation.

    Args:
        result: the run's result.

    Returns:
        The lines, joined.
    """
    lines = [f"device: {result.device}", f"steps: {result.steps} (epochs {result.epochs})"]
    if result.device_choice:
        lines.insert(1, f"device choice: {result.device_choice}")
    if result.stopped_early is not None:
        lines.append(f"stopped early after step {result.stopped_at}: {result.stopped_early}")
    if result.loss is not None:
        lines.append(f"final loss: {result.loss:.4f}")
    if result.checkpoint:
        lines.append(f"checkpoint: {result.checkpoint}")
    if result.skipped:
        shown = ", ".join(result.skipped_examples)
        more = ", ..." if result.skipped > len(result.skipped_examples) else ""
        lines.append(f"skipped: {result.skipped} bad item(s) (on_error='skip'): {shown}{more}")
    if result.inputs is not None:
        x = result.inputs
        lines.append(
            f"inputs: [{x.min:.4g}, {x.max:.4g}], mean {x.mean:.4g}, std {x.std:.3g} "
            "(first training batch, after preprocessing)"
        )
    lines += [f"warning: {message}" for message in result.warnings]
    setup = f" (setup {sum(result.setup.values()):.1f} s)" if result.setup else ""
    lines.append(f"time: {result.seconds:.1f} s{setup}")
    if result.accuracy is not None:
        lines.append(f"accuracy: {result.accuracy:.4f}")
    return "\n".join(lines)


def user_error(error: BaseException, spec_file: str = "") -> list[str] | None:
    """The lines to print for a mistake in the user's input, or None for an error of vkflow's own.

    User mistakes are: a spec that does not load, validate or plan (FlowError: one line a problem,
    each naming the spec file), bad data (LoaderError), a checkpoint that cannot be resumed
    (CheckpointError and the resume checks, which are ValueErrors), a file that cannot be read
    (OSError), a device that is not there (the plain LookupError of device selection; KeyError and
    IndexError are LookupErrors too, but there they are bugs), a run that diverged (NonFiniteLoss: a
    learning rate too high, or NaN in the data), a device that stopped answering (DeviceHung) or
    ranks of an MPI job that disagree (RanksError), each naming the device or the ranks, and an
    actor failing with one of these.

    Args:
        error: what the run raised.
        spec_file: the spec's file name, to prefix the spec's problems with.

    Returns:
        The lines without the ``error:`` prefix, each one line; None to let the error propagate.
    """
    if isinstance(error, ActorError):
        return user_error(error.error, spec_file)
    if isinstance(error, FlowError):
        prefix = f"{spec_file}: " if spec_file else ""
        return [prefix + " ".join(str(problem).split()) for problem in error.problems]
    named = LoaderError | ValueError | OSError | NonFiniteLoss | DeviceHung | RanksError
    if isinstance(error, named) or type(error) is LookupError:
        return [" ".join(str(error).split()) or type(error).__name__]
    return None


def print_user_error(error: BaseException, spec_file: str = "") -> bool:
    """Print a mistake in the user's input as ``error:`` lines on stderr (:func:`user_error`).

    Returns:
        False for an error of vkflow's own, which the caller re-raises.
    """
    lines = user_error(error, spec_file)
    for line in lines or ():
        print(f"error: {line}", file=sys.stderr)
    return lines is not None


def callbacks_of(args: argparse.Namespace) -> list[Callback]:
    """The callbacks of ``--early-stopping``, ``--csv`` and ``--tensorboard``; a ValueError names a
    flag's bad value (or a missing package)."""
    callbacks: list[Callback] = []
    if (text := args.early_stopping) is not None:
        monitor, colon, patience = text.partition(":")
        if not (colon and patience.isdecimal()):
            raise ValueError(f"--early-stopping takes MONITOR:PATIENCE (e.g. val_loss:3), got {text!r}")
        try:
            callbacks.append(EarlyStopping(monitor, int(patience)))  # type: ignore[arg-type]
        except ValueError as error:
            raise ValueError(f"--early-stopping: {error}") from None
    if args.csv is not None and world_from_env(os.environ).rank == 0:  # one writer for an MPI job
        callbacks.append(CSVLogger(args.csv, append=args.resume is not None))
    if args.tensorboard is not None and world_from_env(os.environ).rank == 0:
        try:
            callbacks.append(TensorBoardLogger(args.tensorboard))
        except ImportError as error:  # the extra is not installed: say how to install it
            raise ValueError(f"--tensorboard: {error}") from None
    return callbacks


def main_run(argv: Sequence[str]) -> int:
    """``python -m flow run FILE [--resume DIR] [--device SELECT] [--quiet] [--early-stopping
    MONITOR:PATIENCE] [--csv PATH]``.

    Args:
        argv: the arguments after ``run``.

    Returns:
        The exit status: 0 done (stopped early included), 1 a mistake in the input (one ``error:``
        line each on stderr), 2 a flag's bad value (one ``error:`` line), 130 interrupted (after
        writing a checkpoint).

    Raises:
        Exception: an error of vkflow's own (a bug), with its traceback.
    """
    from flow.__main__ import program

    parser = argparse.ArgumentParser(prog=f"{program()} run", description="Train a spec.")
    parser.add_argument("file", help="the spec (.json, .msgpack or .mpk)")
    parser.add_argument(
        "--resume", metavar="DIR", help="continue from the newest checkpoint in DIR (or a file)"
    )
    parser.add_argument(
        "--device", metavar="SELECT", help="override devices.select: cpu, auto, an index or a name"
    )
    quiet = "no progress (bar or lines) and no log: only the summary and errors"
    parser.add_argument("--quiet", action="store_true", help=quiet)
    stop = "stop when MONITOR (val_loss or val_accuracy) has not improved for PATIENCE evaluations"
    parser.add_argument("--early-stopping", metavar="MONITOR:PATIENCE", help=stop)
    parser.add_argument("--csv", metavar="PATH", help="a CSV row per validation round (--resume appends)")
    tensorboard = "write TensorBoard event files to DIR: the metrics file's scalars (needs tensorboardX)"
    parser.add_argument("--tensorboard", metavar="DIR", help=tensorboard)
    args = parser.parse_args(list(argv))
    try:
        callbacks = callbacks_of(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # --quiet: the warnings that matter are in the summary already (RunResult.warnings).
    logging.basicConfig(level=logging.ERROR if args.quiet else logging.WARNING, format="%(message)s")
    try:
        spec = load_spec(args.file)
        if args.device is not None:
            select: int | str = int(args.device) if args.device.isdigit() else args.device
            spec = replace(spec, devices=replace(spec.devices, select=select))
        progress = Progress(enabled=False) if args.quiet else None  # None: drawn on a TTY
        result = run(spec, resume=args.resume, progress=progress, callbacks=callbacks)
    except KeyboardInterrupt as interrupt:
        notes = getattr(interrupt, "__notes__", [])
        print(
            "interrupted" + (f"; {notes[-1].removeprefix('vkflow: interrupted; ')}" if notes else ""),
            file=sys.stderr,
        )
        return 130
    except Exception as error:
        if not print_user_error(error, args.file):
            raise
        return 1
    if world_from_env(os.environ).rank == 0:  # one summary for an MPI job, as rank 0 alone writes
        print(summary(result))
    return 0

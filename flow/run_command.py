"""The ``python -m flow run FILE [--resume DIR] [--device SELECT]`` command and the summary it
prints (the demo prints it too)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace

from flow.codec import load as load_spec
from flow.runner import ActorError, RunResult, run


def summary(result: RunResult) -> str:
    """A short report of a run, whose last line is ``accuracy: 0.XXXX`` when there was an evaluation.

    Args:
        result: the run's result.

    Returns:
        The lines, joined.
    """
    lines = [f"device: {result.device}", f"steps: {result.steps} (epochs {result.epochs})"]
    if result.loss is not None:
        lines.append(f"final loss: {result.loss:.4f}")
    if result.checkpoint:
        lines.append(f"checkpoint: {result.checkpoint}")
    lines.append(f"time: {result.seconds:.1f} s")
    if result.accuracy is not None:
        lines.append(f"accuracy: {result.accuracy:.4f}")
    return "\n".join(lines)


def main_run(argv: Sequence[str]) -> int:
    """``python -m flow run FILE [--resume DIR] [--device SELECT]``.

    Args:
        argv: the arguments after ``run``.

    Returns:
        The exit status: 0 done, 1 failed, 130 interrupted (after writing a checkpoint).
    """
    parser = argparse.ArgumentParser(prog="python -m flow run", description="Train a spec.")
    parser.add_argument("file", help="the spec (.json, .msgpack or .mpk)")
    parser.add_argument(
        "--resume", metavar="DIR", help="continue from the newest checkpoint in DIR (or a file)"
    )
    parser.add_argument(
        "--device", metavar="SELECT", help="override devices.select: cpu, auto, an index or a name"
    )
    args = parser.parse_args(list(argv))
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        spec = load_spec(args.file)
        if args.device is not None:
            select: int | str = int(args.device) if args.device.isdigit() else args.device
            spec = replace(spec, devices=replace(spec.devices, select=select))
        result = run(spec, resume=args.resume)
    except KeyboardInterrupt as interrupt:
        notes = getattr(interrupt, "__notes__", [])
        print(
            "interrupted" + (f"; {notes[-1].removeprefix('vkflow: interrupted; ')}" if notes else ""),
            file=sys.stderr,
        )
        return 130
    except (ActorError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(summary(result))
    return 0

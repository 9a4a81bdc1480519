"""The sink actor: the end of the stream. It writes the metrics file, draws progress and writes
checkpoints; it computes nothing heavy.

Metrics are JSON lines, one per event: ``{"event": "step", "step", "epoch", "loss", "accuracy",
"lr", "samples_per_second", "elapsed"}``, ``{"event": "eval", ...}`` and ``{"event": "checkpoint",
"step", "path"}``. Every step has its line. Each actor's statistics (``"statistics": {actor:
{...}}``, cumulative counters) ride on the first step's line, then on one step line a second
(``STATISTICS_EVERY_S``) and on the run's last step: gathering them costs more than a whole step on
a fast GPU. The file is opened for appending and written line by line, so a resumed run continues
it and a killed run loses at most the line being written.

Checkpoints are written where the device's snapshots arrive: at the loader's scheduled marks
(every ``checkpoint_every`` steps) and at the end. Writing (encode, fsync, rename) runs in a worker
thread under the sink's own limiter, so the event loop keeps moving.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from actors import checkpoint as checkpoints
from actors.messages import EvalDone, Snapshot, StepDone
from actors.progress import Progress, ProgressState, Rate
from actors.statistics import ActorStatistics, Meter
from flow.spec import Spec

STATISTICS_EVERY_S = 1.0

# One encoder for every line: json.dumps with an option builds a new encoder on each call.
_encode = json.JSONEncoder(allow_nan=False).encode


def _number(value: float | None) -> float | None:
    """JSON has no NaN: a missing measure (regression accuracy, an empty batch's loss) is null."""
    return None if value is None or not math.isfinite(value) else float(value)


def step_record(
    done: StepDone,
    samples_per_second: float,
    elapsed: float,
    statistics: dict[str, ActorStatistics] | None = None,
) -> dict[str, Any]:
    """The metrics line for a training step.

    Args:
        done: the step.
        samples_per_second: recent throughput.
        elapsed: seconds since this process started the run.
        statistics: every actor's statistics now; None leaves them out of this line.

    Returns:
        The record.
    """
    accuracy = done.correct / done.rows if done.rows else None
    record = {
        "event": "step",
        "step": done.step,
        "epoch": done.epoch,
        "loss": _number(done.loss),
        "accuracy": _number(accuracy),
        "lr": _number(done.lr),  # NaN for a batch with no sample left: no update
        "samples_per_second": round(samples_per_second, 3),
        "elapsed": round(elapsed, 6),
    }
    if statistics is not None:
        record["statistics"] = {name: s.as_dict() for name, s in statistics.items()}
    return record


def eval_record(done: EvalDone, elapsed: float) -> dict[str, Any]:
    """The metrics line for an evaluation.

    Args:
        done: the evaluation.
        elapsed: seconds since this process started the run.

    Returns:
        The record.
    """
    return {
        "event": "eval",
        "step": done.step,
        "epoch": done.epoch,
        "loss": _number(done.loss),
        "accuracy": _number(done.accuracy),
        "samples": done.samples,
        "elapsed": round(elapsed, 6),
    }


class Sink:
    """The sink actor (see the module docstring).

    Args:
        meter: its ports (inbox from the device; outboxes, if any, get every message forwarded).
        spec: the run's spec (checkpoints carry it).
        total_steps: steps in the run (for progress and ETA).
        first_step: steps already done when this process started.
        statistics: returns every actor's statistics (for the metrics lines).
        optimiser: what a checkpoint records about the optimiser.
        checkpoint_dir: where checkpoints go; None writes none.
        metrics_file: the JSON-lines file; None writes none.
        progress: the progress line.
        keep: checkpoints to keep.
        inline: write checkpoints on the event loop (deterministic tests; no threads).
    """

    def __init__(
        self,
        meter: Meter,
        spec: Spec,
        total_steps: int,
        first_step: int = 0,
        statistics: Callable[[], dict[str, ActorStatistics]] = dict,
        optimiser: dict[str, Any] | None = None,
        checkpoint_dir: str | Path | None = None,
        metrics_file: str | Path | None = None,
        progress: Progress | None = None,
        keep: int = 3,
        inline: bool = False,
    ) -> None:
        self.meter = meter
        self.spec = spec
        self.total_steps = total_steps
        self.first_step = first_step
        self.all_statistics = statistics
        self.optimiser = optimiser or {}
        self.checkpoint_dir = checkpoint_dir
        self.metrics_path = Path(metrics_file) if metrics_file else None
        self.progress = progress or Progress(enabled=False)
        self.keep = keep
        self.inline = inline
        self.limiter = trio.CapacityLimiter(1)
        self.rate = Rate()
        self.started = time.monotonic()
        self.samples_per_second = 0.0
        # What the run reports at the end.
        self.last_step: StepDone | None = None
        self.evals: list[EvalDone] = []
        self.final: Snapshot | None = None
        self.checkpoint: Path | None = None
        self._metrics = None
        self._next_statistics = 0.0  # monotonic time the next step line carries statistics

    def _write(self, record: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(_encode(record) + "\n")

    def _state(self) -> ProgressState:
        step = self.last_step.step + 1 if self.last_step else self.first_step
        return ProgressState(
            step=step,
            total=self.total_steps,
            samples_per_second=self.samples_per_second,
            loss=self.last_step.loss if self.last_step else None,
            accuracy=self.evals[-1].accuracy if self.evals else None,
            elapsed=time.monotonic() - self.started,
            done_at_start=self.first_step,
        )

    async def _save(self, snapshot: Snapshot) -> Path:
        checkpoint = checkpoints.from_snapshot(self.spec, snapshot, self.optimiser)
        if self.inline:
            return checkpoints.save(self.checkpoint_dir, checkpoint, self.keep)
        return await trio.to_thread.run_sync(
            checkpoints.save, self.checkpoint_dir, checkpoint, self.keep, limiter=self.limiter
        )

    def _step(self, item: StepDone) -> None:
        self.last_step = item
        if self._metrics is None and not self.progress.enabled:
            return  # nothing listens: the result needs only the last step
        now = time.monotonic()
        self.samples_per_second = self.rate.add(now, item.rows)
        last = item.step + 1 >= self.total_steps
        if self._metrics is not None:
            statistics = None
            if last or now >= self._next_statistics:
                statistics = self.all_statistics()
                self._next_statistics = now + STATISTICS_EVERY_S
            self._write(step_record(item, self.samples_per_second, now - self.started, statistics))
        if self.progress.due(force=last):  # building the state costs: only when it is drawn
            self.progress.update(self._state(), force=last)

    async def _handle(self, item: Any) -> None:
        elapsed = time.monotonic() - self.started
        if isinstance(item, StepDone):
            self._step(item)
        elif isinstance(item, EvalDone):
            self.evals.append(item)
            self._write(eval_record(item, elapsed))
            self.progress.note(
                f"step {item.step}  epoch {item.epoch}  eval loss {item.loss:.4f}  "
                f"accuracy {item.accuracy:.4f}"
            )
        elif isinstance(item, Snapshot):
            if item.final:
                self.final = item
            if self.checkpoint_dir is not None:
                self.checkpoint = await self._save(item)
                self._write(
                    {
                        "event": "checkpoint",
                        "step": item.cursor.step,
                        "path": str(self.checkpoint),
                        "final": item.final,
                    }
                )

    async def run(self) -> None:
        """Record everything until the inbox ends."""
        if self.metrics_path is not None:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self._metrics = open(self.metrics_path, "a", buffering=1)  # line-buffered: a kill loses one line
        try:
            async with self.meter:
                async for item in self.meter:
                    with self.meter.busy():
                        if isinstance(item, StepDone):  # every step: no coroutine for it
                            self._step(item)
                        else:
                            await self._handle(item)
                    if self.meter.outboxes:
                        await self.meter.send(item)
        finally:
            if self._metrics is not None:
                self._metrics.close()
            self.progress.close()

    def statistics(self):
        return self.meter.statistics()

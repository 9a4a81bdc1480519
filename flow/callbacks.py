"""Callbacks: user code that watches a training run and may stop it, as Keras and Lightning users
expect (``flow.run(spec, callbacks=[EarlyStopping(patience=3)])``).

Their methods run in the sink actor, on the event loop, right after the sink has handled the item:
in order, and they must be quick. Records are the metrics file's lines as plain dicts (what a user
reads in metrics.jsonl): ``on_step`` gets ``{"event": "step", "step", "epoch", "loss", "accuracy",
"lr", "samples_per_second", "elapsed"}``, ``on_eval`` ``{"event": "eval", "split" ("val" or
"test"), "step", "epoch", "loss", "accuracy", "samples", "elapsed"}`` (a measure that does not
exist is None). An exception in a callback stops the run with ``flow.ActorError`` naming the sink
and the callback; its ``error`` is the callback's exception. :meth:`Callback.stop_run` stops the run
as an interrupt does (cancelled actors, drained device, a checkpoint that ``resume`` continues).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

from flow import spec as spec_records
from flow.metrics import STEP_MEANS, metric_name
from flow.spec import CallbackRecord, Spec
from flow.spec_rules import MONITOR, monitor_problem

if TYPE_CHECKING:  # the runtime's record; imported for the annotation only (flow's tiers)
    from flow.runtime import RunResult


class Callback:
    """The base of every callback: each method does nothing, so a callback overrides what it needs.
    ``stop_reason`` is why it asked the run to stop (:meth:`stop_run`); each run clears it."""

    stop_reason: str | None = None

    def on_start(self, spec: Spec, splits: frozenset[str]) -> None:
        """Once, before any device work; raise to refuse the run. ``splits``: the evaluated splits
        that hold samples ("val", "test", both or neither)."""

    def on_step(self, record: dict[str, Any]) -> None:
        """After every training step, in step order (the step's metrics line)."""

    def on_eval(self, record: dict[str, Any]) -> None:
        """After every evaluation round (its metrics line; ``record["split"]`` is "val" or "test")."""

    def on_checkpoint(self, path: str, step: int) -> None:
        """After a checkpoint is written (the stop's checkpoint included), with the steps it holds."""

    def on_end(self, result: RunResult) -> None:
        """Once, after the run ended normally or stopped early (not after an error)."""

    def stop_run(self, reason: str) -> None:
        """Ask the run to stop after the current item, with a checkpoint to resume from; ``reason``
        is one line (the metrics file, RunResult.stopped_early and the CLI show it)."""
        self.stop_reason = reason


Monitor = Literal["val_loss", "val_accuracy"] | str  # or "val_" and a metric's name: "val_top5", "val_mae"


class EarlyStopping(Callback):
    """Stop the run when the validation loss (or accuracy) has not improved for ``patience``
    evaluation rounds in a row, as Keras' EarlyStopping does. The count starts anew with each run,
    a resumed one included.

    Args:
        monitor: "val_loss", "val_accuracy" (classification only) or one of the model's metrics
            ("val_top5", "val_mae", "val_rmse", "val_perplexity").
        patience: rounds without improvement before stopping, >= 0 (0: the first such round stops).
        min_delta: the least change that counts as an improvement, >= 0.
        mode: "min", "max", or "auto" (max for the accuracy and top-k, else min).
    """

    def __init__(
        self, monitor: Monitor = "val_loss", patience: int = 3, min_delta: float = 0.0, mode: str = "auto"
    ) -> None:
        if not MONITOR.fullmatch(str(monitor)):
            raise ValueError(
                f"EarlyStopping monitor must be 'val_loss' or 'val_accuracy', got {monitor!r} (or 'val_' "
                "and one of the model's metrics: 'val_top5', 'val_mae', 'val_rmse', 'val_perplexity')"
            )
        if not isinstance(patience, int) or patience < 0:
            raise ValueError(f"EarlyStopping patience must be an int >= 0, got {patience!r}")
        if not (math.isfinite(min_delta) and min_delta >= 0):
            raise ValueError(f"EarlyStopping min_delta must be finite and >= 0, got {min_delta!r}")
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'auto', 'min' or 'max', got {mode!r}")
        self.monitor, self.patience, self.min_delta = monitor, patience, min_delta
        higher = monitor == "val_accuracy" or monitor.startswith("val_top")
        self.mode = mode if mode != "auto" else ("max" if higher else "min")
        self.best: float | None = None
        self.best_step: int | None = None
        self.waited = 0

    def on_start(self, spec: Spec, splits: frozenset[str]) -> None:
        # Refused here, before any device work: a monitor that never appears would never stop a run.
        val = f"data.split.val is {spec.data.split.val}"
        problem = monitor_problem(self.monitor, spec.model, "val" in splits, val)
        if problem is not None:
            raise ValueError(f"{type(self).__name__}(monitor={self.monitor!r}): {problem}")
        self.best, self.best_step, self.waited = None, None, 0

    def improved(self, value: float) -> bool:
        """Whether ``value`` beats the best so far by more than ``min_delta``."""
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_eval(self, record: dict[str, Any]) -> None:
        if record["split"] != "val":
            return
        value = record[self.monitor.removeprefix("val_")]  # None for a non-finite loss: no improvement
        if value is not None and self.improved(value):
            self.best, self.best_step, self.waited = value, record["step"], 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            best = "none" if self.best is None else f"{self.best:.6g} at step {self.best_step}"
            self.stop_run(f"{self.monitor} did not improve for {self.waited} evaluation(s) (best {best})")


class BestCheckpoint(EarlyStopping):
    """What a ``SaveBest`` record asks for (flow.spec.SaveBest): the sink writes ``best.ckpt`` from
    the snapshot at :attr:`due`, the step of the round that improved; it never stops the run."""

    def __init__(self, monitor: Monitor = "val_loss", mode: str = "auto") -> None:
        super().__init__(monitor, patience=0, mode=mode)
        self.due: int | None = None  # the step whose weights are the best so far, until written

    def on_start(self, spec: Spec, splits: frozenset[str]) -> None:
        super().on_start(spec, splits)
        self.due = None
        # A resumed run goes on comparing with the round best.ckpt holds, which the metrics file's
        # last "best" line names (a fresh run never finds one: it refuses another run's file).
        from flow.runtime import metrics_file_of

        path = metrics_file_of(spec.run)
        if path is not None and Path(path).is_file():
            lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
            for line in reversed(lines):
                event = _json_or_none(line) if '"best"' in line else None
                if event is not None and event.get("monitor") == self.monitor:
                    self.best, self.best_step = event.get("value"), event.get("step")
                    break

    def on_eval(self, record: dict[str, Any]) -> None:
        value = record[self.monitor.removeprefix("val_")] if record["split"] == "val" else None
        if value is not None and self.improved(value):
            self.best, self.best_step, self.due = value, record["step"], record["step"]


def _json_or_none(line: str) -> dict | None:
    """A metrics line as a dict, or None for a line a killed writer left half written."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) and event.get("event") == "best" else None


def from_records(records: Sequence[CallbackRecord]) -> list[Callback]:
    """The callback objects of a spec's ``run.callbacks`` records, in order (the runtime runs them
    before the Python callbacks given to flow.run)."""
    made: list[Callback] = []
    for record in records:
        if isinstance(record, spec_records.EarlyStopping):
            made.append(EarlyStopping(record.monitor, record.patience, record.min_delta, record.mode))
        else:
            made.append(BestCheckpoint(record.monitor, record.mode))
    return made


class CSVLogger(Callback):
    """Write a CSV row per validation round, as Keras' CSVLogger writes one per epoch: a run
    evaluates after each epoch by default, or every ``run.eval_every`` steps. Columns: ``epoch``
    (0-based), ``step`` (steps done), ``loss`` and ``accuracy`` (the mean over the training steps
    since the previous row), then each model metric's (``top5``, ``mae``, ``rmse`` as the root of the
    steps' mean square, ``perplexity`` as exp of their mean log), ``val_loss``, ``val_accuracy``, each
    ``val_<metric>`` (the round's, e.g. ``val_top5``), ``lr`` (the last step's), ``elapsed``
    (seconds); a measure that does not exist is an empty cell. Each row is one flushed write, so a
    killed run leaves a valid CSV of whole rows. The test split's round is not a row.

    Args:
        path: the CSV file; its folder must exist.
        append: add rows under an existing file's header (a resumed run) instead of replacing it.
    """

    def __init__(self, path: str | os.PathLike[str], append: bool = False) -> None:
        self.path, self.append = Path(path), append
        self._file: TextIO | None = None
        self._fields: list[str] | None = None  # the header, from the first row or the existing file
        self._sums: dict[str, list[float]] = {}  # measure: [sum, count] over the steps since the last row
        self._lr: float | None = None

    def on_start(self, spec: Spec, splits: frozenset[str]) -> None:
        if "val" not in splits:  # refused before any device work: the file would stay empty
            raise ValueError(
                f"CSVLogger({str(self.path)!r}) writes a row per validation round, but this run has no "
                f"validation samples (data.split.val is {spec.data.split.val}): give it > 0"
            )
        self.on_end(None)  # the file of an earlier run that failed
        self._names = [metric_name(m) for m in spec.model.metrics]
        self._fields, self._sums, self._lr = None, self._fresh(), None
        if self.append and self.path.exists():
            with self.path.open(newline="") as existing:
                self._fields = next(csv.reader(existing), None)
        self._file = self.path.open("a" if self.append else "w", newline="")

    def _fresh(self) -> dict[str, list[float]]:
        return {key: [0.0, 0] for key in ("loss", "accuracy", *self._names)}

    def on_step(self, record: dict[str, Any]) -> None:
        for key, total in self._sums.items():
            value = record.get(key)  # None: not finite, no accuracy (regression), an empty step
            if value is not None:
                there = STEP_MEANS.get(key, (float, float))[0]
                total[0], total[1] = total[0] + there(value), total[1] + 1
        self._lr = record["lr"]

    def on_eval(self, record: dict[str, Any]) -> None:
        if record["split"] != "val" or self._file is None:
            return
        means = {
            key: STEP_MEANS.get(key, (float, float))[1](total / count) if count else None
            for key, (total, count) in self._sums.items()
        }
        vals = {f"val_{name}": record.get(name) for name in self._names}
        row = {"epoch": record["epoch"], "step": record["step"], **means, "val_loss": record["loss"],
               "val_accuracy": record["accuracy"], **vals, "lr": self._lr,
               "elapsed": record["elapsed"]}  # fmt: skip
        self._sums = self._fresh()
        lines = io.StringIO()
        if self._fields is None:
            self._fields = list(row)
            csv.writer(lines).writerow(self._fields)
        csv.writer(lines).writerow([row.get(field) for field in self._fields])  # None: an empty cell
        self._file.write(lines.getvalue())  # whole rows in one write, then to the OS
        self._file.flush()

    def on_end(self, result: RunResult | None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

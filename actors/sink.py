"""The sink actor: the end of the stream. It writes the metrics file, draws progress and writes
checkpoints; it computes nothing heavy.

Metrics are JSON lines, one per event: ``{"event": "step", "step", "epoch", "loss", "accuracy",
"lr", "samples_per_second", "elapsed"}``, ``{"event": "eval", ...}`` and ``{"event": "checkpoint",
"step", "path"}``; step and eval lines also carry the model's metrics by name (``"top5"``,
``"mae"``, ``"rmse"``, ``"perplexity"``: flow.metrics). Every step has its line, or with
``RunSettings.metrics_every`` N > 1 its place in a ``{"event": "steps", ...}`` line whose fields
are arrays over N steps (written when the N-th arrives, or before any other line: the order stays
the steps' order; flow.metrics.step_lines turns it back into step lines): one line to encode and
write per N steps. Each actor's
statistics (``"statistics": {actor: {...}}``, cumulative counters) ride on the first step's line,
then on one step line a second (``STATISTICS_EVERY_S``) and on the run's last step: gathering them
costs more than a whole step on a fast GPU. Bad items the source skipped (``on_error="skip"``) ride
on the same lines as ``"skipped": {"count", "examples"}`` once there are any, and the run ends with
one ``{"event": "skipped", "step", "count", "examples"}`` line, so a user finds them without
reading the log. The file is opened for appending and written a channel item at a time (a step or a
chunk of steps, see actors.meter), so a resumed run continues it and a killed run loses at most one
chunk's lines. A step's seconds come from when the device saw it done (``StepDone.finished``), not
from when its chunk arrived. Each process's lines follow the ``{"event": "run", "run", "step",
"resumed", "pid", "time"}`` record that claiming the file wrote (actors.outputs), so one run's
lines never run on into another's; then ``{"event": "setup", "step", "seconds", "parts"}``, the
seconds before the first step by part (flow.runtime.RunResult.setup). A data-parallel run adds a
``{"event": "devices", ...}`` line as each epoch ends (:func:`devices_record`): each member's
samples/s, busy and idle seconds, and the all-reduce's seconds.

The sink also acts on the run's health checks (:mod:`actors.health`). It writes the first training
batch's input range as ``{"event": "inputs", "step", "epoch", "rows", "min", "max", "mean",
"std"}``; whatever looks wrong (inputs constant or tiny, an epoch's mean loss at ln(classes), a
non-finite loss under ``on_nonfinite="continue"``) becomes one ``{"event": "warning", "kind",
"step", "message"}`` line and one warning on the ``vkflow`` logger. A non-finite loss under
``on_nonfinite="raise"`` writes its step line and ``{"event": "error", ...}``, then stops the run
with :class:`actors.health.NonFiniteLoss`. Per step this costs one ``math.isfinite`` and, for
CrossEntropy, a running sum.

Checkpoints are written where the device's snapshots arrive: at the loader's scheduled marks
(every ``checkpoint_every`` steps) and at the end. Writing (encode, fsync, rename) runs in a worker
thread under the sink's own limiter, so the event loop keeps moving.

Callbacks (flow.callbacks) run after each item is handled. When one asks to stop, the sink writes
``{"event": "stopped", "step", "reason"}`` and the runtime stops the run as an interrupt does. A
SaveBest callback marks the step of a round that improved; the snapshot that follows the round (a
regular mark, or a best-only one: CheckpointMark.best_only) becomes ``best.ckpt`` and a ``{"event":
"best", "step", "monitor", "value", "path"}`` line.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import trio

from actors import checkpoint as checkpoints
from actors import health
from actors.messages import EvalDone, InputStatistics, Profile, Snapshot, StepDone
from actors.meter import Meter
from actors.progress import Progress, ProgressState, Rate
from actors.statistics import ActorStatistics
from flow.metrics import finish, summed
from flow.spec import Model, Spec

STATISTICS_EVERY_S = 1.0

logger = logging.getLogger("vkflow")

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
    model: Model | None = None,
) -> dict[str, Any]:
    """The metrics line for a training step.

    Args:
        done: the step.
        samples_per_second: recent throughput.
        elapsed: seconds since this process started the run.
        statistics: every actor's statistics now; None leaves them out of this line.
        model: the model, whose metrics (``"top5"``, ``"mae"``, ...) the line carries; None: none.

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
    if model is not None and done.rows:
        values = finish(model, summed(model, done.metrics, done.rows), done.rows, done.loss)
        record.update((name, _number(value)) for name, value in values.items())
    if statistics is not None:
        record["statistics"] = {name: s.as_dict() for name, s in statistics.items()}
    return record


def steps_record(
    steps: Sequence[tuple[StepDone, float, float]],
    statistics: dict[str, ActorStatistics] | None = None,
    model: Model | None = None,
) -> dict[str, Any]:
    """The metrics line for several training steps (``RunSettings.metrics_every``): each field of
    :func:`step_record` as an array over the steps (None where a step's line lacks the field: an
    empty batch has no model metrics).

    Args:
        steps: (the step, the throughput then, its seconds since the run began), in order.
        statistics: every actor's statistics at the last of them; None leaves them out.
        model: the model, whose metrics the line carries.

    Returns:
        The record: ``{"event": "steps", "step": [...], "epoch": [...], ...}``.
    """
    records = [step_record(done, rate, elapsed, None, model) for done, rate, elapsed in steps]
    keys = dict.fromkeys(key for record in records for key in record if key != "event")
    record: dict[str, Any] = {"event": "steps", **{key: [r.get(key) for r in records] for key in keys}}
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
        "split": done.split,
        "step": done.step,
        "epoch": done.epoch,
        "loss": _number(done.loss),
        "accuracy": _number(done.accuracy),
        **{name: _number(value) for name, value in done.metrics.items()},
        "samples": done.samples,
        "elapsed": round(elapsed, 6),
    }


def devices_record(device: Any, step: int, epoch: int) -> dict[str, Any] | None:
    """The metrics line of a data-parallel run's members at the end of an epoch: each member's
    rows, samples/s, busy and idle seconds, and the all-reduce's seconds and path, since this
    process started the run (actors.data_parallel.DataParallelStatistics).

    Args:
        device: the device actor's statistics (any other actor's: no line).
        step: the epoch's last step.
        epoch: the epoch.

    Returns:
        The record, or None for a device actor without members.
    """
    members = getattr(device, "members", ())
    if not members:
        return None
    times = zip(members, device.member_rows, device.member_seconds, device.member_idle_seconds, strict=True)
    return {
        "event": "devices",
        "step": step,
        "epoch": epoch,
        "step_seconds": device.step_seconds,
        "all_reduce": device.all_reduce,
        "all_reduce_seconds": round(device.all_reduce_seconds, 6),
        "devices": [
            {"name": name, "rows": rows, "samples_per_second": round(rows / busy, 1) if busy > 0 else 0.0,
             "busy_seconds": busy, "idle_seconds": idle}
            for name, rows, busy, idle in times
        ],
    }  # fmt: skip


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
        keep: checkpoints to keep (``run.keep_checkpoints``); None keeps every one.
        run: the run's id, which its checkpoints carry; None draws one (a run of its own).
        inline: write checkpoints and open the metrics file on the event loop (deterministic tests; no
            threads).
        skipped: returns the source's distinct skipped items and where the first few are; None
            when there is no source (predicting).
        callbacks: flow.callbacks.Callback objects to run after each item; None or empty for none.
        stop: asks the runtime to stop the run (step, reason), when a callback asks for it.
        measured: what a data-parallel run measured before its first step, for its checkpoints
            (actors.checkpoint.Checkpoint.measured).
        setup: seconds per part of the run's setup (flow.runtime.RunResult.setup), written as the
            metrics file's ``"setup"`` line before any step's; None: no such line.
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
        keep: int | None = 3,
        run: str | None = None,
        inline: bool = False,
        skipped: Callable[[], tuple[int, tuple[str, ...]]] | None = None,
        callbacks: Sequence[Any] | None = None,
        stop: Callable[[int, str], None] | None = None,
        measured: dict[str, Any] | None = None,
        setup: dict[str, float] | None = None,
    ) -> None:
        self.meter = meter
        self.setup = setup
        self.spec = spec
        self.model = spec.model if spec.model.metrics else None  # whose metrics the step lines carry
        self.total_steps = total_steps
        self.first_step = first_step
        self.all_statistics = statistics
        self.optimiser = optimiser or {}
        self.checkpoint_dir = checkpoint_dir
        self.metrics_path = Path(metrics_file) if metrics_file else None
        self.progress = progress or Progress(enabled=False)
        self.keep = keep
        self.run_id = run or checkpoints.new_run_id()
        self.inline = inline
        self.skipped = skipped
        self.callbacks = tuple(callbacks) if callbacks else None  # None: the hot path tests only this
        self.stop = stop
        self.measured = measured
        self.failed_callback: str | None = None  # "Class.method" of a callback that raised
        self.limiter = trio.CapacityLimiter(1)
        self.rate = Rate()
        self.started = time.monotonic()
        self.samples_per_second = 0.0
        # What the run reports at the end.
        self.last_step: StepDone | None = None
        self.evals: list[EvalDone] = []
        self.profile: Profile | None = None  # RunSettings(profile=True): the launch times
        self.final: Snapshot | None = None
        self.checkpoint: Path | None = None
        self._metrics = None
        self._next_statistics = 0.0  # monotonic time the next step line carries statistics
        self.metrics_every = spec.run.metrics_every
        self._held: list[tuple[StepDone, float, float]] = []  # steps for the next "steps" line
        self._held_statistics: dict[str, ActorStatistics] | None = None
        # Health checks (actors.health), each reported once: warnings go to the log and the file.
        self.inputs: InputStatistics | None = None
        self.warnings: list[str] = []
        self.on_nonfinite = spec.run.on_nonfinite
        self._nonfinite_seen = False
        classes = health.classes_of(spec.model)
        self._chance = health.ChanceWatch(classes) if classes else None  # None once it has warned

    def _write(self, record: dict[str, Any]) -> None:
        if self._metrics is not None:
            if self._held:  # the held steps came first
                self._write_held()
            self._metrics.write(_encode(record) + "\n")

    def _write_held(self) -> None:
        held, self._held = self._held, []
        statistics, self._held_statistics = self._held_statistics, None
        record = steps_record(held, statistics, self.model)
        if statistics is not None and (skipped := self._skipped()):
            record["skipped"] = skipped
        self._metrics.write(_encode(record) + "\n")

    def _skipped(self) -> dict[str, Any] | None:
        """The source's skipped items for a metrics line; None when it has skipped none."""
        if self.skipped is None:
            return None
        count, examples = self.skipped()
        return {"count": count, "examples": list(examples)} if count else None

    def _warn(self, kind: str, step: int | None, message: str) -> None:
        """Report something that looks wrong, once: on the log (stderr by default) and in the file."""
        self.warnings.append(message)
        logger.warning("vkflow: %s", message)
        self._write({"event": "warning", "kind": kind, "step": step, "message": message})

    def _inputs(self, stats: InputStatistics) -> None:
        self.inputs = stats
        self._write(
            {
                "event": "inputs",
                "step": stats.step,
                "epoch": stats.epoch,
                "rows": stats.rows,
                "min": _number(stats.min),
                "max": _number(stats.max),
                "mean": _number(stats.mean),
                "std": _number(stats.std),
            }
        )
        for message in health.input_warnings(stats):
            self._warn("inputs", stats.step, message)

    def _nonfinite(self, item: StepDone) -> None:
        """A step's loss is NaN or infinite: stop the run, or warn once and go on."""
        self._nonfinite_seen = True
        if self.on_nonfinite == "continue":
            self._warn("nonfinite", item.step, health.nonfinite_message(item, continuing=True))
            return
        message = health.nonfinite_message(item, continuing=False)
        # The file shows the step and why the run ended before the error unwinds the actors.
        elapsed = time.monotonic() - self.started
        self._write(step_record(item, self.samples_per_second, elapsed, None, self.model))
        self._write({"event": "error", "kind": "nonfinite", "step": item.step, "message": message})
        raise health.NonFiniteLoss(message, item.step, item.epoch, item.loss)

    def _chance_verdict(self, message: str | None, step: int | None) -> None:
        if message is not None:
            self._chance = None
            self._warn("chance", step, message)

    def _state(self) -> ProgressState:
        step = self.last_step.step + 1 if self.last_step else self.first_step
        # A data-parallel run's device actor reports each member's samples/s and its all-reduce.
        device = self.all_statistics().get("device")
        steps_s = getattr(device, "step_seconds", 0.0)
        return ProgressState(
            step=step,
            total=self.total_steps,
            samples_per_second=self.samples_per_second,
            loss=self.last_step.loss if self.last_step else None,
            accuracy=self.evals[-1].accuracy if self.evals else None,
            elapsed=time.monotonic() - self.started,
            done_at_start=self.first_step,
            epoch=self.last_step.epoch if self.last_step else None,
            devices=tuple(getattr(device, "member_samples_per_s", ())),
            # A split run's stages report these fields too, with no all-reduce ("none").
            all_reduce_share=(
                device.all_reduce_seconds / steps_s if steps_s > 0 and device.all_reduce != "none" else None
            ),
        )

    async def _save(self, snapshot: Snapshot, name: str | None = None) -> Path:
        measured = self.measured
        checkpoint = checkpoints.from_snapshot(self.spec, snapshot, self.optimiser, self.run_id, measured)
        if self.inline:
            return checkpoints.save(self.checkpoint_dir, checkpoint, self.keep, name)
        return await trio.to_thread.run_sync(
            checkpoints.save, self.checkpoint_dir, checkpoint, self.keep, name, limiter=self.limiter
        )

    async def _save_best(self, snapshot: Snapshot) -> None:
        """Write ``best.ckpt`` when a SaveBest callback (flow.callbacks.BestCheckpoint) found its
        best round at this snapshot's step: its validation round came just before the mark."""
        step = snapshot.cursor.step
        due = [c for c in self.callbacks or () if getattr(c, "due", None) == step]
        if not due:
            return
        path = await self._save(snapshot, checkpoints.BEST)
        for callback in due:
            callback.due = None
            best = {"monitor": callback.monitor, "value": callback.best, "path": str(path)}
            self._write({"event": "best", "step": step, **best})

    def _devices(self, step: int, epoch: int) -> None:
        """Write a data-parallel run's per-member times as an epoch ends."""
        record = devices_record(self.all_statistics().get("device"), step, epoch)
        if record is not None:
            self._write(record)

    def _step(self, item: StepDone) -> None:
        previous, self.last_step = self.last_step, item
        if not math.isfinite(item.loss) and item.rows and not self._nonfinite_seen:
            self._nonfinite(item)
        if self._chance is not None:
            self._chance_verdict(self._chance.add(item), item.step)
        if self._metrics is None and not self.progress.enabled and self.callbacks is None:
            return  # nothing listens: the result needs only the last step
        now = item.finished or time.monotonic()
        self.samples_per_second = self.rate.add(now, item.rows)
        last = item.step + 1 >= self.total_steps
        if self._metrics is not None:
            statistics = None
            if last or now >= self._next_statistics:
                statistics = self.all_statistics()
                self._next_statistics = now + STATISTICS_EVERY_S
            if previous is not None and previous.epoch != item.epoch:
                self._devices(previous.step, previous.epoch)
            if self.metrics_every > 1:  # one line per metrics_every steps
                self._held.append((item, self.samples_per_second, now - self.started))
                self._held_statistics = statistics or self._held_statistics
                if len(self._held) >= self.metrics_every or last:
                    self._write_held()
            else:
                elapsed = now - self.started
                record = step_record(item, self.samples_per_second, elapsed, statistics, self.model)
                if statistics is not None and (skipped := self._skipped()):
                    record["skipped"] = skipped
                self._write(record)
            if last:
                self._devices(item.step, item.epoch)
        if self.progress.due(force=last, epoch=item.epoch):  # building the state costs: only when drawn
            self.progress.update(self._state(), force=last)

    async def _handle(self, item: Any) -> None:
        elapsed = time.monotonic() - self.started
        if isinstance(item, StepDone):
            self._step(item)
        elif isinstance(item, EvalDone):
            self.evals.append(item)
            self._write(eval_record(item, elapsed))
            self.progress.note(
                f"step {item.step}  epoch {item.epoch}  {item.split} loss {item.loss:.4f}  "
                f"accuracy {item.accuracy:.4f}" + "".join(f"  {k} {v:.4f}" for k, v in item.metrics.items())
            )
        elif isinstance(item, InputStatistics):
            self._inputs(item)
        elif isinstance(item, Profile):
            self.profile = item
            launches = [{"name": name, "op": op, "seconds": seconds} for name, op, seconds in item.launches]
            note = {"note": item.note} if item.note else {}
            self._write({"event": "profile", "steps": item.steps, "launches": launches, **note})
        elif isinstance(item, Snapshot):
            if item.final:
                self.final = item
            if self.checkpoint_dir is not None and self.callbacks is not None:
                await self._save_best(item)
            if self.checkpoint_dir is not None and not item.best_only:
                self.checkpoint = await self._save(item)
                self._write(
                    {
                        "event": "checkpoint",
                        "step": item.cursor.step,
                        "path": str(self.checkpoint),
                        "final": item.final,
                    }
                )

    async def _notify(self, item: Any) -> None:
        """Run the callbacks on the item just handled; stop the run when one of them asks."""
        if isinstance(item, StepDone):
            elapsed = (item.finished or time.monotonic()) - self.started
            record = step_record(item, self.samples_per_second, elapsed, None, self.model)
            method, arguments, done = "on_step", (record,), item.step + 1  # done: steps done
        elif isinstance(item, EvalDone):
            record = eval_record(item, time.monotonic() - self.started)
            method, arguments, done = "on_eval", (record,), item.step
        elif isinstance(item, Snapshot) and self.checkpoint_dir is not None and not item.best_only:
            done = item.cursor.step
            method, arguments = "on_checkpoint", (str(self.checkpoint), done)
        else:
            return
        for callback in self.callbacks:
            try:
                getattr(callback, method)(*arguments)
            except Exception:
                self.failed_callback = f"{type(callback).__name__}.{method}"  # the runtime names it
                raise
        # Every callback sees the item that stops the run, as Keras' do the epoch that stops it.
        reason = next((c.stop_reason for c in self.callbacks if c.stop_reason is not None), None)
        if reason is not None and self.stop is not None:
            self._write({"event": "stopped", "step": done, "reason": reason})
            self.stop(done, reason)
            await trio.sleep_forever()  # the runtime cancels every actor, this one included

    def _open_metrics(self) -> IO[str]:
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        return open(self.metrics_path, "a")  # flushed after each channel item (see run)

    async def run(self) -> None:
        """Record everything until the inbox ends."""
        if self.metrics_path is not None:
            # Opening can block (a slow or network disk): a thread, as checkpoints are saved.
            if self.inline:
                self._metrics = self._open_metrics()
            else:
                self._metrics = await trio.to_thread.run_sync(self._open_metrics, limiter=self.limiter)
            if self.setup:  # the seconds before the first step, by part (flow.runtime.RunResult.setup)
                parts = {part: round(seconds, 6) for part, seconds in self.setup.items()}
                seconds = round(sum(self.setup.values()), 6)
                self._write({"event": "setup", "step": self.first_step, "seconds": seconds, "parts": parts})
        try:
            async with self.meter:
                async for item in self.meter:
                    with self.meter.busy():
                        if isinstance(item, StepDone):  # every step: no coroutine for it
                            self._step(item)
                        else:
                            await self._handle(item)
                    if self.callbacks is not None:
                        await self._notify(item)
                    if self._metrics is not None and not self.meter.holding:
                        self._metrics.flush()  # one write per chunk, not per line
                    if self.meter.outboxes:
                        await self.meter.pass_on(item)
            if self._chance is not None:  # the last epoch ends with the stream
                self._chance_verdict(self._chance.finish(), self.last_step.step if self.last_step else None)
            # After the stream's end every read is done, evaluations included: the final count.
            if skipped := self._skipped():
                step = self.last_step.step if self.last_step else None
                self._write({"event": "skipped", "step": step, **skipped})
        finally:
            if self._metrics is not None:
                if self._held:  # a run stopped early: the steps it did
                    self._write_held()
                self._metrics.close()
            self.progress.close()

    def statistics(self):
        return self.meter.statistics()

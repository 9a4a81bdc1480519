"""The runner: the entry points that run a spec, and the one place that turns what happens into a
result or one clear error.

- :func:`run` trains (sync; ``trio.run`` inside) and returns a :class:`~flow.runtime.RunResult`.
- :func:`open_pipeline` does the same inside a trio program (``async with``), and in
  ``mode="predict"`` lets the caller ``await p.feed(x)`` and read predictions as a stream.

Both take a spec, a checkpoint to resume, or both (a resume must match the checkpoint's model,
optimiser and data), and run a :class:`flow.runtime.Runtime` (the resources, actors and channels of
one pipeline) in one trio nursery. When an actor raises, the nursery cancels every other actor and
the original error comes back as :class:`~flow.runtime.ActorError` naming the actor (the original
is its ``__cause__``), except for a run that stops itself: a non-finite training loss raises
:class:`actors.health.NonFiniteLoss` as it is. On KeyboardInterrupt the actors are cancelled, the
device is drained and a checkpoint is written before the interrupt propagates. A callback
(flow.callbacks) that stops the run takes the same path, and the run returns its result, with
``stopped_early`` saying why.

Predictions without trio live in flow.inference, the ``run`` command in flow.run_command.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import trio

from actors import checkpoint as checkpoints
from actors.backend import Backend
from actors.health import NonFiniteLoss
from actors.messages import Batch, Prediction, unpack
from actors.meter import Hooks
from actors.progress import Progress
from actors.statistics import ActorStatistics
from flow.callbacks import Callback
from flow.codec import load as load_spec
from flow.inputs import as_inputs, batch_bounds, expected
from flow.runtime import ActorError, Mode, RunResult, Runtime, error_leaves
from flow.spec import Spec

# -- decisions (pure) ------------------------------------------------------------------------------


def resume_conflicts(spec: Spec, saved: Spec) -> list[str]:
    """The parts of a spec that must match a checkpoint's for an exact resume.

    The run settings may differ (more epochs, another checkpoint directory); the model, the
    optimiser and the data may not.

    Args:
        spec: the spec given now.
        saved: the checkpoint's spec.

    Returns:
        The names of the parts that differ; empty when the resume is exact.
    """
    return [name for name in ("model", "optimiser", "data") if getattr(spec, name) != getattr(saved, name)]


# -- effects ---------------------------------------------------------------------------------------


def _resolve(
    spec: Spec | str | Path | None, resume: str | Path | None
) -> tuple[Spec, checkpoints.Checkpoint | None]:
    saved = checkpoints.load(resume) if resume is not None else None
    if isinstance(spec, str | Path):
        spec = load_spec(spec)
    if spec is None:
        if saved is None:
            raise ValueError("give a spec, a checkpoint to resume, or both")
        return saved.spec, saved
    if saved is not None:
        conflicts = resume_conflicts(spec, saved.spec)
        if conflicts:
            raise ValueError(
                f"cannot resume {resume}: the spec's {', '.join(conflicts)} differ from the "
                "checkpoint's (only run settings may change on resume)"
            )
    return spec, saved


class PipelineHandle:
    """A running pipeline, as ``open_pipeline`` yields it."""

    def __init__(self, runtime: Runtime, nursery: trio.Nursery) -> None:
        self._runtime = runtime
        self._nursery = nursery
        self._tags = 0
        self._seq = 0
        self.result: RunResult | None = None

    @property
    def spec(self) -> Spec:
        return self._runtime.spec

    @property
    def channels(self) -> dict[tuple[str, str], tuple[Any, Any]]:
        """(src, dst) -> (send, receive) channel of every pipeline edge."""
        return dict(self._runtime.channels)

    @property
    def total_steps(self) -> int:
        return self._runtime.total

    def statistics(self) -> dict[str, ActorStatistics]:
        """Every actor's statistics now."""
        return self._runtime.statistics()

    async def wait(self) -> None:
        """Wait until every actor has finished (training: the run is over)."""
        await self._runtime.finished.wait()

    def cancel(self) -> None:
        """Stop the pipeline now (no final checkpoint); the ``async with`` block then exits."""
        self._nursery.cancel_scope.cancel()

    async def feed(self, x: np.ndarray) -> int:
        """Send inputs to predict on (``mode="predict"``); waits while the pipeline is full.

        Args:
            x: one sample [*input_shape] or a batch [n, *input_shape] of any n >= 1; it is cut into
                batches of at most ``data.batch_size`` rows.

        Returns:
            The tag of this input: predictions come back in feed order, one array per feed.
        """
        feed = self._runtime.feed
        if feed is None:
            raise RuntimeError("feed() needs open_pipeline(..., mode='predict')")
        input_shape = tuple(self.spec.model.input_shape)
        x = as_inputs(x, input_shape, what="feed")
        if x.shape[0] == 0:
            raise ValueError(f"feed takes at least one sample of shape {expected(input_shape)}, got none")
        tag, self._tags = self._tags, self._tags + 1
        count = x.shape[0]
        for position, (start, stop) in enumerate(batch_bounds(count, self.spec.data.batch_size)):
            batch = Batch(
                seq=self._seq,
                epoch=0,
                position=position,
                indices=np.arange(start, stop),
                x=x[start:stop],
                y=None,
                split="predict",
                tag=tag,
                last=stop == count,
            )
            self._seq += 1
            await feed.send(batch)
        return tag

    async def end_input(self) -> None:
        """No more feeds: the pipeline drains and its actors finish."""
        if self._runtime.feed is not None:
            self._runtime.feed.close()

    async def results(self) -> AsyncIterator[np.ndarray]:
        """Predictions, one array per feed, in feed order, until the input ends.

        Yields:
            [n, *output_shape] arrays.
        """
        if self._runtime.results is None:
            raise RuntimeError("results() needs open_pipeline(..., mode='predict')")
        parts: list[np.ndarray] = []
        async for received in self._runtime.results:
            for item in unpack(received):  # predictions ready together come as one chunk
                if isinstance(item, Prediction):
                    parts.append(item.outputs)
                    if item.last:
                        out, parts = np.concatenate(parts), []
                        yield out

    async def predict(self, x: np.ndarray) -> np.ndarray:
        """Feed one input and wait for its predictions (no other feeds may be in flight).

        Args:
            x: a batch [n, *input_shape].

        Returns:
            [n, *output_shape].
        """
        out: list[np.ndarray] = []
        results = self.results()

        async def collect() -> None:
            out.append(await results.__anext__())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect)
            await self.feed(x)
        await results.aclose()
        return out[0]


@asynccontextmanager
async def open_pipeline(
    spec: Spec | str | Path | None = None,
    *,
    resume: str | Path | None = None,
    backend: Backend | None = None,
    mode: Mode = "train",
    hooks: Sequence[Hooks] = (),
    progress: Progress | None = None,
    callbacks: Sequence[Callback] = (),
) -> AsyncIterator[PipelineHandle]:
    """Run a pipeline inside a trio program.

    ``mode="train"``: the loader drives; the block's end waits for the run to finish (or call
    ``p.cancel()``), and ``p.result`` holds the RunResult afterwards. ``mode="predict"``: the caller
    feeds inputs with ``await p.feed(x)`` and reads ``p.results()`` (or ``await p.predict(x)``);
    leaving the block ends the input, and predictions not read by then are dropped.

    Args:
        spec: the spec, a spec file, or None to take the one in ``resume``'s checkpoint.
        resume: a checkpoint file or directory to continue from (training) or to take weights
            from (predicting).
        backend: a backend to use (the caller keeps and closes it); None opens what
            ``spec.devices.select`` asks for and closes it at the end. A backend with
            ``runs_inline = True`` (flow.testing.FakeDevice) makes the whole pipeline thread-free.
        mode: "train" or "predict".
        hooks: observers of every item the actors move (see actors.meter.Hooks).
        progress: the progress line; default: drawn on stderr when it is a TTY.
        callbacks: flow.callbacks.Callback objects run in the sink after each step, evaluation and
            checkpoint (training only); one may stop the run early, with a checkpoint.

    Yields:
        The running pipeline.

    Raises:
        ActorError: an actor failed (``__cause__`` is the original error), or a callback raised
            (``callback`` names it).
        NonFiniteLoss: a training step's loss was NaN or infinite (``run.on_nonfinite="raise"``);
            it names the step.
        KeyboardInterrupt: after a checkpoint, when the spec has a checkpoint_dir.
    """
    if callbacks and mode != "train":
        raise ValueError("callbacks watch a training run; open_pipeline(mode='predict') takes none")
    spec, saved = _resolve(spec, resume)
    progress = progress if progress is not None else Progress()
    runtime = Runtime(spec, mode, saved, backend, hooks, progress, callbacks)
    try:
        await runtime.open()
        try:
            async with trio.open_nursery() as nursery:
                handle = PipelineHandle(runtime, nursery)
                runtime.start(nursery)
                yield handle
                if mode == "predict":
                    await handle.end_input()
                    async for _ in runtime.results:  # unread predictions: let the pipeline drain
                        pass
        except BaseException as error:
            raise _translate(runtime, error) from _cause(runtime, error)
        if runtime.stopped is not None:
            await runtime.finish_stopped()
        handle.result = runtime.result() if mode == "train" else None
        for callback in runtime.callbacks:
            callback.on_end(handle.result)
    finally:
        runtime.close()


def _cause(runtime: Runtime, error: BaseException) -> BaseException | None:
    if runtime.failure is not None and not any(isinstance(e, KeyboardInterrupt) for e in error_leaves(error)):
        return None if _stopped(runtime.failure) else runtime.failure.error
    return error.__cause__


def _stopped(failure: ActorError) -> bool:
    """Whether the run stopped itself (its loss went non-finite): no actor failed, so the run raises
    that error as its own, not as an ActorError."""
    return isinstance(failure.error, NonFiniteLoss)


def _translate(runtime: Runtime, error: BaseException) -> BaseException:
    """The one exception to raise for what ended the nursery."""
    leaves = [e for e in error_leaves(error) if not isinstance(e, trio.Cancelled)]
    interrupt = next((e for e in leaves if isinstance(e, KeyboardInterrupt)), None)
    if runtime.failure is not None and interrupt is None:
        return runtime.failure.error if _stopped(runtime.failure) else runtime.failure
    if interrupt is not None:
        path = runtime.interrupted()
        if path is not None:
            interrupt.add_note(f"vkflow: interrupted; checkpoint written to {path}")
        return interrupt
    if len(leaves) == 1:
        return leaves[0]
    return error


# -- sync entry points -------------------------------------------------------------------------------


def run(
    spec: Spec | str | Path | None = None,
    resume: str | Path | None = None,
    backend: Backend | None = None,
    *,
    hooks: Sequence[Hooks] = (),
    progress: Progress | None = None,
    callbacks: Sequence[Callback] = (),
) -> RunResult:
    """Train a spec to the end (sync; runs trio inside).

    Args:
        spec: the spec or a spec file; None takes the spec in ``resume``'s checkpoint.
        resume: a checkpoint file or directory: continue exactly where it stopped.
        backend: a backend to use and keep open; None opens the one the spec selects.
        hooks: observers of every item the actors move.
        progress: the progress line; default: drawn on stderr when it is a TTY.
        callbacks: flow.callbacks.Callback objects (``EarlyStopping(patience=3)``) run after each
            step, evaluation and checkpoint; one may stop the run early, with a checkpoint.

    Returns:
        The RunResult (final metrics, eval accuracy, steps, checkpoint path, weights;
        ``stopped_early`` when a callback stopped the run).

    Raises:
        ActorError: an actor failed, or a callback raised (``callback`` names it).
        NonFiniteLoss: a training step's loss was NaN or infinite (``run.on_nonfinite="raise"``);
            it names the step.
        KeyboardInterrupt: interrupted (a checkpoint is written first when the spec has a directory).
    """

    async def main() -> RunResult:
        options = {"backend": backend, "hooks": hooks, "progress": progress, "callbacks": callbacks}
        async with open_pipeline(spec, resume=resume, **options) as p:
            pass
        assert p.result is not None
        return p.result

    return trio.run(main)

"""Helpers for testing pipelines and actors with pytest-trio.

- :class:`FakeDevice`: the CPU backend marked ``runs_inline``. Given to ``open_pipeline`` it makes
  the whole pipeline thread-free (the device waits, the loader reads, preprocess and the sink work
  on the event loop), so a test is deterministic under trio's ``autojump_clock``: virtual time
  moves only when every actor is blocked, never while a worker thread runs.
- :func:`step_pipeline`: a training pipeline that takes one batch per ``await stepper.step()``.
- :class:`ChannelProbe`: records the deepest each channel got and whether a sender ever waited,
  to assert backpressure.
- :class:`FailAt` and :class:`Slow`: make one actor fail at its n-th item, or be slow.

Example (see tests/test_flow_testing_example.py)::

    async def test_one_step_at_a_time(autojump_clock):
        async with step_pipeline(spec, backend=FakeDevice()) as stepper:
            first = await stepper.step()
            assert first.step == 0
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from actors.cpu_backend import CpuBackend
from actors.messages import Batch, StepDone
from actors.meter import Hooks
from actors.statistics import ActorStatistics
from flow.runner import PipelineHandle, open_pipeline
from flow.spec import Spec


class FakeDevice(CpuBackend):
    """The CPU backend, run on the event loop: no worker thread anywhere in the pipeline.

    Args:
        precision: "float32" (as the GPU) or "float64".
    """

    runs_inline = True


class ChannelProbe(Hooks):
    """Samples every channel's depth each time an actor moves an item.

    Depth only grows on a send, and every send is followed by a sample, so ``peak`` is the exact
    maximum depth each channel reached.

    Attributes:
        peak: (src, dst) -> the most items seen waiting.
        capacity: (src, dst) -> the channel's capacity.
        blocked: (src, dst) -> whether a sender was ever seen waiting for space.
        samples: how many times the channels were sampled.
    """

    def __init__(self) -> None:
        self.channels: dict[tuple[str, str], Any] = {}
        self.peak: dict[tuple[str, str], int] = {}
        self.capacity: dict[tuple[str, str], int] = {}
        self.blocked: dict[tuple[str, str], bool] = {}
        self.samples = 0

    def attach(self, channels: dict[tuple[str, str], tuple[Any, Any]]) -> None:
        for edge, (send, _receive) in channels.items():
            self.channels[edge] = send
            self.capacity[edge] = int(send.statistics().max_buffer_size)
            self.peak[edge] = 0
            self.blocked[edge] = False

    def sample(self) -> None:
        """Record every channel's depth now."""
        self.samples += 1
        for edge, send in self.channels.items():
            stats = send.statistics()
            self.peak[edge] = max(self.peak[edge], stats.current_buffer_used)
            self.blocked[edge] = self.blocked[edge] or stats.tasks_waiting_send > 0

    async def received(self, actor: str, item: Any) -> None:
        self.sample()

    async def sent(self, actor: str, item: Any) -> None:
        self.sample()


class FailAt(Hooks):
    """Make one actor raise when it moves its n-th item (counted from 1).

    Args:
        actor: the node's name.
        item: which item.
        error: the exception to raise.
        on: "received" (after taking the item from the inbox) or "sending" (before sending it);
            default "sending" for the loader, which has no inbox, and "received" for the others.

    Attributes:
        raised_at: ``time.monotonic()`` when it raised (to measure how fast the run stops).
    """

    def __init__(
        self, actor: str, item: int = 1, error: BaseException | None = None, on: str | None = None
    ) -> None:
        self.actor = actor
        self.item = item
        self.error = error if error is not None else RuntimeError(f"injected failure in {actor}")
        self.on = on or ("sending" if actor == "loader" else "received")
        self.count = 0
        self.raised_at: float | None = None

    def _tick(self, actor: str, where: str) -> None:
        if actor != self.actor or where != self.on:
            return
        self.count += 1
        if self.count == self.item:
            self.raised_at = time.monotonic()
            raise self.error

    async def received(self, actor: str, item: Any) -> None:
        self._tick(actor, "received")

    async def sending(self, actor: str, item: Any) -> None:
        self._tick(actor, "sending")


class Slow(Hooks):
    """Make one actor sleep after each item it receives (a slow consumer).

    Args:
        actor: the node's name.
        seconds: the sleep (virtual under autojump_clock).
    """

    def __init__(self, actor: str, seconds: float) -> None:
        self.actor = actor
        self.seconds = seconds

    async def received(self, actor: str, item: Any) -> None:
        if actor == self.actor:
            await trio.sleep(self.seconds)


class _Gate(Hooks):
    """Holds each training batch at the loader until a permit arrives; reports steps as the sink
    receives them."""

    holds = True

    def __init__(self) -> None:
        self.permits_send, self.permits = trio.open_memory_channel(1)
        self.done_send, self.done = trio.open_memory_channel(1)

    async def sending(self, actor: str, item: Any) -> None:
        if actor == "loader" and isinstance(item, Batch) and item.split == "train":
            await self.permits.receive()

    async def received(self, actor: str, item: Any) -> None:
        if actor == "sink" and isinstance(item, StepDone):
            await self.done_send.send(item)


class Stepper:
    """A training pipeline driven one batch at a time (from :func:`step_pipeline`)."""

    def __init__(self, pipeline: PipelineHandle, gate: _Gate) -> None:
        self.pipeline = pipeline
        self._gate = gate

    async def step(self) -> StepDone:
        """Let one training batch through and wait until its step is reported at the sink.

        Returns:
            The step's StepDone.
        """
        await self._gate.permits_send.send(None)
        return await self._gate.done.receive()

    def statistics(self) -> dict[str, ActorStatistics]:
        """Every actor's statistics now."""
        return self.pipeline.statistics()


@asynccontextmanager
async def step_pipeline(
    spec: Spec, *, backend: Any = None, hooks: Sequence[Hooks] = (), resume: Any = None
) -> AsyncIterator[Stepper]:
    """Open a training pipeline that moves one batch per ``await stepper.step()``.

    Leaving the block cancels the pipeline (no final checkpoint).

    Args:
        spec: the spec (keep ``run.steps`` above the steps you take).
        backend: the backend; use FakeDevice() for deterministic tests.
        hooks: more hooks (e.g. a ChannelProbe).
        resume: a checkpoint to start from.

    Yields:
        The stepper.
    """
    gate = _Gate()
    async with open_pipeline(spec, backend=backend, hooks=[gate, *hooks], resume=resume) as pipeline:
        yield Stepper(pipeline, gate)
        pipeline.cancel()

"""The meter through which every actor moves its items, and the hooks it calls on the way.

Every actor takes items from its inbox and sends to its outboxes only through a :class:`Meter`, so
the counts (items in and out), the times (busy working, idle waiting for input, blocked waiting for
space downstream) and the channel fill are measured in one place, the same way for every actor.
``Meter.statistics()`` returns a frozen :class:`actors.statistics.ActorStatistics`.

:class:`Hooks` lets tests and tools watch or perturb items as actors move them (fail at the n-th
item, sleep to be a slow consumer, gate a loader one batch at a time, sample channel depths); a
Meter without hooks pays nothing for them.

Messages move in chunks (:class:`actors.messages.Chunk`) where several are ready at once: the meter
unpacks a chunk it receives and hands its messages out one by one (``holding`` counts those left),
and an actor stages what it sends (:meth:`Meter.stage`) and sends the staged messages as one
channel item (:meth:`Meter.flush`). :meth:`Meter.pass_on` keeps a chunk whole through a relay, and
anything staged leaves before the actor waits for input, so a chunk never waits on an idle actor.
Counts, hooks and order stay per message; only channel capacities count chunks (at most
``MAX_CHUNK`` messages each).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import trio

from actors.messages import Chunk
from actors.statistics import ActorStatistics

# The most messages one channel item carries. Issue 13's measurement in a throwaway copy: 4-8 steps
# a message brought the event loop's cost to 24-28 µs a step, past which it hardly falls; a bigger
# chunk only holds more batches (and their slots) ahead of the device and delays their reports.
MAX_CHUNK = 8


class Hooks:
    """Callbacks around every item an actor moves; the default does nothing.

    Subclass and override what you need (see flow.testing for ready-made ones). Hooks run inside
    the actor's task, so an exception raised here is that actor failing, and a sleep here is that
    actor being slow.

    The items are the records of :mod:`actors.messages`, one at a time (a
    :class:`~actors.messages.Chunk` never reaches a hook): between the loader and the device,
    :class:`~actors.messages.Batch` (training, evaluation or prediction rows) and
    :class:`~actors.messages.CheckpointMark`; out of the preprocess node, once a run, an
    :class:`~actors.messages.InputStatistics` ahead of the first training batch; out of the device,
    :class:`~actors.messages.StepDone` per training step, :class:`~actors.messages.EvalDone` per
    evaluation round (validation, and the test split at the end), :class:`~actors.messages.Snapshot`
    at each checkpoint mark, and :class:`~actors.messages.Prediction` when predicting.

    Attributes:
        holds: set it on a hook whose ``sending`` can wait for something outside the pipeline (a
            test's permit, as flow.testing's step gate): the meter then sends what it has staged
            before calling it, so no message waits, staged, behind the one the hook holds.
    """

    holds = False

    def attach(self, channels: dict[tuple[str, str], tuple[Any, Any]]) -> None:
        """Called once before the actors start.

        Args:
            channels: (src, dst) -> (send channel, receive channel) for every pipeline edge.
        """

    async def received(self, actor: str, item: Any) -> None:
        """After ``actor`` took ``item`` from its inbox."""

    async def sending(self, actor: str, item: Any) -> None:
        """Before ``actor`` sends ``item`` downstream."""

    async def sent(self, actor: str, item: Any) -> None:
        """After ``actor`` sent ``item`` to every outbox."""


class HookList(Hooks):
    """Several hooks, called in order."""

    def __init__(self, hooks: Sequence[Hooks]) -> None:
        self.hooks = tuple(hooks)
        self.holds = any(hook.holds for hook in self.hooks)

    def attach(self, channels: dict[tuple[str, str], tuple[Any, Any]]) -> None:
        for hook in self.hooks:
            hook.attach(channels)

    async def received(self, actor: str, item: Any) -> None:
        for hook in self.hooks:
            await hook.received(actor, item)

    async def sending(self, actor: str, item: Any) -> None:
        for hook in self.hooks:
            await hook.sending(actor, item)

    async def sent(self, actor: str, item: Any) -> None:
        for hook in self.hooks:
            await hook.sent(actor, item)


def _used(channel: Any) -> int:
    stats = getattr(channel, "statistics", None)
    return int(stats().current_buffer_used) if stats else 0


def _peak(channel: Any) -> int | None:
    """The most items ``channel`` ever held, as the channel itself counts it (trio >= 0.24); None
    when it does not, and the meter has to sample the depth on every item instead."""
    stats = getattr(channel, "statistics", None)
    peak = getattr(stats(), "peak_buffer_used", None) if stats else 0
    return None if peak is None else int(peak)


def _capacity(channel: Any) -> int:
    stats = getattr(channel, "statistics", None)
    size = stats().max_buffer_size if stats else 0
    return int(size) if size != float("inf") else -1


# An actor's states, in the order that wins where two overlap (the device actor's feeder may wait
# for input while its completer waits for the GPU: the actor is busy).
BUSY, BLOCKED, IDLE = 0, 1, 2


class _Timed:
    """Puts a Meter in a state for the time inside a ``with`` block (a plain class: a
    generator-based context manager costs three times as much, on every item)."""

    __slots__ = ("meter", "state")

    def __init__(self, meter: Meter, state: int) -> None:
        self.meter = meter
        self.state = state

    def __enter__(self) -> None:
        meter = self.meter
        meter._accrue()
        meter._active[self.state] += 1

    def __exit__(self, *exc: object) -> None:
        meter = self.meter
        meter._accrue()
        meter._active[self.state] -= 1


class Meter:
    """An actor's ports: iterate it for inbox items, ``send`` to every outbox, ``busy()`` around
    work. Use it as an async context manager; leaving it cleanly closes the inbox and the outboxes,
    so the actors downstream see the end of the stream.

    Moving an item costs the actor at most one schedule point: an item already waiting in the inbox
    is taken at once (the actor yields when its inbox runs dry), and an actor with an inbox sends
    without one when there is room. A source actor (no inbox) yields at every send, so every chain
    of actors yields at least once per item and a cancellation reaches each actor within the few
    items its inbox holds. Channel peaks come from the channels' own counters where they keep one,
    so a step pays nothing for them.

    Args:
        name: the actor's name (statistics and hooks use it).
        inbox: the receive channel, or None for a source actor.
        outboxes: send channels; each item goes to every one of them in order (explicit fan-out).
        hooks: optional observers.
        clock: the time source for busy/idle/blocked seconds.
    """

    def __init__(
        self,
        name: str,
        inbox: trio.MemoryReceiveChannel | None = None,
        outboxes: Sequence[trio.MemorySendChannel] = (),
        hooks: Hooks | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.name = name
        self.inbox = inbox
        self.outboxes = tuple(outboxes)
        self.hooks = hooks
        self._clock = clock
        self._in = 0
        self._out = 0
        self._spent = [0.0, 0.0, 0.0]  # seconds busy, blocked, idle (see ActorStatistics)
        self._active = [0, 0, 0]  # blocks in each state now (the actor's tasks may overlap)
        self._mark: float | None = None  # the last change of state; None before the start, after close
        self._started: float | None = None  # when the actor started (entered the meter, or its first state)
        self._ended: float | None = None
        self._inbox_peak = 0
        self._outbox_peak = 0
        self._local: deque[Any] = deque()  # the current chunk's messages not yet handed out
        self._staged: list[Any] = []  # messages to send together at the next flush
        # Channels without their own peak counter (older trio, stand-ins in tests) are sampled.
        self._sample_inbox = inbox is not None and _peak(inbox) is None
        self._sample_outboxes = any(_peak(outbox) is None for outbox in self.outboxes)

    # -- receiving -------------------------------------------------------------------------------
    def __aiter__(self) -> Meter:
        return self

    async def __anext__(self) -> Any:
        if self._local:
            item = self._local.popleft()
        else:
            item = await self._receive()
            if type(item) is Chunk:
                self._local.extend(item)
                item = self._local.popleft()
        self._in += 1
        if self.hooks is not None:
            await self.hooks.received(self.name, item)
        return item

    async def _receive(self) -> Any:
        inbox = self.inbox
        if inbox is None:
            raise StopAsyncIteration
        if self._sample_inbox:
            used = _used(inbox)
            if used > self._inbox_peak:
                self._inbox_peak = used
        try:
            return inbox.receive_nowait()
        except trio.WouldBlock:
            if self._staged:  # nothing more in hand: what is ready leaves before the wait
                await self.flush()
            return await self._receive_waiting(inbox)
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def peek(self) -> Any:
        """The next inbox item if it is here already (the rest of the current chunk, or a message
        waiting in the inbox), without taking it and without a schedule point; None if none is
        (or hooks watch this actor: they observe every receive, which may wait).
        """
        if self.hooks is not None:
            return None
        if not self._local:
            if self.inbox is None:
                return None
            try:
                item = self.inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return None  # the end, if it is that, is seen by the next ``async for`` turn
            if type(item) is Chunk:
                self._local.extend(item)
            else:
                self._local.append(item)
        return self._local[0]

    def take(self) -> Any:
        """Take the item :meth:`peek` just returned (not None)."""
        self._in += 1
        return self._local.popleft()

    @property
    def holding(self) -> int:
        """Messages of the chunk being received that the actor has not taken yet."""
        return len(self._local)

    async def _receive_waiting(self, inbox: trio.MemoryReceiveChannel) -> Any:
        with _Timed(self, IDLE):
            try:
                return await inbox.receive()
            except trio.EndOfChannel:
                raise StopAsyncIteration from None

    # -- sending ---------------------------------------------------------------------------------
    async def send(self, item: Any) -> None:
        """Send ``item`` to every outbox now, after (and with) whatever is staged.

        Args:
            item: the message.
        """
        await self.stage(item)
        await self.flush()

    async def stage(self, item: Any) -> None:
        """Queue ``item`` for the next :meth:`flush` (the caller flushes at ``MAX_CHUNK``)."""
        if self.hooks is not None:
            if self.hooks.holds:
                await self.flush()
            await self.hooks.sending(self.name, item)
        self._staged.append(item)

    @property
    def staged(self) -> int:
        """Messages staged and not yet sent."""
        return len(self._staged)

    async def pass_on(self, item: Any) -> None:
        """Send ``item`` with the rest of the chunk it came in: staged while the chunk still holds
        messages (up to ``MAX_CHUNK``), so a relay sends a chunk on as one item."""
        await self.stage(item)
        if not self._local or len(self._staged) >= MAX_CHUNK:
            await self.flush()

    async def flush(self) -> None:
        """Send the staged messages to every outbox as one channel item, waiting for space (the
        time counts as blocked).

        An actor with an inbox yields to the scheduler when its inbox runs dry, so its sends skip
        trio's extra schedule point when there is room (``send_nowait``); a source actor always
        yields.
        """
        staged = self._staged
        if not staged:
            return
        self._staged = []
        item = staged[0] if len(staged) == 1 else Chunk(staged)
        if self.inbox is not None:
            for outbox in self.outboxes:
                try:
                    outbox.send_nowait(item)
                except trio.WouldBlock:
                    await self._send_waiting(outbox, item)
        else:
            for outbox in self.outboxes:
                await self._send_waiting(outbox, item)
        if self._sample_outboxes:
            for outbox in self.outboxes:
                used = _used(outbox)
                if used > self._outbox_peak:
                    self._outbox_peak = used
        self._out += len(staged)
        if self.hooks is not None:
            for message in staged:
                await self.hooks.sent(self.name, message)

    def room(self) -> bool:
        """Whether every outbox has space for an item now (a send would not wait)."""
        for outbox in self.outboxes:
            statistics = getattr(outbox, "statistics", None)
            if statistics is not None:
                now = statistics()
                if now.current_buffer_used >= now.max_buffer_size:
                    return False
        return True

    async def _send_waiting(self, outbox: trio.MemorySendChannel, item: Any) -> None:
        with _Timed(self, BLOCKED):
            await outbox.send(item)

    def busy(self) -> _Timed:
        """Count the time inside the block (``with meter.busy():``) as work."""
        return _Timed(self, BUSY)

    def blocked(self) -> _Timed:
        """Count the time inside the block as waiting for capacity downstream (e.g. a free device
        slot), like a send that waits for space."""
        return _Timed(self, BLOCKED)

    def idle(self) -> _Timed:
        """Count the time inside the block as waiting for input that comes on a channel besides
        the inbox (a pipeline stage's activations or gradients), like an empty inbox."""
        return _Timed(self, IDLE)

    def _accrue(self) -> None:
        """Add the time since the last change of state to the state the actor was in: busy if any
        of its tasks was, else blocked, else idle; in none (its own code between waits): busy."""
        now = self._clock()
        if self._started is None:
            self._started = now
        if self._mark is not None:
            busy, blocked, idle = self._active
            state = BUSY if busy or not (blocked or idle) else BLOCKED if blocked else IDLE
            self._spent[state] += now - self._mark
        self._mark = now

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the inbox and every outbox (no checkpoint: nothing else runs meanwhile); the
        actor's clock stops."""
        if self._mark is not None:
            self._accrue()
            self._mark, self._ended = None, self._mark
        for outbox in self.outboxes:
            outbox.close()
        if self.inbox is not None:
            self.inbox.close()

    async def __aenter__(self) -> Meter:
        if self._started is None:  # the actor's lifetime begins: its own code counts as busy
            self._accrue()
        return self

    async def __aexit__(self, exc_type: type | None, *exc: object) -> None:
        # Only a clean end closes the channels. On an error the runner cancels every actor anyway;
        # closing here would make the neighbours fail too (BrokenResourceError upstream, a false
        # end of stream downstream) and blur which actor really failed.
        if exc_type is None:
            await self.flush()
            self.close()

    def statistics(self) -> ActorStatistics:
        """The counters now.

        Returns:
            A frozen snapshot.
        """
        if self._mark is not None:  # running: count up to now
            self._accrue()
        inbox_peak = self._inbox_peak
        if self.inbox is not None and not self._sample_inbox:
            inbox_peak = max(inbox_peak, _peak(self.inbox) or 0)
        outbox_peak = max(self._outbox_peak, max((_peak(o) or 0 for o in self.outboxes), default=0))
        started, ended = self._started, self._ended if self._mark is None else self._mark
        return ActorStatistics(
            name=self.name,
            seconds=ended - started if started is not None and ended is not None else 0.0,
            items_in=self._in,
            items_out=self._out,
            busy_seconds=self._spent[BUSY],
            idle_seconds=self._spent[IDLE],
            blocked_seconds=self._spent[BLOCKED],
            inbox_used=_used(self.inbox) if self.inbox is not None else 0,
            inbox_capacity=_capacity(self.inbox) if self.inbox is not None else 0,
            inbox_peak=inbox_peak,
            outbox_used=max((_used(o) for o in self.outboxes), default=0),
            outbox_peak=outbox_peak,
        )

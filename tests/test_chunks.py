"""Several messages per channel item (actors.messages.Chunk): the loader sends ready batches one
by one while the channel downstream has room and the loop keeps up, and chunks them while the
channel is full or the loop is the slower side (actors.read_ahead); a relay
passes a chunk on whole; the device reports steps finished together as one item; counts, hooks
and order stay per message, and a chunk never waits on an idle actor."""

from __future__ import annotations

import time

import numpy as np
import pytest
import trio
from fake_sources import CostlySource

from actors.loader import Loader, Read
from actors.messages import Chunk, unpack
from actors.meter import MAX_CHUNK, Hooks, Meter
from actors.read_ahead import WINDOW, ReadAhead
from flow.runner import run
from flow.testing import FakeDevice, Slow


class Seen(Hooks):
    def __init__(self) -> None:
        self.taken: list[object] = []
        self.given: list[object] = []

    async def received(self, actor, item) -> None:
        self.taken.append(item)

    async def sent(self, actor, item) -> None:
        self.given.append(item)


async def test_a_relay_passes_a_chunk_on_whole_and_counts_each_message():
    into, inbox = trio.open_memory_channel(4)
    outbox, out = trio.open_memory_channel(4)
    seen = Seen()
    relay = Meter("relay", inbox, [outbox], seen)
    await into.send(Chunk(("a", "b", "c")))
    await into.send("d")
    await into.aclose()
    async with relay:
        async for item in relay:
            await relay.pass_on(item.upper())
    items = [item async for item in out]
    assert items == [Chunk(("A", "B", "C")), "D"] and type(items[0]) is Chunk
    assert seen.taken == ["a", "b", "c", "d"] and seen.given == ["A", "B", "C", "D"]
    stats = relay.statistics()
    assert (stats.items_in, stats.items_out) == (4, 4)


async def test_staged_messages_leave_before_the_actor_waits_for_input():
    into, inbox = trio.open_memory_channel(4)
    outbox, out = trio.open_memory_channel(4)
    meter = Meter("actor", inbox, [outbox])
    await into.send(Chunk((1, 2)))
    async with trio.open_nursery() as nursery:

        async def actor() -> None:
            async with meter:
                async for item in meter:
                    await meter.stage(item * 10)  # never flushed by the actor itself

        nursery.start_soon(actor)
        with trio.fail_after(1):
            assert unpack(await out.receive()) == (10, 20)  # sent while the actor waits for more
        await into.aclose()


def _loader(outbox: trio.MemorySendChannel, steps: int, on_device: bool) -> Loader:
    stream = (Read(seq, "train", seq, 0, seq, np.arange(seq, seq + 2)) for seq in range(steps))
    meter = Meter("loader", None, [outbox])
    if on_device:  # indices into a dataset on the device: nothing to read
        return Loader(meter, None, stream, on_device=True)
    return Loader(meter, CostlySource(0.0, in_memory=True), stream)  # a gather from RAM, inline


def _spin(seconds: float) -> None:
    """Hold the event loop (the CPU work of the other actors' turns)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _chunk_sizes(steps: int, on_device: bool, slow: bool, busy_s: float = 0.0) -> list[int]:
    # Room for one item when the consumer is behind; room to spare when it keeps up (or when it
    # holds the loop, and with it the loader, for ``busy_s`` each item it takes).
    outbox, received = trio.open_memory_channel(1 if slow else MAX_CHUNK if not busy_s else steps)
    items: list[object] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_loader(outbox, steps, on_device).run)
        async for item in received:
            items.append(item)
            _spin(busy_s)
            if slow:
                await trio.sleep(1.0)
    assert [batch.seq for item in items for batch in unpack(item)] == list(range(steps))
    return [len(unpack(item)) for item in items]


@pytest.mark.parametrize("on_device", [False, True], ids=["read on the host", "indices on the device"])
async def test_the_loader_chunks_only_while_the_consumer_is_behind(autojump_clock, on_device):
    # Keeping up: one batch per item, no latency added (and a hook that holds each batch, such as
    # flow.testing's step gate, never waits on batches staged behind it).
    assert await _chunk_sizes(100, on_device, slow=False) == [1] * 100
    behind = await _chunk_sizes(100, on_device, slow=True)
    assert max(behind) == MAX_CHUNK and behind.count(MAX_CHUNK) >= 100 // MAX_CHUNK - 2


@pytest.mark.parametrize("on_device", [False, True], ids=["read on the host", "indices on the device"])
async def test_the_loader_chunks_when_the_loop_is_the_slower_side(on_device):
    # The channel always has room, but each message costs the loop 400 us of other work: the
    # loader holds ready batches back and sends them together, in order, at most MAX_CHUNK a time.
    sizes = await _chunk_sizes(200, on_device, slow=False, busy_s=400e-6)
    assert max(sizes) == MAX_CHUNK and len(sizes) < 200 // 2


def test_read_ahead_holds_only_while_the_next_batch_is_ready_before_the_loop_comes_back():
    policy = ReadAhead(limit=4, floor_s=100e-6)
    policy.prepared(10e-6)
    for _ in range(WINDOW // 2 - 1):
        policy.turned_around(300e-6)
    assert not policy.hold(1, 0.0)  # too few turnarounds seen to judge
    policy.turned_around(300e-6)
    assert policy.hold(1, 0.0) and policy.hold(3, 280e-6)
    assert not policy.hold(3, 295e-6)  # the next batch would come after the loop came back
    assert not policy.hold(4, 0.0)  # the chunk is full
    policy.turned_around(5.0)  # one slow turn (the OS took the core) moves nothing
    assert policy.turnaround_s == 300e-6 and policy.hold(1, 0.0)
    for _ in range(WINDOW):
        policy.turned_around(60e-6)  # a loop that comes back quickly: nothing is held
    assert not policy.hold(1, 0.0)


def test_a_run_behind_a_slow_device_moves_chunks_and_reports_every_step(tmp_path, monkeypatch):
    from specs import synthetic_spec  # the tests' own spec builders

    flushed: dict[str, list[int]] = {}
    flush = Meter.flush

    async def counted(meter: Meter) -> None:
        if meter.staged:
            flushed.setdefault(meter.name, []).append(meter.staged)
        await flush(meter)

    monkeypatch.setattr(Meter, "flush", counted)

    class Steps(Hooks):
        def __init__(self) -> None:
            self.steps: list[int] = []

        async def received(self, actor, item) -> None:
            if actor == "sink" and hasattr(item, "lr"):
                self.steps.append(item.step)

    steps = Steps()
    slow_device = Slow("device", 0.003)
    result = run(synthetic_spec(tmp_path, epochs=4), backend=FakeDevice(), hooks=[steps, slow_device])
    assert steps.steps == list(range(result.steps)) and result.steps == 52  # every step, once, in order
    assert max(flushed["loader"]) > 1  # the loader ran ahead of the slow device in chunks
    assert sum(flushed["loader"]) == result.statistics["loader"].items_out

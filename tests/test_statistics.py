"""actors.statistics: an actor's busy, idle and blocked seconds add up to its lifetime
(``seconds``); a slow consumer shows as blocked time in its producer, a slow producer as idle time in
its consumer. First two bare meters on trio's virtual clock (exact figures), then a whole run
slowed through the runtime's hooks, where the same reading has to hold."""

from __future__ import annotations

import time

import pytest
import trio
from specs import synthetic_spec

from actors.cpu_backend import CpuBackend
from actors.meter import Hooks, Meter
from flow.runner import run
from flow.testing import Slow

ITEMS, CAPACITY = 10, 2


async def producer_and_consumer(produce_s: float, consume_s: float):
    """A source and its consumer over a channel of CAPACITY, each working the given (virtual)
    seconds per item; their statistics at the end."""
    send, receive = trio.open_memory_channel(CAPACITY)
    producer = Meter("producer", outboxes=[send], clock=trio.current_time)
    consumer = Meter("consumer", inbox=receive, clock=trio.current_time)

    async def produce() -> None:
        async with producer:
            for item in range(ITEMS):
                with producer.busy():
                    await trio.sleep(produce_s)
                await producer.send(item)

    async def consume() -> None:
        async with consumer:
            async for _ in consumer:
                with consumer.busy():
                    await trio.sleep(consume_s)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        nursery.start_soon(consume)
    return producer.statistics(), consumer.statistics()


def assert_adds_up(stats) -> None:
    total = stats.busy_seconds + stats.idle_seconds + stats.blocked_seconds
    assert total == pytest.approx(stats.seconds, rel=1e-9, abs=1e-9), stats.name


async def test_a_slow_consumer_blocks_its_producer(autojump_clock):
    producer, consumer = await producer_and_consumer(0.0, 1.0)
    # The consumer takes item 0 at once; the producer fills the channel, then each send waits for
    # the consumer to take one more: its last send goes out when the consumer takes item 7.
    waited = ITEMS - CAPACITY - 1
    assert (producer.seconds, producer.blocked_seconds, producer.busy_seconds, producer.idle_seconds) == (
        pytest.approx(waited), pytest.approx(waited), 0.0, 0.0)  # fmt: skip
    assert (consumer.seconds, consumer.busy_seconds, consumer.idle_seconds) == (ITEMS, ITEMS, 0.0)
    assert (producer.items_out, consumer.items_in) == (ITEMS, ITEMS)
    for stats in (producer, consumer):
        assert_adds_up(stats)


async def test_a_slow_producer_leaves_its_consumer_idle(autojump_clock):
    producer, consumer = await producer_and_consumer(1.0, 0.0)
    assert (producer.seconds, producer.busy_seconds, producer.blocked_seconds) == (ITEMS, ITEMS, 0.0)
    # The consumer waits for every item; the last ends its stream at the producer's end.
    assert (consumer.seconds, consumer.idle_seconds, consumer.busy_seconds) == (ITEMS, ITEMS, 0.0)
    for stats in (producer, consumer):
        assert_adds_up(stats)


class SlowLoader(Hooks):
    """The loader sleeps before each message it sends (a slow producer)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.messages = 0

    async def sending(self, actor: str, item) -> None:
        if actor == "loader":
            self.messages += 1
            await trio.sleep(self.seconds)


def run_statistics(hooks):
    started = time.perf_counter()
    result = run(synthetic_spec(epochs=6), backend=CpuBackend(), hooks=hooks)
    wall = time.perf_counter() - started
    for stats in result.statistics.values():
        assert_adds_up(stats)
        assert 0 < stats.seconds <= wall, stats.name
    return result.statistics


def test_in_a_run_a_slow_sink_blocks_the_device_and_a_slow_loader_idles_the_rest():
    pause = 0.003
    slow_sink = run_statistics([Slow("sink", pause)])
    slept = slow_sink["sink"].items_in * pause
    assert slow_sink["sink"].busy_seconds >= slept  # the hook's sleep is the sink's own code
    # The device runs ahead of the sink by at most what the channel holds (4 chunks of 8 steps):
    # for the rest of the run it waits for room.
    ahead = 4 * 8 * pause
    assert slow_sink["device"].blocked_seconds >= 0.5 * (slept - ahead)
    assert slow_sink["device"].blocked_seconds > slow_sink["device"].idle_seconds

    hook = SlowLoader(pause)
    slow_loader = run_statistics([hook])
    slept = hook.messages * pause
    assert slow_loader["loader"].busy_seconds >= slept
    for consumer in ("preprocess", "device"):
        stats = slow_loader[consumer]
        assert stats.idle_seconds >= 0.5 * slept, consumer
        assert stats.idle_seconds > stats.blocked_seconds, consumer

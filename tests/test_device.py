"""actors.device: the device actor reports steps in order and sums an evaluation's batches; steps
still in flight on the device are awaited in order, and a device lost at a submit or a wait ends
the run fast; the input slots follow trio's ``*_nowait`` convention."""

from __future__ import annotations

import time

import numpy as np
import pytest
import trio
import trio.testing
from conftest import near_ties
from run_checks import assert_same_weights, thread_snapshot, vkflow_threads
from specs import image_spec

from actors.cpu_backend import CpuBackend
from actors.device import DeviceActor, InputSlots
from actors.engine import Engine
from actors.messages import Batch, CheckpointMark, Cursor, unpack
from actors.meter import Meter
from flow.planning import plan
from flow.runner import run
from flow.runtime import ActorError
from flow.testing import FakeDevice


async def test_the_device_actor_reports_in_order_and_sums_evaluations(autojump_clock):
    spec = image_spec()
    device_plan = plan(spec).devices[0]
    engine = Engine(device_plan, FakeDevice())
    engine.initialise("he", 0)
    reference = Engine(device_plan, CpuBackend())
    reference.initialise("he", 0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 1, 6, 6)).astype(np.float32)
    y = rng.integers(0, 4, 40).astype(np.int32)

    inbox_send, inbox = trio.open_memory_channel(engine.slots)
    outbox, reports = trio.open_memory_channel(100)
    actor = DeviceActor(Meter("device", inbox, [outbox]), engine, inline=True)

    def batch(seq, rows, step, split="train", last=False):
        return Batch(seq, 0, seq, np.arange(rows.start, rows.stop), x[rows], y[rows], split=split, step=step,
                     last=last)  # fmt: skip

    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        async with inbox_send:
            await inbox_send.send(batch(0, slice(0, 16), 0))
            await inbox_send.send(batch(1, slice(16, 16), 1))  # every sample skipped as bad: no update
            await inbox_send.send(batch(2, slice(16, 32), 2))
            await inbox_send.send(batch(3, slice(32, 37), 3, "val"))
            await inbox_send.send(batch(4, slice(37, 40), 3, "val", last=True))
            await inbox_send.send(CheckpointMark(Cursor(3, 0, 3)))
    messages = [m async for item in reports for m in unpack(item)]

    first, empty, third, evaluation, snapshot = messages
    assert (first.step, empty.step, third.step) == (0, 1, 2) and empty.rows == 0 and np.isnan(empty.loss)
    assert first.loss == reference.train_step(x[:16], y[:16], 0).loss
    assert third.loss == reference.train_step(x[16:32], y[16:32], 2).loss
    expected = reference.evaluate(x[32:40], y[32:40])  # one batch of 8 where the actor ran 5 and 3
    assert evaluation.samples == 8
    assert abs(evaluation.accuracy * 8 - expected.correct) <= near_ties(reference.predict(x[32:40])) + 1e-9
    assert evaluation.loss == pytest.approx(expected.loss, rel=1e-6)
    assert snapshot.cursor == Cursor(3, 0, 3)
    assert snapshot.state["params:all"].tobytes() == reference.state()["params:all"].tobytes()


class LateTickets(CpuBackend):
    """The CPU backend, but a ticket reads as done only ``delay`` seconds after its submit, like a
    GPU still busy: the device actor has to poll for it or wait for it in a thread, and a batch that
    finds every slot busy is submitted by the completer when one frees up.

    Args:
        delay: seconds from a submit until its ticket is done.
        fail_wait: the ticket whose wait fails, as a lost device would.
        fail_submit: the submission (1-based) that fails.
    """

    def __init__(self, delay: float = 0.002, fail_wait: int | None = None, fail_submit: int | None = None):
        super().__init__()
        self.delay = delay
        self.fail_wait = fail_wait
        self.fail_submit = fail_submit
        self.ready: dict[int, float] = {}
        self.busy_at_submit: list[int] = []  # steps still running when each submit came

    def submit(self, handle: int) -> int:
        if len(self.ready) + 1 == self.fail_submit:
            raise RuntimeError("device lost at submit")
        now = time.monotonic()
        self.busy_at_submit.append(sum(now < ready for ready in self.ready.values()))
        ticket = super().submit(handle)
        self.ready[ticket] = now + self.delay
        return ticket

    def is_done(self, ticket: int) -> bool:
        return time.monotonic() >= self.ready[ticket]

    def wait(self, ticket: int, timeout_s: float | None = None) -> None:
        if ticket == self.fail_wait:
            raise RuntimeError("device lost while waiting")
        time.sleep(max(0.0, self.ready[ticket] - time.monotonic()))


def test_steps_still_in_flight_on_the_device_are_awaited_in_order():
    existing = thread_snapshot()
    reference = run(image_spec(epochs=1), backend=CpuBackend())
    late = LateTickets()
    result = run(image_spec(epochs=1), backend=late)
    assert result.steps == reference.steps and result.loss == reference.loss
    assert result.accuracy == reference.accuracy
    assert_same_weights(result.parameters, reference.parameters)
    assert max(late.busy_at_submit) == 1  # K = 2: one step runs while the next is submitted
    for broken, message in ((LateTickets(60.0, fail_wait=1), "device lost while waiting"),
                            (LateTickets(0.05, fail_submit=3), "device lost at submit")):  # fmt: skip
        started = time.monotonic()
        with pytest.raises(ActorError, match=f"actor 'device' failed: RuntimeError: {message}"):
            run(image_spec(epochs=1), backend=broken)
        assert time.monotonic() - started < 1.0
    assert vkflow_threads(existing) == []


class BurstyTickets(CpuBackend):
    """A device whose steps finish in bursts (every ``quantum`` seconds, all that are due), as a
    GPU looks to a host that fell behind it: several slots come free at once."""

    def __init__(self, quantum: float = 0.01):
        super().__init__()
        self.quantum = quantum
        self.ready: dict[int, float] = {}
        self.groups: list[int] = []  # the size of each submission

    def submit(self, handle: int) -> int:
        ticket = super().submit(handle)
        self.ready[ticket] = (time.monotonic() // self.quantum + 1) * self.quantum
        return ticket

    def submit_group(self, handles: tuple[int, ...]) -> list[int]:
        self.groups.append(len(handles))
        return [self.submit(handle) for handle in handles]

    def is_done(self, ticket: int) -> bool:
        return time.monotonic() >= self.ready[ticket]

    def wait(self, ticket: int, timeout_s: float | None = None) -> None:
        time.sleep(max(0.0, self.ready[ticket] - time.monotonic()))


@pytest.mark.parametrize("in_flight", [2, 4])
def test_steps_that_pile_up_go_to_the_device_in_one_submission_and_train_the_same(in_flight):
    spec = image_spec(epochs=2, in_flight=in_flight)
    reference = run(spec, backend=CpuBackend())
    bursty = BurstyTickets()
    result = run(spec, backend=bursty)
    assert max(bursty.groups) == in_flight  # all the slots a burst freed, refilled by one submission
    assert sum(bursty.groups) == result.steps + len(result.evals) * 3  # every batch went exactly once
    assert result.steps == reference.steps and result.loss == reference.loss
    assert result.accuracy == reference.accuracy
    assert_same_weights(result.parameters, reference.parameters)


async def test_input_slots_follow_trios_nowait_convention():
    slots = InputSlots(2)
    assert [slots.take_nowait(), slots.take_nowait()] == [0, 1]
    # Raises as trio's *_nowait do: a None that a caller forgot to check would become a slot index.
    with pytest.raises(trio.WouldBlock):
        slots.take_nowait()
    async with trio.open_nursery() as nursery:
        taken = []

        async def take() -> None:
            taken.append(await slots.take())

        nursery.start_soon(take)
        await trio.testing.wait_all_tasks_blocked()
        assert taken == []  # waits while every slot is held
        slots.give(1)
    assert taken == [1]
    slots.give(0)
    assert slots.take_nowait() == 0

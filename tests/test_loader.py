"""actors.loader: the schedule half, the whole run's data order as a pure stream (evaluations and
checkpoints after the right steps; a resumed stream is the tail of the uninterrupted one), and the
actor (cheap reads inline, costly ones in threads; a batch with no sample left gives its input
slot back)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import trio
from fake_sources import CostlySource

from actors.device import InputSlots
from actors.loader import Loader, Read, after_step, jobs, next_cursor
from actors.messages import CheckpointMark, Cursor, unpack
from actors.meter import Meter
from flow.data_plan import StepSchedule, total_steps
from loaders import Sampler


def test_the_schedule_decides_evals_and_checkpoints():
    schedule = StepSchedule(
        batches_per_epoch=4, total_steps=10, eval_every=None, checkpoint_every=3, has_val=True
    )
    assert total_steps(3, None, 4) == 12 and total_steps(3, 10, 4) == 10 and total_steps(None, 7, 4) == 7
    assert next_cursor(Cursor(4, 0, 4), schedule) == Cursor(4, 1, 0)
    assert next_cursor(Cursor(10, 2, 2), schedule) is None
    assert after_step(Cursor(3, 0, 3), schedule) == ("checkpoint",)
    assert after_step(Cursor(4, 0, 4), schedule) == ("eval",)
    assert after_step(Cursor(10, 2, 2), schedule) == ("eval", "final")
    every = dataclasses.replace(schedule, eval_every=5, checkpoint_every=None)
    assert after_step(Cursor(4, 0, 4), every) == () and after_step(Cursor(5, 1, 1), every) == ("eval",)


def test_a_resumed_stream_is_the_tail_of_the_uninterrupted_one():
    train = Sampler(np.arange(37), batch_size=8, shuffle=True, seed=1, drop_last=False)
    val = Sampler(np.arange(37, 47), batch_size=8, shuffle=False, seed=1, drop_last=False)
    schedule = StepSchedule(train.batches_per_epoch(), 13, None, 4, True)

    def key(job):
        if isinstance(job, CheckpointMark):
            return ("mark", job.cursor, job.final)
        return (job.split, job.step, job.epoch, job.position, tuple(job.indices.tolist()))

    full = [key(j) for j in jobs(Cursor(), schedule, train, val)]
    assert sum(k[0] == "train" for k in full) == 13 and full[-1] == ("mark", Cursor(13, 2, 3), True)
    marks = [k[1] for k in full if k[0] == "mark"]
    assert marks[:3] == [Cursor(4, 0, 4), Cursor(8, 1, 3), Cursor(12, 2, 2)]
    for cursor in marks:
        tail = [key(j) for j in jobs(cursor, schedule, train, val)]
        cut = full.index(("mark", cursor, cursor.step == 13)) + 1
        assert tail == full[cut:] or cursor.step == 13


@pytest.mark.parametrize("cost", [0.0, 0.003])
async def test_the_loader_reads_cheap_batches_inline_and_costly_ones_in_threads(cost):
    source = CostlySource(cost)
    stream = (Read(seq, "train", seq, 0, seq, np.arange(4)) for seq in range(100))
    send, receive = trio.open_memory_channel(100)
    await Loader(Meter("loader", None, [send]), source, stream, workers=3).run()
    seqs = [batch.seq async for item in receive for batch in unpack(item)]
    assert seqs == list(range(100))  # in order either way
    assert source.on_loop[0] is False  # not measured yet: a thread
    assert all(source.on_loop[-20:]) if cost == 0.0 else not any(source.on_loop)


class Skipping:
    """A source whose read of the second batch keeps no sample (every one of them bad)."""

    sample_shape = (2,)

    def __init__(self) -> None:
        self.reads = 0

    def read_into(self, indices, x, y):
        self.reads += 1
        if self.reads == 2:
            return 0, len(indices)
        x[: len(indices)] = np.asarray(indices, np.float32)[:, None]
        y[: len(indices)] = 1
        return len(indices), 0


async def test_a_batch_with_no_sample_left_gives_its_slot_back():
    views = [(np.zeros((4, 2), np.float32), np.zeros(4, np.int32)) for _ in range(2)]
    slots = InputSlots(2, views)
    stream = (Read(seq, "train", seq, 0, seq, np.arange(seq, seq + 3)) for seq in range(3))
    send, receive = trio.open_memory_channel(10)
    await Loader(Meter("loader", None, [send]), Skipping(), stream, inline=True, slots=slots).run()
    first, empty, third = [batch async for item in receive for batch in unpack(item)]
    assert (first.slot, empty.slot, third.slot) == (0, -1, 1)
    assert empty.rows == 0 and first.rows == third.rows == 3
    assert third.x[:, 0].tolist() == [2.0, 3.0, 4.0] and np.shares_memory(third.x, views[1][0])
    # The empty batch's slot came back at once and the third batch took it; the other two slots are
    # held until the device gives them back.
    with pytest.raises(trio.WouldBlock):
        slots.take_nowait()


class Recorded(Sampler):
    """A sampler that notes which epochs were prepared ahead, and from which thread."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prepared: list[tuple[int, bool]] = []

    def prepare(self, epoch: int) -> None:
        import threading

        self.prepared.append((epoch, threading.current_thread() is threading.main_thread()))
        super().prepare(epoch)


async def test_the_loader_shuffles_the_next_epoch_in_a_thread_and_the_stream_is_unchanged():
    # Shuffled on the event loop, each epoch's order stalled the loop at the epoch's start; prepared
    # in a worker thread an epoch ahead, it must give exactly the batches computed in place.
    train = Recorded(np.arange(203), batch_size=16, shuffle=True, seed=7, drop_last=True)
    plain = Sampler(np.arange(203), batch_size=16, shuffle=True, seed=7, drop_last=True)
    schedule = StepSchedule(train.batches_per_epoch(), 4 * train.batches_per_epoch(), None, None, False)
    send, receive = trio.open_memory_channel(1000)
    stream = jobs(Cursor(), schedule, train, None)
    loader = Loader(
        Meter("loader", None, [send]), CostlySource(0.0, in_memory=True), stream, prepare_epoch=train.prepare
    )
    await loader.run()
    got = [
        tuple(b.indices.tolist())
        async for item in receive
        for b in unpack(item)
        if not isinstance(b, CheckpointMark)
    ]
    want = [tuple(j.indices.tolist()) for j in jobs(Cursor(), schedule, plain, None) if isinstance(j, Read)]
    assert got == want and len(set(got)) == len(got)
    # Each epoch after the first prepared once, off the loop (the threads may finish in any order).
    assert sorted(epoch for epoch, _ in train.prepared) == [1, 2, 3, 4]
    assert not any(on_loop for _, on_loop in train.prepared)
    assert np.array_equal(train.shard(4), plain.shard(4))  # the last one, prepared and never used

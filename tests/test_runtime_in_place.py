"""Batches read straight into the device's input slots, and the other fast paths of a step.

Where the backend maps its input slots (the Vulkan backend's host-visible memory) and nothing
transforms a batch, the loader takes a free slot for each batch and the source reads the batch
into it (``read_into``); the device then only submits. These tests check that such a run trains
exactly as one that copies every batch in, that a slot is never refilled before the step that used
it has run, that exact resume still holds, and when the runner chooses to fill in place.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

import numpy as np
import pytest
import trio
import trio.testing

from actors import checkpoint as checkpoints
from actors.cpu_backend import CpuBackend
from actors.device import InputSlots
from actors.loader import Loader, Read
from actors.messages import Batch, StepDone
from actors.meter import Hooks, Meter
from flow import pipeline_plan
from flow.pipeline_plan import plan_pipeline
from flow.runner import run
from flow.spec import (
    MSE,
    Adam,
    CrossEntropy,
    Data,
    Devices,
    Edge,
    Linear,
    Model,
    Node,
    Normalize,
    Pipeline,
    RunSettings,
    Spec,
    Split,
    Synthetic,
    default_pipeline,
)
from loaders import SyntheticSource


def synthetic_spec(tmp=None, **run) -> Spec:
    """250 samples in batches of 16 with a validation split: partial batches in both splits."""
    settings = {"epochs": 3, "in_flight": 2, **run}
    if tmp is not None:
        settings.setdefault("checkpoint_dir", str(tmp / "ckpt"))
        settings.setdefault("metrics_file", str(tmp / "metrics.jsonl"))
    return Spec(
        model=Model(input_shape=(6,), layers=(Linear(12, activation="relu"), Linear(3)), loss=CrossEntropy()),
        optimiser=Adam(0.01),
        data=Data(Synthetic(samples=250, features=(6,), classes=3, seed=2), batch_size=16, seed=4,
                  split=Split(train=0.8, val=0.2)),
        devices=Devices("cpu"),
        run=RunSettings(**settings),
    )  # fmt: skip


class Mapped(CpuBackend):
    """The CPU backend with mapped input slots, run like a GPU.

    ``write_into`` returns live views of a tensor, as the Vulkan backend does for host-visible
    memory, so the runner fills batches in place. A submission runs only once its ticket is seen
    done, ``delay`` seconds after it was submitted, in submission order: like a GPU, it reads its
    slot while it runs, so a batch written into a slot before the step that used it had run would
    change the results.

    Args:
        delay: seconds from a submit until its ticket is done.
        kind: the device kind its facts report ("discrete": the completer may poll for it).
    """

    def __init__(self, delay: float = 0.0, kind: str = "discrete") -> None:
        super().__init__()
        self.facts = dataclasses.replace(self.facts, kind=kind)
        self.delay = delay
        self.queue: deque[tuple[int, int, float]] = deque()  # (ticket, handle, ready at)
        self.ready: dict[int, float] = {}
        self.finished = 0

    def write_into(self, tensor: str, slot: int = 0) -> np.ndarray:
        return self.view(tensor, slot).reshape(self._layout.tensor(tensor).shape)

    def submit(self, handle: int) -> int:
        self._ticket += 1
        ready = time.monotonic() + self.delay
        self.queue.append((self._ticket, handle, ready))
        self.ready[self._ticket] = ready
        return self._ticket

    def _run_to(self, ticket: int) -> None:
        while self.queue and self.queue[0][0] <= ticket:
            done, handle, _ = self.queue.popleft()
            self.execute(*self._recorded[handle])
            self.finished = done

    def is_done(self, ticket: int) -> bool:
        if ticket > self.finished and time.monotonic() < self.ready[ticket]:
            return False
        self._run_to(ticket)
        return True

    def wait(self, ticket: int, timeout_s: float | None = None) -> None:
        time.sleep(max(0.0, self.ready.get(ticket, 0.0) - time.monotonic()))
        self._run_to(ticket)


class Seen(Hooks):
    """Records the slot of every batch the device receives, and every step the sink receives."""

    def __init__(self) -> None:
        self.slots: list[int] = []
        self.steps: list[StepDone] = []

    async def received(self, actor, item) -> None:
        if actor == "device" and isinstance(item, Batch):
            self.slots.append(item.slot)
        if actor == "sink" and isinstance(item, StepDone):
            self.steps.append(item)


def assert_same_run(a, b) -> None:
    """Same steps, losses, evaluations and weights, bit for bit (a resumed run ``a`` holds only the
    evaluations of its own process: the last of ``b``'s)."""
    assert a.steps == b.steps and a.loss == b.loss and a.accuracy == b.accuracy
    evals = [(e.step, e.loss, e.accuracy, e.samples) for e in b.evals]
    assert [(e.step, e.loss, e.accuracy, e.samples) for e in a.evals] == evals[len(evals) - len(a.evals) :]
    assert a.parameters.keys() == b.parameters.keys()
    for name in a.parameters:
        assert np.array_equal(a.parameters[name], b.parameters[name]), name


@pytest.mark.parametrize(("in_flight", "delay"), [(1, 0.0), (2, 0.0005), (3, 0.002)])
def test_batches_read_in_place_train_exactly_as_copied_ones(in_flight, delay):
    spec = synthetic_spec(in_flight=in_flight)
    copied, in_place = Seen(), Seen()
    reference = run(spec, backend=CpuBackend(), hooks=[copied])
    result = run(spec, backend=Mapped(delay), hooks=[in_place])
    assert set(copied.slots) == {-1}  # the CPU backend maps nothing: every batch is copied in
    assert set(in_place.slots) == set(range(in_flight))  # every batch arrived in a slot
    assert [s.loss for s in in_place.steps] == [s.loss for s in copied.steps]
    assert_same_run(result, reference)


def test_resume_of_a_run_read_in_place_is_bit_exact(tmp_path):
    reference = run(synthetic_spec(), backend=Mapped(0.0005))
    spec = synthetic_spec(tmp_path, checkpoint_every=7)

    class InterruptAt(Hooks):
        async def received(self, actor, item) -> None:
            if actor == "sink" and isinstance(item, StepDone) and item.step == 17:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(spec, backend=Mapped(0.0005), hooks=[InterruptAt()])
    saved = checkpoints.load(tmp_path / "ckpt")
    assert saved.interrupted and 18 <= saved.cursor.step < reference.steps
    resumed = run(spec, resume=tmp_path / "ckpt", backend=Mapped(0.0005))
    assert resumed.resumed_from == saved.cursor.step
    assert_same_run(resumed, reference)


def test_the_plan_reads_in_place_only_where_nothing_changes_a_batch():
    spec = synthetic_spec()
    shape = tuple(spec.model.input_shape)

    def in_place(spec=spec, sample_shape=shape, reads=True, maps=True) -> bool:
        return plan_pipeline(spec, sample_shape=sample_shape, reads_in_place=reads, maps_inputs=maps).in_place

    assert in_place()
    assert not in_place(maps=False)  # the device maps nothing
    assert not in_place(reads=False)  # a source without read_into
    predicting = plan_pipeline(
        spec, mode="predict", sample_shape=shape, reads_in_place=True, maps_inputs=True
    )
    assert not predicting.in_place  # the caller feeds arrays
    normalised = dataclasses.replace(
        spec, data=dataclasses.replace(spec.data, preprocess=(Normalize((0.0,), (2.0,)),))
    )
    assert not in_place(normalised)
    assert not in_place(sample_shape=(7,))  # the source's samples are not the inputs
    # A second consumer of the loader's batches (a fan-out) would see slots the device refills.
    pipeline = default_pipeline(spec)
    fan_out = Pipeline(
        nodes=(*pipeline.nodes, Node("tap", "broadcast")),
        edges=(*pipeline.edges, Edge("loader", "tap")),
    )
    assert not in_place(dataclasses.replace(spec, pipeline=fan_out))
    # MSE with several outputs: a row's targets are more than one element of the slot's labels.
    regression = dataclasses.replace(
        spec, model=dataclasses.replace(spec.model, layers=(*spec.model.layers[:-1], Linear(2)), loss=MSE())
    )
    assert not in_place(regression)


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
    first, empty, third = [batch async for batch in receive]
    assert (first.slot, empty.slot, third.slot) == (0, -1, 1)
    assert empty.rows == 0 and first.rows == third.rows == 3
    assert third.x[:, 0].tolist() == [2.0, 3.0, 4.0] and np.shares_memory(third.x, views[1][0])
    # The empty batch's slot came back at once and the third batch took it; the other two slots are
    # held until the device gives them back.
    with pytest.raises(trio.WouldBlock):
        slots.take_nowait()


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


def test_a_synthetic_read_into_gives_what_read_gives(rng):
    for task in ("classification", "regression"):
        for cache in (None, 0):
            kwargs = {} if cache is None else {"cache_bytes": cache}
            source = SyntheticSource(task, 300, (2, 3), classes=4, seed=7, **kwargs)
            indices = rng.integers(0, 300, 20)
            x, y, _ = source.read(indices)
            into_x = np.full((32, 2, 3), np.nan, np.float32)
            into_y = np.zeros(32, y.dtype)
            assert source.read_into(indices, into_x, into_y) == (20, 0)
            assert into_x[:20].tobytes() == x.tobytes() and into_y[:20].tobytes() == y.tobytes()
            assert np.isnan(into_x[20:]).all()
            with pytest.raises(IndexError):
                source.read_into([300], into_x, into_y)
            with pytest.raises(ValueError):
                source.read_into(np.arange(40), into_x, into_y)


def test_a_synthetic_run_on_vulkan_reads_in_place_and_matches_the_copied_run(vulkan_backend, monkeypatch):
    spec = synthetic_spec(epochs=2)
    in_place, copied = Seen(), Seen()
    result = run(spec, backend=vulkan_backend, hooks=[in_place])
    monkeypatch.setattr(pipeline_plan, "_reads_in_place", lambda *args: False)
    reference = run(spec, backend=vulkan_backend, hooks=[copied])
    assert set(in_place.slots) == {0, 1} and set(copied.slots) == {-1}
    assert_same_run(result, reference)  # the same bits on the same device, however they got there
    on_cpu = run(spec, backend=CpuBackend())
    np.testing.assert_allclose(
        [s.loss for s in in_place.steps], [s.loss for s in copied.steps], rtol=0, atol=0
    )
    assert abs(result.loss - on_cpu.loss) <= 1e-4 * max(1.0, abs(on_cpu.loss))

"""flow.runtime, the resources, actors and channels of one pipeline: the device it selects, opens,
and closes after a failure; data that does not fit the model refused before any device work; the
bounded channels (a slow sink blocks the loader, and memory stays bounded).

And batches read straight into the device's input slots: where the backend maps its input slots
(the Vulkan backend's host-visible memory) and nothing transforms a batch, the loader takes a free
slot for each batch and the source reads the batch into it (``read_into``); the device then only
submits. Such a run trains exactly as one that copies every batch in, a slot is never refilled
before the step that used it has run, and exact resume still holds."""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections import deque

import numpy as np
import pytest
import trio
from run_checks import thread_snapshot, vkflow_threads
from specs import digits_spec, image_spec, synthetic_spec

from actors import checkpoint as checkpoints
from actors.cpu_backend import CpuBackend
from actors.messages import Batch, StepDone
from actors.meter import IDLE, MAX_CHUNK, Hooks, Meter, _Timed
from flow import pipeline_plan
from flow.runner import open_pipeline, run
from flow.runtime import ActorError
from flow.spec import (
    CrossEntropy,
    Devices,
    Edge,
    Flatten,
    Linear,
    Model,
    Node,
    Pipeline,
    Split,
)
from flow.testing import ChannelProbe, FailAt, FakeDevice, Slow

runtime = importlib.import_module("flow.runtime")


def test_device_selection(caplog, monkeypatch):
    assert isinstance(runtime.open_backend(Devices("cpu")), CpuBackend)
    with pytest.raises(LookupError):
        runtime.open_backend(Devices("no such device"))
    with pytest.raises(LookupError):
        runtime.selected_facts(Devices("no such device"))  # refused before any device is opened
    # "auto" without Vulkan: the CPU, and one clear warning line.
    monkeypatch.delenv("VKFLOW_AUTO_DEVICE", raising=False)
    monkeypatch.setattr(runtime.device_select, "list_devices", lambda: ([], "no Vulkan: x\ny"))
    assert runtime.selected_facts(Devices("auto")).is_numpy
    assert isinstance(runtime.open_backend(Devices("auto")), CpuBackend)
    warned = "vkflow: auto: the CPU (numpy) backend: no Vulkan: x"
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [warned] * 2


def test_the_backend_the_runner_opens_is_closed_after_a_failure(monkeypatch):
    existing = thread_snapshot()
    opened = []

    class Tracked(CpuBackend):
        closed = False

        def close(self) -> None:
            self.closed = True
            super().close()

    def open_tracked(facts, memory_fraction):
        opened.append(Tracked(facts=facts))
        return opened[-1]

    monkeypatch.setattr(runtime.device_select, "open_device", open_tracked)
    with pytest.raises(ActorError):
        run(image_spec(), hooks=[FailAt("sink", 3)])
    assert len(opened) == 1 and opened[0].closed
    assert vkflow_threads(existing) == []


def test_data_that_does_not_fit_the_model_is_refused_before_any_device_work(monkeypatch):
    from flow.errors import SpecError

    existing = thread_snapshot()
    opened = []
    # Where the runtime opens a device: never reached for data the plan refuses.
    monkeypatch.setattr(
        runtime.device_select, "open_device", lambda facts, fraction: opened.append(facts) or CpuBackend()
    )
    spec = digits_spec(epochs=1, checkpoint_dir=None, metrics_file=None)
    wrong = dataclasses.replace(
        spec,
        model=Model(input_shape=(1, 10, 10), layers=(Flatten(), Linear(16), Linear(7)), loss=CrossEntropy()),
    )
    with pytest.raises(SpecError) as caught:
        run(wrong)
    message = str(caught.value)
    assert "model.input_shape" in message and "(1, 8, 8)" in message and "(1, 10, 10)" in message
    assert "10 classes" in message and "7 outputs" in message
    assert opened == []  # no device was opened
    assert vkflow_threads(existing) == []


class Bound(Hooks):
    """Checks, every time the sink takes an item, how far the loader has run ahead of it."""

    def __init__(self) -> None:
        self.pipeline = None
        self.ahead: list[int] = []

    async def received(self, actor, item) -> None:
        if actor == "sink" and self.pipeline is not None:
            stats = self.pipeline.statistics()
            self.ahead.append(stats["loader"].items_out - stats["sink"].items_in)


async def test_a_slow_sink_blocks_the_loader_and_memory_stays_bounded(autojump_clock):
    caps = {("loader", "preprocess"): 3, ("preprocess", "device"): 2, ("device", "sink"): 2,
            ("device", "optimiser"): 6}  # fmt: skip
    pipeline = Pipeline(
        nodes=tuple(Node(n, n) for n in ("loader", "preprocess", "device", "optimiser", "sink")),
        edges=tuple(Edge(src, dst, capacity=c) for (src, dst), c in caps.items()),
    )
    # No validation split: then every batch the loader sends comes back to the sink as one message.
    # Enough steps that the loader's channel fills even where it sends chunks of MAX_CHUNK batches
    # (on FakeDevice the loop is the slower side, so the loader holds batches to chunk them).
    plain = image_spec(epochs=8)
    spec = dataclasses.replace(plain, pipeline=pipeline, data=dataclasses.replace(plain.data, split=Split()))
    probe, bound = ChannelProbe(), Bound()
    start = trio.current_time()
    async with open_pipeline(spec, backend=FakeDevice(), hooks=[probe, bound, Slow("sink", 1.0)]) as p:
        bound.pipeline = p
    stats = p.result.statistics

    assert probe.capacity == caps
    assert all(probe.peak[edge] <= caps[edge] for edge in caps)
    assert probe.peak[("loader", "preprocess")] == 3 and probe.blocked[("loader", "preprocess")]
    # Items between the loader and the sink: the channels on the way (capacities count chunks of
    # at most MAX_CHUNK batches), a chunk being taken and one being staged inside each of the
    # three actors, and the device's slots. Never more, however long the run.
    path = caps[("loader", "preprocess")] + caps[("preprocess", "device")] + caps[("device", "sink")]
    assert max(bound.ahead) <= (path + 2 * 3) * MAX_CHUNK + 2
    # The end drains everything: each item the loader sent, and the InputStatistics the preprocess
    # node sends ahead of the first training batch.
    assert stats["sink"].items_in == stats["loader"].items_out + 1
    # The sink's pace set the run's: one virtual second per item it took.
    assert trio.current_time() - start >= stats["sink"].items_in * 1.0


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


@pytest.mark.parametrize("in_flight, delay", [(1, 0.0), (2, 0.0005), (3, 0.002)])
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


def test_busy_idle_and_blocked_add_up_to_the_actors_time():
    """Where an actor's tasks overlap, busy wins over blocked and blocked over idle; time in no
    state (the actor's own code) is busy; the clock stops when the actor ends."""
    now = [0.0]
    meter = Meter("device", clock=lambda: now[0])
    waiting_for_input = _Timed(meter, IDLE)  # what Meter does while its inbox is empty
    gpu = meter.busy()
    gpu.__enter__()  # t=0..3: the completer waits for the GPU...
    now[0] = 1.0
    with meter.blocked(), waiting_for_input:  # ...while the feeder waits (t=1..2): still busy
        now[0] = 2.0
    now[0] = 3.0
    gpu.__exit__()
    with meter.blocked():  # t=3..5: waiting for space downstream
        now[0] = 5.0
    with waiting_for_input:  # t=5..6: waiting for input alone
        now[0] = 6.0
    now[0] = 6.5  # the actor's own code: busy
    meter.close()
    now[0] = 9.0  # after its end: counts nowhere
    stats = meter.statistics()
    assert (stats.busy_seconds, stats.blocked_seconds, stats.idle_seconds) == (3.5, 2.0, 1.0)


def test_a_runs_actors_account_for_their_time_once(tmp_path):
    started = time.perf_counter()
    result = run(synthetic_spec(tmp_path, epochs=2), backend=CpuBackend())
    wall = time.perf_counter() - started
    for name, stats in result.statistics.items():
        total = stats.busy_seconds + stats.idle_seconds + stats.blocked_seconds
        assert 0 < total <= wall, name  # the device's two tasks are no longer counted twice

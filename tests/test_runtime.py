"""The actor runtime end to end: training to a target, backend agreement, failure handling,
backpressure, exact resume (in process, and after SIGKILL / SIGINT of a subprocess), inference, the
schedule and the progress line; and the fast paths that keep the runtime's per-step cost small
(inline cheap work, polled device completions, the synthetic cache, sparse statistics lines)."""

from __future__ import annotations

import dataclasses
import importlib
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import trio
from conftest import near_ties

from actors import checkpoint as checkpoints
from actors.cpu_backend import CpuBackend, cpu_facts
from actors.device import DeviceActor
from actors.engine import Engine
from actors.inline import MAX_PROBE_GAP, InlineOrThread, InlinePolicy
from actors.loader import Loader, Read, after_step, jobs, next_cursor
from actors.messages import Batch, CheckpointMark, Cursor, StepDone
from actors.meter import Hooks, Meter
from actors.progress import Progress, ProgressState, Rate, eta_seconds, format_line
from flow.codec import load as load_spec
from flow.codec import save as save_spec
from flow.data_plan import StepSchedule, total_steps
from flow.inference import predict
from flow.planning import plan
from flow.run_command import main_run
from flow.runner import ActorError, open_pipeline, resume_conflicts, run
from flow.spec import (
    Adam,
    CrossEntropy,
    Data,
    Devices,
    Edge,
    Flatten,
    HorizontalFlip,
    Linear,
    Model,
    Node,
    Normalize,
    Pipeline,
    RandomCrop,
    RunSettings,
    Spec,
    Split,
    Synthetic,
)
from flow.testing import ChannelProbe, FailAt, FakeDevice, Slow
from loaders import Sampler, SyntheticSource

runner = importlib.import_module("flow.runner")
ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits.json"


def image_spec(tmp: Path | None = None, **run) -> Spec:
    """A tiny image classifier with augmentation (random crops and flips draw from the batch rng),
    so exact resume covers the random streams too."""
    settings = {"epochs": 3, "in_flight": 2, **run}
    if tmp is not None:
        settings.setdefault("checkpoint_dir", str(tmp / "ckpt"))
        settings.setdefault("metrics_file", str(tmp / "metrics.jsonl"))
    return Spec(
        model=Model(input_shape=(1, 6, 6), layers=(Flatten(), Linear(16, activation="relu"), Linear(4)),
                    loss=CrossEntropy()),
        optimiser=Adam(0.01),
        data=Data(Synthetic(samples=200, features=(1, 6, 6), classes=4, seed=3), batch_size=16, seed=5,
                  split=Split(train=0.8, val=0.2), preprocess=(Normalize((0.0,), (2.0,)),),
                  augment=(RandomCrop((6, 6), padding=1), HorizontalFlip(0.5))),
        devices=Devices("cpu"),
        run=RunSettings(**settings),
    )  # fmt: skip


def digits_spec(**run) -> Spec:
    spec = load_spec(DIGITS)
    # The example writes to runs/digits under the working directory: a test writes only where it says.
    run = {"checkpoint_dir": None, "metrics_file": None, **run}
    return dataclasses.replace(spec, run=dataclasses.replace(spec.run, **run))


class Recorder(Hooks):
    """Keeps every StepDone the sink receives."""

    def __init__(self) -> None:
        self.steps: list[StepDone] = []

    async def received(self, actor, item) -> None:
        if actor == "sink" and isinstance(item, StepDone):
            self.steps.append(item)


class InterruptAt(Hooks):
    """Raises KeyboardInterrupt in the sink when step ``step`` arrives, as Ctrl-C would."""

    def __init__(self, step: int) -> None:
        self.step = step

    async def received(self, actor, item) -> None:
        if actor == "sink" and isinstance(item, StepDone) and item.step == self.step:
            raise KeyboardInterrupt


def vkflow_threads(existing: frozenset[threading.Thread] = frozenset()) -> list[str]:
    """vkflow's worker threads alive now, except those in ``existing`` (a snapshot taken when the
    test began: sources other tests left to the garbage collector are not this run's leak)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("vkflow") and t not in existing]


def thread_snapshot() -> frozenset[threading.Thread]:
    return frozenset(threading.enumerate())


def assert_same_weights(a: dict[str, np.ndarray], b: dict[str, np.ndarray], rtol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if rtol == 0.0:
            assert np.array_equal(a[name], b[name]), name
        else:
            scale = max(float(np.abs(b[name]).max()), 1e-12)
            assert float(np.abs(a[name] - b[name]).max()) / scale <= rtol, name


# -- end to end ------------------------------------------------------------------------------------


def test_digits_reach_the_target_on_vulkan(vulkan_backend, tmp_path):
    spec = digits_spec(
        epochs=6, checkpoint_dir=str(tmp_path / "ckpt"), metrics_file=str(tmp_path / "m.jsonl")
    )
    recorder = Recorder()
    result = run(spec, backend=vulkan_backend, hooks=[recorder])

    losses = [s.loss for s in recorder.steps]
    assert [s.step for s in recorder.steps] == list(range(result.steps))
    assert np.mean(losses[-10:]) < 0.25 * np.mean(losses[:10])  # the loss falls
    assert result.accuracy is not None and result.accuracy >= 0.95
    assert len(result.evals) == 6 and result.evals[-1].samples == 359  # one eval per epoch, whole val split
    assert result.device == vulkan_backend.facts.name

    # The metrics file holds every step with each actor's statistics, and the evaluations.
    lines = [json.loads(line) for line in Path(spec.run.metrics_file).read_text().splitlines()]
    steps = [r for r in lines if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(result.steps))
    assert set(steps[-1]["statistics"]) == {"loader", "preprocess", "device", "optimiser", "sink"}
    assert steps[-1]["lr"] == pytest.approx(0.003) and steps[-1]["samples_per_second"] > 0
    assert [r["accuracy"] for r in lines if r["event"] == "eval"][-1] == pytest.approx(result.accuracy)

    # The final checkpoint holds the final weights, and predicting from it reproduces the accuracy.
    saved = checkpoints.load(tmp_path / "ckpt")
    assert saved.final and saved.cursor.step == result.steps and str(result.checkpoint).endswith(".ckpt")
    flat, device_plan = saved.state["params:all"], plan(spec).devices[0]
    assert result.parameters.keys() == {p.name for p in device_plan.parameters}
    for name, value in result.parameters.items():  # each parameter at its own offset in the arena
        start = device_plan.layout.tensor(name).offset // 4
        assert np.array_equal(flat[start : start + value.size], value.reshape(-1)), name
    from loaders import open_source, split_indices

    source = open_source(spec.data.source)
    parts = split_indices(len(source), source.labels, 0.8, 0.2, 0.0, spec.data.seed, True)
    x, y, _ = source.read(parts["val"])
    source.close()
    probabilities = predict(tmp_path / "ckpt", x, backend=vulkan_backend)
    assert probabilities.shape == (len(y), 10)
    # The eval and predict programs are two computations: only a row whose two best classes are
    # within rounding of each other may go either way.
    correct = int(np.sum(probabilities.argmax(axis=1) == y))
    assert abs(correct - result.accuracy * len(y)) <= near_ties(probabilities) + 1e-6


def test_cpu_and_vulkan_give_the_same_loss_curve(vulkan_backend):
    spec = image_spec(epochs=None, steps=20)
    curves = []
    for backend in (CpuBackend(), vulkan_backend):
        recorder = Recorder()
        assert run(spec, backend=backend, hooks=[recorder]).device == backend.facts.name
        curves.append(np.array([s.loss for s in recorder.steps]))
    assert len(curves[0]) == 20
    assert curves[0][-1] < curves[0][0]
    np.testing.assert_allclose(curves[1], curves[0], rtol=1e-4)


# -- failures --------------------------------------------------------------------------------------


class BrokenDevice(CpuBackend):
    """A backend whose 4th submission fails, as a lost device would."""

    def __init__(self) -> None:
        super().__init__()
        self.submits = 0

    def submit(self, handle: int) -> int:
        self.submits += 1
        if self.submits == 4:
            raise RuntimeError("device lost")
        return super().submit(handle)


@pytest.mark.parametrize("actor", ["loader", "preprocess", "device", "optimiser", "sink"])
async def test_a_failing_actor_ends_the_run_fast_with_its_name(actor):
    existing = thread_snapshot()
    injected = FailAt(actor, item=5, error=ValueError(f"boom in {actor}"))
    spec = digits_spec(epochs=20)  # far longer than the failure point; its image folder decodes in threads
    with trio.fail_after(10):
        with pytest.raises(ActorError) as caught:
            async with open_pipeline(spec, backend=CpuBackend(), hooks=[injected]):
                pass
    stopped = time.monotonic()
    error = caught.value
    assert error.actor == actor and f"actor '{actor}' failed" in str(error)
    assert error.__cause__ is injected.error
    assert stopped - injected.raised_at < 1.0
    assert vkflow_threads(existing) == []


async def test_a_real_failure_names_its_actor():
    with pytest.raises(ActorError, match="actor 'device' failed: RuntimeError: device lost") as caught:
        async with open_pipeline(image_spec(), backend=BrokenDevice()):
            pass
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_bad_transform_fails_in_preprocess():
    cropped = dataclasses.replace(image_spec().data, augment=(RandomCrop((4, 4)),))
    bad_shape = dataclasses.replace(image_spec(), data=cropped)
    with pytest.raises(ActorError, match="actor 'preprocess' failed: ValueError: .*shape"):
        run(bad_shape, backend=FakeDevice())


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

    monkeypatch.setattr(runner.device_select, "open_device", open_tracked)
    with pytest.raises(ActorError):
        run(image_spec(), hooks=[FailAt("sink", 3)])
    assert len(opened) == 1 and opened[0].closed
    assert vkflow_threads(existing) == []


# -- backpressure ----------------------------------------------------------------------------------


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
    plain = image_spec(epochs=2)
    spec = dataclasses.replace(plain, pipeline=pipeline, data=dataclasses.replace(plain.data, split=Split()))
    probe, bound = ChannelProbe(), Bound()
    start = trio.current_time()
    async with open_pipeline(spec, backend=FakeDevice(), hooks=[probe, bound, Slow("sink", 1.0)]) as p:
        bound.pipeline = p
    stats = p.result.statistics

    assert probe.capacity == caps
    assert all(probe.peak[edge] <= caps[edge] for edge in caps)
    assert probe.peak[("loader", "preprocess")] == 3 and probe.blocked[("loader", "preprocess")]
    # Items between the loader and the sink: the channels on the way, one item inside each actor,
    # and the device's slots. Never more, however long the run.
    path = caps[("loader", "preprocess")] + caps[("preprocess", "device")] + caps[("device", "sink")]
    assert max(bound.ahead) <= path + 3 + 2
    # The end drains everything: each item the loader sent, and the InputStatistics the preprocess
    # node sends ahead of the first training batch.
    assert stats["sink"].items_in == stats["loader"].items_out + 1
    # The sink's pace set the run's: one virtual second per item it took.
    assert trio.current_time() - start >= stats["sink"].items_in * 1.0


# -- the schedule ----------------------------------------------------------------------------------


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


# -- exact resume ----------------------------------------------------------------------------------


def test_resume_after_an_interrupt_at_a_random_step_is_bit_exact(tmp_path, rng):
    reference = run(image_spec(tmp_path / "a"))
    assert reference.steps == 30
    stop = int(rng.integers(1, reference.steps - 2))
    spec = image_spec(tmp_path / "b", checkpoint_every=7)
    with pytest.raises(KeyboardInterrupt):
        run(spec, hooks=[InterruptAt(stop)])
    saved = checkpoints.load(tmp_path / "b" / "ckpt")
    assert saved.interrupted and not saved.final
    assert stop + 1 <= saved.cursor.step <= stop + 12  # steps applied but not yet reported are kept

    resumed = run(spec, resume=tmp_path / "b" / "ckpt")
    assert resumed.resumed_from == saved.cursor.step and resumed.steps == reference.steps
    assert_same_weights(resumed.parameters, reference.parameters)
    assert resumed.accuracy == reference.accuracy
    # The metrics file continues. Steps applied after the last one reported are not in it: the
    # interruption stopped the sink before their reports arrived.
    steps = {json.loads(line)["step"] for line in Path(spec.run.metrics_file).read_text().splitlines()}
    assert set(range(stop)) | set(range(saved.cursor.step, reference.steps)) <= steps


def test_resume_on_vulkan_matches_within_float_tolerance(tmp_path, vulkan_backend):
    reference = run(image_spec(epochs=2), backend=vulkan_backend)
    spec = image_spec(tmp_path, epochs=2, checkpoint_every=5)
    with pytest.raises(KeyboardInterrupt):
        run(spec, backend=vulkan_backend, hooks=[InterruptAt(11)])
    resumed = run(spec, resume=spec.run.checkpoint_dir, backend=vulkan_backend)
    assert resumed.resumed_from >= 12
    assert_same_weights(resumed.parameters, reference.parameters, rtol=1e-6)


def test_resume_refuses_a_different_model(tmp_path):
    spec = image_spec(tmp_path, epochs=1)
    run(spec)
    other = dataclasses.replace(spec, optimiser=Adam(0.5))
    assert resume_conflicts(other, spec) == ["optimiser"]
    with pytest.raises(ValueError, match="optimiser differ"):
        run(other, resume=spec.run.checkpoint_dir)
    # Run settings may change: more epochs continue the finished run.
    longer = dataclasses.replace(spec, run=dataclasses.replace(spec.run, epochs=2))
    assert run(longer, resume=spec.run.checkpoint_dir).steps == 20


SCRIPT = textwrap.dedent(
    """
    import sys
    from flow.runner import run
    from flow.testing import Slow
    try:
        run(sys.argv[1], resume=sys.argv[2] if len(sys.argv) > 2 else None, hooks=[Slow("sink", 0.01)])
    except KeyboardInterrupt:
        sys.exit(130)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_resume_after_the_process_is_killed_is_bit_exact(tmp_path, sig, rng):
    spec = image_spec(tmp_path, epochs=10, checkpoint_every=5)
    save_spec(spec, tmp_path / "spec.json")
    # Keep the caller's path too: packages may be installed off sys.path's defaults (PYTHONPATH).
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    child = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "spec.json")], cwd=ROOT, env=env,
                             stderr=subprocess.PIPE)  # fmt: skip
    wanted = int(rng.integers(2, 8)) * 5
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        newest = checkpoints.latest(tmp_path / "ckpt")
        if newest is not None and int(newest.stem.split("-")[1]) >= wanted:
            break
        assert child.poll() is None, child.stderr.read().decode()
        time.sleep(0.005)
    child.send_signal(sig)
    code = child.wait(timeout=20)
    assert code == (-9 if sig == signal.SIGKILL else 130), child.stderr.read().decode()
    saved = checkpoints.load(tmp_path / "ckpt")
    assert not saved.final and saved.cursor.step < 100
    if sig == signal.SIGINT:
        assert saved.interrupted  # the interrupt wrote one more checkpoint on its way out

    resumed = run(spec, resume=tmp_path / "ckpt")
    reference = run(image_spec(epochs=10))
    assert resumed.resumed_from == saved.cursor.step and resumed.steps == reference.steps == 100
    assert_same_weights(resumed.parameters, reference.parameters)


def test_the_command_line_runs_and_resumes(tmp_path, capsys):
    spec = image_spec(tmp_path, epochs=2)
    save_spec(spec, tmp_path / "spec.json")
    assert main_run([str(tmp_path / "spec.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("accuracy: 0.") and len(out[-1]) == len("accuracy: 0.0000")
    assert "steps: 20 (epochs 2)" in out
    assert main_run([str(tmp_path / "spec.json"), "--resume", str(tmp_path / "ckpt")]) == 0
    assert "steps: 20 (epochs 2)" in capsys.readouterr().out
    assert main_run([str(tmp_path / "missing.json")]) == 1


# -- inference -------------------------------------------------------------------------------------


async def test_streaming_inference_through_the_pipeline(tmp_path):
    spec = image_spec(tmp_path, epochs=1)
    trained = await trio.to_thread.run_sync(run, spec)  # run() starts its own trio loop
    x = np.random.default_rng(0).standard_normal((37, 1, 6, 6)).astype(np.float32)

    expected = predict(trained.checkpoint, x)
    assert expected.shape == (37, 4) and np.allclose(expected.sum(axis=1), 1.0, atol=1e-5)
    streamed = list(predict(trained.checkpoint, x, stream=True))
    assert [len(s) for s in streamed] == [16, 16, 5]
    assert np.array_equal(np.concatenate(streamed), expected)
    fresh = predict(spec, x)  # untrained weights give other answers
    assert not np.allclose(fresh, expected)

    async with open_pipeline(resume=trained.checkpoint, mode="predict", backend=CpuBackend()) as p:
        first = await p.predict(x)
        async with trio.open_nursery() as nursery:

            async def feed_all() -> None:
                for rows in (x[:3], x[3:30], x[30:]):
                    await p.feed(rows)
                await p.end_input()

            nursery.start_soon(feed_all)
            outputs = [out async for out in p.results()]
    assert np.array_equal(first, expected)  # the same batches of 16, 16 and 5 rows: the same bits
    assert [len(o) for o in outputs] == [3, 27, 7]
    # Other batch splits (3, 16, 11 and 7 rows): nothing promises the same summation order for
    # them (a BLAS blocks each shape its own way), so they agree within float32 rounding.
    np.testing.assert_allclose(np.concatenate(outputs), expected, rtol=1e-5, atol=1e-6)


def test_predict_from_a_source_spec(tmp_path):
    spec = image_spec(tmp_path, epochs=1)
    trained = run(spec)
    everything = predict(trained.checkpoint, spec.data.source)
    assert everything.shape == (200, 4)
    from loaders import open_source

    source = open_source(spec.data.source)
    x, _, _ = source.read(np.arange(200))
    assert np.array_equal(everything, predict(trained.checkpoint, x))


# -- devices and progress --------------------------------------------------------------------------


def test_device_selection(caplog, monkeypatch):
    assert isinstance(runner.open_backend(Devices("cpu")), CpuBackend)
    with pytest.raises(LookupError):
        runner.open_backend(Devices("no such device"))
    with pytest.raises(LookupError):
        runner.selected_facts(Devices("no such device"))  # refused before any device is opened
    # "auto" without Vulkan: the CPU, and one clear warning line.
    monkeypatch.setattr(runner.device_select, "select_facts", lambda *a: (cpu_facts(), "no Vulkan: x\ny"))
    assert runner.selected_facts(Devices("auto")).kind == "cpu"
    assert isinstance(runner.open_backend(Devices("auto")), CpuBackend)
    assert [r.getMessage() for r in caplog.records] == ["vkflow: no Vulkan: x"] * 2


def test_progress_draws_on_a_tty_only():
    state = ProgressState(step=30, total=120, samples_per_second=5120.4, loss=0.43214, accuracy=0.95,
                          elapsed=10.0, done_at_start=10)  # fmt: skip
    assert eta_seconds(state) == pytest.approx(45.0)
    line = format_line(state)
    assert "30/120 steps" in line and "5120 samples/s" in line and "loss 0.4321" in line
    assert "acc 0.9500" in line and "ETA 00:45" in line and line.startswith("[######")

    quiet = io.StringIO()
    Progress(quiet).update(state, force=True)
    assert quiet.getvalue() == ""  # StringIO is not a TTY
    loud = io.StringIO()
    bar = Progress(loud, enabled=True)
    bar.update(state, force=True)
    bar.update(state)  # within the interval: not drawn again
    bar.close()
    assert loud.getvalue().count("30/120 steps") == 1 and loud.getvalue().endswith("\n")


# -- one actor on its own --------------------------------------------------------------------------


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
    messages = [m async for m in reports]

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


# -- the fast paths ----------------------------------------------------------------------------------


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


def test_cheap_work_runs_inline_and_costly_work_in_threads():
    assert InlinePolicy(forced=True).inline() and not InlinePolicy(forced=False).inline()
    cheap = InlinePolicy(threshold_s=1e-3)
    assert not cheap.inline()  # nothing measured yet: a thread
    cheap.note_thread(1e-5)
    assert cheap.inline()  # cheap in a thread: a probe runs inline...
    cheap.note_inline(2e-5)
    assert all(cheap.inline() for _ in range(20))  # ...and it stays inline while it stays cheap
    cheap.note_inline(5e-3)
    assert cheap.inline()  # one item 5x over the threshold among cheap ones: still inline
    cheap.note_inline(0.1)
    assert not cheap.inline()  # one slow item inline: back to threads
    costly = InlinePolicy(threshold_s=1e-3)
    costly.inline()
    costly.note_thread(5e-3)
    assert not any(costly.inline() for _ in range(1000))  # costly in CPU: never probed
    disk = InlinePolicy(threshold_s=1e-3)  # little CPU but slow (a disk): probes back off
    probes = []
    for item in range(5000):
        if disk.inline():
            probes.append(item)
            disk.note_inline(0.01)
        else:
            disk.note_thread(1e-5)
    gaps = np.diff(probes).tolist()
    assert gaps[:6] == [2, 4, 8, 16, 32, MAX_PROBE_GAP] and set(gaps[5:]) == {MAX_PROBE_GAP}
    # Reads that turn cheap (a cache filled in the first epoch) go inline within one probe gap.
    warming = InlinePolicy(threshold_s=1e-3)
    for item in range(2000):
        if warming.inline():
            warming.note_inline(0.01 if item < 1000 else 1e-5)
        else:
            warming.note_thread(1e-5)
    assert all(warming.inline() for _ in range(10)) and warming.running_inline


async def test_inline_or_thread_reports_each_items_cost_to_its_policy():
    """The one helper the loader and the preprocess actor run their work through."""
    threads = []

    def work(a: int, b: int) -> float:
        threads.append(threading.get_ident())
        return a / b

    policy = InlinePolicy(threshold_s=1e-3)
    offload = InlineOrThread(work, policy, trio.CapacityLimiter(1))
    assert not offload.inline()  # nothing measured yet: a thread
    assert await offload.run_in_thread(3, 2) == 1.5
    assert threads[-1] != threading.get_ident() and policy.thread_cpu_s is not None  # CPU time noted
    assert offload.inline()  # cheap in a thread: a probe runs inline
    assert offload.run_inline(4, 2) == 2
    assert threads[-1] == threading.get_ident() and policy.inline_s is not None and policy.running_inline
    noted = policy.inline_s
    with pytest.raises(ZeroDivisionError):
        offload.run_inline(1, 0)
    assert policy.inline_s == noted  # a failed item ends the actor: its cost is not noted


class CostlySource:
    """Reads that burn ``cost`` seconds of CPU, noting whether each ran on the event loop's thread."""

    def __init__(self, cost: float) -> None:
        self.cost = cost
        self.on_loop: list[bool] = []

    def read(self, indices):
        self.on_loop.append(threading.current_thread() is threading.main_thread())
        end = time.thread_time() + self.cost
        while time.thread_time() < end:
            pass
        return np.zeros((len(indices), 2), np.float32), np.zeros(len(indices), np.int32), 0


@pytest.mark.parametrize("cost", [0.0, 0.003])
async def test_the_loader_reads_cheap_batches_inline_and_costly_ones_in_threads(cost):
    source = CostlySource(cost)
    stream = (Read(seq, "train", seq, 0, seq, np.arange(4)) for seq in range(100))
    send, receive = trio.open_memory_channel(100)
    await Loader(Meter("loader", None, [send]), source, stream, workers=3).run()
    assert [batch.seq async for batch in receive] == list(range(100))  # in order either way
    assert source.on_loop[0] is False  # not measured yet: a thread
    assert all(source.on_loop[-20:]) if cost == 0.0 else not any(source.on_loop)


def test_the_synthetic_cache_gives_exactly_the_generated_samples(rng):
    for task in ("classification", "regression"):
        cached = SyntheticSource(task, 300, (2, 3), classes=4, seed=7)
        generated = SyntheticSource(task, 300, (2, 3), classes=4, seed=7, cache_bytes=0)
        for _ in range(4):
            indices = rng.integers(0, 300, 64)
            (xa, ya, _), (xb, yb, _) = cached.read(indices), generated.read(indices)
            assert xa.tobytes() == xb.tobytes() and ya.tobytes() == yb.tobytes()
        xa[:] = 0  # the caller owns what it read: the cache is not touched
        assert cached.read(indices)[0].tobytes() == xb.tobytes()


def test_every_step_has_a_metrics_line_and_statistics_ride_on_some(tmp_path):
    spec = image_spec(tmp_path, epochs=2)
    result = run(spec)
    lines = [json.loads(line) for line in Path(spec.run.metrics_file).read_text().splitlines()]
    steps = [r for r in lines if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(result.steps))
    actors = {"loader", "preprocess", "device", "optimiser", "sink"}
    assert set(steps[0]["statistics"]) == set(steps[-1]["statistics"]) == actors
    assert steps[-1]["statistics"]["sink"]["items_in"] >= result.steps


def test_the_rate_is_the_samples_in_its_window_over_its_span(rng):
    for window in (0, 1, 3, 20):
        rate, marks, when = Rate(window), [], 0.0
        for _ in range(100):
            when += float(rng.uniform(0.001, 0.01))
            samples = int(rng.integers(0, 64))
            marks.append((when, samples))
            kept = marks[-(window + 1) :]
            span = kept[-1][0] - kept[0][0]
            expected = sum(s for _, s in kept[1:]) / span if len(kept) > 1 and span > 0 else 0.0
            assert rate.add(when, samples) == pytest.approx(expected, rel=1e-9)


def test_data_that_does_not_fit_the_model_is_refused_before_any_device_work(monkeypatch):
    from flow.errors import SpecError

    existing = thread_snapshot()
    opened = []
    monkeypatch.setattr(runner, "open_backend", lambda devices: opened.append(devices) or CpuBackend())
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


def test_skipped_items_are_counted_once_and_named_in_the_result_metrics_and_summary(tmp_path, rng):
    from PIL import Image

    from flow.run_command import summary
    from flow.spec import ImageFolder

    bad = set()
    for index in range(40):
        folder = tmp_path / "images" / f"class_{index % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{index:02d}.png"
        if index % 5 == 3:  # 8 corrupt files, in both classes and in every split
            path.write_bytes(b"not a png at all")
            bad.add(str(path))
        else:
            Image.fromarray(rng.integers(0, 256, (4, 4), dtype=np.uint8), mode="L").save(path)
    spec = Spec(
        model=Model(input_shape=(1, 4, 4), layers=(Flatten(), Linear(2)), loss=CrossEntropy()),
        optimiser=Adam(0.01),
        data=Data(
            ImageFolder(str(tmp_path / "images"), on_error="skip"),
            batch_size=8,
            split=Split(train=0.75, val=0.25),
        ),
        devices=Devices("cpu"),
        run=RunSettings(epochs=3, metrics_file=str(tmp_path / "metrics.jsonl")),
    )
    result = run(spec)
    # Three epochs meet each bad training file three times; each still counts once.
    assert result.skipped == len(bad) == 8
    assert len(result.skipped_examples) == 5 and set(result.skipped_examples) <= bad
    lines = [json.loads(line) for line in Path(spec.run.metrics_file).read_text().splitlines()]
    assert lines[-1] == {
        "event": "skipped",
        "step": result.steps - 1,
        "count": 8,
        "examples": list(result.skipped_examples),
    }
    carried = [r["skipped"]["count"] for r in lines if r["event"] == "step" and "skipped" in r]
    assert carried and carried == sorted(carried) and carried[-1] <= 8  # the statistics lines carry it
    text = summary(result)
    assert f"skipped: 8 bad item(s) (on_error='skip'): {', '.join(result.skipped_examples)}, ..." in text

"""How to test your own pipelines with flow.testing: the documented example.

Three things make actor tests fast and deterministic:

1. ``FakeDevice()``: the CPU backend run on the event loop. With it the whole pipeline has no
   worker thread, so under pytest-trio's ``autojump_clock`` virtual time advances only when every
   actor is blocked: a ``Slow`` consumer that "sleeps" a second per item costs no real time, and
   the order things happen in is the same on every run.
2. ``step_pipeline(spec)``: the loader releases one training batch per ``await stepper.step()``,
   which returns that step's report once it has reached the sink.
3. ``ChannelProbe()``: a hook that samples every channel's depth whenever an actor moves an item,
   so a test can assert that queues stayed within their capacity and that senders had to wait.

pytest-trio runs ``async def`` tests itself (``trio_mode = true`` in pyproject.toml); asking for the
``autojump_clock`` fixture switches the test to virtual time.
"""

import numpy as np

from flow.runner import open_pipeline
from flow.spec import (
    SGD,
    CrossEntropy,
    Data,
    Devices,
    Edge,
    Linear,
    Model,
    Node,
    Pipeline,
    RunSettings,
    Spec,
    Split,
    Synthetic,
)
from flow.testing import ChannelProbe, FakeDevice, Slow, step_pipeline


def small_spec(pipeline: Pipeline | None = None, steps: int = 40) -> Spec:
    """A 3-class problem small enough to train in milliseconds."""
    return Spec(
        model=Model(input_shape=(6,), layers=(Linear(12, activation="relu"), Linear(3)), loss=CrossEntropy()),
        optimiser=SGD(0.2),
        data=Data(
            Synthetic(samples=240, features=(6,), classes=3), batch_size=16, split=Split(train=0.8, val=0.2)
        ),
        devices=Devices("cpu"),
        pipeline=pipeline,
        run=RunSettings(epochs=None, steps=steps),
    )


async def test_step_one_batch_at_a_time(autojump_clock):
    async with step_pipeline(small_spec(), backend=FakeDevice()) as stepper:
        first = await stepper.step()
        losses = [first.loss] + [(await stepper.step()).loss for _ in range(29)]
        stats = stepper.statistics()

    # Steps arrive one by one, in order, and the model learns while we watch.
    assert first.step == 0 and first.rows == 16
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    # The gate held the loader: the optimiser saw exactly the steps we asked for.
    assert stats["optimiser"].updates == 30


async def test_a_slow_sink_backs_the_queues_up(autojump_clock):
    # Small capacities, so the effect is easy to see.
    pipeline = Pipeline(
        nodes=(Node("loader", "loader"), Node("preprocess", "preprocess"), Node("device", "device"),
               Node("optimiser", "optimiser"), Node("sink", "sink")),
        edges=(Edge("loader", "preprocess", capacity=3), Edge("preprocess", "device", capacity=2),
               Edge("device", "optimiser", capacity=2), Edge("optimiser", "sink", capacity=1)),
    )  # fmt: skip
    probe = ChannelProbe()
    async with open_pipeline(
        small_spec(pipeline, steps=120), backend=FakeDevice(), hooks=[probe, Slow("sink", 1.0)]
    ) as p:
        pass  # the block's end waits for the run to finish

    # Every queue filled up to its capacity and never beyond it (capacities count messages, and
    # several ready at once travel as one chunk, so it takes a longer run than capacity steps)...
    for edge, capacity in probe.capacity.items():
        assert probe.peak[edge] == capacity, edge
    # ...and the loader had to wait for space: the slow sink slowed it down.
    assert probe.blocked[("loader", "preprocess")]
    assert p.result.steps == 120

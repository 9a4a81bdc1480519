"""Random valid specs train, evaluate and predict on the CPU and on Vulkan, and the two agree.

Each test id draws one spec from a generator seeded by that id (``draw_spec(index)``): an MLP or a
small CNN with odd widths from 1 to 1024 and every activation (as a layer's epilogue and as a layer
of its own), CrossEntropy or MSE, every optimiser with every schedule, batch sizes from 1 to 256
with and without ``drop_last``, Synthetic sources sized so that partial last batches and validation
splits occur. The categorical choices cycle with the index, so the first 50 specs cover all of them;
the sizes are drawn at random. Widths are mostly small (lavapipe does a few GFLOP/s), with a wide
spec (256 to 1024 units, a batch of 33 to 96 rows, a step or two) every tenth index.

For each spec the test trains it with ``flow.run`` on the CPU backend and on the Vulkan backend,
then predicts on a row count that is not a multiple of the batch size with ``flow.predict`` and
through ``open_pipeline(mode="predict")`` fed in uneven pieces. The two backends must agree within
float32 tolerances: the runs take a few steps at a modest learning rate, so rounding differences
(and the occasional ReLU kink or Adam step on a near-zero gradient) stay small.

``VKFLOW_PROPERTY_SPECS=<n>`` runs n specs (50 by default, as in CI); ``VKFLOW_TEST_SEED=<s>``
draws another set. A failure prints the spec as JSON: ``flow run`` takes it as it is.
"""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest
import trio
from conftest import near_ties, relative_error, stable_seed

import flow
from actors.cpu_backend import CpuBackend
from flow.codec import encode
from flow.spec import (
    GELU,
    MSE,
    SGD,
    Adam,
    AdamW,
    Add,
    Concat,
    Constant,
    Conv2d,
    Cosine,
    CrossEntropy,
    Data,
    Devices,
    Flatten,
    HorizontalFlip,
    Init,
    LeakyReLU,
    Linear,
    MaxPool2d,
    Model,
    Normalize,
    ReLU,
    Repeat,
    Residual,
    RunSettings,
    Sigmoid,
    Softmax,
    Spec,
    Split,
    StepLR,
    Synthetic,
    Tanh,
)
from loaders import open_source, split_indices

SPECS = int(os.environ.get("VKFLOW_PROPERTY_SPECS", "50"))

ACTIVATIONS = ("relu", "leaky_relu", "sigmoid", "tanh", "gelu")
LAYERS = {"relu": ReLU, "leaky_relu": LeakyReLU, "sigmoid": Sigmoid, "tanh": Tanh, "gelu": GELU}
OPTIMISERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "step", "cosine", "warmup")

# Float32 over a few steps: CPU and Vulkan sum in different orders, and their exp/tanh differ in
# the last bits. Over the first 600 specs on lavapipe the worst differences were 7e-6 of a
# parameter tensor's norm, 7e-6 of a loss and 3e-6 of the predictions' norm; a wrong kernel or
# a wrong row count gives 1e-2 to O(1).
PARAM_TOL = 1e-4
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-6
OUTPUT_TOL = 1e-4
TIE_GAP = 1e-3  # the probability gap under which two slightly different models may disagree


def _width(r: random.Random, low: int = 1, high: int = 24) -> int:
    """An odd-sized width: log-uniform, so 1, 2, 3 come up as often as 13 to 24."""
    return int(round(math.exp(r.uniform(math.log(low), math.log(high)))))


def _activation(r: random.Random, featured: str | None) -> tuple[str | None, tuple]:
    """An epilogue activation and the activation layers after it (either may be empty)."""
    name = featured or r.choice((None, None, *ACTIVATIONS))
    if name is None:
        return None, ()
    if r.random() < 0.5:
        return name, ()
    layer = LAYERS[name](slope=r.choice((0.01, 0.2))) if name == "leaky_relu" else LAYERS[name]()
    return None, (layer,)


def _mlp(r: random.Random, index: int, outputs: int, wide: bool) -> tuple[tuple[int, ...], tuple]:
    featured = ACTIVATIONS[index % 5]
    if wide:  # the top of the range comes up often: boundaries are where plans change
        features, units = (r.choice((1024, r.randint(900, 1024), r.randint(256, 1024))) for _ in range(2))
        hidden = [units] + ([_width(r, 5, 64)] if r.random() < 0.3 else [])
    else:
        features = _width(r, 1, 40)
        hidden = [_width(r) for _ in range(r.randint(0, 3))]
    layers: list = []
    for position, units in enumerate(hidden):
        activation, extra = _activation(r, featured if position == 0 else None)
        layers += [Linear(units=units, activation=activation, bias=r.random() < 0.9), *extra]
        if r.random() < 0.08:
            layers.append(Softmax())
    layers.append(Linear(units=outputs))
    if not hidden and r.random() < 0.5:  # a linear model: the featured activation after its outputs
        layers.append(LAYERS[featured]())
    return (features,), tuple(layers)


def _cnn(r: random.Random, index: int, outputs: int) -> tuple[tuple[int, ...], tuple]:
    shape = (r.randint(1, 3), r.randint(3, 9), r.randint(3, 9))
    layers: list = []
    for position in range(r.randint(1, 2)):
        activation, extra = _activation(r, ACTIVATIONS[index % 5] if position == 0 else None)
        layers.append(
            Conv2d(channels=_width(r, 1, 6), kernel=r.choice((1, 2, 3)), stride=r.choice((1, 1, 2)),
                   padding=r.choice((0, 1)), bias=r.random() < 0.9, activation=activation)
        )  # fmt: skip
        layers += extra
        if r.random() < 0.4:
            layers.append(MaxPool2d(kernel=2, stride=r.choice((None, 1))))
    layers.append(Flatten())
    if r.random() < 0.5:
        layers.append(Linear(units=_width(r), activation=r.choice((None, *ACTIVATIONS))))
    layers.append(Linear(units=outputs))
    return shape, tuple(layers)


def _graph(r: random.Random) -> tuple:
    """Layers that make a model a graph: a named trunk, then a Residual block (maybe repeated) or a
    branch of its own joined back to the trunk by Add or Concat (or one joining the model's input)."""
    width = _width(r, 1, 40)
    activation, extra = _activation(r, None)
    block = (Linear(units=width, activation=activation), *extra, Linear(units=width, bias=r.random() < 0.9))
    trunk = Linear(units=width, activation=r.choice((None, *ACTIVATIONS)), name="trunk")
    kind = r.choice(("residual", "repeat", "add", "concat", "input"))
    if kind == "residual":
        return trunk, Residual(block)
    if kind == "repeat":
        return trunk, Repeat(r.randint(2, 3), (Residual(block[-1:]), *extra))
    if kind == "input":
        return trunk, Linear(units=width, inputs=("input",), name="side"), Concat(inputs=("trunk", "side"))
    join = Add if kind == "add" else Concat
    return trunk, *block[:-1], Linear(units=width, name="branch"), join(inputs=("branch", "trunk", "branch"))


def _optimiser(r: random.Random, index: int, steps: int):
    kind, schedule_kind = OPTIMISERS[index % 3], SCHEDULES[(index // 3) % 4]
    warmup = r.randint(1, 2) if schedule_kind == "warmup" else r.choice((0, 0, 1))
    if schedule_kind == "step":
        schedule = StepLR(step_size=r.randint(1, 3), gamma=r.choice((0.5, 0.1)), warmup_steps=warmup)
    elif schedule_kind == "cosine":
        total = max(steps + r.randint(-1, 3), warmup + 1)
        schedule = Cosine(total_steps=total, min_lr=0.0, warmup_steps=warmup)
    else:
        schedule = Constant(warmup_steps=warmup)
    if kind == "sgd":
        momentum = r.choice((0.0, 0.9))
        return SGD(lr=r.uniform(0.01, 0.05), momentum=momentum, nesterov=momentum > 0 and r.random() < 0.5,
                   weight_decay=r.choice((0.0, 1e-3)), schedule=schedule)  # fmt: skip
    if kind == "adam":
        return Adam(lr=r.uniform(5e-4, 2e-3), weight_decay=r.choice((0.0, 1e-3)), schedule=schedule)
    return AdamW(lr=r.uniform(5e-4, 2e-3), weight_decay=r.choice((0.0, 0.01)), schedule=schedule)


def draw_spec(index: int) -> Spec:
    """The ``index``-th random spec (valid; the same on every run and machine).

    Args:
        index: which spec.

    Returns:
        The spec.
    """
    r = random.Random(stable_seed("tests/test_property_specs.py", index))
    for _ in range(1000):
        spec = _draw(r, index)
        if not flow.validate(spec) and _trains(spec):
            return spec
    raise AssertionError(f"no valid spec drawn for index {index}")


def _draw(r: random.Random, index: int) -> Spec:
    wide = index % 10 == 7
    regression = index % 7 == 3
    classes = r.randint(2, 10)
    outputs = 1 if regression else classes + r.choice((0, 0, 1))
    if index % 4 == 1 and not wide:
        input_shape, layers = _cnn(r, index, outputs)
    else:
        input_shape, layers = _mlp(r, index, outputs, wide)
        if not wide and index % 3 == 2:  # a graph: branches joined, residual blocks, repeats
            layers = (*layers[:-1], *_graph(r), layers[-1])
    if regression and r.random() < 0.3:
        layers = (*layers, r.choice((Tanh(), Sigmoid())))

    batch = r.randint(33, 128) if wide else _width(r, 1, 256)
    split = r.choice((Split(), Split(train=0.8, val=0.2), Split(train=0.7, val=0.2, test=0.1),
                      Split(train=0.75, val=0.25, stratify=not regression)))  # fmt: skip
    batches = 1 if wide else r.randint(1, 4)
    # Mostly a partial last batch, as often of a few rows as of nearly a whole batch.
    train_rows = batches * batch - (batch - _width(r, 1, batch) if r.random() < 0.85 else 0)
    samples = max(2, math.ceil(train_rows / split.train))
    if wide:
        steps, epochs = r.randint(1, 2), None
    else:
        epochs = r.choice((1, 1, 2, None))
        steps = r.randint(1, 6) if epochs is None or r.random() < 0.5 else None
    normalize = Normalize(mean=(r.uniform(-0.5, 0.5),), std=(r.uniform(0.5, 2.0),))
    preprocess = (normalize,) if r.random() < 0.2 else ()
    augment = (HorizontalFlip(p=0.5),) if len(input_shape) == 3 and r.random() < 0.3 else ()
    return Spec(
        model=Model(input_shape=input_shape, layers=layers, loss=MSE() if regression else CrossEntropy(),
                    init=Init(scheme=r.choice(("he", "xavier")), seed=r.randrange(1000))),
        optimiser=_optimiser(r, index, steps or batches * (epochs or 1)),
        data=Data(
            Synthetic(task="regression" if regression else "classification", samples=samples,
                      features=input_shape, classes=classes, seed=r.randrange(1000)),
            batch_size=batch, shuffle=r.random() < 0.8, seed=r.randrange(1000), split=split,
            drop_last=r.random() < 0.3, preprocess=preprocess, augment=augment,
        ),
        devices=Devices(select="cpu"),
        run=RunSettings(epochs=epochs, steps=steps, in_flight=r.randint(1, 3),
                        eval_every=r.choice((None, None, 2)) if split.val else None),
    )  # fmt: skip


def _parts(spec: Spec) -> dict[str, np.ndarray]:
    """The spec's split, as the loader makes it."""
    source, split = open_source(spec.data.source), spec.data.split
    source.close()
    return split_indices(len(source), source.labels, split.train, split.val, split.test, spec.data.seed,
                         split.stratify)  # fmt: skip


def _trains(spec: Spec) -> bool:
    """Whether an epoch has a training batch: with drop_last, fewer rows than a batch have none, and
    the runner refuses such a spec with a clear error before any device work."""
    rows = len(_parts(spec)["train"])
    return rows >= (spec.data.batch_size if spec.data.drop_last else 1)


def _with_checkpoints(spec: Spec, directory) -> Spec:
    from dataclasses import replace

    return replace(spec, run=replace(spec.run, checkpoint_dir=str(directory)))


async def _predict_in_pieces(checkpoint: str, x: np.ndarray, backend, r: random.Random) -> np.ndarray:
    """Predictions through ``open_pipeline(mode="predict")``, fed in uneven pieces."""
    cuts = sorted(r.sample(range(1, len(x)), min(3, len(x) - 1)))
    pieces = np.split(x, cuts)
    async with flow.open_pipeline(resume=checkpoint, mode="predict", backend=backend) as pipeline:
        async with trio.open_nursery() as nursery:

            async def feed_all() -> None:
                for piece in pieces:
                    await pipeline.feed(piece)
                await pipeline.end_input()

            nursery.start_soon(feed_all)
            outputs = [out async for out in pipeline.results()]
    assert [len(o) for o in outputs] == [len(p) for p in pieces]
    return np.concatenate(outputs)


def _close(actual: float, expected: float) -> bool:
    return abs(actual - expected) <= LOSS_ATOL + LOSS_RTOL * abs(expected)


@pytest.mark.parametrize("index", range(SPECS))
def test_a_random_spec_trains_and_predicts_alike_on_cpu_and_vulkan(index, vulkan_backend, tmp_path):
    spec = draw_spec(index)
    print(json.dumps(encode(spec)))
    r = random.Random(stable_seed("tests/test_property_specs.py", index, "inputs"))
    cpu = flow.run(_with_checkpoints(spec, tmp_path / "cpu"), backend=CpuBackend())
    gpu = flow.run(_with_checkpoints(spec, tmp_path / "vulkan"), backend=vulkan_backend)

    # The same schedule on both: steps, epochs, evaluations of the same rows.
    assert gpu.steps == cpu.steps >= 1 and gpu.epochs == cpu.epochs
    schedule = [(e.step, e.samples, getattr(e, "split", "val")) for e in cpu.evals]
    assert [(e.step, e.samples, getattr(e, "split", "val")) for e in gpu.evals] == schedule
    assert math.isfinite(cpu.loss) and _close(gpu.loss, cpu.loss), (gpu.loss, cpu.loss)
    for name, value in cpu.parameters.items():
        assert relative_error(gpu.parameters[name], value) <= PARAM_TOL, name
    for mine, theirs in zip(gpu.evals, cpu.evals, strict=True):
        assert _close(mine.loss, theirs.loss), (mine, theirs)

    # Predictions on a row count that is not a multiple of the batch size.
    batch = spec.data.batch_size
    rows = batch * r.randint(0, 2) + (r.randint(1, batch - 1) if batch > 1 else r.randint(1, 3))
    x = np.random.default_rng(r.randrange(2**32)).standard_normal((rows, *spec.model.input_shape))
    x = x.astype(np.float32)
    expected = flow.predict(cpu.checkpoint, x, backend=CpuBackend())
    predicted = flow.predict(gpu.checkpoint, x, backend=vulkan_backend)
    assert predicted.shape == expected.shape and expected.shape[0] == rows
    assert np.isfinite(expected).all()
    assert relative_error(predicted, expected) <= OUTPUT_TOL
    pieces = trio.run(_predict_in_pieces, gpu.checkpoint, x, vulkan_backend, r)
    assert relative_error(pieces, predicted) <= 1e-5  # the same weights, other batch splits

    # Evaluations at the end ran on the final weights: their correct counts may differ by near-ties only.
    if isinstance(spec.model.loss, CrossEntropy):
        final = [(g, c) for g, c in zip(gpu.evals, cpu.evals, strict=True) if c.step == cpu.steps]
        parts, source = _parts(spec), open_source(spec.data.source)
        for mine, theirs in final:
            rows = source.read(parts[getattr(theirs, "split", "val")])[0]
            ties = near_ties(flow.predict(cpu.checkpoint, rows, backend=CpuBackend()), TIE_GAP)
            assert abs(mine.accuracy - theirs.accuracy) * theirs.samples <= ties + 1e-6, (mine, theirs, ties)
        source.close()

"""Hypothesis strategies for vkflow's records: ``specs()`` draws a random valid spec (every layer,
loss, optimiser and schedule, source, transform and split kind, with and without an explicit
pipeline); the parts it draws from are strategies of their own."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from flow.shapes import output_shape
from flow.spec import (
    CSV,
    GELU,
    IDX,
    MSE,
    SGD,
    Adam,
    AdamW,
    Add,
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    Concat,
    Constant,
    Conv2d,
    Cosine,
    CrossEntropy,
    Data,
    Devices,
    Digits,
    Edge,
    Flatten,
    GlobalAvgPool,
    HorizontalFlip,
    ImageFolder,
    Init,
    LeakyReLU,
    Linear,
    MaxPool2d,
    Model,
    Normalize,
    RandomCrop,
    RawBinary,
    ReLU,
    Repeat,
    Residual,
    Resize,
    RunSettings,
    Scale,
    Sigmoid,
    Spec,
    Split,
    StepLR,
    Synthetic,
    Tanh,
    default_pipeline,
)


def floats(low: float, high: float, **kwargs) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_nan=False, allow_infinity=False, **kwargs)


names = st.text(min_size=1, max_size=12)
sizes = st.tuples(st.integers(1, 64), st.integers(1, 64))
activations = st.sampled_from([None, "relu", "leaky_relu", "sigmoid", "tanh", "gelu"])
activation_layers = st.sampled_from([ReLU(), Sigmoid(), Tanh(), GELU()]) | st.builds(LeakyReLU, floats(0, 1))
seeds = st.integers(0, 2**32)


def batch_norms(kind: type) -> st.SearchStrategy:
    return st.builds(kind, momentum=floats(0, 1), eps=floats(1e-8, 1.0))


@st.composite
def graph_blocks(draw, hidden: st.SearchStrategy) -> list:
    """Layers that make a flat model a graph: a Linear named for later, then a Residual block (in
    a Repeat or not) or a second branch from it, joined back by Add or Concat."""
    width = draw(st.integers(1, 32))
    layers = [Linear(width, activation=draw(activations), name="trunk")]
    block = tuple(draw(st.lists(hidden, max_size=2))) + (Linear(width, bias=draw(st.booleans())),)
    kind = draw(st.sampled_from(["residual", "repeat", "add", "concat"]))
    if kind == "residual":
        layers.append(Residual(block))
    elif kind == "repeat":
        layers.append(Repeat(draw(st.integers(1, 3)), (Residual(block),)))
    else:
        layers += [*block[:-1], Linear(width, name="branch"), Add(inputs=("branch", "trunk"))]
        if kind == "concat":
            layers[-1] = Concat(inputs=("trunk", "branch"))
    return layers


@st.composite
def models(draw) -> Model:
    layers = []
    if draw(st.booleans()):
        input_shape = shape = (draw(st.integers(1, 3)), draw(st.integers(4, 16)), draw(st.integers(4, 16)))
        for _ in range(draw(st.integers(0, 3))):
            kernel = draw(st.integers(1, min(shape[1:])))
            kind = draw(st.sampled_from(["conv", "max", "avg", "norm"]))
            if kind == "conv":
                layer = Conv2d(
                    draw(st.integers(1, 8)),
                    kernel,
                    stride=draw(st.integers(1, 3)),
                    padding=draw(st.integers(0, 2)),
                    bias=draw(st.booleans()),
                    activation=draw(activations),
                )
            elif kind == "max":
                layer = MaxPool2d(kernel, stride=draw(st.none() | st.integers(1, 3)))
            elif kind == "avg":
                stride = draw(st.none() | st.integers(1, 3))
                layer = AvgPool2d(kernel, stride=stride, padding=draw(st.integers(0, kernel // 2)))
            else:
                layer = draw(batch_norms(BatchNorm2d))
            shape = output_shape(layer, shape)
            layers.append(layer)
        layers.append(draw(st.sampled_from([Flatten(), GlobalAvgPool()])))
    else:
        input_shape = (draw(st.integers(1, 64)),)
    hidden = (
        st.builds(Linear, st.integers(1, 64), bias=st.booleans(), activation=activations)
        | activation_layers
        | batch_norms(BatchNorm1d)
    )
    layers += draw(st.lists(hidden, max_size=3))
    if draw(st.booleans()):
        layers += draw(graph_blocks(hidden))
    layers.append(Linear(draw(st.integers(2, 16)), bias=draw(st.booleans())))
    return Model(
        input_shape=input_shape,
        layers=tuple(layers),
        loss=draw(st.sampled_from([CrossEntropy(), MSE()])),
        input_dtype=draw(st.sampled_from(["float32", "float16", "uint8"])),
        init=Init(scheme=draw(st.sampled_from(["he", "xavier"])), seed=draw(seeds)),
    )


@st.composite
def optimisers(draw):
    lr = draw(floats(1e-6, 1.0))
    warmup = draw(st.integers(0, 100))
    schedule = draw(
        st.just(Constant(warmup_steps=warmup))
        | st.builds(StepLR, st.integers(1, 1000), gamma=floats(0.01, 1.0), warmup_steps=st.just(warmup))
        | st.builds(
            Cosine, st.integers(warmup + 1, 10_000), min_lr=floats(0, lr), warmup_steps=st.just(warmup)
        )
    )
    betas = st.tuples(floats(0, 0.999), floats(0, 0.9999))
    momentum = draw(floats(0, 0.99))
    return draw(
        st.builds(
            SGD,
            st.just(lr),
            momentum=st.just(momentum),
            nesterov=st.booleans().map(lambda b: b and momentum > 0),
            weight_decay=floats(0, 0.1),
            schedule=st.just(schedule),
        )
        | st.builds(
            Adam,
            st.just(lr),
            betas=betas,
            eps=floats(1e-12, 1e-3),
            weight_decay=floats(0, 0.1),
            schedule=st.just(schedule),
        )
        | st.builds(AdamW, st.just(lr), betas=betas, weight_decay=floats(0, 0.1), schedule=st.just(schedule))
    )


@st.composite
def normalizes(draw) -> Normalize:
    n = draw(st.integers(1, 3))
    return Normalize(
        tuple(draw(st.lists(floats(-1, 1), min_size=n, max_size=n))),
        tuple(draw(st.lists(floats(0.01, 2), min_size=n, max_size=n))),
    )


on_error = st.sampled_from(["raise", "skip"])
dtypes = st.sampled_from(["uint8", "int32", "float16", "float32", "float64"])
sources = st.one_of(
    st.builds(
        ImageFolder,
        names,
        size=st.none() | sizes,
        mode=st.sampled_from(["L", "RGB", "RGBA"]),
        layout=st.sampled_from(["CHW", "HWC"]),
        labels_csv=st.none() | names,
        workers=st.integers(1, 8),
        on_error=on_error,
    ),
    st.builds(
        CSV,
        names,
        label_column=names,
        feature_columns=st.none() | st.lists(st.integers(0, 50), min_size=1),
        chunk_rows=st.integers(1, 10_000),
        on_error=on_error,
    ),
    st.builds(
        RawBinary,
        names,
        dtype=dtypes,
        shape=st.lists(st.integers(1, 32), min_size=1, max_size=3),
        labels_path=st.none() | names,
        label_dtype=dtypes,
        on_error=on_error,
    ),
    st.builds(IDX, names, names),
    st.builds(
        Synthetic,
        task=st.sampled_from(["classification", "regression"]),
        samples=st.integers(1, 10**6),
        features=st.lists(st.integers(1, 32), min_size=1, max_size=3),
        classes=st.integers(2, 100),
        seed=seeds,
    ),
    st.just(Digits()),
)
transforms = st.one_of(
    normalizes(),
    st.builds(Scale, floats(-10, 10)),
    st.builds(RandomCrop, sizes, padding=st.integers(0, 8)),
    st.builds(HorizontalFlip, floats(0, 1)),
    st.builds(Resize, sizes),
)


@st.composite
def splits(draw) -> Split:
    train = draw(floats(0.01, 1.0))
    val = draw(floats(0.0, 1.0 - train))
    return Split(train=train, val=val, test=max(0.0, 1.0 - train - val), stratify=draw(st.booleans()))


@st.composite
def specs(draw) -> Spec:
    steps = draw(st.none() | st.integers(1, 10**6))
    checkpoint_dir = draw(st.none() | names)
    spec = Spec(
        model=draw(models()),
        optimiser=draw(optimisers()),
        data=draw(
            st.builds(
                Data,
                sources,
                batch_size=st.integers(1, 1024),
                shuffle=st.booleans(),
                seed=seeds,
                split=splits(),
                drop_last=st.booleans(),
                preprocess=st.lists(transforms, max_size=3),
                augment=st.lists(transforms, max_size=3),
            )
        ),
        devices=Devices(
            draw(st.sampled_from(["auto", "cpu"]) | st.integers(0, 7) | names),
            memory_fraction=draw(floats(0, 1, exclude_min=True)),
        ),
        run=RunSettings(
            epochs=draw(st.integers(1, 100)) if steps is None else draw(st.none() | st.integers(1, 100)),
            steps=steps,
            eval_every=draw(st.none() | st.integers(1, 1000)),
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=None if checkpoint_dir is None else draw(st.none() | st.integers(1, 1000)),
            metrics_file=draw(st.none() | names),
            in_flight=draw(st.integers(1, 8)),
        ),
    )
    if draw(st.booleans()):
        pipeline = default_pipeline(spec)
        edges = pipeline.edges + ((Edge("optimiser", "device", credit=True),) if draw(st.booleans()) else ())
        spec = dataclasses.replace(spec, pipeline=dataclasses.replace(pipeline, edges=edges))
    return spec

"""Spec types: a training job as pure data.

A spec is a tree of frozen records (model, optimiser, data, devices, pipeline, run settings) with no
behaviour beyond two pure helpers: :func:`learning_rate` (the schedules) and
:func:`default_pipeline`. Records hold tuples, never lists, so a spec is hashable and compares by
value; the codec tags each record by its class name, so class and field names are part of the file
format (:data:`SCHEMA_VERSION`). Constructors never check values: :mod:`flow.validate` does, and
returns every problem at once.

Annotations here are real objects (no ``from __future__ import annotations``) because the codec and
the validator read them from ``dataclasses.fields``.
"""

import math
from dataclasses import KW_ONLY, dataclass, fields
from typing import Literal

SCHEMA_VERSION = 1

Shape = tuple[int, ...]
Activation = Literal["relu", "leaky_relu", "sigmoid", "tanh", "gelu"]
DType = Literal["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64"]
OnError = Literal["raise", "skip"]


class _Record:
    """Base of every spec record: turns lists into tuples so hand-written specs stay hashable and
    equal to the same spec decoded from a file."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, _tuplify(value))


def _tuplify(value: list) -> tuple:
    return tuple(_tuplify(v) if isinstance(v, list) else v for v in value)


# Layers


@dataclass(frozen=True)
class Linear(_Record):
    units: int
    _: KW_ONLY
    bias: bool = True
    activation: Activation | None = None


@dataclass(frozen=True)
class Conv2d(_Record):
    channels: int
    kernel: int
    _: KW_ONLY
    stride: int = 1
    padding: int = 0
    bias: bool = True
    activation: Activation | None = None


@dataclass(frozen=True)
class MaxPool2d(_Record):
    kernel: int
    _: KW_ONLY
    stride: int | None = None  # None: the same as kernel (non-overlapping windows)


@dataclass(frozen=True)
class Flatten(_Record):
    pass


@dataclass(frozen=True)
class ReLU(_Record):
    pass


@dataclass(frozen=True)
class LeakyReLU(_Record):
    slope: float = 0.01


@dataclass(frozen=True)
class Sigmoid(_Record):
    pass


@dataclass(frozen=True)
class Tanh(_Record):
    pass


@dataclass(frozen=True)
class GELU(_Record):
    pass


@dataclass(frozen=True)
class Softmax(_Record):
    pass


Layer = Linear | Conv2d | MaxPool2d | Flatten | ReLU | LeakyReLU | Sigmoid | Tanh | GELU | Softmax

# Losses and the model


@dataclass(frozen=True)
class CrossEntropy(_Record):
    """Integer class labels; softmax is fused into the loss, so the model ends in raw logits."""


@dataclass(frozen=True)
class MSE(_Record):
    pass


Loss = CrossEntropy | MSE


@dataclass(frozen=True, kw_only=True)
class Init(_Record):
    scheme: Literal["he", "xavier"] = "he"
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class Model(_Record):
    input_shape: Shape  # without the batch dimension: (64,) for a vector, (C, H, W) for images
    layers: tuple[Layer, ...]
    loss: Loss | None
    input_dtype: Literal["float32", "float16", "uint8"] = "float32"
    init: Init = Init()


# Optimisers and learning-rate schedules


@dataclass(frozen=True, kw_only=True)
class Constant(_Record):
    warmup_steps: int = 0


@dataclass(frozen=True)
class StepLR(_Record):
    step_size: int
    _: KW_ONLY
    gamma: float = 0.1
    warmup_steps: int = 0


@dataclass(frozen=True)
class Cosine(_Record):
    total_steps: int  # the whole run, warmup included: the decay ends here at min_lr
    _: KW_ONLY
    min_lr: float = 0.0
    warmup_steps: int = 0


Schedule = Constant | StepLR | Cosine


@dataclass(frozen=True)
class SGD(_Record):
    lr: float = 0.01
    _: KW_ONLY
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    schedule: Schedule = Constant()


@dataclass(frozen=True)
class Adam(_Record):
    lr: float = 1e-3
    _: KW_ONLY
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0  # L2 added to the gradient; AdamW decouples it
    schedule: Schedule = Constant()


@dataclass(frozen=True)
class AdamW(_Record):
    lr: float = 1e-3
    _: KW_ONLY
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    schedule: Schedule = Constant()


Optimiser = SGD | Adam | AdamW

# Sources


@dataclass(frozen=True)
class ImageFolder(_Record):
    root: str
    _: KW_ONLY
    size: tuple[int, int] | None = None  # (height, width); None keeps each image's own size
    mode: Literal["L", "RGB", "RGBA"] = "L"
    layout: Literal["CHW", "HWC"] = "CHW"
    labels_csv: str | None = None  # None: the label is the name of the image's sub-folder
    workers: int = 2
    on_error: OnError = "raise"


@dataclass(frozen=True)
class CSV(_Record):
    path: str
    _: KW_ONLY
    label_column: str | int
    feature_columns: tuple[str | int, ...] | None = None  # None: every column but the label
    header: bool = True
    chunk_rows: int = 4096
    on_error: OnError = "raise"


@dataclass(frozen=True)
class RawBinary(_Record):
    path: str
    _: KW_ONLY
    dtype: DType
    shape: Shape  # of one sample
    labels_path: str | None = None
    label_dtype: DType = "int32"
    on_error: OnError = "raise"


@dataclass(frozen=True)
class IDX(_Record):
    images: str
    labels: str


@dataclass(frozen=True, kw_only=True)
class Synthetic(_Record):
    task: Literal["classification", "regression"] = "classification"
    samples: int
    features: Shape
    classes: int = 10
    seed: int = 0


@dataclass(frozen=True)
class Digits(_Record):
    """The bundled 8x8 grey handwritten-digit set (1 x 8 x 8 inputs, 10 classes)."""


Source = ImageFolder | CSV | RawBinary | IDX | Synthetic | Digits

# Preprocessing and augmentation


@dataclass(frozen=True)
class Normalize(_Record):
    mean: tuple[float, ...]  # one value for every channel, or one per channel
    std: tuple[float, ...]


@dataclass(frozen=True)
class Scale(_Record):
    factor: float


@dataclass(frozen=True)
class RandomCrop(_Record):
    size: tuple[int, int]
    _: KW_ONLY
    padding: int = 0


@dataclass(frozen=True)
class HorizontalFlip(_Record):
    p: float = 0.5


@dataclass(frozen=True)
class Resize(_Record):
    size: tuple[int, int]


Transform = Normalize | Scale | RandomCrop | HorizontalFlip | Resize

# Data, devices, pipeline, run settings


@dataclass(frozen=True, kw_only=True)
class Split(_Record):
    train: float = 1.0
    val: float = 0.0
    test: float = 0.0
    stratify: bool = False


@dataclass(frozen=True)
class Data(_Record):
    source: Source
    _: KW_ONLY
    batch_size: int = 64
    shuffle: bool = True
    seed: int = 0
    split: Split = Split()
    drop_last: bool = False
    preprocess: tuple[Transform, ...] = ()
    augment: tuple[Transform, ...] = ()  # training batches only


@dataclass(frozen=True)
class Devices(_Record):
    select: int | str = "auto"  # "auto", "cpu", a device index, or a substring of a device name
    _: KW_ONLY
    memory_fraction: float = 0.9


NodeKind = Literal["loader", "preprocess", "device", "optimiser", "sink", "broadcast"]


@dataclass(frozen=True)
class Node(_Record):
    name: str
    kind: NodeKind
    _: KW_ONLY
    device: int | None = None
    workers: int = 1


@dataclass(frozen=True)
class Edge(_Record):
    src: str
    dst: str
    _: KW_ONLY
    capacity: int = 4  # channels are always bounded
    credit: bool = False  # a credit edge may close a cycle: its sender waits for a credit, not space


@dataclass(frozen=True)
class Pipeline(_Record):
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]


@dataclass(frozen=True, kw_only=True)
class RunSettings(_Record):
    epochs: int | None = 1
    steps: int | None = None  # when both are set, the run stops at whichever comes first
    eval_every: int | None = None  # in steps; None: after each epoch
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # in steps
    metrics_file: str | None = None
    in_flight: int = 2  # training steps submitted ahead of the one being waited on
    # "mixed": GEMMs round their inputs to float16 and run on tensor cores (cooperative matrices)
    # with float32 accumulation; weights, gradients and optimiser state stay float32.
    precision: Literal["float32", "mixed"] = "float32"


@dataclass(frozen=True, kw_only=True)
class Spec(_Record):
    model: Model
    optimiser: Optimiser
    data: Data
    devices: Devices = Devices()
    pipeline: Pipeline | None = None  # None: default_pipeline(spec)
    run: RunSettings = RunSettings()
    version: int = SCHEMA_VERSION


RECORDS: tuple[type, ...] = (
    Linear, Conv2d, MaxPool2d, Flatten, ReLU, LeakyReLU, Sigmoid, Tanh, GELU, Softmax,
    CrossEntropy, MSE, Init, Model,
    Constant, StepLR, Cosine, SGD, Adam, AdamW,
    ImageFolder, CSV, RawBinary, IDX, Synthetic, Digits,
    Normalize, Scale, RandomCrop, HorizontalFlip, Resize,
    Split, Data, Devices, Node, Edge, Pipeline, RunSettings, Spec,
)  # fmt: skip


# Fields whose key in a file differs from their name: a Spec's version is the document's schema, and a
# Node's kind would collide with the "kind" tag that names every record's class.
FILE_KEYS: dict[tuple[type, str], str] = {(Spec, "version"): "schema", (Node, "kind"): "node_kind"}


def file_key(cls: type, name: str) -> str:
    """The key a record's field has in a file (and in problem paths).

    Args:
        cls: the record's class.
        name: the field's name.

    Returns:
        The key; the field's name except for the few in FILE_KEYS.
    """
    return FILE_KEYS.get((cls, name), name)


def learning_rate(optimiser: Optimiser, step: int) -> float:
    """The learning rate for one optimiser step.

    Warmup rises linearly from 0 at step 0 to ``lr`` at step ``warmup_steps``; the schedule's clock
    then starts. ``StepLR`` multiplies by ``gamma`` every ``step_size`` steps; ``Cosine`` falls from
    ``lr`` to ``min_lr`` at step ``total_steps`` (counted from step 0, warmup included) and stays there.

    Args:
        optimiser: an SGD, Adam or AdamW record (valid, see flow.validate).
        step: the 0-based index of the update.

    Returns:
        The learning rate for that update.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    lr, schedule = optimiser.lr, optimiser.schedule
    if step < schedule.warmup_steps:
        return lr * step / schedule.warmup_steps
    t = step - schedule.warmup_steps
    if isinstance(schedule, StepLR):
        return lr * schedule.gamma ** (t // schedule.step_size)
    if isinstance(schedule, Cosine):
        progress = min(t / (schedule.total_steps - schedule.warmup_steps), 1.0)
        return schedule.min_lr + (lr - schedule.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return float(lr)


def default_pipeline(spec: Spec) -> Pipeline:
    """The pipeline used when ``spec.pipeline`` is None: loader → preprocess → device → sink.

    The optimiser hangs off the device: the update runs inside the device's recorded step, so the
    device → optimiser edge carries only what the optimiser node reports, and no edge goes back.

    Args:
        spec: the spec; its source sets the loader's workers and ``run.in_flight`` the capacity of the
            edge into the device (one input slot per step in flight).

    Returns:
        The default pipeline.
    """
    source = spec.data.source
    workers = source.workers if isinstance(source, ImageFolder) else 1
    return Pipeline(
        nodes=(
            Node("loader", "loader", workers=workers),
            Node("preprocess", "preprocess"),
            Node("device", "device"),
            Node("optimiser", "optimiser"),
            Node("sink", "sink"),
        ),
        edges=(
            Edge("loader", "preprocess"),
            Edge("preprocess", "device", capacity=spec.run.in_flight),
            Edge("device", "optimiser"),
            Edge("device", "sink"),
        ),
    )

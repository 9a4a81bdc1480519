"""Spec types: a training job as pure data.

A spec is a tree of frozen records (model, optimiser, data, devices, pipeline, run settings) with no
behaviour beyond one pure helper, :func:`default_pipeline`: what an optimiser record means (its
learning-rate schedule, step values and state) is decided in :mod:`flow.optim`. Records hold tuples,
never lists, so a spec is hashable and compares by value; the codec tags each record by its class
name, so class and field names are part of the file format (:data:`SCHEMA_VERSION`). Constructors
never check values: :mod:`flow.validation` does, and returns every problem at once.

This module defines the job's top (:class:`Spec`), the optimisers, the devices, the pipeline and
the run settings, and lists every record (:data:`RECORDS`, which the codec reads). The model's
records are defined in :mod:`flow.spec_model` and the data's in :mod:`flow.spec_data`; their
record classes (and only those) are re-exported here, so that users import every record from one
place: ``from flow.spec import Linear, Model, Data, Digits, SGD, Spec``.

Inputs, the one convention of every source: samples arrive as float32, images channels first
(C, H, W) unless ``layout="HWC"``. 8-bit data is divided by 255, so it arrives in [0, 1]: images of
every source (16-bit greyscale from 0..65535 alike), uint8 IDX files and uint8 RawBinary records;
the bundled Digits too. Every other dtype arrives as it is stored, cast to float32 (CSV numbers as
written, int or float IDX/RawBinary records); Synthetic features are Gaussian around 0. So no source
needs ``Scale(1/255)``: on [0, 1] data it leaves inputs in [0, 1/255], and a model trains at chance
with no error. A run reports the range of its first training batch after preprocessing
(``RunResult.inputs`` and an ``"inputs"`` metrics event) and warns when it looks like this.

Every record documents its fields in its class docstring (``help(flow.spec.Scale)``): units, ranges
and defaults. Ranges are what :mod:`flow.validation` enforces.

Annotations here are real objects (no ``from __future__ import annotations``) because the codec and
the validator read them from ``dataclasses.fields``.
"""

from dataclasses import KW_ONLY, dataclass, field
from typing import Literal

from flow.spec_base import LATER, Record
from flow.spec_data import (
    CSV,
    IDX,
    Arrays,
    Custom,
    Data,
    Digits,
    HorizontalFlip,
    ImageFolder,
    Lambda,
    Normalize,
    RandomCrop,
    RawBinary,
    Resize,
    Scale,
    Split,
    Synthetic,
    Text,
)
from flow.spec_model import (
    GELU,
    L1,
    MAE,
    MSE,
    RMSE,
    Add,
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    BCEWithLogits,
    Concat,
    Conv1d,
    Conv2d,
    CrossEntropy,
    Dropout,
    Embedding,
    Flatten,
    GlobalAvgPool,
    Huber,
    Init,
    LayerNorm,
    LeakyReLU,
    Linear,
    MatMul,
    MaxPool2d,
    Model,
    Perplexity,
    PositionalEmbedding,
    ReLU,
    Repeat,
    Reshape,
    Residual,
    SelfAttention,
    Sigmoid,
    Softmax,
    Tanh,
    TopK,
)

SCHEMA_VERSION = 2
# Files of these versions still load: 2 added graph models (layers' name and inputs, Add, Concat,
# Residual, Repeat) and new layers, all absent from version 1 files.
READABLE_SCHEMAS = (1, 2)


# Optimisers and learning-rate schedules


@dataclass(frozen=True, kw_only=True)
class Constant(Record):
    """A constant learning rate (the default schedule), after an optional warmup.

    Attributes:
        warmup_steps: steps over which the rate rises linearly from 0 to ``lr``, >= 0 (default 0).
    """

    warmup_steps: int = 0


@dataclass(frozen=True)
class StepLR(Record):
    """The learning rate times ``gamma`` every ``step_size`` steps (counted after the warmup).

    Attributes:
        step_size: steps between two decays, > 0.
        gamma: the factor at each decay, > 0 (default 0.1).
        warmup_steps: as Constant's, >= 0 (default 0).
    """

    step_size: int
    _: KW_ONLY
    gamma: float = 0.1
    warmup_steps: int = 0


@dataclass(frozen=True)
class Cosine(Record):
    """Cosine decay from ``lr`` to ``min_lr``, after an optional warmup; flat at ``min_lr`` after.

    Attributes:
        total_steps: the step where the decay ends at ``min_lr``, counted from step 0 with the
            warmup included, > warmup_steps.
        min_lr: the final learning rate, in [0, lr] (default 0.0).
        warmup_steps: as Constant's, >= 0 (default 0).
    """

    total_steps: int
    _: KW_ONLY
    min_lr: float = 0.0
    warmup_steps: int = 0


Schedule = Constant | StepLR | Cosine


@dataclass(frozen=True)
class SGD(Record):
    """Stochastic gradient descent, as ``torch.optim.SGD``.

    Attributes:
        lr: the learning rate, > 0 (default 0.01). Too large a rate makes the loss non-finite,
            which stops the run (see ``RunSettings.on_nonfinite``).
        momentum: in [0, 1) (default 0.0: none).
        nesterov: Nesterov momentum; needs momentum > 0 (default False).
        weight_decay: L2 penalty added to the gradient, >= 0 (default 0.0).
        schedule: the learning-rate schedule (default ``Constant()``).
        clip_norm: clip the gradients by their global norm, > 0, as
            ``torch.nn.utils.clip_grad_norm_`` before each step (default None: no clipping).
    """

    lr: float = 0.01
    _: KW_ONLY
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    schedule: Schedule = Constant()
    clip_norm: float | None = field(default=None, metadata=LATER)


@dataclass(frozen=True)
class Adam(Record):
    """Adam, as ``torch.optim.Adam``.

    Attributes:
        lr: the learning rate, > 0 (default 1e-3).
        betas: decay rates of the first and second moment estimates, each in [0, 1)
            (default (0.9, 0.999)).
        eps: added to the denominator, > 0 (default 1e-8).
        weight_decay: L2 penalty added to the gradient, >= 0 (default 0.0); AdamW decouples it.
        schedule: the learning-rate schedule (default ``Constant()``).
        clip_norm: clip the gradients by their global norm, > 0, as
            ``torch.nn.utils.clip_grad_norm_`` before each step (default None: no clipping).
    """

    lr: float = 1e-3
    _: KW_ONLY
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: Schedule = Constant()
    clip_norm: float | None = field(default=None, metadata=LATER)


@dataclass(frozen=True)
class AdamW(Record):
    """AdamW, as ``torch.optim.AdamW``: Adam with weight decay applied to the weights directly.

    Attributes:
        lr: the learning rate, > 0 (default 1e-3).
        betas: as Adam's (default (0.9, 0.999)).
        eps: as Adam's (default 1e-8).
        weight_decay: each step multiplies the weights by ``1 - lr * weight_decay``, >= 0
            (default 0.01).
        schedule: the learning-rate schedule (default ``Constant()``).
        clip_norm: clip the gradients by their global norm, > 0, as
            ``torch.nn.utils.clip_grad_norm_`` before each step (default None: no clipping).
    """

    lr: float = 1e-3
    _: KW_ONLY
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    schedule: Schedule = Constant()
    clip_norm: float | None = field(default=None, metadata=LATER)


Optimiser = SGD | Adam | AdamW

# Devices, pipeline, run settings

@dataclass(frozen=True)
class Devices(Record):
    """Which devices run the model.

    Attributes:
        select: one device: "auto" (default: the best hardware Vulkan device, discrete >
            integrated > virtual, else the CPU backend, which also beats a software Vulkan device
            such as lavapipe; see flow.device_choice), "cpu" (the numpy backend), a Vulkan device
            index >= 0 (0: the first listed by ``flow devices``, lavapipe included), or a substring of a
            device's name. Several, trained data parallel: a list of those (a device may appear
            twice: two logical devices on one GPU), or "all" (every Vulkan device and the CPU).
        shares: with a list, the relative share of each global batch each device takes, in the
            list's order (e.g. [3, 1]); None (default): equal shares where the devices are the
            same, else shares measured from each device's throughput before the first step.
        drop_slow: leave out devices that would slow each step (their share saves less than the
            all-reduce they add costs, measured before the first step), and say so (default True);
            False, or explicit ``shares``, keeps every device.
        memory_fraction: the share of each device's memory the run may plan for, in (0, 1]
            (default 0.9).
        stages: with a list, split the model over the devices as pipeline stages instead of
            training data parallel (flow.stage_plan): "auto" places the layers greedily in order
            under each device's memory budget; a tuple gives the device (its place in the list,
            non-decreasing) of each top-level layer, e.g. (0, 0, 1, 1). None (default): data
            parallel.
        micro_batches: with stages, the micro-batches each batch is cut into (a 1F1B schedule
            runs them through the stages; their gradients are summed, then one update), in
            [1, batch size] (default 1).
        bucket_mb: data parallel: the gradients are summed in buckets of about this many MiB,
            each as soon as the backward pass has finished it, while the devices go on with the
            rest (default 4; a model smaller than that sums once, after the backward pass). Any
            size gives the same bits.
    """

    select: int | str | tuple[int | str, ...] = "auto"
    _: KW_ONLY
    shares: tuple[float, ...] | None = None
    drop_slow: bool = True
    memory_fraction: float = 0.9
    stages: Literal["auto"] | tuple[int, ...] | None = field(default=None, metadata=LATER)
    micro_batches: int = field(default=1, metadata=LATER)
    bucket_mb: float = field(default=4.0, metadata=LATER)

    @property
    def choices(self) -> tuple[int | str, ...]:
        """``select`` as a tuple of single choices (one for a single device; "all" stays one)."""
        return self.select if isinstance(self.select, tuple) else (self.select,)


NodeKind = Literal["loader", "preprocess", "device", "optimiser", "sink", "broadcast"]


@dataclass(frozen=True)
class Node(Record):
    """One actor of the pipeline.

    Attributes:
        name: unique within the pipeline, not empty.
        kind: "loader", "preprocess", "device", "optimiser", "sink" or "broadcast".
        device: the device index it runs on, >= 0; None (default): the one ``devices`` selects.
        workers: threads it may use, > 0 (default 1): the loader's read and decode workers.
    """

    name: str
    kind: NodeKind
    _: KW_ONLY
    device: int | None = None
    workers: int = 1


@dataclass(frozen=True)
class Edge(Record):
    """A bounded channel from one node to another.

    Attributes:
        src: the sending node's name.
        dst: the receiving node's name.
        capacity: messages it holds, > 0 (default 4); channels are always bounded.
        credit: a credit edge may close a cycle: its sender waits for a credit, not for space
            (default False).
    """

    src: str
    dst: str
    _: KW_ONLY
    capacity: int = 4
    credit: bool = False


@dataclass(frozen=True)
class Pipeline(Record):
    """The actors and channels of a run (default: :func:`default_pipeline`).

    Attributes:
        nodes: the actors; exactly one loader, device and sink.
        edges: the channels; at most one into each node, and no cycle without a credit edge.
    """

    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]


# Callbacks a spec file asks for (the runtime makes flow.callbacks objects of them)


@dataclass(frozen=True, kw_only=True)
class EarlyStopping(Record):
    """Stop the run when ``monitor`` has not improved for ``patience`` validation rounds in a row,
    as Keras' EarlyStopping; with a checkpoint to resume from. The record of
    ``flow.callbacks.EarlyStopping`` (which ``flow.EarlyStopping`` is).

    Attributes:
        monitor: "val_loss" (default), "val_accuracy" (a CrossEntropy loss) or "val_" and one of
            ``model.metrics``' names ("val_top5", "val_mae", "val_rmse", "val_perplexity"); the run
            needs a validation split.
        patience: rounds without improvement before stopping, >= 0 (default 3).
        mode: "min", "max", or "auto" (default: max for the accuracy and top-k, else min).
        min_delta: the least change that counts as an improvement, >= 0 (default 0.0).
    """

    monitor: str = "val_loss"
    patience: int = 3
    mode: Literal["auto", "min", "max"] = "auto"
    min_delta: float = 0.0


@dataclass(frozen=True, kw_only=True)
class SaveBest(Record):
    """Keep the weights of the best validation round as ``best.ckpt`` in ``run.checkpoint_dir``, as
    Keras' ModelCheckpoint(save_best_only=True) and Lightning's ModelCheckpoint(monitor, mode): a
    checkpoint like the others (atomic, verified), never removed by ``keep_checkpoints``; resume
    and ``flow.predict(run_dir)`` still take the newest ``step-*.ckpt`` (name ``best.ckpt`` to use
    it). Each round that improves writes it and a ``{"event": "best", "step", "monitor", "value",
    "path"}`` metrics line. A resumed run goes on comparing with the round
    ``best.ckpt`` holds (the metrics file's last "best" line).

    Attributes:
        monitor: as EarlyStopping's (default "val_loss"); needs ``run.checkpoint_dir``.
        mode: as EarlyStopping's (default "auto").
    """

    monitor: str = "val_loss"
    mode: Literal["auto", "min", "max"] = "auto"


CallbackRecord = EarlyStopping | SaveBest


@dataclass(frozen=True, kw_only=True)
class RunSettings(Record):
    """How long to train, what to write, and how to react to trouble.

    Attributes:
        epochs: passes over the training split, > 0 (default 1); None: only ``steps`` ends the run.
        steps: training steps (batches), > 0; None (default): only ``epochs`` ends the run. With
            both set the run stops at whichever comes first.
        eval_every: steps between evaluations of the validation split, > 0; None (default): after
            each epoch. Nothing is evaluated without a validation split.
        limit_val_batches: how much of the validation split each evaluation reads, as Lightning's
            ``limit_val_batches``: an int > 0 is that many batches, a float in (0, 1] that fraction
            of its batches (at least one); the first ones, in the split's order, so every round
            scores the same samples. None (default): all of it.
        checkpoint_dir: the folder checkpoints go to (the newest ``keep_checkpoints`` are kept,
            and the end of the run always writes one); None (default): no checkpoints. A run owns
            it: a fresh run refuses a folder that holds another run's checkpoints, and two live
            runs never share one (see actors.outputs).
        checkpoint_every: steps between checkpoints, > 0; needs checkpoint_dir. None (default):
            only at the end.
        metrics_file: a JSON-lines file each step, evaluation, checkpoint and warning appends an
            event to (``"inputs"``: the first training batch's range after preprocessing;
            ``"warning"``: what looks wrong); None (default): ``metrics.jsonl`` in the run's own
            folder, ``checkpoint_dir``, when there is one, else none. Each process's lines begin
            with a ``"run"`` event naming the run; a fresh run refuses a file another run began.
        keep_checkpoints: how many checkpoints to keep, the newest, > 0 (default 3); None keeps
            every one.
        metrics_every: training steps a metrics line holds, > 0. 1 (default): a ``"step"`` line
            for every step. N > 1: one ``{"event": "steps", "step": [...], "loss": [...], ...}``
            line per N steps (and before any other line), each field an array of those steps'
            values, so nothing is lost and the file has N times fewer lines
            (``flow.metrics.step_lines`` turns a line back into per-step records; ``python -m
            flow report`` reads both). A killed run loses at most the N steps' lines not yet written.
        in_flight: training steps submitted ahead of the one being waited on, > 0 (default 4: a
            deeper queue rides out the host's pauses; each step costs one more copy of the io
            tensors, the batch's inputs, labels and outputs).
        precision: "float32" (default), or "mixed": GEMMs round their inputs to float16 and run on
            tensor cores (cooperative matrices) with float32 accumulation, and so does SelfAttention
            (head sizes that are multiples of 16 up to 128; softmax in float32); weights, gradients
            and optimiser state stay float32.
        on_nonfinite: a training step whose loss is NaN or infinite (the run diverged, or the
            data holds NaN): "raise" (default) stops the run with an error naming the step;
            "continue" warns once and trains on.
        loss_scale: dynamic loss scaling, as torch.amp.GradScaler: the loss's gradient is
            multiplied by a scale kept on the device, so float16 GEMM operands keep small
            gradients; a step whose gradients overflow is skipped and halves the scale, and 2000
            good steps in a row double it. "auto" (default): on, from 65536, with "mixed"
            precision, off with "float32"; "off": never; a number > 0: on from that scale in
            either precision (a power of two changes no float32 result). The scale, its streak
            and the skipped steps are checkpointed (``loss_scale:state``).
        profile: time every launch of the training step on the GPU with timestamp queries and
            write their medians to the metrics file as one ``{"event": "profile", "launches":
            [{"name", "op", "seconds"}]}`` line at the end (``python -m flow report`` plots it);
            a single-device run on Vulkan (the CPU backend has no timestamps: the line says so).
        callbacks: EarlyStopping and SaveBest records (default none), run with the Python
            callbacks given to ``flow.run``. Two more trainer habits are plain fields above:
            ``keep_checkpoints`` (how many to keep) and ``on_nonfinite`` ("raise" ends the run at a
            NaN loss).
    """

    epochs: int | None = 1
    steps: int | None = None  # when both are set, the run stops at whichever comes first
    eval_every: int | None = None  # in steps; None: after each epoch
    # Batches, or a fraction of them; None: all. Left out of files at its default (spec_base.LATER).
    limit_val_batches: int | float | None = field(default=None, metadata=LATER)
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # in steps
    metrics_file: str | None = None
    # Steps a metrics line holds: 1 writes a "step" line each; N > 1 one "steps" line per N steps,
    # each field an array of the steps' values. Left out of files at its default (spec_base.LATER).
    metrics_every: int = field(default=1, metadata=LATER)
    # Training steps submitted ahead of the one being waited on. 4, not 2: on an H100 the small MLP
    # ran 1-13 % faster at 4 in each of 5 paired sets of 5 runs (bench/RESULTS.md, session 13).
    in_flight: int = 4
    keep_checkpoints: int | None = 3  # the newest; None keeps every one
    # "mixed": GEMMs round their inputs to float16 and run on tensor cores (cooperative matrices)
    # with float32 accumulation; weights, gradients and optimiser state stay float32.
    precision: Literal["float32", "mixed"] = "float32"
    on_nonfinite: Literal["raise", "continue"] = "raise"
    loss_scale: Literal["auto", "off"] | float = field(default="auto", metadata=LATER)
    profile: bool = field(default=False, metadata=LATER)
    callbacks: tuple[CallbackRecord, ...] = field(default=(), metadata=LATER)


@dataclass(frozen=True, kw_only=True)
class Spec(Record):
    """A whole training job: validate with ``flow.validate``, run with ``flow.run``.

    Attributes:
        model: the network and its loss.
        optimiser: SGD, Adam or AdamW.
        data: the source, batching, split and transforms.
        devices: which device (default ``Devices()``: the best available).
        pipeline: the actors and channels; None (default): ``default_pipeline(spec)``.
        run: how long to train and what to write (default ``RunSettings()``: one epoch).
        version: the schema version (``SCHEMA_VERSION``; ``schema`` in files).
    """

    model: Model
    optimiser: Optimiser
    data: Data
    devices: Devices = Devices()
    pipeline: Pipeline | None = None  # None: default_pipeline(spec)
    run: RunSettings = RunSettings()
    version: int = SCHEMA_VERSION


RECORDS: tuple[type, ...] = (
    Linear, Conv2d, MaxPool2d, AvgPool2d, GlobalAvgPool, BatchNorm1d, BatchNorm2d, LayerNorm,
    Dropout, Embedding, PositionalEmbedding, SelfAttention, Flatten, ReLU, LeakyReLU, Sigmoid, Tanh,
    GELU, Softmax, Add, Concat, Residual, Repeat, Reshape, Conv1d, MatMul,
    CrossEntropy, MSE, L1, Huber, BCEWithLogits, TopK, MAE, RMSE, Perplexity, Init, Model,
    Constant, StepLR, Cosine, SGD, Adam, AdamW,
    ImageFolder, CSV, RawBinary, IDX, Synthetic, Digits, Arrays, Text, Custom,
    Normalize, Scale, RandomCrop, HorizontalFlip, Resize, Lambda,
    Split, Data, Devices, Node, Edge, Pipeline, EarlyStopping, SaveBest, RunSettings, Spec,
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


# What ``help(flow.spec)`` documents and ``import *`` takes: this module's names and every record,
# the model's and the data's included.
__all__ = [
    "CallbackRecord", "FILE_KEYS", "RECORDS", "SCHEMA_VERSION", "NodeKind", "Optimiser", "Schedule",
    "default_pipeline", "file_key", *(record.__name__ for record in RECORDS),
]  # fmt: skip

"""Spec types: a training job as pure data.

A spec is a tree of frozen records (model, optimiser, data, devices, pipeline, run settings) with no
behaviour beyond one pure helper, :func:`default_pipeline`: what an optimiser record means (its
learning-rate schedule, step values and state) is decided in :mod:`flow.optim`. Records hold tuples,
never lists, so a spec is hashable and compares by value; the codec tags each record by its class
name, so class and field names are part of the file format (:data:`SCHEMA_VERSION`). Constructors
never check values: :mod:`flow.validation` does, and returns every problem at once.

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

from dataclasses import KW_ONLY, dataclass, fields
from typing import Literal

SCHEMA_VERSION = 1

Shape = tuple[int, ...]
Activation = Literal["relu", "leaky_relu", "sigmoid", "tanh", "gelu"]
# The element types a raw source file may hold; device tensors hold fewer (flow.program.TensorDType).
SourceDType = Literal["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64"]
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
    """A dense layer on a flat input: ``y = act(x @ W + b)``, with W [in, units].

    Attributes:
        units: outputs per sample, > 0.
        bias: whether the layer adds a learned bias b [units] (default True).
        activation: applied to the output, fused into the layer's kernel: "relu", "leaky_relu"
            (slope 0.01), "sigmoid", "tanh", "gelu" (exact, erf-based), or None (default) for none.
    """

    units: int
    _: KW_ONLY
    bias: bool = True
    activation: Activation | None = None


@dataclass(frozen=True)
class Conv2d(_Record):
    """A 2-D convolution over (C, H, W) inputs with square kernels; output (channels, OH, OW) with
    ``OH = (H + 2 * padding - kernel) // stride + 1`` (OW alike).

    Attributes:
        channels: output channels, > 0.
        kernel: kernel height and width in pixels, > 0.
        stride: step between windows in pixels, > 0 (default 1).
        padding: zeros added on each side in pixels, >= 0 (default 0).
        bias: whether a learned bias per output channel is added (default True).
        activation: as Linear's, fused into the convolution (default None).
    """

    channels: int
    kernel: int
    _: KW_ONLY
    stride: int = 1
    padding: int = 0
    bias: bool = True
    activation: Activation | None = None


@dataclass(frozen=True)
class MaxPool2d(_Record):
    """The maximum of each square window of a (C, H, W) input, per channel, without padding. NaN
    counts above every number, so a window holding NaN gives NaN.

    Attributes:
        kernel: window height and width in pixels, > 0.
        stride: step between windows in pixels, > 0; None (default) is the same as kernel
            (non-overlapping windows).
    """

    kernel: int
    _: KW_ONLY
    stride: int | None = None


@dataclass(frozen=True)
class Flatten(_Record):
    """Reshapes each sample to one dimension (C * H * W values, row-major), as Linear needs."""


@dataclass(frozen=True)
class ReLU(_Record):
    """``max(x, 0)`` elementwise, as a layer of its own (Linear and Conv2d can fuse it instead).
    NaN gives NaN on every backend, as in numpy and PyTorch."""


@dataclass(frozen=True)
class LeakyReLU(_Record):
    """``x`` where x > 0, else ``slope * x``, elementwise. NaN gives NaN.

    Attributes:
        slope: the factor for negative inputs (default 0.01).
    """

    slope: float = 0.01


@dataclass(frozen=True)
class Sigmoid(_Record):
    """``1 / (1 + exp(-x))`` elementwise, in (0, 1). NaN gives NaN."""


@dataclass(frozen=True)
class Tanh(_Record):
    """``tanh(x)`` elementwise, in (-1, 1). NaN gives NaN."""


@dataclass(frozen=True)
class GELU(_Record):
    """``x * Phi(x)`` elementwise, Phi the standard normal CDF (exact, erf-based; not the tanh
    approximation). NaN gives NaN."""


@dataclass(frozen=True)
class Softmax(_Record):
    """Softmax over a flat sample: outputs in [0, 1] that sum to 1. Not before CrossEntropy, which
    applies softmax itself; a row holding NaN gives NaN everywhere."""


Layer = Linear | Conv2d | MaxPool2d | Flatten | ReLU | LeakyReLU | Sigmoid | Tanh | GELU | Softmax

# Losses and the model


@dataclass(frozen=True)
class CrossEntropy(_Record):
    """Mean cross-entropy over the batch, for integer class labels 0..classes-1; softmax is fused
    into the loss, so the model ends in raw logits (a Linear with one unit per class, >= 2).

    A model that guesses uniformly scores ``ln(classes)`` (2.3026 for 10 classes): a run warns when
    a whole epoch's mean training loss stays within 1% of that. Predictions are probabilities.
    """


@dataclass(frozen=True)
class MSE(_Record):
    """Mean squared error over the batch and the outputs, for float targets shaped like the model's
    output. Predictions are the raw outputs."""


Loss = CrossEntropy | MSE


@dataclass(frozen=True, kw_only=True)
class Init(_Record):
    """How fresh weights are drawn; biases always start at 0.

    Attributes:
        scheme: "he" (default): normal with std ``sqrt(2 / fan_in)``, for relu-like activations;
            "xavier": uniform in ``+-sqrt(6 / (fan_in + fan_out))``, for tanh and sigmoid.
        seed: the generator's seed, >= 0 (default 0): the same seed gives the same weights.
    """

    scheme: Literal["he", "xavier"] = "he"
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class Model(_Record):
    """The network: its input shape, its layers in order and its loss.

    Attributes:
        input_shape: one sample's shape without the batch dimension, every size > 0: (64,) for a
            vector, (C, H, W) for images. It must equal the source's sample shape after
            ``data.preprocess``.
        layers: the layers, in order; each must accept the previous one's output shape.
        loss: CrossEntropy() or MSE(); None only for a model used to predict (training needs one).
        input_dtype: what the inputs are declared as: "float32" (default), "float16" or "uint8".
            It is recorded and shown in summaries; every backend takes float32 inputs today, with
            the values of the module's input convention.
        init: how fresh weights are drawn (default ``Init()``: He, seed 0).
    """

    input_shape: Shape
    layers: tuple[Layer, ...]
    loss: Loss | None
    input_dtype: Literal["float32", "float16", "uint8"] = "float32"
    init: Init = Init()


# Optimisers and learning-rate schedules


@dataclass(frozen=True, kw_only=True)
class Constant(_Record):
    """A constant learning rate (the default schedule), after an optional warmup.

    Attributes:
        warmup_steps: steps over which the rate rises linearly from 0 to ``lr``, >= 0 (default 0).
    """

    warmup_steps: int = 0


@dataclass(frozen=True)
class StepLR(_Record):
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
class Cosine(_Record):
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
class SGD(_Record):
    """Stochastic gradient descent, as ``torch.optim.SGD``.

    Attributes:
        lr: the learning rate, > 0 (default 0.01). Too large a rate makes the loss non-finite,
            which stops the run (see ``RunSettings.on_nonfinite``).
        momentum: in [0, 1) (default 0.0: none).
        nesterov: Nesterov momentum; needs momentum > 0 (default False).
        weight_decay: L2 penalty added to the gradient, >= 0 (default 0.0).
        schedule: the learning-rate schedule (default ``Constant()``).
    """

    lr: float = 0.01
    _: KW_ONLY
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    schedule: Schedule = Constant()


@dataclass(frozen=True)
class Adam(_Record):
    """Adam, as ``torch.optim.Adam``.

    Attributes:
        lr: the learning rate, > 0 (default 1e-3).
        betas: decay rates of the first and second moment estimates, each in [0, 1)
            (default (0.9, 0.999)).
        eps: added to the denominator, > 0 (default 1e-8).
        weight_decay: L2 penalty added to the gradient, >= 0 (default 0.0); AdamW decouples it.
        schedule: the learning-rate schedule (default ``Constant()``).
    """

    lr: float = 1e-3
    _: KW_ONLY
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: Schedule = Constant()


@dataclass(frozen=True)
class AdamW(_Record):
    """AdamW, as ``torch.optim.AdamW``: Adam with weight decay applied to the weights directly.

    Attributes:
        lr: the learning rate, > 0 (default 1e-3).
        betas: as Adam's (default (0.9, 0.999)).
        eps: as Adam's (default 1e-8).
        weight_decay: each step multiplies the weights by ``1 - lr * weight_decay``, >= 0
            (default 0.01).
        schedule: the learning-rate schedule (default ``Constant()``).
    """

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
    """Image files (PNG, JPEG, BMP, GIF, WebP) under a folder. Samples are float32 in [0, 1]
    (8-bit pixels / 255, 16-bit greyscale / 65535): never add ``Scale(1/255)``.

    Attributes:
        root: the folder.
        size: (height, width) in pixels each image is scaled to cover and centre-cropped to, every
            size > 0; None (default) keeps each file's own size, which must then be the same.
        mode: "L" (default, 1 grey channel), "RGB" (3) or "RGBA" (4).
        layout: "CHW" (default, what Conv2d takes) or "HWC".
        labels_csv: a ``filename,label`` CSV for a flat folder, filenames relative to root,
            labels integers or class names (sorted into ids); None (default): the label is the
            image's sub-folder, the sorted sub-folder names being classes 0..k-1.
        workers: decoding threads, > 0 (default 2).
        on_error: a file that cannot be decoded: "raise" (default) stops the run; "skip" leaves
            it out with a warning and counts it.
    """

    root: str
    _: KW_ONLY
    size: tuple[int, int] | None = None
    mode: Literal["L", "RGB", "RGBA"] = "L"
    layout: Literal["CHW", "HWC"] = "CHW"
    labels_csv: str | None = None
    workers: int = 2
    on_error: OnError = "raise"


@dataclass(frozen=True)
class CSV(_Record):
    """Rows of a CSV file (UTF-8, comma-separated): float32 features, as written (unscaled).

    The label column holds integer class ids or class names (classification) or other numbers
    (regression targets), judged from the first label.

    Attributes:
        path: the file.
        label_column: the label's column, by name (needs ``header``) or index >= 0.
        feature_columns: the features' columns in order, by name or index; None (default): every
            column but the label.
        header: whether the first row names the columns (default True).
        chunk_rows: rows parsed at a time, > 0 (default 4096); bounds a read's extra memory.
        on_error: a row that does not parse: "raise" (default) or "skip" (left out, counted).
    """

    path: str
    _: KW_ONLY
    label_column: str | int
    feature_columns: tuple[str | int, ...] | None = None
    header: bool = True
    chunk_rows: int = 4096
    on_error: OnError = "raise"


@dataclass(frozen=True)
class RawBinary(_Record):
    """Fixed-size records back to back in a raw file, mapped rather than read. uint8 records are
    divided by 255 (samples in [0, 1], as images); other dtypes are cast to float32 unscaled.

    Attributes:
        path: the records file; its size must be a whole number of records.
        dtype: one value's type: "uint8", "int8", "uint16", "int16", "int32", "int64", "float16",
            "float32" or "float64" (native byte order).
        shape: one sample's shape, every size > 0.
        labels_path: a raw file (or ``.npy``) of one label per record; None (default): unlabelled,
            for prediction only.
        label_dtype: the raw labels' type (default "int32"); integers are class ids, floats
            regression targets.
        on_error: a bad record (NaN or infinity, or a partial record at the end): "raise"
            (default) or "skip" (left out, counted).
    """

    path: str
    _: KW_ONLY
    dtype: SourceDType
    shape: Shape
    labels_path: str | None = None
    label_dtype: SourceDType = "int32"
    on_error: OnError = "raise"


@dataclass(frozen=True)
class IDX(_Record):
    """An IDX images file and an IDX labels file (the MNIST format; ``.gz`` allowed). uint8 images
    are divided by 255 (samples in [0, 1]); other types are cast to float32 unscaled. 3-D images
    (n, H, W) become (1, H, W) samples.

    Attributes:
        images: the samples' file (n, ...).
        labels: the labels' file (n,), integer class ids.
    """

    images: str
    labels: str


@dataclass(frozen=True, kw_only=True)
class Synthetic(_Record):
    """Generated data with a known answer, needing no files; sample i is a pure function of
    (seed, i). Classification: balanced classes, each a Gaussian blob (noise std 0.5) around a
    standard-normal centre; regression: a standard-normal target y and ``x = y * direction +
    noise``. Features are float32 around 0 (no fixed range; do not scale them).

    Attributes:
        task: "classification" (default) or "regression".
        samples: how many, > 0.
        features: one sample's shape, every size > 0.
        classes: classes for classification, >= 2 (default 10).
        seed: the data's seed, >= 0 (default 0).
    """

    task: Literal["classification", "regression"] = "classification"
    samples: int
    features: Shape
    classes: int = 10
    seed: int = 0


@dataclass(frozen=True)
class Digits(_Record):
    """The bundled 8x8 grey handwritten-digit set (UCI, 1797 images): (1, 8, 8) samples in [0, 1]
    read through the image-folder loader, 10 classes. Needs no preprocessing."""


Source = ImageFolder | CSV | RawBinary | IDX | Synthetic | Digits

# Preprocessing and augmentation


@dataclass(frozen=True)
class Normalize(_Record):
    """``(x - mean) / std`` per channel (axis 1 of the batch: the C of (C, H, W), or each feature
    of a flat sample). Sources give [0, 1] for 8-bit data, so take mean and std in those units
    (e.g. MNIST: mean (0.1307,), std (0.3081,)), not 0..255.

    Attributes:
        mean: one value for every channel, or one per channel.
        std: as many values as mean, each > 0.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass(frozen=True)
class Scale(_Record):
    """Multiply every input value by ``factor``.

    Sources already give 8-bit data (ImageFolder, Digits, uint8 IDX and RawBinary) as floats in
    [0, 1], so raw bytes need no ``Scale(1/255)``: on such data it leaves inputs in [0, 1/255] and
    the model trains at chance. The run warns when the inputs after preprocessing look like that.
    Use Scale for data of other units, e.g. ``Scale(1/1000)`` for millimetres as metres.

    Attributes:
        factor: the multiplier.
    """

    factor: float


@dataclass(frozen=True)
class RandomCrop(_Record):
    """A random (height, width) window of each (C, H, W) sample, after zero padding; an
    augmentation (put it in ``data.augment``). Draws are seeded by the batch's place in the run.

    Attributes:
        size: (height, width) of the crop in pixels, every size > 0.
        padding: zeros added on each side first, in pixels, >= 0 (default 0).
    """

    size: tuple[int, int]
    _: KW_ONLY
    padding: int = 0


@dataclass(frozen=True)
class HorizontalFlip(_Record):
    """Mirror each (C, H, W) sample left to right at random; an augmentation.

    Attributes:
        p: each sample's probability of being flipped, in [0, 1] (default 0.5).
    """

    p: float = 0.5


@dataclass(frozen=True)
class Resize(_Record):
    """Resize each (C, H, W) sample bilinearly (antialiased when shrinking); values keep their range.

    Attributes:
        size: (height, width) in pixels, every size > 0.
    """

    size: tuple[int, int]


Transform = Normalize | Scale | RandomCrop | HorizontalFlip | Resize

# Data, devices, pipeline, run settings


@dataclass(frozen=True, kw_only=True)
class Split(_Record):
    """How the source's samples divide into training, validation and test sets (fractions that
    sum to 1, drawn with ``data.seed``).

    Attributes:
        train: the training fraction, in (0, 1] (default 1.0).
        val: the validation fraction, in [0, 1] (default 0.0): evaluated every ``run.eval_every``
            steps or after each epoch.
        test: the test fraction, in [0, 1] (default 0.0): held out from training and validation,
            scored once after the last step (``RunResult.test``).
        stratify: keep each class's share the same in every part (default False).
    """

    train: float = 1.0
    val: float = 0.0
    test: float = 0.0
    stratify: bool = False


@dataclass(frozen=True)
class Data(_Record):
    """Where the samples come from and how they are batched.

    Attributes:
        source: ImageFolder, CSV, RawBinary, IDX, Synthetic or Digits; each gives float32 samples
            by the module's convention (8-bit data in [0, 1]).
        batch_size: samples per batch, > 0 (default 64).
        shuffle: reshuffle the training samples each epoch (default True).
        seed: seeds the split, the shuffles and the augmentations, >= 0 (default 0).
        split: training, validation and test fractions (default ``Split()``: all training).
        drop_last: leave out each epoch's last, partial training batch (default False).
        preprocess: transforms applied in order to every batch (default none).
        augment: transforms applied after ``preprocess`` to training batches only (default none).
    """

    source: Source
    _: KW_ONLY
    batch_size: int = 64
    shuffle: bool = True
    seed: int = 0
    split: Split = Split()
    drop_last: bool = False
    preprocess: tuple[Transform, ...] = ()
    augment: tuple[Transform, ...] = ()


@dataclass(frozen=True)
class Devices(_Record):
    """Which device runs the model.

    Attributes:
        select: "auto" (default: the best Vulkan device, else the CPU with a warning), "cpu" (the
            numpy backend), a Vulkan device index >= 0, or a substring of a device's name.
        memory_fraction: the share of the device's memory the run may plan for, in (0, 1]
            (default 0.9).
    """

    select: int | str = "auto"
    _: KW_ONLY
    memory_fraction: float = 0.9


NodeKind = Literal["loader", "preprocess", "device", "optimiser", "sink", "broadcast"]


@dataclass(frozen=True)
class Node(_Record):
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
class Edge(_Record):
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
class Pipeline(_Record):
    """The actors and channels of a run (default: :func:`default_pipeline`).

    Attributes:
        nodes: the actors; exactly one loader, device and sink.
        edges: the channels; at most one into each node, and no cycle without a credit edge.
    """

    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]


@dataclass(frozen=True, kw_only=True)
class RunSettings(_Record):
    """How long to train, what to write, and how to react to trouble.

    Attributes:
        epochs: passes over the training split, > 0 (default 1); None: only ``steps`` ends the run.
        steps: training steps (batches), > 0; None (default): only ``epochs`` ends the run. With
            both set the run stops at whichever comes first.
        eval_every: steps between evaluations of the validation split, > 0; None (default): after
            each epoch. Nothing is evaluated without a validation split.
        checkpoint_dir: the folder checkpoints go to (the newest ``keep_checkpoints`` are kept,
            and the end of the run always writes one); None (default): no checkpoints. A run owns
            it: a fresh run refuses a folder that holds another run's checkpoints, and two live
            runs never share one (see actors.outputs).
        checkpoint_every: steps between checkpoints, > 0; needs checkpoint_dir. None (default):
            only at the end.
        metrics_file: a JSON-lines file each step, evaluation, checkpoint and warning appends an
            event to (``"inputs"``: the first training batch's range after preprocessing;
            ``"warning"``: what looks wrong); None (default): none. Each process's lines begin
            with a ``"run"`` event naming the run; a fresh run refuses a file another run began.
        keep_checkpoints: how many checkpoints to keep, the newest, > 0 (default 3); None keeps
            every one.
        in_flight: training steps submitted ahead of the one being waited on, > 0 (default 2).
        precision: "float32" (default), or "mixed": GEMMs round their inputs to float16 and run on
            tensor cores (cooperative matrices) with float32 accumulation; weights, gradients and
            optimiser state stay float32.
        on_nonfinite: a training step whose loss is NaN or infinite (the run diverged, or the
            data holds NaN): "raise" (default) stops the run with an error naming the step;
            "continue" warns once and trains on.
    """

    epochs: int | None = 1
    steps: int | None = None  # when both are set, the run stops at whichever comes first
    eval_every: int | None = None  # in steps; None: after each epoch
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # in steps
    metrics_file: str | None = None
    in_flight: int = 2  # training steps submitted ahead of the one being waited on
    keep_checkpoints: int | None = 3  # the newest; None keeps every one
    # "mixed": GEMMs round their inputs to float16 and run on tensor cores (cooperative matrices)
    # with float32 accumulation; weights, gradients and optimiser state stay float32.
    precision: Literal["float32", "mixed"] = "float32"
    on_nonfinite: Literal["raise", "continue"] = "raise"


@dataclass(frozen=True, kw_only=True)
class Spec(_Record):
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

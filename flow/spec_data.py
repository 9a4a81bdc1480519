"""The data's records: the sources, the transforms (preprocessing and augmentation), the split and
:class:`Data`, which says where samples come from and how they are batched. Every source follows
the input convention in :mod:`flow.spec`'s docstring, which re-exports these records for users;
annotations are real objects (no ``from __future__ import annotations``) because the codec and the
validator read them from ``dataclasses.fields``.
"""

import sys
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal

from flow.spec_base import Record, Shape

# The element types a raw source file may hold; device tensors hold fewer (flow.program.TensorDType).
SourceDType = Literal["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64"]
OnError = Literal["raise", "skip"]

# Sources


@dataclass(frozen=True)
class ImageFolder(Record):
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
        cache: "auto" (default): the folder is decoded once, when opened, into a cache of 8-bit
            pixels in the user cache (kept while no file changes; up to 2 GiB of pixels), read
            afterwards like IDX, and kept on the device where ``data.placement`` allows.
            "off": every epoch decodes the files.
    """

    root: str
    _: KW_ONLY
    size: tuple[int, int] | None = None
    mode: Literal["L", "RGB", "RGBA"] = "L"
    layout: Literal["CHW", "HWC"] = "CHW"
    labels_csv: str | None = None
    workers: int = 2
    on_error: OnError = "raise"
    cache: Literal["auto", "off"] = "auto"


@dataclass(frozen=True)
class CSV(Record):
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
class RawBinary(Record):
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
class IDX(Record):
    """An IDX images file and an IDX labels file (the MNIST format; ``.gz`` allowed, decompressed once
    into the user cache and read from there by later runs: loaders.read_idx). uint8 images
    are divided by 255 (samples in [0, 1]); other types are cast to float32 unscaled. 3-D images
    (n, H, W) become (1, H, W) samples.

    Attributes:
        images: the samples' file (n, ...).
        labels: the labels' file (n,), integer class ids.
    """

    images: str
    labels: str


@dataclass(frozen=True, kw_only=True)
class Synthetic(Record):
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
class Digits(Record):
    """The bundled 8x8 grey handwritten-digit set (UCI, 1797 images): (1, 8, 8) samples in [0, 1]
    read through the image-folder loader, 10 classes. Needs no preprocessing."""


class _ArrayType(type):
    def __instancecheck__(cls, value: Any) -> bool:
        numpy = sys.modules.get("numpy")  # a numpy array exists only once numpy is loaded
        return numpy is not None and isinstance(value, numpy.ndarray)


class NDArray(metaclass=_ArrayType):
    """A numpy array, as a field's type: checked without importing numpy, so specs stay light."""


@dataclass(frozen=True, eq=False)
class Arrays(Record):
    """Samples in numpy arrays: in memory (``Arrays(x, y)``, for a run from Python) or in files a
    saved spec refers to: ``Arrays(path="data.npz")`` (arrays named x and y) or
    ``Arrays(x="x.npy", y="y.npy")`` (mapped, not read). A spec holding arrays in memory cannot be
    saved: write them with ``np.savez("data.npz", x=x, y=y)`` and use the file form. uint8 x is
    divided by 255 (samples in [0, 1]); other real dtypes are cast to float32 unscaled.

    Attributes:
        x: the samples [n, *sample_shape], real and finite, or a ``.npy`` file of them; None with path.
        y: [n] integer class ids >= 0 or [n, k] float targets, or a ``.npy`` file; None with path.
        path: a ``.npz`` file of arrays x and y; None (default) when x and y are given.
    """

    x: NDArray | str | None = None
    y: NDArray | str | None = None
    _: KW_ONLY
    path: str | None = None

    def _key(self) -> tuple:
        # numpy's == is elementwise, so arrays are the same only when they are the same object.
        return tuple(v if v is None or isinstance(v, str) else id(v) for v in (self.x, self.y, self.path))

    def __eq__(self, other: object) -> bool:
        return type(other) is Arrays and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclass(frozen=True)
class Text(Record):
    """A UTF-8 text file for a language model, as windows of token ids (loaders.text). Sample i
    starts at token ``i * stride``: x is the ``context`` ids from there, float32 of shape
    (context,), what an Embedding takes; its label y is the next token at each position, int32
    class ids of shape (context,). The vocabulary is built from the file and saved in every
    checkpoint (``actors.checkpoint.read_vocabulary``); ``loaders.text.encode``/``decode`` map
    text and ids. Splits are contiguous, in file order (train, then val, then test), never
    shuffled: neighbouring windows share text, so the windows that would reach across a
    boundary are left out. ``data.split.stratify`` does not apply.

    Attributes:
        path: the file; not empty, and at least context + 1 tokens long. ``stdlib:`` names a file
            of Python's standard library: ``stdlib:pydoc_data/topics.py`` is 0.5 MB of English in
            every Python install, which the examples use.
        level: "char" (default): the tokens are characters, the vocabulary the file's distinct
            characters in code-point order, so the file must be valid UTF-8. "byte": the tokens
            are the file's bytes, the vocabulary all 256 byte values.
        context: tokens in a window, > 0 (default 128).
        stride: tokens between two windows' starts, > 0 (default 1). 1, as nanoGPT's random
            offsets: a shuffled epoch visits every start once, so it sees each token about
            ``context`` times; bound a run with ``run.steps``, and expect an evaluation to read
            ``context`` times its split's text. ``stride=context``: windows side by side, an
            epoch is one pass over the text.
    """

    path: str
    _: KW_ONLY
    level: Literal["char", "byte"] = "char"
    context: int = 128
    stride: int = 1


class _ReadableType(type):
    def __instancecheck__(cls, value: Any) -> bool:
        return hasattr(type(value), "__len__") and callable(getattr(value, "read", None))


class Readable(metaclass=_ReadableType):
    """Any object with ``__len__`` and ``read(indices)``, as a field's type (see :class:`Custom`)."""

    described = "an object with __len__ and read(indices)"


class _FunctionType(type):
    def __instancecheck__(cls, value: Any) -> bool:
        return callable(value) and not isinstance(value, Record | type)


class Function(metaclass=_FunctionType):
    """A Python callable, as a field's type (see :class:`Lambda`)."""

    described = "a function"


@dataclass(frozen=True, eq=False)
class Custom(Record):
    """Samples from a Python object, for a run from Python: ``Custom(obj)``, where ``len(obj)`` is
    the number of samples and ``obj.read(indices) -> (x, y)`` gives the samples at a sequence of
    indices (any order, repeats allowed): x ``[len(indices), *sample_shape]`` of real numbers (uint8
    divided by 255, others cast to float32) and y ``[len(indices)]`` integer class ids >= 0 or
    ``[len(indices), k]`` float targets. ``obj.labels`` (an array or a method), when there, gives
    every label at once; else they are read once when the run opens the source. Reads run in a
    worker thread. A spec holding one cannot be saved (nor write checkpoints, which embed it):
    write the data to files for that (``np.savez`` and ``Arrays(path=...)``).

    Attributes:
        source: the object.
        name: what messages call it (default "custom").
    """

    source: Readable
    _: KW_ONLY
    name: str = "custom"

    def __eq__(self, other: object) -> bool:  # the object is the same only when it is the same object
        return type(other) is Custom and (id(self.source), self.name) == (id(other.source), other.name)

    def __hash__(self) -> int:
        return hash((id(self.source), self.name))


Source = ImageFolder | CSV | RawBinary | IDX | Synthetic | Digits | Arrays | Text | Custom

# Preprocessing and augmentation


@dataclass(frozen=True)
class Normalize(Record):
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
class Scale(Record):
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
class RandomCrop(Record):
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
class HorizontalFlip(Record):
    """Mirror each (C, H, W) sample left to right at random; an augmentation.

    Attributes:
        p: each sample's probability of being flipped, in [0, 1] (default 0.5).
    """

    p: float = 0.5


@dataclass(frozen=True)
class Resize(Record):
    """Resize each (C, H, W) sample bilinearly (antialiased when shrinking); values keep their range.

    Attributes:
        size: (height, width) in pixels, every size > 0.
    """

    size: tuple[int, int]


@dataclass(frozen=True, eq=False)
class Lambda(Record):
    """A transform from a Python function, for a run from Python: ``fn(x)`` takes a float32 batch
    ``[n, *sample_shape]`` and returns n samples of real numbers (cast to float32), of any shape the
    model takes. In ``data.preprocess`` it runs on every batch (so the data streams from the host);
    in ``data.augment`` on training batches only. With ``random=True`` it is called ``fn(x, rng)``
    with the batch's numpy Generator, seeded from ``data.seed`` and the batch's place, so a resumed
    run draws what an uninterrupted one would. A spec holding one cannot be saved.

    Attributes:
        fn: the function.
        random: pass the batch's generator as a second argument (default False).
        name: what messages call it (default "lambda").
    """

    fn: Function
    _: KW_ONLY
    random: bool = False
    name: str = "lambda"

    def __eq__(self, other: object) -> bool:
        if type(other) is not Lambda:
            return False
        return (self.fn, self.random, self.name) == (other.fn, other.random, other.name)

    def __hash__(self) -> int:
        return hash((self.random, self.name))  # functions compare by identity, bound methods not


Transform = Normalize | Scale | RandomCrop | HorizontalFlip | Resize | Lambda

# The split and the data


@dataclass(frozen=True, kw_only=True)
class Split(Record):
    """How the source's samples divide into training, validation and test sets (fractions that
    sum to 1, drawn with ``data.seed``). A Text source's parts are contiguous runs of its file
    instead, in order (see Text).

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
class Data(Record):
    """Where the samples come from and how they are batched.

    Attributes:
        source: ImageFolder, CSV, RawBinary, IDX, Synthetic, Digits, Arrays, Text or Custom; each gives
            float32 samples by the module's convention (8-bit data in [0, 1]).
        batch_size: samples per batch, > 0 (default 64).
        shuffle: reshuffle the training samples each epoch (default True). "blocks": for data
            larger than memory, an order read by blocks: the samples cut into blocks of
            32 MiB of stored samples, the blocks reshuffled each epoch and the samples shuffled
            within windows of 4 blocks, so a batch mixes blocks while the file is read block by
            block. A memory-mapped source (IDX, RawBinary) streamed from the host is then read a
            window ahead by a background thread, contiguously; ``flow plan`` shows it.
        seed: seeds the split, the shuffles and the augmentations, >= 0 (default 0).
        split: training, validation and test fractions (default ``Split()``: all training).
        drop_last: leave out each epoch's last, partial training batch (default False).
        preprocess: transforms applied in order to every batch (default none).
        augment: transforms applied after ``preprocess`` to training batches only (default none).
        placement: where the samples live during training. "auto" (default): on the device when
            the source can hand over its whole data as stored (IDX, raw binary, Arrays, Synthetic
            classification, an ImageFolder with its cache and no bad file), every transform is a
            Scale or Normalize (they are fused into the step's first launch), there is no
            augmentation, the loss is CrossEntropy and it fits the device's memory budget beside
            the model; else streamed from the host. "device": require it (a plan error says why
            not). "host": always stream. ``flow plan`` shows the choice.
    """

    source: Source
    _: KW_ONLY
    batch_size: int = 64
    shuffle: bool | Literal["blocks"] = True
    seed: int = 0
    split: Split = Split()
    drop_last: bool = False
    preprocess: tuple[Transform, ...] = ()
    augment: tuple[Transform, ...] = ()
    placement: Literal["auto", "device", "host"] = "auto"

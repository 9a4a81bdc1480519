"""The model's records: its layers, its loss, how fresh weights are drawn (:class:`Init`) and the
:class:`Model` that holds them. Frozen data like every spec record (see :mod:`flow.spec`, which
re-exports these for users); annotations are real objects (no ``from __future__ import
annotations``) because the codec and the validator read them from ``dataclasses.fields``.
"""

from dataclasses import KW_ONLY, dataclass, field
from typing import Literal

from flow.spec_base import LATER, Record, Shape

Activation = Literal["relu", "leaky_relu", "sigmoid", "tanh", "gelu"]


# Layers


@dataclass(frozen=True)
class LayerRecord(Record):
    """What every layer has besides its own fields: where its input comes from.

    A model is a sequence by default: each layer reads the output of the layer before it (the
    first reads the model's input). Naming layers makes it a graph (a DAG): any layer may read
    named earlier layers instead, and :class:`Add` and :class:`Concat` join branches.

    Attributes:
        name: how later layers refer to this one's output (default None: unnamed). Names are
            unique within their block (a model, a :class:`Residual` or one repetition of a
            :class:`Repeat`, which can also read names outside it); ``"input"`` is the model's
            input and cannot be taken.
        inputs: the names of the layers whose outputs this one reads, in order (default None: the
            previous layer's). Add and Concat read two or more; every other layer exactly one.
    """

    _: KW_ONLY
    name: str | None = field(default=None, metadata=LATER)
    inputs: tuple[str, ...] | None = field(default=None, metadata=LATER)


@dataclass(frozen=True)
class Linear(LayerRecord):
    """A dense layer: ``y = act(x @ W + b)``, with W [in, units], on a flat (in,) input or on
    each position of a (positions, in) one (a transformer's tokens), as PyTorch's Linear.

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
class _Convolution(LayerRecord):
    """The fields Conv2d and Conv1d share (each documents them for its own shape)."""

    channels: int
    kernel: int
    _: KW_ONLY
    stride: int = 1
    padding: int = 0
    bias: bool = True
    activation: Activation | None = None


@dataclass(frozen=True)
class Conv2d(_Convolution):
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


@dataclass(frozen=True)
class Conv1d(_Convolution):
    """A 1-D convolution over (C, L) inputs, as PyTorch's ``Conv1d(C, channels, kernel)``
    (weights [channels, C, kernel]); output (channels, OL) with
    ``OL = (L + 2 * padding - kernel) // stride + 1``. Its fields are Conv2d's; it runs on Conv2d's
    kernels, as a convolution of height 1.

    Attributes:
        channels: output channels, > 0.
        kernel: kernel length, > 0.
        stride: step between windows, > 0 (default 1).
        padding: zeros added on each end, >= 0 (default 0).
        bias: whether a learned bias per output channel is added (default True).
        activation: as Linear's, fused into the convolution (default None).
    """


@dataclass(frozen=True)
class MaxPool2d(LayerRecord):
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
class AvgPool2d(LayerRecord):
    """The mean of each square window of a (C, H, W) input, per channel. Padding zeros count in
    the mean (PyTorch's default ``count_include_pad=True``): every window divides by kernel^2.

    Attributes:
        kernel: window height and width in pixels, > 0.
        stride: step between windows in pixels, > 0; None (default) is the same as kernel
            (non-overlapping windows).
        padding: zeros added on each side in pixels, >= 0 and at most kernel // 2 (as in PyTorch,
            so no window lies wholly in the padding) (default 0).
    """

    kernel: int
    _: KW_ONLY
    stride: int | None = None
    padding: int = 0


@dataclass(frozen=True)
class GlobalAvgPool(LayerRecord):
    """The mean of each channel over its whole plane: (C, H, W) in, (C,) out. The output is flat,
    so a Linear may follow directly (PyTorch's ``AdaptiveAvgPool2d(1)`` then ``Flatten``)."""


@dataclass(frozen=True, kw_only=True)
class BatchNorm2d(LayerRecord):
    """Batch normalisation per channel of a (C, H, W) input, as PyTorch's BatchNorm2d:
    ``y = gamma * (x - mean) / sqrt(var + eps) + beta`` with a learned scale gamma (starting at 1)
    and shift beta (starting at 0) per channel.

    Training normalises by the batch's own mean and biased variance over its real rows and every
    pixel, and moves the running statistics toward them: ``running = (1 - momentum) * running +
    momentum * batch``, with the unbiased variance. Evaluation and prediction normalise by the
    running statistics (mean 0 and variance 1 at first). They are state, not parameters: the
    optimiser and weight decay never touch them, and checkpoints keep them.

    Attributes:
        momentum: how far each training step moves the running statistics, in [0, 1] (default 0.1).
        eps: added to the variance before the square root, > 0 (default 1e-5).
    """

    momentum: float = 0.1
    eps: float = 1e-5


@dataclass(frozen=True, kw_only=True)
class BatchNorm1d(LayerRecord):
    """BatchNorm2d for a flat (F,) input, one channel per feature, or for (C, L), one channel per
    row of L (PyTorch's BatchNorm1d); statistics are over the batch (and L).

    Attributes:
        momentum: as BatchNorm2d's, in [0, 1] (default 0.1).
        eps: as BatchNorm2d's, > 0 (default 1e-5).
    """

    momentum: float = 0.1
    eps: float = 1e-5


@dataclass(frozen=True, kw_only=True)
class LayerNorm(LayerRecord):
    """Layer normalisation over the last dimension of a (F,) or (C, L) input, as PyTorch's
    ``LayerNorm(last_dim)``: each sample's row of F (or each of its C rows of L) is normalised by
    its own mean and biased variance, ``y = weight * (x - mean) / sqrt(var + eps) + bias``, with a
    learned scale (starting at 1) and shift (starting at 0) per position of that dimension. No
    running statistics: training and evaluation compute the same thing.

    Attributes:
        eps: added to the variance before the square root, > 0 (default 1e-5).
    """

    eps: float = 1e-5


@dataclass(frozen=True)
class Dropout(LayerRecord):
    """PyTorch's ``Dropout(p)``: while training, each element is zeroed with probability p and the
    kept ones scaled by ``1 / (1 - p)``; evaluation and prediction pass the input through unchanged
    (a copy; p = 0 is no launch at all). The mask is a counter-based hash of (``Init.seed``, the
    layer's index, the training step, the element's flat index in the batch), the same on every
    backend to the bit: each step draws a new mask, and a resumed run draws the masks an
    uninterrupted one would. Under data parallelism each device hashes its own shard's indices.

    Attributes:
        p: the probability of zeroing an element, in [0, 1) (default 0.5); 0 is the identity.
    """

    p: float = 0.5


@dataclass(frozen=True)
class Embedding(LayerRecord):
    """PyTorch's ``Embedding(num_embeddings, dim)``: a learned table of ``num_embeddings`` rows of
    ``dim``, looked up by integer token ids; an input of any shape S gives (*S, dim). The ids come
    in the model's float32 input (exact integers up to 2**24, hence the limit on the table), so an
    Embedding must be the first layer and its input must not be normalised or scaled. Rows start
    N(0, 1), as in PyTorch. Ids are not differentiable: nothing before the layer learns. An id that
    is not an integer in [0, num_embeddings) stops the run with an error naming its sample and
    position, on every backend: the host checks each batch (a dataset kept on the device once,
    before the first step). The shader also clamps ids into range, so it never reads outside the
    table.

    Attributes:
        num_embeddings: rows of the table (the vocabulary size), in [1, 2**24].
        dim: values per row, > 0.
    """

    num_embeddings: int
    dim: int


@dataclass(frozen=True)
class Flatten(LayerRecord):
    """Reshapes each sample to one dimension (C * H * W values, row-major), as Linear needs."""


@dataclass(frozen=True)
class Reshape(LayerRecord):
    """Gives each sample the shape ``shape`` (row-major, as ``torch.reshape``): the values stay,
    in order. A view: no launch, no copy.

    Attributes:
        shape: the new sample shape, its sizes > 0 with the input's count of values; one size may
            be -1, which takes what the others leave.
    """

    shape: Shape


@dataclass(frozen=True)
class ReLU(LayerRecord):
    """``max(x, 0)`` elementwise, as a layer of its own (Linear and Conv2d can fuse it instead).
    NaN gives NaN on every backend, as in numpy and PyTorch."""


@dataclass(frozen=True)
class LeakyReLU(LayerRecord):
    """``x`` where x > 0, else ``slope * x``, elementwise. NaN gives NaN.

    Attributes:
        slope: the factor for negative inputs (default 0.01).
    """

    slope: float = 0.01


@dataclass(frozen=True)
class Sigmoid(LayerRecord):
    """``1 / (1 + exp(-x))`` elementwise, in (0, 1). NaN gives NaN."""


@dataclass(frozen=True)
class Tanh(LayerRecord):
    """``tanh(x)`` elementwise, in (-1, 1). NaN gives NaN."""


@dataclass(frozen=True)
class GELU(LayerRecord):
    """``x * Phi(x)`` elementwise, Phi the standard normal CDF (exact, erf-based; not the tanh
    approximation). NaN gives NaN."""


@dataclass(frozen=True)
class Softmax(LayerRecord):
    """Softmax over a flat sample: outputs in [0, 1] that sum to 1. Not before CrossEntropy, which
    applies softmax itself; a row holding NaN gives NaN everywhere."""


@dataclass(frozen=True)
class PositionalEmbedding(LayerRecord):
    """A learned position embedding, as GPT-2's: a table of one row per position, added to a
    (T, D) input, ``y[t] = x[t] + table[t]``, so that attention can tell positions apart. The
    table is (T, D), T and D taken from the input; rows start N(0, 0.02^2), as in GPT-2."""


@dataclass(frozen=True)
class SelfAttention(LayerRecord):
    """Multi-head self-attention over a (T, D) input, as PyTorch's ``MultiheadAttention`` with
    query, key and value all the input: ``qkv = x @ W_qkv + b_qkv`` [T, 3D] split into ``heads``
    heads of D / heads; per head ``softmax(q k^T / sqrt(D / heads)) v``, causal by default (a
    position sees itself and the ones before it); the heads concatenated, then ``@ W_out + b_out``.
    The attention itself is one fused kernel with an online softmax: no T x T matrix is ever held,
    and the backward pass recomputes the probabilities it needs.

    Attributes:
        heads: attention heads, > 0, dividing the input's last dimension.
        causal: whether position t attends only to positions <= t (default True).
        bias: whether both projections add a learned bias (default True).
    """

    heads: int
    _: KW_ONLY
    causal: bool = True
    bias: bool = True


@dataclass(frozen=True)
class Add(LayerRecord):
    """The elementwise sum of its inputs (two or more, all of one shape): a residual connection's
    join. Name them in ``inputs``."""


@dataclass(frozen=True, kw_only=True)
class Concat(LayerRecord):
    """Its inputs (two or more) joined along one dimension, in ``inputs`` order; their other
    dimensions must agree.

    Attributes:
        axis: the sample dimension to join along (default 0: channels of (C, H, W) images, features
            of flat ones); negative counts from the end.
    """

    axis: int = 0


@dataclass(frozen=True, kw_only=True)
class MatMul(LayerRecord):
    """The matrix product of its two inputs per sample, as ``torch.matmul`` on (..., M, K) and
    (..., K, N): (..., M, N), their leading dimensions equal (no broadcasting). Name both in
    ``inputs``; no parameters of its own.

    Attributes:
        transpose_b: the second input is (..., N, K) and is transposed first: ``a @ b^T``
            (attention's scores, ``q @ k^T``) (default False).
    """

    transpose_b: bool = False


@dataclass(frozen=True)
class Residual(LayerRecord):
    """``x + f(x)``, f its layers in order (a block of its own: names inside it are local): the
    residual block of ResNets and transformers. f must give x's shape.

    Attributes:
        layers: the block's layers, at least one.
    """

    layers: tuple  # tuple[Layer, ...], set below once Layer exists


@dataclass(frozen=True)
class Repeat(LayerRecord):
    """Its layers, ``times`` times in a row, each repetition with parameters of its own (a stack of
    transformer blocks). A repetition is a block: names inside it are local to it.

    Attributes:
        times: how many repetitions, > 0.
        layers: one repetition's layers, at least one; the last one's output must fit the first.
    """

    times: int
    layers: tuple  # tuple[Layer, ...], set below once Layer exists


Layer = (
    Linear | Conv2d | MaxPool2d | AvgPool2d | GlobalAvgPool | BatchNorm1d | BatchNorm2d | LayerNorm
    | Dropout | Embedding | PositionalEmbedding | SelfAttention | Flatten | ReLU | LeakyReLU
    | Sigmoid | Tanh | GELU | Softmax | Add | Concat | Residual | Repeat | Reshape | Conv1d | MatMul
)  # fmt: skip
# A block holds layers of every kind, itself included: the annotation the codec and validator read
# can only name the union once it exists.
for _block in (Residual, Repeat):
    _block.__dataclass_fields__["layers"].type = tuple[Layer, ...]
# The layers that hold other layers.
Block = Residual | Repeat
# The largest table an Embedding may have: float32 holds every integer id below it exactly.
MAX_EMBEDDINGS = 1 << 24
# The layers that normalise by batch statistics and keep running ones.
BatchNorm = BatchNorm1d | BatchNorm2d
# The convolutions: Conv1d runs as a Conv2d of height 1.
Conv = Conv2d | Conv1d

# Losses and the model


@dataclass(frozen=True, kw_only=True)
class CrossEntropy(Record):
    """Mean cross-entropy over the batch, for integer class labels 0..classes-1; softmax is fused
    into the loss, so the model ends in raw logits (a Linear with one unit per class, >= 2), as
    PyTorch's ``CrossEntropyLoss(weight=class_weights, label_smoothing=label_smoothing)``.

    An output of shape (*S, classes) with labels of shape S a sample (a language model: (T, V)
    logits, (T,) ids) is a cross-entropy per position, averaged over every position of every real
    sample; accuracy then counts positions. A model that guesses uniformly scores ``ln(classes)``
    (2.3026 for 10 classes): a run warns when a whole epoch's mean training loss stays within 1% of
    that. Predictions are probabilities.

    Attributes:
        label_smoothing: in [0, 1] (default 0): the target mixes the one-hot label with the
            uniform distribution, ``(1 - s) * onehot + s / classes``.
        class_weights: one weight >= 0 per class, or None (default) for all 1: each row's loss is
            scaled by its label's weight and the mean divides by the sum of the real rows' label
            weights (PyTorch's rule; under data parallelism each device divides by its own sum
            scaled up to the global batch, an estimate of that sum).
    """

    label_smoothing: float = field(default=0.0, metadata=LATER)
    class_weights: tuple[float, ...] | None = field(default=None, metadata=LATER)


@dataclass(frozen=True)
class MSE(Record):
    """Mean squared error over the batch and the outputs, for float targets shaped like the model's
    output. Predictions are the raw outputs."""


@dataclass(frozen=True)
class L1(Record):
    """Mean absolute error over the batch and the outputs, for float targets shaped like the
    model's output (PyTorch's ``L1Loss``; the gradient at 0 is 0). Predictions are the raw outputs."""


@dataclass(frozen=True)
class Huber(Record):
    """PyTorch's ``HuberLoss(delta=delta)``, mean over the batch and the outputs: ``d^2 / 2`` where
    ``|d| < delta``, else ``delta * (|d| - delta / 2)``, d the output minus its float target.
    Predictions are the raw outputs.

    Attributes:
        delta: where the loss turns from quadratic to linear, > 0 (default 1.0).
    """

    delta: float = 1.0


@dataclass(frozen=True)
class BCEWithLogits(Record):
    """Binary cross-entropy on logits, mean over the batch and the outputs (PyTorch's
    ``BCEWithLogitsLoss``), for multi-label targets in [0, 1] shaped like the model's output:
    ``max(z, 0) - z * y + log(1 + exp(-|z|))``, the sigmoid fused in. Predictions are
    probabilities (the sigmoid of each output)."""


Loss = CrossEntropy | MSE | L1 | Huber | BCEWithLogits
# The losses that compare each output with its own float target.
PointwiseLoss = MSE | L1 | Huber | BCEWithLogits


# Metrics beside the loss (Model.metrics), computed on the device each step and reported as the
# metrics file's keys and CSV columns "top5", "mae", ... ("val_top5" for the validation round).


@dataclass(frozen=True)
class TopK(Record):
    """Top-k accuracy, for CrossEntropy only: the fraction of rows (positions, for per-token
    labels) whose label's logit is among the ``k`` largest; a tie counts as right only when
    strictly fewer than ``k`` logits are greater. Reported as ``top<k>``.

    Attributes:
        k: 1 <= k <= classes (default 5); TopK(1) is the accuracy.
    """

    k: int = 5


@dataclass(frozen=True)
class MAE(Record):
    """Mean absolute error over every real row's outputs, for float-target losses (MSE, L1, Huber)."""


@dataclass(frozen=True)
class RMSE(Record):
    """Root mean squared error, the square root of a whole round's (or epoch's) mean squared error
    (not the mean of each step's), for float-target losses (MSE, L1, Huber)."""


@dataclass(frozen=True)
class Perplexity(Record):
    """exp of the mean per-token cross-entropy over a round (a language model's perplexity), for
    CrossEntropy only: from the summed loss, with no kernel of its own."""


Metric = TopK | MAE | RMSE | Perplexity


@dataclass(frozen=True, kw_only=True)
class Init(Record):
    """How fresh weights are drawn; biases always start at 0.

    Attributes:
        scheme: "he" (default): normal with std ``sqrt(2 / fan_in)``, for relu-like activations;
            "xavier": uniform in ``+-sqrt(6 / (fan_in + fan_out))``, for tanh and sigmoid.
        seed: the generator's seed, >= 0 (default 0): the same seed gives the same weights.
        from_file: a ``.safetensors`` file to start from instead (default None: drawn), named and
            shaped as the equivalent PyTorch model's state_dict (see flow.safetensors_io), as
            ``python -m flow export`` writes it. Resuming a checkpoint takes its weights instead.
    """

    scheme: Literal["he", "xavier"] = "he"
    seed: int = 0
    from_file: str | None = field(default=None, metadata=LATER)


@dataclass(frozen=True, kw_only=True)
class Model(Record):
    """The network: its input shape, its layers in order and its loss.

    Attributes:
        input_shape: one sample's shape without the batch dimension, every size > 0: (64,) for a
            vector, (C, H, W) for images. It must equal the source's sample shape after
            ``data.preprocess``.
        layers: the layers, in order; each must accept the previous one's output shape.
        loss: CrossEntropy(), MSE(), L1(), Huber() or BCEWithLogits(); None only for a model used
            to predict (training needs one).
        input_dtype: what the inputs are declared as: "float32" (default), "float16" or "uint8".
            It is recorded and shown in summaries; every backend takes float32 inputs today, with
            the values of the module's input convention.
        init: how fresh weights are drawn (default ``Init()``: He, seed 0).
        metrics: measures reported beside the loss, each at most once (default none): TopK(k),
            MAE(), RMSE(), Perplexity(), as Keras' ``compile(metrics=[...])``.
    """

    input_shape: Shape
    layers: tuple[Layer, ...]
    loss: Loss | None
    input_dtype: Literal["float32", "float16", "uint8"] = "float32"
    init: Init = Init()
    metrics: tuple[Metric, ...] = field(default=(), metadata=LATER)

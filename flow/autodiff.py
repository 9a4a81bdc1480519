"""From a model to groups of launches: forward, loss, backward (derived by one rule per layer) and
the optimiser update (flow.optim decides its launch). Pure: it names tensors and launches into a
:class:`flow.graph.Graph`, walking the model's stages (flow.graph); flow.planning places them in
memory.

Launches inside one group are independent (dW, db and dX of a layer share a group), and groups
run in order with one barrier between them. Fusions that pay at MLP scale are made here: bias and
activation in the GEMM or conv epilogue (an activation layer right after a Linear or Conv2d
without one is folded into it), softmax with cross-entropy, and one optimiser launch over the
whole flat parameter arena.
"""

from __future__ import annotations

import math

from flow.errors import PlanError, Problem
from flow.graph import Graph, Stage, TensorDecl, fused_bias_grads, optimised_floats, stages, unwrap
from flow.optim import update_launch
from flow.program import Launch, launch
from flow.spec import Optimiser
from flow.spec_model import (
    MSE,
    AvgPool2d,
    BatchNorm,
    Conv2d,
    CrossEntropy,
    Dropout,
    Embedding,
    Flatten,
    GlobalAvgPool,
    LayerNorm,
    Linear,
    MaxPool2d,
    Model,
    Softmax,
)
from shaders.registry import ACTIVATIONS, REDUCE
from shaders.tiles import conv_gemm_shape

# Activations whose derivative the GEMM epilogue can take from the saved output (gelu needs its
# input, which the forward keeps only in a separate tensor).
EPILOGUE_DERIVATIVES = frozenset({"relu", "leaky_relu", "sigmoid", "tanh"})


# Up to this many classes, one workgroup computes the cross-entropy rows and the batch totals
# (softmax_xent_totals); wider logits take a workgroup per row and separate sums.
NARROW_LOGITS = 32


def k_splits(m: int, n: int, k: int) -> int:
    """How many slices to split a GEMM's K into: more when its M x N output has few 32 x 32
    tiles and K is long (a classifier's logits: 256 x 10 x 1024), so the GPU has enough
    workgroups; 1 when the output alone fills the GPU or K is short.

    Args:
        m, n, k: the GEMM's shape.

    Returns:
        The number of K slices, 1 to 16.
    """
    tiles = math.ceil(m / 32) * math.ceil(n / 32)
    if k < 256 or tiles >= 64:
        return 1
    return max(1, min(math.ceil(k / 128), math.ceil(128 / tiles), 16))


# A convolution's weight gradient: slices of its (n, oh, ow) positions are summed by separate
# workgroups when the K x C*R*S output has few tiles. Enough workgroups to keep a big GPU's
# multiprocessors several deep (bench/sweep_conv.py on an H100: conv2's 64 x 288 output over
# 50176 positions took 210 us in 15 slices, 95 us in 128 (90 of them the GEMM, 6 conv_splitk_sum);
# conv1's 32 x 9 over 200704 took 44 us in 256 slices, 34 in 512), each slice at least
# CONV_SPLIT_MIN_K positions long, and at most CONV_MAX_SPLITS (conv_splitk_sum's pass over the
# slices, and the workspace of splits x K x C*R*S floats, grow with them).
CONV_SPLIT_TARGET_GROUPS = 2304
CONV_SPLIT_MIN_K = 256
CONV_MAX_SPLITS = 512


def conv_weight_splits(m: int, n: int, k: int) -> int:
    """How many slices to split a convolution's weight-gradient GEMM into (see the constants
    above): a Fashion-MNIST CNN's first layer, 32 x 9 outputs summed over 256 x 28 x 28 positions,
    has a single 32 x 32 tile and gets 512 slices; its second, 64 x 288 over 256 x 14 x 14, 128.

    Args:
        m, n, k: the GEMM's shape (output channels, C*R*S, N*OH*OW).

    Returns:
        The number of slices, 1 to CONV_MAX_SPLITS.
    """
    tiles = math.ceil(m / 32) * math.ceil(n / 32)
    if tiles >= CONV_SPLIT_TARGET_GROUPS // 2:
        return 1
    wanted = math.ceil(CONV_SPLIT_TARGET_GROUPS / tiles)
    return max(1, min(wanted, k // CONV_SPLIT_MIN_K, CONV_MAX_SPLITS))


class _Builder:
    """Walks the stages once forward and once backward, emitting launches into a Graph."""

    def __init__(
        self, model: Model, batch: int, graph: Graph, precision: str = "float32", training: bool = False
    ) -> None:
        self.model, self.b, self.g = model, batch, graph
        # BatchNorm normalises by the batch's statistics when training, else by its running ones.
        self.training = training
        self.mixed = precision == "mixed"
        self.stages = stages(model)
        self.saved: dict[int, dict[str, str]] = {}  # stage position -> names of tensors backward needs
        self.fused_bias_grads = {} if self.mixed else fused_bias_grads(model)
        # Stage positions whose activation backward an input-gradient GEMM already applied.
        self.activation_done: set[int] = set()

    # forward ---------------------------------------------------------------------------------
    def forward(self, x: str) -> str:
        h = x
        for position, stage in enumerate(self.stages):
            h = self._forward_stage(position, stage, h)
        return h

    def _forward_stage(self, position: int, stage: Stage, h: str) -> str:
        b, g = self.b, self.g
        layer, slope = unwrap(stage.layer)
        out = g.add(f"act[{stage.index}]", (b, *stage.out_shape))
        saved = {"input": h, "output": out}
        act_code = ACTIVATIONS[stage.activation]
        # GELU's derivative needs its input, so the epilogue stops before it and a unary applies it.
        split_gelu = stage.activation == "gelu" and isinstance(layer, Linear | Conv2d)
        target = g.add(f"pre[{stage.index}]", (b, *stage.out_shape)) if split_gelu else out
        epilogue = ACTIVATIONS["none"] if split_gelu else act_code
        if isinstance(layer, Linear):
            w, bias = f"layers[{stage.index}].weight", f"layers[{stage.index}].bias"
            k, n = stage.in_shape[0], layer.units
            main, finish = self._gemm(
                (h, w, bias if layer.bias else h, target),
                M=b,
                N=n,
                K=k,
                has_bias=int(layer.bias),
                act=epilogue,
                slope=slope,
            )
            g.emit(main)
            g.emit(finish)
        elif isinstance(layer, Conv2d):
            w, bias = f"layers[{stage.index}].weight", f"layers[{stage.index}].bias"
            g.emit(
                launch(
                    "conv2d_gemm",
                    (h, w, bias if layer.bias else h, target),
                    **self._conv_params(stage, layer),
                    has_bias=int(layer.bias),
                    act=epilogue,
                    slope=slope,
                )
            )
        elif isinstance(layer, MaxPool2d):
            idx = g.add(f"argmax[{stage.index}]", (b, *stage.out_shape), dtype="int32")
            saved["idx"] = idx
            g.emit(launch("maxpool2d", (h, out, idx), **self._pool_params(stage, layer)))
        elif isinstance(layer, AvgPool2d):
            g.emit(launch("avgpool2d", (h, out), **self._pool_params(stage, layer)))
        elif isinstance(layer, GlobalAvgPool):
            c, height, width = stage.in_shape
            mean = REDUCE["mean"]
            g.emit(launch("reduce", (h, out), rows=b * c, cols=height * width, axis=1, fn=mean, alpha=1.0))
        elif isinstance(layer, BatchNorm):
            saved["stats"] = self._batch_norm_forward(stage, layer, h, out)
        elif isinstance(layer, LayerNorm):
            params, prefix = self._layer_norm_params(stage, layer), f"layers[{stage.index}]"
            # Each row's mean and 1 / std, which the backward reads; the same in train and eval.
            stats = g.add(f"norm_stats[{stage.index}]", (b, 2 * params["R"]))
            g.emit(launch("layernorm", (h, f"{prefix}.weight", f"{prefix}.bias", out, stats), **params))
            saved["stats"] = stats
        elif isinstance(layer, Dropout) and layer.p > 0:
            # Eval and predict copy rather than alias the input: work memory is placed once, from
            # the train program's lifetimes, so every program must read and write the same
            # tensors (a view would let the next layer's output take its input's memory).
            params = self._dropout_params(stage, layer)
            step = launch("dropout", (h, "stepvals", out), **params) if self.training else None
            g.emit(step or launch("copy", (h, out), n=params["n"]))
        elif isinstance(layer, Embedding):
            weight = f"layers[{stage.index}].weight"
            g.emit(launch("embedding", (h, weight, "stepvals", out), **self._embedding_params(stage, layer)))
        elif isinstance(layer, Flatten | Dropout):
            # A reshape, or a dropout of p = 0 (the identity): a view in every program, no launch.
            base = g.tensors[h].view_of or h
            g.tensors[out] = TensorDecl(out, (b, *stage.out_shape), "float32", "work", view_of=base)
        elif stage.activation is not None:
            g.emit(launch("unary", (h, out), n=b * math.prod(stage.out_shape), fn=act_code, a=slope, b=0.0))
        elif isinstance(layer, Softmax):
            rows, cols = b * math.prod(stage.out_shape[:-1]), stage.out_shape[-1]
            g.emit(launch("softmax", (h, out), rows=rows, cols=cols, log=0))
        else:
            raise PlanError(
                [Problem(f"model.layers[{stage.index}]", f"no forward rule for {type(layer).__name__}")]
            )
        if split_gelu:
            g.emit(
                launch("unary", (target, out), n=b * math.prod(stage.out_shape), fn=act_code, a=0.0, b=0.0)
            )
            saved["pre"] = target
        self.saved[position] = saved
        return out

    def _gemm(self, args: tuple[str, str, str, str], **params: int | float) -> tuple[Launch, Launch | None]:
        """A GEMM launch, split over K when its output has too few tiles to fill a GPU.

        Returns:
            (launch, finish): ``finish`` adds the K slices and applies the epilogue; it must run in
            a later group. None when the GEMM is not split.
        """
        if self.mixed:
            # Tensor cores: no split-K there, their tiles already keep many subgroups busy.
            return launch("gemm_coopmat", args, alpha=1.0, **params), None
        a, b, bias, c = args
        m, n, k = int(params["M"]), int(params["N"]), int(params["K"])
        splits = k_splits(m, n, k)
        if splits == 1:
            return launch("gemm", args, alpha=1.0, **params), None
        workspace = self.g.add(f"splitk:{c}", (splits, m, n))
        partial = {key: value for key, value in params.items() if key not in ("has_bias", "act", "slope")}
        main = launch("gemm", (a, b, a, workspace), alpha=1.0, k_splits=splits, **partial)
        finish = launch(
            "splitk_epilogue",
            (workspace, bias, c),
            M=m,
            N=n,
            splits=splits,
            has_bias=int(params.get("has_bias", 0)),
            act=int(params.get("act", 0)),
            alpha=1.0,
            slope=float(params.get("slope", 0.0)),
        )
        return main, finish

    def _input_grad_gemm(
        self, position: int, dz: str, w: str, h: str, in_grad: str, k: int, n: int
    ) -> tuple[Launch, Launch | None]:
        """dX = dz @ W^T for the dense layer at ``position``. When the stage before it ends in an
        activation whose derivative its saved output gives (``h`` is that output), the GEMM's
        epilogue applies it too (gemm.comp act_grad), so that stage skips its own launch."""
        previous = self.stages[position - 1] if position > 0 else None
        fusable = (
            previous is not None
            and previous.activation in EPILOGUE_DERIVATIVES
            and isinstance(unwrap(previous.layer)[0], Linear | Conv2d)
            and self.saved[position - 1]["output"] == h
            and not self.mixed
            and k_splits(self.b, k, n) == 1
        )
        if not fusable:
            return self._gemm((dz, w, dz, in_grad), M=self.b, N=k, K=n, trans_b=1)
        assert previous is not None
        self.activation_done.add(position - 1)
        fused = launch(
            "gemm",
            (dz, w, h, in_grad),
            M=self.b,
            N=k,
            K=n,
            trans_b=1,
            alpha=1.0,
            act_grad=ACTIVATIONS[previous.activation],
            slope=unwrap(previous.layer)[1],
        )
        return fused, None

    def _conv_params(self, stage: Stage, layer: Conv2d) -> dict[str, int]:
        c, h, w = stage.in_shape
        k, oh, ow = stage.out_shape
        return dict(
            N=self.b,
            C=c,
            H=h,
            W=w,
            K=k,
            R=layer.kernel,
            S=layer.kernel,
            stride=layer.stride,
            pad=layer.padding,
            OH=oh,
            OW=ow,
        )

    def _conv_weight_grad(
        self, x: str, dz: str, dw: str, params: dict[str, int]
    ) -> tuple[Launch, Launch | None]:
        """The weight gradient of a convolution as an implicit GEMM, split over its (n, oh, ow)
        positions when its small output (K x C*R*S) has too few tiles to fill a GPU.

        Returns:
            (launch, finish): ``finish`` (conv_splitk_sum) adds the slices into ``dw``; it must
            run in a later group. None when the GEMM is not split.
        """
        m, n, k = conv_gemm_shape("weight", params)
        splits = conv_weight_splits(m, n, k)
        if splits == 1:
            return launch("conv2d_gemm_backward_weight", (x, dz, dw), **params), None
        workspace = self.g.add(f"splitk:{dw}", (splits, m, n))
        main = launch("conv2d_gemm_backward_weight", (x, dz, workspace), k_splits=splits, **params)
        finish = launch("conv_splitk_sum", (workspace, dw), total=m * n, splits=splits)
        return main, finish

    def _pool_params(self, stage: Stage, layer: MaxPool2d | AvgPool2d) -> dict[str, int]:
        c, h, w = stage.in_shape
        _, oh, ow = stage.out_shape
        stride = layer.kernel if layer.stride is None else layer.stride
        params = dict(N=self.b, C=c, H=h, W=w, OH=oh, OW=ow, kernel=layer.kernel, stride=stride)
        if isinstance(layer, AvgPool2d):  # max pooling has no padding
            params["pad"] = layer.padding
        return params

    def _norm_params(self, stage: Stage) -> dict[str, int]:
        """A BatchNorm input as [N, C, HW]: HW is 1 for flat features, H*W for images."""
        return dict(N=self.b, C=stage.in_shape[0], HW=math.prod(stage.in_shape[1:]))

    def _layer_norm_params(self, stage: Stage, layer: LayerNorm) -> dict[str, int | float]:
        """A LayerNorm input as [N * R, D]: D its last dimension, R = 1 for flat features."""
        return dict(N=self.b, R=math.prod(stage.in_shape[:-1]), D=stage.in_shape[-1], eps=float(layer.eps))

    def _dropout_params(self, stage: Stage, layer: Dropout) -> dict[str, int | float]:
        """dropout.comp's constants: the run's seed (Init.seed, folded to 32 bits) mixed with the
        layer's index, so that two Dropout layers draw different masks; the step comes at run time."""
        seed = self.model.init.seed
        mixed = (seed ^ (seed >> 32) ^ (0x9E3779B9 * (stage.index + 1))) & 0xFFFFFFFF
        threshold = min(math.ceil(layer.p * 2.0**32), 2**32 - 1)  # uniform >= p as uint32 >= it
        n = self.b * math.prod(stage.out_shape)
        return dict(n=n, seed=mixed, threshold=threshold, scale=1 / (1 - layer.p))

    def _embedding_params(self, stage: Stage, layer: Embedding) -> dict[str, int]:
        """An Embedding's ids as [N, S] (S = every id of a sample) and its table as [V, D]."""
        return dict(N=self.b, S=math.prod(stage.in_shape), V=layer.num_embeddings, D=layer.dim)

    def _batch_norm_forward(self, stage: Stage, layer: BatchNorm, h: str, out: str) -> str:
        """Per-channel statistics (the batch's while training, moving the running ones; else the
        running ones) into a [4, C] work tensor, then the normalisation; returns the tensor, whose
        rows 0 and 1 (mean, 1 / std) the backward reads and whose rows 2 and 3 it fills."""
        params, prefix = self._norm_params(stage), f"layers[{stage.index}]"
        stats = self.g.add(f"norm_stats[{stage.index}]", (4, params["C"]))
        running = (f"{prefix}.running_mean", f"{prefix}.running_var")
        self.g.emit(
            launch(
                "batchnorm_stats",
                (h, *running, stats, "stepvals"),
                **params,
                training=int(self.training),
                momentum=float(layer.momentum),
                eps=float(layer.eps),
            )
        )
        self.g.emit(launch("batchnorm", (h, stats, f"{prefix}.weight", f"{prefix}.bias", out), **params))
        return stats

    # loss ----------------------------------------------------------------------------------------
    def loss(self, output: str, labels: str, write_grad: bool) -> str | None:
        """Emit the fused loss; returns the name of d(output) when write_grad.

        The loss kernels average over the batch's real rows, which the engine writes into
        ``stepvals`` each step, so one program serves every row count up to the batch size."""
        b, g = self.b, self.g
        out_shape = g.tensors[output].shape
        cols = math.prod(out_shape[1:])
        grad = g.add(f"grad:{output}", out_shape) if write_grad else None
        if isinstance(self.model.loss, CrossEntropy) and cols <= NARROW_LOGITS:
            # One launch for the rows and both totals (a classifier's few classes).
            g.emit(
                launch(
                    "softmax_xent_totals",
                    (output, labels, "loss", "correct", grad or output, "stepvals"),
                    rows=b,
                    cols=cols,
                    write_grad=int(write_grad),
                )
            )
        elif isinstance(self.model.loss, CrossEntropy):
            loss_rows = g.add("loss_rows", (b,))
            correct_rows = g.add("correct_rows", (b,))
            g.emit(
                launch(
                    "softmax_xent",
                    (output, labels, loss_rows, correct_rows, grad or loss_rows, "stepvals"),
                    rows=b,
                    cols=cols,
                    write_grad=int(write_grad),
                )
            )
            g.emit(
                launch("reduce", (loss_rows, "loss"), rows=1, cols=b, axis=1, fn=REDUCE["sum"], alpha=1.0),
                launch(
                    "reduce", (correct_rows, "correct"), rows=1, cols=b, axis=1, fn=REDUCE["sum"], alpha=1.0
                ),
            )
        elif isinstance(self.model.loss, MSE):
            loss_rows = g.add("loss_rows", (b,))
            g.emit(
                launch(
                    "mse",
                    (output, labels, loss_rows, grad or loss_rows, "stepvals"),
                    rows=b,
                    cols=cols,
                    write_grad=int(write_grad),
                )
            )
            g.emit(launch("reduce", (loss_rows, "loss"), rows=1, cols=b, axis=1, fn=REDUCE["sum"], alpha=1.0))
        else:
            raise PlanError([Problem("model.loss", "training needs a loss (CrossEntropy or MSE)")])
        return grad

    # backward ------------------------------------------------------------------------------------
    def backward(self, grad_out: str) -> None:
        first_trainable = next(
            (
                p
                for p, s in enumerate(self.stages)
                if isinstance(unwrap(s.layer)[0], Linear | Conv2d | BatchNorm | LayerNorm | Embedding)
            ),
            None,
        )
        grad = grad_out
        for position in range(len(self.stages) - 1, -1, -1):
            if first_trainable is None or position < first_trainable:
                break
            grad = self._backward_stage(
                position, self.stages[position], grad, need_input_grad=position > first_trainable
            )

    def _backward_stage(self, position: int, stage: Stage, grad: str, need_input_grad: bool) -> str:
        b, g = self.b, self.g
        layer, slope = unwrap(stage.layer)
        saved = self.saved[position]
        h = saved["input"]
        in_grad = f"grad:{h}" if need_input_grad else None
        if in_grad is not None:
            in_grad = g.add(in_grad, g.tensors[h].shape)
        count = b * math.prod(stage.out_shape)
        if isinstance(layer, Linear | Conv2d):
            dz = grad
            if stage.activation is not None and position not in self.activation_done:
                dz = g.add(f"grad:pre[{stage.index}]", (b, *stage.out_shape))
                keep = saved["pre"] if stage.activation == "gelu" else saved["output"]
                g.emit(_activation_backward(stage.activation, grad, keep, dz, count, slope))
            w, bias = f"layers[{stage.index}].weight", f"layers[{stage.index}].bias"
            dw, db = f"grad:{w}", f"grad:{bias}"
            if isinstance(layer, Linear):
                k, n = stage.in_shape[0], layer.units
                both = f"{dw}+bias"
                if both in self.fused_bias_grads:
                    # [dW; db] = [h, 1]^T dz: the bias gradient is the weight GEMM's extra row.
                    weight_grad, finish_weight = self._gemm(
                        (h, dz, h, both), M=k + 1, N=n, K=b, trans_a=1, ones_row=1
                    )
                    bias_grad = None
                else:
                    weight_grad, finish_weight = self._gemm((h, dz, h, dw), M=k, N=n, K=b, trans_a=1)
                    bias_grad = (
                        launch("reduce", (dz, db), rows=b, cols=n, axis=0, fn=REDUCE["sum"], alpha=1.0)
                        if layer.bias
                        else None
                    )
                input_grad, finish_input = (None, None)
                if in_grad:
                    input_grad, finish_input = self._input_grad_gemm(position, dz, w, h, in_grad, k, n)
                g.emit(weight_grad, bias_grad, input_grad)
                g.emit(finish_weight, finish_input)
            else:
                params = self._conv_params(stage, layer)
                weight_grad, finish_weight = self._conv_weight_grad(h, dz, dw, params)
                g.emit(
                    weight_grad,
                    launch(
                        "channel_sum",
                        (dz, db),
                        N=b,
                        K=layer.channels,
                        HW=stage.out_shape[1] * stage.out_shape[2],
                    )
                    if layer.bias
                    else None,
                    launch("conv2d_gemm_backward_data", (dz, w, in_grad), **params) if in_grad else None,
                )
                g.emit(finish_weight)
        elif isinstance(layer, MaxPool2d):
            if in_grad:
                g.emit(
                    launch(
                        "maxpool2d_backward", (grad, saved["idx"], in_grad), **self._pool_params(stage, layer)
                    )
                )
        elif isinstance(layer, AvgPool2d):
            if in_grad:
                g.emit(launch("avgpool2d_backward", (grad, in_grad), **self._pool_params(stage, layer)))
        elif isinstance(layer, GlobalAvgPool):
            if in_grad:
                c, height, width = stage.in_shape
                area = height * width
                g.emit(launch("broadcast_rows", (grad, in_grad), rows=b * c, cols=area, alpha=1.0 / area))
        elif isinstance(layer, BatchNorm):
            params, prefix = self._norm_params(stage), f"layers[{stage.index}]"
            stats = saved["stats"]
            grads = (f"grad:{prefix}.weight", f"grad:{prefix}.bias")
            g.emit(launch("batchnorm_backward_reduce", (grad, h, stats, *grads, "stepvals"), **params))
            if in_grad:
                g.emit(
                    launch(
                        "batchnorm_backward_data",
                        (grad, h, stats, f"{prefix}.weight", "stepvals", in_grad),
                        **params,
                    )
                )
        elif isinstance(layer, LayerNorm):
            params, prefix = self._layer_norm_params(stage, layer), f"layers[{stage.index}]"
            stats = saved["stats"]
            grads = (f"grad:{prefix}.weight", f"grad:{prefix}.bias")
            g.emit(
                launch("layernorm_backward_reduce", (grad, h, stats, *grads, "stepvals"), **params),
                launch(
                    "layernorm_backward_data",
                    (grad, h, stats, f"{prefix}.weight", "stepvals", in_grad),
                    **params,
                )
                if in_grad
                else None,
            )
        elif isinstance(layer, Embedding):
            # The table's gradient alone: ids have none, and an Embedding is always the first layer.
            weight_grad = f"grad:layers[{stage.index}].weight"
            params = self._embedding_params(stage, layer)
            g.emit(launch("embedding_backward", (h, grad, "stepvals", weight_grad), **params))
        elif isinstance(layer, Dropout) and layer.p > 0:
            if in_grad:
                # The same mask, recomputed from its hash (cheaper than storing it), on the gradient.
                g.emit(launch("dropout", (grad, "stepvals", in_grad), **self._dropout_params(stage, layer)))
        elif isinstance(layer, Flatten | Dropout):
            if in_grad:
                # The gradient of a reshape (or of an identity) is the gradient: a view, no launch.
                base = g.tensors[grad].view_of or grad
                g.tensors[in_grad] = TensorDecl(in_grad, g.tensors[h].shape, "float32", "work", view_of=base)
        elif stage.activation is not None:
            if in_grad:
                keep = h if stage.activation == "gelu" else saved["output"]
                g.emit(_activation_backward(stage.activation, grad, keep, in_grad, count, slope))
        elif isinstance(layer, Softmax):
            if in_grad:
                rows, cols = b * math.prod(stage.out_shape[:-1]), stage.out_shape[-1]
                g.emit(
                    launch("softmax_backward", (saved["output"], grad, in_grad), rows=rows, cols=cols, log=0)
                )
        else:
            raise PlanError(
                [
                    Problem(
                        f"model.layers[{stage.index}]",
                        f"{type(layer).__name__} has no backward rule, so a model with it cannot train",
                    )
                ]
            )
        return in_grad or ""


def _activation_backward(
    activation: str, grad: str, saved: str, out: str, count: int, slope: float
) -> Launch:
    """d(input) = grad * f'(saved): ``saved`` is the forward output, or the input for GELU."""
    return launch("unary_backward", (grad, saved, out), n=count, fn=ACTIVATIONS[activation], a=slope, b=0.0)


def build_graph(
    model: Model,
    optimiser: Optimiser | None,
    batch: int,
    program: str,
    total_params: int,
    precision: str = "float32",
    update: bool = True,
) -> Graph:
    """The launches of one program for one batch size.

    Args:
        model: the model.
        optimiser: needed for ``train``.
        batch: rows in this batch.
        program: ``train`` (forward, loss, backward, update), ``eval`` (forward, loss, accuracy) or
            ``predict`` (forward, then probabilities for CrossEntropy models).
        total_params: floats in the flat parameter arena (padding included).
        precision: ``float32``, or ``mixed`` for GEMMs on tensor cores (float16 inputs, float32
            accumulation).
        update: ``train`` ends with the optimiser's update (False: at the gradients, for a
            data-parallel member, whose update runs after the all-reduce).

    Returns:
        The graph: tensor declarations (work tensors only; the planner adds the rest) and groups.
    """
    graph = Graph()
    graph.add("x", (batch, *model.input_shape), role="io")
    builder = _Builder(model, batch, graph, precision, training=program == "train")
    out = builder.forward("x")
    if program == "predict":
        cols = math.prod(graph.tensors[out].shape[1:]) if out != "x" else math.prod(model.input_shape)
        if isinstance(model.loss, CrossEntropy):
            graph.emit(launch("softmax", (out, "output"), rows=batch, cols=cols, log=0))
        else:
            graph.emit(launch("copy", (out, "output"), n=batch * cols))
        return graph
    grad = builder.loss(out, "y", write_grad=program == "train")
    if program == "train":
        assert grad is not None and optimiser is not None
        builder.backward(grad)
        if update:
            graph.emit(update_launch(optimiser, optimised_floats(model, total_params)))
    return graph

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

from flow.autodiff_matmul import matmul_backward, matmul_dims, matmul_forward
from flow.errors import PlanError, Problem
from flow.graph import (
    CLASS_WEIGHTS,
    Graph,
    Stage,
    TensorDecl,
    fused_bias_grads,
    optimised_floats,
    stages,
    unwrap,
)
from flow.metrics import metric_name, on_device
from flow.model_graph import MODEL_INPUT, concat_axis
from flow.optim import LOSS_SCALE, update_groups
from flow.program import Launch, launch
from flow.spec import Optimiser
from flow.spec_model import (
    MAE,
    Add,
    AvgPool2d,
    BatchNorm,
    BCEWithLogits,
    Concat,
    Conv,
    Conv1d,
    CrossEntropy,
    Dropout,
    Embedding,
    Flatten,
    GlobalAvgPool,
    LayerNorm,
    Linear,
    MatMul,
    MaxPool2d,
    Model,
    PointwiseLoss,
    PositionalEmbedding,
    Reshape,
    SelfAttention,
    Softmax,
    TopK,
)
from shaders.attention_tiles import COOPMAT_ATTENTION_OPS, attention_ops
from shaders.conv_coopmat_tiles import conv_gemm_op
from shaders.registry import ACTIVATIONS, BINARY, CASTS, HALF_COPY_OUTPUT, HALF_ONLY, LOSSES, REDUCE
from shaders.registry import op as op_def
from shaders.tiles import conv_gemm_shape, coopmat_k_splits, gemm_k_splits

# Activations whose derivative an input-gradient GEMM's epilogue applies (act_grad), from the saved
# output; gelu's, from the saved pre-activation, too where GELU_IN_EPILOGUES.
EPILOGUE_DERIVATIVES = frozenset({"relu", "leaky_relu", "sigmoid", "tanh"})
# GELU after a Linear, in the GEMM epilogues (True): its GEMM writes the pre-activation and GELU of
# it (gemm_copy; mixed: straight to the next Linear's fp16 operand, gemm_coopmat_copy's copy_act),
# and the next Linear's input-gradient GEMM multiplies by GELU'(pre) (act_grad). Or in launches of
# its own (False): a unary (mixed: unary_half, straight to that fp16 operand) and a unary_backward.
# False on measurement (session 14, bench/bench_epilogues.py, H100, the char GPT's 16384 x 384 <->
# 1536 MLP): the epilogues cost more than the launches they replace, since GELU's erf and exp run
# in an epilogue that overlaps nothing (fc1 mixed: 317 us against 121 + 106 for the GEMM and
# unary_half; fc2's input gradient: 358 against 130 + 142; fp32: 778 against 600 + 103 and 867
# against 614 + 141; the step, bench/ab_gelu_epilogue.py: mixed 16.3 ms against 15.45).
GELU_IN_EPILOGUES = False
# A residual block's sum x + f(x) written by the GEMM of a Linear f (gemm_residual,
# gemm_coopmat_residual), with no binary launch (fc2 of the char GPT, H100: mixed 136 us against
# 109 + 37, fp32 665 against 650 + 37).
RESIDUAL_IN_EPILOGUES = True


# Which float16 operand copies mixed-precision plans make, so that GEMMs stream halves instead of
# rounding fp32 in the kernel (gemm_coopmat's AH/BH): "weights", each dense weight's copy, which the
# optimiser's update writes beside its fp32 master (flow.weight_copies; or cast from the master at
# the start of every program, where the plan keeps no copies); "activations", each activation and
# gradient a GEMM reads, copied once where its producer can write the copy too, else where its
# GEMMs are wide enough to pay for a cast launch (HALF_ACTIVATION_MIN_N, _FLOATS; _half_copy).
# A module constant so that bench/ab_mixed_copies.py can time each choice in one process.
HALF_COPIES = frozenset({"weights", "activations"})
# An fp16 copy of an activation costs 6 bytes a float of traffic and a barrier; a GEMM saves in
# proportion to the width it multiplies the copy against. On an H100 (session 12) the large MLP's
# 4096-wide layers gained 38 % with copies from width 2048, and the char GPT's qkv (1152) and MLP
# (1536) layers another 0.7 % from 1024.
HALF_ACTIVATION_MIN_N = 1024
HALF_ACTIVATION_MIN_FLOATS = 1 << 21
# Mixed precision: an activation's or gradient's fp16 copy is written by the GEMM that produces it
# (gemm_coopmat_copy, _fold_casts_into_producers) rather than by a cast launch after a barrier, and
# input-gradient GEMMs apply the previous activation's derivative in their epilogue (gemm_coopmat's
# AD) rather than a unary_backward launch. False keeps those launches (bench/ab_mixed_copies.py).
MIXED_FUSIONS = True
# With MIXED_FUSIONS: a LayerNorm or GEMM whose fp32 output no launch reads (its readers all read
# the fp16 copy) writes only the copy (_write_halves_only). A module constant for A/B runs.
HALF_ONLY_OUTPUTS = True


# The layers with parameters of their own.
TRAINED = Linear | Conv | BatchNorm | LayerNorm | Embedding | PositionalEmbedding | SelfAttention


# Up to this many classes, one workgroup computes the cross-entropy rows and the batch totals
# (softmax_xent_totals); wider logits take a workgroup per row and separate sums.
NARROW_LOGITS = 32


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


# A convolution's bias gradient (channel_sum.comp): enough (channel, slice of samples) workgroups
# to keep a big GPU busy, each slice at least CHANNEL_SUM_MIN elements. One workgroup a channel
# took 245 us for conv1's 32 channels of 256 x 784 values on an H100 (session 9's profile).
CHANNEL_SUM_TARGET_GROUPS = 512
CHANNEL_SUM_MIN = 4096


def channel_sum_parts(n: int, k: int, hw: int) -> int:
    """How many slices of the ``n`` samples a convolution's bias gradient is summed in (1: one
    workgroup a channel writes the gradient itself)."""
    wanted = math.ceil(CHANNEL_SUM_TARGET_GROUPS / k)
    return max(1, min(wanted, n, n * hw // CHANNEL_SUM_MIN))


# Column sums over many rows (column_sum.comp: bias gradients; layernorm_backward_reduce.comp):
# enough (64 columns, slice of rows) workgroups to fill a big GPU, each slice at least
# COLUMN_SUM_MIN_ROWS rows. One workgroup a column, its threads walking down the rows, took
# 2.6 ms of the char GPT's 25.7 ms mixed step on an H100 for the biases alone (session 10).
COLUMN_SUM_TARGET_GROUPS = 1024
COLUMN_SUM_MIN_ROWS = 64
COLUMN_SUM_OUTS = 64  # the shaders' OUTS: columns a workgroup


def column_sum_parts(rows: int, cols: int) -> int:
    """How many slices of ``rows`` a column sum of [rows, cols] is split into (1: the sums are
    written directly; else conv_splitk_sum adds the slices). The GPT's 16384 x 384 gets 171."""
    tiles = math.ceil(cols / COLUMN_SUM_OUTS)
    wanted = math.ceil(COLUMN_SUM_TARGET_GROUPS / tiles)
    return max(1, min(wanted, rows // COLUMN_SUM_MIN_ROWS))


def _written(item: Launch) -> set[str]:
    """The tensors a launch writes (its op's output bindings)."""
    definition = op_def(item.op)
    pairs = zip(definition.bindings, item.args, strict=False)
    return {arg for name, arg in pairs if name in definition.outputs}


def embedding_chunks(ids: int, rows: int, dim: int) -> int:
    """Chunks of an Embedding's ids whose table gradients embedding_backward sums apart (one
    workgroup per table row and chunk) for embedding_chunk_sum to add in chunk order: with a
    small vocabulary (a char GPT's 84 rows, 16384 ids) one workgroup a row scanned every id.
    1 for a large vocabulary (rows already spread the work); else at least 256 ids a chunk, at
    most 64 chunks and an 8M-float (32 MB) workspace of chunks x rows x dim partial sums."""
    if rows >= 1024:
        return 1
    return max(1, min(64, ids // 256, (8 << 20) // (rows * dim)))


class _Builder:
    """Walks the stages once forward and once backward, emitting launches into a Graph."""

    def __init__(
        self,
        model: Model,
        batch: int,
        graph: Graph,
        precision: str = "float32",
        training: bool = False,
        part: tuple[int, int] | None = None,
        kept_copies: bool = False,
    ) -> None:
        self.model, self.b, self.g = model, batch, graph
        # BatchNorm normalises by the batch's statistics when training, else by its running ones.
        self.training = training
        self.mixed = precision == "mixed"
        self.stages = stages(model)
        self.saved: dict[int, dict[str, str]] = {}  # stage position -> names of tensors backward needs
        self.fused_bias_grads = {} if self.mixed else fused_bias_grads(model)
        # Mixed precision: the float16 copy of each dense weight that GEMMs read (copy -> (master,
        # floats)): kept by the optimiser in the plan's HALVES arena (kept_copies), else cast from
        # the fp32 master at the start of every program (_prepend_weight_casts).
        self.kept_copies = kept_copies
        self.halves: dict[str, tuple[str, int]] = {}
        self.half_copies: dict[str, str] = {}  # an activation or gradient -> its fp16 copy (_half_copy)
        # Stage positions whose activation backward an input-gradient GEMM already applied.
        self.activation_done: set[int] = set()
        # Positions of Add stages whose sum a GEMM already wrote (_residual_sum).
        self.sums_done: set[int] = set()
        # A pipeline stage's part of the model (flow.stage_plan): the stages at positions lo..hi-1,
        # whose input ``x`` is the output of the stage at lo - 1 (the only tensor that crosses).
        self.lo, self.hi = part if part is not None else (0, len(self.stages))
        self.outputs: list[str] = [""] * (self.lo - 1) + ["x"] * (self.lo > 0)  # position -> its output
        # How many stages read each stage's output (a gradient read by several is their sum).
        self.readers = [0] * len(self.stages)
        for stage in self.stages:
            for i in stage.inputs:
                if i != MODEL_INPUT:
                    self.readers[i] += 1

    # forward ---------------------------------------------------------------------------------
    def forward(self, x: str) -> str:
        for position in range(self.lo, self.hi):
            stage = self.stages[position]
            inputs = [x if i == MODEL_INPUT else self.outputs[i] for i in stage.inputs]
            self.outputs.append(self._forward_stage(position, stage, inputs))
        return self.outputs[-1] if self.outputs else x

    def _forward_stage(self, position: int, stage: Stage, inputs: list[str]) -> str:
        b, g = self.b, self.g
        layer, slope = unwrap(stage.layer)
        h, prefix = inputs[0], stage.path
        act_code = ACTIVATIONS[stage.activation]
        # GELU's derivative needs its input, so the layer writes that (pre) and GELU(pre) apart:
        # as its GEMM's second output (GELU_IN_EPILOGUES) or by a launch after it (_gelu_output).
        split_gelu = stage.activation == "gelu" and isinstance(layer, Linear | Conv)
        gelu_dtype = self._gelu_output(position, stage) if split_gelu else "float32"
        residual = None if split_gelu else self._residual_sum(position, stage)
        out = f"act[{stage.index}]"
        if residual is None:  # else the GEMM writes the sum, and this output is no tensor
            g.add(out, (b, *stage.out_shape), dtype=gelu_dtype)
        gelu_done = False
        saved = {"input": h, "output": out}
        target = g.add(f"pre[{stage.index}]", (b, *stage.out_shape)) if split_gelu else out
        target = residual[0] if residual else target
        epilogue = ACTIVATIONS["none"] if split_gelu else act_code
        if isinstance(layer, Linear):
            w, bias = f"{prefix}.weight", f"{prefix}.bias"
            k, n = stage.in_shape[-1], layer.units
            main, finish = self._gemm(
                (
                    self._half_copy(h, self._rows(stage) * k, n),
                    self._half_weight(w, k * n),
                    bias if layer.bias else h,
                    target,
                ),
                M=self._rows(stage),
                N=n,
                K=k,
                has_bias=int(layer.bias),
                act=epilogue,
                slope=slope,
            )
            # gemm_coopmat_copy writes the fp16 operand only (whole words of halves: N even); no
            # copy variant writes raw split-K sums.
            half = gelu_dtype == "float16" and n % 2 == 0
            gelu_done = split_gelu and GELU_IN_EPILOGUES and finish is None and (half or not self.mixed)
            if gelu_done:
                op = "gemm_coopmat_copy" if self.mixed else "gemm_copy"
                main = launch(op, (*main.args, out), **main.param_dict, copy_act=act_code)
            g.emit(self._with_residual(main, residual))
            g.emit(finish)
        elif isinstance(layer, Conv):
            w, bias = f"{prefix}.weight", f"{prefix}.bias"
            g.emit(
                launch(
                    conv_gemm_op("forward", self.mixed),
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
            params = self._layer_norm_params(stage, layer)
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
            weight = f"{prefix}.weight"
            g.emit(launch("embedding", (h, weight, "stepvals", out), **self._embedding_params(stage, layer)))
        elif isinstance(layer, PositionalEmbedding):
            g.emit(launch("add_rows", (h, f"{prefix}.weight", out), rows=b, cols=math.prod(stage.in_shape)))
        elif isinstance(layer, Add):
            if position not in self.sums_done:
                self._add_all(inputs, out)
        elif isinstance(layer, MatMul):
            saved["other"] = inputs[1]
            g.emit(matmul_forward(layer, matmul_dims(layer, b, stage.in_shapes), h, inputs[1], out))
        elif isinstance(layer, Concat):
            blocks = zip(inputs, self._concat_blocks(stage), strict=True)
            g.emit(*(launch("copy_columns", (x, out), **block) for x, block in blocks))
        elif isinstance(layer, SelfAttention):
            saved.update(self._attention_forward(stage, layer, h, target, residual))
        elif isinstance(layer, Flatten | Reshape | Dropout):
            # A reshape, or a dropout of p = 0 (the identity): a view in every program, no launch.
            base = g.tensors[h].view_of or h
            g.tensors[out] = TensorDecl(out, (b, *stage.out_shape), "float32", "work", view_of=base)
        elif stage.activation is not None:
            g.emit(launch("unary", (h, out), n=b * math.prod(stage.out_shape), fn=act_code, a=slope, b=0.0))
        elif isinstance(layer, Softmax):
            rows, cols = b * math.prod(stage.out_shape[:-1]), stage.out_shape[-1]
            g.emit(launch("softmax", (h, out), rows=rows, cols=cols, log=0))
        else:
            raise PlanError([Problem(f"model.{stage.path}", f"no forward rule for {type(layer).__name__}")])
        if split_gelu and not gelu_done:
            op = "unary_half" if gelu_dtype == "float16" else "unary"
            g.emit(launch(op, (target, out), n=b * math.prod(stage.out_shape), fn=act_code, a=0.0, b=0.0))
        if split_gelu:
            saved["pre"] = target
        self.saved[position] = saved
        return out

    def _only_reader(self, position: int) -> int | None:
        """The position of the stage of this part that reads the output of the stage at
        ``position``, where exactly one does."""
        readers = [i for i in range(position + 1, self.hi) if position in self.stages[i].inputs]
        return readers[0] if len(readers) == 1 else None

    def _gelu_output(self, position: int, stage: Stage) -> str:
        """The type of GELU(pre) after a Linear or Conv2d: in mixed plans (MIXED_FUSIONS, activation
        copies on) float16 where its one reader is a Linear of this part, whose GEMMs then read it
        as halves (written as such by the GEMM or by unary_half: no fp32 GELU(pre) at all, and no
        rounding in the reader's kernels); else float32."""
        only = self._only_reader(position)
        reader = self.stages[only] if only is not None else None
        half = (
            self.mixed
            and MIXED_FUSIONS
            and "activations" in HALF_COPIES
            and reader is not None
            and self.readers[position] == 1
            and isinstance(unwrap(reader.layer)[0], Linear)
        )
        if half:
            self.half_copies[f"act[{stage.index}]"] = f"act[{stage.index}]"
        return "float16" if half else "float32"

    def _residual_sum(self, position: int, stage: Stage) -> tuple[str, str] | None:
        """A Linear or SelfAttention whose one reader is an Add of its output and a tensor made
        before it (a residual block's x + f(x)): (the sum, x), for its (output projection's) GEMM
        to write the sum itself, reading x through a fifth binding and leaving it as it is
        (gemm_residual, gemm_coopmat_residual: one launch less and one pass less over x and f(x));
        None where the binary add stays."""
        only = self._only_reader(position)
        add = self.stages[only] if only is not None else None
        others = [i for i in add.inputs if i != position] if add is not None else []
        fusable = (
            add is not None
            and RESIDUAL_IN_EPILOGUES
            and isinstance(unwrap(stage.layer)[0], Linear | SelfAttention)
            and stage.activation is None  # an activation's backward reads f(x), which is no tensor here
            and isinstance(unwrap(add.layer)[0], Add)
            and add.activation is None
            and (MIXED_FUSIONS or not self.mixed)
            and self.readers[position] == 1
            and len(add.inputs) == 2
            and len(others) == 1
            and others[0] != MODEL_INPUT
            and others[0] < position
            and add.out_shape == stage.out_shape
        )
        if not fusable:
            return None
        assert add is not None
        x = self.outputs[others[0]]
        rows, k, n = self._rows(stage), stage.in_shape[-1], stage.out_shape[-1]
        unsplit = (coopmat_k_splits if self.mixed else gemm_k_splits)(rows, n, k) == 1
        if not unsplit or self.g.tensors[x].dtype != "float32":
            return None
        self.sums_done.add(only)
        return self.g.add(f"act[{add.index}]", (self.b, *add.out_shape)), x

    def _with_residual(self, gemm: Launch, residual: tuple[str, str] | None) -> Launch:
        """The GEMM, or where _residual_sum fused the add after it, its variant that adds x."""
        if residual is None:
            return gemm
        op = "gemm_coopmat_residual" if self.mixed else "gemm_residual"
        return launch(op, (*gemm.args, residual[1]), **gemm.param_dict)

    def _gemm(self, args: tuple[str, str, str, str], **params: int | float) -> tuple[Launch, Launch | None]:
        """A GEMM launch, split over K when its output has too few tiles to fill a GPU.

        Returns:
            (launch, finish): ``finish`` adds the K slices and applies the epilogue; it must run in
            a later group. None when the GEMM is not split.
        """
        a, b, bias, c = args
        m, n, k = int(params["M"]), int(params["N"]), int(params["K"])
        # Tensor cores split K by their own 128x128 tiles (a weight gradient over 16384 rows).
        op = "gemm_coopmat" if self.mixed else "gemm"
        splits = coopmat_k_splits(m, n, k) if self.mixed else gemm_k_splits(m, n, k)
        # An operand that is a float16 copy is read as halves (gemm_coopmat's AH/BH, tune_gemm_coopmat).
        half_names = {*self.halves, *self.half_copies.values()}
        halves = {flag: 1 for flag, x in (("a_half", a), ("b_half", b)) if x in half_names}
        if splits == 1:
            return launch(op, args, alpha=1.0, **params, **halves), None
        workspace = self.g.add(f"splitk:{c}", (splits, m, n))
        partial = {key: value for key, value in params.items() if key not in ("has_bias", "act", "slope")}
        main = launch(op, (a, b, a, workspace), alpha=1.0, k_splits=splits, **partial, **halves)
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

    def _half_weight(self, w: str, floats: int) -> str:
        """The operand a GEMM reads for the dense weight ``w`` of ``floats`` floats: in mixed
        precision its float16 copy ``half:<w>`` (declared here: a view of the HALVES arena that
        the optimiser keeps, role "halves", or a work tensor cast at the start of the program), so
        the kernel never rounds it (gemm_coopmat with BH = 1 streams halves); else ``w``. The copy
        has an even length: the cast and the update write whole 32-bit words."""
        if not (self.mixed and "weights" in HALF_COPIES):
            return w
        role = "halves" if self.kept_copies else "work"
        name = self.g.add(f"half:{w}", (floats + floats % 2,), role=role, dtype="float16")
        self.halves[name] = (w, floats)
        return name

    def _half_copy(self, x: str, floats: int, width: int) -> str:
        """The operand a GEMM reads for the activation or gradient ``x`` of ``floats`` floats, which
        it multiplies against ``width`` columns or rows (a forward GEMM's input h against N
        outputs; the output gradient dz against the K inputs in dX = dz W^T and in dW = h^T dz): in
        mixed precision (HALF_COPIES) an fp16 copy, cast in a group of its own just before, where
        the cast folds into the launch that wrote ``x`` last (_copy_op: ~2 bytes a float more
        there) or, for a cast launch of its own (6 bytes a float and a barrier), where ``x`` is wide
        enough to pay (HALF_ACTIVATION_MIN_N and _FLOATS); else ``x``."""
        if x in self.half_copies:  # cast already, or written as halves by its producer (_gelu_output)
            return self.half_copies[x]
        wide = width >= HALF_ACTIVATION_MIN_N and floats >= HALF_ACTIVATION_MIN_FLOATS
        cast = launch("cast", (x, f"half:{x}"), n=floats, mode=CASTS["f32_to_f16"])
        writers = [item for group in self.g.groups for item in group if x in _written(item)]
        folds = MIXED_FUSIONS and bool(writers) and _copy_op(writers[-1], cast) is not None
        if not (self.mixed and "activations" in HALF_COPIES and (wide or folds)):
            return x
        self.g.add(cast.args[1], (floats + floats % 2,), dtype="float16")
        self.g.emit(cast)
        self.half_copies[x] = cast.args[1]
        return cast.args[1]

    def _input_grad_gemm(
        self, position: int, dz: str, w: str, h: str, in_grad: str, k: int, n: int
    ) -> tuple[Launch, Launch | None]:
        """dX = dz @ W^T for the dense layer at ``position``. When the stage before it ends in an
        activation whose derivative its saved output gives (``h`` is that output), or GELU (where
        GELU_IN_EPILOGUES: from its saved pre-activation), the GEMM's epilogue applies it too
        (gemm.comp act_grad, bound in place of the bias), so that stage skips its own launch."""
        source = self.stages[position].inputs[0]
        previous = self.stages[source] if source != MODEL_INPUT else None
        if previous is not None and previous.activation == "gelu":
            saved = self.saved.get(source, {}).get("pre")
        else:
            saved = h
        rows = self._rows(self.stages[position])
        fusable = (
            previous is not None
            and source >= self.lo  # a stage on another device applies its own derivative
            and previous.activation in (EPILOGUE_DERIVATIVES | ({"gelu"} if GELU_IN_EPILOGUES else set()))
            and isinstance(unwrap(previous.layer)[0], Linear | Conv)
            and self.saved[source]["output"] == h
            and saved is not None
            and self.readers[source] == 1
            and (MIXED_FUSIONS or not self.mixed)
            and (coopmat_k_splits if self.mixed else gemm_k_splits)(rows, k, n) == 1
        )
        w = self._half_weight(w, k * n)
        if not fusable:
            return self._gemm((dz, w, dz, in_grad), M=rows, N=k, K=n, trans_b=1)
        assert previous is not None
        self.activation_done.add(source)
        derivative = dict(act_grad=ACTIVATIONS[previous.activation], slope=unwrap(previous.layer)[1])
        return self._gemm((dz, w, saved, in_grad), M=rows, N=k, K=n, trans_b=1, **derivative)

    def _rows(self, stage: Stage) -> int:
        """The rows a Linear's GEMM has: one per sample, or per position of a (T, D) input."""
        return self.b * math.prod(stage.in_shape[:-1])

    def _concat_blocks(self, stage: Stage) -> list[dict[str, int]]:
        """copy_columns' constants placing each input of a Concat in its output: a sample is
        ``outer`` rows of its inputs' columns side by side (axis and everything after it)."""
        layer = unwrap(stage.layer)[0]
        rank = len(stage.out_shape)
        axis = concat_axis(layer, rank)
        rows = self.b * math.prod(stage.out_shape[:axis])
        width = math.prod(stage.out_shape[axis:])
        blocks, offset = [], 0
        for shape in stage.in_shapes:
            cols = math.prod(shape[axis:])
            blocks.append(
                dict(rows=rows, cols=cols, x_width=cols, x_offset=0, y_width=width, y_offset=offset)
            )
            offset += cols
        return blocks

    @staticmethod
    def _take_columns(grad: str, dx: str, block: dict[str, int]) -> Launch:
        """The backward of placing columns: the same block taken back out of the gradient."""
        cols, width, offset = block["cols"], block["y_width"], block["y_offset"]
        return launch(
            "copy_columns",
            (grad, dx),
            rows=block["rows"],
            cols=cols,
            x_width=width,
            x_offset=offset,
            y_width=cols,
            y_offset=0,
        )

    def _attention_params(self, stage: Stage, layer: SelfAttention) -> dict[str, int | float]:
        t, d = stage.in_shape
        dh = d // layer.heads
        return dict(N=self.b, T=t, H=layer.heads, dh=dh, scale=1.0 / math.sqrt(dh), causal=int(layer.causal))

    def _attention_forward(
        self, stage: Stage, layer: SelfAttention, h: str, out: str, residual: tuple[str, str] | None
    ) -> dict[str, str]:
        """qkv = h W_qkv + b, the fused attention (keeping each row's log-sum-exp for the
        backward), then out = y W_out + b (+ x, the residual: see _residual_sum); returns what the
        backward reads."""
        g, prefix, params = self.g, stage.path, self._attention_params(stage, layer)
        t, d = stage.in_shape
        rows, bias = self.b * t, int(layer.bias)
        qkv = g.add(f"qkv[{stage.index}]", (self.b, t, 3 * d))
        heads = g.add(f"heads[{stage.index}]", (self.b, t, d))
        lse = g.add(f"lse[{stage.index}]", (self.b, layer.heads, t))
        w_qkv, b_qkv = self._half_weight(f"{prefix}.qkv_weight", 3 * d * d), f"{prefix}.qkv_bias"
        a = self._half_copy(h, rows * d, 3 * d)
        for step in self._gemm((a, w_qkv, b_qkv if bias else h, qkv), M=rows, N=3 * d, K=d, has_bias=bias):
            g.emit(step)
        kernel = attention_ops(self.mixed, int(params["dh"]))["forward"]
        # On tensor cores, where the qkv GEMM writes qkv's fp16 copy (_half_copy with no width: only
        # where the cast folds), the kernels read it and write their outputs' copies (the _half ops).
        if kernel == COOPMAT_ATTENTION_OPS["forward"] and self._half_copy(qkv, rows * 3 * d, 0) != qkv:
            self.half_copies[heads] = g.add(f"half:{heads}", (rows * d,), dtype="float16")
            g.emit(launch(f"{kernel}_half", (self.half_copies[qkv], heads, lse, f"half:{heads}"), **params))
        else:
            g.emit(launch(kernel, (qkv, heads, lse), **params))
        w_out, b_out = self._half_weight(f"{prefix}.out_weight", d * d), f"{prefix}.out_bias"
        args = (self._half_copy(heads, rows * d, d), w_out, b_out if bias else heads, out)
        project, finish = self._gemm(args, M=rows, N=d, K=d, has_bias=bias)
        g.emit(self._with_residual(project, residual))
        g.emit(finish)
        return {"qkv": qkv, "heads": heads, "lse": lse}

    def _attention_backward(
        self, stage: Stage, layer: SelfAttention, saved: dict[str, str], grad: str, in_grad: str | None
    ) -> None:
        g, prefix, params = self.g, stage.path, self._attention_params(stage, layer)
        t, d = stage.in_shape
        rows, b = self.b * t, self.b
        qkv, heads, lse, h = saved["qkv"], saved["heads"], saved["lse"], saved["input"]
        d_heads = g.add(f"grad:heads[{stage.index}]", (b, t, d))
        d_qkv = g.add(f"grad:qkv[{stage.index}]", (b, t, 3 * d))
        row_dots = g.add(f"attention_dots[{stage.index}]", (b, layer.heads, t))
        w_qkv, w_out = f"{prefix}.qkv_weight", f"{prefix}.out_weight"
        # The operands' fp16 copies as the forward Linear's (_half_copy): the output gradient's
        # (a LayerNorm's input gradient wrote it last: layernorm_backward_data_copy), heads' from
        # the forward kernel, d_qkv's from the qkv bias's column sums, else where wide.
        y, dz = self.half_copies.get(heads, heads), self._half_copy(grad, rows * d, d)
        out_weight, finish_out = self._gemm((y, dz, heads, f"grad:{w_out}"), M=d, N=d, K=rows, trans_a=1)
        half_out = self._half_weight(w_out, d * d)
        to_heads, finish_heads = self._gemm((dz, half_out, grad, d_heads), M=rows, N=d, K=d, trans_b=1)
        out_bias, finish_bias = self._bias_grad(layer.bias, grad, f"grad:{prefix}.out_bias", rows, d)
        g.emit(out_weight, to_heads, out_bias)
        g.emit(finish_out, finish_heads, finish_bias)
        g.emit(launch("attention_backward_dot", (d_heads, heads, row_dots), **params))
        kernels = attention_ops(self.mixed, int(params["dh"]))
        half = "_half" if qkv in self.half_copies else ""  # the forward read qkv's fp16 copy
        args = (self.half_copies.get(qkv, qkv), d_heads, lse, row_dots, d_qkv)
        g.emit(*(launch(kernels[kind] + half, args, **params) for kind in ("kv", "q")))
        qkv_bias, finish_bias = self._bias_grad(layer.bias, d_qkv, f"grad:{prefix}.qkv_bias", rows, 3 * d)
        if half and qkv_bias is not None and d % 2 == 0:
            # The bias's column sums read all of dqkv: they write its fp16 copy for the qkv GEMMs.
            copy = self.half_copies[d_qkv] = g.add(f"half:{d_qkv}", (rows * 3 * d,), dtype="float16")
            g.emit(launch("column_sum_copy", (*qkv_bias.args, copy), **qkv_bias.param_dict))
            qkv_bias = None
        x, dz = self.half_copies.get(h, h), self._half_copy(d_qkv, rows * 3 * d, d)
        qkv_weight, finish_qkv = self._gemm((x, dz, h, f"grad:{w_qkv}"), M=d, N=3 * d, K=rows, trans_a=1)
        to_input, finish_input = (
            self._gemm(
                (dz, self._half_weight(w_qkv, 3 * d * d), d_qkv, in_grad), M=rows, N=d, K=3 * d, trans_b=1
            )
            if in_grad
            else (None, None)
        )
        g.emit(qkv_weight, to_input, qkv_bias)
        g.emit(finish_qkv, finish_input, finish_bias)

    def _bias_grad(
        self, bias: bool, dz: str, db: str, rows: int, cols: int
    ) -> tuple[Launch | None, Launch | None]:
        """A dense layer's bias gradient, the column sums of its output's gradient (column_sum),
        in slices of the rows when the columns alone are too few workgroups (column_sum_parts).

        Returns:
            (launch, finish): ``finish`` (conv_splitk_sum) adds the slices into ``db``, in a later
            group; None when there is one slice. Both None without a bias.
        """
        if not bias:
            return None, None
        parts = column_sum_parts(rows, cols)
        if parts == 1:
            return launch("column_sum", (dz, db), rows=rows, cols=cols, parts=1), None
        workspace = self.g.add(f"splitk:{db}", (parts, cols))
        main = launch("column_sum", (dz, workspace), rows=rows, cols=cols, parts=parts)
        return main, launch("conv_splitk_sum", (workspace, db), total=cols, splits=parts)

    def _conv_params(self, stage: Stage, layer: Conv) -> dict[str, int]:
        if isinstance(layer, Conv1d):  # (C, L) as an image (C, 1, L), a kernel 1 x kernel
            (c, length), (k, out) = stage.in_shape, stage.out_shape
            geometry = dict(C=c, H=1, W=length, K=k, R=1, S=layer.kernel, OH=1, OW=out, one_d=1)
            return dict(N=self.b, stride=layer.stride, pad=layer.padding, **geometry)
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
            return launch(conv_gemm_op("weight", self.mixed), (x, dz, dw), **params), None
        workspace = self.g.add(f"splitk:{dw}", (splits, m, n))
        main = launch(conv_gemm_op("weight", self.mixed), (x, dz, workspace), k_splits=splits, **params)
        finish = launch("conv_splitk_sum", (workspace, dw), total=m * n, splits=splits)
        return main, finish

    def _conv_bias_grad(self, dz: str, db: str, out_shape: tuple[int, ...]) -> tuple[Launch, Launch | None]:
        """A convolution's bias gradient (channel_sum), summed in slices of the samples when its
        channels alone are too few workgroups (channel_sum_parts).

        Returns:
            (launch, finish): ``finish`` (conv_splitk_sum) adds the slices into ``db``, in a later
            group; None when there is one slice.
        """
        k, hw = out_shape[0], math.prod(out_shape[1:])
        parts = channel_sum_parts(self.b, k, hw)
        if parts == 1:
            return launch("channel_sum", (dz, db), N=self.b, K=k, HW=hw, parts=1), None
        workspace = self.g.add(f"splitk:{db}", (parts, k))
        main = launch("channel_sum", (dz, workspace), N=self.b, K=k, HW=hw, parts=parts)
        return main, launch("conv_splitk_sum", (workspace, db), total=k, splits=parts)

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
        params, prefix = self._norm_params(stage), stage.path
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
        ``stepvals`` each step, so one program serves every row count up to the batch size. A
        CrossEntropy on an output (*S, classes) with labels S a sample is one per position: its
        rows are b * prod(S), per_sample prod(S), and ``correct`` counts right positions divided by
        prod(S), so that correct / samples is the fraction of positions right."""
        b, g, loss = self.b, self.g, self.model.loss
        out_shape = g.tensors[output].shape
        grad = g.add(f"grad:{output}", out_shape) if write_grad else None
        if isinstance(loss, CrossEntropy):
            per_sample, cols = math.prod(out_shape[1:-1]), out_shape[-1]
            rows = b * per_sample
            dims = dict(rows=rows, cols=cols, write_grad=int(write_grad), per_sample=per_sample)
            plain = loss == CrossEntropy()
            if plain and cols <= NARROW_LOGITS:
                # One launch for the rows and both totals (a classifier's few classes).
                totals = ("loss", "correct", grad or output, "stepvals")
                g.emit(launch("softmax_xent_totals", (output, labels, *totals), **dims))
                self._metrics(output, labels, rows, cols, per_sample)
                return grad
            loss_rows, correct_rows = g.add("loss_rows", (rows,)), g.add("correct_rows", (rows,))
            tail = (loss_rows, correct_rows, grad or loss_rows, "stepvals")
            if plain:
                g.emit(launch("softmax_xent", (output, labels, *tail), **dims))
            else:
                weighted = loss.class_weights is not None
                weights = weight_sum = output  # read only when weighted
                if weighted:
                    weights, weight_sum = CLASS_WEIGHTS, g.add("class_weight_sum", (1,))
                    sum_args = (labels, weights, "stepvals", weight_sum)
                    g.emit(launch("class_weight_sum", sum_args, rows=rows, cols=cols, per_sample=per_sample))
                smoothing = float(loss.label_smoothing)
                args = (output, labels, weights, weight_sum, *tail)
                extra = dict(weighted=int(weighted), smoothing=smoothing)
                g.emit(launch("softmax_xent_general", args, **dims, **extra))
            totals = [(loss_rows, "loss", 1.0), (correct_rows, "correct", 1.0 / per_sample)]
        elif isinstance(loss, PointwiseLoss):
            rows, cols = b, math.prod(out_shape[1:])
            loss_rows = g.add("loss_rows", (b,))
            code, delta = LOSSES[type(loss).__name__], float(getattr(loss, "delta", 1.0))
            args = (output, labels, loss_rows, grad or loss_rows, "stepvals")
            g.emit(launch("mse", args, rows=b, cols=cols, write_grad=int(write_grad), fn=code, delta=delta))
            totals = [(loss_rows, "loss", 1.0)]
        else:
            raise PlanError([Problem("model.loss", "training needs a loss (CrossEntropy, MSE, ...)")])
        total_sum = dict(rows=1, cols=rows, axis=1, fn=REDUCE["sum"])
        g.emit(*(launch("reduce", (t, total), **total_sum, alpha=a) for t, total, a in totals))
        self._metrics(output, labels, rows, cols, per_sample if isinstance(loss, CrossEntropy) else 1)
        return grad

    def _metrics(self, output: str, labels: str, rows: int, cols: int, per_sample: int) -> None:
        """Each metric's kernel, summed into its io tensor ``metric:<name>`` (flow.metrics): TopK's
        right rows counted (positions over per_sample), MAE's and RMSE's batch mean |d| and d^2 by
        the pointwise loss kernel without a gradient. Padding rows add 0 to every one."""
        for metric in on_device(self.model):
            name = metric_name(metric)
            hits = self.g.add(f"metric_rows:{name}", (rows,))
            if isinstance(metric, TopK):
                args = dict(rows=rows, cols=cols, per_sample=per_sample, k=metric.k)
                self.g.emit(launch("topk", (output, labels, hits, "stepvals"), **args))
            else:
                code = LOSSES["L1" if isinstance(metric, MAE) else "MSE"]
                args = dict(rows=rows, cols=cols, write_grad=0, fn=code, delta=1.0)
                self.g.emit(launch("mse", (output, labels, hits, hits, "stepvals"), **args))
            alpha = 1.0 / per_sample if isinstance(metric, TopK) else 1.0
            total = dict(rows=1, cols=rows, axis=1, fn=REDUCE["sum"], alpha=alpha)
            self.g.emit(launch("reduce", (hits, f"metric:{name}"), **total))

    # backward ------------------------------------------------------------------------------------
    def backward(self, grad_out: str) -> None:
        """Each stage's backward in reverse order, from the loss's gradient (a pipeline stage's:
        from its output's gradient ``grad_out``, and it ends by copying its input's gradient into
        io ``dx`` where the stage before needs one). Only stages on a path from a trained
        parameter to the loss run; a stage's output gradient is the sum of what its readers pass
        back, added in reader order (so every run sums alike)."""
        needs = backward_needs(self.stages)
        passed: dict[int, list[str]] = {self.hi - 1: [grad_out]} if self.hi > self.lo else {}
        for position in range(self.hi - 1, self.lo - 1, -1):
            parts = passed.get(position)
            if not needs[position] or not parts:
                continue
            stage = self.stages[position]
            want = [i != MODEL_INPUT and needs[i] for i in stage.inputs]
            in_grads = self._backward_stage(position, stage, self._sum(position, parts), want)
            for source, in_grad in zip(stage.inputs, in_grads, strict=True):
                if in_grad:
                    passed.setdefault(source, []).append(in_grad)
        if self.lo > 0 and needs[self.lo - 1]:
            dx = self._sum(self.lo - 1, passed[self.lo - 1])
            self.g.emit(launch("copy", (dx, "dx"), n=math.prod(self.g.tensors[dx].shape)))

    def _sum(self, position: int, parts: list[str]) -> str:
        """The gradient of a stage's output from what its readers passed back."""
        if len(parts) == 1:
            return parts[0]
        total = self.g.add(f"grad:{self.outputs[position]}", self.g.tensors[parts[0]].shape)
        self._add_all(parts, total)
        return total

    def _add_all(self, parts: list[str], total: str) -> None:
        """``total`` = the sum of two or more tensors of its shape, added in ``parts`` order (the
        third on is added in place: binary.comp reads each element before it writes it)."""
        if len(parts) == 2 and self._fuse_into_norm_grad(parts, total):
            return
        n = math.prod(self.g.tensors[total].shape)
        self.g.emit(launch("binary", (parts[0], parts[1], total), n=n, fn=BINARY["add"], a=1.0, b=0.0))
        for part in parts[2:]:
            self.g.emit(launch("binary", (total, part, total), n=n, fn=BINARY["add"], a=1.0, b=0.0))

    def _fuse_into_norm_grad(self, parts: list[str], total: str) -> bool:
        """Two gradients of a residual stream, one the LayerNorm input gradient one of the last two
        groups wrote: that launch writes ``total`` itself, adding the other part as it goes
        (layernorm_backward_data's accumulate), instead of a separate add reading both again
        (12 adds of 16384 x 384 in the char GPT's step). Only when nothing in that group or after
        writes the other part, so it is complete when the launch reads it.

        Returns:
            True when fused (the part the LayerNorm wrote is then no tensor of the graph).
        """
        groups = self.g.groups[-2:]  # the LayerNorm's group, and its parameter sums' finish
        for at, group in enumerate(groups):
            for index, item in enumerate(group):
                params = item.param_dict
                norm_grad = item.op == "layernorm_backward_data" and not params.get("accumulate")
                if not norm_grad or item.args[5] not in parts:
                    continue
                mine = item.args[5]
                other = parts[1] if mine == parts[0] else parts[0]
                later = {arg for each in groups[at:] for x in each for arg in _written(x)}
                if other == mine or other in later:
                    return False
                # One float addition of the two, as binary.comp's (it commutes exactly).
                group[index] = launch(item.op, (*item.args[:5], total, other), **params, accumulate=1)
                del self.g.tensors[mine]
                return True
        return False

    def _grad_name(self, stage: Stage, j: int) -> str:
        """The gradient a stage passes to its ``j``-th input: ``grad:<input>`` when it is that
        input's only reader, else a part of its own for the sum."""
        source = stage.inputs[j]
        name = self.outputs[source]
        only = self.readers[source] == 1 and stage.inputs.count(source) == 1
        return f"grad:{name}" if only else f"grad:{name}@{stage.index}.{j}"

    def _backward_stage(self, position: int, stage: Stage, grad: str, want: list[bool]) -> list[str | None]:
        b, g = self.b, self.g
        layer, slope = unwrap(stage.layer)
        saved, prefix = self.saved[position], stage.path
        if isinstance(layer, Add):
            # Every input's gradient is the output's: the same tensor, passed on without a launch.
            return [grad if wanted else None for wanted in want]
        if isinstance(layer, Concat):
            grads = [
                g.add(self._grad_name(stage, j), (b, *shape)) if wanted else None
                for j, (shape, wanted) in enumerate(zip(stage.in_shapes, want, strict=True))
            ]
            blocks = zip(grads, self._concat_blocks(stage), want, strict=True)
            g.emit(*(self._take_columns(grad, dx, block) for dx, block, wanted in blocks if wanted))
            return [dx if wanted else None for dx, wanted in zip(grads, want, strict=True)]
        if isinstance(layer, MatMul):
            grads = [g.add(self._grad_name(stage, j), (b, *s)) if wanted else None
                     for j, (s, wanted) in enumerate(zip(stage.in_shapes, want, strict=True))]  # fmt: skip
            dims = matmul_dims(layer, b, stage.in_shapes)
            g.emit(*matmul_backward(layer, dims, saved["input"], saved["other"], grad, *grads))
            return grads
        if isinstance(layer, PositionalEmbedding):
            # The table's gradient sums the batch; the input's is the output's, passed on as it is.
            cols, dw = math.prod(stage.in_shape), f"grad:{prefix}.weight"
            column_sum, finish = self._bias_grad(True, grad, dw, b, cols)
            g.emit(column_sum)
            g.emit(finish)
            return [grad if want[0] else None]
        h = saved["input"]
        in_grad = g.add(self._grad_name(stage, 0), g.tensors[h].shape) if want[0] else None
        count = b * math.prod(stage.out_shape)
        if isinstance(layer, Linear | Conv):
            dz = grad
            if stage.activation is not None and position not in self.activation_done:
                dz = g.add(f"grad:pre[{stage.index}]", (b, *stage.out_shape))
                keep = saved["pre"] if stage.activation == "gelu" else saved["output"]
                g.emit(_activation_backward(stage.activation, grad, keep, dz, count, slope))
            w, bias = f"{prefix}.weight", f"{prefix}.bias"
            dw, db = f"grad:{w}", f"grad:{bias}"
            if isinstance(layer, Linear):
                k, n, rows = stage.in_shape[-1], layer.units, self._rows(stage)
                both = f"{dw}+bias"
                if both in self.fused_bias_grads:
                    # [dW; db] = [h, 1]^T dz: the bias gradient is the weight GEMM's extra row.
                    weight_grad, finish_weight = self._gemm(
                        (h, dz, h, both), M=k + 1, N=n, K=rows, trans_a=1, ones_row=1
                    )
                    bias_grad, finish_bias = None, None
                else:
                    a, b = self.half_copies.get(h, h), self._half_copy(dz, rows * n, k)
                    weight_grad, finish_weight = self._gemm((a, b, h, dw), M=k, N=n, K=rows, trans_a=1)
                    bias_grad, finish_bias = self._bias_grad(layer.bias, dz, db, rows, n)
                input_grad, finish_input = (None, None)
                if in_grad:
                    dz = self.half_copies.get(dz, dz)
                    input_grad, finish_input = self._input_grad_gemm(position, dz, w, h, in_grad, k, n)
                g.emit(weight_grad, bias_grad, input_grad)
                g.emit(finish_weight, finish_input, finish_bias)
            else:
                params = self._conv_params(stage, layer)
                weight_grad, finish_weight = self._conv_weight_grad(h, dz, dw, params)
                bias_grad, finish_bias = (None, None)
                if layer.bias:
                    bias_grad, finish_bias = self._conv_bias_grad(dz, db, stage.out_shape)
                g.emit(
                    weight_grad,
                    bias_grad,
                    launch(conv_gemm_op("data", self.mixed), (dz, w, in_grad), **params) if in_grad else None,
                )
                g.emit(finish_weight, finish_bias)
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
            params, prefix = self._norm_params(stage), stage.path
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
            params = self._layer_norm_params(stage, layer)
            stats = saved["stats"]
            grads = (f"grad:{prefix}.weight", f"grad:{prefix}.bias")
            # Sliced over the rows as a bias gradient is (column_sum_parts); the slices are added
            # after the group.
            parts = column_sum_parts(self.b * int(params["R"]), int(params["D"]))
            sums = grads if parts == 1 else tuple(g.add(f"splitk:{n}", (parts, params["D"])) for n in grads)
            finish = [
                launch("conv_splitk_sum", (part, whole), total=params["D"], splits=parts)
                for part, whole in zip(sums, grads, strict=True)
                if parts > 1
            ]
            reduce_args = (grad, h, stats, *sums, "stepvals")
            g.emit(
                launch("layernorm_backward_reduce", reduce_args, **params, parts=parts),
                launch(
                    "layernorm_backward_data",
                    # The addend slot reads grad as a stand-in until _add_all fuses a sum in.
                    (grad, h, stats, f"{prefix}.weight", "stepvals", in_grad, grad),
                    **params,
                )
                if in_grad
                else None,
            )
            g.emit(*finish)
        elif isinstance(layer, SelfAttention):
            self._attention_backward(stage, layer, saved, grad, in_grad)
        elif isinstance(layer, Embedding):
            # The table's gradient alone: ids have none, and an Embedding is always the first layer.
            weight_grad = f"grad:{prefix}.weight"
            params = self._embedding_params(stage, layer)
            chunks = embedding_chunks(params["N"] * params["S"], params["V"], params["D"])
            if chunks == 1:
                g.emit(launch("embedding_backward", (h, grad, "stepvals", weight_grad), **params))
            else:
                partial = self.g.add(f"chunks:{weight_grad}", (chunks, params["V"], params["D"]))
                g.emit(launch("embedding_backward", (h, grad, "stepvals", partial), chunks=chunks, **params))
                total = params["V"] * params["D"]
                g.emit(launch("embedding_chunk_sum", (partial, weight_grad), total=total, splits=chunks))
        elif isinstance(layer, Dropout) and layer.p > 0:
            if in_grad:
                # The same mask, recomputed from its hash (cheaper than storing it), on the gradient.
                g.emit(launch("dropout", (grad, "stepvals", in_grad), **self._dropout_params(stage, layer)))
        elif isinstance(layer, Flatten | Reshape | Dropout):
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
                        f"model.{stage.path}",
                        f"{type(layer).__name__} has no backward rule, so a model with it cannot train",
                    )
                ]
            )
        return [in_grad]


def backward_needs(model_stages: list[Stage]) -> list[bool]:
    """For each stage position, whether the backward pass reaches it: it has trained parameters,
    or reads a stage that does (so its output's gradient is needed)."""
    needs: list[bool] = []
    for stage in model_stages:
        trained = isinstance(unwrap(stage.layer)[0], TRAINED)
        needs.append(trained or any(i != MODEL_INPUT and needs[i] for i in stage.inputs))
    return needs


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
    sample: dict[str, float] | None = None,
    loss_scaled: bool = False,
    part: tuple[int, int] | None = None,
    kept_copies: bool = False,
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
        sample: ``generate`` (forward, then sample_token's draw from the logits): its parameters
            (flow.generation.sample_params).
        loss_scaled: ``train`` multiplies the loss's gradient by the loss scale and its update
            divides it out (flow.optim.LOSS_SCALE).
        part: a pipeline stage's stage positions [lo, hi) (flow.stage_plan): its input ``x`` is
            the output of the stage before lo; a part before the last copies its output into io
            ``output`` and (``train``) then runs its backward from io ``dy``, from the group
            ``Graph.backward_from``; every part but the first ends ``train`` by writing its
            input's gradient to io ``dx``. A part never updates.
        kept_copies: mixed precision: the dense weights' float16 copies live in the plan's HALVES
            arena, which the update writes (flow.weight_copies), rather than being cast at the start
            of the program.

    Returns:
        The graph: tensor declarations (work tensors only; the planner adds the rest) and groups.
    """
    graph = Graph()
    builder = _Builder(model, batch, graph, precision, program == "train", part, kept_copies)
    _emit_program(builder, optimiser, program, total_params, update, sample, loss_scaled, part)
    if MIXED_FUSIONS:
        _fold_casts_into_producers(graph)
        if HALF_ONLY_OUTPUTS:
            _write_halves_only(graph)
    if not kept_copies:
        _prepend_weight_casts(graph, builder.halves)
    return graph


def _fold_casts_into_producers(graph: Graph) -> None:
    """Mixed precision: each cast to fp16 whose source one launch wrote whole and last becomes that
    launch's second output where a variant writes it (_copy_op: a whole unsplit gemm_coopmat, a
    Linear's output or an input gradient with its activation derivative applied, from the
    epilogue's registers; a LayerNorm's output or input gradient; an activation's input gradient),
    with the same rounding, bit for bit, and a group left empty goes with its barrier."""
    writers: dict[str, tuple[int, int]] = {}  # tensor -> (group, index) of its last writer
    folds: dict[tuple[int, int], tuple[tuple[int, int], str]] = {}  # cast position -> its producer's, op
    for at, group in enumerate(graph.groups):
        for index, item in enumerate(group):
            producer = writers.get(item.args[0]) if item.op == "cast" else None
            fresh = producer not in (where for where, _ in folds.values())  # a producer writes one copy
            variant = _copy_op(graph.groups[producer[0]][producer[1]], item) if producer and fresh else None
            if producer and variant:
                folds[(at, index)] = (producer, variant)
                writers[item.args[1]] = producer
                continue
            writers.update((name, (at, index)) for name in _written(item))
    for (at, index), ((g, i), variant) in folds.items():
        producer, copy = graph.groups[g][i], graph.groups[at][index].args[1]
        graph.groups[g][i] = launch(variant, (*producer.args, copy), **producer.param_dict)
    kept = [[x for i, x in enumerate(group) if (at, i) not in folds] for at, group in enumerate(graph.groups)]
    if graph.backward_from is not None:
        graph.backward_from -= sum(1 for group in kept[: graph.backward_from] if not group)
    graph.groups = [group for group in kept if group]


def _write_halves_only(graph: Graph) -> None:
    """Mixed precision: a launch writing an fp32 output and its fp16 copy (registry.HALF_ONLY)
    writes only the copy where no launch of the program reads the fp32 output (a LayerNorm or a
    GEMM every reader of which reads the copy: the char GPT's LayerNorms and qkv projection)."""
    read = {arg for group in graph.groups for item in group for arg in _read(item)}
    for group in graph.groups:
        for index, item in enumerate(group):
            variant, skipped = HALF_ONLY.get(item.op, (None, ""))
            output = item.args[op_def(item.op).bindings.index(skipped)] if variant else None
            if variant and output not in read and not item.param_dict.get("accumulate"):
                group[index] = launch(variant, item.args, **item.param_dict)


def _read(item: Launch) -> set[str]:
    """The tensors a launch reads: its op's input bindings, less a GEMM's bias binding where the
    launch reads no bias and no act_grad input there (a placeholder by convention) and the output a
    _half variant leaves unwritten, plus C where it accumulates into C."""
    definition, params = op_def(item.op), item.param_dict
    unread = set() if params.get("has_bias") or params.get("act_grad") else {"bias"}
    unread |= {skipped for variant, skipped in HALF_ONLY.values() if variant == item.op}
    inputs = {name for name in definition.bindings if name not in definition.outputs and name not in unread}
    inputs |= {"C"} if params.get("accumulate") else set()
    return {arg for name, arg in zip(definition.bindings, item.args, strict=False) if name in inputs}


def _copy_op(producer: Launch, cast: Launch) -> str | None:
    """The op that writes what ``cast`` writes, the fp16 copy of all of ``producer``'s output,
    beside that output (in whole words of two halves); None where there is none."""
    params = producer.param_dict
    if cast.param("mode") != CASTS["f32_to_f16"]:
        return None
    if producer.op == "gemm_coopmat":
        m, n = int(params["M"]), int(params["N"])
        whole = int(params.get("k_splits", 1)) == 1 and m * n == int(cast.param("n"))
        fits = producer.args[3] == cast.args[0] and n % 2 == 0 and whole
        return "gemm_coopmat_copy" if fits else None
    if producer.op in HALF_COPY_OUTPUT:  # the layer norms: N * R rows of D; unary_backward: n floats
        output = producer.args[op_def(producer.op).bindings.index(HALF_COPY_OUTPUT[producer.op])]
        count = int(params["n"]) if "n" in params else int(params["N"]) * int(params["R"]) * int(params["D"])
        row = int(params.get("D", count))  # a copy's rows are whole words of halves
        fits = output == cast.args[0] and row % 2 == 0 and count == int(cast.param("n"))
        return f"{producer.op}_copy" if fits else None
    return None


def _prepend_weight_casts(graph: Graph, halves: dict[str, tuple[str, int]]) -> None:
    """Mixed precision where the plan keeps no copies (flow.weight_copies.keeps_copies): one group
    first that casts each dense weight's fp32 master to its fp16 copy (cast.comp rounds to nearest
    even, bit for bit numpy's astype). Every program refreshes its copies so, after each update and
    after a checkpoint load alike, and the copies are work tensors that no checkpoint holds. One
    cast reads 4 and writes 2 bytes a weight (the large MLP's 42 M weights: ~250 MB, ~0.1 ms of its
    ~10 ms step)."""
    if not halves:
        return
    mode = CASTS["f32_to_f16"]
    graph.groups.insert(0, [launch("cast", (w, half), n=n, mode=mode) for half, (w, n) in halves.items()])
    if graph.backward_from is not None:
        graph.backward_from += 1


def _emit_program(
    builder: _Builder,
    optimiser: Optimiser | None,
    program: str,
    total_params: int,
    update: bool,
    sample: dict[str, float] | None,
    loss_scaled: bool,
    part: tuple[int, int] | None,
) -> None:
    """build_graph's launches for ``program`` (see there), into ``builder``'s graph."""
    graph, model, batch = builder.g, builder.model, builder.b
    first = builder.stages[builder.lo] if builder.lo > 0 else None
    graph.add("x", (batch, *(first.in_shape if first else model.input_shape)), role="io")
    out = builder.forward("x")
    if builder.hi < len(builder.stages):  # a pipeline stage before the last
        graph.emit(launch("copy", (out, "output"), n=math.prod(graph.tensors[out].shape)))
        if program == "train":
            graph.backward_from = len(graph.groups)
            builder.backward(graph.add("dy", graph.tensors[out].shape, role="io"))
        return
    if program == "generate":
        assert sample is not None
        cols = graph.tensors[out].shape[-1]
        graph.emit(launch("sample_token", (out, "cursor", "token"), cols=cols, **sample))
        return
    if program == "predict":
        cols = math.prod(graph.tensors[out].shape[1:]) if out != "x" else math.prod(model.input_shape)
        if isinstance(model.loss, CrossEntropy):  # probabilities over the last dimension
            classes = graph.tensors[out].shape[-1] if out != "x" else model.input_shape[-1]
            graph.emit(launch("softmax", (out, "output"), rows=batch * cols // classes, cols=classes, log=0))
        elif isinstance(model.loss, BCEWithLogits):  # a probability per output
            sigmoid = ACTIVATIONS["sigmoid"]
            graph.emit(launch("unary", (out, "output"), n=batch * cols, fn=sigmoid, a=0.0, b=0.0))
        else:
            graph.emit(launch("copy", (out, "output"), n=batch * cols))
        return
    grad = builder.loss(out, "y", write_grad=program == "train")
    if program == "train":
        assert grad is not None and optimiser is not None
        if loss_scaled:
            n = math.prod(graph.tensors[grad].shape)
            graph.emit(launch("loss_scale_apply", (grad, LOSS_SCALE), n=n))
        builder.backward(grad)
        if update and part is None:
            halves = builder.kept_copies and bool(builder.halves)
            for group in update_groups(optimiser, optimised_floats(model, total_params), loss_scaled, halves):
                graph.emit(*group)

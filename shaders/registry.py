"""The op registry: for each op, its shader, bindings, push constants, specialisation constants,
workgroup counts and required features, the op-code tables the shaders share, and the resolution
of a launch's specialisation constants for a device. Pure data and pure functions; no device
access. The GEMM tile tables and the choice of tiles per launch live in :mod:`shaders.tiles`; the
GEMM ops' ``tune`` hooks point there.

Conventions every shader follows, so the backend can bind any op the same way:
- set 0, binding i is the i-th tensor of the launch, a std430 storage buffer;
- push constants are the op's ``push`` fields in order, 4 bytes each (uint, int or float);
- specialisation constant ids 0, 1, 2 are local_size_x/y/z; ids 3+ follow ``spec`` in order.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, replace

from flow.device_facts import DeviceFacts
from flow.program import Launch, Program
from shaders.attention_tiles import tune_attention, tune_attention_coopmat
from shaders.conv_coopmat_tiles import tune_conv_coopmat
from shaders.tiles import (
    COOPMAT_F16_SPEC,
    COOPMAT_SPEC,
    GemmTable,
    ceil_div,
    conv_gemm_shape,
    tune_conv,
    tune_conv_splitk_sum,
    tune_gemm,
    tune_gemm_coopmat,
    tune_gemm_coopmat_f16,
)

# Activation codes shared by gemm and conv epilogues and by the unary ops.
ACTIVATIONS: dict[str | None, int] = {
    None: 0,
    "none": 0,
    "relu": 1,
    "leaky_relu": 2,
    "sigmoid": 3,
    "tanh": 4,
    "gelu": 5,
}
# Unary-only functions, numbered after the activations.
UNARY_EXTRA: dict[str, int] = {"scale_shift": 6, "copy": 7, "exp": 8}
BINARY: dict[str, int] = {"add": 0, "sub": 1, "mul": 2}
REDUCE: dict[str, int] = {"sum": 0, "mean": 1, "max": 2}
CASTS: dict[str, int] = {"f32_to_f16": 0, "f16_to_f32": 1, "i32_to_f32": 2, "f32_to_i32": 3}
# The pointwise losses of mse.comp (its ``fn``), each output against its own float target.
LOSSES: dict[str, int] = {"MSE": 0, "L1": 1, "Huber": 2, "BCEWithLogits": 3}
# Every op-code table by the prefix of its GLSL names (ACT_RELU, BINARY_ADD, ...). These tables are
# the codes' one source: the shader compiler writes them into a generated op_codes.glsl
# (compiler.op_codes_glsl), so no shader spells a code as a number; tests/test_shaders.py checks it.
OP_CODES: dict[str, dict] = {
    "ACT": ACTIVATIONS,
    "UNARY": UNARY_EXTRA,
    "BINARY": BINARY,
    "REDUCE": REDUCE,
    "CAST": CASTS,
    "LOSS": LOSSES,
}

Groups = tuple[int, int, int]


# Every device allows at least 65535 workgroups per dimension. Element-wise shaders use grid-stride
# loops, so capping the count keeps any size launchable without a second grid dimension.
MAX_GROUPS = 65535


def capped_groups(items: int, per_group: int) -> Groups:
    """Workgroups for ``items`` work items, ``per_group`` each, capped at MAX_GROUPS."""
    return (max(1, min(MAX_GROUPS, ceil_div(items, per_group))), 1, 1)


@dataclass(frozen=True)
class OpDef:
    """How to launch one op.

    Attributes:
        name: registry key, used in Launch.op.
        shader: GLSL file in shaders/ (without directory).
        bindings: names of the storage buffers, in binding order.
        push: (name, "u"|"i"|"f") fields of the push-constant block, in order.
        spec: (name, default) specialisation constants after local_size_x/y/z.
        local_size: default workgroup size.
        groups: (params, local_size, spec) -> workgroup counts.
        features: device features the shader needs (e.g. "cooperative_matrix").
        outputs: the bindings it writes, for lifetimes and barriers in the planner.
    """

    name: str
    shader: str
    bindings: tuple[str, ...]
    push: tuple[tuple[str, str], ...]
    groups: Callable[[dict[str, float], tuple[int, int, int], dict[str, int]], Groups]
    local_size: tuple[int, int, int] = (256, 1, 1)
    spec: tuple[tuple[str, int], ...] = ()
    features: frozenset[str] = frozenset()
    outputs: tuple[str, ...] = ()  # bindings the op writes (the rest it only reads)
    defaults: tuple[tuple[str, float], ...] = ()  # push fields whose default is not 0
    local_from_spec: Callable[[dict[str, int]], tuple[int, int, int]] | None = None
    # (launch params, device facts, tuning table) -> specialisation constants for this launch on
    # that device (GEMM tiles, and what the launch itself needs, such as gemm's TA/TB/VEC).
    tune: Callable[[dict[str, float], DeviceFacts | None, GemmTable | None], dict[str, int]] | None = None

    def local(self, spec: dict[str, int]) -> tuple[int, int, int]:
        """The workgroup size for these specialisation constants (tiles set it for GEMM)."""
        return self.local_from_spec(spec) if self.local_from_spec else self.local_size

    def resolve(self, params: dict[str, float]) -> dict[str, float]:
        """Every push field's value: given, else its default, else 0. Both backends use this, so a
        launch that leaves a parameter out means the same thing on each."""
        values = {name: 0 for name, _ in self.push}
        values.update(dict(self.defaults))
        values.update(params)
        return values

    def pack_push(self, params: dict[str, float]) -> bytes:
        """Pack the push-constant block (missing params take their defaults, see ``resolve``)."""
        values = []
        resolved = self.resolve(params)
        for name, kind in self.push:
            value = resolved[name]
            if kind == "f":
                values.append(struct.pack("<f", float(value)))
            elif kind == "i":
                values.append(struct.pack("<i", int(value)))
            else:
                values.append(struct.pack("<I", int(value)))
        return b"".join(values)

    def spec_values(self, overrides: dict[str, int] | None = None) -> dict[str, int]:
        values = dict(self.spec)
        if overrides:
            values.update({k: v for k, v in overrides.items() if k in values})
        return values


_SGD_PUSH = (("n", "u"), ("momentum", "f"), ("nesterov", "u"), ("weight_decay", "f"))
# 1 - beta arrive precomputed in double precision, as PyTorch computes them: in float32,
# 1 - float32(0.999) is 1.3e-5 (relative) away from 0.001.
_ADAM_PUSH = (
    ("n", "u"),
    ("beta1", "f"),
    ("beta2", "f"),
    ("eps", "f"),
    ("weight_decay", "f"),
    ("decoupled", "u"),
    ("one_minus_beta1", "f"),
    ("one_minus_beta2", "f"),
)


def _linear_groups(count_param: str, per_thread: int = 1):
    def groups(params, local, spec) -> Groups:
        return capped_groups(int(params[count_param]), local[0] * per_thread)

    return groups


def _rows_groups(params, local, spec) -> Groups:
    # One workgroup per row: rows are reduced cooperatively with shared memory.
    return capped_groups(int(params["rows"]), 1)


def _coopmat_local(spec: dict[str, int]) -> Groups:
    """A cooperative-matrix tile's workgroup: one subgroup of SG invocations per WM x WN warp tile
    of its BM x BN block."""
    return (spec["BM"] // spec["WM"]) * (spec["BN"] // spec["WN"]) * spec["SG"], 1, 1


def _coopmat_gemm(name: str, shader: str, outputs: tuple[str, ...], threads: int, spec, tune) -> OpDef:
    """A tensor-core GEMM op: gemm's bindings (A, B, bias, then ``outputs``), push constants and
    grid, on devices with cooperative matrices."""
    return OpDef(
        name,
        shader,
        ("A", "B", "bias", *outputs),
        _GEMM_PUSH,
        _gemm_groups,
        local_size=(threads, 1, 1),
        spec=spec,
        features=frozenset({"cooperative_matrix"}),
        local_from_spec=_coopmat_local,
        tune=tune,
    )


def _gemm_groups(params, local, spec) -> Groups:
    splits = max(1, int(params.get("k_splits", 1)))
    return (ceil_div(int(params["N"]), spec["BN"]), ceil_div(int(params["M"]), spec["BM"]), splits)


def _gemm_fp32_groups(params, local, spec) -> Groups:
    """gemm.comp's grid: BM x BN tiles of C, or of C^T under its CT (M and N swap)."""
    swapped = {**params, "M": params["N"], "N": params["M"]} if spec.get("CT", 0) else params
    return _gemm_groups(swapped, local, spec)


def _reduce_groups(params, local, spec) -> Groups:
    outputs = int(params["cols"]) if int(params["axis"]) == 0 else int(params["rows"])
    return capped_groups(outputs, 1)


_ELEMENTWISE_PUSH = (("n", "u"), ("fn", "u"), ("a", "f"), ("b", "f"))
_CONV_PUSH = (
    ("N", "u"),
    ("C", "u"),
    ("H", "u"),
    ("W", "u"),
    ("K", "u"),
    ("R", "u"),
    ("S", "u"),
    ("stride", "u"),
    ("pad", "u"),
    ("OH", "u"),
    ("OW", "u"),
    ("has_bias", "u"),
    ("act", "u"),
    ("slope", "f"),
    ("one_d", "u"),  # a Conv1d's (C, L) seen as (C, 1, L): no padding along the height
)
# The implicit-GEMM convolutions take the direct ones' fields plus the weight gradient's split-K.
_CONV_GEMM_PUSH = (*_CONV_PUSH, ("k_splits", "u"))
_POOL_PUSH = (
    ("N", "u"),
    ("C", "u"),
    ("H", "u"),
    ("W", "u"),
    ("OH", "u"),
    ("OW", "u"),
    ("kernel", "u"),
    ("stride", "u"),
    ("pad", "u"),  # average pooling's zero padding on each side; max pooling has none
)
# A BatchNorm input viewed as [N, C, HW] (HW = 1 for flat features).
_NORM_PUSH = (("N", "u"), ("C", "u"), ("HW", "u"))
# A LayerNorm input viewed as [N * R, D]: R rows of D per sample (R = 1 for flat features).
_LAYER_NORM_PUSH = (("N", "u"), ("R", "u"), ("D", "u"), ("eps", "f"))


def layer_norm_threads(d: int) -> int:
    """Threads of a workgroup that normalises one row of ``d``: each row's sums are workgroup
    trees (a barrier a level), so a GPT's 384-wide rows on 256 threads spent most of their time
    in barriers (61 us for 16384 rows on an H100, about 3x the bytes' time; session 10)."""
    return 64 if d <= 512 else 128 if d <= 2048 else 256


# An Embedding: N samples of S ids each, a table of V rows of D.
_EMBEDDING_PUSH = (("N", "u"), ("S", "u"), ("V", "u"), ("D", "u"))


def _conv_out_groups(params, local, spec) -> Groups:
    total = int(params["N"]) * int(params["K"]) * int(params["OH"]) * int(params["OW"])
    return capped_groups(total, local[0])


def _conv_data_groups(params, local, spec) -> Groups:
    total = int(params["N"]) * int(params["C"]) * int(params["H"]) * int(params["W"])
    return capped_groups(total, local[0])


def _conv_weight_groups(params, local, spec) -> Groups:
    # One workgroup per weight element; its threads split the (n, oh, ow) sum.
    return capped_groups(int(params["K"]) * int(params["C"]) * int(params["R"]) * int(params["S"]), 1)


def _conv_gemm_groups(kind: str):
    def groups(params, local, spec) -> Groups:
        m, n, _k = conv_gemm_shape(kind, params)
        splits = max(1, int(params.get("k_splits", 1)))
        return (ceil_div(n, spec["BN"]), ceil_div(m, spec["BM"]), splits)

    return groups


def _conv_gemm(name: str, kind: str, bindings: tuple[str, ...]) -> OpDef:
    """An implicit-GEMM convolution op (conv2d_gemm*.comp): gemm.comp's tiles, chosen by tune_conv."""
    return OpDef(
        name,
        f"{name}.comp",
        bindings,
        _CONV_GEMM_PUSH,
        _conv_gemm_groups(kind),
        spec=(("BM", 64), ("BN", 64), ("BK", 16), ("TM", 4), ("TN", 4), ("ACT", 0)),
        local_from_spec=lambda s: ((s["BM"] // s["TM"]) * (s["BN"] // s["TN"]), 1, 1),
        tune=lambda params, facts, table=None: tune_conv(kind, params, facts, table),
    )


def _conv_gemm_coopmat(name: str, kind: str, bindings: tuple[str, ...]) -> OpDef:
    """A tensor-core implicit-GEMM convolution (conv2d_gemm_coopmat*.comp), for mixed precision:
    the fp32 op's bindings, push block and groups, tiles from tune_conv_coopmat."""
    return OpDef(
        name,
        f"{name}.comp",
        bindings,
        _CONV_GEMM_PUSH,
        _conv_gemm_groups(kind),
        spec=(("BM", 64), ("BN", 64), ("BK", 32), ("WM", 32), ("WN", 32), ("ACT", 0), ("SG", 32)),
        features=frozenset({"cooperative_matrix"}),
        local_from_spec=_coopmat_local,
        tune=lambda params, facts, table=None: tune_conv_coopmat(kind, params, facts),
    )


def _pool_out_groups(params, local, spec) -> Groups:
    total = int(params["N"]) * int(params["C"]) * int(params["OH"]) * int(params["OW"])
    return capped_groups(total, local[0])


def _pool_in_groups(params, local, spec) -> Groups:
    total = int(params["N"]) * int(params["C"]) * int(params["H"]) * int(params["W"])
    return capped_groups(total, local[0])


def _norm_channel_groups(params, local, spec) -> Groups:
    # One workgroup per channel: its threads split the sums over the batch and the pixels.
    return capped_groups(int(params["C"]), 1)


def _norm_element_groups(params, local, spec) -> Groups:
    return capped_groups(int(params["N"]) * int(params["C"]) * int(params["HW"]), local[0])


# Every attention op's push block; scale is normally 1 / sqrt(dh), causal 0 or 1.
_ATTENTION_PUSH = (("N", "u"), ("T", "u"), ("H", "u"), ("dh", "u"), ("scale", "f"), ("causal", "u"))


def _attention(name: str, bindings: tuple[str, ...], kind: str) -> OpDef:
    """A fused attention kernel: one workgroup per (block of BR rows, head, sample)."""
    return OpDef(
        name,
        f"{name}.comp",
        bindings,
        _ATTENTION_PUSH,
        lambda p, local, spec: (ceil_div(int(p["T"]), spec["BR"]), int(p["H"]), int(p["N"])),
        spec=(("BR", 64), ("BC", 32), ("G", 4), ("DHP", 64)),
        local_from_spec=lambda s: (s["BR"] * s["G"], 1, 1),
        tune=lambda params, facts, table=None: tune_attention(kind, params, facts),
    )


def _attention_coopmat(name: str, bindings: tuple[str, ...], kind: str) -> OpDef:
    """A tensor-core attention kernel: one workgroup of WARPS subgroups per (block of 16 * WARPS
    rows, head, sample)."""
    return OpDef(
        name,
        f"{name}.comp",
        bindings,
        _ATTENTION_PUSH,
        lambda p, local, spec: (ceil_div(int(p["T"]), 16 * spec["WARPS"]), int(p["H"]), int(p["N"])),
        spec=(("BC", 32), ("DH", 64), ("SG", 32), ("WARPS", 2), ("PREFETCH", 1), ("SYNC", 1)),
        features=frozenset({"cooperative_matrix"}),
        local_from_spec=lambda s: (s["WARPS"] * s["SG"], 1, 1),
        tune=lambda params, facts, table=None: tune_attention_coopmat(kind, params, facts),
    )


# The push constants gemm and gemm_coopmat share, all of gemm's (gemm_coopmat ignores act_grad).
_GEMM_PUSH = (
    ("M", "u"),
    ("N", "u"),
    ("K", "u"),
    ("trans_a", "u"),
    ("trans_b", "u"),
    ("has_bias", "u"),
    ("act", "u"),
    ("accumulate", "u"),
    ("alpha", "f"),
    ("slope", "f"),
    ("k_splits", "u"),
    ("act_grad", "u"),
    ("ones_row", "u"),
)

# gemm.comp's specialisation constants (TA/TB: transposition flags from trans_a/trans_b via
# tune_gemm; VEC: vec4 access mask).
_GEMM_SPEC = (
    ("BM", 64),
    ("BN", 64),
    ("BK", 16),
    ("TM", 4),
    ("TN", 4),
    ("TA", 0),
    ("TB", 0),
    ("VEC", 0),
    ("GM", 1),
    ("SK", 1),
    ("DB", 0),
    ("ACT", 0),
    ("AG", 0),
    ("KR", 0),  # 1: A (stored [M,K]) kept k-contiguous in shared memory
    ("WL", 0),  # warp tiling: lanes along n of each 32-lane warp tile (0: block-wide)
    ("XS", 0),  # 1: transposed shared stores by runs of 16 rows (conflict-free)
    ("CT", 0),  # 1: compute C^T = op(B)^T op(A)^T and store it transposed
    ("NR", 0),  # 1: no row of ones (from the launch's ones_row, via tune_gemm)
)


def _gemm_local(spec: dict[str, int]) -> Groups:
    """gemm.comp's workgroup: one invocation per TM x TN outputs of its tile, times its K slices."""
    return (spec["BM"] // spec["TM"]) * (spec["BN"] // spec["TN"]) * spec.get("SK", 1), 1, 1


def _with_copy_act(tune, name: str):
    """``tune`` plus the specialisation constant ``name`` (gemm_copy's YA, gemm_coopmat_copy's HA)
    from a launch's ``copy_act``, the activation its second output applies; left out where that is
    none, so a plain copy launch keeps the constants it had."""

    def tuned(params, facts, table=None) -> dict[str, int]:
        code = int(params.get("copy_act", 0))
        return {**tune(params, facts, table), **({name: code} if code else {})}

    return tuned


def _fp32_gemm(name: str, outputs: tuple[str, ...], spec=_GEMM_SPEC, tune=tune_gemm) -> OpDef:
    """An fp32 GEMM op (shaders/<name>.comp on gemm_body.glsl): gemm's bindings (A, B, bias, then
    ``outputs``), push constants, grid and tiles."""
    return OpDef(
        name,
        f"{name}.comp",
        ("A", "B", "bias", *outputs),
        _GEMM_PUSH,
        _gemm_fp32_groups,
        local_size=(256, 1, 1),
        spec=spec,
        local_from_spec=_gemm_local,
        tune=tune,
    )


_OPS: tuple[OpDef, ...] = (
    # C[M,N] = act(alpha * op(A) @ op(B) + bias[N] + (accumulate ? C : 0))
    _fp32_gemm("gemm", ("C",)),
    # gemm that also writes Y = act(C) for the launch's copy_act (gemm_copy.comp's YA): a Linear
    # followed by GELU in an fp32 plan writes its pre-activation and GELU of it in one launch.
    _fp32_gemm("gemm_copy", ("C", "Y"), (*_GEMM_SPEC, ("YA", 0)), _with_copy_act(tune_gemm, "YA")),
    # gemm plus a residual: C = R + act(...), R[M,N] (gemm_residual.comp): a residual block's
    # x + f(x) written by the GEMM of f, with no binary add launch.
    _fp32_gemm("gemm_residual", ("C", "R")),
    # Finishes a split-K gemm: C = act(alpha * sum over splits of W[s] + (accumulate ? C : 0) + bias).
    OpDef(
        "splitk_epilogue",
        "splitk_epilogue.comp",
        ("W", "bias", "C"),
        (
            ("M", "u"),
            ("N", "u"),
            ("splits", "u"),
            ("has_bias", "u"),
            ("act", "u"),
            ("accumulate", "u"),
            ("alpha", "f"),
            ("slope", "f"),
        ),
        lambda p, local, spec: capped_groups(int(p["M"]) * int(p["N"]), local[0]),
    ),
    # Y = f(X) elementwise; fn codes from ACTIVATIONS | UNARY_EXTRA; a = slope or scale, b = shift.
    OpDef("unary", "unary.comp", ("X", "Y"), _ELEMENTWISE_PUSH, _linear_groups("n")),
    # Y = fp16(f(X)) for an activation f, as unary then cast write it, two halves a word (Y float16).
    OpDef("unary_half", "unary_half.comp", ("X", "Y"), _ELEMENTWISE_PUSH, _linear_groups("n", 4)),
    # dX = dY * f'(.), where S is the forward output for relu/leaky/sigmoid/tanh and the input for gelu.
    # One invocation per pair of elements: unary_backward_copy writes a word of two halves.
    OpDef(
        "unary_backward", "unary_backward.comp", ("dY", "S", "dX"), _ELEMENTWISE_PUSH, _linear_groups("n", 2)
    ),
    # Z = a * (X op Y) with op from BINARY.
    OpDef("binary", "binary.comp", ("X", "Y", "Z"), _ELEMENTWISE_PUSH, _linear_groups("n")),
    # X is [rows, cols]; axis 0 reduces over rows -> [cols], axis 1 over cols -> [rows]; result * alpha.
    OpDef(
        "reduce",
        "reduce.comp",
        ("X", "Y"),
        (("rows", "u"), ("cols", "u"), ("axis", "u"), ("fn", "u"), ("alpha", "f")),
        _reduce_groups,
        local_size=(64, 1, 1),
    ),
    # out[p * cols + c] = alpha * the sum of X [rows, cols]'s column c over slice p of `parts` row
    # slices (a bias gradient; conv_splitk_sum adds the slices when parts > 1; see the shader).
    OpDef(
        "column_sum",
        "column_sum.comp",
        ("X", "outs"),
        (("rows", "u"), ("cols", "u"), ("parts", "u"), ("alpha", "f")),
        lambda p, local, spec: (ceil_div(int(p["cols"]), spec["OUTS"]), int(p["parts"]), 1),
        spec=(("OUTS", 64), ("LANES", 4)),
        local_from_spec=lambda s: (s["OUTS"], s["LANES"], 1),
    ),
    # Row-wise softmax (log=0) or log-softmax (log=1) of X [rows, cols].
    OpDef(
        "softmax",
        "softmax.comp",
        ("X", "Y"),
        (("rows", "u"), ("cols", "u"), ("log", "u")),
        _rows_groups,
        local_size=(64, 1, 1),
    ),
    # Backward of softmax / log-softmax from its output Y: dX for dY.
    OpDef(
        "softmax_backward",
        "softmax_backward.comp",
        ("Y", "dY", "dX"),
        (("rows", "u"), ("cols", "u"), ("log", "u")),
        _rows_groups,
        local_size=(64, 1, 1),
    ),
    # Fused softmax + cross-entropy on int labels over the first n = stepvals[4] rows (the rest are
    # padding): loss_rows[r] = row loss / n, correct_rows[r] (1.0 if argmax == label), and when
    # write_grad, dlogits = (softmax - onehot) / n; padding rows get 0.
    OpDef(
        "softmax_xent",
        "softmax_xent.comp",
        ("logits", "labels", "loss_rows", "correct_rows", "dlogits", "stepvals"),
        (("rows", "u"), ("cols", "u"), ("write_grad", "u"), ("per_sample", "u")),
        _rows_groups,
        local_size=(64, 1, 1),
    ),
    # softmax_xent with label smoothing and class weights (PyTorch's CrossEntropyLoss): divided by
    # weight_sum[0] (class_weight_sum's) when weighted, else as softmax_xent (see the shader).
    OpDef(
        "softmax_xent_general",
        "softmax_xent_general.comp",
        ("logits", "labels", "weights", "weight_sum", "loss_rows", "correct_rows", "dlogits", "stepvals"),
        (
            ("rows", "u"),
            ("cols", "u"),
            ("write_grad", "u"),
            ("per_sample", "u"),
            ("weighted", "u"),
            ("smoothing", "f"),
        ),
        _rows_groups,
        local_size=(64, 1, 1),
    ),
    # weight_sum[0] = the real rows' label weights summed, scaled from this batch to the divisor's.
    OpDef(
        "class_weight_sum",
        "class_weight_sum.comp",
        ("labels", "weights", "stepvals", "weight_sum"),
        (("rows", "u"), ("cols", "u"), ("per_sample", "u")),
        lambda params, local, spec: (1, 1, 1),
        local_size=(256, 1, 1),
    ),
    # softmax_xent for narrow rows with the batch totals fused: loss = mean of the first n row
    # losses, correct = count of right rows among them; one workgroup (see the shader).
    OpDef(
        "softmax_xent_totals",
        "softmax_xent_totals.comp",
        ("logits", "labels", "loss", "correct", "dlogits", "stepvals"),
        (("rows", "u"), ("cols", "u"), ("write_grad", "u"), ("per_sample", "u")),
        lambda params, local, spec: (1, 1, 1),
        local_size=(256, 1, 1),
    ),
    # Over the first n = stepvals[4] rows: loss_rows[r] = mean_c f(Y, T) / n, f by fn (LOSSES: MSE
    # by default, L1, Huber with delta, BCEWithLogits); when write_grad, dY = f' / (n * cols);
    # padding rows get 0.
    OpDef(
        "mse",
        "mse.comp",
        ("Y", "T", "loss_rows", "dY", "stepvals"),
        (("rows", "u"), ("cols", "u"), ("write_grad", "u"), ("fn", "u"), ("delta", "f")),
        _rows_groups,
        local_size=(64, 1, 1),
    ),
    # NCHW conv with square stride/pad; Y = act(conv(X, W) + bias).
    OpDef("conv2d", "conv2d.comp", ("X", "Wt", "bias", "Y"), _CONV_PUSH, _conv_out_groups),
    OpDef(
        "conv2d_backward_data", "conv2d_backward_data.comp", ("dY", "Wt", "dX"), _CONV_PUSH, _conv_data_groups
    ),
    OpDef(
        "conv2d_backward_weight",
        "conv2d_backward_weight.comp",
        ("X", "dY", "dW"),
        _CONV_PUSH,
        _conv_weight_groups,
        local_size=(64, 1, 1),
    ),
    # The same three convolutions as implicit GEMMs (tiled, im2col index math on the fly): what
    # flow.autodiff lowers Conv2d to; the direct kernels above stay as their simple references.
    # conv2d_gemm_backward_weight with k_splits > 1 writes raw partial sums into dW viewed as
    # [k_splits, K, C*R*S], for a splitk_epilogue launch to add.
    _conv_gemm("conv2d_gemm", "forward", ("X", "Wt", "bias", "Y")),
    _conv_gemm("conv2d_gemm_backward_data", "data", ("dY", "Wt", "dX")),
    _conv_gemm("conv2d_gemm_backward_weight", "weight", ("X", "dY", "dW")),
    # The same three on tensor cores (fp16 operands, fp32 sums), for mixed precision.
    _conv_gemm_coopmat("conv2d_gemm_coopmat", "forward", ("X", "Wt", "bias", "Y")),
    _conv_gemm_coopmat("conv2d_gemm_coopmat_backward_data", "data", ("dY", "Wt", "dX")),
    _conv_gemm_coopmat("conv2d_gemm_coopmat_backward_weight", "weight", ("X", "dY", "dW")),
    # dW = the sum of conv2d_gemm_backward_weight's k_splits slices of partial sums, several
    # threads per output (see the shader; tune_conv_splitk_sum sizes the workgroups).
    OpDef(
        "conv_splitk_sum",
        "conv_splitk_sum.comp",
        ("W", "dW"),
        (("total", "u"), ("splits", "u")),
        lambda params, local, spec: (ceil_div(int(params["total"]), spec["OUTS"]), 1, 1),
        spec=(("OUTS", 32), ("LANES", 8)),
        local_from_spec=lambda s: (s["OUTS"], s["LANES"], 1),
        tune=lambda params, facts, table=None: tune_conv_splitk_sum(params),
    ),
    # db[k] = sum over n and spatial of dY[n, k, :] (dY viewed as [N, K, HW]); with parts > 1,
    # per-slice sums [parts, K] for conv_splitk_sum to finish (see the shader).
    OpDef(
        "channel_sum",
        "channel_sum.comp",
        ("dY", "db"),
        (("N", "u"), ("K", "u"), ("HW", "u"), ("parts", "u")),
        lambda p, local, spec: (capped_groups(int(p["K"]), 1)[0], int(p["parts"]), 1),
        local_size=(256, 1, 1),
    ),
    # Y = max over each window; idx = flat h*W+w of the max within its channel plane.
    OpDef("maxpool2d", "maxpool2d.comp", ("X", "Y", "idx"), _POOL_PUSH, _pool_out_groups),
    OpDef("maxpool2d_backward", "maxpool2d_backward.comp", ("dY", "idx", "dX"), _POOL_PUSH, _pool_in_groups),
    # Y = mean over each window, zero padding counted (every window divides by kernel^2).
    OpDef("avgpool2d", "avgpool2d.comp", ("X", "Y"), _POOL_PUSH, _pool_out_groups),
    OpDef("avgpool2d_backward", "avgpool2d_backward.comp", ("dY", "dX"), _POOL_PUSH, _pool_in_groups),
    # Y[r, j] = alpha * X[r] for every j < cols (global average pooling's backward).
    OpDef(
        "broadcast_rows",
        "broadcast_rows.comp",
        ("X", "Y"),
        (("rows", "u"), ("cols", "u"), ("alpha", "f")),
        lambda p, local, spec: capped_groups(int(p["rows"]) * int(p["cols"]), local[0]),
    ),
    # Batch normalisation of X [N, C, HW] per channel c, over the first n = stepvals[4] rows.
    # batchnorm_stats: training=1, the batch's mean and 1/sqrt(biased var + eps) into stats[0, c]
    # and stats[1, c], and the running statistics moved toward them by momentum (unbiased var);
    # training=0, the same two rows from the running statistics.
    OpDef(
        "batchnorm_stats",
        "batchnorm_stats.comp",
        ("X", "running_mean", "running_var", "stats", "stepvals"),
        (*_NORM_PUSH, ("training", "u"), ("momentum", "f"), ("eps", "f")),
        _norm_channel_groups,
    ),
    # Y = gamma[c] * (X - stats[0, c]) * stats[1, c] + beta[c].
    OpDef(
        "batchnorm", "batchnorm.comp", ("X", "stats", "gamma", "beta", "Y"), _NORM_PUSH, _norm_element_groups
    ),
    # Over the first n rows: dbeta[c] = sum dY, dgamma[c] = sum dY * xhat; both also into stats
    # rows 2 and 3, for batchnorm_backward_data.
    OpDef(
        "batchnorm_backward_reduce",
        "batchnorm_backward_reduce.comp",
        ("dY", "X", "stats", "dgamma", "dbeta", "stepvals"),
        _NORM_PUSH,
        _norm_channel_groups,
    ),
    # dX = gamma * invstd * (dY - (dbeta + xhat * dgamma) / (n * HW)) on the first n rows, 0 below.
    OpDef(
        "batchnorm_backward_data",
        "batchnorm_backward_data.comp",
        ("dY", "X", "stats", "gamma", "stepvals", "dX"),
        _NORM_PUSH,
        _norm_element_groups,
    ),
    # Layer normalisation of each of the N * R rows of D: its mean and 1/sqrt(biased var + eps)
    # into stats[row], and Y = gamma[d] * (X - mean) * invstd + beta[d].
    OpDef(
        "layernorm",
        "layernorm.comp",
        ("X", "gamma", "beta", "Y", "stats"),
        _LAYER_NORM_PUSH,
        lambda p, local, spec: capped_groups(int(p["N"]) * int(p["R"]), 1),
        spec=(("THREADS", 256),),
        local_from_spec=lambda s: (s["THREADS"], 1, 1),
        tune=lambda params, facts, table=None: {"THREADS": layer_norm_threads(int(params["D"]))},
    ),
    # Over the rows of the first n = stepvals[4] samples: dbeta[d] = sum dY, dgamma[d] = sum dY * xhat.
    OpDef(
        "layernorm_backward_reduce",
        "layernorm_backward_reduce.comp",
        ("dY", "X", "stats", "dgamma", "dbeta", "stepvals"),
        (*_LAYER_NORM_PUSH, ("parts", "u")),
        lambda p, local, spec: (ceil_div(int(p["D"]), spec["OUTS"]), max(1, int(p.get("parts", 1))), 1),
        spec=(("OUTS", 64), ("LANES", 4)),
        local_from_spec=lambda s: (s["OUTS"], s["LANES"], 1),
    ),
    # dX = invstd * (g - mean(g) - xhat * mean(g * xhat)), g = dY * gamma, on real rows; 0 below.
    OpDef(
        "layernorm_backward_data",
        "layernorm_backward_data.comp",
        ("dY", "X", "stats", "gamma", "stepvals", "dX", "addend"),
        (*_LAYER_NORM_PUSH, ("accumulate", "u")),
        lambda p, local, spec: capped_groups(int(p["N"]) * int(p["R"]), 1),
        spec=(("THREADS", 256),),
        local_from_spec=lambda s: (s["THREADS"], 1, 1),
        tune=lambda params, facts, table=None: {"THREADS": layer_norm_threads(int(params["D"]))},
    ),
    # Fused causal (or not) multi-head self-attention on qkv [N, T, 3D] (rows [q | k | v], D = H * dh):
    # Y [N, T, D] and L [N, H, T] (each query row's log-sum-exp), no T x T buffer. The backward:
    # attention_backward_dot (Drow = rowwise dY . Y), then _kv and _q, which write disjoint columns
    # of dqkv (k and v; q), every element exactly once. Tiles per dh: attention_tiles.
    _attention("attention", ("qkv", "Y", "L"), "forward"),
    OpDef(
        "attention_backward_dot",
        "attention_backward_dot.comp",
        ("dY", "Y", "Drow"),
        _ATTENTION_PUSH,
        lambda p, local, spec: capped_groups(int(p["N"]) * int(p["T"]) * int(p["H"]), local[1]),
        local_size=(16, 16, 1),  # (lanes a row, rows a workgroup)
    ),
    _attention("attention_backward_kv", ("qkv", "dY", "L", "Drow", "dqkv"), "kv"),
    _attention("attention_backward_q", ("qkv", "dY", "L", "Drow", "dqkv"), "q"),
    # The same three on tensor cores, for mixed precision (shaders/attention_tiles.attention_ops):
    # qkv and dY rounded to fp16, P and dS multiplied as fp16, softmax and sums in fp32.
    _attention_coopmat("attention_coopmat", ("qkv", "Y", "L"), "forward"),
    _attention_coopmat("attention_coopmat_backward_kv", ("qkv", "dY", "L", "Drow", "dqkv"), "kv"),
    _attention_coopmat("attention_coopmat_backward_q", ("qkv", "dY", "L", "Drow", "dqkv"), "q"),
    # The same three reading qkv's float16 copy (mixed precision with MIXED_FUSIONS: the qkv GEMM
    # writes it), the forward also writing Y's, H, for the out-projection's GEMMs (half_bits.glsl).
    _attention_coopmat("attention_coopmat_half", ("qkv", "Y", "L", "H"), "forward"),
    _attention_coopmat("attention_coopmat_backward_kv_half", ("qkv", "dY", "L", "Drow", "dqkv"), "kv"),
    _attention_coopmat("attention_coopmat_backward_q_half", ("qkv", "dY", "L", "Drow", "dqkv"), "q"),
    # Y = X * mask * scale, the mask a hash of (seed, step stepvals[3], element): dropout's forward
    # and, on the output's gradient, its backward.
    OpDef(
        "dropout",
        "dropout.comp",
        ("X", "stepvals", "Y"),
        (("n", "u"), ("seed", "u"), ("threshold", "u"), ("scale", "f")),
        _linear_groups("n"),
    ),
    # Y[r, y_offset + c] = X[r, x_offset + c]: a block of columns between matrices (Concat).
    OpDef(
        "copy_columns",
        "copy_columns.comp",
        ("X", "Y"),
        tuple((name, "u") for name in ("rows", "cols", "x_width", "x_offset", "y_width", "y_offset")),
        lambda p, local, spec: capped_groups(int(p["rows"]) * int(p["cols"]), local[0]),
    ),
    # C[z] = op(A[z]) @ op(B[z]) for each of a batch of matrices (a MatMul layer), 16 x 16 tiles.
    OpDef(
        "bmm",
        "bmm.comp",
        ("A", "B", "C"),
        tuple((name, "u") for name in ("batch", "M", "N", "K", "trans_a", "trans_b")),
        lambda p, local, spec: (
            ceil_div(int(p["N"]), 16),
            ceil_div(int(p["M"]), 16),
            max(1, min(MAX_GROUPS, int(p["batch"]))),
        ),
        local_size=(16, 16, 1),
    ),
    # Y[r, c] = X[r, c] + B[c]: one row added to each row of a batch (a position embedding).
    OpDef(
        "add_rows",
        "add_rows.comp",
        ("X", "B", "Y"),
        (("rows", "u"), ("cols", "u")),
        lambda p, local, spec: capped_groups(int(p["rows"]) * int(p["cols"]), local[0]),
    ),
    # Y[i, :] = W[ids[i], :] for the N * S ids (float32, clamped into [0, V)) of a batch.
    OpDef(
        "embedding",
        "embedding.comp",
        ("ids", "W", "stepvals", "Y"),
        _EMBEDDING_PUSH,
        lambda p, local, spec: capped_groups(int(p["N"]) * int(p["S"]) * int(p["D"]), local[0]),
    ),
    # dW[v, :] = sum of dY[i, :] over the real rows' ids i naming v; one workgroup per table row
    # and chunk of ids (chunks > 1: dW is [chunks, V, D] partial sums for embedding_chunk_sum).
    OpDef(
        "embedding_backward",
        "embedding_backward.comp",
        ("ids", "dY", "stepvals", "dW"),
        (*_EMBEDDING_PUSH, ("chunks", "u")),
        lambda p, local, spec: capped_groups(int(p["V"]) * max(int(p.get("chunks", 0)), 1), 1),
        local_size=(128, 1, 1),
    ),
    # dW = the sum of embedding_backward's chunks, added one lane per output in chunk order.
    OpDef(
        "embedding_chunk_sum",
        "conv_splitk_sum.comp",
        ("W", "dW"),
        (("total", "u"), ("splits", "u")),
        lambda params, local, spec: capped_groups(int(params["total"]), spec["OUTS"]),
        spec=(("OUTS", 256), ("LANES", 1)),
        local_from_spec=lambda s: (s["OUTS"], s["LANES"], 1),
    ),
    # In-place optimisers over a flat parameter range; step values [lr, 1-b1^t, 1-b2^t, t] per slot.
    OpDef("sgd", "sgd.comp", ("P", "G", "M", "stepvals"), _SGD_PUSH, _linear_groups("n")),
    OpDef("adam", "adam.comp", ("P", "G", "M", "V", "stepvals"), _ADAM_PUSH, _linear_groups("n")),
    # sgd and adam with each gradient scaled by clip[1] (grad_norm's factor): clipping by global norm.
    OpDef("sgd_clip", "sgd_clip.comp", ("P", "G", "M", "stepvals", "clip"), _SGD_PUSH, _linear_groups("n")),
    OpDef(
        "adam_clip",
        "adam_clip.comp",
        ("P", "G", "M", "V", "stepvals", "clip"),
        _ADAM_PUSH,
        _linear_groups("n"),
    ),
    # Each of the four also writing H, the float16 copy of every parameter it updates (mixed
    # precision's weight copies, bit for bit cast.comp's): one invocation per word of two halves.
    *(
        OpDef(f"{name}_half", f"{name}_half.comp", (*bindings, "H"), push, _linear_groups("n", 2))
        for name, bindings, push in (
            ("sgd", ("P", "G", "M", "stepvals"), _SGD_PUSH),
            ("adam", ("P", "G", "M", "V", "stepvals"), _ADAM_PUSH),
            ("sgd_clip", ("P", "G", "M", "stepvals", "clip"), _SGD_PUSH),
            ("adam_clip", ("P", "G", "M", "V", "stepvals", "clip"), _ADAM_PUSH),
        )
    ),
    # parts > 0: Y[w] = the sum of squares of X[:n] that workgroup w strides over, for each of parts
    # workgroups; parts = 0: one workgroup joins the partials X[:n] into s, Y = [sqrt(s),
    # min(1, max_norm / (sqrt(s) + 1e-6))]. The tree needs a power-of-two workgroup size.
    OpDef(
        "grad_norm",
        "grad_norm.comp",
        ("X", "Y"),
        (("n", "u"), ("parts", "u"), ("max_norm", "f")),
        lambda p, local, spec: (max(1, int(p.get("parts", 0))), 1, 1),
    ),
    # Dynamic loss scaling (flow.optim.LOSS_SCALE): X[:n] *= S[0], the loss's gradient times the
    # scale; and one workgroup joining grad_norm's partials into Y = [unscaled norm, clip factor /
    # scale, skip] while it moves S = [scale, streak, skipped] (halve on overflow, grow after a streak).
    OpDef("loss_scale_apply", "loss_scale_apply.comp", ("X", "S"), (("n", "u"),), _linear_groups("n")),
    OpDef(
        "loss_scale_update",
        "loss_scale_update.comp",
        ("X", "S", "Y"),
        (("n", "u"), ("max_norm", "f"), ("growth_interval", "u")),
        lambda p, local, spec: (1, 1, 1),
    ),
    OpDef("fill", "fill.comp", ("X",), (("n", "u"), ("value", "f")), _linear_groups("n")),
    # Copies n 32-bit elements (float32, int32 or uint32) bit for bit.
    OpDef("copy", "copy.comp", ("X", "Y"), (("n", "u"),), _linear_groups("n")),
    # A batch from a dataset kept on the device: X[r] = float(D[idx[r]]) * a_c + b_c per channel c
    # (affine = [a_0, b_0, a_1, b_1, ...]), Y[r] = labels[idx[r]]; D holds bytes (launch param
    # bytes=1, uint8 data) or float32 (bytes=0).
    OpDef(
        "gather_rows",
        "gather_rows.comp",
        ("D", "labels", "idx", "affine", "X", "Y"),
        (("rows", "u"), ("row_elems", "u"), ("channel_elems", "u")),
        lambda params, local, spec: capped_groups(int(params["rows"]) * int(params["row_elems"]), local[0]),
        spec=(("BYTES", 0),),
        tune=lambda params, facts, table=None: {"BYTES": int(params.get("bytes", 0))},
    ),
    # n elements converted by mode (CASTS); float16 is packed two per 32-bit word.
    OpDef("cast", "cast.comp", ("X", "Y"), (("n", "u"), ("mode", "u")), _linear_groups("n")),
    # Over the first n = stepvals[4] * per_sample rows: hits[r] = 1.0 when fewer than k logits are
    # strictly greater than the label's (top-k accuracy; ties count as right), else and for padding 0.
    OpDef(
        "topk",
        "topk.comp",
        ("logits", "labels", "hits", "stepvals"),
        (("rows", "u"), ("cols", "u"), ("per_sample", "u"), ("k", "u")),
        _rows_groups,
        local_size=(64, 1, 1),
    ),
    # out[r] = argmax_c X[r, c] (first maximum), int32.
    OpDef(
        "argmax",
        "argmax.comp",
        ("X", "out"),
        (("rows", "u"), ("cols", "u")),
        _rows_groups,
        local_size=(64, 1, 1),
    ),
    # token[0] = a token drawn from row cursor[0] of L [T, cols]: temperature, top-k, softmax and a
    # counter-hash uniform of (seed, cursor[1]); one workgroup (a power of two: tree reductions).
    OpDef(
        "sample_token",
        "sample_token.comp",
        ("L", "cursor", "token"),
        (("cols", "u"), ("top_k", "u"), ("seed", "u"), ("inv_temperature", "f")),
        lambda p, local, spec: (1, 1, 1),
        local_size=(64, 1, 1),
    ),
    # gemm on tensor cores (GL_KHR_cooperative_matrix): same bindings, push constants and result,
    # but A and B are rounded to float16 (fp32 accumulate), ~1e-3 relative error. Block tile
    # BM x BN x BK; (BM/WM)*(BN/WN) subgroups of SG invocations (the device's subgroup size),
    # each a WM x WN warp tile; GM tile rows per L2 group. Defaults are the fastest on an H200 at
    # 4096^3; small problems (e.g. 256x1024x784) prefer BM=BN=32, BK=64, WM=WN=16.
    _coopmat_gemm("gemm_coopmat", "gemm_coopmat.comp", ("C",), 128, COOPMAT_SPEC, tune_gemm_coopmat),
    # gemm_coopmat with A and B float16 tensors (C and bias stay float32): the same shader with
    # AH = BH = 1, so the halves go to shared memory as they are, 16 bytes at a time, and only fp32
    # accumulation error remains against the product of the fp16 inputs. The halved staging pays
    # for wider tiles (tune_gemm_coopmat_f16); the fp16 counterpart of cuBLAS's fp16 GEMM.
    _coopmat_gemm(
        "gemm_coopmat_f16", "gemm_coopmat.comp", ("C",), 256, COOPMAT_F16_SPEC, tune_gemm_coopmat_f16
    ),
    # gemm_coopmat that also writes C's float16 copy H (cast.comp's rounding, bit for bit) from its
    # epilogue, for the next GEMMs of a mixed plan to read as halves: no cast launch, no barrier.
    # N even and no split (flow.autodiff only asks it so).
    # copy_act (HA) makes the copy fp16(act(C)): a Linear followed by GELU writes its pre-activation
    # and the next GEMM's fp16 operand GELU(C) from one epilogue.
    _coopmat_gemm(
        "gemm_coopmat_copy",
        "gemm_coopmat_copy.comp",
        ("C", "H"),
        128,
        (*COOPMAT_SPEC, ("HA", 0)),
        _with_copy_act(tune_gemm_coopmat, "HA"),
    ),
    # gemm_coopmat plus a residual: C = R + act(...), R[M,N] fp32 (gemm_coopmat_residual.comp).
    _coopmat_gemm(
        "gemm_coopmat_residual",
        "gemm_coopmat_residual.comp",
        ("C", "R"),
        128,
        COOPMAT_SPEC,
        tune_gemm_coopmat,
    ),
)

# Ops whose one fp32 output may also be written as a float16 copy, H (two halves a word, rounded as
# cast.comp rounds), by a variant "<op>_copy" of the same body: mixed precision folds the cast
# after such a launch into it (flow.autodiff._fold_casts_into_producers).
HALF_COPY_OUTPUT = {"layernorm": "Y", "layernorm_backward_data": "dX", "unary_backward": "dX"}


def _variants(names: dict[str, str], copy: bool = False, **changes) -> tuple[OpDef, ...]:
    """The ops in ``names`` again, each under its new name with the shader file of that name (with
    ``copy``, a last binding H, the float16 copy the variant writes; ``changes`` replaced too)."""
    return tuple(replace(item, name=names[item.name], shader=f"{names[item.name]}.comp",
                         bindings=(*item.bindings, *("H",) * copy), **changes)
                 for item in _OPS if item.name in names)  # fmt: skip


_OPS = (*_OPS, *_variants({op: f"{op}_copy" for op in HALF_COPY_OUTPUT}, copy=True))

# A _copy op's variant that writes only the copy H, not its fp32 output (the plan's choice where no
# launch reads that output but as halves: flow.autodiff._write_halves_only): op -> (variant, the
# output it leaves unwritten).
HALF_ONLY = {"layernorm_copy": ("layernorm_half", "Y"), "gemm_coopmat_copy": ("gemm_coopmat_half", "C")}

_OPS = (*_OPS, *_variants({op: variant for op, (variant, _) in HALF_ONLY.items()}))
# column_sum that also writes X's float16 copy H, two columns an invocation (cols even): the qkv
# bias's gradient writes dqkv's copy for the qkv GEMMs (flow.autodiff._attention_backward).
_OPS = (
    *_OPS,
    *_variants(
        {"column_sum": "column_sum_copy"},
        copy=True,
        local_from_spec=lambda s: (s["OUTS"] // 2, s["LANES"], 1),
    ),
)

# Ops with a variant whose float16 copy the hardware converts, rounded to nearest even with
# subnormals kept (SPV_KHR_float_controls): half_bits.glsl's bits but a NaN's payload, in one
# conversion a pair (the char GPT's fc1 with only its copy: 160 -> 121 us on an H100, the cost of
# the plain GEMM). resolve() picks the variant on a device with the fact fp16_exact_rounding while
# FP16_HARDWARE_ROUNDING is on (off: half_bits everywhere, for A/B runs such as
# bench/bench_epilogues.py).
FP16_ROUNDING_VARIANTS = {op: f"{op}_rte" for op in ("gemm_coopmat_copy", "gemm_coopmat_half")}
FP16_HARDWARE_ROUNDING = True
_OPS = (*_OPS, *_variants(FP16_ROUNDING_VARIANTS))

# What each op writes; everything else it binds is read only.
_OUTPUTS: dict[str, tuple[str, ...]] = {
    "gemm": ("C",),
    "gemm_copy": ("C", "Y"),
    "gemm_residual": ("C",),
    "splitk_epilogue": ("C",),
    "unary": ("Y",),
    "unary_half": ("Y",),
    "unary_backward": ("dX",),
    "unary_backward_copy": ("dX", "H"),
    "binary": ("Z",),
    "reduce": ("Y",),
    "column_sum": ("outs",),
    "column_sum_copy": ("outs", "H"),
    "softmax": ("Y",),
    "softmax_backward": ("dX",),
    "softmax_xent": ("loss_rows", "correct_rows", "dlogits"),
    "softmax_xent_totals": ("loss", "correct", "dlogits"),
    "softmax_xent_general": ("loss_rows", "correct_rows", "dlogits"),
    "class_weight_sum": ("weight_sum",),
    "mse": ("loss_rows", "dY"),
    "conv2d": ("Y",),
    "conv2d_backward_data": ("dX",),
    "conv2d_backward_weight": ("dW",),
    "conv2d_gemm": ("Y",),
    "conv2d_gemm_backward_data": ("dX",),
    "conv2d_gemm_backward_weight": ("dW",),
    "conv2d_gemm_coopmat": ("Y",),
    "conv2d_gemm_coopmat_backward_data": ("dX",),
    "conv2d_gemm_coopmat_backward_weight": ("dW",),
    "conv_splitk_sum": ("dW",),
    "channel_sum": ("db",),
    "maxpool2d": ("Y", "idx"),
    "maxpool2d_backward": ("dX",),
    "avgpool2d": ("Y",),
    "avgpool2d_backward": ("dX",),
    "broadcast_rows": ("Y",),
    "copy_columns": ("Y",),
    "add_rows": ("Y",),
    "bmm": ("C",),
    "batchnorm_stats": ("running_mean", "running_var", "stats"),
    "batchnorm": ("Y",),
    "batchnorm_backward_reduce": ("stats", "dgamma", "dbeta"),
    "batchnorm_backward_data": ("dX",),
    "layernorm": ("Y", "stats"),
    "layernorm_backward_reduce": ("dgamma", "dbeta"),
    "layernorm_backward_data": ("dX",),
    "layernorm_copy": ("Y", "stats", "H"),
    "layernorm_backward_data_copy": ("dX", "H"),
    "attention": ("Y", "L"),
    "attention_backward_dot": ("Drow",),
    "attention_backward_kv": ("dqkv",),
    "attention_backward_q": ("dqkv",),
    "attention_coopmat": ("Y", "L"),
    "attention_coopmat_backward_kv": ("dqkv",),
    "attention_coopmat_backward_q": ("dqkv",),
    "attention_coopmat_half": ("Y", "L", "H"),
    "attention_coopmat_backward_kv_half": ("dqkv",),
    "attention_coopmat_backward_q_half": ("dqkv",),
    "dropout": ("Y",),
    "embedding": ("Y",),
    "embedding_backward": ("dW",),
    "embedding_chunk_sum": ("dW",),
    "sgd": ("P", "M"),
    "adam": ("P", "M", "V"),
    "sgd_clip": ("P", "M"),
    "adam_clip": ("P", "M", "V"),
    "sgd_half": ("P", "M", "H"),
    "adam_half": ("P", "M", "V", "H"),
    "sgd_clip_half": ("P", "M", "H"),
    "adam_clip_half": ("P", "M", "V", "H"),
    "grad_norm": ("Y",),
    "loss_scale_apply": ("X",),
    "loss_scale_update": ("S", "Y"),
    "fill": ("X",),
    "copy": ("Y",),
    "gather_rows": ("X", "Y"),
    "cast": ("Y",),
    "argmax": ("out",),
    "sample_token": ("token",),
    "topk": ("hits",),
    "gemm_coopmat": ("C",),
    "gemm_coopmat_f16": ("C",),
    "gemm_coopmat_copy": ("C", "H"),
    "gemm_coopmat_residual": ("C",),
}

# Scale factors default to 1, not 0.
_DEFAULTS: dict[str, tuple[tuple[str, float], ...]] = {
    "gemm": (("alpha", 1.0), ("k_splits", 1)),
    "gemm_copy": (("alpha", 1.0), ("k_splits", 1)),
    "gemm_residual": (("alpha", 1.0), ("k_splits", 1)),
    "splitk_epilogue": (("alpha", 1.0), ("splits", 1)),
    "conv2d_gemm_backward_weight": (("k_splits", 1),),
    "conv2d_gemm_coopmat_backward_weight": (("k_splits", 1),),
    "binary": (("a", 1.0),),
    "broadcast_rows": (("alpha", 1.0),),
    "reduce": (("alpha", 1.0),),
    "column_sum": (("alpha", 1.0), ("parts", 1)),
    "column_sum_copy": (("alpha", 1.0), ("parts", 1)),
    "layernorm_backward_reduce": (("parts", 1),),
    "softmax_xent": (("per_sample", 1),),
    "softmax_xent_totals": (("per_sample", 1),),
    "softmax_xent_general": (("per_sample", 1),),
    "class_weight_sum": (("per_sample", 1),),
    "mse": (("delta", 1.0),),
    "gemm_coopmat": (("alpha", 1.0), ("k_splits", 1)),
    "gemm_coopmat_f16": (("alpha", 1.0), ("k_splits", 1)),
    "gemm_coopmat_copy": (("alpha", 1.0), ("k_splits", 1)),
    "gemm_coopmat_residual": (("alpha", 1.0), ("k_splits", 1)),
}

_OUTPUTS.update({v: tuple(o for o in _OUTPUTS[k] if o != skip) for k, (v, skip) in HALF_ONLY.items()})
_DEFAULTS.update({v: _DEFAULTS[k] for k, (v, _) in HALF_ONLY.items() if k in _DEFAULTS})
_OUTPUTS.update({v: _OUTPUTS[k] for k, v in FP16_ROUNDING_VARIANTS.items()})
_DEFAULTS.update({v: _DEFAULTS[k] for k, v in FP16_ROUNDING_VARIANTS.items() if k in _DEFAULTS})

OPS: dict[str, OpDef] = {
    op.name: replace(op, outputs=_OUTPUTS[op.name], defaults=_DEFAULTS.get(op.name, ())) for op in _OPS
}


def op(name: str) -> OpDef:
    """Look up an op definition.

    Args:
        name: the op's registry name.

    Returns:
        Its OpDef.

    Raises:
        KeyError: naming the unknown op and the known ones.
    """
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; known ops: {', '.join(sorted(OPS))}") from None


def resolve(launch: Launch, facts: DeviceFacts | None, table: GemmTable | None = None) -> Launch:
    """``launch`` with the specialisation constants its op needs on ``facts``'s device (GEMM tiles
    from ``table`` or the size heuristic), and the op's hardware-rounding variant where the device
    has one (FP16_ROUNDING_VARIANTS); unchanged for ops tuned nowhere. The planner resolves
    every launch of a run this way, so ``flow plan`` shows the tiles a device will run; a backend
    resolves a hand-made launch (an op test, a benchmark) the same way when it records it.

    Args:
        launch: the launch.
        facts: the device, or None (the defaults every device can run).
        table: the device's tuning table, or None.

    Returns:
        The launch with ``constants`` set (sorted by name).
    """
    exact = facts is not None and facts.has("fp16_exact_rounding") and FP16_HARDWARE_ROUNDING
    if exact and launch.op in FP16_ROUNDING_VARIANTS:
        launch = replace(launch, op=FP16_ROUNDING_VARIANTS[launch.op])
    definition = op(launch.op)
    if definition.tune is None:
        return launch
    constants = definition.tune(launch.param_dict, facts, table)
    return replace(launch, constants=tuple(sorted(constants.items())))


def resolve_program(program: Program, facts: DeviceFacts | None, table: GemmTable | None = None) -> Program:
    """``program`` with every launch resolved (see :func:`resolve`); barriers as they are.

    Args:
        program: the program.
        facts: the device, or None.
        table: the device's tuning table, or None.

    Returns:
        The resolved program.
    """
    steps = tuple(resolve(s, facts, table) if isinstance(s, Launch) else s for s in program.steps)
    return replace(program, steps=steps)

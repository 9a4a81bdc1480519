"""The op registry: for each op, its shader, bindings, push constants, specialisation constants,
workgroup counts and required features. Pure data and pure functions; no device access.

Conventions every shader follows, so the backend can bind any op the same way:
- set 0, binding i is the i-th tensor of the launch, a std430 storage buffer;
- push constants are the op's ``push`` fields in order, 4 bytes each (uint, int or float);
- specialisation constant ids 0, 1, 2 are local_size_x/y/z; ids 3+ follow ``spec`` in order.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from flow.device_facts import DeviceFacts
from flow.program import Launch, Program
from shaders import gemm_tuning

# A device's measured GEMM tiles by launch shape (gemm_tuning.shape_key -> tile constants): data
# the caller loads (gemm_tuning.load_table), so choosing tiles stays pure.
GemmTable = Mapping[str, Mapping[str, int]]

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
# Every op-code table by the prefix of its GLSL names (ACT_RELU, BINARY_ADD, ...). These tables are
# the codes' one source: the shader compiler writes them into a generated op_codes.glsl
# (compiler.op_codes_glsl), so no shader spells a code as a number; tests/test_shaders.py checks it.
OP_CODES: dict[str, dict] = {
    "ACT": ACTIVATIONS,
    "UNARY": UNARY_EXTRA,
    "BINARY": BINARY,
    "REDUCE": REDUCE,
    "CAST": CASTS,
}

Groups = tuple[int, int, int]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


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


def _linear_groups(count_param: str, per_thread: int = 1):
    def groups(params, local, spec) -> Groups:
        return capped_groups(int(params[count_param]), local[0] * per_thread)

    return groups


def _rows_groups(params, local, spec) -> Groups:
    # One workgroup per row: rows are reduced cooperatively with shared memory.
    return capped_groups(int(params["rows"]), 1)


def gemm_shared_bytes(bm: int, bn: int, bk: int, sk: int = 1, db: int = 0) -> int:
    """Shared memory gemm.comp needs for these tiles: 1 + db buffers of BK rows of BM + 4 and BN + 4
    floats (the padding keeps vec4 rows aligned and spreads column stores over the banks), plus,
    with sk > 1 K slices, one BM x BN partial tile through which the slices sum (16 bytes else)."""
    return (1 + db) * bk * (bm + 4 + bn + 4) * 4 + min(sk - 1, 1) * bm * bn * 4 + 16


# Fallback fp32 GEMM tiles, for shapes a device's tuning table does not list, largest first. The
# defaults come from bench/sweep_gemm.py on an H100: single-buffered shared tiles (DB 0) beat
# double-buffered ones at every size measured; 64 x 128 x 32 with 4 x 8 per thread was best for
# big shapes with A row-major (4096^3: 37.8 TFLOP/s, against 36.5 with 128 x 128 x 32 and 31.8
# with 64 x 128 x 16; BK 32 halves the barriers per K), and fits lavapipe's 32 KiB of shared
# memory; sliced K for an MLP's batch of 256 (256 x 1024 x 1024 in 31 us against 48 us with
# the best plain tile).
GEMM_TILES: tuple[dict[str, int], ...] = (
    {"BM": 64, "BN": 128, "BK": 32, "TM": 4, "TN": 8, "GM": 8, "SK": 1, "DB": 0},
    {"BM": 64, "BN": 64, "BK": 16, "TM": 4, "TN": 4, "GM": 1, "SK": 1, "DB": 0},
    # Too few tiles to fill the GPU and a long K: 4 slices of K per 32 x 32 tile.
    {"BM": 32, "BN": 32, "BK": 32, "TM": 4, "TN": 4, "GM": 1, "SK": 4, "DB": 0},
    # Too few tiles and a short K.
    {"BM": 32, "BN": 64, "BK": 16, "TM": 2, "TN": 4, "GM": 1, "SK": 1, "DB": 0},
)
# Enough workgroups to fill a big GPU (an H100 has 132 multiprocessors).
GEMM_MIN_WORKGROUPS = 128
# Below this K, slicing K leaves each slice too little work.
GEMM_SLICED_MIN_K = 128
# On a CPU driver (lavapipe): few wide threads.
GEMM_CPU_TILES = GEMM_TILES[1]
# Constants a tuning-table entry or a fallback tile may leave out.
GEMM_SPEC_DEFAULTS = {"GM": 1, "SK": 1, "DB": 0}


def tune_gemm(
    params: dict[str, float], facts: DeviceFacts | None, table: GemmTable | None = None
) -> dict[str, int]:
    """Specialise gemm for one launch. Tiles: the device's tuning table (``table``, see
    gemm_tuning) when it lists this exact shape; else the first of GEMM_TILES that fits the device and still
    yields enough workgroups to keep every multiprocessor busy (big tiles waste a GPU on an
    MLP's batch of 256), then sliced K, then the smallest tile; on a CPU driver (lavapipe), or
    with no facts, GEMM_CPU_TILES. TA/TB: the launch's trans_a/trans_b (the shader compiles one
    load path per pair, so these are required for a correct result, whatever the tiles). VEC:
    which operands take vec4 global access (bit 0 A, bit 1 B, bit 2 C): those whose contiguous
    dimension is a multiple of 4 (tensor offsets are 256-byte aligned, so their rows then start
    16-byte aligned).

    Args:
        params: the launch's parameters (M, N, K, trans_a, trans_b).
        facts: the device, or None (default tiles).
        table: the device's tuning table, or None.

    Returns:
        Specialisation constants BM, BN, BK, TM, TN, GM, SK, DB, TA, TB, VEC, and ACT and AG
        (the launch's act and act_grad: the shader compiles only the epilogue in use).
    """
    m, n, k = int(params["M"]), int(params["N"]), int(params.get("K", 0))
    ta, tb = int(bool(params.get("trans_a", 0))), int(bool(params.get("trans_b", 0)))
    choice = GEMM_CPU_TILES
    if facts is not None and facts.kind != "cpu":
        shared, threads = facts.shared_memory_bytes, facts.max_workgroup_invocations
        tuned = (table or {}).get(gemm_tuning.shape_key(m, n, k, ta, tb))
        if tuned and gemm_fits(tuned, shared, threads):
            choice = tuned
        else:
            fitting = [t for t in GEMM_TILES if gemm_fits(t, shared, threads)] or [GEMM_CPU_TILES]
            plain = [t for t in fitting if t["SK"] == 1]
            sliced = [t for t in fitting if t["SK"] > 1 and k >= GEMM_SLICED_MIN_K]
            filling = [t for t in plain if ceil_div(m, t["BM"]) * ceil_div(n, t["BN"]) >= GEMM_MIN_WORKGROUPS]
            if filling:
                choice = filling[0]
            elif sliced:
                choice = sliced[0]
            else:
                choice = (plain or fitting)[-1]
    # Under a row of ones (ones_row) A stores M - 1 rows; vec4 granules must not reach the ones.
    stored_m = m - min(int(params.get("ones_row", 0)), 1)
    vec = int((stored_m if ta else k) % 4 == 0) | int((k if tb else n) % 4 == 0) << 1 | int(n % 4 == 0) << 2
    epilogue = {"ACT": int(params.get("act", 0)), "AG": int(params.get("act_grad", 0))}
    return {**GEMM_SPEC_DEFAULTS, **choice, "TA": ta, "TB": tb, "VEC": vec, **epilogue}


def gemm_fits(tiles: dict[str, int], shared_bytes: int, max_threads: int) -> bool:
    """Whether gemm.comp with these tile constants fits a device's shared memory and workgroup size."""
    sk, db = tiles.get("SK", 1), tiles.get("DB", 0)
    threads = (tiles["BM"] // tiles["TM"]) * (tiles["BN"] // tiles["TN"]) * sk
    need = gemm_shared_bytes(tiles["BM"], tiles["BN"], tiles["BK"], sk, db)
    return threads <= max_threads and need <= shared_bytes


def _gemm_groups(params, local, spec) -> Groups:
    splits = max(1, int(params.get("k_splits", 1)))
    return (ceil_div(int(params["N"]), spec["BN"]), ceil_div(int(params["M"]), spec["BM"]), splits)


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
)
_POOL_PUSH = (
    ("N", "u"),
    ("C", "u"),
    ("H", "u"),
    ("W", "u"),
    ("OH", "u"),
    ("OW", "u"),
    ("kernel", "u"),
    ("stride", "u"),
)


def _conv_out_groups(params, local, spec) -> Groups:
    total = int(params["N"]) * int(params["K"]) * int(params["OH"]) * int(params["OW"])
    return capped_groups(total, local[0])


def _conv_data_groups(params, local, spec) -> Groups:
    total = int(params["N"]) * int(params["C"]) * int(params["H"]) * int(params["W"])
    return capped_groups(total, local[0])


def _conv_weight_groups(params, local, spec) -> Groups:
    # One workgroup per weight element; its threads split the (n, oh, ow) sum.
    return capped_groups(int(params["K"]) * int(params["C"]) * int(params["R"]) * int(params["S"]), 1)


def _pool_out_groups(params, local, spec) -> Groups:
    total = int(params["N"]) * int(params["C"]) * int(params["OH"]) * int(params["OW"])
    return capped_groups(total, local[0])


def _pool_in_groups(params, local, spec) -> Groups:
    total = int(params["N"]) * int(params["C"]) * int(params["H"]) * int(params["W"])
    return capped_groups(total, local[0])


# The push constants gemm and gemm_coopmat share (gemm adds k_splits).
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
)

# -- cooperative-matrix GEMM (gemm_coopmat.comp) ---------------------------------------------------

# Specialisation constants after the tiles: AH/BH (operand is float16 in memory), PD (K slabs in
# flight in registers) and NS (shared stages); see the shader's header.
_COOPMAT_SPEC = (
    ("BM", 128),
    ("BN", 128),
    ("BK", 32),
    ("WM", 64),
    ("WN", 64),
    ("SG", 32),
    ("GM", 8),
    ("AH", 0),
    ("BH", 0),
    ("PD", 1),
    ("NS", 2),
)
# Shared memory per workgroup assumed where the device is unknown: NVIDIA's Vulkan limit (48 KiB),
# the smallest among the drivers with cooperative matrices we know of.
COOPMAT_ASSUMED_SHARED_BYTES = 49152
# Tiles for fp16 inputs, first choice first: the first that fits the device's shared memory and
# still gives GEMM_MIN_WORKGROUPS workgroups, else COOPMAT_F16_SMALL. Order from bench/sweep_coopmat.py
# on an H100 (48 KiB of shared memory, 2026-11-22): 128x256x32 with one shared stage was the best
# fixed tile over 4096^3, 8192^3 and 4000^3 (120, 128 and 86 TFLOP/s); 128x256x32 with two stages
# needs 60 KiB and is taken only where a driver reports that much; 32x32x64 was best at 256 x 1024 x
# 784 (37 TFLOP/s, 1.5x cuBLAS fp16 there).
COOPMAT_F16_TILES: tuple[dict[str, int], ...] = (
    {"BM": 128, "BN": 256, "BK": 32, "WM": 64, "WN": 64, "PD": 1, "NS": 2},
    {"BM": 128, "BN": 256, "BK": 32, "WM": 64, "WN": 64, "PD": 1, "NS": 1},
    {"BM": 128, "BN": 128, "BK": 64, "WM": 64, "WN": 64, "PD": 1, "NS": 1},
    {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 64, "PD": 1, "NS": 2},
    {"BM": 64, "BN": 64, "BK": 64, "WM": 32, "WN": 32, "PD": 1, "NS": 2},
)
COOPMAT_F16_SMALL: dict[str, int] = {"BM": 32, "BN": 32, "BK": 64, "WM": 16, "WN": 16, "PD": 1, "NS": 2}


def coopmat_shared_bytes(spec: dict[str, int]) -> int:
    """Shared memory one gemm_coopmat workgroup declares for these specialisation constants (missing
    ones take the registry defaults); the shader's SMEM_VECS, in bytes."""
    s = {**dict(_COOPMAT_SPEC), **spec}
    pad = 8  # halves of padding per shared row
    a_halves = max(s["BM"] * (s["BK"] + pad), s["BK"] * (s["BM"] + pad))
    b_halves = max(s["BK"] * (s["BN"] + pad), s["BN"] * (s["BK"] + pad))
    stage = (a_halves + b_halves) // 8
    main = (((s["NS"] - 1) & 1) + 1) * stage
    epilogue = (s["BM"] // s["WM"]) * (s["BN"] // s["WN"]) * 16 * ((s["WN"] + 4) // 4)
    return 16 * max(main, epilogue)


def coopmat_tile_problem(spec: dict[str, int], facts: DeviceFacts | None = None) -> str | None:
    """Why gemm_coopmat cannot run with these specialisation constants (missing ones take the
    registry defaults), or None when it can. Without facts only the shader's own rules are checked.

    Args:
        spec: specialisation constants, e.g. {"BM": 128, "BN": 256, "BK": 16, "WM": 64, "WN": 64}.
        facts: the device (``subgroup_size``, ``shared_memory_bytes``, ``max_workgroup_invocations``).

    Returns:
        A sentence, or None.
    """
    s = {**dict(_COOPMAT_SPEC), **spec}
    bm, bn, bk, wm, wn = s["BM"], s["BN"], s["BK"], s["WM"], s["WN"]
    if min(wm, wn, bk) < 16 or wm % 16 or wn % 16 or bk % 16:
        return f"WM={wm}, WN={wn} and BK={bk} must be multiples of 16"
    if bm % wm or bn % wn:
        return f"the block tile {bm}x{bn} must be a multiple of the warp tile {wm}x{wn}"
    if s["PD"] < 1 or s["NS"] not in (1, 2) or s["AH"] not in (0, 1) or s["BH"] not in (0, 1):
        return f"PD={s['PD']} must be >= 1, NS={s['NS']} 1 or 2, AH/BH 0 or 1"
    if facts is None:
        return None
    threads = (bm // wm) * (bn // wn) * s["SG"]
    allowed = facts.max_workgroup_invocations
    if threads > allowed:
        return f"needs {threads} invocations per workgroup; the device allows {allowed}"
    if s["SG"] != facts.subgroup_size:
        return f"SG={s['SG']} is not the device's subgroup size {facts.subgroup_size}"
    shared = coopmat_shared_bytes(s)
    limit = facts.shared_memory_bytes
    if shared > limit:
        return f"needs {shared} B of shared memory; the device has {limit}"
    return None


def tune_gemm_coopmat_f16(
    params: dict[str, float], facts: DeviceFacts | None, table: GemmTable | None = None
) -> dict[str, int]:
    """Specialise gemm_coopmat_f16 for one launch: the first of COOPMAT_F16_TILES that the device
    can run (with no facts: 48 KiB of shared memory) and that gives at least GEMM_MIN_WORKGROUPS
    workgroups, else COOPMAT_F16_SMALL; AH = BH = 1 always, since they say how A and B are read.

    Args:
        params: the launch's parameters (M and N are read).
        facts: the device, or None (tuning off).
        table: unused (no table is measured for tensor-core tiles yet).

    Returns:
        Specialisation constants BM, BN, BK, WM, WN, PD, NS, AH, BH.
    """
    m, n = int(params["M"]), int(params["N"])
    # Only shared memory is checked against the device: SG stays the registry's, as for gemm_coopmat.
    shared = facts.shared_memory_bytes if facts is not None else COOPMAT_ASSUMED_SHARED_BYTES
    choice = COOPMAT_F16_SMALL
    for tiles in COOPMAT_F16_TILES:
        if coopmat_shared_bytes(tiles) <= shared:
            if ceil_div(m, tiles["BM"]) * ceil_div(n, tiles["BN"]) >= GEMM_MIN_WORKGROUPS:
                choice = tiles
                break
    return {**choice, "AH": 1, "BH": 1}


# gemm_coopmat_f16's defaults (tune_gemm_coopmat_f16 replaces the tiles per launch): 128x256x16
# with two slabs in flight and two shared stages, which fits in the assumed 48 KiB.
_COOPMAT_F16_DEFAULT = {
    "BM": 128,
    "BN": 256,
    "BK": 16,
    "WM": 64,
    "WN": 64,
    "PD": 2,
    "NS": 2,
    "AH": 1,
    "BH": 1,
}
_COOPMAT_F16_SPEC = tuple((name, _COOPMAT_F16_DEFAULT.get(name, value)) for name, value in _COOPMAT_SPEC)


_OPS: tuple[OpDef, ...] = (
    # C[M,N] = act(alpha * op(A) @ op(B) + bias[N] + (accumulate ? C : 0))
    OpDef(
        "gemm",
        "gemm.comp",
        ("A", "B", "bias", "C"),
        (*_GEMM_PUSH, ("k_splits", "u"), ("act_grad", "u"), ("ones_row", "u")),
        _gemm_groups,
        local_size=(256, 1, 1),
        # TA/TB: transposition flags (from trans_a/trans_b via tune_gemm); VEC: vec4 access mask.
        spec=(
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
        ),
        local_from_spec=lambda s: ((s["BM"] // s["TM"]) * (s["BN"] // s["TN"]) * s.get("SK", 1), 1, 1),
        tune=tune_gemm,
    ),
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
    # dX = dY * f'(.), where S is the forward output for relu/leaky/sigmoid/tanh and the input for gelu.
    OpDef("unary_backward", "unary_backward.comp", ("dY", "S", "dX"), _ELEMENTWISE_PUSH, _linear_groups("n")),
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
        (("rows", "u"), ("cols", "u"), ("write_grad", "u")),
        _rows_groups,
        local_size=(64, 1, 1),
    ),
    # softmax_xent for narrow rows with the batch totals fused: loss = mean of the first n row
    # losses, correct = count of right rows among them; one workgroup (see the shader).
    OpDef(
        "softmax_xent_totals",
        "softmax_xent_totals.comp",
        ("logits", "labels", "loss", "correct", "dlogits", "stepvals"),
        (("rows", "u"), ("cols", "u"), ("write_grad", "u")),
        lambda params, local, spec: (1, 1, 1),
        local_size=(256, 1, 1),
    ),
    # Over the first n = stepvals[4] rows: loss_rows[r] = mean_c (Y - T)^2 / n; when write_grad,
    # dY = 2 (Y - T) / (n * cols); padding rows get 0.
    OpDef(
        "mse",
        "mse.comp",
        ("Y", "T", "loss_rows", "dY", "stepvals"),
        (("rows", "u"), ("cols", "u"), ("write_grad", "u")),
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
    # db[k] = sum over n and spatial of dY[n, k, :] (dY viewed as [N, K, HW]).
    OpDef(
        "channel_sum",
        "channel_sum.comp",
        ("dY", "db"),
        (("N", "u"), ("K", "u"), ("HW", "u")),
        lambda p, local, spec: capped_groups(int(p["K"]), 1),
        local_size=(64, 1, 1),
    ),
    # Y = max over each window; idx = flat h*W+w of the max within its channel plane.
    OpDef("maxpool2d", "maxpool2d.comp", ("X", "Y", "idx"), _POOL_PUSH, _pool_out_groups),
    OpDef("maxpool2d_backward", "maxpool2d_backward.comp", ("dY", "idx", "dX"), _POOL_PUSH, _pool_in_groups),
    # In-place optimisers over a flat parameter range; step values [lr, 1-b1^t, 1-b2^t, t] per slot.
    OpDef(
        "sgd",
        "sgd.comp",
        ("P", "G", "M", "stepvals"),
        (("n", "u"), ("momentum", "f"), ("nesterov", "u"), ("weight_decay", "f")),
        _linear_groups("n"),
    ),
    OpDef(
        "adam",
        "adam.comp",
        ("P", "G", "M", "V", "stepvals"),
        # 1 - beta arrive precomputed in double precision, as PyTorch computes them: in float32,
        # 1 - float32(0.999) is 1.3e-5 (relative) away from 0.001.
        (
            ("n", "u"),
            ("beta1", "f"),
            ("beta2", "f"),
            ("eps", "f"),
            ("weight_decay", "f"),
            ("decoupled", "u"),
            ("one_minus_beta1", "f"),
            ("one_minus_beta2", "f"),
        ),
        _linear_groups("n"),
    ),
    OpDef("fill", "fill.comp", ("X",), (("n", "u"), ("value", "f")), _linear_groups("n")),
    # Copies n 32-bit elements (float32, int32 or uint32) bit for bit.
    OpDef("copy", "copy.comp", ("X", "Y"), (("n", "u"),), _linear_groups("n")),
    # n elements converted by mode (CASTS); float16 is packed two per 32-bit word.
    OpDef("cast", "cast.comp", ("X", "Y"), (("n", "u"), ("mode", "u")), _linear_groups("n")),
    # out[r] = argmax_c X[r, c] (first maximum), int32.
    OpDef(
        "argmax",
        "argmax.comp",
        ("X", "out"),
        (("rows", "u"), ("cols", "u")),
        _rows_groups,
        local_size=(64, 1, 1),
    ),
    # gemm on tensor cores (GL_KHR_cooperative_matrix): same bindings, push constants and result,
    # but A and B are rounded to float16 (fp32 accumulate), ~1e-3 relative error. Block tile
    # BM x BN x BK; (BM/WM)*(BN/WN) subgroups of SG invocations (the device's subgroup size),
    # each a WM x WN warp tile; GM tile rows per L2 group. Defaults are the fastest on an H200 at
    # 4096^3; small problems (e.g. 256x1024x784) prefer BM=BN=32, BK=64, WM=WN=16.
    OpDef(
        "gemm_coopmat",
        "gemm_coopmat.comp",
        ("A", "B", "bias", "C"),
        _GEMM_PUSH,
        _gemm_groups,
        local_size=(128, 1, 1),
        spec=_COOPMAT_SPEC,
        features=frozenset({"cooperative_matrix"}),
        local_from_spec=lambda s: ((s["BM"] // s["WM"]) * (s["BN"] // s["WN"]) * s["SG"], 1, 1),
        # The largest tile that still gives GEMM_MIN_WORKGROUPS workgroups, else the smallest.
        tune=lambda params, facts, table=None: dict(
            zip(
                ("BM", "BN", "BK", "WM", "WN"),
                next(
                    (
                        t
                        for t in ((128, 128, 32, 64, 64), (64, 64, 64, 32, 32))
                        if ceil_div(int(params["M"]), t[0]) * ceil_div(int(params["N"]), t[1])
                        >= GEMM_MIN_WORKGROUPS
                    ),
                    (32, 32, 64, 16, 16),
                ),
                strict=True,
            )
        ),
    ),
    # gemm_coopmat with A and B float16 tensors (C and bias stay float32): the same shader with
    # AH = BH = 1, so the halves go to shared memory as they are, 16 bytes at a time, and only fp32
    # accumulation error remains against the product of the fp16 inputs. The halved staging pays
    # for wider tiles (tune_gemm_coopmat_f16); the fp16 counterpart of cuBLAS's fp16 GEMM.
    OpDef(
        "gemm_coopmat_f16",
        "gemm_coopmat.comp",
        ("A", "B", "bias", "C"),
        _GEMM_PUSH,
        _gemm_groups,
        local_size=(256, 1, 1),
        spec=_COOPMAT_F16_SPEC,
        features=frozenset({"cooperative_matrix"}),
        local_from_spec=lambda s: ((s["BM"] // s["WM"]) * (s["BN"] // s["WN"]) * s["SG"], 1, 1),
        tune=tune_gemm_coopmat_f16,
    ),
)

# What each op writes; everything else it binds is read only.
_OUTPUTS: dict[str, tuple[str, ...]] = {
    "gemm": ("C",),
    "splitk_epilogue": ("C",),
    "unary": ("Y",),
    "unary_backward": ("dX",),
    "binary": ("Z",),
    "reduce": ("Y",),
    "softmax": ("Y",),
    "softmax_backward": ("dX",),
    "softmax_xent": ("loss_rows", "correct_rows", "dlogits"),
    "softmax_xent_totals": ("loss", "correct", "dlogits"),
    "mse": ("loss_rows", "dY"),
    "conv2d": ("Y",),
    "conv2d_backward_data": ("dX",),
    "conv2d_backward_weight": ("dW",),
    "channel_sum": ("db",),
    "maxpool2d": ("Y", "idx"),
    "maxpool2d_backward": ("dX",),
    "sgd": ("P", "M"),
    "adam": ("P", "M", "V"),
    "fill": ("X",),
    "copy": ("Y",),
    "cast": ("Y",),
    "argmax": ("out",),
    "gemm_coopmat": ("C",),
    "gemm_coopmat_f16": ("C",),
}

# Scale factors default to 1, not 0.
_DEFAULTS: dict[str, tuple[tuple[str, float], ...]] = {
    "gemm": (("alpha", 1.0), ("k_splits", 1)),
    "splitk_epilogue": (("alpha", 1.0), ("splits", 1)),
    "binary": (("a", 1.0),),
    "reduce": (("alpha", 1.0),),
    "gemm_coopmat": (("alpha", 1.0),),
    "gemm_coopmat_f16": (("alpha", 1.0),),
}

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
    from ``table`` or the size heuristic); unchanged for ops tuned nowhere. The planner resolves
    every launch of a run this way, so ``flow plan`` shows the tiles a device will run; a backend
    resolves a hand-made launch (an op test, a benchmark) the same way when it records it.

    Args:
        launch: the launch.
        facts: the device, or None (the defaults every device can run).
        table: the device's tuning table, or None.

    Returns:
        The launch with ``constants`` set (sorted by name).
    """
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


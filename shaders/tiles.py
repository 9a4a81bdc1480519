"""GEMM tiles: the tile tables of the fp32 GEMM (gemm.comp) and of the cooperative-matrix GEMM
(gemm_coopmat.comp), what each tile needs from a device (shared memory, invocations, subgroup
size), and the choice of tiles for one launch on one device. Pure: a device's measured table
(:mod:`shaders.gemm_tuning`) arrives as data, and the op registry (:mod:`shaders.registry`) calls
:func:`tune_gemm`, :func:`tune_gemm_coopmat` and :func:`tune_gemm_coopmat_f16` as its ops' ``tune``.
"""

from __future__ import annotations

from collections.abc import Mapping

from flow.device_facts import DeviceFacts
from shaders import gemm_tuning

# A device's measured GEMM tiles by launch shape (gemm_tuning.shape_key -> tile constants): data
# the caller loads (gemm_tuning.load_table), so choosing tiles stays pure.
GemmTable = Mapping[str, Mapping[str, int]]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def gemm_shared_bytes(bm: int, bn: int, bk: int, sk: int = 1, db: int = 0) -> int:
    """Shared memory gemm.comp needs for these tiles: 1 + db buffers of BK rows of BN + 4 floats
    for B and, for A, room for BK rows of BM + 4 or BM rows of BK + 4 (k-major or k-contiguous,
    see the shader's KR; the padding keeps vec4 rows aligned and spreads stores over the banks),
    plus, with sk > 1 K slices, one BM x BN partial tile through which the slices sum (16 bytes
    else)."""
    a_words = bk * bm + 4 * max(bm, bk)
    return (1 + db) * (a_words + bk * (bn + 4)) * 4 + min(sk - 1, 1) * bm * bn * 4 + 16


# Fallback fp32 GEMM tiles, for shapes a device's tuning table does not list, largest first. The
# defaults come from bench/sweep_gemm.py on an H100: single-buffered shared tiles (DB 0) beat
# double-buffered ones at every size measured; for big shapes 128 x 128 x 16 with 8 x 8 per thread
# and A kept k-contiguous in shared memory (KR 1) was within 3 % of the best tile in every
# transposition (4096^3: 39.0 TFLOP/s, A k-major 43.3; 8192 x 4096 x 4096 with B transposed
# 37.7), where the earlier 64 x 128 x 32 / 4 x 8 fell to 27.3 with B transposed; it fits
# lavapipe's 32 KiB of shared memory. Warp tiles of 32 x 64 (WL 8, session 13, measured while every
# launch still tested for a row of ones, see gemm.comp's NR): A k-major 42.9 -> 44.1, B transposed
# 38.1 -> 38.2, row-major A unchanged (39.2). Sliced K for an MLP's batch of 256 (256 x 1024 x 1024
# in 31 us against 48 us with the best plain tile). Where 35 KiB of shared memory fit (GPUs), the
# same tile with BK 32 and warp tiles of 32 x 32 (WL 4) comes first: on the char GPT's twelve
# GEMM shapes (bench/sweep_gemm.py --only gpt, H100, session 16) it took 18-30 % less time than
# the BK 16 tile (16384 x 1152 x 384: 483 -> 364 us, 0.73 -> 0.97 of cuBLAS), and the tuning
# table's large shapes mostly chose it too.
GEMM_TILES: tuple[dict[str, int], ...] = (
    {"BM": 128, "BN": 128, "BK": 32, "TM": 8, "TN": 8, "GM": 8, "SK": 1, "DB": 0, "WL": 4},
    {"BM": 128, "BN": 128, "BK": 16, "TM": 8, "TN": 8, "GM": 8, "SK": 1, "DB": 0, "KR": 1, "WL": 8},
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
# Split-K over GEMM_TILES[0] (gemm_k_splits): about two such workgroups a multiprocessor
# of an H100, each slice at least GEMM_SPLIT_MIN_K deep.
GEMM_SPLIT_WORKGROUPS = 264
GEMM_SPLIT_MIN_K = 512


def gemm_k_splits(m: int, n: int, k: int) -> int:
    """How many slices to split a gemm (fp32) launch's K into, 1 to 16: 1 when the output fills a
    GPU or K is short. A few 32 x 32 tiles over a long K (a classifier's logits: 256 x 10 x 1024)
    take up to 128 workgroups. An output of many small tiles but few of GEMM_TILES[0]'s (a weight
    gradient over many rows: the char GPT's 385 x 1536 x 16384 has 48) takes the big tile's slices
    up to GEMM_SPLIT_WORKGROUPS, each at least GEMM_SPLIT_MIN_K deep: on an H100 the smaller tile
    unsplit ran that shape at 14 TFLOP/s (session 16)."""
    tiles = ceil_div(m, 32) * ceil_div(n, 32)
    big = ceil_div(m, GEMM_TILES[0]["BM"]) * ceil_div(n, GEMM_TILES[0]["BN"])
    if k < 256 or big >= GEMM_MIN_WORKGROUPS:
        return 1
    if tiles < 64:
        return max(1, min(ceil_div(k, 128), ceil_div(128, tiles), 16))
    return max(1, min(GEMM_SPLIT_WORKGROUPS // big, k // GEMM_SPLIT_MIN_K, 16))


# On a CPU driver (lavapipe): few wide threads.
GEMM_CPU_TILES = GEMM_TILES[2]
# Constants a tuning-table entry or a fallback tile may leave out.
GEMM_SPEC_DEFAULTS = {"GM": 1, "SK": 1, "DB": 0, "KR": 0, "WL": 0, "XS": 0, "CT": 0}


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
        Specialisation constants BM, BN, BK, TM, TN, GM, SK, DB, KR, WL, XS, CT, TA, TB, VEC, NR
        (1: no row of ones, so the shader compiles out the code that writes it into shared
        memory), and ACT and AG (the launch's act and act_grad: the shader compiles only the
        epilogue in use).
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
            least = GEMM_MIN_WORKGROUPS / max(1, int(params.get("k_splits", 1)))  # split-K's slices count
            filling = [t for t in plain if ceil_div(m, t["BM"]) * ceil_div(n, t["BN"]) >= least]
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
    launch = {"TA": ta, "TB": tb, "VEC": vec, "NR": int(stored_m == m)}
    return {**GEMM_SPEC_DEFAULTS, **choice, **launch, **epilogue}


def gemm_fits(tiles: dict[str, int], shared_bytes: int, max_threads: int) -> bool:
    """Whether gemm.comp with these tile constants fits a device's shared memory and workgroup size
    (and its warp tiles, if any, divide the block tile: gemm_layout_problem)."""
    sk, db = tiles.get("SK", 1), tiles.get("DB", 0)
    threads = (tiles["BM"] // tiles["TM"]) * (tiles["BN"] // tiles["TN"]) * sk
    need = gemm_shared_bytes(tiles["BM"], tiles["BN"], tiles["BK"], sk, db)
    return threads <= max_threads and need <= shared_bytes and gemm_layout_problem(tiles) is None


def gemm_layout_problem(tiles: Mapping[str, int]) -> str | None:
    """Why gemm.comp's warp tiling (WL: lanes along n of each 32-lane warp) cannot lay out these
    tiles, or None when it can (always, with WL 0). A warp tile is (32 / WL) * TM rows by WL * TN
    columns; the block tile must hold a whole number of them.

    Args:
        tiles: gemm.comp's tile constants (BM, BN, TM, TN, and WL if any).

    Returns:
        A sentence, or None.
    """
    wl = tiles.get("WL", 0)
    if not wl:
        return None
    if wl not in (1, 2, 4, 8, 16, 32):
        return f"WL={wl} must divide 32"
    rows, cols = (32 // wl) * tiles["TM"], wl * tiles["TN"]
    if tiles["BM"] % rows or tiles["BN"] % cols:
        return f"the warp tile {rows}x{cols} (WL={wl}) must divide the block tile {tiles['BM']}x{tiles['BN']}"
    return None


# -- cooperative-matrix GEMM (gemm_coopmat.comp) ---------------------------------------------------

# gemm_coopmat's specialisation constants with their defaults, in the registry's order. After the
# tiles: AH/BH (operand is float16 in memory), PD (K slabs in flight in registers), NS (shared
# stages) and AD (the launch's act_grad: the epilogue multiplies by f'(D)); see the shader's header.
COOPMAT_SPEC = (
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
    ("AD", 0),
)
# Shared memory per workgroup assumed where the device is unknown: NVIDIA's Vulkan limit (48 KiB),
# the smallest among the drivers with cooperative matrices we know of.
COOPMAT_ASSUMED_SHARED_BYTES = 49152
# Tiles for fp16 inputs, first choice first: the first that fits the device's shared memory and
# still gives GEMM_MIN_WORKGROUPS workgroups, else COOPMAT_F16_SMALL. 128x256x32 with two stages
# needs 60 KiB and is taken only where a driver reports that much. On an H100 (48 KiB of shared
# memory) bench/ab_coopmat.py (interleaved rounds, session 11) measured at 4096^3 / 8192^3 / 4000^3:
# 128x128x64 with one stage and 4 subgroups 289 / 324 / 210 TFLOP/s, 128x128x32 with two stages
# 266 / 271 / 193, 128x256x32 with one stage (the earlier first choice) 258 / 281 / 167; 32x32x64
# was best at 256 x 1024 x 784 (37 TFLOP/s, 1.5x cuBLAS fp16 there).
COOPMAT_F16_TILES: tuple[dict[str, int], ...] = (
    {"BM": 128, "BN": 256, "BK": 32, "WM": 64, "WN": 64, "PD": 1, "NS": 2},
    {"BM": 128, "BN": 128, "BK": 64, "WM": 64, "WN": 64, "PD": 1, "NS": 1},
    {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 64, "PD": 1, "NS": 2},
    {"BM": 128, "BN": 256, "BK": 32, "WM": 64, "WN": 64, "PD": 1, "NS": 1},
    {"BM": 64, "BN": 64, "BK": 64, "WM": 32, "WN": 32, "PD": 1, "NS": 2},
)
COOPMAT_F16_SMALL: dict[str, int] = {"BM": 32, "BN": 32, "BK": 64, "WM": 16, "WN": 16, "PD": 1, "NS": 2}


def coopmat_shared_bytes(spec: dict[str, int]) -> int:
    """Shared memory one gemm_coopmat workgroup declares for these specialisation constants (missing
    ones take gemm_coopmat's defaults, COOPMAT_SPEC); the shader's SMEM_VECS, in bytes."""
    s = {**dict(COOPMAT_SPEC), **spec}
    pad = 8  # halves of padding per shared row
    a_halves = max(s["BM"] * (s["BK"] + pad), s["BK"] * (s["BM"] + pad))
    b_halves = max(s["BK"] * (s["BN"] + pad), s["BN"] * (s["BK"] + pad))
    stage = (a_halves + b_halves) // 8
    main = (((s["NS"] - 1) & 1) + 1) * stage
    epilogue = (s["BM"] // s["WM"]) * (s["BN"] // s["WN"]) * 16 * ((s["WN"] + 4) // 4)
    return 16 * max(main, epilogue)


def coopmat_tile_problem(spec: dict[str, int], facts: DeviceFacts | None = None) -> str | None:
    """Why gemm_coopmat cannot run with these specialisation constants (missing ones take the
    defaults of COOPMAT_SPEC), or None when it can. Without facts only the shader's own rules are
    checked.

    Args:
        spec: specialisation constants, e.g. {"BM": 128, "BN": 256, "BK": 16, "WM": 64, "WN": 64}.
        facts: the device (``subgroup_size``, ``shared_memory_bytes``, ``max_workgroup_invocations``).

    Returns:
        A sentence, or None.
    """
    s = {**dict(COOPMAT_SPEC), **spec}
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


# gemm_coopmat's tiles (BM, BN, BK, WM, WN), largest first, and the one for problems too small to
# fill the GPU with either. With fp32 operands (two vec4 staging registers per 8 elements) the
# wider fp16 tiles lose: on an H100 (bench/ab_coopmat.py, session 11) 128x128x32 gave 187 / 193 /
# 170 TFLOP/s at 4096^3 / 8192^3 / 4000^3, 128x256x32 with one stage 163 / 168 / 144, 128x128x64
# with one stage 129 / 134 / 116.
COOPMAT_TILES: tuple[tuple[int, int, int, int, int], ...] = ((128, 128, 32, 64, 64), (64, 64, 64, 32, 32))
COOPMAT_SMALL: tuple[int, int, int, int, int] = (32, 32, 64, 16, 16)


# Split-K for gemm_coopmat (k_splits, then splitk_epilogue): a weight gradient's output has few
# 128x128 tiles (the char GPT's 384 x 1536 has 36) over a long K (16384 rows), so a one-slice
# launch leaves most of an H100's 132 multiprocessors idle. Slices are added until the launch has
# about COOPMAT_SPLIT_WORKGROUPS workgroups (two a multiprocessor), each slice at least
# COOPMAT_SPLIT_MIN_K deep. bench/bench_coopmat_wgrad.py on an H100: 384 x 1536 x 16384 took 323 us
# unsplit, 126 us in 7 slices (252 workgroups) and 194 us in 8 (288: a second, partial wave).
COOPMAT_SPLIT_WORKGROUPS = 264
COOPMAT_SPLIT_MIN_K = 512
COOPMAT_MAX_SPLITS = 32


def coopmat_k_splits(m: int, n: int, k: int) -> int:
    """How many K slices a gemm_coopmat launch of this shape should take (1: no split).

    Args:
        m, n, k: the GEMM's shape.

    Returns:
        1 to COOPMAT_MAX_SPLITS.
    """
    tiles = ceil_div(m, COOPMAT_TILES[0][0]) * ceil_div(n, COOPMAT_TILES[0][1])
    wanted = COOPMAT_SPLIT_WORKGROUPS // tiles
    return max(1, min(wanted, k // COOPMAT_SPLIT_MIN_K, COOPMAT_MAX_SPLITS))


def tune_gemm_coopmat(
    params: dict[str, float], facts: DeviceFacts | None, table: GemmTable | None = None
) -> dict[str, int]:
    """Specialise gemm_coopmat for one launch: the largest of COOPMAT_TILES that still gives
    GEMM_MIN_WORKGROUPS workgroups (K slices included), else COOPMAT_SMALL. An operand that is a
    float16 tensor (launch params ``a_half``/``b_half``: mixed precision's weight copies) sets AH/BH;
    with both halves and no split, the tiles are gemm_coopmat_f16's (tune_gemm_coopmat_f16). The
    launch's ``act_grad`` becomes AD, so only a fused input-gradient GEMM's epilogue applies f'.

    Args:
        params: the launch's parameters (M, N, k_splits, a_half, b_half and act_grad are read).
        facts: the device, read only for two float16 operands (shared memory); else unused.
        table: unused (no table is measured for tensor-core tiles yet).

    Returns:
        Specialisation constants BM, BN, BK, WM, WN, AH, BH, AD (and PD, NS for fp16 tiles).
    """
    m, n, splits = int(params["M"]), int(params["N"]), max(1, int(params.get("k_splits", 1)))
    halves = {"AH": int(params.get("a_half", 0)), "BH": int(params.get("b_half", 0))}
    derivative = {"AD": int(params.get("act_grad", 0))}
    if halves["AH"] and halves["BH"] and splits == 1:
        return {**tune_gemm_coopmat_f16(params, facts, table), **derivative}
    need = ceil_div(GEMM_MIN_WORKGROUPS, splits)
    filling = (t for t in COOPMAT_TILES if ceil_div(m, t[0]) * ceil_div(n, t[1]) >= need)
    choice = next(filling, COOPMAT_SMALL)
    return {**dict(zip(("BM", "BN", "BK", "WM", "WN"), choice, strict=True)), **halves, **derivative}


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
    # Only shared memory is checked against the device: SG stays COOPMAT_SPEC's, as for gemm_coopmat.
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
COOPMAT_F16_SPEC = tuple((name, _COOPMAT_F16_DEFAULT.get(name, value)) for name, value in COOPMAT_SPEC)


# -- implicit-GEMM convolutions (conv2d_gemm*.comp) -------------------------------------------------

# The implicit-GEMM convolutions' tiles (gemm.comp's layout: (BM/TM) * (BN/TN) threads, TN a
# multiple of 4, TM 1, 2, 4 or 8). Several shapes because a convolution's GEMM is often narrow
# (N = 32 or 64 output channels) and long (M = batch x pixels): a tile wider than N wastes its
# columns, and a BK deeper than a short reduction (a first layer's C*R*S = 9) wastes its depth, so
# tune_conv picks the tile with the least padded work among those that fill the GPU, the earlier on
# a tie. The order is bench/sweep_conv.py's on an H100 (batch 256, the CNN's layers): 64-row tiles
# beat 128-row ones (more workgroups resident per multiprocessor), and with 32 columns a shallow
# BK 8 was best (conv2's data gradient: 64x32x8 116 us, 64x32x32 149 us, 128x32x32 252 us; its
# forward: 64x64x16 103 us, 128x64x32 121 us). Every one fits lavapipe's 32 KiB of shared memory
# and 256 invocations.
CONV_TILES: tuple[dict[str, int], ...] = (
    {"BM": 64, "BN": 64, "BK": 16, "TM": 4, "TN": 4},
    {"BM": 64, "BN": 32, "BK": 8, "TM": 4, "TN": 4},
    {"BM": 64, "BN": 32, "BK": 32, "TM": 4, "TN": 4},
    {"BM": 64, "BN": 128, "BK": 32, "TM": 4, "TN": 8},
    {"BM": 128, "BN": 64, "BK": 32, "TM": 8, "TN": 4},
    {"BM": 128, "BN": 32, "BK": 32, "TM": 8, "TN": 4},
    {"BM": 32, "BN": 32, "BK": 32, "TM": 4, "TN": 4},
    {"BM": 32, "BN": 16, "BK": 32, "TM": 2, "TN": 4},
)
# Limits assumed where the device is unknown (lavapipe's, the smallest we run on).
CONV_ASSUMED_SHARED_BYTES = 32 * 1024
CONV_ASSUMED_THREADS = 256


def conv_gemm_shape(kind: str, params: dict[str, float]) -> tuple[int, int, int]:
    """(M, N, K) of the implicit GEMM behind one convolution launch.

    Args:
        kind: ``forward`` (rows (n, oh, ow), columns k, reduction (c, r, s)), ``data`` (rows
            (n, h, w), columns c, reduction (k, r, s)) or ``weight`` (rows k, columns (c, r, s),
            reduction (n, oh, ow)).
        params: the launch's conv parameters (N, C, H, W, K, R, S, OH, OW).

    Returns:
        The GEMM's (M, N, K).
    """
    n, c, h, w, k = (int(params[key]) for key in ("N", "C", "H", "W", "K"))
    taps, out = int(params["R"]) * int(params["S"]), int(params["OH"]) * int(params["OW"])
    if kind == "forward":
        return n * out, k, c * taps
    if kind == "data":
        return n * h * w, c, k * taps
    if kind == "weight":
        return k, c * taps, n * out
    raise ValueError(f"unknown convolution GEMM {kind!r}")


def conv_fits(tiles: dict[str, int], shared_bytes: int, max_threads: int) -> bool:
    """Whether a conv_gemm shader with these tiles fits a device (one shared buffer, no slices)."""
    threads = (tiles["BM"] // tiles["TM"]) * (tiles["BN"] // tiles["TN"])
    return threads <= max_threads and gemm_shared_bytes(tiles["BM"], tiles["BN"], tiles["BK"]) <= shared_bytes


def conv_key(kind: str, m: int, n: int, k: int) -> str:
    """A convolution's entry in a device's tuning table (beside gemm_tuning.shape_key's GEMMs)."""
    return f"conv-{kind}:{m}x{n}x{k}"


def tune_conv(
    kind: str, params: dict[str, float], facts: DeviceFacts | None, table: GemmTable | None = None
) -> dict[str, int]:
    """Specialise an implicit-GEMM convolution for one launch. Tiles: the device's tuning table
    when it lists this convolution (conv_key; bench/sweep_conv.py measures them); else, of the
    CONV_TILES that fit the device (no facts: lavapipe's limits), those whose workgroups (tiles
    times k_splits) fill a big GPU, the one with the least padded work (M x N x K rounded up to
    the tile), the earlier on a tie; when none fills, the one with the most workgroups (then the
    least padding). ACT: the launch's act (the forward compiles only the epilogue in use).

    Args:
        kind: ``forward``, ``data`` or ``weight`` (see conv_gemm_shape).
        params: the launch's parameters.
        facts: the device, or None.
        table: the device's tuning table, or None.

    Returns:
        Specialisation constants BM, BN, BK, TM, TN and ACT.
    """
    m, n, k = conv_gemm_shape(kind, params)
    splits = max(1, int(params.get("k_splits", 1)))
    shared = facts.shared_memory_bytes if facts is not None else CONV_ASSUMED_SHARED_BYTES
    threads = facts.max_workgroup_invocations if facts is not None else CONV_ASSUMED_THREADS
    fitting = [t for t in CONV_TILES if conv_fits(t, shared, threads)] or [CONV_TILES[-1]]
    tuned = (table or {}).get(conv_key(kind, m, n, k)) if facts is not None and facts.kind != "cpu" else None
    if tuned and conv_fits(tuned, shared, threads):
        fitting = [{key: tuned[key] for key in ("BM", "BN", "BK", "TM", "TN")}]

    def rank(tiles: dict[str, int]) -> tuple[int, int, int]:
        count = ceil_div(m, tiles["BM"]) * ceil_div(n, tiles["BN"])
        padded = count * tiles["BM"] * tiles["BN"] * ceil_div(k, tiles["BK"]) * tiles["BK"]
        if count * splits >= GEMM_MIN_WORKGROUPS:
            return (0, padded, 0)
        return (1, -count, padded)

    choice = min(fitting, key=rank)
    return {**choice, "ACT": int(params.get("act", 0))}


def tune_conv_splitk_sum(params: dict[str, float]) -> dict[str, int]:
    """conv_splitk_sum's workgroup: 256 threads, OUTS outputs x LANES slices. A small output (a
    first layer's 32 x 9) takes 32 lanes per output, so its few workgroups still have many loads
    in flight; a larger one 8 lanes and 32 outputs (coalesced 128-byte rows).

    Args:
        params: the launch's parameters (total: the number of outputs).

    Returns:
        Specialisation constants OUTS and LANES.
    """
    small = int(params["total"]) <= 4096
    return {"OUTS": 8 if small else 32, "LANES": 32 if small else 8}

"""Which implicit-GEMM convolution kernels a launch uses, and the tensor-core variants' tiles.

Mixed precision runs the convolution GEMMs of COOPMAT_CONV_KINDS on cooperative matrices
(conv2d_gemm_coopmat*.comp) under the same decision gemm_coopmat follows: the run's precision is
"mixed", which the planner refuses on a device without cooperative matrices (flow/planning.py), so
everywhere else they stay fp32.
"""

from __future__ import annotations

from flow.device_facts import DeviceFacts
from shaders.tiles import GEMM_MIN_WORKGROUPS, ceil_div, conv_gemm_shape

# The kinds of convolution GEMM mixed precision sends to tensor cores (the rest stay fp32). The
# weight gradient's variant is correct but slower on the wide layers (H100, bench_conv: 17.7
# against 22.4 TFLOP/s at 128 -> 256 channels); the wide CNN in mixed precision trains at 83.6k
# samples/s with forward and data here, 80.4k with all three, 71.1k with none.
COOPMAT_CONV_KINDS = frozenset({"forward", "data"})

# The fp32 op of each kind (see conv_gemm_shape) and its tensor-core variant.
CONV_GEMM_OPS = {
    "forward": "conv2d_gemm",
    "data": "conv2d_gemm_backward_data",
    "weight": "conv2d_gemm_backward_weight",
}
COOPMAT_CONV_OPS = {
    kind: name.replace("conv2d_gemm", "conv2d_gemm_coopmat") for kind, name in CONV_GEMM_OPS.items()
}

# Candidate tiles, largest first: block BM x BN x BK, warp tile WM x WN, subgroups of SG. Of two
# tiles of one size the one with more subgroups comes first (a tie goes to it): its threads share
# the gathers, which bound these kernels more than the multiply-adds do.
COOPMAT_CONV_TILES = [
    {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 32, "SG": 32},
    {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 64, "SG": 32},
    {"BM": 128, "BN": 64, "BK": 32, "WM": 32, "WN": 32, "SG": 32},
    {"BM": 64, "BN": 64, "BK": 32, "WM": 32, "WN": 16, "SG": 32},
    {"BM": 64, "BN": 64, "BK": 32, "WM": 32, "WN": 32, "SG": 32},
    {"BM": 64, "BN": 32, "BK": 32, "WM": 32, "WN": 16, "SG": 32},
]


def conv_gemm_op(kind: str, mixed: bool) -> str:
    """The registry op of a convolution GEMM of ``kind`` ("forward", "data" or "weight"): on
    tensor cores when the run is mixed precision and COOPMAT_CONV_KINDS lists the kind, else fp32."""
    return (COOPMAT_CONV_OPS if mixed and kind in COOPMAT_CONV_KINDS else CONV_GEMM_OPS)[kind]


def coopmat_conv_shared_bytes(kind: str, tile: dict[str, int]) -> int:
    """Shared memory of one workgroup, as conv_gemm_coopmat_body.glsl declares it (SMEM_WORDS)."""
    bm, bn, bk, wm, wn = (tile[key] for key in ("BM", "BN", "BK", "WM", "WN"))
    a_fast = bk if kind == "weight" else bm  # the weight gradient gathers A along k
    main = (bm + bk - a_fast) * (a_fast + 8) // 2 + bn * (bk + 8) // 2
    epilogue = (bm // wm) * (bn // wn) * 16 * 20
    return 4 * max(main, epilogue)


def coopmat_conv_problem(kind: str, tile: dict[str, int], facts: DeviceFacts | None = None) -> str | None:
    """Why the tensor-core convolution of ``kind`` cannot run with ``tile`` (the shader's rules,
    then the device's limits when facts are given), or None when it can."""
    bm, bn, bk, wm, wn, sg = (tile[key] for key in ("BM", "BN", "BK", "WM", "WN", "SG"))
    threads = (bm // wm) * (bn // wn) * sg
    if min(wm, wn, bk) < 16 or wm % 16 or wn % 16 or bk % 16 or bm % wm or bn % wn:
        return f"tile {tile}: warp tiles and BK must be multiples of 16 dividing the block"
    a_pairs = bk // 2 if kind == "weight" else bm // 2
    if threads % a_pairs or threads % (bk // 2) or (bm * bk // 2) % threads or (bn * bk // 2) % threads:
        return f"tile {tile}: its {threads} threads must share every tile row's pairs evenly"
    if facts is None:
        return None
    if sg != facts.subgroup_size or threads > facts.max_workgroup_invocations:
        return f"tile {tile}: the device runs subgroups of {facts.subgroup_size}"
    if coopmat_conv_shared_bytes(kind, tile) > facts.shared_memory_bytes:
        return f"tile {tile}: more shared memory than the device's {facts.shared_memory_bytes} bytes"
    return None


def tune_conv_coopmat(kind: str, params: dict[str, float], facts: DeviceFacts | None) -> dict[str, int]:
    """Specialise a tensor-core convolution for one launch: of the tiles that fit the device (no
    facts: every tile), the fewest padded multiply-adds among those whose workgroups (tiles times
    k_splits) fill a big GPU, else the most workgroups; ACT is the launch's activation.

    Returns:
        Specialisation constants BM, BN, BK, WM, WN, SG and ACT.
    """
    m, n, k = conv_gemm_shape(kind, params)
    splits = max(1, int(params.get("k_splits", 1)))
    fitting = [t for t in COOPMAT_CONV_TILES if coopmat_conv_problem(kind, t, facts) is None]

    def rank(tile: dict[str, int]) -> tuple[int, int, int]:
        count = ceil_div(m, tile["BM"]) * ceil_div(n, tile["BN"])
        padded = count * tile["BM"] * tile["BN"] * ceil_div(k, tile["BK"]) * tile["BK"]
        return (0, padded, 0) if count * splits >= GEMM_MIN_WORKGROUPS else (1, -count, padded)

    choice = min(fitting or COOPMAT_CONV_TILES[-1:], key=rank)
    return {**choice, "ACT": int(params.get("act", 0))}

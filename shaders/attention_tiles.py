"""Tiles of the fused attention kernels (attention*.comp), chosen per head size and device.

Each workgroup owns BR rows (query rows; key rows in the kv backward) with G threads per row, and
streams blocks of BC rows of the other side through shared memory. A thread keeps whole padded
head rows in registers (DHP = dh rounded up to 4) and owns DHP / G of the row's accumulator, so G
grows with dh to keep the accumulators at about 32 floats a thread: at the char GPT's shape (N64
T256 H6 dh64 causal, H100, bench/ab_attention.py --scalar, session 16) G 2 with BR 64 and BC 32
took 1398 us for the forward and both backward kernels, against 2374 with G 4 (16 floats), and
beat every other BR of 32-128, BC of 32-64 and G of 2-4 (G 8 leaves dh 16 no accumulator).

The tensor-core variants (attention_coopmat*.comp, mixed precision) have their own tiles: WARPS
subgroups of 16 owned rows each, and BC streamed rows (see attention_coopmat_head.glsl).
:func:`attention_ops` picks the kernels of a launch.
"""

from __future__ import annotations

from flow.device_facts import DeviceFacts

# Lavapipe's limit, and within NVIDIA's 48 KiB: what a launch may use when the device is unknown.
ATTENTION_ASSUMED_SHARED_BYTES = 32768
ATTENTION_KINDS = ("forward", "kv", "q")
SCALAR_ATTENTION_OPS = {"forward": "attention", "kv": "attention_backward_kv", "q": "attention_backward_q"}
COOPMAT_ATTENTION_OPS = {
    "forward": "attention_coopmat",
    "kv": "attention_coopmat_backward_kv",
    "q": "attention_coopmat_backward_q",
}
# Every device with cooperative matrices we know of has at least NVIDIA's 48 KiB.
COOPMAT_ATTENTION_ASSUMED_SHARED_BYTES = 49152
# (BC, WARPS) per kind, fastest first, the first that fits the device wins: streamed rows, and
# subgroups per workgroup (16 owned rows each; the owned rows are staged through the two streamed
# blocks' memory, so 2 BC >= 16 WARPS). From an A/B sweep on an H100 at the char GPT's shape (N64
# T256 H6 dh64 causal; bench/ab_attention.py, bench/RESULTS.md session 14).
# forward 152 us, kv 188, q 120 (kv and q with BC 64 and 4 subgroups: 197, 126).
COOPMAT_ATTENTION_TILES = {"forward": ((64, 2), (32, 2)), "kv": ((32, 2),), "q": ((32, 2),)}
COOPMAT_ATTENTION_MAX_DH = 128  # beyond it the per-subgroup fragments outgrow the registers
# Mixed precision runs the attention on tensor cores (False: the float32 kernels in every precision,
# e.g. to compare the two).
COOPMAT_ATTENTION = True


def attention_ops(mixed: bool, dh: int) -> dict[str, str]:
    """The attention kernels of a launch, by kind ("forward", "kv", "q").

    Tensor cores when the run is mixed precision, the one decision gemm_coopmat follows too (the
    planner refuses "mixed" on a device without cooperative matrices), and the head size is a
    multiple of 16 (a fragment's edge) up to COOPMAT_ATTENTION_MAX_DH; otherwise the float32 scalar
    kernels, which run everywhere.

    Args:
        mixed: the run's precision is "mixed".
        dh: the head size.

    Returns:
        Registry op names by kind.
    """
    tensor_cores = COOPMAT_ATTENTION and mixed and dh % 16 == 0 and 0 < dh <= COOPMAT_ATTENTION_MAX_DH
    return dict(COOPMAT_ATTENTION_OPS if tensor_cores else SCALAR_ATTENTION_OPS)


def attention_shared_bytes(kind: str, spec: dict[str, int]) -> int:
    """Shared memory of one workgroup, as the shaders declare it (head rows padded by one vec4,
    score rows by G floats, against bank conflicts)."""
    br, bc, g, dhp = spec["BR"], spec["BC"], spec["G"], spec["DHP"]
    staged = 2 * bc * (dhp + 4)  # K and V blocks (forward, q); Q and dY blocks (kv)
    if kind == "kv":
        return 4 * (staged + 2 * br * (bc + g) + 2 * bc)  # P, dS, and the block's L and Drow
    return 4 * (staged + br * (bc + g))  # P (forward) or dS (q)


def tune_attention(kind: str, params: dict[str, float], facts: DeviceFacts | None) -> dict[str, int]:
    """The tiles for one attention launch: the widest streamed block that fits the device's shared
    memory (wider blocks mean fewer barriers per key).

    Args:
        kind: "forward", "kv" or "q" (the backward kernels).
        params: the launch's parameters (``dh`` is read).
        facts: the device, or None (then 32 KiB of shared memory is assumed).

    Returns:
        The specialisation constants BR, BC, G and DHP.

    Raises:
        ValueError: a head too large for any tile to fit.
    """
    dhp = max(4, -(-int(params["dh"]) // 4) * 4)
    g = 1
    while (dhp // 4) % (2 * g) == 0 and dhp // (2 * g) >= 32:
        g *= 2
    br = max(16, min(64, 256 // g))
    limit = facts.shared_memory_bytes if facts is not None else ATTENTION_ASSUMED_SHARED_BYTES
    for bc in (64, 32, 16, 8):
        spec = {"BR": br, "BC": bc, "G": g, "DHP": dhp}
        if bc % g == 0 and attention_shared_bytes(kind, spec) <= limit:
            return spec
    raise ValueError(
        f"attention: head size {int(params['dh'])} needs more than {limit} bytes of shared memory"
    )


def coopmat_attention_shared_bytes(kind: str, spec: dict[str, int]) -> int:
    """Shared memory of one tensor-core attention workgroup, as the shaders declare it: two staged
    fp16 blocks of BC head rows (padded by 8 halves); each subgroup's fp32 scores (the forward: a
    16 x BC strip padded by 4 floats; the backward: a 16 x 16 tile padded by 4) and fp16 strips of
    16 x BC (padded by 8 halves: P, or dS, and the kv kernel's second); and two floats a row (q:
    its rows' L and Drow) or a query of the block (kv: L and Drow)."""
    bc, dh, rows = spec["BC"], spec["DH"], 16 * spec["WARPS"]
    staged = 2 * bc * (dh + 8) * 2
    if kind == "forward":
        return staged + rows * (bc + 4) * 4 + rows * (bc + 8) * 2
    strips16 = (2 if kind == "kv" else 1) * rows * (bc + 8) * 2
    return staged + rows * 20 * 4 + strips16 + (8 * bc if kind == "kv" else 8 * rows)


def tune_attention_coopmat(kind: str, params: dict[str, float], facts: DeviceFacts | None) -> dict[str, int]:
    """The tiles for one tensor-core attention launch: the first of COOPMAT_ATTENTION_TILES[kind]
    that fits the device's shared memory.

    Args:
        kind: "forward", "kv" or "q".
        params: the launch's parameters (``dh``, a multiple of 16, is read).
        facts: the device, or None (then 48 KiB of shared memory and subgroups of 32 are assumed).

    Returns:
        The specialisation constants BC, DH, SG, WARPS, PREFETCH (1: the next block's loads are
        in flight during this block's products) and SYNC (see attention_coopmat_head.glsl).

    Raises:
        ValueError: a head size that is not a multiple of 16, or too large to fit.
    """
    dh = int(params["dh"])
    limit = facts.shared_memory_bytes if facts is not None else COOPMAT_ATTENTION_ASSUMED_SHARED_BYTES
    subgroup = facts.subgroup_size if facts is not None else 32
    for bc, warps in COOPMAT_ATTENTION_TILES[kind]:
        spec = {"BC": bc, "DH": dh, "SG": subgroup, "WARPS": warps, "PREFETCH": 1, "SYNC": 1}
        if dh % 16 == 0 and coopmat_attention_shared_bytes(kind, spec) <= limit:
            return spec
    raise ValueError(
        f"attention on tensor cores: head size {dh} must be a multiple of 16 that fits in {limit} "
        "bytes of shared memory"
    )

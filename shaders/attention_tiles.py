"""Tiles of the fused attention kernels (attention*.comp), chosen per head size and device.

Each workgroup owns BR rows (query rows; key rows in the kv backward) with G threads per row, and
streams blocks of BC rows of the other side through shared memory. A thread keeps whole padded
head rows in registers (DHP = dh rounded up to 4) and owns DHP / G of the row's accumulator, so G
grows with dh to keep the accumulators at about 16 floats a thread.
"""

from __future__ import annotations

from flow.device_facts import DeviceFacts

# Lavapipe's limit, and within NVIDIA's 48 KiB: what a launch may use when the device is unknown.
ATTENTION_ASSUMED_SHARED_BYTES = 32768
ATTENTION_KINDS = ("forward", "kv", "q")


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
    while (dhp // 4) % (2 * g) == 0 and dhp // (2 * g) >= 16:
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

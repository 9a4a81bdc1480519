"""What KHR cooperative matrices can do on this device with no global memory in the loop, against
cuBLAS and against vkflow's own GEMM, in one process: the ceiling that bounds gemm_coopmat.

``coopmat_peak.comp`` (beside this file, registered here as a bench-only op) runs the GEMM's inner
loop with its fragments held in registers (FEED 0: the tensor cores alone), loaded from shared
tiles laid out as gemm_coopmat's every k step (FEED 1), then with the one-stage barriers (2) and
the global loads (3) of gemm_coopmat's K loop, or straight from global memory with no shared tile
(4, and 5 with the next step's fragments loaded ahead): see the shader's header. Each config is
checked against float64 numpy on a short run first (one subgroup's sum of tiles) and timed with
timestamp queries; cuBLAS fp16 (torch.matmul) and gemm_coopmat_f16 (the registry's tiles) are
timed at ``--shape`` in the same process.

    python bench/coopmat_peak.py [--shape 8192x8192x8192] [--reps 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

BENCH = "coopmat_peak"
OP = "coopmat_peak"
SRC_VECS = 4096  # the shader's source buffer, in uvec4 (8 halves each)
# (label, spec): gemm_coopmat's own warp layout first (4 subgroups of 64x64, BK 64), then wider ones.
CHUNKS = 1024  # the source holds its 4096-granule pattern this many times (64 MiB)
CONFIGS = [
    ("registers, 4 subgroups of 64x64", dict(WARPS_M=2, WARPS_N=2, FM=4, FN=4, FEED=0, BK=64)),
    ("registers, 8 subgroups of 64x64", dict(WARPS_M=2, WARPS_N=4, FM=4, FN=4, FEED=0, BK=32)),
    ("registers, 4 subgroups of 32x64", dict(WARPS_M=2, WARPS_N=2, FM=2, FN=4, FEED=0, BK=64)),
]
# gemm_coopmat's tile (4 subgroups of 64x64, BK 64) and others, each through FEED 1 to 5; workgroups
# of one or two subgroups only through FEED 1 to 3 (their barriers wait for fewer subgroups).
for _name, _tile, _feeds in (
    ("4 subgroups of 64x64, BK 64 (gemm_coopmat's tile)", dict(WARPS_M=2, WARPS_N=2, FM=4, FN=4, BK=64), 5),
    ("8 subgroups of 64x64, BK 32", dict(WARPS_M=2, WARPS_N=4, FM=4, FN=4, BK=32), 5),
    ("8 subgroups of 64x32, BK 64", dict(WARPS_M=2, WARPS_N=4, FM=4, FN=2, BK=64), 5),
    ("1 subgroup of 64x64, BK 64", dict(WARPS_M=1, WARPS_N=1, FM=4, FN=4, BK=64), 3),
    ("1 subgroup of 64x64, BK 32", dict(WARPS_M=1, WARPS_N=1, FM=4, FN=4, BK=32), 3),
    ("2 subgroups of 64x64 (64x128), BK 64", dict(WARPS_M=1, WARPS_N=2, FM=4, FN=4, BK=64), 3),
    ("2 subgroups of 64x64 (128x64), BK 64", dict(WARPS_M=2, WARPS_N=1, FM=4, FN=4, BK=64), 3),
):
    for _feed, _how in (
        (1, "shared"),
        (2, "shared + barriers"),
        (3, "shared + barriers + global"),
        (4, "global fragments, no shared"),
        (5, "global fragments, no shared, prefetched"),
    )[:_feeds]:
        CONFIGS.append((f"{_how}, {_name}", dict(_tile, FEED=_feed)))


def register(groups: int) -> None:
    """Add the bench-only op to the registry of this process (launching ``groups`` workgroups)."""
    from shaders import registry

    registry.OPS[OP] = registry.OpDef(
        OP,
        str(Path(__file__).with_name("coopmat_peak.comp")),
        ("src", "dst"),
        (("slabs", "u"), ("shift", "u"), ("chunks", "u")),
        lambda params, local, spec: (groups, 1, 1),
        spec=tuple(CONFIGS[0][1].items()),
        features=frozenset({"cooperative_matrix"}),
        outputs=("dst",),
        local_from_spec=lambda s: (32 * s["WARPS_M"] * s["WARPS_N"], 1, 1),
    )


def flop(spec: dict[str, int], groups: int, slabs: int) -> float:
    warps = spec["WARPS_M"] * spec["WARPS_N"]
    return 2.0 * 16**3 * groups * warps * slabs * (spec["BK"] // 16) * spec["FM"] * spec["FN"]


def expected(halves: np.ndarray, spec: dict[str, int], slabs: int) -> np.ndarray:
    """Subgroup 0 of workgroup 0's 16x16 result in float64: the sum over its FM x FN tiles."""
    bm = spec["WARPS_M"] * spec["FM"] * 16
    bn = spec["WARPS_N"] * spec["FN"] * 16
    sa, sb, bk = spec["BK"] + 8, bn + 8, spec["BK"]
    whole = halves[np.arange(bm * sa + bk * sb) % halves.size].astype(np.float64)
    a = whole[: bm * sa].reshape(bm, sa)
    b = whole[bm * sa :].reshape(bk, sb)
    depth, times = (bk, slabs) if spec["FEED"] else (16, slabs * bk // 16)
    total = np.zeros((16, 16))
    for i in range(spec["FM"]):
        for j in range(spec["FN"]):
            total += a[i * 16 : i * 16 + 16, :depth] @ b[:depth, j * 16 : j * 16 + 16]
    return times * total


def main(argv: list[str] | None = None) -> int:
    import common
    from bench_gemm import VkGemm, torch_seconds_per_matmul
    from sweep_coopmat import parse_shape

    from actors.single_op import single_op_layout
    from flow.program import Barrier, Program, launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192x8192x8192", help="the GEMM cuBLAS and gemm_coopmat_f16 run")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--groups", type=int, default=132 * 32, help="workgroups a launch")
    parser.add_argument("--slabs", type=int, default=256, help="K slabs each subgroup multiplies")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rep = common.Reporter(args.out)
    backend = common.open_coopmat(rep, BENCH)
    if backend is None:
        return 1
    device = backend.facts.name
    register(args.groups)
    rng = np.random.default_rng(0)
    halves = rng.uniform(-1, 1, SRC_VECS * 8).astype(np.float16)
    source = np.tile(halves.view(np.uint32), CHUNKS)
    arrays = {"src": source, "dst": np.empty(args.groups * 8 * 256, np.float32)}
    backend.open_layout(single_op_layout(arrays))
    backend.write("src", source)

    def run(spec: dict[str, int], slabs: int, launches: int) -> list[float]:
        one = launch(OP, ("src", "dst"), slabs=slabs, shift=16, chunks=CHUNKS)
        steps = [one]
        for _ in range(launches - 1):
            steps += [Barrier(), one]
        pool = backend.timestamp_pool(launches + 1)
        program = Program(name=f"{OP}x{launches}", steps=tuple(steps))
        handle = backend.record(program, 0, spec_overrides={OP: spec}, timestamps=pool)
        backend.wait(backend.submit(handle))
        return np.diff(backend.read_timestamps_ns(pool)).tolist()

    peaks: dict[str, float] = {}
    for label, spec in CONFIGS:
        run(spec, 3, 1)
        got = backend.read("dst")[:256].reshape(16, 16).astype(np.float64)
        want = expected(halves, spec, 3)
        error = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
        if error > 1e-3:
            rep.missing(BENCH, label, "wrong", f"relative error {error:.3e} against float64 numpy")
            continue
        times = [statistics.median(run(spec, args.slabs, 5)) * 1e-9 for _ in range(args.reps)]
        rates = [flop(spec, args.groups, args.slabs) / t / 1e12 for t in times]
        peaks[label] = statistics.median(rates)
        rep.figure(BENCH, label, device, tflops=peaks[label], tflops_min=min(rates), tflops_max=max(rates),
                   check_error=error, groups=args.groups, slabs=args.slabs, **spec)  # fmt: skip

    shape = parse_shape(args.shape)
    gemm_flop = 2.0 * shape[0] * shape[1] * shape[2]
    gemm = VkGemm(backend, shape, seed=1, dtype="float16")
    ours = [gemm.seconds_per_gemm(None, 3, 0.02, 50, "gemm_coopmat_f16")[0] for _ in range(args.reps)]
    ours_rate = gemm_flop / statistics.median(ours) / 1e12
    best_shared = max((v for k, v in peaks.items() if k.startswith("shared,")), default=1.0)
    rep.figure(BENCH, "gemm_coopmat_f16 (registry tiles)", device, shape=args.shape, tflops=ours_rate,
               vs_best_shared=ours_rate / best_shared)  # fmt: skip
    torch = common.import_torch()
    if torch is not None and torch.cuda.is_available():
        for label, kind in (("cublas_fp16", torch.float16), ("cublas_bf16", torch.bfloat16)):
            seconds = [torch_seconds_per_matmul(torch, shape, kind, 3, 0.02) for _ in range(args.reps)]
            rate = gemm_flop / statistics.median(seconds) / 1e12
            rep.figure(BENCH, label, torch.cuda.get_device_name(), shape=args.shape, tflops=rate,
                       registers_peak_vs_this=max(peaks.values(), default=0) / rate,
                       gemm_coopmat_vs_this=ours_rate / rate)  # fmt: skip
    print(rep.table())
    del gemm
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

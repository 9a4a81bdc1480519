"""Sweep fp32 GEMM tile configurations over the shapes vkflow's models actually launch.

For each configuration (tiles, optional split-K) the script first checks one launch against numpy
on an odd shape with every transposition pair, then times each shape with Vulkan timestamp queries
(median over repetitions of a program of back-to-back launches separated by barriers, as in a
training step; split-K adds its epilogue launch to the time). torch.matmul on the same shapes and
transpositions (TF32 off) is timed with CUDA events in the same run when CUDA is present.

    python bench/sweep_gemm.py [--quick] [--out FILE] [--only SHAPE,...] [--configs NAME,...] [--exact]
                               [--kr 0,1] [--wl 0,4,8] [--xs 0,1] [--ct 0,1] [--nr 0,1]

``--kr 0,1`` times every config both ways of gemm.comp's KR (A kept k-contiguous in shared memory);
``--wl``, ``--xs`` and ``--ct`` likewise for its warp tiling (lanes along n of a warp tile; 0:
block-wide layout), its transposed shared stores by runs of rows and C^T = op(B)^T op(A)^T stored
transposed: every combination of the values given,
so an A/B of one choice is two configs that differ in one of them. ``--exact`` makes ``--configs``
whole names (after the cross product) instead of substrings. ``--nr 0,1`` forces gemm.comp's NR
(no row of ones: the code writing it compiled out), which tune_gemm otherwise sets from the launch;
NR 1 is checked and timed only on shapes without that row, and table entries never carry it.

One JSON line per (config, shape); then, per shape, the configs sorted by time against cuBLAS. The
registry's tile choice (``shaders.tiles.tune_gemm``) is timed too, under the name ``tuned``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from common import import_torch, median, open_vulkan

from actors.single_op import single_op_layout
from flow.program import Barrier, Program, launch
from shaders import gemm_tuning
from shaders.tiles import gemm_k_splits, gemm_layout_problem, gemm_shared_bytes

# (M, N, K, trans_a, trans_b, what): the launches of the benchmark's models. The weight-gradient
# GEMMs of dense layers with a bias have M = inputs + 1: their last row of op(A) is ones
# (ones_row), giving the bias gradient. Split-K is applied as the plan applies it (k_splits).
SHAPES = (
    (256, 1024, 784, 0, 0, "small fwd1"),
    (256, 1024, 1024, 0, 0, "small fwd2"),
    (256, 10, 1024, 0, 0, "small logits"),
    (256, 1024, 1024, 0, 1, "small dX2"),
    (256, 1024, 10, 0, 1, "small dX3"),
    (1025, 1024, 256, 1, 0, "small dW2+b"),
    (785, 1024, 256, 1, 0, "small dW1+b"),
    (1025, 10, 256, 1, 0, "small dW3+b"),
    (8192, 4096, 4096, 0, 0, "large fwd"),
    (8192, 4096, 1024, 0, 0, "large fwd1"),
    (8192, 1024, 4096, 0, 0, "large fwd4"),
    (8192, 4096, 1024, 0, 1, "large dX4"),
    (8192, 4096, 4096, 0, 1, "large dX"),
    (4097, 4096, 8192, 1, 0, "large dW+b"),
    # the large MLP's other weight gradients, which have no table entry: in the first of them the
    # last tile row holds only the row of ones
    (1025, 4096, 8192, 1, 0, "large dW1+b"),
    (4097, 1024, 8192, 1, 0, "large dW4+b"),
    (4096, 4096, 4096, 0, 0, "4096^3"),
    (4096, 4096, 4096, 1, 0, "4096^3 tn"),  # A k-major: the layout without a transposition
    # C^T = B^T A^T of the 4096^3 NN product (A' = B stored [K,N], B' = A stored [M,K]): what
    # running NN transposed would cost, before its transposed store
    (4096, 4096, 4096, 1, 1, "4096^3 tt"),
    (4000, 4000, 4000, 0, 0, "4000^3"),
    (8192, 8192, 8192, 0, 0, "8192^3"),
    # bench_gpt.py's char GPT in fp32 (L6 H6 D384, 64 x 256 tokens): each block's Linear forward,
    # input gradient and weight gradient (+b: with its bias row; the attention's biases are summed apart)
    (16384, 1152, 384, 0, 0, "gpt qkv"),
    (16384, 384, 384, 0, 0, "gpt proj"),
    (16384, 1536, 384, 0, 0, "gpt fc1"),
    (16384, 384, 1536, 0, 0, "gpt fc2"),
    (16384, 384, 1152, 0, 1, "gpt qkv dX"),
    (16384, 384, 384, 0, 1, "gpt proj dX"),
    (16384, 384, 1536, 0, 1, "gpt fc1 dX"),
    (16384, 1536, 384, 0, 1, "gpt fc2 dX"),
    (384, 1152, 16384, 1, 0, "gpt qkv dW"),
    (384, 384, 16384, 1, 0, "gpt proj dW"),
    (385, 1536, 16384, 1, 0, "gpt fc1 dW+b"),
    (1537, 384, 16384, 1, 0, "gpt fc2 dW+b"),
)
QUICK_SHAPES = ((96, 128, 80, 0, 0, "quick"), (65, 96, 64, 1, 0, "quick dW+b"))
SMALL = 300  # M or N below this: also try split-K


def config(bm, bn, bk, tm, tn, gm=1, sk=1, db=1, kr=0, wl=0, xs=0, ct=0) -> dict[str, int]:
    # Every constant set: an override is merged over the tuned constants of the shape, so a config
    # without KR would inherit the tuning table's.
    return {"BM": bm, "BN": bn, "BK": bk, "TM": tm, "TN": tn, "GM": gm, "SK": sk, "DB": db, "KR": kr,
            "WL": wl, "XS": xs, "CT": ct}  # fmt: skip


CONFIGS = (
    # big tiles, for shapes with thousands of them
    config(128, 128, 8, 8, 8, gm=8),
    config(128, 128, 8, 8, 8, gm=8, db=0),
    config(128, 128, 16, 8, 8, gm=8, db=0),
    config(128, 128, 32, 8, 8, gm=8, db=0),
    config(64, 128, 32, 4, 8, gm=8, db=0),
    config(128, 64, 32, 8, 4, gm=8, db=0),
    config(128, 64, 16, 8, 4, db=0),
    config(128, 64, 8, 8, 4, gm=8, db=0),
    config(64, 128, 8, 4, 8, gm=8),
    config(64, 128, 8, 4, 8, gm=8, db=0),
    config(64, 128, 16, 4, 8, gm=8, db=0),
    config(64, 64, 16, 4, 4, db=0),
    config(128, 256, 16, 8, 8, gm=8, db=0),  # 512 threads
    # 128 threads of 8 x 8: smaller workgroups, so more of them fit a multiprocessor's registers
    config(64, 128, 32, 8, 8, gm=8, db=0),
    config(128, 64, 32, 8, 8, gm=8, db=0),
    config(64, 256, 16, 4, 8, gm=8, db=0),
    # small tiles and sliced K, for an MLP's batch of 256
    config(32, 64, 16, 2, 4, db=0),
    config(32, 32, 32, 4, 4, sk=4),
    config(32, 32, 32, 4, 4, sk=4, db=0),
    config(32, 32, 64, 4, 4, sk=8, db=0),
    config(32, 64, 32, 4, 8, sk=4, db=0),
    config(32, 64, 32, 4, 4, sk=4, db=0),
    config(64, 64, 32, 4, 8, sk=4, db=0),
    config(64, 64, 16, 8, 8, sk=4, db=0),
    config(32, 64, 16, 4, 4, sk=2, db=0),
    config(64, 64, 32, 8, 8, sk=2, db=0),
    config(64, 64, 16, 4, 4, sk=2, db=0),
)
BIG_TILE = 64 * 64  # smallest tile (BM x BN) tried on large shapes, which have plenty of tiles
QUICK_CONFIGS = (
    config(64, 64, 16, 4, 4),
    config(32, 64, 16, 2, 4, sk=2),
    config(128, 128, 8, 8, 8, db=0),
    config(32, 32, 32, 4, 4, sk=4),
)
CHECK = (67, 45, 33)


def name(cfg: dict[str, int] | None) -> str:
    if cfg is None:
        return "tuned"
    text = f"{cfg['BM']}x{cfg['BN']}x{cfg['BK']}/{cfg['TM']}x{cfg['TN']}"
    if cfg["GM"] > 1:
        text += f" gm{cfg['GM']}"
    if cfg["SK"] > 1:
        text += f" sk{cfg['SK']}"
    if not cfg["DB"]:
        text += " single"
    for key in ("KR", "WL", "XS", "CT"):
        if cfg.get(key):
            text += f" {key.lower()}{cfg[key]}"
    if "NR" in cfg:
        text += f" nr{cfg['NR']}"
    return text


class Case:
    """One GEMM shape on the backend, operands stored as the transposition flags say; with
    ``ones`` the last row of op(A) is ones and A stores M - 1 rows (a fused bias gradient)."""

    def __init__(
        self, backend, m: int, n: int, k: int, ta: int, tb: int, ones: int = 0, seed: int = 0
    ) -> None:
        self.backend, self.m, self.n, self.k, self.ta, self.tb, self.ones = backend, m, n, k, ta, tb, ones
        self.splits = gemm_k_splits(m, n, k)
        splits = self.splits
        rng = np.random.default_rng(seed)
        stored = m - ones
        self.a = rng.uniform(-1, 1, (k, stored) if ta else (stored, k)).astype(np.float32)
        self.b = rng.uniform(-1, 1, (n, k) if tb else (k, n)).astype(np.float32)
        arrays = {
            "A": self.a,
            "B": self.b,
            "bias": np.empty(n, np.float32),
            "C": np.empty((m, n), np.float32),
            "W": np.empty((max(splits, 1) * m, n), np.float32),
        }
        backend.open_layout(single_op_layout(arrays))
        backend.write("A", self.a)
        backend.write("B", self.b)
        backend.write("bias", rng.uniform(-1, 1, n).astype(np.float32))

    def steps(self) -> list:
        splits = self.splits
        params = {
            "M": self.m,
            "N": self.n,
            "K": self.k,
            "trans_a": self.ta,
            "trans_b": self.tb,
            "has_bias": int(not self.ones),
            "ones_row": self.ones,
        }
        if splits <= 1:
            return [launch("gemm", ("A", "B", "bias", "C"), **params)]
        return [
            launch("gemm", ("A", "B", "bias", "W"), **params, k_splits=splits),
            Barrier(),
            launch(
                "splitk_epilogue",
                ("W", "bias", "C"),
                M=self.m,
                N=self.n,
                splits=splits,
                has_bias=int(not self.ones),
            ),
        ]

    def program(self, repeats: int) -> Program:
        steps: list = []
        for index in range(repeats):
            if index:
                steps.append(Barrier())
            steps += self.steps()
        return Program(name="sweep", steps=tuple(steps))

    def record(self, cfg: dict[str, int] | None, repeats: int, pool=None) -> int:
        overrides = {"gemm": cfg} if cfg else None
        return self.backend.record(self.program(repeats), 0, spec_overrides=overrides, timestamps=pool)

    def error(self, cfg: dict[str, int] | None) -> float:
        self.backend.wait(self.backend.submit(self.record(cfg, 1)))
        got = self.backend.read("C").astype(np.float64)
        op_a = (self.a.T if self.ta else self.a).astype(np.float64)
        if self.ones:
            op_a = np.vstack([op_a, np.ones((1, self.k))])
        op_b = (self.b.T if self.tb else self.b).astype(np.float64)
        bias = 0.0 if self.ones else self.backend.read("bias").astype(np.float64)
        want = op_a @ op_b + bias
        return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))

    def seconds(self, cfg: dict[str, int] | None, target_s: float, reps: int) -> float:
        per = 1 if self.splits <= 1 else 2  # launches per GEMM

        def timed(repeats: int, times: int) -> list[float]:
            pool = self.backend.timestamp_pool(repeats * per + 1)
            handle = self.record(cfg, repeats, pool)
            out: list[float] = []
            for _ in range(times):
                self.backend.wait(self.backend.submit(handle))
                stamps = self.backend.read_timestamps_ns(pool)
                # per-GEMM time: timestamp after its last launch minus after the previous GEMM's
                out.extend(np.diff(stamps[::per]).tolist())
            return out

        probe = median(timed(2, 2)) * 1e-9
        repeats = int(min(200, max(3, round(target_s / max(probe, 1e-9)))))
        return median(timed(repeats, reps)) * 1e-9


def torch_seconds(torch, m, n, k, ta, tb, reps: int) -> float | None:
    if torch is None or not torch.cuda.is_available():
        return None
    dev = "cuda"
    a = torch.rand((k, m) if ta else (m, k), device=dev)
    b = torch.rand((n, k) if tb else (k, n), device=dev)
    op_a, op_b = (a.t() if ta else a), (b.t() if tb else b)
    c = torch.empty((m, n), device=dev)
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            torch.matmul(op_a, op_b, out=c)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 20 * 1e-3)
    return median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated substrings of shape names")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; shapes left then are skipped")
    parser.add_argument("--configs", default="", help="comma-separated substrings of config names")
    parser.add_argument("--exact", action="store_true", help="--configs are whole config names")
    parser.add_argument("--kr", default="", help="comma-separated KR values (gemm.comp) to time")
    parser.add_argument("--wl", default="", help="comma-separated WL values (warp tiling) to time")
    parser.add_argument("--xs", default="", help="comma-separated XS values (transposed stores) to time")
    parser.add_argument("--ct", default="", help="comma-separated CT values (C^T stored transposed) to time")
    parser.add_argument("--nr", default="", help="comma-separated NR values (no row of ones) to force")
    parser.add_argument("--table", help="where to write the best tiles per shape (default: the user cache)")
    args = parser.parse_args()
    backend, why_not = open_vulkan()
    if backend is None:
        print(json.dumps({"bench": "sweep_gemm", "status": "not available", "reason": why_not}))
        return
    torch = import_torch()  # fp32 without TF32
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.only:
        shapes = tuple(s for s in shapes if any(word in s[5] for word in args.only.split(",")))
    configs = QUICK_CONFIGS if args.quick else CONFIGS
    for key in ("kr", "wl", "xs", "ct", "nr"):
        if getattr(args, key):
            values = getattr(args, key).split(",")
            configs = tuple({**cfg, key.upper(): int(v)} for cfg in configs for v in values)
    if args.configs:
        words = args.configs.split(",")
        configs = tuple(
            c for c in configs if (name(c) in words if args.exact else any(w in name(c) for w in words))
        )
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 - closed below

    def emit(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if out:
            out.write(line + "\n")

    usable: list[dict[str, int] | None] = [None]
    for cfg in configs:
        threads = (cfg["BM"] // cfg["TM"]) * (cfg["BN"] // cfg["TN"]) * cfg["SK"]
        shared = gemm_shared_bytes(cfg["BM"], cfg["BN"], cfg["BK"], cfg["SK"], cfg["DB"])
        layout = gemm_layout_problem(cfg)
        if (
            threads > backend.facts.max_workgroup_invocations
            or shared > backend.facts.shared_memory_bytes
            or layout
        ):
            emit({"bench": "sweep_gemm", "config": name(cfg), "status": "skipped", "threads": threads,
                  "shared": shared, "layout": layout})  # fmt: skip
            continue
        worst = 0.0
        try:
            for ta, tb in ((0, 0), (1, 1)):  # the tests cover every pair for the shipped tiles
                for ones in (0, 1):
                    case = Case(backend, *CHECK, ta, tb, ones, seed=ta * 2 + tb)
                    if not (ones and cfg.get("NR")):  # NR 1 is only for launches without the row
                        worst = max(worst, case.error(cfg))
        except Exception as error:  # noqa: BLE001 - one bad config must not end the sweep
            emit({"bench": "sweep_gemm", "config": name(cfg), "status": "failed", "error": repr(error)[:300]})
            continue
        ok = worst <= 1e-5
        emit(
            {
                "bench": "sweep_gemm",
                "config": name(cfg),
                "check_error": worst,
                "status": "ok" if ok else "wrong",
            }
        )
        if ok:
            usable.append(cfg)

    summary = []
    best: dict[str, dict[str, int]] = {}
    began = time.perf_counter()
    for m, n, k, ta, tb, what in shapes:
        ones = int("+b" in what)
        if time.perf_counter() - began > args.budget:
            emit({"bench": "sweep_gemm", "shape": what, "status": "skipped", "reason": "over --budget"})
            continue
        flop = 2.0 * m * n * k
        ref = torch_seconds(torch, m, n, k, ta, tb, args.reps)
        rows = []
        case = Case(backend, m, n, k, ta, tb, ones)  # one upload per shape, every config reads it
        for cfg in usable:
            if cfg and ones and cfg.get("NR"):
                continue
            if cfg and min(m, n) >= SMALL * 4 and (cfg["BM"] * cfg["BN"] < BIG_TILE or cfg["SK"] > 1):
                continue  # small tiles and sliced K are for shapes with few tiles
            started = time.perf_counter()
            try:
                seconds = case.seconds(cfg, 0.02 if min(m, n) < SMALL else 0.05, args.reps)
            except Exception as error:  # noqa: BLE001
                emit({"bench": "sweep_gemm", "shape": what, "config": name(cfg), "status": "failed",
                      "error": repr(error)[:300]})  # fmt: skip
                continue
            record = {
                "bench": "sweep_gemm",
                "shape": what,
                "mnk": [m, n, k],
                "trans": [ta, tb],
                "config": name(cfg),
                "us": round(seconds * 1e6, 2),
                "tflops": round(flop / seconds / 1e12, 2),
                "vs_cublas": round(ref / seconds, 3) if ref else None,
                "wall_s": round(time.perf_counter() - started, 2),
            }
            emit(record)
            rows.append({**record, "cfg": cfg})
        rows.sort(key=lambda r: r["us"])
        summary.append((what, ref, rows))
        # Tiles only: whether to split K is the plan's decision (k_splits), timed here as made.
        winner = next((r for r in rows if r["cfg"]), None)
        if winner:
            tiles = {key: value for key, value in winner["cfg"].items() if key != "NR"}  # the launch's
            best[gemm_tuning.shape_key(m, n, k, ta, tb)] = tiles

    print()
    for what, ref, rows in summary:
        cublas = f"cuBLAS {ref * 1e6:.1f} us" if ref else "no cuBLAS"
        print(f"{what}: {cublas}")
        for record in rows[:6]:
            speed = f"{record['us']:>9.1f} us {record['tflops']:>7.2f} TFLOP/s"
            print(f"   {record['config']:<28} {speed}  {record['vs_cublas']}")
    if best:
        path = Path(args.table) if args.table else gemm_tuning.cache_path(backend.facts.name)
        gemm_tuning.write_table(path, backend.facts.name, backend.facts.driver_version, best)
        print(f"\nbest tiles for {len(best)} shapes written to {path}")
    if out:
        out.close()
    backend.close()


if __name__ == "__main__":
    main()

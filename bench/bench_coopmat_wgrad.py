"""Weight-gradient GEMMs on tensor cores: split-K and the bias row (gemm_coopmat, the training path).

A dense layer's weight gradient is dW [M, N] = h^T [M, K] @ dz [K, N] with K the batch's rows (the
char GPT: K = 64 x 256 = 16384) and M, N its widths (384 to 1536): few output tiles, a long K. For
each shape this times, as GPU medians from timestamp queries:

- the registry's own choice, one launch (what a training step ran before split-K);
- split-K with given tiles: gemm_coopmat with k_splits into a [splits, M, N] workspace, then
  splitk_epilogue (both launches timed, reported as their sum and apart);
- the same with ones_row (op(A) gets a row of ones, so C's last row is the bias gradient db);
- the bias gradient the plan launches beside an unfused GEMM: column_sum over the K rows;
- torch fp16 and bf16 ``a.t() @ b`` (cuBLAS) on the same shape, where torch has CUDA.

Every variant is first checked against numpy (fp16-rounded inputs, float64 product): a variant over
``--tol`` is reported and not timed. One JSON line per figure.

    python bench/bench_coopmat_wgrad.py [--shapes 384x1536x16384,...] [--splits 4,8] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BENCH = "coopmat_wgrad"
# The char GPT's weight gradients (M x N x K; bench_gpt.py's model): fc1, qkv, fc2, attention out.
SHAPES = ((384, 1536, 16384), (384, 1152, 16384), (1536, 384, 16384), (384, 384, 16384))
TILES = {
    "128x128x32": {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 64},
    "128x256x16": {"BM": 128, "BN": 256, "BK": 16, "WM": 64, "WN": 64},
}


class Case:
    """One shape on the device: A [K, M] and B [K, N] fp32 (A transposed, as for dW), bias, a
    workspace of ``max_splits`` slices and C with room for the ones row."""

    def __init__(self, backend, m: int, n: int, k: int, max_splits: int, seed: int = 0) -> None:
        from actors.single_op import single_op_layout

        self.backend, self.m, self.n, self.k = backend, m, n, k
        rng = np.random.default_rng(seed)
        self.a = rng.standard_normal((k, m)).astype(np.float32)
        self.b = rng.standard_normal((k, n)).astype(np.float32)
        arrays = {
            "A": self.a,
            "B": self.b,
            "bias": np.zeros(n, np.float32),
            "W": np.empty((max_splits, m + 1, n), np.float32),
            "C": np.empty((m + 1, n), np.float32),
            "S": np.empty((max(1, -(-k // 96)), n), np.float32),
        }
        backend.open_layout(single_op_layout(arrays))
        for name in ("A", "B", "bias"):
            backend.write(name, arrays[name])
        a16 = self.a.astype(np.float16).astype(np.float64)
        b16 = self.b.astype(np.float16).astype(np.float64)
        self.want = np.vstack([a16.T @ b16, b16.sum(axis=0)])  # [dW; db]

    def steps(self, splits: int, ones: int):
        from flow.program import launch

        m = self.m + ones
        params = dict(M=m, N=self.n, K=self.k, trans_a=1, ones_row=ones)
        if splits == 1:
            return [launch("gemm_coopmat", ("A", "B", "bias", "C"), **params)]
        return [
            launch("gemm_coopmat", ("A", "B", "bias", "W"), k_splits=splits, **params),
            launch("splitk_epilogue", ("W", "bias", "C"), M=m, N=self.n, splits=splits),
        ]

    def program(self, steps, repeat: int):
        from flow.program import Barrier, Program

        body = []
        for _ in range(repeat):
            for step in steps:
                body += [step, Barrier()]
        return Program(name=f"{BENCH}{self.m}x{self.n}", steps=tuple(body[:-1]))

    def error(self, splits: int, ones: int, spec) -> float:
        handle = self.backend.record(self.program(self.steps(splits, ones), 1), 0, spec_overrides=spec)
        self.backend.wait(self.backend.submit(handle))
        got = self.backend.read("C")[: self.m + ones].astype(np.float64)
        want = self.want if ones else self.want[: self.m]
        if not np.all(np.isfinite(got)):
            return float("inf")
        return float(np.abs(got - want).max() / np.abs(want).max())

    def seconds(self, steps, spec, reps: int, repeat: int = 20) -> list[float]:
        """Median GPU seconds of each of ``steps`` over ``repeat`` rounds x ``reps`` submissions."""
        pool = self.backend.timestamp_pool(len(steps) * repeat + 1)
        handle = self.backend.record(self.program(steps, repeat), 0, spec_overrides=spec, timestamps=pool)
        diffs: list[float] = []
        for rep in range(reps + 1):
            self.backend.wait(self.backend.submit(handle))
            if rep:  # the first submission warms up
                diffs.extend(np.diff(self.backend.read_timestamps_ns(pool)).tolist())
        per = len(steps)
        return [statistics.median(diffs[i::per]) * 1e-9 for i in range(per)]


def torch_seconds(torch, m: int, n: int, k: int, dtype, reps: int) -> float:
    a = torch.randn(k, m, device="cuda").to(dtype)
    b = torch.randn(k, n, device="cuda").to(dtype)
    times = []
    for _ in range(reps + 1):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(20):
            torch.matmul(a.t(), b)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e-3 / 20)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    import common

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    parser.add_argument("--splits", default="2,4,6,8,12", help="K slices to try with each of --tiles")
    parser.add_argument("--tiles", default="128x128x32", help=f"comma-separated, of {sorted(TILES)}")
    parser.add_argument("--reps", type=int, default=3, help="submissions per figure in a round (median)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over every variant (median, min, max)")
    parser.add_argument("--ones", type=int, default=0, help="1: also each variant with the ones row")
    parser.add_argument("--tol", type=float, default=2e-4)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rep = common.Reporter(args.out)
    backend, why = common.open_vulkan("auto")
    if backend is None or not backend.facts.has("cooperative_matrix"):
        rep.missing(BENCH, "vkflow", "not available", why or "no cooperative matrices")
        return 1
    device = backend.facts.name
    torch = None if args.no_torch else common.import_torch()
    splits_list = [int(s) for s in args.splits.split(",") if s]
    variants = [("tuned", 1, None, 0)] + [("tuned+ones", 1, None, 1)] * args.ones
    for tile in args.tiles.split(","):
        for splits in splits_list:
            variants.append((f"{tile}/sk{splits}", splits, TILES[tile], 0))
            variants += [(f"{tile}/sk{splits}+ones", splits, TILES[tile], 1)] * args.ones
    from flow.autodiff import column_sum_parts
    from flow.program import launch

    for text in args.shapes.split(","):
        m, n, k = (int(v) for v in text.split("x"))
        shape, flop = f"{m}x{n}x{k}", 2.0 * m * n * k
        case = Case(backend, m, n, k, max(splits_list))
        timed = {}  # name -> (steps, spec overrides)
        for name, splits, tiles, ones in variants:
            spec = {"gemm_coopmat": tiles} if tiles else None
            err = rep.guarded(
                BENCH, "vkflow", lambda a=(splits, ones, spec), c=case: c.error(*a), shape=shape, tiles=name
            )
            if err is not None and not err <= args.tol:
                rep.missing(
                    BENCH, "vkflow", "wrong", f"max relative error {err:.3e}", shape=shape, tiles=name
                )
            elif err is not None:
                timed[name] = (case.steps(splits, ones), spec)
        # The bias gradient an unfused GEMM needs: the plan's sliced column sum (autodiff.column_sum_parts).
        parts = column_sum_parts(k, n)
        sums = [launch("column_sum", ("B", "S"), rows=k, cols=n, parts=parts)]
        sums += [launch("conv_splitk_sum", ("S", "bias"), total=n, splits=parts)] * (parts > 1)
        timed[f"column_sum/{parts}"] = (sums, None)
        rounds: dict[str, list[list[float]]] = {name: [] for name in timed}
        cuda = torch is not None and torch.cuda.is_available()
        torch_rounds: dict[str, list[float]] = {"torch_fp16": [], "torch_bf16": []} if cuda else {}
        for _ in range(args.rounds):  # interleaved, so clock drift hits every variant alike
            for name, (steps, spec) in timed.items():
                rounds[name].append(case.seconds(steps, spec, args.reps))
            for label in torch_rounds:
                dtype = torch.float16 if label == "torch_fp16" else torch.bfloat16
                torch_rounds[label].append(torch_seconds(torch, m, n, k, dtype, args.reps))
        for name, values in rounds.items():
            totals = [sum(parts) for parts in values]
            total = statistics.median(totals)
            split = [statistics.median(p[i] for p in values) * 1e6 for i in range(len(values[0]))]
            fields = dict(
                shape=shape, tiles=name, parts_us=split, us_min=min(totals) * 1e6, us_max=max(totals) * 1e6
            )
            rep.figure(BENCH, "vkflow", device, us=total * 1e6, tflops=flop / total / 1e12, **fields)
        for label, values in torch_rounds.items():
            seconds = statistics.median(values)
            rep.figure(BENCH, label, device, shape=shape, us=seconds * 1e6, tflops=flop / seconds / 1e12,
                       us_min=min(values) * 1e6, us_max=max(values) * 1e6)  # fmt: skip
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

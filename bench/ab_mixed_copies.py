"""Mixed precision with and without fp16 operand copies (issue 18), A/B in one process.

The large MLP of ``bench_mlp.py --only b`` (1024-4096-4096-4096-1024, batch 8192, SGD, 2 in flight)
planned with each choice of ``flow.autodiff.HALF_COPIES``: none (every GEMM rounds fp32 operands in
the kernel, as before session 12), the weights' copies, and the weights' plus wide activations'
copies, made by cast launches (``MIXED_FUSIONS`` off: helper H13's path) or written by the GEMMs that
produce them, with the activation derivative in the input-gradient epilogue (H14); and the weights'
copies written by the optimiser's update instead of cast at the start of each program
(``flow.weight_copies.OPTIMISER_COPIES``, session 14's H20: "optimiser"). The variants
are timed in turn, round after round (the H100's clocks drift; see
bench/RESULTS.md), each a median of host-timed step loops (``bench_mlp.measure``); then one
timestamped run of each gives the GPU time of its GEMMs and casts by kind. torch bf16 autocast on the
same model, timed once, gives the ratio the issue's target is set against.

Usage: ``python3 bench/ab_mixed_copies.py [--rounds 2] [--reps 3] [--variants producers,optimiser]
[--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import bench_mlp
import common
import numpy as np

from flow import autodiff, weight_copies

BOTH = ("weights", "activations")
# name -> (HALF_COPIES, MIXED_FUSIONS, OPTIMISER_COPIES)
VARIANTS = {
    "none": ((), False, False),
    "weights": (("weights",), False, False),
    "casts": (BOTH, False, False),
    "producers": (BOTH, True, False),
    "optimiser": (BOTH, True, True),
}


def trainer(backend, variant: tuple[tuple[str, ...], bool, bool], timestamps: bool = False):
    copies, autodiff.MIXED_FUSIONS, weight_copies.OPTIMISER_COPIES = variant
    autodiff.HALF_COPIES = frozenset(copies)
    sizes = bench_mlp.FULL
    return bench_mlp.VkTrainer(
        backend, sizes.large, sizes.large_batch, "sgd", 2, 2, timestamps=timestamps, precision="mixed"
    )


def kind(item: dict) -> str:
    """A launch's label: GEMMs by direction and operand types, casts, the rest by op."""
    if item["op"] in ("gemm_coopmat", "gemm_coopmat_copy"):
        direction = (
            "dW" if "trans_a=1" in item["params"] else "dX" if "trans_b=1" in item["params"] else "fwd"
        )
        return f"gemm {direction}"
    return item["op"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--timed-rounds", type=int, default=1)
    parser.add_argument("--variants", default="producers,optimiser", help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}
    backend, why = common.open_vulkan("auto")
    if backend is None or not backend.facts.has("cooperative_matrix"):
        sys.exit(f"needs a Vulkan device with cooperative matrices: {why or backend.facts.name}")
    sizes, batch = bench_mlp.FULL, bench_mlp.FULL.large_batch
    rows: list[dict] = []
    rates: dict[str, list[float]] = defaultdict(list)
    for round_ in range(args.rounds):
        for name, variant in variants.items():
            run = trainer(backend, variant)
            value, steps = bench_mlp.measure(run, args.reps, sizes.large_target_s, batch, start=1)
            rates[name].append(value)
            print(f"round {round_} {name:>20}: {value:,.0f} samples/s ({steps} steps), loss {run.loss:.4f}")
    # Timestamped runs interleaved too (--timed-rounds): a clock dip slows every kernel of one run.
    timed: dict[str, list[dict[str, float]]] = defaultdict(list)
    for _ in range(args.timed_rounds):
        for name, variant in variants.items():
            run = trainer(backend, variant, timestamps=True)
            run.run(2)
            run.launch_ns.clear()
            run.run(6)
            by_kind: dict[str, float] = defaultdict(float)
            for item in bench_mlp.kernel_breakdown(run):
                by_kind[kind(item)] += item["us"] / 1e3
            print(
                f"{name}: GPU {sum(by_kind.values()):.2f} ms/step: "
                + ", ".join(f"{k} {v:.3f}" for k, v in by_kind.items())
            )
            timed[name].append({k: round(v, 4) for k, v in by_kind.items()})
    for name in variants:
        gpu_ms = [round(sum(t.values()), 3) for t in timed[name]]
        median = float(np.median(rates[name]))
        row = {"variant": name, "samples_per_s": median, "all": rates[name], "gpu_ms": gpu_ms}
        rows.append({**row, "ms_by_kind": timed[name]})
    torch, device = common.open_torch()
    if torch is not None and torch.cuda.is_available():
        run = bench_mlp.TorchTrainer(torch, sizes.large, batch, "sgd", "eager", False, 2, autocast_bf16=True)
        value, _ = bench_mlp.measure(run, args.reps, sizes.large_target_s, batch, start=1)
        print(f"torch bf16 autocast: {value:,.0f} samples/s")
        for row in rows:
            row["vs_torch_bf16"] = row["samples_per_s"] / value
        rows.append({"variant": "torch_bf16_autocast", "samples_per_s": value})
    for row in rows:
        print(json.dumps(row))
        if args.out:
            with open(args.out, "a") as out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

"""GELU and the residual add in the GEMM epilogues (issue 16, session 14's H19), A/B in one process.

The char GPT of ``bench_gpt.py`` (L6 H6 D384 T256 B64) planned three ways (VARIANTS): as before
session 14, with the default launches, and with GELU in the GEMM epilogues (fc1 writes pre and
GELU(pre), in mixed precision as fc2's fp16 operand; fc2's input-gradient GEMM applies GELU'(pre)),
every other fusion as it is. Each round times each variant in turn: the step's GPU time op by op
from timestamp queries (``bench_gpt.part_kernels``, both precisions) and the tokens/s and validation
loss of one mixed-precision ``flow.run`` (float32 on a device without cooperative matrices).

Usage: ``python3 bench/ab_gelu_epilogue.py [--rounds 1] [--steps 200] [--variants
before,launches,epilogues] [--no-run] [--quick] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import bench_gpt
import common

from flow import autodiff

GELU_OUTPUT = autodiff._Builder._gelu_output
# variant -> (GELU(pre) may be written as the next Linear's fp16 operand, GELU_IN_EPILOGUES,
# RESIDUAL_IN_EPILOGUES). "before": session 13's plan (a unary writing fp32 GELU(pre), read and
# rounded in fc2's kernels, a unary_backward and a binary add); "launches": the default (unary_half
# straight to the fp16 operand, unary_backward, fc2 writing the residual sum); "epilogues": GELU and
# GELU' in the GEMM epilogues, and the residual sum.
VARIANTS = {
    "before": (False, False, False),
    "launches": (True, False, True),
    "epilogues": (True, True, True),
}


def use(variant: str) -> None:
    """Plan the GPT as ``variant`` does."""
    half, autodiff.GELU_IN_EPILOGUES, autodiff.RESIDUAL_IN_EPILOGUES = VARIANTS[variant]
    autodiff._Builder._gelu_output = GELU_OUTPUT if half else lambda self, position, stage: "float32"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="bench_gpt's smoke sizes (L2 H2 D32 T32 B8)")
    parser.add_argument("--variants", default="before,launches,epilogues", help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--no-run", action="store_true", help="the step's kernels only, no flow.run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    backend, why = common.open_vulkan("auto")
    if backend is None:
        sys.exit(f"needs a Vulkan device: {why}")
    base = bench_gpt.QUICK if args.quick else bench_gpt.FULL
    sizes = bench_gpt.Sizes(**{**base.__dict__, "steps": args.steps, "reps": 1})
    # The run is the mixed-precision one where the device has tensor cores (lavapipe: float32).
    precision = "mixed" if backend.facts.has("cooperative_matrix") else "float32"
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ab-gelu-") as tmp:
        folder = Path(tmp)
        corpus = bench_gpt.open_corpus(folder, sizes.context, None)
        for round_ in range(args.rounds):
            for variant in args.variants.split(","):
                use(variant)
                rep = bench_gpt.GPTReporter(None)
                bench_gpt.part_kernels(None, rep, sizes, corpus, backend, "vulkan")
                for row in rep.rows:
                    if "ops" in row:
                        ops = {item["op"]: (item["launches"], item["us"]) for item in row["ops"]}
                        rows.append(dict(round=round_, variant=variant, precision=row["precision"],
                                         ms=row["ms"], launches=row["launches"], ops=ops))  # fmt: skip
                if args.no_run:
                    continue
                outcome = bench_gpt.vk_once(backend, sizes, corpus, precision, 0, folder)
                rows.append(dict(round=round_, variant=variant, precision=precision, run_steps=sizes.steps,
                                 tokens_per_s=outcome.tokens_per_s, val_loss=outcome.val_loss))  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        if "ops" in row:
            print(f"round {row['round']} {row['variant']:8s} {row['precision']:7s} {row['ms']:.3f} ms, "
                  f"{row['launches']} launches")  # fmt: skip
            for op, (count, us) in sorted(row["ops"].items(), key=lambda item: -item[1][1]):
                print(f"    {us:9.1f} us {count:4d} x {op}")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()

"""Which workgroup-count threshold should the fp32 GEMM tile choice use? Times full training steps
of the small and large MLPs with each threshold (registry.GEMM_MIN_WORKGROUPS: tune_gemm takes
the largest tile that still gives at least that many workgroups) and prints samples/s per value.

Run on the GPU the default is for: ``python bench/tune_gemm.py [--quick]``. Host clocks time whole
step loops (K=2 in flight), as bench_mlp.py does; one JSON line per figure.
"""

from __future__ import annotations

import argparse
import json

import bench_mlp
from common import open_vulkan

import shaders.registry as registry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    backend, why_not = open_vulkan()
    if backend is None:
        print(json.dumps({"bench": "tune_gemm", "status": "not available", "reason": why_not}))
        return
    device = backend.facts.name
    sizes = bench_mlp.QUICK if args.quick else bench_mlp.FULL
    cases = (
        ("mlp_small", sizes.small, sizes.small_batch, 0.5),
        ("mlp_large", sizes.large, sizes.large_batch, 1.0),
    )
    original = registry.GEMM_MIN_WORKGROUPS
    for threshold in (16, 32, 64, 128, 256):
        registry.GEMM_MIN_WORKGROUPS = threshold
        for bench, layers, batch, target_s in cases:
            trainer = bench_mlp.VkTrainer(backend, layers, batch, "sgd", 2, 2)
            rate, steps = bench_mlp.measure(trainer, 3, target_s * (0.1 if args.quick else 1), batch, start=1)
            print(
                json.dumps(
                    {
                        "bench": bench,
                        "min_workgroups": threshold,
                        "samples_per_s": round(rate, 1),
                        "steps": steps,
                        "default": threshold == original,
                        "device": device,
                    }
                )
            )
    registry.GEMM_MIN_WORKGROUPS = original
    backend.close()


if __name__ == "__main__":
    main()

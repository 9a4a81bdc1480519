"""A/B timing of cooperative-matrix GEMM variants, interleaved so that a drift of the GPU's clocks
hits every variant alike.

``sweep_coopmat.py`` times each config once, one after the other; on a shared or power-capped GPU
a figure then depends on when it was taken. Here every round times every variant (and cuBLAS fp16
and bf16 through torch, in the same process) once per shape, in turn, and the figure is the median
over rounds, with the min and max beside it. A variant is a spec dict (the op's specialisation
constants, "tuned" for the registry's own choice); each is checked on the timed shape first (three
rows of C against numpy, ``VkGemm.spot_error``) and dropped with a line when it is off.

    python bench/ab_coopmat.py --op gemm_coopmat_f16 --configs FILE.json [--shapes 4096x4096x4096,...]
        [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

BENCH = "ab_coopmat"


def main(argv: list[str] | None = None) -> int:
    import common
    from bench_gemm import VkGemm, torch_seconds_per_matmul
    from sweep_coopmat import config_name, parse_shape

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="gemm_coopmat_f16", choices=("gemm_coopmat_f16", "gemm_coopmat"))
    parser.add_argument("--configs", required=True, help='JSON list of spec dicts, or "tuned"')
    parser.add_argument("--shapes", default="4096x4096x4096,8192x8192x8192,4000x4000x4000")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3, help="submissions per figure (median)")
    parser.add_argument("--target", type=float, default=0.02, help="GPU seconds per submission")
    parser.add_argument("--tol", type=float, default=5e-3, help="spot check against the fp32 product")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rep = common.Reporter(args.out)
    backend, why = common.open_vulkan("auto")
    if backend is None:
        rep.missing(BENCH, "vkflow", "not available", why)
        return 1
    device = backend.facts.name
    torch = common.import_torch()
    cuda = torch is not None and torch.cuda.is_available()
    variants = [None if c == "tuned" else c for c in json.loads(Path(args.configs).read_text())]
    dtype = "float16" if args.op == "gemm_coopmat_f16" else "float32"
    for text in args.shapes.split(","):
        shape = parse_shape(text)
        flop = 2.0 * shape[0] * shape[1] * shape[2]
        gemm = VkGemm(backend, shape, seed=1, dtype=dtype)
        names = {("tuned" if v is None else config_name(v)): v for v in variants}
        usable = {}
        for name, spec in names.items():
            gemm.seconds_per_gemm(spec, 1, 0.001, 2, args.op)  # compile and warm up
            err = gemm.spot_error()
            if err is None or err <= args.tol:
                usable[name] = spec
            else:
                rep.missing(BENCH, name, "wrong", f"spot error {err:.3e}", shape=text)
        times: dict[str, list[float]] = {name: [] for name in usable}
        if cuda:
            times.update({"cublas_fp16": [], "cublas_bf16": []})
        for _ in range(args.rounds):
            for name, spec in usable.items():
                seconds, _ = gemm.seconds_per_gemm(spec, args.reps, args.target, 200, args.op)
                times[name].append(seconds)
            if cuda:
                for label, kind in (("cublas_fp16", torch.float16), ("cublas_bf16", torch.bfloat16)):
                    times[label].append(torch_seconds_per_matmul(torch, shape, kind, args.reps, args.target))
        best_cublas = min((statistics.median(times[k]) for k in ("cublas_fp16",) if k in times), default=None)
        for name, values in times.items():
            median = statistics.median(values)
            fields = dict(shape=text, op=args.op, rounds=len(values), us=median * 1e6)
            fields.update(tflops=flop / median / 1e12, tflops_min=flop / max(values) / 1e12)
            fields.update(tflops_max=flop / min(values) / 1e12)
            if best_cublas and not name.startswith("cublas"):
                fields["vs_cublas_fp16"] = best_cublas / median
            rep.figure(BENCH, name, device, **fields)
        del gemm
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The char GPT's MLP block launch by launch, each epilogue against the launches it replaces.

bench_gpt.py's model (L6 H6 D384 T256 B64) runs fc1 = Linear(1536, gelu) and fc2 = Linear(384) over
16384 rows. This times, as GPU medians from timestamp queries, every launch that block's step can
take (session 14, H19): fc1's GEMM plain, with its output's copy (gemm_coopmat_copy) and with an
activation applied to that copy or to its output; the unary GELU (and unary_half, GELU straight to
fp16), the cast, unary_backward and the residual add; fc2's forward from an fp32 or an fp16
activation, plain or writing the residual sum; fc2's input gradient plain and with each activation
derivative in its epilogue; the same for the fp32 GEMMs (gemm, gemm_copy, gemm_residual). The copy
GEMMs run as named (half_bits.glsl's rounding), and also as their _rte variants (the device's
rounding, registry.FP16_ROUNDING_VARIANTS) and without the fp32 output (gemm_coopmat_half). Launches
are timed in a program of ``--repeat`` rounds with a barrier after each, ``--reps`` submissions; one
JSON line per launch with its median microseconds.

    python3 bench/bench_epilogues.py [--reps 5] [--repeat 10] [--only mixed,float32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ROWS, D, HIDDEN = 16384, 384, 1536


def tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every tensor the launches bind, with random contents (pre-activations near N(0, 1))."""

    def normal(*shape, scale=1.0, half=False):
        return (rng.standard_normal(shape) * scale).astype(np.float16 if half else np.float32)

    w1, w2 = D**-0.5, HIDDEN**-0.5
    return {
        "X32": normal(ROWS, D), "X16": normal(ROWS, D, half=True),
        "W1": normal(D, HIDDEN, scale=w1), "W1h": normal(D, HIDDEN, scale=w1, half=True),
        "W2": normal(HIDDEN, D, scale=w2), "W2h": normal(HIDDEN, D, scale=w2, half=True),
        "b1": normal(HIDDEN), "b2": normal(D),
        "PRE": normal(ROWS, HIDDEN), "ACT": normal(ROWS, HIDDEN), "ACTH": normal(ROWS, HIDDEN, half=True),
        "OUT": normal(ROWS, D), "SUM": normal(ROWS, D), "RES": normal(ROWS, D),
        "DZ32": normal(ROWS, D), "DZh": normal(ROWS, D, half=True),
        "DX": normal(ROWS, HIDDEN), "DXB": normal(ROWS, HIDDEN),
    }  # fmt: skip


def variants(precision: str) -> dict[str, tuple]:
    """name -> (op, bindings, params[, specialisation constants over the tuned ones]) for one
    precision's launches."""
    from shaders.registry import ACTIVATIONS, BINARY, CASTS

    act, n1 = ACTIVATIONS, ROWS * HIDDEN
    half = dict(a_half=1, b_half=1) if precision == "mixed" else {}
    fc1 = dict(M=ROWS, N=HIDDEN, K=D, has_bias=1, **half)
    fc2 = dict(M=ROWS, N=D, K=HIDDEN, has_bias=1, **half)
    dx2 = dict(M=ROWS, N=HIDDEN, K=D, trans_b=1, **half)
    found = {
        "unary gelu": ("unary", ("PRE", "ACT"), dict(n=n1, fn=act["gelu"])),
        "unary_backward gelu": ("unary_backward", ("DX", "PRE", "DXB"), dict(n=n1, fn=act["gelu"])),
        "binary add (residual)": ("binary", ("RES", "OUT", "SUM"), dict(n=ROWS * D, fn=BINARY["add"])),
    }
    if precision == "float32":
        x, w1, w2, dz, copies = "X32", "W1", "W2", "DZ32", ("relu", "gelu")
        gemm, copy, residual, derivatives = "gemm", "gemm_copy", "gemm_residual", ("relu", "gelu")
        found["fc2 gemm"] = (gemm, ("ACT", w2, "b2", "OUT"), fc2)
    else:
        x, w1, w2, dz, copies = "X16", "W1h", "W2h", "DZh", ("relu", "sigmoid", "tanh", "gelu")
        gemm, copy, residual = "gemm_coopmat", "gemm_coopmat_copy", "gemm_coopmat_residual"
        derivatives = ("relu", "tanh", "gelu")
        found["cast (fp32 -> fp16)"] = ("cast", ("ACT", "ACTH"), dict(n=n1, mode=CASTS["f32_to_f16"]))
        found["unary_half gelu"] = ("unary_half", ("PRE", "ACTH"), dict(n=n1, fn=act["gelu"]))
        found["fc2 fp32 act"] = (gemm, ("ACT", w2, "b2", "OUT"), {**fc2, "a_half": 0})
        found["fc2 fp16 act"] = (gemm, ("ACTH", w2, "b2", "OUT"), fc2)
    operand = "ACT" if precision == "float32" else "ACTH"
    found[f"fc1 {gemm}"] = (gemm, (x, w1, "b1", "PRE"), fc1)
    found[f"fc1 {gemm} act=gelu"] = (gemm, (x, w1, "b1", "PRE"), {**fc1, "act": act["gelu"]})
    found[f"fc1 {copy}"] = (copy, (x, w1, "b1", "PRE", operand), fc1)
    if precision == "mixed":  # the copy alone (no fp32 output), and both with the hardware's rounding
        for op in ("gemm_coopmat_half", "gemm_coopmat_copy_rte", "gemm_coopmat_half_rte"):
            found[f"fc1 {op}"] = (op, (x, w1, "b1", "PRE", operand), fc1)
    for name in copies:
        found[f"fc1 {copy} copy_act={name}"] = (
            copy,
            (x, w1, "b1", "PRE", operand),
            {**fc1, "copy_act": act[name]},
        )
    found[f"fc2 {residual}"] = (residual, (operand, w2, "b2", "SUM", "RES"), fc2)
    found[f"fc2 dX {gemm}"] = (gemm, (dz, w2, dz, "DX"), dx2)
    for name in derivatives:
        found[f"fc2 dX {gemm} act_grad={name}"] = (
            gemm,
            (dz, w2, "PRE", "DX"),
            {**dx2, "act_grad": act[name]},
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--only", default="mixed,float32")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from actors.single_op import single_op_layout
    from bench.common import open_vulkan
    from flow.program import Barrier, Program, launch
    from shaders import registry
    from shaders.registry import resolve

    registry.FP16_HARDWARE_ROUNDING = False  # the plain ops round by half_bits, the _rte rows by the device

    backend, why = open_vulkan("auto")
    if backend is None:
        sys.exit(f"needs a Vulkan device: {why}")
    arrays = tensors(np.random.default_rng(0))
    backend.open_layout(single_op_layout(arrays))
    for name, array in arrays.items():
        backend.write(name, array)
    rows = []
    for precision in args.only.split(","):
        if precision == "mixed" and not backend.facts.has("cooperative_matrix"):
            print(f"mixed: {backend.facts.name} has no cooperative matrices", file=sys.stderr)
            continue
        chosen = variants(precision)
        steps = []
        for op, bindings, params, *constants in chosen.values():
            step = resolve(launch(op, bindings, **params), backend.facts)
            steps.append(replace(step, constants=tuple({**dict(step.constants), **constants[0]}.items()))
                         if constants else step)  # fmt: skip
        body = []
        for _ in range(args.repeat):
            for step in steps:
                body += [step, Barrier()]
        pool = backend.timestamp_pool(len(steps) * args.repeat + 1)
        handle = backend.record(Program(f"epilogues-{precision}", tuple(body[:-1])), 0, timestamps=pool)
        diffs: list[float] = []
        for rep in range(args.reps + 1):
            backend.wait(backend.submit(handle))
            if rep:  # the first submission warms up
                diffs.extend(np.diff(backend.read_timestamps_ns(pool)).tolist())
        for index, name in enumerate(chosen):
            us = statistics.median(diffs[index :: len(steps)]) / 1e3
            rows.append({"bench": "epilogues", "precision": precision, "launch": name, "us": round(us, 1)})
            print(f"{precision:7s} {us:9.1f} us  {name}", flush=True)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()

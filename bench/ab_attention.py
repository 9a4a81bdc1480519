"""A/B timing of the attention kernels' tiles: the tensor-core ones (attention_coopmat,
_backward_kv, _q), or with ``--scalar`` the float32 ones (attention, _backward_kv, _q: BR, BC, G),
each variant checked against a float64 numpy oracle before it is timed.

A variant is a spec dict (BC, WARPS, PREFETCH; with --scalar BR, BC, G; "tuned" for the
registry's own choice) applied to all three kernels (a kernel whose shared memory it would overflow
keeps its tuned tiles). Each is first run on odd shapes (T across the blocks, dh 16 to 128, causal
and not) and compared with the oracle of the fp16-rounded inputs (--scalar: of the float32 inputs,
to SCALAR_TOL); a variant off by more than the tolerance is reported and not timed. Timing: at
the char GPT's shape, every round times every variant's three kernels in turn (GPU timestamps
around each launch, median over launches), and the figure is the median over rounds.

    python bench/ab_attention.py [--scalar] [--configs JSON] [--shape N,T,H,dh] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "bench", ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from attention_oracle import attention_oracle  # noqa: E402 - tests/, on the path from here on

BENCH = "ab_attention"
KINDS = ("forward", "kv", "q")
DEFAULT_CONFIGS = [
    "tuned",
    {"BC": 64, "WARPS": 2},
    {"BC": 64, "WARPS": 4},
    {"BC": 32, "WARPS": 4},
    {"BC": 32, "WARPS": 2, "PREFETCH": 0},
    {"BC": 32, "WARPS": 2, "SYNC": 0},
]
CHECK_SHAPES = [(2, 37, 3, 32), (1, 129, 2, 64), (2, 256, 2, 64), (1, 71, 2, 128), (2, 20, 1, 16)]
TOL = 2e-3  # against the oracle of the fp16-rounded inputs (tests/test_ops_attention.py)
# The float32 kernels' variants (--scalar): rows a workgroup, streamed rows, threads a row.
SCALAR_CONFIGS = [
    "tuned",
    *(
        {"BR": br, "BC": bc, "G": g}
        for g in (2, 4, 8)
        for br in (32, 64, 128)
        for bc in (32, 64)
        if br * g <= 512
    ),
]
SCALAR_TOL = 1e-4  # float32 inputs, against the float64 oracle of the same inputs


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / max(np.linalg.norm(want), 1e-30))


class Attention:
    """One shape's tensors on the device, and the four launches of a forward and backward."""

    def __init__(
        self, backend, n: int, t: int, heads: int, dh: int, causal: bool, seed: int, scalar: bool = False
    ) -> None:
        from actors.single_op import single_op_layout
        from shaders.attention_tiles import COOPMAT_ATTENTION_OPS, SCALAR_ATTENTION_OPS

        self.backend, self.scalar = backend, scalar
        self.ops = SCALAR_ATTENTION_OPS if scalar else COOPMAT_ATTENTION_OPS
        d = heads * dh
        rng = np.random.default_rng(seed)
        self.qkv = (rng.standard_normal((n, t, 3 * d)) * 1.5).astype(np.float32)
        self.dy = rng.standard_normal((n, t, d)).astype(np.float32)
        self.arrays = {
            "qkv": self.qkv,
            "Y": np.full((n, t, d), np.nan, np.float32),
            "L": np.full((n, heads, t), np.nan, np.float32),
            "dY": self.dy,
            "Drow": np.full((n, heads, t), np.nan, np.float32),
            "dqkv": np.full((n, t, 3 * d), np.nan, np.float32),
        }
        self.p = {"N": n, "T": t, "H": heads, "dh": dh, "scale": 1.0 / math.sqrt(dh), "causal": int(causal)}
        self.shape = (n, t, heads, dh, causal)
        backend.open_layout(single_op_layout(self.arrays))
        for name, array in self.arrays.items():
            backend.write(name, array)

    def launches(self, kinds: tuple[str, ...]):
        from flow.program import launch

        binds = {
            "forward": (self.ops["forward"], ("qkv", "Y", "L")),
            "dot": ("attention_backward_dot", ("dY", "Y", "Drow")),
            "kv": (self.ops["kv"], ("qkv", "dY", "L", "Drow", "dqkv")),
            "q": (self.ops["q"], ("qkv", "dY", "L", "Drow", "dqkv")),
        }
        return [launch(*binds[kind], **self.p) for kind in kinds]

    def program(self, kinds: tuple[str, ...], repeat: int = 1):
        from flow.program import Barrier, Program

        steps = []
        for one in self.launches(kinds) * repeat:
            steps += [Barrier(), one] if steps else [one]
        return Program(name="ab-attention", steps=tuple(steps))

    def overrides(self, spec: dict | None) -> dict[str, dict] | None:
        """The variant's tiles for each kernel whose shared memory they fit (the rest: tuned)."""
        from shaders import attention_tiles as tiles

        if spec is None:
            return None
        tune = tiles.tune_attention if self.scalar else tiles.tune_attention_coopmat
        size = tiles.attention_shared_bytes if self.scalar else tiles.coopmat_attention_shared_bytes
        chosen = {}
        for kind in KINDS:
            spec_of_kind = {**tune(kind, self.p, self.backend.facts), **spec}
            if size(kind, spec_of_kind) <= self.backend.facts.shared_memory_bytes:
                chosen[self.ops[kind]] = spec_of_kind
        return chosen

    def errors(self, spec: dict | None) -> dict[str, float]:
        """The variant's relative errors against the oracle of the fp16-rounded inputs."""
        program = self.program(("forward", "dot", "kv", "q"))
        handle = self.backend.record(program, 0, spec_overrides=self.overrides(spec))
        self.backend.wait(self.backend.submit(handle))
        n, t, heads, dh, causal = self.shape
        # What the kernels multiply: the float32 inputs, or (tensor cores) their fp16 roundings.
        seen = (lambda a: a) if self.scalar else (lambda a: a.astype(np.float16).astype(np.float32))
        y, lse, _drow, dqkv = attention_oracle(seen(self.qkv), seen(self.dy), heads, self.p["scale"], causal)
        d = heads * dh
        got = {name: self.backend.read(name).reshape(self.arrays[name].shape) for name in ("Y", "L", "dqkv")}
        return {
            "Y": relative_error(got["Y"], y),
            "L": relative_error(got["L"], lse),
            "dq": relative_error(got["dqkv"][..., :d], dqkv[..., :d]),
            "dk": relative_error(got["dqkv"][..., d : 2 * d], dqkv[..., d : 2 * d]),
            "dv": relative_error(got["dqkv"][..., 2 * d :], dqkv[..., 2 * d :]),
        }

    def us(self, spec: dict | None, repeat: int, submissions: int) -> dict[str, float]:
        """Median GPU microseconds of each kernel over ``repeat`` x ``submissions`` launches."""
        kinds = ("forward", "dot", "kv", "q")
        pool = self.backend.timestamp_pool(len(kinds) * repeat + 1)
        handle = self.backend.record(
            self.program(kinds, repeat), 0, spec_overrides=self.overrides(spec), timestamps=pool
        )
        diffs = []
        for _ in range(submissions):
            self.backend.wait(self.backend.submit(handle))
            diffs.append(np.diff(self.backend.read_timestamps_ns(pool)).reshape(repeat, len(kinds)))
        med = np.median(np.concatenate(diffs), axis=0) / 1e3
        return dict(zip(kinds, (float(v) for v in med), strict=True))


def name_of(spec: dict | None) -> str:
    return "tuned" if spec is None else "-".join(f"{k}{v}" for k, v in sorted(spec.items()))


def main(argv: list[str] | None = None) -> int:
    import common

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scalar", action="store_true", help="the float32 kernels (BR, BC, G)")
    parser.add_argument("--configs", default=None, help='JSON list of spec dicts, or "tuned"')
    parser.add_argument("--shape", default="64,256,6,64", help="N,T,H,dh (causal)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rep = common.Reporter(args.out)
    if args.scalar:  # the float32 kernels run on any Vulkan device
        backend, why = common.open_vulkan("auto")
        if backend is None:
            rep.missing(BENCH, "vkflow", "not available", why)
    else:
        backend = common.open_coopmat(rep, BENCH)
    if backend is None:
        return 1
    configs = json.loads(args.configs) if args.configs else SCALAR_CONFIGS if args.scalar else DEFAULT_CONFIGS
    tolerance = SCALAR_TOL if args.scalar else TOL
    variants = {name_of(None if c == "tuned" else c): (None if c == "tuned" else c) for c in configs}
    usable = {}
    for name, spec in variants.items():
        worst, where = 0.0, ""
        try:
            for index, (n, t, heads, dh) in enumerate(CHECK_SHAPES):
                for causal in (True, False):
                    errors = Attention(backend, n, t, heads, dh, causal, index, args.scalar).errors(spec)
                    for what, err in errors.items():
                        if not err <= worst:  # NaN counts as worst
                            case = f"N{n}-T{t}-H{heads}-dh{dh}-{'causal' if causal else 'full'}"
                            worst, where = err, f"{what} {case}"
        except Exception as error:  # a variant that fails to build or fit: report, go on
            rep.missing(BENCH, name, "failed", f"{type(error).__name__}: {error}")
            continue
        rep.emit({"bench": BENCH, "impl": name, "check": "oracle", "worst": worst, "where": where})
        if worst <= tolerance:
            usable[name] = spec
        else:
            rep.missing(BENCH, name, "wrong", f"relative error {worst:.3e} at {where}")
    n, t, heads, dh = (int(x) for x in args.shape.split(","))
    timed = Attention(backend, n, t, heads, dh, True, 0, args.scalar)
    flops = 2 * 2 * n * heads * t * t * dh / 2
    times: dict[str, list[dict[str, float]]] = {name: [] for name in usable}
    for spec in usable.values():  # warm-up, not counted: the first variant timed on an idle GPU
        timed.us(spec, repeat=5, submissions=3)  # ran at a fraction of its clock (session 14)
    for _ in range(args.rounds):
        for name, spec in usable.items():
            times[name].append(timed.us(spec, repeat=5, submissions=3))
    for name, rounds in times.items():
        us = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        total = sum(us.values())
        rep.figure(
            BENCH, name, backend.facts.name, shape=f"N{n}-T{t}-H{heads}-dh{dh}-causal",
            forward_us=us["forward"], dot_us=us["dot"], kv_us=us["kv"], q_us=us["q"], total_us=total,
            forward_tflops=flops / us["forward"] / 1e6, total_tflops=3.5 * flops / total / 1e6,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

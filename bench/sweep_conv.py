"""Sweep the implicit-GEMM convolutions' tiles (and the weight gradient's K slices) over the CNN's
two layers at batch 256, one device call.

Each (layer, direction, tiles, slices) is checked at full size against the float64 CPU ops
(actors.cpu_ops), then timed with timestamps: a program of back-to-back convolutions separated by
barriers, median over repetitions; a split weight gradient's time is its main launch plus its
conv_splitk_sum (both reported). One JSON line per configuration, then the best per direction.

    python bench/sweep_conv.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from bench_conv import BATCH, LAYERS, QUICK_BATCH, QUICK_LAYERS, RELU, conv_params, flops
from common import median, open_vulkan

from actors import cpu_ops
from actors.single_op import single_op_layout
from flow.autodiff import conv_weight_splits
from flow.program import Barrier, Program, launch
from shaders.tiles import CONV_TILES, conv_fits, conv_gemm_shape


def tile(bm, bn, bk, tm, tn) -> dict[str, int]:
    return {"BM": bm, "BN": bn, "BK": bk, "TM": tm, "TN": tn}


CANDIDATES = tuple(CONV_TILES) + (
    tile(64, 64, 32, 4, 4),
    tile(64, 64, 32, 4, 8),
    tile(64, 64, 32, 8, 4),
    tile(128, 64, 16, 8, 4),
    tile(128, 128, 16, 8, 8),
    tile(128, 128, 32, 8, 8),
    tile(64, 96, 32, 4, 8),
    tile(64, 96, 16, 4, 8),
    tile(64, 96, 32, 4, 4),
    tile(64, 144, 32, 4, 12),
    tile(64, 144, 16, 4, 12),
    tile(64, 32, 16, 4, 4),
    tile(32, 64, 32, 4, 4),
    tile(32, 96, 32, 4, 8),
    tile(128, 32, 16, 8, 4),
    tile(256, 32, 32, 8, 4),
    tile(256, 64, 16, 8, 8),
    tile(256, 32, 16, 8, 4),
    tile(32, 32, 64, 4, 4),
    tile(32, 16, 32, 4, 4),
    tile(32, 16, 64, 2, 4),
    tile(32, 16, 32, 2, 4),
    tile(128, 32, 8, 8, 4),
    tile(256, 32, 8, 8, 4),
    tile(64, 32, 8, 4, 4),
    tile(128, 64, 8, 8, 4),
)
# --short: the winners of a full sweep on an H100, and the old defaults.
SHORT = (
    tile(64, 64, 16, 4, 4),
    tile(64, 32, 32, 4, 4),
    tile(64, 32, 16, 4, 4),
    tile(64, 32, 8, 4, 4),
    tile(128, 32, 32, 8, 4),
    tile(128, 64, 32, 8, 4),
    tile(32, 16, 32, 2, 4),
    tile(32, 32, 32, 4, 4),
)
SPLITS = (0, 16, 32, 64, 128, 256, 512)  # 0: autodiff's choice
MAX_SPLITS = 512


class Layer:
    def __init__(self, backend, p: dict[str, int], relu_dy: bool = False) -> None:
        self.backend, self.p = backend, p
        n, c, h, w, k = p["N"], p["C"], p["H"], p["W"], p["K"]
        self.wm, self.wn, self.wk = conv_gemm_shape("weight", p)
        rng = np.random.default_rng(0)
        self.host = {
            "X": rng.uniform(-1, 1, (n, c, h, w)).astype(np.float32),
            "Wt": rng.uniform(-1, 1, (k, c, p["R"], p["S"])).astype(np.float32),
            "bias": rng.uniform(-1, 1, k).astype(np.float32),
            "dY": rng.uniform(-1, 1, (n, k, p["OH"], p["OW"])).astype(np.float32),
            "Y": np.zeros((n, k, p["OH"], p["OW"]), np.float32),
            "dX": np.zeros((n, c, h, w), np.float32),
            "dW": np.zeros((k, c, p["R"], p["S"]), np.float32),
            "WS": np.zeros((MAX_SPLITS, self.wm, self.wn), np.float32),
        }
        if relu_dy:  # a gradient through a ReLU: about half of it zeros
            self.host["dY"][rng.uniform(size=self.host["dY"].shape) < 0.5] = 0.0
        backend.open_layout(single_op_layout(self.host))
        for name in ("X", "Wt", "bias", "dY"):
            backend.write(name, self.host[name])
        wide = {name: a.astype(np.float64).ravel() for name, a in self.host.items()}
        cpu_ops.conv2d([wide["X"], wide["Wt"], wide["bias"], wide["Y"]], {**p, "has_bias": 1, "act": RELU})
        cpu_ops.conv2d_backward_data([wide["dY"], wide["Wt"], wide["dX"]], p)
        cpu_ops.conv2d_backward_weight([wide["X"], wide["dY"], wide["dW"]], p)
        self.want = {"forward": wide["Y"], "data": wide["dX"], "weight": wide["dW"]}

    def launches(self, direction: str, splits: int) -> list:
        p = self.p
        if direction == "forward":
            return [launch("conv2d_gemm", ("X", "Wt", "bias", "Y"), **p, has_bias=1, act=RELU)]
        if direction == "data":
            return [launch("conv2d_gemm_backward_data", ("dY", "Wt", "dX"), **p)]
        if splits <= 1:
            return [launch("conv2d_gemm_backward_weight", ("X", "dY", "dW"), **p)]
        return [
            launch("conv2d_gemm_backward_weight", ("X", "dY", "WS"), **p, k_splits=splits),
            launch("conv_splitk_sum", ("WS", "dW"), total=self.wm * self.wn, splits=splits),
        ]

    def record(self, direction, splits, cfg, repeats, pool=None):
        steps: list = []
        for _ in range(repeats):
            for one in self.launches(direction, splits):
                steps += [Barrier(), one] if steps else [one]
        program = Program(name=f"sweep_{direction}_x{repeats}", steps=tuple(steps))
        op = {"forward": "conv2d_gemm", "data": "conv2d_gemm_backward_data"}.get(
            direction, "conv2d_gemm_backward_weight"
        )
        overrides = {op: cfg} if cfg else None
        return self.backend.record(program, 0, spec_overrides=overrides, timestamps=pool)

    def error(self, direction, splits, cfg) -> float:
        self.backend.wait(self.backend.submit(self.record(direction, splits, cfg, 1)))
        out = {"forward": "Y", "data": "dX", "weight": "dW"}[direction]
        got = self.backend.read(out).astype(np.float64).ravel()
        want = self.want[direction]
        return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))

    def seconds(self, direction, splits, cfg, target_s, reps) -> list[float]:
        """Median seconds of each launch of one convolution."""
        per = len(self.launches(direction, splits))

        def timed(repeats: int, times: int) -> np.ndarray:
            pool = self.backend.timestamp_pool(repeats * per + 1)
            handle = self.record(direction, splits, cfg, repeats, pool)
            rows = []
            for _ in range(times):
                self.backend.wait(self.backend.submit(handle))
                rows.append(np.diff(self.backend.read_timestamps_ns(pool)).reshape(repeats, per))
            return np.concatenate(rows)

        probe = float(np.median(timed(2, 1).sum(axis=1))) * 1e-9
        repeats = int(min(300, max(3, round(target_s / max(probe, 1e-9)))))
        diffs = timed(repeats, reps)
        return [median(diffs[:, i].tolist()) * 1e-9 for i in range(per)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--short", action="store_true", help="the SHORT tiles only")
    parser.add_argument("--relu-dy", action="store_true", help="dY half zeros, as through a ReLU")
    parser.add_argument("--target", type=float, default=0.03, help="GPU seconds per timed program")
    args = parser.parse_args()
    backend, why = open_vulkan()
    if backend is None:
        raise SystemExit(f"no Vulkan: {why}")
    facts = backend.facts
    print(f"sweep_conv on {facts.name}, {facts.shared_memory_bytes} B shared", flush=True)
    out = open(args.out, "a") if args.out else None
    started = time.perf_counter()
    best: dict[tuple[str, str], tuple[float, str]] = {}
    for name, c, h, w, k in reversed(QUICK_LAYERS if args.quick else LAYERS):  # conv2 first
        p = conv_params(QUICK_BATCH if args.quick else BATCH, c, h, w, k)
        layer = Layer(backend, p, args.relu_dy)
        for direction in ("forward", "data", "weight"):
            if name == "conv1" and direction == "data":
                continue  # never run in training
            auto = conv_weight_splits(layer.wm, layer.wn, layer.wk)
            splits_list = [s or auto for s in SPLITS] if direction == "weight" else [1]
            for cfg in (None, *(SHORT if args.short else CANDIDATES)):
                if cfg and not conv_fits(cfg, facts.shared_memory_bytes, facts.max_workgroup_invocations):
                    continue
                m, n, _ = conv_gemm_shape(direction, p)
                if cfg and (cfg["BM"] > 2 * max(m, 32) or cfg["BN"] > 2 * max(n, 16)):
                    continue  # mostly padding
                for splits in dict.fromkeys(splits_list):
                    if cfg is None and splits != auto and direction == "weight":
                        continue
                    label = "tuned" if cfg is None else "{BM}x{BN}x{BK}/{TM}x{TN}".format(**cfg)
                    row = {"relu_dy": args.relu_dy, "layer": name, "dir": direction, "cfg": label}
                    row["splits"] = splits
                    try:
                        row["err"] = layer.error(direction, splits, cfg)
                        times = layer.seconds(direction, splits, cfg, args.target, args.reps)
                    except Exception as error:  # a config the driver refuses: report, go on
                        row["fail"] = f"{type(error).__name__}: {error}"[:200]
                        print(json.dumps(row), flush=True)
                        continue
                    total = sum(times)
                    row.update(us=round(total * 1e6, 2), parts_us=[round(t * 1e6, 2) for t in times])
                    row["tflops"] = round(flops(p) / total / 1e12, 3)
                    line = json.dumps(row)
                    print(line, flush=True)
                    if out:
                        out.write(line + "\n")
                    key = (name, direction)
                    if row["err"] < 1e-4 and (key not in best or total < best[key][0]):
                        best[key] = (total, f"{label} splits {splits}: {row['tflops']} TFLOP/s")
    for (name, direction), (_, text) in best.items():
        print(f"BEST {name} {direction}: {text}")
    print(f"sweep took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

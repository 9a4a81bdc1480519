"""Shared helpers for the benchmarks: command line, timing, figures as JSON lines, the table.

Every figure is printed at once as one JSON line on stdout (and appended to ``--out``), so a run
cut short still leaves what it measured; the table of all figures follows at the end. Host clocks
time only end-to-end loops (samples/s of full steps); GPU times come from Vulkan timestamp queries
and CUDA events, measured in the scripts.

Importing this module puts the repository root on ``sys.path`` when vkflow is not importable yet,
so ``python bench/bench_mlp.py`` works from a checkout without installing anything.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
try:
    import flow  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

PARTS = "abcde"


def parse_args(description: str, default_parts: str) -> argparse.Namespace:
    """The command line every benchmark script shares.

    Args:
        description: the script's one-line description.
        default_parts: the parts (letters of the issue: a-e) the script runs when ``--only`` is absent.

    Returns:
        The parsed arguments; ``parts`` is the set of part letters to run.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes and few iterations (a smoke run on lavapipe / CPU torch)",
    )
    parser.add_argument(
        "--only",
        default=",".join(default_parts),
        help=f"comma-separated parts to run, from a,b,c,d,e (default {','.join(default_parts)})",
    )
    parser.add_argument("--out", default=None, help="also append every JSON line to this file")
    parser.add_argument(
        "--reps", type=int, default=None, help="timed repetitions per figure (median reported)"
    )
    parser.add_argument("--device", default="auto", help="Vulkan device: index, name substring or auto")
    parser.add_argument(
        "--metrics-every", type=int, default=1, help="RunSettings.metrics_every: steps a metrics line"
    )
    args = parser.parse_args()
    parts = {p.strip().lower() for p in args.only.split(",") if p.strip()}
    unknown = parts - set(PARTS)
    if unknown:
        parser.error(f"--only takes letters from a,b,c,d,e; got {sorted(unknown)}")
    args.parts = parts
    if args.reps is None:
        args.reps = 3 if args.quick else 5
    return args


# -- timing ----------------------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def calibrated_reps(
    run: Callable[[int], float], reps: int, target_s: float, start: int = 8, limit: int = 1_000_000
) -> tuple[int, list[float]]:
    """Find an iteration count whose run takes about ``target_s``, then time ``reps`` runs of it.

    The calibration runs double as warm-up (pipelines compiled, caches and clocks settled).

    Args:
        run: runs n iterations and returns the elapsed seconds.
        reps: timed repetitions after calibration.
        target_s: wanted duration of one repetition.
        start: first iteration count tried.
        limit: the most iterations one repetition may have.

    Returns:
        (iterations per repetition, seconds of each repetition).
    """
    n = max(1, start)
    while True:
        elapsed = run(n)
        if elapsed >= target_s * 0.7 or n >= limit:
            break
        grow = target_s / max(elapsed, 1e-9)
        n = min(limit, max(n + 1, int(n * min(grow, 8.0))))
    return n, [run(n) for _ in range(reps)]


def host_seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- optional dependencies --------------------------------------------------------------------------


def import_torch():
    """torch with fp32 meaning fp32 (no TF32 in matmuls or convolutions: the issue's condition for
    every comparison), or None when it is not installed (or fails to import)."""
    try:
        import torch
    except Exception:  # any import failure means "no torch" for a benchmark
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return torch


def open_torch():
    """(torch or None, its device's name or "-"), as ``import_torch``, saying which on stdout."""
    torch = import_torch()
    if torch is None:
        print("torch: not installed; torch figures are skipped")
        return None, "-"
    kind, device = torch_target(torch)
    print(f"torch {torch.__version__} on {kind}: {device}")
    return torch, device


def torch_target(torch) -> tuple[str, str]:
    """("cuda", GPU name) when torch sees a CUDA device, else ("cpu", processor name)."""
    if torch is not None and torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_name(0)
    return "cpu", cpu_name()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def open_vulkan(device: str = "auto"):
    """(VulkanBackend, None) or (None, why not): never raises, so a machine without Vulkan still
    gets the torch figures."""
    try:
        from actors.vulkan import VulkanBackend

        select: int | str = int(device) if device.isdigit() else device
        return VulkanBackend(select), None
    except Exception as error:  # no loader, no driver, no device: report and go on
        return None, f"{type(error).__name__}: {error}"


def open_coopmat(rep: Reporter, bench: str):
    """The Vulkan backend when its device has cooperative matrices, else None after reporting why
    (the tensor-core benchmarks' first step)."""
    backend, why = open_vulkan("auto")
    if backend is not None and not backend.facts.has("cooperative_matrix"):
        backend, why = None, f"{backend.facts.name} has no cooperative matrices"
    if backend is None:
        rep.missing(bench, "vkflow", "not available", why)
    return backend


# -- reporting --------------------------------------------------------------------------------------


def _fmt(value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-2):
            return f"{value:.3e}"
        return f"{value:,.2f}" if abs(value) >= 100 else f"{value:.4g}"
    return str(value)


def _round(value):
    """Six significant digits for floats (tiny lavapipe TFLOP/s and big samples/s alike)."""
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.6g}")
    return value


class Reporter:
    """Prints each figure as one JSON line as soon as it exists and keeps it for the final table."""

    # Keys that describe what was measured (the table's "case" column), in print order.
    CASE_KEYS = ("opt", "shape", "dtype", "tiles", "in_flight", "mode", "bytes")
    VALUE_KEYS = ("samples_per_s", "tflops", "gb_per_s", "idle_fraction", "ms", "us")

    def __init__(self, out: str | None = None) -> None:
        self.rows: list[dict] = []
        self._out = open(out, "a") if out else None  # noqa: SIM115 - open for the whole run

    def emit(self, record: dict) -> dict:
        record = {k: _round(v) for k, v in record.items()}
        line = json.dumps(record, default=str)
        print(line, flush=True)
        if self._out is not None:
            self._out.write(line + "\n")
            self._out.flush()
        self.rows.append(record)
        return record

    def figure(self, bench: str, impl: str, device: str, **fields) -> dict:
        """One measured figure; ``fields`` holds its value key (e.g. samples_per_s) and its case."""
        return self.emit({"bench": bench, **fields, "impl": impl, "device": device})

    def ratio(
        self, bench: str, name: str, numerator: float | None, denominator: float | None, **fields
    ) -> dict | None:
        """A ratio line ``{"bench", "ratio": "a/b", "value"}``; skipped when either side is missing."""
        if not numerator or not denominator or math.isnan(numerator) or math.isnan(denominator):
            return None
        return self.emit({"bench": bench, **fields, "ratio": name, "value": numerator / denominator})

    def missing(self, bench: str, impl: str, status: str, reason: str = "", **fields) -> dict:
        """A figure that could not be taken: ``status`` is "not available", "not implemented" or "error"."""
        record = {"bench": bench, **fields, "impl": impl, "status": status}
        if reason:
            record["reason"] = reason
        return self.emit(record)

    def guarded(self, bench: str, impl: str, fn: Callable[[], object], **fields) -> object | None:
        """Run one measurement; an exception becomes an "error" line instead of ending the run."""
        try:
            return fn()
        except Exception as error:  # a benchmark reports a broken figure and carries on
            traceback.print_exc(limit=4, file=sys.stderr)
            self.missing(bench, impl, "error", f"{type(error).__name__}: {error}", **fields)
            return None

    def table(self) -> str:
        """Every figure and ratio so far as an aligned text table."""
        header = ("bench", "case", "impl", "metric", "value", "device / note")
        lines = [header]
        for row in self.rows:
            case = " ".join(f"{k}={row[k]}" for k in self.CASE_KEYS if k in row)
            if "ratio" in row:
                lines.append((row["bench"], case, row["ratio"], "ratio", _fmt(row["value"]), ""))
                continue
            if "status" in row:
                lines.append(
                    (row["bench"], case, row["impl"], "-", row["status"], row.get("reason", "")[:70])
                )
                continue
            key = next((k for k in self.VALUE_KEYS if k in row), None)
            value = _fmt(row[key]) if key else "-"
            lines.append((row["bench"], case, row["impl"], key or "-", value, row.get("device", "")))
        widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
        text = []
        for index, line in enumerate(lines):
            cells = [
                str(c).rjust(w) if i == 4 else str(c).ljust(w)
                for i, (c, w) in enumerate(zip(line, widths, strict=True))
            ]
            text.append("  ".join(cells).rstrip())
            if index == 0:
                text.append("  ".join("-" * w for w in widths))
        return "\n".join(text)

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None


def section(title: str) -> None:
    print(f"\n== {title}", flush=True)


def finish(rep: Reporter, backend, started: float) -> None:
    """End a benchmark run: the summary table, the JSON file, and the Vulkan device released."""
    print(f"\n== summary ({time.perf_counter() - started:.1f} s)")
    print(rep.table())
    rep.close()
    if backend is not None:
        backend.close()

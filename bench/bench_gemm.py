"""GEMM and upload microbenchmarks: vkflow against PyTorch on the same GPU, in one run.

What is measured (letters follow the performance issue):

(c) fp32 GEMM C = A @ B, row-major, for 4096^3, 8192^3 and the odd shapes 4000^3 and
    256x1024x784 (M x N x K: the small MLP's first layer). vkflow: one program of n ``gemm``
    launches separated by barriers (as in a training step), recorded once with a timestamp pool;
    the time of one GEMM is the median difference of consecutive timestamps over several
    submissions (n is chosen so one submission takes about ``target`` seconds of GPU time). Each
    tile configuration is first checked against numpy on an odd shape, then timed; every config
    gets a line and ``best`` marks the fastest per shape, which the ratio uses.
    torch: ``torch.matmul`` into a preallocated output, timed with CUDA events over n calls, TF32
    off, median of repetitions; fp16 and bf16 (cuBLAS tensor cores) for reference only.
    Tensor cores, where the device has cooperative matrices: ``vkflow_coopmat_f16`` is
    ``gemm_coopmat_f16`` on fp16 A and B (fp32 C), as cuBLAS fp16 gets them, for each config of
    COOPMAT_F16_CONFIGS (checked first on the odd shape against the float64 product of the same
    halves) and the registry's choice (``tuned``); ``best`` marks the fastest, which the ratio
    against torch fp16 uses. ``vkflow_coopmat`` (reference) is ``gemm_coopmat`` on the fp32 A and
    B, rounded to fp16 as they enter shared memory, with the registry's tiles.
(d) Host-to-device uploads of one io tensor, once with the GPU idle and once while GEMM submissions
    keep it busy. vkflow ``upload`` (the figure compared with torch): ``backend.upload``, a DMA
    copy on the transfer queue (a transfer-only family where the device has one) from pinned
    host staging memory that ``staging_view`` exposes, filled once outside the timing; the copies
    are queued back to back and each is timed by timestamps on the transfer queue (median), or by
    host clocks around all of them where that queue has no timestamps (``timing`` says which;
    ``wall_gb_per_s`` is always the host-clock rate of the whole batch, submits included).
    vkflow ``write`` (reference): ``backend.write``, the CPU copying into mapped device memory
    from 4 threads, host clocks per call. torch: pinned host tensor ``.to(device,
    non_blocking=True)`` on a side stream, timed with CUDA events per copy, idle and while
    matmuls run on the default stream.

All tile configurations keep (BM/TM)*(BN/TN) = 256 threads, because the backend always
specialises the op's registered local size (256) and gemm.comp requires local_size_x to equal
that product; configs that need a different workgroup size, or more shared memory than the
device has, are reported as skipped with the reason.

Output: one JSON line per figure on stdout (and appended to ``--out``), then a table. Run alone it
does (c) and (d); bench_mlp.py runs these too.
"""

from __future__ import annotations

import time
from collections import deque

import common
import numpy as np
from common import Reporter, median, open_vulkan, section

from shaders.tiles import GEMM_SPEC_DEFAULTS, gemm_shared_bytes

DEFAULT_TILES = {"BM": 64, "BN": 64, "BK": 16, "TM": 4, "TN": 4}
# Fixed configs timed beside the tuned choice (see sweep_gemm.py for the full search). Each sets
# every tuning constant: an override is merged over the tuned constants of the shape, so a config
# without SK would inherit the tuning table's sliced K (on the H100, at 256x1024x784 the fixed
# configs with the table's SK=4, up to 1024 threads a workgroup, did not finish in 45 s).
TILE_CONFIGS = tuple(
    {**GEMM_SPEC_DEFAULTS, **tiles}
    for tiles in (
        DEFAULT_TILES,
        {"BM": 64, "BN": 128, "BK": 16, "TM": 4, "TN": 8, "GM": 8},
        {"BM": 128, "BN": 128, "BK": 32, "TM": 8, "TN": 8, "GM": 8},
    )
)
QUICK_TILE_CONFIGS = TILE_CONFIGS[:2]
SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (4000, 4000, 4000), (256, 1024, 784))  # M, N, K
QUICK_SHAPES = ((256, 256, 256), (100, 128, 78))
CHECK_SHAPE = (67, 45, 33)  # odd in every dimension: exercises every bounds check of the tiles
# gemm_coopmat_f16 (A and B float16, as cuBLAS's fp16 GEMM gets them): the tile configs timed in
# (c), each checked first on CHECK_SHAPE. bench/sweep_coopmat.py sweeps many more.
COOPMAT_F16_CONFIGS = (
    {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 64},
    {"BM": 128, "BN": 256, "BK": 16, "WM": 64, "WN": 64, "PD": 2},
    {"BM": 256, "BN": 128, "BK": 16, "WM": 64, "WN": 64, "PD": 2},
    {"BM": 128, "BN": 256, "BK": 32, "WM": 64, "WN": 64, "NS": 1},
    {"BM": 64, "BN": 64, "BK": 64, "WM": 32, "WN": 32},
    {"BM": 32, "BN": 32, "BK": 64, "WM": 16, "WN": 16},
)
QUICK_COOPMAT_F16_CONFIGS = (COOPMAT_F16_CONFIGS[0], COOPMAT_F16_CONFIGS[-1])


def tile_name(tiles: dict[str, int]) -> str:
    if "tuned" in tiles:
        return "tuned"  # chosen per launch by the registry, as in a training step
    return f"{tiles['BM']}x{tiles['BN']}x{tiles['BK']}/{tiles['TM']}x{tiles['TN']}"


def shape_name(shape: tuple[int, int, int]) -> str:
    return "x".join(map(str, shape))


def tile_problem(backend, tiles: dict[str, int]) -> str | None:
    """Why ``tiles`` cannot run on this backend, or None when it can."""
    threads = (tiles["BM"] // tiles["TM"]) * (tiles["BN"] // tiles["TN"])
    if threads > backend.facts.max_workgroup_invocations:
        allowed = backend.facts.max_workgroup_invocations
        return f"needs {threads} threads per workgroup; the device allows {allowed}"
    shared = gemm_shared_bytes(tiles["BM"], tiles["BN"], tiles["BK"])
    if shared > backend.facts.shared_memory_bytes:
        return f"needs {shared} B of shared memory; the device has {backend.facts.shared_memory_bytes}"
    return None


# -- vkflow GEMM -------------------------------------------------------------------------------------


class VkGemm:
    """One GEMM shape laid out on a backend, with A and B filled with uniform(-1, 1) values.

    ``dtype`` is A's and B's ("float16" for gemm_coopmat_f16; bias and C stay float32); with
    ``trans_a`` (``trans_b``) A (B) is stored [K,M] ([N,K]) and every launch says so.
    """

    def __init__(
        self,
        backend,
        shape: tuple[int, int, int],
        seed: int = 0,
        dtype: str = "float32",
        trans_a: int = 0,
        trans_b: int = 0,
    ) -> None:
        from actors.single_op import single_op_layout

        self.backend = backend
        self.M, self.N, self.K = shape
        self.trans_a, self.trans_b = int(trans_a), int(trans_b)
        operand = np.dtype(dtype)
        a_shape = (self.K, self.M) if self.trans_a else (self.M, self.K)
        b_shape = (self.N, self.K) if self.trans_b else (self.K, self.N)
        arrays = {
            "A": np.empty(a_shape, operand),
            "B": np.empty(b_shape, operand),
            "bias": np.empty(self.N, np.float32),
            "C": np.empty((self.M, self.N), np.float32),
        }
        largest = max(a.nbytes for a in arrays.values())
        if largest > backend.facts.max_storage_buffer_range:
            raise ValueError(
                f"a {largest:,}-byte operand exceeds maxStorageBufferRange "
                f"({backend.facts.max_storage_buffer_range:,})"
            )
        backend.open_layout(single_op_layout(arrays))
        rng = np.random.default_rng(seed)
        self.a = rng.uniform(-1, 1, a_shape).astype(operand)
        self.b = rng.uniform(-1, 1, b_shape).astype(operand)
        backend.write("A", self.a)
        backend.write("B", self.b)
        backend.write("bias", np.zeros(self.N, np.float32))

    def program(self, launches: int, op: str = "gemm"):
        from flow.program import Barrier, Program, launch

        # Transposition flags only where set, so plain launches are exactly what they always were.
        flags = {k: v for k, v in (("trans_a", self.trans_a), ("trans_b", self.trans_b)) if v}
        one = launch(op, ("A", "B", "bias", "C"), M=self.M, N=self.N, K=self.K, **flags)
        steps = [one]
        for _ in range(launches - 1):
            steps += [Barrier(), one]
        return Program(name=f"gemm{shape_name((self.M, self.N, self.K))}x{launches}", steps=tuple(steps))

    def check(self, tiles: dict[str, int] | None, op: str = "gemm") -> float:
        """Max relative error of one launch against numpy (float64); None tiles: the tuned ones."""
        handle = self.backend.record(self.program(1, op), 0, spec_overrides={op: tiles} if tiles else None)
        self.backend.wait(self.backend.submit(handle))
        got = self.backend.read("C")
        want = self.op_a() @ self.op_b()
        return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))

    def op_a(self, rows: list[int] | None = None) -> np.ndarray:
        """op(A) in float64 (only ``rows`` of it, when given): the values the GPU was given."""
        a = self.a.T if self.trans_a else self.a
        return (a if rows is None else a[rows]).astype(np.float64)

    def op_b(self) -> np.ndarray:
        return (self.b.T if self.trans_b else self.b).astype(np.float64)

    def spot_error(self) -> float | None:
        """Max relative error of three rows of C (after a run) against numpy, read through the
        mapped view; None where C is not host-visible (reading all of a big C is too slow)."""
        view = self.backend.write_into("C")
        if view is None:
            return None
        rows = sorted({0, self.M // 2, self.M - 1})
        got = np.array(view[rows])
        want = self.op_a(rows) @ self.op_b()
        return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))

    def seconds_per_gemm(
        self, tiles: dict[str, int] | None, reps: int, target_s: float, max_launches: int, op: str = "gemm"
    ) -> tuple[float, int]:
        """(median GPU seconds of one GEMM launch, launches per submission), from timestamps.
        None tiles: the registry's per-launch tuning picks them, as in a training step."""

        def timed(launches: int, times: int) -> list[float]:
            pool = self.backend.timestamp_pool(launches + 1)
            overrides = {op: tiles} if tiles else None
            handle = self.backend.record(
                self.program(launches, op), 0, spec_overrides=overrides, timestamps=pool
            )
            diffs: list[float] = []
            for _ in range(times):
                self.backend.wait(self.backend.submit(handle))
                diffs.extend(np.diff(self.backend.read_timestamps_ns(pool)).tolist())
            return diffs

        probe = median(timed(2, 2)) * 1e-9  # also the warm-up
        launches = int(min(max_launches, max(3, round(target_s / max(probe, 1e-9)))))
        return median(timed(launches, reps)) * 1e-9, launches


# -- torch GEMM --------------------------------------------------------------------------------------


def torch_seconds_per_matmul(torch, shape: tuple[int, int, int], dtype, reps: int, target_s: float) -> float:
    """Median seconds of one ``torch.matmul(a, b, out=c)``: CUDA events on the GPU, host clock on CPU."""
    M, N, K = shape
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    a = (torch.rand(M, K, device=device, generator=generator) * 2 - 1).to(dtype)
    b = (torch.rand(K, N, device=device, generator=generator) * 2 - 1).to(dtype)
    c = torch.empty(M, N, device=device, dtype=dtype)

    def run(n: int) -> float:
        if not cuda:
            start = time.perf_counter()
            for _ in range(n):
                torch.matmul(a, b, out=c)
            return (time.perf_counter() - start) / n
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(n):
            torch.matmul(a, b, out=c)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) * 1e-3 / n

    run(3)  # warm-up: cuBLAS heuristics, workspace, clocks
    probe = run(3)
    n = int(min(1000, max(3, round(target_s / max(probe, 1e-9)))))
    return median([run(n) for _ in range(reps)])


def coopmat_f16_checked(args, rep: Reporter, backend) -> dict[str, tuple[dict[str, int], float]]:
    """The gemm_coopmat_f16 tile configs this device can run and that are right on CHECK_SHAPE
    (max relative error <= 1e-4 against the float64 product of the same halves): name -> (tiles,
    check error). Every other config gets a "skipped" line saying why."""
    from sweep_coopmat import config_name

    from shaders.tiles import coopmat_tile_problem

    bench, impl = "gemm", "vkflow_coopmat_f16"
    if backend is None or not backend.facts.has("cooperative_matrix"):
        return {}
    usable = {}
    for tiles in QUICK_COOPMAT_F16_CONFIGS if args.quick else COOPMAT_F16_CONFIGS:
        name = config_name(tiles)
        problem = coopmat_tile_problem({**tiles, "AH": 1, "BH": 1}, backend.facts)
        if problem is None:

            def check(tiles=tiles):
                return VkGemm(backend, CHECK_SHAPE, dtype="float16").check(tiles, "gemm_coopmat_f16")

            error = rep.guarded(bench, impl, check, shape=shape_name(CHECK_SHAPE), dtype="fp16", tiles=name)
            if error is None:
                continue
            if not error <= 1e-4:
                problem = f"wrong result on {shape_name(CHECK_SHAPE)}: max relative error {error:.2e}"
        if problem is not None:
            rep.missing(bench, impl, "skipped", problem, dtype="fp16", tiles=name)
            continue
        usable[name] = (tiles, error)
    return usable


def coopmat_f16_shape(
    args,
    rep: Reporter,
    backend,
    vk_device: str,
    shape: tuple[int, int, int],
    configs: dict[str, tuple[dict[str, int], float]],
    target_s: float,
) -> tuple[str, dict] | None:
    """Times gemm_coopmat_f16 at ``shape`` with each checked config and the registry's choice
    ("tuned"); one figure each, ``best`` marking the fastest. Returns (tiles, figure) of the best."""
    bench, impl, name = "gemm", "vkflow_coopmat_f16", shape_name(shape)
    if backend is None or not backend.facts.has("cooperative_matrix"):
        if backend is not None:
            rep.missing(bench, impl, "not available", "no cooperative matrices", shape=name, dtype="fp16")
        return None
    gemm = rep.guarded(bench, impl, lambda: VkGemm(backend, shape, dtype="float16"), shape=name, dtype="fp16")
    if gemm is None:
        return None
    flop = 2.0 * shape[0] * shape[1] * shape[2]
    found = []
    for label, (tiles, error) in [*configs.items(), ("tuned", (None, None))]:

        def one(tiles=tiles, error=error):
            seconds, launches = gemm.seconds_per_gemm(
                tiles, args.reps, target_s, 200 if args.quick else 500, "gemm_coopmat_f16"
            )
            if tiles is None and flop <= 2.0 * 4096**3:  # the tuned tiles on this shape, in full
                error = gemm.check(None, "gemm_coopmat_f16")
            return {
                "tflops": flop / seconds / 1e12,
                "us": seconds * 1e6,
                "launches": launches,
                "check_err": error,
                "spot_err": gemm.spot_error(),
            }

        result = rep.guarded(bench, impl, one, shape=name, dtype="fp16", tiles=label)
        if result is not None:
            found.append((label, result))
    best = max(found, key=lambda f: f[1]["tflops"]) if found else None
    for label, result in found:
        rep.figure(
            bench, impl, vk_device, shape=name, dtype="fp16", tiles=label, **result, best=result is best[1]
        )
    return best


def part_c(args, rep: Reporter, backend, vk_device: str, torch, torch_device: str) -> None:
    shapes = QUICK_SHAPES if args.quick else SHAPES
    configs = QUICK_TILE_CONFIGS if args.quick else TILE_CONFIGS
    target_s = 0.05 if args.quick else 0.25
    section(f"(c) GEMM fp32, shapes {', '.join(map(shape_name, shapes))} (M x N x K)")
    bench = "gemm"
    usable: list[dict[str, int]] = []
    check_error: dict[str, float] = {}
    if backend is None:
        rep.missing(bench, "vkflow_gemm", "not available", vk_device)
    else:
        for tiles in configs:
            problem = tile_problem(backend, tiles)
            if problem is None:

                def check(tiles=tiles):
                    return VkGemm(backend, CHECK_SHAPE).check(tiles)

                error = rep.guarded(
                    bench, "vkflow_gemm", check, shape=shape_name(CHECK_SHAPE), tiles=tile_name(tiles)
                )
                if error is not None and error > 1e-4:
                    problem = f"wrong result on {shape_name(CHECK_SHAPE)}: max relative error {error:.2e}"
                elif error is None:
                    continue
            if problem is not None:
                rep.missing(bench, "vkflow_gemm", "skipped", problem, tiles=tile_name(tiles))
                continue
            usable.append(tiles)
            check_error[tile_name(tiles)] = error
    coop16 = coopmat_f16_checked(args, rep, backend)
    for shape in shapes:
        name, flop = shape_name(shape), 2.0 * shape[0] * shape[1] * shape[2]
        found = []
        if usable:
            gemm = rep.guarded(bench, "vkflow_gemm", lambda shape=shape: VkGemm(backend, shape), shape=name)
            for tiles in usable if gemm is not None else ():

                def one(tiles=tiles, gemm=gemm, flop=flop):
                    seconds, launches = gemm.seconds_per_gemm(
                        tiles, args.reps, target_s, 200 if args.quick else 500
                    )
                    return {
                        "tflops": flop / seconds / 1e12,
                        "us": seconds * 1e6,
                        "launches": launches,
                        "check_err": check_error[tile_name(tiles)],
                        "spot_err": gemm.spot_error(),
                    }

                result = rep.guarded(
                    bench, "vkflow_gemm", one, shape=name, dtype="fp32", tiles=tile_name(tiles)
                )
                if result is not None:
                    found.append((tiles, result))
        coop = None
        if usable and gemm is not None:
            for op_name, dtype_name in (("gemm", "fp32"), ("gemm_coopmat", "fp16")):
                if op_name == "gemm_coopmat" and "cooperative_matrix" not in backend.facts.features:
                    rep.missing(
                        bench, "vkflow_coopmat", "not available", "no cooperative matrices", shape=name
                    )
                    continue
                impl = "vkflow_gemm" if op_name == "gemm" else "vkflow_coopmat"

                def tuned(gemm=gemm, flop=flop, op_name=op_name):
                    error = gemm.check(None, op_name)
                    seconds, launches = gemm.seconds_per_gemm(
                        None, args.reps, target_s, 200 if args.quick else 500, op_name
                    )
                    return {
                        "tflops": flop / seconds / 1e12,
                        "us": seconds * 1e6,
                        "launches": launches,
                        "check_err": error,
                    }

                result = rep.guarded(bench, impl, tuned, shape=name, dtype=dtype_name, tiles="tuned")
                if result is None:
                    continue
                if op_name == "gemm":
                    found.append(({"tuned": 1}, result))
                else:
                    coop = result
                    rep.figure(bench, impl, vk_device, shape=name, dtype=dtype_name, tiles="tuned", **result)
        best16 = coopmat_f16_shape(args, rep, backend, vk_device, shape, coop16, target_s)
        best = max(found, key=lambda f: f[1]["tflops"]) if found else None
        for tiles, result in found:
            rep.figure(
                bench,
                "vkflow_gemm",
                vk_device,
                shape=name,
                dtype="fp32",
                tiles=tile_name(tiles),
                **result,
                best=best is not None and result is best[1],
            )
        if torch is None:
            rep.missing(bench, "torch_matmul", "not available", "torch is not installed", shape=name)
            continue
        dtypes = [("fp32", torch.float32)]
        if torch.cuda.is_available():
            dtypes += [("fp16", torch.float16), ("bf16", torch.bfloat16)]
        impl = "torch_matmul" if torch.cuda.is_available() else "torch_cpu_matmul"
        fp32 = None
        torch_rates = {}
        for dtype_name, dtype in dtypes:

            def one(dtype=dtype, shape=shape, flop=flop):
                seconds = torch_seconds_per_matmul(torch, shape, dtype, args.reps, target_s)
                return {"tflops": flop / seconds / 1e12, "us": seconds * 1e6}

            result = rep.guarded(bench, impl, one, shape=name, dtype=dtype_name)
            if result is not None:
                rep.figure(bench, impl, torch_device, shape=name, dtype=dtype_name, **result)
                torch_rates[dtype_name] = result["tflops"]
                if dtype_name == "fp32":
                    fp32 = result["tflops"]
        if best is not None:
            rep.ratio(
                bench,
                f"vkflow_gemm/{impl}",
                best[1]["tflops"],
                fp32,
                shape=name,
                dtype="fp32",
                tiles=tile_name(best[0]),
            )
        if coop is not None:
            for dtype_name in ("fp16", "bf16"):
                if dtype_name in torch_rates:
                    rep.ratio(
                        bench,
                        f"vkflow_coopmat/{impl}_{dtype_name}",
                        coop["tflops"],
                        torch_rates[dtype_name],
                        shape=name,
                    )
        if best16 is not None and "fp16" in torch_rates:
            rep.ratio(
                bench,
                f"vkflow_coopmat_f16/{impl}_fp16",
                best16[1]["tflops"],
                torch_rates["fp16"],
                shape=name,
                tiles=best16[0],
            )
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# -- uploads -------------------------------------------------------------------------------------------


def vk_uploads(backend, nbytes: int, copies: int, compute_shape: tuple[int, int, int]) -> dict[str, dict]:
    """GB/s of host-to-device uploads into an io tensor: GPU idle, and with GEMMs keeping it busy.

    ``upload``: DMA on the transfer queue from pinned staging memory (``staging_view`` +
    ``upload``), the counterpart of torch's pinned ``.to(device, non_blocking=True)``. The staging
    view is filled once, outside the timing, as torch's pinned tensor is; the copies are queued
    back to back and each is timed by two timestamps on the transfer queue (median), or, where
    that queue has none, by host clocks around all of them. ``write``: ``backend.write``, the CPU
    copying into mapped device memory, host clocks per call (for reference).

    Returns:
        "<method>_<idle|busy>" -> the figure's fields (``gb_per_s`` and how it was timed).
    """
    from flow.program import Arena, Barrier, Layout, Program, Tensor, launch

    M, N, K = compute_shape
    sizes = {"A": M * K, "B": K * N, "bias": N, "C": M * N}
    tensors, offset = [], 0
    for name, count in sizes.items():
        tensors.append(Tensor(name, (count,), "float32", "work", offset))
        offset += (count * 4 + 255) // 256 * 256
    tensors.append(Tensor("upload", (nbytes // 4,), "float32", "io", 0))
    arenas = (Arena("work", offset), Arena("io", nbytes, per_slot=True, host_visible=True))
    backend.open_layout(Layout(arenas=arenas, tensors=tuple(tensors)), slots=1)
    one = launch("gemm", ("A", "B", "bias", "C"), M=M, N=N, K=K)
    busy_program = Program("busy", steps=(one, Barrier()) * 7 + (one,))
    # Two recordings, alternated: a command buffer must not be pending twice at once.
    computes = [backend.record(busy_program, 0) for _ in range(2)]
    src = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    in_flight: deque[int] = deque()
    submitted = 0

    def keep_busy() -> None:
        nonlocal submitted
        while in_flight and backend.is_done(in_flight[0]):
            in_flight.popleft()
        while len(in_flight) < 2:
            in_flight.append(backend.submit(computes[submitted % 2]))
            submitted += 1

    def drain() -> None:
        while in_flight:
            backend.wait(in_flight.popleft())

    results: dict[str, dict] = {}
    backend.staging_view("upload")[:] = src
    pool = backend.timestamp_pool(2 * copies) if backend.upload_timestamps else None

    def queue_uploads() -> list[int]:
        if pool is None:
            return [backend.upload("upload") for _ in range(copies)]
        return [backend.upload("upload", timestamps=pool, query=2 * i) for i in range(copies)]

    for warm_up in (True, False):  # the warm-up records every command buffer the timed passes replay
        for busy in (False, True):
            if pool is not None:
                backend.reset_timestamps(pool)  # before keep_busy: the fallback reset waits for compute
            if busy:
                keep_busy()
            start = time.perf_counter()
            tickets = queue_uploads()
            backend.wait(tickets[-1])
            wall = time.perf_counter() - start
            overlapped = busy and not backend.is_done(in_flight[-1])
            drain()
            if warm_up:
                break
            total = nbytes * copies / wall / 1e9
            rate, timing = total, "host clock"
            if pool is not None:
                stamps = backend.read_timestamps_ns(pool)
                seconds = median((stamps[1::2] - stamps[0::2]).tolist()) * 1e-9
                rate, timing = nbytes / seconds / 1e9, "transfer-queue timestamps"
            results[f"upload_{'busy' if busy else 'idle'}"] = {
                "gb_per_s": rate,
                "timing": timing,
                "wall_gb_per_s": total,
                "queue": backend.upload_queue_name,
                **({"overlapped": overlapped} if busy else {}),
            }
    np.testing.assert_array_equal(backend.read("upload"), src)  # the copies landed

    def write() -> None:
        backend.write("upload", src)

    write()  # warm-up: first touch of the mapping
    for busy in (False, True):
        times, overlapped_copies = [], 0
        for _ in range(copies):
            if busy:
                keep_busy()
            start = time.perf_counter()
            write()
            times.append(time.perf_counter() - start)
            overlapped_copies += busy and not backend.is_done(in_flight[-1])
        drain()
        results[f"write_{'busy' if busy else 'idle'}"] = {
            "gb_per_s": nbytes / median(times) / 1e9,
            "timing": "host clock",
            **({"overlapped": overlapped_copies / copies} if busy else {}),
        }
    return results


def torch_uploads(torch, nbytes: int, copies: int, compute_n: int) -> dict[str, tuple]:
    """GB/s of pinned ``.to(device, non_blocking=True)`` on a side stream: idle and under matmuls.

    Returns:
        "idle" | "busy" -> (GB/s, for busy: whether every copy ran between the matmuls' start and end).
    """
    src = torch.randn(nbytes // 4).pin_memory()
    stream = torch.cuda.Stream()
    a = torch.randn(compute_n, compute_n, device="cuda")
    results = {}
    for busy in (False, True):
        torch.cuda.synchronize()
        compute = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        if busy:
            compute[0].record()
            for _ in range(64):
                torch.matmul(a, a)
            compute[1].record()
        events = []
        with torch.cuda.stream(stream):
            src.to("cuda", non_blocking=True)  # warm-up
            for _ in range(copies):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record(stream)
                src.to("cuda", non_blocking=True)
                end.record(stream)
                events.append((begin, end))
        torch.cuda.synchronize()
        times = [b.elapsed_time(e) * 1e-3 for b, e in events]
        overlapped = None
        if busy:
            overlapped = (
                compute[0].elapsed_time(events[0][0]) >= 0 and events[-1][1].elapsed_time(compute[1]) >= 0
            )
        results["busy" if busy else "idle"] = (nbytes / median(times) / 1e9, overlapped)
    return results


def part_d(args, rep: Reporter, backend, vk_device: str, torch, torch_device: str) -> None:
    nbytes = (4 if args.quick else 64) * 2**20
    copies = 10 if args.quick else 30
    section(f"(d) host -> device uploads of {nbytes >> 20} MiB, GPU idle and busy")
    bench = "upload"
    vk_upload = {}
    if backend is None:
        rep.missing(bench, "vkflow", "not available", vk_device)
    else:
        compute_shape = (256, 256, 256) if args.quick else (4096, 4096, 4096)
        results = rep.guarded(bench, "vkflow", lambda: vk_uploads(backend, nbytes, copies, compute_shape))
        for key, fields in (results or {}).items():
            method, mode = key.rsplit("_", 1)
            rep.figure(bench, f"vkflow_{method}", vk_device, mode=mode, bytes=nbytes, **fields)
            if method == "upload":
                vk_upload[mode] = fields["gb_per_s"]
    if torch is None or not torch.cuda.is_available():
        why = "torch is not installed" if torch is None else "no CUDA: host to device copies need a GPU"
        rep.missing(bench, "torch_pinned_to", "not available", why)
        return
    results = rep.guarded(bench, "torch_pinned_to", lambda: torch_uploads(torch, nbytes, copies, 4096))
    for mode, (rate, overlapped) in (results or {}).items():
        rep.figure(
            bench,
            "torch_pinned_to",
            torch_device,
            mode=mode,
            bytes=nbytes,
            gb_per_s=rate,
            **({"overlapped": overlapped} if overlapped is not None else {}),
        )
        rep.ratio(bench, "vkflow_upload/torch_pinned_to", vk_upload.get(mode), rate, mode=mode)


def run_parts(args, rep: Reporter, backend, vk_device: str, torch, torch_device: str) -> None:
    """Run parts (c) and (d) as selected in ``args.parts`` (bench_mlp.py calls this too)."""
    if "c" in args.parts:
        part_c(args, rep, backend, vk_device, torch, torch_device)
    if "d" in args.parts:
        part_d(args, rep, backend, vk_device, torch, torch_device)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], "cd")
    skipped = args.parts - {"c", "d"}
    if skipped:
        print(f"parts {','.join(sorted(skipped))} are in bench_mlp.py; this script runs c and d")
    rep = Reporter(args.out)
    torch, torch_device = common.open_torch()
    backend, why = open_vulkan(args.device)
    vk_device = backend.facts.name if backend is not None else f"no Vulkan: {why}"
    print(f"vkflow on {vk_device}")
    started = time.perf_counter()
    try:
        run_parts(args, rep, backend, vk_device, torch, torch_device)
    finally:
        common.finish(rep, backend, started)


if __name__ == "__main__":
    main()

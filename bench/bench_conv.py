"""Convolution microbenchmarks: vkflow's implicit-GEMM convolutions against PyTorch (cuDNN) on the
same GPU, in one run.

What is measured: the two convolutions of the Fashion-MNIST CNN at batch 256 (1x28x28 -> 32 and
32x14x14 -> 64, 3x3, stride 1, padding 1), each in three directions: ``forward`` (Y = relu(conv(X,
W) + b), the fused epilogue as in training), ``data`` (dX from dY) and ``weight`` (dW from X and
dY). FLOPs: 2 x N x K x OH x OW x C x R x S for each direction.

vkflow ``vkflow_gemm``: the ops flow.autodiff lowers Conv2d to (conv2d_gemm,
conv2d_gemm_backward_data, and conv2d_gemm_backward_weight split over its positions as autodiff
splits it, then conv_splitk_sum), with the registry's tiles. One program repeats the convolution
with barriers between launches (as in a training step), recorded once with a timestamp pool; one
convolution's time is the median over repetitions of the sum of its launches' timestamp
differences. Each op is first checked against the float64 CPU oracle on the same layer at batch 2.
``vkflow_direct`` (reference): the direct kernels (conv2d, conv2d_backward_data,
conv2d_backward_weight) the implicit GEMMs replace. ``vkflow_coopmat`` (devices with cooperative
matrices): the tensor-core variants mixed precision lowers Conv2d to (conv2d_gemm_coopmat*,
operands rounded to float16, fp32 sums; checked to 1e-2), against the same fp32 torch figures.
The wide CNN's three layers (bench_wide_cnn.py: 3-64-128-256 channels on 32x32) follow.
torch: ``torch.nn.functional.conv2d`` (+ bias, relu) for forward and
``torch.ops.aten.convolution_backward`` with one output selected for data and weight (what
autograd runs), fp32 with TF32 off (bench/common.py), CUDA events over n calls, median of
repetitions; host clocks on a CPU-only torch. Without torch or without Vulkan, the other side's
figures are still taken and the missing one is reported.

``--quick``: batch 4 and narrower layers, a smoke run for lavapipe.
"""

from __future__ import annotations

import time

import common
import numpy as np
from common import Reporter, median, open_vulkan, section

# (name, C, H, W, K): 3x3, stride 1, padding 1.
LAYERS = (
    ("conv1", 1, 28, 28, 32),
    ("conv2", 32, 14, 14, 64),
    ("wide1", 3, 32, 32, 64),
    ("wide2", 64, 16, 16, 128),
    ("wide3", 128, 8, 8, 256),
)
QUICK_LAYERS = (("conv1", 1, 12, 12, 8), ("conv2", 8, 6, 6, 16))
BATCH, QUICK_BATCH, CHECK_BATCH = 256, 4, 2
DIRECTIONS = ("forward", "data", "weight")
KERNEL, STRIDE, PAD = 3, 1, 1
RELU = 1  # ACTIVATIONS["relu"]


def conv_params(batch: int, c: int, h: int, w: int, k: int) -> dict[str, int]:
    oh = (h + 2 * PAD - KERNEL) // STRIDE + 1
    ow = (w + 2 * PAD - KERNEL) // STRIDE + 1
    return dict(N=batch, C=c, H=h, W=w, K=k, R=KERNEL, S=KERNEL, stride=STRIDE, pad=PAD, OH=oh, OW=ow)


def flops(p: dict[str, int]) -> float:
    return 2.0 * p["N"] * p["K"] * p["OH"] * p["OW"] * p["C"] * p["R"] * p["S"]


# -- vkflow ------------------------------------------------------------------------------------------


class VkConv:
    """One convolution layer laid out on a backend: X, Wt, bias, Y (also dY), dX, dW and the
    split-K workspace, filled with uniform(-1, 1) values."""

    def __init__(self, backend, p: dict[str, int], seed: int = 0) -> None:
        from actors.single_op import single_op_layout
        from flow.autodiff import conv_weight_splits
        from shaders.tiles import conv_gemm_shape

        self.backend, self.p = backend, p
        n, c, h, w, k = p["N"], p["C"], p["H"], p["W"], p["K"]
        self.wm, self.wn, wk = conv_gemm_shape("weight", p)
        self.splits = conv_weight_splits(self.wm, self.wn, wk)
        rng = np.random.default_rng(seed)
        self.host = {
            "X": rng.uniform(-1, 1, (n, c, h, w)).astype(np.float32),
            "Wt": rng.uniform(-1, 1, (k, c, p["R"], p["S"])).astype(np.float32),
            "bias": rng.uniform(-1, 1, k).astype(np.float32),
            "Y": rng.uniform(-1, 1, (n, k, p["OH"], p["OW"])).astype(np.float32),
            "dX": np.zeros((n, c, h, w), np.float32),
            "dW": np.zeros((k, c, p["R"], p["S"]), np.float32),
            "WS": np.zeros((self.splits, self.wm, self.wn), np.float32),
        }
        backend.open_layout(single_op_layout(self.host))
        for name in ("X", "Wt", "bias", "Y"):
            backend.write(name, self.host[name])

    def launches(self, direction: str, impl: str) -> list:
        """The launches of one convolution in ``direction`` (barriers go between them)."""
        from flow.program import launch
        from shaders.conv_coopmat_tiles import COOPMAT_CONV_OPS

        p = self.p
        if impl == "vkflow_coopmat":
            op = COOPMAT_CONV_OPS[direction]
            if direction == "forward":
                return [launch(op, ("X", "Wt", "bias", "Y"), **p, has_bias=1, act=RELU)]
            if direction == "data":
                return [launch(op, ("Y", "Wt", "dX"), **p)]
            if self.splits == 1:
                return [launch(op, ("X", "Y", "dW"), **p)]
            return [
                launch(op, ("X", "Y", "WS"), **p, k_splits=self.splits),
                launch("conv_splitk_sum", ("WS", "dW"), total=self.wm * self.wn, splits=self.splits),
            ]
        if direction == "forward":
            op = "conv2d_gemm" if impl == "vkflow_gemm" else "conv2d"
            return [launch(op, ("X", "Wt", "bias", "Y"), **p, has_bias=1, act=RELU)]
        if direction == "data":
            op = "conv2d_gemm_backward_data" if impl == "vkflow_gemm" else "conv2d_backward_data"
            return [launch(op, ("Y", "Wt", "dX"), **p)]
        if impl == "vkflow_direct":
            return [launch("conv2d_backward_weight", ("X", "Y", "dW"), **p)]
        if self.splits == 1:
            return [launch("conv2d_gemm_backward_weight", ("X", "Y", "dW"), **p)]
        return [
            launch("conv2d_gemm_backward_weight", ("X", "Y", "WS"), **p, k_splits=self.splits),
            launch("conv_splitk_sum", ("WS", "dW"), total=self.wm * self.wn, splits=self.splits),
        ]

    def program(self, direction: str, impl: str, repeats: int):
        from flow.program import Barrier, Program

        steps: list = []
        for _ in range(repeats):
            for one in self.launches(direction, impl):
                steps += [Barrier(), one] if steps else [one]
        return Program(name=f"conv_{direction}_{impl}_x{repeats}", steps=tuple(steps))

    def output(self, direction: str) -> str:
        return {"forward": "Y", "data": "dX", "weight": "dW"}[direction]

    def check(self, direction: str, impl: str) -> float:
        """Max relative error of one convolution against the float64 CPU oracle (actors.cpu_ops)."""
        from actors import cpu_ops

        # The forward overwrites Y, which the backward directions read as dY: restore it first.
        for name in ("X", "Wt", "bias", "Y"):
            self.backend.write(name, self.host[name])
        self.backend.wait(self.backend.submit(self.backend.record(self.program(direction, impl, 1))))
        got = self.backend.read(self.output(direction))
        wide = {name: array.astype(np.float64).ravel() for name, array in self.host.items()}
        if direction == "forward":
            wide["Y"] = np.zeros_like(wide["Y"])
            cpu_ops.conv2d(
                [wide["X"], wide["Wt"], wide["bias"], wide["Y"]], {**self.p, "has_bias": 1, "act": RELU}
            )
            want = wide["Y"]
        elif direction == "data":
            cpu_ops.conv2d_backward_data([wide["Y"], wide["Wt"], wide["dX"]], self.p)
            want = wide["dX"]
        else:
            cpu_ops.conv2d_backward_weight([wide["X"], wide["Y"], wide["dW"]], self.p)
            want = wide["dW"]
        got = got.astype(np.float64).ravel()[: want.size]
        return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))

    def seconds(
        self, direction: str, impl: str, reps: int, target_s: float, max_repeats: int
    ) -> tuple[float, int]:
        """(median GPU seconds of one convolution, convolutions per submission), from timestamps."""
        per = len(self.launches(direction, impl))

        def timed(repeats: int, times: int) -> list[float]:
            pool = self.backend.timestamp_pool(repeats * per + 1)
            handle = self.backend.record(self.program(direction, impl, repeats), 0, timestamps=pool)
            sums: list[float] = []
            for _ in range(times):
                self.backend.wait(self.backend.submit(handle))
                diffs = np.diff(self.backend.read_timestamps_ns(pool))
                sums.extend(diffs.reshape(repeats, per).sum(axis=1).tolist())
            return sums

        probe = median(timed(2, 1)) * 1e-9  # also the warm-up
        repeats = int(min(max_repeats, max(3, round(target_s / max(probe, 1e-9)))))
        return median(timed(repeats, reps)) * 1e-9, repeats


# -- torch ---------------------------------------------------------------------------------------------


def torch_seconds(torch, p: dict[str, int], direction: str, reps: int, target_s: float) -> float:
    """Median seconds of one torch convolution in ``direction``: CUDA events, or host clocks on CPU."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)

    def uniform(*shape):
        return torch.rand(*shape, device=device, generator=generator) * 2 - 1

    x = uniform(p["N"], p["C"], p["H"], p["W"])
    w = uniform(p["K"], p["C"], p["R"], p["S"])
    b = uniform(p["K"])
    dy = uniform(p["N"], p["K"], p["OH"], p["OW"])
    functional = torch.nn.functional
    stride, pad = [p["stride"]] * 2, [p["pad"]] * 2
    mask = [direction == "data", direction == "weight", False]

    def once():
        if direction == "forward":
            functional.relu(functional.conv2d(x, w, b, stride=stride, padding=pad), inplace=True)
        else:
            torch.ops.aten.convolution_backward(dy, x, w, None, stride, pad, [1, 1], False, [0, 0], 1, mask)

    def run(n: int) -> float:
        if not cuda:
            start = time.perf_counter()
            for _ in range(n):
                once()
            return (time.perf_counter() - start) / n
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(n):
            once()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) * 1e-3 / n

    run(3)  # warm-up: cuDNN's algorithm choice, workspace, clocks
    probe = run(3)
    n = int(min(1000, max(3, round(target_s / max(probe, 1e-9)))))
    return median([run(n) for _ in range(reps)])


# -- the run --------------------------------------------------------------------------------------------


def vk_checked(rep: Reporter, backend, vk_device: str, name: str, p: dict[str, int], check: dict[str, int]):
    """(the layer laid out at full size, {(impl, direction): check error}) for the ops that are right
    at batch CHECK_BATCH; (None, {}) without Vulkan."""
    bench = "conv"
    if backend is None:
        rep.missing(bench, "vkflow_gemm", "not available", vk_device, shape=name)
        return None, {}
    small = rep.guarded(bench, "vkflow_gemm", lambda: VkConv(backend, check), shape=name)
    errors: dict[tuple[str, str], float] = {}
    for impl in vk_impls(backend):
        tolerance = 1e-2 if impl == "vkflow_coopmat" else 1e-4  # float16 operands
        for direction in DIRECTIONS if small is not None else ():
            error = rep.guarded(
                bench, impl, lambda d=direction, i=impl: small.check(d, i), shape=name, mode=direction
            )
            if error is not None and not error <= tolerance:
                reason = f"wrong result at batch {CHECK_BATCH}: {error:.2e}"
                rep.missing(bench, impl, "error", reason, shape=name, mode=direction)
            elif error is not None:
                errors[impl, direction] = error
    if not errors:
        return None, {}
    return rep.guarded(bench, "vkflow_gemm", lambda: VkConv(backend, p), shape=name), errors


def vk_impls(backend) -> tuple[str, ...]:
    """The vkflow kernels timed on this device (the tensor-core ones only where it has them)."""
    coopmat = backend.facts.has("cooperative_matrix")
    return ("vkflow_gemm", "vkflow_direct") + (("vkflow_coopmat",) if coopmat else ())


def run_layer(args, rep: Reporter, backend, vk_device: str, torch, torch_device: str, layer: tuple) -> None:
    """Every figure of one layer: vkflow (implicit GEMM and direct) and torch, per direction."""
    name, c, h, w, k = layer
    bench = "conv"
    p = conv_params(QUICK_BATCH if args.quick else BATCH, c, h, w, k)
    flop = flops(p)
    target_s = 0.05 if args.quick else 0.25
    max_repeats = 50 if args.quick else 500
    torch_impl = "torch_conv" if torch is not None and torch.cuda.is_available() else "torch_cpu_conv"
    conv, errors = vk_checked(rep, backend, vk_device, name, p, conv_params(CHECK_BATCH, c, h, w, k))
    for direction in DIRECTIONS:
        vk_rates: dict[str, float] = {}
        for impl in vk_impls(backend) if backend is not None else ():
            if conv is None or (impl, direction) not in errors:
                continue

            def one(direction=direction, impl=impl):
                seconds, repeats = conv.seconds(direction, impl, args.reps, target_s, max_repeats)
                return {"tflops": flop / seconds / 1e12, "us": seconds * 1e6, "repeats": repeats}

            result = rep.guarded(bench, impl, one, shape=name, mode=direction)
            if result is None:
                continue
            extra = {"splits": conv.splits} if direction == "weight" and impl != "vkflow_direct" else {}
            dtype = "fp16_fp32acc" if impl == "vkflow_coopmat" else "fp32"
            rep.figure(bench, impl, vk_device, shape=name, dtype=dtype, mode=direction, **result,
                       check_err=errors[impl, direction], **extra)  # fmt: skip
            vk_rates[impl] = result["tflops"]
        if torch is None:
            rep.missing(
                bench, "torch_conv", "not available", "torch is not installed", shape=name, mode=direction
            )
            continue

        def theirs(direction=direction):
            seconds = torch_seconds(torch, p, direction, args.reps, target_s)
            return {"tflops": flop / seconds / 1e12, "us": seconds * 1e6}

        result = rep.guarded(bench, torch_impl, theirs, shape=name, mode=direction)
        if result is None:
            continue
        rep.figure(bench, torch_impl, torch_device, shape=name, dtype="fp32", mode=direction, **result)
        for impl, rate in vk_rates.items():
            rep.ratio(bench, f"{impl}/{torch_impl}", rate, result["tflops"], shape=name, mode=direction)
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_conv(args, rep: Reporter, backend, vk_device: str, torch, torch_device: str) -> None:
    layers = QUICK_LAYERS if args.quick else LAYERS
    batch = QUICK_BATCH if args.quick else BATCH
    section(f"conv fp32, batch {batch}: " + ", ".join(f"{n} {c}x{h}x{w}->{k}" for n, c, h, w, k in layers))
    for layer in layers:
        run_layer(args, rep, backend, vk_device, torch, torch_device, layer)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], "c")
    rep = Reporter(args.out)
    torch, torch_device = common.open_torch()
    backend, why = open_vulkan(args.device)
    vk_device = backend.facts.name if backend is not None else f"no Vulkan: {why}"
    print(f"vkflow on {vk_device}")
    started = time.perf_counter()
    try:
        run_conv(args, rep, backend, vk_device, torch, torch_device)
    finally:
        common.finish(rep, backend, started)


if __name__ == "__main__":
    main()

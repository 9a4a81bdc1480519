"""Average pooling, global average pooling and batch normalisation ops, forward and backward, on
every backend.

Each op runs through ``run_op`` on the CPU and Vulkan backends and is compared with an oracle
written here in float64 numpy from the textbook formulas (explicit loops over windows; batch
statistics with np.mean and np.var), deliberately not cpu_ops, and with torch where it is
installed. Inputs are fresh standard-normal draws seeded from the test id, with odd sizes (7 x 5
planes, 3 and 5 channels), strides that differ from the kernel and padding. The batch
normalisation cases also run with fewer real rows than the batch holds (``stepvals[4]``), whose
padding rows must take no part.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_error

from actors.single_op import run_op
from shaders.registry import REDUCE

try:
    import torch
except ImportError:  # torch is an optional second oracle
    torch = None

# fp32 against a float64 oracle: sums of at most a few thousand terms.
TOL = 1e-5


def normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def as64(array: np.ndarray) -> np.ndarray:
    return np.asarray(array, dtype=np.float64)


def t64(array: np.ndarray):
    return torch.from_numpy(as64(array))


# ---------------------------------------------------------------------------------------------
# Average pooling


def pool_size(size: int, kernel: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - kernel) // stride + 1


def avgpool_oracle(x: np.ndarray, kernel: int, stride: int, pad: int) -> np.ndarray:
    """Window means by explicit loops; padding counts as zeros and every window divides by k^2."""
    n, c, h, w = x.shape
    oh, ow = pool_size(h, kernel, stride, pad), pool_size(w, kernel, stride, pad)
    y = np.zeros((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            for r in range(kernel):
                for s in range(kernel):
                    row, col = i * stride - pad + r, j * stride - pad + s
                    if 0 <= row < h and 0 <= col < w:
                        y[:, :, i, j] += x[:, :, row, col]
    return y / (kernel * kernel)


def avgpool_backward_oracle(dy: np.ndarray, shape: tuple[int, ...], kernel: int, stride: int, pad: int):
    """Each output's gradient shared equally by the k^2 pixels of its window (padding's share lost)."""
    dx = np.zeros(shape)
    _, _, h, w = shape
    for i in range(dy.shape[2]):
        for j in range(dy.shape[3]):
            for r in range(kernel):
                for s in range(kernel):
                    row, col = i * stride - pad + r, j * stride - pad + s
                    if 0 <= row < h and 0 <= col < w:
                        dx[:, :, row, col] += dy[:, :, i, j] / (kernel * kernel)
    return dx


def pool_params(n, c, h, w, kernel, stride, pad):
    return dict(
        N=n,
        C=c,
        H=h,
        W=w,
        OH=pool_size(h, kernel, stride, pad),
        OW=pool_size(w, kernel, stride, pad),
        kernel=kernel,
        stride=stride,
        pad=pad,
    )


# (N, C, H, W, kernel, stride, pad): stride < kernel overlaps windows, stride > kernel skips
# pixels, padding puts windows over the border.
AVG_CASES = [
    (1, 1, 4, 4, 2, 2, 0),
    (2, 3, 7, 5, 2, 2, 0),
    (2, 5, 7, 5, 3, 2, 1),
    (3, 3, 7, 5, 3, 1, 1),
    (1, 5, 9, 7, 2, 3, 1),
    (2, 3, 7, 5, 5, 2, 2),
    (2, 1, 1, 1, 1, 1, 0),
]


@pytest.mark.parametrize("n,c,h,w,kernel,stride,pad", AVG_CASES)
def test_avgpool2d_forward_and_backward(backend, rng, n, c, h, w, kernel, stride, pad):
    x = normal(rng, n, c, h, w)
    params = pool_params(n, c, h, w, kernel, stride, pad)
    out_shape = (n, c, params["OH"], params["OW"])
    y = run_op(backend, "avgpool2d", {"X": x, "Y": np.zeros(out_shape, np.float32)}, **params)["Y"]
    assert relative_error(y, avgpool_oracle(as64(x), kernel, stride, pad)) <= TOL

    dy = normal(rng, *out_shape)
    dx = run_op(backend, "avgpool2d_backward", {"dY": dy, "dX": np.zeros(x.shape, np.float32)}, **params)[
        "dX"
    ]
    assert relative_error(dx, avgpool_backward_oracle(as64(dy), x.shape, kernel, stride, pad)) <= TOL
    # Adjoint identity with the forward oracle: <avgpool(x), dY> = <x, dX>.
    lhs = np.sum(avgpool_oracle(as64(x), kernel, stride, pad) * as64(dy))
    rhs = np.sum(as64(x) * as64(dx))
    assert abs(lhs - rhs) <= TOL * np.linalg.norm(as64(x)) * np.linalg.norm(as64(dx)) + 1e-9

    if torch is not None:
        tx = t64(x).requires_grad_()
        ty = torch.nn.functional.avg_pool2d(tx, kernel, stride, pad, count_include_pad=True)
        ty.backward(t64(dy))
        assert relative_error(y, ty.detach().numpy()) <= TOL
        assert relative_error(dx, tx.grad.numpy()) <= TOL


# ---------------------------------------------------------------------------------------------
# Global average pooling: a row mean (reduce) forward, broadcast_rows backward


@pytest.mark.parametrize("n,c,h,w", [(1, 1, 1, 1), (2, 3, 7, 5), (3, 5, 5, 7), (2, 3, 17, 19)])
def test_global_avgpool_forward_and_backward(backend, rng, n, c, h, w):
    x = normal(rng, n, c, h, w)
    bindings = {"X": x, "Y": np.zeros((n, c), np.float32)}
    mean = REDUCE["mean"]
    y = run_op(backend, "reduce", bindings, rows=n * c, cols=h * w, axis=1, fn=mean, alpha=1.0)["Y"]
    expected = np.array([[as64(x[a, b]).sum() / (h * w) for b in range(c)] for a in range(n)])
    assert relative_error(y, expected) <= TOL

    dy = normal(rng, n, c)
    bindings = {"X": dy, "Y": np.zeros((n, c, h, w), np.float32)}
    dx = run_op(backend, "broadcast_rows", bindings, rows=n * c, cols=h * w, alpha=1.0 / (h * w))["Y"]
    expected_dx = np.empty((n, c, h, w))
    for a in range(n):
        for b in range(c):
            expected_dx[a, b] = dy[a, b] / (h * w)
    assert relative_error(dx, expected_dx) <= TOL

    if torch is not None:
        tx = t64(x).requires_grad_()
        ty = torch.nn.functional.adaptive_avg_pool2d(tx, 1).flatten(1)
        ty.backward(t64(dy))
        assert relative_error(y, ty.detach().numpy()) <= TOL
        assert relative_error(dx, tx.grad.numpy()) <= TOL


def test_broadcast_rows_wider_than_the_workgroup_cap(backend, rng):
    """More elements than the capped workgroups cover in one pass: the grid-stride loop reaches all."""
    rows, cols = 3, 6_000_000
    x = normal(rng, rows)
    y = run_op(backend, "broadcast_rows", {"X": x, "Y": np.zeros(rows * cols, np.float32)}, rows=rows,
               cols=cols, alpha=0.5)["Y"]  # fmt: skip
    np.testing.assert_array_equal(y.reshape(rows, cols), np.repeat(x[:, None] * 0.5, cols, axis=1))


# ---------------------------------------------------------------------------------------------
# Batch normalisation


def batch_norm_oracle(x, gamma, beta, dy, real: int, eps: float):
    """Training-mode batch normalisation of x [N, C, HW] over its first ``real`` rows, in float64:
    the output, the input gradient by the textbook formula (0 on padding rows), dgamma, dbeta, the
    batch mean and the biased and unbiased variances."""
    x, dy = as64(x)[:real], as64(dy)[:real]
    mean = x.mean(axis=(0, 2))
    var = x.var(axis=(0, 2))
    m = x.shape[0] * x.shape[2]
    unbiased = x.var(axis=(0, 2), ddof=1) if m > 1 else var
    invstd = 1.0 / np.sqrt(var + eps)
    xhat = (x - mean[None, :, None]) * invstd[None, :, None]
    y = as64(gamma)[None, :, None] * xhat + as64(beta)[None, :, None]
    dbeta = dy.sum(axis=(0, 2))
    dgamma = (dy * xhat).sum(axis=(0, 2))
    dxhat = dy * as64(gamma)[None, :, None]
    dx = (invstd[None, :, None] / m) * (
        m * dxhat
        - dxhat.sum(axis=(0, 2))[None, :, None]
        - xhat * (dxhat * xhat).sum(axis=(0, 2))[None, :, None]
    )
    return y, dx, dgamma, dbeta, mean, var, unbiased


def run_batch_norm(backend, x, gamma, beta, dy, running_mean, running_var, real, momentum, eps, training=1):
    """The batch normalisation ops in the order a train program runs them, each through run_op."""
    n, c, hw = x.shape
    dims = dict(N=n, C=c, HW=hw)
    stepvals = np.array([0.0, 1.0, 1.0, 1.0, real, real], np.float32)
    stats = run_op(
        backend,
        "batchnorm_stats",
        {"X": x, "running_mean": running_mean, "running_var": running_var,
         "stats": np.zeros((4, c), np.float32), "stepvals": stepvals},
        **dims, training=training, momentum=momentum, eps=eps,
    )  # fmt: skip
    y = run_op(
        backend,
        "batchnorm",
        {"X": x, "stats": stats["stats"], "gamma": gamma, "beta": beta, "Y": np.zeros_like(x)},
        **dims,
    )["Y"]
    if not training:
        return stats, y, None
    reduced = run_op(
        backend,
        "batchnorm_backward_reduce",
        {"dY": dy, "X": x, "stats": stats["stats"], "dgamma": np.zeros(c, np.float32),
         "dbeta": np.zeros(c, np.float32), "stepvals": stepvals},
        **dims,
    )  # fmt: skip
    dx = run_op(
        backend,
        "batchnorm_backward_data",
        {"dY": dy, "X": x, "stats": reduced["stats"], "gamma": gamma, "stepvals": stepvals,
         "dX": np.full_like(x, np.nan)},
        **dims,
    )["dX"]  # fmt: skip
    return stats, y, {**reduced, "dX": dx}


# (N, C, HW, real rows): HW 1 is BatchNorm1d; N * HW past the 256 threads of a workgroup makes
# each thread add several values; fewer real rows than N leave padding rows.
NORM_CASES = [
    (3, 1, 1, 3),
    (7, 3, 1, 7),
    (7, 5, 35, 7),
    (9, 3, 35, 4),
    (37, 5, 35, 37),
    (5, 3, 12, 1),
    (300, 4, 1, 299),
]


@pytest.mark.parametrize("n,c,hw,real", NORM_CASES)
def test_batch_norm_training_forward_backward_and_running_statistics(backend, rng, n, c, hw, real):
    momentum, eps = 0.1, 1e-5
    # Offset and scaled inputs: a variance far from 1 and a mean far from 0 must be measured, not assumed.
    x = (normal(rng, n, c, hw) * 3.0 + 2.0).astype(np.float32)
    x[real:] = 1e4  # padding rows: anything there must change nothing
    gamma, beta, dy = normal(rng, c), normal(rng, c), normal(rng, n, c, hw)
    dy[real:] = 0.0  # as the loss leaves the padding rows' gradient
    running_mean, running_var = normal(rng, c), np.abs(normal(rng, c)) + 0.5
    stats, y, grads = run_batch_norm(
        backend, x, gamma, beta, dy, running_mean, running_var, real, momentum, eps
    )
    y_ref, dx_ref, dgamma_ref, dbeta_ref, mean, var, unbiased = batch_norm_oracle(
        x, gamma, beta, dy, real, eps
    )

    assert relative_error(y[:real], y_ref) <= TOL
    assert relative_error(stats["stats"][0], mean) <= TOL
    assert relative_error(stats["stats"][1], 1.0 / np.sqrt(var + eps)) <= TOL
    expected_mean = (1 - momentum) * as64(running_mean) + momentum * mean
    expected_var = (1 - momentum) * as64(running_var) + momentum * unbiased
    assert relative_error(stats["running_mean"], expected_mean) <= TOL
    assert relative_error(stats["running_var"], expected_var) <= TOL
    assert relative_error(grads["dgamma"], dgamma_ref) <= TOL
    assert relative_error(grads["dbeta"], dbeta_ref) <= TOL
    assert relative_error(grads["dX"][:real], dx_ref) <= 1e-4  # a difference of near-equal sums
    np.testing.assert_array_equal(grads["dX"][real:], 0.0)

    if torch is not None:
        tx = t64(x[:real]).requires_grad_()
        tg, tb = t64(gamma).requires_grad_(), t64(beta).requires_grad_()
        tmean, tvar = t64(running_mean), t64(running_var)
        ty = torch.nn.functional.batch_norm(
            tx, tmean, tvar, tg, tb, training=True, momentum=momentum, eps=eps
        )
        ty.backward(t64(dy[:real]))
        assert relative_error(y[:real], ty.detach().numpy()) <= TOL
        assert relative_error(grads["dX"][:real], tx.grad.numpy()) <= 1e-4
        assert relative_error(grads["dgamma"], tg.grad.numpy()) <= TOL
        assert relative_error(grads["dbeta"], tb.grad.numpy()) <= TOL
        assert relative_error(stats["running_mean"], tmean.numpy()) <= TOL
        assert relative_error(stats["running_var"], tvar.numpy()) <= TOL


@pytest.mark.parametrize("n,c,hw", [(3, 5, 35), (4, 3, 1)])
def test_batch_norm_evaluation_uses_the_running_statistics_and_leaves_them(backend, rng, n, c, hw):
    eps = 1e-3
    x, gamma, beta = normal(rng, n, c, hw), normal(rng, c), normal(rng, c)
    running_mean, running_var = normal(rng, c), np.abs(normal(rng, c)) + 0.5
    stats, y, _ = run_batch_norm(
        backend, x, gamma, beta, None, running_mean, running_var, 1, 0.1, eps, training=0
    )
    np.testing.assert_array_equal(stats["running_mean"], running_mean)
    np.testing.assert_array_equal(stats["running_var"], running_var)
    scale = as64(gamma) / np.sqrt(as64(running_var) + eps)
    expected = (as64(x) - as64(running_mean)[None, :, None]) * scale[None, :, None] + as64(beta)[
        None, :, None
    ]
    assert relative_error(y, expected) <= TOL
    if torch is not None:
        reference = torch.nn.functional.batch_norm(
            t64(x), t64(running_mean), t64(running_var), t64(gamma), t64(beta), training=False, eps=eps
        )
        assert relative_error(y, reference.numpy()) <= TOL

"""Reference semantics of every op in numpy: the oracle the GPU shaders are tested against, and
the kernels of the CPU backend.

Each function takes the launch's bound arrays (flat views in binding order) and its parameters
and writes its outputs in place, exactly as the shader does. Math happens in the arrays' own
precision (float32 normally, float64 for finite-difference gradient checks), and under
:func:`gpu_float_errors`, so float errors pass silently into inf and NaN as on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from flow.inputs import token_id_error
from shaders.registry import ACTIVATIONS, BINARY, CASTS, LOSSES, REDUCE, UNARY_EXTRA

Params = dict[str, float]

_SQRT_HALF = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_erfc = np.vectorize(math.erfc, otypes=[np.float64])


def gpu_float_errors() -> np.errstate:
    """numpy's float error handling set to what a GPU does: an overflow gives inf, 0/0 or inf - inf
    gives NaN, and a NaN flows on, all silently. numpy would warn at each instead; a run that
    diverges is for the loss check (actors.health) to report, once, as it is on Vulkan.

    Returns:
        A context manager; the kernels run inside it.
    """
    return np.errstate(all="ignore")


def activate(x: np.ndarray, code: int, slope: float) -> np.ndarray:
    """Apply an activation by its ACTIVATIONS code; NaN in gives NaN out (numpy's maximum and
    arithmetic propagate it)."""
    if code == ACTIVATIONS["none"]:
        return x
    if code == ACTIVATIONS["relu"]:
        return np.maximum(x, 0).astype(x.dtype, copy=False)
    if code == ACTIVATIONS["leaky_relu"]:
        return np.where(x > 0, x, x * x.dtype.type(slope))
    if code == ACTIVATIONS["sigmoid"]:
        return (1 / (1 + np.exp(-x))).astype(x.dtype, copy=False)
    if code == ACTIVATIONS["tanh"]:
        return np.tanh(x)
    if code == ACTIVATIONS["gelu"]:
        # erfc keeps the lower tail: 1 + erf(x/sqrt2) cancels to 0 in float32 below x ~ -5.5.
        wide = x.astype(np.float64)
        return (0.5 * wide * _erfc(-wide * _SQRT_HALF)).astype(x.dtype)
    raise ValueError(f"unknown activation code {code}")


def activation_derivative(saved: np.ndarray, code: int, slope: float) -> np.ndarray:
    """f'(.) from the saved tensor: the forward *output* for relu, leaky_relu, sigmoid and tanh,
    the forward *input* for gelu (its derivative cannot be recovered from the output). f' at NaN
    is NaN for every activation but none, as in the shader."""
    one = saved.dtype.type(1)
    if code == ACTIVATIONS["relu"]:
        # A comparison with NaN is False, which would make f'(NaN) 0 and hide the NaN.
        return np.where(np.isnan(saved), saved, saved > 0).astype(saved.dtype, copy=False)
    if code == ACTIVATIONS["leaky_relu"]:
        kink = np.where(saved > 0, one, saved.dtype.type(slope))
        return np.where(np.isnan(saved), saved, kink)
    if code == ACTIVATIONS["sigmoid"]:
        return saved * (one - saved)
    if code == ACTIVATIONS["tanh"]:
        return (one - saved) * (one + saved)  # no cancellation where tanh saturates
    if code == ACTIVATIONS["gelu"]:
        x = saved.astype(np.float64)
        cdf = 0.5 * _erfc(-x * _SQRT_HALF)
        pdf = np.exp(-0.5 * x * x) * _INV_SQRT_2PI
        return (cdf + x * pdf).astype(saved.dtype)
    if code == ACTIVATIONS["none"]:
        return np.ones_like(saved)
    raise ValueError(f"activation code {code} has no derivative")


def gemm(arrays: list[np.ndarray], p: Params) -> None:
    a, b, bias, c = arrays
    m, n, k = int(p["M"]), int(p["N"]), int(p["K"])
    # ones_row: row M-1 of op(A) is all ones and A stores only M-1 rows (C's last row = the
    # column sums of op(B): a bias gradient beside its weight gradient).
    stored = m - min(int(p.get("ones_row", 0)), 1)
    op_a = a[: stored * k].reshape(k, stored).T if p.get("trans_a") else a[: stored * k].reshape(stored, k)
    if stored < m:
        op_a = np.vstack([op_a, np.ones((1, k), op_a.dtype)])
    op_b = b[: k * n].reshape(n, k).T if p.get("trans_b") else b[: k * n].reshape(k, n)
    splits = int(p.get("k_splits", 1))
    act_grad = int(p.get("act_grad", 0))
    if act_grad and (splits > 1 or p.get("has_bias")):
        raise ValueError("gemm: act_grad binds the saved activation in place of the bias, without split-K")
    if splits > 1:
        # Split-K: raw partial sums per K slice into C viewed as [splits, M, N]; splitk_epilogue
        # finishes them. (The GPU slices K in multiples of its tile depth; sums agree to rounding.)
        chunk = -(-k // splits)
        partial = c[: splits * m * n].reshape(splits, m, n)
        for s in range(splits):
            partial[s] = op_a[:, s * chunk : (s + 1) * chunk] @ op_b[s * chunk : (s + 1) * chunk]
        return
    out = c[: m * n].reshape(m, n)
    result = (op_a @ op_b) * out.dtype.type(p.get("alpha", 1.0))
    if p.get("accumulate"):
        result = result + out
    if p.get("has_bias"):
        result = result + bias[:n]
    if act_grad:
        # binding 2 holds the previous layer's saved activation D[M,N]: multiply by f'(D)
        result = result * activation_derivative(bias[: m * n].reshape(m, n), act_grad, p.get("slope", 0.0))
    out[...] = activate(result.astype(out.dtype, copy=False), int(p.get("act", 0)), p.get("slope", 0.0))


def gemm_coopmat(arrays: list[np.ndarray], p: Params) -> None:
    """gemm with A and B rounded to float16 first, as the tensor-core shader does: an fp32
    operand as it enters shared memory, an fp16 one (``a_half``/``b_half``, the shader's AH/BH)
    as stored. Products of halves are exact in fp32, so both are widened to C's type.

    Raises:
        TypeError: an operand's type disagrees with its flag (the GPU would read fp32 words as
            halves, or halves as fp32 words, and give garbage; the emulation refuses instead).
    """
    a, b, bias, c = arrays
    operands = []
    for name, x in (("a", a), ("b", b)):
        flagged, stored = bool(p.get(f"{name}_half", 0)), _is_half(x, c)
        if flagged != stored:
            raise TypeError(f"gemm_coopmat: {name}_half={int(flagged)} but {name.upper()} is {x.dtype}")
        operands.append((x if stored else x.astype(np.float16)).astype(c.dtype))
    gemm([*operands, bias, c], p)


def gemm_copy(arrays: list[np.ndarray], p: Params) -> None:
    """gemm that also writes Y = act(C) for the launch's ``copy_act`` (gemm_copy.comp's YA), from
    C as stored: what a unary launch over C would write.

    Raises:
        ValueError: K is split (the raw sums are no result to activate).
    """
    a, b, bias, c, y = arrays
    if int(p.get("k_splits", 1)) > 1:
        raise ValueError("gemm_copy: the second output needs an unsplit K")
    gemm([a, b, bias, c], p)
    size = int(p["M"]) * int(p["N"])
    y[:size] = activate(c[:size], int(p.get("copy_act", 0)), 0.0)


def _residual(kernel: Callable[..., None]) -> Callable[..., None]:
    """``kernel`` (gemm, gemm_coopmat) plus a residual R[M,N] added to its finished C, as
    gemm_residual.comp / gemm_coopmat_residual.comp add it: R + C in C's type, binary.comp's add."""

    def with_residual(arrays: list[np.ndarray], p: Params) -> None:
        *operands, c, r = arrays
        if int(p.get("k_splits", 1)) > 1:
            raise ValueError("a residual GEMM needs an unsplit K")
        kernel([*operands, c], p)
        size = int(p["M"]) * int(p["N"])
        c[:size] = r[:size] + c[:size]

    return with_residual


def gemm_coopmat_copy(arrays: list[np.ndarray], p: Params) -> None:
    """gemm_coopmat that also writes H, C's float16 copy, rounded as cast.comp rounds (to nearest
    even: numpy's astype). The shader writes it as whole words of two halves from its epilogue.
    With ``copy_act`` (the shader's HA) the copy is of act(C) computed in C's precision, what a
    unary launch and a cast would write.

    Raises:
        ValueError: K is split (the raw sums are no result to copy) or N is odd (two invocations
            would share a word of H), which the shader does not do.
    """
    a, b, bias, c, h = arrays
    m, n = int(p["M"]), int(p["N"])
    if int(p.get("k_splits", 1)) > 1 or n % 2:
        raise ValueError(
            f"gemm_coopmat_copy needs an even N and no split, got N={n}, k_splits={p.get('k_splits')}"
        )
    gemm_coopmat([a, b, bias, c], p)
    h[: m * n] = activate(c[: m * n], int(p.get("copy_act", 0)), 0.0).astype(np.float16)


def _is_half(x: np.ndarray, c: np.ndarray) -> bool:
    """Whether ``x`` is a float16 tensor, beside float32 ``c`` (in the backend's float64
    precision float16 tensors are widened to float32 and float32 ones to float64)."""
    return x.dtype == (np.float32 if c.dtype == np.float64 else np.float16)


def gemm_coopmat_f16(arrays: list[np.ndarray], p: Params) -> None:
    """gemm_coopmat with float16 A and B: the shader multiplies the halves as stored (products of
    halves are exact in fp32) and sums in fp32, so this widens them to C's type and multiplies.

    Raises:
        TypeError: A or B is not a float16 tensor (reading fp32 data as halves gives garbage on the
            GPU, so the emulation refuses it rather than agreeing).
    """
    a, b, bias, c = arrays
    # In float64 precision the backend widens float16 tensors to float32 (and float32 to float64).
    half = np.float32 if c.dtype == np.float64 else np.float16
    if a.dtype != half or b.dtype != half:
        raise TypeError(f"gemm_coopmat_f16 needs float16 A and B tensors, got {a.dtype} and {b.dtype}")
    gemm([a.astype(c.dtype), b.astype(c.dtype), bias, c], {**p, "k_splits": 1})


def splitk_epilogue(arrays: list[np.ndarray], p: Params) -> None:
    w, bias, c = arrays
    m, n, splits = int(p["M"]), int(p["N"]), int(p["splits"])
    out = c[: m * n].reshape(m, n)
    result = w[: splits * m * n].reshape(splits, m, n).sum(axis=0) * out.dtype.type(p.get("alpha", 1.0))
    if p.get("accumulate"):
        result = result + out
    if p.get("has_bias"):
        result = result + bias[:n]
    out[...] = activate(result.astype(out.dtype, copy=False), int(p.get("act", 0)), p.get("slope", 0.0))


def unary(arrays: list[np.ndarray], p: Params) -> None:
    x, y = arrays
    n, fn = int(p["n"]), int(p["fn"])
    src = x[:n]
    if fn == UNARY_EXTRA["scale_shift"]:
        y[:n] = src * y.dtype.type(p.get("a", 1.0)) + y.dtype.type(p.get("b", 0.0))
    elif fn == UNARY_EXTRA["copy"]:
        y[:n] = src
    elif fn == UNARY_EXTRA["exp"]:
        y[:n] = np.exp(src)
    else:
        y[:n] = activate(src, fn, p.get("a", 0.0))


def unary_half(arrays: list[np.ndarray], p: Params) -> None:
    """Y = fp16(f(X)) for an activation f: f in X's precision, then rounded as cast rounds."""
    x, y = arrays
    n = int(p["n"])
    y[:n] = activate(x[:n], int(p["fn"]), p.get("a", 0.0)).astype(np.float16)


def unary_backward(arrays: list[np.ndarray], p: Params) -> None:
    dy, saved, dx = arrays
    n = int(p["n"])
    dx[:n] = dy[:n] * activation_derivative(saved[:n], int(p["fn"]), p.get("a", 0.0))


def binary(arrays: list[np.ndarray], p: Params) -> None:
    x, y, z = arrays
    n, fn = int(p["n"]), int(p["fn"])
    scale = z.dtype.type(p.get("a", 1.0))
    if fn == BINARY["add"]:
        z[:n] = (x[:n] + y[:n]) * scale
    elif fn == BINARY["sub"]:
        z[:n] = (x[:n] - y[:n]) * scale
    elif fn == BINARY["mul"]:
        z[:n] = (x[:n] * y[:n]) * scale
    else:
        raise ValueError(f"unknown binary fn {fn}")


def reduce(arrays: list[np.ndarray], p: Params) -> None:
    x, y = arrays
    rows, cols, axis, fn = int(p["rows"]), int(p["cols"]), int(p["axis"]), int(p["fn"])
    matrix = x[: rows * cols].reshape(rows, cols)
    # Accumulate in float64 (numpy sums down columns row by row, losing digits in float32).
    if fn == REDUCE["sum"]:
        result = matrix.sum(axis=axis, dtype=np.float64).astype(matrix.dtype)
    elif fn == REDUCE["mean"]:
        result = matrix.mean(axis=axis, dtype=np.float64).astype(matrix.dtype)
    elif fn == REDUCE["max"]:
        result = matrix.max(axis=axis)
    else:
        raise ValueError(f"unknown reduce fn {fn}")
    out_len = cols if axis == 0 else rows
    y[:out_len] = result * y.dtype.type(p.get("alpha", 1.0))


def _log_softmax_rows(matrix: np.ndarray) -> np.ndarray:
    shifted = matrix - matrix.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def softmax(arrays: list[np.ndarray], p: Params) -> None:
    x, y = arrays
    rows, cols = int(p["rows"]), int(p["cols"])
    log_probs = _log_softmax_rows(x[: rows * cols].reshape(rows, cols))
    y[: rows * cols] = (log_probs if p.get("log") else np.exp(log_probs)).reshape(-1)


def softmax_backward(arrays: list[np.ndarray], p: Params) -> None:
    y, dy, dx = arrays
    rows, cols = int(p["rows"]), int(p["cols"])
    out = y[: rows * cols].reshape(rows, cols)
    grad = dy[: rows * cols].reshape(rows, cols)
    if p.get("log"):
        result = grad - np.exp(out) * grad.sum(axis=1, keepdims=True)
    else:
        result = out * (grad - (grad * out).sum(axis=1, keepdims=True))
    dx[: rows * cols] = result.reshape(-1)


def _real_rows(stepvals: np.ndarray, capacity: int) -> int:
    """The batch's real rows, stepvals[4], clamped to [1, capacity] as batch_rows.glsl does."""
    return min(max(int(stepvals[4]), 1), capacity)


def _divisor(stepvals: np.ndarray, rows: int) -> float:
    """The rows the loss averages over, stepvals[5], as batch_rows.glsl's mean_divisor."""
    divisor = float(stepvals[5]) if len(stepvals) > 5 else 0.0
    return divisor if divisor >= 1.0 else float(rows)


def _xent(arrays: list[np.ndarray], p: Params, weights: np.ndarray | None, weight_sum: float) -> None:
    """softmax_xent_general's rows (softmax_xent's when unweighted and without smoothing)."""
    logits, labels, loss_rows, correct_rows, dlogits, stepvals = arrays
    rows, cols, per = int(p["rows"]), int(p["cols"]), max(int(p.get("per_sample", 1)), 1)
    samples = _real_rows(stepvals, rows // per)
    n = samples * per
    matrix = logits[: n * cols].reshape(n, cols)
    dt = matrix.dtype.type
    target = labels[:n].astype(np.int64)
    # As the shader: a label outside [0, cols) gives a NaN loss, counts as wrong and adds no
    # one-hot term to the gradient.
    valid = (target >= 0) & (target < cols)
    safe = np.where(valid, target, 0)
    w = np.ones(cols, matrix.dtype) if weights is None else weights[:cols].astype(matrix.dtype)
    wy = np.where(valid, w[safe], dt(1))
    smoothing = dt(p.get("smoothing", 0.0))
    spread = smoothing / dt(cols)
    log_probs = _log_softmax_rows(matrix)
    picked = np.arange(n)
    scale = dt(1.0 / weight_sum) if weights is not None else dt(1.0 / (_divisor(stepvals, samples) * per))
    row_loss = (1 - smoothing) * wy * -log_probs[picked, safe]
    if smoothing:
        row_loss = row_loss - spread * (log_probs * w).sum(axis=1)
    loss_rows[:n] = np.where(valid, row_loss, np.nan) * scale
    loss_rows[n:rows] = 0
    correct_rows[:n] = (valid & (matrix.argmax(axis=1) == target)).astype(correct_rows.dtype)
    correct_rows[n:rows] = 0
    if p.get("write_grad"):
        grad = np.exp(log_probs) * ((1 - smoothing) * wy + spread * w.sum())[:, None] - spread * w
        grad[picked[valid], target[valid]] -= (1 - smoothing) * wy[valid]
        dlogits[: n * cols] = (grad * scale).reshape(-1)
        dlogits[n * cols : rows * cols] = 0


def softmax_xent(arrays: list[np.ndarray], p: Params) -> None:
    _xent(arrays, p, None, 0.0)


def softmax_xent_general(arrays: list[np.ndarray], p: Params) -> None:
    logits, labels, weights, weight_sum, *rest = arrays
    if p.get("weighted"):
        _xent([logits, labels, *rest], p, weights, float(weight_sum[0]))
    else:
        _xent([logits, labels, *rest], p, None, 0.0)


def class_weight_sum(arrays: list[np.ndarray], p: Params) -> None:
    labels, weights, stepvals, weight_sum = arrays
    rows, cols, per = int(p["rows"]), int(p["cols"]), max(int(p.get("per_sample", 1)), 1)
    samples = _real_rows(stepvals, rows // per)
    target = labels[: samples * per].astype(np.int64)
    valid = (target >= 0) & (target < cols)
    total = weights[np.where(valid, target, 0)][valid].sum()
    weight_sum[0] = total * (_divisor(stepvals, samples) / samples)


def softmax_xent_totals(arrays: list[np.ndarray], p: Params) -> None:
    logits, labels, loss, correct, dlogits, stepvals = arrays
    rows = int(p["rows"])
    loss_rows = np.empty(rows, np.float64)
    correct_rows = np.empty(rows, np.float64)
    softmax_xent([logits, labels, loss_rows, correct_rows, dlogits, stepvals], p)
    loss[0] = loss_rows.sum()
    correct[0] = correct_rows.sum() / max(int(p.get("per_sample", 1)), 1)


def _pointwise(y: np.ndarray, t: np.ndarray, fn: int, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """mse.comp's f and f' (see LOSSES) of each output y against its target t."""
    d = y - t
    if fn == LOSSES["L1"]:
        return np.abs(d), np.sign(d)
    if fn == LOSSES["Huber"]:
        a, delta = np.abs(d), d.dtype.type(delta)
        return np.where(a < delta, d * d / 2, delta * (a - delta / 2)), np.clip(d, -delta, delta)
    if fn == LOSSES["BCEWithLogits"]:
        e = np.exp(-np.abs(y))
        return np.maximum(y, 0) - y * t + np.log1p(e), np.where(y >= 0, 1, e) / (1 + e) - t
    return d * d, 2 * d


def mse(arrays: list[np.ndarray], p: Params) -> None:
    y, t, loss_rows, dy, stepvals = arrays
    rows, cols = int(p["rows"]), int(p["cols"])
    n = _real_rows(stepvals, rows)
    outputs, targets = y[: n * cols].reshape(n, cols), t[: n * cols].reshape(n, cols)
    f, grad = _pointwise(outputs, targets, int(p.get("fn", 0)), p.get("delta", 1.0))
    scale = f.dtype.type(1.0 / (_divisor(stepvals, n) * cols))
    loss_rows[:n] = f.sum(axis=1) * scale
    loss_rows[n:rows] = 0
    if p.get("write_grad"):
        dy[: n * cols] = (grad * scale).astype(dy.dtype).reshape(-1)
        dy[n * cols : rows * cols] = 0


def _conv_dims(p: Params) -> tuple[int, ...]:
    return tuple(int(p[k]) for k in ("N", "C", "H", "W", "K", "R", "S", "stride", "pad", "OH", "OW"))


def _pad_h(p: Params) -> int:
    """The zeros above and below the input: none for a Conv1d's (C, 1, L) (push field one_d)."""
    return 0 if p.get("one_d") else int(p["pad"])


def _im2col(x: np.ndarray, p: Params) -> np.ndarray:
    """[N, C, H, W] -> [N, OH, OW, C, R, S] windows (zero padded)."""
    n, c, h, w, _k, r, s, stride, pad, oh, ow = _conv_dims(p)
    pad_h = _pad_h(p)
    padded = np.pad(x, ((0, 0), (0, 0), (pad_h, pad_h), (pad, pad)))
    cols = np.empty((n, oh, ow, c, r, s), dtype=x.dtype)
    for i in range(r):
        for j in range(s):
            cols[..., i, j] = padded[
                :, :, i : i + stride * oh : stride, j : j + stride * ow : stride
            ].transpose(0, 2, 3, 1)
    return cols


def conv2d(arrays: list[np.ndarray], p: Params) -> None:
    x, wt, bias, y = arrays
    n, c, h, w, k, r, s, _stride, _pad, oh, ow = _conv_dims(p)
    cols = _im2col(x[: n * c * h * w].reshape(n, c, h, w), p).reshape(n * oh * ow, c * r * s)
    out = cols @ wt[: k * c * r * s].reshape(k, c * r * s).T
    if p.get("has_bias"):
        out = out + bias[:k]
    out = activate(out.astype(y.dtype, copy=False), int(p.get("act", 0)), p.get("slope", 0.0))
    y[: n * k * oh * ow] = out.reshape(n, oh, ow, k).transpose(0, 3, 1, 2).reshape(-1)


def conv2d_backward_data(arrays: list[np.ndarray], p: Params) -> None:
    dy, wt, dx = arrays
    n, c, h, w, k, r, s, stride, pad, oh, ow = _conv_dims(p)
    grad_cols = dy[: n * k * oh * ow].reshape(n, k, oh, ow).transpose(0, 2, 3, 1).reshape(-1, k) @ wt[
        : k * c * r * s
    ].reshape(k, c * r * s)
    grad_cols = grad_cols.reshape(n, oh, ow, c, r, s)
    pad_h = _pad_h(p)
    padded = np.zeros((n, c, h + 2 * pad_h, w + 2 * pad), dtype=dx.dtype)
    for i in range(r):
        for j in range(s):
            padded[:, :, i : i + stride * oh : stride, j : j + stride * ow : stride] += grad_cols[
                ..., i, j
            ].transpose(0, 3, 1, 2)
    dx[: n * c * h * w] = padded[:, :, pad_h : pad_h + h, pad : pad + w].reshape(-1)


def conv2d_backward_weight(arrays: list[np.ndarray], p: Params) -> None:
    x, dy, dw = arrays
    n, c, h, w, k, r, s, _stride, _pad, oh, ow = _conv_dims(p)
    cols = _im2col(x[: n * c * h * w].reshape(n, c, h, w), p).reshape(n * oh * ow, c * r * s)
    grad = dy[: n * k * oh * ow].reshape(n, k, oh, ow).transpose(0, 2, 3, 1).reshape(-1, k)
    dw[: k * c * r * s] = (grad.T @ cols).reshape(-1)


def conv2d_gemm_backward_weight(arrays: list[np.ndarray], p: Params) -> None:
    """conv2d_backward_weight, or with k_splits > 1 the raw partial sums over slices of the
    (n, oh, ow) positions into dW viewed as [k_splits, K, C*R*S], for splitk_epilogue to add.
    (The GPU slices in multiples of its tile depth; the sums agree to rounding.)"""
    splits = int(p.get("k_splits", 1))
    if splits <= 1:
        conv2d_backward_weight(arrays, p)
        return
    x, dy, dw = arrays
    n, c, h, w, k, r, s, _stride, _pad, oh, ow = _conv_dims(p)
    cols = _im2col(x[: n * c * h * w].reshape(n, c, h, w), p).reshape(n * oh * ow, c * r * s)
    grad = dy[: n * k * oh * ow].reshape(n, k, oh, ow).transpose(0, 2, 3, 1).reshape(-1, k)
    chunk = -(-(n * oh * ow) // splits)
    partial = dw[: splits * k * c * r * s].reshape(splits, k, c * r * s)
    for z in range(splits):
        partial[z] = grad[z * chunk : (z + 1) * chunk].T @ cols[z * chunk : (z + 1) * chunk]


def _fp16_operands(kernel: Callable[..., None]) -> Callable[..., None]:
    """``kernel`` with its first two bindings rounded to float16 first, as the tensor-core
    convolutions (conv2d_gemm_coopmat*.comp) round their operands."""

    def rounded(arrays: list[np.ndarray], p: Params) -> None:
        kernel([a.astype(np.float16).astype(a.dtype) for a in arrays[:2]] + arrays[2:], p)

    return rounded


def conv_splitk_sum(arrays: list[np.ndarray], p: Params) -> None:
    w, dw = arrays
    total, splits = int(p["total"]), int(p["splits"])
    dw[:total] = w[: splits * total].reshape(splits, total).sum(axis=0)


def channel_sum(arrays: list[np.ndarray], p: Params) -> None:
    dy, db = arrays
    n, k, hw, parts = int(p["N"]), int(p["K"]), int(p["HW"]), int(p.get("parts", 1))
    per_part = -(-n // parts)
    planes = dy[: n * k * hw].reshape(n, k, hw)
    for part in range(parts):  # slice p's sums at [p * K, (p + 1) * K), as channel_sum.comp
        rows = planes[part * per_part : (part + 1) * per_part]
        db[part * k : (part + 1) * k] = rows.sum(axis=(0, 2), dtype=db.dtype)


def _pool_dims(p: Params) -> tuple[int, ...]:
    return tuple(int(p[k]) for k in ("N", "C", "H", "W", "OH", "OW", "kernel", "stride"))


def maxpool2d(arrays: list[np.ndarray], p: Params) -> None:
    x, y, idx = arrays
    n, c, h, w, oh, ow, kernel, stride = _pool_dims(p)
    planes = x[: n * c * h * w].reshape(n, c, h * w)
    best = np.full((n, c, oh, ow), -np.inf, dtype=x.dtype)
    best_idx = np.zeros((n, c, oh, ow), dtype=np.int32)
    # Row-major scan with strict '>' keeps the first maximum, as the shader does. NaN counts above
    # every number (the first NaN wins, as numpy's argmax), so a NaN input gives a NaN output.
    for i in range(kernel):
        for j in range(kernel):
            rows = np.arange(oh) * stride + i
            cols = np.arange(ow) * stride + j
            flat = (rows[:, None] * w + cols[None, :]).astype(np.int32)
            values = planes[:, :, flat]
            better = (values > best) | (np.isnan(values) & ~np.isnan(best))
            best = np.where(better, values, best)
            best_idx = np.where(better, flat, best_idx)
    y[: n * c * oh * ow] = best.reshape(-1)
    idx[: n * c * oh * ow] = best_idx.reshape(-1)


def maxpool2d_backward(arrays: list[np.ndarray], p: Params) -> None:
    dy, idx, dx = arrays
    n, c, h, w, oh, ow, _kernel, _stride = _pool_dims(p)
    grad = np.zeros((n * c, h * w), dtype=dx.dtype)
    np.add.at(
        grad,
        (np.repeat(np.arange(n * c), oh * ow), idx[: n * c * oh * ow].astype(np.int64)),
        dy[: n * c * oh * ow],
    )
    dx[: n * c * h * w] = grad.reshape(-1)


def _avg_pool_dims(p: Params) -> tuple[int, ...]:
    return (*_pool_dims(p), int(p.get("pad", 0)))


def avgpool2d(arrays: list[np.ndarray], p: Params) -> None:
    x, y = arrays
    n, c, h, w, oh, ow, kernel, stride, pad = _avg_pool_dims(p)
    padded = np.pad(x[: n * c * h * w].reshape(n, c, h, w), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    total = np.zeros((n, c, oh, ow), dtype=np.float64)
    for i in range(kernel):  # each window offset in turn, over every window at once
        for j in range(kernel):
            total += padded[:, :, i : i + oh * stride : stride, j : j + ow * stride : stride]
    # Padding counts in the mean (count_include_pad): every window divides by kernel^2.
    y[: n * c * oh * ow] = (total / (kernel * kernel)).reshape(-1)


def avgpool2d_backward(arrays: list[np.ndarray], p: Params) -> None:
    dy, dx = arrays
    n, c, h, w, oh, ow, kernel, stride, pad = _avg_pool_dims(p)
    share = dy[: n * c * oh * ow].reshape(n, c, oh, ow).astype(np.float64) / (kernel * kernel)
    grad = np.zeros((n, c, h + 2 * pad, w + 2 * pad), dtype=np.float64)
    for i in range(kernel):
        for j in range(kernel):
            grad[:, :, i : i + oh * stride : stride, j : j + ow * stride : stride] += share
    dx[: n * c * h * w] = grad[:, :, pad : pad + h, pad : pad + w].reshape(-1)


def broadcast_rows(arrays: list[np.ndarray], p: Params) -> None:
    x, y = arrays
    rows, cols = int(p["rows"]), int(p["cols"])
    spread = np.repeat(x[:rows] * x.dtype.type(p.get("alpha", 1.0)), cols)
    y[: rows * cols] = spread


def copy_columns(arrays: list[np.ndarray], p: Params) -> None:
    x, y = arrays
    rows, cols = int(p["rows"]), int(p["cols"])
    source = x[: rows * int(p["x_width"])].reshape(rows, -1)
    target = y[: rows * int(p["y_width"])].reshape(rows, -1)
    target[:, int(p["y_offset"]) : int(p["y_offset"]) + cols] = source[:, int(p["x_offset"]) :][:, :cols]


def bmm(arrays: list[np.ndarray], p: Params) -> None:
    x, w, y = arrays
    z, m, n, k = (int(p[key]) for key in ("batch", "M", "N", "K"))
    a = x[: z * m * k].reshape((z, k, m) if p.get("trans_a") else (z, m, k))
    b = w[: z * k * n].reshape((z, n, k) if p.get("trans_b") else (z, k, n))
    a = a.transpose(0, 2, 1) if p.get("trans_a") else a
    b = b.transpose(0, 2, 1) if p.get("trans_b") else b
    y[: z * m * n] = np.matmul(a, b).astype(y.dtype, copy=False).reshape(-1)


def add_rows(arrays: list[np.ndarray], p: Params) -> None:
    x, b, y = arrays
    rows, cols = int(p["rows"]), int(p["cols"])
    y[: rows * cols] = (x[: rows * cols].reshape(rows, cols) + b[:cols]).reshape(-1)


def _norm_planes(array: np.ndarray, p: Params, rows: int) -> np.ndarray:
    """The first ``rows`` rows of a BatchNorm tensor as [rows, C, HW]."""
    c, hw = int(p["C"]), int(p["HW"])
    return array[: rows * c * hw].reshape(rows, c, hw)


def batchnorm_stats(arrays: list[np.ndarray], p: Params) -> None:
    x, running_mean, running_var, stats, stepvals = arrays
    c, eps = int(p["C"]), float(p["eps"])
    if not p.get("training"):
        stats[:c] = running_mean[:c]
        stats[c : 2 * c] = 1.0 / np.sqrt(running_var[:c].astype(np.float64) + eps)
        return
    n = _real_rows(stepvals, int(p["N"]))
    planes = _norm_planes(x, p, n).astype(np.float64)
    m = planes.shape[0] * planes.shape[2]
    mean = planes.mean(axis=(0, 2))
    # Two passes, as the shader: the deviations from the mean, not a sum of squares minus its square.
    variance = ((planes - mean[None, :, None]) ** 2).mean(axis=(0, 2))
    stats[:c] = mean
    stats[c : 2 * c] = 1.0 / np.sqrt(variance + eps)
    unbiased = variance * (m / (m - 1)) if m > 1 else variance
    momentum = float(p["momentum"])
    running_mean[:c] = (1 - momentum) * running_mean[:c].astype(np.float64) + momentum * mean
    running_var[:c] = (1 - momentum) * running_var[:c].astype(np.float64) + momentum * unbiased


def batchnorm(arrays: list[np.ndarray], p: Params) -> None:
    x, stats, gamma, beta, y = arrays
    n, c = int(p["N"]), int(p["C"])
    planes = _norm_planes(x, p, n)
    mean, invstd = stats[:c, None], stats[c : 2 * c, None]
    y[: planes.size] = (gamma[:c, None] * ((planes - mean) * invstd) + beta[:c, None]).reshape(-1)


def batchnorm_backward_reduce(arrays: list[np.ndarray], p: Params) -> None:
    dy, x, stats, dgamma, dbeta = arrays[:5]
    c, n = int(p["C"]), _real_rows(arrays[5], int(p["N"]))
    grad = _norm_planes(dy, p, n).astype(np.float64)
    centred = _norm_planes(x, p, n).astype(np.float64) - stats[:c, None].astype(np.float64)
    dy_sum = grad.sum(axis=(0, 2))
    dy_xhat = (grad * centred).sum(axis=(0, 2)) * stats[c : 2 * c]
    dbeta[:c], dgamma[:c] = dy_sum, dy_xhat
    stats[2 * c : 3 * c], stats[3 * c : 4 * c] = dy_sum, dy_xhat


def batchnorm_backward_data(arrays: list[np.ndarray], p: Params) -> None:
    dy, x, stats, gamma, stepvals, dx = arrays
    rows, c, hw = int(p["N"]), int(p["C"]), int(p["HW"])
    n = _real_rows(stepvals, rows)
    invstd, mean = stats[c : 2 * c, None], stats[:c, None]
    xhat = (_norm_planes(x, p, n) - mean) * invstd
    correction = (stats[2 * c : 3 * c, None] + xhat * stats[3 * c : 4 * c, None]) / dx.dtype.type(n * hw)
    grads = gamma[:c, None] * invstd * (_norm_planes(dy, p, n) - correction)
    dx[: n * c * hw] = grads.reshape(-1)
    dx[n * c * hw : rows * c * hw] = 0  # padding rows took no part in the statistics


def _layer_rows(array: np.ndarray, p: Params, samples: int) -> np.ndarray:
    """The rows of the first ``samples`` samples of a LayerNorm tensor as [samples * R, D]."""
    r, d = int(p["R"]), int(p["D"])
    return array[: samples * r * d].reshape(samples * r, d)


def layernorm(arrays: list[np.ndarray], p: Params) -> None:
    x, gamma, beta, y, stats = arrays
    n, d = int(p["N"]), int(p["D"])
    rows = _layer_rows(x, p, n).astype(np.float64)
    mean = rows.mean(axis=1, keepdims=True)
    # Two passes, as the shader: the deviations from the mean, not a sum of squares minus its square.
    invstd = 1.0 / np.sqrt(((rows - mean) ** 2).mean(axis=1, keepdims=True) + float(p["eps"]))
    y[: rows.size] = (gamma[:d] * ((rows - mean) * invstd) + beta[:d]).reshape(-1)
    stats[: 2 * rows.shape[0]] = np.concatenate([mean, invstd], axis=1).reshape(-1)


def _layer_xhat(x: np.ndarray, stats: np.ndarray, p: Params, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """xhat of the first ``samples`` samples' rows, and their 1 / std, in float64."""
    pairs = stats[: 2 * samples * int(p["R"])].astype(np.float64).reshape(-1, 2)
    invstd = pairs[:, 1:]
    return (_layer_rows(x, p, samples).astype(np.float64) - pairs[:, :1]) * invstd, invstd


def layernorm_backward_reduce(arrays: list[np.ndarray], p: Params) -> None:
    dy, x, stats, dgamma, dbeta, stepvals = arrays
    n, d = _real_rows(stepvals, int(p["N"])), int(p["D"])
    grad = _layer_rows(dy, p, n).astype(np.float64)
    xhat, _ = _layer_xhat(x, stats, p, n)
    # Slice s of the capacity's rows sums into [s * D, (s + 1) * D), as the shader (see there).
    parts = max(1, int(p.get("parts", 1)))
    per_part = -(-int(p["N"]) * int(p["R"]) // parts)
    for part in range(parts):
        rows = slice(part * per_part, (part + 1) * per_part)
        dbeta[part * d : (part + 1) * d] = grad[rows].sum(axis=0)
        dgamma[part * d : (part + 1) * d] = (grad[rows] * xhat[rows]).sum(axis=0)


def _with_half_copy(kernel: Callable[..., None], output: int) -> Callable[..., None]:
    """A kernel's _copy variant (registry HALF_COPY_OUTPUT): the kernel, then H (its last binding) =
    the float16 copy of its ``output``-th binding, rounded as cast.comp rounds: over the layer
    norms' N * R rows of D, or unary_backward's n elements."""

    def with_copy(arrays: list[np.ndarray], p: Params) -> None:
        kernel(arrays[:-1], p)
        count = int(p["n"]) if "n" in p else int(p["N"]) * int(p["R"]) * int(p["D"])
        arrays[-1][:count] = arrays[output][:count].astype(np.float16)

    return with_copy


def _half_only(kernel: Callable[..., None], output: int) -> Callable[..., None]:
    """A _copy kernel's _half variant (registry HALF_ONLY): its ``output``-th binding left as it was."""

    def half_only(arrays: list[np.ndarray], p: Params) -> None:
        kept = arrays[output].copy()
        kernel(arrays, p)
        arrays[output][...] = kept

    return half_only


def column_sum_copy(arrays: list[np.ndarray], p: Params) -> None:
    """column_sum, then H = X's float16 copy (rows x cols, as cast.comp rounds)."""
    column_sum(arrays[:2], p)
    count = int(p["rows"]) * int(p["cols"])
    arrays[2][:count] = arrays[0][:count].astype(np.float16)


def column_sum(arrays: list[np.ndarray], p: Params) -> None:
    x, out = arrays
    rows, cols, parts = int(p["rows"]), int(p["cols"]), max(1, int(p.get("parts", 1)))
    matrix, per_part = x[: rows * cols].reshape(rows, cols), -(-rows // parts)
    alpha = out.dtype.type(p.get("alpha", 1.0))
    for part in range(parts):  # slice p's sums at [p * cols, (p + 1) * cols), as column_sum.comp
        sums = matrix[part * per_part : (part + 1) * per_part].sum(axis=0, dtype=np.float64)
        out[part * cols : (part + 1) * cols] = sums.astype(out.dtype) * alpha


def layernorm_backward_data(arrays: list[np.ndarray], p: Params) -> None:
    dy, x, stats, gamma, stepvals, dx, addend = arrays
    rows, r, d = int(p["N"]), int(p["R"]), int(p["D"])
    n = _real_rows(stepvals, rows)
    xhat, invstd = _layer_xhat(x, stats, p, n)
    g = _layer_rows(dy, p, n).astype(np.float64) * gamma[:d]
    grads = invstd * (g - g.mean(axis=1, keepdims=True) - xhat * (g * xhat).mean(axis=1, keepdims=True))
    # accumulate: a residual stream's other gradient added in (the padding rows get it alone).
    base = addend[: rows * r * d].copy() if int(p.get("accumulate", 0)) else np.zeros(rows * r * d, dx.dtype)
    dx[: n * r * d] = base[: n * r * d] + grads.reshape(-1).astype(dx.dtype)
    dx[n * r * d : rows * r * d] = base[n * r * d :]  # padding rows: the layers before never learn from them


def _attention_heads(qkv: np.ndarray, p: Params) -> np.ndarray:
    """qkv [N, T, 3D] as [3, N, H, T, dh] (q, k, v per head), a view."""
    n, t, h, dh = int(p["N"]), int(p["T"]), int(p["H"]), int(p["dh"])
    return qkv[: n * t * 3 * h * dh].reshape(n, t, 3, h, dh).transpose(2, 0, 3, 1, 4)


def _attention_scores(q: np.ndarray, k: np.ndarray, p: Params) -> np.ndarray:
    """scale * q k^T per head, [N, H, T, T], -inf above the diagonal when causal."""
    scores = (q @ k.swapaxes(-1, -2)) * q.dtype.type(p["scale"])
    if int(p["causal"]):
        t = q.shape[2]
        scores = np.where(np.tri(t, dtype=bool), scores, q.dtype.type(-np.inf))
    return scores


def attention(arrays: list[np.ndarray], p: Params) -> None:
    qkv, y, lse = arrays
    q, k, v = _attention_heads(qkv, p)
    scores = _attention_scores(q, k, p)
    top = scores.max(axis=-1, keepdims=True)  # j = i is never masked: finite
    e = np.exp(scores - top)
    total = e.sum(axis=-1, keepdims=True)
    out = (e / total) @ v
    y[: out.size] = out.transpose(0, 2, 1, 3).reshape(-1)
    lse[: total.size] = (top + np.log(total)).reshape(-1)


def attention_backward_dot(arrays: list[np.ndarray], p: Params) -> None:
    dy, y, drow = arrays
    n, t, h, dh = int(p["N"]), int(p["T"]), int(p["H"]), int(p["dh"])
    size = n * t * h * dh
    dots = (dy[:size] * y[:size]).reshape(n, t, h, dh).sum(axis=-1)
    drow[: n * h * t] = dots.transpose(0, 2, 1).reshape(-1)


def _attention_grads(arrays: list[np.ndarray], p: Params) -> tuple[np.ndarray, ...]:
    """The attention backward from the saved L and Drow, as the kernels compute it: dq, dk, dv
    [N, H, T, dh], and dqkv as [3, N, H, T, dh] (a view to write them into)."""
    qkv, dy, lse, drow, dqkv = arrays
    q, k, v = _attention_heads(qkv, p)
    n, t, h, dh = q.shape[0], q.shape[2], q.shape[1], q.shape[3]
    grad = dy[: n * t * h * dh].reshape(n, t, h, dh).transpose(0, 2, 1, 3)
    probs = np.exp(_attention_scores(q, k, p) - lse[: n * h * t].reshape(n, h, t, 1))
    ds = probs * (grad @ v.swapaxes(-1, -2) - drow[: n * h * t].reshape(n, h, t, 1))
    scale = q.dtype.type(p["scale"])
    dq, dk = (ds @ k) * scale, (ds.swapaxes(-1, -2) @ q) * scale
    return dq, dk, probs.swapaxes(-1, -2) @ grad, _attention_heads(dqkv, p)


def attention_backward_kv(arrays: list[np.ndarray], p: Params) -> None:
    _dq, dk, dv, out = _attention_grads(arrays, p)
    out[1], out[2] = dk, dv  # the q columns are attention_backward_q's


def attention_backward_q(arrays: list[np.ndarray], p: Params) -> None:
    dq, _dk, _dv, out = _attention_grads(arrays, p)
    out[0] = dq


def _half(x: np.ndarray) -> np.ndarray:
    """x rounded to float16, in x's type: what the tensor-core kernels stage."""
    return x.astype(np.float16).astype(x.dtype)


def attention_coopmat(arrays: list[np.ndarray], p: Params) -> None:
    """attention on tensor cores: qkv rounded to float16 (P's own fp16 rounding is not emulated)."""
    attention([_half(arrays[0]), *arrays[1:]], p)


def attention_coopmat_backward_kv(arrays: list[np.ndarray], p: Params) -> None:
    attention_backward_kv([_half(arrays[0]), _half(arrays[1]), *arrays[2:]], p)


def attention_coopmat_backward_q(arrays: list[np.ndarray], p: Params) -> None:
    attention_backward_q([_half(arrays[0]), _half(arrays[1]), *arrays[2:]], p)


def _attention_half(kernel: Callable[..., None]) -> Callable[..., None]:
    """An attention_coopmat*_half kernel: ``kernel`` on qkv's float16 copy (the values it would
    round qkv to); the forward's then H (its last binding) = Y's float16 copy."""

    def with_halves(arrays: list[np.ndarray], p: Params) -> None:
        forward = kernel is attention_coopmat
        out = arrays[1] if forward else arrays[4]
        kernel([arrays[0].astype(out.dtype), *arrays[1 : len(arrays) - forward]], p)
        if forward:  # Y [N, T, D]
            count = int(p["N"]) * int(p["T"]) * int(p["H"]) * int(p["dh"])
            arrays[-1][:count] = out[:count].astype(np.float16)

    return with_halves


def _pcg(v: np.ndarray) -> np.ndarray:
    """dropout.comp's pcg() on a uint32 array (numpy wraps uint32 arithmetic as GLSL does)."""
    state = v * np.uint32(747796405) + np.uint32(2891336453)
    word = ((state >> ((state >> np.uint32(28)) + np.uint32(4))) ^ state) * np.uint32(277803737)
    return (word >> np.uint32(22)) ^ word


def dropout_keep(n: int, seed: int, step: int, threshold: int) -> np.ndarray:
    """Which of the first ``n`` elements dropout.comp keeps at training step ``step`` (its t).

    Args:
        n: elements.
        seed: the launch's seed (flow.autodiff mixes the run's seed with the layer's index).
        step: the 1-based step, stepvals[3].
        threshold: ceil(p * 2**32); a hash below it drops its element.

    Returns:
        bool [n], True where the element is kept.
    """
    key = _pcg(_pcg(np.array([seed], np.uint32)) ^ np.uint32(step))
    return _pcg(_pcg(np.arange(n, dtype=np.uint32)) ^ key) >= np.uint32(threshold)


def dropout(arrays: list[np.ndarray], p: Params) -> None:
    x, stepvals, y = arrays
    n = int(p["n"])
    keep = dropout_keep(n, int(p["seed"]), int(stepvals[3]), int(p["threshold"]))
    y[:n] = x[:n] * np.where(keep, y.dtype.type(p["scale"]), y.dtype.type(0))


def _table_rows(ids: np.ndarray, p: Params, stepvals: np.ndarray) -> np.ndarray:
    """The table row of each of an Embedding's N * S ids. A real sample's id must be an integer
    in [0, V); a padding row's is clamped into range, as embedding_row.glsl does with every id."""
    n, s, v = int(p["N"]), int(p["S"]), int(p["V"])
    values = ids[: n * s]
    message = token_id_error(values[: _real_rows(stepvals, n) * s].reshape(-1, s), v)
    if message is not None:
        raise ValueError(message)
    return np.clip(np.nan_to_num(values), 0, v - 1).astype(np.int64)


def embedding(arrays: list[np.ndarray], p: Params) -> None:
    ids, w, stepvals, y = arrays
    v, d = int(p["V"]), int(p["D"])
    rows = _table_rows(ids, p, stepvals)
    y[: rows.size * d] = w[: v * d].reshape(v, d)[rows].reshape(-1)


def embedding_backward(arrays: list[np.ndarray], p: Params) -> None:
    ids, dy, stepvals, dw = arrays
    v, d, chunks = int(p["V"]), int(p["D"]), max(int(p.get("chunks", 0)), 1)
    rows = _table_rows(ids, p, stepvals)[: _real_rows(stepvals, int(p["N"])) * int(p["S"])]
    span = -(-int(p["N"]) * int(p["S"]) // chunks)
    grad = np.zeros((chunks, v, d), dw.dtype)
    for chunk in range(chunks):  # with chunks > 1: [chunks, V, D] partial sums, as the shader's
        part = rows[chunk * span : (chunk + 1) * span]
        # Unbuffered: a repeated id adds each of its rows, in order, as the shader's loop does.
        np.add.at(grad[chunk], part, dy[chunk * span * d : (chunk * span + part.size) * d].reshape(-1, d))
    dw[: chunks * v * d] = grad.reshape(-1)


def embedding_chunk_sum(arrays: list[np.ndarray], p: Params) -> None:
    w, dw = arrays
    total, splits = int(p["total"]), int(p["splits"])
    sum_ = np.zeros(total, dw.dtype)
    for part in w[: splits * total].reshape(splits, total):  # in chunk order, as the shader's lane
        sum_ += part
    dw[:total] = sum_


def sgd(arrays: list[np.ndarray], p: Params) -> None:
    param, grad, momentum_buf, stepvals = arrays
    n = int(p["n"])
    dtype = param.dtype.type
    lr = dtype(stepvals[0])
    g = grad[:n] + dtype(p.get("weight_decay", 0.0)) * param[:n]
    momentum = dtype(p.get("momentum", 0.0))
    if momentum != 0:
        momentum_buf[:n] = momentum * momentum_buf[:n] + g
        g = g + momentum * momentum_buf[:n] if p.get("nesterov") else momentum_buf[:n].copy()
    param[:n] -= lr * g


def adam(arrays: list[np.ndarray], p: Params) -> None:
    param, grad, m, v, stepvals = arrays
    n = int(p["n"])
    dtype = param.dtype.type
    lr, bias1, bias2 = dtype(stepvals[0]), dtype(stepvals[1]), dtype(stepvals[2])
    beta1, beta2 = dtype(p["beta1"]), dtype(p["beta2"])
    decay = dtype(p.get("weight_decay", 0.0))
    g = grad[:n]
    if p.get("decoupled"):
        param[:n] *= dtype(1) - lr * decay
    else:
        g = g + decay * param[:n]
    m[:n] = beta1 * m[:n] + dtype(p["one_minus_beta1"]) * g
    v[:n] = beta2 * v[:n] + dtype(p["one_minus_beta2"]) * g * g
    denom = np.sqrt(v[:n] / bias2) + dtype(p["eps"])
    param[:n] -= lr * (m[:n] / bias1) / denom


def _clipped(update: Callable[..., None]) -> Callable[..., None]:
    """sgd_clip or adam_clip: the update on the gradients times clip[1] (grad_norm's factor)."""

    def kernel(arrays: list[np.ndarray], p: Params) -> None:
        *bound, clip = arrays
        if clip[2] != 0:  # loss scaling found the gradients overflowed: the step changes nothing
            return
        bound[1] = bound[1][: int(p["n"])] * clip[1]
        update(bound, p)

    return kernel


def _halved(update: Callable[..., None]) -> Callable[..., None]:
    """The _half variant of an update: the update, then H = the float16 copy of every parameter it
    updated, as cast.comp rounds it (a skipped step leaves P, so its copy, as it was)."""

    def kernel(arrays: list[np.ndarray], p: Params) -> None:
        *bound, halves = arrays
        update(bound, p)
        cast([bound[0], halves], {"n": p["n"], "mode": CASTS["f32_to_f16"]})

    return kernel


def grad_norm(arrays: list[np.ndarray], p: Params) -> None:
    x, y = arrays
    n, parts = int(p["n"]), int(p["parts"])
    values = x[:n].astype(np.float64)
    if parts:  # each workgroup's share, as grad_norm.comp strides (256 invocations a workgroup)
        y[:parts] = np.bincount(np.arange(n) // 256 % parts, values * values, minlength=parts)
        return
    dtype = y.dtype.type
    norm = dtype(np.sqrt(values.sum()))
    factor = dtype(p["max_norm"]) / (norm + dtype(1e-6))
    y[:3] = norm, factor if factor < 1 else 1, 0  # a NaN norm gives 1, as the shader's comparison


def loss_scale_apply(arrays: list[np.ndarray], p: Params) -> None:
    x, scale = arrays
    x[: int(p["n"])] *= scale[0]


def loss_scale_update(arrays: list[np.ndarray], p: Params) -> None:
    """loss_scale_update.comp: the partials' sum (float64, as grad_norm's), the clip values with
    the scale divided out, then the scale's state moved (flow.optim.LOSS_SCALE)."""
    x, state, y = arrays
    total = x[: int(p["n"])].astype(np.float64).sum()
    dtype = y.dtype.type
    scale = state[0]
    finite = bool(np.isfinite(total))
    with np.errstate(over="ignore", invalid="ignore"):
        norm = dtype(np.sqrt(total)) / scale
        factor = dtype(p["max_norm"]) / (norm + dtype(1e-6))
    y[:3] = norm, (factor if factor < 1 else dtype(1)) / scale, 0 if finite else 1
    if finite:
        grow = state[1] + 1 >= int(p["growth_interval"])
        state[:2] = (scale * 2 if grow and scale < 2.0**100 else scale), (0 if grow else state[1] + 1)
    else:
        state[:3] = scale / 2, 0, state[2] + 1


def fill(arrays: list[np.ndarray], p: Params) -> None:
    (x,) = arrays
    x[: int(p["n"])] = p["value"]


def copy(arrays: list[np.ndarray], p: Params) -> None:
    x, y = arrays
    # A word copy ignores element types, so copy the raw bytes (n elements of the source).
    nbytes = int(p["n"]) * x.dtype.itemsize
    y.view(np.uint8)[:nbytes] = x.view(np.uint8)[:nbytes]


def gather_rows(arrays: list[np.ndarray], p: Params) -> None:
    data, labels, idx, affine, x, y = arrays
    rows, row_elems, channel_elems = int(p["rows"]), int(p["row_elems"]), int(p["channel_elems"])
    picked = idx[:rows].astype(np.int64)
    samples = data.reshape(-1, row_elems)[picked].astype(np.float64)
    channels = np.arange(row_elems) // channel_elems
    # In float64 then rounded once, as the shader's fma rounds once.
    scaled = samples * affine[2 * channels].astype(np.float64) + affine[2 * channels + 1].astype(np.float64)
    x[: rows * row_elems] = scaled.reshape(-1)
    y[:rows] = labels[picked]


def cast(arrays: list[np.ndarray], p: Params) -> None:
    x, y = arrays
    n, mode = int(p["n"]), int(p["mode"])
    if mode == CASTS["f32_to_f16"] and x.dtype == np.float64:  # the backend's float64 precision
        y[:n] = x[:n].astype(np.float16)
    elif mode == CASTS["f32_to_f16"]:
        y.view(np.float16)[:n] = x.view(np.float32)[:n]
    elif mode == CASTS["f16_to_f32"]:
        y.view(np.float32)[:n] = x.view(np.float16)[:n]
    elif mode == CASTS["i32_to_f32"]:
        y.view(np.float32)[:n] = x.view(np.int32)[:n]
    elif mode == CASTS["f32_to_i32"]:
        # GLSL int(float) truncates toward zero, as numpy's astype does.
        y.view(np.int32)[:n] = x.view(np.float32)[:n].astype(np.int32)
    else:
        raise ValueError(f"unknown cast mode {mode}")


def argmax(arrays: list[np.ndarray], p: Params) -> None:
    x, out = arrays
    rows, cols = int(p["rows"]), int(p["cols"])
    out[:rows] = x[: rows * cols].reshape(rows, cols).argmax(axis=1)


def _f32(bits: int) -> np.float32:
    return np.uint32(bits).view(np.float32)


def _exp_neg(x: np.ndarray) -> np.ndarray:
    """sample_token.comp's exp_neg, the same float32 operations in the same order."""
    k = np.floor(x * _f32(0x3FB8AA3B) + np.float32(0.5))
    r = (x - k * _f32(0x3F317200)) - k * _f32(0x35BFBE8E)
    p = np.full_like(x, _f32(0x3AB60B61))
    for c in (0x3C088889, 0x3D2AAAAB, 0x3E2AAAAB, 0x3F000000, 0x3F800000, 0x3F800000):  # 1/5! .. 1/2, 1, 1
        p = p * r + _f32(c)
    return np.where(x < -87, np.float32(0), np.ldexp(p, np.maximum(k, -126).astype(np.int32)))


def sample_draw(logits: np.ndarray, top_k: int, seed: int, step: int, inv_temperature: float) -> int:
    """The id sample_token.comp draws, to the bit, from float32 ``logits`` [V] keeping the
    ``top_k`` largest (ties: lowest index first), with a uniform hashed from (``seed``, ``step``)."""
    bits = logits.view(np.uint32)
    keys = np.where(bits >> np.uint32(31), ~bits, bits | np.uint32(0x80000000))
    kept = np.zeros(len(logits), bool)
    kept[np.lexsort((np.arange(len(logits)), ~keys))[:top_k]] = True
    x = (logits - logits.max()) * np.float32(inv_temperature)
    weights = np.where(kept, _exp_neg(x), np.float32(0))
    running = np.cumsum(weights, dtype=np.float32)  # in index order, as the shader adds
    key = _pcg(_pcg(np.array([seed], np.uint32)) ^ np.uint32(step))
    draw = _pcg(_pcg(np.array([0], np.uint32)) ^ key)[0]
    target = np.float32(draw >> np.uint32(8)) * _f32(0x33800000) * running[-1]
    above = np.flatnonzero(running > target)
    # u * total can round up to total: the last token of nonzero weight takes that case.
    return int(above[0]) if above.size else int(np.flatnonzero(weights > 0)[-1])


def sample_token(arrays: list[np.ndarray], p: Params) -> None:
    logits, cursor, token = arrays
    v = int(p["cols"])
    row = logits[int(cursor[0]) * v : (int(cursor[0]) + 1) * v]
    token[0] = sample_draw(row, int(p["top_k"]), int(p["seed"]), int(cursor[1]), p["inv_temperature"])


def topk(arrays: list[np.ndarray], p: Params) -> None:
    """topk.comp: 1.0 for a real row whose label's logit has fewer than k strictly greater."""
    logits, labels, hits, stepvals = arrays
    rows, cols, per = int(p["rows"]), int(p["cols"]), max(int(p.get("per_sample", 1)), 1)
    n = _real_rows(stepvals, rows // per) * per
    matrix, target = logits[: n * cols].reshape(n, cols), labels[:n].astype(np.int64)
    valid = (target >= 0) & (target < cols)
    picked = matrix[np.arange(n), np.where(valid, target, 0)]
    with np.errstate(invalid="ignore"):
        hit = valid & ~np.isnan(picked) & ((matrix > picked[:, None]).sum(axis=1) < int(p["k"]))
    hits[:n], hits[n:rows] = hit, 0


KERNELS: dict[str, Callable[[list[np.ndarray], Params], None]] = {
    "gemm": gemm,
    "splitk_epilogue": splitk_epilogue,
    "gemm_coopmat": gemm_coopmat,
    "gemm_coopmat_f16": gemm_coopmat_f16,
    "gemm_coopmat_copy": gemm_coopmat_copy,
    "gemm_coopmat_half": _half_only(gemm_coopmat_copy, 3),
    "gemm_coopmat_copy_rte": gemm_coopmat_copy,  # numpy's bits, NaN payloads aside (FP16_ROUNDING_VARIANTS)
    "gemm_coopmat_half_rte": _half_only(gemm_coopmat_copy, 3),
    "gemm_copy": gemm_copy,
    "gemm_residual": _residual(gemm),
    "gemm_coopmat_residual": _residual(gemm_coopmat),
    "unary": unary,
    "unary_half": unary_half,
    "unary_backward": unary_backward,
    "binary": binary,
    "reduce": reduce,
    "softmax": softmax,
    "softmax_backward": softmax_backward,
    "softmax_xent": softmax_xent,
    "softmax_xent_totals": softmax_xent_totals,
    "mse": mse,
    "softmax_xent_general": softmax_xent_general,
    "class_weight_sum": class_weight_sum,
    "conv2d": conv2d,
    "conv2d_backward_data": conv2d_backward_data,
    "conv2d_backward_weight": conv2d_backward_weight,
    # The implicit-GEMM convolutions compute the direct ones' results.
    "conv2d_gemm": conv2d,
    "conv2d_gemm_backward_data": conv2d_backward_data,
    "conv2d_gemm_backward_weight": conv2d_gemm_backward_weight,
    "conv2d_gemm_coopmat": _fp16_operands(conv2d),
    "conv2d_gemm_coopmat_backward_data": _fp16_operands(conv2d_backward_data),
    "conv2d_gemm_coopmat_backward_weight": _fp16_operands(conv2d_gemm_backward_weight),
    "conv_splitk_sum": conv_splitk_sum,
    "channel_sum": channel_sum,
    "maxpool2d": maxpool2d,
    "maxpool2d_backward": maxpool2d_backward,
    "avgpool2d": avgpool2d,
    "avgpool2d_backward": avgpool2d_backward,
    "broadcast_rows": broadcast_rows,
    "copy_columns": copy_columns,
    "add_rows": add_rows,
    "bmm": bmm,
    "batchnorm_stats": batchnorm_stats,
    "batchnorm": batchnorm,
    "batchnorm_backward_reduce": batchnorm_backward_reduce,
    "batchnorm_backward_data": batchnorm_backward_data,
    "layernorm": layernorm,
    "layernorm_backward_reduce": layernorm_backward_reduce,
    "column_sum": column_sum,
    "column_sum_copy": column_sum_copy,
    "layernorm_backward_data": layernorm_backward_data,
    "layernorm_copy": _with_half_copy(layernorm, 3),
    "layernorm_half": _half_only(_with_half_copy(layernorm, 3), 3),
    "layernorm_backward_data_copy": _with_half_copy(layernorm_backward_data, 5),
    "unary_backward_copy": _with_half_copy(unary_backward, 2),
    "attention": attention,
    "attention_backward_dot": attention_backward_dot,
    "attention_backward_kv": attention_backward_kv,
    "attention_backward_q": attention_backward_q,
    "attention_coopmat": attention_coopmat,
    "attention_coopmat_backward_kv": attention_coopmat_backward_kv,
    "attention_coopmat_backward_q": attention_coopmat_backward_q,
    "attention_coopmat_half": _attention_half(attention_coopmat),
    "attention_coopmat_backward_kv_half": _attention_half(attention_coopmat_backward_kv),
    "attention_coopmat_backward_q_half": _attention_half(attention_coopmat_backward_q),
    "dropout": dropout,
    "embedding": embedding,
    "embedding_backward": embedding_backward,
    "embedding_chunk_sum": embedding_chunk_sum,
    "sgd": sgd,
    "adam": adam,
    "loss_scale_apply": loss_scale_apply,
    "loss_scale_update": loss_scale_update,
    "sgd_clip": _clipped(sgd),
    "adam_clip": _clipped(adam),
    "sgd_half": _halved(sgd),
    "adam_half": _halved(adam),
    "sgd_clip_half": _halved(_clipped(sgd)),
    "adam_clip_half": _halved(_clipped(adam)),
    "grad_norm": grad_norm,
    "fill": fill,
    "copy": copy,
    "gather_rows": gather_rows,
    "cast": cast,
    "argmax": argmax,
    "sample_token": sample_token,
    "topk": topk,
}

"""Element-wise, row-wise, reduction, optimiser and data-movement ops on every backend, checked
against oracles written here in float64 numpy (never actors.cpu_ops), and against torch (CPU,
float64) where it is installed.

Inputs are fresh random arrays from the ``rng`` fixture in odd sizes, so partial workgroups and
several workgroups are exercised; ``test_capped_groups`` caps the group count so every shader's
grid-stride or row-stride loop runs more than once.
"""

from __future__ import annotations

import math

import numpy as np
import oracles
import pytest
from conftest import assert_nans_match, relative_error

from actors.single_op import run_op
from shaders import registry
from shaders.registry import ACTIVATIONS, BINARY, CASTS, REDUCE, UNARY_EXTRA

try:
    import torch
except ImportError:  # torch is optional; the numpy oracle always runs
    torch = None

TOL = 1e-5
SIZES = [1, 7, 33, 257, 1000, 70001]
ACTS = ["none", "relu", "leaky_relu", "sigmoid", "tanh", "gelu"]
SLOPE = 0.1
_erf = oracles.erf


def f32(array) -> np.ndarray:
    return np.asarray(array, dtype=np.float32)


def straddling(rng, n: int, scale: float = 3.0) -> np.ndarray:
    """float32 values of both signs, none within 0.01 of 0 (kinks and finite differences)."""
    x = rng.standard_normal(n) * scale
    x = np.where(np.abs(x) < 0.01, np.copysign(0.01, x) + x, x)
    return f32(x)


# ---- float64 oracles ------------------------------------------------------------------------


def oracle_act(x: np.ndarray, name: str) -> np.ndarray:
    return oracles.activation(x, name, SLOPE)


def oracle_act_derivative(x: np.ndarray, name: str) -> np.ndarray:
    """f'(x) in terms of the forward INPUT x."""
    x = np.asarray(x, dtype=np.float64)
    if name == "none":
        return np.ones_like(x)
    if name == "relu":
        return (x > 0).astype(np.float64)
    if name == "leaky_relu":
        return np.where(x > 0, 1.0, SLOPE)
    if name == "sigmoid":
        s = 1.0 / (1.0 + np.exp(-x))
        return s * (1.0 - s)
    if name == "tanh":
        return 1.0 - np.tanh(x) ** 2
    if name == "gelu":
        return 0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    raise AssertionError(name)


def oracle_derivative_from_saved(saved: np.ndarray, name: str) -> np.ndarray:
    """f' from the saved tensor, as unary_backward defines it: the forward output for relu,
    leaky_relu, sigmoid and tanh, the forward input for gelu."""
    s = np.asarray(saved, dtype=np.float64)
    if name == "sigmoid":
        return s * (1.0 - s)
    if name == "tanh":
        return 1.0 - s * s
    if name in ("relu", "leaky_relu"):
        return np.where(s > 0, 1.0, SLOPE if name == "leaky_relu" else 0.0)
    return oracle_act_derivative(s, name)  # none, gelu


def torch_act(x, name: str):
    functional = torch.nn.functional
    return {
        "none": lambda v: v,
        "relu": functional.relu,
        "leaky_relu": lambda v: functional.leaky_relu(v, SLOPE),
        "sigmoid": torch.sigmoid,
        "tanh": torch.tanh,
        "gelu": lambda v: functional.gelu(v, approximate="none"),
    }[name](x)


def oracle_log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    shifted = x - x.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def run(backend, op: str, bindings: dict[str, np.ndarray], **params) -> dict[str, np.ndarray]:
    return run_op(backend, op, bindings, **params)


def check(actual, expected, tol: float = TOL, what: str = "", floor: float = 0.0) -> float:
    """Assert ||actual - expected|| <= tol * max(||expected||, floor); returns the error."""
    error = relative_error(actual, expected)
    norm = float(np.linalg.norm(np.asarray(expected, dtype=np.float64)))
    if floor > norm > 0:
        error *= norm / floor
    assert error <= tol, f"{what} relative error {error:.3g} > {tol:.3g}"
    return error


def tail_floor(backend, name: str, reference: np.ndarray) -> float:
    """The numpy backend computes gelu's 1 + erf(x / sqrt 2) in float32, which cancels in the
    lower tail (absolute error ~6e-8 * |x|, and exactly 0 below x ~ -5.5), so for it alone
    errors are measured against the scale of the input instead of the tiny output."""
    if backend.facts.kind == "cpu" and name == "gelu":
        return float(np.linalg.norm(np.asarray(reference, dtype=np.float64)))
    return 0.0


# ---- unary ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", ACTS)
def test_activation_forward(backend, rng, name, n):
    x = straddling(rng, n)
    out = run(
        backend,
        "unary",
        {"X": x, "Y": f32(rng.standard_normal(n))},
        n=n,
        fn=ACTIVATIONS[name],
        a=SLOPE if name == "leaky_relu" else 0.0,
        b=0.0,
    )
    floor = tail_floor(backend, name, x)
    check(out["Y"], oracle_act(x, name), what=name, floor=floor)
    np.testing.assert_array_equal(out["X"], x)
    if torch is not None:
        reference = torch_act(torch.from_numpy(x.astype(np.float64)), name).numpy()
        check(out["Y"], reference, what=f"torch {name}", floor=floor)


@pytest.mark.parametrize("n", [1, 33, 1000, 70001])
@pytest.mark.parametrize("name", ["scale_shift", "copy", "exp"])
def test_unary_extra(backend, rng, name, n):
    x = f32(rng.uniform(-5, 5, n))
    a, b = 1.7, -0.3
    out = run(backend, "unary", {"X": x, "Y": np.zeros(n, np.float32)}, n=n, fn=UNARY_EXTRA[name], a=a, b=b)
    x64 = x.astype(np.float64)
    expected = {"scale_shift": x64 * a + b, "copy": x64, "exp": np.exp(x64)}[name]
    check(out["Y"], expected, what=name)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", ACTS)
def test_activation_backward(backend, rng, name, n):
    x = straddling(rng, n)
    dy = f32(rng.standard_normal(n))
    # The saved tensor is the forward output, except for gelu (its input), as the op defines.
    saved = x if name == "gelu" else f32(oracle_act(x, name))
    out = run(
        backend,
        "unary_backward",
        {"dY": dy, "S": saved, "dX": np.zeros(n, np.float32)},
        n=n,
        fn=ACTIVATIONS[name],
        a=SLOPE if name == "leaky_relu" else 0.0,
        b=0.0,
    )
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    # The op's contract: f' recovered from the float32 saved tensor, evaluated in float64. The
    # floor (an absolute 1e-7 |dY|) allows the rounding of 1 - s*s in float32 at saturation.
    contract = dy64 * oracle_derivative_from_saved(saved.astype(np.float64), name)
    floor = max(0.01 * float(np.linalg.norm(dy64)), tail_floor(backend, name, dy))
    check(out["dX"], contract, what=f"{name} vs f'(saved)", floor=floor)
    # The math: f'(x) analytically, and by central differences of the float64 forward oracle
    # (which also validates the analytic oracle). f' recovered from a float32 output carries
    # absolute error ~1e-7 where tanh and sigmoid saturate, so these use a floor of 0.1 |dY|.
    analytic = oracle_act_derivative(x64, name)
    h = 1e-6
    finite = (oracle_act(x64 + h, name) - oracle_act(x64 - h, name)) / (2 * h)
    np.testing.assert_allclose(finite, analytic, rtol=1e-6, atol=1e-9)
    floor = max(0.1 * float(np.linalg.norm(dy64)), tail_floor(backend, name, dy))
    check(out["dX"], dy64 * analytic, what=f"{name} vs analytic", floor=floor)
    check(out["dX"], dy64 * finite, what=f"{name} vs finite differences", floor=floor)
    if torch is not None:
        tx = torch.from_numpy(x64).requires_grad_(True)
        torch_act(tx, name).backward(torch.from_numpy(dy64))
        check(out["dX"], tx.grad.numpy(), what=f"torch {name}", floor=floor)


def test_erf_accuracy_through_gelu(backend):
    """GLSL has no erf: the shader's own must stay within ~1.5e-7 absolute; checked densely
    through gelu, whose value is x * Phi(x)."""
    x = f32(np.linspace(-7, 7, 20001))
    out = run(
        backend, "unary", {"X": x, "Y": np.zeros_like(x)}, n=x.size, fn=ACTIVATIONS["gelu"], a=0.0, b=0.0
    )
    x64 = x.astype(np.float64)
    nonzero = np.abs(x64) > 1e-3
    phi = out["Y"][nonzero] / x64[nonzero]
    erf_implied = 2 * phi - 1
    assert np.max(np.abs(erf_implied - _erf(x64[nonzero] / math.sqrt(2)))) < 1.5e-7 * 2


# ---- binary ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", ["add", "sub", "mul"])
def test_binary(backend, rng, name, n):
    x, y = f32(rng.standard_normal(n)), f32(rng.standard_normal(n))
    scale = -0.75
    out = run(
        backend,
        "binary",
        {"X": x, "Y": y, "Z": np.zeros(n, np.float32)},
        n=n,
        fn=BINARY[name],
        a=scale,
        b=0.0,
    )
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    expected = {"add": x64 + y64, "sub": x64 - y64, "mul": x64 * y64}[name] * scale
    check(out["Z"], expected, what=name)


# ---- reduce ---------------------------------------------------------------------------------

REDUCE_SHAPES = [(1, 1), (7, 33), (257, 3), (3, 1000), (8192, 10), (10, 4099)]


@pytest.mark.parametrize("shape", REDUCE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("name", ["sum", "mean", "max"])
def test_reduce(backend, rng, name, axis, shape):
    rows, cols = shape
    x = f32(rng.standard_normal(shape) + 0.5)
    alpha = 0.5
    out_len = cols if axis == 0 else rows
    out = run(
        backend,
        "reduce",
        {"X": x, "Y": np.zeros(out_len, np.float32)},
        rows=rows,
        cols=cols,
        axis=axis,
        fn=REDUCE[name],
        alpha=alpha,
    )
    x64 = x.astype(np.float64)
    expected = {"sum": np.sum, "mean": np.mean, "max": np.max}[name](x64, axis=axis) * alpha
    check(out["Y"], expected, what=f"{name} axis {axis}")


def test_reduce_sum_accuracy_tall(backend, rng):
    """Bias gradients sum a batch of 8192 rows of same-signed values: the shader's compensated
    partial sums must stay close to the float64 sum element by element, not just in norm."""
    rows, cols = 8192, 5
    x = f32(1000.0 + rng.standard_normal((rows, cols)))
    out = run(
        backend,
        "reduce",
        {"X": x, "Y": np.zeros(cols, np.float32)},
        rows=rows,
        cols=cols,
        axis=0,
        fn=REDUCE["sum"],
        alpha=1.0,
    )
    expected = x.astype(np.float64).sum(axis=0)
    worst = np.max(np.abs(out["Y"] / expected - 1))
    # numpy sums axis 0 sequentially in float32 (about 2e-6 here); the shader must do far better.
    assert worst < (1e-5 if backend.facts.kind == "cpu" else 5e-7), worst


# ---- softmax and losses ---------------------------------------------------------------------

ROW_SHAPES = [(1, 1), (7, 33), (33, 257), (5, 1000), (300, 10)]


def logits_with_extremes(rng, rows: int, cols: int) -> np.ndarray:
    """Random logits where some rows sit near +100 or -100: exp overflows or underflows there
    unless the row max is subtracted first."""
    x = rng.standard_normal((rows, cols)) * 3
    x[::3] += 100.0
    x[1::5] -= 100.0
    return f32(x)


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("log", [0, 1])
def test_softmax(backend, rng, log, shape):
    rows, cols = shape
    x = logits_with_extremes(rng, rows, cols)
    out = run(backend, "softmax", {"X": x, "Y": np.zeros_like(x)}, rows=rows, cols=cols, log=log)
    expected = oracle_log_softmax(x)
    if not log:
        expected = np.exp(expected)
    assert np.all(np.isfinite(out["Y"]))
    check(out["Y"], expected, what="log-softmax" if log else "softmax")
    if torch is not None:
        tx = torch.from_numpy(x.astype(np.float64))
        reference = torch.log_softmax(tx, dim=1) if log else torch.softmax(tx, dim=1)
        check(out["Y"], reference.numpy(), what="torch")


def logits_and_labels_with_ties(rng, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Random logits with extremes and random labels; where there is room, rows 0 and 1 have tied
    maxima at columns 2 and 5 (the FIRST maximum is the prediction, as numpy's argmax decides),
    labelled 5 (wrong) and 2 (right)."""
    x = logits_with_extremes(rng, rows, cols)
    labels = rng.integers(0, cols, rows).astype(np.int32)
    if cols >= 6 and rows >= 2:
        x[0, :] = x[1, :] = -1.0
        x[0, 2] = x[0, 5] = x[1, 2] = x[1, 5] = 4.0
        labels[0], labels[1] = 5, 2
    return x, labels


def check_xent_dlogits(dlogits, log_probs, labels, real: int, sentinel, write_grad: int) -> None:
    """With write_grad, dlogits = (softmax - onehot) / real on the first ``real`` rows and 0 on
    the padding rows after them; without, the buffer is untouched."""
    if write_grad:
        rows, cols = log_probs.shape
        grad = np.exp(log_probs) / real
        grad[np.arange(rows), labels] -= 1.0 / real
        grad[real:] = 0.0
        check(dlogits.reshape(rows, cols), grad, what="dlogits")
    else:
        np.testing.assert_array_equal(dlogits, sentinel)


def real_rows(rng, rows: int, partial: bool) -> int:
    """How many of ``rows`` are real: all, or (``partial``) a random 1..rows-1 where there is room."""
    return int(rng.integers(1, rows)) if partial and rows > 1 else rows


def step_values_for(real: int) -> np.ndarray:
    """A slot's stepvals with only the real row count set (the loss kernels read nothing else)."""
    return f32([0.0, 1.0, 1.0, 0.0, real])


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("write_grad", [0, 1])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_softmax_xent(backend, rng, write_grad, shape, partial):
    """Row losses pre-divided by the real rows (their sum is the mean), correct flags and dlogits;
    padding rows past the real ones get 0 everywhere."""
    rows, cols = shape
    real = real_rows(rng, rows, partial)
    x, labels = logits_and_labels_with_ties(rng, rows, cols)
    sentinel = f32(rng.standard_normal(rows * cols))
    out = run(
        backend,
        "softmax_xent",
        {
            "logits": x.reshape(-1),
            "labels": labels,
            "loss_rows": f32(rng.standard_normal(rows)),
            "correct_rows": np.full(rows, 7, np.float32),
            "dlogits": sentinel,
            "stepvals": step_values_for(real),
        },
        rows=rows,
        cols=cols,
        write_grad=write_grad,
    )
    log_probs = oracle_log_softmax(x)
    picked = log_probs[np.arange(rows), labels]
    expected_loss = np.where(np.arange(rows) < real, -picked / real, 0.0)
    check(out["loss_rows"], expected_loss, what="loss")
    expected_correct = (np.argmax(x.astype(np.float64), axis=1) == labels) & (np.arange(rows) < real)
    np.testing.assert_array_equal(out["correct_rows"], expected_correct.astype(np.float32))
    if cols >= 6 and real >= 2:
        assert out["correct_rows"][0] == 0 and out["correct_rows"][1] == 1
    check_xent_dlogits(out["dlogits"], log_probs, labels, real, sentinel, write_grad)
    if torch is not None:
        tx = torch.from_numpy(x[:real].astype(np.float64)).requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(
            tx, torch.from_numpy(labels[:real].astype(np.int64)), reduction="none"
        )
        check(out["loss_rows"][:real] * real, loss.detach().numpy(), what="torch loss")
        if write_grad:
            loss.mean().backward()
            check(out["dlogits"].reshape(rows, cols)[:real], tx.grad.numpy(), what="torch dlogits")


@pytest.mark.parametrize(
    "shape", [(1, 1), (3, 10), (256, 10), (257, 7), (1000, 32)], ids=lambda s: f"{s[0]}x{s[1]}"
)
@pytest.mark.parametrize("write_grad", [0, 1])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_softmax_xent_totals(backend, rng, write_grad, shape, partial):
    """Narrow logits: the rows, the mean loss and the count of right rows over the real rows in one
    launch (more rows than the workgroup's 256 invocations loop; ties pick the first maximum)."""
    rows, cols = shape
    real = real_rows(rng, rows, partial)
    x, labels = logits_and_labels_with_ties(rng, rows, cols)
    sentinel = f32(rng.standard_normal(rows * cols))
    out = run(
        backend,
        "softmax_xent_totals",
        {
            "logits": x.reshape(-1),
            "labels": labels,
            "loss": f32([7.0]),
            "correct": f32([-3.0]),
            "dlogits": sentinel,
            "stepvals": step_values_for(real),
        },
        rows=rows,
        cols=cols,
        write_grad=write_grad,
    )
    log_probs = oracle_log_softmax(x)
    picked = log_probs[np.arange(real), labels[:real]]
    check(out["loss"], np.array([-picked.mean()]), what="mean loss")
    expected_correct = int((np.argmax(x[:real].astype(np.float64), axis=1) == labels[:real]).sum())
    assert out["correct"][0] == expected_correct
    check_xent_dlogits(out["dlogits"], log_probs, labels, real, sentinel, write_grad)
    if torch is not None:
        tx = torch.from_numpy(x[:real].astype(np.float64))
        loss = torch.nn.functional.cross_entropy(tx, torch.from_numpy(labels[:real].astype(np.int64)))
        check(out["loss"], np.array([loss.item()]), what="torch loss")


def test_softmax_xent_totals_bad_label_gives_nan_loss(backend):
    """A label outside [0, cols) poisons the total loss (NaN) and counts as wrong, as in softmax_xent;
    a bad label on a padding row is ignored."""
    x = f32([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [1.0, 3.0, 2.0]])
    labels = np.array([2, 3, -5], np.int32)
    tensors = {"logits": x.reshape(-1), "labels": labels, "loss": f32([0.5]), "correct": f32([9.0]),
               "dlogits": f32(np.ones(9))}  # fmt: skip
    out = run(backend, "softmax_xent_totals", {**tensors, "stepvals": step_values_for(2)},
              rows=3, cols=3, write_grad=0)  # fmt: skip
    assert np.isnan(out["loss"][0]) and out["correct"][0] == 1
    out = run(backend, "softmax_xent_totals", {**tensors, "stepvals": step_values_for(1)},
              rows=3, cols=3, write_grad=0)  # fmt: skip
    assert out["loss"][0] == pytest.approx(-oracle_log_softmax(x)[0, 2], rel=1e-6) and out["correct"][0] == 1


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("write_grad", [0, 1])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_mse(backend, rng, write_grad, shape, partial):
    """Row losses pre-divided by the real rows, dY = 2 (Y - T) / (real * cols); padding rows 0."""
    rows, cols = shape
    real = real_rows(rng, rows, partial)
    y, t = f32(rng.standard_normal(shape)), f32(rng.standard_normal(shape))
    sentinel = f32(rng.standard_normal(rows * cols))
    out = run(
        backend,
        "mse",
        {"Y": y, "T": t, "loss_rows": f32(rng.standard_normal(rows)), "dY": sentinel,
         "stepvals": step_values_for(real)},
        rows=rows,
        cols=cols,
        write_grad=write_grad,
    )  # fmt: skip
    diff = y.astype(np.float64) - t.astype(np.float64)
    diff[real:] = 0.0
    check(out["loss_rows"], (diff**2).mean(axis=1) / real, what="loss")
    if write_grad:
        check(out["dY"], (diff * 2.0 / (real * cols)).reshape(-1), what="dY")
    else:
        np.testing.assert_array_equal(out["dY"], sentinel)
    if torch is not None and write_grad:
        ty = torch.from_numpy(y[:real].astype(np.float64)).requires_grad_(True)
        torch.nn.functional.mse_loss(ty, torch.from_numpy(t[:real].astype(np.float64))).backward()
        check(out["dY"].reshape(rows, cols)[:real], ty.grad.numpy(), what="torch dY")


@pytest.mark.parametrize(
    "shape", [(1, 1), (7, 33), (33, 257), (4, 1000), (500, 3)], ids=lambda s: f"{s[0]}x{s[1]}"
)
def test_argmax(backend, rng, shape):
    rows, cols = shape
    x = f32(rng.integers(-3, 4, shape))  # few distinct values: ties everywhere
    out = run(backend, "argmax", {"X": x, "out": np.full(rows, -5, np.int32)}, rows=rows, cols=cols)
    np.testing.assert_array_equal(out["out"], np.argmax(x.astype(np.float64), axis=1))


def test_argmax_nan_counts_as_max(backend):
    x = f32([[1.0, np.nan, 5.0, np.nan], [2.0, 3.0, 3.0, -1.0]])
    out = run(backend, "argmax", {"X": x, "out": np.zeros(2, np.int32)}, rows=2, cols=4)
    np.testing.assert_array_equal(out["out"], [1, 1])


# ---- optimisers -----------------------------------------------------------------------------

OPT_N = 1001


def torch_trajectory(make_optimizer, p0: np.ndarray, grads: list[np.ndarray], lrs: list[float]) -> np.ndarray:
    """torch.optim in float64 from p0, one step per (grad, lr)."""
    param = torch.nn.Parameter(torch.from_numpy(p0.astype(np.float64)))
    optimizer = make_optimizer([param])
    for g, lr in zip(grads, lrs, strict=True):
        optimizer.param_groups[0]["lr"] = lr
        param.grad = torch.from_numpy(g.astype(np.float64))
        optimizer.step()
    return param.detach().numpy()


SGD_CASES = [(0.0, 0, 0.0), (0.0, 0, 1e-2), (0.9, 0, 0.0), (0.9, 1, 0.0), (0.9, 1, 1e-2), (0.5, 0, 1e-2)]


@pytest.mark.parametrize("momentum,nesterov,weight_decay", SGD_CASES)
def test_sgd(backend, rng, momentum, nesterov, weight_decay):
    p0 = f32(rng.standard_normal(OPT_N))
    grads = [f32(rng.standard_normal(OPT_N)) for _ in range(3)]
    lrs = [0.1, 0.05, 0.02]
    p, m = p0, np.zeros(OPT_N, np.float32)
    # PyTorch's SGD formula (dampening 0), by hand in float64.
    p64, m64 = p0.astype(np.float64), np.zeros(OPT_N)
    for g, lr in zip(grads, lrs, strict=True):
        out = run(
            backend,
            "sgd",
            {"P": p, "G": g, "M": m, "stepvals": f32([lr, 0.0, 0.0, 0.0])},
            n=OPT_N,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
        )
        p, m = out["P"], out["M"]
        d = g.astype(np.float64) + weight_decay * p64
        if momentum:
            m64 = momentum * m64 + d
            d = d + momentum * m64 if nesterov else m64
        p64 = p64 - lr * d
        check(p, p64, what="param")
        if momentum:
            check(m, m64, what="momentum buffer")
        else:
            np.testing.assert_array_equal(m, 0)
    if torch is not None:
        reference = torch_trajectory(
            lambda params: torch.optim.SGD(
                params, lr=lrs[0], momentum=momentum, nesterov=bool(nesterov), weight_decay=weight_decay
            ),
            p0,
            grads,
            lrs,
        )
        check(p, reference, what="torch.optim.SGD")


ADAM_CASES = [(0.0, 0), (1e-2, 0), (1e-2, 1), (0.1, 1)]


@pytest.mark.parametrize("weight_decay,decoupled", ADAM_CASES)
def test_adam(backend, rng, weight_decay, decoupled):
    # Push constants are float32: the device sees float32(0.999) and the 1 - beta values it is
    # given; the oracle and torch use exactly those (a plan passes 1 - beta from double, as torch).
    beta1, beta2, eps = float(np.float32(0.9)), float(np.float32(0.999)), 1e-8
    p0 = f32(rng.standard_normal(OPT_N))
    grads = [f32(rng.standard_normal(OPT_N) * 0.1) for _ in range(4)]
    lrs = [1e-2, 5e-3, 2e-3, 1e-3]
    p, m, v = p0, np.zeros(OPT_N, np.float32), np.zeros(OPT_N, np.float32)
    p64, m64, v64 = p0.astype(np.float64), np.zeros(OPT_N), np.zeros(OPT_N)
    for t, (g, lr) in enumerate(zip(grads, lrs, strict=True), start=1):
        stepvals = f32([lr, 1 - beta1**t, 1 - beta2**t, t])
        out = run(
            backend,
            "adam",
            {"P": p, "G": g, "M": m, "V": v, "stepvals": stepvals},
            n=OPT_N,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            decoupled=decoupled,
            one_minus_beta1=1 - beta1,
            one_minus_beta2=1 - beta2,
        )
        p, m, v = out["P"], out["M"], out["V"]
        # PyTorch's Adam / AdamW formulas, by hand in float64.
        d = g.astype(np.float64)
        if decoupled:
            p64 = p64 * (1 - lr * weight_decay)
        else:
            d = d + weight_decay * p64
        m64 = beta1 * m64 + (1 - beta1) * d
        v64 = beta2 * v64 + (1 - beta2) * d * d
        p64 = p64 - (lr / (1 - beta1**t)) * m64 / (np.sqrt(v64) / math.sqrt(1 - beta2**t) + eps)
        check(p, p64, what=f"param step {t}")
        check(m, m64, what=f"m step {t}")
        check(v, v64, what=f"v step {t}")
    if torch is not None:
        kind = torch.optim.AdamW if decoupled else torch.optim.Adam
        reference = torch_trajectory(
            lambda params: kind(params, lr=lrs[0], betas=(beta1, beta2), eps=eps, weight_decay=weight_decay),
            p0,
            grads,
            lrs,
        )
        check(p, reference, what=kind.__name__)


# ---- fill, copy, cast -----------------------------------------------------------------------

ODD_SIZES = [1, 7, 33, 1001, 70001]


@pytest.mark.parametrize("n", ODD_SIZES)
def test_fill(backend, rng, n):
    x = f32(rng.standard_normal(n + 3))
    value = float(np.float32(rng.standard_normal()))
    out = run(backend, "fill", {"X": x}, n=n, value=value)
    np.testing.assert_array_equal(out["X"][:n], np.float32(value))
    np.testing.assert_array_equal(out["X"][n:], x[n:])


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("n", ODD_SIZES)
def test_copy(backend, rng, n, dtype):
    bits = rng.integers(0, 2**32, n + 3, dtype=np.uint64).astype(np.uint32)
    bits[:3] = [0x80000000, 0x7FC00001, 0xFF800000][: min(3, n + 3)]  # -0.0, a NaN payload, -inf
    x = bits.view(dtype)
    y = rng.integers(0, 2**32, n + 3, dtype=np.uint64).astype(np.uint32).view(dtype)
    out = run(backend, "copy", {"X": x, "Y": y}, n=n)
    result = out["Y"].view(np.uint32)
    np.testing.assert_array_equal(result[:n], bits[:n])
    np.testing.assert_array_equal(result[n:], y.view(np.uint32)[n:])


HALF_EDGES = [
    0.0,
    -0.0,
    1.0,
    -2.5,
    65504.0,
    65519.99,
    65520.0,
    -65520.0,
    1e6,
    np.inf,
    -np.inf,
    1 + 2**-11,
    1 + 3 * 2**-11,
    -(1 + 2**-11),  # ties round to even
    2**-24,
    2**-25,
    3 * 2**-25,
    2**-26,
    2**-14,
    2**-14 * (1 - 2**-12),
    6.1e-5,
    1e-7,
    -3e-6,  # subnormal halves
    1e-40,
    2048.5,
    3e-5,
]


@pytest.mark.parametrize("n", ODD_SIZES)
def test_cast_f32_to_f16(backend, rng, n):
    x = rng.standard_normal(n) * rng.choice([1e-6, 1e-3, 1.0, 1e3, 1e4], n)
    x[: min(n, len(HALF_EDGES))] = HALF_EDGES[: min(n, len(HALF_EDGES))]
    x = f32(x)
    y = np.full(n, 7.0, np.float16)
    with np.errstate(over="ignore"):  # the numpy backend warns on values that round to inf
        out = run(backend, "cast", {"X": x, "Y": y}, n=n, mode=CASTS["f32_to_f16"])
    assert out["Y"].dtype == np.float16
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16)  # IEEE round to nearest even, subnormals kept
    np.testing.assert_array_equal(out["Y"].view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("n", ODD_SIZES)
def test_cast_f16_to_f32(backend, rng, n):
    bits = rng.integers(0, 2**16, n).astype(np.uint16)
    nan = (bits & 0x7C00) == 0x7C00
    bits[nan] &= 0xFC00  # NaN patterns become +-inf: NaN payloads are not part of the contract
    bits[: min(n, 4)] = [0x0001, 0x8000, 0x03FF, 0x7BFF][: min(n, 4)]
    x = bits.view(np.float16)
    out = run(backend, "cast", {"X": x, "Y": np.zeros(n, np.float32)}, n=n, mode=CASTS["f16_to_f32"])
    np.testing.assert_array_equal(out["Y"].view(np.uint32), x.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("n", ODD_SIZES)
def test_cast_i32_to_f32(backend, rng, n):
    x = rng.integers(-(2**31), 2**31, n).astype(np.int32)
    x[: min(n, 4)] = [2**24 + 1, 2**24 + 3, -(2**31), 2**31 - 1][: min(n, 4)]  # round to nearest even
    out = run(backend, "cast", {"X": x, "Y": np.zeros(n, np.float32)}, n=n, mode=CASTS["i32_to_f32"])
    np.testing.assert_array_equal(out["Y"], x.astype(np.float64).astype(np.float32))


@pytest.mark.parametrize("n", ODD_SIZES)
def test_cast_f32_to_i32(backend, rng, n):
    x = rng.uniform(-(2**30), 2**30, n) * rng.choice([1e-9, 1e-6, 1.0], n)
    x[: min(n, 5)] = [-1.5, -0.999, 0.999, 2.5, -(2.0**31)][: min(n, 5)]
    x = f32(x)
    out = run(backend, "cast", {"X": x, "Y": np.zeros(n, np.int32)}, n=n, mode=CASTS["f32_to_i32"])
    np.testing.assert_array_equal(out["Y"], np.trunc(x.astype(np.float64)).astype(np.int32))


# ---- capped group counts ---------------------------------------------------------------------


def test_capped_groups(backend, rng, monkeypatch):
    """Large tensors need more workgroups than the registry launches (it caps at MAX_GROUPS), so
    each shader loops: elements with a grid stride, rows and outputs with gl_NumWorkGroups. Capping
    at 2 groups makes small tensors take those loops many times on any device."""
    monkeypatch.setattr(registry, "MAX_GROUPS", 2)
    assert registry.op("unary").groups({"n": 5001}, (256, 1, 1), {}) == (2, 1, 1)
    n, rows, cols = 5001, 37, 29
    x = straddling(rng, n)
    y = f32(rng.standard_normal(n))

    out = run(
        backend, "unary", {"X": x, "Y": np.zeros(n, np.float32)}, n=n, fn=ACTIVATIONS["gelu"], a=0.0, b=0.0
    )
    check(out["Y"], oracle_act(x, "gelu"), what="unary")
    out = run(
        backend,
        "unary_backward",
        {"dY": y, "S": x, "dX": np.zeros(n, np.float32)},
        n=n,
        fn=ACTIVATIONS["tanh"],
        a=0.0,
        b=0.0,
    )
    check(out["dX"], y * (1 - x.astype(np.float64) ** 2), what="unary_backward")
    out = run(
        backend, "binary", {"X": x, "Y": y, "Z": np.zeros(n, np.float32)}, n=n, fn=BINARY["mul"], a=2.0, b=0.0
    )
    check(out["Z"], 2.0 * x.astype(np.float64) * y, what="binary")
    out = run(backend, "fill", {"X": np.zeros(n, np.float32)}, n=n, value=3.0)
    np.testing.assert_array_equal(out["X"], 3.0)
    out = run(backend, "copy", {"X": x, "Y": np.zeros(n, np.float32)}, n=n)
    np.testing.assert_array_equal(out["Y"], x)
    out = run(backend, "cast", {"X": x, "Y": np.zeros(n, np.float16)}, n=n, mode=CASTS["f32_to_f16"])
    np.testing.assert_array_equal(out["Y"], x.astype(np.float16))
    out = run(
        backend,
        "sgd",
        {"P": x, "G": y, "M": np.zeros(n, np.float32), "stepvals": f32([0.5, 0, 0, 0])},
        n=n,
        momentum=0.0,
        nesterov=0,
        weight_decay=0.0,
    )
    check(out["P"], x - 0.5 * y.astype(np.float64), what="sgd")
    b1, b2 = float(np.float32(0.9)), float(np.float32(0.999))
    out = run(
        backend,
        "adam",
        {"P": x, "G": y, "M": np.zeros(n, np.float32), "V": np.zeros(n, np.float32),
         "stepvals": f32([0.5, 1 - b1, 1 - b2, 1])},
        n=n, beta1=b1, beta2=b2, eps=1e-8, weight_decay=0.0, decoupled=0, one_minus_beta1=1 - b1,
        one_minus_beta2=1 - b2,
    )  # fmt: skip
    y64 = y.astype(np.float64)
    expected = x - 0.5 * y64 / (np.abs(y64) + 1e-8)  # step 1: m_hat = g, sqrt(v_hat) = |g|
    check(out["P"], expected, what="adam")

    matrix = f32(rng.standard_normal((rows, cols)))
    m64 = matrix.astype(np.float64)
    for axis in (0, 1):
        out = run(
            backend,
            "reduce",
            {"X": matrix, "Y": np.zeros(max(rows, cols), np.float32)},
            rows=rows,
            cols=cols,
            axis=axis,
            fn=REDUCE["sum"],
            alpha=1.0,
        )
        check(out["Y"][: m64.shape[1 - axis]], m64.sum(axis=axis), what=f"reduce axis {axis}")
    out = run(backend, "softmax", {"X": matrix, "Y": np.zeros_like(matrix)}, rows=rows, cols=cols, log=1)
    check(out["Y"], oracle_log_softmax(matrix), what="softmax")
    labels = rng.integers(0, cols, rows).astype(np.int32)
    out = run(
        backend,
        "softmax_xent",
        {
            "logits": matrix,
            "labels": labels,
            "loss_rows": np.zeros(rows, np.float32),
            "correct_rows": np.zeros(rows, np.float32),
            "dlogits": np.zeros_like(matrix),
            "stepvals": step_values_for(rows),
        },
        rows=rows,
        cols=cols,
        write_grad=1,
    )
    log_probs = oracle_log_softmax(matrix)
    check(out["loss_rows"] * rows, -log_probs[np.arange(rows), labels], what="softmax_xent loss")
    np.testing.assert_array_equal(out["correct_rows"], np.argmax(matrix, axis=1) == labels)
    target = f32(rng.standard_normal((rows, cols)))
    out = run(
        backend,
        "mse",
        {"Y": matrix, "T": target, "loss_rows": np.zeros(rows, np.float32), "dY": np.zeros_like(matrix),
         "stepvals": step_values_for(rows)},
        rows=rows,
        cols=cols,
        write_grad=1,
    )  # fmt: skip
    check(out["loss_rows"] * rows, ((m64 - target) ** 2).mean(axis=1), what="mse")
    out = run(backend, "argmax", {"X": matrix, "out": np.zeros(rows, np.int32)}, rows=rows, cols=cols)
    np.testing.assert_array_equal(out["out"], np.argmax(matrix, axis=1))


def test_more_rows_than_max_groups(backend, rng):
    """Without a patched cap: 70001 rows need more than 65535 workgroups, so the row loop runs."""
    rows, cols = 70001, 3
    x = logits_with_extremes(rng, rows, cols)
    out = run(backend, "softmax", {"X": x, "Y": np.zeros_like(x)}, rows=rows, cols=cols, log=0)
    check(out["Y"], np.exp(oracle_log_softmax(x)), what="softmax")
    out = run(backend, "argmax", {"X": x, "out": np.zeros(rows, np.int32)}, rows=rows, cols=cols)
    np.testing.assert_array_equal(out["out"], np.argmax(x, axis=1))
    out = run(
        backend,
        "reduce",
        {"X": x, "Y": np.zeros(rows, np.float32)},
        rows=rows,
        cols=cols,
        axis=1,
        fn=REDUCE["max"],
        alpha=1.0,
    )
    np.testing.assert_array_equal(out["Y"], x.max(axis=1))


def test_elements_beyond_max_groups(backend, rng):
    """Without a patched cap: just over 65535 groups * 256 invocations (67 MB per tensor, about a
    second on lavapipe), so the real grid-stride loop takes a second lap."""
    n = registry.MAX_GROUPS * 256 + 1001
    x = np.full(n + 3, -1.0, np.float32)
    value = float(np.float32(rng.uniform(1, 2)))
    filled = run(backend, "fill", {"X": x}, n=n, value=value)["X"]
    assert np.all(filled[:n] == np.float32(value)) and np.all(filled[n:] == -1.0)
    filled[n - 5 : n] = f32(rng.standard_normal(5))
    out = run(backend, "unary", {"X": filled, "Y": x}, n=n, fn=UNARY_EXTRA["scale_shift"], a=2.0, b=0.5)["Y"]
    assert np.all(out[: n - 5] == np.float32(2 * value + 0.5)) and np.all(out[n:] == -1.0)
    check(out[n - 5 : n], filled[n - 5 : n].astype(np.float64) * 2 + 0.5, what="tail")


@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 3), (33, 257), (5, 1000)])
@pytest.mark.parametrize("log", [0, 1])
def test_softmax_backward_matches_the_jacobian(backend, rng, rows, cols, log):
    x = rng.standard_normal((rows, cols)) * 3
    dy = rng.standard_normal((rows, cols))
    shifted = x - x.max(axis=1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    y = np.log(probs) if log else probs
    # The oracle applies each row's full Jacobian: d softmax_i / d x_j = p_i (delta_ij - p_j);
    # d log_softmax_i / d x_j = delta_ij - p_j. dX = J^T dY.
    expected = np.empty_like(x)
    for r in range(rows):
        p = probs[r]
        jacobian = np.eye(cols) - p[None, :] if log else np.diag(p) - np.outer(p, p)
        expected[r] = jacobian.T @ dy[r]
    out = run_op(
        backend,
        "softmax_backward",
        {"Y": y.astype(np.float32), "dY": dy.astype(np.float32), "dX": np.zeros((rows, cols), np.float32)},
        rows=rows,
        cols=cols,
        log=log,
    )["dX"]
    assert relative_error(out, expected) <= 1e-5


# ---- NaN propagates as in numpy ---------------------------------------------------------------


def with_nans(rng, x: np.ndarray, fraction: float = 0.1) -> np.ndarray:
    """A copy of ``x`` with NaN at about ``fraction`` of random places (at least one)."""
    out = np.array(x, dtype=np.float32, copy=True)
    flat = out.reshape(-1)
    count = max(1, int(fraction * flat.size))
    flat[rng.choice(flat.size, size=count, replace=False)] = np.nan
    return out


@pytest.mark.parametrize("n", [7, 1000])
@pytest.mark.parametrize("name", ACTS)
def test_activations_propagate_nan(backend, rng, name, n):
    """GLSL max(NaN, 0.0) is undefined (lavapipe gives 0); every activation and its derivative
    must give NaN for NaN, as numpy does, and the numbers around them as usual."""
    x = with_nans(rng, straddling(rng, n))
    slope = SLOPE if name == "leaky_relu" else 0.0
    y = run(backend, "unary", {"X": x, "Y": f32(rng.standard_normal(n))}, n=n, fn=ACTIVATIONS[name], a=slope)
    assert_nans_match(y["Y"], oracle_act(x, name), tol=TOL)

    dy = f32(rng.standard_normal(n))
    saved = x if name == "gelu" else f32(oracle_act(x, name))
    bindings = {"dY": dy, "S": saved, "dX": np.zeros(n, np.float32)}
    dx = run(backend, "unary_backward", bindings, n=n, fn=ACTIVATIONS[name], a=slope)["dX"]
    if name == "none":  # the identity's derivative is 1 whatever the input
        assert np.isfinite(dx).all()
        check(dx, dy.astype(np.float64), what="none")
        return
    # f' at NaN is NaN: relu's and leaky_relu's comparisons would say 0 or slope and hide it.
    s64 = saved.astype(np.float64)
    derivative = np.where(np.isnan(s64), np.nan, oracle_derivative_from_saved(np.nan_to_num(s64), name))
    assert_nans_match(dx, dy.astype(np.float64) * derivative, tol=TOL)


@pytest.mark.parametrize("log", [0, 1])
def test_softmax_row_with_nan_is_nan(backend, rng, log):
    rows, cols = 9, 37
    x = logits_with_extremes(rng, rows, cols)
    x[[1, 6], rng.integers(0, cols, 2)] = np.nan
    out = run(backend, "softmax", {"X": x, "Y": np.zeros_like(x)}, rows=rows, cols=cols, log=log)["Y"]
    expected = oracle_log_softmax(x)  # numpy's row max is NaN for those rows: all NaN
    assert_nans_match(out, expected if log else np.exp(expected))
    assert np.isnan(out[[1, 6]]).all()


@pytest.mark.parametrize("axis", [0, 1])
def test_max_reduce_keeps_nan(backend, rng, axis):
    rows, cols = 33, 257  # several invocations per output: the tree joins partial maxima
    x = f32(rng.standard_normal((rows, cols)))
    x[rng.integers(0, rows, 3), rng.integers(0, cols, 3)] = np.nan
    out_len = cols if axis == 0 else rows
    bindings = {"X": x, "Y": np.zeros(out_len, np.float32)}
    out = run(backend, "reduce", bindings, rows=rows, cols=cols, axis=axis, fn=REDUCE["max"], alpha=1.0)["Y"]
    assert_nans_match(out, np.max(x.astype(np.float64), axis=axis))


# ---------------------------------------------------------------------------------------------
# gather_rows: a batch from a dataset kept on the device


@pytest.mark.parametrize("stored", ["uint8", "float32"])
@pytest.mark.parametrize("shape", [(1, 5, 3), (3, 7, 5), (2, 1, 1)], ids=lambda s: "x".join(map(str, s)))
def test_gather_rows_picks_converts_and_preprocesses(backend, rng, stored, shape):
    """X[r] = D[idx[r]] * a_c + b_c per channel, Y[r] = labels[idx[r]], for the first ``rows``
    rows; repeated and unordered indices alike; the rows past them are left alone."""
    samples, rows, capacity = 37, 11, 13
    if stored == "uint8":
        data = rng.integers(0, 256, (samples, *shape)).astype(np.uint8)
    else:
        data = f32(rng.standard_normal((samples, *shape)))
    labels = rng.integers(0, 10, samples).astype(np.int32)
    idx = rng.integers(0, samples, capacity).astype(np.int32)
    channels = shape[0]
    scales, shifts = rng.uniform(0.5, 2.0, channels), rng.standard_normal(channels)
    affine = f32(np.stack([scales, shifts], axis=1).reshape(-1))
    sentinel_x = f32(rng.standard_normal((capacity, *shape)))
    out = run(
        backend,
        "gather_rows",
        {"D": data, "labels": labels, "idx": idx, "affine": affine, "X": sentinel_x.copy(),
         "Y": np.full(capacity, -7, np.int32)},
        rows=rows, row_elems=int(np.prod(shape)), channel_elems=int(np.prod(shape[1:])),
        bytes=int(stored == "uint8"),
    )  # fmt: skip
    a = affine[0::2].astype(np.float64).reshape(channels, *(1,) * (len(shape) - 1))
    b = affine[1::2].astype(np.float64).reshape(channels, *(1,) * (len(shape) - 1))
    expected = data[idx[:rows]].astype(np.float64) * a + b
    check(out["X"][:rows], expected, what="gathered rows")
    np.testing.assert_array_equal(out["X"][rows:], sentinel_x[rows:])
    np.testing.assert_array_equal(out["Y"][:rows], labels[idx[:rows]])
    assert (out["Y"][rows:] == -7).all()

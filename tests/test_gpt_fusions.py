"""The char GPT's step, faster (issue 16, session 10): column sums sliced over rows (the bias and
LayerNorm parameter gradients) and a residual stream's gradient sum fused into the LayerNorm
input gradient.

column_sum and the sliced layernorm_backward_reduce, finished by conv_splitk_sum, and
layernorm_backward_data's accumulate, on every backend against float64 numpy with odd sizes
(columns that do not fill a workgroup, slices that do not divide the rows, a partial batch whose
padding rows must take no part); then the plans: a sequence model's bias and LayerNorm gradients go
through the sliced kernels, a residual GPT block's sums through the LayerNorm, and the gradients
match central differences of the loss and the float64 CPU backend on Vulkan.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_error
from layer_programs import (
    check_gradients_by_differences,
    layer_batch,
    layer_spec,
    nudged_parameters,
    run_train_program,
)
from specs import gpt_blocks
from test_layer_norm import layer_norm_oracle

from actors.cpu_backend import CpuBackend
from actors.single_op import run_op
from flow.autodiff import column_sum_parts
from flow.planning import plan
from flow.spec import (
    CrossEntropy,
    Embedding,
    LayerNorm,
    Linear,
    Model,
    PositionalEmbedding,
    SelfAttention,
)

TOL = 1e-5


def _forward_stats(backend, x, gamma, beta, dims):
    """The LayerNorm forward's per-row statistics (mean, 1/std) that the backward kernels read."""
    n, r = dims["N"], dims["R"]
    stats = np.zeros((n, 2 * r), np.float32)
    inputs = {"X": x, "gamma": gamma, "beta": beta, "Y": np.zeros_like(x), "stats": stats}
    return run_op(backend, "layernorm", inputs, **dims)["stats"]

# (rows, cols, parts, alpha): one row; fewer columns than a workgroup's 64; 64 + 3 columns; more
# slices than rows have (the last slices empty); slices that do not divide the rows; columns a
# multiple of 4 (16-byte loads), with slices of rows that are and are not multiples of 4 LANES.
SUM_CASES = [
    (1, 1, 1, 1.0),
    (37, 5, 1, 0.5),
    (300, 67, 7, 1.0),
    (9, 130, 16, 1.0),
    (1000, 129, 13, -2.0),
    (1031, 384, 5, 1.0),
    (128, 68, 1, 0.25),
]


@pytest.mark.parametrize("rows,cols,parts,alpha", SUM_CASES)
def test_column_sum_slices_and_their_sum_match_numpy(backend, rng, rows, cols, parts, alpha):
    x = (rng.standard_normal((rows, cols)) * 3.0 + 1.0).astype(np.float32)
    slices = run_op(
        backend, "column_sum", {"X": x, "outs": np.full((parts, cols), np.nan, np.float32)},
        rows=rows, cols=cols, parts=parts, alpha=alpha,
    )["outs"]  # fmt: skip
    per_part = -(-rows // parts)
    x64 = x.astype(np.float64)
    for part in range(parts):  # each slice on its own: an empty slice sums to 0
        expected = alpha * x64[part * per_part : (part + 1) * per_part].sum(axis=0)
        np.testing.assert_allclose(slices[part], expected, rtol=TOL, atol=TOL * np.abs(x64).sum(axis=0).max())
    total = run_op(
        backend, "conv_splitk_sum", {"W": slices, "dW": np.full(cols, np.nan, np.float32)},
        total=cols, splits=parts,
    )["dW"]  # fmt: skip
    assert relative_error(total, alpha * x64.sum(axis=0)) <= TOL


EVEN_SUM_CASES = [case for case in SUM_CASES if case[1] % 2 == 0] + [(513, 1152, 9, 1.0)]


@pytest.mark.parametrize("rows,cols,parts,alpha", EVEN_SUM_CASES)
def test_column_sum_copy_sums_as_column_sum_and_copies_x(backend, rng, rows, cols, parts, alpha):
    """column_sum_copy (the qkv bias's gradient in mixed plans, two columns an invocation): the
    same sums as column_sum, bit for bit (the same additions in the same order), and H numpy's
    astype(float16) of X, bit for bit, subnormal halves and overflow included."""
    x = (rng.standard_normal((rows, cols)) * 3.0 + 1.0).astype(np.float32)
    x[0, : cols // 2] *= 1e-6  # subnormal halves
    x[-1, -2:] = [7e4, -7e4]  # past the largest half
    empty = np.full((parts, cols), np.nan, np.float32)
    sizes = dict(rows=rows, cols=cols, parts=parts, alpha=alpha)
    plain = run_op(backend, "column_sum", {"X": x, "outs": empty}, **sizes)
    arrays = {"X": x, "outs": empty, "H": np.full(x.shape, np.nan, np.float16)}
    copy = run_op(backend, "column_sum_copy", arrays, **sizes)
    np.testing.assert_array_equal(copy["outs"].view(np.uint32), plain["outs"].view(np.uint32))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(copy["H"].view(np.uint16), x.astype(np.float16).view(np.uint16))


# (N, R, D, real samples, parts): slices across sample boundaries; D not a multiple of 64;
# padding samples whose rows fall in the last slices; D a multiple of 4 (16-byte loads).
NORM_CASES = [(6, 3, 5, 6, 4), (7, 3, 67, 2, 5), (30, 11, 13, 29, 9), (9, 17, 68, 7, 3), (5, 40, 384, 5, 2)]


@pytest.mark.parametrize("n,r,d,real,parts", NORM_CASES)
def test_sliced_layer_norm_parameter_gradients_match_numpy(backend, rng, n, r, d, real, parts):
    eps = 1e-5
    x = (rng.standard_normal((n, r, d)) * 3.0 + 2.0).astype(np.float32)
    x[real:] = 1e4 * rng.standard_normal(x[real:].shape)  # padding: must change nothing
    gamma, beta = rng.standard_normal(d).astype(np.float32), rng.standard_normal(d).astype(np.float32)
    dy = rng.standard_normal((n, r, d)).astype(np.float32)
    dy[real:] = 1e3
    dims = dict(N=n, R=r, D=d, eps=eps)
    stepvals = np.array([0.0, 1.0, 1.0, 1.0, real, real], np.float32)
    stats = _forward_stats(backend, x, gamma, beta, dims)
    sliced = run_op(
        backend, "layernorm_backward_reduce",
        {"dY": dy, "X": x, "stats": stats, "dgamma": np.full((parts, d), np.nan, np.float32),
         "dbeta": np.full((parts, d), np.nan, np.float32), "stepvals": stepvals},
        **dims, parts=parts,
    )  # fmt: skip
    _, _, dgamma_ref, dbeta_ref = layer_norm_oracle(x, gamma, beta, dy, real, eps)
    for name, expected in (("dgamma", dgamma_ref), ("dbeta", dbeta_ref)):
        total = run_op(
            backend, "conv_splitk_sum", {"W": sliced[name], "dW": np.full(d, np.nan, np.float32)},
            total=d, splits=parts,
        )["dW"]  # fmt: skip
        assert relative_error(total, expected) <= TOL, name


def test_parts_fill_a_gpu_and_keep_slices_long():
    assert column_sum_parts(16384, 384) == 171  # the char GPT's biases: 6 x 171 workgroups
    assert column_sum_parts(16384, 1536) == 43
    assert column_sum_parts(63, 1000) == 1  # too few rows to slice
    assert column_sum_parts(10**6, 64 * 2000) == 1  # columns alone fill the GPU
    for rows, cols in ((16384, 384), (200, 7), (5000, 3000)):
        parts = column_sum_parts(rows, cols)
        assert parts == 1 or rows // parts >= 64


SEQUENCE = Model(
    input_shape=(16,),
    layers=(
        Embedding(11, 8),
        PositionalEmbedding(),
        LayerNorm(),
        SelfAttention(2),
        LayerNorm(),
        Linear(12, activation="gelu"),
        Linear(11),
    ),
    loss=CrossEntropy(),
)


def test_a_sequence_model_sums_its_biases_in_slices():
    device = plan(layer_spec(SEQUENCE, batch=32)).devices[0]
    launches = device.program("train").launches
    sliced = [item for item in launches if item.op == "column_sum" and item.param("parts") > 1]
    norms = [item for item in launches if item.op == "layernorm_backward_reduce"]
    # 512 rows: the attention's two biases and the last Linear's (the GELU one's bias is fused
    # into its weight GEMM in fp32), each in 8 slices; both LayerNorms' gradients too.
    assert len(sliced) >= 3 and {item.param("parts") for item in sliced} == {8}
    assert [item.param("parts") for item in norms] == [8, 8]
    finishes = [item for item in launches if item.op == "conv_splitk_sum"]
    assert len(finishes) == len(sliced) + 2 * len(norms)
    assert not [item for item in launches if item.op == "reduce" and item.param("axis") == 0]


def test_sliced_gradients_match_central_differences(rng):
    check_gradients_by_differences(SEQUENCE, rng)  # 80 rows: one slice (the reference's ops)


def test_sliced_gradients_on_vulkan_match_float64_on_the_cpu(rng, vulkan_backend):
    """A plan for 32 samples (512 rows: 8 slices) with 29 real ones on Vulkan, against the float64
    CPU backend's plan for exactly the 29 (464 rows: 7 slices, summed in float64)."""
    rows, real = 32, 29
    full = plan(layer_spec(SEQUENCE, batch=rows)).devices[0]
    exact = plan(layer_spec(SEQUENCE, batch=real)).devices[0]
    params = {k: v.astype(np.float32) for k, v in nudged_parameters(full, rng).items()}
    x, y = layer_batch(SEQUENCE, rows, rng)
    x[real:] = 1e6  # ids far out of range on padding rows: they must take no part
    x = x.astype(np.float32)
    reference = CpuBackend(precision="float64")
    reference.open_layout(exact.layout)
    loss, grads, _ = run_train_program(exact, reference, params, x[:real], y[:real], real)
    vulkan_backend.open_layout(full.layout)
    got_loss, got, _ = run_train_program(full, vulkan_backend, params, x, y, real)
    assert got_loss == pytest.approx(loss, rel=1e-5)
    for name, value in grads.items():
        assert relative_error(got[name], value) <= 1e-4, name


@pytest.mark.parametrize("n,r,d,real", [(5, 3, 7, 5), (7, 2, 67, 4), (3, 1, 300, 3)])
def test_layer_norm_input_gradient_adds_the_other_gradient(backend, rng, n, r, d, real):
    eps = 1e-5
    x = (rng.standard_normal((n, r, d)) * 3.0 + 2.0).astype(np.float32)
    gamma = rng.standard_normal(d).astype(np.float32)
    dy = rng.standard_normal((n, r, d)).astype(np.float32)
    dy[real:] = 1e3
    addend = rng.standard_normal((n, r, d)).astype(np.float32)
    dims = dict(N=n, R=r, D=d, eps=eps)
    stepvals = np.array([0.0, 1.0, 1.0, 1.0, real, real], np.float32)
    stats = _forward_stats(backend, x, gamma, gamma, dims)
    dx = run_op(
        backend, "layernorm_backward_data",
        {"dY": dy, "X": x, "stats": stats, "gamma": gamma, "stepvals": stepvals,
         "dX": np.full_like(x, np.nan), "addend": addend},
        **dims, accumulate=1,
    )["dX"]  # fmt: skip
    _, dx_ref, _, _ = layer_norm_oracle(x, gamma, gamma, dy, real, eps)
    assert relative_error(dx[:real], addend[:real].astype(np.float64) + dx_ref) <= 1e-4
    np.testing.assert_array_equal(dx[real:], addend[real:])  # padding rows: the other gradient alone


BLOCKS = gpt_blocks(vocab=11, width=8, hidden=16, context=16)


def test_residual_blocks_sum_their_gradients_in_the_layer_norm():
    device = plan(layer_spec(BLOCKS, batch=8)).devices[0]
    launches = device.program("train").launches
    norms = [item for item in launches if item.op == "layernorm_backward_data"]
    adds = [item for item in launches if item.op == "binary"]
    # Every block's input gradient: the residual's pass-through plus the LayerNorm's, in one launch
    # (the embedding's output, the first block's input, too); the last LayerNorm's has one part.
    assert [item.param_dict.get("accumulate", 0) for item in norms] == [0, 1, 1, 1, 1]
    # No forward residual add: the attention's output projection and each MLP's last GEMM write
    # their block's sum themselves (gemm_residual).
    assert len(adds) == 0
    assert len([item for item in launches if item.op == "gemm_residual"]) == 4
    for item in norms[1:]:
        assert item.args[5] != item.args[6] and "@" not in item.args[5]
    names = [tensor.name for tensor in device.layout.tensors]
    assert not [name for name in names if "@" in name and name.startswith("grad:act")]


def test_fused_residual_gradients_match_central_differences(rng):
    check_gradients_by_differences(BLOCKS, rng)


def test_fused_residual_gradients_on_vulkan_match_float64_on_the_cpu(rng, vulkan_backend):
    full = plan(layer_spec(BLOCKS, batch=8)).devices[0]
    exact = plan(layer_spec(BLOCKS, batch=6)).devices[0]
    params = {k: v.astype(np.float32) for k, v in nudged_parameters(full, rng).items()}
    x, y = layer_batch(BLOCKS, 8, rng)
    x[6:] = 1e6
    x = x.astype(np.float32)
    reference = CpuBackend(precision="float64")
    reference.open_layout(exact.layout)
    loss, grads, _ = run_train_program(exact, reference, params, x[:6], y[:6], 6)
    vulkan_backend.open_layout(full.layout)
    got_loss, got, _ = run_train_program(full, vulkan_backend, params, x, y, 6)
    assert got_loss == pytest.approx(loss, rel=1e-5)
    for name, value in grads.items():
        assert relative_error(got[name], value) <= 1e-4, name

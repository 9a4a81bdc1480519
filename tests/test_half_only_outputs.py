"""Outputs no launch reads but as halves (issue 16, session 15): in mixed precision a LayerNorm or a
GEMM whose fp32 output every reader reads through its fp16 copy writes only the copy
(``layernorm_half``, ``gemm_coopmat_half``; flow.autodiff._write_halves_only): the char GPT's
LayerNorms and its qkv projection. Each variant writes the copy bit for bit as its ``_copy`` op
does and leaves the fp32 output as it was; plans choose it only where nothing reads that output;
and a mixed GPT trains bit for bit as without it."""

from __future__ import annotations

import numpy as np
import pytest
from layer_programs import layer_spec
from specs import gpt_blocks
from test_gelu_epilogue import _half_case, _mixed, _needs_coopmat, check_mixed_fusions_change_nothing

from actors.single_op import run_op
from flow import autodiff
from flow.planning import plan
from flow.spec import CrossEntropy, LayerNorm, Linear, Model

EPS = 1e-5


@pytest.mark.parametrize("n,r,d", [(1, 1, 2), (3, 5, 6), (2, 7, 384), (5, 3, 770)])
def test_layernorm_half_writes_the_copy_and_the_statistics_but_not_y(backend, rng, n, r, d):
    x = (rng.standard_normal((n, r, d)) * 3.0 + 1.5).astype(np.float32)
    gamma, beta = rng.standard_normal(d).astype(np.float32), rng.standard_normal(d).astype(np.float32)
    common = {"X": x, "gamma": gamma, "beta": beta}
    params = dict(N=n, R=r, D=d, eps=EPS)
    stale = rng.standard_normal(n * r * d).astype(np.float16)
    outputs = {"stats": np.zeros(2 * n * r, np.float32), "H": stale}
    copy = run_op(backend, "layernorm_copy", {**common, "Y": np.zeros_like(x), **outputs}, **params)
    untouched = rng.standard_normal(x.shape).astype(np.float32)
    half = run_op(backend, "layernorm_half", {**common, "Y": untouched.copy(), **outputs}, **params)
    np.testing.assert_array_equal(half["H"].view(np.uint16), copy["H"].view(np.uint16))
    np.testing.assert_array_equal(half["stats"], copy["stats"])
    np.testing.assert_array_equal(half["Y"], untouched)


@pytest.mark.parametrize("m,n,k,trans_b", [(37, 70, 48, 0), (130, 6, 33, 1), (257, 1030, 200, 1)])
def test_gemm_coopmat_half_writes_the_copy_but_not_c(backend, rng, m, n, k, trans_b):
    _needs_coopmat(backend)
    a, b, product = _half_case(rng, m, n, k, trans_b)
    bias = rng.standard_normal(n).astype(np.float32)
    params = dict(M=m, N=n, K=k, trans_b=trans_b, a_half=1, b_half=1, has_bias=1)
    inputs = {"A": a, "B": b, "bias": bias, "H": rng.standard_normal(m * n).astype(np.float16)}
    copy = run_op(backend, "gemm_coopmat_copy", {**inputs, "C": np.zeros((m, n), np.float32)}, **params)
    untouched = rng.standard_normal((m, n)).astype(np.float32)
    half = run_op(backend, "gemm_coopmat_half", {**inputs, "C": untouched.copy()}, **params)
    np.testing.assert_array_equal(half["H"].view(np.uint16), copy["H"].view(np.uint16))
    np.testing.assert_array_equal(half["C"], untouched)
    got = half["H"].astype(np.float64).reshape(m, n)
    want = product + bias
    assert np.all(np.abs(got - want) <= np.abs(want) * 2.0**-10 + 1e-3 * np.abs(want).max())


@pytest.fixture
def halves_only(monkeypatch):
    """The pass on, and activation copies at the test's small widths (the thresholds are an H100's)."""
    monkeypatch.setattr(autodiff, "HALF_ONLY_OUTPUTS", True)
    monkeypatch.setattr(autodiff, "HALF_ACTIVATION_MIN_N", 16)
    monkeypatch.setattr(autodiff, "HALF_ACTIVATION_MIN_FLOATS", 1)


GPT = gpt_blocks(vocab=13, width=12, hidden=24, context=10)


def _train_ops(model: Model) -> list[str]:
    return [item.op for item in plan(_mixed(layer_spec(model, batch=8))).devices[0].program("train").launches]


def test_a_mixed_gpt_writes_only_copies_of_its_layer_norms(halves_only, monkeypatch):
    """Every LayerNorm of the GPT feeds only GEMMs (qkv, fc1, the head), which read its copy: all
    five write the copy alone. Off, they write both."""
    ops = _train_ops(GPT)
    assert ops.count("layernorm_half") == 5 and "layernorm_copy" not in ops and "layernorm" not in ops
    monkeypatch.setattr(autodiff, "HALF_ONLY_OUTPUTS", False)
    assert _train_ops(GPT).count("layernorm_copy") == 5


def test_a_layer_norm_whose_output_is_read_in_fp32_keeps_it(halves_only):
    """Two LayerNorms that feed Linears write only their copies; the last one's output is the
    logits the loss reads in fp32, so it writes Y (and, read by no GEMM, no copy)."""
    model = Model(
        input_shape=(16,),
        layers=(LayerNorm(), Linear(32), LayerNorm(), Linear(5, activation="relu"), LayerNorm()),
        loss=CrossEntropy(),
    )
    ops = _train_ops(model)
    assert ops.count("layernorm_half") == 2
    assert ops.count("layernorm_copy") == 0 and ops.count("layernorm") == 1


def test_a_mixed_gpt_trains_bit_for_bit_writing_only_the_copies(halves_only, monkeypatch, rng):
    """Loss and gradients of one mixed train program on the CPU backend with the half-only
    variants (MIXED_FUSIONS on) and with neither they nor any fusion: the same numbers, bit for bit."""
    check_mixed_fusions_change_nothing(GPT, rng, monkeypatch, fused_op="layernorm_half")

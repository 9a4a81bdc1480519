"""LayerNorm's float16 copies (issue 16/18, session 14): ``layernorm_copy`` and
``layernorm_backward_data_copy`` also write their output rounded to float16, so mixed precision
folds the cast after a LayerNorm (the char GPT's fc1 input, and the residual stream's gradient that
fc2's weight gradient reads) into the LayerNorm itself."""

from __future__ import annotations

import numpy as np
import pytest
from layer_programs import layer_spec
from specs import gpt_blocks
from test_gelu_epilogue import _mixed, check_mixed_fusions_change_nothing
from test_layer_norm import layer_norm_oracle

from actors.cpu_backend import CpuBackend
from actors.single_op import run_op
from flow import autodiff
from flow.planning import plan

EPS = 1e-5


def _inputs(rng, n: int, r: int, d: int):
    x = (rng.standard_normal((n, r, d)) * 3.0 + 1.5).astype(np.float32)
    gamma = rng.standard_normal(d).astype(np.float32)
    beta = rng.standard_normal(d).astype(np.float32)
    return x, gamma, beta


@pytest.mark.parametrize("n,r,d", [(1, 1, 2), (3, 5, 6), (2, 7, 384), (5, 3, 770)])
def test_layernorm_copy_writes_y_and_its_float16_copy(backend, rng, n, r, d):
    """Y and the statistics as the plain op writes them (and the float64 oracle's Y), and H the
    float16 rounding of Y, bit for bit numpy's astype."""
    x, gamma, beta = _inputs(rng, n, r, d)
    rows = n * r
    common = {"X": x, "gamma": gamma, "beta": beta}
    params = dict(N=n, R=r, D=d, eps=EPS)
    outputs = {"Y": np.zeros_like(x), "stats": np.zeros(2 * rows, np.float32)}
    plain = run_op(backend, "layernorm", {**common, **outputs}, **params)
    stale = rng.standard_normal(rows * d).astype(np.float16)
    copy = run_op(
        backend,
        "layernorm_copy",
        {**common, "Y": np.zeros_like(x), "stats": np.zeros(2 * rows, np.float32), "H": stale},
        **params,
    )
    want, *_ = layer_norm_oracle(x, gamma, beta, np.zeros_like(x), n, EPS)
    assert np.max(np.abs(copy["Y"] - want)) <= 1e-4 * max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(copy["Y"], plain["Y"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(copy["stats"], plain["stats"], rtol=1e-6, atol=1e-6)
    rounded = copy["Y"].reshape(-1).astype(np.float16)
    np.testing.assert_array_equal(copy["H"].view(np.uint16), rounded.view(np.uint16))


@pytest.mark.parametrize("n,r,d,real", [(1, 1, 2, 1), (3, 5, 6, 2), (4, 3, 384, 4), (5, 3, 770, 3)])
@pytest.mark.parametrize("accumulate", [0, 1])
def test_layernorm_backward_data_copy_writes_dx_and_its_float16_copy(backend, rng, n, r, d, real, accumulate):
    """dX (padding rows past ``real`` samples: the addend or 0) as the plain op writes it and as
    the float64 oracle gives it, and H the float16 rounding of all of dX."""
    x, gamma, beta = _inputs(rng, n, r, d)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    addend = rng.standard_normal(x.shape).astype(np.float32)
    rows = n * r
    forward = {"X": x, "gamma": gamma, "beta": beta, "Y": np.zeros_like(x)}
    forward["stats"] = np.zeros(2 * rows, np.float32)
    stats = run_op(backend, "layernorm", forward, N=n, R=r, D=d, eps=EPS)["stats"]
    stepvals = np.array([0.0, 1.0, 1.0, 1.0, real, real], np.float32)
    common = {"dY": dy, "X": x, "stats": stats, "gamma": gamma, "stepvals": stepvals, "addend": addend}
    params = dict(N=n, R=r, D=d, eps=EPS, accumulate=accumulate)
    start = np.full(x.shape, np.nan, np.float32)
    plain = run_op(backend, "layernorm_backward_data", {**common, "dX": start.copy()}, **params)
    h = rng.standard_normal(rows * d).astype(np.float16)
    copy = run_op(backend, "layernorm_backward_data_copy", {**common, "dX": start.copy(), "H": h}, **params)
    _, want, _, _ = layer_norm_oracle(x, gamma, beta, dy, real, EPS)
    got = copy["dX"][:real] - (addend[:real] if accumulate else 0.0)
    assert np.max(np.abs(got - want)) <= 1e-4 * max(1.0, float(np.max(np.abs(want))))
    if isinstance(backend, CpuBackend):  # the emulation writes real rows only, as the plain op
        plain["dX"], copy["dX"] = plain["dX"][:real], copy["dX"][:real]
        h, whole = copy["H"][: real * r * d], copy["dX"].reshape(-1)
    else:
        np.testing.assert_array_equal(copy["dX"][real:], addend[real:] if accumulate else 0.0)
        h, whole = copy["H"], copy["dX"].reshape(-1)
    np.testing.assert_allclose(copy["dX"], plain["dX"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(h.view(np.uint16), whole.astype(np.float16).view(np.uint16))


@pytest.fixture
def wide_copies(monkeypatch):
    """Activation copies at the test's small widths (the thresholds are for an H100's GEMMs)."""
    monkeypatch.setattr(autodiff, "HALF_ACTIVATION_MIN_N", 16)
    monkeypatch.setattr(autodiff, "HALF_ACTIVATION_MIN_FLOATS", 1)


GPT = gpt_blocks(vocab=13, width=12, hidden=24, context=10)


def test_a_mixed_gpt_casts_nothing_after_its_layer_norms(wide_copies):
    """Each copy of a LayerNorm's output (the input of qkv, fc1 and the head) and of a LayerNorm's
    input gradient (the residual gradient that fc2's and the out-projection's GEMMs read) is
    written by that LayerNorm: all five forward ones, and the backward ones but the first block's
    first, whose gradient goes to the embeddings (no GEMM)."""
    launches = plan(_mixed(layer_spec(GPT, batch=8))).devices[0].program("train").launches
    writers = {}
    for item in launches:
        if item.op == "cast":
            assert not writers.get(item.args[0], "").startswith("layernorm"), item
        for name in autodiff._written(item):
            writers[name] = item.op
    ops = [item.op for item in launches]
    # layernorm_half: the copy alone, where no launch reads Y (tests/test_half_only_outputs.py).
    assert ops.count("layernorm_copy") + ops.count("layernorm_half") == 5
    assert ops.count("layernorm_backward_data_copy") == 4


def test_a_mixed_gpt_trains_bit_for_bit_with_layer_norms_writing_copies(wide_copies, monkeypatch, rng):
    """Loss and gradients of one mixed train program on the CPU backend with the casts folded into
    the LayerNorms and without (MIXED_FUSIONS off): the same numbers, bit for bit."""
    check_mixed_fusions_change_nothing(GPT, rng, monkeypatch, fused_op="layernorm_half")

"""fp16 in and out of the tensor-core attention (issue 16, session 15).

In a mixed plan with MIXED_FUSIONS the qkv GEMM writes qkv's fp16 copy (gemm_coopmat_half) and
the attention kernels' ``_half`` variants read it (attention_coopmat_half, _backward_kv_half,
_backward_q_half); the forward also writes Y's fp16 copy (``heads``, which the out-projection's
forward and weight-gradient GEMMs read), and the qkv bias's column sums, which read all of dqkv,
write dqkv's (column_sum_copy; the qkv weight- and input-gradient GEMMs read it, the bias sums the
fp32 dqkv as before).

Checked here: the variants against the float32-input kernels on the same inputs, bit for bit (Y,
L, dqkv: qkv's copy holds the halves the float32 kernels round qkv to), their copies against
numpy's astype(float16) bit for bit, and their results against the float64 oracle, over odd
sequence lengths and head sizes, on the CPU backend and, where there are cooperative matrices, on
Vulkan; the plan of the char GPT (every tensor-core GEMM reads halves but the logits' gradient's,
the fp32 qkv unread); and a mixed GPT trains bit for bit the same with MIXED_FUSIONS on and off
(CPU backend).
"""

from __future__ import annotations

import numpy as np
import pytest
from attention_oracle import attention_oracle
from conftest import assert_specialised_spirv_valid, relative_error
from layer_programs import layer_spec
from specs import gpt_blocks
from test_gelu_epilogue import _mixed, check_mixed_fusions_change_nothing
from test_ops_attention import (
    COOP_CASES,
    COOP_IDS,
    TOL_COOP_F16,
    TOL_COOP_F32,
    f16,
    facts_with,
    make_inputs,
    params,
    run_coopmat_attention,
)

from actors.cpu_backend import CpuBackend
from actors.single_op import run_op
from flow import autodiff
from flow.planning import plan
from flow.program import Barrier
from shaders.attention_tiles import ATTENTION_KINDS, COOPMAT_ATTENTION_OPS, tune_attention_coopmat
from shaders.registry import op as op_def

HALF_OPS = {kind: f"{name}_half" for kind, name in COOPMAT_ATTENTION_OPS.items()}


@pytest.fixture(params=["cpu", "vulkan"])
def half_backend(request):
    """The CPU backend, and Vulkan where it has the cooperative matrices the kernels need."""
    return CpuBackend() if request.param == "cpu" else request.getfixturevalue("coop")


def run_half_attention(backend, qkv16: np.ndarray, dy: np.ndarray, p: dict):
    """The _half kernels chained as a train step runs them (Drow by attention_backward_dot from the
    fp32 Y), then the qkv bias's column_sum_copy: Y, L, Y's copy, dqkv and dqkv's copy. Outputs
    and copies start as NaN, so an element left unwritten shows; the kv kernel must leave the q
    columns of dqkv alone."""
    n, t, heads, dh = p["N"], p["T"], p["H"], p["dh"]
    empty = np.full((n, heads, t), np.nan, np.float32)
    forward = {"qkv": qkv16, "Y": np.full(dy.shape, np.nan, np.float32), "L": empty}
    forward["H"] = np.full(dy.shape, np.nan, np.float16)
    forward = run_op(backend, HALF_OPS["forward"], forward, **p)
    dot = {"dY": dy, "Y": forward["Y"], "Drow": empty}
    drow = run_op(backend, "attention_backward_dot", dot, **p)["Drow"]
    grads = {"qkv": qkv16, "dY": dy, "L": forward["L"], "Drow": drow}
    kv = run_op(backend, HALF_OPS["kv"], {**grads, "dqkv": np.full(qkv16.shape, np.nan, np.float32)}, **p)
    d = heads * dh
    assert np.isnan(kv["dqkv"][..., :d]).all()
    q = run_op(backend, HALF_OPS["q"], {**grads, "dqkv": kv["dqkv"]}, **p)
    np.testing.assert_array_equal(q["dqkv"][..., d:].view(np.uint8), kv["dqkv"][..., d:].view(np.uint8))
    sums = {"X": q["dqkv"], "outs": np.full(3 * d, np.nan, np.float32)}
    sums["H"] = np.full(qkv16.shape, np.nan, np.float16)
    bias = run_op(backend, "column_sum_copy", sums, rows=n * t, cols=3 * d, parts=1)
    want = q["dqkv"].reshape(-1, 3 * d).astype(np.float64).sum(axis=0)
    np.testing.assert_allclose(bias["outs"], want, rtol=1e-4, atol=1e-3 * np.abs(want).max())
    return forward["Y"], forward["L"], forward["H"], q["dqkv"], bias["H"]


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=what)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n,t,heads,dh", COOP_CASES, ids=COOP_IDS)
def test_half_kernels_give_the_float32_kernels_results_and_their_copies(
    half_backend, rng, n, t, heads, dh, causal
):
    """From qkv's fp16 copy the _half kernels write what the float32-input kernels write from qkv,
    bit for bit (Y, L, dqkv), within fp16 rounding of the float64 oracle; their copies are numpy's
    astype(float16) of Y and dqkv, bit for bit."""
    qkv, dy = make_inputs(rng, n, t, heads, dh)
    p = params(n, t, heads, dh, causal)
    y32, lse32, dqkv32 = run_coopmat_attention(half_backend, qkv, dy, p, COOPMAT_ATTENTION_OPS)
    y, lse, y_copy, dqkv, dqkv_copy = run_half_attention(half_backend, qkv.astype(np.float16), dy, p)
    assert_same_bits(y, y32, "Y")
    assert_same_bits(lse, lse32, "L")
    assert_same_bits(dqkv, dqkv32, "dqkv")
    assert_same_bits(y_copy, y.astype(np.float16), "Y's copy")
    assert_same_bits(dqkv_copy, dqkv.astype(np.float16), "dqkv's copy")
    y16, lse16, _drow, dqkv16 = attention_oracle(f16(qkv), f16(dy), heads, p["scale"], causal)
    y64, _lse, _drow, dqkv64 = attention_oracle(qkv, dy, heads, p["scale"], causal)
    assert relative_error(y, y16) <= TOL_COOP_F16 and relative_error(lse, lse16) <= 1e-4
    assert relative_error(dqkv, dqkv16) <= TOL_COOP_F16
    assert relative_error(y, y64) <= TOL_COOP_F32 and relative_error(dqkv, dqkv64) <= TOL_COOP_F32


def test_the_copies_keep_what_numpy_keeps(half_backend, rng):
    """Outputs at the edges of fp16, the copies still numpy's astype bit for bit: tiny values round
    to subnormal halves (Y from v of about 1e-5) and huge ones to inf (dv of key 0 sums the dY of
    all 40 queries, each over 20000; every input fits in fp16)."""
    n, t, heads, dh = 1, 40, 2, 16
    qkv, dy = make_inputs(rng, n, t, heads, dh)
    d = heads * dh
    qkv[..., 2 * d :] *= 1e-5
    dy = (20000.0 + 10000.0 * np.abs(dy)).clip(max=60000.0).astype(np.float32)
    p = params(n, t, heads, dh, True)
    y, _lse, y_copy, dqkv, dqkv_copy = run_half_attention(half_backend, qkv.astype(np.float16), dy, p)
    with np.errstate(over="ignore"):  # what numpy's astype does past 65504: inf, as the kernels do
        assert_same_bits(y_copy, y.astype(np.float16), "Y's copy")
        assert_same_bits(dqkv_copy, dqkv.astype(np.float16), "dqkv's copy")
    halves = np.abs(np.concatenate([y_copy.ravel(), dqkv_copy.ravel()]).astype(np.float32))
    assert np.isinf(halves).any() and ((halves > 0) & (halves < 2.0**-14)).any()  # both edges reached
    assert np.isfinite(y).all() and np.isfinite(dqkv).all()


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_half_kernels_specialised_spirv_valid(kind, tmp_path):
    """Runs everywhere: each _half kernel specialised for every head size passes spirv-val."""
    definition = op_def(HALF_OPS[kind])
    cases = {dh: definition.spec_values(tune_attention_coopmat(kind, {"dh": dh}, facts_with(49152)))
             for dh in range(16, 129, 16)}  # fmt: skip
    assert_specialised_spirv_valid(definition, cases, tmp_path)


def _readers(launches, tensor: str) -> list[str]:
    """The ops that read ``tensor`` (bind it other than as an output, as a GEMM's unused bias or as
    the output a _half variant leaves unwritten)."""
    return [item.op for item in launches if tensor in autodiff._read(item)]


@pytest.mark.parametrize("fusions", [True, False], ids=["fused", "unfused"])
def test_the_char_gpt_attention_reads_and_writes_halves(monkeypatch, fusions):
    """The char GPT's sizes: with MIXED_FUSIONS every attention launch is a _half kernel reading the
    copy its qkv GEMM wrote, the out-projection's GEMMs read the forward's copy and the qkv GEMMs
    the copy the qkv bias's column sums write (from the fp32 gradient they sum), and the fp32 qkv is
    read by nothing; without, the plan
    is the float32-input kernels' and no copy of heads or dqkv exists."""
    monkeypatch.setattr(autodiff, "MIXED_FUSIONS", fusions)
    model = gpt_blocks(vocab=103, width=384, hidden=1536, context=256, heads=6)
    device = plan(_mixed(layer_spec(model, batch=64))).devices[0]
    launches = device.program("train").launches
    dtypes = {t.name: t.dtype for t in device.layout.tensors}
    attention = [s for s in launches if s.op.startswith("attention_coopmat")]
    assert len(attention) == 2 * 3
    assert {s.op for s in attention} == set((HALF_OPS if fusions else COOPMAT_ATTENTION_OPS).values())
    for item in attention:
        assert dtypes[item.args[0]] == ("float16" if fusions else "float32")
    for layer in (3, 10):  # the two attention stages
        qkv, heads, dqkv = f"qkv[{layer}]", f"heads[{layer}]", f"grad:qkv[{layer}]"
        assert (f"half:{heads}" in dtypes) == fusions and (f"half:{dqkv}" in dtypes) == fusions
        assert _readers(launches, qkv) == ([] if fusions else list(COOPMAT_ATTENTION_OPS.values()))
        writers = [s for s in launches if f"half:{qkv}" in s.args]
        if fusions:
            # gemm_coopmat_half: the copy alone, since nothing reads the fp32 qkv
            # (tests/test_half_only_outputs.py).
            assert writers[0].op == "gemm_coopmat_half" and dtypes[f"half:{qkv}"] == "float16"
            gemms = [s.op for s in launches if f"half:{heads}" in s.args[:2] or f"half:{dqkv}" in s.args[:2]]
            assert len(gemms) == 4 and all(op.startswith("gemm_coopmat") for op in gemms)
            # dqkv's copy comes from the bias's column sums, a group before the qkv GEMMs.
            staged, group = [], 0  # (group, launch) in program order
            for step in device.program("train").steps:
                group += isinstance(step, Barrier)
                staged += [] if isinstance(step, Barrier) else [(group, step)]
            (bias,) = [g for g, s in staged if f"half:{dqkv}" in s.args and s.op == "column_sum_copy"]
            assert all(bias < g for g, s in staged if f"half:{dqkv}" in s.args[:2])
        assert ("column_sum_copy" if fusions else "column_sum") in _readers(launches, dqkv)
        unfused = ["gemm_coopmat"] * 2  # the out-projection's forward and weight gradient
        assert _readers(launches, heads) == [*([] if fusions else unfused), "attention_backward_dot"]


def test_a_mixed_gpt_trains_bit_for_bit_with_and_without_the_half_attention(monkeypatch, rng):
    """Two heads of 16 (the tensor-core kernels): loss and gradients of a mixed train program on
    the CPU backend are the same, bit for bit, whether the attention reads and writes fp16 copies
    (MIXED_FUSIONS) or rounds its fp32 qkv and the GEMMs round its fp32 outputs."""
    model = gpt_blocks(vocab=13, width=32, hidden=48, context=10)
    check_mixed_fusions_change_nothing(model, rng, monkeypatch, fused_op="attention_coopmat_half")

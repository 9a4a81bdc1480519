"""Fused multi-head self-attention (attention, attention_backward_dot, _kv, _q): each op and the
composed backward on every backend against a float64 numpy oracle written here (and torch's
scaled_dot_product_attention where torch is installed), causal and not, odd sequence lengths and
head sizes; and the kernels' tiles within the shared memory of the devices we run on.

The tensor-core variants (attention_coopmat, _backward_kv, _q; mixed precision) stage qkv and dY
as float16 and multiply P and dS as float16, so they are checked against the oracle of the
fp16-rounded inputs (what remains is P's and dS's rounding) and, more loosely, of the fp32 inputs.
Devices without cooperative matrices (lavapipe) skip those; the choice of kernels, the tiles, the
specialised SPIR-V and the CPU backend's emulation are checked everywhere.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from attention_oracle import as64, attention_oracle
from conftest import assert_specialised_spirv_valid, relative_error

from actors.cpu_backend import CpuBackend
from actors.single_op import run_op
from flow.device_facts import DeviceFacts
from flow.planning import plan
from flow.spec import MSE, SGD, Data, Model, RunSettings, SelfAttention, Spec, Synthetic
from shaders.attention_tiles import (
    ATTENTION_KINDS,
    COOPMAT_ATTENTION_OPS,
    SCALAR_ATTENTION_OPS,
    attention_ops,
    attention_shared_bytes,
    coopmat_attention_shared_bytes,
    tune_attention,
    tune_attention_coopmat,
)
from shaders.registry import op as op_def

try:
    import torch
except ImportError:  # torch is an optional second oracle
    torch = None

TOL = 2e-5


def torch_attention(qkv: np.ndarray, dy: np.ndarray, heads: int, scale: float, causal: bool):
    """Y and dqkv from torch's scaled_dot_product_attention in float64."""
    n, t, width = qkv.shape
    x = torch.from_numpy(as64(qkv)).requires_grad_()
    q, k, v = x.reshape(n, t, 3, heads, -1).permute(2, 0, 3, 1, 4)
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    y = y.permute(0, 2, 1, 3).reshape(n, t, width // 3)
    y.backward(torch.from_numpy(as64(dy)))
    return y.detach().numpy(), x.grad.numpy()


def make_inputs(rng, n: int, t: int, heads: int, dh: int):
    """qkv spread enough that the softmax is far from uniform, and an output gradient; no zeros."""
    qkv = (rng.standard_normal((n, t, 3 * heads * dh)) * 1.5).astype(np.float32)
    dy = rng.standard_normal((n, t, heads * dh)).astype(np.float32)
    return qkv, dy


def params(n: int, t: int, heads: int, dh: int, causal: bool, scale: float | None = None) -> dict:
    return dict(
        N=n, T=t, H=heads, dh=dh, scale=1.0 / math.sqrt(dh) if scale is None else scale, causal=int(causal)
    )


# (N, T, H, dh, scale or None for 1/sqrt(dh)): T 1 and odd T around the block sizes (BR is 16 to
# 64 rows, BC 8 to 64), every supported dh, head sizes that are not multiples of 4 (the scalar
# load path), and a scale of the caller's.
CASES = [
    (2, 1, 1, 8, None),
    (1, 5, 3, 16, None),
    (2, 33, 2, 32, None),
    (1, 129, 1, 64, None),
    (1, 71, 2, 128, None),
    (2, 7, 3, 6, None),
    (1, 40, 2, 12, 0.3),
    (3, 9, 5, 3, None),
]
IDS = [f"N{c[0]}-T{c[1]}-H{c[2]}-dh{c[3]}" + ("-scaled" if c[4] else "") for c in CASES]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n,t,heads,dh,scale", CASES, ids=IDS)
def test_attention_ops_against_the_oracle(backend, rng, n, t, heads, dh, scale, causal):
    """Each op alone from the oracle's inputs: the forward, Drow, then kv (which must leave the q
    columns alone) and q (after which no element of dqkv is left unwritten)."""
    qkv, dy = make_inputs(rng, n, t, heads, dh)
    p = params(n, t, heads, dh, causal, scale)
    y_ref, lse_ref, drow_ref, dqkv_ref = attention_oracle(qkv, dy, heads, p["scale"], causal)

    forward = run_op(
        backend,
        "attention",
        {"qkv": qkv, "Y": np.full_like(dy, np.nan), "L": np.full((n, heads, t), np.nan, np.float32)},
        **p,
    )
    assert relative_error(forward["Y"], y_ref) <= TOL
    assert relative_error(forward["L"], lse_ref) <= TOL

    y32, lse32 = y_ref.astype(np.float32), lse_ref.astype(np.float32)
    drow = run_op(
        backend,
        "attention_backward_dot",
        {"dY": dy, "Y": y32, "Drow": np.full((n, heads, t), np.nan, np.float32)},
        **p,
    )["Drow"]
    assert relative_error(drow, drow_ref) <= TOL

    grads = {"qkv": qkv, "dY": dy, "L": lse32, "Drow": drow_ref.astype(np.float32)}
    kv = run_op(backend, "attention_backward_kv", {**grads, "dqkv": np.full_like(qkv, np.nan)}, **p)["dqkv"]
    d = heads * dh
    assert np.isnan(kv[..., :d]).all()
    assert relative_error(kv[..., d:], dqkv_ref[..., d:]) <= TOL
    dqkv = run_op(backend, "attention_backward_q", {**grads, "dqkv": kv}, **p)["dqkv"]
    assert relative_error(dqkv[..., :d], dqkv_ref[..., :d]) <= TOL
    np.testing.assert_array_equal(dqkv[..., d:], kv[..., d:])


def run_attention(backend, qkv: np.ndarray, dy: np.ndarray, p: dict):
    """The forward and the three backward ops chained as a train step runs them: Y and dqkv."""
    n, t, heads = p["N"], p["T"], p["H"]
    empty = np.full((n, heads, t), np.nan, np.float32)
    forward = run_op(backend, "attention", {"qkv": qkv, "Y": np.full_like(dy, np.nan), "L": empty}, **p)
    dot = {"dY": dy, "Y": forward["Y"], "Drow": empty}
    drow = run_op(backend, "attention_backward_dot", dot, **p)["Drow"]
    grads = {"qkv": qkv, "dY": dy, "L": forward["L"], "Drow": drow}
    dqkv = run_op(backend, "attention_backward_kv", {**grads, "dqkv": np.full_like(qkv, np.nan)}, **p)["dqkv"]
    dqkv = run_op(backend, "attention_backward_q", {**grads, "dqkv": dqkv}, **p)["dqkv"]
    return forward["Y"], dqkv


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n,t,heads,dh,scale", CASES, ids=IDS)
def test_composed_backward_against_the_oracle_and_torch(backend, rng, n, t, heads, dh, scale, causal):
    qkv, dy = make_inputs(rng, n, t, heads, dh)
    p = params(n, t, heads, dh, causal, scale)
    y, dqkv = run_attention(backend, qkv, dy, p)
    y_ref, _lse, _drow, dqkv_ref = attention_oracle(qkv, dy, heads, p["scale"], causal)
    assert relative_error(y, y_ref) <= TOL
    assert relative_error(dqkv, dqkv_ref) <= 1e-4  # through the forward's float32 Y and L
    if torch is not None:
        y_torch, dqkv_torch = torch_attention(qkv, dy, heads, p["scale"], causal)
        assert relative_error(y, y_torch) <= TOL
        assert relative_error(dqkv, dqkv_torch) <= 1e-4


def test_causal_rows_see_no_later_keys(backend, rng):
    """Changing the last token's q, k and v changes no earlier row of Y, bit for bit (its scores
    are masked to an exact 0 weight)."""
    n, t, heads, dh = 1, 21, 2, 8
    qkv, dy = make_inputs(rng, n, t, heads, dh)
    p = params(n, t, heads, dh, True)
    changed = qkv.copy()
    changed[:, -1] = rng.standard_normal(changed[:, -1].shape).astype(np.float32)
    y, _ = run_attention(backend, qkv, dy, p)
    y_changed, _ = run_attention(backend, changed, dy, p)
    np.testing.assert_array_equal(y[:, :-1], y_changed[:, :-1])
    assert not np.array_equal(y[:, -1], y_changed[:, -1])


def facts_with(shared: int) -> DeviceFacts:
    return DeviceFacts(
        index=0,
        name="test",
        kind="discrete",
        vendor="test",
        vendor_id=0,
        api_version="1.3",
        driver_version="0",
        shared_memory_bytes=shared,
    )


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
@pytest.mark.parametrize("shared", [None, 32768, 49152], ids=["unknown", "lavapipe-32K", "nvidia-48K"])
def test_tiles_fit_the_shared_memory_for_every_head_size(kind, shared):
    limit = 32768 if shared is None else shared
    facts = None if shared is None else facts_with(shared)
    for dh in range(1, 129):
        spec = tune_attention(kind, {"dh": dh}, facts)
        assert attention_shared_bytes(kind, spec) <= limit, (dh, spec)
        # What the shaders assume of their tiles.
        assert spec["DHP"] >= dh and spec["DHP"] % 4 == 0 and (spec["DHP"] // 4) % spec["G"] == 0
        assert spec["BC"] % spec["G"] == 0
        assert spec["BR"] * spec["G"] <= 256  # every device allows 256 threads a workgroup


def test_the_char_gpts_heads_take_the_measured_tiles():
    """dh 64 on a 48 KiB GPU: 2 threads a row (32 accumulators each), 64 rows, 32 streamed, the
    fastest of bench/ab_attention.py --scalar's sweep on an H100 for all three kernels."""
    for kind in ATTENTION_KINDS:
        spec = tune_attention(kind, {"dh": 64}, facts_with(49152))
        assert (spec["G"], spec["BR"], spec["BC"]) == (2, 64, 32), kind


@pytest.mark.parametrize("name", ["attention", "attention_backward_kv", "attention_backward_q"])
def test_registry_launches_one_workgroup_per_row_block_head_and_sample(name):
    definition = op_def(name)
    spec = tune_attention("forward", {"dh": 64}, None)
    assert definition.groups({"N": 3, "T": 129, "H": 6, "dh": 64}, definition.local(spec), spec) == (
        math.ceil(129 / spec["BR"]),
        6,
        3,
    )
    assert definition.local(spec) == (spec["BR"] * spec["G"], 1, 1)


def test_shared_memory_declared_by_the_shaders_matches_the_formula():
    """attention_shared_bytes is what the tiles are chosen by, so it must count every shared
    array the shaders declare: sizes from the shader sources evaluated with the tiles."""
    import re

    from shaders.compiler import SHADER_DIR

    spec = {"BR": 32, "BC": 16, "G": 8, "DHP": 128}
    values = {**spec, "D4": 32, "RS4": 33, "SS": 24}
    sizes = {"vec4": 16, "float": 4}
    shaders = ["attention.comp", "attention_backward_kv.comp", "attention_backward_q.comp"]
    for kind, shader in zip(ATTENTION_KINDS, shaders, strict=True):
        source = (SHADER_DIR / shader).read_text()
        total = 0
        for match in re.finditer(r"^shared (vec4|float) \w+\[([^\]]+)\];", source, re.MULTILINE):
            total += sizes[match[1]] * eval(match[2], {}, dict(values))  # noqa: S307 - our own shader text
        assert total == attention_shared_bytes(kind, spec), shader


# -- the tensor-core kernels (mixed precision) -------------------------------------------------------

# Measured on an H100: at most 6e-4 and 1e-3 (the q and k gradients), 1e-4 and 6e-4 for Y.
TOL_COOP_F16 = 2e-3  # against the fp16-rounded inputs: P's and dS's fp16 rounding
TOL_COOP_F32 = 4e-3  # against the fp32 inputs: the input rounding too


def f16(array: np.ndarray) -> np.ndarray:
    return np.asarray(array).astype(np.float16).astype(np.float32)


def run_coopmat_attention(backend, qkv: np.ndarray, dy: np.ndarray, p: dict, ops: dict[str, str]):
    """The forward and the backward (Drow by the scalar kernel, as a train step) chained: Y, L, dqkv."""
    n, t, heads = p["N"], p["T"], p["H"]
    empty = np.full((n, heads, t), np.nan, np.float32)
    forward = run_op(backend, ops["forward"], {"qkv": qkv, "Y": np.full_like(dy, np.nan), "L": empty}, **p)
    dot = {"dY": dy, "Y": forward["Y"], "Drow": empty}
    drow = run_op(backend, "attention_backward_dot", dot, **p)["Drow"]
    grads = {"qkv": qkv, "dY": dy, "L": forward["L"], "Drow": drow}
    kv = run_op(backend, ops["kv"], {**grads, "dqkv": np.full_like(qkv, np.nan)}, **p)["dqkv"]
    d = heads * p["dh"]
    assert np.isnan(kv[..., :d]).all()  # the q columns are the q kernel's
    dqkv = run_op(backend, ops["q"], {**grads, "dqkv": kv}, **p)["dqkv"]
    np.testing.assert_array_equal(dqkv[..., d:], kv[..., d:])
    return forward["Y"], forward["L"], dqkv


# T across the 16-row fragments and the 32- and 64-row blocks (fragments the causal mask or T leave
# empty are skipped, cut ones masked), and dh 48 (an odd number of 16-column fragments).
COOP_CASES = [
    (2, 37, 3, 32),
    (1, 129, 2, 64),
    (2, 256, 2, 64),
    (1, 71, 2, 128),
    (2, 20, 1, 16),
    (3, 5, 2, 48),
    (1, 97, 3, 48),
]
COOP_IDS = [f"N{c[0]}-T{c[1]}-H{c[2]}-dh{c[3]}" for c in COOP_CASES]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n,t,heads,dh", COOP_CASES, ids=COOP_IDS)
def test_coopmat_kernels_against_the_oracle(coop, rng, n, t, heads, dh, causal):
    """Y, L and every gradient of the tensor-core kernels, odd T across their 64-row blocks: within
    fp16 rounding of the oracle of the rounded inputs, and of the plain fp32 oracle."""
    qkv, dy = make_inputs(rng, n, t, heads, dh)
    p = params(n, t, heads, dh, causal)
    y, lse, dqkv = run_coopmat_attention(coop, qkv, dy, p, COOPMAT_ATTENTION_OPS)
    y16, lse16, _drow, dqkv16 = attention_oracle(f16(qkv), f16(dy), heads, p["scale"], causal)
    y32, lse32, _drow, dqkv32 = attention_oracle(qkv, dy, heads, p["scale"], causal)
    assert np.all(np.isfinite(dqkv))
    assert relative_error(y, y16) <= TOL_COOP_F16
    assert relative_error(lse, lse16) <= 1e-4  # sums and logs in fp32
    d = heads * dh
    for part, columns in (("q", slice(0, d)), ("k", slice(d, 2 * d)), ("v", slice(2 * d, 3 * d))):
        assert relative_error(dqkv[..., columns], dqkv16[..., columns]) <= TOL_COOP_F16, part
        assert relative_error(dqkv[..., columns], dqkv32[..., columns]) <= TOL_COOP_F32, part
    assert relative_error(y, y32) <= TOL_COOP_F32
    assert relative_error(lse, lse32) <= 1e-3


def test_coopmat_causal_rows_see_no_later_keys(coop, rng):
    n, t, heads, dh = 1, 70, 2, 32
    qkv, dy = make_inputs(rng, n, t, heads, dh)
    p = params(n, t, heads, dh, True)
    changed = qkv.copy()
    changed[:, -1] = rng.standard_normal(changed[:, -1].shape).astype(np.float32)
    y, _, _ = run_coopmat_attention(coop, qkv, dy, p, COOPMAT_ATTENTION_OPS)
    y_changed, _, _ = run_coopmat_attention(coop, changed, dy, p, COOPMAT_ATTENTION_OPS)
    np.testing.assert_array_equal(y[:, :-1], y_changed[:, :-1])
    assert not np.array_equal(y[:, -1], y_changed[:, -1])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_coopmat_emulation_on_the_cpu(rng, causal):
    """The CPU backend (which runs mixed-precision plans too) rounds qkv and dY to float16 as the
    kernels stage them: it matches the oracle of the rounded inputs to fp32 accuracy."""
    n, t, heads, dh = 2, 19, 2, 16
    qkv, dy = make_inputs(rng, n, t, heads, dh)
    p = params(n, t, heads, dh, causal)
    y, lse, dqkv = run_coopmat_attention(CpuBackend(), qkv, dy, p, COOPMAT_ATTENTION_OPS)
    y16, lse16, _drow, dqkv16 = attention_oracle(f16(qkv), f16(dy), heads, p["scale"], causal)
    assert relative_error(y, y16) <= TOL
    assert relative_error(lse, lse16) <= TOL
    assert relative_error(dqkv, dqkv16) <= 1e-3  # Drow is the fp32 dY's (attention_backward_dot)
    assert relative_error(y, attention_oracle(qkv, dy, heads, p["scale"], causal)[0]) > 1e-5  # rounded


def test_mixed_precision_picks_the_tensor_core_kernels():
    """The pure choice: tensor cores for mixed precision and head sizes that are multiples of 16 up
    to 128, the scalar kernels otherwise."""
    for dh in (16, 32, 48, 64, 128):
        assert attention_ops(True, dh) == COOPMAT_ATTENTION_OPS
        assert attention_ops(False, dh) == SCALAR_ATTENTION_OPS
    for dh in (1, 8, 12, 24, 100, 144, 256):
        assert attention_ops(True, dh) == SCALAR_ATTENTION_OPS


@pytest.mark.parametrize(
    "precision,width,expected",
    [
        ("mixed", 32, COOPMAT_ATTENTION_OPS),
        ("float32", 32, SCALAR_ATTENTION_OPS),
        ("mixed", 24, SCALAR_ATTENTION_OPS),
    ],
)
def test_the_plan_launches_the_chosen_kernels(precision, width, expected):
    """A spec's precision and head size (2 heads of width / 2) decide the kernels its train
    program launches."""
    model = Model(input_shape=(9, width), layers=(SelfAttention(2),), loss=MSE())
    spec = Spec(
        model=model,
        optimiser=SGD(lr=0.1),
        data=Data(Synthetic(samples=16, features=(9, width), classes=4), batch_size=4),
        run=RunSettings(precision=precision),
    )
    train = plan(spec).devices[0].programs[0]
    # The tensor-core kernels' _half variants read and write fp16 copies (test_attention_half_copies).
    ops = {step.op.removesuffix("_half") for step in train.steps if hasattr(step, "op")}
    assert set(expected.values()) <= ops
    other = COOPMAT_ATTENTION_OPS if expected == SCALAR_ATTENTION_OPS else SCALAR_ATTENTION_OPS
    assert not set(other.values()) & ops


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
@pytest.mark.parametrize("subgroup", [32, 64])
def test_coopmat_tiles_fit_48k_and_match_the_shaders(kind, subgroup):
    """Every head size the choice allows fits NVIDIA's 48 KiB, and the formula the tiles are chosen
    by counts every shared array the shader declares (evaluated with the tiles)."""
    import re

    from shaders.compiler import SHADER_DIR

    facts = dataclasses.replace(facts_with(49152), subgroup_size=subgroup)
    shader = COOPMAT_ATTENTION_OPS[kind] + "_body.glsl"  # of the .comp and its _half variant
    source = (SHADER_DIR / shader).read_text()
    for dh in range(16, 129, 16):
        spec = tune_attention_coopmat(kind, {"dh": dh}, facts)
        assert coopmat_attention_shared_bytes(kind, spec) <= 49152
        assert 2 * spec["BC"] >= 16 * spec["WARPS"] and (spec["BC"] // (subgroup // 16)) % 4 == 0
        bc, warps = spec["BC"], spec["WARPS"]
        values = dict(BC=bc, BR=16 * warps, STAGED=bc * (dh + 8) // 4, SS=20, SW=bc + 4, PS=(bc + 8) // 4)
        total = 0
        for match in re.finditer(r"^shared (uvec2|float) \w+\[([^\]]+)\];", source, re.MULTILINE):
            expression = match[2].replace("2u", "2")
            total += {"uvec2": 8, "float": 4}[match[1]] * eval(expression, {}, values)  # noqa: S307
        assert total == coopmat_attention_shared_bytes(kind, spec), (shader, dh)
    with pytest.raises(ValueError, match="multiple of 16"):
        tune_attention_coopmat(kind, {"dh": 24}, facts)


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_coopmat_specialised_spirv_valid(kind, tmp_path):
    """Runs everywhere: each kernel specialised (spirv-opt: set, freeze, fold) for every head size
    and the tiles tune picks passes spirv-val (glslang 13.1 mishandles some expressions on
    specialisation constants, which only a specialised module shows)."""
    definition = op_def(COOPMAT_ATTENTION_OPS[kind])
    cases = {dh: definition.spec_values(tune_attention_coopmat(kind, {"dh": dh}, facts_with(49152)))
             for dh in range(16, 129, 16)}  # fmt: skip
    assert_specialised_spirv_valid(definition, cases, tmp_path)

"""Fused multi-head self-attention (attention, attention_backward_dot, _kv, _q): each op and the
composed backward on every backend against a float64 numpy oracle written here (and torch's
scaled_dot_product_attention where torch is installed), causal and not, odd sequence lengths and
head sizes; and the kernels' tiles within the shared memory of the devices we run on.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import relative_error

from actors.single_op import run_op
from flow.device_facts import DeviceFacts
from shaders.attention_tiles import ATTENTION_KINDS, attention_shared_bytes, tune_attention
from shaders.registry import op as op_def

try:
    import torch
except ImportError:  # torch is an optional second oracle
    torch = None

TOL = 2e-5


def as64(array: np.ndarray) -> np.ndarray:
    return np.asarray(array, dtype=np.float64)


def attention_oracle(qkv: np.ndarray, dy: np.ndarray, heads: int, scale: float, causal: bool):
    """Attention of qkv [N, T, 3D] by the textbook formulas in float64: Y [N, T, D], L [N, H, T],
    Drow [N, H, T] and dqkv [N, T, 3D] for the output gradient dy."""
    n, t, width = qkv.shape
    dh = width // 3 // heads
    q, k, v = as64(qkv).reshape(n, t, 3, heads, dh).transpose(2, 0, 3, 1, 4)
    grad = as64(dy).reshape(n, t, heads, dh).transpose(0, 2, 1, 3)
    scores = scale * np.einsum("nhid,nhjd->nhij", q, k)
    allowed = np.tri(t, dtype=bool) if causal else np.ones((t, t), bool)
    scores = np.where(allowed, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    total = np.exp(scores - top).sum(axis=-1, keepdims=True)
    lse = top + np.log(total)
    probs = np.exp(scores - lse)
    y = probs @ v
    dprobs = grad @ v.swapaxes(-1, -2)
    # The softmax backward written out, not through Drow: dS = P * (dP - rowsum(P * dP)).
    dscores = probs * (dprobs - (probs * dprobs).sum(axis=-1, keepdims=True))
    dq, dk, dv = scale * dscores @ k, scale * dscores.swapaxes(-1, -2) @ q, probs.swapaxes(-1, -2) @ grad
    dqkv = np.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(n, t, width)
    return (
        y.transpose(0, 2, 1, 3).reshape(n, t, width // 3),
        lse[..., 0],
        (grad * y).sum(axis=-1),
        dqkv,
    )


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

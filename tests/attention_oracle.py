"""The float64 oracle of the fused attention ops, shared by tests/test_ops_attention.py and
bench/ab_attention.py (which checks every tile variant against it before timing)."""

from __future__ import annotations

import numpy as np


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

"""A MatMul layer's launches, pure: its forward and both input gradients as batched matrix
products (bmm.comp), one matrix per sample and leading position. :mod:`flow.autodiff` calls these
for a MatMul stage; the dimensions come from the stage's two input shapes.

With C = A @ B (A: M x K, B: K x N): dA = dC @ B^T, dB = A^T @ dC. Under ``transpose_b``
(C = A @ B^T, B: N x K): dA = dC @ B, dB = dC^T @ A.
"""

from __future__ import annotations

import math

from flow.program import Launch, launch
from flow.spec_base import Shape
from flow.spec_model import MatMul


def matmul_dims(layer: MatMul, batch: int, in_shapes: tuple[Shape, ...]) -> dict[str, int]:
    """The matrices a MatMul multiplies: ``batch`` (rows times leading positions), M, K and N."""
    a, b = in_shapes
    n = b[-2] if layer.transpose_b else b[-1]
    return dict(batch=batch * math.prod(a[:-2]), M=a[-2], K=a[-1], N=n)


def matmul_forward(layer: MatMul, dims: dict[str, int], a: str, b: str, out: str) -> Launch:
    """C = A @ op(B)."""
    return launch("bmm", (a, b, out), **_shape(dims, "M", "N", "K"), trans_b=int(layer.transpose_b))


def matmul_backward(
    layer: MatMul, dims: dict[str, int], a: str, b: str, grad: str, da: str | None, db: str | None
) -> list[Launch]:
    """The launches (independent: one group) of the gradients wanted: dA into ``da`` and dB into
    ``db``, each None when not wanted."""
    launches = []
    if da is not None:  # dA [M, K] = dC [M, N] @ (B^T, or B under transpose_b)
        trans_b = int(not layer.transpose_b)
        launches.append(launch("bmm", (grad, b, da), **_shape(dims, "M", "K", "N"), trans_b=trans_b))
    if db is not None and layer.transpose_b:  # dB [N, K] = dC^T @ A
        launches.append(launch("bmm", (grad, a, db), **_shape(dims, "N", "K", "M"), trans_a=1))
    elif db is not None:  # dB [K, N] = A^T @ dC
        launches.append(launch("bmm", (a, grad, db), **_shape(dims, "K", "N", "M"), trans_a=1))
    return launches


def _shape(dims: dict[str, int], m: str, n: str, k: str) -> dict[str, int]:
    """bmm's batch, M, N and K from a MatMul's dimensions named m, n and k."""
    return dict(batch=dims["batch"], M=dims[m], N=dims[n], K=dims[k])

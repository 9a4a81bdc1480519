"""Float64 numpy oracles shared by the op tests, written from the textbook formulas and
independent of actors/cpu_ops.py (which they also check)."""

from __future__ import annotations

import math

import numpy as np

erf = np.vectorize(math.erf, otypes=[np.float64])


def activation(x: np.ndarray, name: str | None, slope: float = 0.01) -> np.ndarray:
    """An activation by name ("none"/None, relu, leaky_relu, sigmoid, tanh, gelu), in float64."""
    x = np.asarray(x, dtype=np.float64)
    if name in (None, "none"):
        return x
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "leaky_relu":
        return np.where(x > 0, x, slope * x)
    if name == "sigmoid":
        return 1.0 / (1.0 + np.exp(-x))
    if name == "tanh":
        return np.tanh(x)
    if name == "gelu":
        return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))
    raise ValueError(f"unknown activation {name!r}")


def derivative_from_output(s: np.ndarray, name: str, slope: float = 0.01) -> np.ndarray:
    """f'(x) of relu, leaky_relu, sigmoid or tanh written in terms of their output s = f(x), in
    float64 (what a backward pass that saved the output computes); NaN where s is NaN."""
    s = np.asarray(s, dtype=np.float64)
    derivative = {
        "relu": lambda: (s > 0).astype(np.float64),
        "leaky_relu": lambda: np.where(s > 0, 1.0, slope),
        "sigmoid": lambda: s * (1 - s),
        "tanh": lambda: 1 - s * s,
    }[name]()
    derivative[np.isnan(s)] = np.nan
    return derivative


_U32 = 0xFFFFFFFF


def pcg_hash(value: int) -> int:
    """The PCG hash of Jarzynski and Olano (2020) of a uint32, in Python's unbounded integers
    (masked to 32 bits by hand), so it checks numpy's wrapping uint32 arithmetic independently."""
    state = (value * 747796405 + 2891336453) & _U32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _U32
    return (word >> 22) ^ word


def dropout_keep(n: int, seed: int, step: int, p: float) -> np.ndarray:
    """Dropout's mask by its definition: element i is kept when its uniform draw in [0, 1), the
    hash of (seed, step, i) over 2**32, is >= p."""
    key = pcg_hash(pcg_hash(seed) ^ step)
    return np.array([pcg_hash(pcg_hash(i) ^ key) / 2.0**32 >= p for i in range(n)], dtype=bool)


def embedding(ids: np.ndarray, table: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An embedding lookup of integer ``ids`` (any shape) in ``table`` [V, D] and the table's
    gradient for ``dy`` [*ids.shape, D], in float64: each id's dy row added to its table row, one
    at a time, so a repeated id adds every one of its rows."""
    table = np.asarray(table, dtype=np.float64)
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    grads = np.asarray(dy, dtype=np.float64).reshape(flat.size, table.shape[1])
    dtable = np.zeros_like(table)
    for position, row in enumerate(flat):
        dtable[row] += grads[position]
    return table[flat].reshape(*np.shape(ids), table.shape[1]), dtable

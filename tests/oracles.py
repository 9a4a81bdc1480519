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


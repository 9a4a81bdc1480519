"""The GEMM copy epilogue's hardware rounding (issue 16/18, session 15): on a device whose shaders
may ask for float16 conversions rounded to nearest even with subnormals kept (the fact
``fp16_exact_rounding``, from VkPhysicalDeviceFloatControlsProperties), the planner runs
``gemm_coopmat_copy_rte`` / ``gemm_coopmat_half_rte``, whose copy the hardware converts. That copy
must be numpy's astype(float16) bit for bit, as half_bits.glsl's is: ties, subnormal halves, the
largest half and overflow, signed zeros; a NaN stays a NaN (its payload is the hardware's)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_gelu_epilogue import _needs_coopmat

from actors.cpu_backend import cpu_facts
from actors.single_op import run_op
from flow.program import launch
from shaders import registry

# fp32 values whose float16 rounding is an edge: ties to even (1 + 2^-11 rounds down, 1 + 3 * 2^-11
# up), subnormal halves and the ties between them, the smallest normal half, the largest half,
# the last value that rounds to it and the first that overflows, signed zeros, infinities, NaNs
# with payloads.
EDGES = np.array(
    [1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 2**-24, 1.5 * 2**-24, 2.5 * 2**-24, 3e-6, -3e-6, 2**-14,
     2**-14 - 2**-25, 65504.0, 65519.99, 65520.0, -65520.0, 0.0, -0.0, np.inf, -np.inf, 1e-30],
    np.float32,
)  # fmt: skip
NANS = np.array([0x7FC00001, 0xFFC12345, 0x7F800001], np.uint32).view(np.float32)


def _gpu(exact: bool):
    features = ("timeline_semaphore", "cooperative_matrix", "fp16")
    features += ("fp16_exact_rounding",) if exact else ()
    return dataclasses.replace(cpu_facts(), kind="discrete", name="Test GPU", features=features)


@pytest.mark.parametrize("op", ["gemm_coopmat_copy", "gemm_coopmat_half"])
def test_the_hardware_rounding_variant_runs_only_where_the_device_rounds_exactly(op, monkeypatch):
    step = launch(op, ("A", "B", "bias", "C", "H"), M=64, N=64, K=32, a_half=1, b_half=1)
    assert registry.resolve(step, _gpu(exact=True)).op == f"{op}_rte"
    assert registry.resolve(step, _gpu(exact=False)).op == op
    assert registry.resolve(step, None).op == op
    monkeypatch.setattr(registry, "FP16_HARDWARE_ROUNDING", False)
    assert registry.resolve(step, _gpu(exact=True)).op == op


@pytest.mark.parametrize("op", ["gemm_coopmat_copy", "gemm_coopmat_half"])
def test_the_copy_rounds_every_edge_as_numpy(backend, rng, op):
    """A's two columns cancel exactly against B's rows (a - a, in fp32), so C is the bias: every
    edge value in every column, with random fp16 operands. On this device the launch resolves to
    the _rte variant where the device has the fact (the CPU backend emulates the plain op)."""
    _needs_coopmat(backend)
    values = np.concatenate([EDGES, NANS])
    m, n, k = 37, values.size + (values.size % 2), 16
    a = np.zeros((m, k), np.float16)
    a[:, 0] = a[:, 1] = rng.uniform(0.5, 2.0, m).astype(np.float16)
    b = rng.uniform(-2.0, 2.0, (k, n)).astype(np.float16)
    b[1] = -b[0]
    b[2:] = 0  # columns 2.. of A are zero, so the rest of B takes no part
    bias = np.resize(values, n).astype(np.float32)
    step = launch(op, ("A", "B", "bias", "C", "H"), M=m, N=n, K=k, a_half=1, b_half=1, has_bias=1)
    exact = backend.facts.has("fp16_exact_rounding")
    assert registry.resolve(step, backend.facts).op == (f"{op}_rte" if exact else op)
    c = rng.standard_normal((m, n)).astype(np.float32)
    arrays = {"A": a, "B": b, "bias": bias, "C": c.copy(), "H": np.zeros(m * n, np.float16)}
    with np.errstate(invalid="ignore", over="ignore"):  # a signalling NaN, and overflow to inf
        out = run_op(backend, op, arrays, M=m, N=n, K=k, a_half=1, b_half=1, has_bias=1)
        # C = (A B = +0) + bias in fp32: -0 becomes +0; a NaN stays a NaN, its payload the device's.
        want = np.broadcast_to(np.float32(0.0) + bias, (m, n))
    nan = np.isnan(want)
    if op == "gemm_coopmat_copy":
        got = out["C"]
        np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
        assert np.isnan(got[nan]).all()
    else:
        np.testing.assert_array_equal(out["C"], c)  # left as it was
    h = out["H"].reshape(m, n)
    with np.errstate(over="ignore"):
        rounded = want[~nan].astype(np.float16)
    np.testing.assert_array_equal(h[~nan].view(np.uint16), rounded.view(np.uint16))
    assert np.isnan(h[nan]).all()

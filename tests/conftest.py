"""Shared fixtures. The Vulkan backend is one per session (creating a device per test is slow, and
pytest-trio fixtures are per test), so it is a plain sync session fixture.

Vulkan tests are never skipped silently in CI: with VKFLOW_REQUIRE_VULKAN=1 (set by .ci/run) a
missing driver fails the run instead of skipping.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from actors.cpu_backend import CpuBackend


@pytest.fixture(scope="session")
def vulkan_backend():
    try:
        from actors.vulkan_backend import VulkanBackend, VulkanUnavailable
    except ImportError as error:  # the vulkan package itself is missing
        if os.environ.get("VKFLOW_REQUIRE_VULKAN") == "1":
            raise
        pytest.skip(f"vulkan package unavailable: {error}")
    try:
        backend = VulkanBackend()
    except VulkanUnavailable as error:
        if os.environ.get("VKFLOW_REQUIRE_VULKAN") == "1":
            raise
        pytest.skip(str(error))
    yield backend
    backend.close()


@pytest.fixture(params=["cpu", "vulkan"])
def backend(request):
    """Each op test runs on both backends against an independent numpy oracle."""
    if request.param == "cpu":
        return CpuBackend()
    return request.getfixturevalue("vulkan_backend")


@pytest.fixture
def rng(request):
    """Fresh random inputs on every run; the seed is printed, so pytest shows it on failure and
    VKFLOW_TEST_SEED=<seed> replays it."""
    seed = int(os.environ.get("VKFLOW_TEST_SEED") or np.random.SeedSequence().entropy % 2**63)
    print(f"rng seed for {request.node.nodeid}: {seed}")
    return np.random.default_rng(seed)


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """||actual - expected|| / ||expected||, the fp32 closeness measure used across op tests."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    denom = np.linalg.norm(expected)
    return float(np.linalg.norm(actual - expected) / (denom if denom > 0 else 1.0))

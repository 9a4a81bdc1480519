"""actors.vulkan's backend: an allocation over the budget names its bytes and the budget and leaves
the backend working, and large writes split across threads land exactly."""

from __future__ import annotations

import numpy as np
import pytest

from actors.memory import MemoryBudgetError
from flow.program import Arena, Layout, Tensor


def test_vulkan_over_budget_allocation_names_bytes_and_budget():
    from actors.vulkan import VulkanBackend

    backend = VulkanBackend(memory_fraction=1e-6)
    try:
        layout = Layout(
            arenas=(Arena("work", 64 * 2**20),), tensors=(Tensor("t", (16 * 2**20,), "float32", "work", 0),)
        )
        with pytest.raises(MemoryBudgetError) as error:
            backend.open_layout(layout)
        assert "work" in str(error.value) and f"{backend.budget:,}" in str(error.value)
        # The backend still works after the refusal.
        small = Layout(arenas=(Arena("work", 1024),), tensors=(Tensor("t", (7,), "float32", "work", 0),))
        backend.open_layout(small)
        values = np.random.default_rng(1).standard_normal(7).astype(np.float32)
        backend.write("t", values)
        np.testing.assert_array_equal(backend.read("t"), values)
    finally:
        backend.close()


def test_large_writes_split_across_threads_land_exactly(vulkan_backend, rng):
    count = 3_000_001  # > 8 MiB, odd: the chunks do not divide it evenly
    layout = Layout(
        arenas=(Arena("io", count * 4 + 256, host_visible=True),),
        tensors=(Tensor("t", (count,), "float32", "io", 0),),
    )
    vulkan_backend.open_layout(layout)
    values = rng.standard_normal(count).astype(np.float32)
    vulkan_backend.write("t", values)
    np.testing.assert_array_equal(vulkan_backend.read("t"), values)
    prefix = rng.standard_normal(2_500_000).astype(np.float32)
    vulkan_backend.write("t", prefix)
    back = vulkan_backend.read("t")
    np.testing.assert_array_equal(back[: prefix.size], prefix)
    np.testing.assert_array_equal(back[prefix.size :], values[prefix.size :])

"""The Vulkan backend, one module per job.

``library`` loads the binding (the only module that imports ``vulkan``); ``facts`` and
``features`` read what each device is and pick one; ``device`` opens it; ``queues_policy`` (pure)
and ``queues`` decide and run the queues, tickets and waits; ``memory`` places arenas and staging
buffers (its choices are pure code in ``actors/memory.py``); ``uploads`` moves batches by DMA;
``pipelines`` builds pipelines and descriptor sets; ``recording`` turns a Program into a command
buffer; ``timing`` owns timestamp pools; ``backend`` assembles them into ``VulkanBackend``.

The names below are imported on first use, not here: importing ``actors.vulkan.queues_policy`` (or
any pure module) then never loads the binding, so pure tests run where Vulkan is missing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actors.vulkan.backend import VulkanBackend
    from actors.vulkan.facts import enumerate_devices, select_device
    from actors.vulkan.library import VulkanUnavailable
    from actors.vulkan.timing import TimestampPool

__all__ = ["TimestampPool", "VulkanBackend", "VulkanUnavailable", "enumerate_devices", "select_device"]

_HOMES = {
    "VulkanBackend": "actors.vulkan.backend",
    "VulkanUnavailable": "actors.vulkan.library",
    "enumerate_devices": "actors.vulkan.facts",
    "select_device": "actors.vulkan.facts",
    "TimestampPool": "actors.vulkan.timing",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)

"""Timing on the GPU: timestamp query pools, resetting them and reading them in nanoseconds.

Host clocks measure Python, so benchmarks time kernels and copies with timestamps that the
queues write themselves: a program writes one before its first launch and one after each, an
upload one around its copy. This module owns the pools (freed with the backend) and the two ways
of resetting them, from the host where the device allows it and else on the compute queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from actors.vulkan import library
from actors.vulkan.library import check

if TYPE_CHECKING:
    from actors.vulkan.queues import Queues

# Assigned, not imported by name: see library's docstring (3.11 method calls).
ffi, lib, vk = library.ffi, library.lib, library.vk


@dataclass
class TimestampPool:
    """A timestamp query pool.

    Attributes:
        pool: the VkQueryPool.
        count: its queries.
        host_reset: programs recorded with it leave resetting the queries to the host
            (``reset_timestamps`` before each submission), so the command buffer holds only the
            program and its timestamps; only where the device resets queries from the host.
    """

    pool: object
    count: int
    host_reset: bool = False


class Timestamps:
    """The timestamp pools of one device."""

    def __init__(self, queues: Queues) -> None:
        self._queues = queues
        self._pools: list[TimestampPool] = []

    def new_pool(self, count: int, host_reset: bool = False) -> TimestampPool:
        """A pool of ``count`` timestamps; ``host_reset`` only where the device has
        host_query_reset."""
        info = ffi.new(
            "VkQueryPoolCreateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
                "queryType": vk.VK_QUERY_TYPE_TIMESTAMP,
                "queryCount": count,
            },
        )
        handle = ffi.new("VkQueryPool*")
        device = self._queues.device
        check(lib.vkCreateQueryPool(device, info, ffi.NULL, handle), "vkCreateQueryPool")
        pool = TimestampPool(
            pool=handle[0], count=count, host_reset=host_reset and self._queues.facts.has("host_query_reset")
        )
        self._pools.append(pool)
        return pool

    def reset(self, pool: TimestampPool) -> None:
        """Make every query of ``pool`` writable again (no submitted work may still write it).

        A transfer queue cannot reset queries itself (vkCmdResetQueryPool needs a graphics or
        compute queue), so this resets from the host where the device allows it, else with a
        submission on the compute queue that waits for the work queued there.
        """
        queues = self._queues
        if queues.facts.has("host_query_reset"):
            lib.vkResetQueryPool(queues.device, pool.pool, 0, pool.count)
            return
        command = queues.begin_one_shot()
        lib.vkCmdResetQueryPool(command, pool.pool, 0, pool.count)
        queues.finish_one_shot(command)

    def read_ns(self, pool: TimestampPool) -> np.ndarray:
        """The pool's timestamps in nanoseconds (call after the submission is done)."""
        data = np.zeros(pool.count, dtype=np.uint64)
        flags = vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT
        check(
            lib.vkGetQueryPoolResults(
                self._queues.device, pool.pool, 0, pool.count, data.nbytes, ffi.from_buffer(data), 8, flags
            ),
            "vkGetQueryPoolResults",
        )
        return data.astype(np.float64) * self._queues.facts.timestamp_period_ns

    def close(self) -> None:
        """Destroy every pool made here."""
        for pool in self._pools:
            lib.vkDestroyQueryPool(self._queues.device, pool.pool, ffi.NULL)
        self._pools = []

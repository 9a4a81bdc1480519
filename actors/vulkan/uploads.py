"""Uploads: DMA copies from pinned host staging memory into tensors, on the upload queue.

Like a pinned host tensor copied on a side stream in PyTorch: the host fills a staging buffer
(``staging_view``), and the copy engine moves it while compute runs. Each tensor and slot has one
staging buffer, allocated on first use, and one copy command buffer per timestamp setting,
recorded once and replayed; both are freed with the layout. Several threads (loaders) may ask for
them at once, and a command pool must not be used from two threads, hence the lock. Ordering
against programs is the queues' job (``Queues.submit_upload``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from actors.vulkan import library
from actors.vulkan.library import check
from actors.vulkan.memory import Staging
from actors.vulkan.queues import Recorded
from actors.vulkan.recording import memory_barrier
from flow.program import Tensor

if TYPE_CHECKING:
    from actors.vulkan.memory import DeviceMemory
    from actors.vulkan.queues import Queues
    from actors.vulkan.timing import TimestampPool

# Assigned, not imported by name: see library's docstring (3.11 method calls).
ffi, lib, vk = library.ffi, library.lib, library.vk


class Uploads:
    """The staging buffers and recorded copies of one device's open layout."""

    def __init__(self, queues: Queues, memory: DeviceMemory) -> None:
        self._queues = queues
        self._memory = memory
        self._lock = threading.Lock()
        self.staging: dict[tuple[str, int], Staging] = {}
        self._commands: dict[tuple, Recorded] = {}

    def staging_for(self, declared: Tensor, slot: int) -> Staging:
        """``declared``'s staging buffer for ``slot``, made on first use."""
        key = (declared.name, slot)
        with self._lock:
            staging = self.staging.get(key)
            if staging is None:
                staging = self.staging[key] = self._new_staging(declared, slot)
        return staging

    def prepare(
        self, declared: Tensor, slot: int, timestamps: TimestampPool | None, query: int
    ) -> tuple[Staging, Recorded]:
        """(staging buffer, recorded copy) of an upload into ``declared`` for ``slot``.

        Args:
            declared: the tensor.
            slot: which per-slot copy (and staging buffer).
            timestamps: a pool the copy writes its start and end into, or None.
            query: the first of its two queries.
        """
        key = (declared.name, slot)
        with self._lock:
            staging = self.staging.get(key)
            if staging is None:
                staging = self.staging[key] = self._new_staging(declared, slot)
            return staging, self._command(declared, slot, staging, timestamps, query)

    def _new_staging(self, declared: Tensor, slot: int) -> Staging:
        return self._memory.new_staging(f"staging for {declared.name!r} [slot {slot}]", declared)

    def _command(
        self, declared: Tensor, slot: int, staging: Staging, timestamps: TimestampPool | None, query: int
    ) -> Recorded:
        """The copy's command buffer, recorded once per tensor, slot (and timestamp queries) and
        replayed; several may be pending at once (back-to-back uploads), hence SIMULTANEOUS_USE."""
        pool_id = None if timestamps is None else int(ffi.cast("uintptr_t", timestamps.pool))
        key = (declared.name, slot, pool_id, query if timestamps is not None else 0)
        if key in self._commands:
            return self._commands[key]
        handles = self._queues.allocate_command_buffer(upload=True)
        command = handles[0]
        begin = ffi.new(
            "VkCommandBufferBeginInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                "flags": vk.VK_COMMAND_BUFFER_USAGE_SIMULTANEOUS_USE_BIT,
            },
        )
        check(lib.vkBeginCommandBuffer(command, begin), "vkBeginCommandBuffer")
        # Copies into the same tensor land in submission order. Only transfer stages: a
        # transfer-only queue supports no others; compute is ordered by the semaphores (or, on a
        # shared queue, by the programs' own full barriers).
        stage = vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        memory_barrier(
            command,
            vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            vk.VK_ACCESS_TRANSFER_READ_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            stage,
        )
        if timestamps is not None:
            # At the transfer stage, not top of pipe: the start then excludes waiting for the
            # previous copy, so the pair times this copy alone (as CUDA events on a stream do).
            lib.vkCmdWriteTimestamp(command, stage, timestamps.pool, query)
        copy = {"srcOffset": 0, "dstOffset": declared.offset, "size": declared.nbytes}
        region = ffi.new("VkBufferCopy*", copy)
        target = self._memory.arena_for(declared, slot)
        lib.vkCmdCopyBuffer(command, staging.buffer, target.buffer, 1, region)
        if timestamps is not None:
            lib.vkCmdWriteTimestamp(command, stage, timestamps.pool, query + 1)
        check(lib.vkEndCommandBuffer(command), "vkEndCommandBuffer")
        # The copy signals the upload timeline; its waiting form first waits for compute.
        plain, waiting = self._queues.submit_infos(handles, upload=True)
        self._commands[key] = Recorded(handles=handles, plain=plain, waiting=waiting)
        return self._commands[key]

    def has_objects(self) -> bool:
        """Whether a copy or staging buffer was made since the last ``release`` (then the device
        must go idle before they are freed)."""
        return bool(self._commands or self.staging)

    def release(self) -> None:
        """Free every recorded copy and staging buffer (the device must be idle)."""
        queues = self._queues
        for command in self._commands.values():
            lib.vkFreeCommandBuffers(queues.device, queues.upload_pool, 1, command.handles)
        self._commands = {}
        for staging in self.staging.values():
            self._memory.free_staging(staging)
        self.staging = {}

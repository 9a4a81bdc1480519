"""Device memory: large VkDeviceMemory blocks, the plan's arenas placed in them as buffers, and
pinned host staging buffers.

The choices (which memory type, where in which block, whether every arena can be mapped) are
pure code in ``actors/memory.py``; this module carries them out on the device and owns what it
made: blocks stay mapped for their life where host-visible, arenas live until the next layout,
staging buffers are their own allocations of host memory outside the device budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from actors.memory import BlockAllocator, Placement, choose_memory_type, choose_staging_type, has_rebar
from actors.vulkan import library
from actors.vulkan.library import check
from flow.device_facts import DeviceFacts, MemoryType
from flow.program import Layout, Tensor

# Assigned, not imported by name: see library's docstring (3.11 method calls).
ffi, lib, vk = library.ffi, library.lib, library.vk


@dataclass
class ArenaBuffer:
    """One arena (or a temporary staging copy) as a VkBuffer inside a block."""

    buffer: object
    placement: Placement
    size: int
    mapped: object | None  # cffi pointer to the first byte, when host visible
    cached: bool = False  # host-cached memory: fast for the CPU to read


@dataclass
class Staging:
    """Pinned host memory for one tensor and slot: the source of its uploads."""

    buffer: object
    memory: object
    view: np.ndarray  # shaped and typed as the tensor, onto the mapped memory
    ticket: int = 0  # the latest upload that reads it


class DeviceMemory:
    """Blocks, the open layout's arenas and staging buffers of one device.

    Args:
        device: the VkDevice.
        facts: its facts (memory types and heaps).
        budget: bytes the blocks may hold in all.
        block_bytes: size of a block (a larger buffer gets a block of its own).
        families: (compute, upload) queue families; buffers are shared by both where they differ.
    """

    def __init__(
        self, device, facts: DeviceFacts, budget: int, block_bytes: int, families: tuple[int, int]
    ) -> None:
        self.device = device
        self.facts = facts
        self.allocator = BlockAllocator(budget, block_bytes)
        self._blocks: list[object] = []
        self._block_maps: dict[int, object] = {}
        self.layout: Layout | None = None
        self.slots = 0
        self.arenas: dict[tuple[str, int], ArenaBuffer] = {}
        # Arenas are shared by the compute and transfer families without ownership transfers
        # (a pre-recorded program cannot acquire a buffer per upload); buffers lose nothing by it.
        self._concurrent = families[0] != families[1]
        self._sharing = ffi.new("uint32_t[]", list(families))

    # -- buffers in blocks ----------------------------------------------------------------------
    def create_buffer(
        self, name: str, size: int, host_visible: bool, host_reads: bool = False
    ) -> ArenaBuffer:
        """A storage and transfer buffer placed in a block of the memory type the flags ask for.

        Raises:
            MemoryBudgetError: it would take the device over its budget.
        """
        usage = (
            vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT
            | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
            | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT
        )
        info = ffi.new(
            "VkBufferCreateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO,
                "size": size,
                "usage": usage,
                "sharingMode": vk.VK_SHARING_MODE_EXCLUSIVE,
            },
        )
        if self._concurrent:
            info.sharingMode = vk.VK_SHARING_MODE_CONCURRENT
            info.queueFamilyIndexCount = 2
            info.pQueueFamilyIndices = self._sharing
        handle = ffi.new("VkBuffer*")
        check(lib.vkCreateBuffer(self.device, info, ffi.NULL, handle), f"vkCreateBuffer({name})")
        buffer = handle[0]
        requirements = ffi.new("VkMemoryRequirements*")
        lib.vkGetBufferMemoryRequirements(self.device, buffer, requirements)
        memory_type = choose_memory_type(
            self.facts.memory_types, requirements.memoryTypeBits, host_visible, host_reads
        )
        try:
            placement, new_block = self.allocator.place(
                name, int(requirements.size), int(requirements.alignment), memory_type.index
            )
        except Exception:
            lib.vkDestroyBuffer(self.device, buffer, ffi.NULL)
            raise
        if new_block is not None:
            self._allocate_block(new_block, memory_type)
        block = self._blocks[placement.block]
        check(
            lib.vkBindBufferMemory(self.device, buffer, block, placement.offset),
            f"vkBindBufferMemory({name})",
        )
        mapped = None
        if "host_visible" in memory_type.flags:
            mapped = self._block_maps[placement.block] + placement.offset
        return ArenaBuffer(
            buffer=buffer,
            placement=placement,
            size=size,
            mapped=mapped,
            cached="host_cached" in memory_type.flags,
        )

    def _allocate_block(self, size: int, memory_type: MemoryType) -> None:
        info = ffi.new(
            "VkMemoryAllocateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                "allocationSize": size,
                "memoryTypeIndex": memory_type.index,
            },
        )
        handle = ffi.new("VkDeviceMemory*")
        result = lib.vkAllocateMemory(self.device, info, ffi.NULL, handle)
        if result != 0:
            self.allocator.blocks.pop()
            raise MemoryError(
                f"vkAllocateMemory of {size:,} bytes (type {memory_type.index}) failed: {result}"
            )
        self._blocks.append(handle[0])
        if "host_visible" in memory_type.flags:
            pointer = ffi.new("void**")
            check(lib.vkMapMemory(self.device, handle[0], 0, size, 0, pointer), "vkMapMemory")
            self._block_maps[len(self._blocks) - 1] = ffi.cast("char*", pointer[0])

    def free_buffer(self, arena: ArenaBuffer) -> None:
        """Destroy a buffer from ``create_buffer`` and give its bytes back (its block stays)."""
        lib.vkDestroyBuffer(self.device, arena.buffer, ffi.NULL)
        self.allocator.release(arena.placement)

    # -- the layout's arenas --------------------------------------------------------------------
    def open_layout(self, layout: Layout, slots: int) -> None:
        """Create every arena of ``layout`` (per-slot ones ``slots`` times); the previous layout's
        must have been released."""
        self.layout = layout
        self.slots = slots
        # Every arena is mappable where the device has ReBAR-style memory, so weights and
        # batches move without staging copies; elsewhere only host-visible arenas are.
        rebar = has_rebar(self.facts)
        for arena in layout.arenas:
            for slot in range(slots if arena.per_slot else 1):
                name = arena.name if not arena.per_slot else f"{arena.name}[slot {slot}]"
                self.arenas[(arena.name, slot)] = self.create_buffer(
                    name, max(arena.nbytes, 256), arena.host_visible or rebar
                )

    def release_layout(self) -> None:
        """Destroy the arenas (the device must be idle)."""
        for arena in self.arenas.values():
            self.free_buffer(arena)
        self.arenas = {}

    def arena_for(self, tensor: Tensor, slot: int) -> ArenaBuffer:
        """The buffer holding ``tensor`` for ``slot``.

        Raises:
            IndexError: a per-slot tensor and a slot out of range.
        """
        assert self.layout is not None, "open_layout first"
        arena = self.layout.arena(tensor.arena)
        if arena.per_slot and not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range (0..{self.slots - 1})")
        return self.arenas[(arena.name, slot if arena.per_slot else 0)]

    def buffer_key(self, tensor: Tensor, slot: int) -> tuple[str, int]:
        """(arena, slot) of the buffer holding ``tensor``: what QueueOrder orders by."""
        assert self.layout is not None, "open_layout first"
        arena = self.layout.arena(tensor.arena)
        return (arena.name, slot if arena.per_slot else 0)

    # -- pinned host staging --------------------------------------------------------------------
    def new_staging(self, name: str, declared: Tensor) -> Staging:
        """A buffer in its own allocation of pinned host memory, mapped for the buffer's life.
        Outside the block allocator: that budget is the device-local heap's, this is host memory."""
        info = ffi.new(
            "VkBufferCreateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO,
                "size": max(declared.nbytes, 4),
                "usage": vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT,
                "sharingMode": vk.VK_SHARING_MODE_EXCLUSIVE,  # only the transfer queue reads it
            },
        )
        handle = ffi.new("VkBuffer*")
        check(lib.vkCreateBuffer(self.device, info, ffi.NULL, handle), f"vkCreateBuffer({name})")
        buffer = handle[0]
        requirements = ffi.new("VkMemoryRequirements*")
        lib.vkGetBufferMemoryRequirements(self.device, buffer, requirements)
        try:
            memory_type = choose_staging_type(self.facts.memory_types, requirements.memoryTypeBits)
            allocate = ffi.new(
                "VkMemoryAllocateInfo*",
                {
                    "sType": vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                    "allocationSize": requirements.size,
                    "memoryTypeIndex": memory_type.index,
                },
            )
            memory = ffi.new("VkDeviceMemory*")
            result = lib.vkAllocateMemory(self.device, allocate, ffi.NULL, memory)
            if result != 0:
                raise MemoryError(
                    f"{name}: vkAllocateMemory of {int(requirements.size):,} bytes of host memory "
                    f"(type {memory_type.index}) failed: {result}"
                )
        except Exception:
            lib.vkDestroyBuffer(self.device, buffer, ffi.NULL)
            raise
        check(lib.vkBindBufferMemory(self.device, buffer, memory[0], 0), f"vkBindBufferMemory({name})")
        pointer = ffi.new("void**")
        check(lib.vkMapMemory(self.device, memory[0], 0, requirements.size, 0, pointer), "vkMapMemory")
        raw = ffi.buffer(ffi.cast("char*", pointer[0]), declared.nbytes)
        view = np.frombuffer(raw, dtype=np.dtype(declared.dtype)).reshape(declared.shape)
        return Staging(buffer=buffer, memory=memory[0], view=view)

    def free_staging(self, staging: Staging) -> None:
        """Destroy a staging buffer and free (so also unmap) its memory."""
        lib.vkDestroyBuffer(self.device, staging.buffer, ffi.NULL)
        lib.vkFreeMemory(self.device, staging.memory, ffi.NULL)

    def close(self) -> None:
        """Unmap and free every block (every buffer in them must be gone)."""
        for index, block in enumerate(self._blocks):
            if index in self._block_maps:
                lib.vkUnmapMemory(self.device, block)
            lib.vkFreeMemory(self.device, block, ffi.NULL)
        self._blocks = []

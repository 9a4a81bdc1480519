"""Device memory decisions, as pure code: which memory type to use, and where each buffer goes
inside large blocks, with bytes in use tracked against the budget.

The Vulkan backend asks this module what to do and then does it; nothing here touches a device,
so allocation policy is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flow.device_facts import DeviceFacts, MemoryType

DEFAULT_BLOCK_BYTES = 64 * 2**20


class MemoryBudgetError(MemoryError):
    """A request that would take a device over its memory budget."""

    def __init__(self, request: str, nbytes: int, in_use: int, budget: int) -> None:
        self.request, self.nbytes, self.in_use, self.budget = request, nbytes, in_use, budget
        super().__init__(
            f"{request}: needs {nbytes:,} bytes, but {in_use:,} of the {budget:,}-byte budget are in use "
            f"({budget - in_use:,} free)"
        )


def choose_memory_type(
    types: Sequence[MemoryType], allowed_bits: int, host_visible: bool, host_reads: bool = False
) -> MemoryType:
    """Pick a memory type by its flags, never by its index.

    For host-visible requests prefer device-local + host-visible + coherent memory (ReBAR: the host
    writes batches straight into VRAM), then host-visible + coherent. Otherwise prefer device-local.

    Args:
        types: the device's memory types.
        allowed_bits: VkMemoryRequirements.memoryTypeBits of the buffer.
        host_visible: whether the host must map it.
        host_reads: the host reads it back in bulk: prefer cached memory, since reading
            uncached (write-combined) device memory from the CPU is an order of magnitude slower.

    Returns:
        The chosen type.

    Raises:
        MemoryError: when no allowed type fits.
    """
    allowed = [t for t in types if allowed_bits & (1 << t.index)]
    if host_reads:
        preferences = [{"host_visible", "host_coherent", "host_cached"}, {"host_visible", "host_coherent"}]
    elif host_visible:
        preferences = [
            {"device_local", "host_visible", "host_coherent"},
            {"host_visible", "host_coherent"},
        ]
    else:
        preferences = [{"device_local"}, set()]
    for wanted in preferences:
        for memory_type in allowed:
            if wanted <= set(memory_type.flags):
                return memory_type
    raise MemoryError(f"no memory type fits (host_visible={host_visible}, allowed bits {allowed_bits:#x})")


def choose_staging_type(types: Sequence[MemoryType], allowed_bits: int) -> MemoryType:
    """Pick the memory type of a pinned host staging buffer, the source of DMA uploads.

    System memory (not device-local) that is host-visible and coherent, cached where offered:
    what CUDA's pinned host memory is, so the CPU fills it at full speed and the copy engine reads
    it across the bus. Devices whose memory is all one kind (integrated GPUs, lavapipe) fall back to
    any host-visible coherent type.

    Args:
        types: the device's memory types.
        allowed_bits: VkMemoryRequirements.memoryTypeBits of the buffer.

    Returns:
        The chosen type.

    Raises:
        MemoryError: when no allowed type is host-visible and coherent.
    """
    allowed = [t for t in types if allowed_bits & (1 << t.index)]
    coherent = {"host_visible", "host_coherent"}
    ranked = (
        [t for t in allowed if coherent | {"host_cached"} <= set(t.flags) and "device_local" not in t.flags],
        [t for t in allowed if coherent <= set(t.flags) and "device_local" not in t.flags],
        [t for t in allowed if coherent | {"host_cached"} <= set(t.flags)],
        [t for t in allowed if coherent <= set(t.flags)],
    )
    for candidates in ranked:
        if candidates:
            return candidates[0]
    raise MemoryError(f"no host-visible coherent memory type for staging (allowed bits {allowed_bits:#x})")


def has_rebar(facts: DeviceFacts) -> bool:
    """Whether the largest device-local heap is also host-visible and coherent (ReBAR), so every
    arena can be mapped and weights and batches move without staging copies.

    Args:
        facts: the device.

    Returns:
        True where some memory type of that heap is device-local, host-visible and coherent.
    """
    largest = max((h for h in facts.heaps if h.device_local), key=lambda h: h.size, default=None)
    if largest is None:
        return False
    return any(
        {"device_local", "host_visible", "host_coherent"} <= set(t.flags) and t.heap == largest.index
        for t in facts.memory_types
    )


@dataclass(frozen=True)
class Placement:
    """Where one buffer lives: block ``block`` of memory type ``memory_type``, at ``offset``."""

    name: str
    memory_type: int
    block: int
    offset: int
    size: int


@dataclass
class _Block:
    memory_type: int
    size: int
    free: list[tuple[int, int]]  # (offset, size), sorted by offset


class BlockAllocator:
    """First-fit sub-allocation inside large blocks, one list of blocks per memory type.

    ``place`` returns a placement and, when a new block is needed, its size; the caller then
    allocates that block on the device. Bytes in use count what buffers asked for.
    """

    def __init__(self, budget: int, block_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
        self.budget = budget
        self.block_bytes = block_bytes
        self.in_use = 0
        self.blocks: list[_Block] = []

    def place(self, name: str, size: int, alignment: int, memory_type: int) -> tuple[Placement, int | None]:
        """Find room for a buffer.

        Args:
            name: what the buffer is for (named in errors).
            size: bytes.
            alignment: required offset alignment.
            memory_type: the memory type index chosen for it.

        Returns:
            (placement, new_block_size): new_block_size is None when an existing block had room,
            else the size of the block the caller must allocate as block ``placement.block``.

        Raises:
            MemoryBudgetError: when the request does not fit in the budget.
        """
        if size <= 0:
            raise ValueError(f"{name}: buffer size must be > 0, got {size}")
        if self.in_use + size > self.budget:
            raise MemoryBudgetError(name, size, self.in_use, self.budget)
        for index, block in enumerate(self.blocks):
            if block.memory_type != memory_type:
                continue
            offset = self._take(block, size, alignment)
            if offset is not None:
                self.in_use += size
                return Placement(name, memory_type, index, offset, size), None
        block_size = max(self.block_bytes, _round_up(size, alignment))
        block = _Block(memory_type, block_size, [(0, block_size)])
        self.blocks.append(block)
        offset = self._take(block, size, alignment)
        assert offset == 0
        self.in_use += size
        return Placement(name, memory_type, len(self.blocks) - 1, 0, size), block_size

    def release(self, placement: Placement) -> None:
        """Give a placement's bytes back to its block."""
        block = self.blocks[placement.block]
        block.free.append((placement.offset, placement.size))
        block.free.sort()
        merged: list[tuple[int, int]] = []
        for offset, size in block.free:
            if merged and merged[-1][0] + merged[-1][1] >= offset:
                last_offset, last_size = merged[-1]
                merged[-1] = (last_offset, max(last_size, offset + size - last_offset))
            else:
                merged.append((offset, size))
        block.free = merged
        self.in_use -= placement.size

    @staticmethod
    def _take(block: _Block, size: int, alignment: int) -> int | None:
        for position, (offset, free_size) in enumerate(block.free):
            start = _round_up(offset, alignment)
            end = start + size
            if end <= offset + free_size:
                pieces = []
                if start > offset:
                    pieces.append((offset, start - offset))
                if end < offset + free_size:
                    pieces.append((end, offset + free_size - end))
                block.free[position : position + 1] = pieces
                return start
        return None


def _round_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment

"""actors.memory, the memory policy a backend asks: memory types chosen by their flags, never their
index (for device buffers and for staging), and the block allocator that sub-allocates, reuses
and enforces the budget."""

from __future__ import annotations

import pytest

from actors.backend import MemoryType
from actors.memory import BlockAllocator, MemoryBudgetError, choose_memory_type, choose_staging_type

H100_TYPES = (
    MemoryType(0, 1, ()),
    MemoryType(1, 0, ("device_local",)),
    MemoryType(2, 1, ("host_visible", "host_coherent")),
    MemoryType(3, 1, ("host_visible", "host_coherent", "host_cached")),
    MemoryType(4, 0, ("device_local", "host_visible", "host_coherent")),
)


def test_memory_types_are_chosen_by_flags_not_index():
    assert choose_memory_type(H100_TYPES, 0b11111, host_visible=True).index == 4
    assert choose_memory_type(H100_TYPES, 0b01111, host_visible=True).index == 2
    assert choose_memory_type(H100_TYPES, 0b11111, host_visible=False).index == 1
    reversed_types = tuple(MemoryType(4 - t.index, t.heap, t.flags) for t in H100_TYPES)
    assert choose_memory_type(reversed_types, 0b11111, host_visible=True).index == 0
    with pytest.raises(MemoryError):
        choose_memory_type(H100_TYPES, 0b00001, host_visible=True)


def test_staging_memory_is_cached_host_memory_where_there_is_some():
    assert choose_staging_type(H100_TYPES, 0b11111).index == 3
    assert choose_staging_type(H100_TYPES, 0b10111).index == 2  # uncached system memory next
    assert choose_staging_type(H100_TYPES, 0b10011).index == 4  # ReBAR only as a last resort
    lavapipe = (MemoryType(0, 0, ("device_local", "host_visible", "host_coherent", "host_cached")),)
    assert choose_staging_type(lavapipe, 0b1).index == 0
    with pytest.raises(MemoryError):
        choose_staging_type(H100_TYPES, 0b00011)


def test_block_allocator_sub_allocates_reuses_and_enforces_the_budget(rng):
    allocator = BlockAllocator(budget=10_000, block_bytes=4096)
    sizes = [int(s) for s in rng.integers(1, 900, 8)]
    placements = []
    for i, size in enumerate(sizes):
        placement, _ = allocator.place(f"t{i}", size, 64, memory_type=0)
        assert placement.offset % 64 == 0
        placements.append(placement)
    assert len(allocator.blocks) <= 2  # sub-allocated, not one block per buffer
    spans = sorted((p.block, p.offset, p.offset + p.size) for p in placements)
    for (b1, _, end), (b2, start, _) in zip(spans, spans[1:], strict=False):
        assert b1 != b2 or end <= start
    assert allocator.in_use == sum(sizes)
    with pytest.raises(MemoryBudgetError) as error:
        allocator.place("huge activation", 10_000, 64, 0)
    message = str(error.value)
    assert "huge activation" in message and "10,000" in message and f"{sum(sizes):,}" in message
    for placement in placements:
        allocator.release(placement)
    assert allocator.in_use == 0
    again, new_block = allocator.place("after release", 4000, 64, 0)
    assert new_block is None and again.offset == 0

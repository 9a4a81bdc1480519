"""actors.backend, the interface both backends implement: the memory budget prefers the driver's
budget, then the heap's size."""

from __future__ import annotations

from actors.backend import MemoryHeap, memory_budget
from actors.cpu_backend import cpu_facts


def test_budget_prefers_the_driver_budget_then_the_heap_size():
    facts = cpu_facts(memory_bytes=1000)
    assert memory_budget(facts, 0.9) == 900
    from dataclasses import replace

    with_budget = replace(facts, heaps=(MemoryHeap(0, 1000, True, budget=600),))
    assert memory_budget(with_budget, 0.5) == 300

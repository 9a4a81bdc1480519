"""Backends and devices: memory placement and budget, device facts, the no-driver fallback, and
the shader cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from actors.backend import MemoryHeap, MemoryType, memory_budget
from actors.cpu_backend import cpu_facts
from actors.memory import BlockAllocator, MemoryBudgetError, choose_memory_type
from flow.program import Arena, Layout, Tensor

ROOT = Path(__file__).resolve().parent.parent

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


def test_budget_prefers_the_driver_budget_then_the_heap_size():
    facts = cpu_facts(memory_bytes=1000)
    assert memory_budget(facts, 0.9) == 900
    from dataclasses import replace

    with_budget = replace(facts, heaps=(MemoryHeap(0, 1000, True, budget=600),))
    assert memory_budget(with_budget, 0.5) == 300


def test_the_cpu_heap_is_this_machines_memory_and_its_budget_what_is_available_now():
    (heap,) = cpu_facts().heaps
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < heap.size <= physical  # less only under a container's limit
    assert heap.budget is not None and 0 < heap.budget <= heap.size
    assert memory_budget(cpu_facts(), 0.5) <= heap.size // 2
    meminfo = Path("/proc/meminfo").read_text().split()
    available = int(meminfo[meminfo.index("MemAvailable:") + 1]) * 1024
    limits = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
    if not any(limit.exists() for limit in limits):
        assert abs(heap.budget - available) < physical // 20  # memory moves a little between reads


def test_the_cpu_budget_reads_meminfo_and_a_containers_cgroup_limit(tmp_path):
    from actors.cpu_backend import host_memory

    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    cgroup.mkdir()
    (proc / "meminfo").write_text("MemTotal:  1000 kB\nMemFree:  10 kB\nMemAvailable:    3000 kB\n")
    assert host_memory(proc, cgroup) == (physical, 3000 * 1024)  # no limit: the host's figures
    (cgroup / "memory.max").write_text("max\n")
    assert host_memory(proc, cgroup) == (physical, 3000 * 1024)  # cgroup v2 without a limit
    (cgroup / "memory.max").write_text(f"{2 * 2**20}\n")
    (cgroup / "memory.current").write_text(f"{2**20 + 512}\n")
    assert host_memory(proc, cgroup) == (2 * 2**20, 2**20 - 512)  # the limit less the group's use
    (cgroup / "memory.max").unlink()
    v1 = cgroup / "memory"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text(f"{2**40}\n")  # v1's "no limit" is a huge number
    (v1 / "memory.usage_in_bytes").write_text("0\n")
    assert host_memory(proc, cgroup) == (min(physical, 2**40), 3000 * 1024)
    (proc / "meminfo").write_text("MemTotal:  1000 kB\n")  # a kernel before 3.14: no budget
    (v1 / "memory.limit_in_bytes").unlink()
    assert host_memory(proc, cgroup) == (physical, None)


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


def test_devices_json_lists_the_device_with_its_facts(vulkan_backend):
    done = subprocess.run(
        [sys.executable, "-m", "flow", "devices", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    listing = json.loads(done.stdout)
    names = [d["name"] for d in listing["devices"]]
    assert vulkan_backend.facts.name in names
    device = listing["devices"][names.index(vulkan_backend.facts.name)]
    assert device["subgroup_size"] == vulkan_backend.facts.subgroup_size > 0
    assert device["shared_memory_bytes"] >= 16384
    assert "timeline_semaphore" in device["features"]
    assert any(f["compute"] for f in device["queue_families"])


def test_no_driver_gives_a_clear_message_and_the_cpu_fallback(tmp_path):
    env = dict(
        os.environ, VK_DRIVER_FILES=str(tmp_path / "missing.json"), VK_ICD_FILENAMES=str(tmp_path / "x.json")
    )
    script = (
        "from actors.device_select import list_devices, open_device, select_facts\n"
        "devices, message = list_devices()\n"
        "facts, why = select_facts('auto')\n"
        "backend = open_device(facts)\n"
        "print(len(devices), type(backend).__name__)\n"
        "print(message)\n"
        "print(why)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, check=True
    )
    first, message, why = done.stdout.splitlines()[:3]
    assert first == "0 CpuBackend"
    assert "CPU" in message and "CPU" in why
    cli = subprocess.run(
        [sys.executable, "-m", "flow", "devices"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=True,
    )
    assert "CPU" in cli.stdout


def test_compiled_shaders_are_cached_by_content_outside_the_tree(tmp_path, monkeypatch):
    from shaders import compiler

    monkeypatch.setenv("VKFLOW_CACHE", str(tmp_path / "cache"))
    first = compiler.compile_shader("fill.comp")
    files = list((tmp_path / "cache" / "spirv").glob("fill-*.spv"))
    assert len(files) == 1 and files[0].read_bytes() == first
    assert first[:4] == b"\x03\x02\x23\x07"  # the SPIR-V magic number
    compiler.compile_shader("fill.comp", {"UNUSED_DEFINE": "1"})
    assert len(list((tmp_path / "cache" / "spirv").glob("fill-*.spv"))) == 2  # a new key per variant
    assert not list((ROOT / "shaders").glob("**/*.spv"))


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

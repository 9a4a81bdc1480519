"""actors.cpu_backend's memory: its heap is this machine's memory and its budget what is available
now, read from /proc/meminfo and a container's cgroup limit."""

from __future__ import annotations

import os
from pathlib import Path

from actors.backend import memory_budget
from actors.cpu_backend import cpu_facts


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

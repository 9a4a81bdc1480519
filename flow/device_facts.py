"""What a compute device is, as plain data: its queues, memory, limits and features.

Records (the bottom tier of flow): backends report them, the planner decides from them (tiles that
fit the shared memory, a memory budget, features such as cooperative matrices), and ``flow
devices`` prints them. :func:`memory_budget` is the one rule that turns them into a byte budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The vendor the CPU (numpy) backend reports: its kind, "cpu", is also lavapipe's.
NUMPY_VENDOR = "numpy"


@dataclass(frozen=True)
class QueueFamily:
    index: int
    count: int
    graphics: bool
    compute: bool
    transfer: bool
    timestamp_bits: int = 0  # timestampValidBits: 0 means the family's queues cannot write timestamps


@dataclass(frozen=True)
class MemoryHeap:
    index: int
    size: int
    device_local: bool
    budget: int | None = None  # from VK_EXT_memory_budget where the driver has it


@dataclass(frozen=True)
class MemoryType:
    index: int
    heap: int
    flags: tuple[str, ...]  # e.g. ("device_local", "host_visible", "host_coherent")


@dataclass(frozen=True)
class DeviceFacts:
    """What we know about one compute device, as plain data (printable, JSON-able)."""

    index: int
    name: str
    kind: str  # "discrete", "integrated", "virtual", "cpu", "other"
    vendor: str
    vendor_id: int
    api_version: str
    driver_version: str
    queue_families: tuple[QueueFamily, ...] = ()
    heaps: tuple[MemoryHeap, ...] = ()
    memory_types: tuple[MemoryType, ...] = ()
    max_workgroup_size: tuple[int, int, int] = (1024, 1024, 64)
    max_workgroup_invocations: int = 1024
    max_workgroup_count: tuple[int, int, int] = (65535, 65535, 65535)
    shared_memory_bytes: int = 32768
    subgroup_size: int = 32
    max_push_constants: int = 128
    max_storage_buffer_range: int = 2**27
    min_storage_offset_alignment: int = 16
    timestamp_period_ns: float = 1.0
    features: tuple[str, ...] = ()  # "fp16", "int8", "storage16", "timeline_semaphore", ...
    cooperative_matrix_shapes: tuple[str, ...] = ()  # "16x16x16 float16->float32"
    extensions: tuple[str, ...] = field(default=(), repr=False)

    def has(self, feature: str) -> bool:
        return feature in self.features

    @property
    def is_numpy(self) -> bool:
        """The CPU (numpy) backend, as opposed to a Vulkan device: lavapipe's kind is "cpu" too."""
        return self.vendor == NUMPY_VENDOR

    @property
    def memory_bytes(self) -> int:
        """Size of the largest device-local heap (the one tensors live in)."""
        local = [h for h in self.heaps if h.device_local] or list(self.heaps)
        return max((h.size for h in local), default=0)


def memory_budget(facts: DeviceFacts, fraction: float = 0.9) -> int:
    """Bytes a run may use on this device: the driver's budget for the device-local heap where
    VK_EXT_memory_budget reports one, else the heap size, times ``fraction``.

    Args:
        facts: the device.
        fraction: share of the budget to use, in (0, 1].

    Returns:
        The budget in bytes.
    """
    local = [h for h in facts.heaps if h.device_local] or list(facts.heaps)
    if not local:
        return 0
    heap = max(local, key=lambda h: h.size)
    base = heap.budget if heap.budget is not None else heap.size
    return int(base * fraction)

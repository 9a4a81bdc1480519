"""The interface every backend implements, and the device facts it reports.

A backend owns the memory of one device laid out by a plan's Layout, records Programs once and
replays them. Submission returns a ticket; waiting on a ticket blocks, so the runtime waits from a
worker thread and never on the trio event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from flow.program import Layout, Program, Tensor


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


class Backend(Protocol):
    """What the runtime and tests use; CpuBackend and VulkanBackend implement it."""

    facts: DeviceFacts
    # run_program's handles per (program, slot): set to {} by the backend's constructor and again
    # by open_layout, which frees the recordings they name.
    run_program_cache: dict[tuple[Program, int], int]

    def open_layout(self, layout: Layout, slots: int = 1) -> None:
        """Allocate every arena of ``layout`` (per-slot arenas ``slots`` times)."""

    def write(self, tensor: str, data: np.ndarray, slot: int = 0) -> None:
        """Copy host data into a tensor, or into its first elements when ``data`` is shorter."""

    def read(self, tensor: str, slot: int = 0) -> np.ndarray:
        """Copy a tensor back to the host, shaped and typed as declared."""

    def staging_view(self, tensor: str, slot: int = 0) -> np.ndarray:
        """A writable host array (pinned staging memory on a GPU) shaped and typed as ``tensor``,
        for ``upload``. One per tensor and slot, allocated on first use and reused."""

    def upload(self, tensor: str, slot: int = 0, data: np.ndarray | None = None) -> int:
        """Queue a copy of the staging array (after copying ``data`` into it, if given) into
        ``tensor``; returns a ticket that ``wait`` accepts. Programs submitted later that bind the
        tensor's memory run after the copy. Never blocks on the GPU."""

    def record(self, program: Program, slot: int = 0) -> int:
        """Record ``program`` bound to ``slot``'s per-slot tensors; returns a handle to replay."""

    def submit(self, handle: int) -> int:
        """Queue a recorded program; returns a ticket that ``wait`` accepts. Never blocks."""

    def wait(self, ticket: int, timeout_s: float | None = None) -> None:
        """Block until the submission of ``ticket`` has finished."""

    def is_done(self, ticket: int) -> bool:
        """Whether the submission of ``ticket`` has finished, without blocking."""

    def close(self) -> None:
        """Free every device object. Safe to call twice."""


def upload_target(
    layout: Layout | None, tensor: str, slot: int, slots: int, data: np.ndarray | None = None
) -> Tensor:
    """Check the arguments of ``staging_view``/``upload`` before any device work.

    Args:
        layout: the open layout (None: no layout open yet).
        tensor: the tensor's name.
        slot: which per-slot copy and staging buffer; must be in ``range(slots)`` for every tensor,
            so one slot number means the same thing for inputs and weights.
        slots: the slots the layout was opened with.
        data: values to stage, if any: exactly the tensor's dtype (no silent casts), and its shape
            or the flat shape ``(size,)``.

    Returns:
        The tensor's record.

    Raises:
        RuntimeError: no layout is open.
        KeyError: no such tensor.
        IndexError: slot out of range.
        TypeError: data of another dtype.
        ValueError: data of another shape.
    """
    if layout is None:
        raise RuntimeError(f"upload to {tensor!r}: no layout is open (call open_layout first)")
    try:
        spec = layout.tensor(tensor)
    except KeyError:
        raise KeyError(f"upload: layout has no tensor named {tensor!r}") from None
    if not 0 <= slot < max(slots, 1):
        raise IndexError(f"upload to {tensor!r}: slot {slot} out of range (0..{max(slots, 1) - 1})")
    if data is not None:
        array = np.asarray(data)
        if array.dtype != np.dtype(spec.dtype):
            raise TypeError(f"upload to {tensor!r}: data is {array.dtype}, the tensor holds {spec.dtype}")
        if array.shape not in (tuple(spec.shape), (spec.size,)):
            raise ValueError(
                f"upload to {tensor!r}: data has shape {array.shape}, the tensor is {tuple(spec.shape)}"
            )
    return spec


def run_program(backend: Backend, program: Program, slot: int = 0) -> None:
    """Record (cached per program and slot), submit and wait: the simple synchronous path for
    tests, checkpoints and one-off work.

    Args:
        backend: where to run.
        program: the program.
        slot: which per-slot tensors to bind.
    """
    cache = backend.run_program_cache
    key = (program, slot)
    if key not in cache:
        cache[key] = backend.record(program, slot)
    backend.wait(backend.submit(cache[key]))

"""The CPU backend: runs the same Programs as the Vulkan backend, with numpy.

It is the oracle in tests and the fallback where no Vulkan device exists. Tensors are views into
byte arenas at the layout's offsets, so buffer reuse in a plan behaves exactly as on the GPU (a
plan that reuses memory too early gives wrong numbers here too).

``precision="float64"`` widens every 4-byte element to 8 bytes (doubling offsets), for
finite-difference gradient checks of whole programs.

Its memory is the machine's own (:func:`host_memory`): the heap's size is the physical memory and
its budget what can be had now, as VK_EXT_memory_budget reports them for a GPU, so a plan that would
not fit is refused before it swaps or meets the OOM killer.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from actors import cpu_ops
from actors.backend import DeviceFacts, MemoryHeap, upload_target
from flow.device_facts import NUMPY_VENDOR
from flow.program import Barrier, Layout, Program, Tensor
from shaders.registry import op as op_def

_NATIVE = {
    "float32": np.float32, "int32": np.int32, "uint32": np.uint32, "float16": np.float16, "uint8": np.uint8
}  # fmt: skip
_WIDE = {
    "float32": np.float64, "int32": np.int64, "uint32": np.uint64, "float16": np.float32, "uint8": np.uint8
}  # fmt: skip


# Only where the machine says nothing (no sysconf figure): the size this backend once assumed.
FALLBACK_MEMORY_BYTES = 8 * 2**30


def _read_int(path: Path) -> int | None:
    """An integer file such as cgroup's memory.max; None when absent, unreadable or "max"."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _mem_available(proc: Path) -> int | None:
    """MemAvailable of /proc/meminfo in bytes (Linux 3.14+); None elsewhere."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB, meaning KiB
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_memory(
    proc: str | os.PathLike = "/proc", cgroup: str | os.PathLike = "/sys/fs/cgroup"
) -> tuple[int, int | None]:
    """This machine's memory for the CPU backend: (size, budget).

    The size is the physical memory, ``sysconf(SC_PHYS_PAGES) * sysconf(SC_PAGE_SIZE)``. The budget
    is ``MemAvailable`` from /proc/meminfo: free memory plus the page cache and buffers the kernel
    can reclaim, i.e. what a run can allocate now without swapping. It, not the physical size, is
    what a plan must fit in: other processes hold the rest. Inside a container with a memory limit
    (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``), the limit caps the size and the limit
    minus the group's current use caps the budget, because the host's figures do not apply there.

    Args:
        proc: where procfs is mounted (tests point it at a folder of their own).
        cgroup: where the process's cgroup hierarchy is mounted.

    Returns:
        (size, budget) in bytes; the budget is None where the system does not report one, and the
        size falls back to FALLBACK_MEMORY_BYTES where sysconf has no figure.
    """
    try:
        size: int | None = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # a platform without these names
        size = None
    budget = _mem_available(Path(proc))
    root = Path(cgroup)
    for limit_file, usage_file in (
        (root / "memory.max", root / "memory.current"),
        (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes"),
    ):
        limit = _read_int(limit_file)
        if limit is None:
            continue
        size = limit if size is None else min(size, limit)
        left = max(0, limit - (_read_int(usage_file) or 0))
        budget = left if budget is None else min(budget, left)
        break
    return (size if size else FALLBACK_MEMORY_BYTES), budget


def cpu_facts(memory_bytes: int | None = None) -> DeviceFacts:
    """Facts for the numpy device.

    Args:
        memory_bytes: the heap's size; None reads this machine's memory (:func:`host_memory`).

    Returns:
        The facts.
    """
    size, budget = host_memory() if memory_bytes is None else (memory_bytes, None)
    return DeviceFacts(
        index=-1,
        name="cpu (numpy)",
        kind="cpu",
        vendor=NUMPY_VENDOR,
        vendor_id=0,
        api_version="-",
        driver_version=np.__version__,
        heaps=(MemoryHeap(index=0, size=size, device_local=True, budget=budget),),
        # Tensor-core GEMMs are emulated (inputs rounded to float16), so mixed-precision plans run here too.
        features=("timeline_semaphore", "cooperative_matrix"),
    )


class CpuBackend:
    """Executes programs synchronously at submit time; tickets are always done."""

    def __init__(self, precision: str = "float32", facts: DeviceFacts | None = None) -> None:
        if precision not in ("float32", "float64"):
            raise ValueError(f"precision must be 'float32' or 'float64', got {precision!r}")
        self.facts = facts or cpu_facts()
        self.precision = precision
        self._scale = 2 if precision == "float64" else 1
        self._types = _WIDE if precision == "float64" else _NATIVE
        self._layout: Layout | None = None
        self._arenas: dict[tuple[str, int], np.ndarray] = {}
        self._recorded: list[tuple[Program, int]] = []
        self._staging: dict[tuple[str, int], np.ndarray] = {}
        self._ticket = 0
        self.slots = 0
        self.run_program_cache: dict[tuple[Program, int], int] = {}  # run_program's; dies with the layout

    def open_layout(self, layout: Layout, slots: int = 1) -> None:
        self._layout = layout
        self.slots = slots
        self._arenas = {}
        self._recorded = []
        self._staging = {}
        self.run_program_cache = {}
        for arena in layout.arenas:
            for slot in range(slots if arena.per_slot else 1):
                self._arenas[(arena.name, slot)] = np.zeros(arena.nbytes * self._scale, dtype=np.uint8)

    def _view(self, tensor: Tensor, slot: int) -> np.ndarray:
        assert self._layout is not None, "open_layout first"
        arena = self._layout.arena(tensor.arena)
        buffer = self._arenas[(arena.name, slot if arena.per_slot else 0)]
        dtype = np.dtype(self._types[tensor.dtype])
        start = tensor.offset * self._scale
        return buffer[start : start + tensor.size * dtype.itemsize].view(dtype)

    def view(self, name: str, slot: int = 0) -> np.ndarray:
        """A live flat view of a tensor (CPU only; tests use it to poke memory)."""
        assert self._layout is not None, "open_layout first"
        return self._view(self._layout.tensor(name), slot)

    def write(self, tensor: str, data: np.ndarray, slot: int = 0) -> None:
        assert self._layout is not None, "open_layout first"
        declared = self._layout.tensor(tensor)
        flat = np.asarray(data).reshape(-1)
        if flat.size > declared.size:
            raise ValueError(
                f"write to {tensor!r}: holds {declared.size} elements {declared.shape}, got {flat.size}"
            )
        # A shorter write fills a prefix: a partial final batch uses only its first rows.
        self._view(declared, slot)[: flat.size] = flat

    def read(self, tensor: str, slot: int = 0) -> np.ndarray:
        assert self._layout is not None, "open_layout first"
        declared = self._layout.tensor(tensor)
        return self._view(declared, slot).reshape(declared.shape).copy()

    def read_into(self, tensor: str, out: np.ndarray, slot: int = 0) -> None:
        """Copy ``tensor`` into ``out`` (its size and type), as VulkanBackend.read_into."""
        assert self._layout is not None, "open_layout first"
        declared = self._layout.tensor(tensor)
        if out.dtype != np.dtype(declared.dtype) or out.size != declared.size:
            wanted = f"{declared.dtype} {declared.shape}"
            raise ValueError(f"read of {tensor!r} into {out.dtype} {out.shape}: needs {wanted}")
        np.copyto(out.reshape(-1), self._view(declared, slot).reshape(-1))

    def staging_view(self, tensor: str, slot: int = 0) -> np.ndarray:
        """A host array shaped and typed as declared (not widened: it stands for pinned host
        memory), which ``upload`` copies into the tensor."""
        declared = upload_target(self._layout, tensor, slot, self.slots)
        key = (tensor, slot)
        if key not in self._staging:
            self._staging[key] = np.zeros(declared.shape, dtype=np.dtype(declared.dtype))
        return self._staging[key]

    def upload(self, tensor: str, slot: int = 0, data: np.ndarray | None = None) -> int:
        """Copy the staging array (after ``data``, if given) into the tensor now; the ticket is done."""
        declared = upload_target(self._layout, tensor, slot, self.slots, data)
        staging = self.staging_view(tensor, slot)
        if data is not None:
            staging.reshape(-1)[:] = np.asarray(data).reshape(-1)
        self._view(declared, slot)[:] = staging.reshape(-1)
        self._ticket += 1
        return self._ticket

    def record(self, program: Program, slot: int = 0) -> int:
        self._recorded.append((program, slot))
        return len(self._recorded) - 1

    def execute(self, program: Program, slot: int = 0) -> None:
        """Run every launch of ``program`` now."""
        assert self._layout is not None, "open_layout first"
        with cpu_ops.gpu_float_errors():
            for step in program.steps:
                if isinstance(step, Barrier):
                    continue
                arrays = [self._view(self._layout.tensor(name), slot) for name in step.args]
                cpu_ops.KERNELS[step.op](arrays, op_def(step.op).resolve(step.param_dict))

    def submit(self, handle: int) -> int:
        program, slot = self._recorded[handle]
        self.execute(program, slot)
        self._ticket += 1
        return self._ticket

    def submit_group(self, handles: tuple[int, ...]) -> list[int]:
        """Run several recorded programs in order; one ticket each (as the Vulkan backend's one
        submission for them all)."""
        return [self.submit(handle) for handle in handles]

    def wait(self, ticket: int, timeout_s: float | None = None) -> None:
        return None

    def is_done(self, ticket: int) -> bool:
        return True

    def close(self) -> None:
        self._arenas = {}
        self._recorded = []
        self._staging = {}

"""The CPU backend: runs the same Programs as the Vulkan backend, with numpy.

It is the oracle in tests and the fallback where no Vulkan device exists. Tensors are views into
byte arenas at the layout's offsets, so buffer reuse in a plan behaves exactly as on the GPU (a
plan that reuses memory too early gives wrong numbers here too).

``precision="float64"`` widens every 4-byte element to 8 bytes (doubling offsets), for
finite-difference gradient checks of whole programs.
"""

from __future__ import annotations

import numpy as np

from actors import cpu_ops
from actors.backend import DeviceFacts, MemoryHeap, upload_target
from flow.program import Barrier, Layout, Program, Tensor
from shaders.registry import op as op_def

_NATIVE = {"float32": np.float32, "int32": np.int32, "uint32": np.uint32, "float16": np.float16}
_WIDE = {"float32": np.float64, "int32": np.int64, "uint32": np.uint64, "float16": np.float32}


def cpu_facts(memory_bytes: int = 8 * 2**30) -> DeviceFacts:
    """Facts for the numpy device."""
    return DeviceFacts(
        index=-1,
        name="cpu (numpy)",
        kind="cpu",
        vendor="numpy",
        vendor_id=0,
        api_version="-",
        driver_version=np.__version__,
        heaps=(MemoryHeap(index=0, size=memory_bytes, device_local=True),),
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

    def open_layout(self, layout: Layout, slots: int = 1) -> None:
        self._layout = layout
        self.slots = slots
        self._arenas = {}
        self._recorded = []
        self._staging = {}
        self.__dict__.pop("_run_program_cache", None)
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
        spec = self._layout.tensor(tensor)
        flat = np.asarray(data).reshape(-1)
        if flat.size > spec.size:
            raise ValueError(f"write to {tensor!r}: holds {spec.size} elements {spec.shape}, got {flat.size}")
        # A shorter write fills a prefix: a partial final batch uses only its first rows.
        self._view(spec, slot)[: flat.size] = flat

    def read(self, tensor: str, slot: int = 0) -> np.ndarray:
        assert self._layout is not None, "open_layout first"
        spec = self._layout.tensor(tensor)
        return self._view(spec, slot).reshape(spec.shape).copy()

    def staging_view(self, tensor: str, slot: int = 0) -> np.ndarray:
        """A host array shaped and typed as declared (not widened: it stands for pinned host
        memory), which ``upload`` copies into the tensor."""
        spec = upload_target(self._layout, tensor, slot, self.slots)
        key = (tensor, slot)
        if key not in self._staging:
            self._staging[key] = np.zeros(spec.shape, dtype=np.dtype(spec.dtype))
        return self._staging[key]

    def upload(self, tensor: str, slot: int = 0, data: np.ndarray | None = None) -> int:
        """Copy the staging array (after ``data``, if given) into the tensor now; the ticket is done."""
        spec = upload_target(self._layout, tensor, slot, self.slots, data)
        staging = self.staging_view(tensor, slot)
        if data is not None:
            staging.reshape(-1)[:] = np.asarray(data).reshape(-1)
        self._view(spec, slot)[:] = staging.reshape(-1)
        self._ticket += 1
        return self._ticket

    def record(self, program: Program, slot: int = 0) -> int:
        self._recorded.append((program, slot))
        return len(self._recorded) - 1

    def execute(self, program: Program, slot: int = 0) -> None:
        """Run every launch of ``program`` now."""
        assert self._layout is not None, "open_layout first"
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

    def wait(self, ticket: int, timeout_s: float | None = None) -> None:
        return None

    def is_done(self, ticket: int) -> bool:
        return True

    def close(self) -> None:
        self._arenas = {}
        self._recorded = []
        self._staging = {}

"""The interface every backend implements. The device facts it reports are records
(flow.device_facts), so the pure planner can read them.

A backend owns the memory of one device laid out by a plan's Layout, records Programs once and
replays them. Submission returns a ticket; waiting on a ticket blocks, so the runtime waits from a
worker thread and never on the trio event loop.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from flow.device_facts import DeviceFacts, MemoryHeap, MemoryType, QueueFamily, memory_budget  # noqa: F401
from flow.program import Layout, Program, Tensor


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

    def submit_group(self, handles: tuple[int, ...]) -> list[int]:
        """Queue several recorded programs to run in the order given, at once; returns one ticket
        per program. Never blocks."""

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
        declared = layout.tensor(tensor)
    except KeyError:
        raise KeyError(f"upload: layout has no tensor named {tensor!r}") from None
    if not 0 <= slot < max(slots, 1):
        raise IndexError(f"upload to {tensor!r}: slot {slot} out of range (0..{max(slots, 1) - 1})")
    if data is not None:
        array = np.asarray(data)
        if array.dtype != np.dtype(declared.dtype):
            raise TypeError(f"upload to {tensor!r}: data is {array.dtype}, the tensor holds {declared.dtype}")
        if array.shape not in (tuple(declared.shape), (declared.size,)):
            raise ValueError(
                f"upload to {tensor!r}: data has shape {array.shape}, the tensor is {tuple(declared.shape)}"
            )
    return declared


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


def read_into(backend: Backend, tensor: str, out: np.ndarray) -> None:
    """Read ``tensor`` into ``out`` (its size, any shape): in place through the backend's own
    ``read_into`` where it has one, else by a copy of ``read`` (a test's own backend may lack it).
    Blocking."""
    own = getattr(backend, "read_into", None)
    if own is not None:
        own(tensor, out)
    else:
        np.copyto(out, backend.read(tensor).reshape(out.shape))

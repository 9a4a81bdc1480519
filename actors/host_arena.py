"""The pinned host arena of a data-parallel all-reduce: one page-aligned host allocation with a
region per member, imported by every Vulkan member (VK_EXT_external_memory_host).

Each member's gradients land in its region by the device's own copy, submitted right after its
train program (the CPU backend, host memory already, copies with numpy); the host sums the regions
in member order in place, into the first's (numpy views on the arena: no other copies), and each
member copies the sum back by a device copy that its update program, submitted next, runs after.
The sum is the same float32 additions in the same order as actors.data_parallel.host_all_reduce's,
so both paths give the same bits. Where some member cannot import host memory the run keeps that
path (flow.parallel_plan.all_reduce_path decides; ``flow plan`` says which).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence

import numpy as np

from actors.backend import Backend, read_into


class HostArena:
    """The arena and each member's recorded copies (see the module docstring).

    Args:
        backends: every member's backend, in member order.
        nbytes: the bytes of ``tensor`` (float32).
        tensor: the flat tensor summed.
    """

    def __init__(self, backends: Sequence[Backend], nbytes: int, tensor: str = "grads:all") -> None:
        self.backends = list(backends)
        self.tensor = tensor
        aligns = [getattr(b, "host_import_alignment", lambda: None)() for b in self.backends]
        alignment = max([mmap.PAGESIZE, *(a for a in aligns if a)])
        stride = -(-max(nbytes, 4) // alignment) * alignment
        total = stride * len(self.backends)
        # Anonymous memory is page aligned; a device asking for more gets the first aligned byte.
        self._memory = mmap.mmap(-1, total + alignment)
        whole = np.frombuffer(self._memory, np.uint8)
        skip = -whole.ctypes.data % alignment
        raw = whole[skip : skip + total]
        self.regions = [
            raw[i * stride : i * stride + nbytes].view(np.float32) for i in range(len(self.backends))
        ]
        # (to the host, back) copy handles per Vulkan member; None: a host-memory member (numpy).
        self.copies: list[tuple[int, int] | None] = []
        for i, (backend, align) in enumerate(zip(self.backends, aligns, strict=True)):
            if align is None:
                self.copies.append(None)
            else:
                address = raw.ctypes.data
                self.copies.append(backend.import_host_copies(address, total, self, tensor, i * stride, 0))

    def gather(self, member: int) -> int | None:
        """Start ``member``'s copy of its tensor into its region (call after its train program was
        submitted). Returns the ticket to wait on, or None when the copy is already done."""
        copies, backend = self.copies[member], self.backends[member]
        if copies is None:
            read_into(backend, self.tensor, self.regions[member])
            return None
        return backend.submit(copies[0])

    def sum(
        self, members: Sequence[int], across: Callable[[np.ndarray], np.ndarray] | None = None
    ) -> np.ndarray:
        """Sum the regions of ``members`` (their copies done) in their order into region 0, then,
        with ``across``, replace it by ``across`` of it (the sum over an MPI job's ranks).

        Returns:
            Region 0, holding the sum.
        """
        total = self.regions[members[0]]
        for member in members[1:]:
            total += self.regions[member]
        if across is not None:
            total = across(total)
        if total is not self.regions[0]:
            np.copyto(self.regions[0], total)
        return self.regions[0]

    def scatter(self, member: int) -> int | None:
        """Copy the sum (region 0) into ``member``'s tensor: a device copy that programs submitted
        after it run after, or numpy's at once. Returns the copy's ticket, or None when done."""
        copies, backend = self.copies[member], self.backends[member]
        if copies is None:
            backend.write(self.tensor, self.regions[0])
            return None
        return backend.submit(copies[1])

"""The pinned host arena of a data-parallel all-reduce: one page-aligned host allocation with a
region per member, imported by every Vulkan member (VK_EXT_external_memory_host).

Each member's gradients land in its region by the device's own copy, submitted right after its
train program (the CPU backend, host memory already, copies with numpy); the host sums the regions
in member order in place, into the first's (numpy views on the arena: no other copies), and each
member copies the sum back by a device copy that its update program, submitted next, runs after.
The sum is the same float32 additions in the same order as actors.data_parallel.host_all_reduce's,
so both paths give the same bits. Where some member cannot import host memory the run keeps that
path (flow.parallel_plan.all_reduce_path decides; ``flow plan`` says which).

With buckets (flow.parallel_plan.grad_buckets), each member has a copy per bucket, submitted after
the part of its train program that completes the bucket, and the host sums a bucket's slice of
the regions as soon as its copies are done: the same additions, so the same bits.
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
        buckets: its buckets, (first float, end) each; () one bucket, the whole tensor.
    """

    def __init__(
        self, backends: Sequence[Backend], nbytes: int, tensor: str = "grads:all",
        buckets: Sequence[tuple[int, int]] = (),
    ) -> None:  # fmt: skip
        self.backends = list(backends)
        self.tensor = tensor
        self.buckets = [slice(start, stop) for start, stop in buckets] or [slice(0, nbytes // 4)]
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
        # (to the host, back) copy handles per Vulkan member, the first bucket's to the host (the
        # others' in ``downs``); None: a host-memory member (numpy).
        parts = tuple((b.start * 4, (b.stop - b.start) * 4) for b in self.buckets) if buckets else ()
        self.copies: list[tuple[int, int] | None] = []
        self.downs: list[tuple[int, ...]] = []
        for i, (backend, align) in enumerate(zip(self.backends, aligns, strict=True)):
            downs, back = (), None
            if align is not None:
                address = raw.ctypes.data
                downs, back = backend.import_host_copies(address, total, self, tensor, i * stride, 0, parts)
            self.copies.append(None if back is None else (downs[0], back))
            self.downs.append(downs)

    def gather(self, member: int, bucket: int = 0) -> int | None:
        """Start ``member``'s copy of its tensor's ``bucket`` into its region (call after the part
        of its train program that completes the bucket was submitted). Returns the ticket to wait
        on, or None when the copy is already done."""
        copies, backend = self.copies[member], self.backends[member]
        if copies is None:
            if len(self.buckets) == 1:
                read_into(backend, self.tensor, self.regions[member])
            else:  # the numpy backend: its memory is host memory already
                part = self.buckets[bucket]
                np.copyto(self.regions[member][part], backend.view(self.tensor)[part])  # type: ignore[attr-defined]
            return None
        return backend.submit(self.downs[member][bucket])

    def sum(
        self,
        members: Sequence[int],
        across: Callable[[np.ndarray], np.ndarray] | None = None,
        bucket: int = 0,
    ) -> np.ndarray:
        """Sum ``bucket``'s slice of the regions of ``members`` (their copies done) in their order
        into region 0's, then, with ``across``, replace it by ``across`` of it (the sum over an MPI
        job's ranks).

        Returns:
            Region 0's slice (:meth:`part`), holding the sum.
        """
        total = self.part(members[0], bucket)
        for member in members[1:]:
            total += self.part(member, bucket)
        if across is not None:
            total = across(total)
        target = self.part(0, bucket)
        if not np.may_share_memory(total, target):  # another member's region, or across's result
            np.copyto(target, total)
        return target

    def part(self, member: int, bucket: int) -> np.ndarray:
        """``member``'s region's slice of ``bucket`` (the region itself for one bucket)."""
        region = self.regions[member]
        return region if len(self.buckets) == 1 else region[self.buckets[bucket]]

    def scatter(self, member: int) -> int | None:
        """Copy the sum (region 0) into ``member``'s tensor: a device copy that programs submitted
        after it run after, or numpy's at once. Returns the copy's ticket, or None when done."""
        copies, backend = self.copies[member], self.backends[member]
        if copies is None:
            backend.write(self.tensor, self.regions[0])
            return None
        return backend.submit(copies[1])

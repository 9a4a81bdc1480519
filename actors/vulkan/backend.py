"""VulkanBackend: the Backend interface on one Vulkan device, assembled from the package's parts.

It allocates a plan's arenas from large memory blocks (``memory``), records each Program into a
command buffer once per slot (``recording``, with ``pipelines``) and replays it with one submit
(``queues``, which it inherits so the per-step submit and wait run without delegation).
Submissions signal a timeline semaphore (or a fence where the driver lacks timelines); ``wait``
blocks, so the runtime calls it from a worker thread. Uploads (``staging_view`` + ``upload``) are
DMA copies from pinned staging memory on the upload queue (``uploads``); host ``write``/``read``
go straight through mapped memory where they can and through a staged copy otherwise. What is
left here is that host access and the lifetime of everything: a layout's objects are freed when
the next layout opens, the rest on ``close``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from actors.backend import upload_target
from actors.vulkan import host_import, library
from actors.vulkan.facts import select_device
from actors.vulkan.memory import ArenaBuffer, DeviceMemory, Staging
from actors.vulkan.pipelines import Pipelines
from actors.vulkan.queues import Queues
from actors.vulkan.recording import full_barrier, record_program
from actors.vulkan.timing import TimestampPool, Timestamps
from actors.vulkan.uploads import Uploads
from flow.device_facts import memory_budget
from flow.program import Layout, Program
from shaders import gemm_tuning

# Assigned, not imported by name: see library's docstring (3.11 method calls).
ffi, lib = library.ffi, library.lib

_DIRECT_READ_BYTES = 1 << 20
_PARALLEL_WRITE_BYTES = 8 << 20
_WRITE_THREADS = 4


class VulkanBackend(Queues):
    """Runs Programs on one Vulkan device. See the module docstring.

    Args:
        device: "auto" (the best device), an index or part of a name (see ``select_device``).
        memory_fraction: share of the device's memory budget to use.
        block_bytes: size of the memory blocks arenas are placed in.
    """

    def __init__(
        self, device: int | str = "auto", memory_fraction: float = 0.9, block_bytes: int = 64 * 2**20
    ) -> None:
        self._closed = False
        facts, physical = select_device(device)
        super().__init__(physical, facts)
        self.budget = memory_budget(facts, memory_fraction)
        self.memory = DeviceMemory(
            self.device, facts, self.budget, block_bytes, (self.queue_family, self.upload_family)
        )
        self.pipelines = Pipelines(self.device, physical)  # physical: the pipeline cache's identity
        self._uploads = Uploads(self, self.memory)
        self._timestamps = Timestamps(self)
        # For hand-made programs (planned ones carry their constants): resolve launches for this
        # device, with its measured GEMM tiles.
        self.tuning = True
        self.gemm_table = gemm_tuning.load_table(facts.name)
        # run_program's handles per (program, slot); they die with the layout.
        self.run_program_cache: dict[tuple[Program, int], int] = {}
        self._downloads = None  # the staging buffer reads go through (see _download_staging)
        self._physical = physical
        self._host_imports: list[host_import.HostImport] = []  # freed with the layout

    @property
    def slots(self) -> int:
        """The slots the open layout was opened with (0 before any)."""
        return self.memory.slots

    @property
    def _staging(self) -> dict[tuple[str, int], Staging]:
        """The staging buffers by (tensor, slot), as CpuBackend keeps them: tests check that a
        refused upload made none."""
        return self._uploads.staging

    # -- layout and host access -----------------------------------------------------------------
    def open_layout(self, layout: Layout, slots: int = 1) -> None:
        """Allocate every arena (per-slot ones ``slots`` times). Replaces any earlier layout."""
        self._release_layout()
        self.memory.open_layout(layout, slots)

    def write(self, tensor: str, data: np.ndarray, slot: int = 0) -> None:
        memory = self.memory
        assert memory.layout is not None, "open_layout first"
        declared = memory.layout.tensor(tensor)
        array = np.ascontiguousarray(data, dtype=np.dtype(declared.dtype))
        if array.size > declared.size:
            raise ValueError(
                f"write to {tensor!r}: holds {declared.size} elements {declared.shape}, got {array.size}"
            )
        # A shorter write fills a prefix: a partial final batch uses only its first rows.
        target = memory.arena_for(declared, slot)
        if target.mapped is None:
            self._staged_copy(target, declared.offset, array.nbytes, upload=array)
        elif array.nbytes < _PARALLEL_WRITE_BYTES:
            ffi.memmove(target.mapped + declared.offset, ffi.from_buffer(array), array.nbytes)
        else:
            _parallel_write(target.mapped + declared.offset, array)

    def read(self, tensor: str, slot: int = 0) -> np.ndarray:
        memory = self.memory
        assert memory.layout is not None, "open_layout first"
        declared = memory.layout.tensor(tensor)
        out = np.empty(declared.shape, dtype=np.dtype(declared.dtype))
        self.read_into(tensor, out, slot)
        return out

    def read_into(self, tensor: str, out: np.ndarray, slot: int = 0) -> None:
        """Copy ``tensor`` into ``out`` (contiguous, its size and type): a reader that reads the
        same tensor every step keeps one array instead of faulting in a fresh one each time."""
        memory = self.memory
        assert memory.layout is not None, "open_layout first"
        declared = memory.layout.tensor(tensor)
        if out.dtype != np.dtype(declared.dtype) or out.size != declared.size or not out.flags.c_contiguous:
            wanted = f"{declared.dtype} {declared.shape}"
            raise ValueError(f"read of {tensor!r} into {out.dtype} {out.shape}: needs {wanted}")
        source = memory.arena_for(declared, slot)
        # CPU reads of uncached (write-combined) VRAM crawl; bulk reads go through cached staging.
        if source.mapped is not None and (source.cached or out.nbytes < _DIRECT_READ_BYTES):
            ffi.memmove(ffi.from_buffer(out), source.mapped + declared.offset, out.nbytes)
        else:
            self._staged_copy(source, declared.offset, out.nbytes, download=out)

    def write_into(self, tensor: str, slot: int = 0) -> np.ndarray | None:
        """A writable numpy view straight onto a host-visible tensor (no copy), or None when the
        tensor's memory is not mappable. The loader fills batches in place through it."""
        memory = self.memory
        assert memory.layout is not None, "open_layout first"
        declared = memory.layout.tensor(tensor)
        target = memory.arena_for(declared, slot)
        if target.mapped is None:
            return None
        buffer = ffi.buffer(target.mapped + declared.offset, declared.nbytes)
        return np.frombuffer(buffer, dtype=np.dtype(declared.dtype)).reshape(declared.shape)

    def _staged_copy(self, arena: ArenaBuffer, offset: int, nbytes: int, upload=None, download=None) -> None:
        """Copy between host data and an unmapped arena through a temporary host-visible buffer,
        waiting for the copy (and for every upload queued before it)."""
        reused = download is not None
        if reused:
            staging = self._download_staging(nbytes)
        else:
            staging = self.memory.create_buffer("staging", max(nbytes, 4), True)
        try:
            if upload is not None:
                ffi.memmove(staging.mapped, ffi.from_buffer(upload), nbytes)
            region = ffi.new(
                "VkBufferCopy*",
                {
                    "srcOffset": 0 if upload is not None else offset,
                    "dstOffset": offset if upload is not None else 0,
                    "size": nbytes,
                },
            )
            src, dst = (
                (staging.buffer, arena.buffer) if upload is not None else (arena.buffer, staging.buffer)
            )
            command = self.begin_one_shot()
            full_barrier(command)
            lib.vkCmdCopyBuffer(command, src, dst, 1, region)
            full_barrier(command)
            self.finish_one_shot(command)
            if download is not None:
                ffi.memmove(ffi.from_buffer(download), staging.mapped, nbytes)
        finally:
            if not reused:
                self.memory.free_buffer(staging)

    def _download_staging(self, nbytes: int):
        """The host-cached buffer downloads go through, kept (grown as needed) until the layout is
        released: a buffer made for every read cost its allocation and first touch each time
        (device->host reads ran at ~3 GB/s on an H100 host)."""
        if self._downloads is not None and self._downloads.size < nbytes:
            self.memory.free_buffer(self._downloads)
            self._downloads = None
        if self._downloads is None:
            self._downloads = self.memory.create_buffer("downloads", max(nbytes, 4), True, host_reads=True)
        return self._downloads

    # -- uploads: DMA from pinned staging memory on the upload queue ----------------------------
    def staging_view(self, tensor: str, slot: int = 0) -> np.ndarray:
        """A writable numpy view of pinned host staging memory for ``tensor``: fill it, then
        ``upload``. Like a pinned host tensor in PyTorch: the copy engine reads it directly.

        Allocated on first use (one per tensor and slot, in host memory, outside the device
        budget), reused, and freed with the layout. Blocks until the previous upload from it has
        read it, so the view returned may be refilled at once; a view kept across uploads must
        not be written before that upload's ticket is done.

        Args:
            tensor: a tensor of the open layout.
            slot: which per-slot copy of the tensor (and which staging buffer).

        Returns:
            An array shaped and typed as the tensor.
        """
        declared = upload_target(self.memory.layout, tensor, slot, self.memory.slots)
        staging = self._uploads.staging_for(declared, slot)
        if staging.ticket:
            self.wait(staging.ticket)
        return staging.view

    def upload(
        self,
        tensor: str,
        slot: int = 0,
        data: np.ndarray | None = None,
        *,
        timestamps: TimestampPool | None = None,
        query: int = 0,
    ) -> int:
        """Queue a DMA copy of ``tensor``'s staging memory into the tensor, on the upload queue.

        Programs submitted afterwards that bind the tensor's buffer wait for the copy on the GPU
        (a timeline semaphore), and the copy waits for programs submitted before it that bind
        that buffer, so uploading the next batch never blocks the host on compute. Host access
        (``read``, ``write``, ``write_into`` views) is not ordered: wait for the ticket first.

        Args:
            tensor: a tensor of the open layout.
            slot: which per-slot copy of the tensor (and which staging buffer).
            data: values to copy into the staging memory first (after the previous upload from
                it is done): the tensor's dtype, and its shape or ``(size,)``.
            timestamps: a pool from ``timestamp_pool``, reset with ``reset_timestamps``: the copy
                writes its start and end into queries ``query`` and ``query + 1`` (benchmarks).
            query: the first of the two queries.

        Returns:
            A ticket for ``wait`` and ``is_done``.

        Raises:
            KeyError, IndexError, TypeError, ValueError: bad arguments, before any device work.
        """
        memory = self.memory
        declared = upload_target(memory.layout, tensor, slot, memory.slots, data)
        if timestamps is not None:
            if not self.upload_timestamps:
                raise ValueError(f"upload to {tensor!r}: {self.upload_queue_name} cannot write timestamps")
            if not 0 <= query < timestamps.count - 1:
                raise IndexError(
                    f"upload to {tensor!r}: queries {query} and {query + 1} are not both in the pool "
                    f"of {timestamps.count}"
                )
        staging, command = self._uploads.prepare(declared, slot, timestamps, query)
        if data is not None:
            if staging.ticket:
                self.wait(staging.ticket)
            np.copyto(staging.view.reshape(-1), np.asarray(data).reshape(-1))
        ticket = self.submit_upload(command, memory.buffer_key(declared, slot))
        staging.ticket = ticket
        return ticket

    # -- recording ------------------------------------------------------------------------------
    def record(
        self,
        program: Program,
        slot: int = 0,
        spec_overrides: dict[str, dict[str, int]] | None = None,
        timestamps: TimestampPool | None = None,
    ) -> int:
        """Record ``program`` once, bound to ``slot``'s per-slot arenas.

        Args:
            program: what to run.
            slot: which per-slot arenas to bind.
            spec_overrides: op name -> specialisation constants, replacing the registry's
                per-launch tuning for that op (benchmarks use it to compare tiles).
            timestamps: a pool from ``timestamp_pool`` to write one timestamp before the first
                launch and after each launch (for per-kernel GPU timing in benchmarks).

        Returns:
            A handle for ``submit``.
        """
        recorded = record_program(
            self, self.memory, self.pipelines, program, slot, spec_overrides, timestamps, self.tuning,
            self.gemm_table,
        )  # fmt: skip
        return self.add_program(recorded)

    # -- host memory imported into the device (actors.host_arena) -------------------------------
    def host_import_alignment(self) -> int | None:
        """The alignment (bytes) of host memory this device imports, or None where it cannot."""
        if not self.facts.has("host_memory_import"):
            return None
        return host_import.import_alignment(self._physical)

    def import_host_copies(self, address: int, nbytes: int, owner: object, tensor: str,
                           into: int, back_from: int, parts: tuple[tuple[int, int], ...] = ()
                           ) -> tuple[tuple[int, ...], int]:  # fmt: skip
        """Import the host range ``address``..+``nbytes`` (kept alive by ``owner``) and record the
        copies of ``tensor`` into the range at byte ``into``, one per part of its bytes (first,
        count; () the whole tensor), and one from byte ``back_from`` into ``tensor``. All are freed
        with the layout.

        Returns:
            The copies' handles for ``submit``: (to the host, one per part; back from it).
        """
        imported = host_import.import_host(self, address, nbytes, owner)
        self._host_imports.append(imported)
        down = tuple(host_import.record_copy(self, imported, tensor, into, True, p) for p in parts or (None,))
        return down, host_import.record_copy(self, imported, tensor, back_from, to_host=False)

    # -- timing ---------------------------------------------------------------------------------
    def timestamp_pool(self, count: int, host_reset: bool = False) -> TimestampPool:
        """A query pool of ``count`` timestamps for ``record(..., timestamps=pool)``.

        With ``host_reset`` (and a device that resets queries from the host), programs recorded
        with the pool do not reset it themselves: call ``reset_timestamps`` before each submission.
        An in-buffer reset adds GPU work to every step (~6 µs on an H100), which a gap or step time
        measured with it would wrongly include.
        """
        return self._timestamps.new_pool(count, host_reset)

    def reset_timestamps(self, pool: TimestampPool) -> None:
        """Make every query of ``pool`` writable again before ``upload(..., timestamps=pool)`` or
        a submission of a program recorded with a ``host_reset`` pool. Call it only when no
        submitted work still writes the pool."""
        self._timestamps.reset(pool)

    def read_timestamps_ns(self, pool: TimestampPool) -> np.ndarray:
        """The pool's timestamps in nanoseconds (call after the submission is done)."""
        return self._timestamps.read_ns(pool)

    # -- teardown -------------------------------------------------------------------------------
    def _release_layout(self) -> None:
        if self._programs or self._uploads.has_objects():
            lib.vkDeviceWaitIdle(self.device)
        # The device is idle: no pending upload or program constrains the new layout's buffers.
        self.free_programs()
        for imported in self._host_imports:
            host_import.free_import(self, imported)
        self._host_imports = []
        self._uploads.release()
        self.run_program_cache = {}
        self.pipelines.free_descriptors()
        if self._downloads is not None:
            self.memory.free_buffer(self._downloads)
            self._downloads = None
        self.memory.release_layout()

    def close(self) -> None:
        """Wait for the queues, then destroy every Vulkan object this backend made."""
        if self._closed:
            return
        self._closed = True
        lib.vkDeviceWaitIdle(self.device)
        self._release_layout()
        self._timestamps.close()
        self.pipelines.close()
        self.memory.close()
        self.close_queues()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown, or a constructor that failed half way
            pass


def _parallel_write(pointer, array: np.ndarray) -> None:
    """Copy a large array into mapped device memory from several threads. One core's writes
    across PCIe into write-combined VRAM stall on the bus; numpy's copy releases the GIL, so a
    few threads keep more writes in flight."""
    flat = array.reshape(-1).view(np.uint8)
    destination = np.frombuffer(ffi.buffer(pointer, flat.nbytes), dtype=np.uint8)
    bounds = np.linspace(0, flat.nbytes, _WRITE_THREADS + 1).astype(np.int64) // 64 * 64
    bounds[-1] = flat.nbytes
    # A pool per call (a few hundred microseconds against a copy of milliseconds) leaves no
    # threads behind between writes.
    with ThreadPoolExecutor(_WRITE_THREADS, thread_name_prefix="vkflow-write") as writers:
        jobs = [
            writers.submit(np.copyto, destination[start:end], flat[start:end])
            for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        for job in jobs:
            job.result()

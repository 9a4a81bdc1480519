"""Queues: the logical device's compute and upload queues, submitting to them and waiting.

``Queues`` opens the VkDevice (``device``) with the queues ``queues_policy`` chose, and owns
everything that orders work on them: the timeline semaphores (or fences where the driver lacks
timelines), the tickets that ``wait`` and ``is_done`` accept, and ``QueueOrder``'s cross-queue
waits. VulkanBackend inherits it, so ``submit``, ``wait`` and
``is_done`` (the per-step hot path) run with no delegation in between: a replay is one
``vkQueueSubmit`` with structs built once, of which only the signal and wait values change.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field

from actors.vulkan import library
from actors.vulkan.device import open_device
from actors.vulkan.library import TIMEOUT_NS, check
from actors.vulkan.queues_policy import (
    UPLOAD_TICKETS,
    QueueOrder,
    choose_compute_family,
    choose_upload_queue,
    upload_queue_name,
)
from flow.device_facts import DeviceFacts

# Assigned, not imported by name: see library's docstring (3.11 method calls).
ffi, lib, vk = library.ffi, library.lib, library.vk


@dataclass
class Recorded:
    """A command buffer recorded once and submitted many times (a program or an upload's copy).

    Attributes:
        handles: its VkCommandBuffer[1].
        plain: the VkSubmitInfo that runs it and signals its queue's timeline.
        waiting: the same, first waiting on the other queue's timeline (None without timelines).
        buffers: (arena, slot) of every buffer a program binds, for QueueOrder.
        keep: structs the recording or the submit infos point into, kept alive with it.
    """

    handles: object
    plain: object
    waiting: object | None = None
    buffers: frozenset = frozenset()
    keep: list = field(default_factory=list)


@dataclass
class Group:
    """``submit_group``'s structs for one tuple of programs: a VkSubmitInfo per program, each
    signalling its own value of the compute timeline (``values``, set per submission).

    Attributes:
        plain: the VkSubmitInfo array.
        waiting: the same, each first waiting for the upload value in ``after`` (values already
            reached cost nothing).
        buffers: every buffer the programs bind, for QueueOrder.
        values: uint64_t[count], the timeline values the programs signal.
        after: uint64_t[1], the upload value the waiting form waits for.
        keep: structs the infos point into, kept alive with them.
    """

    plain: object
    waiting: object
    buffers: frozenset
    values: object
    after: object
    keep: list = field(default_factory=list)


class Queues:
    """The logical device with its queues, tickets and waits. See the module docstring."""

    def __init__(self, physical, facts: DeviceFacts) -> None:
        self.facts = facts
        families = facts.queue_families
        self.queue_family = choose_compute_family(families)
        self.timeline = facts.has("timeline_semaphore")
        self.upload_family, upload_index = choose_upload_queue(families, self.queue_family, self.timeline)
        upload_facts = next(f for f in families if f.index == self.upload_family)
        # Transfer-only queues may lack timestamps (timestampValidBits 0); benchmarks check this.
        self.upload_timestamps = upload_facts.timestamp_bits > 0
        self.upload_queue_name = upload_queue_name(self.queue_family, self.upload_family, upload_index)
        self.device = open_device(physical, facts, self.queue_family, self.upload_family, upload_index)
        queue = ffi.new("VkQueue*")
        lib.vkGetDeviceQueue(self.device, self.queue_family, 0, queue)
        self.queue = queue[0]
        lib.vkGetDeviceQueue(self.device, self.upload_family, upload_index, queue)
        self.upload_queue = queue[0]
        self.command_pool = self._new_command_pool(self.queue_family)
        self.upload_pool = self._new_command_pool(self.upload_family)
        self._lock = threading.Lock()
        self._programs: list[Recorded] = []
        self._groups: dict[tuple[int, ...], Group] = {}  # submit_group's infos per tuple of handles
        self._submitted = 0  # the compute timeline's last signalled value (or the last fence ticket)
        self._upload_value = 0  # the transfer timeline's last signalled value
        self._fences: dict[int, object] = {}
        self._order = QueueOrder()
        if self.timeline:
            self._init_timelines()

    def _new_command_pool(self, family: int):
        info = ffi.new(
            "VkCommandPoolCreateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
                "queueFamilyIndex": family,
                "flags": vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
            },
        )
        pool = ffi.new("VkCommandPool*")
        check(lib.vkCreateCommandPool(self.device, info, ffi.NULL, pool), "vkCreateCommandPool")
        return pool[0]

    def _new_timeline_semaphore(self):
        type_info = ffi.new(
            "VkSemaphoreTypeCreateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_SEMAPHORE_TYPE_CREATE_INFO,
                "semaphoreType": vk.VK_SEMAPHORE_TYPE_TIMELINE,
                "initialValue": 0,
            },
        )
        sem_info = ffi.new(
            "VkSemaphoreCreateInfo*",
            {"sType": vk.VK_STRUCTURE_TYPE_SEMAPHORE_CREATE_INFO, "pNext": type_info},
        )
        semaphore = ffi.new("VkSemaphore*")
        check(lib.vkCreateSemaphore(self.device, sem_info, ffi.NULL, semaphore), "vkCreateSemaphore")
        return semaphore[0]

    def _init_timelines(self) -> None:
        """Both queues' timelines and the structs every submission reuses: only the values change
        per submit (under the lock), so a replay costs one call."""
        self.semaphore = self._new_timeline_semaphore()
        self._signal_value = ffi.new("uint64_t[]", [0])
        self._semaphore_array = ffi.new("VkSemaphore[]", [self.semaphore])
        self._timeline_submit = ffi.new(
            "VkTimelineSemaphoreSubmitInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO,
                "signalSemaphoreValueCount": 1,
                "pSignalSemaphoreValues": self._signal_value,
            },
        )
        self._counter = ffi.new("uint64_t*")
        # The highest compute ticket seen done: a check at or below it needs no Vulkan call (the
        # device actor checks each ticket in order, and waits after a check found it done).
        self._compute_done = 0
        self.upload_semaphore = self._new_timeline_semaphore()
        self._upload_semaphore_array = ffi.new("VkSemaphore[]", [self.upload_semaphore])
        self._upload_signal = ffi.new("uint64_t[]", [0])
        self._after_compute = ffi.new("uint64_t[]", [0])  # compute ticket an upload waits for
        self._after_upload = ffi.new("uint64_t[]", [0])  # upload value a program waits for
        self._wait_stage = ffi.new("VkPipelineStageFlags[]", [vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT])
        self._upload_timeline = ffi.new(
            "VkTimelineSemaphoreSubmitInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO,
                "signalSemaphoreValueCount": 1,
                "pSignalSemaphoreValues": self._upload_signal,
            },
        )
        self._upload_timeline_waiting = ffi.new(
            "VkTimelineSemaphoreSubmitInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO,
                "waitSemaphoreValueCount": 1,
                "pWaitSemaphoreValues": self._after_compute,
                "signalSemaphoreValueCount": 1,
                "pSignalSemaphoreValues": self._upload_signal,
            },
        )
        self._compute_timeline_waiting = ffi.new(
            "VkTimelineSemaphoreSubmitInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO,
                "waitSemaphoreValueCount": 1,
                "pWaitSemaphoreValues": self._after_upload,
                "signalSemaphoreValueCount": 1,
                "pSignalSemaphoreValues": self._signal_value,
            },
        )

    # -- command buffers ------------------------------------------------------------------------
    def allocate_command_buffer(self, upload: bool = False):
        """A primary command buffer from the compute queue's pool (``upload``: the upload queue's).

        Returns:
            VkCommandBuffer[1], as submit infos and vkFreeCommandBuffers take it.
        """
        info = ffi.new(
            "VkCommandBufferAllocateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
                "commandPool": self.upload_pool if upload else self.command_pool,
                "level": vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
                "commandBufferCount": 1,
            },
        )
        handle = ffi.new("VkCommandBuffer[]", 1)
        check(lib.vkAllocateCommandBuffers(self.device, info, handle), "vkAllocateCommandBuffers")
        return handle

    def submit_infos(self, handles, upload: bool = False) -> tuple[object, object | None]:
        """(plain, waiting) VkSubmitInfos for one command buffer of the compute queue (``upload``:
        of the upload queue). Both signal that queue's timeline; ``waiting`` first waits on the
        other queue's. Without timeline semaphores: (plain, None).
        """
        plain = ffi.new(
            "VkSubmitInfo*",
            {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, "commandBufferCount": 1, "pCommandBuffers": handles},
        )
        if not self.timeline:
            return plain, None
        if upload:
            signal_values, signal_semaphores = self._upload_timeline, self._upload_semaphore_array
            wait_values, wait_semaphores = self._upload_timeline_waiting, self._semaphore_array
        else:
            signal_values, signal_semaphores = self._timeline_submit, self._semaphore_array
            wait_values, wait_semaphores = self._compute_timeline_waiting, self._upload_semaphore_array
        plain.pNext = signal_values
        plain.signalSemaphoreCount = 1
        plain.pSignalSemaphores = signal_semaphores
        waiting = ffi.new(
            "VkSubmitInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                "pNext": wait_values,
                "waitSemaphoreCount": 1,
                "pWaitSemaphores": wait_semaphores,
                "pWaitDstStageMask": self._wait_stage,
                "commandBufferCount": 1,
                "pCommandBuffers": handles,
                "signalSemaphoreCount": 1,
                "pSignalSemaphores": signal_semaphores,
            },
        )
        return plain, waiting

    def add_program(self, recorded: Recorded) -> int:
        """Keep a recorded program for ``submit``; returns its handle."""
        self._programs.append(recorded)
        return len(self._programs) - 1

    def free_programs(self) -> None:
        """Free every recorded program's command buffer (the device must be idle) and forget the
        cross-queue order: nothing pending constrains buffers any more."""
        for recorded in self._programs:
            lib.vkFreeCommandBuffers(self.device, self.command_pool, 1, recorded.handles)
        self._programs = []
        self._groups = {}
        self._order = QueueOrder()

    # -- submission -----------------------------------------------------------------------------
    def submit(self, handle: int) -> int:
        """Queue a recorded program. Returns the ticket to wait on; never blocks on the GPU.

        Where an upload into a buffer the program binds is still pending, the GPU waits for it.
        """
        recorded = self._programs[handle]
        submit = recorded.plain
        with self._lock:
            self._submitted += 1
            ticket = self._submitted
            if self.timeline:
                self._signal_value[0] = ticket
                after = self._order.program(recorded.buffers, ticket)
                if after:
                    self._after_upload[0] = after
                    submit = recorded.waiting
                check(lib.vkQueueSubmit(self.queue, 1, submit, ffi.NULL), "vkQueueSubmit")
            else:
                fence = self._new_fence()
                check(lib.vkQueueSubmit(self.queue, 1, submit, fence), "vkQueueSubmit")
                self._fences[ticket] = fence
        return ticket

    def submit_group(self, handles: tuple[int, ...]) -> list[int]:
        """Queue several recorded programs with one ``vkQueueSubmit``, in the order given. Returns
        one ticket per program (consecutive: each is done when its program is); never blocks.

        When the host falls behind the GPU, the device actor submits the steps that have piled up
        together, so its cost per step falls just when it matters; each step still signals its
        own value, so its slot is free as soon as it is done.
        """
        if len(handles) == 1 or not self.timeline:
            return [self.submit(handle) for handle in handles]
        group = self._groups.get(handles)
        if group is None:
            if len(set(handles)) < len(handles):  # a command buffer may be pending only once
                raise ValueError(f"submit_group: a program submitted twice in one group {handles}")
            if len(self._groups) >= 4096:  # slots come round in order, so few groups recur: a bound
                self._groups.clear()
            group = self._groups[handles] = self._group(handles)
        count = len(handles)
        with self._lock:
            first = self._submitted + 1
            self._submitted += count
            for i in range(count):
                group.values[i] = first + i
            submit = group.plain
            after = self._order.program(group.buffers, self._submitted)
            if after:
                group.after[0] = after
                submit = group.waiting
            check(lib.vkQueueSubmit(self.queue, count, submit, ffi.NULL), "vkQueueSubmit")
        return list(range(first, first + count))

    def _group(self, handles: tuple[int, ...]) -> Group:
        """``submit_group``'s structs for ``handles`` (see :class:`Group`)."""
        programs = [self._programs[handle] for handle in handles]
        count = len(programs)
        values, after = ffi.new("uint64_t[]", count), ffi.new("uint64_t[]", 1)
        plain, waiting = ffi.new("VkSubmitInfo[]", count), ffi.new("VkSubmitInfo[]", count)
        signals = ffi.new("VkTimelineSemaphoreSubmitInfo[]", count)
        waits = ffi.new("VkTimelineSemaphoreSubmitInfo[]", count)
        for i, program in enumerate(programs):
            for info, timeline, waits_too in ((plain + i, signals + i, 0), (waiting + i, waits + i, 1)):
                timeline.sType = vk.VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO
                timeline.signalSemaphoreValueCount = 1
                timeline.pSignalSemaphoreValues = values + i
                info.sType = vk.VK_STRUCTURE_TYPE_SUBMIT_INFO
                info.pNext = timeline
                info.commandBufferCount = 1
                info.pCommandBuffers = program.handles
                info.signalSemaphoreCount = 1
                info.pSignalSemaphores = self._semaphore_array
                if waits_too:
                    timeline.waitSemaphoreValueCount = 1
                    timeline.pWaitSemaphoreValues = after
                    info.waitSemaphoreCount = 1
                    info.pWaitSemaphores = self._upload_semaphore_array
                    info.pWaitDstStageMask = self._wait_stage
        union = frozenset().union(*(program.buffers for program in programs))
        return Group(plain, waiting, union, values, after, keep=[signals, waits, programs])

    def submit_upload(self, command: Recorded, buffer: Hashable) -> int:
        """Queue an upload's recorded copy into ``buffer`` on the upload queue, after any program
        submitted earlier that binds it. Returns its ticket; never blocks on the GPU."""
        with self._lock:
            if self.timeline:
                self._upload_value += 1
                after = self._order.upload(buffer, self._upload_value)
                self._upload_signal[0] = self._upload_value
                self._after_compute[0] = after
                submit = command.waiting if after else command.plain
                check(lib.vkQueueSubmit(self.upload_queue, 1, submit, ffi.NULL), "vkQueueSubmit(upload)")
                return UPLOAD_TICKETS + self._upload_value
            # One queue for everything: submission order and barriers keep the order.
            self._submitted += 1
            ticket = self._submitted
            fence = self._new_fence()
            check(lib.vkQueueSubmit(self.upload_queue, 1, command.plain, fence), "vkQueueSubmit(upload)")
            self._fences[ticket] = fence
            return ticket

    def _new_fence(self):
        info = ffi.new("VkFenceCreateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO})
        handle = ffi.new("VkFence*")
        check(lib.vkCreateFence(self.device, info, ffi.NULL, handle), "vkCreateFence")
        return handle[0]

    def wait(self, ticket: int, timeout_s: float | None = None) -> None:
        """Block until ``ticket``'s submission (a program or an upload) is done (call from a worker
        thread under trio)."""
        timeout = TIMEOUT_NS if timeout_s is None else int(timeout_s * 1e9)
        if self.timeline:
            if ticket <= self._compute_done:
                return
            semaphores, value = self._timeline_of(ticket)
            values = ffi.new("uint64_t[]", [value])
            info = ffi.new(
                "VkSemaphoreWaitInfo*",
                {
                    "sType": vk.VK_STRUCTURE_TYPE_SEMAPHORE_WAIT_INFO,
                    "semaphoreCount": 1,
                    "pSemaphores": semaphores,
                    "pValues": values,
                },
            )
            result = lib.vkWaitSemaphores(self.device, info, timeout)
            if result == 0 and ticket <= UPLOAD_TICKETS:
                self._compute_done = max(self._compute_done, ticket)
        else:
            with self._lock:
                done = [t for t in self._fences if t <= ticket]
                fences = [self._fences[t] for t in done]
            if not fences:
                return
            array = ffi.new("VkFence[]", fences)
            result = lib.vkWaitForFences(self.device, len(fences), array, 1, timeout)
            if result == 0:
                with self._lock:
                    for t in done:
                        fence = self._fences.pop(t, None)
                        if fence is not None:
                            lib.vkDestroyFence(self.device, fence, ffi.NULL)
        if result == vk.VK_TIMEOUT:
            raise TimeoutError(f"GPU work for ticket {ticket} not done after {timeout_s} s")
        check(result, "wait")

    def _timeline_of(self, ticket: int) -> tuple[object, int]:
        """(VkSemaphore[1] of the queue that ran ``ticket``, its value on that timeline)."""
        if ticket > UPLOAD_TICKETS:
            return self._upload_semaphore_array, ticket - UPLOAD_TICKETS
        return self._semaphore_array, ticket

    def is_done(self, ticket: int) -> bool:
        """Whether ``ticket``'s submission is done, without blocking."""
        if self.timeline:
            if ticket <= self._compute_done:
                return True
            semaphores, value = self._timeline_of(ticket)
            lib.vkGetSemaphoreCounterValue(self.device, semaphores[0], self._counter)
            reached = self._counter[0]
            if ticket <= UPLOAD_TICKETS:
                self._compute_done = max(self._compute_done, reached)
            return reached >= value
        with self._lock:
            pending = [self._fences[t] for t in self._fences if t <= ticket]
        return all(lib.vkGetFenceStatus(self.device, f) == 0 for f in pending)

    # -- one-shot work on the compute queue -----------------------------------------------------
    def begin_one_shot(self):
        """Begin a command buffer for ``finish_one_shot``; returns the VkCommandBuffer."""
        handles = self.allocate_command_buffer()
        begin = ffi.new(
            "VkCommandBufferBeginInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                "flags": vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT,
            },
        )
        check(lib.vkBeginCommandBuffer(handles[0], begin), "vkBeginCommandBuffer")
        self._one_shot_handles = handles
        return handles[0]

    def finish_one_shot(self, command) -> None:
        """End, submit and wait for the command buffer ``begin_one_shot`` began, then free it."""
        handles = self._one_shot_handles
        check(lib.vkEndCommandBuffer(command), "vkEndCommandBuffer")
        submit = ffi.new(
            "VkSubmitInfo*",
            {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, "commandBufferCount": 1, "pCommandBuffers": handles},
        )
        fence = self._new_fence()
        with self._lock:
            if self.timeline and self._upload_value:
                # A staged read or write must see every upload queued before it, on either queue.
                values = ffi.new("uint64_t[]", [self._upload_value])
                timeline = ffi.new(
                    "VkTimelineSemaphoreSubmitInfo*",
                    {
                        "sType": vk.VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO,
                        "waitSemaphoreValueCount": 1,
                        "pWaitSemaphoreValues": values,
                    },
                )
                submit.pNext = timeline
                submit.waitSemaphoreCount = 1
                submit.pWaitSemaphores = self._upload_semaphore_array
                submit.pWaitDstStageMask = self._wait_stage
            check(lib.vkQueueSubmit(self.queue, 1, submit, fence), "vkQueueSubmit")
        fences = ffi.new("VkFence[]", [fence])
        check(lib.vkWaitForFences(self.device, 1, fences, 1, TIMEOUT_NS), "vkWaitForFences")
        lib.vkDestroyFence(self.device, fence, ffi.NULL)
        lib.vkFreeCommandBuffers(self.device, self.command_pool, 1, handles)

    def close_queues(self) -> None:
        """Destroy the fences, semaphores, command pools and finally the device (every other
        object made on it must be gone by then)."""
        for fence in self._fences.values():
            lib.vkDestroyFence(self.device, fence, ffi.NULL)
        if self.timeline:
            lib.vkDestroySemaphore(self.device, self.semaphore, ffi.NULL)
            lib.vkDestroySemaphore(self.device, self.upload_semaphore, ffi.NULL)
        lib.vkDestroyCommandPool(self.device, self.command_pool, ffi.NULL)
        lib.vkDestroyCommandPool(self.device, self.upload_pool, ffi.NULL)
        lib.vkDestroyDevice(self.device, ffi.NULL)

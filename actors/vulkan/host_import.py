"""Host memory imported into a device (VK_EXT_external_memory_host), and the recorded copies
between it and a tensor: the device's own copy engine moves a data-parallel member's gradients
into the host arena and the sum back (actors.host_arena), with no staging buffer in between.

The host owns the allocation (page aligned, a multiple of ``minImportedHostPointerAlignment``);
the device only maps it, so one allocation is imported by every member. The copies are recorded
once, on the compute queue, each between two full barriers, and kept as programs: a copy submitted
right after a train program runs after it, and a program submitted after a copy sees what it wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.memory import choose_staging_type
from actors.vulkan import library
from actors.vulkan.library import check
from actors.vulkan.queues import Recorded
from actors.vulkan.recording import full_barrier

# Assigned, not imported by name: see library's docstring (3.11 method calls).
ffi, lib, vk = library.ffi, library.lib, library.vk

EXTENSION = "VK_EXT_external_memory_host"


@dataclass
class HostImport:
    """One host range imported into a device as a transfer buffer.

    Attributes:
        buffer: the VkBuffer over the whole range.
        memory: the imported VkDeviceMemory.
        owner: what keeps the host range alive (it must outlive the import).
    """

    buffer: object
    memory: object
    owner: object


def import_alignment(physical) -> int:
    """The device's minImportedHostPointerAlignment (bytes): a host range's start and size must be
    multiples of it."""
    host = ffi.new(
        "VkPhysicalDeviceExternalMemoryHostPropertiesEXT*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_EXTERNAL_MEMORY_HOST_PROPERTIES_EXT},
    )
    props = ffi.new(
        "VkPhysicalDeviceProperties2*", {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2}
    )
    props.pNext = host
    lib.vkGetPhysicalDeviceProperties2(physical, props)
    return int(host.minImportedHostPointerAlignment)


def import_host(backend, address: int, nbytes: int, owner: object) -> HostImport:
    """Import ``nbytes`` of host memory at ``address`` into ``backend``'s device.

    Args:
        backend: a VulkanBackend whose device enabled the extension.
        address: the range's start, aligned to :func:`import_alignment`.
        nbytes: its size, a multiple of that alignment.
        owner: the object that owns the range (kept with the import).

    Returns:
        The import; :func:`free_import` releases it.
    """
    device, handle_type = backend.device, vk.VK_EXTERNAL_MEMORY_HANDLE_TYPE_HOST_ALLOCATION_BIT_EXT
    external = ffi.new(
        "VkExternalMemoryBufferCreateInfo*",
        {"sType": vk.VK_STRUCTURE_TYPE_EXTERNAL_MEMORY_BUFFER_CREATE_INFO, "handleTypes": handle_type},
    )
    info = ffi.new(
        "VkBufferCreateInfo*",
        {
            "sType": vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO,
            "pNext": external,
            "size": nbytes,
            "usage": vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT,
            "sharingMode": vk.VK_SHARING_MODE_EXCLUSIVE,  # only the compute queue copies
        },
    )
    buffer = ffi.new("VkBuffer*")
    check(lib.vkCreateBuffer(device, info, ffi.NULL, buffer), "vkCreateBuffer(host arena)")
    try:
        requirements = ffi.new("VkMemoryRequirements*")
        lib.vkGetBufferMemoryRequirements(device, buffer[0], requirements)
        pointer = ffi.cast("void*", address)
        query = vk.vkGetDeviceProcAddr(device, "vkGetMemoryHostPointerPropertiesEXT")
        found = ffi.new(
            "VkMemoryHostPointerPropertiesEXT*",
            {"sType": vk.VK_STRUCTURE_TYPE_MEMORY_HOST_POINTER_PROPERTIES_EXT},
        )
        query(device, handle_type, pointer, found)
        allowed = int(found.memoryTypeBits) & int(requirements.memoryTypeBits)
        memory_type = choose_staging_type(backend.facts.memory_types, allowed)
        source = ffi.new(
            "VkImportMemoryHostPointerInfoEXT*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_IMPORT_MEMORY_HOST_POINTER_INFO_EXT,
                "handleType": handle_type,
                "pHostPointer": pointer,
            },
        )
        allocate = ffi.new(
            "VkMemoryAllocateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                "pNext": source,
                "allocationSize": nbytes,
                "memoryTypeIndex": memory_type.index,
            },
        )
        memory = ffi.new("VkDeviceMemory*")
        check(
            lib.vkAllocateMemory(device, allocate, ffi.NULL, memory), f"import of {nbytes:,} B of host memory"
        )
    except Exception:
        lib.vkDestroyBuffer(device, buffer[0], ffi.NULL)
        raise
    imported = HostImport(buffer[0], memory[0], owner)
    check(lib.vkBindBufferMemory(device, buffer[0], memory[0], 0), "vkBindBufferMemory(host arena)")
    return imported


def record_copy(
    backend,
    imported: HostImport,
    tensor: str,
    offset: int,
    to_host: bool,
    part: tuple[int, int] | None = None,
) -> int:
    """Record a copy of ``tensor`` (or its bytes ``part``: (first, count)) to (``to_host``) or from
    the imported range at ``offset`` (where byte 0 of the tensor goes), as a program for
    ``backend.submit``.

    Returns:
        Its handle (freed with the layout's programs).
    """
    declared = backend.memory.layout.tensor(tensor)
    arena = backend.memory.arena_for(declared, 0)
    handles = backend.allocate_command_buffer()
    begin = ffi.new(
        "VkCommandBufferBeginInfo*",
        {
            "sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
            "flags": vk.VK_COMMAND_BUFFER_USAGE_SIMULTANEOUS_USE_BIT,
        },
    )
    check(lib.vkBeginCommandBuffer(handles[0], begin), "vkBeginCommandBuffer")
    full_barrier(handles[0])  # after the train program's (or the host's) writes
    first, size = part or (0, declared.nbytes)
    device_side, host_side = (declared.offset + first, offset + first)
    region = ffi.new(
        "VkBufferCopy*",
        {
            "srcOffset": device_side if to_host else host_side,
            "dstOffset": host_side if to_host else device_side,
            "size": size,
        },
    )
    src, dst = (arena.buffer, imported.buffer) if to_host else (imported.buffer, arena.buffer)
    lib.vkCmdCopyBuffer(handles[0], src, dst, 1, region)
    full_barrier(handles[0])  # before the host reads, or the update program
    check(lib.vkEndCommandBuffer(handles[0]), "vkEndCommandBuffer")
    plain, waiting = backend.submit_infos(handles)
    buffers = frozenset({backend.memory.buffer_key(declared, 0)})
    return backend.add_program(Recorded(handles=handles, plain=plain, waiting=waiting, buffers=buffers))


def free_import(backend, imported: HostImport) -> None:
    """Destroy the buffer and free the import (the device must be idle)."""
    lib.vkDestroyBuffer(backend.device, imported.buffer, ffi.NULL)
    lib.vkFreeMemory(backend.device, imported.memory, ffi.NULL)

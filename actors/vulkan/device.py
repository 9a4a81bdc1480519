"""Opening the logical device: the queues the queue policy chose, the features the facts found.

A VkDevice is created once per backend with everything it will ever use: its queues cannot be
added later, and a feature or extension not enabled here is undefined behaviour in a shader even
where the hardware has it. So what is enabled follows the device's facts exactly, through the same
feature chain that read them (``features``), plus the extensions those facts rely on.
"""

from __future__ import annotations

from actors.vulkan import library
from actors.vulkan.features import feature_chain
from actors.vulkan.library import check
from flow.device_facts import DeviceFacts

# Assigned, not imported by name: see library's docstring (3.11 method calls).
ffi, lib, vk = library.ffi, library.lib, library.vk


def open_device(physical, facts: DeviceFacts, compute_family: int, upload_family: int, upload_index: int):
    """Create the VkDevice with one compute queue and the upload queue.

    Args:
        physical: the VkPhysicalDevice.
        facts: its facts: every feature they list is enabled.
        compute_family: the family whose queue 0 runs programs.
        upload_family: the family of the upload queue (may be the compute family).
        upload_index: the upload queue's index in its family (1: a second compute queue).

    Returns:
        The VkDevice.
    """
    priority = ffi.new("float[]", [1.0, 1.0])
    queue_info = ffi.new("VkDeviceQueueCreateInfo[]", 2)
    queue_info[0].sType = vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO
    queue_info[0].queueFamilyIndex = compute_family
    queue_info[0].queueCount = 1 + (upload_family == compute_family and upload_index == 1)
    queue_info[0].pQueuePriorities = priority
    queue_count = 1
    if upload_family != compute_family:
        queue_info[1].sType = vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO
        queue_info[1].queueFamilyIndex = upload_family
        queue_info[1].queueCount = 1
        queue_info[1].pQueuePriorities = priority
        queue_count = 2
    chain = feature_chain(enable=facts)  # holds every feature struct until vkCreateDevice returns
    extension_names = []
    if facts.has("cooperative_matrix"):
        extension_names.append("VK_KHR_cooperative_matrix")
    if facts.has("memory_budget"):
        extension_names.append("VK_EXT_memory_budget")
    if facts.has("host_memory_import"):
        extension_names.append("VK_EXT_external_memory_host")
    ext_strings = [ffi.new("char[]", name.encode()) for name in extension_names]
    ext_array = ffi.new("char*[]", ext_strings) if ext_strings else ffi.NULL
    info = ffi.new(
        "VkDeviceCreateInfo*",
        {
            "sType": vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO,
            "pNext": chain.head,
            "queueCreateInfoCount": queue_count,
            "pQueueCreateInfos": queue_info,
            "enabledExtensionCount": len(ext_strings),
            "ppEnabledExtensionNames": ext_array,
        },
    )
    handle = ffi.new("VkDevice*")
    check(lib.vkCreateDevice(physical, info, ffi.NULL, handle), "vkCreateDevice")
    return handle[0]

"""Device facts, enumeration and selection: what each Vulkan device is, read once into DeviceFacts.

Everything the planner needs to know about a device (limits, queues, memory heaps and types,
features, cooperative matrix shapes) is read here into plain data, so the planner and the memory
and queue policies decide from records they can be tested with, never from live handles.
Enumeration orders devices best first (discrete before integrated before CPU), and that order is
the one the device indices people type refer to.
"""

from __future__ import annotations

from dataclasses import replace

from actors.vulkan import library
from actors.vulkan.features import feature_chain
from actors.vulkan.library import INSTALL_HINT, VulkanUnavailable, check, instance, text
from flow.device_facts import DeviceFacts, MemoryHeap, MemoryType, QueueFamily

# Assigned, not imported by name: see library's docstring (3.11 method calls).
ffi, lib, vk = library.ffi, library.lib, library.vk

_KINDS = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
_KIND_ORDER = {"discrete": 0, "integrated": 1, "virtual": 2, "cpu": 3, "other": 4}
_VENDORS = {
    0x10DE: "NVIDIA",
    0x1002: "AMD",
    0x8086: "Intel",
    0x10005: "Mesa",
    0x13B5: "ARM",
    0x5143: "Qualcomm",
    0x106B: "Apple",
}
_COMPONENT_TYPES = {
    0: "float16",
    1: "float32",
    2: "float64",
    3: "int8",
    4: "int16",
    5: "int32",
    6: "int64",
    7: "uint8",
    8: "uint16",
    9: "uint32",
    10: "uint64",
    1000141000: "bfloat16",
}


def _version(packed: int) -> str:
    return f"{packed >> 22}.{(packed >> 12) & 0x3FF}.{packed & 0xFFF}"


def _device_extensions(physical) -> tuple[str, ...]:
    count = ffi.new("uint32_t*")
    lib.vkEnumerateDeviceExtensionProperties(physical, ffi.NULL, count, ffi.NULL)
    props = ffi.new("VkExtensionProperties[]", count[0])
    lib.vkEnumerateDeviceExtensionProperties(physical, ffi.NULL, count, props)
    return tuple(sorted(text(props[i].extensionName) for i in range(count[0])))


def _cooperative_shapes(vk_instance, physical) -> tuple[str, ...]:
    try:
        query = vk.vkGetInstanceProcAddr(vk_instance, "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
    except Exception:  # the loader has no such entry point
        return ()
    try:
        props = query(physical)
    except Exception:
        return ()
    shapes = []
    for p in props:
        a = _COMPONENT_TYPES.get(p.AType, str(p.AType))
        c = _COMPONENT_TYPES.get(p.ResultType, str(p.ResultType))
        scope = "subgroup" if p.scope == 3 else f"scope{p.scope}"
        shapes.append(f"{p.MSize}x{p.NSize}x{p.KSize} {a}->{c} {scope}")
    return tuple(sorted(set(shapes)))


def _features(physical, extensions: tuple[str, ...]) -> tuple[str, ...]:
    """The optional features vkflow uses that ``physical`` has, in a fixed order."""
    chain = feature_chain()
    features2 = ffi.new(
        "VkPhysicalDeviceFeatures2*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, "pNext": chain.head},
    )
    lib.vkGetPhysicalDeviceFeatures2(physical, features2)
    features = chain.enabled()
    if "VK_KHR_push_descriptor" in extensions:
        features.append("push_descriptors")
    if "VK_EXT_memory_budget" in extensions:
        features.append("memory_budget")
    if "VK_KHR_cooperative_matrix" in extensions:
        features.append("cooperative_matrix")
    if "VK_EXT_external_memory_host" in extensions:  # a host arena every member imports
        features.append("host_memory_import")
    if features2.features.shaderInt64:
        features.append("int64")
    return tuple(features)


def _memory(physical, budgets: bool) -> tuple[tuple[MemoryHeap, ...], tuple[MemoryType, ...]]:
    """The device's heaps (with VK_EXT_memory_budget's budgets where ``budgets``) and memory types."""
    budget = ffi.new(
        "VkPhysicalDeviceMemoryBudgetPropertiesEXT*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT},
    )
    memory2 = ffi.new(
        "VkPhysicalDeviceMemoryProperties2*",
        {
            "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2,
            "pNext": budget if budgets else ffi.NULL,
        },
    )
    lib.vkGetPhysicalDeviceMemoryProperties2(physical, memory2)
    memory = memory2.memoryProperties
    heaps = tuple(
        MemoryHeap(
            index=i,
            size=int(memory.memoryHeaps[i].size),
            device_local=bool(memory.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT),
            budget=int(budget.heapBudget[i]) if budgets else None,
        )
        for i in range(memory.memoryHeapCount)
    )
    flag_names = (
        (vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, "device_local"),
        (vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT, "host_visible"),
        (vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT, "host_coherent"),
        (vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT, "host_cached"),
    )
    types = tuple(
        MemoryType(
            index=i,
            heap=int(memory.memoryTypes[i].heapIndex),
            flags=tuple(name for bit, name in flag_names if memory.memoryTypes[i].propertyFlags & bit),
        )
        for i in range(memory.memoryTypeCount)
    )
    return heaps, types


def _queue_families(physical) -> tuple[QueueFamily, ...]:
    count = ffi.new("uint32_t*")
    lib.vkGetPhysicalDeviceQueueFamilyProperties(physical, count, ffi.NULL)
    families = ffi.new("VkQueueFamilyProperties[]", count[0])
    lib.vkGetPhysicalDeviceQueueFamilyProperties(physical, count, families)
    return tuple(
        QueueFamily(
            index=i,
            count=int(families[i].queueCount),
            graphics=bool(families[i].queueFlags & vk.VK_QUEUE_GRAPHICS_BIT),
            compute=bool(families[i].queueFlags & vk.VK_QUEUE_COMPUTE_BIT),
            transfer=bool(families[i].queueFlags & vk.VK_QUEUE_TRANSFER_BIT),
            timestamp_bits=int(families[i].timestampValidBits),
        )
        for i in range(count[0])
    )


def facts_for(vk_instance, physical, index: int) -> DeviceFacts:
    """Read one physical device's facts.

    Args:
        vk_instance: the VkInstance (for the cooperative matrix query's entry point).
        physical: the VkPhysicalDevice.
        index: its position in the enumeration.

    Returns:
        The device's facts.
    """
    extensions = _device_extensions(physical)
    subgroup = ffi.new(
        "VkPhysicalDeviceSubgroupProperties*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES},
    )
    controls = ffi.new(
        "VkPhysicalDeviceFloatControlsProperties*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FLOAT_CONTROLS_PROPERTIES, "pNext": subgroup},
    )
    driver = ffi.new(
        "VkPhysicalDeviceDriverProperties*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES, "pNext": controls},
    )
    props2 = ffi.new(
        "VkPhysicalDeviceProperties2*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, "pNext": driver},
    )
    lib.vkGetPhysicalDeviceProperties2(physical, props2)
    props = props2.properties
    limits = props.limits
    features = _features(physical, extensions)
    # Shaders may ask for float16 conversions rounded to nearest even with subnormals kept, which
    # is numpy's astype (registry.FP16_ROUNDING_VARIANTS use the hardware's conversion then).
    if controls.shaderRoundingModeRTEFloat16 and controls.shaderDenormPreserveFloat16 and "fp16" in features:
        features = (*features, "fp16_exact_rounding")
    heaps, types = _memory(physical, "memory_budget" in features)
    driver_text = f"{text(driver.driverName)} {text(driver.driverInfo)}".strip()
    return DeviceFacts(
        index=index,
        name=text(props.deviceName),
        kind=_KINDS.get(props.deviceType, "other"),
        vendor=_VENDORS.get(props.vendorID, f"{props.vendorID:#x}"),
        vendor_id=int(props.vendorID),
        api_version=_version(props.apiVersion),
        driver_version=driver_text or str(props.driverVersion),
        queue_families=_queue_families(physical),
        heaps=heaps,
        memory_types=types,
        max_workgroup_size=tuple(int(limits.maxComputeWorkGroupSize[i]) for i in range(3)),
        max_workgroup_invocations=int(limits.maxComputeWorkGroupInvocations),
        max_workgroup_count=tuple(int(limits.maxComputeWorkGroupCount[i]) for i in range(3)),
        shared_memory_bytes=int(limits.maxComputeSharedMemorySize),
        subgroup_size=int(subgroup.subgroupSize),
        max_push_constants=int(limits.maxPushConstantsSize),
        max_storage_buffer_range=int(limits.maxStorageBufferRange),
        min_storage_offset_alignment=int(limits.minStorageBufferOffsetAlignment),
        timestamp_period_ns=float(limits.timestampPeriod),
        features=features,
        cooperative_matrix_shapes=_cooperative_shapes(vk_instance, physical)
        if "cooperative_matrix" in features
        else (),
        extensions=extensions,
    )


def physical_devices() -> list[tuple[DeviceFacts, object]]:
    """(facts, VkPhysicalDevice) of every device that can compute, best first.

    Raises:
        VulkanUnavailable: with the install command when there is no loader or driver.
    """
    vk_instance = instance()
    count = ffi.new("uint32_t*")
    check(lib.vkEnumeratePhysicalDevices(vk_instance, count, ffi.NULL), "vkEnumeratePhysicalDevices")
    handles = ffi.new("VkPhysicalDevice[]", count[0])
    check(lib.vkEnumeratePhysicalDevices(vk_instance, count, handles), "vkEnumeratePhysicalDevices")
    found = []
    for i in range(count[0]):
        facts = facts_for(vk_instance, handles[i], i)
        if any(f.compute for f in facts.queue_families):
            found.append((facts, handles[i]))
    # Order discrete > integrated > virtual > cpu, stable within a kind; indices follow that order.
    found.sort(key=lambda pair: _KIND_ORDER.get(pair[0].kind, 9))
    return [(replace(facts, index=position), handle) for position, (facts, handle) in enumerate(found)]


def enumerate_devices() -> list[DeviceFacts]:
    """Every Vulkan device that can compute, best first.

    Returns:
        Facts per device; empty when the driver reports none.

    Raises:
        VulkanUnavailable: with the install command when there is no loader or driver.
    """
    return [facts for facts, _ in physical_devices()]


def select_device(select: int | str = "auto") -> tuple[DeviceFacts, object]:
    """Pick a device by index, by (case-insensitive substring of) name, or the best one.

    Args:
        select: "auto" (or None) for the best device, an index, or part of a name.

    Returns:
        (facts, VkPhysicalDevice).

    Raises:
        VulkanUnavailable: no device that can compute.
        LookupError: naming the request and the devices there are.
    """
    devices = physical_devices()
    if not devices:
        raise VulkanUnavailable(f"the Vulkan driver reports no device that can compute; try: {INSTALL_HINT}")
    if select in ("auto", None):
        return devices[0]
    if isinstance(select, int):
        if 0 <= select < len(devices):
            return devices[select]
    else:
        for facts, handle in devices:
            if select.lower() in facts.name.lower():
                return facts, handle
    names = ", ".join(f"{f.index}: {f.name}" for f, _ in devices)
    raise LookupError(f"no Vulkan device matches {select!r}; devices: {names}")

"""The Vulkan backend: the only module that imports ``vulkan``.

It enumerates devices into DeviceFacts, allocates a plan's arenas from large memory blocks,
records each Program into a command buffer once per slot and replays it with one submit.
Submissions signal a timeline semaphore (or a fence where the driver lacks timelines); ``wait``
blocks, so the runtime calls it from a worker thread.

Structs are built with ``ffi.new`` and every nested struct is bound to a name that lives until the
call returns: the cffi binding frees temporaries early and the driver then reads garbage.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from actors.backend import DeviceFacts, MemoryHeap, MemoryType, QueueFamily, memory_budget
from actors.memory import BlockAllocator, Placement, choose_memory_type
from flow.program import Barrier, Layout, Program, Tensor
from shaders.compiler import compile_shader
from shaders.registry import OpDef
from shaders.registry import op as op_def


class VulkanUnavailable(RuntimeError):
    """No Vulkan loader, no driver, or no device that can compute."""


try:
    import vulkan as vk
except OSError as _error:  # the binding raises OSError when libvulkan.so.1 is missing
    vk = None
    _IMPORT_ERROR: Exception | None = _error
else:
    _IMPORT_ERROR = None

if vk is not None:
    ffi = vk.ffi
    lib = vk.lib

INSTALL_HINT = "apt-get install -y libvulkan1 mesa-vulkan-drivers"
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
_TIMEOUT_NS = 2**64 - 1
_DIRECT_READ_BYTES = 1 << 20
_PARALLEL_WRITE_BYTES = 8 << 20
_WRITE_THREADS = 4


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with VkResult {result}")


def _require_loader() -> None:
    if vk is None:
        raise VulkanUnavailable(f"no Vulkan loader ({_IMPORT_ERROR}); install one with: {INSTALL_HINT}")


def _text(chars) -> str:
    return ffi.string(chars).decode("utf-8", "replace")


class _Instance:
    """One VkInstance per process, shared by every backend and by enumeration."""

    _lock = threading.Lock()
    _handle = None

    @classmethod
    def get(cls):
        _require_loader()
        with cls._lock:
            if cls._handle is None:
                name = ffi.new("char[]", b"vkflow")  # bound to a name: must outlive the create call
                app = ffi.new(
                    "VkApplicationInfo*",
                    {
                        "sType": vk.VK_STRUCTURE_TYPE_APPLICATION_INFO,
                        "pApplicationName": name,
                        "apiVersion": vk.VK_MAKE_VERSION(1, 2, 0),
                    },
                )
                info = ffi.new(
                    "VkInstanceCreateInfo*",
                    {
                        "sType": vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
                        "pApplicationInfo": app,
                    },
                )
                handle = ffi.new("VkInstance*")
                result = lib.vkCreateInstance(info, ffi.NULL, handle)
                if result != 0:
                    raise VulkanUnavailable(
                        f"vkCreateInstance failed ({result}): no Vulkan driver? "
                        f"install one with: {INSTALL_HINT}"
                    )
                cls._handle = handle[0]
            return cls._handle


def _version(packed: int) -> str:
    return f"{packed >> 22}.{(packed >> 12) & 0x3FF}.{packed & 0xFFF}"


def _device_extensions(physical) -> tuple[str, ...]:
    count = ffi.new("uint32_t*")
    lib.vkEnumerateDeviceExtensionProperties(physical, ffi.NULL, count, ffi.NULL)
    props = ffi.new("VkExtensionProperties[]", count[0])
    lib.vkEnumerateDeviceExtensionProperties(physical, ffi.NULL, count, props)
    return tuple(sorted(_text(props[i].extensionName) for i in range(count[0])))


def _cooperative_shapes(instance, physical) -> tuple[str, ...]:
    try:
        query = vk.vkGetInstanceProcAddr(instance, "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
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


def _facts_for(instance, physical, index: int) -> DeviceFacts:
    extensions = _device_extensions(physical)
    subgroup = ffi.new(
        "VkPhysicalDeviceSubgroupProperties*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES},
    )
    driver = ffi.new(
        "VkPhysicalDeviceDriverProperties*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES, "pNext": subgroup},
    )
    props2 = ffi.new(
        "VkPhysicalDeviceProperties2*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, "pNext": driver},
    )
    lib.vkGetPhysicalDeviceProperties2(physical, props2)
    props = props2.properties
    limits = props.limits

    storage16 = ffi.new(
        "VkPhysicalDevice16BitStorageFeatures*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES},
    )
    f16i8 = ffi.new(
        "VkPhysicalDeviceShaderFloat16Int8Features*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_FLOAT16_INT8_FEATURES, "pNext": storage16},
    )
    timeline = ffi.new(
        "VkPhysicalDeviceTimelineSemaphoreFeatures*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_TIMELINE_SEMAPHORE_FEATURES, "pNext": f16i8},
    )
    features2 = ffi.new(
        "VkPhysicalDeviceFeatures2*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, "pNext": timeline},
    )
    lib.vkGetPhysicalDeviceFeatures2(physical, features2)

    features = []
    if f16i8.shaderFloat16:
        features.append("fp16")
    if f16i8.shaderInt8:
        features.append("int8")
    if storage16.storageBuffer16BitAccess:
        features.append("storage16")
    if timeline.timelineSemaphore:
        features.append("timeline_semaphore")
    if "VK_KHR_push_descriptor" in extensions:
        features.append("push_descriptors")
    if "VK_EXT_memory_budget" in extensions:
        features.append("memory_budget")
    if "VK_KHR_cooperative_matrix" in extensions:
        features.append("cooperative_matrix")
    if features2.features.shaderInt64:
        features.append("int64")

    budget = ffi.new(
        "VkPhysicalDeviceMemoryBudgetPropertiesEXT*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT},
    )
    memory2 = ffi.new(
        "VkPhysicalDeviceMemoryProperties2*",
        {
            "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2,
            "pNext": budget if "memory_budget" in features else ffi.NULL,
        },
    )
    lib.vkGetPhysicalDeviceMemoryProperties2(physical, memory2)
    memory = memory2.memoryProperties
    heaps = tuple(
        MemoryHeap(
            index=i,
            size=int(memory.memoryHeaps[i].size),
            device_local=bool(memory.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT),
            budget=int(budget.heapBudget[i]) if "memory_budget" in features else None,
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

    count = ffi.new("uint32_t*")
    lib.vkGetPhysicalDeviceQueueFamilyProperties(physical, count, ffi.NULL)
    families = ffi.new("VkQueueFamilyProperties[]", count[0])
    lib.vkGetPhysicalDeviceQueueFamilyProperties(physical, count, families)
    queue_families = tuple(
        QueueFamily(
            index=i,
            count=int(families[i].queueCount),
            graphics=bool(families[i].queueFlags & vk.VK_QUEUE_GRAPHICS_BIT),
            compute=bool(families[i].queueFlags & vk.VK_QUEUE_COMPUTE_BIT),
            transfer=bool(families[i].queueFlags & vk.VK_QUEUE_TRANSFER_BIT),
        )
        for i in range(count[0])
    )
    driver_text = f"{_text(driver.driverName)} {_text(driver.driverInfo)}".strip()
    return DeviceFacts(
        index=index,
        name=_text(props.deviceName),
        kind=_KINDS.get(props.deviceType, "other"),
        vendor=_VENDORS.get(props.vendorID, f"{props.vendorID:#x}"),
        vendor_id=int(props.vendorID),
        api_version=_version(props.apiVersion),
        driver_version=driver_text or str(props.driverVersion),
        queue_families=queue_families,
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
        features=tuple(features),
        cooperative_matrix_shapes=_cooperative_shapes(instance, physical)
        if "cooperative_matrix" in features
        else (),
        extensions=extensions,
    )


def _physical_devices():
    instance = _Instance.get()
    count = ffi.new("uint32_t*")
    _check(lib.vkEnumeratePhysicalDevices(instance, count, ffi.NULL), "vkEnumeratePhysicalDevices")
    handles = ffi.new("VkPhysicalDevice[]", count[0])
    _check(lib.vkEnumeratePhysicalDevices(instance, count, handles), "vkEnumeratePhysicalDevices")
    found = []
    for i in range(count[0]):
        facts = _facts_for(instance, handles[i], i)
        if any(f.compute for f in facts.queue_families):
            found.append((facts, handles[i]))
    # Order discrete > integrated > virtual > cpu, stable within a kind; indices follow that order.
    found.sort(key=lambda pair: _KIND_ORDER.get(pair[0].kind, 9))
    return [(_reindex(facts, position), handle) for position, (facts, handle) in enumerate(found)]


def _reindex(facts: DeviceFacts, index: int) -> DeviceFacts:
    from dataclasses import replace

    return replace(facts, index=index)


def enumerate_devices() -> list[DeviceFacts]:
    """Every Vulkan device that can compute, best first.

    Returns:
        Facts per device; empty when the driver reports none.

    Raises:
        VulkanUnavailable: with the install command when there is no loader or driver.
    """
    return [facts for facts, _ in _physical_devices()]


def select_device(select: int | str = "auto") -> tuple[DeviceFacts, object]:
    """Pick a device by index, by (case-insensitive substring of) name, or the best one.

    Raises:
        VulkanUnavailable: no device that can compute.
        LookupError: naming the request and the devices there are.
    """
    devices = _physical_devices()
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


@dataclass
class _ArenaBuffer:
    buffer: object
    placement: Placement
    size: int
    mapped: object | None  # cffi pointer to the first byte, when host visible
    cached: bool = False  # host-cached memory: fast for the CPU to read


@dataclass
class _Recorded:
    command_buffer: object
    command_buffers_ptr: object
    keep: list = field(default_factory=list)


class VulkanBackend:
    """Runs Programs on one Vulkan device. See the module docstring."""

    def __init__(
        self, device: int | str = "auto", memory_fraction: float = 0.9, block_bytes: int = 64 * 2**20
    ) -> None:
        self.facts, self._physical = select_device(device)
        self.budget = memory_budget(self.facts, memory_fraction)
        self._allocator = BlockAllocator(self.budget, block_bytes)
        self._lock = threading.Lock()
        self._closed = False
        self._blocks: list[object] = []
        self._block_maps: dict[int, object] = {}
        self._arenas: dict[tuple[str, int], _ArenaBuffer] = {}
        self._layout: Layout | None = None
        self.slots = 0
        self._pipelines: dict[tuple, tuple[object, object, object]] = {}
        self._modules: dict[str, object] = {}
        self._set_layouts: dict[int, object] = {}
        self._descriptor_pools: list[object] = []
        self._recorded: list[_Recorded] = []
        self._query_pools: list[TimestampPool] = []
        self.tuning = True  # per-launch specialisation (tiles) from the registry's tune functions
        self._create_device()

    # -- device and queue -------------------------------------------------------------------
    def _create_device(self) -> None:
        families = self.facts.queue_families
        # A compute-only family avoids sharing a queue with graphics work where the device has one.
        family = min((f for f in families if f.compute), key=lambda f: (f.graphics, f.index))
        self.queue_family = family.index
        priority = ffi.new("float[]", [1.0])
        queue_info = ffi.new(
            "VkDeviceQueueCreateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
                "queueFamilyIndex": family.index,
                "queueCount": 1,
                "pQueuePriorities": priority,
            },
        )
        self.timeline = self.facts.has("timeline_semaphore")
        storage16 = ffi.new(
            "VkPhysicalDevice16BitStorageFeatures*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES,
                "storageBuffer16BitAccess": int(self.facts.has("storage16")),
            },
        )
        f16i8 = ffi.new(
            "VkPhysicalDeviceShaderFloat16Int8Features*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_FLOAT16_INT8_FEATURES,
                "pNext": storage16,
                "shaderFloat16": int(self.facts.has("fp16")),
                "shaderInt8": int(self.facts.has("int8")),
            },
        )
        timeline = ffi.new(
            "VkPhysicalDeviceTimelineSemaphoreFeatures*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_TIMELINE_SEMAPHORE_FEATURES,
                "pNext": f16i8,
                "timelineSemaphore": int(self.timeline),
            },
        )
        chain = timeline
        extension_names = []
        coop = None
        if self.facts.has("cooperative_matrix"):
            coop = ffi.new(
                "VkPhysicalDeviceCooperativeMatrixFeaturesKHR*",
                {
                    "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR,
                    "pNext": chain,
                    "cooperativeMatrix": 1,
                },
            )
            chain = coop
            extension_names.append("VK_KHR_cooperative_matrix")
        if self.facts.has("memory_budget"):
            extension_names.append("VK_EXT_memory_budget")
        ext_strings = [ffi.new("char[]", name.encode()) for name in extension_names]
        ext_array = ffi.new("char*[]", ext_strings) if ext_strings else ffi.NULL
        info = ffi.new(
            "VkDeviceCreateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO,
                "pNext": chain,
                "queueCreateInfoCount": 1,
                "pQueueCreateInfos": queue_info,
                "enabledExtensionCount": len(ext_strings),
                "ppEnabledExtensionNames": ext_array,
            },
        )
        handle = ffi.new("VkDevice*")
        _check(lib.vkCreateDevice(self._physical, info, ffi.NULL, handle), "vkCreateDevice")
        self.device = handle[0]
        queue = ffi.new("VkQueue*")
        lib.vkGetDeviceQueue(self.device, family.index, 0, queue)
        self.queue = queue[0]
        pool_info = ffi.new(
            "VkCommandPoolCreateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
                "queueFamilyIndex": family.index,
                "flags": vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
            },
        )
        pool = ffi.new("VkCommandPool*")
        _check(lib.vkCreateCommandPool(self.device, pool_info, ffi.NULL, pool), "vkCreateCommandPool")
        self.command_pool = pool[0]
        self._submitted = 0
        self._fences: dict[int, object] = {}
        if self.timeline:
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
            _check(lib.vkCreateSemaphore(self.device, sem_info, ffi.NULL, semaphore), "vkCreateSemaphore")
            self.semaphore = semaphore[0]
            # Reused for every submit: only the signal value changes, so a replay costs one call.
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
            self._wait_value = ffi.new("uint64_t[]", [0])
            self._wait_info = ffi.new(
                "VkSemaphoreWaitInfo*",
                {
                    "sType": vk.VK_STRUCTURE_TYPE_SEMAPHORE_WAIT_INFO,
                    "semaphoreCount": 1,
                    "pSemaphores": self._semaphore_array,
                    "pValues": self._wait_value,
                },
            )
            self._counter = ffi.new("uint64_t*")

    # -- memory -----------------------------------------------------------------------------
    def _create_buffer(
        self, name: str, size: int, host_visible: bool, host_reads: bool = False
    ) -> _ArenaBuffer:
        usage = (
            vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT
            | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
            | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT
        )
        info = ffi.new(
            "VkBufferCreateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO,
                "size": size,
                "usage": usage,
                "sharingMode": vk.VK_SHARING_MODE_EXCLUSIVE,
            },
        )
        handle = ffi.new("VkBuffer*")
        _check(lib.vkCreateBuffer(self.device, info, ffi.NULL, handle), f"vkCreateBuffer({name})")
        buffer = handle[0]
        requirements = ffi.new("VkMemoryRequirements*")
        lib.vkGetBufferMemoryRequirements(self.device, buffer, requirements)
        memory_type = choose_memory_type(
            self.facts.memory_types, requirements.memoryTypeBits, host_visible, host_reads
        )
        try:
            placement, new_block = self._allocator.place(
                name, int(requirements.size), int(requirements.alignment), memory_type.index
            )
        except Exception:
            lib.vkDestroyBuffer(self.device, buffer, ffi.NULL)
            raise
        if new_block is not None:
            self._allocate_block(new_block, memory_type)
        block = self._blocks[placement.block]
        _check(
            lib.vkBindBufferMemory(self.device, buffer, block, placement.offset),
            f"vkBindBufferMemory({name})",
        )
        mapped = None
        if "host_visible" in memory_type.flags:
            mapped = self._block_maps[placement.block] + placement.offset
        return _ArenaBuffer(
            buffer=buffer,
            placement=placement,
            size=size,
            mapped=mapped,
            cached="host_cached" in memory_type.flags,
        )

    def _allocate_block(self, size: int, memory_type: MemoryType) -> None:
        info = ffi.new(
            "VkMemoryAllocateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                "allocationSize": size,
                "memoryTypeIndex": memory_type.index,
            },
        )
        handle = ffi.new("VkDeviceMemory*")
        result = lib.vkAllocateMemory(self.device, info, ffi.NULL, handle)
        if result != 0:
            self._allocator.blocks.pop()
            raise MemoryError(
                f"vkAllocateMemory of {size:,} bytes (type {memory_type.index}) failed: {result}"
            )
        self._blocks.append(handle[0])
        if "host_visible" in memory_type.flags:
            pointer = ffi.new("void**")
            _check(lib.vkMapMemory(self.device, handle[0], 0, size, 0, pointer), "vkMapMemory")
            self._block_maps[len(self._blocks) - 1] = ffi.cast("char*", pointer[0])

    def open_layout(self, layout: Layout, slots: int = 1) -> None:
        """Allocate every arena (per-slot ones ``slots`` times). Replaces any earlier layout."""
        self._release_layout()
        self._layout = layout
        self.slots = slots
        for arena in layout.arenas:
            for slot in range(slots if arena.per_slot else 1):
                name = arena.name if not arena.per_slot else f"{arena.name}[slot {slot}]"
                # Every arena is mappable where the device has ReBAR-style memory, so weights and
                # batches move without staging copies; elsewhere only host-visible arenas are.
                self._arenas[(arena.name, slot)] = self._create_buffer(
                    name, max(arena.nbytes, 256), arena.host_visible or self._has_rebar()
                )

    def _has_rebar(self) -> bool:
        largest = max((h for h in self.facts.heaps if h.device_local), key=lambda h: h.size, default=None)
        if largest is None:
            return False
        return any(
            {"device_local", "host_visible", "host_coherent"} <= set(t.flags) and t.heap == largest.index
            for t in self.facts.memory_types
        )

    def _arena_for(self, tensor: Tensor, slot: int) -> _ArenaBuffer:
        assert self._layout is not None, "open_layout first"
        arena = self._layout.arena(tensor.arena)
        if arena.per_slot and not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range (0..{self.slots - 1})")
        return self._arenas[(arena.name, slot if arena.per_slot else 0)]

    def write(self, tensor: str, data: np.ndarray, slot: int = 0) -> None:
        assert self._layout is not None, "open_layout first"
        spec = self._layout.tensor(tensor)
        array = np.ascontiguousarray(data, dtype=np.dtype(spec.dtype))
        if array.size > spec.size:
            raise ValueError(
                f"write to {tensor!r}: holds {spec.size} elements {spec.shape}, got {array.size}"
            )
        # A shorter write fills a prefix: a partial final batch uses only its first rows.
        target = self._arena_for(spec, slot)
        if target.mapped is None:
            self._staged_copy(target, spec.offset, array.nbytes, upload=array)
        elif array.nbytes < _PARALLEL_WRITE_BYTES:
            ffi.memmove(target.mapped + spec.offset, ffi.from_buffer(array), array.nbytes)
        else:
            self._parallel_write(target.mapped + spec.offset, array)

    def _parallel_write(self, pointer, array: np.ndarray) -> None:
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

    def read(self, tensor: str, slot: int = 0) -> np.ndarray:
        assert self._layout is not None, "open_layout first"
        spec = self._layout.tensor(tensor)
        out = np.empty(spec.shape, dtype=np.dtype(spec.dtype))
        source = self._arena_for(spec, slot)
        # CPU reads of uncached (write-combined) VRAM crawl; bulk reads go through cached staging.
        if source.mapped is not None and (source.cached or out.nbytes < _DIRECT_READ_BYTES):
            ffi.memmove(ffi.from_buffer(out), source.mapped + spec.offset, out.nbytes)
        else:
            self._staged_copy(source, spec.offset, out.nbytes, download=out)
        return out

    def write_into(self, tensor: str, slot: int = 0) -> np.ndarray | None:
        """A writable numpy view straight onto a host-visible tensor (no copy), or None when the
        tensor's memory is not mappable. The loader fills batches in place through it."""
        assert self._layout is not None, "open_layout first"
        spec = self._layout.tensor(tensor)
        target = self._arena_for(spec, slot)
        if target.mapped is None:
            return None
        buffer = ffi.buffer(target.mapped + spec.offset, spec.nbytes)
        return np.frombuffer(buffer, dtype=np.dtype(spec.dtype)).reshape(spec.shape)

    def _staged_copy(self, arena: _ArenaBuffer, offset: int, nbytes: int, upload=None, download=None) -> None:
        staging = self._create_buffer("staging", max(nbytes, 4), True, host_reads=download is not None)
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
            command = self._begin_one_shot()
            self._full_barrier(command)
            lib.vkCmdCopyBuffer(command, src, dst, 1, region)
            self._full_barrier(command)
            self._finish_one_shot(command)
            if download is not None:
                ffi.memmove(ffi.from_buffer(download), staging.mapped, nbytes)
        finally:
            lib.vkDestroyBuffer(self.device, staging.buffer, ffi.NULL)
            self._allocator.release(staging.placement)

    # -- pipelines --------------------------------------------------------------------------
    def _set_layout(self, bindings: int):
        if bindings not in self._set_layouts:
            entries = ffi.new(
                "VkDescriptorSetLayoutBinding[]",
                [
                    {
                        "binding": i,
                        "descriptorType": vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                        "descriptorCount": 1,
                        "stageFlags": vk.VK_SHADER_STAGE_COMPUTE_BIT,
                    }
                    for i in range(bindings)
                ],
            )
            info = ffi.new(
                "VkDescriptorSetLayoutCreateInfo*",
                {
                    "sType": vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO,
                    "bindingCount": bindings,
                    "pBindings": entries,
                },
            )
            handle = ffi.new("VkDescriptorSetLayout*")
            _check(
                lib.vkCreateDescriptorSetLayout(self.device, info, ffi.NULL, handle),
                "vkCreateDescriptorSetLayout",
            )
            self._set_layouts[bindings] = handle[0]
        return self._set_layouts[bindings]

    def _module(self, shader: str, defines: tuple[tuple[str, str], ...]):
        key = (shader, defines)
        if key not in self._modules:
            code = compile_shader(shader, dict(defines))
            code_buffer = ffi.from_buffer(code)
            info = ffi.new(
                "VkShaderModuleCreateInfo*",
                {
                    "sType": vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO,
                    "codeSize": len(code),
                    "pCode": ffi.cast("uint32_t*", code_buffer),
                },
            )
            handle = ffi.new("VkShaderModule*")
            _check(
                lib.vkCreateShaderModule(self.device, info, ffi.NULL, handle),
                f"vkCreateShaderModule({shader})",
            )
            self._modules[key] = handle[0]
        return self._modules[key]

    def pipeline(
        self,
        definition: OpDef,
        spec_overrides: dict[str, int] | None = None,
        defines: tuple[tuple[str, str], ...] = (),
    ):
        """(pipeline, pipeline layout, spec values) for an op, cached per op and specialisation."""
        spec = definition.spec_values(spec_overrides)
        local = definition.local(spec)
        key = (definition.name, local, tuple(sorted(spec.items())), defines)
        if key in self._pipelines:
            return self._pipelines[key]
        values = [*local, *(spec[name] for name, _ in definition.spec)]
        entries = ffi.new(
            "VkSpecializationMapEntry[]",
            [{"constantID": i, "offset": 4 * i, "size": 4} for i in range(len(values))],
        )
        data = ffi.new("uint32_t[]", values)
        spec_info = ffi.new(
            "VkSpecializationInfo*",
            {
                "mapEntryCount": len(values),
                "pMapEntries": entries,
                "dataSize": 4 * len(values),
                "pData": data,
            },
        )
        set_layout = ffi.new("VkDescriptorSetLayout[]", [self._set_layout(len(definition.bindings))])
        push_size = 4 * len(definition.push)
        push_range = ffi.new(
            "VkPushConstantRange*",
            {"stageFlags": vk.VK_SHADER_STAGE_COMPUTE_BIT, "offset": 0, "size": push_size},
        )
        layout_info = ffi.new(
            "VkPipelineLayoutCreateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO,
                "setLayoutCount": 1,
                "pSetLayouts": set_layout,
                "pushConstantRangeCount": 1 if push_size else 0,
                "pPushConstantRanges": push_range,
            },
        )
        layout_handle = ffi.new("VkPipelineLayout*")
        _check(
            lib.vkCreatePipelineLayout(self.device, layout_info, ffi.NULL, layout_handle),
            "vkCreatePipelineLayout",
        )
        entry_name = ffi.new("char[]", b"main")
        info = ffi.new(
            "VkComputePipelineCreateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO,
                "stage": {
                    "sType": vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
                    "stage": vk.VK_SHADER_STAGE_COMPUTE_BIT,
                    "module": self._module(definition.shader, defines),
                    "pName": entry_name,
                    "pSpecializationInfo": spec_info,
                },
                "layout": layout_handle[0],
            },
        )
        handle = ffi.new("VkPipeline*")
        _check(
            lib.vkCreateComputePipelines(self.device, ffi.NULL, 1, info, ffi.NULL, handle),
            f"vkCreateComputePipelines({definition.name})",
        )
        self._pipelines[key] = (handle[0], layout_handle[0], spec)
        return self._pipelines[key]

    # -- recording --------------------------------------------------------------------------
    def _descriptor_set(self, bindings: int):
        for _attempt in range(2):
            if self._descriptor_pools:
                set_layout = ffi.new("VkDescriptorSetLayout[]", [self._set_layout(bindings)])
                info = ffi.new(
                    "VkDescriptorSetAllocateInfo*",
                    {
                        "sType": vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
                        "descriptorPool": self._descriptor_pools[-1],
                        "descriptorSetCount": 1,
                        "pSetLayouts": set_layout,
                    },
                )
                handle = ffi.new("VkDescriptorSet*")
                if lib.vkAllocateDescriptorSets(self.device, info, handle) == 0:
                    return handle[0]
            sizes = ffi.new(
                "VkDescriptorPoolSize*",
                {"type": vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, "descriptorCount": 8192},
            )
            pool_info = ffi.new(
                "VkDescriptorPoolCreateInfo*",
                {
                    "sType": vk.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
                    "maxSets": 1024,
                    "poolSizeCount": 1,
                    "pPoolSizes": sizes,
                },
            )
            pool = ffi.new("VkDescriptorPool*")
            _check(
                lib.vkCreateDescriptorPool(self.device, pool_info, ffi.NULL, pool), "vkCreateDescriptorPool"
            )
            self._descriptor_pools.append(pool[0])
        raise RuntimeError("could not allocate a descriptor set")

    def _full_barrier(self, command) -> None:
        barrier = ffi.new(
            "VkMemoryBarrier*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                "srcAccessMask": vk.VK_ACCESS_SHADER_WRITE_BIT
                | vk.VK_ACCESS_TRANSFER_WRITE_BIT
                | vk.VK_ACCESS_HOST_WRITE_BIT,
                "dstAccessMask": vk.VK_ACCESS_SHADER_READ_BIT
                | vk.VK_ACCESS_SHADER_WRITE_BIT
                | vk.VK_ACCESS_TRANSFER_READ_BIT
                | vk.VK_ACCESS_TRANSFER_WRITE_BIT
                | vk.VK_ACCESS_HOST_READ_BIT,
            },
        )
        stages = (
            vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
            | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
            | vk.VK_PIPELINE_STAGE_HOST_BIT
        )
        lib.vkCmdPipelineBarrier(command, stages, stages, 0, 1, barrier, 0, ffi.NULL, 0, ffi.NULL)

    def _compute_barrier(self, command) -> None:
        barrier = ffi.new(
            "VkMemoryBarrier*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                "srcAccessMask": vk.VK_ACCESS_SHADER_WRITE_BIT,
                "dstAccessMask": vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT,
            },
        )
        stage = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
        lib.vkCmdPipelineBarrier(command, stage, stage, 0, 1, barrier, 0, ffi.NULL, 0, ffi.NULL)

    def _allocate_command_buffer(self):
        info = ffi.new(
            "VkCommandBufferAllocateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
                "commandPool": self.command_pool,
                "level": vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
                "commandBufferCount": 1,
            },
        )
        handle = ffi.new("VkCommandBuffer[]", 1)
        _check(lib.vkAllocateCommandBuffers(self.device, info, handle), "vkAllocateCommandBuffers")
        return handle

    def record(
        self,
        program: Program,
        slot: int = 0,
        spec_overrides: dict[str, dict[str, int]] | None = None,
        timestamps: object | None = None,
    ) -> int:
        """Record ``program`` once, bound to ``slot``'s per-slot arenas.

        Args:
            program: what to run.
            slot: which per-slot arenas to bind.
            spec_overrides: op name -> specialisation constants, replacing the registry's
                per-launch tuning for that op (benchmarks use it to compare tiles).
            timestamps: a QueryPool from ``timestamp_pool`` to write one timestamp before the
                first launch and after each launch (for per-kernel GPU timing in benchmarks).

        Returns:
            A handle for ``submit``.
        """
        assert self._layout is not None, "open_layout first"
        handles = self._allocate_command_buffer()
        command = handles[0]
        begin = ffi.new(
            "VkCommandBufferBeginInfo*", {"sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO}
        )
        _check(lib.vkBeginCommandBuffer(command, begin), "vkBeginCommandBuffer")
        keep: list = []
        # Orders this submission after earlier ones and after host writes of its inputs.
        self._full_barrier(command)
        if timestamps is not None:
            lib.vkCmdResetQueryPool(command, timestamps.pool, 0, timestamps.count)
            lib.vkCmdWriteTimestamp(command, vk.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, timestamps.pool, 0)
        query = 1
        for step in program.steps:
            if isinstance(step, Barrier):
                self._compute_barrier(command)
                continue
            definition = op_def(step.op)
            if len(step.args) != len(definition.bindings):
                raise ValueError(
                    f"launch of {step.op!r} binds {len(step.args)} tensors, op needs "
                    f"{len(definition.bindings)} {definition.bindings}"
                )
            overrides = (spec_overrides or {}).get(step.op)
            if definition.tune is not None:
                # tune also sets what the launch itself needs (gemm's TA/TB/VEC), so it runs even
                # when overrides replace its tiles or tuning is off (no facts: default tiles).
                tuned = definition.tune(step.param_dict, self.facts if self.tuning else None)
                overrides = {**tuned, **(overrides or {})}
            pipeline, pipeline_layout, spec = self.pipeline(definition, overrides)
            descriptor_set = self._descriptor_set(len(definition.bindings))
            infos = ffi.new("VkDescriptorBufferInfo[]", len(step.args))
            for i, name in enumerate(step.args):
                tensor = self._layout.tensor(name)
                arena = self._arena_for(tensor, slot)
                infos[i].buffer = arena.buffer
                infos[i].offset = tensor.offset
                infos[i].range = max(4, (tensor.nbytes + 3) // 4 * 4)
            writes = ffi.new("VkWriteDescriptorSet[]", len(step.args))
            for i in range(len(step.args)):
                writes[i].sType = vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET
                writes[i].dstSet = descriptor_set
                writes[i].dstBinding = i
                writes[i].descriptorCount = 1
                writes[i].descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
                writes[i].pBufferInfo = infos + i
            lib.vkUpdateDescriptorSets(self.device, len(step.args), writes, 0, ffi.NULL)
            lib.vkCmdBindPipeline(command, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipeline)
            sets = ffi.new("VkDescriptorSet[]", [descriptor_set])
            lib.vkCmdBindDescriptorSets(
                command, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipeline_layout, 0, 1, sets, 0, ffi.NULL
            )
            params = step.param_dict
            push = definition.pack_push(params)
            if push:
                push_buffer = ffi.new("char[]", push)
                lib.vkCmdPushConstants(
                    command, pipeline_layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(push), push_buffer
                )
                keep.append(push_buffer)
            gx, gy, gz = definition.groups(params, definition.local(spec), spec)
            limit = self.facts.max_workgroup_count
            if gx > limit[0] or gy > limit[1] or gz > limit[2]:
                raise ValueError(
                    f"launch of {step.op!r} needs {(gx, gy, gz)} workgroups; device allows {limit}"
                )
            lib.vkCmdDispatch(command, gx, gy, gz)
            if timestamps is not None and query < timestamps.count:
                lib.vkCmdWriteTimestamp(
                    command, vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, timestamps.pool, query
                )
                query += 1
            keep.extend((infos, writes, sets))
        self._full_barrier(command)
        _check(lib.vkEndCommandBuffer(command), "vkEndCommandBuffer")
        submit = ffi.new(
            "VkSubmitInfo*",
            {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, "commandBufferCount": 1, "pCommandBuffers": handles},
        )
        if self.timeline:
            submit.pNext = self._timeline_submit
            submit.signalSemaphoreCount = 1
            submit.pSignalSemaphores = self._semaphore_array
        recorded = _Recorded(command_buffer=command, command_buffers_ptr=handles, keep=[*keep, submit])
        self._recorded.append(recorded)
        return len(self._recorded) - 1

    # -- submission -------------------------------------------------------------------------
    def submit(self, handle: int) -> int:
        """Queue a recorded program. Returns the ticket to wait on; never blocks on the GPU."""
        recorded = self._recorded[handle]
        submit = recorded.keep[-1]
        with self._lock:
            self._submitted += 1
            ticket = self._submitted
            if self.timeline:
                self._signal_value[0] = ticket
                _check(lib.vkQueueSubmit(self.queue, 1, submit, ffi.NULL), "vkQueueSubmit")
            else:
                fence = self._new_fence()
                _check(lib.vkQueueSubmit(self.queue, 1, submit, fence), "vkQueueSubmit")
                self._fences[ticket] = fence
        return ticket

    def _new_fence(self):
        info = ffi.new("VkFenceCreateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO})
        handle = ffi.new("VkFence*")
        _check(lib.vkCreateFence(self.device, info, ffi.NULL, handle), "vkCreateFence")
        return handle[0]

    def wait(self, ticket: int, timeout_s: float | None = None) -> None:
        """Block until ``ticket``'s submission is done (call from a worker thread under trio)."""
        timeout = _TIMEOUT_NS if timeout_s is None else int(timeout_s * 1e9)
        if self.timeline:
            value = ffi.new("uint64_t[]", [ticket])
            info = ffi.new(
                "VkSemaphoreWaitInfo*",
                {
                    "sType": vk.VK_STRUCTURE_TYPE_SEMAPHORE_WAIT_INFO,
                    "semaphoreCount": 1,
                    "pSemaphores": self._semaphore_array,
                    "pValues": value,
                },
            )
            result = lib.vkWaitSemaphores(self.device, info, timeout)
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
        _check(result, "wait")

    def is_done(self, ticket: int) -> bool:
        if self.timeline:
            lib.vkGetSemaphoreCounterValue(self.device, self.semaphore, self._counter)
            return self._counter[0] >= ticket
        with self._lock:
            pending = [self._fences[t] for t in self._fences if t <= ticket]
        return all(lib.vkGetFenceStatus(self.device, f) == 0 for f in pending)

    def _begin_one_shot(self):
        handles = self._allocate_command_buffer()
        begin = ffi.new(
            "VkCommandBufferBeginInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                "flags": vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT,
            },
        )
        _check(lib.vkBeginCommandBuffer(handles[0], begin), "vkBeginCommandBuffer")
        self._one_shot_handles = handles
        return handles[0]

    def _finish_one_shot(self, command) -> None:
        handles = self._one_shot_handles
        _check(lib.vkEndCommandBuffer(command), "vkEndCommandBuffer")
        submit = ffi.new(
            "VkSubmitInfo*",
            {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, "commandBufferCount": 1, "pCommandBuffers": handles},
        )
        fence = self._new_fence()
        with self._lock:
            _check(lib.vkQueueSubmit(self.queue, 1, submit, fence), "vkQueueSubmit")
        fences = ffi.new("VkFence[]", [fence])
        _check(lib.vkWaitForFences(self.device, 1, fences, 1, _TIMEOUT_NS), "vkWaitForFences")
        lib.vkDestroyFence(self.device, fence, ffi.NULL)
        lib.vkFreeCommandBuffers(self.device, self.command_pool, 1, handles)

    # -- timing -----------------------------------------------------------------------------
    def timestamp_pool(self, count: int) -> TimestampPool:
        """A query pool of ``count`` timestamps for ``record(..., timestamps=pool)``."""
        info = ffi.new(
            "VkQueryPoolCreateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
                "queryType": vk.VK_QUERY_TYPE_TIMESTAMP,
                "queryCount": count,
            },
        )
        handle = ffi.new("VkQueryPool*")
        _check(lib.vkCreateQueryPool(self.device, info, ffi.NULL, handle), "vkCreateQueryPool")
        pool = TimestampPool(pool=handle[0], count=count)
        self._query_pools.append(pool)
        return pool

    def read_timestamps_ns(self, pool: TimestampPool) -> np.ndarray:
        """The pool's timestamps in nanoseconds (call after the submission is done)."""
        data = np.zeros(pool.count, dtype=np.uint64)
        flags = vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT
        _check(
            lib.vkGetQueryPoolResults(
                self.device, pool.pool, 0, pool.count, data.nbytes, ffi.from_buffer(data), 8, flags
            ),
            "vkGetQueryPoolResults",
        )
        return data.astype(np.float64) * self.facts.timestamp_period_ns

    # -- teardown ---------------------------------------------------------------------------
    def _release_layout(self) -> None:
        if self._recorded:
            lib.vkDeviceWaitIdle(self.device)
            for recorded in self._recorded:
                lib.vkFreeCommandBuffers(self.device, self.command_pool, 1, recorded.command_buffers_ptr)
            self._recorded = []
        self.__dict__.pop("_run_program_cache", None)
        for pool in self._descriptor_pools:
            lib.vkDestroyDescriptorPool(self.device, pool, ffi.NULL)
        self._descriptor_pools = []
        for arena in self._arenas.values():
            lib.vkDestroyBuffer(self.device, arena.buffer, ffi.NULL)
            self._allocator.release(arena.placement)
        self._arenas = {}

    def close(self) -> None:
        """Wait for the queue, then destroy every Vulkan object this backend made."""
        if self._closed:
            return
        self._closed = True
        lib.vkDeviceWaitIdle(self.device)
        self._release_layout()
        for pool in self.__dict__.get("_query_pools", []):
            lib.vkDestroyQueryPool(self.device, pool.pool, ffi.NULL)
        for pipeline, layout, _ in self._pipelines.values():
            lib.vkDestroyPipeline(self.device, pipeline, ffi.NULL)
            lib.vkDestroyPipelineLayout(self.device, layout, ffi.NULL)
        for module in self._modules.values():
            lib.vkDestroyShaderModule(self.device, module, ffi.NULL)
        for set_layout in self._set_layouts.values():
            lib.vkDestroyDescriptorSetLayout(self.device, set_layout, ffi.NULL)
        for fence in self._fences.values():
            lib.vkDestroyFence(self.device, fence, ffi.NULL)
        if self.timeline:
            lib.vkDestroySemaphore(self.device, self.semaphore, ffi.NULL)
        lib.vkDestroyCommandPool(self.device, self.command_pool, ffi.NULL)
        for index, block in enumerate(self._blocks):
            if index in self._block_maps:
                lib.vkUnmapMemory(self.device, block)
            lib.vkFreeMemory(self.device, block, ffi.NULL)
        self._blocks = []
        lib.vkDestroyDevice(self.device, ffi.NULL)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the loader may already be gone
            pass


@dataclass
class TimestampPool:
    pool: object
    count: int

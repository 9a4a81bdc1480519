"""The Vulkan backend: the only module that imports ``vulkan``.

It enumerates devices into DeviceFacts, allocates a plan's arenas from large memory blocks,
records each Program into a command buffer once per slot and replays it with one submit.
Submissions signal a timeline semaphore (or a fence where the driver lacks timelines); ``wait``
blocks, so the runtime calls it from a worker thread.

Uploads (``staging_view`` + ``upload``) are DMA copies from pinned host staging memory on a
transfer queue (a transfer-only family where the device has one), with a timeline of their own;
``QueueOrder`` decides which semaphore waits keep them and the programs that bind the same
buffers in submission order.

Structs are built with ``ffi.new`` and every nested struct is bound to a name that lives until the
call returns: the cffi binding frees temporaries early and the driver then reads garbage.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from actors.backend import DeviceFacts, MemoryHeap, MemoryType, QueueFamily, memory_budget, upload_target
from actors.memory import BlockAllocator, Placement, choose_memory_type, choose_staging_type
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
# Upload tickets count on the transfer queue's own timeline; offsetting them keeps them apart from
# the compute queue's tickets (1, 2, ...), so one ``wait``/``is_done`` serves both kinds.
UPLOAD_TICKETS = 1 << 62


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
    host_reset = ffi.new(
        "VkPhysicalDeviceHostQueryResetFeatures*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_HOST_QUERY_RESET_FEATURES, "pNext": timeline},
    )
    features2 = ffi.new(
        "VkPhysicalDeviceFeatures2*",
        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, "pNext": host_reset},
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
    if host_reset.hostQueryReset:
        features.append("host_query_reset")
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
            timestamp_bits=int(families[i].timestampValidBits),
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


def choose_upload_queue(
    families: Sequence[QueueFamily], compute_family: int, timeline: bool
) -> tuple[int, int]:
    """The (family, queue index) that runs uploads.

    A transfer-only family is the copy engines: DMA beside the compute units, as CUDA's copies on a
    side stream use. Else a second queue of the compute family still lets copies overlap compute.
    Else (lavapipe has one queue), or without timeline semaphores to order two queues, uploads
    share the compute queue, where submission order and the programs' barriers order them.

    Args:
        families: the device's queue families.
        compute_family: index of the family the compute queue comes from (its queue 0).
        timeline: whether the device has timeline semaphores.

    Returns:
        (queue family index, queue index within it).
    """
    if timeline:
        for family in families:
            if family.transfer and not family.compute and not family.graphics and family.count > 0:
                return family.index, 0
        if any(f.index == compute_family and f.count > 1 for f in families):
            return compute_family, 1
    return compute_family, 0


class QueueOrder:
    """Which timeline value a submission must wait for, so that uploads (transfer queue) and
    programs (compute queue) that touch the same buffer run in the order they were submitted.

    Pure bookkeeping keyed by buffer, called under the backend's submit lock: a program waits for
    the latest upload into any buffer it binds (read after write); an upload waits for the latest
    program that binds its destination (write after read: a step still reading the last batch).
    A wait also orders everything submitted later on the same queue, so a value already waited
    for on that queue is never waited for again.
    """

    def __init__(self) -> None:
        self._uploaded: dict[Hashable, int] = {}  # buffer -> transfer value of its latest upload
        self._used: dict[Hashable, int] = {}  # buffer -> compute ticket of its latest program
        self._compute_waited = 0
        self._transfer_waited = 0

    def program(self, buffers: Iterable[Hashable], ticket: int) -> int:
        """Note a program submitted as ``ticket`` binding ``buffers``.

        Returns:
            The upload value it must wait for on the transfer timeline; 0 for none.
        """
        need = 0
        for buffer in buffers:
            need = max(need, self._uploaded.get(buffer, 0))
            self._used[buffer] = ticket
        if need <= self._compute_waited:
            return 0
        self._compute_waited = need
        return need

    def upload(self, buffer: Hashable, value: int) -> int:
        """Note an upload into ``buffer`` signalling ``value`` on the transfer timeline.

        Returns:
            The compute ticket it must wait for; 0 for none.
        """
        self._uploaded[buffer] = value
        need = self._used.get(buffer, 0)
        if need <= self._transfer_waited:
            return 0
        self._transfer_waited = need
        return need


@dataclass
class _Staging:
    """Pinned host memory for one tensor and slot: the source of its uploads."""

    buffer: object
    memory: object
    view: np.ndarray  # shaped and typed as the tensor, onto the mapped memory
    ticket: int = 0  # the latest upload that reads it


@dataclass
class _UploadCommand:
    handles: object  # VkCommandBuffer[1]
    plain: object  # VkSubmitInfo signalling the transfer timeline
    waiting: object | None  # the same, first waiting on the compute timeline


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
    buffers: frozenset = frozenset()  # (arena, slot) of every buffer it binds, for QueueOrder
    waiting: object | None = None  # its VkSubmitInfo that first waits on the transfer timeline


class VulkanBackend:
    """Runs Programs on one Vulkan device. See the module docstring."""

    def __init__(
        self, device: int | str = "auto", memory_fraction: float = 0.9, block_bytes: int = 64 * 2**20
    ) -> None:
        self.facts, self._physical = select_device(device)
        self.budget = memory_budget(self.facts, memory_fraction)
        self._allocator = BlockAllocator(self.budget, block_bytes)
        self._lock = threading.Lock()
        # Staging buffers and upload command buffers are made on first use, maybe from several
        # threads (loaders); a command pool must not be used from two threads at once.
        self._upload_lock = threading.Lock()
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
        self._staging: dict[tuple[str, int], _Staging] = {}
        self._upload_commands: dict[tuple, _UploadCommand] = {}
        self._order = QueueOrder()
        self._uploads = 0  # the transfer timeline's last signalled value
        self.tuning = True  # per-launch specialisation (tiles) from the registry's tune functions
        self._create_device()

    # -- device and queue -------------------------------------------------------------------
    def _create_device(self) -> None:
        families = self.facts.queue_families
        # A compute-only family avoids sharing a queue with graphics work where the device has one.
        family = min((f for f in families if f.compute), key=lambda f: (f.graphics, f.index))
        self.queue_family = family.index
        self.timeline = self.facts.has("timeline_semaphore")
        self.upload_family, upload_index = choose_upload_queue(families, family.index, self.timeline)
        upload_facts = next(f for f in families if f.index == self.upload_family)
        # Transfer-only queues may lack timestamps (timestampValidBits 0); benchmarks check this.
        self.upload_timestamps = upload_facts.timestamp_bits > 0
        if self.upload_family != family.index:
            self.upload_queue_name = f"transfer-only family {self.upload_family}"
        elif upload_index:
            self.upload_queue_name = f"compute family {family.index}, queue {upload_index}"
        else:
            self.upload_queue_name = f"the compute queue (family {family.index})"
        priority = ffi.new("float[]", [1.0, 1.0])
        queue_info = ffi.new("VkDeviceQueueCreateInfo[]", 2)
        queue_info[0].sType = vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO
        queue_info[0].queueFamilyIndex = family.index
        queue_info[0].queueCount = 1 + (self.upload_family == family.index and upload_index == 1)
        queue_info[0].pQueuePriorities = priority
        queue_count = 1
        if self.upload_family != family.index:
            queue_info[1].sType = vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO
            queue_info[1].queueFamilyIndex = self.upload_family
            queue_info[1].queueCount = 1
            queue_info[1].pQueuePriorities = priority
            queue_count = 2
        # Arenas are shared by the compute and transfer families without ownership transfers
        # (a pre-recorded program cannot acquire a buffer per upload); buffers lose nothing by it.
        self._sharing = ffi.new("uint32_t[]", [family.index, self.upload_family])
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
        host_reset = ffi.new(
            "VkPhysicalDeviceHostQueryResetFeatures*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_HOST_QUERY_RESET_FEATURES,
                "pNext": timeline,
                "hostQueryReset": int(self.facts.has("host_query_reset")),
            },
        )
        chain = host_reset
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
                "queueCreateInfoCount": queue_count,
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
        lib.vkGetDeviceQueue(self.device, self.upload_family, upload_index, queue)
        self.upload_queue = queue[0]
        self.command_pool = self._new_command_pool(family.index)
        self._upload_pool = self._new_command_pool(self.upload_family)
        self._submitted = 0
        self._fences: dict[int, object] = {}
        if self.timeline:
            self.semaphore = self._new_timeline_semaphore()
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
            self._init_upload_timeline()

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
        _check(lib.vkCreateCommandPool(self.device, info, ffi.NULL, pool), "vkCreateCommandPool")
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
        _check(lib.vkCreateSemaphore(self.device, sem_info, ffi.NULL, semaphore), "vkCreateSemaphore")
        return semaphore[0]

    def _init_upload_timeline(self) -> None:
        """The transfer queue's timeline and the structs every upload and every program that waits
        on it reuse: as for compute submits, only the values change per submit (under the lock)."""
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
        if self.upload_family != self.queue_family:
            info.sharingMode = vk.VK_SHARING_MODE_CONCURRENT
            info.queueFamilyIndexCount = 2
            info.pQueueFamilyIndices = self._sharing
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

    # -- uploads: DMA from pinned staging memory on the transfer queue ------------------------
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
        spec = upload_target(self._layout, tensor, slot, self.slots)
        with self._upload_lock:
            staging = self._staging_for(spec, slot)
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
        """Queue a DMA copy of ``tensor``'s staging memory into the tensor, on the transfer queue.

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
        spec = upload_target(self._layout, tensor, slot, self.slots, data)
        if timestamps is not None:
            if not self.upload_timestamps:
                raise ValueError(f"upload to {tensor!r}: {self.upload_queue_name} cannot write timestamps")
            if not 0 <= query < timestamps.count - 1:
                raise IndexError(
                    f"upload to {tensor!r}: queries {query} and {query + 1} are not both in the pool "
                    f"of {timestamps.count}"
                )
        with self._upload_lock:
            staging = self._staging_for(spec, slot)
            command = self._upload_command(spec, slot, staging, timestamps, query)
        if data is not None:
            if staging.ticket:
                self.wait(staging.ticket)
            np.copyto(staging.view.reshape(-1), np.asarray(data).reshape(-1))
        buffer = self._buffer_key(spec, slot)
        with self._lock:
            if self.timeline:
                self._uploads += 1
                after = self._order.upload(buffer, self._uploads)
                self._upload_signal[0] = self._uploads
                self._after_compute[0] = after
                submit = command.waiting if after else command.plain
                _check(lib.vkQueueSubmit(self.upload_queue, 1, submit, ffi.NULL), "vkQueueSubmit(upload)")
                ticket = UPLOAD_TICKETS + self._uploads
            else:
                # One queue for everything: submission order and barriers keep the order.
                self._submitted += 1
                ticket = self._submitted
                fence = self._new_fence()
                _check(lib.vkQueueSubmit(self.upload_queue, 1, command.plain, fence), "vkQueueSubmit(upload)")
                self._fences[ticket] = fence
        staging.ticket = ticket
        return ticket

    def reset_timestamps(self, pool: TimestampPool) -> None:
        """Make every query of ``pool`` writable again before ``upload(..., timestamps=pool)``.

        A transfer queue cannot reset queries itself (vkCmdResetQueryPool needs a graphics or
        compute queue), so this resets from the host where the device allows it, else with a
        submission on the compute queue that waits for the work queued there. Call it only when
        no submitted work still writes the pool.
        """
        if self.facts.has("host_query_reset"):
            lib.vkResetQueryPool(self.device, pool.pool, 0, pool.count)
            return
        command = self._begin_one_shot()
        lib.vkCmdResetQueryPool(command, pool.pool, 0, pool.count)
        self._finish_one_shot(command)

    def _buffer_key(self, tensor: Tensor, slot: int) -> tuple[str, int]:
        assert self._layout is not None, "open_layout first"
        arena = self._layout.arena(tensor.arena)
        return (arena.name, slot if arena.per_slot else 0)

    def _staging_for(self, spec: Tensor, slot: int) -> _Staging:
        key = (spec.name, slot)
        if key not in self._staging:
            self._staging[key] = self._new_staging(f"staging for {spec.name!r} [slot {slot}]", spec)
        return self._staging[key]

    def _new_staging(self, name: str, spec: Tensor) -> _Staging:
        """A buffer in its own allocation of pinned host memory, mapped for the buffer's life.
        Outside the block allocator: that budget is the device-local heap's, this is host memory."""
        info = ffi.new(
            "VkBufferCreateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO,
                "size": max(spec.nbytes, 4),
                "usage": vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT,
                "sharingMode": vk.VK_SHARING_MODE_EXCLUSIVE,  # only the transfer queue reads it
            },
        )
        handle = ffi.new("VkBuffer*")
        _check(lib.vkCreateBuffer(self.device, info, ffi.NULL, handle), f"vkCreateBuffer({name})")
        buffer = handle[0]
        requirements = ffi.new("VkMemoryRequirements*")
        lib.vkGetBufferMemoryRequirements(self.device, buffer, requirements)
        try:
            memory_type = choose_staging_type(self.facts.memory_types, requirements.memoryTypeBits)
            allocate = ffi.new(
                "VkMemoryAllocateInfo*",
                {
                    "sType": vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                    "allocationSize": requirements.size,
                    "memoryTypeIndex": memory_type.index,
                },
            )
            memory = ffi.new("VkDeviceMemory*")
            result = lib.vkAllocateMemory(self.device, allocate, ffi.NULL, memory)
            if result != 0:
                raise MemoryError(
                    f"{name}: vkAllocateMemory of {int(requirements.size):,} bytes of host memory "
                    f"(type {memory_type.index}) failed: {result}"
                )
        except Exception:
            lib.vkDestroyBuffer(self.device, buffer, ffi.NULL)
            raise
        _check(lib.vkBindBufferMemory(self.device, buffer, memory[0], 0), f"vkBindBufferMemory({name})")
        pointer = ffi.new("void**")
        _check(lib.vkMapMemory(self.device, memory[0], 0, requirements.size, 0, pointer), "vkMapMemory")
        raw = ffi.buffer(ffi.cast("char*", pointer[0]), spec.nbytes)
        view = np.frombuffer(raw, dtype=np.dtype(spec.dtype)).reshape(spec.shape)
        return _Staging(buffer=buffer, memory=memory[0], view=view)

    def _upload_command(
        self, spec: Tensor, slot: int, staging: _Staging, timestamps: TimestampPool | None, query: int
    ) -> _UploadCommand:
        """The copy's command buffer, recorded once per tensor, slot (and timestamp queries) and
        replayed; several may be pending at once (back-to-back uploads), hence SIMULTANEOUS_USE."""
        pool_id = None if timestamps is None else int(ffi.cast("uintptr_t", timestamps.pool))
        key = (spec.name, slot, pool_id, query if timestamps is not None else 0)
        if key in self._upload_commands:
            return self._upload_commands[key]
        info = ffi.new(
            "VkCommandBufferAllocateInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
                "commandPool": self._upload_pool,
                "level": vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
                "commandBufferCount": 1,
            },
        )
        handles = ffi.new("VkCommandBuffer[]", 1)
        _check(lib.vkAllocateCommandBuffers(self.device, info, handles), "vkAllocateCommandBuffers")
        command = handles[0]
        begin = ffi.new(
            "VkCommandBufferBeginInfo*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                "flags": vk.VK_COMMAND_BUFFER_USAGE_SIMULTANEOUS_USE_BIT,
            },
        )
        _check(lib.vkBeginCommandBuffer(command, begin), "vkBeginCommandBuffer")
        # Copies into the same tensor land in submission order. Only transfer stages: a
        # transfer-only queue supports no others; compute is ordered by the semaphores (or, on a
        # shared queue, by the programs' own full barriers).
        stage = vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        self._memory_barrier(
            command,
            vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            vk.VK_ACCESS_TRANSFER_READ_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            stage,
        )
        if timestamps is not None:
            # At the transfer stage, not top of pipe: the start then excludes waiting for the
            # previous copy, so the pair times this copy alone (as CUDA events on a stream do).
            lib.vkCmdWriteTimestamp(command, stage, timestamps.pool, query)
        region = ffi.new("VkBufferCopy*", {"srcOffset": 0, "dstOffset": spec.offset, "size": spec.nbytes})
        target = self._arena_for(spec, slot)
        lib.vkCmdCopyBuffer(command, staging.buffer, target.buffer, 1, region)
        if timestamps is not None:
            lib.vkCmdWriteTimestamp(command, stage, timestamps.pool, query + 1)
        _check(lib.vkEndCommandBuffer(command), "vkEndCommandBuffer")
        # The copy signals the transfer timeline; its waiting form first waits for compute.
        plain, waiting = self._submit_infos(
            handles,
            lambda: (
                (self._upload_timeline, self._upload_semaphore_array),
                (self._upload_timeline_waiting, self._semaphore_array),
            ),
        )
        self._upload_commands[key] = _UploadCommand(handles, plain, waiting)
        return self._upload_commands[key]

    def _submit_infos(self, handles, semaphores) -> tuple[object, object | None]:
        """(plain, waiting) VkSubmitInfos for one command buffer. With timeline semaphores,
        ``semaphores()`` gives (signal, wait), each (timeline values struct, semaphore array):
        both forms signal ``signal``, and ``waiting`` first waits on ``wait``. Without timeline
        semaphores (whose structs then do not exist, hence the callable): plain only."""
        plain = ffi.new(
            "VkSubmitInfo*",
            {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, "commandBufferCount": 1, "pCommandBuffers": handles},
        )
        if not self.timeline:
            return plain, None
        (signal_values, signal_semaphores), (wait_values, wait_semaphores) = semaphores()
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

    @staticmethod
    def _memory_barrier(command, src_access: int, dst_access: int, stages: int) -> None:
        """One global memory barrier from and to ``stages``."""
        barrier = ffi.new(
            "VkMemoryBarrier*",
            {
                "sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                "srcAccessMask": src_access,
                "dstAccessMask": dst_access,
            },
        )
        lib.vkCmdPipelineBarrier(command, stages, stages, 0, 1, barrier, 0, ffi.NULL, 0, ffi.NULL)

    def _full_barrier(self, command) -> None:
        self._memory_barrier(
            command,
            vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT | vk.VK_ACCESS_HOST_WRITE_BIT,
            vk.VK_ACCESS_SHADER_READ_BIT
            | vk.VK_ACCESS_SHADER_WRITE_BIT
            | vk.VK_ACCESS_TRANSFER_READ_BIT
            | vk.VK_ACCESS_TRANSFER_WRITE_BIT
            | vk.VK_ACCESS_HOST_READ_BIT,
            vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
            | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
            | vk.VK_PIPELINE_STAGE_HOST_BIT,
        )

    def _compute_barrier(self, command) -> None:
        self._memory_barrier(
            command,
            vk.VK_ACCESS_SHADER_WRITE_BIT,
            vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT,
            vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
        )

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
        buffers: set[tuple[str, int]] = set()
        if not self.timeline:
            # Orders this program after uploads on the shared queue, which end without a barrier.
            # With timeline semaphores it is not needed: host writes are visible at submission,
            # uploads are waited for through the semaphores, and every earlier submission on this
            # queue that writes memory (programs, staged copies) ends with this same full
            # barrier, which already orders everything submitted after it (~1.3 µs a step on an
            # H100, measured with timestamps).
            self._full_barrier(command)
        if timestamps is not None:
            if not timestamps.host_reset:
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
                buffers.add(self._buffer_key(tensor, slot))
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
        # The program signals the compute timeline; its waiting form first waits for an upload.
        submit, waiting = self._submit_infos(
            handles,
            lambda: (
                (self._timeline_submit, self._semaphore_array),
                (self._compute_timeline_waiting, self._upload_semaphore_array),
            ),
        )
        recorded = _Recorded(
            command_buffer=command,
            command_buffers_ptr=handles,
            keep=[*keep, submit],
            buffers=frozenset(buffers),
            waiting=waiting,
        )
        self._recorded.append(recorded)
        return len(self._recorded) - 1

    # -- submission -------------------------------------------------------------------------
    def submit(self, handle: int) -> int:
        """Queue a recorded program. Returns the ticket to wait on; never blocks on the GPU.

        Where an upload into a buffer the program binds is still pending, the GPU waits for it.
        """
        recorded = self._recorded[handle]
        submit = recorded.keep[-1]
        with self._lock:
            self._submitted += 1
            ticket = self._submitted
            if self.timeline:
                self._signal_value[0] = ticket
                after = self._order.program(recorded.buffers, ticket)
                if after:
                    self._after_upload[0] = after
                    submit = recorded.waiting
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
        """Block until ``ticket``'s submission (a program or an upload) is done (call from a worker
        thread under trio)."""
        timeout = _TIMEOUT_NS if timeout_s is None else int(timeout_s * 1e9)
        if self.timeline:
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

    def _timeline_of(self, ticket: int) -> tuple[object, int]:
        """(VkSemaphore[1] of the queue that ran ``ticket``, its value on that timeline)."""
        if ticket > UPLOAD_TICKETS:
            return self._upload_semaphore_array, ticket - UPLOAD_TICKETS
        return self._semaphore_array, ticket

    def is_done(self, ticket: int) -> bool:
        if self.timeline:
            semaphores, value = self._timeline_of(ticket)
            lib.vkGetSemaphoreCounterValue(self.device, semaphores[0], self._counter)
            return self._counter[0] >= value
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
            if self.timeline and self._uploads:
                # A staged read or write must see every upload queued before it, on either queue.
                values = ffi.new("uint64_t[]", [self._uploads])
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
            _check(lib.vkQueueSubmit(self.queue, 1, submit, fence), "vkQueueSubmit")
        fences = ffi.new("VkFence[]", [fence])
        _check(lib.vkWaitForFences(self.device, 1, fences, 1, _TIMEOUT_NS), "vkWaitForFences")
        lib.vkDestroyFence(self.device, fence, ffi.NULL)
        lib.vkFreeCommandBuffers(self.device, self.command_pool, 1, handles)

    # -- timing -----------------------------------------------------------------------------
    def timestamp_pool(self, count: int, host_reset: bool = False) -> TimestampPool:
        """A query pool of ``count`` timestamps for ``record(..., timestamps=pool)``.

        With ``host_reset`` (and a device that resets queries from the host), programs recorded
        with the pool do not reset it themselves: call ``reset_timestamps`` before each submission.
        An in-buffer reset adds GPU work to every step (~6 µs on an H100), which a gap or step time
        measured with it would wrongly include.
        """
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
        pool = TimestampPool(
            pool=handle[0], count=count, host_reset=host_reset and self.facts.has("host_query_reset")
        )
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
        if self._recorded or self._upload_commands or self._staging:
            lib.vkDeviceWaitIdle(self.device)
        for recorded in self._recorded:
            lib.vkFreeCommandBuffers(self.device, self.command_pool, 1, recorded.command_buffers_ptr)
        self._recorded = []
        for command in self._upload_commands.values():
            lib.vkFreeCommandBuffers(self.device, self._upload_pool, 1, command.handles)
        self._upload_commands = {}
        for staging in self._staging.values():
            lib.vkDestroyBuffer(self.device, staging.buffer, ffi.NULL)
            lib.vkFreeMemory(self.device, staging.memory, ffi.NULL)  # also unmaps it
        self._staging = {}
        # The device is idle: no pending upload or program constrains the new layout's buffers.
        self._order = QueueOrder()
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
            lib.vkDestroySemaphore(self.device, self.upload_semaphore, ffi.NULL)
        lib.vkDestroyCommandPool(self.device, self.command_pool, ffi.NULL)
        lib.vkDestroyCommandPool(self.device, self._upload_pool, ffi.NULL)
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
    """A timestamp query pool.

    Attributes:
        pool: the VkQueryPool.
        count: its queries.
        host_reset: programs recorded with it leave resetting the queries to the host
            (``reset_timestamps`` before each submission), so the command buffer holds only the
            program and its timestamps; only where the device resets queries from the host.
    """

    pool: object
    count: int
    host_reset: bool = False

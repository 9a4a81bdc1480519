"""The driver's pipeline cache kept on disk between runs, so a second run builds its pipelines from
what the first one compiled.

A VkPipelineCache holds the driver's compiled pipelines; its data is only meaningful to the same
driver on the same kind of device, so the file is named by the device's vendor, device id, driver
version and ``pipelineCacheUUID``, under the user cache (``cache_dir("pipelines")``). What is read
back is handed to the driver only when it is whole and made for this device: the file seals the
driver's data with its SHA-256 (a torn or bit-flipped file is refused whatever the driver would
make of it), and the data must start with the Vulkan spec's VkPipelineCacheHeaderVersionOne naming
this device. Anything else is ignored and the run starts with an empty cache; a cache that cannot be
read or written never stops a run, it only makes the next one compile again.

The deciding (names, header, seal) is pure; ``open_cache`` and ``save_cache`` do the Vulkan calls.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

from actors.vulkan import library
from actors.vulkan.library import check
from shaders.user_cache import cache_dir, write_atomically

# Assigned, not imported by name: see library's docstring (3.11 method calls).
ffi, lib, vk = library.ffi, library.lib, library.vk

# VkPipelineCacheHeaderVersionOne: headerSize, headerVersion, vendorID, deviceID (uint32 each) and
# pipelineCacheUUID, written least significant byte first on every host (the spec says so).
_HEADER = struct.Struct("<IIII16s")
_HEADER_VERSION_ONE = 1
_MAGIC = b"VKFLOWPC"  # this file's own format, version 1: magic, SHA-256 of the data, the data
_DIGEST_BYTES = 32
# A larger file is dropped, not loaded: the driver never evicts, so a cache fed by tile sweeps
# (a pipeline per tried shape) would otherwise grow with every run and be read whole each time.
MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class CacheIdentity:
    """What the driver's cache data is valid for (from VkPhysicalDeviceProperties)."""

    vendor_id: int
    device_id: int
    driver_version: int
    uuid: bytes  # pipelineCacheUUID, 16 bytes

    def file_name(self) -> str:
        return f"{self.vendor_id:04x}-{self.device_id:04x}-{self.driver_version:08x}-{self.uuid.hex()}.bin"


def cache_path(identity: CacheIdentity) -> Path:
    """The file of ``identity``'s pipeline cache in the user cache directory."""
    return cache_dir("pipelines", identity.file_name())


def header_matches(data: bytes, identity: CacheIdentity) -> bool:
    """Whether ``data`` starts with a version-one pipeline cache header for ``identity``'s device.

    Args:
        data: what vkGetPipelineCacheData returned (in some run).
        identity: the device about to receive it.

    Returns:
        True when the driver may be handed it.
    """
    if len(data) < _HEADER.size:
        return False
    size, version, vendor, device, uuid = _HEADER.unpack_from(data)
    return (
        size == _HEADER.size
        and version == _HEADER_VERSION_ONE
        and (vendor, device, uuid) == (identity.vendor_id, identity.device_id, identity.uuid)
    )


def seal(data: bytes) -> bytes:
    """The file content for the driver's ``data``: magic, its digest, then it."""
    return _MAGIC + hashlib.sha256(data).digest() + data


def unseal(content: bytes) -> bytes | None:
    """The driver's data from a file's ``content``, or None when it is not a whole sealed file."""
    start = len(_MAGIC) + _DIGEST_BYTES
    if len(content) < start or not content.startswith(_MAGIC):
        return None
    data = content[start:]
    return data if hashlib.sha256(data).digest() == content[len(_MAGIC) : start] else None


def initial_data(path: Path, identity: CacheIdentity) -> bytes:
    """What to seed the device's cache with from ``path``: its data when whole, of a sane size and
    made for ``identity``'s device, else nothing (b"")."""
    try:
        if path.stat().st_size > MAX_BYTES:
            return b""
        content = path.read_bytes()
    except OSError:  # none yet, or unreadable: start empty
        return b""
    data = unseal(content)
    return data if data is not None and header_matches(data, identity) else b""


def identity_of(physical) -> CacheIdentity:
    """The cache identity of a VkPhysicalDevice."""
    props = ffi.new("VkPhysicalDeviceProperties*")
    lib.vkGetPhysicalDeviceProperties(physical, props)
    return CacheIdentity(
        vendor_id=int(props.vendorID),
        device_id=int(props.deviceID),
        driver_version=int(props.driverVersion),
        uuid=bytes(ffi.buffer(props.pipelineCacheUUID, 16)),
    )


def open_cache(device, data: bytes):
    """A VkPipelineCache seeded with ``data`` (may be empty). Should the driver still refuse the
    data, the cache starts empty instead.

    Returns:
        The VkPipelineCache.
    """
    seed = ffi.from_buffer(data) if data else ffi.NULL  # bound: must outlive the create call
    info = ffi.new(
        "VkPipelineCacheCreateInfo*",
        {
            "sType": vk.VK_STRUCTURE_TYPE_PIPELINE_CACHE_CREATE_INFO,
            "initialDataSize": len(data),
            "pInitialData": seed,
        },
    )
    handle = ffi.new("VkPipelineCache*")
    if data and lib.vkCreatePipelineCache(device, info, ffi.NULL, handle) == 0:
        return handle[0]
    info.initialDataSize = 0
    info.pInitialData = ffi.NULL
    check(lib.vkCreatePipelineCache(device, info, ffi.NULL, handle), "vkCreatePipelineCache")
    return handle[0]


def cache_data(device, cache) -> bytes:
    """The driver's data for ``cache`` (vkGetPipelineCacheData)."""
    size = ffi.new("size_t*")
    check(lib.vkGetPipelineCacheData(device, cache, size, ffi.NULL), "vkGetPipelineCacheData")
    buffer = ffi.new("char[]", size[0])
    # VK_INCOMPLETE (5) cannot happen with the size just asked for, but is not an error either.
    result = lib.vkGetPipelineCacheData(device, cache, size, buffer)
    if result not in (0, 5):
        check(result, "vkGetPipelineCacheData")
    return ffi.buffer(buffer, size[0])[:]


def save_cache(device, cache, path: Path) -> bool:
    """Write ``cache``'s data to ``path`` atomically; a failure to write only loses the cache.

    Returns:
        Whether the file was written.
    """
    try:
        write_atomically(path, seal(cache_data(device, cache)))
    except OSError:  # a read-only or full cache directory: the next run compiles again
        return False
    return True

"""Loading the Vulkan library: the one module in the repo that imports ``vulkan``.

Every other module of the backend takes ``vk`` (constants and wrapped entry points), ``ffi`` (cffi
structs) and ``lib`` (raw entry points) from here, so a missing loader is detected in one place and
reported with the command that installs one, and tests/test_layers.py can check that nothing else
reaches for the binding. A missing ``libvulkan.so.1`` leaves ``vk``, ``ffi`` and ``lib`` None and
import still succeeds (the caller then gets VulkanUnavailable when it asks for the instance); a
missing ``vulkan`` Python package raises ImportError at import, which callers treat as "no Vulkan".

Structs are built with ``ffi.new``, and every nested struct is bound to a name that lives until the
call returns: the cffi binding frees temporaries early and the driver then reads garbage.

Other modules bind ``ffi``, ``lib`` and ``vk`` by assignment (``ffi = library.ffi``), not with
``from ... import ffi``: CPython 3.11 compiles ``name.f(...)`` on a name bound by an import as an
attribute load that allocates a bound method (it takes the name for a module), which costs ~40 ns
more per ``ffi.new``/``ffi.memmove`` on the per-step path than the method call an assigned name
gets.
"""

from __future__ import annotations

import threading

try:
    import vulkan as vk
except OSError as _error:  # the binding raises OSError when libvulkan.so.1 is missing
    vk = None
    _IMPORT_ERROR: Exception | None = _error
else:
    _IMPORT_ERROR = None

ffi = vk.ffi if vk is not None else None
lib = vk.lib if vk is not None else None

INSTALL_HINT = "apt-get install -y libvulkan1 mesa-vulkan-drivers"
TIMEOUT_NS = 2**64 - 1  # "wait forever" for vkWaitSemaphores / vkWaitForFences


class VulkanUnavailable(RuntimeError):
    """No Vulkan loader, no driver, or no device that can compute."""


def check(result: int, what: str) -> None:
    """Raise unless ``result`` is VK_SUCCESS.

    Args:
        result: a VkResult.
        what: the call, for the message.
    """
    if result != 0:
        raise RuntimeError(f"{what} failed with VkResult {result}")


def text(chars) -> str:
    """A fixed-size C ``char[]`` (device name, extension name) as a Python string."""
    return ffi.string(chars).decode("utf-8", "replace")


_instance_lock = threading.Lock()
_instance = None


def instance():
    """The process's one VkInstance, shared by every backend and by enumeration; created on first
    use.

    Raises:
        VulkanUnavailable: with the install command when there is no loader or no driver.
    """
    global _instance
    if vk is None:
        raise VulkanUnavailable(f"no Vulkan loader ({_IMPORT_ERROR}); install one with: {INSTALL_HINT}")
    with _instance_lock:
        if _instance is None:
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
                {"sType": vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, "pApplicationInfo": app},
            )
            handle = ffi.new("VkInstance*")
            result = lib.vkCreateInstance(info, ffi.NULL, handle)
            if result != 0:
                raise VulkanUnavailable(
                    f"vkCreateInstance failed ({result}): no Vulkan driver? install one with: {INSTALL_HINT}"
                )
            _instance = handle[0]
        return _instance

"""Which devices exist, for people and for the runner: Vulkan devices when a driver is present,
else the CPU backend with a message that says why and how to get a driver."""

from __future__ import annotations

from actors.backend import Backend, DeviceFacts


def list_devices() -> tuple[list[DeviceFacts], str]:
    """Every Vulkan device that can compute, best first, and a message when there are none.

    Returns:
        (devices, message): message is empty when at least one Vulkan device was found.
    """
    try:
        from actors.vulkan import VulkanUnavailable, enumerate_devices
    except ImportError as error:
        return [], f"the vulkan Python package is missing ({error}); pip install vulkan"
    try:
        devices = enumerate_devices()
    except VulkanUnavailable as error:
        return [], f"no Vulkan: {error}. Falling back to the CPU (numpy) backend."
    if not devices:
        return (
            [],
            "the Vulkan driver reports no device that can compute. Falling back to the CPU (numpy) backend.",
        )
    return devices, ""


def open_backend(select: int | str = "auto", memory_fraction: float = 0.9) -> tuple[Backend, str]:
    """The backend for a spec's device choice.

    Args:
        select: "cpu", "auto" (the best Vulkan device, else the CPU), a device index or a name.
        memory_fraction: share of the device's memory budget to use.

    Returns:
        (backend, message): message explains a fallback to the CPU, else is empty.

    Raises:
        LookupError: an explicit index or name that matches no Vulkan device.
    """
    from actors.cpu_backend import CpuBackend

    if select == "cpu":
        return CpuBackend(), ""
    try:
        from actors.vulkan import VulkanBackend, VulkanUnavailable
    except ImportError as error:
        if select != "auto":
            raise LookupError(f"device {select!r} asked for, but Vulkan is unavailable: {error}") from error
        return CpuBackend(), f"vulkan package missing ({error}); using the CPU backend"
    try:
        return VulkanBackend(select, memory_fraction=memory_fraction), ""
    except VulkanUnavailable as error:
        if select != "auto":
            raise LookupError(f"device {select!r} asked for, but Vulkan is unavailable: {error}") from error
        return CpuBackend(), f"{error}; using the CPU (numpy) backend"

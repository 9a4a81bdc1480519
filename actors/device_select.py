"""Which devices exist, for people and for the runner: Vulkan devices when a driver is present,
else the CPU backend with a message that says why and how to get a driver.

Choosing stays apart from reporting: the functions here return the fallback message and the caller
decides how to show it (``flow.runtime`` logs its first line; ``flow.runtime.open_backend`` is the one
public ``open_backend``). What ``"auto"`` picks is flow.device_choice's rule, from the facts alone."""

from __future__ import annotations

import os
from dataclasses import dataclass

from actors.backend import Backend, DeviceFacts
from flow.device_choice import AutoChoice, choose_auto

# What "auto" means on this machine when set: a device index, part of a name, or "cpu". The test
# suite sets it to 0 (tests/conftest.py) so that its runs under "auto" keep exercising lavapipe,
# which the rule would pass over for the faster numpy backend.
AUTO_ENV = "VKFLOW_AUTO_DEVICE"


@dataclass(frozen=True)
class Selection:
    """The devices a spec's ``select`` names, and what to tell the user about the choice.

    Attributes:
        facts: each device's facts, in the spec's order.
        reason: why "auto" chose its device (shown by ``flow plan`` and the run's summary), else "".
        warning: a fallback to the CPU because there is no Vulkan, else "".
    """

    facts: tuple[DeviceFacts, ...]
    reason: str = ""
    warning: str = ""


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


def select_facts(select: int | str = "auto") -> tuple[DeviceFacts, str]:
    """The facts of the device a spec's choice names, without opening it (a Vulkan instance lists
    the physical devices; no logical device, queue or memory is created), so a run can be planned,
    and refused, before any device work.

    Args:
        select: "cpu", "auto" (:func:`auto_choice`), a Vulkan device index or a name.

    Returns:
        (facts, message): message explains a fallback to the CPU, else is empty.

    Raises:
        LookupError: an explicit index or name that matches no Vulkan device.
    """
    from actors.cpu_backend import cpu_facts

    if select == "cpu":
        return cpu_facts(), ""
    if select == "auto":
        choice = auto_choice()
        return choice.facts, choice.reason if choice.fallback else ""
    try:
        from actors.vulkan import VulkanUnavailable, select_device
    except ImportError as error:
        if select != "auto":
            raise LookupError(f"device {select!r} asked for, but Vulkan is unavailable: {error}") from error
        return cpu_facts(), f"vulkan package missing ({error}); using the CPU backend"
    try:
        return select_device(select)[0], ""
    except VulkanUnavailable as error:
        if select != "auto":
            raise LookupError(f"device {select!r} asked for, but Vulkan is unavailable: {error}") from error
        return cpu_facts(), f"{error}; using the CPU (numpy) backend"


def auto_choice() -> AutoChoice:
    """What ``"auto"`` picks here: flow.device_choice's rule over the Vulkan devices and the CPU
    backend, or the device :data:`AUTO_ENV` names.

    Raises:
        LookupError: :data:`AUTO_ENV` names a device that is not there.
    """
    from actors.cpu_backend import cpu_facts

    named = os.environ.get(AUTO_ENV, "").strip()
    if named and named != "auto":
        facts, _ = select_facts(int(named) if named.isdigit() else named)
        return AutoChoice(facts, f"auto: {facts.name} (the environment's {AUTO_ENV}={named})")
    devices, missing = list_devices()
    return choose_auto(devices, cpu_facts(), missing)


def select(choices: tuple[int | str, ...]) -> Selection:
    """:func:`select_group`, with the reason for an "auto" choice.

    Args:
        choices: ``Devices.choices``.

    Returns:
        The selection.

    Raises:
        LookupError: an explicit index or name that matches no Vulkan device.
    """
    if choices == ("auto",):
        choice = auto_choice()
        return Selection((choice.facts,), choice.reason, choice.reason if choice.fallback else "")
    facts, warning = select_group(choices)
    return Selection(facts, "", warning)


def select_group(choices: tuple[int | str, ...]) -> tuple[tuple[DeviceFacts, ...], str]:
    """The facts of every device a spec's ``select`` names, in order, without opening any: one
    device for a single choice (:func:`select_facts`), every Vulkan device and the CPU for "all",
    and each listed choice for a list (a choice listed twice is two logical devices).

    Args:
        choices: ``Devices.choices``.

    Returns:
        (facts, message): message explains a fallback to the CPU, else is empty.

    Raises:
        LookupError: an explicit index or name that matches no Vulkan device.
    """
    from actors.cpu_backend import cpu_facts

    if choices == ("all",):
        devices, message = list_devices()
        return (*devices, cpu_facts()), message
    if len(choices) == 1:
        facts, message = select_facts(choices[0])
        return (facts,), message
    return tuple(select_facts(choice)[0] for choice in choices), ""


def every_device() -> tuple[list[DeviceFacts], str]:
    """What ``flow devices`` lists: every Vulkan device that can compute, then the CPU backend.

    Returns:
        (devices, message): message says why there is no Vulkan device, else is empty.
    """
    from actors.cpu_backend import cpu_facts

    devices, message = list_devices()
    return [*devices, cpu_facts()], message


def open_device(facts: DeviceFacts, memory_fraction: float = 0.9) -> Backend:
    """Open the backend of a device :func:`select_facts` chose.

    Args:
        facts: the device's facts (the CPU's, or a Vulkan device's by its index).
        memory_fraction: share of the device's memory budget to use.

    Returns:
        The backend; the caller closes it.
    """
    if facts.is_numpy:
        from actors.cpu_backend import CpuBackend

        return CpuBackend(facts=facts)
    from actors.vulkan import VulkanBackend

    return VulkanBackend(facts.index, memory_fraction=memory_fraction)

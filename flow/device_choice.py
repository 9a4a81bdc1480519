"""What ``Devices("auto")`` picks, and why, decided from device facts alone (no device is opened).

The rule, in order:

1. a hardware Vulkan device beats the CPU backend, and among them discrete > integrated > virtual
   > other (the first listed wins a tie, as the driver lists them);
2. a software Vulkan device (Vulkan's device type CPU: lavapipe/llvmpipe, SwiftShader) loses to the
   CPU (numpy) backend: both run on the same cores, and numpy's BLAS does in one call what the
   rasteriser emulates invocation by invocation (on a 2-core VM, idle: the digits MLP example 2.8 s
   on numpy against 3.3 s on lavapipe, the digits CNN 1.4 s against 6.5 s);
3. without any Vulkan device, the CPU backend, with the reason there is none.

The reason is one sentence, shown by ``flow plan`` and in a run's summary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flow.device_facts import DeviceFacts

# Hardware kinds, best first (VkPhysicalDeviceType); "cpu" is a software rasteriser.
HARDWARE_ORDER = ("discrete", "integrated", "virtual", "other")
_KIND_WORDS = {"discrete": "a discrete GPU", "integrated": "an integrated GPU", "virtual": "a virtual GPU"}


@dataclass(frozen=True)
class AutoChoice:
    """The device ``"auto"`` chose.

    Attributes:
        facts: the chosen device (the CPU backend's facts when no Vulkan device won).
        reason: why, in one sentence.
        fallback: True when no Vulkan device was found at all (worth a warning, not just a note).
    """

    facts: DeviceFacts
    reason: str
    fallback: bool = False


def choose_auto(vulkan: Sequence[DeviceFacts], cpu: DeviceFacts, missing: str = "") -> AutoChoice:
    """Pick the device ``Devices("auto")`` runs on (see the module docstring for the rule).

    Args:
        vulkan: every Vulkan device that can compute, as the driver lists them.
        cpu: the CPU (numpy) backend's facts.
        missing: why there is no Vulkan device, when ``vulkan`` is empty.

    Returns:
        The choice and its reason.
    """
    hardware = [d for d in vulkan if d.kind in HARDWARE_ORDER]
    if hardware:
        best = min(hardware, key=lambda d: HARDWARE_ORDER.index(d.kind))
        what = _KIND_WORDS.get(best.kind, f"a Vulkan device of type {best.kind!r}")
        passed = ""
        if len(vulkan) > 1:
            passed = f", the best of {len(vulkan)} Vulkan devices (discrete > integrated > virtual)"
        return AutoChoice(best, f"auto: {best.name}, {what}{passed}")
    if vulkan:
        names = ", ".join(d.name for d in vulkan)
        return AutoChoice(
            cpu,
            f"auto: the CPU (numpy) backend, not {names}: a software Vulkan device (type CPU) runs "
            "on the same cores, slower than numpy (Devices(0) selects it anyway)",
        )
    return AutoChoice(cpu, f"auto: the CPU (numpy) backend: {missing or 'no Vulkan device'}", fallback=True)


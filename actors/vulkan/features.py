"""The device features vkflow asks about and turns on: one table and one chain builder.

Optional features (fp16 arithmetic, 16-bit storage, timeline semaphores, host query reset,
cooperative matrices) live in extension structs linked through ``pNext``. The same chain is read
by vkGetPhysicalDeviceFeatures2 when the device's facts are gathered and passed to vkCreateDevice
to enable what those facts found, so both come from ``FEATURE_STRUCTS`` here and cannot drift apart
(a feature reported but not enabled fails only later, inside a shader).
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.vulkan import library
from flow.device_facts import DeviceFacts

# Assigned, not imported by name: see library's docstring (3.11 method calls).
ffi, vk = library.ffi, library.vk

# (struct type, its sType constant, {struct member: vkflow feature name}), in the order the
# features appear in DeviceFacts.features.
FEATURE_STRUCTS: tuple[tuple[str, str, dict[str, str]], ...] = (
    (
        "VkPhysicalDeviceShaderFloat16Int8Features",
        "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_FLOAT16_INT8_FEATURES",
        {"shaderFloat16": "fp16", "shaderInt8": "int8"},
    ),
    (
        "VkPhysicalDevice16BitStorageFeatures",
        "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES",
        {"storageBuffer16BitAccess": "storage16"},
    ),
    (
        "VkPhysicalDeviceTimelineSemaphoreFeatures",
        "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_TIMELINE_SEMAPHORE_FEATURES",
        {"timelineSemaphore": "timeline_semaphore"},
    ),
    (
        "VkPhysicalDeviceHostQueryResetFeatures",
        "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_HOST_QUERY_RESET_FEATURES",
        {"hostQueryReset": "host_query_reset"},
    ),
)
# Only enabled, never queried: its presence is read from the extension list, and the struct may
# only be chained where the extension exists.
COOPERATIVE_MATRIX_STRUCT = (
    "VkPhysicalDeviceCooperativeMatrixFeaturesKHR",
    "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR",
    {"cooperativeMatrix": "cooperative_matrix"},
)


@dataclass
class FeatureChain:
    """Feature structs linked through ``pNext``.

    Attributes:
        head: the first struct: the ``pNext`` of VkPhysicalDeviceFeatures2 or VkDeviceCreateInfo.
        structs: every struct with its member -> feature map; holding them keeps the chain alive
            until the call that reads it returns.
    """

    head: object
    structs: list[tuple[object, dict[str, str]]]

    def enabled(self) -> list[str]:
        """The feature names whose members are set, in table order (after the driver filled them)."""
        return [
            name
            for struct, members in self.structs
            for member, name in members.items()
            if getattr(struct, member)
        ]


def feature_chain(enable: DeviceFacts | None = None) -> FeatureChain:
    """Build the chain, empty for a query or set from a device's facts for device creation.

    Args:
        enable: None to query (every member 0, for the driver to fill); else the facts whose
            features to enable, cooperative matrices included where the facts have them.

    Returns:
        The linked structs.
    """
    table = list(FEATURE_STRUCTS)
    if enable is not None and enable.has("cooperative_matrix"):
        table.append(COOPERATIVE_MATRIX_STRUCT)
    structs: list[tuple[object, dict[str, str]]] = []
    head = ffi.NULL
    for struct_type, s_type, members in table:
        fields: dict[str, object] = {"sType": getattr(vk, s_type), "pNext": head}
        if enable is not None:
            fields.update({member: int(enable.has(name)) for member, name in members.items()})
        head = ffi.new(f"{struct_type}*", fields)
        structs.append((head, members))
    return FeatureChain(head=head, structs=structs)

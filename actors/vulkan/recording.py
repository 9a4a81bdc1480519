"""Recording: a Program into a command buffer, once, and the barriers between its launches.

Recording from Python costs ~36 µs a dispatch against ~2.7 µs to replay one (DESIGN.md), so each
program is recorded once per slot and replayed for every step: its pipelines, descriptor sets
(pointing at that slot's arenas), push constants, group counts and barriers are all fixed here,
and the step's changing values reach the shaders through host-visible tensors. The result is a
``Recorded`` whose submit infos the queues reuse on every submit.

Before the first launch is recorded, every shader the program needs is compiled at once and in
parallel (``shader_variants`` decides which, ``Pipelines.compile_shaders`` compiles), so a cold
start does not compile them one by one as their pipelines are made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from actors.vulkan import library
from actors.vulkan.library import check
from actors.vulkan.queues import Recorded
from flow.device_facts import DeviceFacts
from flow.program import Barrier, Launch, Program
from shaders.compiler import Variant, variant
from shaders.registry import op as op_def
from shaders.registry import resolve
from shaders.tiles import GemmTable

if TYPE_CHECKING:
    from actors.vulkan.memory import DeviceMemory
    from actors.vulkan.pipelines import Pipelines
    from actors.vulkan.queues import Queues
    from actors.vulkan.timing import TimestampPool

# Assigned, not imported by name: see library's docstring (3.11 method calls).
ffi, lib, vk = library.ffi, library.lib, library.vk


def memory_barrier(command, src_access: int, dst_access: int, stages: int) -> None:
    """Record one global memory barrier from and to ``stages``."""
    barrier = ffi.new(
        "VkMemoryBarrier*",
        {
            "sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
            "srcAccessMask": src_access,
            "dstAccessMask": dst_access,
        },
    )
    lib.vkCmdPipelineBarrier(command, stages, stages, 0, 1, barrier, 0, ffi.NULL, 0, ffi.NULL)


def full_barrier(command) -> None:
    """Record a barrier after which every earlier shader, transfer and host write is visible to
    every later shader, transfer and host access."""
    memory_barrier(
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


def compute_barrier(command) -> None:
    """Record a barrier between two launches: shader writes before, shader accesses after."""
    memory_barrier(
        command,
        vk.VK_ACCESS_SHADER_WRITE_BIT,
        vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT,
        vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
    )


def shader_variants(program: Program) -> list[Variant]:
    """Every shader variant ``program``'s launches are built from, each once, in first-use order.

    Raises:
        KeyError: a launch of an op the registry does not know.
    """
    # Pipelines are built with no defines (variants differ by specialisation constants instead).
    return list(dict.fromkeys(variant(op_def(launch.op).shader) for launch in program.launches))


def launch_constants(
    launch: Launch,
    spec_overrides: dict[str, dict[str, int]] | None,
    facts: DeviceFacts | None,
    table: GemmTable | None,
) -> dict[str, int] | None:
    """The specialisation constants ``launch``'s pipeline is built with: a planned launch carries
    the constants the plan chose for this device; a hand-made one is resolved here the same way
    (``facts`` None: the defaults every device runs). Either way they include what the launch
    itself needs (gemm's TA/TB/VEC), so ``spec_overrides`` replace tiles on top of them."""
    overrides = (spec_overrides or {}).get(launch.op)
    if op_def(launch.op).tune is None:
        return overrides
    resolved = launch if launch.constants else resolve(launch, facts, table)
    return {**dict(resolved.constants), **(overrides or {})}


def record_program(
    queues: Queues,
    memory: DeviceMemory,
    pipelines: Pipelines,
    program: Program,
    slot: int,
    spec_overrides: dict[str, dict[str, int]] | None = None,
    timestamps: TimestampPool | None = None,
    tuning: bool = True,
    table: GemmTable | None = None,
) -> Recorded:
    """Record ``program`` bound to ``slot``'s per-slot arenas into a compute command buffer.

    Args:
        queues: the device and its compute queue (command pool, submit infos).
        memory: the open layout's arenas.
        pipelines: where pipelines and descriptor sets come from.
        program: what to run.
        slot: which per-slot arenas to bind.
        spec_overrides: op name -> specialisation constants, replacing the registry's per-launch
            tuning for that op.
        timestamps: a pool to write one timestamp before the first launch and after each launch.
        tuning: for launches the plan did not resolve (hand-made programs), whether their
            constants are resolved for this device (else the defaults every device runs).
        table: the device's GEMM tuning table, for those launches.

    Returns:
        The recorded program, for ``Queues.add_program``.

    Raises:
        ValueError: a launch binding the wrong number of tensors, or needing more workgroups than
            the device allows.
    """
    layout = memory.layout
    assert layout is not None, "open_layout first"
    facts = queues.facts
    pipelines.compile_shaders(shader_variants(program))
    # Every pipeline the program binds, built before recording (the driver's compiles at once).
    device = facts if tuning else None
    constants = [launch_constants(launch, spec_overrides, device, table) for launch in program.launches]
    pipelines.build_all((op_def(launch.op), c) for launch, c in zip(program.launches, constants, strict=True))
    handles = queues.allocate_command_buffer()
    command = handles[0]
    begin = ffi.new("VkCommandBufferBeginInfo*", {"sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO})
    check(lib.vkBeginCommandBuffer(command, begin), "vkBeginCommandBuffer")
    keep: list = []
    buffers: set[tuple[str, int]] = set()
    if not queues.timeline:
        # Orders this program after uploads on the shared queue, which end without a barrier.
        # With timeline semaphores it is not needed: host writes are visible at submission,
        # uploads are waited for through the semaphores, and every earlier submission on this
        # queue that writes memory (programs, staged copies) ends with this same full
        # barrier, which already orders everything submitted after it (~1.3 µs a step on an
        # H100, measured with timestamps).
        full_barrier(command)
    if timestamps is not None:
        if not timestamps.host_reset:
            lib.vkCmdResetQueryPool(command, timestamps.pool, 0, timestamps.count)
        lib.vkCmdWriteTimestamp(command, vk.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, timestamps.pool, 0)
    query = 1
    launched = 0  # launches recorded so far (their constants are ``constants[launched]``)
    for step in program.steps:
        if isinstance(step, Barrier):
            compute_barrier(command)
            continue
        definition = op_def(step.op)
        if len(step.args) != len(definition.bindings):
            raise ValueError(
                f"launch of {step.op!r} binds {len(step.args)} tensors, op needs "
                f"{len(definition.bindings)} {definition.bindings}"
            )
        overrides, launched = constants[launched], launched + 1
        pipeline, pipeline_layout, spec = pipelines.pipeline(definition, overrides)
        descriptor_set = pipelines.descriptor_set(len(definition.bindings))
        infos = ffi.new("VkDescriptorBufferInfo[]", len(step.args))
        for i, name in enumerate(step.args):
            tensor = layout.tensor(name)
            arena = memory.arena_for(tensor, slot)
            buffers.add(memory.buffer_key(tensor, slot))
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
        lib.vkUpdateDescriptorSets(queues.device, len(step.args), writes, 0, ffi.NULL)
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
        limit = facts.max_workgroup_count
        if gx > limit[0] or gy > limit[1] or gz > limit[2]:
            raise ValueError(f"launch of {step.op!r} needs {(gx, gy, gz)} workgroups; device allows {limit}")
        lib.vkCmdDispatch(command, gx, gy, gz)
        if timestamps is not None and query < timestamps.count:
            lib.vkCmdWriteTimestamp(command, vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, timestamps.pool, query)
            query += 1
        keep.extend((infos, writes, sets))
    full_barrier(command)
    check(lib.vkEndCommandBuffer(command), "vkEndCommandBuffer")
    # The program signals the compute timeline; its waiting form first waits for an upload.
    plain, waiting = queues.submit_infos(handles)
    return Recorded(handles=handles, plain=plain, waiting=waiting, buffers=frozenset(buffers), keep=keep)

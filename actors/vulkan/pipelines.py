"""Pipelines and descriptors: compiled shaders as compute pipelines, and the descriptor sets that
bind buffers to them.

Building a pipeline compiles SPIR-V into machine code in the driver (milliseconds), so each is
made once per op and specialisation and cached for the backend's life; shader modules and set
layouts (one per binding count) are shared between them. Descriptor sets come from pools that
grow as programs are recorded and are freed with the layout, whose buffers they point at.

Between runs, two caches spare the compiling: the SPIR-V cache (``shaders.compiler``), which
``compile_shaders`` fills for a whole program at once and in parallel before it is recorded, and
the driver's pipeline cache, kept on disk per device (``pipeline_cache``), loaded when the
backend opens and written back on ``close`` when this run built pipelines.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from actors.vulkan import library, pipeline_cache
from actors.vulkan.library import check
from shaders.compiler import Variant, compile_all, compile_shader
from shaders.registry import OpDef

# Assigned, not imported by name: see library's docstring (3.11 method calls).
ffi, lib, vk = library.ffi, library.lib, library.vk


class Pipelines:
    """The pipelines, shader modules, set layouts and descriptor pools of one VkDevice.

    Args:
        device: the VkDevice.
        physical: its VkPhysicalDevice, to keep the driver's pipeline cache on disk; None keeps
            none (every pipeline is compiled afresh).
    """

    def __init__(self, device, physical=None) -> None:
        self.device = device
        self._cache = ffi.NULL
        self._cache_path = None
        if physical is not None:
            self._open_cache(physical)
        self._built = False  # a pipeline was built since the cache was loaded: close saves it
        self._pipelines: dict[tuple, tuple[object, object, dict[str, int]]] = {}
        self._modules: dict[tuple, object] = {}
        self._set_layouts: dict[int, object] = {}
        self._descriptor_pools: list[object] = []

    def _open_cache(self, physical) -> None:
        identity = pipeline_cache.identity_of(physical)
        # Decided now, not at close: the cache goes back where it came from even if the
        # environment (VKFLOW_CACHE) has changed since.
        self._cache_path = pipeline_cache.cache_path(identity)
        seed = pipeline_cache.initial_data(self._cache_path, identity)
        self._cache = pipeline_cache.open_cache(self.device, seed)

    def set_layout(self, bindings: int):
        """The VkDescriptorSetLayout of ``bindings`` storage buffers (bindings 0..n-1)."""
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
            check(
                lib.vkCreateDescriptorSetLayout(self.device, info, ffi.NULL, handle),
                "vkCreateDescriptorSetLayout",
            )
            self._set_layouts[bindings] = handle[0]
        return self._set_layouts[bindings]

    def compile_shaders(self, variants: Iterable[Variant]) -> list[Variant]:
        """Compile the shader variants that have no module yet into the SPIR-V cache, in parallel,
        so the modules made while recording only read the cache.

        Returns:
            The variants that were compiled (not found in the cache).
        """
        return compile_all(v for v in variants if v not in self._modules)

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
            check(
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
    ) -> tuple[object, object, dict[str, int]]:
        """(pipeline, pipeline layout, spec values) for an op, cached per op and specialisation.

        Args:
            definition: the op.
            spec_overrides: specialisation constants replacing the op's defaults.
            defines: preprocessor defines the shader is compiled with.

        Returns:
            The VkPipeline, its VkPipelineLayout and the specialisation values it was built with.
        """
        key, request = self._request(definition, spec_overrides, defines)
        if request is not None:
            self._store(key, request, self._create(request))
        return self._pipelines[key]

    def build_all(self, wanted: Iterable[tuple[OpDef, dict[str, int] | None]]) -> int:
        """Build every pipeline in ``wanted`` that is not built yet, the driver's compiles in
        parallel threads (cffi releases the GIL in the call, and a VkPipelineCache is internally
        synchronised): on a cold start the driver compiles each pipeline for tens to hundreds of
        milliseconds, one after another otherwise (~3.5 s of the CNN example's first run on an
        H100). Modules and layouts are made here first, in order, so the threads share nothing.

        Returns:
            How many pipelines were built.
        """
        requests: dict[tuple, tuple] = {}
        for definition, overrides in wanted:
            key, request = self._request(definition, overrides, ())
            if request is not None and key not in requests:
                requests[key] = request
        if len(requests) > 1:
            workers = min(len(requests), os.cpu_count() or 1)
            with ThreadPoolExecutor(workers, thread_name_prefix="vkflow-pipelines") as pool:
                handles = list(pool.map(self._create, requests.values()))
        else:
            handles = [self._create(request) for request in requests.values()]
        for (key, request), handle in zip(requests.items(), handles, strict=True):
            self._store(key, request, handle)
        return len(requests)

    def _request(self, definition: OpDef, spec_overrides: dict[str, int] | None, defines: tuple):
        """(key, None) for a pipeline already built, else (key, what ``_create`` needs): its
        layout made, its create-info filled and everything that info points at kept alive."""
        spec = definition.spec_values(spec_overrides)
        local = definition.local(spec)
        key = (definition.name, local, tuple(sorted(spec.items())), defines)
        if key in self._pipelines:
            return key, None
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
        set_layout = ffi.new("VkDescriptorSetLayout[]", [self.set_layout(len(definition.bindings))])
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
        check(
            lib.vkCreatePipelineLayout(self.device, layout_info, ffi.NULL, layout_handle),
            "vkCreatePipelineLayout",
        )
        # The stage is copied into ``info`` by value, but what it points at (the entry name, the
        # specialisation info with its entries and data) is bound to names: each must outlive
        # vkCreateComputePipelines, or the driver reads freed memory.
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
        keep = (entries, data, spec_info, entry_name)
        return key, (definition.name, info, layout_handle[0], spec, keep)

    def _create(self, request: tuple) -> object:
        """vkCreateComputePipelines for one request (safe from several threads at once)."""
        name, info, _, _, _ = request
        handle = ffi.new("VkPipeline*")
        check(
            lib.vkCreateComputePipelines(self.device, self._cache, 1, info, ffi.NULL, handle),
            f"vkCreateComputePipelines({name})",
        )
        return handle[0]

    def _store(self, key: tuple, request: tuple, handle: object) -> None:
        _, _, layout, spec, _ = request
        self._pipelines[key] = (handle, layout, spec)
        self._built = True

    def descriptor_set(self, bindings: int):
        """A fresh VkDescriptorSet for ``bindings`` storage buffers, from a new pool when the
        current one is full."""
        for _attempt in range(2):
            if self._descriptor_pools:
                set_layout = ffi.new("VkDescriptorSetLayout[]", [self.set_layout(bindings)])
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
            check(
                lib.vkCreateDescriptorPool(self.device, pool_info, ffi.NULL, pool), "vkCreateDescriptorPool"
            )
            self._descriptor_pools.append(pool[0])
        raise RuntimeError("could not allocate a descriptor set")

    def free_descriptors(self) -> None:
        """Destroy every descriptor pool, so every set (the device must be idle)."""
        for pool in self._descriptor_pools:
            lib.vkDestroyDescriptorPool(self.device, pool, ffi.NULL)
        self._descriptor_pools = []

    def close(self) -> None:
        """Write the pipeline cache back if this run added to it, then destroy it, the pipelines,
        their layouts, the shader modules and the set layouts."""
        if self._cache != ffi.NULL:
            if self._built:
                pipeline_cache.save_cache(self.device, self._cache, self._cache_path)
            lib.vkDestroyPipelineCache(self.device, self._cache, ffi.NULL)
            self._cache = ffi.NULL
        for pipeline, layout, _ in self._pipelines.values():
            lib.vkDestroyPipeline(self.device, pipeline, ffi.NULL)
            lib.vkDestroyPipelineLayout(self.device, layout, ffi.NULL)
        for module in self._modules.values():
            lib.vkDestroyShaderModule(self.device, module, ffi.NULL)
        for set_layout in self._set_layouts.values():
            lib.vkDestroyDescriptorSetLayout(self.device, set_layout, ffi.NULL)

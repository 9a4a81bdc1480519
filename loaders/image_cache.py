"""The decoded-pixel cache of an image folder: every image's 8-bit pixels, decoded once, so that
later epochs cost what IDX costs (a gather from ``cache_dir("images")/<group>-<key>.npy``, uint8
[n, *sample_shape] in the source's layout, beside a JSON record; see :mod:`loaders.image_folder`).

The key hashes all that decides the pixels: this format's and Pillow's versions, the root, labels
CSV, mode, size, layout, and every file in order with its size and mtime from a fresh ``stat`` (the
manifest trusts directory mtimes, which miss a file rewritten in place). The group hashes the same
without the files; a new cache removes its group's older ones. The record holds the key, the array's
bytes and the bad items met while decoding (index -> why), so ``on_error`` meets them on every read
as uncached. Both files are written atomically, the array first; a record or array that does not
check out on load is ignored with a warning and rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import PIL

from loaders.errors import logger
from shaders.user_cache import cache_dir, partial_path, write_atomically

CACHE_VERSION = 1
Found = tuple[np.ndarray, dict[int, str]]  # the pixels (mapped, read-only) and the bad items


@dataclass(frozen=True)
class CacheEntry:
    """One folder's cache: its group and key (see the module docstring) and uint8 shape [n, ...]."""

    group: str
    key: str
    shape: tuple[int, ...]

    def path(self, suffix: str) -> Path:
        return cache_dir("images") / f"{self.group}-{self.key[:24]}{suffix}"


def cache_entry(settings: dict, files: Iterable[tuple[str, str]], shape: tuple[int, ...]) -> CacheEntry:
    """The entry of a folder decoded with ``settings`` (JSON-able: root, mode, size...), of
    ``files`` ((name, OS path) of each sample, in order) into uint8 ``shape`` [n, *sample_shape]."""
    # The group leaves out the files and their count: a folder that gains a file stays in its group.
    head = json.dumps({**settings, "version": CACHE_VERSION, "pillow": PIL.__version__, "sample": shape[1:]})
    digest = hashlib.sha256(f"{head}\n{shape[0]}\n".encode())
    for name, path in files:
        try:
            st = os.stat(path)
            stamp = f"{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            stamp = "missing"  # read as a bad item, which keeps this cache from being written
        digest.update(f"{name}\0{stamp}\n".encode())
    return CacheEntry(hashlib.sha256(head.encode()).hexdigest()[:16], digest.hexdigest(), tuple(shape))


def load_cache(entry: CacheEntry) -> Found | None:
    """``entry``'s (pixels, bad items) when its cache is there and checks out; else None, after a
    warning where a cache was there but is corrupt or stale: the folder must be decoded again."""
    record_path, array_path = entry.path(".json"), entry.path(".npy")
    if not record_path.exists():
        older = sorted(record_path.parent.glob(f"{entry.group}-*.json"))
        if older:
            logger.warning("image cache %s is stale (the folder's files changed): decoding again", older[0])
        return None
    try:
        record = json.loads(record_path.read_text())
        pixels = np.load(array_path, mmap_mode="r", allow_pickle=False)
        bad = {int(i): str(why) for i, why in record["bad"].items()}
        size, problem = os.path.getsize(array_path), ""
        if record["version"] != CACHE_VERSION or record["key"] != entry.key:
            problem = "its record is of another version or key"
        elif pixels.dtype != np.uint8 or pixels.shape != entry.shape or not pixels.flags.c_contiguous:
            problem = f"array {pixels.dtype} {pixels.shape}, expected uint8 {entry.shape}"
        elif size != record["bytes"]:
            problem = f"{size} bytes, its record says {record['bytes']}"
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        logger.warning("image cache %s is corrupt (%s): ignored, decoding again", array_path, problem)
        return None
    return pixels, bad


def write_cache(entry: CacheEntry, fill: Callable[[np.ndarray], dict[int, str] | None]) -> Found | None:
    """Make ``entry``'s cache: ``fill(array)`` decodes into the mapped array (a temporary file) and
    returns the bad items met (index -> why), or None to give up; the array and then its record are
    put in place atomically, the group's older caches removed, and the cache loaded back as a later
    open would. None where ``fill`` gave up or the cache cannot be written (warned)."""
    final = entry.path(".npy")
    partial = partial_path(final)  # a mapped array, so not write_atomically
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        array = np.lib.format.open_memmap(partial, mode="w+", dtype=np.uint8, shape=entry.shape)
        bad = fill(array)
        array.flush()
        del array  # unmapped before the file moves
        if bad is None:
            return None
        os.replace(partial, final)
        bad_items = {str(i): why for i, why in bad.items()}
        record = dict(
            version=CACHE_VERSION, key=entry.key, shape=entry.shape, bytes=final.stat().st_size, bad=bad_items
        )
        write_atomically(entry.path(".json"), json.dumps(record).encode())
    except OSError as exc:
        logger.warning("cannot write image cache %s (%s): reading decodes", final, exc)
        return None
    finally:
        partial.unlink(missing_ok=True)
    for older in final.parent.glob(f"{entry.group}-*"):
        if older.stem != final.stem:
            older.unlink(missing_ok=True)  # a mapping of it elsewhere stays valid (POSIX)
    return load_cache(entry)

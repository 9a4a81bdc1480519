"""Per-device GEMM tile tables: the measured best tiles for the shapes a model launches.

The best fp32 tile depends on the GPU and on the shape (an MLP's batch of 256 leaves too few
128 x 128 tiles to fill an H100; a 4096^3 GEMM wants exactly those). ``bench/sweep_gemm.py``
times candidate tiles on a device and writes the winners as a table; the entry tier loads it
(:func:`load_table`) and the planner hands it to ``tune_gemm``, which looks a launch's shape up
there first and falls back to its size heuristic for shapes not listed.

Tables are JSON files, found in this order:
1. the file named by ``$VKFLOW_GEMM_TUNING``;
2. the user's cache, ``cache_dir("tuning")/<device>.json`` (what a sweep writes; see
   :mod:`shaders.user_cache`: ``$VKFLOW_CACHE``, else ``$XDG_CACHE_HOME/vkflow``);
3. the tables shipped in ``shaders/tuning/<device>.json`` (measured by the developers).
Only a table whose ``device`` matches the device's name is used.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path

from shaders.user_cache import cache_dir

SHIPPED = Path(__file__).with_name("tuning")
TILE_KEYS = ("BM", "BN", "BK", "TM", "TN", "GM", "SK", "DB", "KR", "WL", "XS", "CT")


def device_slug(device: str) -> str:
    """A file name for a device name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "device"


def shape_key(m: int, n: int, k: int, trans_a: int, trans_b: int) -> str:
    return f"{m}x{n}x{k}:{int(bool(trans_a))}{int(bool(trans_b))}"


def cache_path(device: str) -> Path:
    """Where a sweep writes the device's table in the user cache.

    Args:
        device: the device's name.

    Returns:
        ``cache_dir("tuning")/<device slug>.json``.
    """
    return cache_dir("tuning", f"{device_slug(device)}.json")


def candidate_paths(device: str) -> list[Path]:
    paths = []
    if os.environ.get("VKFLOW_GEMM_TUNING"):
        paths.append(Path(os.environ["VKFLOW_GEMM_TUNING"]))
    paths += [cache_path(device), SHIPPED / f"{device_slug(device)}.json"]
    return paths


@lru_cache(maxsize=16)
def _table(device: str, paths: tuple[Path, ...]) -> dict[str, dict[str, int]]:
    # The paths are the cache key beside the device: a new $VKFLOW_GEMM_TUNING, $VKFLOW_CACHE or
    # $XDG_CACHE_HOME means a new lookup.
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as error:
            raise ValueError(f"GEMM tuning table {path}: unreadable ({error})") from error
        if data.get("device") != device:
            continue
        return {key: validated(path, key, tiles) for key, tiles in data.get("gemm", {}).items()}
    return {}


def validated(path: Path, key: str, tiles: object) -> dict[str, int]:
    """The entry's tile constants, or a ValueError naming the file, the shape and the value."""
    if not isinstance(tiles, dict) or not all(isinstance(tiles.get(name), int) for name in TILE_KEYS[:5]):
        need = ", ".join(TILE_KEYS[:5])
        raise ValueError(f"GEMM tuning table {path}: entry {key!r} needs integers {need}; got {tiles!r}")
    return {name: int(tiles[name]) for name in TILE_KEYS if name in tiles}


def load_table(device: str) -> dict[str, dict[str, int]]:
    """The device's tuning table (shape key -> tiles), read from the first file that is for this
    device (see the module docstring), or empty. The read is the effect; choosing tiles from the
    table (shaders.tiles.tune_gemm) is pure, so the planner takes the table as data.

    Args:
        device: the device's name.

    Returns:
        The table; the same object on later calls while the candidate files stay the same.
    """
    return _table(device, tuple(candidate_paths(device)))


def lookup(device: str, m: int, n: int, k: int, trans_a: int, trans_b: int) -> dict[str, int] | None:
    """The table's tiles for this exact launch shape on this device, or None."""
    return load_table(device).get(shape_key(m, n, k, trans_a, trans_b))


def write_table(path: Path, device: str, driver: str, best: dict[str, dict[str, int]]) -> None:
    """Write (atomically) a table of the best tiles per shape key, keeping the entries of an
    existing table for the same device that ``best`` does not measure again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    merged: dict[str, dict[str, int]] = {}
    try:
        old = json.loads(path.read_text())
        if old.get("device") == device:
            merged.update(old.get("gemm", {}))
    except (OSError, ValueError):
        pass  # no table yet, or an unreadable one that this write replaces
    merged.update(best)
    body = {"device": device, "driver": driver, "gemm": dict(sorted(merged.items()))}
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(temporary, path)
    _table.cache_clear()

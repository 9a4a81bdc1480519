"""A source over a folder of images: ``root/<class>/*.png`` or a flat folder plus a labels CSV.

Class names are the sorted sub-directory names and become label ids 0..k-1 in that order. The
listing comes from the cached manifest (:mod:`loaders.cache`); files are decoded by
:mod:`loaders.decode` in a thread pool: each worker takes short contiguous runs of the batch
until none are left.

Small images are cheap to decode, so the Python work per image (which holds the GIL and so does
not run in parallel) decides the speed there. A worker therefore keeps it to the minimum: read
the bytes (plain ``os`` calls, sized from the manifest), let Pillow decode them (the fast path of
:mod:`loaders.decode` for plain JPEGs and PNGs), copy the 8-bit pixels into the batch's uint8
staging array; then it converts the whole run to float32 in one vectorised numpy pass (which
releases the GIL), instead of one small float array per image.

With ``cache="auto"`` (the spec's default) the folder is decoded once, at open, into a uint8 cache
(:mod:`loaders.image_cache`); reads are then a gather and one cast, as IDX's, and ``stored()``
hands the pixels to a device.
"""

from __future__ import annotations

import csv
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from loaders.cache import load_manifest
from loaders.decode import (
    CHANNELS,
    IMAGE_EXTENSIONS,
    LAYOUTS,
    MODES,
    DecodeSpec,
    decode_pixels,
    probe_size,
    read_file,
)
from loaders.errors import ErrorPolicy, LoaderError, logger
from loaders.image_cache import CacheEntry, cache_entry, load_cache, write_cache
from loaders.source import SourceStatistics, StatsRecorder, StoredData, check_indices, readonly

# A batch is cut into about this many runs per decode worker (see ImageFolderSource.read).
_RUNS_PER_WORKER = 8
# What an 8-bit pixel is multiplied by, decoded or from the cache: the same float32 bits either way.
_SCALE = np.float32(1.0 / 255.0)
# The default limit on a folder's decoded pixels for cache="auto"; a cache up to _IN_RAM_BYTES is
# read into RAM (reads are then a gather from memory, see loaders.source), a larger one is mapped.
CACHE_BYTES = 2 * 2**30
_IN_RAM_BYTES = 256 * 2**20
# The cache is decoded in chunks of about this many bytes of pixels (bounding the staging memory).
_CHUNK_BYTES = 64 * 2**20


def _norm_size(size: int | Sequence[int] | None) -> tuple[int, int] | None:
    if size is None:
        return None
    if isinstance(size, int):
        size = (size, size)
    h, w = (int(v) for v in size)
    if h <= 0 or w <= 0:
        raise ValueError(f"size must be positive (height, width), got {size!r}")
    return h, w


def _read_labels_csv(path: Path) -> list[tuple[str, str, int]]:
    """Rows (filename, label, line number) of a ``filename,label`` CSV; a header row is optional."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise LoaderError(str(path), f"cannot read labels CSV ({exc})") from exc
    out = []
    for line, row in enumerate(rows, start=1):
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) != 2:
            raise LoaderError(f"{path}: line {line}", f"expected 2 columns (filename,label), got {len(row)}")
        name, label = row[0].strip(), row[1].strip()
        if not out and name.lower() in ("filename", "file", "path") and label.lower() == "label":
            continue
        if not name or not label:
            raise LoaderError(f"{path}: line {line}", "empty filename or label")
        out.append((name.replace(os.sep, "/"), label, line))
    return out


def _class_ids(names: list[str]) -> tuple[list[str], np.ndarray]:
    """Label ids for label strings: integers as they are, otherwise sorted names -> 0..k-1."""
    try:
        ids = np.array([int(n) for n in names], dtype=np.int64)
    except ValueError:
        classes = sorted(set(names))
        lookup = {c: i for i, c in enumerate(classes)}
        return classes, np.array([lookup[n] for n in names], dtype=np.int32)
    if ids.size and ids.min() < 0:
        raise ValueError("negative class label")
    k = int(ids.max()) + 1 if ids.size else 0
    return [str(i) for i in range(k)], ids.astype(np.int32)


class _Batch:
    """One ``read``: the indices, the float32 output and the uint8 staging the workers share.

    Workers take runs of positions from :meth:`take` and write only those, so the arrays need no
    lock.
    """

    __slots__ = (
        "deep",
        "flat",
        "ids",
        "lock",
        "next",
        "ok",
        "out",
        "per",
        "planar",
        "run",
        "size",
        "sizes",
        "staging",
        "transpose",
    )

    def __init__(
        self,
        source: ImageFolderSource,
        idx: np.ndarray,
        out: np.ndarray | None,
        run: int,
        pixels: np.ndarray | None = None,
    ) -> None:
        spec, shape = source._decode, source.sample_shape
        h, w = (shape[1], shape[2]) if spec.layout == "CHW" else (shape[0], shape[1])
        c = CHANNELS[spec.mode]
        self.size = int(idx.size)
        self.ids: list[int] = idx.tolist()
        self.sizes: list[int] = source._sizes[idx].tolist()
        self.out = out  # None: 8-bit pixels only, into ``pixels`` (the decoded-pixel cache)
        self.run, self.next, self.lock = run, 0, threading.Lock()
        self.ok = np.zeros(self.size, dtype=bool)
        self.deep: list[tuple[int, np.ndarray]] = []  # >8-bit images, float32 already
        self.per = h * w * c
        # Pillow gives pixels as (H, W, C) bytes; (C, H, W) output with C > 1 needs a transpose,
        # done as a uint8 copy into ``planar`` so that the float cast runs on contiguous memory.
        self.transpose = spec.layout == "CHW" and c > 1
        self.planar = np.empty((self.size, *shape), np.uint8) if pixels is None else pixels
        hwc = (self.size, h, w, c)
        self.staging = np.empty(hwc, dtype=np.uint8) if self.transpose else self.planar.reshape(hwc)
        self.flat = memoryview(self.staging.reshape(-1))  # bytes go in by slice assignment

    def take(self) -> tuple[int, int] | None:
        """The next run of positions ``(lo, hi)`` to decode, or None when all are taken."""
        with self.lock:
            lo = self.next
            if lo >= self.size:
                return None
            self.next = hi = min(lo + self.run, self.size)
        return lo, hi

    def to_float(self, lo: int, hi: int) -> None:
        """Convert positions ``[lo, hi)`` to float32 in [0, 1] (numpy releases the GIL)."""
        if self.transpose:
            np.copyto(self.planar[lo:hi], self.staging[lo:hi].transpose(0, 3, 1, 2))
        if self.out is not None:
            np.multiply(self.planar[lo:hi], _SCALE, out=self.out[lo:hi], casting="unsafe")


class ImageFolderSource:
    """Images under a folder, decoded to float32 in [0, 1].

    Args:
        root: the folder.
        size: (height, width) to resize (cover, then centre-crop) every image to; None keeps the
            files' size, which must then be the same for all (a different one is a bad item). The
            expected size is that of the first readable file.
        mode: target colour mode, "L", "RGB" or "RGBA".
        layout: "CHW" or "HWC" per sample.
        labels_csv: a ``filename,label`` CSV for a flat folder (filenames relative to ``root``);
            None means class sub-directories. Integer labels are used as they are; other labels
            are class names, sorted into ids.
        workers: decode threads; 0 or 1 decodes in the calling thread.
        on_error: "raise" or "skip" (see :mod:`loaders.errors`).
        cache: "auto": keep the decoded 8-bit pixels in the user cache (:mod:`loaders.image_cache`),
            decoding the folder now if no valid cache is there and they fit ``cache_bytes``. "off"
            (default here; the spec's default is "auto"): every read decodes.
        cache_bytes: the most bytes of pixels "auto" caches.

    Attributes:
        in_memory: the cache is open and read into RAM (see loaders.source).
        cache_reused: an existing cache was opened (nothing was decoded at open).
        cache_file: the cache's array file while it is open, else None.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        size: int | Sequence[int] | None = None,
        mode: str = "L",
        layout: str = "CHW",
        labels_csv: str | os.PathLike | None = None,
        workers: int = 2,
        on_error: str = "raise",
        cache: str = "off",
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        if cache not in ("auto", "off"):
            raise ValueError(f"cache must be 'auto' or 'off', got {cache!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise LoaderError(str(root), "not a directory" if self.root.exists() else "no such directory")
        self.workers = int(workers)
        self._policy = ErrorPolicy(on_error, str(self.root))
        self._stats = StatsRecorder()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        try:
            manifest = load_manifest(self.root, IMAGE_EXTENSIONS)
        except OSError as exc:
            raise LoaderError(str(self.root), f"cannot list folder ({exc})") from exc
        self.manifest_reused = manifest.reused
        if labels_csv is None:
            files, labels, self.classes = self._by_class_dirs(manifest.files)
        else:
            files, labels, self.classes = self._by_labels_csv(Path(labels_csv), manifest.files)
        if not files:
            raise LoaderError(str(self.root), f"no image files ({', '.join(sorted(IMAGE_EXTENSIONS))})")
        self.files: tuple[str, ...] = tuple(files)
        # Per-image lookups done once: the OS path prefix, and each file's listed size (the first
        # read is sized from it; a file changed since the listing is still read whole).
        self._prefix = str(self.root) + os.sep
        listed_size = dict(zip(manifest.files, manifest.sizes, strict=True))
        self._sizes = np.array([listed_size[f] for f in files], dtype=np.int64)
        self.labels = readonly(labels)
        self.label_dtype = np.dtype(np.int32)
        self.num_classes: int | None = len(self.classes)
        hw = _norm_size(size) or self._probe_first_size()
        self._decode = DecodeSpec(mode, _norm_size(size), layout)
        self.sample_shape: tuple[int, ...] = self._decode.shape(hw)
        self._pixels: np.ndarray | None = None  # the decoded-pixel cache, when open
        self._bad: dict[int, str] = {}  # the bad items it recorded: index -> why
        self._bad_mask = np.zeros(0, bool)
        self.in_memory = self.cache_reused = False
        self.cache_file: Path | None = None
        if cache == "auto":
            self._open_cache(labels_csv, cache_bytes)

    def _by_class_dirs(self, listed: Sequence[str]) -> tuple[list[str], np.ndarray, list[str]]:
        nested = [f for f in listed if "/" in f]
        if nested and len(nested) < len(listed):
            # Not bad items (they have no class to be read as), but never dropped without a word.
            logger.warning(
                "%s: %d image files directly under the root are in no class folder and are ignored",
                self.root,
                len(listed) - len(nested),
            )
        classes = sorted({f.split("/", 1)[0] for f in nested})
        lookup = {c: i for i, c in enumerate(classes)}
        labels = np.array([lookup[f.split("/", 1)[0]] for f in nested], dtype=np.int32)
        return nested, labels, classes

    def _by_labels_csv(
        self, csv_path: Path, listed: Sequence[str]
    ) -> tuple[list[str], np.ndarray, list[str]]:
        if not csv_path.is_file() and (self.root / csv_path).is_file():
            csv_path = self.root / csv_path
        rows = _read_labels_csv(csv_path)
        present = set(listed)
        seen: set[str] = set()
        files, names = [], []
        for name, label, line in rows:
            if name in seen:
                raise LoaderError(f"{csv_path}: line {line}", f"duplicate filename {name!r}")
            seen.add(name)
            if name not in present:
                # A listed file that does not exist is a bad item like any other.
                self._policy.handle(
                    LoaderError(f"{csv_path}: line {line}", f"image {name!r} not found under {self.root}")
                )
                continue
            files.append(name)
            names.append(label)
        try:
            classes, labels = _class_ids(names)
        except ValueError as exc:
            raise LoaderError(str(csv_path), str(exc)) from exc
        # Keep the manifest's sorted order, whatever order the CSV lists files in.
        order = sorted(range(len(files)), key=lambda i: files[i].split("/"))
        return [files[i] for i in order], labels[order], classes

    def _probe_first_size(self) -> tuple[int, int]:
        last: LoaderError | None = None
        for i in range(len(self.files)):
            path = self._path(i)
            try:
                return probe_size(read_file(path), path)
            except LoaderError as exc:
                last = exc  # a bad first file is reported when read; its neighbour sets the size
        raise LoaderError(str(self.root), f"no readable image to take the size from (last: {last})")

    def __len__(self) -> int:
        return len(self.files)

    def __enter__(self) -> ImageFolderSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def statistics(self) -> SourceStatistics:
        """Frozen counters: samples read, skipped, bytes read, decode seconds (summed over threads).

        Returns:
            The statistics so far.
        """
        policy = self._policy
        return self._stats.snapshot(policy.skipped, policy.items, policy.examples)

    def close(self) -> None:
        """Stop the decode threads (a later ``read`` starts new ones)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _path(self, i: int) -> str:
        """The OS path of sample ``i`` (as ``str(self.root / self.files[i])``)."""
        rel = self.files[i]
        return self._prefix + (rel if os.sep == "/" else rel.replace("/", os.sep))

    def _fill(self, batch: _Batch, lo: int, hi: int, errors: dict[int, LoaderError]) -> int:
        """Decode batch positions ``[lo, hi)`` and convert them to float32; returns bytes read.

        Each image's 8-bit pixels go into the batch's uint8 staging array; the run is converted
        to float32 in one pass at the end. A bad item goes into ``errors`` by position, never
        raised here; its slot holds whatever and ``read`` drops it.
        """
        spec, expect, per = self._decode, self.sample_shape, batch.per
        flat, ids, sizes, ok = batch.flat, batch.ids, batch.sizes, batch.ok
        nbytes = 0
        for pos in range(lo, hi):
            path = self._path(ids[pos])
            try:
                data = read_file(path, sizes[pos])
                pixels = decode_pixels(data, spec, path, expect)
            except LoaderError as exc:
                errors[pos] = exc
                continue
            if type(pixels) is bytes:
                flat[pos * per : (pos + 1) * per] = pixels
            else:
                batch.deep.append((pos, pixels))  # >8-bit: float32 already, placed by read
            nbytes += len(data)
            ok[pos] = True
        batch.to_float(lo, hi)
        return nbytes

    def _fill_runs(self, batch: _Batch) -> dict[int, LoaderError]:
        """Decode runs of the batch until none are left; bad items are returned by position."""
        errors: dict[int, LoaderError] = {}
        nbytes = 0
        t0 = time.perf_counter()
        while (todo := batch.take()) is not None:
            nbytes += self._fill(batch, *todo, errors)
        self._stats.add(bytes_read=nbytes, seconds=time.perf_counter() - t0)
        return errors

    def read(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """Decode samples.

        Args:
            indices: sample indices, any order, repeats allowed.

        Returns:
            (x float32 [n, *sample_shape], y int32 [n], skipped) where n < len(indices) only when
            bad items were skipped under ``on_error="skip"``.

        Raises:
            LoaderError: under ``on_error="raise"``, for the first bad item in ``indices`` order.
        """
        idx = check_indices(indices, len(self), str(self.root))
        out = np.empty((idx.size, *self.sample_shape), dtype=np.float32)
        if self._pixels is not None:
            rows, skipped = self._from_cache(idx, out, labels := np.empty(idx.size, np.int32))
            return out[:rows], labels[:rows], skipped
        batch, errors = self._decode_batch(idx, out)
        for pos, pixels in batch.deep:
            out[pos] = pixels
        for pos in sorted(errors):
            self._policy.handle(errors[pos])
        skipped = len(errors)
        if skipped:
            out, idx = out[batch.ok], idx[batch.ok]
        self._stats.add(samples=int(idx.size))
        return out, self.labels[idx], skipped

    def _decode_batch(
        self, idx: np.ndarray, out: np.ndarray | None, pixels: np.ndarray | None = None
    ) -> tuple[_Batch, dict[int, LoaderError]]:
        """Decode ``idx`` into ``out`` (float32) or only into ``pixels`` (uint8); bad items by position."""
        if self.workers <= 1 or idx.size <= 1:
            batch = _Batch(self, idx, out, max(1, idx.size), pixels)
            return batch, self._fill_runs(batch)
        with self._pool_lock:  # two threads reading at once must not start two pools
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="vkflow-decode")
            pool = self._pool
        # One task per worker, each taking short contiguous runs of the batch until none are
        # left: few futures, and no worker idles while another still has a run of slow images
        # (a PNG decodes several times slower than a JPEG of the same size).
        run = max(1, idx.size // (self.workers * _RUNS_PER_WORKER))
        batch = _Batch(self, idx, out, run, pixels)
        futures = [pool.submit(self._fill_runs, batch) for _ in range(min(self.workers, -(-idx.size // run)))]
        errors: dict[int, LoaderError] = {}
        for fut in futures:
            errors.update(fut.result())
        return batch, errors

    # --- the decoded-pixel cache (loaders.image_cache) ------------------------------------------

    def _open_cache(self, labels_csv: str | os.PathLike | None, limit: int) -> None:
        """Map this folder's decoded-pixel cache, decoding the folder into a new one first when there
        is none and its pixels fit ``limit`` bytes; without a cache, reads decode."""
        spec = self._decode
        csv_name = None if labels_csv is None else str(labels_csv)
        settings = {"root": str(self.root), "csv": csv_name, "decode": [spec.mode, spec.size, spec.layout]}
        files = ((name, self._path(i)) for i, name in enumerate(self.files))
        entry = cache_entry(settings, files, (len(self), *self.sample_shape))
        found = load_cache(entry)
        self.cache_reused = found is not None
        if found is None and math.prod(entry.shape) > limit:
            logger.info("%s: pixels over the image cache's %d bytes: not cached", self.root, limit)
        elif found is None:
            found = self._build_cache(entry)
        if found is not None:
            pixels, self._bad = found
            # Small enough: read whole into RAM, where a read is a gather (loaders.source).
            self.in_memory = pixels.nbytes <= _IN_RAM_BYTES
            self._pixels = readonly(np.array(pixels) if self.in_memory else pixels)
            self._bad_mask = np.zeros(len(self), bool)
            self._bad_mask[list(self._bad)] = True
            self.cache_file = entry.path(".npy")

    def _build_cache(self, entry: CacheEntry) -> tuple[np.ndarray, dict[int, str]] | None:
        began = time.perf_counter()
        logger.info("%s: decoding %d images once into the image cache", self.root, len(self))
        found = write_cache(entry, self._decode_all)
        if found is not None:
            logger.info("%s: image cache written in %.1f s", self.root, time.perf_counter() - began)
        return found

    def _decode_all(self, pixels: np.ndarray) -> dict[int, str] | None:
        """Decode every image into ``pixels`` (in chunks, in the decode threads): the bad items met
        (index -> why), or None where the cache must not be written."""
        errors: dict[int, LoaderError] = {}
        chunk = max(1, _CHUNK_BYTES // math.prod(self.sample_shape))
        for lo in range(0, len(self), chunk):
            idx = np.arange(lo, min(lo + chunk, len(self)))
            batch, found = self._decode_batch(idx, None, pixels[lo : lo + idx.size])
            if batch.deep:
                logger.info("%s holds images of more than 8 bits: not cached", self.root)
                return None
            errors.update({lo + pos: error for pos, error in found.items()})
        if any(error.why.startswith("cannot read file") for error in errors.values()):
            # Perhaps passing (permissions, a network disk): not recorded as bad for good.
            logger.info("%s: files that cannot be read now: the image cache is not written", self.root)
            return None
        return {i: errors[i].why for i in sorted(errors)}

    def _from_cache(self, idx: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[int, int]:
        """Samples ``idx`` from the cache into ``x[:rows]`` and ``y[:rows]``: the bad items recorded
        in it go through ``on_error`` as when decoding; the rest is a gather and one cast."""
        t0 = time.perf_counter()
        skipped = 0
        if self._bad:
            bad = self._bad_mask[idx]
            for i in idx[bad].tolist():
                self._policy.handle(LoaderError(self._path(i), self._bad[i]))
            skipped, idx = int(bad.sum()), idx[~bad]
        rows = int(idx.size)
        raw = self._pixels[idx]
        np.multiply(raw, _SCALE, out=x[:rows], casting="unsafe")  # as _Batch.to_float: the same bits
        y[:rows] = self.labels[idx]
        self._stats.add(samples=rows, bytes_read=raw.nbytes, seconds=time.perf_counter() - t0)
        return rows, skipped

    @property
    def read_into(self) -> Callable[[Sequence[int], np.ndarray, np.ndarray], tuple[int, int]] | None:
        """``read_into(indices, x, y) -> (rows, skipped)`` where the cache is open: the same values
        as ``read`` written into the caller's arrays, kept rows first (e.g. a device's mapped input
        slot). None without a cache (a decode has nothing to gain from it)."""
        return None if self._pixels is None else self._read_into

    def _read_into(self, indices: Sequence[int], x: np.ndarray, y: np.ndarray) -> tuple[int, int]:
        idx = check_indices(indices, len(self), str(self.root))
        if idx.size > min(x.shape[0], y.shape[0]) or tuple(x.shape[1:]) != self.sample_shape:
            shapes = f"{self.sample_shape} do not fit arrays {tuple(x.shape)} and {tuple(y.shape)}"
            raise ValueError(f"{self.root}: {idx.size} samples of shape {shapes}")
        return self._from_cache(idx, x, y)

    @property
    def stored_dtype(self) -> str | None:
        """ "uint8" where :meth:`stored` gives the data: the cache is open and holds no bad item."""
        return "uint8" if self._pixels is not None and not self._bad else None

    def stored(self) -> StoredData | None:
        """Every sample's 8-bit pixels from the cache, to keep on a device (loaders.source.StoredData:
        ``read`` gives ``float32(x) * float32(1/255)``); None where :attr:`stored_dtype` is None (bad
        items go through ``read`` and ``on_error``)."""
        return (
            None if self.stored_dtype is None else StoredData(self._pixels, np.asarray(self.labels), 1 / 255)
        )

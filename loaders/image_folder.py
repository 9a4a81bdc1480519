"""A source over a folder of images: ``root/<class>/*.png`` or a flat folder plus a labels CSV.

Class names are the sorted sub-directory names and become label ids 0..k-1 in that order. The
listing comes from the cached manifest (:mod:`loaders.cache`); files are decoded by
:mod:`loaders.decode` in a thread pool, each worker filling its own slice of the batch array.
"""

from __future__ import annotations

import csv
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import numpy as np

from loaders.cache import load_manifest
from loaders.decode import (
    IMAGE_EXTENSIONS,
    LAYOUTS,
    MODES,
    DecodeSpec,
    decode_image,
    probe_size,
    read_file,
)
from loaders.errors import ErrorPolicy, LoaderError, logger
from loaders.source import SourceStatistics, StatsRecorder, check_indices, readonly


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
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise LoaderError(str(root), "not a directory")
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
        self.labels = readonly(labels)
        self.label_dtype = np.dtype(np.int32)
        self.num_classes: int | None = len(self.classes)
        hw = _norm_size(size) or self._probe_first_size()
        self._decode = DecodeSpec(mode, _norm_size(size), layout)
        self.sample_shape: tuple[int, ...] = self._decode.shape(hw)

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
        for rel in self.files:
            path = self.root / rel
            try:
                return probe_size(read_file(path), str(path))
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
        return self._stats.snapshot(self._policy.skipped)

    def close(self) -> None:
        """Stop the decode threads (a later ``read`` starts new ones)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _decode_into(self, i: int, out: np.ndarray) -> int:
        """Decode sample ``i`` into ``out``; returns the bytes read."""
        path = self.root / self.files[i]
        data = read_file(path)
        decode_image(data, self._decode, str(path), expect=self.sample_shape, out=out)
        return len(data)

    def _fill(
        self, idx: np.ndarray, out: np.ndarray, ok: np.ndarray, lo: int, hi: int
    ) -> dict[int, LoaderError]:
        """Decode ``idx[lo:hi]`` into ``out``; errors are returned by position, never raised here."""
        errors: dict[int, LoaderError] = {}
        nbytes = 0
        t0 = time.perf_counter()
        for pos in range(lo, hi):
            try:
                nbytes += self._decode_into(int(idx[pos]), out[pos])
                ok[pos] = True
            except LoaderError as exc:
                errors[pos] = exc
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
        ok = np.zeros(idx.size, dtype=bool)
        errors: dict[int, LoaderError] = {}
        if self.workers <= 1 or idx.size <= 1:
            errors = self._fill(idx, out, ok, 0, idx.size)
        else:
            with self._pool_lock:  # two threads reading at once must not start two pools
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="vkflow-decode")
                pool = self._pool
            # One contiguous slice per worker: far fewer futures than one per image.
            bounds = np.linspace(0, idx.size, min(self.workers, idx.size) + 1).astype(int)
            futures = [pool.submit(self._fill, idx, out, ok, lo, hi) for lo, hi in pairwise(bounds.tolist())]
            for fut in futures:
                errors.update(fut.result())
        for pos in sorted(errors):
            self._policy.handle(errors[pos])
        skipped = len(errors)
        if skipped:
            out, idx = out[ok], idx[ok]
        self._stats.add(samples=int(idx.size))
        return out, self.labels[idx], skipped

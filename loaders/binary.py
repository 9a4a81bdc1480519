"""Fixed-size binary records: raw files through ``np.memmap``, and the IDX format (MNIST).

A raw file is ``n`` records of ``dtype`` and ``shape`` back to back; labels, when given, are a second
raw file (or ``.npy``) of ``n`` values. IDX is the format MNIST ships in: two zero bytes, a type code,
the number of dimensions, each dimension as a big-endian uint32, then big-endian data.
:func:`write_idx` writes it, so that the reader can be tested by round trip. Records are mapped,
not read: only the rows asked for are touched.

Values follow the one convention of every source (``flow.spec``'s module docstring): uint8 records
are divided by 255, so they arrive in [0, 1] like decoded images; every other dtype is cast to
float32 unchanged.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import struct
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loaders.errors import ErrorPolicy, LoaderError, logger
from loaders.source import SourceStatistics, StatsRecorder, StoredData, check_indices, readonly
from shaders.user_cache import cache_dir, write_atomically

IDX_TYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {dt.newbyteorder("=").str if dt.itemsize > 1 else dt.str: code for code, dt in IDX_TYPES.items()}


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file (gzip-compressed when ``path`` ends in ``.gz``).

    Args:
        path: the file to write.
        array: uint8, int8, int16, int32, float32 or float64 data, at least 1-D.
    """
    array = np.asarray(array)
    key = array.dtype.newbyteorder("=").str if array.dtype.itemsize > 1 else array.dtype.str
    if key not in _IDX_CODES:
        raise ValueError(f"IDX cannot hold dtype {array.dtype} (uint8, int8, int16, int32, float32, float64)")
    if array.ndim < 1 or array.ndim > 255:
        raise ValueError(f"IDX needs 1..255 dimensions, got {array.ndim}")
    code = _IDX_CODES[key]
    head = struct.pack(">HBB", 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    body = np.ascontiguousarray(array, dtype=IDX_TYPES[code]).tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(head + body)


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file: memory-mapped, or into memory when it ends in ``.gz``. A ``.gz`` file is
    decompressed once into the user cache (``cache_dir("idx")``, keyed by the file's path, size and
    mtime) and later reads load that copy instead: Debian's Fashion-MNIST training images took
    0.3-0.4 s to decompress on every run (H100 host), and a read of the copy takes milliseconds.

    Args:
        path: the file.

    Returns:
        The array (big-endian dtypes as stored; values are exact).

    Raises:
        LoaderError: bad magic number, unknown type code, or a size that does not match the header.
    """
    where = str(path)
    if not where.endswith(".gz"):
        return _map_idx(where, where)
    try:
        stat = os.stat(where)
    except OSError as exc:
        raise LoaderError(where, f"cannot read IDX file ({exc})") from exc
    absolute = os.path.abspath(where)
    group = hashlib.sha256(absolute.encode()).hexdigest()[:16]
    stamp = hashlib.sha256(f"{absolute}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    try:
        copy = cache_dir("idx") / f"{group}-{stamp}.idx"
        raw = copy.read_bytes()
        os.utime(copy)  # used now: the last copy to go when the cache is trimmed
        return _idx_in_memory(raw, where)
    except FileNotFoundError:
        pass
    except NotADirectoryError as exc:  # the cache's root is a file: read the data, keep no copy
        logger.warning("cannot keep a decompressed copy of %s (%s)", where, exc)
        return _idx_in_memory(_gunzip(where), where)
    except (LoaderError, OSError):  # a damaged copy (or no cache folder): made again from the file
        with contextlib.suppress(OSError):
            copy.unlink()
    raw = _gunzip(where)
    array = _idx_in_memory(raw, where)  # a bad file is named here, and never kept
    try:
        write_atomically(copy, raw)
        _trim_copies(copy, group)
    except OSError as exc:
        logger.warning("cannot keep a decompressed copy of %s in %s (%s)", where, copy, exc)
    return array


def _gunzip(where: str) -> bytes:
    try:
        with gzip.open(where, "rb") as f:
            return f.read()
    except (OSError, EOFError) as exc:
        raise LoaderError(where, f"cannot read IDX file ({exc})") from exc


# The most the decompressed copies may take together; the least recently used go first.
IDX_CACHE_BYTES = 4 << 30


def _trim_copies(kept: Path, group: str) -> None:
    """Remove the copies of the same file from before it changed, then the least recently used
    others while all of them take more than IDX_CACHE_BYTES (a file decompressed from a temporary
    folder would otherwise stay forever)."""
    copies = []
    for other in kept.parent.glob("*.idx"):
        if other != kept and other.name.startswith(f"{group}-"):
            other.unlink(missing_ok=True)
        elif other != kept:
            try:
                stat = other.stat()
            except FileNotFoundError:  # another run trimmed it meanwhile
                continue
            copies.append((stat.st_mtime, stat.st_size, other))
    total = kept.stat().st_size + sum(size for _, size, _ in copies)
    for _, size, other in sorted(copies):
        if total <= IDX_CACHE_BYTES:
            break
        other.unlink(missing_ok=True)
        total -= size


# The most an IDX header can hold: 4 bytes, then 4 for each of up to 255 dimensions.
_IDX_PREFIX = 4 + 4 * 255


def _idx_layout(prefix: bytes, size: int, where: str) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, dims, data offset) of an IDX file of ``size`` bytes that begins with ``prefix``.

    Raises:
        LoaderError: naming ``where``: bad magic number, unknown type code, a truncated header, or a
            size that does not match the header.
    """
    head = prefix[:4]
    if len(head) < 4 or head[0] != 0 or head[1] != 0:
        raise LoaderError(where, f"not an IDX file (magic bytes {head.hex() or 'missing'})")
    code, ndim = head[2], head[3]
    if code not in IDX_TYPES:
        raise LoaderError(where, f"unknown IDX type code 0x{code:02x}")
    offset = 4 + 4 * ndim
    dims_raw = prefix[4:offset]
    if len(dims_raw) < 4 * ndim:
        raise LoaderError(where, f"truncated header: {ndim} dimensions announced")
    dims = struct.unpack(f">{ndim}I", dims_raw)
    dtype = IDX_TYPES[code]
    expected = offset + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if size != expected:
        raise LoaderError(where, f"size {size} bytes, but the header {dims} of {dtype} needs {expected}")
    return dtype, dims, offset


def _idx_in_memory(raw: bytes, where: str) -> np.ndarray:
    """The array of an IDX file's bytes ``raw`` (read-only); errors name ``where``."""
    dtype, dims, offset = _idx_layout(raw[:_IDX_PREFIX], len(raw), where)
    return np.frombuffer(raw, dtype=dtype, offset=offset).reshape(dims)


def _map_idx(path: str, where: str) -> np.ndarray:
    """The uncompressed IDX file ``path`` memory-mapped; errors name ``where`` (the user's file)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(_IDX_PREFIX)
    except OSError as exc:
        raise LoaderError(where, f"cannot read IDX file ({exc})") from exc
    dtype, dims, offset = _idx_layout(prefix, size, where)
    if size == offset:
        return np.empty(dims, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=dims)


class _ArraySource:
    """A source over an array-like of records (memmap or array) and a label array."""

    def __init__(
        self, where: str, records: np.ndarray, labels: np.ndarray, scale: float, policy: ErrorPolicy
    ) -> None:
        self.path = where
        self._records = records
        # An array in RAM (a decompressed .gz IDX file) is read by a gather: the loader keeps those
        # reads on its event loop (see actors.loader). A memory map is not declared in memory:
        # a record not in the page cache yet is a wait on the disk, and the loader's measurement
        # (which catches reads that wait) decides for it; once cached its reads measure as cheap.
        self.in_memory = not isinstance(records, np.memmap)
        self._scale = np.float32(scale)
        self._policy = policy
        self._stats = StatsRecorder()
        self.sample_shape: tuple[int, ...] = tuple(int(d) for d in records.shape[1:])
        if labels.dtype.kind in "iu":
            labels = labels.astype(np.int32)
            if labels.size and labels.min() < -1:
                raise LoaderError(where, f"negative class label {labels.min()}")
            self.num_classes: int | None = (
                int(labels.max()) + 1 if labels.size and labels.max() >= 0 else None
            )
        else:
            labels = labels.astype(np.float32)
            self.num_classes = None
        self.labels = readonly(labels)
        self.label_dtype = self.labels.dtype

    def __len__(self) -> int:
        return int(self._records.shape[0])

    def __enter__(self) -> _ArraySource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the mapping (the file closes when the last view of it goes)."""
        self._records = self._records[:0]

    def statistics(self) -> SourceStatistics:
        """Frozen counters.

        Returns:
            The statistics so far.
        """
        policy = self._policy
        return self._stats.snapshot(policy.skipped, policy.items, policy.examples)

    def read(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """Copy records out as float32.

        Args:
            indices: record indices, any order, repeats allowed.

        Returns:
            (x float32 [n, *sample_shape], y [n], skipped); a record with NaN or infinity is a bad
            item (it would poison training).

        Raises:
            LoaderError: under ``on_error="raise"``, for the first non-finite record.
        """
        idx = check_indices(indices, len(self), self.path)
        t0 = time.perf_counter()
        raw = self._records[idx]
        return self.decode(idx, raw, raw.nbytes, t0)

    @property
    def record_bytes(self) -> int:
        """Bytes of one stored record (the block order's unit: loaders.blocks)."""
        return int(self._records.dtype.itemsize * np.prod(self.sample_shape, dtype=np.int64))

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Records ``start:stop`` as stored, copied into RAM by one sequential read."""
        rows = np.array(self._records[start:stop])
        self._stats.add(bytes_read=rows.nbytes)
        return rows

    def decode(
        self, idx: np.ndarray, raw: np.ndarray, bytes_read: int = 0, t0: float | None = None
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """``read``'s result from records ``idx`` fetched as stored (``raw``, ``bytes_read`` bytes
        taken from storage, from ``t0``)."""
        t0 = time.perf_counter() if t0 is None else t0
        x = raw.astype(np.float32)
        if self._scale != 1:
            x *= self._scale
        ok = np.isfinite(x.reshape(len(idx), -1)).all(axis=1)
        self._stats.add(bytes_read=bytes_read, seconds=time.perf_counter() - t0)
        for pos in np.flatnonzero(~ok).tolist():
            self._policy.handle(
                LoaderError(f"{self.path}: record {int(idx[pos])}", "contains NaN or infinity")
            )
        skipped = int(idx.size - ok.sum())
        if skipped:
            x, idx = x[ok], idx[ok]
        self._stats.add(samples=int(idx.size))
        return x, self.labels[idx], skipped


    @property
    def stored_dtype(self) -> str | None:
        """What :meth:`stored` gives: "uint8" for 8-bit records, "float32" for others; None where
        the labels are not class ids."""
        if self.num_classes is None:
            return None
        return "uint8" if self._records.dtype == np.uint8 else "float32"

    def stored(self) -> StoredData | None:
        """The records as stored, for keeping on a device (see loaders.source.StoredData): uint8
        stays uint8, anything else becomes float32. None where a record holds NaN or infinity
        (those must go through ``read``, which applies the on_error policy to each) or where the
        labels are not class ids.

        Returns:
            The data, or None.
        """
        if self.num_classes is None:
            return None
        records = np.asarray(self._records)
        if records.dtype != np.uint8:
            records = records.astype(np.float32)
            if not np.isfinite(records).all():
                return None
        return StoredData(np.ascontiguousarray(records), np.asarray(self.labels), float(self._scale))


class RawBinarySource(_ArraySource):
    """Raw fixed-size records through ``np.memmap``: uint8 values are scaled to [0, 1] (/ 255), as
    IDX and image files are; other dtypes are cast to float32 unscaled.

    Args:
        path: the records file.
        dtype: numpy dtype of one value (e.g. "uint8", "<f4").
        shape: shape of one record.
        labels_path: a raw file (or ``.npy``) of one label per record; None = unlabelled (labels
            are -1 and num_classes is None).
        label_dtype: dtype of the raw labels file.
        on_error: "raise" or "skip". A file whose size is not a whole number of records is bad
            input: raised, or under "skip" the partial record at the end is left out and counted.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        dtype: str | np.dtype,
        shape: Sequence[int],
        labels_path: str | os.PathLike | None = None,
        label_dtype: str | np.dtype = "int32",
        on_error: str = "raise",
    ) -> None:
        where = str(path)
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        record = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if record <= 0:
            raise ValueError(f"record shape {shape} of {dtype} has no bytes")
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            raise LoaderError(where, f"cannot open ({exc.strerror or exc})") from exc
        n, rest = divmod(size, record)
        policy = ErrorPolicy(on_error, where)
        if rest:
            policy.handle(
                LoaderError(
                    where, f"size {size} is not a whole number of {record}-byte records ({rest} bytes over)"
                )
            )
        records = (
            np.memmap(path, dtype=dtype, mode="r", shape=(n, *shape)) if n else np.empty((0, *shape), dtype)
        )
        if labels_path is None:
            labels = np.full(n, -1, dtype=np.int32)
        else:
            labels = _load_labels(labels_path, np.dtype(label_dtype))
            if labels.shape != (n,):
                raise LoaderError(str(labels_path), f"{labels.size} labels for {n} records in {where}")
        super().__init__(where, records, labels, 1.0 / 255.0 if dtype == np.uint8 else 1.0, policy)


def _load_labels(path: str | os.PathLike, dtype: np.dtype) -> np.ndarray:
    try:
        if str(path).endswith(".npy"):
            return np.load(path, mmap_mode="r").reshape(-1)
        return np.fromfile(path, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise LoaderError(str(path), f"cannot read labels ({exc})") from exc


class IDXSource(_ArraySource):
    """An IDX images file and an IDX labels file (MNIST layout).

    3-D images (n, h, w) become (n, 1, h, w) samples, CHW like the image folder; uint8 pixels are
    scaled to [0, 1] like decoded images; other dtypes are cast unscaled.

    Args:
        images: IDX file of the samples (n, ...).
        labels: IDX file of n labels.
        on_error: "raise" or "skip".
    """

    def __init__(self, images: str | os.PathLike, labels: str | os.PathLike, on_error: str = "raise") -> None:
        x = read_idx(images)
        y = read_idx(labels)
        if y.ndim != 1 or y.shape[0] != x.shape[0]:
            raise LoaderError(str(labels), f"labels of shape {y.shape} for {x.shape[0]} samples in {images}")
        if x.ndim == 3:
            x = x.reshape(x.shape[0], 1, *x.shape[1:])
        scale = 1.0 / 255.0 if x.dtype == np.uint8 else 1.0
        super().__init__(str(images), x, np.asarray(y), scale, ErrorPolicy(on_error, str(images)))

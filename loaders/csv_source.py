"""A source over a CSV file: random access to rows through a byte-offset index, parsed in chunks.

Opening makes one streaming pass (:mod:`loaders.csv_index`); the file is never held whole. ``read``
sorts the wanted rows, reads each run of neighbouring rows with one seek, and parses ``chunk_rows``
rows at a time: numpy's C ``loadtxt`` on the common case (no quotes, right column count, all
numbers), and the csv module row by row only to find out what is wrong with a chunk that failed,
so that the error names the row, column and value.
"""

from __future__ import annotations

import csv
import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from loaders.csv_index import resolve_column, scan_csv, split_row
from loaders.errors import ErrorPolicy, LoaderError
from loaders.source import SourceStatistics, StatsRecorder, check_indices, readonly


class CSVSource:
    """Rows of a CSV file as float32 feature vectors plus a label.

    Args:
        path: the CSV file (UTF-8, comma-separated, RFC 4180 quotes).
        label_column: name (needs ``header``) or index of the label column.
        feature_columns: names or indices of the features, in this order; None = every column
            but the label.
        header: whether the first record names the columns.
        chunk_rows: rows parsed at a time; bounds the memory a read needs beyond its output.
        on_error: "raise" or "skip" (see :mod:`loaders.errors`).
        task: "classification", "regression" or None to infer from the first label (an integer is
            a class id, another number a regression target, other text a class name).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        label_column: str | int,
        feature_columns: Sequence[str | int] | None = None,
        header: bool = True,
        chunk_rows: int = 4096,
        on_error: str = "raise",
        task: str | None = None,
    ) -> None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        if task not in (None, "classification", "regression"):
            raise ValueError(f"task must be 'classification', 'regression' or None, got {task!r}")
        self.path = str(path)
        self.chunk_rows = int(chunk_rows)
        self._policy = ErrorPolicy(on_error, self.path)
        self._stats = StatsRecorder()
        t0 = time.perf_counter()
        index = scan_csv(self.path, header, label_column, task, self._policy)
        self._stats.add(bytes_read=os.path.getsize(self.path), seconds=time.perf_counter() - t0)
        self._starts = index.starts
        self._lengths = index.lengths
        self.columns = index.columns
        self.label_col = index.label_col
        if feature_columns is None:
            self.feature_cols = [j for j in range(len(self.columns)) if j != self.label_col]
        else:
            self.feature_cols = [resolve_column(c, self.columns, header, self.path) for c in feature_columns]
        if not self.feature_cols:
            raise LoaderError(self.path, "no feature columns")
        self.classes = index.classes
        self.labels = readonly(index.labels)
        self.label_dtype = self.labels.dtype
        if index.kind == "float":
            self.num_classes: int | None = None
        else:
            self.num_classes = len(self.classes) if self.classes is not None else int(self.labels.max()) + 1
        self.sample_shape: tuple[int, ...] = (len(self.feature_cols),)
        self._file = open(self.path, "rb")
        self._file_lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._starts.size)

    def __enter__(self) -> CSVSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def statistics(self) -> SourceStatistics:
        """Frozen counters (bytes_read includes the indexing pass at open).

        Returns:
            The statistics so far.
        """
        policy = self._policy
        return self._stats.snapshot(policy.skipped, policy.items, policy.examples)

    def _line_of(self, row: int) -> int:
        """1-based line number of a row: counts newlines up to it (only done for error messages)."""
        end = int(self._starts[row])
        count, pos = 0, 0
        with open(self.path, "rb") as f:
            while pos < end:
                block = f.read(min(1 << 20, end - pos))
                if not block:
                    break
                count += block.count(b"\n")
                pos += len(block)
        return count + 1

    def _fetch(self, rows: np.ndarray) -> list[bytes]:
        """Bytes of sorted ``rows``; one seek and read per run of consecutive rows."""
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        out: list[bytes] = []
        nbytes = 0
        with self._file_lock:
            for run in np.split(rows, breaks):
                s0 = int(self._starts[run[0]])
                end = int(self._starts[run[-1]]) + int(self._lengths[run[-1]])
                self._file.seek(s0)
                data = self._file.read(end - s0)
                nbytes += len(data)
                for s, n in zip((self._starts[run] - s0).tolist(), self._lengths[run].tolist(), strict=True):
                    out.append(data[s : s + n])
        self._stats.add(bytes_read=nbytes)
        return out

    def _fast_parse(self, lines: list[bytes]) -> np.ndarray | None:
        """numpy's C parser for a clean chunk; None when anything looks off."""
        text = b"\n".join(lines)
        if b'"' in text:
            return None
        # loadtxt with usecols ignores extra columns, so count the commas of every row here.
        commas = len(self.columns) - 1
        if any(line.count(b",") != commas for line in lines):
            return None
        try:
            x = np.loadtxt(
                text.decode("utf-8").split("\n"),
                delimiter=",",
                usecols=self.feature_cols,
                dtype=np.float32,
                comments=None,
                ndmin=2,
            )
        except (ValueError, UnicodeDecodeError):
            return None
        return x if np.isfinite(x).all() else None

    def _row_error(self, line: bytes) -> tuple[str, np.ndarray | None]:
        """Parse one row carefully: (why it is bad, None) or ("", its features)."""
        try:
            fields = split_row(line)
        except (UnicodeDecodeError, csv.Error) as exc:
            return f"cannot parse row ({exc})", None
        if len(fields) != len(self.columns):
            return f"expected {len(self.columns)} columns, got {len(fields)}", None
        values = np.empty(len(self.feature_cols), dtype=np.float32)
        for k, j in enumerate(self.feature_cols):
            token = fields[j].strip()
            try:
                values[k] = float(token)
            except ValueError:
                return f"column {self.columns[j]!r}: cannot parse {token!r} as a number", None
            if not np.isfinite(values[k]):
                return f"column {self.columns[j]!r}: value {token!r} is not finite", None
        return "", values

    def _parse(self, lines: list[bytes], x: np.ndarray, ok: np.ndarray) -> dict[int, str]:
        """Fill ``x`` and ``ok`` for a chunk; returns {position: why} for bad rows."""
        fast = self._fast_parse(lines)
        if fast is not None:
            x[:] = fast
            ok[:] = True
            return {}
        bad: dict[int, str] = {}
        for k, line in enumerate(lines):
            why, values = self._row_error(line)
            if values is None:
                bad[k] = why
            else:
                x[k] = values
                ok[k] = True
        return bad

    def read(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """Parse rows.

        Args:
            indices: row indices (0-based data rows), any order, repeats allowed.

        Returns:
            (x float32 [n, features], y [n], skipped); n < len(indices) only when bad rows were
            skipped under ``on_error="skip"``.

        Raises:
            LoaderError: under ``on_error="raise"``, for the first bad row in ``indices`` order,
                naming its row, line, column and value.
        """
        idx = check_indices(indices, len(self), self.path)
        rows, inverse = np.unique(idx, return_inverse=True)
        xu = np.empty((rows.size, len(self.feature_cols)), dtype=np.float32)
        oku = np.zeros(rows.size, dtype=bool)
        why: dict[int, str] = {}
        t_parse = 0.0
        for lo in range(0, rows.size, self.chunk_rows):
            hi = min(lo + self.chunk_rows, rows.size)
            lines = self._fetch(rows[lo:hi])
            t0 = time.perf_counter()
            bad = self._parse(lines, xu[lo:hi], oku[lo:hi])
            t_parse += time.perf_counter() - t0
            why.update({lo + k: w for k, w in bad.items()})
        self._stats.add(seconds=t_parse)
        ok = oku[inverse]
        skipped = int(idx.size - ok.sum())
        for pos in np.flatnonzero(~ok).tolist():
            row = int(idx[pos])
            # Counting lines costs a pass over the file: only for a message someone will read.
            first = self._policy.on_error == "raise" or self._policy.skipped == 0
            where = (
                f"{self.path}: row {row} (line {self._line_of(row)})" if first else f"{self.path}: row {row}"
            )
            self._policy.handle(LoaderError(where, why[int(inverse[pos])]), item=f"{self.path}: row {row}")
        x, y = xu[inverse[ok]], self.labels[idx[ok]]
        self._stats.add(samples=int(x.shape[0]))
        return x, y, skipped

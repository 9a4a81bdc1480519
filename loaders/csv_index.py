"""One streaming pass over a CSV file: the byte offset of every record, the header and the labels.

The file is read in fixed-size blocks, so memory stays bounded by the index itself (16 bytes per
row: an int64 start, a uint32 length and a 4-byte label) plus a few blocks, whatever the file's
size. Record
boundaries are the newlines outside quotes (RFC 4180 quoting; a newline inside a quoted field does
not end the record), found with numpy rather than per byte in Python. Blank lines are dropped. The
label column is parsed in the same pass, because the runtime needs all labels up front.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loaders.errors import ErrorPolicy, LoaderError

BLOCK_BYTES = 1 << 18
_BOM = b"\xef\xbb\xbf"
_INT32_MAX = 2**31 - 1


class _Growable:
    """A numpy array appended to in place: no list of parts to concatenate, so no second copy."""

    def __init__(self, dtype: type, capacity: int) -> None:
        self._data = np.empty(max(capacity, 1024), dtype=dtype)
        self._n = 0

    @property
    def dtype(self) -> np.dtype:
        return self._data.dtype

    def extend(self, values: np.ndarray) -> None:
        need = self._n + values.size
        if need > self._data.size:
            self._data.resize(max(need, int(self._data.size * 1.5)), refcheck=False)
        self._data[self._n : need] = values
        self._n = need

    def finish(self) -> np.ndarray:
        """The filled part; shrinking in place (realloc) rather than copying."""
        self._data.resize(self._n, refcheck=False)
        return self._data


# A quoted field left open would otherwise make the rest of the file one record held in memory.
MAX_RECORD_BYTES = 16 << 20


@dataclass
class CSVIndex:
    """The result of :func:`scan_csv`.

    Attributes:
        starts: int64 byte offset of each data row.
        lengths: uint32 byte length of each row, without its newline.
        columns: column names (from the header, or "column 0".. without one).
        label_col: index of the label column.
        labels: int32 class ids or float32 targets, one per row.
        classes: class names when labels were strings, else None.
        kind: "int", "float" or "names": how labels were parsed.
        skipped: rows left out for a bad label (under on_error="skip").
    """

    starts: np.ndarray
    lengths: np.ndarray
    columns: list[str]
    label_col: int
    labels: np.ndarray
    classes: list[str] | None
    kind: str
    skipped: int


def resolve_column(spec: str | int, columns: Sequence[str], has_header: bool, where: str) -> int:
    """Column index for a name or (possibly negative) index.

    Args:
        spec: column name (needs a header) or index.
        columns: the column names.
        has_header: whether names came from a header.
        where: the file, for errors.

    Returns:
        A non-negative column index.
    """
    if isinstance(spec, str):
        if not has_header:
            raise LoaderError(where, f"column {spec!r} named but the file has no header (header=False)")
        if spec not in columns:
            raise LoaderError(where, f"no column {spec!r} in header {list(columns)}")
        return list(columns).index(spec)
    j = int(spec)
    if not -len(columns) <= j < len(columns):
        raise LoaderError(where, f"column index {j} out of range for {len(columns)} columns")
    return j % len(columns)


def split_row(line: bytes) -> list[str]:
    """Parse one record into fields with the csv module (quotes, embedded commas and newlines).

    Args:
        line: the record's bytes without its final newline.

    Returns:
        The fields.

    Raises:
        UnicodeDecodeError, csv.Error: the record is not valid UTF-8 CSV.
    """
    row = next(csv.reader(io.StringIO(line.decode("utf-8"), newline=""), strict=True), None)
    return row if row is not None else [""]


class _LabelParser:
    """Turns label tokens into ids or targets; the first token decides the kind unless task says."""

    def __init__(self, task: str | None) -> None:
        self.task = task
        self.kind: str | None = {"regression": "float"}.get(task or "")
        self.names: dict[str, int] = {}

    def _decide(self, token: str) -> None:
        try:
            int(token)
            self.kind = "int"
            return
        except ValueError:
            pass
        if self.task != "classification":
            try:
                float(token)
                self.kind = "float"
                return
            except ValueError:
                pass
        self.kind = "names"

    def parse(self, token: str) -> float | int:
        """One label; raises ValueError with the reason."""
        token = token.strip()
        if not token:
            raise ValueError("empty label")
        if self.kind is None:
            self._decide(token)
        if self.kind == "int":
            value = int(token)
            if value < 0:
                raise ValueError("negative class label")
            if value > _INT32_MAX:
                raise ValueError("class label too large")
            return value
        if self.kind == "float":
            value = float(token)
            if not np.isfinite(value):
                raise ValueError("label is not finite")
            return value
        return self.names.setdefault(token, len(self.names))


def _line_no(buf: bytes, rel: int, lines_before: int) -> int:
    return lines_before + buf.count(b"\n", 0, rel) + 1


def scan_csv(
    path: str,
    header: bool,
    label_column: str | int,
    task: str | None,
    policy: ErrorPolicy,
) -> CSVIndex:
    """Index a CSV file in one streaming pass (see the module docstring).

    Args:
        path: the CSV file.
        header: whether the first record names the columns.
        label_column: name or index of the label column.
        task: "classification", "regression" or None to infer from the first label (an integer
            means class ids, another number a regression target, anything else a class name).
        policy: what to do with a row whose label is bad.

    Returns:
        The index.
    """
    parser = _LabelParser(task)
    try:
        # A first guess of 32 bytes a row; capacity never written costs address space, not memory.
        guess = os.path.getsize(path) // 32
    except OSError as exc:
        raise LoaderError(path, f"cannot open ({exc.strerror or exc})") from exc
    all_starts = _Growable(np.int64, guess)
    all_lengths = _Growable(np.uint32, guess)
    all_labels: _Growable | None = None
    columns: list[str] | None = None
    label_col = -1
    skipped = 0
    carry = b""
    carry_base = 0
    lines_before = 0
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise LoaderError(path, f"cannot open ({exc.strerror or exc})") from exc
    with f:
        while True:
            block = f.read(BLOCK_BYTES)
            eof = not block
            buf = carry + block
            if not buf:
                break
            arr = np.frombuffer(buf, dtype=np.uint8)
            ends = np.flatnonzero(arr == 10)
            if b'"' in buf:
                # Each buffer starts on a record boundary, so quote parity starts even.
                parity = np.cumsum(arr == 34, dtype=np.int32) & 1
                ends = ends[parity[ends] == 0]
            if eof and (ends.size == 0 or ends[-1] != len(buf) - 1):
                ends = np.append(ends, len(buf))  # a last record with no final newline
            if ends.size == 0:
                if len(buf) > MAX_RECORD_BYTES:
                    raise LoaderError(
                        f"{path}: line {lines_before + 1}",
                        f"record longer than {MAX_RECORD_BYTES} bytes (unterminated quote?)",
                    )
                carry = buf
                continue
            consumed = int(ends[-1]) + 1
            starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64)
            lengths = ends - starts
            # Strip a CR of CRLF line ends, then drop blank lines.
            has_cr = (lengths > 0) & (arr[np.maximum(ends - 1, 0)] == 13)
            lengths = lengths - has_cr
            keep = lengths > 0
            starts, lengths = starts[keep], lengths[keep]
            if carry_base == 0 and starts.size and starts[0] == 0 and buf.startswith(_BOM):
                starts[0] += len(_BOM)
                lengths[0] -= len(_BOM)
            if columns is None and starts.size:
                first = buf[starts[0] : starts[0] + lengths[0]]
                try:
                    fields = split_row(first)
                except (UnicodeDecodeError, csv.Error) as exc:
                    raise LoaderError(
                        f"{path}: line {_line_no(buf, int(starts[0]), lines_before)}", str(exc)
                    ) from exc
                if header:
                    columns = [c.strip() for c in fields]
                    starts, lengths = starts[1:], lengths[1:]
                else:
                    columns = [f"column {j}" for j in range(len(fields))]
                label_col = resolve_column(label_column, columns, header, path)
            good = np.ones(starts.size, dtype=bool)
            values = []
            quoted = b'"' in buf
            for k, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
                line = buf[s : s + n]
                try:
                    if quoted:
                        token = split_row(line)[label_col]
                    else:
                        token = line.split(b",", label_col + 1)[label_col].decode("utf-8")
                    values.append(parser.parse(token))
                except (ValueError, IndexError, csv.Error) as exc:
                    if isinstance(exc, IndexError):
                        why = f"too few columns to hold the label column {columns[label_col]!r}"
                    elif isinstance(exc, csv.Error | UnicodeDecodeError):
                        why = f"cannot parse row ({exc})"
                    else:
                        why = f"column {columns[label_col]!r}: bad label {token.strip()!r} ({exc})"
                    skipped += 1
                    good[k] = False
                    policy.handle(LoaderError(f"{path}: line {_line_no(buf, s, lines_before)}", why))
            if values:
                if all_labels is None:
                    all_labels = _Growable(np.float32 if parser.kind == "float" else np.int32, guess)
                all_starts.extend(starts[good] + carry_base)
                all_lengths.extend(lengths[good])
                all_labels.extend(np.asarray(values, dtype=all_labels.dtype))
            lines_before += buf.count(b"\n", 0, consumed)
            carry = buf[consumed:]
            carry_base += consumed
            if eof:
                break
    if columns is None:
        raise LoaderError(path, "empty file: no header and no data rows")
    if all_labels is None:
        if skipped:
            raise LoaderError(path, f"no data rows left: all {skipped} had a bad label and were skipped")
        raise LoaderError(path, "no data rows under the header" if header else "no data rows")
    labels = all_labels.finish()
    classes = None
    if parser.kind == "names":
        classes = sorted(parser.names)
        # Ids were handed out in first-seen order; renumber so that ids follow sorted names.
        remap = np.empty(len(classes), dtype=np.int32)
        for new, name in enumerate(classes):
            remap[parser.names[name]] = new
        labels = remap[labels]
    return CSVIndex(
        starts=all_starts.finish(),
        lengths=all_lengths.finish(),
        columns=columns,
        label_col=label_col,
        labels=labels,
        classes=classes,
        kind=parser.kind or "int",
        skipped=skipped,
    )

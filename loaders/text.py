"""A UTF-8 text file for language models: the file as token ids, cut into context windows.

Level "byte": the ids are the file's bytes, the vocabulary the 256 byte values
(``bytes(range(256))``), whatever the file holds. Level "char": the ids are its characters, the
vocabulary the file's distinct characters sorted by code point (a str; id i is ``vocabulary[i]``),
so one file always gives the same ids. :func:`encode` and :func:`decode` map text and ids through
either kind of vocabulary, for generation.

Sample i is the window that starts at token ``i * stride``: x is ``ids[start : start + context]``
as float32 (what an Embedding takes), y is ``ids[start + 1 : start + context + 1]`` as int32
class ids, the next token at every position. Both are views of one int32 id array (4 bytes a
token), never copied: ``labels`` is a read-only (n, context) view, so even stride 1 costs nothing
more than the ids.

Neighbouring windows share tokens, so a shuffled split would put the same text in training and
validation. The source says so with ``split_gap`` (flow.data_plan reads it): its splits are then
contiguous runs in file order (train first, then val, then test: loaders.splits.split_contiguous),
and the ``context // stride`` windows before each boundary, which reach across it, are left out.
"""

from __future__ import annotations

import os
import sysconfig
import time
from collections.abc import Sequence

import numpy as np

from loaders.errors import LoaderError
from loaders.source import SourceStatistics, StatsRecorder, check_indices, readonly

BYTES = bytes(range(256))
Vocabulary = str | bytes

# The vocabulary each path was last opened with, so that a checkpoint saves the one the run trains
# on without reading the file again (see opened_vocabulary).
_opened: dict[tuple[str, str], Vocabulary] = {}


# A path of this form names a file of the standard library, which every Python has: the bundled
# English that the examples and tests train on (``stdlib:pydoc_data/topics.py``) wherever Python lives.
STDLIB = "stdlib:"


def resolve(path: str | os.PathLike) -> str | os.PathLike:
    """The file a Text path names: ``stdlib:<relative path>`` inside the standard library,
    anything else as it is."""
    if isinstance(path, str) and path.startswith(STDLIB):
        return os.path.join(sysconfig.get_paths()["stdlib"], path.removeprefix(STDLIB))
    return path


def read_ids(path: str | os.PathLike, level: str = "char") -> tuple[np.ndarray, Vocabulary]:
    """A text file's token ids and its vocabulary.

    Args:
        path: a UTF-8 file (any bytes at level "byte").
        level: "char" or "byte".

    Returns:
        (ids int32 [tokens], vocabulary: a str at level "char", ``BYTES`` at level "byte").

    Raises:
        LoaderError: naming the file: missing or unreadable, empty, or (level "char") not UTF-8,
            with the offset of the first bad byte.
    """
    where = str(path)
    if level not in ("char", "byte"):
        raise ValueError(f"level must be 'char' or 'byte', got {level!r}")
    try:
        with open(resolve(path), "rb") as file:
            data = file.read()
    except OSError as error:
        raise LoaderError(where, f"cannot read text file ({error.strerror or error})") from error
    if not data:
        raise LoaderError(where, "the text file is empty")
    if level == "byte":
        return np.frombuffer(data, np.uint8).astype(np.int32), BYTES
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise LoaderError(
            where,
            f"not UTF-8: byte 0x{data[error.start]:02x} at offset {error.start} ({error.reason}); "
            "fix the file, or use level='byte'",
        ) from error
    # Code points through numpy: np.unique sorts them and numbers each character by its rank.
    points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    distinct, ids = np.unique(points, return_inverse=True)
    return ids.astype(np.int32).reshape(-1), "".join(map(chr, distinct.tolist()))


def vocabulary(path: str | os.PathLike, level: str = "char") -> Vocabulary:
    """The vocabulary a text file gives at ``level`` (see the module docstring).

    Args:
        path: the file.
        level: "char" or "byte".

    Returns:
        The sorted distinct characters (a str) for "char"; ``BYTES`` for "byte".
    """
    return BYTES if level == "byte" else read_ids(path, level)[1]


def opened_vocabulary(path: str | os.PathLike, level: str = "char") -> Vocabulary:
    """The vocabulary this process last opened ``path`` at ``level`` with (what a run trains on,
    even if the file has changed since), else :func:`vocabulary`'s.

    Args:
        path: the file.
        level: "char" or "byte".

    Returns:
        The vocabulary.
    """
    found = _opened.get((os.path.abspath(path), level))
    return found if found is not None else vocabulary(path, level)


def encode(text: str, vocab: Vocabulary) -> np.ndarray:
    """Text as token ids.

    Args:
        text: the text.
        vocab: a vocabulary from :func:`vocabulary` (bytes: UTF-8 bytes are the ids).

    Returns:
        int32 ids [tokens].

    Raises:
        ValueError: a character the vocabulary lacks, named.
    """
    if isinstance(vocab, bytes):
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    index = {c: i for i, c in enumerate(vocab)}
    missing = sorted(set(text) - index.keys())
    if missing:
        raise ValueError(f"characters not in the vocabulary: {''.join(missing)!r}")
    return np.fromiter((index[c] for c in text), np.int32, len(text))


def decode(ids: Sequence[int] | np.ndarray, vocab: Vocabulary) -> str:
    """Token ids as text.

    Args:
        ids: ids in ``range(len(vocab))`` (floats allowed: inputs are float32 ids).
        vocab: a vocabulary from :func:`vocabulary`.

    Returns:
        The text; at level "byte", bytes that are not UTF-8 (a cut character) become U+FFFD.
    """
    ids = np.asarray(ids).astype(np.int64).reshape(-1)
    if isinstance(vocab, bytes):
        return bytes(ids.astype(np.uint8)).decode("utf-8", errors="replace")
    return "".join(vocab[i] for i in ids.tolist())


class TextSource:
    """A text file as context windows (see the module docstring).

    Args:
        path: the file.
        level: "char" or "byte".
        context: tokens a window, >= 1.
        stride: tokens between two windows' starts, >= 1.

    Attributes:
        vocabulary: the vocabulary (a str at level "char", ``BYTES`` at "byte").
        num_classes: its size: what the model's last layer must output per token.
        split_gap: windows left out before each split boundary (``context // stride``); its
            presence makes splits contiguous (flow.data_plan).
    """

    in_memory = True  # a read is a gather from RAM: the loader keeps it on its event loop

    def __init__(
        self, path: str | os.PathLike, level: str = "char", context: int = 128, stride: int = 1
    ) -> None:
        if context < 1 or stride < 1:
            raise ValueError(f"context and stride must be >= 1, got {context}, {stride}")
        self.path = str(path)
        t0 = time.perf_counter()
        ids, self.vocabulary = read_ids(path, level)
        if ids.size < context + 1:
            raise LoaderError(
                self.path,
                f"{ids.size} tokens at level {level!r}: too short for one window of context {context} "
                f"(needs context + 1 = {context + 1})",
            )
        _opened[(os.path.abspath(path), level)] = self.vocabulary
        window = np.lib.stride_tricks.sliding_window_view
        self._x = readonly(window(ids[:-1], context)[::stride])
        self.labels = readonly(window(ids[1:], context)[::stride])
        self.sample_shape: tuple[int, ...] = (int(context),)
        self.label_dtype = self.labels.dtype
        self.num_classes: int | None = len(self.vocabulary)
        self.split_gap = context // stride
        self._stats = StatsRecorder()
        self._stats.add(bytes_read=os.path.getsize(resolve(path)), seconds=time.perf_counter() - t0)

    def __len__(self) -> int:
        return int(self._x.shape[0])

    def read(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """Windows by index.

        Args:
            indices: window indices, any order, repeats allowed.

        Returns:
            (x float32 [n, context] ids, y int32 [n, context] next-token ids, 0).
        """
        idx = check_indices(indices, len(self), self.path)
        x = self._x[idx].astype(np.float32)
        self._stats.add(samples=int(idx.size))
        return x, self.labels[idx], 0

    def statistics(self) -> SourceStatistics:
        """Frozen counters.

        Returns:
            The statistics so far.
        """
        return self._stats.snapshot(0)

    def close(self) -> None:
        """Nothing to release: the ids are an array in RAM."""

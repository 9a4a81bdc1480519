"""Errors and the bad-input policy shared by every source.

A source meets bad input (a corrupt image, a CSV row that does not parse) in one of two ways,
chosen by ``on_error``: ``"raise"`` stops with a :class:`LoaderError` that names the file or row and
why; ``"skip"`` leaves the item out, counts it in the source's statistics and logs one warning per
source, so a dataset with a few broken files still trains but never drops data silently.
:class:`ErrorPolicy` is the one place that decides between the two; it also keeps the distinct bad
items and the names of the first few, which the run reports (RunResult, metrics, summary).
"""

from __future__ import annotations

import logging
import threading
from typing import Literal

OnError = Literal["raise", "skip"]

logger = logging.getLogger("vkflow.loaders")

# How many bad items a run names (RunResult.skipped_examples, the metrics line): enough to spot a
# pattern (one folder, one camera), few enough for one line.
EXAMPLES = 5


class LoaderError(Exception):
    """Bad input data: names where (file, row) and why.

    Args:
        where: the file, or file and row/column, at fault.
        why: what is wrong with it, in words.
    """

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}")
        self.where = where
        self.why = why


def check_on_error(on_error: str) -> OnError:
    """Validate an ``on_error`` setting.

    Args:
        on_error: ``"raise"`` or ``"skip"``.

    Returns:
        The same value, typed.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    return on_error  # type: ignore[return-value]


class ErrorPolicy:
    """Applies ``on_error`` to a bad item: raise it, or count it and warn once.

    Thread-safe: decode workers call :meth:`handle` concurrently.

    Args:
        on_error: ``"raise"`` or ``"skip"``.
        source_name: how the warning names the source (usually its path).
    """

    def __init__(self, on_error: str, source_name: str) -> None:
        self.on_error: OnError = check_on_error(on_error)
        self.source_name = source_name
        self._lock = threading.Lock()
        self._skipped = 0
        # Every epoch reads a bad file again: the set counts each item once, and holds only the
        # bad ones, so it stays small next to the dataset.
        self._items: set[str] = set()
        self._examples: list[str] = []

    @property
    def skipped(self) -> int:
        """Items skipped so far (each read of a bad item counts once)."""
        return self._skipped

    @property
    def items(self) -> int:
        """Distinct bad items skipped so far (a bad file met in every epoch counts once)."""
        return len(self._items)

    @property
    def examples(self) -> tuple[str, ...]:
        """Where the first few distinct bad items are (file, or file and row), in the order met."""
        with self._lock:
            return tuple(self._examples)

    def handle(self, error: LoaderError, item: str | None = None) -> None:
        """Raise ``error`` under ``"raise"``; under ``"skip"`` count it and warn on the first one.

        Args:
            error: the bad item's error.
            item: what identifies the item when ``error.where`` may differ between two reads of it
                (e.g. a line number added only to the first message); default ``error.where``.
        """
        if self.on_error == "raise":
            raise error
        key = error.where if item is None else item
        with self._lock:
            self._skipped += 1
            first = self._skipped == 1
            if key not in self._items:
                self._items.add(key)
                if len(self._examples) < EXAMPLES:
                    self._examples.append(error.where)
        if first:
            # One warning per source: a folder with thousands of bad files must not flood the log;
            # the count is in statistics().skipped.
            logger.warning(
                "%s: skipping bad items (on_error='skip'); first: %s; see statistics().skipped for the count",
                self.source_name,
                error,
            )

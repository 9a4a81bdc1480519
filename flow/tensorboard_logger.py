"""TensorBoard event files from a run: :class:`TensorBoardLogger`, a callback (flow.callbacks).

It writes the metrics file's numbers as scalars, so TensorBoard shows what ``metrics.jsonl`` holds:
each training step's ``train/loss``, ``train/accuracy``, ``train/lr``,
``train/samples_per_second`` and model metrics (``train/top5``, ...) at the step line's ``step``,
and each evaluation round's ``val/loss``, ``val/accuracy``, ... (``test/...`` for the test split)
at the eval line's ``step`` (steps done). A measure that does not exist (None) is left out.
tensorboardX writes the files (the ``tensorboard`` extra: no torch or TensorFlow needed); it is
imported when the logger is made, so a missing package is one message saying how to install it.
"""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING, Any

from flow.callbacks import Callback
from flow.spec import Spec

if TYPE_CHECKING:
    from flow.runtime import RunResult

# The step line's keys that are not measures of the step.
_NOT_SCALARS = frozenset({"event", "step", "epoch", "elapsed", "split", "samples", "statistics", "skipped"})

_RUNS = itertools.count()  # this process's writers

INSTALL_HINT = "pip install 'vkflow-ml[tensorboard]' (or pip install tensorboardX)"


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The scalars a metrics line becomes, by tag (pure; the test reads the event file against it).

    Args:
        record: a ``"step"`` or ``"eval"`` line of the metrics file, as a dict.

    Returns:
        ``{"train/loss": ..., ...}`` for a step, ``{"val/loss": ...}`` (or ``"test/..."``) for an
        evaluation; numbers only, Nones and non-numbers left out.
    """
    prefix = "train" if record["event"] == "step" else record["split"]
    return {
        f"{prefix}/{key}": float(value)
        for key, value in record.items()
        if key not in _NOT_SCALARS and isinstance(value, int | float) and not isinstance(value, bool)
    }


class TensorBoardLogger(Callback):
    """Write TensorBoard event files under ``log_dir`` (``tensorboard --logdir LOG_DIR`` shows them).

    Each process of a run (a resumed one too) adds its own event file to the folder; TensorBoard
    joins them. Events are flushed at each evaluation round and at the end.

    Args:
        log_dir: the folder (created if missing).

    Raises:
        ModuleNotFoundError: tensorboardX is not installed (the message says how to install it).
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ModuleNotFoundError(
                f"TensorBoardLogger needs tensorboardX, which is not installed: {INSTALL_HINT}",
                name="tensorboardX",
            ) from None
        self._writer_class = SummaryWriter
        self.log_dir = os.fspath(log_dir)
        self._writer: Any = None

    def on_start(self, spec: Spec, splits: frozenset[str]) -> None:
        self.on_end(None)  # the writer of an earlier run that failed
        # tensorboardX names a file by the second and the host: two runs in one second would share
        # (and overwrite) one without a suffix of their own.
        self._writer = self._writer_class(self.log_dir, filename_suffix=f".{os.getpid()}.{next(_RUNS)}")

    def _add(self, record: dict[str, Any]) -> None:
        if self._writer is None:
            return
        for tag, value in scalars_of(record).items():
            self._writer.add_scalar(tag, value, record["step"])

    def on_step(self, record: dict[str, Any]) -> None:
        self._add(record)

    def on_eval(self, record: dict[str, Any]) -> None:
        self._add(record)
        if self._writer is not None:
            self._writer.flush()

    def on_end(self, result: RunResult | None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

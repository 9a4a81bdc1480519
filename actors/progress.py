"""Progress of a training run on stderr: a tqdm bar on a terminal, plain lines elsewhere.

On a terminal (``mode="bar"``) a tqdm bar shows steps, elapsed time and ETA, then loss, accuracy
and samples/s (and each device's, in a data-parallel run); it takes the terminal's width, so it
never wraps, and lines such as evaluations are printed above it (tqdm.write). Off a terminal (logs,
CI, a pipe: ``mode="lines"``) it prints one plain line when an epoch begins, every ``every_s``
seconds and at the last step, and the evaluation lines as they come. ``mode="off"`` prints nothing
(``run --quiet``).

Formatting is pure (:func:`plain_line`, :func:`postfix`, :func:`eta_seconds`, :class:`Rate`);
:class:`Progress` only decides whether and when to draw, and the sink asks :meth:`Progress.due`
before building a state, so a fast run spends nothing on it between draws.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal, TextIO

from tqdm import tqdm

Mode = Literal["bar", "lines", "off"]


@dataclass(frozen=True)
class ProgressState:
    """What the progress shows.

    Attributes:
        step: steps done.
        total: steps in the run.
        samples_per_second: recent throughput.
        loss: the last training loss.
        accuracy: the last evaluation accuracy, if any.
        elapsed: seconds since the run (or resume) started.
        done_at_start: steps already done when this process started (for the ETA).
        epoch: the epoch of the last step (0-based), if known.
        devices: each device's samples/s in a data-parallel run (since the run began); empty for
            one device.
        all_reduce_share: the share of a data-parallel run's step time spent in the all-reduce;
            None for one device.
    """

    step: int
    total: int
    samples_per_second: float = 0.0
    loss: float | None = None
    accuracy: float | None = None
    elapsed: float = 0.0
    done_at_start: int = 0
    epoch: int | None = None
    devices: tuple[float, ...] = ()
    all_reduce_share: float | None = None


def eta_seconds(state: ProgressState) -> float | None:
    """Seconds left at this process's average pace.

    Args:
        state: the progress so far.

    Returns:
        The estimate, or None before the first step of this process.
    """
    done = state.step - state.done_at_start
    if done <= 0 or state.elapsed <= 0:
        return None
    return max(0.0, (state.total - state.step) * state.elapsed / done)


def postfix(state: ProgressState) -> str:
    """The measures after the bar: ``loss 0.4321  acc 0.9521  5120 samples/s`` and, for several
    devices, ``all-reduce 12%  per device 2600, 2520``.

    Args:
        state: what to show.

    Returns:
        The text.
    """
    parts = []
    if state.loss is not None:
        parts.append(f"loss {state.loss:.4f}")
    if state.accuracy is not None:
        parts.append(f"acc {state.accuracy:.4f}")
    parts.append(f"{state.samples_per_second:.0f} samples/s")
    if state.all_reduce_share is not None:
        parts.append(f"all-reduce {state.all_reduce_share:.0%}")
    if state.devices:
        parts.append("per device " + ", ".join(f"{speed:.0f}" for speed in state.devices))
    return "  ".join(parts)


def plain_line(state: ProgressState) -> str:
    """A line for a log: ``step 120/690  epoch 2  elapsed 00:10  ETA 00:45  loss 0.4321 ...``.

    Args:
        state: what to show.

    Returns:
        The line, without a newline.
    """
    eta = eta_seconds(state)
    parts = [f"step {state.step}/{state.total}"]
    if state.epoch is not None:
        parts.append(f"epoch {state.epoch}")
    parts.append(f"elapsed {tqdm.format_interval(state.elapsed)}")
    parts.append(f"ETA {'--:--' if eta is None else tqdm.format_interval(eta)}")
    return "  ".join(parts) + "  " + postfix(state)


class Rate:
    """Samples per second over the last ``window`` steps (O(1) per step: a running sum).

    Args:
        window: steps to average over.
    """

    def __init__(self, window: int = 20) -> None:
        self._marks: deque[tuple[float, int]] = deque(maxlen=window + 1)
        self._samples = 0  # samples of every mark but the oldest: those that arrived within the span

    def add(self, when: float, samples: int) -> float:
        """Record a step.

        Args:
            when: its time (seconds, any monotonic clock).
            samples: its samples.

        Returns:
            The rate over the window (0.0 until two steps are known).
        """
        marks = self._marks
        if len(marks) == marks.maxlen:
            marks.popleft()
            if marks:
                self._samples -= marks[0][1]  # the new oldest mark opens the span: its samples leave it
        marks.append((when, samples))
        if len(marks) < 2:
            return 0.0
        self._samples += samples
        span = when - marks[0][0]
        return self._samples / span if span > 0 else 0.0


class _Bar(tqdm):
    """tqdm without its monitor thread: the sink redraws the bar itself, a few times a second."""

    monitor_interval = 0


_BAR_FORMAT = (
    "{n_fmt}/{total_fmt} |{bar:12}| {elapsed}<{remaining}{postfix}"  # tqdm puts ", " before a postfix
)


class Progress:
    """Draws the progress (see the module docstring).

    Args:
        stream: where; default stderr.
        enabled: False prints nothing (``mode="off"``); True or None (default) draw.
        per_second: most redraws of the bar per second.
        every_s: seconds between plain lines (besides one as each epoch begins).
        mode: "bar", "lines" or "off"; default: a bar when ``stream`` is a terminal, else lines.
        width: the bar line's width in characters; default: the terminal's, as it changes.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        per_second: float = 10.0,
        every_s: float = 30.0,
        mode: Mode | None = None,
        width: int | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if enabled is False:
            mode = "off"
        elif mode is None:
            isatty = getattr(self.stream, "isatty", None)
            mode = "bar" if isatty and isatty() else "lines"
        self.mode: Mode = mode
        self.enabled = mode != "off"
        self.width = width
        self._interval = 1.0 / per_second if mode == "bar" else every_s
        self._last = time.monotonic() if mode == "lines" else -1e9  # a first line after every_s
        self._epoch: int | None = None  # the epoch of the last step seen (lines: a new one prints)
        self._bar: tqdm | None = None

    def due(self, force: bool = False, epoch: int | None = None) -> bool:
        """Whether :meth:`update` would draw now: lets a caller skip building the state.

        Args:
            force: a forced update (e.g. the last step).
            epoch: the step's epoch: the first step of a new one draws a plain line.

        Returns:
            True when enabled and forced, an interval has passed since the last draw, or (lines) an
            epoch begins.
        """
        if not self.enabled:
            return False
        if self.mode == "lines" and epoch is not None and epoch != self._epoch:
            first, self._epoch = self._epoch is None, epoch
            if not first:
                return True
        return force or time.monotonic() - self._last >= self._interval

    def update(self, state: ProgressState, force: bool = False) -> None:
        """Draw ``state``: redraw the bar, or print a plain line. Ask :meth:`due` first.

        Args:
            state: what to show.
            force: unused (the caller's :meth:`due` decided); kept for callers that pass it.
        """
        if not self.enabled:
            return
        self._last = time.monotonic()
        if self.mode == "lines":
            self.stream.write(plain_line(state) + "\n")
            self.stream.flush()
            return
        if self._bar is None:
            self._bar = _Bar(
                total=state.total, initial=state.done_at_start, file=self.stream, unit="step",
                bar_format=_BAR_FORMAT, ncols=self.width, dynamic_ncols=self.width is None, leave=True,
            )  # fmt: skip
        self._bar.n = state.step
        self._bar.set_postfix_str(postfix(state), refresh=False)
        self._bar.refresh()

    def note(self, text: str) -> None:
        """Print a line above the bar, or as a plain line (evaluations, checkpoints).

        Args:
            text: the line.
        """
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)  # clears the bar, prints, redraws it below
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Leave the bar's last state on its own line, so later output starts on a fresh one."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

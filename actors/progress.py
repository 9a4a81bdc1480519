"""Progress on a terminal: one self-rewriting line with steps, samples/s, loss, accuracy and ETA.

Formatting is pure (:func:`format_line`, :func:`eta_seconds`, :class:`Rate`); :class:`Progress`
only decides whether and when to draw. It draws on a TTY, at most ``per_second`` times a second
so a fast run spends nothing on it, and is quiet otherwise (logs and CI get the metrics file, not
carriage returns).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True)
class ProgressState:
    """What the line shows.

    Attributes:
        step: steps done.
        total: steps in the run.
        samples_per_second: recent throughput.
        loss: the last training loss.
        accuracy: the last evaluation accuracy, if any.
        elapsed: seconds since the run (or resume) started.
        done_at_start: steps already done when this process started (for the ETA).
    """

    step: int
    total: int
    samples_per_second: float = 0.0
    loss: float | None = None
    accuracy: float | None = None
    elapsed: float = 0.0
    done_at_start: int = 0


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


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def format_line(state: ProgressState, width: int = 24) -> str:
    """The progress line.

    Args:
        state: what to show.
        width: characters in the bar.

    Returns:
        e.g. ``[#########...............] 120/690 steps  5120 samples/s  loss 0.4321  acc 0.9521  ETA 00:05``.
    """
    fraction = min(1.0, state.step / state.total) if state.total > 0 else 1.0
    filled = int(round(fraction * width))
    parts = [
        f"[{'#' * filled}{'.' * (width - filled)}] {state.step}/{state.total} steps",
        f"{state.samples_per_second:.0f} samples/s",
    ]
    if state.loss is not None:
        parts.append(f"loss {state.loss:.4f}")
    if state.accuracy is not None:
        parts.append(f"acc {state.accuracy:.4f}")
    parts.append(f"ETA {_clock(eta_seconds(state))}")
    return "  ".join(parts)


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


class Progress:
    """Draws the progress line (see the module docstring).

    Args:
        stream: where; default stderr.
        enabled: force on or off; default: on when ``stream`` is a TTY.
        per_second: most redraws per second.
    """

    def __init__(
        self, stream: TextIO | None = None, enabled: bool | None = None, per_second: float = 10.0
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty()) if enabled is None else enabled
        self._interval = 1.0 / per_second
        self._last = -1e9
        self._drawn = False

    def due(self, force: bool = False) -> bool:
        """Whether :meth:`update` would draw now: lets a caller skip building the state.

        Args:
            force: a forced update (e.g. the last step).

        Returns:
            True when enabled and forced or an interval has passed since the last draw.
        """
        return self.enabled and (force or time.monotonic() - self._last >= self._interval)

    def update(self, state: ProgressState, force: bool = False) -> None:
        """Redraw, unless drawn less than an interval ago.

        Args:
            state: what to show.
            force: draw even within the interval (e.g. the last step).
        """
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < self._interval):
            return
        self._last = now
        self.stream.write("\r" + format_line(state) + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def note(self, text: str) -> None:
        """Print a line above the progress line (evaluations, checkpoints).

        Args:
            text: the line.
        """
        if not self.enabled:
            return
        self.stream.write("\r\x1b[K" + text + "\n")
        self.stream.flush()
        self._last = -1e9  # redraw the bar at the next update

    def close(self) -> None:
        """End the line so later output starts on a fresh one."""
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

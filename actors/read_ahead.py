"""Whether the loader holds a ready batch back, to send it with the next ones as one chunk.

Every message costs each actor on its way a turn of the event loop (a receive, the hooks, the
counts, a send, a wake-up), whatever it carries. When the host is the slower side, so that the
device waits for batches (a small model on a fast GPU), those turns are the run's speed, and they
are paid once per message: sending several steps in one message pays them once for all. The
loader already chunks while the channel downstream is full (the device is behind), but a run
bound by the host never fills it, so it used to send one batch a message and pay every turn at
every step (issue 13: 209-245 us of loop CPU a step on the H100 host, against a 170 us GPU step).

So the loader measures the loop's *turnaround*: how long a send that did not wait for room takes
to come back to it, which is every other actor's turn in between. It keeps a ready batch staged
while the batches staged so far, plus the next one's preparation, are ready before the loop would
have come back to it anyway. A batch so waits at most one turnaround, the time it would have
spent waiting for its turn in the loop, and the latency a user sees does not rise. In a loop that
comes back quickly (under :data:`HOLD_FLOOR_S`, the host keeps up with any device whose step is
longer) the loader never holds. Both costs are the medians of the last :data:`WINDOW` samples, so
one slow turn (the OS took the core) decides nothing. Wall time is the right clock here: the
turnaround is time the device waits, whoever's CPU it is.

Pure bookkeeping; the loader does the sends (actors.loader).
"""

from __future__ import annotations

from collections import deque

# Samples each median looks back over: a few chunks' worth, so the policy follows a run that
# changes pace (an evaluation round, a slower epoch) within a few dozen steps.
WINDOW = 16

# The turnaround below which nothing is held: a loop back within this feeds any device whose step
# takes longer, and the per-message cost that holding would save is then small beside the step. The
# H100 host's host-bound MLP run turned around in ~190 us; an idle pipeline in ~10-30 us.
HOLD_FLOOR_S = 100e-6


def _median(values: deque[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class ReadAhead:
    """The loader's decision to hold ready batches back (see the module docstring).

    Args:
        limit: the most messages one chunk carries (actors.meter.MAX_CHUNK).
        floor_s: the turnaround under which nothing is held.
    """

    __slots__ = ("limit", "floor_s", "_turnarounds", "_preparing", "turnaround_s", "preparing_s")

    def __init__(self, limit: int, floor_s: float = HOLD_FLOOR_S) -> None:
        self.limit = limit
        self.floor_s = floor_s
        self._turnarounds: deque[float] = deque(maxlen=WINDOW)
        self._preparing: deque[float] = deque(maxlen=WINDOW)
        self.turnaround_s = 0.0  # the medians, kept up to date as samples come in
        self.preparing_s = 0.0

    def turned_around(self, seconds: float) -> None:
        """Note how long a send that found room took to come back to the loader."""
        self._turnarounds.append(seconds)
        self.turnaround_s = _median(self._turnarounds)

    def prepared(self, seconds: float) -> None:
        """Note how long the loader took to have its next batch ready (a read, a job's making)."""
        self._preparing.append(seconds)
        self.preparing_s = _median(self._preparing)

    def hold(self, staged: int, waited_s: float) -> bool:
        """Whether to keep the staged batches back for the next one.

        Args:
            staged: messages staged now.
            waited_s: how long the oldest of them has been staged.

        Returns:
            True while the next batch would be ready before the loop would come back anyway.
        """
        if staged >= self.limit or len(self._turnarounds) < WINDOW // 2:
            return False
        turnaround = self.turnaround_s
        return turnaround >= self.floor_s and waited_s + self.preparing_s < turnaround

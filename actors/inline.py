"""Whether an actor's blocking work runs inline on the event loop or in a worker thread.

:class:`InlinePolicy` decides, item by item, from what items cost (pure bookkeeping, no effects);
:class:`InlineOrThread` carries the decision out for an actor and reports each item's cost back to
the policy. The loader (reads) and the preprocess actor (transforms) use them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import trio

T = TypeVar("T")


# The most items between two probes. Reads that are costly only for a while (a source filling its
# cache in its first epoch) must not keep a run on threads for long: with gaps of up to 1024, a
# 704-read run profiled on the H100 host sent every read to a thread. A failed probe stalls the
# loop once per this many items.
MAX_PROBE_GAP = 64


# Weight of the newest item in the inline average. One slow item among cheap ones (the OS takes
# the core away once) must not send a cheap source to threads, where every read then costs the
# event loop a hop and the GIL handoffs: with a weight of 1/4, one 1 ms item among 100 us reads
# did. (On the H100 the actor figure swung between 0.58 M and 0.95 M samples/s from run to run,
# the slow runs with the loader's busy time of reads in threads.) A source that really is slow
# (milliseconds a read) still crosses the threshold at its first.
INLINE_WEIGHT = 1 / 16


class InlinePolicy:
    """Whether to run a piece of blocking work inline on the event loop or in a worker thread.

    A hop to a worker thread and back costs ~50-100 µs of event-loop time and wakeups: as much as
    a gather from an in-memory source or a small transform, which hold the GIL anyway, and on a
    fast GPU a third of a training step. So work is measured. While items run inline, their wall
    time (an exponential average, weight ``INLINE_WEIGHT``) must stay under ``threshold_s``, else
    they go back to threads.
    In a thread, wall time also counts waiting for the GIL, so CPU time is averaged there; when it
    is under ``threshold_s``, one item now and then runs inline as a probe of its real cost (after
    2, 4, ... up to ``MAX_PROBE_GAP`` items while probes keep failing: a slow disk costs little CPU
    but must not stall the event loop often). Work not measured yet runs in a thread.

    Args:
        threshold_s: the most an item may cost to run inline.
        forced: True: always inline (a thread-free fake device); False: never.
    """

    def __init__(self, threshold_s: float = 200e-6, forced: bool | None = None) -> None:
        self.threshold_s = threshold_s
        self.forced = forced
        self.running_inline = False
        self.inline_s: float | None = None  # average wall time of inline items
        self.thread_cpu_s: float | None = None  # average CPU time of items in threads
        self._countdown = 1
        self._backoff = 1

    def inline(self) -> bool:
        """Whether the next item runs inline (call once per item: it counts items for probes).

        Returns:
            True to run it inline.
        """
        if self.forced is not None:
            return self.forced
        if self.running_inline:
            return True
        self._countdown -= 1
        cheap = self.thread_cpu_s is not None and self.thread_cpu_s < self.threshold_s
        if self._countdown <= 0 and cheap:
            self._backoff = min(2 * self._backoff, MAX_PROBE_GAP)
            self._countdown = self._backoff
            self.inline_s = None  # the probe's own cost decides
            return True
        return False

    def note_inline(self, seconds: float) -> None:
        """Record the wall time of an item run inline.

        Args:
            seconds: its duration.
        """
        average = self.inline_s
        self.inline_s = seconds if average is None else average + INLINE_WEIGHT * (seconds - average)
        cheap = self.inline_s < self.threshold_s
        if cheap and not self.running_inline:
            self._backoff = 1  # a probe succeeded
        self.running_inline = cheap

    def note_thread(self, cpu_seconds: float) -> None:
        """Record the CPU time of an item run in a worker thread (a lost update from a race only
        delays a decision).

        Args:
            cpu_seconds: its ``time.thread_time()`` difference.
        """
        average = self.thread_cpu_s
        self.thread_cpu_s = cpu_seconds if average is None else 0.75 * average + 0.25 * cpu_seconds


class InlineOrThread(Generic[T]):
    """One actor's blocking work, item by item: inline on the event loop or in a worker thread, as
    its :class:`InlinePolicy` decides, with each item's cost reported back to the policy (wall time
    inline, CPU time in a thread: see the policy for why).

    Ask :meth:`inline` once per item, then call :meth:`run_inline` or await :meth:`run_in_thread`.
    The caller keeps that branch because the loader needs it: it finishes an inline read at once
    but leaves a threaded one running in its nursery beside other reads. The work is bound once,
    here, so an item costs one call more than writing the timing out at the call site (~80 ns on
    the development VM; a context manager cost ~300 ns, since Python 3.11 binds ``__exit__`` anew
    for every ``with``).

    Args:
        work: the blocking function, called with each item's arguments.
        policy: decides and learns from the costs.
        limiter: the actor's own limit on worker threads (never trio's shared default).
    """

    __slots__ = ("work", "policy", "limiter", "inline")

    def __init__(self, work: Callable[..., T], policy: InlinePolicy, limiter: trio.CapacityLimiter) -> None:
        self.work = work
        self.policy = policy
        self.limiter = limiter
        # Whether the next item runs inline (call once per item: see InlinePolicy.inline). The
        # policy's own method, bound once, so the question costs no extra call.
        self.inline: Callable[[], bool] = policy.inline

    def run_inline(self, *args: Any) -> T:
        """Run ``work(*args)`` now, on the event loop, timing its wall time.

        Args:
            args: the item's arguments.

        Returns:
            What ``work`` returns.
        """
        start = time.perf_counter()
        result = self.work(*args)
        self.policy.note_inline(time.perf_counter() - start)
        return result

    async def run_in_thread(self, *args: Any) -> T:
        """Run ``work(*args)`` in a worker thread under the limiter, timing its CPU time.

        Args:
            args: the item's arguments.

        Returns:
            What ``work`` returns.
        """
        return await trio.to_thread.run_sync(self._timed_in_thread, *args, limiter=self.limiter)

    def _timed_in_thread(self, *args: Any) -> T:
        start = time.thread_time()
        result = self.work(*args)
        self.policy.note_thread(time.thread_time() - start)
        return result

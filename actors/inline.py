"""Whether an actor's blocking work runs inline on the event loop or in a worker thread.

:class:`InlinePolicy` decides, item by item, from what recent items cost (pure bookkeeping, no
effects); :class:`InlineOrThread` carries the decision out for an actor, reports each item's cost
back to the policy and counts the items that went to threads. The loader (reads) and the
preprocess actor (transforms) use them.

Why it is built this way: the decision used to follow an exponential average of wall time, and on
a busy host one slow read among cheap ones (the OS took the core, another thread held the GIL)
could send an in-memory source's later reads to threads, where each read costs the event loop a
hop and GIL handoffs: the H100's actor figure swung between 511 k and 955 k samples/s from run to
run with it. So now:

- an item's cost is its thread CPU time (``time.thread_time``), inline and in a thread alike: time
  spent waiting for the core or the GIL is not the item's cost, and the same clock on both sides
  needs no probes to compare them;
- the decision follows the median of a window of recent items (:data:`WINDOW`), so no lone outlier
  moves it;
- a source that declares itself in memory is pinned inline by its actor (``forced=True``) and never
  measured at all.

CPU time misses one cost: work that waits off the CPU (a cold disk, a decode pool of the source's
own) stalls the event loop for its whole wall time while its CPU time stays small. Inline items
therefore also record their off-CPU time (wall minus CPU); when its median says they wait, items
go to threads, with an inline probe now and then to see whether the waiting has ended.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import trio

T = TypeVar("T")


# Items the decision looks back over. Long enough that one slow item (or a burst of a few) is far
# from the median, short enough that a source that changes for good (a cache filled in its first
# epoch) is followed within half a window: 16 items.
WINDOW = 32

# The most items between two probes of work that waits. Reads that wait only for a while (a cold
# page cache in the first epoch) must not keep a run on threads for long: with gaps of up to 1024,
# a 704-read run profiled on the H100 host sent every read to a thread. A failed probe stalls the
# loop once per this many items.
MAX_PROBE_GAP = 64


class CostWindow:
    """The last ``size`` costs of one kind, and how many of them reach ``limit``.

    The lower median reaches the limit exactly when more than half the costs do, so the question
    the policy asks for every item is answered from a count kept as costs come and go, without a
    sort (the window's mean would let one outlier move it; the median does not).

    Args:
        limit: the cost that counts as too much.
        size: how many costs are kept.
    """

    __slots__ = ("limit", "costs", "over")

    def __init__(self, limit: float, size: int = WINDOW) -> None:
        self.limit = limit
        self.costs: deque[float] = deque(maxlen=max(1, int(size)))
        self.over = 0  # costs in the window at or above the limit

    def __len__(self) -> int:
        return len(self.costs)

    def add(self, cost: float) -> None:
        """Take in a cost; the oldest leaves when the window is full.

        Args:
            cost: seconds.
        """
        costs = self.costs
        if len(costs) == costs.maxlen and costs[0] >= self.limit:
            self.over -= 1
        costs.append(cost)
        if cost >= self.limit:
            self.over += 1

    def clear(self) -> None:
        """Forget every cost."""
        self.costs.clear()
        self.over = 0

    def reached(self) -> bool:
        """Whether the median reaches the limit (more than half the costs do); False when empty."""
        return 2 * self.over > len(self.costs)

    def median(self) -> float | None:
        """The median cost (for reports and tests; the decision uses :meth:`reached`), or None."""
        return statistics.median(self.costs) if self.costs else None


class InlinePolicy:
    """Whether to run a piece of blocking work inline on the event loop or in a worker thread.

    A hop to a worker thread and back costs ~50-100 µs of event-loop time and wakeups: as much as
    a gather from an in-memory source or a small transform, which hold the GIL anyway, and on a
    fast GPU a third of a training step. So work is measured (see the module docstring for why
    this way):

    - Every item's thread CPU time goes into a window; while the window's median is under
      ``threshold_s``, items run inline, else in threads. Work not measured yet runs in a thread.
    - Inline items also put their off-CPU time (wall minus CPU: a disk, a pool the work waits on,
      the GIL) into a second window. When its median reaches ``threshold_s`` (judged from two items
      on, so a lone item never decides), the work waits rather than computes, and items go to
      threads. One item runs inline as a probe after 2 items, then 4, 8, ... up to
      ``MAX_PROBE_GAP`` while probes keep failing; a probe that does not wait brings the work back
      inline, and the gaps start again from 2 once it has stayed inline for a whole window.

    Costs come in on the event loop's thread only (:class:`InlineOrThread` notes a thread's cost
    after the hop back), so the windows need no lock.

    Args:
        threshold_s: the most CPU time, and the most off-CPU waiting, an item may cost inline.
        forced: True: always inline (an in-memory source, a thread-free fake device); False: never.
            A forced policy learns nothing, and its items are not timed.
        window: how many recent items the decisions look back over.
    """

    def __init__(self, threshold_s: float = 200e-6, forced: bool | None = None, window: int = WINDOW) -> None:
        self.threshold_s = threshold_s
        self.forced = forced
        self.cpu = CostWindow(threshold_s, window)  # every measured item's thread CPU time
        self.waits = CostWindow(threshold_s, window)  # inline items' off-CPU time
        self.window = self.cpu.costs.maxlen
        self.waiting = False  # inline items wait off the CPU: threads, with probes
        self._gap = 2  # items from a failed probe (or the start of waiting) to the next probe
        self._countdown = 0
        self._held = 0  # inline items since the work last came back from waiting

    @property
    def cpu_s(self) -> float | None:
        """The median thread CPU time of the recent items (None before the first)."""
        return self.cpu.median()

    @property
    def wait_s(self) -> float | None:
        """The median off-CPU time of the recent inline items (None before the first)."""
        return self.waits.median()

    def inline(self) -> bool:
        """Whether the next item runs inline (call once per item: it counts items for probes).

        Returns:
            True to run it inline.
        """
        if self.forced is not None:
            return self.forced
        cpu = self.cpu
        if not cpu.costs or cpu.reached():
            return False  # not measured yet, or costly: threads measure CPU as well as inline does
        if not self.waiting:
            return True
        self._countdown -= 1
        return self._countdown <= 0  # a probe

    def note_inline(self, cpu_seconds: float, wall_seconds: float) -> None:
        """Record the cost of an item run inline.

        Args:
            cpu_seconds: its ``time.thread_time()`` difference.
            wall_seconds: its ``time.perf_counter()`` difference.
        """
        self.cpu.add(cpu_seconds)
        waited = wall_seconds - cpu_seconds
        waits = self.waits
        if self.waiting:  # a probe: it alone decides, since the window holds the waiting past
            if waited < waits.limit:
                self.waiting = False
                waits.clear()
                waits.add(waited)
                self._held = 1
            else:
                self._gap = min(2 * self._gap, MAX_PROBE_GAP)
                self._countdown = self._gap
            return
        waits.add(waited)
        if len(waits) >= 2 and waits.reached():
            # The gap is not reset here: work that a lucky probe brought back for a few items
            # resumes its probes as far apart as before.
            self.waiting = True
            self._countdown = self._gap
            self._held = 0
            return
        self._held += 1
        if self._held >= self.window:
            self._gap = 2  # inline for a whole window: it has stopped waiting for good

    def note_thread(self, cpu_seconds: float) -> None:
        """Record the cost of an item run in a worker thread.

        Args:
            cpu_seconds: its ``time.thread_time()`` difference, taken in the thread.
        """
        self.cpu.add(cpu_seconds)


class InlineOrThread(Generic[T]):
    """One actor's blocking work, item by item: inline on the event loop or in a worker thread, as
    its :class:`InlinePolicy` decides, with each item's cost reported back to the policy (thread CPU
    time on both sides, and off-CPU time inline: see the policy for why) and the items that went to
    threads counted in ``thread_items`` (for the actor's statistics).

    Ask :meth:`inline` once per item, then call :meth:`run_inline` or await :meth:`run_in_thread`.
    The caller keeps that branch because the loader needs it: it finishes an inline read at once
    but leaves a threaded one running in its nursery beside other reads. The work is bound once,
    here, so an item costs one call more than writing the timing out at the call site (~80 ns on
    the development VM; a context manager cost ~300 ns, since Python 3.11 binds ``__exit__`` anew
    for every ``with``). A forced policy's inline items are not timed at all: ``time.thread_time``
    is a system call (~0.6 µs on the development VM), and a pinned source has nothing to learn.

    Args:
        work: the blocking function, called with each item's arguments.
        policy: decides and learns from the costs.
        limiter: the actor's own limit on worker threads (never trio's shared default).
    """

    __slots__ = ("work", "policy", "limiter", "inline", "thread_items")

    def __init__(self, work: Callable[..., T], policy: InlinePolicy, limiter: trio.CapacityLimiter) -> None:
        self.work = work
        self.policy = policy
        self.limiter = limiter
        self.thread_items = 0  # items sent to a worker thread
        # Whether the next item runs inline (call once per item: see InlinePolicy.inline). The
        # policy's own method, bound once, so the question costs no extra call.
        self.inline: Callable[[], bool] = policy.inline

    def run_inline(self, *args: Any) -> T:
        """Run ``work(*args)`` now, on the event loop, timing its CPU and wall time.

        Args:
            args: the item's arguments.

        Returns:
            What ``work`` returns.
        """
        policy = self.policy
        if policy.forced is not None:
            return self.work(*args)
        wall = time.perf_counter()
        cpu = time.thread_time()
        result = self.work(*args)
        cpu = time.thread_time() - cpu
        policy.note_inline(cpu, time.perf_counter() - wall)
        return result

    async def run_in_thread(self, *args: Any) -> T:
        """Run ``work(*args)`` in a worker thread under the limiter, timing its CPU time there and
        noting it once back on the event loop.

        Args:
            args: the item's arguments.

        Returns:
            What ``work`` returns.
        """
        self.thread_items += 1
        result, cpu = await trio.to_thread.run_sync(self._timed_in_thread, *args, limiter=self.limiter)
        self.policy.note_thread(cpu)
        return result

    def _timed_in_thread(self, *args: Any) -> tuple[T, float]:
        start = time.thread_time()
        result = self.work(*args)
        return result, time.thread_time() - start

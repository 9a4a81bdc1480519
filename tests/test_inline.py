"""actors.inline: cheap work runs inline on the event loop and costly work in threads (judged by
thread CPU time, with probes that back off), and ``InlineOrThread`` reports each item's cost to its
policy."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trio

from actors.inline import MAX_PROBE_GAP, InlineOrThread, InlinePolicy


def test_cheap_work_runs_inline_and_costly_work_in_threads():
    assert InlinePolicy(forced=True).inline() and not InlinePolicy(forced=False).inline()
    cheap = InlinePolicy(threshold_s=1e-3)
    assert not cheap.inline()  # nothing measured yet: a thread
    cheap.note_thread(1e-5)
    assert cheap.inline()  # cheap in a thread: a probe runs inline...
    cheap.note_inline(2e-5)
    assert all(cheap.inline() for _ in range(20))  # ...and it stays inline while it stays cheap
    cheap.note_inline(5e-3)
    assert cheap.inline()  # one item 5x over the threshold among cheap ones: still inline
    cheap.note_inline(0.1)
    assert not cheap.inline()  # one slow item inline: back to threads
    costly = InlinePolicy(threshold_s=1e-3)
    costly.inline()
    costly.note_thread(5e-3)
    assert not any(costly.inline() for _ in range(1000))  # costly in CPU: never probed
    disk = InlinePolicy(threshold_s=1e-3)  # little CPU but slow (a disk): probes back off
    probes = []
    for item in range(5000):
        if disk.inline():
            probes.append(item)
            disk.note_inline(0.01)
        else:
            disk.note_thread(1e-5)
    gaps = np.diff(probes).tolist()
    assert gaps[:6] == [2, 4, 8, 16, 32, MAX_PROBE_GAP] and set(gaps[5:]) == {MAX_PROBE_GAP}
    # Reads that turn cheap (a cache filled in the first epoch) go inline within one probe gap.
    warming = InlinePolicy(threshold_s=1e-3)
    for item in range(2000):
        if warming.inline():
            warming.note_inline(0.01 if item < 1000 else 1e-5)
        else:
            warming.note_thread(1e-5)
    assert all(warming.inline() for _ in range(10)) and warming.running_inline


async def test_inline_or_thread_reports_each_items_cost_to_its_policy():
    """The one helper the loader and the preprocess actor run their work through."""
    threads = []

    def work(a: int, b: int) -> float:
        threads.append(threading.get_ident())
        return a / b

    policy = InlinePolicy(threshold_s=1e-3)
    offload = InlineOrThread(work, policy, trio.CapacityLimiter(1))
    assert not offload.inline()  # nothing measured yet: a thread
    assert await offload.run_in_thread(3, 2) == 1.5
    assert threads[-1] != threading.get_ident() and policy.thread_cpu_s is not None  # CPU time noted
    assert offload.inline()  # cheap in a thread: a probe runs inline
    assert offload.run_inline(4, 2) == 2
    assert threads[-1] == threading.get_ident() and policy.inline_s is not None and policy.running_inline
    noted = policy.inline_s
    with pytest.raises(ZeroDivisionError):
        offload.run_inline(1, 0)
    assert policy.inline_s == noted  # a failed item ends the actor: its cost is not noted

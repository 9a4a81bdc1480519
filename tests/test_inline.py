"""actors.inline: cheap work runs inline on the event loop and costly work in threads, judged by
the median thread CPU time of a window of recent items (so no lone outlier flips it); work that
waits off the CPU goes to threads with probes that back off; an in-memory source is pinned inline;
``InlineOrThread`` reports each item's cost to its policy and counts the items sent to threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trio
from fake_sources import CostlySource
from specs import synthetic_spec

from actors.inline import MAX_PROBE_GAP, WINDOW, CostWindow, InlineOrThread, InlinePolicy
from actors.loader import Loader, Read
from actors.messages import unpack
from actors.meter import Meter
from flow.runner import run
from flow.spec import Devices

CHEAP = 50e-6  # a gather from memory
SLOW = 5e-3  # a decode, or a read that waits on a disk


def drive(policy: InlinePolicy, items: int, cpu, wall=None) -> list[bool]:
    """Feed ``policy`` synthetic costs as an actor would: ask, then note the item's cost where it
    ran. ``cpu(i)`` (and ``wall(i)``, default the same as cpu: no waiting) give item i's costs.

    Returns:
        Whether each item ran inline.
    """
    wall = wall or cpu
    ran = []
    for i in range(items):
        inline = policy.inline()
        ran.append(inline)
        if inline:
            policy.note_inline(cpu(i), wall(i))
        else:
            policy.note_thread(cpu(i))
    return ran


def test_the_window_median_is_judged_from_a_count():
    window = CostWindow(limit=1.0, size=4)
    assert not window.reached() and window.median() is None
    for cost in (0.1, 5.0):
        window.add(cost)
    assert not window.reached()  # one of two: the lower median is under the limit
    window.add(2.0)
    assert window.reached() and window.over == 2
    for cost in (0.1, 0.2, 0.3, 0.4):  # the four oldest leave, 5.0 and 2.0 among them
        window.add(cost)
    assert len(window) == 4 and window.over == 0 and not window.reached()
    assert window.median() == pytest.approx(0.25)
    window.clear()
    assert len(window) == 0 and window.over == 0


def test_forced_policies_never_ask_the_costs():
    assert InlinePolicy(forced=True).inline() and not InlinePolicy(forced=False).inline()
    pinned = InlinePolicy(forced=True)
    assert all(drive(pinned, 100, cpu=lambda i: SLOW))  # an in-memory source: inline whatever it costs


def test_a_cheap_source_runs_inline_and_no_lone_outlier_flips_it():
    policy = InlinePolicy()
    ran = drive(policy, 2000, cpu=lambda i: SLOW if i % 97 == 50 else CHEAP)
    assert ran[0] is False  # nothing measured yet: a thread
    assert all(ran[1:])  # then inline, through 20 outliers 100x the cheap cost
    assert policy.cpu_s == pytest.approx(CHEAP) and not policy.waiting
    # Outliers in wall time only (the OS took the core, another thread held the GIL) do not flip
    # it either: the off-CPU window's median stays small.
    policy = InlinePolicy()
    ran = drive(policy, 2000, cpu=lambda i: CHEAP, wall=lambda i: CHEAP + (SLOW if i % 7 == 3 else 0))
    assert all(ran[1:]) and not policy.waiting
    # A burst of slow items shorter than half a window does not flip it.
    policy = InlinePolicy()
    burst = range(100, 100 + WINDOW // 2 - 1)
    assert all(drive(policy, 300, cpu=lambda i: SLOW if i in burst else CHEAP)[1:])


def test_a_slow_source_goes_to_threads_and_comes_back_once_cheap():
    slow = InlinePolicy()
    assert not any(drive(slow, 1000, cpu=lambda i: SLOW))  # costly in CPU: threads, never probed
    # Costly only for a while (a cache filled in the first epoch): inline within half a window of
    # the change, since thread CPU time is the same measure as inline CPU time.
    warming = InlinePolicy()
    ran = drive(warming, 400, cpu=lambda i: SLOW if i < 200 else CHEAP)
    assert not any(ran[:200])
    first = ran.index(True)
    assert 200 < first <= 200 + WINDOW // 2 and all(ran[first:])
    # Cheap, then slow for good: threads once more than half the window is slow (a tie stays).
    cooling = InlinePolicy()
    ran = drive(cooling, 400, cpu=lambda i: CHEAP if i < 200 else SLOW)
    assert all(ran[1 : 200 + WINDOW // 2 + 1]) and not any(ran[200 + WINDOW // 2 + 1 :])


def test_work_that_waits_goes_to_threads_with_probes_that_back_off():
    """Little CPU but a long wall time (a disk, a decode pool): a probe now and then, at most
    MAX_PROBE_GAP items apart."""
    disk = InlinePolicy()
    ran = drive(disk, 3000, cpu=lambda i: CHEAP, wall=lambda i: SLOW)
    inline = np.flatnonzero(ran)
    assert inline[:2].tolist() == [1, 2]  # two inline items to judge from: a lone one never decides
    gaps = np.diff(inline[1:]).tolist()
    assert gaps[:6] == [2, 4, 8, 16, 32, MAX_PROBE_GAP] and set(gaps[5:]) == {MAX_PROBE_GAP}
    assert disk.waiting and disk.wait_s == pytest.approx(SLOW - CHEAP)
    # Reads that stop waiting (a page cache filled in the first epoch) come back within one gap.
    warming = InlinePolicy()
    ran = drive(warming, 3000, cpu=lambda i: CHEAP, wall=lambda i: SLOW if i < 1000 else CHEAP)
    first = 1000 + ran[1000:].index(True)
    assert first <= 1000 + MAX_PROBE_GAP and all(ran[first:]) and not warming.waiting
    # A lucky probe costs a couple of waiting items inline, then the probes go on as far apart
    # as before (no thrash back to probing every other item).
    lucky = InlinePolicy()
    drive(lucky, 1000, cpu=lambda i: CHEAP, wall=lambda i: SLOW)
    probes = []

    def once_fast(i: int) -> float:  # the next probe does not wait; nothing after it is so lucky
        probes.append(i)
        return CHEAP if len(probes) == 1 else SLOW

    ran = drive(lucky, 400, cpu=lambda i: CHEAP, wall=once_fast)
    first = ran.index(True)
    assert ran[first : first + 4] == [True, True, True, False]  # the probe, then two to judge
    gaps = np.diff(np.flatnonzero(ran[first + 2 :])).tolist()
    assert gaps and set(gaps) == {MAX_PROBE_GAP}


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
    assert threads[-1] != threading.get_ident() and len(policy.cpu) == 1  # CPU time noted
    assert offload.thread_items == 1
    assert offload.inline()  # cheap in a thread: inline
    assert offload.run_inline(4, 2) == 2
    assert threads[-1] == threading.get_ident() and len(policy.cpu) == 2 and len(policy.waits) == 1
    assert offload.thread_items == 1
    with pytest.raises(ZeroDivisionError):
        offload.run_inline(1, 0)
    assert len(policy.cpu) == 2  # a failed item ends the actor: its cost is not noted
    pinned = InlineOrThread(work, InlinePolicy(forced=True), trio.CapacityLimiter(1))
    assert pinned.inline() and pinned.run_inline(1, 4) == 0.25
    assert len(pinned.policy.cpu) == 0  # a forced policy's items are not timed


@pytest.mark.parametrize("in_memory", [True, False])
async def test_the_loader_pins_an_in_memory_source_inline_and_counts_reads_in_threads(in_memory):
    # Reads 4x the threshold: measured, they go to threads; declared in memory, they never do.
    source = CostlySource(1e-3, in_memory)
    stream = (Read(seq, "train", seq, 0, seq, np.arange(4)) for seq in range(30))
    send, receive = trio.open_memory_channel(100)
    loader = Loader(Meter("loader", None, [send]), source, stream, workers=2)
    await loader.run()
    assert [batch.seq async for item in receive for batch in unpack(item)] == list(range(30))
    stats = loader.statistics()
    assert stats.items_out == 30
    if in_memory:
        assert all(source.on_loop) and stats.thread_items == 0
    else:
        assert not any(source.on_loop) and stats.thread_items == 30


def test_a_synthetic_runs_reads_all_stay_inline(tmp_path):
    """Through a whole run on the CPU backend (not thread-free), streamed from the host: the
    Synthetic source is in memory, so the loader sent none of its reads to a thread."""
    spec = synthetic_spec(epochs=2, in_flight=2)
    assert spec.devices == Devices("cpu") and spec.data.placement == "host"
    result = run(spec)
    loader = result.statistics["loader"]
    assert loader.items_out > 20 and loader.thread_items == 0
    assert "thread_items" in loader.as_dict()

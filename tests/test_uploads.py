"""Uploads through pinned staging memory (``staging_view`` + ``upload``) on both backends.

Every check reads the uploaded tensor through a program (a bit-exact ``copy`` launch), so the
values the GPU sees are tested, not only the bytes the host wrote. Data is fresh random (never
zeros: a copy that never happened must not pass) in odd sizes. On lavapipe, which has one queue,
uploads share the compute queue; the cross-queue waits are tested as pure bookkeeping
(test_vulkan_queues_policy.py) and run for real on devices with a transfer queue.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from actors.backend import run_program
from actors.vulkan.queues_policy import UPLOAD_TICKETS
from flow.program import Arena, Layout, Program, Tensor, align_up, launch

SIZES = [1, 1023, (3 * 2**20 + 4) // 4]  # 3 MiB + 4 bytes of float32


def io_layout(n: int, dtype: str = "float32") -> Layout:
    """``x`` in a per-slot input arena (a batch), ``y`` and ``w`` (a weight) in a shared one."""
    item = 4
    tensors = (
        Tensor("x", (n,), dtype, "batch", 0),
        Tensor("y", (n,), dtype, "work", 0),
        Tensor("w", (n,), dtype, "work", align_up(n * item)),
        Tensor("wy", (n,), dtype, "work", 2 * align_up(n * item)),
    )
    arenas = (Arena("batch", align_up(n * item), per_slot=True), Arena("work", 3 * align_up(n * item)))
    return Layout(arenas=arenas, tensors=tensors)


def out_layout(n: int) -> Layout:
    """io_layout plus ``out``, a per-slot output arena."""
    layout = io_layout(n)
    return Layout(
        arenas=(*layout.arenas, Arena("out", align_up(n * 4), per_slot=True)),
        tensors=(*layout.tensors, Tensor("out", (n,), "float32", "out", 0)),
    )


def copy_program(src: str, dst: str, n: int) -> Program:
    return Program(name=f"copy_{src}_{dst}", steps=(launch("copy", (src, dst), n=n),))


def upload_and_copy_rounds(backend, rng, src: str, dst: str, n: int, rounds: int) -> None:
    """Round after round: fresh values into ``src``'s staging memory, upload, submit a program
    copying ``src`` to ``dst``, wait, and check ``dst`` holds exactly those values."""
    handle = backend.record(copy_program(src, dst, n))
    for _ in range(rounds):
        values = fresh(rng, n)
        backend.staging_view(src)[:] = values
        backend.upload(src)
        backend.wait(backend.submit(handle))
        np.testing.assert_array_equal(backend.read(dst), values)


def fresh(rng, n: int, dtype=np.float32) -> np.ndarray:
    if np.dtype(dtype).kind == "i":
        values = rng.integers(1, 2**31 - 1, n).astype(dtype) * rng.choice([-1, 1], n).astype(dtype)
    else:
        values = rng.standard_normal(n).astype(dtype)
        values[values == 0] = 1.5
    assert np.all(values != 0)
    return values


@pytest.mark.parametrize("n", SIZES)
def test_uploaded_values_reach_the_program_exactly(backend, rng, n):
    backend.open_layout(io_layout(n), slots=1)
    values = fresh(rng, n)
    view = backend.staging_view("x")
    assert view.shape == (n,) and view.dtype == np.float32 and view.flags.writeable
    view[:] = values
    handle = backend.record(copy_program("x", "y", n))
    uploaded = backend.upload("x")
    ticket = backend.submit(handle)  # no wait in between: the program must still see the upload
    backend.wait(ticket)
    backend.wait(uploaded)
    assert backend.is_done(uploaded) and backend.is_done(ticket)
    np.testing.assert_array_equal(backend.read("y"), values)
    np.testing.assert_array_equal(backend.read("x"), values)


def test_upload_of_int32_data_passed_in(backend, rng):
    n = 1023
    backend.open_layout(io_layout(n, "int32"), slots=1)
    values = fresh(rng, n, np.int32)
    backend.upload("w", data=values.reshape(n))
    run_program(backend, copy_program("w", "wy", n))
    np.testing.assert_array_equal(backend.read("wy"), values)
    np.testing.assert_array_equal(backend.staging_view("w"), values)  # the data went through staging


def test_back_to_back_uploads_into_two_slots(backend, rng):
    n = 1023
    backend.open_layout(out_layout(n), slots=2)
    values = [fresh(rng, n), fresh(rng, n)]
    for slot in (0, 1):
        backend.staging_view("x", slot)[:] = values[slot]
    handles = [backend.record(copy_program("x", "out", n), slot) for slot in (0, 1)]
    uploads = [backend.upload("x", slot) for slot in (0, 1)]
    tickets = [backend.submit(handles[slot]) for slot in (0, 1)]
    for ticket in tickets + uploads:
        backend.wait(ticket)
    for slot in (0, 1):
        np.testing.assert_array_equal(backend.read("out", slot), values[slot])
        np.testing.assert_array_equal(backend.read("x", slot), values[slot])


def test_each_program_sees_the_upload_queued_just_before_it(backend, rng):
    """Round after round, refill (``staging_view`` waits for the last upload to have read it),
    upload and submit with no wait in between; each round's result is checked."""
    n = 1023
    backend.open_layout(io_layout(n), slots=1)
    upload_and_copy_rounds(backend, rng, "w", "wy", n, rounds=4)


def test_an_upload_waits_for_the_program_still_reading_the_tensor(backend, rng):
    """Write after read: the upload queued right after a program that reads ``w`` must not
    change what that program copies."""
    n = (3 * 2**20 + 4) // 4
    backend.open_layout(io_layout(n), slots=1)
    old, new = fresh(rng, n), fresh(rng, n)
    backend.upload("w", data=old)
    handle = backend.record(copy_program("w", "wy", n))
    ticket = backend.submit(handle)
    uploaded = backend.upload("w", data=new)
    backend.wait(uploaded)
    backend.wait(ticket)
    np.testing.assert_array_equal(backend.read("wy"), old)
    np.testing.assert_array_equal(backend.read("w"), new)


def test_bad_arguments_name_the_tensor_and_value_before_any_device_work(backend):
    n = 1023
    backend.open_layout(io_layout(n), slots=2)
    before = backend.read("x")
    with pytest.raises(KeyError, match="'nope'"):
        backend.upload("nope")
    with pytest.raises(KeyError, match="'nope'"):
        backend.staging_view("nope")
    with pytest.raises(IndexError, match=r"'x'.*slot 2"):
        backend.upload("x", 2)
    with pytest.raises(IndexError, match=r"'w'.*slot -1"):
        backend.staging_view("w", -1)
    with pytest.raises(TypeError, match=r"'x'.*float64.*float32"):
        backend.upload("x", data=np.ones(n, np.float64))
    with pytest.raises(ValueError, match=r"'x'.*\(1022,\)"):
        backend.upload("x", data=np.ones(n - 1, np.float32))
    with pytest.raises(ValueError, match=r"'x'.*\(3, 341\)"):
        backend.upload("x", data=np.ones((3, 341), np.float32))
    assert backend._staging == {}  # nothing was allocated, so nothing was submitted
    np.testing.assert_array_equal(backend.read("x"), before)


async def test_uploads_from_trio_wait_in_a_worker_thread(backend, rng):
    n = 1023
    backend.open_layout(io_layout(n), slots=1)
    values = fresh(rng, n)
    backend.staging_view("x")[:] = values
    handle = backend.record(copy_program("x", "y", n))
    backend.upload("x")
    ticket = backend.submit(handle)
    await trio.to_thread.run_sync(backend.wait, ticket)
    np.testing.assert_array_equal(backend.read("y"), values)


# -- Vulkan only ------------------------------------------------------------------------------------


def test_vulkan_upload_tickets_and_timestamps(vulkan_backend, rng):
    n = (3 * 2**20 + 4) // 4
    vulkan_backend.open_layout(io_layout(n), slots=1)
    vulkan_backend.staging_view("x")[:] = fresh(rng, n)
    if not vulkan_backend.upload_timestamps:
        pytest.skip(f"{vulkan_backend.upload_queue_name} writes no timestamps")
    pool = vulkan_backend.timestamp_pool(4)
    vulkan_backend.reset_timestamps(pool)
    tickets = [vulkan_backend.upload("x", timestamps=pool, query=q) for q in (0, 2)]
    assert all(t > UPLOAD_TICKETS for t in tickets) and tickets[1] == tickets[0] + 1
    vulkan_backend.wait(tickets[1])
    assert vulkan_backend.is_done(tickets[0])
    stamps = vulkan_backend.read_timestamps_ns(pool)
    assert np.all(np.diff(stamps) >= 0) and stamps[1] > stamps[0]
    with pytest.raises(IndexError, match="queries 3 and 4"):
        vulkan_backend.upload("x", timestamps=pool, query=3)


@pytest.mark.parametrize("host_reset", [False, True])
def test_program_timestamps_reset_in_the_command_buffer_or_from_the_host(vulkan_backend, rng, host_reset):
    """Each round rewrites the same queries; a host-reset pool is reset before each submission
    (the benchmarks' idle figure), the other by the program itself. Results stay exact."""
    n = 1023
    vulkan_backend.open_layout(io_layout(n), slots=1)
    pool = vulkan_backend.timestamp_pool(2, host_reset=host_reset)
    assert pool.host_reset == (host_reset and vulkan_backend.facts.has("host_query_reset"))
    handle = vulkan_backend.record(copy_program("w", "wy", n), timestamps=pool)
    for _ in range(3):
        values = fresh(rng, n)
        vulkan_backend.staging_view("w")[:] = values
        vulkan_backend.upload("w")
        if pool.host_reset:
            vulkan_backend.reset_timestamps(pool)
        vulkan_backend.wait(vulkan_backend.submit(handle))
        np.testing.assert_array_equal(vulkan_backend.read("wy"), values)
        stamps = vulkan_backend.read_timestamps_ns(pool)  # raises unless both queries were written
        assert stamps[0] > 0 and stamps[1] >= stamps[0]


# -- pure decisions ---------------------------------------------------------------------------------


def test_without_timeline_semaphores_fences_order_uploads_and_programs(monkeypatch, rng):
    """A device without timeline semaphores: one queue and fences. Uploads and programs still
    run in submission order and a program sees the upload before it."""
    from actors.backend import DeviceFacts

    has = DeviceFacts.has
    monkeypatch.setattr(
        DeviceFacts, "has", lambda self, feature: feature != "timeline_semaphore" and has(self, feature)
    )
    try:
        from actors.vulkan import VulkanBackend

        backend = VulkanBackend()
    except Exception as error:  # noqa: BLE001 - no vulkan package or driver here: nothing to test
        pytest.skip(f"no Vulkan device: {error}")
    try:
        assert not backend.timeline
        n = 1023
        backend.open_layout(io_layout(n), slots=1)
        upload_and_copy_rounds(backend, rng, "x", "y", n, rounds=3)
    finally:
        backend.close()


def test_a_group_submitted_at_once_runs_in_order_after_its_uploads(backend, rng):
    """``submit_group``: one submission for several programs (the device actor's steps that piled
    up), each with its own ticket. Every slot's input was uploaded just before, with no wait, and
    the last program reads what the first one wrote: the group runs in order, after the uploads."""
    n = 1023
    backend.open_layout(out_layout(n), slots=3)
    values = [fresh(rng, n) for _ in range(3)]
    handles = [backend.record(copy_program("x", "out", n), slot) for slot in range(3)]
    chained = backend.record(Program(name="chain", steps=(launch("copy", ("out", "wy"), n=n),)), 0)
    for rounds in range(2):  # the second round replays the group's cached submit structs
        for slot in range(3):
            backend.staging_view("x", slot)[:] = values[slot] + rounds
            backend.upload("x", slot)
        tickets = backend.submit_group((*handles, chained))
        assert len(tickets) == 4 and np.all(np.diff(tickets) == 1)
        backend.wait(tickets[-1])
        assert all(backend.is_done(ticket) for ticket in tickets)
        for slot in range(3):
            np.testing.assert_array_equal(backend.read("out", slot), values[slot] + rounds)
        np.testing.assert_array_equal(backend.read("wy"), values[0] + rounds)
    if hasattr(backend, "queue"):  # Vulkan: a command buffer may be pending only once
        with pytest.raises(ValueError, match="submitted twice"):
            backend.submit_group((handles[0], handles[1], handles[0]))

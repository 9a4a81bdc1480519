"""actors.vulkan.queues_policy, the pure bookkeeping of the upload queue: uploads prefer a
transfer-only family, then a second compute queue, and a queue waits only where a buffer is shared,
and only once."""

from __future__ import annotations

from actors.backend import QueueFamily
from actors.vulkan.queues_policy import QueueOrder, choose_upload_queue


def test_uploads_prefer_a_transfer_only_family_then_a_second_compute_queue():
    h100 = (
        QueueFamily(0, 16, graphics=True, compute=True, transfer=True, timestamp_bits=64),
        QueueFamily(1, 2, graphics=False, compute=False, transfer=True, timestamp_bits=64),
        QueueFamily(2, 8, graphics=False, compute=True, transfer=True, timestamp_bits=64),
    )
    assert choose_upload_queue(h100, 2, timeline=True) == (1, 0)
    assert choose_upload_queue(h100[::2], 2, timeline=True) == (2, 1)
    lavapipe = (QueueFamily(0, 1, graphics=True, compute=True, transfer=True, timestamp_bits=64),)
    assert choose_upload_queue(lavapipe, 0, timeline=True) == (0, 0)
    assert choose_upload_queue(h100, 2, timeline=False) == (2, 0)  # one queue orders itself


def test_queue_order_waits_only_where_a_buffer_is_shared_and_only_once():
    order = QueueOrder()
    assert order.upload(("batch", 0), 1) == 0  # nothing used the buffer yet
    assert order.upload(("batch", 1), 2) == 0
    assert order.program({("work", 0)}, 1) == 0  # binds no uploaded buffer
    assert order.program({("batch", 0), ("work", 0)}, 2) == 1  # read after the upload
    assert order.program({("batch", 0), ("work", 0)}, 3) == 0  # the queue already waited
    assert order.program({("batch", 1)}, 4) == 2
    assert order.upload(("batch", 0), 3) == 3  # write after the read of ticket 3
    assert order.upload(("batch", 0), 4) == 0  # the transfer queue already waited
    assert order.upload(("work", 0), 5) == 0  # ticket 3 bound it too: covered by that wait
    assert order.upload(("batch", 1), 6) == 4
    assert order.program({("work", 0)}, 5) == 5

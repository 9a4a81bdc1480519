"""Queue decisions, as pure code: which queues run compute and uploads, and which timeline value
each submission must wait for.

Nothing here touches a device or imports the Vulkan binding (tests/test_layers.py checks it), so
the policy is tested from QueueFamily records alone on machines with no Vulkan at all, including
the multi-queue cases (an H100's transfer-only family) that lavapipe's single queue never reaches.
The queues module asks and then acts, as ``actors/memory.py`` is asked about memory.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from flow.device_facts import QueueFamily

# Upload tickets count on the transfer queue's own timeline; offsetting them keeps them apart from
# the compute queue's tickets (1, 2, ...), so one ``wait``/``is_done`` serves both kinds.
UPLOAD_TICKETS = 1 << 62


def choose_compute_family(families: Sequence[QueueFamily]) -> int:
    """The family whose queue 0 runs programs.

    A compute-only family avoids sharing a queue with graphics work where the device has one.

    Args:
        families: the device's queue families; at least one computes (enumeration keeps only
            such devices).

    Returns:
        The family's index.
    """
    return min((f for f in families if f.compute), key=lambda f: (f.graphics, f.index)).index


def choose_upload_queue(
    families: Sequence[QueueFamily], compute_family: int, timeline: bool
) -> tuple[int, int]:
    """The (family, queue index) that runs uploads.

    A transfer-only family is the copy engines: DMA beside the compute units, as CUDA's copies on a
    side stream use. Else a second queue of the compute family still lets copies overlap compute.
    Else (lavapipe has one queue), or without timeline semaphores to order two queues, uploads
    share the compute queue, where submission order and the programs' barriers order them.

    Args:
        families: the device's queue families.
        compute_family: index of the family the compute queue comes from (its queue 0).
        timeline: whether the device has timeline semaphores.

    Returns:
        (queue family index, queue index within it).
    """
    if timeline:
        for family in families:
            if family.transfer and not family.compute and not family.graphics and family.count > 0:
                return family.index, 0
        if any(f.index == compute_family and f.count > 1 for f in families):
            return compute_family, 1
    return compute_family, 0


def upload_queue_name(compute_family: int, upload_family: int, upload_index: int) -> str:
    """How benchmarks and error messages name the upload queue ``choose_upload_queue`` picked."""
    if upload_family != compute_family:
        return f"transfer-only family {upload_family}"
    if upload_index:
        return f"compute family {compute_family}, queue {upload_index}"
    return f"the compute queue (family {compute_family})"


class QueueOrder:
    """Which timeline value a submission must wait for, so that uploads (transfer queue) and
    programs (compute queue) that touch the same buffer run in the order they were submitted.

    Pure bookkeeping keyed by buffer, called under the backend's submit lock: a program waits for
    the latest upload into any buffer it binds (read after write); an upload waits for the latest
    program that binds its destination (write after read: a step still reading the last batch).
    A wait also orders everything submitted later on the same queue, so a value already waited
    for on that queue is never waited for again.
    """

    def __init__(self) -> None:
        self._uploaded: dict[Hashable, int] = {}  # buffer -> transfer value of its latest upload
        self._used: dict[Hashable, int] = {}  # buffer -> compute ticket of its latest program
        self._compute_waited = 0
        self._transfer_waited = 0

    def program(self, buffers: Iterable[Hashable], ticket: int) -> int:
        """Note a program submitted as ``ticket`` binding ``buffers``.

        Returns:
            The upload value it must wait for on the transfer timeline; 0 for none.
        """
        need = 0
        for buffer in buffers:
            need = max(need, self._uploaded.get(buffer, 0))
            self._used[buffer] = ticket
        if need <= self._compute_waited:
            return 0
        self._compute_waited = need
        return need

    def upload(self, buffer: Hashable, value: int) -> int:
        """Note an upload into ``buffer`` signalling ``value`` on the transfer timeline.

        Returns:
            The compute ticket it must wait for; 0 for none.
        """
        self._uploaded[buffer] = value
        need = self._used.get(buffer, 0)
        if need <= self._transfer_waited:
            return 0
        self._transfer_waited = need
        return need

"""What each actor reports about itself: a frozen :class:`ActorStatistics` record.

The counting happens in :class:`actors.meter.Meter`, through which every actor moves its items;
``Meter.statistics()`` returns this record, safe to hand to the sink or a test while the actor
keeps running. It lives apart from the meter so that what reads the figures (the sink, tests, tools)
depends on the record only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ActorStatistics:
    """One actor's counters at a moment.

    The actor's lifetime (``seconds``) is split into three states that add up to it exactly:
    ``busy_seconds + idle_seconds + blocked_seconds == seconds``. At each moment the actor is in one:

    - busy: working: its own code, the work it sends to threads, and (the device actor) a step it
      submitted running on the device;
    - blocked: waiting for room downstream: a send to a full outbox (backpressure from a slower
      consumer), or a free device slot;
    - idle: waiting for input from an empty inbox (a slower producer), and nothing else.

    Where an actor's tasks overlap (the device actor's feeder waits for input while its completer
    waits for the GPU) busy wins over blocked, and blocked over idle. So a high ``blocked_seconds``
    points downstream, a high ``idle_seconds`` upstream, and the busiest actor is the bottleneck.

    Attributes:
        name: the pipeline node's name.
        seconds: the actor's lifetime: from when it started (entered its meter) to its end, or to
            now while it runs.
        items_in: items taken from the inbox.
        items_out: items sent (one per item, however many outboxes it went to).
        busy_seconds: time working (see above).
        idle_seconds: time waiting for input, and nothing else.
        blocked_seconds: time waiting for room downstream, and not busy.
        inbox_used: items waiting in the inbox now.
        inbox_capacity: the inbox's capacity (0 for an actor without one).
        inbox_peak: the most items seen waiting in the inbox.
        outbox_used: items waiting in the fullest outbox now.
        outbox_peak: the most items seen waiting in any outbox.
        thread_items: items whose blocking work went to a worker thread (the loader's reads, the
            preprocess actor's transforms: see actors.inline); 0 for actors without such work.
            Reported because cheap reads sent to threads once nearly halved a fast GPU's step
            rate (each costs the event loop a hop and GIL handoffs).
    """

    name: str
    seconds: float = 0.0
    items_in: int = 0
    items_out: int = 0
    busy_seconds: float = 0.0
    idle_seconds: float = 0.0
    blocked_seconds: float = 0.0
    inbox_used: int = 0
    inbox_capacity: int = 0
    inbox_peak: int = 0
    outbox_used: int = 0
    outbox_peak: int = 0
    thread_items: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The record as plain data (for JSON lines); times rounded to microseconds."""
        out: dict[str, Any] = {}
        for key, value in self.__dict__.items():
            out[key] = round(value, 6) if isinstance(value, float) else value
        return out

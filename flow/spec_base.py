"""The base of every spec record and the one type records of several kinds share.

:class:`Record` turns lists into tuples, so that a hand-written spec stays hashable and equal to
the same spec decoded from a file. The records themselves are in :mod:`flow.spec_model` (the
network), :mod:`flow.spec_data` (sources, transforms, batching) and :mod:`flow.spec` (the rest of
the job, and the one module users import records from).
"""

from dataclasses import fields

# A field added after schema 1 is left out of a file while it holds its default (flow.codec), so
# that a spec that does not use it is written exactly as before: ``field(default=..., metadata=LATER)``.
LATER = {"omit_when_default": True}

# One sample's shape without the batch dimension.
Shape = tuple[int, ...]


class Record:
    """Base of every spec record: turns lists into tuples so hand-written specs stay hashable and
    equal to the same spec decoded from a file."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, _tuplify(value))


def _tuplify(value: list) -> tuple:
    return tuple(_tuplify(v) if isinstance(v, list) else v for v in value)

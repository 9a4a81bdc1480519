"""What tests of whole runs share: the check that a run leaves no vkflow thread behind, the
comparison of two runs' weights, and a Ctrl-C at a chosen step."""

from __future__ import annotations

import threading

import numpy as np

from actors.messages import StepDone
from actors.meter import Hooks


def vkflow_threads(existing: frozenset[threading.Thread] = frozenset()) -> list[str]:
    """vkflow's worker threads alive now, except those in ``existing`` (a snapshot taken when the
    test began: sources other tests left to the garbage collector are not this run's leak)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("vkflow") and t not in existing]


def thread_snapshot() -> frozenset[threading.Thread]:
    return frozenset(threading.enumerate())


def assert_same_weights(a: dict[str, np.ndarray], b: dict[str, np.ndarray], rtol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if rtol == 0.0:
            assert np.array_equal(a[name], b[name]), name
        else:
            scale = max(float(np.abs(b[name]).max()), 1e-12)
            assert float(np.abs(a[name] - b[name]).max()) / scale <= rtol, name


class InterruptAt(Hooks):
    """Raises KeyboardInterrupt in the sink when step ``step`` arrives, as Ctrl-C would."""

    def __init__(self, step: int) -> None:
        self.step = step

    async def received(self, actor, item) -> None:
        if actor == "sink" and isinstance(item, StepDone) and item.step == self.step:
            raise KeyboardInterrupt

"""The optimiser's effects: the lifecycle of its state on a device, and its actor.

The update math runs on the device inside the recorded training step, and what the optimiser
record means (schedules, step values, state arenas, the update launch, the checkpoint's
compatibility check) is decided in flow.optim. What lives here is what the host does:
:func:`start` initialises or restores weights and optimiser state on an Engine and says where the
run stands. The :class:`OptimiserActor` follows the completed steps: it checks that every update is
applied exactly once and in order (a lost or repeated step breaks exact resume) and reports the
learning rate in its statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from actors.engine import Engine
from actors.messages import Cursor, StepDone
from actors.meter import Meter
from actors.statistics import ActorStatistics
from flow.optim import device_learning_rate
from flow.spec import Optimiser


def start(
    engine: Engine,
    scheme: str,
    seed: int,
    saved: dict[str, np.ndarray] | None = None,
    cursor: Cursor | None = None,
) -> Cursor:
    """Put weights and optimiser state on the device: fresh, or restored from a checkpoint.

    Args:
        engine: the engine.
        scheme: weight initialisation ("he" or "xavier"), for a fresh start.
        seed: initialisation seed, for a fresh start.
        saved: a checkpoint's state, to restore instead.
        cursor: where that checkpoint stood.

    Returns:
        Where the run stands: Cursor() when fresh.

    Raises:
        ValueError: a saved state that does not fit the engine's plan (flow.optim.check_compatible).
    """
    engine.initialise(scheme, seed)  # also zeroes the gradient arena, which a restore does not hold
    if saved is None:
        return Cursor()
    engine.load_state(saved)  # checks that the whole state fits before writing any of it
    return cursor or Cursor()


@dataclass(frozen=True)
class OptimiserStatistics(ActorStatistics):
    """ActorStatistics plus the optimiser's own counters.

    Attributes:
        updates: steps applied since this process started.
        step: the last step applied (-1 before the first).
        lr: its learning rate.
    """

    updates: int = 0
    step: int = -1
    lr: float = 0.0


class OptimiserActor:
    """Follows completed steps (see the module docstring).

    Args:
        meter: its ports (inbox from the device; outboxes usually none).
        optimiser: the spec's optimiser.
        first_step: the step the run starts at (after a resume, the checkpoint's step).
    """

    def __init__(self, meter: Meter, optimiser: Optimiser, first_step: int = 0) -> None:
        self.meter = meter
        self.optimiser = optimiser
        self.expected = first_step
        self.updates = 0
        self.lr = device_learning_rate(optimiser, first_step)

    async def run(self) -> None:
        """Check each StepDone until the inbox ends; forward everything it receives."""
        async with self.meter:
            async for item in self.meter:
                if isinstance(item, StepDone):
                    with self.meter.busy():
                        if item.step != self.expected:
                            raise RuntimeError(
                                f"update {item.step} arrived where update {self.expected} was due"
                            )
                        self.expected += 1
                        self.updates += 1
                        self.lr = item.lr
                await self.meter.pass_on(item)

    def statistics(self) -> OptimiserStatistics:
        base = self.meter.statistics()
        return OptimiserStatistics(**base.__dict__, updates=self.updates, step=self.expected - 1, lr=self.lr)

"""The optimiser: its learning-rate schedule, the lifecycle of its state, and its actor.

The update math runs on the device inside the recorded training step; what lives here is what
the host owns. The schedule's per-step input to the shaders (learning rate and bias corrections)
is ``actors.engine.step_values``, which the Engine writes into the slot's ``stepvals`` at submit,
so nothing is re-recorded. :func:`start` initialises or restores weights and optimiser state on an Engine and
says where the run stands; :func:`describe` and :func:`check_compatible` are what a checkpoint
records about the optimiser and what a restore checks. The :class:`OptimiserActor` follows the
completed steps: it checks that every update is applied exactly once and in order (a lost or
repeated step breaks exact resume) and reports the learning rate in its statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from actors.engine import Engine
from actors.messages import Cursor, StepDone
from actors.statistics import ActorStatistics, Meter
from flow.spec import Optimiser, learning_rate


def lr(optimiser: Optimiser, step: int) -> float:
    """The learning rate of update ``step`` as the device sees it (rounded to float32).

    Args:
        optimiser: the spec's optimiser.
        step: the update's index.

    Returns:
        The learning rate.
    """
    return float(np.float32(learning_rate(optimiser, step)))


def describe(optimiser: Optimiser, state_names: tuple[str, ...]) -> dict[str, Any]:
    """What a checkpoint records about the optimiser, besides its arrays.

    Args:
        optimiser: the spec's optimiser.
        state_names: the plan's optimiser state arenas.

    Returns:
        {"kind": class name, "state": [arena names]}.
    """
    return {"kind": type(optimiser).__name__, "state": list(state_names)}


def check_compatible(engine: Engine, state: dict[str, np.ndarray]) -> None:
    """Refuse a saved state that does not fit this plan, before anything is written.

    Args:
        engine: the engine to restore into.
        state: ``params:all`` and ``state:<name>`` arrays from a checkpoint.

    Raises:
        ValueError: naming the arrays that are missing, extra or of the wrong size.
    """
    expected = {"params:all", *(f"state:{s}" for s in engine.plan.state_names)}
    problems = []
    if set(state) != expected:
        problems.append(f"holds {sorted(state)}, this plan needs {sorted(expected)}")
    for name in sorted(expected & set(state)):
        array = state[name]
        if array.dtype != np.float32 or array.size != engine.plan.total_params:
            problems.append(
                f"{name}: {array.dtype} x {array.size}, needs float32 x {engine.plan.total_params}"
            )
    if problems:
        raise ValueError("checkpoint does not fit this model and optimiser: " + "; ".join(problems))


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
    """
    engine.initialise(scheme, seed)  # also zeroes the gradient arena, which a restore does not hold
    if saved is None:
        return Cursor()
    check_compatible(engine, saved)
    engine.load_state(saved)
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
        self.lr = lr(optimiser, first_step)

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
                await self.meter.send(item)

    def statistics(self) -> OptimiserStatistics:
        base = self.meter.statistics()
        return OptimiserStatistics(**base.__dict__, updates=self.updates, step=self.expected - 1, lr=self.lr)

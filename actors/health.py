"""Health checks of a training run: pure decisions on what its numbers say, so that a run which
cannot learn says so instead of training at chance in silence, and a diverged run stops.

- :func:`input_statistics` measures a batch's inputs after preprocessing; the preprocess actor
  measures the run's first training batch and sends the record down the stream, ahead of it.
- :func:`input_warnings` says what in that range looks wrong: inputs that are (nearly) constant,
  or so small that they were probably scaled twice (``Scale(1/255)`` on a source that already
  gives [0, 1]: the model then trains at chance, with no error).
- :class:`ChanceWatch` follows a CrossEntropy run's training loss and says when a whole epoch's
  mean sits at ln(classes), the loss of a uniform guess.
- :func:`nonfinite_message` and :class:`NonFiniteLoss`: what a run says, or raises, when a step's
  loss is NaN or infinite (``run.on_nonfinite``).

The sink acts on the decisions: it logs each warning to the ``vkflow`` logger (stderr unless the
program configures logging) and writes it to the metrics file as a ``"warning"`` event.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from actors.messages import Batch, InputStatistics, StepDone
from flow.shapes import infer_shapes
from flow.spec_model import CrossEntropy, Model

# Inputs whose largest magnitude is below this are "tiny". Sources give 8-bit data in [0, 1] and
# Normalize gives std ~1, so real inputs reach far beyond it; [0, 1] data divided by 255 again
# stays below 1/255 = 0.0039.
TINY = 0.02
# Inputs whose std is below this fraction of their largest magnitude are "constant": the model
# sees the same input for every sample (a broken decode, a Scale(0), all-zero files).
CONSTANT = 1e-4
# At most this many values (evenly strided) give the mean and std, so that measuring a huge first
# batch costs milliseconds, not a copy of it in float64; min and max always see every value.
SAMPLE_VALUES = 1 << 20
# An epoch's mean loss within this fraction of ln(classes) is "at chance".
CHANCE_BAND = 0.01
# Epochs of fewer steps give no verdict: so few updates barely move the initial weights, whose
# loss is ln(classes) by design.
CHANCE_MIN_STEPS = 10


class NonFiniteLoss(FloatingPointError):
    """A training step's loss was NaN or infinite, and ``run.on_nonfinite`` is "raise".

    Attributes:
        step: the step's 0-based index.
        epoch: its epoch.
        loss: the loss it reported.
    """

    def __init__(self, message: str, step: int, epoch: int, loss: float) -> None:
        super().__init__(message)
        self.step = step
        self.epoch = epoch
        self.loss = loss


def input_statistics(batch: Batch) -> InputStatistics:
    """The range of a batch's inputs.

    Args:
        batch: a batch of at least one row (after preprocessing: what the model sees).

    Returns:
        Its statistics over every value (mean and std over at most SAMPLE_VALUES of them).
    """
    x = np.asarray(batch.x).reshape(-1)
    sample = x[:: max(1, x.size // SAMPLE_VALUES)]
    return InputStatistics(
        step=batch.step,
        epoch=batch.epoch,
        rows=batch.rows,
        min=float(x.min()),
        max=float(x.max()),
        mean=float(sample.mean(dtype=np.float64)),
        std=float(sample.std(dtype=np.float64)),
    )


def input_warnings(stats: InputStatistics) -> tuple[str, ...]:
    """What looks wrong in the inputs' range.

    Args:
        stats: the first training batch's statistics after preprocessing.

    Returns:
        One message per problem (none for healthy inputs).
    """
    where = (
        f"the first training batch after preprocessing lies in [{stats.min:.4g}, {stats.max:.4g}] "
        f"(mean {stats.mean:.4g}, std {stats.std:.3g})"
    )
    largest = max(abs(stats.min), abs(stats.max))
    if not math.isfinite(largest):
        return (f"the inputs are not finite: {where}; check the source and data.preprocess",)
    if stats.std <= CONSTANT * largest or largest == 0.0:
        return (
            f"the inputs are constant: {where}, so every sample looks the same to the model; check "
            "the source's files and data.preprocess",
        )
    if largest < TINY:
        return (
            f"the inputs are tiny: {where}. Sources already give 8-bit data (images, uint8 IDX and "
            "RawBinary) as floats in [0, 1]; Scale(1/255) on top leaves them below 0.004 and the "
            "model trains at chance. Check data.preprocess",
        )
    return ()


def classes_of(model: Model) -> int | None:
    """The classes of a CrossEntropy model (its output units); None for another loss.

    Args:
        model: a valid model.

    Returns:
        The class count, or None.
    """
    if not isinstance(model.loss, CrossEntropy):
        return None
    shapes = infer_shapes(model)
    return int(shapes[-1][-1]) if shapes else None  # the last dimension: a per-token model's too


@dataclass
class ChanceWatch:
    """Sums one epoch's training loss at a time and judges each epoch as it ends.

    Attributes:
        classes: the model's classes (>= 2).
        epoch: the epoch being summed (None before the first step).
        loss: sum of loss * rows over its steps so far.
        rows: rows summed.
        steps: steps summed.
    """

    classes: int
    epoch: int | None = None
    loss: float = 0.0
    rows: int = 0
    steps: int = 0

    def add(self, done: StepDone) -> str | None:
        """Count a step; the first step of a new epoch ends the one before.

        Args:
            done: the step, in step order.

        Returns:
            The warning for the epoch that just ended, if its mean loss sat at chance; else None.
        """
        message = None
        if done.epoch != self.epoch:
            message = self.finish()
            self.epoch, self.loss, self.rows, self.steps = done.epoch, 0.0, 0, 0
        if done.rows:  # a batch whose samples were all skipped has a NaN loss and no weight
            self.loss += done.loss * done.rows
            self.rows += done.rows
            self.steps += 1
        return message

    def finish(self) -> str | None:
        """Judge the epoch being summed (at the run's end, for its last epoch).

        Returns:
            The warning if its mean loss sat within CHANCE_BAND of ln(classes); else None.
        """
        if self.epoch is None or self.steps < CHANCE_MIN_STEPS:
            return None
        mean = self.loss / self.rows
        chance = math.log(self.classes)
        if not abs(mean - chance) <= CHANCE_BAND * chance:  # NaN: not at chance (its own report)
            return None
        return (
            f"the mean training loss of epoch {self.epoch} is {mean:.4f}, within "
            f"{CHANCE_BAND:.0%} of ln({self.classes}) = {chance:.4f}, the loss of a uniform guess: "
            "the model is not learning. Check the inputs' range (the run's \"inputs\" report) and "
            "the learning rate"
        )


def nonfinite_message(done: StepDone, continuing: bool) -> str:
    """What to say about a step whose loss is NaN or infinite.

    Args:
        done: the step.
        continuing: whether the run trains on (``run.on_nonfinite="continue"``).

    Returns:
        One line naming the step.
    """
    where = (
        f"the training loss is {done.loss} at step {done.step} "
        f"(epoch {done.epoch}, learning rate {done.lr:g})"
    )
    if continuing:
        return f"{where}; training goes on (run.on_nonfinite='continue'), and later ones are not reported"
    return (
        f"{where}: the run diverged, or its data holds NaN. Lower the learning rate, or set "
        "run.on_nonfinite='continue' to train on"
    )

"""The records that travel on the runtime's channels, from the loader down to the sink.

Every message is a frozen dataclass: an actor never changes what it received, it sends a new
record. Arrays ride along by reference (numpy arrays are not frozen, so actors treat them as
read-only by convention and make new ones). Order on a channel is the order of the run: the loader
emits the whole schedule (training batches, evaluation batches, checkpoint marks) and every actor
keeps that order, so the device needs no reordering and a checkpoint mark is consistent by
construction.

Several messages may travel as one channel item, a :class:`Chunk`: a channel hop and the trio
turns around it cost more on a slow host than a fast GPU's step, so an actor that has several
messages ready at once sends them together (see actors.meter). Receivers never see a chunk: the
meter hands its messages out one by one.

A batch the loader filled in place (``Batch.slot`` >= 0) holds views of a device input slot: its
arrays are valid until the device has run that step, after which the slot is filled again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

SplitName = Literal["train", "val", "test", "predict"]


@dataclass(frozen=True)
class Cursor:
    """Where a training run stands, between two steps.

    Attributes:
        step: training steps done (the next step's 0-based index).
        epoch: the epoch of the next batch, or of the last one while ``position`` is at its end.
        position: training batches of ``epoch`` already taken (the sampler's position).
    """

    step: int = 0
    epoch: int = 0
    position: int = 0


@dataclass(frozen=True, eq=False)
class Batch:
    """One batch on its way to the device.

    Attributes:
        seq: sequence number in the stream (0, 1, ... for this run or feed).
        epoch: the epoch it was drawn in.
        position: its position in the epoch (sampler position before it).
        indices: the sample indices (into the source), or the rows of a fed array.
        x: float32 inputs [n, *input_shape]; None where the dataset is kept on the device (the
            device gathers the rows of ``indices`` itself).
        y: labels or targets [n, ...]; None for prediction and for a dataset on the device.
        split: "train", "val" or "test" (evaluation) or "predict".
        step: for "train", the step it is; for "val" and "test", the steps done when the evaluation
            runs.
        last: the last batch of its evaluation round, or of its fed array.
        tag: for "predict", which fed array it belongs to.
        slot: the device input slot ``x`` and ``y`` were read straight into (views of its memory),
            or -1 for arrays of their own that the device copies in.
    """

    seq: int
    epoch: int
    position: int
    indices: np.ndarray
    x: np.ndarray | None
    y: np.ndarray | None
    split: SplitName = "train"
    step: int = 0
    last: bool = False
    tag: int = 0
    slot: int = -1

    @property
    def rows(self) -> int:
        return int(self.x.shape[0]) if self.x is not None else int(len(self.indices))

    def after(self) -> Cursor:
        """The cursor once this training batch has been applied."""
        return Cursor(self.step + 1, self.epoch, self.position + 1)


@dataclass(frozen=True)
class CheckpointMark:
    """A point in the stream where the weights are consistent with ``cursor``: every training batch
    before the mark has been applied and none after it. The device snapshots there.

    Attributes:
        cursor: where the run stands at the mark.
        final: the end of the run (the last mark; the run's result comes from its snapshot).
        best_only: a validation round's weights for ``best.ckpt`` only (flow.spec.SaveBest), not
            a regular checkpoint.
    """

    cursor: Cursor
    final: bool = False
    best_only: bool = False


@dataclass(frozen=True)
class StepDone:
    """A finished training step, reported in step order.

    Attributes:
        step: the step's 0-based index.
        epoch: its epoch.
        position: its batch position in the epoch.
        loss: mean loss over the batch.
        correct: correctly classified rows (0 for regression).
        rows: rows in the batch.
        lr: the learning rate the update used.
        finished: ``time.monotonic()`` when the device actor saw the step done (0: unknown). Steps
            travel in chunks, so the sink takes the time from here, not from their arrival.
        metrics: the model's on-device metric values (flow.metrics.on_device's order; empty
            without metrics).
    """

    step: int
    epoch: int
    position: int
    loss: float
    correct: float
    rows: int
    lr: float
    finished: float = 0.0
    metrics: tuple[float, ...] = ()


@dataclass(frozen=True)
class EvalDone:
    """One evaluation over the validation split (during the run) or the test split (at its end).

    Attributes:
        step: training steps done when it ran.
        epoch: the epoch of the last training batch before it.
        loss: mean loss per sample.
        accuracy: correct / samples (NaN for regression).
        samples: rows evaluated.
        split: "val" or "test".
        metrics: each of the model's metrics by name ("top5", "mae", "rmse", "perplexity").
    """

    step: int
    epoch: int
    loss: float
    accuracy: float
    samples: int
    split: str = "val"
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Snapshot:
    """Weights and optimiser state at a checkpoint mark, for the sink to write.

    Attributes:
        cursor: where the run stands (see CheckpointMark).
        state: Engine.state(): ``params:all`` and ``state:<name>`` flat float32 arrays.
        final: the end of the run.
        interrupted: taken after an interruption rather than at a scheduled mark.
        best_only: taken at a best-only mark (CheckpointMark.best_only).
    """

    cursor: Cursor
    state: dict[str, np.ndarray] = field(repr=False)
    final: bool = False
    interrupted: bool = False
    best_only: bool = False


@dataclass(frozen=True)
class InputStatistics:
    """The range of one training batch's inputs after preprocessing (what the model sees): the
    preprocess actor measures the run's first training batch and sends this ahead of it.

    Attributes:
        step: the batch's step.
        epoch: its epoch.
        rows: its rows.
        min: the smallest input value.
        max: the largest.
        mean: the mean value.
        std: the standard deviation of the values.
    """

    step: int
    epoch: int
    rows: int
    min: float
    max: float
    mean: float
    std: float


@dataclass(frozen=True, eq=False)
class Prediction:
    """The predict program's output for one fed batch.

    Attributes:
        seq: the batch's sequence number.
        tag: which fed array it belongs to.
        last: the last batch of that array.
        outputs: [rows, *output_shape] (probabilities for CrossEntropy models).
    """

    seq: int
    tag: int
    last: bool
    outputs: np.ndarray


class Chunk(tuple):
    """Several messages, in stream order, sent as one channel item (never empty, never nested)."""

    __slots__ = ()


def unpack(item: object) -> tuple:
    """The messages of one channel item: a chunk's, or the item alone."""
    return item if type(item) is Chunk else (item,)


@dataclass(frozen=True)
class Profile:
    """RunSettings(profile=True): the GPU time of each launch of the training step, from timestamp
    queries, sent by the device once its last step is done.

    Attributes:
        launches: (name, op, median seconds) per launch of the train program, in program order;
            the name is ``<position>:<op>``.
        steps: the training steps timed.
        note: why nothing was timed (the backend has no timestamp queries), else "".
    """

    launches: tuple[tuple[str, str, float], ...]
    steps: int
    note: str = ""


Message = Batch | CheckpointMark | StepDone | EvalDone | InputStatistics | Snapshot | Prediction | Profile

"""The data half of a run's plan: which samples train, validate and test, in what batches, for
how many steps, with evaluations and checkpoints when. Pure: it is computed from the spec and the
source's header (:class:`SourceHeader`: a few facts an open source reports without reading a
sample), so ``flow plan`` prints it and a mistake in it (a split with no training batch, data the
model cannot take) is refused before any device work. The loader only follows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from flow.errors import PlanError, Problem, SpecError
from flow.spec import Spec
from flow.validation import data_problems
from loaders.sampler import Sampler
from loaders.splits import split_indices

SPLITS = ("train", "val", "test")


@dataclass(frozen=True, eq=False)
class SourceHeader:
    """What the plan needs to know about an open source, read without touching a sample.

    Attributes:
        samples: how many samples it has.
        sample_shape: the shape of one sample as the source emits it.
        num_classes: classes for a classifier's labels; None for regression targets.
        labels: every sample's label (splits are stratified by them).
        label_shape: the shape of one sample's label (() for a class id or one target).
        reads_in_place: whether it can read a batch straight into caller-owned arrays
            (``read_into``), such as a device's mapped input slot.
    """

    samples: int
    sample_shape: tuple[int, ...]
    num_classes: int | None
    labels: np.ndarray
    label_shape: tuple[int, ...] = ()
    reads_in_place: bool = False


def header_of(source: Any) -> SourceHeader:
    """The header of an open source (loaders.Source).

    Args:
        source: the open source.

    Returns:
        Its header.
    """
    labels = np.asarray(source.labels)
    return SourceHeader(
        samples=len(source),
        sample_shape=tuple(int(d) for d in source.sample_shape),
        num_classes=source.num_classes,
        labels=labels,
        label_shape=tuple(labels.shape[1:]),
        reads_in_place=callable(getattr(source, "read_into", None)),
    )


@dataclass(frozen=True)
class StepSchedule:
    """What a training run does, in steps.

    Attributes:
        batches_per_epoch: training batches per epoch.
        total_steps: steps in the whole run.
        eval_every: evaluate every this many steps; None: at the end of each epoch.
        checkpoint_every: mark a checkpoint every this many steps; None: only at the end.
        has_val: whether there is a validation split to evaluate on.
    """

    batches_per_epoch: int
    total_steps: int
    eval_every: int | None = None
    checkpoint_every: int | None = None
    has_val: bool = False


def total_steps(epochs: int | None, steps: int | None, batches_per_epoch: int) -> int:
    """Steps in a run that stops at ``epochs`` or ``steps``, whichever comes first.

    Args:
        epochs: epochs to run, or None.
        steps: steps to run, or None.
        batches_per_epoch: training batches per epoch.

    Returns:
        The number of training steps.
    """
    limits = [s for s in (steps, None if epochs is None else epochs * batches_per_epoch) if s is not None]
    return min(limits) if limits else 0


@dataclass(frozen=True, eq=False)
class DataPlan:
    """The run's data: the splits as sample indices, how they are batched, and the schedule.

    Attributes:
        samples: samples in the source.
        splits: sorted sample indices of each of SPLITS (empty where the split is 0).
        batch_size: rows a batch.
        shuffle: whether training batches are drawn in a new order each epoch.
        seed: the seed of the splits and the shuffles.
        drop_last: whether an epoch's final partial training batch is left out.
        schedule: steps, evaluations and checkpoints.
    """

    samples: int
    splits: dict[str, np.ndarray]
    batch_size: int
    shuffle: bool
    seed: int
    drop_last: bool
    schedule: StepSchedule

    def sampler(self, split: str) -> Sampler | None:
        """The sampler of ``split``: training shuffles (when asked) and may drop its last partial
        batch; validation and test keep their order and every sample. None for an empty split.

        Args:
            split: one of SPLITS.

        Returns:
            The sampler, or None.
        """
        indices = self.splits[split]
        if not indices.size:
            return None
        if split == "train":
            return Sampler(indices, self.batch_size, self.shuffle, self.seed, self.drop_last)
        return Sampler(indices, self.batch_size, False, self.seed, False)

    def as_dict(self) -> dict:
        """The plan as plain data: sizes and batches (the indices themselves are left out)."""
        splits = {}
        for name in SPLITS:
            sampler = self.sampler(name)
            size = int(self.splits[name].size)
            full, tail = divmod(size, self.batch_size)
            if name == "train" and self.drop_last:
                tail = 0
            splits[name] = {
                "samples": size,
                "batches": sampler.batches_per_epoch() if sampler else 0,
                "last_batch_rows": tail or (self.batch_size if full else 0),
            }
        schedule = self.schedule
        return {
            "samples": self.samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "splits": splits,
            "steps": schedule.total_steps,
            "batches_per_epoch": schedule.batches_per_epoch,
            "eval_every": schedule.eval_every if schedule.has_val else None,
            "checkpoint_every": schedule.checkpoint_every,
        }


def plan_data(spec: Spec, header: SourceHeader) -> DataPlan:
    """Split, batch and schedule the data of ``spec`` as its source's header describes it.

    Args:
        spec: a valid spec.
        header: its source's header.

    Returns:
        The data plan.

    Raises:
        SpecError: the data does not fit the model (shape, classes, targets), every problem at once.
        PlanError: the training split holds no batch.
    """
    problems = data_problems(spec, header.sample_shape, header.num_classes, header.label_shape)
    if problems:
        raise SpecError(problems)
    data, split = spec.data, spec.data.split
    parts = split_indices(
        header.samples, header.labels, split.train, split.val, split.test, data.seed, split.stratify
    )
    train = Sampler(parts["train"], data.batch_size, data.shuffle, data.seed, data.drop_last)
    per_epoch = train.batches_per_epoch()
    if per_epoch == 0:
        raise PlanError(
            [
                Problem(
                    "data.batch_size",
                    f"the training split has {parts['train'].size} samples: no batch of "
                    f"{data.batch_size} (drop_last={data.drop_last})",
                )
            ]
        )
    run = spec.run
    schedule = StepSchedule(
        per_epoch,
        total_steps(run.epochs, run.steps, per_epoch),
        run.eval_every,
        run.checkpoint_every,
        bool(parts["val"].size),
    )
    return DataPlan(
        header.samples,
        {name: parts[name] for name in SPLITS},
        data.batch_size,
        data.shuffle,
        data.seed,
        data.drop_last,
        schedule,
    )

"""The data half of a run's plan: which samples train, validate and test, in what batches, for
how many steps, with evaluations and checkpoints when. Pure: it is computed from the spec and the
source's header (:class:`SourceHeader`: a few facts an open source reports without reading a
sample), so ``flow plan`` prints it and a mistake in it (a split with no training batch, data the
model cannot take: :func:`data_problems`, which ``flow check`` runs too) is refused before any
device work. The loader only follows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from flow.errors import PlanError, Problem, SpecError
from flow.shapes import infer_shapes
from flow.spec import SaveBest, Spec
from loaders.blocks import BlockSource
from loaders.sampler import RankSlices, Sampler
from loaders.splits import split_contiguous, split_indices

SPLITS = ("train", "val", "test")

# The block order (data.shuffle="blocks", loaders.sampler): big enough blocks for sequential I/O, a
# buffer (3 windows at most: loaders.blocks) far below the memory the data does not fit in.
BLOCK_BYTES = 32 << 20
BLOCK_WINDOW = 4


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
        stored_dtype: "uint8" or "float32" where the source can hand over its whole data as
            stored (``stored()``) to be kept on a device; None where it cannot.
        record_bytes: bytes of one stored sample, where the source says (None: taken as float32).
        mapped: reads may wait on a memory map that loaders.blocks can read ahead by slices.
        split_gap: where neighbouring samples share data (text windows): the samples each one shares
            it with on either side; its splits are then contiguous runs with these samples left out
            before each boundary (loaders.splits.split_contiguous). None: a shuffled split.
    """

    samples: int
    sample_shape: tuple[int, ...]
    num_classes: int | None
    labels: np.ndarray
    label_shape: tuple[int, ...] = ()
    reads_in_place: bool = False
    stored_dtype: str | None = None
    record_bytes: int | None = None
    mapped: bool = False
    split_gap: int | None = None


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
        stored_dtype=getattr(source, "stored_dtype", None),
        record_bytes=getattr(source, "record_bytes", None),
        mapped=callable(getattr(source, "read_rows", None)) and not getattr(source, "in_memory", True),
        split_gap=getattr(source, "split_gap", None),
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
        snapshot_evals: mark a snapshot after each validation round (a SaveBest callback's weights).
    """

    batches_per_epoch: int
    total_steps: int
    eval_every: int | None = None
    checkpoint_every: int | None = None
    has_val: bool = False
    snapshot_evals: bool = False


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
class ResidentData:
    """A dataset kept on the device for the whole run: uploaded once as stored, each step's first
    launch gathers its batch by index and applies the preprocessing as one affine map per channel.

    Attributes:
        samples: samples uploaded.
        sample_shape: the shape of one sample.
        dtype: "uint8" (8-bit data, as stored) or "float32".
        affine: (a_0, b_0, a_1, b_1, ...) float32-rounded: channel c's value is stored * a_c + b_c
            (the source's own scale, such as 8-bit data's 1/255, folded in).
    """

    samples: int
    sample_shape: tuple[int, ...]
    dtype: str
    affine: tuple[float, ...]

    @property
    def nbytes(self) -> int:
        return self.samples * math.prod(self.sample_shape) * (1 if self.dtype == "uint8" else 4)

    @property
    def channels(self) -> int:
        return len(self.affine) // 2

    def as_dict(self) -> dict:
        return {"dtype": self.dtype, "bytes": self.nbytes, "affine": list(self.affine)}


def fused_affine(
    stored_scale: float, transforms: tuple, sample_shape: tuple[int, ...]
) -> tuple[float, ...] | None:
    """The per-channel affine map that the source's scale followed by ``transforms`` make, or None
    when a transform is not a Scale or a Normalize. Composed in float64 and rounded once.

    Args:
        stored_scale: what the source multiplies stored values by (1/255 for 8-bit data).
        transforms: the spec's preprocess records.
        sample_shape: one sample's shape; channels are its first axis, as Normalize's are.

    Returns:
        (a_0, b_0, a_1, b_1, ...) for each channel, or None.
    """
    channels = sample_shape[0] if sample_shape else 1
    a = np.full(channels, float(np.float32(stored_scale)), np.float64)
    b = np.zeros(channels, np.float64)
    for transform in transforms:
        kind = type(transform).__name__
        if kind == "Scale":
            a, b = a * transform.factor, b * transform.factor
        elif kind == "Normalize":
            mean = np.broadcast_to(np.asarray(transform.mean, np.float64), (channels,))
            std = np.broadcast_to(np.asarray(transform.std, np.float64), (channels,))
            a, b = a / std, (b - mean) / std
        else:
            return None
    pairs = np.stack([a, b], axis=1).astype(np.float32).reshape(-1)
    return tuple(float(v) for v in pairs)


def resident_data(spec: Spec, header: SourceHeader) -> tuple[ResidentData | None, str]:
    """Whether the run can keep its data on the device (before the memory budget, which the
    device plan checks), and why not.

    Args:
        spec: a valid spec.
        header: its source's header.

    Returns:
        (the resident data, "") or (None, the reason it must stream).
    """
    data = spec.data
    if data.placement == "host":
        return None, "data.placement is 'host'"
    if header.stored_dtype is None:
        return None, f"the {type(data.source).__name__} source cannot hand over its whole data as stored"
    if data.augment:
        return None, "augmentations run on the host"
    if type(spec.model.loss).__name__ != "CrossEntropy" or header.label_shape != ():
        return None, "only one class id a sample is gathered on the device"
    scale = 1.0 / 255.0 if header.stored_dtype == "uint8" else 1.0
    affine = fused_affine(scale, data.preprocess, header.sample_shape)
    if affine is None:
        return None, "a preprocess transform other than Scale or Normalize runs on the host"
    return ResidentData(header.samples, header.sample_shape, header.stored_dtype, affine), ""


@dataclass(frozen=True, eq=False)
class DataPlan:
    """The run's data: the splits as sample indices, how they are batched, and the schedule.

    Attributes:
        samples: samples in the source.
        splits: sorted sample indices of each of SPLITS (empty where the split is 0).
        batch_size: rows a batch.
        shuffle: whether training batches are drawn in a new order each epoch ("blocks": the
            block order of ``block`` samples a block, see loaders.sampler).
        seed: the seed of the splits and the shuffles.
        drop_last: whether an epoch's final partial training batch is left out.
        schedule: steps, evaluations and checkpoints.
        resident: the dataset kept on the device, if any.
        rank: this process's rank in an MPI job: its samplers give its part of every batch.
        world: the number of ranks (1 without MPI).
        mapped: the source is memory-mapped (see :attr:`reads_ahead`).
        val_batches: the validation batches each evaluation reads, the first ones
            (``run.limit_val_batches``); None: all of them.
    """

    samples: int
    splits: dict[str, np.ndarray]
    batch_size: int
    shuffle: bool | str
    seed: int
    drop_last: bool
    schedule: StepSchedule
    resident: ResidentData | None = None
    rank: int = 0
    world: int = 1
    block: int | None = None
    mapped: bool = False
    val_batches: int | None = None

    @property
    def reads_ahead(self) -> bool:
        """The block order's windows are read ahead (loaders.blocks): only a memory map streamed
        from the host gains from it."""
        return self.block is not None and self.mapped and self.resident is None

    def block_source(self, source: Any) -> Any:
        """``source`` as the loader reads it (wrapped where :attr:`reads_ahead`)."""
        return BlockSource(source, self.sampler("train")) if self.reads_ahead else source

    def sampler(self, split: str) -> Sampler | RankSlices | None:
        """The sampler of ``split``: training shuffles (when asked) and may drop its last partial
        batch; validation and test keep their order and every sample. None for an empty split.
        In an MPI job, this rank's part of each (loaders.sampler.RankSlices).

        Args:
            split: one of SPLITS.

        Returns:
            The sampler, or None.
        """
        indices = self.splits[split]
        if split == "val" and self.val_batches is not None:
            indices = indices[: self.val_batches * self.batch_size]
        if not indices.size:
            return None
        if split == "train":
            sampler = Sampler(
                indices, self.batch_size, bool(self.shuffle), self.seed, self.drop_last,
                block=self.block, window=BLOCK_WINDOW,
            )  # fmt: skip
        else:
            sampler = Sampler(indices, self.batch_size, False, self.seed, False)
        return sampler if self.world == 1 else RankSlices(sampler, self.rank, self.world)

    def as_dict(self) -> dict:
        """The plan as plain data: sizes and batches (the indices themselves are left out)."""
        splits = {}
        for name in SPLITS:
            sampler = self.sampler(name)
            size = int(self.splits[name].size)
            if name == "val" and self.val_batches is not None:
                size = min(size, self.val_batches * self.batch_size)
            full, tail = divmod(size, self.batch_size)
            if name == "train" and self.drop_last:
                tail = 0
            splits[name] = {
                "samples": int(self.splits[name].size),
                "batches": sampler.batches_per_epoch() if sampler else 0,
                "last_batch_rows": tail or (self.batch_size if full else 0),
            }
        schedule, block, blocks = self.schedule, self.block, None
        if block is not None:
            count, ahead = -(-splits["train"]["samples"] // block), self.reads_ahead
            blocks = {"samples": block, "count": count, "window": BLOCK_WINDOW, "read_ahead": ahead}
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
            "val_batches": self.val_batches,
            "checkpoint_every": schedule.checkpoint_every,
            "on_device": None if self.resident is None else self.resident.as_dict(),
            "blocks": blocks,
        }


def data_problems(
    spec: Spec,
    sample_shape: tuple[int, ...],
    num_classes: int | None,
    label_shape: tuple[int, ...] = (),
) -> list[Problem]:
    """What is wrong between an opened source and the model, found before any device work.

    Args:
        spec: a valid spec.
        sample_shape: the source's decoded sample shape.
        num_classes: how many classes its labels hold (None for regression targets).
        label_shape: the shape of one sample's label: () for one number, (context,) for a Text
            source's class id per token.

    Returns:
        Every problem: a sample shape the model cannot take (checked when no transform resizes or
        crops), class labels beyond the last layer's units for CrossEntropy, and labels that are
        not one target per output for MSE.
    """
    problems = []
    transforms = (*spec.data.preprocess, *spec.data.augment)
    reshaping = any(type(t).__name__ in ("Resize", "RandomCrop", "Lambda") for t in transforms)
    if not reshaping and tuple(sample_shape) != tuple(spec.model.input_shape):
        problems.append(
            Problem(
                "model.input_shape",
                f"the source gives samples of shape {tuple(sample_shape)}, "
                f"but the model takes {tuple(spec.model.input_shape)}",
            )
        )
    shapes = infer_shapes(spec.model)
    outputs = shapes[-1] if shapes else tuple(spec.model.input_shape)
    if (
        type(spec.model.loss).__name__ == "CrossEntropy"
        and num_classes is not None
        and num_classes > outputs[-1]
    ):
        problems.append(
            Problem(
                f"model.layers[{len(spec.model.layers) - 1}]",
                f"the source has {num_classes} classes, but the model ends in {outputs[-1]} outputs",
            )
        )
    # CrossEntropy takes one class id per row of scores: a Text source's id per token needs a model
    # that ends in (context, classes), never one score row a sample.
    if (
        type(spec.model.loss).__name__ == "CrossEntropy"
        and num_classes is not None
        and tuple(label_shape) != tuple(outputs[:-1])
    ):
        problems.append(
            Problem(
                "model.loss",
                f"CrossEntropy needs one class id per row of the model's output {tuple(outputs)}, but the "
                f"source gives class ids of shape {tuple(label_shape)} a sample",
            )
        )
    # MSE compares each output with its own target. One label a sample against 10 outputs would
    # fill only the first rows' targets and train on nonsense without a word, so it is an error.
    loss = type(spec.model.loss).__name__
    if loss in ("MSE", "L1", "Huber", "BCEWithLogits") and math.prod(label_shape) != math.prod(outputs):
        labels = math.prod(label_shape)
        given = "one label" if labels == 1 else f"{labels} labels"
        kind = f"class ids of {num_classes} classes" if num_classes is not None else "targets"
        hint = "; for class labels use CrossEntropy()" if num_classes is not None else ""
        problems.append(
            Problem(
                "model.loss",
                f"{loss} needs one target per output, but the model ends in {math.prod(outputs)} outputs "
                f"and the source gives {given} a sample ({kind}){hint}",
            )
        )
    return problems


def plan_data(spec: Spec, header: SourceHeader, rank: int = 0, world: int = 1) -> DataPlan:
    """Split, batch and schedule the data of ``spec`` as its source's header describes it.

    Args:
        spec: a valid spec.
        header: its source's header.
        rank: this process's rank in an MPI job.
        world: the number of ranks (each takes its part of every global batch).

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
    if header.split_gap is not None:
        parts = split_contiguous(header.samples, split.train, split.val, split.test, header.split_gap)
    else:
        parts = split_indices(
            header.samples, header.labels, split.train, split.val, split.test, data.seed, split.stratify
        )
    train = Sampler(parts["train"], data.batch_size, bool(data.shuffle), data.seed, data.drop_last)
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
        any(isinstance(record, SaveBest) for record in run.callbacks),
    )
    return DataPlan(
        header.samples,
        {name: parts[name] for name in SPLITS},
        data.batch_size,
        data.shuffle,
        data.seed,
        data.drop_last,
        schedule,
        rank=rank,
        world=world,
        block=block_samples(header) if data.shuffle == "blocks" else None,
        mapped=header.mapped,
        val_batches=val_batches(run.limit_val_batches, parts["val"].size, data.batch_size),
    )


def val_batches(limit: int | float | None, samples: int, batch_size: int) -> int | None:
    """The validation batches each evaluation reads under ``run.limit_val_batches``.

    Args:
        limit: batches (an int), a fraction of them (a float; at least one batch), or None.
        samples: samples in the validation split.
        batch_size: rows a batch.

    Returns:
        The number of batches, None when every batch is read (no limit, or one past them).
    """
    batches = -(-samples // batch_size)
    if limit is None:
        return None
    wanted = limit if isinstance(limit, int) else max(1, int(batches * limit))
    return wanted if wanted < batches else None


def block_samples(header: SourceHeader) -> int:
    """Samples a block holds: BLOCK_BYTES of stored samples (float32 where the source does not say)."""
    record = header.record_bytes or 4 * math.prod(header.sample_shape)
    return max(1, BLOCK_BYTES // max(1, record))

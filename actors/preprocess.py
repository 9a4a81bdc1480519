"""The preprocess actor: runs the spec's numpy transforms on each batch, on the CPU.

``spec.data.preprocess`` applies to every batch; ``spec.data.augment`` to training batches only.
The random ones draw from ``batch_rng(seed, epoch, position)``, a pure function of where the batch
sits in the run, so a resumed run augments exactly as an uninterrupted one. The work itself is
:func:`transform_batch` (pure); the actor runs it in a worker thread under its own limiter so the
event loop stays free, or inline when it has measured it to be cheaper than the hop to a thread
(:class:`actors.inline.InlinePolicy`; its statistics count the batches that went to a thread,
``thread_items``). A batch no transform applies to, already float32 and of the model's shape,
passes through untouched, as does every other message, in order.

Ahead of the run's first training batch the actor sends its :class:`actors.messages.InputStatistics`
(the inputs' range after preprocessing), which the sink reports and checks (:mod:`actors.health`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import trio

from actors.health import input_statistics
from actors.inline import InlineOrThread, InlinePolicy
from actors.messages import Batch
from actors.meter import Meter
from actors.statistics import ActorStatistics
from loaders import apply_transforms, batch_rng


def transform_batch(
    batch: Batch,
    preprocess: Sequence[Any],
    augment: Sequence[Any],
    seed: int,
    input_shape: tuple[int, ...] | None = None,
) -> Batch:
    """A batch with the transforms applied (a new record; the input is not changed).

    Args:
        batch: the batch.
        preprocess: transform specs for every batch.
        augment: transform specs for training batches only.
        seed: the data seed (spec.data.seed).
        input_shape: the model's input shape, to check the result against; None skips the check.

    Returns:
        The transformed batch, x as float32.

    Raises:
        ValueError: the transforms give samples of another shape than the model takes.
    """
    steps = tuple(preprocess) + (tuple(augment) if batch.split == "train" else ())
    x = np.asarray(batch.x, dtype=np.float32)
    if steps:
        x = apply_transforms(x, steps, batch_rng(seed, batch.epoch, batch.position))
    if input_shape is not None and tuple(x.shape[1:]) != tuple(input_shape):
        raise ValueError(
            f"batch {batch.seq}: samples of shape {tuple(x.shape[1:])} after preprocessing, but the model "
            f"takes {tuple(input_shape)} (check data.preprocess or model.input_shape)"
        )
    return replace(batch, x=x)


class Preprocess:
    """The preprocess actor (see the module docstring).

    Args:
        meter: its ports.
        preprocess: transform specs for every batch.
        augment: transform specs for training batches.
        seed: the data seed.
        input_shape: the model's input shape (checked on every batch).
        inline: transform on the event loop instead of in a thread (deterministic tests).
        host_rows: where the dataset is kept on the device (batches carry only indices, and the
            device applies the preprocessing as it gathers them), the same rows computed on the
            host, for the first batch's input statistics only.
    """

    def __init__(
        self,
        meter: Meter,
        preprocess: Sequence[Any],
        augment: Sequence[Any],
        seed: int,
        input_shape: tuple[int, ...] | None,
        inline: bool = False,
        host_rows: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.meter = meter
        self.preprocess = tuple(preprocess)
        self.augment = tuple(augment)
        self.seed = seed
        self.input_shape = input_shape
        self.inline = inline
        self.offload = InlineOrThread(
            self._transform, InlinePolicy(forced=True if inline else None), trio.CapacityLimiter(1)
        )
        self.measured = False  # the first training batch's InputStatistics has been sent
        self.host_rows = host_rows

    def _untouched(self, batch: Batch) -> bool:
        """Whether no transform applies and the batch already is what the device takes."""
        if batch.x is None:  # indices into a dataset on the device, which preprocesses as it gathers
            return True
        if self.preprocess or (self.augment and batch.split == "train"):
            return False
        x = batch.x
        if not isinstance(x, np.ndarray) or x.dtype != np.float32:
            return False
        return self.input_shape is None or tuple(x.shape[1:]) == tuple(self.input_shape)

    def _transform(self, batch: Batch) -> Batch:
        return transform_batch(batch, self.preprocess, self.augment, self.seed, self.input_shape)

    async def run(self) -> None:
        """Transform batches until the inbox ends, then close the outboxes."""
        async with self.meter:
            async for item in self.meter:
                if isinstance(item, Batch) and not self._untouched(item):
                    with self.meter.busy():
                        if self.offload.inline():
                            item = self.offload.run_inline(item)
                        else:
                            item = await self.offload.run_in_thread(item)
                if (
                    not self.measured
                    and isinstance(item, Batch)
                    and item.split == "train"
                    and item.rows
                    and (item.x is not None or self.host_rows is not None)
                ):
                    # Once a run: a source and transforms that give the model nonsense (inputs
                    # scaled twice, all zeros) train at chance without an error, unless measured.
                    self.measured = True
                    with self.meter.busy():
                        shown = item
                        if item.x is None and self.host_rows is not None:
                            shown = replace(item, x=self.host_rows(item.indices))
                        stats = input_statistics(shown)
                    await self.meter.send(stats)
                await self.meter.pass_on(item)

    def statistics(self) -> ActorStatistics:
        """The meter's counters, with the batches transformed in a worker thread.

        Returns:
            A frozen snapshot.
        """
        return replace(self.meter.statistics(), thread_items=self.offload.thread_items)

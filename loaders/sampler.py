"""Which samples go in which batch: a seeded shuffle per epoch, sharded by rank, resumable.

Pure and deterministic: no I/O, and the order depends only on (indices, seed, epoch), through
``np.random.default_rng((seed, epoch))``, so it is the same on every machine and after a restart.
A :class:`SamplerState` (epoch, batches already emitted) is all a checkpoint needs to resume on
the exact next batch.

Sharding: each epoch's permutation is cut to a multiple of ``world`` and rank ``r`` takes every
``world``-th sample starting at ``r``. The ``len(indices) % world`` samples at the tail of the
permutation sit this epoch out, so every rank sees the same number of samples and batches (no rank
waits at a collective for a batch another lacks) and no sample is duplicated. With shuffling the
left-out tail differs each epoch; without it the same last samples are always left out.

Block order (``block``, data larger than memory): ``indices`` cut into blocks of ``block`` entries
(runs of the file), the blocks permuted (the generator's first draw, :meth:`Sampler.windows`) and
the samples of each ``window`` blocks permuted together: a batch mixes blocks, yet an epoch reads
each block once, whole (loaders.blocks).

:class:`RankSlices` shards the other way, as a data-parallel run over the ranks of an MPI job needs:
every rank draws the same global batches and takes its contiguous part of each
(:func:`rank_bounds`), so N ranks train on exactly the batches one process would, at the same
global batch size, and no sample sits out.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplerState:
    """Where a sampler stands.

    Attributes:
        epoch: the epoch (0-based).
        position: batches already emitted in this epoch.
    """

    epoch: int
    position: int


class Sampler:
    """Batches of sample indices (see the module docstring).

    Args:
        indices: the sample indices to draw from (e.g. a split), any order.
        batch_size: samples per batch.
        shuffle: permute each epoch; otherwise keep ``indices`` order.
        seed: the shuffle's seed.
        drop_last: leave out the final partial batch of each epoch (never padded with zeros or
            repeats either way).
        rank: this shard.
        world: number of shards.
        block: samples a block of the block order (with ``shuffle``); None: a full shuffle.
        window: blocks whose samples are shuffled together.
    """

    def __init__(
        self,
        indices: np.ndarray,
        batch_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        rank: int = 0,
        world: int = 1,
        block: int | None = None,
        window: int = 4,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
        self.indices = np.array(indices, dtype=np.int64).reshape(-1)
        self.indices.setflags(write=False)
        self._prepared: dict[int, np.ndarray] = {}  # epoch: shard, from prepare(), until used
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.rank = int(rank)
        self.world = int(world)
        if block is not None and (block < 1 or window < 1):
            raise ValueError(f"block and window must be >= 1, got block={block}, window={window}")
        self.block = int(block) if block is not None and shuffle else None
        self.window = int(window)

    @property
    def samples_per_epoch(self) -> int:
        """Samples this rank sees per epoch (before drop_last)."""
        return self.indices.size // self.world

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The whole epoch's order, before sharding.

        Args:
            epoch: the epoch.

        Returns:
            ``indices`` permuted by ``default_rng((seed, epoch))`` (or as given without shuffle).
        """
        if not self.shuffle:
            return self.indices.copy()
        rng = np.random.default_rng((self.seed, epoch))
        if self.block is None:
            return self.indices[rng.permutation(self.indices.size)]
        parts = []
        for blocks in self._windows(rng):
            members = np.concatenate([self.block_members(b) for b in blocks])
            parts.append(members[rng.permutation(members.size)])
        return np.concatenate(parts)

    def _windows(self, rng: np.random.Generator) -> list[np.ndarray]:
        blocks = rng.permutation(-(-self.indices.size // self.block))
        return [blocks[i : i + self.window] for i in range(0, blocks.size, self.window)]

    def windows(self, epoch: int) -> list[np.ndarray]:
        """Each window's block ids, in the order of the block order's epoch ``epoch``."""
        return self._windows(np.random.default_rng((self.seed, epoch)))

    def block_members(self, block: int) -> np.ndarray:
        """The sample indices of one block of the block order."""
        return self.indices[block * self.block : (block + 1) * self.block]

    def shard(self, epoch: int) -> np.ndarray:
        """This rank's samples for an epoch, in order.

        Args:
            epoch: the epoch.

        Returns:
            Every ``world``-th sample of the epoch order from ``rank``, tail cut as documented.
        """
        prepared = self._prepared.pop(epoch, None)
        return prepared if prepared is not None else self._cut(self.epoch_order(epoch))

    def _cut(self, order: np.ndarray) -> np.ndarray:
        return order[: self.samples_per_epoch * self.world][self.rank :: self.world]

    def prepare(self, epoch: int) -> None:
        """Compute ``epoch``'s shard now, for :meth:`shard` to return (the loader calls this from a
        worker thread an epoch ahead: shuffling 60,000 indices takes the event loop ~1.5 ms on the
        H100 host, longer than the few steps queued on a fast GPU last). Safe from another thread:
        the result is the same whoever computes it, and one dict assignment publishes it.

        Args:
            epoch: the epoch.
        """
        self._prepared[epoch] = self._cut(self.epoch_order(epoch))

    def batches_per_epoch(self) -> int:
        """Batches this rank emits per epoch.

        Returns:
            The count, the same on every rank.
        """
        full, rest = divmod(self.samples_per_epoch, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def batches(self, state: SamplerState) -> Iterator[tuple[SamplerState, np.ndarray]]:
        """Batches from ``state`` to the end of its epoch.

        Args:
            state: where to start; ``position`` batches of ``epoch`` are taken as already emitted.

        Yields:
            (the state after this batch, the batch's sample indices). Resuming from any yielded
            state gives exactly the batches that followed it.
        """
        total = self.batches_per_epoch()
        if not 0 <= state.position <= total:
            raise ValueError(f"position {state.position} outside 0..{total} for epoch {state.epoch}")
        if state.position == total:
            return
        shard = self.shard(state.epoch)
        for pos in range(state.position, total):
            batch = shard[pos * self.batch_size : (pos + 1) * self.batch_size]
            yield SamplerState(state.epoch, pos + 1), batch


def rank_bounds(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous part of a batch of ``rows``: equal parts, one more row for each
    of the first ``rows % world`` ranks (flow.parallel_plan.split_rows with equal weights).

    Args:
        rows: the global batch's rows.
        rank: this rank.
        world: the number of ranks.

    Returns:
        (start, stop) of this rank's rows; empty when there are fewer rows than ranks.
    """
    base, extra = divmod(rows, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class RankSlices:
    """One rank's part of every batch of a global sampler (see the module docstring): the same
    epochs, batch positions and resumable states, fewer rows.

    Args:
        sampler: the global sampler (every rank builds the same one).
        rank: this rank.
        world: the number of ranks.
    """

    def __init__(self, sampler: Sampler, rank: int, world: int) -> None:
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
        self.sampler, self.rank, self.world = sampler, rank, world

    def batches_per_epoch(self) -> int:
        """Global batches per epoch: the same on every rank.

        Returns:
            The count.
        """
        return self.sampler.batches_per_epoch()

    def prepare(self, epoch: int) -> None:
        """:meth:`Sampler.prepare` of the global sampler.

        Args:
            epoch: the epoch.
        """
        self.sampler.prepare(epoch)

    def batches(self, state: SamplerState) -> Iterator[tuple[SamplerState, np.ndarray]]:
        """As :meth:`Sampler.batches`, each batch cut to this rank's part.

        Args:
            state: where to start.

        Yields:
            (the state after this batch, this rank's sample indices of it).
        """
        for after, batch in self.sampler.batches(state):
            start, stop = rank_bounds(len(batch), self.rank, self.world)
            yield after, batch[start:stop]

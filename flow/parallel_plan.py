"""Data parallelism as plain data: how a run's devices share each global batch, how many rows each
records its programs for, and how their weights stay identical. Pure: the runtime measures and
opens; this decides.

Each member runs the train program on its shard with the loss averaged over the *global* batch's
rows (flow.program.STEP_VALUES "divisor"), so the members' gradients sum to the global batch's,
and the host all-reduce is a plain sum in member order (a fixed order: the same inputs give the
same bits). Then every member applies the same update:

- ``"each"``: members that are the same device (one GPU model and driver, lavapipe twice, the CPU
  backend twice) each apply the summed gradient; the same kernels on the same inputs keep their
  weights bit-identical;
- ``"leader"``: members that differ (an NVIDIA GPU, lavapipe and numpy round differently, e.g.
  fused multiply-adds) would drift apart by ulps, so member 0 applies the update and its weights
  are copied to the others: identical by construction.

Across the ranks of an MPI job (:class:`World`, read from the launcher's environment by
:func:`world_from_env`), every rank draws the same global batch and takes its contiguous part
(loaders.sampler.rank_bounds); the plan here is one rank's: its members share the rank's part. The
gradients are summed in member order within each rank, then in rank order across the ranks
(actors.collective), and every rank applies the update itself; a digest of the weights compared
every ``check_every`` steps catches ranks that drift apart (:func:`divergence`).

The gradients are summed in buckets of about ``Devices.bucket_mb`` (:func:`grad_buckets`): ranges
of the flat gradient buffer from its end, the last layers' first, as the backward pass finishes
them. Each member's train program is cut where a bucket is complete (:func:`train_parts`), so the
host sums bucket k, and the ranks exchange it, while the devices run the backward of bucket k+1.
A bucket only partitions the elements: each is still summed in member order, then rank order, so
any bucket size gives the same bits (a model smaller than a bucket has one: no cut at all).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Literal

from flow.device_facts import DeviceFacts
from flow.program import Barrier, Layout, Program
from flow.spec import Devices
from loaders.sampler import rank_bounds

Update = Literal["each", "leader"]
# Where the shares came from: equal devices, the spec's shares, throughput measured before the
# first step, or (a plan made before that measurement) still to be measured.
Basis = Literal["equal", "spec", "measured", "to measure"]
# How gradients reach the host and go back (actors.host_arena): one pinned host arena imported by
# every member, or each backend's own reads and writes.
AllReduce = Literal["arena", "staging"]
# (rank, size) variables of the launchers: Open MPI, MPICH's hydra and Intel MPI (PMI), MVAPICH.
RANK_VARIABLES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
)
# Why every 100 steps: a digest costs one read of the weights from the device and one small
# collective, ~nothing at that rate, and a drift found 100 steps late is still found before the
# next checkpoint (which is checked as well).
CHECK_EVERY = 100


@dataclass(frozen=True)
class World:
    """This process's place among the ranks of an MPI job (rank 0 of 1 without one).

    Attributes:
        rank: this process's rank.
        size: the number of ranks.
        check_every: compare the ranks' weights every this many steps (and at every checkpoint).
        deadline_s: the longest a collective may wait for the other ranks before the job is aborted.
    """

    rank: int = 0
    size: int = 1
    check_every: int = CHECK_EVERY
    deadline_s: float = 600.0


def world_from_env(environ: Mapping[str, str]) -> World:
    """The MPI world a launcher (``mpiexec``) put this process in, read from its environment only,
    so a process started without one never loads MPI. ``VKFLOW_CHECK_EVERY`` and
    ``VKFLOW_MPI_DEADLINE`` (seconds) override the weight check's interval and the deadline.

    Args:
        environ: the environment (``os.environ``).

    Returns:
        The world; size 1 when no launcher's variables are set (or it started one process).

    Raises:
        ValueError: variables that make no sense (a rank outside 0..size-1).
    """
    for rank_name, size_name in RANK_VARIABLES:
        if rank_name in environ and size_name in environ:
            rank, size = int(environ[rank_name]), int(environ[size_name])
            if not 0 <= rank < size:
                raise ValueError(f"{rank_name}={rank} is outside 0..{size_name}-1={size - 1}")
            return World(
                rank,
                size,
                int(environ.get("VKFLOW_CHECK_EVERY", CHECK_EVERY)),
                float(environ.get("VKFLOW_MPI_DEADLINE", 600.0)),
            )
    return World()


def divergence(digests: list[bytes]) -> tuple[int, ...]:
    """The ranks whose weights' digest differs from rank 0's (empty: all agree).

    Args:
        digests: every rank's digest, in rank order.

    Returns:
        Those ranks, in order.
    """
    return tuple(rank for rank, digest in enumerate(digests) if digest != digests[0])


def split_rows(total: int, weights: tuple[float, ...]) -> tuple[int, ...]:
    """``total`` rows split in proportion to ``weights`` (largest remainders, ties to the earlier
    member), every member getting at least one row while there are rows enough.

    Args:
        total: rows to split, >= 0.
        weights: one positive weight per member.

    Returns:
        Rows per member, summing to ``total``.
    """
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    rows = [math.floor(e) for e in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - rows[i]), i))
    for i in order[: total - sum(rows)]:
        rows[i] += 1
    if total >= len(weights):  # every device in use: the biggest share gives up a row to an idle one
        for i in range(len(rows)):
            if rows[i] == 0:
                rows[max(range(len(rows)), key=lambda j: (rows[j], -j))] -= 1
                rows[i] = 1
    return tuple(rows)


def same_device(group: tuple[DeviceFacts, ...]) -> bool:
    """Whether every member is the same device (name, vendor and driver): then they compute
    bit-identically, and each may apply the update itself."""
    return len({(f.name, f.vendor, f.driver_version) for f in group}) == 1


@dataclass(frozen=True)
class DataParallelPlan:
    """How a global batch is shared out (see the module docstring).

    Attributes:
        members: each member's device name, in the spec's order.
        batch: the global batch's rows.
        weights: each member's relative share (equal, the spec's, or measured samples/s).
        rows: the rows each member takes of a full global batch (sum: ``batch``).
        capacity: the rows each member's programs are recorded for: its share, or the whole batch
            where the shares are measured after the programs are recorded.
        basis: where the shares came from.
        update: "each" or "leader".
        ranks: the ranks of an MPI job that share each global batch (1 without one).
        rank: this process's rank.
        global_batch: the rows of a full global batch, over every rank (``batch`` is this rank's).
        all_reduce: the all-reduce's path (:func:`all_reduce_path`).
        buckets: the gradients' buckets, (first float, end) of ``grads:all`` each, in the order
            they are summed (:func:`grad_buckets`); () before the device plans are made.
    """

    members: tuple[str, ...]
    batch: int
    weights: tuple[float, ...]
    rows: tuple[int, ...]
    capacity: tuple[int, ...]
    basis: Basis
    update: Update
    ranks: int = 1
    rank: int = 0
    global_batch: int = 0
    all_reduce: AllReduce = "staging"
    buckets: tuple[tuple[int, int], ...] = ()

    def shard(self, rows: int) -> tuple[int, ...]:
        """The rows each member takes of a batch of ``rows`` (a full batch: ``self.rows``; a
        partial one in the same proportions, never past a member's capacity)."""
        if rows == self.batch:
            return self.rows
        share = list(split_rows(rows, self.weights))
        for i, cap in enumerate(self.capacity):  # a rounding past capacity goes to one with room
            while share[i] > cap:
                share[i] -= 1
                share[next(j for j, c in enumerate(self.capacity) if share[j] < c)] += 1
        return tuple(share)

    def as_dict(self) -> dict:
        return {
            "members": list(self.members),
            "batch": self.batch,
            "weights": [round(w, 6) for w in self.weights],
            "rows": list(self.rows),
            "capacity": list(self.capacity),
            "basis": self.basis,
            "update": self.update,
            "ranks": self.ranks,
            "rank": self.rank,
            "global_batch": self.global_batch or self.batch,
            "all_reduce": self.all_reduce,
            "buckets": [list(b) for b in self.buckets],
        }


def grad_buckets(layout: Layout, bucket_bytes: int) -> tuple[tuple[int, int], ...]:
    """The gradient buffer cut into buckets of at least ``bucket_bytes`` (the last may be smaller),
    walking down from its end: the parameters are laid out in layer order and the backward pass
    finishes the last layer's first. A cut falls only between gradient tensors (never inside a
    layer's fused weight+bias), so a parameter larger than a bucket is a bucket of its own.

    Args:
        layout: a member's layout (every member's places the gradients alike).
        bucket_bytes: the least bytes of a bucket, > 0.

    Returns:
        (first float, end) of each bucket, the last layers' first; one bucket for a small model.
    """
    whole = layout.tensor("grads:all")
    parts = [(t.offset // 4, t.offset // 4 + t.size) for t in layout.tensors
             if t.arena == whole.arena and t.name != whole.name]  # fmt: skip
    cuts = {0, whole.size} | {edge for part in parts for edge in part}
    cuts = sorted(c for c in cuts if 0 <= c <= whole.size and not any(a < c < b for a, b in parts))
    buckets, stop = [], whole.size
    for cut in reversed(cuts[:-1]):
        if (stop - cut) * 4 >= bucket_bytes or cut == 0:
            buckets.append((cut, stop))
            stop = cut
    return tuple(buckets)


def train_parts(
    program: Program, layout: Layout, buckets: tuple[tuple[int, int], ...]
) -> tuple[Program, ...]:
    """``program`` (a member's train program) cut into one part per bucket: when parts 0..k have
    run, buckets 0..k hold their final gradients (no later launch binds them). A cut falls after
    the barrier group of the last launch that binds a gradient tensor overlapping the bucket (or
    an earlier bucket); the last part runs to the program's end. A part may be empty.

    Args:
        program: the train program.
        layout: its layout.
        buckets: :func:`grad_buckets`.

    Returns:
        The parts, named ``<program>#<k>``; the program itself for one bucket.
    """
    if len(buckets) == 1:
        return (program,)
    arena = layout.tensor("grads:all").arena
    ranges = {t.name: (t.offset // 4, t.offset // 4 + t.size) for t in layout.tensors if t.arena == arena}
    steps = program.steps
    last = [-1] * len(buckets)
    for i, step in enumerate(steps):
        if isinstance(step, Barrier):
            continue
        for a, b in (ranges[name] for name in step.args if name in ranges):
            for k, (start, stop) in enumerate(buckets):
                if a < stop and start < b:
                    last[k] = i
    parts, begin, ready = [], 0, -1
    for k in range(len(buckets)):
        ready = max(ready, last[k])
        end = len(steps) if k == len(buckets) - 1 else max(begin, ready + 1)
        while begin <= ready < end < len(steps) and not isinstance(steps[end], Barrier):
            end += 1  # the rest of the launch's barrier group: independent launches, one part
        chunk = steps[begin:end]
        while chunk and isinstance(chunk[0], Barrier):
            chunk = chunk[1:]
        while chunk and isinstance(chunk[-1], Barrier):
            chunk = chunk[:-1]
        parts.append(Program(f"{program.name}#{k}", chunk))
        begin = end
    return tuple(parts)


def plan_data_parallel(
    group: tuple[DeviceFacts, ...],
    batch: int,
    shares: tuple[float, ...] | None,
    world: World | None = None,
    speeds: tuple[float, ...] | None = None,
    running_statistics: bool = False,
) -> DataParallelPlan:
    """How ``group`` shares a global batch of ``batch`` rows (its rank's part, in an MPI job).

    Args:
        group: the members' facts, in the spec's order (two or more; one in an MPI job).
        batch: the global batch's rows.
        shares: the spec's ``devices.shares``, or None.
        world: the ranks of an MPI job, each taking its part of every global batch (None: one).
        speeds: each member's measured samples/s, for unequal devices without the spec's shares.
        running_statistics: the model keeps state its forward pass updates (BatchNorm): each
            member would update it from its own shard, so the leader's weights are copied to
            all, as DDP broadcasts rank 0's buffers.

    Returns:
        The plan: equal shares for equal devices, the spec's where given, else the measured
        speeds' shares, or (no speeds yet) shares to be measured: every member then records its
        programs for the whole batch, and the run plans again once it has measured them.
    """
    world = world or World()
    start, stop = rank_bounds(batch, world.rank, world.size)
    on_ranks = {"ranks": world.size, "rank": world.rank, "global_batch": batch}
    members = _plan_members(group, stop - start, shares, speeds)
    if running_statistics:
        members = replace(members, update="leader")
    return replace(members, all_reduce=all_reduce_path(group), **on_ranks)


def all_reduce_path(group: tuple[DeviceFacts, ...]) -> AllReduce:
    """The all-reduce's path: "arena" where every member can share one pinned host arena, each
    importing host memory (VK_EXT_external_memory_host: lavapipe, NVIDIA, AMD) or being the numpy
    backend (host memory already); else "staging"."""
    return "arena" if all(f.is_numpy or f.has("host_memory_import") for f in group) else "staging"


def _plan_members(
    group: tuple[DeviceFacts, ...],
    batch: int,
    shares: tuple[float, ...] | None,
    speeds: tuple[float, ...] | None = None,
) -> DataParallelPlan:
    names = tuple(f.name for f in group)
    update: Update = "each" if same_device(group) else "leader"
    if shares is not None or same_device(group):
        weights = tuple(float(s) for s in shares) if shares is not None else (1.0,) * len(group)
        rows = split_rows(batch, weights)
        basis: Basis = "spec" if shares is not None else "equal"
        return DataParallelPlan(names, batch, weights, rows, rows, basis, update)
    if speeds is not None:  # each member's programs for its own rows: a slow one runs few
        rows = split_rows(batch, speeds)
        return DataParallelPlan(names, batch, tuple(speeds), rows, rows, "measured", update)
    equal = (1.0,) * len(group)
    whole = (batch,) * len(group)  # any measured share must fit the recorded programs
    return DataParallelPlan(names, batch, equal, split_rows(batch, equal), whole, "to measure", update)


# Why 0.1 ms a member and step: each waits on its update as a submission of its own, and the members
# join at every step where one device keeps steps in flight: a submit and fence wait, on Vulkan.
MEMBER_STEP_S = 1e-4


@dataclass(frozen=True)
class MemberChoice:
    """Which members a data-parallel run keeps (:func:`choose_members`): ``kept`` and ``best`` are
    indices into ``members`` (the spec's order), ``best`` the set of the shortest predicted global
    step, which is kept unless ``forced`` says why every member is; ``seconds_all`` and
    ``seconds_best`` are the predicted seconds per global step with every member and with ``best``."""

    members: tuple[str, ...]
    kept: tuple[int, ...]
    best: tuple[int, ...]
    seconds_all: float
    seconds_best: float
    forced: str = ""

    @property
    def left_out(self) -> tuple[str, ...]:
        """The names of the members the run leaves out."""
        return tuple(name for i, name in enumerate(self.members) if i not in self.kept)

    def sentence(self) -> str:
        """What was kept and why, in one line (the run's log, ``flow plan``)."""
        kept = ", ".join(self.members[i] for i in self.kept)
        said = f"data parallel over {kept}" if len(self.kept) > 1 else f"one device, {kept}"
        every, best = f"predicted {self.seconds_all * 1e3:.3g} ms/step", f"{self.seconds_best * 1e3:.3g} ms"
        if self.left_out:
            return f"{said}; left out {', '.join(self.left_out)}: {every} with them, {best} without"
        slower = ", ".join(name for i, name in enumerate(self.members) if i not in self.best)
        if slower:
            return f"{said}, every device kept ({self.forced}): {every}, {best} without {slower}"
        return f"{said}: {every}, the fastest of the sets tried"

    def as_dict(self) -> dict:
        return {**asdict(self), "left_out": self.left_out}


def choose_members(
    group: tuple[DeviceFacts, ...],
    batch: int,
    devices: Devices,
    world: World | None,
    speeds: tuple[float, ...],
    bandwidth: float,
    grad_bytes: int,
) -> MemberChoice:
    """The members worth keeping. A global step is predicted to take the slowest member's rows at
    its speed and, for two or more members, the host all-reduce (every member's gradients read and
    the sum written back, or the leader's weights, as large: 2 x members x ``grad_bytes`` at
    ``bandwidth``) and each member's MEMBER_STEP_S; one member trains as a plain device. Of the
    fastest k members for every k (the all-reduce depends on k only), the set of the shortest step
    is kept (on a tie, the most members), in the spec's order; every member where the spec gives
    shares (they name every device's part) or ``drop_slow`` False. ``group``, ``batch``, ``world``
    as for :func:`plan_data_parallel`; ``speeds``: each member's measured samples/s
    (actors.data_parallel.measure_throughput); ``bandwidth``: the host all-reduce's bytes/s
    (actors.data_parallel.measure_all_reduce); ``grad_bytes``: a member's float32 gradients.
    """
    world = world or World()
    start, stop = rank_bounds(batch, world.rank, world.size)
    weights = devices.shares or ((1.0,) * len(group) if same_device(group) else speeds)

    def seconds(chosen: tuple[int, ...]) -> float:
        rows = split_rows(stop - start, tuple(weights[i] for i in chosen))
        compute = max(r / speeds[i] for r, i in zip(rows, chosen, strict=True))
        n = len(chosen)
        return compute if n == 1 else compute + 2 * n * grad_bytes / bandwidth + n * MEMBER_STEP_S

    fastest = sorted(range(len(speeds)), key=lambda i: (-speeds[i], i))
    candidates = [tuple(sorted(fastest[:k])) for k in range(len(speeds), 0, -1)]
    best = min(candidates, key=seconds)  # the first of equal times: the most members
    forced = "the spec's shares" if devices.shares is not None else ""
    forced, every = forced or ("" if devices.drop_slow else "drop_slow=False"), candidates[0]
    names = tuple(f.name for f in group)
    return MemberChoice(names, every if forced else best, best, seconds(every), seconds(best), forced)

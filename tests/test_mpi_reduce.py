"""The order-preserving all-reduce over MPI ranks (actors.collective: slice_bounds, pack,
add_in_rank_order, Ranks.start_sum / finish_sum): the cut of a bucket into one slice per rank, the
reduce-scatter + allgather simulated in one process against the plain sum in rank order, and under
``mpiexec -n 3`` (buckets that 3 does not divide) the same bits as that sum, blocking and not, and as
one process of three CPU members."""

from __future__ import annotations

import os

import numpy as np
import pytest

import flow
from actors.collective import add_in_rank_order, pack, slice_bounds
from actors.cpu_backend import cpu_facts
from flow.planning import plan
from tests.specs import ROOT, digits_spec
from tests.test_grad_buckets import TINY_MB, _on
from tests.test_mpi import _final, _mpiexec, _outputs, _written, needs_mpi


def _rank_order(grads: list[np.ndarray], sums: list[tuple[float, ...]]) -> tuple[np.ndarray, tuple]:
    """The oracle: every rank's whole gradients added in rank order, as one process adds its
    members, and the step sums from 0.0 in the same order."""
    total = grads[0].copy()
    for part in grads[1:]:
        total += part
    totals = [0.0] * len(sums[0])
    for rank_sums in sums:
        totals = [t + s for t, s in zip(totals, rank_sums, strict=True)]
    return total, tuple(totals)


@pytest.mark.parametrize("count", [0, 1, 2, 5, 7, 64, 1001])
@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_slices_cover_the_bucket_in_order_and_differ_by_one_at_most(count, ranks):
    bounds = slice_bounds(count, ranks)
    assert len(bounds) == ranks and bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(stop == start for (_, stop), (start, _) in zip(bounds, bounds[1:], strict=False))
    lengths = [b - a for a, b in bounds]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] - lengths[-1] <= 1


@pytest.mark.parametrize("count", [0, 2, 7, 1001])
@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_scatter_add_and_gather_give_the_bits_of_the_sum_in_rank_order(rng, count, ranks):
    """Each rank's bytes routed as the Alltoallv routes them, each slice added in rank order and
    the slices joined as the Allgatherv joins them: the same bits as the whole sum."""
    scale = 10.0 ** rng.integers(-3, 4, (ranks, count))  # magnitudes apart: the order shows in the bits
    grads = [(rng.standard_normal(count) * scale[r]).astype(np.float32) for r in range(ranks)]
    sums = [tuple(rng.standard_normal(3) * 1e3) for _ in range(ranks)]
    bounds = slice_bounds(count, ranks)
    sent = [pack(grads[r], sums[r], bounds) for r in range(ranks)]
    parts, totals = [], set()
    for r in range(ranks):
        rows = np.stack([send[offsets[r] : offsets[r] + sizes[r]] for send, (sizes, offsets) in sent])
        part, rank_totals = add_in_rank_order(rows, 8 * 3, 3)
        parts.append(part)
        totals.add(rank_totals)
    want, want_sums = _rank_order(grads, sums)
    np.testing.assert_array_equal(np.concatenate(parts), want)
    assert totals == {want_sums}  # every rank, the same sums
    if ranks > 2 and count > 100:  # another order gives other bits: the test can tell them apart
        assert not np.array_equal(_rank_order(grads[::-1], sums[::-1])[0], want)


# One rank of the MPI job: seeded parts of every rank, sums of odd sizes (several in flight at
# once, then one at a time), each checked against the sum in rank order computed from every
# rank's parts; prints the exchange and the buckets checked.
SUMS = """
import os, sys
import numpy as np
from actors.collective import Ranks
from flow.parallel_plan import world_from_env
from tests.test_mpi_reduce import _rank_order

world = world_from_env(os.environ)
ranks = Ranks(world)
seed, sizes = int(sys.argv[1]), [0, 1, 2, 3, 7, 1000, 100003]

def parts(size):
    rngs = [np.random.default_rng([seed, size, r]) for r in range(world.size)]
    grads = [(g.standard_normal(size) * 10.0 ** g.integers(-3, 4, size)).astype(np.float32) for g in rngs]
    return grads, [tuple(g.standard_normal(2) * 1e3) for g in rngs]

expected = [_rank_order(*parts(size)) for size in sizes]
started = [ranks.start_sum(parts(size)[0][world.rank], parts(size)[1][world.rank], f"size {size}")
           for size in sizes]
got = [ranks.finish_sum(s) for s in started]
got += [ranks.sum_in_rank_order(parts(size)[0][world.rank], parts(size)[1][world.rank], "one")
        for size in sizes]
for (total, sums), (want, want_sums) in zip(got, expected + expected):
    np.testing.assert_array_equal(total, want)
    assert sums == want_sums, (sums, want_sums)
print(f"rank {world.rank}: {ranks.exchange}: {len(got)} sums bit-exact", flush=True)
"""


@needs_mpi
@pytest.mark.parametrize("blocking", ["0", "1"], ids=["non-blocking", "blocking"])
def test_three_ranks_sum_buckets_of_odd_sizes_in_rank_order(tmp_path, rng, blocking):
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    seed = int(rng.integers(1 << 30))
    env = {"PYTHONPATH": path, "VKFLOW_MPI_BLOCKING": blocking}
    done, _ = _mpiexec(tmp_path, 3, "-c", SUMS, str(seed), env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    exchange = "Alltoallv + Allgatherv" if blocking == "1" else "non-blocking Ialltoallv + Iallgatherv"
    for rank in range(3):
        assert f"rank {rank}: {exchange}: 14 sums bit-exact" in done.stdout
    assert f"vkflow: gradients summed over the ranks by {exchange}" in done.stderr


@needs_mpi
def test_three_ranks_in_buckets_that_3_does_not_divide_train_as_one_process(tmp_path):
    """``mpiexec -n 3`` on the digits in three buckets, two of them cut into three uneven slices
    (704 and 8320 floats): the same bits as one process of three CPU members summing once."""
    spec = _on(digits_spec(), ("cpu",), TINY_MB, epochs=1, checkpoint_every=10)
    one = _on(spec, ("cpu",) * 3, 4.0)
    buckets = plan(_on(digits_spec(), ("cpu",) * 3, TINY_MB), facts=(cpu_facts(),) * 3).parallel.buckets
    assert len(buckets) == 3 and sum((b - a) % 3 > 0 for a, b in buckets) == 2, buckets
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    done, _ = _mpiexec(
        tmp_path, 3, "-m", "flow", "run", _written(tmp_path, "mpi", spec), env={"PYTHONPATH": path}
    )
    assert done.returncode == 0, done.stdout + done.stderr
    flow.run(tmp_path / _written(tmp_path, "one", one))
    np.testing.assert_array_equal(_final(tmp_path, "mpi"), _final(tmp_path, "one"))
    assert _outputs(tmp_path, "mpi") == _outputs(tmp_path, "one")

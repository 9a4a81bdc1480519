"""bench/mpi_scaling.py, the across-hosts estimate of issue 19: its gradient sizes against vkflow's own
parameter count, the cost of vkflow's all-reduce against a round-by-round run of it on real arrays, and
where it says a model stops scaling in cases with a closed-form answer."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flow.shapes import count_parameters
from flow.spec import CrossEntropy, Linear, Model
from tests.specs import bench_module

scaling = bench_module("mpi_scaling")


@pytest.mark.parametrize("widths", [scaling.SMALL_MLP, scaling.LARGE_MLP], ids=["small", "large"])
def test_the_gradients_are_the_models_parameters_in_float32(widths):
    layers = tuple(Linear(w, activation="relu") for w in widths[1:-1]) + (Linear(widths[-1]),)
    model = Model(input_shape=(widths[0],), layers=layers, loss=CrossEntropy())
    assert scaling.gradient_bytes(widths) == 4 * count_parameters(model)


def _vkflow_rounds(parts: list[np.ndarray], link) -> tuple[list[np.ndarray], float]:
    """vkflow's all-reduce run round by round: an Alltoall by pairwise exchange (in round k, host h
    sends its slice (h + k) % hosts to that host), the adds of each host's slices in host order,
    then a ring Allgather (in each round every host passes on the slice it got last). In a round
    every host sends one slice at once, so a round lasts one message. Returns every host's result
    and the seconds."""
    hosts = len(parts)
    slices = [np.array_split(part, hosts) for part in parts]
    got = [[None] * hosts for _ in range(hosts)]  # got[h][s]: slice h of host s
    seconds = link.overhead  # the handing over to the MPI thread and back
    for h in range(hosts):
        got[h][h] = slices[h][h]
    for k in range(1, hosts):
        seconds += (
            link.latency + max(slices[h][(h + k) % hosts].nbytes for h in range(hosts)) / link.bandwidth
        )
        for h in range(hosts):
            got[(h + k) % hosts][h] = slices[h][(h + k) % hosts]
    summed = []
    for h in range(hosts):
        total = got[h][0].copy()
        for other in got[h][1:]:
            total += other
        summed.append(total)
    seconds += max(part.nbytes for part in summed) * (hosts - 1) / link.add
    held = [{h: summed[h]} for h in range(hosts)]
    for k in range(hosts - 1):
        seconds += link.latency + max(part.nbytes for part in summed) / link.bandwidth
        for h in range(hosts):
            index = (h - k) % hosts
            held[(h + 1) % hosts][index] = held[h][index]
    return [np.concatenate([held[h][i] for i in range(hosts)]) for h in range(hosts)], seconds


@pytest.mark.parametrize("hosts", [2, 3, 8])
def test_vkflows_cost_is_its_all_reduce_run_round_by_round(rng, hosts):
    parts = [rng.standard_normal(hosts * 1000).astype(np.float32) for _ in range(hosts)]
    bandwidth, latency, add, overhead = rng.uniform((1e8, 1e-6, 1e9, 1e-6), (1e10, 1e-4, 1e10, 1e-3))
    link = scaling.Link(float(bandwidth), float(latency), float(add), float(overhead))
    results, seconds = _vkflow_rounds(parts, link)
    total = parts[0].copy()
    for part in parts[1:]:
        total += part
    for result in results:  # every host: the sum in host order, bit for bit
        np.testing.assert_array_equal(result, total)
    nbytes = parts[0].nbytes
    assert math.isclose(scaling.vkflow_all_reduce_s(nbytes, hosts, link), seconds, rel_tol=1e-12)
    # Session 10's gather-sum: every host receives every other host's whole gradients, one a
    # round, and adds them all.
    gather = (hosts - 1) * (link.latency + nbytes / link.bandwidth + nbytes / link.add)
    assert math.isclose(scaling.gather_sum_s(nbytes, hosts, link), gather, rel_tol=1e-12)


def test_where_a_model_stops_scaling():
    step, nbytes = 1e-3, 8e6
    free = scaling.Link(bandwidth=1e18, latency=0.0, add=1e18, overhead=0.0, read=1e18, write=1e18)
    assert scaling.stops_scaling(step, nbytes, free) is None  # efficiency ~1: it always scales
    # Gather-sum whose transfer of one host's gradients takes a whole step, no copies nor adds:
    # speedup p / (1 + (p - 1)) = 1 at every host count, flat from one host.
    even = scaling.Link(bandwidth=nbytes / step, latency=0.0, add=1e18, overhead=0.0, read=1e18, write=1e18)
    assert scaling.stops_scaling(step, nbytes, even, vkflow=False) == 1
    assert scaling.plateau(1).startswith("never scales")
    # vkflow's whose latency is a tenth of a step (bandwidth free): speedup S(p) = p / (1 + 0.2 (p - 1)),
    # S(2p) / S(p) = 2 (0.8 + 0.2 p) / (0.8 + 0.4 p) < 1.1 exactly when p > 18: from 32 hosts on.
    slow = scaling.Link(bandwidth=1e18, latency=step / 10, add=1e18, overhead=0.0, read=1e18, write=1e18)
    assert scaling.stops_scaling(step, nbytes, slow) == 32
    assert scaling.plateau(32) == "stops scaling at 32 hosts"
    table = scaling.table(scaling.Link(12.5e9, 2e-6))
    assert table.count("| small MLP") == 3 and table.count("| large MLP") == 3

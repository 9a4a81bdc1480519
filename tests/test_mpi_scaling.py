"""bench/mpi_scaling.py, the across-hosts estimate of issue 19: its gradient sizes against vkflow's own
parameter count, its ring all-reduce cost against a step-by-step run of the ring on real arrays, and
where it says a model stops scaling in cases with a closed-form answer."""

from __future__ import annotations

import importlib.util
import math
import sys

import numpy as np
import pytest

from flow.shapes import count_parameters
from flow.spec import CrossEntropy, Linear, Model
from tests.specs import ROOT

spec = importlib.util.spec_from_file_location("mpi_scaling", ROOT / "bench" / "mpi_scaling.py")
scaling = sys.modules.setdefault("mpi_scaling", importlib.util.module_from_spec(spec))
spec.loader.exec_module(scaling)


@pytest.mark.parametrize("widths", [scaling.SMALL_MLP, scaling.LARGE_MLP], ids=["small", "large"])
def test_the_gradients_are_the_models_parameters_in_float32(widths):
    layers = tuple(Linear(w, activation="relu") for w in widths[1:-1]) + (Linear(widths[-1]),)
    model = Model(input_shape=(widths[0],), layers=layers, loss=CrossEntropy())
    assert scaling.gradient_bytes(widths) == 4 * count_parameters(model)


def _ring(parts: list[np.ndarray], bandwidth: float, latency: float) -> tuple[list[np.ndarray], float]:
    """A ring all-reduce run round by round: in each, every host sends one chunk to the next host
    at once, so a round lasts one message. Returns every host's result and the seconds."""
    hosts = len(parts)
    chunks = [np.array_split(part.astype(np.float64), hosts) for part in parts]
    seconds = 0.0
    for step in range(hosts - 1):  # reduce-scatter: host h ends holding chunk (h + 1) % hosts summed
        sent = [(h, (h - step) % hosts, chunks[h][(h - step) % hosts].copy()) for h in range(hosts)]
        seconds += latency + max(c.nbytes / 2 for _, _, c in sent) / bandwidth  # float32 on the wire
        for h, index, chunk in sent:
            chunks[(h + 1) % hosts][index] += chunk
    for step in range(hosts - 1):  # allgather: pass the summed chunks on
        sent = [(h, (h + 1 - step) % hosts, chunks[h][(h + 1 - step) % hosts].copy()) for h in range(hosts)]
        seconds += latency + max(c.nbytes / 2 for _, _, c in sent) / bandwidth
        for h, index, chunk in sent:
            chunks[(h + 1) % hosts][index] = chunk
    return [np.concatenate(c) for c in chunks], seconds


@pytest.mark.parametrize("hosts", [2, 3, 8])
def test_the_ring_cost_is_a_ring_run_round_by_round(rng, hosts):
    parts = [rng.standard_normal(hosts * 1000).astype(np.float32) for _ in range(hosts)]
    bandwidth, latency = float(rng.uniform(1e8, 1e10)), float(rng.uniform(1e-6, 1e-4))
    results, seconds = _ring(parts, bandwidth, latency)
    total = np.sum(np.stack(parts).astype(np.float64), axis=0)
    for result in results:
        np.testing.assert_allclose(result, total, rtol=1e-12, atol=1e-12)
    nbytes = parts[0].nbytes
    assert math.isclose(scaling.ring_all_reduce_s(nbytes, hosts, bandwidth, latency), seconds, rel_tol=1e-12)
    # vkflow's gather-sum: every host receives every other host's whole gradients, one a round.
    gather = (hosts - 1) * (latency + nbytes / bandwidth)
    assert math.isclose(scaling.gather_sum_s(nbytes, hosts, bandwidth, latency), gather, rel_tol=1e-12)


def test_where_a_model_stops_scaling():
    step, nbytes = 1e-3, 8e6
    free = scaling.Link(bandwidth=1e18, latency=0.0, read=1e18, write=1e18)
    assert scaling.stops_scaling(step, nbytes, free) is None  # efficiency ~1: it always scales
    # Gather-sum whose transfer of one host's gradients takes a whole step, no copies: speedup
    # p / (1 + (p - 1)) = 1 at every host count, flat from one host.
    even = scaling.Link(bandwidth=nbytes / step, latency=0.0, read=1e18, write=1e18)
    assert scaling.stops_scaling(step, nbytes, even, ring=False) == 1
    # A ring whose latency is a tenth of a step (bandwidth free): speedup S(p) = p / (1 + 0.2 (p - 1)),
    # S(2p) / S(p) = 2 (0.8 + 0.2 p) / (0.8 + 0.4 p) < 1.1 exactly when p > 18: from 32 hosts on.
    slow = scaling.Link(bandwidth=1e18, latency=step / 10, read=1e18, write=1e18)
    assert scaling.stops_scaling(step, nbytes, slow) == 32
    table = scaling.table(scaling.Link(12.5e9, 2e-6))
    assert table.count("| small MLP") == 3 and table.count("| large MLP") == 3

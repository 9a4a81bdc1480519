"""Data parallel across hosts, estimated: the per-step all-reduce cost and the scaling efficiency of
2, 8 and 64 hosts, from a ring all-reduce cost model fed with a link's bandwidth and latency
(issue 19). An estimate, not a measurement: this project has one machine.

The model (Thakur, Rabenseifner & Gropp 2005; what MPI libraries and NCCL run for large messages):
a ring all-reduce of ``n`` bytes over ``p`` hosts sends 2 (p - 1) messages of n / p bytes one after
another, so it costs ``2 (p - 1) latency + 2 (p - 1) / p * n / bandwidth``; vkflow's own collective
today (actors.collective: every rank gathers every rank's gradients and adds them in rank order, for
the same bits on every rank) is a ring allgather, ``(p - 1) (latency + n / bandwidth)``. Each host
trains its own batch (weak scaling: the global batch grows with the hosts), the communication is not
overlapped with the backward pass, and every step of two hosts or more also copies the gradients
from the GPU to the host and the sum back (``staging``: bytes / read + bytes / write rate, measured on
the H100 in session 5 at 256 MB; smaller buffers copy slower). Efficiency = step / (step + staging +
all-reduce); the speedup over one host is hosts x efficiency. "Stops scaling": the power-of-two host
count from which every doubling adds under 10 % to the speedup.

Step times (one H100, bench/RESULTS.md): the small MLP 784-1024-1024-10 at batch 1024, 1,074,000
samples/s (session 5); the large MLP 1024-4096-4096-4096-1024 at batch 8192, 157.4 k samples/s
(session 3). Usage:

    python bench/mpi_scaling.py --bandwidth-gbs 12.5 --latency-us 2      # the table
    mpiexec -n 2 python bench/mpi_scaling.py --measure                    # a link's figures

``--measure`` times ``MPI.Allreduce`` (float32, sum) of 4, 32 and 256 MB and of 8 bytes between the
ranks it runs on, and prints the bandwidth and latency the model takes (bandwidth from 256 MB with
the latency taken off, inverting the model above).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

SMALL_MLP = (784, 1024, 1024, 10)
LARGE_MLP = (1024, 4096, 4096, 4096, 1024)
# (model, widths, batch per host, step seconds on one H100 at that batch)
MODELS = (
    ("small MLP", SMALL_MLP, 1024, 1024 / 1_074_000),
    ("large MLP", LARGE_MLP, 8192, 8192 / 157_400),
)
HOSTS = (2, 8, 64)
READ_GBS, WRITE_GBS = 8.5, 22.4  # the H100's device->host and host->device copies, 256 MB (session 5)


def gradient_bytes(widths: tuple[int, ...]) -> int:
    """The float32 gradients of an MLP of these layer widths (weights and biases)."""
    return 4 * sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))


def ring_all_reduce_s(nbytes: float, hosts: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-reduce (reduce-scatter then allgather) of ``nbytes`` over ``hosts``,
    ``bandwidth`` in bytes/s, ``latency`` in seconds per message."""
    if hosts < 2:
        return 0.0
    return 2 * (hosts - 1) * latency + 2 * (hosts - 1) / hosts * nbytes / bandwidth


def gather_sum_s(nbytes: float, hosts: int, bandwidth: float, latency: float) -> float:
    """Seconds of vkflow's gather-then-sum (a ring allgather of every host's whole gradients)."""
    return (hosts - 1) * (latency + nbytes / bandwidth)


@dataclass(frozen=True)
class Link:
    """What moves the gradients: the network (bytes/s, seconds per message) and the GPU's copies to
    and from the host (bytes/s)."""

    bandwidth: float
    latency: float
    read: float = READ_GBS * 1e9
    write: float = WRITE_GBS * 1e9


@dataclass(frozen=True)
class Estimate:
    """One model's step at ``hosts`` hosts, in seconds."""

    hosts: int
    step_s: float
    staging_s: float
    ring_s: float
    gather_s: float

    def efficiency(self, ring: bool = True) -> float:
        """step / (step + staging + all-reduce), the ring's or vkflow's gather-sum's."""
        return self.step_s / (self.step_s + self.staging_s + (self.ring_s if ring else self.gather_s))


def estimate(step_s: float, nbytes: float, hosts: int, link: Link) -> Estimate:
    """One model's estimate at ``hosts`` hosts (see the module docstring)."""
    staging = nbytes / link.read + nbytes / link.write if hosts > 1 else 0.0
    ring = ring_all_reduce_s(nbytes, hosts, link.bandwidth, link.latency)
    return Estimate(hosts, step_s, staging, ring, gather_sum_s(nbytes, hosts, link.bandwidth, link.latency))


def stops_scaling(
    step_s: float, nbytes: float, link: Link, ring: bool = True, most: int = 65536
) -> int | None:
    """The power-of-two host count from which every doubling (up to ``most`` hosts) raises the
    speedup by under 10 %: the start of its plateau (None: it still scales at ``most``)."""
    hosts = [1 << k for k in range(most.bit_length())]
    speedup = [h * estimate(step_s, nbytes, h, link).efficiency(ring) for h in hosts]
    if speedup[-1] >= 1.1 * speedup[-2]:
        return None
    start = len(hosts) - 2
    while start > 0 and speedup[start] < 1.1 * speedup[start - 1]:
        start -= 1
    return hosts[start]


def table(link: Link) -> str:
    """The estimate as a markdown table, and where each model stops scaling."""
    lines = [
        "| model (gradients) | hosts | step | staging | ring all-reduce | efficiency (speedup) "
        "| vkflow gather-sum | efficiency (speedup) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    stops = []
    for name, widths, batch, step_s in MODELS:
        nbytes = gradient_bytes(widths)
        for hosts in HOSTS:
            e = estimate(step_s, nbytes, hosts, link)
            ring, gather = e.efficiency(), e.efficiency(ring=False)
            lines.append(
                f"| {name}, batch {batch}/host ({nbytes / 1e6:.1f} MB) | {hosts} | {step_s * 1e3:.2f} ms "
                f"| {e.staging_s * 1e3:.2f} ms | {e.ring_s * 1e3:.2f} ms | {ring:.2f} ({hosts * ring:.1f}x) "
                f"| {e.gather_s * 1e3:.1f} ms | {gather:.2f} ({hosts * gather:.1f}x) |"
            )
        ring, gather = (stops_scaling(step_s, nbytes, link, ring) or "> 65536" for ring in (True, False))
        stops.append(f"{name}: ring {ring}, gather-sum {gather} hosts")
    plateau = "stops scaling (from this host count on, each doubling adds < 10 % to the speedup): "
    return "\n".join(lines) + "\n\n" + plateau + "; ".join(stops)


def measure(reps: int = 10) -> None:
    """Time MPI.Allreduce between the ranks of this job; rank 0 prints the figures."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    ranks = comm.Get_size()

    def seconds(nbytes: int) -> float:
        data, out = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        comm.Allreduce(data, out)  # warm-up
        times = []
        for _ in range(reps):
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(data, out)
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    tiny = min(seconds(8) for _ in range(3))
    latency = tiny / (2 * (ranks - 1))
    figures = {mb: seconds(mb << 20) for mb in (4, 32, 256)}
    if comm.Get_rank() == 0:
        for mb, s in figures.items():
            print(f"{ranks} ranks, Allreduce {mb} MB: {s * 1e3:.2f} ms, {(mb << 20) / s / 1e9:.2f} GB/s")
        big = 256 << 20
        bandwidth = 2 * (ranks - 1) / ranks * big / (figures[256] - 2 * (ranks - 1) * latency)
        print(f"model inputs: --bandwidth-gbs {bandwidth / 1e9:.2f} --latency-us {latency * 1e6:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth-gbs", type=float, default=12.5, help="network GB/s (12.5: 100 Gb/s)")
    parser.add_argument("--latency-us", type=float, default=2.0, help="network latency per message, us")
    parser.add_argument("--read-gbs", type=float, default=READ_GBS, help="GPU to host copies, GB/s")
    parser.add_argument("--write-gbs", type=float, default=WRITE_GBS, help="host to GPU copies, GB/s")
    parser.add_argument("--measure", action="store_true", help="time MPI.Allreduce (run under mpiexec)")
    args = parser.parse_args()
    if args.measure:
        measure()
    else:
        gbs = 1e9
        print(
            table(
                Link(
                    args.bandwidth_gbs * gbs,
                    args.latency_us * 1e-6,
                    args.read_gbs * gbs,
                    args.write_gbs * gbs,
                )
            )
        )


if __name__ == "__main__":
    main()

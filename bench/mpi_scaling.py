"""Data parallel across hosts, estimated: the per-step all-reduce cost and the scaling efficiency of
2, 8 and 64 hosts, from the cost of vkflow's own all-reduce fed with a link's bandwidth and latency
(issue 19). An estimate, not a measurement: this project has one machine.

The model (Thakur, Rabenseifner & Gropp 2005): vkflow's all-reduce (actors.collective) cuts the
``n`` bytes into one slice per host; an Alltoallv hands host r slice r of every host, host r adds
them in host order (the same bits on every host, as one process), and an Allgatherv hands every host
every summed slice. With pairwise exchange and a ring allgather, each is ``p - 1`` messages of n / p
bytes one after another, so it costs ``2 (p - 1) latency + 2 (p - 1) / p * n / bandwidth`` (a ring
all-reduce's traffic and latency terms), plus the adds, ``(p - 1) / p * n / add`` (numpy's float32
``+=`` rate), plus a fixed ``overhead`` a call (handing the work to the MPI thread and back, twice:
what vkflow's 8-byte all-reduce takes beyond its messages' latency). Session 10's collective (every
host gathers every host's whole gradients, then adds them) is kept for comparison: ``(p - 1)
(latency + n / bandwidth) + (p - 1) n / add``. Each host trains its own batch (weak scaling: the
global batch grows with the hosts), the communication is not overlapped with the backward pass, and
every step of two hosts or more also copies the gradients from the GPU to the host and the sum back
(``staging``: bytes / read + bytes / write rate, measured on the H100 in session 5 at 256 MB;
smaller buffers copy slower). Efficiency = step / (step + staging + all-reduce); the speedup over
one host is hosts x efficiency. "Stops scaling": the power-of-two host count from which every
doubling adds under 10 % to the speedup ("never scales": no doubling from one host on adds 10 %).

Step times (one H100, bench/RESULTS.md): the small MLP 784-1024-1024-10 at batch 1024, 1,074,000
samples/s (session 5); the large MLP 1024-4096-4096-4096-1024 at batch 8192, 157.4 k samples/s
(session 3). Usage:

    python bench/mpi_scaling.py --bandwidth-gbs 12.5 --latency-us 2      # the table
    mpiexec -n 2 python bench/mpi_scaling.py --measure                    # this host's figures

``--measure`` times, between the ranks it runs on, 4, 32 and 256 MB of float32 sums (median [min,
max] of ``--reps``, GB/s = the buffer's bytes / seconds): ``MPI.Allreduce`` (the MPI library's own,
in any order), vkflow's all-reduce (actors.collective.Ranks.sum_in_rank_order: non-blocking where
the library is MPI-3 unless ``VKFLOW_MPI_BLOCKING=1``) and session 10's gather-then-add; and each
of them on 8 bytes (the latency). It prints the model's inputs that vkflow's figures give (bandwidth
from 256 MB with the latency and the adds taken off, inverting the model above).
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
ADD_GBS = 6.3  # numpy float32 adds on the H100 host, 256 MB (session 11; --measure prints its own)
OVERHEAD_US = 53.0  # vkflow's 8-byte all-reduce beyond its messages' latency there (session 11)
SIZES_MB = (4, 32, 256)


def gradient_bytes(widths: tuple[int, ...]) -> int:
    """The float32 gradients of an MLP of these layer widths (weights and biases)."""
    return 4 * sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))


def vkflow_all_reduce_s(nbytes: float, hosts: int, link: Link) -> float:
    """Seconds of vkflow's all-reduce of ``nbytes`` over ``hosts``: Alltoallv + Allgatherv (a ring's
    traffic and latency terms) and the adds of a host's slice (see the module docstring)."""
    if hosts < 2:
        return 0.0
    moved = (hosts - 1) / hosts * nbytes * (2 / link.bandwidth + 1 / link.add)
    return link.overhead + 2 * (hosts - 1) * link.latency + moved


def gather_sum_s(nbytes: float, hosts: int, link: Link) -> float:
    """Seconds of session 10's gather-then-add (a ring allgather of every host's whole gradients)."""
    return (hosts - 1) * (link.latency + nbytes / link.bandwidth + nbytes / link.add)


@dataclass(frozen=True)
class Link:
    """What moves and adds the gradients: the network (bytes/s, seconds per message), numpy's
    float32 adds (bytes/s of the summed buffer), vkflow's fixed seconds a call and the GPU's copies
    to and from the host (bytes/s)."""

    bandwidth: float
    latency: float
    add: float = ADD_GBS * 1e9
    overhead: float = OVERHEAD_US * 1e-6
    read: float = READ_GBS * 1e9
    write: float = WRITE_GBS * 1e9


@dataclass(frozen=True)
class Estimate:
    """One model's step at ``hosts`` hosts, in seconds."""

    hosts: int
    step_s: float
    staging_s: float
    vkflow_s: float
    gather_s: float

    def efficiency(self, vkflow: bool = True) -> float:
        """step / (step + staging + all-reduce), vkflow's or session 10's gather-then-add's."""
        return self.step_s / (self.step_s + self.staging_s + (self.vkflow_s if vkflow else self.gather_s))


def estimate(step_s: float, nbytes: float, hosts: int, link: Link) -> Estimate:
    """One model's estimate at ``hosts`` hosts (see the module docstring)."""
    staging = nbytes / link.read + nbytes / link.write if hosts > 1 else 0.0
    vkflow = vkflow_all_reduce_s(nbytes, hosts, link)
    return Estimate(hosts, step_s, staging, vkflow, gather_sum_s(nbytes, hosts, link) if hosts > 1 else 0.0)


def stops_scaling(
    step_s: float, nbytes: float, link: Link, vkflow: bool = True, most: int = 65536
) -> int | None:
    """The power-of-two host count from which every doubling (up to ``most`` hosts) raises the
    speedup by under 10 %: the start of its plateau (1: it never scales; None: it still scales at
    ``most``)."""
    hosts = [1 << k for k in range(most.bit_length())]
    speedup = [h * estimate(step_s, nbytes, h, link).efficiency(vkflow) for h in hosts]
    if speedup[-1] >= 1.1 * speedup[-2]:
        return None
    start = len(hosts) - 2
    while start > 0 and speedup[start] < 1.1 * speedup[start - 1]:
        start -= 1
    return hosts[start]


def plateau(hosts: int | None, most: int = 65536) -> str:
    """:func:`stops_scaling`'s answer in words."""
    if hosts is None:
        return f"still scales at {most} hosts"
    if hosts == 1:
        return "never scales (no doubling of the hosts from one adds 10 % to the speedup)"
    return f"stops scaling at {hosts} hosts"


def table(link: Link) -> str:
    """The estimate as a markdown table, and where each model stops scaling."""
    lines = [
        "| model (gradients) | hosts | step | staging | vkflow all-reduce | efficiency (speedup) "
        "| session 10 gather-sum | efficiency (speedup) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    stops = []
    for name, widths, batch, step_s in MODELS:
        nbytes = gradient_bytes(widths)
        for hosts in HOSTS:
            e = estimate(step_s, nbytes, hosts, link)
            us, gather = e.efficiency(), e.efficiency(vkflow=False)
            lines.append(
                f"| {name}, batch {batch}/host ({nbytes / 1e6:.1f} MB) | {hosts} | {step_s * 1e3:.2f} ms "
                f"| {e.staging_s * 1e3:.2f} ms | {e.vkflow_s * 1e3:.2f} ms | {us:.2f} ({hosts * us:.1f}x) "
                f"| {e.gather_s * 1e3:.1f} ms | {gather:.2f} ({hosts * gather:.1f}x) |"
            )
        ours, gather = (plateau(stops_scaling(step_s, nbytes, link, way)) for way in (True, False))
        stops.append(f"{name}: vkflow {ours}; session 10's gather-sum {gather}")
    return (
        "\n".join(lines)
        + "\n\n"
        + "\n".join(stops)
        + "\n(stops scaling: from there on, each doubling of the hosts adds < 10 % to the speedup)"
    )


def measure(reps: int) -> None:
    """Time the all-reduces (see the module docstring) between the ranks of this job; rank 0 prints
    the figures, as text and as JSON lines."""
    import json
    import os

    import numpy as np

    from actors.collective import Ranks
    from flow.parallel_plan import world_from_env

    ranks = Ranks(world_from_env(os.environ))
    comm, size, thread = ranks.comm, ranks.world.size, ranks.thread

    def allreduce(data: np.ndarray) -> None:
        thread.call(comm.Allreduce, data, np.empty_like(data))

    def gather_sum(data: np.ndarray) -> None:  # session 10's Ranks.finish_sum(start_sum(...))
        gathered = np.empty((size, data.size), np.float32)
        thread.call(comm.Allgather, data, gathered)
        total = gathered[0].copy()
        for row in gathered[1:]:
            total += row

    def vkflow(data: np.ndarray) -> None:
        ranks.sum_in_rank_order(data, (1.0,), "the benchmark")

    def seconds(fn, nbytes: int) -> list[float]:
        data = np.random.default_rng(ranks.rank).standard_normal(nbytes // 4).astype(np.float32)
        fn(data)  # warm-up
        times = []
        for _ in range(reps):
            thread.call(comm.Barrier)
            start = time.perf_counter()
            fn(data)
            times.append(time.perf_counter() - start)
        return times

    total, part = np.ones(SIZES_MB[-1] << 18, np.float32), np.ones(SIZES_MB[-1] << 18, np.float32)
    adds = []
    for _ in range(3):
        start = time.perf_counter()
        total += part
        adds.append(time.perf_counter() - start)
    add_gbs = total.nbytes / min(adds) / 1e9
    rows = []
    for name, fn in (("MPI.Allreduce", allreduce), (f"vkflow ({ranks.exchange})", vkflow),
                     ("session 10 gather-sum", gather_sum)):  # fmt: skip
        tiny = min(seconds(fn, 8))
        figures = {mb: seconds(fn, mb << 20) for mb in SIZES_MB}
        gbs = {mb: sorted((mb << 20) / t / 1e9 for t in times) for mb, times in figures.items()}
        rows.append({"ranks": size, "what": name, "latency_us": tiny * 1e6,
                     "gbs": {mb: [float(np.median(g)), g[0], g[-1]] for mb, g in gbs.items()},
                     "median_s_256": float(np.median(figures[SIZES_MB[-1]]))})  # fmt: skip
    if ranks.rank == 0:
        for row in rows:
            shown = ", ".join(
                f"{mb} MB {m:.2f} [{lo:.2f}, {hi:.2f}]" for mb, (m, lo, hi) in row["gbs"].items()
            )
            print(f"{size} ranks, {row['what']}: GB/s {shown}; 8 B {row['latency_us']:.1f} us")
            print(json.dumps(row))
        latency = rows[0]["latency_us"] * 1e-6 / (2 * (size - 1))  # MPI's own, a message
        overhead = rows[1]["latency_us"] * 1e-6 - 2 * (size - 1) * latency
        big, part = SIZES_MB[-1] << 20, (size - 1) / size
        moving = rows[1]["median_s_256"] - overhead - 2 * (size - 1) * latency - part * big / (add_gbs * 1e9)
        print(f"numpy float32 adds: {add_gbs:.2f} GB/s; model inputs (vkflow's): "
              f"--bandwidth-gbs {2 * part * big / moving / 1e9:.2f} --latency-us {latency * 1e6:.1f} "
              f"--overhead-us {overhead * 1e6:.0f} --add-gbs {add_gbs:.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth-gbs", type=float, default=12.5, help="network GB/s (12.5: 100 Gb/s)")
    parser.add_argument("--latency-us", type=float, default=2.0, help="network latency per message, us")
    parser.add_argument(
        "--overhead-us", type=float, default=OVERHEAD_US, help="vkflow's fixed cost a call, us"
    )
    parser.add_argument("--add-gbs", type=float, default=ADD_GBS, help="numpy float32 adds, GB/s")
    parser.add_argument("--read-gbs", type=float, default=READ_GBS, help="GPU to host copies, GB/s")
    parser.add_argument("--write-gbs", type=float, default=WRITE_GBS, help="host to GPU copies, GB/s")
    parser.add_argument("--measure", action="store_true", help="time the all-reduces (run under mpiexec)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions of each (--measure)")
    args = parser.parse_args()
    if args.measure:
        measure(args.reps)
    else:
        gbs = 1e9
        print(
            table(
                Link(
                    args.bandwidth_gbs * gbs,
                    args.latency_us * 1e-6,
                    args.add_gbs * gbs,
                    args.overhead_us * 1e-6,
                    args.read_gbs * gbs,
                    args.write_gbs * gbs,
                )
            )
        )


if __name__ == "__main__":
    main()

"""Data parallelism: the host-staged all-reduce's bandwidth and ``flow.run`` over several devices
against one device, in one run.

a. all-reduce: ``actors.data_parallel.host_all_reduce`` of a float32 tensor of 4, 32 and 256 MB
   over the selected members (every member's tensor read to the host, summed in member order, the
   sum written to every member), and the same through the pinned host arena
   (``actors.host_arena``: each member's device copies into the arena and back, the host sums in
   place; only where every member imports host memory), against a plain host-to-device write and
   device-to-host read of the same buffer on member 0. GB/s = the buffer's bytes / seconds
   (algorithm bandwidth); median and range over ``--reps``.
b. training: ``flow.run`` end to end on the Fashion-MNIST MLP (784-1024-1024-10, SGD momentum 0.9,
   batch 256 and 1024) over a Synthetic set (``VKFLOW_BENCH_SAMPLES``, default 60000 rows), on member 0 alone
   and on every member together. samples/s of the steady epochs 2..E (E = 3), each epoch's time
   from the metrics file's step lines (bench_realworld.epochs_from_metrics), so setup and the first
   epoch's warm-up are left out; median and range over ``--reps``.

``--members``: the devices, as ``Devices.select`` takes them (default "all": every Vulkan device and
the CPU backend); ``--quick``: small sizes, a smoke run on lavapipe.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from bench_realworld import epochs_from_metrics  # noqa: E402

import flow  # noqa: E402
from actors import device_select  # noqa: E402
from actors.data_parallel import host_all_reduce  # noqa: E402
from actors.host_arena import HostArena  # noqa: E402
from flow.parallel_plan import all_reduce_path  # noqa: E402
from flow.program import Arena, Layout, Tensor  # noqa: E402
from flow.spec import (  # noqa: E402
    SGD,
    CrossEntropy,
    Data,
    Devices,
    Linear,
    Model,
    RunSettings,
    Spec,
    Split,
    Synthetic,
)

BENCH = "data_parallel"


def _members(text: str) -> tuple[int | str, ...]:
    """``--device`` as ``Devices.select`` choices: "0,0,cpu" -> (0, 0, "cpu")."""
    return tuple(int(c) if c.isdigit() else c for c in text.split(",") if c)


def all_reduce(rep: common.Reporter, choices, sizes_mb, reps: int) -> None:
    group, _ = device_select.select_group(choices)
    backends = [device_select.open_device(facts) for facts in group]
    names = " + ".join(f.name for f in group)
    try:
        for mb in sizes_mb:
            n = mb * 2**20 // 4
            layout = Layout((Arena("grads", n * 4),), (Tensor("grads:all", (n,), "float32", "grads", 0),))
            rng = np.random.default_rng(mb)
            for backend in backends:
                backend.open_layout(layout, slots=1)
                backend.write("grads:all", rng.standard_normal(n, dtype=np.float32))
            data = rng.standard_normal(n, dtype=np.float32)
            timed = {
                "all_reduce": lambda scratch={}: host_all_reduce(backends, backends, scratch=scratch),  # noqa: B006
                **_arena_round(group, backends, n * 4),
                "h2d_write": lambda data=data: backends[0].write("grads:all", data),
                "d2h_read": lambda out=np.empty(n, np.float32): backends[0].read_into("grads:all", out),  # noqa: B008
            }
            for impl, fn in timed.items():
                fn()  # warm: staging buffers made, pages touched
                seconds = [common.host_seconds(fn) for _ in range(reps)]
                gbps = [n * 4 / s / 1e9 for s in seconds]
                device = names if impl.startswith("all_reduce") else group[0].name
                rep.figure(BENCH, impl, device, bytes=n * 4, members=len(backends),
                           gb_per_s=common.median(gbps), min=min(gbps), max=max(gbps))  # fmt: skip
    finally:
        for backend in backends:
            backend.close()


def _arena_round(group, backends, nbytes: int) -> dict:
    """{"all_reduce_arena": one all-reduce through the host arena, waited for}, or {} where some
    member cannot import host memory."""
    if all_reduce_path(group) != "arena":
        return {}
    arena = HostArena(backends, nbytes)  # freed with the layout the next size opens
    members = range(len(backends))

    def round_trip() -> None:
        for backend, ticket in [(backends[i], arena.gather(i)) for i in members]:
            if ticket is not None:
                backend.wait(ticket)
        arena.sum(members)
        for backend, ticket in [(backends[i], arena.scatter(i)) for i in members]:
            if ticket is not None:
                backend.wait(ticket)

    return {"all_reduce_arena": round_trip}


def mlp_spec(select, samples: int, epochs: int, batch: int, metrics: Path) -> Spec:
    return Spec(
        model=Model(input_shape=(784,), loss=CrossEntropy(),
                    layers=(Linear(1024, activation="relu"), Linear(1024, activation="relu"), Linear(10))),
        optimiser=SGD(0.05, momentum=0.9),
        data=Data(Synthetic(samples=samples, features=(784,), classes=10, seed=1), batch_size=batch, seed=0,
                  split=Split(train=1.0, val=0.0), placement="host"),
        # Every member kept: this measures data parallelism itself, which the planner would otherwise
        # cut down to the members worth their all-reduce (flow.parallel_plan.choose_members).
        devices=Devices(select, drop_slow=False),
        run=RunSettings(epochs=epochs, in_flight=2, metrics_file=str(metrics)),
    )  # fmt: skip


def training(rep: common.Reporter, choices, samples: int, epochs: int, batch: int, reps: int) -> None:
    group, _ = device_select.select_group(choices)
    first = choices[0] if choices != ("all",) else 0
    configurations = {"one device": first, "data parallel": choices if len(choices) > 1 else choices[0]}
    rates = {}
    for impl, select in configurations.items():
        speeds, device = [], ""
        for _ in range(reps):
            with tempfile.TemporaryDirectory() as folder:
                metrics = Path(folder) / "metrics.jsonl"
                device = flow.run(mlp_spec(select, samples, epochs, batch, metrics)).device
                # Epochs 2..E from the sink's step times: setup and the first epoch's warm-up left out.
                steady = epochs_from_metrics(metrics)[1:]
            speeds.append(samples * len(steady) / sum(steady))
        rates[impl] = common.median(speeds)
        members = len(group) if impl != "one device" else 1
        rep.figure(BENCH, impl, device, shape=f"784-1024-1024-10 b{batch}", samples_per_s=rates[impl],
                   min=min(speeds), max=max(speeds), members=members)  # fmt: skip
    rep.ratio(BENCH, "data parallel/one device", rates.get("data parallel"), rates.get("one device"),
              shape=f"784-1024-1024-10 b{batch}")  # fmt: skip


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], "ab")
    args.samples = int(os.environ.get("VKFLOW_BENCH_SAMPLES", "60000"))
    choices = _members(args.device) if args.device != "auto" else ("all",)
    rep = common.Reporter(args.out)
    started = time.perf_counter()
    if "a" in args.parts:
        common.section("a. host-staged all-reduce")
        sizes = (1, 4) if args.quick else (4, 32, 256)
        rep.guarded(BENCH, "all_reduce", lambda: all_reduce(rep, choices, sizes, args.reps))
    if "b" in args.parts:
        common.section("b. flow.run over the members against one device")
        samples, epochs = (2048, 2) if args.quick else (args.samples, 3)
        for batch in (256,) if args.quick else (256, 1024):
            run = lambda b=batch: training(rep, choices, samples, epochs, b, args.reps)  # noqa: E731
            rep.guarded(BENCH, "training", run)
    common.finish(rep, None, started)


if __name__ == "__main__":
    main()

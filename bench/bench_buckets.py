"""Gradient buckets overlapped with the backward pass: ``flow.run`` data parallel with the gradients
summed once after the backward pass (one bucket) against summed in buckets as the backward pass
finishes them (``Devices.bucket_mb``), on the same members and model.

Models: the digits MLP (examples/digits.json: 64-128-64-10, 69 KB of gradients, batch 64, the
bundled digits) and a larger MLP (784-2048-2048-2048-10, 38 MiB of gradients, batch 256, Synthetic
rows). For each bucket size: the median step time of the steady steps (every step after the
first epoch's, from the metrics file's step lines: setup and warm-up left out), the all-reduce
seconds a step that the backward pass does not hide (the devices line's ``all_reduce_seconds``),
and the buckets the plan made. Median and range over ``--reps`` runs, the sizes taking turns.

Usage::

    python bench/bench_buckets.py --members 0,0 --buckets 1000,4,1 --model both --reps 3
    python bench/bench_buckets.py --members cpu,cpu --model digits --buckets 1000,0.01

``--members``: the devices, as ``Devices.select`` takes them ("0,0": the first Vulkan device twice;
on the H100 machine "0,0" is the GPU twice and "0,cpu" GPU + CPU); ``--buckets``: MiB per bucket,
the first the reference (1000: one bucket for both models).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (the repository root on sys.path)

import flow
from actors.cpu_backend import cpu_facts
from flow.codec import load as load_spec
from flow.spec import SGD, CrossEntropy, Data, Devices, Linear, Model, RunSettings, Spec, Split, Synthetic

ROOT = Path(__file__).resolve().parents[1]


def _select(text: str) -> tuple[int | str, ...]:
    return tuple(int(c) if c.isdigit() else c for c in text.split(",") if c)


def digits_spec(epochs: int) -> Spec:
    spec = load_spec(ROOT / "examples" / "digits.json")
    return dataclasses.replace(spec, run=dataclasses.replace(spec.run, epochs=epochs, checkpoint_dir=None))


def large_spec(epochs: int, samples: int) -> Spec:
    layers = (*(Linear(2048, activation="relu") for _ in range(3)), Linear(10))
    return Spec(
        model=Model(input_shape=(784,), layers=layers, loss=CrossEntropy()),
        optimiser=SGD(0.01, momentum=0.9),
        data=Data(Synthetic(samples=samples, features=(784,), classes=10, seed=1), batch_size=256, seed=0,
                  split=Split(train=1.0, val=0.0), placement="host"),
        run=RunSettings(epochs=epochs, in_flight=2),
    )  # fmt: skip


def step_times(metrics: Path) -> list[float]:
    """Each step's seconds after the first epoch, from the sink's step lines."""
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [(int(r["epoch"]), float(r["elapsed"])) for r in lines if r.get("event") == "step"]
    times = [b[1] - a[1] for a, b in zip(steps, steps[1:], strict=False) if a[0] >= 1]
    return times


def one_run(spec: Spec, select, bucket_mb: float) -> tuple[float, float, int, int]:
    """(median step s, exposed all-reduce s a step, buckets, steps) of one run."""
    devices = Devices(select, drop_slow=False, shares=(1.0,) * len(select), bucket_mb=bucket_mb)
    with tempfile.TemporaryDirectory() as folder:
        metrics = Path(folder) / "metrics.jsonl"
        run = dataclasses.replace(spec.run, metrics_file=str(metrics), checkpoint_dir=None)
        result = flow.run(dataclasses.replace(spec, devices=devices, run=run))
        times = step_times(metrics)
    device = result.statistics["device"]
    on_cpu = dataclasses.replace(devices, select=("cpu", "cpu"), shares=None)  # the same layout anywhere
    planned = flow.plan(dataclasses.replace(spec, devices=on_cpu), facts=(cpu_facts(),) * 2)
    buckets = len(planned.parallel.buckets)
    return statistics.median(times), device.all_reduce_seconds / result.steps, buckets, result.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", default="0,0", help="Devices.select: 0,0 or cpu,cpu")
    parser.add_argument("--buckets", default="1000,4,1", help="MiB per bucket, the first the reference")
    parser.add_argument("--model", choices=("digits", "large", "both"), default="both")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4096, help="rows of the large MLP's Synthetic set")
    args = parser.parse_args()
    select = _select(args.members)
    sizes = [float(b) for b in args.buckets.split(",")]
    models = {"digits": digits_spec(args.epochs), "large": large_spec(args.epochs, args.samples)}
    chosen = models if args.model == "both" else {args.model: models[args.model]}
    started = time.perf_counter()
    for name, spec in chosen.items():
        # The sizes take turns, rep by rep: a machine's load that drifts (other jobs) hits them alike.
        runs: dict[float, list] = {mb: [] for mb in sizes}
        for _ in range(args.reps):
            for mb in sizes:
                runs[mb].append(one_run(spec, select, mb))
        reference = statistics.median(r[0] for r in runs[sizes[0]])
        for mb, done in runs.items():
            step = statistics.median(r[0] for r in done)
            print(json.dumps({
                "bench": "buckets", "model": name, "members": args.members, "bucket_mb": mb,
                "buckets": done[0][2], "step_ms": round(step * 1e3, 3),
                "min_ms": round(min(r[0] for r in done) * 1e3, 3),
                "max_ms": round(max(r[0] for r in done) * 1e3, 3),
                "exposed_all_reduce_ms": round(statistics.median(r[1] for r in done) * 1e3, 3),
                "vs_one_bucket": round(reference / step, 3), "steps": done[0][3],
            }), flush=True)  # fmt: skip
    print(json.dumps({"bench": "buckets", "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()

"""A wider CNN trained on generated 32x32 colour images: vkflow and PyTorch on the same GPU (issue 20).

The target (issue 20): "A wider CNN (channels 64-128-256, 32x32 inputs, batch 256): at least 0.8x
torch eager with cuDNN, fp32 with TF32 off. With mixed precision, at least 0.6x torch bf16
autocast." The ratio lines below are those two figures, of training samples/s.

The model, the same on both sides: input (3, 32, 32); Conv2d(64, 3, padding 1, relu) ->
MaxPool2d(2) -> Conv2d(128, 3, padding 1, relu) -> MaxPool2d(2) -> Conv2d(256, 3, padding 1,
relu) -> MaxPool2d(2) -> Flatten -> Linear(10); cross-entropy; SGD (lr 0.05, momentum 0.9);
batch 256; every sample once per epoch in a fresh shuffle (a partial last batch is trained too).

The data: ``flow.spec.Synthetic(samples=N, features=(3, 32, 32), classes=10, seed=0)``, float32
(each class a Gaussian blob around its own standard-normal centre). Default N = 20480 (80 batches):
CIFAR-10's 50000 do not fit, because a Synthetic source hands its whole data over for keeping on
the device (``stored()``) only when it fits the source's 256 MiB cache (``loaders/synthetic.py``),
and 20480 x 3 x 32 x 32 x 4 bytes (240 MiB) is the most whole batches that do. With a larger
``--samples`` vkflow's plan refuses ``placement="device"``, which is reported as "not available"
with the plan's reason while torch still runs. torch trains on the same numbers: the script opens
the same record with ``loaders.open_source`` and reads every sample (``read(arange(N))``).

The implementations, each trained from scratch once per repetition, in one process, on one GPU:

- ``vkflow`` and ``vkflow_mixed``: ``flow.run`` on the spec above with ``Data(placement="device")``
  (the data uploaded once and kept on the GPU; each step gathers its batch there), default
  ``RunSettings`` (in_flight 2) plus a metrics file in a temporary folder, no checkpoints,
  ``on_nonfinite="continue"`` (torch does not stop on a NaN either), and
  ``RunSettings.precision`` "float32" or "mixed" (GEMMs on cooperative matrices with float16
  inputs and float32 accumulation; "mixed" also runs the convolutions' forward and data gradient
  there (shaders/conv_coopmat_tiles.py): the figure is whatever "mixed" does at the commit
  measured). Where the plan refuses "mixed" (a device without cooperative
  matrices, e.g. lavapipe), that figure is "not available" with the plan's reason. Every run
  reuses one opened Vulkan backend (the counterpart of torch's CUDA context, made once too).
- ``torch_eager`` and ``torch_eager_bf16_autocast``: PyTorch eager, the whole data set resident on
  the GPU as float32 tensors; each epoch a ``torch.randperm`` on the GPU and each batch gathered by
  indexing (as ``torch_eager_resident`` in bench_realworld.py). fp32 with TF32 off
  (``common.import_torch``), cuDNN with its defaults (``cudnn.benchmark`` off); the bf16 variant
  runs the forward pass and the loss under ``torch.autocast(dtype=torch.bfloat16)`` (weights,
  gradients and the SGD update stay float32). Without CUDA, torch runs on the CPU and its names
  say so (``torch_cpu_eager``, ``torch_cpu_eager_bf16_autocast``); without torch, its figures are
  "not available" lines and vkflow's are still taken.

Figures, each the median and range (min, max) over ``--reps`` timed runs, after ``--warmup``
untimed runs per implementation (their wall time is ``cold_s``: shader compilation, cuDNN start-up):

- ``epoch_s``: steady seconds per epoch, the mean over epochs 2..E (E = ``--epochs``, default 3;
  the first holds warm-up and pipeline start). vkflow: from the metrics file's step lines, whose
  ``elapsed`` is the host time at which the sink received each step's result, by
  ``bench_realworld.epochs_from_metrics``: epoch e takes elapsed(last step of e) - elapsed(last
  step of e-1). torch: a host timer around each epoch, ending in ``torch.cuda.synchronize()``.
- ``samples_per_s``: N / ``epoch_s``.
- ``wall_s``: wall time with setup, on the host clock: for vkflow the ``flow.run`` call (planning,
  opening the source and generating its samples, the upload, recording, every epoch); for torch
  from opening the source and generating the samples through the upload, building the model and
  optimiser and every epoch, to a final synchronize. Its line also has ``loss`` (the last training
  step's loss, median over runs: a sanity check, both sides should train), ``cold_s`` and
  ``first_epoch_s``.
- ratio lines of the ``samples_per_s`` medians: ``vkflow/torch_eager`` (target 0.8) and
  ``vkflow_mixed/torch_eager_bf16_autocast`` (target 0.6); above 1, vkflow is faster. With torch
  on CUDA the line also says ``target`` and ``met``.

Options: ``--quick`` (1024 samples, channels 4-8-16, 2 epochs, 1 repetition, no warm-up: a smoke run
on lavapipe with CPU torch), ``--samples N``, ``--epochs E`` (>= 2), ``--reps N`` (default 5),
``--warmup N`` (default 1), ``--only fp32,mixed`` (fp32: vkflow and torch_eager; mixed:
vkflow_mixed and torch_eager_bf16_autocast), ``--out FILE`` (append the JSON lines), ``--device``
(the Vulkan device: index, name substring or auto). Progress goes to stderr.

Output: one JSON line per figure as soon as it is known (``{"bench": "wide_cnn", "shape",
"precision", "metric", "median", "min", "max", "values", ..., "impl", "device", "data", "samples"}``),
then a table.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import common
import numpy as np
from bench_realworld import (
    aligned,
    epochs_from_metrics,
    fmt,
    open_both,
    resident_epoch,
    spread,
    spread_cell,
    timed_epochs,
    warm_then_timed,
)
from common import Reporter, section

BENCH = "wide_cnn"
METRICS = ("wall_s", "epoch_s", "samples_per_s")
BATCH = 256
LR = 0.05
MOMENTUM = 0.9
CLASSES = 10
INPUT = (3, 32, 32)
DATA_SEED = 0
# (vkflow impl, its precision, torch variant, torch precision label, target ratio of samples/s)
PAIRS = {
    "fp32": ("vkflow", "float32", "eager", "float32", 0.8),
    "mixed": ("vkflow_mixed", "mixed", "eager_bf16_autocast", "bf16_autocast", 0.6),
}


@dataclass(frozen=True)
class Sizes:
    samples: int
    channels: tuple[int, int, int]
    epochs: int
    reps: int
    warmup: int


FULL = Sizes(samples=20480, channels=(64, 128, 256), epochs=3, reps=5, warmup=1)
QUICK = Sizes(samples=1024, channels=(4, 8, 16), epochs=2, reps=1, warmup=0)


def shape_of(sizes: Sizes) -> str:
    c1, c2, c3 = sizes.channels
    return f"conv{c1}-pool-conv{c2}-pool-conv{c3}-pool-{CLASSES}"


def synthetic(sizes: Sizes):
    from flow.spec import Synthetic

    return Synthetic(samples=sizes.samples, features=INPUT, classes=CLASSES, seed=DATA_SEED)


@dataclass(frozen=True)
class Outcome:
    """One training run: wall seconds with setup, seconds of each epoch, the last step's loss."""

    wall_s: float
    epoch_s: tuple[float, ...]
    loss: float

    def steady(self) -> float:
        """Mean seconds of epochs 2..E; NaN with one epoch."""
        rest = self.epoch_s[1:]
        return sum(rest) / len(rest) if rest else math.nan


# -- vkflow ----------------------------------------------------------------------------------------


def vk_once(backend, sizes: Sizes, precision: str, epochs: int, seed: int, folder: Path) -> Outcome:
    import flow
    from flow.spec import (
        SGD,
        Conv2d,
        CrossEntropy,
        Data,
        Flatten,
        Init,
        Linear,
        MaxPool2d,
        Model,
        RunSettings,
        Spec,
    )

    c1, c2, c3 = sizes.channels
    metrics = folder / f"metrics-{precision}-{time.perf_counter_ns()}.jsonl"
    spec = Spec(
        model=Model(
            input_shape=INPUT,
            layers=(
                Conv2d(c1, 3, padding=1, activation="relu"),
                MaxPool2d(2),
                Conv2d(c2, 3, padding=1, activation="relu"),
                MaxPool2d(2),
                Conv2d(c3, 3, padding=1, activation="relu"),
                MaxPool2d(2),
                Flatten(),
                Linear(CLASSES),
            ),
            loss=CrossEntropy(),
            # Xavier, near torch's default init: He init with this lr (SGD 0.05, momentum 0.9)
            # kills the ReLUs of this net in the first steps (loss stuck at ln 10; measured).
            init=Init(scheme="xavier", seed=seed),
        ),
        optimiser=SGD(LR, momentum=MOMENTUM),
        data=Data(synthetic(sizes), batch_size=BATCH, seed=seed, placement="device"),
        # "continue": a diverging run still gives its timing; its loss line says NaN.
        run=RunSettings(
            epochs=epochs, metrics_file=str(metrics), precision=precision, on_nonfinite="continue"
        ),
    )
    start = time.perf_counter()
    result = flow.run(spec, backend=backend)
    wall = time.perf_counter() - start
    return Outcome(wall, epochs_from_metrics(metrics), float(result.loss))


# -- torch -----------------------------------------------------------------------------------------


def torch_impl(torch, variant: str) -> str:
    base = "torch_cpu" if torch is not None and not torch.cuda.is_available() else "torch"
    return f"{base}_{variant}"


def torch_net(torch, sizes: Sizes):
    nn = torch.nn
    c1, c2, c3 = sizes.channels
    side = INPUT[1] // 8
    return nn.Sequential(
        nn.Conv2d(INPUT[0], c1, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c2, c3, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c3 * side * side, CLASSES),
    )


def torch_once(torch, sizes: Sizes, bf16: bool, epochs: int, seed: int) -> Outcome:
    """One run of torch eager with the data resident on the device (see the module docstring)."""
    from loaders import open_source

    functional = torch.nn.functional
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def autocast():
        if bf16:
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    sync()
    start = time.perf_counter()
    source = open_source(synthetic(sizes))
    try:
        n = len(source)
        images, labels, _ = source.read(np.arange(n))  # new arrays: the same values as stored()
    finally:
        source.close()
    x_all = torch.from_numpy(images).to(device)
    y_all = torch.from_numpy(labels.astype(np.int64)).to(device)
    del images, labels
    torch.manual_seed(seed)
    net = torch_net(torch, sizes).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    last_loss = [None]

    def step(x, y) -> None:
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        last_loss[0] = loss

    times = timed_epochs(resident_epoch(torch, step, x_all, y_all), epochs, sync)
    wall = time.perf_counter() - start
    loss = float(last_loss[0].detach().float().cpu()) if last_loss[0] is not None else math.nan
    return Outcome(wall, tuple(times), loss)


# -- reporting -------------------------------------------------------------------------------------


class WideCNNReporter(Reporter):
    """common.Reporter with the data on every line and a table of its own."""

    def __init__(self, out: str | None, samples: int) -> None:
        super().__init__(out)
        self.data = {"data": "synthetic", "samples": samples, "input": "x".join(map(str, INPUT))}

    def emit(self, record: dict) -> dict:
        return super().emit({**record, **self.data})

    def table(self) -> str:
        figures: dict[str, dict[str, dict]] = {}
        notes: list[tuple[str, ...]] = []
        for row in self.rows:
            if "ratio" in row:
                target = (
                    f" (target {row['target']}: {'met' if row['met'] else 'missed'})"
                    if "target" in row
                    else ""
                )
                notes.append((row["ratio"], row["metric"], f"{row['value']:.3f}{target}"))
            elif "status" in row:
                status = f"{row['metric']}: {row['status']}" if "metric" in row else row["status"]
                notes.append((row["impl"], status, row.get("reason", "")[:110]))
            else:
                figures.setdefault(row["impl"], {})[row["metric"]] = row
        header = ("impl", "precision", *(f"{m} median [min, max]" for m in METRICS), "loss", "device")
        lines = [header]
        for impl, by_metric in figures.items():
            cells = []
            for metric in METRICS:
                row = by_metric.get(metric)
                cells.append(spread_cell(row))
            first = next(iter(by_metric.values()))
            loss = fmt(by_metric["wall_s"]["loss"]) if "wall_s" in by_metric else "-"
            lines.append((impl, first["precision"], *cells, loss, first["device"]))
        parts = [aligned(lines)] if figures else []
        if notes:
            parts.append(aligned([("ratio / impl", "metric / status", "value / reason"), *notes]))
        return "\n\n".join(parts)


def report(
    rep: Reporter,
    impl: str,
    device: str,
    precision: str,
    shape: str,
    runs: list[Outcome],
    cold: list[Outcome],
) -> dict[str, float]:
    """Emit the three figures of one implementation; returns their medians."""
    samples = rep.data["samples"]
    steady = [run.steady() for run in runs]
    epochs = len(runs[0].epoch_s)
    labels = {"shape": shape, "precision": precision, "batch": BATCH, "epochs": epochs, "reps": len(runs)}
    medians = {}
    for metric, values, extra in (
        (
            "wall_s",
            [run.wall_s for run in runs],
            {
                "loss": common.median([run.loss for run in runs]),
                "cold_s": [round(run.wall_s, 4) for run in cold],
                "first_epoch_s": common.median([run.epoch_s[0] for run in runs]),
            },
        ),
        ("epoch_s", steady, {"epochs_timed": epochs - 1}),
        ("samples_per_s", [samples / s if s > 0 else math.nan for s in steady], {}),
    ):
        figure = spread(values)
        rep.figure(BENCH, impl, device, **labels, metric=metric, **figure, **extra)
        medians[metric] = figure["median"]
    return medians


def measure(
    rep: Reporter,
    args,
    impl: str,
    device: str,
    precision: str,
    shape: str,
    once: Callable[[int], Outcome],
) -> dict[str, float] | None:
    """``args.warmup`` untimed runs and ``args.reps`` timed ones of ``once(seed)``, then the figures.
    A plan that refuses the spec (flow.PlanError: "mixed" without cooperative matrices, data too
    large to keep on the device) gives a "not available" line; any other exception an "error" line."""
    from flow import PlanError

    def describe(outcome: Outcome) -> str:
        epochs = ", ".join(f"{s:.3f}" for s in outcome.epoch_s)
        return f"wall {outcome.wall_s:.3f} s, epochs {epochs} s, loss {outcome.loss:.4f}"

    def runs() -> dict[str, float] | None:
        try:
            cold, timed = warm_then_timed(once, args.warmup, args.reps, impl, describe)
        except PlanError as error:
            reason = " ".join(str(error).split())
            rep.missing(BENCH, impl, "not available", reason, shape=shape, precision=precision)
            return None
        return report(rep, impl, device, precision, shape, timed, cold)

    return rep.guarded(BENCH, impl, runs, shape=shape, precision=precision)


# -- main ------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="1024 samples, channels 4-8-16, 2 epochs, 1 rep (smoke run)"
    )
    parser.add_argument("--samples", type=int, default=None, help="generated images (default 20480)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per run, >= 2 (default 3)")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per implementation (default 5)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 1; quick 0)")
    parser.add_argument("--only", default="fp32,mixed", help="fp32 and/or mixed (default both)")
    parser.add_argument("--out", default=None, help="also append every JSON line to this file")
    parser.add_argument("--device", default="auto", help="Vulkan device: index, name substring or auto")
    args = parser.parse_args()
    args.pairs = [p.strip().lower() for p in args.only.split(",") if p.strip()]
    if not args.pairs or set(args.pairs) - set(PAIRS):
        parser.error(f"--only takes fp32 and/or mixed; got {args.only!r}")
    base = QUICK if args.quick else FULL
    args.sizes = Sizes(
        samples=base.samples if args.samples is None else args.samples,
        channels=base.channels,
        epochs=base.epochs if args.epochs is None else args.epochs,
        reps=base.reps if args.reps is None else args.reps,
        warmup=base.warmup if args.warmup is None else args.warmup,
    )
    args.reps, args.warmup = args.sizes.reps, args.sizes.warmup
    if args.sizes.samples < 1 or args.sizes.epochs < 2 or args.reps < 1 or args.warmup < 0:
        parser.error("--samples and --reps must be >= 1, --epochs >= 2 (a steady epoch), --warmup >= 0")
    return args


def main() -> None:
    args = parse_args()
    sizes: Sizes = args.sizes
    shape = shape_of(sizes)
    started = time.perf_counter()
    torch, torch_device, backend, vk_device = open_both(args.device)
    cuda = torch is not None and torch.cuda.is_available()
    rep = WideCNNReporter(args.out, sizes.samples)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-wide-cnn-") as tmp:
            folder = Path(tmp)
            for pair in args.pairs:
                vk_name, vk_precision, variant, torch_precision, target = PAIRS[pair]
                section(
                    f"{pair}: {shape}, input {'x'.join(map(str, INPUT))}, {sizes.samples} synthetic samples, "
                    f"batch {BATCH}, SGD lr {LR} momentum {MOMENTUM}, {sizes.epochs} epochs, "
                    f"{args.warmup} warm-up + {args.reps} reps"
                )
                vk = None
                if backend is None:
                    rep.missing(
                        BENCH, vk_name, "not available", vk_device, shape=shape, precision=vk_precision
                    )
                else:
                    vk = measure(
                        rep,
                        args,
                        vk_name,
                        vk_device,
                        vk_precision,
                        shape,
                        lambda seed, p=vk_precision: vk_once(backend, sizes, p, sizes.epochs, seed, folder),
                    )
                impl = torch_impl(torch, variant)
                if torch is None:
                    rep.missing(
                        BENCH,
                        impl,
                        "not available",
                        "torch is not installed",
                        shape=shape,
                        precision=torch_precision,
                    )
                    continue
                found = measure(
                    rep,
                    args,
                    impl,
                    torch_device,
                    torch_precision,
                    shape,
                    lambda seed, bf16=(pair == "mixed"): torch_once(torch, sizes, bf16, sizes.epochs, seed),
                )
                if vk is None or found is None:
                    continue
                # The targets are about a GPU: against CPU torch the ratio is only a smoke figure.
                ratio = vk["samples_per_s"] / found["samples_per_s"] if found["samples_per_s"] else math.nan
                extra = {"target": target, "met": bool(ratio >= target)} if cuda else {}
                rep.ratio(
                    BENCH,
                    f"{vk_name}/{impl}",
                    vk["samples_per_s"],
                    found["samples_per_s"],
                    metric="samples_per_s",
                    **extra,
                )
    finally:
        common.finish(rep, backend, started)


if __name__ == "__main__":
    main()

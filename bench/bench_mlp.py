"""MLP training throughput: vkflow against PyTorch on the same GPU, in one run.

What is measured (letters follow the performance issue):

(a) Small MLP 784-1024-1024-10, batch 256, fp32, SGD and Adam: samples/s of full training steps
    (forward, backward, optimiser update).
    - ``vkflow_raw``: the Engine without actors. K input slots in flight; each step copies a batch
      from host memory into its slot's host-visible io tensors, writes the step values, submits the
      slot's pre-recorded program, and waits for the oldest step only when all K slots are busy
      (then reads its loss). One line per K tried; ``best`` marks the fastest, which the ratios use.
    - ``vkflow_actors``: ``flow.run`` (loader, preprocess, device, optimiser and sink actors) on a shuffled
      Synthetic source of a real data set's size (60000 rows of 784) at K = 2, 3 and 4, each run in a fresh
      process, as a user runs it; ``best`` marks the fastest. Each run trains one whole epoch untimed, then 20
      timed epochs; the rate comes from the step times of its metrics file. The figure is the median of at
      least 5 runs, with its range and spread (``samples_per_s_min``/``_max``, ``spread_pct``), the event
      loop's CPU time a step (``loop_cpu_us_per_step``; every thread's: ``process_cpu_us_per_step``) and the
      loader's reads that went to worker threads (``thread_items``, of the ``loader_items`` it sent). See
      ``measure_actors``.
      ``vkflow_actors_streamed``: the same at the best K with Data placement "host" (every batch
      read by the loader, not kept on the device). Without ``flow.run`` a line says "not
      available".
    - ``torch_eager`` / ``torch_graph``: PyTorch eager, and the whole step (forward, backward,
      optimiser) captured in one CUDA graph with static inputs, as in the PyTorch CUDA graphs docs.
      Each step copies its batch from pinned host memory with ``non_blocking=True`` (the same work
      vkflow does). ``*_resident`` variants keep every batch on the GPU already.
      Without CUDA, torch runs on the CPU and its lines say ``torch_cpu_*``.
(b) Large MLP 1024-4096-4096-4096-1024, batch 8192, SGD: fp32 for both (TF32 off in torch), vkflow
    with its tuned GEMM tiles ("default") and with two fixed tile configs for every GEMM; torch
    bf16 autocast for reference.
    vkflow's mixed precision (run.precision="mixed": fp16 inputs on cooperative matrices, fp32
    accumulation and master weights) runs where the device has cooperative matrices.
(e) GPU idle fraction of the small-MLP vkflow step loop in steady state, from timestamp queries:
    each slot's program is recorded with a timestamp pool that the host resets before each
    submission (so the command buffer holds no reset work); for consecutive steps i, i+1 the gap is
    (first timestamp of i+1) - (last timestamp of i), and idle = sum(gaps) / (span of all steps).
    The first timestamp is the backend's TOP_OF_PIPE one, so a negative gap means the GPU started
    the next submission's front end before the last kernel of the previous one ended. The same
    timestamps give the median GPU time of every launch of the step (``step_kernels``).
(c), (d): GEMM and upload figures live in bench_gemm.py; this script runs them too when asked
    (``--only c,d`` or by default), so one command gives every figure.

Timing: end-to-end step loops use host clocks (that figure is samples/s of full steps, so it must
include Python); a calibration pass picks a step count per repetition and doubles as warm-up;
the median of ``--reps`` repetitions is reported (the actor figure: at least 5, with the range).
GPU-side times come from timestamp queries.

Output: one JSON line per figure on stdout (and appended to ``--out``), then a table, ending with
the repeated figures' median [min, max] and spread.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import common
import numpy as np
from common import Reporter, calibrated_reps, median, open_vulkan, section

from shaders.tiles import GEMM_SPEC_DEFAULTS

# Tile configs tried for the large MLP besides the default (64x64x16/4x4); bench_gemm.py tries more.
# 128x128/8x8 is not among them: on NVIDIA it ran 10x slower than the default in bench_gemm.py.
# Each sets every tuning constant (see bench_gemm.TILE_CONFIGS for why).
LARGE_TILES = (
    ("128x64x16/8x4", {**GEMM_SPEC_DEFAULTS, "BM": 128, "BN": 64, "BK": 16, "TM": 8, "TN": 4}),
    ("64x128x16/4x8", {**GEMM_SPEC_DEFAULTS, "BM": 64, "BN": 128, "BK": 16, "TM": 4, "TN": 8}),
)
KERNEL_PARAMS = ("M", "N", "K", "trans_a", "trans_b", "act", "accumulate", "n", "rows", "cols")


@dataclass(frozen=True)
class Sizes:
    small: tuple[int, ...]
    small_batch: int
    large: tuple[int, ...]
    large_batch: int
    in_flight: tuple[int, ...]  # the raw loop's K values
    actor_in_flight: tuple[int, ...]  # the actor figure's (spec.run.in_flight), each 5 fresh runs
    target_s: float  # wanted duration of one timed repetition of a step loop
    large_target_s: float
    idle_steps: int
    host_batches: int  # distinct batches kept in host memory and cycled through
    actor_samples: int  # rows of the actor figure's Synthetic set
    actor_epochs: int  # timed epochs of each actor run, after one untimed


FULL = Sizes(
    small=(784, 1024, 1024, 10),
    small_batch=256,
    large=(1024, 4096, 4096, 4096, 1024),
    large_batch=8192,
    in_flight=(1, 2, 3, 4, 8),
    # A deeper queue absorbs the host's pauses: on the H100 (session 12), K 8 ran at 1.40-1.41 M
    # samples/s in 3 runs of 3 against 1.38-1.41 M at K 4; K 3 never won a sweep.
    actor_in_flight=(2, 4, 8),
    target_s=0.5,
    large_target_s=1.5,
    idle_steps=1000,
    host_batches=16,
    actor_samples=60000,  # Fashion-MNIST's training set: 234 whole batches of 256 an epoch
    # 20 timed epochs, about 1 s on the H100: over 5 (0.25 s) one slow epoch (the host busy for a
    # moment; seen at 1.0 M among epochs of 1.33 M samples/s) moved a run's figure by 5%.
    actor_epochs=20,
)
QUICK = Sizes(
    small=(64, 128, 10),
    small_batch=64,
    large=(128, 256, 256, 128),
    large_batch=256,
    in_flight=(1, 2),
    actor_in_flight=(2,),
    target_s=0.15,
    large_target_s=0.2,
    idle_steps=40,
    host_batches=4,
    actor_samples=2048,  # 32 batches of 64
    actor_epochs=2,
)


def layer_str(sizes: tuple[int, ...]) -> str:
    return "-".join(map(str, sizes))


def host_data(sizes: tuple[int, ...], batch: int, count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``count`` batches of standard-normal inputs and uniform labels, float32 and int32."""
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((count, batch, sizes[0]), dtype=np.float32)
    ys = rng.integers(0, sizes[-1], size=(count, batch), dtype=np.int32)
    return xs, ys


# -- vkflow ----------------------------------------------------------------------------------------


def vk_spec(sizes: tuple[int, ...], batch: int, opt: str, in_flight: int, precision: str = "float32"):
    from flow.spec import SGD, Adam, CrossEntropy, Data, Linear, Model, RunSettings, Spec, Synthetic

    layers = tuple(Linear(units, activation="relu") for units in sizes[1:-1]) + (Linear(sizes[-1]),)
    model = Model(input_shape=(sizes[0],), layers=layers, loss=CrossEntropy())
    optimiser = SGD(lr=0.01) if opt == "sgd" else Adam(lr=1e-3)
    source = Synthetic(samples=batch * 16, features=(sizes[0],), classes=sizes[-1])
    return Spec(
        model=model,
        optimiser=optimiser,
        data=Data(source, batch_size=batch),
        run=RunSettings(in_flight=in_flight, precision=precision),
    )


class VkTrainer:
    """A planned MLP on one Vulkan backend, driven by a plain loop (no actors, no trio).

    With no tile override and no timestamps it uses ``Engine.submit`` (the programs the Engine
    records). Otherwise it records each slot's train program itself, with the GEMM tile override
    and/or a timestamp pool, and submits exactly as ``Engine.submit`` does.
    """

    def __init__(
        self,
        backend,
        sizes: tuple[int, ...],
        batch: int,
        opt: str,
        in_flight: int,
        host_batches: int,
        tiles: dict[str, int] | None = None,
        timestamps: bool = False,
        precision: str = "float32",
    ) -> None:
        from actors.engine import Engine
        from flow.optim import step_values
        from flow.runtime import plan_on

        self.backend, self.batch, self.slots = backend, batch, in_flight
        # Planned as flow.run plans: with this device's facts and its measured GEMM tiles.
        self.plan = plan_on(vk_spec(sizes, batch, opt, in_flight, precision), backend.facts).devices[0]
        self.engine = Engine(self.plan, backend)
        self.engine.initialise("he", 0)
        self.xs, self.ys = host_data(sizes, batch, host_batches)
        self.step = 0
        self.loss = float("nan")
        self.spans: list[tuple[float, float]] = []  # (first, last) timestamp of each step, ns
        self.launch_ns: list[np.ndarray] = []  # per step: end of each launch minus end of the one before
        self.pools = [None] * in_flight
        if tiles is None and not timestamps:
            self.engine.prepare(("train",))
            self._submit = lambda slot, step: self.engine.submit("train", slot, batch, step)
            return
        program = self.plan.program("train")
        if timestamps:
            # Reset from the host before each submission: the step's command buffer then holds
            # only the step and its timestamps, as an untimed one holds only the step.
            self.pools = [
                backend.timestamp_pool(len(program.launches) + 1, host_reset=True) for _ in range(in_flight)
            ]
        overrides = {"gemm": tiles} if tiles else None
        handles = [
            backend.record(program, slot, spec_overrides=overrides, timestamps=self.pools[slot])
            for slot in range(in_flight)
        ]

        def submit(slot: int, step: int) -> int:
            backend.write("stepvals", step_values(self.plan.optimiser, step, self.plan.batch_size), slot)
            pool = self.pools[slot]
            if pool is not None and pool.host_reset:
                backend.reset_timestamps(pool)  # the slot's last step is done: its queries are free
            return backend.submit(handles[slot])

        self._submit = submit

    def run(self, steps: int) -> float:
        """Run ``steps`` training steps, K in flight; returns host seconds until the last is done."""
        pending: deque[tuple[int, int, int]] = deque()
        count = len(self.xs)
        start = time.perf_counter()
        for _ in range(steps):
            step = self.step
            self.step += 1
            slot = step % self.slots
            if len(pending) == self.slots:  # the oldest step is the one that used this slot
                self._finish(*pending.popleft())
            self.engine.write_batch(slot, self.xs[step % count], self.ys[step % count])
            pending.append((self._submit(slot, step), slot, step))
        while pending:
            self._finish(*pending.popleft())
        return time.perf_counter() - start

    def _finish(self, ticket: int, slot: int, step: int) -> None:
        self.backend.wait(ticket)
        self.loss = self.engine.result(slot, step, self.batch).loss
        if self.pools[slot] is not None:
            stamps = self.backend.read_timestamps_ns(self.pools[slot])
            self.spans.append((float(stamps[0]), float(stamps[-1])))
            self.launch_ns.append(np.diff(stamps))


def actor_pipeline_available() -> bool:
    try:
        return importlib.util.find_spec("flow.runner") is not None
    except (ImportError, ValueError):
        return False


# The actor figure's repetitions, whatever --reps says: its spread is part of the figure (the
# issue's target is +-5 % over 5 runs), and fewer runs cannot show one.
ACTOR_REPS_MIN = 5
# How often the CPU clocks are read during an actor run. Each reading asks every actor for its
# statistics (~85 us of the event loop on the development VM), so it must be rare beside the steps
# it times; its own CPU time is taken out of the loop's.
ACTOR_POLL_S = 0.02


@dataclass(frozen=True)
class ActorRun:
    """One ``flow.run`` of the actor figure."""

    seconds_per_step: float  # wall, over the timed epochs (from the metrics file)
    setup_s: float  # from opening the pipeline to the first step's metrics line
    loop_cpu_s_per_step: float  # the event loop thread's CPU time over the timed epochs
    process_cpu_s_per_step: float  # every thread's (loader threads, drivers, fence waits)
    thread_items: int  # the loader's reads that went to worker threads
    device_thread_waits: int  # step ends the device actor waited for in a thread (past its spin)
    loader_items: int  # what the loader sent: batches and marks
    result: object


def spread(values: list[float]) -> dict:
    """Median, range, spread ((max - min) / median, in %) and the farthest a figure lies from the
    median (``within_pct``: every figure is within +- that many % of it) of repeated figures."""
    finite = [v for v in values if v == v]
    if not finite:
        nan = float("nan")
        return {"median": nan, "min": nan, "max": nan, "spread_pct": nan, "within_pct": nan}
    mid = median(finite)
    pct = (max(finite) - min(finite)) / mid * 100 if mid else float("nan")
    within = max(abs(v - mid) for v in finite) / mid * 100 if mid else float("nan")
    return {"median": mid, "min": min(finite), "max": max(finite), "spread_pct": pct, "within_pct": within}


def actor_spec(
    sizes: Sizes,
    opt: str,
    in_flight: int,
    samples: int,
    epochs: int,
    placement: str,
    metrics: str,
    metrics_every: int = 1,
):
    """The actor figure's spec: ``vk_spec``'s MLP on a Synthetic set of ``samples`` rows, whole
    batches only (each timed step is ``small_batch`` samples), no validation split (no evaluation
    rounds inside the timed epochs); ``metrics_every`` steps a metrics line (RunSettings)."""
    from dataclasses import replace

    from flow.spec import Data, RunSettings, Synthetic

    batch = sizes.small_batch
    spec = vk_spec(sizes.small, batch, opt, in_flight)
    source = Synthetic(samples=samples, features=(sizes.small[0],), classes=sizes.small[-1])
    data = Data(source, batch_size=batch, drop_last=True, placement=placement)
    run = RunSettings(epochs=epochs, in_flight=in_flight, metrics_file=metrics, metrics_every=metrics_every)
    return replace(spec, data=data, run=run)


def run_actors(backend, spec, warm_steps: int) -> ActorRun:
    """One ``flow.run`` (through ``open_pipeline``, so that the loop's CPU clocks can be read while
    it trains), timed over the steps after ``warm_steps``.

    Wall time per step comes from the metrics file (each step's line carries its seconds since the
    run began): (t(last) - t(warm)) / (last - warm). CPU time comes from readings of
    ``time.thread_time`` (this task runs on the event loop's thread, as every actor does) and
    ``time.process_time`` taken every ``ACTOR_POLL_S`` with the number of steps done, from the
    first reading past the warm-up to the last one before the end (the run's close, its summary
    and final checkpoint mark, is not a step's work), less the CPU time of the readings themselves.
    """
    import trio

    from flow.metrics import step_lines
    from flow.runner import open_pipeline

    async def main() -> tuple[object, list[tuple[int, float, float, float]]]:
        # (steps done, loop CPU, process CPU, CPU of the readings so far)
        readings: list[tuple[int, float, float, float]] = []
        own = 0.0
        async with open_pipeline(spec, backend=backend) as pipeline:
            total = pipeline.total_steps
            while True:
                start = time.thread_time()
                done = pipeline.statistics()["optimiser"].updates
                loop = time.thread_time()
                own += loop - start
                readings.append((done, loop, time.process_time(), own))
                if done >= total:
                    break
                await trio.sleep(ACTOR_POLL_S)
        return pipeline.result, readings

    result, readings = trio.run(main)
    total = readings[-1][0]
    elapsed = {}
    for line in Path(spec.run.metrics_file).read_text().splitlines():
        for record in step_lines(json.loads(line)):  # a "steps" line: metrics_every's steps
            if record.get("event") == "step":
                elapsed[int(record["step"])] = float(record["elapsed"])
    # Step numbers count from 0: the line of step s is written when s + 1 steps are done.
    last = max(elapsed)
    warm = min((s for s in elapsed if s >= warm_steps - 1), default=min(elapsed))
    per_step = (elapsed[last] - elapsed[warm]) / max(last - warm, 1)
    timed = [r for r in readings if warm_steps <= r[0] < total] or readings
    first, end = timed[0], timed[-1]
    if end[0] <= first[0]:  # a run too short for two readings in its timed epochs
        first, end = readings[0], readings[-1]
    steps = max(end[0] - first[0], 1)
    loader = result.statistics.get("loader")
    return ActorRun(
        seconds_per_step=per_step,
        setup_s=elapsed[min(elapsed)],
        loop_cpu_s_per_step=(end[1] - first[1] - (end[3] - first[3])) / steps,
        process_cpu_s_per_step=(end[2] - first[2] - (end[3] - first[3])) / steps,
        thread_items=getattr(loader, "thread_items", 0),
        loader_items=getattr(loader, "items_out", 0),
        device_thread_waits=getattr(result.statistics.get("device"), "thread_items", 0),
        result=result,
    )


def run_actors_in_process(
    device: str,
    quick: bool,
    opt: str,
    in_flight: int,
    samples: int,
    epochs: int,
    placement: str,
    metrics: str,
    warm_steps: int,
    metrics_every: int = 1,
) -> ActorRun:
    """``run_actors`` in a child process (``bench_mlp.py --actor-run``) that opens the device, runs
    once and exits; its figures come back as one JSON line, the run's result as a small dict."""
    import subprocess
    import sys

    job = dict(device=device, quick=quick, opt=opt, in_flight=in_flight, samples=samples, epochs=epochs,
               placement=placement, metrics=metrics, warm_steps=warm_steps,
               metrics_every=metrics_every)  # fmt: skip
    done = subprocess.run(
        [sys.executable, __file__, "--actor-run", json.dumps(job)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"actor run failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return ActorRun(**json.loads(lines[-1]))


def actor_run_child(job_json: str) -> None:
    """The child of ``run_actors_in_process``: one run, its ActorRun printed as JSON."""
    from dataclasses import fields

    job = json.loads(job_json)
    backend, why = open_vulkan(job["device"])
    if backend is None:
        raise SystemExit(f"no Vulkan device: {why}")
    sizes = QUICK if job["quick"] else FULL
    spec = actor_spec(
        sizes, job["opt"], job["in_flight"], job["samples"], job["epochs"], job["placement"], job["metrics"],
        job["metrics_every"],
    )  # fmt: skip
    run = run_actors(backend, spec, job["warm_steps"])
    result = run.result
    busy = {
        name: round(stats.busy_seconds / max(result.steps, 1) * 1e6, 1)
        for name, stats in result.statistics.items()
    }
    figures = {f.name: getattr(run, f.name) for f in fields(run) if f.name != "result"}
    print(json.dumps(figures | {"result": {"loss": result.loss, "busy_us_per_step": busy}}))
    backend.close()


def measure_actors(
    device: str,
    sizes: Sizes,
    opt: str,
    in_flight: int,
    reps: int,
    placement: str = "auto",
    metrics_every: int = 1,
) -> dict:
    """Steady-state samples/s of ``flow.run`` (loader, preprocess, device, optimiser and sink actors)
    on a Synthetic source of ``sizes.actor_samples`` rows (60000 x 784 in full: a real data set's
    size, so an epoch's turn comes as rarely as in a real job), reusing ``backend``.

    Each run trains one whole epoch untimed (the warm-up: the source's samples generated, caches and
    allocations settled), then ``sizes.actor_epochs`` timed epochs (see ``run_actors``). One short
    run on a small set first warms this K's pipelines and shader modules. The figure is the median
    over ``max(reps, ACTOR_REPS_MIN)`` runs, with its range and spread, the event loop's CPU time a
    step, and how many of the loader's reads went to worker threads (a cheap source's reads belong
    on the loop: each in a thread costs it a hop and GIL handoffs). ``placement`` is the spec's
    ``Data.placement``: "auto" keeps the data on the device (the loader sends indices), "host"
    streams every batch through the loader. ``metrics_every``: RunSettings' steps a metrics line.
    """
    import tempfile

    batch = sizes.small_batch
    samples = sizes.actor_samples
    per_epoch = samples // batch
    epochs = 1 + sizes.actor_epochs
    reps = max(reps, ACTOR_REPS_MIN)
    with tempfile.TemporaryDirectory() as folder:

        def metrics(name: str) -> str:
            return str(Path(folder) / f"metrics-{name}-{time.perf_counter_ns()}.jsonl")

        # Each run in a process of its own, as a user runs flow.run: on the H100 a second engine
        # in one process ran every kernel ~4.6x slower for its first few hundred steps (GPU
        # timestamps; RESULTS.md, session 6), which a whole-epoch warm-up did not always cover.
        quick = sizes == QUICK
        runs = [
            run_actors_in_process(
                device, quick, opt, in_flight, samples, epochs, placement, metrics("run"), per_epoch,
                metrics_every,
            )  # fmt: skip
            for _ in range(reps)
        ]
    rates = [batch / r.seconds_per_step if r.seconds_per_step > 0 else float("nan") for r in runs]
    figure = spread(rates)
    result = runs[-1].result  # the last run's loss and busy time per step of each actor (whole run)
    return {
        "samples_per_s": figure["median"],
        "samples_per_s_min": figure["min"],
        "samples_per_s_max": figure["max"],
        "spread_pct": figure["spread_pct"],
        "within_pct": figure["within_pct"],
        "values": [round(v, 1) for v in rates],
        "reps": reps,
        "in_flight": in_flight,
        "placement": placement,
        "metrics_every": metrics_every,
        "samples": samples,
        "epochs_timed": sizes.actor_epochs,
        "steps_timed": per_epoch * sizes.actor_epochs,
        "loop_cpu_us_per_step": median([r.loop_cpu_s_per_step * 1e6 for r in runs]),
        "process_cpu_us_per_step": median([r.process_cpu_s_per_step * 1e6 for r in runs]),
        "thread_items": max(r.thread_items for r in runs),
        # Per run, beside "values": where a slow run comes from (the spread hunt of issue 13).
        "device_thread_waits": [r.device_thread_waits for r in runs],
        "loop_cpu_us_values": [round(r.loop_cpu_s_per_step * 1e6, 1) for r in runs],
        "loader_items": runs[-1].loader_items,
        "setup_s": median([r.setup_s for r in runs]),
        "loss": result["loss"],
        "busy_us_per_step": result["busy_us_per_step"],
    }


# -- torch -----------------------------------------------------------------------------------------


class TorchTrainer:
    """The same MLP in PyTorch: eager or one CUDA graph per step, batches from host or resident."""

    def __init__(
        self,
        torch,
        sizes: tuple[int, ...],
        batch: int,
        opt: str,
        mode: str,
        resident: bool,
        host_batches: int,
        autocast_bf16: bool = False,
    ) -> None:
        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.mode, self.resident, self.autocast = mode, resident, autocast_bf16
        torch.manual_seed(0)
        layers: list = []
        for fan_in, fan_out in zip(sizes[:-2], sizes[1:-1], strict=True):
            layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
        layers.append(torch.nn.Linear(sizes[-2], sizes[-1]))
        self.model = torch.nn.Sequential(*layers).to(self.device)
        params = self.model.parameters()
        graph = mode == "graph"
        if opt == "sgd":
            self.opt = torch.optim.SGD(params, lr=0.01)
        else:
            self.opt = torch.optim.Adam(params, lr=1e-3, capturable=graph)
        xs, ys = host_data(sizes, batch, host_batches)
        self.xs = [torch.from_numpy(x) for x in xs]
        self.ys = [torch.from_numpy(y).long() for y in ys]
        if self.cuda:
            if resident:
                self.xs = [x.to(self.device) for x in self.xs]
                self.ys = [y.to(self.device) for y in self.ys]
            else:
                self.xs = [x.pin_memory() for x in self.xs]
                self.ys = [y.pin_memory() for y in self.ys]
        self.i = 0
        self.loss = None
        if graph:
            self._capture()

    def _loss(self, x, y):
        torch = self.torch
        if self.autocast:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                return torch.nn.functional.cross_entropy(self.model(x), y)
        return torch.nn.functional.cross_entropy(self.model(x), y)

    def _eager_step(self) -> None:
        x, y = self.xs[self.i % len(self.xs)], self.ys[self.i % len(self.ys)]
        self.i += 1
        if self.cuda:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.opt.zero_grad(set_to_none=True)
        self.loss = self._loss(x, y)
        self.loss.backward()
        self.opt.step()

    def _capture(self) -> None:
        """Whole-network capture (PyTorch docs, "CUDA Graphs"): warm up on a side stream, then
        capture forward, backward and the optimiser step reading static input tensors."""
        torch = self.torch
        self.static_x = self.xs[0].to(self.device).clone()
        self.static_y = self.ys[0].to(self.device).clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.opt.zero_grad(set_to_none=True)
                self._loss(self.static_x, self.static_y).backward()
                self.opt.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        self.opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(self.graph):
            self.loss = self._loss(self.static_x, self.static_y)
            self.loss.backward()
            self.opt.step()

    def _graph_step(self) -> None:
        self.static_x.copy_(self.xs[self.i % len(self.xs)], non_blocking=True)
        self.static_y.copy_(self.ys[self.i % len(self.ys)], non_blocking=True)
        self.i += 1
        self.graph.replay()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def run(self, steps: int) -> float:
        step = self._graph_step if self.mode == "graph" else self._eager_step
        self.sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        self.sync()
        return time.perf_counter() - start

    def loss_value(self) -> float:
        return float(self.loss.detach().float().cpu()) if self.loss is not None else float("nan")


def torch_impl(torch, mode: str, resident: bool = False, suffix: str = "") -> str:
    base = "torch" if torch.cuda.is_available() else "torch_cpu"
    return f"{base}_{mode}{'_resident' if resident else ''}{suffix}"


# -- the parts -------------------------------------------------------------------------------------


def measure(trainer, reps: int, target_s: float, batch: int, start: int) -> tuple[float, int]:
    """(median samples/s, steps per repetition) of ``trainer.run``."""
    steps, times = calibrated_reps(trainer.run, reps, target_s, start=start)
    return steps * batch / median(times), steps


def swept(rep: Reporter, bench: str, impl: str, device: str, ks, measure_at, **labels) -> dict | None:
    """Measure ``measure_at(k)`` for each K in ``ks`` (a failure becomes an error line) and report
    every point, the fastest marked ``best``.

    Returns:
        The fastest result, or None when none was measured.
    """
    found = []
    for k in ks:
        result = rep.guarded(bench, impl, lambda k=k: measure_at(k), in_flight=k, **labels)
        if result is not None:
            found.append(result)
    if not found:
        return None
    best = max(found, key=lambda r: r["samples_per_s"])
    for result in found:
        rep.figure(bench, impl, device, **labels, **result, best=result is best)
    return best


def part_a(args, rep: Reporter, sizes: Sizes, backend, vk_device: str, torch, torch_device: str) -> None:
    section(f"(a) small MLP {layer_str(sizes.small)}, batch {sizes.small_batch}, fp32")
    bench, shape, batch = "mlp_small", layer_str(sizes.small), sizes.small_batch
    for opt in ("sgd", "adam"):
        vk_best: dict | None = None
        if backend is None:
            rep.missing(bench, "vkflow_raw", "not available", vk_device, opt=opt, shape=shape)
        else:

            def raw(k: int, opt: str = opt) -> dict:
                trainer = VkTrainer(backend, sizes.small, batch, opt, k, sizes.host_batches)
                value, steps = measure(trainer, args.reps, sizes.target_s, batch, start=16)
                return {"samples_per_s": value, "in_flight": k, "steps": steps, "loss": trainer.loss}

            vk_best = swept(rep, bench, "vkflow_raw", vk_device, sizes.in_flight, raw, opt=opt, shape=shape)
        actors_rate = None
        if not actor_pipeline_available():
            print("actor pipeline: not available")
            rep.missing(bench, "vkflow_actors", "not available", "no flow.run module", opt=opt)
        elif backend is not None:
            # K is the spec's in_flight, the user's choice: swept like the raw loop's, the best
            # K is the figure (the actor pipeline's best K need not be the raw loop's).
            ks = sizes.actor_in_flight

            def actors(k: int, opt: str = opt) -> dict:
                return measure_actors(args.device, sizes, opt, k, args.reps, metrics_every=args.metrics_every)

            actors_best = swept(rep, bench, "vkflow_actors", vk_device, ks, actors, opt=opt, shape=shape)
            if actors_best is not None:
                actors_rate = actors_best["samples_per_s"]
                if vk_best is not None:
                    rep.ratio(
                        bench, "vkflow_actors/vkflow_raw", actors_rate, vk_best["samples_per_s"], opt=opt
                    )
                # The same run with every batch read by the loader (Data placement "host"), at the
                # best K: the figure where reads could go to worker threads.
                k = actors_best["in_flight"]
                streamed = rep.guarded(
                    bench,
                    "vkflow_actors_streamed",
                    lambda k=k, opt=opt: measure_actors(
                        args.device, sizes, opt, k, args.reps, "host", args.metrics_every
                    ),
                    opt=opt,
                    shape=shape,
                    in_flight=k,
                )
                if streamed is not None:
                    rep.figure(bench, "vkflow_actors_streamed", vk_device, opt=opt, shape=shape, **streamed)

        if torch is None:
            rep.missing(bench, "torch", "not available", "torch is not installed", opt=opt, shape=shape)
            continue
        torch_rates: dict[str, float] = {}
        variants = [("eager", False), ("graph", False), ("eager", True), ("graph", True)]
        if not torch.cuda.is_available():
            variants = [("eager", False)]
            rep.missing(bench, "torch_graph", "not available", "no CUDA: CUDA graphs need a GPU", opt=opt)
        for mode, resident in variants:
            impl = torch_impl(torch, mode, resident)

            def one(mode=mode, resident=resident, opt=opt):
                trainer = TorchTrainer(torch, sizes.small, batch, opt, mode, resident, sizes.host_batches)
                value, steps = measure(trainer, args.reps, sizes.target_s, batch, start=16)
                return {"samples_per_s": value, "steps": steps, "loss": trainer.loss_value()}

            result = rep.guarded(bench, impl, one, opt=opt, shape=shape)
            if result is not None:
                rep.figure(bench, impl, torch_device, opt=opt, shape=shape, **result)
                torch_rates[impl] = result["samples_per_s"]
        if vk_best is not None:
            for impl, rate in torch_rates.items():
                rep.ratio(
                    bench,
                    f"vkflow_raw/{impl}",
                    vk_best["samples_per_s"],
                    rate,
                    opt=opt,
                    in_flight=vk_best["in_flight"],
                )
        for impl, rate in torch_rates.items():
            rep.ratio(bench, f"vkflow_actors/{impl}", actors_rate, rate, opt=opt)


def part_b(args, rep: Reporter, sizes: Sizes, backend, vk_device: str, torch, torch_device: str) -> None:
    section(f"(b) large MLP {layer_str(sizes.large)}, batch {sizes.large_batch}, SGD")
    bench, shape, batch, opt = "mlp_large", layer_str(sizes.large), sizes.large_batch, "sgd"
    vk_rate = None
    if backend is None:
        rep.missing(bench, "vkflow_raw", "not available", vk_device, shape=shape)
    else:
        for name, tiles in (("default", None), *LARGE_TILES):

            def one(tiles=tiles):
                trainer = VkTrainer(backend, sizes.large, batch, opt, 2, 2, tiles=tiles)
                value, steps = measure(trainer, args.reps, sizes.large_target_s, batch, start=1)
                return {"samples_per_s": value, "steps": steps, "loss": trainer.loss}

            result = rep.guarded(bench, "vkflow_raw", one, shape=shape, dtype="fp32", tiles=name)
            if result is not None:
                rep.figure(
                    bench,
                    "vkflow_raw",
                    vk_device,
                    shape=shape,
                    dtype="fp32",
                    tiles=name,
                    in_flight=2,
                    **result,
                )
                vk_rate = max(vk_rate or 0.0, result["samples_per_s"])
    coop_rate = None
    if backend is not None and "cooperative_matrix" in backend.facts.features:

        def mixed():
            trainer = VkTrainer(backend, sizes.large, batch, opt, 2, 2, precision="mixed")
            value, steps = measure(trainer, args.reps, sizes.large_target_s, batch, start=1)
            return {"samples_per_s": value, "steps": steps, "loss": trainer.loss}

        result = rep.guarded(bench, "vkflow_coopmat", mixed, shape=shape, dtype="fp16")
        if result is not None:
            rep.figure(bench, "vkflow_coopmat", vk_device, shape=shape, dtype="fp16", in_flight=2, **result)
            coop_rate = result["samples_per_s"]
    else:
        rep.missing(
            bench, "vkflow_coopmat", "not available", "device has no cooperative matrices", shape=shape
        )
    if torch is None:
        rep.missing(bench, "torch", "not available", "torch is not installed", shape=shape)
        return
    rates = {}
    for dtype, autocast in (("fp32", False), ("bf16", True)):
        impl = torch_impl(torch, "eager", suffix="_bf16_autocast" if autocast else "")
        if autocast and not torch.cuda.is_available():
            rep.missing(bench, impl, "not available", "bf16 reference only on CUDA", shape=shape, dtype=dtype)
            continue

        def one(autocast=autocast):
            trainer = TorchTrainer(torch, sizes.large, batch, opt, "eager", False, 2, autocast_bf16=autocast)
            value, steps = measure(trainer, args.reps, sizes.large_target_s, batch, start=1)
            return {"samples_per_s": value, "steps": steps, "loss": trainer.loss_value()}

        result = rep.guarded(bench, impl, one, shape=shape, dtype=dtype)
        if result is not None:
            rep.figure(bench, impl, torch_device, shape=shape, dtype=dtype, **result)
            rates[dtype] = (impl, result["samples_per_s"])
    if vk_rate and "fp32" in rates:
        rep.ratio(bench, f"vkflow_raw/{rates['fp32'][0]}", vk_rate, rates["fp32"][1], dtype="fp32")
    if vk_rate and "bf16" in rates:
        rep.ratio(bench, f"vkflow_raw_fp32/{rates['bf16'][0]}", vk_rate, rates["bf16"][1])
    if coop_rate and "bf16" in rates:
        rep.ratio(bench, f"vkflow_coopmat/{rates['bf16'][0]}", coop_rate, rates["bf16"][1])


def part_e(args, rep: Reporter, sizes: Sizes, backend, vk_device: str) -> None:
    section(f"(e) GPU idle fraction, small MLP {layer_str(sizes.small)} step loop (SGD), timestamp queries")
    bench, shape, batch = "idle", layer_str(sizes.small), sizes.small_batch
    if backend is None:
        rep.missing(bench, "vkflow_raw", "not available", vk_device, shape=shape)
        return
    for k in sizes.in_flight:

        def one(k=k):
            trainer = VkTrainer(backend, sizes.small, batch, "sgd", k, sizes.host_batches, timestamps=True)
            trainer.run(max(8, sizes.idle_steps // 10))  # warm-up
            trainer.spans.clear()
            trainer.launch_ns.clear()
            elapsed = trainer.run(sizes.idle_steps)
            spans = sorted(trainer.spans)
            starts = np.array([s for s, _ in spans])
            ends = np.array([e for _, e in spans])
            gaps = starts[1:] - ends[:-1]
            total = ends[-1] - starts[0]
            busy = ends - starts
            return {
                "idle_fraction": float(np.clip(gaps, 0, None).sum() / total),
                "gap_us_median": float(np.median(gaps) / 1e3),
                "gap_us_p90": float(np.percentile(gaps, 90) / 1e3),
                "negative_gaps": int((gaps < 0).sum()),
                "gpu_step_us_median": float(np.median(busy) / 1e3),
                "wall_step_us": elapsed / sizes.idle_steps * 1e6,
                "steps": sizes.idle_steps,
                "kernels": kernel_breakdown(trainer),
            }

        result = rep.guarded(bench, "vkflow_raw", one, shape=shape, opt="sgd", in_flight=k)
        if result is None:
            continue
        kernels = result.pop("kernels")
        rep.figure(bench, "vkflow_raw", vk_device, shape=shape, opt="sgd", in_flight=k, **result)
        if k == max(sizes.in_flight):
            print(f"per-launch GPU time, median over steps (in_flight={k}): from the end of the launch")
            print("before (so the barrier before it is included); launches in one barrier group overlap")
            for kernel in sorted(kernels, key=lambda item: -item["us"]):
                us, index, op = kernel["us"], kernel["launch"], kernel["op"]
                print(f"  {us:9.2f} us  #{index:<3d} {op:<16s} {kernel['params']}")
            rep.figure(
                "step_kernels",
                "vkflow_raw",
                vk_device,
                shape=shape,
                opt="sgd",
                in_flight=k,
                us=float(sum(item["us"] for item in kernels)),
                kernels=kernels,
            )


def kernel_breakdown(trainer: VkTrainer) -> list[dict]:
    """Median GPU time of each launch of the train program over the timed steps."""
    launches = trainer.plan.program("train").launches
    medians = np.median(np.stack(trainer.launch_ns), axis=0) / 1e3
    result = []
    for index, (item, us) in enumerate(zip(launches, medians, strict=True)):
        params = " ".join(f"{k}={v}" for k, v in item.params if k in KERNEL_PARAMS)
        result.append({"launch": index, "op": item.op, "params": params, "us": round(float(us), 3)})
    return result


class MLPReporter(Reporter):
    """common.Reporter whose table ends with the repeated figures' spread: for each line with one,
    the median [min, max] and the spread in %, the event loop's CPU time a step and how many reads
    went to worker threads."""

    def table(self) -> str:
        text = super().table()
        lines = [("bench", "case", "impl", "samples/s median [min, max]", "spread", "within", "loop CPU/step",
                  "process CPU/step", "loader items in threads")]  # fmt: skip
        for row in self.rows:
            if "spread_pct" not in row:
                continue
            case = " ".join(f"{k}={row[k]}" for k in (*Reporter.CASE_KEYS, "placement") if k in row)
            low, high = row["samples_per_s_min"], row["samples_per_s_max"]
            rates = f"{row['samples_per_s']:,.0f} [{low:,.0f}, {high:,.0f}]"
            lines.append(
                (
                    row["bench"],
                    case,
                    row["impl"],
                    rates,
                    f"{row['spread_pct']:.1f} %",
                    f"+-{row['within_pct']:.1f} %",
                    f"{row['loop_cpu_us_per_step']:.1f} us",
                    f"{row['process_cpu_us_per_step']:.1f} us",
                    f"{row['thread_items']} of {row['loader_items']}",
                )
            )
        if len(lines) == 1:
            return text
        widths = [max(len(str(line[i])) for line in lines) for i in range(len(lines[0]))]
        block = []
        for index, line in enumerate(lines):
            block.append("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
            if index == 0:
                block.append("  ".join("-" * w for w in widths))
        return text + "\n\nrepeated figures (" + f"{ACTOR_REPS_MIN}+ runs each)\n" + "\n".join(block)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], "abcde")
    sizes = QUICK if args.quick else FULL
    rep = MLPReporter(args.out)
    torch, torch_device = common.open_torch()
    backend, why = open_vulkan(args.device)
    if backend is None:
        vk_device = f"no Vulkan: {why}"
        print(f"vkflow: {vk_device}")
    else:
        facts = backend.facts
        vk_device = facts.name
        print(f"vkflow on {facts.name} ({facts.driver_version}, Vulkan {facts.api_version})")
    started = time.perf_counter()
    try:
        if "a" in args.parts:
            part_a(args, rep, sizes, backend, vk_device, torch, torch_device)
        if "b" in args.parts:
            part_b(args, rep, sizes, backend, vk_device, torch, torch_device)
        if "e" in args.parts:
            part_e(args, rep, sizes, backend, vk_device)
        if args.parts & {"c", "d"}:
            import bench_gemm

            bench_gemm.run_parts(args, rep, backend, vk_device, torch, torch_device)
    finally:
        common.finish(rep, backend, started)


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--actor-run":
        actor_run_child(sys.argv[2])
    else:
        main()

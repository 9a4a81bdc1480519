"""A real training job, start to finish: Fashion-MNIST with vkflow and PyTorch on the same GPU.

The job (issue 13): 60000 training and 10000 test images of 28x28 uint8 pixels in 10 classes, read
from IDX files as shipped; batch 256, SGD (lr 0.05, momentum 0.9), cross-entropy, every training
sample once per epoch in a fresh shuffle (the last batch of an epoch is partial: 60000 = 234 x 256
+ 96), then accuracy on the test set. Two models:

- ``mlp``: Flatten -> Linear(1024, relu) -> Linear(1024, relu) -> Linear(10), 10 epochs.
- ``cnn``: Conv2d(32, 3, padding 1, relu) -> MaxPool2d(2) -> Conv2d(64, 3, padding 1, relu) ->
  MaxPool2d(2) -> Flatten -> Linear(128, relu) -> Linear(10), input (1, 28, 28), 2 epochs.

Data: Debian's ``dataset-fashion-mnist`` package ships the four files under
``/usr/share/datasets/fashion-mnist/`` (``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``,
``t10k-images-idx3-ubyte.gz``, ``t10k-labels-idx1-ubyte.gz``). Where they are absent, the script
writes a set of the same size and shape into a temporary folder with ``loaders.write_idx``: each
class is a few Gaussian blobs at class-specific places, each image one of them shifted by up to 3
pixels, scaled, with pixel noise (learnable, not trivial). Every JSON line says which it used:
``"data": "fashion-mnist"`` or ``"data": "generated"``.

The implementations, each trained from scratch once per repetition, in one process, on one GPU:

- ``vkflow``: ``flow.run`` on a spec reading the IDX files through ``flow.spec.IDX`` (uint8 arrives in
  [0, 1]) with ``Split(train=1.0)``, the default ``RunSettings`` (in_flight 2) plus a metrics file and
  a checkpoint folder in a temporary directory. Test accuracy: ``flow.predict(result.checkpoint,
  IDX(test images, test labels))``, argmax against the labels. Every run reuses one opened Vulkan
  backend (the counterpart of torch's CUDA context, which is also made once, before any timing).
- ``torch_eager_loader``: PyTorch eager; a ``DataLoader`` over a ``TensorDataset`` of the float
  images (shuffle, ``pin_memory=True``, no worker processes), each batch copied with
  ``.to(device, non_blocking=True)``.
- ``torch_eager_resident``: the whole data set on the GPU (uint8 uploaded, converted there); each
  epoch a ``torch.randperm`` on the GPU, each batch gathered by indexing.
- ``torch_graph_resident``: as resident, with one training step (gather by a static index buffer,
  forward, backward, SGD update) captured in one CUDA graph after a warm-up on a side stream, as
  in the PyTorch CUDA graphs docs and bench_mlp.py. A step copies its indices into the static
  buffer and replays. The partial last batch replays the same graph with its missing rows pointing
  at row 0 and weighted 0 (the loss is the weighted sum of per-row losses, weights 1/rows), so its
  update equals that of a 96-row batch. The warm-up runs with every weight 0, so it leaves the
  parameters and the momentum buffers unchanged.
  Without CUDA, torch runs on the CPU (``torch_cpu_*`` names) and the graph variant is "not available".
  torch computes in fp32 with TF32 off (``common.import_torch``); cuDNN keeps its defaults.

The image-folder variant of the MLP job (``folder``): the same training images written once as
grey PNG files, ``<tmp>/png/<label>/<index>.png`` (the time to write them is printed, not a figure),
and the same MLP trained from them:

- ``vkflow_folder``: ``flow.run`` on ``flow.spec.ImageFolder`` (its default ``cache="auto"``): the
  folder's decoded-pixel cache is removed before each repetition and made again by opening the
  folder, timed as ``decode_s`` (every PNG decoded in the source's two threads and written to the
  user cache); the run then opens that cache and keeps the pixels on the device, as for IDX. So
  ``wall_s`` is a run on a folder decoded before (the second run onwards), ``decode_s`` what the
  first run adds, ``first_epoch_s`` and ``epoch_s`` the first and the steady epochs.
- ``vkflow_folder_streamed``: the same with ``Data.placement="host"``: batches are gathered from
  the cache on the host and read into the device's input slots.
- ``torch_eager_folder``: a ``DataLoader`` (batch 256, shuffle, ``pin_memory`` with CUDA, two worker
  processes as vkflow has two decode threads, kept between epochs) over
  ``torchvision.datasets.ImageFolder`` with ``Grayscale(1)`` and ``ToTensor()`` (a minimal Pillow
  ``Dataset`` where torchvision is missing): every epoch decodes every PNG again.

Figures, each the median and range (min, max) over ``--reps`` timed runs, after ``--warmup``
untimed runs per implementation (their wall time is reported as ``cold_s``: shader compilation,
cuBLAS/cuDNN start-up):

- ``wall_s``: wall time with setup, on the host clock: for vkflow the ``flow.run`` call (planning,
  opening and reading the files, uploads, recording, every epoch, the final checkpoint write); for
  torch from reading the IDX files (the same ``loaders.read_idx``) through building the model,
  optimiser, loader or resident tensors and graph, every epoch, to a final synchronize. The test
  evaluation is outside it (reported as ``eval_s``).
- ``epoch_s``: steady seconds per epoch, the mean over epochs 2..E (the first holds warm-up and
  pipeline start). vkflow: from the metrics file's step lines, whose ``elapsed`` is the host time
  at which the sink received each step's result; an epoch's end is its last step's line, so
  epoch e takes elapsed(last step of e) - elapsed(last step of e-1). torch: a host timer around
  each epoch, ending in ``torch.cuda.synchronize()``.
- ``samples_per_s``: training samples over the steady epochs divided by their time.
- ``accuracy``: test accuracy of the trained model, mean(argmax == label) over the test images.
- ratio lines ``vkflow/<torch impl>`` of the medians, for ``epoch_s`` and ``wall_s`` (time ratios:
  above 1 means vkflow took longer).

Options: ``--quick`` (generated 2048 train / 512 test images, narrower models (MLP 784-256-256-10,
CNN 4/8 channels and 16 units), 2 epochs so a steady epoch exists, 1 repetition, no warm-up: a smoke
run on lavapipe), ``--reps N`` (default 5), ``--warmup N`` (default 1), ``--epochs N`` (every job),
``--only mlp,cnn,folder`` (``folder``: the image-folder MLP job, with the epochs of ``mlp``),
``--data auto|generated|DIR`` (auto: the Debian folder when all four files are
there, else generated; a DIR with ``--quick`` is cut to the quick sizes), ``--out FILE`` (append the
JSON lines), ``--device`` (the Vulkan device: index, name substring or auto). Progress goes to stderr.

Output: one JSON line per figure as soon as it is known (``{"bench": "realworld", "model", "shape",
"metric", "median", "min", "max", "values", ..., "impl", "device", "data"}``), then a table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import common
import numpy as np
from common import Reporter, open_vulkan, section

from loaders import read_idx, write_idx

BENCH = "realworld"
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
MODELS = ("mlp", "cnn", "folder")  # folder: the MLP job read from PNG files
METRICS = ("wall_s", "epoch_s", "samples_per_s", "accuracy")
BATCH = 256
LR = 0.05
MOMENTUM = 0.9
CLASSES = 10
SIDE = 28


@dataclass(frozen=True)
class Sizes:
    train: int
    test: int
    mlp_hidden: tuple[int, ...]
    cnn_channels: tuple[int, int]
    cnn_hidden: int
    epochs: dict[str, int]
    reps: int
    warmup: int


FULL = Sizes(
    train=60000,
    test=10000,
    mlp_hidden=(1024, 1024),
    cnn_channels=(32, 64),
    cnn_hidden=128,
    epochs={"mlp": 10, "cnn": 2},
    reps=5,
    warmup=1,
)
QUICK = Sizes(
    train=2048,
    test=512,
    mlp_hidden=(256, 256),
    cnn_channels=(4, 8),
    cnn_hidden=16,
    epochs={"mlp": 2, "cnn": 2},
    reps=1,
    warmup=0,
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- data ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataSet:
    kind: str  # "fashion-mnist" or "generated"
    train_images: str
    train_labels: str
    test_images: str
    test_labels: str
    train: int
    test: int


def generate(rng: np.random.Generator, count: int, centres: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``count`` MNIST-shaped images (uint8, 28x28) and labels: each class a sum of Gaussian blobs
    at its own places (``centres``: [classes, blobs, 3] of row, column, width), each image shifted by
    up to 3 pixels, scaled by 0.6..1 and overlaid with noise.

    Args:
        rng: the generator.
        count: how many images.
        centres: the blobs of each class.

    Returns:
        (images [count, 28, 28] uint8, labels [count] uint8), classes balanced.
    """
    grid = np.arange(SIDE, dtype=np.float32)
    templates = np.zeros((CLASSES, SIDE, SIDE), np.float32)
    for c in range(CLASSES):
        for row, col, width in centres[c]:
            templates[c] += np.exp(
                -((grid[:, None] - row) ** 2 + (grid[None, :] - col) ** 2) / (2 * width**2)
            )
    templates /= templates.max(axis=(1, 2), keepdims=True)
    labels = (np.arange(count) % CLASSES).astype(np.uint8)
    rng.shuffle(labels)
    images = np.empty((count, SIDE, SIDE), np.uint8)
    chunk = 8192
    for start in range(0, count, chunk):
        y = labels[start : start + chunk]
        n = len(y)
        # Shift by (dy, dx) in [-3, 3]: roll each image's template (few distinct shifts: loop them).
        shifts = rng.integers(-3, 4, size=(n, 2))
        x = templates[y]
        for dy in range(-3, 4):
            for dx in range(-3, 4):
                pick = (shifts[:, 0] == dy) & (shifts[:, 1] == dx)
                if pick.any():
                    x[pick] = np.roll(x[pick], (dy, dx), axis=(1, 2))
        x = x * rng.uniform(0.6, 1.0, size=(n, 1, 1)).astype(np.float32) * 220.0
        x += rng.normal(0.0, 45.0, size=x.shape).astype(np.float32)
        images[start : start + n] = np.clip(x, 0, 255).astype(np.uint8)
    return images, labels


def generated_set(folder: Path, train: int, test: int, seed: int = 13) -> DataSet:
    """Write a generated train and test set as four IDX files in ``folder``."""
    rng = np.random.default_rng(seed)
    blobs = 3
    centres = np.stack(
        [
            rng.uniform(5, 23, (CLASSES, blobs)),
            rng.uniform(5, 23, (CLASSES, blobs)),
            rng.uniform(1.5, 4.0, (CLASSES, blobs)),
        ],
        axis=-1,
    )
    paths = {name: str(folder / f"generated-{name}.idx") for name in FASHION_FILES}
    for split, count in (("train", train), ("test", test)):
        images, labels = generate(rng, count, centres)
        write_idx(paths[f"{split}_images"], images)
        write_idx(paths[f"{split}_labels"], labels)
    return DataSet("generated", **paths, train=train, test=test)


def fashion_set(folder: Path) -> DataSet | None:
    """The Fashion-MNIST files in ``folder``, or None when any of the four is missing."""
    paths = {name: folder / file for name, file in FASHION_FILES.items()}
    if not all(path.is_file() for path in paths.values()):
        return None
    train = int(read_idx(paths["train_labels"]).shape[0])
    test = int(read_idx(paths["test_labels"]).shape[0])
    return DataSet("fashion-mnist", **{k: str(v) for k, v in paths.items()}, train=train, test=test)


def cut(data: DataSet, folder: Path, train: int, test: int) -> DataSet:
    """The first ``train`` / ``test`` samples of ``data``, written as IDX files in ``folder``."""
    paths = {name: str(folder / f"cut-{name}.idx") for name in FASHION_FILES}
    for split, count in (("train", train), ("test", test)):
        for part in ("images", "labels"):
            key = f"{split}_{part}"
            write_idx(paths[key], np.asarray(read_idx(getattr(data, key))[:count]))
    total_train = min(train, data.train)
    total_test = min(test, data.test)
    return DataSet(data.kind, **paths, train=total_train, test=total_test)


def open_data(choice: str, sizes: Sizes, quick: bool, folder: Path) -> DataSet:
    """The data set the run uses (see ``--data``): --quick trains on generated images unless given
    a folder, which it cuts to the quick sizes."""
    if choice == "generated" or (quick and choice == "auto"):
        return generated_set(folder, sizes.train, sizes.test)
    where = FASHION_DIR if choice == "auto" else Path(choice)
    found = fashion_set(where)
    if found is None:
        if choice != "auto":
            raise SystemExit(f"--data {choice}: the four Fashion-MNIST IDX files are not all there")
        log(f"no Fashion-MNIST under {where}: generating an MNIST-shaped set")
        return generated_set(folder, sizes.train, sizes.test)
    return cut(found, folder, sizes.train, sizes.test) if quick else found


def write_png_folder(data: DataSet, folder: Path) -> Path:
    """The training images as grey PNG files, ``folder/<label>/<index>.png`` (lossless: the pixels
    read back are the IDX file's), written in threads (Pillow's encoder releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    from PIL import Image

    images, labels = read_idx(data.train_images), read_idx(data.train_labels)
    for label in np.unique(labels).tolist():
        (folder / str(label)).mkdir(parents=True, exist_ok=True)

    def write(index: int) -> None:
        Image.fromarray(np.asarray(images[index])).save(folder / str(labels[index]) / f"{index:05d}.png")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, range(len(labels))))
    return folder


# -- models ----------------------------------------------------------------------------------------


def shape_of(model: str, sizes: Sizes) -> str:
    if model == "mlp":
        return "-".join(map(str, (SIDE * SIDE, *sizes.mlp_hidden, CLASSES)))
    c1, c2 = sizes.cnn_channels
    return f"conv{c1}-pool-conv{c2}-pool-{sizes.cnn_hidden}-{CLASSES}"


def vk_layers(model: str, sizes: Sizes) -> tuple:
    from flow.spec import Conv2d, Flatten, Linear, MaxPool2d

    if model == "mlp":
        hidden = tuple(Linear(units, activation="relu") for units in sizes.mlp_hidden)
        return (Flatten(), *hidden, Linear(CLASSES))
    c1, c2 = sizes.cnn_channels
    return (
        Conv2d(c1, 3, padding=1, activation="relu"),
        MaxPool2d(2),
        Conv2d(c2, 3, padding=1, activation="relu"),
        MaxPool2d(2),
        Flatten(),
        Linear(sizes.cnn_hidden, activation="relu"),
        Linear(CLASSES),
    )


def torch_net(torch, model: str, sizes: Sizes):
    nn = torch.nn
    if model == "mlp":
        layers: list = [nn.Flatten()]
        fan_in = SIDE * SIDE
        for units in sizes.mlp_hidden:
            layers += [nn.Linear(fan_in, units), nn.ReLU()]
            fan_in = units
        return nn.Sequential(*layers, nn.Linear(fan_in, CLASSES))
    c1, c2 = sizes.cnn_channels
    return nn.Sequential(
        nn.Conv2d(1, c1, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * (SIDE // 4) ** 2, sizes.cnn_hidden),
        nn.ReLU(),
        nn.Linear(sizes.cnn_hidden, CLASSES),
    )


# -- one run of each implementation -----------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One training run: wall seconds with setup, seconds of each epoch, test accuracy, and more."""

    wall_s: float
    epoch_s: tuple[float, ...]
    accuracy: float
    loss: float
    eval_s: float
    decode_s: float = math.nan  # the image-folder job: opening the folder without its cache
    setup: dict[str, float] | None = None  # flow.run's RunResult.setup: seconds by part

    def steady(self) -> float:
        """Mean seconds of epochs 2..E; NaN with one epoch."""
        rest = self.epoch_s[1:]
        return sum(rest) / len(rest) if rest else math.nan


def epochs_from_metrics(path: Path) -> tuple[float, ...]:
    """Each epoch's seconds from a metrics file: the first from the sink's start to the epoch's last
    step line, each later one between the last step lines of two epochs."""
    last: dict[int, float] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "step":
            last[int(record["epoch"])] = float(record["elapsed"])
    ends = [last[e] for e in sorted(last)]
    return tuple(b - a for a, b in zip([0.0, *ends[:-1]], ends, strict=True))


def job_spec(model: str, sizes: Sizes, source, seed: int, run, placement: str = "auto"):
    """The job's spec: ``model`` on ``source``, batch 256, SGD with momentum, every sample trained."""
    from flow.spec import SGD, CrossEntropy, Data, Init, Model, Spec, Split

    return Spec(
        model=Model(
            input_shape=(1, SIDE, SIDE),
            layers=vk_layers(model, sizes),
            loss=CrossEntropy(),
            init=Init(seed=seed),
        ),
        optimiser=SGD(LR, momentum=MOMENTUM),
        data=Data(source, batch_size=BATCH, seed=seed, split=Split(train=1.0), placement=placement),
        run=run,
    )


def vk_once(
    backend,
    model: str,
    sizes: Sizes,
    data: DataSet,
    epochs: int,
    seed: int,
    folder: Path,
    placement: str = "auto",
    png_root: Path | None = None,
) -> Outcome:
    import flow
    from flow.spec import IDX, ImageFolder, RunSettings

    source = IDX(data.train_images, data.train_labels) if png_root is None else ImageFolder(str(png_root))
    stamp = time.perf_counter_ns()
    metrics = folder / f"metrics-{model}-{stamp}.jsonl"
    run = RunSettings(
        epochs=epochs, checkpoint_dir=str(folder / f"checkpoints-{model}-{stamp}"), metrics_file=str(metrics)
    )
    spec = job_spec(model, sizes, source, seed, run, placement)
    start = time.perf_counter()
    result = flow.run(spec, backend=backend)
    wall = time.perf_counter() - start
    labels = np.asarray(read_idx(data.test_labels)).astype(np.int64)
    start = time.perf_counter()
    probabilities = flow.predict(result.checkpoint, IDX(data.test_images, data.test_labels), backend=backend)
    eval_s = time.perf_counter() - start
    accuracy = float(np.mean(np.argmax(probabilities, axis=1) == labels))
    epochs_s = epochs_from_metrics(metrics)
    return Outcome(wall, epochs_s, accuracy, float(result.loss), eval_s, setup=result.setup)


def vk_raw_once(backend, model: str, sizes: Sizes, data: DataSet, epochs: int, seed: int) -> Outcome:
    """vkflow's own raw loop on the job ``vk_once`` runs: the plan flow.run makes (the data kept
    on the device, batches as indices), driven by a plain loop with no actors: each epoch a fresh
    permutation, in_flight steps in flight, each step's loss read when its slot comes round. The
    figure flow.run's steady epochs are held against (the issue's "0.9x vkflow's raw loop")."""
    from flow.data_plan import header_of
    from flow.runtime import plan_on, start_engine
    from flow.spec import IDX, RunSettings
    from loaders import open_source

    spec = job_spec(model, sizes, IDX(data.train_images, data.train_labels), seed, RunSettings(epochs=epochs))
    start = time.perf_counter()
    source = open_source(spec.data.source)
    maps = callable(getattr(backend, "write_into", None))
    run_plan = plan_on(spec, backend.facts, header=header_of(source), maps_inputs=maps)
    if run_plan.devices[0].resident is None:
        raise RuntimeError("the plan keeps no dataset on the device: no raw loop by indices to time")
    engine, _ = start_engine(run_plan, backend)
    stored = source.stored()
    engine.upload_dataset(stored.x, stored.labels)
    slots, rng, step, loss = spec.run.in_flight, np.random.default_rng(seed), 0, math.nan
    pending: deque[tuple[int, int, int, int]] = deque()

    def finish() -> float:
        ticket, slot, at, rows = pending.popleft()
        backend.wait(ticket)
        return engine.result(slot, at, rows).loss

    seconds = []
    for _ in range(epochs):
        began = time.perf_counter()
        order = rng.permutation(len(stored.labels)).astype(np.int32)
        for first in range(0, len(order), BATCH):
            if len(pending) == slots:
                loss = finish()
            indices = order[first : first + BATCH]
            slot = step % slots
            pending.append((engine.submit_indices("train", slot, indices, step), slot, step, len(indices)))
            step += 1
        while pending:
            loss = finish()
        seconds.append(time.perf_counter() - began)
    return Outcome(time.perf_counter() - start, tuple(seconds), math.nan, float(loss), 0.0)


def decode_folder(png_root: Path) -> float:
    """Seconds to open ``png_root`` as a run does with no cache of it: every image decoded and the
    cache written (the cache is removed first)."""
    from flow.spec import ImageFolder
    from loaders import open_source

    with open_source(ImageFolder(str(png_root))) as source:
        made = source.cache_file
    if made is not None:
        made.unlink()
        made.with_suffix(".json").unlink()
    start = time.perf_counter()
    with open_source(ImageFolder(str(png_root))) as source:
        seconds = time.perf_counter() - start
        if source.cache_reused or source.cache_file is None:
            raise RuntimeError(f"{png_root}: the image cache was not made again")
    return seconds


def vk_folder_once(backend, sizes: Sizes, data: DataSet, epochs: int, seed: int, folder: Path,
                   placement: str, png_root: Path) -> Outcome:  # fmt: skip
    """The MLP job on the PNG folder: the cache made again (timed), then the run (see the docstring)."""
    decode_s = decode_folder(png_root)
    outcome = vk_once(backend, "mlp", sizes, data, epochs, seed, folder, placement, png_root)
    return replace(outcome, decode_s=decode_s)


def torch_impl(torch, variant: str) -> str:
    base = "torch" if torch.cuda.is_available() else "torch_cpu"
    return f"{base}_{variant}"


def torch_once(
    torch,
    variant: str,
    model: str,
    sizes: Sizes,
    data: DataSet,
    epochs: int,
    seed: int,
    png_root: Path | None = None,
) -> Outcome:
    """One run of ``variant`` ("eager_loader", "eager_resident", "graph_resident" or, on
    ``png_root``, "eager_folder"); see the module docstring."""
    functional = torch.nn.functional
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    sync()
    start = time.perf_counter()
    torch.manual_seed(seed)
    net = torch_net(torch, model, sizes).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    last_loss = [None]

    def step(x, y) -> None:
        opt.zero_grad(set_to_none=True)
        loss = functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        last_loss[0] = loss

    if variant in ("eager_loader", "eager_folder"):
        if variant == "eager_loader":
            loader = idx_loader(torch, data, cuda)
        else:
            loader = folder_loader(torch, png_root, cuda)

        def epoch() -> None:
            for x, y in loader:
                step(x.to(device, non_blocking=True), y.to(device, non_blocking=True))

    else:
        images = np.array(read_idx(data.train_images))  # a writable copy, as torch wants
        labels = np.array(read_idx(data.train_labels)).astype(np.int64)
        x_all = torch.from_numpy(images).to(device).unsqueeze(1).float().div_(255.0)
        y_all = torch.from_numpy(labels).to(device)
        if variant == "eager_resident":
            epoch = resident_epoch(torch, step, x_all, y_all)
        else:
            epoch = graph_epoch(torch, net, opt, x_all, y_all, last_loss)
    times = timed_epochs(epoch, epochs, sync)
    wall = time.perf_counter() - start
    loss = float(last_loss[0].detach().cpu()) if last_loss[0] is not None else math.nan

    begun = time.perf_counter()
    net.eval()
    test_x = (
        torch.from_numpy(np.array(read_idx(data.test_images))).to(device).unsqueeze(1).float().div_(255.0)
    )
    test_y = np.array(read_idx(data.test_labels)).astype(np.int64)
    with torch.no_grad():
        predicted = torch.cat([net(chunk).argmax(dim=1) for chunk in test_x.split(2000)]).cpu().numpy()
    eval_s = time.perf_counter() - begun
    return Outcome(wall, tuple(times), float(np.mean(predicted == test_y)), loss, eval_s)


def idx_loader(torch, data: DataSet, cuda: bool):
    """A DataLoader over a TensorDataset of the training images as floats (no worker processes)."""
    images = np.array(read_idx(data.train_images))  # a writable copy, as torch wants
    labels = np.array(read_idx(data.train_labels)).astype(np.int64)
    x_all = torch.from_numpy(images).unsqueeze(1).float().div_(255.0)
    dataset = torch.utils.data.TensorDataset(x_all, torch.from_numpy(labels))
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, pin_memory=cuda)


def grey_png(path: str):
    """A PNG as a Pillow image in mode L (module level, so DataLoader worker processes can take it)."""
    from PIL import Image

    with Image.open(path) as img:
        return img.convert("L")


def folder_loader(torch, root: Path, cuda: bool):
    """A DataLoader over the class folders under ``root``, decoding every PNG each epoch:
    torchvision's ImageFolder where torchvision is there, else a minimal Dataset of the same files."""
    try:
        from torchvision import datasets, transforms

        to_tensor = transforms.ToTensor()
        dataset = datasets.ImageFolder(str(root), transform=to_tensor, loader=grey_png)
    except ImportError:
        dataset = PngFolder(root)
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, pin_memory=cuda,
                                       num_workers=2, persistent_workers=True)  # fmt: skip


class PngFolder:
    """``root/<class>/*.png`` as (float tensor (1, H, W) in [0, 1], class id), classes sorted by
    name, like torchvision's ImageFolder with ToTensor."""

    def __init__(self, root: Path) -> None:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.items = [
            (str(path), label)
            for label, name in enumerate(classes)
            for path in sorted((root / name).glob("*.png"))
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        import torch

        path, label = self.items[index]
        pixels = np.array(grey_png(path), dtype=np.uint8)  # a writable copy, as torch wants
        return torch.from_numpy(pixels).unsqueeze(0).float().div_(255.0), label


def resident_epoch(torch, step: Callable, x_all, y_all) -> Callable[[], None]:
    """An epoch over data already on the GPU: a fresh permutation there, each batch gathered by
    indexing and handed to ``step(x, y)``."""
    n = x_all.shape[0]

    def epoch() -> None:
        order = torch.randperm(n, device=x_all.device)
        for first in range(0, n, BATCH):
            rows = order[first : first + BATCH]
            step(x_all[rows], y_all[rows])

    return epoch


def timed_epochs(epoch: Callable[[], None], epochs: int, sync: Callable[[], None]) -> list[float]:
    """Run ``epochs`` epochs, each timed on the host clock up to ``sync()`` (the GPU done)."""
    sync()
    times = []
    for _ in range(epochs):
        begun = time.perf_counter()
        epoch()
        sync()
        times.append(time.perf_counter() - begun)
    return times


def graph_epoch(torch, net, opt, x_all, y_all, last_loss: list) -> Callable[[], None]:
    """Capture one training step in a CUDA graph and return a function that trains one epoch by
    replaying it (see the module docstring for the partial batch and the warm-up)."""
    functional = torch.nn.functional
    n = int(y_all.shape[0])
    device = x_all.device
    index = torch.zeros(BATCH, dtype=torch.long, device=device)
    weight = torch.zeros(BATCH, dtype=torch.float32, device=device)  # 0 while warming up: no change

    def loss_of():
        x = x_all.index_select(0, index)
        y = y_all.index_select(0, index)
        return (functional.cross_entropy(net(x), y, reduction="none") * weight).sum()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss_of().backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = loss_of()
        loss.backward()
        opt.step()
    last_loss[0] = loss
    weight.fill_(1.0 / BATCH)

    def epoch() -> None:
        order = torch.randperm(n, device=device)
        for first in range(0, n, BATCH):
            rows = min(BATCH, n - first)
            if rows == BATCH:
                index.copy_(order[first : first + BATCH])
                graph.replay()
                continue
            index.zero_()
            index[:rows].copy_(order[first:])
            weight.zero_()
            weight[:rows].fill_(1.0 / rows)
            graph.replay()
            weight.fill_(1.0 / BATCH)

    return epoch


# -- reporting -------------------------------------------------------------------------------------


class RealWorldReporter(Reporter):
    """common.Reporter with the data set (kind and sizes) on every line and a table of its own."""

    def __init__(self, out: str | None, data: DataSet) -> None:
        super().__init__(out)
        self.data = {"data": data.kind, "train": data.train, "test": data.test}

    def emit(self, record: dict) -> dict:
        return super().emit({**record, **self.data})

    def table(self) -> str:
        figures: dict[tuple[str, str], dict[str, dict]] = {}
        notes: list[tuple[str, ...]] = []
        for row in self.rows:
            key = (row.get("model", "-"), row.get("impl", row.get("ratio", "-")))
            if "ratio" in row:
                notes.append((row["model"], row["ratio"], row["metric"], f"{row['value']:.3f}"))
            elif "status" in row:
                status = f"{row['metric']}: {row['status']}" if "metric" in row else row["status"]
                notes.append((row.get("model", "-"), row["impl"], status, row.get("reason", "")[:70]))
            else:
                figures.setdefault(key, {})[row["metric"]] = row
        header = ("model", "impl", *(f"{m} median [min, max]" for m in METRICS))
        lines = [header]
        for (model, impl), by_metric in figures.items():
            cells = []
            for metric in METRICS:
                row = by_metric.get(metric)
                cells.append(spread_cell(row))
            lines.append((model, impl, *cells))
        text = aligned(lines)
        if notes:
            text += "\n\n" + aligned([("model", "ratio / impl", "metric / status", "value / reason"), *notes])
        return text


def fmt(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def spread_cell(row: dict | None) -> str:
    """A figure's table cell: "median [min, max]", or "-" where there is none."""
    return "-" if row is None else f"{fmt(row['median'])} [{fmt(row['min'])}, {fmt(row['max'])}]"


def aligned(lines: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(lines[0]))]
    out = []
    for index, line in enumerate(lines):
        out.append("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def spread(values: list[float]) -> dict:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "values": values}
    rounded = [float(f"{v:.6g}") for v in values]
    return {"median": common.median(finite), "min": min(finite), "max": max(finite), "values": rounded}


def report(
    rep: Reporter,
    model: str,
    shape: str,
    impl: str,
    device: str,
    runs: list[Outcome],
    cold: list[Outcome],
    samples: int,
    epochs: int,
) -> dict[str, float]:
    """Emit the four figures of one implementation; returns their medians."""
    steady = [run.steady() for run in runs]
    rates = [samples / s if s > 0 else math.nan for s in steady]
    labels = {"model": model, "shape": shape, "batch": BATCH, "epochs": epochs, "reps": len(runs)}
    medians = {}
    for metric, values, extra in (
        (
            "wall_s",
            [run.wall_s for run in runs],
            {
                "cold_s": [round(run.wall_s, 4) for run in cold],
                "first_epoch_s": common.median([run.epoch_s[0] for run in runs]),
                "outside_epochs_s": common.median([run.wall_s - sum(run.epoch_s) for run in runs]),
                **decode_figure(runs),
            },
        ),
        ("epoch_s", steady, {"epochs_timed": max(epochs - 1, 0)}),
        ("samples_per_s", rates, {}),
        (
            "accuracy",
            [run.accuracy for run in runs],
            {
                "loss": common.median([run.loss for run in runs]),
                "eval_s": common.median([run.eval_s for run in runs]),
            },
        ),
    ):
        if metric in ("epoch_s", "samples_per_s") and epochs < 2:
            rep.missing(
                BENCH,
                impl,
                "not available",
                "a steady epoch needs --epochs 2 or more",
                model=model,
                shape=shape,
                metric=metric,
            )
            medians[metric] = math.nan
            continue
        figure = spread(values)
        rep.figure(BENCH, impl, device, **labels, metric=metric, **figure, **extra)
        medians[metric] = figure["median"]
    return medians


def decode_figure(runs: list[Outcome]) -> dict:
    """``decode_s`` (median and each run's) where the runs decoded an image folder first."""
    values = [run.decode_s for run in runs]
    if all(math.isnan(v) for v in values):
        return {}
    return {"decode_s": common.median(values), "decode_values": [round(v, 4) for v in values]}


def warm_then_timed(
    once: Callable[[int], Any], warmup: int, reps: int, name: str, describe: Callable[[Any], str]
) -> tuple[list, list]:
    """``warmup`` untimed runs of ``once(index)``, then ``reps`` timed ones, each logged as
    "<name> warm-up 1/2: <describe(outcome)> (<seconds> s)".

    Returns:
        (the warm-up outcomes, the timed ones).
    """
    cold, timed = [], []
    for index in range(warmup + reps):
        warm = index < warmup
        began = time.perf_counter()
        outcome = once(index)
        kind, number, count = ("warm-up", index + 1, warmup) if warm else ("rep", index - warmup + 1, reps)
        log(f"{name} {kind} {number}/{count}: {describe(outcome)} ({time.perf_counter() - began:.1f} s)")
        (cold if warm else timed).append(outcome)
    return cold, timed


def measure(
    rep: Reporter,
    args,
    model: str,
    impl: str,
    device: str,
    once: Callable[[int], Outcome],
    samples: int,
    epochs: int,
    shape: str,
) -> dict[str, float] | None:
    """``args.warmup`` untimed runs and ``args.reps`` timed ones of ``once(seed)``, then the figures."""

    def describe(outcome: Outcome) -> str:
        parts = " ".join(f"{k} {v:.3f}" for k, v in (outcome.setup or {}).items())
        setup = f", setup {parts}" if parts else ""
        return (
            f"wall {outcome.wall_s:.3f} s, steady epoch {outcome.steady():.4f} s, "
            f"accuracy {outcome.accuracy:.4f}, loss {outcome.loss:.4f}{setup}"
        )

    def runs() -> dict[str, float]:
        cold, timed = warm_then_timed(once, args.warmup, args.reps, f"[{model}] {impl}", describe)
        return report(rep, model, shape, impl, device, timed, cold, samples, epochs)

    return rep.guarded(BENCH, impl, runs, model=model, shape=shape)


def bench_model(
    args,
    rep: Reporter,
    model: str,
    sizes: Sizes,
    data: DataSet,
    backend,
    vk_device: str,
    torch,
    torch_device: str,
    folder: Path,
) -> None:
    epochs = args.epochs or sizes.epochs[model]
    shape = shape_of(model, sizes)
    section(
        f"{model} {shape} on {data.kind} ({data.train} train, {data.test} test), batch {BATCH}, "
        f"SGD lr {LR} momentum {MOMENTUM}, {epochs} epochs, {args.reps} reps"
    )
    # vkflow: the data kept on the device (the plan's choice for IDX files that fit), and the
    # same run streamed from the host (Data.placement "host": every batch read, cast and uploaded).
    vk: dict[str, dict] = {}
    for impl, placement in (("vkflow", "auto"), ("vkflow_streamed", "host")):
        if backend is None:
            rep.missing(BENCH, impl, "not available", vk_device, model=model, shape=shape)
            continue
        found = measure(
            rep,
            args,
            model,
            impl,
            vk_device,
            lambda seed, placement=placement: vk_once(
                backend, model, sizes, data, epochs, seed, folder, placement
            ),
            data.train,
            epochs,
            shape,
        )
        if found is not None:
            vk[impl] = found
    if backend is not None:
        raw = measure(
            rep,
            args,
            model,
            "vkflow_raw",
            vk_device,
            lambda seed: vk_raw_once(backend, model, sizes, data, epochs, seed),
            data.train,
            epochs,
            shape,
        )
        if raw is not None and "vkflow" in vk:
            rep.ratio(
                BENCH,
                "vkflow/vkflow_raw",
                vk["vkflow"]["samples_per_s"],  # speed: the "0.9x vkflow's raw loop"
                raw["samples_per_s"],
                model=model,
                metric="samples_per_s",
            )
    if torch is None:
        for variant in ("eager_loader", "eager_resident", "graph_resident"):
            rep.missing(
                BENCH, f"torch_{variant}", "not available", "torch is not installed", model=model, shape=shape
            )
        return
    for variant in ("eager_loader", "eager_resident", "graph_resident"):
        impl = torch_impl(torch, variant)
        if variant.startswith("graph") and not torch.cuda.is_available():
            rep.missing(
                BENCH, impl, "not available", "no CUDA: CUDA graphs need a GPU", model=model, shape=shape
            )
            continue
        found = measure(
            rep,
            args,
            model,
            impl,
            torch_device,
            lambda seed, variant=variant: torch_once(torch, variant, model, sizes, data, epochs, seed),
            data.train,
            epochs,
            shape,
        )
        if found is None:
            continue
        for name, figures in vk.items():
            for metric in ("epoch_s", "wall_s"):
                rep.ratio(BENCH, f"{name}/{impl}", figures[metric], found[metric], model=model, metric=metric)


def bench_folder(
    args,
    rep: Reporter,
    sizes: Sizes,
    data: DataSet,
    backend,
    vk_device: str,
    torch,
    torch_device: str,
    folder: Path,
) -> None:
    """The MLP job on the training images as PNG files (see the module docstring)."""
    epochs = args.epochs or sizes.epochs["mlp"]
    shape = shape_of("mlp", sizes)
    began = time.perf_counter()
    png_root = write_png_folder(data, folder / "png")
    section(
        f"mlp {shape} on {data.kind} as {data.train} PNG files ({png_root}, written in "
        f"{time.perf_counter() - began:.1f} s), batch {BATCH}, {epochs} epochs, {args.reps} reps"
    )
    vk: dict[str, dict] = {}
    for impl, placement in (("vkflow_folder", "auto"), ("vkflow_folder_streamed", "host")):
        if backend is None:
            rep.missing(BENCH, impl, "not available", vk_device, model="mlp", shape=shape)
            continue

        def once(seed: int, placement: str = placement) -> Outcome:
            return vk_folder_once(backend, sizes, data, epochs, seed, folder, placement, png_root)

        found = measure(rep, args, "mlp", impl, vk_device, once, data.train, epochs, shape)
        if found is not None:
            vk[impl] = found
    impl = "torch_eager_folder" if torch is None else torch_impl(torch, "eager_folder")
    if torch is None:
        rep.missing(BENCH, impl, "not available", "torch is not installed", model="mlp", shape=shape)
        return
    found = measure(
        rep,
        args,
        "mlp",
        impl,
        torch_device,
        lambda seed: torch_once(torch, "eager_folder", "mlp", sizes, data, epochs, seed, png_root),
        data.train,
        epochs,
        shape,
    )
    if found is None:
        return
    for name, figures in vk.items():
        for metric in ("epoch_s", "wall_s"):
            rep.ratio(BENCH, f"{name}/{impl}", figures[metric], found[metric], model="mlp", metric=metric)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny generated data and models, 1 rep (smoke run)"
    )
    parser.add_argument("--reps", type=int, default=None, help="timed runs per implementation (default 5)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 1; quick 0)")
    parser.add_argument(
        "--epochs", type=int, default=None, help="epochs for every model (default mlp 10, cnn 2)"
    )
    parser.add_argument(
        "--only", default=",".join(MODELS), help="jobs to run: mlp,cnn,folder (default all three)"
    )
    parser.add_argument(
        "--data", default="auto", help="auto (default), generated, or a folder of the four files"
    )
    parser.add_argument("--out", default=None, help="also append every JSON line to this file")
    parser.add_argument("--device", default="auto", help="Vulkan device: index, name substring or auto")
    args = parser.parse_args()
    args.models = [m.strip().lower() for m in args.only.split(",") if m.strip()]
    unknown = set(args.models) - set(MODELS)
    if unknown or not args.models:
        parser.error(f"--only takes mlp, cnn and/or folder; got {args.only!r}")
    sizes = QUICK if args.quick else FULL
    args.reps = sizes.reps if args.reps is None else args.reps
    args.warmup = sizes.warmup if args.warmup is None else args.warmup
    if args.reps < 1 or args.warmup < 0 or (args.epochs is not None and args.epochs < 1):
        parser.error("--reps and --epochs must be >= 1, --warmup >= 0")
    return args


def open_both(device: str) -> tuple[object, str, object, str]:
    """torch (with its CUDA context made, once, before any timing) and the Vulkan backend, each
    with what the figures' lines call its device; a missing side is None, with the reason.

    Returns:
        (torch, torch's device, the backend, vkflow's device or why there is none).
    """
    torch, torch_device = common.open_torch()
    if torch is not None and torch.cuda.is_available():
        torch.zeros(1, device="cuda").sum().item()
    backend, why = open_vulkan(device)
    if backend is None:
        vk_device = f"no Vulkan: {why}"
        print(f"vkflow: {vk_device}")
    else:
        vk_device = backend.facts.name
        print(f"vkflow on {vk_device} ({backend.facts.driver_version}, Vulkan {backend.facts.api_version})")
    return torch, torch_device, backend, vk_device


def main() -> None:
    args = parse_args()
    sizes = QUICK if args.quick else FULL
    started = time.perf_counter()
    torch, torch_device, backend, vk_device = open_both(args.device)
    with tempfile.TemporaryDirectory(prefix="bench-realworld-") as tmp:
        folder = Path(tmp)
        began = time.perf_counter()
        data = open_data(args.data, sizes, args.quick, folder)
        print(
            f"data: {data.kind}, {data.train} train and {data.test} test images "
            f"({Path(data.train_images).parent}; ready in {time.perf_counter() - began:.1f} s)"
        )
        rep = RealWorldReporter(args.out, data)
        try:
            for model in args.models:
                job = bench_folder if model == "folder" else partial(bench_model, model=model)
                job(args, rep, sizes=sizes, data=data, backend=backend, vk_device=vk_device, torch=torch,
                    torch_device=torch_device, folder=folder)  # fmt: skip
        finally:
            common.finish(rep, backend, started)


if __name__ == "__main__":
    main()

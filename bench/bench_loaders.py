"""Benchmark: vkflow's image-folder source against torch's DataLoader on the same decode.

For each image size (default 64 and 256 pixels square) it writes a few thousand RGB images (half
JPEG, half PNG, in 10 class folders) to a temporary folder, then reads whole shuffled epochs in
batches of 64 through

- vkflow: ``Sampler`` + ``ImageFolderSource.read`` (decode threads), and
- torch: ``torch.utils.data.DataLoader`` over a ``Dataset`` whose ``__getitem__`` calls
  ``loaders.decode.decode_image`` on the file's bytes (``loaders.decode.read_file``): the same
  Pillow decode and colour conversion, giving a float32 CHW sample in [0, 1] per item (what
  torchvision's ``ToTensor`` gives, up to rounding), collated by torch. Same number of workers:
  worker processes there, threads here; 0 means decoding in the calling thread on both sides.

Both sides return bit-identical batches (vkflow converts each worker's run of 8-bit pixels to
float32 in one pass; torch converts each sample; the arithmetic is the same). Any speed-up of the
shared decode (``loaders.decode``) speeds up both sides alike. Epochs of the two
alternate, so that a machine shared with other work slows both alike. The first epoch of each
warms the page cache and starts the workers; the figures are the best and the median of the
epochs after it, and the ratio uses the best. Prints the machine (CPUs usable, CPU model), a
table, and one JSON line per figure, e.g. ``{"bench": "loader", "impl": "vkflow", "size": 64,
"workers": 2, "images_per_s": ..., "median_images_per_s": ..., "cpus": 2, "cpu": "..."}``.

torch is not a vkflow dependency. To compare, install it into the bench environment:
``pip install torch==2.13.0``. Without it, only vkflow's figures are printed.

A last figure needs no torch: one epoch over a memory-mapped IDX file of ``--idx-mib`` MiB (28x28
uint8 samples) in batches of 64, read with the full shuffle (``IDXSource.read``: random reads all
over the file) against the block order (``Data(shuffle="blocks")``: ``loaders.blocks.BlockSource``
reading 32 MiB blocks a window ahead), each from a cold page cache where the OS lets a process drop
a file's pages (``posix_fadvise``; else both read from the cache and the figure is the gather's).

Run: ``python bench/bench_loaders.py [--sizes 64,256] [--images 3000] [--workers N] [--epochs 5]
[--idx-mib 512]`` (``--sizes ''`` and ``--idx-mib 0`` skip a part).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.loader import Read, jobs  # noqa: E402
from actors.messages import Cursor  # noqa: E402
from flow.data_plan import StepSchedule  # noqa: E402
from loaders import IDXSource, ImageFolderSource, Sampler, SamplerState, write_idx  # noqa: E402
from loaders.blocks import BlockSource  # noqa: E402
from loaders.decode import DecodeSpec, decode_image, read_file  # noqa: E402

BATCH = 64
TORCH_HINT = "torch is not installed; to compare with torch run: pip install torch==2.13.0"


def make_images(root: Path, count: int, size: int, seed: int = 0) -> None:
    """Write ``count`` RGB images in 10 class folders, alternating JPEG and PNG.

    Args:
        root: the folder to fill.
        count: number of images.
        size: width and height.
        seed: content seed.
    """
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    for i in range(count):
        cls = root / f"class{i % 10}"
        cls.mkdir(parents=True, exist_ok=True)
        # Smooth colour gradients plus noise: compresses like a photo, not like random bytes.
        a, b, c = rng.random(3) * 255
        base = np.stack([a * xx, b * yy, c * (1 - xx * yy)], axis=-1)
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        img = Image.fromarray(pixels)
        if i % 2:
            img.save(cls / f"{i:05d}.png")
        else:
            img.save(cls / f"{i:05d}.jpg", quality=90)


def vkflow_epochs(root: Path, workers: int) -> Iterator[Callable[[], int]]:
    """Epoch runners for vkflow: each call reads one shuffled epoch through Sampler + read.

    Args:
        root: the image folder.
        workers: decode threads.

    Yields:
        A function that runs the next epoch and returns the number of images read.
    """
    src = ImageFolderSource(root, mode="RGB", layout="CHW", workers=workers)
    sampler = Sampler(np.arange(len(src)), BATCH, shuffle=True, seed=0, drop_last=False)
    epoch = 0
    try:
        while True:

            def run(epoch: int = epoch) -> int:
                seen = 0
                for _, batch in sampler.batches(SamplerState(epoch, 0)):
                    x, _, _ = src.read(batch)
                    seen += len(x)
                return seen

            yield run
            epoch += 1
    finally:
        src.close()


def torch_epochs(root: Path, workers: int) -> Iterator[Callable[[], int]]:
    """Epoch runners for a torch DataLoader doing the same decode.

    Args:
        root: the image folder.
        workers: DataLoader worker processes (0 = in the main process).

    Yields:
        A function that runs the next epoch and returns the number of images read.
    """
    import torch
    from torch.utils.data import DataLoader, Dataset

    src = ImageFolderSource(root, mode="RGB", layout="CHW", workers=0)
    files = [str(src.root / f) for f in src.files]
    labels = src.labels.astype(np.int64)
    spec = DecodeSpec("RGB", None, "CHW")

    class Folder(Dataset):
        def __len__(self) -> int:
            return len(files)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return torch.from_numpy(decode_image(read_file(files[i]), spec, files[i])), int(labels[i])

    loader = DataLoader(
        Folder(),
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(0),
    )

    def run() -> int:
        seen = 0
        for x, _ in loader:
            seen += len(x)
        return seen

    while True:
        yield run


def rates(runners: dict[str, Iterator[Callable[[], int]]], epochs: int) -> dict[str, list[float]]:
    """Images/s of each epoch after the first, running the epochs of all runners in turn.

    Args:
        runners: name -> epoch runners.
        epochs: epochs of each (the first is warm-up and not counted, unless it is the only one).

    Returns:
        name -> images/s per counted epoch.
    """
    out: dict[str, list[float]] = {name: [] for name in runners}
    for epoch in range(epochs):
        # Alternate who goes first, so that neither always follows the other's warm caches.
        order = list(runners) if epoch % 2 == 0 else list(reversed(runners))
        for name in order:
            run = next(runners[name])
            t0 = time.perf_counter()
            seen = run()
            rate = seen / (time.perf_counter() - t0)
            if epoch > 0 or epochs == 1:
                out[name].append(rate)
    return out


def idx_orders(mib: int) -> dict[str, float]:
    """Samples a second through one epoch of a memory-mapped IDX file, full shuffle vs block order.

    Args:
        mib: the file's size in MiB.

    Returns:
        Samples a second by order ("full", "blocks").
    """
    n = mib * 2**20 // 784
    got = {}
    with tempfile.TemporaryDirectory(prefix="vkflow-bench-") as tmp:
        images, labels = Path(tmp) / "images.idx", Path(tmp) / "labels.idx"
        rng = np.random.default_rng(0)
        for start in range(0, n, 65536):  # in pieces: the file may be larger than we want in RAM
            chunk = rng.integers(0, 256, (min(65536, n - start), 28, 28), dtype=np.uint8)
            with open(images, "ab" if start else "wb") as f:
                if not start:
                    f.write(bytes([0, 0, 8, 3]) + np.array([n, 28, 28], ">u4").tobytes())
                f.write(chunk.tobytes())
        write_idx(labels, rng.integers(0, 10, n, dtype=np.uint8))
        for order in ("full", "blocks"):
            with open(images, "rb") as f:  # drop the file's pages, so the epoch reads the disk
                os.fsync(f.fileno())
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            block = (32 << 20) // 784 if order == "blocks" else None
            sampler = Sampler(np.arange(n), BATCH, True, 0, False, block=block)
            source = IDXSource(images, labels)
            reader = BlockSource(source, sampler) if block else source
            per_epoch = sampler.batches_per_epoch()
            stream = jobs(Cursor(), StepSchedule(per_epoch, per_epoch), sampler, None)
            reads = [job for job in stream if isinstance(job, Read)]
            t0 = time.perf_counter()
            for job in reader.follow(iter(reads)) if block else reads:
                reader.read(job.indices)
            got[order] = n / (time.perf_counter() - t0)
            reader.close()
    return got


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or platform's guess).

    Returns:
        The name.
    """
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity), else the machine's count.

    Returns:
        The count.
    """
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def main() -> int:
    """Run the benchmark.

    Returns:
        The exit code.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,256", help="comma-separated image sizes (pixels square)")
    parser.add_argument("--size", type=int, default=None, help="one image size (overrides --sizes)")
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=usable_cpus())
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--idx-mib", type=int, default=512, help="memory-mapped IDX file size; 0 skips")
    args = parser.parse_args()
    sizes = [args.size] if args.size else [int(s) for s in args.sizes.split(",") if s.strip()]
    try:
        import torch
    except ImportError:
        torch = None
        print(TORCH_HINT)
    machine = {"cpus": usable_cpus(), "cpu": cpu_model()}
    print(
        f"{machine['cpus']} CPUs ({machine['cpu']}); python {platform.python_version()}"
        + (f"; torch {torch.__version__}" if torch is not None else "")
        + f"; batch {BATCH}; best and median of epochs 2..{args.epochs}, vkflow and torch alternating"
    )
    rows = []
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="vkflow-bench-") as tmp:
            # Keep the manifest of this throwaway folder out of the user's real cache.
            os.environ["VKFLOW_CACHE"] = str(Path(tmp) / "cache")
            root = Path(tmp) / "images"
            t0 = time.perf_counter()
            make_images(root, args.images, size)
            print(
                f"{args.images} images {size}x{size} RGB (half JPEG, half PNG) written in "
                f"{time.perf_counter() - t0:.1f} s"
            )
            for workers in sorted({0, args.workers}):
                runners = {"vkflow": vkflow_epochs(root, workers)}
                if torch is not None:
                    runners["torch"] = torch_epochs(root, workers)
                got = rates(runners, args.epochs)
                for gen in runners.values():
                    gen.close()
                rows.append((size, workers, got["vkflow"], got.get("torch")))
    print(
        f"\n{'size':>4} | {'workers':>7} | {'vkflow img/s':>12} | {'torch img/s':>11} | "
        f"{'vkflow/torch':>12} | median vkflow, torch"
    )
    print("-" * 84)
    for size, workers, vk, th in rows:
        ratio = f"{max(vk) / max(th):12.2f}" if th else f"{'-':>12}"
        th_best = f"{max(th):11.0f}" if th else f"{'-':>11}"
        medians = f"{statistics.median(vk):.0f}, " + (f"{statistics.median(th):.0f}" if th else "-")
        print(f"{size:>4} | {workers:>7} | {max(vk):12.0f} | {th_best} | {ratio} | {medians}")
    print()
    for size, workers, vk, th in rows:
        for impl, got in (("vkflow", vk), ("torch", th)):
            if got:
                line = {
                    "bench": "loader",
                    "impl": impl,
                    "size": size,
                    "workers": workers,
                    "images_per_s": round(max(got), 1),
                    "median_images_per_s": round(statistics.median(got), 1),
                    **machine,
                }
                print(json.dumps(line))
        if th:
            ratio = {"bench": "loader", "impl": "ratio", "size": size, "workers": workers}
            ratio["vkflow_over_torch"] = round(max(vk) / max(th), 3)
            print(json.dumps({**ratio, **machine}))
    if args.idx_mib > 0:
        got = idx_orders(args.idx_mib)
        print(
            f"\nmemory-mapped IDX, {args.idx_mib} MiB, batch {BATCH}, one cold epoch: full shuffle "
            f"{got['full']:.0f} samples/s, block order {got['blocks']:.0f} samples/s "
            f"({got['blocks'] / got['full']:.2f}x)"
        )
        for order, rate in got.items():
            line = {"bench": "loader_idx", "order": order, "mib": args.idx_mib}
            print(json.dumps({**line, "samples_per_s": round(rate, 1), **machine}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

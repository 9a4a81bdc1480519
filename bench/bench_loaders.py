"""Benchmark: vkflow's image-folder source against torch's DataLoader on the same decode.

Writes a few thousand 64x64 RGB images (half JPEG, half PNG) to a temporary folder, then reads
whole shuffled epochs in batches of 64 through

- vkflow: ``Sampler`` + ``ImageFolderSource.read`` (decode threads), and
- torch: ``torch.utils.data.DataLoader`` over a ``Dataset`` whose ``__getitem__`` calls the very
  same decode function (``loaders.decode.decode_image``), with the same number of workers
  (worker processes there, threads here).

The first epoch of each warms the page cache and starts the workers; the figure is the best of the
epochs after it. Prints a table and one JSON line per figure, e.g.
``{"bench": "loader", "impl": "vkflow", "workers": 2, "images_per_s": ...}``.

torch is not a vkflow dependency. To compare, install it into the bench environment:
``pip install torch==2.13.0``. Without it, only vkflow's figures are printed.

Run: ``python bench/bench_loaders.py [--images 3000] [--size 64] [--workers N] [--epochs 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loaders import ImageFolderSource, Sampler, SamplerState  # noqa: E402
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


def time_vkflow(root: Path, workers: int, epochs: int) -> tuple[float, int]:
    """Best images/s over the epochs after the first, reading through Sampler + read.

    Args:
        root: the image folder.
        workers: decode threads.
        epochs: epochs to run (the first is warm-up).

    Returns:
        (images per second, images per epoch).
    """
    src = ImageFolderSource(root, mode="RGB", layout="CHW", workers=workers)
    sampler = Sampler(np.arange(len(src)), BATCH, shuffle=True, seed=0, drop_last=False)
    best = 0.0
    for epoch in range(epochs):
        t0 = time.perf_counter()
        seen = 0
        for _, batch in sampler.batches(SamplerState(epoch, 0)):
            x, y, _ = src.read(batch)
            seen += len(x)
        rate = seen / (time.perf_counter() - t0)
        if epoch > 0 or epochs == 1:
            best = max(best, rate)
    src.close()
    return best, len(src)


def time_torch(root: Path, workers: int, epochs: int) -> float:
    """Best images/s of a torch DataLoader doing the same decode.

    Args:
        root: the image folder.
        workers: DataLoader worker processes (0 = in the main process).
        epochs: epochs to run (the first is warm-up).

    Returns:
        Images per second.
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
    best = 0.0
    for epoch in range(epochs):
        t0 = time.perf_counter()
        seen = 0
        for x, _ in loader:
            seen += len(x)
        rate = seen / (time.perf_counter() - t0)
        if epoch > 0 or epochs == 1:
            best = max(best, rate)
    return best


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


def main() -> int:
    """Run the benchmark.

    Returns:
        The exit code.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        torch = None
        print(TORCH_HINT)
    with tempfile.TemporaryDirectory(prefix="vkflow-bench-") as tmp:
        # Keep the manifest of this throwaway folder out of the user's real cache.
        os.environ["XDG_CACHE_HOME"] = str(Path(tmp) / "cache")
        root = Path(tmp) / "images"
        t0 = time.perf_counter()
        make_images(root, args.images, args.size)
        print(
            f"{args.images} images {args.size}x{args.size} RGB (half JPEG, half PNG) written in "
            f"{time.perf_counter() - t0:.1f} s; batch {BATCH}; best of epochs 2..{args.epochs}; "
            f"{os.cpu_count()} CPUs ({cpu_model()})"
            + (f"; torch {torch.__version__}" if torch is not None else "")
        )
        rows = []
        for workers in sorted({0, args.workers}):
            vk, _ = time_vkflow(root, workers, args.epochs)
            th = time_torch(root, workers, args.epochs) if torch is not None else None
            rows.append((workers, vk, th))
    print(f"\n{'workers':>7} | {'vkflow img/s':>12} | {'torch img/s':>11} | {'vkflow/torch':>12}")
    print("-" * 53)
    for workers, vk, th in rows:
        ratio = f"{vk / th:12.2f}" if th else f"{'-':>12}"
        print(f"{workers:>7} | {vk:12.0f} | {(f'{th:11.0f}' if th else '-'):>11} | {ratio}")
    print()
    for workers, vk, th in rows:
        print(
            json.dumps(
                {"bench": "loader", "impl": "vkflow", "workers": workers, "images_per_s": round(vk, 1)}
            )
        )
        if th:
            print(
                json.dumps(
                    {"bench": "loader", "impl": "torch", "workers": workers, "images_per_s": round(th, 1)}
                )
            )
            print(
                json.dumps(
                    {
                        "bench": "loader",
                        "impl": "ratio",
                        "workers": workers,
                        "vkflow_over_torch": round(vk / th, 3),
                    }
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

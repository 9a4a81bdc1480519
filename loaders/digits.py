"""The bundled 8x8 handwritten digits (UCI / scikit-learn, 1797 images) as a real image folder.

The data ships as ``loaders/data/digits.npz`` (uint8 pixels 0..16 and labels; see
``loaders/data/README.md`` for source and licence). :func:`write_image_folder` writes it once as
greyscale PNGs, ``<dest>/<label>/<index>.png``, so that the demo exercises the same image-folder
loader as real data does; :func:`open_digits` does that in the user cache dir and opens it.
"""

from __future__ import annotations

import io
import os
from importlib import resources
from pathlib import Path

import numpy as np
from PIL import Image

from loaders.image_folder import ImageFolderSource
from shaders.user_cache import cache_dir

DIGITS_COUNT = 1797
_MARKER = ".complete"
_MARKER_TEXT = f"vkflow digits v1: {DIGITS_COUNT} png files\n"


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The bundled digits as arrays.

    Returns:
        (images uint8 [1797, 8, 8] with values 0..16, labels uint8 [1797] with values 0..9).
    """
    data = resources.files("loaders.data").joinpath("digits.npz").read_bytes()
    with np.load(io.BytesIO(data)) as z:
        return z["images"], z["labels"]


def _png_path(dest: Path, index: int, label: int) -> Path:
    return dest / str(label) / f"{index:04d}.png"


def write_image_folder(dest: str | os.PathLike) -> Path:
    """Write the digits as PNGs under ``dest`` (grey, 0..16 scaled to 0..255), once.

    Idempotent: a folder that is already complete is left alone; an interrupted one is finished.
    Each file is written under a hidden temporary name and renamed, so a reader never sees half a
    PNG, and the completion marker is written last.

    Args:
        dest: the folder to fill.

    Returns:
        ``dest`` as a Path.
    """
    dest = Path(dest)
    marker = dest / _MARKER
    images, labels = load_digits_arrays()
    paths = [_png_path(dest, i, int(label)) for i, label in enumerate(labels)]
    if marker.is_file() and marker.read_text() == _MARKER_TEXT and all(p.is_file() for p in paths):
        return dest
    # Why: 0..16 -> 0..255 keeps the full grey range in the PNG; the loader's /255 gives v/16 back
    # to within half a grey level.
    pixels = np.rint(images.astype(np.float32) * (255.0 / 16.0)).astype(np.uint8)
    for i, path in enumerate(paths):
        if path.is_file():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        Image.fromarray(pixels[i]).save(tmp, format="PNG")
        os.replace(tmp, path)
    marker.write_text(_MARKER_TEXT)
    return dest


def open_digits(
    workers: int = 2, on_error: str = "raise", dest: str | os.PathLike | None = None
) -> ImageFolderSource:
    """The digits as an image-folder source: mode L, CHW, samples of shape (1, 8, 8).

    Args:
        workers: decode threads.
        on_error: "raise" or "skip".
        dest: where to write the PNGs; default ``cache_dir("digits")`` in the user cache.

    Returns:
        The source (1797 samples, labels 0..9).
    """
    folder = write_image_folder(dest if dest is not None else cache_dir("digits"))
    return ImageFolderSource(folder, size=None, mode="L", layout="CHW", workers=workers, on_error=on_error)

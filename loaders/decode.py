"""Decode one image file into a float32 array of a fixed mode, size and layout.

Pillow does the work (it releases the GIL while decoding, so several threads decode at once). Every
mode Pillow can open is converted to the target mode, including the awkward ones: CMYK JPEGs,
16-bit greyscale PNGs (scaled from 0..65535, not clipped to 8 bits) and palette images with a
transparent colour. Anything that still fails becomes a :class:`LoaderError` naming the file.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from loaders.errors import LoaderError

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"})
MODES = ("L", "RGB", "RGBA")
LAYOUTS = ("CHW", "HWC")
CHANNELS = {"L": 1, "RGB": 3, "RGBA": 4}

# Modes holding more than 8 bits per sample, with the value that maps to 1.0. Going through 8-bit
# "L" would throw away the low byte, so these are scaled to float directly.
_HIGH_DEPTH = {"I;16": 65535.0, "I;16L": 65535.0, "I;16B": 65535.0, "I;16N": 65535.0, "I": 65535.0, "F": 1.0}
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


@dataclass(frozen=True)
class DecodeSpec:
    """How to decode: target mode, size (h, w) or None to keep the file's, and layout.

    Attributes:
        mode: "L", "RGB" or "RGBA".
        size: (height, width) to resize-and-centre-crop to, or None.
        layout: "CHW" or "HWC".
    """

    mode: str
    size: tuple[int, int] | None
    layout: str

    def shape(self, hw: tuple[int, int]) -> tuple[int, int, int]:
        """The sample shape for an image of ``hw`` = (height, width).

        Args:
            hw: image height and width.

        Returns:
            (C, H, W) or (H, W, C).
        """
        c = CHANNELS[self.mode]
        return (c, *hw) if self.layout == "CHW" else (*hw, c)


def _fit(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    """Scale to cover ``size`` keeping the aspect ratio, then centre-crop to it."""
    h, w = size
    if img.size == (w, h):
        return img
    return ImageOps.fit(img, (w, h), method=Image.Resampling.BILINEAR)


def _high_depth_array(img: Image.Image, spec: DecodeSpec) -> np.ndarray:
    """A >8-bit greyscale image as float32 (H, W, C) in [0, 1]."""
    full = _HIGH_DEPTH[img.mode]
    grey = np.asarray(img).astype(np.float32) / np.float32(full)
    np.clip(grey, 0.0, 1.0, out=grey)
    if spec.size is not None:
        grey = np.asarray(_fit(Image.fromarray(grey), spec.size), dtype=np.float32)
    chans = [grey] * (1 if spec.mode == "L" else 3)
    if spec.mode == "RGBA":
        chans.append(np.ones_like(grey))
    return np.stack(chans, axis=-1)


def _convert(img: Image.Image, mode: str) -> Image.Image:
    """Convert any 8-bit Pillow mode to ``mode``.

    Transparency is made explicit first (a palette or colour-key transparency becomes an alpha
    channel). When the target has no alpha, the image is composited over black: the colour stored
    under a fully transparent pixel is arbitrary, so premultiplying gives it a defined value (0).
    """
    if "transparency" in img.info and img.mode not in _ALPHA_MODES:
        img = img.convert("RGBA")
    elif img.mode in ("PA", "RGBa", "La"):
        img = img.convert("RGBA")
    if img.mode == mode:
        return img
    if img.mode in _ALPHA_MODES and mode != "RGBA":
        rgba = img.convert("RGBA")
        black = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
        return Image.alpha_composite(black, rgba).convert(mode)
    if img.mode not in ("L", "RGB", "RGBA", "1", "P"):
        # CMYK, YCbCr, LAB...: Pillow's colour conversions go through RGB.
        img = img.convert("RGB")
    return img.convert(mode)


def decode_image(
    data: bytes,
    spec: DecodeSpec,
    where: str,
    expect: tuple[int, ...] | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Decode image bytes into float32 in [0, 1], in ``spec``'s mode, size and layout.

    Args:
        data: the file's bytes.
        spec: target mode, size and layout.
        where: the file's name, for errors.
        expect: the sample shape the caller needs; another shape is a :class:`LoaderError`.
        out: a float32 array of that shape to write into (saves a copy per image).

    Returns:
        An array of ``spec.shape((height, width))``: ``out`` when given.

    Raises:
        LoaderError: the bytes are not a readable image, or it does not have shape ``expect``.
    """
    if not data:
        raise LoaderError(where, "empty file (0 bytes)")
    try:
        img = Image.open(io.BytesIO(data))
        if spec.size is not None and img.format == "JPEG":
            # Let libjpeg decode at 1/2, 1/4 or 1/8 scale when the target is that much smaller:
            # far less work, and the result still covers the target size.
            img.draft(img.mode, (spec.size[1], spec.size[0]))
        img.load()
        if img.mode in _HIGH_DEPTH:
            hwc = _high_depth_array(img, spec)
            factor = np.float32(1.0)
        else:
            img = _convert(img, spec.mode)
            if spec.size is not None:
                img = _fit(img, spec.size)
            hwc = np.asarray(img, dtype=np.uint8)
            if hwc.ndim == 2:
                hwc = hwc[:, :, None]
            factor = np.float32(1.0 / 255.0)
    except LoaderError:
        raise
    except MemoryError:
        raise
    except UnidentifiedImageError as exc:
        raise LoaderError(where, f"not a known image format (file starts with {data[:8]!r})") from exc
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, struct.error... on bad files
        raise LoaderError(where, f"cannot decode image ({type(exc).__name__}: {exc})") from exc
    arranged = hwc.transpose(2, 0, 1) if spec.layout == "CHW" else hwc
    if expect is not None and arranged.shape != tuple(expect):
        raise LoaderError(
            where,
            f"decoded shape {arranged.shape} differs from the source's {tuple(expect)} "
            "(set size=(h, w) to resize every image)",
        )
    if out is None:
        out = np.empty(arranged.shape, dtype=np.float32)
    # One pass: cast, scale and lay out straight into the destination.
    np.multiply(arranged, factor, out=out, casting="unsafe")
    return out


def read_file(path: str | os.PathLike) -> bytes:
    """Read a whole file, turning OS errors into :class:`LoaderError`.

    Args:
        path: the file.

    Returns:
        Its bytes.
    """
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise LoaderError(str(path), f"cannot read file ({exc.strerror or exc})") from exc


def probe_size(data: bytes, where: str) -> tuple[int, int]:
    """Read only the header of an image: its (height, width).

    Args:
        data: the file's bytes.
        where: the file's name, for errors.

    Returns:
        (height, width).
    """
    if not data:
        raise LoaderError(where, "empty file (0 bytes)")
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
    except Exception as exc:
        raise LoaderError(where, f"cannot read image header ({type(exc).__name__}: {exc})") from exc
    return h, w

"""Decode one image file into a fixed mode, size and layout.

:func:`decode_image` gives one float32 sample in [0, 1]; :func:`decode_pixels` gives the 8-bit
pixels, for a caller that converts a whole batch to float32 in one vectorised pass (cheaper per
image, which counts for small images). Pillow does the work (it releases the GIL while decoding,
so several threads decode at once). Every mode Pillow can open is converted to the target mode,
including the awkward ones: CMYK JPEGs, 16-bit greyscale PNGs (scaled from 0..65535, not clipped
to 8 bits) and palette images with a transparent colour. Anything that still fails becomes a
:class:`LoaderError` naming the file.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
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
# The first bytes of the commonest formats: Pillow then tries that format's reader alone instead of
# probing every registered one (a few microseconds per image). Anything else is probed as usual.
_FORMATS_BY_MAGIC = {b"\xff\xd8\xff": ("JPEG",), b"\x89PN": ("PNG",)}

# The fast path (see _decode_plain) takes these: 8-bit baseline, extended or progressive JPEGs of 1
# or 3 components, and 8-bit non-interlaced PNGs without a palette or a transparent colour.
_JPEG_SOF = frozenset((0xC0, 0xC1, 0xC2))
_JPEG_MODES = {1: "L", 3: "RGB"}
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_MODES = {0: "L", 2: "RGB", 4: "LA", 6: "RGBA"}  # by colour type, at 8 bits per sample


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


def _jpeg_plain(data: bytes, size: tuple[int, int] | None) -> Image.Image | None:
    """A common JPEG decoded by Pillow's JPEG codec, reading only the frame header in Python.

    None when the file is not one the fast path takes, or when ``size`` is small enough for
    ``Image.draft`` to decode at a reduced scale (Pillow's reader does that).
    """
    unpack, i, n = struct.unpack_from, 2, len(data)
    while i + 4 <= n:
        ff, marker, length = unpack(">BBH", data, i)
        if ff != 0xFF or marker == 0xFF:
            return None  # not at a marker, or fill bytes: leave the file to Pillow's reader
        if marker in _JPEG_SOF:
            if i + 10 > n:
                return None
            bits, h, w, components = unpack(">BHHB", data, i + 4)
            mode = _JPEG_MODES.get(components)
            if bits != 8 or mode is None or not _plain_size(w, h):
                return None
            if size is not None and min(w // size[1], h // size[0]) >= 2:
                return None
            # The arguments Pillow's own JPEG reader gives the codec for an L or RGB frame.
            return Image.frombytes(mode, (w, h), data, "jpeg", mode, "")
        if marker in (0x01, 0xD9, 0xDA) or 0xD0 <= marker <= 0xD8:
            return None  # no frame header before the scan
        i += 2 + length
    return None


def _png_plain(data: bytes) -> Image.Image | None:
    """A common PNG decoded by Pillow's zlib codec, walking the chunks in Python.

    None unless the file is 8 bits per sample, not interlaced, without palette or ``tRNS``, and
    complete (every chunk whole, up to ``IEND``, with the right checksum outside the image data,
    which Pillow checks too): anything else goes to Pillow's reader.
    """
    unpack = struct.unpack_from
    if len(data) < 33 or data[12:16] != b"IHDR":
        return None
    w, h, bits, colour, compression, filtering, interlace = unpack(">IIBBBBB", data, 16)
    mode = _PNG_MODES.get(colour)
    if bits != 8 or mode is None or compression or filtering or interlace or not _plain_size(w, h):
        return None
    i, n, idat = 8, len(data), []
    while True:
        if i + 12 > n:
            return None
        length, kind = unpack(">I4s", data, i)
        if i + 12 + length > n or kind == b"tRNS":
            return None
        if kind == b"IDAT":
            idat.append(data[i + 8 : i + 8 + length])
        elif zlib.crc32(data[i + 4 : i + 8 + length]) != unpack(">I", data, i + 8 + length)[0]:
            return None
        elif kind == b"IEND":
            break
        i += 12 + length
    if not idat:
        return None
    return Image.frombytes(mode, (w, h), idat[0] if len(idat) == 1 else b"".join(idat), "zip", mode)


def _plain_size(w: int, h: int) -> bool:
    """A size the fast path takes: not empty, and not past Pillow's decompression-bomb limit
    (larger ones go to Pillow's reader, which warns or refuses as it always does)."""
    return w > 0 and h > 0 and (Image.MAX_IMAGE_PIXELS is None or w * h <= Image.MAX_IMAGE_PIXELS)


def _decode_plain(data: bytes, size: tuple[int, int] | None) -> Image.Image | None:
    """The fast path for the commonest files: decoded, or None to use Pillow's reader instead.

    ``Image.open`` parses every header segment in Python (JPEG quantisation tables into lists,
    PNG chunks one call each) and ``load`` adds generic bookkeeping: tens of microseconds per
    image, all holding the GIL, which is as long as decoding a 64x64 image takes. For plain JPEGs
    and PNGs, this reads only the size and colour type and hands the bytes to the same Pillow
    codec, with the same arguments Pillow's reader gives it, so the pixels are identical. A file
    it does not take, or any error, falls back to Pillow's reader, which then decides (and words
    the error) exactly as before.
    """
    try:
        if data.startswith(b"\xff\xd8\xff"):
            return _jpeg_plain(data, size)
        if data.startswith(_PNG_SIGNATURE):
            return _png_plain(data)
    except MemoryError:
        raise
    except Exception:
        return None
    return None


def _load(data: bytes, spec: DecodeSpec, where: str) -> Image.Image | np.ndarray:
    """Open, decode, convert and fit: an 8-bit image in ``spec.mode`` (Pillow) or, for a >8-bit
    greyscale file, float32 (H, W, C) in [0, 1]. Every failure becomes a :class:`LoaderError`."""
    if not data:
        raise LoaderError(where, "empty file (0 bytes)")
    try:
        img = _decode_plain(data, spec.size)
        if img is None:
            img = Image.open(io.BytesIO(data), formats=_FORMATS_BY_MAGIC.get(data[:3]))
            if spec.size is not None and img.format == "JPEG":
                # Let libjpeg decode at 1/2, 1/4 or 1/8 scale when the target is that much
                # smaller: far less work, and the result still covers the target size.
                img.draft(img.mode, (spec.size[1], spec.size[0]))
            img.load()
        if img.mode in _HIGH_DEPTH:
            return _high_depth_array(img, spec)
        img = _convert(img, spec.mode)
        if spec.size is not None:
            img = _fit(img, spec.size)
        return img
    except LoaderError:
        raise
    except MemoryError:
        raise
    except UnidentifiedImageError as exc:
        raise LoaderError(where, f"not a known image format (file starts with {data[:8]!r})") from exc
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, struct.error... on bad files
        raise LoaderError(where, f"cannot decode image ({type(exc).__name__}: {exc})") from exc


def _shape_error(where: str, got: tuple[int, ...], expect: tuple[int, ...]) -> LoaderError:
    return LoaderError(
        where,
        f"decoded shape {got} differs from the source's {tuple(expect)} "
        "(set size=(h, w) to resize every image)",
    )


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
    pixels = _load(data, spec, where)
    if isinstance(pixels, np.ndarray):
        hwc = pixels
        factor = np.float32(1.0)
    else:
        w, h = pixels.size
        hwc = np.frombuffer(pixels.tobytes(), dtype=np.uint8).reshape(h, w, CHANNELS[spec.mode])
        factor = np.float32(1.0 / 255.0)
    arranged = hwc.transpose(2, 0, 1) if spec.layout == "CHW" else hwc
    if expect is not None and arranged.shape != tuple(expect):
        raise _shape_error(where, arranged.shape, expect)
    if out is None:
        out = np.empty(arranged.shape, dtype=np.float32)
    # One pass: cast, scale and lay out straight into the destination.
    np.multiply(arranged, factor, out=out, casting="unsafe")
    return out


def decode_pixels(data: bytes, spec: DecodeSpec, where: str, expect: tuple[int, ...]) -> bytes | np.ndarray:
    """Decode image bytes to 8-bit pixels, for a caller that converts a whole batch to float at once.

    Args:
        data: the file's bytes.
        spec: target mode, size and layout.
        where: the file's name, for errors.
        expect: the sample shape (in ``spec.layout``) the caller needs.

    Returns:
        Usually ``bytes``: the pixels as uint8 (H, W, C), row-major, whatever ``spec.layout``
        (divide by 255 for [0, 1]). A greyscale file of more than 8 bits per sample comes back
        as float32 in [0, 1] in ``spec.layout`` instead, so that its precision is kept.

    Raises:
        LoaderError: the bytes are not a readable image, or it does not have shape ``expect``.
    """
    pixels = _load(data, spec, where)
    if isinstance(pixels, np.ndarray):
        arranged = pixels.transpose(2, 0, 1) if spec.layout == "CHW" else pixels
        if arranged.shape != tuple(expect):
            raise _shape_error(where, arranged.shape, expect)
        return np.ascontiguousarray(arranged, dtype=np.float32)
    if spec.shape(pixels.size[::-1]) != tuple(expect):
        raise _shape_error(where, spec.shape(pixels.size[::-1]), expect)
    try:
        return pixels.tobytes()
    except MemoryError:
        raise
    except Exception as exc:
        raise LoaderError(where, f"cannot decode image ({type(exc).__name__}: {exc})") from exc


_FIRST_READ = 1 << 26


def read_file(path: str | os.PathLike, size_hint: int | None = None) -> bytes:
    """Read a whole file, turning OS errors into :class:`LoaderError`.

    Plain ``os`` calls: open, one read and close when the file has the expected size, without
    the buffered file object's extra system calls (microseconds per file, which count when
    files are small).

    Args:
        path: the file.
        size_hint: its expected size (from a listing), to size the first read; None asks the OS.

    Returns:
        Its bytes.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        try:
            if size_hint is None:
                size_hint = os.fstat(fd).st_size
            # One byte more than expected, so that a file grown since it was listed shows (and
            # at most _FIRST_READ, so that a stale hint cannot ask for a huge buffer).
            data = os.read(fd, min(size_hint + 1, _FIRST_READ))
            if len(data) != size_hint:
                # Shorter (a short read, or the file shrank) or longer: read on to the end.
                chunks = [data]
                while chunk := os.read(fd, 1 << 20):
                    chunks.append(chunk)
                data = b"".join(chunks)
        finally:
            os.close(fd)
    except OSError as exc:
        raise LoaderError(str(path), f"cannot read file ({exc.strerror or exc})") from exc
    return data


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

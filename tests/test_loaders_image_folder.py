"""Image-folder source: decoding, layouts, modes, the manifest cache and the bad-input policy."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from loaders import ImageFolderSource, LoaderError, manifest_path
from loaders.decode import DecodeSpec, _decode_plain, decode_image, read_file

RNG = np.random.default_rng(1234)


# Every test here reads and writes a fresh user cache, never the real one.
pytestmark = pytest.mark.usefixtures("user_cache")


def _age(root: Path) -> None:
    """Push every directory's mtime a minute back, out of the manifest's racy window."""
    past = os.stat(root).st_mtime - 60
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        os.utime(d, (past, past))


def _rgb_folder(root: Path, per_class: int = 3, size: tuple[int, int] = (6, 5)) -> dict[str, np.ndarray]:
    """root/<class>/<i>.png with random RGB pixels; returns relpath -> uint8 HWC pixels."""
    pixels = {}
    for cls in ("zebra", "ant", "moth"):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            arr = RNG.integers(1, 255, (*size, 3), dtype=np.uint8)
            Image.fromarray(arr).save(root / cls / f"{i}.png")
            pixels[f"{cls}/{i}.png"] = arr
    return pixels


def test_class_folders_sorted_labels_and_exact_pixels(tmp_path: Path) -> None:
    pixels = _rgb_folder(tmp_path / "data")
    (tmp_path / "data" / "notes.txt").write_text("not an image")
    src = ImageFolderSource(tmp_path / "data", mode="RGB", layout="CHW", workers=2)
    assert src.classes == ["ant", "moth", "zebra"]
    assert src.files == tuple(sorted(pixels))
    assert len(src) == 9 and src.sample_shape == (3, 6, 5) and src.num_classes == 3
    assert src.label_dtype == np.int32
    assert src.labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    x, y, skipped = src.read([8, 0, 4])
    assert skipped == 0 and x.dtype == np.float32 and y.tolist() == [2, 0, 1]
    for k, i in enumerate([8, 0, 4]):
        np.testing.assert_allclose(x[k], pixels[src.files[i]].transpose(2, 0, 1) / 255.0, atol=1e-6)
    stats = src.statistics()
    assert (
        stats.samples_read == 3 and stats.skipped == 0 and stats.bytes_read > 0 and stats.decode_seconds > 0
    )
    src.close()


def test_hwc_layout_grey_mode_and_workers_agree(tmp_path: Path) -> None:
    pixels = _rgb_folder(tmp_path / "data")
    hwc = ImageFolderSource(tmp_path / "data", mode="L", layout="HWC", workers=0)
    chw = ImageFolderSource(tmp_path / "data", mode="L", layout="CHW", workers=3)
    assert hwc.sample_shape == (6, 5, 1) and chw.sample_shape == (1, 6, 5)
    xh, _, _ = hwc.read(range(9))
    xc, _, _ = chw.read(range(9))
    np.testing.assert_array_equal(xh.transpose(0, 3, 1, 2), xc)
    grey = np.asarray(Image.fromarray(pixels[hwc.files[2]]).convert("L")) / 255.0
    np.testing.assert_allclose(xh[2, :, :, 0], grey, atol=1e-6)
    rgba = ImageFolderSource(tmp_path / "data", mode="RGBA").read([0])[0]
    assert rgba.shape == (1, 4, 6, 5)
    np.testing.assert_array_equal(rgba[0, 3], 1.0)


def test_resize_covers_then_centre_crops(tmp_path: Path) -> None:
    (tmp_path / "d" / "a").mkdir(parents=True)
    wide = np.zeros((8, 16), dtype=np.uint8)
    wide[:, 4:12] = 200  # only the centre 8x8 is bright
    Image.fromarray(wide).save(tmp_path / "d" / "a" / "wide.png")
    Image.fromarray(np.full((4, 4), 100, np.uint8)).save(tmp_path / "d" / "a" / "small.png")
    src = ImageFolderSource(tmp_path / "d", size=(8, 8), mode="L")
    x, _, _ = src.read([0, 1])
    assert x.shape == (2, 1, 8, 8)
    np.testing.assert_allclose(x[0], 100 / 255, atol=1e-6)  # small.png sorts first, upscaled
    np.testing.assert_allclose(x[1], 200 / 255, atol=1 / 255)


def test_flat_folder_with_labels_csv(tmp_path: Path) -> None:
    root = tmp_path / "flat"
    root.mkdir()
    for i in range(4):
        Image.fromarray(np.full((3, 3, 3), 10 * i + 5, np.uint8)).save(root / f"img{i}.jpg", quality=100)
    (root / "labels.csv").write_text(
        "filename,label\nimg3.jpg,dog\nimg0.jpg,cat\nimg1.jpg,dog\nimg2.jpg,cat\n"
    )
    src = ImageFolderSource(root, labels_csv=root / "labels.csv")
    assert src.classes == ["cat", "dog"]
    assert src.files == ("img0.jpg", "img1.jpg", "img2.jpg", "img3.jpg")
    assert src.labels.tolist() == [0, 1, 0, 1]
    x, y, _ = src.read([3])
    np.testing.assert_allclose(x, 35 / 255, atol=3 / 255)
    (root / "labels.csv").write_text("img0.jpg,1\nimg1.jpg,0\nghost.jpg,1\n")
    with pytest.raises(LoaderError, match="ghost.jpg"):
        ImageFolderSource(root, labels_csv=root / "labels.csv")
    skipping = ImageFolderSource(root, labels_csv=root / "labels.csv", on_error="skip")
    assert len(skipping) == 2 and skipping.labels.tolist() == [1, 0] and skipping.statistics().skipped == 1


def test_manifest_lives_in_the_user_cache_and_is_reused(tmp_path: Path, user_cache: Path) -> None:
    _rgb_folder(tmp_path / "data")
    _age(tmp_path / "data")
    first = ImageFolderSource(tmp_path / "data")
    assert not first.manifest_reused
    path = manifest_path(tmp_path / "data")
    assert path.is_relative_to(user_cache / "vkflow" / "manifests")
    stored = json.loads(path.read_text())
    assert [f[0] for f in stored["files"]] == list(first.files)
    assert all(f[1] == (tmp_path / "data" / f[0]).stat().st_size for f in stored["files"])
    assert not list((tmp_path / "data").rglob("*.json"))
    second = ImageFolderSource(tmp_path / "data")
    assert second.manifest_reused and second.files == first.files


def test_manifest_is_relisted_when_a_file_is_added_or_removed(tmp_path: Path) -> None:
    _rgb_folder(tmp_path / "data")
    _age(tmp_path / "data")
    assert len(ImageFolderSource(tmp_path / "data")) == 9
    Image.fromarray(np.full((6, 5, 3), 9, np.uint8)).save(tmp_path / "data" / "ant" / "new.png")
    grown = ImageFolderSource(tmp_path / "data")
    assert not grown.manifest_reused
    assert len(grown) == 10 and "ant/new.png" in grown.files
    _age(tmp_path / "data")
    (tmp_path / "data" / "moth" / "0.png").unlink()
    shrunk = ImageFolderSource(tmp_path / "data")
    assert not shrunk.manifest_reused and len(shrunk) == 9 and "moth/0.png" not in shrunk.files


def test_a_fresh_change_is_never_trusted_from_the_manifest(tmp_path: Path) -> None:
    _rgb_folder(tmp_path / "data")
    ImageFolderSource(tmp_path / "data")
    # Folders changed within the racy window (just now) are listed again, not trusted.
    assert not ImageFolderSource(tmp_path / "data").manifest_reused


# --- bad input -----------------------------------------------------------------------------------


def _bad_folder(root: Path) -> dict[str, Path]:
    """Three good PNGs plus one of each kind of broken file, in class "a"."""
    cls = root / "a"
    cls.mkdir(parents=True)
    for i in range(3):
        Image.fromarray(RNG.integers(0, 255, (8, 8), dtype=np.uint8)).save(cls / f"good{i}.png")
    good = (cls / "good0.png").read_bytes()
    bad = {
        "truncated": cls / "truncated.png",
        "empty": cls / "empty.png",
        "text": cls / "text.png",
    }
    bad["truncated"].write_bytes(good[: len(good) // 2])
    bad["empty"].write_bytes(b"")
    bad["text"].write_text("this is not a png\n")
    return bad


@pytest.mark.parametrize("kind", ["truncated", "empty", "text"])
def test_broken_file_raises_loader_error_naming_it(tmp_path: Path, kind: str) -> None:
    bad = _bad_folder(tmp_path / "d")
    src = ImageFolderSource(tmp_path / "d", mode="L")
    i = src.files.index(f"a/{bad[kind].name}")
    with pytest.raises(LoaderError) as info:
        src.read([src.files.index("a/good0.png"), i])
    assert str(bad[kind]) in str(info.value)
    assert info.value.where == str(bad[kind])


def test_broken_files_are_skipped_counted_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _bad_folder(tmp_path / "d")
    src = ImageFolderSource(tmp_path / "d", mode="L", on_error="skip", workers=2)
    assert len(src) == 6
    with caplog.at_level(logging.WARNING, logger="vkflow.loaders"):
        x, y, skipped = src.read(range(6))
        x2, _, skipped2 = src.read(range(6))
    assert skipped == skipped2 == 3 and x.shape == (3, 1, 8, 8) and len(y) == 3
    good = [np.asarray(Image.open(tmp_path / "d" / "a" / f"good{i}.png")) / 255.0 for i in range(3)]
    for k in range(3):
        np.testing.assert_allclose(x[k, 0], good[k], atol=1e-6)
    assert src.statistics().skipped == 6 and src.statistics().samples_read == 6
    # Read twice, each bad file still counts once as an item, named by its path in the order met.
    names = [str(tmp_path / "d" / "a" / f"{kind}.png") for kind in ("empty", "text", "truncated")]
    stats = src.statistics()
    assert stats.skipped_items == 3 and sorted(stats.skipped_examples) == names
    warnings = [r for r in caplog.records if r.name == "vkflow.loaders"]
    assert len(warnings) == 1 and "empty.png" in warnings[0].getMessage()


def test_file_removed_after_listing_is_a_loader_error(tmp_path: Path) -> None:
    _rgb_folder(tmp_path / "data")
    src = ImageFolderSource(tmp_path / "data")
    (tmp_path / "data" / "moth" / "1.png").unlink()
    with pytest.raises(LoaderError, match="moth/1.png.*cannot read file"):
        src.read(range(9))
    skipping = ImageFolderSource(tmp_path / "data", on_error="skip")
    (tmp_path / "data" / "moth" / "2.png").unlink()
    assert skipping.read(range(len(skipping)))[2] == 1


def test_wrong_size_without_resize_is_bad_and_resize_fixes_it(tmp_path: Path) -> None:
    (tmp_path / "d" / "a").mkdir(parents=True)
    Image.fromarray(np.full((8, 8), 50, np.uint8)).save(tmp_path / "d" / "a" / "0.png")
    Image.fromarray(np.full((9, 8), 50, np.uint8)).save(tmp_path / "d" / "a" / "1.png")
    src = ImageFolderSource(tmp_path / "d", mode="L")
    assert src.sample_shape == (1, 8, 8)
    with pytest.raises(LoaderError, match=r"1\.png.*\(1, 9, 8\).*\(1, 8, 8\)"):
        src.read([0, 1])
    x, _, skipped = ImageFolderSource(tmp_path / "d", mode="L", on_error="skip").read([0, 1])
    assert skipped == 1 and x.shape == (1, 1, 8, 8)
    x, _, skipped = ImageFolderSource(tmp_path / "d", mode="L", size=(8, 8)).read([0, 1])
    assert skipped == 0
    np.testing.assert_allclose(x, 50 / 255, atol=1e-6)


# --- convertible modes load correctly ------------------------------------------------------------


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_cmyk_jpeg_converts_to_its_rgb_colour(tmp_path: Path, on_error: str) -> None:
    (tmp_path / "d" / "a").mkdir(parents=True)
    colour = (200, 30, 60)
    cmyk = Image.new("RGB", (8, 8), colour).convert("CMYK")
    cmyk.save(tmp_path / "d" / "a" / "c.jpg", quality=95)
    with Image.open(tmp_path / "d" / "a" / "c.jpg") as written:
        assert written.mode == "CMYK"
    src = ImageFolderSource(tmp_path / "d", mode="RGB", on_error=on_error)
    x, _, skipped = src.read([0])
    assert skipped == 0
    np.testing.assert_allclose(x[0].mean(axis=(1, 2)), np.array(colour) / 255.0, atol=4 / 255)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_16_bit_png_keeps_its_precision(tmp_path: Path, on_error: str) -> None:
    (tmp_path / "d" / "a").mkdir(parents=True)
    values = np.array([[0, 1000, 40000, 65535]] * 4, dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / "d" / "a" / "deep.png")
    with Image.open(tmp_path / "d" / "a" / "deep.png") as written:
        assert written.mode.startswith("I")
    grey = ImageFolderSource(tmp_path / "d", mode="L", on_error=on_error).read([0])
    assert grey[2] == 0
    # 1000/65535 = 0.01526; squeezing through 8 bits would give 3/255 = 0.01176.
    np.testing.assert_allclose(grey[0][0, 0], values / 65535.0, atol=1e-6)
    rgb = ImageFolderSource(tmp_path / "d", mode="RGB").read([0])[0]
    np.testing.assert_allclose(rgb[0], np.stack([values / 65535.0] * 3), atol=1e-6)
    small = ImageFolderSource(tmp_path / "d", mode="L", size=(2, 2)).read([0])[0]
    assert small.shape == (1, 1, 2, 2) and 0 <= small.min() and small.max() <= 1


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_palette_png_with_transparency_becomes_alpha(tmp_path: Path, on_error: str) -> None:
    (tmp_path / "d" / "a").mkdir(parents=True)
    index = np.zeros((4, 4), dtype=np.uint8)
    index[:2] = 1  # top half: opaque green; bottom half: colour 0, red, marked transparent
    img = Image.fromarray(index).convert("P")
    img.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    img.save(tmp_path / "d" / "a" / "p.png", transparency=0)
    with Image.open(tmp_path / "d" / "a" / "p.png") as opened:
        assert opened.mode == "P" and "transparency" in opened.info
    rgba = ImageFolderSource(tmp_path / "d", mode="RGBA", on_error=on_error).read([0])[0][0]
    np.testing.assert_array_equal(rgba[:, 0, 0], [0, 1, 0, 1])
    np.testing.assert_array_equal(rgba[:, 3, 3], [1, 0, 0, 0])
    rgb = ImageFolderSource(tmp_path / "d", mode="RGB").read([0])[0][0]
    np.testing.assert_array_equal(rgb[:, 0, 0], [0, 1, 0])
    np.testing.assert_array_equal(rgb[:, 3, 3], [0, 0, 0])  # transparent: composited over black


def test_constructor_rejects_bad_settings(tmp_path: Path) -> None:
    _rgb_folder(tmp_path / "data")
    with pytest.raises(ValueError, match="mode must be one of .*, got 'CMYK'"):
        ImageFolderSource(tmp_path / "data", mode="CMYK")
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'skip', got 'ignore'"):
        ImageFolderSource(tmp_path / "data", on_error="ignore")
    with pytest.raises(LoaderError, match="missing: no such directory"):
        ImageFolderSource(tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(LoaderError, match="file: not a directory"):
        ImageFolderSource(tmp_path / "file")
    with pytest.raises(IndexError):
        ImageFolderSource(tmp_path / "data").read([9])


def test_loose_root_files_are_ignored_with_a_warning_and_symlink_loops_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _rgb_folder(tmp_path / "data")
    Image.fromarray(np.zeros((6, 5, 3), np.uint8)).save(tmp_path / "data" / "loose.png")
    (tmp_path / "data" / "ant" / "loop").symlink_to(tmp_path / "data", target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="vkflow.loaders"):
        src = ImageFolderSource(tmp_path / "data")
    assert len(src) == 9 and "loose.png" not in src.files
    assert any("1 image files directly under the root" in r.getMessage() for r in caplog.records)


def test_statistics_are_a_frozen_snapshot(tmp_path: Path) -> None:
    _rgb_folder(tmp_path / "data")
    src = ImageFolderSource(tmp_path / "data")
    before = src.statistics()
    src.read([0, 1])
    assert before.samples_read == 0 and src.statistics().samples_read == 2
    with pytest.raises(AttributeError):
        before.samples_read = 5  # type: ignore[misc]


# --- the fast path and the batched float conversion ----------------------------------------------


def _encoded(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _pillow_reader(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def _plain_files() -> dict[str, bytes]:
    """JPEGs and PNGs of the kinds the fast path takes."""
    rgb = Image.fromarray(RNG.integers(0, 256, (23, 37, 3), dtype=np.uint8))
    big = Image.fromarray(RNG.integers(0, 256, (260, 300, 3), dtype=np.uint8))  # several IDATs
    files = {
        "png-L": _encoded(rgb.convert("L"), "PNG"),
        "png-RGB": _encoded(rgb, "PNG"),
        "png-RGBA": _encoded(rgb.convert("RGBA"), "PNG"),
        "png-LA": _encoded(rgb.convert("LA"), "PNG"),
        "png-big": _encoded(big, "PNG"),
        "jpg-L": _encoded(rgb.convert("L"), "JPEG", quality=90),
        "jpg-RGB": _encoded(rgb, "JPEG", quality=90),
        "jpg-progressive": _encoded(rgb, "JPEG", progressive=True),
        "jpg-444": _encoded(rgb, "JPEG", subsampling=0),
        "jpg-restarts": _encoded(rgb, "JPEG", restart_marker_blocks=1),
        "jpg-exif": _encoded(big, "JPEG", exif=Image.Exif()),
    }
    assert files["png-big"].count(b"IDAT") > 1
    return files


@pytest.mark.parametrize("name", sorted(_plain_files()))
def test_fast_path_decodes_exactly_like_pillows_reader(name: str) -> None:
    data = _plain_files()[name]
    fast = _decode_plain(data, None)
    assert fast is not None, "the fast path should take this file"
    ref = _pillow_reader(data)
    assert (fast.mode, fast.size) == (ref.mode, ref.size)
    assert fast.tobytes() == ref.tobytes()


@pytest.mark.parametrize("name", sorted(_plain_files()))
def test_fast_path_never_accepts_a_cut_file_pillow_would_read_otherwise(name: str) -> None:
    data = _plain_files()[name]
    cuts = sorted({*range(0, len(data), max(1, len(data) // 150)), *range(len(data) - 24, len(data))})
    for cut in cuts:
        fast = _decode_plain(data[:cut], None)
        if fast is None:
            continue  # Pillow's reader decides, as before
        ref = _pillow_reader(data[:cut])  # must not raise when the fast path did not
        assert fast.tobytes() == ref.tobytes(), cut


def test_fast_path_leaves_unusual_files_to_pillows_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    rgb = Image.fromarray(RNG.integers(0, 256, (12, 10, 3), dtype=np.uint8))
    png = _encoded(rgb, "PNG")
    interlaced = bytearray(png)
    interlaced[28] = 1  # the IHDR interlace byte
    bad_crc = bytearray(png)
    bad_crc[29] ^= 0xFF  # IHDR checksum
    others = {
        "cmyk jpeg": _encoded(rgb.convert("CMYK"), "JPEG"),
        "palette png": _encoded(rgb.convert("P"), "PNG"),
        "transparent colour": _encoded(rgb, "PNG", transparency=(1, 2, 3)),
        "16-bit png": _encoded(Image.fromarray(np.full((4, 4), 40000, np.uint16)), "PNG"),
        "interlaced": bytes(interlaced),
        "bad checksum": bytes(bad_crc),
        "bmp": _encoded(rgb, "BMP"),
    }
    for name, data in others.items():
        assert _decode_plain(data, None) is None, name
    # A JPEG that Image.draft can decode at a reduced scale goes to Pillow's reader too.
    jpg = _encoded(rgb, "JPEG")
    assert _decode_plain(jpg, (6, 5)) is None and _decode_plain(jpg, (7, 5)) is not None
    # So does anything past Pillow's decompression-bomb limit, which Pillow then enforces.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50)
    assert _decode_plain(jpg, None) is None and _decode_plain(png, None) is None


def _mixed_folder(root: Path, count: int = 40) -> None:
    """root/<class>/ with JPEGs and PNGs of one size in several modes."""
    for i in range(count):
        cls = root / f"c{i % 3}"
        cls.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(RNG.integers(0, 256, (9, 11, 3), dtype=np.uint8))
        img = img.convert(("RGB", "L", "RGBA", "P")[i % 4])
        if i % 2 and img.mode != "RGBA":
            img.convert("RGB").save(cls / f"{i:03d}.jpg", quality=90)
        else:
            img.save(cls / f"{i:03d}.png")


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA"])
@pytest.mark.parametrize("layout", ["CHW", "HWC"])
def test_threaded_batches_equal_the_per_image_float_decode(tmp_path: Path, mode: str, layout: str) -> None:
    _mixed_folder(tmp_path / "d")
    order = [int(i) for i in RNG.permutation(40)] + [3, 3, 17]  # repeats allowed
    serial = ImageFolderSource(tmp_path / "d", mode=mode, layout=layout, workers=0)
    threaded = ImageFolderSource(tmp_path / "d", mode=mode, layout=layout, workers=3)
    x0, y0, _ = serial.read(order)
    x3, y3, _ = threaded.read(order)
    spec = DecodeSpec(mode, None, layout)
    one_by_one = [decode_image(read_file(serial.root / serial.files[i]), spec, "f") for i in order]
    np.testing.assert_array_equal(x0, np.stack(one_by_one))
    np.testing.assert_array_equal(x3, x0)
    np.testing.assert_array_equal(y3, y0)
    empty, labels, skipped = threaded.read([])
    assert empty.shape == (0, *threaded.sample_shape) and labels.shape == (0,) and skipped == 0
    threaded.close()


def test_threaded_bad_items_keep_order_and_the_first_one_is_raised(tmp_path: Path) -> None:
    _mixed_folder(tmp_path / "d", count=30)
    cls = tmp_path / "d" / "c0"
    (cls / "zz_bad1.png").write_bytes(b"not a png at all")
    (cls / "zz_bad2.jpg").write_bytes(b"\xff\xd8\xff\xe0 broken")
    good = ImageFolderSource(tmp_path / "d", mode="RGB", workers=0, on_error="skip")
    bad = [good.files.index("c0/zz_bad1.png"), good.files.index("c0/zz_bad2.jpg")]
    order = [int(i) for i in RNG.permutation(len(good))]
    x, y, skipped = ImageFolderSource(tmp_path / "d", mode="RGB", workers=4, on_error="skip").read(order)
    kept = [i for i in order if i not in bad]
    assert skipped == 2 and len(x) == len(kept)
    np.testing.assert_array_equal(x, good.read(kept)[0])
    np.testing.assert_array_equal(y, good.labels[kept])
    first = min(bad, key=order.index)
    raising = ImageFolderSource(tmp_path / "d", mode="RGB", workers=4)
    with pytest.raises(LoaderError) as info:
        raising.read(order)
    assert info.value.where == raising._path(first)


def test_high_depth_images_keep_precision_in_a_threaded_batch(tmp_path: Path) -> None:
    (tmp_path / "d" / "a").mkdir(parents=True)
    deep = np.array([[0, 1000, 40000, 65535]] * 4, dtype=np.uint16)
    for i in range(6):
        if i % 3 == 1:
            Image.fromarray(deep).save(tmp_path / "d" / "a" / f"{i}.png")
        else:
            Image.fromarray(np.full((4, 4), 10 * i, np.uint8)).save(tmp_path / "d" / "a" / f"{i}.png")
    x, _, _ = ImageFolderSource(tmp_path / "d", mode="L", workers=2).read(range(6))
    for i in range(6):
        want = deep / 65535.0 if i % 3 == 1 else np.full((4, 4), 10 * i / 255)
        np.testing.assert_allclose(x[i, 0], want, atol=1e-6)


def test_read_file_reads_the_whole_file_whatever_the_size_hint(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    data = bytes(RNG.integers(0, 256, 200_000, dtype=np.uint8))
    path.write_bytes(data)
    for hint in (None, 0, 1, 1000, len(data) - 1, len(data), len(data) + 1, 10**6):
        assert read_file(path, hint) == data
    (tmp_path / "empty").write_bytes(b"")
    assert read_file(tmp_path / "empty", 0) == b"" and read_file(tmp_path / "empty") == b""


def test_a_file_rewritten_after_listing_is_read_whole(tmp_path: Path) -> None:
    (tmp_path / "d" / "a").mkdir(parents=True)
    small = Image.fromarray(np.full((8, 8, 3), 7, np.uint8))
    small.save(tmp_path / "d" / "a" / "0.png")
    small.save(tmp_path / "d" / "a" / "1.png")
    src = ImageFolderSource(tmp_path / "d", mode="RGB", workers=2)
    noisy = RNG.integers(0, 256, (8, 8, 3), dtype=np.uint8)  # compresses worse: a larger file
    Image.fromarray(noisy).save(tmp_path / "d" / "a" / "1.png")
    x, _, _ = src.read([0, 1])
    np.testing.assert_allclose(x[1], noisy.transpose(2, 0, 1) / 255.0, atol=1e-6)

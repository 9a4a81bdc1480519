"""The bundled digits: written once as real PNGs, read back through the image-folder loader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from loaders import ImageFolderSource, load_digits_arrays, open_source, write_image_folder

CLASS_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


@dataclass(frozen=True)
class Digits:
    pass


# Every test here reads and writes a fresh user cache, never the real one.
pytestmark = pytest.mark.usefixtures("user_cache")


def test_bundled_arrays_are_the_uci_digits() -> None:
    images, labels = load_digits_arrays()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8
    assert images.min() == 0 and images.max() == 16 and len(np.unique(images)) == 17
    assert np.bincount(labels).tolist() == CLASS_COUNTS
    # The first sample of the UCI/scikit-learn set is a zero with this top row.
    assert labels[0] == 0 and images[0, 0].tolist() == [0, 0, 5, 13, 9, 1, 0, 0]


def test_write_image_folder_writes_grey_pngs_once(tmp_path: Path) -> None:
    dest = write_image_folder(tmp_path / "digits")
    pngs = sorted(dest.rglob("*.png"))
    assert len(pngs) == 1797
    images, labels = load_digits_arrays()
    one = dest / str(labels[5]) / "0005.png"
    img = Image.open(one)
    assert img.mode == "L" and img.size == (8, 8)
    np.testing.assert_array_equal(np.asarray(img), np.rint(images[5] * (255 / 16)))
    stamp = one.stat().st_mtime_ns
    write_image_folder(dest)
    assert one.stat().st_mtime_ns == stamp  # complete: nothing rewritten
    one.unlink()
    write_image_folder(dest)
    assert one.is_file() and len(list(dest.rglob("*.png"))) == 1797


def test_digits_source_reads_real_pngs_from_the_user_cache(user_cache: Path) -> None:
    src = open_source(Digits())
    assert isinstance(src, ImageFolderSource)
    assert src.root == (user_cache / "vkflow" / "digits").resolve()
    assert len(src) == 1797 and src.sample_shape == (1, 8, 8) and src.num_classes == 10
    assert np.bincount(src.labels).tolist() == CLASS_COUNTS
    x, y, skipped = src.read(range(len(src)))
    assert skipped == 0 and x.shape == (1797, 1, 8, 8)
    assert x.min() == 0.0 and x.max() == 1.0
    images, labels = load_digits_arrays()
    # Files are <label>/<index>.png, so the index comes back from the name.
    order = [int(Path(f).stem) for f in src.files]
    np.testing.assert_array_equal(y, labels[order])
    np.testing.assert_allclose(x[:, 0], images[order] / 16.0, atol=0.5 / 255)
    src.close()

"""open_source dispatch on spec class names (loaders.dispatch); the synthetic source itself is in
test_loaders_synthetic.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from loaders import (
    CSVSource,
    IDXSource,
    ImageFolderSource,
    RawBinarySource,
    Source,
    SyntheticSource,
    open_source,
    write_idx,
)


@dataclass(frozen=True)
class ImageFolder:
    root: str
    size: tuple[int, int] | None = None
    mode: str = "RGB"
    layout: str = "CHW"
    labels_csv: str | None = None
    workers: int = 2
    on_error: str = "raise"


@dataclass(frozen=True)
class CSV:
    path: str
    label_column: str | int
    feature_columns: tuple | None = None
    header: bool = True
    chunk_rows: int = 4096
    on_error: str = "raise"


@dataclass(frozen=True)
class RawBinary:
    path: str
    dtype: str
    shape: tuple[int, ...]
    labels_path: str | None = None
    label_dtype: str = "int32"
    on_error: str = "raise"


@dataclass(frozen=True)
class IDX:
    images: str
    labels: str


@dataclass(frozen=True)
class Synthetic:
    task: str = "classification"
    samples: int = 100
    features: tuple[int, ...] = (4,)
    classes: int = 10
    seed: int = 0


@dataclass(frozen=True)
class Parquet:
    path: str


# Every test here reads and writes a fresh user cache, never the real one.
pytestmark = pytest.mark.usefixtures("user_cache")


def test_each_spec_opens_its_source_with_its_settings(tmp_path: Path, closing) -> None:
    (tmp_path / "img" / "a").mkdir(parents=True)
    Image.fromarray(np.full((5, 7, 3), 80, np.uint8)).save(tmp_path / "img" / "a" / "0.png")
    folder = open_source(ImageFolder(str(tmp_path / "img"), size=(4, 4), mode="L", layout="HWC"))
    assert isinstance(folder, ImageFolderSource) and folder.sample_shape == (4, 4, 1)

    (tmp_path / "t.csv").write_text("a,b,y\n1,2,0\n3,4,1\n")
    table = closing(open_source(CSV(str(tmp_path / "t.csv"), "y", feature_columns=("b",))))
    assert isinstance(table, CSVSource) and table.sample_shape == (1,)
    assert table.read([1])[0].tolist() == [[4.0]]

    np.arange(12, dtype=np.uint8).tofile(tmp_path / "r.bin")
    raw = open_source(RawBinary(str(tmp_path / "r.bin"), "uint8", (2, 3)))
    assert isinstance(raw, RawBinarySource) and len(raw) == 2 and raw.sample_shape == (2, 3)

    write_idx(tmp_path / "i.idx", np.ones((3, 2, 2), np.uint8))
    write_idx(tmp_path / "l.idx", np.array([0, 1, 2], np.uint8))
    idx = open_source(IDX(str(tmp_path / "i.idx"), str(tmp_path / "l.idx")))
    assert isinstance(idx, IDXSource) and idx.sample_shape == (1, 2, 2)

    synth = open_source(Synthetic(samples=30, features=(1, 3, 3), classes=3, seed=4))
    assert isinstance(synth, SyntheticSource) and len(synth) == 30 and synth.sample_shape == (1, 3, 3)

    for src in (folder, table, raw, idx, synth):
        assert isinstance(src, Source)
        src.close()


def test_unknown_spec_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="Parquet"):
        open_source(Parquet("x"))


def test_the_real_spec_records_open(tmp_path: Path, closing) -> None:
    spec = pytest.importorskip("flow.spec")
    (tmp_path / "t.csv").write_text("a,b,y\n1,2,0\n3,4,1\n")
    table = closing(
        open_source(spec.CSV(str(tmp_path / "t.csv"), label_column="y", feature_columns=("b", "a")))
    )
    assert table.read([1])[0].tolist() == [[4.0, 3.0]]
    (tmp_path / "img" / "a").mkdir(parents=True)
    Image.fromarray(np.full((5, 7, 3), 80, np.uint8)).save(tmp_path / "img" / "a" / "0.png")
    folder = open_source(spec.ImageFolder(str(tmp_path / "img"), size=[4, 4], layout="HWC"))
    assert folder.sample_shape == (4, 4, 1)  # the spec's default mode is "L"
    synth = open_source(spec.Synthetic(samples=12, features=(2, 3), task="regression"))
    assert synth.sample_shape == (2, 3) and synth.label_dtype == np.float32
    digits = open_source(spec.Digits())
    assert len(digits) == 1797 and digits.sample_shape == (1, 8, 8)

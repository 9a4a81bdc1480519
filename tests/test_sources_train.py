"""Every kind of source streams through the runtime into training: the bundled digits written out
as CSV, raw binary, IDX and an image folder, each trained on the Vulkan device to a held-out
accuracy no model could reach without learning from that source's data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import flow
from flow.spec import (
    CSV,
    IDX,
    Adam,
    CrossEntropy,
    Data,
    Devices,
    Flatten,
    ImageFolder,
    Linear,
    Model,
    Normalize,
    RawBinary,
    RunSettings,
    Spec,
    Split,
)
from loaders import load_digits_arrays, write_idx


def _digits() -> tuple[np.ndarray, np.ndarray]:
    images, labels = load_digits_arrays()
    return images.astype(np.uint8), labels.astype(np.int32)


def _csv(root: Path) -> tuple[CSV, tuple[int, ...]]:
    images, labels = _digits()
    path = root / "digits.csv"
    header = ",".join([f"p{i}" for i in range(64)] + ["digit"])
    rows = [
        ",".join(map(str, [*image.reshape(-1), label])) for image, label in zip(images, labels, strict=True)
    ]
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    return CSV(str(path), label_column="digit"), (64,)


def _raw(root: Path) -> tuple[RawBinary, tuple[int, ...]]:
    images, labels = _digits()
    (root / "x.bin").write_bytes(images.astype(np.float32).tobytes())
    (root / "y.bin").write_bytes(labels.astype(np.int32).tobytes())
    return RawBinary(str(root / "x.bin"), dtype="float32", shape=(8, 8), labels_path=str(root / "y.bin")), (
        8,
        8,
    )


def _idx(root: Path) -> tuple[IDX, tuple[int, ...]]:
    images, labels = _digits()
    write_idx(root / "images.idx", images)
    write_idx(root / "labels.idx", labels.astype(np.uint8))
    return IDX(str(root / "images.idx"), str(root / "labels.idx")), (1, 8, 8)


def _folder(root: Path) -> tuple[ImageFolder, tuple[int, ...]]:
    images, labels = _digits()
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        folder = root / "folder" / f"class_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 15).astype(np.uint8), mode="L").save(folder / f"{index}.png")
    return ImageFolder(str(root / "folder"), mode="L"), (1, 8, 8)


@pytest.mark.parametrize(
    "make", [_csv, _raw, _idx, _folder], ids=["csv", "raw_binary", "idx", "image_folder"]
)
def test_each_source_trains_a_classifier(make, tmp_path, vulkan_backend):
    source, shape = make(tmp_path)
    # Scale each source's pixel range (0..16 for CSV and raw, 0..16/255 for IDX, 0..240/255 for
    # PNGs) to roughly unit size, so one optimiser setting suits all four.
    scale = {"CSV": 16.0, "RawBinary": 16.0, "IDX": 16.0 / 255.0, "ImageFolder": 240.0 / 255.0}[
        type(source).__name__
    ]
    layers = ((Flatten(),) if len(shape) > 1 else ()) + (Linear(64, activation="relu"), Linear(10))
    spec = Spec(
        model=Model(input_shape=shape, layers=layers, loss=CrossEntropy()),
        optimiser=Adam(0.005),
        data=Data(
            source,
            batch_size=64,
            split=Split(train=0.8, val=0.2, stratify=True),
            preprocess=(Normalize((scale / 2,), (scale / 2,)),),
        ),
        devices=Devices(0),
        run=RunSettings(epochs=8),
    )
    result = flow.run(spec)
    assert result.evals[-1].loss < result.evals[0].loss
    assert result.accuracy >= 0.9, result.accuracy  # chance is 0.1

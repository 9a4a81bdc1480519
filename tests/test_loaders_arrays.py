"""The Arrays source: data from Python (numpy arrays in memory) and from .npy / .npz files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import flow
from actors.cpu_backend import CpuBackend
from flow.codec import dumps, load, save
from flow.data_plan import header_of
from flow.errors import SpecError
from flow.spec import (
    Adam,
    Arrays,
    CrossEntropy,
    Data,
    Devices,
    Flatten,
    Linear,
    Model,
    Normalize,
    RunSettings,
    Spec,
    Split,
)
from flow.validation import validate
from loaders import LoaderError, load_digits_arrays, open_source

ROOT = Path(__file__).resolve().parents[1]


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The bundled digits read into arrays: uint8 (n, 1, 8, 8) pixels over 0..255, int64 labels."""
    images, labels = load_digits_arrays()
    x = np.rint(images.astype(np.float32) * (255.0 / 16.0)).astype(np.uint8)[:, None]
    return x, labels.astype(np.int64)


def arrays_spec(source: Arrays, epochs: int = 8, **data) -> Spec:
    return Spec(
        model=Model(input_shape=(1, 8, 8), layers=(Flatten(), Linear(64, activation="relu"), Linear(10)),
                    loss=CrossEntropy()),
        optimiser=Adam(0.003),
        data=Data(source, batch_size=64, split=Split(train=0.8, val=0.2, stratify=True),
                  preprocess=(Normalize((0.5,), (0.5,)),), **data),
        devices=Devices("cpu"),
        run=RunSettings(epochs=epochs),
    )  # fmt: skip


@pytest.mark.parametrize("backend_name", ["cpu", "vulkan"])
@pytest.mark.parametrize("placement", ["auto", "host"])
def test_digits_as_arrays_train_from_python(backend_name, placement, request):
    backend = CpuBackend() if backend_name == "cpu" else request.getfixturevalue("vulkan_backend")
    x, y = digits_arrays()
    result = flow.run(arrays_spec(Arrays(x, y), placement=placement), backend=backend)
    assert result.accuracy is not None and result.accuracy > 0.9, result.accuracy
    assert not result.warnings


def test_the_source_reports_its_header_and_keeps_uint8_on_the_device():
    x, y = digits_arrays()
    source = open_source(Arrays(x, y))
    assert source.in_memory and len(source) == 1797
    header = header_of(source)
    assert header.sample_shape == (1, 8, 8) and header.num_classes == 10 and header.stored_dtype == "uint8"
    stored = source.stored()
    assert stored.x.dtype == np.uint8 and stored.scale == pytest.approx(1 / 255)
    batch, labels, skipped = source.read([5, 0, 5])
    assert skipped == 0 and batch.dtype == np.float32
    assert np.array_equal(batch, x[[5, 0, 5]].astype(np.float32) * np.float32(1 / 255))
    assert np.array_equal(labels, y[[5, 0, 5]])
    into_x, into_y = np.zeros((4, 1, 8, 8), np.float32), np.zeros(4, np.int32)
    assert source.read_into([5, 0, 5], into_x, into_y) == (3, 0)
    assert np.array_equal(into_x[:3], batch) and np.array_equal(into_y[:3], labels)
    planned = flow.plan(arrays_spec(Arrays(x, y)), header=header)
    assert planned.data.resident is not None and planned.data.resident.dtype == "uint8"


def test_float_arrays_and_regression_targets():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 6))
    targets = rng.standard_normal((50, 2))
    source = open_source(Arrays(x, targets))
    assert source.num_classes is None and header_of(source).label_shape == (2,)
    assert source.stored_dtype is None  # targets are not class ids: streamed
    batch, labels, _ = source.read([3])
    assert np.allclose(batch, x[[3]]) and labels.shape == (1, 2)


def test_a_saved_spec_refers_to_npz_and_npy_files(tmp_path):
    x, y = digits_arrays()
    np.savez(tmp_path / "digits.npz", x=x, y=y)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    for source in (Arrays(path=str(tmp_path / "digits.npz")),
                   Arrays(str(tmp_path / "x.npy"), str(tmp_path / "y.npy"))):  # fmt: skip
        opened = open_source(source)
        assert len(opened) == 1797 and opened.read([7])[0].shape == (1, 1, 8, 8)
        assert np.array_equal(opened.labels, y)
        spec = arrays_spec(source, epochs=3)
        save(spec, tmp_path / "spec.json")
        assert load(tmp_path / "spec.json") == spec
    assert not open_source(Arrays(str(tmp_path / "x.npy"), str(tmp_path / "y.npy"))).in_memory  # mapped
    save(arrays_spec(Arrays(path=str(tmp_path / "digits.npz")), epochs=3), tmp_path / "spec.json")
    done = subprocess.run([sys.executable, "-m", "flow", "run", str(tmp_path / "spec.json")],
                          capture_output=True, text=True, cwd=ROOT, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_missing_files_and_keys_are_loader_errors(tmp_path):
    with pytest.raises(LoaderError, match="cannot read"):
        open_source(Arrays(path=str(tmp_path / "absent.npz")))
    np.savez(tmp_path / "d.npz", x=np.zeros((3, 2)), labels=np.zeros(3, np.int64))
    with pytest.raises(LoaderError, match=r"has no array 'y' \(it holds x, labels\)"):
        open_source(Arrays(path=str(tmp_path / "d.npz")))
    np.savez(tmp_path / "nan.npz", x=np.array([[1.0], [np.nan]]), y=np.array([0, 1]))
    with pytest.raises(LoaderError, match="x 1 samples hold NaN or infinity, the first sample 1"):
        open_source(Arrays(path=str(tmp_path / "nan.npz")))


GOOD_X = np.zeros((4, 3), np.float32)
GOOD_Y = np.array([0, 1, 0, 1])
NAN_X = GOOD_X.copy()
NAN_X[2, 1] = np.inf


@pytest.mark.parametrize(
    "source, message",
    [
        (Arrays(GOOD_X, GOOD_Y[:3]), "data.source.y: has 3 labels for 4 samples in x"),
        (Arrays(GOOD_X.astype(np.complex64), GOOD_Y), "data.source.x: must hold real numbers, got dtype c"),
        (Arrays(GOOD_X.astype(object), GOOD_Y), "data.source.x: must hold real numbers, got dtype object"),
        (Arrays(np.array(["a"] * 4)[:, None], GOOD_Y), "data.source.x: must hold real numbers, got dtype <U"),
        (Arrays(NAN_X, GOOD_Y), "data.source.x: 1 samples hold NaN or infinity, the first sample 2"),
        (Arrays(GOOD_X, GOOD_Y * 1.0), "data.source.y: class ids must be integers, got dtype float64"),
        (Arrays(GOOD_X, GOOD_Y - 1), "data.source.y: class ids must be >= 0, got -1 at sample 0"),
        (Arrays(GOOD_X[:, 0], GOOD_Y), "data.source.x: must be [n, *sample_shape] with n > 0, got shape (4"),
        (Arrays(GOOD_X), "data.source.y: is required"),
        (Arrays(GOOD_X, "y.npy"), "data.source: x and y must both be arrays or both be file names"),
        (Arrays(GOOD_X, GOOD_Y, path="d.npz"), "data.source.x: must be None when path is given"),
        (Arrays([[1.0]], GOOD_Y), "data.source.x: must be an array or a string or None"),
    ],
)
def test_bad_arrays_are_refused_with_their_path_and_values(source, message):
    spec = Spec(model=Model(input_shape=(3,), layers=(Linear(2),), loss=CrossEntropy()),
                optimiser=Adam(0.01), data=Data(source))  # fmt: skip
    problems = [str(p) for p in validate(spec)]
    assert any(p.startswith(message) for p in problems), problems
    with pytest.raises(SpecError):  # validated before the run opens anything
        flow.run(spec)


def test_a_spec_holding_arrays_in_memory_cannot_be_saved(tmp_path):
    spec = arrays_spec(Arrays(*digits_arrays()))
    for write in (lambda: save(spec, tmp_path / "spec.json"), lambda: dumps(spec)):
        with pytest.raises(SpecError, match=r"data.source.x: holds an array in memory.*np.savez"):
            write()
    assert not (tmp_path / "spec.json").exists() or (tmp_path / "spec.json").read_text() == ""


def test_arrays_records_compare_by_identity_and_hash():
    x, y = digits_arrays()
    assert Arrays(x, y) == Arrays(x, y) and Arrays(x, y) != Arrays(x.copy(), y)
    assert hash(arrays_spec(Arrays(x, y))) == hash(arrays_spec(Arrays(x, y)))
    assert Arrays(path="a.npz") == Arrays(path="a.npz") != Arrays(path="b.npz")


def test_a_specs_digest_sees_every_byte_of_its_arrays(rng):
    """What MPI ranks compare: a repr elides a large array's middle, the digest does not."""
    from flow.codec import digest

    x = rng.standard_normal((3000, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 3000)
    changed = x.copy()
    changed[1500, 0, 4, 4] += 1.0
    same, other = arrays_spec(Arrays(x.copy(), y.copy())), arrays_spec(Arrays(changed, y))
    assert repr(same) == repr(other)  # why repr was not enough
    assert digest(arrays_spec(Arrays(x, y))) == digest(same)
    assert digest(other) != digest(same)
    assert digest(arrays_spec(Arrays(x, y), epochs=9)) != digest(same)

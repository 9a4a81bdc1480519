"""Raw binary records (memmap) and the IDX format: round trips and bad files."""

from __future__ import annotations

import gzip
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from loaders import IDXSource, LoaderError, RawBinarySource, binary, read_idx, write_idx


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
@pytest.mark.parametrize("suffix", [".idx", ".idx.gz"])
def test_idx_round_trip(tmp_path: Path, dtype: type, suffix: str, user_cache: Path) -> None:
    rng = np.random.default_rng(3)
    info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else None
    if info is not None:
        data = rng.integers(info.min, info.max, (7, 3, 5), endpoint=True).astype(dtype)
    else:
        data = rng.standard_normal((7, 3, 5)).astype(dtype)
    path = tmp_path / f"a{suffix}"
    write_idx(path, data)
    back = read_idx(path)
    assert back.shape == data.shape and back.dtype.newbyteorder("=") == np.dtype(dtype).newbyteorder("=")
    np.testing.assert_array_equal(back, data)


def test_a_gz_file_is_decompressed_once_and_read_from_the_cache(tmp_path, user_cache, caplog, monkeypatch):
    rng = np.random.default_rng(11)
    first, second = (rng.integers(0, 256, (9, 5, 3), dtype=np.uint8) for _ in range(2))
    path = tmp_path / "images.idx.gz"
    write_idx(path, first)
    np.testing.assert_array_equal(read_idx(path), first)
    copies = sorted((user_cache / "vkflow" / "idx").glob("*.idx"))
    assert len(copies) == 1 and copies[0].read_bytes() == gzip.decompress(path.read_bytes())
    with monkeypatch.context() as patch:  # read again from the copy: no decompression
        patch.setattr(binary.gzip, "open", lambda *a, **k: pytest.fail("decompressed again"))
        np.testing.assert_array_equal(read_idx(path), first)
    assert sorted((user_cache / "vkflow" / "idx").glob("*.idx")) == copies
    # A new file at the same path (another size or mtime) gets its own copy; the old one goes.
    write_idx(path, second[:7])
    np.testing.assert_array_equal(read_idx(path), second[:7])
    now = sorted((user_cache / "vkflow" / "idx").glob("*.idx"))
    assert len(now) == 1 and now != copies
    # A damaged copy is made again from the file.
    now[0].write_bytes(now[0].read_bytes()[:-5])
    np.testing.assert_array_equal(read_idx(path), second[:7])
    assert now[0].read_bytes() == gzip.decompress(path.read_bytes())
    # A bad .gz is named, and nothing of it is kept.
    (tmp_path / "bad.idx.gz").write_bytes(b"not gzip at all")
    with pytest.raises(LoaderError, match="bad.idx.gz"):
        read_idx(tmp_path / "bad.idx.gz")
    assert len(list((user_cache / "vkflow" / "idx").glob("*.idx"))) == 1
    # Where no copy can be kept, the data is still read, with a warning.
    user_cache.mkdir(exist_ok=True)
    (user_cache / "file").write_text("")
    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, "vkflow"):
        patch.setenv("VKFLOW_CACHE", str(user_cache / "file"))
        np.testing.assert_array_equal(read_idx(path), second[:7])
    assert "cannot keep a decompressed copy" in caplog.text


def test_the_least_recently_used_copies_go_when_the_cache_is_full(tmp_path, user_cache, monkeypatch):
    rng = np.random.default_rng(12)
    files = []
    for name in "abc":
        files.append(tmp_path / f"{name}.idx.gz")
        write_idx(files[-1], rng.integers(0, 256, (50, 10), dtype=np.uint8))  # 508 bytes decompressed
    monkeypatch.setattr(binary, "IDX_CACHE_BYTES", 1100)  # two copies fit, not three
    folder = user_cache / "vkflow" / "idx"
    read_idx(files[0])
    (a_copy,) = folder.glob("*.idx")
    read_idx(files[1])
    (b_copy,) = set(folder.glob("*.idx")) - {a_copy}
    os.utime(a_copy, (1, 1))  # a's copy last used long ago
    read_idx(files[2])
    left = set(folder.glob("*.idx"))
    assert len(left) == 2 and a_copy not in left and b_copy in left


def test_idx_header_is_mnist_big_endian(tmp_path: Path) -> None:
    write_idx(tmp_path / "l.idx", np.array([1, 2, 3], dtype=np.uint8))
    assert (tmp_path / "l.idx").read_bytes() == bytes([0, 0, 0x08, 1, 0, 0, 0, 3, 1, 2, 3])
    write_idx(tmp_path / "i.idx", np.array([[258]], dtype=np.int32))
    assert (tmp_path / "i.idx").read_bytes() == bytes([0, 0, 0x0C, 2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 2])


def test_idx_rejects_bad_files(tmp_path: Path) -> None:
    write_idx(tmp_path / "ok.idx", np.arange(12, dtype=np.uint8).reshape(3, 4))
    good = (tmp_path / "ok.idx").read_bytes()
    (tmp_path / "short.idx").write_bytes(good[:-1])
    (tmp_path / "magic.idx").write_bytes(b"\x01\x00" + good[2:])
    (tmp_path / "type.idx").write_bytes(b"\x00\x00\x0a" + good[3:])
    (tmp_path / "empty.idx").write_bytes(b"")
    for name, why in [
        ("short", "size 23 bytes"),
        ("magic", "not an IDX file"),
        ("type", "type code 0x0a"),
        ("empty", "not an IDX file"),
    ]:
        with pytest.raises(LoaderError, match=why) as info:
            read_idx(tmp_path / f"{name}.idx")
        assert f"{name}.idx" in str(info.value)
    with pytest.raises(ValueError, match="IDX cannot hold dtype int64"):
        write_idx(tmp_path / "x.idx", np.zeros(3, dtype=np.int64))


def test_idx_source_is_mnist_shaped(tmp_path: Path, user_cache: Path) -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (10, 4, 6), dtype=np.uint8)
    labels = (np.arange(10) % 4).astype(np.uint8)
    write_idx(tmp_path / "img.idx", images)
    write_idx(tmp_path / "lab.idx.gz", labels)
    src = IDXSource(tmp_path / "img.idx", tmp_path / "lab.idx.gz")
    assert len(src) == 10 and src.sample_shape == (1, 4, 6) and src.num_classes == 4
    assert src.label_dtype == np.int32
    x, y, skipped = src.read([9, 2])
    assert skipped == 0 and y.tolist() == [1, 2]
    np.testing.assert_allclose(x[:, 0], images[[9, 2]] / 255.0, atol=1e-7)
    write_idx(tmp_path / "few.idx", labels[:9])
    with pytest.raises(LoaderError, match="few.idx"):
        IDXSource(tmp_path / "img.idx", tmp_path / "few.idx")


def test_raw_binary_records_and_labels(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    data = rng.standard_normal((9, 2, 3)).astype("<f4")
    data.tofile(tmp_path / "x.bin")
    labels = rng.integers(0, 5, 9).astype(np.int32)
    labels.tofile(tmp_path / "y.bin")
    src = RawBinarySource(tmp_path / "x.bin", "<f4", (2, 3), labels_path=tmp_path / "y.bin")
    assert len(src) == 9 and src.sample_shape == (2, 3) and src.num_classes == int(labels.max()) + 1
    x, y, _ = src.read([4, 0, 4])
    np.testing.assert_array_equal(x, data[[4, 0, 4]])
    np.testing.assert_array_equal(y, labels[[4, 0, 4]])
    assert src.statistics().bytes_read == 3 * 24 and src.statistics().samples_read == 3
    np.save(tmp_path / "t.npy", np.linspace(0, 1, 9, dtype=np.float32))
    reg = RawBinarySource(tmp_path / "x.bin", "float32", (6,), labels_path=tmp_path / "t.npy")
    assert reg.label_dtype == np.float32 and reg.num_classes is None and reg.sample_shape == (6,)
    unlabelled = RawBinarySource(tmp_path / "x.bin", "float32", (6,))
    assert unlabelled.labels.tolist() == [-1] * 9 and unlabelled.num_classes is None
    labels[:8].tofile(tmp_path / "y8.bin")
    with pytest.raises(LoaderError, match="8 labels for 9 records"):
        RawBinarySource(tmp_path / "x.bin", "<f4", (2, 3), labels_path=tmp_path / "y8.bin")


def test_raw_binary_partial_record_and_nan_follow_the_policy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = np.arange(5 * 4, dtype=np.float32).reshape(5, 4) + 1
    data[2, 1] = np.nan
    (tmp_path / "x.bin").write_bytes(data.tobytes() + b"\x00\x01")
    with pytest.raises(LoaderError, match=r"x\.bin: size 82 is not a whole number of 16-byte records"):
        RawBinarySource(tmp_path / "x.bin", np.float32, (4,))
    with caplog.at_level(logging.WARNING, logger="vkflow.loaders"):
        src = RawBinarySource(tmp_path / "x.bin", np.float32, (4,), on_error="skip")
        x, _, skipped = src.read(range(5))
    assert len(src) == 5 and skipped == 1 and src.statistics().skipped == 2
    np.testing.assert_array_equal(x, data[[0, 1, 3, 4]])
    assert len([r for r in caplog.records if r.name == "vkflow.loaders"]) == 1
    (tmp_path / "y.bin").write_bytes(data.tobytes())
    strict = RawBinarySource(tmp_path / "y.bin", np.float32, (4,))
    np.testing.assert_array_equal(strict.read([0, 4])[0], data[[0, 4]])
    with pytest.raises(LoaderError, match=r"y\.bin: record 2: contains NaN"):
        strict.read([1, 2])


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "float32"])
def test_raw_binary_follows_the_one_input_convention(tmp_path: Path, rng, dtype: str) -> None:
    """uint8 records arrive in [0, 1] (/ 255), as IDX and image files do, so that no source needs a
    Scale(1/255); every other dtype arrives as stored."""
    top = {"uint8": 256, "uint16": 65536, "int16": 32768, "float32": 1000}[dtype]
    data = rng.integers(0, top, (6, 4, 5)).astype(dtype)
    data.tofile(tmp_path / "x.bin")
    x, _, _ = RawBinarySource(tmp_path / "x.bin", dtype, (4, 5)).read([5, 0, 3])
    expected = data[[5, 0, 3]].astype(np.float64) / (255.0 if dtype == "uint8" else 1.0)
    np.testing.assert_allclose(x, expected, rtol=1e-7)
    if dtype == "uint8":
        assert 0.0 <= x.min() and x.max() <= 1.0 and x.max() > 0.5

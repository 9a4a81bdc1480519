"""The image folder's decoded-pixel cache (loaders.image_cache): cached reads give the very bits a
decode gives; a second open decodes nothing; a changed folder, a corrupt or a stale cache is decoded
again (with a warning, never trusted); bad files keep their on_error behaviour; and a run on a
cached folder keeps the pixels on the device and learns, through the real Vulkan driver."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import flow
import loaders.image_folder
from flow.data_plan import header_of
from flow.spec import SGD, CrossEntropy, Data, Flatten, ImageFolder, Linear, Model, RunSettings, Spec, Split
from loaders import ImageFolderSource, LoaderError, open_source
from loaders.image_cache import CACHE_VERSION

# Every test reads and writes a fresh user cache, never the real one.
pytestmark = pytest.mark.usefixtures("user_cache")


def png_folder(root: Path, rng: np.random.Generator, per_class=(4, 3, 5), side=(13, 7), grey=False) -> Path:
    """root/<class>/<i>.png: random pixels of an odd size, RGB (or grey) with some grey and RGBA
    files among them, so that the decode converts modes."""
    for c, count in enumerate(per_class):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(count):
            img = Image.fromarray(rng.integers(0, 256, (*side, 3), dtype=np.uint8))
            img = img.convert("L" if grey else ("RGB", "L", "RGBA")[i % 3])
            img.save(root / f"class{c}" / f"{i:02d}.png")
    return root


def cache_files(user_cache: Path) -> list[str]:
    folder = user_cache / "vkflow" / "images"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on a decode fails the test: what is read must come from the cache."""

    def refuse(*args, **kwargs):
        raise AssertionError("decoded an image with the cache present")

    monkeypatch.setattr(loaders.image_folder, "decode_pixels", refuse)


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA"])
@pytest.mark.parametrize("layout", ["CHW", "HWC"])
@pytest.mark.parametrize("size", [None, (6, 9)])
def test_cached_reads_are_the_decoded_reads_bit_for_bit(tmp_path, rng, mode, layout, size):
    root = png_folder(tmp_path / "d", rng)
    decoded = ImageFolderSource(root, size=size, mode=mode, layout=layout, workers=2)
    cached = ImageFolderSource(root, size=size, mode=mode, layout=layout, workers=3, cache="auto")
    assert not cached.cache_reused and cached.in_memory and not decoded.in_memory
    assert decoded.read_into is None and decoded.stored_dtype is None and decoded.stored() is None
    order = [*rng.permutation(len(decoded)).tolist(), 2, 2, 11]
    x, y, skipped = decoded.read(order)
    cx, cy, cskipped = cached.read(order)
    assert skipped == cskipped == 0 and cx.dtype == np.float32 and cx.shape == x.shape
    assert cx.tobytes() == x.tobytes() and cy.tolist() == y.tolist()
    # In place, into larger arrays of the loader's kind (a float label slot), rows first.
    into_x = np.full((len(order) + 3, *cached.sample_shape), -1.0, np.float32)
    into_y = np.full(len(order) + 3, -1.0, np.float32)
    assert cached.read_into(order, into_x, into_y) == (len(order), 0)
    assert into_x[: len(order)].tobytes() == x.tobytes() and (into_x[len(order) :] == -1).all()
    np.testing.assert_array_equal(into_y[: len(order)], y)
    with pytest.raises(ValueError, match=f"{root}: {len(order)} samples of shape .* do not fit arrays"):
        cached.read_into(order, into_x[:5], into_y)
    # As stored for the device: uint8, and what the resident path computes gives read's bits.
    stored = cached.stored()
    assert cached.stored_dtype == "uint8" and stored.x.dtype == np.uint8 and not stored.x.flags.writeable
    assert stored.x.shape == (len(decoded), *decoded.sample_shape)
    resident = stored.x[order] * np.float32(stored.scale)
    assert resident.dtype == np.float32 and resident.tobytes() == x.tobytes()
    np.testing.assert_array_equal(stored.labels, decoded.labels)


def test_a_second_open_decodes_nothing_and_maps_the_same_pixels(tmp_path, rng, monkeypatch, user_cache):
    root = png_folder(tmp_path / "d", rng)
    first = ImageFolderSource(root, mode="RGB", cache="auto")
    assert first.statistics().decode_seconds > 0  # the decode at open is counted
    expected = first.read(range(len(first)))[0]
    assert len(cache_files(user_cache)) == 2  # the array and its record, in the user cache only
    assert not [p for p in root.rglob("*") if p.suffix in (".npy", ".json")]
    no_decoding(monkeypatch)
    second = ImageFolderSource(root, mode="RGB", cache="auto", workers=4)
    assert second.cache_reused and second.statistics().decode_seconds == 0
    assert second.cache_file.is_relative_to(user_cache / "vkflow" / "images") and second.cache_file.is_file()
    assert second.read(range(len(second)))[0].tobytes() == expected.tobytes()
    # Another layout is another cache: decoding it is refused here.
    with pytest.raises(AssertionError, match="decoded an image"):
        ImageFolderSource(root, mode="RGB", layout="HWC", cache="auto")
    # A cache larger than RAM's share is mapped, not read in: still no decode, not in_memory.
    monkeypatch.setattr(loaders.image_folder, "_IN_RAM_BYTES", 10)
    mapped = ImageFolderSource(root, mode="RGB", cache="auto")
    assert mapped.cache_reused and not mapped.in_memory and mapped.stored_dtype == "uint8"
    assert mapped.read(range(len(mapped)))[0].tobytes() == expected.tobytes()


def test_an_added_or_changed_file_is_decoded_again(tmp_path, rng, user_cache, caplog):
    root = png_folder(tmp_path / "d", rng)
    before = ImageFolderSource(root, cache="auto")
    Image.fromarray(rng.integers(0, 256, (13, 7), dtype=np.uint8)).save(root / "class1" / "new.png")
    with caplog.at_level(logging.WARNING, logger="vkflow"):
        grown = ImageFolderSource(root, cache="auto")
    assert not grown.cache_reused and len(grown) == len(before) + 1
    assert any("is stale" in r.getMessage() for r in caplog.records)
    # Rewritten in place, same size (the directory's mtime does not change, so the manifest is
    # reused): the file's own mtime tells.
    path = root / "class0" / "01.png"
    stat = path.stat()
    changed = np.full((13, 7), 77, np.uint8)
    Image.fromarray(changed).save(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    again = ImageFolderSource(root, cache="auto")
    assert not again.cache_reused
    x = again.read([again.files.index("class0/01.png")])[0]
    np.testing.assert_array_equal(x[0, 0], changed / np.float32(255))
    assert x.tobytes() == ImageFolderSource(root).read([again.files.index("class0/01.png")])[0].tobytes()
    assert len(cache_files(user_cache)) == 2  # the older caches of this folder are gone
    assert ImageFolderSource(root, cache="auto").cache_reused


def _truncate(array: Path, record: Path) -> None:
    array.write_bytes(array.read_bytes()[:-10])


def _wrong_header(array: Path, record: Path) -> None:
    array.write_bytes(b"\x93NUMPY garbage" + array.read_bytes()[14:])


def _grown(array: Path, record: Path) -> None:
    array.write_bytes(array.read_bytes() + b"\0" * 64)


def _record_not_json(array: Path, record: Path) -> None:
    record.write_text("{ not json")


def _record_other_version(array: Path, record: Path) -> None:
    record.write_text(json.dumps({**json.loads(record.read_text()), "version": CACHE_VERSION + 1}))


def _array_missing(array: Path, record: Path) -> None:
    array.unlink()


@pytest.mark.parametrize(
    "damage", [_truncate, _wrong_header, _grown, _record_not_json, _record_other_version, _array_missing]
)
def test_a_corrupt_cache_is_ignored_with_a_warning_and_rebuilt(tmp_path, rng, user_cache, caplog, damage):
    root = png_folder(tmp_path / "d", rng)
    expected = ImageFolderSource(root, mode="RGBA", cache="auto").read(range(12))[0]
    folder = user_cache / "vkflow" / "images"
    (array,) = folder.glob("*.npy")
    damage(array, array.with_suffix(".json"))
    with caplog.at_level(logging.WARNING, logger="vkflow"):
        rebuilt = ImageFolderSource(root, mode="RGBA", cache="auto")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("is corrupt" in w and "decoding again" in w for w in warnings), warnings
    assert not rebuilt.cache_reused and rebuilt.read(range(12))[0].tobytes() == expected.tobytes()
    assert ImageFolderSource(root, mode="RGBA", cache="auto").cache_reused


def broken_folder(root: Path, rng: np.random.Generator) -> Path:
    png_folder(root, rng, grey=True)
    (root / "class1" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"cut short")
    (root / "class2" / "empty.png").write_bytes(b"")
    return root


def test_bad_files_under_skip_are_recorded_and_skipped_on_every_read(tmp_path, rng, monkeypatch, caplog):
    root = broken_folder(tmp_path / "d", rng)
    decoded = ImageFolderSource(root, on_error="skip")
    cached = ImageFolderSource(root, on_error="skip", cache="auto")
    order = rng.permutation(len(decoded)).tolist() * 2
    x, y, skipped = decoded.read(order)
    cx, cy, cskipped = cached.read(order)
    assert skipped == cskipped == 4 and cx.tobytes() == x.tobytes() and cy.tolist() == y.tolist()
    assert cached.statistics().skipped_items == 2 and cached.statistics().skipped == 4
    assert sorted(cached.statistics().skipped_examples) == sorted(decoded.statistics().skipped_examples)
    into_x = np.empty((len(order), 1, 13, 7), np.float32)
    into_y = np.empty(len(order), np.int32)
    assert cached.read_into(order, into_x, into_y) == (len(order) - 4, 4)
    assert into_x[: len(order) - 4].tobytes() == x.tobytes()
    # Bad items cannot go to the device as stored: such a source streams, through on_error.
    assert cached.stored_dtype is None and cached.stored() is None
    no_decoding(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="vkflow"):
        again = ImageFolderSource(root, on_error="skip", cache="auto")
        assert again.cache_reused and again.read(order)[2] == 4
    assert any("broken.png" in r.getMessage() for r in caplog.records)  # the skip warning names it
    raising = ImageFolderSource(root, cache="auto")  # the bad items are raised when read, not at open
    good = [i for i, name in enumerate(raising.files) if "broken" not in name and "empty" not in name]
    assert raising.read(good)[2] == 0
    with pytest.raises(LoaderError) as info:
        raising.read([good[0], raising.files.index("class2/empty.png")])
    assert info.value.where == str(root / "class2" / "empty.png") and "empty file" in info.value.why


def test_a_folder_that_cannot_be_cached_reads_by_decoding(tmp_path, rng, monkeypatch, user_cache):
    root = png_folder(tmp_path / "d", rng, grey=True)
    too_big = ImageFolderSource(root, cache="auto", cache_bytes=100)
    assert too_big.read_into is None and too_big.stored_dtype is None and not cache_files(user_cache)
    # A file that cannot be read now (permissions, a network disk) may read later: no cache.
    real = loaders.image_folder.read_file

    def flaky(path, size=None):
        if path.endswith(os.path.join("class0", "03.png")):
            raise LoaderError(path, "cannot read file (Input/output error)")
        return real(path, size)

    monkeypatch.setattr(loaders.image_folder, "read_file", flaky)
    flaky_open = ImageFolderSource(root, cache="auto", on_error="skip")
    assert flaky_open.read_into is None and not cache_files(user_cache)
    assert flaky_open.read(range(len(flaky_open)))[2] == 1
    monkeypatch.undo()
    # More than 8 bits a sample would lose precision in uint8: not cached.
    Image.fromarray(np.full((13, 7), 40000, np.uint16)).save(root / "class0" / "deep.png")
    deep = ImageFolderSource(root, cache="auto")
    assert deep.read_into is None and not cache_files(user_cache)
    with pytest.raises(ValueError, match="cache must be 'auto' or 'off', got 'on'"):
        ImageFolderSource(root, cache="on")


def test_the_spec_caches_by_default_and_the_plan_keeps_the_pixels_on_the_device(tmp_path, rng):
    root = png_folder(tmp_path / "d", rng, grey=True)
    source = open_source(ImageFolder(str(root)))
    assert source.stored_dtype == "uint8" and source.read_into is not None
    assert open_source(ImageFolder(str(root), cache="off")).stored_dtype is None
    planned = flow.plan(brightness_spec(root), header=header_of(source))
    on_device = planned.as_dict()["data"]["on_device"]
    assert on_device["dtype"] == "uint8" and on_device["bytes"] == 12 * 13 * 7
    streamed = brightness_spec(root, cache="off")
    assert flow.plan(streamed, header=header_of(open_source(streamed.data.source))).data.resident is None
    problems = flow.validate(brightness_spec(root, cache="sometimes"))
    assert [problem.path for problem in problems] == ["data.source.cache"]


def brightness_spec(root: Path, epochs: int = 3, **source) -> Spec:
    return Spec(
        model=Model(input_shape=(1, 13, 7), layers=(Flatten(), Linear(16, activation="relu"), Linear(4)),
                    loss=CrossEntropy()),
        optimiser=SGD(lr=0.1, momentum=0.9),
        data=Data(ImageFolder(str(root), **source), batch_size=32, split=Split(train=0.8, val=0.2)),
        run=RunSettings(epochs=epochs, metrics_file=str(root.parent / "metrics.jsonl")),
    )  # fmt: skip


def test_a_run_on_a_cached_folder_keeps_the_pixels_on_the_device(tmp_path, rng, vulkan_backend, monkeypatch):
    """Four classes by brightness as PNG files; the run opens the folder's cache (decoding
    nothing), plans the pixels onto the device and never reads a batch on the host."""
    root = tmp_path / "bright"
    for c in range(4):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(60):
            pixels = rng.integers(0, 120, (13, 7)) + 40 * c
            Image.fromarray(pixels.astype(np.uint8)).save(root / f"c{c}" / f"{i:02d}.png")
    spec = brightness_spec(root, epochs=8)
    header = header_of(open_source(spec.data.source))  # decodes the folder into its cache
    assert flow.plan(spec, header=header, facts=vulkan_backend.facts).data.resident is not None
    no_decoding(monkeypatch)

    def no_host_reads(*args, **kwargs):
        raise AssertionError("a batch was read on the host")

    monkeypatch.setattr(ImageFolderSource, "_from_cache", no_host_reads)
    result = flow.run(spec, backend=vulkan_backend)
    losses = [json.loads(line)["loss"] for line in Path(spec.run.metrics_file).read_text().splitlines()
              if json.loads(line).get("event") == "step"]  # fmt: skip
    assert result.steps == 8 * 6 and result.evals[-1].samples == 48
    assert np.mean(losses[-3:]) < 0.7 * losses[0]
    assert result.evals[-1].accuracy > 0.6  # chance is 0.25

"""The text source: its vocabularies, windows that are exactly slices of the file at both levels,
contiguous splits with no window reaching across a boundary, a seeded shuffle that repeats, every
bad file named before a device is touched, the vocabulary kept in checkpoints, and specs with Text
that round-trip through msgpack and JSON. The corpus is the standard library's own
``pydoc_data/topics.py`` (UTF-8 with a few non-ASCII characters), so nothing is downloaded."""

from __future__ import annotations

import dataclasses
import os
import pydoc_data
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

import flow
from actors import checkpoint as checkpoints
from actors.checkpoint import Checkpoint
from actors.messages import Cursor, Snapshot
from flow.codec import dumps, load, loads, save
from flow.data_plan import header_of, plan_data
from flow.errors import SpecError
from flow.preflight import preflight
from flow.spec import (
    SGD,
    CrossEntropy,
    Data,
    Embedding,
    Linear,
    Model,
    RunSettings,
    Spec,
    Split,
    Text,
)
from flow.validation import validate
from loaders import LoaderError, SamplerState, open_source
from loaders.splits import split_contiguous
from loaders.text import BYTES, TextSource, decode, encode, vocabulary

CORPUS = Path(os.path.dirname(pydoc_data.__file__)) / "topics.py"


@pytest.fixture(scope="module")
def text() -> str:
    return CORPUS.read_text(encoding="utf-8")


@pytest.fixture
def excerpt(tmp_path, text) -> Path:
    """A piece of the corpus with non-ASCII characters in it (multi-byte in UTF-8)."""
    start = text.index("“") - 3000
    path = tmp_path / "excerpt.txt"
    path.write_text(text[start : start + 6000], encoding="utf-8")
    return path


def text_spec(source: Text, vocab: int, per_token: bool = False, **data) -> Spec:
    """A spec on ``source``: per token (Embedding then Linear: (context, vocab) scores), or one
    score row a sample (valid as a spec, refused against Text's per-token labels)."""
    layers = (Embedding(vocab, 8), Linear(vocab)) if per_token else (Linear(vocab),)
    return Spec(
        model=Model(input_shape=(source.context,), layers=layers, loss=CrossEntropy()),
        optimiser=SGD(0.1),
        data=Data(source, **data),
        run=RunSettings(steps=5),
    )


def test_the_vocabulary_is_the_sorted_distinct_characters_or_every_byte(text):
    chars = vocabulary(CORPUS)
    assert chars == "".join(sorted(set(text))) and "’" in chars
    assert vocabulary(CORPUS, "byte") == BYTES == bytes(range(256))
    piece = text[:2000] + "“quoted” …"
    for vocab in (chars, BYTES):
        ids = encode(piece, vocab)
        assert ids.dtype == np.int32 and decode(ids, vocab) == piece
        assert decode(ids.astype(np.float32), vocab) == piece  # inputs are float32 ids
    assert encode("ab", chars).tolist() == [chars.index("a"), chars.index("b")]
    with pytest.raises(ValueError, match="not in the vocabulary: '☃'"):
        encode("a☃", chars)


@pytest.mark.parametrize("level", ["char", "byte"])
@pytest.mark.parametrize("stride", [1, 5, 32])
def test_windows_are_slices_of_the_file(excerpt, level, stride, rng):
    raw = excerpt.read_bytes()
    vocab = vocabulary(excerpt, level)
    ids = np.frombuffer(raw, np.uint8) if level == "byte" else encode(raw.decode("utf-8"), vocab)
    assert level == "byte" or ids.size < len(raw)  # multi-byte characters are one token each
    context = 32
    source = open_source(Text(str(excerpt), level=level, context=context, stride=stride))
    assert isinstance(source, TextSource) and source.vocabulary == vocab
    assert len(source) == (ids.size - context - 1) // stride + 1
    assert source.sample_shape == (context,) and source.num_classes == len(vocab)
    assert source.labels.shape == (len(source), context) and source.label_dtype == np.int32
    last = (len(source) - 1) * stride + context  # the last window's label reaches the end or near it
    assert last < ids.size <= last + stride
    indices = [0, len(source) - 1, *rng.integers(0, len(source), 20).tolist()]
    x, y, skipped = source.read(indices)
    assert skipped == 0 and x.dtype == np.float32 and y.dtype == np.int32
    assert x.shape == y.shape == (len(indices), context)
    for row, i in enumerate(indices):
        start = i * stride
        np.testing.assert_array_equal(x[row], ids[start : start + context])
        np.testing.assert_array_equal(y[row], ids[start + 1 : start + context + 1])
        np.testing.assert_array_equal(source.labels[i], y[row])
    assert decode(x[0], vocab) == decode(ids[:context], vocab)
    with pytest.raises(IndexError):
        source.read([len(source)])


def test_splits_are_contiguous_and_no_window_reaches_across(excerpt):
    parts = split_contiguous(100, 0.8, 0.1, 0.1, gap=3)
    assert parts["train"].tolist() == list(range(77))
    assert parts["val"].tolist() == list(range(80, 87)) and parts["test"].tolist() == list(range(90, 100))
    assert split_contiguous(10, 1.0, 0.0, 0.0, gap=4)["train"].tolist() == list(range(10))
    for stride in (1, 4, 16):
        source = Text(str(excerpt), context=16, stride=stride)
        opened = open_source(source)
        spec = text_spec(source, opened.num_classes, per_token=True, split=Split(train=0.9, val=0.1))
        splits = plan_data(spec, header_of(opened)).splits
        train, val = splits["train"], splits["val"]
        assert train.tolist() == list(range(train.size)) and val.tolist() == list(range(val[0], len(opened)))
        assert abs(val.size - 0.1 * len(opened)) <= 1  # the last tenth validates
        # Tokens a window touches (input and label): none of a training window's is a validation one's.
        assert int(train[-1]) * stride + 16 < int(val[0]) * stride
        assert (int(train[-1]) + 1) * stride + 16 >= int(val[0]) * stride  # and no more is left out


def test_the_shuffle_is_seeded_and_stays_in_the_training_split(excerpt):
    source = Text(str(excerpt), context=16)
    opened = open_source(source)

    def epochs(seed: int) -> list[list[int]]:
        spec = text_spec(source, opened.num_classes, True, split=Split(train=0.8, val=0.2), seed=seed)
        sampler = plan_data(spec, header_of(opened)).sampler("train")
        return [sampler.shard(epoch).tolist() for epoch in (0, 1)]

    first = epochs(3)
    assert first == epochs(3) and first != epochs(4) and first[0] != first[1]
    train = plan_data(text_spec(source, opened.num_classes, True, split=Split(train=0.8, val=0.2)),
                      header_of(opened)).splits["train"]  # fmt: skip
    assert sorted(first[0]) == sorted(first[1]) == train.tolist()
    # A resume mid-epoch draws exactly the batches the uninterrupted run would have.
    sampler = plan_data(text_spec(source, opened.num_classes, True), header_of(opened)).sampler("train")
    whole = [b.tolist() for _, b in islice(sampler.batches(SamplerState(1, 0)), 12)]
    resumed = [b.tolist() for _, b in islice(sampler.batches(SamplerState(1, 3)), 9)]
    assert resumed == whole[3:]


def test_bad_files_are_named_before_any_device_work(tmp_path):
    def problems(path: Path, context: int = 8, level: str = "char") -> list[str]:
        found, _ = preflight(text_spec(Text(str(path), level=level, context=context), 4))
        return [f"{p.path}: {p.message}" for p in found]

    missing = tmp_path / "missing.txt"
    (empty := tmp_path / "empty.txt").write_bytes(b"")
    (short := tmp_path / "short.txt").write_text("abcdefgh")  # 8 tokens: a window of 8 needs 9
    (latin := tmp_path / "latin1.txt").write_bytes("abc café and more text".encode("latin-1"))
    assert problems(missing) == [f"data.source: {missing}: cannot read text file (No such file or directory)"]
    assert problems(empty) == [f"data.source: {empty}: the text file is empty"]
    assert problems(short) == [
        f"data.source: {short}: 8 tokens at level 'char': too short for one window of context 8 "
        "(needs context + 1 = 9)"
    ]
    [bad] = problems(latin)
    assert bad.startswith(f"data.source: {latin}: not UTF-8: byte 0xe9 at offset 7 ")
    assert "level='byte'" in bad
    assert not [p for p in problems(latin, level="byte") if p.startswith("data.source")]  # bytes are bytes
    with pytest.raises(LoaderError, match="empty"):
        vocabulary(empty)
    # The record's own values: every problem at once, each at its path.
    spec = text_spec(Text("", context=0, stride=-2), 4)
    assert {(p.path, p.message) for p in validate(spec)} >= {
        ("data.source.path", "must not be empty, got ''"),
        ("data.source.context", "must be > 0, got 0"),
        ("data.source.stride", "must be > 0, got -2"),
    }
    stratified = text_spec(Text("a.txt", context=8), 4, split=Split(train=0.5, val=0.5, stratify=True))
    assert [p.path for p in validate(stratified)] == ["data.split.stratify"]


def test_one_label_a_sample_is_refused_against_per_token_labels(excerpt):
    source = Text(str(excerpt), context=16)
    vocab = len(vocabulary(excerpt))
    found, about = preflight(text_spec(source, vocab))
    assert about is not None and f"{vocab} classes" in about
    assert [(p.path, p.message) for p in found] == [
        ("model.loss", f"CrossEntropy needs one class id per row of the model's output ({vocab},), but the "
                       "source gives class ids of shape (16,) a sample"),
    ]  # fmt: skip
    assert preflight(text_spec(source, vocab, per_token=True))[0] == []


def test_checkpoints_keep_the_vocabulary(tmp_path, excerpt):
    source = Text(str(excerpt), context=16)
    spec = text_spec(source, len(vocabulary(excerpt)), per_token=True)
    opened = open_source(source)
    state = {"params:all": np.arange(6, dtype=np.float32)}
    snap = Snapshot(Cursor(4, 0, 4), state, final=True)
    made = checkpoints.from_snapshot(spec, snap, {"kind": "SGD", "state": []})
    assert made.vocabulary == opened.vocabulary == vocabulary(excerpt)
    excerpt.write_text("changed after opening")  # the run's vocabulary is the one it opened
    assert checkpoints.from_snapshot(spec, snap, {"kind": "SGD", "state": []}).vocabulary == made.vocabulary
    path = checkpoints.save(tmp_path / "char", made)
    assert checkpoints.load(path).vocabulary == made.vocabulary
    assert checkpoints.read_vocabulary(tmp_path / "char") == made.vocabulary
    byte_spec = dataclasses.replace(spec, data=Data(dataclasses.replace(source, level="byte")))
    as_bytes = checkpoints.from_snapshot(byte_spec, snap, {"kind": "SGD", "state": []})
    checkpoints.save(tmp_path / "byte", as_bytes)
    assert checkpoints.read_vocabulary(tmp_path / "byte") == BYTES
    # Another source writes no vocabulary: the key is absent, as in checkpoints written before it.
    plain = Checkpoint(spec=spec, cursor=Cursor(1, 0, 1), state=state)
    checkpoints.save(tmp_path / "plain", dataclasses.replace(plain, spec=text_spec_without_text()))
    assert b"vocabulary" not in checkpoints.latest(tmp_path / "plain").read_bytes()
    assert checkpoints.read_vocabulary(tmp_path / "plain") is None


def text_spec_without_text() -> Spec:
    from flow.spec import Synthetic

    return Spec(
        model=Model(input_shape=(4,), layers=(Linear(3),), loss=CrossEntropy()),
        optimiser=SGD(0.1),
        data=Data(Synthetic(samples=32, features=(4,), classes=3)),
    )


def test_a_spec_with_text_round_trips_through_msgpack_and_json(tmp_path):
    spec = text_spec(Text("data/input.txt", level="byte", context=64, stride=64), 256, per_token=True)
    assert loads(dumps(spec)) == spec and dumps(loads(dumps(spec))) == dumps(spec)
    save(spec, tmp_path / "spec.json")
    assert load(tmp_path / "spec.json") == spec
    assert '"kind": "Text"' in (tmp_path / "spec.json").read_text()
    defaults = text_spec(Text("input.txt"), 65)
    assert loads(dumps(defaults)).data.source == Text("input.txt", level="char", context=128, stride=1)
    with pytest.raises(SpecError, match="data.source.level"):
        loads(dumps(defaults).replace(b"char", b"word"))


def test_a_text_spec_with_a_per_token_model_plans(excerpt):
    """The data side of a language model: (context,) float32 ids in, (context,) int32 ids as labels.
    The model side (per-token cross-entropy) is planned where it exists."""
    source = Text(str(excerpt), context=16)
    opened = open_source(source)
    spec = text_spec(source, opened.num_classes, per_token=True, split=Split(train=0.9, val=0.1))
    header = header_of(opened)
    assert header.sample_shape == (16,) and header.label_shape == (16,) and header.split_gap == 16
    try:
        planned = flow.plan(spec, header=header)
    except Exception as error:  # noqa: BLE001 - whatever the model side lacks today, the data side is done
        pytest.skip(f"per-token models are not planned yet: {str(error).splitlines()[0]}")
    assert planned.data.splits["val"][-1] == len(opened) - 1


def test_a_language_model_trains_on_text_and_resumes_exactly(tmp_path):
    """Where the model side exists (per-token CrossEntropy on the CPU backend): the validation loss
    falls, every checkpoint holds the vocabulary, and a resume continues on the exact same batches."""
    from flow.runner import run
    from flow.spec import Adam
    from flow.testing import FakeDevice

    source = Text(str(CORPUS), context=16, stride=16)
    vocab = len(vocabulary(CORPUS))
    spec = dataclasses.replace(
        text_spec(source, vocab, per_token=True, split=Split(train=0.9, val=0.1), batch_size=32),
        optimiser=Adam(0.01),
        run=RunSettings(steps=40, eval_every=20, checkpoint_dir=str(tmp_path), checkpoint_every=20,
                        keep_checkpoints=None),
    )  # fmt: skip
    try:
        whole = run(spec, backend=FakeDevice())
    except Exception as error:  # noqa: BLE001 - whatever the model side lacks today
        pytest.skip(f"per-token models do not train yet: {str(error).splitlines()[0]}")
    first, last = whole.evals
    assert last.loss < first.loss < np.log(vocab)
    assert checkpoints.read_vocabulary(tmp_path / "step-00000020.ckpt") == vocabulary(CORPUS)
    (tmp_path / "step-00000040.ckpt").unlink()  # else it would shadow the resumed run's
    resumed = run(resume=tmp_path / "step-00000020.ckpt", backend=FakeDevice())
    assert resumed.resumed_from == 20 and resumed.loss == whole.loss

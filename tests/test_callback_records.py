"""Callbacks as spec records (``RunSettings.callbacks``), driven as a user drives them: a spec file
on disk that asks for EarlyStopping stops a ``python -m flow run`` early with a checkpoint; SaveBest
keeps ``best.ckpt`` holding exactly the weights of the best validation round (the regular
checkpoint of that step, bit for bit), whatever ``keep_checkpoints`` removes, while resume and
predict keep taking the newest regular checkpoint; predicting from ``best.ckpt`` scores that round's
accuracy on the validation split; a record that cannot work is refused with one message naming its
path; records round-trip through files, and a file without them is written as before."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from run_checks import assert_same_weights
from specs import DIGITS, ROOT, digits

import flow
from actors import checkpoint as checkpoints
from flow.data_plan import header_of, plan_data
from flow.spec import EarlyStopping, SaveBest, Split, TopK
from loaders import open_source


def lines(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def flow_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flow", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def with_callbacks(spec, *records, **run):
    return dataclasses.replace(spec, run=dataclasses.replace(spec.run, callbacks=records, **run))


def test_early_stopping_in_a_spec_file_stops_a_cli_run_with_a_checkpoint(tmp_path):
    folder = tmp_path / "run"
    # No round can improve on the first by 100: the second round (step 10) stops the run.
    spec = with_callbacks(digits(tmp_path, "run", epochs=3, eval_every=5, checkpoint_every=None),
                          EarlyStopping(patience=1, min_delta=100.0))  # fmt: skip
    path = tmp_path / "spec.json"
    flow.save(spec, path)
    assert '"kind": "EarlyStopping"' in path.read_text()

    done = flow_cli("run", str(path), "--quiet")
    assert done.returncode == 0, done.stderr
    events = lines(folder)
    stopped = [e for e in events if e["event"] == "stopped"]
    assert [e["step"] for e in stopped] == [10] and "val_loss did not improve" in stopped[0]["reason"]
    assert [e["step"] for e in events if e["event"] == "eval"] == [5, 10]
    assert max(e["step"] for e in events if e["event"] == "step") < 69  # 3 epochs are 69 steps
    saved = checkpoints.load(folder)  # the stop's checkpoint, which a resume continues
    assert 10 <= saved.cursor.step < 69 and saved.spec.run.callbacks == spec.run.callbacks


def save_best_run(tmp_path: Path, name: str, keep: int | None):
    spec = digits(tmp_path, name, epochs=3, eval_every=5, checkpoint_every=5, keep_checkpoints=keep)
    spec = with_callbacks(spec, SaveBest(monitor="val_accuracy"))
    result = flow.run(spec)
    return spec, result, Path(spec.run.checkpoint_dir)


def test_save_best_keeps_the_best_rounds_weights_through_retention_and_predicts_its_accuracy(tmp_path):
    spec, result, folder = save_best_run(tmp_path, "all", keep=None)
    events = lines(folder)
    rounds = [(e["step"], e["accuracy"]) for e in events if e["event"] == "eval" and e["split"] == "val"]
    # The rounds that beat every earlier one, as Keras' save_best_only saves them.
    improved, best = [], -1.0
    for step, accuracy in rounds:
        if accuracy > best:
            improved.append(step)
            best = accuracy
    best_step = improved[-1]
    best_lines = [e for e in events if e["event"] == "best"]
    assert [e["step"] for e in best_lines] == improved
    assert best_lines[-1]["value"] == best and best_lines[-1]["path"] == str(folder / "best.ckpt")
    assert len(improved) >= 2  # a real choice: more than the first round improved

    kept = checkpoints.load(folder / "best.ckpt")
    regular = checkpoints.load(folder / checkpoints.file_name(best_step))
    assert kept.cursor == regular.cursor
    assert_same_weights(kept.state, regular.state)

    # Predicting from best.ckpt scores that round's accuracy on the validation split.
    source = open_source(spec.data.source)
    val = plan_data(spec, header_of(source)).splits["val"]
    images, labels, _ = source.read(val)  # as stored: predict applies the spec's preprocess
    probabilities = flow.predict(folder / "best.ckpt", images)
    assert np.mean(probabilities.argmax(axis=1) == labels) == pytest.approx(best, abs=0.5 / len(val))
    final = flow.predict(folder, images)  # the directory: its newest regular checkpoint (step 69)
    assert np.mean(final.argmax(axis=1) == labels) == pytest.approx(rounds[-1][1], abs=0.5 / len(val))

    # keep_checkpoints=1 removes every older step-*.ckpt, never best.ckpt; the run is deterministic,
    # so its best.ckpt holds the same weights. Resume and predict still take the newest regular one.
    _, kept_run, kept_folder = save_best_run(tmp_path, "one", keep=1)
    assert sorted(p.name for p in kept_folder.glob("*.ckpt")) == ["best.ckpt", "step-00000069.ckpt"]
    assert_same_weights(checkpoints.load(kept_folder / "best.ckpt").state, kept.state)
    assert checkpoints.load(kept_folder).cursor.step == 69 == kept_run.steps == result.steps


def test_a_resumed_save_best_goes_on_comparing_with_the_round_best_ckpt_holds(tmp_path):
    """mode "max" on val_loss makes the first round (the highest loss) the best for good: after a
    resume, no later round may replace best.ckpt, as none would in the straight run."""
    spec = digits(tmp_path, "run", epochs=3, eval_every=5, checkpoint_every=5, keep_checkpoints=None)
    spec = with_callbacks(spec, SaveBest(monitor="val_loss", mode="max"))
    flow.run(dataclasses.replace(spec, run=dataclasses.replace(spec.run, steps=20)))
    folder = Path(spec.run.checkpoint_dir)
    before = checkpoints.load(folder / "best.ckpt")
    flow.run(spec, resume=folder)
    best_lines = [e for e in lines(folder) if e["event"] == "best"]
    assert [e["step"] for e in best_lines] == [5]  # the first round, and nothing after the resume
    assert checkpoints.load(folder / "best.ckpt").cursor == before.cursor == checkpoints.load(
        folder / checkpoints.file_name(5)).cursor  # fmt: skip


@pytest.mark.parametrize(
    "records, run, split, path, words",
    [
        (
            (SaveBest(),),
            {"checkpoint_dir": None, "checkpoint_every": None},
            None,
            "run.callbacks[0]",
            "checkpoint_dir",
        ),
        ((EarlyStopping(monitor="val_top5"),), {}, None, "run.callbacks[0].monitor", "model.metrics"),
        ((EarlyStopping(), SaveBest(monitor="loss")), {}, None, "run.callbacks[1].monitor", "'loss'"),
        ((EarlyStopping(),), {}, Split(train=1.0), "run.callbacks[0].monitor", "data.split.val is 0.0"),
        ((EarlyStopping(patience=-1),), {}, None, "run.callbacks[0].patience", "-1"),
        ((SaveBest(), SaveBest(monitor="val_accuracy")), {}, None, "run.callbacks[1]", "second SaveBest"),
    ],
)
def test_a_bad_record_is_refused_with_one_message_naming_its_path(tmp_path, records, run, split, path, words):
    spec = with_callbacks(digits(tmp_path), *records, **run)
    if split is not None:
        spec = dataclasses.replace(spec, data=dataclasses.replace(spec.data, split=split))
    problems = flow.validate(spec)
    assert [p.path for p in problems] == [path] and words in problems[0].message
    file = tmp_path / "bad.json"
    flow.save(spec, file)
    done = flow_cli("run", str(file), "--quiet")
    assert done.returncode == 1 and path in done.stderr and words in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "a").exists()


def test_records_round_trip_and_a_file_without_them_is_written_as_before(tmp_path):
    model = dataclasses.replace(flow.load(DIGITS).model, metrics=(TopK(3),))
    stopping = EarlyStopping(monitor="val_top3", patience=2, mode="max", min_delta=0.01)
    spec = dataclasses.replace(with_callbacks(flow.load(DIGITS), stopping, SaveBest()), model=model)
    assert flow.validate(spec) == []
    for name in ("spec.json", "spec.msgpack"):
        flow.save(spec, tmp_path / name)
        assert flow.load(tmp_path / name) == spec
    assert flow.loads(flow.dumps(spec)) == spec
    # A schema-2 file from before callbacks: loaded and saved again, byte for byte the same.
    flow.save(flow.load(DIGITS), tmp_path / "old.json")
    assert (tmp_path / "old.json").read_bytes() == DIGITS.read_bytes()
    assert "callbacks" not in DIGITS.read_text()

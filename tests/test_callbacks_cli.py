"""flow.CSVLogger and the ``run`` command's callback flags, as a user meets them: the CSV holds one
row per validation round whose values are the metrics file's (the training columns are the mean of
the steps since the previous row), each row is on disk as soon as it is written, a resumed run
appends under the same header, and the file parses with csv.DictReader, on the CPU backend and on
Vulkan. ``--quiet`` draws no progress line and logs nothing, ``--early-stopping MONITOR:PATIENCE``
stops a plateau and says so in one summary line, a bad value is one ``error:`` line and exit 2,
and ``--csv`` writes the file."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from specs import image_spec, synthetic_spec

import flow
from flow.callbacks import Callback, CSVLogger, EarlyStopping
from flow.codec import save as save_spec
from flow.run_command import main_run
from flow.runner import run
from flow.spec import Adam, Normalize, Split

ROOT = Path(__file__).resolve().parents[1]
HEADER = ["epoch", "step", "loss", "accuracy", "val_loss", "val_accuracy", "lr", "elapsed"]


def metrics(spec) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(spec.run.metrics_file).read_text().splitlines()]


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        rows = list(reader)
        assert reader.fieldnames == HEADER
    return rows


def expected_rows(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows the metrics file's lines call for: each validation round, with the mean training
    loss and accuracy of the steps since the previous round and the last step's learning rate."""
    rows, steps = [], []
    for line in lines:
        if line["event"] == "run":  # a resumed process starts its means anew
            steps = []
        elif line["event"] == "step":
            steps.append(line)
        elif line["event"] == "eval" and line["split"] == "val":
            rows.append(
                {
                    "epoch": line["epoch"],
                    "step": line["step"],
                    "loss": sum(s["loss"] for s in steps) / len(steps),
                    "accuracy": sum(s["accuracy"] for s in steps) / len(steps),
                    "val_loss": line["loss"],
                    "val_accuracy": line["accuracy"],
                    "lr": steps[-1]["lr"],
                }
            )
            steps = []
    return rows


def assert_rows_match(path: Path, lines: list[dict[str, Any]]) -> list[dict[str, str]]:
    rows = read_csv(path)
    expected = expected_rows(lines)
    assert len(rows) == len(expected) > 0
    for row, want in zip(rows, expected, strict=True):
        assert (int(row["epoch"]), int(row["step"])) == (want["epoch"], want["step"])
        # The validation values are the file's to the last bit (a float's repr round-trips).
        assert float(row["val_loss"]) == want["val_loss"]
        assert float(row["val_accuracy"]) == want["val_accuracy"]
        assert float(row["lr"]) == want["lr"]
        assert float(row["loss"]) == pytest.approx(want["loss"], rel=1e-12)
        assert float(row["accuracy"]) == pytest.approx(want["accuracy"], rel=1e-12)
        assert float(row["elapsed"]) >= 0
    return rows


class OnDisk(Callback):
    """After each validation round, reads the CSV from disk (as a killed run would leave it)."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen = path, []

    def on_eval(self, record) -> None:
        if record["split"] == "val":
            self.seen.append(record["step"])
            rows = read_csv(self.path)  # whole rows already, each ending in a newline
            assert [int(r["step"]) for r in rows] == self.seen
            assert self.path.read_text().endswith("\n")


# -- CSVLogger ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("eval_every", [None, 5])
def test_csv_rows_are_the_metrics_files_validation_rounds_and_on_disk_at_once(tmp_path, eval_every):
    spec = synthetic_spec(tmp_path, eval_every=eval_every)
    spec = dataclasses.replace(
        spec, data=dataclasses.replace(spec.data, split=Split(train=0.7, val=0.2, test=0.1))
    )
    path = tmp_path / "log.csv"
    on_disk = OnDisk(path)
    result = run(spec, callbacks=[flow.CSVLogger(path), on_disk])

    lines = metrics(spec)
    rows = assert_rows_match(path, lines)
    if eval_every is None:  # Keras' rows: one per epoch
        assert [int(r["epoch"]) for r in rows] == [0, 1, 2] and result.epochs == 3
    else:
        assert [int(r["step"]) for r in rows] == [5, 10, 15, 20, 25, 30, 33] and result.steps == 33
    # The test split's round is in the metrics file, not a row.
    assert [line["split"] for line in lines if line["event"] == "eval"][-1] == "test"
    assert on_disk.seen == [int(r["step"]) for r in rows]


def test_csv_on_vulkan_matches_the_metrics_file(tmp_path, vulkan_backend):
    spec = synthetic_spec(tmp_path, eval_every=4, epochs=1)
    path = tmp_path / "log.csv"
    result = run(spec, backend=vulkan_backend, callbacks=[CSVLogger(path)])
    assert result.device == vulkan_backend.facts.name
    rows = assert_rows_match(path, metrics(spec))
    assert [int(r["step"]) for r in rows] == [4, 8, 12, 13]  # and at the end


def test_csv_appends_across_a_resume_and_replaces_without_append(tmp_path):
    spec = synthetic_spec(tmp_path / "a", eval_every=4)
    path = tmp_path / "log.csv"
    stopped = run(spec, callbacks=[CSVLogger(path), EarlyStopping(patience=1, min_delta=100.0)])
    assert stopped.stopped_at == 8 and [r["step"] for r in read_csv(path)] == ["4", "8"]

    resumed = run(spec, resume=spec.run.checkpoint_dir, callbacks=[CSVLogger(path, append=True)])
    assert resumed.resumed_from == stopped.steps and resumed.stopped_early is None
    text = path.read_text()
    assert text.count("epoch,step") == 1  # one header
    rows = assert_rows_match(path, metrics(spec))  # both processes' rounds, in order
    assert [int(r["step"]) for r in rows][:2] == [4, 8] and int(rows[-1]["step"]) == 39

    # Without append a run replaces the file (as Keras' does).
    fresh = synthetic_spec(tmp_path / "b", eval_every=10)
    run(fresh, callbacks=[CSVLogger(path)])
    assert [int(r["step"]) for r in assert_rows_match(path, metrics(fresh))] == [10, 20, 30, 39]


def test_csv_appended_to_another_header_keeps_its_columns(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("step,val_loss\n0,9.5\n")
    spec = synthetic_spec(tmp_path, epochs=1)
    run(spec, callbacks=[CSVLogger(path, append=True)])
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))
    [eval_line] = [line for line in metrics(spec) if line["event"] == "eval"]
    assert rows == [
        {"step": "0", "val_loss": "9.5"},
        {"step": str(eval_line["step"]), "val_loss": repr(eval_line["loss"])},
    ]


def test_csv_without_a_validation_split_is_refused_and_writes_nothing(tmp_path):
    spec = synthetic_spec(tmp_path)
    spec = dataclasses.replace(spec, data=dataclasses.replace(spec.data, split=Split(train=1.0)))
    with pytest.raises(ValueError, match=r"CSVLogger\(.*no validation samples.*data.split.val"):
        run(spec, callbacks=[CSVLogger(tmp_path / "log.csv")])
    assert not (tmp_path / "log.csv").exists()


# -- the command line ------------------------------------------------------------------------------


def flow_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flow", "run", *args], capture_output=True, text=True, cwd=ROOT, check=False
    )


def plateau(tmp_path: Path) -> Path:
    """A spec whose validation loss cannot move (Adam at 1e-30): every round equals the first."""
    spec = dataclasses.replace(synthetic_spec(tmp_path, eval_every=3), optimiser=Adam(1e-30))
    tmp_path.mkdir(exist_ok=True)
    save_spec(spec, tmp_path / "spec.json")
    return tmp_path / "spec.json"


class Terminal(io.StringIO):
    """A stderr that says it is a TTY, so the progress line is drawn unless the command says not."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("quiet", [False, True])
def test_quiet_draws_no_progress_line_but_prints_the_summary(tmp_path, capsys, monkeypatch, quiet):
    save_spec(image_spec(tmp_path, epochs=2), tmp_path / "spec.json")
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main_run([str(tmp_path / "spec.json"), *(["--quiet"] if quiet else [])]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "steps: 20 (epochs 2)" in out and out[-1].startswith("accuracy: 0.")
    if quiet:
        assert terminal.getvalue() == ""
    else:  # the line the flag silences: the bar and the evaluations above it
        assert "\r20/20 |" in terminal.getvalue()  # the tqdm bar (tests/test_progress.py)
        assert "val loss" in terminal.getvalue()


def test_quiet_leaves_warnings_to_the_summary(tmp_path):
    # Inputs scaled to nothing: the run warns on stderr, and in the summary.
    runs = []
    for name in ("loud", "quiet"):
        spec = image_spec(tmp_path / name, epochs=1)
        tiny = (Normalize((0.0,), (1e6,)),)
        spec = dataclasses.replace(spec, data=dataclasses.replace(spec.data, preprocess=tiny))
        save_spec(spec, tmp_path / f"{name}.json")
        runs.append(flow_run(str(tmp_path / f"{name}.json"), *(["--quiet"] if name == "quiet" else [])))
    loud, quiet = runs
    assert loud.returncode == 0, loud.stderr
    assert "vkflow: the inputs are tiny" in loud.stderr
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert any(line.startswith("warning: the inputs are tiny") for line in quiet.stdout.splitlines())


def test_early_stopping_flag_stops_a_plateau_and_says_so_in_one_line(tmp_path):
    done = flow_run(
        str(plateau(tmp_path)), "--early-stopping", "val_loss:0", "--csv", str(tmp_path / "log.csv")
    )
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stdout.splitlines() if "stopped early" in line]
    assert said == [
        "stopped early after step 6: val_loss did not improve for 1 evaluation(s) "
        f"(best {float(read_csv(tmp_path / 'log.csv')[0]['val_loss']):.6g} at step 3)"
    ]
    lines = metrics(flow.load(tmp_path / "spec.json"))
    assert [line["step"] for line in lines if line["event"] == "stopped"] == [6]
    # --csv wrote the rounds up to the one that stopped the run.
    assert [int(r["step"]) for r in assert_rows_match(tmp_path / "log.csv", lines)] == [3, 6]

    # Without the flag the same spec runs to its end: the flag made the difference.
    whole = flow_run(str(plateau(tmp_path / "whole")))
    assert whole.returncode == 0 and "stopped early" not in whole.stdout
    assert "steps: 39 (epochs 3)" in whole.stdout


@pytest.mark.parametrize(
    "value, expected",
    [
        ("val_loss", "--early-stopping takes MONITOR:PATIENCE (e.g. val_loss:3), got 'val_loss'"),
        ("val_loss:x", "got 'val_loss:x'"),
        ("val_loss:-1", "got 'val_loss:-1'"),
        ("val_loss:1.5", "got 'val_loss:1.5'"),
        (
            "loss:3",
            "--early-stopping: EarlyStopping monitor must be 'val_loss' or 'val_accuracy', got 'loss'",
        ),
    ],
)
def test_a_bad_early_stopping_value_is_one_error_line_and_exit_2(tmp_path, value, expected):
    done = flow_run(str(plateau(tmp_path)), "--early-stopping", value)
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("error: ") and expected in line
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before the run


def test_csv_flag_writes_the_file_and_a_resume_appends(tmp_path, capsys):
    spec_file = plateau(tmp_path)
    csv_file = tmp_path / "log.csv"
    assert main_run([str(spec_file), "--csv", str(csv_file), "--early-stopping", "val_loss:1"]) == 0
    assert [int(r["step"]) for r in read_csv(csv_file)] == [3, 6]
    assert main_run([str(spec_file), "--csv", str(csv_file), "--resume", str(tmp_path / "ckpt")]) == 0
    lines = metrics(flow.load(spec_file))
    rows = assert_rows_match(csv_file, lines)
    # The resumed run goes on from its checkpoint (the stop's, after the steps in flight).
    resumed = [line["step"] for line in lines if line["event"] == "run"][1]
    assert 6 <= resumed < 39
    assert [int(r["step"]) for r in rows] == [3, 6, *range(resumed + 3 - resumed % 3, 40, 3)]
    capsys.readouterr()
    # A file that cannot be written is the user's mistake: one error line, exit 1.
    nowhere = tmp_path / "no" / "log.csv"
    assert main_run([str(plateau(tmp_path / "other")), "--csv", str(nowhere)]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and str(nowhere) in line

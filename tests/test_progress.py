"""actors.progress: on a terminal a tqdm bar that never passes the terminal's width and leaves no
stale bar around the evaluation lines printed above it; off a terminal a plain line per epoch (or
every ``every_s`` seconds) whose numbers are the metrics file's; a data-parallel run shows each
device's samples/s; ``run --quiet`` prints neither; the rate is the samples in its window over its
span."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from specs import image_spec

import flow
from actors.progress import Progress, ProgressState, Rate, eta_seconds, plain_line
from flow.codec import save as save_spec
from flow.spec import Devices

ROOT = Path(__file__).resolve().parents[1]


def screen(output: str) -> list[str]:
    """What a terminal shows after ``output``: ``\\r`` returns to the line's start, characters
    overwrite those under them, ``\\n`` starts a new line."""
    lines, column = [[]], 0
    for char in output:
        if char == "\r":
            column = 0
        elif char == "\n":
            lines.append([])
            column = 0
        else:
            line = lines[-1]
            line[column : column + 1] = [char]
            column += 1
    return ["".join(line).rstrip() for line in lines]


def metrics(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_the_bar_fits_the_terminal_and_evaluations_print_cleanly_above_it():
    out = io.StringIO()
    bar = Progress(out, mode="bar", width=80)
    state = ProgressState(step=30, total=690, samples_per_second=5120.4, loss=0.43214, accuracy=0.95,
                          elapsed=10.0, done_at_start=10, epoch=0, devices=(2600.2, 2520.7))  # fmt: skip
    bar.update(state)
    note = "step 23  epoch 0  val loss 0.3141  accuracy 0.9210"
    bar.note(note)
    bar.update(dataclasses.replace(state, step=690, loss=0.1))
    bar.close()
    shown = screen(out.getvalue())
    assert max(len(line) for line in out.getvalue().replace("\r", "\n").split("\n")) <= 80  # never wraps
    assert shown[0] == note  # above the bar, with nothing of the bar left on its line
    assert shown[1].startswith("690/690 |") and "loss 0.1000  acc 0.9500  5120 samples/s" in shown[1]
    assert shown[2:] == [""]  # closed: later output starts on a fresh line
    wide = io.StringIO()
    Progress(wide, mode="bar", width=200).update(state)
    assert screen(wide.getvalue())[0].endswith("5120 samples/s  per device 2600, 2521")


def test_plain_lines_and_the_eta():
    state = ProgressState(step=30, total=120, samples_per_second=5120.4, loss=0.43214, accuracy=0.95,
                          elapsed=10.0, done_at_start=10, epoch=2)  # fmt: skip
    assert eta_seconds(state) == pytest.approx(45.0)
    assert plain_line(state) == (
        "step 30/120  epoch 2  elapsed 00:10  ETA 00:45  loss 0.4321  acc 0.9500  5120 samples/s"
    )
    assert "ETA --:--" in plain_line(dataclasses.replace(state, step=10))
    silent = io.StringIO()
    off = Progress(silent, enabled=False)
    assert off.mode == "off" and not off.due(force=True)
    off.note("nothing")
    assert silent.getvalue() == ""
    assert Progress(io.StringIO()).mode == "lines"  # not a terminal


def test_off_a_terminal_a_run_prints_a_line_per_epoch_with_the_metrics_files_numbers(tmp_path):
    spec = image_spec(tmp_path, epochs=3)
    out = io.StringIO()
    result = flow.run(spec, progress=Progress(out))
    lines = out.getvalue().splitlines()
    steps = {r["step"]: r for r in metrics(spec.run.metrics_file) if r["event"] == "step"}
    progress = [line for line in lines if line.startswith("step ") and "/30" in line]
    # One line as epochs 1 and 2 begin (the first step of each: 11 and 21 done), one at the end.
    assert [line.split()[1] for line in progress] == ["11/30", "21/30", "30/30"]
    for line in progress:
        done = int(line.split()[1].split("/")[0])
        assert f"epoch {steps[done - 1]['epoch']}" in line
        assert f"loss {steps[done - 1]['loss']:.4f}" in line
    vals = [r for r in metrics(spec.run.metrics_file) if r["event"] == "eval"]
    assert [line for line in lines if "val loss" in line] == [
        f"step {r['step']}  epoch {r['epoch']}  val loss {r['loss']:.4f}  accuracy {r['accuracy']:.4f}"
        for r in vals
    ]
    assert len(vals) == 3 and result.steps == 30


def test_every_s_prints_lines_between_epochs_and_a_data_parallel_run_shows_each_device(tmp_path):
    spec = image_spec(tmp_path, epochs=1)
    spec = dataclasses.replace(spec, devices=Devices(("cpu", "cpu"), drop_slow=False))
    out = io.StringIO()
    flow.run(spec, progress=Progress(out, every_s=0.0))
    progress = [line for line in out.getvalue().splitlines() if "/10  " in line]
    assert [line.split()[1] for line in progress] == [f"{done}/10" for done in range(1, 11)]
    speeds = re.search(r"per device ([0-9]+), ([0-9]+)$", progress[-1])
    assert speeds and all(int(v) > 0 for v in speeds.groups())
    last = [r for r in metrics(spec.run.metrics_file) if "statistics" in r][-1]
    assert len(last["statistics"]["device"]["member_samples_per_s"]) == 2


@pytest.mark.parametrize("quiet", [False, True])
def test_the_run_command_prints_progress_lines_to_a_pipe_unless_quiet(tmp_path, quiet):
    save_spec(image_spec(tmp_path, epochs=2), tmp_path / "spec.json")
    done = subprocess.run(
        [sys.executable, "-m", "flow", "run", str(tmp_path / "spec.json"), *(["--quiet"] if quiet else [])],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("accuracy: 0.")
    if quiet:
        assert done.stderr == ""
    else:
        lines = done.stderr.splitlines()
        assert any(line.startswith("step 20/20  epoch 1  ") for line in lines)
        assert sum(" val loss " in line for line in lines) == 2 and "\r" not in done.stderr


def test_the_rate_is_the_samples_in_its_window_over_its_span(rng):
    for window in (0, 1, 3, 20):
        rate, marks, when = Rate(window), [], 0.0
        for _ in range(100):
            when += float(rng.uniform(0.001, 0.01))
            samples = int(rng.integers(0, 64))
            marks.append((when, samples))
            kept = marks[-(window + 1) :]
            span = kept[-1][0] - kept[0][0]
            expected = sum(s for _, s in kept[1:]) / span if len(kept) > 1 and span > 0 else 0.0
            assert rate.add(when, samples) == pytest.approx(expected, rel=1e-9)

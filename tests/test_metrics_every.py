"""RunSettings.metrics_every: one metrics line per N training steps holding each field as an array
(actors.sink.steps_record), read back as per-step records (step_lines, the report): the same values
as a line per step, every step kept, the lines' order kept, a bad value refused by validation."""

from __future__ import annotations

import dataclasses
import json

import pytest
from specs import digits, digits_spec

import flow
from flow.metrics import step_lines
from flow.report import read_events
from flow.spec import TopK
from flow.validation import validate

PER_STEP = ("step", "epoch", "loss", "accuracy", "lr", "top3")


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _steps(records):
    return [{k: r[k] for k in PER_STEP} for r in records if r["event"] == "step"]


@pytest.mark.parametrize("every", [4, 7, 50])
def test_a_line_per_n_steps_holds_every_step_and_reads_back_as_step_lines(tmp_path, every):
    # 23 steps an epoch, 2 epochs, an evaluation after each: N = 4 and 7 do not divide an epoch, so
    # the steps before each evaluation are written before its line; N = 50 holds a whole run.
    def with_top3(spec):
        model = dataclasses.replace(spec.model, metrics=(TopK(3),))
        return dataclasses.replace(spec, model=model)

    one = with_top3(digits(tmp_path, "one", epochs=2, checkpoint_every=None))
    many = with_top3(digits(tmp_path, "many", epochs=2, checkpoint_every=None, metrics_every=every))
    flow.run(one)
    flow.run(many)
    per_step, held = _lines(tmp_path / "one" / "metrics.jsonl"), _lines(tmp_path / "many" / "metrics.jsonl")
    chunks = [r for r in held if r["event"] == "steps"]
    assert not any(r["event"] == "step" for r in held)
    # A line holds N steps, fewer only where another line (each epoch's evaluation) comes next.
    assert [len(c["step"]) for c in chunks] == {4: [4] * 5 + [3], 7: [7, 7, 7, 2], 50: [23]}[every] * 2
    expanded = [line for r in held for line in step_lines(r)]
    # The CPU backend computes the same steps either way: the values match exactly.
    assert _steps(expanded) == _steps(per_step) and len(_steps(expanded)) == 46
    # Every other line keeps its place among the steps.
    order = [(r["event"], r.get("step")) for r in per_step if r["event"] not in ("run",)]
    assert [(r["event"], r.get("step")) for r in expanded if r["event"] != "run"] == order
    last_step = [r for r in expanded if r["event"] == "step"][-1]
    assert "statistics" in chunks[0] and "statistics" in last_step  # the first and the last step
    assert _steps(read_events(tmp_path / "many" / "metrics.jsonl")) == _steps(per_step)


def test_metrics_every_must_be_positive():
    spec = digits_spec()
    spec = dataclasses.replace(spec, run=dataclasses.replace(spec.run, metrics_every=0))
    assert [(p.path, p.message) for p in validate(spec)] == [("run.metrics_every", "must be > 0, got 0")]

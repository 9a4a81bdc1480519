"""RunSettings(profile=True): a run times each launch of its training step with timestamp queries
(Vulkan; lavapipe in CI) and writes the medians as one "profile" line of the metrics file and as
RunResult.profile; ``python -m flow report`` then plots them; the CPU backend says it has no
timestamps; the setting round trips and is left out of files at its default."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import flow
from flow.codec import load, save
from flow.planning import plan
from tests.specs import digits_spec

ROOT = Path(__file__).resolve().parent.parent


def _profiled(tmp_path: Path, **run):
    settings = {"epochs": 1, "steps": 12, "profile": True, "checkpoint_dir": str(tmp_path / "run"), **run}
    spec = digits_spec()
    return dataclasses.replace(spec, run=dataclasses.replace(spec.run, **settings))


def _profile_lines(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [event for event in map(json.loads, lines) if event["event"] == "profile"]


def test_a_profiled_run_times_every_launch_of_its_training_step(vulkan_backend, tmp_path):
    spec = _profiled(tmp_path)
    result = flow.run(spec, backend=vulkan_backend)
    launches = plan(spec, facts=vulkan_backend.facts).devices[0].program("train").launches
    assert result.profile is not None and result.profile.steps == result.steps == 12
    assert [op for _, op, _ in result.profile.launches] == [item.op for item in launches]
    names = [f"{i}:{item.op}" for i, item in enumerate(launches)]
    assert [name for name, _, _ in result.profile.launches] == names
    seconds = [s for _, _, s in result.profile.launches]
    assert all(math.isfinite(s) and 0 < s < 1 for s in seconds), seconds
    (line,) = _profile_lines(tmp_path)
    assert line["steps"] == 12 and "note" not in line
    assert [(e["name"], e["op"], e["seconds"]) for e in line["launches"]] == list(result.profile.launches)
    # The report reads the same line: its JSON lists every launch with the file's times.
    done = subprocess.run([sys.executable, "-m", "flow", "report", str(tmp_path / "run")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    shown = {e["name"]: e["mean_ms"] for e in report["launches"]}
    assert shown == {name: s * 1e3 for name, _, s in result.profile.launches}


def test_the_cpu_backend_says_it_has_no_timestamps(tmp_path):
    spec = _profiled(tmp_path, steps=3)
    result = flow.run(dataclasses.replace(spec, devices=dataclasses.replace(spec.devices, select="cpu")))
    assert result.profile is not None and result.profile.launches == () and result.profile.steps == 0
    (line,) = _profile_lines(tmp_path)
    assert line["launches"] == [] and "no timestamp queries" in line["note"]
    done = subprocess.run([sys.executable, "-m", "flow", "report", str(tmp_path / "run")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    notes = json.loads((tmp_path / "run" / "report.json").read_text())["notes"]
    assert f"no GPU times per launch: {line['note']}" in notes


def test_without_profile_nothing_is_timed_and_the_setting_round_trips(vulkan_backend, tmp_path):
    spec = _profiled(tmp_path, steps=3, profile=False)
    assert flow.run(spec, backend=vulkan_backend).profile is None and not _profile_lines(tmp_path)
    save(spec, tmp_path / "plain.json")
    assert "profile" not in json.loads((tmp_path / "plain.json").read_text())["run"]
    save(_profiled(tmp_path), tmp_path / "spec.json")
    assert load(tmp_path / "spec.json").run.profile is True

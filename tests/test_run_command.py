"""flow.run_command: the ``run`` command trains, prints its summary and resumes; a spec file that is
missing is exit status 1."""

from __future__ import annotations

import re

from specs import image_spec

from flow.codec import save as save_spec
from flow.run_command import main_run


def test_the_command_line_runs_and_resumes(tmp_path, capsys):
    spec = image_spec(tmp_path, epochs=2)
    save_spec(spec, tmp_path / "spec.json")
    assert main_run([str(tmp_path / "spec.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("accuracy: 0.") and len(out[-1]) == len("accuracy: 0.0000")
    assert "steps: 20 (epochs 2)" in out
    time_line = next(line for line in out if line.startswith("time: "))
    assert re.fullmatch(r"time: \d+\.\d s \(setup \d+\.\d s\)", time_line), time_line
    assert main_run([str(tmp_path / "spec.json"), "--resume", str(tmp_path / "ckpt")]) == 0
    assert "steps: 20 (epochs 2)" in capsys.readouterr().out
    assert main_run([str(tmp_path / "missing.json")]) == 1

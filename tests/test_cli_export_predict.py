"""``python -m flow export`` and ``python -m flow predict`` (flow.predict_command), driven as a user
does, through subprocesses, on a finished run of the bundled digits: what they write equals the
Python API's, and every mistake is one ``error:`` line with no traceback. Also the usage lines of
the console script and the module, for every subcommand."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from conftest import relative_error
from specs import ROOT

import flow
from flow.spec import Digits
from loaders import open_source


def cli(*args: str | Path, program: list[str] | None = None) -> subprocess.CompletedProcess:
    command = [*(program or [sys.executable, "-m", "flow"]), *map(str, args)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def refused(result: subprocess.CompletedProcess, *words: str) -> str:
    """The one error line of a command that refused a mistake, checked."""
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def digits_x() -> np.ndarray:
    with contextlib.closing(open_source(Digits())) as source:
        return source.read(np.arange(150))[0]


def test_export_writes_the_python_apis_file(trained, tmp_path):
    result = cli("export", trained, "-o", tmp_path / "w.safetensors")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {tmp_path / 'w.safetensors'}"
    assert cli("export", trained, "-o", tmp_path / "new" / "w.safetensors").returncode == 0  # makes new/
    flow.export_safetensors(trained, tmp_path / "api.safetensors")
    from_cli = safetensors.numpy.load_file(str(tmp_path / "w.safetensors"))
    from_api = safetensors.numpy.load_file(str(tmp_path / "api.safetensors"))
    assert sorted(from_cli) == ["1.bias", "1.weight", "3.bias", "3.weight", "5.bias", "5.weight"]
    assert all(np.array_equal(from_cli[name], from_api[name]) for name in from_api)
    # --format wins over the file's extension.
    assert cli("export", trained, "-o", tmp_path / "w.bin", "--format", "safetensors").returncode == 0
    assert safetensors.numpy.load_file(str(tmp_path / "w.bin")).keys() == from_api.keys()


def test_predict_saves_prints_and_takes_npz_and_weights(trained, tmp_path, digits_x):
    expected = flow.predict(trained, digits_x)
    np.save(tmp_path / "x.npy", digits_x)
    result = cli("predict", trained, tmp_path / "x.npy", "-o", tmp_path / "p.npy")
    assert result.returncode == 0, result.stderr
    assert np.array_equal(np.load(tmp_path / "p.npy"), expected)
    printed = cli("predict", trained, tmp_path / "x.npy")
    assert printed.returncode == 0, printed.stderr
    assert relative_error(np.loadtxt(printed.stdout.splitlines()), expected) < 1e-5
    np.savez(tmp_path / "xs.npz", images=digits_x[:40], other=np.ones(3))
    classes = cli("predict", trained, tmp_path / "xs.npz", "--key", "images", "--argmax")
    assert [int(c) for c in classes.stdout.split()] == expected[:40].argmax(1).tolist()
    # A spec file and exported weights predict as the checkpoint does.
    cli("export", trained, "-o", tmp_path / "w.safetensors")
    flow.save(_spec_of(trained), tmp_path / "job.json")
    weights = tmp_path / "w.safetensors"
    spec_run = cli(
        "predict", tmp_path / "job.json", tmp_path / "x.npy", "--weights", weights, "-o", tmp_path / "q.npy"
    )
    assert spec_run.returncode == 0, spec_run.stderr
    assert np.array_equal(np.load(tmp_path / "q.npy"), expected)


def _spec_of(run_dir: Path):
    from actors.checkpoint import load

    return load(run_dir).spec


def test_every_mistake_is_one_error_line(trained, tmp_path, digits_x):
    np.save(tmp_path / "x.npy", digits_x[:5])
    np.save(tmp_path / "wide.npy", np.ones((5, 65), np.float32))
    np.save(tmp_path / "text.npy", np.array(["a", "b"]))
    np.savez(tmp_path / "two.npz", a=digits_x[:2], b=digits_x[:2])
    (tmp_path / "junk.npy").write_text("not an array")
    (tmp_path / "junk.ckpt").write_bytes(b"\x00" * 64)
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    flow.save(_spec_of(trained), tmp_path / "job.json")
    x = tmp_path / "x.npy"
    refused(cli("predict", tmp_path / "nowhere", x), "no such checkpoint")
    refused(cli("predict", tmp_path / "junk.ckpt", x), "junk.ckpt")
    refused(cli("predict", trained, tmp_path / "missing.npy"), "missing.npy")
    refused(cli("predict", trained, tmp_path / "junk.npy"), "junk.npy: not a .npy or .npz file")
    refused(cli("predict", trained, tmp_path / "wide.npy"), "wide.npy", "(5, 65)", "[1, 8, 8]")
    refused(cli("predict", trained, tmp_path / "text.npy"), "text.npy holds <U1 values")
    refused(cli("predict", trained, tmp_path / "two.npz"), "2 arrays (a, b): choose one with --key")
    refused(cli("predict", trained, tmp_path / "two.npz", "--key", "c"), "has no array 'c'")
    refused(
        cli("predict", trained, x, "--weights", tmp_path / "w.safetensors"), "--weights goes with a spec file"
    )
    refused(cli("predict", tmp_path / "job.json", x, "--weights", tmp_path / "bad.safetensors"),
            "bad.safetensors: not a readable safetensors file")  # fmt: skip
    refused(cli("predict", tmp_path / "job.json", x, "--weights", tmp_path / "none.safetensors"),
            "none.safetensors: no such weights file")  # fmt: skip
    refused(cli("export", tmp_path / "nowhere", "-o", tmp_path / "w.safetensors"), "no such checkpoint")
    refused(
        cli("export", tmp_path / "job.json", "-o", tmp_path / "w.safetensors"), "holds no trained weights"
    )
    refused(cli("export", trained, "-o", tmp_path / "w.bin"), "say --format safetensors or onnx")
    into_folder = cli("export", trained, "-o", tmp_path, "--format", "safetensors")
    refused(into_folder, "Is a directory", str(tmp_path))
    usage = cli("export", trained, "-o", tmp_path / "w.x", "--format", "tflite")
    assert (
        usage.returncode == 2
        and "invalid choice: 'tflite'" in usage.stderr
        and "Traceback" not in usage.stderr
    )


def test_onnx_export_is_written_or_its_absence_named(trained, tmp_path):
    result = cli("export", trained, "-o", tmp_path / "m.onnx")
    if (ROOT / "flow" / "onnx_io.py").exists():
        assert result.returncode == 0, result.stderr
        assert (tmp_path / "m.onnx").stat().st_size > 1000
    else:
        refused(result, "ONNX export needs")


@pytest.mark.parametrize(
    "command", ["", "devices", "check", "plan", "run", "generate", "export", "predict", "bench"]
)
def test_help_names_the_program_as_it_was_started(command):
    words = [command] if command else []
    module = cli(*words, "--help")
    assert module.returncode == 0, module.stderr
    assert module.stdout.startswith(f"usage: python -m flow {command}".rstrip()), module.stdout
    assert "bench_mlp.py" not in module.stdout.splitlines()[0]
    script = Path(sys.executable).with_name("vkflow")
    if not script.exists():
        return
    installed = cli(*words, "--help", program=[str(script)])
    assert installed.returncode == 0, installed.stderr
    assert installed.stdout.startswith(f"usage: vkflow {command}".rstrip()), installed.stdout


def test_version():
    result = cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("vkflow "), result
    assert os.linesep not in result.stdout.strip()

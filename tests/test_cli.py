"""The command line as a user meets it: every mistake in the input (the spec file, its data, the
device asked for) is one ``error:`` line on stderr and a non-zero exit, never a traceback; ``flow
check`` holds the spec against its data and lists every problem at once; ``flow check`` and ``flow
plan`` work on every example, and ``flow plan`` shows the whole run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flow.codec import save
from flow.run_command import user_error
from flow.runtime import ActorError
from flow.spec import (
    CSV,
    MSE,
    SGD,
    CrossEntropy,
    Data,
    Devices,
    ImageFolder,
    Linear,
    Model,
    RunSettings,
    Spec,
)
from loaders import LoaderError

ROOT = Path(__file__).resolve().parents[1]


def flow_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flow", *args], capture_output=True, text=True, cwd=ROOT, check=False
    )


def spec_of(source, input_shape=(3,), units=2, loss=None) -> Spec:
    return Spec(
        model=Model(input_shape=input_shape, layers=(Linear(units),), loss=loss or CrossEntropy()),
        optimiser=SGD(0.1),
        data=Data(source, batch_size=4),
        devices=Devices("cpu"),
        run=RunSettings(epochs=1),
    )


def write_csv(path: Path, rng, rows: int = 20, features: int = 3, classes: int = 2) -> Path:
    header = ",".join([f"f{j}" for j in range(features)] + ["label"])
    body = [
        ",".join([*(f"{v:.3f}" for v in rng.standard_normal(features)), str(i % classes)])
        for i in range(rows)
    ]
    path.write_text("\n".join([header, *body]) + "\n")
    return path


def the_one_error_line(done: subprocess.CompletedProcess) -> str:
    """The single stderr line of a refused command, after checking that it is all there is."""
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert done.stdout == ""
    return lines[0]


@pytest.mark.parametrize(
    "mistake, expected",
    [
        ("empty csv", ["empty.csv", "empty file"]),
        ("header-only csv", ["header.csv", "no data rows under the header"]),
        ("no label column", ["nolabel.csv", "no column 'label'", "['a', 'b', 'c']"]),
        ("no image folder", ["nowhere", "no such directory"]),
        ("missing spec", ["missing.json", "No such file"]),
        ("device 7", ["7", "device"]),
        ("no checkpoint", ["no-checkpoints-here", "checkpoint"]),
    ],
)
def test_each_user_mistake_in_run_is_one_error_line(tmp_path, rng, mistake, expected):
    spec_file = tmp_path / "spec.json"
    args = [str(spec_file)]
    if mistake == "empty csv":
        (tmp_path / "empty.csv").write_text("")
        save(spec_of(CSV(str(tmp_path / "empty.csv"), label_column="label")), spec_file)
    elif mistake == "header-only csv":
        (tmp_path / "header.csv").write_text("f0,f1,f2,label\n")
        save(spec_of(CSV(str(tmp_path / "header.csv"), label_column="label")), spec_file)
    elif mistake == "no label column":
        (tmp_path / "nolabel.csv").write_text("a,b,c\n1,2,3\n")
        save(spec_of(CSV(str(tmp_path / "nolabel.csv"), label_column="label")), spec_file)
    elif mistake == "no image folder":
        save(spec_of(ImageFolder(str(tmp_path / "nowhere"))), spec_file)
    elif mistake == "missing spec":
        args = [str(tmp_path / "missing.json")]
    else:
        save(spec_of(CSV(str(write_csv(tmp_path / "good.csv", rng)), label_column="label")), spec_file)
        if mistake == "device 7":
            args += ["--device", "7"]
        else:
            args += ["--resume", str(tmp_path / "no-checkpoints-here")]
    line = the_one_error_line(flow_cli("run", *args))
    for words in expected:
        assert words in line, line


def test_check_lists_every_data_problem_at_once_and_run_refuses_the_same(tmp_path, rng):
    # Three features where the model takes four, and five classes where it has three outputs.
    data = write_csv(tmp_path / "five.csv", rng, features=3, classes=5)
    spec_file = tmp_path / "both.json"
    save(spec_of(CSV(str(data), label_column="label"), input_shape=(4,), units=3), spec_file)
    done = flow_cli("check", str(spec_file))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stdout.splitlines() == [
        f"{spec_file}: 2 problem(s)",
        "  model.input_shape: the source gives samples of shape (3,), but the model takes (4,)",
        "  model.layers[0]: the source has 5 classes, but the model ends in 3 outputs",
    ]
    done = flow_cli("run", str(spec_file))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert [line.split(": ", 2)[2] for line in done.stderr.splitlines()] == [
        "model.input_shape: the source gives samples of shape (3,), but the model takes (4,)",
        "model.layers[0]: the source has 5 classes, but the model ends in 3 outputs",
    ]


def test_check_names_a_missing_file_and_describes_readable_data(tmp_path, rng):
    missing = tmp_path / "missing.json"
    save(spec_of(CSV(str(tmp_path / "gone.csv"), label_column="label")), missing)
    done = flow_cli("check", str(missing))
    assert done.returncode == 1
    assert done.stdout.splitlines()[1:] == [
        f"  data.source: {tmp_path / 'gone.csv'}: cannot open (No such file or directory)"
    ]
    good = tmp_path / "good.json"
    save(spec_of(CSV(str(write_csv(tmp_path / "good.csv", rng, rows=12)), label_column="label")), good)
    done = flow_cli("check", str(good))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "source: 12 samples of shape (3,), 2 classes"


def test_mse_on_class_labels_is_an_error_in_check_and_run(tmp_path, rng):
    data = write_csv(tmp_path / "ten.csv", rng, classes=10)
    spec_file = tmp_path / "mse.json"
    save(spec_of(CSV(str(data), label_column="label"), units=10, loss=MSE()), spec_file)
    expected = (
        "model.loss: MSE needs one target per output, but the model ends in 10 outputs and the source "
        "gives one label a sample (class ids of 10 classes); for class labels use CrossEntropy()"
    )
    done = flow_cli("check", str(spec_file))
    assert done.returncode == 1 and done.stdout.splitlines()[1:] == [f"  {expected}"]
    assert the_one_error_line(flow_cli("run", str(spec_file))) == f"error: {spec_file}: {expected}"


def test_user_errors_are_lines_and_bugs_are_left_to_their_traceback():
    bad_file = LoaderError("/data/x.png", "cannot decode image")
    assert user_error(ActorError("loader", bad_file)) == ["/data/x.png: cannot decode image"]
    assert user_error(LookupError("no Vulkan device matches 7")) == ["no Vulkan device matches 7"]
    assert user_error(ValueError("two\nlines")) == ["two lines"]
    # KeyError and IndexError are LookupErrors too, but from inside vkflow they are bugs.
    for bug in (KeyError("w"), IndexError("tuple index out of range"), RuntimeError("x"), TypeError("y")):
        assert user_error(bug) is None
        assert user_error(ActorError("device", bug)) is None


def test_cli_check_and_plan_work_on_every_example():
    examples = sorted((ROOT / "examples").glob("*.json"))
    assert examples
    for path in examples:
        for command in (["check", str(path)], ["plan", str(path), "--json"]):
            done = subprocess.run(
                [sys.executable, "-m", "flow", *command],
                capture_output=True,
                text=True,
                cwd=ROOT,
                check=False,
            )
            assert done.returncode == 0, done.stdout + done.stderr
        plan_json = json.loads(done.stdout)
        assert plan_json["devices"][0]["programs"][0]["name"].startswith("train[")


def test_cli_plan_shows_the_whole_run():
    """``flow plan examples/digits.json``: the data (splits, batches, schedule) from the source's
    header, the actors and channels, and each device's programs and memory."""
    example = str(ROOT / "examples" / "digits.json")
    done = subprocess.run([sys.executable, "-m", "flow", "plan", example, "--json"],
                          capture_output=True, text=True, cwd=ROOT, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    whole = json.loads(done.stdout)
    data = whole["data"]
    assert data["samples"] == 1797 and data["batch_size"] == 64
    assert data["splits"]["train"]["samples"] + data["splits"]["val"]["samples"] == 1797
    train = data["splits"]["train"]
    assert train["batches"] == -(-train["samples"] // 64)
    assert train["last_batch_rows"] == train["samples"] % 64
    assert data["steps"] == 30 * train["batches"]  # the example trains 30 epochs
    kinds = {a["name"]: a["kind"] for a in whole["pipeline"]["actors"]}
    assert set(kinds.values()) == {"loader", "preprocess", "device", "optimiser", "sink"}
    assert ["preprocess", "device", 4] in whole["pipeline"]["channels"]  # the example's in_flight
    assert [p["name"] for p in whole["devices"][0]["programs"]] == ["train[64]", "eval[64]", "predict[64]"]
    text = subprocess.run([sys.executable, "-m", "flow", "plan", example],
                          capture_output=True, text=True, cwd=ROOT, check=True).stdout  # fmt: skip
    for section in ("data: 1,797 samples", "actors (batches read in place", "channels: loader->preprocess",
                    "program train[64]", "arena params"):  # fmt: skip
        assert section in text, section


def test_cli_check_lists_every_problem(tmp_path):
    bad = json.loads((ROOT / "examples" / "digits.json").read_text())
    bad["model"]["layers"][1]["units"] = -3
    bad["model"]["layers"][2]["unitz"] = 5
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    done = subprocess.run(
        [sys.executable, "-m", "flow", "check", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 1
    assert "model.layers[1].units" in done.stdout and "unitz" in done.stdout


def test_cli_hands_run_and_bench_options_through():
    for command, expected in ((["bench", "--help"], "--quick"), (["run", "--help"], "--resume")):
        done = subprocess.run(
            [sys.executable, "-m", "flow", *command], capture_output=True, text=True, cwd=ROOT, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert expected in done.stdout


def _cli(*args: str, program: str | None = None) -> subprocess.CompletedProcess:
    command = [program] if program else [sys.executable, "-m", "flow"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120)


def test_version_and_the_program_name_in_usage_lines():
    from importlib.metadata import PackageNotFoundError, version

    from flow.__main__ import DISTRIBUTION

    try:
        expected = f"vkflow {version(DISTRIBUTION)}"
    except PackageNotFoundError:  # run from a tree that is not installed (the GPU machine)
        expected = "vkflow unknown (not installed)"
    shown = _cli("--version")
    assert shown.returncode == 0 and shown.stdout.strip() == expected
    assert _cli("run", "--help").stdout.startswith("usage: python -m flow run [-h]")
    assert _cli("--help").stdout.startswith("usage: python -m flow [-h] [--version]")


@pytest.mark.skipif(
    not (Path(sys.executable).parent / "vkflow").exists(), reason="the vkflow script is not installed"
)
def test_the_vkflow_script_names_itself_in_usage_lines():
    script = str(Path(sys.executable).parent / "vkflow")
    assert _cli("run", "--help", program=script).stdout.startswith("usage: vkflow run [-h]")
    assert _cli("--help", program=script).stdout.startswith("usage: vkflow [-h] [--version]")

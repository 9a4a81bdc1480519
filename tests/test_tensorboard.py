"""flow.TensorBoardLogger and ``run --tensorboard DIR``, read back as TensorBoard would: the event
files (TFRecord framing read by hand, events parsed with tensorboardX's protobuf classes) hold one
scalar per number of the metrics file's step and eval lines, with the same tags, steps and values;
a resumed run adds its own event file; and without tensorboardX the flag is one ``error:`` line
saying how to install it. The metrics file is written by default in the run's own folder."""

from __future__ import annotations

import dataclasses
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from specs import digits_spec, image_spec
from tensorboardX.proto.event_pb2 import Event

import flow
from flow.codec import save as save_spec
from flow.tensorboard_logger import scalars_of

ROOT = Path(__file__).resolve().parents[1]


def read_events(path: Path) -> list[Event]:
    """The events of one file: each record is a little-endian u64 length, its CRC, the bytes and
    their CRC (the TFRecord framing)."""
    data, events, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        events.append(Event.FromString(data[at + 12 : at + 12 + length]))
        at += 12 + length + 4
    assert at == len(data)
    return events


def scalars(log_dir: Path) -> list[tuple[str, int, float]]:
    """Every scalar under ``log_dir``: (tag, step, value), file by file in the order written."""
    found = []
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in read_events(path):
            if event.HasField("summary"):
                found += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return found


def expected(metrics_file: Path) -> list[tuple[str, int, float]]:
    lines = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    found = []
    for line in lines:
        if line["event"] in ("step", "eval"):
            found += [(tag, line["step"], value) for tag, value in scalars_of(line).items()]
    return found


def assert_same_scalars(got: list[tuple[str, int, float]], want: list[tuple[str, int, float]]) -> None:
    assert [(tag, step) for tag, step, _ in got] == [(tag, step) for tag, step, _ in want]
    # Event files hold float32: the metrics file's float64 rounded once.
    np.testing.assert_array_equal(
        np.array([v for *_, v in got], np.float32), np.array([v for *_, v in want], np.float32)
    )


def test_scalars_of_a_metrics_line_are_its_numbers_by_split():
    step = {"event": "step", "step": 4, "epoch": 0, "loss": 0.5, "accuracy": None, "lr": 0.01,
            "samples_per_second": 900.0, "elapsed": 0.2, "top5": 1.0}  # fmt: skip
    assert scalars_of(step) == {"train/loss": 0.5, "train/lr": 0.01, "train/samples_per_second": 900.0,
                                "train/top5": 1.0}  # fmt: skip
    val = {"event": "eval", "split": "val", "step": 5, "epoch": 0, "loss": 0.25, "accuracy": 0.75,
           "samples": 40, "elapsed": 0.3}  # fmt: skip
    assert scalars_of(val) == {"val/loss": 0.25, "val/accuracy": 0.75}


def test_the_event_files_hold_the_metrics_files_numbers_through_a_resume(tmp_path):
    spec = image_spec(tmp_path, epochs=2, checkpoint_every=7)
    log_dir = tmp_path / "tb"

    class StopAt(flow.Callback):
        def on_step(self, record: dict[str, Any]) -> None:
            if record["step"] == 9:
                self.stop_run("a test's stop")

    first = flow.run(spec, callbacks=[flow.TensorBoardLogger(log_dir), StopAt()])
    assert first.stopped_at == 10
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1
    flow.run(spec, resume=spec.run.checkpoint_dir, callbacks=[flow.TensorBoardLogger(log_dir)])
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2  # one per process, as TensorBoard expects
    want = expected(Path(spec.run.metrics_file))
    assert {tag for tag, *_ in want} >= {"train/loss", "train/accuracy", "val/loss", "val/accuracy"}
    assert_same_scalars(scalars(log_dir), want)


def test_the_tensorboard_flag_writes_the_metrics_of_the_run_folder(tmp_path):
    # digits, on lavapipe where there is one; the spec names no metrics file: it is in the run's folder.
    spec = digits_spec(epochs=2, checkpoint_dir=str(tmp_path / "run"))
    spec = dataclasses.replace(spec, data=dataclasses.replace(spec.data, batch_size=256))
    save_spec(spec, tmp_path / "digits.json")
    done = subprocess.run(
        [sys.executable, "-m", "flow", "run", str(tmp_path / "digits.json"), "--quiet",
         "--tensorboard", str(tmp_path / "tb")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    metrics_file = tmp_path / "run" / "metrics.jsonl"
    want = expected(metrics_file)
    assert sum(tag == "val/accuracy" for tag, *_ in want) == 2  # one round per epoch
    assert_same_scalars(scalars(tmp_path / "tb"), want)
    steps = [
        line for line in map(json.loads, metrics_file.read_text().splitlines()) if line["event"] == "step"
    ]
    assert [line["step"] for line in steps] == list(range(len(steps))) and len(steps) == 2 * 6


def test_without_tensorboardx_the_flag_says_how_to_install_it(tmp_path, monkeypatch):
    save_spec(image_spec(tmp_path, epochs=1), tmp_path / "spec.json")
    hide = "import sys; sys.modules['tensorboardX'] = None; from flow.__main__ import main; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, "-c", hide, "run", str(tmp_path / "spec.json"),
         "--tensorboard", str(tmp_path / "tb")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        "error: --tensorboard: TensorBoardLogger needs tensorboardX, which is not installed: "
        "pip install 'vkflow-ml[tensorboard]' (or pip install tensorboardX)"
    ]
    assert not (tmp_path / "ckpt").exists()  # refused before the run began
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed
    with pytest.raises(ModuleNotFoundError, match="pip install 'vkflow-ml.tensorboard.'"):
        flow.TensorBoardLogger(tmp_path / "tb")

"""RunResult.setup: the seconds before the first step, by part, as flow.run measures them and as
the metrics file's "setup" line records them. A source that is slow to open shows in "source"."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np
from test_loaders_arrays import arrays_spec, digits_arrays

import flow
from actors.cpu_backend import CpuBackend
from flow.spec import Custom, RunSettings

PARTS = {"outputs", "source", "plan", "device", "programs", "data"}


class SlowLabels:
    """A dataset whose labels take ``delay`` seconds to read: the run reads them once, as it opens
    the source, so the delay belongs to the setup's "source" part."""

    def __init__(self, x: np.ndarray, y: np.ndarray, delay: float) -> None:
        self.x, self.y, self.delay = x, y, delay

    def __len__(self) -> int:
        return len(self.y)

    @property
    def labels(self) -> np.ndarray:
        time.sleep(self.delay)
        return self.y

    def read(self, indices):
        return self.x[indices], self.y[indices]


def test_the_setup_is_measured_by_part_and_written_before_the_first_step(tmp_path):
    x, y = digits_arrays()
    delay = 0.3
    metrics = tmp_path / "metrics.jsonl"
    run = RunSettings(epochs=1, metrics_file=str(metrics))
    spec = replace(arrays_spec(Custom(SlowLabels(x, y, delay))), run=run)
    started = time.monotonic()
    result = flow.run(spec, backend=CpuBackend())
    wall = time.monotonic() - started
    assert set(result.setup) == PARTS and all(seconds >= 0 for seconds in result.setup.values())
    assert delay <= result.setup["source"] < delay + 1.0
    assert max(seconds for part, seconds in result.setup.items() if part != "source") < delay
    assert sum(result.setup.values()) <= result.seconds <= wall
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    setup = next(i for i, line in enumerate(lines) if line["event"] == "setup")
    first_step = next(i for i, line in enumerate(lines) if line["event"] == "step")
    assert setup < first_step and lines[setup]["step"] == 0
    assert lines[setup]["parts"] == {part: round(s, 6) for part, s in result.setup.items()}
    assert abs(lines[setup]["seconds"] - sum(result.setup.values())) < 1e-5

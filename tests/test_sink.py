"""actors.sink: every step has a metrics line and statistics ride on some; the items a source
skipped are counted once and named in the result, the metrics file and the summary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from specs import image_spec

from flow.runner import run
from flow.spec import (
    Adam,
    CrossEntropy,
    Data,
    Devices,
    Flatten,
    Linear,
    Model,
    RunSettings,
    Spec,
    Split,
)


def test_every_step_has_a_metrics_line_and_statistics_ride_on_some(tmp_path):
    spec = image_spec(tmp_path, epochs=2)
    result = run(spec)
    lines = [json.loads(line) for line in Path(spec.run.metrics_file).read_text().splitlines()]
    steps = [r for r in lines if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(result.steps))
    actors = {"loader", "preprocess", "device", "optimiser", "sink"}
    assert set(steps[0]["statistics"]) == set(steps[-1]["statistics"]) == actors
    assert steps[-1]["statistics"]["sink"]["items_in"] >= result.steps


def test_skipped_items_are_counted_once_and_named_in_the_result_metrics_and_summary(tmp_path, rng):
    from PIL import Image

    from flow.run_command import summary
    from flow.spec import ImageFolder

    bad = set()
    for index in range(40):
        folder = tmp_path / "images" / f"class_{index % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{index:02d}.png"
        if index % 5 == 3:  # 8 corrupt files, in both classes and in every split
            path.write_bytes(b"not a png at all")
            bad.add(str(path))
        else:
            Image.fromarray(rng.integers(0, 256, (4, 4), dtype=np.uint8), mode="L").save(path)
    spec = Spec(
        model=Model(input_shape=(1, 4, 4), layers=(Flatten(), Linear(2)), loss=CrossEntropy()),
        optimiser=Adam(0.01),
        data=Data(
            ImageFolder(str(tmp_path / "images"), on_error="skip"),
            batch_size=8,
            split=Split(train=0.75, val=0.25),
        ),
        devices=Devices("cpu"),
        run=RunSettings(epochs=3, metrics_file=str(tmp_path / "metrics.jsonl")),
    )
    result = run(spec)
    # Three epochs meet each bad training file three times; each still counts once.
    assert result.skipped == len(bad) == 8
    assert len(result.skipped_examples) == 5 and set(result.skipped_examples) <= bad
    lines = [json.loads(line) for line in Path(spec.run.metrics_file).read_text().splitlines()]
    assert lines[-1] == {
        "event": "skipped",
        "step": result.steps - 1,
        "count": 8,
        "examples": list(result.skipped_examples),
    }
    carried = [r["skipped"]["count"] for r in lines if r["event"] == "step" and "skipped" in r]
    assert carried and carried == sorted(carried) and carried[-1] <= 8  # the statistics lines carry it
    text = summary(result)
    assert f"skipped: 8 bad item(s) (on_error='skip'): {', '.join(result.skipped_examples)}, ..." in text

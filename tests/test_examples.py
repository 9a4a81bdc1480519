"""The shipped examples train: the small CNN on the bundled digits, through the whole runtime on
the Vulkan device (lavapipe in CI), for a few epochs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import flow
from flow.codec import load

ROOT = Path(__file__).resolve().parent.parent


def test_digits_cnn_example_learns(tmp_path, vulkan_backend):
    spec = load(ROOT / "examples" / "digits_cnn.json")
    spec = dataclasses.replace(
        spec,
        devices=dataclasses.replace(spec.devices, select=0),
        run=dataclasses.replace(spec.run, epochs=3, checkpoint_dir=str(tmp_path / "ckpt"), metrics_file=None),
    )
    result = flow.run(spec)
    assert result.steps == 3 * 23  # 1437 training images in batches of 64, the last one partial
    first, last = result.evals[0], result.evals[-1]
    assert last.loss < first.loss
    assert result.accuracy >= 0.93
    assert Path(result.checkpoint).exists()

"""The character GPT example (examples/char_gpt.json): its spec is valid and plans; a few of its
steps on lavapipe lower the loss from the uniform guess; from the CLI, a shortened copy trains, and
its checkpoint holds the vocabulary that generation reads back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import flow
from actors.checkpoint import checkpoints, read_vocabulary
from flow.codec import load
from flow.spec import Split
from loaders.text import vocabulary

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "char_gpt.json"


def _short(spec, **run):
    """The example in batches of 4, on the training text alone (an evaluation at stride 16 would
    read tens of thousands of windows), for ``run``'s steps."""
    data = dataclasses.replace(spec.data, batch_size=4, split=Split(train=1.0))
    return dataclasses.replace(spec, data=data, run=dataclasses.replace(spec.run, eval_every=None, **run))


def test_the_example_is_the_model_the_issue_names():
    spec = load(EXAMPLE)
    assert flow.validate(spec) == []
    kinds = [type(layer).__name__ for layer in spec.model.layers]
    assert kinds == ["Embedding", "PositionalEmbedding", "Repeat", "LayerNorm", "Linear"]
    block = spec.model.layers[2]
    assert block.times == 4 and block.layers[0].layers[1].heads == 4
    assert spec.model.input_shape == (128,) and spec.model.layers[0].dim == 128
    # The vocabulary of any Python's topics fits the table.
    assert len(vocabulary(spec.data.source.path)) <= spec.model.layers[0].num_embeddings


def test_a_few_steps_on_lavapipe_lower_the_loss(vulkan_backend, tmp_path):
    spec = _short(load(EXAMPLE), steps=3, checkpoint_dir=None, metrics_file=str(tmp_path / "m.jsonl"))
    flow.run(spec, backend=vulkan_backend)
    losses = [
        e["loss"]
        for e in map(json.loads, (tmp_path / "m.jsonl").read_text().splitlines())
        if e["event"] == "step"
    ]
    assert len(losses) == 3
    assert abs(losses[0] - math.log(256)) < 1.0  # a fresh model guesses about uniformly
    assert losses[-1] < losses[0] - 0.5


def test_the_example_trains_from_the_cli_and_its_checkpoint_keeps_the_vocabulary(tmp_path):
    spec = _short(load(EXAMPLE), steps=2, checkpoint_dir=str(tmp_path / "run"))
    spec_file = tmp_path / "gpt.json"
    flow.save(spec, spec_file)
    out = subprocess.run(
        [sys.executable, "-m", "flow", "run", str(spec_file), "--quiet", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert checkpoints(tmp_path / "run")
    assert read_vocabulary(tmp_path / "run") == vocabulary(spec.data.source.path)

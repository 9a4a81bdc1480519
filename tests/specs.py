"""Spec builders that several test files share: small whole runs that finish in a moment on the
CPU backend."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from flow.codec import load as load_spec
from flow.spec import (
    Adam,
    CrossEntropy,
    Data,
    Devices,
    Flatten,
    HorizontalFlip,
    Linear,
    Model,
    Normalize,
    RandomCrop,
    RunSettings,
    Spec,
    Split,
    Synthetic,
)

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits.json"


def bench_module(name: str) -> ModuleType:
    """``bench/<name>.py`` (bench is not a package), loaded from its path once per process, for
    tests of a benchmark's own logic that needs no device."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = sys.modules.setdefault(name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


def image_spec(tmp: Path | None = None, **run) -> Spec:
    """A tiny image classifier with augmentation (random crops and flips draw from the batch rng),
    so exact resume covers the random streams too."""
    settings = {"epochs": 3, "in_flight": 2, **run}
    if tmp is not None:
        settings.setdefault("checkpoint_dir", str(tmp / "ckpt"))
        settings.setdefault("metrics_file", str(tmp / "metrics.jsonl"))
    return Spec(
        model=Model(input_shape=(1, 6, 6), layers=(Flatten(), Linear(16, activation="relu"), Linear(4)),
                    loss=CrossEntropy()),
        optimiser=Adam(0.01),
        data=Data(Synthetic(samples=200, features=(1, 6, 6), classes=4, seed=3), batch_size=16, seed=5,
                  split=Split(train=0.8, val=0.2), preprocess=(Normalize((0.0,), (2.0,)),),
                  augment=(RandomCrop((6, 6), padding=1), HorizontalFlip(0.5))),
        devices=Devices("cpu"),
        run=RunSettings(**settings),
    )  # fmt: skip


def digits_spec(**run) -> Spec:
    spec = load_spec(DIGITS)
    # The example writes to runs/digits under the working directory: a test writes only where it says.
    run = {"checkpoint_dir": None, "metrics_file": None, **run}
    return dataclasses.replace(spec, run=dataclasses.replace(spec.run, **run))


def digits(tmp: Path, name: str = "a", **run) -> Spec:
    """The bundled Digits example for one epoch (23 steps) on the CPU, writing under ``tmp/name``."""
    spec = load_spec(DIGITS)
    settings = {"epochs": 1, "checkpoint_every": 5, "checkpoint_dir": str(tmp / name),
                "metrics_file": str(tmp / name / "metrics.jsonl"), **run}  # fmt: skip
    return dataclasses.replace(spec, devices=Devices("cpu"), run=dataclasses.replace(spec.run, **settings))


def synthetic_spec(tmp=None, **run) -> Spec:
    """250 samples in batches of 16 with a validation split: partial batches in both splits.
    Streamed from the host (placement "host"): these tests are about batches read in place into
    the device's slots, which a dataset kept on the device does not need."""
    settings = {"epochs": 3, "in_flight": 2, **run}
    if tmp is not None:
        settings.setdefault("checkpoint_dir", str(tmp / "ckpt"))
        settings.setdefault("metrics_file", str(tmp / "metrics.jsonl"))
    return Spec(
        model=Model(input_shape=(6,), layers=(Linear(12, activation="relu"), Linear(3)), loss=CrossEntropy()),
        optimiser=Adam(0.01),
        data=Data(Synthetic(samples=250, features=(6,), classes=3, seed=2), batch_size=16, seed=4,
                  split=Split(train=0.8, val=0.2), placement="host"),
        devices=Devices("cpu"),
        run=RunSettings(**settings),
    )  # fmt: skip


def gpt_blocks(vocab: int, width: int, hidden: int, context: int, heads: int = 2) -> Model:
    """Two pre-LN GPT blocks (attention, then a GELU MLP of ``hidden``), the char GPT's pattern,
    small: the model the GEMM-epilogue and residual-fusion tests plan and train (the char GPT
    itself: width 384, 6 heads, hidden 1536, context 256)."""
    from flow.spec import Embedding, LayerNorm, PositionalEmbedding, Repeat, Residual, SelfAttention

    block = (
        Residual((LayerNorm(), SelfAttention(heads))),
        Residual((LayerNorm(), Linear(hidden, activation="gelu"), Linear(width))),
    )
    layers = (Embedding(vocab, width), PositionalEmbedding(), Repeat(2, block), LayerNorm(), Linear(vocab))
    return Model(input_shape=(context,), layers=layers, loss=CrossEntropy())

"""BatchNorm in a model split over devices with several micro-batches (flow.stage_plan,
actors.stages), as torchgpipe's deferred_batch_norm: each micro-batch is normalised by its own
statistics (GPipe's forward, checked against numpy), and the running mean and variance move once
per batch by the whole batch's statistics (against a float64 oracle and one device); a CNN with
BatchNorm2d split over two devices trains the digits from a spec file through the CLI; resume is
exact."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

import flow
from flow.spec import (
    Adam,
    Arrays,
    BatchNorm1d,
    BatchNorm2d,
    Conv2d,
    CrossEntropy,
    Data,
    Devices,
    Flatten,
    Linear,
    MaxPool2d,
    Model,
    ReLU,
    RunSettings,
    Spec,
)
from flow.stage_plan import deferred_running
from tests.specs import digits_spec

EPS, MOMENTUM = 1e-5, 0.1


def _select(request, pair: str):
    if pair == "cpu+cpu":
        return ("cpu", "cpu")
    index = request.getfixturevalue("vulkan_backend").facts.index
    return (index, index)


def _normalise(h: np.ndarray) -> np.ndarray:
    return (h - h.mean(0)) / np.sqrt(h.var(0) + EPS)


# -- the host's join -------------------------------------------------------------------------------


def test_the_micro_batches_statistics_join_into_the_whole_batchs_running_statistics(rng):
    """Micro-batches of 5, 5 and 3 rows of (C, H, W) = (3, 2, 2) images: the joined running mean
    and variance are the float64 oracle's over the whole batch (unbiased variance, as one device)."""
    x = rng.standard_normal((13, 3, 2, 2)) * rng.uniform(0.5, 3, (1, 3, 1, 1))
    x += rng.normal(0, 2, (1, 3, 1, 1))
    running = (rng.standard_normal(3).astype(np.float32), rng.uniform(0.5, 2, 3).astype(np.float32))
    parts = []
    for rows in np.split(np.arange(13), [5, 10]):
        planes = x[rows].astype(np.float32).transpose(1, 0, 2, 3).reshape(3, -1).astype(np.float64)
        stats = np.stack([planes.mean(1), 1 / np.sqrt(planes.var(1) + EPS)]).astype(np.float32)
        parts.append((len(rows), stats))
    mean, var = deferred_running(running, parts, ("layers[1]", 3, 4, MOMENTUM, EPS))
    planes = x.astype(np.float32).transpose(1, 0, 2, 3).reshape(3, -1).astype(np.float64)
    expected = (1 - MOMENTUM) * running[0] + MOMENTUM * planes.mean(1)
    np.testing.assert_allclose(mean, expected, rtol=1e-6, atol=1e-7)
    expected = (1 - MOMENTUM) * running[1] + MOMENTUM * planes.var(1, ddof=1)
    np.testing.assert_allclose(var, expected, rtol=1e-6)
    assert mean.dtype == var.dtype == np.float32


# -- the forward and the running statistics against numpy ------------------------------------------


@pytest.mark.parametrize("pair", ["cpu+cpu", "lavapipe+lavapipe"])
def test_micro_batches_normalise_by_their_own_statistics_and_the_running_ones_move_by_the_batchs(
    rng, tmp_path, request, pair
):
    """One batch of 16 rows a step, cut into 4 micro-batches, weights held still (lr 1e-9), a
    BatchNorm on each stage: every step's loss is numpy's with each micro-batch normalised by its
    own statistics (not the batch's), and after 5 steps each running mean and variance is the
    float64 oracle's, moved once a step by the whole batch's statistics of what that layer saw."""
    scale, shift = rng.uniform(0.5, 4, 6), rng.normal(0, 2, 6)
    x = (rng.standard_normal((16, 6)) * scale + shift).astype(np.float32)
    y = rng.integers(0, 3, 16)
    layers = (BatchNorm1d(), Linear(8), BatchNorm1d(), ReLU(), Linear(3))
    steps, metrics = 5, tmp_path / "metrics.jsonl"
    spec = Spec(
        model=Model(input_shape=(6,), layers=layers, loss=CrossEntropy()),
        optimiser=Adam(1e-9),
        data=Data(Arrays(x, y), batch_size=16, shuffle=False, placement="host"),
        devices=Devices(_select(request, pair), stages=(0, 0, 1, 1, 1), micro_batches=4),
        run=RunSettings(epochs=steps, metrics_file=str(metrics)),
    )
    result = flow.run(spec)
    p = {k: v.astype(np.float64) for k, v in result.parameters.items()}
    seen, loss = [], 0.0
    for rows in np.split(np.arange(16), 4):
        h = _normalise(x[rows].astype(np.float64)) * p["layers[0].weight"] + p["layers[0].bias"]
        h = h @ p["layers[1].weight"] + p["layers[1].bias"]
        seen.append(h)
        h = np.maximum(_normalise(h) * p["layers[2].weight"] + p["layers[2].bias"], 0)
        z = h @ p["layers[4].weight"] + p["layers[4].bias"]
        z -= z.max(1, keepdims=True)
        loss -= (z - np.log(np.exp(z).sum(1, keepdims=True)))[np.arange(4), y[rows]].sum() / 16
    whole = _normalise(x.astype(np.float64)) * p["layers[0].weight"] + p["layers[0].bias"]
    whole = _normalise(whole @ p["layers[1].weight"] + p["layers[1].bias"])
    assert np.abs(np.concatenate([_normalise(h) for h in seen]) - whole).max() > 0.05  # not the batch's
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [record["loss"] for record in records if record["event"] == "step"]
    assert len(losses) == steps
    np.testing.assert_allclose(losses, loss, rtol=1e-5)
    kept = 0.9**steps  # r_N = 0.9^N r_0 + (1 - 0.9^N) s for the same batch every step
    for layer, h in (("layers[0]", x.astype(np.float64)), ("layers[2]", np.concatenate(seen))):
        mean, var = h.mean(0), h.var(0, ddof=1)
        np.testing.assert_allclose(p[f"{layer}.running_mean"], (1 - kept) * mean, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(p[f"{layer}.running_var"], kept + (1 - kept) * var, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pair", ["cpu+cpu", "lavapipe+lavapipe"])
def test_running_statistics_over_micro_batches_are_one_devices_on_the_digits(request, pair):
    """A BatchNorm2d on the digits' input and a trained CNN behind it, one epoch: the running
    statistics of four micro-batches over two devices are one device's with the same batches."""
    select = _select(request, pair)
    layers = (BatchNorm2d(), Conv2d(8, 3, padding=1, activation="relu"), Flatten(), Linear(10))
    spec = digits_spec(epochs=1)
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, layers=layers))
    one = flow.run(dataclasses.replace(spec, devices=Devices(select[0])))
    split = flow.run(dataclasses.replace(spec, devices=Devices(select, stages=(0, 1, 1, 1), micro_batches=4)))
    assert split.steps == one.steps == 23
    for name in ("layers[0].running_mean", "layers[0].running_var"):
        np.testing.assert_allclose(split.parameters[name], one.parameters[name], rtol=1e-5, atol=1e-6)
    assert abs(float(one.parameters["layers[0].running_var"][0]) - 1.0) > 0.1  # it moved


# -- a CNN with BatchNorm2d from the CLI, and resume -----------------------------------------------


def _cnn(select, tmp_path, **run) -> Spec:
    layers = (
        Conv2d(16, 3, padding=1),
        BatchNorm2d(),
        ReLU(),
        MaxPool2d(2),
        Flatten(),
        Linear(64),
        BatchNorm1d(),
        ReLU(),
        Linear(10),
    )
    spec = digits_spec(**{"epochs": 12, "checkpoint_dir": str(tmp_path / "ckpt"), **run})
    return dataclasses.replace(
        spec,
        model=dataclasses.replace(spec.model, layers=layers),
        devices=Devices(select, stages="auto", micro_batches=4),
    )


@pytest.mark.parametrize("pair", ["cpu+cpu", "lavapipe+lavapipe"])
def test_a_batchnorm_cnn_split_over_two_devices_trains_the_digits_from_the_cli(tmp_path, request, pair):
    path = tmp_path / "cnn_split.json"
    flow.save(_cnn(_select(request, pair), tmp_path), path)
    command = [sys.executable, "-m", "flow", "plan", str(path)]
    planned = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, check=False)
    assert planned.returncode == 0 and "model split into 2 pipeline stages" in planned.stdout, planned.stderr
    done = subprocess.run([sys.executable, "-m", "flow", "run", str(path)], capture_output=True, text=True,
                          cwd=tmp_path, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    accuracy = float(done.stdout.strip().splitlines()[-1].split()[-1])
    assert accuracy >= 0.95, done.stdout


def test_resume_of_a_split_batchnorm_cnn_is_bit_exact(tmp_path):
    spec = _cnn(("cpu", "cpu"), tmp_path, epochs=2, checkpoint_every=5)
    straight = flow.run(_cnn(("cpu", "cpu"), tmp_path / "straight", epochs=2))
    flow.run(dataclasses.replace(spec, run=dataclasses.replace(spec.run, epochs=None, steps=15)))
    resumed = flow.run(spec, resume=tmp_path / "ckpt")
    assert resumed.resumed_from == 15 and resumed.steps == straight.steps == 46
    for name, value in straight.parameters.items():
        np.testing.assert_array_equal(resumed.parameters[name], value, err_msg=name)
    assert np.abs(straight.parameters["layers[6].running_mean"]).max() > 0

"""Generation: the sampling kernel against a float64 oracle on both backends (temperature, top-k
with ties, the inversion of the running sum at a uniform from the counter hash), the same draws to
the bit on CPU and Vulkan, draws that follow the probabilities, and ``flow.generate`` and
``python -m flow generate`` on a small character model trained in seconds on the standard
library's ``pydoc_data/topics.py``, with every mistake refused in one line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import flow
from actors import checkpoint as checkpoints
from actors.cpu_backend import CpuBackend
from actors.cpu_ops import sample_draw
from actors.single_op import run_op
from flow.generation import language_model, window
from flow.spec import (
    MSE,
    Adam,
    CrossEntropy,
    Data,
    Devices,
    Embedding,
    LayerNorm,
    Linear,
    Model,
    PositionalEmbedding,
    Repeat,
    Residual,
    RunSettings,
    SelfAttention,
    Spec,
    Text,
)

ROOT = Path(__file__).resolve().parents[1]
CORPUS = "stdlib:pydoc_data/topics.py"
T, D = 16, 32


def pcg(v: int) -> int:
    """dropout.comp's hash in Python integers (an oracle independent of numpy's uint32)."""
    state = (v * 747796405 + 2891336453) & 0xFFFFFFFF
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & 0xFFFFFFFF
    return (word >> 22) ^ word


def uniform(seed: int, step: int) -> float:
    return (pcg(pcg(0) ^ pcg(pcg(seed) ^ step)) >> 8) / 2**24


def oracle(logits: np.ndarray, top_k: int, temperature: float, u: float) -> tuple[int, np.ndarray]:
    """(the token, the cumulative probabilities) in float64: top-k by value, lowest index first."""
    order = sorted(range(len(logits)), key=lambda i: (-float(logits[i]), i))[:top_k]
    scaled = logits.astype(np.float64) / temperature
    weights = np.zeros(len(logits))
    weights[order] = np.exp(scaled[order] - scaled[order].max())
    cumulative = np.cumsum(weights / weights.sum())
    return int(np.argmax(cumulative > u)), cumulative


def draw_on(backend, logits: np.ndarray, position: int, step: int, **params) -> int:
    bindings = {"L": logits, "cursor": np.array([position, step], np.int32), "token": np.zeros(1, np.int32)}
    return int(run_op(backend, "sample_token", bindings, **params)["token"][0])


def test_the_kernel_draws_the_float64_oracle_token(backend, rng):
    for trial in range(24):
        vocab, rows = int(rng.integers(1, 200)), 3
        logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
        if trial % 3 == 0:  # many ties: top-k keeps the lowest indices among equals
            logits = np.round(logits / 2).astype(np.float32)
        top_k = [1, vocab, int(rng.integers(1, vocab + 1))][trial % 3]
        temperature = float(rng.choice([0.3, 1.0, 2.5]))
        position, step, seed = int(rng.integers(0, rows)), trial, int(rng.integers(0, 2**32))
        params = {"cols": vocab, "top_k": top_k, "seed": seed, "inv_temperature": 1 / temperature}
        token = draw_on(backend, logits, position, step, **params)
        u = uniform(seed, step)
        expected, cumulative = oracle(logits[position], top_k, temperature, u)
        if np.min(np.abs(cumulative - u)) > 1e-5:  # not a float32 rounding away from a boundary
            assert token == expected, (trial, vocab, top_k)
        kept = sorted(range(vocab), key=lambda i: (-float(logits[position, i]), i))[:top_k]
        assert token in kept
        if top_k == 1:
            assert token == int(np.argmax(logits[position]))


def test_cpu_and_vulkan_draw_the_same_tokens_to_the_bit(vulkan_backend, rng):
    cpu = CpuBackend()
    for trial in range(30):
        vocab = int(rng.integers(2, 300))
        logits = (rng.standard_normal((2, vocab)) * rng.choice([0.1, 3.0, 30.0])).astype(np.float32)
        top_k = int(rng.integers(1, vocab + 1))
        params = {"cols": vocab, "top_k": top_k, "seed": trial * 7919, "inv_temperature": 0.7}
        assert draw_on(cpu, logits, 1, trial, **params) == draw_on(vulkan_backend, logits, 1, trial, **params)


def test_draws_follow_the_probabilities_and_repeat_by_seed():
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4], np.float32))
    counts = np.bincount([sample_draw(logits, 4, 5, step, 1.0) for step in range(4000)], minlength=4)
    assert np.all(np.abs(counts / 4000 - [0.1, 0.2, 0.3, 0.4]) < 0.03), counts
    top2 = {sample_draw(logits, 2, 5, step, 1.0) for step in range(200)}
    assert top2 == {2, 3}
    hot = np.bincount([sample_draw(logits, 4, 5, step, 1 / 0.01) for step in range(200)], minlength=4)
    assert hot[3] == 200  # temperature near 0: greedy

    def draws(seed: int) -> list[int]:
        return [sample_draw(logits, 4, seed, step, 1.0) for step in range(50)]

    assert draws(9) == draws(9) and draws(9) != draws(10)


def gpt(vocab: int, causal: bool = True) -> Model:
    block = (
        Residual((LayerNorm(), SelfAttention(2, causal=causal))),
        Residual((LayerNorm(), Linear(4 * D, activation="gelu"), Linear(D))),
    )
    layers = (Embedding(vocab, D), PositionalEmbedding(), Repeat(1, block), LayerNorm(), Linear(vocab))
    return Model(input_shape=(T,), layers=layers, loss=CrossEntropy())


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A one-block character GPT trained for 40 steps on the CPU backend: its checkpoint folder."""
    from loaders.text import resolve, vocabulary

    folder = tmp_path_factory.mktemp("gpt") / "run"
    spec = Spec(
        model=gpt(len(vocabulary(resolve(CORPUS)))),
        optimiser=Adam(3e-3),
        data=Data(Text(CORPUS, context=T, stride=T), batch_size=32),
        run=RunSettings(steps=40, epochs=None, checkpoint_dir=str(folder)),
        devices=Devices("cpu"),
    )
    flow.run(spec)
    return folder


def test_generate_continues_the_prompt_in_the_vocabulary(trained, vulkan_backend):
    vocab = checkpoints.read_vocabulary(trained)
    text = flow.generate(trained, "The ", 30, seed=3)
    assert text.startswith("The ") and len(text) == 34 and set(text) <= set(vocab)
    assert flow.generate(trained, "The ", 30, seed=3) == text
    assert flow.generate(trained, "The ", 30, seed=4) != text
    assert flow.generate(trained, "The ", 30, seed=3, backend=vulkan_backend) == text
    long = flow.generate(trained, "x" * 40, 5, temperature=0.5, top_k=5)  # past T: the last T tokens
    assert long.startswith("x" * 40) and len(long) == 45


def test_top_k_one_is_the_greedy_argmax_of_predict(trained):
    saved = checkpoints.load(trained)
    context, _ = language_model(saved.spec.model)
    ids = [saved.vocabulary.index(c) for c in "def "]
    greedy = flow.generate(trained, "def ", 12, top_k=1, seed=123)
    for _ in range(12):
        x, position = window(ids, context)
        ids.append(int(np.argmax(flow.predict(saved, x)[0, position])))
    assert greedy == "".join(saved.vocabulary[i] for i in ids)


def test_the_window_holds_the_last_context_tokens_at_the_start():
    x, position = window([5, 6, 7], 4)
    assert x.tolist() == [5, 6, 7, 0] and position == 2
    x, position = window(list(range(10)), 4)
    assert x.tolist() == [6, 7, 8, 9] and position == 3


def flow_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flow", "generate", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )


def test_the_command_line_prints_the_generated_text(trained):
    options = ["--tokens", "20", "--temperature", "0.8", "--top-k", "10", "--seed", "2"]
    done = flow_cli(str(trained), "The ", *options)
    assert done.returncode == 0, done.stderr
    assert done.stdout == flow.generate(trained, "The ", 20, 0.8, 10, 2) + "\n"


def saved_with(trained: Path, tmp_path: Path, **changes) -> Path:
    """A copy of the trained checkpoint with ``changes`` (spec, vocabulary), in its own folder."""
    saved = dataclasses.replace(checkpoints.load(trained), **changes)
    return checkpoints.save(tmp_path / "changed", saved)


@pytest.mark.parametrize(
    "mistake, status, expected",
    [
        ("missing", 1, "no such checkpoint"),
        ("corrupt", 1, "corrupt.ckpt"),
        ("not a language model", 1, "not a language model"),
        ("not causal", 1, "causal"),
        ("no vocabulary", 1, "no vocabulary"),
        ("unknown character", 1, "'☃'"),
        ("tokens 0", 2, "tokens must be >= 1"),
        ("temperature 0", 2, "temperature must be > 0"),
        ("top-k 0", 2, "top_k must be >= 1"),
        ("top-k 1000", 1, "top_k must be <="),
    ],
)
def test_the_command_line_refuses_each_mistake_in_one_line(trained, tmp_path, mistake, status, expected):
    path, prompt, options = str(trained), "The ", ["--tokens", "3"]
    saved = checkpoints.load(trained)
    if mistake == "missing":
        path = str(tmp_path / "nowhere")
    elif mistake == "corrupt":
        (tmp_path / "corrupt.ckpt").write_bytes(b"not a checkpoint")
        path = str(tmp_path / "corrupt.ckpt")
    elif mistake == "not a language model":
        model = Model(input_shape=(T,), layers=(Linear(4),), loss=MSE())
        path = str(saved_with(trained, tmp_path, spec=dataclasses.replace(saved.spec, model=model)))
    elif mistake == "not causal":
        model = gpt(len(saved.vocabulary), causal=False)
        path = str(saved_with(trained, tmp_path, spec=dataclasses.replace(saved.spec, model=model)))
    elif mistake == "no vocabulary":
        path = str(saved_with(trained, tmp_path, vocabulary=None))
    elif mistake == "unknown character":
        prompt = "a☃"
    else:
        flag, value = mistake.split(" ")
        options = ["--tokens", "3", f"--{flag}", value]
    done = flow_cli(path, prompt, *options)
    assert done.returncode == status, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], done.stderr

"""Predictions from a trained model without trio: a checkpoint (or a spec, with fresh weights)
and inputs in, one array or a stream of arrays out, through the device's recorded predict program.
The spec's preprocessing is applied to the inputs, as in training. Also text generation from a
language model's checkpoint (``generate``), its tokens drawn on the device."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

import numpy as np

from actors import checkpoint as checkpoints
from actors.backend import Backend
from actors.device import predict_batches
from actors.messages import Batch
from actors.preprocess import transform_batch
from flow.codec import load as load_spec
from flow.generation import Sampling, generation_spec, language_model, settings_error, window
from flow.inputs import as_inputs, batch_bounds
from flow.planning import plan
from flow.runtime import open_backend, plan_on, start_engine
from flow.spec import Spec
from loaders.text import decode, encode


def _load_model(
    model: Spec | str | Path | checkpoints.Checkpoint,
) -> tuple[Spec, dict[str, np.ndarray] | None]:
    if isinstance(model, Spec):
        return model, None
    if isinstance(model, checkpoints.Checkpoint):
        return model.spec, model.state
    path = Path(model)
    if path.suffix in (".json", ".msgpack", ".mpk"):
        return load_spec(path), None
    if path.suffix == ".onnx":  # an ONNX model, its ops read as vkflow layers (flow.onnx_import)
        from flow.onnx_io import import_onnx

        return import_onnx(path)
    saved = checkpoints.load(path)
    return saved.spec, saved.state


def predict(
    model: Spec | str | Path | checkpoints.Checkpoint,
    data: np.ndarray | Any,
    *,
    stream: bool = False,
    backend: Backend | None = None,
) -> np.ndarray | Iterator[np.ndarray]:
    """Predictions from a trained model, through the device's predict program.

    Args:
        model: a checkpoint (file, directory or loaded), a spec (file or record: fresh weights),
            or an ONNX file (``.onnx``: its ops as vkflow layers, see flow.onnx_io).
        data: inputs [n, *input_shape] or one sample [*input_shape] of real numbers (bools and
            ints are cast to float32, complex is refused: see flow.inputs), or a source spec record
            (e.g. ``Digits()``: every sample, in index order). The spec's ``data.preprocess`` is
            applied either way.
        stream: yield one array per batch instead of returning one array.
        backend: a backend to use and keep open; None opens the one the spec selects.

    Returns:
        [n, *output_shape] (probabilities for CrossEntropy models), or a generator of such arrays.

    Raises:
        TypeError: inputs that are not real numbers (None, text, complex).
        ValueError: inputs of another shape, naming the shapes the model takes.
    """
    spec, state = _load_model(model)
    # Checked here, not in the generator, so that a bad input fails at the call even when streaming,
    # and before any device is opened.
    if not (is_dataclass(data) and not isinstance(data, type)):
        data = as_inputs(data, tuple(spec.model.input_shape))
    outputs = _predict_stream(spec, state, data, backend)
    if stream:
        return outputs
    parts = list(outputs)
    if parts:
        return np.concatenate(parts)
    out_shape = plan(spec).devices[0].layout.tensor("output").shape[1:]
    return np.zeros((0, *out_shape), np.float32)


def _predict_stream(spec: Spec, state, data, backend: Backend | None) -> Iterator[np.ndarray]:
    owned = backend is None
    backend = open_backend(spec.devices) if owned else backend
    source = None
    try:
        engine, _ = start_engine(plan_on(spec, backend.facts, mode="predict"), backend, state)
        if isinstance(data, np.ndarray):
            array = data

            def read(start: int, stop: int) -> np.ndarray:
                return array[start:stop]

            count = array.shape[0]
        else:
            from loaders import open_source

            source = open_source(data)
            count = len(source)

            def read(start: int, stop: int) -> np.ndarray:
                return source.read(np.arange(start, stop))[0]

        def batches() -> Iterator[np.ndarray]:
            for position, (start, stop) in enumerate(batch_bounds(count, spec.data.batch_size)):
                rows = read(start, stop)
                batch = Batch(
                    seq=position,
                    epoch=0,
                    position=position,
                    indices=np.arange(len(rows)),
                    x=rows,
                    y=None,
                    split="predict",
                )
                yield transform_batch(
                    batch, spec.data.preprocess, (), spec.data.seed, tuple(spec.model.input_shape)
                ).x

        yield from predict_batches(engine, batches())
    finally:
        if source is not None:
            source.close()
        if owned:
            backend.close()


def generate(
    checkpoint: str | Path | checkpoints.Checkpoint,
    prompt: str,
    tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    backend: Backend | None = None,
) -> str:
    """Text from a causal language model's checkpoint: the prompt, then ``tokens`` tokens drawn
    one at a time on the device (flow.generation says how the window is placed). Each token runs
    the whole window through the model again (no key/value cache: a window is short) and reads
    back only the drawn id; the same seed and logits give the same tokens on every backend.

    Args:
        checkpoint: a checkpoint (file, directory or loaded) of a run on a Text source.
        prompt: the text to continue, at least one token; every character in the vocabulary.
        tokens: how many tokens to add, >= 1.
        temperature: logits are divided by it, > 0 (lower: surer).
        top_k: draw only among the top_k likeliest tokens, 1..V (None: all; 1: greedy).
        seed: the draws' seed, in [0, 2**32).
        backend: a backend to use and keep open; None opens the one the spec selects.

    Returns:
        The prompt followed by the generated text.

    Raises:
        CheckpointError: no readable checkpoint there.
        ValueError: a bad setting, a model that is not a causal language model, a checkpoint with
            no vocabulary, or a prompt character the vocabulary lacks.
    """
    sampling = Sampling(temperature, top_k, seed)
    if problem := settings_error(tokens, sampling):  # before any file is read
        raise ValueError(problem)
    saved = checkpoint if isinstance(checkpoint, checkpoints.Checkpoint) else checkpoints.load(checkpoint)
    context, vocabulary = language_model(saved.spec.model)
    if problem := settings_error(tokens, sampling, vocabulary):
        raise ValueError(problem)
    if saved.vocabulary is None:
        raise ValueError("the checkpoint has no vocabulary: its run did not train on a Text source")
    if not prompt:
        raise ValueError("the prompt is empty: generation continues at least one token")
    ids = encode(prompt, saved.vocabulary).tolist()
    spec = generation_spec(saved.spec)
    owned = backend is None
    backend = open_backend(spec.devices) if owned else backend
    try:
        the_plan = plan_on(spec, backend.facts, mode="generate", sampling=sampling)
        engine, _ = start_engine(the_plan, backend, saved.state)
        for step in range(tokens):
            x, position = window(ids, context)
            engine.write_batch(0, x[None])
            backend.write("cursor", np.array([position, step], np.int32))
            backend.wait(engine.submit("generate", 0, 1))
            ids.append(int(backend.read("token")[0]))
    finally:
        if owned:
            backend.close()
    return decode(ids, saved.vocabulary)

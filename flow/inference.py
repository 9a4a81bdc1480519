"""Predictions from a trained model without trio: a checkpoint (or a spec, with fresh weights)
and inputs in, one array or a stream of arrays out, through the device's recorded predict program.
The spec's preprocessing is applied to the inputs, as in training."""

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
from flow.inputs import as_inputs, batch_bounds
from flow.planning import plan
from flow.runtime import open_backend, plan_on, start_engine
from flow.spec import Spec


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
        model: a checkpoint (file, directory or loaded), or a spec (file or record: fresh weights).
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

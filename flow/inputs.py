"""What a model accepts as inputs to predict on, and how they are cut into batches, decided in one
place for ``flow.predict`` and ``PipelineHandle.feed``: a batch ``[n, *input_shape]`` or one sample
``[*input_shape]`` of real numbers. Booleans and integers become float32 the way numpy's
``astype(np.float32)`` and torch's ``.float()`` make them (True is 1.0; integers beyond 2**24 round
to the nearest float32). Complex numbers are refused: a model's inputs are real, and silently
dropping the imaginary part (what numpy's cast does, with only a warning) would predict on data the
caller never meant. Anything else (None, a scalar, text, a ragged list, a wrong shape) is refused
with the shape expected. Inputs go in batches of ``data.batch_size`` consecutive rows
(:func:`batch_bounds`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np


def expected(input_shape: tuple[int, ...]) -> str:
    """The input shapes a model takes, in words.

    Args:
        input_shape: the model's input shape, without the batch dimension.

    Returns:
        E.g. ``[n, 4] (a batch) or [4] (one sample)``.
    """
    dims = ", ".join(str(d) for d in input_shape)
    return f"[n, {dims}] (a batch) or [{dims}] (one sample)"


def as_inputs(data: Any, input_shape: tuple[int, ...], *, what: str = "predict") -> np.ndarray:
    """Inputs as a float32 batch ``[n, *input_shape]``, or a clear error.

    Args:
        data: an array-like of real numbers (numpy array, nested lists, anything ``np.asarray``
            takes).
        input_shape: the model's input shape, without the batch dimension.
        what: the function's name, for the messages.

    Returns:
        A float32 array of shape ``[n, *input_shape]`` (n may be 0); a float32 input is not copied.

    Raises:
        TypeError: None, text or objects, or complex numbers.
        ValueError: a scalar, a ragged list, or a shape other than the two the model takes.
    """
    if data is None or isinstance(data, str | bytes):
        raise TypeError(f"{what} takes an array of shape {expected(input_shape)}, got {type(data).__name__}")
    try:
        array = np.asarray(data)
    except ValueError as error:  # ragged nested lists
        raise ValueError(
            f"{what} takes an array of shape {expected(input_shape)}; these inputs make no array ({error})"
        ) from error
    kind = array.dtype.kind
    if kind == "c":
        raise TypeError(
            f"{what} takes real inputs, got complex ({array.dtype}): pass x.real or np.abs(x), "
            "whichever the model was trained on"
        )
    if kind not in "biuf":
        raise TypeError(f"{what} takes numbers, got an array of {array.dtype} (dtype kind {kind!r})")
    if array.shape == tuple(input_shape):
        array = array[None]
    if array.shape[1:] != tuple(input_shape):
        raise ValueError(f"{what} takes inputs of shape {expected(input_shape)}, got shape {array.shape}")
    return array.astype(np.float32, copy=False)


def batch_bounds(count: int, size: int) -> Iterator[tuple[int, int]]:
    """How ``count`` inputs are cut into batches for prediction: consecutive rows, ``size`` a batch,
    the last batch holding what is left. The one cut for ``flow.predict`` and ``PipelineHandle.feed``.

    Args:
        count: rows in all (0 gives no batch).
        size: the most rows a batch holds (the spec's ``data.batch_size``), >= 1.

    Returns:
        ``(start, stop)`` row bounds of each batch, in order; the last has ``stop == count``.
    """
    for start in range(0, count, size):
        yield start, min(start + size, count)


def token_id_error(ids: np.ndarray, vocabulary: int, first: int = 0) -> str | None:
    """Why ``ids`` (a batch, each sample's ids flattened in order) are not token ids of a table of
    ``vocabulary`` rows, naming the first bad one; None when every one is an integer in
    [0, vocabulary). One check for every backend: the CPU op refuses a bad id, and a GPU would
    clamp it into range and train on the wrong row without a word.

    Args:
        ids: float ids [n, ...].
        vocabulary: the Embedding's num_embeddings.
        first: the number of the batch's first sample, for the message.

    Returns:
        The message, or None.
    """
    flat = np.asarray(ids).reshape(len(ids), -1)
    bad = np.argwhere(~((flat >= 0) & (flat < vocabulary) & (flat == np.floor(flat))))
    if not len(bad):
        return None
    row, position = (int(i) for i in bad[0])
    return (
        f"Embedding: token id {float(flat[row, position])!r} (sample {first + row}, position {position}) is "
        f"not an integer in [0, {vocabulary}): ids index the table of num_embeddings={vocabulary} rows"
    )

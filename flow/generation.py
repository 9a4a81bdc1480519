"""Text generation's decisions, as pure functions: which models can generate, the settings' checks,
the spec a generation plans from (one row, one slot), the sampling launch's parameters, and the
window of tokens the model sees at each step. flow.inference.generate does the effects.

The model has a fixed context T and learned positions, so the tokens so far sit at positions
0..n-1 (the last T of them once there are more) and the next token is drawn from the logits at
position n-1. The positions after n-1 hold padding, which position n-1 cannot see under causal
attention: hence generation needs every SelfAttention causal.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from flow.model_graph import MODEL_INPUT, expand
from flow.spec import Spec
from flow.spec_model import CrossEntropy, Embedding, Model, SelfAttention


@dataclass(frozen=True)
class Sampling:
    """How each token is drawn: logits / temperature, the top_k largest kept (None: all), softmax,
    and a uniform hashed from (seed, the token's index)."""

    temperature: float = 1.0
    top_k: int | None = None
    seed: int = 0


def settings_error(tokens: int, sampling: Sampling, vocabulary: int | None = None) -> str | None:
    """What is wrong with the settings (None: nothing); ``vocabulary``, the model's V, when known."""
    if tokens < 1:
        return f"tokens must be >= 1, got {tokens}"
    if not sampling.temperature > 0:
        return f"temperature must be > 0, got {sampling.temperature}"
    if sampling.top_k is not None and sampling.top_k < 1:
        return f"top_k must be >= 1, got {sampling.top_k}"
    if sampling.top_k is not None and vocabulary is not None and sampling.top_k > vocabulary:
        return f"top_k must be <= the vocabulary's {vocabulary} tokens, got {sampling.top_k}"
    if not 0 <= sampling.seed < 2**32:
        return f"seed must be in [0, 2**32), got {sampling.seed}"
    return None


def language_model(model: Model) -> tuple[int, int]:
    """The context T and vocabulary size V of a causal language model.

    Raises:
        ValueError: the model's input is not (T,) token ids read by an Embedding, its output not
            (T, V) logits with a CrossEntropy loss, or a SelfAttention is not causal.
    """
    expansion = expand(model)
    nodes, shape = expansion.nodes, tuple(model.input_shape)
    out = nodes[expansion.output].out_shape if nodes and not expansion.problems else None
    readers = [n.layer for n in nodes if MODEL_INPUT in n.inputs]
    embedded = bool(readers) and all(isinstance(layer, Embedding) for layer in readers)
    if not (len(shape) == 1 and embedded and out is not None and len(out) == 2 and out[0] == shape[0]):
        raise ValueError(
            f"not a language model: generation needs (T,) token ids read by an Embedding in and "
            f"(T, V) logits out; this model takes {shape} and gives {out}"
        )
    if not isinstance(model.loss, CrossEntropy):
        raise ValueError(f"not a language model: its loss is {type(model.loss).__name__}, not CrossEntropy")
    for node in nodes:
        if isinstance(node.layer, SelfAttention) and not node.layer.causal:
            raise ValueError(f"{node.where}: generation needs causal attention, not causal=False")
    return shape[0], out[1]


def generation_spec(spec: Spec) -> Spec:
    """The spec a generation plans from: one row at a time, one input slot (each token waits for
    the one before it)."""
    return replace(spec, data=replace(spec.data, batch_size=1), run=replace(spec.run, in_flight=1))


def sample_params(sampling: Sampling, vocabulary: int) -> dict[str, float]:
    """The sample_token launch's parameters (shaders/sample_token.comp) for a vocabulary of V."""
    top_k = vocabulary if sampling.top_k is None else sampling.top_k
    return {"top_k": top_k, "seed": sampling.seed, "inv_temperature": 1.0 / sampling.temperature}


def window(ids: list[int], context: int) -> tuple[np.ndarray, int]:
    """(the model's input for the next token: float32 [context], the last ``context`` of ``ids``
    (at least one) from position 0, zeros after; the position of the last id, to draw from)."""
    last = ids[-context:]
    x = np.zeros(context, np.float32)
    x[: len(last)] = last
    return x, len(last) - 1

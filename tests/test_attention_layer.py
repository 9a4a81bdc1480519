"""SelfAttention and PositionalEmbedding as layers: their parameters and shapes, the plan keeps no
(T x T) tensor, whole-model gradients (causal and not, with and without biases, inside a small
GPT) against central differences on the float64 CPU backend, Vulkan against the CPU on partial
batches, and the layer's forward pass and every gradient against an independent float64 numpy
implementation of PyTorch's multi-head attention (and torch itself where it is installed).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from layer_programs import (
    check_gradients_by_differences,
    check_partial_batch_matches_rows_alone,
    layer_spec,
    nudged_parameters,
    run_train_program,
)

from actors.cpu_backend import CpuBackend
from flow.planning import plan
from flow.shapes import count_parameters
from flow.spec import (
    MSE,
    CrossEntropy,
    Embedding,
    LayerNorm,
    Linear,
    Model,
    PositionalEmbedding,
    Repeat,
    Residual,
    SelfAttention,
)
from flow.summary import summarize

try:
    import torch
except ImportError:  # torch is an optional second oracle
    torch = None


def attention_model(t: int, d: int, heads: int, causal: bool = True, bias: bool = True) -> Model:
    return Model(
        input_shape=(t, d),
        layers=(SelfAttention(heads, causal=causal, bias=bias), Linear(3)),
        loss=MSE(),
    )


SMALL_GPT = Model(
    input_shape=(7,),
    layers=(
        Embedding(11, 8),
        PositionalEmbedding(),
        Repeat(2, (
            Residual((LayerNorm(), SelfAttention(4))),
            Residual((LayerNorm(), Linear(16, activation="gelu"), Linear(8))),
        )),
        LayerNorm(),
        Linear(11),
    ),
    loss=CrossEntropy(),
)  # fmt: skip
MODELS = [
    attention_model(5, 8, 2),
    attention_model(6, 6, 3, causal=False),
    attention_model(1, 4, 1),
    attention_model(9, 12, 2, bias=False),
    SMALL_GPT,
]
IDS = ["causal", "not_causal", "one_position", "no_bias", "small_gpt"]


def test_parameters_and_no_t_by_t_tensor():
    model = attention_model(33, 12, 3)
    assert count_parameters(model) == 4 * 12 * 12 + 4 * 12 + 12 * 3 + 3
    device = plan(layer_spec(model, batch=4)).devices[0]
    names = {p.name: p.shape for p in device.parameters}
    assert names["layers[0].qkv_weight"] == (12, 36) and names["layers[0].out_bias"] == (12,)
    # Flash style: no tensor holds a head's 33 x 33 scores; each row keeps its log-sum-exp.
    shapes = {tensor.name: tensor.shape for tensor in device.layout.tensors}
    assert not [name for name, shape in shapes.items() if shape[-2:] == (33, 33)]
    assert shapes["lse[0]"] == (4, 3, 33)
    assert "SelfAttention(3)" in summarize(layer_spec(model, batch=4))


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_whole_model_gradients_match_finite_differences(model, rng):
    check_gradients_by_differences(model, rng, probes=4)


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_partial_batch_on_cpu_and_vulkan_matches_its_rows_alone(model, rng, vulkan_backend):
    check_partial_batch_matches_rows_alone(model, rng, vulkan_backend)


def numpy_attention(x, params, heads: int, causal: bool):
    """PyTorch's MultiheadAttention(x, x, x) in float64 with GPT-2's fused qkv layout."""
    n, t, d = x.shape
    dh = d // heads
    qkv = x @ params["qkv_weight"] + params["qkv_bias"]
    q, k, v = (qkv[..., i * d : (i + 1) * d].reshape(n, t, heads, dh).transpose(0, 2, 1, 3) for i in range(3))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh)
    if causal:
        scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    y = (weights @ v).transpose(0, 2, 1, 3).reshape(n, t, d)
    return y @ params["out_weight"] + params["out_bias"]


@pytest.mark.parametrize("causal", [True, False])
def test_the_layer_against_an_independent_oracle(causal, rng, vulkan_backend):
    """The model's MSE loss and the gradients of every attention parameter: vkflow on the CPU and on
    Vulkan against the numpy oracle above, differentiated by central differences of its own loss
    (independent of vkflow's backward rules), and against torch's autograd where torch exists."""
    t, d, heads, rows = 6, 8, 2, 3
    model = Model(input_shape=(t, d), layers=(SelfAttention(heads, causal=causal),), loss=MSE())
    device = plan(layer_spec(model, batch=rows)).devices[0]
    params = nudged_parameters(device, rng)
    x = rng.standard_normal((rows, t, d))
    y = rng.standard_normal((rows, t, d))
    own = {name.removeprefix("layers[0]."): value for name, value in params.items()}

    def oracle_loss(values):
        return float(((numpy_attention(x, values, heads, causal) - y) ** 2).mean())

    want_loss = oracle_loss(own)
    for backend, tol in ((CpuBackend(precision="float64"), 1e-8), (vulkan_backend, 2e-4)):
        backend.open_layout(device.layout)
        loss, grads, _ = run_train_program(device, backend, params, x, y)
        assert loss == pytest.approx(want_loss, rel=tol)
        for name, grad in grads.items():
            key = name.removeprefix("layers[0].")
            for index in rng.choice(grad.size, size=4, replace=False):
                shifted = {k: v.copy() for k, v in own.items()}
                shifted[key].reshape(-1)[index] += 1e-6
                up = oracle_loss(shifted)
                shifted[key].reshape(-1)[index] -= 2e-6
                numeric = (up - oracle_loss(shifted)) / 2e-6
                assert grad.reshape(-1)[index] == pytest.approx(numeric, rel=max(tol, 1e-5), abs=1e-7), name
    if torch is not None:
        tensors = {k: torch.tensor(v, requires_grad=True) for k, v in own.items()}
        xt = torch.tensor(x)
        qkv = xt @ tensors["qkv_weight"] + tensors["qkv_bias"]
        q, k, v = (
            qkv[..., i * d : (i + 1) * d].reshape(rows, t, heads, -1).transpose(1, 2) for i in range(3)
        )
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out = att.transpose(1, 2).reshape(rows, t, d) @ tensors["out_weight"] + tensors["out_bias"]
        torch_loss = ((out - torch.tensor(y)) ** 2).mean()
        torch_loss.backward()
        backend = CpuBackend(precision="float64")
        backend.open_layout(device.layout)
        _, grads, _ = run_train_program(device, backend, params, x, y)
        assert torch_loss.item() == pytest.approx(want_loss, rel=1e-10)
        for name, grad in grads.items():
            np.testing.assert_allclose(
                grad, tensors[name.removeprefix("layers[0].")].grad.numpy(), rtol=1e-7, atol=1e-10
            )

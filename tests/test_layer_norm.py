"""LayerNorm: the ops forward and backward on every backend against a float64 numpy oracle (and
torch where it is installed), with odd sizes and partial batches whose padding rows must take no
part; then the layer in a model: shapes and parameters, the spec files, a bad spec named by its
path, whole-model gradients against finite differences, the same programs on CPU and Vulkan, and
an MLP with a LayerNorm learning the bundled digits through ``flow.run``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import relative_error
from layer_programs import (
    check_gradients_by_differences,
    check_learns_the_digits,
    check_partial_batch_matches_rows_alone,
    layer_spec,
)

from actors.single_op import run_op
from flow.codec import dumps, encode, load, loads, save
from flow.planning import init_parameters, plan
from flow.shapes import count_parameters, infer_shapes
from flow.spec import (
    MSE,
    CrossEntropy,
    Flatten,
    LayerNorm,
    Linear,
    Model,
)
from flow.validation import validate

try:
    import torch
except ImportError:  # torch is an optional second oracle
    torch = None

TOL = 1e-5


def as64(array: np.ndarray) -> np.ndarray:
    return np.asarray(array, dtype=np.float64)


def layer_norm_oracle(x, gamma, beta, dy, real: int, eps: float):
    """Layer normalisation of x [N, R, D] over D, in float64, for the first ``real`` samples: the
    output, the input gradient by the textbook formula, dgamma and dbeta."""
    x, dy, gamma = as64(x)[:real], as64(dy)[:real], as64(gamma)
    mean = x.mean(axis=2, keepdims=True)
    invstd = 1.0 / np.sqrt(x.var(axis=2, keepdims=True) + eps)
    xhat = (x - mean) * invstd
    y = gamma * xhat + as64(beta)
    dxhat = dy * gamma
    d = x.shape[2]
    dx = (invstd / d) * (
        d * dxhat - dxhat.sum(axis=2, keepdims=True) - xhat * (dxhat * xhat).sum(axis=2, keepdims=True)
    )
    return y, dx, (dy * xhat).sum(axis=(0, 1)), dy.sum(axis=(0, 1))


def run_layer_norm(backend, x, gamma, beta, dy, real: int, eps: float):
    """The three ops in the order a train program runs them, each through run_op."""
    n, r, d = x.shape
    dims = dict(N=n, R=r, D=d, eps=eps)
    stepvals = np.array([0.0, 1.0, 1.0, 1.0, real, real], np.float32)
    forward = run_op(
        backend,
        "layernorm",
        {"X": x, "gamma": gamma, "beta": beta, "Y": np.zeros_like(x),
         "stats": np.zeros((n, 2 * r), np.float32)},
        **dims,
    )  # fmt: skip
    reduced = run_op(
        backend,
        "layernorm_backward_reduce",
        {"dY": dy, "X": x, "stats": forward["stats"], "dgamma": np.full(d, np.nan, np.float32),
         "dbeta": np.full(d, np.nan, np.float32), "stepvals": stepvals},
        **dims,
    )  # fmt: skip
    dx = run_op(
        backend,
        "layernorm_backward_data",
        {"dY": dy, "X": x, "stats": forward["stats"], "gamma": gamma, "stepvals": stepvals,
         "dX": np.full_like(x, np.nan), "addend": np.full_like(x, np.nan)},  # not read: no accumulate
        **dims,
    )["dX"]  # fmt: skip
    return forward["Y"], dx, reduced["dgamma"], reduced["dbeta"]


# (N, R, D, real samples): R 1 is a flat (F,) input; D past the 256 threads of a workgroup makes
# each thread add several values; fewer real samples than N leave padding rows.
NORM_CASES = [
    (4, 1, 7, 4),
    (5, 1, 13, 3),
    (6, 3, 5, 6),
    (7, 3, 5, 2),
    (3, 2, 300, 3),
    (300, 1, 13, 299),
]


@pytest.mark.parametrize("n,r,d,real", NORM_CASES)
def test_layer_norm_ops_forward_and_backward(backend, rng, n, r, d, real):
    eps = 1e-5
    # Offset and scaled rows: a variance far from 1 and a mean far from 0 must be measured.
    x = (rng.standard_normal((n, r, d)) * 3.0 + 2.0).astype(np.float32)
    x[real:] = 1e4 * rng.standard_normal(x[real:].shape)  # padding: must change nothing
    gamma, beta = rng.standard_normal(d).astype(np.float32), rng.standard_normal(d).astype(np.float32)
    dy = rng.standard_normal((n, r, d)).astype(np.float32)
    dy[real:] = 1e3  # even a gradient on padding rows must not reach dgamma, dbeta or dX
    y, dx, dgamma, dbeta = run_layer_norm(backend, x, gamma, beta, dy, real, eps)
    y_ref, dx_ref, dgamma_ref, dbeta_ref = layer_norm_oracle(x, gamma, beta, dy, real, eps)

    assert relative_error(y[:real], y_ref) <= TOL
    assert relative_error(dgamma, dgamma_ref) <= TOL
    assert relative_error(dbeta, dbeta_ref) <= TOL
    assert relative_error(dx[:real], dx_ref) <= 1e-4  # a difference of near-equal sums
    np.testing.assert_array_equal(dx[real:], 0.0)

    if torch is not None:
        tx = torch.from_numpy(as64(x[:real])).requires_grad_()
        tg = torch.from_numpy(as64(gamma)).requires_grad_()
        tb = torch.from_numpy(as64(beta)).requires_grad_()
        ty = torch.nn.functional.layer_norm(tx, (d,), tg, tb, eps=eps)
        ty.backward(torch.from_numpy(as64(dy[:real])))
        assert relative_error(y[:real], ty.detach().numpy()) <= TOL
        assert relative_error(dx[:real], tx.grad.numpy()) <= 1e-4
        assert relative_error(dgamma, tg.grad.numpy()) <= TOL
        assert relative_error(dbeta, tb.grad.numpy()) <= TOL


# ---------------------------------------------------------------------------------------------
# The layer in a model

FLAT = Model(
    input_shape=(7,),
    layers=(LayerNorm(), Linear(13, activation="tanh"), LayerNorm(eps=1e-3), Linear(4)),
    loss=CrossEntropy(),
)
SEQUENCE = Model(
    input_shape=(3, 5),
    layers=(LayerNorm(), Flatten(), Linear(6, activation="relu"), LayerNorm(), Linear(2)),
    loss=MSE(),
)
MODELS, IDS = [FLAT, SEQUENCE], ["flat", "sequence"]


def test_shapes_parameters_and_initial_values():
    assert infer_shapes(SEQUENCE) == [(3, 5), (15,), (6,), (6,), (2,)]
    assert count_parameters(SEQUENCE) == 2 * 5 + (15 * 6 + 6) + 2 * 6 + (6 * 2 + 2)
    device = plan(layer_spec(SEQUENCE, 4)).devices[0]
    assert all(p.trainable for p in device.parameters)  # no running statistics
    values = init_parameters(device, "he", 0)
    np.testing.assert_array_equal(values["layers[0].weight"], np.ones(5))
    np.testing.assert_array_equal(values["layers[0].bias"], np.zeros(5))
    # The same forward launch in train and eval: no batch statistics.
    for name in ("train", "eval"):
        ops = [launch.op for launch in device.program(name).launches]
        assert ops.count("layernorm") == 2, name


def test_spec_files_round_trip(tmp_path):
    spec = layer_spec(dataclasses.replace(SEQUENCE, layers=(LayerNorm(eps=1e-3), *SEQUENCE.layers[1:])), 8)
    assert validate(spec) == []
    assert loads(dumps(spec)) == spec
    for name in ("spec.json", "spec.msgpack"):
        save(spec, tmp_path / name)
        assert load(tmp_path / name) == spec
    assert encode(spec)["model"]["layers"][0] == {"eps": 1e-3, "kind": "LayerNorm"}


@pytest.mark.parametrize(
    "layers, input_shape, path, words",
    [
        ((Flatten(), LayerNorm(eps=0.0), Linear(3)), (3, 5), "model.layers[1].eps", "must be > 0"),
        ((LayerNorm(eps=-1e-5), Linear(3)), (7,), "model.layers[0].eps", "must be > 0"),
        ((LayerNorm(), Flatten(), Linear(3)), (3, 7, 5), "model.layers[0]", "LayerNorm needs a (features,)"),
    ],
)
def test_bad_layer_norms_are_named_by_their_path(layers, input_shape, path, words):
    spec = layer_spec(Model(input_shape=input_shape, layers=layers, loss=CrossEntropy()), 4)
    problems = validate(spec)
    assert len(problems) == 1 and problems[0].path == path and words in problems[0].message, problems


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_whole_model_gradients_match_finite_differences(model, rng):
    check_gradients_by_differences(model, rng, probes=4)


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_partial_batch_on_cpu_and_vulkan_matches_its_rows_alone(model, rng, vulkan_backend):
    check_partial_batch_matches_rows_alone(model, rng, vulkan_backend)


def test_an_mlp_with_a_layer_norm_learns_the_digits(vulkan_backend):
    model = Model(
        input_shape=(1, 8, 8),
        layers=(Flatten(), Linear(64), LayerNorm(), Linear(32, activation="relu"), LayerNorm(), Linear(10)),
        loss=CrossEntropy(),
    )
    check_learns_the_digits(model, vulkan_backend, epochs=4)

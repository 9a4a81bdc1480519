"""Dynamic loss scaling (RunSettings.loss_scale, flow.optim.LOSS_SCALE): the update with a scale
divided out equals the update on the unscaled gradients bit for bit on both backends (a power of
two scales exactly); an overflow skips the step, leaving every weight and state as it was, and
halves the scale; a streak doubles it; whole runs on float32 equal runs without scaling, resume
exactly with the scale's state in the checkpoint, and learn through overflowing first steps; with
mixed precision on a device with cooperative matrices the digits train as well as float32; the
spec's validation and round trip."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import flow
from actors import checkpoint
from actors.backend import run_program
from actors.single_op import single_op_layout
from flow.codec import dumps, load, save
from flow.errors import SpecError
from flow.optim import (
    AUTO_LOSS_SCALE,
    CLIP_TENSORS,
    LOSS_SCALE,
    LOSS_SCALE_GROWTH,
    initial_loss_scale,
    optimiser_state_names,
    step_values,
    update_groups,
)
from flow.planning import plan
from flow.program import Program, with_barriers
from flow.spec import SGD, Adam, AdamW
from flow.validation import check, validate
from tests.specs import digits_spec, synthetic_spec

OPTIMISERS = {
    "sgd-momentum": SGD(0.1, momentum=0.9, weight_decay=1e-2),
    "adam": Adam(0.01, weight_decay=1e-2),
    "adamw-clipped": AdamW(0.01, weight_decay=0.1, clip_norm=0.5),
}


def updated(backend, optimiser, p0, grads, scale=None, streak=0.0):
    """The plan's update launches run once per gradient on ``backend``; with ``scale`` the scaled
    variant (loss_scale_update, the _clip update) from the state [scale, streak, 0]. Returns the
    final arrays and the loss scale's state after each step."""
    n = p0.size
    arrays = {"params:all": p0, "grads:all": grads[0], "stepvals": step_values(optimiser, 0, 1)}
    arrays |= {f"state:{name}": np.zeros(n, np.float32) for name in optimiser_state_names(optimiser)}
    arrays |= {name: np.zeros(floats, np.float32) for name, floats in CLIP_TENSORS}
    arrays[LOSS_SCALE] = np.array([scale or 1.0, streak, 0.0], np.float32)
    backend.open_layout(single_op_layout(arrays))
    for name, array in arrays.items():
        backend.write(name, array)
    program = Program("update", with_barriers(update_groups(optimiser, n, scaled=scale is not None)))
    states = []
    for step, grad in enumerate(grads):
        backend.write("grads:all", grad)
        backend.write("stepvals", step_values(optimiser, step, 1))
        run_program(backend, program)
        states.append(backend.read(LOSS_SCALE))
    return {name: backend.read(name) for name in arrays if name.startswith(("params", "state"))}, states


@pytest.mark.parametrize("name", OPTIMISERS)
@pytest.mark.parametrize("n", [7, 70001])
def test_the_scaled_update_is_the_unscaled_one_bit_for_bit(backend, rng, name, n):
    optimiser = OPTIMISERS[name]
    scale = 2.0**16
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [(rng.standard_normal(n) * 1e-3).astype(np.float32) for _ in range(3)]
    plain, _ = updated(backend, optimiser, p0, grads)
    scaled, states = updated(backend, optimiser, p0, [g * np.float32(scale) for g in grads], scale)
    for key, value in plain.items():
        np.testing.assert_array_equal(scaled[key], value, err_msg=key)
    assert not np.array_equal(plain["params:all"], p0)
    assert [s.tolist() for s in states] == [[scale, 1, 0], [scale, 2, 0], [scale, 3, 0]]


@pytest.mark.parametrize("name", OPTIMISERS)
def test_an_overflow_skips_the_step_and_halves_the_scale(backend, rng, name):
    optimiser = OPTIMISERS[name]
    n, scale = 1001, 2.0**20
    p0 = rng.standard_normal(n).astype(np.float32)
    good = (rng.standard_normal(n) * scale).astype(np.float32)
    bad = good.copy()
    bad[rng.integers(n)] = np.inf
    first, _ = updated(backend, optimiser, p0, [good], scale)
    skipped, states = updated(backend, optimiser, p0, [bad, good * np.float32(0.5)], scale)
    # The bad step left everything as it was; the good one then ran at half the scale, on the same
    # true gradients as ``first``'s, so it lands where ``first`` did (Adam's step count aside).
    assert states[0].tolist() == [scale / 2, 0, 1] and states[1].tolist() == [scale / 2, 1, 1]
    if isinstance(optimiser, SGD):
        for key, value in first.items():
            np.testing.assert_array_equal(skipped[key], value, err_msg=key)
    only_bad, _ = updated(backend, optimiser, p0, [bad], scale)
    np.testing.assert_array_equal(only_bad["params:all"], p0)
    for key, value in only_bad.items():
        if key.startswith("state:"):
            np.testing.assert_array_equal(value, np.zeros(n, np.float32), err_msg=key)


def test_a_streak_of_good_steps_doubles_the_scale(backend, rng):
    n = 301
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    _, states = updated(backend, SGD(0.1), p0, grads, 1024.0, streak=LOSS_SCALE_GROWTH - 1)
    assert [s.tolist() for s in states] == [[2048.0, 0, 0], [2048.0, 1, 0]]


# -- the plan and whole runs ------------------------------------------------------------------------


def _run(spec, **run):
    return dataclasses.replace(spec, run=dataclasses.replace(spec.run, **run))


def test_the_plan_scales_only_where_asked():
    spec = synthetic_spec()
    assert initial_loss_scale("auto", "float32") is None and initial_loss_scale("off", "mixed") is None
    assert initial_loss_scale("auto", "mixed") == AUTO_LOSS_SCALE
    assert initial_loss_scale(8.0, "float32") == 8.0
    plain = plan(spec).devices[0]
    ops = [launch.op for launch in plain.program("train").launches]
    assert plain.loss_scale is None and "loss_scale_apply" not in ops and ops[-1] == "adam"
    device = plan(_run(spec, loss_scale=256.0)).devices[0]
    train = [launch.op for launch in device.program("train").launches]
    assert device.loss_scale == 256.0 and train[-3:] == ["grad_norm", "loss_scale_update", "adam_clip"]
    # The loss's gradient is scaled before the first backward launch reads it.
    assert train.index("loss_scale_apply") == train.index("softmax_xent_totals") + 1
    for kind in ("eval", "predict"):
        assert "loss_scale_apply" not in [launch.op for launch in device.program(kind).launches]


@pytest.mark.parametrize("clip", [None, 0.5])
def test_a_float32_run_with_a_power_of_two_scale_is_the_run_without(backend, clip, tmp_path):
    spec = digits_spec(epochs=1, steps=12)
    spec = dataclasses.replace(spec, optimiser=dataclasses.replace(spec.optimiser, clip_norm=clip))
    runs = {}
    for label, scale in (("off", "off"), ("scaled", 2.0**16)):
        folder = tmp_path / label
        runs[label] = flow.run(_run(spec, loss_scale=scale, checkpoint_dir=str(folder)), backend=backend)
    for name, value in runs["off"].parameters.items():
        np.testing.assert_array_equal(runs["scaled"].parameters[name], value, err_msg=name)
    saved = checkpoint.load(tmp_path / "scaled").state
    assert saved[LOSS_SCALE].tolist() == [2.0**16, 12, 0]
    assert LOSS_SCALE not in checkpoint.load(tmp_path / "off").state


def test_overflowing_first_steps_are_skipped_and_the_run_learns_and_resumes_exactly(tmp_path):
    """From 2^90 the first steps' gradients overflow float32's sum of squares: each is skipped and
    halves the scale until the gradients fit; the run then learns, and stopping half way and
    resuming gives the same bits as the straight run, loss scale included."""
    spec = _run(digits_spec(epochs=3), loss_scale=2.0**90, checkpoint_every=10)
    straight = flow.run(_run(spec, checkpoint_dir=str(tmp_path / "straight")))
    state = checkpoint.load(tmp_path / "straight").state[LOSS_SCALE]
    scale, streak, skipped = state.tolist()
    assert skipped >= 1 and scale == 2.0 ** (90 - skipped) and streak == straight.steps - skipped
    assert straight.accuracy > 0.9
    half = _run(spec, checkpoint_dir=str(tmp_path / "resumed"), steps=straight.steps // 2)
    flow.run(half)
    resumed = flow.run(_run(spec, checkpoint_dir=str(tmp_path / "resumed")), resume=tmp_path / "resumed")
    np.testing.assert_array_equal(checkpoint.load(tmp_path / "resumed").state[LOSS_SCALE], state)
    for name, value in straight.parameters.items():
        np.testing.assert_array_equal(resumed.parameters[name], value, err_msg=name)


def test_mixed_precision_with_loss_scaling_learns_the_digits_like_float32(vulkan_backend):
    if "cooperative_matrix" not in vulkan_backend.facts.features:
        pytest.skip(f"{vulkan_backend.facts.name} has no cooperative matrices: 'mixed' needs them")
    spec = digits_spec(epochs=10)
    full = flow.run(spec, backend=vulkan_backend)
    mixed = flow.run(_run(spec, precision="mixed"), backend=vulkan_backend)
    assert mixed.accuracy > 0.9 and abs(mixed.accuracy - full.accuracy) < 0.03
    assert abs(mixed.loss - full.loss) < 0.1 * max(full.loss, 0.05)


# -- the spec ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1.0, 0.0, float("inf"), float("nan"), "sometimes"])
def test_a_bad_loss_scale_is_named(value):
    problems = validate(_run(synthetic_spec(), loss_scale=value))
    assert [problem.path for problem in problems] == ["run.loss_scale"], problems
    with pytest.raises(SpecError, match=r"run\.loss_scale"):
        check(_run(synthetic_spec(), loss_scale=value))


def test_the_loss_scale_round_trips_and_is_left_out_at_its_default(tmp_path):
    spec = _run(synthetic_spec(), loss_scale=1024.0)
    save(spec, tmp_path / "spec.json")
    assert load(tmp_path / "spec.json") == spec
    assert b"loss_scale" not in dumps(synthetic_spec()) and b"loss_scale" in dumps(spec)

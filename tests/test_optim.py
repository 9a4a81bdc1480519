"""The optimiser's pure decisions (flow.optim): the learning-rate schedules against hand-computed
values, the step values the update shaders read, the state arenas and the update launch, what a
checkpoint records, and the one compatibility check that a restore runs before writing anything."""

from __future__ import annotations

import math

import numpy as np
import pytest

from actors import optimiser as optimiser_effects
from actors.cpu_backend import CpuBackend
from actors.engine import Engine
from flow.errors import PlanError
from flow.optim import (
    check_compatible,
    describe_optimiser,
    device_learning_rate,
    learning_rate,
    optimiser_state_names,
    step_values,
    update_launch,
)
from flow.planning import plan
from flow.program import STEP_VALUES
from flow.spec import (
    SGD,
    Adam,
    AdamW,
    Constant,
    Cosine,
    CrossEntropy,
    Data,
    Digits,
    Flatten,
    Linear,
    Model,
    Optimiser,
    Spec,
    StepLR,
)

# -- learning-rate schedules -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "optimiser, step, expected",
    [
        (SGD(0.1), 0, 0.1),
        (SGD(0.1), 1000, 0.1),
        (SGD(0.1, schedule=Constant(warmup_steps=10)), 0, 0.0),
        (SGD(0.1, schedule=Constant(warmup_steps=10)), 5, 0.05),
        (SGD(0.1, schedule=Constant(warmup_steps=10)), 10, 0.1),
        (Adam(1.0, schedule=StepLR(10, gamma=0.5)), 9, 1.0),
        (Adam(1.0, schedule=StepLR(10, gamma=0.5)), 10, 0.5),
        (Adam(1.0, schedule=StepLR(10, gamma=0.5)), 25, 0.25),
        (Adam(1.0, schedule=StepLR(10, gamma=0.5, warmup_steps=4)), 2, 0.5),
        (Adam(1.0, schedule=StepLR(10, gamma=0.5, warmup_steps=4)), 14, 0.5),
        (AdamW(1.0, schedule=Cosine(100)), 0, 1.0),
        (AdamW(1.0, schedule=Cosine(100)), 50, 0.5),
        (AdamW(1.0, schedule=Cosine(100)), 25, 0.5 + 0.5 * math.cos(math.pi / 4)),
        (AdamW(1.0, schedule=Cosine(100)), 100, 0.0),
        (AdamW(1.0, schedule=Cosine(100)), 150, 0.0),
        # Warmup is part of total_steps: the decay spans steps 10..110.
        (AdamW(1.1, schedule=Cosine(110, min_lr=0.1, warmup_steps=10)), 5, 0.55),
        (AdamW(1.1, schedule=Cosine(110, min_lr=0.1, warmup_steps=10)), 10, 1.1),
        (AdamW(1.1, schedule=Cosine(110, min_lr=0.1, warmup_steps=10)), 60, 0.6),
        (AdamW(1.1, schedule=Cosine(110, min_lr=0.1, warmup_steps=10)), 110, 0.1),
    ],
)
def test_learning_rate(optimiser, step, expected):
    assert learning_rate(optimiser, step) == pytest.approx(expected, abs=1e-12)


def test_learning_rate_rejects_negative_step():
    with pytest.raises(ValueError, match="step"):
        learning_rate(SGD(), -1)


def test_device_learning_rate_is_the_rounded_rate_the_shaders_read():
    """0.1 is not a float32: what a run reports must be the float32 the update applied."""
    optimiser = SGD(0.1, schedule=Cosine(7))
    for step in range(9):
        rounded = device_learning_rate(optimiser, step)
        assert rounded == float(np.float32(learning_rate(optimiser, step)))
        assert rounded == float(step_values(optimiser, step, 1)[0])
    assert device_learning_rate(SGD(0.1), 0) != 0.1


# -- step values ------------------------------------------------------------------------------------


def _f32(values: list[float]) -> np.ndarray:
    """Hand-computed float64 values rounded once, as the host must round them."""
    return np.array(values, dtype=np.float64).astype(np.float32)


@pytest.mark.parametrize(
    "optimiser, step, rows, expected",
    [
        # SGD has no bias corrections: 1.0 for both, whatever the step.
        (SGD(0.1), 0, 32, [0.1, 1.0, 1.0, 1.0, 32.0, 32.0]),
        (SGD(0.1, momentum=0.9, schedule=Constant(warmup_steps=4)), 1, 7, [0.025, 1.0, 1.0, 2.0, 7.0, 7.0]),
        # Adam at t = 1 and t = 3: 1 - 0.9^3 = 0.271, 1 - 0.999^3 = 0.002997001.
        (Adam(0.01), 0, 5, [0.01, 0.1, 0.001, 1.0, 5.0, 5.0]),
        (Adam(0.01), 2, 5, [0.01, 0.271, 0.002997001, 3.0, 5.0, 5.0]),
        # StepLR at t = 4 has halved once: 0.25; 1 - 0.5^4 = 0.9375.
        (Adam(0.5, betas=(0.5, 0.75), schedule=StepLR(2, gamma=0.5)), 3, 1,
         [0.25, 0.9375, 1 - 0.75**4, 4, 1, 1]),
        # AdamW halfway down a cosine from 1e-3 to 1e-4: the midpoint, 5.5e-4.
        (AdamW(1e-3, schedule=Cosine(10, min_lr=1e-4)), 5, 3, [5.5e-4, 1 - 0.9**6, 1 - 0.999**6, 6, 3, 3]),
    ],
)  # fmt: skip
def test_step_values_for_a_training_step(optimiser, step, rows, expected):
    values = step_values(optimiser, step, rows)
    assert values.dtype == np.float32 and values.shape == (len(STEP_VALUES),)
    np.testing.assert_array_equal(values, _f32(expected))


def test_step_values_round_once_from_float64():
    """1 - beta2^t rounded from float64 differs from the same arithmetic done in float32: the host
    must not round beta2 first, or every backend's bias correction drifts from PyTorch's."""
    step = 999
    values = step_values(Adam(1e-3, betas=(0.9, 0.999)), step, 4)
    once = np.float32(1.0 - 0.999 ** (step + 1))
    in_float32 = np.float32(1.0) - np.float32(0.999) ** np.float32(step + 1)
    assert values[2] == once and once != in_float32


@pytest.mark.parametrize("optimiser", [SGD(0.1, momentum=0.9), Adam(0.01), AdamW(0.01)])
def test_step_values_without_an_update_carry_only_the_rows(optimiser):
    np.testing.assert_array_equal(step_values(optimiser, None, 9), _f32([0.0, 1.0, 1.0, 0.0, 9.0, 9.0]))


def test_step_values_carry_the_divisor_a_data_parallel_member_averages_over():
    values = step_values(SGD(0.1), 3, 5, divisor=16)
    assert values[STEP_VALUES.index("rows")] == 5 and values[STEP_VALUES.index("divisor")] == 16


# -- state arenas and the update launch -------------------------------------------------------------


@pytest.mark.parametrize(
    "optimiser, names",
    [
        (SGD(0.1), ()),
        (SGD(0.1, momentum=0.9), ("momentum",)),
        (Adam(), ("exp_avg", "exp_avg_sq")),
        (AdamW(), ("exp_avg", "exp_avg_sq")),
    ],
)
def test_state_names_are_what_the_update_launch_binds(optimiser, names):
    assert optimiser_state_names(optimiser) == names
    bound = update_launch(optimiser, 256).args
    assert bound[:2] == ("params:all", "grads:all") and bound[-1] == "stepvals"
    assert {f"state:{name}" for name in names} <= set(bound)


def test_update_launch_parameters():
    plain = update_launch(SGD(0.1, weight_decay=0.01), 512)
    # No momentum arena exists, so the gradients fill the kernel's unread momentum binding.
    assert plain.op == "sgd" and plain.args[2] == "grads:all"
    assert plain.param_dict == {"n": 512, "momentum": 0.0, "nesterov": 0, "weight_decay": 0.01}
    nesterov = update_launch(SGD(0.1, momentum=0.9, nesterov=True), 512)
    assert nesterov.param("momentum") == 0.9 and nesterov.param("nesterov") == 1
    adam, adamw = update_launch(Adam(betas=(0.8, 0.99)), 256), update_launch(AdamW(), 256)
    assert adam.op == adamw.op == "adam"
    assert adam.param("decoupled") == 0 and adamw.param("decoupled") == 1
    assert adam.param("one_minus_beta1") == pytest.approx(0.2) and adam.param("beta2") == 0.99
    assert adamw.param("weight_decay") == 0.01 and adamw.param("eps") == 1e-8


def test_update_launch_refuses_an_unknown_optimiser():
    with pytest.raises(PlanError, match="unknown optimiser"):
        update_launch("RMSprop", 256)  # type: ignore[arg-type]


def test_describe_optimiser():
    assert describe_optimiser(AdamW(), ("exp_avg", "exp_avg_sq")) == {
        "kind": "AdamW",
        "state": ["exp_avg", "exp_avg_sq"],
    }
    assert describe_optimiser(SGD(), ()) == {"kind": "SGD", "state": []}


# -- the compatibility check ------------------------------------------------------------------------


def _state(names: tuple[str, ...], size: int, dtype=np.float32) -> dict[str, np.ndarray]:
    return {name: np.zeros(size, dtype) for name in ("params:all", *(f"state:{n}" for n in names))}


def test_check_compatible_accepts_a_state_that_fits():
    check_compatible(_state(("exp_avg", "exp_avg_sq"), 512), ("exp_avg", "exp_avg_sq"), 512)
    check_compatible(_state((), 64), (), 64)


@pytest.mark.parametrize(
    "saved, needs, named",
    [
        # An SGD-with-momentum checkpoint restored into an Adam plan.
        (_state(("momentum",), 64), ("exp_avg", "exp_avg_sq"),
         ["missing state:exp_avg, state:exp_avg_sq", "extra state:momentum"]),
        # Plain SGD into SGD with momentum: only the momentum arena is missing.
        (_state((), 64), ("momentum",), ["missing state:momentum"]),
        # Another model: every array is of the wrong size.
        (_state(("momentum",), 32), ("momentum",),
         ["params:all is float32 x 32, needs float32 x 64", "state:momentum is float32 x 32"]),
        (_state((), 64, np.float64), (), ["params:all is float64 x 64, needs float32 x 64"]),
    ],
)  # fmt: skip
def test_check_compatible_names_what_differs(saved, needs, named):
    with pytest.raises(ValueError, match="does not fit this model and optimiser") as refused:
        check_compatible(saved, needs, 64)
    for part in named:
        assert part in str(refused.value)


def _engine(optimiser: Optimiser, units: int = 4) -> Engine:
    model = Model(input_shape=(1, 8, 8), layers=(Flatten(), Linear(units)), loss=CrossEntropy())
    spec = Spec(model=model, optimiser=optimiser, data=Data(Digits(), batch_size=4))
    return Engine(plan(spec).devices[0], CpuBackend())


def test_a_refused_restore_writes_nothing():
    """The engine and the checkpoint restore path (actors.optimiser.start) run the same check, and
    run it before the first write: the refused state leaves the device's weights as they were."""
    sgd = _engine(SGD(0.1, momentum=0.9))
    sgd.initialise("he", 1)
    saved = sgd.state()
    adam = _engine(Adam())
    adam.initialise("he", 2)
    before = adam.state()
    with pytest.raises(ValueError, match="missing state:exp_avg, state:exp_avg_sq; extra state:momentum"):
        adam.load_state(saved)
    with pytest.raises(ValueError, match="extra state:momentum"):
        # start initialises before it restores: the same seed keeps the weights comparable.
        optimiser_effects.start(adam, "he", 2, saved)
    after = adam.state()
    assert all(np.array_equal(before[name], after[name]) for name in before)
    # The same state restores into a plan it fits.
    fresh = _engine(SGD(0.1, momentum=0.9))
    optimiser_effects.start(fresh, "he", 3, saved)
    assert all(np.array_equal(saved[name], fresh.state()[name]) for name in saved)

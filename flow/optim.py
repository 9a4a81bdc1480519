"""The optimiser's pure decisions, gathered in one place: what an SGD, Adam or AdamW record means
for a run, with no effects.

The learning-rate schedules (:func:`learning_rate`); the per-step values the update shaders read
from each slot's ``stepvals`` (:func:`step_values`, in flow.program.STEP_VALUES order), written at
submit so a schedule never re-records a program; the state arenas the optimiser keeps beside the
parameters (:func:`optimiser_state_names`) and the one launch that updates the flat parameter arena
(:func:`update_launch`); and what a checkpoint records about the optimiser
(:func:`describe_optimiser`) with the one check that a saved state fits a plan
(:func:`check_compatible`), which the engine runs before it writes anything. The effects (putting
weights and state on a device, following completed steps) live in actors.optimiser.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from flow.errors import PlanError, Problem
from flow.program import Launch, launch
from flow.spec import SGD, Adam, AdamW, Cosine, Optimiser, StepLR

# The arrays a checkpoint holds besides the optimiser state: every parameter, as one flat arena.
PARAMS = "params:all"
# Mixed precision: the float16 mirror of PARAMS (each weight's copy at its own float index), which
# the update's _half variant writes beside each parameter it updates (flow.weight_copies).
HALVES = "halves:all"

# Clipping by global norm (an optimiser's clip_norm) runs before the update, on the device, with no
# read-back: grad_norm writes CLIP_PARTS partial sums of squares of the gradients (a fixed order,
# no atomics, so every run sums alike), then one workgroup joins them into clip:norm = [norm,
# min(1, clip_norm / (norm + 1e-6))], and the update's _clip variant scales each gradient by the
# second. The planner puts CLIP_TENSORS (name, floats) in a "clip" arena.
CLIP_PARTS = 256
# clip:norm = [norm, factor, skip]: skip = 1 makes the _clip update leave every weight and state
# as it is (only loss scaling sets it, on gradients that overflowed).
CLIP_TENSORS = (("clip:partials", CLIP_PARTS), ("clip:norm", 3))

# Dynamic loss scaling (RunSettings.loss_scale), torch.amp.GradScaler's rule kept on the device with
# no read-back: the train program multiplies the loss's gradient by scale (loss_scale_apply); the
# update's loss_scale_update joins grad_norm's partial sums into the unscaled norm, writes clip:norm
# with the factor divided by scale (so the _clip update sees the true gradients, clipped where
# clip_norm is set) and skip = 1 where the sum is not finite, then moves the state: halve on a skip,
# double after LOSS_SCALE_GROWTH good steps in a row. With a power-of-two scale every product in
# the backward pass is scaled exactly, so float32 results do not change.
LOSS_SCALE = "loss_scale:state"  # [scale, good steps in a row, steps skipped], checkpointed
LOSS_SCALE_FLOATS = 3
LOSS_SCALE_GROWTH = 2000
AUTO_LOSS_SCALE = 65536.0


def initial_loss_scale(loss_scale: str | float, precision: str) -> float | None:
    """The scale a run starts from, or None when it does not scale its loss.

    Args:
        loss_scale: RunSettings.loss_scale ("auto", "off" or a number > 0).
        precision: RunSettings.precision.

    Returns:
        AUTO_LOSS_SCALE for "auto" in "mixed" precision, the number given, else None.
    """
    if loss_scale == "off" or (loss_scale == "auto" and precision != "mixed"):
        return None
    return AUTO_LOSS_SCALE if loss_scale == "auto" else float(loss_scale)


def learning_rate(optimiser: Optimiser, step: int) -> float:
    """The learning rate for one optimiser step, in float64.

    Warmup rises linearly from 0 at step 0 to ``lr`` at step ``warmup_steps``; the schedule's clock
    then starts. ``StepLR`` multiplies by ``gamma`` every ``step_size`` steps; ``Cosine`` falls from
    ``lr`` to ``min_lr`` at step ``total_steps`` (counted from step 0, warmup included) and stays there.

    Args:
        optimiser: an SGD, Adam or AdamW record (valid, see flow.validation).
        step: the 0-based index of the update.

    Returns:
        The learning rate for that update.

    Raises:
        ValueError: a negative step.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    lr, schedule = optimiser.lr, optimiser.schedule
    if step < schedule.warmup_steps:
        return lr * step / schedule.warmup_steps
    t = step - schedule.warmup_steps
    if isinstance(schedule, StepLR):
        return lr * schedule.gamma ** (t // schedule.step_size)
    if isinstance(schedule, Cosine):
        progress = min(t / (schedule.total_steps - schedule.warmup_steps), 1.0)
        return schedule.min_lr + (lr - schedule.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return float(lr)


def device_learning_rate(optimiser: Optimiser, step: int) -> float:
    """The learning rate of update ``step`` as the device sees it: :func:`learning_rate` rounded
    once to float32, as :func:`step_values` writes it, so what a run reports is what was applied.

    Args:
        optimiser: the spec's optimiser.
        step: the update's 0-based index.

    Returns:
        The learning rate.
    """
    return float(np.float32(learning_rate(optimiser, step)))


def step_values(optimiser: Optimiser, step: int | None, rows: int, divisor: int | None = None) -> np.ndarray:
    """A slot's step values (flow.program.STEP_VALUES) for one submit.

    For a training step with 0-based index ``step`` (t = step + 1): [lr, 1 - beta1^t, 1 - beta2^t,
    t, rows, divisor]; SGD has no bias corrections, so 1.0 for both. Computed in float64 on the host then
    rounded once, so every backend sees identical values. For evaluation and prediction (``step``
    None) only ``rows`` matters. The engine calls this before every submit, so it stays a few
    float operations and one small array.

    Args:
        optimiser: the spec's optimiser.
        step: the update's index, or None when nothing is updated.
        rows: the batch's real rows.
        divisor: the rows the loss averages over (None: ``rows``; a data-parallel member gets the
            global batch's rows, so the members' gradients sum to the global mean's).

    Returns:
        float32 [len(STEP_VALUES)].
    """
    divisor = rows if divisor is None else divisor
    if step is None:
        return np.array([0.0, 1.0, 1.0, 0.0, rows, divisor], dtype=np.float32)
    t = step + 1
    lr = learning_rate(optimiser, step)
    if isinstance(optimiser, Adam | AdamW):
        beta1, beta2 = optimiser.betas
        return np.array([lr, 1.0 - beta1**t, 1.0 - beta2**t, t, rows, divisor], dtype=np.float32)
    assert isinstance(optimiser, SGD)
    return np.array([lr, 1.0, 1.0, t, rows, divisor], dtype=np.float32)


def optimiser_state_names(optimiser: Optimiser) -> tuple[str, ...]:
    """The flat state arenas the optimiser keeps beside the parameters, each as large as them.

    Args:
        optimiser: the spec's optimiser.

    Returns:
        ("momentum",) for SGD with momentum, () for plain SGD, ("exp_avg", "exp_avg_sq") for Adam
        and AdamW.
    """
    if isinstance(optimiser, SGD):
        return ("momentum",) if optimiser.momentum else ()
    return ("exp_avg", "exp_avg_sq")


def update_launch(optimiser: Optimiser, total: int, scaled: bool = False, halves: bool = False) -> Launch:
    """One launch that updates every parameter in the flat arena (padding included: its gradient
    is always zero, so it stays zero). Hyperparameters that never change are push constants; the
    schedule's values come from ``stepvals`` (:func:`step_values`).

    Args:
        optimiser: the spec's optimiser.
        total: floats in the flat parameter arena.
        scaled: the gradients carry a loss scale (the _clip variant divides it out).
        halves: also write each updated parameter's float16 copy into HALVES (the _half variant).

    Returns:
        The ``sgd`` or ``adam`` launch (``sgd_clip``, ``adam_clip`` with clip_norm set or a loss
            scale: they also read ``clip:norm``; ``..._half``: they also write HALVES).

    Raises:
        PlanError: an optimiser with no update kernel.
    """
    clipped = scaled or getattr(optimiser, "clip_norm", None) is not None
    clip = ("_clip", ("clip:norm",)) if clipped else ("", ())
    clip = (clip[0] + "_half", (*clip[1], HALVES)) if halves else clip
    if isinstance(optimiser, SGD):
        # Without momentum the kernel never reads its buffer, so the gradients stand in for the
        # arena that plain SGD does not allocate.
        momentum_buffer = "state:momentum" if optimiser.momentum else "grads:all"
        return launch(
            "sgd" + clip[0],
            (PARAMS, "grads:all", momentum_buffer, "stepvals", *clip[1]),
            n=total,
            momentum=float(optimiser.momentum),
            nesterov=int(optimiser.nesterov),
            weight_decay=float(optimiser.weight_decay),
        )
    if isinstance(optimiser, Adam | AdamW):
        return launch(
            "adam" + clip[0],
            (PARAMS, "grads:all", "state:exp_avg", "state:exp_avg_sq", "stepvals", *clip[1]),
            n=total,
            beta1=float(optimiser.betas[0]),
            beta2=float(optimiser.betas[1]),
            eps=float(optimiser.eps),
            weight_decay=float(optimiser.weight_decay),
            decoupled=int(isinstance(optimiser, AdamW)),
            one_minus_beta1=1.0 - float(optimiser.betas[0]),
            one_minus_beta2=1.0 - float(optimiser.betas[1]),
        )
    raise PlanError([Problem("optimiser", f"unknown optimiser {type(optimiser).__name__}")])


def update_groups(
    optimiser: Optimiser, total: int, scaled: bool = False, halves: bool = False
) -> list[list[Launch]]:
    """The update's launches in dependent groups (a barrier between each): the update alone, or
    with clip_norm set or a loss scale, the two passes over the gradients before it (see
    CLIP_PARTS and LOSS_SCALE).

    Args:
        optimiser: the spec's optimiser.
        total: floats at the start of the flat arenas that the optimiser updates.
        scaled: the run scales its loss (initial_loss_scale is not None).
        halves: the update also writes the weights' float16 copies (see update_launch).

    Returns:
        [[update]], or [[partial sums], [norm and factor], [update]].
    """
    update = update_launch(optimiser, total, scaled, halves)
    if optimiser.clip_norm is None and not scaled:
        return [[update]]
    max_norm = math.inf if optimiser.clip_norm is None else float(optimiser.clip_norm)
    if scaled:
        join = launch(
            "loss_scale_update",
            ("clip:partials", LOSS_SCALE, "clip:norm"),
            n=CLIP_PARTS,
            max_norm=max_norm,
            growth_interval=LOSS_SCALE_GROWTH,
        )
    else:
        join = launch("grad_norm", ("clip:partials", "clip:norm"), n=CLIP_PARTS, max_norm=max_norm)
    return [
        [launch("grad_norm", ("grads:all", "clip:partials"), n=total, parts=CLIP_PARTS)],
        [join],
        [update],
    ]


def describe_optimiser(optimiser: Optimiser, state_names: tuple[str, ...]) -> dict[str, Any]:
    """What a checkpoint records about the optimiser, besides its arrays.

    Args:
        optimiser: the spec's optimiser.
        state_names: the plan's optimiser state arenas.

    Returns:
        {"kind": class name, "state": [arena names]}.
    """
    return {"kind": type(optimiser).__name__, "state": list(state_names)}


def check_compatible(
    saved: Mapping[str, np.ndarray], state_names: tuple[str, ...], total_params: int
) -> None:
    """Refuse a saved state that does not fit a plan. A restore writes arrays one by one, so it runs
    this first: a half-written restore would train from weights of one run and state of another.

    Args:
        saved: ``params:all`` and ``state:<name>`` arrays, as Engine.state returns and a checkpoint
            holds.
        state_names: the plan's optimiser state arenas.
        total_params: floats in the plan's flat parameter arena (padding included).

    Raises:
        ValueError: naming the arrays that are missing, extra, or of the wrong type or size.
    """
    expected = {PARAMS, *(f"state:{s}" for s in state_names)}
    problems = []
    if missing := sorted(expected - set(saved)):
        problems.append(f"missing {', '.join(missing)}")
    # The loss scale's state may come or go: a run that scales without it starts from its first
    # scale, and one that does not scale has no use for it (Engine.load_state).
    if extra := sorted(set(saved) - expected - {LOSS_SCALE}):
        problems.append(f"extra {', '.join(extra)}")
    for name in sorted(expected & set(saved)):
        array = saved[name]
        if array.dtype != np.float32 or array.size != total_params:
            problems.append(f"{name} is {array.dtype} x {array.size}, needs float32 x {total_params}")
    scale = saved.get(LOSS_SCALE)
    if scale is not None and (scale.dtype != np.float32 or scale.size != LOSS_SCALE_FLOATS):
        problems.append(f"{LOSS_SCALE} is {scale.dtype} x {scale.size}, needs float32 x {LOSS_SCALE_FLOATS}")
    if problems:
        raise ValueError("checkpoint does not fit this model and optimiser: " + "; ".join(problems))

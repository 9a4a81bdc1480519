"""The optimiser writes mixed precision's float16 weight copies (issue 18, flow.weight_copies).

The update's ``_half`` kernels (sgd, adam and their _clip variants) write each updated parameter's
float16 copy from the value just written: checked against a float64 numpy oracle with odd sizes, bit
for bit against the plain kernel for the fp32 results, and bit for bit against numpy's
astype(float16) (cast.comp's rounding) for the copies, on the CPU backend and on lavapipe; a skipped
(overflowed) step leaves the copies as they were. A mixed plan keeps its copies in one arena that
mirrors the parameters, casts no weight at the start of any program, and the engine refreshes the
copies whenever the masters are written other than by the update: fresh weights, a checkpoint, a
data-parallel leader's weights, weights imported from a file. Whole runs with the copies kept train
bit for bit as runs that cast them at the start of every program: one device, two data-parallel
members, resumed; eval before any train step reads the fresh weights' copies.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from test_grad_clip import oracle_update

import flow
from actors.backend import run_program
from actors.cpu_backend import CpuBackend, cpu_facts
from actors.engine import Engine
from actors.single_op import single_op_layout
from flow import weight_copies
from flow.optim import (
    CLIP_TENSORS,
    HALVES,
    LOSS_SCALE,
    PARAMS,
    optimiser_state_names,
    step_values,
    update_groups,
)
from flow.planning import plan
from flow.program import Program, with_barriers
from flow.safetensors_io import save_weights, with_weights
from flow.spec import SGD, Adam, AdamW, Devices
from loaders.digits import load_digits_arrays
from tests.specs import digits, digits_spec

OPTIMISERS = {
    "sgd": SGD(0.1),
    "sgd-nesterov": SGD(0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adam": Adam(0.01, weight_decay=1e-2),
    "adamw-clipped": AdamW(0.01, weight_decay=0.1, clip_norm=0.5),
}


def _bits(halves: np.ndarray) -> np.ndarray:
    return np.asarray(halves, np.float16).view(np.uint16)


def _updates(backend, optimiser, p0, grads, halves: bool, scale: float | None = None, h0=None):
    """The plan's update launches, once per gradient, on ``backend`` (``halves``: the _half
    variant, its copies starting from ``h0``). Returns the arrays after each step."""
    n = p0.size
    arrays = {PARAMS: p0, "grads:all": grads[0], "stepvals": step_values(optimiser, 0, 1)}
    arrays |= {f"state:{name}": np.zeros(n, np.float32) for name in optimiser_state_names(optimiser)}
    arrays |= {name: np.zeros(floats, np.float32) for name, floats in CLIP_TENSORS}
    arrays[LOSS_SCALE] = np.array([scale or 1.0, 0.0, 0.0], np.float32)
    if halves:
        arrays[HALVES] = h0
    backend.open_layout(single_op_layout(arrays))
    for name, array in arrays.items():
        backend.write(name, array)
    groups = update_groups(optimiser, n, scaled=scale is not None, halves=halves)
    assert groups[-1][0].op.endswith("_half") == halves
    program = Program("update", with_barriers(groups))
    after = []
    for step, grad in enumerate(grads):
        backend.write("grads:all", grad)
        backend.write("stepvals", step_values(optimiser, step, 1))
        run_program(backend, program)
        after.append(
            {name: backend.read(name) for name in arrays if name.startswith(("params", "state", "halves"))}
        )
    return after


@pytest.mark.parametrize("name", OPTIMISERS)
@pytest.mark.parametrize("n", [1, 37, 4099])
@pytest.mark.parametrize("scale", [None, 2.0**12])
def test_the_half_updates_write_fp16_of_what_they_wrote(backend, rng, name, n, scale):
    """Three steps: the fp32 results are the plain kernel's bit for bit and the oracle's within
    float32 rounding; after each, the copy is astype(float16) of the masters bit for bit, and an odd
    n's last high half (another parameter's, in a plan) is left alone."""
    optimiser = OPTIMISERS[name]
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    scaled = [g * np.float32(scale) for g in grads] if scale else grads
    h0 = rng.standard_normal(n + n % 2).astype(np.float16)  # stale bits: every one must be rewritten
    plain = _updates(backend, optimiser, p0, scaled, False, scale)
    halved = _updates(backend, optimiser, p0, scaled, True, scale, h0)
    for before, after in zip(plain, halved, strict=True):
        for key, value in before.items():
            np.testing.assert_array_equal(after[key], value, err_msg=key)
        np.testing.assert_array_equal(_bits(after[HALVES][:n]), _bits(after[PARAMS].astype(np.float16)))
        assert _bits(after[HALVES][n:]).tolist() == _bits(h0[n:]).tolist()
    want = oracle_update(optimiser, p0, grads)[0]["params:all"]
    np.testing.assert_allclose(halved[-1][PARAMS], want, rtol=2e-5, atol=2e-6)
    assert not np.array_equal(halved[-1][PARAMS], p0)


@pytest.mark.parametrize("name", ["sgd-nesterov", "adam"])
def test_an_overflowed_step_leaves_the_copies_as_they_were(backend, rng, name):
    optimiser, n = OPTIMISERS[name], 1001
    p0 = rng.standard_normal(n).astype(np.float32)
    bad = rng.standard_normal(n).astype(np.float32)
    bad[rng.integers(n)] = np.inf
    h0 = p0.astype(np.float16)
    (after,) = _updates(backend, optimiser, p0, [bad], True, 2.0**10, h0)
    np.testing.assert_array_equal(after[PARAMS], p0)
    np.testing.assert_array_equal(_bits(after[HALVES]), _bits(h0))


# -- plans ------------------------------------------------------------------------------------------


def _mixed(spec, **run):
    return dataclasses.replace(spec, run=dataclasses.replace(spec.run, precision="mixed", **run))


def _cpu_digits(optimiser=None, **run):
    spec = dataclasses.replace(digits_spec(), devices=Devices("cpu"))
    if optimiser is not None:
        spec = dataclasses.replace(spec, optimiser=optimiser)
    return _mixed(spec, **run)


def test_a_mixed_plan_keeps_its_copies_beside_the_masters_and_casts_no_weight():
    device = plan(_cpu_digits()).devices[0]
    layout = device.layout
    weights = [p.name for p in device.parameters if p.name.endswith(".weight")]
    for name in weights:
        copy, master = layout.tensor(f"half:{name}"), layout.tensor(name)
        assert (copy.arena, copy.dtype, copy.offset) == ("halves", "float16", master.offset // 2)
        assert copy.size >= math.prod(master.shape)
    assert layout.tensor(HALVES).size == device.total_params
    assert layout.arena("halves").nbytes >= 2 * device.total_params
    for program in device.programs:
        assert not any(s.op == "cast" and s.args[0] in weights for s in program.launches), program.name
    update = device.program("train").launches[-1]
    # The digits example: Adam with mixed precision's "auto" loss scale.
    assert (update.op, update.args[0], update.args[-1]) == ("adam_clip_half", PARAMS, HALVES)


def test_plans_that_keep_no_copies_cast_at_the_start_of_every_program(monkeypatch):
    weights = lambda device: sorted(p.name for p in device.parameters if p.name.endswith(".weight"))  # noqa: E731
    float32 = plan(dataclasses.replace(digits_spec(), devices=Devices("cpu"))).devices[0]
    assert not any(a.name == "halves" for a in float32.layout.arenas)
    assert not any(s.op.endswith("_half") for s in float32.program("train").launches)
    coarse = dataclasses.replace(cpu_facts(), min_storage_offset_alignment=256)
    monkeypatch.setattr(weight_copies, "OPTIMISER_COPIES", False)
    casting = plan(_cpu_digits()).devices[0]
    monkeypatch.setattr(weight_copies, "OPTIMISER_COPIES", True)
    for device in (casting, plan(_cpu_digits(), facts=coarse).devices[0]):
        assert not any(a.name == "halves" for a in device.layout.arenas)
        for program in device.programs:
            first = program.launches[: len(weights(device))]
            assert sorted(s.args[0] for s in first) == weights(device), program.name
        assert device.program("train").launches[-1].op == "adam_clip"


def _batches(count: int, batch: int, rng):
    images, labels = load_digits_arrays()
    for _ in range(count):
        rows = rng.choice(len(labels), batch, replace=False)
        yield (
            (images[rows].astype(np.float32) / 8.0 - 1.0).reshape(batch, 1, 8, 8),
            labels[rows].astype(np.int32),
        )


def _assert_copies(engine: Engine) -> None:
    for name, master in engine.parameters().items():
        if name.endswith(".weight"):
            copy = engine.backend.read(f"half:{name}")[: master.size]
            np.testing.assert_array_equal(
                _bits(copy), _bits(master.reshape(-1).astype(np.float16)), err_msg=name
            )


@pytest.mark.parametrize("optimiser", [SGD(0.1, momentum=0.9), None])
def test_the_copies_follow_every_write_of_the_masters(monkeypatch, backend, rng, optimiser):
    """Fresh weights, eval before any step, train steps (on a GPU where it has cooperative matrices),
    a restored state and a leader's weights: the copies are fp16 of the masters after each, and the
    results are the casting plan's, bit for bit."""
    if not backend.facts.has("cooperative_matrix"):
        pytest.skip(f"{backend.facts.name} has no cooperative matrices")
    spec = _cpu_digits(optimiser)
    batches = list(_batches(5, 64, rng))
    results = {}
    for kept in (False, True):
        monkeypatch.setattr(weight_copies, "OPTIMISER_COPIES", kept)
        engine = Engine(plan(spec).devices[0], backend)
        assert engine.keeps_copies == kept
        engine.initialise("he", 3)
        (x, y), *steps = batches
        results[kept] = [engine.evaluate(x, y)] + [
            engine.train_step(x, y, i) for i, (x, y) in enumerate(steps[:3])
        ]
        results[kept].append(engine.parameters())
        if kept:
            _assert_copies(engine)
    trained, cast = results[True].pop(), results[False].pop()
    assert results[True] == results[False]
    for name, value in cast.items():
        np.testing.assert_array_equal(trained[name], value, err_msg=name)
    # The kept engine (the last one opened) after writes that are not the update's: the same weights
    # loaded from a state and set as a leader's evaluate alike, and unlike the drawn ones between.
    x, y = batches[4]
    other = Engine(engine.plan, CpuBackend())
    other.initialise("xavier", 4)
    engine.load_state(other.state())
    _assert_copies(engine)
    loaded = engine.evaluate(x, y)
    engine.initialise("he", 3)
    _assert_copies(engine)
    assert engine.evaluate(x, y) != loaded
    engine.set_weights(other.weights())
    _assert_copies(engine)
    assert engine.evaluate(x, y) == loaded
    # A data-parallel leader converts its weights once and hands every member the copies.
    engine.initialise("he", 3)
    engine.set_weights(other.weights(), other.weights().astype(np.float16))
    _assert_copies(engine)
    assert engine.evaluate(x, y) == loaded


def _twice(monkeypatch, spec, **kwargs):
    """``spec`` run with the copies kept, then cast at the start of every program."""
    runs = []
    for kept in (True, False):
        monkeypatch.setattr(weight_copies, "OPTIMISER_COPIES", kept)
        runs.append(flow.run(spec, **kwargs))
    return runs


def _assert_same(run, other) -> None:
    assert (run.loss, run.accuracy, run.steps) == (other.loss, other.accuracy, other.steps)
    for name, value in other.parameters.items():
        np.testing.assert_array_equal(run.parameters[name], value, err_msg=name)


def test_whole_runs_with_kept_copies_are_runs_with_casts_bit_for_bit(monkeypatch, tmp_path):
    """One device, two data-parallel members (each applies the update) and weights imported from a
    safetensors file, through flow.run: the digits example in mixed precision (Adam, the "auto"
    loss scale)."""
    spec = _cpu_digits(epochs=2)
    kept, cast = _twice(monkeypatch, spec)
    _assert_same(kept, cast)
    assert kept.accuracy > 0.85
    pair = dataclasses.replace(spec, devices=Devices(("cpu", "cpu"), drop_slow=False))
    _assert_same(*_twice(monkeypatch, pair))
    # Weights imported from a file replace the drawn ones after the engine starts: their copies too.
    path = save_weights(spec.model, kept.parameters, tmp_path / "trained.safetensors")
    imported = with_weights(_cpu_digits(epochs=1), path)
    again, cast = _twice(monkeypatch, imported)
    _assert_same(again, cast)
    assert again.accuracy > kept.accuracy - 0.05  # it went on from the trained weights


def test_a_resumed_run_with_kept_copies_is_the_straight_run(tmp_path):
    spec = _mixed(digits(tmp_path, "straight", epochs=2))
    straight = flow.run(spec)
    assert plan(spec).devices[0].layout.arena("halves")
    flow.run(_mixed(digits(tmp_path, "resumed", epochs=2, steps=straight.steps // 2)))
    resumed = flow.run(_mixed(digits(tmp_path, "resumed", epochs=2)), resume=tmp_path / "resumed")
    assert resumed.resumed_from and resumed.steps == straight.steps
    for name, value in straight.parameters.items():
        np.testing.assert_array_equal(resumed.parameters[name], value, err_msg=name)

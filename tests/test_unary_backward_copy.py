"""fp16 operands for every GEMM of the mixed char GPT (issues 16 and 18, session 15).

In mixed precision an activation or gradient that a GEMM reads gets an fp16 copy wherever the
launch that wrote it last can write the copy beside it (the cast folds: autodiff._copy_op), or
where it is wide enough to pay for a cast launch of its own (autodiff._half_copy). The new
producer is ``unary_backward_copy``: unary_backward that also writes dX's fp16 copy, so GELU's
gradient (the char GPT's fc1's dz) reaches fc1's weight and input gradients as halves, while the
bias gradient still sums the fp32 dX.

Checked here: the op against a float64 oracle and bit for bit against unary_backward then numpy's
astype(float16), with odd sizes and every activation, on the CPU backend and on Vulkan; the plan
of a mixed GPT at the char GPT's sizes, where every tensor-core GEMM reads halves except the
operands that no kernel can copy and that are too narrow for a cast; a mixed GPT trains bit for bit
the same whether its producers write the copies or cast launches do (CPU backend).
"""

from __future__ import annotations

import math

import numpy as np
import oracles
import pytest
from layer_programs import layer_batch, layer_spec
from specs import gpt_blocks
from test_gelu_epilogue import _mixed, assert_same_training, mixed_train_on_cpu

from actors.single_op import run_op
from flow import autodiff
from flow.planning import plan
from shaders.registry import ACTIVATIONS

SLOPE = 0.1


def _derivative(x: np.ndarray, saved: np.ndarray, name: str) -> np.ndarray:
    """f'(x) in float64: from x for gelu and the identity, from the saved output for the others."""
    if name == "none":
        return np.ones_like(x, dtype=np.float64)
    if name == "gelu":
        x = x.astype(np.float64)
        density = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        return 0.5 * (1.0 + oracles.erf(x / math.sqrt(2.0))) + x * density
    return oracles.derivative_from_output(saved, name, SLOPE)


@pytest.mark.parametrize("n", [1, 7, 1001, 70001, 4096])
@pytest.mark.parametrize("name", ["none", "relu", "leaky_relu", "sigmoid", "tanh", "gelu"])
def test_unary_backward_copy_writes_dx_and_its_float16_copy(backend, rng, n, name):
    """dX within float32 rounding of the float64 oracle and as unary_backward writes it, bit for
    bit; H numpy's astype(float16) of that dX, bit for bit; for odd n the last word's high half
    keeps its old contents (as the cast's does)."""
    x = (rng.standard_normal(n) * 2.5).astype(np.float32)
    saved = x if name in ("gelu", "none") else oracles.activation(x, name, SLOPE).astype(np.float32)
    dy = (rng.standard_normal(n) * 3.0).astype(np.float32)
    params = dict(n=n, fn=ACTIVATIONS[name], a=SLOPE if name == "leaky_relu" else 0.0)
    plain = run_op(backend, "unary_backward", {"dY": dy, "S": saved, "dX": np.zeros(n, np.float32)}, **params)
    old = rng.standard_normal(n + n % 2).astype(np.float16)
    arrays = {"dY": dy, "S": saved, "dX": np.full(n, np.nan, np.float32), "H": old.copy()}
    copy = run_op(backend, "unary_backward_copy", arrays, **params)
    want = dy.astype(np.float64) * _derivative(x, saved, name)
    assert np.all(np.abs(copy["dX"] - want) <= 1e-5 * np.abs(want) + 1e-6), name
    np.testing.assert_array_equal(copy["dX"].view(np.uint32), plain["dX"].view(np.uint32))
    halves = copy["H"].view(np.uint16)
    np.testing.assert_array_equal(halves[:n], plain["dX"].astype(np.float16).view(np.uint16))
    assert halves[n:].tolist() == old.view(np.uint16)[n:].tolist()


def _operands(launches) -> list[tuple[str, str, bool]]:
    """(GEMM output, operand, read as halves) for both operands of every tensor-core GEMM."""
    gemms = [s for s in launches if s.op.startswith("gemm_coopmat")]
    flags = ("a_half", "b_half")
    return [
        (g.args[3], x, bool(g.param_dict.get(f)))
        for g in gemms
        for x, f in zip(g.args[:2], flags, strict=True)
    ]


def test_every_gemm_of_a_mixed_gpt_reads_halves_but_the_uncopyable_narrow_ones():
    """The char GPT's sizes (width 384, 6 heads, MLP 1536, 256 positions, 64 rows: 16384 rows a
    GEMM), with the default thresholds: every operand of every tensor-core GEMM is an fp16 copy,
    written by its producer (no cast launch; the attention's Y and qkv gradient by the tensor-core
    attention kernels: tests/test_attention_half_copies.py), except the logits' gradient (the
    head's weight and input gradients), which no kernel writes a copy of and which is too narrow
    (103) for a cast of its own."""
    model = gpt_blocks(vocab=103, width=384, hidden=1536, context=256, heads=6)
    launches = plan(_mixed(layer_spec(model, batch=64))).devices[0].program("train").launches
    parameters = {p.name for p in plan(_mixed(layer_spec(model, batch=2))).devices[0].parameters}
    assert all(s.args[0] in parameters for s in launches if s.op == "cast")  # the weights' only
    operands = _operands(launches)
    fp32 = sorted({x.split("[")[0] for _, x, half in operands if not half})
    assert fp32 == ["grad:act"]
    assert [(c, x) for c, x, half in operands if not half and x.startswith("grad:act")] == [
        ("splitk:grad:layers[4].weight", "grad:act[17]"),
        ("grad:act[16]", "grad:act[17]"),
    ]
    assert sum(not half for *_, half in operands) == 2
    ops = [s.op for s in launches]
    assert ops.count("unary_backward_copy") == 2 and "unary_backward" not in ops
    # The bias gradients still sum the fp32 gradients.
    assert all(not s.args[0].startswith("half:") for s in launches if s.op == "column_sum")


def test_a_mixed_gpt_trains_bit_for_bit_with_producers_writing_the_copies(monkeypatch, rng):
    """Loss and gradients of one mixed train program on the CPU backend, with the new copies
    written by their producers and with the same copies made by cast launches: the same numbers,
    bit for bit (cast.comp and the copy variants round alike)."""
    model = gpt_blocks(vocab=13, width=12, hidden=24, context=10)
    x, y = layer_batch(model, 8, rng)
    results = []
    for folded in (True, False):
        if not folded:
            monkeypatch.setattr(autodiff, "_fold_casts_into_producers", lambda graph: None)
        results.append(mixed_train_on_cpu(model, x, y))
        ops = [s.op for s in results[-1][2].program("train").launches]
        assert ("unary_backward_copy" in ops) == folded and ("cast" in ops) != folded
    assert_same_training(*results)

"""Embedding: the lookup and the table's gradient on every backend against a float64 oracle
(repeated ids accumulate, odd sizes, partial batches whose padding ids must take no part), ids out
of range (the CPU refuses them, a GPU clamps them and never reads outside the table), then the
layer in a model: shapes, parameters and PyTorch's N(0, 1) initial table, clear problems for a bad
vocabulary size or placement, the spec files and the summary, gradients against finite
differences, the same programs on CPU and Vulkan, and pixel ids of the bundled digits learnt
through ``flow.run``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import relative_error
from layer_programs import (
    check_gradients_by_differences,
    check_partial_batch_matches_rows_alone,
    layer_spec,
)
from oracles import embedding as oracle

import flow
from actors.cpu_backend import CpuBackend
from actors.single_op import run_op
from flow.autodiff import embedding_chunks
from flow.codec import dumps, encode, load, loads, save
from flow.planning import init_parameters, plan
from flow.shapes import count_parameters, infer_shapes
from flow.spec import (
    MSE,
    Adam,
    Arrays,
    CrossEntropy,
    Data,
    Devices,
    Embedding,
    Flatten,
    Linear,
    Model,
    RunSettings,
    Spec,
    Split,
)
from flow.summary import summarize
from flow.validation import validate
from loaders.digits import load_digits_arrays


def run_embedding(backend, ids, table, dy, real: int):
    """The lookup and the table's gradient of ids [N, S] as a train program runs them."""
    (n, s), (v, d) = ids.shape, table.shape
    dims = dict(N=n, S=s, V=v, D=d)
    stepvals = np.array([0.0, 1.0, 1.0, 1.0, real, real], np.float32)
    ids = ids.astype(np.float32)
    bindings = {"ids": ids, "W": table, "stepvals": stepvals, "Y": np.full((n, s, d), np.nan, np.float32)}
    y = run_op(backend, "embedding", bindings, **dims)["Y"]
    bindings = {"ids": ids, "dY": dy, "stepvals": stepvals, "dW": np.full_like(table, np.nan)}
    return y, run_op(backend, "embedding_backward", bindings, **dims)["dW"]


# (N samples, S ids each, V rows, D columns, real samples): more ids than rows (repeats are
# certain), D past the 64 threads of the backward's workgroup, padding samples, one of everything.
CASES = [
    (4, 5, 3, 7, 4),
    (5, 1, 11, 1, 3),
    (3, 17, 2, 300, 2),
    (70, 9, 50, 13, 65),
    (1, 1, 1, 1, 1),
    (6, 3, 700, 5, 6),
]


@pytest.mark.parametrize("n,s,v,d,real", CASES)
def test_embedding_ops_match_the_oracle(backend, rng, n, s, v, d, real):
    ids = rng.integers(0, v, (n, s))
    ids[real:] = rng.choice([-7, v, 10 * v + 3], ids[real:].shape)  # padding: out of range, ignored
    table = (rng.standard_normal((v, d)) * 2.0 + 0.5).astype(np.float32)
    dy = rng.standard_normal((n, s, d)).astype(np.float32)
    dy[real:] = 1e3  # a gradient on padding samples must not reach the table
    y, dw = run_embedding(backend, ids, table, dy, real)
    y_ref, dw_ref = oracle(ids[:real], table, dy[:real])
    np.testing.assert_array_equal(y[:real], y_ref)  # a lookup copies exactly
    assert relative_error(dw, dw_ref) <= 1e-6
    unnamed = np.setdiff1d(np.arange(v), ids[:real])
    np.testing.assert_array_equal(dw[unnamed], 0.0)  # written, not left as they were


def test_repeated_ids_accumulate_every_row(backend, rng):
    v, d = 5, 6
    ids = np.array([[3, 3, 1, 3], [1, 3, 3, 0]])
    table = rng.standard_normal((v, d)).astype(np.float32)
    dy = rng.standard_normal((2, 4, d)).astype(np.float32)
    _, dw = run_embedding(backend, ids, table, dy, real=2)
    rows = dy.reshape(-1, d).astype(np.float64)
    flat = ids.reshape(-1)
    np.testing.assert_allclose(dw[3], rows[flat == 3].sum(axis=0), rtol=1e-6)  # five occurrences
    np.testing.assert_allclose(dw[1], rows[flat == 1].sum(axis=0), rtol=1e-6)
    np.testing.assert_allclose(dw[0], rows[7], rtol=1e-6)
    np.testing.assert_array_equal(dw[[2, 4]], 0.0)


def test_the_gpu_table_gradient_is_the_cpu_one_to_the_bit(vulkan_backend, rng):
    """Both add each id's rows in the ids' order: the same float32 sums, not merely close ones."""
    ids = rng.integers(0, 40, (33, 21))
    table = rng.standard_normal((40, 19)).astype(np.float32)
    dy = rng.standard_normal((33, 21, 19)).astype(np.float32)
    cpu = run_embedding(CpuBackend(), ids, table, dy, real=31)
    gpu = run_embedding(vulkan_backend, ids, table, dy, real=31)
    np.testing.assert_array_equal(gpu[0][:31], cpu[0][:31])
    np.testing.assert_array_equal(gpu[1], cpu[1])


@pytest.mark.parametrize("bad", [5.0, -1.0, 2.5, float("nan"), 1e9])
def test_the_cpu_refuses_an_id_outside_the_table(rng, bad):
    ids = rng.integers(0, 5, (3, 4)).astype(np.float32)
    ids[1, 2] = bad
    table = rng.standard_normal((5, 3)).astype(np.float32)
    with pytest.raises(
        ValueError, match=r"token id .* \(sample 1, position 2\) is not an integer in \[0, 5\)"
    ):
        run_embedding(CpuBackend(), ids, table, np.ones((3, 4, 3), np.float32), real=3)


def test_a_gpu_clamps_an_id_outside_the_table(vulkan_backend, rng):
    v, d = 6, 4
    ids = np.array([[-3.0, 6.0, 1e9, 2.0, -1e9, 5.0]])
    table = rng.standard_normal((v, d)).astype(np.float32)
    y, dw = run_embedding(vulkan_backend, ids, table, np.ones((1, 6, d), np.float32), real=1)
    np.testing.assert_array_equal(y[0], table[[0, 5, 5, 2, 0, 5]])
    np.testing.assert_array_equal(dw[:, 0], [2.0, 0.0, 1.0, 0.0, 0.0, 3.0])


# ---------------------------------------------------------------------------------------------
# The table's gradient split over chunks of ids (a small vocabulary: one workgroup a row would
# scan every id): embedding_backward's [chunks, V, D] partial sums, added in chunk order.


def chunked_table_gradient(backend, ids, dy, v: int, real: int, chunks: int) -> np.ndarray:
    (n, s), d = ids.shape, dy.shape[-1]
    stepvals = np.array([0.0, 1.0, 1.0, 1.0, real, real], np.float32)
    partial = np.full((chunks, v, d), np.nan, np.float32)
    bindings = {"ids": ids.astype(np.float32), "dY": dy, "stepvals": stepvals, "dW": partial}
    partial = run_op(backend, "embedding_backward", bindings, N=n, S=s, V=v, D=d, chunks=chunks)["dW"]
    if chunks == 1:
        return partial.reshape(v, d)
    bindings = {"W": partial, "dW": np.full((v, d), np.nan, np.float32)}
    return run_op(backend, "embedding_chunk_sum", bindings, total=v * d, splits=chunks)["dW"]


def skewed_ids(rng, n: int, s: int, v: int, real: int) -> np.ndarray:
    """Ids where one row (a text's space) takes most positions, padding samples out of range."""
    ids = rng.integers(0, v, (n, s))
    ids[rng.random((n, s)) < 0.8] = v // 2
    ids[real:] = rng.choice([-7, v, 10 * v + 3], ids[real:].shape)
    return ids


# (N, S, V, D, real samples, chunks): chunks not aligned to samples, D past two passes of the 64
# threads, more chunks than ids (the last ones empty), a partial batch, and no split (one over
# several of the shader's 512-id windows, D past its 128 threads).
SPLIT_CASES = [
    (40, 30, 5, 131, 37, 1),
    (16, 37, 7, 67, 13, 8),
    (9, 31, 3, 130, 9, 5),
    (5, 11, 13, 1, 2, 64),
    (64, 16, 84, 38, 61, 64),
    (8, 33, 84, 40, 6, 1),
]


@pytest.mark.parametrize("n,s,v,d,real,chunks", SPLIT_CASES)
def test_the_chunked_table_gradient_matches_the_oracle(backend, rng, n, s, v, d, real, chunks):
    ids = skewed_ids(rng, n, s, v, real)
    dy = rng.standard_normal((n, s, d)).astype(np.float32)
    dy[real:] = 1e3  # a gradient on padding samples must not reach the table
    dw = chunked_table_gradient(backend, ids, dy, v, real, chunks)
    _, dw_ref = oracle(ids[:real], np.zeros((v, d)), dy[:real])
    assert relative_error(dw, dw_ref) <= 1e-6
    np.testing.assert_array_equal(dw[np.setdiff1d(np.arange(v), ids[:real])], 0.0)


def test_the_chunked_gpu_gradient_is_reproducible_and_the_cpu_one_to_the_bit(vulkan_backend, rng):
    n, s, v, d, real, chunks = 32, 64, 11, 45, 29, 16
    ids = skewed_ids(rng, n, s, v, real)
    dy = rng.standard_normal((n, s, d)).astype(np.float32)
    first, second = (chunked_table_gradient(vulkan_backend, ids, dy, v, real, chunks) for _ in range(2))
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(first, chunked_table_gradient(CpuBackend(), ids, dy, v, real, chunks))


def test_chunks_are_chosen_from_the_shapes():
    assert embedding_chunks(64 * 256, 84, 384) == 64  # a char GPT: 16384 ids, an 84-row table
    assert embedding_chunks(4 * 5, 1000, 64) == 1  # too few ids to split
    assert embedding_chunks(64 * 1024, 50257, 768) == 1  # a large vocabulary spreads the rows
    assert embedding_chunks(2**20, 1000, 4096) == 2  # the workspace stays at most 32 MB
    model = Model(input_shape=(256,), layers=(Embedding(20, 8), Flatten(), Linear(3)), loss=CrossEntropy())
    launches = plan(layer_spec(model, 8)).devices[0].program("train").launches
    split = [step for step in launches if step.op.startswith("embedding_")]
    assert [(step.op, step.param_dict.get("chunks")) for step in split] == [
        ("embedding_backward", 8),
        ("embedding_chunk_sum", None),
    ]


# ---------------------------------------------------------------------------------------------
# The layer in a model

TOKENS = Model(
    input_shape=(6,),
    layers=(Embedding(11, 5), Flatten(), Linear(8, activation="tanh"), Linear(4)),
    loss=CrossEntropy(),
)
GRID = Model(input_shape=(2, 3), layers=(Embedding(4, 3), Flatten(), Linear(2)), loss=MSE())
# 7 x 256 ids of a 5-row table: its gradient split into 7 chunks (4 in the plan for the real rows).
CHUNKED = Model(input_shape=(256,), layers=(Embedding(5, 3), Flatten(), Linear(4)), loss=CrossEntropy())
MODELS, IDS = [TOKENS, GRID], ["tokens", "grid"]


def test_shapes_parameters_and_a_normal_initial_table():
    assert infer_shapes(GRID) == [(2, 3, 3), (18,), (2,)]
    assert count_parameters(GRID) == 4 * 3 + 18 * 2 + 2
    model = Model(input_shape=(5,), layers=(Embedding(1000, 64), Flatten(), Linear(3)), loss=CrossEntropy())
    device = plan(layer_spec(model, 4)).devices[0]
    for scheme in ("he", "xavier"):
        table = init_parameters(device, scheme, 3)["layers[0].weight"].astype(np.float64)
        assert table.shape == (1000, 64)
        # N(0, 1) as PyTorch, whatever the scheme: mean and std within 5 standard errors, and
        # normal tails (a uniform draw has none past 2 standard deviations).
        assert abs(table.mean()) < 5 / math.sqrt(table.size)
        assert abs(table.std() - 1.0) < 5 / math.sqrt(2 * table.size)
        assert (np.abs(table) > 3).mean() == pytest.approx(0.0027, abs=0.001)
    ops = [launch.op for launch in device.program("train").launches]
    assert ops[0] == "embedding" and "embedding_backward" in ops
    assert [launch.op for launch in device.program("predict").launches][0] == "embedding"


@pytest.mark.parametrize(
    "layers, path, words",
    [
        ((Embedding(2**24 + 1, 4), Flatten(), Linear(3)), "model.layers[0].num_embeddings", "at most 2**24"),
        ((Embedding(0, 4), Flatten(), Linear(3)), "model.layers[0].num_embeddings", "must be > 0, got 0"),
        ((Embedding(10, 0), Flatten(), Linear(3)), "model.layers[0].dim", "must be > 0, got 0"),
        ((Linear(5), Embedding(10, 4), Flatten(), Linear(3)), "model.layers[1]", "must be the first layer"),
    ],
)
def test_bad_embeddings_are_named_by_their_path(layers, path, words):
    spec = layer_spec(Model(input_shape=(5,), layers=layers, loss=CrossEntropy()), 4)
    problems = validate(spec)
    assert len(problems) == 1 and problems[0].path == path and words in problems[0].message, problems


def test_the_largest_table_float32_ids_can_address_is_accepted():
    spec = layer_spec(
        Model(input_shape=(3,), layers=(Embedding(2**24, 1), Flatten(), Linear(2)), loss=MSE()), 4
    )
    assert validate(spec) == []


def test_spec_files_and_summary(tmp_path):
    spec = layer_spec(TOKENS, 8)
    assert validate(spec) == []
    assert loads(dumps(spec)) == spec
    for name in ("spec.json", "spec.msgpack"):
        save(spec, tmp_path / name)
        assert load(tmp_path / name) == spec
    assert encode(spec)["model"]["layers"][0] == {"dim": 5, "kind": "Embedding", "num_embeddings": 11}
    row = next(line for line in summarize(spec).splitlines() if "[0] Embedding(11, 5)" in line)
    assert row.split()[-3:] == ["(6,", "5)", "55"]


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_whole_model_gradients_match_finite_differences(model, rng):
    check_gradients_by_differences(model, rng, probes=6)


@pytest.mark.parametrize("model", [*MODELS, CHUNKED], ids=[*IDS, "chunked"])
def test_partial_batch_on_cpu_and_vulkan_matches_its_rows_alone(model, rng, vulkan_backend):
    check_partial_batch_matches_rows_alone(model, rng, vulkan_backend)


def digit_pixel_ids(levels: int) -> tuple[np.ndarray, np.ndarray]:
    """The bundled digits' 64 pixels (0..16) quantised to ``levels`` grey levels, as token ids."""
    images, labels = load_digits_arrays()
    ids = np.minimum(images.reshape(len(images), 64).astype(np.int64) * levels // 17, levels - 1)
    return ids.astype(np.float32), labels.astype(np.int64)


def test_embedded_pixel_ids_learn_the_digits(vulkan_backend):
    """Each pixel's grey level (one of 4) is a token; its learnt vector is all the model sees."""
    x, y = digit_pixel_ids(4)
    assert set(np.unique(x)) == {0.0, 1.0, 2.0, 3.0}
    spec = Spec(
        model=Model(input_shape=(64,), layers=(Embedding(4, 6), Flatten(), Linear(10)), loss=CrossEntropy()),
        optimiser=Adam(lr=0.01),
        data=Data(Arrays(x, y), batch_size=64, split=Split(train=0.8, val=0.2, stratify=True)),
        devices=Devices("cpu"),
        run=RunSettings(epochs=6),
    )
    result = flow.run(spec, backend=vulkan_backend)
    assert result.evals[-1].loss < 0.3 * math.log(10)  # a guess scores ln 10
    assert result.evals[-1].loss < result.evals[0].loss
    assert result.accuracy >= 0.85


@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("where", ["cpu", "vulkan"])
def test_a_run_with_an_id_past_the_table_says_so(where, placement, request, tmp_path):
    """A GPU would clamp the id and train on the wrong row: the host checks every batch (and a
    dataset kept on the device once, before any step), on every backend alike."""
    x, y = digit_pixel_ids(4)
    bad = int(np.flatnonzero(x.reshape(-1) == 3.0)[0])  # the first pixel at the top level
    sample, position = divmod(bad, 64)
    metrics = tmp_path / "metrics.jsonl"
    spec = Spec(
        model=Model(input_shape=(64,), layers=(Embedding(3, 2), Flatten(), Linear(10)), loss=CrossEntropy()),
        optimiser=Adam(lr=0.01),
        data=Data(Arrays(x, y), batch_size=64, shuffle=False, placement=placement),
        devices=Devices("cpu"),
        run=RunSettings(steps=40, metrics_file=str(metrics)),
    )
    backend = request.getfixturevalue("vulkan_backend") if where == "vulkan" else CpuBackend()
    words = rf"token id 3\.0 \(sample {sample}, position {position}\) is not an integer in \[0, 3\)"
    with pytest.raises(Exception, match=words):
        flow.run(spec, backend=backend)
    steps = [line for line in metrics.read_text().splitlines() if '"step"' in line and '"loss"' in line]
    assert steps == [] or placement == "host"  # kept on the device: refused before the first step
    assert len(steps) <= sample // 64  # streamed: no step past the batch that holds the id

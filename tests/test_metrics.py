"""Metrics beside the loss (Model.metrics, flow.metrics): the top-k kernel and the MAE/RMSE launches
against float64 numpy oracles on both backends (partial batches whose padding rows hold huge values
that must not count, odd sizes), whole runs whose RunResult, metrics file and CSV carry them, the
spec's validation and its round trip."""

from __future__ import annotations

import csv
import dataclasses
import json
import math

import numpy as np
import pytest

import flow
from actors.engine import Engine
from actors.single_op import run_op
from flow.callbacks import CSVLogger, EarlyStopping
from flow.codec import dumps, loads
from flow.data_plan import header_of, plan_data
from flow.planning import plan
from flow.spec import (
    MAE,
    MSE,
    RMSE,
    SGD,
    Adam,
    Arrays,
    CrossEntropy,
    Data,
    Devices,
    Embedding,
    Linear,
    Model,
    Perplexity,
    RunSettings,
    Spec,
    Split,
    Synthetic,
    Text,
    TopK,
)
from flow.validation import validate
from loaders.dispatch import open_source
from tests.specs import digits_spec

HUGE = 1e30


def topk_oracle(logits: np.ndarray, labels: np.ndarray, k: int, real: int) -> np.ndarray:
    """1.0 for each of the first ``real`` rows whose label's logit has fewer than k strictly greater."""
    x = logits.astype(np.float64)
    hits = np.zeros(len(labels), np.float32)
    for r in range(real):
        label = int(labels[r])
        if 0 <= label < x.shape[1] and not np.isnan(x[r, label]):
            hits[r] = float(np.sum(x[r] > x[r, label]) < k)
    return hits


@pytest.mark.parametrize(
    "samples, per_sample, cols", [(1, 1, 1), (7, 1, 3), (65, 1, 10), (9, 5, 37), (3, 7, 129)]
)
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_topk_kernel_matches_a_float64_oracle(backend, rng, samples, per_sample, cols, partial):
    """Ties (small integer logits) count only when fewer than k logits are strictly greater; padding
    rows full of huge logits, a label outside the classes and a NaN label logit never count."""
    rows = samples * per_sample
    real = int(rng.integers(1, samples)) if partial and samples > 1 else samples
    logits = rng.integers(-3, 4, (rows, cols)).astype(np.float32)
    labels = rng.integers(0, cols, rows).astype(np.int32)
    logits[real * per_sample :] = HUGE
    if real * per_sample >= 3 and cols >= 2:
        labels[0] = cols  # out of range: a miss
        logits[1, labels[1]] = np.nan  # a NaN label logit: a miss
    stepvals = np.array([0.0, 1.0, 1.0, 0.0, real], np.float32)
    for k in sorted({1, 2, min(5, cols), cols}):
        bindings = {"logits": logits.reshape(-1), "labels": labels, "hits": np.full(rows, 7, np.float32),
                    "stepvals": stepvals}  # fmt: skip
        out = run_op(backend, "topk", bindings, rows=rows, cols=cols, per_sample=per_sample, k=k)
        expected = topk_oracle(logits, labels, k, real * per_sample)
        np.testing.assert_array_equal(out["hits"], expected, err_msg=f"k={k}")


def _spec(model: Model, batch: int) -> Spec:
    data = Data(Synthetic(samples=64, features=model.input_shape, classes=4), batch_size=batch)
    return Spec(model=model, optimiser=SGD(lr=0.1), data=data, devices=Devices("cpu"))


@pytest.mark.parametrize("cols", [1, 3, 33])
def test_mae_and_rmse_launches_match_numpy_on_a_partial_batch(backend, rng, cols):
    """The planned eval program's metric tensors: mean |d| and mean d^2 over the real rows' outputs
    (RMSE's root is taken over the round), the padding rows' huge inputs and targets left out."""
    model = Model(input_shape=(5,), layers=(Linear(8, activation="tanh"), Linear(cols)), loss=MSE(),
                  metrics=(MAE(), RMSE()))  # fmt: skip
    batch, real = 7, 5
    engine = Engine(plan(_spec(model, batch)).devices[0], backend)
    engine.initialise("he", 3)
    assert engine.metric_tensors == ("metric:mae", "metric:rmse")
    x = rng.standard_normal((batch, 5)).astype(np.float32)
    y = rng.standard_normal((batch, cols)).astype(np.float32)
    outputs = engine.predict(x[:real]).astype(np.float64)
    x[real:], y[real:] = HUGE, -HUGE
    engine.write_batch(0, x, y)
    engine.backend.wait(engine.submit("eval", 0, real))
    mae, mse = engine.metric_values(0)
    d = outputs - y[:real].astype(np.float64)
    assert mae == pytest.approx(np.abs(d).mean(), rel=1e-5)
    assert mse == pytest.approx((d * d).mean(), rel=1e-5)
    loss, _ = engine.loss_and_correct(0)
    assert loss == pytest.approx(mse, rel=1e-5)  # the MSE loss is the same mean


def test_digits_top3_is_at_least_the_accuracy_in_the_result_the_file_and_the_csv(backend, tmp_path):
    spec = digits_spec(epochs=2, metrics_file=str(tmp_path / "metrics.jsonl"))
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, metrics=(TopK(3), TopK(1))))
    result = flow.run(spec, backend=backend, callbacks=[CSVLogger(tmp_path / "log.csv"),
                                                        EarlyStopping("val_top3", patience=5)])  # fmt: skip
    assert set(result.metrics) == {"top3", "top1"}
    assert 1.0 >= result.metrics["top3"] >= result.accuracy > 0.5
    # top-1 differs from the accuracy only on an exact tie of the first maximum with the label
    assert result.metrics["top1"] == pytest.approx(result.accuracy, abs=1 / result.evals[-1].samples)
    assert result.evals[-1].metrics == result.metrics
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in evals if e["event"] == "step"]
    evals = [e for e in evals if e["event"] == "eval"]
    assert [e["top3"] for e in evals] == [e.metrics["top3"] for e in result.evals]
    assert all(s["top3"] >= s["accuracy"] for s in steps)
    with (tmp_path / "log.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 2 and float(rows[-1]["val_top3"]) == pytest.approx(result.metrics["top3"])
    assert all(float(r["top3"]) >= float(r["accuracy"]) for r in rows)
    assert float(rows[-1]["val_top3"]) >= float(rows[-1]["val_accuracy"])


def test_regression_mae_and_rmse_match_numpy_on_the_predictions(tmp_path, rng):
    """The validation round's MAE and RMSE against flow.predict's outputs on the validation samples
    (odd batches: the round ends in a partial one); RMSE is the root of the round's mean squared
    error, which the MSE loss also is."""
    x = rng.standard_normal((103, 6)).astype(np.float32)
    y = np.stack([x @ rng.standard_normal(6), np.sin(x[:, 0])], axis=1).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    model = Model(input_shape=(6,), layers=(Linear(16, activation="relu"), Linear(2)), loss=MSE(),
                  metrics=(RMSE(), MAE()))  # fmt: skip
    data = Data(Arrays(path=str(tmp_path / "data.npz")), batch_size=9, split=Split(train=0.7, val=0.3))
    run = RunSettings(epochs=3, checkpoint_dir=str(tmp_path / "ckpt"))
    spec = Spec(model=model, optimiser=Adam(0.01), data=data, devices=Devices("cpu"), run=run)
    result = flow.run(spec)
    val = plan_data(spec, header_of(open_source(spec.data.source))).splits["val"]
    d = flow.predict(result.checkpoint, x[val]).astype(np.float64) - y[val]
    assert result.metrics["mae"] == pytest.approx(np.abs(d).mean(), rel=1e-4)
    assert result.metrics["rmse"] == pytest.approx(math.sqrt((d * d).mean()), rel=1e-4)
    assert result.metrics["rmse"] ** 2 == pytest.approx(result.evals[-1].loss, rel=1e-5)
    assert list(result.metrics) == ["rmse", "mae"] and result.accuracy is None


def test_perplexity_is_exp_of_the_mean_per_token_loss(backend, tmp_path):
    """A per-token model (Text windows: (T, V) logits, (T,) labels): perplexity = exp(val loss);
    top-k counts positions, so TopK(vocab) is 1 and TopK(1) is the accuracy's fraction of positions."""
    path = tmp_path / "text.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    source = Text(str(path), context=8, stride=8)
    vocab = open_source(source).num_classes
    model = Model(input_shape=(8,), layers=(Embedding(vocab, 8), Linear(vocab)), loss=CrossEntropy(),
                  metrics=(Perplexity(), TopK(vocab), TopK(1)))  # fmt: skip
    spec = Spec(model=model, optimiser=Adam(0.01),
                data=Data(source, batch_size=7, split=Split(train=0.8, val=0.2)),
                devices=Devices("cpu"), run=RunSettings(epochs=2))  # fmt: skip
    result = flow.run(spec, backend=backend)
    for done in result.evals:
        assert done.metrics["perplexity"] == pytest.approx(math.exp(done.loss), rel=1e-9)
        assert done.metrics[f"top{vocab}"] == 1.0
        assert done.metrics["top1"] == pytest.approx(done.accuracy, abs=1e-9)
    assert result.evals[-1].metrics["perplexity"] < result.evals[0].metrics["perplexity"] < vocab


def _problems(model: Model) -> list[str]:
    return [str(p) for p in validate(_spec(model, 8))]


def test_metrics_are_validated_against_the_loss_and_the_classes():
    classifier = Model(input_shape=(4,), layers=(Linear(4),), loss=CrossEntropy())
    regression = Model(input_shape=(4,), layers=(Linear(2),), loss=MSE())

    def with_metrics(model, *metrics):
        return _problems(dataclasses.replace(model, metrics=metrics))

    assert with_metrics(classifier, TopK(4), TopK(1), Perplexity()) == []
    assert with_metrics(regression, MAE(), RMSE()) == []
    assert with_metrics(classifier, TopK(0)) == ["model.metrics[0].k: must be >= 1, got 0"]
    assert with_metrics(classifier, TopK(5)) == ["model.metrics[0].k: must be <= the classes (4), got 5"]
    assert with_metrics(classifier, MAE(), TopK(2), TopK(2)) == [
        "model.metrics[0]: MAE needs an MSE, L1 or Huber loss, got "
        "CrossEntropy(label_smoothing=0.0, class_weights=None)",
        "model.metrics[2]: top2 is already among the metrics",
    ]
    assert with_metrics(regression, TopK(1), Perplexity()) == [
        "model.metrics[0]: TopK needs a CrossEntropy loss, got MSE()",
        "model.metrics[1]: Perplexity needs a CrossEntropy loss, got MSE()",
    ]
    problems = with_metrics(dataclasses.replace(regression, loss=None), RMSE())
    assert "model.metrics[0]: RMSE needs an MSE, L1 or Huber loss, got None" in problems


def test_metrics_round_trip_and_a_model_without_them_is_written_as_before():
    spec = _spec(Model(input_shape=(4,), layers=(Linear(4),), loss=CrossEntropy()), 8)
    assert b"\xa7metrics" not in dumps(spec)  # the msgpack key "metrics"
    for metrics in [(TopK(3), Perplexity()), (TopK(4),)]:
        with_metrics = dataclasses.replace(spec, model=dataclasses.replace(spec.model, metrics=metrics))
        assert loads(dumps(with_metrics)) == with_metrics
    regression = dataclasses.replace(spec, model=Model(input_shape=(4,), layers=(Linear(2),), loss=MSE(),
                                                       metrics=(MAE(), RMSE())))  # fmt: skip
    assert loads(dumps(regression)) == regression


def test_early_stopping_and_csv_logger_name_metrics():
    spec = _spec(Model(input_shape=(4,), layers=(Linear(4),), loss=CrossEntropy(), metrics=(TopK(2),)), 8)
    assert EarlyStopping("val_top2").mode == "max" and EarlyStopping("val_rmse").mode == "min"
    EarlyStopping("val_top2").on_start(spec, frozenset({"val"}))
    with pytest.raises(ValueError, match="names none of model.metrics"):
        EarlyStopping("val_mae").on_start(spec, frozenset({"val"}))
    with pytest.raises(ValueError, match="val_top5"):
        EarlyStopping("val_f1")

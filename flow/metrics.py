"""What a model's metrics (Model.metrics) are called and how their device sums become values. Pure.

Each metric with a kernel (every one but Perplexity) has an io tensor ``metric:<name>`` per slot,
which the loss's launches fill and the engine reads with the loss: TopK the count of right rows
(positions / per_sample, as ``correct``), MAE and RMSE the batch's mean |d| and d^2 (a share of the
global mean under data parallelism, as the loss). A round sums counts and mean * rows, and only
then takes RMSE's square root and Perplexity's exp of the round's mean loss.
"""

import math
from typing import Any

from flow.spec_model import RMSE, Metric, Model, Perplexity, TopK


def metric_name(metric: Metric) -> str:
    """Its key in the metrics file and RunResult: "top5", "mae", "rmse", "perplexity"."""
    return f"top{metric.k}" if isinstance(metric, TopK) else type(metric).__name__.lower()


def on_device(model: Model) -> tuple[Metric, ...]:
    """The model's metrics that a kernel computes, in order (their io tensors' order)."""
    return tuple(m for m in model.metrics if not isinstance(m, Perplexity))


def summed(model: Model, values: tuple[float, ...], rows: int) -> tuple[float, ...]:
    """A step's device values (on_device's order) as sums over its ``rows`` real rows."""
    pairs = zip(on_device(model), values, strict=True)
    return tuple(v if isinstance(m, TopK) else v * rows for m, v in pairs)


def finish(model: Model, sums: tuple[float, ...], rows: int, loss: float) -> dict[str, float]:
    """Every metric's value from the sums over ``rows`` rows and the mean ``loss`` over them."""
    means = iter(s / max(rows, 1) for s in sums)
    values = {}
    for m in model.metrics:
        value = (math.inf if loss > 709 else math.exp(loss)) if isinstance(m, Perplexity) else next(means)
        values[metric_name(m)] = math.sqrt(value) if isinstance(m, RMSE) and value >= 0 else value
    return values


# How a mean over steps is taken (CSVLogger's training columns): through these, then back.
STEP_MEANS = {"rmse": (lambda v: v * v, math.sqrt), "perplexity": (math.log, math.exp)}


def step_lines(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A metrics line as per-step records: a ``"steps"`` line (actors.sink.steps_record) becomes the
    ``"step"`` lines it stands for, its statistics and skipped items on the last; any other line
    is itself.

    Args:
        record: one line of the metrics file, as a dict.

    Returns:
        The records, in order.
    """
    if record.get("event") != "steps":
        return [record]
    shared = ("statistics", "skipped")
    columns = {key: value for key, value in record.items() if key != "event" and key not in shared}
    count = len(columns["step"])
    lines = [{"event": "step", **{key: values[i] for key, values in columns.items()}} for i in range(count)]
    if lines:
        lines[-1].update((key, record[key]) for key in shared if key in record)
    return lines

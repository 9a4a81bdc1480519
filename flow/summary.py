"""A spec in a few lines for people (``flow check``, ``flow.summarize``): each layer with its output
shape and parameter count, the totals, the optimiser and the data, each record written as Python
would write it with keyword fields at their defaults left out. Pure; it assumes a valid spec.
"""

from dataclasses import MISSING, fields, is_dataclass
from typing import Any

from flow.model_graph import expand, parameter_count
from flow.shapes import count_parameters, infer_shapes
from flow.spec import Spec


def summarize(spec: Spec) -> str:
    """A few lines for people: each layer with its output shape and parameters, and the totals.

    Args:
        spec: a valid spec.

    Returns:
        The summary, without a trailing newline.
    """
    model = spec.model
    shapes = infer_shapes(model)
    expansion = expand(model)
    # A block's row counts the parameters of every layer inside it.
    rows = [
        (
            f"[{i}] {_brief(layer)}",
            str(shape),
            f"{parameter_count(expansion.nodes[span.start : span.stop]):,}",
        )
        for i, (layer, shape, span) in enumerate(zip(model.layers, shapes, expansion.spans, strict=True))
    ]
    rows.insert(0, ("layer", "output", "parameters"))
    wide = [max(len(row[c]) for row in rows) for c in range(3)]
    total = count_parameters(model)
    lines = [f"model: input {tuple(model.input_shape)} {model.input_dtype}, loss {_brief(model.loss)}"]
    lines += [f"  {a:<{wide[0]}}  {b:<{wide[1]}}  {c:>{wide[2]}}" for a, b, c in rows]
    # Master weights are float32 whatever the input dtype, so 4 bytes per parameter.
    lines.append(f"parameters: {total:,} ({4 * total:,} bytes as float32)")
    lines.append(f"optimiser: {_brief(spec.optimiser)}")
    lines.append(f"data: {_brief(spec.data)}")
    return "\n".join(lines)


def _brief(value: Any) -> str:
    """A record as Python would write it, leaving out keyword fields at their defaults."""
    if isinstance(value, tuple):
        inner = ", ".join(_brief(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if not is_dataclass(value):
        return repr(value)
    parts, keywords = [], []
    for f in fields(value):
        item = getattr(value, f.name)
        if not f.kw_only:
            parts.append(_brief(item))
        elif f.default is MISSING or item != f.default:
            keywords.append(f"{f.name}={_brief(item)}")
    parts += keywords  # a base record's keyword fields (a layer's name) come first in fields()
    return f"{type(value).__name__}({', '.join(parts)})"

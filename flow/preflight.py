"""Everything ``flow check`` can find wrong before a run touches a device: the spec's own problems
(flow.validation) and, when its source can be read, the data's against the model: a file that is
missing or unreadable, samples of a shape the model cannot take, more classes than outputs, labels
that are not one target per output for MSE. All of them come back at once, each with its path, so
that a user fixes them in one go rather than one per run. Opening a source costs what the run's
start costs, no more: a directory listing (from the manifest cache) and one image probe, an IDX or
raw header and a memory map, or for a CSV its one streaming pass (the class count is in the labels).
"""

from __future__ import annotations

from flow.data_plan import data_problems
from flow.errors import Problem
from flow.spec import Spec
from flow.validation import validate
from loaders import LoaderError, open_source


def preflight(spec: Spec) -> tuple[list[Problem], str | None]:
    """Every problem found before a run: the spec's, then its data's.

    Args:
        spec: the spec, valid or not.

    Returns:
        (problems, about): every problem, in the spec's order and then the data's; ``about`` is one
        line on the data (samples, sample shape, classes) when the source could be opened, else None.
    """
    problems = validate(spec)
    if any(p.path in ("", "data") or p.within("data.source") for p in problems):
        return problems, None  # a source record with problems of its own cannot be opened
    try:
        source = open_source(spec.data.source)
    except (LoaderError, OSError, ValueError) as error:  # the sources' errors about their settings
        return [*problems, Problem("data.source", str(error))], None
    try:
        shape, classes = tuple(source.sample_shape), source.num_classes
        about = f"{len(source)} samples of shape {shape}, " + (
            f"{classes} classes" if classes is not None else "labels that are not class ids"
        )
        # The data can only be held against a model (and transforms) that passed their own checks.
        if not any(p.within("model") or p.within("data") for p in problems):
            label_shape = tuple(source.labels.shape[1:])
            problems += data_problems(spec, shape, classes, label_shape)
    finally:
        source.close()
    return problems, about

"""vkflow: train and run small ML models on any Vulkan GPU, with the job described as data.

The package is in three tiers, each importing only those below it (tests/test_layers.py checks):

- records: ``flow.spec`` (the job; the model's and the data's records in ``flow.spec_model`` and
  ``flow.spec_data``), ``flow.errors``, ``flow.program`` (launches, layouts) and the device facts;
  frozen data with no behaviour.
- pure decisions: ``flow.codec``, ``flow.validation``, ``flow.shapes``, ``flow.autodiff``,
  ``flow.optim`` (the optimiser), ``flow.planning`` and the other modules that decide from records
  without effects.
- entry: this package's top level, ``flow.__main__``, ``flow.runner`` (``run``, ``open_pipeline``),
  ``flow.runtime`` (a pipeline's resources and actors), ``flow.inference`` (``predict``),
  ``flow.run_command`` and ``flow.testing``: the only flow modules that import ``actors``, the
  runtime that does the effects.

Every name below is loaded on first use (PEP 562), so ``import flow.spec`` stays a records-only
import (no trio, no Vulkan, no msgpack), while ``dir(flow)`` and ``help(flow)`` still list and
document the whole API (``flow.__all__``), among it:

- run a spec: ``run``, ``RunResult``, ``open_pipeline`` (inside trio), ``NonFiniteLoss``,
  ``ActorError``; callbacks ``Callback``, ``EarlyStopping``, ``CSVLogger``;
- use a trained model: ``predict``, ``generate``;
- specs as data: ``check``, ``validate``, ``summarize``, ``plan``, ``Plan``, ``save``, ``load``,
  ``dumps``, ``loads``; errors ``FlowError``, ``SpecError``, ``PlanError``, ``Problem``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Public name -> the module that defines it.
_EXPORTS = {
    "FlowError": "flow.errors",
    "PlanError": "flow.errors",
    "Problem": "flow.errors",
    "SpecError": "flow.errors",
    "dumps": "flow.codec",
    "load": "flow.codec",
    "loads": "flow.codec",
    "save": "flow.codec",
    "check": "flow.validation",
    "summarize": "flow.summary",
    "validate": "flow.validation",
    "Plan": "flow.planning",
    "plan": "flow.planning",
    "ActorError": "flow.runtime",
    "CSVLogger": "flow.callbacks",
    "Callback": "flow.callbacks",
    "EarlyStopping": "flow.callbacks",
    "TensorBoardLogger": "flow.tensorboard_logger",
    "NonFiniteLoss": "flow.runner",
    "RunResult": "flow.runtime",
    "open_pipeline": "flow.runner",
    "run": "flow.runner",
    "predict": "flow.inference",
    "generate": "flow.inference",
    "export_safetensors": "flow.safetensors_io",
    "with_weights": "flow.safetensors_io",
    "export_onnx": "flow.onnx_io",
    "import_onnx": "flow.onnx_io",
}

__all__ = [
    "ActorError", "CSVLogger", "Callback", "EarlyStopping", "FlowError", "NonFiniteLoss", "Plan", "PlanError",
    "Problem", "RunResult", "SpecError", "check", "dumps", "generate", "load", "loads", "open_pipeline",
    "plan", "predict", "run", "save", "summarize", "TensorBoardLogger", "validate",
    "export_safetensors", "with_weights", "export_onnx", "import_onnx",
]  # fmt: skip

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from flow.callbacks import Callback, CSVLogger, EarlyStopping
    from flow.codec import dumps, load, loads, save
    from flow.errors import FlowError, PlanError, Problem, SpecError
    from flow.inference import generate, predict
    from flow.onnx_io import export_onnx, import_onnx
    from flow.planning import Plan, plan
    from flow.runner import NonFiniteLoss, open_pipeline, run
    from flow.runtime import ActorError, RunResult
    from flow.safetensors_io import export_safetensors, with_weights
    from flow.summary import summarize
    from flow.tensorboard_logger import TensorBoardLogger
    from flow.validation import check, validate


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

"""vkflow: train and run small ML models on any Vulkan GPU, with the job described as data.

The pure layers (spec, codec, validation, plan) hold the job as data; the runtime (``run``,
``open_pipeline``, ``predict``) runs it as trio actors.
"""

from flow.codec import dumps, load, loads, save
from flow.errors import FlowError, PlanError, Problem, SpecError
from flow.plan import Plan, plan
from flow.validate import check, summarize, validate

__all__ = [
    "ActorError",
    "FlowError",
    "Plan",
    "PlanError",
    "Problem",
    "SpecError",
    "check",
    "dumps",
    "load",
    "loads",
    "open_pipeline",
    "plan",
    "predict",
    "run",
    "RunResult",
    "save",
    "summarize",
    "validate",
]


_RUNTIME = ("ActorError", "RunResult", "open_pipeline", "predict", "run")


def __getattr__(name: str):
    # The runtime (flow.runner) sits above the actors, which import flow's pure modules; loading
    # it on first use keeps that layering free of import cycles.
    if name in _RUNTIME:
        import importlib

        module = "flow.inference" if name == "predict" else "flow.runner"
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flow' has no attribute {name!r}")

"""vkflow: train and run small ML models on any Vulkan GPU, with the job described as data.

The pure layers (spec, codec, validation, plan) import nothing heavy; the runtime (``run``,
``open_pipeline``, ``predict``) is imported on first use so ``import flow`` stays cheap.
"""

from flow.codec import dumps, load, loads, save
from flow.errors import FlowError, PlanError, Problem, SpecError
from flow.plan import Plan, plan
from flow.validate import check, summarize, validate

__all__ = [
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
    "save",
    "summarize",
    "validate",
]


def __getattr__(name: str):
    # The runtime pulls in trio and the backends; load it only when asked for.
    if name in ("run", "open_pipeline", "predict"):
        from flow import run as _run_module

        return getattr(_run_module, name)
    raise AttributeError(f"module 'flow' has no attribute {name!r}")

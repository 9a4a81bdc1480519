"""Layering: which modules may import which, read from every module's imports with ``ast``.

Three rules, kept by reading the source rather than by review:

- the Vulkan binding is imported by one module, ``actors/vulkan/library.py``, and the pure policy
  modules (queue and memory decisions) never load it, even indirectly, so their tests run on
  machines with no Vulkan;
- flow/ has three tiers (records, pure decisions, entry points): a module imports only its own
  tier and those below it, and only entry points import actors/;
- loaders/ and shaders/ import nothing of each other but the one cache directory they share
  (shaders/user_cache.py), which loads nothing else.

Imports anywhere in a module count (inside functions too); for "never loads the binding" only those
that run do (an ``if TYPE_CHECKING:`` block does not), and importing ``a.b.c`` runs ``a`` and
``a.b`` as well.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Not the repository's code: environments, caches, and git-ignored run outputs (runs/).
SKIP_DIRS = {".venv", ".git", "build", "dist", "node_modules", "__pycache__", "runs"}
LOADING_MODULE = "actors.vulkan.library"
PURE_POLICY = ("actors.vulkan.queues_policy", "actors.memory")


@dataclass(frozen=True)
class Import:
    target: str  # the module loaded, absolute: "a.b.c" for ``from a.b import c`` where c is a module
    runtime: bool  # False inside ``if TYPE_CHECKING:``
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def repo_modules() -> dict[str, Path]:
    """Every Python file of the repository (not the virtual environment) by dotted name."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).parts
        if any(part in SKIP_DIRS or part.startswith(".") or part.endswith(".egg-info") for part in relative):
            continue
        found[module_name(path)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import statement in the module, resolved to absolute module names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, runtime: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, runtime)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, runtime, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            targets = {f"{source}.{alias.name}" for alias in node.names} & modules.keys() or {source}
            found.extend(Import(target, runtime, node.lineno) for target in sorted(targets))
        for child in ast.iter_child_nodes(node):
            visit(child, runtime)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def _is_or_under(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


MODULES = repo_modules()
IMPORTS = {name: imports_of(name, path, MODULES) for name, path in MODULES.items()}


# -- the Vulkan binding -----------------------------------------------------------------------------


def test_exactly_one_module_imports_the_vulkan_binding():
    importers = sorted(
        f"{MODULES[name].relative_to(ROOT)}:{imp.line}"
        for name, imports in IMPORTS.items()
        for imp in imports
        if _is_or_under(imp.target, "vulkan")
    )
    files = {entry.rpartition(":")[0] for entry in importers}
    assert files == {str(MODULES[LOADING_MODULE].relative_to(ROOT))}, (
        f"only {LOADING_MODULE} may import vulkan (re-export it from there); found {importers}"
    )


def runtime_closure(start: str) -> set[str]:
    """Repository modules that importing ``start`` runs, following runtime imports."""
    seen: set[str] = set()
    pending = [start]
    while pending:
        name = pending.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # a.b.c runs a and a.b first
            module = ".".join(parts[:i])
            if module in MODULES and module not in seen:
                seen.add(module)
                pending.extend(imp.target for imp in IMPORTS[module] if imp.runtime)
    return seen


def test_pure_policy_never_loads_the_binding():
    for module in PURE_POLICY:
        assert module in MODULES, f"{module} moved: update PURE_POLICY"
        reached = runtime_closure(module)
        assert LOADING_MODULE not in reached, f"importing {module} runs {LOADING_MODULE}"


def test_pure_policy_imports_where_vulkan_is_missing():
    """The same, for real: with the binding blocked, the pure modules still import."""
    code = "import sys; sys.modules['vulkan'] = None\n" + "".join(f"import {m}\n" for m in PURE_POLICY)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- flow/'s tiers ----------------------------------------------------------------------------------
# A module imports only modules of its own tier or lower ones; only entry points import actors/.
# Every flow module must be listed: a new one is placed on purpose, not by default.

FLOW_TIERS: dict[str, int] = {
    # 0: records: frozen data and the errors that describe it
    **dict.fromkeys(("spec", "spec_base", "spec_model", "spec_data", "errors", "program", "device_facts"), 0),
    # 1: pure decisions on records
    **dict.fromkeys(("codec", "validation", "spec_rules", "summary", "shapes", "model_graph", "graph"), 1),
    **dict.fromkeys(("autodiff", "optim", "planning", "data_plan", "pipeline_plan", "parallel_plan"), 1),
    "autodiff_matmul": 1,  # a MatMul layer's launches
    "stage_plan": 1,  # a model split over devices as pipeline stages
    "weight_copies": 1,  # where mixed precision keeps its weights' fp16 copies
    **dict.fromkeys(("plan_table", "preflight", "inputs", "metrics", "generation"), 1),
    "device_choice": 1,  # what Devices("auto") picks, from device facts
    **dict.fromkeys(("onnx_export", "onnx_import"), 1),  # a model as an ONNX graph and back
    "report": 1,  # a metrics file's figures, plotted (imports no other flow module)
    # 2: entry points: the only flow modules that run actors
    **dict.fromkeys(("__init__", "__main__", "runner", "runtime", "run_command", "inference", "testing"), 2),
    "callbacks": 2,  # user code the runtime calls; its on_end takes a RunResult
    **dict.fromkeys(("safetensors_io", "predict_command"), 2),  # they load checkpoints
    "onnx_io": 2,  # ONNX files from checkpoints
    "tensorboard_logger": 2,  # a callback
}
TIER_NAMES = ("records", "pure decisions", "entry")
# Violations that exist today, each to be removed from here when fixed (the test fails on a listed
# violation that no longer exists, so this list only shrinks). Entries: (module, imported module).
KNOWN_FLOW_VIOLATIONS: set[tuple[str, str]] = set()


def _flow_short(module: str) -> str:
    return "__init__" if module == "flow" else module.removeprefix("flow.")


def flow_violations() -> set[tuple[str, str]]:
    """(flow module, module it must not import) for every import against the tiers."""
    found = set()
    for name, imports in IMPORTS.items():
        if not _is_or_under(name, "flow") or _flow_short(name) not in FLOW_TIERS:
            continue
        tier = FLOW_TIERS[_flow_short(name)]
        for imp in imports:
            if _is_or_under(imp.target, "actors"):
                if tier < FLOW_TIERS["runner"]:
                    found.add((name, imp.target))
            elif _is_or_under(imp.target, "flow") and FLOW_TIERS.get(_flow_short(imp.target), -1) > tier:
                found.add((name, imp.target))
    return found


def test_every_flow_module_has_a_tier():
    flow = {_flow_short(name) for name in MODULES if _is_or_under(name, "flow")}
    unplaced = sorted(flow - FLOW_TIERS.keys())
    assert not unplaced, f"place these flow modules in FLOW_TIERS (tests/test_layers.py): {unplaced}"


def test_flow_tiers_import_only_downwards_and_only_entry_points_import_actors():
    found = flow_violations()
    new = sorted(found - KNOWN_FLOW_VIOLATIONS)
    described = [
        f"{module} ({TIER_NAMES[FLOW_TIERS[_flow_short(module)]]}) imports {target}" for module, target in new
    ]
    assert not new, "flow/ layering broken:\n" + "\n".join(described)
    fixed = sorted(KNOWN_FLOW_VIOLATIONS - found)
    assert not fixed, f"fixed, so remove from KNOWN_FLOW_VIOLATIONS: {fixed}"


# -- the shared cache directory --------------------------------------------------------------------
# loaders/ and shaders/ share one module, shaders.user_cache (the one cache directory), and nothing
# else: a loader must not load the shader registry, and compiling a kernel must not load every
# source, numpy and Pillow. Importing it runs only itself and the shaders package, which must stay
# free of imports for that.

SHARED_CACHE = "shaders.user_cache"


def test_loaders_and_shaders_share_only_the_user_cache():
    crossing = sorted(
        f"{MODULES[name].relative_to(ROOT)}:{imp.line} imports {imp.target}"
        for name, imports in IMPORTS.items()
        for package, other, allowed in (("loaders", "shaders", SHARED_CACHE), ("shaders", "loaders", None))
        if _is_or_under(name, package)
        for imp in imports
        if _is_or_under(imp.target, other) and imp.target != allowed
    )
    assert not crossing, "\n".join(crossing)
    assert runtime_closure(SHARED_CACHE) == {"shaders", SHARED_CACHE}, (
        f"importing {SHARED_CACHE} must load nothing else of vkflow"
    )

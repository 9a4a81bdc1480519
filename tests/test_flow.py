"""The flow package's surface: ``help(flow)`` and ``dir(flow)`` show the whole API, while importing a
records module (``flow.spec``) loads nothing above it."""

from __future__ import annotations

import pydoc
import subprocess
import sys

import flow


def test_help_and_dir_show_the_runtime_api():
    text = pydoc.render_doc(flow, renderer=pydoc.plaintext)
    shown = ("run(", "predict(", "open_pipeline(", "check(", "plan(", "class RunResult(", "class SpecError(")
    for name in shown:
        assert name in text, name
    assert {"run", "predict", "open_pipeline", "RunResult", "ActorError"} <= set(dir(flow))
    for name in ("run", "predict", "open_pipeline", "RunResult", "check", "plan", "save", "load"):
        assert f"``{name}``" in flow.__doc__, name  # the module's own page names the main entry points
    assert sorted(flow.__all__) == sorted(flow._EXPORTS)
    assert all(getattr(flow, name) is not None for name in flow.__all__)


def test_importing_the_spec_loads_only_records():
    """A process that only builds specs (a config generator, a notebook cell) pays for the records
    (flow.spec and the records modules it re-exports): no codec, plan, shader registry, msgpack,
    trio, numpy or Vulkan."""
    code = (
        "import sys, flow.spec\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('flow', 'actors', 'shaders', 'loaders', 'msgpack', 'trio', 'vulkan', 'numpy'))))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    records = ["flow.spec", "flow.spec_base", "flow.spec_data", "flow.spec_model"]
    assert loaded.stdout.split() == ["flow", *records]


def test_functions_are_not_shadowed_by_their_modules():
    """``flow.plan`` and ``flow.validate`` stay the functions after their modules load (a submodule
    import binds the submodule on its package, so no module may share a public function's name)."""
    import flow.planning
    import flow.validation

    assert flow.plan is flow.planning.plan and callable(flow.plan)
    assert flow.validate is flow.validation.validate and callable(flow.validate)
    module_names = {m.name for m in __import__("pkgutil").iter_modules(flow.__path__)}
    assert module_names.isdisjoint(flow.__all__)

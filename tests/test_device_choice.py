"""What ``Devices("auto")`` picks (flow.device_choice): the rule on made-up device facts, then
``flow plan`` and ``flow run`` on this machine's real devices, which print the choice and its reason.

The suite's runs under "auto" use Vulkan device 0 (tests/conftest.py sets VKFLOW_AUTO_DEVICE);
these tests remove it, so the rule itself decides.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from actors.cpu_backend import cpu_facts
from actors.device_select import AUTO_ENV, list_devices
from flow.device_choice import choose_auto
from flow.device_facts import DeviceFacts

ROOT = Path(__file__).resolve().parent.parent


def device(name: str, kind: str, index: int = 0) -> DeviceFacts:
    return DeviceFacts(index, name, kind, "vendor", 0x1234, "1.3.0", "1.0")


LAVAPIPE = device("llvmpipe (LLVM 15.0.6, 256 bits)", "cpu")
SWIFTSHADER = device("SwiftShader Device (LLVM 10.0.0)", "cpu")
INTEGRATED = device("Intel(R) UHD Graphics 770", "integrated")
DISCRETE = device("NVIDIA H100 80GB HBM3", "discrete")
VIRTUAL = device("Virtio-GPU Venus", "virtual")


@pytest.mark.parametrize(
    "listed, chosen",
    [
        ((LAVAPIPE,), "cpu backend"),
        ((LAVAPIPE, SWIFTSHADER), "cpu backend"),
        ((LAVAPIPE, INTEGRATED), INTEGRATED.name),
        ((INTEGRATED, DISCRETE, LAVAPIPE), DISCRETE.name),
        ((VIRTUAL, INTEGRATED), INTEGRATED.name),
        ((LAVAPIPE, VIRTUAL), VIRTUAL.name),
        ((replace(DISCRETE, name="first"), replace(DISCRETE, name="second")), "first"),
    ],
)
def test_hardware_beats_the_cpu_backend_which_beats_a_software_rasteriser(listed, chosen):
    choice = choose_auto(listed, cpu_facts())
    name = "cpu backend" if choice.facts.is_numpy else choice.facts.name
    assert name == chosen
    assert not choice.fallback and choice.reason.startswith("auto: ")
    if choice.facts.is_numpy:  # names what it passed over, and why
        assert all(d.name in choice.reason for d in listed) and "software Vulkan device" in choice.reason
    else:
        assert choice.facts.name in choice.reason and choice.facts.kind in choice.reason


def test_no_vulkan_device_falls_back_to_the_cpu_with_the_reason():
    choice = choose_auto((), cpu_facts(), "no Vulkan: libvulkan.so.1 not found")
    assert choice.facts.is_numpy and choice.fallback
    assert choice.reason == "auto: the CPU (numpy) backend: no Vulkan: libvulkan.so.1 not found"


def _rule_on_this_machine() -> tuple[str, str]:
    """The device name the rule picks from this machine's real listing, and its reason."""
    devices, missing = list_devices()
    choice = choose_auto(devices, cpu_facts(), missing)
    return choice.facts.name, choice.reason


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != AUTO_ENV}
    return subprocess.run([sys.executable, "-m", "flow", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_flow_plan_prints_the_choice_and_its_reason(tmp_path):
    name, reason = _rule_on_this_machine()
    text = _cli(["plan", str(ROOT / "examples" / "digits.json")], tmp_path)
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0] == f"device choice: {reason}"
    listed = _cli(["plan", str(ROOT / "examples" / "digits.json"), "--json"], tmp_path)
    assert json.loads(listed.stdout)["device_choice"] == reason
    if all(d.kind == "cpu" for d in list_devices()[0]):  # lavapipe alone (CI): numpy is faster
        assert name == cpu_facts().name and "slower than numpy" in reason


def test_a_run_under_auto_runs_on_the_chosen_device_and_says_why(tmp_path):
    name, reason = _rule_on_this_machine()
    spec = json.loads((ROOT / "examples" / "digits.json").read_text())
    spec["run"].update(epochs=2, checkpoint_dir=None, metrics_file=None)
    (tmp_path / "digits.json").write_text(json.dumps(spec))
    done = _cli(["run", "digits.json", "--quiet"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == [f"device: {name}", f"device choice: {reason}"]
    assert float(lines[-1].removeprefix("accuracy: ")) > 0.8  # it trained: chance is 0.1
    # An explicit choice is no "auto" choice: no reason line.
    explicit = _cli(["run", "digits.json", "--quiet", "--device", "cpu"], tmp_path)
    assert explicit.returncode == 0 and "device choice" not in explicit.stdout

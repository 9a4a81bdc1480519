"""actors.device_select: ``flow devices --json`` lists the device with its facts, and without a
driver there is one clear message and the CPU fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_devices_json_lists_the_device_with_its_facts(vulkan_backend):
    done = subprocess.run(
        [sys.executable, "-m", "flow", "devices", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    listing = json.loads(done.stdout)
    names = [d["name"] for d in listing["devices"]]
    assert vulkan_backend.facts.name in names
    device = listing["devices"][names.index(vulkan_backend.facts.name)]
    assert device["subgroup_size"] == vulkan_backend.facts.subgroup_size > 0
    assert device["shared_memory_bytes"] >= 16384
    assert "timeline_semaphore" in device["features"]
    assert any(f["compute"] for f in device["queue_families"])


def test_no_driver_gives_a_clear_message_and_the_cpu_fallback(tmp_path):
    env = dict(
        os.environ, VK_DRIVER_FILES=str(tmp_path / "missing.json"), VK_ICD_FILENAMES=str(tmp_path / "x.json")
    )
    env.pop("VKFLOW_AUTO_DEVICE", None)  # "auto" by its rule (tests/conftest.py sets it to device 0)
    script = (
        "from actors.device_select import list_devices, open_device, select_facts\n"
        "devices, message = list_devices()\n"
        "facts, why = select_facts('auto')\n"
        "backend = open_device(facts)\n"
        "print(len(devices), type(backend).__name__)\n"
        "print(message)\n"
        "print(why)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, check=True
    )
    first, message, why = done.stdout.splitlines()[:3]
    assert first == "0 CpuBackend"
    assert "CPU" in message and "CPU" in why
    cli = subprocess.run(
        [sys.executable, "-m", "flow", "devices"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=True,
    )
    assert "CPU" in cli.stdout


def test_auto_on_a_cpu_kind_vulkan_device_opens_vulkan_not_numpy(vulkan_backend):
    """lavapipe reports the Vulkan device type CPU, as the numpy backend's facts do: selecting it
    must still open the Vulkan driver (it once opened the numpy backend in its place)."""
    from actors.device_select import open_device, select_facts

    facts, _ = select_facts(vulkan_backend.facts.index)
    backend = open_device(facts)
    try:
        assert type(backend).__name__ == "VulkanBackend" and not facts.is_numpy
        assert backend.facts.name == vulkan_backend.facts.name
    finally:
        backend.close()


def test_devices_lists_every_vulkan_device_and_the_cpu_backend(vulkan_backend):
    done = subprocess.run(
        [sys.executable, "-m", "flow", "devices", "--json"], capture_output=True, text=True, cwd=ROOT,
        check=True,
    )
    listing = json.loads(done.stdout)["devices"]
    assert [d["vendor"] for d in listing][-1] == "numpy"
    assert vulkan_backend.facts.name in [d["name"] for d in listing[:-1]]

"""One user cache directory for everything vkflow caches (shaders.user_cache): ``VKFLOW_CACHE`` moves
the compiled SPIR-V, the GEMM tuning tables, the image-folder manifests and the digits' PNGs alike,
and without it ``XDG_CACHE_HOME`` and then ``~/.cache`` decide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from loaders import ImageFolderSource, manifest_path, open_digits
from loaders import digits as digits_module
from shaders import compiler, gemm_tuning
from shaders.user_cache import cache_dir


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VKFLOW_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("VKFLOW_GEMM_TUNING", raising=False)
    return monkeypatch


def test_vkflow_cache_then_xdg_cache_home_then_home(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    assert cache_dir() == tmp_path / "home" / ".cache" / "vkflow"
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("spirv") == tmp_path / "xdg" / "vkflow" / "spirv"
    env.setenv("VKFLOW_CACHE", "")  # empty counts as unset, as for XDG_CACHE_HOME
    assert cache_dir() == tmp_path / "xdg" / "vkflow"
    env.setenv("VKFLOW_CACHE", str(tmp_path / "mine"))
    assert cache_dir("tuning", "gpu.json") == tmp_path / "mine" / "tuning" / "gpu.json"


def test_vkflow_cache_moves_every_cache(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    mine = tmp_path / "mine"
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # set too, to show VKFLOW_CACHE wins
    env.setenv("VKFLOW_CACHE", str(mine))

    compiler.compile_shader("fill.comp")
    assert len(list((mine / "spirv").glob("fill-*.spv"))) == 1

    device = "Test GPU 9000"
    table = gemm_tuning.cache_path(device)
    assert table.parent == mine / "tuning"
    tiles = {"BM": 16, "BN": 16, "BK": 8, "TM": 2, "TN": 2}
    gemm_tuning.write_table(table, device, "test", {gemm_tuning.shape_key(3, 5, 7, 0, 0): tiles})
    assert gemm_tuning.lookup(device, 3, 5, 7, 0, 0) == tiles
    assert json.loads(table.read_text())["device"] == device

    images = tmp_path / "images"
    (images / "a").mkdir(parents=True)
    Image.fromarray(np.zeros((2, 2), np.uint8)).save(images / "a" / "0.png")
    ImageFolderSource(images, size=None, mode="L").close()
    assert manifest_path(images).parent == mine / "manifests" and manifest_path(images).exists()

    # Where the digits go by default (writing the 1797 PNGs is test_loaders_digits' job).
    written = []
    env.setattr(digits_module, "write_image_folder", lambda dest: written.append(dest) or images)
    open_digits().close()
    assert written == [mine / "digits"]
    assert not (tmp_path / "xdg").exists()


def test_the_tuning_lookup_follows_the_cache_when_it_moves(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    """The table lookup is memoised; moving the cache must not keep answering from the old one."""
    device = "Test GPU 9001"
    key = gemm_tuning.shape_key(3, 5, 7, 0, 0)
    tiles = {"BM": 16, "BN": 16, "BK": 8, "TM": 2, "TN": 2}
    env.setenv("VKFLOW_CACHE", str(tmp_path / "a"))
    gemm_tuning.write_table(gemm_tuning.cache_path(device), device, "test", {key: tiles})
    assert gemm_tuning.lookup(device, 3, 5, 7, 0, 0) == tiles
    env.setenv("VKFLOW_CACHE", str(tmp_path / "b"))
    assert gemm_tuning.lookup(device, 3, 5, 7, 0, 0) is None


def test_a_cache_root_that_is_a_file_names_its_setting(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    """A cache root that is a file fails once, naming the root and the variable that set it, from
    the library and from ``flow plan`` (which printed a traceback about a tuning table before)."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    env.setenv("VKFLOW_CACHE", str(blocker))
    with pytest.raises(NotADirectoryError, match=r"not-a-folder \(from \$VKFLOW_CACHE\) is a file"):
        cache_dir("spirv")
    env.delenv("VKFLOW_CACHE")
    env.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "vkflow").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"\(from \$XDG_CACHE_HOME\)"):
        cache_dir()

    spec = Path(__file__).resolve().parents[1] / "examples" / "digits.json"
    run = subprocess.run(
        [sys.executable, "-m", "flow", "plan", str(spec)],
        capture_output=True, text=True, env={**os.environ, "VKFLOW_CACHE": str(blocker)},
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    assert f"the vkflow cache {blocker} (from $VKFLOW_CACHE) is a file" in run.stdout

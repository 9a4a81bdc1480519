"""A plain (not editable) install works: the wheel built from the tree, installed into a fresh
virtual environment outside the repository, gives the ``vkflow`` script and ``python -m flow``
that check and train the bundled digits from any directory, with the wheel's own copy of the code.

The build is offline (``--no-build-isolation``, the test extra's setuptools) and from a copy of the
tree, so it writes nothing into the repository. The fresh environment gets the dependencies from
this one's site-packages through a ``.pth`` line (``--no-deps``: no index is asked); a ``.pth``
file read from there is not run, so this environment's editable install of the repository does not
leak in, which ``flow.__file__`` confirms.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flow", "actors", "loaders", "shaders")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """The wheel built and installed: the new environment's paths and the build's output."""
    base = tmp_path_factory.mktemp("install")
    source = base / "source"
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    wheels = base / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), "."],
        cwd=source, capture_output=True, text=True, env=_clean_env(),
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = wheels.glob("vkflow_ml-*.whl")
    env = base / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(site, "repo_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index"]
        + [str(wheel)],
        capture_output=True, text=True, env=_clean_env(),
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    return {"env": env, "python": python, "site": Path(site), "build": build.stdout + build.stderr}


def _clean_env() -> dict[str, str]:
    """This process's environment without a PYTHONPATH that could point at the repository."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=_clean_env(), timeout=300)


def test_the_build_says_nothing_about_shaders_tuning(installed):
    assert "shaders.tuning" not in installed["build"]
    assert "is absent from the `packages` configuration" not in installed["build"]


def test_the_installed_copy_is_the_one_imported_with_its_data(installed, tmp_path):
    code = (
        "import json, flow, shaders, loaders.digits, shaders.gemm_tuning as t; from pathlib import Path\n"
        "print(json.dumps({'flow': flow.__file__, 'tables': sorted(p.name for p in "
        "(Path(shaders.__file__).parent / 'tuning').glob('*.json')), 'comp': len(list("
        "Path(shaders.__file__).parent.glob('*.comp'))),\n"
        " 'digits': loaders.digits.load_digits_arrays()[0].shape[0]}))"
    )
    done = _run([str(installed["python"]), "-c", code], tmp_path)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert Path(found["flow"]).is_relative_to(installed["site"])
    shipped = sorted(p.name for p in (ROOT / "shaders" / "tuning").glob("*.json"))
    assert found["tables"] == shipped and shipped
    assert found["comp"] == len(list((ROOT / "shaders").glob("*.comp")))
    assert found["digits"] == 1797  # the bundled scikit-learn digits


def test_the_script_reports_its_version_and_checks_and_trains_a_spec(installed, tmp_path):
    script = installed["env"] / "bin" / "vkflow"
    version = _run([str(script), "--version"], tmp_path)
    assert version.stdout.strip() == "vkflow 0.1.0", version.stdout + version.stderr
    spec = json.loads((ROOT / "examples" / "digits.json").read_text())
    spec["run"].update(epochs=3, checkpoint_dir="runs/digits", metrics_file=None)
    (tmp_path / "digits.json").write_text(json.dumps(spec))
    check = _run([str(installed["python"]), "-m", "flow", "check", "digits.json"], tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "source: 1797 samples of shape (1, 8, 8), 10 classes" in check.stdout
    run = _run([str(installed["python"]), "-m", "flow", "run", "digits.json", "--quiet"], tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    accuracy = float(run.stdout.strip().splitlines()[-1].removeprefix("accuracy: "))
    assert accuracy > 0.85  # an MLP on the digits after three epochs; chance is 0.1
    assert list((tmp_path / "runs" / "digits").glob("*.ckpt"))

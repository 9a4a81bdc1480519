"""``python -m flow report RUN_DIR`` as a user meets it: a real digits run, reported through the CLI;
the page is self-contained (its only image a data: URI holding a real PNG, no link outside) and its
figures are the metrics file's numbers, read here independently; headless Chromium opens the page
and shows the plots (skipped where Chromium is not installed); each mistake is one ``error:`` line;
and the pure series extraction handles resumed runs, missing fields and profile lines."""

from __future__ import annotations

import base64
import io
import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import flow
from flow.report import draw, figures, page

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TAB_ORANGE = (255, 127, 14)
TAB_PURPLE = (148, 103, 189)  # matplotlib's second colour: the validation line and the channel peaks


def flow_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flow", *args], capture_output=True, text=True, cwd=ROOT, check=False
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """The bundled digits example, 3 epochs, trained and reported through the CLI."""
    folder = tmp_path_factory.mktemp("report") / "run"
    spec = flow.load(ROOT / "examples" / "digits.json")
    spec = replace(
        spec,
        run=replace(
            spec.run, epochs=3, checkpoint_dir=str(folder), metrics_file=str(folder / "metrics.jsonl")
        ),
    )
    flow.save(spec, folder.parent / "digits.json")
    trained = flow_cli("run", str(folder.parent / "digits.json"), "--quiet")
    assert trained.returncode == 0, trained.stderr
    reported = flow_cli("report", str(folder))
    assert reported.returncode == 0, reported.stderr
    assert reported.stdout.split() == [
        str(folder / name) for name in ("report.png", "report.html", "report.json")
    ]
    return folder


def metrics_lines(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


class PageParts(HTMLParser):
    """Every tag's attributes, and the cells of each table by its class."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.tables: dict[str, list[list[str]]] = {}
        self._table: list[list[str]] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        self.tags.append((tag, attributes))
        if tag == "table":
            self._table = self.tables.setdefault(attributes.get("class", ""), [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self._table[-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def parse_page(path: Path) -> PageParts:
    parts = PageParts()
    parts.feed(path.read_text(encoding="utf-8"))
    parts.close()
    return parts


def orange_pixels(image: Image.Image) -> int:
    pixels = np.asarray(image.convert("RGB"), dtype=np.int32)
    return int((np.abs(pixels - np.array(TAB_ORANGE)).sum(axis=2) < 30).sum())


def test_the_page_is_self_contained(run_dir):
    parts = parse_page(run_dir / "report.html")
    images = [attributes for tag, attributes in parts.tags if tag == "img"]
    assert len(images) == 1
    prefix = "data:image/png;base64,"
    assert images[0]["src"].startswith(prefix)
    png = base64.b64decode(images[0]["src"][len(prefix) :], validate=True)
    assert png.startswith(PNG_SIGNATURE)
    assert png == (run_dir / "report.png").read_bytes()
    image = Image.open(io.BytesIO(png))
    image.verify()
    assert 800 <= min(image.size) and max(image.size) <= 3000
    # The plots, not a blank canvas: many colours, and the validation line's orange.
    image = Image.open(io.BytesIO(png))
    assert len(image.convert("RGB").getcolors(maxcolors=1 << 20)) > 100
    assert orange_pixels(image) > 500
    for tag, attributes in parts.tags:
        for name, value in attributes.items():
            assert not (value or "").lower().startswith(("http:", "https:", "//", "file:")), (
                tag,
                name,
                value,
            )
        assert tag not in ("script", "link", "iframe", "object", "embed")
    assert "url(" not in (run_dir / "report.html").read_text()


def test_the_figures_are_the_runs_numbers(run_dir):
    lines = metrics_lines(run_dir)
    steps = [line for line in lines if line["event"] == "step"]
    evals = [line for line in lines if line["event"] == "eval" and line["split"] == "val"]
    assert len(steps) == 69 and len(evals) == 3  # 1437 training samples, batches of 64, 3 epochs
    data = json.loads((run_dir / "report.json").read_text())
    series = data["series"]
    assert series["train_loss"] == {"steps": [s["step"] for s in steps], "values": [s["loss"] for s in steps]}
    assert series["train_accuracy"]["values"] == [s["accuracy"] for s in steps]
    assert series["val_loss"] == {"steps": [e["step"] for e in evals], "values": [e["loss"] for e in evals]}
    assert series["val_accuracy"]["values"] == [e["accuracy"] for e in evals]
    measured = [s for s in steps if s["samples_per_second"] > 0]
    assert series["samples_per_second"]["values"] == [s["samples_per_second"] for s in measured]
    assert len(measured) >= len(steps) - 1

    last = [line["statistics"] for line in steps if "statistics" in line][-1]
    assert [a["name"] for a in data["actors"]] == list(last)
    for actor in data["actors"]:
        for state in ("busy", "idle", "blocked"):
            assert actor[state] == last[actor["name"]][f"{state}_seconds"]
    with_inbox = [name for name, stats in last.items() if stats["inbox_capacity"] > 0]
    assert [c["into"] for c in data["channels"]] == with_inbox
    for channel in data["channels"]:
        assert channel["capacity"] == last[channel["into"]]["inbox_capacity"]
        assert 0 <= channel["mean_used"] <= channel["peak"] <= channel["capacity"]
    assert data["launches"] == []
    assert any("profile=True" in note for note in data["notes"])

    # The page's table says the same, to its 6 significant digits.
    table = {row[0]: row[1:] for row in parse_page(run_dir / "report.html").tables["last"][1:]}
    assert table["val_accuracy"][0] == str(evals[-1]["step"])
    assert math.isclose(float(table["val_accuracy"][1]), evals[-1]["accuracy"], rel_tol=1e-5)
    assert math.isclose(float(table["train_loss"][1]), steps[-1]["loss"], rel_tol=1e-5)
    assert evals[-1]["accuracy"] > 0.9  # the digits learn in 3 epochs: the plotted run is a real one


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="chromium is not installed (apt-get install -y chromium)"
)
def test_chromium_shows_the_plots(run_dir, tmp_path):
    shot = tmp_path / "shot.png"
    page = (run_dir / "report.html").as_uri()
    # A container's /dev/shm is small: --disable-dev-shm-usage keeps Chromium's buffers in /tmp.
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    command = ["chromium", *flags, f"--screenshot={shot}", "--window-size=1400,1400", page]
    opened = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert opened.returncode == 0, opened.stderr[-2000:]
    image = Image.open(shot)
    assert image.size == (1400, 1400)
    assert len(image.convert("RGB").getcolors(maxcolors=1 << 20)) > 100
    assert orange_pixels(image) > 300  # the embedded plots drew: a broken image has none


def write_lines(path: Path, *lines: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "no such run directory"),
        ("empty_dir", "no metrics file"),
        ("corrupt", "metrics.jsonl:3: not a metrics line"),
        ("no_steps", "no training step lines"),
    ],
)
def test_a_mistake_is_one_error_line(tmp_path, case, expected):
    folder = tmp_path / "run"
    if case != "missing":
        folder.mkdir()
    step = '{"event": "step", "step": 0, "loss": 2.3}'
    if case == "corrupt":
        write_lines(
            folder / "metrics.jsonl", '{"event": "run", "run": "x", "step": 0}', step, '{"event": "st'
        )
    if case == "no_steps":
        write_lines(folder / "metrics.jsonl", '{"event": "run", "run": "x", "step": 0}')
    result = flow_cli("report", str(folder))
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert expected in result.stderr and str(folder) in result.stderr
    assert not (folder / "report.html").exists()


def test_without_matplotlib_it_says_how_to_install(tmp_path):
    folder = tmp_path / "run"
    write_lines(folder / "metrics.jsonl", '{"event": "step", "step": 0, "loss": 2.3}')
    hide = "import sys; sys.modules['matplotlib'] = None; from flow.__main__ import main; sys.exit(main())"
    result = subprocess.run(
        [sys.executable, "-c", hide, "report", str(folder)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 1
    assert (
        result.stderr.startswith("error: ")
        and "[report]'" in result.stderr
        and "pip install" in result.stderr
    )
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["metrics.jsonl"]


def statistics(rng, names=("loader", "device", "sink")) -> dict:
    return {
        name: {
            "busy_seconds": float(rng.uniform(0.1, 2)),
            "idle_seconds": float(rng.uniform(0.1, 2)),
            "blocked_seconds": float(rng.uniform(0, 1)),
            "inbox_capacity": 0 if name == "loader" else 4,
            "inbox_used": int(rng.integers(0, 5)),
            "inbox_peak": 4,
        }
        for name in names
    }


def test_a_resumed_run_keeps_each_steps_latest_value_and_sums_its_stints(rng):
    first, second = statistics(rng), statistics(rng)
    losses = rng.uniform(0.1, 3, size=20)
    events = [{"event": "run", "step": 0}]
    events += [
        {"event": "step", "step": s, "loss": float(losses[s]), "samples_per_second": 100.0 + s}
        for s in range(8)
    ]
    events[-1]["statistics"] = first
    events.append({"event": "run", "step": 5, "resumed": True})  # killed after step 7, resumed from 5
    events += [{"event": "step", "step": s, "loss": float(losses[s + 7])} for s in range(5, 13)]
    events[-1]["statistics"] = second
    events.append({"event": "eval", "split": "test", "step": 12, "loss": 0.5, "accuracy": None})
    figs = figures(events)
    assert figs.series["train_loss"].steps == tuple(range(13))
    assert figs.series["train_loss"].values == tuple(losses[:5]) + tuple(losses[12:20])
    assert figs.series["samples_per_second"].steps == tuple(range(8))  # the second stint has none
    assert figs.series["test_loss"].values == (0.5,) and "test_accuracy" not in figs.series
    for actor in figs.actors:
        for state in ("busy", "idle", "blocked"):
            total = first[actor.name][f"{state}_seconds"] + second[actor.name][f"{state}_seconds"]
            assert math.isclose(getattr(actor, state), total, rel_tol=1e-12)
    assert [c.into for c in figs.channels] == ["device", "sink"]
    for channel in figs.channels:
        mean = (first[channel.into]["inbox_used"] + second[channel.into]["inbox_used"]) / 2
        assert channel.mean_used == mean and (channel.capacity, channel.peak) == (4, 4)
    assert any("no validation" in note for note in figs.notes)


def test_missing_fields_become_notes_and_profile_lines_become_launch_times(rng, tmp_path):
    stats = statistics(rng)
    del stats["device"]["idle_seconds"]
    times = {name: rng.uniform(1e-5, 1e-3, size=3) for name in ("gemm", "softmax_xent")}
    events = [{"event": "step", "step": 0, "loss": 1.0, "statistics": stats}]
    for i in range(3):  # the two forms a profile line may take
        launches = (
            [{"name": n, "ns": float(t[i] * 1e9)} for n, t in times.items()]
            if i % 2
            else {n: float(t[i]) for n, t in times.items()}
        )
        events.append({"event": "profile", "step": i, "launches": launches})
    figs = figures(events)
    device = next(a for a in figs.actors if a.name == "device")
    assert device.idle is None and device.busy == stats["device"]["busy_seconds"]
    assert any("idle_seconds" in note for note in figs.notes)
    assert sorted(launch.name for launch in figs.launches) == ["gemm", "softmax_xent"]
    for launch in figs.launches:
        assert launch.count == 3
        assert math.isclose(launch.mean_ms, times[launch.name].mean() * 1e3, rel_tol=1e-9)
    assert figs.launches[0].total_ms >= figs.launches[1].total_ms
    assert not any("profile" in note for note in figs.notes)

    # Drawn and tabled: the launch panel's bars (purple) and one table row per launch.
    png = draw(figs)
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int32)
    assert (np.abs(pixels - np.array(TAB_PURPLE)).sum(axis=2) < 30).sum() > 500
    html_page = tmp_path / "page.html"
    html_page.write_text(page(figs, png))
    rows = {row[0]: row[1:] for row in parse_page(html_page).tables["launches"][1:]}
    for name, seconds in times.items():
        assert math.isclose(float(rows[name][0]), seconds.mean() * 1e3, rel_tol=1e-5)
    assert rows["gemm"][2] == "3"

"""``python -m flow report RUN_DIR``: a run's figures as a PNG and a self-contained HTML page.

The run's metrics file (``RUN_DIR/metrics.jsonl``, or the one JSON-lines file there, or a file
given directly) is the only input. :func:`figures` turns its events into a :class:`Figures` record
(pure: no matplotlib, no files); :func:`draw` renders that record as one PNG (matplotlib, imported
only here, on its Agg canvas so no display or GUI backend is touched); :func:`page` wraps the PNG,
base64-encoded, and the record's numbers as tables in one HTML page with no external resource.
:func:`write_report` writes ``report.png``, ``report.html`` and ``report.json`` (the plotted series).

What is read: ``"step"`` lines (loss, accuracy, samples/s), ``"eval"`` lines (validation and test),
the actors' cumulative ``"statistics"`` some step lines carry (busy, idle and blocked seconds, inbox
fill) and ``"profile"`` lines, ``{"event": "profile", "launches": [{"name", "seconds"}, ...]}``
(also ``"ms"``/``"us"``/``"ns"``, or a ``{name: seconds}`` mapping), the GPU time of each launch
from timestamp queries. A field a file lacks becomes a note on the page, not a failure: files
written by older or newer vkflow still report what they hold. Statistics restart with each process
(each ``"run"`` line), so a resumed run's actor times are the sum of each stint's last figures.
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flow.metrics import step_lines

INSTALL_HINT = "the report draws with matplotlib: pip install 'vkflow-ml[report]' (or pip install matplotlib)"
TIMES = ("busy", "idle", "blocked")
# Bar charts' legends go under the x label, in one row: inside the axes they would hide bars.
BELOW = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.12), "ncols": 3, "frameon": False}
UNITS = {"seconds": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}  # a launch's time fields, to seconds


class ReportError(ValueError):
    """A run directory that cannot be reported on (missing, no metrics file, a corrupt line)."""


@dataclass(frozen=True)
class Series:
    """One plotted line: ``values[i]`` at ``steps[i]``."""

    steps: tuple[int, ...] = ()
    values: tuple[float, ...] = ()


@dataclass(frozen=True)
class ActorTimes:
    """An actor's seconds in each state over the run (None: the file does not say)."""

    name: str
    busy: float | None
    idle: float | None
    blocked: float | None


@dataclass(frozen=True)
class Channel:
    """The channel into an actor: its capacity, the most items it held, and its mean fill over
    the statistics samples (items waiting when each was taken)."""

    into: str
    capacity: int
    peak: int
    mean_used: float


@dataclass(frozen=True)
class Launch:
    """One launch's GPU time over the profiled steps, in milliseconds."""

    name: str
    mean_ms: float
    total_ms: float
    count: int


@dataclass(frozen=True)
class Figures:
    """Everything the report shows, as plain data (``report.json`` is its ``asdict``)."""

    metrics_file: str
    series: dict[str, Series]  # train_loss, train_accuracy, samples_per_second, val_*, test_*
    actors: tuple[ActorTimes, ...]
    channels: tuple[Channel, ...]
    launches: tuple[Launch, ...]
    notes: tuple[str, ...]


def metrics_path(run_dir: str | Path) -> Path:
    """The metrics file of ``run_dir``: the path itself when it is a file, else ``metrics.jsonl``
    in it, else the one ``*.jsonl`` file in it.

    Raises:
        ReportError: no such directory, or no metrics file in it.
    """
    path = Path(run_dir)
    if path.is_file():
        return path
    if not path.is_dir():
        raise ReportError(
            f"{path}: no such run directory (give the run's checkpoint_dir or its metrics file)"
        )
    if (path / "metrics.jsonl").is_file():
        return path / "metrics.jsonl"
    found = sorted(path.glob("*.jsonl"))
    if len(found) != 1:
        what = "no metrics file" if not found else f"{len(found)} .jsonl files, so no single metrics file"
        raise ReportError(
            f"{path}: {what} (a run writes one with RunSettings(metrics_file=...)); give the file"
        )
    return found[0]


def read_events(path: Path) -> list[dict[str, Any]]:
    """The metrics file's events, in order.

    Raises:
        ReportError: a line that is not a JSON object (naming the file and line), or no events.
    """
    events = []
    with open(path, encoding="utf-8", errors="replace") as file:  # bad bytes: a corrupt line
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if not isinstance(event, dict):
                raise ReportError(
                    f"{path}:{number}: not a metrics line (a JSON object): {line.strip()[:60]!r}"
                )
            events.extend(step_lines(event))  # a "steps" line (RunSettings.metrics_every): its steps
    if not any(event.get("event") == "step" for event in events):
        raise ReportError(f"{path}: no training step lines, nothing to report")
    return events


def _number(value: Any) -> float | None:
    """A finite number, or None (JSON null, a string, a bool)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _series(points: dict[int, float]) -> Series:
    steps = sorted(points)
    return Series(tuple(steps), tuple(points[s] for s in steps))


def _launch_seconds(launches: Any) -> list[tuple[str, float]]:
    """(name, seconds) for each launch of a profile line; unreadable entries are left out."""
    if isinstance(launches, dict):
        return [(str(k), s) for k, v in launches.items() if (s := _number(v)) is not None]
    found = []
    for launch in launches if isinstance(launches, list) else ():
        if isinstance(launch, dict) and "name" in launch:
            for unit, scale in UNITS.items():
                if (value := _number(launch.get(unit))) is not None:
                    found.append((str(launch["name"]), value * scale))
                    break
    return found


def _actors(stints: list[dict[str, dict]], notes: list[str]) -> tuple[ActorTimes, ...]:
    """Each actor's times, summed over the stints' last statistics (each process counts anew)."""
    last: dict[str, dict[str, float | None]] = {}
    for stint in stints:
        for name, stats in stint.items():
            totals = last.setdefault(name, dict.fromkeys(TIMES, 0.0))
            for time in TIMES:
                value = _number(stats.get(f"{time}_seconds"))
                totals[time] = None if value is None or totals[time] is None else totals[time] + value
    missing = sorted({t for totals in last.values() for t, v in totals.items() if v is None})
    if missing:
        notes.append(f"the statistics lack {', '.join(f'{t}_seconds' for t in missing)} for some actors")
    return tuple(ActorTimes(name, **totals) for name, totals in last.items())


def _channels(samples: list[dict[str, dict]], notes: list[str]) -> tuple[Channel, ...]:
    """Each actor's inbox: capacity and peak (the largest seen), mean fill over the samples."""
    capacity: dict[str, int] = {}
    peak: dict[str, int] = {}
    used: dict[str, list[float]] = {}
    for sample in samples:
        for name, stats in sample.items():
            if not (cap := _number(stats.get("inbox_capacity"))):  # 0: no inbox (the loader)
                continue
            capacity[name] = max(capacity.get(name, 0), int(cap))
            peak[name] = max(peak.get(name, 0), int(_number(stats.get("inbox_peak")) or 0))
            used.setdefault(name, []).append(_number(stats.get("inbox_used")) or 0.0)
    if samples and not capacity:
        notes.append("the statistics hold no channel figures (inbox_capacity)")
    return tuple(
        Channel(name, capacity[name], peak[name], sum(used[name]) / len(used[name])) for name in capacity
    )


def figures(events: list[dict[str, Any]], metrics_file: str = "") -> Figures:
    """What the report shows, from a metrics file's events (pure).

    Args:
        events: the file's lines as dicts, in order (see :func:`read_events`).
        metrics_file: the file's name, for the page.

    Returns:
        The series (a step repeated after a resume keeps its latest value), the actors' times,
        the channels, the profiled launches and notes on what the file lacks.
    """
    points: dict[str, dict[int, float]] = {}
    stints: list[dict[str, dict]] = [{}]
    samples: list[dict[str, dict]] = []
    profile: dict[str, list[float]] = {}
    profile_lines = 0
    profile_notes: list[str] = []
    for event in events:
        kind, step = event.get("event"), event.get("step")
        if kind == "run" and stints[-1]:
            stints.append({})
        if kind == "profile":  # one line at the end of a run, with no step of its own
            profile_lines += 1
            for name, seconds in _launch_seconds(event.get("launches")):
                profile.setdefault(name, []).append(seconds * 1e3)
            if isinstance(note := event.get("note"), str) and note:
                profile_notes.append(f"no GPU times per launch: {note}")
        if not isinstance(step, int):
            continue
        if kind == "step":
            for field, name in (("loss", "train_loss"), ("accuracy", "train_accuracy")):
                if (value := _number(event.get(field))) is not None:
                    points.setdefault(name, {})[step] = value
            if (rate := _number(event.get("samples_per_second"))) is not None and rate > 0:
                points.setdefault("samples_per_second", {})[step] = rate  # 0: not measured yet
            if isinstance(stats := event.get("statistics"), dict):
                stints[-1] = {name: s for name, s in stats.items() if isinstance(s, dict)}
                samples.append(stints[-1])
        elif kind == "eval":
            split = event.get("split", "val")
            for field in ("loss", "accuracy"):
                if (value := _number(event.get(field))) is not None:
                    points.setdefault(f"{split}_{field}", {})[step] = value
    notes: list[str] = []
    if not samples:
        notes.append("no actor statistics in the metrics file")
    if "val_loss" not in points:
        notes.append("no validation rounds (no validation split, or the run ended before one)")
    if not profile:
        notes += profile_notes or [
            "no GPU times per launch: run with RunSettings(profile=True)"
            if not profile_lines
            else f"{profile_lines} profile line(s), but no launch times in a known form"
        ]
    launches = sorted(
        (Launch(name, sum(ms) / len(ms), sum(ms), len(ms)) for name, ms in profile.items()),
        key=lambda launch: -launch.total_ms,
    )
    actors = _actors([s for s in stints if s], notes)
    return Figures(
        metrics_file=metrics_file,
        series={name: _series(values) for name, values in points.items()},
        actors=actors,
        channels=_channels(samples, notes),
        launches=tuple(launches),
        notes=tuple(notes),
    )


def _empty(axes: Any, title: str, why: str) -> None:
    axes.set_title(title)
    axes.set_axis_off()
    axes.text(0.5, 0.5, why, ha="center", va="center", wrap=True, transform=axes.transAxes, color="0.4")


def _lines(axes: Any, figs: Figures, field: str, title: str) -> None:
    """Training per step (thin), validation per round (markers), the test split's final figure."""
    styles = {"train": {"lw": 0.8, "alpha": 0.8}, "val": {"marker": "o"}, "test": {"marker": "*", "ls": ""}}
    if not any(f"{split}_{field}" in figs.series for split in styles):
        return _empty(axes, title, f"no {field} in the metrics file")
    for split, style in styles.items():
        if series := figs.series.get(f"{split}_{field}"):
            axes.plot(series.steps, series.values, label=split, **style)
    axes.set(title=title, xlabel="step")
    axes.grid(alpha=0.3)
    axes.legend()


def _actor_bars(axes: Any, figs: Figures) -> None:
    actors = [a for a in figs.actors if None not in (a.busy, a.idle, a.blocked)]
    if not actors:
        return _empty(axes, "actor time", "no actor statistics")
    names = [a.name for a in actors][::-1]
    left = [0.0] * len(actors)
    for state, colour in zip(TIMES, ("tab:green", "tab:gray", "tab:red"), strict=True):
        widths = [getattr(a, state) for a in actors][::-1]
        axes.barh(names, widths, left=left, color=colour, label=state)
        left = [x + w for x, w in zip(left, widths, strict=True)]
    axes.set(title="actor time (busy, idle, blocked)", xlabel="seconds")
    axes.legend(**BELOW)


def _channel_bars(axes: Any, figs: Figures) -> None:
    if not figs.channels:
        return _empty(axes, "channel occupancy", "no channel statistics")
    names = [f"-> {c.into}" for c in figs.channels][::-1]
    channels = figs.channels[::-1]
    axes.barh(names, [c.capacity for c in channels], color="white", edgecolor="0.3", label="capacity")
    axes.barh(names, [c.peak for c in channels], height=0.5, color="tab:orange", label="peak")
    axes.barh(names, [c.mean_used for c in channels], height=0.25, color="tab:blue", label="mean (sampled)")
    axes.set(title="channel occupancy (items waiting)", xlabel="items")
    axes.legend(**BELOW)


def _launch_bars(axes: Any, figs: Figures, shown: int = 16) -> None:
    if not figs.launches:
        return _empty(axes, "GPU time per launch", "no profile: run with RunSettings(profile=True)")
    launches = figs.launches[:shown][::-1]
    axes.barh(
        [launch.name for launch in launches], [launch.mean_ms for launch in launches], color="tab:purple"
    )
    more = f"; {shown} of {len(figs.launches)}, most total time" if len(figs.launches) > shown else ""
    axes.set(title=f"GPU time per launch (mean{more})", xlabel="ms")
    axes.tick_params(axis="y", labelsize=7)


def draw(figs: Figures) -> bytes:
    """The report's plots as one PNG.

    Raises:
        ReportError: matplotlib is not installed (naming how to install it).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError(INSTALL_HINT) from None
    from io import BytesIO

    figure = Figure(figsize=(13, 13), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)  # Agg, whatever backend matplotlib would pick: no display needed
    top, middle, bottom = figure.subplots(3, 2)
    _lines(top[0], figs, "loss", "loss")
    _lines(top[1], figs, "accuracy", "accuracy")
    if rate := figs.series.get("samples_per_second"):
        middle[0].plot(rate.steps, rate.values, lw=0.8, color="tab:green")
        middle[0].set(title="samples/s", xlabel="step", ylim=(0, None))
        middle[0].grid(alpha=0.3)
    else:
        _empty(middle[0], "samples/s", "no samples_per_second in the metrics file")
    _actor_bars(middle[1], figs)
    _channel_bars(bottom[0], figs)
    _launch_bars(bottom[1], figs)
    figure.suptitle(f"vkflow run: {figs.metrics_file}")
    out = BytesIO()
    figure.savefig(out, format="png", metadata={"Software": None})
    return out.getvalue()


def _table(title: str, header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    def cell(value: Any) -> str:
        return html.escape(
            f"{value:.6g}" if isinstance(value, float) else "-" if value is None else str(value)
        )

    if not rows:  # the notes say why
        return ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f'<h2>{html.escape(title)}</h2>\n<table class="{title.split()[0]}"><tr>{head}</tr>{body}</table>\n'


def page(figs: Figures, png: bytes) -> str:
    """One HTML page with the PNG inline (base64) and the figures as tables; nothing external."""
    last = {name: (s.steps[-1], s.values[-1]) for name, s in figs.series.items() if s.steps}
    rate = sorted(figs.series["samples_per_second"].values) if "samples_per_second" in figs.series else []
    summary = [(name, step, value) for name, (step, value) in sorted(last.items())]
    if rate:
        summary.append(("median samples_per_second", None, rate[len(rate) // 2]))
    actors = [(a.name, a.busy, a.idle, a.blocked) for a in figs.actors]
    channels = [(c.into, c.capacity, c.peak, c.mean_used) for c in figs.channels]
    launches = [(x.name, x.mean_ms, x.total_ms, x.count) for x in figs.launches]
    notes = "".join(f"<li>{html.escape(note)}</li>" for note in figs.notes)
    name = html.escape(figs.metrics_file)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>vkflow report: {name}</title>\n'
        "<style>body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;"
        "margin-bottom:1em}td,th{border:1px solid #bbb;padding:2px 8px;text-align:right}"
        "td:first-child{text-align:left}"
        "img{max-width:100%}</style></head><body>\n"
        f"<h1>vkflow report</h1>\n<p>from <code>{name}</code></p>\n"
        f'<img alt="the run\'s plots" src="data:image/png;base64,{base64.b64encode(png).decode()}">\n'
        + (f"<h2>Notes</h2><ul>{notes}</ul>\n" if notes else "")
        + _table("last values", ("series", "step", "value"), summary)
        + _table("actors (seconds)", ("actor", "busy", "idle", "blocked"), actors)
        + _table("channels (items)", ("into", "capacity", "peak", "mean used"), channels)
        + _table("launches (GPU ms)", ("launch", "mean", "total", "count"), launches)
        + "</body></html>\n"
    )


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> tuple[Path, Path, Path]:
    """Write ``report.png``, ``report.html`` and ``report.json`` (the figures as data).

    Args:
        run_dir: the run's directory (its checkpoint_dir) or its metrics file.
        out_dir: where to write; None: next to the metrics file.

    Returns:
        The three paths.

    Raises:
        ReportError: see :func:`metrics_path`, :func:`read_events` and :func:`draw`.
    """
    source = metrics_path(run_dir)
    figs = figures(read_events(source), str(source))
    png = draw(figs)  # before any file is written: a missing matplotlib leaves nothing half done
    out = Path(out_dir) if out_dir is not None else source.parent
    out.mkdir(parents=True, exist_ok=True)
    paths = (out / "report.png", out / "report.html", out / "report.json")
    paths[0].write_bytes(png)
    paths[1].write_text(page(figs, png), encoding="utf-8")
    paths[2].write_text(json.dumps(asdict(figs)), encoding="utf-8")
    return paths

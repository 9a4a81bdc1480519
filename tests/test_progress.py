"""actors.progress: the progress line draws on a TTY only, and the rate is the samples in its window
over its span."""

from __future__ import annotations

import io

import pytest

from actors.progress import Progress, ProgressState, Rate, eta_seconds, format_line


def test_progress_draws_on_a_tty_only():
    state = ProgressState(step=30, total=120, samples_per_second=5120.4, loss=0.43214, accuracy=0.95,
                          elapsed=10.0, done_at_start=10)  # fmt: skip
    assert eta_seconds(state) == pytest.approx(45.0)
    line = format_line(state)
    assert "30/120 steps" in line and "5120 samples/s" in line and "loss 0.4321" in line
    assert "acc 0.9500" in line and "ETA 00:45" in line and line.startswith("[######")

    quiet = io.StringIO()
    Progress(quiet).update(state, force=True)
    assert quiet.getvalue() == ""  # StringIO is not a TTY
    loud = io.StringIO()
    bar = Progress(loud, enabled=True)
    bar.update(state, force=True)
    bar.update(state)  # within the interval: not drawn again
    bar.close()
    assert loud.getvalue().count("30/120 steps") == 1 and loud.getvalue().endswith("\n")


def test_the_rate_is_the_samples_in_its_window_over_its_span(rng):
    for window in (0, 1, 3, 20):
        rate, marks, when = Rate(window), [], 0.0
        for _ in range(100):
            when += float(rng.uniform(0.001, 0.01))
            samples = int(rng.integers(0, 64))
            marks.append((when, samples))
            kept = marks[-(window + 1) :]
            span = kept[-1][0] - kept[0][0]
            expected = sum(s for _, s in kept[1:]) / span if len(kept) > 1 and span > 0 else 0.0
            assert rate.add(when, samples) == pytest.approx(expected, rel=1e-9)

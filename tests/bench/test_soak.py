"""The soak benchmark's readings: windowed medians and the RSS slope, on synthetic samples."""

from __future__ import annotations

import pytest

from tandem_serve.bench.soak.rss import ProcessRss, Windows, format_table, growth_pct


def _proc(kb_at: dict[float, int]) -> ProcessRss:
    return ProcessRss(1, "gpu-worker", samples=sorted(kb_at.items()))


def test_windows_leave_out_the_warmup_and_never_overlap() -> None:
    w = Windows.of(warmup_s=60, load_s=660, window_s=60)
    assert (w.start, w.end) == ((60, 120), (600, 660))
    short = Windows.of(warmup_s=30, load_s=90, window_s=60)
    assert short.start == (30, 60) and short.end == (60, 90)
    assert "30 s warm-up" in short.describe()


def test_one_sample_spike_does_not_make_the_reading() -> None:
    # Flat at 1000 MB after a warm-up ramp, with one transient spike in each window.
    samples = {float(t): 1000 * 1024 for t in range(0, 660, 10)}
    samples.update({0.0: 800 * 1024, 10.0: 900 * 1024, 80.0: 1080 * 1024, 650.0: 1090 * 1024})
    p = _proc(samples)
    w = Windows.of(60, 660, 60)
    start, end = w.readings(p)
    assert start == end == 1000 * 1024
    assert growth_pct(start, end) == 0.0
    assert p.first() == 800 * 1024
    assert "+0.0%" in format_table([p], w)


def test_slope_is_mb_per_minute_after_the_warmup() -> None:
    # 1 MB every 10 s after the warm-up (6 MB/min); the warm-up ramp must not count.
    samples = {float(t): (500 + 5 * t) * 1024 for t in range(0, 60, 10)}
    samples.update({float(t): (1000 + (t - 60) // 10) * 1024 for t in range(60, 660, 10)})
    p = _proc(samples)
    assert p.slope_mb_per_min(60) == pytest.approx(6.0)
    start, end = Windows.of(60, 660, 60).readings(p)
    assert growth_pct(start, end) == pytest.approx(100 * 54 / 1003)

"""The soak's memory readings: RSS samples per process, the start and end windows they are
compared over, growth and slope, and the table."""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem_serve.harness.processes import role_of, rss_kb, tree_pids


@dataclass
class ProcessRss:
    pid: int
    role: str
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds, kB) under load
    idle_after_kb: int | None = None  # once the last request finished

    def first(self) -> int | None:
        return self.samples[0][1] if self.samples else None

    def median(self, t0: float, t1: float) -> int | None:
        """Median kB of the samples taken in [t0, t1) seconds (None if there are none)."""
        kb = sorted(k for s, k in self.samples if t0 <= s < t1)
        return kb[len(kb) // 2] if kb else None

    def slope_mb_per_min(self, t0: float) -> float | None:
        """Least-squares RSS slope over the samples from `t0` on, in MB per minute."""
        pts = [(s, k / 1024) for s, k in self.samples if s >= t0]
        if len(pts) < 3:
            return None
        mt = sum(s for s, _ in pts) / len(pts)
        mm = sum(m for _, m in pts) / len(pts)
        var = sum((s - mt) ** 2 for s, _ in pts)
        return 60.0 * sum((s - mt) * (m - mm) for s, m in pts) / var if var else None


@dataclass(frozen=True)
class Windows:
    """Where the start and end readings come from, in seconds since the load began."""

    warmup_s: float
    start: tuple[float, float]
    end: tuple[float, float]

    @classmethod
    def of(cls, warmup_s: float, load_s: float, window_s: float) -> Windows:
        # Never wider than half the measured span, so the two windows do not overlap.
        w = max(0.0, min(window_s, (load_s - warmup_s) / 2))
        return cls(warmup_s, (warmup_s, warmup_s + w), (load_s - w, load_s))

    def describe(self) -> str:
        return (f"RSS start = median of the samples at {self.start[0]:g}-{self.start[1]:g} s "
                f"of load (after a {self.warmup_s:g} s warm-up), end = median at "
                f"{self.end[0]:g}-{self.end[1]:g} s; MB/min = least-squares slope from "
                f"{self.warmup_s:g} s on")

    def readings(self, p: ProcessRss) -> tuple[int | None, int | None]:
        return p.median(*self.start), p.median(*self.end)


def sample(root: int, now: float, procs: dict[int, ProcessRss]) -> None:
    """One RSS sample of every process of `root`'s tree, `now` seconds into the load."""
    for p in tree_pids(root):
        kb = rss_kb(p)
        if kb is not None:
            procs.setdefault(p, ProcessRss(p, role_of(p))).samples.append((now, kb))


def growth_pct(start: int | None, end: int | None) -> float | None:
    if not start or end is None:
        return None
    return 100.0 * (end - start) / start


def format_table(procs: list[ProcessRss], windows: Windows) -> str:
    lines = [windows.describe(),
             f"{'process':<14}{'pid':>8}{'at 0 s MB':>11}{'start MB':>10}{'end MB':>9}"
             f"{'growth':>9}{'MB/min':>8}{'idle after MB':>15}", "-" * 84]
    for p in procs:
        start, end = windows.readings(p)
        g = growth_pct(start, end)
        slope = p.slope_mb_per_min(windows.warmup_s)
        lines.append(f"{p.role:<14}{p.pid:>8}{(p.first() or 0) / 1024:>11.1f}"
                     f"{(start or 0) / 1024:>10.1f}{(end or 0) / 1024:>9.1f}"
                     f"{'' if g is None else f'{g:+.1f}%':>9}"
                     f"{'' if slope is None else f'{slope:+.2f}':>8}"
                     f"{(p.idle_after_kb or 0) / 1024:>15.1f}")
    return "\n".join(lines)

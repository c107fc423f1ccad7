"""The scale curve's figures and plot (pure over measured points): see bench/scale.py.

The two rules, their tolerance and the per-point figures are here, apart from the
measuring rig, so that each file reads in one sitting and the rules are unit-tested
on synthetic points (tests/bench/test_bench.py).
"""

from __future__ import annotations

import datetime
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.report import Figure, skipped
from bench.stats import Summary

# Pods of one unit of this size at every point (why this size: see bench/scale.py).
MEMORY_UNIT_MIB = 136
TOLERANCE = 1.25
RSS_INCREMENT_FLOOR_MIB = 0.25


@dataclass
class Point:
    cards: int
    allocations: int
    skipped: str = ""  # why the point was not measured; "" when it was
    allocate: list[float] = field(default_factory=list)  # seconds, memory and share pooled
    floor: list[float] = field(default_factory=list)  # seconds of the trivial call
    preferred: list[float] = field(default_factory=list)  # GetPreferredAllocation seconds
    idle_cpu_percent: float = 0.0
    children_cpu_percent: float = 0.0  # MPS control commands (the stand-in)
    idle_seconds: float = 0.0
    rss_mib: float = 0.0
    held: int = 0  # allocations in the ledger before the idle window
    events_per_s: float | None = None  # the machine's process events in the idle window
    rate_per_s: float = 0.0  # steady-state admissions per second reached
    stale_reuses: int = 0
    # The daemon's CPU over its steady-state phase per admission made to it (ms): what an
    # admission costs it, reconciles and releases of that phase included.
    cpu_ms_per_admission: float = 0.0

    @property
    def ratio(self) -> float:
        return Summary.of(self.allocate).p99 / Summary.of(self.floor).p99

    @property
    def p50_ratio(self) -> float:
        return Summary.of(self.allocate).p50 / Summary.of(self.floor).p50


def figures(points: list[Point]) -> list[Figure]:
    out = [figure for p in points for figure in _point_figures(p)]
    return out + _flat_figures(points) + _linear_figures(points)


def _three(
    names: list[str],
    labels: list[str],
    values: Sequence[float] | None,
    why: str = "",
    notes: Sequence[str] = ("", "", ""),
) -> list[Figure]:
    """Three figures; all ``skipped`` for ``why`` when ``values`` is None."""
    if values is None:
        return [skipped(name, label, why) for name, label in zip(names, labels, strict=True)]
    parts = zip(names, values, labels, notes, strict=True)
    return [Figure(name, value, label, note=note) for name, value, label, note in parts]


def _point_figures(p: Point) -> list[Figure]:
    key = f"c{p.cards}_a{p.allocations}"
    where = f", {p.cards} card{'s' if p.cards > 1 else ''}, {p.allocations} allocations"
    names = [
        f"scale_{what}_{key}" for what in ("allocate_p99_ratio", "idle_cpu_percent", "rss_mib")
    ]
    labels = [
        f"{what}{where}"
        for what in ("Allocate p99 / floor p99", "idle CPU, daemon (% of a core)", "idle RSS (MiB)")
    ]
    if p.skipped:
        cpu_name = f"scale_cpu_ms_per_admission_{key}"
        cpu_label = f"daemon CPU per steady-state admission (ms){where}"
        return _three(names, labels, None, p.skipped) + [skipped(cpu_name, cpu_label, p.skipped)]
    allocate, floor, preferred = (Summary.of(s) for s in (p.allocate, p.floor, p.preferred))
    events = "" if p.events_per_s is None else f", {p.events_per_s:.0f} process events/s"
    held = "" if p.held == p.allocations else f"; the ledger held {p.held}, not {p.allocations}"
    stale = f"; {p.stale_reuses} devices reused while held" if p.stale_reuses else ""
    notes = (
        f"Allocate p99 {allocate.p99 * 1e6:.0f} us (n={allocate.n}), floor p99 "
        f"{floor.p99 * 1e6:.0f} us, p50 ratio {allocate.p50 / floor.p50:.2f}, "
        f"GetPreferredAllocation p99 {preferred.p99 * 1e6:.0f} us, "
        f"{p.rate_per_s:.1f} admissions/s{stale}",
        f"{p.idle_seconds:.0f} s; MPS control commands (stand-in) "
        f"{p.children_cpu_percent:.1f} %{events}{held}",
        "",
    )
    cpu = Figure(
        f"scale_cpu_ms_per_admission_{key}",
        p.cpu_ms_per_admission,
        f"daemon CPU per steady-state admission (ms){where}",
    )
    return _three(names, labels, (p.ratio, p.idle_cpu_percent, p.rss_mib), notes=notes) + [cpu]


def _growth(new: float, old: float) -> float:
    return new / old if old > 0 else math.inf


# The flat rule's parts, (name part, label, value of a point, judged). The points of one
# card count are measured side by side against one floor (bench/scale.py), so a growth
# is that of the Allocate latency alone. Shown, not judged: idle CPU (a 10 s window holds
# one reconcile, and the machine's other work moves it by more than 25 %) and the
# daemon's CPU per admission, which holds the steady phase's reconciles (every second,
# a walk over every allocation: it grows with allocations by design of the phase).
_FLAT_PARTS = (
    ("rss", "RSS", lambda p: p.rss_mib, True),
    ("allocate_ratio", "Allocate p99 ratio", lambda p: p.ratio, True),
    ("allocate_p50_ratio", "Allocate p50 ratio", lambda p: p.p50_ratio, True),
    ("cpu_per_admission", "daemon CPU per admission", lambda p: p.cpu_ms_per_admission, False),
    ("idle_cpu", "idle CPU", lambda p: p.idle_cpu_percent, False),
)


def _flat_figures(points: list[Point]) -> list[Figure]:
    """Per card count: the most allocations over none, for each part of the flat rule."""
    measured = {(p.cards, p.allocations): p for p in points if not p.skipped}
    low, high = min(p.allocations for p in points), max(p.allocations for p in points)
    out, judged = [], []
    for cards in sorted({p.cards for p in points}):
        a, b = measured.get((cards, low)), measured.get((cards, high))
        for part, what, value, judge in _FLAT_PARTS:
            name = f"scale_{part}_growth_c{cards}"
            label = f"{what} at {high} / at {low} allocations, {cards} card(s)"
            if a is None or b is None or low == high:
                out.append(skipped(name, label, "needs two measured allocation counts"))
                continue
            growth = _growth(value(b), value(a))
            out.append(Figure(name, growth, label, note="" if judge else "shown, not judged"))
            if judge:
                judged.append(growth)
    label = f"cost flat in allocations: worst RSS or Allocate p99/p50 ratio growth, {low} to {high}"
    return [*out, _rule("scale_flat_in_allocations", label, judged)]


def _linear_figures(points: list[Point]) -> list[Figure]:
    """Per allocation count: growth from the fewest cards to the most, against linear."""
    measured = {(p.cards, p.allocations): p for p in points if not p.skipped}
    counts = sorted({p.cards for p in points})
    out, judged = [], []
    for level in sorted({p.allocations for p in points}):
        series = [(c, measured[(c, level)]) for c in counts if (c, level) in measured]
        names = [
            f"scale_{what}_a{level}"
            for what in ("idle_cpu_vs_linear", "rss_mib_per_card", "rss_vs_linear")
        ]
        span = f"{counts[0]} to {counts[-1]} cards, {level} allocations"
        labels = [
            f"idle CPU growth / card growth, {span}",
            f"RSS per added card (MiB), {span}",
            f"RSS increment growth, {span}",
        ]
        if len(series) < 2:
            out += _three(names, labels, None, "needs two measured card counts")
            continue
        (c0, p0), (cn, pn) = series[0], series[-1]
        cpu = _growth(pn.idle_cpu_percent, max(p0.idle_cpu_percent, cpu_resolution(p0)))
        cpu /= cn / c0
        rss, how = _rss_vs_linear([(c, p.rss_mib) for c, p in series])
        values = (cpu, (pn.rss_mib - p0.rss_mib) / (cn - c0), rss)
        out += _three(names, labels, values, notes=("1: proportional to the cards", "", how))
        judged += [cpu, rss]
    label = "cost at most linear in cards: worst idle CPU or RSS growth against linear"
    return [*out, _rule("scale_linear_in_cards", label, judged)]


def cpu_resolution(p: Point) -> float:
    """The smallest idle CPU (%) a point's window can show: one clock tick of CPU time
    (the kernel counts it in ticks). A window that saw none is read as that, so that a
    quiet 1-card daemon does not make the card growth infinite."""
    if p.idle_seconds <= 0:
        return 0.0
    return 100 / os.sysconf("SC_CLK_TCK") / p.idle_seconds


def _rss_vs_linear(series: list[tuple[int, float]]) -> tuple[float, str]:
    """(value, how): above 1, RSS grows faster than linearly in cards."""
    (c0, r0), (cn, rn) = series[0], series[-1]
    if len(series) < 3:
        return _growth(rn, r0) / (cn / c0), f"growth over card ratio ({c0} to {cn} cards)"
    (c1, r1), (cm, rm) = series[1], series[-2]
    first = max((r1 - r0) / (c1 - c0), RSS_INCREMENT_FLOOR_MIB)
    last = (rn - rm) / (cn - cm)
    return last / first, (
        f"per-card increment {cm} to {cn} cards ({last:.2f} MiB) over {c0} to {c1} "
        f"({(r1 - r0) / (c1 - c0):.2f} MiB, at least {RSS_INCREMENT_FLOOR_MIB:g})"
    )


def _rule(name: str, label: str, judged: list[float]) -> Figure:
    target = f"<= {TOLERANCE:g}"
    if not judged:
        return skipped(name, label, "no pair of measured points", target=target)
    worst = max(judged)
    return Figure(name, worst, label, target=target, met=worst <= TOLERANCE)


def plot(points: list[Point], path: str, title: str) -> bool:
    """A panel per figure against allocations, a line per card count; False without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")  # files only: no display on a node or in CI
    import matplotlib.pyplot as plt

    panels = [
        ("Allocate p99 / floor p99", lambda p: p.ratio),
        ("idle CPU, daemon (% of a core)", lambda p: p.idle_cpu_percent),
        ("idle RSS (MiB)", lambda p: p.rss_mib),
        ("daemon CPU per admission (ms)", lambda p: p.cpu_ms_per_admission),
    ]
    levels = sorted({p.allocations for p in points})
    fig, axes = plt.subplots(1, len(panels), figsize=(18, 4.5))
    for ax, (label, value) in zip(axes, panels, strict=True):
        for cards in sorted({p.cards for p in points}):
            shown = sorted(
                (p for p in points if p.cards == cards and not p.skipped),
                key=lambda p: p.allocations,
            )
            if shown:
                ax.plot(
                    [p.allocations for p in shown],
                    [value(p) for p in shown],
                    marker="o",
                    label=f"{cards} card{'s' if cards > 1 else ''}",
                )
        ax.set_xticks(levels)
        ax.set_xlabel("allocations held")
        ax.set_title(label, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def title(idle_seconds: float, admissions: int) -> str:
    """The plot's title: what was run, where and when."""
    return (
        f"Scale: simulated H200 cards, pods of one {MEMORY_UNIT_MIB} MiB unit, idle "
        f"{idle_seconds:g} s, {admissions} admissions per point; "
        f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )

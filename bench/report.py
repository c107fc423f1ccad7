"""The suite's output: a table for people, then one ``name=value`` line per figure.

A figure is a measured value, or one of two markers instead of a value:
``absent`` when the feature it measures is not built yet, and ``skipped``
when this machine lacks what the measurement needs (runc, root); the table
says why. Names carry their unit (``_us``, ``_ms``, ``_mib``, ``_percent``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ABSENT = "absent"
SKIPPED = "skipped"


@dataclass(frozen=True)
class Figure:
    name: str  # machine-readable, with the unit in it
    value: float | int | str  # a number, or ABSENT / SKIPPED
    label: str  # what it is, for the table
    target: str = ""  # the figure's target, when it has one
    met: bool | None = None  # whether the target is met (None: no target, or no value)
    note: str = ""  # why a figure is absent or skipped, or a remark

    @property
    def measured(self) -> bool:
        return self.value not in (ABSENT, SKIPPED)


def skipped(name: str, label: str, reason: str, target: str = "") -> Figure:
    return Figure(name, SKIPPED, label, target=target, note=reason)


def format_value(value: float | int | str) -> str:
    """Digits that mean something: no 17-digit floats, integers as integers."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int) or (math.isfinite(value) and float(value).is_integer()):
        return str(int(value))
    if abs(value) >= 100:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def machine_lines(figures: list[Figure]) -> list[str]:
    """``name=value`` per figure, in order; names must be unique.

    A figure with a target also gets ``name_target=<target>`` and ``name_met=yes|no``
    (``no`` also when it has no value: a target not shown met is not met)."""
    seen: set[str] = set()
    lines = []
    for figure in figures:
        if figure.name in seen:
            raise ValueError(f"figure {figure.name} reported twice")
        seen.add(figure.name)
        lines.append(f"{figure.name}={format_value(figure.value)}")
        if figure.target:
            lines.append(f"{figure.name}_target={figure.target}")
            lines.append(f"{figure.name}_met={'yes' if figure.met else 'no'}")
    return lines


def table(figures: list[Figure]) -> str:
    """An aligned text table: figure, value, name, target and whether it is met."""
    rows = [("figure", "value", "name", "target", "met")]
    for f in figures:
        verdict = "" if f.met is None else ("yes" if f.met else "NO")
        rows.append((f.label, format_value(f.value), f.name, f.target, verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0]), row[1].rjust(widths[1])]
        cells += [cell.ljust(width) for cell, width in zip(row[2:], widths[2:], strict=True)]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    notes = [f"  {f.name}: {f.note}" for f in figures if f.note]
    if notes:
        lines += ["", "notes:", *notes]
    return "\n".join(lines)

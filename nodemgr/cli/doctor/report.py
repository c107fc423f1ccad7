"""What every doctor check returns, and how the report is printed."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
RANK = {PASS: 0, WARN: 1, FAIL: 2}  # severity: the higher, the worse


@dataclass(frozen=True)
class Result:
    check: str
    status: str  # PASS, WARN or FAIL
    detail: str  # what was found
    fix: str | None = None  # the exact action; None for PASS


def worst(statuses: Iterable[str]) -> str:
    return max(statuses, key=RANK.__getitem__)


def render(results: list[Result]) -> str:
    width = max(len(r.check) for r in results)
    lines = []
    for r in results:
        line = f"{r.status}  {r.check:<{width}}  {r.detail}"
        if r.fix:
            line += f" — fix: {r.fix}"
        lines.append(line)
    counts = {s: sum(r.status == s for r in results) for s in (FAIL, WARN, PASS)}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    if counts[FAIL]:
        summary += ": gpushare-node cannot work on this node until every FAIL is fixed"
    else:
        summary += ": nothing blocks gpushare-node here"
    return "\n".join(lines) + f"\n\n{summary}"

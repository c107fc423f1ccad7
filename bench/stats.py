"""Distribution summaries shared by the benchmarks.

Single timings mean little on a shared, noisy machine: every benchmark keeps
its samples and reports percentiles (nearest rank, so a reported value is a
value that was really measured) and ratios to a floor measured in the same run.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile: the value below which ``p`` % of the samples fall."""
    if not values:
        raise ValueError("percentile of no samples")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


@dataclass(frozen=True)
class Summary:
    n: int
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        return cls(
            n=len(values),
            p50=statistics.median(values),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
            max=max(values),
        )

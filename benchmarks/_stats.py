"""Small order statistics, with no dependency beyond the standard library."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def summary_ms(samples_s: Sequence[float]) -> dict[str, Any]:
    """Median, p99, mean, min, max and count of durations given in seconds, in milliseconds."""
    if not samples_s:
        return {"n": 0}
    ms = [s * 1000.0 for s in samples_s]
    return {
        "n": len(ms),
        "median_ms": round(median(ms), 4),
        "p99_ms": round(percentile(ms, 99.0), 4),
        "mean_ms": round(sum(ms) / len(ms), 4),
        "min_ms": round(min(ms), 4),
        "max_ms": round(max(ms), 4),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return round(numerator / denominator, 3)

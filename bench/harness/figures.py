"""Summary figures of measured values: percentiles, medians, min/median/max."""

from __future__ import annotations

import statistics


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (``q`` in 0..100); NaN when there is no value."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def pct(values: list[float], q: float) -> float | None:
    """The value at rank ``int(q * n)`` of the sorted values (``q`` in 0..1); None when empty."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def stats(values: list[float], digits: int = 2) -> dict[str, float | None]:
    """min, median and max, rounded to ``digits``; None each when there is no value."""
    if not values:
        return {"min": None, "median": None, "max": None}
    return {"min": round(min(values), digits), "median": round(statistics.median(values), digits),
            "max": round(max(values), digits)}

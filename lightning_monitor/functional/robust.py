"""Robust statistics of a run's own recent history (no Lightning, no state beyond the arguments).

A value ``x`` is judged against a history ``h`` of recent normal values by the trend-robust z-score

    z = (x - median(h[-recent:])) / max(noise(h), rel_floor * |median(h[-recent:])|, abs_floor)
    noise(h) = 1.4826 * median(|h[t+1] - h[t]|) / sqrt(2)

The reference is the median of the last ``recent`` values, so it follows a falling loss closely; the
scale is the batch-to-batch noise, from consecutive differences (1.4826 * median absolute value
estimates the standard deviation of a normal sample, the difference of two draws has sqrt(2) of it), so
neither a downward trend nor a minority of outliers inflates it. The floors keep a nearly constant
history from turning a tiny wobble into a huge z.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["robust_zscore", "difference_noise", "median"]

MAD_TO_STD = 1.4826


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence of floats."""
    if not values:
        raise ValueError("median of an empty sequence")
    s = sorted(values)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def difference_noise(values: Sequence[float]) -> float:
    """Robust standard deviation of one value around its trend, from consecutive differences (>= 2 values).

    >>> round(difference_noise([5.0, 4.0, 5.0, 4.0]), 3)
    1.048
    """
    if len(values) < 2:
        raise ValueError("difference_noise needs at least two values")
    return MAD_TO_STD * median([abs(b - a) for a, b in zip(values, values[1:])]) / math.sqrt(2.0)


def robust_zscore(x: float, history: Sequence[float], recent: int = 10, rel_floor: float = 0.01,
                  abs_floor: float = 1e-12) -> float:
    """Trend-robust z-score of ``x`` against ``history`` (>= 2 values; see the module docstring).

    >>> round(robust_zscore(10.0, [1.0, 1.1, 0.9, 1.0, 1.05]), 1)
    85.8
    """
    if not math.isfinite(x):
        return x  # nan stays nan, +-inf stays +-inf
    center = median(history[-recent:])
    return (x - center) / max(difference_noise(history), rel_floor * abs(center), abs_floor)

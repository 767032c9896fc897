"""Robust statistics of a run's own recent history (no Lightning, no state beyond the arguments).

A value ``x`` is judged against a window ``h`` of recent values by the robust z-score

    z = (x - median(h)) / max(1.4826 * MAD(h), rel_floor * |median(h)|, abs_floor)

where MAD is the median absolute deviation (1.4826 * MAD estimates the standard deviation of a
normal sample, and unlike the standard deviation it ignores a minority of outliers). The floors keep
a nearly constant history from turning a tiny wobble into a huge z.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["robust_zscore", "median"]

MAD_TO_STD = 1.4826


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence of floats."""
    if not values:
        raise ValueError("median of an empty sequence")
    s = sorted(values)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def robust_zscore(x: float, history: Sequence[float], rel_floor: float = 0.01, abs_floor: float = 1e-12) -> float:
    """Robust z-score of ``x`` against ``history`` (see module docstring).

    >>> round(robust_zscore(10.0, [1.0, 1.1, 0.9, 1.0, 1.05]), 1)
    121.4
    """
    if not history:
        raise ValueError("robust_zscore needs a non-empty history")
    if not math.isfinite(x):
        return x  # nan stays nan, +-inf stays +-inf
    med = median(history)
    mad = median([abs(h - med) for h in history])
    scale = max(MAD_TO_STD * mad, rel_floor * abs(med), abs_floor)
    return (x - med) / scale

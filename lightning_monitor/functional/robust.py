"""Robust statistics of a run's own recent history (no Lightning; the functions keep no state, and
:class:`SeriesWatch` keeps only its series' recent history).

A value ``x`` is judged against a history ``h`` of recent normal values by the trend-robust z-score

    z = (x - median(h[-recent:])) / max(noise(h), rel_floor * |median(h[-recent:])|, abs_floor)
    noise(h) = 1.4826 * median(|h[t+1] - h[t]|) / sqrt(2)

The reference is the median of the last ``recent`` values, so it follows a falling loss closely; the
scale is the batch-to-batch noise, from consecutive differences (1.4826 * median absolute value
estimates the standard deviation of a normal sample, the difference of two draws has sqrt(2) of it), so
neither a downward trend nor a minority of outliers inflates it. The floors keep a nearly constant
history from turning a tiny wobble into a huge z. :class:`SeriesWatch` judges a series value by value
with this z-score, keeping the level and noise of its history between changes.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Sequence
from typing import Any, Optional

__all__ = ["robust_zscore", "difference_noise", "median", "SeriesWatch"]

MAD_TO_STD = 1.4826


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence of floats."""
    if not values:
        raise ValueError("median of an empty sequence")
    return _sorted_median(sorted(values))


def _sorted_median(s: Sequence[float]) -> float:
    """Median of a non-empty sorted sequence."""
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


class SeriesWatch:
    """A scalar series judged against its own recent normal history (DivergenceGuard's loss series).

    The reference is the median of the last ``recent`` normal values (it follows a falling loss closely);
    the scale is the batch-to-batch noise, from the median absolute difference of consecutive normal values
    over the whole ``window`` (a trend does not inflate it), floored by ``rel_floor`` times the reference
    and by an absolute floor: the z-score is :func:`robust_zscore`'s. A value is *anomalous* when its
    z-score exceeds ``threshold`` (once ``min_history`` normal values, and at least 3, are in), or when it
    exceeds ``ceiling`` (an absolute bound, judged from the first value on). Only normal values enter the
    history, so a sustained explosion stays anomalous instead of becoming the new normal. ``run`` counts
    consecutive anomalous values, ``start`` is the first one's step.

    >>> watch = SeriesWatch(window=10, min_history=3, threshold=6.0, rel_floor=0.0)
    >>> [watch.update(step, x)[0] for step, x in enumerate([1.0, 1.2, 1.0, 1.1, 5.0])]
    [False, False, False, False, True]
    >>> watch.level(), watch.run, watch.start
    (1.05, 1, 4)
    """

    def __init__(self, window: int, min_history: int, threshold: float, rel_floor: float, recent: int = 10) -> None:
        self.history: deque[float] = deque(maxlen=window)
        # |history[t + 1] - history[t]|, kept along with the history, in order and sorted: the noise (their median)
        # needs no pass over them, and no sort, per value
        self._diffs: deque[float] = deque(maxlen=max(window - 1, 1))
        self._sorted_diffs: list[float] = []
        self.min_history = min_history
        self.threshold = threshold
        self.rel_floor = rel_floor
        self.recent = recent
        self.run = 0
        self.start: Optional[int] = None
        self._cache: Optional[tuple[float, float]] = None

    @property
    def ready(self) -> bool:
        """Whether enough normal values are in for the z-score to be judged."""
        return len(self.history) >= max(self.min_history, 3)

    def _stats(self) -> tuple[float, float]:
        """(level, noise), computed once per change of the history."""
        if self._cache is None:
            values = list(self.history)
            if len(self._diffs) != max(len(values) - 1, 0) or len(self._sorted_diffs) != len(self._diffs):
                # the history was changed from outside: rebuilt
                self._diffs.clear()
                self._diffs.extend(abs(b - a) for a, b in zip(values, values[1:]))
                self._sorted_diffs = sorted(self._diffs)
            # difference_noise(values), from the kept differences
            noise = MAD_TO_STD * _sorted_median(self._sorted_diffs) / math.sqrt(2.0) if len(values) > 1 else 0.0
            self._cache = (median(values[-self.recent:]), noise)
        return self._cache

    def level(self) -> float:
        """The reference: median of the most recent normal values (the history must not be empty)."""
        return self._stats()[0]

    def noise(self) -> float:
        """Robust standard deviation of one value around the trend (from consecutive differences)."""
        return self._stats()[1]

    def zscore(self, x: float, abs_floor: float = 1e-12) -> float:
        """:func:`robust_zscore` of ``x`` against the history (0 while not ready), from the cached level and
        noise."""
        if not self.ready:
            return 0.0
        if not math.isfinite(x):
            return x
        level, noise = self._stats()
        return (x - level) / max(noise, self.rel_floor * abs(level), abs_floor)

    def update(self, step: int, x: float, abs_floor: float = 1e-12, ceiling: float = math.inf) -> tuple[bool, float]:
        """Feed one finite value; returns (anomalous, z)."""
        z = self.zscore(x, abs_floor)
        anomalous = z > self.threshold or x > ceiling
        if anomalous:
            self.start = step if self.run == 0 else self.start
            self.run += 1
        else:
            self.run, self.start = 0, None
            if self.history:
                self._add_diff(abs(x - self.history[-1]))
            self.history.append(x)
            self._cache = None
        return anomalous, z

    def _add_diff(self, d: float) -> None:
        """Append a consecutive difference, keeping the sorted copy in step (the one pushed out leaves it)."""
        diffs, ordered = self._diffs, self._sorted_diffs
        if len(ordered) != len(diffs):  # changed from outside (a reload): rebuilt by _stats
            diffs.append(d)
            return
        if len(diffs) == diffs.maxlen:
            del ordered[bisect_left(ordered, diffs[0])]
        diffs.append(d)
        insort(ordered, d)

    def reseed(self, values: list[float]) -> None:
        """Make ``values`` the new normal (after a data shift): no anomalous run."""
        self.load_state_dict({"history": values})

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "run": self.run, "start": self.start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.clear()
        self.history.extend(state.get("history", []))
        self._diffs.clear()  # rebuilt by _stats
        self._sorted_diffs = []
        self._cache = None
        self.run, self.start = int(state.get("run", 0)), state.get("start")

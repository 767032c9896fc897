"""The guard's robust statistics against numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_monitor.functional.robust import difference_noise, median, robust_zscore


def test_against_numpy():
    rng = np.random.default_rng(0)
    h = list(np.linspace(3.0, 1.0, 60) + 0.1 * rng.standard_normal(60))  # a falling loss with noise
    noise = 1.4826 * np.median(np.abs(np.diff(h))) / math.sqrt(2.0)
    assert difference_noise(h) == pytest.approx(noise, rel=1e-12)
    assert median(h) == pytest.approx(np.median(h), rel=1e-12)
    center = np.median(h[-10:])
    assert robust_zscore(2.0, h) == pytest.approx((2.0 - center) / noise, rel=1e-12)
    # the trend does not inflate the scale: the noise is close to the 0.1 of the draws, not to the spread
    assert 0.05 < difference_noise(h) < 0.15 < np.std(h)
    # floors, and non-finite values
    assert robust_zscore(1.1, [1.0] * 20, rel_floor=0.05) == pytest.approx(2.0)
    assert math.isnan(robust_zscore(math.nan, h)) and robust_zscore(math.inf, h) == math.inf
    with pytest.raises(ValueError):
        difference_noise([1.0])


def test_the_guards_cached_zscore_equals_the_functional_one():
    # the guard caches its history's level and noise between changes; its z-scores must be robust_zscore's
    import random

    from lightning_monitor.callbacks.divergence_guard import _SeriesWatch

    watch = _SeriesWatch(window=100, min_history=20, threshold=6.0, rel_floor=0.02)
    rng = random.Random(0)
    compared = 0
    for step in range(300):
        x = rng.gauss(1.0, 0.1) * (6.0 if step % 37 == 0 else 1.0)
        z = watch.zscore(x, abs_floor=0.05)
        if watch.ready:
            assert z == pytest.approx(robust_zscore(x, list(watch.history), 10, 0.02, 0.05), rel=1e-12, abs=1e-12)
            compared += 1
        watch.update(step, x, abs_floor=0.05)
    assert compared > 250

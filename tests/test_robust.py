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

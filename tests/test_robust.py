"""The guard's robust statistics against numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_monitor.functional.robust import SeriesWatch, difference_noise, median, robust_zscore


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

    watch = SeriesWatch(window=100, min_history=20, threshold=6.0, rel_floor=0.02)
    rng = random.Random(0)
    compared = 0
    for step in range(300):
        x = rng.gauss(1.0, 0.1) * (6.0 if step % 37 == 0 else 1.0)
        z = watch.zscore(x, abs_floor=0.05)
        if watch.ready:
            assert z == pytest.approx(robust_zscore(x, list(watch.history), 10, 0.02, 0.05), rel=1e-12, abs=1e-12)
            # the noise kept up to date value by value (a sorted copy of the differences, the oldest pushed out as the
            # window moves) is the median of the same differences: equal, not just close
            assert watch.noise() == difference_noise(list(watch.history))
            compared += 1
        watch.update(step, x, abs_floor=0.05)
        if step in (150, 151, 220):  # a reload (a resume) mid-run, then more values: the differences are rebuilt
            watch.load_state_dict(watch.state_dict())
    assert compared > 250


def test_series_watch_against_hand_computed_medians():
    # window 5, judged from 3 values on, level = median of the last 3, no relative floor
    watch = SeriesWatch(window=5, min_history=3, threshold=3.0, rel_floor=0.0, recent=3)
    for step, x in enumerate([10.0, 12.0]):
        assert watch.update(step, x) == (False, 0.0) and not watch.ready  # no z-score before 3 values
    watch.update(2, 11.0)
    assert watch.ready
    # history 10, 12, 11: level median(10, 12, 11) = 11; differences 2, 1 -> median 1.5
    assert watch.level() == 11.0
    assert watch.noise() == pytest.approx(1.4826 * 1.5 / math.sqrt(2.0), rel=1e-12)
    assert watch.update(3, 13.0) == (False, pytest.approx(2.0 / (1.4826 * 1.5 / math.sqrt(2.0)), rel=1e-12))
    # history 10, 12, 11, 13: level median(12, 11, 13) = 12; differences 2, 1, 2 -> median 2
    noise = 1.4826 * 2.0 / math.sqrt(2.0)
    assert (watch.level(), watch.noise()) == (12.0, pytest.approx(noise, rel=1e-12))
    # two anomalous values: counted from the first one's step, kept out of the history
    assert watch.update(4, 30.0) == (True, pytest.approx(18.0 / noise, rel=1e-12))
    assert watch.update(5, 25.0) == (True, pytest.approx(13.0 / noise, rel=1e-12))
    assert (watch.run, watch.start, list(watch.history)) == (2, 4, [10.0, 12.0, 11.0, 13.0])
    assert not watch.update(6, 12.5)[0] and (watch.run, watch.start) == (0, None)
    # the window drops the oldest value: history 12, 11, 13, 12.5, 14
    watch.update(7, 14.0)
    assert list(watch.history) == [12.0, 11.0, 13.0, 12.5, 14.0]
    # level median(13, 12.5, 14) = 13; differences 1, 2, 0.5, 1.5 -> median (1 + 1.5) / 2 = 1.25
    noise = 1.4826 * 1.25 / math.sqrt(2.0)
    assert (watch.level(), watch.noise()) == (13.0, pytest.approx(noise, rel=1e-12))
    assert watch.zscore(15.0) == pytest.approx(2.0 / noise, rel=1e-12)
    assert watch.zscore(15.0, abs_floor=4.0) == pytest.approx(0.5)  # the absolute floor wins over the noise
    assert math.isnan(watch.zscore(math.nan)) and watch.zscore(math.inf) == math.inf
    # a value within the z-score but above the ceiling is anomalous
    assert watch.update(8, 13.5, ceiling=13.0) == (True, pytest.approx(0.5 / noise, rel=1e-12))

    # the state (the checkpoint format) round-trips, differences rebuilt from the history
    state = watch.state_dict()
    assert state == {"history": [12.0, 11.0, 13.0, 12.5, 14.0], "run": 1, "start": 8}
    other = SeriesWatch(window=5, min_history=3, threshold=3.0, rel_floor=0.0, recent=3)
    other.load_state_dict(state)
    assert (other.level(), other.noise(), other.run, other.start) == (13.0, pytest.approx(noise, rel=1e-12), 1, 8)

    # the relative floor: 0.5 x level 13 = 6.5 above a noise of about 1.31
    floored = SeriesWatch(window=5, min_history=3, threshold=3.0, rel_floor=0.5, recent=3)
    floored.load_state_dict(state)
    assert floored.zscore(26.0) == pytest.approx(2.0)

    # reseed: the values given are the new normal, no anomalous run
    other.reseed([4.0, 6.0])
    assert (list(other.history), other.run, other.start, other.ready) == ([4.0, 6.0], 0, None, False)
    assert (other.level(), other.noise()) == (5.0, pytest.approx(1.4826 * 2.0 / math.sqrt(2.0), rel=1e-12))

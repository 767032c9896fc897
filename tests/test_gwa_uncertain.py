"""GWA says when its pick is uncertain: a pick at the window's first epoch with the score still falling into
it, or a one-epoch spike (the two patterns of the validity benchmark's bad picks)."""

from __future__ import annotations

from lightning_monitor import GradientWeightAlignmentMonitor


def _with(scores: list[float], warmup: int) -> GradientWeightAlignmentMonitor:
    gwa = GradientWeightAlignmentMonitor()
    gwa._warmup_resolved = warmup
    for epoch, score in enumerate(scores):
        gwa._select(epoch, score)
        gwa.history.append({"epoch": epoch, "score": score, "count": 100})
    return gwa


def test_a_pick_at_the_window_edge_while_the_score_falls_is_uncertain():
    gwa = _with([0.030, 0.047, 0.045, 0.041, 0.040, 0.039, 0.038], warmup=3)
    assert gwa.best_epoch == 3
    assert "first epoch after the warm-up" in gwa._uncertainty() and "epoch 2" in gwa._uncertainty()


def test_a_later_peak_clears_it():
    gwa = _with([0.030, 0.047, 0.045, 0.041, 0.040, 0.043, 0.046, 0.050, 0.049], warmup=3)
    assert gwa.best_epoch == 7 and gwa._uncertainty() is None


def test_a_one_epoch_spike_is_uncertain_once_the_next_epoch_is_seen():
    scores = [0.02, 0.03, 0.04, 0.05, 0.053, 0.080]
    gwa = _with(scores, warmup=2)
    assert gwa.best_epoch == 5 and gwa._uncertainty() is None  # the next epoch is not in yet
    gwa = _with(scores + [0.052], warmup=2)
    assert gwa.best_epoch == 5 and "one-epoch spike" in gwa._uncertainty()


def test_a_steady_peak_is_not_uncertain():
    gwa = _with([0.02, 0.03, 0.04, 0.05, 0.055, 0.056, 0.054, 0.05], warmup=2)
    assert gwa.best_epoch == 5 and gwa._uncertainty() is None

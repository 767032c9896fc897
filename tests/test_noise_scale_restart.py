"""A change of scale restarts the noise scale's averages: gradients 1e7 times larger on the first checks (the first
steps from random init) no longer fix B_simple at their own ratio for a hundred checks; the restart is an info alert,
read back from the run's alerts file, and the logged B_simple meets the closed-form truth of the weights after it."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from test_noise_scale_callback import D, NOISE, Regression, RegressionData, fit, scalars
from torch.utils.data import DataLoader

from lightning_monitor import GradientNoiseScaleMonitor
from lightning_monitor.alerts import read_alerts
from lightning_monitor.functional.noise_scale import NoiseScaleEMA

CHANGE = 10


def _truth(offset: float) -> float:
    """B_simple at weights ``w* + offset * u`` (lr 0): ((D + 1) e2 + D noise^2) / e2, e2 = |w - w*|^2."""
    u = torch.randn(D, generator=torch.Generator().manual_seed(7))
    e2 = float((offset * u).pow(2).sum())
    return ((D + 1) * e2 + D * NOISE**2) / e2


class _SetWeights(pl.Callback):
    """Weights far from the optimum until step CHANGE (huge, mostly systematic gradients), near it after."""

    def __init__(self, far: float, near: float) -> None:
        self.far, self.near = far, near

    def _set(self, module: Regression, offset: float) -> None:
        w_star = torch.randn(D, generator=torch.Generator().manual_seed(123))
        u = torch.randn(D, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            module.lin.weight.copy_((w_star + offset * u).reshape(1, D))

    def on_train_start(self, trainer, pl_module) -> None:
        self._set(pl_module, self.far)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == CHANGE:
            self._set(pl_module, self.near)


def test_a_change_of_scale_restarts_the_averages(tmp_path) -> None:
    torch.manual_seed(0)
    far, near = 1000.0, 0.1
    loader = DataLoader(RegressionData(16 * 800), batch_size=16, shuffle=False)
    mon = GradientNoiseScaleMonitor(every_n_steps=1, smoothing=0.99, min_checks=5)
    trainer, lg = fit(Regression(), [mon, _SetWeights(far, near)], tmp_path, loader, max_steps=800)
    b = dict(scalars(lg.log_dir)["gns/b_simple"])
    truth_far, truth_near = _truth(far), _truth(near)
    assert truth_near > 3 * truth_far  # two regimes of clearly different noise scales
    assert b[CHANGE - 1] < truth_near / 2  # the first regime's ratio (about 9; 10 noisy checks)
    # after the change the averages hold the new weights' checks only: the last value meets the new truth
    assert b[799] == pytest.approx(truth_near, rel=0.25)
    alerts = [a for a in read_alerts(os.path.join(lg.log_dir, "alerts.jsonl")) if a.kind == "averages_restarted"]
    # at the third check of the new scale (the first two are held out of the averages, then replayed into them)
    assert [(a.step, a.severity) for a in alerts] == [(CHANGE + 2, "info")]
    assert "another scale" in alerts[0].message and "3 checks in a row" in alerts[0].message
    assert b[CHANGE] == b[CHANGE + 1] == b[CHANGE - 1]  # the held checks do not move the logged average


def test_one_outlier_check_is_held_out_not_a_restart() -> None:
    """Near convergence one batch the model already fits has a tr(Sigma) a thousand times below the average: it
    restarted the averages, and the next ordinary batch restarted them again (41 restarts in 300 checks of a small
    MLP). Fewer than `persist` such checks in a row are held out and dropped; the averages are those of the ordinary
    checks alone, and a run of them on the same side restarts once."""
    ordinary = [(0.5 + 0.1 * (k % 3), 40.0 + 5.0 * (k % 4)) for k in range(60)]
    plain, with_outliers = NoiseScaleEMA(0.9), NoiseScaleEMA(0.9)
    restarts = 0
    for k, (g2, tr) in enumerate(ordinary):
        plain.update(g2, tr)
        if k % 10 == 5:  # a fitted batch, then a spike, alone each: on either side
            for outlier in ((1e-3, 0.02), (50.0, 9e4)):
                with_outliers.update(*outlier)
                restarts += with_outliers.restarted
        with_outliers.update(g2, tr)
        restarts += with_outliers.restarted
    assert restarts == 0 and with_outliers.b_simple == pytest.approx(plain.b_simple, rel=1e-12)
    # one below and one above the range are no run: held, then dropped
    mixed = NoiseScaleEMA(0.9)
    for g2, tr in [(0.5, 40.0), (1e-3, 0.02), (50.0, 9e4), (1e-3, 0.02), (0.5, 40.0)]:
        mixed.update(g2, tr)
        assert not mixed.restarted
    assert mixed.b_simple == pytest.approx(80.0) and mixed.held == []
    # a checkpoint keeps the held checks: a run that straddles a resume restarts as it would have
    held = NoiseScaleEMA(0.9)
    for g2, tr in [(0.5, 40.0), (1e-3, 0.02), (1e-3, 0.02)]:
        held.update(g2, tr)
    resumed = NoiseScaleEMA(0.9)
    resumed.load_state_dict(held.state_dict())
    resumed.update(1e-3, 0.02)
    assert resumed.restarted and resumed.b_simple == pytest.approx(20.0)


def test_persist_must_be_a_positive_integer() -> None:
    with pytest.raises(ValueError, match="persist"):
        NoiseScaleEMA(0.9, persist=0)


def test_without_a_restart_the_first_checks_would_have_fixed_the_ratio() -> None:
    """The same two regimes fed to averages that never restart (a factor no change reaches): the ratio stays the first
    regime's, which is what the restart is for."""
    never, restarting = NoiseScaleEMA(0.95, restart_factor=1e30), NoiseScaleEMA(0.95)
    for k in range(200):
        g2, tr = (1e7, 9e7) if k < 10 else (0.08, 2.7)  # B_simple 9, then about 34
        never.update(g2, tr)
        restarting.update(g2, tr)
    assert never.b_simple == pytest.approx(9.0, rel=0.05)
    assert restarting.b_simple == pytest.approx(2.7 / 0.08)


def test_restart_factor_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="restart_factor"):
        NoiseScaleEMA(0.9, restart_factor=1.0)

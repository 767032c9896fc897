"""DivergenceGuard on float64 losses: a finite loss beyond float32's range (about 3.4e38) was cast to float32 before it
was judged, read as inf, and a healthy run had every step's gradients zeroed and was stopped at step 4."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard

SCALE = 1e40  # every loss and gradient beyond float32's range, finite in float64


class Regressor(pl.LightningModule):
    def __init__(self, jump_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).double()
        self.jump_at = jump_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x).squeeze(-1), y) * SCALE

    def on_train_batch_start(self, batch, batch_idx):
        if self.jump_at is not None and self.global_step == self.jump_at:
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] *= 3000.0

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)  # Adam: the scale does not change the steps


def _fit(model: Regressor, **guard_kw) -> DivergenceGuard:
    torch.manual_seed(0)
    x = torch.randn(640, 4, dtype=torch.float64)
    data = DataLoader(TensorDataset(x, x[:, 0] * 2 - x[:, 1]), batch_size=16)
    guard = DivergenceGuard(**guard_kw)
    pl.Trainer(max_steps=80, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False, callbacks=[guard]).fit(model, data)
    return guard


@pytest.mark.parametrize("lag_steps", [None, 1])  # the values read at once on CPU, and through the device row
def test_a_healthy_float64_run_with_losses_beyond_float32_is_left_alone(lag_steps) -> None:
    model = Regressor()
    guard = _fit(model, lag_steps=lag_steps)
    assert guard.rollbacks == [] and guard.stopped_step is None
    assert not [a for a in guard.hub.history if a.severity != "info"]
    with torch.no_grad():
        assert all(torch.isfinite(p).all() for p in model.parameters())
    # it learned (its gradients were not zeroed): the loss fell by orders of magnitude
    assert guard._loss_watch.level() < 0.2 * SCALE  # from about 5 * SCALE (the target's variance)


@pytest.mark.parametrize("lag_steps", [None, 1])
def test_a_float64_run_that_diverges_beyond_float32_is_still_rolled_back(lag_steps) -> None:
    guard = _fit(Regressor(jump_at=40), lag_steps=lag_steps)
    assert guard.rollbacks and 40 <= guard.rollbacks[0]["to_step"] <= 41 <= guard.rollbacks[0]["step"] <= 45
    assert guard.stopped_step is None

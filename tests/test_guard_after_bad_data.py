"""A creep after a rollback over bad data is judged as any other: the rollback found the data at fault, not the rate.

FixMatch-style self-training on digits: the unsupervised term rises by design as more pseudo-labels pass the
confidence threshold. One corrupt unlabeled batch (a NaN pixel) is rightly rolled back over, the rate kept; the rise
that followed, within 200 steps of that rollback, was taken for "the learning rate is still too high" (a second
rollback, 54 batches discarded, every rate x0.25). Without the NaN batch the same run draws no action."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard

sklearn_datasets = pytest.importorskip("sklearn.datasets")


class _FixMatch(pl.LightningModule):
    def __init__(self, xl: torch.Tensor, yl: torch.Tensor, nan_at: int | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        self.xl, self.yl, self.nan_at, self.done = xl, yl, nan_at, False

    def training_step(self, batch, batch_idx):
        xu = batch[0]
        if self.global_step == self.nan_at and not self.done:  # one corrupt unlabeled batch, once
            self.done = True
            xu = xu.clone()
            xu[0, 0] = float("nan")
        idx = torch.randint(0, len(self.xl), (32,))
        sup = F.cross_entropy(self.net(self.xl[idx] + 0.05 * torch.randn_like(self.xl[idx])), self.yl[idx])
        with torch.no_grad():  # pseudo-labels from the current model, kept where confident
            conf, label = F.softmax(self.net(xu + 0.05 * torch.randn_like(xu)), -1).max(-1)
            mask = (conf >= 0.95).float()
        strong = (xu + 0.3 * torch.randn_like(xu)) * (torch.rand_like(xu) > 0.2)
        return sup + (F.cross_entropy(self.net(strong), label, reduction="none") * mask).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@pytest.mark.slow
def test_a_rise_by_design_after_a_bad_batch_rollback_draws_no_second_rollback(tmp_path) -> None:
    x, y = sklearn_datasets.load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(11))
    x, y = x[perm][:1400], y[perm][:1400]
    pl.seed_everything(0, verbose=False)
    guard = DivergenceGuard()
    loader = DataLoader(TensorDataset(x[100:]), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    pl.Trainer(max_steps=300, accelerator="cpu", logger=False, callbacks=[guard], enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path)).fit(
        _FixMatch(x[:100], y[:100], nan_at=200), loader)
    assert [r["step"] for r in guard.rollbacks] == [200]
    assert guard.rollbacks[0]["lr_factor"] == 1.0 and guard.rollbacks[0]["diverged"] is False

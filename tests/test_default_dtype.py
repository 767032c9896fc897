"""The suite under ``torch.set_default_dtype(torch.float64)`` (scientific models set it globally): the per-example
probe's projections and GradES's vectors were built in the default dtype and met float32 statistics, and the first
backward (the probe) or the first check (GradES) failed."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import HealthMonitor, PerExampleGradNorms


@pytest.fixture
def float64_default():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 3))


def test_probe_matches_single_example_gradients_under_a_float64_default(float64_default) -> None:
    torch.manual_seed(0)
    net, x, y = _net(), torch.randn(12, 10), torch.randint(0, 3, (12,))
    assert next(net.parameters()).dtype == torch.float64
    with PerExampleGradNorms(net, loss_reduction="sum") as probe:  # verified against the gradient at its first backward
        F.cross_entropy(net(x), y, reduction="sum").backward()
    oracle = []
    for i in range(len(x)):
        net.zero_grad()
        F.cross_entropy(net(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        oracle.append(sum(p.grad.pow(2).sum() for p in net.parameters()))
    torch.testing.assert_close(probe.squared_norms().double(), torch.stack(oracle), rtol=1e-5, atol=0)
    assert probe.uncovered == []


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_every_monitor_runs_and_logs_under_a_float64_default(tmp_path, float64_default) -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 10)
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()), batch_size=16)
    monitor = HealthMonitor(grades=True, spectral={"every_n_steps": 4}, noise_scale={"every_n_steps": 4},
                            gwa={"every_n_steps": 1, "min_epoch_samples": 64})
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", logger=logger, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[monitor],
                         default_root_dir=str(tmp_path))
    trainer.fit(Classifier(), data)
    assert trainer.global_step == 48
    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("sa/sign_diversity_mean", "gns/g2", "gns/trace_sigma", "gwa/score", "grades/frozen_fraction"):
        assert tag in tags, tag
        assert all(torch.isfinite(torch.tensor(e.value)) for e in acc.Scalars(tag)), tag
    assert [e.value for e in acc.Scalars("gns/coverage")][-1] == pytest.approx(1.0)
    guard = next(c for c in trainer.callbacks if type(c).__name__ == "DivergenceGuard")
    assert guard.rollbacks == [] and not [a for a in guard.hub.history if a.severity == "critical"]

"""A model trained by several optimizers (a GAN with manual optimization): the monitors whose numbers
would mix the optimizers' losses refuse it with a clear reason (or stay idle under the preset's
setting); GWA scores an explicitly named head; spectral alignment watches every layer."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import (
    GradientEarlyStopping,
    GradientNoiseScaleMonitor,
    GradientWeightAlignmentMonitor,
    SpectralAlignmentMonitor,
    read_alerts,
)
from lightning_monitor.callbacks.base import NothingToWatch


class GAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))
        self.disc = nn.ModuleList([nn.Linear(6, 16), nn.Linear(16, 2)])

    def discriminate(self, x):
        return self.disc[1](torch.relu(self.disc[0](x)))

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        fake = self.gen(torch.randn(real.shape[0], 4))
        d_loss = F.cross_entropy(self.discriminate(torch.cat([real, fake.detach()])),
                                 torch.cat([torch.ones(len(real)), torch.zeros(len(real))]).long())
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = F.cross_entropy(self.discriminate(fake), torch.ones(len(real)).long())
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.gen.parameters(), lr=0.01), torch.optim.SGD(self.disc.parameters(), lr=0.01)


def fit(tmp_path, callbacks):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = pl.Trainer(accelerator="cpu", max_steps=4, logger=logger, callbacks=callbacks, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    data = TensorDataset(torch.randn(32, 6), torch.randint(0, 2, (32,)))
    trainer.fit(GAN(), DataLoader(data, batch_size=8))
    path = os.path.join(logger.log_dir, "alerts.jsonl")
    return read_alerts(path) if os.path.exists(path) else []


@pytest.mark.parametrize("make, match", [
    (lambda: GradientNoiseScaleMonitor(every_n_steps=1), "2 optimizers"),
    (lambda: GradientWeightAlignmentMonitor(warmup_epochs=0), "Pass `head=`"),
    (lambda: GradientEarlyStopping(include="disc.*", grace_steps=0), "GradES supports one optimizer"),
])
def test_refused_with_the_reason(tmp_path, make, match) -> None:
    with pytest.raises(NothingToWatch, match=match):
        fit(tmp_path, [make()])


def test_idle_under_the_preset_setting_and_the_others_watch(tmp_path) -> None:
    mons = [GradientNoiseScaleMonitor(every_n_steps=1), GradientWeightAlignmentMonitor(warmup_epochs=0),
            GradientEarlyStopping(include="disc.*", grace_steps=0)]
    for m in mons:
        m.idle_when_nothing_to_watch = True
    sa = SpectralAlignmentMonitor(every_n_steps=1, head=None)
    alerts = fit(tmp_path, [*mons, sa])
    assert all(m.idle_reason is not None for m in mons)
    assert sorted(a.monitor for a in alerts if a.kind == "nothing_to_watch") == ["gns", "grades", "gwa"]
    assert sa.idle_reason is None and sa._n_checks > 0


def test_gwa_with_a_named_head_scores_it(tmp_path) -> None:
    gwa = GradientWeightAlignmentMonitor(head="disc.1", warmup_epochs=0, log_histograms=False,
                                         target_fn=lambda b: torch.cat([torch.ones(len(b[0])), torch.zeros(len(b[0]))]).long())
    fit(tmp_path, [gwa])
    assert gwa.idle_reason is None and gwa.history and gwa.history[0]["count"] > 0

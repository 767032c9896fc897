"""A batch skipped on purpose: ``training_step`` returns None (Lightning's documented way), and Lightning still steps
the optimizer, with no gradient anywhere. A monitor whose check falls on such a step skips it (the noise-scale monitor
raised on an empty list of gradients and took the fit down); the guard does not tell the user to return the loss, and
spectral alignment does not name a layer "not called" for a step that ran no forward. (Under distributed training
Lightning refuses a training_step that returns None.)"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientNoiseScaleMonitor, HealthMonitor, read_alerts

SKIPPED = {3, 50}  # step 50 is a check of the preset's noise-scale and spectral monitors (every 50)


class _Skips(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))

    def training_step(self, batch, batch_idx):
        if self.global_step in SKIPPED:
            return None  # skipped before the forward
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _fit(root: str, callback: pl.Callback, steps: int = 120) -> pl.Trainer:
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=TensorBoardLogger(root, name="skips", version=0),
                         callbacks=[callback], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, log_every_n_steps=1)
    trainer.fit(_Skips(), DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=g))
    return trainer


def test_the_preset_runs_through_skipped_batches_on_its_check_steps(tmp_path, recwarn) -> None:
    trainer = _fit(str(tmp_path), HealthMonitor())
    assert trainer.global_step == 120 and not trainer.should_stop
    log_dir = trainer.logger.log_dir
    kinds = [(a.monitor, a.kind) for a in read_alerts(os.path.join(log_dir, "alerts.jsonl"))]
    assert ("sa", "layers_not_called") not in kinds, kinds
    assert not [k for k in kinds if k[1] in ("rollback", "stopped", "nonfinite")], kinds
    assert not [w for w in recwarn if "saw no training loss" in str(w.message)]
    # the checks that were not skipped are logged: the noise scale's at 0 and 100, not at the skipped step 50
    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    events.Reload()
    steps = sorted({e.step for tag in events.Tags()["scalars"] if tag.startswith("gns/") for e in events.Scalars(tag)})
    assert 50 not in steps and 100 in steps, steps
    sa_steps = sorted({e.step for tag in events.Tags()["scalars"] if tag.startswith("sa/") for e in events.Scalars(tag)})
    assert 50 not in sa_steps and 100 in sa_steps, sa_steps


def test_noise_scale_checking_every_step_skips_the_skipped_ones(tmp_path) -> None:
    gns = GradientNoiseScaleMonitor(every_n_steps=1)
    trainer = _fit(str(tmp_path), gns, steps=60)
    assert trainer.global_step == 60
    events = EventAccumulator(trainer.logger.log_dir, size_guidance={"scalars": 0})
    events.Reload()
    steps = {e.step for e in events.Scalars("gns/batch_size")}
    assert not steps & SKIPPED and len(steps) == 60 - len(SKIPPED & set(range(60))), sorted(steps)


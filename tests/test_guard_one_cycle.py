"""A healthy one-cycle schedule at the edge of stability (SGD with momentum, max_lr 0.3, on digits): around its peak the
loss spikes to 2-4x its recent level, and the weights are then worse on the last batches too (2-5x), but every spike
stays below the initial loss and settles by itself. The guard rolls such runs back (5 of 7 seeds), and the rollback's
rate ceiling flattens the rest of the schedule (the peak at 0.06 instead of 0.3): a known limit, marked xfail (strict:
it fails the suite once fixed, so that the mark goes). A rule that waited on surges below the initial loss spared 6
of 7 seeds but caught diverging runs of the zoo's held-out splits later (BENCHMARKS.md), so it was not adopted. The same
run at max_lr x30 explodes at step 20 and is rolled back there."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from conftest import digits_subset

from lightning_monitor import DivergenceGuard

sklearn_datasets = pytest.importorskip("sklearn.datasets")

STEPS = 200


class Net(pl.LightningModule):
    def __init__(self, max_lr: float) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                         torch.nn.ReLU(), torch.nn.Linear(128, 10))
        self.max_lr = max_lr

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.max_lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.max_lr, total_steps=505, pct_start=0.3)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def run(seed: int, max_lr: float):
    torch.set_num_threads(1)
    pl.seed_everything(seed, verbose=False)
    x, y = digits_subset()
    module = Net(max_lr)
    guard = DivergenceGuard()
    trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, max_epochs=-1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[guard])
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
    return trainer, guard


@pytest.mark.xfail(strict=True, reason="known limit: a healthy one-cycle peak at the edge of stability is rolled back")
@pytest.mark.parametrize("seed", [2, 5, 0], ids=["rolled back at 60", "at 88", "at 148"])
def test_a_healthy_one_cycle_peak_is_not_rolled_back(seed: int) -> None:
    trainer, guard = run(seed, 0.3)
    assert guard.rollbacks == [] and guard.stopped_step is None and trainer.global_step == STEPS
    # the rates are the schedule's own (no ceiling), near its peak (step 151)
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0] and lr > 0.25


def test_the_same_schedule_x30_is_still_rolled_back_at_once() -> None:
    _, guard = run(2, 9.0)
    assert guard.rollbacks and guard.rollbacks[0]["step"] <= 25

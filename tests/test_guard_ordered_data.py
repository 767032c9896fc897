"""Epochs ordered by difficulty (each epoch's samples sorted by the model's present loss): the loss climbs through
every epoch by design, and the weights at the end of an epoch, fresh from its hardest samples, handle the next
epoch's hard stretch better than the present ones. An older snapshot finding the batch easier is then no evidence of
divergence: the guard stopped such a healthy run at step 181 of 600 (four rollbacks to the same state) and halved the
learning rate of others. A learning rate jumped x100 in the same run is still rolled back at once."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Sampler, TensorDataset

from conftest import digits_subset

from lightning_monitor import DivergenceGuard
from lightning_monitor.alerts import AlertHub

sklearn_datasets = pytest.importorskip("sklearn.datasets")


class ByDifficulty(Sampler):
    """Each epoch, the training set ordered by the model's present per-sample loss."""

    def __init__(self, module: pl.LightningModule, x: torch.Tensor, y: torch.Tensor, hard_first: bool) -> None:
        self.module, self.x, self.y, self.hard_first = module, x, y, hard_first

    def __len__(self) -> int:
        return len(self.x)

    def __iter__(self):
        with torch.no_grad():
            loss = F.cross_entropy(self.module(self.x), self.y, reduction="none")
        return iter(torch.argsort(loss, descending=self.hard_first).tolist())


class Net(pl.LightningModule):
    def __init__(self, jump_at: int = -1) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                         torch.nn.ReLU(), torch.nn.Linear(256, 10))
        self.jump_at = jump_at

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.jump_at:  # the diverging twin: the rate x100 from here on
            for group in self.optimizers().optimizer.param_groups:
                group["lr"] *= 100.0
            self.jump_at = -1
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def run(seed: int, hard_first: bool, steps: int, jump_at: int = -1):
    torch.set_num_threads(1)
    pl.seed_everything(seed, verbose=False)
    x, y = digits_subset()
    module = Net(jump_at)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, sampler=ByDifficulty(module, x, y, hard_first))
    guard = DivergenceGuard()
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, max_epochs=-1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[guard])
    trainer.fit(module, loader)
    return trainer, guard


@pytest.mark.parametrize("seed, hard_first, steps", [(2, False, 200), (0, True, 200)],
                         ids=["easy first (was stopped at 181)", "hard first (was rolled back at 116)"])
def test_epochs_ordered_by_difficulty_are_data_not_divergence(seed: int, hard_first: bool, steps: int) -> None:
    trainer, guard = run(seed, hard_first, steps)
    assert guard.rollbacks == [] and guard.stopped_step is None and trainer.global_step == steps
    said = [a for a in AlertHub.for_trainer(trainer).history if a.monitor == "guard" and a.severity == "critical"]
    assert said == []
    assert "data_shift" in {a.kind for a in AlertHub.for_trainer(trainer).history if a.monitor == "guard"}


def test_a_divergence_in_the_same_run_is_still_rolled_back() -> None:
    trainer, guard = run(0, True, 170, jump_at=150)
    assert guard.rollbacks and 150 <= guard.rollbacks[0]["step"] <= 156  # the loss rose from 152: caught at 154
    assert guard.rollbacks[0]["to_step"] <= 150 and guard.stopped_step is None

"""A `training_step` that steps a learning-rate scheduler itself: the guard's replays leave the schedule alone.

The guard evaluates kept batches again (at each checkpoint, at the end of the fit, on a surge). Under automatic
optimization a replay ran the step's `self.lr_schedulers().step()` (or a scheduler the module keeps, `self.sched`):
each replay moved the schedule on one step, and a run checkpointed every epoch ended 16 steps ahead of the same run
unguarded (weights 7e-3 apart), with no action taken."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)


class _Registered(pl.LightningModule):
    """A warm-up stepped by hand inside the step; Lightning's own stepping once an epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.schedule().step()
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def schedule(self) -> Any:
        return self.lr_schedulers()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.net.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 200))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


class _Held(_Registered):
    """A scheduler the module keeps itself, not given to Lightning."""

    def schedule(self) -> Any:
        return self.sched

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.net.parameters(), lr=3e-3)
        self.sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 200))
        return opt


def _fit(tmp_path, cls: type, guarded: bool) -> tuple[pl.LightningModule, DivergenceGuard | None]:
    pl.seed_everything(0, verbose=False)
    module = cls()
    guard = DivergenceGuard() if guarded else None
    checkpoints = ModelCheckpoint(dirpath=tmp_path / f"ckpt-{guarded}", every_n_epochs=1, save_top_k=-1)
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", logger=False, default_root_dir=tmp_path,
                         callbacks=([guard] if guard else []) + [checkpoints], enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, _loader())
    return module, guard


@pytest.mark.parametrize("cls", [_Registered, _Held], ids=["lr_schedulers()", "self.sched"])
def test_replays_do_not_step_the_schedule(tmp_path, cls) -> None:
    plain, _ = _fit(tmp_path, cls, False)
    guarded, guard = _fit(tmp_path, cls, True)
    assert guard is not None and not guard.rollbacks and guard.stopped_step is None
    assert guarded.schedule().last_epoch == plain.schedule().last_epoch
    for a, b in zip(plain.state_dict().values(), guarded.state_dict().values()):
        assert torch.equal(a, b)

"""A guard's rollback takes the undone batches' GWA scores out of the epoch, the batch at the snapshot's own step too.
The guard snapshots a step before its update, after its forward: GWA had already kept that batch's scores, and the
snapshot held them, so a rollback to it kept one undone batch in ``gwa/*`` (76 batches scored of 75 trained). The run
rolled back is checked against a straight run on the same data without the undone batches."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_monitor as lm

N, B, NAN_AT = 1280, 16, 24  # 80 batches; a NaN loss at step 24 rolls back to the snapshot of step 20


class _Clf(pl.LightningModule):
    def __init__(self, nan_at: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        self.nan_at = nan_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.global_step == self.nan_at:
            self.nan_at = None
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _fit(x, y, nan_at, guard, tmp_path):
    pl.seed_everything(0, verbose=False)
    gwa = lm.GradientWeightAlignmentMonitor(every_n_steps=1, warmup_epochs=0)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[gwa] + ([guard] if guard is not None else []))
    model = _Clf(nan_at)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=B))
    return gwa.history[-1], model


def test_a_rollback_leaves_no_undone_batch_in_the_epoch(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    y = (x @ torch.randn(8, 4, generator=g)).argmax(-1)
    guard = lm.DivergenceGuard(every_n_steps=5)
    rolled, model = _fit(x, y, NAN_AT, guard, tmp_path / "rolled")
    assert [(r["step"], r["to_step"], [b for _, b in r["batches"]]) for r in guard.rollbacks] == [
        (24, 20, [20, 21, 22, 23, 24])]
    kept = torch.cat([torch.arange(0, 20 * B), torch.arange(25 * B, N)])  # the batches the rolled-back run trained on
    straight, twin = _fit(x[kept], y[kept], None, None, tmp_path / "straight")
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)  # the same updates
    assert rolled["count"] == straight["count"] == N - 5 * B and rolled["negative"] == straight["negative"]
    for key in ("mean", "kurtosis", "score"):
        assert rolled[key] == pytest.approx(straight[key], rel=1e-6, abs=1e-9), key

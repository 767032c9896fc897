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

N, B, NAN_AT = 1280, 16, 24  # 80 batches; a NaN loss at step 24


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


def test_a_nan_batch_judged_late_is_skipped_and_stays_in_the_epoch(tmp_path):
    # judged a step late (as on a GPU) with the weights intact: no rollback (it would undo the good step since too); the
    # batch's gradients were zeroed, and its forward, under good weights, stays in GWA's epoch
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    y = (x @ torch.randn(8, 4, generator=g)).argmax(-1)
    guard = lm.DivergenceGuard(every_n_steps=5, lag_steps=1)
    rolled, model = _fit(x, y, NAN_AT, guard, tmp_path / "rolled")
    assert not guard.rollbacks and guard.stopped_step is None
    assert [a.step for a in guard.hub.history if a.kind == "nonfinite_skipped"] == [NAN_AT + 1]
    assert rolled["count"] == N and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("lag, undone", [(None, [24])])
def test_a_rollback_leaves_no_undone_batch_in_the_epoch(tmp_path, lag, undone):
    # judged at once (one CPU process), the NaN batch is undone alone: the guard keeps the state before its update
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    y = (x @ torch.randn(8, 4, generator=g)).argmax(-1)
    guard = lm.DivergenceGuard(every_n_steps=5, lag_steps=lag)
    rolled, model = _fit(x, y, NAN_AT, guard, tmp_path / "rolled")
    assert [(r["step"], r["to_step"], [b for _, b in r["batches"]]) for r in guard.rollbacks] == [
        (undone[-1], undone[0], undone)]
    # the batches the rolled-back run trained on
    kept = torch.cat([torch.arange(0, undone[0] * B), torch.arange((undone[-1] + 1) * B, N)])
    straight, twin = _fit(x[kept], y[kept], None, None, tmp_path / "straight")
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)  # the same updates
    assert rolled["count"] == straight["count"] == N - len(undone) * B and rolled["negative"] == straight["negative"]
    for key in ("mean", "kurtosis", "score"):
        assert rolled[key] == pytest.approx(straight[key], rel=1e-6, abs=1e-9), key


def test_snapshots_share_the_history_and_a_long_epoch_keeps_few_steps(tmp_path, monkeypatch):
    # thousands of epochs: every snapshot (every 10 steps) copied GWA's whole per-epoch history (11 ms a snapshot at
    # 3,000 epochs, five times the guard's cost a step at 100); now the records, which never change once made, are held
    # by reference. And one long epoch with a small head kept every scored step unfolded (the element bound took
    # 327,680 steps with 2 classes and batch 8): at most 256 are kept (8 times as many while a reading of the loss is
    # being checked, as here all epoch long: 16 a step cap in this test, 128 steps)
    import lightning_monitor.callbacks.gradient_weight_alignment as module
    from lightning_monitor.snapshot import Shared

    monkeypatch.setattr(module, "_FLUSH_STEPS", 16, raising=False)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    y = (x @ torch.randn(8, 4, generator=g)).argmax(-1)

    class Peek(pl.Callback):
        stash = 0
        held: list = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.stash = max(self.stash, len(gwa._stash))
            snaps = guard._snapshots
            if snaps:
                self.held.append(snaps[-1].state()["monitors"][next(k for k in snaps[-1].state()["monitors"]
                                                                    if "GradientWeight" in k)]["history"])

    gwa, guard, peek = lm.GradientWeightAlignmentMonitor(every_n_steps=1, warmup_epochs=0), lm.DivergenceGuard(), Peek()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[gwa, guard, peek])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Clf(None), DataLoader(TensorDataset(x.repeat(4, 1), y.repeat(4)), batch_size=4))
    assert len(gwa.history) == 3 and trainer.global_step == 3 * 4 * N // 4
    assert 0 < peek.stash <= 8 * 16
    assert all(type(h) is Shared for h in peek.held)
    # one object per epoch's history, shared by every snapshot taken while it stood
    assert len({id(h) for h in peek.held}) == len({len(h) for h in peek.held}) <= 3
    assert [dict(h) for h in peek.held[-1]] == gwa.history[: len(peek.held[-1])]

"""GWA's epoch bookkeeping across resumes: a checkpoint saved inside an epoch carries the epoch's
accumulators, so the resumed run scores the whole epoch (checked against per-sample autograd over both
processes' samples); an epoch cut short by ``max_steps`` and resumed is one epoch, not two; a short
remainder is logged but never selected."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from test_gwa_callback import DigitsMLP, _loader, _scipy_gwa, _trainer

from lightning_monitor import GradientWeightAlignmentMonitor

BATCHES = 6  # 600 digits in batches of 100


def _run(root: str, max_steps: int, ckpt_path=None, **checkpoint_kw):
    seed_everything(0, verbose=False)
    module = DigitsMLP()
    loader, _ = _loader(shuffle=False)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    ckpt = ModelCheckpoint(dirpath=os.path.join(root, "ck"), save_top_k=-1, **checkpoint_kw)
    trainer = _trainer(root, False, [gwa, ckpt], max_epochs=-1, max_steps=max_steps)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, module, gwa


def _oracle(*parts: list) -> float:
    return _scipy_gwa(torch.cat([t for part in parts for t in part]).numpy())


def test_mid_epoch_resume_scores_the_whole_epoch(tmp_path) -> None:
    root = str(tmp_path)
    _, first, _ = _run(root, 9, every_n_train_steps=8)  # a checkpoint at step 8: 2 batches into epoch 1
    ckpt = os.path.join(root, "ck", "epoch=1-step=8.ckpt")
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("GradientWeightAlignmentMonitor")]
    assert state["open_epoch"]["epoch"] == 1 and state["open_epoch"]["moments"][0] == 200
    trainer, resumed, gwa = _run(root, 12, ckpt_path=ckpt)
    assert [h["epoch"] for h in gwa.history] == [0, 1]
    record = gwa.history[1]
    assert record["count"] == 600 and not record.get("partial")
    # the 2 batches the first process scored before its checkpoint, then the 4 the resumed process ran
    expected = _oracle(first.oracle[1][:2], resumed.oracle[1])
    np.testing.assert_allclose(record["score"], expected, rtol=1e-6)
    # without the saved accumulators the epoch would be the resumed part alone: a different number
    assert abs(_oracle(resumed.oracle[1]) - expected) > 1e-4


def test_epoch_cut_short_by_max_steps_and_resumed_is_one_epoch(tmp_path) -> None:
    root = str(tmp_path)
    _, first, gwa1 = _run(root, 9)  # the epoch-end checkpoint of epoch 1 is saved after 3 of its 6 batches
    assert gwa1.history[1]["partial"] and gwa1.history[1]["count"] == 300
    trainer, resumed, gwa = _run(root, 12, ckpt_path=os.path.join(root, "ck", "epoch=1-step=9.ckpt"))
    assert [h["epoch"] for h in gwa.history] == [0, 1]  # the partial record of epoch 1 is replaced, not repeated
    record = gwa.history[1]
    assert record["count"] == 600 and not record.get("partial")
    np.testing.assert_allclose(record["score"], _oracle(first.oracle[1], resumed.oracle[1]), rtol=1e-6)
    assert trainer.callback_metrics["gwa/score"].item() == pytest.approx(record["score"], rel=1e-6)


def test_short_remainder_is_logged_but_not_selected(tmp_path) -> None:
    trainer, module, gwa = _run(str(tmp_path), BATCHES + 1)  # epoch 1: one batch of six
    short = gwa.history[1]
    assert short["partial"] and short["count"] == 100 and short["score"] is not None
    assert not short["eligible"] and gwa.best_epoch == 0
    # callback_metrics keeps epoch 0's score: a checkpoint callback on gwa/score never sees the remainder
    assert trainer.callback_metrics["gwa/score"].item() == pytest.approx(gwa.history[0]["score"], rel=1e-6)


def test_ddp_mid_epoch_resume_reduces_the_saved_epoch_over_ranks(tmp_path) -> None:
    from conftest import fit_ddp_spawn
    from test_gwa_callback import RankDump

    def run(out: str, max_steps: int, ckpt_path=None) -> None:
        os.makedirs(out, exist_ok=True)
        torch.manual_seed(5)
        loader, _ = _loader(400, batch_size=50, shuffle=False)  # 4 steps an epoch on 2 ranks
        gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
        ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=6, save_top_k=-1)
        trainer = _trainer(out, False, [gwa, RankDump(out), ckpt], max_epochs=-1, max_steps=max_steps,
                           devices=2, strategy="ddp_spawn")
        fit_ddp_spawn(trainer, DigitsMLP(lr=0.5), loader, ckpt_path=ckpt_path)

    run(str(tmp_path / "first"), 7)
    ckpt = str(tmp_path / "ck" / "epoch=1-step=6.ckpt")
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("GradientWeightAlignmentMonitor")]
    assert state["open_epoch"]["moments"][0] == 200  # 2 steps x 2 ranks x 50, reduced before saving
    run(str(tmp_path / "resumed"), 8, ckpt_path=ckpt)
    first = [torch.load(tmp_path / "first" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    resumed = [torch.load(tmp_path / "resumed" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert resumed[0]["history"] == resumed[1]["history"]
    record = resumed[0]["history"][-1]
    assert record["epoch"] == 1 and record["count"] == 400
    parts = [first[r]["oracle"][1][:100] for r in (0, 1)] + [resumed[r]["oracle"][1] for r in (0, 1)]
    np.testing.assert_allclose(record["score"], _scipy_gwa(torch.cat(parts).numpy()), rtol=1e-4, atol=1e-6)

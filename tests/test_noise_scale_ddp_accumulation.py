"""GradientNoiseScaleMonitor(method="ddp") under gradient accumulation: the DDP communication hook path.

With ``accumulate_grad_batches > 1`` the parameters' tensor hooks see one micro-batch at a time, so the
``ddp`` method reads each rank's *accumulated* local gradient from the bucket a DDP communication hook is
handed before the all-reduce (``GradientNoiseScaleMonitor._comm_hook``). Small batch: the
``accumulate * batch_size`` examples of one rank; big batch: ``world`` times that.

Linear regression with lr = 0 (the weights never move), x ~ N(0, I_D), y = w*.x + eps: with the error
e = w - w*, the per-example gradient of 0.5 (w.x - y)^2 has mean e and
``tr(Sigma) = (D + 1)|e|^2 + D sigma^2``, so ``|G|^2``, ``tr(Sigma)`` and ``B_simple`` are known in closed
form and the smoothed estimates must land on them.
"""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from conftest import fit_ddp_spawn
from lightning_monitor import GradientNoiseScaleMonitor
from test_noise_scale_callback import D, NOISE, Regression, RegressionData

STEPS, BATCH, ACCUMULATE = 120, 16, 2


class _AccumulatingDDPRegression(Regression):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out

    def on_train_end(self) -> None:
        mon = next(c for c in self.trainer.callbacks if isinstance(c, GradientNoiseScaleMonitor))
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({
                "method": mon.resolved_method, "comm_hook": mon._ddp_registered, "count": mon.ema.count,
                "b_simple": mon.ema.b_simple, "g2": float(mon.ema.g2.value), "tr": float(mon.ema.trace_sigma.value),
                "batch_size": float(self.trainer.callback_metrics.get("gns/batch_size", float("nan"))),
            }, fh)


def test_ddp_method_with_gradient_accumulation_matches_the_closed_form(tmp_path) -> None:
    torch.manual_seed(0)
    model = _AccumulatingDDPRegression(str(tmp_path))
    e2 = float((model.lin.weight.detach().reshape(-1) - RegressionData(1).w_star).pow(2).sum())
    truth = {"g2": e2, "tr": (D + 1) * e2 + D * NOISE**2, "b_simple": model.truth()}
    data = RegressionData(BATCH * 2 * ACCUMULATE * STEPS, seed=5)
    mon = GradientNoiseScaleMonitor(method="ddp", every_n_steps=1, smoothing=0.98)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=STEPS, accumulate_grad_batches=ACCUMULATE,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[mon], default_root_dir=str(tmp_path),
    )
    fit_ddp_spawn(trainer, model, DataLoader(data, batch_size=BATCH))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    # the communication-hook path ran, on every step, on both ranks
    assert r0["method"] == r1["method"] == "ddp"
    assert r0["comm_hook"] and r1["comm_hook"]
    assert r0["count"] == r1["count"] == STEPS
    # every rank computes the same estimates (the small-batch norms are averaged across ranks)
    for key in ("b_simple", "g2", "tr"):
        assert r0[key] == pytest.approx(r1[key], rel=1e-6), key
    # big batch = ACCUMULATE * BATCH examples on each of the 2 ranks
    assert r0["batch_size"] == 2 * ACCUMULATE * BATCH
    # within sampling noise of the closed form (~7,700 examples; same tolerance as the no-accumulation test)
    assert r0["g2"] == pytest.approx(truth["g2"], rel=0.25)
    assert r0["tr"] == pytest.approx(truth["tr"], rel=0.15)
    assert r0["b_simple"] == pytest.approx(truth["b_simple"], rel=0.25)

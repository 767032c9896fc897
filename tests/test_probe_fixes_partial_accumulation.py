"""An epoch whose last gradient-accumulation window is short (18 batches with ``accumulate_grad_batches=4``:
windows of 4, 4, 4, 4, 2 micro-batches). Lightning divides every micro-batch's loss by 4, also in the short
window; GradientNoiseScaleMonitor used to scale back by the number of micro-batches it saw (2), so on those steps
``gns/g2`` and ``gns/trace_sigma`` were 4x too small. Every step is checked against the estimators computed from
per-example gradients of a loop over examples (lr = 0: the weights, hence the gradients, never move)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import tb_scalars
from lightning_monitor import GradientNoiseScaleMonitor
from test_probe_fixes_oracle import loop_grads

BATCH, ACCUMULATE, BATCHES = 8, 4, 18  # windows of 4, 4, 4, 4, 2 micro-batches per epoch


class Clf(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def truth(per: dict[str, Tensor], window: range, method: str) -> tuple[float, float]:
    """``(|G|^2, tr(Sigma))`` of McCandlish et al.'s estimators for the examples of the micro-batches in ``window``:
    micro-batch against window (``"accumulation"``), or example against window (``"per_example"``)."""
    idx = torch.cat([torch.arange(m * BATCH, (m + 1) * BATCH) for m in window])
    g = torch.cat([v[idx].flatten(1) for v in per.values()], 1)  # [examples, all parameters]
    big = float(g.mean(0).pow(2).sum())
    if method == "accumulation":
        b_small, small = BATCH, float(g.reshape(len(window), BATCH, -1).mean(1).pow(2).sum(1).mean())
    else:
        b_small, small = 1, float(g.pow(2).sum(1).mean())
    b_big = len(idx)
    return (b_big * big - b_small * small) / (b_big - b_small), (small - big) / (1 / b_small - 1 / b_big)


def _fit_logged(tmp_path, model: pl.LightningModule, x: Tensor, y: Tensor, method: str, epochs: int,
                accumulate: int) -> dict[str, list[tuple[int, float]]]:
    """Every step's raw estimates (lr 0, no smoothing), read back from the TensorBoard event file."""
    mon = GradientNoiseScaleMonitor(method=method, every_n_steps=1, smoothing=0.0, per_layer=False)
    trainer = pl.Trainer(max_epochs=epochs, accumulate_grad_batches=accumulate, accelerator="cpu", log_every_n_steps=1,
                         logger=TensorBoardLogger(str(tmp_path), name="tb"), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[mon])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    return tb_scalars(str(tmp_path))


@pytest.mark.parametrize("method", ["accumulation", "per_example"])
def test_short_last_accumulation_window_exact(method: str, tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * BATCHES, 6, generator=g)
    y = torch.randint(0, 3, (BATCH * BATCHES,), generator=g)
    model = Clf()
    per = loop_grads(model.net, F.cross_entropy, x, y)
    logged = _fit_logged(tmp_path, model, x, y, method, epochs=2, accumulate=ACCUMULATE)
    windows = [range(s, min(s + ACCUMULATE, BATCHES)) for s in range(0, BATCHES, ACCUMULATE)] * 2
    assert [int(v) for _, v in logged["gns/batch_size"]] == [BATCH * len(w) for w in windows]
    for (step, g2), (_, tr), window in zip(logged["gns/g2"], logged["gns/trace_sigma"], windows):
        true_g2, true_tr = truth(per, window, method)
        assert g2 == pytest.approx(true_g2, rel=1e-4, abs=1e-7), (step, len(window))
        assert tr == pytest.approx(true_tr, rel=1e-4, abs=1e-7), (step, len(window))


@pytest.mark.slow
def test_short_last_accumulation_window_exact_ddp(tmp_path) -> None:
    """``method="ddp"`` with accumulation (the DDP communication hook reads each rank's accumulated gradient): the
    same rescaling. Two ranks, each with the examples Lightning's DistributedSampler gives it (shuffled, seed 0,
    epoch 0); small batch: one rank's window, big batch: both ranks' windows."""
    from torch.utils.data import DistributedSampler

    from conftest import fit_ddp_spawn

    g = torch.Generator().manual_seed(0)
    n = 2 * BATCH * BATCHES
    x = torch.randn(n, 6, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    model = Clf()
    per = loop_grads(model.net, F.cross_entropy, x, y)
    mon = GradientNoiseScaleMonitor(method="ddp", every_n_steps=1, smoothing=0.0, per_layer=False)
    trainer = pl.Trainer(max_epochs=1, accumulate_grad_batches=ACCUMULATE, accelerator="cpu", devices=2,
                         strategy="ddp_spawn", log_every_n_steps=1, logger=TensorBoardLogger(str(tmp_path), name="tb"),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[mon])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit_ddp_spawn(trainer, model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    logged = tb_scalars(str(tmp_path))
    windows = [range(s, min(s + ACCUMULATE, BATCHES)) for s in range(0, BATCHES, ACCUMULATE)]
    flat = torch.cat([v.flatten(1) for v in per.values()], 1)
    order = [list(DistributedSampler(range(n), num_replicas=2, rank=r, shuffle=True, seed=0)) for r in (0, 1)]
    assert [int(v) for _, v in logged["gns/batch_size"]] == [2 * BATCH * len(w) for w in windows]
    for (step, g2), (_, tr), window in zip(logged["gns/g2"], logged["gns/trace_sigma"], windows):
        ranks = [torch.tensor(order[r][window[0] * BATCH:(window[-1] + 1) * BATCH]) for r in (0, 1)]
        small = sum(float(flat[idx].mean(0).pow(2).sum()) for idx in ranks) / 2
        big = float(flat[torch.cat(ranks)].mean(0).pow(2).sum())
        b_small, b_big = BATCH * len(window), 2 * BATCH * len(window)
        true_g2 = (b_big * big - b_small * small) / (b_big - b_small)
        true_tr = (small - big) / (1 / b_small - 1 / b_big)
        assert g2 == pytest.approx(true_g2, rel=1e-4, abs=1e-7), (step, len(window))
        assert tr == pytest.approx(true_tr, rel=1e-4, abs=1e-7), (step, len(window))


def weighted_truth(per: dict[str, Tensor], sizes: list[int], start: int) -> tuple[float, float]:
    """``(|G|^2, tr(Sigma))`` from the examples of micro-batches of ``sizes`` (from example ``start``) as the accumulated
    gradient weighs them: each micro-batch's loss a mean over its own examples, so the window's gradient is the mean of
    the micro-batches' means, ``G_w = sum_i w_i g_i`` with ``w_i = 1 / (K n_k)``. ``E|G_w|^2 = |G|^2 + tr(Sigma) S``
    with ``S = sum_i w_i^2``, and ``E|g_i|^2 = |G|^2 + tr(Sigma)``: two equations, solved for the two unknowns."""
    g = torch.cat([v[start:start + sum(sizes)].flatten(1) for v in per.values()], 1)
    w = torch.cat([torch.full((n,), 1.0 / (len(sizes) * n), dtype=g.dtype) for n in sizes])
    big = float((w[:, None] * g).sum(0).pow(2).sum())
    small = float(g.pow(2).sum(1).mean())
    s = float(w.pow(2).sum())
    return (big - s * small) / (1 - s), (small - big) / (1 - s)


def test_unequal_micro_batches_in_a_window_per_example(tmp_path) -> None:
    """An epoch's short last batch inside an accumulation window (43 examples in batches of 8, 3 micro-batches a step:
    8, 8, 8 then 8, 8, 3). The accumulated gradient weighs each of the 3 examples of the short batch as much as 8/3 of
    another: it is no plain mean over the 19 examples, and taken for one (B_big = 19) the step's ``gns/g2`` was 16% off
    here (0.288 against 0.248). The estimators now use the weighted mean's own variance (B_big = 9 / (2/8 + 1/3) = 15.4)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(43, 6, generator=g)
    y = torch.randint(0, 3, (43,), generator=g)
    model = Clf()
    per = loop_grads(model.net, F.cross_entropy, x, y)
    logged = _fit_logged(tmp_path, model, x, y, "per_example", epochs=1, accumulate=3)
    assert [int(v) for _, v in logged["gns/batch_size"]] == [24, 19]  # the examples seen
    for (step, g2), (_, tr), (sizes, start) in zip(logged["gns/g2"], logged["gns/trace_sigma"],
                                                   [([8, 8, 8], 0), ([8, 8, 3], 24)]):
        true_g2, true_tr = weighted_truth(per, sizes, start)
        assert g2 == pytest.approx(true_g2, rel=1e-4, abs=1e-7), step
        assert tr == pytest.approx(true_tr, rel=1e-4, abs=1e-7), step


def test_weighted_estimators_are_unbiased() -> None:
    """The estimators of ``weighted_truth`` (the monitor's, for unequal micro-batches) against the population's own
    ``|G|^2`` and ``tr(Sigma)``, averaged over 100k windows of micro-batches of 4, 4 and 2 examples drawn with
    replacement; taking the window for a plain mean of its 10 examples is biased by 10% on ``|G|^2``."""
    g = torch.Generator().manual_seed(0)
    pop = torch.randn(50, 5, generator=g, dtype=torch.float64) + torch.tensor([0.5, 0, 0, 0, 0.2], dtype=torch.float64)
    true_g2 = float(pop.mean(0).pow(2).sum())
    true_tr = float((pop - pop.mean(0)).pow(2).sum(1).mean())
    draws = pop[torch.randint(0, 50, (100_000, 10), generator=g)]
    sizes = [4, 4, 2]
    w = torch.cat([torch.full((n,), 1.0 / (len(sizes) * n), dtype=torch.float64) for n in sizes])
    big = (w[None, :, None] * draws).sum(1).pow(2).sum(1)
    small = draws.pow(2).sum(2).mean(1)
    s = float(w.pow(2).sum())
    assert float(((big - s * small) / (1 - s)).mean()) == pytest.approx(true_g2, rel=0.02)
    assert float(((small - big) / (1 - s)).mean()) == pytest.approx(true_tr, rel=0.01)
    plain = float(((10 * big - small) / 9).mean())  # B_big = 10: what the monitor used to take
    assert abs(plain - true_g2) > 0.05 * true_g2

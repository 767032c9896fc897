"""The noise scale under DDP when the ranks' batches differ in size (a sampler of one's own with
``use_distributed_sampler=False``, or an epoch's short last batch on some ranks only).

Each rank's loss is a mean over its own examples and DDP averages the ranks' gradients, so the big-batch gradient
weighs an example of rank ``r`` by ``1 / (R n_r)``, and a rank's local gradient is a mean over ``n_r`` examples. A
gradient ``sum_i w_i g_i`` of i.i.d. examples (``sum_i w_i = 1``) has ``E|g_w|^2 = |G|^2 + tr(Sigma) sum_i w_i^2``: it
counts as the plain mean of ``1 / sum_i w_i^2`` examples. The oracle below takes every batch size from those weights
and every gradient from per-example autograd at the run's fixed weights (lr = 0), rank by rank and step by step;
``test_the_oracles_estimates_are_unbiased`` checks that these sizes make the estimators unbiased, and that each
rank's own batch size taken for every rank's does not (tr(Sigma) at 0.81 and 1.30 times its value on ranks of 5 and
8 examples).
"""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import fit_ddp_spawn
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientNoiseScaleMonitor

STEPS, WORLD = 6, 2
# each rank's batch size and examples: rank 0 batches of 5, rank 1 batches of 8 with a short last one of 3
SIZES = {1: ((5, 30), (8, 43)), 2: ((5, 60), (8, 91))}  # accumulate_grad_batches -> per rank (batch size, examples)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(200, 10, generator=g), torch.randint(0, 3, (200,), generator=g)


def _rank_rows(rank: int, accumulate: int) -> tuple[int, int]:
    """The first row of rank ``rank``'s examples in ``_data()`` and their number (rank 1 reads rows after rank 0's)."""
    (_, n0), (_, n1) = SIZES[accumulate]
    return (0, n0) if rank == 0 else (n0, n1)


class _Recording(GradientNoiseScaleMonitor):
    """Keeps what it logs at every step."""

    def log_metrics(self, trainer, metrics, step, loggers_only=()):
        host = super().log_metrics(trainer, metrics, step, loggers_only)
        self.logged = {**getattr(self, "logged", {}), step: dict(host)}
        return host


class _Net(pl.LightningModule):
    def __init__(self, reduction: str, accumulate: int, out: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
        self.reduction, self.accumulate, self.out = reduction, accumulate, out

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1], reduction=self.reduction)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the weights, hence the oracle, never move

    def train_dataloader(self):
        x, y = _data()
        start, n = _rank_rows(self.global_rank, self.accumulate)
        batch = SIZES[self.accumulate][self.global_rank][0]
        return DataLoader(TensorDataset(x[start:start + n], y[start:start + n]), batch_size=batch)

    def on_train_end(self) -> None:
        mon = next(c for c in self.trainer.callbacks if isinstance(c, _Recording))
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"method": mon.resolved_method, "logged": getattr(mon, "logged", {})}, fh)


def _per_example(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each example's own gradient (of its loss), one float64 row per example."""
    rows = []
    for i in range(len(x)):
        grads = torch.autograd.grad(F.cross_entropy(net(x[i:i + 1]), y[i:i + 1]), list(net.parameters()))
        rows.append(torch.cat([g.flatten() for g in grads]).double())
    return torch.stack(rows)


def _weights(sizes: list[int], reduction: str) -> torch.Tensor:
    """The weight of each example of a gradient over micro-batches of ``sizes`` (each loss a mean over its micro-batch
    and the micro-batches averaged; with summed losses, the plain mean of all of them)."""
    if reduction == "sum":
        return torch.full((sum(sizes),), 1.0 / sum(sizes), dtype=torch.float64)
    return torch.cat([torch.full((n,), 1.0 / (len(sizes) * n), dtype=torch.float64) for n in sizes])


def _mcc(small: float, big: float, b_small: float, b_big: float) -> tuple[float, float]:
    """McCandlish et al., Appendix A: ``(|G|^2, tr(Sigma))`` from gradients counting as ``b_small`` and ``b_big``
    examples."""
    return ((b_big * big - b_small * small) / (b_big - b_small), (small - big) / (1.0 / b_small - 1.0 / b_big))


def oracle(method: str, reduction: str, micro: list[list[torch.Tensor]]) -> list[dict[str, float]]:
    """Each rank's ``|G|^2`` and ``tr(Sigma)`` estimates of one step from ``micro[r][k]``, the per-example gradients
    of micro-batch ``k`` of rank ``r``."""
    ranks = []  # (rank's examples, weights of its local gradient)
    for parts in micro:
        ranks.append((torch.cat(parts), _weights([len(p) for p in parts], reduction)))
    if reduction == "sum":  # the mean over every rank's examples
        n = sum(len(w) for _, w in ranks)
        big_w = [torch.full_like(w, 1.0 / n) for _, w in ranks]
    else:  # DDP's mean of the ranks' gradients
        big_w = [w / len(ranks) for _, w in ranks]
    big = sum(w @ g for (g, _), w in zip(ranks, big_w))
    b_big = 1.0 / float(sum(w.pow(2).sum() for w in big_w))
    out = []
    for r, (g, w) in enumerate(ranks):
        if method == "ddp":  # the mean over the ranks of their local gradients' squared norms
            small = sum(float((wr @ gr).pow(2).sum()) for gr, wr in ranks) / len(ranks)
            b_small = 1.0 / (sum(float(wr.pow(2).sum()) for _, wr in ranks) / len(ranks))
        elif method == "per_example":  # this rank's examples' own gradients
            small, b_small = float(g.pow(2).sum(1).mean()), 1.0
        else:  # accumulation: this rank's micro-batches' mean gradients
            means = [p.mean(0) for p in micro[r]]
            small = sum(float(m.pow(2).sum()) for m in means) / len(means)
            b_small = 1.0 / (sum(1.0 / len(p) for p in micro[r]) / len(micro[r]))
        g2, tr = _mcc(small, float(big.pow(2).sum()), b_small, b_big)
        out.append({"g2": g2, "tr": tr, "batch": float(sum(len(p) for parts in micro for p in parts))})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method,reduction,accumulate", [
    ("ddp", "mean", 1), ("ddp", "mean", 2), ("ddp", "sum", 2), ("per_example", "mean", 2), ("accumulation", "mean", 2),
])
def test_uneven_ranks_ddp_estimates_match_per_example_autograd(tmp_path, method, reduction, accumulate) -> None:
    """Rank 0 trains on batches of 5, rank 1 on batches of 8 and, at the last step, of 3 (with accumulation: windows
    of 5 and 5 against 8 and 8, then 8 and 3). Every logged ``gns/g2`` and ``gns/trace_sigma`` (``smoothing=0``: the
    step's own estimate) is the oracle's, on each rank, and so is each layer's ``B_simple``; the ``"ddp"`` method's are
    the same on both ranks, and ``gns/batch_size`` counts the examples of both ranks."""
    mon = _Recording(method=method, every_n_steps=1, smoothing=0.0, loss_reduction=reduction)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp_spawn", max_steps=STEPS, logger=False,
                         accumulate_grad_batches=accumulate, use_distributed_sampler=False, callbacks=[mon],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    model = _Net(reduction, accumulate, str(tmp_path))
    fit_ddp_spawn(trainer, model)
    runs = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(WORLD)]
    assert [run["method"] for run in runs] == [method] * WORLD

    x, y = _data()
    per = []  # per rank, its examples' gradients in loader order
    for r in range(WORLD):
        start, n = _rank_rows(r, accumulate)
        per.append(_per_example(model.net, x[start:start + n], y[start:start + n]))
    columns = {"net.0": slice(0, 176), "net.2": slice(176, 227)}  # net.0: 16 x 10 + 16, net.2: 3 x 16 + 3
    for step in range(STEPS):
        micro = []
        for r in range(WORLD):
            batch = SIZES[accumulate][r][0]
            rows = per[r][step * accumulate * batch:(step + 1) * accumulate * batch]
            micro.append([rows[k:k + batch] for k in range(0, len(rows), batch)])
        want = oracle(method, reduction, micro)
        for r in range(WORLD):
            got = runs[r]["logged"][str(step)]
            assert got["gns/trace_sigma"] == pytest.approx(want[r]["tr"], rel=1e-4), (step, r)
            assert got["gns/g2"] == pytest.approx(want[r]["g2"], rel=1e-4, abs=1e-6), (step, r)
            assert got["gns/batch_size"] == want[r]["batch"], (step, r)
        for layer, cols in columns.items():
            want = oracle(method, reduction, [[p[:, cols] for p in parts] for parts in micro])
            for r in range(WORLD):
                got = runs[r]["logged"][str(step)].get(f"gns/{layer}/b_simple")
                if want[r]["g2"] > 0.01 * want[r]["tr"]:  # well defined (B_simple < 100): logged, the oracle's ratio
                    assert got == pytest.approx(want[r]["tr"] / want[r]["g2"], rel=1e-3), (step, r, layer)
                elif want[r]["g2"] < 0:
                    assert got is None, (step, r, layer)
        if method == "ddp":
            a, b = (runs[r]["logged"][str(step)] for r in range(WORLD))
            assert a["gns/trace_sigma"] == b["gns/trace_sigma"] and a["gns/g2"] == b["gns/g2"], step


def test_the_oracles_estimates_are_unbiased() -> None:
    """Per-example gradients drawn i.i.d. (mean G, covariance Sigma known), two ranks of 5 and 8 examples: averaged
    over many draws, the estimates with the oracle's batch sizes land on |G|^2 and tr(Sigma) for every method (and
    with an accumulation window of 8 and 3 on one rank); taking each rank's own size for every rank's does not."""
    gen = torch.Generator().manual_seed(0)
    draws, dim = 40_000, 4
    mean = torch.tensor([0.6, -0.3, 0.2, 0.1], dtype=torch.float64)
    scale = torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64)  # independent coordinates
    g2_true, tr_true = float(mean.pow(2).sum()), float(scale.pow(2).sum())
    for layout in ([[5], [8]], [[5, 5], [8, 3]]):
        micro = [[mean + scale * torch.randn(draws, k, dim, generator=gen, dtype=torch.float64) for k in rank]
                 for rank in layout]
        for method, reduction in (("ddp", "mean"), ("ddp", "sum"), ("per_example", "mean"), ("per_example", "sum"),
                                  ("accumulation", "mean")):
            for rank in range(2):  # the rank's own small batches for "per_example" and "accumulation"
                g2, tr = _vectorised(method, reduction, micro, rank=rank).mean(0).tolist()
                # standard errors of these means at this many draws: <= 0.05 on tr(Sigma) (7.5), <= 0.005 on |G|^2 (0.5)
                assert tr == pytest.approx(tr_true, rel=0.03), (layout, method, reduction, rank)
                assert g2 == pytest.approx(g2_true, abs=0.025), (layout, method, reduction, rank)
        if layout == [[5], [8]]:
            # one rank's size taken for every rank's (5 and 5, or 8 and 8): off on each rank, and apart
            trs = [float(_vectorised("ddp", "mean", micro, own=r)[:, 1].mean()) for r in range(2)]
            assert trs[0] == pytest.approx(tr_true * 5 / (80 / 13), rel=0.03)  # 0.81 tr(Sigma)
            assert trs[1] == pytest.approx(tr_true * 8 / (80 / 13), rel=0.03)  # 1.30 tr(Sigma)


def _vectorised(method: str, reduction: str, micro: list[list[torch.Tensor]], own: int | None = None,
                rank: int = 0) -> torch.Tensor:
    """The oracle's ``[|G|^2, tr(Sigma)]`` of rank ``rank`` on many draws at once (``micro[r][k]``: ``[draws, n_rk,
    dim]``); ``own``: the ``"ddp"`` method with rank ``own``'s batch size taken as every rank's."""
    ranks = []
    for parts in micro:
        sizes = [p.shape[1] for p in parts]
        w = _weights(sizes, reduction)
        ranks.append((torch.cat(parts, 1), w))
    if reduction == "sum":
        n = sum(len(w) for _, w in ranks)
        big_w = [torch.full_like(w, 1.0 / n) for _, w in ranks]
    else:
        big_w = [w / len(ranks) for _, w in ranks]
    big = sum(torch.einsum("dnk,n->dk", g, w) for (g, _), w in zip(ranks, big_w)).pow(2).sum(1)
    b_big = 1.0 / float(sum(w.pow(2).sum() for w in big_w))
    if own is not None:  # one rank's size for all: B_small = n_own, B_big = R n_own
        b_small, b_big = float(len(ranks[own][1])), float(len(ranks) * len(ranks[own][1]))
        small = sum(torch.einsum("dnk,n->dk", g, w).pow(2).sum(1) for g, w in ranks) / len(ranks)
    elif method == "ddp":
        small = sum(torch.einsum("dnk,n->dk", g, w).pow(2).sum(1) for g, w in ranks) / len(ranks)
        b_small = 1.0 / (sum(float(w.pow(2).sum()) for _, w in ranks) / len(ranks))
    elif method == "per_example":
        small, b_small = ranks[rank][0].pow(2).sum(2).mean(1), 1.0
    else:
        small = sum(p.mean(1).pow(2).sum(1) for p in micro[rank]) / len(micro[rank])
        b_small = 1.0 / (sum(1.0 / p.shape[1] for p in micro[rank]) / len(micro[rank]))
    g2 = (b_big * big - b_small * small) / (b_big - b_small)
    tr = (small - big) / (1.0 / b_small - 1.0 / b_big)
    return torch.stack([g2, tr], 1)

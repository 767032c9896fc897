"""Rows the loss gives no gradient are not scored by GWA. The scores' closed form reads the targets, not the loss's
weights: padding masked by multiplying the per-token losses with the mask (its tags a real class), or sample weights
of 0, were scored as if trained. On a token tagger the epoch's mean came out of the wrong sign (-0.0057 against 0.0099
over the trained tokens, 2048 rows scored of 1329). Each scored step now reads which rows of the head's output got a
gradient. The oracle: each row's head-weight gradient from autograd's own gradient of the logits, ``g_r z_r^T``."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientWeightAlignmentMonitor

V, C, T, N = 40, 5, 16, 128


class _Tagger(pl.LightningModule):
    """Tags every token; ``weighting``: ``"mask"`` multiplies the per-token losses by the padding mask, ``"samples"``
    weighs whole sequences (every fifth by 0). Records, per epoch, the cosine of each trained row's head gradient with
    the head's weight, from the logits' gradient as autograd computes it."""

    def __init__(self, weighting: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, 24)
        self.body = nn.Sequential(nn.Linear(24, 24), nn.Tanh())
        self.head = nn.Linear(24, C)
        self.weighting = weighting
        self.oracle: dict[int, list[float]] = {}

    def training_step(self, batch, batch_idx):
        ids, mask, tags, sample_w = batch
        z = self.body(self.emb(ids))
        logits = self.head(z)
        logits.retain_grad()
        self._kept = (z.detach(), logits)
        per = F.cross_entropy(logits.transpose(1, 2), tags, reduction="none")  # [B, T]
        w = mask.float() if self.weighting == "mask" else sample_w[:, None].expand_as(per)
        return (per * w).sum() / w.sum()

    def on_after_backward(self) -> None:
        z, logits = self._kept
        g = logits.grad.reshape(-1, C).double()
        zz = z.reshape(-1, z.shape[-1]).double()
        w = self.head.weight.detach().double()
        trained = g.abs().sum(-1) > 0
        wz = zz @ w.T
        cos = -(g * wz).sum(-1) / (g.norm(dim=-1) * zz.norm(dim=-1) * w.norm())
        self.oracle.setdefault(self.current_epoch, []).extend(cos[trained].tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, V, (N, T), generator=g)
    tags = ids % C
    lens = torch.randint(4, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None] < lens[:, None]).long()
    ids[mask == 0], tags[mask == 0] = 0, 0  # padding: class 0, a real class, weighed out by the loss
    sample_w = (torch.arange(N) % 5 != 0).float()
    return ids, mask, tags, sample_w


@pytest.mark.parametrize("weighting", ["mask", "samples"])
def test_rows_the_loss_does_not_weigh_are_not_scored(weighting, tmp_path):
    ids, mask, tags, sample_w = _data()
    pl.seed_everything(0, verbose=False)
    model = _Tagger(weighting)
    gwa = GradientWeightAlignmentMonitor(target_fn=lambda b: b[2], warmup_epochs=0, log_histograms=False)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[gwa])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(ids, mask, tags, sample_w), batch_size=16, shuffle=True))
    trained = int(mask.sum()) if weighting == "mask" else int(sample_w.sum()) * T
    assert [h["count"] for h in gwa.history] == [trained] * 3
    for h in gwa.history:
        want = torch.tensor(model.oracle[h["epoch"]], dtype=torch.float64)
        assert len(want) == trained
        assert h["mean"] == pytest.approx(float(want.mean()), rel=1e-5, abs=1e-8)
        centred = want - want.mean()
        kurtosis = float((centred**4).mean() / (centred**2).mean() ** 2 - 3)
        assert h["kurtosis"] == pytest.approx(kurtosis, rel=1e-4, abs=1e-5)
    (said,) = [a for a in gwa.hub.history if a.kind == "unweighted_rows"]
    assert said.value == N * T - trained


class _Confident(pl.LightningModule):
    """A two-class head whose logits are 150 apart on most rows (lr 0): their softmax saturates, and the fp32 gradient
    of each such row is exactly 0 though the loss weighs it. Such rows stay scored (the closed form is exact there)."""

    def __init__(self, mask_some: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 2)
        with torch.no_grad():
            self.head.weight.copy_(torch.tensor([[40.0, 0, 0, 0], [-40.0, 0, 0, 0]]))
            self.head.bias.zero_()
        self.mask_some = mask_some

    def training_step(self, batch, batch_idx):
        x, y = batch
        per = F.cross_entropy(self.head(x), y, reduction="none")
        w = (torch.arange(len(y)) % 4 != 0).float() if self.mask_some else torch.ones_like(per)
        return (per * w).sum() / w.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("mask_some", [False, True])
def test_rows_whose_softmax_saturated_stay_scored(mask_some, tmp_path):
    from lightning_monitor.functional import gwa_scores

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    x[:, 0] = x[:, 0].sign() * (2.0 + x[:, 0].abs())  # |logit gap| >= 160 on every row
    y = (x[:, 0] < 0).long()
    model = _Confident(mask_some)
    assert (torch.autograd.grad(F.cross_entropy(model.head(x), y, reduction="sum"), model.head.weight)[0] == 0).all()
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[gwa])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    with torch.no_grad():
        want = gwa_scores(x.double(), model.head(x).double(), y, model.head.weight.double())
    (h,) = gwa.history
    assert h["count"] == 64 and h["mean"] == pytest.approx(float(want.mean()), rel=1e-6)
    assert "unweighted_rows" not in {a.kind for a in gwa.hub.history}

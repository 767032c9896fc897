"""Layers behind LayerNorms are not classifier heads: a Linear whose output reaches the loss only through LayerNorms (a
post-LN transformer's residual branches) has output gradient rows summing to 0, as a softmax's do, and was taken for a
second head (a `several_heads` warning on healthy runs, and wrong heads tried in turn). A head trained on class
indices is told apart by its gradient's positive entries, which are the softmax's times the row's weight."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientWeightAlignmentMonitor
from lightning_monitor.alerts import read_alerts
from lightning_monitor.functional.gwa import softmax_proportionality


class PostLN(pl.LightningModule):
    """Two post-LN residual MLP blocks and a head whose logits the model slices (so no output counts as returned:
    every candidate with zero-sum rows is in one tier)."""

    def __init__(self, smoothing: float = 0.0) -> None:
        super().__init__()
        self.smoothing = smoothing
        self.emb = nn.Linear(8, 16)
        self.fc1, self.fc2, self.ln = nn.Linear(16, 32), nn.Linear(32, 16), nn.LayerNorm(16)
        self.fc3, self.fc4, self.ln2 = nn.Linear(16, 32), nn.Linear(32, 16), nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        h = self.emb(x)
        h = self.ln(h + self.fc2(F.gelu(self.fc1(h))))
        h = self.ln2(h + self.fc4(F.gelu(self.fc3(h))))
        return self.head(h)[:, 0]

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y, label_smoothing=self.smoothing)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), 1e-3)


def _fit(tmp_path, smoothing: float):
    torch.manual_seed(0)
    x = torch.randn(256, 4, 8)
    y = (x[:, 0, 0] > 0).long() + (x[:, 0, 1] > 0).long()
    gwa = GradientWeightAlignmentMonitor()
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=logger, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, callbacks=[gwa])
    trainer.fit(PostLN(smoothing), DataLoader(TensorDataset(x, y), batch_size=32))
    return gwa, read_alerts(os.path.join(logger.log_dir, "alerts.jsonl"))


def test_layers_behind_layernorms_are_not_heads(tmp_path) -> None:
    gwa, alerts = _fit(tmp_path, 0.0)
    assert gwa._head_name == "head"
    assert not [a for a in alerts if a.kind == "several_heads"]
    assert not gwa._other_heads  # no hidden layer queued to be tried as a head


def test_soft_targets_keep_the_zero_sum_rule(tmp_path) -> None:
    """Label smoothing: the head's positive entries are not the softmax's, so it cannot be told from the layers behind
    LayerNorms; the rule before stands (the one called last, with the warning naming the others)."""
    gwa, alerts = _fit(tmp_path, 0.1)
    assert gwa._head_name == "head"
    several = [a for a in alerts if a.kind == "several_heads"]
    assert len(several) == 1 and "`fc2`" in several[0].message and "`fc4`" in several[0].message


def test_softmax_proportionality_tells_class_indices_from_layernorm_gradients() -> None:
    torch.manual_seed(0)
    z = torch.randn(6, 5, requires_grad=True)
    F.cross_entropy(z, torch.randint(0, 5, (6,))).backward()
    d, p = softmax_proportionality(z.grad, z.detach()).tolist()
    assert p > 0 and d <= 1e-6 * p
    # a LayerNorm's input gradient: rows summing to 0, positive entries unrelated to a softmax
    h = torch.randn(6, 5, requires_grad=True)
    (F.layer_norm(h, (5,)) * torch.randn(6, 5)).sum().backward()
    assert float(h.grad.sum(-1).abs().max()) < 1e-5
    d, p = softmax_proportionality(h.grad, h.detach()).tolist()
    assert d > 0.1 * p
    # soft targets (label smoothing): rows summing to 0, not proportional
    w = torch.randn(6, 5, requires_grad=True)
    F.cross_entropy(w, torch.randint(0, 5, (6,)), label_smoothing=0.2).backward()
    d, p = softmax_proportionality(w.grad, w.detach()).tolist()
    assert d > 0.01 * p


class _Trajectories(pl.LightningModule):
    """A decision-transformer-like regression: returns, states and actions each embedded by a Linear, stacked and fed
    to a LayerNorm (so the three embeddings' output gradient rows sum to 0, as a softmax's do); batches are dicts with
    no class targets."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_r, self.embed_s, self.embed_a = nn.Linear(1, 16), nn.Linear(6, 16), nn.Linear(3, 16)
        self.ln = nn.LayerNorm(16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.predict = nn.Linear(16, 3)

    def forward(self, r, s, a):
        h = self.ln(torch.stack([self.embed_r(r), self.embed_s(s), self.embed_a(a)], 1))
        return self.predict((h + self.body(h)).mean(1))

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch["returns"], batch["states"], batch["actions"]), batch["actions"])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), 1e-3)


def _preset_fit(tmp_path, module, loader):
    from lightning_monitor import HealthMonitor

    hm = HealthMonitor(spectral=False, noise_scale=False, guard=False)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    pl.Trainer(accelerator="cpu", max_epochs=2, logger=logger, enable_progress_bar=False, enable_checkpointing=False,
               enable_model_summary=False, callbacks=[hm]).fit(module, loader)
    return hm, read_alerts(os.path.join(logger.log_dir, "alerts.jsonl"))


def test_a_regression_behind_a_layernorm_gets_one_warning(tmp_path) -> None:
    """Under the preset a regression goes idle with one warning; its input embeddings, which feed a LayerNorm, were
    first named as three classifier heads (`several_heads`)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    rows = [{"returns": torch.randn(1, generator=g), "states": torch.randn(6, generator=g),
             "actions": torch.randn(3, generator=g)} for _ in range(128)]
    hm, alerts = _preset_fit(tmp_path, _Trajectories(), DataLoader(rows, batch_size=16))
    assert [a.kind for a in alerts if a.monitor == "gwa"] == ["nothing_to_watch"]
    assert hm.gwa.idle_reason is not None


def test_several_heads_is_said_under_the_preset_once_the_targets_fit(tmp_path) -> None:
    """Label smoothing on a post-LN model: the head and the layers behind LayerNorms all qualify; the warning waits for
    the first scored batch's targets, and they fit, so it is said (once)."""

    class Smoothed(PostLN):
        def __init__(self) -> None:
            super().__init__(0.1)

    torch.manual_seed(0)
    x = torch.randn(256, 4, 8)
    y = (x[:, 0, 0] > 0).long() + (x[:, 0, 1] > 0).long()
    hm, alerts = _preset_fit(tmp_path, Smoothed(), DataLoader(TensorDataset(x, y), batch_size=32))
    several = [a for a in alerts if a.kind == "several_heads"]
    assert len(several) == 1 and "`fc2`" in several[0].message and hm.gwa.idle_reason is None

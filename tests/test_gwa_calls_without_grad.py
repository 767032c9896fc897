"""The head called without autograd in the step (FixMatch's pseudo-labels made under `no_grad` on an unlabelled batch,
before the trained call; the first pass of a reentrant checkpoint): that call trains nothing and is not the one scored.
Before, GWA paired its logits with the labelled batch's targets: the epoch's mean came out negative where the trained
call's was positive (no alert), an unlabelled batch of another size ended the fit, and under a reentrant checkpoint a
false `no_softmax_head` warning was raised. Checked against an oracle computed from the trained call by hand."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientWeightAlignmentMonitor

D, C = 16, 4


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(192, 10, generator=g)
    y = (x[:, :2].sum(1) > 0).long() + 2 * (x[:, 2] > 0).long()
    return x, y, torch.randn(400, 10, generator=g)


class _SemiSupervised(pl.LightningModule):
    """A classifier; ``variant``: "fixmatch" (pseudo-labels from a `no_grad` call on ``mu`` times the batch first, then
    the trained call, then a consistency call), "reentrant" (the head run in a reentrant checkpoint)."""

    def __init__(self, variant: str, mu: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(10, D), nn.Tanh())
        self.head = nn.Linear(D, C)
        self.variant, self.mu, self.record, self.tag = variant, mu, [], False
        self.unlabelled = _data()[2]
        self.head.register_forward_hook(self._keep)

    def _keep(self, module, inputs, output):
        # the trained call: its features, logits and weights, by hand (in a reentrant checkpoint, its first pass,
        # without autograd: the same values as the recomputation in the backward)
        if self.tag and (torch.is_grad_enabled() or self.variant == "reentrant"):
            self.record.append((self.current_epoch, inputs[0].detach().clone(), output.detach().clone(),
                                module.weight.detach().clone()))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.variant == "reentrant":
            self.tag = True
            out = checkpoint(self.head, self.features(x), use_reentrant=True)
            self.tag = False
            self.record[-1] += (y,)
            return F.cross_entropy(out, y)
        u = self.unlabelled[torch.randint(0, len(self.unlabelled), (self.mu * len(x),))]
        with torch.no_grad():
            pseudo = self.head(self.features(u)).argmax(-1)
        self.tag = True
        out = self.head(self.features(x))
        self.tag = False
        self.record[-1] += (y,)
        consistency = F.cross_entropy(self.head(self.features(u + 0.3 * torch.randn_like(u))), pseudo)
        return F.cross_entropy(out, y) + 0.5 * consistency

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _oracle(record) -> dict[int, float]:
    """Per epoch, the mean of gamma_i = cos(-(p_i - y_i) z_i^T, W) over the trained calls' samples."""
    out: dict[int, list[torch.Tensor]] = {}
    for epoch, z, logits, w, y in record:
        d = logits.softmax(-1) - F.one_hot(y, C).float()
        out.setdefault(epoch, []).append((-(d * (z @ w.T)).sum(1) / (d.norm(dim=1) * z.norm(dim=1) * w.norm())).double())
    return {e: float(torch.cat(v).mean()) for e, v in out.items()}


@pytest.mark.parametrize("variant,mu", [("fixmatch", 1), ("fixmatch", 2), ("reentrant", 1)])
def test_the_trained_call_is_scored(tmp_path, variant: str, mu: int) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    x, y, _ = _data()
    module, gwa = _SemiSupervised(variant, mu), GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    pl.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[gwa], default_root_dir=str(tmp_path)).fit(
        module, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    expected = _oracle(module.record)
    assert [h["epoch"] for h in gwa.history] == [0, 1, 2]
    for h in gwa.history:
        assert h["mean"] == pytest.approx(expected[h["epoch"]], abs=1e-5)
        assert h["count"] == 192
    assert expected[2] > 0  # the trained call aligns: the unlabelled call's were negative
    assert not [a.kind for a in gwa.hub.history if a.severity != "info"]

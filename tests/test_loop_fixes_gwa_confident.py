"""GWA's test of a softmax head (its output's gradient rows sum to 0) on a confident classifier: the rows of a
well-fit model are mostly the rounding of ``p - 1``, so a fit resumed from one was told its head is not a softmax's."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientWeightAlignmentMonitor
from lightning_monitor.functional.gwa import softmax_gradient_evidence

EPS = torch.finfo(torch.float32).eps


def _clusters(n: int = 256):
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 16, generator=g) * 2
    y = torch.randint(0, 4, (n,), generator=g)
    return DataLoader(TensorDataset(centers[y] + torch.randn(n, 16, generator=g), y), batch_size=16)


class _Clf(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _trainer(tmp_path, callbacks, max_epochs):
    return pl.Trainer(max_epochs=max_epochs, accelerator="cpu", logger=False, callbacks=callbacks,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))


def test_a_fit_resumed_from_a_confident_classifier_finds_its_softmax_head_silently(tmp_path):
    loader = _clusters()
    saved = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    _trainer(tmp_path, [saved], max_epochs=2).fit(_Clf(), loader)
    ckpt = str(tmp_path / "ck" / "epoch=1.ckpt")
    # the premise: the first batch's logit gradient, as the watched step sees it, has row sums over 1e-3 of its size
    fit = _Clf()
    fit.load_state_dict(torch.load(ckpt, weights_only=False)["state_dict"])
    x, y = next(iter(loader))
    z = fit.net(x).detach().requires_grad_()
    F.cross_entropy(z, y).backward()
    assert z.grad.sum(-1).abs().sum() > 1e-2 * z.grad.abs().sum()

    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    _trainer(tmp_path, [gwa], max_epochs=4).fit(_Clf(), loader, ckpt_path=ckpt)
    assert [a.kind for a in gwa.hub.history if a.kind == "no_softmax_head"] == []
    assert gwa._head_name == "net.4" and gwa.idle_reason is None and len(gwa.history) == 2


def test_confident_rows_are_not_judged_and_other_outputs_still_fail():
    torch.manual_seed(0)
    y = torch.randint(0, 10, (64,))
    # every row confident: p one-hot to within 1e-5 .. 1e-9, the rounding of p - 1 a large share of the row
    z = (torch.randn(64, 10) + F.one_hot(y, 10) * torch.empty(64, 1).uniform_(14.0, 22.0)).requires_grad_()
    F.cross_entropy(z, y).backward()
    a, j, r, t = softmax_gradient_evidence(z.grad, z.detach(), EPS).tolist()
    assert t > 0 and a <= 1e-3 * j + r
    assert z.grad.sum(-1).abs().sum() > 1e-3 * z.grad.abs().sum()  # the old test (a relative bound) failed it
    # an undecided softmax (every row one-hot): nothing judged
    w = (torch.tensor([[80.0, 0.0, 0.0]]).repeat(8, 1)).requires_grad_()
    F.cross_entropy(w, torch.zeros(8, dtype=torch.long)).backward()
    assert softmax_gradient_evidence(w.grad, w.detach(), EPS)[1] == 0
    # a sigmoid (binary cross-entropy) head and a hidden layer's output are judged, and are no softmax's
    h = torch.randn(64, 10).requires_grad_()
    F.binary_cross_entropy_with_logits(h, torch.rand(64, 10).round()).backward()
    a, j, r, _ = softmax_gradient_evidence(h.grad, h.detach(), EPS).tolist()
    assert j > 0 and a > 1e-3 * j + r
    hidden = torch.randn(64, 32).requires_grad_()
    (torch.relu(hidden) @ torch.randn(32, 4)).pow(2).mean().backward()
    a, j, r, _ = softmax_gradient_evidence(hidden.grad, hidden.detach(), EPS).tolist()
    assert j > 0 and a > 1e-3 * j + r

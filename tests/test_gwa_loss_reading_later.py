"""The reading of the loss GWA takes from the head's output gradient at its first check (a logit scale, a label
smoothing, the targets as given) is taken near the random init's uniform softmax, where some losses cannot be told
apart: ``cross_entropy(logits / 2, y, label_smoothing=0.1)`` read as one logit scale of 0.556 (neither 0.5 nor the
smoothing), mixup's soft targets smoothed again by the loss read as the targets given, and the scores followed that reading all run with no
word (194 of 960 per-sample scores of the wrong sign against each sample's own gradient). The reading is checked again
at the first due step of each later epoch, where the softmax has sharpened: a reading that no longer fits turns the
scores to each row's own output gradient from then on (``scores_from_gradient``), and the epochs after it match
autograd's per-row gradients. A class target of -1 in the first scored batch (a loss with ``ignore_index=-1``) stopped the fit;
it is left unscored and said, as in any later batch."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientWeightAlignmentMonitor

LOSSES = {
    "temperature": lambda o, y: F.cross_entropy(o / 2, y),
    "smoothing": lambda o, y: F.cross_entropy(o, y, label_smoothing=0.1),
    "temperature and smoothing": lambda o, y: F.cross_entropy(o / 2, y, label_smoothing=0.1),
    "soft targets": lambda o, y: F.cross_entropy(o, y),
    "soft targets smoothed": lambda o, y: F.cross_entropy(o, y, label_smoothing=0.1),
    "ignore -1": lambda o, y: F.cross_entropy(o, y, ignore_index=-1),
    # class weights with label smoothing: no reading explains it (the smoothing's share is weighted per class); the
    # scores were 3-77% off in an epoch's mean, with no word
    "class weights and smoothing": lambda o, y: F.cross_entropy(o, y, weight=torch.linspace(0.5, 1.5, 5),
                                                                label_smoothing=0.1),
}


class _Clf(pl.LightningModule):
    def __init__(self, loss: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 5)
        self.loss = LOSSES[loss]

        self.oracle: dict[int, list[float]] = {}

    def training_step(self, batch, batch_idx):
        z = self.body(batch[0])
        logits = self.head(z)
        logits.retain_grad()
        self._kept = (z.detach(), logits)
        return self.loss(logits, batch[1])

    def on_after_backward(self) -> None:  # each row's cos(-g z^T, W), g autograd's gradient of the logits' row
        z, logits = self._kept
        g, zz, w = logits.grad.double(), z.double(), self.head.weight.detach().double()
        cos = -(g * (zz @ w.T)).sum(-1) / (g.norm(dim=-1) * zz.norm(dim=-1) * w.norm())
        self.oracle.setdefault(self.current_epoch, []).extend(cos.tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def _data(ignored: bool = False, soft: bool = False):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(96, 10, generator=g), torch.randn(10, 5, generator=g)
    y = (x @ w + 0.5 * torch.randn(96, 5, generator=g)).argmax(-1)
    if ignored:
        y[::7] = -1  # the first batch holds some
    if soft:  # mixup's targets, in the batch: each sample's label mixed with another's at 0.7 / 0.3
        onehot = F.one_hot(y, 5).float()
        y = 0.7 * onehot + 0.3 * onehot.roll(1, 0)
    return x, y


def _fit(tmp_path, loss: str, ignored: bool = False, epochs: int = 10):
    gwa = GradientWeightAlignmentMonitor(every_n_steps=1, log_histograms=False)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, logger=False, callbacks=[gwa], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    model = _Clf(loss)
    trainer.fit(model, DataLoader(TensorDataset(*_data(ignored, soft=loss.startswith("soft"))), batch_size=16))
    gwa.model = model
    return gwa


@pytest.mark.parametrize("loss, said", [("temperature", False), ("smoothing", False), ("soft targets", False),
                                        ("temperature and smoothing", True), ("soft targets smoothed", True),
                                        ("class weights and smoothing", True)])
def test_a_reading_that_stops_fitting_the_loss_is_said(tmp_path, loss, said):
    gwa = _fit(tmp_path, loss)
    switched = [a for a in gwa.hub.history if a.kind == "scores_from_gradient"]
    assert not [a for a in gwa.hub.history if a.kind == "inexact_scores"]
    if said:  # at the first check where its misfit is already above the rounding, else at a later epoch's
        assert len(switched) == 1
        assert switched[0].step == 1 or (switched[0].step > 6 and "taken at step" in switched[0].message)
        if switched[0].step > 1:  # the epochs scored before were read with the reading that stopped fitting: said
            assert re.search(r"epochs scored before step \d+ were read with it", switched[0].message)
    else:  # each reading alone is exact: the closed form all run
        assert not switched
    # the last epoch (read from the gradient where the reading stopped fitting) against autograd's per-row gradients
    last = gwa.history[-1]
    want = torch.tensor(gwa.model.oracle[last["epoch"]], dtype=torch.float64)
    assert last["count"] == len(want)
    assert last["mean"] == pytest.approx(float(want.mean()), rel=1e-4, abs=1e-7)
    assert last["negative"] == float((want < 0).sum())


def test_a_target_of_minus_one_in_the_first_batch_is_left_unscored_and_said(tmp_path):
    gwa = _fit(tmp_path, "ignore -1", ignored=True, epochs=2)
    assert gwa.idle_reason is None
    out = [a for a in gwa.hub.history if a.kind == "targets_out_of_range"]
    assert len(out) == 1 and out[0].value == 14.0  # 96 / 7, rounded up
    assert [h["count"] for h in gwa.history] == [82, 82]

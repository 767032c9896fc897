"""The reading of the loss GWA takes from the head's output gradient at its first check (a logit scale, a label
smoothing, the targets as given) is taken near the random init's uniform softmax, where some losses cannot be told
apart: ``cross_entropy(logits / 2, y, label_smoothing=0.1)`` read as one logit scale of 0.556 (neither 0.5 nor the
smoothing), mixup's soft targets smoothed again by the loss read as the targets given, and the scores followed that reading all run with no
word (194 of 960 per-sample scores of the wrong sign against each sample's own gradient). The reading is checked again
at the first due step of each later epoch, where the softmax has sharpened: a reading that no longer fits is said
(``inexact_scores``). A class target of -1 in the first scored batch (a loss with ``ignore_index=-1``) stopped the fit;
it is left unscored and said, as in any later batch."""

from __future__ import annotations

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
}


class _Clf(pl.LightningModule):
    def __init__(self, loss: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 5)
        self.loss = LOSSES[loss]

    def training_step(self, batch, batch_idx):
        return self.loss(self.head(self.body(batch[0])), batch[1])

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
    trainer.fit(_Clf(loss), DataLoader(TensorDataset(*_data(ignored, soft=loss.startswith("soft"))), batch_size=16))
    return gwa


@pytest.mark.parametrize("loss, said", [("temperature", False), ("smoothing", False), ("soft targets", False),
                                        ("temperature and smoothing", True), ("soft targets smoothed", True)])
def test_a_reading_that_stops_fitting_the_loss_is_said(tmp_path, loss, said):
    gwa = _fit(tmp_path, loss)
    inexact = [a for a in gwa.hub.history if a.kind == "inexact_scores"]
    if not said:  # each reading alone is exact: nothing to say
        assert not inexact
        return
    assert len(inexact) == 1 and inexact[0].step > 6 and "read at step" in inexact[0].message
    assert inexact[0].value > 0.1


def test_a_target_of_minus_one_in_the_first_batch_is_left_unscored_and_said(tmp_path):
    gwa = _fit(tmp_path, "ignore -1", ignored=True, epochs=2)
    assert gwa.idle_reason is None
    out = [a for a in gwa.hub.history if a.kind == "targets_out_of_range"]
    assert len(out) == 1 and out[0].value == 14.0  # 96 / 7, rounded up
    assert [h["count"] for h in gwa.history] == [82, 82]

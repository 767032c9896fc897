"""A classifier head run on some of a batch's rows only (``head(h[y >= 0])``: the rows with a label), where the first
batches happen to have every label: a later batch's logits have fewer rows than its targets. GWA cannot pair them and
leaves that batch unscored (said once, ``rows_unpaired``); before, the ValueError escaped the head's forward hook and
ended a healthy fit at the first such batch (`HealthMonitor()`, steps 28-42 with 0.3% of labels missing)."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientWeightAlignmentMonitor, HealthMonitor


def _data(missing: float, first_complete: bool = True) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    centers = 1.2 * torch.randn(10, 32, generator=g)
    y = torch.randint(0, 10, (1024,), generator=g)
    x = centers[y] + 1.3 * torch.randn(1024, 32, generator=g)
    y[torch.rand(1024, generator=g) < missing] = -1
    if first_complete:
        y[:64] = y[:64].clamp(min=0)  # the first batches have every label
    else:
        y[3] = -1  # the first batch misses one
    return TensorDataset(x, y)


class _LabelledRows(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        keep = y >= 0
        return F.cross_entropy(self.head(self.trunk(x)[keep]), y[keep])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(tmp_path, callback, missing: float = 0.03, first_complete: bool = True) -> pl.Trainer:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    trainer = pl.Trainer(max_epochs=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                         default_root_dir=str(tmp_path))
    trainer.fit(_LabelledRows(), DataLoader(_data(missing, first_complete), batch_size=32, shuffle=False))
    return trainer


@pytest.mark.parametrize("first_complete", [True, False], ids=["later batch", "first batch"])
@pytest.mark.parametrize("preset", [True, False], ids=["HealthMonitor()", "GWA monitor alone"])
def test_a_batch_whose_head_ran_on_some_rows_is_left_unscored(tmp_path, preset: bool, first_complete: bool) -> None:
    """In the first batch scored too: there the error ended the fit (the monitor alone) or left the preset idle for the
    whole run with a false reason ("the targets do not fit a softmax classifier")."""
    callback = HealthMonitor() if preset else GradientWeightAlignmentMonitor(every_n_steps=1)
    trainer = _fit(tmp_path, callback, first_complete=first_complete)
    assert trainer.global_step == 4 * 32  # the fit ran to its end
    gwa = next(m for m in callback.monitors if isinstance(m, GradientWeightAlignmentMonitor)) if preset else callback
    said = [a for a in gwa.hub.history if a.kind == "rows_unpaired"]
    assert len(said) == 1 and said[0].severity == "warning"
    assert re.search(r"`head` produced (2\d|3[01]) logits rows for 32 targets at step \d+: it ran on some", said[0].message)
    assert (said[0].step > 0) == first_complete and gwa.idle_reason is None
    assert [h["epoch"] for h in gwa.history] == [0, 1, 2, 3] and all(h["count"] > 0 for h in gwa.history)


def test_the_first_batch_not_fitting_still_raises_on_the_monitor_alone(tmp_path) -> None:
    """A `target_fn` or `head` that does not fit the model shows on the first scored batch: the monitor configured by
    hand says so at once, as before."""

    class _Doubled(_LabelledRows):  # the head's rows are not the batch's: twice as many logits as targets
        def training_step(self, batch, batch_idx):
            x, y = batch
            h = self.trunk(x)
            return F.cross_entropy(self.head(torch.cat([h, h])), torch.cat([y, y]))

    torch.set_num_threads(1)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[GradientWeightAlignmentMonitor(every_n_steps=1)], default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match="one target per logits row"):
        trainer.fit(_Doubled(), DataLoader(_data(0.0), batch_size=32))

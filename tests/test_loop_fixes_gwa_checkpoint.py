"""`ModelCheckpoint(monitor="gwa/selection")` with validation inside the epochs (`val_check_interval=0.5`): GWA sets
the key at each epoch's end, so a checkpoint saved after each validation raised at the first one, also with
`warmup_epochs=0`, without the monitor's warning. The monitor now says what works (`save_on_train_epoch_end=True`),
and that configuration keeps the checkpoint of the GWA-best epoch's end."""

from __future__ import annotations

import csv
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientWeightAlignmentMonitor


def _loader(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)) * 1.5
    y = torch.randint(0, 4, (n,), generator=g)
    y_noisy = torch.where(torch.rand(n, generator=g) < 0.2, torch.randint(0, 4, (n,), generator=g), y)
    return DataLoader(TensorDataset(centers[y] + torch.randn(n, 16, generator=g), y_noisy), batch_size=16)


class _Clf(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(tmp_path, gwa, checkpoint, max_epochs=3):
    trainer = pl.Trainer(max_epochs=max_epochs, accelerator="cpu", logger=CSVLogger(str(tmp_path), name="csv"),
                         callbacks=[gwa, checkpoint], val_check_interval=0.5, num_sanity_val_steps=0,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(_Clf(), _loader(256, 0), _loader(64, 1))
    return trainer


@pytest.mark.parametrize("kwargs", [{"warmup_epochs": 0}, {"warmup_epochs": 0, "mask_warmup": False}])
def test_a_checkpoint_saved_after_each_validation_inside_the_epochs_is_warned_about(tmp_path, kwargs):
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor="gwa/selection", mode="max")
    with pytest.warns(UserWarning, match=r"save_on_train_epoch_end=True\)`: it then saves the weights at each "
                                         r"epoch's end"), pytest.raises(MisconfigurationException, match="gwa/selection"):
        _fit(tmp_path, GradientWeightAlignmentMonitor(**kwargs), checkpoint)


def test_saved_at_each_epochs_end_it_keeps_the_gwa_best_epoch(tmp_path, recwarn):
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor="gwa/selection", mode="max", save_top_k=-1,
                                 filename="{epoch}-{step}", save_on_train_epoch_end=True)
    trainer = _fit(tmp_path, gwa, checkpoint)
    assert not [w for w in recwarn if "save_on_train_epoch_end" in str(w.message)]
    assert trainer.global_step == 48
    # one checkpoint per epoch, at its end (step 16, 32, 48), not after the validations in the middle
    assert sorted(os.listdir(tmp_path / "ck")) == ["epoch=0-step=16.ckpt", "epoch=1-step=32.ckpt", "epoch=2-step=48.ckpt"]
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as fh:
        logged = [(int(r["step"]), float(r["gwa/score"])) for r in csv.DictReader(fh) if r.get("gwa/score")]
    assert [s for s, _ in logged] == [16, 32, 48]  # each epoch's score, at its last step
    best_step = max(logged, key=lambda ss: ss[1])[0]
    assert best_step == 16 * (gwa.best_epoch + 1)
    assert os.path.basename(checkpoint.best_model_path) == f"epoch={gwa.best_epoch}-step={best_step}.ckpt"

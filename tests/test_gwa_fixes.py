"""GWA in two setups the preset meets: epochs of fewer optimizer steps than its cadence (each epoch must have a scored
step), and a classifier head re-made in ``configure_model`` (the monitors select the modules that run)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_monitor as lm


class _Classifier(LightningModule):
    """An MLP classifier of 4 classes; ``remake_head``: the head is a placeholder of 10 classes, re-made for the task's
    4 in ``configure_model`` (after the callbacks' setup)."""

    def __init__(self, remake_head: bool = False) -> None:
        super().__init__()
        self.remake_head = remake_head
        self.body = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 10 if remake_head else 4)

    def configure_model(self) -> None:
        if self.remake_head and self.head.out_features != 4:
            self.head = nn.Linear(32, 4)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.head(self.body(batch[0])), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    centres = 2 * torch.randn(4, 20, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    return TensorDataset(centres[y] + torch.randn(n, 20, generator=g), y)


def _fit(tmp_path, callbacks, model, loader, **kwargs) -> tuple[Trainer, list[str]]:
    torch.manual_seed(0)  # the loader's shuffle (the model is made after its test seeds the run)
    trainer = Trainer(accelerator="cpu", logger=False, callbacks=callbacks, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path), **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader)
    return trainer, [str(w.message) for w in caught]


def test_preset_gwa_scores_every_epoch_of_fewer_steps_than_its_cadence(tmp_path) -> None:
    """1600 samples an epoch in 16 batches of 100, 4 accumulated: 4 optimizer steps. ``min_epoch_samples=256`` kept
    every 6th step (1600 // 256), so two epochs in three had a due step and epochs 2 and 5 scored nothing ("GWA
    skipped for this epoch"); the cadence is at most an epoch's steps, and every epoch is scored from one step."""
    torch.manual_seed(0)  # the model's initial weights: whatever ran before in this process
    hm = lm.HealthMonitor(spectral=False, noise_scale=False, guard=False, gwa=dict(warmup_epochs=0))
    loader = DataLoader(_data(1600), batch_size=100)
    trainer, said = _fit(tmp_path, [hm], _Classifier(), loader, max_epochs=6, accumulate_grad_batches=4)
    assert trainer.global_step == 24
    assert not [m for m in said if "GWA skipped for this epoch" in m]
    assert hm.gwa.every_n_steps == 4
    assert [h["epoch"] for h in hm.gwa.history] == list(range(6))
    assert all(h["count"] == 400 and h["score"] is not None for h in hm.gwa.history)  # one step of 4 x 100 an epoch
    cadence = [a for a in hm.gwa.hub.history if a.kind == "cadence"]
    assert len(cadence) == 1 and "only 4 steps" in cadence[0].message and cadence[0].value == 4.0


def test_an_epoch_whose_last_accumulation_window_is_short_counts_its_last_step(tmp_path) -> None:
    """17 batches of 100 an epoch, 4 accumulated: Lightning steps at the epoch's last batch too, 5 steps. The cadence
    was set from 4 steps of 400 samples (1600 an epoch, said so); every epoch's 1700 samples are scored at the
    epoch's 5 steps apart."""
    torch.manual_seed(0)  # the model's initial weights: whatever ran before in this process
    hm = lm.HealthMonitor(spectral=False, noise_scale=False, guard=False, gwa=dict(warmup_epochs=0))
    loader = DataLoader(_data(1700), batch_size=100)
    trainer, _ = _fit(tmp_path, [hm], _Classifier(), loader, max_epochs=3, accumulate_grad_batches=4)
    assert trainer.global_step == 15
    assert hm.gwa.every_n_steps == 5
    cadence = [a for a in hm.gwa.hub.history if a.kind == "cadence"]
    assert len(cadence) == 1 and "An epoch holds about 1700 samples (5 steps)" in cadence[0].message
    assert [h["epoch"] for h in hm.gwa.history] == [0, 1, 2]


def test_preset_watches_a_head_remade_in_configure_model(tmp_path) -> None:
    """The head made in ``__init__`` and replaced in ``configure_model``: GWA held the placeholder it found at setup,
    which never ran, took the hidden `body.2` for the head and went idle for the run ("points at another class than
    the targets"). The monitors select again at the start of the fit and watch the modules that run."""
    torch.manual_seed(0)  # the model's initial weights: whatever ran before in this process
    hm = lm.HealthMonitor(gwa=dict(warmup_epochs=0), spectral=dict(every_n_steps=4), noise_scale=dict(every_n_steps=4))
    model = _Classifier(remake_head=True)
    loader = DataLoader(_data(256), batch_size=32, shuffle=True)
    _, said = _fit(tmp_path, [hm], model, loader, max_epochs=3)
    assert model.head.out_features == 4
    assert hm.gwa.idle_reason is None and hm.gwa._head_name == "head" and hm.gwa._head is model.head
    assert not [a for a in hm.gwa.hub.history if a.kind in ("no_softmax_head", "nothing_to_watch")]
    assert len(hm.gwa.history) == 3 and all(h["score"] is not None for h in hm.gwa.history)
    # every monitor watches the model's modules as they are after configure_model
    assert all(layer is model.get_submodule(name) for name, layer in hm.spectral.layers.items())
    assert all(m.idle_reason is None for m in hm.monitors)


def test_gwa_does_not_warn_of_no_softmax_head_from_an_overflowed_fp16_step(tmp_path) -> None:
    """fp16 under a loss scaler whose scale (2**24, as a resumed run restores a grown one) overflows the first steps'
    output gradients: their inf/NaN rows failed the softmax test, and a plain classifier was warned to have no softmax
    head (``no_softmax_head``). The head is chosen as without the test, and the epochs are scored."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    torch.manual_seed(0)  # the model's initial weights: whatever ran before in this process
    gwa = lm.GradientWeightAlignmentMonitor(warmup_epochs=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    loader = DataLoader(_data(256), batch_size=32, shuffle=True)
    _, said = _fit(tmp_path, [gwa], _Classifier(), loader, max_epochs=2,
                   plugins=[MixedPrecision("16-mixed", device="cpu", scaler=scaler)])
    assert scaler.get_scale() < 2.0**24  # the scaler did skip overflowed steps
    assert not [a for a in gwa.hub.history if a.kind == "no_softmax_head"]
    assert gwa.idle_reason is None and gwa._head_name == "head"
    assert len(gwa.history) == 2 and all(h["score"] is not None for h in gwa.history)


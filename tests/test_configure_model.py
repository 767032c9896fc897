"""A model whose layers are built in ``LightningModule.configure_model``, which Lightning calls after the callbacks'
``setup``: the monitors select what to watch once it exists (every monitor said it had nothing to watch, and stayed
idle for the whole fit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tb_scalars
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

import lightning_monitor as lm


class _Built(LightningModule):
    """Blocks of Linear layers and a classifier, made in ``configure_model`` (once); ``classes=0``: a regression."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.classes = classes
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is None:
            blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])
            self.net = nn.ModuleDict({"blocks": blocks, "head": nn.Linear(8, max(self.classes, 1))})

    def training_step(self, batch, batch_idx):
        x, y = batch
        for block in self.net["blocks"]:
            x = x + block(x)
        out = self.net["head"](x)
        return F.cross_entropy(out, y) if self.classes else F.mse_loss(out.squeeze(1), y.float())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].argmax(1)), batch_size=32)


def _fit(tmp_path, callbacks, model, steps=24) -> Trainer:
    trainer = Trainer(accelerator="cpu", max_steps=steps, callbacks=callbacks, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1,
                      logger=TensorBoardLogger(str(tmp_path), name="run", version=""))
    trainer.fit(model, _loader())
    return trainer


def test_preset_watches_a_model_built_in_configure_model(tmp_path) -> None:
    hm = lm.HealthMonitor(grades=dict(grace_steps=4, every_n_steps=2, stop=False),
                          spectral=dict(every_n_steps=4), noise_scale=dict(every_n_steps=4))
    trainer = _fit(tmp_path, [hm], _Built())
    monitors = {m.name: m for m in hm.monitors}
    assert {name: m.idle_reason for name, m in monitors.items()} == dict.fromkeys(monitors)
    assert not [a for a in hm.guard.hub.history if a.kind == "nothing_to_watch"]
    assert len(hm.grades._components) == 2 and hm.gwa._head_name == "net.head"
    scalars = tb_scalars(str(tmp_path / "run"))
    assert any(tag.startswith("sa/") for tag in scalars) and "gns/b_simple" in scalars and "gwa/score" in scalars
    assert trainer.global_step == 24


def test_monitor_alone_selects_at_the_start_of_the_fit_and_still_says_what_it_cannot_watch(tmp_path) -> None:
    """A monitor passed alone selects in its own ``on_fit_start``; a model that, once built, offers it nothing (GWA
    on a regression) is still said to have nothing to watch, once."""
    sa = lm.SpectralAlignmentMonitor(every_n_steps=4)
    gwa = lm.GradientWeightAlignmentMonitor()
    gwa.idle_when_nothing_to_watch = True
    _fit(tmp_path, [sa, gwa], _Built(classes=0), steps=8)
    assert sa.idle_reason is None
    assert [step for step, _ in tb_scalars(str(tmp_path / "run"))["sa/sign_diversity_mean"]] == [0, 4]
    assert gwa.idle_reason is not None
    assert [a.kind for a in gwa.hub.history if a.monitor == "gwa"].count("nothing_to_watch") == 1


def test_a_model_with_no_configure_model_still_fails_at_setup() -> None:
    """Without a ``configure_model`` nothing is built later: a monitor given nothing to watch says so at setup."""

    class Empty(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

        def training_step(self, batch, batch_idx):
            return (self.scale * batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(lm.NothingToWatch, match="nn.Linear"):
        Trainer(accelerator="cpu", max_steps=1, callbacks=[lm.SpectralAlignmentMonitor()], logger=False,
                enable_progress_bar=False).fit(Empty(), _loader())

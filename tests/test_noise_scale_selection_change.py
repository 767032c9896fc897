"""The noise scale's averages when a layer's measured parameters change mid-run: the docs promise that the averages
start again, model-wide and for each layer whose parameters changed. A layer replaced under the same name (a hidden
layer widened) kept the names, so nothing restarted; a layer with one parameter frozen restarted the model-wide average
but kept its own."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientNoiseScaleMonitor

CHANGE_AT = 6


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Change(pl.Callback):
    """Changes the model at step CHANGE_AT; records (step, model-wide count, net.2's count, net.4's count) after each
    check."""

    def __init__(self, what: str) -> None:
        self.what, self.counts = what, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != CHANGE_AT:
            return
        net = pl_module.net
        if self.what == "freeze a bias":
            net[2].bias.requires_grad_(False)
        elif self.what == "replace a layer":
            net[2] = nn.Linear(16, 16)
            trainer.optimizers[0].add_param_group({"params": net[2].parameters()})
        else:  # widen a layer
            net[2], net[4] = nn.Linear(16, 32), nn.Linear(32, 4)
            trainer.strategy.optimizers = [torch.optim.SGD(pl_module.parameters(), lr=0.05)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        mon = next(c for c in trainer.callbacks if isinstance(c, GradientNoiseScaleMonitor))
        step = trainer.global_step - 1
        if step % 2 == 0:
            self.counts[step] = tuple(e.count if e is not None else None
                                      for e in (mon.ema, mon.layer_ema.get("net.2"), mon.layer_ema.get("net.4")))


@pytest.mark.parametrize("what", ["freeze a bias", "replace a layer", "widen a layer"])
def test_the_averages_of_the_layers_whose_parameters_changed_start_again(what) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(160, 6), torch.randint(0, 4, (160,))
    mon, change = GradientNoiseScaleMonitor(every_n_steps=2, smoothing=0.9), Change(what)
    pl.Trainer(max_epochs=1, accelerator="cpu", callbacks=[change, mon], logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(Net(), DataLoader(TensorDataset(x, y),
                                                                                           batch_size=8))
    restarts = [a for a in mon.hub.history if a.kind == "averages_restarted"]
    assert [a.step for a in restarts] == [CHANGE_AT]
    model_wide, layer2, layer4 = zip(*(change.counts[s] for s in sorted(change.counts)))
    checks = sorted(change.counts)
    before, at = checks.index(CHANGE_AT - 2), checks.index(CHANGE_AT)
    assert model_wide[before] == layer2[before] == layer4[before] == before + 1
    assert model_wide[at] == 1 and layer2[at] == 1  # net.2's parameters changed: its own average starts again too
    # net.4: replaced (widened) or not
    assert layer4[at] == (1 if what == "widen a layer" else before + 2)
    assert model_wide[-1] == layer2[-1] == len(checks) - at
    if what != "freeze a bias":
        assert "replaced by new parameters under the same names" in restarts[0].message

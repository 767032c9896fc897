"""Monitors are read-only on parametrized layers: reading a ``spectral_norm`` weight in training mode advances its
power iteration (its ``_u`` / ``_v`` buffers), so a monitor that read it that way changed the run."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm
from torch.utils.data import DataLoader, TensorDataset

import lightning_monitor as lm
from lightning_monitor.callbacks.base import reading_weights


class _Net(pl.LightningModule):
    """A discriminator's usual layers (spectral_norm), and a head with it too or not."""

    def __init__(self, sn_head: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        head = nn.Linear(32, 4)
        self.net = nn.Sequential(spectral_norm(nn.Linear(10, 32)), nn.LeakyReLU(0.2), spectral_norm(nn.Linear(32, 32)),
                                 nn.LeakyReLU(0.2), spectral_norm(head) if sn_head else head)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _run(tmp_path, callbacks, sn_head: bool) -> _Net:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 10, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    torch.manual_seed(1)
    module = _Net(sn_head)
    pl.Trainer(max_steps=30, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=callbacks, default_root_dir=str(tmp_path)).fit(
        module, DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True))
    return module


@pytest.mark.parametrize(("make", "sn_head"), [
    (lambda: [lm.SpectralAlignmentMonitor(every_n_steps=1, head=None)], True),
    (lambda: [lm.GradientWeightAlignmentMonitor(warmup_epochs=0)], True),  # reads its head's weight at each step
    # selects its components among every module of the model (the head: GradES needs a weight parameter)
    (lambda: [lm.GradientEarlyStopping(include=["net.4"], every_n_steps=1, grace_steps=1000)], False),
], ids=["sa", "gwa", "grades"])
def test_a_run_with_the_monitor_is_bit_identical_to_one_without(tmp_path, make, sn_head):
    plain = _run(tmp_path / "plain", [], sn_head)
    callbacks = make()
    watched = _run(tmp_path / "watched", callbacks, sn_head)
    assert watched.losses == plain.losses
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values()):  # _u, _v included
        assert torch.equal(a, b), name
    if isinstance(callbacks[0], lm.SpectralAlignmentMonitor):  # it measured: three layers, every step
        assert len(callbacks[0]._vectors) == 3 and callbacks[0]._n_checks == 30


def test_reading_weights_leaves_the_parametrization_as_it_was_and_restores_its_mode():
    torch.manual_seed(0)
    layer = spectral_norm(nn.Linear(6, 5))
    layer.train()
    with torch.no_grad():  # a power iteration away from converged (at init it has run 15: one more may change nothing)
        layer.parametrizations.weight[0]._u.copy_(torch.nn.functional.normalize(torch.randn(5), dim=0))
    u = layer.parametrizations.weight[0]._u.clone()
    with reading_weights([layer, nn.Linear(2, 2)]):
        w = layer.weight
        assert not layer.parametrizations.weight[0].training
    assert torch.equal(layer.parametrizations.weight[0]._u, u) and layer.parametrizations.weight[0].training
    layer.weight  # noqa: B018 - in training mode a read advances the power iteration: what the context avoids
    assert not torch.equal(layer.parametrizations.weight[0]._u, u) and not torch.equal(layer.weight.detach(), w)

"""A model that writes to its own weights when it switches to eval mode (as Hugging Face's RWKV rescales some of them):
the per-example probe's runs on slices of the batch (in eval mode, to check the batch layouts) must leave the weights
alone. Before, the run divided them in place: the step's backward failed its version check (RWKV with the noise-scale
monitor crashed on the first backward) and the weights stayed divided. Then such writes were refused, but one that left
its values as they were (RWKV's first blocks are divided by 2 ** 0) was let through with its version counted, and a
refused one after it skipped putting that version back: a 12-layer RWKV crashed again. Now the writes run and are undone,
values and versions (refused only where torch cannot set a version back)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientNoiseScaleMonitor
from lightning_monitor import PerExampleGradNorms
from lightning_monitor._replays import ParameterWrite, ParametersReadOnly, WritesUndone
from lightning_monitor.probes.per_example.probe import _versions_put_back


class _Rescaling(nn.Module):
    """Halves ``inner.weight`` in place on entering eval mode and doubles it back on entering training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = nn.Linear(8, 16), nn.Linear(16, 3)
        self.rescaled = False

    def forward(self, x):
        if self.training == self.rescaled:
            with torch.no_grad():
                if self.training:
                    self.inner.weight.mul_(2.0)
                else:
                    self.inner.weight.div_(2.0)
            self.rescaled = not self.training
        return self.head(torch.relu(self.inner(x)))


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _Rescaling()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(callbacks) -> _Module:
    torch.manual_seed(0)
    model = _Module()
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    pl.Trainer(max_steps=6, accelerator="cpu", logger=False, callbacks=callbacks, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(model, DataLoader(data, batch_size=8))
    return model


def test_a_model_writing_its_weights_in_eval_mode_trains_as_without_the_probe():
    monitor = GradientNoiseScaleMonitor(every_n_steps=1)
    watched, plain = _fit([monitor]), _fit([])
    assert monitor.idle_reason is None
    for a, b in zip(watched.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert watched.net.rescaled is False


def test_writes_into_parameters_are_refused_and_others_run():
    layer = nn.Linear(4, 4)
    before = layer.weight.detach().clone()
    with torch.no_grad(), ParametersReadOnly(list(layer.parameters())):
        out = layer(torch.ones(2, 4)).mul_(2.0)  # a write into a fresh tensor runs
        with pytest.raises(ParameterWrite):
            layer.weight.div_(2.0)
        with pytest.raises(ParameterWrite):
            layer.bias.view(2, 2).zero_()  # through a view of its storage too
    assert out.shape == (2, 4)
    torch.testing.assert_close(layer.weight, before, rtol=0, atol=0)


def test_an_empty_parameter_does_not_refuse_writes_into_other_empty_tensors():
    layer = nn.Linear(4, 4)
    layer.empty = nn.Parameter(torch.zeros(0))
    with torch.no_grad(), ParametersReadOnly(list(layer.parameters())):
        torch.zeros(0).add_(1.0)  # a fresh empty tensor: nothing of a parameter's is written
        with pytest.raises(ParameterWrite):
            layer.weight.zero_()


def test_writes_into_parameters_run_and_are_undone_with_their_versions():
    layer = nn.Linear(4, 4)
    layer.shared = nn.Parameter(torch.zeros(8))
    layer.a, layer.b = nn.Parameter(layer.shared.detach()[:4]), nn.Parameter(layer.shared.detach()[4:])  # one storage
    params = list(layer.parameters())
    before, versions = [p.detach().clone() for p in params], [p._version for p in params]
    writes = WritesUndone(params)
    with writes:
        layer.weight.data.clamp_(-0.05, 0.05)  # through `.data` (its own version counter)
        with torch.no_grad():
            layer.weight.div_(2.0)  # on the parameter itself: counted
            layer.bias.view(2, 2).zero_()  # through a view of its storage
            layer.a.add_(1.0)  # a parameter whose storage it shares with two others
        out = layer(torch.ones(2, 4))
        assert float(layer.weight.abs().max()) <= 0.0251 and float(layer.bias.abs().max()) == 0.0
    assert out.shape == (2, 4)
    assert writes.undo()
    for p, b in zip(params, before):
        torch.testing.assert_close(p, b, rtol=0, atol=0)
    assert [p._version for p in params] == versions
    assert writes.undo()  # nothing written since: nothing to do


class _Blocks(nn.Module):
    """RWKV's rescaling on sequences: on entering eval mode block i's weight is divided by ``2 ** (i // 2)`` in place
    (the first two by 1: a write that leaves the values as they are), multiplied back on entering training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 3)
        self.rescaled = False

    def forward(self, x):
        if self.training == self.rescaled:
            with torch.no_grad():
                for i, block in enumerate(self.blocks):
                    if self.training:
                        block.weight.mul_(2 ** (i // 2))
                    else:
                        block.weight.div_(2 ** (i // 2))
            self.rescaled = not self.training
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x).mean(1)


class _BlocksModule(_Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _Blocks()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x.reshape(len(x), 2, 8)), y)  # sequences of 2


def test_a_model_rescaling_its_blocks_in_eval_mode_is_measured_and_trains_as_without_the_probe():
    def fit(callbacks):
        torch.manual_seed(0)
        model = _BlocksModule()
        data = TensorDataset(torch.randn(64, 16), torch.randint(0, 3, (64,)))
        trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=False, callbacks=callbacks, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, DataLoader(data, batch_size=8))
        return model, trainer

    monitor = GradientNoiseScaleMonitor(every_n_steps=1)
    (watched, trainer), (plain, _) = fit([monitor]), fit([])
    assert monitor.idle_reason is None
    assert float(trainer.callback_metrics["gns/coverage"]) == pytest.approx(1.0)
    for a, b in zip(watched.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert watched.net.rescaled is False
    # the norms of a step, against each example's own gradient
    net = _Blocks()
    x, y = torch.randn(6, 2, 8), torch.randint(0, 3, (6,))
    with PerExampleGradNorms(net) as probe:
        F.cross_entropy(net(x), y).backward()
    assert not probe.uncovered
    norms = probe.per_parameter()
    for name, p in net.named_parameters():
        oracle = torch.stack([torch.autograd.grad(F.cross_entropy(net(x[i:i + 1]), y[i:i + 1]), p)[0]
                              .pow(2).sum() for i in range(len(x))])
        torch.testing.assert_close(norms[name], oracle, rtol=1e-4, atol=1e-10)


class _Clamping(nn.Module):
    """Clamps a coefficient matrix's ``.data`` in place on every training forward (Gemma 3n's AltUp), then uses it."""

    def __init__(self, via_data: bool) -> None:
        super().__init__()
        self.inner, self.coefs, self.head = nn.Linear(8, 16), nn.Linear(16, 16, bias=False), nn.Linear(16, 3)
        self.via_data = via_data

    def forward(self, x):
        if self.training:
            if self.via_data:
                self.coefs.weight.data.clamp_(-0.1, 0.1)
            else:  # on the parameter itself: its version moves, and the backward checks it
                with torch.no_grad():
                    self.coefs.weight.clamp_(-0.1, 0.1)
        return self.head(torch.relu(self.coefs(torch.relu(self.inner(x)))))


class _ClampingModule(_Module):
    def __init__(self, via_data: bool) -> None:
        super().__init__()
        self.net = _Clamping(via_data)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x.reshape(len(x), 2, 4).repeat(1, 1, 2)).mean(1), y)  # sequences of 2


@pytest.mark.parametrize("via_data", [True, False], ids=["data", "parameter"])
def test_a_model_clamping_a_weight_every_forward_is_measured(via_data):
    monitor = GradientNoiseScaleMonitor(every_n_steps=1)
    torch.manual_seed(0)
    model = _ClampingModule(via_data)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=False, callbacks=[monitor], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=8))
    assert monitor.idle_reason is None
    assert float(trainer.callback_metrics["gns/coverage"]) == pytest.approx(1.0)
    assert float(model.net.coefs.weight.abs().max()) <= 0.1 + 0.1 * 6  # clamped each step, then one SGD update



def test_without_a_way_to_put_a_version_back_such_writes_are_refused_as_before(monkeypatch):
    """Where torch cannot set a version counter back, a write undone would leave its version moved (the step's backward
    would fail its check): every write into a parameter is refused, as before, and the model still trains as without
    the probe."""
    import lightning_monitor._compat as compat

    monkeypatch.setattr(compat, "_version_setter", lambda: None)
    layer = nn.Linear(4, 4)
    with torch.no_grad():
        layer.weight.clamp_(-0.1, 0.1)
    version = layer.weight._version
    with torch.no_grad(), ParametersReadOnly(list(layer.parameters())):
        with pytest.raises(ParameterWrite):
            layer.weight.clamp_(-0.1, 0.1)
    assert layer.weight._version == version
    assert not _versions_put_back([layer.weight], [version - 1])
    monitor = GradientNoiseScaleMonitor(every_n_steps=1)
    watched, plain = _fit([monitor]), _fit([])
    for a, b in zip(watched.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

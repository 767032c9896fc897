"""GradES and a component whose parameter a module outside it also holds (a weight tied by assignment): freezing the
component freezes the parameter there too. Said at setup (``shared_parameters``) and in the ``frozen`` alert, and
nothing is said where no parameter is shared (tied input and output embeddings are no component)."""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientEarlyStopping
from lightning_monitor.functional.grades import find_components, shared_outside


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Linear(8, 16)
        self.down_proj = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down_proj(torch.relu(self.up_proj(x)))


class _Net(nn.Module):
    def __init__(self, share: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])
        self.aux = nn.Linear(8, 16)
        if share:
            self.aux.weight = self.blocks[0].up_proj.weight  # no component: outside the numbered blocks
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        z = self.inp(x)
        for block in self.blocks:
            z = block(z)
        return self.head(z + 0.1 * self.aux(z)[:, :8])


class _Module(pl.LightningModule):
    def __init__(self, share: bool) -> None:
        super().__init__()
        self.net = _Net(share)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(share: bool):
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    y = (x[:, 0] > 0).long()
    grades = GradientEarlyStopping(every_n_steps=2, grace_steps=4, threshold="absolute", tau=1.0, smoothing=0.0,
                                   min_loss_progress=None, stop=False)
    module = _Module(share)
    trainer = pl.Trainer(accelerator="cpu", max_steps=12, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[grades])
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=16))
    return grades, module


def test_a_shared_parameter_is_said_at_setup_and_when_frozen():
    grades, module = _fit(share=True)
    assert "net.blocks.0.up_proj" in grades.frozen
    assert not module.net.aux.weight.requires_grad  # the shared parameter is frozen in `aux` too
    shared = [a for a in grades.hub.history if a.kind == "shared_parameters"]
    assert len(shared) == 1 and shared[0].severity == "info"
    assert "net.blocks.0.up_proj (with net.aux)" in shared[0].message and shared[0].value == 1.0
    frozen = {a.layer: a.message for a in grades.hub.history if a.kind == "frozen"}
    assert "shared with net.aux are frozen there too" in frozen["net.blocks.0.up_proj"]
    assert not any("shared with" in m for layer, m in frozen.items() if layer != "net.blocks.0.up_proj")


def test_nothing_is_said_where_nothing_is_shared():
    grades, module = _fit(share=False)
    assert grades.frozen and module.net.aux.weight.requires_grad
    assert not [a for a in grades.hub.history if a.kind == "shared_parameters"]
    assert not any("shared with" in a.message for a in grades.hub.history if a.kind == "frozen")


def test_shared_outside_names_other_holders_only():
    """An alias of the same module (two paths) is one module; a weight tied between two components names each other;
    a LoRA-style bare parameter component resolves to the module that holds it."""
    net = _Net(share=False)
    net.alias = net.blocks[1]  # the same module under a second name: nothing shared outside it
    assert shared_outside(net, find_components(net)) == {}
    net.blocks[1].up_proj.weight = net.blocks[0].up_proj.weight  # two components, one weight
    found = shared_outside(net, find_components(net))
    assert found == {"blocks.0.up_proj": ["blocks.1.up_proj"], "blocks.1.up_proj": ["blocks.0.up_proj"]}

"""Manual optimization with several optimizer steps per batch: every due step is checked, whichever step of
its batch it is, with the hooks armed for that step's own forward only; steps that are not due arm nothing."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from conftest import tb_scalars
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_monitor as lm


class _Rows(lm.Monitor):
    """Records, per check, the number of input rows of each forward its hook saw since it was armed."""

    name = "rows"

    def __init__(self, every_n_steps: int) -> None:
        super().__init__(every_n_steps=every_n_steps)
        self.armed: list[int] = []
        self.seen: list[int] = []
        self.checks: list[tuple[int, list[int]]] = []

    def select(self, trainer, pl_module) -> None:
        self.layer = pl_module.net[0]

    def arm(self, trainer, pl_module, step):
        self.armed.append(step)
        self.keep(self.layer.register_forward_hook(lambda m, inputs, out: self.seen.append(inputs[0].shape[0])))

    def release(self) -> None:
        super().release()
        self.seen = []

    def compute(self, trainer, pl_module, step):
        self.checks.append((step, list(self.seen)))
        return {self.key("rows"): torch.tensor(float(sum(self.seen)))}


class _Manual(pl.LightningModule):
    """One optimizer, ``len(split)`` steps per batch (on rows of those sizes), then a forward without gradients
    (a metric) after the last step."""

    def __init__(self, split: tuple[int, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        self.split, self.automatic_optimization = split, False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        for x, y in zip(batch[0].split(self.split), batch[1].split(self.split)):
            opt.zero_grad()
            self.manual_backward(F.cross_entropy(self.net(x), y))
            opt.step()
        with torch.no_grad():
            self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(tmp_path, split, callbacks, max_steps):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(400, 8, generator=g), torch.randint(0, 3, (400,), generator=g)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=TensorBoardLogger(str(tmp_path), name="tb"),
                         callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, log_every_n_steps=1)
    module = _Manual(split)
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=sum(split)))
    return trainer, module


def test_a_due_step_taken_second_in_its_batch_is_checked_on_its_own_forward(tmp_path):
    rows = _Rows(every_n_steps=3)
    sa = lm.SpectralAlignmentMonitor(every_n_steps=3)
    grades = lm.GradientEarlyStopping(include=["net.*"], every_n_steps=3, grace_steps=1000)
    trainer, module = _fit(tmp_path, (4, 6), [rows, sa, grades], max_steps=16)
    assert trainer.global_step == 16
    due = [0, 3, 6, 9, 12, 15]
    # steps 3, 9, 15 are the second step of their batch: checked too, each on the forward of its own 6 rows
    # (not the batch's first 4, nor the forward without gradients after the step)
    assert rows.checks == [(s, [4] if s % 2 == 0 else [6]) for s in due]
    # nothing armed on a step that is not due; 6 and 12 are armed after the backward of steps 5 and 11 (their
    # batch might take them), released at its end, and armed again at the start of their own batch
    assert rows.armed == [0, 3, 6, 6, 9, 12, 12, 15]
    scalars = tb_scalars(trainer.logger.log_dir)
    assert [s for s, _ in scalars["rows/rows"]] == due
    assert [s for s, _ in scalars["sa/sigma_max"]] == due
    assert [s for s, _ in scalars["grades/frozen_fraction"]] == due
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def test_one_step_per_batch_the_step_armed_ahead_is_armed_afresh_at_its_batch(tmp_path):
    rows = _Rows(every_n_steps=2)
    trainer, module = _fit(tmp_path, (5,), [rows], max_steps=7)
    # step 2 is armed after step 1's backward (the batch might take it) and released at the end of the batch:
    # the forward without gradients after step 1 is not counted; the next batch arms it again
    assert rows.checks == [(0, [5]), (2, [5]), (4, [5]), (6, [5])]
    assert [s for s, _ in tb_scalars(trainer.logger.log_dir)["rows/rows"]] == [0, 2, 4, 6]
    assert not any(m._forward_hooks for m in module.modules())


def test_the_noise_scale_stands_down_when_a_batch_makes_several_steps(tmp_path):
    """Each estimate reads a step's examples from its batches: with two steps a batch each step's gradient is of a
    part of the batch it cannot see (it logged a batch size of 0 and a coverage of 0 at the second steps). It says
    so once and stays idle; the fit goes on, standalone too."""
    gns = lm.GradientNoiseScaleMonitor(every_n_steps=3)
    trainer, _ = _fit(tmp_path, (4, 6), [gns], max_steps=16)
    assert trainer.global_step == 16 and gns.idle_reason is not None and "2 optimizer steps" in gns.idle_reason
    assert [a.kind for a in gns.hub.history if a.severity == "warning"][-1] == "nothing_to_watch"
    scalars = tb_scalars(trainer.logger.log_dir)
    assert [s for s, _ in scalars.get("gns/batch_size", [])] in ([], [0])  # at most the first batch's first step


class _GAN(pl.LightningModule):
    """Both players' forwards first, then the discriminator's step and the generator's (a valid GAN ordering)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        (x,) = batch
        g_opt, d_opt = self.optimizers()
        fake = self.G(torch.randn(x.shape[0], 4))
        ones, zeros = torch.ones(x.shape[0], 1), torch.zeros(x.shape[0], 1)
        d_loss = (F.binary_cross_entropy_with_logits(self.D(x), ones)
                  + F.binary_cross_entropy_with_logits(self.D(fake.detach()), zeros))
        g_loss = F.binary_cross_entropy_with_logits(self.D(fake), ones)
        g_opt.zero_grad()
        self.manual_backward(g_loss, retain_graph=True)
        g_opt.step()
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()

    def configure_optimizers(self):
        return [torch.optim.Adam(self.G.parameters(), 1e-3), torch.optim.Adam(self.D.parameters(), 1e-3)]


def test_with_several_optimizers_only_a_batchs_first_step_is_armed(tmp_path):
    """A GAN whose forwards all run before its first step: a step armed after the one before it would find its
    forward over (SA warned `layers_not_called` for layers that ran, and muted that alert for them)."""
    sa = lm.SpectralAlignmentMonitor(every_n_steps=1)
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", logger=TensorBoardLogger(str(tmp_path), name="tb"),
                         callbacks=[sa], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, log_every_n_steps=1)
    trainer.fit(_GAN(), DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=8))
    assert trainer.global_step == 8
    assert not any(a.kind == "layers_not_called" for a in sa.hub.history)
    assert [s for s, _ in tb_scalars(trainer.logger.log_dir)["sa/sigma_max"]] == [0, 2, 4, 6]

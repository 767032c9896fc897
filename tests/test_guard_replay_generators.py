"""The guard's replays of ``training_step`` leave the random generators a step draws from as they were: numpy's
``Generator`` and Python's ``random.Random`` held by the module, and a ``torch.Generator`` held by a plain helper object
(an augmentation class that is no module). A replay that drew from them moved the run's own draws on: a healthy MixUp
run went another way from its first replay (step 10) than without the guard, and 2 of 12 were rolled back (a replay drew
another mixing than its step, and the loss it gave was another batch's). With them kept, the run with the guard is the
run without it, loss for loss."""

from __future__ import annotations

import random

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard


class _Helper:  # an augmentation object with its own generator, not an nn.Module
    def __init__(self) -> None:
        self.g = torch.Generator().manual_seed(0)

    def draw(self, n: int) -> tuple[float, torch.Tensor]:
        return float(torch.rand((), generator=self.g)), torch.randperm(n, generator=self.g)


class _MixUp(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))
        if kind == "numpy Generator":
            self.rng = np.random.default_rng(0)
        elif kind == "random.Random":
            self.rng = random.Random(0)
        else:
            self.helper = _Helper()

    def _draw(self, n: int) -> tuple[float, torch.Tensor]:
        if self.kind == "numpy Generator":
            return float(self.rng.beta(0.4, 0.4)), torch.from_numpy(self.rng.permutation(n))
        if self.kind == "random.Random":
            order = list(range(n))
            self.rng.shuffle(order)
            return self.rng.betavariate(0.4, 0.4), torch.tensor(order)
        return self.helper.draw(n)

    def training_step(self, batch, batch_idx):
        x, y = batch
        lam, perm = self._draw(len(y))
        out = self.net(lam * x + (1 - lam) * x[perm])
        return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _run(kind: str, guard: bool, root) -> tuple[list[float], DivergenceGuard]:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    centres = 1.5 * torch.randn(10, 16, generator=g)
    y = torch.randint(0, 10, (4 * 120,), generator=g)
    data = TensorDataset(centres[y] + torch.randn(len(y), 16, generator=g), y)
    losses, dg = _Losses(), DivergenceGuard()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
                         callbacks=[losses, dg] if guard else [losses])
    trainer.fit(_MixUp(kind), DataLoader(data, batch_size=4))
    return losses.losses, dg


@pytest.mark.parametrize("kind", ["numpy Generator", "random.Random", "torch.Generator in a helper object"])
def test_replays_leave_the_generators_a_step_draws_from_as_they_were(tmp_path, kind: str) -> None:
    bare, _ = _run(kind, False, tmp_path / "bare")
    guarded, guard = _run(kind, True, tmp_path / "guarded")
    assert len(guarded) == len(bare) == 120 and not guard.rollbacks
    assert guarded == bare  # loss for loss: the replays (from step 10 on) drew nothing the run drew

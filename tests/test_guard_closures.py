"""Optimizers that evaluate their closure several times a step, and micro-batches: what the guard judges.

* Minibatch LBFGS with a strong-Wolfe line search: Lightning calls ``on_before_optimizer_step`` after every closure
  evaluation, so each line-search trial point was judged as a step of its own; a healthy run was rolled back four
  times and stopped (steps 39-84 of 300, 3 of 3 seeds). A step is now judged once, on its first evaluation.
* Gradient accumulation: the batches kept for replays are micro-batches; with 7 kept and 8 micro-batches a step,
  no earlier step had one left, so bad data (a batch whose labels are all ignored, a NaN loss) could not be told from
  weights that diverged: the rate was cut at each and the run stopped at step 104. Now the same as without
  accumulation: each bad batch is skipped with the rate kept."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_monitor import DivergenceGuard

sklearn = pytest.importorskip("sklearn.datasets")


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = sklearn.load_digits(return_X_y=True)
    idx = np.random.RandomState(0).permutation(len(x))[:1400]
    return torch.tensor(x[idx] / 16.0, dtype=torch.float32), torch.tensor(y[idx], dtype=torch.int64)


class _Net(pl.LightningModule):
    def __init__(self, make_opt) -> None:
        super().__init__()
        self.make_opt = make_opt
        self.net = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
        self.evaluations = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.evaluations += 1
        return F.cross_entropy(self.net(x), y, ignore_index=-100)

    def configure_optimizers(self):
        return self.make_opt(self.parameters())


def _fit(model, loader, steps: int, **kw) -> tuple[pl.Trainer, DivergenceGuard]:
    guard = DivergenceGuard()
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, max_epochs=1000, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, callbacks=[guard], **kw)
    trainer.fit(model, loader)
    return trainer, guard


@pytest.mark.parametrize("seed", [0, 2])
def test_minibatch_lbfgs_line_search_is_judged_once_a_step(seed: int) -> None:
    x, y = _digits()
    pl.seed_everything(seed, verbose=False)
    model = _Net(lambda p: torch.optim.LBFGS(p, lr=1.0, max_iter=10, history_size=10, line_search_fn="strong_wolfe"))
    g = torch.Generator().manual_seed(seed)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=g, drop_last=True)
    trainer, guard = _fit(model, loader, 100)
    assert model.evaluations > 3 * 100  # several closure evaluations a step
    assert trainer.global_step == 100 and guard.stopped_step is None
    assert guard.rollbacks == []


class _Windows(IterableDataset):
    """Batches of 64, every 15th step (after 30) with every label ignored (a NaN mean loss), cut into micro-batches."""

    def __init__(self, x, y, micro: int, seed: int) -> None:
        self.items = []
        g = torch.Generator().manual_seed(seed)
        step = 0
        while len(self.items) < 130 * 64 // micro:
            perm = torch.randperm(len(x), generator=g)
            for i in range(0, len(x) - 63, 64):
                xb, yb = x[perm[i:i + 64]], y[perm[i:i + 64]].clone()
                if step % 15 == 14 and step > 30:
                    yb[:] = -100
                self.items += [(xb[j:j + micro], yb[j:j + micro]) for j in range(0, 64, micro)]
                step += 1

    def __iter__(self):
        return iter(self.items)


@pytest.mark.parametrize("micro, accumulate", [(64, 1), (8, 8)])
def test_bad_batches_under_gradient_accumulation_keep_the_rate(micro: int, accumulate: int) -> None:
    x, y = _digits()
    pl.seed_everything(0, verbose=False)
    model = _Net(lambda p: torch.optim.Adam(p, lr=1e-3))
    loader = DataLoader(_Windows(x, y, micro, 0), batch_size=None)
    trainer, guard = _fit(model, loader, 120, accumulate_grad_batches=accumulate)
    assert trainer.global_step == 120 and guard.stopped_step is None
    # one rollback over each bad batch (steps 44, 59, ..., 119), each keeping the rate: bad data, not divergence
    assert [r["step"] for r in guard.rollbacks] == list(range(44, 120, 15))
    assert all(r["lr_scale"] == 1.0 for r in guard.rollbacks)

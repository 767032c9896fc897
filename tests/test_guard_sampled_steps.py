"""The guard's replays of a step that samples (REINFORCE, dropout) draw what the step drew: its judgement compares
weights, not two random draws of one loss."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard

JACKPOT, P_JACKPOT = 49.0, 0.03


def _digits():
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32)[:-300], torch.tensor(y)[:-300]


class _Bandit(pl.LightningModule):
    """A contextual bandit on digits: reward 1 for the right class, 50 with probability 3% (a jackpot); the loss of
    a step is a random draw (the actions and the jackpots), heavy-tailed."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(dropout), nn.Linear(128, 128), nn.ReLU(),
                                 nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logp = F.log_softmax(self.net(x), -1)
        a = torch.multinomial(logp.exp().detach(), 1).squeeze(-1)
        r = (a == y).float() * (1.0 + JACKPOT * (torch.rand(len(y)) < P_JACKPOT).float())
        return -(r * logp.gather(1, a[:, None]).squeeze(-1)).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), 1e-3)


def _loader(seed: int, steps: int, batch: int = 16) -> DataLoader:
    x, y = _digits()
    g = torch.Generator().manual_seed(30 + seed)
    idx = torch.cat([torch.randperm(len(x), generator=g) for _ in range(10)])[: steps * batch]
    return DataLoader(TensorDataset(x[idx], y[idx]), batch_size=batch, shuffle=False)


class _ReplayNow(pl.Callback):
    """Before each update: the guard's replay of the step's batch under the same weights, beside the step's loss."""

    def __init__(self, guard: DivergenceGuard):
        self.guard, self.pairs, self._loss = guard, [], None

    def on_before_backward(self, trainer, pl_module, loss):
        self._loss = float(loss)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.pairs.append((self._loss, self.guard._batch_loss(pl_module)))


def test_a_replay_of_a_sampling_step_under_the_same_weights_gives_its_loss(tmp_path):
    """Actions, jackpots and dropout masks drawn again as the step drew them: the replay's loss is the step's, to the
    bit (a fresh draw differed by up to 50x)."""
    pl.seed_everything(0)
    guard = DivergenceGuard()
    replay = _ReplayNow(guard)
    pl.Trainer(max_steps=30, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[guard, replay], default_root_dir=str(tmp_path)).fit(
        _Bandit(dropout=0.2), _loader(0, 30))
    assert len(replay.pairs) == 30
    assert all(then == now for then, now in replay.pairs), replay.pairs[:5]
    assert len({round(then, 6) for then, _ in replay.pairs}) > 10  # the losses are draws, not one value


def test_a_healthy_bandit_is_not_rolled_back(tmp_path):
    """A jackpot batch is a surge; the last normal batches, evaluated again, drew fresh actions and jackpots, and one
    jackpot among them read as weights that diverged: the healthy run was rolled back at step 241, its rate halved."""
    pl.seed_everything(1)
    guard = DivergenceGuard()
    pl.Trainer(max_steps=300, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[guard], default_root_dir=str(tmp_path)).fit(
        _Bandit(), _loader(1, 300))
    assert guard.rollbacks == []
    assert [a.kind for a in guard.hub.history if a.severity != "info"] == []

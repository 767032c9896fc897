"""The guard's replays of a step that samples (REINFORCE, dropout) draw what the step drew: its judgement compares
weights, not two random draws of one loss."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
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


@pytest.mark.parametrize("seed", [1, 0, 3])
def test_a_healthy_bandit_is_not_rolled_back(tmp_path, seed: int):
    """A jackpot batch is a surge; the last normal batches, evaluated again, drew fresh actions and jackpots, and one
    jackpot among them read as weights that diverged: the healthy run was rolled back at step 241, its rate halved
    (seed 1). Seeds 0 and 3: a jackpot surge beyond twice the first losses, asked of older weights, which drew other
    actions from the step's random numbers and no jackpot ("easy"): rolled back twice, the rate at 1/8, until such a
    surge had to come back under fresh random numbers first."""
    pl.seed_everything(seed)
    guard = DivergenceGuard()
    pl.Trainer(max_steps=300, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[guard], default_root_dir=str(tmp_path)).fit(
        _Bandit(), _loader(seed, 300))
    assert guard.rollbacks == []
    assert [a.kind for a in guard.hub.history if a.severity == "critical"] == []
    if seed == 1:
        assert [a.kind for a in guard.hub.history if a.severity != "info"] == []


class _BanditOwnBatches(_Bandit):
    """Each rank its own data and batch size (2 on rank 0, 16 on rank 1); decisions and weights written at the end."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def train_dataloader(self):
        torch.set_num_threads(1)
        return _loader(10 * self.global_rank, 200, (2, 16)[self.global_rank])

    def on_train_end(self) -> None:
        import json
        import os

        guard = next(c for c in self.trainer.callbacks if isinstance(c, DivergenceGuard))
        with open(os.path.join(self.out_dir, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"rollbacks": [(r["step"], r["to_step"]) for r in guard.rollbacks], "stopped": guard.stopped_step,
                       "step": self.trainer.global_step, "weights": float(self.net[0].weight.sum())}, fh)


@pytest.mark.slow
def test_ranks_of_unequal_batch_sizes_keep_as_many_references_ddp(tmp_path):
    """Two ranks with batches of 2 and 16: each sized its references by its own batch (8 and 4), and at a surge one rank
    went on to replay all of its references while the other did not: both waited for ever. The count is now the most
    any rank asks for, on every rank."""
    import json

    from conftest import fit_ddp_spawn

    torch.set_num_threads(1)
    pl.seed_everything(0)
    trainer = pl.Trainer(max_steps=200, accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[DivergenceGuard()], default_root_dir=str(tmp_path), use_distributed_sampler=False)
    fit_ddp_spawn(trainer, _BanditOwnBatches(str(tmp_path)))
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["step"] == 200

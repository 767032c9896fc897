"""A surge beyond twice the run's first losses whose reference batches, evaluated again, still lose what they lost: the
guard asks the weights from just before it about the surging batch itself. A diverging run the reference batches cannot
show (one task's head of a model that trains its tasks by turns, the others' batches the references), with its matched
control (the same seed and data, no jump). The healthy runs where weights of a few steps back find a smaller surge
easier (new data after a memorised set, a bandit) and nothing must act are in test_guard_high_start.py and
test_guard_sampled_steps.py."""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_monitor import DivergenceGuard

D, C, JUMP_AT = 32, 10, 300


def _task(seed: int = 99):
    """Inputs and two targets of one hidden map: a 10-class label (task A) and a unit-variance regression (task B);
    the last 1024 samples held out."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8192, D, generator=g)
    t1, t2 = torch.randn(D, 64, generator=g) / D**0.5, torch.randn(64, C, generator=g)
    h = torch.tanh(x @ t1)
    ya, yb = (h @ t2).argmax(1), h @ torch.randn(64, generator=g) / 8**0.5
    return x, ya, (yb - yb.mean()) / yb.std()


X, YA, YB = _task()


class _ByTurns(Dataset):
    """Batch ``i`` of 32 is task B when ``i % 5 == 4``, else task A."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __len__(self) -> int:
        return 10**5

    def __getitem__(self, i: int):
        idx = torch.randint(0, len(X) - 1024, (32,), generator=torch.Generator().manual_seed(self.seed * 100003 + i))
        return X[idx], YA[idx], YB[idx], torch.tensor(int(i % 5 == 4))


class _TwoHeads(pl.LightningModule):
    """A shared trunk, a classification head (task A) and a regression head (task B) in a parameter group of its own,
    whose rate jumps ``jump`` times at step 300 (Adam 1e-3)."""

    def __init__(self, jump: float, out_dir: str = "") -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(D, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.head_a = nn.Linear(128, C)
        self.head_b = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1))
        self.jump, self.out_dir = jump, out_dir

    def losses(self, x, ya, yb):
        h = self.trunk(x)
        return F.cross_entropy(self.head_a(h), ya), F.mse_loss(self.head_b(h).squeeze(-1), yb)

    def training_step(self, batch, batch_idx):
        x, ya, yb, task = batch
        la, lb = self.losses(x, ya, yb)
        return lb if int(task) == 1 else la

    def configure_optimizers(self):
        opt = torch.optim.Adam([{"params": [*self.trunk.parameters(), *self.head_a.parameters()]},
                                {"params": self.head_b.parameters()}], lr=1e-3)
        jump = self.jump
        sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda t: 1.0, lambda t: jump if t >= JUMP_AT else 1.0])
        return [opt], [{"scheduler": sched, "interval": "step"}]

    def held_out(self) -> tuple[float, float]:
        with torch.no_grad():
            la, lb = self.losses(X[-1024:], YA[-1024:], YB[-1024:])
        return float(la), float(lb)

    def on_train_end(self) -> None:
        if not self.out_dir:
            return
        guard = next(c for c in self.trainer.callbacks if isinstance(c, DivergenceGuard))
        with open(os.path.join(self.out_dir, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"rollbacks": [(r["step"], r["to_step"]) for r in guard.rollbacks], "stopped": guard.stopped_step,
                       "held_out": self.held_out(),
                       "weights": [float(v) for v in self.head_b[0].weight.flatten()[:32]]}, fh)


def _fit(module: pl.LightningModule, data: DataLoader, steps: int, root, **trainer_kwargs) -> DivergenceGuard:
    torch.set_num_threads(1)
    guard = DivergenceGuard()
    pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[guard], default_root_dir=str(root), **trainer_kwargs).fit(module, data)
    return guard


@pytest.mark.parametrize("seed", [0, 1])
def test_one_head_blown_up_in_a_model_trained_by_turns_is_rolled_back(tmp_path, seed: int) -> None:
    """Head B's rate x300 at step 300: its batches (every 5th) surge to 250, while the last normal batches, all of
    task A, lose what they lost. Before, each surge was read as one hard batch: no action, the head ended dead (held-out
    B 1.01 against the control's 0.10-0.13). Now the weights of step 300 find the surging batch easy: rolled back at
    the first surge (beyond twice the first losses), the head's rate held, and the run ends where its control does.
    The control: no action."""
    runs = {}
    for name, jump in (("diverging", 300.0), ("control", 1.0)):
        torch.manual_seed(seed)
        module = _TwoHeads(jump)
        guard = _fit(module, DataLoader(_ByTurns(seed), batch_size=None), 400, tmp_path / name)
        runs[name] = (guard, module.held_out())
    guard, (_, b) = runs["diverging"]
    control, (_, b_control) = runs["control"]
    assert control.rollbacks == [] and control.stopped_step is None
    assert [(r["step"], r["to_step"]) for r in guard.rollbacks] == [(309, 300)] and guard.stopped_step is None
    message = next(a.message for a in guard.hub.history if a.kind == "loss_explosion")
    assert "find this batch easy" in message and "times the run's first losses" in message
    assert b < 1.5 * b_control


@pytest.mark.slow
def test_the_same_rollback_on_two_ranks_ddp(tmp_path) -> None:
    """Two processes (gloo), each its own batches by turns: the ranks judge the mean of their replays and take the same
    decision, with the same weights after it."""
    from conftest import fit_ddp_spawn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn_find_unused_parameters_true", max_steps=340, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[DivergenceGuard()], default_root_dir=str(tmp_path), use_distributed_sampler=False)
    fit_ddp_spawn(trainer, _TwoHeads(300.0, str(tmp_path)), DataLoader(_ByTurns(0), batch_size=None))
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert ranks[0] == ranks[1]  # the same decisions and weights on both
    assert ranks[0]["stopped"] is None and ranks[0]["rollbacks"] and ranks[0]["rollbacks"][0][1] == 300

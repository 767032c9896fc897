"""A `training_step` whose replay cannot give its loss: it reads state it changes itself.

A MoCo step enqueues its batch's keys into a queue buffer after computing its loss. Evaluated again after the step,
the batch finds its own keys among the negatives and loses several times more: the end-of-fit check, which replays the
last batches under the final weights, read that as a last update that broke the weights and stopped every healthy fit
(`guard-step=299.ckpt`, the weights of step 290 put back). The guard now checks its replays against the first steps'
own losses (at its first snapshots), says when they differ, and does not judge the end of such a fit by them."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard
from lightning_monitor.alerts import AlertHub

_D, _K, _B = 16, 1024, 32


class _MoCo(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Sequential(nn.Linear(_D, 64), nn.ReLU(), nn.Linear(64, 16))
        self.k = copy.deepcopy(self.q).requires_grad_(False)
        self.register_buffer("queue", F.normalize(torch.randn(_K, 16), dim=1))
        self.register_buffer("ptr", torch.zeros(1, dtype=torch.long))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        with torch.no_grad():  # the momentum key encoder
            for pk, pq in zip(self.k.parameters(), self.q.parameters()):
                pk.data = pk.data * 0.99 + pq.data * 0.01
            k = F.normalize(self.k(x + 0.1 * torch.randn_like(x)), dim=1)
        q = F.normalize(self.q(x + 0.1 * torch.randn_like(x)), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.clone().t()], 1) / 0.07
        loss = F.cross_entropy(logits, torch.zeros(len(x), dtype=torch.long))
        with torch.no_grad():  # the batch's keys join the queue
            p = int(self.ptr)
            self.queue[p:p + len(x)] = k
            self.ptr[0] = (p + len(x)) % _K
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.q.parameters(), lr=0.05, momentum=0.9)


class _Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(_D, 32), nn.ReLU(), nn.Linear(32, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return F.cross_entropy(F.dropout(self.net(x), 0.2), (x[:, 0] > 0).long())

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _fit(tmp_path, module: pl.LightningModule, steps: int) -> tuple[pl.Trainer, DivergenceGuard]:
    pl.seed_everything(0, verbose=False)
    x = torch.randn(steps * _B, _D, generator=torch.Generator().manual_seed(1))
    guard = DivergenceGuard()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, default_root_dir=tmp_path, callbacks=[guard],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, DataLoader(TensorDataset(x), batch_size=_B))
    return trainer, guard


def test_a_healthy_moco_run_is_not_stopped_at_its_end(tmp_path) -> None:
    pl.seed_everything(0, verbose=False)
    trainer, guard = _fit(tmp_path, _MoCo(), 300)
    history = AlertHub.for_trainer(trainer).history
    said = [a for a in history if a.kind == "replay_differs"]
    # said at the first snapshot made in a step (step 10): its own keys make the batch far harder
    assert len(said) == 1 and said[0].step == 10 and said[0].value > 1.3 * said[0].threshold
    # before: a critical loss_explosion at step 299 and a stop with the weights of step 290 put back
    assert guard.stopped_step is None and not guard.rollbacks
    assert not [a for a in history if a.severity == "critical"]


def test_a_step_whose_replay_is_exact_is_judged_at_its_end_as_before(tmp_path) -> None:
    # dropout draws from torch's streams, which each kept batch keeps: its replays are exact, nothing is said, and the
    # end of the fit is judged by them
    pl.seed_everything(0, verbose=False)
    trainer, guard = _fit(tmp_path, _Plain(), 40)
    assert not [a for a in AlertHub.for_trainer(trainer).history if a.kind == "replay_differs"]
    assert not guard._unfaithful and guard._faithful_checks == 0


class _CountsOnRankOne(pl.LightningModule):
    """Rank 1's loss reads a counter its step increments (a replay sees it one further); rank 0's replays are exact."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.net = nn.Linear(_D, 1)
        self.count = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), x[:, 0])
        if self.global_rank == 1:
            self.count += 1
            loss = loss * (1.0 + (self.count % 2))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        import json
        import os

        guard = next(c for c in self.trainer.callbacks if isinstance(c, DivergenceGuard))
        said = [a.step for a in AlertHub.for_trainer(self.trainer).history if a.kind == "replay_differs"]
        with open(os.path.join(self.out_dir, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"unfaithful": guard._unfaithful, "left": guard._faithful_checks, "said": said,
                       "stopped": guard.stopped_step, "weights": [float(v) for v in self.net.weight.flatten()]}, fh)


@pytest.mark.slow
def test_two_ranks_agree_that_the_replays_differ(tmp_path) -> None:
    import json

    from conftest import fit_ddp_spawn

    guard = DivergenceGuard(every_n_steps=5, snapshot_every_n_checks=2)
    trainer = pl.Trainer(max_steps=40, accelerator="cpu", devices=2, strategy="ddp_spawn", callbacks=[guard],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    x = torch.randn(40 * 2 * 8, _D, generator=torch.Generator().manual_seed(1))
    fit_ddp_spawn(trainer, _CountsOnRankOne(str(tmp_path)), DataLoader(TensorDataset(x), batch_size=8))
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert results[0]["unfaithful"] and results[1]["unfaithful"]  # rank 1's finding, reduced: every rank holds it
    assert results[0]["left"] == results[1]["left"] == 0
    assert results[0]["weights"] == results[1]["weights"] and results[0]["stopped"] is None
    assert results[1]["said"] and all(len(r["said"]) <= 1 for r in results)

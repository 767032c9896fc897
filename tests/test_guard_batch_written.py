"""A `training_step` that writes into its batch's tensors in place (`x /= 16`, `batch["labels"][mask] = -100`).

The guard keeps the last batches to evaluate them again (a surge's test, the end of the fit). It kept their tensors
shared with the step, so after the step they held what the step had made of them, and a replay applied the step a
second time (x / 256): a healthy run was stopped at the end of every fit (its last batches replayed near chance), and a
true divergence of the same run was read as an objective that changed and left alone. The step's writes are found by
the tensors' version counters; the batch's tensors are then kept as a copy."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_monitor import DivergenceGuard
from lightning_monitor.alerts import AlertHub

_N, _D, _C = 768, 16, 4


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = torch.randn(_D, _C, generator=torch.Generator().manual_seed(100))
    x = torch.randn(_N, _D, generator=torch.Generator().manual_seed(seed))
    y = (x @ teacher).argmax(1)
    return 16.0 * x, y  # raw inputs 16 times their scale, as pixels 0..16 before normalising


class _Net(pl.LightningModule):
    def __init__(self, inplace: bool, jump: int | None = None, factor: float = 1.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(_D, 32), nn.ReLU(), nn.Linear(32, _C))
        self.inplace, self.jump, self.factor = inplace, jump, factor

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.inplace:
            x /= 16.0  # an augmented assignment on a tensor writes into the batch
        else:
            x = x / 16.0
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=3e-3)
        jump, factor = self.jump, self.factor
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: factor if jump is not None and k >= jump else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _seeded(cls: type, *args: Any, **kwargs: Any) -> pl.LightningModule:
    pl.seed_everything(0, verbose=False)
    return cls(*args, **kwargs)


def _fit(tmp_path, module: pl.LightningModule, data: Any, steps: int, guard: DivergenceGuard | None) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=steps, max_epochs=-1, accelerator="cpu", logger=False, default_root_dir=tmp_path,
                         callbacks=[guard] if guard is not None else [], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, data)
    return trainer


def _loader(x: torch.Tensor, y: torch.Tensor) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))


def _held_out(module: _Net) -> float:
    x, y = _data(seed=1)
    with torch.no_grad():
        return float(F.cross_entropy(module.net(x / 16.0), y))


def _alerts(trainer: pl.Trainer, **match: str) -> list:
    return [a for a in AlertHub.for_trainer(trainer).history
            if a.monitor == "guard" and all(getattr(a, k) == v for k, v in match.items())]


def test_a_healthy_run_that_writes_into_its_batch_is_left_alone(tmp_path) -> None:
    x, y = _data()
    plain = _seeded(_Net, inplace=True)
    _fit(tmp_path, plain, _loader(x.clone(), y), 240, None)
    guard = DivergenceGuard()
    guarded = _seeded(_Net, inplace=True)
    trainer = _fit(tmp_path, guarded, _loader(x.clone(), y), 240, guard)
    # before: a critical `loss_explosion` at the end ("the last 4 normal batches, evaluated again under the final
    # weights, went from 0.1 to 1.3"), the run stopped and the weights of 10 steps earlier put back
    assert not _alerts(trainer, severity="critical")
    assert guard.stopped_step is None and not guard.rollbacks
    said = _alerts(trainer, kind="batch_written")
    assert len(said) == 1 and said[0].severity == "info" and said[0].step == 0
    for a, b in zip(plain.parameters(), guarded.parameters()):  # the guarded run trained exactly as the plain one
        assert torch.equal(a, b)
    assert _held_out(guarded) < 0.5 * math.log(_C)  # it learned


@pytest.mark.parametrize("inplace", [True, False], ids=["x /= 16", "x = x / 16"])
def test_a_divergence_of_a_run_that_writes_into_its_batch_is_rolled_back(tmp_path, inplace) -> None:
    # the rate x100 from step 150; before, with `x /= 16` the guard read the rise as an objective that changed (the
    # newest snapshot replayed the same doubly divided batches) and let the run diverge: held-out 1.3 against 0.1
    x, y = _data()
    plain = _seeded(_Net, inplace, jump=150, factor=100.0)
    _fit(tmp_path, plain, _loader(x.clone(), y), 200, None)
    guard = DivergenceGuard()
    guarded = _seeded(_Net, inplace, jump=150, factor=100.0)
    trainer = _fit(tmp_path, guarded, _loader(x.clone(), y), 200, guard)
    assert guard.rollbacks and 151 <= guard.rollbacks[0]["step"] <= 160
    assert not _alerts(trainer, kind="objective_change")
    assert _held_out(guarded) < 0.5 * _held_out(plain)
    assert bool(_alerts(trainer, kind="batch_written")) is inplace


class _Tokens(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 20, (256, 12), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i].clone(), "labels": self.ids[i].clone()}


class _MaskedLM(pl.LightningModule):
    """Masks a fixed set of positions of `input_ids` in place and ignores the others' labels in place, as a
    hand-written masked-LM step does."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(21, 16)
        self.out = nn.Linear(16, 21)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, labels = batch["input_ids"], batch["labels"]
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, ::3] = True
        labels[~mask] = -100
        ids[mask] = 0  # the [MASK] id
        # a bag of the sequence's unmasked tokens predicts each masked one
        h = self.emb(ids).mean(1, keepdim=True).expand(-1, ids.shape[1], -1)
        return F.cross_entropy(self.out(h).reshape(-1, 21), labels.reshape(-1), ignore_index=-100)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class _Inspect(pl.Callback):
    """Runs ``check(guard, module)`` at the end of batch ``at`` (after the guard's own hook: listed after it)."""

    def __init__(self, guard: DivergenceGuard, at: int, check: Any) -> None:
        self.guard, self.at, self.check, self.done = guard, at, check, False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.at:
            self.check(self.guard, pl_module)
            self.done = True


def _kept_batches_are_the_loaders(guard: DivergenceGuard, module: pl.LightningModule) -> None:
    # every kept batch is what the loader gave (no [MASK] id, no ignored label), and a replay of one gives what a fresh
    # step gives on a copy of it under the same weights
    assert len(guard._recent_batches) >= 4
    for _, batch, batch_idx, rng in guard._recent_batches:
        assert (batch["input_ids"] != 0).all() and (batch["labels"] != -100).all()
        fresh = {k: v.clone() for k, v in batch.items()}
        with torch.no_grad():
            expected = float(module.training_step(fresh, batch_idx))
        assert guard._batch_loss(module, batch, batch_idx, rng) == pytest.approx(expected, rel=1e-6)
        assert (batch["input_ids"] != 0).all()  # the replay wrote into a copy of its own


def test_a_dict_batch_masked_in_place_is_kept_as_a_copy_and_replayed_as_the_step_saw_it(tmp_path) -> None:
    guard = DivergenceGuard()
    inspect = _Inspect(guard, 50, _kept_batches_are_the_loaders)
    module = _seeded(_MaskedLM)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=60, accelerator="cpu", logger=False, default_root_dir=tmp_path,
                         callbacks=[guard, inspect], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    trainer.fit(module, DataLoader(_Tokens(), batch_size=16, shuffle=True))
    assert inspect.done
    assert len(_alerts(trainer, kind="batch_written")) == 1
    assert not _alerts(trainer, severity="critical") and guard.stopped_step is None


def _shared(guard: DivergenceGuard, module: pl.LightningModule) -> None:
    _, kept, _, _ = guard._recent_batches[-1]
    assert kept[0] is module.seen[0] and kept[1] is module.seen[1]


class _Recording(_Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen = batch
        return super().training_step(batch, batch_idx)


def test_a_step_that_leaves_its_batch_alone_keeps_the_tensors_shared(tmp_path) -> None:
    # no copy where none is needed: the kept batch holds the very tensors the step was given
    x, y = _data()
    guard = DivergenceGuard()
    inspect = _Inspect(guard, 30, _shared)
    module = _seeded(_Recording, inplace=False)
    trainer = pl.Trainer(max_steps=40, accelerator="cpu", logger=False, default_root_dir=tmp_path,
                         callbacks=[guard, inspect], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    trainer.fit(module, _loader(x, y))
    assert inspect.done
    assert not _alerts(trainer, kind="batch_written") and not guard._copy_batches

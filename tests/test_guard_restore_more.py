"""What a rollback (or an undone batch) puts back besides the module's state_dict and the optimizers: buffers outside
the state_dict (``persistent=False``), the epoch-interval schedulers' steps of the epochs that ended since the
snapshot, and, for a replay, the module's own containers (a ``Counter``, a tuple of tensors)."""

from __future__ import annotations

from collections import Counter

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard
from lightning_monitor._replays import attributes, restore_attributes

PER_EPOCH = 24


def _data(n: int = PER_EPOCH * 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x @ torch.randn(8, 1, generator=g)), batch_size=8)


class _Jump(pl.Callback):
    """The learning rate x1000 for the step ``at`` only (the guard rolls it back)."""

    def __init__(self, at: int) -> None:
        self.at, self.saved = at, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        group = trainer.optimizers[0].param_groups[0]
        if trainer.global_step == self.at:
            self.saved = group["lr"]
            group["lr"] = self.saved * 1000.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.saved is not None:
            trainer.optimizers[0].param_groups[0]["lr"], self.saved = self.saved, None


class _Counting(pl.LightningModule):
    """A regression whose loss is divided by a running normaliser kept in a non-persistent buffer, beside a
    non-persistent step counter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.register_buffer("seen", torch.zeros(()), persistent=False)
        self.register_buffer("scale", torch.ones(1), persistent=False)
        self.register_buffer("mask", torch.ones(32, dtype=torch.bool), persistent=False)  # a constant

    def training_step(self, batch, batch_idx):
        self.seen += 1
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        with torch.no_grad():
            self.scale.mul_(0.9).add_(0.1 * loss.detach().clamp(max=1e6))
        return loss / self.scale

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class _At(pl.Callback):
    """The module's buffers (all of them) at ``on_before_optimizer_step`` of the given steps, and right after the
    guard's first rollback."""

    def __init__(self, steps=(), guard=None) -> None:
        self.steps, self.guard, self.seen = set(steps), guard, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step in self.steps:
            self.seen[trainer.global_step] = {n: b.clone() for n, b in pl_module.named_buffers()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.guard is not None and self.guard.rollbacks and "rolled" not in self.seen:
            self.seen["rolled"] = {n: b.clone() for n, b in pl_module.named_buffers()}


def _fit(module, callbacks, steps, data=None) -> pl.Trainer:
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, data or _data())
    return trainer


def test_a_rollback_puts_back_the_buffers_outside_the_state_dict():
    # a non-persistent normaliser kept its diverged value (1e5 for 6.27): every later loss 16,000 times smaller
    guard = DivergenceGuard()
    after = _At(guard=guard)
    _fit(_Counting(), [_Jump(25), guard, after], 40)
    rollback = guard.rollbacks[0]
    assert rollback["to_step"] == 20 and rollback["step"] >= 26
    oracle = _At(steps=[20])
    _fit(_Counting(), [oracle], 21)
    for name, value in oracle.seen[20].items():
        assert torch.equal(after.seen["rolled"][name], value), name
    assert after.seen["rolled"]["seen"].item() == 20.0 + 1  # counted at step 20's training_step, before its update


class _StepLR(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                                                   "interval": "epoch"}}


class _Epochs(pl.Callback):
    def __init__(self) -> None:
        self.last_epoch = {}

    def on_train_epoch_start(self, trainer, pl_module):
        self.last_epoch[trainer.current_epoch] = trainer.lr_scheduler_configs[0].scheduler.last_epoch


def test_a_rollback_across_an_epoch_end_keeps_the_epoch_schedulers_with_the_epochs():
    # a divergence at the first batch of epoch 1 went back to a snapshot of epoch 0: the restore took back the epoch's
    # StepLR step, which was never made again (the rate twice the schedule's for the rest of the run)
    guard, epochs = DivergenceGuard(every_n_steps=10), _Epochs()
    _fit(_StepLR(), [_Jump(PER_EPOCH), guard, epochs], PER_EPOCH * 5)
    assert guard.rollbacks and guard.rollbacks[0]["to_step"] < PER_EPOCH <= guard.rollbacks[0]["step"]
    assert epochs.last_epoch == {e: e for e in range(5)}


def test_an_undone_last_batch_of_an_epoch_keeps_the_epoch_schedulers_with_the_epochs():
    for skip in ((0, PER_EPOCH - 1), (0, PER_EPOCH - 2)):
        guard, epochs = DivergenceGuard(skip_batches=[skip]), _Epochs()
        _fit(_StepLR(), [guard, epochs], PER_EPOCH * 3)
        assert epochs.last_epoch == {0: 0, 1: 1, 2: 2}, skip


class _Keeper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tally = Counter({0: 5, 1: 4})
        self.moments = (torch.zeros(1), torch.zeros(2))
        self.lin = nn.Linear(2, 2)


def test_a_replay_puts_back_a_counter_and_the_tensors_of_a_tuple():
    module = _Keeper()
    saved = attributes(module)
    module.tally.update([0, 2, 2])
    module.moments[0].add_(3.0)
    module.moments[1][1] = 7.0
    restore_attributes(saved)
    assert module.tally == Counter({0: 5, 1: 4})  # was {(0, 5): 1, (1, 4): 1}: the pairs counted as keys
    assert torch.equal(module.moments[0], torch.zeros(1)) and torch.equal(module.moments[1], torch.zeros(2))


class _StepLREvery2(_StepLR):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                                                   "interval": "epoch", "frequency": 2}}


def test_an_epoch_scheduler_stepped_every_two_epochs_keeps_its_schedule_across_a_rollback():
    # re-stepped for the epochs ended since the snapshot as Lightning steps it: at the end of every second epoch
    guard, epochs = DivergenceGuard(every_n_steps=10), _Epochs()
    _fit(_StepLREvery2(), [_Jump(PER_EPOCH * 2), guard, epochs], PER_EPOCH * 6)
    assert guard.rollbacks and guard.rollbacks[0]["to_step"] < PER_EPOCH * 2 <= guard.rollbacks[0]["step"]
    assert epochs.last_epoch == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}


class _DataWrites(_Counting):
    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.scale.data = self.scale.data * 0.9 + 0.1 * loss.detach().clamp(max=1e6)  # no version counter moves
        return loss / self.scale


def test_a_buffer_written_through_data_is_put_back_too():
    guard = DivergenceGuard()
    after = _At(guard=guard)
    _fit(_DataWrites(), [_Jump(25), guard, after], 40)
    assert guard.rollbacks[0]["to_step"] == 20
    oracle = _At(steps=[20])
    _fit(_DataWrites(), [oracle], 21)
    assert torch.equal(after.seen["rolled"]["scale"], oracle.seen[20]["scale"])


class _Saving(_StepLR):
    """A step that saves a checkpoint itself every 10 steps."""

    def __init__(self, folder) -> None:
        super().__init__()
        self.folder, self.saves = folder, []

    def training_step(self, batch, batch_idx):
        if self.global_step and self.global_step % 10 == 0:
            self.saves.append(self.global_step)
            self.trainer.save_checkpoint(str(self.folder / f"own-{self.global_step}-{len(self.saves)}.ckpt"))
        return super().training_step(batch, batch_idx)


def test_a_step_that_saves_a_checkpoint_is_replayed_without_saving(tmp_path):
    # the checkpoint's own replays ran the step, which saved again, whose replays ran it again ... (no end)
    module = _Saving(tmp_path)
    _fit(module, [DivergenceGuard()], 31)
    files = sorted(p.name for p in tmp_path.glob("own-*.ckpt"))
    assert len(files) == 3 and {f.split("-")[1] for f in files} == {"10", "20", "30"}
    said = torch.load(str(tmp_path / files[0]), weights_only=True)["callbacks"]
    assert next(v for k, v in said.items() if k.startswith("DivergenceGuard"))["saved_weights"]["step"] == 10


class _IndexDataWrites(_Counting):
    """An index buffer (long, non-persistent) rewritten through `.data` at step 15 (no version counter moves)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("order", torch.arange(6), persistent=False)

    def training_step(self, batch, batch_idx):
        if self.global_step == 15:
            self.order.data.copy_(self.order.data.flip(0))
        return F.mse_loss(self.net(batch[0]), batch[1])


def test_an_index_buffer_written_through_data_is_put_back_as_it_was_at_the_snapshot():
    # unchanged by identity and version, the snapshot of step 20 shared the copy of step 10: put back reversed
    guard = DivergenceGuard()
    after = _At(guard=guard)
    _fit(_IndexDataWrites(), [_Jump(25), guard, after], 40)
    assert guard.rollbacks[0]["to_step"] == 20
    assert after.seen["rolled"]["order"].tolist() == [5, 4, 3, 2, 1, 0]

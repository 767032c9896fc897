"""DivergenceGuard(action="rollback") in real Trainer.fit runs: exact restore, skipped batches, resume,
escalation to a stop, BatchNorm buffers, data shifts, DDP."""

from __future__ import annotations

import csv
import json
import os
import pathlib

import lightning.pytorch as pl
import pytest
import torch
from conftest import fit_ddp_spawn
from test_guard import _CriticalAt
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_monitor import DivergenceGuard, read_alerts

N, BATCH = 4096, 16


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.5 * torch.randn(N, 1, generator=g)
    return x, y


class _Regression(pl.LightningModule):
    """Least squares with AdamW. The batch is chosen by ``batch_idx`` alone, so a resumed run sees the same
    data at the same index. ``penalty_from``: from that step on ``training_step`` adds a penalty (the loss jumps
    more than tenfold; the objective changed, not the weights). ``glitch``: steps whose learning rate is
    multiplied by 500 (a transient instability); ``unstable_from``: the learning rate is 5.0 from that step on
    (a lasting one), set in the module's ``on_before_optimizer_step``, the last hook before the update, so no ceiling
    of the guard's holds (``lr_in_step``: set in ``training_step`` instead, which the guard's ceiling overrides); ``shift_from``: from that batch index on, the targets change sign (new data, not a divergence)."""

    def __init__(self, glitch=(), unstable_from=None, shift_from=None, bn=False, nan_batch=None, penalty_from=None,
                 lr_in_step=False):
        super().__init__()
        self.lr_in_step = lr_in_step
        self.penalty_from = penalty_from
        self.lin = torch.nn.Linear(8, 1)
        self.bn = torch.nn.BatchNorm1d(8) if bn else torch.nn.Identity()
        self.glitch, self.unstable_from, self.shift_from, self.nan_batch = set(glitch), unstable_from, shift_from, nan_batch
        self.x, self.y = _data()

    def training_step(self, batch, batch_idx):
        lo = (batch_idx * BATCH) % N
        x, y = self.x[lo:lo + BATCH], self.y[lo:lo + BATCH]
        if self.shift_from is not None and batch_idx >= self.shift_from:
            y = -3.0 * y
        if batch_idx == self.nan_batch:
            x = torch.full_like(x, float("nan"))
        group = self.optimizers().param_groups[0]
        step = self.global_step
        if step in self.glitch and step - 1 not in self.glitch:
            group["lr"] *= 500.0
        if step - 1 in self.glitch and step not in self.glitch:
            group["lr"] /= 500.0
        if self.lr_in_step and self.unstable_from is not None and step >= self.unstable_from:
            group["lr"] = 5.0
        loss = torch.nn.functional.mse_loss(self.lin(self.bn(x)), y)
        if self.penalty_from is not None and step >= self.penalty_from:
            loss = loss + 50.0 + 0.1 * self.lin.weight.pow(2).sum()  # a term switched on: the objective changes
        return loss

    def on_before_optimizer_step(self, optimizer):
        if not self.lr_in_step and self.unstable_from is not None and self.global_step >= self.unstable_from:
            optimizer.param_groups[0]["lr"] = 5.0

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(N // BATCH)), batch_size=1)


def _trainer(tmp_path, callbacks, steps, **kw):
    return pl.Trainer(
        max_steps=steps, accelerator="cpu", callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
        logger=kw.pop("logger", CSVLogger(str(tmp_path), name="csv")),
        enable_checkpointing=kw.pop("enable_checkpointing", False), **kw,
    )


class _Capture(Callback):
    """Copies the module's and the optimizer's state at the end of the batch after which ``global_step == step``
    (after the callbacks listed before it acted), and records the steps whose update left the weights as they
    were (skipped)."""

    def __init__(self, step: int = -1) -> None:
        self.step, self.module, self.optim, self.dropped, self._before = step, None, None, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if all(torch.equal(a, p) for a, p in zip(self._before, pl_module.parameters())):
            self.dropped.append(trainer.global_step - 1)
        if trainer.global_step == self.step:
            optimizer = trainer.optimizers[0]
            self.module = {k: v.clone() for k, v in pl_module.state_dict().items()}
            self.optim = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(optimizer.state.values())}
            self.lr = optimizer.param_groups[0]["lr"]


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_rollback_restores_exact_state_and_skips_the_batches_seen_since(tmp_path):
    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5, snapshot_every_n_checks=5)  # snapshots at 0, 25, 50, ...
    capture = _Capture(step=62)  # the end of step 61
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=40, save_top_k=-1)
    trainer = _trainer(tmp_path / "a", [guard, capture, ckpt], 120, enable_checkpointing=True)
    trainer.fit(_Regression(glitch=(60, 61, 62)))

    # the glitch (lr x500 from step 60) blows the loss up at 61: a surge the last normal batches share (the weights
    # diverged), acted on at once
    assert [(r["step"], r["to_step"], r["skipped"]) for r in guard.rollbacks] == [(61, 50, 12)]
    assert guard.rollbacks[0]["batches"] == [[0, b] for b in range(50, 62)]
    assert guard.stopped_step is None and trainer.global_step == 120
    assert [(a.step, a.kind) for a in guard.hub.history if a.severity == "critical"] == [(61, "loss_explosion")]

    # right after the rollback: bit-identical to a run trained for exactly 50 steps (the rate rose since the best
    # smoothed loss: it is capped at that rate, the one of the state restored)
    pl.seed_everything(0)
    ref = _Capture(step=50)
    _trainer(tmp_path / "ref", [ref], 50, logger=False).fit(_Regression())
    _assert_same(capture.module, ref.module)
    assert capture.optim.keys() == ref.optim.keys()
    for i in ref.optim:
        _assert_same(capture.optim[i], ref.optim[i])
    assert capture.lr == ref.lr

    # the rollback is in alerts.jsonl, with the skipped batches
    alerts = read_alerts(os.path.join(trainer.loggers[0].log_dir, "alerts.jsonl"))
    rolled = [a for a in alerts if a.kind == "rolled_back"]
    assert len(rolled) == 1 and rolled[0].details["batches"] == [[0, b] for b in range(50, 62)]
    assert "to the state of step 50" in rolled[0].message
    # ... and in the checkpoint saved after it
    state = torch.load(tmp_path / "ck" / "epoch=0-step=80.ckpt", weights_only=False)["callbacks"][guard.state_key]
    assert [tuple(b) for b in state["skip"]] == [(0, b) for b in range(50, 62)]
    assert state["rollbacks"][0]["to_step"] == 50


def test_a_run_resumed_from_an_earlier_checkpoint_skips_the_rolled_back_batches(tmp_path):
    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5, snapshot_every_n_checks=5, lr_factor=1.0)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=40, save_top_k=-1)
    first = _trainer(tmp_path / "a", [guard, ckpt], 100, enable_checkpointing=True)
    model_a = _Regression(glitch=(60, 61, 62))
    first.fit(model_a)
    assert [(r["step"], r["to_step"]) for r in guard.rollbacks] == [(61, 50)]

    # restart from the step-40 checkpoint (before the rollback), told which batches to skip
    pl.seed_everything(0)
    resumed = DivergenceGuard(every_n_steps=5, snapshot_every_n_checks=5, lr_factor=1.0,
                              skip_batches=pathlib.Path(first.loggers[0].log_dir) / "alerts.jsonl")  # a Path too
    capture = _Capture()
    model_b = _Regression(glitch=(60, 61, 62))
    second = _trainer(tmp_path / "b", [resumed, capture], 100)
    second.fit(model_b, ckpt_path=str(tmp_path / "ck" / "epoch=0-step=40.ckpt"))
    assert capture.dropped == list(range(50, 62))  # the glitch's steps never applied: nothing to roll back
    assert resumed.rollbacks == [] and not [a for a in resumed.hub.history if a.severity == "critical"]
    # the same weights as the run that rolled back
    _assert_same(model_b.state_dict(), model_a.state_dict())


def test_a_rate_set_by_the_module_after_the_guard_is_held_under_the_ceiling(tmp_path):
    # the module sets lr 5.0 in `training_step` from step 60, after the callbacks' on_train_batch_start where the
    # guard caps the rates: the guard holds the ceiling again right before each update (it used to be overwritten,
    # the run re-exploded after every rollback and stopped). One rollback, said once, and the run goes on
    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5, max_rollbacks=3, dirpath=str(tmp_path / "ck"))
    model = _Regression(unstable_from=60, lr_in_step=True)
    _trainer(tmp_path, [guard], 150).fit(model)
    assert [(r["to_step"], r["lr_ceiling"]) for r in guard.rollbacks] == [(60, [[0.01]])]
    assert guard.stopped_step is None
    assert [a.kind for a in guard.hub.history].count("lr_overridden") == 1
    assert model.optimizers().param_groups[0]["lr"] == 0.01  # held at the ceiling, not the 5.0 the module set


def test_repeated_rollbacks_escalate_to_a_stop_with_the_last_good_state(tmp_path):
    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5, max_rollbacks=3, dirpath=str(tmp_path / "ck"))
    model = _Regression(unstable_from=60)  # the module sets lr 5.0 right before every update from 60: nothing cures it
    _trainer(tmp_path, [guard], 300).fit(model)
    assert len(guard.rollbacks) == 3 and all(r["to_step"] == 60 for r in guard.rollbacks)
    # the rate rose (the module sets it): the first rollback caps it, the next ones also scale it, faster and faster
    assert [r["lr_factor"] for r in guard.rollbacks] == [1.0, 0.5, 0.25]
    assert [r["lr_scale"] for r in guard.rollbacks] == [1.0, 0.5, 0.125]
    assert [r["lr_ceiling"] for r in guard.rollbacks] == [[[0.01]], [[0.005]], [[0.00125]]]
    assert guard.stopped_step is not None and guard.stopped_step > guard.rollbacks[-1]["step"]
    stop = next(a for a in guard.hub.history if a.kind == "stopped")
    assert "max_rollbacks=3" in stop.message and "the state of step 60" in stop.message
    # the checkpoint holds the last good state: the weights of step 60 (the update of step 60 not applied yet)
    saved = torch.load(guard.stop_checkpoint, weights_only=False)["state_dict"]
    pl.seed_everything(0)
    ref = _Capture(step=60)
    _trainer(tmp_path / "ref", [ref], 60, logger=False).fit(_Regression())
    _assert_same({k: saved[k] for k in ref.module}, ref.module)


class _Ramp(_Regression):
    """The learning rate ramps from 1e-2 up 500x over 200 steps (LambdaLR): past the edge of stability."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 + 499.0 * min(s, 200) / 200)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _LRLog(Callback):
    def __init__(self) -> None:
        self.lr: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lr[trainer.global_step] = optimizer.param_groups[0]["lr"]


def test_a_divergence_on_a_ramp_caps_the_learning_rate(tmp_path):
    pl.seed_everything(0)
    guard, lrs = DivergenceGuard(every_n_steps=5, snapshot_every_n_checks=2), _LRLog()
    _trainer(tmp_path, [guard, lrs], 300).fit(_Ramp())
    assert len(guard.rollbacks) >= 1 and guard.stopped_step is None
    first = guard.rollbacks[0]
    # the rate rose since the best smoothed loss: the first rollback caps it (at the rate of that best loss, at
    # most half the rate in force when it acted) without scaling the schedule
    assert first["lr_scale"] == 1.0 and first["lr_ceiling"] is not None
    ceiling = first["lr_ceiling"][0][0]
    ramp = lambda s: 1e-2 * (1.0 + 499.0 * min(s, 200) / 200)  # noqa: E731
    assert 0 < ceiling <= 0.5 * ramp(first["step"] + 1) + 1e-12
    # from then on the ramp never climbs past the ceiling (the schedule alone would go on)
    after = [lr for step, lr in lrs.lr.items() if step > first["step"]]
    assert after and max(after) <= ceiling * (1 + 1e-12) and max(lrs.lr.values()) > ceiling


def test_the_rates_read_between_steps_are_the_capped_ones(tmp_path):
    # the scheduler steps after the update and writes its own rate back into the groups: LearningRateMonitor listed
    # before the guard logged that rate (not the one in force), and a checkpoint saved it
    from lightning.pytorch.callbacks import LearningRateMonitor

    pl.seed_everything(0)
    guard, lrs = DivergenceGuard(every_n_steps=5, snapshot_every_n_checks=2), _LRLog()
    trainer = _trainer(tmp_path, [LearningRateMonitor("step"), guard, lrs], 300, log_every_n_steps=1)
    trainer.fit(_Ramp())
    assert guard.rollbacks and guard.stopped_step is None
    first = guard.rollbacks[0]
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        logged = {int(r["step"]): float(r["lr-AdamW"]) for r in csv.DictReader(f) if r.get("lr-AdamW")}
    after = {s: lr for s, lr in logged.items() if s > first["step"]}
    assert after and after == {s: lrs.lr[s] for s in after}  # the logged rate is the rate each update used
    ceiling = min(c[0][0] for c in (r["lr_ceiling"] for r in guard.rollbacks) if c is not None)
    assert trainer.optimizers[0].param_groups[0]["lr"] <= ceiling * (1 + 1e-12)  # what a checkpoint would save


def test_healthy_run_never_rolls_back_and_a_data_shift_only_warns(tmp_path):
    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5)
    trainer = _trainer(tmp_path, [guard], 200)
    trainer.fit(_Regression(shift_from=100))  # the targets change at batch 100: the loss jumps and stays up
    assert guard.rollbacks == [] and guard.stopped_step is None and trainer.global_step == 200
    warnings = [a for a in guard.hub.history if a.severity != "info"]
    assert [a.kind for a in warnings] == ["data_shift"]
    assert warnings[0].step >= 100 and "the data changed" in warnings[0].message

    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5)
    _trainer(tmp_path / "h", [guard], 200).fit(_Regression())
    assert guard.hub.history == [] and guard.rollbacks == []


def test_a_loss_term_switched_on_mid_run_only_warns(tmp_path):
    """``training_step`` adds a penalty from step 100: the loss jumps more than tenfold at once, and the last normal
    batches, evaluated again, jump with it, which alone reads as weights that diverged. The weights of the
    snapshot from before the jump find those batches as hard: the loss function changed. One ``objective_change``
    warning (in TensorBoard's Text tab too), no rollback, and the run goes on at the new level."""
    from conftest import tb_texts
    from lightning.pytorch.loggers import TensorBoardLogger

    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = _trainer(tmp_path, [guard], 200, logger=logger)
    trainer.fit(_Regression(penalty_from=100))
    assert guard.rollbacks == [] and guard.stopped_step is None and trainer.global_step == 200
    warnings = [a for a in guard.hub.history if a.severity != "info"]
    assert [(a.step, a.kind) for a in warnings] == [(100, "objective_change")]
    assert "the loss function changed" in warnings[0].message and "weights of step 95" in warnings[0].message
    texts = [text for tag, rows in tb_texts(logger.log_dir).items() for _, text in rows]
    assert any("objective_change" in t for t in texts)

    # the same jump made by weights that broke (the learning rate at 5.0 from step 100) is still rolled back
    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5)
    _trainer(tmp_path / "u", [guard], 200).fit(_Regression(unstable_from=100))
    assert guard.rollbacks and not any(a.kind == "objective_change" for a in guard.hub.history)


def test_a_run_resumed_on_new_data_is_not_stopped(tmp_path):
    """A second stage resumes the first stage's checkpoint on new data (the targets change sign). Its first loss,
    computed with the checkpoint's own weights, is far above the level saved with them, and no snapshot of the new
    fit predates it, so the weights cannot be asked; nothing has updated them since the checkpoint, so it is the
    data (or the loss function): one ``data_shift`` warning, no action, and the run completes. It was stopped on
    its third step before. The same resume with weights that break after its first step (learning rate 5.0) is
    still rolled back."""
    pl.seed_everything(0)
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True)
    _trainer(tmp_path, [DivergenceGuard(every_n_steps=5), checkpoints], 100, enable_checkpointing=True).fit(
        _Regression())
    last = str(tmp_path / "ck" / "last.ckpt")

    guard = DivergenceGuard(every_n_steps=5)
    trainer = _trainer(tmp_path / "new", [guard], 200)
    trainer.fit(_Regression(shift_from=100), ckpt_path=last)
    assert guard.rollbacks == [] and guard.stopped_step is None and trainer.global_step == 200
    warnings = [a for a in guard.hub.history if a.severity != "info"]
    assert [a.kind for a in warnings] == ["data_shift"] and "first step after resuming" in warnings[0].message
    # the checkpoint said its weights were sound when it was saved (the last batches before it, evaluated again)
    assert "when it was saved, its weights still lost" in warnings[0].message

    guard = DivergenceGuard(every_n_steps=5)
    _trainer(tmp_path / "broken", [guard], 200).fit(_Regression(unstable_from=100), ckpt_path=last)
    assert guard.rollbacks and guard.rollbacks[0]["step"] > 100


def test_a_second_fit_of_the_same_trainer_on_new_data_is_not_stopped(tmp_path):
    """The same reasoning for a second ``fit`` of the same Trainer (the guard keeps its loss history): its first
    step uses the weights the first fit ended with, so a rise that begins there is the new data."""
    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5)
    trainer = _trainer(tmp_path, [guard], 100)
    trainer.fit(_Regression())
    trainer.fit_loop.epoch_loop.max_steps = 200
    trainer.fit(_Regression(shift_from=0))  # new targets from the second fit's first step
    assert guard.rollbacks == [] and guard.stopped_step is None and trainer.global_step == 200
    assert [a.kind for a in guard.hub.history if a.severity != "info"] == ["data_shift"]


def test_nan_batch_through_batchnorm_is_rolled_back_with_finite_buffers(tmp_path):
    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=10, snapshot_every_n_checks=2)
    model = _Regression(bn=True, nan_batch=33)
    _trainer(tmp_path, [guard], 80).fit(model)
    assert [(r["step"], r["to_step"]) for r in guard.rollbacks] == [(33, 20)]  # on the NaN step itself
    assert [(a.step, a.kind) for a in guard.hub.history if a.severity == "critical"] == [(33, "nonfinite")]
    assert all(torch.isfinite(t).all() for t in model.state_dict().values() if t.is_floating_point())

    # with action="stop" the checkpoint's BatchNorm statistics are the last good ones, not NaN
    pl.seed_everything(0)
    guard = DivergenceGuard(action="stop", every_n_steps=10, dirpath=str(tmp_path / "ck"))
    _trainer(tmp_path / "s", [guard], 80).fit(_Regression(bn=True, nan_batch=33))
    saved = torch.load(guard.stop_checkpoint, weights_only=False)["state_dict"]
    assert torch.isfinite(saved["bn.running_mean"]).all() and torch.isfinite(saved["bn.running_var"]).all()


def test_bad_rollback_arguments():
    with pytest.raises(ValueError, match="lr_factor"):
        DivergenceGuard(lr_factor=0.0)
    with pytest.raises(ValueError, match="needs snapshots"):
        DivergenceGuard(snapshot_every_n_checks=None)
    with pytest.raises(ValueError, match="max_rollbacks"):
        DivergenceGuard(max_rollbacks=0)
    with pytest.raises(FileNotFoundError, match="alerts.jsonl"):
        DivergenceGuard(skip_batches="/nonexistent/alerts.jsonl")


# ----------------------------------------------------------------------------- DDP (2 gloo ranks)


class _DDPRegression(_Regression):
    def __init__(self, out_dir: str, jump_at: int = -1):
        super().__init__()
        self.out_dir, self.jump_at = out_dir, jump_at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.jump_at:
            self.optimizers().param_groups[0]["lr"] = 5.0
        lo = ((2 * batch_idx + self.global_rank) * BATCH) % N  # each rank its own data
        return torch.nn.functional.mse_loss(self.lin(self.x[lo:lo + BATCH]), self.y[lo:lo + BATCH])

    def on_train_end(self):
        guard = next(c for c in self.trainer.callbacks if isinstance(c, DivergenceGuard))
        with open(os.path.join(self.out_dir, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"rollbacks": [(r["step"], r["to_step"]) for r in guard.rollbacks],
                       "weights": [float(v) for v in torch.cat([p.detach().flatten() for p in self.parameters()])],
                       "lr": self.optimizers().param_groups[0]["lr"]}, fh)


def test_ddp_ranks_roll_back_together(tmp_path):
    # only rank 1 raises a critical alert at step 27; both ranks roll back at 30 to the snapshot of 20
    guard = DivergenceGuard(every_n_steps=5, snapshot_every_n_checks=2)
    trainer = pl.Trainer(
        max_steps=50, accelerator="cpu", devices=2, strategy="ddp_spawn", callbacks=[_CriticalAt(27, rank=1), guard],
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    fit_ddp_spawn(trainer, _DDPRegression(str(tmp_path)))
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert results[0]["rollbacks"] == results[1]["rollbacks"] == [[30, 20]]
    assert results[0]["weights"] == results[1]["weights"]  # the replicas stayed identical
    assert results[0]["lr"] == results[1]["lr"] == pytest.approx(1e-2)


def test_ddp_ranks_judge_every_step_alike_and_roll_back_together(tmp_path):
    # the learning rate jumps at step 33 on both ranks (each with its own data): between the guard's checks, every
    # rank judges the same (mean) loss series and takes the same decision on the same step
    guard = DivergenceGuard(every_n_steps=10)
    trainer = pl.Trainer(
        max_steps=50, accelerator="cpu", devices=2, strategy="ddp_spawn", callbacks=[guard], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
    )
    fit_ddp_spawn(trainer, _DDPRegression(str(tmp_path), jump_at=33))
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert results[0]["rollbacks"] == results[1]["rollbacks"]
    assert len(results[0]["rollbacks"]) >= 1 and results[0]["rollbacks"][0][1] == 30
    assert 33 <= results[0]["rollbacks"][0][0] < 40  # before the next check
    assert results[0]["weights"] == results[1]["weights"]


def test_one_hard_batch_is_not_a_divergence(tmp_path):
    # batch 70's targets are 30x larger: its loss surges, but the last normal batches, evaluated again, are as easy
    # as before: nothing is said, nothing is done (the batch is learned from like any other)
    class _HardBatch(_Regression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * 900.0 if batch_idx == 70 else loss

    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5)
    _trainer(tmp_path, [guard], 120).fit(_HardBatch())
    assert guard.rollbacks == [] and [a for a in guard.hub.history if a.severity != "info"] == []
    assert guard._hard_batch == 70


@pytest.mark.parametrize("action", ["rollback", "stop"])
@pytest.mark.parametrize("guard_first", [True, False])
def test_acting_on_a_noise_scale_check_step_works_in_any_order(tmp_path, tiny_gpt, action, guard_first):
    # the guard acts after every monitor of the step has read its gradients, whatever the callback order
    from lightning_monitor import GradientNoiseScaleMonitor

    pl.seed_everything(0)
    module, loader = tiny_gpt(nan_at_step=15)  # a step on which the noise-scale monitor checks too
    guard = DivergenceGuard(action=action, every_n_steps=5, snapshot_every_n_checks=1)
    gns = GradientNoiseScaleMonitor(every_n_steps=5)
    callbacks = [guard, gns] if guard_first else [gns, guard]
    _trainer(tmp_path, callbacks, 40, logger=False).fit(module, loader)
    if action == "rollback":
        assert [(r["step"], r["to_step"]) for r in guard.rollbacks] == [(15, 10)]
    else:
        assert guard.stopped_step == 15
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_the_same_guard_in_a_second_trainer_starts_clean(tmp_path):
    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5)
    _trainer(tmp_path / "a", [guard], 100).fit(_Regression(glitch=(60, 61, 62)))
    assert len(guard.rollbacks) == 1 and guard._skip
    # a fresh model in a new Trainer: no rollback record, no batch to skip, no history of the last run
    pl.seed_everything(0)
    capture = _Capture()
    _trainer(tmp_path / "b", [guard, capture], 100).fit(_Regression())
    assert guard.rollbacks == [] and guard.hub.history == [] and capture.dropped == []


def test_snapshot_files_outlive_a_killed_process_and_serve_the_resumed_run(tmp_path, monkeypatch):
    from lightning_monitor.snapshot import TrainingSnapshot

    snaps = str(tmp_path / "snaps")
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=55, save_top_k=-1)
    guard = DivergenceGuard(every_n_steps=5, snapshot_every_n_checks=5, snapshot_dir=snaps)  # at 0, 25, 50
    pl.seed_everything(0)
    with monkeypatch.context() as patch:  # a process killed before its teardown leaves its files behind
        patch.setattr(TrainingSnapshot, "discard", lambda self: None)
        _trainer(tmp_path / "a", [guard, ckpt], 55, enable_checkpointing=True).fit(_Regression())
    state = torch.load(tmp_path / "ck" / "epoch=0-step=55.ckpt", weights_only=False)["callbacks"][guard.state_key]
    assert [f["step"] for f in state["snapshot_files"]] == [25, 50]  # keep_snapshots=2

    # resumed with the glitch ahead: the snapshot of step 50, taken by the killed process, is adopted, and the
    # resumed state of step 55 is kept beside it; the divergence at 61 goes back to 55 (it went back to the file of
    # step 50, undoing the five healthy steps the checkpoint held as well)
    pl.seed_everything(0)
    resumed = DivergenceGuard(every_n_steps=5, snapshot_every_n_checks=5, snapshot_dir=snaps)
    capture, steps = _Capture(step=62), []

    class _Held(Callback):
        def on_train_start(self, trainer, pl_module):
            steps.extend(s.step for s in resumed._snapshots)

    trainer = _trainer(tmp_path / "b", [resumed, _Held(), capture], 120)
    trainer.fit(_Regression(glitch=(60, 61, 62)), ckpt_path=str(tmp_path / "ck" / "epoch=0-step=55.ckpt"))
    assert steps == [25, 50, 55]
    assert [(r["step"], r["to_step"]) for r in resumed.rollbacks] == [(61, 55)]
    pl.seed_everything(0)
    ref = _Capture(step=55)
    _trainer(tmp_path / "ref", [ref], 55, logger=False).fit(_Regression())
    _assert_same(capture.module, ref.module)
    # the resumed run's end deletes the files it took over (the step-0 file is one the killed process dropped)
    assert os.listdir(snaps) == ["guard-snapshot-rank0-step=0.pt"]


def test_snapshot_files_missing_on_resume_are_left_out(tmp_path, monkeypatch):
    from lightning_monitor.snapshot import TrainingSnapshot

    snaps = str(tmp_path / "snaps")
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=55, save_top_k=-1)
    pl.seed_everything(0)
    with monkeypatch.context() as patch:
        patch.setattr(TrainingSnapshot, "discard", lambda self: None)
        _trainer(tmp_path / "a", [DivergenceGuard(every_n_steps=5, snapshot_every_n_checks=5, snapshot_dir=snaps),
                                  ckpt], 55, enable_checkpointing=True).fit(_Regression())
    for name in os.listdir(snaps):
        if "step=50" in name:
            os.remove(os.path.join(snaps, name))

    class _Snaps(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not hasattr(self, "steps"):
                self.steps = [s.step for s in resumed._snapshots]

    resumed = DivergenceGuard(every_n_steps=5, snapshot_every_n_checks=5, snapshot_dir=snaps)
    probe = _Snaps()
    _trainer(tmp_path / "b", [resumed, probe], 57).fit(_Regression(), ckpt_path=str(tmp_path / "ck" / "epoch=0-step=55.ckpt"))
    assert probe.steps == [25, 55]  # the file of 50 is gone on this rank: left out; the resumed state is kept


def test_a_snapshot_writes_over_the_memory_of_the_one_it_pushes_out(tmp_path):
    """Host-memory snapshots recycle the tensors of the snapshot they replace (no fresh allocation per snapshot),
    and every kept snapshot still holds its own step's state: rolling back to each gives that step's weights."""
    from lightning_monitor.snapshot import _to_host

    src = {"w": torch.randn(3, 4), "state": {0: {"step": torch.tensor(5.0), "m": torch.randn(7)}}, "lr": 0.1,
           "names": ["a", "b"]}
    first = _to_host(src)
    assert first["w"] is not src["w"] and torch.equal(first["w"], src["w"])
    src["w"].add_(1.0)
    src["state"][0]["m"] = torch.randn(8)  # a shape that no longer fits: allocated anew
    ptr_w, ptr_m = first["w"].data_ptr(), first["state"][0]["m"].data_ptr()
    second = _to_host(src, reuse=first)
    assert second["w"].data_ptr() == ptr_w and torch.equal(second["w"], src["w"])
    assert second["state"][0]["m"].data_ptr() != ptr_m and torch.equal(second["state"][0]["m"], src["state"][0]["m"])
    assert second["lr"] == 0.1 and second["names"] == ["a", "b"]
    src["w"].add_(1.0)
    assert not torch.equal(second["w"], src["w"])  # a copy, not the live tensor

    # every kind of tensor a state can hold: dtypes, a non-contiguous view, a scalar, an empty and a sparse
    # tensor, a tuple; the fused copy gives each its own host copy with the values of the source
    base = torch.arange(12.0).reshape(3, 4)
    mixed = {"half": torch.randn(5).half(), "int": torch.arange(4), "bool": torch.tensor([True, False]),
             "t": base.t(), "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3),
             "sparse": torch.eye(3).to_sparse(), "pair": (torch.ones(2), 3),
             "param": torch.nn.Parameter(torch.randn(2, 2)), "needs_grad": torch.randn(3, requires_grad=True) * 2}
    for reuse in (None, _to_host(mixed)):
        copied = _to_host(mixed, reuse=reuse)  # in grad mode: no copy may join an autograd graph
        assert not any(t.requires_grad for t in (copied["param"], copied["needs_grad"]))
        assert type(copied["param"]) is torch.Tensor
        for key, value in mixed.items():
            got, want = copied[key], value
            if key == "pair":
                assert got[1] == 3
                got, want = got[0], want[0]
            assert got.dtype == want.dtype and got.shape == want.shape and got.layout == want.layout
            assert torch.equal(got.to_dense(), want.to_dense())
            assert got is not want and (want.numel() == 0 or got.layout != torch.strided
                                        or got.data_ptr() != want.data_ptr())
    base.zero_()
    assert copied["t"].sum() == 66.0  # the view's data was copied, not shared

    # in a fit: snapshots every 5 steps, 2 kept; each kept snapshot equals the module's state at its step
    states: dict[int, dict] = {}
    kept: dict[int, dict] = {}
    guard = DivergenceGuard(every_n_steps=5, action="warn")

    class _Record(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            states[trainer.global_step] = {k: v.clone() for k, v in pl_module.state_dict().items()}

        def on_train_end(self, trainer, pl_module):  # before the guard lets its snapshots go
            kept.update({s.step: s.state()["module"] for s in guard._snapshots})

    _trainer(tmp_path, [_Record(), guard], 33).fit(_Regression())
    assert sorted(kept) == [25, 30]
    for step, module in kept.items():
        _assert_same(module, states[step])
    assert kept[25]["lin.weight"].data_ptr() != kept[30]["lin.weight"].data_ptr()


def test_another_monitors_alert_from_steps_a_rollback_undid_is_not_acted_on_again(tmp_path):
    # a critical alert of another monitor at step 43 waits for the guard's check at step 50; the loss explodes at 48
    # (a one-step glitch of the rate) and the guard rolls back to step 40 at step 49. The alert belonged to weights that
    # rollback undid: it used to trigger a second rollback at the check, with the rate scaled down again
    pl.seed_everything(0)
    guard = DivergenceGuard()
    _trainer(tmp_path, [_CriticalAt(43), guard], 80).fit(_Regression(glitch=(48,)))
    assert [(r["step"], r["to_step"]) for r in guard.rollbacks] == [(49, 40)]
    assert guard.stopped_step is None


class _HardBatchThenUnstable(pl.LightningModule):
    """A logistic model on two kinds of batches: A (features 0-3) and B (features 4-7), alternating. At step 48 a
    B batch 20 times as large with its labels flipped (a hard batch: the weights are not to blame for its loss), whose
    update breaks the B weights; steps 49-50 are A batches, which do not see that, and 51 is a B batch again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)
        self.teacher = torch.randn(8, generator=torch.Generator().manual_seed(0))

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(32, 8, generator=g)
        kind = {46: "B", 47: "B", 48: "B", 49: "A", 50: "A", 51: "B"}.get(step, "AB"[step % 2])
        x[:, 4:] *= kind == "B"
        x[:, :4] *= kind == "A"
        y = (x @ self.teacher > 0).long()
        if step in (46, 47):
            x = 2 * x  # easy when seen (their labels are the teacher's), hard for broken B weights
        if step == 48:
            x, y = 20 * x, 1 - y
        return x, y

    def training_step(self, batch, batch_idx):
        x, y = self._batch(int(batch[0]))  # the batch is its step's index (one epoch, in order): replays see it again
        return torch.nn.functional.cross_entropy(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_weights_broken_after_a_hard_batch_are_not_taken_for_a_new_loss_function(tmp_path):
    """A hard batch's update broke the weights while the next batches looked normal, and a snapshot was taken in
    between (step 50). When the loss surged at 51, the batches before it lost more again, and the snapshot of step 50,
    asked as the weights "from before the surge", found them as hard: the guard called it a new loss function, took
    no action and made the broken level the normal (an Esm classifier near a loss of 0, whose spikes then went on). The
    weights from before the hard batch are the ones known good: the surge is the weights', rolled back to them."""
    guard = DivergenceGuard()
    trainer = _trainer(tmp_path, [guard], 60)
    trainer.fit(_HardBatchThenUnstable(), torch.utils.data.DataLoader(torch.arange(64), batch_size=1))
    kinds = [(a.step, a.kind) for a in guard.hub.history if a.severity != "info"]
    assert (51, "loss_explosion") in kinds and not any(k == "objective_change" for _, k in kinds), kinds
    assert guard._hard_batch is None or guard._hard_batch == 48
    assert [(r["step"], r["to_step"]) for r in guard.rollbacks][:1] == [(51, 40)]


class _HeadJump(_Regression):
    """Two parameter groups, a hidden layer and a head, both at 1e-2; at step 60 the head's rate alone is set x500
    (kept from then on: the run sets it once)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        if self.global_step == 60 and not getattr(self, "_jumped", False):
            self._jumped = True
            self.optimizers().param_groups[1]["lr"] *= 500.0
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.AdamW([{"params": self.lin[0].parameters()}, {"params": self.lin[2].parameters()}], lr=1e-2)


def test_a_rollback_caps_only_the_rates_that_rose(tmp_path):
    # the head's rate jumped, the hidden layer's never moved: the rollback had also halved the hidden layer's rate,
    # for good ("capped at a fraction of the rate that diverged", per group, whether or not that group's rate rose)
    pl.seed_everything(0)
    guard = DivergenceGuard()
    _trainer(tmp_path, [guard], 120).fit(model := _HeadJump())
    assert guard.rollbacks and guard.stopped_step is None
    first = guard.rollbacks[0]
    assert first["lr_scale"] == 1.0 and first["lr_ceiling"][0][0] == 0.01 and first["lr_ceiling"][0][1] <= 0.01
    groups = model.optimizers().param_groups
    assert groups[0]["lr"] == 0.01 and groups[1]["lr"] <= 0.01
    said = next(a for a in guard.hub.history if a.kind == "rolled_back").message
    assert "1 of 2 parameter groups: optimizer 0 group 1" in said and "the others kept" in said


def test_a_stop_says_when_its_state_holds_the_rates_that_diverged(tmp_path):
    # the head's rate was set x500 at step 60, before the snapshot of that step: the stop's checkpoint holds the
    # weights of step 60 and the rate that diverged; resumed, the run diverges again, which the message now says
    pl.seed_everything(0)
    guard = DivergenceGuard(action="stop", dirpath=str(tmp_path / "ck"))
    _trainer(tmp_path, [guard], 120).fit(_HeadJump())
    assert guard.stopped_step is not None
    said = next(a for a in guard.hub.history if a.kind == "stopped").message
    saved = torch.load(guard.stop_checkpoint, weights_only=False)["optimizer_states"][0]["param_groups"]
    assert guard.stopped_step == 61 and "holds the state of step 60" in said
    assert saved[1]["lr"] == 5.0 and saved[0]["lr"] == 0.01
    assert "above those of the lowest smoothed loss (5 against 0.01)" in said and "may diverge again" in said


class _OneCorruptBatch(pl.LightningModule):
    """A linear regression on fresh batches (the batch is its step's index); the batch of step 80 has its inputs
    scaled x10 (corrupt data): its loss is hard for every weights, and its update breaks the weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 1)
        self.w = torch.randn(8, generator=torch.Generator().manual_seed(1))

    def training_step(self, batch, batch_idx):
        step = int(batch[0])
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(32, 8, generator=g)
        y = x @ self.w + 0.1 * torch.randn(32, generator=g)
        if step == 80:
            x = 10 * x
        return torch.nn.functional.mse_loss(self.lin(x).squeeze(1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02)


def test_a_rollback_over_bad_data_says_why_the_rate_is_kept(tmp_path):
    # the critical alert advises a lower rate; the rollback, finding the rise began with a batch earlier weights found
    # hard too, keeps the rate (bad data): its message said nothing of that
    guard = DivergenceGuard()
    _trainer(tmp_path, [guard], 100).fit(_OneCorruptBatch(), torch.utils.data.DataLoader(torch.arange(200), batch_size=1))
    assert [(r["step"], r["to_step"], r["lr_factor"], r["diverged"]) for r in guard.rollbacks] == [(81, 70, 1.0, False)]
    (said,) = [a for a in guard.hub.history if a.kind == "rolled_back"]
    assert "taken for bad data" in said.message and "learning rates are kept" in said.message


def test_skip_batches_reads_the_rollbacks_a_resume_into_the_same_folder_moved_aside(tmp_path):
    # attempt 1 rolled back over (1, 8) and (1, 9); attempt 2, restarted from an older checkpoint into the same log
    # folder with skip_batches=alerts.jsonl, skipped them without rolling back, and its resume moved the record to
    # alerts.superseded.jsonl: attempt 3, with the same command, read an empty list and trained on them again
    record = {"step": 41, "monitor": "guard", "kind": "rolled_back", "severity": "info", "message": "Rolled back.",
              "details": {"batches": [[1, 8], [1, 9]]}}
    (tmp_path / "alerts.jsonl").write_text("")
    (tmp_path / "alerts.superseded.jsonl").write_text(json.dumps(record) + "\n")
    guard = DivergenceGuard(skip_batches=str(tmp_path / "alerts.jsonl"))
    assert sorted(guard._skip_given) == [(1, 8), (1, 9)]
    # a later rollback in the file itself adds to them, once each
    (tmp_path / "alerts.jsonl").write_text(json.dumps({**record, "details": {"batches": [[1, 9], [2, 0]]}}) + "\n")
    guard = DivergenceGuard(skip_batches=str(tmp_path / "alerts.jsonl"))
    assert sorted(guard._skip_given) == [(1, 8), (1, 9), (2, 0)]


class _StagedUnfreeze(_Regression):
    """Two parameter groups: a head whose rate jumps x1000 at step 40 (the divergence), and a trunk switched off by its
    schedule (rate 0) until step 80, when it is unfrozen."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(8, 8)
        self.lin = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        lo = (batch_idx * BATCH) % N
        return torch.nn.functional.mse_loss(self.lin(self.x[lo:lo + BATCH] + self.trunk(self.x[lo:lo + BATCH])),
                                            self.y[lo:lo + BATCH])

    def configure_optimizers(self):
        opt = torch.optim.SGD([{"params": self.lin.parameters()}, {"params": self.trunk.parameters()}], lr=0.05)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1000.0 if s >= 40 else 1.0,
                                                        lambda s: 0.0 if s < 80 else 0.2])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_a_group_switched_off_at_a_rollback_is_not_held_at_zero(tmp_path):
    # the rollback capped every group at its present rate: the trunk's, 0 before its unfreeze, for good (it never
    # trained, though the message said the other groups were kept)
    pl.seed_everything(0)
    model, guard, lrs = _StagedUnfreeze(), DivergenceGuard(), _LRLog()
    trunk0 = model.trunk.weight.detach().clone()
    logger = CSVLogger(str(tmp_path), name="csv")
    _trainer(tmp_path, [guard, lrs], 160, logger=logger).fit(model)
    first = guard.rollbacks[0]
    assert 40 <= first["to_step"] <= first["step"] <= 45 and guard.stopped_step is None
    assert first["lr_ceiling"][0][0] <= 0.05 + 1e-12  # the head: capped at its rate before the jump
    assert first["lr_ceiling"][0][1] == float("inf")  # the trunk: no cap
    trunk_lr = [g["lr"] for g in model.trainer.optimizers[0].param_groups][1]
    assert trunk_lr > 0.0 and (model.trunk.weight - trunk0).abs().max() > 1e-3
    # the ceiling's inf reaches alerts.jsonl as strict JSON (a string), which readers other than Python's take
    with open(os.path.join(logger.log_dir, "alerts.jsonl"), encoding="utf-8") as fh:
        lines = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) for line in fh]
    rolled = next(line for line in lines if line["kind"] == "rolled_back")
    assert rolled["details"]["lr_ceiling"][0][1] == "inf"


def test_a_run_resumed_from_a_checkpoint_saved_right_after_a_bad_update_stops_with_the_reason(tmp_path):
    """A checkpoint is written after the step's update, which no loss has judged yet: saved right after the update that
    broke the weights (a rate x500 for one step), it holds them. Resumed from it, the first loss surged, no snapshot
    predated it, and the rise was taken for new data: the diverged level became the normal and a later rollback went
    back to the broken weights (a full-data loss 300x that of the run not interrupted). The checkpoint now says what
    the last batches before it lose with the weights it holds: the resumed run stops at its first step, saying why."""
    pl.seed_everything(0)
    every = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    first = DivergenceGuard()
    _trainer(tmp_path, [first, every], 60, enable_checkpointing=True).fit(_Regression(glitch=(40,)))
    assert [(r["step"], r["to_step"]) for r in first.rollbacks][0] == (41, 40)  # the run not interrupted

    bad = torch.load(str(tmp_path / "ck" / "step=41.ckpt"), weights_only=True)  # after update 40, before its judgement
    said = next(v for k, v in bad["callbacks"].items() if k.startswith("DivergenceGuard"))["saved_weights"]
    assert said["step"] == 41 and said["now"] > 5 * said["then"]
    good = torch.load(str(tmp_path / "ck" / "step=40.ckpt"), weights_only=True)
    said = next(v for k, v in good["callbacks"].items() if k.startswith("DivergenceGuard"))["saved_weights"]
    assert said["step"] == 40 and said["now"] < 2 * said["then"]

    guard = DivergenceGuard()
    trainer = _trainer(tmp_path / "resumed", [guard], 60)
    trainer.fit(_Regression(), ckpt_path=str(tmp_path / "ck" / "step=41.ckpt"))
    assert guard.rollbacks == [] and guard.stopped_step == 41 and os.path.isfile(guard.stop_checkpoint)
    critical = [a for a in guard.hub.history if a.severity == "critical"]
    assert [a.kind for a in critical] == ["loss_explosion"] and "update saved last in it" in critical[0].message
    assert not [a for a in guard.hub.history if a.kind == "data_shift"]

    # from the checkpoint before the bad update, the resumed run meets it again and does what the first run did
    guard = DivergenceGuard()
    _trainer(tmp_path / "before", [guard], 60).fit(_Regression(glitch=(40,)),
                                                   ckpt_path=str(tmp_path / "ck" / "step=40.ckpt"))
    assert [(r["step"], r["to_step"]) for r in guard.rollbacks][0] == (41, 40) and guard.stopped_step is None


class _Dropout(_Regression):
    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)
        self.frozen_norm = torch.nn.BatchNorm1d(8).eval()  # kept in eval mode by the user

    def training_step(self, batch, batch_idx):
        lo = (batch_idx * BATCH) % N
        x = self.frozen_norm(self.drop(self.x[lo:lo + BATCH]))
        return torch.nn.functional.mse_loss(self.lin(x), self.y[lo:lo + BATCH])

    def on_train_batch_start(self, batch, batch_idx):
        self.frozen_norm.eval()

    def validation_step(self, batch, batch_idx):
        return None

    def val_dataloader(self):
        return self.train_dataloader()


class _Modes(Callback):
    def __init__(self):
        self.seen = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.seen.append((pl_module.training, pl_module.drop.training, pl_module.frozen_norm.training))


def test_a_checkpoint_written_at_the_end_of_a_validation_says_whether_its_weights_are_sound(tmp_path):
    # the batches are evaluated again in training mode, as they were trained; the modes are put back after
    pl.seed_everything(0)
    ck = ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True)
    modes = _Modes()
    _trainer(tmp_path, [DivergenceGuard(), ck, modes], 40, enable_checkpointing=True, val_check_interval=20,
             limit_val_batches=1).fit(_Dropout())
    assert modes.seen and all(m == (False, False, False) for m in modes.seen)  # saved at a validation's end: eval
    saved = torch.load(str(tmp_path / "ck" / "last.ckpt"), weights_only=True)
    said = next(v for k, v in saved["callbacks"].items() if k.startswith("DivergenceGuard"))["saved_weights"]
    assert 0 < said["now"] < 2 * said["then"]


class _FrozenNorm(_Regression):
    """A regression behind a pretrained BatchNorm the user keeps in eval mode (its statistics of another domain)."""

    def __init__(self, shift_from=None):
        super().__init__(shift_from=shift_from)
        self.norm = torch.nn.BatchNorm1d(8)
        with torch.no_grad():
            self.norm.running_var.fill_(100.0)

    def on_train_batch_start(self, batch, batch_idx):
        self.norm.eval()

    def training_step(self, batch, batch_idx):
        lo = (batch_idx * BATCH) % N
        x, y = self.x[lo:lo + BATCH], self.y[lo:lo + BATCH]
        if self.shift_from is not None and batch_idx >= self.shift_from:
            y = -3.0 * y
        return torch.nn.functional.mse_loss(self.lin(self.norm(x)), y)


def test_a_checkpoint_says_its_weights_are_sound_with_the_modes_they_were_trained_in(tmp_path):
    # the replays ran with every module switched to training mode: a BatchNorm kept in eval mode normalised with the
    # batch's statistics, the sound weights read as broken (134 for 0.28), and a resume on new data stopped at once
    pl.seed_everything(0)
    every = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=100, save_top_k=-1, filename="{step}")
    _trainer(tmp_path, [DivergenceGuard(), every], 200, enable_checkpointing=True).fit(_FrozenNorm())
    saved = torch.load(str(tmp_path / "ck" / "step=200.ckpt"), weights_only=True)["callbacks"]
    said = next(v for k, v in saved.items() if k.startswith("DivergenceGuard"))["saved_weights"]
    assert said["now"] < 2 * said["then"]
    guard = DivergenceGuard()
    trainer = _trainer(tmp_path / "new", [guard], 300)
    trainer.fit(_FrozenNorm(shift_from=200 % (N // BATCH)), ckpt_path=str(tmp_path / "ck" / "step=200.ckpt"))
    assert guard.stopped_step is None and trainer.global_step == 300
    assert [a.kind for a in guard.hub.history if a.severity != "info"] == ["data_shift"]


class _Penalised(pl.LightningModule):
    """A healthy regression whose loss gains an auxiliary term at step ``switch`` (a penalty switched on at a set
    step); ``scale`` makes the targets larger (new, harder data)."""

    def __init__(self, switch: int, scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.switch, self.scale = switch, scale
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=torch.Generator().manual_seed(1))

    def training_step(self, batch, batch_idx):
        lo = (batch_idx * BATCH) % N
        pred = self.net(self.x[lo:lo + BATCH])
        loss = torch.nn.functional.mse_loss(pred, self.scale * self.y[lo:lo + BATCH])
        if self.global_step >= self.switch:
            loss = loss + 3.0 + 0.01 * pred.pow(2).mean()
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(N // BATCH)), batch_size=1)


def test_the_batches_of_an_old_loss_function_are_no_references_after_it_changed(tmp_path):
    # after a loss term switched on (taken for a new loss function, no action), the checkpoint's replays and the end of
    # the fit replayed batches trained under the old one: the sound weights read as broken, the first fit was stopped
    # at its end, and the fit resumed on new data at its first step
    pl.seed_everything(0)
    every = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=151, save_top_k=-1, filename="{step}")
    first = DivergenceGuard(every_n_steps=10)
    _trainer(tmp_path, [first, every], 151, enable_checkpointing=True).fit(_Penalised(150))
    assert [a.kind for a in first.hub.history if a.severity != "info"] == ["objective_change"]
    assert first.stopped_step is None and first.rollbacks == []
    guard = DivergenceGuard(every_n_steps=10)
    trainer = _trainer(tmp_path / "new", [guard], 191)
    trainer.fit(_Penalised(150, scale=2.0), ckpt_path=str(tmp_path / "ck" / "step=151.ckpt"))
    assert guard.stopped_step is None and guard.rollbacks == [] and trainer.global_step == 191


def test_a_loss_term_switched_on_at_the_step_a_checkpoint_is_written_is_no_broken_weights(tmp_path):
    # written after the update of step 149, the checkpoint of step 150 replayed batches trained under the old loss with
    # the new one (the step computes it from its step number): 146x what they lost, read as broken, and a resume from
    # it on the same data was stopped. The newest snapshot's weights, known good, find them as hard: the loss changed
    pl.seed_everything(0)
    every = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=50, save_top_k=-1, filename="{step}")
    first = DivergenceGuard(every_n_steps=10)
    _trainer(tmp_path, [first, every], 160, enable_checkpointing=True).fit(_Penalised(150))
    saved = torch.load(str(tmp_path / "ck" / "step=150.ckpt"), weights_only=True)["callbacks"]
    assert "saved_weights" not in next(v for k, v in saved.items() if k.startswith("DivergenceGuard"))
    guard = DivergenceGuard(every_n_steps=10)
    trainer = _trainer(tmp_path / "again", [guard], 200)
    trainer.fit(_Penalised(150), ckpt_path=str(tmp_path / "ck" / "step=150.ckpt"))
    assert guard.stopped_step is None and guard.rollbacks == [] and trainer.global_step == 200


class _Spiked(_Regression):
    """`_Regression` with the rate set before each update: ``base``, times ``factor`` at the steps in ``spikes``."""

    def __init__(self, base=1e-2, spikes=(), factor=1e4, **kw):
        super().__init__(**kw)
        self.base, self.spikes, self.factor = base, set(spikes), factor

    def on_before_optimizer_step(self, optimizer):
        optimizer.param_groups[0]["lr"] = self.base * (self.factor if self.global_step in self.spikes else 1.0)


def test_a_divergence_right_after_a_data_shift_is_still_caught_at_the_end_of_the_fit(tmp_path):
    # the batches from before a data shift stayed references (the same loss): dropped with it, the last update, which
    # broke the weights at the very step the shift was taken for the new normal, went unjudged by the end of the fit
    pl.seed_everything(0)
    guard = DivergenceGuard()
    _trainer(tmp_path, [guard], 63, logger=False).fit(_Spiked(shift_from=60, spikes=(62,)))
    assert [a.kind for a in guard.hub.history if a.severity == "warning"] == ["data_shift"]
    assert guard.stopped_step == 62 and guard.stop_checkpoint is not None


def test_a_checkpoint_is_not_excused_by_a_snapshot_older_than_its_batches(tmp_path):
    # asked whether the loss function changed, the untrained snapshot of step 0 (every_n_steps=50) found the recent
    # batches hard too, and a checkpoint holding weights a rate x100 had just broken said nothing: the resume went on
    pl.seed_everything(0)
    every = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=41, save_top_k=-1, filename="{step}")
    _trainer(tmp_path, [DivergenceGuard(every_n_steps=50), every], 41, logger=False,
             enable_checkpointing=True).fit(_Spiked(base=0.1, spikes=(40,), factor=100.0))
    saved = torch.load(str(tmp_path / "ck" / "step=41.ckpt"), weights_only=True)["callbacks"]
    said = next(v for k, v in saved.items() if k.startswith("DivergenceGuard"))["saved_weights"]
    assert said["now"] > 10 * said["then"]
    guard = DivergenceGuard(every_n_steps=50)
    _trainer(tmp_path / "again", [guard], 80, logger=False).fit(_Spiked(base=0.1),
                                                                 ckpt_path=str(tmp_path / "ck" / "step=41.ckpt"))
    assert guard.stopped_step == 41


class _SaveEveryStep(pl.Callback):
    """A user's own saver listed before the guard (Lightning moves only `Checkpoint` subclasses last)."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.save_checkpoint(str(self.folder / f"user-{trainer.global_step}.ckpt"))


def test_a_checkpoint_written_after_a_rollback_at_the_same_step_is_judged_on_its_own_weights(tmp_path):
    # the verdict of the file written before the rollback (broken weights) went into the one written after it, at
    # the same step, which holds the weights restored: a resume from it on new data was stopped
    pl.seed_everything(0)
    every = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    guard = DivergenceGuard()
    _trainer(tmp_path, [_SaveEveryStep(tmp_path), guard, every], 44, logger=False,
             enable_checkpointing=True).fit(_Spiked(spikes=(40,), factor=500.0))
    step = guard.rollbacks[0]["step"] + 1
    before = torch.load(str(tmp_path / f"user-{step}.ckpt"), weights_only=True)["callbacks"]
    said = next(v for k, v in before.items() if k.startswith("DivergenceGuard"))["saved_weights"]
    assert said["now"] > 2 * said["then"]  # the weights the user's file holds, before the rollback: broken
    saved = torch.load(str(tmp_path / "ck" / f"step={step}.ckpt"), weights_only=True)["callbacks"]
    said = next(v for k, v in saved.items() if k.startswith("DivergenceGuard")).get("saved_weights")
    assert said is None or said["now"] < 2 * said["then"]  # restored: no batch vouches yet, or sound


def test_an_old_snapshot_does_not_excuse_a_divergence_as_a_new_loss_function(tmp_path):
    # with checks 50 steps apart the newest snapshot was the untrained state of step 0: asked about the recent batches it
    # lost far more than they had, as the loss function's change would make it, and a rate x100 that broke the weights
    # (45x the loss) was taken for a new loss function, no action. Now a rise above the snapshot's own level is asked
    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=50)
    _trainer(tmp_path, [guard], 60, logger=False).fit(_Spiked(base=0.1, spikes=(40,), factor=100.0))
    assert [(r["step"], r["to_step"]) for r in guard.rollbacks] == [(41, 0)]
    assert not [a for a in guard.hub.history if a.kind == "objective_change"]
    # a loss term switched on, with the same snapshots: still a new loss function, no action
    for switch in (30, 70):
        pl.seed_everything(0)
        guard = DivergenceGuard(every_n_steps=50)
        _trainer(tmp_path / str(switch), [guard], 100, logger=False).fit(_Penalised(switch))
        assert [a.kind for a in guard.hub.history if a.severity != "info"] == ["objective_change"], switch
        assert guard.rollbacks == [] and guard.stopped_step is None

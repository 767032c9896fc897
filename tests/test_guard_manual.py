"""DivergenceGuard under manual optimization with one optimizer: the weights-or-data tests replay
``training_step`` with its backward, optimizer steps and scheduler steps made no-ops, so new data is told from
weights that broke, and the replay leaves the step's gradients and the run's weights exactly as they were."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard

STEPS, SWITCH, BATCH = 200, 100, 32


def _data(new_labels: bool) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    centres = 3.0 * torch.randn(10, 16, generator=g)
    y = torch.randint(0, 10, (STEPS * BATCH,), generator=g)
    x = centres[y] + 0.3 * torch.randn(STEPS * BATCH, 16, generator=g)
    if new_labels:  # from step SWITCH on, every label moves by 3 classes: new data, not a divergence
        y = torch.where(torch.arange(len(y)) >= SWITCH * BATCH, (y + 3) % 10, y)
    return TensorDataset(x, y)


class _Manual(pl.LightningModule):
    """A classifier trained by hand: zero_grad, manual_backward, clip, step and a scheduler step in
    ``training_step``. ``blowup``: the learning rate multiplied by 3000 at step SWITCH (the weights break)."""

    def __init__(self, blowup: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.blowup = blowup
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=10.0, gradient_clip_algorithm="norm")
        if self.blowup and self.global_step == SWITCH:
            for group in opt.param_groups:
                group["lr"] *= 3000.0
        opt.step()
        self.lr_schedulers().step()
        # nothing returned: the guard takes the loss given to manual_backward

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-3)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)]


def _fit(tmp_path, model, guard=None):
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                         callbacks=[guard] if guard else [], enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(model, DataLoader(_data(not model.blowup), batch_size=BATCH))
    return trainer


def test_new_data_under_manual_optimization_only_warns(tmp_path) -> None:
    """The labels change at step 100: a `data_shift` warning, no action (before, the guard could not evaluate a
    batch under manual optimization: it rolled back and stopped the run at step 114)."""
    guard = DivergenceGuard()
    trainer = _fit(tmp_path, _Manual(), guard)
    assert guard.rollbacks == [] and guard.stopped_step is None and trainer.global_step == STEPS
    assert [a.kind for a in guard.hub.history if a.severity != "info"] == ["data_shift"]


def test_weights_that_break_under_manual_optimization_are_rolled_back(tmp_path) -> None:
    guard = DivergenceGuard()
    _fit(tmp_path, _Manual(blowup=True), guard)
    assert guard.rollbacks and guard.rollbacks[0]["step"] > SWITCH


def test_the_replay_changes_nothing_in_the_run(tmp_path) -> None:
    """With ``action="warn"`` the guard replays steps (it judges the label change) but never acts: the weights,
    the optimizer's state and the scheduler's are bit for bit those of the same run without the guard."""
    plain = _Manual()
    trainer = _fit(tmp_path / "plain", plain)
    guard = DivergenceGuard(action="warn")
    guarded = _Manual()
    guarded_trainer = _fit(tmp_path / "guarded", guarded, guard)
    assert any(a.kind == "data_shift" for a in guard.hub.history)  # the replay did run
    for a, b in zip(plain.state_dict().values(), guarded.state_dict().values()):
        assert torch.equal(a, b)
    state_a, state_b = trainer.optimizers[0].state_dict()["state"], guarded_trainer.optimizers[0].state_dict()["state"]
    assert all(torch.equal(state_a[k]["exp_avg"], state_b[k]["exp_avg"]) for k in state_a)
    sched_a, sched_b = trainer.lr_scheduler_configs[0].scheduler, guarded_trainer.lr_scheduler_configs[0].scheduler
    assert sched_a.last_epoch == sched_b.last_epoch == STEPS
    # the replay's no-ops are gone: the module's and the optimizer's own attributes are as in the plain run
    assert set(vars(guarded)) == set(vars(plain)) and "manual_backward" not in vars(guarded)
    for opt_a, opt_b in zip(trainer.optimizers, guarded_trainer.optimizers):
        assert set(vars(opt_a)) == set(vars(opt_b))
        assert vars(opt_a).get("step", None).__class__ is vars(opt_b).get("step", None).__class__


class _ClosureStep(_Manual):
    """A step that takes the loss back from ``opt.step(closure)``: the replay (whose ``step`` does nothing and
    returns None) cannot run it."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch

        def closure():
            loss = F.cross_entropy(self.net(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        self.last_loss = opt.step(closure=closure).detach()


def test_a_step_the_replay_cannot_run_is_said_once_and_training_goes_on(tmp_path) -> None:
    import pytest

    guard = DivergenceGuard()
    with pytest.warns(UserWarning, match="could not run `training_step` again on a kept batch"):
        trainer = _fit(tmp_path, _ClosureStep(), guard)
    assert trainer.global_step > SWITCH  # the fit went on past the label change (judged as before, without the test)


class _TwoStepsPerBatch(pl.LightningModule):
    """One optimizer stepped twice a batch, once on each half: the same updates as automatic optimization on batches
    half the size."""

    def __init__(self, manual: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = not manual
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.automatic_optimization:
            return F.cross_entropy(self.net(x), y)
        opt, half = self.optimizers(), len(x) // 2
        for xs, ys in ((x[:half], y[:half]), (x[half:], y[half:])):
            opt.zero_grad()
            self.manual_backward(F.cross_entropy(self.net(xs), ys))
            opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_two_steps_per_batch_are_judged_like_the_same_steps_under_automatic_optimization(tmp_path) -> None:
    """A well-separated classifier whose loss falls to about 1e-4 and has a hard batch at step 57. The replay of a
    two-step batch gives the loss of both halves under one set of weights, the step's loss was one half's: compared,
    the difference looked like broken weights (an `objective_change` warning, and with `action="stop"` a stop at
    step 57, while the same updates under automatic optimization drew nothing). With several steps a batch the
    replay's tests are off, said once."""
    g = torch.Generator().manual_seed(0)
    centres = 2 * torch.randn(4, 16, generator=g)
    y = torch.randint(0, 4, (256,), generator=g)
    x = centres[y] + torch.randn(256, 16, generator=g)
    runs = {}
    for manual in (False, True):
        guard = DivergenceGuard(every_n_steps=3, action="stop", snapshot_every_n_checks=None)
        pl.seed_everything(0)
        trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False, callbacks=[guard],
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
        trainer.fit(_TwoStepsPerBatch(manual), DataLoader(TensorDataset(x, y), batch_size=16 if manual else 8))
        runs[manual] = (trainer.global_step, guard.stopped_step, [a.kind for a in guard.hub.history])
    assert runs[False] == (64, None, [])
    assert runs[True] == (64, None, ["several_steps_per_batch"])

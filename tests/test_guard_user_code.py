"""DivergenceGuard with training code that does what users' code does: a ``training_step`` that pops its labels
from the batch (the guard replays kept batches), one that cannot run twice, and a learning rate set by the module
after the guard has capped it (a warm-up in ``optimizer_step`` or in the module's own ``on_train_batch_start``)."""

from __future__ import annotations

import math
import random

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_monitor import DivergenceGuard
from lightning_monitor.alerts import AlertHub

N, BATCH = 1024, 32  # 32 steps an epoch


def _data(seed: int = 0, hard_from: int | None = None):
    g = torch.Generator().manual_seed(seed)
    centers = 0.6 * torch.randn(4, 16, generator=g)
    y = torch.randint(0, 4, (N,), generator=g)
    x = centers[y] + torch.randn(N, 16, generator=g)
    if hard_from is not None:  # from this sample on the labels are random: the data gets harder, the run is healthy
        y[hard_from:] = torch.randint(0, 4, (N - hard_from,), generator=g)
    return [{"x": x[i], "y": y[i]} for i in range(N)]


class _PopLabels(pl.LightningModule):
    """An MLP whose ``training_step`` pops ``y`` from the batch dict; ``boost_at``: the learning rate x``boost`` from
    that step on (set in ``optimizer_step`` when ``late_lr``, i.e. after the callbacks' ``on_train_batch_start``)."""

    def __init__(self, data, lr=3e-3, boost_at=None, boost=200.0, late_lr=False, fail_replay=False):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.data, self.lr, self.boost_at, self.boost, self.late_lr = data, lr, boost_at, boost, late_lr
        self.fail_replay, self.seen = fail_replay, set()

    def training_step(self, batch, batch_idx):
        if self.fail_replay:  # a step that consumes something: a second call on the same batch fails
            key = (self.current_epoch, batch_idx)
            if key in self.seen:
                raise RuntimeError("this batch was already consumed")
            self.seen.add(key)
        y = batch.pop("y")
        return F.cross_entropy(self.net(batch["x"]), y)

    def _lr_now(self) -> float:
        return self.lr * (self.boost if self.boost_at is not None and self.global_step >= self.boost_at else 1.0)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if self.late_lr:  # nanoGPT-style: the rate of this step set right before the update
            for group in optimizer.param_groups:
                group["lr"] = self._lr_now()
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        if self.late_lr or self.boost_at is None:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: self.boost if s >= self.boost_at else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=BATCH, shuffle=False)


def _fit(tmp_path, model, guard, steps):
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, callbacks=[guard], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, logger=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(model)
    return trainer


def _held_out_loss(model) -> float:
    batch = _data(seed=0)
    x = torch.stack([b["x"] for b in batch])
    y = torch.stack([b["y"] for b in batch])
    with torch.no_grad():
        return float(F.cross_entropy(model.net(x), y))


def test_a_step_that_pops_its_labels_is_replayed_on_a_whole_batch(tmp_path):
    # the learning rate x200 from step 60: the surge test replays the last normal batches, from which `training_step`
    # had popped "y" (the replay failed with KeyError: 'y' and ended the fit)
    model = _PopLabels(_data(), boost_at=60)
    guard = DivergenceGuard()
    trainer = _fit(tmp_path, model, guard, 120)
    assert trainer.global_step == 120
    assert guard.rollbacks and 60 <= guard.rollbacks[0]["step"] <= 66
    assert "loss explosion" in guard.rollbacks[0]["reasons"]


def test_harder_data_with_popped_labels_is_a_data_shift(tmp_path):
    # healthy: from step 16 on the labels are random. The weights-or-data test asks older snapshots about the current
    # batch (which had lost its "y" too): the verdict is the data, and nothing acts
    model = _PopLabels(_data(hard_from=16 * BATCH))
    guard = DivergenceGuard()
    trainer = _fit(tmp_path, model, guard, 64)
    assert trainer.global_step == 64 and guard.rollbacks == [] and guard.stopped_step is None
    assert ("data_shift", None) in guard._conditions


def test_a_step_that_cannot_run_twice_leaves_the_fit_going(tmp_path):
    model = _PopLabels(_data(), boost_at=60, fail_replay=True)
    guard = DivergenceGuard()
    with pytest.warns(UserWarning, match="could not run `training_step` again on a kept batch"):
        trainer = _fit(tmp_path, model, guard, 120)
    assert trainer.global_step == 120


class _LrSeen(pl.Callback):
    """The learning rate each update used (read in the optimizer's step post-hook: the closure, with every hook of the
    step, runs inside `step`, before the update)."""

    def __init__(self):
        self.lrs: list[float] = []

    def on_train_start(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        opt.register_step_post_hook(lambda o, args, kwargs: self.lrs.append(o.param_groups[0]["lr"]))


def test_a_rate_set_in_optimizer_step_is_held_under_the_rollback_ceiling(tmp_path):
    # the module sets the rate in `optimizer_step` (after the callbacks' on_train_batch_start, where the guard caps it):
    # x200 from step 60. The cap used to be overwritten on every step: the run exploded again after each rollback, and
    # after four the guard stopped it
    model = _PopLabels(_data(), boost_at=60, late_lr=True)
    guard, seen = DivergenceGuard(), _LrSeen()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", max_steps=160, callbacks=[guard, seen], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, logger=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(model)
    assert trainer.global_step == 160 and guard.stopped_step is None
    assert len(guard.rollbacks) == 1
    step, ceiling = guard.rollbacks[0]["step"], guard.rollbacks[0]["lr_ceiling"][0][0]
    assert ceiling <= 0.5 * model.lr * model.boost
    after = seen.lrs[step + 1:]
    assert after and max(after) <= ceiling  # every update after the rollback used a rate under the ceiling
    kinds = [a.kind for a in AlertHub.for_trainer(trainer).history]
    assert kinds.count("lr_overridden") == 1
    assert math.isfinite(_held_out_loss(model))


class _NanGradAt(_PopLabels):
    """A finite loss whose gradient is NaN at the steps ``nan_steps`` (a degenerate sample: ``sqrt`` at 0 times 0)."""

    def __init__(self, data, nan_steps):
        super().__init__(data)
        self.nan_steps = set(nan_steps)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step in self.nan_steps:
            loss = loss + 0.0 * torch.sqrt(self.net[0].weight.sum() * 0.0)
        return loss


@pytest.mark.parametrize("nan_steps, factors", [
    # rare bad batches, the run confirmed healthy in between (a snapshot two intervals after each rollback): each
    # rollback keeps the rate, and none counts toward max_rollbacks (the 4th stopped the run, the rate cut to 0.016x)
    ((40, 80, 120, 160, 200, 240), [1.0] * 6),
    # bad batches close together (before the run was confirmed healthy again, and right after a rollback): the last
    # normal batches, evaluated again, find the weights intact, so each is a new episode too (they were repeats: the
    # rate halved, and a masked-LM batch whose labels were all ignored every 20 steps stopped the run at step 99)
    ((40, 55), [1.0, 1.0]),
    ((40, 41, 42, 43, 44, 100, 120, 140, 160), [1.0] * 9),
])
def test_rare_non_finite_gradients_each_start_a_new_episode(tmp_path, nan_steps, factors):
    model = _NanGradAt(_data(), nan_steps)
    guard = DivergenceGuard()
    trainer = _fit(tmp_path, model, guard, 260)
    assert trainer.global_step == 260 and guard.stopped_step is None
    assert [r["step"] for r in guard.rollbacks] == list(nan_steps)
    assert [r["lr_factor"] for r in guard.rollbacks] == factors
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _BrokenFrom(_PopLabels):
    """From step ``at`` on every loss is NaN, the replays' too: the weights (here, the step) are what is broken."""

    def __init__(self, data, at):
        super().__init__(data)
        self.at = at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step >= self.at else loss


def test_non_finite_steps_whose_weights_fail_the_last_normal_batches_are_repeats(tmp_path):
    model = _BrokenFrom(_data(), at=40)
    guard = DivergenceGuard()
    trainer = _fit(tmp_path, model, guard, 120)
    assert [r["lr_factor"] for r in guard.rollbacks] == [1.0, 0.5, 0.25, 0.125]
    assert guard.stopped_step is not None and trainer.global_step < 120


# ----------------------------------------------------------------------------- masks, self-differentiating steps


class _MaskedLM(pl.LightningModule):
    """A causal attention LM whose mask is a buffer of -inf above the diagonal (a common pattern); ``nan_at``: a
    BatchNorm-like buffer turned NaN at that step (a non-finite batch reaching a buffer)."""

    T, V = 12, 16

    def __init__(self, nan_at=None):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(self.V, 32)
        self.att = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, self.V)
        self.register_buffer("mask", torch.triu(torch.full((self.T, self.T), float("-inf")), 1))
        self.register_buffer("stat", torch.zeros(32))
        self.nan_at = nan_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.emb(x)
        h = h + self.att(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        if self.nan_at is not None and self.global_step == self.nan_at:
            with torch.no_grad():
                self.stat.fill_(float("nan"))
        return F.cross_entropy(self.head(h).reshape(-1, self.V), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, self.V, (640, self.T + 1), generator=g)
        x[:, 1:] = (x[:, :-1] * 3 + 1) % self.V
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:]), batch_size=16)


def test_a_buffer_of_minus_inf_by_design_does_not_stop_the_run(tmp_path):
    # the check of the state before each snapshot found the mask non-finite at step 0: no snapshot could ever be
    # taken, and the guard stopped the run at its first step
    guard = DivergenceGuard()
    trainer = _fit(tmp_path, _MaskedLM(), guard, 40)
    assert trainer.global_step == 40 and guard.stopped_step is None and not guard.rollbacks
    said = [a for a in AlertHub.for_trainer(trainer).history if a.kind == "infinite_buffers"]
    assert len(said) == 1 and "mask" in said[0].message and "stat" not in said[0].message


class _LargeConstants(_MaskedLM):
    """The masked LM with buffers of large finite constants: float32's lowest value (the masking constant many models
    keep, ``torch.finfo(dtype).min``) and a float64 1e300."""

    def __init__(self, nan_at=None):
        super().__init__(nan_at)
        self.register_buffer("fill", torch.full((4,), torch.finfo(torch.float32).min))
        self.register_buffer("wide", torch.full((2,), 1e300, dtype=torch.float64))


def test_buffers_of_large_finite_constants_do_not_stop_the_run(tmp_path):
    # the check before each snapshot read a tensor's 2-norm, whose squares overflow float32 from 1.8e19 on: the buffer
    # of finfo.min read as non-finite, no snapshot was ever taken, and the guard stopped the run at step 0
    guard = DivergenceGuard()
    trainer = _fit(tmp_path, _LargeConstants(), guard, 40)
    assert trainer.global_step == 40 and guard.stopped_step is None and not guard.rollbacks
    assert not [a for a in guard.hub.history if a.kind == "nonfinite"]
    # ... and a buffer that does turn NaN beside them is still caught
    guard = DivergenceGuard()
    _fit(tmp_path, _LargeConstants(nan_at=25), guard, 40)
    assert ("nonfinite", "critical") in [(a.kind, a.severity) for a in guard.hub.history if a.monitor == "guard"]
    assert guard.rollbacks or guard.stopped_step is not None


def test_a_buffer_that_turns_nan_is_still_caught_beside_a_mask(tmp_path):
    guard = DivergenceGuard()
    _fit(tmp_path, _MaskedLM(nan_at=25), guard, 40)
    kinds = [(a.kind, a.severity) for a in guard.hub.history if a.monitor == "guard"]
    assert ("nonfinite", "critical") in kinds
    assert guard.rollbacks or guard.stopped_step is not None


class _Calls:
    """What each call of a step saw, in an object the guard's replays do not put back (they put back the module's own
    lists)."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def append(self, value: bool) -> None:
        self.seen.append(value)


class _InputPenalty(pl.LightningModule):
    """A classifier with an input-gradient penalty (``torch.autograd.grad`` inside ``training_step``) on a
    curriculum: classes 0-4 until step ``switch``, all 10 after (the loss rises: the data got harder). Records
    whether autocast was on in each call."""

    def __init__(self, switch=60, n=120):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
        self.switch, self.n, self.autocast = switch, n, _Calls()

    def training_step(self, batch, batch_idx):
        self.autocast.append(torch.is_autocast_enabled("cpu"))
        x, y = batch
        x = x.clone().requires_grad_(True)
        logits = self.net(x)
        (gx,) = torch.autograd.grad(F.cross_entropy(logits, y, reduction="sum"), x, create_graph=True)
        return F.cross_entropy(logits, y) + 0.01 * gx.float().pow(2).sum(-1).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(22)
        centers = torch.randn(10, 32, generator=g) * 1.6
        ys = [torch.randint(0, 5 if i < self.switch else 10, (32,), generator=g) for i in range(self.n)]
        y = torch.cat(ys)
        x = centers[y] + 1.5 * torch.randn(len(y), 32, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def test_a_step_that_differentiates_itself_is_replayed_with_gradients(tmp_path):
    # the replays ran under no_grad, where `torch.autograd.grad` fails: the weights-or-data test could not run, the
    # harder data was taken for a divergence, and the guard rolled back four times and stopped the healthy run
    model, guard = _InputPenalty(), DivergenceGuard()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "could not run `training_step` again"
        warnings.filterwarnings("ignore", message=".*(LeafSpec|num_workers|does not have many workers).*")
        trainer = _fit(tmp_path, model, guard, 120)
    assert trainer.global_step == 120 and guard.rollbacks == [] and guard.stopped_step is None
    assert guard._replay_grad
    assert any(a.kind == "data_shift" for a in guard.hub.history)


def test_replays_run_under_the_precision_plugins_autocast(tmp_path):
    # bf16-mixed: Lightning runs the step under autocast, and so must the replays (they ran in float32 and their
    # losses were compared with bfloat16 ones)
    model, guard = _InputPenalty(), DivergenceGuard()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", max_steps=120, callbacks=[guard], precision="bf16-mixed", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(model)
    assert len(model.autocast.seen) > 120  # the replays of the weights-or-data test are among the calls
    assert all(model.autocast.seen)


def test_an_anomaly_at_the_first_step_after_a_resume_rolls_back_to_the_checkpoints_state(tmp_path):
    # the snapshots in host memory do not travel with a checkpoint: a NaN at the first check after the resume found no
    # snapshot to go back to, and the guard stopped a run that the uninterrupted one rolled back and trained on
    def fit(steps, guard, ckpt=None):
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(accelerator="cpu", max_steps=steps, callbacks=[guard], enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, logger=False,
                             default_root_dir=str(tmp_path))
        model = _NanGradAt(_data(), nan_steps=[40])
        trainer.fit(model, ckpt_path=ckpt)
        return trainer, model

    trainer, _ = fit(40, DivergenceGuard())
    path = str(tmp_path / "at40.ckpt")
    trainer.save_checkpoint(path)
    guard = DivergenceGuard()
    trainer, model = fit(80, guard, path)
    assert trainer.global_step == 80 and guard.stopped_step is None
    assert [(r["step"], r["to_step"]) for r in guard.rollbacks] == [(40, 40)]
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _ScheduleInABuffer(pl.LightningModule):
    """A classifier whose labels get noisier from step 60 on, the noise level kept in a registered buffer (as a
    teacher-forcing ratio or a curriculum stage often is): the loss rises because the task got harder. Each sample's
    noisy label is fixed (a replay sees the same batch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.register_buffer("noise", torch.zeros(()))
        data = _data()
        self.x = torch.stack([b["x"] for b in data])
        self.y = torch.stack([b["y"] for b in data])
        g = torch.Generator().manual_seed(1)
        self.u, self.other = torch.rand(N, generator=g), torch.randint(0, 4, (N,), generator=g)

    def on_train_batch_start(self, batch, batch_idx):
        with torch.no_grad():
            self.noise.fill_(min(max(self.global_step - 60, 0) / 20.0, 1.0) * 0.9)

    def training_step(self, batch, batch_idx):
        (i,) = batch
        y = torch.where(self.u[i] < self.noise, self.other[i], self.y[i])
        return F.cross_entropy(self.net(self.x[i]), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(N)), batch_size=BATCH)


def test_a_schedule_kept_in_a_buffer_is_not_taken_for_older_weights(tmp_path):
    # the weights-or-data test set each snapshot's whole state, buffers too: the older noise level made the present
    # batches easy for the older weights, the rise was blamed on the weights, and the guard rolled back the healthy
    # run (four times and a stop, with a teacher-forcing ratio in a buffer)
    model, guard = _ScheduleInABuffer(), DivergenceGuard()
    trainer = _fit(tmp_path, model, guard, 160)
    assert trainer.global_step == 160 and guard.rollbacks == [] and guard.stopped_step is None
    # the surge's recent batches, asked with the older weights under the present noise level, are as hard: what the
    # step computes changed (a warning, no action)
    assert any(a.kind in ("objective_change", "data_shift") for a in guard.hub.history)


@pytest.mark.parametrize("after_rollback", [False, True])
def test_a_creep_soon_after_a_rollback_is_judged_as_a_climb(after_rollback):
    # after a warm-up to a rate far too high, the rate of the best loss (the rollback's cap) can be too high as well:
    # the run crept up again and wandered above its best for the rest of it, never 1.5 times its minimum (a climb),
    # so nothing acted again. Within 200 steps of a rollback a creep is judged at once (the weights-or-data test
    # still decides what it is)
    guard = DivergenceGuard()
    guard.alert = lambda *a, **k: None  # no trainer: the alerts go nowhere
    guard._levels = True
    g = torch.Generator().manual_seed(0)
    climbs = []
    for step in range(200):
        if step == 100 and after_rollback:
            guard.rollbacks = [{"step": 99}]
        loss = (1.0 if step < 100 else 1.3) * (1.0 + 0.01 * float(torch.randn((), generator=g)))
        _, start, _ = guard._judge(step, loss, 0.0, False)
        if start is not None and guard._climb_judged and not climbs:
            climbs.append(step)
    assert bool(climbs) == after_rollback
    assert not climbs or (climbs[0] < 130 and guard._climb_after_rollback)  # its message says so


class _WritesItsWeights(pl.LightningModule):
    """Token classification through ``nn.Embedding(max_norm=1)``, which renormalises the rows it looks up in place on
    every forward; ``clamp``: the step also clamps a scale parameter in place through ``.data`` (a projection kept in
    the step)."""

    def __init__(self, clamp: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(30, 16, max_norm=1.0)
        self.scale = nn.Parameter(torch.tensor(3.0))
        self.head = nn.Linear(16, 5)
        self.clamp = clamp

    def training_step(self, batch, batch_idx):
        tokens, y = batch
        if self.clamp:
            self.scale.data.clamp_(max=1.0 + 0.01 * self.global_step)
        return F.cross_entropy(self.head(self.scale * torch.tanh(self.emb(tokens)).mean(1)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _token_loader():
    g = torch.Generator().manual_seed(0)
    tokens, y = torch.randint(0, 30, (64, 7), generator=g), torch.randint(0, 5, (64,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, y), batch_size=8, shuffle=True,
                                       generator=torch.Generator().manual_seed(0))


def _fit_weights(tmp_path, callbacks, clamp=False):
    pl.seed_everything(0, verbose=False)
    model = _WritesItsWeights(clamp)
    pl.Trainer(max_steps=30, accelerator="cpu", logger=False, callbacks=callbacks, enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path).fit(model, _token_loader())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, model


def test_replays_undo_a_steps_writes_into_its_weights(tmp_path):
    # the end-of-fit check replays kept batches under the last weights: the max_norm embedding renormalised their rows
    # in place, and the guarded run ended with other weights than the unguarded one (max difference 6e-4)
    plain, _ = _fit_weights(tmp_path / "plain", [])
    guard = DivergenceGuard()
    guarded, model = _fit_weights(tmp_path / "guarded", [guard])
    assert not guard.rollbacks and guard.stopped_step is None
    for name in plain:
        assert torch.equal(plain[name], guarded[name]), name
    # a replay on demand, of a batch whose rows exceed the norm now, with a clamp that changes a value
    model.clamp = True
    with torch.no_grad():
        model.emb.weight.mul_(3.0)
        model.scale.fill_(2.0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    versions = {k: v._version for k, v in model.named_parameters()}
    loss = guard._batch_loss(model, next(iter(_token_loader())), 0)
    assert loss is not None and math.isfinite(loss)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    from lightning_monitor._compat import versions_settable

    if versions_settable():
        assert {k: v._version for k, v in model.named_parameters()} == versions


def test_replays_are_not_read_by_the_other_monitors_hooks(tmp_path):
    # the guard's replay of a kept batch runs the model's forward; spectral alignment's input hooks stay armed for the
    # whole due step (a layer's every call is read), so a replay while they were armed added its rows to the check's
    from lightning_monitor.probes.inputs import InputCapture

    _, model = _fit_weights(tmp_path, [])
    guard = DivergenceGuard()
    layer = next(m for m in model.modules() if isinstance(m, nn.Linear))
    capture = InputCapture({"layer": layer})
    capture.arm()
    assert guard._batch_loss(model, next(iter(_token_loader())), 0) is not None
    assert capture.take() == {}


class _RescalesForEval(pl.LightningModule):
    """Hugging Face RWKV's habit: the second layer's weight is halved in place on the first forward in eval mode and
    doubled back on the first one in training mode, with a flag on the module saying which; ``calls`` counts the
    training steps run (a counter a step keeps)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.rescaled, self.calls = False, 0

    def forward(self, x):
        if self.training == self.rescaled:
            with torch.no_grad():
                (self.b.weight.mul_ if self.training else self.b.weight.div_)(2.0)
            self.rescaled = not self.training
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))

    def training_step(self, batch, batch_idx):
        self.calls += 1
        return F.cross_entropy(self(batch["x"]), batch["y"])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch["x"]), batch["y"]))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_replays_put_back_what_the_step_sets_on_its_modules(tmp_path):
    # the end-of-fit check replayed `training_step` after the last validation: in training mode the model doubled its
    # weight back and set its flag; the weight was put back, the flag was not, and the next eval forward halved the
    # weight again (a 12-layer RWKV's eval logits were 0.6 off). The step's counter moved too
    data = _data()
    def fit(callbacks):
        pl.seed_everything(0, verbose=False)
        model = _RescalesForEval()
        trainer = pl.Trainer(max_steps=24, accelerator="cpu", logger=False, callbacks=callbacks, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                             val_check_interval=8, num_sanity_val_steps=0)
        loader = lambda part: torch.utils.data.DataLoader(part, batch_size=BATCH, collate_fn=torch.utils.data.default_collate)
        trainer.fit(model, loader(data[:768]), loader(data[768:]))
        return model

    plain, guard = fit([]), DivergenceGuard()
    guarded = fit([guard])
    assert not guard.rollbacks and guard.stopped_step is None
    assert plain.rescaled and guarded.rescaled and guarded.calls == plain.calls == 24
    for (name, a), b in zip(guarded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    x = torch.stack([d["x"] for d in data[:8]])
    plain.eval(), guarded.eval()
    with torch.no_grad():
        assert torch.equal(guarded(x), plain(x))


class _StatefulStep(pl.LightningModule):
    """A step that keeps state the ways users' steps do: a MoCo queue reassigned as a registered buffer, a teacher
    moved by reassigning its parameters' data (MoCo's own momentum update), a memory bank in a dict, counts in a numpy
    array, a plain tensor written through ``.data``, Python's and numpy's random streams, and a rate set from
    ``batch_idx``; ``surge_at``: one step whose loss is 20 times its own (the guard replays kept batches to judge it)."""

    def __init__(self, surge_at=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.teacher = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).requires_grad_(False)
        self.register_buffer("queue", torch.zeros(8, 4))
        self.bank = {"q": torch.zeros(8, 4)}
        self.counts = np.zeros(4)
        self.seen = torch.zeros(4)
        self.surge_at, self.surged = surge_at, False

    def training_step(self, batch, batch_idx):
        x, y = batch["x"], batch["y"]
        with torch.no_grad():
            for pt, ps in zip(self.teacher.parameters(), self.net.parameters()):
                pt.data = pt.data * 0.9 + ps.data * 0.1
            soft = self.teacher(x).softmax(-1)
        self.queue = torch.cat([soft, self.queue])[:8]
        self.bank["q"] = torch.cat([soft, self.bank["q"]])[:8]
        self.counts += np.bincount(y.numpy(), minlength=4)
        self.seen.data[y] += 1.0
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] = 1e-3 * (1.0 + 0.01 * (batch_idx % 5))
        x = x + 0.01 * random.gauss(0.0, 1.0) + 0.01 * float(np.random.randn())
        loss = F.cross_entropy(self.net(x), y) + 0.1 * (self.queue.mean() + self.bank["q"].mean())
        if self.global_step == self.surge_at and not self.surged:
            self.surged = True
            loss = loss * 20
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=1e-3)


@pytest.mark.parametrize("surge_at", [None, 60], ids=["healthy", "one_surge"])
def test_replays_put_back_a_stateful_steps_state(tmp_path, surge_at):
    # each of these was left as the replays had made it: the buffer's new tensor stayed in `_buffers`, the teacher's
    # reassigned data and the `.data` write were not seen, the dict's tensor, the numpy counts and Python's and numpy's
    # random streams were not kept, and the surge test's replay set the kept batch's rate for the update about to run
    def fit(callbacks):
        pl.seed_everything(0, verbose=False)
        model = _StatefulStep(surge_at)
        pl.Trainer(max_steps=100, accelerator="cpu", logger=False, callbacks=callbacks, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path).fit(
            model, torch.utils.data.DataLoader(_data(), batch_size=BATCH, collate_fn=torch.utils.data.default_collate))
        return model, random.random(), float(np.random.rand())

    (plain, *draws), guard = fit([]), DivergenceGuard()
    guarded, *guarded_draws = fit([guard])
    assert not guard.rollbacks and guard.stopped_step is None
    if surge_at is not None:  # the surge was tested on kept batches (a hard batch: no action)
        assert guard._hard_batch is not None
    for (name, a), b in zip(guarded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(guarded.bank["q"], plain.bank["q"]) and torch.equal(guarded.seen, plain.seen)
    assert (guarded.counts == plain.counts).all()
    assert guarded_draws == draws


class _UnpicklableScheduler(_PopLabels):
    """A scheduler holding a closure of the user's (``sched.note = lambda: ...``): its state does not pickle."""

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: self.boost if s >= self.boost_at else 1.0)
        sched.note = lambda: "a closure"
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_a_stop_whose_checkpoint_cannot_be_written_still_stops_cleanly(tmp_path):
    """The stop saves a checkpoint; a state that does not pickle made that save raise, and the fit ended with the error
    (the weights already restored, no `stopped` alert). The stop now goes on, says the checkpoint could not be written,
    and leaves the restored state in memory."""
    healthy = _fit(tmp_path / "healthy", _UnpicklableScheduler(_data(), boost_at=10**6), DivergenceGuard(action="stop"), 90)
    assert healthy.global_step == 90
    guard = DivergenceGuard(action="stop")
    model = _UnpicklableScheduler(_data(), boost_at=60, boost=1000.0)
    trainer = _fit(tmp_path / "run", model, guard, 200)
    assert guard.stopped_step is not None and trainer.global_step < 200
    assert guard.stop_checkpoint is None
    (stopped,) = [a for a in guard.hub.history if a.kind == "stopped"]
    assert stopped.severity == "warning" and "could not be written" in stopped.message
    assert stopped.details["checkpoint"] is None and stopped.details["to_step"] <= 60
    assert _held_out_loss(model) < 1.0  # the restored state from before the jump, not the diverged weights

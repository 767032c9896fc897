"""DivergenceGuard across changes made to the run while it trains: another callback changing the optimizers
(BackboneFinetuning, StochasticWeightAveraging), a second fit with fresh optimizers, a learning rate that comes
back up (warm restarts), and the replays leaving BatchNorm statistics alone."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, StochasticWeightAveraging
from torch import nn

from lightning_monitor import DivergenceGuard, read_alerts
from lightning_monitor.alerts import AlertHub
from lightning_monitor.snapshot import SnapshotMismatch, TrainingSnapshot

N, BATCH = 512, 32  # 16 steps an epoch


def _blobs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centers = 2.0 * torch.randn(3, 8, generator=g)
    y = torch.randint(0, 3, (N,), generator=g)
    return centers[y] + torch.randn(N, 8, generator=g), y


class _BackboneHead(pl.LightningModule):
    """A classifier with a ``backbone`` and a ``head``; ``nan_step``: the loss of that step is NaN. The optimizer takes
    the trainable parameters only (as BackboneFinetuning asks); ``cosine``: a per-epoch cosine schedule."""

    def __init__(self, nan_step=None, cosine=False, bn=False):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32) if bn else nn.Identity(), nn.ReLU())
        self.head = nn.Linear(32, 3)
        self.nan_step, self.cosine = nan_step, cosine
        self.x, self.y = _blobs()

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        lo = (batch_idx * BATCH) % N
        loss = nn.functional.cross_entropy(self(self.x[lo:lo + BATCH]), self.y[lo:lo + BATCH])
        return loss * float("nan") if self.global_step == self.nan_step else loss

    def configure_optimizers(self):
        opt = torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-2)
        if not self.cosine:
            return opt
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(N // BATCH)), batch_size=1)


def _trainer(tmp_path, callbacks, **kw):
    return pl.Trainer(accelerator="cpu", callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, logger=False, default_root_dir=str(tmp_path), **kw)


def test_a_rollback_across_a_backbone_unfreeze_keeps_the_new_parameter_group(tmp_path):
    # the backbone joins the optimizer at step 16 (epoch 1); the NaN at step 18 goes back to the snapshot of step 10,
    # taken when the optimizer had one group: restoring it used to fail ("a different number of parameter groups")
    model = _BackboneHead(nan_step=18)
    guard = DivergenceGuard()
    trainer = _trainer(tmp_path, [guard, BackboneFinetuning(unfreeze_backbone_at_epoch=1)], max_epochs=3)
    trainer.fit(model)
    assert [(r["step"], r["to_step"]) for r in guard.rollbacks] == [(18, 10)]
    assert trainer.current_epoch == 3  # the fit went on to its end
    opt = trainer.optimizers[0]
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]  # the head, then the unfrozen backbone
    assert all(p.requires_grad for p in model.backbone.parameters())
    assert all(p in opt.state for p in model.backbone.parameters())  # trained since the rollback
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_rollback_across_the_swa_scheduler_swap_keeps_swa_going(tmp_path):
    # StochasticWeightAveraging swaps in its SWALR when epoch 1 starts (step 16) and adds `swa_lr` to the groups; the
    # NaN at step 17 goes back to the snapshot of step 10, taken under the cosine schedule (the restore put the cosine's
    # state into SWALR and dropped `swa_lr`: the fit ended with a KeyError at the epoch's end)
    model = _BackboneHead(nan_step=17, cosine=True)
    guard = DivergenceGuard()
    swa = StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=2, annealing_epochs=1)
    trainer = _trainer(tmp_path, [guard, swa], max_epochs=4)
    trainer.fit(model)
    assert [(r["step"], r["to_step"]) for r in guard.rollbacks] == [(17, 10)]
    assert type(trainer.lr_scheduler_configs[0].scheduler).__name__ == "SWALR"
    assert trainer.optimizers[0].param_groups[0]["swa_lr"] == 1e-3
    assert trainer.current_epoch == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _SwapToAdamW(pl.Callback):
    """Replaces the run's optimizer by AdamW when step ``at`` starts (the way a user switches optimizers mid-run)."""

    def __init__(self, at):
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at and not isinstance(trainer.optimizers[0], torch.optim.AdamW):
            trainer.strategy.optimizers = [torch.optim.AdamW(pl_module.parameters(), lr=3e-3)]


class _SgdHead(_BackboneHead):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.parametrize("action", ["rollback", "stop"])
def test_an_optimizer_swapped_for_another_class_since_the_snapshot_starts_again_without_state(tmp_path, action):
    # SGD until step 25, AdamW from then on; the NaN at step 27 goes back to the snapshot of step 20, which holds SGD's
    # state: loading it into AdamW failed inside torch (KeyError 'step') and the fit ended with a traceback, no
    # rollback and no checkpoint. The module goes back; AdamW keeps its settings and starts again with no state
    model = _SgdHead(nan_step=27)
    guard = DivergenceGuard(action=action)
    trainer = _trainer(tmp_path, [guard, _SwapToAdamW(at=25)], max_epochs=3)
    trainer.fit(model)
    opt = trainer.optimizers[0]
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["lr"] == 3e-3  # bad data: the rate is kept
    if action == "rollback":
        assert [(r["step"], r["to_step"]) for r in guard.rollbacks] == [(27, 20)]
        assert trainer.current_epoch == 3 and all(p in opt.state for p in model.parameters())  # trained since
        assert all(torch.isfinite(p).all() for p in model.parameters())
    else:
        assert guard.stopped_step == 27 and not guard.rollbacks
        saved = torch.load(guard.stop_checkpoint, weights_only=False)
        assert all(torch.isfinite(v).all() for v in saved["state_dict"].values())
        assert saved["optimizer_states"][0]["state"] == {}  # AdamW as it was swapped in: no state


def _fake_trainer(opt):
    return SimpleNamespace(optimizers=[opt], lr_scheduler_configs=[], precision_plugin=None, current_epoch=0,
                           global_rank=0)


def test_a_snapshot_fits_groups_added_since_and_refuses_groups_removed():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    module = nn.Sequential(a, b)
    opt = torch.optim.Adam(a.parameters(), lr=0.1)
    a(torch.randn(4, 2)).sum().backward()
    opt.step()
    snap = TrainingSnapshot.capture(_fake_trainer(opt), module, {}, step=1, lr_scale=1.0)
    moment = opt.state[a.weight]["exp_avg"].clone()
    # a group added since (an unfreeze) with a key the saved groups lack: both kept, the new group without state
    opt.add_param_group({"params": list(b.parameters()), "lr": 0.01})
    opt.param_groups[0]["swa_lr"] = 0.05
    (a(torch.randn(4, 2)).sum() + b(torch.randn(4, 2)).sum()).backward()
    opt.step()
    assert snap.mismatch(_fake_trainer(opt)) is None
    snap.restore(_fake_trainer(opt), module, {})
    assert torch.equal(opt.state[a.weight]["exp_avg"], moment)
    assert b.weight not in opt.state and opt.param_groups[1]["lr"] == 0.01
    assert opt.param_groups[0]["swa_lr"] == 0.05
    # an optimizer that lost the saved group cannot take the saved state: refused before anything changes
    other = torch.optim.Adam(b.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    reason = snap.mismatch(_fake_trainer(other))
    assert reason is None  # same sizes: 2 tensors in one group ...
    lone = torch.optim.Adam([b.weight], lr=0.1)
    reason = snap.mismatch(_fake_trainer(lone))
    assert reason is not None and "[2]" in reason and "[1]" in reason
    with pytest.raises(SnapshotMismatch):
        snap.restore(_fake_trainer(lone), module, {})
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())
    # an optimizer of another class in its place (SGD saved, Adam now): fits whatever its groups, and takes none of
    # the saved state (SGD's momentum buffers are no Adam state); the module goes back
    sgd = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    a(torch.randn(4, 2)).sum().backward()
    sgd.step()
    snap = TrainingSnapshot.capture(_fake_trainer(sgd), module, {}, step=2, lr_scale=1.0)
    weight = a.weight.detach().clone()
    adam = torch.optim.Adam([b.weight], lr=0.01)
    b(torch.randn(4, 2)).sum().backward()
    adam.step()
    with torch.no_grad():
        a.weight.add_(1.0)
    assert snap.mismatch(_fake_trainer(adam)) is None
    snap.restore(_fake_trainer(adam), module, {})
    assert torch.equal(a.weight, weight) and not adam.state and adam.param_groups[0]["lr"] == 0.01


def test_replays_leave_batchnorm_statistics_as_they_were(tmp_path, monkeypatch):
    # the guard runs `training_step` again (in training mode) to tell weights from data; BatchNorm must not see those
    # batches: the guarded run's buffers equal an unguarded run's bit for bit
    replays = []
    original = DivergenceGuard._batch_loss

    def counted(self, *args, **kwargs):
        replays.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DivergenceGuard, "_batch_loss", counted)

    class _HardBatches(_BackboneHead):
        def training_step(self, batch, batch_idx):
            lo = (batch_idx * BATCH) % N
            y = self.y[lo:lo + BATCH]
            if batch_idx in (9, 13):  # two batches of wrong labels an epoch: surges the weights are not to blame for
                y = (y + 1) % 3
            return nn.functional.cross_entropy(self(self.x[lo:lo + BATCH]), y)

    states = []
    for callbacks in ([DivergenceGuard(action="warn")], []):
        pl.seed_everything(0, verbose=False)
        model = _HardBatches(bn=True)
        _trainer(tmp_path, callbacks, max_epochs=6).fit(model)
        states.append(model.state_dict())
    assert replays, "no replay happened: the test would not test anything"
    guarded, plain = states
    assert all(torch.equal(guarded[k], plain[k]) for k in plain)


def _gpt(tiny_gpt_factory, lr):
    module, loader = tiny_gpt_factory(batch_size=16, n_samples=4096, lr=lr,
                                      config={"n_layer": 2, "d_model": 64, "block_size": 64})
    return module, loader


@pytest.mark.slow
@pytest.mark.parametrize("second_lr", [3e-3, 0.05])
def test_a_second_fit_with_fresh_optimizers_is_judged_as_a_new_start(tmp_path, tiny_gpt, second_lr):
    # a second `fit` of the same Trainer builds new optimizers: the first updates of a fresh Adam overshoot and settle
    # (the loss 1.3 -> 2.5 on step 201 here), which was rolled back with the learning rate halved for good. The same
    # second fit at a rate 17x higher is still rolled back on that step.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the run's numbers as measured
    try:
        pl.seed_everything(0, verbose=False)
        module, loader = _gpt(tiny_gpt, 3e-3)
        guard = DivergenceGuard()
        trainer = _trainer(tmp_path, [guard], max_steps=200)
        trainer.fit(module, loader)
        trainer.fit_loop.epoch_loop.max_steps = 230
        module.lr = second_lr
        trainer.fit(module, loader)
    finally:
        torch.set_num_threads(threads)
    rolled = [(r["step"], r["to_step"]) for r in guard.rollbacks]
    assert rolled == ([] if second_lr == 3e-3 else [(201, 200)])


@pytest.mark.slow
@pytest.mark.parametrize("restart_factor", [1.0, 10.0])
def test_a_warm_restart_to_a_rate_trained_at_before_only_warns(tmp_path, restart_factor):
    # the demo's GPT under cosine with warm restarts every 150 steps, from 3e-3 down to 1e-5: the restart at step 300
    # makes the loss jump from 1.25 to 2.3, and the run recovers (0.47 at step 600 unguarded). It was rolled back, with
    # the rate capped at the floor of the cosine for the rest of the run (1.18 at step 600). The matched run restarts
    # at 10x the rate it ever trained at: rolled back on the same step.
    from gpt import GPTModule, make_loader

    class _Restarts(GPTModule):
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)

            def factor(k):
                cosine = 1 / 300 + (1 - 1 / 300) * 0.5 * (1 + math.cos(math.pi * (k % 150) / 150))
                return cosine * (restart_factor if k >= 300 else 1.0)

            sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the run's numbers as measured
    try:
        pl.seed_everything(0, verbose=False)
        module = _Restarts({"n_layer": 2, "n_head": 2, "d_model": 64, "block_size": 64}, lr=3e-3)
        loader = make_loader("prose", block_size=64, batch_size=16, n_samples=16 * 600)
        guard = DivergenceGuard()
        trainer = _trainer(tmp_path, [guard], max_steps=330)
        trainer.fit(module, loader)
    finally:
        torch.set_num_threads(threads)
    kinds = [(a.step, a.kind) for a in AlertHub.for_trainer(trainer).history if a.severity != "info"]
    if restart_factor == 1.0:
        assert guard.rollbacks == [] and (301, "lr_restart") in kinds
    else:
        assert [r["step"] for r in guard.rollbacks] == [301]
        assert all(kind != "lr_restart" for _, kind in kinds)


class _BlobsBN(pl.LightningModule):
    """A BatchNorm classifier trained on ``(x, y)`` batches (what GWA reads its targets from)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_blobs()), batch_size=BATCH)


def test_swa_batchnorm_epoch_is_not_judged_or_scored(tmp_path, recwarn):
    # after its last epoch, StochasticWeightAveraging runs one more epoch forward only (the fit loop skips the
    # backward) to recompute BatchNorm's statistics for the averaged weights: no loss reaches a backward and no
    # gradient exists. The guard used to warn that it "saw no training loss", and GWA logged an epoch of 0 samples.
    from lightning_monitor import GradientWeightAlignmentMonitor

    guard, gwa = DivergenceGuard(), GradientWeightAlignmentMonitor(warmup_steps=0)
    swa = StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1, annealing_epochs=1)
    trainer = _trainer(tmp_path, [guard, gwa, swa], max_epochs=3)
    trainer.fit(_BlobsBN())
    assert trainer.current_epoch == 4  # the three epochs and SWA's BatchNorm epoch
    messages = [str(w.message) for w in recwarn]
    assert not [m for m in messages if "saw no training loss" in m or "samples; GWA skipped" in m], messages
    assert [h["epoch"] for h in gwa.history] == [0, 1, 2]  # the BatchNorm epoch is not an epoch of GWA's
    assert all(h["count"] == N for h in gwa.history)
    assert guard.rollbacks == [] and guard.stopped_step is None


class _Kicked(_BackboneHead):
    """SGD; the update of step ``kick`` uses 300 times the rate: the weights leave the basin in one step."""

    def __init__(self, kick):
        super().__init__()
        self.kick = kick

    def training_step(self, batch, batch_idx):
        group = self.optimizers().param_groups[0]
        if self.global_step == self.kick:
            group["lr"] *= 300.0
        elif self.global_step == self.kick + 1:
            group["lr"] /= 300.0
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _EpochStartWeights(pl.Callback):
    def __init__(self) -> None:
        self.weights: dict[int, tuple[int, list[torch.Tensor]]] = {}

    def on_train_epoch_start(self, trainer, pl_module):
        self.weights[trainer.current_epoch] = (trainer.global_step, [p.detach().clone() for p in pl_module.parameters()])


def test_a_rollback_takes_the_swa_average_back_too(tmp_path):
    # SWA adds the weights of each epoch's start to its average: the weights broken at step 31 entered it at step 32
    # (epoch 2's start); the rollback went back to step 30, and the final average still held the broken weights
    model, starts = _Kicked(kick=31), _EpochStartWeights()
    guard = DivergenceGuard()
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1, annealing_epochs=1)
    trainer = _trainer(tmp_path, [guard, swa, starts], max_epochs=6)
    trainer.fit(model)
    assert [r["to_step"] for r in guard.rollbacks] == [30] and guard.rollbacks[0]["step"] >= 32
    undone = [e for e, (s, _) in starts.weights.items() if 30 < s <= guard.rollbacks[0]["step"]]
    assert undone == [2]
    kept = [w for e, (s, w) in sorted(starts.weights.items()) if e >= swa.swa_start and e not in undone]
    assert int(swa.n_averaged) == len(kept) == 5  # epochs 0, 1, 3, 4, 5
    for avg, *ws in zip(swa._average_model.parameters(), *kept):
        torch.testing.assert_close(avg, torch.stack(ws).mean(0), rtol=1e-5, atol=1e-6)


def test_a_layer_added_since_the_snapshots_makes_them_unfit_and_the_guard_stops(tmp_path):
    """A layer (and its parameter group) added at step 12 with a rate that breaks it at once: the snapshot of step 10
    does not hold it, so going back to it would leave the broken layer as it is (the rollback said "rolled back to
    step 10" while the loss went on to 1e11). The snapshots no longer fit the run: the guard stops, saying why."""
    from torch.utils.data import DataLoader, TensorDataset

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.inp, self.head, self.extra = nn.Linear(10, 16), nn.Linear(16, 4), None

        def training_step(self, batch, batch_idx):
            x, y = batch
            h = torch.tanh(self.inp(x))
            if self.extra is not None:
                h = h + self.extra(h)
            return nn.functional.cross_entropy(self.head(h), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Grow(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 12 and pl_module.extra is None:
                pl_module.extra = nn.Linear(16, 16)
                trainer.optimizers[0].add_param_group({"params": pl_module.extra.parameters(), "lr": 300.0})

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 10, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=10)
    trainer = pl.Trainer(accelerator="cpu", max_steps=30, logger=False, enable_checkpointing=False,
                         callbacks=[guard, Grow()], enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(Net(), DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True))
    assert guard.rollbacks == [] and guard.stopped_step == 13
    (stopped,) = [a for a in guard.hub.history if a.kind == "stopped"]
    assert "no longer fit the run" in stopped.message and "extra.weight" in stopped.message
    assert not any(a.kind == "objective_change" for a in guard.hub.history)


def test_a_rollback_does_not_hold_a_group_that_was_off_at_the_best_loss_at_zero(tmp_path):
    """A backbone at rate 0 until step 100 (a LambdaLR unfreeze), then too hot: the rollback capped each group at its
    rate at the best smoothed loss, 0 for the backbone, which then never trained again (held-out loss 0.28-0.32
    against the control's 0.01-0.02). A group off at the best loss is capped at a fraction of the rate that diverged."""
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset

    x, y = load_digits(return_X_y=True)
    x = torch.tensor((x - x.mean(0)) / (x.std(0) + 1.0), dtype=torch.float32)
    y = torch.tensor(y)
    torch.manual_seed(700)
    net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))
    first = y < 5  # pre-trained on digits 0-4
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    g = torch.Generator().manual_seed(700)
    for _ in range(300):
        i = torch.nonzero(first).squeeze(1)[torch.randint(0, int(first.sum()), (32,), generator=g)]
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[i]), y[i]).backward()
        opt.step()
    torch.manual_seed(0)
    net[4].reset_parameters()  # a new head for the ten digits

    class FineTune(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            back = [p for n, p in self.net.named_parameters() if not n.startswith("4.")]
            opt = torch.optim.SGD([{"params": list(self.net[4].parameters()), "lr": 0.05},
                                   {"params": back, "lr": 0.5}], momentum=0.9)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.0 if s < 100 else 1.0])
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    pl.seed_everything(0)
    guard = DivergenceGuard()
    trainer = pl.Trainer(accelerator="cpu", max_steps=250, logger=False, enable_checkpointing=False,
                         callbacks=[guard], enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(FineTune(), DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
    assert guard.rollbacks and guard.rollbacks[0]["to_step"] >= 100  # the hot unfreeze is caught and undone
    assert all(r["lr_ceiling"][0][1] > 0.0 for r in guard.rollbacks)  # the backbone's cap is not 0 ...
    assert trainer.optimizers[0].param_groups[1]["lr"] > 0.0  # ... and it trains on
    with torch.no_grad():
        assert float(nn.functional.cross_entropy(net(x), y)) < 0.15


class _Rates(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, list[float]]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.seen.append((trainer.global_step, [g["lr"] for g in optimizer.param_groups]))


def test_a_later_fit_with_new_optimizers_runs_at_its_own_rate_after_a_rollback(tmp_path):
    # fit 1 diverges under a rate ramp (a GPT without LayerNorm, 1e-3 -> 0.04) and is rolled back, its rate capped;
    # fit 2 of the same Trainer, no checkpoint, builds a new optimizer at a rate the user picked (after lr_find,
    # say): it ran at the old cap, silently, before
    from gpt import GPTModule, make_loader

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pl.seed_everything(0, verbose=False)
        module = GPTModule({"n_layer": 2, "n_head": 4, "d_model": 64, "block_size": 32, "layernorm": False},
                           lr=1e-3, lr_end=0.04, ramp_steps=100)
        loader = make_loader("prose", block_size=32, batch_size=16, n_samples=4096)
        guard, rates = DivergenceGuard(), _Rates()
        trainer = _trainer(tmp_path, [guard, rates], max_steps=120)
        trainer.fit(module, loader)
        assert guard.rollbacks and guard.rollbacks[-1]["lr_ceiling"] is not None
        cap = max(c for row in guard.rollbacks[-1]["lr_ceiling"] for c in row)
        assert cap < 0.02
        module.lr, module.lr_end = 0.02, None
        rates.seen.clear()
        trainer.fit_loop.epoch_loop.max_steps = 125
        trainer.fit(module, loader)
    finally:
        torch.set_num_threads(threads)
    # the new optimizer's rate is used (0.02 diverges this model at once: the guard rolls it back and lowers it again)
    again = min([r["step"] for r in guard.rollbacks if r["step"] >= 120], default=125)
    before = [lrs for step, lrs in rates.seen if step <= again]
    assert before and all(lrs == [0.02] * len(lrs) for lrs in before)
    lifted = [a for a in read_alerts(str(tmp_path / "alerts.jsonl")) if a.kind == "lr_ceiling_lifted"]
    assert len(lifted) == 1 and lifted[0].severity == "info" and f"{cap:.3g}" in lifted[0].message


@pytest.mark.skipif(not hasattr(pl.callbacks, "EMAWeightAveraging"), reason="Lightning 2.6's EMAWeightAveraging")
def test_a_rollback_takes_the_ema_average_back_too(tmp_path):
    """``EMAWeightAveraging`` averages the weights after every step, and Lightning puts the average into the model at
    the end of the fit: the steps a rollback undid stayed in it (a run rolled back once ended with a held-out loss of
    2.57 against 1.47 for its raw weights). The final average is the EMA of the weights of the steps kept."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    class Weights(pl.Callback):  # the weights the average takes in, after each step (it runs after the average)
        def __init__(self) -> None:
            self.seen: list[tuple[int, list[torch.Tensor]]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append((trainer.global_step, [p.detach().clone() for p in pl_module.parameters()]))

    pl.seed_everything(0)
    model, weights = _Kicked(kick=31), Weights()
    guard = DivergenceGuard()
    ema = EMAWeightAveraging(decay=0.9)
    _trainer(tmp_path, [guard, ema, weights], max_epochs=4).fit(model)
    ((step, back),) = [(r["step"], r["to_step"]) for r in guard.rollbacks]
    assert back < 31 < step
    expected = None
    for g, w in weights.seen:
        # the steps rolled back over, and the rollback's own step: its weights, the restored ones, are those of step
        # `back`, which the average took in then (taken in again, the average held them twice: a run without the undone
        # steps never does)
        if not back < g <= step + 1:
            expected = w if expected is None else [0.9 * e + 0.1 * x for e, x in zip(expected, w)]
    for avg, want in zip(ema._average_model.module.parameters(), expected):
        torch.testing.assert_close(avg.detach(), want, rtol=1e-5, atol=1e-6)
    for p, want in zip(model.parameters(), expected):  # and the model ends with that average
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)


class _GrowingVocab(pl.LightningModule):
    """A bigram language model whose vocabulary grows from 24 to 32 tokens before step ``grow`` (the embedding and the
    head resized, the old rows kept, as ``resize_token_embeddings`` does; the optimizer rebuilt), with data that uses
    the new tokens from then on: the loss rises by design. ``hot``: the learning rate times 10,000 from that step on (a
    divergence after the change)."""

    V0, V1, T = 24, 32, 16

    def __init__(self, grow: int, hot=None, sizes=(24, 32)):
        super().__init__()
        torch.manual_seed(0)
        self.V0, self.V1 = sizes
        self.emb, self.head = nn.Embedding(self.V0, 32), nn.Linear(32, self.V0)
        self.grow, self.hot, self.grown, self.soon = grow, hot, False, False
        g = torch.Generator().manual_seed(1)
        self.next0 = torch.randint(0, self.V0, (self.V0,), generator=g)
        self.next1 = torch.randint(0, self.V1, (self.V1,), generator=g)

    def _resize(self):
        emb, head = nn.Embedding(self.V1, 32), nn.Linear(32, self.V1)
        kept = min(self.V0, self.V1)  # the rows of the tokens both vocabularies hold
        with torch.no_grad():
            emb.weight[:kept] = self.emb.weight[:kept]
            head.weight[:kept], head.bias[:kept] = self.head.weight[:kept], self.head.bias[:kept]
        self.emb, self.head, self.grown = emb, head, True
        self.trainer.strategy.optimizers = [torch.optim.Adam(self.parameters(), lr=3e-3)]

    def on_train_batch_start(self, batch, batch_idx):
        self.soon = self.global_step + 2 >= self.grow  # the next batch, fetched now, is the change's
        if self.global_step + 1 == self.grow and not self.grown:
            self._resize()
        if self.hot is not None and self.global_step == self.hot:
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] = 30.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.emb(x)).reshape(-1, self.head.out_features), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_Tokens(self), batch_size=None)


class _Tokens(torch.utils.data.Dataset):
    """Batches of 16 sequences of the model's present vocabulary (the new tokens once it has grown) and their next
    tokens."""

    def __init__(self, model: _GrowingVocab) -> None:
        self.model = model

    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        # a shrunk vocabulary's data from the batch fetched before the change on (the old model takes its tokens too)
        new = m.grown or (m.soon and m.V1 < m.V0)
        vocab, nxt = (m.V1, m.next1) if new else (m.V0, m.next0)
        x = torch.randint(0, vocab, (16, m.T), generator=torch.Generator().manual_seed(1000 + i))
        return x, nxt[x]


@pytest.mark.parametrize("grow", [62, 66])
def test_a_vocabulary_grown_mid_run_is_no_divergence(tmp_path, grow):
    """The embedding and head resized (``resize_token_embeddings``) after the snapshot of step 60, and the data using
    the new tokens at once. The snapshots from before hold the old shapes: asked about the rise, the guard copied them
    into the resized weights and the fit died (a size mismatch); told they do not fit, it found no state to go back to
    and stopped a healthy run. The resized model still finds the last batches from before the rise easy: the rise is
    the change's, and the guard rebases."""
    guard = DivergenceGuard()
    trainer = _trainer(tmp_path, [guard], max_steps=120)
    trainer.fit(_GrowingVocab(grow))
    assert trainer.global_step == 120 and guard.stopped_step is None and not guard.rollbacks
    rebased = [a for a in guard.hub.history if a.kind == "rebased"]
    assert len(rebased) <= 1 and all("resized since step 60" in a.message for a in rebased)
    assert not [a for a in guard.hub.history if a.severity == "critical"]


def test_a_vocabulary_shrunk_mid_run_is_no_divergence(tmp_path):
    # 32 tokens, then 24: the last batches from before the rise hold token ids the shrunk model has no row for, so
    # they cannot be evaluated again (an IndexError the replay catches); that says nothing against the change, which
    # was stopped as a divergence ("no earlier snapshot fits the run")
    guard = DivergenceGuard()
    trainer = _trainer(tmp_path, [guard], max_steps=120)
    with pytest.warns(UserWarning, match="could not run `training_step` again"):
        trainer.fit(_GrowingVocab(62, sizes=(32, 24)))
    assert trainer.global_step == 120 and guard.stopped_step is None and not guard.rollbacks
    (rebased,) = [a for a in guard.hub.history if a.kind == "rebased"]
    assert "emb.weight [32, 32] -> [24, 32]" in rebased.message


def test_a_divergence_after_a_grown_vocabulary_is_still_rolled_back(tmp_path):
    guard = DivergenceGuard()
    trainer = _trainer(tmp_path, [guard], max_steps=160)
    trainer.fit(_GrowingVocab(62, hot=100))
    assert guard.rollbacks and guard.rollbacks[0]["to_step"] >= 70 and 100 <= guard.rollbacks[0]["step"] <= 110
    assert guard.stopped_step is None and trainer.global_step == 160


def test_a_decay_from_another_optimizer_explains_no_rise():
    """The decay rule excuses a rise when some group's weight decay rose since the lowest smoothed loss and no rate did.
    SGD (no decay) swapped for AdamW (its default decay 0.01) at a rate x1000: rolled back once, the renewed rise was
    then excused as the decay's ("0 -> 0.01") and the run ended at 1.7 against a healthy 1.1. A decay read on another
    optimizer class than the one at the lowest loss explains nothing; within one class it still does."""
    layer = nn.Linear(2, 2)
    guard = DivergenceGuard()
    guard._lr_at_min, guard._wd_at_min, guard._types_at_min = [[0.1]], [[0.0]], ["SGD"]
    swapped = _fake_trainer(torch.optim.AdamW(layer.parameters(), lr=0.1))
    assert guard._decay_rose(swapped) is None
    guard._types_at_min = ["AdamW"]  # the same optimizer, its decay raised since: the decay's effect
    assert guard._decay_rose(swapped) == "0 -> 0.01"

"""DivergenceGuard in real Trainer.fit runs: NaN injection, explosions, alerts of other monitors, DDP."""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import pytest
import torch
from conftest import tb_scalars
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_monitor import DivergenceGuard, Monitor, read_alerts
from conftest import fit_ddp_spawn  # noqa: E402


def _trainer(tmp_path, callbacks, steps, logger=True, **kw):
    if logger is True:
        logger = [TensorBoardLogger(str(tmp_path), name="tb"), CSVLogger(str(tmp_path), name="csv")]
    return pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=logger, callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=kw.pop("enable_checkpointing", False),
        default_root_dir=str(tmp_path), **kw,
    )


def _finite(module) -> bool:
    return all(torch.isfinite(p).all() for p in module.parameters())


def test_nan_loss_stops_on_its_step_with_finite_checkpoint(tmp_path, tiny_gpt):
    pl.seed_everything(0)
    module, loader = tiny_gpt(nan_at_step=23)
    guard = DivergenceGuard(action="stop", every_n_steps=10)
    trainer = _trainer(tmp_path, [guard], steps=200)
    trainer.fit(module, loader)

    assert guard.stopped_step == 23  # every step is judged (on CPU, with no lag): the NaN step itself
    assert trainer.global_step == 24 and trainer.should_stop
    assert _finite(module)  # the NaN gradients were zeroed on the device, never applied
    # the checkpoint loads and is finite
    from gpt import GPTModule

    assert os.path.basename(guard.stop_checkpoint) == "guard-step=23.ckpt"
    restored = GPTModule.load_from_checkpoint(guard.stop_checkpoint)
    assert _finite(restored)
    ckpt = torch.load(guard.stop_checkpoint, weights_only=False)
    assert ckpt["global_step"] == 24  # saved at the end of step 23, with the weights of the snapshot of step 20
    # exactly one critical alert, at the step of the NaN, in the JSONL file and in TensorBoard
    tb_dir = trainer.loggers[0].log_dir
    alerts = read_alerts(os.path.join(tb_dir, "alerts.jsonl"))
    critical = [a for a in alerts if a.severity == "critical"]
    assert len(critical) == 1 and critical[0].kind == "nonfinite" and critical[0].step == 23
    assert any(a.kind == "stopped" and "guard-step=23.ckpt" in a.message for a in alerts)
    assert (23, 1.0) in tb_scalars(tb_dir)["alerts/count/critical"]  # the cumulative count steps to 1 there


def test_check_every_step_skips_the_bad_update_exactly(tmp_path, tiny_gpt):
    pl.seed_everything(0)
    module, loader = tiny_gpt(nan_at_step=12)
    guard = DivergenceGuard(action="stop", every_n_steps=1, snapshot_every_n_checks=10)
    _trainer(tmp_path / "a", [guard], steps=100, logger=False).fit(module, loader)
    assert guard.stopped_step == 12

    pl.seed_everything(0)
    reference, loader = tiny_gpt()
    _trainer(tmp_path / "b", [], steps=10, logger=False).fit(reference, loader)
    saved = torch.load(guard.stop_checkpoint, weights_only=False)["state_dict"]
    # the checkpoint is the last snapshot before the NaN step (step 10), bit for bit
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(saved[name], p, rtol=0, atol=0)


def test_healthy_run_raises_no_alert(tmp_path, tiny_gpt):
    pl.seed_everything(0)
    module, loader = tiny_gpt(lr=3e-3)
    guard = DivergenceGuard()
    trainer = _trainer(tmp_path, [guard], steps=250)
    trainer.fit(module, loader)
    assert trainer.global_step == 250 and guard.stopped_step is None
    assert guard.hub.history == []
    assert not os.path.exists(os.path.join(trainer.loggers[0].log_dir, "alerts.jsonl"))


class _Exploding(pl.LightningModule):
    """A least-squares regression trained by SGD whose learning rate jumps past the edge of stability
    (lr * curvature > 2) at ``explode_at``: the loss then grows geometrically, a genuine divergence."""

    def __init__(self, explode_at: int = 60) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)
        self.explode_at = explode_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == self.explode_at:
            self.optimizers().param_groups[0]["lr"] = 1.5
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 8, generator=g)
        y = x @ torch.randn(8, 1, generator=g) + 0.5 * torch.randn(4096, 1, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def test_loss_surge_is_critical_on_its_step_when_the_weights_are_to_blame(tmp_path):
    pl.seed_everything(0)
    guard = DivergenceGuard(action="stop", every_n_steps=5, patience=3)
    _trainer(tmp_path, [guard], steps=200, logger=False).fit(_Exploding(explode_at=60))
    kinds = [(a.step, a.kind, a.severity) for a in guard.hub.history]
    # from the update of step 60 (lr 1.5) on, the loss grows geometrically; at step 62 it surges, and the last
    # normal batches, evaluated again, have got as much worse: critical at once, acted on at the same step
    assert not [k for k in kinds if k[2] == "warning"]
    assert [k for k in kinds if k[2] == "critical"] == [(62, "loss_explosion", "critical")]
    assert guard.stopped_step == 62
    explosion = next(a for a in guard.hub.history if a.kind == "loss_explosion")
    assert "surged" in explosion.message and "the weights diverged" in explosion.message


def test_loss_explosion_is_critical_after_patience(tmp_path):
    pl.seed_everything(0)
    # no surge test (a surge must be 1e9 times the level): the explosion is judged after `patience` steps
    guard = DivergenceGuard(action="stop", every_n_steps=5, patience=3, surge=1e9)
    _trainer(tmp_path, [guard], steps=200, logger=False).fit(_Exploding(explode_at=60))
    kinds = [(a.step, a.kind, a.severity) for a in guard.hub.history]
    # 62, 63, 64: the loss far above its history, and the weights (not the batches) are to blame: critical at
    # 64, acted on at once (the sudden jump is not "creep": no warning before it)
    assert not [k for k in kinds if k[2] == "warning"]
    assert [k for k in kinds if k[2] == "critical"] == [(64, "loss_explosion", "critical")]
    assert guard.stopped_step == 64
    explosion = next(a for a in guard.hub.history if a.kind == "loss_explosion")
    assert "since step 62" in explosion.message and "the weights diverged" in explosion.message


def test_a_blow_up_from_the_first_update_is_acted_on_at_once(tmp_path):
    pl.seed_everything(0)
    guard = DivergenceGuard(action="stop", every_n_steps=5)
    _trainer(tmp_path, [guard], steps=200, logger=False).fit(_Exploding(explode_at=0))
    critical = [(a.step, a.kind) for a in guard.hub.history if a.severity == "critical"]
    # lr 1.5 from step 0: the loss passes twice the initial loss within a few steps, before it has any history;
    # the first batches, evaluated again, have lost more than twice as much too, so the guard does not wait the
    # ten steps an early transient gets: it acts on the step of the surge
    assert len(critical) == 1 and critical[0][1] == "loss_explosion"
    assert guard.stopped_step is not None and guard.stopped_step <= 5, critical


class _OneHardBatchEarly(_Exploding):
    """A healthy regression whose fourth batch has targets a hundred times too large: one hard batch."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x), 100.0 * y if batch_idx == 3 else y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def test_one_hard_batch_before_any_history_is_not_an_explosion(tmp_path):
    pl.seed_everything(0)
    guard = DivergenceGuard(action="stop", every_n_steps=5)
    _trainer(tmp_path, [guard], steps=40, logger=False).fit(_OneHardBatchEarly())
    # step 3's loss is thousands of times the initial one, but the first batches, evaluated again, are as easy
    # as before: nothing is raised and the run goes on
    assert guard.stopped_step is None
    assert not [a for a in guard.hub.history if a.severity != "info"]


def test_warn_mode_keeps_training_and_weights_finite(tmp_path, tiny_gpt):
    pl.seed_everything(0)
    module, loader = tiny_gpt(nan_at_step=7)
    guard = DivergenceGuard(action="warn", every_n_steps=4)
    trainer = _trainer(tmp_path, [guard], steps=30, logger=False)
    trainer.fit(module, loader)
    assert trainer.global_step == 30 and guard.stopped_step is None and _finite(module)
    assert [(a.kind, a.step) for a in guard.hub.history] == [("nonfinite", 7), ("nonfinite_cleared", 8)]


class _CriticalAt(Monitor):
    """Raises one critical alert at ``step`` (on rank ``rank`` only, if given)."""

    name = "probe"

    def __init__(self, step: int, rank: int | None = None) -> None:
        super().__init__(every_n_steps=1)
        self.step, self.rank = step, rank

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            self.alert(trainer.global_step, "collapse", "critical", "test collapse")


def test_guard_acts_on_other_monitors_critical_alerts(tmp_path, tiny_gpt):
    module, loader = tiny_gpt()
    guard = DivergenceGuard(action="stop", every_n_steps=10, dirpath=str(tmp_path / "ck"))
    _trainer(tmp_path, [_CriticalAt(12), guard], steps=100, logger=False).fit(module, loader)
    assert guard.stopped_step == 20 and os.path.isfile(tmp_path / "ck" / "guard-step=20.ckpt")
    stop = [a for a in guard.hub.history if a.kind == "stopped"]
    assert len(stop) == 1 and "probe/collapse" in stop[0].message


class _WarningBetween(Monitor):
    """Holds a warning condition ``monitor/kind`` from step ``start`` to ``end``."""

    def __init__(self, start: int, end: int, monitor: str = "sa", kind: str = "sigma_growth") -> None:
        super().__init__(every_n_steps=1)
        self.start, self.end, self.name, self.kind = start, end, monitor, kind

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        s = trainer.global_step
        self.condition(s, self.kind, self.start <= s < self.end, "warning", "sigma_1 grows")


class _CreepingLoss(_Exploding):
    """A loss of 1 with +-20% batch-to-batch noise that, from ``creep_at``, climbs by 0.01 per step; the
    weights stay put (lr 0). Each value stays within the noise of the last ones, only the smoothed loss shows
    the climb: only the guard's ``loss_creep`` warning fires."""

    def __init__(self, creep_at: int = 60) -> None:
        super().__init__(explode_at=10**9)
        self.creep_at, self.noise = creep_at, torch.Generator().manual_seed(0)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        noise = 0.8 + 0.4 * torch.rand((), generator=self.noise)
        return 0.0 * self.lin(x).sum() + noise + 0.01 * max(0, self.global_step - self.creep_at)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _creep_step(tmp_path) -> int:
    pl.seed_everything(0)
    guard = DivergenceGuard(action="warn", every_n_steps=1)
    _trainer(tmp_path, [guard], steps=100, logger=False).fit(_CreepingLoss(creep_at=60))
    return next(a.step for a in guard.hub.history if a.kind == "loss_creep")


def test_corroboration_of_two_warnings_is_critical(tmp_path):
    creep = _creep_step(tmp_path)
    assert 60 < creep < 100
    # the creep warning alone stops nothing; with the SA warning active it is critical at once
    pl.seed_everything(0)
    guard = DivergenceGuard(action="stop", every_n_steps=1, corroborate=True)
    _trainer(tmp_path, [_WarningBetween(10, 1000), guard], steps=100, logger=False).fit(_CreepingLoss(creep_at=60))
    critical = [(a.step, a.kind) for a in guard.hub.history if a.severity == "critical"]
    assert critical == [(creep, "corroborated")] and guard.stopped_step == creep
    msg = next(a.message for a in guard.hub.history if a.kind == "corroborated")
    assert "loss_creep" in msg and "sa/sigma_growth" in msg

    # an SA warning that cleared before, or a warning that is not about divergence (a one-off that never
    # clears), does not count
    for probe in ([_WarningBetween(10, 40)], [_WarningBetween(10, 1000, "gns", "no_variance_estimate")]):
        pl.seed_everything(0)
        guard = DivergenceGuard(action="stop", every_n_steps=1, corroborate=True)
        _trainer(tmp_path, probe + [guard], steps=100, logger=False).fit(_CreepingLoss(creep_at=60))
        assert [(a.step, a.kind) for a in guard.hub.history if a.kind == "loss_creep"] == [(creep, "loss_creep")]
        assert guard.stopped_step is None and not [a for a in guard.hub.history if a.severity == "critical"]


def test_state_roundtrips_through_checkpoint(tmp_path, tiny_gpt):
    pl.seed_everything(0)
    module, loader = tiny_gpt()
    # judged 3 steps late (as on an accelerator, where the values reach the host asynchronously)
    guard = DivergenceGuard(action="stop", every_n_steps=5, min_history=5, lag_steps=3)
    ckpt_cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=40, save_top_k=-1)
    _trainer(tmp_path, [guard, ckpt_cb], steps=40, logger=False, enable_checkpointing=True).fit(module, loader)
    ckpt = torch.load(ckpt_cb.best_model_path or ckpt_cb.last_model_path or
                      os.path.join(tmp_path, "ck", os.listdir(tmp_path / "ck")[0]), weights_only=False)
    saved = ckpt["callbacks"][guard.state_key]
    # steps 0..36 judged, 37..39 still on their way: nothing is lost
    assert len(saved["loss"]["history"]) == 37 and [s for s, _, _ in saved["pending"]] == [37, 38, 39]

    resumed = DivergenceGuard(action="stop", every_n_steps=5, min_history=5, lag_steps=3)
    module2, loader2 = tiny_gpt()
    trainer = _trainer(tmp_path, [resumed], steps=41, logger=False)
    trainer.fit(module2, loader2, ckpt_path=os.path.join(tmp_path, "ck", os.listdir(tmp_path / "ck")[0]))
    expected = saved["loss"]["history"] + [loss for _, loss, _ in saved["pending"]]
    assert list(resumed._loss_watch.history)[:40] == expected
    assert trainer.global_step == 41


class _NoLoss(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.lin(batch[0]).sum().backward()  # plain backward: no on_before_backward hook, no loss returned
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 2)), batch_size=4)


def test_no_loss_warns_and_still_checks_gradients(tmp_path):
    guard = DivergenceGuard(action="stop", every_n_steps=2)
    with pytest.warns(UserWarning, match="DivergenceGuard saw no training loss"):
        _trainer(tmp_path, [guard], steps=12, logger=False).fit(_NoLoss())  # 10 steps without one: said
    assert guard.hub.history == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"action": "halt"}, "action"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"min_history": 0}, "min_history"),
        ({"window": 10, "min_history": 20}, "must not exceed"),
        ({"z_threshold": -1.0}, "z_threshold"),
        ({"patience": 0}, "patience"),
        ({"creep": 0.0}, "creep"),
        ({"smoothing": 1.0}, "smoothing"),
        # accepted before and failing inside the first step (a string floor), or taken silently (a NaN floor)
        ({"loss_rel_floor": "0.02"}, "`loss_rel_floor` must be a finite number >= 0"),
        ({"loss_rel_floor": -0.1}, "`loss_rel_floor`"),
        ({"initial_floor": float("nan")}, "`initial_floor` must be a finite number >= 0"),
        ({"initial_floor": -1}, "`initial_floor`"),
        ({"lr_factor": "0.5"}, "`lr_factor`"),
        ({"lr_factor": 1.5}, "`lr_factor`"),
        ({"blowup": "3"}, "`blowup`"),
        ({"blowup": 1.0}, "`blowup`"),
        ({"skip_batches": [1, 2]}, r"`skip_batches` must be .* pairs of integers, got the entry 1"),
        ({"skip_batches": [(0, 1.5)]}, "`skip_batches`"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DivergenceGuard(**kwargs)


def test_corroborate_with_takes_one_kind_or_a_sequence_of_them():
    """A single string was split into its characters, so no alert kind ever matched and corroboration was off."""
    assert DivergenceGuard(corroborate_with="sa/collapse").corroborate_with == ("sa/collapse",)
    assert DivergenceGuard(corroborate_with=["sa/collapse", "gns/high"]).corroborate_with == ("sa/collapse", "gns/high")
    for bad in (5, [1], ["sa/collapse", ""]):
        with pytest.raises(TypeError, match="`corroborate_with` must be an alert kind"):
            DivergenceGuard(corroborate_with=bad)
    assert DivergenceGuard(skip_batches=[(0, 1), [2, 3]])._skip_given == {(0, 1), (2, 3)}


def test_skip_batches_that_is_neither_a_path_nor_pairs_says_what_to_pass():
    for bad in (5, b"alerts.jsonl"):
        with pytest.raises(TypeError, match=r"`skip_batches` must be an alerts.jsonl path \(str or os.PathLike\)"):
            DivergenceGuard(skip_batches=bad)


# ----------------------------------------------------------------------------- DDP (2 gloo ranks)


class _DDPModule(pl.LightningModule):
    def __init__(self, out_dir: str):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.out_dir = out_dir

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.lin(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(512, 4)), batch_size=4)

    def on_train_end(self):
        guard = next(c for c in self.trainer.callbacks if isinstance(c, DivergenceGuard))
        with open(os.path.join(self.out_dir, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"global_step": self.trainer.global_step, "stopped_step": guard.stopped_step}, fh)


def test_ddp_stop_decision_is_reduced_across_ranks(tmp_path):
    # only rank 1 raises a critical alert; both ranks must stop on the same step, none may hang
    guard = DivergenceGuard(action="stop", every_n_steps=4, dirpath=str(tmp_path / "ck"))
    trainer = pl.Trainer(
        max_steps=40, accelerator="cpu", devices=2, strategy="ddp_spawn", callbacks=[_CriticalAt(9, rank=1), guard],
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    fit_ddp_spawn(trainer, _DDPModule(str(tmp_path)))
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert results[0] == results[1] == {"global_step": 13, "stopped_step": 12}
    assert os.path.isfile(tmp_path / "ck" / "guard-step=12.ckpt")


def test_a_condition_clearing_never_stops_the_run(tmp_path, tiny_gpt):
    # a run resumed while a critical condition was active: the condition clears, the run goes on
    module, loader = tiny_gpt()
    guard = DivergenceGuard(action="stop", every_n_steps=5)
    guard.load_state_dict({"conditions": [["nonfinite", None, "critical"], ["loss_explosion", None, "critical"]]})
    trainer = _trainer(tmp_path, [guard], steps=30, logger=False)
    trainer.fit(module, loader)
    assert guard.stopped_step is None and trainer.global_step == 30
    assert {a.kind for a in guard.hub.history} == {"nonfinite_cleared", "loss_explosion_cleared"}


def test_fp16_loss_scaler_nan_loss_is_caught(tmp_path, tiny_gpt):
    # under a dynamic loss scaler the loss the hook sees is scaled: the guard divides the scale out
    from lightning.pytorch.plugins import MixedPrecision

    pl.seed_everything(0)
    module, loader = tiny_gpt(nan_at_step=12)
    guard = DivergenceGuard(action="stop", every_n_steps=5)
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=65536.0))
    _trainer(tmp_path, [guard], steps=40, logger=False, plugins=[plugin]).fit(module, loader)
    assert guard.stopped_step == 12 and _finite(module)
    assert [(a.step, a.kind) for a in guard.hub.history if a.severity == "critical"] == [(12, "nonfinite")]
    losses = list(guard._loss_watch.history)
    assert 1.0 < min(losses) and max(losses) < 6.0  # unscaled (a scaled loss would be ~65536x larger)


class _MatrixLoss(_Exploding):
    """Returns the loss as a [1, 1] tensor."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx).reshape(1, 1)


def test_a_loss_of_shape_1x1_is_judged_like_a_scalar(tmp_path):
    pl.seed_everything(0)
    guard = DivergenceGuard(action="stop", every_n_steps=5)
    _trainer(tmp_path, [guard], steps=200, logger=False).fit(_MatrixLoss(explode_at=60))
    assert [(a.step, a.kind) for a in guard.hub.history if a.severity == "critical"] == [(62, "loss_explosion")]


def test_nonfinite_on_host_reads_every_tensor_and_leaves_it_bit_for_bit():
    """The guard's per-step gradient check on CPU: one fused kernel, true exactly when some element is NaN or
    +-inf, every value left as it was (to the bit: -0.0, denormals, the largest float); ``None`` where the kernel
    does not apply, so that the guard takes the norms instead."""
    from lightning_monitor._sharded import nonfinite_on_host

    grads = [torch.tensor([-0.0, 1e-45, 3.4e38, -5.5]), torch.randn(3, 4).t(), torch.randn(5).half(),
             torch.randn(2, 2).double()]
    bits = [g.clone() for g in grads]
    assert nonfinite_on_host(grads) is False
    assert all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)) for a, b in zip(grads, bits))
    for bad in (float("nan"), float("inf"), -float("inf")):
        hit = [g.clone() for g in bits]
        hit[1][2, 0] = bad
        assert nonfinite_on_host(hit) is True
    assert nonfinite_on_host([]) is None
    assert nonfinite_on_host([torch.randn(3), torch.eye(3).to_sparse()]) is None
    assert nonfinite_on_host([torch.arange(3)]) is None


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_nonfinite_gradient_with_a_finite_loss_is_zeroed_and_reported_with_its_norm(tmp_path, bad):
    """A gradient that turns non-finite while the loss stays finite (an overflow in the backward): the guard finds
    it on its step, zeroes the step's gradients so that nothing non-finite reaches the weights, and reports the
    norm's value in its critical alert; the steps before it raise nothing."""

    class Overflow(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_after_backward(self):
            if self.global_step == 15:
                self.net[0].weight.grad[1, 2] = bad

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    pl.seed_everything(0)
    x = torch.randn(256, 4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    module, guard = Overflow(), DivergenceGuard(action="warn")
    _trainer(tmp_path, [guard], steps=30, logger=[TensorBoardLogger(str(tmp_path), name="tb")]).fit(module, loader)
    assert _finite(module)
    alerts = read_alerts(os.path.join(str(tmp_path), "tb", "version_0", "alerts.jsonl"))
    critical = [a for a in alerts if a.severity == "critical"]
    assert [(a.kind, a.step) for a in critical] == [("nonfinite", 15)]
    assert f"Non-finite gradient norm ({bad})" in critical[0].message and "zeroed" in critical[0].message


def _shifted(tiny_gpt, offset: float, **kwargs):
    """The example GPT with a constant added to its loss: the same gradients, so the same training, but a loss below 0
    (as the negative log-likelihood of a continuous density can be)."""
    from gpt import GPTModule

    class Shifted(GPTModule):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) + offset

    module, loader = tiny_gpt(**kwargs)
    module.__class__ = Shifted
    return module, loader


def test_a_loss_below_zero_turns_the_loss_rules_off_and_changes_nothing_else(tmp_path, tiny_gpt):
    """Shifted by -10, a healthy run's loss is negative from the first step. The loss rules (multiples of the loss's
    levels) assume a loss bounded below by 0; on such a run the guard says so once and takes no action, so the
    weights end bit for bit as those of the same run without the guard."""
    pl.seed_everything(0)
    module, loader = _shifted(tiny_gpt, -10.0, lr=3e-3)
    guard = DivergenceGuard()
    _trainer(tmp_path / "a", [guard], steps=150, logger=False).fit(module, loader)
    assert [(a.kind, a.severity) for a in guard.hub.history] == [("signed_loss", "warning")]
    assert guard.hub.history[0].step == 0 and "below 0" in guard.hub.history[0].message
    assert guard.rollbacks == [] and guard.stopped_step is None
    pl.seed_everything(0)
    reference, loader = _shifted(tiny_gpt, -10.0, lr=3e-3)
    _trainer(tmp_path / "b", [], steps=150, logger=False).fit(reference, loader)
    for (name, p), q in zip(module.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_a_nan_in_a_run_with_a_negative_loss_is_still_caught(tmp_path, tiny_gpt):
    pl.seed_everything(0)
    module, loader = _shifted(tiny_gpt, -10.0, nan_at_step=23)
    guard = DivergenceGuard(action="stop", every_n_steps=10)
    _trainer(tmp_path, [guard], steps=100, logger=False).fit(module, loader)
    assert guard.stopped_step == 23 and _finite(module)
    assert [a.kind for a in guard.hub.history if a.severity != "info"] == ["signed_loss", "nonfinite"]
    state = guard.state_dict()
    assert state["signed_loss"] is True
    again = DivergenceGuard()
    again.load_state_dict(state)
    assert again._signed


class _GaussianNLL(pl.LightningModule):
    """Heteroscedastic regression on nearly noiseless data: the Gaussian negative log-likelihood falls from +0.2 to
    about -3.8 as the predicted variance shrinks, with the heavy-tailed batch losses of a small variance."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        mu, log_var = self.net(x).unbind(-1)
        return 0.5 * (log_var + (y - mu) ** 2 / log_var.exp()).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def test_a_healthy_gaussian_likelihood_run_is_not_rolled_back(tmp_path):
    """The rules made for losses bounded below by 0 rolled this healthy run back at step 430 (its smoothed loss rose
    from -3.02 to -2.63, which they read as a creep turning into a climb). Now: one signed_loss warning, no action."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 4, generator=g)
    y = torch.sin(x[:, 0]) + 0.5 * x[:, 1] + 0.01 * torch.randn(8192, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    pl.seed_everything(0)
    guard = DivergenceGuard()
    trainer = _trainer(tmp_path, [guard], steps=600, logger=False)
    trainer.fit(_GaussianNLL(), loader)
    assert trainer.global_step == 600 and guard.rollbacks == [] and guard.stopped_step is None
    assert [a.kind for a in guard.hub.history] == ["signed_loss"]


def test_a_loss_a_hair_below_zero_from_rounding_keeps_the_loss_rules():
    guard = DivergenceGuard()
    guard._initial = [2.0]
    assert guard._signed_loss(5, -1e-7) is False and not guard._signed  # a KL divergence at its minimum, rounded
    assert guard._signed_loss(6, 0.0) is False


def test_squared_norms_of_sparse_gradients_match_the_dense_oracle():
    from lightning_monitor._sharded import squared_norms

    i = torch.tensor([[0, 2, 0]])  # index 0 twice: uncoalesced, the duplicates sum
    sparse = torch.sparse_coo_tensor(i, torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), (4, 2))
    dense = torch.tensor([1.0, -2.0])
    plain, sharded = squared_norms([sparse, dense])
    want = sparse.to_dense().pow(2).sum() + dense.pow(2).sum()
    assert sharded is None and float(plain) == pytest.approx(float(want))


class _SparseEmbedding(pl.LightningModule):
    def __init__(self, nan_at: int = -1) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(30, 8, sparse=True)
        self.head = torch.nn.Linear(8, 3)
        self.nan_at = nan_at

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self.head(self.emb(batch[0]).mean(1)), batch[1])
        return loss * float("nan") if self.global_step == self.nan_at else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("nan_at", [-1, 7])
def test_sparse_gradients_are_judged(tmp_path, nan_at):
    """nn.Embedding(sparse=True): the fused norm kernel does not take sparse gradients, which used to fail the fit
    in the guard's first check; a NaN among them is still caught and the step zeroed."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 30, (160, 6), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, 0] % 3), batch_size=16)
    guard = DivergenceGuard(action="stop")
    module = _SparseEmbedding(nan_at)
    _trainer(tmp_path, [guard], steps=10, logger=False).fit(module, loader)
    assert _finite(module)
    if nan_at < 0:
        assert guard.stopped_step is None and guard.hub.history == []
    else:
        assert guard.stopped_step == 7 and [a.kind for a in guard.hub.history if a.severity == "critical"] == ["nonfinite"]


class _ListHub:
    """What a monitor emits its alerts to, outside a Trainer."""

    def __init__(self):
        self.history = []

    def emit(self, alert):
        self.history.append(alert)


def test_a_creep_episode_is_dated_from_its_first_step_and_keeps_snapshots_out():
    # the loss falls to 1.0 and rises to 1.25 (loss_creep, warned), falls back to 1.06 (cleared, no new low), rises to
    # 1.25 again (not warned again: no new low), dips to 1.12 (below the creep limit, above halfway to it), rises
    # again. The dip used to end the episode: the rise was dated anew from its end and, unwarned, let snapshots of
    # the risen weights in (a later rollback then restored them, or found none from before the rise and stopped)
    import math
    import random

    random.seed(0)
    levels = [(200, None), (240, 1.25), (300, 1.06), (340, 1.25), (360, 1.12), (400, 1.25)]
    guard = DivergenceGuard()
    guard._hub = _ListHub()
    starts, high = {}, {}
    for step in range(400):
        level = next(v for end, v in levels if step < end)
        base = 2.0 * math.exp(-step / 40) + 1.0 if level is None else level
        guard._judge(step, base + 0.02 * random.gauss(0, 1), 0.0, False)
        starts[step], high[step] = guard._creep_start, guard._creep_high
    assert [(a.step, a.kind) for a in guard._hub.history] == [(209, "loss_creep"), (257, "loss_creep_cleared")]
    second = starts[310]
    assert second is not None and 300 <= second < 310
    assert all(starts[s] == second for s in range(310, 400))  # through the dip at 340-359
    assert all(high[s] for s in range(310, 400))


def test_one_hard_batch_stays_out_of_the_moving_average():
    # one batch 10^5 times the level (bad data, judged one hard batch), then the loss climbs slowly (weights that the
    # batch's update broke). The jump used to enter the moving average and hold it far above the losses for hundreds
    # of steps: the climb rule (the smoothed loss 1.5 times its minimum, the recent losses up with it) never held,
    # and the climb was never judged
    import random

    random.seed(0)
    guard = DivergenceGuard()
    guard._hub = _ListHub()
    climbs = []
    for step in range(200):
        level = 1.0 if step < 60 else 1.0 + 0.02 * (step - 60)
        loss = 1e5 if step == 50 else level + 0.02 * random.gauss(0, 1)
        _, start, _ = guard._judge(step, loss, 0.0, False)
        if start is not None and start == guard._creep_start:
            climbs.append((step, start))
    assert climbs and 80 < climbs[0][0] < 130 and 60 < climbs[0][1] < climbs[0][0]


def test_a_replay_missing_on_one_rank_is_missing_on_every_rank():
    # a batch that could not be replayed on one rank (None there) and could on the other: the mean was NaN, which the
    # first rank read as None and the second as NaN, so they took different decisions
    from types import SimpleNamespace

    class _TwoRanks:
        def __init__(self, other: torch.Tensor) -> None:
            self.other = other

        def reduce(self, t, reduce_op):
            assert reduce_op == "sum"
            return t + self.other.to(t.dtype)

    module = SimpleNamespace(device=torch.device("cpu"))
    contribution = {None: torch.tensor([0.0, 1.0]), 2.0: torch.tensor([2.0, 0.0]), 4.0: torch.tensor([4.0, 0.0])}
    for mine, theirs, expected in ((None, 2.0, None), (2.0, None, None), (2.0, 4.0, 3.0), (None, None, None)):
        trainer = SimpleNamespace(world_size=2, strategy=_TwoRanks(contribution[theirs]))
        assert DivergenceGuard._rank_mean(trainer, module, mine) == expected
    single = SimpleNamespace(world_size=1)
    assert DivergenceGuard._rank_mean(single, module, None) is None and DivergenceGuard._rank_mean(single, module, 1.5) == 1.5



class _MessagePassing(pl.LightningModule):
    """Message passing (``index_add``) on one random graph a batch, a per-node regression, SGD with momentum 0.9: a
    healthy run whose loss rises from about 0.11 at its start to a noisy 0.4 (batch losses up to 0.9) and stays."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        n, e, d = 64, 256, 8
        self.graphs = []
        for _ in range(512):
            src, dst = torch.randint(0, n, (e,), generator=g), torch.randint(0, n, (e,), generator=g)
            x, w = torch.randn(n, d, generator=g), torch.randn(d, generator=g)
            h = x @ w
            a = torch.zeros(n).index_add(0, dst, h[src]) / 4
            y = torch.tanh(torch.zeros(n).index_add(0, dst, a[src]) / 4 + h / 4)
            self.graphs.append((x, torch.stack([src, dst]), y))
        self.inp = torch.nn.Linear(d, 32)
        self.mix = torch.nn.ModuleList([torch.nn.Linear(64, 32) for _ in range(2)])
        self.out = torch.nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        x, edges, y = self.graphs[int(batch[0])]
        h = torch.relu(self.inp(x))
        src, dst = edges
        for layer in self.mix:
            h = torch.relu(layer(torch.cat([h, torch.zeros_like(h).index_add(0, dst, h[src]) / 4], 1)))
        return torch.nn.functional.mse_loss(self.out(h).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_loss_settled_above_its_start_is_judged_against_its_level(tmp_path, seed):
    """Twice the initial level was a ceiling no loss may cross for long: a loss that rose early and settled above its
    start crossed it with three noisy batches in a row (seed 1: rolled back at step 247, its rate halved). The ceiling
    is twice the recent level where that is higher."""
    guard = DivergenceGuard()
    loader = torch.utils.data.DataLoader(torch.arange(512), batch_size=1, shuffle=True,
                                         generator=torch.Generator().manual_seed(1))
    _trainer(tmp_path, [guard], 400, logger=False).fit(_MessagePassing(seed), loader)
    assert guard.rollbacks == [] and guard.stopped_step is None
    assert not [a for a in guard.hub.history if a.kind == "loss_explosion"]


class _RateAt(pl.Callback):
    """Sets every group's rate to ``rates[k]`` from step ``k`` on (the latest key at or below the step)."""

    def __init__(self, rates: dict) -> None:
        self.rates = rates

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        lr = self.rates[max(k for k in self.rates if k <= trainer.global_step)]
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = lr


def test_a_stop_checkpoint_holds_the_monitors_and_detectors_of_its_good_state(tmp_path, tiny_gpt):
    # the rate is raised 50 times at step 40, before the snapshot of step 40 (whose loss, computed before the update,
    # is normal): the stop restored the weights of step 40 but saved the other monitors' states and the guard's
    # detectors as the diverged steps left them, the raised rate among "the rates trained at with a normal loss". A
    # run resumed from it at a lower rate, raised back to that rate, was then told of a warm restart (a warning, no
    # action) while it diverged again
    from lightning_monitor import GradientNoiseScaleMonitor

    pl.seed_everything(0)
    module, loader = tiny_gpt(lr=3e-3)
    gns = GradientNoiseScaleMonitor(every_n_steps=2)
    guard = DivergenceGuard(action="stop")
    _trainer(tmp_path / "a", [gns, guard, _RateAt({0: 3e-3, 40: 0.15})], steps=100, logger=False).fit(module, loader)
    assert guard.stopped_step is not None and guard.stopped_step > 40
    saved = torch.load(guard.stop_checkpoint, weights_only=False)["callbacks"]
    state = saved[guard.state_key]
    assert state["lr_peak"] == [[3e-3, 3e-3]] and not state["conditions"]  # two parameter groups
    assert saved[gns.state_key]["ema"]["g2"]["count"] == 21  # the checks of steps 0-40 (at the weights of 40), no later

    pl.seed_everything(0)
    module, loader = tiny_gpt(lr=3e-3)
    again = DivergenceGuard(action="stop")
    resumed = _trainer(tmp_path / "b", [again, _RateAt({0: 1e-3, 70: 0.15})], steps=120, logger=False)
    resumed.fit(module, loader, ckpt_path=guard.stop_checkpoint)
    kinds = [(a.kind, a.severity) for a in again.hub.history if a.monitor == "guard"]
    assert ("loss_explosion", "critical") in kinds and ("lr_restart", "warning") not in kinds
    assert again.stopped_step is not None and again.stopped_step >= 70


@pytest.mark.parametrize("lag, raised_at", [(0, 59), (2, 57)])
def test_the_last_updates_of_a_fit_are_judged_at_its_end(tmp_path, tiny_gpt, lag, raised_at):
    # the rate raised 50 times for the fit's last step (or, with lag_steps=2, three steps before its end): no later step
    # judged those updates, and the fit ended with weights at twice the healthy loss, without a word. At the end the
    # last normal batches are evaluated once more; broken, the last good state is restored and saved
    pl.seed_everything(0)
    module, loader = tiny_gpt(lr=3e-3)
    guard = DivergenceGuard(lag_steps=lag)
    _trainer(tmp_path, [guard, _RateAt({0: 3e-3, raised_at: 0.15})], steps=60, logger=False).fit(module, loader)
    critical = [a for a in guard.hub.history if a.severity == "critical"]
    assert critical and critical[0].kind == "loss_explosion"
    if lag == 0:
        assert critical[0].step == 59 and "Training ended at step 59" in critical[0].message
    assert guard.stopped_step == 59 and not guard.rollbacks
    stop = next(a for a in guard.hub.history if a.kind == "stopped")
    assert "at the end of training" in stop.message and stop.details["to_step"] <= raised_at
    saved = torch.load(guard.stop_checkpoint, weights_only=False)["state_dict"]
    assert all(torch.equal(saved[k], v) for k, v in module.state_dict().items())  # the weights in memory: the same

    pl.seed_everything(0)
    module, loader = tiny_gpt(lr=3e-3)
    healthy = DivergenceGuard(lag_steps=lag)
    _trainer(tmp_path / "healthy", [healthy], steps=60, logger=False).fit(module, loader)
    assert healthy.stopped_step is None and not [a for a in healthy.hub.history if a.severity != "info"]


def _gwa_counts_after_a_rollback(tmp_path, tiny_gpt, raised_at, raised_to=0.15, **kw):
    from lightning_monitor import GradientWeightAlignmentMonitor

    pl.seed_everything(0)
    module, loader = tiny_gpt(lr=3e-3, n_samples=256)  # 32 batches of 8 x 32 tokens an epoch
    gwa = GradientWeightAlignmentMonitor(every_n_steps=1, warmup_epochs=0, log_histograms=False)
    guard = DivergenceGuard()
    trainer = _trainer(tmp_path, [gwa, guard, _RateAt({0: 3e-3, raised_at: raised_to})], steps=-1, logger=False, **kw)
    trainer.fit(module, loader)
    return gwa, guard


def test_a_rollback_takes_the_undone_steps_scores_out_of_gwas_epoch(tmp_path, tiny_gpt):
    # GWA's scores of the epoch under way were not part of the guard's snapshots: the steps a rollback undid stayed in
    # the epoch's score, its pick and its best epoch (16384 samples scored where 30 of 32 batches were kept)
    gwa, guard = _gwa_counts_after_a_rollback(tmp_path, tiny_gpt, raised_at=40, max_epochs=2)
    ((step, to_step, skipped),) = [(r["step"], r["to_step"], r["skipped"]) for r in guard.rollbacks]
    assert 32 < to_step < step < 64 and skipped == step - to_step + 1
    # the kept batches only: the batch of the snapshot's own step is skipped too, and its scores leave the epoch with
    # the others (they were kept in it; tests/test_gwa_rollback_scores.py checks the values against a straight run)
    assert [h["count"] for h in gwa.history] == [32 * 256, (32 - skipped) * 256]


def test_a_rollback_at_an_epochs_last_step_keeps_the_epoch_in_gwas_history(tmp_path, tiny_gpt):
    # 8 optimizer steps an epoch (accumulating 4 batches); the rate raised to 1.0 at step 22, the surge seen at step
    # 23, the epoch's last: GWA had recorded the epoch, and the rollback to a snapshot inside it took the record away
    gwa, guard = _gwa_counts_after_a_rollback(tmp_path, tiny_gpt, raised_at=22, raised_to=1.0, max_epochs=4,
                                              accumulate_grad_batches=4)
    assert [(r["step"], r["to_step"]) for r in guard.rollbacks][:1] == [(23, 20)], guard.rollbacks
    assert [h["epoch"] for h in gwa.history] == [0, 1, 2, 3]

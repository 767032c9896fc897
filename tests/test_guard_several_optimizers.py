"""DivergenceGuard with several optimizers (a GAN, manual optimization): one loss series, never two mixed."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from test_several_optimizers import GAN
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard


class _Recording(DivergenceGuard):
    def _judge(self, step, loss, gnorm, scaler_on):
        self.seen.append((step, loss))
        return super()._judge(step, loss, gnorm, scaler_on)


class _LossLog(GAN):
    """Records which optimizer stepped at which global step, and the losses it saw."""

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        step_d = self.trainer.global_step  # the discriminator steps first
        super().training_step(batch, batch_idx)
        self.stepped += [("disc", step_d), ("gen", step_d + 1)]


@pytest.mark.parametrize("index, which", [(0, "gen"), (1, "disc")])
def test_the_guard_judges_one_optimizers_loss(tmp_path, index, which) -> None:
    pl.seed_everything(0)
    guard = _Recording(every_n_steps=2, optimizer_index=index)
    guard.seen = []
    model = _LossLog()
    model.stepped = []
    trainer = pl.Trainer(accelerator="cpu", max_steps=12, logger=False, callbacks=[guard], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    with pytest.warns(UserWarning, match=f"the loss judged is the one of optimizer {index}"):
        trainer.fit(model, DataLoader(TensorDataset(torch.randn(64, 6), torch.randint(0, 2, (64,))), batch_size=8))
    judged = {step for step, loss in guard.seen if loss is not None}
    # optimizer 0 is the generator's (configure_optimizers returns it first)
    assert judged == {step for name, step in model.stepped if name == which}
    assert {step for step, _ in guard.seen} == {step for _, step in model.stepped}  # every step's gradients checked


def test_an_optimizer_index_out_of_range_is_an_error(tmp_path) -> None:
    guard = DivergenceGuard(optimizer_index=2)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, callbacks=[guard], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match="optimizer_index=2"):
        trainer.fit(GAN(), DataLoader(TensorDataset(torch.randn(16, 6), torch.randint(0, 2, (16,))), batch_size=8))


class _Game(pl.LightningModule):
    """Two players on one scalar: optimizer 0 moves ``a`` to minimise ``(a - b)^2 + 1``, optimizer 1 moves ``b``
    (twice as fast) to maximise it, so player 0's loss rises steadily in a run where nothing is wrong (as a GAN's
    generator loss does while its discriminator improves). ``nan_at``: a batch whose loss is NaN."""

    def __init__(self, nan_at=None):
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = torch.nn.Parameter(torch.zeros(())), torch.nn.Parameter(torch.full((), 0.1))
        self.nan_at = nan_at

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        noise = 0.01 * batch[0].mean()
        gap = (self.a - self.b) ** 2
        opt_b.zero_grad()
        self.manual_backward(-gap)
        opt_b.step()
        loss = (self.a - self.b) ** 2 + 1.0 + noise
        if batch_idx == self.nan_at:
            loss = loss * float("nan")
        opt_a.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        return loss

    def configure_optimizers(self):
        return [torch.optim.SGD([self.a], lr=0.01), torch.optim.SGD([self.b], lr=0.02)]


def _fit_game(tmp_path, guard, model, steps=400):
    data = DataLoader(TensorDataset(torch.randn(steps * 4, 3)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, callbacks=[guard], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    trainer.fit(model, data)
    return trainer


def test_with_several_optimizers_only_nonfinite_values_are_judged_by_default(tmp_path) -> None:
    """A two-player game whose judged loss climbs all run (1.0 -> well above 2): the default guard takes no action
    and raises nothing but its start-of-fit warning; with ``loss_rules=True`` the same run is judged by the loss's
    level and acted on; a NaN loss is still caught with the default."""
    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5)
    with pytest.warns(UserWarning, match=r"the loss judged is the one of optimizer 0.*only for non-finite values"):
        _fit_game(tmp_path, guard, model := _Game())
    assert float((model.a - model.b) ** 2 + 1.0) > 2.0  # the judged loss more than doubled
    assert guard.rollbacks == [] and guard.stopped_step is None and guard.hub.history == []

    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5, loss_rules=True)
    with pytest.warns(UserWarning, match=r"its level is judged too"):
        _fit_game(tmp_path / "levels", guard, _Game())
    assert guard.rollbacks or guard.stopped_step is not None  # the climb read as a divergence

    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5)
    with pytest.warns(UserWarning, match="only for non-finite values"):
        _fit_game(tmp_path / "nan", guard, _Game(nan_at=60), steps=200)
    assert [(a.step, a.kind) for a in guard.hub.history if a.severity == "critical"] == [(121, "nonfinite")]


def test_loss_rules_must_be_a_bool_or_none() -> None:
    with pytest.raises(TypeError, match="loss_rules"):
        DivergenceGuard(loss_rules="yes")


class _SharedLoss(pl.LightningModule):
    """One loss, its parameters shared out over two optimizers (as Muon for the matrices and AdamW for the rest, or
    SparseAdam for a sparse embedding): one backward, then both step. ``hot_from``: the step (global, two a batch)
    from which both rates are 1000 times higher; ``order``: which optimizer steps first; ``only_first``: step only
    the first optimizer on even batches (a schedule of updates: no longer one loss for all)."""

    def __init__(self, hot_from=None, order=(0, 1), only_first=False):
        super().__init__()
        self.automatic_optimization = False
        self.body, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
        self.hot_from, self.order, self.only_first = hot_from, order, only_first

    def training_step(self, batch, batch_idx):
        x, y = batch
        opts = self.optimizers()
        if self.hot_from is not None and self.trainer.global_step >= self.hot_from:
            for opt in opts:
                for group in opt.param_groups:
                    group["lr"] = 1000 * 0.05
        loss = torch.nn.functional.cross_entropy(self.head(torch.tanh(self.body(x))), y)
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for i in self.order[:1] if self.only_first and batch_idx % 2 == 0 else self.order:
            opts[i].step()
        return loss

    def configure_optimizers(self):
        return [torch.optim.SGD(self.body.parameters(), lr=0.05), torch.optim.SGD(self.head.parameters(), lr=0.05)]


def _blobs_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    centers = 3.0 * torch.randn(3, 8, generator=g)
    y = torch.randint(0, 3, (1024,), generator=g)
    return DataLoader(TensorDataset(centers[y] + torch.randn(1024, 8, generator=g), y), batch_size=16)


def _fit_shared(tmp_path, model, steps=200, loader=None):
    pl.seed_everything(0)
    guard = DivergenceGuard()
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, callbacks=[guard],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(model, loader or _blobs_loader())
    return guard


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["judged-optimizer-first", "other-first"])
def test_one_loss_over_several_optimizers_is_judged_like_one_optimizers(tmp_path, order) -> None:
    """Taken for a GAN, such a run was judged only for non-finite values: a learning rate 1000 times too high drove
    the loss to hundreds with no action. After three batches that each step every optimizer after their backward, its
    level is judged: the blow-up is rolled back, and the healthy twin sees no action."""
    healthy = _fit_shared(tmp_path, _SharedLoss(order=order))
    said = [a for a in healthy.hub.history if a.kind == "one_loss"]
    assert [(a.step, a.severity) for a in said] == [(6, "info")]
    assert healthy.rollbacks == [] and healthy.stopped_step is None
    assert not [a for a in healthy.hub.history if a.severity != "info"]
    hot = _fit_shared(tmp_path, _SharedLoss(hot_from=100, order=order))
    assert hot.rollbacks and 100 < hot.rollbacks[0]["step"] <= 110  # within 5 batches (two steps a batch)
    assert any(a.kind == "loss_explosion" for a in hot.hub.history)


def test_optimizers_that_do_not_all_step_after_one_backward_are_players(tmp_path) -> None:
    """A batch that steps only some of the optimizers is no loss shared by all: judged for non-finite values only, as
    a GAN (whose batches run a backward between the players' steps, `benchmarks/guard_gan.py`), with the warning."""
    with pytest.warns(UserWarning, match="only for non-finite values"):
        guard = _fit_shared(tmp_path, _SharedLoss(hot_from=100, only_first=True), steps=150)
    assert not [a for a in guard.hub.history if a.kind == "one_loss"] and guard.rollbacks == []
    with pytest.warns(UserWarning, match="only for non-finite values"):
        gan = _LossLog()
        gan.stepped = []
        guard = _fit_shared(tmp_path, gan, steps=12, loader=DataLoader(
            TensorDataset(torch.randn(64, 6), torch.randint(0, 2, (64,))), batch_size=8))
    assert guard._one_loss_batches == 3 and not guard._one_loss_seen and not guard._levels


class _SharedLossReport(_SharedLoss):
    def __init__(self, out, **kw):
        super().__init__(**kw)
        self.out = out

    def on_train_end(self) -> None:
        import json
        import os

        guard = next(c for c in self.trainer.callbacks if isinstance(c, DivergenceGuard))
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"step": self.trainer.global_step, "levels": guard._levels, "rollbacks": guard.rollbacks,
                       "one_loss": [a.step for a in guard.hub.history if a.kind == "one_loss"]}, fh)


def test_one_loss_is_found_alike_on_every_rank_ddp(tmp_path) -> None:
    """Two gloo ranks: the finding is reduced, so both judge the level from the same step and roll back together."""
    import json

    from conftest import fit_ddp_spawn

    guard = DivergenceGuard()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=140, logger=False,
                         callbacks=[guard], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    fit_ddp_spawn(trainer, _SharedLossReport(str(tmp_path), hot_from=100), _blobs_loader())
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0 == r1
    assert r0["levels"] is True and r0["one_loss"] == [6]
    assert r0["rollbacks"] and 100 < r0["rollbacks"][0]["step"] <= 110

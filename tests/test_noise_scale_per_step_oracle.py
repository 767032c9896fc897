"""The noise scale's logged estimates, step by step, against per-example autograd: a summed loss
(``loss_reduction="sum"``), and a trainable set that changes mid-run.

The noise scale is defined on mean gradients. With a summed loss every gradient the monitor reads (``.grad``, a
micro-batch's, a rank's) is a sum over its examples; before, only the per-example norms were read as such, so the
batch gradient's squared norm came out ``B^2`` too large, ``tr(Sigma)`` negative and ``B_simple`` 0 at every step
(the accumulation method's two norms were both ``B^2`` too large: its ratio was right, its units not)."""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import fit_ddp_spawn, tb_scalars
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientNoiseScaleMonitor

B, STEPS = 6, 3


class Classifier(pl.LightningModule):
    def __init__(self, reduction: str, out: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
        self.reduction, self.out = reduction, out

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1], reduction=self.reduction)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the weights, hence the oracle, never move

    def on_train_end(self) -> None:
        if self.out:
            mon = next(c for c in self.trainer.callbacks if isinstance(c, GradientNoiseScaleMonitor))
            with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
                json.dump({"method": mon.resolved_method, "g2": mon.ema.g2.value, "tr": mon.ema.trace_sigma.value,
                           "count": mon.ema.count}, fh)


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 10, generator=g), torch.randint(0, 3, (n,), generator=g)


def _flat_grad(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of the mean loss over ``x`` (one row: one example's own gradient), as one float64 vector."""
    grads = torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters()))
    return torch.cat([g.flatten() for g in grads]).double()


def _estimates(small: torch.Tensor, big: torch.Tensor, b_small: float, b_big: float) -> tuple[float, float]:
    """The unbiased ``|G|^2`` and ``tr(Sigma)`` from the mean squared norm of small-batch mean gradients and the
    squared norm of the big batch's mean gradient."""
    g2 = (b_big * big - b_small * small) / (b_big - b_small)
    tr = (small - big) / (1.0 / b_small - 1.0 / b_big)
    return float(g2), float(tr)


@pytest.mark.parametrize("method,accumulate,scheduled", [("per_example", 1, False), ("per_example", 2, False),
                                                          ("accumulation", 2, False), ("accumulation", 2, True)])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_summed_and_averaged_losses_give_the_oracles_estimates(tmp_path, method, accumulate, scheduled,
                                                               reduction) -> None:
    # scheduled: the accumulation set by a GradientAccumulationScheduler (the Trainer says 1 at setup, and
    # method="accumulation" was refused there)
    n = B * accumulate
    x, y = _data(n * STEPS)
    model = Classifier(reduction)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    mon = GradientNoiseScaleMonitor(method=method, every_n_steps=1, smoothing=0.0, loss_reduction=reduction,
                                    per_layer=False)
    callbacks = [GradientAccumulationScheduler({0: accumulate}), mon] if scheduled else [mon]
    pl.Trainer(accelerator="cpu", max_steps=STEPS, logger=logger, callbacks=callbacks, log_every_n_steps=1,
               accumulate_grad_batches=1 if scheduled else accumulate, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(
        model, DataLoader(TensorDataset(x, y), batch_size=B))
    assert mon.resolved_method == method
    logged = {tag: dict(rows) for tag, rows in tb_scalars(logger.log_dir).items()}
    for step in range(STEPS):
        xs, ys = x[step * n:(step + 1) * n], y[step * n:(step + 1) * n]
        big = _flat_grad(model.net, xs, ys).pow(2).sum()
        if method == "per_example":
            per = torch.stack([_flat_grad(model.net, xs[i:i + 1], ys[i:i + 1]) for i in range(n)])
            g2, tr = _estimates(per.pow(2).sum(1).mean(), big, 1, n)
        else:
            micro = torch.stack([_flat_grad(model.net, xs[j * B:(j + 1) * B], ys[j * B:(j + 1) * B])
                                 for j in range(accumulate)])
            g2, tr = _estimates(micro.pow(2).sum(1).mean(), big, B, n)
        assert logged["gns/g2"][step] == pytest.approx(g2, rel=1e-4, abs=1e-7)
        assert logged["gns/trace_sigma"][step] == pytest.approx(tr, rel=1e-4)
        if g2 > 0:
            assert logged["gns/b_simple"][step] == pytest.approx(tr / g2, rel=1e-3)


def test_a_summed_loss_over_two_ddp_ranks_gives_the_averaged_ones_estimate(tmp_path) -> None:
    x, y = _data(2 * B * 20)
    runs = {}
    for reduction in ("sum", "mean"):
        out = tmp_path / reduction
        out.mkdir()
        mon = GradientNoiseScaleMonitor(every_n_steps=1, smoothing=0.9, loss_reduction=reduction)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=20, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                             callbacks=[mon])
        fit_ddp_spawn(trainer, Classifier(reduction, str(out)), DataLoader(TensorDataset(x, y), batch_size=B))
        runs[reduction] = [json.load(open(out / f"rank{r}.json")) for r in (0, 1)]
    for r in (0, 1):
        assert runs["sum"][r]["method"] == "ddp" and runs["sum"][r]["count"] == 20
        assert runs["sum"][r]["g2"] == pytest.approx(runs["mean"][r]["g2"], rel=1e-4)
        assert runs["sum"][r]["tr"] == pytest.approx(runs["mean"][r]["tr"], rel=1e-4)


class _FreezeAt(pl.Callback):
    """Freeze ``module`` at the start of step ``step`` (as GradientEarlyStopping freezes a component)."""

    def __init__(self, name: str, step: int) -> None:
        self.name, self.step = name, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            pl_module.get_submodule(self.name).requires_grad_(False)


def _bias_corrected_ema(values: list[float], beta: float) -> float:
    acc = 0.0
    for v in values:
        acc = beta * acc + (1.0 - beta) * v
    return acc / (1.0 - beta ** len(values))


def test_the_averages_start_again_when_the_parameters_measured_change(tmp_path) -> None:
    # the model-wide averages had mixed in the checks of the parameters before a freeze: after GradES froze most of a
    # model, B_simple stayed several times that of the parameters still trained for about ten checks
    steps, freeze, beta = 8, 3, 0.5
    x, y = _data(B * steps)
    model = Classifier("mean")
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    mon = GradientNoiseScaleMonitor(every_n_steps=1, smoothing=beta, per_layer=False)
    pl.Trainer(accelerator="cpu", max_steps=steps, logger=logger, callbacks=[_FreezeAt("net.0", freeze), mon],
               log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False).fit(model, DataLoader(TensorDataset(x, y), batch_size=B))
    logged = {tag: dict(rows) for tag, rows in tb_scalars(logger.log_dir).items()}
    last = model.net[2]
    raw = []
    for step in range(freeze, steps):  # the oracle: per-example gradients of the parameters still trained
        xs, ys = x[step * B:(step + 1) * B], y[step * B:(step + 1) * B]

        def flat(xi, yi):
            grads = torch.autograd.grad(F.cross_entropy(model.net(xi), yi), list(last.parameters()))
            return torch.cat([g.flatten() for g in grads]).double()

        per = torch.stack([flat(xs[i:i + 1], ys[i:i + 1]) for i in range(B)])
        raw.append(_estimates(per.pow(2).sum(1).mean(), flat(xs, ys).pow(2).sum(), 1, B))
        g2 = _bias_corrected_ema([r[0] for r in raw], beta)
        tr = _bias_corrected_ema([r[1] for r in raw], beta)
        assert logged["gns/g2"][step] == pytest.approx(g2, rel=1e-4)
        assert logged["gns/trace_sigma"][step] == pytest.approx(tr, rel=1e-4)
    restarts = [json.loads(line) for line in open(os.path.join(logger.log_dir, "alerts.jsonl"))
                if json.loads(line)["kind"] == "averages_restarted"]
    assert len(restarts) == 1 and restarts[0]["step"] == freeze and "2 no longer trained" in restarts[0]["message"]


class _NaNOnce(Classifier):
    """A non-finite loss once, at step ``at``: the guard rolls back to its last snapshot."""

    def __init__(self, at: int) -> None:
        super().__init__("mean")
        self.at, self.done = at, False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == self.at and not self.done:
            self.done = True
            return loss * float("nan")
        return loss


def test_a_rollback_to_before_a_freeze_starts_the_averages_again(tmp_path) -> None:
    # the rollback restores the averages of step 20, over every parameter; the freeze of step 25 stays (the
    # requires_grad flags are no state): the averages must start again, not mix the two sets
    from lightning_monitor import DivergenceGuard

    x, y = _data(B * 60)
    model = _NaNOnce(at=27)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    # judged a step late (as on a GPU), the NaN update applied (its gradients not zeroed: the weights break, so it is
    # no step to skip): the rollback goes back to the check's snapshot of step 20, before the freeze (judged at once,
    # the NaN batch alone is undone, from the state of its own step)
    guard = DivergenceGuard(lag_steps=1, zero_nonfinite_grads=False)
    mon = GradientNoiseScaleMonitor(every_n_steps=1, smoothing=0.9, per_layer=False)
    pl.Trainer(accelerator="cpu", max_steps=35, logger=logger, callbacks=[_FreezeAt("net.0", 25), mon, guard],
               log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False).fit(model, DataLoader(TensorDataset(x, y), batch_size=B))
    assert [(r["step"], r["to_step"]) for r in guard.rollbacks] == [(28, 20)]
    restarts = [json.loads(line)["step"] for line in open(os.path.join(logger.log_dir, "alerts.jsonl"))
                if json.loads(line)["kind"] == "averages_restarted"]
    assert restarts == [25, 29]  # at the freeze, and at the first check after the rollback
    assert mon.ema.count == 35 - 29 and mon._ema_names == {"net.2.weight", "net.2.bias"}

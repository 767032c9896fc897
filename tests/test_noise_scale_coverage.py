"""GradientNoiseScaleMonitor: the coverage of the per-example norms is logged and said, sparse gradients
and activation checkpointing in Trainer.fit, and a model with nothing to measure."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import tb_scalars
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientNoiseScaleMonitor, read_alerts
from lightning_monitor.callbacks.base import NothingToWatch


class Classifier(pl.LightningModule):
    """``body`` then a Linear head, SGD; ``sparse`` embeds integer inputs."""

    def __init__(self, body: nn.Module, width: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(width, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.body(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def run(model, x, y, tmp_path, monitor, steps=4):
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = pl.Trainer(accelerator="cpu", logger=logger, max_steps=steps, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1,
                         callbacks=[monitor])
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    alerts_file = os.path.join(logger.log_dir, "alerts.jsonl")
    alerts = read_alerts(alerts_file) if os.path.exists(alerts_file) else []
    return tb_scalars(logger.log_dir), alerts


def test_batchnorm_model_coverage_logged_and_alerted_once(tmp_path) -> None:
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16))
    model = Classifier(body, 16)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    mon = GradientNoiseScaleMonitor(every_n_steps=1, min_coverage=0.999999)
    tags, alerts = run(model, x, y, tmp_path, mon)
    coverage = [v for _, v in tags["gns/coverage"]]
    assert len(coverage) == 4 and all(0.0 < c < 1.0 for c in coverage)
    assert all(v == 1.0 for _, v in tags["gns/partial"])
    cov = [a for a in alerts if a.kind == "partial_coverage"]
    assert len(cov) == 1 and cov[0].severity == "warning"  # once, not every check
    assert "body.1 (weight, bias)" in cov[0].message and "batch statistics" in cov[0].message
    assert "partial" in cov[0].message


def test_high_coverage_said_on_the_console_not_as_an_alert(tmp_path) -> None:
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16))
    model = Classifier(body, 16)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    # the BatchNorm, and the Linear feeding it (the batch's statistics couple the examples there)
    with pytest.warns(UserWarning, match=r"leave out 4 trainable parameter\(s\) of 2 module.*body.0 \(weight, bias\).*body.1 \(weight, bias\)"):
        tags, alerts = run(model, x, y, tmp_path, GradientNoiseScaleMonitor(every_n_steps=1, min_coverage=0.5))
    assert all(0.5 < v < 1.0 for _, v in tags["gns/coverage"]) and all(v == 0.0 for _, v in tags["gns/partial"])
    assert alerts == []  # a healthy run raises no alert


def test_coverage_matches_the_gradient_share(tmp_path) -> None:
    """gns/coverage is |G_covered|^2 / |G|^2 of the batch gradient, computed independently here."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU())
    model = Classifier(body, 16)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    twin = Classifier(nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU()), 16)
    twin.load_state_dict(model.state_dict())
    F.cross_entropy(twin.head(twin.body(x)), y).backward()
    sq = {n: float(p.grad.pow(2).sum()) for n, p in twin.named_parameters()}
    # left out: the BatchNorm and the Linear feeding it
    expected = 1.0 - sum(sq[f"body.{i}.{p}"] for i in (0, 1) for p in ("weight", "bias")) / sum(sq.values())
    tags, _ = run(model, x, y, tmp_path, GradientNoiseScaleMonitor(every_n_steps=1), steps=1)
    assert tags["gns/coverage"][0][1] == pytest.approx(expected, rel=1e-5)
    assert tags["gns/partial"][0][1] == float(expected < 0.9)


def test_fully_covered_model_has_coverage_one_and_no_alert(tmp_path) -> None:
    torch.manual_seed(0)
    model = Classifier(nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU()), 16)
    tags, alerts = run(model, torch.randn(32, 6), torch.randint(0, 3, (32,)), tmp_path,
                       GradientNoiseScaleMonitor(every_n_steps=2))
    assert [v for _, v in tags["gns/coverage"]] == [1.0, 1.0]
    assert not [a for a in alerts if a.kind == "partial_coverage"]


class EmbeddingBody(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, sparse=sparse)

    def forward(self, idx):
        return self.emb(idx).mean(1)


def test_sparse_embedding_in_fit_same_as_dense(tmp_path) -> None:
    """A sparse embedding gradient trains under the monitor and gives the estimates of the dense one."""
    x, y = torch.randint(0, 20, (32, 5)), torch.randint(0, 3, (32,))
    runs = {}
    for sparse in (True, False):
        torch.manual_seed(0)
        model = Classifier(EmbeddingBody(sparse), 8)
        runs[sparse] = run(model, x, y, tmp_path / str(sparse), GradientNoiseScaleMonitor(every_n_steps=1))
    (tags, alerts), (dense, _) = runs[True], runs[False]
    assert [v for _, v in tags["gns/coverage"]] == [1.0] * 4
    for key in ("gns/g2", "gns/trace_sigma"):
        assert [v for _, v in tags[key]] == pytest.approx([v for _, v in dense[key]], rel=1e-5)
    assert not [a for a in alerts if a.kind == "partial_coverage"]


class CheckpointedBody(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_in_fit_fully_covered(tmp_path, reentrant: bool) -> None:
    torch.manual_seed(0)
    model = Classifier(CheckpointedBody(reentrant), 16)
    tags, alerts = run(model, torch.randn(32, 6), torch.randint(0, 3, (32,)), tmp_path,
                       GradientNoiseScaleMonitor(every_n_steps=1))
    assert [v for _, v in tags["gns/coverage"]] == [1.0] * 4
    assert not [a for a in alerts if a.kind == "partial_coverage"]


class OnlyBatchNorm(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)

    def training_step(self, batch, batch_idx):
        return self.bn(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class OnlyEmbeddingBag(OnlyBatchNorm):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.EmbeddingBag(10, 3)  # no per-example rule: left out at setup

    def training_step(self, batch, batch_idx):
        return self.bn(batch[0].abs().long() % 10).pow(2).mean()


def test_nothing_to_watch_raises_or_stays_idle(tmp_path) -> None:
    x, y = torch.randn(16, 3), torch.randint(0, 3, (16,))
    with pytest.raises(NothingToWatch, match="no parameter of the model is covered"):
        run(OnlyEmbeddingBag(), x, y, tmp_path, GradientNoiseScaleMonitor(every_n_steps=1), steps=2)
    mon = GradientNoiseScaleMonitor(every_n_steps=1)
    mon.idle_when_nothing_to_watch = True
    tags, alerts = run(OnlyEmbeddingBag(), x, y, tmp_path, mon, steps=2)
    assert mon.idle_reason is not None and "covered" in mon.idle_reason
    assert not [t for t in tags if t.startswith("gns/")]
    assert [a.kind for a in alerts] == ["nothing_to_watch"]


def test_a_batchnorm_in_training_mode_is_left_out_when_it_runs(tmp_path) -> None:
    # a BatchNorm is measured in eval mode only; its mode is known when it runs (the training code may put it in eval
    # at each epoch's start), so a model whose only parameters are a training-mode BatchNorm's says so at its first
    # check, as a coverage of 0, with the BatchNorm's reason, and estimates nothing
    x, y = torch.randn(16, 3), torch.randint(0, 3, (16,))
    tags, alerts = run(OnlyBatchNorm(), x, y, tmp_path, GradientNoiseScaleMonitor(every_n_steps=1), steps=2)
    assert [v for _, v in tags["gns/coverage"]] == [0.0, 0.0] and "gns/b_simple" not in tags
    (said,) = [a for a in alerts if a.kind == "partial_coverage"]
    assert "batch statistics couple the examples" in said.message and "nothing is estimated" in said.message


class FoldedChoices(pl.LightningModule):
    """Every layer sees the batch folded with two choices per example, ``(B * 2, d)``, as a multiple-choice model
    does: no module's rows are examples, so the per-example norms cover nothing (found at the first backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 16)
        self.head = nn.Linear(16, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.head(torch.relu(self.body(x.reshape(-1, 6)))).reshape(x.shape[0], 2, 3).mean(1)
        return F.cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_nothing_covered_at_run_time_is_said_and_logged_as_zero_coverage(tmp_path) -> None:
    torch.manual_seed(0)
    tags, alerts = run(FoldedChoices(), torch.randn(32, 2, 6), torch.randint(0, 3, (32,)), tmp_path,
                       GradientNoiseScaleMonitor(every_n_steps=1))
    assert [v for _, v in tags["gns/coverage"]] == [0.0] * 4 and [v for _, v in tags["gns/partial"]] == [1.0] * 4
    assert "gns/b_simple" not in tags and "gns/g2" not in tags  # nothing is estimated
    cov = [a for a in alerts if a.kind == "partial_coverage"]
    assert len(cov) == 1 and cov[0].severity == "warning" and cov[0].value == 0.0
    assert "body (weight, bias)" in cov[0].message and "head (weight, bias)" in cov[0].message
    assert "batch dimension" in cov[0].message  # the probe's reason for each module


class LazyClassifier(pl.LightningModule):
    """``nn.LazyLinear`` layers: their parameters are uninitialized until the first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.LazyLinear(3))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_lazy_modules_are_measured_from_the_first_due_step_after_they_exist(tmp_path) -> None:
    """The probe's hooks on uninitialized parameters failed the fit at step 0; the step is now skipped and the
    parameters are measured from the next due step, fully covered."""
    torch.manual_seed(0)
    tags, alerts = run(LazyClassifier(), torch.randn(64, 6), torch.randint(0, 3, (64,)), tmp_path,
                       GradientNoiseScaleMonitor(every_n_steps=2), steps=8)
    assert [s for s, _ in tags["gns/coverage"]] == [2, 4, 6] and all(v == 1.0 for _, v in tags["gns/coverage"])
    assert not [a for a in alerts if a.kind == "partial_coverage"]


class _GrowingShare(pl.LightningModule):
    """A covered classifier plus a bare parameter (no per-example rule) whose gradient is 0.01 before step 5 and 100
    from there: the share the left-out parameter carries grows past ``1 - min_coverage`` with nothing new left out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.extra = nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        k = 0.01 if self.global_step < 5 else 100.0
        return F.cross_entropy(self.net(x), y) + k * self.extra.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_an_estimate_that_turns_partial_later_is_said_once(tmp_path):
    """The left-out parameter is named at the first check on the console (the estimate stood); when its share grows
    and the estimate turns partial, a `partial_coverage` warning says so (it was never said: nothing new was left
    out)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(160, 6, generator=g), torch.randint(0, 3, (160,), generator=g)
    gns = GradientNoiseScaleMonitor(every_n_steps=1, min_coverage=0.9)
    trainer = pl.Trainer(max_steps=10, accelerator="cpu", logger=False, callbacks=[gns], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="leave out 1 trainable parameter"):
        trainer.fit(_GrowingShare(), DataLoader(TensorDataset(x, y), batch_size=16))
    partial = [a for a in gns.hub.history if a.kind == "partial_coverage"]
    assert [a.step for a in partial] == [5] and partial[0].value < 0.9


def test_a_coverage_just_below_the_threshold_never_reads_as_equal_to_it(tmp_path) -> None:
    """The coverage in the partial_coverage message is rounded down, with a digit more when needed: 0.8998 read
    ``gns/coverage = 0.900 ... below min_coverage=0.9``."""
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from lightning_monitor import GradientNoiseScaleMonitor, read_alerts

    class Net(pl.LightningModule):
        def __init__(self, c: float) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc, self.head = nn.Linear(16, 32), nn.Linear(32, 5)
            self.extra = nn.Parameter(torch.zeros(5))  # held by the module itself: no per-example rule
            self.c = c

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.head(torch.relu(self.fc(x))) + self.c * self.extra, y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 16, generator=g), torch.randint(0, 5, (16,), generator=g)

    def coverage(c: float) -> float:
        m = Net(c)
        m.training_step((x, y), 0).backward()
        total = sum(p.grad.pow(2).sum() for p in m.parameters())
        return float(1 - m.extra.grad.pow(2).sum() / total)

    lo, hi = 0.0, 10.0  # the coverage falls as c grows: c with a coverage of 0.8998
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if coverage(mid) > 0.8998 else (lo, mid)
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=logger, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[GradientNoiseScaleMonitor(every_n_steps=1, min_coverage=0.9)])
    trainer.fit(Net((lo + hi) / 2), DataLoader(TensorDataset(x, y), batch_size=16))
    (alert,) = [a for a in read_alerts(os.path.join(logger.log_dir, "alerts.jsonl")) if a.kind == "partial_coverage"]
    assert alert.value == pytest.approx(0.8998, abs=1e-4)
    import re

    printed = float(re.search(r"gns/coverage = ([0-9.]+)[,)]", alert.message).group(1))
    assert printed < 0.9 and alert.value - printed < 1e-3  # 0.899, not 0.900


class Aliased(Classifier):
    """The same layers reachable under a second name (``self.net``), the forward going through it."""

    def __init__(self, body: nn.Module, width: int) -> None:
        super().__init__(body, width)
        self.net = nn.Sequential(self.body, self.head)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)


def test_modules_reachable_under_two_names_are_measured_once(tmp_path) -> None:
    # hooked under both names, every call was counted twice: the check of the batch gradient failed and every
    # parameter was left out (gns/coverage 0, no B_simple all run)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    results = []
    for cls in (Classifier, Aliased):
        torch.manual_seed(0)
        model = cls(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16)), 16)
        tags, alerts = run(model, x, y, tmp_path / cls.__name__, GradientNoiseScaleMonitor(every_n_steps=1))
        assert [v for _, v in tags["gns/coverage"]] == [1.0] * 4
        assert not [a for a in alerts if a.kind == "partial_coverage"]
        results.append(tags)
    plain, aliased = results
    for key in ("gns/g2", "gns/trace_sigma", "gns/b_simple"):
        assert [v for _, v in aliased[key]] == pytest.approx([v for _, v in plain[key]], rel=1e-6)


class _BatchNormEvalInFirstEpoch(pl.Callback):
    """The BatchNorms in eval mode (running statistics) in epoch 0, in training mode after."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        for m in pl_module.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.train(trainer.current_epoch > 0)


def test_coverage_that_shrinks_at_run_time_starts_the_averages_again(tmp_path) -> None:
    # a BatchNorm measured in eval mode, then found in training mode: its parameters and those feeding it are left
    # out from then on; the averages had gone on, mixing the estimates of the two sets
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16))
    model = Classifier(body, 16)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))  # 8 steps an epoch
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    mon = GradientNoiseScaleMonitor(every_n_steps=2)
    pl.Trainer(accelerator="cpu", logger=logger, max_steps=16, enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False, log_every_n_steps=1, callbacks=[_BatchNormEvalInFirstEpoch(), mon]).fit(
        model, DataLoader(TensorDataset(x, y), batch_size=8))
    tags = tb_scalars(logger.log_dir)
    assert [v for s, v in tags["gns/coverage"] if s < 8] == [1.0] * 4
    assert all(v < 1.0 for s, v in tags["gns/coverage"] if s >= 8)
    alerts = read_alerts(os.path.join(logger.log_dir, "alerts.jsonl"))
    (restart,) = [a for a in alerts if a.kind == "averages_restarted"]
    assert restart.step == 8 and "BatchNorm" in restart.message and "4 no longer" in restart.message
    assert mon.ema.count == 4 and mon._ema_names == {"head.weight", "head.bias", "body.3.weight", "body.3.bias"}


class _TwoPasses(pl.LightningModule):
    """A SAM-like step by hand: a forward and backward, a perturbation of the weights, a second forward and backward
    over the same batch, the perturbation undone, one optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        self.manual_backward(F.cross_entropy(self.net(x), y))
        eps = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in self.parameters()]
        with torch.no_grad():
            for p, e in zip(self.parameters(), eps):
                p.add_(e)
        opt.zero_grad()
        self.manual_backward(F.cross_entropy(self.net(x), y))
        with torch.no_grad():
            for p, e in zip(self.parameters(), eps):
                p.sub_(e)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_two_passes_over_one_batch_are_said_as_such(tmp_path) -> None:
    """SAM's two forward and backward passes give each layer twice the batch's rows: the reason the layers are left
    out says so (it blamed a missing batch dimension, "positions broadcast over the batch")."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    mon = GradientNoiseScaleMonitor(every_n_steps=1)
    run(_TwoPasses(), x, y, tmp_path, mon)
    reasons = mon._probe.reasons if mon._probe is not None else {}
    assert reasons and all("ran 2 times over the batch's 8 examples in the step (gave 16 rows" in r
                           for r in reasons.values()), reasons

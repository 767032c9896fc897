"""Two gloo ranks that see different things: a branch of the model only some ranks' batches reach, epochs of
different lengths, a critical alert raised on one rank only. Nothing may crash or hang, and every rank must take
the same decisions (the rollback's learning-rate factor included)."""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import pytest
import torch
from conftest import fit_ddp_spawn
from test_guard import _CriticalAt
from torch.utils.data import DataLoader, TensorDataset

import lightning_monitor as lm


class _Branchy(pl.LightningModule):
    """A classifier whose second head is used on rank 1's every third batch only."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.body, self.head_a, self.head_b = torch.nn.Linear(8, 32), torch.nn.Linear(32, 4), torch.nn.Linear(32, 4)
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(1024, 8, generator=g)
        self.y = (self.x @ torch.randn(8, 4, generator=g)).argmax(-1)

    def training_step(self, batch, batch_idx):
        (i,) = batch
        h = torch.tanh(self.body(self.x[i]))
        out = self.head_a(h)
        if self.global_rank == 1 and batch_idx % 3 == 0:
            out = out + self.head_b(h)
        return torch.nn.functional.cross_entropy(out, self.y[i])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(1024)), batch_size=16)

    def on_train_end(self) -> None:
        mon = next(c for c in self.trainer.callbacks if isinstance(c, lm.GradientNoiseScaleMonitor))
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"count": mon.ema.count, "b_simple": mon.ema.b_simple, "step": self.trainer.global_step}, fh)


def test_noise_scale_ddp_method_with_a_branch_one_rank_skips(tmp_path) -> None:
    # the ddp method's per-parameter hooks fire only for the parameters a rank's batch reached: each rank all-reduced
    # a vector of its own length (gloo aborted the process: "Received data size doesn't match expected size")
    mon = lm.GradientNoiseScaleMonitor(method="ddp", every_n_steps=1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn_find_unused_parameters_true", max_steps=12,
                         callbacks=[mon], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    fit_ddp_spawn(trainer, _Branchy(str(tmp_path)))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["step"] == r1["step"] == 12 and r0["count"] == r1["count"] == 12
    assert r0["b_simple"] == pytest.approx(r1["b_simple"], rel=1e-6)


class _Uneven(pl.LightningModule):
    """Rank 0's epoch has 20 batches, rank 1's 25 (no distributed sampler)."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(400, 8, generator=g)
        self.y = (self.x @ torch.randn(8, 4, generator=g)).argmax(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        n = 320 if self.global_rank == 0 else 400
        return DataLoader(TensorDataset(self.x[:n], self.y[:n]), batch_size=16)

    def on_train_end(self) -> None:
        hm = next(c for c in self.trainer.callbacks if isinstance(c, lm.HealthMonitor))
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"step": self.trainer.global_step, "gwa_idle": hm.gwa.idle_reason}, fh)


def test_gwa_ddp_epochs_of_different_lengths_leave_it_idle(tmp_path) -> None:
    # GWA reduces each epoch's scores at the epoch's end: on the rank whose epoch ended first that gather met the other
    # rank's gradient all-reduce, and the run hung. The preset's GWA now stays idle and says why; the rest trains
    hm = lm.HealthMonitor()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=60, use_distributed_sampler=False,
                         callbacks=[hm], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    fit_ddp_spawn(trainer, _Uneven(str(tmp_path)))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["step"] == r1["step"] == 60
    assert r0["gwa_idle"] == r1["gwa_idle"] and "different lengths (20, 25 batches)" in r0["gwa_idle"]


class _UnevenWeights(_Uneven):
    def on_train_end(self) -> None:
        guard = next(c for c in self.trainer.callbacks if isinstance(c, lm.DivergenceGuard))
        weights = torch.cat([p.detach().flatten() for p in self.parameters()])
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"step": self.trainer.global_step, "weights": weights.tolist(),
                       "epoch": self.trainer.current_epoch, "rollbacks": guard.rollbacks}, fh)


def test_guard_ddp_skip_batches_undoes_the_same_steps_on_every_rank(tmp_path) -> None:
    # with epochs of 20 and 25 batches, batch (1, 2) comes at step 22 on rank 0 and at step 27 on rank 1: each rank
    # undid its own step's update, and the replicas trained on with different weights (no alert, no error)
    guard = lm.DivergenceGuard(skip_batches=[(1, 2)])
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=40, use_distributed_sampler=False,
                         callbacks=[guard], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    fit_ddp_spawn(trainer, _UnevenWeights(str(tmp_path)))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["step"] == r1["step"] == 40 and r0["rollbacks"] == r1["rollbacks"] == []
    assert torch.equal(torch.tensor(r0["weights"]), torch.tensor(r1["weights"]))


class _HardThenBroken(pl.LightningModule):
    """Regression: at step 42 one batch with targets x30 on both ranks (bad data, the weights not to blame); at step
    48 the weights are perturbed (a divergence at a steady rate)."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(8192, 8, generator=g)
        self.y = 0.3 * (self.x @ torch.randn(8, 1, generator=g)) + torch.randn(8192, 1, generator=g)
        self.poison, self.perturbed = None, False

    def training_step(self, batch, batch_idx):
        (i,) = batch
        x, y = self.x[i], self.y[i]
        if self.global_step == 42 and self.poison is None:
            self.poison = i.clone()
        if self.poison is not None and torch.equal(i, self.poison):
            y = y * 30
        if self.global_step == 48 and not self.perturbed:
            self.perturbed = True
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in self.net.parameters():
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(8192)), batch_size=64, shuffle=True)

    def on_train_end(self) -> None:
        guard = next(c for c in self.trainer.callbacks if isinstance(c, lm.DivergenceGuard))
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"rollbacks": [[r["step"], r["to_step"], r["lr_factor"]] for r in guard.rollbacks],
                       "lr": self.optimizers().param_groups[0]["lr"],
                       "weights": [p.detach().reshape(-1).tolist() for p in self.parameters()]}, fh)


def test_guard_ddp_rate_factor_agrees_with_an_alert_on_one_rank(tmp_path) -> None:
    # a critical alert of another monitor on rank 1 only (step 43) moved that rank's first anomalous step, and with it
    # whether the divergence began with the hard batch of step 42: rank 0 halved the rate, rank 1 kept it, and the
    # replicas drifted apart
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=70,
                         callbacks=[_CriticalAt(43, rank=1), lm.DivergenceGuard(surge=5.0)], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    fit_ddp_spawn(trainer, _HardThenBroken(str(tmp_path)))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["rollbacks"] and r0["rollbacks"] == r1["rollbacks"]
    assert r0["lr"] == r1["lr"]
    assert r0["weights"] == r1["weights"]


def _tanh_classifier(n: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A seeded 8-32-32-4 tanh classifier and ``n`` samples of a linear 4-class problem."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                              torch.nn.Linear(32, 4))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return net, x, (x @ torch.randn(8, 4, generator=g)).argmax(-1)


class _RankInputs(pl.LightningModule):
    """Rank 1's inputs are all positive (its spectral alignment and noise scale differ from rank 0's); writes each
    rank's SA and GNS states at the end of training and at the start of a resumed one."""

    def __init__(self, out: str, tag: str) -> None:
        super().__init__()
        self.out, self.tag = out, tag
        self.net, self.x, self.y = _tanh_classifier(640)

    def training_step(self, batch, batch_idx):
        (i,) = batch
        x = self.x[i].abs() * 3.0 if self.global_rank == 1 else self.x[i]
        return torch.nn.functional.cross_entropy(self.net(x), self.y[i])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(640)), batch_size=16)

    def _dump(self, when: str) -> None:
        sa = next(c for c in self.trainer.callbacks if isinstance(c, lm.SpectralAlignmentMonitor))
        gns = next(c for c in self.trainer.callbacks if isinstance(c, lm.GradientNoiseScaleMonitor))
        state = {"sa": sa.state_dict()["history"], "gns": gns.state_dict()["ema"]}
        with open(os.path.join(self.out, f"{self.tag}-{when}-rank{self.global_rank}.json"), "w") as fh:
            json.dump(state, fh, default=float)

    def on_train_start(self) -> None:
        self._dump("start")

    def on_train_end(self) -> None:
        self._dump("end")


def test_ddp_resume_gives_each_rank_its_own_monitor_state(tmp_path) -> None:
    # Lightning writes rank 0's callback states only: after a resume every rank had rank 0's spectral-alignment
    # history and noise-scale averages (its own sign diversities and examples were lost)
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer(steps: int) -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=steps, logger=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
            callbacks=[lm.SpectralAlignmentMonitor(every_n_steps=2, baseline_checks=1),
                       lm.GradientNoiseScaleMonitor(every_n_steps=2),
                       ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=10, filename="{step}")])

    fit_ddp_spawn(trainer(10), _RankInputs(str(tmp_path), "first"))
    fit_ddp_spawn(trainer(14), _RankInputs(str(tmp_path), "resumed"), ckpt_path=str(tmp_path / "ckpt" / "step=10.ckpt"))
    end = [json.load(open(tmp_path / f"first-end-rank{r}.json")) for r in (0, 1)]
    start = [json.load(open(tmp_path / f"resumed-start-rank{r}.json")) for r in (0, 1)]
    assert end[0]["sa"] != end[1]["sa"]  # the ranks' own values differ (the noise scale's agree under DDP)
    for r in (0, 1):
        assert start[r] == end[r], r


class _NanOnRank1(_UnevenWeights):
    """Rank 1's loss is NaN at the steps ``at`` (a batch whose labels are all ignored, on one rank)."""

    def __init__(self, out: str, at: tuple[int, ...]) -> None:
        super().__init__(out)
        self.at = set(at)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=16)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_rank == 1 and self.global_step in self.at else loss


def test_guard_ddp_bad_batches_close_together_on_one_rank(tmp_path) -> None:
    # the weights-intact test replays the last normal batches on every rank and averages their losses over the ranks:
    # both ranks call it together, agree that the weights are intact, keep the rate and the same weights
    guard = lm.DivergenceGuard()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=70, callbacks=[guard],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    fit_ddp_spawn(trainer, _NanOnRank1(str(tmp_path), (40, 44, 48)))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["step"] == r1["step"] == 70 and r0["rollbacks"] == r1["rollbacks"]
    assert [r["step"] for r in r0["rollbacks"]] == [40, 44, 48]
    assert [r["lr_factor"] for r in r0["rollbacks"]] == [1.0, 1.0, 1.0]
    assert torch.equal(torch.tensor(r0["weights"]), torch.tensor(r1["weights"]))


class _OneRankDrifts(pl.LightningModule):
    """From step 60 rank 1's inputs drift towards one repeated row: only its own rows lose their sign diversity
    (spectral alignment's collapse, a rank-local warning). Writes each rank's rollbacks and weights at the end."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.net, self.x, self.y = _tanh_classifier(1024)

    def training_step(self, batch, batch_idx):
        (i,) = batch
        x = self.x[i]
        if self.global_step >= 60 and self.global_rank == 1:
            a = min(1.0, (self.global_step - 60) / 40.0)
            x = (1 - a) * x + a * 3.0 * x[:1].expand_as(x)
        return torch.nn.functional.cross_entropy(self.net(x), self.y[i])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(1024)), batch_size=16)

    def on_train_end(self) -> None:
        guard = next(c for c in self.trainer.callbacks if isinstance(c, lm.DivergenceGuard))
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"rollbacks": [(r["step"], r["to_step"]) for r in guard.rollbacks],
                       "step": self.trainer.global_step,
                       "weights": [float(p.double().sum()) for p in self.parameters()]}, fh)


def test_guard_ddp_corroboration_by_one_ranks_warning_is_acted_on_together(tmp_path) -> None:
    # corroborate=True: rank 1's own collapse warning agreed with the guard's creep warning at step 78, between two
    # checks; rank 1 acted alone and waited in a collective rank 0 never joined (the run hung). SA checks every 2nd
    # step: with 16 rows a check its collapse counts once beyond its sampling noise, and at every 3rd step it came at
    # step 87, after the creep had cleared (now at step 72, acted on at the check of step 75)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=130, logger=False,
                         callbacks=[lm.SpectralAlignmentMonitor(every_n_steps=2),
                                    lm.DivergenceGuard(every_n_steps=5, corroborate=True)],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    fit_ddp_spawn(trainer, _OneRankDrifts(str(tmp_path)))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["step"] == r1["step"] == 130
    assert r0["rollbacks"] and r0["rollbacks"] == r1["rollbacks"]
    assert all(step % 5 == 0 for step, _ in r0["rollbacks"])  # at the guard's checks, where the ranks agree
    assert r0["weights"] == r1["weights"]


def _jump_at_80(step: int) -> float:
    return 1000.0 if step >= 80 else 1.0


class _PrunedResetJumped(_Uneven):
    """Pruned by Lightning's ModelPruning (with the lottery-ticket rewind) at the end of epoch 1, its head
    re-initialised at step 40 with the guard told (`rebase`), and the rate x1000 from step 80; both ranks see epochs
    of the same length (the distributed sampler)."""

    def __init__(self, out: str) -> None:
        super().__init__(out)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                       torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == 40:
            torch.manual_seed(1)  # the same new head on every rank
            self.net[4].reset_parameters()
            guard = next(c for c in self.trainer.callbacks if isinstance(c, lm.DivergenceGuard))
            guard.rebase(self.trainer, "the head was re-initialised")

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _jump_at_80)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=16)

    def on_train_end(self) -> None:
        guard = next(c for c in self.trainer.callbacks if isinstance(c, lm.DivergenceGuard))
        weights = torch.cat([p.detach().flatten() for p in self.parameters()])
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"step": self.trainer.global_step, "weights": weights.tolist(), "stopped": guard.stopped_step,
                       "rollbacks": [(r["step"], r["to_step"]) for r in guard.rollbacks],
                       "kinds": sorted({a.kind for a in guard.hub.history if a.monitor == "guard"})}, fh)


def _prune_at_epoch_1(epoch: int) -> float:  # a module-level function: the spawned ranks unpickle it
    return 0.8 if epoch == 1 else 0.0


def test_guard_ddp_pruning_a_rebase_and_a_divergence_are_judged_alike_on_every_rank(tmp_path) -> None:
    from lightning.pytorch.callbacks import ModelPruning

    pruning = ModelPruning("l1_unstructured", amount=_prune_at_epoch_1, parameter_names=["weight"],
                           use_lottery_ticket_hypothesis=True, verbose=0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=100,
                         callbacks=[pruning, lm.DivergenceGuard()], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    fit_ddp_spawn(trainer, _PrunedResetJumped(str(tmp_path)))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["step"] == r1["step"] == 100 and r0["stopped"] is None and r1["stopped"] is None
    assert "rebased" in r0["kinds"] and r0["kinds"] == r1["kinds"]
    assert r0["rollbacks"] == r1["rollbacks"] and r0["rollbacks"] and all(to >= 40 for _, to in r0["rollbacks"])
    assert torch.equal(torch.tensor(r0["weights"]), torch.tensor(r1["weights"]))


class _AuxOnOneRank(pl.LightningModule):
    """A main head and an auxiliary one, the auxiliary called last and on rank 1 only; batches ``(x, y_main, y_aux)``
    (``aux_classes`` < 4: the auxiliary head's classes cannot hold the main targets)."""

    def __init__(self, out: str, aux_classes: int = 4, aux_everywhere: bool = False) -> None:
        super().__init__()
        self.out, self.aux_everywhere = out, aux_everywhere
        self.body = torch.nn.Linear(8, 32)
        self.head_main, self.head_aux = torch.nn.Linear(32, 4), torch.nn.Linear(32, aux_classes)
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(512, 8, generator=g)
        self.ym = (self.x @ torch.randn(8, 4, generator=g)).argmax(-1)
        self.ya = (self.x @ torch.randn(8, aux_classes, generator=g)).argmax(-1)

    def training_step(self, batch, batch_idx):
        x, ym, ya = batch
        h = torch.tanh(self.body(x))
        loss = torch.nn.functional.cross_entropy(self.head_main(h), ym)
        if self.aux_everywhere or self.global_rank == 1:
            loss = loss + 0.5 * torch.nn.functional.cross_entropy(self.head_aux(h), ya)
        else:
            loss = loss + 0 * self.head_aux.weight.sum()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.ym, self.ya), batch_size=16)

    def on_train_end(self) -> None:
        gwa = next(c for c in self.trainer.callbacks if isinstance(c, lm.GradientWeightAlignmentMonitor))
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"head": gwa._head_name, "idle": gwa.idle_reason, "step": self.trainer.global_step,
                       "kinds": [a.kind for a in gwa.hub.history if a.monitor == "gwa"]}, fh)


@pytest.mark.parametrize("case", ["aux_on_rank_1", "aux_everywhere", "aux_of_fewer_classes"])
def test_gwa_takes_the_same_head_on_every_rank_ddp(tmp_path, case) -> None:
    """The head is chosen from what every rank saw: the call order, whether the model returned it and the largest
    class target, gathered once. An auxiliary head called last on rank 1 only made rank 1 score it and rank 0 the main
    head; under DDP no output counts as returned, so the head called last was scored and GWA went idle instead of
    trying the other; an auxiliary head of fewer classes than the targets failed the fit."""
    module = _AuxOnOneRank(str(tmp_path), aux_classes=3 if case == "aux_of_fewer_classes" else 4,
                           aux_everywhere=case != "aux_on_rank_1")
    gwa = lm.GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn_find_unused_parameters_true", max_steps=24,
                         callbacks=[gwa], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    fit_ddp_spawn(trainer, module)
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["step"] == r1["step"] == 24
    assert r0["head"] == r1["head"] == "head_main"
    assert r0["idle"] is None and r1["idle"] is None
    assert r0["kinds"] == r1["kinds"]


class _ManualOrNot(pl.LightningModule):
    """The same classifier and data under automatic or manual optimization (``manual_backward`` inside the
    ``training_step`` that DDP runs within the module's call)."""

    def __init__(self, out: str, manual: bool) -> None:
        super().__init__()
        self.out = out
        self.automatic_optimization = not manual
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(512, 8, generator=g)
        self.y = (self.x @ torch.randn(8, 4, generator=g)).argmax(-1)

    def training_step(self, batch, batch_idx):
        (i,) = batch
        loss = torch.nn.functional.cross_entropy(self.net(self.x[i]), self.y[i])
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(512)), batch_size=16)

    def on_train_end(self) -> None:
        mon = next(c for c in self.trainer.callbacks if isinstance(c, lm.GradientNoiseScaleMonitor))
        name = f"{'manual' if not self.automatic_optimization else 'auto'}-rank{self.global_rank}.json"
        with open(os.path.join(self.out, name), "w") as fh:
            json.dump({"count": mon.ema.count, "g2": float(mon.ema.g2.value), "tr": float(mon.ema.trace_sigma.value),
                       "covered": len(mon._probe.covered) if mon._probe is not None else 0}, fh)


def test_per_example_noise_scale_under_manual_optimization_ddp(tmp_path) -> None:
    """Under DDP the entry call is the LightningModule's, running `training_step`; with manual optimization its
    backward comes before that call ends, so the batch dimensions were not found yet and every parameter was left out
    (coverage 0, no estimate). They are now found on the call nested in it that is over (the network's): the estimates
    equal those of the same training under automatic optimization."""
    for manual in (False, True):
        mon = lm.GradientNoiseScaleMonitor(method="per_example", every_n_steps=2)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=8, callbacks=[mon],
                             logger=False, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, default_root_dir=str(tmp_path))
        fit_ddp_spawn(trainer, _ManualOrNot(str(tmp_path), manual))
    auto, manual = (json.load(open(tmp_path / f"{kind}-rank0.json")) for kind in ("auto", "manual"))
    assert manual["count"] == auto["count"] == 4
    assert manual["g2"] == pytest.approx(auto["g2"], rel=1e-5) and manual["tr"] == pytest.approx(auto["tr"], rel=1e-5)
    assert manual["covered"] == auto["covered"] == 4


class _UnevenGrades(_Uneven):
    """Two epochs of 20 batches on rank 0 and of 25 on rank 1 planned; both ranks stop together at step 30."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.trainer.global_step >= 30:
            self.trainer.should_stop = True

    def on_train_end(self) -> None:
        grades = next(c for c in self.trainer.callbacks if isinstance(c, lm.GradientEarlyStopping))
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"step": self.trainer.global_step, "grace_end": grades.grace_end,
                       "frozen": sorted(grades.frozen)}, fh)


def test_grades_ddp_epochs_of_different_lengths_end_the_grace_together(tmp_path) -> None:
    # each rank took its grace period from its own planned steps (40 and 50): from step 20 rank 0 asked the other to
    # agree on a stop at every check, rank 1 did not, and gloo aborted both ("Received data size doesn't match")
    grades = lm.GradientEarlyStopping(grace_fraction=0.5, every_n_steps=5)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn_find_unused_parameters_true", max_epochs=2,
                         use_distributed_sampler=False, callbacks=[grades], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    fit_ddp_spawn(trainer, _UnevenGrades(str(tmp_path)))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["step"] == r1["step"] == 30
    assert r0["grace_end"] == r1["grace_end"] == 20  # half of the fewer planned steps
    assert r0["frozen"] == r1["frozen"]


class _RankClock(pl.callbacks.Timer):
    """A time limit whose clock reads 2 s elapsed on rank 0 and 4 s on rank 1, 4 s remaining, when GWA plans its warm-up
    after the first epoch (the ranks' clocks never agree exactly; here they disagree by half)."""

    def time_elapsed(self, stage="train"):
        return 2.0 if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0 else 4.0

    def time_remaining(self, stage="train"):
        return 4.0


class _Timed(_Uneven):
    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x[:128], self.y[:128]), batch_size=32)  # 2 batches a rank an epoch

    def on_train_end(self) -> None:
        gwa = next(c for c in self.trainer.callbacks if isinstance(c, lm.GradientWeightAlignmentMonitor))
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"warmup": gwa._warmup_resolved, "step": self.trainer.global_step,
                       "eligible": [h["epoch"] for h in gwa.history if h["eligible"]]}, fh)


def test_gwa_ddp_plans_a_time_limited_warm_up_from_rank_zeros_clock(tmp_path) -> None:
    # each rank's own clock would give 3 epochs (half of them: a warm-up of 2) on rank 0 and 2 (a warm-up of 1) on
    # rank 1: the windows, picks and a stop would then differ between the ranks
    gwa = lm.GradientWeightAlignmentMonitor(log_histograms=False, warmup_fraction=0.5)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=8,
                         callbacks=[gwa, _RankClock(duration={"seconds": 40})], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    fit_ddp_spawn(trainer, _Timed(str(tmp_path)))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["step"] == r1["step"] == 8
    assert r0["warmup"] == r1["warmup"] == 2 and r0["eligible"] == r1["eligible"] == [2, 3]


class _RaisedAtTheEnd(pl.LightningModule):
    """The tanh classifier, its rate raised 200 times for the fit's last step (``last``), with GWA and the guard;
    writes each rank's guard outcome, weights and GWA counts."""

    def __init__(self, out: str, last: int) -> None:
        super().__init__()
        self.out, self.last = out, last
        self.net, self.x, self.y = _tanh_classifier(1024)

    def training_step(self, batch, batch_idx):
        (i,) = batch
        return torch.nn.functional.cross_entropy(self.net(self.x[i]), self.y[i])

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == self.last:
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] = 20.0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(1024)), batch_size=16)

    def on_fit_end(self) -> None:  # after the callbacks' on_train_end, where the guard judges the fit's end
        guard = next(c for c in self.trainer.callbacks if isinstance(c, lm.DivergenceGuard))
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"stopped": guard.stopped_step, "to": [a.details.get("to_step") for a in guard.hub.history
                                                            if a.kind == "stopped"],
                       "weights": [float(p.double().sum()) for p in self.parameters()]}, fh)


def test_guard_ddp_the_end_of_fit_check_acts_alike_on_every_rank(tmp_path) -> None:
    # the end-of-fit check evaluates each rank's own last normal batches and reduces the mean loss over the ranks:
    # both ranks find the last update broke the weights, restore the same snapshot and stop at the same step
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=40, logger=False,
                         callbacks=[lm.DivergenceGuard()], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    fit_ddp_spawn(trainer, _RaisedAtTheEnd(str(tmp_path), last=39))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["stopped"] == r1["stopped"] == 39 and r0["to"] == r1["to"] and r0["to"][0] <= 39
    assert r0["weights"] == r1["weights"]

"""GradientEarlyStopping in real Trainer.fit runs (CSV and TensorBoard loggers read back)."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lightning_monitor import GradientEarlyStopping, HealthMonitor, read_alerts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPTConfig, GPTModule, make_loader  # noqa: E402
from conftest import fit_ddp_spawn  # noqa: E402

N_COMPONENTS = 12  # 2 blocks x (q, k, v, o, up, down)


def _module(seed: int = 0) -> GPTModule:
    pl.seed_everything(seed)
    return GPTModule(GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=32), lr=3e-3)


def _loader() -> Any:
    return make_loader("arith", block_size=32, batch_size=8, n_samples=512)


def _trainer(tmp_path: Path, callbacks: list, max_steps: int, logger: Any = None, **kw: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=logger if logger is not None else CSVLogger(tmp_path),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=callbacks, default_root_dir=tmp_path, **kw,
    )


class Recorder(pl.Callback):
    """Weights at the start of every step, and weight gradients before the optimizer step."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.grads: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.weights[trainer.global_step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.grads[trainer.global_step] = {
            n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None
        }


def _csv_rows(logger: CSVLogger) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    with open(os.path.join(logger.log_dir, "metrics.csv"), encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            step = int(row["step"])
            rows.setdefault(step, {}).update({k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"})
    return rows


# ----------------------------------------------------------------------------- statistics through Trainer.fit


@pytest.mark.parametrize("criterion", ["grad", "update"])
def test_logged_statistics_match_numpy_oracle(tmp_path: Path, criterion: str) -> None:
    rec = Recorder()
    cb = GradientEarlyStopping(tau=1e-9, reference_at="early", criterion=criterion, every_n_steps=3, grace_steps=0, reference_checks=2,
                               smoothing=0.5)
    logger = CSVLogger(tmp_path)
    _trainer(tmp_path, [rec, cb], max_steps=13, logger=logger).fit(_module(), _loader())
    assert cb.frozen == {}
    rows = _csv_rows(logger)
    checks = [0, 3, 6, 9, 12]
    names = cb.components
    assert len(names) == N_COMPONENTS
    stats: dict[int, np.ndarray] = {}
    for s in checks:
        if criterion == "grad":
            expected = [np.abs(rec.grads[s][f"{n}.weight"].numpy()).mean() for n in names]
        elif s == 0:
            assert not any(k.endswith("/stat") for k in rows[0])  # first check: a snapshot only
            continue
        else:
            expected = [np.abs(rec.weights[s][f"{n}.weight"].numpy() - rec.weights[s - 3][f"{n}.weight"].numpy()).mean() / 3
                        for n in names]
        stats[s] = np.array(expected)
        got = [rows[s][f"grades/{n}/stat"] for n in names]
        np.testing.assert_allclose(got, expected, rtol=1e-4)
        assert rows[s]["grades/frozen_fraction"] == 0.0
    first = sorted(stats)[:2]
    reference = (stats[first[0]] + stats[first[1]]) / 2
    smoothed = stats[first[0]]
    for s in sorted(stats)[1:]:
        smoothed = 0.5 * smoothed + 0.5 * stats[s]  # EMA, smoothing=0.5
        np.testing.assert_allclose([rows[s][f"grades/{n}/ratio"] for n in names], smoothed / reference, rtol=1e-4)


# ----------------------------------------------------------------------------- freezing, stopping, resuming


def _ratios_at(tmp_path: Path, step: int) -> dict[str, float]:
    """A first run that freezes nothing: the ratio of every component at ``step``."""
    cb = GradientEarlyStopping(tau=1e-9, reference_at="early", every_n_steps=3, grace_steps=step)
    logger = CSVLogger(tmp_path / "probe")
    _trainer(tmp_path / "probe", [cb], max_steps=step + 1, logger=logger).fit(_module(), _loader())
    row = _csv_rows(logger)[step]
    return {n: row[f"grades/{n}/ratio"] for n in cb.components}


def test_freeze_keeps_frozen_weights_and_resume_restores_the_set(tmp_path: Path) -> None:
    grace = 6
    ratios = _ratios_at(tmp_path, grace)
    ordered = sorted(ratios.values())
    tau = (ordered[5] + ordered[6]) / 2  # half of the components are under tau at the first decision
    expected_first = {n for n, r in ratios.items() if r < tau}
    assert len(expected_first) == 6

    rec = Recorder()
    cb = GradientEarlyStopping(tau=tau, reference_at="early", every_n_steps=3, grace_steps=grace)
    logger = TensorBoardLogger(tmp_path, name="run")
    trainer = _trainer(tmp_path, [cb, rec], max_steps=15, logger=logger)
    module = _module()
    trainer.fit(module, _loader())

    assert {n for n, s in cb.frozen.items() if s == grace} == expected_first
    assert all(s >= grace and (s - grace) % 3 == 0 for s in cb.frozen.values())
    assert len(cb.frozen) < N_COMPONENTS and trainer.global_step == 15
    final = dict(module.named_parameters())
    opt = trainer.optimizers[0]
    for name in cb.components:
        module_ = module.get_submodule(name)
        w = f"{name}.weight"
        if name in cb.frozen:
            s = cb.frozen[name]
            assert not module_.weight.requires_grad and not module_.bias.requires_grad
            assert module_.weight not in opt.state and module_.weight.grad is None
            torch.testing.assert_close(final[w].detach(), rec.weights[s][w], rtol=0, atol=0)  # unchanged from its freeze step
            assert not torch.equal(rec.weights[s][w], rec.weights[s - 1][w])  # it trained before
        else:
            assert module_.weight.requires_grad and module_.weight in opt.state
            assert not torch.equal(final[w].detach(), rec.weights[grace][w])
    # non-components keep training
    assert not torch.equal(final["model.lm_head.weight"].detach(), rec.weights[14]["model.lm_head.weight"])

    alerts = read_alerts(os.path.join(logger.log_dir, "alerts.jsonl"))
    frozen_alerts = {a.layer: a.step for a in alerts if a.monitor == "grades" and a.kind == "frozen"}
    assert frozen_alerts == cb.frozen
    assert all(a.severity == "info" and a.value < tau for a in alerts if a.kind == "frozen")
    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    events = acc.Scalars("grades/frozen_fraction")
    assert [e.step for e in events] == [0, 3, 6, 9, 12]
    assert events[-1].value == pytest.approx(len(cb.frozen) / N_COMPONENTS)
    assert events[1].value == 0.0 and events[2].value == pytest.approx(6 / N_COMPONENTS)
    assert "grades/model.blocks.0.attn.q_proj/stat" in acc.Tags()["scalars"]

    # ---- resume: a fresh model re-freezes exactly the same set before the first step
    ckpt = str(tmp_path / "grades.ckpt")
    trainer.save_checkpoint(ckpt)
    frozen_at_save = dict(cb.frozen)
    saved = {n: p.detach().clone() for n, p in module.named_parameters()}

    class FrozenAtStart(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            self.names = {n.rsplit(".", 1)[0] for n, p in pl_module.named_parameters() if not p.requires_grad}

    probe = FrozenAtStart()
    cb2 = GradientEarlyStopping(tau=tau, reference_at="early", every_n_steps=3, grace_steps=grace)
    module2 = _module(seed=1)
    _trainer(tmp_path, [cb2, probe], max_steps=21, logger=CSVLogger(tmp_path / "resumed")).fit(module2, _loader(), ckpt_path=ckpt)
    assert probe.names == set(frozen_at_save)
    assert {n: s for n, s in cb2.frozen.items() if n in frozen_at_save} == frozen_at_save
    torch.testing.assert_close(cb2.reference(), cb.reference())
    for name in frozen_at_save:
        w = f"{name}.weight"
        torch.testing.assert_close(dict(module2.named_parameters())[w].detach(), saved[w], rtol=0, atol=0)


def test_stops_when_all_components_are_frozen(tmp_path: Path) -> None:
    cb = GradientEarlyStopping(tau=1e6, every_n_steps=2, grace_steps=4)
    logger = CSVLogger(tmp_path)
    trainer = _trainer(tmp_path, [cb], max_steps=40, logger=logger)
    module = _module()
    trainer.fit(module, _loader())
    # default reference_at="grace_end": the reference is taken at step 4, the first judged check is step 6
    assert cb.frozen == {n: 6 for n in cb.components} and cb.stopped_at == 6
    assert trainer.global_step == 7  # the step that froze everything was the last one
    assert all(not module.get_submodule(n).weight.requires_grad for n in cb.components)
    alerts = read_alerts(os.path.join(logger.log_dir, "alerts.jsonl"))
    assert [a.kind for a in alerts if a.kind == "stop"] == ["stop"]
    assert _csv_rows(logger)[6]["grades/frozen_fraction"] == 1.0


class UnusedBranchGPT(GPTModule):
    """Each block holds a `global_proj` its forward never calls (Longformer's global-attention projections without a
    global token): a component that never gets a gradient."""

    def __init__(self) -> None:
        pl.seed_everything(0)
        super().__init__(GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=32), lr=3e-3)
        for block in self.model.blocks:
            block.global_proj = nn.Linear(32, 32)


def test_components_that_never_get_a_gradient_do_not_hold_the_stop_back(tmp_path: Path) -> None:
    cb = GradientEarlyStopping(tau=1e6, every_n_steps=2, grace_steps=4)
    logger = CSVLogger(tmp_path)
    trainer = _trainer(tmp_path, [cb], max_steps=40, logger=logger)
    module = UnusedBranchGPT()
    trainer.fit(module, _loader())
    unused = {f"model.blocks.{i}.global_proj" for i in (0, 1)}
    assert unused <= set(cb.components) and len(cb.components) == N_COMPONENTS + 2
    assert set(cb.frozen) == set(cb.components) - unused  # the unused never freeze ...
    assert cb.stopped_at == 6 and trainer.global_step == 7  # ... and the run stops when the others have
    alerts = read_alerts(os.path.join(logger.log_dir, "alerts.jsonl"))
    said = [a for a in alerts if a.kind == "unused_components"]
    assert len(said) == 1 and said[0].severity == "info" and all(n in said[0].message for n in unused)


def test_grace_fraction_of_the_planned_steps(tmp_path: Path) -> None:
    cb = GradientEarlyStopping(tau=1e6, every_n_steps=2, grace_fraction=0.25)
    trainer = _trainer(tmp_path, [cb], max_steps=20)
    trainer.fit(_module(), _loader())
    assert cb.grace_end == 5  # 25% of max_steps=20
    # default reference_at="grace_end": reference at the first check at or after step 5 (6), freeze at the next (8)
    assert set(cb.frozen.values()) == {8} and trainer.global_step == 9


def test_grace_fraction_of_the_steps_a_gradient_accumulation_scheduler_plans(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    # 16 batches an epoch: 16 steps at accumulation 1, then 4 at 4. Lightning's estimate divides every epoch by the
    # Trainer's accumulation at setup (1 under a scheduler): 32 steps, a grace period of 16 of the run's 20
    cb = GradientEarlyStopping(tau=1e-12, every_n_steps=2, grace_fraction=0.5)
    trainer = _trainer(tmp_path, [GradientAccumulationScheduler({0: 1, 1: 4}), cb], max_steps=-1, max_epochs=2,
                       limit_train_batches=16)
    trainer.fit(_module(), _loader())
    assert trainer.global_step == 20 and cb.grace_end == 10


def test_max_frozen_ratio_stops_early(tmp_path: Path) -> None:
    # every component is under an absolute tau of 1e6 at the first decision: 1.0 >= 0.5 stops the run
    cb = GradientEarlyStopping(tau=1e6, threshold="absolute", every_n_steps=1, grace_steps=2, max_frozen_ratio=0.5)
    trainer = _trainer(tmp_path, [cb], max_steps=40)
    trainer.fit(_module(), _loader())
    assert cb.stopped_at == 2 and trainer.global_step == 3 and len(cb.frozen) == N_COMPONENTS


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tau": 0}, "`tau` must be a finite number > 0"),
        ({"tau": -1.0}, "`tau` must be a finite number > 0"),
        ({"tau": float("nan")}, "`tau`"),
        ({"grace_fraction": 1.0}, r"`grace_fraction` must be a number in \[0.0, 1.0\)"),
        ({"grace_fraction": -0.1}, "`grace_fraction`"),
        ({"criterion": "loss"}, "`criterion` must be 'grad'"),
        ({"threshold": "rel"}, "`threshold`"),
        ({"max_frozen_ratio": 0.0}, "`max_frozen_ratio`"),
        ({"smoothing": 1.0}, "`smoothing`"),
        ({"grace_steps": -1}, "`grace_steps`"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GradientEarlyStopping(**kwargs)


@pytest.mark.parametrize("kwargs", [{"include": 5}, {"exclude": [3]}, {"include": ["blocks.*", None]}])
def test_patterns_that_are_not_strings_are_refused_at_construction(kwargs: dict[str, Any]) -> None:
    """``include=5`` was accepted, and ``Trainer(callbacks=[...])`` then failed with "'int' object is not iterable"."""
    with pytest.raises(TypeError, match="must be a string or a sequence of non-empty strings"):
        GradientEarlyStopping(**kwargs)


class NoBlocks(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.head(self.norm(self.emb(x)))
        return F.cross_entropy(logits.reshape(-1, 10), y.reshape(-1) % 10)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class HeadOnlyOptimizer(GPTModule):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.model.lm_head.parameters(), lr=1e-3)


def test_no_component_found_names_the_modules(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no trainable component of NoBlocks.*Module names seen: 'emb', 'norm', 'head'"):
        _trainer(tmp_path, [GradientEarlyStopping()], max_steps=2).fit(NoBlocks(), _loader())


def test_unknown_length_with_fractional_grace(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, [GradientEarlyStopping(grace_fraction=0.3)], max_steps=-1, max_epochs=-1)
    with pytest.raises(ValueError, match=r"grace_fraction=0.3.*no planned length.*max_steps"):
        trainer.fit(_module(), _loader())


class _Stream(torch.utils.data.IterableDataset):
    """The loader's batches as a stream without a length."""

    def __iter__(self):
        yield from _loader()


@pytest.mark.parametrize("kw", [{"max_epochs": 2}, {"max_time": {"seconds": 60}, "max_epochs": -1}])
def test_a_run_of_unknown_length_has_no_fractional_grace(tmp_path: Path, kw) -> None:
    # `max_epochs` over a stream without a length: Lightning plans -1 steps, and the grace period was 0 steps (the
    # reference taken in the first steps' transient); `max_time` alone aborted the fit where the preset's other
    # monitors go idle. Alone the monitor refuses, in the preset it stays idle and says why
    stream = torch.utils.data.DataLoader(_Stream(), batch_size=None)
    with pytest.raises(ValueError, match=r"grace_fraction=0.3.*(unknown|no planned length).*max_steps"):
        _trainer(tmp_path, [GradientEarlyStopping()], max_steps=-1, **kw).fit(_module(), stream)
    health = HealthMonitor(grades=True, spectral=False, noise_scale=False, gwa=False, guard=False)
    short = {"max_epochs": 1} if "max_time" not in kw else {**kw, "max_time": {"seconds": 2}}
    _trainer(tmp_path / "preset", [health], max_steps=-1, **short).fit(_module(), stream)
    assert "grace_fraction=0.3" in health.grades.idle_reason and not health.grades.frozen


def test_optimizer_over_some_parameters(tmp_path: Path) -> None:
    pl.seed_everything(0)
    module = HeadOnlyOptimizer(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=32))
    with pytest.raises(ValueError, match=r"optimizer does not hold the parameters of 6 component.*exclude"):
        _trainer(tmp_path, [GradientEarlyStopping()], max_steps=2).fit(module, _loader())


class FirstBlockFrozen(GPTModule):
    """The optimizer over the trainable parameters only (as BackboneFinetuning asks)."""

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class _FreezeFirstBlockAtSetup(pl.Callback):
    """Freezes the first block in its ``setup``, after GradES's own ``setup`` has found the components (as
    BackboneFinetuning does with a backbone, until it unfreezes it)."""

    def setup(self, trainer, pl_module, stage):
        for p in pl_module.model.blocks[0].parameters():
            p.requires_grad_(False)


def test_components_frozen_before_the_fit_are_left_out(tmp_path: Path) -> None:
    # it raised "the optimizer does not hold the parameters of 6 component(s)" (HealthMonitor(grades=True) listed
    # before BackboneFinetuning aborted the fit)
    pl.seed_everything(0)
    module = FirstBlockFrozen(GPTConfig(n_layer=2, n_head=2, d_model=16, block_size=32))
    grades = GradientEarlyStopping(grace_steps=2)
    logger = CSVLogger(tmp_path)
    trainer = _trainer(tmp_path, [grades, _FreezeFirstBlockAtSetup()], max_steps=20, logger=logger)
    trainer.fit(module, _loader())
    assert grades.idle_reason is None and trainer.global_step == 20
    assert grades._names and all(n.startswith("model.blocks.1.") for n in grades._names)
    left = [a for a in read_alerts(os.path.join(logger.log_dir, "alerts.jsonl")) if a.kind == "components_left_out"]
    assert len(left) == 1 and "model.blocks.0." in left[0].message


@pytest.mark.parametrize(
    ("strategy", "match"),
    [
        (DDPStrategy(), "find_unused_parameters=True"),
        (DDPStrategy(find_unused_parameters=True, static_graph=True), "static_graph"),
    ],
)
def test_ddp_settings_that_would_fail_are_refused(tmp_path: Path, strategy: DDPStrategy, match: str) -> None:
    import re

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=match) as refused:
        GradientEarlyStopping().setup(trainer, _module(), "fit")
    # Lightning's DDP replaces a message holding DDP's words for the failure with its own advice (which named neither
    # GradES nor the spawn variant): the refusal must not quote them
    assert not re.match(".*Expected to have finished reduction in the prior iteration.*", str(refused.value))
    # the right setting passes setup
    ok = pl.Trainer(accelerator="cpu", devices=1, strategy="ddp_find_unused_parameters_true", logger=False,
                    default_root_dir=tmp_path, max_steps=10)
    cb = GradientEarlyStopping()
    cb.setup(ok, _module(), "fit")
    assert len(cb.components) == N_COMPONENTS


# ----------------------------------------------------------------------------- DDP (2 ranks, gloo)


class DeadBranchLM(pl.LightningModule):
    """Two blocks; each `gate_proj` feeds the output through a zero factor, so its gradient is exactly
    zero and it freezes at the first decision, while the live projections never do (tiny tau)."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.emb = nn.Embedding(48, 16)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"q_proj": nn.Linear(16, 16), "up_proj": nn.Linear(16, 16), "gate_proj": nn.Linear(16, 16)})
            for _ in range(2)
        )
        self.head = nn.Linear(16, 48)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.emb(x)
        for b in self.blocks:
            h = h + torch.tanh(b["up_proj"](torch.tanh(b["q_proj"](h)))) + 0.0 * b["gate_proj"](h)
        return F.cross_entropy(self.head(h).reshape(-1, 48), y.reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def on_train_end(self) -> None:
        cb = next(c for c in self.trainer.callbacks if isinstance(c, GradientEarlyStopping))
        out = {
            "frozen": cb.frozen,
            "global_step": self.trainer.global_step,
            "requires_grad": {n: p.requires_grad for n, p in self.named_parameters()},
            "weights": {n: p.detach().double().sum().item() for n, p in self.named_parameters()},
        }
        with open(os.path.join(self.out_dir, f"rank{self.global_rank}.json"), "w", encoding="utf-8") as fh:
            json.dump(out, fh)


def test_ddp_two_ranks_freeze_identically(tmp_path: Path) -> None:
    cb = GradientEarlyStopping(tau=1e-4, reference_at="early", every_n_steps=2, grace_steps=4)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn_find_unused_parameters_true", max_steps=12,
        logger=CSVLogger(tmp_path), enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[cb], default_root_dir=tmp_path,
    )
    # tensors cross to the spawned ranks through shared memory; file descriptors cannot be resized in
    # some sandboxes ("unable to resize file ... Invalid argument"), named files can
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        fit_ddp_spawn(trainer, DeadBranchLM(str(tmp_path)), make_loader("arith", block_size=16, batch_size=4, n_samples=256))
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["frozen"] == r1["frozen"] == {"blocks.0.gate_proj": 4, "blocks.1.gate_proj": 4}
    assert r0["global_step"] == r1["global_step"] == 12  # training went on after the freeze, no DDP error
    assert r0["requires_grad"] == r1["requires_grad"]
    assert not r0["requires_grad"]["blocks.0.gate_proj.weight"] and r0["requires_grad"]["blocks.0.q_proj.weight"]
    assert r0["weights"] == pytest.approx(r1["weights"], rel=1e-6)


# ----------------------------------------------------------------------------- cost and scale


def test_statistic_only_on_due_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_monitor.callbacks.grades as grades_module

    calls: list[int] = []
    original = grades_module.mean_abs

    def counting(tensors: Any) -> torch.Tensor:
        calls.append(len(tensors))
        return original(tensors)

    monkeypatch.setattr(grades_module, "mean_abs", counting)
    cb = GradientEarlyStopping(tau=1e-9, every_n_steps=4, warmup_steps=2, grace_steps=0)
    _trainer(tmp_path, [cb], max_steps=15).fit(_module(), _loader())
    assert calls == [N_COMPONENTS] * 4  # steps 2, 6, 10, 14


class ScaledLoss(GPTModule):
    """The same model with its loss multiplied by a constant (AdamW's updates barely change)."""

    def __init__(self, scale: float) -> None:
        super().__init__(GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=32), lr=3e-3)
        self.scale = scale

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * self.scale


def test_relative_threshold_is_free_of_the_loss_scale(tmp_path: Path) -> None:
    results = {}
    for scale in (1.0, 1000.0):
        for threshold, tau in (("relative", 0.85), ("absolute", 2e-3)):
            pl.seed_everything(0)
            # (the loss still falls at step 24: the progress rule, itself free of the scale, is left out here)
            cb = GradientEarlyStopping(tau=tau, threshold=threshold, every_n_steps=2, grace_steps=10,
                                       min_loss_progress=None)
            _trainer(tmp_path / f"{scale}{threshold}", [cb], max_steps=24).fit(ScaledLoss(scale), _loader())
            results[scale, threshold] = (cb.frozen, cb.reference())
    rel1, rel1000 = results[1.0, "relative"], results[1000.0, "relative"]
    assert rel1[0] == rel1000[0] and 0 < len(rel1[0])
    torch.testing.assert_close(rel1000[1], 1000 * rel1[1], rtol=1e-3, atol=0)
    # the absolute rule's tau means something else at another loss scale
    assert results[1.0, "absolute"][0] != results[1000.0, "absolute"][0]


class _AllLinear(pl.LightningModule):
    """An MLP whose every trainable parameter belongs to a component (three Linear layers, nothing else)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(2048, 16, generator=g)
        self.y = (self.x @ torch.randn(16, 8, generator=g)).argmax(-1)

    def training_step(self, batch, batch_idx):
        (i,) = batch
        return F.cross_entropy(self.net(self.x[i]), self.y[i])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(2048)), batch_size=16)


def test_a_stop_lightning_defers_keeps_the_last_component_trainable(tmp_path: Path) -> None:
    # stop=True, every component converged at once, but `min_steps` defers the stop: the steps until then had nothing
    # to train and the first backward failed ("element 0 of tensors does not require grad")
    grades = GradientEarlyStopping(tau=2.0, grace_steps=10, include=["net.*"])
    trainer = _trainer(tmp_path, [grades], max_steps=60, min_steps=30)  # Lightning adds min_epochs=1: 128 steps
    trainer.fit(_AllLinear())
    assert grades.stopped_at is not None and grades.stopped_at < 30 and trainer.global_step == 60
    assert len(grades.frozen) == len(grades.components) - 1 and len(grades.held) == 1


def test_resuming_a_run_it_stopped_stops_again(tmp_path: Path) -> None:
    # the checkpoint written at the stop, resumed with the same budget: the run trained on with every component frozen
    # (embeddings, norms and head only); with nothing else to train, the first backward failed
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    grades = GradientEarlyStopping(tau=2.0, grace_steps=10, include=["net.*"])
    pl.Trainer(accelerator="cpu", max_steps=60, logger=False, callbacks=[grades, ckpt], enable_progress_bar=False,
               enable_model_summary=False, default_root_dir=tmp_path).fit(_AllLinear())
    stopped = grades.stopped_at
    assert stopped is not None
    again = GradientEarlyStopping(tau=2.0, grace_steps=10, include=["net.*"])
    trainer = _trainer(tmp_path, [again], max_steps=60)
    trainer.fit(_AllLinear(), ckpt_path=str(tmp_path / "ck" / "last.ckpt"))
    assert trainer.global_step == stopped + 1 and again.stopped_at == stopped
    assert any(a.kind == "stop" and "Resumed from a state" in a.message for a in again.hub.history)


def test_stop_false_keeps_the_last_component_trainable(tmp_path: Path) -> None:
    # with stop=False every component froze at once (tau above any ratio) and the next backward failed with "element
    # 0 of tensors does not require grad": the docs promise that training goes on
    grades = GradientEarlyStopping(tau=2.0, stop=False, grace_steps=10, include=["net.*"])
    logger = CSVLogger(tmp_path)
    trainer = _trainer(tmp_path, [grades], max_steps=60, logger=logger)
    module = _AllLinear()
    trainer.fit(module)
    assert trainer.global_step == 60 and grades.stopped_at is None
    assert len(grades.frozen) == len(grades.components) - 1 and len(grades.held) == 1
    (held,) = grades.held
    assert all(p.requires_grad for p in module.get_submodule(held).parameters())
    said = [a for a in read_alerts(os.path.join(logger.log_dir, "alerts.jsonl")) if a.kind == "held_trainable"]
    assert len(said) == 1 and said[0].layer == held


@pytest.mark.parametrize("kw", [{"limit_train_batches": 0, "max_epochs": 1}, {"max_steps": 0}])
def test_a_fit_with_no_training_step_is_idle_not_an_error(tmp_path: Path, kw) -> None:
    # a fit run for its validation alone: the grace period's fraction of nothing is not an unknown length, and the
    # monitor alone does not abort it
    cb = GradientEarlyStopping()
    _trainer(tmp_path, [cb], **{"max_steps": -1, **kw}).fit(_module(), _loader())
    assert cb.idle_reason is not None and "no training step is planned" in cb.idle_reason
    assert not cb.frozen


class _UnfreezeAllAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            pl_module.requires_grad_(True)


def test_components_the_run_unfreezes_are_released(tmp_path: Path) -> None:
    """A callback unfreezes the whole model after GradES froze some components: they trained again while GradES still
    reported them frozen (``frozen``, ``grades/frozen_fraction``), and a rollback would have frozen them again. The
    next check releases them: not frozen, not judged, not counted for the stop, said once (info)."""
    logger = CSVLogger(tmp_path)
    grades = GradientEarlyStopping(tau=1e6, grace_steps=4, every_n_steps=2, stop=False)  # all converge at once
    recorder = Recorder()
    trainer = _trainer(tmp_path, [_UnfreezeAllAt(9), grades, recorder], max_steps=16, logger=logger)
    module = _module()
    trainer.fit(module, _loader())
    frozen_at = {n for n, s in grades.released.items()}
    assert len(frozen_at) == N_COMPONENTS and grades.frozen == {}
    assert set(grades.released.values()) == {10}  # the check after the unfreeze
    said = [a for a in grades.hub.history if a.kind == "released"]
    assert len(said) == 1 and said[0].step == 10 and f"{N_COMPONENTS} component(s)" in said[0].message
    rows = _csv_rows(logger)
    assert rows[10]["grades/frozen_fraction"] == 0.0
    name = sorted(frozen_at)[0]
    weight = f"{name}.weight"
    assert not torch.equal(recorder.weights[15][weight], recorder.weights[10][weight])  # it trains again


class _ShrinkingScale(_AllLinear):
    """The loss is the cross-entropy times a scale that falls 2% a step until step 150, then stays: every gradient
    shrinks with it, model-wide, while the loss falls (as a growing logit scale or temperature does), then the loss
    settles."""

    def training_step(self, batch, batch_idx):
        scale = 0.98 ** min(self.global_step, 150)
        return scale * super().training_step(batch, batch_idx)


def test_components_wait_while_the_loss_still_falls(tmp_path: Path) -> None:
    # a model-wide shrink of the gradients made every component fall below tau at once while the loss still fell
    # (a SigLIP model stopped at step 141 with a loss of 4.65; trained on, 3.99 at step 300)
    runs = {}
    for progress in (None, 0.01):
        pl.seed_everything(0)
        grades = GradientEarlyStopping(grace_steps=30, every_n_steps=5, min_loss_progress=progress, stop=False)
        _trainer(tmp_path / str(progress), [grades], max_steps=260).fit(_ShrinkingScale())
        runs[progress] = grades
    plain, waiting = runs[None], runs[0.01]
    assert plain.frozen and min(plain.frozen.values()) < 150  # the paper's rule freezes in the shrink
    assert waiting.frozen and min(waiting.frozen.values()) > 150  # now only once the loss settled
    said = [a for a in waiting.hub.history if a.kind.startswith("still_learning")]
    assert [a.kind for a in said] == ["still_learning", "still_learning_cleared"]
    assert said[0].step < 150 < said[1].step and "the training loss still falls" in said[0].message
    assert not [a for a in plain.hub.history if a.kind.startswith("still_learning")]


def test_min_loss_progress_is_checked() -> None:
    for bad in (-0.1, 1.5, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="min_loss_progress"):
            GradientEarlyStopping(min_loss_progress=bad)


class _ShrinkingScaleRanks(_ShrinkingScale):
    """Each rank writes its frozen set and its `still_learning` alerts at the end of training."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out

    def on_train_end(self) -> None:
        grades = next(c for c in self.trainer.callbacks if isinstance(c, GradientEarlyStopping))
        said = [[a.kind, a.step] for a in grades.hub.history if a.kind.startswith("still_learning")]
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"frozen": grades.frozen, "said": said, "losses": grades.losses}, fh)


def test_ddp_ranks_wait_for_the_loss_together(tmp_path: Path) -> None:
    # each rank reads its own batches' loss: the progress rule judges the ranks' mean, so every rank holds and
    # freezes at the same checks
    grades = GradientEarlyStopping(grace_steps=30, every_n_steps=5, stop=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn_find_unused_parameters_true",
                         max_steps=220, callbacks=[grades], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    fit_ddp_spawn(trainer, _ShrinkingScaleRanks(str(tmp_path)))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["losses"] == r1["losses"] and r0["said"] == r1["said"] and r0["frozen"] == r1["frozen"]
    assert r0["said"] and r0["said"][0][0] == "still_learning"
    assert r0["frozen"] and min(r0["frozen"].values()) > 150


def test_the_losses_the_progress_rule_reads_travel_with_the_state(tmp_path: Path) -> None:
    pl.seed_everything(0)
    grades = GradientEarlyStopping(grace_steps=30, every_n_steps=5, stop=False)
    _trainer(tmp_path, [grades], max_steps=260).fit(_ShrinkingScale())
    w = grades._loss_window()
    steps = [s for s, _ in grades.losses]
    # the first three checks and the last two windows before the last check are kept, nothing between (the checks
    # end once every component is frozen or held)
    last = steps[-1]
    assert steps[:3] == [0, 5, 10] and steps[3:] == list(range(last - 2 * w + 5, last + 5, 5)) and last > 3 * w
    again = GradientEarlyStopping(grace_steps=30, every_n_steps=5, stop=False)
    again.load_state_dict(grades.state_dict())
    assert again.losses == grades.losses


class _Backbone(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-3)


def test_components_a_finetuning_callback_froze_are_said_to_be_its(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import BackboneFinetuning

    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
    trainer = _trainer(tmp_path, [BackboneFinetuning(unfreeze_backbone_at_epoch=1), GradientEarlyStopping()],
                       max_steps=4)
    with pytest.raises(ValueError, match=r"already frozen.*BackboneFinetuning froze them and may unfreeze them later"):
        trainer.fit(_Backbone(), torch.utils.data.DataLoader(data, batch_size=8))

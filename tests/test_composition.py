"""The monitors together in real Trainer.fit runs: GradES freezing components under the other monitors,
resuming a frozen set with an optimizer over the parameters that require a gradient, callback instances
reused in a second Trainer, and two instances of one monitor in one Trainer."""

from __future__ import annotations

import csv
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from gpt import GPTModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_monitor import (
    DivergenceGuard,
    GradientEarlyStopping,
    GradientNoiseScaleMonitor,
    GradientWeightAlignmentMonitor,
    SpectralAlignmentMonitor,
    read_alerts,
)

CONFIG = {"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 32}
Q, K = "model.blocks.0.attn.q_proj", "model.blocks.0.attn.k_proj"
FREEZE_STEP = 2


def _grades() -> GradientEarlyStopping:
    # on the tiny GPT the mean |gradient| of q/k is ~1e-5 and of v/o/up/down ~1e-3: an absolute tau of
    # 1e-4 freezes q_proj and k_proj (only) at the first decision, step 2, and training goes on
    return GradientEarlyStopping(tau=1e-4, threshold="absolute", every_n_steps=2, grace_steps=FREEZE_STEP)


def _trainer(tmp_path: Any, name: str, callbacks: list, max_steps: int, **kw: Any) -> pl.Trainer:
    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=CSVLogger(str(tmp_path), name=name), callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), **kw,
    )


def _csv_rows(trainer: pl.Trainer) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv"), encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            values = {k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"}
            rows.setdefault(int(row["step"]), {}).update(values)
    return rows


def _steps_with(rows: dict[int, dict[str, float]], key: str) -> list[int]:
    return sorted(s for s, r in rows.items() if key in r)


class _Watch(pl.Callback):
    """Which parameters are frozen at train start and at each step's start; weights at each step's start."""

    def __init__(self) -> None:
        self.frozen_at_start: set[str] = set()
        self.frozen: dict[int, set[str]] = {}
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.frozen_at_start = {n for n, p in pl_module.named_parameters() if not p.requires_grad}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        self.frozen.setdefault(step, {n for n, p in pl_module.named_parameters() if not p.requires_grad})
        self.weights.setdefault(step, {n: p.detach().clone() for n, p in pl_module.named_parameters()})

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.guard_snapshots = [s.step for cb in trainer.callbacks if isinstance(cb, DivergenceGuard)
                                for s in cb._snapshots]


class FilteredGPT(GPTModule):
    """The usual optimizer over the parameters that require a gradient."""

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=self.lr)


def _frozen_params(module: torch.nn.Module) -> set[str]:
    return {n for n, p in module.named_parameters() if not p.requires_grad}


FROZEN_PARAMS = {f"{c}.{w}" for c in (Q, K) for w in ("weight", "bias")}

# ----------------------------------------------------------------------------- GradES x every monitor

CASES = ["sa", "gns_per_example", "gns_accumulation", "gwa", "guard", "all"]


def _others(case: str) -> tuple[list[pl.Callback], dict[str, Any]]:
    trainer_kw: dict[str, Any] = {}
    monitors: list[pl.Callback] = []
    if case in ("sa", "all"):
        monitors.append(SpectralAlignmentMonitor(every_n_steps=2, max_rows=64))
    if case == "gns_per_example":
        monitors.append(GradientNoiseScaleMonitor(method="per_example", every_n_steps=2))
    if case in ("gns_accumulation", "all"):
        monitors.append(GradientNoiseScaleMonitor(method="accumulation", every_n_steps=2))
        trainer_kw["accumulate_grad_batches"] = 2
    if case in ("gwa", "all"):
        monitors.append(GradientWeightAlignmentMonitor(warmup_fraction=0.0))
    if case in ("guard", "all"):
        monitors.append(DivergenceGuard(every_n_steps=2, snapshot_every_n_checks=1))
    return monitors, trainer_kw


# the callback order matters for the noise scale (both act in on_before_optimizer_step): GradES first
# drops the frozen gradients before the noise scale reads them
ORDERS = [(case, True) for case in CASES] + [(case, False) for case in ("gns_per_example", "all")]


@pytest.mark.parametrize(("case", "grades_first"), ORDERS,
                         ids=[f"{c}-{'grades_first' if g else 'grades_last'}" for c, g in ORDERS])
def test_grades_with_each_monitor(tmp_path, tiny_gpt, case: str, grades_first: bool) -> None:
    pl.seed_everything(0)
    module, loader = tiny_gpt(n_samples=96)  # 12 batches: GWA ends an epoch inside the run
    grades = _grades()
    monitors, trainer_kw = _others(case)
    watch = _Watch()
    callbacks = [grades, *monitors, watch] if grades_first else [*monitors, grades, watch]
    max_steps = 14
    trainer = _trainer(tmp_path, "run", callbacks, max_steps, **trainer_kw)
    trainer.fit(module, loader)

    # trained to the end, GradES froze q/k at step 2 and they stayed frozen
    assert trainer.global_step == max_steps
    assert grades.frozen == {Q: FREEZE_STEP, K: FREEZE_STEP}
    assert _frozen_params(module) == FROZEN_PARAMS
    for step in range(FREEZE_STEP + 1, max_steps):
        assert watch.frozen[step] == FROZEN_PARAMS
    final = dict(module.named_parameters())
    for name in FROZEN_PARAMS:  # the freeze dropped step 2's gradient: unchanged since step 2 began
        assert torch.equal(final[name].detach(), watch.weights[FREEZE_STEP][name])
    assert not torch.equal(final["model.blocks.0.attn.v_proj.weight"].detach(),
                           watch.weights[FREEZE_STEP + 1]["model.blocks.0.attn.v_proj.weight"])

    # the other monitors kept logging after the freeze (read back from the CSV logger)
    rows = _csv_rows(trainer)
    after = [s for s in range(FREEZE_STEP + 1, max_steps) if s % 2 == 0]  # due steps after the freeze
    for m in monitors:
        if isinstance(m, SpectralAlignmentMonitor):
            assert set(after) <= set(_steps_with(rows, "sa/sign_diversity_mean"))
            # the frozen layers leave the check (their weights no longer train); the others stay
            assert [s for s in _steps_with(rows, f"sa/{Q}/sigma") if s > FREEZE_STEP] == []
            assert set(after) <= set(_steps_with(rows, "sa/model.blocks.0.attn.v_proj/sigma"))
        elif isinstance(m, GradientNoiseScaleMonitor):
            assert set(after) <= set(_steps_with(rows, "gns/g2")), _steps_with(rows, "gns/g2")
            assert set(after) <= set(_steps_with(rows, "gns/trace_sigma"))
            # the frozen layers left the per-layer estimates; the others stay
            for layer in (Q, K):
                assert [s for s in _steps_with(rows, f"gns/{layer}/b_simple") if s > FREEZE_STEP] == []
            assert not any(Q in n or K in n for n in m._params)
            per_layer_after = {k for s in after for k in rows[s] if k.startswith("gns/model.") and k.endswith("/b_simple")}
            if m.resolved_method == "accumulation":  # per_example's per-layer values may be undefined (< 0)
                assert per_layer_after, rows
        elif isinstance(m, GradientWeightAlignmentMonitor):
            epochs_end = _steps_with(rows, "gwa/mean")
            assert epochs_end and max(epochs_end) > FREEZE_STEP, epochs_end
        elif isinstance(m, DivergenceGuard):
            alerts = read_alerts(os.path.join(trainer.logger.log_dir, "alerts.jsonl"))
            assert not [a for a in alerts if a.monitor == "guard"], alerts
            assert m.rollbacks == []
            assert max(watch.guard_snapshots) > FREEZE_STEP  # snapshots of the frozen model
    alerts = read_alerts(os.path.join(trainer.logger.log_dir, "alerts.jsonl"))
    assert {a.layer for a in alerts if a.kind == "frozen"} == {Q, K}


def test_noise_scale_follows_a_freeze_before_its_first_check(tmp_path, tiny_gpt) -> None:
    # the noise-scale monitor's first check comes after GradES froze q/k: its per-example probe is
    # rebuilt over the parameters that still require a gradient
    pl.seed_everything(0)
    module, loader = tiny_gpt()
    gns = GradientNoiseScaleMonitor(method="per_example", every_n_steps=3, warmup_steps=4)
    trainer = _trainer(tmp_path, "run", [_grades(), gns], max_steps=11)
    trainer.fit(module, loader)
    rows = _csv_rows(trainer)
    assert _steps_with(rows, "gns/g2") == [4, 7, 10]
    assert _frozen_params(module) == FROZEN_PARAMS
    assert gns._probe is not None and not set(gns._probe.covered) & FROZEN_PARAMS


def test_noise_scale_measures_a_layer_unfrozen_mid_run(tmp_path, tiny_gpt) -> None:
    class Unfreeze(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 5:
                for p in pl_module.model.blocks[0].mlp.parameters():
                    p.requires_grad_(True)

    pl.seed_everything(0)
    module, loader = tiny_gpt()
    for p in module.model.blocks[0].mlp.parameters():
        p.requires_grad_(False)
    gns = GradientNoiseScaleMonitor(method="accumulation", every_n_steps=2)
    trainer = _trainer(tmp_path, "run", [Unfreeze(), gns], max_steps=10, accumulate_grad_batches=2)
    trainer.fit(module, loader)
    rows = _csv_rows(trainer)
    up = "gns/model.blocks.0.mlp.up_proj/b_simple"
    assert "model.blocks.0.mlp.up_proj.weight" in gns._params
    assert all(s > 5 for s in _steps_with(rows, up)) and _steps_with(rows, "gns/g2") == [0, 2, 4, 6, 8]


# ----------------------------------------------------------------------------- resume with a frozen set


@pytest.mark.parametrize("method", ["per_example", "accumulation"])
def test_resume_frozen_set_with_requires_grad_filtered_optimizer(tmp_path, tiny_gpt, method: str) -> None:
    accumulate = 2 if method == "accumulation" else 1

    def callbacks() -> tuple[GradientEarlyStopping, GradientNoiseScaleMonitor, SpectralAlignmentMonitor]:
        return (_grades(), GradientNoiseScaleMonitor(method=method, every_n_steps=2),
                SpectralAlignmentMonitor(every_n_steps=2, max_rows=64))

    _, loader = tiny_gpt()
    pl.seed_everything(0)
    module = FilteredGPT(CONFIG)
    grades, gns, sa = callbacks()
    trainer = _trainer(tmp_path, "first", [grades, gns, sa], max_steps=6, accumulate_grad_batches=accumulate)
    trainer.fit(module, loader)
    assert grades.frozen == {Q: FREEZE_STEP, K: FREEZE_STEP}
    ckpt = str(tmp_path / "frozen.ckpt")
    trainer.save_checkpoint(ckpt)
    saved = {n: p.detach().clone() for n, p in module.named_parameters()}
    saved_opt = trainer.optimizers[0].state_dict()
    assert len(saved_opt["param_groups"][0]["params"]) == len(saved)  # built before the freeze: all of them

    pl.seed_everything(1)
    module2 = FilteredGPT(CONFIG)
    grades2, gns2, sa2 = callbacks()
    watch = _Watch()
    trainer2 = _trainer(tmp_path, "resumed", [grades2, gns2, sa2, watch], max_steps=12,
                        accumulate_grad_batches=accumulate)
    trainer2.fit(module2, loader, ckpt_path=ckpt)

    assert trainer2.global_step == 12
    assert grades2.frozen == {Q: FREEZE_STEP, K: FREEZE_STEP}
    assert watch.frozen_at_start == FROZEN_PARAMS  # restored before the first step
    assert all(watch.frozen[s] == FROZEN_PARAMS for s in range(6, 12))
    params = dict(module2.named_parameters())
    for name in FROZEN_PARAMS:
        assert torch.equal(params[name].detach(), saved[name])
        assert params[name] not in trainer2.optimizers[0].state  # its optimizer state was freed
    assert not torch.equal(params["model.blocks.0.attn.v_proj.weight"].detach(), saved["model.blocks.0.attn.v_proj.weight"])
    # the optimizer state went on from the checkpoint's (Adam's step count)
    v = params["model.blocks.0.attn.v_proj.weight"]
    assert int(trainer2.optimizers[0].state[v]["step"]) == 12
    rows = _csv_rows(trainer2)
    assert _steps_with(rows, "gns/g2") == [6, 8, 10]
    assert _steps_with(rows, "sa/sign_diversity_mean") == [6, 8, 10]
    assert [s for s in _steps_with(rows, f"gns/{Q}/b_simple")] == []


# ----------------------------------------------------------------------------- reuse in a second Trainer


def test_callbacks_reused_in_a_second_trainer_start_clean(tmp_path, tiny_gpt) -> None:
    grades = _grades()
    gns = GradientNoiseScaleMonitor(method="per_example", every_n_steps=2)
    sa = SpectralAlignmentMonitor(every_n_steps=2, max_rows=64)
    gwa = GradientWeightAlignmentMonitor(warmup_fraction=0.0)
    callbacks = [grades, gns, sa, gwa]

    pl.seed_everything(0)
    module, loader = tiny_gpt(n_samples=64)
    first = _trainer(tmp_path, "first", [*callbacks, _Watch()], max_steps=9)
    first.fit(module, loader)
    assert grades.frozen == {Q: FREEZE_STEP, K: FREEZE_STEP} and gwa.history

    pl.seed_everything(1)
    module2, loader2 = tiny_gpt(n_samples=64)
    watch = _Watch()
    second = _trainer(tmp_path, "second", [*callbacks, watch], max_steps=9)
    second.fit(module2, loader2)

    # nothing frozen at step 0 (nor before step 2's freeze), then GradES decides afresh
    assert watch.frozen_at_start == set() and watch.frozen[0] == set() and watch.frozen[FREEZE_STEP] == set()
    assert watch.frozen[FREEZE_STEP + 1] == FROZEN_PARAMS
    assert grades.frozen == {Q: FREEZE_STEP, K: FREEZE_STEP}
    rows = _csv_rows(second)
    assert _steps_with(rows, "grades/frozen_fraction") == [0, 2, 4, 6, 8]
    assert rows[0]["grades/frozen_fraction"] == 0.0
    # the noise scale works and starts its EMA afresh (the checks of this run only), and again once GradES's freeze
    # at step 2 changed what it measures (the checks at steps 4, 6 and 8)
    assert _steps_with(rows, "gns/g2") == [0, 2, 4, 6, 8]
    assert gns.ema.count == 3
    assert sa._n_checks == 5 and _steps_with(rows, "sa/sign_diversity_mean") == [0, 2, 4, 6, 8]
    assert [h["epoch"] for h in gwa.history] == [0, 1]  # this run's epochs only (1: partial, at fit end)
    alerts = read_alerts(os.path.join(second.logger.log_dir, "alerts.jsonl"))
    assert [(a.layer, a.step) for a in alerts if a.kind == "frozen"] == [(Q, 2), (K, 2)]


def test_state_loaded_by_hand_before_a_second_trainer_is_kept(tmp_path, tiny_gpt) -> None:
    sa = SpectralAlignmentMonitor(every_n_steps=2, max_rows=64)
    pl.seed_everything(0)
    module, loader = tiny_gpt()
    _trainer(tmp_path, "first", [sa], max_steps=5).fit(module, loader)
    state = sa.state_dict()
    assert state["n_checks"] == 3
    sa.load_state_dict(state)  # carried over on purpose
    _trainer(tmp_path, "second", [sa], max_steps=5).fit(module, loader)
    assert sa._n_checks == 6


# ----------------------------------------------------------------------------- two instances of one monitor


def test_two_spectral_monitors_with_checkpointing_and_resume(tmp_path, tiny_gpt) -> None:
    def monitors() -> tuple[SpectralAlignmentMonitor, SpectralAlignmentMonitor]:
        return (SpectralAlignmentMonitor(include="model.blocks.0.attn.*", every_n_steps=2, max_rows=64),
                SpectralAlignmentMonitor(include="model.blocks.0.mlp.*", every_n_steps=3, max_rows=64))

    attn, mlp = monitors()
    assert attn.state_key != mlp.state_key
    pl.seed_everything(0)
    module, loader = tiny_gpt()
    ckpt_cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=6, save_top_k=-1)
    trainer = _trainer(tmp_path, "first", [attn, mlp, ckpt_cb], max_steps=6, enable_checkpointing=True)
    trainer.fit(module, loader)
    ckpt = os.path.join(str(tmp_path / "ck"), "epoch=0-step=6.ckpt")
    states = torch.load(ckpt, weights_only=False)["callbacks"]
    assert set(states[attn.state_key]["history"]) == set(attn.layers) == {
        f"model.blocks.0.attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert set(states[mlp.state_key]["history"]) == set(mlp.layers) == {"model.blocks.0.mlp.up_proj", "model.blocks.0.mlp.down_proj"}
    assert states[attn.state_key]["n_checks"] == 3 and states[mlp.state_key]["n_checks"] == 2

    class AtStart(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            self.seen = {m.state_key: (m._n_checks, set(m._history), {k: v.clone() for k, v in m._vectors.items()})
                         for m in (attn2, mlp2)}

    attn2, mlp2 = monitors()
    at_start = AtStart()
    trainer2 = _trainer(tmp_path, "resumed", [attn2, mlp2, at_start], max_steps=12)
    trainer2.fit(module, loader, ckpt_path=ckpt)
    for mon, old in ((attn2, attn), (mlp2, mlp)):
        n_checks, history, vectors = at_start.seen[mon.state_key]
        assert n_checks == states[old.state_key]["n_checks"] and history == set(old.layers)
        assert set(vectors) == set(old.layers)
        for layer, v in vectors.items():
            torch.testing.assert_close(v, states[old.state_key]["vectors"][layer])
    assert attn2._n_checks == 3 + 3 and mlp2._n_checks == 2 + 2  # steps 6, 8, 10 and 6, 9
    rows = _csv_rows(trainer2)
    assert _steps_with(rows, "sa/model.blocks.0.attn.q_proj/sigma") == [6, 8, 10]
    assert _steps_with(rows, "sa/model.blocks.0.mlp.up_proj/sigma") == [6, 9]


@pytest.mark.parametrize(
    "make",
    [
        lambda: [GradientNoiseScaleMonitor(include="model.blocks.*"), GradientNoiseScaleMonitor(include="model.lm_head")],
        lambda: [GradientEarlyStopping(grace_steps=2, include="*.attn.*"),
                 GradientEarlyStopping(grace_steps=2, include="*.mlp.*")],
        lambda: [GradientWeightAlignmentMonitor(warmup_fraction=0.0),
                 GradientWeightAlignmentMonitor(warmup_fraction=0.0, warmup_steps=4)],
        lambda: [SpectralAlignmentMonitor(head=None), SpectralAlignmentMonitor()],
    ],
    ids=["gns", "grades", "gwa", "sa_head"],
)
def test_state_keys_tell_instances_apart(make: Any) -> None:
    a, b = make()
    assert a.state_key != b.state_key


class _HeadCalledDirectly(pl.LightningModule):
    """A classifier whose head ``training_step`` calls itself: the per-example probe treats it as a model entry and
    runs it once more on a two-row batch to find its batch dimension (a dry run)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.head(torch.relu(self.body(batch[0]))), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _head_loader() -> Any:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()),
                                       batch_size=16)


def test_the_probes_dry_run_is_not_seen_by_other_monitors(tmp_path) -> None:
    """The noise-scale probe's dry run of the head used to reach GWA's head hook: GWA took the two rows for the
    step's logits, failed on its targets (so the probe dropped the head from its coverage) and lost the step's
    scores. Now GWA's scores equal those of GWA alone, and the probe covers the whole gradient."""
    def fit(callbacks: list) -> pl.Trainer:
        pl.seed_everything(0)
        trainer = pl.Trainer(accelerator="cpu", max_epochs=2, callbacks=callbacks, logger=CSVLogger(str(tmp_path)),
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                             default_root_dir=str(tmp_path))
        trainer.fit(_HeadCalledDirectly(), _head_loader())
        return trainer

    alone = GradientWeightAlignmentMonitor(warmup_epochs=0)
    fit([alone])
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    gns = GradientNoiseScaleMonitor(every_n_steps=1)
    spectral = SpectralAlignmentMonitor(every_n_steps=1)
    trainer = fit([spectral, gns, gwa])
    assert gwa.idle_reason is None
    assert [(h["count"], h["mean"]) for h in gwa.history] == [(h["count"], h["mean"]) for h in alone.history]
    assert gwa.history[0]["count"] == 64
    assert float(trainer.callback_metrics["gns/coverage"]) == pytest.approx(1.0)


class _FrozenWeights(pl.Callback):
    """The weights of q/k at the end of every step (``global_step`` after it), and whether the optimizer holds state
    for them."""

    def __init__(self) -> None:
        self.weights: dict[int, list[torch.Tensor]] = {}
        self.in_state: dict[int, bool] = {}

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        params = [pl_module.get_submodule(n).weight for n in (Q, K)]
        self.weights[trainer.global_step] = [p.detach().clone() for p in params]
        self.in_state[trainer.global_step] = any(p in trainer.optimizers[0].state for p in params)


def test_a_rollback_keeps_frozen_components_as_they_froze(tmp_path, tiny_gpt) -> None:
    # q/k freeze at step 2; a NaN at step 7 rolls back to the snapshot of step 0, from before the freeze: q/k stayed
    # frozen at their weights of step 0 (updates the rollback undid, on a trajectory never judged converged) and got
    # their optimizer state back for good
    module, loader = tiny_gpt(nan_at_step=7)
    grades, guard, watch = _grades(), DivergenceGuard(every_n_steps=5, snapshot_every_n_checks=2), _FrozenWeights()
    _trainer(tmp_path, "rb", [grades, guard, watch], max_steps=20).fit(module, loader)
    assert set(grades.frozen) == {Q, K} and [(r["step"], r["to_step"]) for r in guard.rollbacks] == [(7, 0)]
    frozen_with = watch.weights[FREEZE_STEP + 1]  # after the update of the freeze's step (which skips them)
    for step in range(FREEZE_STEP + 1, 21):
        assert all(torch.equal(a, b) for a, b in zip(watch.weights[step], frozen_with)), step
        assert not watch.in_state[step], step
    assert all(not module.get_submodule(n).weight.requires_grad for n in (Q, K))

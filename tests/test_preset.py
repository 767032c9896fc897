"""HealthMonitor: the recommended monitors as one callback. Settings reach each monitor; the monitors join
``trainer.callbacks`` as ordinary callbacks (the guard sees the others, an explicit monitor replaces the
preset's), their states round-trip through a checkpoint, a model with nothing to watch for some monitors
trains, and per-layer statistics are folded into histograms by default."""

from __future__ import annotations

import logging
import math
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import tb_event_accumulator, tb_scalars
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_monitor as lm
from lightning_monitor.callbacks.gradient_weight_alignment import default_target_fn

FAST = dict(spectral=dict(every_n_steps=2), noise_scale=dict(every_n_steps=2), guard=dict(every_n_steps=2))


def _trainer(tmp_path: Any, callbacks: list, max_steps: int, **kw: Any) -> pl.Trainer:
    kw.setdefault("enable_checkpointing", False)
    kw.setdefault("logger", TensorBoardLogger(str(tmp_path), name="run", version=""))
    return pl.Trainer(
        accelerator="cpu", max_steps=max_steps, callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path), log_every_n_steps=2, **kw,
    )


def test_settings_reach_each_monitor() -> None:
    hm = lm.HealthMonitor(spectral=dict(every_n_steps=100), gwa=False, grades=True)
    assert isinstance(hm.spectral, lm.SpectralAlignmentMonitor) and hm.spectral.every_n_steps == 100
    assert isinstance(hm.noise_scale, lm.GradientNoiseScaleMonitor)
    assert isinstance(hm.guard, lm.DivergenceGuard)
    assert isinstance(hm.grades, lm.GradientEarlyStopping)
    assert hm.gwa is None
    assert [type(m) for m in hm.monitors] == [
        lm.SpectralAlignmentMonitor, lm.GradientNoiseScaleMonitor, lm.GradientEarlyStopping, lm.DivergenceGuard
    ]
    for m in hm.monitors:
        assert m.idle_when_nothing_to_watch and not m.per_layer_scalars
    # GradES changes training: off unless asked
    assert lm.HealthMonitor().grades is None
    assert all(m.per_layer_scalars for m in lm.HealthMonitor(per_layer_scalars=True).monitors)


def test_callable_arguments_take_a_dotted_path() -> None:
    path = "lightning_monitor.callbacks.gradient_weight_alignment.default_target_fn"
    hm = lm.HealthMonitor(gwa=dict(target_fn=path))
    assert hm.gwa.target_fn is default_target_fn
    with pytest.raises(ValueError, match="gwa.target_fn"):
        lm.HealthMonitor(gwa=dict(target_fn="no_such_module.fn"))


def test_the_monitors_callable_arguments_take_a_dotted_path_too() -> None:
    path = "lightning_monitor.callbacks.gradient_weight_alignment.default_target_fn"
    assert lm.GradientWeightAlignmentMonitor(target_fn=path, index_fn=path).target_fn is default_target_fn
    with pytest.raises(ValueError, match="`index_fn`='no_such_module.fn' is not an importable dotted path"):
        lm.GradientWeightAlignmentMonitor(index_fn="no_such_module.fn")
    with pytest.raises(TypeError, match="`target_fn` must be a callable"):
        lm.GradientWeightAlignmentMonitor(target_fn=3)


@pytest.mark.parametrize("make", [
    lambda v: lm.HealthMonitor(progress_bar=v), lambda v: lm.HealthMonitor(dashboard=v),
    lambda v: lm.HealthMonitor(per_layer_scalars=v), lambda v: lm.DivergenceGuard(zero_nonfinite_grads=v),
    lambda v: lm.DivergenceGuard(corroborate=v), lambda v: lm.GradientEarlyStopping(stop=v),
    lambda v: lm.GradientWeightAlignmentMonitor(mask_warmup=v), lambda v: lm.GradientNoiseScaleMonitor(per_layer=v),
    lambda v: lm.SpectralAlignmentMonitor(log_histograms=v),
])
def test_switches_take_booleans_only(make) -> None:
    # `progress_bar="no"` is truthy: taken for True, it left the bar on
    with pytest.raises(ValueError, match="must be True or False, got 'no'"):
        make("no")
    with pytest.raises(ValueError, match="must be True or False, got None"):
        make(None)
    with pytest.raises(ValueError, match="must be True or False, got 1"):
        make(1)
    make(False), make(True)


def test_a_pattern_argument_that_is_not_a_sequence_is_named() -> None:
    with pytest.raises(TypeError, match="`include` must be a string or a sequence of non-empty strings, got 5"):
        lm.SpectralAlignmentMonitor(include=5)


def test_bad_settings_name_the_monitor() -> None:
    with pytest.raises(TypeError, match="spectral.*SpectralAlignmentMonitor"):
        lm.HealthMonitor(spectral=dict(no_such_argument=1))
    with pytest.raises(TypeError, match="noise_scale"):
        lm.HealthMonitor(noise_scale=3)


def test_monitors_join_the_trainer_and_fold_per_layer_keys(tmp_path, tiny_gpt) -> None:
    module, loader = tiny_gpt()
    hm = lm.HealthMonitor(**FAST)
    trainer = _trainer(tmp_path, [hm], max_steps=6)
    trainer.fit(module, loader)

    callbacks = trainer.callbacks
    at = next(i for i, cb in enumerate(callbacks) if cb is hm)
    assert callbacks[at + 1 : at + 1 + len(hm.monitors)] == hm.monitors  # right after the preset, in order
    assert sum(cb is hm.guard for cb in callbacks) == 1
    # every monitor was set up and ran its checks
    assert hm.spectral.hub is hm.guard.hub
    # the guard finds the other monitors in trainer.callbacks: their states travel with its snapshots
    assert set(hm.guard._monitors(trainer)) == {m.state_key for m in (hm.spectral, hm.noise_scale, hm.gwa)}

    ea = tb_event_accumulator(str(tmp_path))
    scalars, histograms = set(ea.Tags()["scalars"]), set(ea.Tags()["histograms"])
    assert {"sa/sign_diversity_mean", "sa/sigma_growth", "gns/b_simple", "gns/batch_size"} <= scalars
    # per-layer statistics: one histogram per statistic, no scalar per layer ...
    assert {"sa/layers/sign_diversity", "sa/layers/sigma", "sa/layers/mean_abs", "gns/layers/b_simple"} <= histograms
    assert not [t for t in scalars if t.count("/") >= 2 and t.split("/")[0] in ("sa", "gns")]
    assert len(ea.Histograms("sa/layers/sign_diversity")) == 3  # steps 0, 2, 4
    # ... while callback_metrics keeps every per-layer key (EarlyStopping / ModelCheckpoint can use them)
    assert "sa/model.blocks.0.attn.q_proj/sign_diversity" in trainer.callback_metrics
    # the dashboard layout, written once
    assert "custom_scalars__config__" in ea.Tags()["tensors"]
    assert len(ea.Tensors("custom_scalars__config__")) == 1

    # a second fit of the same trainer: the monitors are not added twice
    trainer.fit_loop.epoch_loop.max_steps = 8
    trainer.fit(module, loader)
    assert [type(cb) for cb in trainer.callbacks].count(lm.DivergenceGuard) == 1


def test_per_layer_scalars_on_keeps_one_scalar_per_layer(tmp_path, tiny_gpt) -> None:
    module, loader = tiny_gpt()
    trainer = _trainer(tmp_path, [lm.HealthMonitor(per_layer_scalars=True, gwa=False, **FAST)], max_steps=3)
    trainer.fit(module, loader)
    ea = tb_event_accumulator(str(tmp_path))
    assert "sa/model.blocks.0.attn.q_proj/sign_diversity" in ea.Tags()["scalars"]
    assert not [t for t in ea.Tags()["histograms"] if "/layers/" in t]


def test_an_explicit_monitor_replaces_the_presets(tmp_path, tiny_gpt) -> None:
    module, loader = tiny_gpt()
    mine = lm.DivergenceGuard(action="warn", every_n_steps=2)
    hm = lm.HealthMonitor(**FAST)
    trainer = _trainer(tmp_path, [hm, mine], max_steps=2)
    trainer.fit(module, loader)
    guards = [cb for cb in trainer.callbacks if isinstance(cb, lm.DivergenceGuard)]
    assert guards == [mine]
    assert hm.spectral in trainer.callbacks
    # the preset's attribute names the guard that watched the run (its rollbacks are the ones read after the fit)
    assert hm.guard is mine and hm.guard in hm.monitors


def test_a_second_preset_adds_what_the_first_lacks_and_says_what_it_does_not(tmp_path, tiny_gpt) -> None:
    # a YAML's preset and one added on the command line: the second said four times that a monitor "passed to the
    # Trainer" replaced its own, and its GradES was dropped although the first had none
    module, loader = tiny_gpt()
    first = lm.HealthMonitor(**FAST)
    second = lm.HealthMonitor(**FAST, grades={"stop": False})
    with pytest.warns(UserWarning, match="two HealthMonitor presets; the first one's SpectralAlignmentMonitor, "):
        _trainer(tmp_path, [first, second], max_steps=2).fit(module, loader)
    assert second.grades is not None and second.grades._hub is not None  # the one monitor the first lacked joined
    assert second.guard is first.guard  # the first's guard watches the run: the second's attribute names it


class _States(pl.Callback):
    """The preset's monitors' states when the fit starts (after a checkpoint's restore)."""

    def __init__(self, hm: lm.HealthMonitor) -> None:
        self.hm = hm
        self.states: dict[str, Any] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.states = {m.state_key: m.state_dict() for m in self.hm.monitors}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not hasattr(self, "gwa_count"):
            gwa = next(m for m in self.hm.monitors if isinstance(m, lm.GradientWeightAlignmentMonitor))
            self.gwa_count = float(gwa._moments.state[0])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # both NaN
    return a == b


def test_checkpoint_round_trip(tmp_path, tiny_gpt) -> None:
    module, loader = tiny_gpt()
    hm = lm.HealthMonitor(**FAST)
    ckpt_cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=6, save_top_k=-1)
    trainer = _trainer(tmp_path / "a", [hm, ckpt_cb], max_steps=6, enable_checkpointing=True)
    trainer.fit(module, loader)
    ckpt_path = ckpt_cb.best_model_path or ckpt_cb.last_model_path
    saved = torch.load(ckpt_path, weights_only=False)["callbacks"]
    for m in hm.monitors:  # one entry per monitor, under its own state key
        assert m.state_key in saved, m.state_key

    module2, _ = tiny_gpt()
    hm2 = lm.HealthMonitor(**FAST)
    probe = _States(hm2)
    trainer2 = _trainer(tmp_path / "b", [probe, hm2], max_steps=8)
    trainer2.fit(module2, loader, ckpt_path=ckpt_path)
    assert probe.states.keys() == {m.state_key for m in hm2.monitors}
    for key, state in probe.states.items():
        # GWA's open epoch (a checkpoint inside an epoch) goes back into its accumulators, not its state; what the
        # guard's entry says of the weights saved is read at the resume, not kept in its state
        expected = {k: v for k, v in saved[key].items() if k not in ("open_epoch", "saved_weights")}
        assert _same(state, expected), key
    gwa = next(m for m in hm2.monitors if isinstance(m, lm.GradientWeightAlignmentMonitor))
    (open_epoch,) = [v["open_epoch"] for k, v in saved.items() if k == gwa.state_key]
    assert open_epoch["epoch"] == 0 and open_epoch["moments"][0] > 0
    assert probe.gwa_count == open_epoch["moments"][0]  # the resumed epoch continues from the saved count
    assert trainer2.global_step == 8


class _NoLinear(pl.LightningModule):
    """A regression on a bare weight: no nn.Linear (nothing for spectral alignment), no classifier head
    (nothing for GWA)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = ((x @ self.w - y) ** 2).mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_model_with_nothing_to_watch_for_some_monitors_trains(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x @ torch.ones(4, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    hm = lm.HealthMonitor(**FAST)
    trainer = _trainer(tmp_path, [hm], max_steps=6)
    trainer.fit(_NoLinear(), loader)
    assert trainer.global_step == 6
    assert hm.spectral.idle_reason and hm.gwa.idle_reason
    assert hm.guard.idle_reason is None
    idle = [a for a in hm.guard.hub.history if a.kind == "nothing_to_watch"]
    assert {a.monitor for a in idle} >= {"sa", "gwa"}
    assert all(a.severity == "warning" for a in idle)



class _ComplexLayer(pl.LightningModule):
    """A complex ``nn.Linear`` (an FFT-domain filter, say) under a real classifier head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 16, dtype=torch.cfloat)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.a(x.to(torch.cfloat)).abs())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_complex_layers_are_left_out_not_measured_wrong(tmp_path) -> None:
    # SA raised "weight must be real" at its first check and stopped the fit; the per-example probe read a complex
    # Linear as measured (coverage 1.0) with norms off by up to 72%: its rules cast to float, dropping the imaginary part
    g = torch.Generator().manual_seed(0)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(64, 12, generator=g), torch.randint(0, 5, (64,), generator=g)),
        batch_size=8)
    hm = lm.HealthMonitor(**FAST)
    trainer = _trainer(tmp_path, [hm], max_steps=6)
    trainer.fit(_ComplexLayer(), loader)
    assert trainer.global_step == 6
    assert hm.spectral.idle_reason and "complex weights (a)" in hm.spectral.idle_reason  # and the head left out
    probe = lm.PerExampleGradNorms(_ComplexLayer())
    assert "complex" in probe.reasons["a.weight"] and "complex" in probe.reasons["a.bias"]
    scalars = tb_scalars(os.path.join(str(tmp_path), "run"))
    coverage = [v for _, v in scalars["gns/coverage"]]
    assert coverage and all(0.0 < v < 1.0 for v in coverage)



class _Net(pl.LightningModule):
    """An MLP trained with a loss of the caller's; ``batch[1]`` (when there is one) is what the loss compares with."""

    def __init__(self, out: int, loss: Any) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, out))
        self.loss = loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self.net(batch[0])
        return self.loss(out, batch[1] if len(batch) > 1 else batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


_X = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
_NO_SOFTMAX_HEAD = {
    # name: (outputs, the batch's tensors, loss)
    "regression": (1, (_X, _X[:, 0]), lambda out, y: torch.nn.functional.mse_loss(out.squeeze(-1), y)),
    "regression_column": (1, (_X, _X[:, :1]), torch.nn.functional.mse_loss),
    "multi_output_regression": (3, (_X, _X[:, :3]), torch.nn.functional.mse_loss),
    "multi_label": (5, (_X, (_X[:, :5] > 0).float()), torch.nn.functional.binary_cross_entropy_with_logits),
    "binary_one_logit": (1, (_X, (_X[:, 0] > 0).float()),
                         lambda out, y: torch.nn.functional.binary_cross_entropy_with_logits(out.squeeze(-1), y)),
    "autoencoder": (8, (_X,), torch.nn.functional.mse_loss),  # the batch holds no targets at all
}


@pytest.mark.parametrize("case", list(_NO_SOFTMAX_HEAD))
def test_a_model_without_a_softmax_classifier_trains_with_the_preset(tmp_path, case) -> None:
    """Regression, multi-label, one-logit binary and autoencoder models: GWA finds an nn.Linear with >= 2 outputs,
    but the batches' targets do not fit it. The preset's GWA says so once and stays idle; the fit finishes and the
    other monitors log. A GWA monitor configured by hand still raises, naming the targets."""
    out, tensors, loss = _NO_SOFTMAX_HEAD[case]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*tensors), batch_size=8)
    hm = lm.HealthMonitor(**FAST)
    trainer = _trainer(tmp_path, [hm], max_steps=8)
    trainer.fit(_Net(out, loss), loader)
    assert trainer.global_step == 8
    assert "do not fit a softmax classifier" in hm.gwa.idle_reason
    # one real number per sample is said to be so (the layer named is then a hidden one, not the one-output head)
    one = case in ("regression", "regression_column", "binary_one_logit")
    assert ("one real number per sample" in hm.gwa.idle_reason) == one
    assert hm.spectral.idle_reason is None and hm.noise_scale.idle_reason is None and hm.guard.idle_reason is None
    idle = [a for a in hm.guard.hub.history if a.kind == "nothing_to_watch"]
    assert [a.monitor for a in idle] == ["gwa"] and idle[0].severity == "warning"
    # one warning for one fact: not also `no_softmax_head` for the head it then never scores
    assert [a.kind for a in hm.guard.hub.history if a.monitor == "gwa" and a.severity != "info"] == ["nothing_to_watch"]
    tags = tb_event_accumulator(trainer.logger.log_dir).Tags()["scalars"]
    assert "sa/sign_diversity_mean" in tags and "gns/b_simple" in tags
    assert not [t for t in tags if t.startswith("gwa/")]
    alone = lm.GradientWeightAlignmentMonitor(warmup_epochs=0)
    with pytest.raises((TypeError, ValueError), match="target"):
        _trainer(tmp_path / "alone", [alone], max_steps=2, logger=False).fit(_Net(out, loss), loader)



class _Stream(torch.utils.data.IterableDataset):
    """Examples without end and without a length."""

    def __iter__(self) -> Any:
        i = 0
        while True:
            yield _X[i % 64], torch.tensor(i % 3)
            i += 1


@pytest.mark.parametrize("run", ["stream_with_max_steps", "unbounded_with_max_time"])
def test_a_run_of_unknown_length_trains_with_the_preset(tmp_path, run) -> None:
    """GWA takes its warm-up as a fraction of the planned epochs: an iterable without a length (max_steps) has none.
    The preset's GWA says so and stays idle; the others watch; GWA alone raises. A run bounded only by time plans
    its warm-up from the first epoch's pace (it stayed idle as "an unbounded run")."""
    loss = torch.nn.functional.cross_entropy
    if run == "stream_with_max_steps":
        loader, kw = torch.utils.data.DataLoader(_Stream(), batch_size=8), dict(max_steps=6)
    else:
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_X, torch.arange(64) % 3), batch_size=8)
        kw = dict(max_steps=-1, max_epochs=-1, max_time={"seconds": 2})
    hm = lm.HealthMonitor(**FAST)
    trainer = _trainer(tmp_path, [hm], **kw)
    trainer.fit(_Net(3, loss), loader)
    assert hm.spectral.idle_reason is None and hm.guard.idle_reason is None
    tags = tb_event_accumulator(trainer.logger.log_dir).Tags()["scalars"]
    assert "sa/sign_diversity_mean" in tags
    if run == "unbounded_with_max_time":
        assert hm.gwa.idle_reason is None and "gwa/score" in tags and hm.gwa._timed_warmup >= 1
        return
    assert trainer.global_step >= 6 and "warmup_epochs=" in hm.gwa.idle_reason
    with pytest.raises(ValueError, match="warmup_epochs="):
        _trainer(tmp_path / "alone", [lm.GradientWeightAlignmentMonitor()], logger=False, **kw).fit(_Net(3, loss), loader)


def test_default_targets_of_a_dataclass_batch() -> None:
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        inputs: torch.Tensor
        labels: torch.Tensor
        note: str = "x"

    batch = Batch(torch.zeros(2, 3), torch.tensor([1, 0]))
    assert default_target_fn(batch) is batch.labels
    with pytest.raises(TypeError, match="tensor attribute"):
        default_target_fn(dataclasses.replace(batch, labels=None))

class _RankLabels(torch.utils.data.Dataset):
    """Class labels in [0, 4) on rank 0 and 7 on rank 1 (read in each rank's own process), which a 4-class head
    cannot take."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> Any:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return _X[i], torch.tensor(7 if rank == 1 else i % 4)


class _Clamped(_Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1].clamp(max=3))


class _DumpIdle(pl.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        hm = next(cb for cb in trainer.callbacks if isinstance(cb, lm.GradientWeightAlignmentMonitor))
        torch.save({"idle": hm.idle_reason, "step": trainer.global_step}, f"{self.out_dir}/rank{trainer.global_rank}.pt")


def test_ddp_targets_refused_on_one_rank_idle_every_rank(tmp_path) -> None:
    """Only rank 1's first batch has classes the head cannot take: both ranks go idle together (one collective),
    and the epoch-end gather, which an idle rank skips, is skipped on both, so the fit ends instead of hanging."""
    from conftest import fit_ddp_spawn

    loader = torch.utils.data.DataLoader(_RankLabels(), batch_size=8)
    trainer = _trainer(tmp_path, [lm.HealthMonitor(**FAST), _DumpIdle(str(tmp_path))], max_steps=4, devices=2,
                       strategy="ddp_spawn", max_epochs=1, logger=False)
    fit_ddp_spawn(trainer, _Clamped(4, None), loader)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["step"] == r1["step"] == 4
    assert r0["idle"] and r1["idle"] and "do not fit a softmax classifier" in r0["idle"]
    assert "another rank's targets" in r0["idle"] and "outside [0, 4)" in r1["idle"]

class _DumpRank(pl.Callback):
    """Each rank writes which monitors it ran and the keys it published."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        torch.save(
            {"callbacks": [type(cb).__name__ for cb in trainer.callbacks], "metrics": sorted(trainer.callback_metrics)},
            f"{self.out_dir}/rank{trainer.global_rank}.pt",
        )


def test_ddp_every_rank_runs_the_presets_monitors(tmp_path, tiny_gpt) -> None:
    from conftest import fit_ddp_spawn

    module, loader = tiny_gpt()
    trainer = _trainer(tmp_path, [lm.HealthMonitor(**FAST), _DumpRank(str(tmp_path))], max_steps=4, devices=2,
                       strategy="ddp_spawn")
    # tensors cross to the spawned ranks through shared memory; file descriptors cannot be resized in
    # some sandboxes ("unable to resize file ... Invalid argument"), named files can
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        fit_ddp_spawn(trainer, module, loader)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["callbacks"] == r1["callbacks"]
    assert {"SpectralAlignmentMonitor", "GradientNoiseScaleMonitor", "GradientWeightAlignmentMonitor",
            "DivergenceGuard"} <= set(r0["callbacks"])
    assert r0["metrics"] == r1["metrics"] and "sa/sign_diversity_mean" in r0["metrics"]


def test_the_progress_bar_shows_a_health_word(tmp_path, tiny_gpt) -> None:
    # a NaN at step 12: the guard rolls back; before it, "ok"; after it, "rolled back x1"
    pl.seed_everything(0)
    module, loader = tiny_gpt(nan_at_step=12)
    seen: dict[int, str] = {}

    class Read(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen[trainer.global_step] = trainer.progress_bar_callback.get_metrics(trainer, pl_module)["health"]

    health = lm.HealthMonitor(spectral=False, noise_scale=False, gwa=False, guard=dict(every_n_steps=5))
    trainer = pl.Trainer(max_steps=20, accelerator="cpu", logger=False, callbacks=[health, Read()],
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    trainer.fit(module, loader)
    assert [r["step"] for r in health.guard.rollbacks] == [12]
    assert seen[5] == "ok" and seen[20] == "rolled back x1"
    # a condition in force is named, the worst first
    health.guard._conditions[("loss_creep", None)] = "warning"
    assert lm.HealthMonitor.health_word(trainer) == "warning: guard/loss_creep"
    health.guard._conditions[("nonfinite", None)] = "critical"
    assert lm.HealthMonitor.health_word(trainer) == "critical: guard/nonfinite"

    # progress_bar=False leaves the bar alone
    pl.seed_everything(0)
    module, loader = tiny_gpt()
    quiet = lm.HealthMonitor(spectral=False, noise_scale=False, gwa=False, progress_bar=False)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, callbacks=[quiet], enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path / "q"))
    trainer.fit(module, loader)
    assert "health" not in trainer.progress_bar_callback.get_metrics(trainer, module)


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_every_monitor_in_a_model_of_another_dtype(tmp_path, tiny_gpt, precision) -> None:
    """Parameters in float64 or bfloat16 (``precision="64-true"`` / ``"bf16-true"``): every monitor watches, GradES
    included. The fused norms used to refuse float64 ("should be convertible without narrowing"), which failed the
    fit in the guard's first snapshot check."""
    module, loader = tiny_gpt()
    hm = lm.HealthMonitor(**FAST, grades=dict(every_n_steps=2, grace_steps=2, stop=False))
    trainer = _trainer(tmp_path, [hm], max_steps=8, precision=precision)
    trainer.fit(module, loader)
    assert trainer.global_step == 8
    assert next(module.parameters()).dtype == {"64-true": torch.float64, "bf16-true": torch.bfloat16}[precision]
    ea = tb_event_accumulator(trainer.logger.log_dir)
    tags = ea.Tags()["scalars"]
    for key in ("sa/sign_diversity_mean", "gns/b_simple", "grades/frozen_fraction"):
        assert key in tags, key
    assert all(math.isfinite(e.value) for t in tags for e in ea.Scalars(t))
    assert not [m for m in ("spectral", "noise_scale", "guard", "grades") if getattr(hm, m).idle_reason]


def test_fused_norms_of_mixed_dtypes_match_the_oracle() -> None:
    from lightning_monitor._compat import foreach_norm

    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(5, generator=g, dtype=torch.float64), torch.randn(3, generator=g).bfloat16(),
          torch.randn(4, generator=g), torch.randn(2, generator=g, dtype=torch.float64)]
    got = foreach_norm(ts, 2.0, dtype=torch.float32)
    assert [t.dtype for t in got] == [torch.float32] * 4
    want = [torch.linalg.vector_norm(t.double()).float() for t in ts]
    for a, b in zip(got, want):
        assert float(a) == pytest.approx(float(b), rel=1e-6)
    assert foreach_norm(ts[:1], 2.0, dtype=torch.float32)[0].dtype == torch.float32  # only wide tensors


def test_gwa_scores_enough_samples_an_epoch_on_a_small_dataset(tmp_path) -> None:
    """96 samples, 6 steps an epoch: at the preset's every 10th step an epoch scored 0 or 16 samples (warnings that it
    skipped epochs, and kurtosis judged on 16 scores). ``min_epoch_samples=256`` lowers the cadence to every step at
    the first scored step (one ``cadence`` info alert): every epoch is scored whole. Its state key stays the
    configured one."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :3].argmax(1)), batch_size=16)
    hm = lm.HealthMonitor(**FAST)
    key = hm.gwa.state_key
    saved = ModelCheckpoint(dirpath=str(tmp_path / "checkpoints"), every_n_epochs=1, save_top_k=-1)
    trainer = _trainer(tmp_path, [hm, saved], max_steps=24, enable_checkpointing=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Net(3, torch.nn.functional.cross_entropy), loader)
    assert hm.gwa.every_n_steps == 1 and hm.gwa.state_key == key
    said = [a for a in hm.guard.hub.history if a.kind == "cadence"]
    assert len(said) == 1 and said[0].severity == "info" and said[0].step == 1  # after the first step
    # 96 samples an epoch cannot reach 256 even at every step: said, not promised
    assert "Even so an epoch gives fewer samples than min_epoch_samples" in said[0].message
    assert [h["count"] for h in hm.gwa.history][1:] == [96, 96, 96]  # the first epoch lost the step before the change
    assert not [w for w in caught if "GWA skipped" in str(w.message)]

    # resumed from the end of the second epoch, the run scores at the cadence chosen, from its first step: it went back
    # to every 10th step until its first scored step, and its first epoch scored 80 samples of 96, as the run it
    # continues did not
    (path,) = [str(p) for p in (tmp_path / "checkpoints").glob("epoch=1-*.ckpt")]
    resumed = lm.HealthMonitor(**FAST)
    more = _trainer(tmp_path / "resumed", [resumed], max_steps=24)
    more.fit(_Net(3, torch.nn.functional.cross_entropy), loader, ckpt_path=path)
    assert resumed.gwa.every_n_steps == 1 and resumed.gwa.state_key == key
    assert not [a for a in resumed.guard.hub.history if a.kind == "cadence"]
    # every one of its 12 steps scored (Lightning runs the resumed epochs one batch off the straight run's)
    assert sum(h["count"] for h in resumed.gwa.history[2:]) == 16 * 12


class _Unsized(torch.utils.data.IterableDataset):
    """96 samples with no ``__len__``: Lightning cannot tell how many batches an epoch holds until one ends."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self):
        return iter(zip(self.x, self.y))


def test_gwa_sets_its_cadence_after_the_first_epoch_of_unknown_length(tmp_path) -> None:
    """The same 96 samples from an iterable without a length: the cadence could not be set at the first scored step
    (the epoch's length unknown) and was never set, so every epoch was scored from one batch of 16. It is set when the
    first epoch ends (6 batches), with the same ``cadence`` alert, and the later epochs are scored whole."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    loader = torch.utils.data.DataLoader(_Unsized(x, x[:, :3].argmax(1)), batch_size=16)
    hm = lm.HealthMonitor(**FAST)
    trainer = _trainer(tmp_path, [hm], max_steps=-1, max_epochs=4)
    trainer.fit(_Net(3, torch.nn.functional.cross_entropy), loader)
    assert hm.gwa.every_n_steps == 1
    said = [a for a in hm.guard.hub.history if a.kind == "cadence"]
    assert len(said) == 1 and said[0].step == 6 and "about 96 samples (6 steps)" in said[0].message
    assert [h["count"] for h in hm.gwa.history] == [16, 96, 96, 96]


@pytest.mark.parametrize("max_steps, every, warned", [(18, 5, False), (16, 20, True)],
                         ids=["last-epoch-cut-short", "whole-epoch-unscored"])
def test_gwa_says_nothing_of_a_last_epoch_cut_short_by_max_steps(tmp_path, max_steps, every, warned) -> None:
    """8 steps an epoch. ``max_steps=18`` with a score every 5th step ends the third epoch after 2 steps, none scored:
    a run that ends inside an epoch (most ``max_steps`` runs) was told its last epoch scored too few samples. A whole
    epoch that scored none (every 20th step: the second epoch, steps 8-15) is still said."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :3].argmax(1)), batch_size=16)
    gwa = lm.GradientWeightAlignmentMonitor(every_n_steps=every)
    trainer = _trainer(tmp_path, [gwa], max_steps=max_steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Net(3, torch.nn.functional.cross_entropy), loader)
    counts = [(h["epoch"], h["count"], bool(h.get("partial"))) for h in gwa.history]
    skipped = [str(w.message) for w in caught if "GWA skipped" in str(w.message)]
    if warned:
        assert counts[1] == (1, 0, False) and len(skipped) == 1 and "epoch 1 scored 0" in skipped[0], (counts, skipped)
    else:
        assert counts[-1] == (2, 0, True) and not skipped, (counts, skipped)


def test_a_typo_in_a_monitors_arguments_names_the_argument_meant() -> None:
    """A misspelt key in a preset's dict (from Python or a YAML config) says which argument was meant, or lists them;
    deprecated aliases still pass."""
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'acton' \(did you mean 'action'\?\)"):
        lm.HealthMonitor(guard=dict(acton="stop"))
    # one message, not the monitor's own error chained under it (a second traceback on the console)
    with pytest.raises(TypeError) as raised:
        lm.HealthMonitor(spectral=dict(every_n_step=100))
    assert raised.value.__cause__ is None and raised.value.__suppress_context__, raised.value
    assert "did you mean 'every_n_steps'" in str(raised.value)
    with pytest.raises(TypeError, match=r"'zzz'; its arguments are method, every_n_steps"):
        lm.HealthMonitor(noise_scale=dict(zzz=1))
    # the prefix of the monitor's scalars and alerts, passed as the argument's name: the argument meant is named
    with pytest.raises(TypeError, match=r"no argument `gns`: .* read `gns/\.\.\.` is set with `noise_scale=`"):
        lm.HealthMonitor(gns=dict(every_n_steps=5))
    with pytest.raises(TypeError, match="`spectral=`"):
        lm.HealthMonitor(sa=False)
    with pytest.warns(DeprecationWarning, match="beta"):
        assert lm.HealthMonitor(noise_scale=dict(beta=0.9)).noise_scale.smoothing == 0.9


def test_monitors_pickle_after_a_fit_and_run_again(tmp_path, tiny_gpt) -> None:
    """A monitor that had run a fit held its trainer's alert hub, whose weak reference to the trainer does not pickle:
    ``pickle.dumps`` failed for every monitor (a ``ddp_spawn`` trainer pickles its callbacks). The hub stays with its
    trainer; the copy gets the next trainer's at setup and runs."""
    import pickle

    module, loader = tiny_gpt()
    hm = lm.HealthMonitor(grades=True)
    _trainer(tmp_path / "first", [hm], max_steps=6).fit(module, loader)
    assert hm.guard.hub.history is not None
    copy = pickle.loads(pickle.dumps(hm))
    for name in ("spectral", "noise_scale", "gwa", "guard", "grades"):
        assert type(getattr(copy, name)) is type(getattr(hm, name))
    module, loader = tiny_gpt()
    trainer = _trainer(tmp_path / "second", [copy], max_steps=6)
    trainer.fit(module, loader)
    assert trainer.global_step == 6 and copy.guard.hub is not hm.guard.hub


def test_a_bad_value_in_a_monitors_dict_names_the_monitor():
    """`every_n_steps` and `warmup_steps` are arguments of every monitor: the error says whose value is wrong (in a
    LightningCLI YAML no traceback points at the dict)."""
    import pytest

    from lightning_monitor import HealthMonitor

    expected = r"HealthMonitor\(`noise_scale`=\.\.\.\): GradientNoiseScaleMonitor: .*every_n_steps"
    with pytest.raises(ValueError, match=expected):
        HealthMonitor(spectral={"every_n_steps": 100}, noise_scale={"every_n_steps": 0})


class _TwoPlayers(_Net):
    """Manual optimization with two optimizers (a game's players): the noise scale and GWA refuse it."""

    def __init__(self) -> None:
        super().__init__(4, torch.nn.functional.cross_entropy)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        for opt in self.optimizers():
            opt.zero_grad()
            self.manual_backward(self.loss(self.net(batch[0]), batch[1]))
            opt.step()

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.01), torch.optim.SGD(self.net[2].parameters(), lr=0.01)]


def test_the_line_that_says_what_watches_names_the_monitors_idle_from_their_own_start(tmp_path, caplog) -> None:
    # the line was written before the monitors' own start hooks, where the noise scale and GWA refuse several
    # optimizers: "watching sa, gns, gwa, guard", then both idle a moment later
    data = DataLoader(TensorDataset(_X, (_X[:, 0] > 0).long()), batch_size=16)
    # the line goes through Lightning's `rank_zero_info`, whose `lightning.pytorch` logger does not propagate to the
    # root, where caplog's handler is (Lightning turns propagation off when the root had no handler at its import).
    # pytest 9.2 attaches the handler to such loggers too, pytest 7 (the test extra's floor) does not: attached here
    attached = [lg for lg in logging.root.manager.loggerDict.values()
                if isinstance(lg, logging.Logger) and not lg.propagate and caplog.handler not in lg.handlers]
    for lg in attached:
        lg.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO):
            _trainer(tmp_path, [lm.HealthMonitor(**FAST)], max_steps=4).fit(_TwoPlayers(), data)
    finally:
        for lg in attached:
            lg.removeHandler(caplog.handler)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("HealthMonitor: watching")]
    assert len(said) == 1 and said[0].startswith("HealthMonitor: watching sa, guard; idle: gns (the model has 2 "
                                                 "optimizers")
    assert "; gwa (the model has 2 optimizers" in said[0]

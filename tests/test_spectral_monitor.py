"""SpectralAlignmentMonitor in real Trainer.fit runs: keys read back from TensorBoard and CSV, values
against a full-SVD oracle, no work on steps that are not due, alerts, state, bad input."""

from __future__ import annotations

import csv
import glob
import os
import sys

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import SpectralAlignmentMonitor, read_alerts
from lightning_monitor.callbacks.spectral_alignment import find_output_head

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPTConfig, GPTModule, make_loader  # noqa: E402

TINY = GPTConfig(n_layer=1, n_head=2, d_model=32, block_size=16)
LAYERS = ["model.blocks.0.attn.q_proj", "model.blocks.0.attn.k_proj", "model.blocks.0.attn.v_proj",
          "model.blocks.0.attn.o_proj", "model.blocks.0.mlp.up_proj", "model.blocks.0.mlp.down_proj"]


def trainer(tmp_path, callbacks, max_steps, logger=None, **kw):
    return pl.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=logger if logger is not None else False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=kw.pop("enable_checkpointing", False),
        default_root_dir=str(tmp_path), callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=0, **kw,
    )


def loader(n=64):
    return make_loader("prose", block_size=16, batch_size=4, n_samples=n, seed=0)


class Oracle(pl.Callback):
    """On due steps: every input row of each layer and the full SVD of its weight, in
    on_before_optimizer_step (after the monitor, which is listed first)."""

    def __init__(self, layers, every, monitor=None):
        self.layers, self.every, self.monitor = layers, every, monitor
        self.inputs, self.expected, self.hooks_seen = {}, {}, {}
        self._h = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        mods = dict(pl_module.named_modules())
        # the monitor (listed first) has already armed its hooks, or not
        self.hooks_seen[trainer.global_step] = sum(len(mods[n]._forward_pre_hooks) for n in self.layers)
        if trainer.global_step % self.every == 0:
            for n in self.layers:
                self._h.append(mods[n].register_forward_hook(
                    lambda m, a, o, n=n: self.inputs.__setitem__(n, a[0].detach().reshape(-1, a[0].shape[-1]).clone())))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for h in self._h:
            h.remove()
        self._h.clear()
        step = trainer.global_step
        if step % self.every:
            return
        mods = dict(pl_module.named_modules())
        for n in self.layers:
            w = mods[n].weight.detach().double().numpy()
            _, s, vh = np.linalg.svd(w)
            x = self.inputs[n].double().numpy()
            ref = {"sigma": s[0], "gap": s[1] / s[0]}
            vecs = {"svd": vh[0]}
            if self.monitor is not None:  # the monitor's own v_1 (first column of its basis)
                vecs["ours"] = self.monitor._vectors[n][:, 0].double().numpy()
                ref["cos"] = abs(vecs["ours"] @ vh[0])
            for tag, v in vecs.items():
                a = (x @ v) / np.linalg.norm(x, axis=1)
                p = np.mean(a > 0)
                ref[f"sign_diversity_{tag}"] = 2 * min(p, 1 - p)
                ref[f"mean_abs_{tag}"] = np.mean(np.abs(a))
            self.expected[(step, n)] = ref


def test_fit_logs_every_key_to_tensorboard_and_csv_and_matches_svd_oracle(tmp_path):
    pl.seed_everything(0)
    every = 3
    mon = SpectralAlignmentMonitor(every_n_steps=every, max_rows=10_000, log_histograms=True)
    oracle = Oracle(LAYERS, every, monitor=mon)
    tb = TensorBoardLogger(str(tmp_path), name="tb")
    csvl = CSVLogger(str(tmp_path), name="csv")
    tr = trainer(tmp_path, [mon, oracle], max_steps=10, logger=[tb, csvl])
    tr.fit(GPTModule(TINY, lr=3e-3), loader())

    assert sorted(mon.layers) == sorted(LAYERS)  # lm_head left out by default
    files = glob.glob(os.path.join(tb.log_dir, "events.out.tfevents.*"))
    acc = EventAccumulator(tb.log_dir, size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    due = [0, 3, 6, 9]
    for layer in LAYERS:
        for stat in ("sign_diversity", "mean_abs", "sigma"):
            key = f"sa/{layer}/{stat}"
            assert key in tags, key
            events = acc.Scalars(key)
            assert [e.step for e in events] == due
            for e in events:
                ref = oracle.expected[(e.step, layer)]
                if stat == "sigma":  # ||W v|| <= s_1, equal once v is the top singular vector
                    assert 0.95 * ref["sigma"] <= e.value <= ref["sigma"] * (1 + 1e-5)
                    if ref["cos"] > 0.999:
                        assert e.value == pytest.approx(ref["sigma"], rel=1e-3)
                else:
                    # the statistic of the monitor's v_1, recomputed in float64 from every input row
                    assert e.value == pytest.approx(ref[f"{stat}_ours"], abs=1e-5)
                    if ref["cos"] > 0.999:  # and the full SVD's v_1 gives the same up to a token
                        assert e.value == pytest.approx(ref[f"{stat}_svd"], abs=0.07 if stat == "sign_diversity" else 0.01)
        assert f"sa/{layer}/alignment" in acc.Tags()["histograms"]
    # after the first few steps of Adam (which reorganise a random init), v_1 is tracked closely
    cosines = [oracle.expected[(s, n)]["cos"] for s in due for n in LAYERS]
    assert min(oracle.expected[(s, n)]["cos"] for s in (0, 6, 9) for n in LAYERS) > 0.999, cosines
    assert not any("lm_head" in t for t in tags)
    for key in ("sa/sign_diversity_mean", "sa/collapsed_fraction", "sa/sigma_max"):
        assert [e.step for e in acc.Scalars(key)] == due
    means = {e.step: e.value for e in acc.Scalars("sa/sign_diversity_mean")}
    for step in due:
        per_layer = [e.value for layer in LAYERS for e in acc.Scalars(f"sa/{layer}/sign_diversity") if e.step == step]
        assert means[step] == pytest.approx(np.mean(per_layer), abs=1e-6)
        assert all(0.0 <= d <= 1.0 for d in per_layer)
    assert files
    # the same values in the CSV logger
    with open(os.path.join(csvl.log_dir, "metrics.csv")) as fh:
        rows = [r for r in csv.DictReader(fh) if r.get(f"sa/{LAYERS[0]}/sigma")]
    assert [int(r["step"]) for r in rows] == due
    tb_sigma = [e.value for e in acc.Scalars(f"sa/{LAYERS[0]}/sigma")]
    np.testing.assert_allclose([float(r[f"sa/{LAYERS[0]}/sigma"]) for r in rows], tb_sigma, rtol=1e-5)


def test_hooks_only_on_due_steps_and_released(tmp_path):
    every = 4
    mon = SpectralAlignmentMonitor(every_n_steps=every, warmup_steps=2, max_rows=8)
    oracle = Oracle(LAYERS, every=10_000)  # records hook counts only (never due)
    tr = trainer(tmp_path, [mon, oracle], max_steps=11)
    tr.fit(GPTModule(TINY), loader())
    for step, n_hooks in oracle.hooks_seen.items():
        expected = len(LAYERS) if mon.is_due(step) else 0
        assert n_hooks == expected, (step, n_hooks)
    assert [s for s in oracle.hooks_seen if mon.is_due(s)] == [2, 6, 10]
    # nothing kept after the checks: no hook, no captured rows
    assert not mon._capture.armed and mon._capture._captured == {}
    assert all(len(m._forward_pre_hooks) == 0 for m in mon.layers.values())


def test_bf16_autocast_run_gives_finite_values(tmp_path):
    pl.seed_everything(1)
    mon = SpectralAlignmentMonitor(every_n_steps=2)
    csvl = CSVLogger(str(tmp_path), name="csv")
    tr = trainer(tmp_path, [mon], max_steps=5, logger=csvl, precision="bf16-mixed")
    tr.fit(GPTModule(TINY), loader())
    with open(os.path.join(csvl.log_dir, "metrics.csv")) as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("sa/sign_diversity_mean")]
    assert [int(r["step"]) for r in rows] == [0, 2, 4]
    for r in rows:
        for layer in LAYERS:
            assert np.isfinite(float(r[f"sa/{layer}/sigma"])) and 0 <= float(r[f"sa/{layer}/sign_diversity"]) <= 1


# ----------------------------------------------------------------------------- alerts end to end
class ShiftingModel(pl.LightningModule):
    """Two Linear layers on centred Gaussian inputs; from ``shift_at`` on, every input is pushed far
    along one fixed direction (a collapse of sign diversity in both layers)."""

    def __init__(self, shift_at: int = 1000):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 1)
        self.shift_at = shift_at
        self.direction = torch.randn(16)

    def forward(self, x):
        if self.global_step >= self.shift_at:
            x = x + 20.0 * self.direction
        return self.head(self.l2(self.l1(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def gaussian_loader(n=2048, batch=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    return DataLoader(TensorDataset(x, x[:, 0].clone()), batch_size=batch, shuffle=False)


def test_collapse_raises_warning_then_critical_through_the_hub(tmp_path):
    mon = SpectralAlignmentMonitor(every_n_steps=2, patience=2, critical_patience=3, baseline_checks=3,
                                   max_sigma_growth=None)
    tb = TensorBoardLogger(str(tmp_path), name="tb")
    tr = trainer(tmp_path, [mon], max_steps=40, logger=tb)
    tr.fit(ShiftingModel(shift_at=20), gaussian_loader())
    assert sorted(mon.layers) == ["l1", "l2"]
    alerts = [a for a in read_alerts(os.path.join(tb.log_dir, "alerts.jsonl")) if a.monitor == "sa"]
    kinds = [(a.kind, a.severity, a.step) for a in alerts]
    # shift from step 20: checks at 20, 22 -> warning at 22 (patience 2); 24 -> critical
    assert kinds == [("collapse", "warning", 22), ("collapse", "critical", 24)], kinds
    assert alerts[1].value == 1.0 and alerts[1].threshold == mon.warn_fraction
    acc = EventAccumulator(tb.log_dir)
    acc.Reload()
    frac = {e.step: e.value for e in acc.Scalars("sa/collapsed_fraction")}
    assert all(v == 0.0 for s, v in frac.items() if s < 20) and all(v == 1.0 for s, v in frac.items() if s >= 20)


def test_no_alert_on_healthy_training(tmp_path):
    mon = SpectralAlignmentMonitor(every_n_steps=2, baseline_checks=3)
    tr = trainer(tmp_path, [mon], max_steps=40)
    tr.fit(ShiftingModel(shift_at=10_000), gaussian_loader())
    assert mon._n_checks == 20
    assert not [a for a in tr.callbacks[0].hub.history if a.monitor == "sa"]


def _rule_monitor(**kw):
    mon = SpectralAlignmentMonitor(every_n_steps=1, **kw)
    fired = []
    mon.condition = lambda step, kind, active, severity, *a, **k: fired.append((step, kind, active, severity))
    return mon, fired


def test_rule_ignores_layers_collapsed_by_nature_and_noise():
    mon, fired = _rule_monitor(baseline_checks=3, patience=2, critical_patience=3)
    rng = np.random.default_rng(0)
    for step in range(60):
        d = {"a": rng.uniform(0.7, 1.0), "b": rng.uniform(0.6, 1.0), "gelu": rng.uniform(0.0, 0.05),
             "c": rng.uniform(0.6, 1.0) if step != 30 else 0.0}  # one layer dips once
        mon._update_rule(step, d)
    assert not [f for f in fired if f[2]]
    assert mon.baseline("gelu") < mon.min_baseline  # never eligible
    frac, ratio, eligible, collapsed = mon.collapse_state({"a": 0.0, "b": 0.0, "gelu": 0.0, "c": 0.9})
    assert sorted(eligible) == ["a", "b", "c"] and sorted(collapsed) == ["a", "b"]
    assert frac == pytest.approx(2 / 3)


def _sampled_diversity(rng, minority: float, n: int) -> float:
    """``D = 2 min(p, 1 - p)`` of ``n`` signs drawn with probability ``minority`` of the minority sign."""
    p = rng.binomial(n, minority) / n
    return 2 * min(p, 1 - p)


@pytest.mark.parametrize("rows", [8, 256])
def test_a_drop_within_the_sampling_noise_of_few_rows_is_no_collapse(rows):
    """D from 8 rows a check moves in steps of 0.25: three layers whose signs are mixed 40/60 throughout read, by
    chance, below 80% of their baseline three checks in a row (the warning fired 2-4 times in each of 4 healthy
    3000-step runs of an MLP at batch 8). With the row counts the drop must exceed twice its sampling noise: no
    warning there, while a real collapse (the minority sign falls to 1%) is still seen, at 8 rows and at 256."""
    rng = np.random.default_rng(0)
    mon, fired = _rule_monitor(baseline_checks=10, patience=3, max_sigma_growth=None)
    without, _ = _rule_monitor(baseline_checks=10, patience=3, max_sigma_growth=None)
    fired_without = []
    without.condition = lambda step, kind, active, severity, *a, **k: fired_without.append((step, active))
    counts = {n: rows for n in "abc"}
    for step in range(300):
        d = {n: _sampled_diversity(rng, 0.4, rows) for n in "abc"}
        mon._update_rule(step, d, rows=counts)
        without._update_rule(step, d)
    assert not [f for f in fired if f[2]]
    if rows == 8:  # the same draws, judged without the row counts: the noise alone fires
        assert [s for s, active in fired_without if active]
    for step in range(300, 310):
        mon._update_rule(step, {n: _sampled_diversity(rng, 0.01, rows) for n in "abc"}, rows=counts)
    assert [s for s, kind, active, _ in fired if active and kind == "collapse"][:1] == [302]


def test_rule_escalates_and_clears():
    mon, fired = _rule_monitor(baseline_checks=2, patience=2, critical_patience=4)
    series = [0.8] * 5 + [0.0] * 5 + [0.8] * 2
    for step, d in enumerate(series):
        out = mon._update_rule(step, {"a": d, "b": d}, {"a": 1.0, "b": 2.0})
        assert out["sigma_growth"] == 1.0  # constant sigma
    active = [(s, sev) for s, _, act, sev in fired if act]
    assert active[0] == (6, "warning") and (8, "critical") in active
    # cleared once it has not held for `patience` checks: at the second check back at 0.8
    clears = [s for s, kind, act, _ in fired if kind == "collapse" and not act and s > 6]
    assert clears == [11]
    # collapsed checks never enter the baseline
    assert mon.baseline("a") == pytest.approx(0.8)


def test_a_condition_that_comes_and_goes_is_said_once():
    """A collapse that holds, lapses for one check and holds again (a model with few eligible layers, whose share
    jumps between 0 and 1/2) is one warning, cleared once after ``patience`` checks without it; before, each return
    raised it anew (five warnings and five clears in 200 healthy steps of a small CNN, checked every 5 steps)."""
    mon = SpectralAlignmentMonitor(every_n_steps=1, baseline_checks=3, patience=2, max_sigma_growth=None)
    alerts = []
    mon.alert = lambda step, kind, severity, message, *a, **k: alerts.append((step, kind, severity, message))
    series = [0.8] * 3 + [0.0, 0.0, 0.8, 0.0, 0.0, 0.8, 0.0, 0.0] + [0.8, 0.8, 0.8] + [0.0, 0.0]
    for step, d in enumerate(series):
        mon._update_rule(step, {"a": d, "b": 0.8})
    assert [(s, kind) for s, kind, _, _ in alerts] == [(4, "collapse"), (12, "collapse_cleared"), (15, "collapse")]
    # the message leads with the criterion that holds: 1 of 2 layers collapsed (the share), mean at 50%
    assert alerts[0][3].split(": ", 1)[1].startswith("1/2 layers whose inputs usually have mixed signs collapsed")


def test_a_drop_of_the_mean_alone_is_described_as_such():
    mon = SpectralAlignmentMonitor(every_n_steps=1, baseline_checks=3, patience=1, max_sigma_growth=None)
    alerts = []
    mon.alert = lambda step, kind, severity, message, *a, **k: alerts.append(message)
    for step, d in enumerate([0.9, 0.9, 0.9, 0.6]):
        mon._update_rule(step, {"a": d, "b": d})
    # no layer at or below 0.1: the mean's drop to 67% of its baseline is what holds, and it is said first
    assert alerts and "collapsing (1 checks in a row): the mean sign diversity of those layers is at 67%" in alerts[0]
    assert "0/2 layers" in alerts[0]


def test_partial_drop_against_baseline_counts_as_collapse():
    """No layer below the threshold, but the eligible layers' mean diversity falls by more than max_drop."""
    mon, fired = _rule_monitor(baseline_checks=3, patience=2, max_drop=0.2, max_sigma_growth=None)
    for step in range(3):
        mon._update_rule(step, {"a": 0.9, "b": 0.8, "gelu": 0.0})
    out = mon._update_rule(3, {"a": 0.6, "b": 0.6, "gelu": 0.0})
    assert out["collapsed_fraction"] == 0.0 and out["diversity_ratio"] == pytest.approx(1.2 / 1.7)
    mon._update_rule(4, {"a": 0.6, "b": 0.6, "gelu": 0.0})
    assert [(s, sev) for s, kind, act, sev in fired if act] == [(4, "warning")]


def test_sigma_growth_rule_against_a_geometric_series():
    mon, fired = _rule_monitor(baseline_checks=1, growth_window=10, max_sigma_growth=1.5, patience=2)
    d = {"a": 0.9, "b": 0.9}
    for step in range(0, 40, 5):  # sigma_max grows 1.2x per 10 steps: below 1.5
        out = mon._update_rule(step, d, {"a": 1.2 ** (step / 10), "b": 0.1})
        if step >= 10:
            assert out["sigma_growth"] == pytest.approx(1.2)
    assert not [f for f in fired if f[2]]
    for step in range(40, 70, 5):  # then 2x per 10 steps
        out = mon._update_rule(step, d, {"a": 1.2 ** 4 * 2.0 ** ((step - 35) / 10), "b": 0.1})
    assert out["sigma_growth"] == pytest.approx(2.0)
    growth = [(s, kind, sev) for s, kind, act, sev in fired if act]
    assert growth[0][1:] == ("sigma_growth", "warning") and growth[0][0] == 45  # 1.69x from step 30 to 40 already
    nan = mon._update_rule(70, d, {"a": float("nan"), "b": 0.1})
    assert nan["sigma_growth"] == float("inf")


class StagedNet(pl.LightningModule):
    """A layer with a large top singular value that joins the forward at step ``join``; no weight ever changes (lr 0)."""

    def __init__(self, join: int) -> None:
        super().__init__()
        self.join = join
        self.a, self.b, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 2)
        with torch.no_grad():
            self.b.weight.mul_(10.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.tanh(self.a(x))
        if self.global_step >= self.join:
            h = torch.tanh(self.b(h))
        return F.cross_entropy(self.head(h), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_sigma_growth_compares_the_layers_measured_at_both_checks(tmp_path):
    # a layer that starts being called is no growth: the largest sigma_1 over the layers measured now was compared
    # with that over the layers measured growth_window steps before (8.3x per 25 steps logged, and a sigma_growth
    # warning at step 60, with every weight constant)
    torch.manual_seed(0)
    x = torch.randn(512, 16)
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
    model = StagedNet(join=50)
    mon = SpectralAlignmentMonitor(every_n_steps=5, growth_window=25, max_sigma_growth=1.35, patience=3,
                                   baseline_checks=2)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer(tmp_path, [mon], 80, logger=logger).fit(model, data)
    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    sigma_max = {e.step: e.value for e in acc.Scalars("sa/sigma_max")}
    growth = {e.step: e.value for e in acc.Scalars("sa/sigma_growth")}
    oracle = {n: torch.linalg.svdvals(getattr(model, n).weight.detach())[0].item() for n in ("a", "b")}
    assert sigma_max[45] == pytest.approx(oracle["a"], rel=1e-4) and sigma_max[50] == pytest.approx(oracle["b"], rel=1e-4)
    assert {50, 55, 60, 65, 70, 75} <= set(growth)
    assert all(v == pytest.approx(1.0, abs=1e-5) for v in growth.values())
    assert not [a for a in mon.hub.history if a.kind == "sigma_growth"]
    # a layer present at both checks still carries the growth: sigma_1 of `a` x2 between steps 25 and 50
    mon2, _ = _rule_monitor(baseline_checks=1, growth_window=25)
    mon2._update_rule(25, {"a": 0.9}, {"a": 1.0})
    assert mon2._update_rule(50, {"a": 0.9, "b": 0.9}, {"a": 2.0, "b": 0.5})["sigma_growth"] == pytest.approx(2.0)


# ----------------------------------------------------------------------------- state
def test_singular_vectors_persist_in_checkpoint_and_resume(tmp_path):
    pl.seed_everything(0)
    mon = SpectralAlignmentMonitor(every_n_steps=2)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=6, save_top_k=-1)
    tr = trainer(tmp_path, [mon, ckpt], max_steps=6, enable_checkpointing=True)
    tr.fit(GPTModule(TINY), loader())
    path = glob.glob(str(tmp_path / "ckpt" / "*.ckpt"))[0]
    state = torch.load(path, weights_only=False)["callbacks"][mon.state_key]
    assert sorted(state["vectors"]) == sorted(LAYERS) and state["n_checks"] == 3
    for name, v in state["vectors"].items():
        torch.testing.assert_close(v, mon._vectors[name].cpu())
        assert v.shape == (dict(tr.lightning_module.named_modules())[name].in_features, mon.n_vectors)
    mon2 = SpectralAlignmentMonitor(every_n_steps=2)
    tr2 = trainer(tmp_path, [mon2], max_steps=8)
    tr2.fit(GPTModule(TINY), loader(), ckpt_path=path)
    assert mon2._n_checks == 4  # 3 restored + the check at step 6
    assert mon2.baseline(LAYERS[0]) is not None


class _Values(pl.Callback):
    """The values the monitor measured at each of its checks (its callback metrics after the step)."""

    def __init__(self):
        self.rows = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows[trainer.global_step] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("sa/")}


def test_a_resumed_run_continues_exactly(tmp_path):
    """The checks after a resume give the uninterrupted run's values to the bit: the warm iteration counts per weight
    shape are in the checkpoint with the bases (from the default count, the first check's vector differed within the
    tolerance, and so did D by a row or two)."""
    pl.seed_everything(0)
    full, ckpt = _Values(), ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=8, save_top_k=-1)
    data = make_loader("prose", block_size=16, batch_size=4, n_samples=32, seed=0, shuffle=False)  # 8 steps an epoch
    trainer(tmp_path, [SpectralAlignmentMonitor(every_n_steps=2, max_rows=48), full, ckpt], max_steps=16,
            enable_checkpointing=True).fit(GPTModule(TINY), data)
    pl.seed_everything(0)
    resumed = _Values()
    trainer(tmp_path, [SpectralAlignmentMonitor(every_n_steps=2, max_rows=48), resumed], max_steps=16).fit(
        GPTModule(TINY), data, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=8.ckpt"))
    assert sorted(resumed.rows) == list(range(9, 17))
    assert resumed.rows == {step: full.rows[step] for step in resumed.rows}
    assert any("sign_diversity" in k for k in resumed.rows[16])


# ----------------------------------------------------------------------------- selection and bad input
def test_output_head_rule():
    gpt = GPTModule(TINY).model
    assert find_output_head(gpt) == "lm_head"

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight
            self.proj = nn.Linear(4, 4)  # registered last, but the tied one is the head

    assert find_output_head(Tied()) == "out"
    assert find_output_head(nn.Sequential(nn.Conv2d(1, 1, 1))) is None


def test_selection_include_exclude_and_head():
    model = GPTModule(TINY)
    assert "model.lm_head" not in SpectralAlignmentMonitor().select_layers(model)
    assert "model.lm_head" in SpectralAlignmentMonitor(head=None).select_layers(model)
    assert list(SpectralAlignmentMonitor(include="model.lm_head").select_layers(model)) == ["model.lm_head"]
    sel = SpectralAlignmentMonitor(include="*.attn.*", exclude="*o_proj").select_layers(model)
    assert sorted(sel) == sorted(LAYERS[:3])
    with pytest.raises(ValueError, match="matches no module"):
        SpectralAlignmentMonitor(include="*.nothing_*").select_layers(model)
    with pytest.raises(ValueError, match="head"):
        SpectralAlignmentMonitor(head="model.not_there").select_layers(model)


class ConvOnly(pl.LightningModule):
    """No layer that multiplies its input by a weight matrix: a depthwise (grouped) convolution only."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, groups=2)

    def training_step(self, batch, batch_idx):
        return self.conv(batch[0]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_model_without_linear_fails_at_setup(tmp_path):
    from lightning_monitor.callbacks.base import NothingToWatch

    tr = trainer(tmp_path, [SpectralAlignmentMonitor()], max_steps=1)
    data = DataLoader(TensorDataset(torch.randn(4, 2, 5, 5)), batch_size=2)
    with pytest.raises(NothingToWatch, match="no nn.Linear"):
        tr.fit(ConvOnly(), data)
    # with idle_when_nothing_to_watch (the preset's setting) the fit goes on, the monitor says so once
    mon = SpectralAlignmentMonitor(every_n_steps=1)
    mon.idle_when_nothing_to_watch = True
    trainer(tmp_path, [mon], max_steps=2).fit(ConvOnly(), data)
    assert mon.idle_reason is not None and "no nn.Linear" in mon.idle_reason and mon._n_checks == 0


def test_only_head_linear_gives_clear_error():
    class OnlyHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

    with pytest.raises(ValueError, match="head=None"):
        SpectralAlignmentMonitor().select_layers(OnlyHead())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"max_rows": 0}, "max_rows"),
        ({"n_iter": 0}, "n_iter"),
        ({"min_baseline": 1.5}, "min_baseline"),
        ({"collapse_threshold": 0.5, "min_baseline": 0.3}, "collapse_threshold"),
        ({"warn_fraction": 0.0}, "warn_fraction"),
        ({"patience": 3, "critical_patience": 2}, "critical_patience"),
        ({"head": 3}, "head"),
    ],
)
def test_bad_arguments_fail_in_constructor(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SpectralAlignmentMonitor(**kwargs)


@pytest.mark.parametrize("escalate", [True, False])
def test_collapse_with_sigma_growth_escalates_early(escalate):
    mon, fired = _rule_monitor(baseline_checks=2, patience=2, critical_patience=10, growth_window=1,
                               max_sigma_growth=1.5, escalate_on_growth=escalate)
    for step in range(4):
        mon._update_rule(step, {"a": 0.9, "b": 0.9}, {"a": 1.0, "b": 1.0})
    for step in range(4, 8):  # collapse and sigma doubling every step, together
        mon._update_rule(step, {"a": 0.0, "b": 0.0}, {"a": 2.0 ** (step - 3), "b": 1.0})
    collapse = [(s, sev) for s, kind, act, sev in fired if act and kind == "collapse"]  # every active check
    assert collapse[0] == ((5, "critical") if escalate else (5, "warning"))
    assert {sev for _, sev in collapse} == ({"critical"} if escalate else {"warning"})
    assert [s for s, kind, act, sev in fired if act and kind == "sigma_growth"][0] == 5


# ----------------------------------------------------------------------------- input capture probe
def test_input_capture_bounded_detached_every_call_read_and_global_rng_untouched():
    from lightning_monitor.probes.inputs import InputCapture

    lin = nn.Linear(6, 3)
    cap = InputCapture({"lin": lin}, max_rows=10, seed=1)
    x = torch.randn(4, 7, 6, requires_grad=True)
    lin(x)
    assert cap.take() == {}  # not armed: nothing recorded, no hook
    assert len(lin._forward_pre_hooks) == 0
    cap.arm()
    cap.arm()  # idempotent
    assert len(lin._forward_pre_hooks) == 1 and len(lin._forward_hooks) == 1
    state = torch.get_rng_state()
    lin(torch.eye(6))  # PEFT's DoRA: a call on the identity before the data, not read
    assert torch.equal(state, torch.get_rng_state())  # the sampler has its own generator
    lin(x)
    lin(x + 100.0)  # a further call of the step (a shared layer, a micro-batch) is read too
    rows = cap.take()["lin"]
    assert len(lin._forward_pre_hooks) == 0 and len(lin._forward_hooks) == 0  # the hooks are gone
    assert rows.shape == (10, 6) and not rows.requires_grad
    flat = torch.cat([x.detach().reshape(-1, 6), x.detach().reshape(-1, 6) + 100.0])
    # every sampled row is a distinct row of the two data calls' inputs, none of the identity
    matches = [(flat == r).all(dim=1).nonzero().flatten().tolist() for r in rows]
    assert all(len(m) == 1 for m in matches) and len({m[0] for m in matches}) == 10
    once = InputCapture({"lin": lin}, max_rows=10, seed=1)
    once.arm()
    lin(x)  # a layer called once keeps its rows
    assert once.take()["lin"].shape == (10, 6) and len(lin._forward_pre_hooks) == 0
    assert cap.take() == {}  # released after use
    small = InputCapture({"lin": lin}, max_rows=100)
    small.arm()
    lin(x)
    torch.testing.assert_close(small.take()["lin"], flat[:28])  # fewer rows than max_rows: all of them
    with pytest.raises(ValueError, match="max_rows"):
        InputCapture({"lin": lin}, max_rows=0)


def test_input_capture_merges_calls_as_one_uniform_sample_and_skips_the_identity_path():
    # a layer called by several calls of a step (shared weights) gets a sample of all their rows, each row as likely as
    # any other: here a call of 30 rows and one of 10, 8 rows kept, 4000 times: the first call gives 3/4 of the rows
    from lightning_monitor.probes.inputs import InputCapture

    lin = nn.Linear(3, 2)
    a, b = torch.zeros(30, 3), torch.ones(10, 3)
    cap = InputCapture({"lin": lin}, max_rows=8, seed=0)
    from_a = 0
    for _ in range(4000):
        cap.arm()
        lin(a)
        lin(b)
        rows = cap.take()["lin"]
        assert rows.shape == (8, 3)
        from_a += int((rows[:, 0] == 0).sum())
    assert abs(from_a / (8 * 4000) - 0.75) < 0.01
    # DoRA's weight norm `lora_B(lora_A(eye))`: neither adapter reads the identity's path; both read the data
    lora_a, lora_b = nn.Linear(5, 2, bias=False), nn.Linear(2, 5, bias=False)
    cap = InputCapture({"a": lora_a, "b": lora_b}, max_rows=100)
    cap.arm()
    lora_b(lora_a(torch.eye(5)))
    x = torch.randn(3, 5)
    h = lora_a(x)
    lora_b(h)
    rows = cap.take()
    torch.testing.assert_close(rows["a"], x)
    torch.testing.assert_close(rows["b"], h.detach())
    # a square input of the layer's size that is not the identity is data
    cap.arm()
    sq = torch.randn(5, 5)
    lora_a(sq)
    torch.testing.assert_close(cap.take()["a"], sq)
    # a call on the identity that raised (its output never came): the layer's next call, and what it feeds, are data
    cap.arm()
    with pytest.raises(RuntimeError):
        lora_a(torch.eye(5, dtype=torch.float64))  # the weight is fp32
    h = lora_a(x)
    lora_b(h)
    rows = cap.take()
    torch.testing.assert_close(rows["a"], x)
    torch.testing.assert_close(rows["b"], h.detach())


def test_a_layer_shared_across_calls_is_aligned_on_all_its_inputs_and_recomputation_is_not_read(tmp_path):
    # one nn.Linear applied four times a forward (a recurrence with shared weights), under activation checkpointing:
    # the logged sign diversity and mean |a| are those of the rows of all four calls (oracle: explicit SVD); reading the
    # second call only, they were off by 0.25-0.31 in sign diversity, silently
    from torch.utils.checkpoint import checkpoint

    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.h = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            for t in range(4):
                h = checkpoint(lambda z, t=t: torch.tanh(self.b(z) + 0.5 * t), h, use_reentrant=False)
            return self.h(h)

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Rec()

        def training_step(self, batch, i):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Oracle(pl.Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_start(self, trainer, pl_module, batch, i):
            self.calls = []
            self.handle = pl_module.net.b.register_forward_pre_hook(
                lambda m, a: None if torch._C._current_graph_task_id() != -1 else self.calls.append(a[0].detach().double()))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, i):
            self.handle.remove()
            m = trainer.callback_metrics
            v1 = torch.linalg.svd(pl_module.net.b.weight.detach().double())[2][0]
            rows = torch.cat(self.calls)
            a = rows @ v1 / rows.norm(dim=1)
            p = float((a > 0).double().mean())
            self.seen.append((len(self.calls), float(m["sa/net.b/sign_diversity"]), 2 * min(p, 1 - p),
                              float(m["sa/net.b/mean_abs"]), float(a.abs().mean())))

    torch.manual_seed(1)
    x, y = torch.randn(24, 6), torch.randint(0, 3, (24,))
    oracle = Oracle()
    mon = SpectralAlignmentMonitor(every_n_steps=1, max_rows=100000, head=None)
    pl.Trainer(accelerator="cpu", max_steps=3, logger=False, default_root_dir=tmp_path, callbacks=[oracle, mon],
               enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False).fit(LM(), DataLoader(TensorDataset(x, y), batch_size=8))
    assert len(oracle.seen) == 3
    for calls, logged_d, d, logged_abs, mean_abs in oracle.seen:
        assert calls == 4
        assert logged_d == pytest.approx(d, abs=1e-6)
        assert logged_abs == pytest.approx(mean_abs, rel=1e-5)


def test_by_default_a_collapse_with_sigma_growth_stays_a_warning():
    # the collapse followed the learning rate in matched controls: by default it never makes the guard act
    mon, fired = _rule_monitor(baseline_checks=2, patience=2, growth_window=1, max_sigma_growth=1.5)
    for step in range(4):
        mon._update_rule(step, {"a": 0.9, "b": 0.9}, {"a": 1.0, "b": 1.0})
    for step in range(4, 40):
        mon._update_rule(step, {"a": 0.0, "b": 0.0}, {"a": 2.0 ** (step - 3), "b": 1.0})
    active = {(kind, sev) for s, kind, act, sev in fired if act}
    assert active == {("collapse", "warning"), ("sigma_growth", "warning")}


def test_frozen_layers_are_left_out_of_the_check(tmp_path):
    # a model fine-tuned in part (a LoRA model's base layers, a component GradientEarlyStopping froze): a frozen layer's
    # alignment says nothing of the run's, and it used to count in the collapse fractions. It is left out of each check
    # from the step it is frozen on, unless named in `include`
    class FreezeAt(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 6:
                pl_module.model.blocks[0].attn.v_proj.weight.requires_grad_(False)

    module = GPTModule(TINY)
    module.model.blocks[0].mlp.up_proj.weight.requires_grad_(False)  # frozen before the fit
    mon = SpectralAlignmentMonitor(every_n_steps=4, max_rows=8)
    tr = trainer(tmp_path, [FreezeAt(), mon], max_steps=12, logger=CSVLogger(str(tmp_path), name="csv"))
    tr.fit(module, loader())
    rows = list(csv.DictReader(open(os.path.join(tr.logger.log_dir, "metrics.csv"))))
    logged = {}
    for row in rows:
        for key, value in row.items():
            if key.endswith("/sign_diversity") and value != "":
                logged.setdefault(int(row["step"]), set()).add(key.removeprefix("sa/").removesuffix("/sign_diversity"))
    up, v = "model.blocks.0.mlp.up_proj", "model.blocks.0.attn.v_proj"
    assert logged[4] == set(LAYERS) - {up}  # v_proj still trains at step 4
    assert logged[8] == set(LAYERS) - {up, v}
    # named in `include`, a frozen layer is watched
    module = GPTModule(TINY)
    module.model.blocks[0].mlp.up_proj.weight.requires_grad_(False)
    mon = SpectralAlignmentMonitor(every_n_steps=4, max_rows=8, include=[up])
    trainer(tmp_path / "b", [mon], max_steps=5).fit(module, loader())
    assert list(mon._vectors) == [up]


def test_every_layer_frozen_is_said_once_and_cleared_when_one_trains_again(tmp_path):
    # GradientEarlyStopping with `stop=False` can freeze every watched layer: the monitor then measured nothing and
    # said nothing (its keys stopped, and HealthMonitor still listed it as watching)
    class Freeze(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            step = trainer.global_step
            if step in (6, 14):
                for name in LAYERS:
                    pl_module.get_submodule(name).weight.requires_grad_(step == 14)

    mon = SpectralAlignmentMonitor(every_n_steps=4, max_rows=8)
    tr = trainer(tmp_path, [Freeze(), mon], max_steps=20, logger=CSVLogger(str(tmp_path), name="csv"))
    tr.fit(GPTModule(TINY), loader())
    said = [(a.step, a.kind, a.severity) for a in mon.hub.history if a.monitor == "sa" and "frozen" in a.kind]
    assert said == [(8, "all_frozen", "info"), (16, "all_frozen_cleared", "info")]
    rows = list(csv.DictReader(open(os.path.join(tr.logger.log_dir, "metrics.csv"))))
    measured = sorted({int(r["step"]) for r in rows if r.get("sa/sign_diversity_mean", "") != ""})
    assert measured == [0, 4, 16]


class _ReluRegression(pl.LightningModule):
    """A healthy regression MLP: its second Linear takes ReLU outputs, inputs of one sign."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                        torch.nn.ReLU())
        self.head = torch.nn.Linear(64, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.body(x)), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_layer_fed_non_negative_inputs_never_counts_for_a_collapse(tmp_path):
    """Its sign diversity falls to 0 by nature as v_1 turns toward the mean of its (non-negative) inputs; on a healthy
    regression, with its early baseline taken while v_1 was still random, that read as a collapse of half the layers
    (a warning at step 600, 4 seeds of 4). The inputs' sign is read at each check."""
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(320, 16, generator=g)
    y = torch.stack([x[:, :4].sum(1), (x[:, 4:8] ** 2).sum(1) * 0.3], 1)
    mon = SpectralAlignmentMonitor(every_n_steps=50)
    tr = trainer(tmp_path, [mon], max_steps=700, logger=CSVLogger(str(tmp_path), name="csv"))
    tr.fit(_ReluRegression(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16,
                                                          shuffle=True))
    assert set(mon.layers) == {"body.0", "body.2"}
    assert mon._one_sign == {"body.2"}
    assert float(tr.callback_metrics["sa/body.2/sign_diversity"]) <= 0.1  # collapsed by nature ...
    assert not [a for a in mon._hub.history if a.kind == "collapse"]  # ... and not taken for a collapse
    assert not [k for k in tr.callback_metrics if "one_sign" in k]  # the flag is not logged


def test_a_validation_run_inside_an_accumulation_window_is_not_read_by_the_check(tmp_path):
    # `val_check_interval=2` with `accumulate_grad_batches=4`: validation runs between the micro-batches of one step,
    # while the step's input hooks are armed; its inputs went into the check (0.98438 -> 0.97917 in sign diversity)
    class MLP(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

        def training_step(self, batch, i):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch, i):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    def run(validate: bool) -> dict:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g)
        vx = torch.randn(64, 16, generator=g) * 3.0
        mon = SpectralAlignmentMonitor(every_n_steps=1, max_rows=100000)
        kw = dict(val_check_interval=2, limit_val_batches=2) if validate else dict(limit_val_batches=0)
        trainer = pl.Trainer(accelerator="cpu", max_steps=2, accumulate_grad_batches=4, logger=False,
                             default_root_dir=tmp_path, callbacks=[mon], enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)
        trainer.fit(MLP(), DataLoader(TensorDataset(x, y), batch_size=32),
                    DataLoader(TensorDataset(vx, y[:64]), batch_size=32))
        return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("sa/")}

    plain, validated = run(False), run(True)
    assert plain and plain.keys() == validated.keys()
    assert plain == validated

"""GradientNoiseScaleMonitor in real Trainer.fit runs, logged to TensorBoard / CSV and read back."""

from __future__ import annotations

import json
import math
import os
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_monitor import GradientNoiseScaleMonitor, read_alerts
from conftest import fit_ddp_spawn, tb_scalars  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

D, NOISE = 8, 0.5


class RegressionData(Dataset):
    """x ~ N(0, I_d), y = w* . x + eps: B_simple at fixed weights is known in closed form."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w_star = torch.randn(D, generator=torch.Generator().manual_seed(123))
        self.x = torch.randn(n, D, generator=g)
        self.y = self.x @ self.w_star + NOISE * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Regression(pl.LightningModule):
    """Linear regression with lr = 0: the weights, hence the true noise scale, never move."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, 1, bias=False)
        with torch.no_grad():
            w_star = torch.randn(D, generator=torch.Generator().manual_seed(123))
            self.lin.weight.copy_(w_star + 0.3 * torch.randn(D, generator=torch.Generator().manual_seed(7)))

    def truth(self) -> float:
        w_star = torch.randn(D, generator=torch.Generator().manual_seed(123))
        e2 = float((self.lin.weight.detach().reshape(-1) - w_star).pow(2).sum())
        return ((D + 1) * e2 + D * NOISE**2) / e2

    def training_step(self, batch, batch_idx):
        x, y = batch
        return 0.5 * (self.lin(x).squeeze(1) - y).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(model, callbacks, tmp_path, loader, max_steps, logger="tb", **trainer_kw):
    lg = TensorBoardLogger(str(tmp_path), name="tb") if logger == "tb" else CSVLogger(str(tmp_path), name="csv")
    trainer = pl.Trainer(
        accelerator="cpu", logger=lg, max_steps=max_steps, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1, callbacks=callbacks, **trainer_kw,
    )
    trainer.fit(model, loader)
    return trainer, lg


def scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_gpt_fit_logs_keys_to_tensorboard(tmp_path) -> None:
    from gpt import GPTConfig, GPTModule, make_loader

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=2, d_model=32, block_size=16)
    module = GPTModule(cfg, lr=3e-3)
    loader = make_loader("prose", block_size=16, batch_size=8, n_samples=128, seed=0)
    mon = GradientNoiseScaleMonitor(every_n_steps=2, warmup_steps=1)
    trainer, lg = fit(module, [mon], tmp_path, loader, max_steps=9)
    assert mon.resolved_method == "per_example"
    tags = scalars(lg.log_dir)
    for key in ("gns/b_simple", "gns/g2", "gns/trace_sigma", "gns/batch_size",
                "gns/model.blocks.0.attn.q_proj/b_simple", "gns/model.tok_emb/b_simple",
                "gns/model.blocks.0.ln_1/b_simple"):
        assert key in tags, (key, sorted(tags))
    assert [s for s, _ in tags["gns/g2"]] == [1, 3, 5, 7]  # due steps only
    assert all(v == 8.0 for _, v in tags["gns/batch_size"])
    assert all(v > 0 and math.isfinite(v) for _, v in tags["gns/trace_sigma"])
    # the position embedding's input is broadcast over the batch: reported, not mixed in
    assert "model.pos_emb.weight" in mon._probe.uncovered
    assert not any(m._forward_hooks for m in module.modules())  # detached after the run


def test_include_restricts_hooks_and_layer_keys(tmp_path) -> None:
    from gpt import GPTConfig, GPTModule, make_loader

    torch.manual_seed(0)
    module = GPTModule(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=8), lr=1e-3)
    loader = make_loader("prose", block_size=8, batch_size=4, n_samples=16, seed=0)
    mon = GradientNoiseScaleMonitor(every_n_steps=1, include="model.blocks.0.mlp.*")
    trainer, lg = fit(module, [mon], tmp_path, loader, max_steps=2)
    assert set(mon._probe.modules()) == {"model.blocks.0.mlp.up_proj", "model.blocks.0.mlp.down_proj"}
    layer_keys = {k for k in scalars(lg.log_dir) if k.startswith("gns/") and k.count("/") == 2}
    assert layer_keys == {"gns/model.blocks.0.mlp.up_proj/b_simple", "gns/model.blocks.0.mlp.down_proj/b_simple"}


def test_regression_b_simple_and_alerts(tmp_path) -> None:
    torch.manual_seed(0)
    model = Regression()
    truth = model.truth()
    loader = DataLoader(RegressionData(4 * 2000), batch_size=4, shuffle=False)
    mon = GradientNoiseScaleMonitor(every_n_steps=1, smoothing=0.98, alert_ratio=2.0, min_checks=5)
    trainer, lg = fit(model, [mon], tmp_path, loader, max_steps=400, logger="csv")
    rows = list(__import__("csv").DictReader(open(os.path.join(lg.log_dir, "metrics.csv"))))
    values = [float(r["gns/b_simple"]) for r in rows if r.get("gns/b_simple")]
    assert len(values) >= 390
    assert values[-1] == pytest.approx(truth, rel=0.15)
    assert float(rows[-1]["gns/lin/b_simple"] or values[-1]) == pytest.approx(values[-1])
    alerts = read_alerts(os.path.join(lg.log_dir, "alerts.jsonl"))
    kinds = [a.kind for a in alerts]
    assert kinds.count("batch_below_noise_scale") == 1  # batch 4 * 2 < B_simple ~ 20: condition, raised once
    below = next(a for a in alerts if a.kind == "batch_below_noise_scale")
    assert below.severity == "info" and "Raise the batch size" in below.message


def test_accumulation_method_agrees_with_truth(tmp_path) -> None:
    torch.manual_seed(0)
    model = Regression()
    truth = model.truth()
    loader = DataLoader(RegressionData(8 * 4 * 300, seed=1), batch_size=8)
    mon = GradientNoiseScaleMonitor(every_n_steps=1, smoothing=0.98)
    fit(model, [mon], tmp_path, loader, max_steps=250, accumulate_grad_batches=4)
    assert mon.resolved_method == "accumulation"
    assert mon.ema.b_simple == pytest.approx(truth, rel=0.2)
    assert not any(p._backward_hooks for p in model.parameters() if p._backward_hooks)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_amp_loss_scale_is_divided_out(tmp_path, accumulate: int) -> None:
    """Under a dynamic loss scaler (scale 1024) the hooks see scaled gradients: the estimate must not."""
    from lightning.pytorch.plugins import MixedPrecision

    model = Regression()
    truth = model.truth()
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    mon = GradientNoiseScaleMonitor(every_n_steps=1, smoothing=0.98)
    fit(model, [mon], tmp_path, DataLoader(RegressionData(16 * 2 * 150), batch_size=16), max_steps=150,
        logger="csv", plugins=[plugin], accumulate_grad_batches=accumulate)
    assert mon.resolved_method == ("per_example" if accumulate == 1 else "accumulation")
    assert mon.ema.count == 150
    assert mon.ema.b_simple == pytest.approx(truth, rel=0.2)


def test_batch_size_one_says_so(tmp_path) -> None:
    model = Regression()
    loader = DataLoader(RegressionData(20), batch_size=1)
    mon = GradientNoiseScaleMonitor(every_n_steps=1)
    trainer, lg = fit(model, [mon], tmp_path, loader, max_steps=4)
    alerts = read_alerts(os.path.join(lg.log_dir, "alerts.jsonl"))
    assert [a.kind for a in alerts] == ["no_variance_estimate"]
    tags = scalars(lg.log_dir)
    assert "gns/b_simple" not in tags and "gns/g2" not in tags
    assert [v for _, v in tags["gns/batch_size"]] == [1.0] * 4


def test_non_finite_steps_skipped(tmp_path) -> None:
    class Spiky(Regression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if self.global_step == 2 else loss

        def on_before_optimizer_step(self, optimizer) -> None:  # after the callbacks' hook
            for p in self.parameters():
                p.grad.nan_to_num_(0.0, 0.0, 0.0)  # keep the weights finite for the next steps

    model = Spiky()
    mon = GradientNoiseScaleMonitor(every_n_steps=1)
    trainer, lg = fit(model, [mon], tmp_path, DataLoader(RegressionData(64), batch_size=8), max_steps=5)
    steps = [s for s, _ in scalars(lg.log_dir)["gns/g2"]]
    assert steps == [0, 1, 3, 4]
    assert mon.ema.count == 4


def test_state_dict_round_trip() -> None:
    mon = GradientNoiseScaleMonitor()
    mon.ema.update(2.0, 10.0)
    mon.layer_ema["lin"] = type(mon.ema)(0.9)
    mon.layer_ema["lin"].update(1.0, 3.0)
    other = GradientNoiseScaleMonitor()
    other.load_state_dict(json.loads(json.dumps(mon.state_dict())))
    assert other.ema.b_simple == pytest.approx(5.0) and other.layer_ema["lin"].b_simple == pytest.approx(3.0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"method": "fast"}, "method"),
        ({"smoothing": 1.0}, "smoothing"),
        ({"alert_ratio": 1.0}, "alert_ratio"),
        ({"min_checks": 0}, "min_checks"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"loss_reduction": "none"}, "loss_reduction"),
    ],
)
def test_bad_constructor_arguments(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        GradientNoiseScaleMonitor(**kwargs)


@pytest.mark.parametrize(
    "kwargs,trainer_kw,match",
    [
        ({"method": "ddp"}, {}, "needs >= 2 data-parallel ranks"),
        ({"method": "accumulation"}, {}, "accumulate_grad_batches >= 2"),
        ({"include": "nothing*"}, {}, "matches no module"),
    ],
)
def test_bad_setup_raises_clear_error(tmp_path, kwargs, trainer_kw, match) -> None:
    mon = GradientNoiseScaleMonitor(**kwargs)
    with pytest.raises(ValueError, match=match):
        fit(Regression(), [mon], tmp_path, DataLoader(RegressionData(16), batch_size=4), max_steps=1, **trainer_kw)


# ----------------------------------------------------------------------------- DDP (2 gloo ranks)


class DDPRegression(Regression):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out

    def on_train_end(self) -> None:
        mon = next(c for c in self.trainer.callbacks if isinstance(c, GradientNoiseScaleMonitor))
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"b_simple": mon.ema.b_simple, "method": mon.resolved_method, "count": mon.ema.count}, fh)


def test_ddp_method_agrees_with_per_example(tmp_path) -> None:
    torch.manual_seed(0)
    model = DDPRegression(str(tmp_path))
    truth = model.truth()
    data = RegressionData(16 * 2 * 200, seed=3)
    mon = GradientNoiseScaleMonitor(every_n_steps=1, smoothing=0.98)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=150, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[mon],
    )
    fit_ddp_spawn(trainer, model, DataLoader(data, batch_size=16))
    res = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert [r["method"] for r in res] == ["ddp", "ddp"]
    assert res[0]["b_simple"] == pytest.approx(res[1]["b_simple"])  # all ranks agree
    # per-example on one process, same global batch of 32 examples
    single = Regression()
    mon1 = GradientNoiseScaleMonitor(every_n_steps=1, smoothing=0.98)
    fit(single, [mon1], tmp_path / "single", DataLoader(data, batch_size=32), max_steps=150, logger="csv")
    assert mon1.resolved_method == "per_example"
    # within noise: both estimates of the same closed-form truth
    assert res[0]["b_simple"] == pytest.approx(truth, rel=0.25)
    assert mon1.ema.b_simple == pytest.approx(truth, rel=0.25)
    assert res[0]["b_simple"] == pytest.approx(mon1.ema.b_simple, rel=0.35)


def test_batch_advice_shows_b_simple_as_measured_and_never_advises_below_one_example():
    from lightning_monitor import GradientNoiseScaleMonitor

    mon = GradientNoiseScaleMonitor(min_checks=1)
    mon.ema.update(1.0, 1.0)  # one check in
    raised = []
    mon.condition = lambda step, kind, active, severity, message, **kw: raised.append((kind, active, message))
    mon._batch_alerts(step=40, batch=16, b_simple=0.495)
    above = next(m for kind, active, m in raised if kind == "batch_above_noise_scale" and active)
    assert "B_simple = 0.495" in above and "toward ~1 " in above and "~0" not in above


def test_b_simple_undefined_for_many_checks_is_said_once_and_cleared():
    # a smoothed |G|^2 that stays <= 0 (Whisper, CLIP, MoE models at small batches): gns/b_simple was never logged and
    # nothing said why
    from lightning_monitor import GradientNoiseScaleMonitor

    mon = GradientNoiseScaleMonitor(smoothing=0.0)
    raised = []
    mon.condition = lambda step, kind, active, severity, message, **kw: raised.append((step, kind, active, message))
    mon._batch_alerts = lambda *a, **kw: None
    mon._measured = set()
    logged = []
    for step, g2 in enumerate([-0.5] * 6 + [0.2]):
        metrics = mon.judge(None, step, {"\x00g2": g2, "\x00tr": 4.0, "\x00batch": 8.0})
        logged.append("gns/b_simple" in metrics)
    said = [(step, active) for step, kind, active, _ in raised if kind == "b_simple_undefined"]
    assert said == [(0, False), (1, False), (2, False), (3, False), (4, True), (5, True), (6, False)]
    assert "stays <= 0 (-0.5)" in next(m for s, k, a, m in raised if k == "b_simple_undefined" and a)
    assert logged == [False] * 6 + [True]


class _ClippedClassifier(pl.LightningModule):
    """One model, trained either with automatic optimization and ``gradient_clip_val``, or with manual optimization and
    ``self.clip_gradients`` before ``opt.step()``: the same updates."""

    def __init__(self, manual: bool, clip: float) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.clip = clip
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_manual_optimization_clipping_reads_the_unclipped_gradient(tmp_path) -> None:
    """Under manual optimization Lightning calls ``on_before_optimizer_step`` inside ``opt.step()``, after the user's
    ``clip_gradients``; the per-example norms come from the backward, unclipped. The batch gradient is read after the
    backward instead, so the estimates equal those of the same training under automatic optimization (whose hook runs
    before Lightning clips). Before, |G|^2 came out negative at every check (clipped batch gradient against unclipped
    per-example norms)."""
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    y = (x @ torch.randn(16, 5, generator=g)).argmax(1)
    logged = {}
    for manual in (False, True):
        torch.manual_seed(0)
        model = _ClippedClassifier(manual, clip=0.05)
        logger = TensorBoardLogger(str(tmp_path), name=f"manual={manual}")
        trainer = pl.Trainer(max_steps=16, accelerator="cpu", logger=logger, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1,
                             gradient_clip_val=None if manual else 0.05,
                             callbacks=[GradientNoiseScaleMonitor(every_n_steps=5, method="per_example")])
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=32))
        logged[manual] = tb_scalars(logger.log_dir)
    for key in ("gns/g2", "gns/trace_sigma"):
        auto, manual = logged[False][key], logged[True][key]
        assert [s for s, _ in auto] == [s for s, _ in manual] == [0, 5, 10, 15]
        assert [v for _, v in manual] == pytest.approx([v for _, v in auto], rel=1e-5)
    assert all(v > 0 for _, v in logged[True]["gns/g2"])


def test_batch_size_advice_stops_at_the_training_set() -> None:
    """B_simple above the samples an epoch holds: the advice was 'toward ~655' on a set of 512 samples, a batch no
    epoch can fill. It now says the whole training set, and why; below it the advice names B_simple as before."""
    mon = GradientNoiseScaleMonitor(min_checks=1)
    said = []
    mon.condition = lambda step, kind, active, severity, message, *a, **k: said.append((kind, active, message))
    mon.ema.update(1.0, 655.0)
    mon._batch_alerts(10, 16.0, 655.0, epoch_samples=512.0)
    (below,) = [m for kind, active, m in said if kind == "batch_below_noise_scale" and active]
    assert "as far as the whole training set (~512 samples an epoch" in below and "~655 " not in below
    said.clear()
    mon._batch_alerts(20, 16.0, 655.0, epoch_samples=4096.0)
    (below,) = [m for kind, active, m in said if kind == "batch_below_noise_scale" and active]
    assert "toward ~655 " in below


def test_batch_size_advice_waits_for_half_the_gradient() -> None:
    """A MobileNetV2 (its BatchNorm layers couple the examples) had 0.3% of the gradient's squared norm covered and was
    told to raise its batch size from B_simple 290. Below half of it the advice is withheld, saying why; an active one
    is withdrawn; at full coverage the same estimate advises as before."""
    mon = GradientNoiseScaleMonitor(min_checks=1)
    said = []

    def condition(step, kind, active, severity, message, *a, clear_message="", **k):
        said.append((kind, active, message or clear_message))
        if active:
            mon._conditions[(kind, None)] = severity
        else:
            mon._conditions.pop((kind, None), None)

    mon.condition = condition
    mon.ema.update(1.0, 290.0)
    mon._batch_alerts(10, 4.0, 290.0, coverage=1.0)
    assert ("batch_below_noise_scale", True) in [(k, a) for k, a, _ in said]
    said.clear()
    mon._batch_alerts(20, 4.0, 290.0, coverage=0.003)
    (withheld,) = [m for kind, active, m in said if kind == "advice_withheld" and active]
    assert "0.3% of the gradient's squared norm" in withheld
    assert ("batch_below_noise_scale", False) in [(k, a) for k, a, _ in said]  # the advice given is withdrawn
    assert not any(active for kind, active, _ in said if kind.startswith("batch_"))
    said.clear()
    mon._batch_alerts(30, 4.0, 290.0, coverage=0.95)
    assert ("advice_withheld", False) in [(k, a) for k, a, _ in said]
    assert ("batch_below_noise_scale", True) in [(k, a) for k, a, _ in said]


def test_b_simple_undefined_counts_on_across_a_resume():
    # the checks in a row without B_simple are part of the saved state: a run resumed after 2 of them says so at its
    # 3rd check, as the run it continues would have (it counted from 0 again and said it 2 checks late, or never)
    from lightning_monitor import GradientNoiseScaleMonitor

    def monitor():
        mon = GradientNoiseScaleMonitor(smoothing=0.0)
        mon.raised = []
        mon.condition = lambda step, kind, active, severity, message, **kw: mon.raised.append((step, kind, active))
        mon._batch_alerts = lambda *a, **kw: None
        mon._measured = set()
        return mon

    first = monitor()
    for step in range(2):
        first.judge(None, step, {"\x00g2": -0.5, "\x00tr": 4.0, "\x00batch": 8.0})
    resumed = monitor()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for step in range(2, 5):
        resumed.judge(None, step, {"\x00g2": -0.5, "\x00tr": 4.0, "\x00batch": 8.0})
    said = [(step, active) for step, kind, active in resumed.raised if kind == "b_simple_undefined"]
    assert said == [(2, False), (3, False), (4, True)]


class _TwoLoaders(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(6, 3)

    def training_step(self, batch, batch_idx):
        parts = batch.values() if isinstance(batch, dict) else [batch]
        return sum(torch.nn.functional.cross_entropy(self.net(x), y) for x, y in parts)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("mode", ["max_size_cycle", "min_size"])
def test_batches_combining_several_loaders_leave_the_noise_scale_idle_saying_why(tmp_path, mode):
    # a dict of two loaders (16 and 8 a batch): the batch size was read from the first sub-batch (gns/batch_size 16 for
    # 24 examples a step) and the reason given for the layers left out was a sequence-first input
    from lightning.pytorch.utilities import CombinedLoader

    g = torch.Generator().manual_seed(0)
    loaders = {name: torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)),
        batch_size=size) for name, size in (("a", 16), ("b", 8))}
    monitor = GradientNoiseScaleMonitor(every_n_steps=1)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False, callbacks=[monitor], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(_TwoLoaders(), CombinedLoader(loaders, mode=mode))
    assert "combines 2 data loaders" in monitor.idle_reason
    assert not any(k.startswith("gns/") for k in trainer.callback_metrics)
    # one loader: measured
    monitor = GradientNoiseScaleMonitor(every_n_steps=1)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False, callbacks=[monitor], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(_TwoLoaders(), loaders["a"])
    assert monitor.idle_reason is None and trainer.callback_metrics["gns/batch_size"] == 16.0

"""The TensorBoard dashboard: which cards the layout holds, that each card's regex selects the tags it
means (as TensorBoard matches them) and every card of a real run shows data; and the per-layer switch of
the monitors' logging path (one histogram per statistic instead of one scalar per layer)."""

from __future__ import annotations

import math
import re
from typing import Any

import lightning.pytorch as pl
import torch
from conftest import tb_event_accumulator
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.plugins.custom_scalar import layout_pb2

import lightning_monitor as lm
from lightning_monitor.dashboard import HEALTH_CATEGORY, health_layout


def _regexes(layout: dict[str, Any]) -> dict[str, list[str]]:
    return {title: chart[1] for charts in layout.values() for title, chart in charts.items()}


def _selects(regexes: list[str], tag: str) -> bool:
    return any(re.match(r, tag) for r in regexes)  # TensorBoard's custom-scalars plugin: re.match per tag


def test_layout_has_a_card_per_monitor_of_the_run() -> None:
    layout = health_layout(["sa", "gns", "gwa", "guard"])
    assert list(layout) == [HEALTH_CATEGORY]
    titles = list(layout[HEALTH_CATEGORY])
    assert titles[:2] == ["loss", "alerts: count per severity"]
    assert any(t.startswith("sa:") for t in titles) and any(t.startswith("gns:") for t in titles)
    assert not any(t.startswith("grades:") for t in titles)
    assert any(t.startswith("grades:") for t in health_layout(["grades"])[HEALTH_CATEGORY])
    with_layers = health_layout(["sa", "gns"], per_layer=["sa", "gns", "mine"])
    assert list(with_layers) == [HEALTH_CATEGORY, "per layer: sa", "per layer: gns", "per layer: mine"]
    assert len(with_layers["per layer: sa"]) == 3


def test_card_regexes_select_the_tags_they_mean() -> None:
    cards = _regexes(health_layout(["sa", "gns", "gwa", "grades"], per_layer=["sa", "gns"]))
    loss = cards["loss"]
    for tag in ("train/loss", "val/loss", "train_loss_epoch", "loss", "Val/Loss"):
        assert _selects(loss, tag), tag
    for tag in ("alerts/count/critical", "gwa/score", "sa/sign_diversity_mean"):
        assert not _selects(loss, tag), tag
    sa = cards["sa: sign diversity, collapsed fraction"]
    assert _selects(sa, "sa/sign_diversity_mean") and _selects(sa, "sa/collapsed_fraction")
    assert not _selects(sa, "sa/blocks.0.q/sign_diversity")
    gns = cards["gns: B_simple vs batch size"]
    assert _selects(gns, "gns/b_simple") and _selects(gns, "gns/batch_size")
    assert not _selects(gns, "gns/blocks.0.q/b_simple") and not _selects(gns, "gns/g2")
    per_layer = cards["sa: sign_diversity per layer"]
    assert _selects(per_layer, "sa/model.blocks.0.attn.q_proj/sign_diversity")
    assert not _selects(per_layer, "sa/sign_diversity_mean") and not _selects(per_layer, "sa/layers/sign_diversity")
    assert _selects(cards["alerts: count per severity"], "alerts/count/warning")


def test_every_card_of_a_real_run_shows_data(tmp_path, tiny_gpt) -> None:
    """Monitors constructed one by one (per-layer scalars) with TensorBoardDashboard: the layout is
    written once, and each of its cards selects at least one scalar the run logged."""
    module, loader = tiny_gpt(n_samples=32)  # 4 steps per epoch: GWA reports at each epoch end
    callbacks = [
        lm.SpectralAlignmentMonitor(every_n_steps=2), lm.GradientNoiseScaleMonitor(every_n_steps=2),
        lm.GradientWeightAlignmentMonitor(warmup_epochs=0), lm.DivergenceGuard(every_n_steps=2),
        lm.TensorBoardDashboard(),
    ]
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=8, logger=TensorBoardLogger(str(tmp_path), name="run", version=""),
        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        log_every_n_steps=2,
    )
    trainer.fit(module, loader)
    ea = tb_event_accumulator(str(tmp_path))
    events = ea.Tensors("custom_scalars__config__")
    assert len(events) == 1
    layout = layout_pb2.Layout()
    layout.ParseFromString(events[0].tensor_proto.string_val[0])
    categories = [c.title for c in layout.category]
    assert categories == [HEALTH_CATEGORY, "per layer: sa", "per layer: gns"]
    scalars = ea.Tags()["scalars"]
    for category in layout.category:
        for chart in category.chart:
            assert any(_selects(list(chart.multiline.tag), t) for t in scalars), (chart.title, sorted(scalars))


class _Layers(lm.Monitor):
    name = "toy"


class _Run(pl.Callback):
    """Logs one check of ``_Layers`` at step 3 from ``on_train_start``."""

    def __init__(self, monitor: _Layers) -> None:
        self.monitor = monitor

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        m = self.monitor
        m.log_metrics(trainer, {
            m.key("mean"): torch.tensor(0.5),
            m.key("norm", "a"): torch.tensor(1.0), m.key("norm", "b"): torch.tensor(3.0),
            m.key("norm", "c"): torch.tensor(math.nan), m.key("rank", "a"): 2.0,
        }, step=3)
        trainer.should_stop = True


def _log_once(tmp_path: Any, per_layer_scalars: bool) -> tuple[pl.Trainer, Any]:
    from gpt import GPTModule, make_loader

    monitor = _Layers()
    monitor.per_layer_scalars = per_layer_scalars
    loggers = [TensorBoardLogger(str(tmp_path), name="tb", version=""),
               CSVLogger(str(tmp_path), name="csv", version="")]
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=loggers, callbacks=[monitor, _Run(monitor)],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(GPTModule({"n_layer": 1, "n_head": 2, "d_model": 16, "block_size": 8}),
                make_loader("prose", block_size=8, batch_size=2, n_samples=4))
    for logger in loggers:
        logger.finalize("success")
    return trainer, tb_event_accumulator(str(tmp_path / "tb"))


def test_per_layer_values_fold_into_one_histogram_per_statistic(tmp_path) -> None:
    trainer, ea = _log_once(tmp_path, per_layer_scalars=False)
    assert "toy/mean" in ea.Tags()["scalars"]
    assert not [t for t in ea.Tags()["scalars"] if t.startswith("toy/") and t != "toy/mean"]
    assert sorted(t for t in ea.Tags()["histograms"] if t.startswith("toy/")) == ["toy/layers/norm", "toy/layers/rank"]
    (norm,) = ea.Histograms("toy/layers/norm")
    assert norm.step == 3
    assert norm.histogram_value.num == 2  # the NaN is left out
    assert norm.histogram_value.min == 1.0 and norm.histogram_value.max == 3.0
    with open(tmp_path / "csv" / "metrics.csv", encoding="utf-8") as fh:
        header = fh.readline()
    assert "toy/mean" in header and "toy/a/norm" not in header  # other loggers: model level only
    # callback_metrics keep every key
    assert {"toy/a/norm", "toy/b/norm", "toy/a/rank", "toy/mean"} <= set(trainer.callback_metrics)


def test_per_layer_scalars_on_is_todays_behaviour(tmp_path) -> None:
    assert lm.SpectralAlignmentMonitor().per_layer_scalars  # a monitor constructed on its own
    _, ea = _log_once(tmp_path, per_layer_scalars=True)
    assert {"toy/mean", "toy/a/norm", "toy/b/norm", "toy/a/rank"} <= set(ea.Tags()["scalars"])
    assert not [t for t in ea.Tags()["histograms"] if t.startswith("toy/")]


def test_a_monitor_idle_from_the_first_batch_has_its_cards_taken_off(tmp_path) -> None:
    """A regression under `HealthMonitor()`: GWA learns from the first batch's targets that there is no classifier
    and goes idle, after the layout was written at the start of the fit. The layout is written again without its card
    (TensorBoard shows a run's last one): the GWA card stayed, empty, on every regression run. Every card of the last
    layout selects a scalar the run logged."""
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

        def training_step(self, batch, batch_idx):
            loss = nn.functional.mse_loss(self.net(batch[0]).squeeze(-1), batch[1])
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), 1e-3)

    pl.seed_everything(0, verbose=False)
    x = torch.randn(256, 8)
    hm = lm.HealthMonitor()
    logger = TensorBoardLogger(str(tmp_path), name="run", version="")
    trainer = pl.Trainer(accelerator="cpu", max_steps=40, logger=logger, callbacks=[hm], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, log_every_n_steps=1)
    trainer.fit(Regression(), DataLoader(TensorDataset(x, x.sum(1)), batch_size=16))
    assert hm.gwa.idle_reason is not None
    ea = tb_event_accumulator(str(tmp_path))
    layouts = []
    for event in ea.Tensors("custom_scalars__config__"):
        layout = layout_pb2.Layout()
        layout.ParseFromString(event.tensor_proto.string_val[0])
        layouts.append([chart.title for category in layout.category for chart in category.chart])
    assert len(layouts) == 2 and any(t.startswith("gwa") for t in layouts[0])
    assert not any(t.startswith("gwa") for t in layouts[-1])
    scalars = ea.Tags()["scalars"]
    for category in layout.category:
        for chart in category.chart:
            assert any(_selects(list(chart.multiline.tag), t) for t in scalars), (chart.title, sorted(scalars))

"""Alert record, the hub's sinks in a real Trainer, and the base Monitor's conditions."""

from __future__ import annotations

import json
import logging
import math
import os

import lightning.pytorch as pl
import pytest
import torch
from conftest import tb_scalars, tb_texts
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_monitor import Alert, Monitor, read_alerts


def test_alert_record_roundtrip_and_validation():
    a = Alert(3, "guard", "nonfinite", "critical", "boom", value=math.nan, threshold=None, layer="blocks.0.mlp")
    d = a.to_dict()
    assert d["value"] == "nan" and d["layer"] == "blocks.0.mlp" and d["severity"] == "critical"
    back = Alert.from_dict(json.loads(json.dumps(d)))
    assert back.step == 3 and math.isnan(back.value) and back.level == 3
    assert "**CRITICAL**" in a.to_markdown() and "`blocks.0.mlp`" in a.to_markdown()
    with pytest.raises(ValueError, match="severity"):
        Alert(0, "m", "k", "fatal", "x")


class _Raiser(Monitor):
    """Raises a persisting condition on steps 4..7 (warning, escalating to critical on 6) and a one-off alert."""

    name = "probe"

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        step = trainer.global_step
        if not self.is_due(step):
            return
        self.log_metrics(trainer, {self.key("value", "layer.a"): torch.tensor(float(step))}, step)
        sev = "critical" if step >= 6 else "warning"
        self.condition(step, "high", 4 <= step <= 7, sev, f"high at {step}", value=float(step), threshold=4.0)
        if step == 2:
            self.alert(step, "hello", "info", "one-off", layer="layer.a")


def _fit(tmp_path, loggers, callbacks, tiny_gpt, steps=12):
    module, loader = tiny_gpt()
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=loggers, callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
    )
    trainer.fit(module, loader)
    return trainer


def test_alerts_reach_every_sink_once_per_condition(tmp_path, tiny_gpt, caplog):
    tb = TensorBoardLogger(str(tmp_path), name="tb")
    csv = CSVLogger(str(tmp_path), name="csv")
    probe = _Raiser(every_n_steps=1)
    with caplog.at_level(logging.INFO, logger="lightning_monitor"):
        _fit(tmp_path, [tb, csv], [probe], tiny_gpt)

    # JSONL in the first logger's log dir: one-off, onset, escalation, clear -- not one per step
    path = os.path.join(tb.log_dir, "alerts.jsonl")
    alerts = read_alerts(path)
    assert [(a.step, a.kind, a.severity) for a in alerts] == [
        (2, "hello", "info"), (4, "high", "warning"), (6, "high", "critical"), (8, "high_cleared", "info")
    ]
    assert alerts[0].layer == "layer.a" and alerts[1].threshold == 4.0
    with open(path) as fh:
        assert set(json.loads(fh.readline())) == {
            "step", "monitor", "kind", "severity", "message", "value", "threshold", "layer", "details"
        }

    # TensorBoard scalars (alerts/<monitor> = severity level, 0 on clear) and the monitor's own keys
    scalars = tb_scalars(tb.log_dir)
    assert scalars["alerts/probe"] == [(2, 1.0), (4, 2.0), (6, 3.0), (8, 0.0)]
    assert [s for s, _ in scalars["probe/layer.a/value"]] == list(range(12))
    # Text tab: readable Markdown
    texts = tb_texts(tb.log_dir)
    md = [t for tag, items in texts.items() if tag.startswith("alerts/probe") for _, t in items]
    assert len(md) == 4 and any("**CRITICAL**" in t and "high at 6" in t for t in md)
    # CSV logger saw the same alert scalars
    with open(os.path.join(csv.log_dir, "metrics.csv")) as fh:
        header = fh.readline().strip().split(",")
        rows = [dict(zip(header, line.strip().split(","))) for line in fh]
    levels = [(int(r["step"]), float(r["alerts/probe"])) for r in rows if r.get("alerts/probe")]
    assert levels == [(2, 1.0), (4, 2.0), (6, 3.0), (8, 0.0)]
    # Python logging, logger name lightning_monitor, with matching levels
    recs = [r for r in caplog.records if r.name == "lightning_monitor"]
    assert [r.levelno for r in recs] == [logging.INFO, logging.WARNING, logging.CRITICAL, logging.INFO]


def test_alerts_jsonl_without_logger_goes_to_root_dir(tmp_path, tiny_gpt):
    probe = _Raiser(every_n_steps=2)
    _fit(tmp_path, False, [probe], tiny_gpt, steps=9)
    alerts = read_alerts(os.path.join(str(tmp_path), "alerts.jsonl"))
    assert [a.kind for a in alerts] == ["hello", "high", "high", "high_cleared"]


def test_unwritable_log_dir_fails_at_setup(tmp_path, tiny_gpt):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    module, loader = tiny_gpt()
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, callbacks=[_Raiser()],
                         default_root_dir=str(blocker / "sub"), enable_progress_bar=False,
                         enable_checkpointing=False)
    with pytest.raises(PermissionError, match="default_root_dir"):
        trainer.fit(module, loader)
    assert trainer.global_step == 0


def test_cadence_and_validation():
    m = Monitor(every_n_steps=5, warmup_steps=3)
    assert [s for s in range(20) if m.is_due(s)] == [3, 8, 13, 18]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="every_n_steps"):
            Monitor(every_n_steps=bad)
    with pytest.raises(ValueError, match="warmup_steps"):
        Monitor(warmup_steps=-1)


def test_condition_state_roundtrip():
    m = Monitor()

    class Hub:
        history: list = []

        def emit(self, a):
            self.history.append(a)

    m._hub = Hub()
    m.condition(1, "x", True, "warning", "on", layer="l")
    m2 = Monitor()
    m2._hub = Hub()
    m2.load_state_dict(m.state_dict())
    assert m2.condition(2, "x", True, "warning", "still on", layer="l") is None  # no duplicate after resume
    assert m2.condition(3, "x", False, "warning", "off", layer="l").kind == "x_cleared"


def test_to_host_single_transfer_keeps_order():
    host = Monitor.to_host({"b": torch.tensor(2.0), "a": 1, "c": torch.tensor([3.0])})
    assert list(host) == ["b", "a", "c"] and host == {"b": 2.0, "a": 1.0, "c": 3.0}

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
    """Raises a persisting condition on steps 4..7 (warning, escalating to critical on 6) and a one-off alert
    on two layers at step 2."""

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
            self.alert(step, "hello", "info", "one-off", layer="layer.b")


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
        (2, "hello", "info"), (2, "hello", "info"), (4, "high", "warning"), (6, "high", "critical"),
        (8, "high_cleared", "info"),
    ]
    assert [a.layer for a in alerts[:2]] == ["layer.a", "layer.b"] and alerts[2].threshold == 4.0
    with open(path) as fh:
        assert set(json.loads(fh.readline())) == {
            "step", "monitor", "kind", "severity", "message", "value", "threshold", "layer", "details", "run_id"
        }
    # one run id for the whole fit, in the file and in the hub's history
    assert len({a.run_id for a in alerts}) == 1 and alerts[0].run_id == probe.hub.run_id
    assert [a.run_id for a in probe.hub.history] == [a.run_id for a in alerts]

    # TensorBoard: cumulative counts per severity (a staircase: the previous count one step before each
    # change; a start and an end point), and the monitor's own keys
    scalars = tb_scalars(tb.log_dir)
    assert not any(tag.startswith("alerts/probe") for tag in scalars)  # no sparse per-monitor level points
    expected = {
        "info": {0: 0, 1: 0, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2, 8: 3, 12: 3},
        "warning": {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1, 8: 1, 12: 1},
        "critical": {0: 0, 1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 6: 1, 7: 1, 8: 1, 12: 1},
    }
    for sev, by_step in expected.items():
        series = scalars[f"alerts/count/{sev}"]
        assert dict(series) == by_step, sev  # the last value logged at each step
        values = [v for _, v in series]
        assert values == sorted(values) and [s for s, _ in series] == sorted(s for s, _ in series)
    assert [s for s, _ in scalars["probe/layer.a/value"]] == list(range(12))
    # Text tab: one readable Markdown entry per alert, a unique (tag, step) each; the clear under its condition
    texts = {tag.removesuffix("/text_summary"): items for tag, items in tb_texts(tb.log_dir).items()}
    entries = {(tag, step) for tag, items in texts.items() if tag.startswith("alerts/") for step, _ in items}
    assert entries == {("alerts/probe/hello", 2), ("alerts/probe/hello/2", 2), ("alerts/probe/high", 4),
                       ("alerts/probe/high", 6), ("alerts/probe/high", 8)}
    md = [t for tag, items in texts.items() if tag.startswith("alerts/probe") for _, t in items]
    assert len(md) == 5 and any("**CRITICAL**" in t and "high at 6" in t for t in md)
    assert "`layer.b`" in texts["alerts/probe/hello/2"][0][1]
    # CSV logger saw the same counts
    with open(os.path.join(csv.log_dir, "metrics.csv")) as fh:
        header = fh.readline().strip().split(",")
        rows = [dict(zip(header, line.strip().split(","))) for line in fh]
    critical = {int(r["step"]): float(r["alerts/count/critical"]) for r in rows if r.get("alerts/count/critical")}
    assert critical == expected["critical"]
    # Python logging, logger name lightning_monitor, with matching levels
    recs = [r for r in caplog.records if r.name == "lightning_monitor"]
    assert [r.levelno for r in recs] == [logging.INFO, logging.INFO, logging.WARNING, logging.CRITICAL, logging.INFO]


def test_alerts_jsonl_without_logger_goes_to_root_dir(tmp_path, tiny_gpt):
    probe = _Raiser(every_n_steps=2)
    _fit(tmp_path, False, [probe], tiny_gpt, steps=9)
    alerts = read_alerts(os.path.join(str(tmp_path), "alerts.jsonl"))
    assert [a.kind for a in alerts] == ["hello", "hello", "high", "high", "high_cleared"]


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


def test_runs_started_together_in_one_folder_each_find_it_writable(tmp_path, monkeypatch):
    # the check wrote and removed one fixed probe file: runs preparing one folder at once (a sweep's, tests run in
    # parallel) removed it under each other, and 57 of 1200 checks from 4 threads said the folder was not writable
    import threading
    from types import SimpleNamespace

    import lightning_monitor.alerts as alerts_module
    from lightning_monitor.alerts import AlertHub

    monkeypatch.setattr(alerts_module, "writes_files", lambda trainer: True)
    monkeypatch.setattr(alerts_module, "alerts_dir", lambda trainer: str(tmp_path))
    errors = []

    def prepare():
        for _ in range(300):
            try:
                AlertHub.__new__(AlertHub)._prepare_file(SimpleNamespace(global_rank=0))
            except OSError as err:
                errors.append(err)

    threads = [threading.Thread(target=prepare) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and [p.name for p in tmp_path.iterdir()] == []  # no probe file left behind


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


class _Actor(_Raiser):
    """_Raiser plus an action (GradES-like ``frozen`` info alert) at step 3."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        if trainer.global_step == 3:
            self.alert(3, "frozen", "info", "Froze layer.a.", layer="layer.a")


def test_console_shows_warnings_criticals_and_actions_once(tmp_path, tiny_gpt, capsys):
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()  # an application that did not configure logging
    try:
        _fit(tmp_path, False, [_Actor(every_n_steps=1)], tiny_gpt)
    finally:
        root.handlers[:] = saved
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lightning_monitor ")]
    # once per alert record: the onset and the escalation of the condition, not every step it holds;
    # neither the plain info one-offs nor the clear
    assert lines == [
        "lightning_monitor [info] probe/frozen [layer.a] @ step 3: Froze layer.a.",
        "lightning_monitor [warning] probe/high @ step 4: high at 4",
        "lightning_monitor [critical] probe/high @ step 6: high at 6",
    ]


def test_the_packages_other_warnings_reach_the_console_too(capsys):
    # the webhook's delivery failures are plain records of the package's logger: the console handler attached to it
    # kept Python's last-resort handler from printing them, and printed only alerts
    from lightning_monitor.alerts import log

    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        log.info("an info note")
        log.warning("AlertWebhook: 0 alert(s) posted, 1 failed")
    finally:
        root.handlers[:] = saved
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lightning_monitor ")]
    assert lines == ["lightning_monitor AlertWebhook: 0 alert(s) posted, 1 failed"]


def test_console_defers_to_configured_logging(tmp_path, tiny_gpt, capsys, caplog):
    # the root logger has handlers (here pytest's): the records reach them, nothing is printed twice
    with caplog.at_level(logging.INFO, logger="lightning_monitor"):
        _fit(tmp_path, False, [_Actor(every_n_steps=1)], tiny_gpt)
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("lightning_monitor ")]
    assert [r.getMessage() for r in caplog.records if r.name == "lightning_monitor"][2] == \
        "[info] probe/frozen [layer.a] @ step 3: Froze layer.a."


def test_each_fit_writes_its_own_alerts_file_with_its_run_id(tmp_path, tiny_gpt):
    runs = []
    for _ in range(2):  # the same command twice: version_0, version_1
        tb = TensorBoardLogger(str(tmp_path), name="tb")
        probe = _Raiser(every_n_steps=2)
        trainer = _fit(tmp_path, tb, [probe], tiny_gpt, steps=9)
        runs.append((tb.log_dir, probe.hub.run_id))
    assert runs[0][0] != runs[1][0] and runs[0][1] != runs[1][1]
    for log_dir, run_id in runs:
        alerts = read_alerts(os.path.join(log_dir, "alerts.jsonl"))
        assert len(alerts) == 5 and {a.run_id for a in alerts} == {run_id}
    # a further fit of the same trainer is a new run
    trainer.fit_loop.epoch_loop.max_steps = 11
    trainer.fit(*tiny_gpt())
    assert probe.hub.run_id not in (runs[0][1], runs[1][1])


def test_alerts_dir_is_the_runs_own_folder(tmp_path):
    from types import SimpleNamespace

    from lightning.pytorch.loggers import Logger

    from lightning_monitor.alerts import alerts_dir

    class Tracker(Logger):
        """Like MLFlowLogger: no log_dir; name = experiment id, version = run id; save_dir None when remote."""

        def __init__(self, save_dir):
            super().__init__()
            self._dir = save_dir

        name = property(lambda self: "7")
        version = property(lambda self: "f00d")
        save_dir = property(lambda self: self._dir)

        def log_metrics(self, metrics, step=None):
            pass

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    root = str(tmp_path)
    trainer = SimpleNamespace(loggers=[Tracker(os.path.join(root, "mlruns"))], default_root_dir=root)
    assert alerts_dir(trainer) == os.path.join(root, "mlruns", "7", "f00d")  # never the shared mlruns/
    trainer.loggers = [Tracker(None)]
    assert alerts_dir(trainer) == os.path.join(root, "7", "f00d")
    trainer.loggers = [TensorBoardLogger(root, name="tb", version=3)]
    assert alerts_dir(trainer) == os.path.join(root, "tb", "version_3")
    trainer.loggers = []
    assert alerts_dir(trainer) == root


def _line(step, kind="k", run_id="old", **kw):
    return json.dumps(Alert(step, "m", kind, "warning", f"at {step}", run_id=run_id, **kw).to_dict()) + "\n"


def test_read_alerts_skips_a_torn_last_line_and_names_a_bad_line(tmp_path):
    path = tmp_path / "alerts.jsonl"
    path.write_text(_line(1) + _line(2)[:25])
    assert [a.step for a in read_alerts(str(path))] == [1]
    path.write_text(_line(1) + _line(2).rstrip("\n"))  # complete, only the newline missing
    assert [a.step for a in read_alerts(str(path))] == [1, 2]
    path.write_text(_line(1)[:-2] + ',"added_later": 1}\n')  # a field of a newer version is ignored
    assert read_alerts(str(path))[0].run_id == "old"
    path.write_text("{oops\n" + _line(1))
    with pytest.raises(ValueError, match=r"alerts.jsonl:1: not valid JSON"):
        read_alerts(str(path))
    path.write_text(_line(1) + '{"step": 3}\n')
    with pytest.raises(ValueError, match=r"alerts.jsonl:2: not an alert record"):
        read_alerts(str(path))


def test_a_torn_last_record_is_repaired_when_the_next_run_opens_the_file(tmp_path):
    from lightning_monitor.alerts import _repair_tail

    path = tmp_path / "alerts.jsonl"
    path.write_text(_line(1) + _line(2)[:25])
    assert _repair_tail(str(path)) == len(_line(1)) and path.read_text() == _line(1)
    path.write_text(_line(1) + _line(2).rstrip("\n"))
    _repair_tail(str(path))
    assert path.read_text() == _line(1) + _line(2)


class _Rank0:
    global_rank = 0
    loggers: list = []


def test_resume_moves_the_records_after_the_checkpoint(tmp_path):
    from lightning_monitor.alerts import AlertHub

    path = tmp_path / "alerts.jsonl"
    before = _line(0, "hello") + _line(5)
    after = _line(10) + _line(12)
    setup_again = _line(0, "hello", run_id="new") + _line(0, "setup_only", run_id="new")
    trainer = _Rank0()

    def resume(state, step=10):
        path.write_text(before + after + setup_again)
        hub = AlertHub(trainer, run_id="new")
        hub.path = str(path)
        hub.resume(trainer, step, state)
        return hub, [(a.step, a.kind, a.run_id) for a in read_alerts(str(path))]

    kept = [(0, "hello", "old"), (5, "k", "old"), (0, "setup_only", "new")]
    # the checkpoint says where the file was when it was saved: what follows is replayed
    hub, records = resume({"path": str(path), "offset": len(before)})
    assert records == kept
    superseded = read_alerts(str(tmp_path / "alerts.superseded.jsonl"))
    assert [(a.step, a.run_id) for a in superseded] == [(10, "old"), (12, "old")]
    assert hub.counts == {"info": 0, "warning": 3, "critical": 0} and hub._offset == path.stat().st_size
    # a record kept is never written again by this run
    hub.emit(Alert(5, "m", "k", "warning", "again"))
    assert len(read_alerts(str(path))) == 3
    # a checkpoint without the hub's state: the other runs' records at steps >= the restored step move
    (tmp_path / "alerts.superseded.jsonl").unlink()
    _, records = resume(None)
    assert records == kept
    # a checkpoint of a run that wrote another file: this file is left alone
    _, records = resume({"path": str(tmp_path / "elsewhere" / "alerts.jsonl"), "offset": 3})
    assert len(records) == 6


class _Linear(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.lin(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 4)), batch_size=4)


class _RunIds(pl.Callback):
    """Every rank writes its hub's run id and the run ids its alerts were stamped with."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        from lightning_monitor import AlertHub

        hub = AlertHub.for_trainer(trainer)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as fh:
            json.dump({"run_id": hub.run_id, "stamped": [a.run_id for a in hub.history],
                       "severities": [a.severity for a in hub.history],
                       "counts": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("alerts/count/")}},
                      fh)


def test_ddp_ranks_share_one_run_id(tmp_path):
    from conftest import fit_ddp_spawn

    trainer = pl.Trainer(
        max_steps=9, accelerator="cpu", devices=2, strategy="ddp_spawn",
        callbacks=[_Raiser(every_n_steps=1), _RunIds(str(tmp_path))], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
    )
    fit_ddp_spawn(trainer, _Linear())
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    run_id = ranks[0]["run_id"]
    assert ranks[1]["run_id"] == run_id
    assert ranks[0]["stamped"] == ranks[1]["stamped"] == [run_id] * 5
    # the alert counts are callback metrics on both ranks (EarlyStopping can monitor them): each rank's own alerts
    expected = {f"alerts/count/{sev}": float(ranks[0]["severities"].count(sev)) for sev in ("info", "warning", "critical")}
    assert expected["alerts/count/critical"] >= 1
    assert ranks[0]["counts"] == ranks[1]["counts"] == expected
    assert {a.run_id for a in read_alerts(str(tmp_path / "alerts.jsonl"))} == {run_id}  # written by rank 0 only
    assert len(read_alerts(str(tmp_path / "alerts.jsonl"))) == 5


def test_fast_dev_run_writes_no_file_into_the_working_directory(tmp_path, monkeypatch, tiny_gpt) -> None:
    """Under ``fast_dev_run`` Lightning writes no logs and no checkpoints, and its logger has no folder: the alerts
    file (and GWA's suspects files) would land in the working directory. The alerts still reach Python logging."""
    import lightning_monitor as lm

    monkeypatch.chdir(tmp_path)
    module, loader = tiny_gpt()
    preset = lm.HealthMonitor(gwa={"index_fn": lambda batch: torch.arange(batch[0].shape[0])})
    trainer = pl.Trainer(accelerator="cpu", fast_dev_run=2, callbacks=[preset], enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, loader)
    assert os.listdir(tmp_path) == []
    hub = preset.monitors[0].hub
    assert hub.path is None and hub.history  # alerts were raised (GWA's cadence, at least), not written


class _DiskFills(pl.Callback):
    """From step 3 on, every write to the run's alerts.jsonl fails with ENOSPC (the file becomes a link to /dev/full),
    after the folder was found writable at setup."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 3:
            from lightning_monitor.alerts import AlertHub

            path = AlertHub.for_trainer(trainer).path
            os.replace(path, path + ".before")
            os.symlink("/dev/full", path)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_file_that_can_no_longer_be_written_does_not_end_the_fit(tmp_path, tiny_gpt, caplog):
    # the next alert ended the fit with the write's OSError (No space left on device)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    probe = _Raiser(every_n_steps=1)
    with caplog.at_level(logging.WARNING, logger="lightning_monitor"):
        trainer = _fit(tmp_path, [logger], [_DiskFills(), probe], tiny_gpt)
    assert trainer.global_step == 12 and trainer.state.status == "finished"
    said = [r.getMessage() for r in caplog.records if "can no longer be written" in r.getMessage()]
    assert len(said) == 1 and "No space left on device" in said[0] and "from step 4 on" in said[0]
    # every alert still reached the hub's history and the logger; the file holds those written before
    kinds = [(a.step, a.kind) for a in probe.hub.history]
    assert kinds[:2] == [(2, "hello"), (2, "hello")] and (4, "high") in kinds and (8, "high_cleared") in kinds
    assert [a.step for a in read_alerts(os.path.join(logger.log_dir, "alerts.jsonl.before"))] == [2, 2]
    assert tb_scalars(logger.log_dir)["alerts/count/critical"][-1][1] == 1.0


class _LastStep(Monitor):
    name = "probe"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == trainer.max_steps:  # after the last update (as GWA judges a last partial epoch)
            self.alert(trainer.global_step, "late", "info", "at the last step")


def test_the_counts_are_logged_once_at_the_last_step(tmp_path, tiny_gpt):
    # an alert at the fit's last step logged the counts at that step, and the end of training logged the same point
    # again: two rows in metrics.csv
    import csv

    logger = CSVLogger(str(tmp_path), name="csv")
    _fit(tmp_path, [logger], [_LastStep(every_n_steps=1)], tiny_gpt, steps=6)
    with open(os.path.join(logger.log_dir, "metrics.csv"), encoding="utf-8") as fh:
        rows = [(int(r["step"]), float(r["alerts/count/info"])) for r in csv.DictReader(fh) if r.get("alerts/count/info")]
    assert rows == [(0, 0.0), (5, 0.0), (6, 1.0)]


class _NanAt(pl.LightningModule):
    """A classifier whose loss is NaN on batch 5 of each epoch: the guard's critical ``nonfinite`` alert."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        return loss * float("nan") if batch_idx == 5 else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_early_stopping_can_monitor_the_alert_counts(tmp_path):
    """``alerts/count/<severity>`` are callback metrics from the start of training, as the README's table says, so
    ``EarlyStopping`` stops at the first critical alert (it raised 'not available' before)."""
    from lightning.pytorch.callbacks import EarlyStopping

    from lightning_monitor import DivergenceGuard

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(128, 8), torch.randint(0, 4, (128,)))
    stop = EarlyStopping(monitor="alerts/count/critical", mode="max", stopping_threshold=0.5,
                         check_on_train_epoch_end=True)
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = pl.Trainer(max_epochs=4, accelerator="cpu", logger=logger, callbacks=[DivergenceGuard(), stop],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(_NanAt(), torch.utils.data.DataLoader(data, batch_size=16))
    assert float(trainer.callback_metrics["alerts/count/critical"]) == 1.0
    assert trainer.current_epoch == 1  # stopped at the end of the first epoch, not after four
    assert stop.stopped_epoch == 0


"""`lightning-monitor report LOGDIR` on a real run's logs and on empty, partial and corrupt log directories."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_monitor import (
    Alert,
    DivergenceGuard,
    GradientNoiseScaleMonitor,
    GradientWeightAlignmentMonitor,
    SpectralAlignmentMonitor,
    read_alerts,
)
from lightning_monitor.report import RunReport, load_run, main, render_html, summarize


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A tiny GPT trained with four monitors until the guard stops it (a NaN loss at step 23): the log
    directory, the alerts the hub raised, and the run's own folder."""
    from gpt import GPTModule, make_loader

    root = str(tmp_path_factory.mktemp("logs"))
    pl.seed_everything(0)
    module = GPTModule({"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 32}, nan_at_step=23)
    loader = make_loader("prose", block_size=32, batch_size=8, n_samples=80)  # 10 steps per epoch: GWA scores
    guard = DivergenceGuard(action="stop", every_n_steps=10)
    callbacks = [SpectralAlignmentMonitor(every_n_steps=2), GradientNoiseScaleMonitor(every_n_steps=2),
                 GradientWeightAlignmentMonitor(every_n_steps=1), guard]
    logger = TensorBoardLogger(root, name="tiny")
    trainer = pl.Trainer(max_steps=60, accelerator="cpu", logger=logger, callbacks=callbacks, log_every_n_steps=1,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, loader)
    assert guard.stopped_step is not None
    return root, list(guard.hub.history), logger.log_dir


def _report(capsys, *args):
    rc = main(["report", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def test_report_on_a_real_run(real_run, capsys):
    root, history, run_dir = real_run
    rc, out, err = _report(capsys, root)
    assert rc == 0, err
    assert out.startswith(f"Run: {run_dir}\n")
    # every alert, in the order raised, and what fired first
    listed = re.findall(r"step +(\d+) +(info|warning|critical) +(\S+(?: \[[^\]]+\])?):", out)
    assert [(int(s), sev, name) for s, sev, name in listed] == [
        (a.step, a.severity, f"{a.monitor}/{a.kind}" + (f" [{a.layer}]" if a.layer else "")) for a in history]
    first = next(a for a in history if a.severity != "info")
    assert f"fired first (warning or critical): step {first.step} {first.monitor}/{first.kind}" in out
    counts = {sev: sum(a.severity == sev for a in history) for sev in ("critical", "warning", "info")}
    assert f"alerts: {len(history)} (" in out and f"{counts['critical']} critical" in out
    # the action taken, with the checkpoint path, and the signals
    stop = next(a for a in history if a.kind == "stopped")
    # why it stopped and what its checkpoint holds, from the alert's details
    assert (f"step {stop.step}: the guard stopped training ({stop.details['reasons']}); checkpoint "
            f"{stop.details['checkpoint']}, which holds {stop.details['holds']}") in out
    batch = r"batch size: 8 vs B_simple = [\d.]+ at step \d+: the batch is [\d.]+x (above|below) B_simple"
    assert re.search(batch, out)
    assert re.search(r"GWA: best epoch \d+ \(gwa/best_epoch at step \d+\); highest score in the selection window", out)
    assert re.search(r"train/loss: [\d.]+ \(step 0\) -> [\d.]+ \(step \d+\)", out)
    # one self-contained HTML page with the model-level signals, alerts marked
    page_path = os.path.join(run_dir, "health_report.html")
    assert f"figure: {page_path}" in out
    with open(page_path, encoding="utf-8") as fh:
        page = fh.read()
    assert page.count("<svg") >= 5
    for title in ("loss", "alerts: cumulative count per severity", "spectral alignment: sign diversity",
                  "gradient noise scale: B_simple vs batch size", "gradient-weight alignment: score"):
        assert f'font-weight="bold">{title}</text>' in page
    assert "<title>[critical] guard/nonfinite @ step 23" in page
    assert not re.search(r'(src|href)="', page)  # nothing loaded from elsewhere
    # --no-html, --html PATH
    rc, out, _ = _report(capsys, run_dir, "--no-html")
    assert rc == 0 and "figure:" not in out


def test_report_html_to_a_chosen_path(real_run, tmp_path, capsys):
    _, _, run_dir = real_run
    target = str(tmp_path / "page.html")
    rc, out, _ = _report(capsys, run_dir, "--html", target)
    assert rc == 0 and f"figure: {target}" in out and os.path.getsize(target) > 1000


def test_summary_of_frozen_components_and_rollbacks():
    run = RunReport("somewhere", scalars={"grades/frozen_fraction": [(10, 0.25), (20, 0.5)]}, alerts=[
        Alert(12, "grades", "frozen", "info", "Froze a.", layer="blocks.0.mlp"),
        Alert(18, "grades", "frozen", "info", "Froze b.", layer="blocks.1.mlp"),
        Alert(30, "guard", "loss_explosion", "critical", "Boom."),
        Alert(30, "guard", "rolled_back", "info", "Rolled back.", details={"to_step": 20, "skipped": 10}),
    ])
    text = summarize(run)
    assert "GradES: 2 frozen: blocks.0.mlp, blocks.1.mlp (frozen fraction 0.5 at step 20)" in text
    # a run resumed from a checkpoint: components frozen before its first step, whose alerts are the earlier run's
    resumed = summarize(RunReport("r", scalars={"grades/frozen_fraction": [(97, 0.25), (120, 0.25)]}, alerts=[]))
    assert "none frozen" not in resumed and "frozen before this log's first step" in resumed
    assert "frozen fraction 0.25 at step 120" in resumed
    assert "GradES: none frozen" in summarize(RunReport("n", scalars={"grades/frozen_fraction": [(5, 0.0)]}))
    # TensorBoard's hp_metric placeholder (step 0 of every fit) is no step of a resumed run
    assert "steps logged: 97 .. 120" in summarize(RunReport("r", scalars={
        "hp_metric": [(0, -1.0)], "grades/frozen_fraction": [(97, 0.25), (120, 0.25)]}))
    assert "step 12: GradES froze blocks.0.mlp" in text
    assert "step 30: the guard rolled back to the state of step 20 (10 batches skipped)" in text
    one = summarize(RunReport("x", alerts=[Alert(5, "guard", "rolled_back", "info", "Rolled back.",
                                                 details={"to_step": 4, "skipped": 1})]))
    assert "(1 batch skipped)" in one
    # GradES's stop in full: the share that stopped it is after a colon
    stop = Alert(40, "grades", "stop", "info", "4/12 components frozen and 8 converged but kept trainable: the "
                 "converged share of those counted, 1, is >= max_frozen_ratio=1; stopping training.")
    assert "max_frozen_ratio=1" in summarize(RunReport("x", alerts=[stop]))
    assert "fired first (warning or critical): step 30 guard/loss_explosion (critical)" in text
    page = render_html(run, text)
    assert "GradES: frozen fraction" in page and page.count("<svg") == 1


def test_missing_and_empty_directories(tmp_path, capsys):
    rc, out, err = _report(capsys, str(tmp_path / "nope"))
    assert rc == 2 and "does not exist" in err and not out
    (tmp_path / "a_file").write_text("x")
    rc, out, err = _report(capsys, str(tmp_path / "a_file"))
    assert rc == 2 and "is not a directory" in err and not out
    with pytest.raises(SystemExit):  # both page options: refused, not one silently ignored
        _report(capsys, str(tmp_path), "--html", str(tmp_path / "p.html"), "--no-html")
    (tmp_path / "a_file").unlink()
    rc, out, err = _report(capsys, str(tmp_path))
    assert rc == 2 and "no run under" in err


def test_corrupt_event_file(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.out.tfevents.1.host.1.0").write_bytes(bytes(range(256)) * 4)
    rc, out, err = _report(capsys, str(tmp_path))
    assert rc == 1
    assert "events.out.tfevents.1.host.1.0: corrupt, not a TensorBoard event record at byte 0" in err
    assert f"Run: {run}" in out


def test_a_folder_whose_alert_records_are_elsewhere_says_so(tmp_path, real_run, capsys):
    # CSVLogger listed before TensorBoardLogger: alerts.jsonl is in the CSV folder; the TensorBoard folder's report
    # said "alerts: none" and "actions taken: none" for a run the guard stopped
    _, history, run_dir = real_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "alerts.jsonl").unlink()
    rc, out, err = _report(capsys, str(tmp_path), "--no-html")
    critical = sum(a.severity == "critical" for a in history)
    assert f"alerts: {critical} critical, " in out and "but this folder has no alerts.jsonl" in out
    assert "actions taken: unknown (no alert records here)" in out and "alerts: none" not in out


def test_a_fit_resumed_from_an_earlier_step_supersedes_the_points_it_redoes(tmp_path):
    # a fit that crashed at step 9, resumed from its checkpoint of step 5 into the same folder: both files' points of
    # steps 5-9 were read, the lines went back in x and the lowest loss came from steps the resume undid
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    for stamp, steps, loss in ((1000, range(0, 10), lambda s: 1.0 / (s + 1) if s < 5 else 0.01),
                               (2000, range(5, 13), lambda s: 1.0 / (s + 1))):
        tmp = tmp_path / str(stamp)
        with SummaryWriter(str(tmp)) as writer:
            for step in steps:
                writer.add_scalar("train_loss", loss(step), step)
        run.mkdir(exist_ok=True)
        (next(tmp.iterdir())).rename(run / f"events.out.tfevents.{stamp}.host.1.0")
    report = load_run(str(run))
    assert [s for s, _ in report.scalars["train_loss"]] == list(range(13))
    assert min(v for _, v in report.scalars["train_loss"]) == pytest.approx(1.0 / 13)
    # steps 6-9 were undone; step 5, logged again by the resumed fit, is replaced
    assert any("4 scalar point(s) of an earlier fit were superseded" in n for n in report.notes)


def test_a_fit_resumed_from_its_last_checkpoint_keeps_what_was_logged_at_that_step(tmp_path):
    # resumed from the checkpoint of step 10 (an epoch's end), the later fit logs its alert counts at step 10 first:
    # every point of the earlier fit from step 10 on was cut, the epoch-end score of step 10 with them, and the note
    # spoke of a resume "from an earlier step"
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    files = ((1000, {"gwa/score": [(5, 0.3), (10, 0.5)], "alerts/count/info": [(0, 0.0), (10, 1.0)]}),
             (2000, {"alerts/count/info": [(10, 1.0)], "gwa/score": [(15, 0.4)]}))
    for stamp, tags in files:
        tmp = tmp_path / str(stamp)
        with SummaryWriter(str(tmp)) as writer:
            for tag, points in tags.items():
                for step, value in points:
                    writer.add_scalar(tag, value, step)
        run.mkdir(exist_ok=True)
        (next(tmp.iterdir())).rename(run / f"events.out.tfevents.{stamp}.host.1.0")
    report = load_run(str(run))
    assert report.scalars["gwa/score"] == [(5, pytest.approx(0.3)), (10, pytest.approx(0.5)), (15, pytest.approx(0.4))]
    assert [s for s, _ in report.scalars["alerts/count/info"]] == [0, 10]  # step 10 once: the later fit's
    assert report.restart is None and not any("superseded" in n for n in report.notes)


class _WarnAt(pl.Callback):
    """A warning through the hub at the given steps."""

    def __init__(self, steps):
        self.steps = steps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_monitor import Alert
        from lightning_monitor.alerts import AlertHub

        if trainer.global_step in self.steps:
            AlertHub.for_trainer(trainer).emit(Alert(trainer.global_step, "probe", f"at{trainer.global_step}",
                                                     "warning", "a warning"))


def test_a_fit_resumed_after_an_alert_at_its_setup_is_read_as_a_resume(tmp_path):
    # an alert raised at a resumed fit's setup (SA with nothing to watch on a model without hidden layers) had its
    # counts logged at step 0, before the checkpoint's step was back: the resume read as a fit started over, and the
    # earlier fit's points of steps 1-9 and its warning at step 3 were dropped ("fired first" named step 15)
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_monitor import HealthMonitor

    class Head(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 4)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    x = torch.randn(256, 8)
    data = DataLoader(TensorDataset(x, x[:, :4].argmax(-1)), batch_size=8)

    def fit(steps, warn_at, ckpt=None, checkpoints=()):
        monitor = HealthMonitor(noise_scale=False, gwa=False, dashboard=False, progress_bar=False)
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", log_every_n_steps=1, enable_progress_bar=False,
                             enable_model_summary=False, logger=TensorBoardLogger(str(tmp_path), name="run", version=0),
                             callbacks=[monitor, _WarnAt(warn_at), *checkpoints],
                             enable_checkpointing=bool(checkpoints))
        trainer.fit(Head(), data, ckpt_path=ckpt)
        return trainer

    every = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=5, save_top_k=-1, filename="{step}")
    fit(16, {3, 12}, checkpoints=[every])
    fit(20, {15}, ckpt=str(tmp_path / "ck" / "step=10.ckpt"))
    folder = str(tmp_path / "run" / "version_0")
    assert [(a.step, a.kind) for a in read_alerts(os.path.join(folder, "alerts.jsonl"))] == [
        (0, "nothing_to_watch"), (3, "at3"), (15, "at15")]
    report = load_run(folder)
    assert report.restart == 10 and [s for s, _ in report.scalars["train_loss"]] == list(range(20))
    assert "fired first (warning or critical): step 0 sa/nothing_to_watch" in summarize(report)
    assert [a.step for a in report.alerts if a.kind.startswith("at")] == [3, 15]


def test_a_record_with_a_field_of_the_wrong_type_is_skipped_and_the_rest_reported(tmp_path, real_run, capsys):
    # one record with `message: null` (or a step of 1e400, details as a string ...) passed the reading and failed the
    # summary later: only "Run: <path>" and "cannot be read" were printed
    _, history, run_dir = real_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("checkpoints", "*.html"))
    path = run / "alerts.jsonl"
    good = path.read_bytes()
    lineno = good.count(b"\n") + 1
    for bad in (b'{"step": 3, "monitor": "guard", "kind": "k", "severity": "warning", "message": null}',
                b'{"step": 1e400, "monitor": "guard", "kind": "k", "severity": "warning", "message": "m"}',
                b'{"step": 3, "monitor": "guard", "kind": "stopped", "severity": "info", "message": "m", '
                b'"details": "x"}',
                b'{"step": 3, "monitor": "grades", "kind": "frozen", "severity": "info", "message": "m", "layer": 7}',
                b'[1, 2]'):
        path.write_bytes(good + bad + b"\n")
        rc, out, err = _report(capsys, str(run))
        assert rc == 1 and f"alerts.jsonl line {lineno}: not an alert record (" in err, bad
        assert f"alerts: {len(history)} (" in out and "cannot be read" not in err, bad


def test_a_damaged_record_in_the_middle_is_a_problem(tmp_path, real_run, capsys):
    # a record whose data checksum fails: TensorBoard's reader stops there quietly, and the report summarised the
    # first half of the run with exit 0
    import struct

    _, _, run_dir = real_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    path = next(p for p in run.iterdir() if p.name.startswith("events.out.tfevents"))
    data = bytearray(path.read_bytes())
    pos = 0
    for _ in range(40):  # the 41st record
        pos += 16 + struct.unpack("<Q", data[pos:pos + 8])[0]
    data[pos + 14] ^= 0xFF  # a byte of its data
    path.write_bytes(bytes(data))
    rc, out, err = _report(capsys, str(tmp_path), "--no-html")
    assert rc == 1
    assert f"{path.name}: corrupt, record 40 at byte {pos} is damaged (data checksum mismatch)" in err


def test_empty_event_file_and_alerts_without_events(tmp_path, real_run, capsys):
    _, history, run_dir = real_run
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "events.out.tfevents.1.host.1.0").write_bytes(b"")
    (tmp_path / "b").mkdir()
    shutil.copy(os.path.join(run_dir, "alerts.jsonl"), tmp_path / "b" / "alerts.jsonl")
    rc, out, err = _report(capsys, str(tmp_path), "--no-html")
    assert rc == 1
    assert f"{tmp_path / 'a'}: the TensorBoard event files hold no scalar" in err
    assert f"{tmp_path / 'b'}: no TensorBoard event file or CSVLogger metrics.csv in this folder" in err
    assert f"alerts: {len(history)} (" in out  # what could be read is still reported


def test_corrupt_and_torn_alert_lines(tmp_path, real_run, capsys):
    _, history, run_dir = real_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("checkpoints", "*.html"))
    path = run / "alerts.jsonl"
    lines = path.read_bytes().split(b"\n")
    # a cut last line (a killed run) is a note, not an error
    path.write_bytes(b"\n".join(lines) + b'{"step": 40, "monitor": "gu')
    rc, out, err = _report(capsys, str(run), "--no-html")
    assert rc == 0 and "note: alerts.jsonl: the last line is incomplete" in out
    assert len(read_alerts(str(path))) == len(history)
    # a garbled line in the middle is an error; the other lines are still read
    path.write_bytes(b"\n".join([lines[0], b"{not json", *lines[1:]]))
    rc, out, err = _report(capsys, str(run), "--no-html")
    assert rc == 1 and "alerts.jsonl line 2: not an alert record (not valid JSON); skipped." in err
    assert f"alerts: {len(history)} (" in out
    path.write_bytes(b"\n".join([lines[0], b'{"step": 1}', *lines[1:]]))
    rc, out, err = _report(capsys, str(run), "--no-html")
    assert rc == 1 and "alerts.jsonl line 2: not an alert record" in err


def test_command_line_without_traceback(tmp_path):
    """The module runs as a command: a bad directory gives a message and exit status 2, no traceback."""
    out = subprocess.run([sys.executable, "-m", "lightning_monitor.report", "report", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "does not exist" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "lightning_monitor.report"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "report" in out.stderr


def test_a_csv_logger_run_is_reported_from_its_metrics_csv(tmp_path, capsys):
    """A run logged by a CSVLogger alone: every signal is in its ``metrics.csv`` (the report read event files only and
    said the run had no data, exit 1)."""
    from gpt import GPTModule, make_loader
    from lightning.pytorch.loggers import CSVLogger

    pl.seed_everything(0)
    module = GPTModule({"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 32})
    guard = DivergenceGuard(every_n_steps=5)
    logger = CSVLogger(str(tmp_path), name="csv")
    pl.Trainer(max_steps=30, accelerator="cpu", logger=logger, callbacks=[GradientNoiseScaleMonitor(every_n_steps=5),
                                                                         guard],
               log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False).fit(module, make_loader("prose", block_size=32, batch_size=8, n_samples=240))
    rc, out, err = _report(capsys, str(tmp_path), "--no-html")
    assert rc == 0, err
    assert out.startswith(f"Run: {logger.log_dir}\n") and "steps logged: 0 .. " in out
    assert "batch size: 8 vs B_simple" in out and re.search(r"train/loss: [\d.]+ \(step 0\) -> ", out), out
    report = load_run(logger.log_dir)
    assert [s for s, _ in report.scalars["gns/b_simple"]] == [0, 5, 10, 15, 20, 25]  # the checks, read back


def test_alerts_of_an_earlier_fit_in_the_same_folder_are_left_out(tmp_path, capsys):
    """Two fits from step 0 into one folder (a fixed ``version``): the scalars were the later fit's, the alerts and
    actions both fits', so a healthy run was reported rolled back. The earlier fit's alerts from the step the later fit
    started at are left out, with a note; a resumed fit (its event file starts later) keeps the earlier ones before
    it."""
    import json

    from torch.utils.tensorboard import SummaryWriter

    def fit(run, stamp, steps, alerts, run_id):
        tmp = tmp_path / f"w{stamp}"
        with SummaryWriter(str(tmp)) as writer:
            for step in steps:
                writer.add_scalar("train_loss", 1.0 / (step + 1), step)
        run.mkdir(exist_ok=True)
        next(tmp.iterdir()).rename(run / f"events.out.tfevents.{stamp}.host.1.0")
        with open(run / "alerts.jsonl", "a") as fh:
            for step, kind, severity in alerts:
                fh.write(json.dumps(Alert(step, "guard", kind, severity, f"{kind} at {step}", run_id=run_id).to_dict())
                         + "\n")

    again = tmp_path / "again"
    fit(again, 1000, range(0, 150), [(30, "partial_coverage", "warning"), (101, "rolled_back", "info")], "first")
    fit(again, 2000, range(0, 80), [(30, "partial_coverage", "warning")], "second")
    report = load_run(str(again))
    assert [(a.step, a.run_id) for a in report.alerts] == [(30, "second")]
    assert any("2 alert(s) of earlier fits in this folder (run ids first) at steps >= 0" in n for n in report.notes)
    assert "rolled back" not in summarize(report)
    resumed = tmp_path / "resumed"
    fit(resumed, 1000, range(0, 60), [(30, "partial_coverage", "warning"), (55, "loss_creep", "warning")], "first")
    fit(resumed, 2000, range(50, 80), [(70, "loss_creep", "warning")], "second")
    assert [(a.step, a.run_id) for a in load_run(str(resumed)).alerts] == [(30, "first"), (70, "second")]


def test_a_reader_that_goes_away_ends_the_report_quietly(real_run):
    """``lightning-monitor report DIR | head -1``: the report ended in a BrokenPipeError traceback."""
    root, _, _ = real_run
    out = subprocess.run(f"{sys.executable} -m lightning_monitor.report report {root} --no-html | head -c 5",
                         shell=True, capture_output=True, text=True, timeout=120)
    assert out.stdout == "Run: " and "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


def test_few_noise_scale_checks_and_an_abandoned_fits_alerts_are_said(tmp_path):
    (tmp_path / "alerts.jsonl").write_text("")
    (tmp_path / "alerts.superseded.jsonl").write_text('{"step": 40}\n{"step": 41}\n')
    run = load_run(str(tmp_path))
    assert any("2 alert(s) of a fit abandoned after its checkpoint" in n and "alerts.superseded.jsonl" in n
               for n in run.notes)
    few = RunReport("x", scalars={"gns/b_simple": [(0, 290.0)], "gns/batch_size": [(0, 8.0)]})
    assert "(from 1 check only: not settled)" in summarize(few)
    many = RunReport("x", scalars={"gns/b_simple": [(s, 290.0) for s in range(5)], "gns/batch_size": [(4, 8.0)]})
    assert "not settled" not in summarize(many)


def test_folders_that_cannot_be_listed_are_said_and_make_the_report_partial(tmp_path, real_run, capsys, monkeypatch):
    """A folder the reader may not list (permissions) was skipped by the walk without a word: a run under it was left
    out with exit 0, and a run folder that could not be read itself was said to hold "no run". (Simulated: the tests
    may run as root, whom permissions do not stop.)"""
    _, _, run_dir = real_run
    shutil.copytree(run_dir, tmp_path / "readable")
    shutil.copytree(run_dir, tmp_path / "locked" / "run")
    listing = os.scandir

    def scandir(path="."):
        if os.path.basename(os.fspath(path)) == "locked":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return listing(path)

    monkeypatch.setattr(os, "scandir", scandir)
    rc, out, err = _report(capsys, str(tmp_path), "--no-html")
    assert rc == 1
    assert f"Run: {tmp_path / 'readable'}" in out and "locked" not in out
    assert f"{tmp_path / 'locked'}: cannot be read (Permission denied); a run in it is not reported." in err
    rc, out, err = _report(capsys, str(tmp_path / "locked"), "--no-html")
    assert rc == 1 and "cannot be read (Permission denied)" in err and "no run under" not in err


def test_a_last_fit_without_alerts_is_not_given_an_earlier_fits(tmp_path, capsys):
    """Two Trainers write one folder (a fixed ``version``): the first rolls back at step 61, the second (a healthy
    40 steps) raises nothing. The second fit's run id, written to its event file, says the records are the first fit's:
    the report says "alerts: none" with a note (it gave the second fit the first one's rollback at a step it never
    reached); the second fit's alert counts continue from the file's records, so the counts logged add up to it."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_monitor.alerts import RUN_ID_TAG

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=g)
    y = (x @ torch.randn(32, 10, generator=g)).argmax(1)

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 60 else 100.0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def fit(steps):
        pl.seed_everything(0, verbose=False)
        guard = DivergenceGuard()
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=TensorBoardLogger(str(tmp_path), "fixed", 0),
                             callbacks=[guard], enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, log_every_n_steps=5)
        trainer.fit(Net(), DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
        return guard, trainer.logger.log_dir

    first, run_dir = fit(120)
    assert first.rollbacks
    second, _ = fit(40)
    assert not second.hub.history
    records = read_alerts(os.path.join(run_dir, "alerts.jsonl"))
    assert records and {r.run_id for r in records} == {first.hub.run_id}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # written in this order (one process numbers its writers: ".9" then ".10")
    last = max((f for f in os.listdir(run_dir) if f.startswith("events")),
               key=lambda f: (f.split(".")[3], int(f.split(".")[-1])))
    acc = EventAccumulator(os.path.join(run_dir, last), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    written = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(RUN_ID_TAG + "/text_summary")]
    assert written == [second.hub.run_id]
    report = load_run(run_dir)
    assert report.last_run_id == second.hub.run_id and report.alerts == []
    summary = summarize(report)
    assert "alerts: none" in summary and "actions taken: none" in summary and "rolled back" not in summary
    assert any(f"{len(records)} alert(s) of earlier fits" in n for n in report.notes)
    # the second fit's counts start from the file's records and end there (0 raised)
    total = [sum(acc.Scalars(f"alerts/count/{sev}")[i].value for sev in ("info", "warning", "critical"))
             for i in (0, -1)]
    assert total == [len(records), len(records)]


def test_event_files_of_one_process_in_one_second_are_read_in_the_order_written(tmp_path):
    """A process numbers its TensorBoard writers: within one second, writer 10 was written after writer 9 (read in
    the order of their names, 10 came first and the earlier fit's points were taken for the later one's)."""
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    run.mkdir()
    for number, steps, value in ((9, range(0, 120), 1.0), (10, range(0, 40), 2.0)):
        tmp = tmp_path / f"w{number}"
        with SummaryWriter(str(tmp)) as writer:
            for step in steps:
                writer.add_scalar("train_loss", value, step)
        next(tmp.iterdir()).rename(run / f"events.out.tfevents.1700000000.host.name.77.{number}")
    report = load_run(str(run))
    assert report.restart == 0
    assert report.scalars["train_loss"] == [(step, 2.0) for step in range(40)]

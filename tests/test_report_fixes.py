"""`lightning-monitor report` on a resume of a module with hyperparameters, on GradES components released by the run,
and on alert records whose `details` hold fields of an unexpected type."""

from __future__ import annotations

import io
import json
import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_monitor import Alert, read_alerts
from lightning_monitor import report as report_module
from lightning_monitor.report import RunReport, load_run, report, summarize


class _WarnAt(pl.Callback):
    """A warning through the hub at the given steps, and one at the end of the batch that completes step 10 (before
    ModelCheckpoint saves that step, as an epoch-end alert is) when ``at_10`` is set."""

    def __init__(self, steps: set[int], at_10: bool = False) -> None:
        self.steps, self.at_10 = steps, at_10

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_monitor.alerts import AlertHub

        if trainer.global_step in self.steps:
            AlertHub.for_trainer(trainer).emit(Alert(trainer.global_step, "probe", f"at{trainer.global_step}",
                                                     "warning", "a warning"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lightning_monitor.alerts import AlertHub

        if self.at_10 and trainer.global_step == 10:
            AlertHub.for_trainer(trainer).emit(Alert(10, "probe", "at10_end", "warning", "a warning"))


class _Head(pl.LightningModule):
    def __init__(self, lr: float = 0.1, hparams: bool = True) -> None:
        super().__init__()
        if hparams:
            # TensorBoardLogger then writes its `hp_metric` placeholder at step 0 of every fit, the resumed one too
            self.save_hyperparameters()
        self.lr = lr
        self.net = torch.nn.Linear(8, 4)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@pytest.mark.parametrize("hparams", [True, False])
def test_a_resume_in_the_same_folder_keeps_the_earlier_fits_points_and_alerts(tmp_path, hparams):
    # with save_hyperparameters(), the resumed fit's event file starts with `hp_metric` at step 0: the resume was read
    # as a fit started over at step 0, the earlier fit's points of steps 1-9 and its alerts were dropped; without it,
    # the earlier fit's alert at the checkpoint's step (raised before the checkpoint, kept by the hub) was dropped
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_monitor import HealthMonitor

    torch.manual_seed(0)
    x = torch.randn(256, 8)
    data = DataLoader(TensorDataset(x, x[:, :4].argmax(-1)), batch_size=8)

    def fit(steps, warn_at, ckpt=None, checkpoints=()):
        monitor = HealthMonitor(noise_scale=False, gwa=False, dashboard=False, progress_bar=False)
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", log_every_n_steps=1, enable_progress_bar=False,
                             enable_model_summary=False, logger=TensorBoardLogger(str(tmp_path), name="run", version=0),
                             callbacks=[monitor, _WarnAt(warn_at, at_10=not ckpt), *checkpoints],
                             enable_checkpointing=bool(checkpoints))
        trainer.fit(_Head(hparams=hparams), data, ckpt_path=ckpt)

    every = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=5, save_top_k=-1, filename="{step}")
    fit(16, {3, 12}, checkpoints=[every])
    fit(20, {15}, ckpt=str(tmp_path / "ck" / "step=10.ckpt"))
    folder = str(tmp_path / "run" / "version_0")
    kept = [(a.step, a.kind) for a in read_alerts(os.path.join(folder, "alerts.jsonl"))]
    assert kept == [(0, "nothing_to_watch"), (3, "at3"), (10, "at10_end"), (15, "at15")]
    run = load_run(folder)
    assert run.restart == 10
    assert [s for s, _ in run.scalars["train_loss"]] == list(range(20))
    assert [(a.step, a.kind) for a in run.alerts] == kept  # every record the hub kept
    text = summarize(run)
    assert "fired first (warning or critical): step 0 sa/nothing_to_watch" in text
    assert "alert(s) of earlier fits" not in text and "started again at steps >= 0" not in text


def test_an_earlier_fits_alert_at_the_restart_step_stays_unless_the_last_fit_raised_it_again():
    # the step the last fit started from is a checkpoint's: what the earlier fit raised there came before it
    alerts = [Alert(3, "probe", "a", "warning", "m", run_id="A"), Alert(10, "probe", "b", "warning", "m", run_id="A"),
              Alert(10, "probe", "c", "warning", "m", run_id="A"), Alert(12, "probe", "d", "warning", "m", run_id="A"),
              Alert(10, "probe", "c", "warning", "m", run_id="B"), Alert(15, "probe", "e", "warning", "m", run_id="B")]
    run = RunReport("r", alerts=list(alerts), event_files=["e"], restart=10, last_run_id="B")
    report_module._drop_superseded_alerts(run)
    assert [(a.step, a.kind, a.run_id) for a in run.alerts] == [
        (3, "a", "A"), (10, "b", "A"), (10, "c", "B"), (15, "e", "B")]
    assert any("2 alert(s) of earlier fits" in n for n in run.notes)  # A's `c` at 10 (raised again) and `d` at 12


def _write_run(folder, records: list[dict], scalars: dict[str, list[tuple[int, float]]]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(folder)) as writer:
        for tag, points in scalars.items():
            for step, value in points:
                writer.add_scalar(tag, value, step)
    with open(os.path.join(folder, "alerts.jsonl"), "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)


def _run_report(folder) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = report(str(folder), write_html=False, out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def _grades(kind: str, step: int, **extra) -> dict:
    return dict(step=step, monitor="grades", kind=kind, severity="info", message=f"{kind}.", **extra)


def test_components_released_by_the_run_are_not_listed_as_frozen(tmp_path):
    # GradES's `released` alert names the components in its details: they were listed as frozen to the end
    fraction = {"grades/frozen_fraction": [(8, 1 / 3), (10, 2 / 3), (12, 1.0), (24, 1 / 3)]}
    records = [_grades("frozen", 8, layer="a"), _grades("frozen", 10, layer="c"), _grades("frozen", 12, layer="b"),
               _grades("released", 24, details={"components": ["a", "c"]})]
    _write_run(tmp_path, records, fraction)
    rc, out, err = _run_report(tmp_path)
    assert rc == 0, err
    assert ("GradES: 1 frozen: b; 2 released (unfrozen by the run, left to train): a, c (frozen fraction 0.3333 at "
            "step 24)") in out
    # all released: none frozen
    every = records[:3] + [_grades("released", 24, details={"components": ["a", "b", "c"]})]
    text = summarize(RunReport("r", scalars={"grades/frozen_fraction": [(24, 0.0)]},
                               alerts=[Alert.from_dict(r) for r in every]))
    assert "GradES: none frozen; 3 released (unfrozen by the run, left to train): a, b, c (frozen fraction 0 at " \
           "step 24)" in text
    # a `released` record that names no components (an older version's): the frozen list is said to be uncertain
    old = summarize(RunReport("r", alerts=[Alert.from_dict(r) for r in records[:3] + [_grades("released", 24)]]))
    assert "GradES: 3 frozen: a, c, b; some of them may have been released since" in old


def test_a_fit_that_unfreezes_what_grades_froze_is_reported_with_those_components_released(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_monitor import GradientEarlyStopping

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.cross_entropy(self.c(torch.relu(self.b(torch.relu(self.a(batch[0]))))), batch[1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Unfreeze(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 24:
                pl_module.requires_grad_(True)

    torch.manual_seed(0)
    x = torch.randn(512, 8)
    data = DataLoader(TensorDataset(x, x[:, :4].argmax(-1)), batch_size=16)
    grades = GradientEarlyStopping(tau=3.0, grace_steps=4, every_n_steps=2, stop=False, min_loss_progress=None,
                                   reference_checks=1, include=["a", "b", "c"])
    trainer = pl.Trainer(max_steps=40, accelerator="cpu", log_every_n_steps=1, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         logger=TensorBoardLogger(str(tmp_path), name="run"), callbacks=[grades, Unfreeze()])
    trainer.fit(MLP(), data)
    assert grades.released and not grades.frozen  # the run unfroze all it froze
    line = next(ln for ln in summarize(load_run(trainer.logger.log_dir)).splitlines() if "GradES:" in ln)
    released = ", ".join(grades.released)
    assert line.startswith(f"  GradES: none frozen; {len(grades.released)} released (unfrozen by the run, left to "
                           f"train): {released} (frozen fraction 0 at step "), line


@pytest.mark.parametrize("details", [
    {"reasons": ["loss spike"], "checkpoint": "x.ckpt", "holds": "the weights of step 4."},
    {"reasons": "Loss spike. Lower the lr.", "checkpoint": "x.ckpt", "holds": {"step": 4}},
    {"reasons": 7, "checkpoint": "x.ckpt", "holds": None},
])
def test_a_record_with_odd_details_costs_only_its_own_line(tmp_path, details):
    # `details` is only checked to be an object: a list where the guard writes text lost the whole run's summary
    good = dict(step=3, monitor="guard", kind="loss_spike", severity="warning", message="Loss spike. Lower the lr.")
    odd = dict(step=5, monitor="guard", kind="stopped", severity="info", message="Training stopped.", details=details)
    _write_run(tmp_path, [good, odd], {"train/loss": [(s, 1.0 / (s + 1)) for s in range(10)]})
    rc, out, err = _run_report(tmp_path)
    assert rc == 0 and "cannot be read" not in out + err, err
    assert "alerts: 2 (1 warning, 1 info)" in out and "train/loss: 1 (step 0) -> 0.1 (step 9)" in out
    # the strings are used, the rest left out
    why = " (Loss spike)" if isinstance(details["reasons"], str) else ""
    holds = ", which holds the weights of step 4" if isinstance(details["holds"], str) else ""
    assert f"    step 5: the guard stopped training{why}; checkpoint x.ckpt{holds}\n" in out


def test_an_action_that_cannot_be_read_costs_only_its_line(monkeypatch):
    # whatever else a record's details hold that the action line cannot use, the rest of the summary stays
    real = report_module._action

    def failing(alert: Alert):
        if alert.kind == "rolled_back":
            raise TypeError("odd details")
        return real(alert)

    monkeypatch.setattr(report_module, "_action", failing)
    run = RunReport("r", scalars={"train/loss": [(0, 1.0), (9, 0.5)]}, alerts=[
        Alert(4, "guard", "rolled_back", "info", "Rolled back.", details={"to_step": [2]}),
        Alert(6, "grades", "frozen", "info", "Froze a.", layer="a")])
    text = summarize(run)
    assert "    step 4: guard/rolled_back (its details cannot be read: TypeError)" in text
    assert "    step 6: GradES froze a" in text and "train/loss: 1 (step 0) -> 0.5 (step 9)" in text

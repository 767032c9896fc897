"""The cumulative `alerts/count/*` series of a further `fit` of the same Trainer without a checkpoint: it writes the
same `alerts.jsonl` (the same logger folder) as the first fit, and its counts continue from the first fit's, as they
do after `fit(ckpt_path=...)`, instead of restarting at 0."""

from __future__ import annotations

import os

import lightning.pytorch as pl
from conftest import tb_scalars
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_monitor import Monitor, read_alerts


class _OnceAt(Monitor):
    """One warning at step 3 (of the first fit only), nothing else."""

    name = "probe"

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 3:
            self.alert(3, "odd", "warning", "once")


def test_a_second_fit_of_the_same_trainer_continues_the_counts_of_its_alerts_file(tmp_path, tiny_gpt):
    module, loader = tiny_gpt()
    tb, csv = TensorBoardLogger(str(tmp_path), name="tb"), CSVLogger(str(tmp_path), name="csv")
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=[tb, csv], callbacks=[_OnceAt()],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, loader)
    trainer.fit_loop.epoch_loop.max_steps = 10
    trainer.fit(module, loader)  # no checkpoint: a new run id, the same folder and alerts.jsonl
    alerts = read_alerts(os.path.join(tb.log_dir, "alerts.jsonl"))
    assert [(a.step, a.kind) for a in alerts] == [(3, "odd")] and trainer.global_step == 10
    warnings = tb_scalars(tb.log_dir)["alerts/count/warning"]
    # the staircase up at step 3, then 1 to the end of the second fit (at its start, step 6, and its end, step 10)
    assert warnings == [(0, 0.0), (2, 0.0), (3, 1.0), (6, 1.0), (6, 1.0), (10, 1.0)]
    with open(os.path.join(csv.log_dir, "metrics.csv")) as fh:
        lines = fh.read().splitlines()
    column = lines[0].split(",").index("alerts/count/warning")
    assert [float(row.split(",")[column]) for row in lines[1:] if row.split(",")[column]][-1] == len(alerts)


class _At4And6(Monitor):
    name = "probe"

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step in (4, 6):
            self.alert(trainer.global_step, "odd", "warning", "x")


def test_a_second_fit_from_an_earlier_checkpoint_replays_the_counts_at_their_steps(tmp_path, tiny_gpt):
    """The same Trainer fitted to step 8, then again from its checkpoint of step 3: the replayed steps log their counts
    at their own steps (the first fit's last logged step, carried over, pushed the whole replay to step 8)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    module, loader = tiny_gpt()
    tb = TensorBoardLogger(str(tmp_path), name="tb")
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", logger=tb, callbacks=[_At4And6(), ckpt],
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    trainer.fit(module, loader, ckpt_path=str(tmp_path / "ck" / "step=3.ckpt"))
    assert [(a.step, a.kind) for a in read_alerts(os.path.join(tb.log_dir, "alerts.jsonl"))] == [(4, "odd"), (6, "odd")]
    warnings = tb_scalars(tb.log_dir)["alerts/count/warning"]
    replay = warnings[warnings.index((8, 2.0)) + 1:]
    assert [s for s, _ in replay if s < 8] == [3, 4, 5, 6] and replay[-1] == (8, 2.0)


def test_a_second_fit_from_an_earlier_checkpoint_without_any_alert_logs_its_counts_at_its_steps(tmp_path, tiny_gpt):
    """No alert at all (no alerts.jsonl): the replay's counts were logged at the first fit's last step."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    module, loader = tiny_gpt()
    tb = TensorBoardLogger(str(tmp_path), name="tb")
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", logger=tb, callbacks=[Monitor(every_n_steps=100), ckpt],
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    trainer.fit(module, loader, ckpt_path=str(tmp_path / "ck" / "step=3.ckpt"))
    assert not os.path.exists(os.path.join(tb.log_dir, "alerts.jsonl"))
    warnings = tb_scalars(tb.log_dir)["alerts/count/warning"]
    first_end = warnings.index((8, 0.0))
    assert warnings[first_end + 1][0] == 3  # the replay starts at its checkpoint's step


def test_a_new_trainer_in_the_same_folder_continues_the_counts_of_its_alerts_file(tmp_path, tiny_gpt):
    """Another Trainer writing the same folder (a fixed `version`): its counts start from the records the file holds
    (they restarted at 0, and the folder's counts no longer added up to its file); a record written by other code with
    a severity that is no string is not counted, and does not stop the fit (it did, at setup)."""
    import json

    module, loader = tiny_gpt()
    folder = tmp_path / "tb" / "version_0"
    folder.mkdir(parents=True)
    records = [{"step": 1, "monitor": "guard", "kind": "k1", "severity": "critical", "message": "m", "run_id": "old"},
               {"step": 2, "monitor": "guard", "kind": "k2", "severity": ["warning"], "message": "m"},
               {"step": 3, "monitor": "guard", "kind": "k3", "severity": "warning", "message": "m", "run_id": "old"}]
    (folder / "alerts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=TensorBoardLogger(str(tmp_path), name="tb", version=0),
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[Monitor()])
    trainer.fit(module, loader)
    scalars = tb_scalars(str(folder))
    assert scalars["alerts/count/critical"][0] == (0, 1.0) and scalars["alerts/count/warning"][0] == (0, 1.0)
    assert scalars["alerts/count/info"][-1][1] == 0.0


class _RaisesOnceAt(Monitor):
    """A warning at step 2 of every fit; the first fit then raises at step 4."""

    name = "probe"
    raised = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step in (2, 7):
            self.alert(trainer.global_step, "odd", "warning", "x")
        if trainer.global_step == 4 and not self.raised:
            self.raised = True
            raise RuntimeError("the step failed")


def test_a_fit_after_a_failed_fit_of_the_same_trainer_gets_a_run_id_of_its_own(tmp_path, tiny_gpt):
    # Lightning calls no callback's `teardown` when a fit raises: the hub did not see the fit end, and the next fit of
    # the same Trainer wrote its alerts under the failed fit's run id (the report could not tell the two apart)
    module, loader = tiny_gpt()
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=TensorBoardLogger(str(tmp_path), name="tb"),
                         callbacks=[_RaisesOnceAt()], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    try:
        trainer.fit(module, loader)
    except RuntimeError:
        pass
    trainer.fit_loop.epoch_loop.max_steps = 10
    trainer.fit(module, loader)
    alerts = read_alerts(os.path.join(trainer.logger.log_dir, "alerts.jsonl"))
    assert [(a.step, a.kind) for a in alerts] == [(2, "odd"), (7, "odd")]
    assert alerts[0].run_id and alerts[1].run_id and alerts[0].run_id != alerts[1].run_id

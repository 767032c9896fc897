"""alerts.jsonl survives a SIGKILL and a resume from the last checkpoint: every line parses, and no alert
is recorded twice or lost for a step."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_monitor import Monitor, read_alerts

TESTS = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(TESTS), "examples")
EVERY = 5  # checkpoint every EVERY optimizer steps


class Ticker(Monitor):
    """Deterministic alerts: ``hello`` at setup, ``tick`` every third step, and a ``band`` condition on
    steps 8..17 (its state travels in the checkpoint); ``delay`` slows each step down."""

    name = "tick"

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(every_n_steps=1)
        self.delay = delay

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        self.alert(trainer.global_step, "hello", "info", "set up")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        step = trainer.global_step
        if step % 3 == 0:
            self.alert(step, "tick", "warning", f"tick {step}")
        self.condition(step, "band", 8 <= step < 18, "warning", f"band at {step}")
        if self.delay:
            time.sleep(self.delay)


def build(root: str, max_steps: int, delay: float = 0.0):
    """The trainer, module and loader of the run, the same in the killed and in the resumed process."""
    from gpt import GPTModule, make_loader

    pl.seed_everything(0, verbose=False)
    config = {"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 32}
    module = GPTModule(config)
    loader = make_loader("prose", block_size=32, batch_size=8, n_samples=2048)
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
        logger=TensorBoardLogger(root, name="run", version=0),  # the resumed run writes the same folder
        callbacks=[Ticker(delay), ModelCheckpoint(dirpath=os.path.join(root, "ck"), every_n_train_steps=EVERY,
                                                  save_top_k=-1)],
    )
    return trainer, module, loader


CHILD = """
import sys
sys.path[:0] = [{tests!r}, {examples!r}]
from test_resume_alerts import build
trainer, module, loader = build({root!r}, max_steps=400, delay=0.05)
trainer.fit(module, loader)
"""


def _checkpoints(root: str) -> list[tuple[int, str]]:
    out = []
    for path in glob.glob(os.path.join(root, "ck", "*.ckpt")):
        match = re.search(r"step=(\d+)", os.path.basename(path))
        if match:
            out.append((int(match.group(1)), path))
    return sorted(out)


def _steps_written(path: str) -> list[int]:
    try:
        with open(path, "rb") as fh:
            lines = fh.read().split(b"\n")[:-1]  # complete lines only
    except FileNotFoundError:
        return []
    return [json.loads(line)["step"] for line in lines if line.strip()]


def test_sigkill_then_resume_keeps_alerts_jsonl_whole_and_without_duplicates(tmp_path, caplog):
    root = str(tmp_path)
    path = os.path.join(root, "run", "version_0", "alerts.jsonl")
    code = CHILD.format(tests=TESTS, examples=EXAMPLES, root=root)
    child = subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    # kill it once a checkpoint at step >= 10 exists and alerts were written at steps after it
    deadline = time.monotonic() + 240
    try:
        while True:
            assert child.poll() is None, child.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the child never got far enough"
            ckpts = _checkpoints(root)
            steps = _steps_written(path)
            if ckpts and ckpts[-1][0] >= 10 and steps and max(steps) >= ckpts[-1][0] + 2:
                break
            time.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL

    # a kill while writing leaves an incomplete last line: read_alerts skips it
    with open(path, "ab") as fh:
        fh.write(b'{"step": 999, "monitor": "tick", "ki')
    killed = read_alerts(path)
    assert killed and all(a.step != 999 for a in killed)

    # resume from the last checkpoint that loads (a kill may have cut the newest one short)
    for ckpt_step, ckpt in reversed(_checkpoints(root)):
        try:
            restored_step = torch.load(ckpt, weights_only=False, map_location="cpu")["global_step"]
            break
        except Exception:
            continue
    assert restored_step == ckpt_step
    replayed = [a for a in killed if a.step >= restored_step and a.kind != "hello"]
    assert replayed, "the killed run wrote no alert after its checkpoint: nothing to replay"

    trainer, module, loader = build(root, max_steps=30)
    with caplog.at_level(logging.INFO, logger="lightning_monitor"):
        trainer.fit(module, loader, ckpt_path=ckpt)
    assert trainer.global_step == 30

    # every line parses, the incomplete one is gone
    with open(path, "rb") as fh:
        data = fh.read()
    assert data.endswith(b"\n")
    records = [json.loads(line) for line in data.split(b"\n") if line.strip()]
    assert len(records) == len(read_alerts(path))
    assert any("incomplete record" in r.getMessage() for r in caplog.records)

    # no alert twice, none lost: hello once, every third step, the band's onset and its clear
    keys = [(r["step"], r["monitor"], r["kind"], r["layer"]) for r in records]
    assert len(keys) == len(set(keys))
    expected = {(0, "tick", "hello", None), (8, "tick", "band", None), (18, "tick", "band_cleared", None)}
    expected |= {(s, "tick", "tick", None) for s in range(0, 30, 3)}
    assert set(keys) == expected
    assert [r["step"] for r in records] == sorted(r["step"] for r in records)

    # the killed run's records after its checkpoint moved aside; the replay wrote its own, with its run id
    first_id = killed[0].run_id
    resumed_id = trainer.callbacks[0].hub.run_id
    assert first_id != resumed_id
    assert all(r["run_id"] == (first_id if r["step"] < restored_step else resumed_id) for r in records)
    superseded = read_alerts(os.path.join(root, "run", "version_0", "alerts.superseded.jsonl"))
    assert {a.key for a in superseded} == {a.key for a in replayed}
    assert all(a.run_id == first_id for a in superseded)

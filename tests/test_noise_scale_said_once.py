"""The noise-scale monitor says each of its one-time conditions once per run: a run resumed from a checkpoint does not
say again what the interrupted run said (the parameters left out of the estimate, the estimate turning partial),
and a check that falls on an epoch's short last batch of one example skips quietly instead of telling the user
to raise a batch size of 32."""

from __future__ import annotations

import os
from typing import Optional

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from gpt import GPTModule, make_loader
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientNoiseScaleMonitor, read_alerts


def _gpt_fit(root: str, name: str, max_epochs: int, ckpt_path: Optional[str] = None) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    module = GPTModule({"n_layer": 2, "n_head": 4, "d_model": 64, "block_size": 32}, lr=3e-3)
    loader = make_loader("prose", block_size=32, batch_size=16, n_samples=256, shuffle=False)  # 16 steps an epoch
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=max_epochs, logger=CSVLogger(root, name=name, version=0),
        callbacks=[GradientNoiseScaleMonitor(every_n_steps=4),
                   ModelCheckpoint(dirpath=os.path.join(root, name, "ck"), save_top_k=-1)],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    )
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


def _alerts(root: str, name: str) -> list[tuple[int, str, str]]:
    return sorted((a.step, a.kind, a.severity) for a in read_alerts(os.path.join(root, name, "version_0", "alerts.jsonl")))


def test_a_resumed_run_does_not_say_its_coverage_again(tmp_path) -> None:
    root = str(tmp_path)
    _gpt_fit(root, "straight", 4)
    straight = _alerts(root, "straight")
    # the demo GPT's position embedding is used outside a hooked module: named once, and the estimate turns partial
    assert [k for _, k, _ in straight].count("partial_coverage") >= 1
    _gpt_fit(root, "resumed", 2)
    _gpt_fit(root, "resumed", 4, ckpt_path=os.path.join(root, "resumed", "ck", "epoch=1-step=32.ckpt"))
    assert _alerts(root, "resumed") == straight


class _MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _mlp_fit(root: str, n: int, batch_size: int, every: int, epochs: int) -> tuple[GradientNoiseScaleMonitor, str]:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :3] + 0.3 * torch.randn(n, 3, generator=g)).argmax(1)
    mon = GradientNoiseScaleMonitor(every_n_steps=every)
    logger = CSVLogger(root, name="mlp", version=0)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, logger=logger, callbacks=[mon], log_every_n_steps=1,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(_MLP(), DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False))
    return mon, logger.log_dir


def _logged_batch_sizes(log_dir: str) -> dict[int, float]:
    import csv

    out = {}
    with open(os.path.join(log_dir, "metrics.csv")) as f:
        for row in csv.DictReader(f):
            if row.get("gns/batch_size"):
                out[int(row["step"])] = float(row["gns/batch_size"])
    return out


def test_a_check_on_a_short_last_batch_of_one_example_is_skipped_quietly(tmp_path) -> None:
    # 97 examples at 32 a batch: each epoch's fourth batch holds one; checks every 3 steps land on steps 3 and 15
    # (an epoch is 4 steps: the last batch of the first epoch is step 3, of the fourth step 15)
    mon, log_dir = _mlp_fit(str(tmp_path), 97, 32, 3, 5)
    alerts = read_alerts(os.path.join(log_dir, "alerts.jsonl")) if os.path.exists(
        os.path.join(log_dir, "alerts.jsonl")) else []
    assert [a.kind for a in alerts if a.kind == "no_variance_estimate"] == []
    logged = _logged_batch_sizes(log_dir)
    assert logged and set(logged.values()) == {32.0}  # the one-example checks log nothing
    assert 15 not in logged and 12 in logged and 18 in logged
    assert mon.ema.count == len(logged)


def test_batches_of_one_example_throughout_are_still_said(tmp_path) -> None:
    mon, log_dir = _mlp_fit(str(tmp_path), 12, 1, 2, 1)
    kinds = [a.kind for a in read_alerts(os.path.join(log_dir, "alerts.jsonl"))]
    assert kinds.count("no_variance_estimate") == 1
    assert mon.ema.count == 0



def test_batch_size_advice_waits_after_a_rollback(tmp_path) -> None:
    """The demo's diverging run (no LayerNorm, a warm-up to a rate past the edge of stability): the guard rolled it back
    at step 99, and the noise scale's check at step 100, of a run that was just diverging, told it to lower its batch
    size toward 1. Advice now waits for ``min_checks`` checks of the run that goes on."""
    import lightning.pytorch as pl
    from gpt import GPTModule, make_loader

    import lightning_monitor as lm

    pl.seed_everything(0, verbose=False)
    hm = lm.HealthMonitor(spectral=False, gwa=False, dashboard=False, noise_scale=dict(every_n_steps=20),
                          guard=dict(every_n_steps=5))
    config = {"n_layer": 2, "n_head": 4, "d_model": 64, "block_size": 64, "layernorm": False}
    module = GPTModule(config, lr=1e-3, lr_end=0.04, ramp_steps=100)
    pl.Trainer(max_steps=130, accelerator="cpu", logger=False, callbacks=[hm], enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path)).fit(
        module, make_loader("prose", block_size=64, batch_size=16, n_samples=1600))
    assert hm.guard.rollbacks, "the run was expected to be rolled back"
    first = hm.guard.rollbacks[0]["step"]
    wait = first + hm.noise_scale.min_checks * hm.noise_scale.every_n_steps
    advice = [(a.step, a.kind) for a in hm.guard.hub.history if a.kind.startswith("batch_") and first < a.step < wait]
    assert advice == []


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.q_proj, self.up_proj, self.down_proj = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down_proj(torch.tanh(self.up_proj(torch.tanh(self.q_proj(self.ln(x))))))


class _TokenNet(pl.LightningModule):
    """Two residual blocks over 12 tokens, trained on random targets: B_simple in the tens."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.blocks, self.head = nn.Embedding(12, 8), nn.Sequential(_Block(), _Block()), nn.Linear(8, 12)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.blocks(self.emb(x))).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _column(logger: CSVLogger, key: str) -> list[str]:
    import csv

    with open(os.path.join(logger.log_dir, "metrics.csv")) as fh:
        return [row[key] for row in csv.DictReader(fh) if row.get(key)]


@pytest.mark.parametrize("every, warmup", [(1, 0), (6, 5)])
def test_the_advice_is_about_the_batch_size_in_use_not_a_short_last_batch(tmp_path, every, warmup) -> None:
    """43 examples in batches of 8: every epoch ends with 3. Advice at ``alert_ratio=10`` needs B_simple above 80 at
    batch size 8 (it stays below); the check on the short batch judged "batch size 3" and said the batch was far
    below the noise scale (with an epoch of 18 samples), and the condition stayed. Checked every 6th step from step 5,
    every check falls on an epoch's last batch: the training loader's batch size is the one in use."""
    x = torch.randint(0, 12, (43, 5), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 12, (43, 5), generator=torch.Generator().manual_seed(5))
    logger = CSVLogger(str(tmp_path), name="csv")
    ratio = 10.0 if every == 1 else 4.0  # B_simple in the tens: advice at batch 3, none at 8
    monitor = GradientNoiseScaleMonitor(every_n_steps=every, warmup_steps=warmup, alert_ratio=ratio)
    pl.Trainer(max_epochs=4 if every == 1 else 12, accelerator="cpu", logger=logger, callbacks=[monitor], log_every_n_steps=1,
               enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False).fit(
        _TokenNet(), DataLoader(TensorDataset(x, y), batch_size=8))
    b_simple = [float(v) for v in _column(logger, "gns/b_simple")]
    assert b_simple and 3 * ratio < max(b_simple) < 8 * ratio  # above the advice at batch 3, below the advice at 8
    assert sorted({float(v) for v in _column(logger, "gns/batch_size")}) == ([3.0, 8.0] if every == 1 else [3.0])
    assert not [a for a in monitor.hub.history if a.kind.startswith("batch_")]

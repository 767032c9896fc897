"""Every monitor's state continues across a resume: a run stopped at an epoch boundary and resumed from its
checkpoint in a fresh process state (new module, new callbacks) ends in the same state as the same run
trained straight through: the EMAs, baselines and singular vectors, the frozen set, GWA's history and the
guard's history."""

from __future__ import annotations

import csv
import math
import os
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from gpt import GPTModule, make_loader
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_monitor import (
    DivergenceGuard,
    GradientEarlyStopping,
    GradientNoiseScaleMonitor,
    GradientWeightAlignmentMonitor,
    SpectralAlignmentMonitor,
    read_alerts,
)

CONFIG = {"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 32}
EPOCHS, STOP_AFTER = 4, 2  # the interrupted run checkpoints after its second epoch


def _monitors() -> list[pl.Callback]:
    return [
        SpectralAlignmentMonitor(every_n_steps=2, max_rows=64),
        GradientNoiseScaleMonitor(method="per_example", every_n_steps=2),
        GradientWeightAlignmentMonitor(warmup_epochs=0),
        # freezes q_proj and k_proj (mean |gradient| ~1e-5) at its first decision and nothing else
        GradientEarlyStopping(tau=1e-4, threshold="absolute", every_n_steps=2, grace_steps=2),
        DivergenceGuard(every_n_steps=2),
    ]


def _fit(root: str, name: str, max_epochs: int, ckpt_path: Optional[str] = None) -> tuple[pl.Trainer, GPTModule]:
    pl.seed_everything(0, verbose=False)
    module = GPTModule(CONFIG)
    loader = make_loader("prose", block_size=32, batch_size=8, n_samples=64, shuffle=False)  # 8 steps an epoch
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=max_epochs, logger=CSVLogger(root, name=name, version=0),
        callbacks=[*_monitors(), ModelCheckpoint(dirpath=os.path.join(root, name, "ck"), save_top_k=-1)],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    )
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, module


def _assert_same(a: Any, b: Any, where: str) -> None:
    """Equal structures; tensors and floats to a tight relative tolerance (the same arithmetic, run twice)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, where
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-7, equal_nan=True), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(set(a) ^ set(b))}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert isinstance(b, (int, float)) and (
            math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7) or (math.isnan(a) and math.isnan(b))
        ), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _logged(trainer: pl.Trainer) -> dict[tuple[int, str], float]:
    out = {}
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv"), encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            for k, v in row.items():
                if k not in ("step", "epoch") and v not in ("", None):
                    out[(int(row["step"]), k)] = float(v)
    return out


def test_every_monitor_continues_after_a_resume(tmp_path) -> None:
    root = str(tmp_path)
    straight, straight_module = _fit(root, "straight", EPOCHS)
    first, _ = _fit(root, "first", STOP_AFTER)
    ckpt = os.path.join(root, "first", "ck", f"epoch={STOP_AFTER - 1}-step={STOP_AFTER * 8}.ckpt")
    assert os.path.exists(ckpt), os.listdir(os.path.dirname(ckpt))
    # the resumed run logs to the same folder, as a resumed run usually does: its alert counts continue
    resumed, resumed_module = _fit(root, "first", EPOCHS, ckpt_path=ckpt)
    assert straight.global_step == resumed.global_step == EPOCHS * 8

    for a, b in zip(straight_module.parameters(), resumed_module.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    monitors = [(a, b) for a, b in zip(straight.callbacks, resumed.callbacks) if hasattr(a, "state_key")
                and type(a).__module__.startswith("lightning_monitor")]
    assert len(monitors) == 6  # the five monitors and the alert hub (its state is a place in its own file)
    for a, b in monitors[:5]:
        _assert_same(a.state_dict(), b.state_dict(), type(a).__name__)
    # the alerts of the two runs (the resumed run's file continues the first run's): the same
    def alerts(trainer: pl.Trainer) -> list[tuple[Any, ...]]:
        records = read_alerts(os.path.join(trainer.logger.log_dir, "alerts.jsonl"))
        return sorted((a.step, a.monitor, a.kind, a.severity, a.message) for a in records)

    assert alerts(straight) == alerts(resumed) and alerts(straight)
    # the frozen set is in force, not only recorded
    grades = next(cb for cb in resumed.callbacks if isinstance(cb, GradientEarlyStopping))
    assert grades.frozen, "nothing froze: the test does not exercise the frozen set"
    frozen = {n for n, p in resumed_module.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, p in straight_module.named_parameters() if not p.requires_grad} and frozen
    gwa = next(cb for cb in resumed.callbacks if isinstance(cb, GradientWeightAlignmentMonitor))
    assert [h["epoch"] for h in gwa.history] == list(range(EPOCHS))

    # what the resumed run logged after the resume equals what the straight run logged at the same steps
    after = {k: v for k, v in _logged(resumed).items() if k[0] > STOP_AFTER * 8}
    reference = _logged(straight)
    assert len(after) > 50
    for key, value in after.items():
        assert key in reference, key
        assert math.isclose(value, reference[key], rel_tol=1e-4, abs_tol=1e-6), (key, value, reference[key])


def test_a_resume_with_an_optimizer_that_keeps_no_state_keeps_the_guards_history(tmp_path) -> None:
    # plain SGD keeps no per-parameter state, so its empty state after a resume looked like a later fit's fresh
    # optimizers: the checkpoint's loss history, moving average and minimum were dropped (32 losses -> 0)
    class Plain(GPTModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Peek(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = next(c for c in trainer.callbacks if isinstance(c, DivergenceGuard)).state_dict()

    def fit(max_steps: int, callbacks: list, ckpt_path: Optional[str] = None) -> None:
        pl.seed_everything(0, verbose=False)
        pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, default_root_dir=tmp_path, callbacks=callbacks,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0).fit(
            Plain(CONFIG, lr=0.05), make_loader("prose", block_size=32, batch_size=8, n_samples=8 * 40),
            ckpt_path=ckpt_path)

    fit(32, [DivergenceGuard(), ModelCheckpoint(dirpath=tmp_path / "ck")])
    ckpt = str(next((tmp_path / "ck").glob("*.ckpt")))
    saved = next(v for k, v in torch.load(ckpt, weights_only=False)["callbacks"].items() if k.startswith("DivergenceGuard"))
    assert len(saved["loss"]["history"]) == 32
    peek = Peek()
    fit(40, [DivergenceGuard(), peek], ckpt_path=ckpt)
    assert peek.state["loss"]["history"] == saved["loss"]["history"]
    assert peek.state["creep"]["ema"] == saved["creep"]["ema"] and peek.state["creep"]["min"] == saved["creep"]["min"]

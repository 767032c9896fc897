"""lightning-monitor demo: a small GPT trained on CPU with the suite attached, twice.

1. A healthy run: the monitors log their health metrics (spectral alignment, gradient noise scale,
   gradient-weight alignment of the output head, loss and gradient norm); nothing alarms.
2. A run of the same GPT without LayerNorm (less stable) whose learning-rate warm-up climbs to a peak
   past its edge of stability (1e-3 -> 0.04 over the first 100 steps, then held): the loss explodes; the
   DivergenceGuard rolls the run back to its last good snapshot, skips the batches seen since and halves
   the learning rate, as often as needed, and the run goes on learning.

Each run lands in a fresh ``runs/demo/<healthy|diverging>/version_<n>`` (TensorBoard event files, the
dashboard layout, ``alerts.jsonl`` when something was raised).
Run: ``python examples/demo.py`` (under a minute on a laptop CPU; ``--quick`` for a shorter run).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPTModule, make_loader  # noqa: E402

import lightning_monitor as lm  # noqa: E402


def suite() -> lm.HealthMonitor:
    """The monitors attached to both runs: the preset, with shorter cadences for a short run."""
    return lm.HealthMonitor(
        spectral=dict(every_n_steps=5, warmup_steps=50),
        noise_scale=dict(every_n_steps=20),
        gwa=dict(every_n_steps=5, log_histograms=True),  # tokens are the samples
        guard=dict(every_n_steps=5),  # rolls back to the last good state
    )


def train(name: str, root: str, steps: int, config: dict[str, Any], **module_kwargs: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    health = suite()
    logger = TensorBoardLogger(root, name=name)  # a fresh version_<n> folder per run
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=logger, callbacks=[health, Progress(name, steps)],
        log_every_n_steps=10, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        val_check_interval=100, limit_val_batches=8,
    )
    module = GPTModule(config, **module_kwargs)
    # 100 steps per epoch: GWA reports once per epoch
    train_loader = make_loader("prose", block_size=config["block_size"], batch_size=16, n_samples=1600)
    val_loader = make_loader("prose", block_size=config["block_size"], batch_size=16, n_samples=128, seed=100,
                             shuffle=False)
    start = time.perf_counter()
    trainer.fit(module, train_loader, val_loader)
    guard = health.guard
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    signals = {}
    for key in ("sa/sign_diversity_mean", "sa/collapsed_fraction", "gns/b_simple", "gwa/score"):
        series = logged(logger.log_dir, key)
        if series:
            signals[key] = series[-1]
    return {
        "health": signals,
        "name": name, "steps": trainer.global_step, "seconds": time.perf_counter() - start,
        "train_loss": metrics.get("train/loss"), "val_loss": metrics.get("val/loss"),
        "alerts": list(guard.hub.history), "stopped_step": guard.stopped_step, "rollbacks": guard.rollbacks,
        "checkpoint": guard.stop_checkpoint, "log_dir": logger.log_dir,
    }


class Progress(pl.Callback):
    """One line every 50 steps: the run is alive and where it stands."""

    def __init__(self, name: str, steps: int) -> None:
        self.name, self.steps = name, steps

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step % 50 == 0 or step == self.steps:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            print(f"   {self.name}: step {step}/{self.steps}, loss {float(loss):.3f}", flush=True)


def logged(log_dir: str, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` pairs of ``key`` read back from the run's TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    ea.Reload()
    return [(e.step, e.value) for e in ea.Scalars(key)] if key in ea.Tags()["scalars"] else []


def report(run: dict[str, Any]) -> None:
    print(f"\n== {run['name']}: {run['steps']} steps in {run['seconds']:.0f}s, "
          f"train loss {run['train_loss']:.3f}" + (f", val loss {run['val_loss']:.3f}" if run["val_loss"] else ""))
    for key, (step, value) in run["health"].items():
        print(f"   {key} = {value:.4g} (step {step})")
    if not run["alerts"]:
        print("   no alerts")
    for alert in run["alerts"]:
        print(f"   {alert}")
    warnings = [a for a in run["alerts"] if a.severity != "info"]
    if warnings:
        print(f"   first warning at step {warnings[0].step} ({warnings[0].monitor}/{warnings[0].kind}); "
              f"first spectral-alignment warning: "
              + next((f"step {a.step} (sa/{a.kind})" for a in warnings if a.monitor == "sa"), "none"))
    for r in run["rollbacks"]:
        cap = f"capped at {r['lr_ceiling'][0][0]:.3g}" if r["lr_ceiling"] else ""
        if r["lr_factor"] == 1.0:
            lr = f"learning rate {cap}" if cap else "learning rate kept"
        else:
            lr = f"learning rate now {r['lr_scale']:.3g}x its schedule" + (f", {cap}" if cap else "")
        print(f"   rolled back at step {r['step']} to the state of step {r['to_step']}: {r['skipped']} batches skipped, {lr}")
    if run["stopped_step"] is not None:
        print(f"   stopped by the DivergenceGuard at step {run['stopped_step']}; last good state: {run['checkpoint']}")
    path = os.path.join(run["log_dir"], "alerts.jsonl")
    if os.path.exists(path):
        print(f"   alerts file: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="runs/demo", help="output directory")
    parser.add_argument("--quick", action="store_true", help="fewer steps (for a smoke test)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    steps = 250 if args.quick else 400
    # positions looked up per example: the noise scale covers every parameter (else it warns that it leaves the
    # position table out, a healthy run's only warning)
    base = {"n_layer": 2, "n_head": 4, "d_model": 64, "block_size": 64, "batched_positions": True}

    print("Training a healthy run (AdamW, lr 3e-3, LayerNorm) ...", flush=True)
    healthy = train("healthy", args.root, steps, base, lr=3e-3)
    print("Training a run without LayerNorm whose warm-up climbs to lr 0.04 (too high) ...", flush=True)
    diverging = train("diverging", args.root, steps, {**base, "layernorm": False}, lr=1e-3, lr_end=0.04, ramp_steps=100)
    report(healthy)
    report(diverging)
    rollbacks = diverging["rollbacks"]
    # rescued: no stop, every step trained, and the loss at the end below the last good state's
    rescued = bool(rollbacks) and diverging["stopped_step"] is None and diverging["steps"] == steps
    # (the loss level of the state the first rollback restored: none where it was the state the fit started from)
    before = rollbacks[0]["loss_before"] if rollbacks else None
    rescued = rescued and before is not None and diverging["train_loss"] < before
    # the healthy run: nothing about divergence and nothing critical (a coverage note is information, not alarm)
    clean = not [a for a in healthy["alerts"] if a.severity == "critical" or a.monitor == "guard"]
    ok = clean and rescued
    print(f"\nThe healthy run was never rolled back or stopped and raised nothing critical; the diverging run was rolled back {len(rollbacks)} time(s) and went on "
          f"learning (train loss {diverging['train_loss']:.3f} at the end, "
          f"{before:.3f} before the first explosion)." if ok
          else "\nUnexpected outcome: see the alerts above.")
    print(f"\nLook at it: tensorboard --logdir {args.root}")


if __name__ == "__main__":
    main()

"""DivergenceGuard when the learning rate comes back up (warm restarts) and when a second fit starts fresh optimizers,
each against its matched divergence.

The demo's GPT (2 layers, d_model 64, 0.2 M parameters, AdamW, batch 16, one CPU thread), the guard at its defaults:

* ``restart``: cosine with warm restarts (period ``T0``, from 3e-3 down to 1e-5), 600 steps. A healthy run: the loss
  jumps after a restart and recovers. Its matched divergence (``x10``): the same run, seed and data, whose restarts
  from step ``2 * T0`` on go to 10 times the rate it ever trained at.
* ``refit``: 200 steps, then a second ``fit`` of the same Trainer to step 230 (new optimizers, fresh Adam state) at the
  same rate; matched: the second fit at 0.05.

Prints per run the rollbacks, the guard's warnings and the mean loss of the last 50 steps, and the same run without
the guard. Run: python benchmarks/guard_restarts.py  (about 3 min on 2 cores)
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from gpt import GPTModule, make_loader  # noqa: E402

from lightning_monitor import DivergenceGuard  # noqa: E402
from lightning_monitor.alerts import AlertHub  # noqa: E402

CONFIG = {"n_layer": 2, "n_head": 2, "d_model": 64, "block_size": 64}


class _Restarts(GPTModule):
    def __init__(self, *args, period: int = 150, factor: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.period, self.factor = period, factor

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        period, factor = self.period, self.factor

        def mult(k: int) -> float:
            cosine = 1 / 300 + (1 - 1 / 300) * 0.5 * (1 + math.cos(math.pi * (k % period) / period))
            return cosine * (factor if k >= 2 * period else 1.0)

        sched = torch.optim.lr_scheduler.LambdaLR(opt, mult)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.values.append(float(loss))


def _trainer(callbacks, steps):
    return pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, callbacks=callbacks, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)


def _outcome(trainer, guard, losses):
    if guard is None:
        return "no guard", ""
    warned = [f"{a.kind}@{a.step}" for a in AlertHub.for_trainer(trainer).history if a.severity == "warning"]
    acts = [f"rollback@{r['step']}" for r in guard.rollbacks] + ([f"stop@{guard.stopped_step}"] if guard.stopped_step else [])
    return ", ".join(acts) or "none", ", ".join(warned)


def restart(seed: int, period: int, factor: float, guarded: bool):
    pl.seed_everything(seed, verbose=False)
    module = _Restarts(CONFIG, lr=3e-3, period=period, factor=factor)
    loader = make_loader("prose", block_size=64, batch_size=16, n_samples=16 * 600)
    guard, losses = (DivergenceGuard() if guarded else None), _Losses()
    trainer = _trainer([c for c in (guard, losses) if c is not None], 600)
    trainer.fit(module, loader)
    return (*_outcome(trainer, guard, losses), losses.values)


def refit(second_lr: float, guarded: bool):
    pl.seed_everything(0, verbose=False)
    module = GPTModule(CONFIG, lr=3e-3)
    loader = make_loader("prose", block_size=64, batch_size=16, n_samples=4096)
    guard, losses = (DivergenceGuard() if guarded else None), _Losses()
    trainer = _trainer([c for c in (guard, losses) if c is not None], 200)
    trainer.fit(module, loader)
    trainer.fit_loop.epoch_loop.max_steps = 230
    module.lr = second_lr
    trainer.fit(module, loader)
    return (*_outcome(trainer, guard, losses), losses.values)


def main() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("lightning_monitor").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    runs = [(f"restart T0={p} seed {s}", lambda g, s=s, p=p: restart(s, p, 1.0, g)) for s, p in ((0, 150), (1, 100), (2, 150))]
    runs += [(f"restart T0={p} seed {s} x10 (matched)", lambda g, s=s, p=p: restart(s, p, 10.0, g)) for s, p in ((0, 150), (1, 100))]
    runs += [("refit at 3e-3", lambda g: refit(3e-3, g)), ("refit at 0.05 (matched)", lambda g: refit(0.05, g))]
    print("| run | actions | guard's warnings | last-50 loss, guarded | unguarded |")
    print("|---|---|---|---|---|")
    for name, fn in runs:
        acts, warned, guarded = fn(True)
        _, _, plain = fn(False)
        tail = lambda v: sum(v[-50:]) / len(v[-50:]) if all(math.isfinite(x) for x in v[-50:]) else math.nan  # noqa: E731
        print(f"| {name} | {acts} | {warned or '-'} | {tail(guarded):.3f} | {tail(plain):.3f} |", flush=True)


if __name__ == "__main__":
    main()

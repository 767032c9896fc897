"""Acting does not depend on the order of ``callbacks=[...]``: the five monitors in every one of the 120
orders, on a run where GradES freezes components and the guard rolls back a NaN step that falls on a
check of every other monitor. Every order must train to the end and take the same decisions."""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import torch
from gpt import GPTModule, make_loader

from lightning_monitor import (
    DivergenceGuard,
    GradientEarlyStopping,
    GradientNoiseScaleMonitor,
    GradientWeightAlignmentMonitor,
    SpectralAlignmentMonitor,
)

CONFIG = {"n_layer": 1, "n_head": 2, "d_model": 16, "block_size": 8}
STEPS, NAN_AT = 12, 8


def _monitors() -> list[pl.Callback]:
    return [
        SpectralAlignmentMonitor(every_n_steps=4, baseline_checks=1),
        GradientNoiseScaleMonitor(every_n_steps=4),
        GradientWeightAlignmentMonitor(),
        # mean |gradient| of q/k is far below v/o/mlp on this model: an absolute tau freezes them at step 2
        GradientEarlyStopping(tau=1e-4, threshold="absolute", every_n_steps=2, grace_steps=2),
        DivergenceGuard(every_n_steps=4, snapshot_every_n_checks=1),
    ]


def _run(order: tuple[int, ...]) -> tuple:
    pl.seed_everything(0, verbose=False)
    module = GPTModule(CONFIG, nan_at_step=NAN_AT)
    loader = make_loader("prose", block_size=CONFIG["block_size"], batch_size=4, n_samples=4 * STEPS)
    monitors = _monitors()
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[monitors[i] for i in order])
    trainer.fit(module, loader)
    guard = monitors[4]
    frozen = tuple(sorted(n for n, p in module.named_parameters() if not p.requires_grad))
    finite = all(bool(torch.isfinite(p).all()) for p in module.parameters())
    return trainer.global_step, [(r["step"], r["to_step"]) for r in guard.rollbacks], guard.stopped_step, frozen, finite


def test_every_order_of_the_five_callbacks_trains_and_decides_alike():
    results = {order: _run(order) for order in itertools.permutations(range(5))}
    reference = results[(0, 1, 2, 3, 4)]
    steps, rollbacks, stopped, frozen, finite = reference
    assert steps == STEPS and stopped is None and finite
    assert rollbacks == [(NAN_AT, 4)]  # the NaN at 8 (a check of SA, GNS and the guard): back to step 4
    assert frozen  # GradES froze components (the same ones in every order, below)
    different = {order: r for order, r in results.items() if r != reference}
    assert not different, f"{len(different)} orders decided differently, e.g. {next(iter(different.items()))}"

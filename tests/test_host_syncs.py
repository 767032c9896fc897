"""No host sync on steps where a monitor is not due.

On CPU there is no device to wait for, so we count the calls that *would* sync on an accelerator
(``Tensor.item``, ``tolist``, ``cpu``, ``numpy``, ``__bool__``, ``__float__``, ``__int__``) made from
lightning_monitor's own code, and record on which optimizer steps they happen.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from contextlib import contextmanager

import lightning.pytorch as pl
import torch

import lightning_monitor

PACKAGE_DIR = os.path.dirname(os.path.abspath(lightning_monitor.__file__))
SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


@contextmanager
def count_package_syncs(trainer_ref: list):
    """Counts syncing calls made from lightning_monitor's code, keyed by ``trainer.global_step``."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def wrap(name, fn):
        def wrapped(self, *args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(PACKAGE_DIR) and trainer_ref:
                counts[trainer_ref[0].global_step] += 1
            return fn(self, *args, **kwargs)

        return wrapped

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def run_counting(callbacks, module, loader, steps, tmp_path):
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    ref = [trainer]
    with count_package_syncs(ref) as counts:
        trainer.fit(module, loader)
    return counts


def test_guard_syncs_only_on_its_checks(tmp_path, tiny_gpt):
    module, loader = tiny_gpt()
    guard = lightning_monitor.DivergenceGuard(every_n_steps=10, snapshot_every_n_checks=2)
    counts = run_counting([guard], module, loader, 45, tmp_path)
    assert sorted(counts) == [0, 10, 20, 30, 40], counts
    assert counts[10] == counts[30] == 2  # one transfer per check (and the tolist that reads it)
    assert counts[0] == counts[20] == counts[40] == 3  # a snapshot is due: plus one finiteness check


def _due(monitor, steps):
    return [s for s in range(steps) if monitor.is_due(s)]


def test_step_monitors_sync_only_on_due_steps(tmp_path, tiny_gpt):
    """SA, GNS and GradES together: every syncing call from the package happens on a due step."""
    from lightning_monitor import GradientEarlyStopping, GradientNoiseScaleMonitor, SpectralAlignmentMonitor

    module, loader = tiny_gpt()
    monitors = [
        SpectralAlignmentMonitor(every_n_steps=7, warmup_steps=3),
        GradientNoiseScaleMonitor(every_n_steps=6),
        GradientEarlyStopping(every_n_steps=5, grace_steps=1000),
    ]
    steps = 40
    counts = run_counting(monitors, module, loader, steps, tmp_path)
    due = set().union(*(_due(m, steps) for m in monitors))
    off_steps = sorted(set(counts) - due)
    assert off_steps == [], f"host syncs on steps where no monitor was due: {off_steps}"
    assert set(counts) >= set(_due(monitors[0], steps))  # the counter does see the checks


def test_gwa_scores_every_step_without_syncing_until_epoch_end(tmp_path, tiny_gpt):
    """GWA accumulates on the device every step; values cross to the host only when the epoch ends."""
    from lightning_monitor import GradientWeightAlignmentMonitor

    module, loader = tiny_gpt(n_samples=8 * 12)  # 12 steps per epoch
    counts = run_counting([GradientWeightAlignmentMonitor(log_histograms=False)], module, loader, 36, tmp_path)
    assert counts, "the epoch-end report should transfer values"
    assert all(step % 12 == 0 for step in counts), sorted(counts)  # global_step after each epoch: 12, 24, 36

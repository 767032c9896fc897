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


def test_guard_reads_only_copies_started_lag_steps_earlier(tmp_path, tiny_gpt, monkeypatch):
    """The guard judges every step, from a host copy of its ``[loss, grad norm]`` started ``lag_steps`` earlier
    (asynchronous on an accelerator, so reading it then does not wait for the device). Between its checks, its
    only syncing calls are ``tolist`` on those copies; at its checks, a snapshot adds one finiteness check."""
    from lightning_monitor.callbacks.divergence_guard import DivergenceGuard

    started: dict[int, int] = {}  # id of a host copy -> the step its copy started at
    kept: list = []
    copy = DivergenceGuard._copy_to_host

    def recording(self, step, row, no_loss):
        out = copy(self, step, row, no_loss)
        started[id(out[1])] = step
        kept.append(out[1])  # alive until the end: no other tensor takes its id
        return out

    monkeypatch.setattr(DivergenceGuard, "_copy_to_host", recording)
    reads: list[tuple[int, str, int]] = []  # (step, method, age of the copy read, -1 if not a copy)
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}
    module, loader = tiny_gpt()
    guard = DivergenceGuard(every_n_steps=10, snapshot_every_n_checks=2, lag_steps=2)
    trainer = pl.Trainer(max_steps=45, accelerator="cpu", logger=False, callbacks=[guard], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))

    def wrap(name, fn):
        def wrapped(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(PACKAGE_DIR):
                step = trainer.global_step
                reads.append((step, name, step - started[id(self)] if id(self) in started else -1, caller.co_name))
            return fn(self, *args, **kwargs)

        return wrapped

    for name, fn in originals.items():
        monkeypatch.setattr(torch.Tensor, name, wrap(name, fn))
    trainer.fit(module, loader)
    for name, fn in originals.items():
        monkeypatch.setattr(torch.Tensor, name, fn)

    # once per fit, before its first step: which buffers hold infinities by design (a mask), one transfer
    once = [r for r in reads if r[3] == "_infinite_buffers"]
    assert [(s, name) for s, name, _, _ in once] == [(0, "cpu"), (0, "tolist")]
    reads = [r for r in reads if r[3] != "_infinite_buffers"]
    # at the end of the fit (step 45) the guard judges what no later step will: the last two steps' values, still on
    # their way, and the last update (the last normal batches evaluated once more: their losses read)
    end = [r for r in reads if r[0] == 45]
    reads = [r for r in reads if r[0] < 45]
    assert sorted((45 - age, name) for _, name, age, _ in end if age >= 0) == [(43, "tolist"), (44, "tolist")]
    assert end and all(caller in ("_values_to_host", "_batch_loss", "_rank_mean") or age >= 0
                       for _, _, age, caller in end), end
    copies = [r for r in reads if r[2] >= 0]
    others = [r for r in reads if r[2] < 0]
    # every step but the last two was read during the fit, 2 steps later
    assert sorted(s - age for s, _, age, _ in copies) == list(range(43))
    assert {(name, age) for _, name, age, _ in copies} == {("tolist", 2)}
    # nothing else is read, except at the snapshot checks (0, 20, 40): one finiteness check each, and at those made in a
    # step (20, 40; the first is taken as training starts) the step's loss and its replay's (a replay must give the
    # step's loss: DivergenceGuard._check_replay)
    assert sorted((s, caller) for s, _, _, caller in others) == sorted(
        [(0, "_all_finite")] + [(s, c) for s in (20, 40) for c in ("_all_finite", "_check_replay", "_batch_loss")]), others


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
    """GWA accumulates on the device every step; values cross to the host only when the epoch ends, and once in the
    fit, on the first scored step after the head is chosen, when the head's gradient is checked against the scores'
    reading of the loss."""
    from lightning_monitor import GradientWeightAlignmentMonitor

    module, loader = tiny_gpt(n_samples=8 * 12)  # 12 steps per epoch
    gwa = GradientWeightAlignmentMonitor(log_histograms=False)
    counts = run_counting([gwa], module, loader, 36, tmp_path)
    assert counts, "the epoch-end report should transfer values"
    # global_step after each epoch: 12, 24, 36; the check of the loss's reading ran at step 1 (the head chosen at 0)
    assert gwa._check_state == "done" and gwa._check_step == 1
    assert {step for step in counts if step % 12} == {1}, sorted(counts)


class _FakeDevice:
    def __init__(self, kind: str) -> None:
        self.type = kind


class _RowOn:
    """A stand-in for a ``[loss, grad norm]`` row on another accelerator: records how it was copied to the host."""

    def __init__(self, kind: str) -> None:
        self.device = _FakeDevice(kind)
        self.copies: list[tuple[str, dict]] = []

    def to(self, where, **kwargs):
        self.copies.append((where, kwargs))
        return torch.tensor([1.5, 2.0])


def test_rows_from_an_accelerator_other_than_cuda_are_copied_so_the_copy_has_finished() -> None:
    """A copy to the host that does not wait is made only from CUDA, where an event marks its end. From MPS such a
    copy can still be under way when read: there (and on any other accelerator) the copy waits, and the values read
    are the row's."""
    from lightning_monitor.callbacks.divergence_guard import DivergenceGuard

    for kind in ("mps", "xpu"):
        row = _RowOn(kind)
        step, host, event, no_loss = DivergenceGuard._copy_to_host(None, 7, row, False)
        assert row.copies == [("cpu", {})] and event is None and step == 7
        assert DivergenceGuard._values_to_host([(step, host, event, no_loss)]) == [(7, 1.5, 2.0)]


def test_the_suites_own_forward_runs_fork_the_random_stream_of_the_models_accelerator(monkeypatch) -> None:
    """The guard's replays and the probe's runs on slices fork the random streams of the model's devices, so that a
    run's dropout masks are those of the same run without the suite: CUDA's, and on MPS (or XPU) that device's (the
    fork named only CUDA devices before: on MPS those runs drew from the training's stream)."""
    import contextlib

    from lightning_monitor._compat import fork_rng_of

    calls: list[tuple] = []

    def recording(devices=None, enabled=True, device_type=None, **kwargs):
        calls.append((list(devices), device_type))
        return contextlib.nullcontext()

    monkeypatch.setattr(torch.random, "fork_rng", recording)
    for kind in ("mps", "xpu"):
        monkeypatch.setattr(getattr(torch, kind), "get_rng_state", lambda *a: None, raising=False)
    fork_rng_of([torch.device("cpu")])
    fork_rng_of([torch.device("cuda", 1), torch.device("cpu"), torch.device("cuda", 0)])
    fork_rng_of([torch.device("mps", 0)])
    fork_rng_of([torch.device("xpu", 0), torch.device("xpu", 1)])
    assert calls == [([], None), ([0, 1], None), ([0], "mps"), ([0, 1], "xpu")]

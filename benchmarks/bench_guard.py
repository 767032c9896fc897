"""DivergenceGuard: overhead per step and what it catches, against Lightning's SpikeDetection.

Overhead: the demo's GPT (2 layers, d_model 64, block 64, batch 16) trained for the same steps with no
callback (baseline), with the guard at its defaults (rollback, checks every 10 steps, a host-memory
snapshot every 50), the same guard without snapshots (``action="warn", snapshot_every_n_checks=None``),
the guard checking every step, and Lightning's SpikeDetection, interleaved in one process; median
seconds per step over the repetitions (first 20 steps of each run excluded). Then the time spent inside
the guard's hooks, and inside its snapshots alone, per training step.

Detection: a NaN injected into the loss at step 50, and a real divergence (no LayerNorm, AdamW, lr
ramped 1e-3 -> 0.1 over 400 steps): the step each tool reacts at, and whether the weights stayed finite.
The scenario zoo (``benchmarks/divergence_zoo.py``) is the systematic evaluation.

Run: python benchmarks/bench_guard.py [--quick]
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import sys
import time
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, SpikeDetection

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPTModule, make_loader  # noqa: E402

from lightning_monitor import DivergenceGuard, Monitor  # noqa: E402

CONFIG = {"n_layer": 2, "n_head": 4, "d_model": 64, "block_size": 64}


class StepTimer(Callback):
    def __init__(self, skip: int = 20) -> None:
        self.skip, self.start, self.end, self.steps = skip, None, None, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.skip:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.end, self.steps = time.perf_counter(), trainer.global_step - self.skip

    def per_step(self) -> float:
        return (self.end - self.start) / self.steps


class TimedGuard(DivergenceGuard):
    """The guard with the wall time spent inside its per-step hooks, and inside its snapshots, recorded
    (CPU: no async work)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inside = 0.0
        self.snapshots = 0.0

    def _timed(self, hook, *args):
        t = time.perf_counter()
        hook(*args)
        self.inside += time.perf_counter() - t

    def on_train_batch_start(self, *args):
        self._timed(super().on_train_batch_start, *args)

    def on_before_backward(self, *args):
        self._timed(super().on_before_backward, *args)

    def on_before_optimizer_step(self, *args):
        self._timed(super().on_before_optimizer_step, *args)

    def on_train_batch_end(self, *args):
        self._timed(super().on_train_batch_end, *args)

    def _snapshot(self, *args):
        t = time.perf_counter()
        super()._snapshot(*args)
        self.snapshots += time.perf_counter() - t


def fit(callbacks, steps, root, **module_kwargs):
    pl.seed_everything(0, verbose=False)
    module = GPTModule({**CONFIG, **module_kwargs.pop("config", {})}, **module_kwargs)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=root)
    error = None
    try:
        trainer.fit(module, make_loader("prose", block_size=64, batch_size=16, n_samples=16 * steps))
    except Exception as err:  # SpikeDetection raises TrainingSpikeException
        error = err
    finite = all(bool(torch.isfinite(p).all()) for p in module.parameters())
    return trainer, finite, error


def overhead(steps: int, reps: int, root: str) -> None:
    variants = {
        "baseline (no callback)": lambda: [],
        "DivergenceGuard() (rollback, snapshots every 50 steps)": lambda: [DivergenceGuard()],
        "DivergenceGuard(action='warn', snapshot_every_n_checks=None)": lambda: [
            DivergenceGuard(action="warn", snapshot_every_n_checks=None)],
        "DivergenceGuard(every_n_steps=1)": lambda: [DivergenceGuard(every_n_steps=1, snapshot_every_n_checks=50)],
        "SpikeDetection()": lambda: [SpikeDetection(exclude_batches_path=os.path.join(root, "skip.json"))],
    }
    times = {name: [] for name in variants}
    for _ in range(reps):
        for name, make in variants.items():
            timer = StepTimer()
            fit(make() + [timer], steps, root)
            times[name].append(timer.per_step())
    base = statistics.median(times["baseline (no callback)"])
    print(f"\n| variant | ms/step (median of {reps}) | ratio to baseline |\n|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {1e3 * med:.2f} | {med / base:.3f} |")
    # the guard's own cost, measured inside its hooks (less noisy than whole-run ratios)
    print("\n| guard | us per step inside its hooks (median) | share of a training step | of which snapshots |"
          "\n|---|---|---|---|")
    for label, kwargs in (("DivergenceGuard()", {}), ("DivergenceGuard(every_n_steps=1)", {"every_n_steps": 1,
                                                                                        "snapshot_every_n_checks": 50})):
        inside = []
        for _ in range(reps):
            guard, timer = TimedGuard(**kwargs), StepTimer(skip=0)
            trainer, _, _ = fit([guard, timer], steps, root)
            n = trainer.global_step
            inside.append((guard.inside / n, guard.inside / n / timer.per_step(), guard.snapshots / n / timer.per_step()))
        us, share, snap = (statistics.median(x[i] for x in inside) for i in range(3))
        print(f"| {label} | {1e6 * us:.0f} | {100 * share:.2f}% | {100 * snap:.2f}% |")


def detection(root: str) -> None:
    print("\n| scenario | tool | reacts at step | run ends at step | weights finite | checkpoint |\n|---|---|---|---|---|---|")
    scenarios = {
        "NaN loss at step 50": dict(steps=120, lr=3e-3, nan_at_step=50),
        "no LayerNorm, lr 1e-3 -> 0.1 ramp": dict(steps=400, lr=1e-3, lr_end=0.1, ramp_steps=400,
                                                  config={"layernorm": False}),
    }
    for label, kw in scenarios.items():
        steps = kw.pop("steps")
        for action in ("rollback", "stop"):
            guard = DivergenceGuard(action=action, dirpath=os.path.join(root, "ck"))
            trainer, finite, _ = fit([guard], steps, root, **dict(kw))
            acted = [f"rollback {r['step']}->{r['to_step']}" for r in guard.rollbacks]
            acted += [f"stop {guard.stopped_step}"] if guard.stopped_step is not None else []
            print(f"| {label} | DivergenceGuard(action={action!r}) | {', '.join(acted) or 'never'} | "
                  f"{trainer.global_step} | {finite} | "
                  f"{os.path.basename(guard.stop_checkpoint) if guard.stop_checkpoint else '-'} |")
        spike = SpikeDetection(exclude_batches_path=os.path.join(root, "skip.json"))
        trainer, finite, error = fit([spike], steps, root, **dict(kw))
        # TrainingSpikeException names the batch in its message (one epoch here: batch index = step)
        found = re.search(r"batch (\d+)", str(error)) if error is not None else None
        step = int(found.group(1)) if found else None
        print(f"| {label} | SpikeDetection (defaults) | {step if step is not None else 'never'} | "
              f"{trainer.global_step} | {finite} | - |")


class FalseAlarm(Monitor):
    """Raises one critical alert at ``step``: a false alarm, to measure what a rollback costs a healthy run."""

    name = "probe"

    def __init__(self, step: int) -> None:
        super().__init__(every_n_steps=1)
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step:
            self.alert(self.step, "false_alarm", "critical", "a deliberate false alarm")


def false_alarm_cost(steps: int, root: str) -> None:
    """A healthy run, and the same run with one false critical alert: the steps a rollback throws away and
    what it does to the final loss (mean of the last 20 step losses)."""
    print("\n| run | rollbacks | batches skipped | final train loss |\n|---|---|---|---|")
    for label, extra in (("healthy, no alarm", []), (f"false alarm at step {steps // 2 + 5}", [FalseAlarm(steps // 2 + 5)])):
        guard = DivergenceGuard()
        losses = LossRecorder()
        fit(extra + [guard, losses], steps, root)
        skipped = sum(r["skipped"] for r in guard.rollbacks)
        print(f"| {label} | {len(guard.rollbacks)} | {skipped} | {statistics.fmean(losses.losses[-20:]):.4f} |")


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--root", default="benchmarks/out/guard")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_monitor").setLevel(logging.ERROR)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    overhead(steps=80 if args.quick else 220, reps=3 if args.quick else 5, root=args.root)
    detection(args.root)
    false_alarm_cost(200 if args.quick else 400, args.root)


if __name__ == "__main__":
    main()

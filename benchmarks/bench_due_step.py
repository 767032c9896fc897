"""What a due step of the noise-scale or spectral-alignment monitor costs, against the other steps of the same run.

The demo's GPT (2 layers, d_model 64, block 64, batch 16, 0.2 M parameters), one CPU thread, one monitor checking
every 10 steps, 300 steps, no logger. Each step is timed from ``on_train_batch_start`` to ``on_train_batch_end``;
the medians of the due steps and of the others are compared (steps 20 on). At the preset's cadence (every 50
steps) a due step's extra cost is spread over 50 steps.

Run: python benchmarks/bench_due_step.py [--monitor gns|sa] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.join(os.getcwd(), "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_guard_hooks import quiet_demo_config  # noqa: E402
from gpt import GPTModule, make_loader  # noqa: E402

from lightning_monitor import GradientNoiseScaleMonitor, SpectralAlignmentMonitor  # noqa: E402

EVERY = 10


class StepTimes(pl.Callback):
    def __init__(self) -> None:
        self.times: dict[int, float] = {}
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times[trainer.global_step - 1] = time.perf_counter() - self._t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--monitor", choices=("gns", "sa"), default="gns")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    config = quiet_demo_config()
    monitor = (GradientNoiseScaleMonitor(every_n_steps=EVERY) if args.monitor == "gns"
               else SpectralAlignmentMonitor(every_n_steps=EVERY))
    timer = StepTimes()  # first: it starts the clock before the monitor's hooks and stops it after them
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", logger=False, callbacks=[timer, monitor],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(GPTModule(config, lr=3e-3), make_loader("prose", block_size=64, batch_size=16,
                                                         n_samples=16 * args.steps))
    due = [t for s, t in timer.times.items() if s >= 20 and s % EVERY == 0]
    other = [t for s, t in timer.times.items() if s >= 20 and s % EVERY]
    d, o = statistics.median(due), statistics.median(other)
    print(f"{args.monitor}: due step {1e3 * d:.2f} ms, other steps {1e3 * o:.2f} ms: +{1e3 * (d - o):.2f} ms "
          f"(+{100 * (d / o - 1):.1f}% of a step); at every 50 steps {100 * (d / o - 1) / 50:.2f}% of the run")


if __name__ == "__main__":
    main()

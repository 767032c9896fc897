"""DivergenceGuard alone: microseconds per step spent inside its per-step hooks, and their share of the fit.

The demo's GPT (2 layers, d_model 64, block 64, batch 16, 0.2 M parameters), one CPU thread, the guard at its
defaults, 200 steps, no logger. The hooks are timed in the run itself, so the figure does not depend on how
fast the machine runs the rest of the step (whole-run ratios on a shared machine move by several percent).

To compare two versions of the code, run this script (it imports ``lightning_monitor`` from ``PYTHONPATH`` and the
example GPT from the working directory) in each checkout, alternating:

    git worktree add /tmp/before <revision>
    for i in 1 2 3; do (cd /tmp/before && PYTHONPATH=. python "$OLDPWD/benchmarks/bench_guard_hooks.py"); \
        python benchmarks/bench_guard_hooks.py; done

``--parts``: also time the parts of the per-step hook (the finiteness check, snapshots, judging ...) by wrapping
the guard's methods with timers (the wrappers add a little to the total).

Run: python benchmarks/bench_guard_hooks.py [--steps N] [--parts]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.join(os.getcwd(), "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_guard import TimedGuard  # noqa: E402
from gpt import GPTModule, make_loader  # noqa: E402


def quiet_demo_config() -> dict:
    """One CPU thread, warnings and library logging silenced; the demo GPT's config (0.2 M parameters)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning_monitor"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return {"n_layer": 2, "n_head": 4, "d_model": 64, "block_size": 64}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--parts", action="store_true", help="also time the parts of the per-step hook")
    args = parser.parse_args()
    config = quiet_demo_config()
    pl.seed_everything(0, verbose=False)
    guard = TimedGuard()  # its per-step hooks timed
    parts: dict[str, float] = {}
    if args.parts:
        import lightning_monitor.callbacks.divergence_guard as module

        def timed(owner, name):
            fn = getattr(owner, name)

            def wrapper(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    parts[name] = parts.get(name, 0.0) + time.perf_counter() - t
            setattr(owner, name, wrapper)

        for name in ("_read_ready", "_judge_ready", "_snapshot", "_lag", "_all_finite", "is_due"):
            timed(guard, name)
        timed(module, "nonfinite_on_host")
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", logger=False, callbacks=[guard],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    t0 = time.perf_counter()
    trainer.fit(GPTModule(config, lr=3e-3), make_loader("prose", block_size=64, batch_size=16,
                                                         n_samples=16 * args.steps))
    total = time.perf_counter() - t0
    print(f"{os.getcwd()}: guard {1e6 * guard.inside / args.steps:.0f} us per step inside its hooks, "
          f"{100 * guard.inside / total:.2f}% of the fit ({1e3 * total / args.steps:.1f} ms per step)")
    for name, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {name:20s} {1e6 * seconds / args.steps:7.1f} us per step")


if __name__ == "__main__":
    main()

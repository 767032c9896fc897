"""``HealthMonitor()`` left on at its defaults, against the same training without it.

Example GPT on CPU (one thread), two sizes. Each repetition trains the same seeded run twice, with no
callback and with ``HealthMonitor()`` (SpectralAlignmentMonitor every 50 steps, GradientNoiseScaleMonitor
every 50 with per-example norms, GradientWeightAlignmentMonitor every 10th step on the lm_head (tokens are the
samples), DivergenceGuard judging every step, the dashboard), alternating which goes first. Reported:
median seconds per step (first 20 steps excluded), the median of the per-pair ratios, and the time spent
inside each monitor's callback hooks (its on_* methods; the probes' forward and backward hooks are not
included) as a share of the monitored run's training time, twice: over the whole run (the first checks' cold
starts included: SA's first singular vectors take 30 iterations instead of 4) and over the steps whose times are
measured (step 20 on: the steady state of a long run, the window of the ratio). GradientEarlyStopping is off in the preset:
it changes the training it measures (see bench_grades.py).

``--only sa`` (``gns``, ``gwa``, ``guard``; or several, comma-separated) keeps only those monitors of the
preset, at the preset's settings: one monitor's own overhead.

``--untimed`` leaves the hook timers out (they add a few microseconds to every hook call of every monitor):
the ratio alone, as a user would see it.

``--sizes 0.2m,0.8m,5m`` picks the model sizes (default the first two; ``5m``, 5.0 M parameters, takes
minutes per run on CPU: pair it with ``--steps 80 --pairs 3``).

Run: python benchmarks/bench_suite.py [--quick] [--only sa,gns,gwa,guard] [--untimed] [--sizes ...] [--steps N] [--pairs N]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import types
import warnings
from typing import Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPTModule, make_loader  # noqa: E402

import lightning_monitor as lm  # noqa: E402
from bench_guard import StepTimer  # noqa: E402

SIZES = {
    "GPT 2x64 (0.2 M params)": {"n_layer": 2, "n_head": 4, "d_model": 64, "block_size": 64},
    "GPT 4x128 (0.8 M params)": {"n_layer": 4, "n_head": 4, "d_model": 128, "block_size": 64},
    # off by default: minutes per run on CPU
    "GPT 4x320 (5.0 M params)": {"n_layer": 4, "n_head": 8, "d_model": 320, "block_size": 64},
}
SIZE_NAMES = {"0.2m": "GPT 2x64 (0.2 M params)", "0.8m": "GPT 4x128 (0.8 M params)", "5m": "GPT 4x320 (5.0 M params)"}


#: the first steps of each run are not timed (StepTimer's ``skip``): the cold starts fall in them
SKIP = 20


#: the hooks a training step calls: only they count in the window of the per-step times (a fit's once-only hooks,
#: such as the guard's end-of-fit check in ``on_train_end``, count in the whole run's share)
PER_STEP_HOOKS = frozenset({"on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
                            "on_before_optimizer_step", "on_before_zero_grad"})


def timed(callback: Callback, clock: list) -> Callback:
    """Wrap every ``on_*`` hook the callback overrides with a timer adding to ``clock[0]``, and the per-step hooks
    to ``clock[1]`` from step ``SKIP`` on (the window of the per-step times)."""
    for name in dir(type(callback)):
        if not name.startswith("on_") or getattr(type(callback), name) is getattr(Callback, name, None):
            continue
        original = getattr(callback, name)

        def wrapper(self, *args, _original=original, _per_step=name in PER_STEP_HOOKS, **kwargs):
            t = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent = time.perf_counter() - t
                clock[0] += spent
                if _per_step and args and getattr(args[0], "global_step", -1) >= SKIP:
                    clock[1] += spent

        setattr(callback, name, types.MethodType(wrapper, callback))
    return callback


SLOTS = {"sa": "spectral", "gns": "noise_scale", "gwa": "gwa", "guard": "guard"}


def suite(clocks: Optional[dict], only: tuple[str, ...] = ()) -> list[Callback]:
    """``HealthMonitor()`` (with only the monitors named in ``only`` when given) with every monitor's hooks
    timed into ``clocks[<monitor name>]`` (``clocks=None``: not timed, so the timers cost nothing)."""
    health = lm.HealthMonitor(**{slot: False for name, slot in SLOTS.items() if only and name not in only})
    if clocks is None:
        return [health]
    for monitor in health.monitors:
        timed(monitor, clocks.setdefault(monitor.name, [0.0, 0.0]))
    return [timed(health, clocks.setdefault("preset", [0.0, 0.0]))]


def run(config: dict, steps: int, callbacks: list[Callback], root: str) -> float:
    pl.seed_everything(0, verbose=False)
    timer = StepTimer(skip=SKIP)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=pl.loggers.CSVLogger(root, name="suite"),
                         callbacks=callbacks + [timer], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, log_every_n_steps=50)
    trainer.fit(GPTModule(config, lr=3e-3), make_loader("prose", block_size=config["block_size"], batch_size=16,
                                                         n_samples=16 * steps))
    return timer.per_step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--root", default="benchmarks/out/suite")
    parser.add_argument("--only", default="", help="comma-separated monitors to keep: sa, gns, gwa, guard")
    parser.add_argument("--untimed", action="store_true",
                        help="no timers in the hooks: the ratio without their own cost (the shares read 0)")
    parser.add_argument("--sizes", default="0.2m,0.8m", help=f"comma-separated, from {list(SIZE_NAMES)}")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 220; --quick 120)")
    parser.add_argument("--pairs", type=int, default=None, help="pairs of runs per size (default 4; --quick 2)")
    args = parser.parse_args()
    sizes = [n for n in args.sizes.split(",") if n]
    if not sizes or any(n not in SIZE_NAMES for n in sizes):
        parser.error(f"--sizes: choose from {list(SIZE_NAMES)}, got {args.sizes!r}")
    only = tuple(n for n in args.only.split(",") if n)
    unknown = [n for n in only if n not in SLOTS]
    if unknown:
        parser.error(f"--only: unknown monitors {unknown}; choose from {list(SLOTS)}")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning_monitor"):
        logging.getLogger(name).setLevel(logging.ERROR)
    steps, reps = (120, 2) if args.quick else (220, 4)
    steps, reps = args.steps or steps, args.pairs or reps
    if steps <= 40:
        parser.error("--steps must exceed 40 (the first 20 steps of each run are not timed)")
    print(f"torch {torch.__version__}, 1 thread, {steps} steps per run, {reps} pairs, load {os.getloadavg()[0]:.1f}"
          + (f", only {', '.join(only)}" if only else ""))
    names = ("sa", "gns", "gwa", "guard", "preset")
    print("\n| model | ms/step without | ms/step with HealthMonitor() | ratio (median of pairs) | time in the hooks: "
          + " | ".join(names) + " | all |")
    print("|---|---|---|---|" + "---|" * (len(names) + 1))
    for label, config in ((SIZE_NAMES[n], SIZES[SIZE_NAMES[n]]) for n in sizes):
        base, mon, ratios = [], [], []
        shares: dict[str, list[float]] = {n: [] for n in names + ("all",)}
        steady: dict[str, list[float]] = {n: [] for n in names + ("all",)}
        for rep in range(reps):
            order = ("base", "suite") if rep % 2 == 0 else ("suite", "base")
            result = {}
            for which in order:
                clocks: dict = {}
                cbs = suite(None if args.untimed else clocks, only) if which == "suite" else []
                per_step = run(config, steps, cbs, args.root)
                result[which] = per_step
                if which == "suite":
                    for n in names:
                        shares[n].append(clocks.get(n, [0.0, 0.0])[0] / (per_step * steps))
                        steady[n].append(clocks.get(n, [0.0, 0.0])[1] / (per_step * (steps - SKIP)))
                    shares["all"].append(sum(c[0] for c in clocks.values()) / (per_step * steps))
                    steady["all"].append(sum(c[1] for c in clocks.values()) / (per_step * (steps - SKIP)))
            base.append(result["base"])
            mon.append(result["suite"])
            ratios.append(result["suite"] / result["base"])
        head = (f"{1e3 * statistics.median(base):.2f} | {1e3 * statistics.median(mon):.2f} | "
                f"{statistics.median(ratios):.3f}")
        for tag, table in (("whole run", shares), (f"steps {SKIP}+", steady)):
            cells = " | ".join(f"{100 * statistics.median(table[n]):.2f}%" for n in names + ("all",))
            print(f"| {label}, hooks timed over the {tag} | {head} | {cells} |", flush=True)
    print(f"\nload at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

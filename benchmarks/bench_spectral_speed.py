"""Speed of spectral alignment: warm-started top singular pair against a full SVD, and the
overhead of SpectralAlignmentMonitor on the example GPT.

1. ``top_singular_pair`` (single vector) and ``top_singular_subspace`` (the block of 4 the monitor
   uses), warm-started from the previous check's vector of a weight that has since moved (a small
   random update), against ``torch.linalg.svd`` of the same weight, on 1024x4096 and 4096x4096 weights
   with a spectral gap (Gaussian bulk plus three spikes; s2/s1 ~ 0.83). Accuracy: |cos(v, v_svd)|.
   Repetitions of both are interleaved in the same process; medians and their ratio are reported.
2. Monitor overhead at ``every_n_steps=50`` on the example GPT (2 layers, d_model 64, CPU, one thread):
   (a) the time spent inside the monitor (its hooks and its input-capture pre-hooks), measured in
   the run, over the training time of the same run; (b) end to end, ``Trainer.fit`` with and without
   the monitor, repetitions interleaved, median ratio (noisy on a shared machine: (a) is the figure);
   (c) the cost of a step that is not due (the hook returns at once; no forward hook is installed).

Run: ``/work/venv/bin/python benchmarks/bench_spectral_speed.py`` (``--quick``: fewer repetitions).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))

import lightning.pytorch as pl  # noqa: E402
from gpt import GPTConfig, GPTModule, make_loader  # noqa: E402

from lightning_monitor import SpectralAlignmentMonitor  # noqa: E402
from lightning_monitor.functional.spectral import top_singular_pair, top_singular_subspace  # noqa: E402

warnings.filterwarnings("ignore")


# ----------------------------------------------------------------------------- 1. power iteration vs SVD
def gapped_weight(n_out: int, n_in: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=g) / n_in**0.5
    edge = 1.0 + (n_out / n_in) ** 0.5 if n_out <= n_in else 1.0 + (n_in / n_out) ** 0.5
    for s in (3.0, 2.5, 2.0):
        u = torch.randn(n_out, generator=g)
        v = torch.randn(n_in, generator=g)
        w += s * edge * torch.outer(u / u.norm(), v / v.norm())
    return w


def bench_svd(shape: tuple[int, int], reps: int, n_iter: int) -> dict[str, Any]:
    w_prev = gapped_weight(*shape, seed=0)
    g = torch.Generator().manual_seed(1)
    # a training-like move between two checks: 1% of the weight's Frobenius norm, random direction
    delta = torch.randn(shape, generator=g)
    w = w_prev + 0.01 * w_prev.norm() / delta.norm() * delta
    _, _, v_prev, basis_prev = top_singular_subspace(w_prev)  # the previous check (cold start)
    times: dict[str, list[float]] = {"svd": [], "pair": [], "block": []}
    cos: dict[str, float] = {}
    for _ in range(reps):
        t = time.perf_counter()
        _, s_ref, vh = torch.linalg.svd(w, full_matrices=False)
        times["svd"].append(time.perf_counter() - t)
        t = time.perf_counter()
        sigma_p, _, v_p = top_singular_pair(w, v0=v_prev, n_iter=n_iter)
        times["pair"].append(time.perf_counter() - t)
        t = time.perf_counter()
        sigma_b, _, v_b, _ = top_singular_subspace(w, basis_prev, n_iter=n_iter)
        times["block"].append(time.perf_counter() - t)
        cos = {"pair": abs(float(v_p @ vh[0])), "block": abs(float(v_b @ vh[0]))}
        rel = {"pair": abs(float(sigma_p / s_ref[0]) - 1), "block": abs(float(sigma_b / s_ref[0]) - 1)}
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"shape": shape, "gap": float(s_ref[1] / s_ref[0]), "med": med, "cos": cos, "rel": rel, "n_iter": n_iter}


# ----------------------------------------------------------------------------- 2. monitor overhead
class TimedMonitor(SpectralAlignmentMonitor):
    """The monitor, with the time spent in its hooks (and its capture pre-hooks) accumulated."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.spent = {"due": 0.0, "not_due": 0.0}
        self.calls = {"due": 0, "not_due": 0}
        self.per_check: dict[int, float] = {}

    def _timed(self, step: int, fn: Any, *args: Any) -> None:
        t = time.perf_counter()
        fn(*args)
        key = "due" if self.is_due(step) else "not_due"
        dt = time.perf_counter() - t
        self.spent[key] += dt
        self.calls[key] += 1
        if key == "due":
            self.per_check[step] = self.per_check.get(step, 0.0) + dt

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        self._timed(trainer.global_step, super().on_train_batch_start, trainer, pl_module, batch, batch_idx)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # noqa: ANN001
        self._timed(trainer.global_step, super().on_before_optimizer_step, trainer, pl_module, optimizer)

    def setup(self, trainer, pl_module, stage):  # noqa: ANN001
        super().setup(trainer, pl_module, stage)
        capture = self._capture
        original = capture.sample

        def sample(x: torch.Tensor) -> torch.Tensor:
            t = time.perf_counter()
            out = original(x)
            dt = time.perf_counter() - t
            self.spent["due"] += dt
            step = self._armed_step if self._armed_step is not None else -1
            self.per_check[step] = self.per_check.get(step, 0.0) + dt
            return out

        capture.sample = sample  # type: ignore[method-assign]


def fit(monitor: bool, steps: int, every: int) -> tuple[float, Any]:
    pl.seed_everything(0, verbose=False)
    module = GPTModule(GPTConfig(n_layer=2, d_model=64, n_head=4, block_size=64), lr=3e-3)
    mon = TimedMonitor(every_n_steps=every) if monitor else None
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(
            max_steps=steps, accelerator="cpu", logger=pl.loggers.CSVLogger(tmp), enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[mon] if mon else [],
            num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=every,
        )
        loader = make_loader("prose", block_size=64, batch_size=16, n_samples=16 * steps)
        t = time.perf_counter()
        trainer.fit(module, loader)
        return time.perf_counter() - t, mon


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, 1024x4096 only")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=None, help="training repetitions of each kind [3; 2 with --quick]")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)\n")
    print("| weight | s2/s1 | full SVD (s) | warm pair, 4 it (s) | speed-up | 1-|cos| | warm block of 4, 4 it (s) | speed-up | 1-|cos| |")
    print("|---|---|---|---|---|---|---|---|---|")
    shapes = [(1024, 4096)] if args.quick else [(1024, 4096), (4096, 4096)]
    for shape in shapes:
        reps = 2 if (args.quick or shape[0] == 4096) else 3
        r = bench_svd(shape, reps, n_iter=4)
        m = r["med"]
        print(f"| {shape[0]}x{shape[1]} | {r['gap']:.2f} | {m['svd']:.3f} | {m['pair']:.4f} | {m['svd'] / m['pair']:.0f}x | "
              f"{abs(1 - r['cos']['pair']):.1e} | {m['block']:.4f} | {m['svd'] / m['block']:.0f}x | {abs(1 - r['cos']['block']):.1e} |", flush=True)

    steps, every = (200, 50) if args.quick else (400, 50)
    reps = args.reps or (2 if args.quick else 3)
    base, with_mon, inside, warm_checks, cold_checks = [], [], [], [], []
    mon = None
    for rep in range(reps):  # interleaved, alternating which goes first
        for monitored in ((False, True) if rep % 2 == 0 else (True, False)):
            t, m = fit(monitored, steps, every)
            if monitored:
                mon = m
                with_mon.append(t)
                inside.append((m.spent["due"] + m.spent["not_due"]) / t)
                checks = [m.per_check[s] for s in sorted(m.per_check)]
                cold_checks.append(checks[0])
                warm_checks.extend(checks[1:])
            else:
                base.append(t)
    assert mon is not None
    step_ms = statistics.median(base) / steps * 1e3
    warm_ms = statistics.median(warm_checks) * 1e3
    not_due_us = mon.spent["not_due"] / max(1, mon.calls["not_due"]) * 1e6
    print(f"\nMonitor overhead, example GPT (2 layers, d_model 64, 12 monitored Linear layers, max_rows 256), "
          f"{steps} steps, every_n_steps={every}, {reps} interleaved repetitions:")
    print("| measure | value |")
    print("|---|---|")
    print(f"| training step without monitor (median) | {step_ms:.1f} ms |")
    print(f"| warm check (capture + 12 layers + logging), median | {warm_ms:.1f} ms |")
    print(f"| first check (cold start, {steps // every} checks per run), median | {statistics.median(cold_checks) * 1e3:.1f} ms |")
    print(f"| step that is not due (two hooks returning at once) | {not_due_us:.1f} us per hook call |")
    print(f"| steady-state overhead: (warm check + {every - 1} not-due steps) / ({every} steps) | "
          f"{100 * (warm_ms + 2 * (every - 1) * not_due_us / 1e3) / (every * step_ms):.2f}% |")
    print(f"| time inside the monitor / training time, whole {steps}-step run incl. the cold check (median) | "
          f"{100 * statistics.median(inside):.2f}% |")
    print(f"| end to end: fit with / without monitor (median of ratios; noisy, shared machine) | "
          f"{statistics.median([a / b for a, b in zip(with_mon, base)]):.3f} |")


if __name__ == "__main__":
    main()

"""The suite on a GPU: ``HealthMonitor()`` at its defaults against the same training without it, on the example GPT at
two sizes (bf16-mixed, batch 32 x 256 tokens). On the larger one, the guard alone with its snapshots' copies to the
host made four ways (``lightning_monitor.snapshot._DEVICE_COPIES``): gathered into one buffer per dtype on the device and
carried to pinned memory in one transfer on a side stream (``flat``, the default), the same per tensor (``staged``),
straight to pinned memory on the training stream (``pinned``), and one blocking copy per tensor into pageable memory
(``waiting``, the path before); ``--alone``: each monitor alone too; ``--guard-variants``: the guard alone with one of
its costs taken away at a time (snapshots every 50 steps, no snapshot with ``action="warn"``, checks every 50 steps, non-finite
gradients not zeroed). Then, per size, the host time inside each monitor's hooks; and on one monitored run, the steps at which the package made the host wait for the device (CUDA's
sync detector), against the steps where a monitor was due.

Each round runs every variant once, in a rotated order. A run's time per step is the wall time from step ``SKIP`` to
its last step, the device synchronized at both ends, divided by the steps. Reported: the median per variant, and the
median over rounds of the per-round ratio to the run without the suite (the same round). Peak device memory is
``torch.cuda.max_memory_allocated``.

Needs a CUDA device. Run: python benchmarks/bench_cuda.py [--rounds 3] [--steps 150] [--sizes 19m,85m] [--alone]
[--guard-variants] [--ratios-only] [--json F]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from gpt import GPTModule, make_loader  # noqa: E402

import lightning_monitor as lm  # noqa: E402
from lightning_monitor import snapshot as snapshot_module  # noqa: E402

SIZES = {
    "19m": {"n_layer": 6, "n_head": 8, "d_model": 512, "block_size": 256},
    "85m": {"n_layer": 12, "n_head": 12, "d_model": 768, "block_size": 256},
}
BATCH = 32
SKIP = 30


class CudaTimer(Callback):
    """Wall time from the start of step ``SKIP`` to the end of the last step, the device synchronized at both ends."""

    def __init__(self) -> None:
        self.start = self.end = None
        self.steps = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == SKIP:
            torch.cuda.synchronize()
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        torch.cuda.synchronize()
        self.end, self.steps = time.perf_counter(), trainer.global_step - SKIP

    def per_step(self) -> float:
        return (self.end - self.start) / self.steps


def preset(**only: bool) -> Callable[[], list[Callback]]:
    return lambda: [lm.HealthMonitor(**only)]


ALONE = {"sa": "spectral", "gns": "noise_scale", "gwa": "gwa", "guard": "guard"}


def alone(name: str, **settings: Any) -> Callable[[], list[Callback]]:
    """The preset with only monitor ``name``, at the preset's settings updated with ``settings``."""
    return preset(**{slot: (settings or True) if slot == ALONE[name] else False for slot in ALONE.values()})


#: ``--guard-variants``: the guard alone with one of its costs taken away at a time, to tell them apart
GUARD_VARIANTS = {
    "guard alone, snapshot every 50 steps": {"snapshot_every_n_checks": 5},
    "guard alone, no snapshot (action='warn')": {"snapshot_every_n_checks": None, "action": "warn"},
    "guard alone, checks every 50 steps": {"every_n_steps": 50},
    "guard alone, gradients not zeroed": {"zero_nonfinite_grads": False},
}


def run(config: dict, steps: int, callbacks: list[Callback], root: str, copies: str = "flat") -> tuple[float, float]:
    snapshot_module._DEVICE_COPIES = copies
    pl.seed_everything(0, verbose=False)
    torch.cuda.reset_peak_memory_stats()
    timer = CudaTimer()
    trainer = pl.Trainer(max_steps=steps, accelerator="gpu", devices=1, precision="bf16-mixed",
                         logger=pl.loggers.CSVLogger(root, name="cuda"), callbacks=callbacks + [timer],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         log_every_n_steps=50)
    trainer.fit(GPTModule(config, lr=1e-3), make_loader("prose", block_size=config["block_size"], batch_size=BATCH,
                                                       n_samples=BATCH * steps))
    snapshot_module._DEVICE_COPIES = "flat"
    return timer.per_step(), torch.cuda.max_memory_allocated() / 2**30


def sync_steps(config: dict, steps: int, root: str) -> dict[str, Any]:
    """One run of ``HealthMonitor()``: the steps at which the package's code made the host wait for the device, and
    where (file:line function), as CUDA's sync detector reports them (tests/test_cuda.py's ``package_syncs``); the
    due steps of each monitor."""
    from test_cuda import package_syncs

    health = lm.HealthMonitor()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=steps, accelerator="gpu", devices=1, precision="bf16-mixed", logger=False,
                         callbacks=[health], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    with package_syncs([trainer]) as found:
        trainer.fit(GPTModule(config, lr=1e-3), make_loader("prose", block_size=config["block_size"],
                                                           batch_size=BATCH, n_samples=BATCH * steps))
    due = {m.name: [s for s in range(steps) if m.is_due(s)] for m in health.monitors}
    by_step: dict[int, list[str]] = {}
    for s, where in found:
        by_step.setdefault(s, [])
        if where not in by_step[s]:
            by_step[s].append(where)
    return {"steps": steps, "due": due, "sync_steps": {str(k): v for k, v in sorted(by_step.items())}}


def hook_times(config: dict, steps: int, root: str) -> dict[str, float]:
    """One run of ``HealthMonitor()`` with every monitor's hooks timed on the host (bench_suite's timers): the
    milliseconds per step spent inside each monitor's per-step hooks from step ``bench_suite.SKIP`` on (on a GPU the
    hooks' host time adds to the step where the host, not the device, sets the pace)."""
    import bench_suite

    clocks: dict[str, list[float]] = {}
    run(config, steps, bench_suite.suite(clocks), root)
    return {name: 1e3 * clock[1] / (steps - bench_suite.SKIP) for name, clock in clocks.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--sizes", default="19m,85m")
    parser.add_argument("--json", default=None)
    parser.add_argument("--alone", action="store_true", help="each monitor alone too, on the larger size")
    parser.add_argument("--ratios-only", action="store_true", help="leave out the hook times and the sync count")
    parser.add_argument("--guard-variants", action="store_true",
                        help="the guard alone with one of its costs taken away at a time (snapshots, checks, zeroing)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda.py needs a CUDA device.")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_monitor").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    root = tempfile.mkdtemp(prefix="bench_cuda_")
    sizes = args.sizes.split(",")
    largest = sizes[-1]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, lightning {pl.__version__}", flush=True)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sizes": {}}
    for size in sizes:
        config = SIZES[size]
        params = sum(p.numel() for p in GPTModule(config).parameters()) / 1e6
        variants: dict[str, tuple[Callable[[], list[Callback]], str]] = {
            "none": (lambda: [], "flat"), "suite": (preset(), "flat")}
        if size == largest:
            if args.alone:
                variants.update({f"{k} alone": (alone(k), "flat") for k in ALONE})
            else:
                variants["guard alone"] = (alone("guard"), "flat")
            variants["guard alone, copies staged"] = (alone("guard"), "staged")
            variants["guard alone, copies pinned"] = (alone("guard"), "pinned")
            variants["guard alone, copies waiting"] = (alone("guard"), "waiting")
            if args.guard_variants:
                variants.update({k: (alone("guard", **v), "flat") for k, v in GUARD_VARIANTS.items()})
        times: dict[str, list[float]] = {k: [] for k in variants}
        memory: dict[str, float] = {}
        names = list(variants)
        width = max(len(k) for k in names)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                make, copies = variants[name]
                t, mem = run(config, args.steps, make(), root, copies)
                gc.collect()
                times[name].append(t)
                memory[name] = max(memory.get(name, 0.0), mem)
                print(f"  {size} round {r} {name:{width}s} {1e3 * t:8.2f} ms/step  peak {mem:6.2f} GiB", flush=True)
        ratios = {k: statistics.median(times[k][i] / times["none"][i] for i in range(args.rounds)) for k in names}
        print(f"\n{size} ({params:.1f} M parameters), bf16-mixed, batch {BATCH} x {config['block_size']}, "
              f"{args.steps} steps ({SKIP} untimed), {args.rounds} rounds:")
        print(f"  {'variant':{width}s} {'ms/step':>9s} {'ratio':>7s} {'peak GiB':>9s}")
        for k in names:
            print(f"  {k:{width}s} {1e3 * statistics.median(times[k]):9.2f} {ratios[k]:7.3f} {memory[k]:9.2f}")
        out["sizes"][size] = {"params_m": params, "ms_per_step": {k: [1e3 * t for t in v] for k, v in times.items()},
                              "ratio": ratios, "peak_gib": memory}
    if args.ratios_only:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    for size in sizes:
        hooks = hook_times(SIZES[size], args.steps, root)
        print(f"\nhost time inside each monitor's hooks, {size}, HealthMonitor() (ms per step, from step 20): "
              + ", ".join(f"{k} {v:.3f}" for k, v in hooks.items()))
        out["sizes"][size]["hook_ms_per_step"] = hooks
    syncs = sync_steps(SIZES[largest], 120, root)
    print(f"\nsyncs from the package, HealthMonitor() at its defaults, {largest}, 120 steps:")
    print("  due steps: " + "; ".join(f"{k}: {v[:8]}{'...' if len(v) > 8 else ''}" for k, v in syncs["due"].items()))
    for step, where in syncs["sync_steps"].items():
        print(f"  step {step}: {', '.join(where)}")
    out["syncs"] = syncs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

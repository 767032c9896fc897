"""GWA on scikit-learn's digits: checkpoint choice without a validation set, mislabelled samples, cost.

For each seed and label-noise level (0% and 20% of the training labels flipped to another class):

* trains a small CNN (or ``--model mlp``) on 55% of ``load_digits``; 15% is a clean validation set,
  30% a clean test set;
* **selection**: the epoch GradientWeightAlignmentMonitor predicts (max GWA after the 10% warm-up,
  from training data only) vs the epoch of best validation accuracy; test accuracy of both epochs'
  weights (what ``ModelCheckpoint`` on either key restores), and of the last epoch;
* **suspects**: precision / recall of the ``k`` most negative samples (``k`` = number of flipped
  labels) of the predicted best epoch against the flipped labels;
* **overhead**: the same training with and without the monitor, interleaved in this process
  (``--reps`` pairs, alternating order), median of the per-pair time ratio; plus the time spent
  inside the monitor's hooks as a fraction of the baseline's training time.

* **realistic overhead**: the same pairs on a wide MLP (256-1024-1024-10, batch 256, ~30 ms steps,
  one epoch of 200 steps per run) on synthetic Gaussian classes: the monitor's cost where a training
  step is not a toy (``--realistic-only`` runs just this, about 2 minutes).

Run: ``python benchmarks/bench_gwa.py`` (about 12 minutes on 1 CPU thread) or ``--quick``; ``--selection-only``
skips the overhead runs (about 4 minutes).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import time
import warnings
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_monitor import GradientWeightAlignmentMonitor  # noqa: E402
from lightning_monitor.callbacks.gradient_weight_alignment import SUSPECTS_FILENAME  # noqa: E402


def split_digits(seed: int, flip: float) -> dict[str, Any]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    g = np.random.default_rng(seed)
    order = torch.from_numpy(g.permutation(len(y)))
    n_tr, n_va = int(0.55 * len(y)), int(0.15 * len(y))
    tr, va, te = order[:n_tr], order[n_tr : n_tr + n_va], order[n_tr + n_va :]
    y_tr = y[tr].clone()
    flipped = torch.zeros(n_tr, dtype=torch.bool)
    k = int(round(flip * n_tr))
    if k:
        which = torch.from_numpy(g.choice(n_tr, k, replace=False))
        y_tr[which] = (y_tr[which] + torch.from_numpy(g.integers(1, 10, k))) % 10
        flipped[which] = True
    return {
        "train": TensorDataset(x[tr], y_tr, torch.arange(n_tr)),
        "val": (x[va], y[va]),
        "test": (x[te], y[te]),
        "flipped": flipped,
    }


class Net(LightningModule):
    def __init__(self, kind: str = "cnn", opt: str = "adam") -> None:
        super().__init__()
        if kind == "cnn":
            self.body = nn.Sequential(
                nn.Unflatten(1, (1, 8, 8)),
                nn.Conv2d(1, 32, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(32, 64, 3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Flatten(),
                nn.Linear(64 * 16, 128),
                nn.ReLU(),
            )
        else:
            self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU())
        self.head = nn.Linear(128, 10)
        self.opt = opt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class EpochEval(Callback):
    """Validation and test accuracy of the weights at the end of every training epoch."""

    def __init__(self, val, test) -> None:
        self.val, self.test = val, test
        self.acc: list[tuple[float, float]] = []

    @torch.no_grad()
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pl_module.eval()
        out = []
        for x, y in (self.val, self.test):
            out.append(float((pl_module(x).argmax(-1) == y).float().mean()))
        pl_module.train()
        self.acc.append((out[0], out[1]))


class TimedGWA(GradientWeightAlignmentMonitor):
    """The monitor with the wall time spent in its hooks added up: per step, and at epoch end."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.spent = {"step": 0.0, "epoch": 0.0}
        self.epochs = 0

    def _timed(name: str, part: str):  # type: ignore[misc]
        def method(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return getattr(GradientWeightAlignmentMonitor, name)(self, *args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter() - t0

        return method

    on_train_batch_start = _timed("on_train_batch_start", "step")
    _on_head_forward = _timed("_on_head_forward", "step")
    on_train_epoch_start = _timed("on_train_epoch_start", "epoch")
    on_train_epoch_end = _timed("on_train_epoch_end", "epoch")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        t0 = time.perf_counter()
        finished = self._finished
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        part = "epoch" if self._finished and not finished else "step"
        self.epochs += part == "epoch"
        self.spent[part] += time.perf_counter() - t0


def trainer(callbacks, epochs: int, logger=False, root: str = ".") -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
    )


def selection_run(seed: int, flip: float, args) -> dict[str, Any]:
    data = split_digits(seed, flip)
    n_flip = int(data["flipped"].sum())
    seed_everything(seed, verbose=False)
    model = Net(args.model, args.opt)
    loader = DataLoader(data["train"], batch_size=args.batch_size, shuffle=True)
    gwa = GradientWeightAlignmentMonitor(index_fn=lambda b: b[2], suspects=max(n_flip, 50))
    ev = EpochEval(data["val"], data["test"])
    with tempfile.TemporaryDirectory() as root:
        logger = CSVLogger(root, name="gwa")
        trainer([gwa, ev], args.epochs, logger, root).fit(model, loader)
        with open(os.path.join(logger.log_dir, SUSPECTS_FILENAME)) as fh:
            rows = list(csv.DictReader(fh))
    val = [a for a, _ in ev.acc]
    test = [t for _, t in ev.acc]
    e_gwa = gwa.best_epoch
    e_val = int(np.argmax(val))
    # the stop=True rule replayed on the same scores (same code path as the callback)
    rule = GradientWeightAlignmentMonitor(patience=args.patience)
    rule._warmup_resolved = gwa._warmup_resolved
    e_stopped = None
    for rec in gwa.history:
        rule._select(rec["epoch"], rec["score"])
        if rule.best_epoch is not None and rule.wait >= rule.patience:
            e_stopped = rec["epoch"]
            break
    e_stop = rule.best_epoch
    out = {
        "seed": seed,
        "flip": flip,
        "epoch_gwa": e_gwa,
        "epoch_stop": e_stop,
        "stopped_at": e_stopped,
        "epoch_val": e_val,
        "test_gwa": test[e_gwa],
        "test_stop": test[e_stop],
        "test_val": test[e_val],
        "test_last": test[-1],
        "test_best": max(test),
        "n_flip": n_flip,
        "negative_at_best": gwa.history[e_gwa]["negative"],
        "n_train": len(data["train"]),
    }
    if n_flip:
        for tag, epoch in (("gwa", e_gwa), ("stop", e_stop), ("val", e_val), ("last", len(test) - 1)):
            ranked = sorted((float(r["score"]), int(r["index"])) for r in rows if int(r["epoch"]) == epoch)
            flagged = torch.tensor([i for _, i in ranked[:n_flip]], dtype=torch.long)
            hits = int(data["flipped"][flagged].sum())
            out[f"precision_{tag}"] = hits / max(len(flagged), 1)
    return out


class LoopTimer(Callback):
    """Wall time of the training loop itself (on_train_start to on_train_end), optimizer steps."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.t0 = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        self.elapsed = time.perf_counter() - self.t0
        self.steps = trainer.global_step


def paired_overhead(reps: int, epochs: int, make_model: Any, make_loader: Any) -> dict[str, Any]:
    """Interleaved pairs (alternating order) of the same training with and without the monitor."""
    ratios, fractions, step_us, epoch_ms, base_step, steps = [], [], [], [], [], 0
    for rep in range(reps):
        times: dict[str, float] = {}
        for mode in (("base", "gwa") if rep % 2 == 0 else ("gwa", "base")):
            seed_everything(rep, verbose=False)
            model, loader = make_model(), make_loader()
            timer = LoopTimer()
            gwa = TimedGWA(index_fn=lambda b: b[2], suspects=200, log_histograms=False) if mode == "gwa" else None
            with tempfile.TemporaryDirectory() as root:
                trainer([gwa, timer] if gwa else [timer], epochs, root=root).fit(model, loader)
            times[mode] = timer.elapsed
            steps = timer.steps
            if gwa is not None:
                step_us.append(1e6 * gwa.spent["step"] / timer.steps)
                epoch_ms.append(1e3 * gwa.spent["epoch"] / max(gwa.epochs, 1))
                spent = gwa.spent["step"] + gwa.spent["epoch"]
            else:
                base_step.append(timer.elapsed / timer.steps)
        ratios.append(times["gwa"] / times["base"])
        fractions.append(spent / times["base"])
    return {
        "steps": steps,
        "ratio": statistics.median(ratios),
        "fraction": statistics.median(fractions),
        "step_us": statistics.median(step_us),
        "epoch_ms": statistics.median(epoch_ms),
        "ms_base_step": 1e3 * statistics.median(base_step),
        "ratios": ratios,
    }


def overhead(args, batch_size: int) -> dict[str, Any]:
    """The overhead on the digits model (the selection benchmark's network)."""
    data = split_digits(0, 0.2)
    return paired_overhead(
        args.reps, args.overhead_epochs, lambda: Net(args.model, args.opt),
        lambda: DataLoader(data["train"], batch_size=batch_size, shuffle=True),
    )


class WideMLP(LightningModule):
    """A classifier whose step is not a toy: ``d_in -> width -> width -> classes`` (ReLU), Adam."""

    def __init__(self, d_in: int, width: int, classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def synthetic_classes(n: int, d_in: int, classes: int, flip: float = 0.2, seed: int = 0) -> TensorDataset:
    """Gaussian classes (unit noise around random means of norm ~2) with ``flip`` of the labels flipped."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(classes, d_in, generator=g) * (2.0 / d_in**0.5)
    y = torch.randint(0, classes, (n,), generator=g)
    x = means[y] + torch.randn(n, d_in, generator=g)
    flipped = torch.rand(n, generator=g) < flip
    y = torch.where(flipped, (y + torch.randint(1, classes, (n,), generator=g)) % classes, y)
    return TensorDataset(x, y, torch.arange(n))


def realistic_overhead(args) -> dict[str, Any]:
    """The overhead on a realistically sized step: interleaved pairs (alternating order) of one epoch of
    ``--real-steps`` steps of a wide MLP with and without the monitor; batches are gathered by index
    (a BatchSampler), so the loader costs what a real in-memory loader costs."""
    from torch.utils.data import BatchSampler, RandomSampler

    bs = args.real_batch_size
    data = synthetic_classes(args.real_steps * bs, args.real_d_in, args.real_classes)
    return paired_overhead(
        args.real_reps, 1, lambda: WideMLP(args.real_d_in, args.real_width, args.real_classes),
        lambda: DataLoader(data, sampler=BatchSampler(RandomSampler(data), batch_size=bs, drop_last=False),
                           batch_size=None),
    )


def realistic_table(args) -> None:
    print(
        f"\nrealistic overhead: WideMLP {args.real_d_in}-{args.real_width}-{args.real_width}-{args.real_classes}, "
        f"Adam, batch {args.real_batch_size}, one epoch of {args.real_steps} steps per run, {args.real_reps} "
        "interleaved pairs; synthetic Gaussian classes, 20% flipped labels; index_fn on, 200 suspects, no logger "
        "(target <= 1%)\n"
    )
    print(
        "| steps/epoch | baseline ms/step | monitor us/step (in fit) | monitor ms/epoch end | per-step part "
        "| all hooks / baseline | median time ratio monitored / baseline | ratios |"
    )
    print("|---|---|---|---|---|---|---|---|")
    o = realistic_overhead(args)
    print(
        f"| {o['steps']} | {o['ms_base_step']:.2f} | {o['step_us']:.0f} | {o['epoch_ms']:.2f} | "
        f"{o['step_us'] / (10 * o['ms_base_step']):.3f}% | {100 * o['fraction']:.3f}% | {o['ratio']:.4f} | "
        f"{' '.join(f'{x:.3f}' for x in o['ratios'])} |",
        flush=True,
    )


def isolated_step_cost(args, batch_size: int, blocks: int = 15, n: int = 400) -> float:
    """Median extra microseconds per step of the monitor's per-step work: the head's forward with the
    monitor armed (targets, indices, hook, kept tensors) minus the plain forward, in interleaved blocks."""
    model = Net(args.model, args.opt)
    gwa = GradientWeightAlignmentMonitor(index_fn=lambda b: b[2], suspects=200, log_histograms=False)
    gwa._head_name, gwa._head = "head", model.head
    gwa._reset_epoch(None)
    x, y, idx = torch.randn(batch_size, 64), torch.randint(0, 10, (batch_size,)), torch.arange(batch_size)
    feats = model.body(x)
    batch = (x, y, idx)

    fake_trainer = SimpleNamespace(global_step=0)

    def plain() -> None:
        model.head(feats)

    def armed() -> None:
        gwa.on_train_batch_start(fake_trainer, model, batch, 0)  # type: ignore[arg-type]
        model.head(feats)
        if gwa._stashed > 1 << 18:  # what an epoch end would score; not part of the per-step cost
            gwa._stash, gwa._stashed = [], 0

    diffs = []
    for block in range(blocks):
        t = {}
        order = (("plain", plain), ("armed", armed))
        for name, fn in order if block % 2 == 0 else order[::-1]:
            gwa.release()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t[name] = (time.perf_counter() - t0) / n
        diffs.append(t["armed"] - t["plain"])
    return 1e6 * statistics.median(diffs)


def selection_table(args) -> None:
    print(
        "\n| flip | seed | GWA epoch (max) | GWA stop: best / stopped | val epoch | test @GWA max | test @GWA stop "
        "| test @val | GWA max - val (pt) | GWA stop - val (pt) | test @last | best test | negative @GWA max "
        "| P@k @GWA max | P@k @GWA stop | P@k @val | P@k @last |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    results = []

    def fmt(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:.3f}" if key in r else "-"

    for flip in (0.0, 0.2):
        for seed in args.seeds:
            r = selection_run(seed, flip, args)
            results.append(r)
            stopped = "-" if r["stopped_at"] is None else r["stopped_at"]
            print(
                f"| {flip:.0%} | {seed} | {r['epoch_gwa']} | {r['epoch_stop']} / {stopped} | {r['epoch_val']} | "
                f"{100 * r['test_gwa']:.2f} | {100 * r['test_stop']:.2f} | {100 * r['test_val']:.2f} | "
                f"{100 * (r['test_gwa'] - r['test_val']):+.2f} | {100 * (r['test_stop'] - r['test_val']):+.2f} | "
                f"{100 * r['test_last']:.2f} | {100 * r['test_best']:.2f} | {int(r['negative_at_best'])} | "
                f"{fmt(r, 'precision_gwa')} | {fmt(r, 'precision_stop')} | {fmt(r, 'precision_val')} | "
                f"{fmt(r, 'precision_last')} |",
                flush=True,
            )
    for flip in (0.0, 0.2):
        sel = [r for r in results if r["flip"] == flip]
        d_max = statistics.mean(100 * (r["test_gwa"] - r["test_val"]) for r in sel)
        d_stop = statistics.mean(100 * (r["test_stop"] - r["test_val"]) for r in sel)
        line = (
            f"flip {flip:.0%}: mean test accuracy GWA max - val = {d_max:+.2f} pt, GWA stop - val = {d_stop:+.2f} pt "
            "(target >= -1)"
        )
        if flip:
            line += (
                f"; mean precision@k at the GWA max epoch = {statistics.mean(r['precision_gwa'] for r in sel):.3f}, "
                f"GWA stop epoch = {statistics.mean(r['precision_stop'] for r in sel):.3f}, "
                f"val epoch = {statistics.mean(r['precision_val'] for r in sel):.3f} (target >= 0.8)"
            )
        print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 seed, fewer epochs and repetitions")
    p.add_argument("--overhead-only", action="store_true", help="skip the selection runs")
    p.add_argument("--selection-only", action="store_true", help="skip the overhead runs")
    p.add_argument(
        "--realistic-only", action="store_true", help="only the overhead on the wide MLP (about 2 minutes)"
    )
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    p.add_argument(
        "--opt", choices=["adam", "sgd"], default="adam", help="adam (lr 1e-3) or sgd (lr 0.05, momentum 0.9, wd 5e-4)"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--patience", type=int, default=5, help="patience of the replayed stop=True rule")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--overhead-epochs", type=int, default=5)
    p.add_argument("--overhead-batch-sizes", type=int, nargs="+", default=[32, 128])
    p.add_argument("--real-reps", type=int, default=7, help="pairs of the wide-MLP overhead runs")
    p.add_argument("--real-steps", type=int, default=200, help="steps per epoch of the wide-MLP runs")
    p.add_argument("--real-batch-size", type=int, default=256)
    p.add_argument("--real-width", type=int, default=1024)
    p.add_argument("--real-d-in", type=int, default=256)
    p.add_argument("--real-classes", type=int, default=10)
    args = p.parse_args()
    if args.reps < 1 or args.real_reps < 1:
        p.error("--reps and --real-reps must be at least 1 (--selection-only skips the overhead runs)")
    if args.quick:
        args.seeds, args.epochs, args.reps, args.overhead_epochs = args.seeds[:1], 20, 3, 2
        args.real_reps = min(args.real_reps, 3)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_monitor").setLevel(logging.ERROR)

    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    if args.realistic_only:
        realistic_table(args)
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        return
    print(f"model={args.model} opt={args.opt} epochs={args.epochs} batch={args.batch_size} seeds={args.seeds}")
    if not args.overhead_only:
        selection_table(args)
    if args.selection_only:
        return

    print(
        f"\noverhead: {args.reps} interleaved pairs per batch size, {args.overhead_epochs} epochs each, training loop "
        "time only; index_fn on, 200 suspects (target <= 1%)\n"
    )
    print(
        "| batch size | steps/epoch | baseline ms/step | monitor us/step (isolated) | monitor us/step (in fit) "
        "| monitor ms/epoch end | per-step part (isolated / in fit) | all hooks / baseline "
        "| median time ratio monitored / baseline | ratios |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for bs in args.overhead_batch_sizes:
        iso = isolated_step_cost(args, bs)
        o = overhead(args, bs)
        steps = -(-int(0.55 * 1797) // bs)
        print(
            f"| {bs} | {steps} | {o['ms_base_step']:.2f} | {iso:.0f} | {o['step_us']:.0f} | {o['epoch_ms']:.2f} | "
            f"{iso / (10 * o['ms_base_step']):.2f}% / {o['step_us'] / (10 * o['ms_base_step']):.2f}% | "
            f"{100 * o['fraction']:.2f}% | {o['ratio']:.4f} | "
            f"{' '.join(f'{x:.3f}' for x in o['ratios'])} |",
            flush=True,
        )
    realistic_table(args)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

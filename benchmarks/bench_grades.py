"""GradES fine-tuning benchmark on CPU: wall-clock, final validation quality, time per step as
components freeze, and the cost of the statistic before any freeze.

1. Pre-train the example GPT (4 layers, d_model 128) on the "prose" corpus (cached in a temp dir).
2. Fine-tune it on "arith" (``"17 plus 25 is 42."``) for the same step budget, same seed, with and
   without :class:`~lightning_monitor.GradientEarlyStopping`; report wall-clock of ``fit``, final
   validation loss and accuracy on the answer digits, and the median time per step by frozen fraction.
3. Overhead: runs with a tau that never freezes, interleaved with baseline runs in the same process;
   the ratio of median step times.

``--prefix`` runs only another measurement: the time per step once a prefix of the blocks is frozen, with
and without ``cut_frozen_prefix``. An 8-block GPT (d_model 128, 512 tokens a step, embeddings frozen, a
45-character vocabulary, so that the blocks' forward and backward are nearly all of a step) is trained by
a plain loop (forward, backward, AdamW step; single thread, process CPU time per step) with nothing
frozen, and with the components of its first ``k`` blocks frozen (``freeze_parameters``), without and
with the cut (the rest of those blocks frozen as ``frozen_prefix`` says, which is what the callback does);
the configurations take turns, a few steps each, over several rounds. The expected ratio of each
configuration is the share of the step's compute left: the FLOPs of its forward and backward
(``torch.utils.flop_counter``) over those with nothing frozen.

Run: ``/work/venv/bin/python benchmarks/bench_grades.py`` (``--quick`` for a smoke run;
``--prefix`` for the frozen-prefix measurement only; ``--grades-kwargs '{"reference_at": "grace_end"}'`` for
further arguments of the callback).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
from gpt import GPT, STOI, GPTConfig, GPTModule, make_loader  # noqa: E402

from lightning_monitor import GradientEarlyStopping  # noqa: E402
from lightning_monitor.functional.grades import (  # noqa: E402
    block_container,
    find_components,
    freeze_parameters,
    frozen_prefix,
)

DIGITS = {STOI[c] for c in "0123456789"}


class StepTimer(pl.Callback):
    """Wall and CPU time of every training batch (forward, backward, optimizer step, callbacks)."""

    def __init__(self) -> None:
        self.times: list[tuple[int, float]] = []
        self.cpu: list[float] = []
        self._t0 = self._c0 = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.times.append((trainer.global_step - 1, time.perf_counter() - self._t0))
        self.cpu.append(time.process_time() - self._c0)


class TimedGradES(GradientEarlyStopping):
    """GradientEarlyStopping that also records the CPU time of its own hook (the statistic's cost)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hook_cpu: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        c0 = time.process_time()
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self.hook_cpu.append(time.process_time() - c0)


def answer_mask(x: torch.Tensor) -> torch.Tensor:
    """Positions whose *target* (the next character) is an answer digit: after "is " and before "."."""
    s_id, i_id, sp, dot = STOI["s"], STOI["i"], STOI[" "], STOI["."]
    mask = torch.zeros_like(x, dtype=torch.bool)
    for b in range(x.shape[0]):
        row = x[b].tolist()
        inside = False
        for t in range(len(row)):
            if t >= 2 and row[t] == sp and row[t - 1] == s_id and row[t - 2] == i_id:
                inside = True
            elif row[t] == dot:
                inside = False
            mask[b, t] = inside
    return mask


@torch.no_grad()
def evaluate(module: GPTModule, loader: Any) -> tuple[float, float]:
    """Validation loss (all tokens) and accuracy on the answer digits."""
    module.eval()
    losses, hits, total = [], 0, 0
    for x, y in loader:
        logits = module(x)
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item())
        m = answer_mask(x) & torch.isin(y, torch.tensor(sorted(DIGITS)))
        hits += int((logits.argmax(-1)[m] == y[m]).sum())
        total += int(m.sum())
    module.train()
    return statistics.fmean(losses), hits / max(total, 1)


def _trainer(steps: int, callbacks: list, root: str) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, default_root_dir=root, num_sanity_val_steps=0,
    )


def pretrain(cfg: GPTConfig, steps: int, root: str) -> dict[str, torch.Tensor]:
    key = hashlib.sha1(json.dumps([vars(cfg), steps]).encode()).hexdigest()[:10]
    path = Path(tempfile.gettempdir()) / f"lm_bench_grades_pretrained_{key}.pt"
    if path.exists():
        print(f"pre-trained weights: {path} (cached)")
        return torch.load(path)
    pl.seed_everything(0)
    module = GPTModule(cfg, lr=3e-3)
    t0 = time.perf_counter()
    _trainer(steps, [], root).fit(module, make_loader("prose", block_size=cfg.block_size, batch_size=16))
    print(f"pre-trained {steps} steps on prose in {time.perf_counter() - t0:.0f} s -> {path}")
    state = module.state_dict()
    torch.save(state, path)
    return state


def finetune(
    cfg: GPTConfig, state: dict[str, torch.Tensor], steps: int, lr: float, root: str,
    grades: Optional[GradientEarlyStopping], val: Any, seed: int = 1,
) -> dict[str, Any]:
    pl.seed_everything(seed)
    module = GPTModule(cfg, lr=lr)
    module.load_state_dict(state)
    timer = StepTimer()
    callbacks: list = [timer] + ([grades] if grades is not None else [])
    trainer = _trainer(steps, callbacks, root)
    loader = make_loader("arith", block_size=cfg.block_size, batch_size=16, seed=seed)
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.fit(module, loader)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    loss, acc = evaluate(module, val) if val is not None else (float("nan"), float("nan"))
    frozen = dict(grades.frozen) if grades is not None else {}
    n = len(grades.components) if grades is not None else 1
    by_fraction: dict[str, list[float]] = {}
    cpu_by_fraction: dict[str, list[float]] = {}
    for (step, dt), ct in list(zip(timer.times, timer.cpu))[3:]:  # the first steps warm up allocators
        frac = sum(1 for s in frozen.values() if s < step) / n
        bucket = "0%" if frac == 0 else ("1-50%" if frac <= 0.5 else ("51-99%" if frac < 1 else "100%"))
        by_fraction.setdefault(bucket, []).append(dt)
        cpu_by_fraction.setdefault(bucket, []).append(ct)
    return {
        "wall": wall, "cpu": cpu, "steps": trainer.global_step, "val_loss": loss, "val_acc": acc, "frozen": frozen,
        "step_ms": {k: 1000 * statistics.median(v) for k, v in by_fraction.items()},
        "step_cpu_ms": {k: 1000 * statistics.median(v) for k, v in cpu_by_fraction.items()},
        "step_n": {k: len(v) for k, v in by_fraction.items()},
        "median_ms": 1000 * statistics.median(dt for _, dt in timer.times[3:]),
        "median_cpu_ms": 1000 * statistics.median(timer.cpu[3:]),
    }


def _prefix_model(cfg: GPTConfig, k: int, cut: bool) -> tuple[GPT, torch.optim.Optimizer]:
    """The GPT with its embeddings frozen and the components of its first ``k`` blocks frozen; with ``cut``
    also the rest of those blocks (their norms), so that the backward stops at the end of block ``k - 1``."""
    torch.manual_seed(0)
    model = GPT(cfg)
    model.tok_emb.weight.requires_grad_(False)
    model.pos_emb.weight.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    comps = find_components(model)
    container = block_container(model, comps)
    assert container == "blocks"
    freeze_parameters([p for n, c in comps.items() if int(n.split(".")[1]) < k for p in c.params], [opt])
    if cut:
        prefix = frozen_prefix(model, container)
        assert prefix.depth == k and not prefix.front
        freeze_parameters(prefix.params.values(), [opt])
    return model, opt


def _prefix_step(model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    logits = model(x)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    opt.step()


def _step_flops(model: GPT, x: torch.Tensor, y: torch.Tensor) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def prefix_benchmark(args: argparse.Namespace) -> None:
    """Time per step with a frozen prefix of ``k`` of the blocks, with and without the cut, against the
    share of the step's FLOPs left (see the module docstring)."""
    n = args.prefix_layers
    cfg = GPTConfig(n_layer=n, n_head=4, d_model=args.prefix_d_model, block_size=64, mlp_ratio=4)
    ks = [k for k in args.prefix_k if 0 < k <= n]
    configs = [(0, False)] + [(k, cut) for k in ks for cut in (False, True)]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.prefix_batch, cfg.block_size + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    models = {c: _prefix_model(cfg, *c) for c in configs}
    flops = {c: _step_flops(models[c][0], x, y) for c in configs}
    for model, opt in models.values():  # warm-up: allocators, AdamW state
        for _ in range(2):
            _prefix_step(model, opt, x, y)
    cpu: dict[tuple[int, bool], list[float]] = {c: [] for c in configs}
    wall: dict[tuple[int, bool], list[float]] = {c: [] for c in configs}
    for _ in range(args.prefix_reps):  # the configurations take turns
        for c in configs:
            model, opt = models[c]
            for _ in range(args.prefix_steps):
                t0, c0 = time.perf_counter(), time.process_time()
                _prefix_step(model, opt, x, y)
                cpu[c].append(time.process_time() - c0)
                wall[c].append(time.perf_counter() - t0)
    med = statistics.median
    base_cpu, base_wall, base_flops = med(cpu[0, False]), med(wall[0, False]), flops[0, False]
    print(f"\nfrozen prefix: GPT {n} blocks, d_model {cfg.d_model}, {args.prefix_batch}x{cfg.block_size} tokens a step, "
          f"embeddings frozen, AdamW, 1 thread; {args.prefix_reps} interleaved rounds of {args.prefix_steps} steps per "
          f"configuration; forward+backward {base_flops / 1e9:.2f} GFLOP a step with nothing frozen")
    print("expected = FLOPs of the step's forward and backward over those with nothing frozen; measured = median "
          "CPU time per step over that with nothing frozen")
    print("\n| frozen blocks | cut | compute frozen | expected ratio | median CPU ms/step | measured ratio "
          "| median wall ms/step | wall ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for k, cut in configs:
        expected = flops[k, cut] / base_flops
        c_ms, w_ms = 1000 * med(cpu[k, cut]), 1000 * med(wall[k, cut])
        print(f"| {k}/{n} | {'yes' if cut else 'no'} | {100 * (1 - expected):.1f}% | {expected:.3f} | {c_ms:.1f} | "
              f"{c_ms / (1000 * base_cpu):.3f} | {w_ms:.1f} | {w_ms / (1000 * base_wall):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model and few steps (smoke run)")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=600, help="fine-tuning step budget")
    parser.add_argument("--lr", type=float, default=1e-3, help="fine-tuning learning rate")
    parser.add_argument("--tau", type=float, default=0.4)
    parser.add_argument("--criterion", default="grad", choices=["grad", "update"])
    parser.add_argument("--grace", type=float, default=0.3)
    parser.add_argument("--smoothing", type=float, default=0.9)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions of each fine-tuning run")
    parser.add_argument("--no-overhead", action="store_true", help="skip the overhead measurement")
    parser.add_argument("--grades-kwargs", default="{}",
                        help="JSON object of further GradientEarlyStopping arguments, e.g. '{\"reference_at\": \"grace_end\"}' "
                             "(tau, every_n_steps, criterion, grace_fraction, smoothing: use their flags)")
    parser.add_argument("--overhead-reps", type=int, default=5)
    parser.add_argument("--overhead-steps", type=int, default=30)
    parser.add_argument("--prefix", action="store_true",
                        help="only measure the time per step with a frozen prefix of the blocks, with and without the cut")
    parser.add_argument("--prefix-layers", type=int, default=8)
    parser.add_argument("--prefix-d-model", type=int, default=128)
    parser.add_argument("--prefix-batch", type=int, default=8)
    parser.add_argument("--prefix-k", type=int, nargs="+", default=[2, 4, 6], help="numbers of frozen leading blocks")
    parser.add_argument("--prefix-reps", type=int, default=8, help="interleaved rounds")
    parser.add_argument("--prefix-steps", type=int, default=6, help="steps per configuration and round")
    args = parser.parse_args()
    extra = json.loads(args.grades_kwargs)
    if not isinstance(extra, dict):
        parser.error("--grades-kwargs must be a JSON object")
    clash = sorted(set(extra) & {"tau", "every_n_steps", "criterion", "grace_fraction", "smoothing", "log_stats"})
    if clash:
        parser.error(f"--grades-kwargs: set {clash} with their own flags (--tau, --every, --criterion, --grace, --smoothing)")
    GradientEarlyStopping(**extra)  # fail on a bad argument before any training
    if args.quick:
        args.d_model, args.layers, args.pretrain_steps, args.steps = 64, 2, 60, 80
        args.overhead_reps, args.overhead_steps, args.reps = 2, 20, 1
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_monitor").setLevel(logging.ERROR)
    if args.prefix:
        prefix_benchmark(args)
        return

    cfg = GPTConfig(n_layer=args.layers, n_head=4, d_model=args.d_model, block_size=64)
    root = tempfile.mkdtemp(prefix="bench_grades_")
    state = pretrain(cfg, args.pretrain_steps, root)
    val = make_loader("arith", block_size=64, batch_size=32, n_samples=512, seed=100, shuffle=False)

    def make_cb(tau: float, every: int) -> TimedGradES:
        return TimedGradES(tau=tau, criterion=args.criterion, grace_fraction=args.grace,
                           smoothing=args.smoothing, every_n_steps=every, log_stats=True, **extra)

    # --- 1. fine-tuning: baseline vs GradES, same seed, same budget; repetitions interleaved
    base_runs, grades_runs = [], []
    for _ in range(args.reps):
        base_runs.append(finetune(cfg, state, args.steps, args.lr, root, None, val))
        grades_runs.append(finetune(cfg, state, args.steps, args.lr, root, make_cb(args.tau, args.every), val))
    base, grades = base_runs[-1], grades_runs[-1]
    med = statistics.median
    speedups = [b["wall"] / g["wall"] for b, g in zip(base_runs, grades_runs)]
    cpu_speedups = [b["cpu"] / g["cpu"] for b, g in zip(base_runs, grades_runs)]
    print(f"\nfine-tuning budget {args.steps} steps, lr {args.lr:g}, {args.reps} interleaved repetitions; times are "
          f"medians, speedups medians of the per-pair ratios (wall: {', '.join(f'{x:.2f}' for x in speedups)}; "
          f"CPU: {', '.join(f'{x:.2f}' for x in cpu_speedups)})")
    print("\n| run | steps | wall-clock (s) | wall speedup | CPU time (s) | CPU speedup | val loss | vs baseline "
          "| answer-digit acc |")
    print("|---|---|---|---|---|---|---|---|---|")
    name = f"GradES (tau={args.tau:g}, {args.criterion}, EMA {args.smoothing:g}, every {args.every}" + "".join(
        f", {k}={v!r}" for k, v in extra.items()) + ")"
    for label, r, runs, sp, csp in (("full fine-tuning", base, base_runs, 1.0, 1.0),
                                    (name, grades, grades_runs, med(speedups), med(cpu_speedups))):
        print(f"| {label} | {r['steps']} | {med(x['wall'] for x in runs):.1f} | {sp:.2f}x | "
              f"{med(x['cpu'] for x in runs):.1f} | {csp:.2f}x | {r['val_loss']:.4f} | "
              f"{100 * (r['val_loss'] / base['val_loss'] - 1):+.2f}% | {100 * r['val_acc']:.1f}% |")
    print("\n| frozen fraction at the step | steps | median wall ms/step | vs no freeze | median CPU ms/step | vs no freeze |")
    print("|---|---|---|---|---|---|")
    ref = med(r["step_ms"]["0%"] for r in grades_runs)
    cref = med(r["step_cpu_ms"]["0%"] for r in grades_runs)
    for bucket in ("0%", "1-50%", "51-99%", "100%"):
        if bucket in grades["step_ms"]:
            ms = med(r["step_ms"][bucket] for r in grades_runs if bucket in r["step_ms"])
            cms = med(r["step_cpu_ms"][bucket] for r in grades_runs if bucket in r["step_cpu_ms"])
            print(f"| {bucket} | {grades['step_n'][bucket]} | {ms:.1f} | {ms / ref:.2f}x | {cms:.1f} | {cms / cref:.2f}x |")
    freeze_steps = sorted(grades["frozen"].values())
    print(f"\nfreeze steps of the {len(grades['frozen'])} frozen components: {freeze_steps}; baseline median "
          f"{med(r['median_ms'] for r in base_runs):.1f} ms/step wall, {med(r['median_cpu_ms'] for r in base_runs):.1f} CPU")
    same = all(r["val_loss"] == base["val_loss"] for r in base_runs) and all(
        r["val_loss"] == grades["val_loss"] for r in grades_runs)
    print(f"repetitions give identical validation results: {same}")

    # --- 2. overhead before any freeze: tau that never freezes, interleaved with baseline runs
    rows = []
    for every in (() if args.no_overhead else (args.every, 1)):
        ratios, cpu_ratios, b_ms, g_ms, hook_ms, hook_share = [], [], [], [], [], []
        for _ in range(args.overhead_reps):
            b = finetune(cfg, state, args.overhead_steps, args.lr, root, None, None)
            cb = make_cb(1e-12, every)
            g = finetune(cfg, state, args.overhead_steps, args.lr, root, cb, None)
            hook_ms.append(1000 * statistics.fmean(cb.hook_cpu))  # mean CPU ms of the hook per step
            hook_share.append(hook_ms[-1] / b["median_cpu_ms"])
            b_ms.append(b["median_ms"])
            g_ms.append(g["median_ms"])
            ratios.append(g["median_ms"] / b["median_ms"])
            cpu_ratios.append(g["median_cpu_ms"] / b["median_cpu_ms"])
        rows.append((every, statistics.median(b_ms), statistics.median(g_ms), statistics.median(ratios),
                     statistics.median(cpu_ratios), statistics.median(hook_ms), statistics.median(hook_share)))
    if not rows:
        return
    print(f"\n{args.overhead_reps} interleaved pairs of {args.overhead_steps}-step runs, tau=1e-12 (nothing freezes); "
          "overhead = median over pairs of the ratio of median step times")
    print("hook CPU = CPU time inside GradES's on_before_optimizer_step per optimizer step (checks amortised), "
          "as a share of the baseline's median CPU time per step")
    print("\n| statistic every n steps | baseline ms/step | GradES ms/step (no freeze) | wall overhead | CPU overhead "
          "| hook CPU ms/step | hook share |")
    print("|---|---|---|---|---|---|---|")
    for every, b, g, r, c, h, share in rows:
        print(f"| {every} | {b:.1f} | {g:.1f} | {100 * (r - 1):+.1f}% | {100 * (c - 1):+.1f}% | {h:.2f} | "
              f"{100 * share:.2f}% |")


if __name__ == "__main__":
    main()

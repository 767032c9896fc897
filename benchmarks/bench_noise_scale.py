"""Gradient noise scale and per-example gradient norms: exactness, estimate correctness, cost, memory.

Run: /work/venv/bin/python benchmarks/bench_noise_scale.py [--quick] [--crossover]

1. Exactness of PerExampleGradNorms.squared_norms() against torch.func (vmap over grad), fp32, on an MLP,
   a CNN and a small transformer, for every Linear strategy (fused: the whole batch in one batched
   matmul, and one example at a time as on CPU for large layers).
2. Closed-form check: linear regression with Gaussian inputs at fixed weights, where
   tr(Sigma) = (d + 1)|e|^2 + d s^2 and |G|^2 = |e|^2; smoothed B_simple against the truth.
3. Cost of a due step (forward + backward + norms, read on the host) against a plain forward + backward
   in the same process, interleaved, median over repetitions, one thread: a token-wise model
   (B=8, T=128, d=256, hidden 1024, 4 Linear layers); BackPACK's BatchL2Grad side by side when
   installed (optional: pip install --no-deps backpack-for-pytorch einops unfoldNd); torch.func for
   reference; the callback's hooks on a step that is not due; the fused Linear path as it was before it
   worked a chunk of examples at a time (whole batch in one batched matmul).
4. Peak memory of the same step (tensor allocations made by the step, tracked by a dispatch mode).

--crossover: only the fused Linear against the Gram form over sequence lengths and widths (the
measurements behind GRAM_OVER_FUSED, the rule of linear_strategy="auto").
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import weakref
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from lightning_monitor import GradientNoiseScaleMonitor, PerExampleGradNorms  # noqa: E402
from lightning_monitor.functional import NoiseScaleEMA, noise_scale_estimates  # noqa: E402
from lightning_monitor.probes import per_example  # noqa: E402

#: (label, linear_strategy, CPU_CHUNK_BYTES or None for the default)
STRATEGIES = (("auto", "auto", None), ("fused, whole batch", "fused", 2**62),
              ("fused, one example at a time", "fused", 1), ("gram", "gram", None),
              ("materialize", "materialize", None))


# ----------------------------------------------------------------------------- 1. exactness


def exactness() -> list[list[str]]:
    from test_per_example import CNN, MLP, TinyTransformer, ce_seq, oracle

    cases = [
        ("MLP (B=32, 2-D Linear + LayerNorm)", MLP, lambda: (torch.randn(32, 12), torch.randint(0, 5, (32,))), F.cross_entropy),
        ("CNN (B=16, Conv2d: groups, stride, dilation, reflect pad)", CNN,
         lambda: (torch.randn(16, 3, 8, 8), torch.randint(0, 5, (16,))), F.cross_entropy),
        ("Transformer (B=8, T=7: Embedding, attention from Linear, LayerNorm, RMSNorm, MLP)", TinyTransformer,
         lambda: (torch.randint(0, 11, (8, 7)), torch.randint(0, 11, (8, 7))), ce_seq),
        ("Transformer, tied embedding / head", lambda: TinyTransformer(tied=True),
         lambda: (torch.randint(0, 11, (8, 7)), torch.randint(0, 11, (8, 7))), ce_seq),
    ]
    rows = []
    for name, make, data, loss_fn in cases:
        torch.manual_seed(0)
        model = make()
        x, y = data()
        ref = oracle(model, loss_fn, x, y)
        errs = []
        for _, strategy, chunk_bytes in STRATEGIES:
            model.zero_grad()
            saved = per_example.CPU_CHUNK_BYTES
            per_example.CPU_CHUNK_BYTES = chunk_bytes or saved
            try:
                with PerExampleGradNorms(model, linear_strategy=strategy) as probe:
                    loss_fn(model(x), y).backward()
            finally:
                per_example.CPU_CHUNK_BYTES = saved
            total = torch.stack([ref[n] for n in probe.covered]).sum(0)
            errs.append(float(((probe.squared_norms().double() - total).abs() / total).max()))
        n_all = len(list(model.parameters()))
        rows.append([name, f"{len(probe.covered)}/{n_all}"] + [f"{e:.1e}" for e in errs])
    return rows


# ----------------------------------------------------------------------------- 2. closed form


def closed_form(steps: int, seeds: int) -> list[list[str]]:
    d, s = 8, 0.5
    rows = []
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        w_star = torch.randn(d, generator=gen)
        model = nn.Linear(d, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(w_star + 0.3 * torch.randn(d, generator=gen))
        e2 = float((model.weight.detach().reshape(-1) - w_star).pow(2).sum())
        truth = ((d + 1) * e2 + d * s**2) / e2
        per_ex, two_batch = NoiseScaleEMA(0.995), NoiseScaleEMA(0.995)
        probe = PerExampleGradNorms(model)
        for _ in range(steps):
            x = torch.randn(64, d, generator=gen)
            y = x @ w_star + s * torch.randn(64, generator=gen)
            model.zero_grad()
            probe.reset()
            with probe:
                (0.5 * (model(x).squeeze(1) - y).pow(2).mean()).backward()
            big = model.weight.grad.pow(2).sum()
            per_ex.update(*map(float, noise_scale_estimates(probe.squared_norms().mean(), big, 1, 64)))
            # two batch sizes as with 8 ranks (or micro-batches) of 8 examples
            per = x * (model(x).squeeze(1) - y).detach().unsqueeze(1)
            small = per.reshape(8, 8, d).mean(1).pow(2).sum(1).mean()
            two_batch.update(*map(float, noise_scale_estimates(small, per.mean(0).pow(2).sum(), 8, 64)))
        rows.append([str(seed), f"{truth:.2f}", f"{per_ex.b_simple:.2f}", f"{100 * (per_ex.b_simple / truth - 1):+.1f}%",
                     f"{two_batch.b_simple:.2f}", f"{100 * (two_batch.b_simple / truth - 1):+.1f}%"])
    return rows


# ----------------------------------------------------------------------------- 3./4. cost, memory


class PeakMemory(TorchDispatchMode):
    """Peak bytes of the tensor storages allocated by ops run inside the mode (CPU-friendly)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {}

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self._seen.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._seen:
                    n = storage.nbytes()
                    self._seen[key] = n
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, n)
        return out


def token_model(d: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d), nn.GELU(),
                         nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))


def cost(reps: int) -> tuple[list[list[str]], str]:
    torch.manual_seed(0)
    b, t, d, hidden = 8, 128, 256, 1024
    model = token_model(d, hidden)
    x, y = torch.randn(b, t, d), torch.randn(b, t, d)

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()

    def ours(strategy: str, verify: bool = False, chunk_bytes: int | None = None) -> Callable[[], None]:
        probe = PerExampleGradNorms(model, linear_strategy=strategy, verify=verify)

        def step() -> None:
            saved = per_example.CPU_CHUNK_BYTES
            if chunk_bytes is not None:
                per_example.CPU_CHUNK_BYTES = chunk_bytes
            try:
                model.zero_grad(set_to_none=True)
                probe.reset()
                with probe:
                    F.mse_loss(model(x), y).backward()
                probe.squared_norms().sum().item()
            finally:
                per_example.CPU_CHUNK_BYTES = saved

        return step

    # the callback on a step that is not due: its two hooks return at once
    mon = GradientNoiseScaleMonitor(every_n_steps=1000, warmup_steps=0)
    trainer_stub = SimpleNamespace(global_step=1)
    module_stub = SimpleNamespace(automatic_optimization=True)

    def not_due() -> None:
        mon.on_train_batch_start(trainer_stub, None, (x,), 0)  # type: ignore[arg-type]
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        mon.on_before_optimizer_step(trainer_stub, module_stub, None)  # type: ignore[arg-type]

    # the callback on a due step: arm, forward, backward, read the norms, estimate, one host transfer
    class TrainerStub:
        global_step = 0
        world_size = 1
        global_rank = 0
        accumulate_grad_batches = 1
        loggers: list = []
        precision_plugin = SimpleNamespace()
        strategy = SimpleNamespace()  # a single device
        callback_metrics: dict = {}
        should_stop = False
        default_root_dir = tempfile.mkdtemp(prefix="bench_noise_scale_")

    stub = TrainerStub()
    due_mon = GradientNoiseScaleMonitor(every_n_steps=1)
    model.automatic_optimization = True  # what the monitors read of a LightningModule
    due_mon.setup(stub, model, "fit")  # type: ignore[arg-type]

    def due() -> None:
        stub.global_step += 1  # a new optimizer step each call: each is due (every_n_steps=1) and checked once
        due_mon.on_train_batch_start(stub, model, (x,), 0)  # type: ignore[arg-type]
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        due_mon.on_before_optimizer_step(stub, model, None)  # type: ignore[arg-type]

    fns: dict[str, Callable[[], None]] = {
        "plain fwd+bwd": plain,
        "callback, step not due": not_due,
        "callback, due step (per_example, per-layer keys)": due,
    }
    for s in ("auto", "gram", "materialize"):
        label = {"auto": "PerExampleGradNorms auto (fused Linear)", "gram": "PerExampleGradNorms gram",
                 "materialize": "PerExampleGradNorms materialize"}[s]
        fns[label] = ours(s)
        if s == "auto":  # with the projection check (the callback runs it on its first check only)
            fns[label + ", verify=True"] = ours(s, verify=True)
            # the fused path as it was before chunking: the whole batch's per-example gradients in one
            # batched matmul, then one pass for their sum and one for their norms
            fns["PerExampleGradNorms fused, whole batch in one bmm (before chunking)"] = ours(s, chunk_bytes=2**62)

    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p: dict[str, Any], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    def torch_func() -> None:
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
        sum(v.flatten(1).pow(2).sum(1) for v in g.values()).sum().item()

    fns["torch.func vmap(grad) + plain fwd+bwd"] = torch_func

    backpack_note = "BackPACK not installed: skipped"
    try:
        from backpack import backpack, extend
        from backpack.extensions import BatchL2Grad

        bp_model = extend(token_model(d, hidden))
        bp_model.load_state_dict(model.state_dict())
        bp_loss = extend(nn.MSELoss())

        def bp_plain() -> None:
            bp_model.zero_grad(set_to_none=True)
            bp_loss(bp_model(x), y).backward()

        def bp_l2() -> None:
            bp_model.zero_grad(set_to_none=True)
            with backpack(BatchL2Grad()):
                bp_loss(bp_model(x), y).backward()
            sum(p.batch_l2 for p in bp_model.parameters()).sum().item()

        from importlib.metadata import version

        fns["BackPACK BatchL2Grad"] = bp_l2
        fns["plain fwd+bwd, BackPACK-extended model"] = bp_plain
        backpack_note = f"backpack-for-pytorch {version('backpack-for-pytorch')}"
    except ImportError:
        pass

    for f in fns.values():  # warm up
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    rng = random.Random(0)
    for _ in range(reps):
        rng.shuffle(order)  # no step always runs right after another
        for k in order:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    base_times = times["plain fwd+bwd"]
    mems: dict[str, int] = {}
    for k, f in fns.items():
        if k.startswith("torch.func"):
            continue
        with PeakMemory() as pm:
            f()
        mems[k] = pm.peak
    rows = []
    for k in fns:
        med = statistics.median(times[k])
        # the ratio to the plain step of the same round, then the median: robust to a machine whose
        # load drifts during the run; and the ratio of the fastest repetitions
        paired = statistics.median(t / b for t, b in zip(times[k], base_times))
        best = min(times[k]) / min(base_times)
        mem = f"{mems[k] / 2**20:.1f} MiB ({mems[k] / mems['plain fwd+bwd']:.2f}x)" if k in mems else "n/a"
        rows.append([k, f"{med * 1e3:.1f}", f"{paired:.3f}x", f"{best:.3f}x", mem])
    return rows, backpack_note


def crossover(reps: int) -> list[list[str]]:
    """Fused Linear against the Gram form (each vs a plain step of the same model, interleaved), over
    sequence lengths and widths: the measurements behind ``GRAM_OVER_FUSED``."""
    rows = []
    for b, t, d_in, d_out in [(8, 4, 1024, 1024), (8, 16, 1024, 1024), (8, 48, 1024, 1024), (8, 96, 1024, 1024),
                              (8, 16, 256, 1024), (8, 40, 256, 1024), (8, 64, 256, 1024), (8, 128, 256, 1024),
                              (32, 16, 128, 512), (8, 128, 256, 256)]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(d_in, d_out), nn.Tanh(), nn.Linear(d_out, d_in))
        x = torch.randn(b, t, d_in)

        def plain(model: nn.Module = model, x: torch.Tensor = x) -> None:
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()

        def probe_step(strategy: str, model: nn.Module = model, x: torch.Tensor = x) -> Callable[[], None]:
            probe = PerExampleGradNorms(model, linear_strategy=strategy, verify=False)

            def step() -> None:
                model.zero_grad(set_to_none=True)
                probe.reset()
                with probe:
                    model(x).square().mean().backward()
                probe.squared_norms().sum().item()

            return step

        fns = {"plain": plain, "fused": probe_step("fused"), "gram": probe_step("gram")}
        for f in fns.values():
            f()
        times: dict[str, list[float]] = {k: [] for k in fns}
        order = list(fns)
        rng = random.Random(0)
        for _ in range(reps):
            rng.shuffle(order)
            for k in order:
                t0 = time.perf_counter()
                fns[k]()
                times[k].append(time.perf_counter() - t0)
        ratio = {k: statistics.median(a / p for a, p in zip(times[k], times["plain"])) for k in fns}
        rule = t * t * (d_in + d_out) / (d_in * d_out)
        auto = "gram" if rule < per_example.GRAM_OVER_FUSED else "fused"
        rows.append([f"{b}, {t}, {d_in}x{d_out}", f"{rule:.1f}", f"{ratio['fused']:.3f}x", f"{ratio['gram']:.3f}x", auto])
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and steps")
    parser.add_argument("--crossover", action="store_true",
                        help="only the fused-vs-Gram measurements behind linear_strategy='auto'")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.crossover:
        reps = 5 if args.quick else 15
        print("## Fused Linear vs Gram form: B, T, d_in x d_out (two Linear layers, d_in -> d_out -> d_in); "
              f"1 thread, median of {reps} interleaved paired ratios to a plain step\n")
        print(table(["B, T, layer", "T^2 (d_in + d_out) / (d_in d_out)", "fused", "gram", "auto picks"],
                    crossover(reps)))
        return
    reps = 7 if args.quick else 41
    steps, seeds = (300, 2) if args.quick else (600, 4)

    print("## 1. Exactness vs torch.func (max relative error per example, fp32)\n")
    print(table(["model", "covered params"] + [label for label, _, _ in STRATEGIES], exactness()))
    print("\n## 2. Closed-form linear regression (d=8, B=64, noise 0.5, EMA beta 0.995, "
          f"{steps} steps at fixed weights)\n")
    print(table(["seed", "true B_simple", "per-example", "error", "two batch sizes (8 vs 64)", "error"],
                closed_form(steps, seeds)))
    rows, note = cost(reps)
    print(f"\n## 3./4. Cost and peak memory of one step: B=8, T=128, d=256, hidden 1024, 4 Linear; "
          f"1 thread, median of {reps} interleaved repetitions; {note}\n")
    print(table(["step", "median ms", "vs plain (median of paired ratios)", "vs plain (fastest reps)",
                 "peak memory (vs plain)"], rows))


if __name__ == "__main__":
    main()

"""Overhead of the suite on a ``torch.compile``-d model against the compiled model alone (CPU).

    python benchmarks/bench_compile.py [--backend inductor|aot_eager] [--steps 200] [--every 50]
                                       [--width 256] [--disable-gwa-hook]

Four runs of the same MLP classifier (the inner ``nn.Module`` compiled): eager alone, eager + suite,
compiled alone, compiled + ``HealthMonitor(grades=True)``. For each: the wall time of the first step
(compilation included), the median and mean step time after warm-up, the graphs Dynamo built, the
graphs built after the warm-up (steps > ``every + 1``: should be 0), and whether a frame hit Dynamo's
``recompile_limit`` (it then runs eagerly, silently). ``--disable-gwa-hook`` wraps
``GradientWeightAlignmentMonitor._on_head_forward`` in ``torch.compiler.disable`` first (the proposed fix,
see docs/compile.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torch._dynamo
from torch._dynamo.utils import counters

from lightning_monitor import HealthMonitor


class Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(64, width), nn.Linear(width, width), nn.Linear(width, width)
        self.fc = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.gelu(self.l3(F.gelu(self.l2(F.gelu(self.l1(x)))))))


class Classifier(pl.LightningModule):
    def __init__(self, backend: str | None, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.compile(Net(width), backend=backend) if backend else Net(width)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Timer(Callback):
    def __init__(self) -> None:
        self.t0 = 0.0
        self.times: list[float] = []
        self.graphs: list[int] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self.t0)
        self.graphs.append(counters["stats"]["unique_graphs"])
        self.losses.append(float(outputs["loss"]))


def run(backend: str | None, suite: bool, args: argparse.Namespace) -> Timer:
    torch._dynamo.reset()
    counters.clear()
    timer = Timer()
    cbs: list[Callback] = [timer]
    if suite:
        e = {"every_n_steps": args.every}
        cbs.append(HealthMonitor(spectral=e, noise_scale=e, guard=e, grades=e, dashboard=False))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.steps * args.batch, 64, generator=g)
    y = (x[:, :10] + 0.5 * torch.randn(x.shape[0], 10, generator=g)).argmax(1)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=args.steps, logger=False, callbacks=cbs, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(Classifier(backend, args.width), DataLoader(TensorDataset(x, y), batch_size=args.batch))
    timer.limit_hits = sum(v for k, v in counters["unimplemented"].items() if "recompile limit" in k.lower())
    return timer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="inductor")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--disable-gwa-hook", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.disable_gwa_hook:
        from lightning_monitor.callbacks.gradient_weight_alignment import GradientWeightAlignmentMonitor as G

        G._on_head_forward = torch.compiler.disable(G._on_head_forward)
    warm = args.every + 2
    rows = {}
    for name, backend, suite in [
        ("eager", None, False), ("eager+suite", None, True),
        (f"{args.backend}", args.backend, False), (f"{args.backend}+suite", args.backend, True),
    ]:
        t = run(backend, suite, args)
        steady = t.times[warm:]
        rows[name] = t
        print(
            f"{name:>18}: first step {t.times[0]:7.2f} s | steady median {1e3 * statistics.median(steady):7.2f} ms"
            f" mean {1e3 * statistics.fmean(steady):7.2f} ms | graphs {t.graphs[-1]:3d}, after warm-up "
            f"{t.graphs[-1] - t.graphs[warm - 1]:2d} | recompile-limit hits {t.limit_hits}",
            flush=True,
        )
    base, with_suite = rows[args.backend], rows[f"{args.backend}+suite"]
    eb, es = rows["eager"], rows["eager+suite"]
    mean = lambda t: statistics.fmean(t.times[warm:])  # noqa: E731
    print(f"suite overhead, steady state (every {args.every} steps): compiled {100 * (mean(with_suite) / mean(base) - 1):+.1f}%"
          f", eager {100 * (mean(es) / mean(eb) - 1):+.1f}%")
    print(f"compile time added by the suite (first {warm} steps): "
          f"{sum(with_suite.times[:warm]) - sum(base.times[:warm]):+.2f} s")
    diff = max(abs(a - b) for a, b in zip(with_suite.losses, es.losses))
    print(f"max |loss(compiled+suite) - loss(eager+suite)| = {diff:.3g}")


if __name__ == "__main__":
    main()

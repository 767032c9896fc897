"""Per-example gradient norms of a CNN: the probe against torch.func, as a multiple of a plain step.

Run: /work/venv/bin/python benchmarks/bench_conv_per_example.py [--threads N] [--reps R]

A 3-layer CNN (Conv 3->32, Conv 32->64 stride 2, Conv 64->64 stride 2, ReLU, global average pool,
Linear 64->10) on 32x32 images, batch 64, cross-entropy, CPU. Timed (median over interleaved
repetitions, after a warm-up):

* plain: forward + backward;
* probe: the same inside ``PerExampleGradNorms`` (per-example squared norms of every parameter, read
  on the host), the batch-size resolution and the coverage verification done once before timing (the
  first runs once per input shape, the callback runs the second on its first check only);
* torch.func: ``vmap(grad(loss of one example))`` over the batch and the squared norms of the
  per-example gradients (the batch gradient is their mean: it replaces the plain step).

Also checks that the probe's norms equal torch.func's (max relative error).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightning_monitor import PerExampleGradNorms  # noqa: E402


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 32, 3, padding=1)
        self.c2 = nn.Conv2d(32, 64, 3, stride=2, padding=1)
        self.c3 = nn.Conv2d(64, 64, 3, stride=2, padding=1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.c1(x))
        x = F.relu(self.c2(x))
        x = F.relu(self.c3(x))
        return self.fc(x.mean((2, 3)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = CNN()
    x, y = torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    probe = PerExampleGradNorms(model)

    def with_probe() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        probe.reset()
        with probe:
            F.cross_entropy(model(x), y).backward()
        out = probe.squared_norms()
        out.tolist()  # on the host, as the callback reads it
        return out

    def loss_one(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per_example_grad = vmap(grad(loss_one), in_dims=(None, 0, 0))

    def with_func() -> torch.Tensor:
        grads = per_example_grad(params, x, y)
        out = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0)
        out.tolist()
        return out

    ours, ref = with_probe(), with_func()
    assert probe.uncovered == [], probe.reasons
    probe.verify = False  # the callback verifies coverage on its first check only
    err = float(((ours.double() - ref.double()).abs() / ref.double()).max())
    times: dict[str, list[float]] = {"plain": [], "probe": [], "torch.func": []}
    fns = {"plain": plain, "probe": with_probe, "torch.func": with_func}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(args.reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain"])
    print(f"3-layer CNN, 32x32, batch {args.batch}, {args.threads} thread(s), median of {args.reps}")
    print("| path | ms | x plain step |")
    print("|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.1f} | {med / base:.2f}x |")
    print(f"max relative error of the probe's norms against torch.func: {err:.1e}")


if __name__ == "__main__":
    main()

"""What the per-example probe costs on an ``nn.LSTM`` / ``nn.GRU`` classifier now that it covers recurrent layers.

A 2-layer recurrent layer (input 32, hidden 128, batch-first) under a Linear head, batch 32, 50 steps, one CPU
thread. Three forward + backward passes are timed, interleaved over the repetitions:

* ``plain``: no probe (a step the monitor is not due on);
* ``probe``: ``PerExampleGradNorms`` over every parameter, the recurrent layer included (a due step of the
  noise-scale monitor: its backward runs the recurrence again in float32 for the gate gradients);
* ``probe, recurrent layer left out``: the head alone (what a due step measured before).

Printed: the median milliseconds of each, their ratios to ``plain`` in the same run, and the parameters covered.

Run: python benchmarks/bench_recurrent_probe.py [--reps N] [--kind lstm|gru]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from lightning_monitor import PerExampleGradNorms

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention_probe import interleave  # noqa: E402


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        cls = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = cls(32, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, probe: PerExampleGradNorms | None) -> float:
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    if probe is None:
        F.cross_entropy(model(x), y).backward()
    else:
        with probe:
            F.cross_entropy(model(x), y).backward()
        probe.squared_norms()
        probe.reset()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--kind", choices=("lstm", "gru"), default="lstm")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net(args.kind)
    x, y = torch.randn(32, 50, 32), torch.randint(0, 10, (32,))
    probes = {
        "probe": PerExampleGradNorms(model, loss_reduction="mean"),
        "probe, recurrent layer left out": PerExampleGradNorms(
            model, loss_reduction="mean", include=lambda name, m: not name.startswith("rnn")),
    }
    interleave(lambda p: step(model, x, y, p), probes, model, args.reps, title=f"{args.kind}, ")

if __name__ == "__main__":
    main()

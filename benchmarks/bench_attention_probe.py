"""What the per-example probe costs on an ``nn.TransformerEncoder`` now that it covers ``nn.MultiheadAttention``.

A 4-layer ``nn.TransformerEncoder`` (d_model 128, 4 heads, feed-forward 512, batch-first, causal mask), batch 16,
64 tokens, one CPU thread. Three forward + backward passes are timed, interleaved over the repetitions:

* ``plain``: no probe (a step the monitor is not due on);
* ``probe``: ``PerExampleGradNorms`` over every parameter, the attention included (a due step of the noise-scale
  monitor);
* ``probe, attention left out``: the same probe with ``include`` leaving the attention modules out (what a due
  step covered before: the attention's four matrices uncovered, the rest as above).

Printed: the median milliseconds of each, their ratios to ``plain`` in the same run, and the parameters covered.

Run: python benchmarks/bench_attention_probe.py [--reps N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, Optional

import torch
from torch import nn

from lightning_monitor import PerExampleGradNorms


def build() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 4, enable_nested_tensor=False), nn.Linear(128, 10))
    return model, torch.randn(16, 64, 128), nn.Transformer.generate_square_subsequent_mask(64)


def step(model: nn.Module, x: torch.Tensor, mask: torch.Tensor, probe: PerExampleGradNorms | None) -> float:
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    if probe is None:
        model[1](model[0](x, mask=mask, is_causal=True)).pow(2).mean().backward()
    else:
        with probe:
            model[1](model[0](x, mask=mask, is_causal=True)).pow(2).mean().backward()
        probe.squared_norms()
        probe.reset()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, x, mask = build()
    probes = {
        "probe": PerExampleGradNorms(model, loss_reduction="mean"),
        "probe, attention left out": PerExampleGradNorms(
            model, loss_reduction="mean", include=lambda name, m: not name.endswith(("self_attn", "out_proj"))),
    }
    interleave(lambda p: step(model, x, mask, p), probes, model, args.reps)


def interleave(run: Callable[[Optional[PerExampleGradNorms]], float], probes: dict[str, PerExampleGradNorms],
               model: nn.Module, reps: int, title: str = "") -> None:
    """Time ``run(None)`` (a plain pass) and ``run(probe)`` for each probe, interleaved over ``reps`` repetitions after
    one untimed use of each probe (it resolves the batch dimension and verifies), and print the medians, their ratios
    to the plain pass and the parameters each probe covers."""
    for p in probes.values():
        run(p)
    times: dict[str, list[float]] = {"plain": [], **{k: [] for k in probes}}
    for _ in range(reps):
        times["plain"].append(run(None))
        for name, p in probes.items():
            times[name].append(run(p))
    base = statistics.median(times["plain"])
    print(f"{title}torch {torch.__version__}, 1 thread, {reps} interleaved repetitions, load {os.getloadavg()[0]:.1f}")
    print()
    print("| pass | median ms | vs plain | parameters covered |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        cov = "-" if name == "plain" else f"{len(probes[name].covered)} of {len(list(model.parameters()))}"
        print(f"| {name} | {med * 1e3:.1f} | {med / base:.3f} | {cov} |")

if __name__ == "__main__":
    main()

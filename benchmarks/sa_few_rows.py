"""SpectralAlignmentMonitor's collapse rule on healthy runs with few input rows a check.

A small MLP classifier (20 -> 64 -> 64 -> 64 -> 5, tanh, so every layer's inputs have mixed signs) trained with
Adam on generated data at a small batch size: each check sees only ``--batch`` rows per layer, so a layer's sign
diversity ``D`` moves in steps of ``2 / batch``. Two monitors watch the same run: the monitor as it is, and the
same rule without the sampling-noise bar (:meth:`SpectralAlignmentMonitor.beyond_noise` always true), so the
count of collapse warnings with and without it comes from identical checks.

Run: python benchmarks/sa_few_rows.py [--batch 8] [--seeds 4] [--steps 3000]
"""

from __future__ import annotations

import argparse
import logging
import warnings

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_monitor import SpectralAlignmentMonitor


class WithoutNoiseBar(SpectralAlignmentMonitor):
    """The collapse rule as it was before the sampling-noise bar."""

    name = "sa_raw"

    def beyond_noise(self, diversity, eligible, rows):  # type: ignore[override]
        return True


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64),
                                 nn.Tanh(), nn.Linear(64, 5))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def run(seed: int, batch: int, steps: int) -> tuple[int, int, float]:
    pl.seed_everything(seed, verbose=False)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4000, 20, generator=g)
    y = (x @ torch.randn(20, 5, generator=g) + 0.5 * torch.randn(4000, 5, generator=g)).argmax(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=True)
    kept, raw = SpectralAlignmentMonitor(every_n_steps=20), WithoutNoiseBar(every_n_steps=20)
    trainer = pl.Trainer(max_steps=steps, callbacks=[kept, raw], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    model = MLP()
    trainer.fit(model, loader)
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model.net(x), y).item()

    def warnings_of(mon: SpectralAlignmentMonitor) -> int:
        return sum(a.kind == "collapse" and a.severity != "info" for a in mon.hub.history if a.monitor == mon.name)

    return warnings_of(kept), warnings_of(raw), loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning_monitor"):
        logging.getLogger(name).setLevel(logging.ERROR)
    print("| seed | collapse warnings | without the noise bar | final training loss |\n|---|---|---|---|")
    for seed in range(args.seeds):
        kept, raw, loss = run(seed, args.batch, args.steps)
        print(f"| {seed} | {kept} | {raw} | {loss:.3f} |", flush=True)


if __name__ == "__main__":
    main()

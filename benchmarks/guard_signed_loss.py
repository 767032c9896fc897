"""DivergenceGuard on healthy runs whose loss goes below 0: heteroscedastic regressions trained on the Gaussian
negative log-likelihood (the loss falls from about +0.2 to -1 .. -3.9 as the predicted variance shrinks).

Three noise levels of the data x two seeds, 1500 steps each, the guard at its defaults. The guard's loss rules
compare the loss with multiples of its levels, which assumes a loss bounded below by 0; every run is healthy (it
ends near its lowest loss), so any action is a false one. Prints, per run, the loss path, rollbacks, stops and the
guard's alerts.

Run: python benchmarks/guard_signed_loss.py  (about 1 minute on 2 cores)
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import warnings

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_monitor import DivergenceGuard


class GaussianNLL(pl.LightningModule):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        mu, log_var = self.net(x).unbind(-1)
        return 0.5 * (log_var + (y - mu) ** 2 / log_var.exp()).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), self.lr)


def loader(noise: float, seed: int, n: int = 8192) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = torch.sin(x[:, 0]) + 0.5 * x[:, 1] + noise * torch.randn(n, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True,
                                       generator=torch.Generator().manual_seed(seed))


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(outputs["loss"]))


def main() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning_monitor"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    print("| noise | seed | loss: first -> lowest -> mean of the last 50 | rollbacks | stopped | alerts (step kind) |")
    print("|---|---|---|---|---|---|")
    actions = 0
    for noise in (0.3, 0.05, 0.01):
        for seed in (0, 1):
            pl.seed_everything(seed, verbose=False)
            guard, losses = DivergenceGuard(), Losses()
            with tempfile.TemporaryDirectory() as root:
                trainer = pl.Trainer(accelerator="cpu", max_steps=1500, callbacks=[guard, losses], logger=False,
                                     enable_checkpointing=False, enable_progress_bar=False,
                                     enable_model_summary=False, default_root_dir=root)
                trainer.fit(GaussianNLL(), loader(noise, seed))
            v = losses.values
            alerts = ", ".join(f"{a.step} {a.kind}" for a in guard.hub.history)
            actions += len(guard.rollbacks) + (guard.stopped_step is not None)
            print(f"| {noise} | {seed} | {v[0]:.2f} -> {min(v):.2f} -> {sum(v[-50:]) / 50:.2f} | {len(guard.rollbacks)} "
                  f"| {guard.stopped_step} | {alerts} |", flush=True)
    print(f"\nactions on these 6 healthy runs: {actions}")


if __name__ == "__main__":
    sys.exit(main())

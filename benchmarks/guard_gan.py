"""DivergenceGuard on healthy GANs: the generator's loss climbs as the discriminator improves.

A generator (8 -> 64 -> 2) and a discriminator (2 -> 64 -> 1) learn a ring of eight Gaussians (radius 2, std 0.05)
with manual optimization, Adam 2e-4 (betas 0.5, 0.999), batch 64, 600 batches (1200 optimizer steps), six seeds.
Every run is healthy (nothing turns non-finite, the losses stay near their usual 0.5-1.4), so any action is a false
one. Each run is made twice: the guard with its loss rules on (``loss_rules=True``: the level of the generator's loss
is judged, as it was by default before) and at its defaults (several optimizers: non-finite values only). Prints the
generator's loss at the start and the end, and the guard's actions and alerts.

Run: python benchmarks/guard_gan.py  (about 1 minute on 2 cores)
"""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard

BATCHES, BATCH = 600, 64
SEEDS = (0, 1, 2, 3, 4, 5)


class GAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
        self.g_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        opt_g, opt_d = self.optimizers()
        fake = self.generator(torch.randn(len(x), 8))
        ones, zeros = torch.ones(len(x), 1), torch.zeros(len(x), 1)
        d_loss = (F.binary_cross_entropy_with_logits(self.discriminator(x), ones)
                  + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros))
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.g_losses.append(float(g_loss))
        return g_loss

    def configure_optimizers(self):
        betas = (0.5, 0.999)
        return [torch.optim.Adam(self.generator.parameters(), 2e-4, betas=betas),
                torch.optim.Adam(self.discriminator.parameters(), 2e-4, betas=betas)]


def ring() -> TensorDataset:
    angle = torch.randint(0, 8, (BATCHES * BATCH,)).float() * (torch.pi / 4)
    x = 2.0 * torch.stack([angle.cos(), angle.sin()], 1) + 0.05 * torch.randn(BATCHES * BATCH, 2)
    return TensorDataset(x)


def run(seed: int, loss_rules) -> dict:
    pl.seed_everything(seed, verbose=False)
    data = ring()
    guard = DivergenceGuard(loss_rules=loss_rules)
    model = GAN()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, callbacks=[guard],
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=BATCH, shuffle=True))
    g = model.g_losses
    return {"seed": seed, "loss_rules": loss_rules, "g_first": sum(g[:50]) / 50, "g_last": sum(g[-50:]) / 50,
            "actions": len(guard.rollbacks) + (guard.stopped_step is not None),
            "alerts": [f"{a.kind}@{a.step}" for a in guard.hub.history]}


def main() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning_monitor"):
        logging.getLogger(name).setLevel(logging.ERROR)
    rows = [run(seed, rules) for seed in SEEDS for rules in (True, None)]
    print("| seed | loss_rules | generator loss, first 50 -> last 50 batches | actions | alerts |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['loss_rules']} | {r['g_first']:.3f} -> {r['g_last']:.3f} | {r['actions']} | "
              f"{', '.join(r['alerts']) or '-'} |")
    for rules in (True, None):
        sub = [r for r in rows if r["loss_rules"] is rules]
        print(f"loss_rules={rules}: actions on the {len(sub)} healthy runs {sum(r['actions'] for r in sub)}, "
              f"warnings {sum(1 for r in sub for a in r['alerts'] if not a.startswith(('rolled_back', 'stopped')))}")


if __name__ == "__main__":
    main()

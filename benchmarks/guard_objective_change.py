"""DivergenceGuard when the loss function changes mid-run, against the same jump made by weights that break.

A 10-class classifier (an MLP on generated Gaussian clusters, Adam 1e-3, batch 32, 300 steps, one epoch) whose
``training_step`` changes at step 150 in one of three ways:

* ``penalty``: an L2 penalty (1e-2 times the squared weights) is added to the loss;
* ``smoothing``: the cross-entropy takes label smoothing 0.2 (the loss floor rises);
* ``lr_blowup``: nothing changes in the loss, but the learning rate is multiplied by 3000 (the weights break).

The first two are healthy runs whose loss jumps because the objective changed, so any action is a false one; the
third is the matched divergence (same seed, data and step), which must still be acted on. Two seeds each, the
guard at its defaults. Prints per run the actions and the guard's warnings.

Then the same three changes across a resume: a first stage of 150 steps saves a checkpoint, and a second stage
(a new Trainer and guard) resumes it with the change in force from its first step, or, for ``new_labels``, on the
same inputs with every label moved by 3 classes (new data). The healthy second stages must not be acted on; the
one whose learning rate is multiplied by 3000 must be.

Last, under manual optimization (one optimizer; ``training_step`` calls ``manual_backward`` and ``step`` itself):
``new_labels`` (every label moved by 3 classes from step 150, new data) and ``lr_blowup``. The guard evaluates a
batch again by replaying ``training_step`` with its backward and steps made no-ops.

Run: python benchmarks/guard_objective_change.py  (about 50 s on 2 cores)
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard

SWITCH, STEPS, BATCH = 150, 300, 32


def make_data(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    centres = 3.0 * torch.randn(10, 32, generator=g)
    y = torch.randint(0, 10, (STEPS * BATCH,), generator=g)
    x = centres[y] + 0.3 * torch.randn(STEPS * BATCH, 32, generator=g)
    return TensorDataset(x, y)


class Classifier(pl.LightningModule):
    def __init__(self, change: str, switch: int = SWITCH) -> None:
        super().__init__()
        self.change, self.switch = change, switch
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        after = self.global_step >= self.switch
        smoothing = 0.2 if after and self.change == "smoothing" else 0.0
        loss = F.cross_entropy(self.net(x), y, label_smoothing=smoothing)
        if after and self.change == "penalty":
            loss = loss + 1e-2 * sum(p.pow(2).sum() for p in self.parameters())
        if self.change == "lr_blowup" and self.global_step == self.switch:
            for group in self.optimizers().param_groups:
                group["lr"] *= 3000.0
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def run(change: str, seed: int) -> dict:
    pl.seed_everything(seed, verbose=False)
    guard = DivergenceGuard()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, callbacks=[guard],
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier(change), DataLoader(make_data(seed), batch_size=BATCH))
    kinds = [f"{a.kind}@{a.step}" for a in guard.hub.history if a.severity != "info"]
    actions = len(guard.rollbacks) + (guard.stopped_step is not None)
    return {"change": change, "seed": seed, "actions": actions, "rollbacks": [r["step"] for r in guard.rollbacks],
            "stopped": guard.stopped_step, "alerts": kinds}


class ManualClassifier(Classifier):
    """The same classifier trained by hand (manual optimization, one optimizer)."""

    def __init__(self, change: str) -> None:
        super().__init__(change)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        if self.change == "lr_blowup" and self.global_step == self.switch:
            for group in opt.param_groups:
                group["lr"] *= 3000.0
        opt.step()
        return loss


def run_manual(change: str, seed: int) -> dict:
    pl.seed_everything(seed, verbose=False)
    x, y = make_data(seed)[:]
    if change == "new_labels":
        y = torch.where(torch.arange(len(y)) >= SWITCH * BATCH, (y + 3) % 10, y)
    guard = DivergenceGuard()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, callbacks=[guard],
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(ManualClassifier(change), DataLoader(TensorDataset(x, y), batch_size=BATCH))
    kinds = [f"{a.kind}@{a.step}" for a in guard.hub.history if a.severity != "info"]
    return {"change": f"{change} (manual optimization)", "seed": seed,
            "actions": len(guard.rollbacks) + (guard.stopped_step is not None),
            "rollbacks": [r["step"] for r in guard.rollbacks], "stopped": guard.stopped_step, "alerts": kinds}


def run_resumed(change: str, seed: int, directory: str) -> dict:
    """A first stage of ``SWITCH`` steps with a checkpoint, then a second stage resumed from it with ``change``
    from its first step on."""
    pl.seed_everything(seed, verbose=False)
    data = make_data(seed)
    first = data[:SWITCH * BATCH]
    save = ModelCheckpoint(dirpath=directory, save_last=True)
    pl.Trainer(accelerator="cpu", max_steps=SWITCH, logger=False, callbacks=[DivergenceGuard(), save],
               enable_progress_bar=False, enable_model_summary=False).fit(
        Classifier("none"), DataLoader(TensorDataset(*first), batch_size=BATCH))
    x, y = data[:]
    if change == "new_labels":
        y = (y + 3) % 10
    guard = DivergenceGuard()
    trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                         callbacks=[guard], enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier("none" if change == "new_labels" else change), DataLoader(TensorDataset(x, y), batch_size=BATCH),
                ckpt_path=os.path.join(directory, "last.ckpt"))
    kinds = [f"{a.kind}@{a.step}" for a in guard.hub.history if a.severity != "info"]
    actions = len(guard.rollbacks) + (guard.stopped_step is not None)
    return {"change": f"{change} (resumed)", "seed": seed, "actions": actions,
            "rollbacks": [r["step"] for r in guard.rollbacks], "stopped": guard.stopped_step, "alerts": kinds}


def main() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning_monitor"):
        logging.getLogger(name).setLevel(logging.ERROR)
    rows = [run(change, seed) for change in ("penalty", "smoothing", "lr_blowup") for seed in (0, 1)]
    with tempfile.TemporaryDirectory() as root:
        rows += [run_resumed(change, seed, os.path.join(root, f"{change}{seed}"))
                 for change in ("new_labels", "penalty", "lr_blowup") for seed in (0, 1)]
    rows += [run_manual(change, seed) for change in ("new_labels", "lr_blowup") for seed in (0, 1)]
    print("| change at step 150 | seed | actions | rollbacks at | stopped at | warnings and criticals |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['change']} | {r['seed']} | {r['actions']} | {r['rollbacks'] or '-'} | {r['stopped'] or '-'} | "
              f"{', '.join(r['alerts']) or '-'} |")
    healthy = [r for r in rows if not r["change"].startswith("lr_blowup")]
    diverging = [r for r in rows if r["change"].startswith("lr_blowup")]
    print(f"\nactions on the {len(healthy)} healthy runs (the objective or the data changed): "
          f"{sum(r['actions'] for r in healthy)} (any is a false one); divergences acted on: "
          f"{sum(r['actions'] > 0 for r in diverging)} of {len(diverging)}")
    sys.exit(0)


if __name__ == "__main__":
    main()

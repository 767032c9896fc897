"""An objective that rises by design and settles higher (a loss term ramped in, as a VAE's KL weight annealed to 1):
the smoothed loss creeps above its minimum and stays there. Held above the halfway mark to the creep limit, it made
the guard refuse every snapshot for the rest of the run (a later rollback lost 200 healthy steps), with the warning
active for good. A rise that has stopped (no more than 5% over 100 steps) is now the new level: the warning clears
and snapshots resume."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard

sklearn_datasets = pytest.importorskip("sklearn.datasets")


class Ramped(pl.LightningModule):
    """Digits, cross-entropy plus a term the model cannot lower (a KL to a prior it must keep, say) ramped in from 0 to
    0.15 over steps 150-250, with the rate down to 1/1000 from step 150: the loss settles about 25% above its
    minimum, above the creep limit, below a climb."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        weight = min(max((self.global_step - 150) / 100, 0.0), 1.0)
        return F.cross_entropy(logits, y) + 0.15 * weight

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 150 else 1e-3)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_a_level_the_run_settled_at_is_the_new_normal() -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    d = sklearn_datasets.load_digits()
    x, y = torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target)
    taken: list[int] = []
    guard = DivergenceGuard()
    original = guard._snapshot

    def spy(trainer, pl_module, step, ok, module_state=None):
        before = guard._snapshots[-1].step if guard._snapshots else None
        original(trainer, pl_module, step, ok, module_state)
        if guard._snapshots and guard._snapshots[-1].step != before:
            taken.append(step)

    guard._snapshot = spy
    trainer = pl.Trainer(accelerator="cpu", max_steps=600, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[guard])
    trainer.fit(Ramped(), DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
    history = guard.hub.history
    assert guard.rollbacks == [] and guard.stopped_step is None
    creep = [a for a in history if a.kind == "loss_creep"]
    assert len(creep) == 1 and creep[0].severity == "warning" and 150 < creep[0].step < 300  # the rise is said ...
    cleared = [a for a in history if a.kind == "loss_creep_cleared"]
    assert len(cleared) == 1 and "settled at a new level" in cleared[0].message  # ... and cleared once it stopped
    assert creep[0].step + 100 <= cleared[0].step <= creep[0].step + 200
    assert [s for s in taken if s > cleared[0].step]  # snapshots again after it
    assert not [s for s in taken if creep[0].step < s <= cleared[0].step]  # (none while it rose)

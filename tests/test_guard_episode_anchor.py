"""A fault that rate cuts cannot cure, from inside the step: a bug sets SGD's momentum to 1.02 at step 300. The first
rollbacks restore good states, but the climb goes on at every rate; the snapshots taken on it then find its batches as
hard as the present weights do. Asked alone, they made the rise read as new data (`data_shift`: the new level became
the normal), and later rollbacks restored states already on the climb (held-out 2.3-3.8 against the control's 0.8; the
run ended 2.9-4.3 times its control). The state the last rollback for a divergence restored is now kept and asked for
200 steps: it finds the batches easy, so the rise is the weights', and the rollback goes back to the newest state that
finds them easy. The matched control (momentum left at 0.9) is untouched."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard

D, C, FAULT_AT, STEPS = 32, 10, 300, 700


def _data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8192, D, generator=g)
    y = (torch.tanh(x @ (torch.randn(D, 64, generator=g) / D**0.5)) @ torch.randn(64, C, generator=g)).argmax(1)
    return x[:-1024], y[:-1024], x[-1024:], y[-1024:]


class _Net(pl.LightningModule):
    def __init__(self, fault: bool, held_out) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, C))
        self.fault, self.held_out_data, self.held_out = fault, held_out, {}

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def on_train_batch_start(self, batch, batch_idx):
        if self.fault and self.trainer.global_step >= FAULT_AT:
            for group in self.trainer.optimizers[0].param_groups:
                group["momentum"] = 1.02

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def loss_now(self) -> float:
        x, y = self.held_out_data
        with torch.no_grad():
            return float(F.cross_entropy(self.net(x), y))


class _Record(pl.Callback):
    """After the guard: the held-out loss of the weights each step ends with (a rollback's restored ones included)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.held_out[trainer.global_step] = pl_module.loss_now()


@pytest.mark.parametrize("seed", [0, 1])
def test_a_fault_the_rate_cannot_cure_is_not_taken_for_new_data(tmp_path, seed: int) -> None:
    torch.set_num_threads(1)
    x, y, xe, ye = _data()
    runs = {}
    for name, fault in (("fault", True), ("control", False)):
        torch.manual_seed(seed)
        module, guard = _Net(fault, (xe, ye)), DivergenceGuard()
        pl.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=[guard, _Record()],
                   default_root_dir=str(tmp_path / name)).fit(
            module, DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True,
                               generator=torch.Generator().manual_seed(seed + 11)))
        runs[name] = (module, guard)
    module, guard = runs["fault"]
    control, control_guard = runs["control"]
    assert control_guard.rollbacks == [] and control_guard.stopped_step is None
    assert len(guard.rollbacks) >= 2
    for r in guard.rollbacks:  # every state restored is a good one: near the control's at the same step
        assert module.held_out[r["step"] + 1] < 1.35 * control.held_out[r["to_step"]], r
    assert module.loss_now() < 1.3 * control.loss_now()

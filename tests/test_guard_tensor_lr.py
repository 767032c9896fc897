"""A learning rate held as a tensor (``Adam(lr=torch.tensor(...))``, as capturable and fused optimizers take it) under
an LR scheduler: a rollback's cut reaches the scheduler's own copies of the rate (its ``base_lrs``). Before, the next
scheduler step set the rate of before the rollback again: each cut lasted one step, and a run that one rollback cures
under a float rate was rolled back four times and stopped (3 of 3 seeds)."""

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard
from lightning_monitor.snapshot import scale_learning_rates

JUMP_AT, JUMP = 100, 300.0


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                                 nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=torch.tensor(1e-3), foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: JUMP if s >= JUMP_AT else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _RatesUsed(pl.Callback):
    def __init__(self) -> None:
        self.lrs: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs[trainer.global_step] = float(optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("seed", [0, 1])
def test_a_tensor_rates_cut_holds_after_a_rollback(seed):
    pl.seed_everything(seed, verbose=False)
    g = torch.Generator().manual_seed(1000 + seed)
    centres = torch.randn(10, 32, generator=g) * 1.5
    y = torch.randint(0, 10, (2048,), generator=g)
    x = centres[y] + torch.randn(2048, 32, generator=g) * 1.5
    guard, used = DivergenceGuard(), _RatesUsed()
    trainer = pl.Trainer(accelerator="cpu", max_steps=170, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[guard, used])
    trainer.fit(_Net(), DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
    assert guard.rollbacks and guard.stopped_step is None and trainer.global_step == 170
    ends = [r["step"] for r in guard.rollbacks[1:]] + [170]
    for r, end in zip(guard.rollbacks, ends):
        after = [used.lrs[s] for s in range(r["step"] + 1, min(end + 1, r["step"] + 11)) if s in used.lrs]
        assert len(after) >= 2, (r, after)
        # the cut lasts until the next rollback (or 10 steps)
        assert after == pytest.approx([JUMP * 1e-3 * r["lr_scale"]] * len(after), rel=1e-5), (r, after)
    assert guard.rollbacks[-1]["lr_scale"] < 1.0


def test_scaling_reaches_a_schedules_tensor_copies_once():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    trainer = SimpleNamespace(optimizers=[opt], lr_scheduler_configs=[SimpleNamespace(scheduler=sched)])
    sched.base_lrs.append(opt.param_groups[0]["initial_lr"])  # an alias of the group's own tensor: scaled once
    scale_learning_rates(trainer, 0.5)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.05)
    assert float(opt.param_groups[0]["initial_lr"]) == pytest.approx(0.05)
    assert [float(v) for v in sched.base_lrs] == pytest.approx([0.05, 0.05])
    sched.base_lrs.pop()
    sched.step()
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.05)  # the schedule goes on from the cut rate

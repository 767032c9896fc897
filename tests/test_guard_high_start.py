"""A run whose first loss is far above where it settles (a fine-tune that starts confidently wrong), and runs whose loss
falls far below its first value (a memorised training set, then new data): the detectors' floor and ceiling keep the
initial loss's scale. Lowered to the level the run reached, they caught a collapse after a high start, but rolled back
healthy runs that memorise; the collapse is a known limit."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def _setup():
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32)[:-300], torch.tensor(y)[:-300]
    torch.manual_seed(0)
    pre = _mlp()
    opt = torch.optim.Adam(pre.parameters(), 3e-3)
    for _ in range(400):  # "pretrained" on the digits' labels
        i = torch.randint(0, len(x), (64,))
        loss = F.cross_entropy(pre(x[i]), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    # fine-tuned on permuted labels: the pretrained net is confidently wrong, its first loss about 17
    g = torch.Generator().manual_seed(7)
    idx = torch.cat([torch.randperm(len(x), generator=g) for _ in range(8)])[: 300 * 32]
    return pre.state_dict(), DataLoader(TensorDataset(x[idx], ((y + 3) % 10)[idx]), batch_size=32, shuffle=False)


class _FineTune(pl.LightningModule):
    def __init__(self, state, jump: bool):
        super().__init__()
        self.net, self.jump = _mlp(), jump
        self.net.load_state_dict(state)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        rate = (lambda s: 50.0 if s >= 150 else 1.0) if self.jump else (lambda s: 1.0)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, rate), "interval": "step"}}


@pytest.mark.slow  # two fits of 300 steps for a limit
@pytest.mark.xfail(strict=True, reason="known limit: the ceiling and the climb scale with the initial loss (17 here)")
def test_a_collapse_after_a_fine_tune_that_started_high_is_acted_on(tmp_path):
    """The loss starts at 17, settles at 0.1, and a 50x rate at step 150 collapses the net to chance (2.3, 20x its
    level): the ceiling is twice the first loss (34) and a climb needs 4.3, and only a warning comes (held-out 2.33
    against the control's 0.365). At 10x the lowest smoothed loss the floor and ceiling caught it at step 151, the
    ceiling alone at 182 (rolled back to step 150); each rolled back the healthy runs below. The control (the same
    run, no jump) is never acted on."""
    state, loader = _setup()
    runs = {}
    for jump in (False, True):
        pl.seed_everything(0)
        guard, module = DivergenceGuard(), _FineTune(state, jump)
        pl.Trainer(max_steps=300, accelerator="cpu", logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=[guard],
                   default_root_dir=str(tmp_path)).fit(module, loader)
        runs[jump] = guard, module
    control, _ = runs[False]
    assert runs[False][1].losses[0] > 10 and sorted(runs[False][1].losses[130:150])[10] < 0.3
    assert control.rollbacks == [] and not [a for a in control.hub.history if a.severity == "critical"]
    guard, _ = runs[True]
    acted = [r["step"] for r in guard.rollbacks] + ([guard.stopped_step] if guard.stopped_step is not None else [])
    assert acted and 150 <= min(acted) <= 200, acted
    assert guard.rollbacks and guard.rollbacks[0]["to_step"] <= 150  # the state before the jump


class _Memorise(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), 0.05, momentum=0.9)


def test_a_memorised_training_set_is_not_rolled_back(tmp_path):
    """400 digits learnt by heart (SGD with momentum, constant rate): the loss reaches 1e-3, where one harder batch is
    10x the level. With the noise floor at 10x the lowest smoothed loss (0.001) that wobble read as a surge, and an
    ordinary step as weights that diverged: rolled back, rate halved. The floor keeps the initial loss's scale."""
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    g = torch.Generator().manual_seed(100)
    for _ in range(800 * 16 // len(x) + 2):
        torch.randperm(len(x), generator=g)
    idx = torch.cat([torch.randperm(400, generator=g) for _ in range(800 * 16 // 400 + 2)])[: 800 * 16]
    pl.seed_everything(0)
    guard, module = DivergenceGuard(), _Memorise()
    pl.Trainer(max_steps=800, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[guard], default_root_dir=str(tmp_path)).fit(
        module, DataLoader(TensorDataset(x[idx], y[idx]), batch_size=16, shuffle=False))
    assert guard.rollbacks == [] and not [a for a in guard.hub.history if a.severity == "critical"]
    assert module.trainer.optimizers[0].param_groups[0]["lr"] == 0.05


class _Curriculum(torch.utils.data.Dataset):
    """200 digits until ``stage`` turns 1 (memorised: loss 0.006), then 1500 (mostly unseen)."""

    def __init__(self, seed: int) -> None:
        x, y = load_digits(return_X_y=True)
        x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        self.small, self.big, self.stage = (x[perm[:200]], y[perm[:200]]), (x[perm[:1500]], y[perm[:1500]]), 0

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int):
        xs, ys = self.small if self.stage == 0 else self.big
        return xs[i % len(xs)], ys[i % len(xs)]


class _Staged(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step >= 200:
            self.trainer.train_dataloader.dataset.stage = 1

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def test_new_data_after_a_memorised_set_is_not_rolled_back(tmp_path):
    """A curriculum step after memorisation: the loss rises from 0.006 to 0.3-0.9 on unseen digits and the run learns
    them (unguarded it ends at 0.03). With the ceiling at 10x the lowest smoothed loss (0.12) every step of the rise
    was anomalous and the weights were blamed: rolled back, rate halved."""
    pl.seed_everything(0)
    guard, module = DivergenceGuard(), _Staged()
    pl.Trainer(max_steps=300, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[guard], default_root_dir=str(tmp_path)).fit(
        module, DataLoader(_Curriculum(0), batch_size=32, shuffle=False))
    assert guard.rollbacks == [] and not [a for a in guard.hub.history if a.severity == "critical"]


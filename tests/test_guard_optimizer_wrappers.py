"""Rollbacks under optimizers that wrap another one: a SAM-style wrapper whose base optimizer shares its groups (the
base's momentum is not in the wrapper's `state_dict`), and a Lookahead whose `state_dict` is a format of its own (no
`param_groups`). Before, the first kept the base's diverged momentum and stopped its groups being shared (the restored
state diverged again at once: four rollbacks, then a stop, where one rollback cures the same run under plain SGD), and
the second crashed the fit at its first rollback (`KeyError: 'param_groups'`)."""

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard
from lightning_monitor.snapshot import TrainingSnapshot


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as it is commonly written: the base optimizer is built on the wrapper's groups."""

    def __init__(self, params, base_cls, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base = base_cls(self.param_groups, **kwargs)
        self.param_groups = self.base.param_groups

    @torch.no_grad()
    def first_step(self):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([g.norm() for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    e = p.grad * group["rho"] / (norm + 1e-12)
                    p.add_(e)
                    self.state[p]["e_w"] = e

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            for p in group["params"]:
                if "e_w" in self.state[p]:
                    p.sub_(self.state[p]["e_w"])
        self.base.step()


class Lookahead(torch.optim.Optimizer):
    """Lookahead with a `state_dict` of its own format (the base's state, the slow weights, the counter)."""

    def __init__(self, base, k=5, alpha=0.5):
        self.base, self.k, self.alpha = base, k, alpha
        self.param_groups, self.defaults, self.state = base.param_groups, base.defaults, base.state
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self.n = 0
        self.slow = [p.detach().clone() for g in self.param_groups for p in g["params"]]

    def step(self, closure=None):
        loss = self.base.step(closure)
        self.n += 1
        if self.n % self.k == 0:
            with torch.no_grad():
                for s, p in zip(self.slow, [p for g in self.param_groups for p in g["params"]]):
                    s.add_(p - s, alpha=self.alpha)
                    p.copy_(s)
        return loss

    def zero_grad(self, set_to_none=True):
        self.base.zero_grad(set_to_none)

    def state_dict(self):
        return {"base": self.base.state_dict(), "slow": [s.clone() for s in self.slow], "n": self.n}

    def load_state_dict(self, state):
        self.base.load_state_dict(state["base"])
        self.n = state["n"]
        for s, t in zip(self.slow, state["slow"]):
            s.copy_(t)
        self.param_groups, self.state = self.base.param_groups, self.base.state


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(10, 20, generator=g) * 3 / 20 ** 0.5
    y = torch.randint(0, 10, (2048,), generator=g)
    return DataLoader(TensorDataset(centres[y] + torch.randn(2048, 20, generator=g), y), batch_size=64, shuffle=True)


def _net():
    return nn.Sequential(nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


class _SAMModule(pl.LightningModule):
    def __init__(self, jump_at, factor):
        super().__init__()
        self.automatic_optimization = False
        self.net, self.jump_at, self.factor = _net(), jump_at, factor

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        loss = F.cross_entropy(self.net(x), y)
        self.manual_backward(loss)
        opt.optimizer.first_step()
        opt.zero_grad()
        self.manual_backward(F.cross_entropy(self.net(x), y))
        opt.step()
        opt.zero_grad()
        self.lr_schedulers().step()
        return loss.detach()

    def configure_optimizers(self):
        opt = SAM(self.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
        jump_at, factor = self.jump_at, self.factor
        return [opt], [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factor if s >= jump_at else 1.0)]


class _LookaheadModule(pl.LightningModule):
    def __init__(self, jump_at, factor):
        super().__init__()
        self.net, self.jump_at, self.factor = _net(), jump_at, factor

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        opt = Lookahead(torch.optim.Adam(self.parameters(), lr=1e-3))
        jump_at, factor = self.jump_at, self.factor
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factor if s >= jump_at else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(module, steps, seed):
    pl.seed_everything(seed, verbose=False)
    guard = DivergenceGuard()
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[guard])
    trainer.fit(module, _data(seed))
    return guard, trainer


@pytest.mark.parametrize("seed", [0, 1])
def test_a_sam_wrapper_is_rolled_back_once_with_its_base_optimizers_state(seed):
    """The rate jumped x100 at step 120: one rollback cures it (as under plain SGD with momentum), no stop."""
    module = _SAMModule(jump_at=120, factor=100.0)
    guard, trainer = _fit(module, 170, seed)
    assert [r["step"] for r in guard.rollbacks][:1] and len(guard.rollbacks) == 1, guard.rollbacks
    assert guard.stopped_step is None and trainer.global_step == 170
    opt = trainer.optimizers[0]
    assert opt.base.param_groups is opt.param_groups  # still shared: the rate held down reaches the base optimizer
    assert opt.base.param_groups[0]["lr"] < 5.0


def test_a_restore_brings_back_a_wrapped_optimizers_state_and_keeps_what_it_shares():
    model = nn.Linear(3, 2)
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    trainer = SimpleNamespace(optimizers=[opt], lr_scheduler_configs=[], precision_plugin=None, current_epoch=0,
                              global_rank=0)
    for _ in range(2):
        model(torch.randn(4, 3)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    snap = TrainingSnapshot.capture(trainer, nn.Sequential(model), {}, step=2, lr_scale=1.0)
    momentum = {p: opt.base.state[p]["momentum_buffer"].clone() for p in model.parameters()}
    groups, base_state = opt.param_groups, opt.base.state
    for _ in range(3):
        (100 * model(torch.randn(4, 3))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    snap.restore(trainer, nn.Sequential(model), {})
    for p in model.parameters():
        assert torch.equal(opt.base.state[p]["momentum_buffer"], momentum[p])
    assert opt.param_groups is groups and opt.base.param_groups is groups and opt.base.state is base_state
    opt.param_groups[0]["lr"] = 0.01
    assert opt.base.param_groups[0]["lr"] == 0.01


def test_a_lookahead_with_a_state_format_of_its_own_is_rolled_back():
    module = _LookaheadModule(jump_at=120, factor=300.0)
    guard, trainer = _fit(module, 160, 0)
    assert len(guard.rollbacks) >= 1 and guard.stopped_step is None and trainer.global_step == 160
    opt = trainer.optimizers[0]
    assert opt.param_groups is opt.base.param_groups and opt.state is opt.base.state

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
from lightning_monitor.snapshot import SnapshotMismatch, TrainingSnapshot


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


def _trainer(opts, scheds=()):
    return SimpleNamespace(optimizers=list(opts), lr_scheduler_configs=[SimpleNamespace(scheduler=s) for s in scheds],
                           precision_plugin=None, current_epoch=0, global_rank=0)


def _train(model, opt, n, scale=1.0):
    for _ in range(n):
        (scale * model(torch.randn(4, 3))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


class _Forwarding(torch.optim.Optimizer):
    """A wrapper that reads its groups and state from the optimizer it steps, through properties."""

    def __init__(self, inner):
        self.inner, self.defaults = inner, inner.defaults
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self, closure=None):
        return self.inner.step(closure)

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none)


class _Several(_Forwarding):
    """A wrapper stepping optimizers held in a list, its groups their group dicts."""

    def __init__(self, opts):
        self.opts, self.defaults = list(opts), {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}
        self.__dict__["param_groups"] = [g for o in self.opts for g in o.param_groups]
        self.__dict__["state"] = {}

    param_groups = None  # plain attributes here (set in __init__), not the parent's properties
    state = None

    def step(self, closure=None):
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.opts:
            o.zero_grad(set_to_none)

    def state_dict(self):
        return {"opts": [o.state_dict() for o in self.opts]}

    def load_state_dict(self, state):
        for o, s in zip(self.opts, state["opts"]):
            o.load_state_dict(s)


def test_a_wrapper_reading_its_groups_through_properties_gets_its_rates_back():
    """Its load wrote entries the properties hid: the rate stayed at its diverged value while the scheduler went
    back, and the run went on 8x below its schedule."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = _Forwarding(inner)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    trainer = _trainer([opt], [sched])
    _train(model, opt, 2)
    snap = TrainingSnapshot.capture(trainer, nn.Sequential(model), {}, step=2, lr_scale=1.0)
    momentum = inner.state[model.weight]["momentum_buffer"].clone()
    for _ in range(3):
        _train(model, opt, 1, 100.0)
        sched.step()
    snap.restore(trainer, nn.Sequential(model), {})
    assert opt.param_groups[0]["lr"] == 0.1 and sched.last_epoch == 0
    assert torch.equal(inner.state[model.weight]["momentum_buffer"], momentum)
    assert "param_groups" not in opt.__dict__ and "state" not in opt.__dict__
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05


def test_optimizers_held_in_a_list_keep_the_groups_their_wrapper_shares():
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3), nn.Linear(3, 2)
    model = nn.Sequential(a, b)
    inner = [torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), torch.optim.Adam(b.parameters(), lr=1e-3)]
    opt = _Several(inner)
    trainer = _trainer([opt])
    _train(model, opt, 2)
    snap = TrainingSnapshot.capture(trainer, model, {}, step=2, lr_scale=1.0)
    momentum = inner[0].state[a.weight]["momentum_buffer"].clone()
    _train(model, opt, 3, 100.0)
    snap.restore(trainer, model, {})
    assert torch.equal(inner[0].state[a.weight]["momentum_buffer"], momentum)
    assert opt.param_groups[0] is inner[0].param_groups[0] and opt.param_groups[1] is inner[1].param_groups[0]
    opt.param_groups[0]["lr"] = 0.001  # a rate cut through the wrapper reaches the optimizer that steps
    assert inner[0].param_groups[0]["lr"] == 0.001


def test_groups_added_since_the_snapshot_under_wrappers():
    """SAM's base optimizer keeps the state of the groups it had (it lost all of it); a Lookahead, whose own format has
    no groups to add the new one to, makes the snapshot a misfit (its load failed half way and crashed the fit)."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3), nn.Linear(3, 2)
    model = nn.Sequential(a, b)
    sam = SAM(a.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    lookahead = Lookahead(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9))
    for opt, wrapped in ((sam, sam.base), (lookahead, lookahead.base)):
        trainer = _trainer([opt])
        _train(model, opt, 2)
        snap = TrainingSnapshot.capture(trainer, model, {}, step=2, lr_scale=1.0)
        momentum = wrapped.state[a.weight]["momentum_buffer"].clone()
        wrapped.add_param_group({"params": list(b.parameters()), "lr": 0.01})  # an unfreeze (the groups are shared)
        _train(model, opt, 2, 100.0)
        if opt is sam:
            assert snap.mismatch(trainer) is None
            snap.restore(trainer, model, {})
            assert torch.equal(wrapped.state[a.weight]["momentum_buffer"], momentum)
            assert b.weight not in wrapped.state and opt.param_groups[1]["lr"] == 0.01
        else:
            assert "format of its own" in snap.mismatch(trainer)
            with pytest.raises(SnapshotMismatch):
                snap.restore(trainer, model, {})

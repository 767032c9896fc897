"""A module called more than once in one forward where one call's output receives no gradient (a target under
stop-gradient from the same encoder; a router whose logits feed an argmax and a softmax): that call contributes
nothing to the gradient, so the per-example norms are those of the calls that do, exact against a loop over
examples. It used to be left out as "has a gradient but its module's forward was not called"."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientNoiseScaleMonitor, PerExampleGradNorms
from test_probe_fixes_oracle import NoiseScaleOracle, assert_exact, loop_oracle


class TwoViews(nn.Module):
    """Predicts the embedding of one view from the other's; the target under stop-gradient. ``x``: ``[B, 2, T, 5]``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(5, 8)
        self.pred = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        target = self.enc(x[:, 1]).detach()
        return ((self.pred(torch.tanh(self.enc(x[:, 0]))) - target) ** 2).flatten(1).sum(-1)


class Router(nn.Module):
    """Top-1 gating: the router's logits are used for an argmax in one call, for a softmax in the other."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(5, 3)
        self.o = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        top = self.router(x).argmax(-1, keepdim=True)
        return self.o(x) * torch.softmax(self.router(x), -1).gather(-1, top)


def mean_loss(out: Tensor, y: Tensor) -> Tensor:
    return out.mean()


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def cases() -> dict[str, tuple[nn.Module, Tensor, Tensor, Any]]:
    torch.manual_seed(0)
    return {
        "two_views": (TwoViews(), torch.randn(6, 2, 4, 5), torch.zeros(6), mean_loss),
        "two_views_flat": (TwoViews(), torch.randn(6, 2, 5), torch.zeros(6), mean_loss),
        "router": (Router(), torch.randn(6, 5), torch.arange(6) % 3, ce),
    }


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("strategy", ["auto", "gram"])  # fused and plain-hook paths
@pytest.mark.parametrize("case", ["two_views", "two_views_flat", "router"])
def test_call_without_gradient_contributes_nothing(case: str, strategy: str, verify: bool) -> None:
    model, x, y, loss_fn = cases()[case]
    with PerExampleGradNorms(model, linear_strategy=strategy, verify=verify) as probe:
        loss_fn(model(x), y).backward()
    per = probe.per_parameter()
    assert probe.uncovered == []
    assert_exact(per, loop_oracle(model, loss_fn, x, y))


def test_several_backward_passes_keep_their_examples_apart() -> None:
    """Two forward/backward passes read together (gradient accumulation): each pass's awaited use is settled when
    the next forward starts, not summed with the next pass's examples."""
    model, x, y, loss_fn = cases()["two_views"]
    with PerExampleGradNorms(model, batch_size=6) as probe:
        for part in (slice(0, 3), slice(3, 6)):
            loss_fn(model(x[part]), y[part]).backward()
    per = probe.per_parameter()
    assert probe.uncovered == []
    ref = {n: torch.cat([v[:3], v[3:]]) for n, v in loop_oracle(model, loss_fn, x, y).items()}
    assert_exact(per, ref)


def test_parameter_used_outside_its_module_says_so() -> None:
    class Outside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            self.a(x).argmax(-1)  # called, its output gets no gradient
            return x @ self.a.weight.T  # the weight used outside the module

    with PerExampleGradNorms(Outside(), verify=False) as probe:
        F.cross_entropy(probe.module(torch.randn(5, 4)), torch.arange(5) % 4).backward()
    probe.per_parameter()
    assert "a.weight" in probe.uncovered
    assert "used outside its module" in probe.reasons["a.weight"]


class _Wrap(pl.LightningModule):
    def __init__(self, net: nn.Module, loss_fn: Any) -> None:
        super().__init__()
        self.net, self.loss_fn = net, loss_fn

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.loss_fn(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("case", ["two_views", "router"])
def test_fit_covers_every_parameter_and_matches_the_oracle(case: str, tmp_path) -> None:
    torch.manual_seed(0)
    model = TwoViews() if case == "two_views" else Router()
    x = torch.randn(40, 2, 4, 5) if case == "two_views" else torch.randn(40, 5)
    y = torch.zeros(40) if case == "two_views" else torch.arange(40) % 3
    loss_fn = mean_loss if case == "two_views" else ce
    mon = GradientNoiseScaleMonitor(method="per_example", every_n_steps=1, smoothing=0.0, per_layer=False)
    oracle = NoiseScaleOracle(mon, loss_fn, lambda m, xi: m.net(xi))
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[oracle, mon],
                         default_root_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Wrap(model, loss_fn), DataLoader(TensorDataset(x, y), batch_size=8))
    assert float(trainer.callback_metrics["gns/coverage"]) == 1.0
    assert mon._probe.uncovered == []
    assert len(oracle.rows) == 4 and oracle.worst() < 1e-3


@pytest.mark.parametrize("strategy", ["gram", "auto"])
def test_two_views_then_a_backward_each_with_a_forward_between_exact(strategy: str) -> None:
    """An encoder run on two views, then one backward per view, with a forward without gradients between (a metric):
    the parameters wait for the second view's gradient across that forward (settling them at any new forward broke
    the second backward: 'the backward of enc.0.weight has not finished')."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    x1, x2 = torch.randn(6, 5), torch.randn(6, 5)
    truth = []
    for i in range(6):
        grads = torch.autograd.grad(enc(x1[i:i + 1]).pow(2).sum() + enc(x2[i:i + 1]).pow(2).sum(), list(enc.parameters()))
        truth.append(sum(float(g.pow(2).sum()) for g in grads))
    with PerExampleGradNorms(enc, loss_reduction="sum", linear_strategy=strategy) as probe:
        z1, z2 = enc(x1), enc(x2)
        z1.pow(2).sum().backward()
        with torch.no_grad():
            enc(x1)
        z2.pow(2).sum().backward()
    torch.testing.assert_close(probe.squared_norms(), torch.tensor(truth), rtol=1e-4, atol=1e-6)

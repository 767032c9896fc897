"""nn.Linear handler (lightning_monitor/probes/per_example/linear.py) against torch.func, and the one
strategy rule of Linear-form layers (strategy.LinearRule)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_per_example import ce_seq, check
from torch import Tensor, nn

from lightning_monitor import PerExampleGradNorms
from lightning_monitor.probes.per_example import LinearRule

STRATEGIES = ["auto", "fused", "gram", "materialize"]


def mse_seq(out: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(out, y)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("shape", [(6, 5), (6, 4, 5), (6, 2, 3, 5), (6, 1, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_exact(strategy: str, shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(5, 7, bias=bias)
    x = torch.randn(*shape)
    y = torch.randn(*shape[:-1], 7)
    probe = check(model, mse_seq, x, y, linear_strategy=strategy)
    assert probe.uncovered == []


class CountingLinear(nn.Linear):
    """A Linear subclass with its own forward: the handler of nn.Linear, never the fused path."""

    calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return super().forward(x)


class ScaledLinear(nn.Linear):
    """Not a Linear map any more: the verification must move its parameters to ``uncovered``."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * 0.5


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_linear_subclass_uses_plain_hooks(strategy: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(CountingLinear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(4, 9, 6), torch.randint(0, 3, (4, 9))
    with PerExampleGradNorms(model, linear_strategy=strategy):
        assert "forward" not in model[0].__dict__ and model[0]._forward_hooks
    probe = check(model, ce_seq, x, y, linear_strategy=strategy)
    assert probe.uncovered == []


def test_linear_subclass_that_is_not_linear_is_caught() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(ScaledLinear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(4, 9, 6), torch.randint(0, 3, (4, 9))
    probe = check(model, ce_seq, x, y)
    assert probe.uncovered == ["0.weight", "0.bias"]


# ----------------------------------------------------------------------------- the rule


def choose(rule: LinearRule, **kw) -> str:
    kw.setdefault("device_type", "cpu")
    return rule.choose(**kw)


def test_rule_cost_against_fused() -> None:
    """Fused unless T^2 (d_in + d_out) < GRAM_OVER_FUSED d_in d_out: 32 x 64 -> T <= 13 is Gram."""
    rule = LinearRule("auto", 256 * 2**20)
    assert choose(rule, t=13, d_in=32, d_out=64, batch=4, fused=True) == "gram"
    assert choose(rule, t=14, d_in=32, d_out=64, batch=4, fused=True) == "fused"
    # a layer that cannot fuse weighs Gram against the extra matmul: T (d_in + d_out) < d_in d_out
    assert choose(rule, t=21, d_in=32, d_out=64, batch=4) == "gram"
    assert choose(rule, t=22, d_in=32, d_out=64, batch=4) == "materialize"
    # one cost rule: where Gram beats fused it is chosen, never the dearer materialised path
    assert choose(rule, t=7, d_in=16, d_out=11, batch=4, fused=True) == "gram"


def test_rule_memory(monkeypatch) -> None:
    """The per-example gradients held at once, 4 n d_in d_out bytes, must fit the cap."""
    from lightning_monitor.probes import per_example

    per = 4 * 16 * 64
    rule = LinearRule("auto", 2 * per)
    kw = {"t": 32, "d_in": 16, "d_out": 64, "batch": 5}
    monkeypatch.setattr(per_example, "CPU_CHUNK_BYTES", 1)  # one example at a time on CPU
    assert choose(rule, fused=True, **kw) == "fused"
    assert choose(rule, fused=True, device_type="cuda", **kw) == "gram"  # the whole batch at once
    assert choose(rule, **kw) == "gram"  # materialize holds the whole batch
    monkeypatch.setattr(per_example, "CPU_CHUNK_BYTES", 2 * per)
    assert choose(rule, fused=True, **kw) == "fused"  # two examples: exactly the cap
    monkeypatch.setattr(per_example, "CPU_CHUNK_BYTES", 3 * per)
    assert choose(rule, fused=True, **kw) == "gram"
    assert choose(LinearRule("auto", 5 * per), **kw) == "materialize"
    assert choose(LinearRule("auto", None), fused=True, **kw) == "fused"  # no cap


def test_rule_explicit_strategies() -> None:
    kw = {"t": 32, "d_in": 16, "d_out": 64, "batch": 5}
    for s in ("gram", "materialize"):
        assert choose(LinearRule(s, 0), fused=True, **kw) == s
    assert choose(LinearRule("fused", 0), fused=True, **kw) == "fused"  # forced: no cap, no cost rule
    # "fused" on a layer that cannot fuse is "auto"
    assert choose(LinearRule("fused", 0), **kw) == choose(LinearRule("auto", 0), **kw) == "gram"
    assert choose(LinearRule("fused", None), **kw) == "materialize"


class MaskedInPlace(nn.Module):
    """Writes into its first layer's output in place (wav2vec2's and HuBERT's SpecAugment: ``h[mask] = emb``).
    ``F.linear`` with a bias on a 3-D input returns a view of its product, and a view written in place loses the
    gradient hooks registered on it; a custom Function's output that is a view may not be written at all."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 8, bias=bias)
        self.emb = nn.Parameter(torch.randn(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)
        h[:, :2] = self.emb
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("pre_hook", [False, True])
def test_output_written_in_place(strategy: str, bias: bool, pre_hook: bool) -> None:
    # it raised "Output 0 of Slice is a view and is being modified inplace" on the fused path, and on the plain
    # hooks (a layer with a forward pre-hook, e.g. spectral alignment's input capture) it left the layer out as
    # "has a gradient but its module's forward was not called"
    torch.manual_seed(0)
    model = MaskedInPlace(bias)
    if pre_hook:
        model.proj.register_forward_pre_hook(lambda m, args: None)
    x, y = torch.randn(6, 4, 5), torch.randint(0, 3, (6, 4))
    probe = check(model, ce_seq, x, y, linear_strategy=strategy)
    assert {"proj.weight", "head.weight"} <= set(probe.covered)
    assert probe.uncovered == ["emb"]

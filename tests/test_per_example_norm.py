"""nn.LayerNorm / nn.RMSNorm handler (lightning_monitor/probes/per_example/norm.py) against torch.func."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_per_example import check, probe_run
from torch import Tensor, nn

from lightning_monitor import PerExampleGradNorms


class NormHead(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.w = nn.Parameter(torch.randn(6, 4), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.norm(x)).flatten(-2) @ self.w if x.dim() == 4 else torch.tanh(self.norm(x)) @ self.w[:3]


def mse(out: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(out, y)


NORMS = {
    "layernorm": lambda: nn.LayerNorm(3),
    "layernorm_no_bias": lambda: nn.LayerNorm(3, bias=False),
    "rmsnorm": lambda: nn.RMSNorm(3),
    "rmsnorm_eps": lambda: nn.RMSNorm(3, eps=1e-3),
}


@pytest.mark.parametrize("kind", list(NORMS))
@pytest.mark.parametrize("shape", [(5, 3), (5, 4, 3)])
def test_norm_exact(kind: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = NormHead(NORMS[kind]())
    with torch.no_grad():  # affine parameters away from their initial values
        for p in model.norm.parameters():
            p.add_(torch.randn_like(p))
    x = torch.randn(*shape)
    probe = check(model, mse, x, torch.randn(*shape[:-1], 4))
    assert probe.uncovered == []


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_over_two_dims_exact(kind: str) -> None:
    torch.manual_seed(0)
    norm = nn.LayerNorm((2, 3)) if kind == "layernorm" else nn.RMSNorm((2, 3))
    model = NormHead(norm)
    x = torch.randn(5, 4, 2, 3)
    probe = check(model, mse, x, torch.randn(5, 4, 4))
    assert probe.uncovered == []


# ----------------------------------------------------------------------------- GroupNorm, RMSNorm in bf16


@pytest.mark.parametrize("affine", [True, False])
def test_groupnorm_exact(affine: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.GroupNorm(3, 6, affine=affine), nn.Tanh(), nn.Flatten(), nn.Linear(6 * 4 * 4, 3))
    probe = check(model, F.cross_entropy, torch.randn(5, 3, 6, 6), torch.randint(0, 3, (5,)))
    assert probe.uncovered == []


def test_groupnorm_on_sequences_exact() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 6, 3, padding=1), nn.GroupNorm(2, 6), nn.Tanh(), nn.Flatten(), nn.Linear(6 * 7, 3))
    probe = check(model, F.cross_entropy, torch.randn(5, 4, 7), torch.randint(0, 3, (5,)))
    assert probe.uncovered == []


def test_batchnorm_uncovered_with_its_reason() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))
    probe = probe_run(model, F.cross_entropy, torch.randn(6, 4), torch.randint(0, 3, (6,)))
    # the Linear before it feeds it: the batch's statistics couple the examples there too (test_per_example_batchnorm)
    assert set(probe.per_parameter()) == {"3.weight", "3.bias"}
    assert sorted(probe.uncovered) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert "batch statistics couple the examples" in probe.reasons["1.weight"]
    assert "feeds '1', a BatchNorm" in probe.reasons["0.weight"]


class Bf16RMS(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.norm = nn.RMSNorm(8)  # eps=None: torch computes bf16 inputs with fp32's epsilon
        self.out = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.norm(self.inp(x) * 1e-3))  # small activations: eps matters


def _rel(a: Tensor, b: Tensor) -> float:
    return float(((a.double() - b.double()).abs() / b.double().abs().clamp_min(1e-30)).max())


@pytest.mark.parametrize("verify", [True, False])
def test_rmsnorm_default_eps_in_bf16_matches_torch_func(verify: bool) -> None:
    from test_per_example import oracle

    torch.manual_seed(0)
    model = Bf16RMS().to(torch.bfloat16)
    x, y = torch.randn(6, 4, 5).to(torch.bfloat16), torch.randint(0, 3, (6, 4))
    ce = lambda out, t: F.cross_entropy(out.float().reshape(-1, 3), t.reshape(-1))  # noqa: E731
    probe = probe_run(model, ce, x, y, verify=verify)
    ref = oracle(model, ce, x, y)  # the bf16 model's own per-example gradients
    assert "norm.weight" in probe.covered
    assert _rel(probe.per_parameter()["norm.weight"], ref["norm.weight"]) < 0.05  # bf16 rounding, not 2x


def test_rmsnorm_under_autocast_close_to_fp32() -> None:
    from test_per_example import oracle

    torch.manual_seed(0)
    model = Bf16RMS()
    x, y = torch.randn(6, 4, 5), torch.randint(0, 3, (6, 4))
    ce = lambda out, t: F.cross_entropy(out.float().reshape(-1, 3), t.reshape(-1))  # noqa: E731
    ref = oracle(model, ce, x, y)
    with PerExampleGradNorms(model) as probe, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ce(model(x), y)
    loss.backward()
    assert "norm.weight" in probe.covered
    assert _rel(probe.per_parameter()["norm.weight"], ref["norm.weight"]) < 0.05

"""nn.LayerNorm / nn.RMSNorm handler (lightning_monitor/probes/per_example/norm.py) against torch.func."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_per_example import check
from torch import Tensor, nn


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

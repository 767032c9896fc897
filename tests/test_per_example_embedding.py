"""nn.Embedding handler (lightning_monitor/probes/per_example/embedding.py) against torch.func."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_per_example import check
from torch import Tensor, nn

from lightning_monitor import PerExampleGradNorms


class EmbHead(nn.Module):
    def __init__(self, padding_idx: int | None) -> None:
        super().__init__()
        self.emb = nn.Embedding(9, 6, padding_idx=padding_idx)
        self.w = nn.Parameter(torch.randn(6, 4), requires_grad=False)  # a fixed, uncovered readout

    def forward(self, idx: Tensor) -> Tensor:
        return torch.tanh(self.emb(idx)) @ self.w


def mse(out: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(out, y)


@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("shape", [(5,), (5, 7), (5, 2, 3)])
def test_embedding_exact(padding_idx: int | None, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = EmbHead(padding_idx)
    idx = torch.randint(0, 9, shape)
    if len(shape) > 1:  # (every example keeps a non-padding token: a zero gradient has no relative error)
        idx[:, 0] = 0  # padding tokens (when padding_idx=0)
        idx[1, 1:] = 4  # one token repeated over an example
    y = torch.randn(*shape, 4)
    probe = check(model, mse, idx, y)
    assert probe.covered == ["emb.weight"]


def test_scale_grad_by_freq_uncovered() -> None:
    model = nn.Embedding(9, 6, scale_grad_by_freq=True)
    probe = PerExampleGradNorms(model)
    assert probe.uncovered == ["weight"] and "scale_grad_by_freq" in probe.reasons["weight"]

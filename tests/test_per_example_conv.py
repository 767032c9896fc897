"""nn.Conv2d handler (lightning_monitor/probes/per_example/conv.py) against torch.func."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_per_example import check
from torch import nn

CONVS = {
    "plain": lambda: nn.Conv2d(3, 4, 3),
    "stride_pad": lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1),
    "groups_no_bias": lambda: nn.Conv2d(4, 6, 3, groups=2, bias=False),
    "dilation_rect": lambda: nn.Conv2d(3, 4, (3, 2), dilation=(1, 2)),
    "same_reflect": lambda: nn.Conv2d(3, 4, 3, padding="same", padding_mode="reflect"),
    "same_even_kernel": lambda: nn.Conv2d(3, 4, 2, padding="same"),
    "valid": lambda: nn.Conv2d(3, 4, 3, padding="valid"),
    "circular": lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"),
    "replicate": lambda: nn.Conv2d(3, 4, 3, padding=(1, 2), padding_mode="replicate"),
    "pointwise": lambda: nn.Conv2d(3, 4, 1),
}


@pytest.mark.parametrize("kind", list(CONVS))
@pytest.mark.parametrize("strategy", ["auto", "gram", "materialize"])
def test_conv2d_exact(kind: str, strategy: str) -> None:
    torch.manual_seed(0)
    conv = CONVS[kind]()
    model = nn.Sequential(conv, nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    cin = conv.in_channels
    x = torch.randn(5, cin, 7, 6)
    y = torch.randn(5, conv.out_channels)
    probe = check(model, F.mse_loss, x, y, linear_strategy=strategy)
    assert probe.uncovered == []


def test_conv2d_memory_cap_exact() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    check(model, F.mse_loss, torch.randn(5, 3, 7, 6), torch.randn(5, 4), max_fused_bytes=0)


CONV1DS = {
    "plain": lambda: nn.Conv1d(3, 4, 3),
    "stride_pad": lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1),
    "groups_no_bias": lambda: nn.Conv1d(4, 6, 3, groups=2, bias=False),
    "dilation": lambda: nn.Conv1d(3, 4, 2, dilation=2),
    "same_reflect": lambda: nn.Conv1d(3, 4, 3, padding="same", padding_mode="reflect"),
    "circular": lambda: nn.Conv1d(3, 4, 3, padding=1, padding_mode="circular"),
    "depthwise": lambda: nn.Conv1d(3, 3, 3, groups=3, padding=1),
}


@pytest.mark.parametrize("kind", list(CONV1DS))
def test_conv1d_exact(kind: str) -> None:
    torch.manual_seed(0)
    conv = CONV1DS[kind]()
    model = nn.Sequential(conv, nn.Tanh(), nn.AdaptiveAvgPool1d(1), nn.Flatten())
    x = torch.randn(5, conv.in_channels, 9)
    probe = check(model, F.mse_loss, x, torch.randn(5, conv.out_channels))
    assert probe.uncovered == []

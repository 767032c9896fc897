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


CONVNDS = {
    "conv3d": (lambda: nn.Conv3d(2, 3, 3), (5, 2, 5, 6, 4)),
    "conv3d_stride_groups": (lambda: nn.Conv3d(4, 6, (3, 2, 2), stride=2, padding=1, groups=2), (5, 4, 6, 6, 5)),
    "conv3d_same_reflect": (lambda: nn.Conv3d(2, 3, 3, padding="same", padding_mode="reflect"), (4, 2, 5, 5, 5)),
    "transposed1d": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1), (5, 3, 7)),
    "transposed2d": (lambda: nn.ConvTranspose2d(3, 4, 3, stride=2), (5, 3, 5, 4)),
    "transposed2d_groups_dilation": (lambda: nn.ConvTranspose2d(4, 6, 2, groups=2, dilation=2, bias=False), (5, 4, 5, 4)),
    "transposed3d": (lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), (4, 2, 3, 3, 2)),
}


@pytest.mark.parametrize("kind", list(CONVNDS))
@pytest.mark.parametrize("cap", [None, 0])
def test_conv3d_and_transposed_exact(kind: str, cap) -> None:
    """Conv3d and ConvTranspose1d/2d/3d against torch.func, in one chunk and one example at a time (cap 0)."""
    torch.manual_seed(0)
    make, shape = CONVNDS[kind]
    conv = make()
    pool = {3: nn.AdaptiveAvgPool1d, 4: nn.AdaptiveAvgPool2d, 5: nn.AdaptiveAvgPool3d}[len(shape)](1)
    model = nn.Sequential(conv, nn.Tanh(), pool, nn.Flatten())
    kw = {} if cap is None else {"max_fused_bytes": cap}
    probe = check(model, F.mse_loss, torch.randn(*shape), torch.randn(shape[0], conv.out_channels), **kw)
    assert probe.uncovered == []


class _UpDown(nn.Module):
    """A decoder step as U-Nets write it: a transposed convolution given the skip's size, used twice (shared)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.down(x))
        u = torch.tanh(self.up(h, output_size=x.shape[-2:]))  # output padding from the size asked for
        u = u + torch.tanh(self.up(h, output_size=[x.shape[-2] - 1, x.shape[-1] - 1])).mean((2, 3), keepdim=True)
        return self.head(u.mean((2, 3)))


def test_transposed_output_size_and_shared_use_exact() -> None:
    torch.manual_seed(0)
    probe = check(_UpDown(), F.cross_entropy, torch.randn(5, 3, 8, 8), torch.randint(0, 2, (5,)))
    assert probe.uncovered == []


@pytest.mark.parametrize("first", ["conv2d", "conv1d", "conv_transpose2d"])
def test_a_float64_model_keeps_its_gradient_in_float64(first: str) -> None:
    """The fused convolution hands autograd the sum of the per-example gradients it formed: in a float64 model they
    are formed in float64, so the training gradient is autograd's to the last bits (it was float32's, ~1e-7 off)."""
    from lightning_monitor import PerExampleGradNorms

    torch.manual_seed(0)
    layer, x = {
        "conv2d": (nn.Conv2d(3, 8, 3, padding=1), torch.randn(16, 3, 8, 8)),
        "conv1d": (nn.Conv1d(3, 8, 3, padding=1), torch.randn(16, 3, 8)),
        "conv_transpose2d": (nn.ConvTranspose2d(3, 8, 3, stride=2), torch.randn(16, 3, 5, 5)),
    }[first]
    model = nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.LazyLinear(3)).double()
    x, y = x.double(), torch.randint(0, 3, (16,))
    model(x)
    F.cross_entropy(model(x), y).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with PerExampleGradNorms(model) as probe:
        F.cross_entropy(model(x), y).backward()
    assert probe.uncovered == []
    for n in ("0.weight", "0.bias"):
        grad = dict(model.named_parameters())[n].grad
        assert grad.dtype == torch.float64
        torch.testing.assert_close(grad, ref[n], rtol=1e-12, atol=1e-14)

"""``nn.Conv2d``: the Linear form on unfolded patches, one group at a time (stride, dilation, groups,
``padding="same"`` at stride 1, non-zero padding modes); the weight norms by the rule of
:class:`~.strategy.LinearRule` (Gram or materialised, never fused), bias ``||sum_l d_l||^2``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_monitor.probes.per_example.kernels import linear_sq_norms, project_matrix
from lightning_monitor.probes.per_example.registry import Handler, register
from lightning_monitor.probes.per_example.strategy import LinearRule


def _patches(m: nn.Conv2d, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Per group: patches ``(B * groups, L, C_in/groups * kh * kw)`` and grads ``(B * groups, L, C_out/groups)``."""
    kh, kw = m.kernel_size
    if isinstance(m.padding, str):
        if m.padding == "valid":
            pad = [0, 0, 0, 0]
        else:  # "same" (nn.Conv2d refuses it with a stride > 1)
            pad = []
            for k, dil in ((kw, m.dilation[1]), (kh, m.dilation[0])):
                total = dil * (k - 1)
                pad += [total // 2, total - total // 2]
        x = F.pad(x, pad, mode="constant" if m.padding_mode == "zeros" else m.padding_mode)
        padding: Any = 0
    elif m.padding_mode != "zeros":
        # what nn.Conv2d pads with for a non-"zeros" padding_mode: its integer padding, last dim first,
        # each side (torch's private `_reversed_padding_repeated_twice`, built from the public `padding`)
        x = F.pad(x, [p for p in reversed(m.padding) for _ in range(2)], mode=m.padding_mode)
        padding = 0
    else:
        padding = m.padding
    u = F.unfold(x.float(), (kh, kw), dilation=m.dilation, padding=padding, stride=m.stride)  # B, C k k, L
    b, _, length = u.shape
    grp = m.groups
    a = u.reshape(b, grp, -1, length).permute(0, 1, 3, 2).reshape(b * grp, length, -1)
    d = g.float().reshape(b, grp, m.out_channels // grp, -1).permute(0, 1, 3, 2).reshape(b * grp, length, -1)
    return a, d


@register(nn.Conv2d)
class Conv2dHandler(Handler):
    def capture(self, m: nn.Module, x: Tensor) -> Any:
        return x if x.dim() == 4 else None

    def sq_norms(self, m: nn.Module, x: Tensor, g: Tensor, rule: LinearRule) -> dict[str, Tensor]:
        b = x.shape[0]
        a, d = _patches(m, x, g)
        strategy = rule.choose(t=a.shape[1], d_in=a.shape[2], d_out=d.shape[2], batch=b,
                               device_type=a.device.type, groups=m.groups)
        out = {"weight": linear_sq_norms(a, d, strategy).reshape(b, m.groups).sum(1)}
        if m.bias is not None:
            out["bias"] = g.float().flatten(2).sum(2).pow(2).sum(1)
        return out

    def grads(self, m: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
        b = x.shape[0]
        a, d = _patches(m, x, g)
        out = {"weight": torch.bmm(d.transpose(1, 2), a).reshape(b, *m.weight.shape)}
        if m.bias is not None:
            out["bias"] = g.float().flatten(2).sum(2)
        return out

    def project(self, m: nn.Module, x: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        out = {}
        if "weight" in uv:
            u, v = uv["weight"]
            b, grp, k = x.shape[0], m.groups, u.shape[0]
            a, d = _patches(m, x, g)
            a = a.reshape(b, grp, a.shape[1], -1)
            d = d.reshape(b, grp, d.shape[1], -1)
            du = torch.einsum("bglo,kgo->bglk", d, u.reshape(k, grp, -1))
            av = torch.einsum("bglc,kc->bglk", a, v)
            out["weight"] = (du * av).sum((0, 1, 2))
        if "bias" in uv:
            out["bias"] = project_matrix(g.float().sum((0, 2, 3)), *uv["bias"])
        return out

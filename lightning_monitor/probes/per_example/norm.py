"""``nn.LayerNorm`` and ``nn.RMSNorm``: per example, weight ``sum_t d_t * xhat_t`` and bias ``sum_t d_t``
(``xhat`` the normalised input, recomputed in fp32), squared."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_monitor.probes.per_example.kernels import project_matrix
from lightning_monitor.probes.per_example.registry import Handler, register


def _normalized(m: nn.Module, x: Tensor) -> Tensor:
    shape = tuple(m.normalized_shape)
    xf = x.float()
    if isinstance(m, nn.LayerNorm):
        return F.layer_norm(xf, shape, None, None, m.eps)
    eps = m.eps if m.eps is not None else torch.finfo(x.dtype).eps
    return F.rms_norm(xf, shape, None, eps)


class NormHandler(Handler):
    def grads(self, m: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
        with torch.no_grad():
            b = x.shape[0]
            xhat = _normalized(m, x)
            d = g.float()
            keep = (b, -1) + tuple(m.normalized_shape)
            out: dict[str, Tensor] = {}
            if getattr(m, "weight", None) is not None:
                out["weight"] = (d * xhat).reshape(keep).sum(1)
            if getattr(m, "bias", None) is not None:
                out["bias"] = d.reshape(keep).sum(1)
            return out

    def sq_norms(self, m: nn.Module, x: Tensor, g: Tensor, rule: Any) -> dict[str, Tensor]:
        return {k: v.pow(2).flatten(1).sum(1) for k, v in self.grads(m, x, g).items()}

    def project(self, m: nn.Module, x: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        per = self.grads(m, x, g)
        return {k: project_matrix(per[k].sum(0), *uv[k]) for k in uv}


register(nn.LayerNorm, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))(NormHandler)

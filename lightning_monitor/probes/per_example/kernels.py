"""Per-example squared norms of Linear-form weight gradients ``G_i = D_i^T A_i``, and the projections
used by the verification. Shared by the Linear and Conv2d handlers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from lightning_monitor.probes.per_example.strategy import LinearRule, examples_at_once

__all__ = ["as_seq", "linear_sq_norms", "per_example_linear", "project_matrix"]


def forward_under_autocast(fn: Callable[[Tensor, Tensor, Optional[Tensor]], Tensor], x: Tensor, weight: Tensor,
                           bias: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(fn(x, weight, bias), x, weight)`` inside a custom ``autograd.Function``'s forward, where autocast does
    not cast: under autocast the operands are cast to its dtype first (as the layer's own forward would be),
    and the cast ``x`` and ``weight`` are returned for ``save_for_backward``."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return fn(x, weight, bias), x, weight
    dt = torch.get_autocast_dtype(device)
    x, weight = x.to(dt), weight.to(dt)
    bias = None if bias is None else bias.to(dt)
    with torch.autocast(device, enabled=False):
        return fn(x, weight, bias), x, weight


def as_seq(x: Tensor, d: int) -> Tensor:
    """``(B, ..., d)`` -> ``(B, T, d)``."""
    return x.reshape(x.shape[0], -1, d)


def project_matrix(c: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """``u_j^T C v_j`` for each row ``j`` of ``u`` (``k x rows``) and ``v`` (``k x cols``), with ``C`` the
    tensor ``c`` viewed as ``(shape[0], -1)`` (a 1-D ``c`` as a column, a 0-D one as ``1 x 1``)."""
    c2 = c.float().reshape(c.shape[0] if c.dim() else 1, -1)
    return ((u @ c2) * v).sum(1)


def linear_sq_norms(a: Tensor, d: Tensor, strategy: str = "auto") -> Tensor:
    """``||D_i^T A_i||_F^2`` for each ``i``: ``a`` is ``(B, T, d_in)``, ``d`` is ``(B, T, d_out)``; fp32.

    ``strategy``: ``"gram"``, ``"materialize"``, or ``"auto"`` (the cost rule of
    :class:`~lightning_monitor.probes.per_example.strategy.LinearRule` between the two, no memory cap).

    >>> a, d = torch.randn(4, 3, 5), torch.randn(4, 3, 2)
    >>> torch.allclose(linear_sq_norms(a, d), torch.einsum("bto,bti->boi", d, a).pow(2).sum((1, 2)))
    True
    """
    a, d = a.float(), d.float()
    b, t, d_in = a.shape
    d_out = d.shape[-1]
    if t == 1:
        return a.pow(2).sum((1, 2)) * d.pow(2).sum((1, 2))
    if strategy == "auto":
        strategy = LinearRule().choose(t=t, d_in=d_in, d_out=d_out, batch=b, device_type=a.device.type)
    if strategy == "gram":
        ga = torch.bmm(a, a.transpose(1, 2))
        gd = torch.bmm(d, d.transpose(1, 2))
        return (ga * gd).sum((1, 2))
    return torch.bmm(d.transpose(1, 2), a).pow(2).sum((1, 2))


def per_example_linear(a: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """``(sum_i G_i, ||G_i||_F^2)`` for ``G_i = D_i^T A_i``, ``a`` ``(B, T, d_in)``, ``d`` ``(B, T, d_out)``:
    the fused Linear's backward. On CPU a chunk of examples at a time
    (:func:`~lightning_monitor.probes.per_example.strategy.examples_at_once`), reduced to their norms
    and their sum while in cache; elsewhere one batched matmul.

    The sum has the inputs' dtype (accumulated in fp32 for half types), the squared norms are fp32.

    >>> a, d = torch.randn(3, 5, 4), torch.randn(3, 5, 2)
    >>> s, sq = per_example_linear(a, d)
    >>> g = torch.einsum("bto,bti->boi", d, a)
    >>> torch.allclose(s, g.sum(0), atol=1e-5) and torch.allclose(sq, g.pow(2).sum((1, 2)), rtol=1e-5)
    True
    """
    b, _, d_in = a.shape
    d_out = d.shape[-1]
    dt = d.transpose(1, 2)
    chunk = examples_at_once(a.device.type, b, d_in * d_out * a.element_size())
    half = a.dtype in (torch.float16, torch.bfloat16)
    acc = torch.float32 if half else None  # squared norms accumulated in fp32 (or wider)
    if chunk >= b:
        p = torch.bmm(dt, a)
        return p.sum(0), torch.linalg.vector_norm(p.flatten(1), dim=1, dtype=acc).pow(2).float()
    # half types: the sum is accumulated in fp32 from zero; otherwise the first chunk is written into it
    total = (torch.zeros if half else torch.empty)(d_out, d_in, dtype=torch.float32 if half else a.dtype,
                                                   device=a.device)
    sq = torch.empty(b, dtype=torch.float32 if half else a.dtype, device=a.device)
    if chunk == 1:  # one example at a time: few Python-level ops per example
        buf = torch.empty(d_out, d_in, dtype=a.dtype, device=a.device)
        flat_buf, flat_total, outs = buf.view(-1), total.view(-1), sq.unbind(0)
        for i, (dt_i, a_i) in enumerate(zip(dt.unbind(0), a.unbind(0))):
            into_total = i == 0 and not half
            g, flat = (total, flat_total) if into_total else (buf, flat_buf)
            torch.mm(dt_i, a_i, out=g)
            if half:
                torch.linalg.vector_norm(flat, dtype=torch.float32, out=outs[i])
            else:
                torch.dot(flat, flat, out=outs[i])
            if not into_total:
                total.add_(buf)
        if half:
            sq.pow_(2)
        return total, sq.float()
    buf = torch.empty(chunk, d_out, d_in, dtype=a.dtype, device=a.device)
    for i in range(0, b, chunk):
        n = min(chunk, b - i)
        p = torch.bmm(dt[i:i + n], a[i:i + n], out=buf[:n])
        torch.linalg.vector_norm(p.flatten(1), dim=1, dtype=acc, out=sq[i:i + n])
        if i == 0 and not half:
            torch.sum(p, 0, out=total)
        else:
            total.add_(p.sum(0))
    return total, sq.pow_(2).float()

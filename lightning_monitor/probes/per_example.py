"""Exact per-example squared gradient norms, computed inside the ordinary backward pass.

While a :class:`PerExampleGradNorms` context is active, a forward hook on every covered module keeps a
reference to the module's input (autograd saves it anyway) and hooks the module's output gradient. When
the backward pass reaches that output, the module's handler turns (input, output gradient) into the
squared norm of each example's gradient for each of the module's parameters, in fp32 (Goodfellow,
"Efficient per-example gradient computations", arXiv 1510.01799):

* ``nn.Linear`` on ``(B, d_in)``: ``||g_i||^2 = ||a_i||^2 ||d_i||^2``. On sequences ``(B, T, d_in)`` the
  per-example weight gradient is ``G_i = D_i^T A_i`` and ``||G_i||_F^2 = <A_i A_i^T, D_i D_i^T>_F``:
  the Gram form costs ``O(B T^2 (d_in + d_out))``, materialising ``G_i`` costs ``O(B T d_in d_out)``;
  each layer takes the cheaper. Bias: ``||sum_t d_it||^2``. By default (``linear_strategy="auto"``)
  a Linear on sequences is *fused* instead unless its sequences are short enough for the Gram form to
  be cheaper (:data:`GRAM_OVER_FUSED`): while the context is active its backward forms the weight
  gradient as ``sum_i G_i`` from the materialised ``G_i`` (the same multiply-adds as the plain
  backward; on CPU a cache-sized chunk of examples at a time, reduced to norms and sum while in cache),
  so the norms come almost for free.
* ``nn.Embedding``: the rows an example touches, ``sum_{t: x_t = v} d_t``, summed per distinct token.
* ``nn.LayerNorm`` / ``nn.RMSNorm``: weight ``sum_t d_t * xhat_t``, bias ``sum_t d_t``.
* ``nn.Conv2d``: the Linear form on unfolded patches (one group at a time).

Handlers live in :data:`HANDLERS`, a table from module type to handler: covering a new type is one entry.
Parameters that no handler covers (``nn.MultiheadAttention``, ``nn.BatchNorm*``, custom modules, an
Embedding with ``scale_grad_by_freq``) are listed in :attr:`PerExampleGradNorms.uncovered`, never
silently mixed in. A parameter used more than once in one forward (a module called twice, tied weights)
gets its per-example gradients materialised and summed over its uses before the norm, so the cross
terms are exact.

With ``loss_reduction="mean"`` (a loss averaged over the batch, e.g. cross-entropy over ``B x T``
tokens) the hooks see ``g_i / B``; the norms are rescaled to the true per-example gradients, where the
per-example loss is that example's mean over its tokens.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["PerExampleGradNorms", "HANDLERS", "Handler", "linear_sq_norms", "per_example_linear", "project_matrix"]

LinearStrategy = Literal["auto", "fused", "gram", "materialize"]


# ----------------------------------------------------------------------------- core math


def _choose(t: int, d_in: int, d_out: int, strategy: str) -> str:
    if strategy != "auto":
        return strategy
    # Gram: B T^2 (d_in + d_out) multiply-adds; materialised: B T d_in d_out (and B d_in d_out memory).
    return "gram" if t * (d_in + d_out) < d_in * d_out else "materialize"


def linear_sq_norms(a: Tensor, d: Tensor, strategy: str = "auto") -> Tensor:
    """``||D_i^T A_i||_F^2`` for each ``i``: ``a`` is ``(B, T, d_in)``, ``d`` is ``(B, T, d_out)``; fp32.

    >>> a, d = torch.randn(4, 3, 5), torch.randn(4, 3, 2)
    >>> torch.allclose(linear_sq_norms(a, d), torch.einsum("bto,bti->boi", d, a).pow(2).sum((1, 2)))
    True
    """
    a, d = a.float(), d.float()
    b, t, d_in = a.shape
    d_out = d.shape[-1]
    if t == 1:
        return a.pow(2).sum((1, 2)) * d.pow(2).sum((1, 2))
    if _choose(t, d_in, d_out, strategy) == "gram":
        ga = torch.bmm(a, a.transpose(1, 2))
        gd = torch.bmm(d, d.transpose(1, 2))
        return (ga * gd).sum((1, 2))
    return torch.bmm(d.transpose(1, 2), a).pow(2).sum((1, 2))


# ----------------------------------------------------------------------------- handlers


@dataclass
class Handler:
    """How to compute per-example gradient norms of one module type.

    Attributes:
        capture: ``(module, input) -> ctx`` at forward time (keep references, compute nothing heavy).
        sq_norms: ``(module, ctx, grad_output, strategy) -> {local param name: Tensor[B]}`` (fp32).
        grads: ``(module, ctx, grad_output) -> {local param name: Tensor[B, *param.shape]}``, the
            materialised per-example gradients, used for parameters with several uses in one forward.
        project: ``(module, ctx, grad_output, {local name: (u, v)}) -> {local name: Tensor[k]}``:
            ``u_j^T C v_j`` for the module's contribution ``C`` to each parameter's batch gradient (as a
            ``(shape[0], -1)`` matrix), without forming ``C``. Compared with the same projection of the
            parameter's full gradient, it reveals uses of the parameter that the hooks did not see.
        unsupported: ``module -> reason`` when this instance cannot be covered, else ``None``.
    """

    capture: Callable[[nn.Module, Tensor], Any]
    sq_norms: Callable[[nn.Module, Any, Tensor, str], dict[str, Tensor]]
    grads: Callable[[nn.Module, Any, Tensor], dict[str, Tensor]]
    project: Callable[[nn.Module, Any, Tensor, dict[str, tuple[Tensor, Tensor]]], dict[str, Tensor]]
    unsupported: Callable[[nn.Module], Optional[str]] = lambda m: None


def project_matrix(c: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """``u_j^T C v_j`` for each row ``j`` of ``u`` (``k x rows``) and ``v`` (``k x cols``), with ``C`` the
    tensor ``c`` viewed as ``(shape[0], -1)`` (a 1-D ``c`` as a column)."""
    c2 = c.float().reshape(c.shape[0], -1)
    return ((u @ c2) * v).sum(1)


def _as_seq(x: Tensor, d: int) -> Tensor:
    """``(B, ..., d)`` -> ``(B, T, d)``."""
    return x.reshape(x.shape[0], -1, d)


# Linear --------------------------------------------------------------------------------------


def _linear_unsupported(m: nn.Module) -> Optional[str]:
    return None


def _linear_capture(m: nn.Module, x: Tensor) -> Any:
    return x if x.dim() >= 2 else None


def _linear_sq(m: nn.Module, x: Tensor, g: Tensor, strategy: str) -> dict[str, Tensor]:
    a = _as_seq(x, m.in_features)
    d = _as_seq(g, m.out_features)
    out = {"weight": linear_sq_norms(a, d, strategy)}
    if m.bias is not None:
        out["bias"] = d.float().sum(1).pow(2).sum(1)
    return out


def _linear_grads(m: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
    a = _as_seq(x, m.in_features).float()
    d = _as_seq(g, m.out_features).float()
    out = {"weight": torch.bmm(d.transpose(1, 2), a)}
    if m.bias is not None:
        out["bias"] = d.sum(1)
    return out


def _linear_project(m: nn.Module, x: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    a = x.reshape(-1, m.in_features).float()
    d = g.reshape(-1, m.out_features).float()
    out = {}
    if "weight" in uv:
        u, v = uv["weight"]
        out["weight"] = ((d @ u.T) * (a @ v.T)).sum(0)
    if "bias" in uv:
        u, v = uv["bias"]
        out["bias"] = project_matrix(d.sum(0), u, v)
    return out


# Embedding -----------------------------------------------------------------------------------


def _embedding_unsupported(m: nn.Module) -> Optional[str]:
    if m.scale_grad_by_freq:
        return "scale_grad_by_freq couples the examples of a batch"
    return None


def _embedding_capture(m: nn.Module, idx: Tensor) -> Any:
    return idx if idx.dim() >= 1 else None


def _embedding_rows(m: nn.Module, idx: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per (example, distinct token) summed output gradients: (rows [U, d], example of each row, token)."""
    b = idx.shape[0]
    dim = m.embedding_dim
    ids = idx.reshape(b, -1)
    d = g.reshape(b, -1, dim).float()
    keys = ids + m.num_embeddings * torch.arange(b, device=ids.device).unsqueeze(1)
    if m.padding_idx is not None:
        keep = ids.reshape(-1) != m.padding_idx
        flat_keys, flat_d = keys.reshape(-1)[keep], d.reshape(-1, dim)[keep]
    else:
        flat_keys, flat_d = keys.reshape(-1), d.reshape(-1, dim)
    uniq, inverse = torch.unique(flat_keys, return_inverse=True)
    rows = torch.zeros(uniq.numel(), dim, device=d.device, dtype=torch.float32).index_add_(0, inverse, flat_d)
    return rows, torch.div(uniq, m.num_embeddings, rounding_mode="floor"), uniq % m.num_embeddings


def _embedding_sq(m: nn.Module, idx: Tensor, g: Tensor, strategy: str) -> dict[str, Tensor]:
    rows, example, _ = _embedding_rows(m, idx, g)
    sq = torch.zeros(idx.shape[0], device=rows.device, dtype=torch.float32)
    return {"weight": sq.index_add_(0, example, rows.pow(2).sum(1))}


def _embedding_grads(m: nn.Module, idx: Tensor, g: Tensor) -> dict[str, Tensor]:
    rows, example, token = _embedding_rows(m, idx, g)
    out = torch.zeros(idx.shape[0], m.num_embeddings, m.embedding_dim, device=rows.device, dtype=torch.float32)
    out[example, token] = rows
    return {"weight": out}


def _embedding_project(m: nn.Module, idx: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    u, v = uv["weight"]
    ids = idx.reshape(-1)
    d = g.reshape(-1, m.embedding_dim).float()
    if m.padding_idx is not None:
        keep = ids != m.padding_idx
        ids, d = ids[keep], d[keep]
    return {"weight": (u[:, ids] * (d @ v.T).T).sum(1)}


# LayerNorm / RMSNorm -------------------------------------------------------------------------


def _norm_unsupported(m: nn.Module) -> Optional[str]:
    return None


def _norm_capture(m: nn.Module, x: Tensor) -> Any:
    return x


def _normalized(m: nn.Module, x: Tensor) -> Tensor:
    shape = tuple(m.normalized_shape)
    xf = x.float()
    if isinstance(m, nn.LayerNorm):
        return F.layer_norm(xf, shape, None, None, m.eps)
    eps = m.eps if m.eps is not None else torch.finfo(x.dtype).eps
    return F.rms_norm(xf, shape, None, eps)


def _norm_per_example(m: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
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


def _norm_sq(m: nn.Module, x: Tensor, g: Tensor, strategy: str) -> dict[str, Tensor]:
    return {k: v.pow(2).flatten(1).sum(1) for k, v in _norm_per_example(m, x, g).items()}


def _norm_project(m: nn.Module, x: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    per = _norm_per_example(m, x, g)
    return {k: project_matrix(per[k].sum(0), *uv[k]) for k in uv}


# Conv2d --------------------------------------------------------------------------------------


def _conv_unsupported(m: nn.Module) -> Optional[str]:
    if isinstance(m.padding, str) and m.padding == "same" and any(s != 1 for s in m.stride):
        return "padding='same' with stride > 1"
    return None


def _conv_capture(m: nn.Module, x: Tensor) -> Any:
    return x if x.dim() == 4 else None


def _conv_patches(m: nn.Conv2d, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Per group: patches ``(B * groups, L, C_in/groups * kh * kw)`` and grads ``(B * groups, L, C_out/groups)``."""
    kh, kw = m.kernel_size
    if isinstance(m.padding, str):
        if m.padding == "valid":
            pad = [0, 0, 0, 0]
        else:  # "same", stride 1
            pad = []
            for k, dil in ((kw, m.dilation[1]), (kh, m.dilation[0])):
                total = dil * (k - 1)
                pad += [total // 2, total - total // 2]
        x = F.pad(x, pad, mode="constant" if m.padding_mode == "zeros" else m.padding_mode)
        padding: Any = 0
    elif m.padding_mode != "zeros":
        x = F.pad(x, m._reversed_padding_repeated_twice, mode=m.padding_mode)
        padding = 0
    else:
        padding = m.padding
    u = F.unfold(x.float(), (kh, kw), dilation=m.dilation, padding=padding, stride=m.stride)  # B, C k k, L
    b, _, length = u.shape
    grp = m.groups
    a = u.reshape(b, grp, -1, length).permute(0, 1, 3, 2).reshape(b * grp, length, -1)
    d = g.float().reshape(b, grp, m.out_channels // grp, -1).permute(0, 1, 3, 2).reshape(b * grp, length, -1)
    return a, d


def _conv_sq(m: nn.Module, x: Tensor, g: Tensor, strategy: str) -> dict[str, Tensor]:
    b = x.shape[0]
    a, d = _conv_patches(m, x, g)
    out = {"weight": linear_sq_norms(a, d, strategy).reshape(b, m.groups).sum(1)}
    if m.bias is not None:
        out["bias"] = g.float().flatten(2).sum(2).pow(2).sum(1)
    return out


def _conv_grads(m: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
    b = x.shape[0]
    a, d = _conv_patches(m, x, g)
    w = torch.bmm(d.transpose(1, 2), a).reshape(b, *m.weight.shape)
    out = {"weight": w}
    if m.bias is not None:
        out["bias"] = g.float().flatten(2).sum(2)
    return out


def _conv_project(m: nn.Module, x: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    out = {}
    if "weight" in uv:
        u, v = uv["weight"]
        b, grp, k = x.shape[0], m.groups, u.shape[0]
        a, d = _conv_patches(m, x, g)
        a = a.reshape(b, grp, a.shape[1], -1)
        d = d.reshape(b, grp, d.shape[1], -1)
        du = torch.einsum("bglo,kgo->bglk", d, u.reshape(k, grp, -1))
        av = torch.einsum("bglc,kc->bglk", a, v)
        out["weight"] = (du * av).sum((0, 1, 2))
    if "bias" in uv:
        out["bias"] = project_matrix(g.float().sum((0, 2, 3)), *uv["bias"])
    return out


#: Module type -> handler. Subclasses use their nearest registered base class.
HANDLERS: dict[type[nn.Module], Handler] = {
    nn.Linear: Handler(_linear_capture, _linear_sq, _linear_grads, _linear_project, _linear_unsupported),
    nn.Embedding: Handler(_embedding_capture, _embedding_sq, _embedding_grads, _embedding_project, _embedding_unsupported),
    nn.LayerNorm: Handler(_norm_capture, _norm_sq, _norm_per_example, _norm_project, _norm_unsupported),
    nn.Conv2d: Handler(_conv_capture, _conv_sq, _conv_grads, _conv_project, _conv_unsupported),
}
if hasattr(nn, "RMSNorm"):
    HANDLERS[nn.RMSNorm] = Handler(_norm_capture, _norm_sq, _norm_per_example, _norm_project, _norm_unsupported)

#: Container types whose submodules' parameters are used without calling those submodules.
_OPAQUE: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def _handler_for(module: nn.Module) -> Optional[Handler]:
    for cls in type(module).__mro__:
        handler = HANDLERS.get(cls)  # type: ignore[arg-type]
        if handler is not None:
            return handler
    return None


def _unwrap(module: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel (or DataParallel) wrapper."""
    wrappers: tuple[type, ...] = (nn.DataParallel,)
    try:
        from torch.nn.parallel import DistributedDataParallel

        wrappers += (DistributedDataParallel,)
    except ImportError:  # pragma: no cover
        pass
    while isinstance(module, wrappers):
        module = module.module
    return module


#: On CPU the per-example weight gradients of a fused Linear are formed a chunk of examples at a time,
#: into a buffer of about this size (the L2 cache of one core), and reduced to their norms and their sum
#: while still in cache: the sum and norm passes then cost almost nothing and the transient memory is
#: one chunk. Elsewhere (GPU) the whole batch is one batched matmul.
CPU_CHUNK_BYTES = 1 << 20


#: ``"auto"`` prefers the Gram form to the fused Linear when ``T^2 (d_in + d_out) < GRAM_OVER_FUSED d_in d_out``.
#: The fused path adds a few memory passes over each example's ``d_in x d_out`` gradient (and its matmuls
#: run at inner size ``T``), the Gram form ``T^2 (d_in + d_out)`` multiply-adds per example; measured on
#: CPU (one thread, B=8, d from 256 to 1024, T from 2 to 128) the two cost the same near a ratio of 8:
#: e.g. T=48, 1024x1024 (ratio 4.5): Gram 1.05x, fused 1.10x a plain step; T=128, 256x1024 (ratio 80):
#: Gram 1.25x, fused 1.06x.
GRAM_OVER_FUSED = 8


def _gram_beats_fused(t: int, mod: nn.Linear) -> bool:
    return t * t * (mod.in_features + mod.out_features) < GRAM_OVER_FUSED * mod.in_features * mod.out_features


def _chunk(device_type: str, b: int, per_example_bytes: int) -> int:
    """Examples per chunk of the fused Linear's per-example gradients (all of them off CPU)."""
    if device_type != "cpu":
        return b
    return max(1, min(b, CPU_CHUNK_BYTES // max(per_example_bytes, 1)))


def per_example_linear(a: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """``(sum_i G_i, ||G_i||_F^2)`` for ``G_i = D_i^T A_i``, ``a`` ``(B, T, d_in)``, ``d`` ``(B, T, d_out)``.

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
    chunk = _chunk(a.device.type, b, d_in * d_out * a.element_size())
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


class _FusedLinear(torch.autograd.Function):
    """``F.linear`` whose backward forms the weight gradient as the sum of the per-example gradients
    ``G_i = D_i^T A_i`` (the same multiply-adds as autograd's single matmul), taking each example's
    squared norm on the way (:func:`per_example_linear`), and hands the norms to ``sink``: per-example
    norms at almost no extra cost."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], sink: Callable[..., None]) -> Tensor:
        device = x.device.type
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        if torch.is_autocast_enabled(device):
            dt = torch.get_autocast_dtype(device)
            x, weight = x.to(dt), weight.to(dt)
            bias = None if bias is None else bias.to(dt)
            with torch.autocast(device, enabled=False):
                out = F.linear(x, weight, bias)
        else:
            out = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.sink = sink
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        x, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        b = x.shape[0]
        a = x.reshape(b, -1, x.shape[-1])
        d = grad.reshape(b, -1, grad.shape[-1])
        sum_w, sq_w = per_example_linear(a, d)
        per_b = d.sum(1) if ctx.has_bias else None
        sum_b = per_b.sum(0) if per_b is not None else None
        sq_b = per_b.float().pow(2).sum(1) if per_b is not None else None

        def grads() -> dict[str, Tensor]:  # only for a parameter used several times in one forward
            out = {"weight": torch.bmm(d.transpose(1, 2), a).float()}
            if per_b is not None:
                out["bias"] = per_b.float()
            return out

        ctx.sink(sq_w, sq_b, sum_w, sum_b, grads)
        grad_w = sum_w.to(ctx.dtypes[0]) if ctx.needs_input_grad[1] else None
        grad_b = sum_b.to(ctx.dtypes[1]) if sum_b is not None and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


# ----------------------------------------------------------------------------- probe


class PerExampleGradNorms:
    """Context manager computing exact per-example squared gradient norms during backward.

    Args:
        module: the model (a DistributedDataParallel wrapper is looked through).
        loss_reduction: ``"mean"`` if the loss is averaged over the batch (the norms are rescaled by
            ``B^2``), ``"sum"`` if it is summed over examples.
        linear_strategy: how an ``nn.Linear`` on sequences ``(B, T, d)`` gets its norms.
            ``"fused"``: its weight gradient is computed as the sum of the materialised per-example
            gradients (the same multiply-adds as the plain backward; on CPU a chunk of examples at a time,
            reduced while in cache), so the norms cost almost nothing extra; ``"gram"``:
            ``<A_i A_i^T, D_i D_i^T>`` beside the plain backward;
            ``"materialize"``: ``D_i^T A_i`` beside the plain backward. ``"auto"``: gram when it is
            the cheaper, ``T^2 (d_in + d_out) < 8 d_in d_out`` (:data:`GRAM_OVER_FUSED`, short sequences);
            else fused while the per-example gradients held at once fit ``max_fused_bytes``
            (``4 c d_in d_out`` bytes for a chunk of ``c`` examples: on CPU the examples that fit
            :data:`CPU_CHUNK_BYTES`, at least one; elsewhere the whole batch); else the cheaper of gram
            and materialize. Inputs ``(B, d)`` always use ``||a_i||^2 ||d_i||^2``.
        include: optional predicate ``(qualified name, module) -> bool`` restricting the modules hooked.
        batch_size: the number of examples expected over the backward passes read together; a module
            whose input's leading dimension does not match (an input broadcast over the batch) is moved to
            :attr:`uncovered`. ``None``: the most common count among the parameters.
        max_fused_bytes: memory cap of the per-example gradients one fused Linear holds at once
            (``"auto"``).
        verify: check, for every covered parameter, that the hooked modules account for its whole
            gradient (two random projections of both, compared when the norms are read; one small host
            sync). A parameter also used outside its module (``x @ emb.weight.T``) is then moved to
            :attr:`uncovered` instead of being silently wrong.

    Example::

        with PerExampleGradNorms(model) as probe:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        probe.squared_norms()  # Tensor[B]: ||grad of example i's loss||^2 over probe.covered
    """

    def __init__(
        self,
        module: nn.Module,
        loss_reduction: Literal["mean", "sum"] = "mean",
        linear_strategy: LinearStrategy = "auto",
        include: Optional[Callable[[str, nn.Module], bool]] = None,
        batch_size: Optional[int] = None,
        max_fused_bytes: int = 256 * 2**20,
        verify: bool = True,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"`module` must be a torch.nn.Module, got {type(module).__name__}.")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(
                f"`loss_reduction` must be 'mean' (loss averaged over the batch) or 'sum', got {loss_reduction!r}."
            )
        if linear_strategy not in ("auto", "fused", "gram", "materialize"):
            raise ValueError(
                f"`linear_strategy` must be 'auto', 'fused', 'gram' or 'materialize', got {linear_strategy!r}."
            )
        if isinstance(max_fused_bytes, bool) or not isinstance(max_fused_bytes, int) or max_fused_bytes < 0:
            raise ValueError(f"`max_fused_bytes` must be an integer >= 0, got {max_fused_bytes!r}.")
        self.module = _unwrap(module)
        self.loss_reduction = loss_reduction
        self.linear_strategy = linear_strategy
        self.batch_size = batch_size
        self.max_fused_bytes = max_fused_bytes
        self.verify = bool(verify)
        self._proj: dict[int, tuple[Tensor, Tensor]] = {}
        self._handles: list[RemovableHandle] = []
        self._fused: list[nn.Module] = []
        self._active = False

        trainable = {id(p): name for name, p in self.module.named_parameters() if p.requires_grad}
        self._params: dict[int, nn.Parameter] = {id(p): p for p in self.module.parameters() if p.requires_grad}
        opaque_prefixes = [n + "." for n, m in self.module.named_modules() if n and isinstance(m, _OPAQUE)]
        # module name -> (module, handler, [(local name, param id)])
        self._modules: dict[str, tuple[nn.Module, Handler, list[tuple[str, int]]]] = {}
        covered: set[int] = set()
        self.reasons: dict[str, str] = {}
        for mname, mod in self.module.named_modules(remove_duplicate=False):
            handler = _handler_for(mod)
            own = [(ln, p) for ln, p in mod.named_parameters(recurse=False) if p.requires_grad]
            if handler is None or not own:
                continue
            if include is not None and not include(mname, mod):
                continue
            if any(mname.startswith(pre) for pre in opaque_prefixes):
                continue
            reason = handler.unsupported(mod)
            if reason is not None:
                for ln, p in own:
                    self.reasons.setdefault(trainable[id(p)], f"{type(mod).__name__}: {reason}")
                continue
            if mname in self._modules:
                continue
            self._modules[mname] = (mod, handler, [(ln, id(p)) for ln, p in own])
            covered.update(id(p) for _, p in own)
        uncovered_ids = [pid for pid in trainable if pid not in covered]
        for pid in uncovered_ids:
            self.reasons.setdefault(trainable[pid], "no handler for its module type (or used outside its module)")
        # a parameter tied into an unsupported module is uncovered as a whole
        self._covered_ids = [pid for pid in trainable if pid in covered and trainable[pid] not in self.reasons]
        self._names = trainable
        self._not_reached: list[str] = []
        self._static_uncovered = [trainable[pid] for pid in trainable if pid not in self._covered_ids]
        self._reset_state()

    # -------------------------------------------------------------- bookkeeping
    def _reset_state(self) -> None:
        self._records: dict[int, list[Tensor]] = defaultdict(list)
        self._outstanding: dict[int, int] = defaultdict(int)
        self._pending: dict[int, Tensor] = {}
        self._fp_mod: dict[int, Tensor] = {}
        self._fp_total: dict[int, Tensor] = {}
        self._verified = True

    def reset(self) -> None:
        """Forget the norms of previous backward passes. Parameters found uncoverable at run time (used
        outside their module, input without a batch dimension) stay in :attr:`uncovered`."""
        self._reset_state()

    @property
    def covered(self) -> list[str]:
        """Names of the trainable parameters whose per-example norms are computed."""
        not_reached = set(self._not_reached)
        return [self._names[pid] for pid in self._covered_ids if self._names[pid] not in not_reached]

    @property
    def uncovered(self) -> list[str]:
        """Names of the trainable parameters left out (see :attr:`reasons` for why)."""
        return self._static_uncovered + [n for n in self._not_reached if n not in self._static_uncovered]

    def modules(self) -> dict[str, nn.Module]:
        """The hooked modules by qualified name."""
        return {name: entry[0] for name, entry in self._modules.items()}

    # -------------------------------------------------------------- hooks
    def __enter__(self) -> PerExampleGradNorms:
        self.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def attach(self) -> None:
        """Arm the hooks (idempotent)."""
        if self._active:
            return
        covered = set(self._covered_ids)
        for mod, handler, params in self._modules.values():
            todo = [(ln, pid) for ln, pid in params if pid in covered]
            if not todo:
                continue
            if self._can_fuse(mod):
                mod.forward = self._make_fused_forward(mod, handler, todo)  # type: ignore[method-assign]
                self._fused.append(mod)
            else:
                self._handles.append(mod.register_forward_hook(self._make_forward_hook(handler, todo)))
        if self.verify:
            for pid in self._covered_ids:
                self._handles.append(self._params[pid].register_hook(self._make_leaf_hook(pid)))
        self._active = True

    def detach(self) -> None:
        """Remove every hook (idempotent); the norms recorded so far stay readable."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for mod in self._fused:
            mod.__dict__.pop("forward", None)
        self._fused.clear()
        self._active = False

    @property
    def active(self) -> bool:
        return self._active

    def _can_fuse(self, mod: nn.Module) -> bool:
        return (
            self.linear_strategy in ("auto", "fused")
            and isinstance(mod, nn.Linear)
            and type(mod).forward is nn.Linear.forward
            and "forward" not in mod.__dict__
            and not mod._forward_pre_hooks
        )

    def _make_forward_hook(self, handler: Handler, params: list[tuple[str, int]]) -> Callable[..., None]:
        def forward_hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not torch.is_grad_enabled() or not isinstance(output, Tensor) or not output.requires_grad:
                return
            if not args or not isinstance(args[0], Tensor):
                return
            ctx = handler.capture(mod, args[0])
            if ctx is None:
                return
            for _, pid in params:
                self._outstanding[pid] += 1
            batch = args[0].shape[0]
            strategy = "auto" if self.linear_strategy == "fused" else self.linear_strategy
            weight = getattr(mod, "weight", None)
            if strategy == "auto" and isinstance(weight, Tensor) and 4 * batch * weight.numel() > self.max_fused_bytes:
                strategy = "gram"  # materialising B copies of the weight would exceed the memory cap

            def grad_hook(grad: Tensor) -> None:
                with torch.no_grad():
                    self._consume(
                        params, batch,
                        lambda: handler.sq_norms(mod, ctx, grad, strategy),
                        lambda: handler.grads(mod, ctx, grad),
                        lambda uv: handler.project(mod, ctx, grad, uv),
                    )

            output.register_hook(grad_hook)

        return forward_hook

    def _make_fused_forward(self, mod: nn.Linear, handler: Handler, params: list[tuple[str, int]]) -> Callable[[Tensor], Tensor]:
        hook = self._make_forward_hook(handler, params)

        def fused_forward(x: Tensor) -> Tensor:
            w, b = mod.weight, mod.bias
            needs = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad))
            if needs and x.dim() >= 2:
                t = x.numel() // max(x.shape[0] * x.shape[-1], 1)
                per = 4 * mod.in_features * mod.out_features  # one example's weight gradient, fp32
                nbytes = per * _chunk(x.device.type, x.shape[0], per)  # held at once in the backward
                fits = nbytes <= self.max_fused_bytes
                if t > 1 and (self.linear_strategy == "fused" or (fits and not _gram_beats_fused(t, mod))):
                    for _, pid in params:
                        self._outstanding[pid] += 1
                    batch = x.shape[0]

                    def sink(sq_w: Tensor, sq_b: Optional[Tensor], s_w: Tensor, s_b: Optional[Tensor],
                             grads: Callable[[], dict[str, Tensor]]) -> None:
                        sqs = {"weight": sq_w} if sq_b is None else {"weight": sq_w, "bias": sq_b}
                        sums = {"weight": s_w} if s_b is None else {"weight": s_w, "bias": s_b}
                        self._consume(
                            params, batch,
                            lambda: sqs,
                            grads,
                            lambda uv: {k: project_matrix(sums[k], *uv[k]) for k in uv},
                        )

                    return _FusedLinear.apply(x, w, b, sink)
            out = F.linear(x, w, b)
            hook(mod, (x,), out)
            return out

        return fused_forward

    def _consume(
        self,
        params: list[tuple[str, int]],
        batch: int,
        sq_fn: Callable[[], dict[str, Tensor]],
        grads_fn: Callable[[], dict[str, Tensor]],
        proj_fn: Callable[[dict[str, tuple[Tensor, Tensor]]], dict[str, Tensor]],
    ) -> None:
        """Record one use's per-example norms; a parameter with several uses in this forward gets its
        per-example gradients summed over the uses first (exact cross terms)."""
        if self.verify:
            self._verified = False
            fps = proj_fn({ln: self._uv(pid) for ln, pid in params})
            for ln, pid in params:
                prev = self._fp_mod.get(pid)
                self._fp_mod[pid] = fps[ln] if prev is None else prev + fps[ln]
        scale = float(batch) ** 2 if self.loss_reduction == "mean" else 1.0
        shared = [pid for _, pid in params if self._outstanding[pid] > 1 or pid in self._pending]
        sqs = sq_fn() if len(shared) < len(params) else {}
        grads = grads_fn() if shared else {}
        factor = float(batch) if self.loss_reduction == "mean" else 1.0
        for ln, pid in params:
            self._outstanding[pid] -= 1
            if pid not in shared:
                self._records[pid].append(sqs[ln] * scale if scale != 1.0 else sqs[ln])
                continue
            g = grads[ln] * factor
            prev = self._pending.get(pid)
            if prev is not None and prev.shape != g.shape:
                warnings.warn(
                    f"PerExampleGradNorms: parameter {self._names[pid]!r} is used with different batch "
                    "sizes in one forward; it is left out.",
                    stacklevel=2,
                )
                self._pending.pop(pid, None)
                self._not_reached.append(self._names[pid])
                self.reasons[self._names[pid]] = "used with different batch sizes in one forward"
                continue
            self._pending[pid] = g if prev is None else prev + g
            if self._outstanding[pid] == 0:
                self._records[pid].append(self._pending.pop(pid).flatten(1).pow(2).sum(1))

    def _uv(self, pid: int) -> tuple[Tensor, Tensor]:
        """Two fixed random projections for parameter ``pid`` (rows and columns of its matrix view)."""
        uv = self._proj.get(pid)
        if uv is None:
            p = self._params[pid]
            rows = p.shape[0] if p.dim() else 1
            cols = p.numel() // max(rows, 1)
            gen = torch.Generator().manual_seed(len(self._proj) + 1)
            u = torch.randn(2, rows, generator=gen).to(p.device)
            v = torch.randn(2, cols, generator=gen).to(p.device) if p.dim() > 1 else torch.ones(2, 1, device=p.device)
            uv = self._proj[pid] = (u, v)
        return uv

    def _make_leaf_hook(self, pid: int) -> Callable[[Tensor], None]:
        def leaf_hook(grad: Tensor) -> None:
            with torch.no_grad():
                fp = project_matrix(grad.detach(), *self._uv(pid))
                prev = self._fp_total.get(pid)
                self._fp_total[pid] = fp if prev is None else prev + fp

        return leaf_hook

    def _check_projections(self) -> None:
        """Move to :attr:`uncovered` every parameter whose gradient the hooked modules do not account for."""
        self._verified = True
        pids = [pid for pid in self._covered_ids if pid in self._fp_mod and pid in self._fp_total]
        if not pids:
            return
        mod = torch.stack([self._fp_mod[pid] for pid in pids])
        tot = torch.stack([self._fp_total[pid].to(mod.device) for pid in pids])
        diff = (mod - tot).norm(dim=1)
        ref = mod.norm(dim=1) + tot.norm(dim=1)
        # relative mismatch, floored for gradients that are zero in exact arithmetic (rounding noise only)
        bad = diff > 1e-2 * ref + 1e-5 * ref.max()
        for pid, flag in zip(pids, bad.tolist()):
            name = self._names[pid]
            if flag and name not in self._not_reached:
                self._not_reached.append(name)
                self.reasons[name] = (
                    "its gradient has contributions the hooks did not see (used outside its module, "
                    "e.g. x @ emb.weight.T)"
                )

    # -------------------------------------------------------------- results
    def per_parameter(self) -> dict[str, Tensor]:
        """Per covered parameter name, the squared norm of each example's gradient (``Tensor[N]``, fp32,
        ``N`` examples over every backward pass since the last :meth:`reset`)."""
        if self.verify and not self._verified and not self._pending:
            self._check_projections()
        out: dict[str, Tensor] = {}
        for pid in self._covered_ids:
            name = self._names[pid]
            if name in self._not_reached:
                continue
            recs = self._records.get(pid)
            if not recs:
                p = self._params[pid]
                if p.grad is not None and name not in self._not_reached:
                    # it has a gradient, but its module's forward never ran: used outside its module
                    self._not_reached.append(name)
                    self.reasons[name] = "has a gradient but its module's forward was not called"
                continue
            if self._outstanding.get(pid, 0) or pid in self._pending:
                raise RuntimeError(
                    f"PerExampleGradNorms: the backward of {name!r} has not finished; read the norms after "
                    "loss.backward()."
                )
            out[name] = recs[0] if len(recs) == 1 else torch.cat(recs)
        if out:
            sizes = [v.shape[0] for v in out.values()]
            expected = self.batch_size if self.batch_size is not None else max(set(sizes), key=lambda n: (sizes.count(n), n))
            for name in [n for n, v in out.items() if v.shape[0] != expected]:
                del out[name]
                if name not in self._not_reached:
                    self._not_reached.append(name)
                    self.reasons[name] = (
                        "its module's input has no batch dimension (e.g. positions broadcast over the batch), "
                        "so per-example gradients are not separable there"
                    )
        return out

    def squared_norms(self) -> Tensor:
        """``Tensor[N]``: each example's squared gradient norm summed over :attr:`covered`."""
        per = self.per_parameter()
        if not per:
            raise RuntimeError(
                "PerExampleGradNorms recorded nothing: run forward and backward inside the context, with "
                "gradients enabled, on a module with covered parameters "
                f"(uncovered: {self.uncovered[:8]})."
            )
        sizes = {v.shape[0] for v in per.values()}
        if len(sizes) != 1:
            raise RuntimeError(
                f"PerExampleGradNorms: parameters saw different numbers of examples ({sorted(sizes)}); "
                "was a module skipped in some forward pass?"
            )
        return torch.stack(list(per.values())).sum(0)

    def per_module(self) -> dict[str, Tensor]:
        """Per hooked module name, the squared per-example norms summed over its covered parameters."""
        per = self.per_parameter()
        out: dict[str, Tensor] = {}
        for mname, (_, _, params) in self._modules.items():
            # a parameter tied into several modules is counted under the module that owns its name
            vals = [per[self._names[pid]] for _, pid in params
                    if self._names[pid] in per and self._owner(pid) == mname]
            if vals:
                out[mname] = torch.stack(vals).sum(0) if len(vals) > 1 else vals[0]
        return out

    def _owner(self, pid: int) -> str:
        name = self._names[pid]
        return name.rsplit(".", 1)[0] if "." in name else ""

    def __iter__(self) -> Iterator[str]:  # pragma: no cover - convenience
        return iter(self.covered)


def _ordered(values: dict[str, Tensor], params: list[tuple[str, int]]) -> list[Tensor]:
    return [values[ln] for ln, _ in params]

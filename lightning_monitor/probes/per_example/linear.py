"""``nn.Linear``: ``||g_i||^2 = ||a_i||^2 ||d_i||^2`` on ``(B, d_in)``; on ``(B, ..., d_in)`` the weight
gradient ``G_i = D_i^T A_i`` by the strategy of :class:`~.strategy.LinearRule` (fused, Gram or
materialised), bias ``||sum_t d_it||^2``.

The fused path replaces the layer's ``forward`` while the probe is armed by :class:`_FusedLinear`,
whose backward forms the weight gradient as ``sum_i G_i`` and takes each ``||G_i||^2`` on the way
(:func:`~.kernels.per_example_linear`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_monitor._compat import has_forward_pre_hooks
from lightning_monitor.probes.per_example.kernels import (
    as_seq,
    forward_under_autocast,
    linear_sq_norms,
    per_example_linear,
    project_matrix,
)
from lightning_monitor.probes.per_example.registry import Handler, register, register_by_name
from lightning_monitor.probes.per_example.strategy import LinearRule


@register(nn.Linear)
class LinearHandler(Handler):
    def param_names(self, m: nn.Module) -> tuple[str, ...]:
        return ("weight", "bias")

    def capture(self, m: nn.Module, x: Tensor) -> Any:
        return x if x.dim() >= 2 else None

    def sq_norms(self, m: nn.Module, x: Tensor, g: Tensor, rule: LinearRule) -> dict[str, Tensor]:
        a = as_seq(x, m.in_features)
        d = as_seq(g, m.out_features)
        b, t = a.shape[:2]
        strategy = rule.choose(t=t, d_in=m.in_features, d_out=m.out_features, batch=b, device_type=a.device.type)
        out = {"weight": linear_sq_norms(a, d, strategy)}
        if m.bias is not None:
            out["bias"] = d.float().sum(1).pow(2).sum(1)
        return out

    def grads(self, m: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
        a = as_seq(x, m.in_features).float()
        d = as_seq(g, m.out_features).float()
        out = {"weight": torch.bmm(d.transpose(1, 2), a)}
        if m.bias is not None:
            out["bias"] = d.sum(1)
        return out

    def project(self, m: nn.Module, x: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        a = x.reshape(-1, m.in_features).float()
        d = g.reshape(-1, m.out_features).float()
        out = {}
        if "weight" in uv:
            u, v = uv["weight"]
            # u^T (D^T A) v = sum_t (d_t . u)(a_t . v), with the two projections as the wide side of the products (a
            # [k, N] result: a third of the time of the [N, k] one on CPU)
            out["weight"] = ((u @ d.T) * (v @ a.T)).sum(1)
        if "bias" in uv:
            u, v = uv["bias"]
            out["bias"] = project_matrix(d.sum(0), u, v)
        return out

    def patch_forward(self, m: nn.Module, uses: Any, rule: LinearRule) -> Optional[Callable[[Tensor], Tensor]]:
        """The fused forward, on a plain ``nn.Linear`` (no custom ``forward``, no pre-hooks) when the
        requested strategy is ``"auto"`` or ``"fused"``; per call, :meth:`LinearRule.choose` decides."""
        fusable = (
            rule.strategy in ("auto", "fused")
            and type(m).forward is nn.Linear.forward
            and "forward" not in m.__dict__
            and not has_forward_pre_hooks(m)
        )
        if not fusable:
            return None

        def fused_forward(input: Tensor) -> Tensor:  # the parameter's name of `nn.Linear.forward`: `m(input=x)`
            x, w, b = input, m.weight, m.bias
            mode = uses.note(x)
            if mode in ("dry", "skip") or uses.left_out(every=True):  # a layer left out at an earlier check: plain
                return F.linear(x, w, b)
            use_rule, choice = rule, None
            needs = x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)
            if needs and x.dim() >= 2:
                batch = x.shape[0]
                t = x.numel() // max(batch * x.shape[-1], 1)
                if t > 1:
                    choice = rule.choose(t=t, d_in=m.in_features, d_out=m.out_features, batch=batch,
                                         device_type=x.device.type, fused=full_precision(x, w))
                    use_rule = LinearRule(choice)  # decided here: the plain hook must not decide again
            if mode == "replay":  # the same operations as the recorded forward, nothing recorded
                return _FusedLinear.apply(x, w, b, None, None) if choice == "fused" else F.linear(x, w, b)
            if choice == "fused":
                return _FusedLinear.apply(x, w, b, _sink(uses.expect(x)), uses.left_out)
            out = F.linear(x, w, b)
            uses.record(x, out, use_rule)
            return out

        return fused_forward


def full_precision(x: Tensor, w: Tensor) -> bool:
    """Whether a layer's product runs in fp32 or fp64 (no autocast to a lower type, inputs and weight of that type). The
    fused path forms the weight gradient as a sum of per-example products; in bf16 or fp16 each is rounded before the
    sum, where autograd's one product rounds once, and training's gradients came out a rounding unit apart (under
    `bf16-mixed` the noise scale changed the run's loss in its fifth digit). Below fp32 the norms are taken beside the
    plain backward, which stays autograd's own."""
    if torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type) not in (torch.float32,
                                                                                                   torch.float64):
        return False
    return w.dtype in (torch.float32, torch.float64) and x.dtype == w.dtype


def _sink(done: Callable[..., None]) -> Callable[..., None]:
    """Adapts :class:`_FusedLinear`'s results to the probe's ``done(grad_output, results)``."""

    def sink(grad: Tensor, sq_w: Tensor, sq_b: Optional[Tensor], s_w: Tensor, s_b: Optional[Tensor],
             grads: Callable[[], dict[str, Tensor]]) -> None:
        sqs = {"weight": sq_w} if sq_b is None else {"weight": sq_w, "bias": sq_b}
        sums = {"weight": s_w} if s_b is None else {"weight": s_w, "bias": s_b}
        done(grad, (lambda: sqs, grads, lambda uv: {k: project_matrix(sums[k], *uv[k]) for k in uv}))

    return sink


def _linear_not_a_view(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.linear(x, weight, bias)`` returned as a tensor of its own, not a view: with a bias and more than two
    dimensions ``F.linear`` multiplies the flattened input and returns a view of the product, and autograd forbids
    in-place writes into a view that a custom Function returns (a model that masks the layer's output in place,
    ``h[mask] = emb`` as wav2vec2's and HuBERT's SpecAugment do, would fail). The same ``addmm`` / ``mm``, written
    into the result's own storage."""
    if x.dim() <= 2:
        return F.linear(x, weight, bias)
    out = x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.result_type(x, weight))
    flat_in, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, weight.shape[0])
    if bias is None:
        torch.mm(flat_in, weight.t(), out=flat_out)
    else:
        torch.addmm(bias, flat_in, weight.t(), out=flat_out)
    return out


class _FusedLinear(torch.autograd.Function):
    """``F.linear`` whose backward forms the weight gradient as the sum of the per-example gradients
    ``G_i = D_i^T A_i`` (the same multiply-adds as autograd's single matmul), taking each example's
    squared norm on the way (:func:`~.kernels.per_example_linear`), and hands the norms to ``sink``:
    per-example norms at almost no extra cost."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], sink: Optional[Callable[..., None]],
                left_out: Optional[Callable[[], bool]]) -> Tensor:
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        out, x, weight = forward_under_autocast(_linear_not_a_view, x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.sink, ctx.left_out = sink, left_out
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        x, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        if ctx.sink is None:  # a recomputation by activation checkpointing (its backward does not run)
            grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
            grad_w = grad.reshape(-1, grad.shape[-1]).T.matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
            return grad_x, grad_w, grad_b, None, None
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

        ctx.sink(grad, sq_w, sq_b, sum_w, sum_b, grads)
        if ctx.left_out is not None and ctx.left_out():
            # left out (a BatchNorm couples the examples, no batch dimension found: see :meth:`_Uses.left_out`): the
            # gradients autograd gives ``F.linear`` on the same tensors (its kernels depend on their layout)
            return (*_plain_linear_grads(x, weight, ctx.has_bias, grad, ctx.needs_input_grad[:3]), None, None)
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = sum_w.to(ctx.dtypes[0]) if ctx.needs_input_grad[1] else None
        grad_b = sum_b.to(ctx.dtypes[1]) if sum_b is not None and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


def _plain_linear_grads(x: Tensor, weight: Tensor, has_bias: bool, grad: Tensor,
                        needs: tuple[bool, ...]) -> tuple[Optional[Tensor], ...]:
    """The gradients of ``F.linear(x, weight, bias)`` as autograd computes them (``F.linear`` again on detached
    copies: the bias's value does not enter its gradients, a zero one of its shape takes the same kernels)."""
    leaves = [x.detach(), weight.detach(), weight.new_zeros(weight.shape[0]) if has_bias else None]
    wanted = [t.requires_grad_() for t, n in zip(leaves, needs) if t is not None and n]
    if not wanted:
        return None, None, None
    with torch.enable_grad():
        got = dict(zip(map(id, wanted), torch.autograd.grad(F.linear(*leaves), wanted, grad)))
    return tuple(got.get(id(t)) if t is not None else None for t in leaves)


@register_by_name("transformers.pytorch_utils.Conv1D")
class HFConv1DHandler(Handler):
    """Hugging Face ``Conv1D`` (GPT-2's projections): ``y = x @ W + b`` with ``W`` of shape ``[in, out]``, a
    Linear with the weight transposed. Example ``i``'s weight gradient is ``A_i^T D_i`` (the transpose
    of a Linear's ``D_i^T A_i``, same norm; Gram or materialised by :class:`~.strategy.LinearRule`, not
    fused), bias ``||sum_t d_it||^2``."""

    def unsupported(self, m: nn.Module) -> Optional[str]:
        w = getattr(m, "weight", None)
        if not isinstance(w, nn.Parameter) or w.dim() != 2:
            return "not the Conv1D layout (a 2-D weight [in, out])"
        return None

    def param_names(self, m: nn.Module) -> tuple[str, ...]:
        return ("weight", "bias")

    def capture(self, m: nn.Module, x: Tensor) -> Any:
        return x if x.dim() >= 2 else None

    def sq_norms(self, m: nn.Module, x: Tensor, g: Tensor, rule: LinearRule) -> dict[str, Tensor]:
        d_in, d_out = m.weight.shape
        a, d = as_seq(x, d_in), as_seq(g, d_out)
        b, t = a.shape[:2]
        strategy = rule.choose(t=t, d_in=d_in, d_out=d_out, batch=b, device_type=a.device.type)
        out = {"weight": linear_sq_norms(a, d, strategy)}
        if getattr(m, "bias", None) is not None:
            out["bias"] = d.float().sum(1).pow(2).sum(1)
        return out

    def grads(self, m: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
        d_in, d_out = m.weight.shape
        a, d = as_seq(x, d_in).float(), as_seq(g, d_out).float()
        out = {"weight": torch.bmm(a.transpose(1, 2), d)}
        if getattr(m, "bias", None) is not None:
            out["bias"] = d.sum(1)
        return out

    def project(self, m: nn.Module, x: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        d_in, d_out = m.weight.shape
        a, d = x.reshape(-1, d_in).float(), g.reshape(-1, d_out).float()
        out = {}
        if "weight" in uv:  # rows of W are inputs: u^T (A^T D) v = sum_t (a_t . u)(d_t . v)
            u, v = uv["weight"]
            out["weight"] = ((u @ a.T) * (v @ d.T)).sum(1)
        if "bias" in uv:
            out["bias"] = project_matrix(d.sum(0), *uv["bias"])
        return out

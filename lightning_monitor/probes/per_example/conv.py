"""``nn.Conv2d`` and ``nn.Conv1d`` (stride, dilation, groups, ``padding="same"`` at stride 1, non-zero
padding modes): the per-example weight gradients by one weight-gradient convolution over the batch
folded into the groups (:func:`per_example_conv_grads`, no unfolding), or the Gram form of the Linear
form on unfolded patches, by the rule of :class:`~.strategy.LinearRule`; bias ``||sum_l d_l||^2``. A
plain zero-padded convolution takes the fused path: its backward returns the sum of the per-example
gradients as the weight gradient (:class:`_FusedConv`).

``nn.Conv3d`` and the transposed convolutions (``nn.ConvTranspose1d/2d/3d``) take the same
weight-gradient convolution over the folded batch (transposed for the latter), a chunk of examples at a
time when their gradients would exceed the probe's memory cap (:class:`ConvNdHandler`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_monitor._compat import has_forward_pre_hooks
from lightning_monitor.probes.per_example.kernels import forward_under_autocast, linear_sq_norms, project_matrix
from lightning_monitor.probes.per_example.registry import Handler, register
from lightning_monitor.probes.per_example.strategy import LinearRule, examples_at_once
from lightning_monitor.probes.per_example.linear import full_precision


def _padded(m: nn.Module, x: Tensor) -> tuple[Tensor, list[int]]:
    """``x`` padded as the layer pads it where a convolution's own ``padding`` cannot (``"same"``, a
    non-zero ``padding_mode``), and the padding left to the convolution."""
    ks, dil = tuple(m.kernel_size), tuple(m.dilation)
    if isinstance(m.padding, str):
        if m.padding == "valid":
            return x, [0] * len(ks)
        pad = []  # "same" (torch refuses it with a stride > 1)
        for k, d in zip(reversed(ks), reversed(dil)):
            total = d * (k - 1)
            pad += [total // 2, total - total // 2]
        return F.pad(x, pad, mode="constant" if m.padding_mode == "zeros" else m.padding_mode), [0] * len(ks)
    if m.padding_mode != "zeros":
        # what torch pads with for a non-"zeros" padding_mode: its integer padding, last dim first, each
        # side (torch's private `_reversed_padding_repeated_twice`, built from the public `padding`)
        return F.pad(x, [p for p in reversed(m.padding) for _ in range(2)], mode=m.padding_mode), [0] * len(ks)
    return x, list(m.padding)


def unfold_input(m: nn.Module, x: Tensor) -> Tensor:
    """The input patches of a convolution as ``F.unfold`` lays them out, ``(B, C_in * kernel, L)``, in fp32,
    padded as the layer pads (``padding="same"``, non-zero padding modes), so that the layer's output is
    ``weight.reshape(C_out, -1) @ patches`` (per group). ``nn.Conv1d`` runs as a Conv2d of height 1."""
    x, padding = _padded(m, x)
    ks, dil, stride = tuple(m.kernel_size), tuple(m.dilation), tuple(m.stride)
    if isinstance(m, nn.Conv1d):
        x, ks, dil, stride, padding = x.unsqueeze(2), (1,) + ks, (1,) + dil, (1,) + stride, [0] + padding
    return F.unfold(x.float(), ks, dilation=dil, padding=padding, stride=stride)


def per_example_conv_grads(m: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """``[B, *weight.shape]``: each example's weight gradient, in fp32, by one weight-gradient convolution
    over the batch folded into the groups (``B * groups``): the kernel autograd uses for the layer's own
    weight gradient, without unfolding the input. A transposed convolution (``nn.ConvTranspose*d``) takes
    the transposed kernel, with the output padding read off the shapes (a forward given ``output_size``)."""
    b, grp = x.shape[0], m.groups
    w = m.weight
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # fp32 or wider
    nd = len(m.kernel_size)
    transposed = isinstance(m, nn.modules.conv._ConvTransposeNd)
    if transposed:  # zero padding only (torch refuses other modes for a transposed convolution)
        padding = list(m.padding)
        out_pad = [o - ((i - 1) * s - 2 * p + d * (k - 1) + 1) for o, i, s, p, d, k in
                   zip(g.shape[2:], x.shape[2:], m.stride, m.padding, m.dilation, m.kernel_size)]
        x = x.to(acc)
    else:
        x, padding = _padded(m, x.to(acc))
        out_pad = [0] * nd
    # only the shape of the weight matters to the weight gradient: an uninitialised tensor, no copy of B weights
    shape_only = torch.empty((b * w.shape[0], *w.shape[1:]), dtype=acc, device=w.device)
    gw = torch.ops.aten.convolution_backward(
        g.to(acc).reshape(1, b * g.shape[1], *g.shape[2:]), x.reshape(1, b * x.shape[1], *x.shape[2:]), shape_only,
        None, list(m.stride), padding, list(m.dilation), transposed, out_pad, b * grp, [False, True, False],
    )[1]
    return gw.reshape(b, *w.shape)


def _patches(m: nn.Module, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Per group: patches ``(B * groups, L, C_in/groups * kernel)`` and grads ``(B * groups, L, C_out/groups)``."""
    u = unfold_input(m, x)  # B, C k k, L
    b, _, length = u.shape
    grp = m.groups
    a = u.reshape(b, grp, -1, length).permute(0, 1, 3, 2).reshape(b * grp, length, -1)
    d = g.float().reshape(b, grp, m.out_channels // grp, -1).permute(0, 1, 3, 2).reshape(b * grp, length, -1)
    return a, d


@register(nn.Conv2d, nn.Conv1d)
class Conv2dHandler(Handler):
    def param_names(self, m: nn.Module) -> tuple[str, ...]:
        return ("weight", "bias")

    def capture(self, m: nn.Module, x: Tensor) -> Any:
        return x if x.dim() == (3 if isinstance(m, nn.Conv1d) else 4) else None

    def batch_dims(self, m: nn.Module, x: Tensor) -> int:
        return 1

    def sq_norms(self, m: nn.Module, x: Tensor, g: Tensor, rule: LinearRule) -> dict[str, Tensor]:
        b = x.shape[0]
        d_in, d_out = m.weight[0].numel(), m.out_channels // m.groups
        strategy = rule.choose(t=g[0, 0].numel(), d_in=d_in, d_out=d_out, batch=b, device_type=x.device.type,
                               groups=m.groups)
        if strategy == "gram":
            a, d = _patches(m, x, g)
            out = {"weight": linear_sq_norms(a, d, "gram").reshape(b, m.groups).sum(1)}
        else:
            out = {"weight": per_example_conv_grads(m, x, g).flatten(1).pow(2).sum(1)}
        if m.bias is not None:
            out["bias"] = g.float().flatten(2).sum(2).pow(2).sum(1)
        return out

    def grads(self, m: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
        out = {"weight": per_example_conv_grads(m, x, g)}
        if m.bias is not None:
            out["bias"] = g.float().flatten(2).sum(2)
        return out

    def project(self, m: nn.Module, x: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        """``u^T G v`` without unfolding: the patches' products with ``v`` are one convolution of the input
        with ``v`` as ``k`` kernels per group (padded as the layer pads, by its own ``_conv_forward``)."""
        out = {}
        if "weight" in uv:
            u, v = uv["weight"]
            b, grp, k = x.shape[0], m.groups, u.shape[0]
            kernels = v.reshape(k, m.in_channels // grp, *m.kernel_size).repeat(grp, *([1] * (1 + len(m.kernel_size))))
            av = m._conv_forward(x.float(), kernels.float(), None).reshape(b, grp, k, -1)
            du = torch.einsum("bgol,kgo->bgkl", g.float().reshape(b, grp, m.out_channels // grp, -1),
                              u.reshape(k, grp, -1))
            out["weight"] = (du * av).sum((0, 1, 3))
        if "bias" in uv:
            out["bias"] = project_matrix(g.float().transpose(0, 1).flatten(1).sum(1), *uv["bias"])
        return out

    def patch_forward(self, m: nn.Module, uses: Any, rule: LinearRule) -> Optional[Callable[[Tensor], Tensor]]:
        """The fused forward on a plain zero-padded ``nn.Conv2d`` / ``nn.Conv1d`` (no custom ``forward``, no
        pre-hooks) when the requested strategy is ``"auto"`` or ``"fused"``: its backward forms each
        example's weight gradient (:func:`per_example_conv_grads`: one weight-gradient convolution over the
        batch folded into the groups, the kernel autograd itself uses) and returns their sum as the weight
        gradient instead of autograd's own weight-gradient convolution, taking each squared norm on the way.
        Per call, :meth:`LinearRule.choose` decides: Gram on unfolded patches for short maps and wide layers,
        or when the batch's per-example gradients exceed the cap."""
        fusable = (
            rule.strategy in ("auto", "fused")
            and type(m).forward in (nn.Conv2d.forward, nn.Conv1d.forward)
            and "forward" not in m.__dict__
            and not has_forward_pre_hooks(m)
            and m.padding_mode == "zeros"
            and not isinstance(m.padding, str)
        )
        if not fusable:
            return None

        def fused_forward(input: Tensor) -> Tensor:  # the parameter's name of the convolutions' forward: `m(input=x)`
            x, w, b = input, m.weight, m.bias
            mode = uses.note(x)
            if uses.left_out(every=True):  # nothing of it is measured (left out at an earlier check): autograd's own
                return m._conv_forward(x, w, b)
            if mode in ("dry", "skip") or x.dim() != w.dim():
                out = m._conv_forward(x, w, b)
                if mode == "record":
                    uses.record(x, out, rule)
                return out
            needs = x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)
            choice = None
            if needs:
                length = 1
                for size, k, st, dil, pad in zip(x.shape[2:], m.kernel_size, m.stride, m.dilation, m.padding):
                    length *= max((size + 2 * pad - dil * (k - 1) - 1) // st + 1, 1)
                choice = rule.choose(t=length, d_in=w[0].numel(), d_out=m.out_channels // m.groups,
                                     batch=x.shape[0], device_type=x.device.type, fused=full_precision(x, w), groups=m.groups,
                                     held_examples=x.shape[0])
            if mode == "replay":  # the same operations as the recorded forward, nothing recorded
                return _FusedConv.apply(x, w, b, m, None, None) if choice == "fused" else m._conv_forward(x, w, b)
            if choice == "fused":
                return _FusedConv.apply(x, w, b, m, _sink(uses.expect(x)), uses.left_out)
            out = m._conv_forward(x, w, b)
            uses.record(x, out, LinearRule(choice) if choice is not None else rule)
            return out

        return fused_forward


@register(nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
class ConvNdHandler(Conv2dHandler):
    """``nn.Conv3d`` and the transposed convolutions: each example's weight gradient by
    :func:`per_example_conv_grads` (no unfolded form: ``F.unfold`` is 2-D only, and a transposed convolution's
    patches are its output's), a chunk of examples at a time within the probe's memory cap (``max_fused_bytes``;
    on CPU also within a core's cache, as the fused Linear); bias ``||sum_l d_l||^2``. No fused forward."""

    def capture(self, m: nn.Module, x: Tensor) -> Any:
        return x if x.dim() == len(m.kernel_size) + 2 else None  # an unbatched input: skipped

    @staticmethod
    def _chunk(m: nn.Module, x: Tensor, rule: Optional[LinearRule] = None) -> int:
        per = 4 * m.weight.numel()
        n = examples_at_once(x.device.type, x.shape[0], per)
        if rule is not None and rule.max_bytes is not None:
            n = max(1, min(n, rule.max_bytes // per))
        return n

    def sq_norms(self, m: nn.Module, x: Tensor, g: Tensor, rule: LinearRule) -> dict[str, Tensor]:
        n = self._chunk(m, x, rule)
        parts = [per_example_conv_grads(m, x[i:i + n], g[i:i + n]).flatten(1).pow(2).sum(1)
                 for i in range(0, x.shape[0], n)]
        out = {"weight": parts[0] if len(parts) == 1 else torch.cat(parts)}
        if m.bias is not None:
            out["bias"] = g.float().flatten(2).sum(2).pow(2).sum(1)
        return out

    def project(self, m: nn.Module, x: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        """From the use's summed gradient (the per-example gradients' sum, a chunk of examples at a time)."""
        out = {}
        if "weight" in uv:
            n = self._chunk(m, x)
            total = sum(per_example_conv_grads(m, x[i:i + n], g[i:i + n]).sum(0) for i in range(0, x.shape[0], n))
            out["weight"] = project_matrix(total, *uv["weight"])
        if "bias" in uv:
            out["bias"] = project_matrix(g.float().transpose(0, 1).flatten(1).sum(1), *uv["bias"])
        return out

    def patch_forward(self, m: nn.Module, uses: Any, rule: LinearRule) -> Optional[Callable[[Tensor], Tensor]]:
        return None


def _sink(done: Callable[..., None]) -> Callable[..., None]:
    """Adapts :class:`_FusedConv`'s results to the probe's ``done(grad_output, results)``."""

    def sink(grad: Tensor, sqs: dict[str, Tensor], sums: dict[str, Tensor],
             grads: Callable[[], dict[str, Tensor]]) -> None:
        done(grad, (lambda: sqs, grads, lambda uv: {k: project_matrix(sums[k], *uv[k]) for k in uv}))

    return sink


class _FusedConv(torch.autograd.Function):
    """A zero-padded convolution whose backward forms the weight gradient as the sum of the per-example
    gradients, taking their squared norms on the way (see :meth:`Conv2dHandler.patch_forward`); the input
    gradient is autograd's own kernel. ``left_out``: says, after the probe has the backward's results, whether the
    module is left out (it feeds a BatchNorm that couples the examples, or its input has no batch dimension found: see
    :meth:`_Uses.left_out`): then the gradients returned are autograd's own, so that the step is the same as without
    the probe."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], m: nn.Module,
                sink: Optional[Callable[..., None]], left_out: Optional[Callable[[], bool]]) -> Tensor:
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        out, x, weight = forward_under_autocast(m._conv_forward, x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.m, ctx.sink, ctx.has_bias, ctx.left_out = m, sink, bias is not None, left_out
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        x, weight = ctx.saved_tensors
        m = ctx.m
        grad = grad.to(weight.dtype)
        nd = len(m.kernel_size)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.convolution_backward(
                grad, x, weight, None, list(m.stride), list(m.padding), list(m.dilation), False, [0] * nd,
                m.groups, [True, False, False],
            )[0]
        per_w = per_example_conv_grads(m, x, grad)
        per_b = grad.to(torch.promote_types(grad.dtype, torch.float32)).flatten(2).sum(2) if ctx.has_bias else None
        total = per_w.sum(0)
        if ctx.sink is not None:
            sqs = {"weight": torch.linalg.vector_norm(per_w.flatten(1), dim=1).pow(2).float()}
            sums = {"weight": total}
            if per_b is not None:
                sqs["bias"], sums["bias"] = per_b.pow(2).sum(1).float(), per_b.sum(0)
            ctx.sink(grad, sqs, sums, lambda: {"weight": per_w, **({"bias": per_b} if per_b is not None else {})})
        if ctx.left_out is not None and ctx.left_out():
            # autograd's own weight and bias gradients (its kernel, in one call as autograd makes it)
            grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
                grad, x, weight, [weight.shape[0]] if ctx.has_bias else None, list(m.stride), list(m.padding),
                list(m.dilation), False, [0] * nd, m.groups, list(ctx.needs_input_grad[:3]),
            )
            grad_w = grad_w.to(ctx.dtypes[0]) if grad_w is not None else None
            grad_b = grad_b.to(ctx.dtypes[1]) if grad_b is not None else None
            return grad_x, grad_w, grad_b, None, None, None
        grad_w = total.to(ctx.dtypes[0]) if ctx.needs_input_grad[1] else None
        grad_b = per_b.sum(0).to(ctx.dtypes[1]) if per_b is not None and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None

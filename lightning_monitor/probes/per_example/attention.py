"""``nn.MultiheadAttention``: its packed input projection ``in_proj_weight`` / ``in_proj_bias`` is a Linear
from ``E`` to ``3E`` applied inside ``F.multi_head_attention_forward``, and its ``out_proj`` is a Linear whose
weight the function uses without calling the module. Neither has a module output to hook.

While the probe is armed, the module's ``forward`` is its own class's ``forward`` run with
``torch.nn.functional.linear`` intercepted for the duration of the call: the call that applies
``in_proj_weight`` to the query is recorded as one Linear-form use (input ``[L, N, E]``, output ``[L, N, 3E]``,
its gradient hooked), and the call that applies ``out_proj.weight`` is made by calling ``out_proj`` itself, so
the Linear handler covers it. Every operation is the one the module would run, in the same order: the outputs
and gradients are bit for bit those of the plain forward.

Covered: self-attention (``query is key is value``, the packed weight: ``nn.TransformerEncoderLayer``,
torchvision's ViT, the self-attention of ``nn.TransformerDecoderLayer``). Cross-attention (the packed weight
split between the query and the memory) leaves ``in_proj_*`` uncovered with that reason (``out_proj`` stays
covered); separate ``q/k/v_proj_weight`` (``kdim`` / ``vdim`` other than ``embed_dim``) and ``bias_k`` /
``bias_v`` have no per-example rule here.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_monitor.probes.per_example.linear import LinearHandler
from lightning_monitor.probes.per_example.registry import Handler, register

__all__ = ["MultiheadAttentionHandler", "intercepts_linear", "route_out_proj"]

_PLAIN_LINEAR = torch._C._nn.linear
_LOCK = threading.RLock()
_CROSS = ("cross-attention: the packed input projection is split between the query and the memory (two uses of "
          "different rows of one weight), which has no per-example rule here")


def intercepts_linear() -> bool:
    """Whether ``F.multi_head_attention_forward`` applies its projections through ``torch.nn.functional.linear``
    looked up at call time (what the handler intercepts). Checked once, on a tiny module."""
    global _INTERCEPTS
    if _INTERCEPTS is None:
        seen: list[Tensor] = []
        with torch.random.fork_rng(devices=[]):  # its initialisation must not move the run's random stream
            m = nn.MultiheadAttention(4, 1)
        x = torch.zeros(2, 1, 4, requires_grad=True)

        def spy(inp: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
            seen.append(weight)
            return _PLAIN_LINEAR(inp, weight, bias)

        with _LOCK:
            before, F.linear = F.linear, spy
            try:
                m(x, x, x, need_weights=False)
            finally:
                F.linear = before
        _INTERCEPTS = any(w is m.in_proj_weight for w in seen) and any(w is m.out_proj.weight for w in seen)
    return _INTERCEPTS


_INTERCEPTS: Optional[bool] = None


@register(nn.MultiheadAttention)
class MultiheadAttentionHandler(Handler):
    """The packed input projection of ``nn.MultiheadAttention`` as a Linear ``E -> 3E`` (see the module
    docstring); ``out_proj`` is covered by the Linear handler, called by the patched forward."""

    _linear = LinearHandler()

    def unsupported(self, m: nn.Module) -> Optional[str]:
        if not getattr(m, "_qkv_same_embed_dim", False) or getattr(m, "in_proj_weight", None) is None:
            return ("separate q/k/v projection weights (kdim or vdim other than embed_dim) have no per-example "
                    "rule here")
        if not intercepts_linear():
            return "this torch's multi_head_attention_forward does not apply its projections through F.linear"
        return None

    def param_names(self, m: nn.Module) -> tuple[str, ...]:
        return ("in_proj_weight", "in_proj_bias")

    def capture(self, m: nn.Module, x: Tensor) -> Any:
        return x if x.dim() >= 2 else None

    @staticmethod
    def _as_linear(m: nn.Module) -> Any:
        """A stand-in with the attributes the Linear handler reads, for the packed projection."""
        w = m.in_proj_weight
        return _Projection(w, m.in_proj_bias, w.shape[1], w.shape[0])

    @staticmethod
    def _rename(out: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"in_proj_" + k: v for k, v in out.items()}

    def sq_norms(self, m: nn.Module, x: Tensor, g: Tensor, rule: Any) -> dict[str, Tensor]:
        return self._rename(self._linear.sq_norms(self._as_linear(m), x, g, rule))

    def grads(self, m: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
        return self._rename(self._linear.grads(self._as_linear(m), x, g))

    def project(self, m: nn.Module, x: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        local = {k[len("in_proj_"):]: v for k, v in uv.items()}
        return self._rename(self._linear.project(self._as_linear(m), x, g, local))

    def patch_forward(self, m: nn.Module, uses: Any, rule: Any) -> Optional[Callable[..., Any]]:
        forward = type(m).forward

        def in_proj(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
            if not uses.params:  # frozen: only out_proj is routed
                return _PLAIN_LINEAR(x, weight, bias)
            mode = uses.note(x)
            out = _PLAIN_LINEAR(x, weight, bias)
            if mode == "record":
                uses.record(x, out, rule)
            return out

        def patched(query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Any:
            if not (query is key and key is value) and torch.is_grad_enabled() and uses.params:
                uses.probe._refused.setdefault(uses.name, _CROSS)
            with _LOCK:
                before = F.linear
                F.linear = _interceptor(m, before, _call_shape(m, query), in_proj)
                try:
                    return forward(m, query, key, value, *args, **kwargs)
                finally:
                    F.linear = before

        return patched


class _Projection:
    """The packed input projection seen as a Linear (``weight``, ``bias``, ``in_features``, ``out_features``)."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor], in_features: int, out_features: int) -> None:
        self.weight, self.bias, self.in_features, self.out_features = weight, bias, in_features, out_features


def _call_shape(mha: nn.MultiheadAttention, query: Tensor) -> tuple[int, int]:
    """``(L, N)`` of a call of ``mha`` on ``query`` (``N = 1`` unbatched)."""
    if query.dim() == 3:
        return tuple(query.shape[1::-1]) if mha.batch_first else tuple(query.shape[:2])  # type: ignore[return-value]
    return query.shape[0], 1


def _interceptor(mha: nn.MultiheadAttention, before: Callable[..., Tensor], shape: Optional[tuple[int, int]] = None,
                 in_proj: Optional[Callable[[Tensor, Tensor, Optional[Tensor]], Tensor]] = None) -> Callable[..., Tensor]:
    """``torch.nn.functional.linear`` for one call of ``mha``: the product with ``out_proj.weight`` is made by calling
    ``out_proj`` itself (its hooks see the use), with ``shape`` ``(L, N)`` on the ``[L, N, E]`` view of the
    ``[L * N, E]`` (L-major) input the attention flattens it to, so that the batch has a dimension of its own; the
    packed projection goes to ``in_proj`` when given; anything else to ``before``. Inside ``out_proj``'s own forward
    the product is the plain one."""
    inside = [False]

    def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        if weight is mha.out_proj.weight:
            if inside[0]:
                return _PLAIN_LINEAR(x, weight, bias)
            inside[0] = True
            try:
                if shape is not None and x.dim() == 2 and x.shape[0] == shape[0] * shape[1]:
                    length, batch = shape
                    return mha.out_proj(x.view(length, batch, x.shape[1])).view(length * batch, -1)
                return mha.out_proj(x)
            finally:
                inside[0] = False
        if in_proj is not None and weight is mha.in_proj_weight:  # cross-attention's slices are other tensors
            return in_proj(x, weight, bias)
        return before(x, weight, bias)

    return linear


def route_out_proj(mha: nn.MultiheadAttention) -> list[RemovableHandle]:
    """Hooks on ``mha`` that make each of its calls apply ``out_proj`` by calling the module (see :func:`_interceptor`:
    the same product), so that hooks on ``out_proj`` see its input: ``torch.nn.functional.linear`` is intercepted
    from the forward pre-hook to the forward hook (which runs even when the forward raises). Remove the returned
    handles to stop; nothing is installed otherwise."""
    saved: list[Callable[..., Tensor]] = []

    # eager under torch.compile, as the probe's and the input capture's hooks
    @torch.compiler.disable
    def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
        _LOCK.acquire()
        saved.append(F.linear)
        F.linear = _interceptor(mha, saved[-1])

    @torch.compiler.disable
    def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if saved:
            F.linear = saved.pop()
            _LOCK.release()

    return [mha.register_forward_pre_hook(pre), mha.register_forward_hook(post, always_call=True)]

"""The probe: :class:`PerExampleGradNorms` arms the handlers of :mod:`.registry` on a model's modules,
collects what their hooks compute, sums the uses of shared parameters and verifies coverage."""

from __future__ import annotations

import functools
import warnings
from collections import defaultdict
from typing import Any, Callable, Literal, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_monitor.probes.per_example.kernels import project_matrix
from lightning_monitor.probes.per_example.registry import Handler, handler_for
from lightning_monitor.probes.per_example.strategy import (
    STRATEGIES,
    LinearRule,
    LinearStrategy,
)

__all__ = ["PerExampleGradNorms"]

#: Container types whose submodules' parameters are used without calling those submodules.
_OPAQUE: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


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


class _Uses:
    """The probe's side of one hooked module: counts each use in a forward and hands the handler's
    results for it to :meth:`PerExampleGradNorms._consume` (see :meth:`Handler.patch_forward`)."""

    def __init__(self, probe: PerExampleGradNorms, module: nn.Module, handler: Handler,
                 params: list[tuple[str, int]]) -> None:
        self.probe, self.module, self.handler, self.params = probe, module, handler, params

    def expect(self, batch: int) -> Callable[..., None]:
        """Count one use of the module on ``batch`` examples; its backward calls the returned
        ``done(sq_fn, grads_fn, proj_fn)`` once."""
        for _, pid in self.params:
            self.probe._outstanding[pid] += 1
        return functools.partial(self.probe._consume, self.params, batch)

    def record(self, x: Tensor, output: Any, rule: LinearRule) -> None:
        """One use with input ``x``: capture it and hook the output gradient."""
        if not torch.is_grad_enabled() or not isinstance(output, Tensor) or not output.requires_grad:
            return
        m, handler = self.module, self.handler
        ctx = handler.capture(m, x)
        if ctx is None:
            return
        done = self.expect(x.shape[0])

        def grad_hook(grad: Tensor) -> None:
            with torch.no_grad():
                done(
                    lambda: handler.sq_norms(m, ctx, grad, rule),
                    lambda: handler.grads(m, ctx, grad),
                    lambda uv: handler.project(m, ctx, grad, uv),
                )

        output.register_hook(grad_hook)

    def forward_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if args and isinstance(args[0], Tensor):
            self.record(args[0], output, self.probe._rule)


class PerExampleGradNorms:
    """Context manager computing exact per-example squared gradient norms during backward.

    Args:
        module: the model (a DistributedDataParallel wrapper is looked through).
        loss_reduction: ``"mean"`` if the loss is averaged over the batch (the norms are rescaled by
            ``B^2``), ``"sum"`` if it is summed over examples.
        linear_strategy: how an ``nn.Linear`` on sequences ``(B, T, d)`` (and an ``nn.Conv2d``) gets its
            weight norms. ``"fused"``: its weight gradient is computed as the sum of the materialised
            per-example gradients (the same multiply-adds as the plain backward; on CPU a chunk of
            examples at a time, reduced while in cache), so the norms cost almost nothing extra;
            ``"gram"``: ``<A_i A_i^T, D_i D_i^T>`` beside the plain backward; ``"materialize"``:
            ``D_i^T A_i`` beside the plain backward. ``"auto"``: the layer's materialising path (fused
            for a plain ``nn.Linear``, else materialize) unless the per-example gradients it holds at
            once exceed ``max_fused_bytes`` (``4 n d_in d_out`` bytes, ``n`` the examples formed at once:
            fused on CPU as many as fit :data:`CPU_CHUNK_BYTES`, at least one; else the batch) or Gram is
            cheaper (``T^2 (d_in + d_out) < w d_in d_out``, ``w =`` :data:`GRAM_OVER_FUSED` ``= 8``
            against fused, ``w = T`` against materialize): then gram. The rule is
            :class:`~lightning_monitor.probes.per_example.strategy.LinearRule`. Inputs ``(B, d)`` always
            use ``||a_i||^2 ||d_i||^2``.
        include: optional predicate ``(qualified name, module) -> bool`` restricting the modules hooked.
        batch_size: the number of examples expected over the backward passes read together; a module
            whose input's leading dimension does not match (an input broadcast over the batch) is moved to
            :attr:`uncovered`. ``None``: the most common count among the parameters.
        max_fused_bytes: memory cap of the per-example gradients a layer holds at once (``"auto"``).
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
        if linear_strategy not in STRATEGIES:
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
        self._patched: list[nn.Module] = []
        self._active = False

        trainable = {id(p): name for name, p in self.module.named_parameters() if p.requires_grad}
        self._params: dict[int, nn.Parameter] = {id(p): p for p in self.module.parameters() if p.requires_grad}
        opaque_prefixes = [n + "." for n, m in self.module.named_modules() if n and isinstance(m, _OPAQUE)]
        # module name -> (module, handler, [(local name, param id)])
        self._modules: dict[str, tuple[nn.Module, Handler, list[tuple[str, int]]]] = {}
        covered: set[int] = set()
        self.reasons: dict[str, str] = {}
        for mname, mod in self.module.named_modules(remove_duplicate=False):
            handler = handler_for(mod)
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
            uses = _Uses(self, mod, handler, todo)
            forward = handler.patch_forward(mod, uses, self._rule)
            if forward is not None:
                mod.forward = forward  # type: ignore[method-assign]
                self._patched.append(mod)
            else:
                self._handles.append(mod.register_forward_hook(uses.forward_hook))
        if self.verify:
            for pid in self._covered_ids:
                self._handles.append(self._params[pid].register_hook(self._make_leaf_hook(pid)))
        self._active = True

    def detach(self) -> None:
        """Remove every hook (idempotent); the norms recorded so far stay readable."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for mod in self._patched:
            mod.__dict__.pop("forward", None)
        self._patched.clear()
        self._active = False

    @property
    def active(self) -> bool:
        return self._active

    @property
    def _rule(self) -> LinearRule:
        return LinearRule(self.linear_strategy, self.max_fused_bytes)

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
                if p.grad is not None:
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

"""The probe: :class:`PerExampleGradNorms` arms the handlers of :mod:`.registry` on a model's modules,
collects what their hooks compute, sums the uses of shared parameters and verifies coverage."""

from __future__ import annotations

import dataclasses
import fnmatch
import sys
import warnings
import weakref
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Callable, Literal, NamedTuple, Optional, Union

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.hooks import RemovableHandle

from lightning_monitor._compat import fork_rng_of, set_versions, versions_settable
from lightning_monitor._replays import (ParameterWrite, ParametersReadOnly, WritesUndone, host_random_states,
                                       plain_parameters, restore_attributes, set_host_random_states)
from lightning_monitor._replays import attributes as module_attributes
from lightning_monitor.probes import call_args, dry_run, in_backward, in_dry_run
from lightning_monitor.probes.per_example.kernels import project_matrix
from lightning_monitor.probes.per_example.registry import Handler, handler_for
from lightning_monitor.probes.per_example.strategy import (
    STRATEGIES,
    LinearRule,
    LinearStrategy,
)

__all__ = ["PerExampleGradNorms"]

#: Container types whose submodules' parameters are used without calling those submodules (unless the probe patches the
#: container's forward, which then calls them: nn.MultiheadAttention's handler does).
_OPAQUE: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)
#: a parameter's gradient may differ from the sum of its per-example parts, before it counts as used outside its
#: module, by this many machine epsilons of the precision the backward ran in (relative; at least 1e-2): bf16's
#: eps of 2^-7 gives 0.125 (seen: up to 0.053 on a LayerNorm's weights), fp16's 0.016, fp32's 1e-2
_ROUNDING_ALLOWANCE = 16.0


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


def _eps(dtype: torch.dtype) -> float:
    """The machine epsilon of a floating dtype (0 for others)."""
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def _fields(value: Any) -> Optional[dict[str, Any]]:
    """A dataclass instance's fields by name (a batch class passed whole), else ``None``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return None


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[Tensor]:
    """The first tensor of at least one dimension among a call's arguments (one level into lists, tuples, dicts and
    dataclasses): its dimension 0 is the batch size by Lightning's convention (``extract_batch_size``)."""
    for value in (*args, *kwargs.values()):
        fields = _fields(value)
        if fields is not None:
            value = fields
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, Tensor) and item.dim() >= 1:
                return item
    return None


def _resize_batch(value: Any, batch: int, size: int, dim: int = 0, order: Optional[list[int]] = None) -> Any:
    """``value`` with every tensor whose dimension ``dim`` is ``batch`` cut (or repeated) to ``size`` examples along
    it (else, for ``dim > 0``, along dimension 0 if that is ``batch``: a batch-first mask beside a sequence-first
    input), through lists, tuples, dicts and dataclasses; with ``order``, the examples of those indices instead."""
    if isinstance(value, Tensor):
        at = dim if value.dim() > dim and value.shape[dim] == batch else 0
        if value.dim() >= 1 and value.shape[at] == batch:
            if order is not None:
                return value.index_select(at, torch.tensor(order, device=value.device))
            if size <= batch:
                return value.narrow(at, 0, size)
            return value.repeat_interleave(-(-size // batch), dim=at).narrow(at, 0, size)
        return value
    if isinstance(value, dict):
        return type(value)({k: _resize_batch(v, batch, size, dim, order) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_resize_batch(v, batch, size, dim, order) for v in value))
    fields = _fields(value)
    if fields is not None:  # a dataclass batch: a copy with its tensor fields resized (init=False fields kept)
        return dataclasses.replace(value, **{k: _resize_batch(v, batch, size, dim, order) for k, v in fields.items()
                                             if any(f.name == k and f.init for f in dataclasses.fields(value))})
    if isinstance(value, (list, tuple)):
        return type(value)(_resize_batch(v, batch, size, dim, order) for v in value)
    return value


def _shapes(value: Any) -> list[tuple[int, ...]]:
    """The shapes of the tensors in a call's output (through lists, tuples and dicts, as a ``ModelOutput``)."""
    return [tuple(t.shape) for t in _tensors(value)]


def _tensors(value: Any) -> list[Tensor]:
    """The tensors of a call's output (through lists, tuples and dicts, as a ``ModelOutput``), in order."""
    if isinstance(value, Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [t for item in items for t in _tensors(item)]


def _low_precision(module: nn.Module) -> bool:
    """Whether the running forward computes in a 16-bit type (autocast on, or the module's own parameters 16-bit): rows
    then differ by rounding between a batch and a slice of it far more than in fp32."""
    if any(p.dtype in (torch.float16, torch.bfloat16) for p in module.parameters()):
        return True
    try:
        return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))
    except TypeError:  # an older torch: a flag per device type
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


def _rows_close(alone: Tensor, together: Tensor, loose: bool) -> bool:
    """Whether the prints of rows computed on a slice of the batch (``alone``) are those of the same rows in the whole
    batch (``together``), to the rounding a different batch size brings (other kernels, TF32; 16-bit: ``loose``) and
    no more: a batch statistic moves them by a share of their spread."""
    if alone.shape != together.shape:
        return False
    # rows holding an infinity (logits masked with -inf) print as +-inf or NaN: compared as they are (the same where both
    # are NaN), the finite ones to a tolerance of their scale
    finite = torch.isfinite(together) & torch.isfinite(alone)
    same = (alone == together) | (alone.isnan() & together.isnan())
    scale = float(together[finite].abs().max()) if bool(finite.any()) else 0.0
    rtol = 0.1 if loose else 1e-2
    near = (alone - together).abs() <= rtol * (together.abs() + 0.1 * scale) + 1e-30
    return bool(torch.where(finite, near, same).all())


def _scaling_dim(shape: tuple[int, ...], small_shape: tuple[int, ...], batch: int, small: int) -> Union[int, str]:
    """The dimension of a module's input that holds the batch, from the input's shape on the whole batch
    and on a ``small``-example slice of it; or why there is none."""
    if len(shape) != len(small_shape):
        return f"the rank of its input {shape} changes with the batch size"
    diff = [i for i, (n, m) in enumerate(zip(shape, small_shape)) if n != m]
    if not diff:
        return (
            f"its input {shape} has no batch dimension (it does not change with the batch size, e.g. positions "
            "broadcast over the batch), so per-example gradients are not separable there"
        )
    if len(diff) > 1:
        return f"several dimensions of its input {shape} change with the batch size"
    i = diff[0]
    if shape[i] == batch and small_shape[i] == small:
        return i
    per = shape[i] // batch
    if per > 1 and shape[i] == batch * per and small_shape[i] == small * per:
        return _Folded(i, per)
    if shape[i] < batch:
        return (f"dimension {i} of its input {shape} holds {shape[i]} rows for the batch's {batch} examples (a layer run on "
                "a slice or a selection of the batch): which example each row belongs to is not known")
    return f"the batch is folded into dimension {i} of its input {shape} together with other positions"


class _Folded(NamedTuple):
    """An input whose dimension ``dim`` holds the batch folded with ``per`` other positions (``[B * T, d]``, a model
    that flattens its tokens before a layer), found example-major: example ``i`` owns ``[i * per, (i + 1) * per)``."""

    dim: int
    per: int


#: the example orders the layout check compares with the batch's own: rolled by one, and reversed (a roll alone is
#: blind to rows whose first example happens to hold its share: padded rows selected with a mask, ``h[mask]``)
def _orders(batch: int) -> list[list[int]]:
    rolled, reversed_ = list(range(1, batch)) + [0], list(range(batch - 1, -1, -1))
    return [rolled] if rolled == reversed_ else [rolled, reversed_]


def _unhandled(mod: nn.Module) -> str:
    """Why a parameter held by ``mod`` (a module type without a handler) is left out, in the user's terms."""
    from torch.nn.utils.parametrize import ParametrizationList

    name = type(mod).__name__
    if isinstance(mod, ParametrizationList):
        return ("a parametrized weight (`torch.nn.utils.parametrize`: weight_norm, spectral_norm, orthogonal ...): its "
                "gradient reaches the original tensor through the parametrization, which has no per-example rule here")
    if not type(mod).__module__.startswith("torch."):
        return (f"no handler for its module type ({name}), whose own forward uses it directly, not through a layer "
                "of a known type (a handler can be registered: `lightning_monitor.probes.per_example.register`)")
    return f"no handler for its module type ({name})"


def _row_prints(x: Tensor, dim: int) -> Tensor:
    """One number per row of ``x`` along ``dim`` (its projection on a fixed random direction, in float64): what the
    layout check compares instead of the rows themselves, which it would hold for every hooked module of three runs of
    the model (a model's activations three times over). Equal rows give equal prints; different ones, different
    prints but for a chance of measure 0."""
    rows = x.detach().movedim(dim, 0).reshape(x.shape[dim], -1).double()
    direction = torch.randn(rows.shape[1], dtype=torch.float64, device=rows.device,
                            generator=torch.Generator(device=rows.device).manual_seed(0))
    return rows @ direction


def _follows(first: Tensor, second: Tensor, dim: int, per: int, batch: int, order: list[int]) -> Optional[bool]:
    """Whether the input ``second`` of a module, on the batch's examples in ``order``, holds the rows of ``first`` (on
    the batch in its own order) moved with their examples: along ``dim``, ``per`` rows an example, example-major
    (``per`` > 1: and not position-major, ``[T * B, d]``, as well; both at once, rows that do not depend on their
    positions, cannot tell: ``None``). The rows may be their prints (:func:`_row_prints`); equal to rounding."""
    if first.shape != second.shape or first.dim() <= dim or first.shape[dim] != batch * per:
        return False

    def same(a: Tensor, b: Tensor) -> bool:
        a, b = a.double(), b.double()
        return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-6 * float(a.abs().max()) + 1e-30))

    index = torch.tensor(order, device=first.device)
    a, b = first.movedim(dim, 0), second.movedim(dim, 0)
    by_example = same(b.unflatten(0, (batch, per)), a.unflatten(0, (batch, per)).index_select(0, index))
    if per == 1 or not by_example:
        return by_example
    by_position = same(b.unflatten(0, (per, batch)), a.unflatten(0, (per, batch)).index_select(1, index))
    return None if by_position else True


_TWICE = ("its module's output received gradients in more than one backward pass of a step (`torch.autograd.grad` inside "
          "`training_step`, e.g. a gradient penalty, or a graph differentiated twice): the parameter's gradient sums the "
          "passes, while each pass's per-example parts are taken alone")


_SUBSTITUTED = ("its module ran and its output received a gradient, but the parameter received none: the module computed "
                "with another tensor in its place (torch.func.functional_call with a generated weight, a hypernetwork)")


def _pruned_reason(module_type: str, name: str) -> str:
    """Why the parameter ``name + "_orig"`` of a module pruned by ``torch.nn.utils.prune`` is left out."""
    return (f"{module_type}.{name} is pruned (torch.nn.utils.prune, e.g. Lightning's ModelPruning): the layer computes with "
            f"{name}_orig * {name}_mask, whose gradient is masked, while the per-example rule of the layer gives the "
            f"gradient of the weight it computes with")


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def _versions_put_back(params: list[Tensor], versions: list[int]) -> bool:
    """Give ``params`` back the autograd versions they had before a run on a slice of the batch (a safety net: the run's
    writes are undone with their versions by :class:`~lightning_monitor._replays.WritesUndone`). ``False`` where a
    version moved and this torch cannot set it back."""
    moved = [(p, v) for p, v in zip(params, versions) if p._version != v]
    return not moved or set_versions([p for p, _ in moved], [v for _, v in moved])


def _project_sparse(c: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """:func:`~.kernels.project_matrix` of a sparse COO gradient (``nn.Embedding(sparse=True)``), without
    densifying it when only its rows are sparse."""
    c = c.coalesce()
    if c.sparse_dim() != 1:
        return project_matrix(c.to_dense(), u, v)
    rows = c.indices()[0]
    values = c.values().float().reshape(rows.numel(), -1)
    return (u[:, rows] * (values @ v.T).T).sum(1)


class _Use(NamedTuple):
    """One call of a hooked module whose backward is awaited: what the backward needs to finish it."""

    uses: _Uses
    shape: tuple[int, ...]
    ctx: Any
    rule: LinearRule


class _Uses:
    """The probe's side of one hooked module: notes each call and hands the handler's results for it to
    the probe (see :meth:`Handler.patch_forward`)."""

    def __init__(self, probe: PerExampleGradNorms, name: str, module: nn.Module, handler: Handler,
                 params: list[tuple[str, int]]) -> None:
        # the probe is held weakly: the autograd graph holds the callbacks of the uses (tensor and node hooks, the
        # fused functions' contexts), the graph of a fit's last loss lives as long as the trainer, and Python's
        # collector cannot see the graph's references; held strongly, the probe (with the model, the trainer and the
        # activations) outlived every fit of the process
        self._probe = weakref.ref(probe)
        self.name, self.module, self.handler, self.params = name, module, handler, params

    @property
    def probe(self) -> PerExampleGradNorms:
        probe = self._probe()
        if probe is None:
            raise RuntimeError("the per-example probe of this hook is gone")
        return probe

    def note(self, x: Tensor) -> str:
        """Note one call of the module on input ``x``; says what the caller does with it: ``"record"``
        (a use whose backward comes: :meth:`expect` or :meth:`record` it), ``"skip"`` (no gradient),
        ``"replay"`` (activation checkpointing recomputes a recorded use: repeat the forward's operations,
        record nothing) or ``"dry"`` (the probe's batch-size run: plain forward)."""
        return self.probe._note_call(self, x)

    def expect(self, x: Tensor, ctx: Any = None, rule: Optional[LinearRule] = None) -> Callable[..., None]:
        """Count one use of the module on input ``x``; its backward calls the returned
        ``done(grad_output, results=None)`` once. ``results``: the ``(sq_fn, grads_fn, proj_fn)`` the
        backward computed itself, valid when the batch lies along dimension 0 of ``x``."""
        waiting = [pid for _, pid in self.params if pid in self.probe._pending]
        if waiting:
            # a use recorded while a backward left this module's parameters waiting for another: that one received no
            # gradient (a micro-batch of gradient accumulation starts after a backward that was over)
            self.probe._settle(waiting)
        for _, pid in self.params:
            self.probe._outstanding[pid] += 1
        self.probe._fwd_uses[self.name] += 1
        use = _Use(self, tuple(x.shape), x if ctx is None else ctx, rule or self.probe._rule)
        probe = self._probe
        finished = []

        def done(*args: Any, **kwargs: Any) -> None:
            live = probe()
            if live is None:  # a graph that outlived its probe: nothing to report to
                return
            if finished:
                # a second backward pass through this use's output in one step (`torch.autograd.grad` inside
                # `training_step`, a gradient penalty; `backward(retain_graph=True)` run twice): the parameter's gradient
                # is the sum over the passes, whose per-example parts were squared pass by pass
                live._leave_out(self.params, _TWICE)
                return
            finished.append(True)
            live._finish(use, *args, **kwargs)

        return done

    def left_out(self, every: bool = False) -> bool:
        """Whether this module's parameters (any of them; ``every``: all of them) are left out
        (:attr:`PerExampleGradNorms.reasons`), as found so far: a BatchNorm normalising with its batch's statistics takes
        an input that depends on them (found in the forward), or no batch dimension was found for its input (found by
        its backward's first results). A fused backward then returns the gradients autograd would, so that the step is
        the same as without the probe; a module all of whose parameters are left out runs its plain forward."""
        probe = self._probe()
        if probe is None:
            return False
        out = (probe._names[pid] in probe.reasons for _, pid in self.params)
        return all(out) if every else any(out)

    def record(self, x: Tensor, output: Any, rule: LinearRule) -> None:
        """One use with input ``x``: capture it and hook the output gradient."""
        if not isinstance(output, Tensor) or not output.requires_grad:
            return
        refused = self.handler.refusal(self.module, x)
        if refused is not None:  # not separable in the module's present mode: left out with the handler's reason
            self.probe._leave_out(self.params, refused)
            return
        ctx = self.handler.capture(self.module, x)
        if ctx is None:  # an input the handler does not take (a subclass with a forward of its own): said below
            self.probe._refused.setdefault(
                self.name, f"its handler does not take its input ({x.dtype}, shape {tuple(x.shape)}): the module "
                           "computes otherwise than its base class")
            return
        done = self.expect(x, ctx, rule)
        base = output._base
        if (base is not None and base.grad_fn is not None and base.numel() == output.numel()
                and base.is_contiguous() and output.is_contiguous() and base.data_ptr() == output.data_ptr()):
            # the output is a reshaped view of the layer's result (``F.linear`` with a bias on a 3-D input returns
            # one): a hook on the view is lost if the model writes into it in place (``h[mask] = emb``, wav2vec2's
            # and HuBERT's SpecAugment), so the node that made its base is hooked instead; it receives the
            # gradient of the layer's result (the written positions get none), which is the view's reshaped
            shape = output.shape

            def node_hook(grad_outputs: tuple[Optional[Tensor], ...]) -> None:
                if grad_outputs[0] is not None:
                    with torch.no_grad():
                        done(grad_outputs[0].reshape(shape))

            base.grad_fn.register_prehook(node_hook)
            return

        def grad_hook(grad: Tensor) -> None:
            with torch.no_grad():
                done(grad)

        output.register_hook(grad_hook)

    # every hook of the probe runs eagerly under torch.compile: traced, its code (per-module state, a module's name and
    # weight shape) made Dynamo recompile once per hooked module, up to its recompile limit
    @torch.compiler.disable
    def own_output_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """The first forward hook of the module: keeps the module's own output, before any hook registered
        earlier replaces it (quantization-aware training's activation fake-quantizer, a user hook)."""
        self._own_output = output

    @torch.compiler.disable
    def forward_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        # the gradient of the module's own output is read (through the hooks that replaced it: their masks count),
        # by a tensor hook registered after theirs (a hook that scales the gradient on that output counts too)
        own = self.__dict__.pop("_own_output", None)
        args = call_args(args, kwargs, module)
        if args and isinstance(args[0], Tensor) and self.note(args[0]) == "record":
            self.record(args[0], output if own is None else own, self.probe._rule)


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
        batch_size: the number of examples expected over the backward passes read together; a parameter
            with another count is moved to :attr:`uncovered`. ``None``: the most common count among the
            parameters.
        batch_dims: glob patterns of hooked module names -> the dimension of the module's input that holds
            the batch (``None``: it has none, the module is left out), declared instead of found (see
            below); the first matching pattern applies. E.g. ``{"*": 0}`` when every hooked input is
            batch-first, ``{"pos_emb": None}``.
        max_fused_bytes: memory cap of the per-example gradients a layer holds at once (``"auto"``).
        verify: check, for every covered parameter, that the hooked modules account for its whole
            gradient (two random projections of both, compared when the norms are read; one small host
            sync). A parameter also used outside its module (``x @ emb.weight.T``) is then moved to
            :attr:`uncovered` instead of being silently wrong.

    **Which dimension holds the batch.** Shapes alone cannot tell it: a sequence-first input ``[T, B, d]``
    with ``T == B``, or positions ``[T, d]`` broadcast over a batch of ``B == T`` examples, look like
    batch-first inputs. So the probe finds it by scaling: the first time it meets a hooked module's input
    shape, at the end of the outermost forward call that ran the module (an *entry*: the model, or a
    submodule the training step calls itself), it runs that call again without gradients on a slice of 2
    examples of its arguments (1 for a batch of 2; tensors whose dimension 0 is the batch size, the
    first tensor argument's dimension 0), with the other hooks silenced, the buffers restored, the
    random states forked (torch's, numpy's, Python's, and the generators the modules own), the modules' other
    attributes put back afterwards (an auxiliary loss the forward keeps, a list or deque it appends to, a
    metric's counts, a memory bank updated in place) and, when the call is the LightningModule's own
    (Lightning's DDP and FSDP wrappers run ``training_step`` that way), its ``self.log`` silenced, and reads
    which input dimension followed the batch size. That dimension is the
    batch (moved to the front for the handler); an input that does not change has no batch dimension
    (positions broadcast over the batch), one where several dimensions change cannot be split per example: such a
    module's parameters go to :attr:`uncovered` with the reason. One where the batch is folded with other positions
    (``[B * T, d]``) is split per example if its rows are example-major. Every dimension found is then checked against
    the examples themselves: three more runs of the call on the whole batch, in eval mode (in its order, rolled by
    one, reversed), whose rows must move with their examples (:meth:`_check_layouts`: a size that follows the batch's
    by coincidence, as an expert's routed tokens, is left out; a fold only if its rows are shown to follow), and one
    more on the first examples alone, whose rows at each module's input and at the call's output must be those they
    have in the whole batch (:meth:`_check_independence`: examples coupled by something other than a BatchNorm
    module, such as functional batch norm, leave the modules feeding the coupling out). The result is kept per module and input shape,
    so the extra small forward runs once per new shape. A model that fails on the slice (one that
    requires a fixed batch size) leaves the modules of that call uncovered, with the reason;
    ``batch_dims`` declares them instead. With the batch's size known (below), the other dimensions of that size
    are tried first (a sequence-first model with fixed-length positions fails on a slice of its time steps). When
    the entry's own input is sequence-first, dimension 0 of its first tensor argument is not the batch. With the
    batch's size known (:attr:`entry_batch_size`, set by the noise-scale monitor from each micro-batch): if dimension 0 has another size, or the call's output
    stays as it is on the slice, the run is repeated slicing each other dimension of that argument of the
    batch's size, and the one the output follows is the batch; if none is and dimension 0 has another size,
    the call's modules are left out with that reason. An output sequence-first too, with ``T == B``, cannot
    be told from a batch-first one, nor, without the batch's size, a sequence-first input from a
    batch-first model whose output does not follow its batch: declare ``batch_dims``.

    **Forward hooks that replace a module's output** (quantization-aware training's activation fake-quantizer,
    a user hook): the probe keeps the module's own output in a hook that runs first, and reads its gradient, through
    them, in a hook that runs after them (so a tensor hook they put on that output, scaling its gradient, counts).

    **Activation checkpointing.** ``torch.utils.checkpoint`` with ``use_reentrant=False`` recomputes a
    segment's forward during the backward to refill saved tensors: those recomputed calls are recognised
    and not counted (the forward's hooks stand); with ``use_reentrant=True`` the forward runs without
    gradients and the recomputation is where the gradients flow: the uses are recorded there. Both are
    exact.

    **Sparse gradients** (``nn.Embedding(sparse=True)``): the embedding's per-example norms come from
    its dense output gradient as usual, and the verification projects the sparse weight gradient
    directly.

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
        batch_dims: Optional[Mapping[str, Optional[int]]] = None,
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
        #: the number of examples in the batch of the model's next call (``None``: unknown): a model call whose first
        #: tensor argument does not hold them along dimension 0 (a sequence-first input) is then looked through
        self.entry_batch_size: Optional[int] = None
        self.max_fused_bytes = max_fused_bytes
        self.verify = bool(verify)
        if batch_dims is not None and not all(
            isinstance(k, str) and (v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0))
            for k, v in dict(batch_dims).items()
        ):
            raise ValueError(
                "`batch_dims` must map module name patterns to a dimension >= 0 or None, got "
                f"{dict(batch_dims)!r}."
            )
        self.batch_dims = dict(batch_dims or {})
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
        fallback: dict[int, str] = {}  # why a parameter of a module that is not hooked is left out
        # each module once, under its first name: a module reachable under a second name (`self.net =
        # nn.Sequential(self.backbone, self.head)`) hooked under each had every call counted twice, the batch
        # gradient's check failed, and every parameter of such a module was left out
        for mname, mod in self.module.named_modules():
            handler = handler_for(mod)
            own = [(ln, p) for ln, p in mod.named_parameters(recurse=False) if p.requires_grad]
            if not own:
                if (isinstance(mod, _OPAQUE) and handler is not None and handler.unsupported(mod) is None
                        and (include is None or include(mname, mod))):
                    # its own parameters frozen (GradES): its forward is still patched, to call its trainable layers
                    self._modules[mname] = (mod, handler, [])
                continue
            if include is not None and not include(mname, mod):
                for _, p in own:
                    fallback.setdefault(id(p), "left out by the probe's `include`")
                continue
            # a container whose forward the probe patches calls its layers (nn.MultiheadAttention's handler)
            container = next((pre for pre in opaque_prefixes if mname.startswith(pre) and pre[:-1] not in self._modules),
                             None)
            if container is not None:
                outer = type(self.module.get_submodule(container[:-1])).__name__
                for _, p in own:
                    fallback.setdefault(id(p), f"inside {outer}, which uses its parameters without calling "
                                               f"this {type(mod).__name__}")
                continue
            if handler is None:
                for _, p in own:
                    fallback.setdefault(id(p), _unhandled(mod))
                continue
            reason = handler.unsupported(mod)
            if reason is not None:
                for ln, p in own:
                    self.reasons.setdefault(trainable[id(p)], f"{type(mod).__name__}: {reason}")
                continue
            computed = handler.param_names(mod)
            left: dict[str, str] = {}
            for ln, p in own:
                if p.is_complex():
                    left[ln] = (f"{type(mod).__name__}.{ln} is complex ({p.dtype}): the per-example rules here are for "
                                "real parameters")
                elif (computed is not None and ln not in computed and ln.endswith("_orig")
                      and isinstance(getattr(mod, ln[: -len("_orig")] + "_mask", None), Tensor)):
                    left[ln] = _pruned_reason(type(mod).__name__, ln[: -len("_orig")])
                elif computed is not None and ln not in computed:  # a subclass's own (LoRA adapters, weight_norm's g / v)
                    left[ln] = (f"{type(mod).__name__}.{ln} is not computed by the handler of its module type, which "
                                f"computes {' and '.join(computed)} only: a parameter the layer holds besides them "
                                "(LoRA adapters, weight_norm's weight_g / weight_v) has no per-example rule here")
                elif ln == "weight" and isinstance(getattr(mod, "weight_fake_quant", None), nn.Module):
                    left[ln] = (f"{type(mod).__name__} fake-quantizes its weight (quantization-aware training): the "
                                "straight-through gradient is masked where the weight leaves the quantization range, "
                                "which the per-example rule of its base class does not follow")
            for ln, p in own:
                if ln in left:
                    self.reasons.setdefault(trainable[id(p)], left[ln])
            own = [(ln, p) for ln, p in own if ln not in left]
            if not own:
                continue
            self._modules[mname] = (mod, handler, [(ln, id(p)) for ln, p in own])
            covered.update(id(p) for _, p in own)
        uncovered_ids = [pid for pid in trainable if pid not in covered]
        for pid in uncovered_ids:
            self.reasons.setdefault(trainable[pid], fallback.get(pid, "used outside its module"))
        # a parameter tied into an unsupported module is uncovered as a whole
        self._covered_ids = [pid for pid in trainable if pid in covered and trainable[pid] not in self.reasons]
        self._names = trainable
        self._not_reached: list[str] = []
        self._static_uncovered = [trainable[pid] for pid in trainable if pid not in self._covered_ids]
        # (module name, input shape) -> the input dimension holding the batch, or why there is none
        self._bdims: dict[tuple[str, tuple[int, ...]], Union[int, _Folded, str]] = {}
        # per module and input shape, the batch dimension and the rows' prints the layout check keeps (_check_layouts)
        self._dry_inputs: Optional[dict[str, dict[tuple[int, ...], tuple[int, list[Tensor]]]]] = None
        self._said_lost: set[str] = set()  # large attributes the batch-size run wrote in place (said once)
        self._dry: Optional[list[tuple[str, tuple[int, ...]]]] = None  # calls seen by the batch-size run
        self._depth = 0  # nesting of entry calls now running
        self._entries: Optional[tuple[tuple[str, ...], list[nn.Module]]] = None  # modules holding hooked ones
        self._entry: Optional[tuple[nn.Module, tuple[Any, ...], dict[str, Any]]] = None
        self._calls: list[tuple[str, tuple[int, ...]]] = []  # hooked calls of the running entry
        # parameters upstream of a BatchNorm that normalised with its batch's statistics -> that BatchNorm's name: the
        # statistics couple the examples, so their per-example gradients are not separable (found on the autograd
        # graph from the BatchNorm's input, once per BatchNorm)
        self._coupled: dict[int, str] = {}
        self._coupling_walked: set[int] = set()
        self._reset_state()

    # -------------------------------------------------------------- bookkeeping
    def _reset_state(self) -> None:
        self._records: dict[int, list[Tensor]] = defaultdict(list)
        self._outstanding: dict[int, int] = defaultdict(int)
        self._pending: dict[int, Tensor] = {}
        self._fp_mod: dict[int, Tensor] = {}
        self._fp_total: dict[int, Tensor] = {}
        self._verified = True
        self._rounding: dict[int, float] = {}  # per parameter: the coarsest machine epsilon of its gradients' dtypes
        self._fwd_uses: dict[str, int] = defaultdict(int)  # uses recorded in forward, per module
        self._recomputed: dict[str, int] = defaultdict(int)  # of those, recomputed by checkpointing
        self._refused: dict[str, str] = {}  # modules whose input their handler did not take, and why

    def _never_called(self, owner: str) -> str:
        """Why a parameter with a gradient whose module never ran is left out: another module's code reads it
        directly (Hugging Face's MambaMixer uses its ``conv1d`` and ``dt_proj`` weights in its own forward)."""
        parent = owner.rpartition(".")[0]
        holder = self.module.get_submodule(parent) if owner else None
        by = ("the model's own code" if holder is None else
              f"the forward of `{parent or type(self.module).__name__}` ({type(holder).__name__})")
        return (f"has a gradient, but its module was never called: its parameters are used directly, most likely by "
                f"{by}, which the per-example rule of its module type does not follow")

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
        self._check_registrations()
        covered = set(self._covered_ids)
        hooked: list[str] = []
        for mname, (mod, handler, params) in self._modules.items():
            todo = [(ln, pid) for ln, pid in params if pid in covered]
            if not todo and (params or not isinstance(mod, _OPAQUE)):
                continue
            hooked.append(mname)
            uses = _Uses(self, mname, mod, handler, todo)
            # eager under torch.compile, as the hooks (see _Uses.forward_hook)
            forward = handler.patch_forward(mod, uses, self._rule)
            if forward is not None:
                mod.forward = torch.compiler.disable(forward)  # type: ignore[method-assign]
                self._patched.append(mod)
            else:
                self._handles.append(mod.register_forward_hook(uses.own_output_hook, prepend=True))
                self._handles.append(mod.register_forward_hook(uses.forward_hook, with_kwargs=True))
        # entry hooks on every module holding a hooked one (registered after the hooks above, so that a
        # hooked module called as an entry has noted its call before its entry hook ends)
        key = tuple(hooked)
        if self._entries is None or self._entries[0] != key:
            holders = {""}
            for h in hooked:
                parts = h.split(".")
                holders.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            self._entries = (key, [m for n, m in self.module.named_modules() if n in holders])
        for mod in self._entries[1]:
            self._handles.append(mod.register_forward_pre_hook(self._entry_pre, with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._entry_post, with_kwargs=True, always_call=True))
        if self.verify:
            for pid in self._covered_ids:
                self._handles.append(self._params[pid].register_hook(self._make_leaf_hook(pid)))
        for mod in self.module.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and id(mod) not in self._coupling_walked:
                self._handles.append(mod.register_forward_pre_hook(self._coupling_hook))
        self._depth, self._entry, self._calls = 0, None, []
        self._active = True

    def _check_registrations(self) -> None:
        """Leave out each covered parameter that its module no longer holds under its name: pruned since the probe was
        built (``torch.nn.utils.prune`` moves ``weight`` to ``weight_orig`` and computes ``weight`` before each forward,
        Lightning's ``ModelPruning`` at an epoch's end), or moved by a parametrization registered since. The layer then
        computes with another tensor than the parameter, and its per-example rule would measure that tensor's gradient.
        A dictionary lookup per covered parameter, at each arming."""
        for mod, _, params in self._modules.values():
            held = mod._parameters
            for ln, pid in params:
                if held.get(ln) is self._params[pid] or self._names[pid] in self.reasons:
                    continue
                if held.get(ln + "_orig") is self._params[pid]:
                    reason = _pruned_reason(type(mod).__name__, ln)
                else:
                    reason = (f"{type(mod).__name__}.{ln} is no longer the parameter its module holds under that name "
                              "(a parametrization registered since the probe was built): the layer computes with "
                              "another tensor, whose gradient its per-example rule would measure")
                self._leave_out([(ln, pid)], reason)

    def detach(self) -> None:
        """Remove every hook (idempotent); the norms recorded so far stay readable."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for mod in self._patched:
            mod.__dict__.pop("forward", None)
        self._patched.clear()
        self._depth, self._entry, self._calls, self._nested = 0, None, [], []
        self._entry_forward = None
        self._active = False

    # -------------------------------------------------------------- batch dimension
    def _declared(self, name: str) -> Optional[tuple[Optional[int]]]:
        """``(dim,)`` declared for module ``name`` by ``batch_dims``, or ``None`` if none is."""
        for pattern, dim in self.batch_dims.items():
            if fnmatch.fnmatchcase(name, pattern):
                return (dim,)
        return None

    def _note_call(self, uses: _Uses, x: Tensor) -> str:
        """See :meth:`_Uses.note`."""
        if self._dry is None and in_dry_run():
            return "skip"  # another monitor's run of the model for its own purposes (the guard's replay of a batch)
        if self._dry is not None:
            self._dry.append((uses.name, tuple(x.shape)))
            kept = self._dry_inputs
            spec = kept.get(uses.name, {}).get(tuple(x.shape)) if kept is not None else None
            if spec is not None:
                spec[1].append(_row_prints(x, spec[0]))
            return "dry"
        if in_backward():
            # activation checkpointing: without reentrance it recomputes uses already recorded in the
            # forward (their gradient hooks stand); with it, the forward ran without gradients and this
            # is the use whose backward comes
            if self._recomputed[uses.name] < self._fwd_uses[uses.name]:
                self._recomputed[uses.name] += 1
                return "replay"
            return "record" if torch.is_grad_enabled() else "skip"
        self._calls.append((uses.name, tuple(x.shape)))
        return "record" if torch.is_grad_enabled() else "skip"

    @torch.compiler.disable
    def _coupling_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """A BatchNorm about to normalise with its batch's statistics (training mode, or no running statistics): every
        parameter its input depends on is coupled across the examples (walked once per BatchNorm)."""
        if (self._dry is not None or in_backward() or not torch.is_grad_enabled()
                or id(module) in self._coupling_walked):
            return
        if module.training is False and module.track_running_stats:  # type: ignore[union-attr]
            return  # eval mode with running statistics: each example is normalised on its own
        x = args[0] if args and isinstance(args[0], Tensor) else None
        if x is None or x.grad_fn is None:
            return
        self._coupling_walked.add(id(module))
        name = next((n for n, m in self.module.named_modules() if m is module), type(module).__name__)
        seen: set[Any] = set()
        stack = [x.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            var = getattr(node, "variable", None)
            if isinstance(var, Tensor):
                self._coupled.setdefault(id(var), name)
            stack.extend(nxt for nxt, _ in node.next_functions)
        for pid in self._covered_ids:
            pname = self._names[pid]
            if pid in self._coupled and pname not in self._not_reached:
                self._not_reached.append(pname)
                self.reasons[pname] = (
                    f"it feeds {self._coupled[pid]!r}, a BatchNorm normalising with its batch's statistics: they couple "
                    "the examples, so an example's gradient here is not that of its own loss (the per-example "
                    "contributions are not separable); `method='accumulation'` measures such a model")

    @torch.compiler.disable
    def _entry_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._dry is not None or in_backward() or in_dry_run():
            return
        self._depth += 1
        if self._depth == 1:
            self._entry, self._calls, self._nested = (module, args, kwargs), [], []
            # Lightning's DDP / FSDP wrappers call the LightningModule with its `forward` patched, for this
            # one call, to run `training_step` (the patch restores `forward` as it starts): keep the forward
            # this call used, so that the dry run on a slice runs the same code
            self._entry_forward = module.__dict__.get("forward")

    @torch.compiler.disable
    def _entry_post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self._dry is not None or in_backward() or in_dry_run() or self._depth == 0:
            return
        self._depth -= 1
        if self._depth > 0 and self._entry is not None and sys.exc_info()[0] is None:
            # a call nested in the running entry is over: kept, in case a backward comes before the entry ends (under
            # DDP with manual optimization the entry is the LightningModule's call running `training_step`, whose
            # `manual_backward` runs inside it): its batch dimensions are then found on it (see _batch_dim)
            self._nested.append((module, args, kwargs, output))  # nothing read now: the common backward needs none
            return
        if self._depth == 0:
            # the nested calls serve a backward inside the entry only: held on, they kept the last probed step's
            # inputs and outputs of every hooked module, with their graphs, until the next probed step
            self._nested = []
        if self._depth > 0 or self._entry is None:
            return
        entry, calls, self._entry, self._calls = self._entry, self._calls, None, []
        if sys.exc_info()[0] is not None:  # the forward raised: nothing to resolve
            return
        todo = sorted({c for c in calls if c not in self._bdims and self._declared(c[0]) is None})
        if todo:
            self._resolve_batch_dims(entry, calls, todo, _shapes(output))

    def _resolve_batch_dims(self, entry: tuple[nn.Module, tuple[Any, ...], dict[str, Any]],
                            calls: list[tuple[str, tuple[int, ...]]], todo: list[tuple[str, tuple[int, ...]]],
                            output: list[tuple[int, ...]]) -> None:
        """Find the batch dimension of each ``(module, input shape)`` in ``todo`` by running the entry call
        again on a slice of its batch (see the class docstring); ``output``: the shapes of the call's output."""
        first = _first_tensor(*entry[1:])
        if first is None:
            for key in todo:
                self._bdims[key] = "its batch dimension is unknown: the model's call has no tensor argument"
            return
        batch = int(first.shape[0])
        small = 1 if batch == 2 else 2
        slice_dim = 0
        dry, error, out = self._dry_run(entry, batch, small, 0)
        # With the batch's size known (``entry_batch_size``, which the noise-scale monitor sets from each micro-batch):
        # dimension 0 of the first argument is not the batch if its size is another, or if the call's output stays
        # as it is when it is sliced (a sequence-first input [T, B, ...], T == B or not). The run is then repeated
        # slicing each other dimension of that argument of the batch's size, and the one the output follows is the
        # batch; if none is and dimension 0 has another size, the call's modules are left out with that reason.
        # Unknown, dimension 0 is the batch: a batch-first model whose output does not follow its batch (a
        # per-position loss averaged over the batch, a pooled vector) looks like a sequence-first one by shapes alone
        known = self.entry_batch_size
        # a model that failed on the slice of dimension 0 may hold the batch elsewhere (a sequence-first model with a
        # fixed-length parameter fails when its sequence is sliced): the other dimensions are tried as well
        if known is not None and (error is not None or batch != known or (out == output and any(output))):
            for k in [k for k in range(1, first.dim()) if first.shape[k] == known]:
                tried = self._dry_run(entry, known, 1 if known == 2 else 2, k)
                if tried[1] is None and tried[2] != output:
                    batch, small, slice_dim, (dry, error, out) = known, 1 if known == 2 else 2, k, tried
                    break
            else:
                if batch != known:
                    for key in todo:
                        self._bdims[key] = (
                            f"its batch dimension could not be found: the model call's first tensor argument "
                            f"{tuple(first.shape)} holds the batch's {known} examples along no dimension its output "
                            "follows (a sequence-first input?); declare it with `batch_dims`"
                        )
                    return
        full: dict[str, list[tuple[int, ...]]] = defaultdict(list)
        part: dict[str, list[tuple[int, ...]]] = defaultdict(list)
        for name, shape in calls:
            full[name].append(shape)
        for name, shape in dry:
            part[name].append(shape)
        if error is None and any(len(full[name]) != len(part[name]) for name, _ in todo):
            # a module called as often as in the real forward only when both draw the same random layer skips (LayerDrop:
            # BART's, wav2vec2's layers are skipped at random in training mode): in eval mode nothing is skipped, so a
            # layer the real forward called runs as often there. Its calls on the slice in eval mode are compared
            # instead (a module that runs a different number of times in eval mode too stays left out)
            redo, redo_error, _ = self._dry_run(entry, batch, small, slice_dim, eval_mode=True)
            if redo_error is None:
                again: dict[str, list[tuple[int, ...]]] = defaultdict(list)
                for name, shape in redo:
                    again[name].append(shape)
                for name in {name for name, _ in todo if len(full[name]) != len(part[name])}:
                    if len(again[name]) == len(full[name]):
                        part[name] = again[name]
        for name, shape in todo:
            if error is not None:
                why = f"{type(error).__name__}: {str(error)[:120]}"
                self._bdims[(name, shape)] = (
                    f"its batch dimension could not be found: the model failed on a {small}-example slice of "
                    f"the batch ({why}); declare it with `batch_dims`"
                )
                continue
            if len(full[name]) != len(part[name]):
                self._bdims[(name, shape)] = (
                    "its batch dimension could not be found: it runs a different number of times on a "
                    "smaller batch; declare it with `batch_dims`"
                )
                continue
            found = {_scaling_dim(a, b, batch, small) for a, b in zip(full[name], part[name]) if a == shape}
            self._bdims[(name, shape)] = found.pop() if len(found) == 1 else (
                f"calls on inputs of shape {shape} disagree on the batch dimension"
            )
        found = {key: self._bdims[key] for key in todo if isinstance(self._bdims.get(key), (int, _Folded))}
        if found and batch > 1:
            self._check_layouts(entry, batch, slice_dim, found, calls)

    def _check_layouts(self, entry: tuple[nn.Module, tuple[Any, ...], dict[str, Any]], batch: int, dim: int,
                       found: dict[tuple[str, tuple[int, ...]], Union[int, _Folded]],
                       calls: Optional[list[tuple[str, tuple[int, ...]]]] = None) -> None:
        """Check the batch dimensions found by scaling against the examples themselves: the entry call is run again
        without gradients on the whole batch, in eval mode (no dropout), in its own order and in others (rolled by
        one, reversed), and each module's rows along its batch dimension must move with their examples. A size that
        follows the batch's by coincidence (a mixture-of-experts' expert given as many routed tokens as there are
        examples; padded rows selected with a mask, as many on average) took other rows for the examples, silently.
        A folded dimension is kept only where the rows are shown to follow (a position-major fold, or rows not split
        evenly among the examples, are left out); a plain one is left out only where they are shown not to (a module
        the eval-mode runs do not call keeps it)."""
        folds = {key: at if isinstance(at, _Folded) else _Folded(at, 1) for key, at in found.items()}
        runs = []
        outputs: list[tuple[Tensor, int]] = []  # the prints of the output's rows (and their length), in the batch's order
        for order in [list(range(batch))] + _orders(batch):
            inputs: dict[str, dict[tuple[int, ...], tuple[int, list[Tensor]]]] = defaultdict(dict)
            for (name, shape), fold in folds.items():
                inputs[name][shape] = (fold.dim, [])
            _, error, _ = self._dry_run(entry, batch, batch, dim, order=order, inputs=inputs,
                                        outputs=None if runs else outputs)
            if error is not None:
                break
            runs.append((order, inputs))
        for (name, shape), at in found.items():
            fold = folds[(name, shape)]
            verdicts: list[Optional[bool]] = []
            if len(runs) == 1 + len(_orders(batch)):
                first = runs[0][1][name][shape][1]
                for order, inputs in runs[1:]:
                    other = inputs[name][shape][1]
                    if first and len(first) == len(other):
                        verdicts += [_follows(a, b, 0, fold.per, batch, order) for a, b in zip(first, other)]
                    else:
                        verdicts.append(None)
            else:
                verdicts.append(None)
            if isinstance(at, _Folded) and not all(v is True for v in verdicts):
                self._bdims[(name, shape)] = (
                    f"the batch is folded into dimension {at.dim} of its input {shape} together with other "
                    "positions, and its rows could not be shown to follow their examples in order (reordering the "
                    "examples in eval mode did not reorder them the same way); declare it with `batch_dims` if it is "
                    "batch-first")
            elif not isinstance(at, _Folded) and False in verdicts:
                self._bdims[(name, shape)] = (
                    f"dimension {at} of its input {shape} changes with the batch size, but its rows do not follow the "
                    "examples (reordering the examples in eval mode did not reorder them the same way: rows taken from "
                    "the batch otherwise, such as the tokens routed to an expert)")
        # the modules whose rows follow their examples: are those rows the examples' own?
        kept = {key: fold for key, fold in folds.items() if isinstance(self._bdims.get(key), (int, _Folded))}
        if runs and calls is not None and kept:
            self._check_independence(entry, batch, dim, kept, runs[0][1], outputs, calls)

    def _check_independence(self, entry: tuple[nn.Module, tuple[Any, ...], dict[str, Any]], batch: int, dim: int,
                            folds: dict[tuple[str, tuple[int, ...]], _Folded],
                            whole: dict[str, dict[tuple[int, ...], tuple[int, list[Tensor]]]],
                            outputs: list[tuple[Tensor, int]],
                            calls: list[tuple[str, tuple[int, ...]]]) -> None:
        """Check that each example is computed on its own: the first examples run alone (eval mode, no gradients) must
        give the rows they have in the whole batch, at every hooked module's input and at the call's output. Where they
        do not, something couples the examples (a batch statistic outside a BatchNorm module: functional batch norm, a
        batch-centred activation, an in-batch term), and an example's per-example gradient is not that of its own loss
        for every parameter whose output reaches that coupling: every module the forward called before the last module
        whose input is coupled is left out (all of them when the output is coupled and no module's input is), as the
        modules feeding a BatchNorm are. (The per-example parts still add up to the batch gradient, so the probe's own
        check cannot see it.) Limits: a coupling that only training mode makes is not seen (the runs are in eval mode,
        where dropout does not differ), nor one in the loss outside the model's call (an in-batch contrastive loss),
        nor a second coupling after the last module whose input is coupled."""
        small = 2 if batch > 2 else 1
        # each module's input shape on the slice: its batch dimension holds the slice's rows
        sliced = {key: key[1][:fold.dim] + (small * fold.per,) + key[1][fold.dim + 1:] for key, fold in folds.items()}
        inputs: dict[str, dict[tuple[int, ...], tuple[int, list[Tensor]]]] = defaultdict(dict)
        for (name, shape), fold in folds.items():
            inputs[name][sliced[(name, shape)]] = (fold.dim, [])
        alone: list[tuple[Tensor, int]] = []
        _, error, _ = self._dry_run(entry, batch, small, dim, order=list(range(small)), inputs=inputs, outputs=alone)
        if error is not None:
            return  # a model that cannot run a slice in eval mode: not judged
        loose = _low_precision(entry[0])
        coupled_at: Optional[str] = None
        last = -1
        for (name, shape), fold in folds.items():
            full = whole.get(name, {}).get(shape, (0, []))[1]
            part = inputs[name][sliced[(name, shape)]][1]
            if len(full) != len(part):
                continue
            if any(not _rows_close(b, a[:small * fold.per], loose) for a, b in zip(full, part)):
                at = max((i for i, call in enumerate(calls) if call[0] == name), default=-1)
                if at > last:
                    coupled_at, last = name, at
        if (coupled_at is None and len(outputs) == len(alone)
                and any(not _rows_close(b, a[:small], loose) for (a, wa), (b, wb) in zip(outputs, alone)
                        if a.shape[0] == batch and b.shape[0] == small and wa == wb)):
            # the output is coupled while no module's input is: the coupling comes after the last module (an output
            # that follows a coupled input says nothing more: a second coupling after that module is not told apart)
            coupled_at, last = "the model's output", len(calls)
        if coupled_at is None:
            return
        where = coupled_at if coupled_at == "the model's output" else f"{coupled_at!r}'s input"
        reason = (f"the examples are coupled before {where} (the first examples run alone, in eval mode, give other rows "
                  "there than in the whole batch: a batch statistic outside a BatchNorm module, such as functional "
                  "batch norm or a batch-centred activation), so an example's gradient here is not that of its own "
                  "loss (the per-example contributions are not separable); `method='accumulation'` measures such a "
                  "model")
        for name in dict.fromkeys(n for n, _ in calls[:last]):
            held = self._modules.get(name)
            if held is not None:
                self._leave_out(held[2], reason)

    def _resolve_inside_entry(self, name: str, shape: tuple[int, ...]) -> Union[int, str, None]:
        """A backward inside the running entry call reached a use whose batch dimension is not known yet: found on the
        latest call nested in the entry that is over and called the module with that shape (its hooked calls: those
        the entry recorded while it ran), as :meth:`_entry_post` finds it on the entry."""
        modules = dict(self.module.named_modules())
        for module, args, kwargs, output in reversed(self.__dict__.get("_nested", [])):
            prefix = next((n for n, m in modules.items() if m is module), None)
            if prefix is None:
                continue
            inside = [c for c in self._calls if prefix == "" or c[0] == prefix or c[0].startswith(prefix + ".")]
            if (name, shape) not in inside:
                continue
            todo = sorted({c for c in inside if c not in self._bdims and self._declared(c[0]) is None})
            if todo:
                root_forward, self._entry_forward = self.__dict__.get("_entry_forward"), None  # the call's own forward
                try:
                    self._resolve_batch_dims((module, args, kwargs), inside, todo, _shapes(output))
                finally:
                    self._entry_forward = root_forward
            return self._bdims.get((name, shape))
        return None

    def _dry_run(self, entry: tuple[nn.Module, tuple[Any, ...], dict[str, Any]], batch: int, small: int,
                 dim: int, order: Optional[list[int]] = None,
                 inputs: Optional[dict[str, dict[tuple[int, ...], tuple[int, list[Tensor]]]]] = None,
                 eval_mode: bool = False, outputs: Optional[list[tuple[Tensor, int]]] = None,
                 ) -> tuple[list[tuple[str, tuple[int, ...]]], Optional[BaseException], list[tuple[int, ...]]]:
        """Run the entry call without gradients on ``small`` examples of its batch (``batch`` along dimension ``dim``
        of its tensors), leaving no trace; returns the hooked calls it made, its error (if it failed) and the shapes
        of its output. With ``order``: on the examples of those indices, every module in eval mode, and the prints of
        the rows of the hooked modules' inputs named in ``inputs`` (module -> input shape -> batch dimension, prints)
        added to it. ``eval_mode``: every module in eval mode (else as the real forward runs them). ``outputs``: where
        given, the prints of the rows along ``dim`` of the output's tensors (with the rows' length) are appended to it."""
        module, args, kwargs = entry
        attributes = module_attributes(module)
        dry: list[tuple[str, tuple[int, ...]]] = []
        out: list[tuple[int, ...]] = []
        # the run works on copies of the buffers (BatchNorm statistics stay as they are: the real ones are
        # saved for the backward, and must keep their version)
        buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
        devices = sorted({p.device for p in module.parameters()}, key=str)
        error: Optional[BaseException] = None
        self._dry = dry
        used = getattr(self, "_entry_forward", None)
        missing = object()
        now = module.__dict__.get("forward", missing)
        swap = used is not None and now is not used
        states = host_random_states()
        modes = [(m, m.training) for m in module.modules()] if order is not None or eval_mode else []
        # without gradients, in eval mode, nn.MultiheadAttention and nn.TransformerEncoderLayer take a fused fast path
        # that calls none of their hooked projections: the run would miss the calls the real forward makes
        fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        params = plain_parameters(module)
        versions = [p._version for p in params]
        # a model that writes into its weights in a forward (RWKV rescales some on entering eval mode): the writes run,
        # and are undone after the run; where torch cannot set a version back, they are refused
        writes: Any = WritesUndone(params) if versions_settable() else ParametersReadOnly(params)
        try:
            for m, _ in modes:
                m.training = False
            self._dry_inputs = inputs
            if swap:
                module.forward = used  # type: ignore[method-assign]
            if isinstance(module, pl.LightningModule):
                # under DDP / FSDP the entry is the LightningModule running `training_step`: what it logs on the
                # slice is not the step's (the slice's loss would replace the logged one)
                module.log = module.log_dict = _no_log  # type: ignore[method-assign]
            with torch.no_grad(), fork_rng_of(devices), warnings.catch_warnings(), dry_run():
                warnings.simplefilter("ignore")  # the model's warnings belong to its real calls
                sliced = _resize_batch(args, batch, small, dim, order), _resize_batch(kwargs, batch, small, dim, order)
                with writes:
                    result = functional_call(module, buffers, *sliced, strict=False)
                    out = _shapes(result)
                    if outputs is not None:  # each row's print, with the row's length (a model may trim its padding)
                        outputs.extend((_row_prints(t, dim), t.numel() // max(t.shape[dim], 1))
                                       for t in _tensors(result) if t.dim() > dim and t.is_floating_point())
        except Exception as err:  # the model may require its batch size: the modules stay unresolved
            error = err
        finally:
            # the run's writes into parameters are undone (values and versions), failed or not; without a way to set a
            # version back they were refused instead
            undone = writes.undo() if isinstance(writes, WritesUndone) else True
            if not (_versions_put_back(params, versions) and undone) and error is None:
                error = ParameterWrite("a write into a parameter during the run on a slice changed its version")
            self._dry, self._dry_inputs = None, None
            torch.backends.mha.set_fastpath_enabled(fastpath)
            for m, mode in modes:
                m.training = mode
            if swap:
                if now is missing:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = now  # type: ignore[method-assign]
            lost = restore_attributes(attributes)
            set_host_random_states(states)
            for name in lost:
                if name not in self._said_lost:
                    self._said_lost.add(name)
                    warnings.warn(
                        f"PerExampleGradNorms: its run of the model on a slice of the batch (to find the batch "
                        f"dimension) wrote into the large tensor attribute {name} in place, which it does not copy: "
                        "that write stays. Declare the batch dimensions with `batch_dims=` to skip that run.",
                        stacklevel=2,
                    )
        return dry, error, out

    def _batch_dim(self, use: _Use) -> Union[int, _Folded, str]:
        """The input dimension holding the batch for this use (folded with other positions: :class:`_Folded`), or why
        it is not known."""
        declared = self._declared(use.uses.name)
        if declared is not None:
            dim = declared[0]
            if dim is None:
                return "declared without a batch dimension (`batch_dims`)"
            mapped = use.uses.handler.declared_dim(use.uses.module, dim)
            if mapped != dim:  # a patched forward reorders the input (a sequence-first RNN's): said in the user's frame
                limit = use.uses.handler.batch_dims(use.uses.module, use.ctx) if isinstance(use.ctx, Tensor) else 1
                if mapped >= limit:
                    return (f"the batch is declared along dimension {dim} of its input (`batch_dims`), which is one of "
                            f"the {type(use.uses.module).__name__}'s own dimensions")
            dim = mapped
        else:
            found = self._bdims.get((use.uses.name, use.shape))
            if found is None and self._depth > 0:
                found = self._resolve_inside_entry(use.uses.name, use.shape)
            if found is None:
                return "its batch dimension is unknown: the module ran outside a forward call of the model"
            if isinstance(found, str):
                return found
            if isinstance(found, _Folded):
                ctx = use.ctx
                folded = f"the batch is folded into dimension {found.dim} of its input {use.shape}"
                if not isinstance(ctx, Tensor) or ctx.shape[found.dim] % found.per:
                    return f"{folded}, which its handler cannot unfold"
                unfolded = ctx.movedim(found.dim, 0).unflatten(0, (-1, found.per))
                if use.uses.handler.batch_dims(use.uses.module, unfolded) < 2:
                    return (f"{folded} together with other positions, and a {type(use.uses.module).__name__} takes one "
                            "batch dimension")
                return found
            dim = found
        limit = use.uses.handler.batch_dims(use.uses.module, use.ctx) if isinstance(use.ctx, Tensor) else 1
        if dim >= limit:
            return (
                f"the batch lies along dimension {dim} of its input {use.shape}, which is one of the "
                f"{type(use.uses.module).__name__}'s own dimensions"
            )
        return dim

    def _finish(self, use: _Use, grad: Tensor,
                results: Optional[tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]] = None) -> None:
        """The backward of one use: its per-example results, with the batch moved to dimension 0."""
        dim = self._batch_dim(use)
        if isinstance(dim, str):
            self._drop(use.uses.params, dim)
            return
        ctx, g = use.ctx, grad
        if self.verify:
            for _, pid in use.uses.params:
                self._rounding[pid] = max(self._rounding.get(pid, 0.0), _eps(grad.dtype))
        if isinstance(dim, _Folded):  # [.., B * per, ..] -> [B, per, ..]
            ctx = ctx.movedim(dim.dim, 0).unflatten(0, (-1, dim.per))
            g, results = g.movedim(dim.dim, 0).unflatten(0, (-1, dim.per)), None
        elif dim != 0:
            ctx, g, results = ctx.movedim(dim, 0), g.movedim(dim, 0), None
        if results is None:
            m, handler, rule = use.uses.module, use.uses.handler, use.rule
            results = (
                lambda: handler.sq_norms(m, ctx, g, rule),
                lambda: handler.grads(m, ctx, g),
                lambda uv: handler.project(m, ctx, g, uv),
            )
        self._consume(use.uses.params, int(g.shape[0]), *results)

    def _drop(self, params: list[tuple[str, int]], reason: str) -> None:
        """One use that cannot be split per example, counted already: its parameters go to :attr:`uncovered`."""
        for _, pid in params:
            self._outstanding[pid] -= 1
            self._pending.pop(pid, None)
        self._leave_out(params, reason)

    def _leave_out(self, params: list[tuple[str, int]], reason: str) -> None:
        """``params`` go to :attr:`uncovered` for the rest of the run, with ``reason`` (the first one said stays)."""
        for _, pid in params:
            name = self._names[pid]
            if name not in self._not_reached:
                self._not_reached.append(name)
                self.reasons[name] = reason

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
        shared = [pid for _, pid in params if self._outstanding[pid] > 1 or pid in self._pending]
        try:
            fps = proj_fn({ln: self._uv(pid) for ln, pid in params}) if self.verify else {}
            sqs = sq_fn() if len(shared) < len(params) else {}
            grads = grads_fn() if shared else {}
        except Exception as err:  # noqa: BLE001 - a handler's assumption broken by the module: left out, never fatal
            # e.g. a subclass with a forward of its own, fed something else than its base class takes
            self._drop(params, f"its handler failed on it ({type(err).__name__}: {err}): its module computes "
                               "otherwise than the handler assumes")
            return
        missing = [(ln, pid) for ln, pid in params
                   if ln not in (grads if pid in shared else sqs) or (self.verify and ln not in fps)]
        if missing:  # a handler that does not declare `param_names`, on a module holding parameters it does not know
            self._drop(missing, "its module's handler returned no per-example norm for it (a parameter the layer "
                                "holds besides those its handler computes)")
            params = [lp for lp in params if lp not in missing]
        if self.verify:
            self._verified = False
            for ln, pid in params:
                prev = self._fp_mod.get(pid)
                self._fp_mod[pid] = fps[ln] if prev is None else prev + fps[ln]
        scale = float(batch) ** 2 if self.loss_reduction == "mean" else 1.0
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

    def _settle(self, pids: Optional[list[int]] = None) -> None:
        """Finish the parameters (default: all) of modules called several times whose backward is over with uses
        still awaited: the output of such a call received no gradient (a target under stop-gradient, logits used for
        an argmax only), so it contributes nothing to the gradient, and the uses that did receive one make the
        per-example gradient. Called when the norms are read, and when such a module is used again with gradients;
        not at any new forward (two views encoded, then a backward each, with a forward without gradients between)."""
        for pid in list(self._pending) if pids is None else pids:
            self._records[pid].append(self._pending.pop(pid).flatten(1).pow(2).sum(1))
            self._outstanding[pid] = 0

    def _uv(self, pid: int) -> tuple[Tensor, Tensor]:
        """Two fixed random projections for parameter ``pid`` (rows and columns of its matrix view)."""
        uv = self._proj.get(pid)
        if uv is None:
            p = self._params[pid]
            rows = p.shape[0] if p.dim() else 1
            cols = p.numel() // max(rows, 1)
            gen = torch.Generator().manual_seed(len(self._proj) + 1)
            # fp32, as the projected gradients (whatever the default dtype: a float64 one made the product fail)
            u = torch.randn(2, rows, generator=gen, dtype=torch.float32).to(p.device)
            v = (torch.randn(2, cols, generator=gen, dtype=torch.float32).to(p.device) if p.dim() > 1
                 else torch.ones(2, 1, dtype=torch.float32, device=p.device))
            uv = self._proj[pid] = (u, v)
        return uv

    def _make_leaf_hook(self, pid: int) -> Callable[[Tensor], None]:
        def leaf_hook(grad: Tensor) -> None:
            with torch.no_grad():
                self._rounding[pid] = max(self._rounding.get(pid, 0.0), _eps(grad.dtype))
                fp = (_project_sparse if grad.is_sparse else project_matrix)(grad.detach(), *self._uv(pid))
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
        # relative mismatch, floored for gradients that are zero in exact arithmetic (rounding noise only). A
        # gradient computed in bf16 (bf16 weights, or autocast) is a sum over the batch's positions rounded to 8
        # bits: 1-5% of its size apart from the fp32 sum of the per-example parts, where a contribution the hooks
        # miss (a tied head's) is of the order of the gradient itself
        rel = torch.tensor([max(1e-2, _ROUNDING_ALLOWANCE * self._rounding.get(pid, 0.0)) for pid in pids],
                           device=diff.device, dtype=diff.dtype)
        bad = diff > rel * ref + 1e-5 * ref.max()
        for pid, flag in zip(pids, bad.tolist()):
            name = self._names[pid]
            if flag and name not in self._not_reached:
                self._not_reached.append(name)
                self.reasons[name] = (
                    "its gradient has contributions the hooks did not see (used outside its module, "
                    "e.g. x @ emb.weight.T, or its module computes otherwise than its handler assumes)"
                )

    # -------------------------------------------------------------- results
    def per_parameter(self) -> dict[str, Tensor]:
        """Per covered parameter name, the squared norm of each example's gradient (``Tensor[N]``, fp32,
        ``N`` examples over every backward pass since the last :meth:`reset`)."""
        if self._pending and not in_backward():
            self._settle()
        if self.verify and not self._verified and not self._pending:
            self._check_projections()
        out: dict[str, Tensor] = {}
        unused: list[str] = []  # covered, but no gradient reached them in these backward passes
        passes: dict[str, int] = {}  # the records of each parameter's module (one per backward through it)
        # a backward populated `.grad` (not `torch.autograd.grad` on chosen inputs, which leaves every `.grad` as it is)
        any_grad = any(self._params[pid].grad is not None for pid in self._covered_ids)
        for pid in self._covered_ids:
            name = self._names[pid]
            if name in self._not_reached:
                continue
            recs = self._records.get(pid)
            if not recs:
                p = self._params[pid]
                if p.grad is None:
                    unused.append(name)
                else:
                    # it has a gradient, but its module's forward never ran: used outside its module
                    self._not_reached.append(name)
                    owner = name.rpartition(".")[0]
                    self.reasons[name] = self._refused.get(owner, (
                        "has a gradient, but no output of its module received one: it is used outside its module"
                        if self._fwd_uses.get(owner) else self._never_called(owner)))
                continue
            if any_grad and self._params[pid].grad is None and self._params[pid].requires_grad:
                # its module ran and its output received a gradient, but the parameter got none: the module computed
                # with another tensor in its place (`torch.func.functional_call(module, {"weight": generated}, x)`,
                # a hypernetwork), whose gradient the hooks measured
                self._leave_out([(name, pid)], _SUBSTITUTED)
                continue
            if self._outstanding.get(pid, 0) or pid in self._pending:
                raise RuntimeError(
                    f"PerExampleGradNorms: the backward of {name!r} has not finished; read the norms after "
                    "loss.backward()."
                )
            out[name] = recs[0] if len(recs) == 1 else torch.cat(recs)
            passes[name] = len(recs)
        if out:
            sizes = [v.shape[0] for v in out.values()]
            expected = self.batch_size if self.batch_size is not None else max(set(sizes), key=lambda n: (sizes.count(n), n))
            for name in [n for n, v in out.items() if v.shape[0] != expected]:
                rows = out.pop(name).shape[0]
                if name not in self._not_reached and passes.get(name, 1) > 1 and rows == passes[name] * expected:
                    # the batch's examples once per pass: SAM's two forward and backward passes over one batch, a
                    # closure evaluated again
                    self._not_reached.append(name)
                    self.reasons[name] = (
                        f"its module ran {passes[name]} times over the batch's {expected} examples in the step (gave "
                        f"{rows} rows: several forward and backward passes, as SAM's two or a closure evaluated again), "
                        "so one pass's per-example gradients cannot be told from another's there"
                    )
                elif name not in self._not_reached:
                    self._not_reached.append(name)
                    self.reasons[name] = (
                        f"its module's input has no batch dimension of the batch's {expected} examples (it gave "
                        f"{rows} rows: positions broadcast over the batch, or a model call whose first "
                        "tensor argument holds the batch along another dimension than 0), so per-example gradients "
                        "are not separable there; declare it with `batch_dims` if it has one"
                    )
        if unused and (out or self.batch_size is not None):
            # no gradient at all (a pooler the classifier does not use): each example's is zero
            n = self.batch_size if self.batch_size is not None else next(iter(out.values())).shape[0]
            device = next(iter(out.values())).device if out else self._params[self._covered_ids[0]].device
            for name in unused:
                out[name] = torch.zeros(n, device=device, dtype=torch.float32)
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

"""Tensors that may be sharded: FSDP2 (``fully_shard``) keeps parameters and gradients as ``DTensor``s.

A ``DTensor`` holds one shard per rank; reductions over it (a norm, a finiteness test) are computed on the
local shard and combined across the ranks with one collective of a few numbers, never a gather of the
tensor. A shard replicated over some mesh dimensions is counted once: its local contribution is divided by
the number of ranks holding the same data. Plain tensors (DDP, one device) pass through unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_monitor._compat import foreach_norm

__all__ = ["check_strategy", "check_tensor_parallel", "full", "global_norm", "is_sharded", "local", "replication",
           "reshard", "fsdp_units", "squared_norms"]

try:  # torch >= 2.4: public
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = Replicate = None  # type: ignore[assignment,misc]


def is_sharded(t: Tensor) -> bool:
    """Whether ``t`` is a ``DTensor``."""
    return DTensor is not None and isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """The rank's own shard of a ``DTensor`` (a view: writing to it writes the ``DTensor``), else ``t``."""
    return t.to_local() if is_sharded(t) else t


@functools.lru_cache(maxsize=None)  # looked up per module by GradES's component search
def _fsdp_module_type() -> Optional[type]:
    try:  # torch >= 2.6: public
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch, or none with distributed
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def fsdp_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP2 (``fully_shard``) units among ``module`` and its submodules; none without FSDP2."""
    kind = _fsdp_module_type()
    return [] if kind is None else [m for m in module.modules() if isinstance(m, kind)]


def reshard(units: Iterable[torch.nn.Module]) -> None:
    """Register the sharded parameters again on FSDP2 units (:func:`fsdp_units`) that hold their gathered ones:
    FSDP's public ``reshard``, a no-op on a unit already sharded.

    FSDP2 swaps a unit's parameters for plain gathered tensors while they are in use and puts the ``DTensor``
    parameters back after the backward; a root unit keeps its gathered ones after a forward that no backward
    follows (a validation loop). Those receive no gradient (the reduce-scatter writes the ``DTensor``'s ``.grad``):
    read then, ``module.parameters()`` gives tensors that never get one. The next forward gathers them again."""
    for m in units:
        m.reshard()


def replication(t: Tensor) -> int:
    """How many ranks hold the same local shard of ``t`` (1 for a plain tensor)."""
    if not is_sharded(t):
        return 1
    mesh, count = t.device_mesh, 1
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            count *= mesh.size(dim)
    return count


def squared_norms(tensors: Sequence[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(plain, sharded)``: the summed squared fp32 norms of the plain tensors (the same on every rank) and
    this rank's part of the summed squared norms of the ``DTensor``s (summed over the ranks, it is their
    total); ``None`` for an empty part. On the device, no host sync."""
    plain: list[Tensor] = []
    shards: list[Tensor] = []
    if all(type(t) is Tensor for t in tensors):  # the common case, read at the cost of one type check each
        plain = list(tensors)
    else:
        for t in tensors:  # one pass (this runs every step)
            (shards if is_sharded(t) else plain).append(t)
    plain_sq = None
    if plain:
        # fp32, or fp64 where a tensor is (finite values beyond fp32's range stay finite)
        wide = torch.float64 if any(t.dtype == torch.float64 for t in plain) else torch.float32
        try:
            norms = torch.stack(foreach_norm(plain, 2.0, dtype=wide))
        except (NotImplementedError, RuntimeError):
            if not any(t.is_sparse for t in plain):
                raise
            # sparse gradients (nn.Embedding(sparse=True)), which the fused kernel does not take: the norm of the
            # coalesced values (duplicate indices summed). Checked only here: the common path reads no layout
            plain = [t.coalesce().values() if t.is_sparse else t for t in plain]
            norms = torch.stack(foreach_norm(plain, 2.0, dtype=wide))
        plain_sq = torch.dot(norms, norms)
    shard_sq = None
    by_count: dict[int, list[Tensor]] = {}
    for t in shards:
        by_count.setdefault(replication(t), []).append(local(t))
    for count, locals_ in by_count.items():  # a host float per group: no host-to-device copy
        part = torch.stack([n.reshape(()) for n in foreach_norm(locals_, 2.0, dtype=torch.float32)]).square().sum()
        part = part / count if count > 1 else part
        shard_sq = part if shard_sq is None else shard_sq + part
    return plain_sq, shard_sq


#: the scale :func:`nonfinite_on_host` multiplies by (read only): made once, not on every step
_ONE = torch.ones(1)


def nonfinite_on_host(tensors: Sequence[Tensor], found: Optional[Tensor] = None) -> Optional[bool]:
    """Whether any of the plain host tensors holds a NaN or an infinity, read by one fused kernel
    (``torch._amp_foreach_non_finite_check_and_unscale_`` with a scale of 1: every value is left bit for bit). On
    CPU that kernel costs a third of the per-tensor norms, whose launches dominate a small model's step. ``None``
    where it does not apply (a DTensor, a sparse or device tensor, a torch without it): the caller measures
    otherwise. ``found``: a float32 host tensor of one zero the kernel flags (kept by a caller that checks every
    step, to allocate nothing); it holds zero again on return."""
    fn = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if fn is None or not tensors or not all(type(t) is Tensor and t.is_cpu for t in tensors):
        return None
    if found is None:
        found = torch.zeros(1)
    try:
        fn(list(tensors), found, _ONE)
    except (RuntimeError, NotImplementedError, TypeError):  # a sparse or integer tensor: not this kernel's
        found.zero_()  # a kernel that failed part way may have flagged a tensor it had checked
        return None
    if not found:
        return False
    found.zero_()
    return True


def full(t: Tensor) -> Tensor:
    """The whole tensor: ``t.full_tensor()`` of a ``DTensor`` (a collective: call it on every rank, and only
    where the cost of gathering ``t`` is meant), else ``t``."""
    return t.full_tensor() if is_sharded(t) else t


def global_norm(t: Tensor) -> Tensor:
    """The fp32 L2 norm of the whole of ``t``: of a ``DTensor`` from its local shard and one all-reduce of
    one float over the default process group (every rank must call it), no gather; else ``t``'s own."""
    if not is_sharded(t):
        return foreach_norm([t], 2.0, dtype=torch.float32)[0]  # a float64 tensor: its own norm, then float32
    _, sq = squared_norms([t])
    assert sq is not None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        sq = sq.clone()
        dist.all_reduce(sq)
    return sq.sqrt()


def check_strategy(trainer: object, owner: str, what: str) -> None:
    """Refuse, at setup, a strategy that flattens parameters into 1-D shards (Lightning's ``FSDPStrategy``,
    FSDP1, and ``DeepSpeedStrategy``): there ``module.weight`` and its gradient are pieces of a flat
    buffer, not the layer's matrix, so ``what`` cannot be computed from them. FSDP2 (``ModelParallelStrategy``,
    ``DTensor`` parameters), DDP and one device pass."""
    kind = type(getattr(trainer, "strategy", None)).__name__
    if "FSDP" in kind or "DeepSpeed" in kind:
        raise ValueError(
            f"{owner} does not support {kind}: it keeps parameters (and gradients) as flattened 1-D shards, "
            f"so {what}. Use ModelParallelStrategy (FSDP2 `fully_shard`: DTensor parameters, supported), DDP or "
            "a single device; see docs/distributed.md."
        )


def check_tensor_parallel(trainer: object, owner: str, why: str) -> None:
    """Refuse, at setup, ``ModelParallelStrategy`` with ``tensor_parallel_size > 1`` for a monitor that reads
    layer inputs or outputs, which tensor-parallel layers hold sharded (``why`` says what it reads)."""
    strategy = getattr(trainer, "strategy", None)
    if type(strategy).__name__ != "ModelParallelStrategy":
        return
    tp = getattr(strategy, "_tensor_parallel_size", 1)
    if isinstance(tp, int) and tp > 1:
        raise ValueError(
            f"{owner} does not support tensor parallelism (ModelParallelStrategy(tensor_parallel_size={tp})): {why}, "
            "which tensor-parallel layers hold sharded. Use tensor_parallel_size=1 (FSDP2 data parallel only, "
            "supported); see docs/distributed.md."
        )

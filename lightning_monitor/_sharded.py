"""Tensors that may be sharded: FSDP2 (``fully_shard``) keeps parameters and gradients as ``DTensor``s.

A ``DTensor`` holds one shard per rank; reductions over it (a norm, a finiteness test) are computed on the
local shard and combined across the ranks with one collective of a few numbers, never a gather of the
tensor. A shard replicated over some mesh dimensions is counted once: its local contribution is divided by
the number of ranks holding the same data. Plain tensors (DDP, one device) pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_monitor._compat import foreach_norm

__all__ = ["is_sharded", "local", "replication", "squared_norms"]

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
    plain = [t for t in tensors if not is_sharded(t)]
    shards = [t for t in tensors if is_sharded(t)]
    plain_sq = torch.stack(foreach_norm(plain, 2.0, dtype=torch.float32)).square().sum() if plain else None
    shard_sq = None
    by_count: dict[int, list[Tensor]] = {}
    for t in shards:
        by_count.setdefault(replication(t), []).append(local(t))
    for count, locals_ in by_count.items():  # a host float per group: no host-to-device copy
        part = torch.stack([n.reshape(()) for n in foreach_norm(locals_, 2.0, dtype=torch.float32)]).square().sum()
        part = part / count if count > 1 else part
        shard_sq = part if shard_sq is None else shard_sq + part
    return plain_sq, shard_sq

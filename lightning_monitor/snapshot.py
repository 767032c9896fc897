"""A copy of everything a training run needs to go back to an earlier step.

:class:`TrainingSnapshot` holds the module's parameters and buffers (BatchNorm statistics included),
every optimizer's state, every LR scheduler's state, the AMP loss scaler's state and the state of the
suite's monitors, in host memory (default) or in a file on disk. :meth:`TrainingSnapshot.restore`
copies it back in place, so the optimizer keeps referring to the same parameter tensors.
"""

from __future__ import annotations

import copy
import os
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

__all__ = ["SnapshotMismatch", "TrainingSnapshot", "scale_learning_rates"]


_ATOMS = (int, float, bool, str, bytes, type(None))


class Shared(tuple):
    """Values a monitor's snapshot state holds by reference, never copied (nor walked) by a snapshot: entries that
    never change once made (GWA's per-epoch records). A run of thousands of epochs had every snapshot copy them all
    (11 ms a snapshot at 3,000 epochs, the guard's cost a step five times its cost at 100)."""

    __slots__ = ()


#: how the CUDA tensors of a snapshot reach the host. ``"flat"`` (default): on each device the tensors of a dtype are
#: gathered into one buffer on the device (one copy at the device's memory bandwidth), which one transfer on a side
#: stream carries to one pinned host buffer (the snapshot's tensors are views of it), overlapping the training that
#: follows: a few calls whatever the number of tensors. ``"staged"``: the same per tensor (a staging copy and a transfer
#: each). Where the device lacks the free memory for the staging copies, either copies straight to pinned host memory on
#: the training stream, which waits for the transfer but the host does not (``"pinned"`` always does that). Each way an
#: event marks the end of the copies and every reader of the snapshot waits for it (:meth:`TrainingSnapshot.state`).
#: ``"waiting"``: one blocking copy per tensor into pageable memory (the host waits for each). Module-level, for the
#: CUDA benchmark's comparison
_DEVICE_COPIES = "flat"

#: a staging copy is made when its bytes are at most this share of the device memory free (the allocator's cached
#: blocks counted as free)
_STAGING_SHARE = 0.5

_SIDE_STREAMS: dict[Any, Any] = {}


def _side_stream(device: torch.device) -> Any:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


def _can_stage(device: torch.device, nbytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return nbytes <= _STAGING_SHARE * (free + cached)


def _groups(src: list[Tensor], key: Callable[[Tensor], Any]) -> dict[Any, list[int]]:
    """The indices of ``src`` grouped by ``key``, in order."""
    groups: dict[Any, list[int]] = {}
    for i, t in enumerate(src):
        groups.setdefault(key(t), []).append(i)
    return groups


def _device_dtype(t: Tensor) -> tuple[torch.device, torch.dtype]:
    return t.device, t.dtype


def _copy_from_devices(dst: list[Tensor], src: list[Tensor], pending: list,
                       flats: Optional[dict[Any, Tensor]] = None) -> None:
    """Start the copies of CUDA tensors ``src`` into pinned host tensors ``dst`` (see ``_DEVICE_COPIES``); append to
    ``pending`` the streams that carry them (an event recorded on each marks their end). ``flats``: per (device,
    dtype), the pinned buffer the ``dst`` of that group are consecutive views of (``"flat"``)."""
    key = _device_dtype if flats is not None else (lambda t: t.device)
    for group, idx in _groups(src, key).items():
        sources = [src[i] for i in idx]
        device = sources[0].device
        main = torch.cuda.current_stream(device)
        staging = flats is not None or _DEVICE_COPIES == "staged"
        if staging and _can_stage(device, sum(t.numel() * t.element_size() for t in sources)):
            # on the training stream, before any later update of the sources: one gathering copy, or one per tensor
            if flats is not None:
                staged, targets = [torch.cat([t.reshape(-1) for t in sources])], [flats[group]]
            else:
                staged = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in sources]
                torch._foreach_copy_(staged, sources)
                targets = [dst[i] for i in idx]
            side = _side_stream(device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for d, t in zip(targets, staged):
                    d.copy_(t, non_blocking=True)
            for t in staged:
                t.record_stream(side)  # its memory is not reused before the side stream's copy has read it
            pending.append(side)
        else:
            for i, t in zip(idx, sources):
                dst[i].copy_(t, non_blocking=True)
            pending.append(main)


def _async_source(t: Tensor) -> bool:
    """Whether the plain tensor ``t`` is copied to the host without the host waiting: a plain strided CUDA tensor."""
    return type(t) is Tensor and t.is_cuda and t.layout == torch.strided


def _cuda_leaves(obj: Any, out: list[Tensor]) -> None:
    """The plain CUDA tensors of ``obj``, in the order :func:`_host_structure` visits them."""
    if isinstance(obj, Tensor):
        t = obj if type(obj) is Tensor else obj.detach()
        if _async_source(t):
            out.append(t)
    elif isinstance(obj, dict):
        for v in obj.values():
            _cuda_leaves(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _cuda_leaves(v, out)


def _flat_views(obj: Any, flats: dict[Any, Tensor]) -> list[Tensor]:
    """Per plain CUDA tensor of ``obj`` (in visiting order), its pinned host destination: a view of the pinned buffer
    of its (device, dtype) in ``flats``, where they lie one after another. A buffer of ``flats`` of the right size is
    written over (an earlier snapshot's, given up); else one is allocated (and put in ``flats``)."""
    leaves: list[Tensor] = []
    _cuda_leaves(obj, leaves)
    views: list[Tensor] = [leaves[0]] * len(leaves) if leaves else []
    for key, idx in _groups(leaves, _device_dtype).items():
        total = sum(leaves[i].numel() for i in idx)
        flat = flats.get(key)
        if flat is None or flat.numel() != total:
            flat = flats[key] = torch.empty(total, dtype=key[1], pin_memory=key[0].type == "cuda")
        offset = 0
        for i in idx:
            n = leaves[i].numel()
            views[i] = flat[offset:offset + n].view(leaves[i].shape)
            offset += n
    return views


def _to_host(obj: Any, reuse: Any = None, pending: Optional[list] = None,
             flats: Optional[dict[Any, Tensor]] = None) -> Any:
    """A deep copy of ``obj`` with every tensor copied to host memory. ``reuse``: an earlier copy of the same
    structure that is no longer needed; a plain host tensor of it with the same shape and dtype is written
    over instead of allocating a new one (fresh host memory costs page faults on every snapshot). The copies
    from host tensors are made by one fused call (per-tensor dispatch dominates for small models). ``pending``:
    where given, plain CUDA tensors are copied into pinned host memory without the host waiting (the streams that
    carry the copies are appended to it: the caller records an event on each before anything reads the copies); else
    every copy has finished on return. ``flats``: with ``pending``, under ``"flat"``, the pinned buffers the copies of a
    (device, dtype) go to (written over where they fit, added where not)."""
    dst: list[Tensor] = []
    src: list[Tensor] = []
    async_dst: list[Tensor] = []
    async_src: list[Tensor] = []
    flat = pending is not None and flats is not None and _DEVICE_COPIES == "flat"
    with torch.no_grad():  # no copy is recorded by autograd, so no source needs a detached alias
        views = iter(_flat_views(obj, flats)) if flat else None
        out = _host_structure(obj, reuse, dst, src, async_dst if pending is not None else None, async_src, views)
        if dst:
            torch._foreach_copy_(dst, src)
        if async_src and pending is not None:
            _copy_from_devices(async_dst, async_src, pending, flats if flat else None)
    return out


def _fits(reuse: Any, t: Tensor, pinned: bool = False) -> bool:
    """Whether ``reuse`` is a plain contiguous host tensor that a copy of the plain tensor ``t`` can be written into
    (``pinned``: one in pinned memory, for a copy that does not wait)."""
    return (type(reuse) is Tensor and type(t) is Tensor and reuse.is_cpu and reuse.dtype == t.dtype
            and reuse.shape == t.shape and reuse.is_contiguous() and (not pinned or reuse.is_pinned()))


def _host_structure(obj: Any, reuse: Any, dst: list[Tensor], src: list[Tensor], async_dst: Optional[list[Tensor]],
                    async_src: list[Tensor], views: Optional[Iterator[Tensor]] = None) -> Any:
    """``obj`` with each plain host tensor replaced by the tensor it will be copied into (appended with its
    source to ``dst`` / ``src``; a plain CUDA tensor to ``async_dst`` / ``async_src``, a pinned buffer (the next of
    ``views`` where given), when ``async_dst`` is given); every other tensor is copied here. Runs without autograd
    (:func:`_to_host`). This walk runs on every snapshot: the common case (a plain host tensor) takes the fewest
    attribute reads."""
    if isinstance(obj, Tensor):
        t = obj if type(obj) is Tensor else obj.detach()  # a Parameter: its plain tensor
        if async_dst is not None and _async_source(t):
            if views is not None:
                reuse = next(views)
            elif not _fits(reuse, t, pinned=True):
                reuse = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            async_dst.append(reuse)
            async_src.append(t)
            return reuse
        if type(t) is not Tensor or not t.is_cpu or t.layout != torch.strided:
            # device tensors (one copy each: the copy to the host waits anyway), DTensors, sparse tensors
            return reuse.copy_(t) if _fits(reuse, t) else t.to("cpu", copy=True)
        if not _fits(reuse, t):
            reuse = torch.empty(t.shape, dtype=t.dtype)
        dst.append(reuse)
        src.append(t)
        return reuse
    if isinstance(obj, _ATOMS) or type(obj) is Shared:
        return obj
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: _host_structure(v, old.get(k), dst, src, async_dst, async_src, views) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else (None,) * len(obj)
        return type(obj)(_host_structure(v, r, dst, src, async_dst, async_src, views) for v, r in zip(obj, old))
    return copy.deepcopy(obj)


def present_names(saved: Iterable[str], present: Collection[str]) -> dict[str, str]:
    """Each saved module-state name -> the present name that holds it: the same name, or across the renaming of
    ``torch.nn.utils.prune`` (Lightning's ``ModelPruning``): a parameter pruned since it was saved (``w`` then,
    ``w_orig`` now beside a ``w_mask`` buffer), or pruned then and made permanent since (``w_orig`` then, ``w`` now).
    Names with no present holder are left out."""
    out = {}
    for name in saved:
        if name in present:
            out[name] = name
        elif name + "_orig" in present and name + "_mask" in present:
            out[name] = name + "_orig"
        elif name.endswith("_orig") and name[: -len("_orig")] in present:
            out[name] = name[: -len("_orig")]
    return out


def held_values(module_state: dict[str, Any], present: Collection[str]) -> list[tuple[str, str, Any]]:
    """``(saved name, present name, value)`` for each saved entry the present module state holds (see
    :func:`present_names`); a pruned parameter made permanent since (``w_orig`` then, ``w`` now) gets its saved
    ``w_orig`` times its saved ``w_mask`` (the pruned entries stay zero)."""
    out = []
    for name, now in present_names(module_state, present).items():
        value = module_state[name]
        mask = module_state.get(name[: -len("_orig")] + "_mask") if name != now else None
        out.append((name, now, value if mask is None else value * mask))
    return out


def pruned_since(saved: Collection[str], present: Collection[str]) -> list[str]:
    """The present names of the parameters ``torch.nn.utils.prune`` has masked since a state with the names
    ``saved``: ``w_orig`` with its ``w_mask`` now, whose mask was not saved."""
    return sorted(k[: -len("_mask")] for k in present
                  if k.endswith("_mask") and k[: -len("_mask")] + "_orig" in present and k not in saved)


def _shapes(module_state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of a saved module state."""
    return {k: tuple(v.shape) for k, v in module_state.items() if isinstance(v, Tensor)}


def _loss_scaler(trainer: pl.Trainer) -> Any:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and hasattr(scaler, "state_dict") else None


@dataclass
class TrainingSnapshot:
    """The state of a run at optimizer step ``step`` (before that step's update).

    Attributes:
        step: the optimizer step (``trainer.global_step``) the state belongs to.
        epoch: the epoch it was taken in.
        lr_scale: the guard's cumulative learning-rate factor when it was taken.
        path: the file holding the tensors, when kept on disk; else ``None``.
        group_sizes: per optimizer, the number of parameters of each group when it was taken (``None``: read
            from the stored state).
        own_step_target: the state before its step's update, a target even for an anomaly at that step: taken as a
            fit started from a state training had reached (a resume), or before the update of a step whose loss or
            gradient was non-finite (a bad batch) with the weights found intact.
        module_keys: the names of the module's state it holds (``None``: read from the stored state).
        optimizer_types: per optimizer, its class when it was taken (``None``: read from the stored state, which
            may predate the field: then each optimizer is taken for the one saved).
    """

    step: int
    epoch: int
    lr_scale: float
    path: Optional[str] = None
    guard: dict[str, Any] = field(default_factory=dict)
    group_sizes: Optional[list[list[int]]] = None
    own_step_target: bool = False
    module_keys: Optional[frozenset[str]] = None
    #: the shape of each tensor of the module's state it holds (``None``: read from the stored state)
    module_shapes: Optional[dict[str, tuple[int, ...]]] = None
    #: the parameters that were trainable (``requires_grad``) when the snapshot was taken
    trainable: Optional[frozenset[str]] = None
    optimizer_types: Optional[list[Optional[str]]] = None
    #: per optimizer, whether its ``state_dict`` is a format of its own, without ``param_groups`` (a Lookahead's): its
    #: groups then cannot be matched to groups added since (``None``: read from the stored state)
    opaque: Optional[list[bool]] = None
    _state: Optional[dict[str, Any]] = field(default=None, repr=False)
    #: events marking the end of the copies from CUDA tensors, still under way (waited for by :meth:`state`)
    _copies: list = field(default_factory=list, repr=False)
    #: the pinned buffers its copies from CUDA tensors are views of (written over by the snapshot that pushes it out)
    _flats: dict = field(default_factory=dict, repr=False)
    #: per non-persistent buffer saved (``module_extra``): a weak reference to the tensor and its in-place version
    #: counter then; a later snapshot shares the copy of a mask or index buffer unchanged since
    _extra_seen: dict = field(default_factory=dict, repr=False)

    @classmethod
    def capture(
        cls,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        monitors: dict[str, Any],
        step: int,
        lr_scale: float,
        directory: Optional[str] = None,
        reuse: Optional[TrainingSnapshot] = None,
        module_state: Optional[dict[str, Any]] = None,
        previous: Optional[TrainingSnapshot] = None,
    ) -> TrainingSnapshot:
        """Copy the run's state now. ``monitors`` maps a state key to a callback with ``state_dict``.
        ``reuse``: a snapshot in host memory that is being given up; its tensors are written over where they
        fit (it is discarded). ``module_state``: ``pl_module.state_dict()`` when the caller already has it.
        ``previous``: a snapshot still kept, whose copies of the module's non-persistent buffers unchanged since are
        shared (a causal mask, a rotary cache: copied once)."""
        old: dict[str, Any] = {}
        # the pinned buffers of the copies from CUDA (``"flat"``): the given-up snapshot's are written over
        flats: dict[Any, Any] = {}
        if reuse is not None:
            reuse._wait()  # its buffers are written over (on the host too)
            old = reuse._state if directory is None and reuse._state is not None else {}
            flats = reuse._flats if directory is None else {}
            reuse.discard()
        opts, scheds = old.get("optimizers") or [], old.get("schedulers") or []
        inners = old.get("inner_optimizers") or []
        scaler = _loss_scaler(trainer)
        module_state = pl_module.state_dict() if module_state is None else module_state
        extra, seen = _extra_buffers(pl_module, module_state, previous)
        # in host memory, the module's and optimizers' CUDA tensors are copied without the host waiting (an event on
        # each stream that carries copies marks their end); a snapshot saved to a file at once gains nothing by it
        pending: Optional[list] = ([] if directory is None and _DEVICE_COPIES != "waiting" and torch.cuda.is_available()
                                   else None)
        state = {
            "module": _to_host(module_state, old.get("module"), pending, flats.setdefault("module", {})),
            # buffers outside the state_dict (`persistent=False`): a counter, a running normaliser the loss reads
            "module_extra": extra,
            "optimizers": [_to_host(opt.state_dict(), opts[i] if i < len(opts) else None, pending,
                                    flats.setdefault(("optimizer", i), {}))
                           for i, opt in enumerate(trainer.optimizers)],
            # the optimizers a wrapper steps (SAM's base optimizer), whose state its own `state_dict` may leave out
            "inner_optimizers": [[_to_host(inner.state_dict(), grid_at(inners, i, j))
                                  for j, inner in enumerate(_inner(opt))] for i, opt in enumerate(trainer.optimizers)],
            "schedulers": [_to_host(cfg.scheduler.state_dict(), scheds[i] if i < len(scheds) else None)
                           for i, cfg in enumerate(trainer.lr_scheduler_configs)],
            "scheduler_types": [_type_name(cfg.scheduler) for cfg in trainer.lr_scheduler_configs],
            "optimizer_types": [_type_name(opt) for opt in trainer.optimizers],
            "scaler": _to_host(scaler.state_dict()) if scaler is not None else None,
            "monitors": {key: _to_host(cb.state_dict()) for key, cb in monitors.items()},
        }
        snap = cls(step=step, epoch=trainer.current_epoch, lr_scale=lr_scale,
                   group_sizes=[[len(g["params"]) for g in opt.param_groups] for opt in trainer.optimizers],
                   opaque=[_opaque(saved) for saved in state["optimizers"]],
                   module_keys=frozenset(state["module"]), optimizer_types=list(state["optimizer_types"]),
                   module_shapes=_shapes(state["module"]),
                   trainable=frozenset(n for n, p in pl_module.named_parameters(remove_duplicate=False)
                                       if p.requires_grad))
        for stream in dict.fromkeys(pending or ()):
            event = torch.cuda.Event()
            event.record(stream)
            snap._copies.append(event)
        snap._extra_seen = seen
        if directory is None:
            snap._state, snap._flats = state, flats
        else:
            snap._wait()
            snap.path = os.path.join(directory, f"guard-snapshot-rank{trainer.global_rank}-step={step}.pt")
            torch.save(state, snap.path)
        return snap

    def state(self) -> dict[str, Any]:
        """The stored state (read from disk when kept there); the copies from the device have finished."""
        self._wait()
        if self._state is not None:
            return self._state
        assert self.path is not None
        return torch.load(self.path, map_location="cpu", weights_only=False)

    def restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule, monitors: dict[str, Any],
                keep: Collection[str] = ()) -> None:
        """Copy the snapshot back into the module, optimizers, schedulers, scaler and ``monitors``.

        Another callback may have changed the optimizers since (``BackboneFinetuning`` adds a parameter group when it
        unfreezes, ``StochasticWeightAveraging`` swaps the scheduler and adds keys to the groups): a group added
        since keeps its settings and starts with no optimizer state, as it did when it was added; a key added to a
        group since keeps its value; a scheduler of another type than the saved one keeps its state; an optimizer of
        another class than the saved one (swapped in since) keeps its settings and starts with no state. Raises
        :class:`SnapshotMismatch`, before changing anything, when the saved optimizer state cannot be matched to the
        parameters (a group removed or resized, another number of optimizers). ``keep``: names of the module's state
        (its ``state_dict`` keys) that keep their present values (parameters frozen for good since)."""
        problem = self._optimizers_mismatch(trainer)
        if problem is not None:
            raise SnapshotMismatch(f"The snapshot of step {self.step} cannot be restored: {problem}.")
        state = self.state()
        with torch.no_grad():
            current = pl_module.state_dict()
            for name, now, value in held_values(state["module"], current):
                if now not in keep and name not in keep:
                    current[now].copy_(value)
            _restore_extra_buffers(pl_module, state.get("module_extra") or {})
        inner_saved = state.get("inner_optimizers") or [[] for _ in state["optimizers"]]
        for opt, saved, swapped, inner in zip(trainer.optimizers, state["optimizers"], self._swapped(trainer),
                                              inner_saved):
            if swapped:
                # an optimizer of another class put in its place since (SGD replaced by AdamW mid-run): the saved
                # state is the old one's, so the new one starts again with none, as it did when it was swapped in,
                # and keeps its own settings
                opt.state.clear()
            else:
                _restore_optimizer(opt, saved, inner)
        types = state.get("scheduler_types") or [None] * len(state["schedulers"])
        for cfg, saved, kind in zip(trainer.lr_scheduler_configs, state["schedulers"], types):
            # a scheduler swapped in since (StochasticWeightAveraging's SWALR) keeps its own state: the saved one is
            # another schedule's
            if kind is None or kind == _type_name(cfg.scheduler):
                cfg.scheduler.load_state_dict(copy.deepcopy(saved))
        scaler = _loss_scaler(trainer)
        if scaler is not None and state["scaler"] is not None:
            scaler.load_state_dict(copy.deepcopy(state["scaler"]))
        for key, cb in monitors.items():
            if key in state["monitors"]:
                cb.load_state_dict(copy.deepcopy(state["monitors"][key]))

    def mismatch(self, trainer: pl.Trainer) -> Optional[str]:
        """Why the snapshot no longer fits the run, or ``None`` when it does: each saved parameter group must still be
        there, in order, with as many parameters (groups may have been added after them), and every trainable
        parameter of the module must be in it (a layer added since, such as an adapter or a grown block, has no
        state to go back to: restoring the rest would leave it as it is now). Read from what was kept at capture (a
        snapshot adopted from a checkpoint's files: read from its file once)."""
        problem = self._optimizers_mismatch(trainer)
        module = getattr(trainer, "lightning_module", None)
        if problem is None and module is not None:
            keys = self.saved_keys()
            trainable = {name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
            present = module.state_dict().keys()
            held = set(present_names(keys, present).values())  # a pruned parameter is held under its old name
            added = sorted(k for k in present if k in trainable and k not in held)
            if added:
                problem = (f"{len(added)} trainable parameter(s) added to the module since step {self.step}: "
                           f"{', '.join(added[:4])}{'...' if len(added) > 4 else ''}")
        if problem is None and module is not None:
            # a tensor resized since (`resize_token_embeddings`, a grown layer): the saved one cannot be copied into it
            assert self.module_shapes is not None  # read by saved_keys() above
            state = module.state_dict()
            resized = [(saved, now, self.module_shapes[saved], tuple(state[now].shape))
                       for saved, now in present_names(self.module_shapes, state).items()
                       if isinstance(state[now], Tensor) and tuple(state[now].shape) != self.module_shapes[saved]]
            if resized:
                problem = (f"{len(resized)} tensor(s) of the module resized since step {self.step}: "
                           + ", ".join(f"{now} {list(then)} -> {list(shape)}" for _, now, then, shape in resized[:3])
                           + ("..." if len(resized) > 3 else ""))
        return problem

    def saved_keys(self) -> frozenset[str]:
        """The names of the module state saved (an adopted snapshot's: read from its file once)."""
        self._read_layout()
        assert self.module_keys is not None
        return self.module_keys

    def _read_layout(self) -> None:
        """A snapshot adopted from a checkpoint's list of files: its group sizes, module keys and optimizer classes,
        read from the file once (kept from then on)."""
        if (self.group_sizes is None or self.module_keys is None or self.optimizer_types is None
                or self.module_shapes is None or self.opaque is None):
            state = self.state()
            self.opaque = [_opaque(saved) for saved in state["optimizers"]]
            # an optimizer whose `state_dict` holds no groups (a wrapper's own format): nothing to check its layout by
            self.group_sizes = [_sizes(saved.get("param_groups", ())) if isinstance(saved, dict) else []
                                for saved in state["optimizers"]]
            self.module_keys = frozenset(state["module"])
            self.module_shapes = _shapes(state["module"])
            self.optimizer_types = list(state.get("optimizer_types") or [None] * len(state["optimizers"]))

    def _swapped(self, trainer: pl.Trainer) -> list[bool]:
        """Per optimizer of the run, whether it is of another class than the one saved in its place."""
        self._read_layout()
        assert self.optimizer_types is not None
        return [kind is not None and kind != _type_name(opt) for opt, kind in zip(trainer.optimizers, self.optimizer_types)]

    def _optimizers_mismatch(self, trainer: pl.Trainer) -> Optional[str]:
        """Why the saved optimizer states do not fit the run's optimizers now, or ``None``."""
        self._read_layout()
        sizes = self.group_sizes
        assert sizes is not None
        if len(sizes) != len(trainer.optimizers):
            return f"{len(sizes)} optimizer(s) then, {len(trainer.optimizers)} now"
        for i, (opt, then, swapped) in enumerate(zip(trainer.optimizers, sizes, self._swapped(trainer))):
            if swapped:
                continue  # none of its saved state is restored (see restore): its groups need not match
            now = [len(g["params"]) for g in opt.param_groups]
            if now[: len(then)] != then:
                return f"optimizer {i} had parameter groups of {then} parameters, now {now}"
            assert self.opaque is not None
            if now != then and self.opaque[i]:
                # its own format holds no groups to add the new ones to: its load of the saved state failed part way
                return (f"optimizer {i} ({type(opt).__name__}) keeps its state in a format of its own and has gained "
                        f"parameter groups since ({then} parameters then, {now} now)")
        return None

    def _wait(self) -> None:
        """Wait for the copies from CUDA tensors still under way (none: nothing to wait for)."""
        while self._copies:
            self._copies.pop().synchronize()

    def discard(self) -> None:
        """Free the memory or the file."""
        self._wait()  # no copy is left writing into memory given back
        self._state = None
        self._flats = {}
        if self.path is not None and os.path.exists(self.path):
            os.remove(self.path)


def _extra_buffers(pl_module: torch.nn.Module, module_state: dict[str, Any], previous: Optional[TrainingSnapshot]
                   ) -> tuple[dict[str, Tensor], dict[str, tuple[Any, int]]]:
    """Host copies of the module's buffers its ``state_dict`` leaves out (``persistent=False``), and what identifies
    each buffer as it is now (a weak reference, its in-place version counter). A mask or index buffer (not floating)
    unchanged since ``previous`` (the same tensor, not written in place since, and on the host the same values) shares
    that snapshot's copy; a floating one is copied each time (a running statistic may be written through ``.data``,
    which moves no version counter)."""
    extra: dict[str, Tensor] = {}
    seen: dict[str, tuple[Any, int]] = {}
    before = previous._extra_seen if previous is not None and previous._state is not None else {}
    kept = (previous._state or {}).get("module_extra") or {} if previous is not None else {}
    for name, buf in pl_module.named_buffers(remove_duplicate=False):
        if name in module_state or buf is None:
            continue
        ref, version = before.get(name, (None, None))
        if (ref is not None and ref() is buf and version == buf._version and name in kept
                and not buf.is_floating_point() and not buf.is_complex()
                and (not buf.is_cpu or torch.equal(buf, kept[name]))):
            # (on the host, compared too: a write through `.data` moves no version counter)
            extra[name] = kept[name]
        else:
            with torch.no_grad():
                extra[name] = buf.detach().to("cpu", copy=True)
        seen[name] = (weakref.ref(buf), buf._version)
    return extra, seen


def _restore_extra_buffers(pl_module: torch.nn.Module, saved: dict[str, Tensor]) -> None:
    """Put back the non-persistent buffers saved (:func:`_extra_buffers`): copied into the present tensor where it
    differs, or, where it was replaced by one of another shape or type since (a queue that grew), replaced by the saved
    one (a constant mask is compared, not copied back)."""
    modules = dict(pl_module.named_modules(remove_duplicate=False))
    for name, value in saved.items():
        owner, _, local = name.rpartition(".")
        module = modules.get(owner)
        if module is None or local not in module._buffers:
            continue
        buf = module._buffers[local]
        if buf is not None and buf.shape == value.shape and buf.dtype == value.dtype:
            if not torch.equal(buf, value.to(buf.device)):
                buf.copy_(value)
        else:
            device = buf.device if buf is not None else value.device
            module._buffers[local] = value.to(device, copy=True)


class SnapshotMismatch(RuntimeError):
    """A snapshot whose optimizer states no longer fit the run's optimizers."""


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _optimizer_state(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``saved`` (an optimizer's ``state_dict()``) for ``opt`` as it is now: the groups added after the
    saved ones keep their present settings and get no state; keys added to a saved group since keep their present
    values. The caller has checked that the saved groups are the first groups of ``opt`` (:meth:`TrainingSnapshot.mismatch`)."""
    state = copy.deepcopy(saved)
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list):
        return state  # a wrapper's own format (a Lookahead holding its base's state): loaded as saved
    for then, now in zip(groups, opt.param_groups):
        for key, value in now.items():
            if key != "params" and key not in then:
                then[key] = value
    first = sum(len(g["params"]) for g in groups)
    for now in opt.param_groups[len(groups):]:
        group = {k: v for k, v in now.items() if k != "params"}
        group["params"] = list(range(first, first + len(now["params"])))
        first += len(now["params"])
        groups.append(group)
    return state


def _opaque(saved: Any) -> bool:
    """Whether an optimizer's saved ``state_dict`` is a format of its own (no list of ``param_groups``)."""
    return not (isinstance(saved, dict) and isinstance(saved.get("param_groups"), list))


def grid_at(rows: Optional[Sequence[Sequence[Any]]], i: int, j: int) -> Any:
    """``rows[i][j]`` (per optimizer, per parameter group or inner optimizer), or ``None`` where there is none."""
    return rows[i][j] if rows is not None and i < len(rows) and j < len(rows[i]) else None


def _sizes(groups: Any) -> list[int]:
    """The number of parameters of each of ``groups`` (an optimizer's or a state dict's ``param_groups``)."""
    return [len(g["params"]) for g in groups]


def _inner(opt: Any) -> list[torch.optim.Optimizer]:
    """The optimizers ``opt`` holds as attributes (SAM's ``base_optimizer``, a Lookahead's ``optimizer``), and those
    they hold in turn; each once, ``opt`` left out."""
    out: list[torch.optim.Optimizer] = []
    seen, todo = {id(opt)}, [opt]
    while todo:
        for value in getattr(todo.pop(0), "__dict__", {}).values():
            held = (list(value) if isinstance(value, (list, tuple)) else list(value.values()) if isinstance(value, dict)
                    else [value])
            for item in held:  # an optimizer held as an attribute, or in a list, tuple or dict of them
                if isinstance(item, torch.optim.Optimizer) and id(item) not in seen:
                    seen.add(id(item))
                    out.append(item)
                    todo.append(item)
    return out


def _restore_optimizer(opt: torch.optim.Optimizer, saved: dict[str, Any], inner_saved: list[dict[str, Any]]) -> None:
    """Load ``saved`` into ``opt`` and each ``inner_saved`` into the optimizer it holds (:func:`_inner`, in order), keeping
    the objects that hold their groups and states. A load puts new ones in their place, and a wrapper that shares its
    groups or state with the optimizers it steps (SAM's ``base.param_groups = self.param_groups``, a list of the inner
    optimizers' group dicts) would no longer reach them: the wrapper's rates, held down after a rollback, stopped
    reaching the optimizer that steps. The values loaded are written into the old objects, and every holder is pointed
    back to them. A group added to an inner optimizer since keeps its settings and gets no state (as for ``opt``); an
    inner optimizer whose groups were removed or resized since loses its state. A wrapper that reads its groups or state
    through a property gets no entry of its own from the load (it would stay, stale, under the property)."""
    family = [opt] + _inner(opt)
    before = [(o, o.param_groups, list(o.param_groups), o.state) for o in family]
    _load(opt, _optimizer_state(opt, saved))
    if len(family) - 1 == len(inner_saved):
        for o, o_saved in zip(family[1:], inner_saved):
            then = _sizes(o_saved.get("param_groups", ()))
            if _sizes(o.param_groups)[: len(then)] == then:
                _load(o, _optimizer_state(o, o_saved))
            else:
                o.state.clear()
    for o, groups, dicts, state in before:
        now = o.param_groups
        if (now is not groups or any(a is not b for a, b in zip(now, dicts))) and len(now) == len(dicts):
            for old, new in zip(dicts, now):
                if old is not new:
                    old.clear()
                    old.update(new)
            groups[:] = dicts
            _point(family, "param_groups", now, groups)
        if o.state is not state:
            new_state = o.state
            state.clear()
            state.update(new_state)
            _point(family, "state", new_state, state)


def _load(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """``opt.load_state_dict(saved)``, without leaving entries a property of its class hides."""
    opt.load_state_dict(saved)
    for name in ("param_groups", "state"):
        if isinstance(getattr(type(opt), name, None), property):
            opt.__dict__.pop(name, None)


def _point(holders: list[Any], name: str, new: Any, old: Any) -> None:
    """Point each holder's ``name`` that is ``new`` back to ``old`` (a holder that reads it through a property from
    another holder follows that one)."""
    for holder in holders:
        if holder.__dict__.get(name) is new:
            setattr(holder, name, old)


def scale_learning_rates(trainer: pl.Trainer, factor: float) -> None:
    """Multiply every learning rate of the run by ``factor``, schedules included.

    The current rate of every parameter group, the rates schedulers start from (``initial_lr``,
    ``base_lrs``) and the bounds some keep in the group (``max_lr``, ``min_lr`` of OneCycleLR and
    cyclic schedules) are all scaled, so that the schedule continues at the lower level.
    """
    if factor == 1.0:
        return
    scaled: set[int] = set()  # a tensor rate held in two places (an alias) is scaled once

    def tensor(value: Tensor) -> None:
        if id(value) not in scaled:
            scaled.add(id(value))
            value.mul_(factor)  # in place: no host sync; a scheduler's copy (its `base_lrs`) is scaled too below

    for opt in trainer.optimizers:
        for group in opt.param_groups:
            for key in ("lr", "initial_lr", "max_lr", "min_lr"):
                value = group.get(key)
                if isinstance(value, (int, float)):
                    group[key] = value * factor
                elif isinstance(value, Tensor):
                    tensor(value)
    for cfg in trainer.lr_scheduler_configs:
        sched = cfg.scheduler
        for attr in ("base_lrs", "_last_lr", "max_lrs", "min_lrs"):
            values = getattr(sched, attr, None)
            if isinstance(values, list):
                # a tensor rate's schedule keeps tensor copies of it: left unscaled, the next scheduler step set the
                # rate of before the rollback again, and the run rolled back four times and stopped
                for v in values:
                    if isinstance(v, Tensor):
                        tensor(v)
                setattr(sched, attr, [v * factor if isinstance(v, (int, float)) else v for v in values])

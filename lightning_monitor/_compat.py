"""The private torch / Lightning APIs this package relies on, each isolated in one small helper.

Every helper below exists because no public API gives the same behaviour (the reason is named in
each). Each was checked on torch 2.13.0 and lightning 2.6.6, and each has a fallback used when the
private name is missing in another version: slower, or a host sync on a due step, or a skipped
early check, never a different result or a silent error. Keep every private access here so an upgrade
has one file to review.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

__all__ = [
    "callback_metrics_store",
    "ddp_comm_hook",
    "ddp_kwargs",
    "foreach_copy_",
    "foreach_norm",
    "foreach_sub",
    "fork_rng_of",
    "grad_scaler_scale",
    "has_forward_pre_hooks",
    "random_states_of",
    "set_random_states_of",
    "set_versions",
    "versions_settable",
    "written_tensors",
]

# ---------------------------------------------------------------- torch: fused multi-tensor kernels
# torch._foreach_norm / _foreach_sub / _foreach_copy_ (private; checked on torch 2.13). Public
# alternatives: torch.nn.utils.get_total_norm returns only the norm of all tensors together, not one
# per tensor; a Python loop over torch.linalg.vector_norm / sub / copy_ gives the same values but one
# kernel launch per tensor instead of one per (device, dtype) group. The loops are the fallbacks.


def foreach_norm(tensors: Sequence[Tensor], ord: float, dtype: Optional[torch.dtype] = None) -> list[Tensor]:
    """``[vector_norm(t, ord, dtype=dtype) for t in tensors]``; ``torch._foreach_norm`` when present. A tensor wider
    than ``dtype`` (float64 for a float32 ``dtype``: the kernels refuse to narrow) has its norm taken in its own
    dtype, then cast to ``dtype``.

    An error from the fused kernel (e.g. a ``dtype=`` it does not accept) propagates to the caller."""
    fn = getattr(torch, "_foreach_norm", None)
    try:
        if fn is None:
            return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors]
        return list(fn(tensors, ord) if dtype is None else fn(tensors, ord, dtype=dtype))
    except RuntimeError:
        wide = [dtype is not None and torch.promote_types(t.dtype, dtype) != dtype for t in tensors]
        if not any(wide):
            raise
    # rare (float64 models): the common path above reads no dtype
    narrow = [t for t, w in zip(tensors, wide) if not w]
    narrow_norms = iter(foreach_norm(narrow, ord, dtype) if narrow else [])
    wide_norms = iter(foreach_norm([t for t, w in zip(tensors, wide) if w], ord))
    return [next(wide_norms).to(dtype) if w else next(narrow_norms) for w in wide]


def foreach_sub(a: Sequence[Tensor], b: Sequence[Tensor]) -> list[Tensor]:
    """``[x - y for x, y in zip(a, b)]``; ``torch._foreach_sub`` when present."""
    fn = getattr(torch, "_foreach_sub", None)
    if fn is None:
        return [x - y for x, y in zip(a, b)]
    return list(fn(list(a), list(b)))


def foreach_copy_(dst: Sequence[Tensor], src: Sequence[Tensor]) -> None:
    """``d.copy_(s)`` for each pair; ``torch._foreach_copy_`` when present."""
    fn = getattr(torch, "_foreach_copy_", None)
    if fn is None:
        for d, s in zip(dst, src):
            d.copy_(s)
        return
    fn(list(dst), list(src))


# ---------------------------------------------------------------- torch: nn.Module hooks


def has_forward_pre_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward pre-hooks of its own (registered by anyone).

    ``nn.Module._forward_pre_hooks`` (private; checked on torch 2.13): torch has no public way to list
    or count another party's hooks (a ``register_forward_pre_hook`` handle only knows its own hook).
    Fallback: ``True`` when the attribute is missing, so callers take their hook-safe path."""
    hooks = getattr(module, "_forward_pre_hooks", None)
    return True if hooks is None else bool(hooks)


# ---------------------------------------------------------------- torch: AMP GradScaler


def grad_scaler_scale(scaler: Any) -> Optional[Tensor]:
    """The dynamic loss scale of an enabled ``GradScaler`` as a tensor, without a host sync; ``None``
    before the first ``scale()`` call (the scale is created lazily).

    ``GradScaler._scale`` (private; checked on torch 2.13): the public ``get_scale()`` returns a Python
    float through ``.item()``, a host sync. Fallback when the attribute is missing: ``get_scale()``
    (one sync, correct value)."""
    if not hasattr(scaler, "_scale"):
        return torch.tensor(float(scaler.get_scale()))
    scale = scaler._scale
    return scale if isinstance(scale, Tensor) else None


# ---------------------------------------------------------------- Lightning: DDPStrategy settings
# DDPStrategy keeps its constructor's DDP kwargs and comm hook in private attributes (checked on
# lightning 2.6.6); it has no public accessor for either. The wrapped DistributedDataParallel exposes
# them only after strategy.setup, too late for a check in Callback.setup.


def ddp_kwargs(strategy: Any) -> Optional[dict[str, Any]]:
    """The kwargs ``DDPStrategy`` passes to ``DistributedDataParallel`` (``find_unused_parameters``,
    ``static_graph``, ...), from ``DDPStrategy._ddp_kwargs``; ``None`` when that attribute is missing
    (the caller then cannot check them up front)."""
    if not hasattr(strategy, "_ddp_kwargs"):
        return None
    return dict(strategy._ddp_kwargs or {})


def ddp_comm_hook(strategy: Any) -> Optional[Any]:
    """The communication hook a ``DDPStrategy`` will register (``DDPStrategy._ddp_comm_hook``), or
    ``None``. When the attribute is missing this also returns ``None``; a second hook registration then
    fails in ``DistributedDataParallel.register_comm_hook`` itself ("can only be called once")."""
    return getattr(strategy, "_ddp_comm_hook", None)


# ---------------------------------------------------------------- Lightning: a forward-only epoch


def backward_skipped(trainer: Any) -> bool:
    """Whether the fit loop runs the training steps without their backward (``fit_loop._skip_backward``,
    private; checked on lightning 2.6.6): ``StochasticWeightAveraging`` sets it for the extra epoch that
    recomputes the BatchNorm statistics of the averaged weights. Such steps have no loss to judge and no
    gradients to read. Fallback when missing: ``False`` (every step is a training step)."""
    return bool(getattr(getattr(trainer, "fit_loop", None), "_skip_backward", False))


def batches_per_epoch(trainer: Any, batches: Any = None) -> Optional[int]:
    """``batches``, else ``trainer.num_training_batches``, when it is a positive int; ``None`` for an epoch of unknown
    length."""
    batches = getattr(trainer, "num_training_batches", None) if batches is None else batches
    return batches if isinstance(batches, int) and not isinstance(batches, bool) and batches > 0 else None


def steps_per_epoch(trainer: Any, batches: Any = None) -> Optional[int]:
    """The optimizer steps of an epoch of ``batches`` training batches (``trainer.num_training_batches`` by
    default) under ``accumulate_grad_batches``; ``None`` for an epoch of unknown length. Lightning steps at the
    epoch's last batch whether or not its accumulation window is full: 11 batches at 3 a step make 4 steps."""
    batches = batches_per_epoch(trainer, batches)
    if batches is None:
        return None
    accumulate = max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1)
    return -(-batches // accumulate)


# ---------------------------------------------------------------- Lightning: callback metrics


def callback_metrics_store(trainer: Any) -> dict[str, Any]:
    """The dict behind ``trainer.callback_metrics``, read without the property's side effect.

    ``trainer._logger_connector._callback_metrics`` (private; checked on lightning 2.6.6): the public
    ``trainer.callback_metrics`` first folds in the values the LightningModule logged, converting its
    progress-bar values with ``.item()`` (a host sync each); the connector's dict is the same object
    without that. Fallback when missing: the public property (correct, with those syncs)."""
    store = getattr(getattr(trainer, "_logger_connector", None), "_callback_metrics", None)
    return store if isinstance(store, dict) else trainer.callback_metrics


# ---------------------------------------------------------------- torch: random streams of the devices


def fork_rng_of(devices: Sequence[torch.device]) -> Any:
    """``torch.random.fork_rng`` over the CPU's random stream and those of the accelerator devices among ``devices``
    (of the first accelerator type found: CUDA, MPS, XPU ...), so that a forward run for the suite's own purposes (the
    guard's replays, the per-example probe's runs on slices) leaves the run's dropout masks as they were. Public API,
    but before this, the fork named only CUDA devices: on MPS the replays drew from the MPS stream. A device type
    torch keeps no random stream for (or a torch whose ``fork_rng`` takes no ``device_type``): the CPU's alone."""
    kinds = [d for d in devices if d.type not in ("cpu", "meta")]
    if not kinds:
        return torch.random.fork_rng(devices=[])
    kind = kinds[0].type
    module = getattr(torch, kind, None)
    if module is None or not hasattr(module, "get_rng_state"):
        return torch.random.fork_rng(devices=[])
    indices = sorted({d.index or 0 for d in kinds if d.type == kind})
    if kind == "cuda":
        return torch.random.fork_rng(devices=indices)
    try:
        return torch.random.fork_rng(devices=indices, device_type=kind)
    except TypeError:  # a torch whose fork_rng forks CUDA devices only
        return torch.random.fork_rng(devices=[])


def seed_streams_of(device: torch.device, seed: int) -> None:
    """Seed the CPU's random stream and, on CUDA, ``device``'s: the streams :func:`fork_rng_of` of that device puts back
    (``torch.manual_seed`` would seed every CUDA device, some of them outside the fork)."""
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)


def _accelerator_streams(devices: Sequence[torch.device]) -> tuple[Any, list[int]]:
    """The torch module (``torch.cuda``, ``torch.mps`` ...) and the device indices of the accelerator random streams
    among ``devices`` (those :func:`fork_rng_of` forks); ``(None, [])`` where there are none."""
    kinds = [d for d in devices if d.type not in ("cpu", "meta")]
    if not kinds:
        return None, []
    module = getattr(torch, kinds[0].type, None)
    if module is None or not hasattr(module, "get_rng_state") or not hasattr(module, "set_rng_state"):
        return None, []
    return module, sorted({d.index or 0 for d in kinds if d.type == kinds[0].type})


def random_states_of(devices: Sequence[torch.device]) -> tuple[Tensor, list[tuple[int, Tensor]]]:
    """The CPU's random state and those of the accelerator devices among ``devices`` (host copies, no device work:
    about a microsecond on CPU), for :func:`set_random_states_of`."""
    module, indices = _accelerator_streams(devices)
    if module is None:
        return torch.get_rng_state(), []
    try:
        return torch.get_rng_state(), [(i, module.get_rng_state(i)) for i in indices]
    except TypeError:  # a backend whose get_rng_state takes no device (MPS: one device)
        return torch.get_rng_state(), [(0, module.get_rng_state())]


def set_random_states_of(devices: Sequence[torch.device], states: tuple[Tensor, list[tuple[int, Tensor]]]) -> None:
    """Set the random streams :func:`random_states_of` read (inside :func:`fork_rng_of`, which puts them back)."""
    cpu, accelerators = states
    torch.set_rng_state(cpu)
    module, _ = _accelerator_streams(devices)
    for index, state in accelerators if module is not None else ():
        try:
            module.set_rng_state(state, index)
        except TypeError:
            module.set_rng_state(state)


# ---------------------------------------------------------------- torch: autograd's version counters


def set_versions(tensors: Sequence[Tensor], versions: Sequence[int]) -> bool:
    """Set the autograd version counters of ``tensors`` to ``versions``: for a write that changed no value but was
    counted (the per-example probe's runs on slices skip such writes into parameters; one made on the parameter itself
    still counts a version, and the step's backward would take its saved weights for changed). No public API sets a
    version: ``torch._C._autograd._unsafe_set_version_counter`` (private; checked on torch 2.13, where it takes
    sequences; one tensor at a time in some earlier versions). Returns whether every version is set; ``False`` where the
    name is missing (then the caller refuses the write as before)."""
    setter = _version_setter()
    if setter is None:
        return False
    try:
        try:
            setter(tuple(tensors), tuple(int(v) for v in versions))
        except TypeError:
            for t, v in zip(tensors, versions):
                setter(t, int(v))
    except (TypeError, RuntimeError):
        return False
    return all(t._version == v for t, v in zip(tensors, versions))


def _version_setter() -> Any:
    return getattr(getattr(torch._C, "_autograd", None), "_unsafe_set_version_counter", None)


def versions_settable() -> bool:
    """Whether :func:`set_versions` can work in this torch (else a write it would have to undo is refused)."""
    return _version_setter() is not None


# ---------------------------------------------------------------- torch: what an operation writes in place

#: per aten operation, the indices and names of the arguments its schema marks as written in place (read once each)
_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensors the aten operation ``func`` (as a ``TorchDispatchMode`` receives it) writes into in place: the
    arguments its schema marks as written (``Tensor(a!)``, an in-place method's ``self``, an ``out=``). Read from
    ``func._schema`` (an ``OpOverload``'s schema: no public API lists what an operation mutates; checked on torch
    2.13). Without a schema, an operation is taken to write into nothing."""
    writes = _WRITES.get(func)
    if writes is None:
        schema = getattr(func, "_schema", None)
        writes = () if schema is None or not schema.is_mutable else tuple(
            (i, arg.name) for i, arg in enumerate(schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write)
        _WRITES[func] = writes
    out: list[Tensor] = []
    for i, name in writes:
        value = args[i] if i < len(args) else kwargs.get(name)
        out.extend(t for t in (value if isinstance(value, (list, tuple)) else (value,)) if isinstance(t, Tensor))
    return out

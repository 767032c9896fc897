"""Runs of a model that must leave its parameters as they were: the guard's replays of ``training_step`` on a kept
batch, the per-example probe's runs of the model on a slice of the batch.

A model may write into its own weights in a forward: ``nn.Embedding(max_norm=...)`` renormalises the rows it looks up,
Hugging Face's RWKV divides some weights in place when it enters eval mode and multiplies them back in training mode,
Gemma 3n and FLAVA clamp a coefficient's ``.data``. Run again outside the step, such a write would change the run's
weights, and (inside a step) the weights the step's backward saved, whose version check then fails.
:class:`WritesUndone` lets every operation run but first copies each parameter an operation is about to write into (at
its first write, and only those): :meth:`WritesUndone.undo` puts the values back, and the autograd versions where torch
can set them (:func:`~lightning_monitor._compat.set_versions`). :class:`ParametersReadOnly` refuses such writes instead,
for a torch that cannot put a version back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_monitor._compat import set_versions, written_tensors

__all__ = ["ParameterWrite", "ParametersReadOnly", "WritesUndone", "plain_parameters"]


def plain_parameters(module: torch.nn.Module) -> list[Tensor]:
    """The module's parameters that are plain tensors (a DTensor's local shard is left out: a dispatch mode sees its
    operations on the DTensor, not on the shard)."""
    return [p for p in module.parameters() if type(p.data) is Tensor]


def _by_storage(params: Iterable[Tensor]) -> dict[int, list[Tensor]]:
    """The parameters per storage address. Several parameters may be views of one storage (one flat buffer): a write
    into it is a write into each. Empty tensors have no storage to write into (their address is 0, shared by every
    empty tensor)."""
    out: dict[int, list[Tensor]] = {}
    for p in params:
        if p.device.type != "meta" and p.numel():
            out.setdefault(p.untyped_storage().data_ptr(), []).append(p)
    return out


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], storages: dict[int, list[Tensor]]) -> list[int]:
    """The addresses in ``storages`` of the storages ``func`` writes into."""
    keys = (t.untyped_storage().data_ptr() for t in written_tensors(func, args, kwargs)
            if t.device.type != "meta" and t.numel())
    return [key for key in keys if key in storages]


class WritesUndone(TorchDispatchMode):
    """Lets every operation run, but first copies the parameters of each storage an in-place operation is about to
    write into (at the first write into it); :meth:`undo` puts the copies back. Only what is written is copied."""

    def __init__(self, params: Iterable[Tensor]) -> None:
        super().__init__()
        self._storages = _by_storage(params)
        self._saved: dict[int, list[tuple[Tensor, Tensor, int]]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for key in _written(func, args, kwargs, self._storages):
            if key not in self._saved:  # the version is counted after the operation: this is the one before it
                self._saved[key] = [(p, p.detach().clone(), p._version) for p in self._storages[key]]
        return func(*args, **kwargs)

    def undo(self) -> bool:
        """Put back the values of the parameters written since the last :meth:`undo`, and their autograd versions;
        ``False`` where a version could not be set back (this torch lacks the setter)."""
        saved = [entry for entries in self._saved.values() for entry in entries]
        self._saved = {}
        if not saved:
            return True
        with torch.no_grad():
            for param, value, _ in saved:
                param.copy_(value)
        return set_versions([p for p, _, _ in saved], [v for _, _, v in saved])


class ParameterWrite(RuntimeError):
    """A run that must leave the parameters as they were tried to write into one (refused, see
    :class:`ParametersReadOnly`)."""


class ParametersReadOnly(TorchDispatchMode):
    """Refuses, before it runs, any operation that would write into the storage of one of ``params`` (raises
    :class:`ParameterWrite`): where torch cannot set a version back, a write undone afterwards would still leave the
    weights a step's backward saved at a new version (its check fails)."""

    def __init__(self, params: Iterable[Tensor]) -> None:
        super().__init__()
        self._storages = _by_storage(params)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _written(func, args, kwargs, self._storages):
            raise ParameterWrite(f"{func} writes into a parameter in place")
        return func(*args, **kwargs)

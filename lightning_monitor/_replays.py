"""Runs of a model that must leave it as it was: the guard's replays of ``training_step`` on a kept batch, the
per-example probe's runs of the model on a slice of the batch.

Besides its parameters and buffers, a forward may change a module's other attributes (``self.aux_loss = ...``, a list
appended to, RWKV's ``layers_are_rescaled`` flag): :func:`attributes` keeps them and :func:`restore_attributes` puts
them back.

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

import copy
import random
import types
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_monitor._compat import set_versions, written_tensors

__all__ = [
    "ParameterWrite", "ParametersReadOnly", "WritesUndone", "attributes", "host_random_states", "plain_parameters",
    "restore_attributes", "set_host_random_states",
]

#: the attributes every nn.Module keeps for itself (parameters, buffers, submodules, hooks, mode)
_MODULE_OWN = frozenset(vars(torch.nn.Module()))
#: plain tensors kept as attributes (a metric's counts, a memory bank) up to this many elements are copied before a
#: run; a larger one written in place by it is named in a warning
_SMALL_TENSOR = 1 << 22


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


def attributes(root: torch.nn.Module) -> list[tuple[torch.nn.Module, dict[str, Any], dict[str, Any], Any]]:
    """What a run (the probe's on a slice of the batch, the guard's replay) could change in ``root``'s modules besides
    their parameters and buffers: each module's other attributes (a forward that keeps its auxiliary loss,
    ``self.aux_loss = ...``, a training step that appends to a list), with copies of the containers among them (lists,
    deques, dicts and sets, a container inside one copied too), of the plain tensors (a metric's counts, a memory bank
    updated in place), of numpy arrays, the states of the random generators a module owns, and which tensors its
    buffers and parameters are (what lies further in, an object's fields, a container three levels deep, is not
    kept). :func:`restore_attributes` puts them back."""
    out = []
    for m in root.modules():
        attrs = {k: v for k, v in vars(m).items() if k not in _MODULE_OWN}
        kept: dict[str, Any] = {}
        for k, v in attrs.items():
            if isinstance(v, (list, deque, dict, set)):
                kept[k] = _copy_container(v)
            elif isinstance(v, tuple) and any(type(x) is Tensor for x in v):
                # a tuple cannot be refilled, but the tensors in it can be (moments kept as `(mean, var)`)
                kept[k] = _copy_container(v)
            elif type(v) is Tensor and not v.is_inference():
                kept[k] = (v._version, v.detach().clone() if v.numel() <= _SMALL_TENSOR else None)
            elif type(v).__name__ == "ndarray" and type(v).__module__ == "numpy":
                kept[k] = v.copy()  # counts kept in a numpy array
            else:
                streams = _Streams.of(v)
                if streams is not None:
                    kept[k] = streams
        # the module's own buffers and parameters as objects, and each parameter's data: a step may reassign a buffer
        # (`self.queue = torch.cat(...)`, which replaces it in `_buffers`) or a parameter's data (`p.data = ...`, a
        # momentum update no operation writes in place). A module with sharded parameters (FSDP2's DTensors) has them
        # swapped for gathered ones by FSDP in each forward, by its own bookkeeping: left to it
        plain = all(p is None or type(p.data) is Tensor for p in m._parameters.values())
        own = (dict(m._buffers), dict(m._parameters) if plain else None,
               {k: p.data for k, p in m._parameters.items() if p is not None} if plain else {})
        out.append((m, attrs, kept, own))
    return out


def _stream_state(v: Any) -> Any:
    """The state of a random generator (torch's ``Generator``, numpy's ``Generator`` and ``RandomState``, Python's
    ``random.Random``), ``None`` for anything else."""
    if isinstance(v, torch.Generator):
        return v.get_state()
    if isinstance(v, random.Random) and not isinstance(v, random.SystemRandom):
        return v.getstate()
    kind = type(v)
    if kind.__module__.startswith("numpy.random"):
        if kind.__name__ == "Generator":
            return v.bit_generator.state
        if kind.__name__ == "RandomState":
            return v.get_state()
    return None


def _set_stream_state(v: Any, state: Any) -> None:
    if isinstance(v, torch.Generator):
        v.set_state(state)
    elif isinstance(v, random.Random):
        v.setstate(state)
    elif type(v).__name__ == "Generator":
        v.bit_generator.state = state
    else:
        v.set_state(state)


class _Streams:
    """The states of the random generators an attribute holds: the attribute itself (``self.rng =
    np.random.default_rng(0)``, a ``torch.Generator``, a ``random.Random``) or the fields of a plain object it holds (an
    augmentation helper that is no module: ``self.mixup = MixUp(...)`` with its own generator). A replay that draws from
    them moved the run's own draws on: the run went another way from the step after the first replay, and a replay of a
    MixUp step drew another mixing than the step, so the loss it gave was another batch's (2 of 12 healthy runs rolled
    back)."""

    def __init__(self, pairs: list[tuple[Any, Any]]) -> None:
        self.pairs = pairs

    @classmethod
    def of(cls, v: Any) -> "_Streams | None":
        state = _stream_state(v)
        if state is not None:
            return cls([(v, state)])
        fields = getattr(v, "__dict__", None)
        if not isinstance(fields, dict) or isinstance(v, (type, types.ModuleType, torch.nn.Module, Tensor)):
            return None
        pairs = [(x, st) for x in fields.values() for st in [_stream_state(x)] if st is not None]
        return cls(pairs) if pairs else None

    def restore(self) -> None:
        for v, state in self.pairs:
            _set_stream_state(v, state)


def _copy_container(v: Any) -> Any:
    """A copy of a container, of the containers directly inside it (their items are not copied) and of the plain
    tensors directly inside it (up to ``_SMALL_TENSOR`` elements: a dict holding a memory bank)."""

    def inner(x: Any) -> Any:
        if isinstance(x, (list, deque, dict, set)):
            return copy.copy(x)
        if type(x) is Tensor and not x.is_inference() and x.numel() <= _SMALL_TENSOR:
            return x.detach().clone()
        return x

    if isinstance(v, dict):
        return [(k, x, inner(x)) for k, x in v.items()]
    return [(x, inner(x)) for x in v]


def _refill(v: Any, saved: Any) -> None:
    """Put back the contents :func:`_copy_container` saved, in place (the object stays the one the model holds)."""
    for entry in saved:
        item, contents = entry[-2], entry[-1]
        if item is not contents and isinstance(item, (list, deque, dict, set)):
            item.clear()
            if isinstance(item, dict):
                dict.update(item, contents)  # not the subclass's own update (a Counter's adds counts)
            elif isinstance(item, set):
                item.update(contents)
            else:
                item.extend(contents)
        elif item is not contents and isinstance(item, Tensor):
            if item.shape != contents.shape:
                item.data = contents
            elif not torch.equal(item, contents):
                item.data.copy_(contents)
    if isinstance(v, tuple):
        return  # its items are the same objects: their contents were put back above
    v.clear()
    if isinstance(v, dict):
        # dict's own update: a Counter's counted the (key, value) pairs as keys
        dict.update(v, ((k, item) for k, item, _ in saved))
    elif isinstance(v, set):
        v.update(item for item, _ in saved)
    else:
        v.extend(item for item, _ in saved)


def restore_attributes(saved: list[tuple[torch.nn.Module, dict[str, Any], dict[str, Any], Any]]) -> list[str]:
    """Undo a run's changes to what :func:`attributes` saved: attributes set anew get their old object back, attributes
    added go, the saved containers, tensors and generators get their old contents (a tensor written through its
    ``.data``, whose version does not move, is found by its values), buffers and parameters reassigned get their old
    tensors back, a parameter whose data was reassigned its old data. Returns the large tensors (not copied) that the
    run wrote in place: they cannot be put back."""
    lost: list[str] = []
    for m, attrs, kept, (buffers, params, datas) in saved:
        d = vars(m)
        for k in [k for k in d if k not in _MODULE_OWN and k not in attrs]:
            del d[k]
        d.update(attrs)
        for k, old in kept.items():
            v = attrs[k]
            if isinstance(old, _Streams):
                old.restore()
            elif isinstance(v, (list, deque, dict, set, tuple)):
                _refill(v, old)
            elif not isinstance(v, Tensor):  # a numpy array, its contents put back in place
                if v.shape == old.shape:
                    v[...] = old
                else:
                    d[k] = old
            elif old[1] is None:
                if v._version != old[0]:
                    lost.append(f"{type(m).__name__}.{k}")
            elif v.shape != old[1].shape:
                v.data = old[1]
            elif v._version != old[0] or not torch.equal(v, old[1]):
                v.data.copy_(old[1])
        if any(m._buffers.get(k) is not b for k, b in buffers.items()) or len(m._buffers) != len(buffers):
            m._buffers.clear()
            m._buffers.update(buffers)
        if params is not None and (any(m._parameters.get(k) is not p for k, p in params.items())
                                   or len(m._parameters) != len(params)):
            m._parameters.clear()
            m._parameters.update(params)
        for k, data in datas.items():
            p = params[k]
            if type(p.data) is not Tensor or (p.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
                                              and p.shape == data.shape):
                continue
            with torch.no_grad():
                p.data = data
    return lost


def host_random_states() -> tuple[Any, Any]:
    """Python's and numpy's global random states (a model may draw from them: Hugging Face's SpecAugment masks do)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with the test and benchmark extras
        return random.getstate(), None
    return random.getstate(), np.random.get_state()


def set_host_random_states(states: tuple[Any, Any]) -> None:
    random.setstate(states[0])
    if states[1] is not None:
        import numpy as np

        np.random.set_state(states[1])

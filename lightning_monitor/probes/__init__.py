"""Hooks that capture layer inputs or per-example gradient norms, armed only on monitored steps."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Optional

_DRY_RUN: ContextVar[bool] = ContextVar("lightning_monitor_dry_run", default=False)


@contextmanager
def dry_run() -> Iterator[None]:
    """A forward that one monitor runs for its own purposes (the per-example probe runs a module again on a
    smaller batch to find its batch dimension): other monitors' forward hooks, which see it, ignore it."""
    token = _DRY_RUN.set(True)
    try:
        yield
    finally:
        _DRY_RUN.reset(token)


def in_dry_run() -> bool:
    """Whether the current forward is a :func:`dry_run`."""
    return _DRY_RUN.get()


def in_backward() -> bool:
    """Whether the autograd engine runs a backward pass on this thread now: a module's forward then is a
    recomputation by activation checkpointing."""
    import torch

    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


_FIRST: dict[type, Optional[str]] = {}


def _first_parameter(module: Any) -> Optional[str]:
    """The name of the first parameter of ``type(module).forward`` after ``self`` (cached per type)."""
    kind = type(module)
    if kind not in _FIRST:
        try:
            params = list(inspect.signature(kind.forward).parameters.values())[1:]
        except (TypeError, ValueError):
            params = []
        first = params[0] if params else None
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        _FIRST[kind] = first.name if first is not None and first.kind in positional else None
    return _FIRST[kind]


def call_args(args: tuple[Any, ...], kwargs: dict[str, Any], module: Any = None) -> tuple[Any, ...]:
    """The positional inputs of a module's call as a forward hook registered ``with_kwargs=True`` sees them, with the
    first input passed by keyword put first: ``layer(input=x)`` (the name ``nn.Linear``, the convolutions,
    ``nn.Embedding``, the norms and the recurrent layers give it), ``attention(query=x, ...)`` (the first parameter of
    the module's ``forward``, where ``module`` is given), so that a layer called either way is read the same."""
    if args or not kwargs:
        return args
    name = _first_parameter(module) if module is not None else None
    for key in (name, "input"):
        if key is not None and key in kwargs:
            return (kwargs[key],)
    return args

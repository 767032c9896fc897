"""Hooks that capture layer inputs or per-example gradient norms, armed only on monitored steps."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

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


def call_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The positional inputs of a module's call as a forward hook registered ``with_kwargs=True`` sees them, with an
    input passed by keyword (``layer(input=x)``: the name ``nn.Linear``, the convolutions, ``nn.Embedding`` and the
    norms give their input) put first, so that a layer called either way is read the same."""
    if not args and "input" in kwargs:
        return (kwargs["input"],)
    return args

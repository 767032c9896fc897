"""Argument helpers shared by the suite's constructors: validation with errors that say what to
pass, deprecated keyword aliases, and dotted import paths for callables (LightningCLI YAML)."""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["check_bool", "check_int", "check_fraction", "check_positive", "deprecated_aliases", "resolve_callable"]


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a bool when it is one (or a NumPy bool), else a ``ValueError`` naming ``name``: a string such as
    ``"no"`` is truthy, and taken for ``True`` it did the opposite of what was meant."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise ValueError(f"`{name}` must be True or False, got {value!r}.")


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` when it is an integer (not a bool) ``>= minimum``, else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
    return value


def check_fraction(name: str, value: Any, low: float = 0.0, high: float = 1.0, high_inclusive: bool = True) -> float:
    """``value`` as a float when it is a finite number in ``[low, high]`` (``[low, high)`` with
    ``high_inclusive=False``), else a ``ValueError`` naming ``name`` and the interval."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and low <= value and (value <= high if high_inclusive else value < high)
    if not ok:
        raise ValueError(f"`{name}` must be a number in [{low}, {high}{']' if high_inclusive else ')'}, got {value!r}.")
    return float(value)


def check_positive(name: str, value: Any) -> float:
    """``value`` as a float when it is a finite number ``> 0``, else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"`{name}` must be a positive number, got {value!r}.")
    return float(value)


def check_nonnegative(name: str, value: Any) -> float:
    """``value`` as a float when it is a finite number ``>= 0``, else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")
    return float(value)


_Init = TypeVar("_Init", bound=Callable[..., None])


def deprecated_aliases(**aliases: str) -> Callable[[_Init], _Init]:
    """Decorator of a monitor's ``__init__``: each ``old="new"`` makes the keyword ``old`` a deprecated
    alias of the argument ``new`` (the suite's one vocabulary, see the README). Passing ``old`` emits a
    ``DeprecationWarning`` and passes its value as ``new``; passing both (``new`` by keyword or by
    position) raises a ``ValueError``. The aliases stay one release.
    """

    def wrap(init: _Init) -> _Init:
        signature = inspect.signature(init)
        for new in aliases.values():
            if new not in signature.parameters:
                raise TypeError(f"{init.__qualname__} has no argument {new!r} to alias.")

        @functools.wraps(init)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
            for old, new in aliases.items():
                if old not in kwargs:
                    continue
                value = kwargs.pop(old)
                owner = type(self).__name__
                if new in kwargs or new in signature.bind_partial(self, *args).arguments:
                    raise ValueError(f"{owner}: pass `{new}` only; `{old}` is its deprecated alias.")
                warnings.warn(
                    f"{owner}(`{old}`=...) is deprecated and will be removed in the next release: use `{new}`.",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = value
            init(self, *args, **kwargs)

        wrapper.deprecated_aliases = dict(aliases)  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return wrap


def resolve_callable(arg: str, value: Any) -> Any:
    """``value`` when it is ``None`` or callable; for a string, the callable its dotted import path
    names (``"my_package.data.targets"``, the way LightningCLI YAML spells a function). So an argument
    such as ``target_fn`` takes either. A path that does not import, or names something that is not
    callable, is an error that says which argument and which path."""
    if value is None or callable(value):
        return value
    if not isinstance(value, str):
        raise TypeError(f"`{arg}` must be a callable or a dotted import path string, got {type(value).__name__}.")
    parts = value.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for name in parts[split:]:
                obj = getattr(obj, name)
        except AttributeError:
            break
        if not callable(obj):
            raise TypeError(f"`{arg}`={value!r} names a {type(obj).__name__}, not a callable.")
        return obj
    raise ValueError(f"`{arg}`={value!r} is not an importable dotted path (`package.module.function`).")

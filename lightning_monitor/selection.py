"""Selecting modules of a model by qualified name pattern and by type.

Patterns are shell-style globs matched against the whole qualified name (``fnmatch``), e.g.
``"blocks.*.attn.*"`` or ``"*mlp.fc"``. A name listed without any glob character must exist.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase
from typing import Optional, Union

from torch import nn

__all__ = ["select_modules", "as_patterns"]

Patterns = Optional[Union[str, Sequence[str]]]


def as_patterns(patterns: Patterns, argument: str) -> tuple[str, ...]:
    """Normalise ``None`` / one string / a sequence of strings to a tuple of strings."""
    if patterns is None:
        return ()
    if isinstance(patterns, str):
        return (patterns,)
    out = tuple(patterns)
    for p in out:
        if not isinstance(p, str) or not p:
            raise TypeError(f"`{argument}` must be a string or a sequence of non-empty strings, got {p!r}.")
    return out


def _is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")


def _preview(names: Iterable[str], limit: int = 12) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return shown + more


def select_modules(
    model: nn.Module,
    include: Patterns = None,
    exclude: Patterns = None,
    types: tuple[type[nn.Module], ...] = (nn.Linear,),
    owner: str = "monitor",
) -> dict[str, nn.Module]:
    """Modules of ``model`` whose qualified name matches ``include`` (all, if ``None``), matches no
    ``exclude`` pattern, and whose type is one of ``types``; in ``named_modules`` order.

    Raises:
        ValueError: an ``include`` or ``exclude`` pattern that matches no module name (the message
            lists the names it saw), or an included name whose module has the wrong type.
    """
    inc = as_patterns(include, "include")
    exc = as_patterns(exclude, "exclude")
    named = {name: mod for name, mod in model.named_modules() if name}
    for argument, patterns in (("include", inc), ("exclude", exc)):
        for pattern in patterns:
            if not any(fnmatchcase(name, pattern) for name in named):
                kind = "pattern" if _is_glob(pattern) else "module name"
                raise ValueError(
                    f"{owner}: `{argument}` {kind} {pattern!r} matches no module of "
                    f"{type(model).__name__}. Module names are: {_preview(named)}."
                )
    type_names = "/".join(t.__name__ for t in types)
    selected: dict[str, nn.Module] = {}
    for name, mod in named.items():
        if inc and not any(fnmatchcase(name, p) for p in inc):
            continue
        if any(fnmatchcase(name, p) for p in exc):
            continue
        if not isinstance(mod, types):
            if name in inc:
                raise ValueError(
                    f"{owner}: `include` names {name!r}, a {type(mod).__name__}; only {type_names} "
                    "modules can be monitored here."
                )
            continue
        selected[name] = mod
    return selected

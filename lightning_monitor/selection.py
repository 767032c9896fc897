"""Selecting modules of a model by qualified name pattern and by type.

Patterns are shell-style globs matched against the whole qualified name (``fnmatch``), e.g.
``"blocks.*.attn.*"`` or ``"*mlp.fc"``. A name listed without any glob character must exist.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase
from typing import Optional, Union

from torch import Tensor, nn

__all__ = ["select_modules", "as_patterns", "hf_conv1d_type", "linear_types", "weight_matrix"]

Patterns = Optional[Union[str, Sequence[str]]]


def as_patterns(patterns: Patterns, argument: str) -> tuple[str, ...]:
    """Normalise ``None`` / one string / a sequence of strings to a tuple of strings."""
    if patterns is None:
        return ()
    if isinstance(patterns, str):
        return (patterns,)
    try:
        out = tuple(patterns)
    except TypeError:  # a number, a module: not a sequence at all
        raise TypeError(
            f"`{argument}` must be a string or a sequence of non-empty strings, got {patterns!r}.") from None
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


def hf_conv1d_type() -> Optional[type[nn.Module]]:
    """``transformers.pytorch_utils.Conv1D`` (GPT-2's projections: ``y = x @ W + b``, ``W`` of shape
    ``[in, out]``) when ``transformers`` is loaded, else ``None``. Never imports it: a model holding such a
    module has loaded it already."""
    module = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(module, "Conv1D", None) if module is not None else None
    return conv1d if isinstance(conv1d, type) and issubclass(conv1d, nn.Module) else None


def linear_types() -> tuple[type[nn.Module], ...]:
    """The module types that apply a weight matrix to the last dimension of their input: ``nn.Linear``,
    and Hugging Face ``Conv1D`` when ``transformers`` is loaded (see :func:`weight_matrix`)."""
    conv1d = hf_conv1d_type()
    return (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)


def weight_matrix(module: nn.Module) -> Tensor:
    """The ``[out, in]`` matrix ``W`` with which ``module`` maps an input row ``x`` to ``W x`` (plus bias):
    an ``nn.Linear``'s weight; a Hugging Face ``Conv1D``'s weight transposed (a view, no copy); a
    convolution's weight as ``[out, in * kernel]`` (its input rows are then the unfolded patches); an
    ``nn.MultiheadAttention``'s packed input projection ``in_proj_weight`` ``[3E, E]``."""
    if isinstance(module, nn.MultiheadAttention):  # its packed q/k/v input projection, applied to the query
        return module.in_proj_weight
    weight = module.weight
    conv1d = hf_conv1d_type()
    if conv1d is not None and isinstance(module, conv1d):
        return weight.t()
    return weight.reshape(weight.shape[0], -1)

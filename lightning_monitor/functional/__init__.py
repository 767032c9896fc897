"""Pure tensor functions behind the monitors: no Lightning, no hooks, no state.

Each submodule holds one method: :mod:`.robust` (robust statistics of a history),
:mod:`.spectral` (spectral alignment), :mod:`.noise_scale` (gradient noise scale),
:mod:`.gwa` (gradient-weight alignment), :mod:`.grades` (per-component gradient statistics).
Names are imported lazily from the submodule that defines them.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("robust", "spectral", "noise_scale", "gwa", "grades")


def __getattr__(name: str) -> Any:
    for sub in _SUBMODULES:
        try:
            module = importlib.import_module(f"{__name__}.{sub}")
        except ModuleNotFoundError as err:
            if err.name == f"{__name__}.{sub}":
                continue
            raise
        if name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            globals()[name] = value
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

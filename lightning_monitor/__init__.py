"""lightning-monitor: training-health callbacks for PyTorch Lightning.

Public names are imported lazily, so that ``import lightning_monitor`` stays cheap and the pure
functions in :mod:`lightning_monitor.functional` never import Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "Alert": "lightning_monitor.alerts",
    "AlertHub": "lightning_monitor.alerts",
    "read_alerts": "lightning_monitor.alerts",
    "Monitor": "lightning_monitor.callbacks.base",
    "DivergenceGuard": "lightning_monitor.callbacks.divergence_guard",
    "SpectralAlignmentMonitor": "lightning_monitor.callbacks.spectral_alignment",
    "GradientNoiseScaleMonitor": "lightning_monitor.callbacks.noise_scale",
    "PerExampleGradNorms": "lightning_monitor.probes.per_example",
    "GradientWeightAlignmentMonitor": "lightning_monitor.callbacks.gradient_weight_alignment",
    "GradientEarlyStopping": "lightning_monitor.callbacks.grades",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from lightning_monitor.alerts import Alert, AlertHub, read_alerts
    from lightning_monitor.callbacks.base import Monitor
    from lightning_monitor.callbacks.divergence_guard import DivergenceGuard
    from lightning_monitor.callbacks.grades import GradientEarlyStopping
    from lightning_monitor.callbacks.gradient_weight_alignment import GradientWeightAlignmentMonitor
    from lightning_monitor.callbacks.noise_scale import GradientNoiseScaleMonitor
    from lightning_monitor.callbacks.spectral_alignment import SpectralAlignmentMonitor
    from lightning_monitor.probes.per_example import PerExampleGradNorms


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_monitor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

"""lightning-monitor: training-health callbacks for PyTorch Lightning.

Public names are imported lazily, so that ``import lightning_monitor`` stays cheap and the pure
functions in :mod:`lightning_monitor.functional` never import Lightning (about 3.5 s of imports).

LightningCLI resolves a short class name (``--trainer.callbacks+=DivergenceGuard``) among the
subclasses of ``Callback`` that exist, i.e. whose modules were imported. So the callbacks are
imported as soon as both this package and Lightning are: at once when ``lightning.pytorch`` is
already imported, else right after ``lightning.pytorch.cli`` (where ``LightningCLI`` lives) is, by a
one-shot import hook. A process that never imports Lightning never imports them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import TYPE_CHECKING, Any, Optional

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "Alert": "lightning_monitor.alerts",
    "AlertHub": "lightning_monitor.alerts",
    "read_alerts": "lightning_monitor.alerts",
    "Monitor": "lightning_monitor.callbacks.base",
    "NothingToWatch": "lightning_monitor.callbacks.base",
    "Streak": "lightning_monitor.callbacks.base",
    "DivergenceGuard": "lightning_monitor.callbacks.divergence_guard",
    "SpectralAlignmentMonitor": "lightning_monitor.callbacks.spectral_alignment",
    "GradientNoiseScaleMonitor": "lightning_monitor.callbacks.noise_scale",
    "PerExampleGradNorms": "lightning_monitor.probes.per_example",
    "GradientWeightAlignmentMonitor": "lightning_monitor.callbacks.gradient_weight_alignment",
    "GradientEarlyStopping": "lightning_monitor.callbacks.grades",
    "HealthMonitor": "lightning_monitor.preset",
    "TensorBoardDashboard": "lightning_monitor.dashboard",
    "AlertWebhook": "lightning_monitor.webhook",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from lightning_monitor.alerts import Alert, AlertHub, read_alerts
    from lightning_monitor.callbacks.base import Monitor, NothingToWatch, Streak
    from lightning_monitor.callbacks.divergence_guard import DivergenceGuard
    from lightning_monitor.callbacks.grades import GradientEarlyStopping
    from lightning_monitor.callbacks.gradient_weight_alignment import GradientWeightAlignmentMonitor
    from lightning_monitor.callbacks.noise_scale import GradientNoiseScaleMonitor
    from lightning_monitor.callbacks.spectral_alignment import SpectralAlignmentMonitor
    from lightning_monitor.dashboard import TensorBoardDashboard
    from lightning_monitor.preset import HealthMonitor
    from lightning_monitor.probes.per_example import PerExampleGradNorms
    from lightning_monitor.webhook import AlertWebhook


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_monitor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


# ---------------------------------------------------------------------- LightningCLI short names
#: The modules that define the package's Lightning callbacks.
_CALLBACK_MODULES = ("lightning_monitor.callbacks", "lightning_monitor.preset", "lightning_monitor.dashboard",
                     "lightning_monitor.webhook")


def _import_callbacks() -> None:
    for module in _CALLBACK_MODULES:
        importlib.import_module(module)


class _AfterLightningCLI(importlib.abc.MetaPathFinder):
    """Imports the callbacks right after ``lightning.pytorch.cli`` has been executed, then leaves
    ``sys.meta_path``. It finds nothing itself: it wraps the spec the other finders return."""

    target = "lightning.pytorch.cli"

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Optional[Any]:
        if fullname != self.target:
            return None
        _remove_hook()
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_import(module: Any) -> None:
            try:
                exec_module(module)
            finally:
                loader.__dict__.pop("exec_module", None)
            try:
                _import_callbacks()
            except Exception as err:  # never break the user's import of LightningCLI
                warnings.warn(f"lightning_monitor: its callbacks could not be imported for LightningCLI: {err!r}")

        try:
            loader.exec_module = exec_then_import
        except (AttributeError, TypeError):  # a loader that takes no attribute: short names need an import
            return spec
        return spec


def _remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterLightningCLI)]


if "lightning.pytorch" in sys.modules:
    _import_callbacks()
elif "lightning.pytorch.cli" not in sys.modules and not any(isinstance(f, _AfterLightningCLI) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterLightningCLI())

"""Lightning callbacks: schedule, select modules, call probes and functional, log, alert, act.

Importing this package imports every monitor: each is then a known subclass of Lightning's
``Callback``, which is how LightningCLI (jsonargparse) resolves a short class name such as
``--trainer.callbacks+=DivergenceGuard``.
"""

from lightning_monitor.callbacks.base import Monitor, NothingToWatch
from lightning_monitor.callbacks.divergence_guard import DivergenceGuard
from lightning_monitor.callbacks.grades import GradientEarlyStopping
from lightning_monitor.callbacks.gradient_weight_alignment import GradientWeightAlignmentMonitor
from lightning_monitor.callbacks.noise_scale import GradientNoiseScaleMonitor
from lightning_monitor.callbacks.spectral_alignment import SpectralAlignmentMonitor

__all__ = [
    "DivergenceGuard",
    "GradientEarlyStopping",
    "GradientNoiseScaleMonitor",
    "GradientWeightAlignmentMonitor",
    "Monitor",
    "NothingToWatch",
    "SpectralAlignmentMonitor",
]

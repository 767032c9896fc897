"""A TensorBoard dashboard of a run's health: a Custom Scalars layout, written once per run.

TensorBoard's Scalars tab shows one card per tag, grouped by the prefix before the first ``/``; a
model with many layers buries the few signals that say whether the run is healthy. The layout built
here puts them on one page (TensorBoard's *Custom Scalars* tab), model level first:

* **health**: the loss (any scalar tag with ``loss`` in its name), the cumulative count of alerts
  per severity (``alerts/count/*``), spectral alignment's sign diversity and collapsed fraction, its
  ``sigma_1`` growth, ``B_simple`` against the batch size in use, the GWA score and GradES's frozen
  fraction, each card only for a monitor of the run;
* **per layer: <monitor>**: one card per statistic with one line per layer, for monitors that log
  per-layer scalars (``per_layer_scalars``). Folded per-layer statistics are histograms
  (``<monitor>/layers/<stat>``) in the Histograms tab, which Custom Scalars cannot show.

Cards select their tags by regular expression (matched from the tag's start), so one layout fits
every run of the same monitors and TensorBoard merges the layouts of several runs into one page.

:class:`~lightning_monitor.HealthMonitor` writes the layout at the start of the fit; with monitors
constructed one by one, add :class:`TensorBoardDashboard` to the callbacks. For runs logged without
either, :func:`health_layout` and :func:`write_layout` write one into an existing log directory.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Collection
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_monitor.alerts import _tensorboard_writer
from lightning_monitor.callbacks.base import Monitor

__all__ = ["LAYER_STATS", "TensorBoardDashboard", "health_layout", "write_dashboard", "write_layout"]

Layout = dict[str, dict[str, list[Any]]]

#: Model-level cards: ``(monitor, title, tag regexes)``; ``monitor`` None: always shown.
_HEALTH_CARDS: tuple[tuple[Optional[str], str, list[str]], ...] = (
    (None, "loss", [r"(?i)(?!(sa|gns|gwa|grades|guard|alerts)/).*loss"]),
    (None, "alerts: count per severity", [r"alerts/count/"]),
    ("sa", "sa: sign diversity, collapsed fraction",
     [r"sa/(sign_diversity_mean|diversity_ratio|collapsed_fraction)$"]),
    ("sa", "sa: sigma_1 growth", [r"sa/sigma_growth$"]),
    ("gns", "gns: B_simple vs batch size", [r"gns/(b_simple|batch_size)$"]),
    ("gwa", "gwa: score (per epoch)", [r"gwa/score$"]),
    ("grades", "grades: frozen fraction", [r"grades/frozen_fraction$"]),
)

#: Per-layer statistics of the suite's monitors, one card each when they are logged as scalars.
LAYER_STATS: dict[str, tuple[str, ...]] = {
    "sa": ("sign_diversity", "sigma", "mean_abs"),
    "gns": ("b_simple",),
    "grades": ("ratio", "stat"),
}

HEALTH_CATEGORY = "health"


def health_layout(monitors: Collection[str], per_layer: Collection[str] = ()) -> Layout:
    """The layout for a run of ``monitors`` (their names: ``"sa"``, ``"gns"``, ``"gwa"``, ``"grades"``,
    ``"guard"`` ...), with a per-layer category for each name in ``per_layer``; in the form
    ``SummaryWriter.add_custom_scalars`` takes (``{category: {title: ["Multiline", [regex, ...]]}}``)."""
    health = {
        title: ["Multiline", list(tags)] for name, title, tags in _HEALTH_CARDS if name is None or name in monitors
    }
    layout: Layout = {HEALTH_CATEGORY: health}
    for name in per_layer:
        stats = LAYER_STATS.get(name)
        if stats is None:  # a monitor outside the suite: one card with every per-layer key
            card = ["Multiline", [rf"{re.escape(name)}/[^/]+/"]]
            layout[f"per layer: {name}"] = {f"{name}: every per-layer statistic": card}
            continue
        layout[f"per layer: {name}"] = {
            f"{name}: {stat} per layer": ["Multiline", [rf"{re.escape(name)}/(?!layers/)[^/]+/{re.escape(stat)}$"]]
            for stat in stats
        }
    return layout


def write_layout(writer: Any, layout: Layout) -> None:
    """Write ``layout`` with ``writer`` (a ``torch.utils.tensorboard.SummaryWriter``) and flush it.
    For a run logged without a layout: ``write_layout(SummaryWriter(run_dir), health_layout(...))``
    adds one to the run directory (TensorBoard reads every event file there)."""
    writer.add_custom_scalars(layout)
    writer.flush()


_written: weakref.WeakSet[Any] = weakref.WeakSet()


def write_dashboard(trainer: pl.Trainer) -> bool:
    """Write the layout of the suite's monitors in ``trainer.callbacks`` (idle ones left out) to
    every TensorBoard logger of ``trainer``, once per logger's writer; rank 0 only. Returns whether
    a layout was written."""
    if trainer.global_rank != 0:
        return False
    layout = _layout_of(trainer)
    wrote = False
    for logger in trainer.loggers:
        writer = _tensorboard_writer(logger)
        if writer is None or writer in _written:
            continue
        write_layout(writer, layout)
        _written.add(writer)
        wrote = True
    return wrote


def refresh_dashboard(trainer: pl.Trainer) -> None:
    """Write the layout again to the TensorBoard loggers that got one (:func:`write_dashboard`), now that a monitor went
    idle during the fit (GWA learns from the first batch's targets that a regression has no classifier to score): its
    cards no longer stay empty. TensorBoard shows a run's last layout; rank 0 only."""
    if trainer.global_rank != 0:
        return
    writers = [w for w in map(_tensorboard_writer, trainer.loggers) if w is not None and w in _written]
    if not writers:
        return
    layout = _layout_of(trainer)
    for writer in writers:
        write_layout(writer, layout)


def _layout_of(trainer: pl.Trainer) -> Layout:
    """The layout of the suite's monitors in ``trainer.callbacks`` that are not idle."""
    monitors = [cb for cb in trainer.callbacks if isinstance(cb, Monitor) and getattr(cb, "idle_reason", None) is None]
    names = list(dict.fromkeys(m.name for m in monitors))
    per_layer = list(dict.fromkeys(m.name for m in monitors if m.per_layer_scalars and _has_layers(m)))
    return health_layout(names, per_layer)


def _has_layers(monitor: Any) -> bool:
    """Whether ``monitor`` logs per-layer keys: the suite's monitors that do, as configured, and any
    other monitor (its keys are unknown until it logs)."""
    if monitor.name == "gns":
        return bool(getattr(monitor, "per_layer", True))
    if monitor.name == "grades":
        return bool(getattr(monitor, "log_stats", True))
    return monitor.name not in ("gwa", "guard")


class TensorBoardDashboard(Callback):
    """Writes the health dashboard (:func:`write_dashboard`) to every TensorBoard logger at the start
    of the fit, for monitors constructed one by one (:class:`~lightning_monitor.HealthMonitor` writes
    it itself)."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        write_dashboard(trainer)

"""Alerts: the record every monitor raises, and the sinks that carry it.

Every alert reaches, on global rank 0:

* Python logging, logger name ``lightning_monitor`` (info -> INFO, warning -> WARNING,
  critical -> CRITICAL);
* every Lightning logger in ``trainer.loggers`` as the scalar ``alerts/<monitor>``: the severity
  level (1 info, 2 warning, 3 critical), or 0 when a condition clears;
* TensorBoard's Text tab (tag ``alerts/<monitor>``, readable Markdown) for each ``TensorBoardLogger``;
* the append-only file ``alerts.jsonl`` in the first logger's log directory (the trainer's
  ``default_root_dir`` without a logger), one JSON object per line, flushed and fsynced per alert
  so that it survives a crash.

Every rank hears every alert it raises through :meth:`AlertHub.subscribe`, so that acting callbacks
(:class:`~lightning_monitor.DivergenceGuard`) can reduce a decision across ranks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Alert", "AlertHub", "Severity", "SEVERITY_LEVELS", "log"]

log = logging.getLogger("lightning_monitor")

Severity = Literal["info", "warning", "critical"]
SEVERITY_LEVELS: dict[str, int] = {"info": 1, "warning": 2, "critical": 3}
_PY_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.CRITICAL}
ALERTS_FILENAME = "alerts.jsonl"


def _clean_number(value: Optional[float]) -> Optional[float]:
    return None if value is None else float(value)


@dataclass(frozen=True)
class Alert:
    """One alert raised by a monitor.

    Attributes:
        step: optimizer step the alert refers to (``trainer.global_step`` when it was measured).
        monitor: short name of the monitor that raised it (``"guard"``, ``"sa"``, ``"gns"`` ...).
        kind: what happened, e.g. ``"nonfinite_loss"``, ``"loss_spike"``, ``"collapse"``; a condition
            that clears raises ``"<kind>_cleared"`` with severity ``"info"``.
        severity: ``"info"``, ``"warning"`` or ``"critical"``. Critical alerts make a
            :class:`~lightning_monitor.DivergenceGuard` act.
        message: a sentence for humans, saying what to do where it can.
        value: the measured value behind the alert, if any (``nan``/``inf`` are kept as such).
        threshold: the threshold it crossed, if any.
        layer: the module's qualified name for a per-layer alert, else ``None``.
        details: structured facts behind an action, if any (e.g. the steps and batches of a rollback).
    """

    step: int
    monitor: str
    kind: str
    severity: Severity
    message: str
    value: Optional[float] = None
    threshold: Optional[float] = None
    layer: Optional[str] = None
    details: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        if self.severity not in SEVERITY_LEVELS:
            raise ValueError(
                f"Alert severity must be one of {sorted(SEVERITY_LEVELS)}, got {self.severity!r}."
            )
        object.__setattr__(self, "step", int(self.step))
        object.__setattr__(self, "value", _clean_number(self.value))
        object.__setattr__(self, "threshold", _clean_number(self.threshold))

    @property
    def level(self) -> int:
        """Numeric severity: 1 info, 2 warning, 3 critical."""
        return SEVERITY_LEVELS[self.severity]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with every field; non-finite numbers become the strings ``"nan"``/``"inf"``."""
        out = asdict(self)
        for key in ("value", "threshold"):
            v = out[key]
            if v is not None and not math.isfinite(v):
                out[key] = str(v)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Alert:
        """Inverse of :meth:`to_dict` (reads a line of ``alerts.jsonl``)."""
        data = dict(data)
        for key in ("value", "threshold"):
            if isinstance(data.get(key), str):
                data[key] = float(data[key])
        return cls(**data)

    def to_markdown(self) -> str:
        """A short Markdown rendering for TensorBoard's Text tab."""
        where = f" on `{self.layer}`" if self.layer else ""
        lines = [f"**{self.severity.upper()}** `{self.monitor}/{self.kind}`{where} at step {self.step}", ""]
        lines.append(self.message)
        if self.value is not None or self.threshold is not None:
            lines.append("")
            lines.append(f"value: `{self.value}`, threshold: `{self.threshold}`")
        return "\n".join(lines)

    def __str__(self) -> str:
        where = f" [{self.layer}]" if self.layer else ""
        return f"[{self.severity}] {self.monitor}/{self.kind}{where} @ step {self.step}: {self.message}"


def alerts_dir(trainer: pl.Trainer) -> str:
    """Directory of ``alerts.jsonl``: the first logger's ``log_dir`` (or ``save_dir``), else the
    trainer's ``default_root_dir``."""
    if trainer.loggers:
        first = trainer.loggers[0]
        path = getattr(first, "log_dir", None) or first.save_dir
        if path:
            return str(path)
    return str(trainer.default_root_dir)


def read_alerts(path: str) -> list[Alert]:
    """Read an ``alerts.jsonl`` file back into :class:`Alert` records."""
    with open(path, encoding="utf-8") as fh:
        return [Alert.from_dict(json.loads(line)) for line in fh if line.strip()]


class AlertHub:
    """Dispatches alerts of every monitor attached to one trainer; one hub per trainer.

    Obtain it with :meth:`AlertHub.for_trainer`; monitors call :meth:`emit`. The hub keeps the
    alerts of the run in :attr:`history` (all ranks) and the path of its JSONL file in :attr:`path`.
    """

    _hubs: weakref.WeakKeyDictionary[Any, AlertHub] = weakref.WeakKeyDictionary()

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer_ref = weakref.ref(trainer)
        self.history: list[Alert] = []
        self._subscribers: list[Callable[[Alert], None]] = []
        self.path: Optional[str] = None

    @classmethod
    def for_trainer(cls, trainer: pl.Trainer) -> AlertHub:
        """The hub of ``trainer``, created (and its log directory checked) on first use."""
        hub = cls._hubs.get(trainer)
        if hub is None:
            hub = cls(trainer)
            hub._prepare_file(trainer)
            cls._hubs[trainer] = hub
        return hub

    def _prepare_file(self, trainer: pl.Trainer) -> None:
        directory = alerts_dir(trainer)
        self.path = os.path.join(directory, ALERTS_FILENAME)
        if trainer.global_rank != 0:
            return
        try:
            os.makedirs(directory, exist_ok=True)
            probe = os.path.join(directory, f".{ALERTS_FILENAME}.probe")
            with open(probe, "w", encoding="utf-8") as fh:
                fh.write("")
            os.remove(probe)
        except OSError as err:
            raise PermissionError(
                f"lightning_monitor cannot write alerts to {directory!r} ({err.strerror}). Pass a writable "
                "`save_dir` to the first logger, or a writable `default_root_dir` to the Trainer."
            ) from err

    def subscribe(self, callback: Callable[[Alert], None]) -> None:
        """Call ``callback(alert)`` for every alert emitted on this rank (all ranks)."""
        if callback not in self._subscribers:
            self._subscribers.append(callback)

    def unsubscribe(self, callback: Callable[[Alert], None]) -> None:
        if callback in self._subscribers:
            self._subscribers.remove(callback)

    def emit(self, alert: Alert) -> None:
        """Send ``alert`` to every sink (rank 0) and to every subscriber (this rank)."""
        self.history.append(alert)
        trainer = self._trainer_ref()
        if trainer is not None and trainer.global_rank == 0:
            self._write_sinks(trainer, alert)
        for callback in list(self._subscribers):
            callback(alert)

    def _write_sinks(self, trainer: pl.Trainer, alert: Alert) -> None:
        log.log(_PY_LEVELS[alert.severity], "%s", alert)
        cleared = alert.kind.endswith("_cleared")
        scalar = {f"alerts/{alert.monitor}": 0.0 if cleared else float(alert.level)}
        for logger in trainer.loggers:
            logger.log_metrics(scalar, step=alert.step)
            writer = _tensorboard_writer(logger)
            if writer is not None:
                writer.add_text(f"alerts/{alert.monitor}", alert.to_markdown(), global_step=alert.step)
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(alert.to_dict()) + "\n")
                fh.flush()
                os.fsync(fh.fileno())


def _tensorboard_writer(logger: Any) -> Any:
    """The ``SummaryWriter`` of a TensorBoard logger, else ``None``."""
    from lightning.pytorch.loggers import TensorBoardLogger

    if isinstance(logger, TensorBoardLogger):
        return logger.experiment
    return None

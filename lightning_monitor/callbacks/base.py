"""The core every monitor of the suite shares.

* **Cadence** on optimizer steps: a monitor is *due* at step ``s`` (``trainer.global_step`` when the
  step's gradients are ready, i.e. the number of optimizer steps already taken) when
  ``s >= warmup_steps`` and ``(s - warmup_steps) % every_n_steps == 0``. A monitor that is not due
  returns at once from every hook: no hook armed, no tensor touched, no host sync.
* **Selection** of modules by qualified-name glob and by type (:func:`~lightning_monitor.selection.select_modules`).
* **Logging** of statistics to every logger in ``trainer.loggers`` under ``<monitor>/<layer>/<stat>``
  (``<layer>`` is the module's qualified name) or ``<monitor>/<stat>`` for model-level values, at the
  step they describe. Values stay tensors on the model's device until this moment; all of a check's
  values cross to the host in one transfer.
* **Alerts** through the trainer's :class:`~lightning_monitor.alerts.AlertHub`, with conditions that
  raise one alert when they start (or escalate) and one when they clear.
* **State**: ``state_dict`` / ``load_state_dict`` hold the active conditions; subclasses extend them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_monitor.alerts import SEVERITY_LEVELS, Alert, AlertHub, Severity, _tensorboard_writer

__all__ = ["Monitor"]

Number = Union[Tensor, float, int]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
    return value


class Monitor(Callback):
    """Base class of the suite's callbacks (not used directly).

    Args:
        every_n_steps: check every this many optimizer steps (>= 1).
        warmup_steps: no check before this optimizer step (>= 0).
    """

    #: Prefix of every key this monitor logs and ``monitor`` field of its alerts.
    name: str = "monitor"

    def __init__(self, every_n_steps: int = 50, warmup_steps: int = 0) -> None:
        super().__init__()
        self.every_n_steps = _check_int("every_n_steps", every_n_steps, 1)
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        self._hub: Optional[AlertHub] = None
        # (kind, layer) -> severity of the active condition
        self._conditions: dict[tuple[str, Optional[str]], str] = {}

    # ------------------------------------------------------------------ identity / state
    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, warmup_steps=self.warmup_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"conditions": [[kind, layer, sev] for (kind, layer), sev in self._conditions.items()]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._conditions = {(kind, layer): sev for kind, layer, sev in state_dict.get("conditions", [])}

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._hub = AlertHub.for_trainer(trainer)

    @property
    def hub(self) -> AlertHub:
        if self._hub is None:
            raise RuntimeError(f"{type(self).__name__} is not set up: attach it to a Trainer first.")
        return self._hub

    # ------------------------------------------------------------------ cadence
    def is_due(self, step: int) -> bool:
        """Whether a check is due at optimizer step ``step``."""
        return step >= self.warmup_steps and (step - self.warmup_steps) % self.every_n_steps == 0

    # ------------------------------------------------------------------ logging
    def key(self, stat: str, layer: Optional[str] = None) -> str:
        """``<monitor>/<layer>/<stat>``, or ``<monitor>/<stat>`` without a layer."""
        return f"{self.name}/{layer}/{stat}" if layer else f"{self.name}/{stat}"

    @staticmethod
    def to_host(metrics: Mapping[str, Number]) -> dict[str, float]:
        """All values as Python floats, with a single device-to-host transfer for the tensors."""
        out: dict[str, float] = {}
        keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
        if keys:
            values = torch.stack([metrics[k].detach().reshape(()).float() for k in keys]).cpu().tolist()
            out.update(zip(keys, values))
        for k, v in metrics.items():
            if not isinstance(v, Tensor):
                out[k] = float(v)
        return {k: out[k] for k in metrics}

    def log_metrics(self, trainer: pl.Trainer, metrics: Mapping[str, Number], step: int) -> dict[str, float]:
        """Send ``metrics`` to every logger of ``trainer`` at ``step``; returns them as floats."""
        host = self.to_host(metrics)
        if trainer.global_rank == 0:
            for logger in trainer.loggers:
                logger.log_metrics(host, step=step)
        return host

    def log_histogram(self, trainer: pl.Trainer, tag: str, values: Tensor, step: int) -> None:
        """A histogram of ``values`` to every TensorBoard logger (others have no histograms)."""
        if trainer.global_rank != 0:
            return
        for logger in trainer.loggers:
            writer = _tensorboard_writer(logger)
            if writer is not None:
                writer.add_histogram(tag, values.detach().float().cpu(), global_step=step)

    # ------------------------------------------------------------------ alerts
    def alert(
        self,
        step: int,
        kind: str,
        severity: Severity,
        message: str,
        value: Optional[float] = None,
        threshold: Optional[float] = None,
        layer: Optional[str] = None,
        details: Optional[dict[str, Any]] = None,
    ) -> Alert:
        """Raise a one-off alert now."""
        record = Alert(step, self.name, kind, severity, message, value, threshold, layer, details)
        self.hub.emit(record)
        return record

    def condition(
        self,
        step: int,
        kind: str,
        active: bool,
        severity: Severity,
        message: str,
        value: Optional[float] = None,
        threshold: Optional[float] = None,
        layer: Optional[str] = None,
        clear_message: Optional[str] = None,
    ) -> Optional[Alert]:
        """Track a condition that may persist: alert when it starts or escalates to a higher
        severity, and once with kind ``<kind>_cleared`` (info) when it stops; silent otherwise."""
        key = (kind, layer)
        current = self._conditions.get(key)
        if active:
            if current is not None and SEVERITY_LEVELS[current] >= SEVERITY_LEVELS[severity]:
                return None
            self._conditions[key] = severity
            return self.alert(step, kind, severity, message, value, threshold, layer)
        if current is None:
            return None
        del self._conditions[key]
        text = clear_message or f"{kind} cleared."
        return self.alert(step, f"{kind}_cleared", "info", text, value, threshold, layer)

    def active_conditions(self) -> dict[tuple[str, Optional[str]], str]:
        """The conditions active now, ``(kind, layer) -> severity``."""
        return dict(self._conditions)

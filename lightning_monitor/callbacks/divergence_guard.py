"""DivergenceGuard: catch a diverging run early, keep its weights finite, stop it without losing work."""

from __future__ import annotations

import math
import os
from collections import deque
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_monitor.alerts import Alert, alerts_dir
from lightning_monitor.callbacks.base import Monitor, _check_int
from lightning_monitor.functional.robust import robust_zscore

__all__ = ["DivergenceGuard"]


def _is_critical(alert: Optional[Alert]) -> bool:
    """Whether ``condition`` just raised a critical alert (it returns the clearing alert too)."""
    return alert is not None and alert.severity == "critical"


class _SeriesWatch:
    """Robust spike detector over one scalar series, judged against its own recent history.

    Only values judged normal enter the history, so a sustained explosion stays anomalous instead of
    becoming the new normal; a slow drift passes (each step is normal against the last) and is followed.
    """

    def __init__(self, window: int, warmup: int, threshold: float, rel_floor: float) -> None:
        self.history: deque[float] = deque(maxlen=window)
        self.warmup = warmup
        self.threshold = threshold
        self.rel_floor = rel_floor
        self.run = 0  # consecutive anomalous values

    def update(self, x: float) -> tuple[bool, float]:
        """Feed a finite value; returns (anomalous, z)."""
        if len(self.history) < self.warmup:
            self.history.append(x)
            return False, 0.0
        z = robust_zscore(x, list(self.history), rel_floor=self.rel_floor)
        anomalous = z > self.threshold
        if anomalous:
            self.run += 1
        else:
            self.run = 0
            self.history.append(x)
        return anomalous, z

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "run": self.run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.clear()
        self.history.extend(state.get("history", []))
        self.run = int(state.get("run", 0))


class DivergenceGuard(Monitor):
    r"""Watches the training loss and the global gradient norm, and acts on critical alerts.

    **Every optimizer step, on the device, with no host sync:** the step's loss (summed over
    accumulated micro-batches, unscaled under AMP) and the global L2 norm of the gradients
    (fp32, unscaled, before clipping) are written to a small on-device buffer. If either is
    non-finite, the gradients are zeroed in place (``zero_nonfinite_grads``), so a NaN/Inf never reaches
    the weights, even between checks.

    **Every ``check_every_n_steps`` steps (one host transfer):** the buffered values are judged:

    * a non-finite loss or gradient -> ``nonfinite`` (critical);
    * a loss above its recent history -> ``loss_spike`` (warning), and ``loss_explosion`` (critical)
      when ``patience`` consecutive steps stay above;
    * the same for :math:`\log` of the gradient norm -> ``grad_spike`` / ``grad_explosion``;
    * the loss EMA (``creep_beta``) risen ``creep`` (relative) above its lowest value -> ``loss_creep``
      (warning): the slow road to an explosion that no single step reveals;
    * one of these warnings of the guard's own while another monitor's warning holds (e.g. a
      spectral-alignment collapse or a sigma_1 growth) -> ``corroborated`` (critical).

    "Above its history" is a robust z-score (median and MAD of the last ``window`` normal values, see
    :func:`lightning_monitor.functional.robust.robust_zscore`) over ``z_threshold``, after ``warmup_steps``
    values: no absolute threshold, so the same settings fit any loss scale.
    Critical alerts raised by any other monitor of the suite count too (``act_on_alerts``).

    With ``action="stop"``, on a critical condition (on any rank) the guard, at that check and before
    the optimizer applies the step: drops this step's gradients (the update is skipped), saves a
    checkpoint (``guard-step=<step>.ckpt``), and sets ``trainer.should_stop``. The decision is
    reduced across ranks, so every rank stops on the same step and none hangs.
    With ``action="warn"`` it only raises the alerts.

    **Latency against syncs.** A non-finite value is neutralised on the step it occurs; alerts and the
    stop come at the next check, at most ``check_every_n_steps - 1`` steps later, at the cost of one
    device-to-host transfer (a few floats) per check. ``check_every_n_steps=1`` stops on the very step
    (one sync per step); the default 10 costs one sync per 10 steps.

    Args:
        action: ``"stop"`` or ``"warn"``.
        check_every_n_steps: steps between host checks (the detection latency bound).
        warmup_steps: values a series needs before spikes are judged.
        window: length of the history each series is judged against.
        z_threshold: robust z-score above which a value is anomalous.
        patience: consecutive anomalous steps that turn a spike into an explosion (critical).
        loss_rel_floor: the loss deviation scale is at least this fraction of its median (so a loss
            that plateaus perfectly does not alarm on a 0.1% wobble).
        grad_rel_floor: the same floor for log gradient norm deviations (absolute, in log units).
        creep: relative rise of the loss EMA over its minimum that raises ``loss_creep`` (``None``: off).
        creep_beta: decay of that EMA, per step.
        zero_nonfinite_grads: zero non-finite gradients on the device every step.
        act_on_alerts: stop on critical alerts of other monitors too.
        corroborate: raise ``corroborated`` (critical) when a warning of the guard and a warning of another
            monitor hold at the same time.
        dirpath: where the stop checkpoint goes (default: the ModelCheckpoint's ``dirpath`` if any,
            else ``<log_dir>/checkpoints``).
    """

    name = "guard"

    def __init__(
        self,
        action: Literal["stop", "warn"] = "stop",
        check_every_n_steps: int = 10,
        warmup_steps: int = 20,
        window: int = 100,
        z_threshold: float = 6.0,
        patience: int = 3,
        loss_rel_floor: float = 0.02,
        grad_rel_floor: float = 0.05,
        creep: Optional[float] = 0.1,
        creep_beta: float = 0.9,
        zero_nonfinite_grads: bool = True,
        act_on_alerts: bool = True,
        corroborate: bool = True,
        dirpath: Optional[str] = None,
    ) -> None:
        super().__init__(every_n_steps=check_every_n_steps, warmup_steps=0)
        if action not in ("stop", "warn"):
            raise ValueError(f"`action` must be 'stop' or 'warn', got {action!r}.")
        _check_int("warmup_steps", warmup_steps, 1)
        _check_int("window", window, 3)
        _check_int("patience", patience, 1)
        if warmup_steps > window:
            raise ValueError(f"`warmup_steps` ({warmup_steps}) must not exceed `window` ({window}).")
        if not (z_threshold > 0 and math.isfinite(z_threshold)):
            raise ValueError(f"`z_threshold` must be a positive number, got {z_threshold!r}.")
        if creep is not None and not (creep > 0 and math.isfinite(creep)):
            raise ValueError(f"`creep` must be a positive number or None, got {creep!r}.")
        if not 0.0 <= creep_beta < 1.0:
            raise ValueError(f"`creep_beta` must be in [0, 1), got {creep_beta!r}.")
        self.action = action
        self.check_every_n_steps = check_every_n_steps
        self.spike_warmup = warmup_steps
        self.window = window
        self.z_threshold = float(z_threshold)
        self.patience = patience
        self.loss_rel_floor = float(loss_rel_floor)
        self.grad_rel_floor = float(grad_rel_floor)
        self.creep = creep
        self.creep_beta = float(creep_beta)
        self.zero_nonfinite_grads = zero_nonfinite_grads
        self.act_on_alerts = act_on_alerts
        self.corroborate = corroborate
        self.dirpath = dirpath

        self._loss_watch = _SeriesWatch(window, warmup_steps, z_threshold, loss_rel_floor)
        self._grad_watch = _SeriesWatch(window, warmup_steps, z_threshold, grad_rel_floor)
        # per-step device values since the last check: (step, loss or None, grad norm)
        self._pending: list[tuple[int, Optional[Tensor], Tensor]] = []
        # values buffered at checkpoint time, restored on resume: (step, loss or None, grad norm)
        self._restored: list[tuple[int, Optional[float], float]] = []
        self._loss_acc: Optional[Tensor] = None
        self._external: list[Alert] = []
        # active warnings of other monitors: (monitor, kind, layer) -> alert
        self._external_warnings: dict[tuple[str, str, Optional[str]], Alert] = {}
        # loss EMA (bias-corrected) and its lowest value after the warm-up, for the creep rule
        self._ema = 0.0
        self._ema_weight = 0.0
        self._ema_min = math.inf
        self._n_loss = 0
        self._warned_no_loss = False
        #: path of the checkpoint written when the guard stopped the run, else None
        self.stop_checkpoint: Optional[str] = None
        #: step at which the guard stopped the run, else None
        self.stopped_step: Optional[int] = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(action=self.action, check_every_n_steps=self.check_every_n_steps)

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        if self.act_on_alerts:
            self.hub.subscribe(self._on_alert)
        if self.action == "stop" and self.dirpath is not None:
            try:
                os.makedirs(self.dirpath, exist_ok=True)
            except OSError as err:
                raise PermissionError(
                    f"DivergenceGuard cannot create `dirpath` {self.dirpath!r} ({err.strerror}); pass a writable directory."
                ) from err

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._hub is not None:
            self._hub.unsubscribe(self._on_alert)

    def _on_alert(self, alert: Alert) -> None:
        if alert.monitor == self.name:
            return
        if alert.severity == "critical":
            self._external.append(alert)
        elif alert.severity == "warning":
            self._external_warnings[(alert.monitor, alert.kind, alert.layer)] = alert
        elif alert.kind.endswith("_cleared"):
            self._external_warnings.pop((alert.monitor, alert.kind[: -len("_cleared")], alert.layer), None)

    # ------------------------------------------------------------------ every step, on device
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        loss = loss.detach().float()
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            loss = loss / scaler._get_scale_async()
        self._loss_acc = loss if self._loss_acc is None else self._loss_acc + loss

    @torch.no_grad()
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        step = trainer.global_step
        loss, self._loss_acc = self._loss_acc, None
        if grads:
            gnorm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
        else:
            gnorm = torch.zeros((), device=pl_module.device)
        # checking every step with action="stop", a non-finite step is dropped by the check itself
        neutralise = self.zero_nonfinite_grads and not (self.every_n_steps == 1 and self.action == "stop")
        if neutralise and grads:
            # the sum is non-finite when either term is (inf - inf is nan): one check instead of two
            bad = torch.isfinite(gnorm if loss is None else gnorm + loss).logical_not_()
            for g in grads:
                g.masked_fill_(bad, 0.0)
        self._pending.append((step, loss, gnorm))
        if self.is_due(step):
            self._check(trainer, optimizer, step)

    # ------------------------------------------------------------------ every check, on host
    def _check(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer, step: int) -> None:
        pending, self._pending = self._pending, []
        values = self._restored + self._to_host(pending)
        self._restored = []
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scaler_on = scaler is not None and scaler.is_enabled()
        if all(loss is None for _, loss, _ in values) and not self._warned_no_loss:
            self._warned_no_loss = True
            rank_zero_warn(
                "DivergenceGuard saw no training loss: `training_step` returned None (or no 'loss' key), so only "
                "gradients are checked. Return the loss tensor, or a dict with a 'loss' key, from `training_step`."
            )
        critical: list[str] = []
        for s, loss, gnorm in values:
            critical += self._judge(s, loss, gnorm, scaler_on)
        if self.act_on_alerts and self._external:
            critical += [f"{a.monitor}/{a.kind} (step {a.step}): {a.message}" for a in self._external]
            self._external.clear()
        if self.action != "stop":
            return
        stop = trainer.strategy.reduce_boolean_decision(bool(critical), all=False)
        if stop:
            self._stop(trainer, optimizer, step, critical)

    @staticmethod
    def _to_host(pending: list[tuple[int, Optional[Tensor], Tensor]]) -> list[tuple[int, Optional[float], float]]:
        """The buffered values as floats, with one device-to-host transfer."""
        if not pending:
            return []
        nan = torch.full((), math.nan, device=pending[0][2].device)
        rows = torch.stack([torch.stack([nan if loss is None else loss.reshape(()), g]) for _, loss, g in pending])
        host = rows.cpu().tolist()
        return [(s, None if loss is None else row[0], row[1]) for (s, loss, _), row in zip(pending, host)]

    def _judge(self, step: int, loss: Optional[float], gnorm: float, scaler_on: bool) -> list[str]:
        """Update the detectors with one step's values; returns the critical reasons raised."""
        reasons: list[str] = []
        bad_loss = loss is not None and not math.isfinite(loss)
        # under a dynamic loss scaler, overflowing gradients are routine: the scaler skips those steps
        bad_grad = not math.isfinite(gnorm) and not scaler_on
        what = " and ".join(n for n, b in (("loss", bad_loss), ("gradient norm", bad_grad)) if b)
        value = loss if bad_loss else gnorm
        if _is_critical(self.condition(
            step, "nonfinite", bool(what), "critical",
            f"Non-finite {what} ({value}) at step {step}; the step's gradients were "
            f"{'zeroed' if self.zero_nonfinite_grads else 'left as they are'}. Lower the learning rate, "
            "clip gradients, or check the batch and the precision settings.",
            value=value,
            clear_message="Loss and gradient norm are finite again.",
        )):
            reasons.append(f"non-finite {what} at step {step}")
        if loss is not None and math.isfinite(loss):
            reasons += self._series(step, "loss", self._loss_watch, loss, loss)
            self._creep(step, loss)
        if math.isfinite(gnorm) and gnorm > 0:
            reasons += self._series(step, "grad", self._grad_watch, math.log(gnorm), gnorm)
        if self.corroborate:
            reasons += self._corroborate(step)
        return reasons

    def _creep(self, step: int, loss: float) -> None:
        """Warn when the smoothed loss has risen ``creep`` (relative) above its lowest value."""
        if self.creep is None:
            return
        self._n_loss += 1
        self._ema = self.creep_beta * self._ema + (1.0 - self.creep_beta) * loss
        self._ema_weight = self.creep_beta * self._ema_weight + (1.0 - self.creep_beta)
        if self._n_loss <= self.spike_warmup:
            return
        ema = self._ema / self._ema_weight
        self._ema_min = min(self._ema_min, ema)
        limit = (1.0 + self.creep) * self._ema_min
        self.condition(
            step, "loss_creep", ema > limit, "warning",
            f"The smoothed loss ({ema:.4g}) has risen {100 * (ema / self._ema_min - 1):.0f}% above its lowest value "
            f"({self._ema_min:.4g}) at step {step}: training may be starting to diverge.",
            value=ema, threshold=limit,
            clear_message="The smoothed loss is back near its lowest value.",
        )

    def _corroborate(self, step: int) -> list[str]:
        """Critical when one of the guard's own warnings and another monitor's warning hold together."""
        own = sorted(kind for (kind, _), sev in self.active_conditions().items() if sev == "warning")
        others = sorted(f"{m}/{k}" + (f"[{layer}]" if layer else "") for m, k, layer in self._external_warnings)
        both = bool(own) and bool(others)
        raised = self.condition(
            step, "corroborated", both, "critical",
            f"Independent signals agree at step {step}: {', '.join(own)} (guard) and {', '.join(others)}. "
            "The run is likely diverging: lower the learning rate or resume from an earlier checkpoint.",
            clear_message="The guard's warnings and the other monitors' warnings no longer coincide.",
        )
        return [f"{', '.join(own)} corroborated by {', '.join(others)} at step {step}"] if _is_critical(raised) else []

    def _series(self, step: int, prefix: str, watch: _SeriesWatch, x: float, shown: float) -> list[str]:
        anomalous, z = watch.update(x)
        label = "loss" if prefix == "loss" else "gradient norm"
        self.condition(
            step, f"{prefix}_spike", anomalous, "warning",
            f"{label} {shown:.4g} at step {step} is {z:.1f} robust standard deviations above its recent "
            f"history (threshold {self.z_threshold}).",
            value=shown, threshold=self.z_threshold,
            clear_message=f"{label} is back within its recent history.",
        )
        exploded = watch.run >= self.patience
        raised = self.condition(
            step, f"{prefix}_explosion", exploded, "critical",
            f"{label} has stayed above its recent history for {watch.run} consecutive steps (now {shown:.4g}, "
            f"z={z:.1f}): the run is diverging. Lower the learning rate or resume from an earlier checkpoint.",
            value=shown, threshold=self.z_threshold,
            clear_message=f"{label} is back within its recent history.",
        )
        return [f"{label} explosion at step {step}"] if _is_critical(raised) else []

    def _stop(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer, step: int, reasons: list[str]) -> None:
        # skip this step's update: optimizers ignore parameters without a gradient
        optimizer.zero_grad(set_to_none=True)
        path = os.path.join(self._checkpoint_dir(trainer), f"guard-step={step}.ckpt")
        trainer.save_checkpoint(path)
        trainer.should_stop = True
        self.stop_checkpoint, self.stopped_step = path, step
        reason = "; ".join(reasons) if reasons else "a critical alert on another rank"
        self.alert(
            step, "stopped", "info",
            f"Training stopped at step {step} ({reason}). This step's update was skipped; the last good state "
            f"is saved in {path}.",
        )

    def _checkpoint_dir(self, trainer: pl.Trainer) -> str:
        if self.dirpath is not None:
            return self.dirpath
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and getattr(ckpt, "dirpath", None):
            return str(ckpt.dirpath)
        return os.path.join(alerts_dir(trainer), "checkpoints")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            loss=self._loss_watch.state_dict(),
            grad=self._grad_watch.state_dict(),
            pending=self._restored + self._to_host(self._pending),
            creep={"ema": self._ema, "weight": self._ema_weight, "min": self._ema_min, "n": self._n_loss},
            stop_checkpoint=self.stop_checkpoint,
            stopped_step=self.stopped_step,
        )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._loss_watch.load_state_dict(state_dict.get("loss", {}))
        self._grad_watch.load_state_dict(state_dict.get("grad", {}))
        self._restored = [(int(s), loss, g) for s, loss, g in state_dict.get("pending", [])]
        creep = state_dict.get("creep", {})
        self._ema, self._ema_weight = creep.get("ema", 0.0), creep.get("weight", 0.0)
        self._ema_min, self._n_loss = creep.get("min", math.inf), creep.get("n", 0)
        self._pending = []
        self.stop_checkpoint = state_dict.get("stop_checkpoint")
        self.stopped_step = state_dict.get("stopped_step")

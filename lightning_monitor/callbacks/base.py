"""The core every monitor of the suite shares.

* **Cadence** on optimizer steps: a monitor is *due* at step ``s`` (``trainer.global_step`` when the
  step's gradients are ready, i.e. the number of optimizer steps already taken) when
  ``s >= warmup_steps`` and ``(s - warmup_steps) % every_n_steps == 0``. A monitor that is not due
  returns at once from every hook: no hook armed, no tensor touched, no host sync.
* **Selection** of modules by qualified-name glob and by type (:func:`~lightning_monitor.selection.select_modules`).
* **Logging** of statistics to every logger in ``trainer.loggers`` under ``<monitor>/<layer>/<stat>``
  (``<layer>`` is the module's qualified name) or ``<monitor>/<stat>`` for model-level values, at the
  step they describe. Values stay tensors on the model's device until this moment; all of a check's
  values cross to the host in one transfer. The same values go into ``trainer.callback_metrics`` on
  every rank, so ``EarlyStopping`` / ``ModelCheckpoint`` can monitor any key. With
  ``per_layer_scalars`` off, the per-layer values of a check reach the loggers folded into one
  TensorBoard histogram per statistic (``<monitor>/layers/<stat>``) instead of one scalar per layer.
* **Alerts** through the trainer's :class:`~lightning_monitor.alerts.AlertHub`, with conditions that
  raise one alert when they start (or escalate) and one when they clear.
* **State**: ``state_dict`` / ``load_state_dict`` hold the active conditions; subclasses extend them.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import warnings
import weakref
from collections.abc import Callable, Collection, Mapping
from typing import Any, Optional, TypeVar, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerStatus
from torch import Tensor

from lightning_monitor.alerts import SEVERITY_LEVELS, Alert, AlertHub, Severity, _tensorboard_writer

__all__ = ["Monitor", "NothingToWatch", "resolve_callable"]


class NothingToWatch(ValueError):
    """Raised by a monitor that finds nothing in the model to watch (no layer of a type it handles, no
    classifier head ...), at setup, or at the start of the fit for what only exists then (the optimizers). Used explicitly, a monitor raises it and the fit aborts with the
    reason; a monitor whose ``idle_when_nothing_to_watch`` is set (the preset sets it) says so once in a
    warning alert and stays idle instead (:meth:`Monitor.nothing_to_watch`)."""

Number = Union[Tensor, float, int]


def _callback_metrics_store(trainer: pl.Trainer) -> dict[str, Any]:
    """The dict behind ``trainer.callback_metrics``. Reading that property first folds in the values
    the LightningModule logged, converting its progress-bar values with ``.item()`` (a host sync
    each); the connector's dict is the same object without that. Falls back to the property."""
    from lightning_monitor._compat import callback_metrics_store  # the private read lives there

    return callback_metrics_store(trainer)


_Init = TypeVar("_Init", bound=Callable[..., None])


def deprecated_aliases(**aliases: str) -> Callable[[_Init], _Init]:
    """Decorator of a monitor's ``__init__``: each ``old="new"`` makes the keyword ``old`` a deprecated
    alias of the argument ``new`` (the suite's one vocabulary, see the README). Passing ``old`` emits a
    ``DeprecationWarning`` and passes its value as ``new``; passing both (``new`` by keyword or by
    position) raises a ``ValueError``. The aliases stay one release.
    """

    def wrap(init: _Init) -> _Init:
        signature = inspect.signature(init)
        for new in aliases.values():
            if new not in signature.parameters:
                raise TypeError(f"{init.__qualname__} has no argument {new!r} to alias.")

        @functools.wraps(init)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
            for old, new in aliases.items():
                if old not in kwargs:
                    continue
                value = kwargs.pop(old)
                owner = type(self).__name__
                if new in kwargs or new in signature.bind_partial(self, *args).arguments:
                    raise ValueError(f"{owner}: pass `{new}` only; `{old}` is its deprecated alias.")
                warnings.warn(
                    f"{owner}(`{old}`=...) is deprecated and will be removed in the next release: use `{new}`.",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = value
            init(self, *args, **kwargs)

        wrapper.deprecated_aliases = dict(aliases)  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return wrap


def resolve_callable(arg: str, value: Any) -> Any:
    """``value`` when it is ``None`` or callable; for a string, the callable its dotted import path
    names (``"my_package.data.targets"``, the way LightningCLI YAML spells a function). So an argument
    such as ``target_fn`` takes either. A path that does not import, or names something that is not
    callable, is an error that says which argument and which path."""
    if value is None or callable(value):
        return value
    if not isinstance(value, str):
        raise TypeError(f"`{arg}` must be a callable or a dotted import path string, got {type(value).__name__}.")
    parts = value.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for name in parts[split:]:
                obj = getattr(obj, name)
        except AttributeError:
            break
        if not callable(obj):
            raise TypeError(f"`{arg}`={value!r} names a {type(obj).__name__}, not a callable.")
        return obj
    raise ValueError(f"`{arg}`={value!r} is not an importable dotted path (`package.module.function`).")


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
    return value


class _TrainerRef:
    """A weak reference to the Trainer a monitor runs in; pickles (``ddp_spawn``) and deep-copies as
    an empty one, so a monitor stays picklable."""

    __slots__ = ("_ref",)

    def __init__(self, trainer: Optional[pl.Trainer] = None) -> None:
        self._ref = weakref.ref(trainer) if trainer is not None else None

    def __call__(self) -> Optional[pl.Trainer]:
        return self._ref() if self._ref is not None else None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_TrainerRef, ())


class Monitor(Callback):
    """Base class of the suite's callbacks (not used directly).

    An instance set up by a new Trainer starts clean (:meth:`_reset_run_state`: no state of its
    previous run; DivergenceGuard forgets only its conditions so far), unless a state was loaded for
    it: a checkpoint restored by ``fit(ckpt_path=...)``, or ``load_state_dict`` called by hand before
    ``fit``. ``state_key`` names what the monitor watches and its cadence, so two
    instances of one monitor over different layers or cadences can share a Trainer.

    Per-layer values (keys made by :meth:`key` with a layer) go to the loggers as one scalar per
    layer while ``per_layer_scalars`` is true (the default of a monitor constructed on its own). When
    it is false (the default of :class:`~lightning_monitor.HealthMonitor`) each check sends one
    histogram per statistic over the layers to TensorBoard loggers instead (tag
    ``<monitor>/layers/<stat>``) and nothing per layer to other loggers: the number of tags no longer
    grows with the depth of the model. ``trainer.callback_metrics`` gets every key either way. Set it
    on an instance, or on ``Monitor`` for every monitor of the suite.

    Args:
        every_n_steps: check every this many optimizer steps (>= 1).
        warmup_steps: no check before this optimizer step (>= 0).
    """

    #: Prefix of every key this monitor logs and ``monitor`` field of its alerts.
    name: str = "monitor"

    #: Per-layer values as one logger scalar per layer (True) or one TensorBoard histogram per
    #: statistic and check (False). A class attribute: set it on ``Monitor`` for the whole suite.
    per_layer_scalars: bool = True

    def __init__(self, every_n_steps: int = 50, warmup_steps: int = 0) -> None:
        super().__init__()
        self.every_n_steps = _check_int("every_n_steps", every_n_steps, 1)
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        self._hub: Optional[AlertHub] = None
        # (kind, layer) -> severity of the active condition
        self._conditions: dict[tuple[str, Optional[str]], str] = {}
        #: set by the preset: a monitor with nothing to watch stays idle instead of aborting the fit
        self.idle_when_nothing_to_watch = False
        #: the reason this monitor is idle (nothing to watch), or None while it watches something
        self.idle_reason: Optional[str] = None

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
        if stage == "fit" and self._bind_trainer(trainer):
            self._reset_run_state()

    # ------------------------------------------------------------------ reuse across trainers
    def _bind_trainer(self, trainer: pl.Trainer) -> bool:
        """Remember ``trainer`` as the one this instance runs in; ``True`` when the instance ran in
        another Trainer before and no state was loaded for this run since (:meth:`_note_state_loaded`):
        its run state belongs to another run and :meth:`setup` starts it clean.

        A checkpoint restored by ``trainer.fit(ckpt_path=...)`` is loaded after ``setup`` and
        overrides the clean state; a state loaded by hand before ``fit`` is kept.
        """
        previous = getattr(self, "_trainer_ref", None)
        bound = previous() if previous is not None else None
        loaded = getattr(self, "_state_loaded", False)
        self._trainer_ref = _TrainerRef(trainer)
        self._state_loaded = False
        return previous is not None and bound is not trainer and not loaded

    def _bound_trainer(self) -> Optional[pl.Trainer]:
        """The Trainer this instance was last set up for ``fit`` by, while it exists."""
        ref = getattr(self, "_trainer_ref", None)
        return ref() if ref is not None else None

    def _note_state_loaded(self) -> None:
        """Called by ``load_state_dict``: a state loaded outside a running fit (by hand, before
        ``fit``) is the state of the next run, and the next :meth:`setup` keeps it."""
        trainer = self._bound_trainer()
        running = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
        self._state_loaded = not running

    def _reset_run_state(self) -> None:
        """Forget everything a previous run left (subclasses extend this); the configuration stays."""
        self._conditions = {}

    def nothing_to_watch(self, trainer: pl.Trainer, reason: str) -> None:
        """Called at setup when the model offers this monitor nothing to watch: raises
        :class:`NothingToWatch` with ``reason``, or, when ``idle_when_nothing_to_watch`` is set, records
        the reason in ``idle_reason``, raises one warning alert (``nothing_to_watch``) and returns; the
        caller then returns from setup and every hook returns at once while ``idle_reason`` is set.
        Call it after ``Monitor.setup`` (the alert hub is bound there)."""
        if not self.idle_when_nothing_to_watch:
            raise NothingToWatch(f"{type(self).__name__}: {reason}")
        self.idle_reason = reason
        self.alert(trainer.global_step, "nothing_to_watch", "warning", f"{type(self).__name__} stays idle: {reason}")

    @property
    def hub(self) -> AlertHub:
        if self._hub is None:
            raise RuntimeError(f"{type(self).__name__} is not set up: attach it to a Trainer first.")
        return self._hub

    # ------------------------------------------------------------------ hooks armed on due steps
    def arm(self, handle: Any) -> Any:
        """Keep a hook handle (``register_forward_hook``, ``register_hook`` ...) to be removed by
        :meth:`release`; returns it. The base releases every kept handle when training ends, on an
        exception and at teardown, so a hook never outlives the step, the fit or an interrupted fit."""
        self.__dict__.setdefault("_armed", []).append(handle)
        return handle

    def release(self) -> None:
        """Remove every handle kept by :meth:`arm`."""
        for handle in self.__dict__.pop("_armed", []):
            handle.remove()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.release()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.release()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.release()

    # ------------------------------------------------------------------ cadence
    def is_due(self, step: int) -> bool:
        """Whether a check is due at optimizer step ``step``."""
        return step >= self.warmup_steps and (step - self.warmup_steps) % self.every_n_steps == 0

    # ------------------------------------------------------------------ logging
    def key(self, stat: str, layer: Optional[str] = None) -> str:
        """``<monitor>/<layer>/<stat>``, or ``<monitor>/<stat>`` without a layer. A key made with a
        layer is remembered as per-layer, so :meth:`log_metrics` can fold it (``per_layer_scalars``)."""
        if not layer:
            return f"{self.name}/{stat}"
        key = f"{self.name}/{layer}/{stat}"
        self.__dict__.setdefault("_layer_keys", {})[key] = stat
        return key

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

    def log_metrics(
        self,
        trainer: pl.Trainer,
        metrics: Mapping[str, Number],
        step: int,
        loggers_only: Collection[str] = (),
    ) -> dict[str, float]:
        """Send ``metrics`` to every logger of ``trainer`` at ``step`` (on global rank 0) and put them
        into ``trainer.callback_metrics`` (on every rank, see :meth:`publish`), except the keys in
        ``loggers_only``; returns them as floats.

        Called on every rank. Tensors cross to the host here in one transfer (none when the values
        are floats already); nothing else syncs. With ``per_layer_scalars`` false, the per-layer keys
        reach the loggers as histograms (see the class docstring).
        """
        host = self.to_host(metrics)
        if trainer.global_rank == 0:
            scalars, per_stat = self._fold_layers(host)
            if scalars:
                for logger in trainer.loggers:
                    logger.log_metrics(scalars, step=step)
            for stat, values in per_stat.items():
                self.log_histogram(trainer, self.layers_tag(stat), torch.tensor(values, dtype=torch.float64), step)
        self.publish(trainer, host, exclude=loggers_only)
        return host

    def layers_tag(self, stat: str) -> str:
        """``<monitor>/layers/<stat>``: the histogram over the layers of one per-layer statistic."""
        return f"{self.name}/layers/{stat}"

    def _fold_layers(self, host: Mapping[str, float]) -> tuple[dict[str, float], dict[str, list[float]]]:
        """``(scalars, {stat: finite per-layer values})``: everything as scalars while
        ``per_layer_scalars`` is set, else the model-level keys as scalars and the per-layer ones
        grouped by statistic (non-finite values left out: a histogram cannot bin them, and the
        model-level keys and alerts report them)."""
        layer_keys: dict[str, str] = self.__dict__.get("_layer_keys", {})
        if self.per_layer_scalars or not layer_keys:
            return dict(host), {}
        scalars: dict[str, float] = {}
        per_stat: dict[str, list[float]] = {}
        for k, v in host.items():
            stat = layer_keys.get(k)
            if stat is None:
                scalars[k] = v
            elif math.isfinite(v):
                per_stat.setdefault(stat, []).append(v)
        return scalars, per_stat

    @staticmethod
    def publish(trainer: pl.Trainer, values: Mapping[str, float], exclude: Collection[str] = ()) -> None:
        """Put host ``values`` into ``trainer.callback_metrics`` as 0-dim float32 CPU tensors, so that
        ``EarlyStopping`` and ``ModelCheckpoint`` can monitor any key.

        Every rank must call this with the same keys: those callbacks reduce their decision across
        ranks only when the monitored key is present, so a key missing on one rank would hang the
        others. A key keeps its last value until it is published again (as with ``self.log``); a key
        never published is absent. Values of reduced quantities are the same on all ranks; values a
        rank measures on its own data (spectral alignment) are that rank's, which is what the
        callbacks' cross-rank reduction of their decisions expects.
        """
        keys = [k for k in values if k not in exclude]
        if not keys:
            return
        # one tensor, viewed per key: ~1 us per key, no device involved
        tensors = torch.tensor([float(values[k]) for k in keys], dtype=torch.float32).unbind(0)
        _callback_metrics_store(trainer).update(zip(keys, tensors))

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

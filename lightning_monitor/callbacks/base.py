"""The core every monitor of the suite shares: its lifecycle, cadence, logging, alerts and state.

* **Lifecycle.** A monitor is its method in four overridable stages; the base calls them and carries
  everything around them:

  - :meth:`Monitor.select` once per fit, at setup: find what to watch (raise :class:`NothingToWatch`
    when there is nothing);
  - :meth:`Monitor.arm` at the first batch of a due step: register the hooks the check needs, keeping
    each handle with :meth:`Monitor.keep`. Under manual optimization with one optimizer a batch may take
    several optimizer steps, and a later one has no batch start of its own: a due step that follows another
    step is armed in ``on_before_optimizer_step`` of that step (after its backward, before the due step's
    forward), and released at the end of the batch if it did not come there (the next batch arms it afresh).
    With several optimizers (a GAN's players, whose forwards may all run before the first step) only a
    batch's first step is checked;
  - :meth:`Monitor.compute` in ``on_before_optimizer_step`` of an armed step (gradients ready, weights not
    yet updated): the check's values as named tensors, on the device;
  - :meth:`Monitor.judge` with those values on the host (one transfer): alerts and decisions; it returns
    the values to log.

  :meth:`Monitor.release` removes every kept handle after the check, when a due step's optimizer step
  never comes, and on every exit path (end of training, an exception, teardown, a second ``fit``).
* **Cadence** on optimizer steps: a monitor is *due* at step ``s`` (``trainer.global_step`` when the
  step's gradients are ready, i.e. the number of optimizer steps already taken) when
  ``s >= warmup_steps`` and ``(s - warmup_steps) % every_n_steps == 0``. A monitor that is not due
  returns at once from every hook: no hook armed, no tensor touched, no host sync.
* **Logging** of statistics to every logger in ``trainer.loggers`` under ``<monitor>/<layer>/<stat>``
  (``<layer>`` is the module's qualified name) or ``<monitor>/<stat>`` for model-level values, at the
  step they describe. Values stay tensors on the model's device until this moment; all of a check's
  values cross to the host in one transfer. The same values go into ``trainer.callback_metrics`` on
  every rank, so ``EarlyStopping`` / ``ModelCheckpoint`` can monitor any key. With
  ``per_layer_scalars`` off, the per-layer values of a check reach the loggers folded into one
  TensorBoard histogram per statistic (``<monitor>/layers/<stat>``) instead of one scalar per layer.
* **Alerts** through the trainer's :class:`~lightning_monitor.alerts.AlertHub`, with conditions that
  raise one alert when they start (or escalate) and one when they clear; :class:`Streak` counts the
  consecutive checks a condition held (``patience`` is in checks), :meth:`Monitor.decide` reduces a
  decision across ranks and :meth:`Monitor.request_stop` stops the run on every rank together.
* **State**: ``state_dict`` / ``load_state_dict`` hold the active conditions; subclasses extend them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.nn.utils import parametrize

from lightning_monitor._args import check_int, deprecated_aliases, resolve_callable
from lightning_monitor._compat import backward_skipped
from lightning_monitor._values import TrainerRef, fold_layers, log_histogram, publish, to_host
from lightning_monitor.alerts import SEVERITY_LEVELS, Alert, AlertHub, Severity

__all__ = ["Monitor", "NothingToWatch", "Streak", "deprecated_aliases", "reading_weights", "resolve_callable"]


class NothingToWatch(ValueError):
    """Raised by a monitor that finds nothing in the model to watch (no layer of a type it handles, no
    classifier head ...), at setup, or at the start of the fit for what only exists then (the optimizers). Used explicitly, a monitor raises it and the fit aborts with the
    reason; a monitor whose ``idle_when_nothing_to_watch`` is set (the preset sets it) says so once in a
    warning alert and stays idle instead (:meth:`Monitor.nothing_to_watch`)."""

Number = Union[Tensor, float, int]


@contextmanager
def reading_weights(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Inside, the weights of ``modules`` read without side effects: the parametrizations
    (``torch.nn.utils.parametrize``) of those that have some run in eval mode, their modes restored after.

    In training mode, reading a parametrized weight runs its parametrization, and ``spectral_norm``'s advances
    its power iteration (its ``_u`` / ``_v`` buffers) at every read, which changes the training of a run a
    monitor reads it in. In eval mode it uses the vectors as they are: before the optimizer step, the weight
    read is the one the step's forward used. A monitor reads weights only inside this; a module without
    parametrizations costs one attribute test.
    """
    switched = [sub for m in modules if parametrize.is_parametrized(m)
                for sub in m.parametrizations.modules() if sub.training]
    for sub in switched:
        sub.training = False
    try:
        yield
    finally:
        for sub in switched:
            sub.training = True


class Streak:
    """The number of consecutive checks a condition held: ``update(active)`` counts one more while it
    holds and restarts at 0 when it does not; ``patience`` thresholds compare against :attr:`count`."""

    __slots__ = ("count",)

    def __init__(self, count: int = 0) -> None:
        self.count = int(count)

    def update(self, active: bool) -> int:
        self.count = self.count + 1 if active else 0
        return self.count

    def __ge__(self, patience: int) -> bool:
        return self.count >= patience

    def __repr__(self) -> str:
        return f"Streak({self.count})"


def _has_gradient(optimizer: Any) -> bool:
    """Whether any parameter ``optimizer`` steps has a gradient (on due steps only: it stops at the first)."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return True  # not an optimizer with groups: checked as before
    return any(p.grad is not None for group in groups for p in group["params"])


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

    #: Keys of :meth:`state_dict` that hold each rank's own values (computed from the rank's own batch). Lightning
    #: writes rank 0's callback states only; a checkpoint saved under several processes keeps every rank's values of
    #: these keys too (:meth:`on_save_checkpoint`), and each rank takes back its own on resume.
    _rank_local: tuple[str, ...] = ()

    def __init__(self, every_n_steps: int = 50, warmup_steps: int = 0) -> None:
        super().__init__()
        self.every_n_steps = check_int("every_n_steps", every_n_steps, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self._hub: Optional[AlertHub] = None
        # (kind, layer) -> severity of the active condition
        self._conditions: dict[tuple[str, Optional[str]], str] = {}
        #: set by the preset: a monitor with nothing to watch stays idle instead of aborting the fit
        self.idle_when_nothing_to_watch = False
        #: the reason this monitor is idle (nothing to watch), or None while it watches something
        self.idle_reason: Optional[str] = None
        self._armed_step: Optional[int] = None  # the due step whose hooks are armed
        self._armed_ahead = False  # armed at the step before it (manual optimization), not at a batch start
        self._checked_step: Optional[int] = None  # the last step checked (several optimizers: once a step)
        self._select_later = False  # the model is built in `configure_model`, which Lightning calls after setup
        self._modules_at_setup: Optional[tuple[tuple[str, int], ...]] = None  # see _select_or_defer
        self._reselecting = False  # selecting again at the start of the fit (see alert)

    # ------------------------------------------------------------------ identity / state
    @property
    def state_key(self) -> str:
        # Lightning reads the key at every hook call of every callback (its profiler names the hook by it):
        # within a fit it is computed once, at setup, and kept until teardown
        key = self.__dict__.get("_fit_state_key")
        return key if key is not None else self._state_key()

    def _state_key(self) -> str:
        """The key from the configuration (subclasses name what they watch and their cadence)."""
        return self._generate_state_key(every_n_steps=self.every_n_steps, warmup_steps=self.warmup_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"conditions": [[kind, layer, sev] for (kind, layer), sev in self._conditions.items()]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Subclasses extend this (calling it first): the state loaded is that of the next run. A checkpoint's
        per-rank values (see :attr:`_rank_local`) replace rank 0's for this rank when the world size is the same."""
        per_rank = state_dict.get("per_rank")
        if isinstance(per_rank, list) and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            if len(per_rank) == world and isinstance(per_rank[rank], dict):
                state_dict.update(per_rank[rank])
        self._note_state_loaded()
        self._conditions = {(kind, layer): sev for kind, layer, sev in state_dict.get("conditions", [])}

    def snapshot_state(self) -> dict[str, Any]:
        """What a :class:`~lightning_monitor.DivergenceGuard` snapshot keeps of this monitor, restored by a rollback
        (or a stop) with :meth:`load_snapshot_state`: the :meth:`state_dict`, unless the monitor keeps more (GWA: the
        scores of the epoch under way, which a checkpoint carries reduced over the ranks instead)."""
        return self.state_dict()

    def load_snapshot_state(self, state: dict[str, Any]) -> None:
        """Go back to a :meth:`snapshot_state` (a rollback or a stop of the guard)."""
        self.load_state_dict(state)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Under several processes, every rank's values of the :attr:`_rank_local` keys go into the checkpoint (one
        gather of Python objects per checkpoint; every rank calls this hook)."""
        if not self._rank_local or trainer.world_size <= 1 or not torch.distributed.is_initialized():
            return
        saved = checkpoint.get("callbacks", {}).get(self.state_key)
        mine = {k: saved[k] for k in self._rank_local if k in saved} if isinstance(saved, dict) else {}
        gathered: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, mine)
        if isinstance(saved, dict):
            saved["per_rank"] = gathered

    # ------------------------------------------------------------------ the stages a monitor overrides
    def select(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Once per fit, at setup (after the trainer is bound and a reused instance was reset): find what
        to watch. Raise :class:`NothingToWatch` when the model offers nothing (see :meth:`nothing_to_watch`)."""

    def arm(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> Optional[bool]:
        """At the first batch of a due step, or, under manual optimization, in ``on_before_optimizer_step`` of
        the step before it (``step`` is then ``trainer.global_step + 1``; see the module docstring): register the
        hooks the check needs (each handle kept with :meth:`keep`). Return ``False`` to skip this step's check."""
        return None

    def compute(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> Optional[Mapping[str, Number]]:
        """In ``on_before_optimizer_step`` of the armed step: the check's values, named by :meth:`key`,
        as tensors on the device (no host sync), or ``None`` when there is nothing to judge."""
        return None

    def judge(self, trainer: pl.Trainer, step: int, values: dict[str, float]) -> Mapping[str, float]:
        """The computed values on the host (one transfer for all): raise alerts, take decisions, and
        return the values to log (by default ``values`` as they are)."""
        return values

    # ------------------------------------------------------------------ the lifecycle the base runs
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._hub = AlertHub.for_trainer(trainer)
        if stage != "fit":
            return
        self._fit_state_key = self._state_key()
        if self._bind_trainer(trainer):
            self._reset_run_state()
        self._release_all()
        self.idle_reason = None
        self._armed_step = self._checked_step = None
        self._select_or_defer(trainer, pl_module, at_setup=True)

    def _select_or_defer(self, trainer: pl.Trainer, pl_module: pl.LightningModule, at_setup: bool) -> None:
        """:meth:`select`; a model with nothing to watch is said to be so (:meth:`nothing_to_watch`), but at setup in a
        model that has a ``configure_model``: its layers may not exist yet (Lightning calls it after the callbacks'
        setup; a model built there, for sharding or a fast init on the device, had every monitor say it had nothing to
        watch), so it is asked again at the start of the fit (:meth:`select_built_model`). So is one whose
        ``configure_model`` replaced modules that existed at setup (a classifier head re-made for the task's classes,
        layers wrapped in adapters): a monitor holding the old ones watched modules that never ran (GWA scored a hidden
        layer and went idle for the run)."""
        self._select_later = False
        self._modules_at_setup = (_module_ids(pl_module) if at_setup and isinstance(pl_module, pl.LightningModule)
                                  and is_overridden("configure_model", pl_module) else None)
        try:
            self.select(trainer, pl_module)
        except NothingToWatch as err:
            if at_setup and isinstance(pl_module, pl.LightningModule) and is_overridden("configure_model", pl_module):
                self._select_later = True
            else:
                self.nothing_to_watch(trainer, str(err).removeprefix(f"{type(self).__name__}: "))

    def _selects_again(self, pl_module: Optional[nn.Module]) -> bool:
        """Whether :meth:`select_built_model` will select again at the start of this fit: ``configure_model`` replaced
        modules that existed at setup (a state loaded before then is checked against that selection, not setup's)."""
        return (self._modules_at_setup is not None and pl_module is not None
                and self._modules_at_setup != _module_ids(pl_module))

    def select_built_model(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At the start of the fit (``on_fit_start``; the preset calls it first for all its monitors): :meth:`select`
        again where it found nothing at setup in a model that has a ``configure_model`` (called after setup), or where
        that replaced modules since. A monitor's ``on_fit_start`` calls this first."""
        replaced = self.idle_reason is None and self._selects_again(pl_module)
        self._modules_at_setup = None  # compared once a fit
        if self._select_later or replaced:
            self._reselecting = True
            try:
                self._select_or_defer(trainer, pl_module, at_setup=False)
            finally:
                self._reselecting = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.select_built_model(trainer, pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.idle_reason is not None or (self._armed_step == step and not self._armed_ahead):
            return  # idle, or a later micro-batch of the armed step
        if self._armed_step is not None:
            # a due step whose optimizer step never came (skipped), or one armed ahead in the last batch: drop it
            self.release()
        # not on a forward-only step (SWA's BatchNorm epoch): no gradients to check
        if (self.is_due(step) and self._checked_step != step and not backward_skipped(trainer)
                and self.arm(trainer, pl_module, step) is not False):
            self._armed_step = step

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        step = trainer.global_step
        if self.idle_reason is not None:
            return
        if self._armed_step == step and self._checked_step != step and _has_gradient(optimizer):
            # (a step with no gradient at all: `training_step` returned None, a batch skipped on purpose, and Lightning
            # still steps the optimizer. Nothing to check; the step stays armed for a later optimizer step of the
            # batch, else the next batch start drops it)
            self._checked_step = step
            try:
                values = self.compute(trainer, pl_module, step)
                if values is not None:
                    logged = self.judge(trainer, step, self.to_host(values))
                    if logged:
                        self.log_metrics(trainer, logged, step)
            finally:
                self.release()
        if not pl_module.automatic_optimization and len(trainer.optimizers) == 1:
            # (several optimizers, a GAN's players: each may run its forward before the other's step, so a step armed
            # here could find its forward over; their later steps in a batch stay unchecked, as documented)
            self._arm_ahead(trainer, pl_module, step + 1)

    def _arm_ahead(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        """Manual optimization: arm the due step ``step`` now, in ``on_before_optimizer_step`` of the step
        before it, since the batch may take it without a batch start of its own. Called again for the same
        step (a closure evaluated again inside ``optimizer.step``, LBFGS), it arms afresh, dropping what that
        evaluation's forward left in the hooks."""
        if not self.is_due(step) or self._checked_step == step:
            return
        if self._armed_step is not None:
            self.release()
        if self.arm(trainer, pl_module, step) is not False:
            self._armed_step, self._armed_ahead = step, True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._armed_ahead:  # the batch took no further step: the next batch start arms the step afresh
            self.release()

    def keep(self, handle: Any, until_end: bool = False) -> Any:
        """Keep a hook handle (``register_forward_hook``, ``register_hook`` ...) until :meth:`release`,
        or with ``until_end`` until the fit ends (or fails, or the instance is set up again); returns it."""
        self.__dict__.setdefault("_kept_to_end" if until_end else "_kept", []).append(handle)
        return handle

    def release(self) -> None:
        """Remove every handle kept by :meth:`keep` for the step and disarm (subclasses extend this to
        drop what they captured). Called after each check and on every exit path."""
        for handle in self.__dict__.pop("_kept", []):
            handle.remove()
        self._armed_step = None
        self._armed_ahead = False

    def _release_all(self) -> None:
        self.release()
        for handle in self.__dict__.pop("_kept_to_end", []):
            handle.remove()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release_all()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release_all()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release_all()
        if stage == "fit":
            self._fit_state_key = None  # the configuration may change before the next fit

    # ------------------------------------------------------------------ decisions, on every rank
    @staticmethod
    def decide(trainer: pl.Trainer, decision: bool, all: bool = False) -> bool:  # noqa: A002 - Lightning's name
        """``decision`` reduced across ranks: true when it holds on any rank (on every rank with
        ``all=True``). Every rank must call it at the same point."""
        return bool(trainer.strategy.reduce_boolean_decision(bool(decision), all=all))

    def request_stop(self, trainer: pl.Trainer, step: int, decision: bool, kind: str, message: str,
                     value: Optional[float] = None, threshold: Optional[float] = None) -> bool:
        """Stop the run on every rank together when ``decision`` holds on any rank (reduced by
        :meth:`decide`, so every rank must call this): sets ``trainer.should_stop`` and raises one info
        alert ``kind``. Returns whether this call stopped the run (``False`` once it is stopping)."""
        if not self.decide(trainer, decision) or trainer.should_stop:
            return False
        trainer.should_stop = True
        self.alert(step, kind, "info", message, value=value, threshold=threshold)
        return True

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
        self._trainer_ref = TrainerRef(trainer)
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

    def nothing_to_watch(self, trainer: pl.Trainer, reason: str, training: bool = False) -> None:
        """Called when the model offers this monitor nothing to watch: raises :class:`NothingToWatch`
        with ``reason``, or, when ``idle_when_nothing_to_watch`` is set, records the reason in
        ``idle_reason``, releases the hooks, raises one warning alert (``nothing_to_watch``) and returns;
        every hook then returns at once. :meth:`select` raising :class:`NothingToWatch` comes here. ``training``:
        found once training is under way, where it never raises (a monitor does not end a run it cannot measure)."""
        if not self.idle_when_nothing_to_watch and not training:
            raise NothingToWatch(f"{type(self).__name__}: {reason}")
        self.release()
        self.idle_reason = reason
        self.alert(trainer.global_step, "nothing_to_watch", "warning", f"{type(self).__name__} stays idle: {reason}")
        from lightning_monitor.dashboard import refresh_dashboard

        refresh_dashboard(trainer)  # idle once the layout was written (at the fit's first batch): its cards went empty

    def refuse_several_optimizers(self, trainer: pl.Trainer, why: str) -> bool:
        """At the start of the fit (the optimizers exist from there): with more than one optimizer, say
        :meth:`nothing_to_watch` with ``why`` (after the count) and return ``True``."""
        n = len(trainer.optimizers)
        if n <= 1:
            return False
        self.nothing_to_watch(trainer, f"the model has {n} optimizers{why}")
        return True

    def __getstate__(self) -> dict[str, Any]:
        """The monitor's state for ``pickle`` and ``copy``, without its alert hub: the hub holds a weak reference to
        the trainer it ran in, which does not pickle (a monitor that had run a fit could no longer travel to spawned
        processes), and it belongs to that trainer. A copy gets the hub of the trainer it is set up in."""
        state = self.__dict__.copy()
        state["_hub"] = None
        return state

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
        """``<monitor>/<layer>/<stat>``, or ``<monitor>/<stat>`` without a layer. A key made with a
        layer is remembered as per-layer, so :meth:`log_metrics` can fold it (``per_layer_scalars``)."""
        if not layer:
            return f"{self.name}/{stat}"
        key = f"{self.name}/{layer}/{stat}"
        self.__dict__.setdefault("_layer_keys", {})[key] = stat
        return key

    to_host = staticmethod(to_host)
    publish = staticmethod(publish)

    def log_metrics(
        self,
        trainer: pl.Trainer,
        metrics: Mapping[str, Number],
        step: int,
        loggers_only: Collection[str] = (),
    ) -> dict[str, float]:
        """Send ``metrics`` to every logger of ``trainer`` at ``step`` (on global rank 0) and put them
        into ``trainer.callback_metrics`` (on every rank, see :func:`~lightning_monitor._values.publish`),
        except the keys in ``loggers_only``; returns them as floats.

        Called on every rank. Tensors cross to the host here in one transfer (none when the values
        are floats already); nothing else syncs. With ``per_layer_scalars`` false, the per-layer keys
        reach the loggers as histograms (see the class docstring).
        """
        host = to_host(metrics)
        if trainer.global_rank == 0:
            layer_keys = {} if self.per_layer_scalars else self.__dict__.get("_layer_keys", {})
            scalars, per_stat = fold_layers(host, layer_keys)
            if scalars:
                for logger in trainer.loggers:
                    logger.log_metrics(scalars, step=step)
            for stat, values in per_stat.items():
                self.log_histogram(trainer, self.layers_tag(stat), torch.tensor(values, dtype=torch.float64), step)
        publish(trainer, host, exclude=loggers_only)
        return host

    def layers_tag(self, stat: str) -> str:
        """``<monitor>/layers/<stat>``: the histogram over the layers of one per-layer statistic."""
        return f"{self.name}/layers/{stat}"

    def log_histogram(self, trainer: pl.Trainer, tag: str, values: Tensor, step: int) -> None:
        """A histogram of ``values`` to every TensorBoard logger (others have no histograms)."""
        log_histogram(trainer, tag, values, step)

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
        """Raise a one-off alert now (while the monitor selects again at the start of the fit, one it already raised
        at setup, the same kind, layer and message, is not raised twice)."""
        record = Alert(step, self.name, kind, severity, message, value, threshold, layer, details)
        if self._reselecting and any((a.monitor, a.kind, a.layer, a.message) == (self.name, kind, layer, message)
                                     for a in self.hub.history):
            return record
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


def _module_ids(module: nn.Module) -> tuple[tuple[str, int], ...]:
    """Every submodule's name and identity: what a selection holds on to. Modules only: the monitors read the
    parameters again at their checks, and FSDP2's ``fully_shard`` in ``configure_model`` replaces every parameter."""
    return tuple((name, id(m)) for name, m in module.named_modules())

"""HealthMonitor: the suite's recommended monitors as one callback.

``Trainer(callbacks=[HealthMonitor()])`` watches a run with spectral alignment, the gradient noise
scale, gradient-weight alignment and a divergence guard (GradES only when asked: it freezes
components, so it changes training), and writes a TensorBoard dashboard of them.

Why one Callback that adds its monitors to the Trainer, and not a factory or a forwarding wrapper:

* A factory returning a list does not fit ``callbacks=[HealthMonitor(), ModelCheckpoint()]`` (a list
  inside the list) nor a LightningCLI ``trainer.callbacks`` entry, which must be one Callback class.
* A wrapper that forwarded every hook to private children would hide them from the Trainer: the
  guard snapshots and restores the other monitors it finds in ``trainer.callbacks``,
  ``EarlyStopping`` / ``ModelCheckpoint`` and the profiler see callbacks there, and a checkpoint keeps
  one state per callback there. Every hook Lightning adds later would have to be forwarded too.

So ``HealthMonitor`` is one Callback (a YAML entry, an element of a list), and at ``setup`` it puts
its monitors into ``trainer.callbacks`` right after itself. From then on they are ordinary callbacks:
Lightning calls each of their hooks, saves each state under its own ``state_key`` and restores it
from a checkpoint (``fit(ckpt_path=...)`` restores after ``setup``). ``HealthMonitor`` itself keeps
no state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_monitor._args import check_bool, resolve_callable
from lightning_monitor.callbacks.base import Monitor
from lightning_monitor.callbacks.divergence_guard import DivergenceGuard
from lightning_monitor.callbacks.grades import GradientEarlyStopping
from lightning_monitor.callbacks.gradient_weight_alignment import GradientWeightAlignmentMonitor
from lightning_monitor.callbacks.noise_scale import GradientNoiseScaleMonitor
from lightning_monitor.callbacks.spectral_alignment import SpectralAlignmentMonitor

__all__ = ["HealthMonitor"]

#: Per-monitor settings: ``True`` (the preset's defaults), ``False`` (off) or a dict of arguments.
MonitorSetting = Union[bool, dict[str, Any]]


def _did_you_mean(err: TypeError, cls: type) -> str:
    """`` (did you mean 'action'?)`` for a TypeError naming an unexpected keyword that is close to one of ``cls``'s
    arguments (a typo in a preset's dict, from Python or a YAML config), else ``""``."""
    import difflib
    import inspect
    import re

    found = re.search(r"unexpected keyword argument '(\w+)'", str(err))
    if found is None:
        return ""
    accepted = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
    close = difflib.get_close_matches(found.group(1), accepted, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; its arguments are {', '.join(accepted)}"


#: the monitors' prefixes (of their scalars, alerts and state) that are not the preset's argument names
_PREFIX_SLOTS = {"sa": "spectral", "gns": "noise_scale"}


def _said_by_prefix(init: Callable[..., None]) -> Callable[..., None]:
    """``HealthMonitor(gns=...)``, the prefix the run's scalars and alerts read, names the argument meant instead of
    Python's bare "unexpected keyword argument 'gns'"."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        for prefix, slot in _PREFIX_SLOTS.items():
            if prefix in kwargs:
                raise TypeError(f"HealthMonitor has no argument `{prefix}`: the monitor whose scalars and alerts "
                                f"read `{prefix}/...` is set with `{slot}=`.")
        init(self, *args, **kwargs)

    return wrapper


class HealthMonitor(Callback):
    """The recommended monitors for the model being trained, as one callback.

    ``trainer = Trainer(callbacks=[HealthMonitor()])``, or in LightningCLI YAML::

        trainer:
          callbacks:
            - class_path: lightning_monitor.HealthMonitor
              init_args:
                spectral: {every_n_steps: 100}
                gwa: false

    Each monitor is an argument: ``True`` builds it with the preset's defaults
    (:attr:`DEFAULTS`, then the monitor's own), a dict passes those arguments on top of them,
    ``False`` leaves it out. An argument ending in ``_fn`` (GWA's ``target_fn`` and ``index_fn``) also
    takes a dotted import path string. The monitors built are the attributes :attr:`spectral`,
    :attr:`noise_scale`, :attr:`gwa`, :attr:`guard` and :attr:`grades` (``None`` when off), to tune or
    read after the fit (``hm.guard.rollbacks``).

    At ``setup`` the monitors join ``trainer.callbacks`` right after this callback (see the module
    docstring for why) and are ordinary callbacks from then on: each logs under its own prefix,
    saves its state under its own ``state_key``, and resumes from a checkpoint. A monitor of the same
    type passed to the Trainer explicitly takes the place of the preset's (one guard, not two).

    **Cadences.** The preset is meant to stay on in every run, so where a monitor's own default would
    cost a noticeable share of a small model's step it samples more sparsely (measured by
    ``benchmarks/bench_suite.py``; pass the monitor's argument to get its own default back):

    * ``noise_scale``: ``every_n_steps=50`` (the monitor's own default: 10). A due step runs the
      per-example gradient-norm probe through the forward and backward pass, which costs about half a
      step of the example GPT on CPU (5% of the run at every 10 steps, 1% at every 50). The noise scale
      drifts over thousands of steps and the monitor smooths its checks (``smoothing=0.9``, about ten
      checks), so one check per 50 steps, as for spectral alignment, still follows it; its alerts wait
      for ``min_checks=5`` checks (250 steps).
    * ``gwa``: ``every_n_steps=10`` (the monitor's own default: 1, the paper's setting). GWA is judged
      once per epoch on the distribution of the epoch's per-sample scores; scoring the batches of every
      10th step estimates that distribution's mean and kurtosis from a tenth of the samples (at the
      example GPT's 1024 scored tokens a step, the scores of all steps cost 6% of the run, a tenth of
      them 0.6%). With ``min_epoch_samples=256`` the cadence is lowered at the first scored step when an
      epoch would give fewer than 256 scored samples (a small dataset: down to every step), said in one
      ``cadence`` info alert: the kurtosis of a few dozen scores is noise.

    The guard keeps its cadence: it judges every step's loss and gradient norm.

    Nothing aborts because a monitor has nothing to watch in this model (no ``nn.Linear`` layer for
    spectral alignment, no classifier head for GWA, or batches whose targets fit no softmax head: regression,
    multi-label, an autoencoder ...): such a monitor says so once in a
    ``nothing_to_watch`` warning alert and stays idle
    (:attr:`~lightning_monitor.Monitor.idle_when_nothing_to_watch`), and the others watch.

    Args:
        spectral: :class:`~lightning_monitor.SpectralAlignmentMonitor` (``sa/...``).
        noise_scale: :class:`~lightning_monitor.GradientNoiseScaleMonitor` (``gns/...``).
        gwa: :class:`~lightning_monitor.GradientWeightAlignmentMonitor` (``gwa/...``).
        guard: :class:`~lightning_monitor.DivergenceGuard`: rolls a diverging run back.
        grades: :class:`~lightning_monitor.GradientEarlyStopping`; off unless asked: it freezes
            converged components and stops the run when all are frozen.
        per_layer_scalars: per-layer statistics as one logger scalar per layer (``True``), or
            folded into one TensorBoard histogram per statistic and check (``False``, the default:
            a 32-layer model gets a few dozen tags, not a thousand);
            see :attr:`~lightning_monitor.Monitor.per_layer_scalars`.
        dashboard: write the TensorBoard Custom Scalars layout of the run
            (:mod:`lightning_monitor.dashboard`) to every TensorBoard logger at the start of the fit.
        progress_bar: add a ``health`` word to Lightning's progress bar (when it is on): ``ok``, or the
            worst condition active among the monitors (``warning: guard/loss_creep``, ``critical: ...``),
            or ``rolled back xN`` after the guard rolled the run back. Read from host state only: no sync.
    """

    #: Arguments the preset gives a monitor unless the setting overrides them (the monitor's own
    #: defaults for everything else).
    DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "spectral": {},
        "noise_scale": {"every_n_steps": 50},
        "gwa": {"every_n_steps": 10, "min_epoch_samples": 256},
        "guard": {},
        "grades": {},
    }
    _CLASSES: ClassVar[dict[str, type[Monitor]]] = {
        "spectral": SpectralAlignmentMonitor,
        "noise_scale": GradientNoiseScaleMonitor,
        "gwa": GradientWeightAlignmentMonitor,
        "grades": GradientEarlyStopping,
        "guard": DivergenceGuard,  # last: it acts after every other monitor of the step was heard
    }

    @_said_by_prefix
    def __init__(
        self,
        spectral: MonitorSetting = True,
        noise_scale: MonitorSetting = True,
        gwa: MonitorSetting = True,
        guard: MonitorSetting = True,
        grades: MonitorSetting = False,
        per_layer_scalars: bool = False,
        dashboard: bool = True,
        progress_bar: bool = True,
    ) -> None:
        super().__init__()
        settings = {"spectral": spectral, "noise_scale": noise_scale, "gwa": gwa, "guard": guard, "grades": grades}
        self.per_layer_scalars = check_bool("per_layer_scalars", per_layer_scalars)
        self.dashboard = check_bool("dashboard", dashboard)
        self.progress_bar = check_bool("progress_bar", progress_bar)
        self.spectral: Optional[SpectralAlignmentMonitor] = None
        self.noise_scale: Optional[GradientNoiseScaleMonitor] = None
        self.gwa: Optional[GradientWeightAlignmentMonitor] = None
        self.guard: Optional[DivergenceGuard] = None
        self.grades: Optional[GradientEarlyStopping] = None
        for slot in self._CLASSES:
            setattr(self, slot, self._build(slot, settings[slot]))

    def _build(self, slot: str, setting: Any) -> Optional[Monitor]:
        if setting is False or setting is None:
            return None
        if setting is True:
            setting = {}
        if not isinstance(setting, Mapping):
            raise TypeError(
                f"HealthMonitor(`{slot}`=...) takes True, False or a dict of arguments, got {type(setting).__name__}."
            )
        kwargs = {**self.DEFAULTS.get(slot, {}), **setting}
        for arg, value in kwargs.items():
            if arg.endswith("_fn"):
                kwargs[arg] = resolve_callable(f"{slot}.{arg}", value)
        cls = self._CLASSES[slot]
        try:
            monitor = cls(**kwargs)
        except TypeError as err:
            raise TypeError(f"HealthMonitor(`{slot}`=...): {cls.__name__}: {err}{_did_you_mean(err, cls)}") from None
        except ValueError as err:
            # the arguments every monitor has (`every_n_steps`, `warmup_steps`): which monitor's value is wrong, also
            # in a LightningCLI YAML, where no traceback points at the dict
            raise ValueError(f"HealthMonitor(`{slot}`=...): {cls.__name__}: {err}") from None
        monitor.idle_when_nothing_to_watch = True
        monitor.per_layer_scalars = self.per_layer_scalars
        return monitor

    @property
    def monitors(self) -> list[Monitor]:
        """The monitors this preset built, in the order they join the Trainer."""
        return [m for m in (getattr(self, slot) for slot in self._CLASSES) if m is not None]

    # ------------------------------------------------------------------ joining the Trainer
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        present = list(trainer.callbacks)
        # another preset in the same Trainer (a YAML's, and one added on the command line): its monitors came first
        others = {id(m) for p in present if isinstance(p, HealthMonitor) and p is not self for m in p.monitors}
        joining, kept_other = [], []
        for slot in self._CLASSES:
            monitor = getattr(self, slot)
            if monitor is None or any(cb is monitor for cb in present):
                continue  # joined at an earlier setup of this Trainer: Lightning calls its hooks itself
            explicit = next((cb for cb in present if isinstance(cb, type(monitor))), None)
            if explicit is not None:
                if id(explicit) in others:
                    kept_other.append(type(explicit).__name__)
                else:
                    rank_zero_info(
                        f"HealthMonitor: the {type(explicit).__name__} passed to the Trainer replaces the preset's."
                    )
                # the attribute names the monitor that watches the run (`hm.guard.rollbacks` read after the fit were
                # the unused preset guard's, always empty)
                setattr(self, slot, explicit)
                continue
            joining.append(monitor)
        if kept_other:
            rank_zero_warn(
                f"HealthMonitor: the Trainer has two HealthMonitor presets; the first one's {', '.join(kept_other)} "
                "watch the run and this one's are not added (its settings for them are not used). Keep one preset, "
                "with all its settings, or pass the monitors themselves."
            )
        if not joining:
            return
        at = next(i for i, cb in enumerate(present) if cb is self) + 1
        # A new list: the loop running this `setup` hook iterates the old one, so it does not reach the
        # joining monitors, which are set up here, once; every later hook reads the new list.
        trainer.callbacks = present[:at] + joining + present[at:]
        for monitor in joining:
            monitor.setup(trainer, pl_module, stage)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        watching = [m for m in trainer.callbacks if isinstance(m, Monitor)]
        for monitor in watching:  # a model built in `configure_model` exists from here: each monitor selects first
            monitor.select_built_model(trainer, pl_module)
        self._said_watching = False  # said at the first batch: after every monitor's own start hooks
        if self.dashboard:
            from lightning_monitor.dashboard import write_dashboard

            write_dashboard(trainer)
        bar = trainer.progress_bar_callback
        if self.progress_bar and bar is not None and not getattr(bar.get_metrics, "_health_word", False):
            original = bar.get_metrics

            def get_metrics(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
                return {**original(trainer, pl_module), "health": self.health_word(trainer)}

            get_metrics._health_word = True  # type: ignore[attr-defined]
            bar.get_metrics = get_metrics  # this bar instance only

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """What watches the run, said once a fit at its first batch: after every monitor's own ``on_fit_start`` and
        ``on_train_start``, where some go idle (the noise scale and GWA with several optimizers: said to watch, then
        idle a moment later)."""
        if getattr(self, "_said_watching", True):
            return
        self._said_watching = True
        watching = [m for m in trainer.callbacks if isinstance(m, Monitor)]
        active = [m.name for m in watching if getattr(m, "idle_reason", None) is None]
        idle = [f"{m.name} ({m.idle_reason})" for m in watching if getattr(m, "idle_reason", None) is not None]
        rank_zero_info(
            "HealthMonitor: watching " + (", ".join(active) or "nothing")
            + ("; idle: " + "; ".join(idle) if idle else "")
        )

    @staticmethod
    def health_word(trainer: pl.Trainer) -> str:
        """One word on the run's health from the monitors' host state (no device access): the worst active
        condition (``critical: <monitor>/<kind>``, ``warning: ...``), else ``rolled back xN`` if the guard
        rolled the run back, else ``ok``."""
        worst: Optional[tuple[int, str]] = None
        rollbacks = 0
        for cb in trainer.callbacks:
            if not isinstance(cb, Monitor):
                continue
            rollbacks += len(getattr(cb, "rollbacks", []) or [])
            for (kind, _), severity in cb.active_conditions().items():
                rank = {"warning": 1, "critical": 2}.get(severity, 0)
                if rank and (worst is None or rank > worst[0]):
                    worst = (rank, f"{severity}: {cb.name}/{kind}")
        if worst is not None:
            return worst[1]
        return f"rolled back x{rollbacks}" if rollbacks else "ok"

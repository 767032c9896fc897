"""DivergenceGuard: catch a diverging run early and take it back to its last good state."""

from __future__ import annotations

import contextlib
import copy
import math
import operator
import os
import re
from collections import deque
from collections.abc import Iterable, Mapping, MutableMapping, MutableSequence
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_monitor._args import (check_bool, check_fraction, check_int, check_nonnegative, check_positive,
                                     deprecated_aliases)
from lightning_monitor._compat import (
    backward_skipped,
    foreach_norm,
    fork_rng_of,
    grad_scaler_scale,
    random_states_of,
    seed_streams_of,
    set_random_states_of,
)
from lightning_monitor._replays import (WritesUndone, attributes, host_random_states, plain_parameters, restore_attributes,
                                       set_host_random_states)
from lightning_monitor._sharded import local, nonfinite_on_host, squared_norms
from lightning_monitor.alerts import SUPERSEDED_FILENAME, Alert, alerts_dir, read_records
from lightning_monitor.callbacks.base import Monitor, NothingToWatch
from lightning_monitor.functional.robust import SeriesWatch, median
from lightning_monitor.probes import dry_run
from lightning_monitor.snapshot import TrainingSnapshot, grid_at, held_values, pruned_since, scale_learning_rates

try:  # Lightning 2.6: EMAWeightAveraging and its base
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # pragma: no cover - older Lightning
    WeightAveraging = None

__all__ = ["DivergenceGuard"]

Action = Literal["rollback", "stop", "warn"]

#: normal batches a loss surge is tested on (see ``DivergenceGuard._surge_test``)
_REFERENCES = 4
#: samples the evidence of a replay should hold: with batches of fewer than ``_REFERENCE_SAMPLES / _REFERENCES``
#: samples, more reference batches are kept, a surge that the last ``_REFERENCES`` find broken is asked again on
#: this many samples, and a rise is attributed on that many samples of its own batches (at batch size 1 one hard
#: example made 4 single-example references "lose half the surge": healthy runs were stopped, 6 of 9)
_REFERENCE_SAMPLES = 16
#: consecutive steps above ``blowup`` times the initial loss that make an explosion before the loss has a
#: history (the first steps of a run are erratic: a spike that settles within a few steps is not a divergence)
_EARLY_PATIENCE = 10
#: after a new normal, the initial level is taken again as the median of this many losses (if lower than the first)
_REANCHOR_STEPS = 10
#: factor over its lowest value at which a creeping smoothed loss is judged like an explosion (a slow climb)
_CLIMB = 1.5
#: steps after a rollback within which a creep is judged as a climb (see _creep)
_AFTER_ROLLBACK = 200
#: a creep episode whose smoothed loss has risen by at most _PLATEAU_RISE over _PLATEAU_STEPS steps has settled
_PLATEAU_STEPS = 100
_PLATEAU_RISE = 0.05
#: factor by which a learning rate must have come back up from its low to make a warm restart (``lr_restart``)
_RESTART = 1.5
#: judged steps without a loss, before any with one, after which the guard says it sees no loss (``training_step``
#: returns none: manual optimization); fewer are batches skipped on purpose
_LOSSLESS_STEPS = 10
#: batches that must each step every optimizer after all of the batch's backward passes before several optimizers are
#: taken for one loss shared out over parameter groups (Muon with AdamW, SparseAdam with Adam), whose level is judged
_ONE_LOSS_BATCHES = 3
#: the fit's first snapshot steps (with a finite loss) whose batch is evaluated again at once, under the weights the step
#: saw, to check that a replay gives the step's loss (see DivergenceGuard._check_replay); and the relative difference allowed
#: (kernels chosen with and without gradients, bf16 rounding: far below the differences that matter, 2-90%)
_FAITHFUL_CHECKS = 3
_FAITHFUL_TOLERANCE = 1e-2
#: fresh random draws under which a surge must come back before older weights are asked about its batch
_FRESH_DRAWS = 3


#: a rise of the weight decay can explain a rise of the loss (``decay_change``) only where the decay is strong: its
#: shrink of the weights a step, ``lr * weight_decay`` (decoupled, as AdamW's), at least this (the weights would halve
#: in about 700 steps without gradients; AdamW's usual 1e-3 * 0.01 is 1e-5)
_DECAY_STRENGTH = 1e-3


def _copy_rows(rows: Optional[list[list[Any]]]) -> Optional[list[list[Any]]]:
    return None if rows is None else [list(r) for r in rows]


def _samples(batch: Any) -> Optional[int]:
    """The number of samples in a batch: the leading size of its first tensor (depth first through mappings and
    sequences), or ``None`` when it holds no tensor with a dimension."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            n = _samples(item)
            if n is not None:
                return n
    return None


def _kept(batch: Any, copied: bool = False) -> Any:
    """A batch as the guard keeps it for a replay: a mutable container (a dict, a ``BatchEncoding``, a list) is copied
    one level deep, so a ``training_step`` that pops or replaces its entries leaves the kept one whole; the tensors are
    shared, not copied. Anything else is kept as it is. ``copied``: the tensors are copied too (every container Lightning
    can move to a device is rebuilt), for a step that writes into its batch's tensors (``x /= 16``)."""
    if copied:
        try:
            return apply_to_collection(batch, Tensor, _copy_tensor)
        except Exception:  # noqa: BLE001 - a container it cannot rebuild (a dataclass whose fields are not all init
            pass  # arguments): copied one level deep, as below
    if isinstance(batch, (MutableMapping, MutableSequence)):
        try:
            return copy.copy(batch)
        except Exception:  # noqa: BLE001 - a container that cannot be copied is kept as it is
            return batch
    return batch


def _copy_tensor(t: Tensor) -> Tensor:
    copied = t.detach().clone()
    return copied.requires_grad_() if t.requires_grad and copied.is_floating_point() else copied


def _tensor_versions(batch: Any, out: list[tuple[Tensor, int]], depth: int = 0) -> list[tuple[Tensor, int]]:
    """``(tensor, its in-place version counter)`` for the tensors of a batch (containers a few levels deep, a few dozen
    tensors at most): a counter that has moved by the end of the step means the step wrote into its batch."""
    if isinstance(batch, Tensor):
        out.append((batch, batch._version))
    elif depth < 4 and len(out) < 64:
        values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
        for item in values:
            _tensor_versions(item, out, depth + 1)
    return out


def _wide(t: Tensor) -> Tensor:
    """A loss in float32, or in float64 where it is (a finite float64 loss beyond float32's range is no inf)."""
    return t if t.dtype == torch.float64 else t.float()

class _AveragedWeights:
    """The running average of :class:`~lightning.pytorch.callbacks.StochasticWeightAveraging` as a snapshot holds it:
    a rollback takes the average back too, so the weights it undoes leave the average (SWA adds the weights of each
    epoch's start; those of a diverged stretch would stay in the final model otherwise). Restored in place: the
    callback's own ``load_state_dict`` only primes a resume."""

    def __init__(self, swa: Any) -> None:
        self.swa = swa

    def state_dict(self) -> dict[str, Any]:
        swa = self.swa
        epoch = swa._latest_update_epoch
        if epoch < 0 or swa._average_model is None or swa.n_averaged is None:
            return {"latest_update_epoch": -1}  # nothing averaged yet
        return {"latest_update_epoch": epoch, "n_averaged": swa.n_averaged,
                "average": swa._average_model.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        swa = self.swa
        swa._latest_update_epoch = state["latest_update_epoch"]
        if swa.n_averaged is not None:
            swa.n_averaged.fill_(int(state.get("n_averaged", 0)))  # 0: the next update starts the average afresh
        if "average" in state and swa._average_model is not None:
            with torch.no_grad():
                current = swa._average_model.state_dict()
                for name, saved in state["average"].items():
                    current[name].copy_(saved)


class _SnapshotOf:
    """A monitor as a snapshot holds it: :meth:`~lightning_monitor.Monitor.snapshot_state` and
    :meth:`~lightning_monitor.Monitor.load_snapshot_state` in the place of its checkpoint state."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    def state_dict(self) -> dict[str, Any]:
        return self.monitor.snapshot_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.monitor.load_snapshot_state(state)


class _WeightAverage:
    """The average of Lightning's :class:`~lightning.pytorch.callbacks.WeightAveraging` (``EMAWeightAveraging``, an
    average of the weights after every step) as a snapshot holds it: a rollback takes the average back too. The average
    had taken in the diverged weights of the steps rolled back over, and Lightning puts it into the model at the end of
    the fit: a run rolled back once ended with weights far worse than its own (held-out loss 2.57 against 1.47 for the
    raw weights). Restored in place, with the step and epoch of its last update."""

    def __init__(self, averaging: Any, trainer: Optional[pl.Trainer] = None) -> None:
        self.averaging, self.trainer = averaging, trainer

    def state_dict(self) -> dict[str, Any]:
        cb = self.averaging
        state = {"latest_update_step": cb._latest_update_step, "latest_update_epoch": cb._latest_update_epoch}
        if cb._average_model is not None:
            state["average"] = cb._average_model.state_dict()  # the averaged weights and `n_averaged`
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        cb = self.averaging
        # its last update no earlier than this step: listed after the guard, the average took the restored weights in
        # once more at the end of the step (an update the run trained without the undone steps never makes)
        now = self.trainer.global_step if self.trainer is not None else 0
        cb._latest_update_step = max(state["latest_update_step"], now)
        cb._latest_update_epoch = state["latest_update_epoch"]
        if "average" in state and cb._average_model is not None:
            with torch.no_grad():
                current = cb._average_model.state_dict()
                for name, saved in state["average"].items():
                    if name in current:
                        current[name].copy_(saved)


def _is_critical(alert: Optional[Alert]) -> bool:
    return alert is not None and alert.severity == "critical"


def _nonfinite_only(reasons: list[str]) -> bool:
    """Whether ``reasons`` (critical ones) are all of a step's non-finite loss or gradient, and there is one."""
    return bool(reasons) and all(r.startswith(("non-finite loss", "non-finite gradient")) for r in reasons)


class DivergenceGuard(Monitor):
    r"""Watches the training loss and gradient norm; rolls a diverging run back to its last good state.

    **Every optimizer step, without a host sync:** the step's loss (unscaled under AMP) and the fp32 global
    gradient norm (before clipping), averaged over the ranks, are copied to the host asynchronously and
    judged ``lag_steps`` steps later (0 on CPU, 2 on an accelerator: the copy is done by then; from an accelerator
    other than CUDA, such as MPS, the copy waits for the device instead: there is no CUDA event to mark its end). On
    one CPU process, where nothing waits, one fused finiteness check reads the gradients instead, and the norm is taken
    only when it finds something (only a non-finite norm is judged). Non-finite
    gradients are zeroed (``zero_nonfinite_grads``), so a NaN/Inf never reaches the weights. Every
    ``every_n_steps`` steps the guard also checks: snapshots, and the other monitors' critical alerts.

    **The rules, judged every step:**

    * ``nonfinite`` (critical): a NaN/Inf loss or gradient norm (not an overflow an AMP scaler skips), or
      a parameter or buffer (BatchNorm statistics) found non-finite when a snapshot is due;
    * ``loss_explosion`` (critical): a *surge* (an anomalous loss above ``1 + surge`` times its recent level)
      on which the last normal batches, evaluated again, agree (they lost at least half as much: the weights
      broke everywhere), on its step; or the loss stays ``patience`` consecutive steps above its own recent
      history (robust z-score over ``z_threshold``, with a deviation floor of ``initial_floor`` times the
      initial loss, so near-zero losses do not alarm on tiny wobbles) or above ``blowup`` times the initial
      loss (this catches a blow-up before any history exists: at once when the first batches, evaluated again,
      have lost ``blowup`` times their loss too; else after 10 steps), or a ``loss_creep`` has raised the smoothed
      loss by half over its lowest value and by a quarter of the initial loss (a slow climb), **and** the rise is the weights' doing:
      the current batch is evaluated again with the weights of every kept snapshot from before the rise; if
      each finds the batch about as hard (``data_shift``, a warning: the data changed, not the run), nothing acts;
      a rise that begins on the first step of a fit that goes on from a checkpoint (or an earlier fit) is a
      ``data_shift`` too: that step's loss came from weights nothing has updated since;
    * ``objective_change`` (warning): a surge the newest snapshot from before it sees on the recent batches too:
      the loss function changed (a term switched on), not the weights; nothing acts;
    * ``lr_restart`` (warning): a surge or a sustained rise while the learning rate is back up (by 1.5 times
      or more from its low) at a level the run already trained at with a normal loss, having come down from it
      since: the transient of a warm restart (SGDR, a cyclic schedule, a new stage's warm-up). Nothing acts, the
      new level is the normal; once per rise of the rate, and not when the loss passes ``blowup`` times the
      initial loss or after a rollback has capped the rates. A rate that rises to a new height is judged as
      always;
    * ``loss_creep`` (warning): the smoothed loss risen above its lowest value by ``creep`` of that value,
      by at least ``initial_floor`` of the initial loss, and by more than batch noise moves the average
      (six of its standard deviations, from the robust batch-to-batch noise); it clears halfway back;
    * critical alerts of the suite's other monitors (``act_on_alerts``) and, with ``corroborate=True``,
      a guard warning and an active divergence warning of another monitor together (``corroborated``).
    Only critical alerts act. A surge the recent batches do not share is one hard batch: nothing is raised. The
    gradient norm is judged for non-finite values only: on the scenario zoo a sustained gradient surge never
    came before a loss explosion and did fire on a healthy curriculum (BENCHMARKS.md).

    **Actions** on a critical decision (reduced across ranks: every rank acts on the same step):

    * ``"rollback"`` (default): restore the newest snapshot that predates the first anomalous step
      (parameters, buffers, optimizers, LR schedulers, AMP scaler, the monitors' states), skip the batches
      seen since (recorded in the ``rolled_back`` alert, in ``alerts.jsonl`` and in the checkpoint state)
      and go on. The learning rate: kept after bad data (a non-finite value, or a corrupt batch that broke the
      weights); capped at the rate of the best smoothed loss (and at ``lr_factor`` times the rate of the
      divergence) when the weights diverged while the rate rose since (a warm-up, ramp or jump); scaled by
      ``lr_factor`` when they diverged at a steady rate. Each further rollback within ``rollback_window``
      steps scales by one more power of ``lr_factor`` and caps at the scaled rate restored. After
      ``max_rollbacks`` rollbacks within the window, or without a snapshot to go back to, it stops instead.
    * ``"stop"``: restore that snapshot (with the other monitors' states and the guard's detectors, as a
      rollback does), save a checkpoint ``guard-step=<step>.ckpt`` (so the file holds the last good state,
      never the diverged weights) and stop.
    * ``"warn"``: raise the alerts only.

    **Snapshots** are taken every ``snapshot_every_n_checks`` checks, at a check that found every step since
    the last check normal and every parameter and buffer finite (a refused one is tried again at the next
    check), in host memory (``snapshot_dir=None``) or in files; the newest ``keep_snapshots`` are kept. The trainer's step counter is not rewound: logged
    steps stay monotonic, ``max_steps`` keeps counting, and the skipped batches are simply not learned from.
    Snapshot files are listed in every checkpoint: a run resumed from it after the process died (files are
    deleted when a fit ends) goes on with the listed snapshots whose files every rank still has, so its
    first rollback can reach back before the resume. Snapshots in host memory do not outlive the process;
    a resumed run takes its first at its first check.

    Args:
        action: what the guard may do on a critical decision: ``"rollback"``, ``"stop"`` or ``"warn"``
            (alerts only). The guard keeps a mode rather than the suite's boolean ``stop`` because it has
            three.
        every_n_steps: steps between checks (snapshots, other monitors' alerts); every step's loss is judged
            anyway. Deprecated alias: ``check_every_n_steps``.
        warmup_steps: no check before this optimizer step.
        snapshot_every_n_checks: checks between snapshots (a snapshot every ``snapshot_every_n_checks *
            every_n_steps`` steps, 10 by default); ``None``: no snapshots (a stop then saves the current
            state, no data-shift test, no rollback).
        keep_snapshots: snapshots kept (>= 1).
        snapshot_dir: directory for snapshot files; ``None`` keeps them in host memory.
        lr_factor: learning-rate factor of a rollback (see above; in (0, 1]; 1 keeps the rate).
        max_rollbacks: rollbacks within ``rollback_window`` steps before the guard stops instead.
        rollback_window: steps over which rollbacks are counted.
        skip_batches: ``(epoch, batch_idx)`` pairs whose update to skip, or the path of an ``alerts.jsonl``
            whose ``rolled_back`` alerts list them (a run restarted from an earlier checkpoint then skips
            the batches an earlier attempt rolled back over).
        min_history: normal values a series needs before its z-score is judged.
        window: length of that history.
        z_threshold: robust z-score above which a value is anomalous.
        patience: consecutive anomalous steps that make an explosion. Counted in optimizer steps, not
            checks: the guard judges every step's loss (buffered on the device between checks).
        loss_rel_floor: the loss deviation floor, as a fraction of the reference level.
        initial_floor: the loss deviation floor, and the creep floor, as a fraction of the initial loss.
        blowup: a loss above ``blowup`` times the initial loss is anomalous whatever its history.
        creep: relative rise of the smoothed loss over its minimum that warns (``None``: off).
        smoothing: decay of that moving average, per step (``m = smoothing * m + (1 - smoothing) * loss``).
        attribute: test whether a loss explosion is the weights' doing before acting (see above).
        zero_nonfinite_grads: zero non-finite gradients on the device every step.
        act_on_alerts: act on critical alerts of other monitors too.
        corroborate: a guard warning and an active warning of another monitor named in ``corroborate_with``
            together are critical. Off by default: on our scenarios spectral alignment's warnings also fired
            in matched controls (see BENCHMARKS.md), so they are not evidence of divergence.
        corroborate_with: ``"<monitor>/<kind>"`` of the conditions that count (conditions that clear, about
            divergence; one-off alerts such as ``gns/no_variance_estimate`` never clear and do not belong).
        dirpath: where a stop checkpoint goes (default: the ModelCheckpoint's ``dirpath``, else
            ``<log_dir>/checkpoints``).
        lag_steps: steps between a step and the judging of its values (``None``: 0 on CPU, 2 on an
            accelerator, where the asynchronous copy has finished by then).
        surge: an anomalous loss above ``1 + surge`` times its recent level is tested on the recent batches
            at once.
        optimizer_index: with several optimizers (manual optimization, e.g. a GAN's generator and
            discriminator), the optimizer whose loss series is judged; the steps of the others are checked
            for non-finite gradients only, so two losses are never mixed in one series.
        loss_rules: whether the loss's level is judged (``loss_explosion``, ``loss_creep``, ``objective_change``,
            ``data_shift``); non-finite losses and gradients are judged always. ``None`` (default): with one
            optimizer; with several, where the first 3 batches that step show one loss shared out over them (each
            batch steps every optimizer after all its backward passes: Muon with AdamW), and not where they are
            players whose losses rise by design (a GAN's generator loss climbs as its discriminator improves: with the
            rules on, 1 of 6 healthy GANs of ``benchmarks/guard_gan.py`` was rolled back after 825 steps of it).
            ``True`` judges the level of ``optimizer_index``'s loss with several optimizers in any case.
    """

    name = "guard"

    @deprecated_aliases(check_every_n_steps="every_n_steps")
    def __init__(
        self,
        action: Action = "rollback",
        every_n_steps: int = 10,
        warmup_steps: int = 0,
        snapshot_every_n_checks: Optional[int] = 1,
        keep_snapshots: int = 2,
        snapshot_dir: Optional[str] = None,
        lr_factor: float = 0.5,
        max_rollbacks: int = 4,
        rollback_window: int = 1000,
        skip_batches: Union[None, str, os.PathLike, list[tuple[int, int]]] = None,
        min_history: int = 20,
        window: int = 100,
        z_threshold: float = 6.0,
        patience: int = 3,
        loss_rel_floor: float = 0.02,
        initial_floor: float = 0.05,
        blowup: float = 2.0,
        creep: Optional[float] = 0.1,
        smoothing: float = 0.9,
        attribute: bool = True,
        zero_nonfinite_grads: bool = True,
        act_on_alerts: bool = True,
        corroborate: bool = False,
        corroborate_with: tuple[str, ...] = ("sa/collapse", "sa/sigma_growth"),
        dirpath: Optional[str] = None,
        lag_steps: Optional[int] = None,
        surge: float = 0.3,
        optimizer_index: int = 0,
        loss_rules: Optional[bool] = None,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, warmup_steps=warmup_steps)
        if loss_rules is not None and not isinstance(loss_rules, bool):
            raise TypeError(f"`loss_rules` must be True, False or None, got {loss_rules!r}.")
        self.loss_rules = loss_rules
        self._levels = loss_rules is not False  # resolved at the start of the fit (several optimizers: off)
        if action not in ("rollback", "stop", "warn"):
            raise ValueError(f"`action` must be 'rollback', 'stop' or 'warn', got {action!r}.")
        if snapshot_every_n_checks is not None:
            check_int("snapshot_every_n_checks", snapshot_every_n_checks, 1)
        elif action == "rollback":
            raise ValueError("`action='rollback'` needs snapshots: set `snapshot_every_n_checks`.")
        self.keep_snapshots = check_int("keep_snapshots", keep_snapshots, 1)
        self.max_rollbacks = check_int("max_rollbacks", max_rollbacks, 1)
        self.rollback_window = check_int("rollback_window", rollback_window, 1)
        self.min_history = check_int("min_history", min_history, 1)
        self.window = check_int("window", window, 3)
        self.patience = check_int("patience", patience, 1)
        if min_history > window:
            raise ValueError(f"`min_history` ({min_history}) must not exceed `window` ({window}).")
        if check_positive("lr_factor", lr_factor) > 1.0:
            raise ValueError(f"`lr_factor` must be in (0, 1], got {lr_factor!r}.")
        self.creep = creep if creep is None else check_positive("creep", creep)
        self.smoothing = check_fraction("smoothing", smoothing, 0.0, 1.0, high_inclusive=False)
        if check_positive("blowup", blowup) <= 1.0:
            raise ValueError(f"`blowup` must be a number > 1, got {blowup!r}.")
        check_nonnegative("initial_floor", initial_floor)
        check_nonnegative("loss_rel_floor", loss_rel_floor)
        if isinstance(corroborate_with, str):  # one kind, not its characters
            corroborate_with = (corroborate_with,)
        try:
            kinds = tuple(corroborate_with)
        except TypeError:
            kinds = (None,)
        if not all(isinstance(k, str) and k for k in kinds):
            raise TypeError("`corroborate_with` must be an alert kind ('sa/collapse') or a sequence of them, got "
                            f"{corroborate_with!r}.")
        self.lag_steps = lag_steps if lag_steps is None else check_int("lag_steps", lag_steps, 0)
        self.surge = check_positive("surge", surge)
        self.optimizer_index = check_int("optimizer_index", optimizer_index, 0)
        self.z_threshold = check_positive("z_threshold", z_threshold)
        self.action = action
        self.snapshot_every_n_checks = snapshot_every_n_checks
        #: steps between snapshots (``None``: no snapshots)
        self.snapshot_every_n_steps = None if snapshot_every_n_checks is None else snapshot_every_n_checks * self.every_n_steps
        self.snapshot_dir = snapshot_dir
        self.lr_factor = float(lr_factor)
        self.initial_floor = float(initial_floor)
        self.blowup = float(blowup)
        self.attribute = check_bool("attribute", attribute)
        self.zero_nonfinite_grads = check_bool("zero_nonfinite_grads", zero_nonfinite_grads)
        self.act_on_alerts = check_bool("act_on_alerts", act_on_alerts)
        self.corroborate = check_bool("corroborate", corroborate)
        self.corroborate_with = kinds
        self.dirpath = dirpath
        self._skip_given = frozenset(self._read_skip(skip_batches))
        self._loss_watch = SeriesWatch(window, min_history, self.z_threshold, float(loss_rel_floor))
        # the last batches (references only) and the losses of the last normal steps: a surge is tested on them
        # (step, batch, batch_idx, torch's random states when the step began: a replay draws what the step drew)
        self._recent_batches: deque[tuple[int, Any, int, Any]] = deque(maxlen=_REFERENCES + 3)
        self._normal_recent: deque[tuple[int, float]] = deque(maxlen=_REFERENCES)
        # normal batches from before the last rollback's snapshot, with their losses (see _weights_intact)
        self._refs_before: list[tuple[tuple[Any, int, Any], float]] = []
        # (step, learning rates) of the last steps, as far back as the moving average reaches
        self._lr_trace: deque[tuple[int, list[list[Optional[float]]]]] = deque(
            maxlen=2 + round(self.smoothing / (1.0 - self.smoothing)) + (lag_steps or 2))
        # the learning rates of the last judged steps with a loss other than 0, as far back as the moving average's age
        self._judged_lrs: deque[Optional[list[list[Optional[float]]]]] = deque(
            maxlen=2 + round(self.smoothing / (1.0 - self.smoothing)))
        self._flat_shards = False  # FSDP1: plain gradients are this rank's shards
        self._batch: Any = None
        self._batch_idx = 0
        self._batch_rng: Any = None  # torch's random states when the batch's step began (see on_train_batch_start)
        self._warned_no_loss = False
        self._loss_seen = False  # a judged step of this guard's had a loss
        self._lossless = 0  # judged steps without a loss before the first with one
        self._snapshots: list[TrainingSnapshot] = []
        self._ref_batches: Optional[int] = None  # reference batches kept this fit (see _size_references)
        self._evaluated: Optional[tuple[int, int]] = None  # (step, optimizer) whose first closure evaluation was judged
        #: every rollback: dicts with ``step``, ``to_step``, ``skipped`` (count), ``batches`` ([epoch, batch_idx]),
        #: ``lr_factor``, ``lr_scale`` (cumulative), ``loss_before`` (median recent loss of the state restored), ``reasons``
        self.rollbacks: list[dict[str, Any]] = []
        #: path of the checkpoint written when the guard stopped the run, else None
        self.stop_checkpoint: Optional[str] = None
        #: step at which the guard stopped the run, else None
        self.stopped_step: Optional[int] = None
        # the flag the fused finiteness check of the gradients sets (kept at 0 between steps: no allocation a step)
        self._found = torch.zeros(1)
        self._reset_run_state()  # the run state, empty

    def _state_key(self) -> str:
        return self._generate_state_key(action=self.action, every_n_steps=self.every_n_steps)

    @staticmethod
    def _read_skip(skip: Union[None, str, os.PathLike, list[tuple[int, int]]]) -> list[tuple[int, int]]:
        if skip is None:
            return []
        if isinstance(skip, os.PathLike):
            skip = os.fspath(skip)
        if isinstance(skip, bytes) or not isinstance(skip, (str, Iterable)):
            raise TypeError("`skip_batches` must be an alerts.jsonl path (str or os.PathLike) or a list of (epoch, "
                            f"batch_idx) pairs of integers, got {type(skip).__name__}.")
        if isinstance(skip, str):
            if not os.path.isfile(skip):
                raise FileNotFoundError(f"`skip_batches` names {skip!r}, which is not a file (an alerts.jsonl).")
            out: list[tuple[int, int]] = []
            # and the records a resume into the same folder moved aside (written after the checkpoint it went back
            # to): a restart from an older checkpoint skips the batches without rolling back, so it writes none of
            # its own, and a second restart read an empty list and trained on them again
            superseded = os.path.join(os.path.dirname(skip), SUPERSEDED_FILENAME)
            for path in [skip] + ([superseded] if os.path.isfile(superseded) else []):
                for _, record in read_records(path)[0]:  # a torn last line (a killed run) is skipped
                    if record.get("kind") == "rolled_back" and record.get("details"):
                        out += [(int(e), int(b)) for e, b in record["details"].get("batches", [])]
            return sorted(set(out))
        out = []
        for entry in skip:
            pair = tuple(entry) if isinstance(entry, (list, tuple)) else ()
            try:
                if len(pair) != 2 or any(isinstance(v, bool) for v in pair):
                    raise TypeError
                out.append((operator.index(pair[0]), operator.index(pair[1])))
            except TypeError:
                raise ValueError("`skip_batches` must be an alerts.jsonl path or a list of (epoch, batch_idx) pairs of "
                                 f"integers, got the entry {entry!r}.") from None
        return out

    # ------------------------------------------------------------------ lifecycle
    def select(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        kind = type(trainer.strategy).__name__
        if "DeepSpeed" in kind:
            raise NothingToWatch(
                f"{kind} holds the gradients and optimizer state in its engine's partitions, which the guard "
                "can neither read per step nor snapshot; use DDP, FSDP2 (ModelParallelStrategy) or FSDP.")
        # FSDP1 keeps each rank's gradients as plain flat shards: their squared norms add up across the ranks
        self._flat_shards = "FSDP" in kind
        self.hub.subscribe(self._on_alert)
        for directory, what in ((self.dirpath, "dirpath"), (self.snapshot_dir, "snapshot_dir")):
            if directory is None:
                continue
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as err:
                raise PermissionError(
                    f"DivergenceGuard cannot create `{what}` {directory!r} ({err.strerror}); pass a writable directory."
                ) from err

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the first step of a fit is computed with weights that nothing has updated since the state the guard carries
        # (a checkpoint's, or the previous fit's in the same Trainer)
        self._resume_step = trainer.global_step
        self._normal_in_fit = 0  # steps of this fit judged normal (their updates kept)
        if trainer.world_size > 1:
            self._say_uneven_ranks(trainer)
        if self.idle_reason is None:
            self._infinite_by_design = self._infinite_buffers(trainer, pl_module)
        adopted = False
        if self.idle_reason is None and self._snapshot_files:
            self._adopt_snapshot_files(trainer)
            adopted = bool(self._snapshots)
        if (trainer.ckpt_path is None and self._loss_watch.history and trainer.optimizers
                and not any(opt.state for opt in trainer.optimizers)):
            # a fit that goes on from earlier weights with new optimizers (a second fit of the same Trainer, no
            # checkpoint): the first updates of a fresh optimizer overshoot and settle, as at the start of a run, so
            # the loss is judged as at the start (its history restarts; the initial level stays). Not a resume from a
            # checkpoint: its optimizers are the checkpoint's, even where they keep no state (plain SGD), and the
            # history was dropped on every such resume
            self._new_normal([])
            self._normal_recent.clear()
        if trainer.ckpt_path is None and (self._lr_ceiling is not None or self._lr_scale != 1.0):
            self._lift_lr_ceiling(trainer)
        if (self.idle_reason is None and self.snapshot_every_n_steps is not None
                and (not self._snapshots or (adopted and self._snapshots[-1].step < trainer.global_step))):
            # a resumed run (or a later fit) starts from a state that training reached and left normal (the snapshots
            # in host memory did not travel with the checkpoint): kept at once, else an anomaly at the first check
            # after the resume found no snapshot to go back to and stopped the run. A fresh fit's too: a NaN input in
            # the first batch of a BatchNorm model made its statistics NaN before the first check, which then kept no
            # snapshot, and the run was stopped at step 0. Also beside the snapshot files
            # adopted from `snapshot_dir`, which are older: a NaN right after the resume went back to the newest
            # file, undoing the steps between it and the checkpoint as well
            self._snapshot_now(trainer, pl_module)
            if self._snapshots and not self._saved_broken():
                # the checkpoint's own state: an anomaly at this very step (a bad batch) goes back to it, not to a stop.
                # Not where the checkpoint said its weights were broken when saved: a rise at this step is theirs
                self._snapshots[-1].own_step_target = True

    def _say_uneven_ranks(self, trainer: pl.Trainer) -> None:
        """Warn (once a fit, one reduction) when the ranks plan different numbers of optimizer steps: each step's
        gradients are reduced across the ranks, so the rank with more steps waits at the end for reductions the others
        never make. Without the suite the fit then fails as the first rank exits; with it, the checks' own reductions
        keep every rank waiting (a DDP run of 50 and 45 samples a rank, batch 16, `max_epochs` only: 44 and 33 steps,
        and it hung with no word)."""
        planned = float(trainer.estimated_stepping_batches)
        both = torch.tensor([planned, -planned], dtype=torch.float64, device=trainer.strategy.root_device)
        most, fewest = (float(v) for v in trainer.strategy.reduce(both, reduce_op="max"))
        fewest = -fewest
        if most != fewest:
            self.alert(
                trainer.global_step, "uneven_ranks", "warning",
                f"The ranks plan different numbers of optimizer steps ({fewest:g} to {most:g}): their training data "
                "give them different numbers of batches (a sampler of your own, `use_distributed_sampler=False`). "
                "Every step's gradients are reduced across the ranks, so the rank with more steps will wait for "
                "ranks that have finished: the fit hangs or fails at its end. Give every rank the same number of "
                "batches, or bound the run with `max_steps`.",
                value=most - fewest,
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.select_built_model(trainer, pl_module)
        self._fit_lag = None  # looked up again for this fit's strategy (see _lag)
        self._world_size = trainer.world_size
        self._evaluated = None
        # the batches kept for replays are micro-batches: under gradient accumulation the last `_REFERENCES + 3` steps
        # need that many times more (with 7 kept and 8 micro-batches a step, no step before the present one had one
        # left, so no surge could be asked about and bad data was taken for weights that diverged)
        self._ref_batches = None  # sized at the fit's first batch (see _size_references)
        self._resize_references(trainer, _REFERENCES)
        if self.idle_reason is not None:
            return
        n = len(trainer.optimizers)
        self._levels = self.loss_rules if self.loss_rules is not None else n <= 1
        self._losses_watched, self._one_loss_batches, self._one_loss_seen = False, 0, True
        self._shared_loss = False
        if n > 1:
            if self.optimizer_index >= n:
                raise ValueError(f"DivergenceGuard(optimizer_index={self.optimizer_index}): the run has {n} optimizers.")
            if self.loss_rules is None:
                # one loss shared out over parameter groups (Muon for the matrices and AdamW for the rest, SparseAdam
                # for a sparse embedding), or players with losses of their own (a GAN)? Read off the first batches
                # (see _read_losses); until then only non-finite values are judged
                self._losses_watched = True
            else:
                self._say_optimizers(trainer)

    def _resize_references(self, trainer: pl.Trainer, refs: int) -> None:
        """Keep ``refs`` normal batches as references (and 3 more batches, for the steps of a rise)."""
        accumulate = getattr(trainer, "accumulate_grad_batches", 1)
        keep = (refs + 3) * (accumulate if isinstance(accumulate, int) and accumulate > 1 else 1)
        if self._recent_batches.maxlen != keep:
            self._recent_batches = deque(self._recent_batches, maxlen=keep)
        if self._normal_recent.maxlen != refs:
            self._normal_recent = deque(self._normal_recent, maxlen=refs)
            self._informative_refs = deque(self._informative_refs, maxlen=refs)

    def _size_references(self, trainer: pl.Trainer, batch: Any) -> None:
        """At the fit's first batch: as many reference batches as hold ``_REFERENCE_SAMPLES`` samples, at least
        ``_REFERENCES`` (small batches only: a batch of 4 or more samples keeps 4, as ever)."""
        n = _samples(batch)
        refs = _REFERENCES if not n else max(_REFERENCES, -(-_REFERENCE_SAMPLES // n))
        if trainer.world_size > 1:
            # the same count on every rank (the most any rank's batch asks for): ranks of unequal batches kept unequal
            # counts, one went on to replay all of its references where the other did not, and both waited for ever
            most = torch.tensor(float(refs), device=trainer.strategy.root_device)
            refs = int(trainer.strategy.reduce(most, reduce_op="max"))
        self._ref_batches = refs
        self._resize_references(trainer, refs)

    def _say_optimizers(self, trainer: pl.Trainer) -> None:
        """With several optimizers: which loss is judged, and how (a warning; info where one loss was found)."""
        n = len(trainer.optimizers)
        if self._levels and self.loss_rules is None:
            self.alert(
                trainer.global_step, "one_loss", "info",
                f"{n} optimizers, each stepped after the batch's backward passes in the first {_ONE_LOSS_BATCHES} "
                "batches: one loss shared out over parameter groups (not players with losses of their own, such as a "
                "GAN's), so its level is judged as with one optimizer. Pass `loss_rules=False` to judge only "
                "non-finite values.",
            )
            return
        levels = (
            "its level is judged too (`loss_rules=True`)" if self._levels else
            "only for non-finite values: each player's loss is raised by the others (a GAN's generator loss "
            "climbs as its discriminator improves), so its level says nothing of divergence. Pass "
            "`loss_rules=True` to judge the level too")
        rank_zero_warn(
            f"DivergenceGuard: {n} optimizers; the loss judged is the one of optimizer {self.optimizer_index} "
            f"(`optimizer_index`), {levels}; the steps of the others are checked for non-finite gradients only."
        )

    def _read_losses(self, trainer: pl.Trainer) -> None:
        """At the end of a batch, while several optimizers are read (``loss_rules=None``): a batch that stepped every
        optimizer, with no backward pass after the first of those steps, minimised one loss; a batch that stepped some
        of them, or ran a backward between two steps (a GAN: the discriminator's loss, its step, the generator's loss,
        its step), did not. After ``_ONE_LOSS_BATCHES`` stepping batches the ranks agree: one loss from then on if all
        of them were such batches."""
        stepped, interleaved = self._batch_stepped, self._batch_interleaved
        self._batch_stepped, self._batch_interleaved = set(), False
        if not stepped:
            return  # no step in this batch (accumulating): nothing to read
        self._one_loss_seen = (self._one_loss_seen and not interleaved
                               and len(stepped) == len(trainer.optimizers))
        self._one_loss_batches += 1
        if self._one_loss_batches < _ONE_LOSS_BATCHES:
            return
        self._losses_watched = False
        self._levels = self._shared_loss = self.decide(trainer, self._one_loss_seen, all=True)
        self._say_optimizers(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        if self._hub is not None:
            self._hub.unsubscribe(self._on_alert)
        for snap in self._snapshots:
            snap.discard()
        self._snapshots = []
        self._batch = None
        self._recent_batches.clear()

    def _on_alert(self, alert: Alert) -> None:
        if alert.monitor == self.name:
            return
        if alert.severity == "critical":
            self._external.append(alert)
        elif alert.severity == "warning" and f"{alert.monitor}/{alert.kind}" in self.corroborate_with:
            self._external_warnings[(alert.monitor, alert.kind, alert.layer)] = alert
        elif alert.kind.endswith("_cleared"):
            self._external_warnings.pop((alert.monitor, alert.kind[: -len("_cleared")], alert.layer), None)

    # ------------------------------------------------------------------ every step, on device
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.idle_reason is not None:
            return
        # `training_step` may pop from it (`batch.pop("labels")`): the replays need it whole. A step found writing into
        # its batch's tensors: they are copied too (see _batch_written)
        batch = _kept(batch, self._copy_batches)
        self._batch_versions = None if self._copy_batches else _tensor_versions(batch, [])
        if self._ref_batches is None:
            self._size_references(trainer, batch)
        step = self._batch_start = trainer.global_step  # a property that walks the loops: read once a hook
        # and torch's random states at its start (about 2 us on CPU), so that a replay of its step draws the dropout
        # masks and samples the step drew: a step that samples (REINFORCE) was judged on a fresh draw, and a rare
        # draw's loss was taken for the weights'
        self._batch, self._batch_idx = batch, batch_idx
        self._step_batches += 1
        self._batch_rng = random_states_of([pl_module.device])
        entry = (step, batch, batch_idx, self._batch_rng)
        if self._recent_batches and self._recent_batches[-1][0] == step and not pl_module.automatic_optimization:
            # accumulation by hand (`opt.step()` every k-th batch): a step keeps its latest batch as its reference, so
            # that the batches kept span as many steps as without it (kept all, the k batches of the current step
            # filled them, and no surge was tested; sized by k, they held k times the memory, of which one a step is read)
            self._recent_batches[-1] = entry
        else:
            self._recent_batches.append(entry)
        self._apply_lr_ceiling(trainer)
        key = (trainer.current_epoch, batch_idx)
        if self.snapshot_every_n_steps is not None:
            self._seen.append((step, *key))
        hit = key in self._skip and self._drop is None
        if self._skip and trainer.world_size > 1:
            # every rank undoes the same steps (a batch's index may come at another step on another rank: epochs of
            # different lengths); one reduction a step, only while a list of batches to skip is given
            hit = self.decide(trainer, hit) and self._drop is None
        if hit:
            # a batch an earlier attempt rolled back over: its update is undone at the end of the step
            self._drop = TrainingSnapshot.capture(trainer, pl_module, {}, step, self._lr_scale)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self.idle_reason is not None:
            return
        if self._losses_watched and self._batch_stepped:
            self._batch_interleaved = True
        loss = loss.detach()
        if loss.dim():
            loss = loss.sum()  # a [1, 1] loss, or a vector passed with its own gradient
        if loss.dtype not in (torch.float32, torch.float64):
            loss = loss.float()  # a float64 loss stays float64: a finite one beyond float32's range is no inf
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            scale = grad_scaler_scale(scaler)  # no host sync
            if scale is not None:
                loss = loss / scale.to(loss.device)
        self._loss_acc = loss if self._loss_acc is None else self._loss_acc + loss

    @torch.no_grad()
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.idle_reason is not None:
            return
        if self._batch_versions:
            self._batch_written(trainer)
        if self._losses_watched:
            self._batch_stepped.add(id(optimizer))
        step = trainer.global_step
        loss, self._loss_acc = self._loss_acc, None
        batches, self._step_batches = self._step_batches, 0
        if loss is not None and batches > 1 and not pl_module.automatic_optimization:
            # a step accumulated by hand over several batches (`manual_backward` on each, `opt.step()` every k-th): the
            # losses given to `manual_backward` add up over its batches, while a replay evaluates one batch. Judged
            # per batch, as a replay gives it (Lightning's own accumulation divides each batch's loss by k before the
            # backward, so that the sum is the mean). Judged as the sum, a blow-up at lr x8 read every replay at an
            # eighth of the step's loss, took each surge for one hard batch and the rise for a transient: no action,
            # and the run ended at chance
            loss = loss / batches
        if self._evaluated == (step, id(optimizer)):
            # another evaluation of the step's closure (LBFGS's line search and inner iterations call it several times
            # a step, each followed by this hook): the step is judged once, on its first evaluation, the loss and
            # gradients at the weights it started from. Judged each, the trial points' losses entered the history
            # and a healthy minibatch LBFGS run was rolled back four times and stopped (3 of 3 seeds)
            return
        self._evaluated = (step, id(optimizer))
        self._rates_in_force(trainer, step)
        if backward_skipped(trainer):
            return  # a forward-only epoch (SWA's BatchNorm update): no loss reached a backward, no gradient to check
        if (len(trainer.optimizers) > 1 and not self._shared_loss
                and optimizer is not trainer.optimizers[min(self.optimizer_index, len(trainer.optimizers) - 1)]):
            # another optimizer's loss (a GAN's other network): its gradients are checked, not its loss. One loss shared
            # by the optimizers is judged at the batch's first step, whichever optimizer takes it
            loss = None
        no_loss = loss is None
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        lag = self._lag(trainer)
        on_host = lag == 0 and self._fit_cpu
        if on_host and trainer.world_size == 1:
            # nothing to wait for and nothing to reduce: the two numbers are read at once, no row is built. Only a
            # non-finite gradient norm is judged (and reported with its value): one fused finiteness check, and the
            # norm itself only when the check finds something (0.0 stands for a finite norm, never reported)
            gnorm = 0.0
            if nonfinite_on_host(grads, self._found) is not False:
                plain_sq, shard_sq = squared_norms(grads)
                gnorm = math.sqrt(sum(float(t) for t in (plain_sq, shard_sq) if t is not None))
            values_now = (math.nan if no_loss else float(loss), gnorm)
            entry: tuple[int, Any, Any, bool] = (step, values_now, None, no_loss)
        else:
            # fused kernels for the per-tensor norms; a sharded (FSDP2) gradient contributes its local shard
            plain_sq, shard_sq = squared_norms(grads)
            if self._flat_shards and plain_sq is not None:
                plain_sq, shard_sq = None, plain_sq if shard_sq is None else shard_sq + plain_sq
            row = self._row(trainer, pl_module, loss, plain_sq, shard_sq)
            if self.zero_nonfinite_grads and grads and not on_host:
                bad = torch.isfinite(row.sum()).logical_not_()  # on the device: no sync
                for g in grads:
                    local(g).masked_fill_(bad, 0.0)
            entry = self._copy_to_host(step, row, no_loss)
        if self._drop is None:  # a dropped batch is not judged
            self._ring.append(entry)
        values = self._read_ready(step, lag)
        critical, first_bad = self._judge_ready(trainer, pl_module, values)
        # judged on the ranks' mean series: the same on every rank (what a check appends below may be rank-local)
        judged_n, judged_first = len(critical), first_bad
        due = self.is_due(step)
        if due and self.corroborate and trainer.world_size > 1:
            found = self._corroborate(step)  # rank-local: reduced with the check's other findings
            if found:
                critical += found
                first_bad = step if first_bad is None else min(first_bad, step)
        if self.zero_nonfinite_grads and grads and on_host:
            # no device to wait for: this step's values are already judged; touch the gradients only when needed
            now = next(((loss, g) for s, loss, g in values if s == step), None)
            if now is not None and (not math.isfinite(now[1]) or (now[0] is not None and not math.isfinite(now[0]))):
                for g in grads:
                    local(g).zero_()
        if due and self._snapshot_due(step):
            if self._faithful_checks and not no_loss:
                self._check_replay(trainer, pl_module, loss)  # where the snapshot reads the host anyway
            module_state = pl_module.state_dict()  # read once: checked, then copied
            if not self._all_finite(module_state, self._infinite_by_design):
                self.alert(step, "nonfinite", "critical",
                           f"A parameter or buffer (e.g. BatchNorm running statistics) is non-finite at step {step}, "
                           "although the gradients were kept finite: a non-finite batch reached a buffer.")
                critical.append(f"non-finite parameter or buffer at step {step}")
                first_bad = step if first_bad is None else min(first_bad, step)
            # refused unless every step judged so far was normal and every parameter and buffer is finite
            self._snapshot(trainer, pl_module, step, not critical, module_state)
        if (judged_n and on_host and judged_first == step and self.action != "warn"
                and self.snapshot_every_n_steps is not None and _nonfinite_only(critical[:judged_n])):
            # (several processes on CPU too: every rank judged the same values at once, and every rank comes here;
            # with one on every fifth step of a loss non-finite whatever the weights, two ranks went back to the
            # snapshot of step 10 at each such step to step 145, and kept 14 steps of 150)
            self._snapshot_before_bad_batch(trainer, pl_module, step)
        if critical or due:
            self._verdict = (step, critical, first_bad)

    @staticmethod
    def _row(trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Optional[Tensor], plain_sq: Optional[Tensor],
             shard_sq: Optional[Tensor]) -> Tensor:
        """``[loss, gradient norm]`` of the step (NaN for no loss), reduced over the ranks; on the device. Only
        what is there is added: on one process with plain gradients, the row is two kernels."""
        device = pl_module.device
        wide = (loss is not None and loss.dtype == torch.float64) or (plain_sq is not None and plain_sq.dtype == torch.float64)
        dtype = torch.float64 if wide else torch.get_default_dtype()
        loss = (torch.full((), math.nan, dtype=dtype, device=device) if loss is None
                else loss.reshape(()).to(device=device, dtype=dtype))
        if trainer.world_size > 1:
            # one all-reduce of two numbers: every rank judges the same mean loss, so every per-step decision is
            # the same on all ranks; the shards' squared norms add up to the sharded gradients' total
            shard = torch.zeros((), dtype=dtype, device=device) if shard_sq is None else shard_sq
            part = trainer.strategy.reduce(torch.stack([loss / trainer.world_size, shard]), reduce_op="sum")
            loss, shard_sq = part[0], part[1]
        parts = [t for t in (plain_sq, shard_sq) if t is not None]
        total = torch.zeros((), dtype=dtype, device=device) if not parts else parts[0] if len(parts) == 1 else parts[0] + parts[1]
        return torch.stack([loss, total.sqrt()])

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Act here, after the optimizer step: every monitor of the step has been heard (whatever the order of
        the callbacks) and has read this step's gradients; the update just applied is undone by the restore."""
        if self._batch_versions:
            self._batch_written(trainer)
        if self._losses_watched:
            self._read_losses(trainer)
        # (several optimizers, one step each: their steps are not replayed anyway, see _replayable)
        now = trainer.global_step
        made = now - self._batch_start if self._batch_start is not None else 0
        if made > self._steps_per_batch and len(trainer.optimizers) == 1:
            if self._steps_per_batch == 1:  # the first batch seen to make several: said once
                self.alert(
                    now, "several_steps_per_batch", "info",
                    f"`training_step` made {made} optimizer steps on one batch (manual optimization): the loss of each "
                    "step is judged, but a kept batch can no longer be evaluated again as the step saw it, so loss "
                    "surges and rises are judged without asking older weights (a sustained rise still acts; a single "
                    "surge is taken for a hard batch).",
                )
            self._steps_per_batch = made
        if self._drop is not None and now > self._drop.step:
            self._drop.restore(trainer, pl_module, {})
            self._saved_verdict = None
            self._restep_epoch_schedulers(trainer, self._drop.epoch)
            self._drop = None
        # a scheduler that stepped after the update set its rate again: held under the ceiling at once, so that what
        # reads the rates before the next step (LearningRateMonitor, a checkpoint) sees the rate in force. A rollback
        # reads the rates as the step left them, before this hold (the rate that diverged, see _rollback)
        rates = self._float_lrs(trainer) if self._verdict is not None and self._lr_ceiling is not None else None
        self._apply_lr_ceiling(trainer)
        if self._verdict is None:
            return
        step, critical, first_bad = self._verdict
        self._verdict = None
        due = self.is_due(step)
        if due and self._external:
            # other monitors' critical alerts are rank-local: they join at the guard's checks, where the ranks agree
            if self.act_on_alerts:
                critical += [f"{a.monitor}/{a.kind} (step {a.step}): {a.message}" for a in self._external]
                first_bad = min([a.step for a in self._external] + ([first_bad] if first_bad is not None else []))
            self._external.clear()
        if self.action == "warn":
            return
        # between checks the decision is the same on every rank (judged on the ranks' mean series); at a check,
        # rank-local findings (other monitors, non-finite buffers) are reduced
        act = self.decide(trainer, bool(critical)) if due else bool(critical)
        if not act:
            return
        target = self._target_snapshot(trainer, step if first_bad is None else first_bad)
        if self._skip_judged_late(trainer, pl_module, step, critical, first_bad, target, due):
            return
        recent = self._episode(step)
        new_episode = False
        nonfinite_only = bool(recent and critical and all(r.startswith("non-finite") for r in critical))
        if due:  # at a check the reasons may be rank-local (a non-finite buffer): the ranks agree first
            nonfinite_only = self.decide(trainer, nonfinite_only, all=True)
        if nonfinite_only:
            # bad data again (a non-finite value), after the run was confirmed healthy since the last rollback, or with
            # the weights found intact now: a new episode, not a repeat (rare bad batches, a masked-LM batch whose
            # labels are all ignored, a CTC sample that cannot be aligned, must not ratchet the rate down and stop a
            # healthy run)
            new_episode = self._healed_since(recent[-1]["step"])
            if due:
                new_episode = self.decide(trainer, new_episode, all=True)
            new_episode = new_episode or self._weights_intact(trainer, pl_module, step)
        if new_episode:
            recent = []
        reasons = "; ".join(critical) if critical else "a critical alert on another rank"
        if self.action == "rollback" and target is not None and len(recent) < self.max_rollbacks:
            # a stretch of bad data (a non-finite loss or gradient) is cured by skipping it: the first rollback of
            # such an episode keeps the learning rate; weights that diverged on good data, or a second divergence,
            # mean the rate is too high: lr_factor, then lr_factor^2 ... (cumulative 0.5, 0.125, 0.016 at the default)
            diverged = any(r.startswith(("loss explosion", "loss climb")) for r in critical)
            # ... unless the anomaly began with a batch the weights were not to blame for (a corrupt batch that then
            # broke them): that is bad data too
            bad_batch = (self._hard_batch is not None and first_bad is not None
                         and first_bad - 1 <= self._hard_batch <= step)
            if due:  # first_bad may come from a rank-local alert at a check: the ranks agree on the rate's factor
                bad_batch = self.decide(trainer, bad_batch, all=True)
            self._rollback(trainer, pl_module, step, target, reasons, len(recent), diverged, bad_batch, rates)
            if new_episode:
                self.rollbacks[-1]["new_episode"] = True
        else:
            if self.action == "rollback":
                why = ("no snapshot predates the anomaly" if self._misfit is None else
                       f"the snapshots from before the anomaly no longer fit the run ({self._misfit})"
                       ) if target is None else (
                    f"{len(recent)} rollbacks within {self.rollback_window} steps (max_rollbacks={self.max_rollbacks})")
                reasons += f"; stopping instead of rolling back: {why}"
            self._stop(trainer, pl_module, step, target, reasons)

    def _skip_judged_late(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, critical: list[str],
                          first_bad: Optional[int], target: Optional[TrainingSnapshot], due: bool) -> bool:
        """A non-finite loss or gradient judged steps after its update (``lag_steps``, a GPU's default: its values
        reached the host later), its gradients zeroed on the device, a normal step right before it, and the weights
        intact now (:meth:`_weights_intact`): the bad step changed nothing a rollback would undo but the steps since,
        which were good. Said (``nonfinite_skipped``, info) and nothing else is done. Rolled back, every such step went
        back to the last snapshot (taken at most ``snapshot_every_n_steps`` earlier): with a loss non-finite every 5th
        step, the run kept a few steps of each ten (held-out 1.05 against 0.14 judged at once). On CPU the state just
        before such a step is kept instead, and the rollback undoes it alone (its scheduler step too)."""
        if (self.action != "rollback" or target is None or first_bad is None or target.step >= first_bad
                or self._lag(trainer) == 0):
            return False
        ok = _nonfinite_only(critical) and self._normal_at(first_bad - 1) and self.zero_nonfinite_grads
        if due:  # at a check the reasons may be rank-local: the ranks agree first
            ok = self.decide(trainer, ok, all=True)
        if not ok or not self._weights_intact(trainer, pl_module, step):
            return False
        self._clear_conditions(step, "The non-finite step was skipped.")
        self.alert(
            step, "nonfinite_skipped", "info",
            f"The non-finite value of step {first_bad} ({'; '.join(critical)}) was judged at step {step}, after the steps "
            f"since had trained on: its gradients were zeroed, so its update changed nothing, and the weights are intact "
            f"(the last normal batches lose what they lost). No rollback: the last snapshot (step {target.step}) would "
            "undo the good steps since as well.",
        )
        return True

    # ------------------------------------------------------------------ every step, on host (lagged)
    def _copy_to_host(self, step: int, row: Tensor, no_loss: bool) -> tuple[int, Tensor, Any, bool]:
        """Start the copy of a step's ``[loss, grad norm]`` to the host; on a CUDA device the copy is asynchronous
        (pinned memory) and an event marks its completion; from another accelerator it has finished on return."""
        if row.device.type == "cpu":
            return step, row, None, no_loss
        if row.device.type != "cuda":
            # another accelerator (MPS, XPU ...): a copy that has finished on return. A copy to the host that does not
            # wait has no event here to mark its end, and on MPS it may still be under way when its values are read
            return step, row.to("cpu"), None, no_loss
        host = row.to("cpu", non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return step, host, event, no_loss

    def _lag(self, trainer: pl.Trainer) -> int:
        # the strategy's device is looked up once per fit (the lookup costs as much as reading the step's values)
        lag = self.__dict__.get("_fit_lag")
        if lag is None:
            self._fit_cpu = trainer.strategy.root_device.type == "cpu"
            lag = self._fit_lag = 0 if self._fit_cpu else 2
        return lag if self.lag_steps is None else self.lag_steps

    def _read_ready(self, step: int, lag: int) -> list[tuple[int, Optional[float], float]]:
        """The host values of the steps at least ``lag`` steps old (after those restored from a checkpoint). Their
        copies were started ``lag`` steps ago, so waiting for them does not stall the device queue (the host stays
        up to ``lag`` steps ahead)."""
        ready = []
        while self._ring and self._ring[0][0] <= step - lag:
            ready.append(self._ring.popleft())
        values, self._restored = self._restored + self._values_to_host(ready), []
        return values

    @staticmethod
    def _values_to_host(entries: Any) -> list[tuple[int, Optional[float], float]]:
        """``(step, loss or None, grad norm)`` of ring entries as floats, each copy waited for."""
        out = []
        for s, host, event, no_loss in entries:
            if event is not None:
                event.synchronize()
            loss, gnorm = host if isinstance(host, tuple) else host.tolist()
            out.append((s, None if no_loss else loss, gnorm))
        return out

    def _judge_ready(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     values: list[tuple[int, Optional[float], float]]) -> tuple[list[str], Optional[int]]:
        """Judge the steps whose values have reached the host (:meth:`_read_ready`); returns the critical reasons
        and the first anomalous step."""
        if not values:
            return [], None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scaler_on = scaler is not None and scaler.is_enabled()
        if not self._loss_seen:
            if any(loss is not None for _, loss, _ in values):
                self._loss_seen = True
            else:
                self._lossless += len(values)
        # said once no loss came in the first _LOSSLESS_STEPS judged steps: a step without one now and then is a batch
        # skipped on purpose (`training_step` returned None), whose advice to return the loss would be wrong
        if not self._loss_seen and self._lossless >= _LOSSLESS_STEPS and not self._warned_no_loss:
            self._warned_no_loss = True
            rank_zero_warn(
                "DivergenceGuard saw no training loss: `training_step` returned None (or no 'loss' key), so only "
                "gradients are checked. Return the loss tensor, or a dict with a 'loss' key, from `training_step`."
            )
        critical: list[str] = []
        first_bad: Optional[int] = None
        explosion: Optional[tuple[int, int]] = None
        for s, loss, gnorm in values:
            best = self._ema_min
            # a loss of exactly 0 (a batch with no labelled item, a hinge loss with every margin met) is no level of the
            # run's: kept out of the history, whose median it held at 0 where most batches had none (every labelled
            # batch then read as a surge, and a real blow-up as one hard batch after another). Its batch stays a
            # reference for the replays (weights that broke lose on it again, if it can lose at all)
            reasons, start, surge = self._judge(s, None if loss == 0.0 else loss, gnorm, scaler_on)
            if loss != 0.0:
                self._judged_lrs.append(next((lrs for t, lrs in reversed(self._lr_trace) if t == s), None))
            if self._ema_min < best:
                # the learning rates that trained the weights of the best smoothed loss so far: the moving average
                # describes the losses of about smoothing / (1 - smoothing) judged steps back (its mean age; steps of
                # loss 0 do not move it)
                oldest = self._judged_lrs[0] if self._judged_lrs else None
                self._lr_at_min = oldest if oldest is not None else self._lr_at_min
                self._wd_at_min = self._float_decays(trainer)
                self._types_at_min = [type(opt).__name__ for opt in trainer.optimizers]
            self._judged_through = s
            if math.isfinite(gnorm):
                self._finite_grad_step = s
            if reasons and first_bad is None:
                first_bad = start
            critical += reasons
            if loss is not None and math.isfinite(loss) and start is None:
                self._normal_in_fit += 1
                self._normal_recent.append((s, loss))
                self._note_lr(s)
                if loss != 0.0:
                    self._informative.append(s)
                    kept = self._kept_batch(s)
                    if kept is not None:
                        self._informative_refs.append((s, kept, loss))
                else:
                    self._zero_losses = True
            if start is None or reasons or explosion is not None:
                continue
            run = self._loss_watch.run
            climbing = start == self._creep_start and not run
            sustained = run >= (self.patience if self._loss_watch.ready else max(self.patience, _EARLY_PATIENCE))
            if (sustained or climbing or (surge and run < self.patience)) and self._lr_restart(s, start, loss):
                continue
            if sustained or climbing:
                explosion = (s, start, loss)
            elif surge and run < self.patience:
                found = self._surge_test(trainer, pl_module, s, loss)
                if found:
                    critical += found
                    first_bad = s if first_bad is None else min(first_bad, s)
                elif self._loss_watch.ready:
                    # one hard batch (with a history: before it, a surge that is not acted on at once may still
                    # be a blow-up building up, judged when it persists)
                    self._hard_batch = s
        if explosion is not None:
            reasons = self._decide_explosion(trainer, pl_module, *explosion)
            if reasons:
                critical += reasons
                first_bad = explosion[1] if first_bad is None else min(first_bad, explosion[1])
        return critical, first_bad

    def _judge(self, step: int, loss: Optional[float], gnorm: float,
               scaler_on: bool) -> tuple[list[str], Optional[int], bool]:
        """Update the detectors with one step; returns (critical reasons, first step of a loss anomaly, surge): a
        *surge* is a loss at least ``blowup`` times its recent level and beyond its noise, judged at once."""
        bad_loss = loss is not None and not math.isfinite(loss)
        bad_grad = not math.isfinite(gnorm) and not scaler_on  # a scaler skips overflowing steps itself
        # the common step (all finite, no condition active) skips the condition and its message: a no-op there
        if bad_loss or bad_grad or ("nonfinite", None) in self._conditions:
            reason = self._nonfinite(step, bad_loss, bad_grad, loss, gnorm)
            if reason is not None:
                return [reason], step, False
        start, surge = None, False
        if loss is not None and math.isfinite(loss) and self._levels and not self._signed_loss(step, loss):
            if len(self._initial) < 3:
                self._initial.append(loss)
            elif self._reanchor is not None:
                floor, seen = self._reanchor
                seen.append(loss)
                if len(seen) >= _REANCHOR_STEPS:
                    self._initial = [max(floor, min(self._anchor(), median(seen)))] * 3
                    self._reanchor = None
            anchor = self._anchor()
            # the floor and the ceiling keep the initial loss's scale, also far above the level the run reached (a
            # fine-tune that started at 17): at 10x the lowest smoothed loss, a memorised training set's ordinary
            # wobble read as surges, and a curriculum's new data after it as weights that diverged (healthy runs rolled
            # back, rate halved; tests/test_guard_high_start.py)
            ready = self._loss_watch.ready
            level = self._loss_watch.level() if ready else anchor
            # the ceiling: `blowup` times the initial level, or the recent level where the run settled above it (a loss
            # that rose early and stayed, noisy batches: normal batches crossed twice the initial level three times
            # in a row, and a healthy run was rolled back with its rate halved)
            anomalous, z = self._loss_watch.update(
                step, loss, abs_floor=self.initial_floor * anchor, ceiling=self.blowup * max(anchor, level))
            start = self._loss_watch.start if anomalous else None
            surge = anomalous and ready and z > self.z_threshold and loss > (1.0 + self.surge) * level
            # before any history: a loss above ``blowup`` times the initial loss is tested on the first batches at
            # once (an update that broke the weights shows on them too); one that does not is left to persist
            surge = surge or (anomalous and not ready and loss > self.blowup * anchor)
            if not anomalous and self._loss_watch.run == 0 and ("loss_explosion", None) in self._conditions:
                self.condition(step, "loss_explosion", False, "critical", "",
                               clear_message="The loss is back within its recent history.")
            if self._creep(step, loss, anchor):
                start = self._creep_start
        # on several ranks the other monitors' warnings are rank-local: agreement is judged at the checks, where the
        # ranks reduce their findings (see on_before_optimizer_step); judged here, one rank acted alone and hung
        local = self.corroborate and self._world_size == 1
        return (self._corroborate(step) if local else []), start, surge

    def _signed_loss(self, step: int, loss: float) -> bool:
        """Whether the loss has gone below 0 in this run (from this step on, for good). The loss rules compare the
        loss with multiples of its levels (twice the recent level, 1.5 times the smoothed minimum, a fraction of
        the initial loss), which assumes a loss bounded below by 0 (cross-entropy, squared error). A loss that
        goes negative (the negative log-likelihood of a continuous density, an ELBO ...) has no such zero, and on
        healthy Gaussian-likelihood runs those rules rolled back. From the first negative loss the guard acts
        only on non-finite losses and gradients, says so once (``signed_loss``) and clears its loss
        conditions."""
        if self._signed:
            return True
        # rounding can leave a loss bounded below by 0 a hair under it (a KL divergence at its minimum): not signed
        if loss >= -1e-6 * max(1.0, abs(self._initial[0]) if self._initial else 1.0):
            return False
        self._signed = True
        self._loss_watch.run, self._loss_watch.start = 0, None
        self._creep_start, self._climb_judged, self._hard_batch = None, False, None
        for kind in ("loss_creep", "loss_explosion"):
            if (kind, None) in self._conditions:
                self.condition(step, kind, False, "warning", "", clear_message="The loss went below 0: not judged.")
        self.alert(
            step, "signed_loss", "warning",
            f"The training loss went below 0 at step {step} ({loss:.4g}). The guard's loss rules compare the loss "
            "with multiples of its levels, which assumes a loss bounded below by 0; from here on it acts only on "
            "non-finite losses and gradients (rolling back over them as before) and no longer judges the loss's "
            "level (no loss_creep / loss_explosion). Add a constant to the loss that keeps it above 0 to keep those "
            "rules.",
            value=loss, threshold=0.0,
        )
        return True

    def _nonfinite(self, step: int, bad_loss: bool, bad_grad: bool, loss: Optional[float], gnorm: float) -> Optional[str]:
        """Update the ``nonfinite`` condition; the critical reason when it is raised (not when it persists)."""
        what = " and ".join(n for n, b in (("loss", bad_loss), ("gradient norm", bad_grad)) if b)
        value = loss if bad_loss else gnorm
        raised = self.condition(
            step, "nonfinite", bool(what), "critical",
            f"Non-finite {what} ({value}) at step {step}; the step's gradients were "
            f"{'zeroed' if self.zero_nonfinite_grads else 'left as they are'}. Lower the learning rate, "
            "clip gradients, or check the batch and the precision settings.",
            value=value, clear_message="Loss and gradient norm are finite again.",
        )
        return f"non-finite {what} at step {step}" if _is_critical(raised) else None

    def _anchor(self) -> float:
        """The initial loss level: the first finite loss, or the median of the first three if lower (one blown-up
        value among them does not move it; a run that blows up from its first update keeps its true start), at
        least a tiny positive number."""
        return max(min(self._initial[0], median(self._initial)), 1e-8) if self._initial else 1.0

    def _creep(self, step: int, loss: float, anchor: float) -> bool:
        """Update the loss EMA and the ``loss_creep`` condition; True when the creep turns into a climb that
        must be judged like an explosion: the smoothed loss 1.5 times its minimum and risen by a
        quarter of the initial loss (once per episode)."""
        if self.creep is None:
            return False
        if self._loss_watch.run:
            # a sudden jump is the explosion rule's to judge; creep is the slow road. The jump stays out of the moving
            # average too: one hard batch (1000x the level) would hold it up for hundreds of steps, and a climb of
            # the weights after it would go unseen
            return False
        self._ema = self.smoothing * self._ema + (1.0 - self.smoothing) * loss
        self._ema_weight = self.smoothing * self._ema_weight + (1.0 - self.smoothing)
        if len(self._loss_watch.history) < self.min_history:
            return False
        ema = self._ema / self._ema_weight
        self._ema_min = min(self._ema_min, ema)
        # the rise must also exceed what batch-to-batch noise moves a moving average by (4 of its std)
        noise = 6.0 * self._loss_watch.noise() * math.sqrt((1.0 - self.smoothing) / (1.0 + self.smoothing))
        limit = self._ema_min + max(self.creep * self._ema_min, self.initial_floor * anchor, noise)
        # snapshots wait while the smoothed loss is in the upper half of its way to a limit of their own (see _snapshot):
        # the creep's, less its floor on the initial loss's scale. A run far below its first loss (a regression
        # converged 200 times lower) has a creep limit of many times its lowest loss, and under it snapshots of weights
        # already climbing were kept: a rate ramp rolled back to weights 5x worse on held-out data than the last good
        # ones (4 of 4 seeds; the control's at that step 0.006, the restored 0.032)
        gate = self._ema_min + max(self.creep * self._ema_min, noise)
        self._creep_high = ema > 0.5 * (self._ema_min + gate)
        warned = ("loss_creep", None) in self._conditions
        if warned or self._creep_start is not None:
            # hysteresis: an episode (warned or not: a repeat is not said again) ends only halfway back, so a dip
            # below the limit neither dates the rise anew nor lets snapshots of the risen weights in
            active = ema > 0.5 * (self._ema_min + limit)
        else:
            # the recent median must have risen too (at least halfway): a few heavy-tailed batch losses (tiny
            # batches) move the average without the typical loss rising
            active = ema > limit and self._loss_watch.level() > 0.5 * (self._ema_min + limit)
        # one warning per lowest value: a loss that wobbles around the limit without a new low is not news again
        repeat = active and not warned and self._ema_min >= self._creep_warned_at
        if not repeat and (active or warned):  # else a no-op: skipped
            raised = self.condition(
                step, "loss_creep", active, "warning",
                f"At step {step} the smoothed loss ({ema:.4g}) has risen {100 * (ema / self._ema_min - 1):.0f}% above "
                f"its lowest value so far ({self._ema_min:.4g}): training may be starting to diverge.",
                value=ema, threshold=limit, clear_message="The smoothed loss is back near its lowest value.",
            )
            if raised is not None and raised.kind == "loss_creep":
                self._creep_warned_at = self._ema_min
        if not active:
            self._creep_start, self._climb_judged, self._plateau = None, False, None
            return False
        self._creep_start = step if self._creep_start is None else self._creep_start
        # a rise that has stopped: the smoothed loss no higher than _PLATEAU_STEPS steps ago (by _PLATEAU_RISE) is a
        # level the run settled at (a KL weight annealed to 1, an objective ramped by design), not a slow divergence:
        # the new minimum, the warning cleared. Held above the halfway mark it refused every snapshot for the rest of
        # the run (a rollback then lost 200 healthy steps)
        if self._plateau is None or step - self._plateau[0] >= _PLATEAU_STEPS:
            if self._plateau is not None and ema <= (1.0 + _PLATEAU_RISE) * self._plateau[1]:
                self._plateau = None
                self._ema_min, self._creep_start, self._climb_judged, self._creep_high = ema, None, False, False
                self.condition(step, "loss_creep", False, "warning", "",
                               clear_message=f"The smoothed loss has settled at a new level ({ema:.4g}): the new "
                                             "normal from here.")
                return False
            self._plateau = (step, ema)
        climb = (ema >= _CLIMB * self._ema_min and ema - self._ema_min >= 0.25 * anchor
                 and self._loss_watch.level() >= 0.5 * (self._ema_min + ema))
        # soon after a rollback, a creep is judged at once: the rollback found the weights diverging, and a run that
        # creeps up again from the restored state is still training too hot (after a warm-up to a rate far too high,
        # the rate of the best loss can be too high too, and the run wandered above its best for the rest of it)
        # Not after a rollback over bad data (a non-finite batch, a corrupt one: the rate was kept): that found the data
        # at fault, not the rate, and a creep after it is judged as any other (an objective rising by design after a
        # NaN batch was rolled back was taken for "the rate still too high")
        last = self.rollbacks[-1] if self.rollbacks else None
        after = (not climb and last is not None and last.get("diverged", True)
                 and step - last["step"] <= _AFTER_ROLLBACK)
        climb = climb or after
        if climb and not self._climb_judged:
            self._climb_after_rollback = after
            self._climb_judged = True
            return True
        return False

    def _note_lr(self, step: int) -> None:
        """Note the learning rates that a normal step's loss vouches for: each group's highest rate so far, and its
        lowest since. A step's loss is computed before its own update, so it vouches for the rates of the update
        before it (the latest traced step before ``step``): noted at their own step, a rate raised 50 times right
        before a normal loss counted as one the run had trained at, and after a stop, resumed lower and raised back
        to it, the divergence it caused again was taken for a warm restart (a warning, no action)."""
        lrs = next((lrs for t, lrs in reversed(self._lr_trace) if t < step), None)
        if lrs is None or lrs == self._lr_noted:
            return  # the common step at a constant rate
        self._lr_noted = lrs
        if self._lr_peak is None or [len(r) for r in self._lr_peak] != [len(r) for r in lrs]:
            self._lr_peak, self._lr_low = [list(r) for r in lrs], [list(r) for r in lrs]
            return
        for peaks, lows, row in zip(self._lr_peak, self._lr_low, lrs):
            for j, lr in enumerate(row):
                if lr is None:
                    continue
                if peaks[j] is None or lr > peaks[j]:
                    peaks[j] = lows[j] = lr
                elif lows[j] is None or lr < lows[j]:
                    lows[j] = lr

    def _lr_restart(self, step: int, start: int, loss: Optional[float]) -> bool:
        """Whether a loss anomaly since ``start`` is a warm restart's transient: the learning rates in force are all
        at or below the highest rates the run trained at with a normal loss, and one has come back up from its low
        since by ``_RESTART`` times or more. Then the ``lr_restart`` warning is raised, the new level becomes the
        normal, and nothing acts; the lows restart from the present rates, so the same rise is excused once. Not
        after a rollback capped the rates, nor for a loss above ``blowup`` times the initial loss."""
        if self._lr_peak is None or self._lr_low is None or self._lr_ceiling is not None or not self._lr_trace:
            return False
        if loss is None or not math.isfinite(loss) or loss > self.blowup * self._anchor():
            return False
        lrs = self._lr_trace[-1][1]
        rows = [(lr, grid_at(self._lr_peak, i, j), grid_at(self._lr_low, i, j))
                for i, row in enumerate(lrs) for j, lr in enumerate(row) if lr is not None]
        if not rows or any(peak is None or lr > 1.001 * peak for lr, peak, _ in rows):
            return False
        rise = max((lr / low for lr, _, low in rows if low is not None and low > 0.0), default=0.0)
        if rise < _RESTART:
            return False
        level = self._loss_watch.level() if self._loss_watch.history else self._anchor()
        self.alert(
            step, "lr_restart", "warning",
            f"The loss rose to {loss:.4g} at step {step} (recent level about {level:.4g}, since step {start}) after the "
            f"learning rate came back up {rise:.3g}x from its low, to a level the run already trained at: the "
            "transient of a warm restart, not judged as a divergence. No action taken; the new level is the normal "
            "from here, and a further rise is judged as usual.",
            value=loss, threshold=level,
        )
        self._new_normal([loss])
        self._lr_low = [[(lr if lr is not None else low) for lr, low in zip(row, lows)]
                        for row, lows in zip(lrs, self._lr_low)]
        return True

    def _corroborate(self, step: int) -> list[str]:
        if not self._external_warnings and ("corroborated", None) not in self._conditions:
            return []  # nothing to agree with and nothing to clear: the common step skips the no-op update
        own = sorted(kind for (kind, _), sev in self.active_conditions().items() if sev == "warning" and kind != "data_shift")
        others = sorted(f"{m}/{k}" + (f"[{layer}]" if layer else "") for m, k, layer in self._external_warnings)
        raised = self.condition(
            step, "corroborated", bool(own) and bool(others), "critical",
            f"Independent signals agree at step {step}: {', '.join(own)} (guard) and {', '.join(others)}.",
            clear_message="The guard's warnings and the other monitors' warnings no longer coincide.",
        )
        return [f"{', '.join(own)} corroborated by {', '.join(others)} at step {step}"] if _is_critical(raised) else []

    # ------------------------------------------------------------------ is it the weights or the data?
    def _decide_explosion(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, start: int,
                          loss: Optional[float] = None) -> list[str]:
        """A sustained loss anomaly (or a climb) since ``start``: critical if the weights explain it, else a data
        shift."""
        climb = start == self._creep_start and not self._loss_watch.run
        # a climb has dragged the recent level up with it: judge it against the smoothed loss's minimum
        if climb:
            level = self._ema_min
        else:
            level = self._loss_watch.level() if self._loss_watch.history else self._anchor()
        if (self.attribute and loss is not None and start == self._resume_step
                and not any(snap.step < start for snap in self._snapshots)):
            # the first step of a fit that goes on from a checkpoint (or from the previous fit in the same Trainer):
            # no snapshot predates it to ask. The checkpoint says whether its weights were sound when it was saved
            # (its last update came after the last loss judged): broken then, the rise is theirs
            if self._saved_broken(loss, level):
                return self._saved_broken_reason(step, loss, level)
            v = self._saved_weights if self._saved_weights and self._saved_weights.get("step") == start else None
            why = (f"when it was saved, its weights still lost {float(v['now']):.4g} on the last normal batches before "
                   f"it ({float(v['then']):.4g} when trained on): the data or the loss function changed across the "
                   "resume, not the weights" if v is not None else
                   "no snapshot predates it, and the checkpoint does not say whether its weights were sound (a checkpoint "
                   "from an older version, or a second fit of the same Trainer): taken for new data or a new loss "
                   "function; if the weights broke in the update saved last, resume from an earlier checkpoint")
            self.condition(
                step, "data_shift", True, "warning",
                f"The loss rose from about {level:.4g} to {loss:.4g} since step {start}, the first step after resuming "
                f"(from a checkpoint, or a new fit of the same Trainer); {why}. No action taken; the new level is the "
                "normal from here.",
                value=loss, threshold=level, clear_message="The loss has settled at its new level.",
            )
            self._new_normal([loss])
            return []
        if loss is not None and (self._pruned(trainer, pl_module, start, loss, level)
                                 or self._unfrozen(pl_module, start, loss, level)
                                 or self._restructured(trainer, pl_module, start, loss, level)):
            return []
        verdict = self._attribute(trainer, pl_module, start, level, climb) if self.attribute else None
        found = None if verdict is None else verdict[0]
        if found == "transient":
            return []
        if found == "forgotten":
            _, now, before = verdict
            self.condition(
                step, "data_shift", True, "warning",
                f"The loss rose from about {level:.4g} to {now:.4g} since step {start}, but the newest snapshot from "
                f"before the rise finds the current batch about as hard ({before:.4g}) and the last normal batches are "
                "still as easy as when they were trained on: only older weights handled this stretch of data better "
                "(data ordered by difficulty, a task learned earlier), the weights did not break. No action taken.",
                value=now, threshold=before, clear_message="The loss has settled at its new level.",
            )
            self._new_normal([now, before])
            return []
        if found == "data":
            if self._loss_watch.run < self.patience and not climb:
                return []  # one hard batch (a surge the last good weights find as hard): nothing to say
            _, now, before = verdict
            self.condition(
                step, "data_shift", True, "warning",
                f"The loss rose from about {level:.4g} to {now:.4g} since step {start}, but every kept snapshot from "
                f"before the rise finds the current batch about as hard (at best {before:.4g}): the data changed, not "
                "the weights (data that shifted, or a stretch of hard batches: on a loss with heavy tails, such as a "
                "focal or class-weighted loss at a small batch size, a few hard batches in a row look the same). No "
                "action taken.",
                value=now, threshold=before, clear_message="The loss has settled at its new level.",
            )
            self._new_normal([now, before])
            return []
        decay = self._decay_rose(trainer) if found == "weights" else None
        if decay is not None:
            _, now, before = verdict
            self.condition(
                step, "decay_change", True, "warning",
                f"The loss rose from about {level:.4g} to {now:.4g} since step {start} while the weight decay rose "
                f"({decay}) since the lowest smoothed loss and no learning rate did: the decay's effect (it trades the "
                f"training loss for smaller weights: older, larger weights find the batch easier, at {before:.4g}), "
                "not a divergence. No action taken; the new level is the normal from here.",
                value=now, threshold=level, clear_message="The loss has settled at its new level.",
            )
            self._new_normal([now], objective=True)
            return []
        how = "" if verdict is None else (
            f" Earlier good weights find the current batch easy ({verdict[2]:.4g} against {verdict[1]:.4g} now): "
            "the weights diverged.")
        what = (f"The loss has stayed above its recent history (about {level:.4g}) since step {start} "
                f"({step - start + 1} steps).")
        if climb and self._climb_after_rollback and self.rollbacks:
            what = (f"The smoothed loss has crept up again (past its limit at step {start}; about {level:.4g} "
                    f"before), {start - self.rollbacks[-1]['step']} steps after the rollback at step "
                    f"{self.rollbacks[-1]['step']}: the learning rate is still too high.")
        # critical: raised now, or active already (there is no higher severity)
        self.condition(
            step, "loss_explosion", True, "critical",
            f"{what}{how} The run is diverging: lower the learning rate.",
            value=verdict[1] if verdict else None,
        )
        return [f"loss explosion since step {start}"]

    def _surge_test(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, loss: float) -> list[str]:
        """A loss surge at ``step`` (``blowup`` times its recent level, beyond its noise): critical at once if the
        weights are broken, i.e. the last normal batches, evaluated again now, have lost at least half as much as
        the surging one; otherwise it is one hard batch and nothing is said (it is judged again if it persists)."""
        if step == self._resume_step:
            level = self._loss_watch.level() if self._loss_watch.history else loss
            if self._saved_broken(loss, level):
                return self._saved_broken_reason(step, loss, level)
        if not self._replayable(pl_module):
            return []
        refs = self._references(step)
        if not refs:
            return []
        # the last `_REFERENCES` first; found broken on small batches, asked again on all that are kept
        level = median([then for _, then in refs[-_REFERENCES:]])
        now, then = self._replayed(trainer, pl_module, refs[-_REFERENCES:])
        if now is not None and math.isfinite(now) and now - then >= 0.5 * (loss - level) and len(refs) > _REFERENCES:
            level = median([then for _, then in refs])
            now, then = self._replayed(trainer, pl_module, refs)
        if now is None or (math.isfinite(now) and now - then < 0.5 * (loss - level)):
            # the last batches still lose what they lost: one hard batch, unless the surge goes beyond the untrained
            # model's loss and weights from just before it find this very batch easy (damage the last batches do not hold)
            return self._surge_batch_test(trainer, pl_module, step, loss, level)
        if not self._loss_watch.ready and math.isfinite(now) and now < self.blowup * then:
            # before any history the references are the first batches, and the first updates of a healthy run can
            # overshoot and settle: at once only if the weights broke by ``blowup`` on those batches too
            return []
        if (self._pruned(trainer, pl_module, step, loss, level) or self._unfrozen(pl_module, step, loss, level)
                or self._restructured(trainer, pl_module, step, loss, level, (now, then))):
            return []
        if math.isfinite(now) and self._objective_changed(trainer, pl_module, step, loss, level, [b for b, _ in refs],
                                                          then, now):
            return []
        self.condition(  # critical: raised now, or active already
            step, "loss_explosion", True, "critical",
            f"The loss surged to {loss:.4g} at step {step} (recent level about {level:.4g}), and the last {len(refs)} "
            f"normal batches, evaluated again, went from {then:.4g} to {now:.4g}: the weights diverged. The run is "
            "diverging: lower the learning rate.",
            value=loss, threshold=level,
        )
        return [f"loss explosion (surge) at step {step}"]

    def _surge_batch_test(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, loss: float,
                          level: float) -> list[str]:
        """A surge beyond ``blowup`` times the run's first losses (the untrained model's) whose reference batches,
        evaluated again, still lose what they lost: the surging batch itself is evaluated under the newest snapshot from
        before it (weights of at most two snapshot intervals earlier, vouched for by normal losses, from before the last
        hard batch where there is one). Weights that find it easy (less than half of the surge) while the present ones
        still lose more than the untrained model did are broken on a part of the data the last batches do not hold: one
        task's head in a model that trains its tasks by turns (at a rate x300 on that head, batches of 250 against a
        level of 0.6 were read as hard ones, 16 surges in a row, and the head ended dead). A batch hard by itself is as
        hard for the weights of a few steps back.

        Not below that bound: a healthy update can leave the weights worse on the next batch for a while, and weights
        of a few steps back then find it easier too (the first steps on new data after a memorised set, 0.93 against
        0.27; data read in time order, where older weights were trained on a stretch more like the batch), and the run
        recovers: a surge there stays one hard batch unless the last batches show the damage too. Only with a loss
        history, faithful replays (:meth:`_check_replay`) and batches of at least ``_REFERENCE_SAMPLES`` samples (on
        fewer, one batch is no evidence); every rank asks the same snapshot and judges the ranks' mean losses."""
        bound = self.blowup * self._anchor()
        if not self._loss_watch.ready or self._unfaithful or loss <= bound:
            return []
        # recent weights (weights that drifted for longer find many batches easier), from before the last hard batch
        # where one is kept: a surge read as one hard batch applied its gradient, and a snapshot taken since may hold
        # what it broke (a head blown up at its first surge, asked at its second)
        every = self.snapshot_every_n_steps
        vouched = self._vouched(step)
        snap = next((s for s in self._hard_batch_first([s for s in reversed(self._snapshots) if s.step <= vouched])
                     if every is not None and step - s.step <= 2 * every), None)
        kept = self._kept_batch(step)
        held = None if kept is None else _samples(kept[0])
        ok = snap is not None and snap.mismatch(trainer) is None and held is not None and held >= _REFERENCE_SAMPLES
        if not (self.decide(trainer, ok, all=True) if trainer.world_size > 1 else ok):
            return []
        assert snap is not None and kept is not None
        now = self._mean_loss(trainer, pl_module, [kept])
        if now is None or not math.isfinite(now) or now <= bound:
            return []  # not what the step saw (a replay that differs), or no longer as bad: nothing to ask
        # the surge must not be a draw of the step's own random numbers: where the step samples from the model (a
        # REINFORCE bandit's actions, whose rare jackpots make its surges), other weights draw other actions from the
        # same numbers, and "the older weights find it easy" was another draw (healthy bandits rolled back, the rate cut
        # to 1/8). The present weights are asked again under fresh random numbers: a surge that does not come back in
        # each of _FRESH_DRAWS draws is the draw's, no evidence (a step that draws nothing gives the same loss)
        for draw in range(_FRESH_DRAWS):
            with fork_rng_of([pl_module.device]):
                seed_streams_of(pl_module.device, 1_000_003 * step + draw)
                again = self._mean_loss(trainer, pl_module, [(kept[0], kept[1], None)])
            if again is None or not math.isfinite(again) or again - level < 0.5 * (now - level):
                return []
            if again == now:
                break  # the same loss under other random numbers: the step draws nothing that matters
        before = self._under_snapshots(pl_module, [snap], lambda: self._mean_loss(trainer, pl_module, [kept]))[0]
        if before is None or not math.isfinite(before) or before - level >= 0.5 * (now - level):
            return []
        if self._pruned(trainer, pl_module, step, loss, level) or self._unfrozen(pl_module, step, loss, level):
            return []
        self.condition(  # critical: raised now, or active already
            step, "loss_explosion", True, "critical",
            f"The loss surged to {loss:.4g} at step {step} (recent level about {level:.4g}), beyond {self.blowup:g} times "
            f"the run's first losses ({self._anchor():.4g}); the weights of step {snap.step}, from before the surge, find "
            f"this batch easy ({before:.4g} against {now:.4g} now), while the last normal batches, evaluated again, still "
            "lose what they lost: the weights diverged on data the last batches do not hold. The run is diverging: lower "
            "the learning rate.",
            value=loss, threshold=level,
        )
        return [f"loss explosion (surge) at step {step}"]

    def _kept_batch(self, step: int) -> Optional[tuple[Any, int, Any]]:
        """``(batch, batch_idx, random states)`` of ``step``, where that batch is still kept."""
        return next(((b, i, r) for t, b, i, r in reversed(self._recent_batches) if t == step), None)

    def _references(self, before: int) -> list[tuple[tuple[Any, int, Any], float]]:
        """The last normal batches kept, from before step ``before``: ``((batch, batch_idx, random states), loss
        then)``."""
        batches = {s: (b, i, r) for s, b, i, r in self._recent_batches}
        since = self._refs_from  # none from before a change of what the step computes (see _new_normal)
        refs = [(batches[s], then) for s, then in self._normal_recent if s in batches and since <= s < before]
        # those that lost something, if any: a batch of loss 0 may have nothing to lose under any weights (no label).
        # Where most batches lose 0, the last ones that lost something are kept apart for this (the last few batches
        # held none of them, and a blow-up was taken for one hard batch after another)
        lost = [r for r in refs if r[1] != 0.0]
        if self._zero_losses and len(lost) < len(refs):
            lost = [(kept, then) for t, kept, then in self._informative_refs if since <= t < before]
        return lost or refs

    def _weights_intact(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int,
                        module_state: Optional[dict[str, Any]] = None) -> bool:
        """Whether the weights came through a non-finite step unharmed (every rank calls this at the same point, the
        answer is the same on all): every parameter and buffer is finite, and the last normal batches, evaluated again
        with the present weights, lose about what they lost then (less than ``blowup`` times it). The non-finite
        value then came from the batch (its gradients were zeroed), not from weights on their way out.
        ``module_state``: ``pl_module.state_dict()`` when the caller has it."""
        refs = self._references(step) or self._refs_before
        state = pl_module.state_dict() if module_state is None and refs else module_state
        ok = bool(refs) and self._replayable(pl_module) and self._all_finite(state, self._infinite_by_design)
        if not self.decide(trainer, ok, all=True):
            return False
        now, then = self._replayed(trainer, pl_module, refs)
        if now is not None and not math.isfinite(now):
            # the step is undone alone (the weights kept) where the step's loss, not the weights, is non-finite; not
            # twice in a row (weights that broke before the newest snapshot lose a non-finite amount under both, and
            # each step undone alone would leave the run where it was, step after step), and only where the step's
            # gradients stayed finite (a term that holds no weight)
            return (self._normal_at(step - 1) and self._finite_grad_step == step
                    and self._nonfinite_whatever_the_weights(trainer, pl_module, refs))
        return now is not None and math.isfinite(now) and now <= self.blowup * max(then, 1e-12)

    def _normal_at(self, step: int) -> bool:
        """Whether ``step`` was judged normal (among the last normal steps kept)."""
        return any(s == step for s, _ in self._normal_recent)

    def _nonfinite_whatever_the_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                        refs: list[tuple[tuple[Any, int, Any], float]]) -> bool:
        """Reference batches lose a non-finite amount under the present (finite) weights, where they lost a finite one
        when trained on: broken weights (activations that overflow), or a loss that is non-finite at this step
        whatever the weights (a term of the step's own, `t * log(t)` of targets that hold a 0 on some steps, its
        gradients finite). The newest snapshot's weights, known good, tell them apart: non-finite under them too, it
        is the step's loss (the same answer on every rank: the losses are averaged over the ranks). Taken for broken
        weights, every such step went back to the last snapshot, whose checks fell on such steps too: 48 rollbacks to
        step 50 of 300 and a stop."""
        if not self._snapshots:
            return False
        older = self._under_snapshots(pl_module, [self._snapshots[-1]],
                                      lambda: self._mean_loss(trainer, pl_module, [b for b, _ in refs]))[0]
        return older is not None and not math.isfinite(older)

    def _replayed(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                  refs: list[tuple[tuple[Any, int, Any], float]]) -> tuple[Optional[float], float]:
        """``(now, then)`` of reference batches (:meth:`_references`): their mean loss under the present weights
        (:meth:`_mean_loss`, averaged over the ranks) and the mean of the losses they had when trained on."""
        return self._mean_loss(trainer, pl_module, [b for b, _ in refs]), sum(t for _, t in refs) / len(refs)

    def _mean_loss(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                   batches: list[tuple[Any, int, Any]]) -> Optional[float]:
        """The mean loss of ``batches`` (``(batch, batch_idx, random states)``) under the module's present weights,
        averaged over the ranks; ``None`` when a batch gives no loss."""
        losses = [self._batch_loss(pl_module, *b) for b in batches]
        return self._rank_mean(trainer, pl_module, None if None in losses else sum(losses) / len(losses))

    def _pruned(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, loss: float,
                level: float) -> bool:
        """Whether ``torch.nn.utils.prune`` (Lightning's ``ModelPruning``) masked parameters since the newest snapshot
        from before ``step`` (``step`` within one snapshot interval of it), and the loss rose with it on a run that was
        normal until then: the pruning's effect (its masks, and with the lottery-ticket rewind the weights of the
        start), not a divergence; the older weights, which find the batches easier, are no state to go back to. Said
        (``model_pruned``, info), the new level becomes the normal, and nothing acts; once per masked parameter. Every
        rank has the same masks (a callback prunes every rank alike) and judges the same mean loss: no reduction."""
        snap = next((s for s in reversed(self._snapshots) if s.step < step), None)
        # only a rise on a run that was normal up to it (the conditions that hold snapshots back: none), within one
        # snapshot interval of that snapshot (a pruning between two checks shows at once), once per pruning: a
        # divergence later on (the smoothed loss already creeping, a rise long after the pruning, a second rise with
        # the same masks) is judged as ever, the pruned model replayed with the older weights under its masks
        every = self.snapshot_every_n_steps
        if snap is None or every is None or step - snap.step > every + 1 or not self._normal_so_far():
            return False
        masked = [n for n in pruned_since(snap.saved_keys(), pl_module.state_dict().keys()) if n not in self._masked]
        if not masked:
            return False
        self._masked.update(masked)
        self._say_changed(step, "model_pruned", loss, level, masked, f"pruned since step {snap.step}",
                          "the pruning's effect, not a divergence. No action taken; the new level is the normal from here.")
        self._new_normal([loss], objective=True)
        return True

    def _restructured(self, trainer: pl.Trainer, pl_module: pl.LightningModule, start: int, loss: float,
                      level: float, replayed: Optional[tuple[Optional[float], float]] = None) -> bool:
        """Whether the model or its optimizers changed shape since the newest snapshot from before ``start`` (a vocabulary
        grown or shrunk by ``resize_token_embeddings``, a layer added, a parametrization registered, the optimizer
        rebuilt with other groups: the snapshot no longer fits the run, see :meth:`TrainingSnapshot.mismatch`) and the
        weights did not break with it. The older state can then neither be gone back to nor asked about the batches,
        and the rise is the change's (new tokens in the data, the first updates under the new structure): the guard
        rebases (:meth:`rebase`, said as ``rebased``), the rise is not acted on, the loss is judged afresh, and the
        present state is the one to go back to. Left to judge, such rises found no snapshot that fits and stopped
        healthy runs.

        The weights broke with the change when the last normal batches from before the rise, evaluated again
        (``replayed``: as the surge test found them), now lose more than ``blowup`` times the most of what they lost
        then and the initial loss (the untrained model's), or nothing finite: a layer added at a rate that blows it up
        (1.39 to 14.6, the initial loss 1.39), a rate x300 with the change. The share of the rise the other tests take
        cannot tell them apart here: the change itself moves those batches (the run's own rate, under SGD with
        momentum, forgot some of a grown vocabulary's old batches in two steps: 1.20 to 4.06, 73% of the rise, where
        the broken layer's moved 56%; still short of twice the untrained model's 3.7). Batches that cannot be run on
        the changed model at all (token ids beyond a shrunk vocabulary) say nothing against it. Every rank changes its
        model alike and judges the same mean loss."""
        snap = next((s for s in reversed(self._snapshots) if s.step < start), None)
        misfit = None if snap is None else snap.mismatch(trainer)
        if misfit is None or not self._replayable(pl_module):
            return False
        if replayed is None:
            refs = self._references(start)
            if not refs:
                return False
            self._replay_failed = False
            replayed = self._replayed(trainer, pl_module, refs)
        now, then = replayed
        if now is None:
            failed = self._replay_failed if trainer.world_size <= 1 else self.decide(trainer, self._replay_failed)
            if not failed:
                return False
        elif not math.isfinite(now) or now > self.blowup * max(then, self._anchor()):
            return False
        self.rebase(trainer, f"the loss rose to {loss:.4g} (recent level about {level:.4g}) after the model or its "
                             f"optimizers changed since step {snap.step} ({misfit}): the change's effect, not a "
                             "divergence; the state from before it no longer fits the run")
        return True

    def _normal_so_far(self) -> bool:
        """No condition but info ones (and a data shift) is active: the run was normal up to now."""
        return not any(sev != "info" for (kind, _), sev in self._conditions.items() if kind != "data_shift")

    def _say_changed(self, step: int, kind: str, loss: float, level: float, names: list[str], what: str,
                     verdict: str) -> None:
        """The info alert of a rise excused by a deliberate change of the parameters (``what`` was done to ``names``)."""
        self.alert(
            step, kind, "info",
            f"The loss rose to {loss:.4g} at step {step} (recent level about {level:.4g}) after {len(names)} "
            f"parameter(s) were {what} ({', '.join(names[:4])}{'...' if len(names) > 4 else ''}): {verdict}",
            value=loss, threshold=level,
        )

    def _unfrozen(self, pl_module: pl.LightningModule, step: int, loss: float, level: float) -> bool:
        """Whether parameters were made trainable (``requires_grad`` turned on: a backbone unfrozen) since the oldest
        kept snapshot within two snapshot intervals of ``step``, and the loss rose with their first updates on a run
        that was normal until then: the unfreezing's effect (parameters whose optimizer state starts afresh), not a
        divergence. Said (``unfrozen``, info), and nothing acts on this rise; once per parameter. The level stays: a
        rise that goes on (a backbone the rate destroys) or comes later is judged as ever, and rolled back into the
        weights from before the unfreezing. Every rank unfreezes alike and judges the same mean loss: no reduction."""
        every = self.snapshot_every_n_steps
        # the oldest snapshot that is recent: one taken at the step of the unfreezing already counts its parameters
        snap = next((s for s in self._snapshots if s.step < step and s.trainable is not None
                     and every is not None and step - s.step <= 2 * every + 1), None)
        if snap is None or not self._normal_so_far():
            return False
        assert snap.trainable is not None
        held = snap.module_keys or frozenset()  # parameters added since are not unfrozen ones (see mismatch)
        thawed = [n for n, p in pl_module.named_parameters(remove_duplicate=False)
                  if p.requires_grad and n in held and n not in snap.trainable and n not in self._thawed]
        if not thawed:
            return False
        self._thawed.update(thawed)
        self._say_changed(step, "unfrozen", loss, level, thawed, f"made trainable since step {snap.step}",
                          "the first updates of newly trained parameters, not a divergence. No action taken on this "
                          "rise; a rise that lasts is judged as ever.")
        return True

    def _objective_changed(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, loss: float,
                           level: float, refs: list[tuple[Any, int, Any]], then: float, now: float) -> bool:
        """Whether a surge whose reference batches, evaluated again, agree with it comes from the loss function
        rather than the weights: the newest snapshot from before the surge, asked about the same batches, sees at
        least half of the rise too. Good weights that find the batches they once found easy as hard as the present
        weights do mean ``training_step`` computes something else now (a penalty or an auxiliary loss switched on, a
        new stage of the run). Then the ``objective_change`` warning is raised, the new level becomes the normal,
        and nothing acts; ``False`` without a snapshot or automatic optimization."""
        seen = self._snapshot_sees_rise(trainer, pl_module, step, refs, then, now)
        if seen is None:
            return False
        snap, before = seen
        self.alert(
            step, "objective_change", "warning",
            f"The loss surged to {loss:.4g} at step {step} (recent level about {level:.4g}), and the last {len(refs)} "
            f"normal batches, evaluated again, went from {then:.4g} to {now:.4g}; but the weights of step {snap.step}, "
            f"from before the surge, find those batches about as hard ({before:.4g}): the loss function changed (a "
            "term switched on, a new stage of the run), not the weights. No action taken; the new level is the "
            "normal from here.",
            value=loss, threshold=level,
        )
        self._new_normal([loss, before], objective=True)
        return True

    def _attribute(self, trainer: pl.Trainer, pl_module: pl.LightningModule, start: int, level: float,
                   climb: bool = False) -> Optional[tuple[str, float, float]]:
        """``("weights" | "data" | "forgotten" | "transient", loss now, lowest loss of the snapshots asked)`` on the current
        batch, or ``None`` when it cannot be told (no snapshot before ``start``, manual optimization, no batch).

        The batch is evaluated with every kept snapshot from before ``start``. It is the data only when each of
        them finds it about as hard: a batch that is hard by itself is hard for older weights too, while weights
        that degraded gradually (a slow learning-rate ramp, within the noise until ``start``) leave the older
        snapshots finding it easy. The loss reported is the lowest of theirs. On small batches "the batch" is the
        rise's last batches together (:meth:`_rise_batches`): one example is no evidence either way."""
        snaps = [s for s in self._snapshots if s.step < start and s.mismatch(trainer) is None]
        vouched = self._vouched(start)
        snaps = [s for s in snaps if s.step <= vouched] or snaps  # weights known good, where there are any
        if not snaps or self._batch is None or not self._replayable(pl_module):
            return None
        batches = self._rise_batches(None if climb else start)
        now = self._mean_loss(trainer, pl_module, batches)
        if climb and now is not None and math.isfinite(now) and now <= level:
            return "transient", now, now  # the current batch shows no rise: no evidence either way
        if now is not None and math.isfinite(now) and not climb:
            anchor = self._anchor()
            z = self._loss_watch.zscore(now, abs_floor=self.initial_floor * anchor)
            if z <= self.z_threshold and now <= self.blowup * anchor:
                return "transient", now, now  # the anomaly is over: the current batch is normal again
        befores = self._under_snapshots(pl_module, list(reversed(snaps)),
                                        lambda: self._mean_loss(trainer, pl_module, batches))
        if now is None or None in befores:
            return None
        before = min((b for b in befores if b is not None and math.isfinite(b)), default=math.nan)
        if not math.isfinite(now):
            return "weights", now, before
        # the data explains the rise if every older state sees at least half of it on the same batch
        hard = [b is not None and math.isfinite(b) and (b - level) >= 0.5 * (now - level) for b in befores]
        if all(hard):
            return "data", now, before
        # the newest of those that find it easy: the state to go back to where newer ones find it as hard (read by
        # _target_snapshot at the rollback that follows a "weights" verdict)
        asked = list(zip(reversed(snaps), hard))
        easy = next(s.step for s, h in asked if not h) if hard[0] else None
        found = None if easy is None else (start, easy)
        anchor = self._episode_anchor(start)
        if anchor is not None and any(s is anchor and not h for s, h in asked):
            # the state the last rollback for a divergence restored finds it easy, the snapshots taken since do not: the
            # run climbs again from it (a fault the rate cuts did not cure), not a stretch of data handled better before
            self._easy_snapshot = found
            return "weights", now, before
        if hard[0] and self._references_intact(trainer, pl_module, start, now - level):
            # the newest snapshot finds the batch as hard as the present weights do (going back to it would not help),
            # only older ones find it easier, and the batches trained on last are still as easy as they were: a
            # stretch of data the run handled better at an earlier stage (epochs ordered by difficulty), not weights
            # that broke. Weights that broke lose on the batches before the rise too
            return "forgotten", now, befores[0]
        self._easy_snapshot = found
        return "weights", now, before

    def _rise_batches(self, start: Optional[int]) -> list[tuple[Any, int, Any]]:
        """The batches a rise since ``start`` is attributed on: the current one, and on small batches (fewer than
        ``_REFERENCE_SAMPLES`` samples) the rise's batches before it too, the newest first, until they hold that many.
        ``None`` for a climb of the smoothed loss: the batches it averages, whenever its rise was dated."""
        out = [(self._batch, self._batch_idx, self._batch_rng)]
        held = _samples(self._batch)
        if held is None or held >= _REFERENCE_SAMPLES:
            return out
        for s, batch, batch_idx, rng in reversed(self._recent_batches):
            if held >= _REFERENCE_SAMPLES or (start is not None and s < start):
                break
            if batch is self._batch:
                continue
            out.append((batch, batch_idx, rng))
            held += _samples(batch) or 0
        return out

    def _references_intact(self, trainer: pl.Trainer, pl_module: pl.LightningModule, start: int, rise: float) -> bool:
        """Whether the last normal batches from before ``start``, evaluated again, lost less than half of ``rise`` since
        they were trained on (every rank calls this at the same point)."""
        refs = self._references(start)
        if not refs or not math.isfinite(rise):
            return False
        now, then = self._replayed(trainer, pl_module, refs)
        return now is not None and math.isfinite(now) and now - then < 0.5 * rise

    @staticmethod
    def _under_snapshots(pl_module: pl.LightningModule, snaps: list[TrainingSnapshot],
                         evaluate: Callable[[], Optional[float]]) -> list[Optional[float]]:
        """``evaluate()`` with the module's weights (its parameters) set to each snapshot's in turn; the module's own
        are put back afterwards, whatever happens. The buffers stay the present ones: the question is whether older
        weights find the batch easy, and a buffer may hold the run's schedule rather than weights (a teacher-forcing
        ratio, a curriculum stage, a step count: older ones made the present batches look easy to older weights and
        a harder schedule was rolled back as a divergence); BatchNorm's running statistics do not enter a training-mode
        replay. The weights that are exactly zero now stay zero (weights pruned in place since, by a callback that
        zeroes the smallest ones: the older weights are asked under today's pruning, as under today's masks when
        the pruning keeps them as buffers; a weight that plain gradient training leaves exactly zero is rare, and
        one held at zero by a projection is zero in the snapshot too). Frozen parameters stay the present ones too, as
        the buffers: no update of this run's moved them, user code did (a DQN's target network synced to the online
        one, a teacher updated as a moving average), and they are part of what the loss computes: older trainable
        weights under an older target found the batches easy, and every sync was rolled back as a divergence. Read on
        the rare path of a judgement only."""
        params = {name for name, _ in pl_module.named_parameters(remove_duplicate=False)}
        trainable = {name for name, p in pl_module.named_parameters(remove_duplicate=False) if p.requires_grad}
        saved = {k: v.detach().clone() for k, v in pl_module.state_dict().items() if k in params}
        zeros = {k: z for k, v in saved.items() if v.is_floating_point() for z in [v == 0] if bool(z.any())}
        out: list[Optional[float]] = []
        try:
            for snap in snaps:
                with torch.no_grad():
                    current = pl_module.state_dict()
                    for _, now, value in held_values(snap.state()["module"], current):
                        if now in trainable:
                            current[now].copy_(value)
                            if now in zeros:
                                current[now].masked_fill_(zeros[now], 0.0)
                out.append(evaluate())
        finally:
            with torch.no_grad():
                current = pl_module.state_dict()
                for name, value in saved.items():
                    current[name].copy_(value)
        return out

    def _new_normal(self, values: list[float], objective: bool = False) -> None:
        """A changed level taken as the normal (new data, a new loss function): the loss history restarts from
        ``values`` (empty: a fresh start), the initial level rises to the first of them if it is higher, the moving
        average restarts, and a rise under way ends there (snapshots are taken again at once). ``objective``: what the
        step computes changed (another loss function, weights pruned, a weight decay raised, a model changed): the
        batches kept from before are no references from here."""
        self._loss_watch.reseed(values)
        if values:
            # at once the first of them (a new loss's scale); after _REANCHOR_STEPS losses, their median, if lower: the
            # first value of a shift is its peak (a jump to 40% flipped labels: 4.4 against a settled 1.5 and an
            # uninformed 2.3), which held every later threshold up (a collapse to chance then went unseen)
            floor = self._anchor()
            self._initial = [max(floor, values[0])] * 3
            self._reanchor = (floor, [])
        self._ema, self._ema_weight, self._ema_min = 0.0, 0.0, math.inf
        self._creep_high, self._creep_start, self._climb_judged, self._plateau = False, None, False, None
        if objective:
            # the batches kept from before are no references from here: their losses were those of the old loss (a
            # checkpoint's replays of them read sound weights as broken, and a resume on new data was stopped; so was
            # the end of a fit). New data keeps them: the same loss, which weights that broke still lose more on
            # (dropped there too, a divergence right after a data shift went unseen at a checkpoint and the fit's end)
            self._refs_from = self._judged_through + 1
            self._refs_before = []

    @staticmethod
    def _rank_mean(trainer: pl.Trainer, pl_module: pl.LightningModule, value: Optional[float]) -> Optional[float]:
        """``value`` averaged over the ranks (every rank then takes the same decision); ``None`` on every rank when it
        is ``None`` on any (a batch that could not be replayed there: the ranks returned ``None`` on one and NaN on the
        other, and took different decisions)."""
        if trainer.world_size <= 1:
            return value
        t = torch.tensor([0.0 if value is None else value, float(value is None)], dtype=torch.float64,
                         device=pl_module.device)
        total, missing = trainer.strategy.reduce(t, reduce_op="sum").tolist()
        return None if missing > 0 else total / trainer.world_size

    def _replayable(self, pl_module: pl.LightningModule) -> bool:
        """Whether ``training_step`` can be run again to evaluate a batch: under automatic optimization, or under
        manual optimization with one optimizer stepped once a batch (its backward, steps and scheduler steps are then
        made no-ops for the replay, and the loss is the one given to ``manual_backward``). With several optimizers the
        loss passed to ``manual_backward`` mixes the players' losses, and with several steps a batch the replay gives
        the losses of every step's part of the batch under one set of weights while each step's loss was of its own
        part: the batch cannot be evaluated like the step."""
        if pl_module.automatic_optimization:
            return True
        if self._steps_per_batch > 1:
            return False
        trainer = pl_module._trainer
        return trainer is not None and len(trainer.optimizers) == 1

    def _check_replay(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """At the fit's first snapshots (``_FAITHFUL_CHECKS`` steps with a finite loss, where the snapshot's finiteness check
        reads the host anyway), the step's batch evaluated again under the same weights, before the update: a replay must
        give the step's loss. A step that reads state it changes
        itself (a MoCo queue holding the batch's own keys once the step has enqueued them, a counter, a target network
        synced inside the step) or draws random numbers the guard does not keep (numpy's or Python's, a generator of its
        own, draws in the module's own ``on_train_batch_start``) gives another loss on a replay. Then the end of the fit
        is not judged by replaying its last batches (a healthy MoCo run was stopped at the end of every fit: its last
        batches, their own keys in the queue, replayed at 7 times their loss), said once (``replay_differs``, info).
        During the fit the replays still run, read as before (turned off, the MoCo run's queue filling by design read as
        a sustained rise, and it was rolled back from step 10). Checked under automatic optimization with one optimizer
        and no accumulation (one host read and one forward pass a check); the ranks agree."""
        if (not pl_module.automatic_optimization or trainer.accumulate_grad_batches != 1 or len(trainer.optimizers) != 1
                or self._drop is not None):
            self._faithful_checks = 0
            return
        expected = float(loss)
        # at a step with a finite loss and the batch kept (not one the step wrote into): on every rank, or none checks
        ready = math.isfinite(expected) and self._batch is not None
        if not (self.decide(trainer, ready, all=True) if trainer.world_size > 1 else ready):
            return
        self._faithful_checks -= 1
        replayed = self._batch_loss(pl_module)
        differs = replayed is not None and not (abs(replayed - expected) <= _FAITHFUL_TOLERANCE * abs(expected))
        if trainer.world_size > 1:
            differs = self.decide(trainer, differs)
        if not differs:
            return
        self._unfaithful, self._faithful_checks = True, 0
        shown = f"{replayed:.6g}" if replayed is not None else "?"
        self.alert(
            trainer.global_step, "replay_differs", "info",
            f"`training_step` evaluated again on its own batch under the same weights gave {shown} against the step's "
            f"{expected:.6g}: the step reads something it changes itself (a queue it writes the batch into, a counter, a "
            "target network it syncs) or draws random numbers the guard does not keep (numpy's, Python's, a generator "
            "of its own). The guard's replays of kept batches are not exact in this fit, and the end of the fit is not "
            "judged by them (the last update is left unjudged); keep such state out of the loss, or draw from torch's "
            "random streams, for the replays to be exact.",
            value=replayed, threshold=expected,
        )

    def _batch_written(self, trainer: pl.Trainer) -> None:
        """Find whether the step wrote into its batch's tensors (``x /= 16``, ``ids[mask] = MASK``, ``y -= 1``: their
        in-place version counters moved since the batch started); asked before the step is judged and at the end of
        every batch (each micro-batch's). The kept batch then holds what the step made of it, and a replay
        would apply the step twice (x / 256: a healthy run was stopped at the end of every fit, its last batches replayed
        near chance, and a true divergence read as an objective that changed): this batch is no longer kept, and from the
        next batch on the guard keeps a copy of each batch's tensors (said once, info)."""
        versions = self._batch_versions
        if not versions or all(t._version == v for t, v in versions):
            return
        self._batch_versions = None
        written = self._batch
        self._recent_batches = deque((e for e in self._recent_batches if e[1] is not written),
                                     maxlen=self._recent_batches.maxlen)
        self._informative_refs = deque((e for e in self._informative_refs if e[1][0] is not written),
                                       maxlen=self._informative_refs.maxlen)
        self._batch = None
        if self._copy_batches:
            return
        self._copy_batches = True
        self.alert(
            trainer.global_step, "batch_written", "info",
            "`training_step` writes into its batch's tensors in place (an in-place operation such as `x /= 16` or "
            "`ids[mask] = ...`): the guard now keeps a copy of each batch's tensors for its replays (one copy a step), "
            "so that a replay sees the batch as the step did. Writing `x = x / 16` instead spares the copy.",
        )

    def _batch_loss(self, pl_module: pl.LightningModule, batch: Any = None, batch_idx: Optional[int] = None,
                    rng: Any = None) -> Optional[float]:
        """The loss of a batch (default: the current one) under the module's present weights, with no side effect on
        the module (its buffers, BatchNorm's running statistics among them, are put back, and so are its parameters
        where the step writes into them: :class:`~lightning_monitor._replays.WritesUndone`; the random state too).
        Under manual optimization (one optimizer) the step's backward, optimizer steps, gradient clipping and
        scheduler steps do nothing during the replay (the gradients about to be applied are left as they are), and
        the loss is what the step gives ``manual_backward``."""
        if batch is None:
            batch, batch_idx, rng = self._batch, self._batch_idx, self._batch_rng
        patched: list[tuple[Any, str, bool, Any]] = []

        def silence(obj: Any, name: str, fn: Any) -> None:
            own = getattr(obj, "__dict__", {})
            patched.append((obj, name, name in own, own.get(name)))
            setattr(obj, name, fn)

        captured: list[Tensor] = []
        silence(pl_module, "log", lambda *a, **k: None)
        silence(pl_module, "log_dict", lambda *a, **k: None)
        trainer_of_step = getattr(pl_module, "_trainer", None)
        if trainer_of_step is not None:
            # a step that saves a checkpoint itself (every n steps): a replay writes no file (and a checkpoint's own
            # replays, see on_save_checkpoint, do not nest)
            silence(trainer_of_step, "save_checkpoint", lambda *a, **k: None)
        if not pl_module.automatic_optimization:
            trainer = pl_module.trainer
            silence(pl_module, "manual_backward", lambda loss, *a, **k: captured.append(loss.detach()))
            for name in ("clip_gradients", "toggle_optimizer", "untoggle_optimizer"):
                silence(pl_module, name, lambda *a, **k: None)
            optimizers = list(trainer.optimizers) + list(getattr(trainer.strategy, "_lightning_optimizers", []))
            for opt in optimizers:
                silence(opt, "step", lambda *a, **k: None)
                silence(opt, "zero_grad", lambda *a, **k: None)
        if trainer_of_step is not None:
            # a step that steps a scheduler itself (`self.lr_schedulers().step()`, also under automatic optimization):
            # a replay leaves the schedule where it was (each replay moved it on one step: 16 steps ahead by the end of
            # a run checkpointed every epoch)
            for cfg in trainer_of_step.lr_scheduler_configs:
                silence(cfg.scheduler, "step", lambda *a, **k: None)
        # and a scheduler the module holds itself (`self.sched = LambdaLR(...)`, stepped in the step)
        for held in list(vars(pl_module).values()):
            if isinstance(held, torch.optim.lr_scheduler.LRScheduler) and not any(p[0] is held for p in patched):
                silence(held, "step", lambda *a, **k: None)
        devices = [pl_module.device]
        # the step runs in training mode: BatchNorm would move its running statistics (and count the batch)
        buffers = [(b, b.detach().clone()) for b in pl_module.buffers()]
        # under the precision plugin's context (bf16-mixed: autocast), as Lightning runs the step itself
        precision = getattr(getattr(pl_module, "_trainer", None), "precision_plugin", None)

        # a step that writes into the module's own weights (a max_norm embedding, a clamp): the writes are undone; and
        # what it sets on its modules (a flag such as RWKV's `layers_are_rescaled`, a counter, a list appended to) is put
        # back (after the silencing above, which the restore below undoes in turn)
        writes = WritesUndone(plain_parameters(pl_module))
        kept = attributes(pl_module)
        # and what lies beside the module that a step may set: Python's and numpy's random streams (torch's are forked
        # below), the optimizers' hyperparameters (a rate set from `batch_idx` inside the step would be the kept batch's
        # for the update about to be made)
        host_states = host_random_states()
        trainer = getattr(pl_module, "_trainer", None)
        groups = [(g, {k: v for k, v in g.items() if k != "params"})
                  for opt in (trainer.optimizers if trainer is not None else []) for g in opt.param_groups]

        def put_back() -> None:
            lost = restore_attributes(kept)  # first: a buffer reassigned by the step gets its tensor back, filled below
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
            writes.undo()
            set_host_random_states(host_states)
            for group, hyper in groups:
                group.update(hyper)
            if lost and not self._warned_lost:
                self._warned_lost = True
                rank_zero_warn(f"DivergenceGuard: its replay of `training_step` wrote into the large tensor attribute(s) "
                               f"{', '.join(lost[:4])} in place, which it does not copy: those writes stay.")

        def replay(grad: bool) -> Any:
            context = precision.train_step_context() if precision is not None else contextlib.nullcontext()
            # a run of the guard's own: the other monitors' hooks (inputs sampled for a check, per-example records) skip it
            with torch.set_grad_enabled(grad), fork_rng_of(devices), context, writes, dry_run():
                if rng is not None:  # the draws of the batch's own step (the fork puts the run's streams back)
                    set_random_states_of(devices, rng)
                # a fresh copy, tensors and all: a replayed step may pop from its batch or write into its tensors
                return pl_module.training_step(_kept(batch, copied=True), batch_idx)

        try:
            try:
                out = replay(self._replay_grad)
            except Exception:  # noqa: BLE001
                if self._replay_grad:
                    raise
                # a step that differentiates itself (`torch.autograd.grad`) fails without gradients: once more with
                # them, and so from now on if that runs
                put_back()
                out = replay(True)
                self._replay_grad = True
        except Exception as err:  # noqa: BLE001
            # a step that cannot run twice (it consumes something of the batch's or of its own; under manual
            # optimization, it needs what the replay turns off, such as a closure's loss from `opt.step`): the batch
            # cannot be evaluated, and the rise is judged without the replay's test. The fit goes on.
            self._replay_failed = True
            if not self._warned_replay:
                self._warned_replay = True
                rank_zero_warn(f"DivergenceGuard could not run `training_step` again on a kept batch "
                               f"({type(err).__name__}: {err}); loss rises are judged without asking older weights.")
            return None
        finally:
            put_back()
            for obj, name, had, value in reversed(patched):
                if had:
                    setattr(obj, name, value)
                else:
                    delattr(obj, name)  # the instance attribute goes: the class's method is back
        if captured:
            return float(sum(_wide(t).sum() for t in captured))
        if isinstance(out, dict):
            out = out.get("loss")
        if not isinstance(out, Tensor):
            return None
        return float(_wide(out.detach()).sum())

    # ------------------------------------------------------------------ snapshots and actions
    def _monitors(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The suite's other monitors whose state travels with a snapshot (GradES's statistics, not its freezes: freezing
        is not undone), and the running averages of ``StochasticWeightAveraging`` and ``WeightAveraging``
        (``EMAWeightAveraging``)."""
        out: dict[str, Any] = {cb.state_key: _SnapshotOf(cb) for cb in trainer.callbacks
                               if isinstance(cb, Monitor) and cb is not self}
        averages = [cb for cb in trainer.callbacks if isinstance(cb, StochasticWeightAveraging)]
        out.update({f"StochasticWeightAveraging[{i}]": _AveragedWeights(cb) for i, cb in enumerate(averages)
                    if hasattr(cb, "_latest_update_epoch") and hasattr(cb, "_average_model")})
        if WeightAveraging is not None:
            averages = [cb for cb in trainer.callbacks if isinstance(cb, WeightAveraging)]
            needed = ("_latest_update_step", "_latest_update_epoch", "_average_model")
            out.update({f"WeightAveraging[{i}]": _WeightAverage(cb, trainer) for i, cb in enumerate(averages)
                        if all(hasattr(cb, a) for a in needed)})
        return out

    @staticmethod
    def _restore_keeping_frozen(trainer: pl.Trainer, pl_module: pl.LightningModule, snap: TrainingSnapshot,
                                monitors: dict[str, Any]) -> None:
        """Restore ``snap``, but for the parameters GradientEarlyStopping has frozen: freezing is not undone, so a
        frozen component keeps the weights it froze with (restored, it stayed frozen at weights from before its
        freeze, on a trajectory the rollback undid) and its optimizer state stays freed (the restore brought it
        back, for good). Nor is pruning undone: the masks of ``torch.nn.utils.prune`` (``w_mask`` beside ``w_orig``)
        keep their present values, and the saved weights are restored under them (a rollback to the state before
        ModelPruning's second pruning brought the first one's mask back: the run ended 82% sparse instead of 94%)."""
        from lightning_monitor.callbacks.grades import GradientEarlyStopping

        grades = [cb for cb in trainer.callbacks if isinstance(cb, GradientEarlyStopping)]
        frozen = {id(p) for g in grades for p in g.frozen_parameters(trainer)}
        keep = {n for n, p in pl_module.named_parameters(remove_duplicate=False) if id(p) in frozen}
        params = dict(pl_module.named_parameters(remove_duplicate=False))
        keep.update(k for k in pl_module.state_dict() if k.endswith("_mask") and k[: -len("_mask")] + "_orig" in params)
        snap.restore(trainer, pl_module, monitors, keep=keep)
        for g in grades:
            g.refreeze(trainer)

    def _snapshot_due(self, step: int) -> bool:
        """At the first check, then once ``snapshot_every_n_steps`` have passed since the newest snapshot
        (a snapshot refused because something was wrong is tried again at the next check)."""
        every = self.snapshot_every_n_steps
        return every is not None and (not self._snapshots or step - self._snapshots[-1].step >= every)

    @staticmethod
    def _all_finite(module_state: dict[str, Any], skip: frozenset[str] = frozenset()) -> bool:
        """Whether every floating parameter and buffer of a module's ``state_dict()`` (but those named in ``skip``)
        is finite (one host transfer)."""
        tensors = [local(t) for k, t in module_state.items()
                   if t.is_floating_point() and local(t).numel() and k not in skip]
        # a NaN or Inf anywhere makes its tensor's norm non-finite: one fused kernel for all of them. A norm can also
        # overflow where every value is finite (its squares, from 1.8e19 on: a buffer holding float32's lowest value, a
        # masking constant, read as non-finite and stopped a healthy run at its first step), so a non-finite norm is
        # confirmed value by value (the rare path; the largest magnitude, which cannot overflow, costs 7 times the
        # 2-norm on CPU)
        if not tensors or bool(torch.isfinite(torch.stack(foreach_norm(tensors, 2.0, dtype=torch.float32)).sum())):
            return True
        return all(bool(torch.isfinite(t).all()) for t in tensors)

    def _infinite_buffers(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> frozenset[str]:
        """The floating buffers of ``pl_module.state_dict()`` that hold infinities, and no NaN, when training starts:
        masks by design (a causal attention mask of ``-inf`` kept as a buffer), which the check of the state before
        each snapshot leaves out (it would otherwise find the state non-finite at every step and stop the run at the
        first). Said once (info)."""
        params = {id(p) for p in pl_module.parameters()}
        found = [(k, t) for k, t in pl_module.state_dict().items()
                 if t.is_floating_point() and id(t) not in params and local(t).numel()]
        if not found:
            return frozenset()
        with torch.no_grad():
            flags = torch.stack([torch.stack([torch.isinf(local(t)).any(), torch.isnan(local(t)).any()])
                                 for _, t in found]).cpu()  # one transfer, once per fit
        names = frozenset(k for (k, _), (inf, nan) in zip(found, flags.tolist()) if inf and not nan)
        if names and self._infinite_by_design != names:
            listed = sorted(names)
            self.alert(
                trainer.global_step, "infinite_buffers", "info",
                f"{len(listed)} buffer(s) hold infinities from the start of training (masks by design): "
                f"{', '.join(listed[:4])}{'...' if len(listed) > 4 else ''}. The check of the weights and buffers "
                "before each snapshot leaves them out; the other parameters and buffers are checked as usual.",
            )
        return names

    def _snapshot_now(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Keep the present state as a snapshot, if every parameter and buffer is finite (and nothing holds snapshots
        back: see :meth:`_snapshot`)."""
        module_state = pl_module.state_dict()
        ok = self._all_finite(module_state, self._infinite_by_design)
        self._snapshot(trainer, pl_module, trainer.global_step, ok, module_state)

    def _snapshot_before_bad_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        """This step's own loss or gradient norm is non-finite, judged before its update (one process on CPU: its values
        read at once; not under ``action="warn"``, which restores nothing), every earlier step normal: the state now,
        before the update, is the last good one if the
        weights are intact (every parameter and buffer finite, and the last normal batches losing about what they lost;
        at the fit's first step, the state it started from, which nothing vouches for but its finiteness). Kept as a
        snapshot an anomaly at this very step goes back to, so that the rollback undoes this batch alone: going back to
        the last check's snapshot undid up to ``snapshot_every_n_steps`` good updates and their scheduler steps with it
        (a run with one bad batch in ten kept 120 of 300 updates), and a bad first batch, with no snapshot yet, stopped
        a healthy run (a model whose every batch is non-finite still stops: whether a rollback opens a new episode is
        asked of the batches alone, so its rollbacks count as repeats)."""
        module_state = pl_module.state_dict()
        if self.__dict__.get("_normal_in_fit", 1) == 0:
            # no step of the fit judged normal yet: the weights are those it started from (every update since was of a
            # non-finite step, its gradients zeroed, or undone), which no batch vouches for yet but their finiteness
            intact = self.decide(trainer, self._all_finite(module_state, self._infinite_by_design), all=True)
        else:
            intact = self._weights_intact(trainer, pl_module, step, module_state)
        if not intact:
            return
        snap = self._snapshot(trainer, pl_module, step, True, module_state, despite="nonfinite")
        if snap is not None:
            snap.own_step_target = True

    def _snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, ok: bool,
                  module_state: Optional[dict[str, Any]] = None,
                  despite: Optional[str] = None) -> Optional[TrainingSnapshot]:
        """Take a snapshot if every rank found its steps since the last check normal (``despite``: a condition raised by
        this step's own values, which the state before its update predates); returns it."""
        active = any(sev != "info" for (kind, _), sev in self._conditions.items()
                     if kind not in ("data_shift", despite))
        # nor while the smoothed loss creeps up (warned or not), or sits closer to the creep limit than to its lowest
        # value: the weights of a slow divergence are no "last good"
        ok = ok and not active and self._loss_watch.run == 0 and self._creep_start is None and not self._creep_high
        if not self.decide(trainer, ok, all=True):
            return None
        # a snapshot newer than the last judged step is provisional (its steps may still turn out anomalous):
        # it does not push out a confirmed one. The ones the new snapshot pushes out give it their memory.
        def confirmed(at: int) -> bool:
            return at <= self._judged_through + 1

        # where the run has steps of loss 0, the newest snapshot a loss other than 0 vouched for is kept: 20 steps
        # without a label pushed it out, and only weights already broken were left to go back to and to ask
        protect = None
        if self._zero_losses and self._informative:
            protect = next((s for s in reversed(self._snapshots) if s.step <= self._informative[-1]), None)
        # the state the last rollback for a divergence restored, for _AFTER_ROLLBACK steps: the snapshots taken since may
        # all be on a renewed climb, and asked alone they found its batches as hard and took it for new data
        anchor = self._episode_anchor(step)
        out: list[TrainingSnapshot] = []
        while sum(confirmed(s.step) for s in self._snapshots) + confirmed(step) > self.keep_snapshots:
            victim = next((s for s in self._snapshots if s is not protect and s is not anchor), None)
            if victim is None:
                break
            self._snapshots.remove(victim)
            out.append(victim)
        # in host memory, the newest one pushed out is written over; files are deleted once the new one is saved
        reuse = out.pop() if out and self.snapshot_dir is None else None
        snap = TrainingSnapshot.capture(trainer, pl_module, self._monitors(trainer), step, self._lr_scale,
                                        self.snapshot_dir, reuse=reuse, module_state=module_state,
                                        previous=self._snapshots[-1] if self._snapshots else None)
        for old in out:
            old.discard()
        snap.guard = self._detector_state()
        self._snapshots.append(snap)
        oldest = self._snapshots[0].step
        self._seen = [e for e in self._seen if e[0] >= oldest]
        return snap

    def _episode(self, step: int) -> list[dict[str, Any]]:
        """The rollbacks of the episode at ``step``: those within ``rollback_window`` steps, from the last one that
        opened a new episode on."""
        recent = [r for r in self.rollbacks if step - r["step"] < self.rollback_window]
        opened = [i for i, r in enumerate(recent) if r.get("new_episode")]
        return recent[opened[-1]:] if opened else recent

    def _healed_since(self, step: int) -> bool:
        """Whether the run was confirmed healthy for a while after ``step``: a snapshot (every step normal and every
        parameter finite) taken at least two snapshot intervals after it, and judged since."""
        every = self.snapshot_every_n_steps
        return every is not None and any(
            s.step >= step + 2 * every and s.step <= self._judged_through for s in self._snapshots)

    def _episode_anchor(self, step: int) -> Optional[TrainingSnapshot]:
        """The state the last rollback for a divergence restored, while it is kept and at most ``_AFTER_ROLLBACK`` steps
        have passed since that rollback; else ``None``."""
        last = self.rollbacks[-1] if self.rollbacks else None
        if last is None or not last.get("diverged") or step - last["step"] > _AFTER_ROLLBACK:
            return None
        return next((s for s in self._snapshots if s.step == last["to_step"]), None)

    def _target_snapshot(self, trainer: pl.Trainer, first_bad: int) -> Optional[TrainingSnapshot]:
        """The newest snapshot before ``first_bad`` on every rank (the ranks agree by a reduction) that still fits the
        run (see :meth:`TrainingSnapshot.mismatch`; the reason the newest one did not is kept in ``_misfit``)."""
        self._misfit = None
        # a state is vouched for by a normal loss at its step; a loss of 0 may vouch for nothing (a batch with no label
        # loses 0 under any weights): where the run has them, a snapshot up to the last step that lost something is
        # preferred (one taken between labelled batches held weights already broken, and the run diverged again), and
        # a later one taken only if there is none (a rollback rather than a stop)
        vouched = self._vouched(first_bad)
        newest = list(reversed(self._snapshots))
        known = self._hard_batch_first(
            [s for s in newest if s.step <= vouched or (s.own_step_target and s.step == first_bad)])
        found, self._easy_snapshot = self._easy_snapshot, None
        easy = found[1] if found is not None and found[0] == first_bad else None
        if easy is not None:
            # the rise was attributed to the weights by an older snapshot that finds its batch easy, while newer ones find
            # it as hard as the present weights do: those are on the climb already, no state to go back to
            known = [s for s in known if s.step <= easy] + [s for s in known if s.step > easy]
        for snap in known + [s for s in newest if vouched < s.step < first_bad]:
            misfit = snap.mismatch(trainer)
            self._misfit = self._misfit or misfit
            if self.decide(trainer, misfit is None, all=True):
                return snap
        return None

    def _hard_batch_first(self, snaps: list[TrainingSnapshot]) -> list[TrainingSnapshot]:
        """``snaps`` (newest first) with those from at or before the last hard batch first, where any is kept. A hard
        batch is a surge the weights were not to blame for, but its large gradient was applied: the steps after it
        may all look normal on their own batches while the weights are already unstable. Near a loss of 0 an Adam run
        whose loss then spiked again had weights 4 steps after the hard batch that lost 0.28 on the batches it had just
        lost 0.009 on; taken for the weights from before the surge, they made the rise look like a new loss function.
        Snapshots from before the hard batch are known good; the newer ones stay as a fallback."""
        hard = self._hard_batch
        if hard is None:
            return snaps
        before = [s for s in snaps if s.step <= hard]
        return before + [s for s in snaps if s.step > hard] if before else snaps

    def _vouched(self, before: int) -> int:
        """The last step before ``before`` whose state a normal loss vouched for: ``before - 1``, or, where the run has
        steps of loss 0 (which may vouch for nothing: a batch with no label), the last normal step that lost
        something. Snapshots up to it are the weights known good."""
        if self._zero_losses:
            return max((t for t in self._informative if t < before), default=before - 1)
        return before - 1

    def _clear_conditions(self, step: int, message: str) -> None:
        for kind, layer in list(self._conditions):
            self.condition(step, kind, False, "info", "", layer=layer, clear_message=message)

    def _forget_recent(self) -> None:
        """Drop the kept batches and the losses of the last normal steps (of weights no longer there)."""
        self._recent_batches.clear()
        self._normal_recent.clear()
        self._informative_refs.clear()
        self._hard_batch = None

    def rebase(self, trainer: pl.Trainer, reason: str = "the weights were changed on purpose") -> None:
        """Tell the guard that the weights were changed on purpose (a head re-initialised, shrink-and-perturb,
        pruning that zeroes weights in place, weights loaded by hand): the rise of the loss that follows is the
        change's, not a divergence, and the weights from before it are no state to go back to. The loss history
        restarts, the snapshots from before are dropped, and the present state is kept as a snapshot at once (when
        every parameter and buffer is finite), so that a divergence after the change rolls back to it. Said
        (``rebased``, info). Call it from a hook of a callback or of the LightningModule, after the change and
        before the step's backward (``on_train_batch_start``, or ``on_train_batch_end`` for the next step), on
        every rank alike (under several processes the snapshot's agreement is a collective)."""
        from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

        if trainer.state.fn != TrainerFn.FITTING or trainer.state.status != TrainerStatus.RUNNING:
            raise RuntimeError("DivergenceGuard.rebase() is called during a fit (from a hook of a callback or of the "
                               "LightningModule), after the change it announces.")
        step = trainer.global_step
        pl_module = trainer.lightning_module
        self._clear_conditions(step, f"Rebased: {reason}.")
        self._forget_recent()
        self._informative.clear()  # the present state is the one to go back to: no older step vouches for it
        self._new_normal([], objective=True)
        for snap in self._snapshots:
            snap.discard()
        self._snapshots = []
        self.alert(step, "rebased", "info",
                   f"Rebased at step {step}: {reason}. The loss is judged afresh from here, and the state of step "
                   f"{step} is the one to go back to.")
        if self.idle_reason is None and self.snapshot_every_n_steps is not None:
            self._snapshot_now(trainer, pl_module)

    def _lift_lr_ceiling(self, trainer: pl.Trainer) -> None:
        """A fit that starts without a checkpoint after a rollback of an earlier fit of the same Trainer: its
        optimizers are new, built by ``configure_optimizers`` at the rates the user set for this fit (a rate picked by
        ``Tuner.lr_find`` in between, say), and their groups need not be the old ones. The earlier fit's ceiling and
        scale are lifted, said once (info): a divergence of this fit is met with rollbacks of its own."""
        ceiling, scale = self._lr_ceiling, self._lr_scale
        self._lr_ceiling, self._lr_scale = None, 1.0
        was = []
        if ceiling is not None:
            was.append("a ceiling of " + ", ".join(f"{c:.3g}" for row in ceiling for c in row if math.isfinite(c)))
        if scale != 1.0:
            was.append(f"{scale:.3g}x their schedule")
        last = self.rollbacks[-1]["step"] if self.rollbacks else None
        self.alert(
            trainer.global_step, "lr_ceiling_lifted", "info",
            f"This fit starts with new optimizers (no checkpoint): the learning rates set by the rollback"
            f"{f' at step {last}' if last is not None else ''} of an earlier fit ({'; '.join(was) or 'none'}) are "
            "lifted, and the rates are those of the new optimizers. A divergence of this fit is rolled back and "
            "its rate lowered again.",
        )

    def _apply_lr_ceiling(self, trainer: pl.Trainer) -> bool:
        """Hold every float learning rate at or below its ceiling (host floats only: no device work); whether one
        was above it."""
        if self._lr_ceiling is None:
            return False
        above = False
        for opt, ceilings in zip(trainer.optimizers, self._lr_ceiling):
            for group, ceiling in zip(opt.param_groups, ceilings):
                if isinstance(group["lr"], float) and group["lr"] > ceiling:
                    group["lr"] = ceiling
                    above = True
        return above

    def _rates_in_force(self, trainer: pl.Trainer, step: int) -> None:
        """Right before the update: hold the rates under the ceiling again, and note the rates the step uses (once per
        optimizer step, micro-batches and several optimizers included). Code that runs after the callbacks'
        ``on_train_batch_start`` may set them (a warm-up in ``optimizer_step``, the module's own
        ``on_train_batch_start``): a ceiling set by a rollback would not hold. Said once (``lr_overridden``)."""
        if self._apply_lr_ceiling(trainer) and not self._said_lr_overridden:
            self._said_lr_overridden = True
            self.alert(
                step, "lr_overridden", "warning",
                f"A learning rate was set above the ceiling of the last rollback after the callbacks' "
                f"`on_train_batch_start` at step {step} (by `optimizer_step`, the LightningModule's "
                "`on_train_batch_start`, or a closure): the guard holds it at the ceiling right before each update. "
                "Set rates with an LR scheduler, or in `on_train_batch_start` of a callback listed before the guard, "
                "to let the guard lower them as it rolls back.",
            )
        if not self._lr_trace or self._lr_trace[-1][0] != step:
            self._lr_trace.append((step, self._float_lrs(trainer)))

    @staticmethod
    def _float_decays(trainer: pl.Trainer) -> list[list[Optional[float]]]:
        """Every parameter group's weight decay (``None`` where it has none, or a tensor)."""
        return [[g.get("weight_decay") if isinstance(g.get("weight_decay"), (int, float)) else None
                 for g in opt.param_groups] for opt in trainer.optimizers]

    def _decay_rose(self, trainer: pl.Trainer) -> Optional[str]:
        """How the weight decay rose since the lowest smoothed loss, where it is strong enough to move the loss
        (:data:`_DECAY_STRENGTH`), while every learning rate stayed at or below its rate then (a weight-decay ramp, a
        regularisation schedule: the training loss rises by design); else ``None`` (a rate that rose since is the
        likelier cause, and a weak decay explains nothing)."""
        then, best = self._wd_at_min, self._lr_at_min
        if then is None or best is None:
            return None
        if self._types_at_min is not None and self._types_at_min != [type(opt).__name__ for opt in trainer.optimizers]:
            # an optimizer swapped since (SGD then, AdamW now): its decay is another optimizer's setting (AdamW's default
            # 0.01 against SGD's 0 read as a decay that rose, and a rise the rollback had not cured was excused)
            return None
        lrs = self._float_lrs(trainer)
        for i, row in enumerate(lrs):
            for j, n in enumerate(row):
                b = grid_at(best, i, j)
                if n is None or b is None or n > 1.001 * b:
                    return None
        rose = [(b, n) for i, row in enumerate(self._float_decays(trainer)) for j, n in enumerate(row)
                for b, lr in [(grid_at(then, i, j), grid_at(lrs, i, j))]
                if n is not None and b is not None and lr is not None and n > 1.001 * b
                and lr * n >= _DECAY_STRENGTH]
        if not rose:
            return None
        return ", ".join(f"{b:.3g} -> {n:.3g}" for b, n in rose[:3]) + (" ..." if len(rose) > 3 else "")

    def _above_best(self, lrs: list[list[Optional[float]]]) -> dict[tuple[int, int], tuple[float, float]]:
        """``(optimizer, group) -> (rate, rate at the best smoothed loss)`` of the float rates ``lrs`` above their
        rate at the best smoothed loss."""
        best = self._lr_at_min
        return {(i, j): (n, b) for i, row in enumerate(lrs) for j, n in enumerate(row) for b in [grid_at(best, i, j)]
                if n is not None and b is not None and n > 1.001 * b}

    @staticmethod
    def _float_lrs(trainer: pl.Trainer) -> list[list[Optional[float]]]:
        """Every parameter group's learning rate (``None`` for a tensor rate: reading it would sync)."""
        return [[g["lr"] if isinstance(g["lr"], float) else None for g in opt.param_groups] for opt in trainer.optimizers]

    def _rollback(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, snap: TrainingSnapshot,
                  reasons: str, repeat: int, diverged: bool, bad_batch: bool,
                  rates: Optional[list[list[Optional[float]]]] = None) -> None:
        """Restore ``snap``. The learning rate, for the ``repeat``-th rollback of an episode (0: the first):

        * weights that diverged while the rate rose since the best smoothed loss (a warm-up, ramp or jump): capped
          at the rate of that best loss and at ``lr_factor`` times the rate of the divergence; scaled by
          ``lr_factor ** repeat``;
        * bad data (a non-finite loss or gradient, or a divergence that began with one batch the weights were not
          to blame for, at a steady rate): scaled by ``lr_factor ** repeat`` (kept the first time);
        * weights that diverged at a steady rate: scaled by ``lr_factor ** (repeat + 1)``.
        A scaled rate is also capped at its restored value, and any cap set earlier in the episode comes down with
        the scale."""
        lr_now = self._float_lrs(trainer) if rates is None else rates
        self._clear_conditions(step, "Rolled back.")
        self._restore_keeping_frozen(trainer, pl_module, snap, self._monitors(trainer))
        self._saved_verdict = None  # other weights at the same step: a checkpoint written now replays them again
        self._restep_epoch_schedulers(trainer, snap.epoch)
        self._load_detector_state(snap.guard)
        # other monitors' critical alerts not yet acted on describe steps now undone: they go with them (else the next
        # check would roll back again for them)
        self._external = [a for a in self._external if a.step < snap.step]
        # the last normal batches stay references for the next non-finite step's question (are the weights intact?),
        # asked right after a rollback too (bad batches close together): their losses then came from weights a few
        # steps from the snapshot's, within the factor asked
        self._refs_before = self._references(step + 1) or self._refs_before
        self._forget_recent()  # skipped data, and losses of weights no longer there
        # the values still on their way to the host (``lag_steps`` > 0, a GPU's default) are of steps this rollback
        # undid: judged after it, the losses of the diverged weights entered the restored history as its recent level,
        # and a second blow-up right after the rollback read as normal (a run left at chance, 2.40 against 0.09)
        self._ring.clear()
        # the steps that vouched for states are those of the timeline kept: up to the snapshot's step
        self._informative = deque((t for t in self._informative if t <= snap.step), maxlen=self._informative.maxlen)
        best, before = self._lr_at_min, self._lr_ceiling
        # the groups whose rate rose since the best smoothed loss: only they are held to a fraction of the rate that
        # diverged (a group whose rate never moved, a trunk beside a head whose rate jumped, keeps its rate)
        risen = self._above_best(lr_now)
        rose = diverged and bool(risen)
        steady = diverged and not rose and not bad_batch
        factor = self.lr_factor ** (repeat + steady)
        self._lr_scale *= factor
        scale_learning_rates(trainer, self._lr_scale / snap.lr_scale)
        if rose or factor < 1.0:
            ceilings = []
            for i, opt in enumerate(trainer.optimizers):
                row = []
                for j, group in enumerate(opt.param_groups):
                    # the rate restored (a group switched off now, a backbone before its unfreeze, is not held at 0
                    # for good: its schedule may switch it on)
                    caps = [group["lr"] if isinstance(group["lr"], float) and group["lr"] > 0.0 else math.inf]
                    if rose:  # the rate of the best smoothed loss, and a fraction of the rate that diverged
                        # (a group switched off then, a backbone before its unfreeze, is not held at 0 for good)
                        caps += [b for b in [grid_at(best, i, j)] if b is not None and b > 0.0]
                        if (i, j) in risen or grid_at(best, i, j) is None:
                            caps += [self.lr_factor * n for n in [grid_at(lr_now, i, j)] if n is not None]
                    caps += [c * factor for c in [grid_at(before, i, j)] if c is not None]
                    row.append(min(caps))
                ceilings.append(row)
            self._lr_ceiling = ceilings
            self._apply_lr_ceiling(trainer)
        batches = [[e, b] for s, e, b in self._seen if snap.step <= s <= step]
        self._skip.update((e, b) for e, b in batches)
        self._seen = [e for e in self._seen if e[0] < snap.step]
        for later in [s for s in self._snapshots if s.step > snap.step]:
            later.discard()
        self._snapshots = [s for s in self._snapshots if s.step <= snap.step]
        record = {"step": step, "to_step": snap.step, "skipped": len(batches), "batches": batches,
                  "lr_factor": factor, "lr_scale": self._lr_scale, "lr_ceiling": self._lr_ceiling,
                  "loss_before": self._loss_watch.level() if self._loss_watch.history else None, "reasons": reasons,
                  "diverged": bool(diverged and not bad_batch)}
        self.rollbacks.append(record)
        lr = f"; learning rates now {self._lr_scale:.3g}x their schedule" if self._lr_scale != 1.0 else ""
        if rose:
            groups = sum(len(row) for row in lr_now)
            lr += ("; learning rates capped at the rate of the best smoothed loss" if len(risen) == groups else
                   f"; the learning rates that rose since the best smoothed loss ({len(risen)} of {groups} parameter "
                   f"groups: {', '.join(f'optimizer {i} group {j}' for i, j in sorted(risen)[:4])}"
                   f"{' ...' if len(risen) > 4 else ''}) capped at their rate then, the others kept")
        elif factor < 1.0:
            lr += ", and capped at the scaled rate of the state restored"
        if diverged and bad_batch and not rose:
            # the critical alert's advice (lower the rate) is not what was done: said why
            lr += ("; the rise began with a surge on one batch, which earlier weights found hard too: taken for bad "
                   "data, so the skip is the cure" + (" and the learning rates are kept" if factor == 1.0 else ""))
        self.alert(
            step, "rolled_back", "info",
            f"Rolled back at step {step} to the state of step {snap.step} ({reasons}). "
            + (f"The {len(batches)} batches seen since are skipped" if len(batches) != 1 else
               "The batch seen since is skipped") + f"{lr}.",
            details={k: v for k, v in record.items() if k != "reasons"},
        )

    @staticmethod
    def _restep_epoch_schedulers(trainer: pl.Trainer, epoch: int) -> None:
        """After a restore to a state of ``epoch``: the epoch-interval schedulers' steps the restore took back are made
        again, as Lightning makes them: one for each epoch that ended since (the run's epochs go on; a rollback to a
        snapshot of the previous epoch left a StepLR one epoch behind for the rest of the run, at twice its rate), and
        one for the epoch ending with this batch (Lightning stepped them before this hook: a bad last batch in each of
        4 epochs held a StepLR at its first rate)."""
        loop = trainer.fit_loop.epoch_loop
        last = getattr(loop, "_num_ready_batches_reached", None)
        if last is None or not trainer.lr_scheduler_configs or not trainer.lightning_module.automatic_optimization:
            return
        ended = list(range(epoch, trainer.current_epoch)) + ([trainer.current_epoch] if last() else [])
        from lightning.pytorch.trainer import call

        for config in trainer.lr_scheduler_configs:
            if config.interval != "epoch" or config.reduce_on_plateau:
                continue
            for e in ended:  # as Lightning steps it at the end of epoch `e` (`frequency`: every that many epochs)
                if (e + 1) % config.frequency == 0:
                    call._call_lightning_module_hook(trainer, "lr_scheduler_step", config.scheduler, None)

    def _stop(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, snap: Optional[TrainingSnapshot],
              reasons: str) -> None:
        if snap is not None:
            # the checkpoint is the snapshot's state throughout, as a rollback restores it: the other monitors' states
            # and the guard's own detectors too. Kept as they were at the stop, they held the diverged steps (the
            # noise scale's averages, SA's checks) and the rate that diverged as one the run had trained at with a
            # normal loss: resumed at a lower rate that later went back up to it, the divergence was taken for a
            # warm restart (a warning, no action) and the run ended at a loss of 2.89 against 1.7
            self._clear_conditions(step, f"Stopped; the checkpoint holds the state of step {snap.step}.")
            self._restore_keeping_frozen(trainer, pl_module, snap, self._monitors(trainer))
            self._saved_verdict = None
            self._load_detector_state(snap.guard)
            state = f"the state of step {snap.step}, the last good one"
            above = list(self._above_best(self._float_lrs(trainer)).values())
            if above:
                # the state holds the rates in force at its step, which may be those that diverged (a jump set before
                # the snapshot's step): said, so that a resume does not take them again unawares
                state += (f", with the learning rates in force then, above those of the lowest smoothed loss "
                          f"({', '.join(f'{n:.3g} against {b:.3g}' for n, b in above[:3])}"
                          f"{' ...' if len(above) > 3 else ''}): resumed at those rates, the run may diverge again")
        else:
            why = "no earlier snapshot fits the run" if self._misfit else "no earlier snapshot to go back to"
            state = f"the state after step {step} ({why})"
        path: Optional[str] = os.path.join(self._checkpoint_dir(trainer), f"guard-step={step}.ckpt")
        where = f"{path} holds {state}."
        self._saving_stop = True
        try:
            trainer.save_checkpoint(path)
        except Exception as err:  # noqa: BLE001 - the stop goes on: the state is in memory
            if trainer.world_size > 1:
                # the other ranks may wait in the save's barrier, or have failed alike: which, only a collective could
                # tell, and one there would pair with that barrier. Raised, as Lightning's own save would
                raise
            # a state that does not pickle (a scheduler holding a lambda): the fit ended with this error, after the
            # weights had been restored, and no `stopped` alert was raised
            path = None
            where = (f"Its checkpoint could not be written ({type(err).__name__}: {err}); the model and optimizers in "
                     f"memory hold {state} when `fit` returns.")
        finally:
            self._saving_stop = False
        trainer.should_stop = True
        self.stop_checkpoint, self.stopped_step = path, step
        self.alert(step, "stopped", "info" if path is not None else "warning",
                   f"Training stopped at step {step} ({reasons}). {where}",
                   details={"step": step, "to_step": None if snap is None else snap.step, "checkpoint": path,
                            "reasons": reasons, "holds": state})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.idle_reason is None and self.stopped_step is None and not trainer.sanity_checking:
            self._judge_the_end(trainer, pl_module)
        super().on_train_end(trainer, pl_module)

    def _judge_the_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The fit's last steps, which no later step judges: the values still on their way to the host (``lag_steps``
        on an accelerator), and the last update, whose loss no step computed. The last normal batches are evaluated
        once more under the final weights (every rank, one reduction): their mean loss anomalous as a surge would be
        on a step of its own (beyond the loss's noise, above ``1 + surge`` times its recent level), or not finite, the
        last update(s) broke the weights, and the last good snapshot is restored and saved as by
        ``action="stop"`` (``"warn"``: the critical alert only). Before, a rate raised 50 times for the last step
        left weights at twice the healthy loss (4.08 against 2.07), and with ``lag_steps=2`` a raise 3 steps before
        the end left 6.80, without a word."""
        step = trainer.global_step - 1  # the last step trained
        if step < 0:
            return
        critical, first_bad = self._judge_ready(trainer, pl_module, self._read_ready(trainer.global_step, 0))
        if not critical:
            if self._unfaithful:
                return  # a replay does not give the step's loss (see _check_replay): no evidence either way
            refs = self._references(trainer.global_step)
            if not self.decide(trainer, bool(refs) and self._replayable(pl_module), all=True):
                return
            rates = [[group["lr"] for group in opt.param_groups] for opt in trainer.optimizers]
            now, then = self._replayed(trainer, pl_module, refs)
            if now is not None and not math.isfinite(now) and self._nonfinite_whatever_the_weights(
                    trainer, pl_module, refs):
                now = None  # the loss of the step after the last, not the weights, is non-finite: no evidence
            # the replay ran `training_step`, which may set the rates itself (held under a ceiling before each update,
            # but no update follows now): the rates the fit ended with are put back
            for opt, row in zip(trainer.optimizers, rates):
                for group, lr in zip(opt.param_groups, row):
                    group["lr"] = lr
            if now is None:
                return  # a replay gave no loss: nothing to judge by
            # judged as a surge would be on a step of its own: beyond the loss's noise and above (1 + surge) times its
            # recent level; before any history, above `blowup` times what the batches lost then
            watch = self._loss_watch
            bar = (1.0 + self.surge) * watch.level() if watch.ready else self.blowup * max(then, 1e-12)
            if math.isfinite(now) and not (now > bar and (not watch.ready or watch.zscore(
                    now, abs_floor=self.initial_floor * self._anchor()) > self.z_threshold)):
                return
            shown = f"{now:.4g}" if math.isfinite(now) else "a loss that is not finite"
            self.condition(
                step, "loss_explosion", True, "critical",
                f"Training ended at step {step}, and the last {len(refs)} normal batches, evaluated again under the "
                f"final weights, went from {then:.4g} to {shown}: the last update(s), which no later step judged, "
                "broke the weights. Lower the learning rate at the end of the run.",
                value=now, threshold=bar,
            )
            critical, first_bad = [f"loss explosion in the last update(s) (step {step})"], step + 1
        if self.action == "warn":
            return
        target = self._target_snapshot(trainer, step if first_bad is None else first_bad)
        self._stop(trainer, pl_module, step, target, "; ".join(critical) + "; at the end of training")

    def _checkpoint_dir(self, trainer: pl.Trainer) -> str:
        if self.dirpath is not None:
            return self.dirpath
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and getattr(ckpt, "dirpath", None):
            return str(ckpt.dirpath)
        return os.path.join(alerts_dir(trainer), "checkpoints")

    # ------------------------------------------------------------------ state
    def _reset_run_state(self) -> None:
        """A new Trainer: forget the histories, snapshots, rollbacks and learning-rate changes of the last run
        (the batches given to ``skip_batches`` stay). The constructor starts from here too."""
        super()._reset_run_state()
        # the loss series, the first losses (the initial level), the moving average, its minimum and its rates
        self._load_detector_state({})
        self._creep_start: Optional[int] = None
        self._climb_judged = False
        self._climb_after_rollback = False  # the climb being judged is a creep soon after a rollback
        self._creep_high = False  # the smoothed loss above halfway from its minimum to the creep limit
        # the tensors of the batch in its step and their in-place version counters then (see _batch_written); a step
        # found writing into its batch: each batch's tensors are kept as a copy
        self._batch_versions: Optional[list[tuple[Tensor, int]]] = None
        self._copy_batches = False
        # per-step values on their way to the host: (step, [loss, grad norm] (a tensor, or host floats on one CPU
        # process), copy-done event or None, no loss)
        self._ring: deque[tuple[int, Any, Any, bool]] = deque()
        self._restored: list[tuple[int, Optional[float], float]] = []  # buffered values restored from a checkpoint
        self._loss_acc: Optional[Tensor] = None
        self._step_batches = 0  # the batches started since the last optimizer step (manual accumulation)
        self._finite_grad_step: Optional[int] = None  # the last judged step whose gradient norm was finite
        self._judged_through = -1  # the last step judged
        self._refs_from = 0  # the first step whose batch may be a reference (see _new_normal)
        self._warned_replay = False  # a replay of `training_step` failed once (said once)
        self._replay_failed = False  # a replay failed since this was last cleared (see _restructured)
        # the first steps' replays checked against the steps' own losses (see _check_replay): how many are left to check,
        # and whether one differed (then the end of the fit is not judged by replays)
        self._faithful_checks = _FAITHFUL_CHECKS
        self._unfaithful = False
        self._warned_lost = False  # a replay wrote into a large tensor attribute, not put back (said once)
        self._batch_start: Optional[int] = None  # the optimizer step at the start of the current batch
        self._steps_per_batch = 1  # the most optimizer steps one batch made (manual optimization may make several)
        # several optimizers, `loss_rules=None`: whether they minimise one loss is read off the first batches
        self._losses_watched = False  # still reading
        self._one_loss_batches = 0  # batches so far that stepped every optimizer after all their backward passes
        self._one_loss_seen = True  # ... and none that did otherwise
        self._batch_stepped: set[int] = set()  # the optimizers stepped in this batch
        self._batch_interleaved = False  # a backward pass came after an optimizer step in this batch
        self._shared_loss = False  # found to be one loss: judged at each batch's first step
        self._world_size = 1  # the fit's (set at its start)
        # the step needs autograd itself (`torch.autograd.grad`: a gradient penalty, a physics-informed loss): its
        # replays run with gradients enabled (no backward, no update)
        self._replay_grad = False
        self._infinite_by_design: frozenset[str] = frozenset()  # buffers that hold infinities by design
        self._said_lr_overridden = False  # a rate set above the ceiling after on_train_batch_start (said once)
        # the first step of the current fit (set at the start of training): after a resume, or a second fit in the
        # same Trainer, the loss history goes on from a state whose weights that step still uses
        self._resume_step: Optional[int] = None
        # what the checkpoint this fit resumed from says of its own weights (see on_save_checkpoint): the last normal
        # batches before it, evaluated again with the weights saved; None where it does not say
        self._saved_weights: Optional[dict[str, Any]] = None
        self._saving_stop = False  # the stop's own checkpoint is being written (its state is a snapshot's)
        self._saving_replay = False  # a checkpoint's replays are running (a step that saves does not replay again)
        self._saved_verdict: Optional[tuple[int, Optional[dict[str, Any]]]] = None  # the last checkpoint's, by step
        for snap in self._snapshots:
            snap.discard()
        self._snapshots = []
        self._seen: list[tuple[int, int, int]] = []  # (step, epoch, batch_idx) since the oldest snapshot
        self._drop: Optional[TrainingSnapshot] = None  # the state before a batch whose update is undone
        self._verdict: Optional[tuple[int, list[str], Optional[int]]] = None  # a check's findings, acted on at batch end
        self._snapshot_files: list[dict[str, Any]] = []  # a checkpoint's snapshot files, adopted at train start
        self._recent_batches.clear()
        self._normal_recent.clear()
        self._refs_before = []
        self._lr_trace.clear()
        self._judged_lrs.clear()
        self._informative: deque[int] = deque(maxlen=64)  # the last normal steps whose loss was not 0
        # the last of them with their batches: (step, (batch, batch_idx), loss)
        self._informative_refs: deque[tuple[int, tuple[Any, int, Any], float]] = deque(maxlen=self._ref_batches or _REFERENCES)
        self._zero_losses = False  # whether a normal step of this fit lost exactly 0
        self._hard_batch: Optional[int] = None  # the last surge the weights were not to blame for
        self._misfit: Optional[str] = None  # why the newest snapshot asked for did not fit the run
        # (the rise's first step, the step of the newest snapshot that found its batch easy) where newer ones found it as
        # hard (see _attribute); read by the rollback for that rise
        self._easy_snapshot: Optional[tuple[int, int]] = None
        self._skip: set[tuple[int, int]] = set(self._skip_given)
        self._lr_scale = 1.0
        self._lr_ceiling: Optional[list[list[float]]] = None  # per optimizer and group, after a repeated divergence
        self._masked: set[str] = set()  # parameters whose pruning excused a rise of the loss (see _pruned)
        self._thawed: set[str] = set()  # parameters whose unfreezing excused a rise of the loss (see _unfrozen)
        self._external: list[Alert] = []
        self._external_warnings: dict[tuple[str, str, Optional[str]], Alert] = {}
        self.rollbacks, self.stop_checkpoint, self.stopped_step = [], None, None
        self._signed = False  # the loss went below 0 (see _signed_loss); not part of a snapshot: for good

    def _detector_state(self) -> dict[str, Any]:
        return {
            "loss": self._loss_watch.state_dict(),
            "initial": list(self._initial),
            "reanchor": None if self._reanchor is None else [self._reanchor[0], list(self._reanchor[1])],
            "creep": {"ema": self._ema, "weight": self._ema_weight, "min": self._ema_min, "warned_at": self._creep_warned_at},
            "lr_at_min": self._lr_at_min,
            "wd_at_min": _copy_rows(self._wd_at_min),
            "types_at_min": None if self._types_at_min is None else list(self._types_at_min),
            "lr_peak": _copy_rows(self._lr_peak),  # copies: the guard's own rows change in place
            "lr_low": _copy_rows(self._lr_low),
        }

    def _load_detector_state(self, state: dict[str, Any]) -> None:
        self._loss_watch.load_state_dict(state.get("loss", {}))
        self._initial = [float(x) for x in state.get("initial", [])]
        reanchor = state.get("reanchor")
        self._reanchor: Optional[tuple[float, list[float]]] = (
            None if reanchor is None else (float(reanchor[0]), [float(x) for x in reanchor[1]]))
        creep = state.get("creep", {})
        self._ema, self._ema_weight = creep.get("ema", 0.0), creep.get("weight", 0.0)
        self._ema_min = creep.get("min", math.inf)
        self._creep_warned_at = creep.get("warned_at", math.inf)
        # a snapshot's state: taken with the smoothed loss near its minimum and no creep episode open (one open when a
        # rollback restores it ended with it: judged on, it rolled the restored weights back again at the next step)
        self._creep_high = False
        self._creep_start, self._climb_judged = None, False
        self._plateau: Optional[tuple[int, float]] = None  # (step, smoothed loss) of the creep episode's last look
        self._lr_at_min = state.get("lr_at_min")
        self._wd_at_min: Optional[list[list[Optional[float]]]] = _copy_rows(state.get("wd_at_min"))
        types = state.get("types_at_min")
        self._types_at_min: Optional[list[str]] = None if types is None else list(types)

        # per optimizer and group: the highest rate at a normal step, and the lowest since (see _lr_restart)
        self._lr_peak: Optional[list[list[Optional[float]]]] = _copy_rows(state.get("lr_peak"))
        self._lr_low: Optional[list[list[Optional[float]]]] = _copy_rows(state.get("lr_low"))
        self._lr_noted: Optional[list[list[Optional[float]]]] = None  # the rates last noted (skip when unchanged)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(self._detector_state())
        state.update(
            pending=self._restored + self._values_to_host(self._ring),
            rollbacks=[dict(r) for r in self.rollbacks],
            skip=sorted([e, b] for e, b in self._skip),
            lr_scale=self._lr_scale,
            lr_ceiling=self._lr_ceiling,
            stop_checkpoint=self.stop_checkpoint,
            stopped_step=self.stopped_step,
            signed_loss=self._signed,
            snapshot_files=[
                {"step": s.step, "epoch": s.epoch, "lr_scale": s.lr_scale, "path": s.path, "guard": s.guard}
                for s in self._snapshots if s.path is not None
            ],
        )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._load_detector_state(state_dict)
        self._restored = [(int(s), loss, g) for s, loss, g in state_dict.get("pending", [])]
        self._ring = deque()
        self.rollbacks = [dict(r) for r in state_dict.get("rollbacks", [])]
        self._skip |= {(int(e), int(b)) for e, b in state_dict.get("skip", [])}
        self._lr_scale = float(state_dict.get("lr_scale", 1.0))
        self._lr_ceiling = state_dict.get("lr_ceiling")
        self.stop_checkpoint = state_dict.get("stop_checkpoint")
        self.stopped_step = state_dict.get("stopped_step")
        self._signed = bool(state_dict.get("signed_loss", False))
        self._snapshot_files = [dict(f) for f in state_dict.get("snapshot_files", [])]
        verdict = state_dict.get("saved_weights")
        self._saved_weights = dict(verdict) if isinstance(verdict, dict) else None

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """A checkpoint also says whether the weights it holds are sound: the last update before it was made after the
        last loss the guard judged, and a run resumed from it cannot tell new data from weights that update broke
        (it took a checkpoint saved right after a bad update for a data shift, made the diverged level its normal, and
        later rolled back to those weights). The last normal batches are evaluated again with the weights saved
        (``saved_weights``: their mean loss now and when they were trained on), in the modes they were trained in.
        Every rank calls this hook: the replays' losses are averaged over the ranks."""
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        saved = checkpoint.get("callbacks", {}).get(self.state_key)
        if (not isinstance(saved, dict) or self.idle_reason is not None or self._saving_stop or not self.attribute
                or self._saving_replay):
            return  # (a `training_step` that saves a checkpoint itself: its replay here does not save again)
        if trainer.state.fn != "fit" or not self._replayable(pl_module):
            return
        step = trainer.global_step
        cached = self._saved_verdict
        if cached is not None and cached[0] == step:  # a second file at the same step (`save_last` beside every n)
            if cached[1] is not None:
                saved["saved_weights"] = dict(cached[1])
            return
        refs = self._references(step)[-_REFERENCES:]
        if not refs:
            return
        # the modes the batches were trained in: the module's own, or, written at the end of a validation, those the
        # validation loop put aside (a submodule the user keeps in eval mode, a frozen BatchNorm, stays so: switched to
        # training mode, the replays lost 134 for 0.28 and a resume on new data was stopped); else no replay
        training = getattr(getattr(getattr(trainer.fit_loop.epoch_loop, "val_loop", None), "_module_mode", None), "mode",
                           None) if not pl_module.training else None
        if not pl_module.training and not training:
            return
        modes = [(m, m.training) for m in pl_module.modules()] if training else []
        for name, m in (pl_module.named_modules() if training else ()):
            if name in training:
                m.training = training[name]
        self._saving_replay = True
        verdict: Optional[dict[str, Any]] = None
        try:
            now, then = self._replayed(trainer, pl_module, refs)
            if now is not None and not self._objective_since(trainer, pl_module, step, refs, now, then):
                verdict = {"step": step, "now": now, "then": then, "batches": len(refs)}
        finally:
            self._saving_replay = False
            for m, mode in modes:
                m.training = mode
        self._saved_verdict = (step, verdict)
        if verdict is not None:
            saved["saved_weights"] = dict(verdict)

    def _objective_since(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int,
                         refs: list[tuple[tuple[Any, int, Any], float]], now: float, then: float) -> bool:
        """Whether batches that lose far more with the weights saved than when trained on lose as much with the newest
        snapshot's weights, known good: then the step computes another loss now (a term switched on at the very step
        the checkpoint was written: a healthy resume from it was stopped), not weights that broke. Asked only when the
        replays read the weights as broken (``blowup`` times), as ``_objective_changed`` asks during a fit."""
        if not math.isfinite(now) or now <= self.blowup * max(then, 1e-12):
            return False
        return self._snapshot_sees_rise(trainer, pl_module, step, [b for b, _ in refs], then, now) is not None

    def _snapshot_sees_rise(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int,
                            batches: list[tuple[Any, int, Any]], then: float, now: float
                            ) -> Optional[tuple[TrainingSnapshot, float]]:
        """``(snapshot, its loss)`` when the newest snapshot known good (up to the last step that vouched for a state
        before ``step``) finds ``batches`` at least half as much harder as the present weights do (``now`` against
        ``then``, what they lost when trained on), both above ``then`` and above its own level when it was taken: the
        step computes another loss, not weights that broke; else ``None``. Its own level, because an old snapshot (the
        untrained weights of step 0, with checks 50 steps apart) loses more on recent batches anyway, and a divergence
        was taken for a new loss function; weights known good, because weights already broken (taken while every
        batch lost 0) found the batches as hard too."""
        vouched = self._vouched(step)
        snap = next((s for s in self._hard_batch_first([s for s in reversed(self._snapshots) if s.step <= vouched])
                     if s.mismatch(trainer) is None), None)
        if snap is None or not self._replayable(pl_module):
            return None
        (before,) = self._under_snapshots(pl_module, [snap], lambda: self._mean_loss(trainer, pl_module, batches))
        if before is None or not math.isfinite(before) or before - then < 0.5 * (now - then):
            return None
        own = self._own_level(snap)
        if own is not None and before - own < 0.5 * (now - then):
            return None
        return snap, before

    def _own_level(self, snap: TrainingSnapshot) -> Optional[float]:
        """The loss level of the run when ``snap`` was taken: the median of its recent losses, or, for the state the fit
        started from (no loss judged yet), the run's initial losses; ``None`` where neither is known."""
        history = ((snap.guard or {}).get("loss") or {}).get("history") or []
        if history:
            return median(history[-_REFERENCES * 4:])
        return median(self._initial) if self._initial else None

    def _saved_broken(self, loss: Optional[float] = None, level: Optional[float] = None) -> bool:
        """Whether the checkpoint this fit resumed from said that its weights were broken when it was saved: the last
        normal batches before it lost at least ``blowup`` times what they lost when trained on (or a non-finite loss)
        and, given the rise now (``loss`` against ``level``), at least half as much more, as the surge test asks (a
        run near a loss of 0 moves by a few times on one healthy update, and new data after the resume then read as
        the weights' rise)."""
        v = self._saved_weights
        if v is None or v.get("step") != self._resume_step:
            return False
        now, then = float(v["now"]), float(v["then"])
        if not math.isfinite(now):
            return True
        if now <= self.blowup * max(then, 1e-12):
            return False
        return loss is None or level is None or not math.isfinite(loss) or now - then >= 0.5 * (loss - level)

    def _saved_broken_reason(self, step: int, loss: float, level: float) -> list[str]:
        """The critical alert for a rise at the first step after resuming from a checkpoint whose weights were broken
        when it was saved (:meth:`_saved_broken`)."""
        v = self._saved_weights or {}
        self.condition(
            step, "loss_explosion", True, "critical",
            f"The loss rose to {loss:.4g} at step {step}, the first step after resuming from a checkpoint (level about "
            f"{level:.4g}). When that checkpoint was saved, its weights lost {float(v['now']):.4g} on the last "
            f"{v['batches']} normal batches before it, which had lost {float(v['then']):.4g} when trained on: the "
            "update saved last in it, made after the last loss the guard judged, broke the weights. Resume from an "
            "earlier checkpoint (and lower the learning rate).",
            value=loss, threshold=level,
        )
        return [f"loss explosion at step {step}: the checkpoint resumed from holds weights its last update broke"]

    def _adopt_snapshot_files(self, trainer: pl.Trainer) -> None:
        """After a resume: take over the checkpoint's snapshot files that every rank still has (each rank's own
        file, named by its rank). One boolean reduction per file listed (at most ``keep_snapshots`` + 1)."""
        files, self._snapshot_files = self._snapshot_files, []
        rank = trainer.global_rank
        for meta in sorted(files, key=lambda f: f["step"]):
            if any(s.step == meta["step"] for s in self._snapshots):
                continue
            name = re.sub(r"-rank\d+-", f"-rank{rank}-", os.path.basename(meta["path"]))
            path = os.path.join(os.path.dirname(meta["path"]), name)
            if not self.decide(trainer, os.path.isfile(path), all=True):
                continue
            snap = TrainingSnapshot(step=int(meta["step"]), epoch=int(meta["epoch"]), lr_scale=float(meta["lr_scale"]),
                                    path=path, guard=dict(meta.get("guard") or {}))
            self._snapshots.append(snap)
        self._snapshots.sort(key=lambda s: s.step)
        if self._snapshots:
            rank_zero_info(f"DivergenceGuard: resumed with the snapshot(s) of step(s) "
                           f"{', '.join(str(s.step) for s in self._snapshots)} from `snapshot_dir`.")

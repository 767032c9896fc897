"""GradientNoiseScaleMonitor: the gradient noise scale B_simple and the batch size it suggests.

``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al., arXiv 1812.06162) estimates the critical batch
size: well below it, a larger batch gives nearly proportionally faster progress per step; well above
it, most of each batch is wasted. It needs gradient squared norms at two batch sizes; this callback
gets them, on due steps only, in one of three ways:

* ``"per_example"``: exact per-example gradient norms from :class:`~lightning_monitor.probes.per_example.PerExampleGradNorms`
  hooks in the ordinary backward (``B_small = 1``) and the batch gradient (``B_big`` = global batch);
* ``"ddp"``: each rank's local gradient, read by a DDP communication hook before the all-reduce
  (``B_small`` = per-rank batch) and the reduced gradient (``B_big`` = global batch); free but >= 2 ranks;
* ``"accumulation"``: each micro-batch's gradient, read by a gradient hook on every parameter before it
  is accumulated (``B_small`` = micro-batch), and the accumulated gradient (``B_big``).

All norms are read in ``on_before_optimizer_step``: before gradient clipping, in fp32, divided by the
loss scale squared under a dynamic AMP scaler and rescaled for Lightning's division of the loss by
``accumulate_grad_batches``. Steps with non-finite estimates are skipped. ``|G|^2`` and ``tr(Sigma)``
are smoothed separately by a bias-corrected EMA and ``B_simple`` is their ratio.

On several ranks every rank's batch size is reduced with the norms (in the ``"ddp"`` method's all-reduce; one
all-reduce of three floats per check for the others), so ranks whose batches differ in size (a sampler of one's own,
an epoch's short last batch on some ranks only) get unbiased estimates: DDP's mean of the ranks' mean gradients counts
as ``R^2 / sum_r 1 / n_r`` examples, the ranks' local gradients as their harmonic mean.
"""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from collections import defaultdict
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor, nn

from lightning_monitor._args import check_bool, deprecated_aliases
from lightning_monitor._compat import batches_per_epoch
from lightning_monitor.callbacks.base import Monitor, NothingToWatch
from lightning_monitor.functional.noise_scale import NoiseScaleEMA, noise_scale_estimates
from lightning_monitor._sharded import fsdp_units, is_sharded, local, replication, reshard
from lightning_monitor.probes.per_example import PerExampleGradNorms
from lightning_monitor.selection import Patterns, as_patterns, select_modules

__all__ = ["GradientNoiseScaleMonitor"]

log = logging.getLogger(__name__)

Method = Literal["auto", "per_example", "ddp", "accumulation"]
_METHODS = ("auto", "per_example", "ddp", "accumulation")


def _sq_norms(tensors: list[Tensor]) -> Tensor:
    """Squared L2 norm of each tensor, fp32, stacked (one kernel per dtype/device group). A sparse
    gradient (``nn.Embedding(sparse=True)``) is coalesced first (its duplicate entries are summands)."""
    if not tensors:
        return torch.zeros(0)
    if any(t.is_sparse for t in tensors):
        return torch.stack([
            t.coalesce().values().float().pow(2).sum() if t.is_sparse else t.float().pow(2).sum() for t in tensors
        ])
    from lightning_monitor._compat import foreach_norm

    try:
        norms = foreach_norm(tensors, 2.0, dtype=torch.float32)
    except (TypeError, RuntimeError):  # older torch without dtype=
        norms = [torch.linalg.vector_norm(t.float()) for t in tensors]
    return torch.stack(list(norms)).pow(2)


_Small = tuple[list[str], dict[str, Tensor], float, float]


def _layer_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


#: consecutive checks with B_simple undefined before the monitor says so (``b_simple_undefined``)
_UNDEFINED_CHECKS = 5
#: the share of the gradient's squared norm the estimate must cover for batch-size advice (see ``_batch_alerts``)
_ADVICE_COVERAGE = 0.5


class GradientNoiseScaleMonitor(Monitor):
    """Logs the gradient noise scale ``B_simple`` and alerts when the batch size is far from it.

    It measures the parameters that require a gradient. When that set changes during the run
    (:class:`~lightning_monitor.GradientEarlyStopping` froze a component, a resumed run re-froze them,
    a layer was unfrozen), the next due step re-reads it before arming its hooks; the estimate and
    ``gns/<layer>/b_simple`` keys then describe the parameters still trained.

    Args:
        method: ``"auto"`` (``"ddp"`` with >= 2 ranks, else ``"accumulation"`` when
            ``accumulate_grad_batches > 1``, else ``"per_example"``), ``"per_example"``, ``"ddp"`` or
            ``"accumulation"``.
        every_n_steps: check every this many optimizer steps.
        warmup_steps: no check before this optimizer step.
        smoothing: EMA factor of the smoothed ``|G|^2`` and ``tr(Sigma)``, in [0, 1) (per check, not per
            step: ``m = smoothing * m + (1 - smoothing) * x``, bias-corrected). Deprecated alias: ``beta``.
        per_layer: also log ``gns/<layer>/b_simple`` for every layer with trainable parameters.
        include, exclude: glob patterns on module names restricting the per-layer keys (and, for
            ``"per_example"``, the modules hooked).
        alert_ratio: an info alert when the global batch size is below ``B_simple / alert_ratio`` or
            above ``B_simple * alert_ratio`` (> 1).
        min_checks: checks smoothed before the first batch-size alert.
        loss_reduction: ``"mean"`` if the training loss is averaged over the examples of the batch (Lightning's
            default losses), ``"sum"`` if summed: every method reads gradients of the loss, and the noise scale is
            defined on mean gradients (with ``"sum"`` the logged ``g2`` and ``trace_sigma`` are those of the mean
            gradient, as with ``"mean"``).
        linear_strategy: for ``"per_example"``: see :class:`~lightning_monitor.probes.per_example.PerExampleGradNorms`
            (``"auto"``, ``"fused"``, ``"gram"``, ``"materialize"``).
        min_coverage: for ``"per_example"``: below this share of the gradient's squared norm covered by
            per-example norms (in (0, 1]), the estimate is marked partial (``gns/partial`` = 1, and the
            coverage alert says so).
        batch_dims: for ``"per_example"``: glob patterns of qualified module names -> the dimension of the module's
            input that holds the batch (``None``: it has none, the module is left out), declared instead of found
            by the probe (see :class:`~lightning_monitor.probes.per_example.PerExampleGradNorms`); the first
            matching pattern applies. E.g. ``{"net.encoder.*": 1, "*": 0}`` for an encoder run sequence-first
            ``[T, B, d]`` whose output the model cannot tell apart.

    **Coverage.** ``gns/coverage`` is logged at every check: the share of the batch gradient's squared
    norm ``sum_covered |G_p|^2 / sum_all |G_p|^2`` carried by the parameters whose per-example norms are
    measured (1 for ``"ddp"`` and ``"accumulation"``, which measure every trainable parameter), and
    ``gns/partial`` (1 when the coverage is below ``min_coverage``). The first check that finds
    parameters left out (no per-example rule for their module, such as BatchNorm; an input without a
    separable batch dimension, such as positions broadcast over the batch) names them by module with the
    reason and the share they carry: in a ``partial_coverage`` warning alert when the coverage is below
    ``min_coverage``, else in a console warning (the estimate stands; a healthy run raises no alert); a
    check that finds new ones says so again, and so does the first check whose estimate turns partial (the
    share of the same parameters grew). ``B_simple`` is then that of the covered parameters; below half of the
    squared norm it gives no batch-size advice (``advice_withheld``, info). When the
    first backward finds that they cover nothing (no module's rows are the batch's examples), every check logs
    a coverage of 0 with ``gns/partial`` 1 and estimates nothing, and one ``partial_coverage`` warning names
    every module with its reason.

    A model with nothing to measure (no trainable parameter, or none that per-example hooks cover), or
    one trained by several optimizers (checked when the fit starts: their losses would mix in one
    estimate), raises :class:`~lightning_monitor.callbacks.base.NothingToWatch`, or, with
    ``idle_when_nothing_to_watch`` set (the preset sets it), says so in one warning alert and stays idle.

    The monitor never stops or changes the run (it has no ``stop``); its alerts are advice (info), the
    coverage alert a warning.
    """

    name = "gns"

    @deprecated_aliases(beta="smoothing")
    def __init__(
        self,
        method: Method = "auto",
        every_n_steps: int = 10,
        warmup_steps: int = 0,
        smoothing: float = 0.9,
        per_layer: bool = True,
        include: Patterns = None,
        exclude: Patterns = None,
        alert_ratio: float = 10.0,
        min_checks: int = 5,
        loss_reduction: Literal["mean", "sum"] = "mean",
        linear_strategy: Literal["auto", "fused", "gram", "materialize"] = "auto",
        min_coverage: float = 0.9,
        batch_dims: Optional[dict[str, Optional[int]]] = None,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, warmup_steps=warmup_steps)
        if method not in _METHODS:
            raise ValueError(f"`method` must be one of {_METHODS}, got {method!r}.")
        if not (isinstance(smoothing, (int, float)) and 0.0 <= smoothing < 1.0):
            raise ValueError(f"`smoothing` must be a float in [0, 1), got {smoothing!r}.")
        if not (isinstance(alert_ratio, (int, float)) and alert_ratio > 1.0):
            raise ValueError(f"`alert_ratio` must be a number > 1 (e.g. 10 for a factor of ten), got {alert_ratio!r}.")
        if isinstance(min_checks, bool) or not isinstance(min_checks, int) or min_checks < 1:
            raise ValueError(f"`min_checks` must be an integer >= 1, got {min_checks!r}.")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"`loss_reduction` must be 'mean' or 'sum', got {loss_reduction!r}.")
        if linear_strategy not in ("auto", "fused", "gram", "materialize"):
            raise ValueError(
                f"`linear_strategy` must be 'auto', 'fused', 'gram' or 'materialize', got {linear_strategy!r}."
            )
        if isinstance(min_coverage, bool) or not isinstance(min_coverage, (int, float)) or not 0.0 < min_coverage <= 1.0:
            raise ValueError(f"`min_coverage` must be a number in (0, 1], got {min_coverage!r}.")
        if batch_dims is not None and not (isinstance(batch_dims, dict) and all(
            isinstance(k, str) and (v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0))
            for k, v in batch_dims.items()
        )):
            raise ValueError(
                "`batch_dims` must map module name patterns to the input dimension holding the batch (an integer "
                f">= 0) or None (no batch dimension), e.g. {{'encoder.*': 1}}; got {batch_dims!r}."
            )
        self.batch_dims = dict(batch_dims or {})
        self.min_coverage = float(min_coverage)
        self.method: Method = method
        self.smoothing = float(smoothing)
        self.per_layer = check_bool("per_layer", per_layer)
        self.include = as_patterns(include, "include")
        self.exclude = as_patterns(exclude, "exclude")
        self.alert_ratio = float(alert_ratio)
        self.min_checks = min_checks
        self.loss_reduction = loss_reduction
        self.linear_strategy = linear_strategy

        self._reset_run_state()

    def _reset_runtime(self) -> None:
        self._probe: Optional[PerExampleGradNorms] = None
        self._params: dict[str, nn.Parameter] = {}  # trainable, by name
        self._layers: dict[str, list[str]] = {}  # layer -> param names, per-layer keys
        self._examples = 0  # local examples seen in the armed step
        self._micro_batches = 0
        self._micro_sizes: list[int] = []
        self._small: dict[str, Tensor] = {}  # accumulation / ddp: per-param sum of small-batch sq norms
        self._unclipped: Optional[dict[str, Tensor]] = None  # manual optimization: the due step's norms before clipping
        self._ddp_registered = False
        self._module: Optional[nn.Module] = None  # the model, to re-read the trainable set at arming
        self._fsdp_units: list[nn.Module] = []
        self._flags: tuple[tuple[int, bool], ...] = ()  # each parameter (identity, requires_grad) when last selected
        self._measurable = False  # something trainable is measured (else checks are skipped)
        self._lazy = True  # parameters may still be uninitialized (lazy modules) until a due step finds none
        self._batch_start = 0  # the optimizer step at the start of the current batch
        self._measured: set[str] = set()  # the parameters measured at this check
        self._selected: set[str] = set()  # modules selected by include / exclude
        self._sizes: Optional[Tensor] = None  # at a check on several ranks: their sizes, averaged (_size_entries)
        self._small_apart: Optional[dict[str, Tensor]] = None  # "ddp", summed losses: each rank's norms as its own mean

    @property
    def beta(self) -> float:
        """Deprecated: the attribute is :attr:`smoothing`."""
        warnings.warn("`GradientNoiseScaleMonitor.beta` is deprecated: use `.smoothing`.", DeprecationWarning, stacklevel=2)
        return self.smoothing

    def _state_key(self) -> str:
        return self._generate_state_key(
            method=self.method, every_n_steps=self.every_n_steps, warmup_steps=self.warmup_steps,
            include=self.include, exclude=self.exclude,
        )

    @property
    def _legacy_state_key(self) -> str:  # type: ignore[override]
        # the key of checkpoints written before the selection was part of it (Lightning's fallback key)
        return self._generate_state_key(method=self.method, every_n_steps=self.every_n_steps, warmup_steps=self.warmup_steps)

    def _reset_run_state(self) -> None:
        super()._reset_run_state()
        self.ema = NoiseScaleEMA(self.smoothing)
        self._ema_names: Optional[set[str]] = None  # the parameters the model-wide averages cover (None: unknown)
        # the parameter objects behind those names (None: unknown, after a state was loaded): a layer replaced under
        # the same name (a hidden layer widened) is another set of parameters
        self._ema_refs: Optional[dict[str, Any]] = None
        self._compare_selection = False
        self._selection_why: Optional[str] = None  # why the selection changed since the last check
        self._undefined = 0  # consecutive checks without B_simple
        self.layer_ema: dict[str, NoiseScaleEMA] = {}
        self.resolved_method: Optional[str] = None
        # what was said once in this run (kept in checkpoints: a resumed run does not say it again)
        self._reported: set[str] = set()  # uncovered parameters named in a coverage alert
        self._said_partial = False  # a partial estimate was said (in an alert)
        self._warned_single = False  # a check without two batch sizes was said
        self._single_run = 0  # consecutive checks without two batch sizes
        # batch-size advice waits until the average holds this many checks (after a rollback: min_checks of the run
        # that goes on from the state restored)
        self._advice_from = 0
        self._rolled_back = False  # a rollback since the last check
        # the batch size of the last check on a batch that was not its epoch's last: what the advice is about (an
        # epoch's short last batch is not the batch size in use)
        self._batch_in_use: Optional[float] = None
        self._reset_runtime()

    # ------------------------------------------------------------------ state
    # each rank's own: the small-batch estimate comes from the rank's own examples (see docs/distributed.md)
    _rank_local = ("conditions", "ema", "layer_ema")

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["ema"] = self.ema.state_dict()
        state["layer_ema"] = {k: v.state_dict() for k, v in self.layer_ema.items()}
        # what the model-wide averages cover: a resumed run re-freezes GradES's components after the setup's selection,
        # and its first check must not take that for a change of what is measured
        state["ema_names"] = None if self._ema_names is None else sorted(self._ema_names)
        state["said"] = {"reported": sorted(self._reported), "partial": self._said_partial,
                         "single": self._warned_single}
        # the checks in a row without B_simple (b_simple_undefined is said after a few): a resumed run goes on counting
        # (it counted from 0 again: the alert came 30 steps late, or not at all)
        state["undefined"] = self._undefined
        state["batch_in_use"] = self._batch_in_use
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "ema" in state_dict:
            self.ema.load_state_dict(state_dict["ema"])
        self.layer_ema = {}
        for k, v in state_dict.get("layer_ema", {}).items():
            ema = NoiseScaleEMA(self.smoothing)
            ema.load_state_dict(v)
            self.layer_ema[k] = ema
        names = state_dict.get("ema_names")
        self._ema_names = None if names is None else set(names)
        self._ema_refs = None  # the objects are not saved: the names are compared
        # a state restored mid-run (the guard's rollback, which keeps GradES's frozen set) may average another set of
        # parameters than the one measured now: compared at the next check
        self._compare_selection = True
        self._undefined = int(state_dict.get("undefined", 0))
        in_use = state_dict.get("batch_in_use")
        self._batch_in_use = None if in_use is None else float(in_use)
        said = state_dict.get("said") or {}
        self._reported = set(said.get("reported", ()))
        self._said_partial = bool(said.get("partial", False))
        self._warned_single = bool(said.get("single", False))

    # ------------------------------------------------------------------ setup
    def select(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_monitor._sharded import check_strategy

        check_strategy(trainer, "GradientNoiseScaleMonitor",
                       "the squared norm of the whole gradient cannot be read from each rank's flat gradient shard")
        self._reset_runtime()
        self.hub.subscribe(self._on_alert)
        world = trainer.world_size
        accumulate = trainer.accumulate_grad_batches
        method = self.method
        model_parallel = type(trainer.strategy).__name__ == "ModelParallelStrategy"
        if method == "auto":
            if model_parallel:  # FSDP2: no DDP communication hook to read the local gradient
                method = "accumulation" if accumulate > 1 else "per_example"
            else:
                method = "ddp" if world >= 2 else ("accumulation" if accumulate > 1 else "per_example")
        if model_parallel:
            self._check_model_parallel(trainer, method)
        if method == "ddp":
            if world < 2:
                raise ValueError(
                    "GradientNoiseScaleMonitor(method='ddp') needs >= 2 data-parallel ranks (got world size "
                    f"{world}); use method='per_example', or 'accumulation' with accumulate_grad_batches > 1."
                )
            from lightning.pytorch.strategies import DDPStrategy

            if not isinstance(trainer.strategy, DDPStrategy):
                raise ValueError(
                    f"GradientNoiseScaleMonitor(method='ddp') needs a DDP strategy ('ddp' or 'ddp_spawn'), got "
                    f"{type(trainer.strategy).__name__}; use method='per_example' (works under any strategy)."
                )
            from lightning_monitor._compat import ddp_comm_hook

            if self._planned_accumulation(trainer) > 1 and ddp_comm_hook(trainer.strategy) is not None:
                raise ValueError(
                    "GradientNoiseScaleMonitor(method='ddp') with gradient accumulation registers its own DDP "
                    "communication hook, but the strategy already has `ddp_comm_hook`; remove it or use "
                    "method='per_example'."
                )
        if method == "accumulation" and self._planned_accumulation(trainer) < 2:
            raise ValueError(
                "GradientNoiseScaleMonitor(method='accumulation') needs Trainer(accumulate_grad_batches >= 2) or a "
                f"GradientAccumulationScheduler that accumulates (got {self._planned_accumulation(trainer)}); use "
                "method='per_example' instead."
            )
        self.resolved_method = method

        self._module = pl_module
        reason = self._select(pl_module, initial=True)
        if reason is not None:
            raise NothingToWatch(reason)

    @staticmethod
    def _planned_accumulation(trainer: pl.Trainer) -> int:
        """The most micro-batches a step will accumulate in this fit: ``accumulate_grad_batches``, or the largest
        factor of a ``GradientAccumulationScheduler``, which sets the Trainer's only as each epoch starts (at setup
        the Trainer says 1, and the scheduler forbids setting it)."""
        from lightning.pytorch.callbacks import GradientAccumulationScheduler

        planned = [int(v) for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)
                   for v in c.scheduling.values()]
        return max([int(trainer.accumulate_grad_batches), *planned])

    @staticmethod
    def _check_model_parallel(trainer: pl.Trainer, method: str) -> None:
        """Refuse at setup what cannot be measured under ModelParallelStrategy (FSDP2 / tensor parallel)."""
        if method == "ddp":
            raise ValueError(
                "GradientNoiseScaleMonitor(method='ddp') reads each rank's gradient in a DDP communication hook, "
                "which FSDP2 (ModelParallelStrategy) does not have: its gradients are reduce-scattered. Use "
                "method='per_example' (per-example norms from this rank's activations, reduced as scalars)."
            )
        if method == "accumulation":
            raise ValueError(
                "GradientNoiseScaleMonitor(method='accumulation') is not supported under ModelParallelStrategy: "
                "FSDP2 reduce-scatters every micro-batch's gradient, so the small-batch (local) gradient is never "
                "seen. Use method='per_example'."
            )
        tp = getattr(trainer.strategy, "_tensor_parallel_size", 1)
        if isinstance(tp, int) and tp > 1:
            raise ValueError(
                f"GradientNoiseScaleMonitor(method='per_example') under tensor parallelism (tensor_parallel_size={tp}) "
                "is not supported: the per-example norms are computed from each layer's input and output gradient, "
                "which tensor parallel layers hold sharded. Use data_parallel only (tensor_parallel_size=1)."
            )

    def _sq_norms_global(self, trainer: pl.Trainer, parts: list[list[Tensor]]) -> list[Tensor]:
        """:func:`_sq_norms` of each list in ``parts``; with DTensor gradients (FSDP2) from the local shards
        (over their replication count), a plain gradient over the world size, summed across ranks in one
        all-reduce of one float per tensor: the squared norms of the full gradients, on every rank."""
        flat = [t for part in parts for t in part]
        if not any(t is not None and is_sharded(t) for t in flat):
            return [_sq_norms(part) for part in parts]
        world = max(trainer.world_size, 1)
        present = [t for t in flat if t is not None]
        device = local(present[0]).device
        # a parameter without a gradient on this rank (None) adds 0 at its place
        vec = _sq_norms([local(t).detach() if t is not None else torch.zeros((), device=device) for t in flat])
        div = torch.tensor([float(replication(t)) if t is not None and is_sharded(t) else float(world) for t in flat],
                           device=vec.device)
        vec = trainer.strategy.reduce(vec / div, reduce_op="sum") if world > 1 else vec / div
        out, at = [], 0
        for part in parts:
            out.append(vec[at:at + len(part)])
            at += len(part)
        return out

    @staticmethod
    def _trainable_flags(pl_module: nn.Module) -> tuple[tuple[int, bool], ...]:
        # each parameter's identity too: a layer replaced mid-run (a hidden layer widened, a block stacked, a vocabulary
        # resized) kept the old layer's probe and parameters, and the new one went unmeasured for the rest of the run
        return tuple((id(p), p.requires_grad) for p in pl_module.parameters())

    def _select(self, pl_module: nn.Module, initial: bool) -> Optional[str]:
        """Read what this monitor measures: the trainable parameters, the per-example probe over them and
        the per-layer groups. At setup, and again at arming when ``requires_grad`` flags changed since (a
        parameter frozen by GradientEarlyStopping or by the user, or unfrozen): no hook is registered on a
        parameter that no longer requires a gradient, and newly trainable ones are measured too. Mid-run,
        nothing left to measure is not an error: checks are skipped until something is. Returns why
        nothing can be measured at setup, else ``None``."""
        # FSDP2 units that hold their gathered parameters after a validation loop: the sharded ones, which receive the
        # gradients, registered again first (a probe built over the gathered ones left the root unit's parameters out,
        # and the averages restarted after every validation)
        self._fsdp_units = fsdp_units(pl_module)
        reshard(self._fsdp_units)
        self._flags = self._trainable_flags(pl_module)
        self._probe = None
        self._probe_reads = 0  # the checks that read the probe since it was built
        self._layers = {}
        self._measurable = False
        self._lazy = True
        self._params = {n: p for n, p in pl_module.named_parameters() if p.requires_grad}
        if not self._params:
            if initial:
                return "the model has no trainable parameters."
            log.info("GradientNoiseScaleMonitor: no trainable parameter is left; checks are skipped.")
            return None
        selected = self._selected_layers(pl_module)
        self._selected = selected
        if self.resolved_method == "per_example":
            probe = PerExampleGradNorms(
                pl_module,
                loss_reduction=self.loss_reduction,
                linear_strategy=self.linear_strategy,
                include=(lambda name, mod: name in selected) if (self.include or self.exclude) else None,
                batch_dims=self.batch_dims,
            )
            if not probe.covered:
                if initial:
                    return (
                        "method='per_example': no parameter of the model is covered by per-example hooks "
                        f"(uncovered: {probe.uncovered[:8]}); use method='ddp' or 'accumulation', or widen `include`."
                    )
                log.info(
                    "GradientNoiseScaleMonitor: no trainable parameter left is covered by per-example hooks "
                    "(uncovered: %s); checks are skipped.", ", ".join(probe.uncovered[:6]),
                )
                return None
            self._probe = probe
            self._probe_reads = 0
            names = probe.covered
        else:
            names = list(self._params)
        self._measurable = True
        if initial and not self.ema.count:
            self._ema_names = set(names)
            self._ema_refs = self._refs(names)
        if self.per_layer:
            layers: dict[str, list[str]] = defaultdict(list)
            for n in names:
                if _layer_of(n) in selected:
                    layers[_layer_of(n)].append(n)
            self._layers = dict(layers)
        return None

    def _measured_names(self) -> set[str]:
        """The parameters the estimate covers under the present selection."""
        if not self._measurable:
            return set()
        return set(self._probe.covered) if self._probe is not None else set(self._params)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_ema_refs"] = None  # weak references do not pickle; a copy compares the names only
        return state

    def _refs(self, names: Any) -> dict[str, Any]:
        """Weak references to the parameters named (a replaced parameter is told apart even where its successor
        takes the freed one's address)."""
        return {n: weakref.ref(self._params[n]) for n in names if n in self._params}

    def _restart_on_new_selection(self, step: int, why: str) -> None:
        """At a check: when the parameters measured are not those the averages cover (a component frozen or unfrozen,
        a state restored from before such a change, a layer found not separable as it ran), the averages of the
        estimates start again (model-wide; the per-layer averages of layers no longer measured are dropped). Averaged
        on, the checks of the old set held the model-wide B_simple at several times that of the parameters still
        trained for about ten checks after GradES froze most of a model (6044 against 1533)."""
        after = self._measured_names()
        averaged = self._ema_names if self._ema_names is not None else after
        refs = self._ema_refs or {}
        replaced = {n for n in after & averaged if n in refs and refs[n]() is not self._params.get(n)}
        if (after == averaged and not replaced) or not self.ema.count:
            self._ema_names, self._ema_refs = after, self._refs(after)
            return
        self.ema = NoiseScaleEMA(self.smoothing)  # batch-size advice waits for min_checks checks of the new set
        self._ema_names, self._ema_refs = after, self._refs(after)
        self._advice_from = 0
        # the layers no longer measured, and those whose measured parameters changed (one frozen, a layer replaced)
        changed = {_layer_of(n) for n in (averaged ^ after) | replaced}
        for layer in [k for k in self.layer_ema if k not in self._layers or k in changed]:
            del self.layer_ema[layer]
        gone, new = len(averaged - after), len(after - averaged)
        if replaced:
            why = f"{len(replaced)} replaced by new parameters under the same names; {why}"
        self.alert(
            step, "averages_restarted", "info",
            f"The noise scale's averages start again at step {step}: the parameters it measures changed ({gone} no "
            f"longer trained or measured, {new} newly so: {why}), and the averages of the "
            f"other set would have mixed in another model's noise scale. Batch-size advice waits for {self.min_checks} "
            "checks again.",
        )

    def _selected_layers(self, pl_module: pl.LightningModule) -> set[str]:
        """Modules with trainable parameters of their own, filtered by ``include`` / ``exclude``."""
        selected = select_modules(pl_module, self.include, self.exclude, (nn.Module,), owner="GradientNoiseScaleMonitor")
        return {n for n, m in selected.items() if any(p.requires_grad for p in m.parameters(recurse=False))}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.select_built_model(trainer, pl_module)
        # with one micro-batch per step, tensor hooks on the parameters see this rank's gradient before
        # DDP reduces it; a communication hook is needed only to read the accumulated local gradient
        if self.idle_reason is not None or self.refuse_several_optimizers(
            trainer, ": the noise scale is defined for one loss and read at one optimizer's step. Players of a game (a "
            "GAN, an actor-critic) minimise losses of their own, which one step's gradient would mix; one loss shared "
            "out over several optimizers (Muon with AdamW) is not supported either. Use it on a model with one "
            "optimizer.",
        ):
            return
        # FSDP2 (`fully_shard` in configure_model, after setup) replaces every parameter by a new DTensor
        # parameter: read the parameters (and build the probe) again when they changed
        if self._module is not None and self._params:
            current = {n: p for n, p in pl_module.named_parameters() if p.requires_grad}
            if any(current.get(n) is not p for n, p in self._params.items()):
                self._select(pl_module, initial=False)
        if self.resolved_method == "ddp" and self._planned_accumulation(trainer) > 1 and not self._ddp_registered:
            from torch.nn.parallel import DistributedDataParallel

            model = trainer.strategy.model
            if not isinstance(model, DistributedDataParallel):
                raise RuntimeError(
                    "GradientNoiseScaleMonitor(method='ddp'): the model is not wrapped in DistributedDataParallel."
                )
            def hook(state, bucket):  # noqa: ANN001 - DDP inspects the annotations: leave them out
                return self._comm_hook(state, bucket)

            model.register_comm_hook(state=None, hook=hook)
            self._ddp_registered = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning.pytorch.utilities import CombinedLoader

        # several loaders given to the fit (a dict or list, a CombinedLoader): Lightning zips them for training (each
        # batch a dict or list of sub-batches; its `sequential` mode is for evaluation only)
        given = trainer.train_dataloader if self.idle_reason is None else None
        loaders = 1 if given is None else len(CombinedLoader(given).flattened)
        if loaders > 1:
            # the batch size of a step was read from the first sub-batch (16 of 16 + 8), and the examples of the others
            # weigh otherwise in the loss (each loader's mean): the gradient is no mean over one batch of examples
            self.nothing_to_watch(
                trainer, f"each training batch combines {loaders} data loaders (a CombinedLoader, or a dict or list of "
                "loaders): the noise scale needs each step's gradient to be the mean over one batch of examples, and "
                "the sub-batches' examples enter the loss as the step combines them. Give the fit one loader to measure "
                "it", training=True)

    # ------------------------------------------------------------------ arming
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_start = trainer.global_step
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._armed_step == trainer.global_step:  # every micro-batch of the armed step counts
            size = extract_batch_size(batch)
            self._examples += size
            self._micro_batches += 1
            self._micro_sizes.append(size)
            if self._probe is not None:  # the examples a model call's arguments hold (a sequence-first input)
                self._probe.entry_batch_size = size

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        made = trainer.global_step - self._batch_start
        if made > 1 and self.idle_reason is None:
            # every estimate counts a step's examples from its batch: with several steps a batch (manual
            # optimization) each step's gradient is of a part of the batch that the monitor cannot see
            self.nothing_to_watch(
                trainer, f"a batch made {made} optimizer steps (manual optimization); the noise scale needs one "
                "optimizer step per batch (or per accumulation window), since the batch size of a step is read from "
                "its batches", training=True)

    def arm(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> Optional[bool]:
        if step != trainer.global_step:
            return False  # a step a batch takes after its first (manual optimization): its examples are unknown
        self._examples = 0
        self._micro_batches = 0
        self._micro_sizes = []
        self._small = {}
        # the trainable set may have changed since the last selection (GradientEarlyStopping froze a
        # component, a resumed run re-froze them, the user unfroze a layer, or replaced one): re-read it. Comparing
        # the flags costs one attribute read per parameter, on due steps only.
        if self._fsdp_units:
            reshard(self._fsdp_units)  # see _select: a validation loop left the root unit's parameters gathered
        if self._module is not None and self._trainable_flags(self._module) != self._flags:
            self._select(self._module, initial=False)
            self._selection_why = "a component frozen or unfrozen, or a layer replaced"
        elif self._compare_selection:
            self._selection_why = "a state restored from before a freeze or unfreeze, a rollback's"
        self._compare_selection = False
        if not self._measurable:
            return
        if self._lazy and any(nn.parameter.is_lazy(p) for p in self._params.values()):
            # LazyLinear & co.: the parameters exist after the model's first forward; measured from the next due step
            return False
        self._lazy = False
        if self.resolved_method == "per_example":
            assert self._probe is not None
            self._probe.reset()
            self._probe.attach()
        elif self.resolved_method == "accumulation" or (self.resolved_method == "ddp" and not self._ddp_registered):
            for name, p in self._params.items():
                self.keep(p.register_hook(self._make_leaf_hook(name)))

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Manual optimization, on a due step: the batch gradient's squared norms as the backward left them. The user
        may clip (``self.clip_gradients``) between ``manual_backward`` and ``opt.step()``, inside which
        ``on_before_optimizer_step`` reads ``.grad``: the small-batch norms come from the backward, unclipped, so the
        big-batch ones must be too (under automatic optimization the hook runs before Lightning clips). Read again
        after each backward of the step: the last holds the whole accumulated gradient."""
        if self._armed_step is None or pl_module.automatic_optimization or self.idle_reason is not None:
            return  # not due (the common step: nothing read), or automatic optimization
        if self._armed_step != trainer.global_step:
            return
        names = [n for n, p in self._params.items() if p.grad is not None]
        if not names:
            return
        (vec,) = self._sq_norms_global(trainer, [[self._params[n].grad.detach() for n in names]])
        scale = self._loss_scale(trainer)
        if scale is not None:  # not unscaled yet at this hook
            vec = vec / scale.to(vec.device).pow(2)
        self._unclipped = dict(zip(names, vec.unbind(0)))

    def release(self) -> None:
        super().release()
        if self._probe is not None:
            self._probe.detach()
            self._probe.reset()
        self._small = {}
        self._unclipped = None
        self._sizes = self._small_apart = None

    def _make_leaf_hook(self, name: str) -> Any:
        def hook(grad: Tensor) -> None:
            sq = grad.detach().float().pow(2).sum()
            prev = self._small.get(name)
            self._small[name] = sq if prev is None else prev + sq

        return hook

    def _comm_hook(self, state: Any, bucket: Any) -> Any:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if self._armed_step is not None:
            # the bucket holds this rank's gradient, before the all-reduce: the small batch
            grads = bucket.gradients()
            ids = {id(p): i for i, p in enumerate(bucket.parameters())}
            sq = _sq_norms([g.detach() for g in grads])
            for name, p in self._params.items():
                i = ids.get(id(p))
                if i is not None:
                    self._small[name] = sq[i]
        return allreduce_hook(state, bucket)

    # ------------------------------------------------------------------ the check
    def _loss_scale(self, trainer: pl.Trainer) -> Optional[Tensor]:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
            return None
        from lightning_monitor._compat import grad_scaler_scale

        scale = grad_scaler_scale(scaler)
        return scale.detach().float() if scale is not None else None

    def _to_mean(self, accumulate: int, micro: int) -> float:
        """The factor that turns the squared norm of an accumulated gradient (``.grad``, or a rank's before the
        all-reduce) into that of the mean gradient over its examples. Lightning divides each micro-batch's loss by
        ``accumulate``: with losses averaged over their examples, ``.grad`` is ``micro / accumulate`` times the mean
        (1 but in an epoch's short last window); with summed losses it is the sum over the examples over
        ``accumulate``."""
        if self.loss_reduction == "sum":
            return (float(accumulate) / max(self._examples, 1)) ** 2
        return 1.0 if micro == accumulate else (float(accumulate) / micro) ** 2

    def _weighted_big(self, b_big: float) -> float:
        """``B_big`` of the per-example method for the estimators. With each micro-batch's loss a mean over its own
        examples, the accumulated gradient weighs an example of a micro-batch of ``n_k`` by ``1 / n_k``: with micro-batches
        of unequal sizes (an epoch's short last batch inside an accumulation window) it is no plain mean over the
        examples. A weighted mean ``sum_i w_i g_i`` (``sum_i w_i = 1``) has ``E|G_w|^2 = |G|^2 + tr(Sigma) sum_i w_i^2``:
        the plain mean of ``1 / sum_i w_i^2`` examples, ``K^2 / sum_k 1 / n_k`` for ``K`` micro-batches (the number of
        examples when the sizes are equal), times the ranks."""
        sizes = [n for n in self._micro_sizes if n > 0]
        if self.loss_reduction != "mean" or len(set(sizes)) <= 1:
            return b_big
        return b_big * len(sizes) ** 2 / (sum(sizes) * sum(1.0 / n for n in sizes))

    def _local_size(self) -> float:
        """The examples this rank's gradient of the step counts as, ``e`` with ``E|g|^2 = |G|^2 + tr(Sigma) / e``: its
        examples, or with losses averaged over micro-batches of unequal sizes ``K^2 / sum_k 1 / n_k`` (see
        :meth:`_weighted_big`)."""
        sizes = [n for n in self._micro_sizes if n > 0]
        if self.loss_reduction != "mean" or len(set(sizes)) <= 1:
            return float(self._examples)
        return len(sizes) ** 2 / sum(1.0 / n for n in sizes)

    def _size_entries(self, trainer: pl.Trainer, device: torch.device, dtype: torch.dtype) -> Tensor:
        """``[1 / e, n, samples]`` of this rank, to be averaged over the ranks: ``e`` its :meth:`_local_size`, ``n`` its
        examples and ``samples`` those of a step as its loader is set (nan where the loader says none). Built on the
        device from numbers (no copy from the host)."""
        nominal = self._loader_batch(trainer)
        world = max(int(trainer.world_size), 1)
        values = (1.0 / max(self._local_size(), 1e-30), float(self._examples),
                  float("nan") if nominal is None else nominal / world)
        return torch.stack([torch.full((), v, device=device, dtype=dtype) for v in values])

    def _ranks_apart(self, trainer: pl.Trainer, sizes: Tensor, method: str) -> dict[str, Any]:
        """The estimators' batch sizes from every rank's ``sizes`` (:meth:`_size_entries` averaged over the ranks), on
        the device. Each rank's loss is a mean over its own examples and DDP averages the ranks' gradients, so the
        reduced gradient weighs an example of rank ``r`` by ``1 / (R e_r)``: it counts as ``R^2 / sum_r 1 / e_r``
        examples (``R`` times their harmonic mean ``H``, not their sum), and the ranks' local gradients, ``E|g_r|^2 =
        |G|^2 + tr(Sigma) / e_r``, average to ``|G|^2 + tr(Sigma) / H`` (the ``"ddp"`` method's small batch). With
        summed losses each gradient read is rescaled to a plain mean: the reduced one over all ``N = sum_r n_r``
        examples. ``equal``: the ranks' sizes are this rank's (within rounding), where the sizes it knows alone are
        exact and are kept, bit for bit."""
        world = max(int(trainer.world_size), 1)
        inv, count, nominal = sizes.double().unbind(0)
        harmonic = 1.0 / inv
        total = torch.round(count * world)  # the examples of all ranks (integers, exact again after the mean)
        big = world * harmonic if self.loss_reduction == "mean" else total
        # 1 / e in float32 and its mean over the ranks carry a rounding of a few 1e-7 (ranks of equal sizes sent
        # 1/5 and read back 0.2000000030 or so): sizes that close are taken for equal
        equal = (inv * self._local_size() - 1.0).abs() <= (world + 2) * 2.0 ** -23
        return {"equal": equal, "small": harmonic if method == "ddp" else None, "big": big, "total": total,
                "count": total / world, "nominal": nominal * world}

    # the small-batch squared norms of each method: (parameter names, {name: |g_small|^2}, B_small, B_big), from
    # `micro` micro-batches, each loss divided by `accumulate` (Lightning's division, also in an epoch's last, shorter
    # accumulation window)
    def _small_per_example(self, trainer: pl.Trainer, accumulate: int, micro: int) -> Optional[_Small]:
        assert self._probe is not None
        self._probe.batch_size = self._examples
        per_param = self._probe.per_parameter()
        # the check that the hooked modules account for each covered parameter's whole gradient (none also used outside
        # its module) costs a small host sync and about a third of the probe's own work: it runs at the 1st, 2nd, 4th,
        # 8th ... check of the probe (a model whose use of its weights changes after the first batches, a tied decoder
        # called from the second batch on, is caught at the next of them), a share of the checks that vanishes as the
        # run goes on. A layer pruned or reparametrized since is found at every check (PerExampleGradNorms.attach)
        self._probe_reads += 1
        self._probe.verify = ((self._probe_reads + 1) & self._probe_reads) == 0
        if not per_param:
            return None
        names = [n for n in self._probe.covered if n in per_param]
        # hooks saw grad of loss / accumulate (Lightning divides the loss)
        factor = float(accumulate) ** 2
        return names, {n: per_param[n].mean() * factor for n in names}, 1, self._examples * trainer.world_size

    def _small_accumulation(self, trainer: pl.Trainer, accumulate: int, micro: int) -> Optional[_Small]:
        names = [n for n in self._params if n in self._small]
        factor = float(accumulate) ** 2 / micro  # the mean over the micro-batches of (accumulate * g)^2
        if self.loss_reduction == "sum":  # each micro-batch's gradient is the sum over its examples: to their mean
            factor /= (self._examples / micro) ** 2
        small = {n: self._small[n] * factor for n in names}
        sizes = [n for n in self._micro_sizes if n > 0]
        if self.loss_reduction == "mean" and len(set(sizes)) > 1:
            # micro-batches of unequal sizes (an epoch's short last batch in the window): the mean of their squared
            # norms is |G|^2 + tr(Sigma) mean_k 1 / n_k, their harmonic mean's (8, 8, 3: 5.1 examples, not 6.3), and
            # the accumulated gradient counts as K^2 / sum_k 1 / n_k examples (15.4, not 19)
            return names, small, len(sizes) / sum(1.0 / n for n in sizes), self._local_size() * trainer.world_size
        return names, small, self._examples / micro, self._examples * trainer.world_size

    def _small_ddp(self, trainer: pl.Trainer, accumulate: int, micro: int) -> Optional[_Small]:
        # the same parameters, in the same order, on every rank: those with a gradient after the all-reduce (DDP
        # writes it on every rank). A parameter this rank's batch did not reach (a branch taken on some ranks only)
        # has a small-batch gradient of 0 here; its hook did not run
        names = [n for n, p in self._params.items() if n in self._small or p.grad is not None]
        if names:
            device = next(iter(self._small.values())).device if self._small else self._params[names[0]].device
            zero = torch.zeros((), device=device)
            vec = torch.stack([self._small[n].to(device) if n in self._small else zero for n in names])
        else:
            vec = torch.zeros(0, device=trainer.strategy.root_device)
        to_mean = self._to_mean(accumulate, micro)
        # every rank's sizes ride in the same all-reduce (ranks whose batches differ in size, see _ranks_apart); with
        # summed losses each rank's norms are also sent as its own examples' mean, which only it can rescale
        own = [vec * to_mean] if self.loss_reduction == "sum" else []
        n = len(names)
        vec = trainer.strategy.reduce(torch.cat([vec, *own, self._size_entries(trainer, vec.device, vec.dtype)]),
                                      reduce_op="mean")
        self._sizes = vec[-3:]
        if own:
            self._small_apart = dict(zip(names, vec[n:2 * n].unbind(0)))
        vec = vec[:n]
        if to_mean != 1.0:  # the accumulated local gradient as the mean over the rank's examples
            vec = vec * to_mean
        e = self._local_size()  # the examples when its micro-batches are of one size
        return names, dict(zip(names, vec.unbind(0))), e, e * trainer.world_size

    def compute(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> Optional[dict[str, Any]]:
        """The small- and big-batch squared norms of this step, by the resolved method, as the raw
        (unsmoothed) ``|G|^2`` and ``tr(Sigma)`` estimates, model-wide and per layer, and the coverage."""
        if not self._measurable:
            return None
        method = self.resolved_method
        read = {"per_example": self._small_per_example, "accumulation": self._small_accumulation, "ddp": self._small_ddp}
        # Lightning divides every micro-batch's loss by accumulate_grad_batches, also when an epoch's last
        # accumulation window holds fewer micro-batches
        accumulate, micro = trainer.accumulate_grad_batches, max(self._micro_batches, 1)
        self._sizes = self._small_apart = None
        if trainer.world_size > 1 and method != "ddp":
            # the ranks' sizes, before anything a rank could skip (an all-reduce of 3 floats per check; the "ddp" method
            # sends them in its own)
            self._sizes = trainer.strategy.reduce(
                self._size_entries(trainer, trainer.strategy.root_device, torch.float32), reduce_op="mean")
        found = read[method](trainer, accumulate, micro)
        if found is None and method == "per_example" and self._probe is not None and not self._probe.covered:
            # the per-example norms cover no parameter (every module left out, e.g. a batch folded with the choices
            # of a multiple-choice model): said once, with each module's reason, and logged as a coverage of 0
            # (nothing is estimated), instead of logging nothing without a word
            if any(p.grad is not None for p in self._params.values()):
                self._coverage_alert(step, set(), 0.0, True)
                return {self.key("batch_size"): float(self._examples * trainer.world_size),
                        self.key("coverage"): 0.0, self.key("partial"): 1.0}
        if found is None:
            return None
        names, small, b_small, b_big = found
        scale = self._loss_scale(trainer)
        if scale is not None:  # the hooks saw the gradients of the scaled loss
            small = {n: v / scale.pow(2) for n, v in small.items()}
            if self._small_apart is not None:
                self._small_apart = {n: v / scale.pow(2) for n, v in self._small_apart.items()}
        if not names:
            return None
        if b_big <= b_small:
            self._single_run += 1
            if self.ema.count and self._single_run < 2:
                # an epoch's short last batch (one example) after checks that had two batch sizes: this check has
                # nothing to estimate, which is no condition of the run (said if it persists)
                return None
            if not self._warned_single:
                self._warned_single = True
                self.alert(
                    step, "no_variance_estimate", "warning",
                    f"The gradient noise scale needs two batch sizes, but method {method!r} sees batch size {b_small} "
                    f"and {b_big} (batch size 1?): nothing is estimated. Use a batch of >= 2 examples, "
                    "gradient accumulation, or >= 2 data-parallel ranks.",
                    value=float(b_big),
                )
            return {self.key("batch_size"): float(b_big)}
        self._single_run = 0

        grads = [self._params[n].grad for n in names]
        if any(g is None for g in grads):
            keep = [i for i, g in enumerate(grads) if g is not None]
            names = [names[i] for i in keep]
            grads = [grads[i] for i in keep]
            if not names:  # no measured parameter has a gradient this step: nothing to estimate
                return None
        self._measured = measured = set(names)
        # compared here, once the step's backward has shown what is separable: what the probe covers also shrinks as
        # layers run (a BatchNorm found in training mode, a layer used outside its module), for good
        self._restart_on_new_selection(step, self._selection_why or (
            "layers found not separable per example as they ran, such as a BatchNorm normalising with its batch's "
            "statistics"))
        self._selection_why = None
        unclipped = self._unclipped
        if unclipped is not None and all(n in unclipped for n in names):
            # manual optimization: read after the backward, before any clipping by the user (on_after_backward)
            others = [n for n, p in self._params.items() if n not in measured and p.grad is not None and n in unclipped]
            big_vec = torch.stack([unclipped[n] for n in names])
            rest = [unclipped[n] for n in others]
            rest_vec = torch.stack(rest) if rest else torch.zeros(0, device=big_vec.device)
        else:
            rest_names = [n for n, p in self._params.items() if n not in measured and p.grad is not None]
            rest = [self._params[n].grad.detach() for n in rest_names]
            # .grad is unscaled at this hook
            if trainer.world_size > 1 and any(is_sharded(g) for g in [*grads, *rest]):
                # sharded gradients are reduced across ranks by position: every trainable parameter in one order, the
                # same on every rank, whatever each rank measured (a rank whose batch left a parameter out measured
                # another set: its lists summed other parameters' shards into its own, a coverage of 0.99 for 0.009)
                order = list(self._params)
                full = self._sq_norms_global(trainer, [[self._params[n].grad for n in order]])[0]
                at = {n: i for i, n in enumerate(order)}
                big_vec = full[[at[n] for n in names]]
                rest_vec = full[[at[n] for n in rest_names]]
            else:
                big_vec, rest_vec = self._sq_norms_global(trainer, [[g.detach() for g in grads], rest])
        big_read = big_vec
        to_mean = self._to_mean(accumulate, micro)
        if to_mean != 1.0:  # .grad as the big batch's mean gradient
            big_vec, rest_vec = (v * to_mean for v in (big_vec, rest_vec))
        small_vec = torch.stack([small[n] for n in names]).to(big_vec.device)

        # and whether it is its epoch's last batch (maybe short: no batch size of the run's, see judge)
        raw: dict[str, Any] = {"\x00batch": float(b_big), "\x00last": float(bool(getattr(trainer, "is_last_batch", False)))}
        if method == "per_example":
            b_big = self._weighted_big(b_big)  # the estimators' B_big: the examples as the accumulated gradient weighs them
        apart = None
        if self._sizes is not None:
            # several ranks: their batches may differ in size (a sampler of one's own, an epoch's short last batch on
            # some ranks only). Each rank's own size taken for every rank's put the "ddp" method's tr(Sigma) at 3.79 on
            # a rank of 5 examples and 6.06 on one of 8 against the oracle's 4.66, and the per-example method's |G|^2
            # at 0.001 and 0.249 against 0.104 and 0.166. The estimates from every rank's sizes are taken where the
            # sizes differ; where they are equal, those above, unchanged to the bit
            apart = self._ranks_apart(trainer, self._sizes.to(big_vec.device), method)
            raw["\x00batch"] = apart["total"]
            raw["\x00nominal"] = apart["nominal"]
            small_apart = small_vec
            if self._small_apart is not None:
                small_apart = torch.stack([self._small_apart[n] for n in names]).to(big_vec.device)
            big_apart = big_vec
            if self.loss_reduction == "sum":  # .grad as the mean over all ranks' examples (R / N times the sum)
                big_apart = big_read * (float(accumulate) / apart["count"]).pow(2).to(big_read.dtype)
            b_small_apart = apart["small"] if apart["small"] is not None else b_small

        def estimate(sel: Optional[Tensor]) -> tuple[Any, Any]:
            """``(|G|^2, tr(Sigma))`` of the parameters at ``sel`` (all: ``None``)."""
            part = (lambda v: v) if sel is None else (lambda v: v[sel])
            g2, tr = noise_scale_estimates(part(small_vec).sum(), part(big_vec).sum(), b_small, b_big)
            if apart is None:
                return g2, tr
            g2_apart, tr_apart = noise_scale_estimates(part(small_apart).sum(), part(big_apart).sum(), b_small_apart,
                                                       apart["big"])
            return torch.where(apart["equal"], g2, g2_apart), torch.where(apart["equal"], tr, tr_apart)

        g2, tr = estimate(None)
        raw["\x00g2"], raw["\x00tr"] = g2, tr
        if rest:  # the share of the gradient's squared norm the measured parameters carry, on device
            covered_sq = big_vec.sum()
            raw["\x00coverage"] = covered_sq / (covered_sq + rest_vec.to(big_vec.device).sum()).clamp_min(1e-30)
        if self._layers:
            index = {n: i for i, n in enumerate(names)}
            for layer, pnames in self._layers.items():
                idx = [index[n] for n in pnames if n in index]
                if not idx:
                    continue
                sel = torch.tensor(idx, device=big_vec.device)
                lg2, ltr = estimate(sel)
                raw[f"{layer}\x00g2"], raw[f"{layer}\x00tr"] = lg2, ltr
        return raw

    def judge(self, trainer: pl.Trainer, step: int, values: dict[str, float]) -> dict[str, float]:
        """Smooth the estimates, and the batch-size and coverage alerts; the smoothed values are logged."""
        host = values
        if "\x00g2" not in host:  # one batch size only: nothing estimated
            return host
        if not self.ema.update(host["\x00g2"], host["\x00tr"]):
            log.debug("GradientNoiseScaleMonitor: non-finite gradient norms at step %d, skipped.", step)
            return {}
        if self.ema.restarted:
            tr = host["\x00tr"]
            self.alert(
                step, "averages_restarted", "info",
                f"The noise scale's averages start again at step {step}: tr(Sigma) ({tr:.3g} now) has been more than "
                f"{self.ema.restart_factor:g} times away from its average for {self.ema.persist} checks in a row, so "
                "the checks before were of another scale (the first steps from random init, weights changed on "
                "purpose); averaged in, they would have fixed B_simple at their own ratio. Batch-size advice waits for "
                f"{self.min_checks} checks again.",
                value=float(tr),
            )
        b_big = host["\x00batch"]
        coverage = host.get("\x00coverage", 1.0)
        partial = not coverage >= self.min_coverage
        metrics: dict[str, float] = {
            self.key("g2"): float(self.ema.g2.value),
            self.key("trace_sigma"): float(self.ema.trace_sigma.value),
            self.key("batch_size"): float(b_big),
            self.key("coverage"): coverage,
            self.key("partial"): float(partial),
        }
        b_simple = self.ema.b_simple
        if math.isfinite(b_simple):
            metrics[self.key("b_simple")] = b_simple
        # a smoothed |G|^2 that stays <= 0 leaves B_simple undefined (not logged): said once it has lasted
        # `_UNDEFINED_CHECKS` checks, and when it clears
        undefined = self._undefined = self._undefined + 1 if not math.isfinite(b_simple) else 0
        self.condition(
            step, "b_simple_undefined", undefined >= _UNDEFINED_CHECKS, "info",
            f"B_simple has been undefined for {undefined} checks: the smoothed estimate of the squared norm of the true "
            f"gradient |G|^2 stays <= 0 ({self.ema.g2.value:.3g}): at batch size {b_big:g} the gradient noise dominates "
            "the batch gradient (or the gradient is near 0), so the noise scale cannot be told from these batch sizes. "
            "`gns/b_simple` is logged once the estimate turns positive; `gns/g2` and `gns/trace_sigma` are logged.",
            value=float(self.ema.g2.value),
            clear_message="B_simple is defined again (the smoothed |G|^2 estimate turned positive).",
        )
        for layer in self._layers:
            if f"{layer}\x00g2" not in host:
                continue
            ema = self.layer_ema.setdefault(layer, NoiseScaleEMA(self.smoothing))
            ema.update(host[f"{layer}\x00g2"], host[f"{layer}\x00tr"])
            if math.isfinite(ema.b_simple):
                metrics[self.key("b_simple", layer)] = ema.b_simple
        self._coverage_alert(step, self._measured, coverage, partial)
        # the advice is about the batch size in use: an epoch's last batch, when smaller than the batch of an earlier
        # check, is short (43 examples in batches of 8 were told that "batch size 3" was far below B_simple)
        in_use = float(b_big)
        if host.get("\x00last"):
            # the training loader's batch size where it says one (every check may fall on an epoch's last batch, and a
            # batch size lowered on purpose is the loader's), else the last check's on a batch that was not the last
            # (on several ranks, every rank's loader: a rank's own times the ranks took its batch size for every rank's)
            nominal = host["\x00nominal"] if "\x00nominal" in host else self._loader_batch(trainer)
            if nominal is not None and not math.isfinite(nominal):
                nominal = None  # a rank's loader says none
            known = nominal if nominal is not None else self._batch_in_use
            in_use = max(in_use, known) if known is not None else in_use
        else:
            self._batch_in_use = in_use
        self._batch_alerts(step, in_use, b_simple, self._epoch_samples(trainer, in_use), coverage)
        return metrics

    def _coverage_alert(self, step: int, measured: set[str], coverage: float, partial: bool) -> None:
        """One warning alert naming the trainable parameters left out of the estimate (by module, with
        the reason), when a check finds some not named before, or when the estimate turns partial for the first
        time (the share the same parameters carry grew past ``1 - min_coverage``: it was said on the console only)."""
        left = [n for n in self._params if n not in measured and self._params[n].grad is not None]
        new = [n for n in left if n not in self._reported]
        crossed = partial and not self._said_partial
        if not new and not crossed:
            return
        self._reported.update(new)
        self._said_partial = self._said_partial or partial
        reasons = self._probe.reasons if self._probe is not None else {}
        selected = self._selected if (self.include or self.exclude) else None
        by_module: dict[str, list[str]] = defaultdict(list)
        why: dict[str, str] = {}
        for n in left:
            layer = _layer_of(n)
            by_module[layer].append(n.rsplit(".", 1)[-1])
            if selected is not None and layer not in selected:
                why.setdefault(layer, "left out by include/exclude")
            else:
                why.setdefault(layer, reasons.get(n, "no handler for its module type"))
        # the modules grouped by their reason, each reason said once (a model whose every block feeds one BatchNorm
        # printed the same three lines of reason thirty times); at most 12 modules named, the rest counted
        groups: dict[str, list[str]] = {}
        for m, ps in by_module.items():
            groups.setdefault(why[m], []).append(f"{m} ({', '.join(ps)})")
        parts, named = [], 0
        for reason, mods in groups.items():
            listed = mods[: max(0, 12 - named)]
            if not listed:
                break
            named += len(listed)
            parts.append(f"{', '.join(listed)}{' ...' if len(listed) < len(mods) else ''}: {reason}")
        shown = "; ".join(parts)
        more = f"; ... ({len(by_module) - named} more modules)" if len(by_module) > named else ""
        # rounded down, at least one digit past the threshold's: a share below it never reads as equal to it (0.8998
        # printed 0.900 beside min_coverage=0.9)
        digits = 3
        while digits < 8 and math.floor(coverage * 10 ** digits) / 10 ** digits >= self.min_coverage > coverage:
            digits += 1
        shown_cov = f"{math.floor(coverage * 10 ** digits) / 10 ** digits:.{digits}f}"
        message = (
            f"Per-example gradient norms leave out {len(left)} trainable parameter(s) of {len(by_module)} module(s), "
            f"{1.0 - coverage:.1%} of the gradient's squared norm at step {step} (gns/coverage = {shown_cov}, logged "
            "at every check: the share moves as training goes on); "
            + ("B_simple is that of the covered parameters." if measured else
               "no parameter is covered, so nothing is estimated (no gns/b_simple).")
        )
        if partial:
            self.alert(
                step, "partial_coverage", "warning",
                f"{message} The estimate is partial (gns/partial = 1): the covered share is below "
                f"min_coverage={self.min_coverage:g}. Left out: {shown}{more}.",
                value=coverage, threshold=self.min_coverage,
            )
        else:  # the estimate stands: said on the console, no alert on a healthy run
            rank_zero_warn(f"GradientNoiseScaleMonitor: {message} Left out: {shown}{more}.")

    def _on_alert(self, alert: Any) -> None:
        if alert.kind == "rolled_back":
            self._rolled_back = True

    @staticmethod
    def _loader_batch(trainer: pl.Trainer) -> Optional[float]:
        """The samples of a step as the training loader is set: its ``batch_size`` times ``accumulate_grad_batches``
        times the ranks; ``None`` where the loader says none (a batch sampler of its own, an iterable)."""
        size = getattr(getattr(trainer, "train_dataloader", None), "batch_size", None)
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            return None
        accumulate = max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1)
        return float(size * accumulate * max(int(getattr(trainer, "world_size", 1) or 1), 1))

    @staticmethod
    def _epoch_samples(trainer: pl.Trainer, batch: float) -> Optional[float]:
        """The samples an epoch holds, all ranks together (its batches times the samples of a micro-batch, ``batch``
        being those of a step), or ``None`` for an epoch of unknown length."""
        batches = batches_per_epoch(trainer)
        accumulate = max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1)
        return None if batches is None else batches * batch / accumulate

    def _batch_alerts(self, step: int, batch: float, b_simple: float, epoch_samples: Optional[float] = None,
                      coverage: float = 1.0) -> None:
        if self._rolled_back:
            # the guard rolled the run back (the average went back with it): the checks of a run that was diverging,
            # right before or after, gave advice from an unsettled state (the demo's diverging run was told to lower
            # its batch size toward 1 at the first check after its rollback). Advice waits for min_checks more
            self._rolled_back = False
            self._advice_from = self.ema.count - 1 + self.min_checks
        if self.ema.count < max(self.min_checks, self._advice_from) or not math.isfinite(b_simple):
            return
        # B_simple of a small part of the gradient is no advice for the whole batch (a MobileNetV2, whose BatchNorm
        # layers couple the examples: 0.3% of the squared norm covered, "raise the batch size" from B_simple 290)
        withheld = coverage < _ADVICE_COVERAGE
        self.condition(
            step, "advice_withheld", withheld, "info",
            f"No batch-size advice: B_simple ({b_simple:.3g}) is estimated from {coverage:.1%} of the gradient's squared "
            f"norm (gns/coverage; the rest is left out, see the coverage alert), less than {_ADVICE_COVERAGE:.0%}, so it "
            "need not be the noise scale of the whole gradient.",
            value=coverage, threshold=_ADVICE_COVERAGE,
            clear_message=f"The noise scale covers {coverage:.1%} of the gradient's squared norm again: advice resumes.",
        )
        if withheld:
            for kind in ("batch_below_noise_scale", "batch_above_noise_scale"):
                if (kind, None) in self.active_conditions():
                    self.condition(step, kind, False, "info", "", clear_message="Withdrawn: see advice_withheld.")
            return
        # hysteresis: a condition raised at a factor alert_ratio clears at sqrt(alert_ratio), so a noisy
        # estimate near the threshold does not flap
        active = self.active_conditions()
        r_low = math.sqrt(self.alert_ratio) if ("batch_below_noise_scale", None) in active else self.alert_ratio
        r_high = math.sqrt(self.alert_ratio) if ("batch_above_noise_scale", None) in active else self.alert_ratio
        low = batch * r_low < b_simple
        high = b_simple > 0 and batch > b_simple * r_high
        shown, target = f"{b_simple:.3g}", max(1, round(b_simple))  # 0.495 reads 0.495, advice "toward 1"
        toward = f"toward ~{target}"
        if epoch_samples is not None and target > epoch_samples:
            # a batch cannot hold more than the training set: B_simple beyond it says the noise stays large even at
            # full batch (advice toward 655 on 512 samples read as a batch no epoch can fill)
            toward = (f"as far as the whole training set (~{epoch_samples:.0f} samples an epoch; B_simple exceeds it, "
                      "so each step's gradient stays noisy up to full batch)")
        self.condition(
            step, "batch_below_noise_scale", low, "info",
            f"Batch size {batch:.0f} is far below the gradient noise scale B_simple = {shown}: each step "
            f"averages out little of the gradient noise. Raise the batch size {toward} (more "
            "data-parallel ranks or accumulate_grad_batches, scaling the learning rate with it) for nearly "
            "proportionally fewer steps at about the same number of examples.",
            value=b_simple, threshold=batch * self.alert_ratio,
            clear_message=f"Batch size {batch:.0f} is no longer far below B_simple = {shown}.",
        )
        self.condition(
            step, "batch_above_noise_scale", high, "info",
            f"Batch size {batch:.0f} is far above the gradient noise scale B_simple = {shown}: most examples "
            f"of each batch add little. Lower the batch size toward ~{target} (fewer ranks or less "
            "accumulation) to reach the same loss with less compute, or keep it if wall-clock time matters more.",
            value=b_simple, threshold=batch / self.alert_ratio,
            clear_message=f"Batch size {batch:.0f} is no longer far above B_simple = {shown}.",
        )

"""GradientEarlyStopping (GradES): freeze transformer components whose gradients have converged, stop
when all are frozen (Wen et al., arXiv 2509.01842)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_monitor._sharded import is_sharded, local, replication
from lightning_monitor._args import check_bool, check_fraction, check_int, deprecated_aliases
from lightning_monitor.callbacks.base import Monitor, NothingToWatch, reading_weights
from lightning_monitor.selection import as_patterns
from lightning_monitor.functional.grades import (
    Component,
    block_container,
    ema_update,
    find_components,
    freeze_mask,
    freeze_parameters,
    frozen_prefix,
    mean_abs,
    mean_abs_update,
    no_component_reason,
    relative_ratio,
    shared_outside,
    uncovered_matrices,
)

__all__ = ["GradientEarlyStopping"]

Criterion = Literal["grad", "update"]
Threshold = Literal["relative", "absolute"]
ReferenceAt = Literal["early", "grace_end"]


def _full_mean_abs(tensors: Sequence[Tensor]) -> Tensor:
    return mean_abs(tensors)


def _scaled_parts(shards: Sequence[Tensor], fulls: Sequence[Tensor]) -> Tensor:
    """This rank's part of ``mean |T|`` for each DTensor ``T`` of ``fulls`` from its local shard: the
    shard's L1 norm over the full element count (over the replication count too, so that a shard held
    by several ranks is counted once); summed over the ranks, ``mean |T|``. An empty shard gives 0."""
    if not shards:
        return torch.zeros(0)
    device = shards[0].device
    l1 = torch.stack([s.detach().abs().sum(dtype=torch.float32) for s in shards])
    denom = torch.tensor([float(f.numel() * replication(f)) for f in fulls], dtype=torch.float32, device=device)
    return l1 / denom


def _local_mean_abs(tensors: Sequence[Tensor]) -> Tensor:
    return _scaled_parts([local(t) for t in tensors], tensors)


def _as_tuple(patterns: Optional[Union[str, Sequence[str]]]) -> Optional[tuple[str, ...]]:
    if patterns is None:
        return None
    return (patterns,) if isinstance(patterns, str) else tuple(patterns)


def _planned_steps(trainer: pl.Trainer) -> Union[int, float]:
    """``trainer.estimated_stepping_batches``, with the accumulation a ``GradientAccumulationScheduler`` will set
    epoch by epoch: Lightning's estimate divides every epoch by the Trainer's accumulation, which is 1 at setup under
    a scheduler (a scheduled run of 464 steps was planned at 307, another of 688 at 307 too, so the grace period was
    two thirds of one and less than half of the other)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    planned = trainer.estimated_stepping_batches
    scheduler = next((c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)), None)
    batches, epochs = trainer.num_training_batches, trainer.max_epochs
    if (scheduler is None or not math.isfinite(planned) or not isinstance(batches, int) or epochs is None
            or epochs < 0):
        return planned
    total = sum(math.ceil(batches / scheduler.get_accumulate_grad_batches(e)) for e in range(max(epochs, 1)))
    return min(total, trainer.max_steps) if trainer.max_steps is not None and trainer.max_steps >= 0 else total


class GradientEarlyStopping(Monitor):
    r"""Freezes each transformer component once its statistic has converged; stops when (almost) all
    are frozen.

    A *component* is one weight matrix of a transformer block: attention q/k/v/o (or a fused qkv),
    MLP gate/up/down (or fc/proj; GPT-2's ``Conv1D`` too), or a LoRA adapter; more generally any
    ``nn.Linear``, Hugging Face ``Conv1D`` or convolution inside a numbered block (a ResNet's
    ``layer1.0.conv1``); found by name (:func:`~lightning_monitor.functional.grades.find_components`) or
    given as glob patterns (``include``). A model without any, or trained by several optimizers
    (checked when the fit starts), raises
    :class:`~lightning_monitor.callbacks.base.NothingToWatch`, or, with
    ``idle_when_nothing_to_watch`` set (the preset sets it), says so in one warning alert and stays
    idle. Every ``every_n_steps`` optimizer steps, in ``on_before_optimizer_step``
    (gradients unscaled under AMP, not yet clipped, already all-reduced under DDP), on the device:

    * ``criterion="grad"`` (the paper): :math:`s_c = \operatorname{mean}_{ij} |\partial L / \partial W_{ij}|`;
    * ``criterion="update"`` (the released code): :math:`s_c = \operatorname{mean}_{ij}|W_{ij}(t) -
      W_{ij}(t-k)| / k`, the weight change per element and step since the previous check.

    ``threshold="relative"`` (default) freezes ``c`` when :math:`\tilde s_c < \tau\, r_c`, where
    :math:`\tilde s_c` is :math:`s_c` smoothed by an EMA (``smoothing``; 0 = the paper's raw value) and the
    reference :math:`r_c` is set by ``reference_at``:

    * ``"early"``: the mean of :math:`s_c` over the first ``reference_checks`` checks (the start of the
      run). In a fine-tuning on a new task those checks fall in the task-switch transient, whose gradients
      are several times the later ones: the reference is inflated and a ratio below ``tau`` may only mean
      that the transient is over (``docs/grades_validity.md``).
    * ``"grace_end"``: :math:`\tilde s_c` at the first check at or after the end of the grace period (the
      smoothed level once the transient is over; ``reference_checks`` is unused); ``c`` may freeze from
      its next check on. A component without a value at that check takes its reference at its first check
      with one.

    A check whose step has a non-finite training loss, or whose statistics are all exactly zero (gradients that
    :class:`~lightning_monitor.DivergenceGuard`, listed before this callback, zeroed on a non-finite step), is left
    out: nothing of it enters the EMA or the reference, and nothing freezes on it (read, the zeros froze every
    component and stopped the run).

    The ratio is free of the matrix size, the loss scale and the learning rate, so one ``tau`` carries
    over between models and schedules; the paper's absolute rule (``threshold="absolute"``,
    :math:`s_c < \tau`) needs a new ``tau`` for every model (values in the wild span 1e-10 .. 2.4).

    No component freezes before the grace period: ``grace_steps`` optimizer steps, or
    ``grace_fraction`` of the planned steps (``trainer.estimated_stepping_batches``, epoch by epoch under a
    scheduled accumulation). A frozen component gets ``requires_grad=False`` (the backward skips its weight-gradient
    matmul; gradients still flow through it to earlier layers), its ``.grad`` is dropped (it skips this step's
    update), its optimizer state is freed, and it stays frozen. When the frozen fraction of components reaches
    ``max_frozen_ratio`` the trainer stops (``trainer.should_stop``, reduced across ranks).

    A block whose matrices are all frozen still costs the gradient with respect to its input whenever a
    parameter before it trains: its own norms and biases, or the embeddings. With
    ``cut_frozen_prefix=True``, once the first ``k`` blocks (the numbered children of the one
    ``nn.ModuleList``/``nn.Sequential`` holding every component, e.g. ``model.layers``) have all their
    weight matrices frozen and nothing in front of the blocks trains (the parameters listed before the
    blocks by ``named_parameters()``: the embeddings, frozen by the user or as components named in
    ``include``), the remaining parameters of those ``k`` blocks (norm scales and shifts, other 1-D
    parameters) are frozen too, the same way: no tensor before block ``k`` then requires a gradient and
    the backward stops there, while the gradients of every parameter still trainable are unchanged.
    The parameters frozen so are :attr:`cut` (name -> step). Trainable embeddings keep the backward
    running through the blocks, so nothing is cut (said once in an info alert ``prefix_not_cut``); so
    does a model whose components are not all in the numbered blocks of one container (info alert
    ``prefix_cut_unavailable``). The default is ``False`` because the cut freezes parameters that are
    not components and that the plain rule keeps training (the norms of the frozen blocks).

    Resuming (``trainer.fit(ckpt_path=...)``) re-freezes the checkpoint's set in ``on_train_start``,
    after ``configure_optimizers`` ran and the optimizer state was loaded, and before the first step:
    an optimizer over ``filter(lambda p: p.requires_grad, model.parameters())`` is built over the same
    parameters as in the run that wrote the checkpoint, so its state loads. (Until ``on_train_start``
    the frozen components still have ``requires_grad=True``.) The same applies to a state loaded with
    ``load_state_dict`` before ``fit``. An instance attached to a new Trainer without such a state
    starts clean: nothing frozen, no reference.

    Under DDP, statistics are all-reduced before the decision, so every rank freezes the same set on
    the same step; DDP must be built with ``find_unused_parameters=True`` (frozen parameters then
    count as globally unused and keep ``.grad is None``); other settings are refused at setup. Under
    FSDP2 (``ModelParallelStrategy``, DTensor parameters) each rank computes its shards' part of every
    statistic and one all-reduce sums them: the same values and decisions as unsharded. FSDP1 and
    DeepSpeed (flat parameters) are refused at setup; see ``docs/distributed.md``.

    Args:
        tau: freeze threshold (> 0): a fraction of the reference (relative) or a value of the statistic
            (absolute).
        criterion: ``"grad"`` or ``"update"``.
        threshold: ``"relative"`` or ``"absolute"``.
        grace_fraction: fraction of the planned optimizer steps in [0, 1) before any freeze.
        grace_steps: grace period in optimizer steps; overrides ``grace_fraction`` when given.
        max_frozen_ratio: stop training when this fraction of components, in (0, 1], is frozen (with
            ``stop=True``).
        include: glob patterns of module names to use as components instead of the naming schemes.
            Deprecated alias: ``components``.
        exclude: glob patterns of module names that are never components.
        reference_checks: number of first checks whose mean is the relative reference (>= 1), with
            ``reference_at="early"``: each component's first checks with a gradient (one that joins the
            forward later takes its reference then, and is judged once it has this many values).
        reference_at: where the relative reference is taken: ``"early"`` (the first ``reference_checks``
            checks) or ``"grace_end"`` (the smoothed statistic at the first check at or after the end of
            the grace period); see above.
        smoothing: EMA coefficient in [0, 1) applied to the statistic before the comparison, per check
            (``m = smoothing * m + (1 - smoothing) * s``; 0 = the paper's raw value).
        log_stats: log ``grades/<component>/stat`` and ``/ratio`` at every check.
        every_n_steps: check every this many optimizer steps.
        warmup_steps: first check at this step (e.g. after an LR warm-up, so that the reference is
            not taken during it).
        stop: whether the monitor may stop the run: stop training once ``max_frozen_ratio`` of the
            components is frozen (default). ``False``: it only freezes (its own action, always on) and
            training goes on with whatever is left trainable.
        cut_frozen_prefix: when the leading blocks have all their matrices frozen and nothing in front of
            them trains, freeze the rest of those blocks (norms) so that the backward stops at their end
            (see above). Off by default: it freezes parameters the plain rule keeps training.
        min_loss_progress: no component freezes while the training loss still falls: while the median of the
            losses read at the checks of the last window (a third of the grace period, at least four checks) is
            below that of the window before by more than this fraction of the initial loss (the median of the
            first three checks). The gradients can shrink model-wide while a model still learns (a growing logit
            scale or temperature, a loss leaving a plateau); the paper's rule froze every component of such a run
            at once and stopped it. Said in one ``still_learning`` info alert, ``still_learning_cleared`` when the
            loss settles. ``None``: the paper's rule alone.

    The monitor has no ``patience``: a component freezes at the first check past the grace period whose
    smoothed statistic is below the threshold (``smoothing`` plays that role).
    """

    name = "grades"

    @deprecated_aliases(components="include")
    def __init__(
        self,
        tau: float = 0.4,
        criterion: Criterion = "grad",
        threshold: Threshold = "relative",
        grace_fraction: float = 0.3,
        grace_steps: Optional[int] = None,
        max_frozen_ratio: float = 1.0,
        include: Optional[Union[str, Sequence[str]]] = None,
        exclude: Optional[Union[str, Sequence[str]]] = None,
        reference_checks: int = 3,
        smoothing: float = 0.9,
        log_stats: bool = True,
        every_n_steps: int = 5,
        warmup_steps: int = 0,
        stop: bool = True,
        cut_frozen_prefix: bool = False,
        reference_at: ReferenceAt = "grace_end",
        min_loss_progress: Optional[float] = 0.01,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, warmup_steps=warmup_steps)
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
            raise ValueError(
                f"`tau` must be a finite number > 0, got {tau!r}. With threshold='relative' it is a fraction of "
                "each component's reference statistic (e.g. 0.5; see `reference_at`); with threshold='absolute' a value of the statistic."
            )
        if criterion not in ("grad", "update"):
            raise ValueError(f"`criterion` must be 'grad' (mean |gradient|) or 'update' (weight change), got {criterion!r}.")
        if threshold not in ("relative", "absolute"):
            raise ValueError(f"`threshold` must be 'relative' or 'absolute', got {threshold!r}.")
        self.grace_fraction = check_fraction("grace_fraction", grace_fraction, 0.0, 1.0, high_inclusive=False)
        self.grace_steps = None if grace_steps is None else check_int("grace_steps", grace_steps, 0)
        self.max_frozen_ratio = check_fraction("max_frozen_ratio", max_frozen_ratio, 0.0, 1.0, high_inclusive=True)
        if self.max_frozen_ratio == 0.0:
            raise ValueError("`max_frozen_ratio` must be > 0 (training stops once this fraction is frozen), got 0.")
        self.smoothing = check_fraction("smoothing", smoothing, 0.0, 1.0, high_inclusive=False)
        self.reference_checks = check_int("reference_checks", reference_checks, 1)
        if not isinstance(reference_at, str) or reference_at not in ("early", "grace_end"):
            raise ValueError(
                f"`reference_at` must be 'early' (mean of the first `reference_checks` checks) or 'grace_end' (the "
                f"smoothed statistic at the end of the grace period), got {reference_at!r}."
            )
        self.reference_at: ReferenceAt = reference_at
        self.tau = float(tau)
        self.criterion: Criterion = criterion
        self.threshold: Threshold = threshold
        as_patterns(include, "include")  # a number or a module: a clear error here, not a TypeError inside Trainer()
        as_patterns(exclude, "exclude")
        self.include = include
        self.exclude = exclude
        self.stop = check_bool("stop", stop)
        self.log_stats = check_bool("log_stats", log_stats)
        self.cut_frozen_prefix = check_bool("cut_frozen_prefix", cut_frozen_prefix)
        if min_loss_progress is not None:
            min_loss_progress = check_fraction("min_loss_progress", min_loss_progress, 0.0, 1.0, high_inclusive=True)
        self.min_loss_progress = min_loss_progress

        self._components: dict[str, Component] = {}
        self._names: list[str] = []
        self._reset_run_state()

    # ------------------------------------------------------------------ identity / state
    def _state_key(self) -> str:
        return self._generate_state_key(
            tau=self.tau, criterion=self.criterion, threshold=self.threshold,
            # `components=`: the key's name from before `include`, so older checkpoints still resume
            components=_as_tuple(self.include), exclude=_as_tuple(self.exclude),
            every_n_steps=self.every_n_steps, warmup_steps=self.warmup_steps,
        )

    @property
    def _legacy_state_key(self) -> str:  # type: ignore[override]
        # the key of checkpoints written before the selection and cadence were part of it (Lightning's
        # fallback key)
        return self._generate_state_key(tau=self.tau, criterion=self.criterion, threshold=self.threshold)

    def _reset_run_state(self) -> None:
        super()._reset_run_state()
        self.frozen: dict[str, int] = {}  # component -> step it was frozen at
        # with stop=False, components that converged last but are kept trainable: freezing them would leave the
        # model nothing to train (the next backward would fail)
        self.held: dict[str, int] = {}
        # components this monitor froze that the run made trainable again (a callback's `requires_grad_(True)`): left
        # to train, no longer judged nor counted for the stop, and not frozen again by a rollback
        self.released: dict[str, int] = {}
        self.grace_end: Optional[int] = None
        self.stopped_at: Optional[int] = None
        self._said_unused = False
        self._shared: dict[str, list[str]] = {}
        self._ref_sum: Optional[Tensor] = None
        self._ref_cnt: Optional[Tensor] = None
        self._smoothed: Optional[Tensor] = None
        self._n_ref_checks = 0
        self._snapshot: dict[str, Tensor] = {}
        self._snapshot_step: Optional[int] = None
        self._saved_names: list[str] = []
        # a restored frozen set waits for on_train_start, after the optimizer state is loaded
        self._freeze_pending = False
        self._training = False  # between on_train_start and the end of the run
        self.cut: dict[str, int] = {}  # parameter frozen by the prefix cut -> step
        self.cut_depth = 0  # number of leading blocks the backward no longer runs through
        self._container: Optional[str] = None
        self._front_said = False
        self._step_loss: Optional[Tensor] = None  # the training loss of the armed step (on the device)
        self.losses: list[tuple[int, float]] = []  # (check step, training loss there), for the progress rule

    @property
    def component_patterns(self) -> Optional[Union[str, Sequence[str]]]:
        """Deprecated: the attribute is :attr:`include`."""
        warnings.warn("`GradientEarlyStopping.component_patterns` is deprecated: use `.include`.", DeprecationWarning, stacklevel=2)
        return self.include

    @property
    def components(self) -> list[str]:
        """Names of the components found at setup, in model order."""
        return list(self._names)

    @property
    def frozen_fraction(self) -> float:
        return len(self.frozen) / len(self._names) if self._names else 0.0

    def reference(self) -> Optional[Tensor]:
        """The per-component reference ``r_c`` (see ``reference_at``), or ``None`` before any. With
        ``reference_at="grace_end"``: ``None`` until the end of the grace period; NaN for a component whose
        reference is not taken yet (early: before its first value)."""
        if self._ref_sum is None or self._ref_cnt is None:
            return None
        if self.reference_at == "grace_end":
            if self._n_ref_checks < 1:  # host-side: no device sync
                return None
            return torch.where(self._ref_cnt > 0, self._ref_sum, torch.full_like(self._ref_sum, float("nan")))
        return torch.where(self._ref_cnt > 0, self._ref_sum / self._ref_cnt.clamp(min=1.0),
                           torch.full_like(self._ref_sum, float("nan")))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        ref = self.reference()
        names = self._names
        to_list = (lambda t: None if t is None else [float(x) for x in t.detach().cpu().tolist()])
        state.update(
            frozen=dict(self.frozen),
            held=dict(self.held),
            released=dict(self.released),
            names=list(names),
            reference_sum=to_list(self._ref_sum),
            reference_count=to_list(self._ref_cnt),
            reference_checks_done=self._n_ref_checks,
            smoothed=to_list(self._smoothed),
            reference=to_list(ref),
            reference_at=self.reference_at,
            stopped_at=self.stopped_at,
            cut=dict(self.cut),
            cut_depth=self.cut_depth,
            losses=[list(x) for x in self.losses],
        )
        return state

    def _ours(self, found: dict[str, Any]) -> dict[str, Any]:
        """The components found that this monitor watches: the trainable ones and those it froze itself."""
        return {n: c for n, c in found.items() if c.weight.requires_grad or n in self.frozen}

    def snapshot_state(self) -> dict[str, Any]:
        """What the guard's snapshots hold of this monitor: its statistics (the smoothed values, the reference, the loss
        history), not its freezes, which a rollback does not undo. Kept on, the statistics of the steps a rollback
        undid (gradients of weights on their way out) set a reference 60 times too high and froze 12 of 12 components
        of a run whose spike-free twin froze none."""
        copy_of = (lambda t: None if t is None else t.detach().clone())
        return {"smoothed": copy_of(self._smoothed), "reference_sum": copy_of(self._ref_sum),
                "reference_count": copy_of(self._ref_cnt), "reference_checks_done": self._n_ref_checks,
                "losses": [list(x) for x in self.losses]}

    def load_snapshot_state(self, state: dict[str, Any]) -> None:
        """Go back to a :meth:`snapshot_state`; the frozen, held and cut components stay as they are."""
        self._smoothed, self._ref_sum, self._ref_cnt = state["smoothed"], state["reference_sum"], state["reference_count"]
        self._n_ref_checks = int(state["reference_checks_done"])
        self.losses = [(int(s), float(v)) for s, v in state["losses"]]
        # the update statistic's previous weights are those of a step undone: the next check takes them anew
        self._snapshot, self._snapshot_step = {}, None
        self._step_loss = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.frozen = {str(k): int(v) for k, v in state_dict.get("frozen", {}).items()}
        self.held = {str(k): int(v) for k, v in state_dict.get("held", {}).items()}
        self.released = {str(k): int(v) for k, v in state_dict.get("released", {}).items()}
        self.losses = [(int(s), float(v)) for s, v in state_dict.get("losses", [])]
        self._saved_names = list(state_dict.get("names", []))
        as_tensor = (lambda v: None if v is None else torch.tensor(v, dtype=torch.float32))
        self._ref_sum = as_tensor(state_dict.get("reference_sum"))
        self._ref_cnt = as_tensor(state_dict.get("reference_count"))
        self._smoothed = as_tensor(state_dict.get("smoothed"))
        self._n_ref_checks = int(state_dict.get("reference_checks_done", 0))
        saved_at = state_dict.get("reference_at", "early")  # checkpoints from before the option: "early"
        if saved_at != self.reference_at and self._ref_sum is not None:
            warnings.warn(
                f"GradientEarlyStopping: the checkpoint's reference was taken with reference_at={saved_at!r}, this "
                f"monitor uses reference_at={self.reference_at!r}: the saved reference is dropped and taken again by "
                "this rule from the next checks.",
                stacklevel=2,
            )
            self._ref_sum = torch.zeros_like(self._ref_sum)
            self._ref_cnt = torch.zeros_like(self._ref_sum)
            self._n_ref_checks = 0
        self.stopped_at = state_dict.get("stopped_at")
        self.cut = {str(k): int(v) for k, v in state_dict.get("cut", {}).items()}
        self.cut_depth = int(state_dict.get("cut_depth", 0))
        self._snapshot, self._snapshot_step = {}, None
        found = getattr(self, "_found", None)
        trainer = self._bound_trainer()
        if not self._training and trainer is not None and self._selects_again(trainer.lightning_module):
            # configure_model replaced modules since setup (layers wrapped in adapters): the components are found again
            # at the start of the fit, and the saved names checked there (against setup's they did not match, and the
            # resume failed); frozen once the optimizers exist, as below
            self._freeze_pending = bool(self.frozen or self.cut)
            return
        if found and self._saved_names and not self._training:
            # the components we froze in the run that saved the checkpoint are ours again (frozen by requires_grad on
            # a module resumed as it was left), in the model's order
            taken = self._ours(found)
            if list(taken) != self._names and list(taken) == self._saved_names:
                self._components, self._names = taken, list(taken)
                trainer = self._bound_trainer()
                module = trainer.lightning_module if trainer is not None else None
                if module is not None:
                    self._shared = shared_outside(module, self._components)
                    if self.cut_frozen_prefix:
                        self._container = block_container(module, self._names)
        if self._components:
            self._check_saved_names()
        trainer = self._bound_trainer()
        if self._components and self._training and trainer is not None:
            # loaded while training (by hand): freeze now, freeing the optimizer state
            self._apply_frozen(trainer)
        else:
            # a checkpoint restored by Trainer.fit(ckpt_path=...) is loaded after setup and before
            # configure_optimizers; freezing there would leave the frozen parameters out of an optimizer
            # built over those that require a gradient, and its saved state would not load
            self._freeze_pending = bool(self.frozen or self.cut)

    def _check_saved_names(self) -> None:
        saved = self._saved_names
        if saved and saved != self._names:
            raise ValueError(
                "GradientEarlyStopping: the checkpoint was written for other components "
                f"({len(saved)}: {saved[:4]}...) than this model has ({len(self._names)}: {self._names[:4]}...). "
                "Resume with the same model and the same `include`/`exclude` patterns."
            )
        unknown = sorted(set(self.frozen) - set(self._names))
        if unknown:
            raise ValueError(f"GradientEarlyStopping: frozen components {unknown} of the checkpoint are not in this model.")

    def frozen_parameters(self, trainer: pl.Trainer) -> list[Tensor]:
        """The parameters this monitor has frozen: the frozen components' and those of the prefix cut."""
        if self.idle_reason is not None or not self._components:
            return []
        params = [p for name in self.frozen if name in self._components for p in self._components[name].params]
        if self.cut:
            named = dict(trainer.lightning_module.named_parameters())
            params += [named[n] for n in self.cut if n in named]
        return params

    def refreeze(self, trainer: pl.Trainer) -> None:
        """Free again the optimizer state of the frozen parameters (after something loaded it back: a rollback)."""
        if self.idle_reason is None and self._components:
            self._apply_frozen(trainer)

    def _apply_frozen(self, trainer: pl.Trainer) -> None:
        for name in self.frozen:
            freeze_parameters(self._components[name].params, trainer.optimizers)
        if self.cut:
            params = dict(trainer.lightning_module.named_parameters())
            unknown = sorted(set(self.cut) - set(params))
            if unknown:
                raise ValueError(
                    f"GradientEarlyStopping: parameters {unknown[:6]} frozen by the prefix cut of the checkpoint are "
                    "not in this model."
                )
            freeze_parameters([params[n] for n in self.cut], trainer.optimizers)

    def _cut_prefix(self, trainer: pl.Trainer, step: int) -> None:
        """With ``cut_frozen_prefix``: freeze what is left of the leading fully frozen blocks when nothing in
        front of them trains, so that the backward stops at their end (see the class docstring). Derived
        from the frozen set and the model alone, so every rank cuts the same parameters on the same step."""
        if not self.cut_frozen_prefix or self._container is None:
            return
        module = trainer.lightning_module
        prefix = frozen_prefix(module, self._container)
        if prefix.depth == 0 or (prefix.depth <= self.cut_depth and not prefix.params):
            return
        blocks = f"blocks {self._container}.0..{prefix.depth - 1}" if prefix.depth > 1 else f"block {self._container}.0"
        if prefix.front:
            if not self._front_said:
                self._front_said = True
                self.alert(
                    step, "prefix_not_cut", "info",
                    f"The weight matrices of {blocks} are all frozen, but {len(prefix.front)} parameter(s) in "
                    f"front of the blocks train ({list(prefix.front)[:4]}): the backward still runs through the "
                    "frozen blocks to reach them. Freeze them (requires_grad=False) for cut_frozen_prefix to stop it there.",
                    value=float(prefix.depth),
                )
            return
        freeze_parameters(prefix.params.values(), trainer.optimizers)
        for name in prefix.params:
            self.cut[name] = step
        self.cut_depth = prefix.depth
        self.alert(
            step, "prefix_cut", "info",
            f"The backward now stops at the end of {blocks} (weight matrices all frozen, nothing trainable in "
            f"front of the blocks); froze the {len(prefix.params)} parameter(s) left there "
            f"({list(prefix.params)[:4]}{'...' if len(prefix.params) > 4 else ''}).",
            value=float(prefix.depth), details={"params": list(prefix.params)},
        )
        self._verify_cut(module, prefix.depth, step)

    def _verify_cut(self, module: torch.nn.Module, depth: int, step: int) -> None:
        """At the next training forward of the first block after the cut, check that nothing entering it
        requires a gradient (something trainable that ``named_parameters()`` lists after the blocks but that
        runs before them would keep the backward going); say so once if it does."""
        blocks = list(module.get_submodule(self._container or "").children())
        if depth >= len(blocks):
            return

        def check(block: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if not (torch.is_grad_enabled() and block.training):
                return
            handle.remove()
            inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)]
            if any(t.requires_grad for t in inputs):
                self.alert(
                    step, "prefix_cut_ineffective", "warning",
                    f"cut_frozen_prefix froze the rest of the first {depth} block(s), but the input of block {depth} "
                    "still requires a gradient: something trainable runs before the blocks that named_parameters() "
                    "lists after them, so the backward still runs through the frozen blocks.",
                    value=float(depth),
                )

        handle = self.keep(blocks[depth].register_forward_pre_hook(check, with_kwargs=True), until_end=True)

    # ------------------------------------------------------------------ setup
    def select(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_strategy(trainer)
        if self.grace_steps is None and self.grace_fraction > 0 and trainer.max_steps == -1 and trainer.max_epochs == -1:
            # NothingToWatch (a ValueError): raised as is, or, in the preset, the monitor stays idle and says why
            raise NothingToWatch(
                f"GradientEarlyStopping: `grace_fraction={self.grace_fraction}` is a fraction of the planned steps, but "
                "the run has no planned length (max_steps=-1 and max_epochs=-1; `max_time` bounds it in time only). "
                "Set `Trainer(max_steps=...)`, or give the grace period in steps with `grace_steps=...`, or use "
                "`grace_fraction=0`."
            )
        with reading_weights(pl_module.modules()):  # parametrized weights (spectral_norm) read without side effects
            found = find_components(pl_module, self.include, self.exclude, trainable_only=False, allow_empty=True)
        # a component frozen before the run (and not by us) is not ours to watch; those we froze are told apart once a
        # checkpoint's frozen set is loaded (see load_state_dict: a resume with the very module trained, whose
        # components we froze, found them frozen "before the run", and the checkpoint's components no longer matched)
        self._found = found
        self._components = self._ours(found)
        self._names = list(self._components)
        if not self._components:
            from lightning.pytorch.callbacks import BaseFinetuning

            thawing = [type(c).__name__ for c in trainer.callbacks if isinstance(c, BaseFinetuning)]
            later = (f" {thawing[0]} froze them and may unfreeze them later in the run; GradES watches the components "
                     "trainable when the fit starts and does not take up those unfrozen later (use it in a fit that "
                     "starts after the unfreeze, or without the finetuning callback)." if thawing else "")
            raise NothingToWatch(no_component_reason(pl_module, self.include) if not found else (
                f"every component found in {type(pl_module).__name__} is already frozen "
                f"({list(found)[:6]}...); nothing is left to watch.{later}"
            ))
        self._check_saved_names()
        if self.include is None:
            # trainable matrices in the blocks that no naming scheme holds keep training when every component is frozen:
            # said once, so that "all frozen" is not read as "nothing left to learn"
            left = uncovered_matrices(pl_module, self._components)
            if left:
                self.alert(
                    trainer.global_step, "matrices_not_watched", "info",
                    f"GradientEarlyStopping watches {len(self._components)} component(s); {len(left)} trainable "
                    f"matrices inside the blocks belong to none and are never frozen: {', '.join(left[:6])}"
                    f"{' ...' if len(left) > 6 else ''}. They keep training while the components freeze, and the run "
                    "stops once the components are frozen (`stop=False` trains on).",
                    value=float(len(left)),
                )
        # a parameter a component shares with a module outside it (a weight tied by assignment) freezes there too
        self._shared = shared_outside(pl_module, self._components)
        if self._shared:
            listed = [f"{n} (with {', '.join(o[:3])}{' ...' if len(o) > 3 else ''})" for n, o in self._shared.items()]
            self.alert(
                trainer.global_step, "shared_parameters", "info",
                f"{len(listed)} component(s) share a parameter with a module outside them: {'; '.join(listed[:4])}"
                f"{' ...' if len(listed) > 4 else ''}. Freezing the component freezes the shared parameter in that "
                "module too, and a gradient reaching the parameter through it counts in the component's statistic. "
                "Pass `exclude=` to leave such a component trainable.",
                value=float(len(listed)),
            )
        self._training = False
        # a frozen set loaded before the run is applied at on_train_start (see there)
        self._freeze_pending = bool(self.frozen or self.cut)
        self._container = block_container(pl_module, self._names) if self.cut_frozen_prefix else None
        if self.cut_frozen_prefix and self._container is None:
            self.alert(
                trainer.global_step, "prefix_cut_unavailable", "info",
                "cut_frozen_prefix: the components are not all inside the numbered blocks of one nn.ModuleList or "
                f"nn.Sequential ({self._names[:4]}...), so the block order is unknown; the backward is not cut.",
            )

    @staticmethod
    def _check_strategy(trainer: pl.Trainer) -> None:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = trainer.strategy
        kind = type(strategy).__name__
        if "FSDP" in kind or "DeepSpeed" in kind:
            raise ValueError(
                f"GradientEarlyStopping does not support {kind}: it freezes parameters by `requires_grad`, which "
                "sharded flat parameters cannot do per matrix. Use ModelParallelStrategy (FSDP2 `fully_shard`, "
                "supported), DDP or a single device; see docs/distributed.md."
            )
        if isinstance(strategy, DDPStrategy):
            from lightning_monitor._compat import ddp_kwargs

            kwargs = ddp_kwargs(strategy)
            if kwargs is None:  # this Lightning keeps them elsewhere: say what to check, do not guess
                warnings.warn(
                    "GradientEarlyStopping could not read the DDPStrategy's settings in this Lightning version; it "
                    "freezes parameters mid-run, so make sure DDP runs with `find_unused_parameters=True` and "
                    "without `static_graph`.",
                    stacklevel=2,
                )
                return
            if kwargs.get("static_graph", False):
                raise ValueError(
                    "GradientEarlyStopping freezes parameters mid-run, which changes the graph DDP's `static_graph=True` "
                    "assumes fixed. Use `strategy=DDPStrategy(find_unused_parameters=True)` without static_graph."
                )
            if not kwargs.get("find_unused_parameters", False):
                raise ValueError(
                    # (DDP's own words for that failure are not quoted: Lightning replaces any message holding them
                    # with its advice about unused parameters, which named neither GradES nor the spawn variant)
                    "GradientEarlyStopping freezes parameters mid-run; DDP then needs `find_unused_parameters=True`, "
                    "or the step after a freeze fails in DDP's reducer (a reduction not finished in the prior step). Use "
                    "`strategy='ddp_find_unused_parameters_true'` (or 'ddp_spawn_find_unused_parameters_true') or "
                    "`strategy=DDPStrategy(find_unused_parameters=True)`."
                )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.select_built_model(trainer, pl_module)
        if self.idle_reason is not None or self.refuse_several_optimizers(
            trainer, ": a component's gradient is read at one optimizer's step, where the other optimizers' "
            "parameters hold stale or no gradients, so the statistics would mix steps. GradES supports one optimizer.",
        ):
            return
        # FSDP2 (`fully_shard` in configure_model, after setup) replaces every parameter by a new DTensor
        # parameter: read the components' parameters again, now that the model is final
        with reading_weights(pl_module.modules()):  # parametrized weights (spectral_norm) read without side effects
            found = find_components(pl_module, self.include, self.exclude, trainable_only=False, allow_empty=True)
        self._components = {n: found[n] for n in self._components if n in found}
        self._names = [n for n in self._names if n in self._components]
        flags = {is_sharded(p) for c in self._components.values() for p in c.params}
        self._sharded = True in flags
        if self._sharded and self._container is not None:
            self._container = None
            self.alert(
                trainer.global_step, "prefix_cut_unavailable", "info",
                "cut_frozen_prefix is not applied to sharded (FSDP2) parameters; the backward is not cut.",
            )
        if self._sharded and trainer.world_size > 1 and len(flags) > 1:
            raise ValueError(
                "GradientEarlyStopping: some watched parameters are sharded (FSDP2 DTensors) and others are plain "
                "tensors; under FSDP2 every watched module must be inside a `fully_shard`-ed module (a plain "
                "parameter's gradient is not reduced across ranks). Shard them, or leave them out with `exclude=[...]`."
            )
        in_optimizer = {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
        outside = [n for n, c in self._components.items()
                   if n not in self.frozen and any(id(p) not in in_optimizer for p in c.params)]
        # frozen before the fit (a backbone that BackboneFinetuning unfreezes later, a model fine-tuned in part): there
        # is nothing of theirs to watch or to freeze; left out, said once
        held = [n for n in outside if not any(p.requires_grad for p in self._components[n].params)]
        if held:
            self._components = {n: c for n, c in self._components.items() if n not in held}
            self._names = [n for n in self._names if n not in held]
            self.alert(
                trainer.global_step, "components_left_out", "info",
                f"GradientEarlyStopping leaves out {len(held)} component(s) frozen when the fit starts (not trained, "
                f"not in the optimizer): {held[:6]}{'...' if len(held) > 6 else ''}. Components unfrozen later are "
                "not watched.",
            )
            if not self._components:
                self.nothing_to_watch(trainer, "every component is frozen when the fit starts")
                return
        missing = [n for n in outside if n not in held]
        if missing:
            raise ValueError(
                f"GradientEarlyStopping: the optimizer does not hold the parameters of {len(missing)} component(s) "
                f"({missing[:6]}{'...' if len(missing) > 6 else ''}); their statistic would not describe training. "
                "Build the optimizer over all parameters (also those frozen later), or leave these modules out "
                "with `exclude=[...]`."
            )
        if self.grace_steps is not None:
            self.grace_end = self.grace_steps
        elif self.grace_fraction == 0.0:
            self.grace_end = 0
        else:
            planned = _planned_steps(trainer)
            if trainer.world_size > 1:
                # the fewest of the ranks': their epochs may differ in length (a sampler of the user's,
                # `use_distributed_sampler=False`), and a rank whose grace ended first asked the others to agree on
                # a stop they never reached (gloo aborted both). Every rank now ends its grace at the same step
                count = torch.tensor(float(planned), dtype=torch.float64, device=trainer.strategy.root_device)
                planned = float(trainer.strategy.reduce(count, reduce_op="min"))
                planned = int(planned) if math.isfinite(planned) else planned
            if planned == 0 or trainer.limit_train_batches == 0 or trainer.max_steps == 0:
                # nothing will train (a fit run for its validation): idle, and no error to end a run that has no steps
                self.nothing_to_watch(trainer, "no training step is planned (`limit_train_batches=0`, `max_steps=0` "
                                      "or empty training data)", training=True)
                return
            if not math.isfinite(planned) or planned < 0:
                # infinite, or -1: `max_epochs` over an iterable dataset without a length (a grace period of 0 steps
                # took the reference in the first steps' transient)
                self.nothing_to_watch(
                    trainer, f"`grace_fraction={self.grace_fraction}` needs the planned number of steps, which is "
                    f"unknown ({planned}: no `max_steps`, and the training data has no length). Set "
                    "`Trainer(max_steps=...)` or use `grace_steps=...`.")
                return
            self.grace_end = int(self.grace_fraction * planned)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The frozen set of a restored checkpoint (or of a state loaded before fit) is applied here,
        # after configure_optimizers ran and Lightning loaded the optimizer state: an optimizer built
        # over the parameters that require a gradient (`filter(lambda p: p.requires_grad, ...)`) then
        # holds the same parameters as when the checkpoint was written, so its state loads; the state
        # of the frozen parameters is freed here. No optimizer step comes before this hook.
        self._training = True
        if self.idle_reason is not None:
            return
        if self._freeze_pending:
            self._apply_frozen(trainer)
            self._freeze_pending = False
        self._cut_prefix(trainer, trainer.global_step)
        if self.stop and self.stopped_at is not None and not trainer.should_stop:
            # resumed from a state this monitor had stopped (a checkpoint written at the stop): it stops again before
            # any step (the run trained on with every component frozen; with nothing else to train, it failed)
            self.request_stop(
                trainer, trainer.global_step, True, "stop",
                f"Resumed from a state in which GradientEarlyStopping had stopped the run (step {self.stopped_at}, "
                f"{len(self.frozen)}/{len(self._names)} components frozen): stopping again. Pass stop=False (or a new "
                "GradientEarlyStopping) to train on.",
                value=self.frozen_fraction, threshold=self.max_frozen_ratio,
            )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._training = False

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        self._training = False

    # ------------------------------------------------------------------ the check
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """The training loss of a step due for a check (summed over its micro-batches, whose losses Lightning has
        divided by their number), on the device: a step whose loss is not finite is left out of the statistics
        (see :meth:`compute`), and ``min_loss_progress`` reads it with them. Nothing on other steps."""
        if self.idle_reason is not None or self._armed_step != trainer.global_step:
            return
        value = loss.detach().float().sum()
        self._step_loss = value if self._step_loss is None else self._step_loss + value

    def release(self) -> None:
        super().release()
        # the loss of a due step whose check never came (its optimizer step skipped) is not the next check's
        self._step_loss = None

    def _loss_window(self) -> int:
        """Steps over which the progress of the loss is read: a third of the grace period (10% of the planned steps
        at the default grace), at least four checks."""
        return max(4 * self.every_n_steps, (self.grace_end or 0) // 3)

    def _still_learning(self, step: int) -> Optional[tuple[float, float, float, int]]:
        """``(before, now, initial, window)`` when the training loss fell over the last window by more than
        ``min_loss_progress`` times its initial level (medians of the losses read at the checks of the last window
        and of the window before, and of the first three checks), else ``None``: also when too few checks were read
        to tell."""
        if self.min_loss_progress is None:
            return None
        w = self._loss_window()
        recent = [v for s, v in self.losses if step - w < s <= step]
        before = [v for s, v in self.losses if step - 2 * w < s <= step - w]
        if len(recent) < 2 or len(before) < 2 or len(self.losses) < 3:
            return None
        initial = abs(_median([v for _, v in self.losses[:3]]))
        b, r = _median(before), _median(recent)
        if initial > 0.0 and b - r > self.min_loss_progress * initial:
            return b, r, initial, w
        return None

    def arm(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> bool:
        self._notice_released(trainer, step)
        # nothing left to judge once every component is frozen (or, with stop=False, frozen or held)
        return len(self.frozen) + len(self.held) + len(self.released) < len(self._names)

    def _judged(self) -> list[str]:
        """The components still judged: neither frozen, nor held trainable, nor released by the run."""
        return [n for n in self._names if n not in self.frozen and n not in self.held and n not in self.released]

    def _notice_released(self, trainer: pl.Trainer, step: int) -> None:
        """Components this monitor froze whose parameters require a gradient again: the run unfroze them (a callback's
        ``requires_grad_(True)``). They were still reported frozen (``frozen``, ``grades/frozen_fraction``) while they
        trained, and a rollback froze them again. Now they are released: left to train, no longer judged, not counted
        for the stop (said once per check that finds some). The same on every rank when the ranks run the same code."""
        found = [n for n in self.frozen if any(p.requires_grad for p in self._components[n].params)]
        if not found:
            return
        for name in found:
            del self.frozen[name]
            self.released[name] = step
        self.alert(
            step, "released", "info",
            f"{len(found)} component(s) GradientEarlyStopping froze require gradients again (unfrozen by the run, e.g. "
            f"a callback's `requires_grad_(True)`): {', '.join(found[:6])}{' ...' if len(found) > 6 else ''}. They are "
            f"left to train and no longer judged; {len(self.frozen)}/{len(self._names)} components frozen.",
            value=float(len(found)), details={"components": list(found)},
        )
        self.log_metrics(trainer, {self.key("frozen_fraction"): self.frozen_fraction}, step)

    def compute(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> dict[str, Any]:
        """The statistic of every component (all-reduced), its EMA and reference, and which components
        fall below ``tau`` (``\\x00``-prefixed vectors over the components, for :meth:`judge`)."""
        active = self._judged()
        stat = self._statistic(active, step)
        loss, self._step_loss = self._step_loss, None
        if stat is None:  # first check of the update criterion: a snapshot only
            return {self.key("frozen_fraction"): self.frozen_fraction}
        device = stat.device
        if loss is not None:
            # a step whose loss is not finite tells nothing of convergence: every statistic NaN, on the device (no
            # sync), before the all-reduce, which then spreads it to every rank
            stat = torch.where(torch.isfinite(loss.to(device)), stat, torch.full_like(stat, float("nan")))
        if getattr(self, "_sharded", False) and trainer.world_size > 1:
            # FSDP2: each rank holds its part of each component's mean |.| (see _local_mean_abs): summed, the
            # statistic of the full tensors, the same on every rank (one all-reduce of one float per component)
            stat = trainer.strategy.reduce(stat, reduce_op="sum")
        elif trainer.world_size > 1:
            stat = trainer.strategy.reduce(stat, reduce_op="mean")
        n = len(self._names)
        position = {name: i for i, name in enumerate(self._names)}
        index = torch.tensor([position[a] for a in active], device=device)
        full = torch.full((n,), float("nan"), device=device, dtype=stat.dtype).index_copy(0, index, stat)
        # a check with a non-finite loss, or whose statistics are all exactly zero (DivergenceGuard listed before this
        # callback zeroes the gradients of a non-finite step), is left out: no value enters the EMA or the reference,
        # and nothing freezes on it. Read, the zeroed step gave every component a ratio of 0 and froze them all
        informative = (torch.isfinite(full) & (full != 0)).any()
        full = torch.where(informative, full, torch.full_like(full, float("nan")))
        finite = torch.isfinite(full)
        self._move_state(device, n)
        late = self.reference_at == "grace_end"
        if not late:
            # each component's first `reference_checks` values (a component without a gradient at the run's first
            # checks, one that joins the forward later, takes its reference from its own first values)
            take = finite & (self._ref_cnt < self.reference_checks)
            self._ref_sum = self._ref_sum + torch.where(take, full, torch.zeros_like(full))
            self._ref_cnt = self._ref_cnt + take.float()
            self._n_ref_checks = min(self._n_ref_checks + 1, self.reference_checks)
        if self._smoothed is None:
            smoothed = full
        else:  # a component without a value yet starts its EMA at its first finite value
            ema = torch.where(torch.isfinite(self._smoothed), ema_update(self._smoothed, full, self.smoothing), full)
            smoothed = torch.where(finite, ema, self._smoothed)
        self._smoothed = smoothed
        past_grace = step >= (self.grace_end or 0)
        # the components whose reference is complete: with grace_end, taken before this check; early, from as many
        # values as `reference_checks`
        judgeable: Optional[Tensor] = (self._ref_cnt >= self.reference_checks
                                       if not late and self.threshold == "relative" else None)
        if late and self.threshold == "relative" and past_grace:
            # the reference is the smoothed (all-reduced) statistic at the first check past the grace period,
            # taken once per component: the same on every rank
            judgeable = self._ref_cnt > 0
            take = ~judgeable & torch.isfinite(smoothed) & informative
            self._ref_sum = torch.where(take, smoothed, self._ref_sum)
            self._ref_cnt = torch.where(take, torch.ones_like(self._ref_cnt), self._ref_cnt)
            self._n_ref_checks = 1
        reference = self.reference() if self.threshold == "relative" else None
        decide = past_grace and (
            self.threshold == "absolute" or late or self._n_ref_checks >= self.reference_checks)
        mask = freeze_mask(smoothed, reference, self.tau) & informative if decide else torch.zeros_like(finite)
        if judgeable is not None:
            mask = mask & judgeable
        values: dict[str, Any] = {"\x00stat": full, "\x00mask": mask.float(), "\x00decide": float(decide),
                                  "\x00seen": torch.isfinite(smoothed).float()}
        if self.min_loss_progress is not None:
            # the ranks' mean: every rank holds the same history, so the same freezes wait
            loss = torch.full((), float("nan"), device=device) if loss is None else loss.to(device)
            values["\x00loss"] = trainer.strategy.reduce(loss, reduce_op="mean") if trainer.world_size > 1 else loss
        if reference is None:
            values["\x00judged"] = smoothed  # absolute threshold: the smoothed statistic is what is judged
        else:
            values["\x00ratio"] = relative_ratio(smoothed, reference)
        return values

    def judge(self, trainer: pl.Trainer, step: int, values: dict[str, Any]) -> dict[str, float]:
        """Freeze the components below ``tau`` (the same on every rank: the statistic was reduced), say
        so, and stop once ``max_frozen_ratio`` is frozen; logs the statistics and the frozen fraction."""
        if "\x00stat" not in values:
            return values
        position = {name: i for i, name in enumerate(self._names)}
        active = self._judged()
        vectors = {k: (v if isinstance(v, list) else [v]) for k, v in values.items() if k != "\x00decide"}
        stat_h, mask_h, ratio_h = vectors["\x00stat"], vectors["\x00mask"], vectors.get("\x00ratio")
        judged_h = ratio_h if ratio_h is not None else vectors["\x00judged"]
        newly = [n for n in active if mask_h[position[n]] > 0.5]
        loss_h = values.get("\x00loss")
        if isinstance(loss_h, list):
            loss_h = loss_h[0]
        if loss_h is not None and math.isfinite(loss_h):
            self.losses.append((step, float(loss_h)))
            # what the rule reads: the first three checks and the last two windows (a checkpoint stays small)
            since = step - 2 * self._loss_window()
            if len(self.losses) > 3 and self.losses[3][0] <= since:
                self.losses = self.losses[:3] + [x for x in self.losses[3:] if x[0] > since]
        if newly and self.min_loss_progress is not None:
            learning = self._still_learning(step)
            if learning is not None:
                before, now, initial, w = learning
                self.condition(
                    step, "still_learning", True, "info",
                    f"{len(newly)} component(s) fell below tau, but the training loss still falls: from {before:.4g} "
                    f"to {now:.4g} over the last {w} steps (medians at the checks), more than min_loss_progress="
                    f"{self.min_loss_progress:g} of its initial {initial:.4g}. Their gradients shrank while the model "
                    "still learns (a model-wide shrink: a growing logit scale, a loss near a plateau it leaves): no "
                    "component freezes until the loss settles.",
                    value=before - now, threshold=self.min_loss_progress * initial,
                )
                newly = []
            else:
                self.condition(step, "still_learning", False, "info", "",
                               clear_message="The training loss settled: components below tau freeze again.")
        if newly and self._nothing_left(trainer, newly):
            # also with stop=True: Lightning defers a stop until `min_steps` / `min_epochs`, and the steps until then
            # would have nothing to train (the backward fails)
            keep = max(newly, key=lambda n: judged_h[position[n]])  # the least converged of them
            newly.remove(keep)
            self._hold(step, keep)
        metrics: dict[str, float] = {}
        if self.log_stats:
            for name in active:
                if not math.isfinite(stat_h[position[name]]):
                    continue  # no gradient this step (module unused)
                metrics[self.key("stat", name)] = stat_h[position[name]]
                # no ratio before the reference (NaN), nor after a zero reference while the component moves (inf:
                # it never freezes); loggers get numbers only
                if ratio_h is not None and math.isfinite(ratio_h[position[name]]):
                    metrics[self.key("ratio", name)] = ratio_h[position[name]]
        for name in newly:
            freeze_parameters(self._components[name].params, trainer.optimizers)
            self.frozen[name] = step
            self._snapshot.pop(name, None)
        metrics[self.key("frozen_fraction")] = self.frozen_fraction
        for name in newly:
            value = judged_h[position[name]]
            when = "early" if self.reference_at == "early" else "end-of-grace"
            how = f"fell to {value:.3g} of its {when} value" if ratio_h is not None else f"is {value:.3g}"
            self.alert(
                step, "frozen", "info",
                f"Froze {name}: its smoothed {self.criterion} statistic {how} (< tau={self.tau:g}); "
                f"{len(self.frozen)}/{len(self._names)} components frozen."
                + (f" Its parameters shared with {', '.join(self._shared[name])} are frozen there too."
                   if name in self._shared else ""),
                value=value, threshold=self.tau, layer=name,
            )
        if newly:
            self._cut_prefix(trainer, step)
        # components no check has seen a gradient of (a branch the forward never takes: Longformer's global-attention
        # projections without a global token): they cannot converge, so they do not hold the stop back (said once)
        seen_h = vectors.get("\x00seen")
        unused = [n for n in active if seen_h is not None and seen_h[position[n]] < 0.5]
        if values["\x00decide"] and unused and not self._said_unused:
            self._said_unused = True
            self.alert(
                step, "unused_components", "info",
                f"{len(unused)} of {len(self._names)} components have had no gradient at any check so far (their "
                f"modules never took part in the loss): {', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}. "
                "They are not counted for the stop until they get one.",
                value=float(len(unused)),
            )
        if values["\x00decide"] and self.stop:  # the same on every rank: no collective skipped on one rank only
            counted = len(self._names) - len(unused) - len(self.released)
            done = (len(self.frozen) + len(self.held)) / counted if counted > 0 else 0.0  # held: converged
            stopped = self.request_stop(
                trainer, step, done >= self.max_frozen_ratio, "stop",
                f"{len(self.frozen)}/{len(self._names)} components frozen"
                + (f" and {len(self.held)} converged but kept trainable" if self.held else "")
                + (f", {len(unused)} never used" if unused else "")
                + (f", {len(self.released)} released" if self.released else "")
                + f": the converged share of those counted, {done:.3g}, is >= max_frozen_ratio="
                f"{self.max_frozen_ratio:g}; stopping training.",
                value=self.frozen_fraction, threshold=self.max_frozen_ratio,
            )
            if stopped:
                self.stopped_at = step
        return metrics

    def _nothing_left(self, trainer: pl.Trainer, newly: list[str]) -> bool:
        """Whether freezing ``newly`` would leave no parameter of the optimizers to train (the same on every rank)."""
        going = {id(p) for n in newly for p in self._components[n].params}
        return not any(p.requires_grad and id(p) not in going
                       for opt in trainer.optimizers for g in opt.param_groups for p in g["params"])

    def _hold(self, step: int, name: str) -> None:
        """The last component to converge stays trainable when freezing it would leave the model nothing to train (said
        once): the next backward would fail, with ``stop=False`` (the run goes on) or with a stop Lightning defers
        (``min_steps``, ``min_epochs``)."""
        self.held[name] = step
        if self.stop:
            why = (f"stopping; {name} stays trainable for the steps Lightning may still run before it stops "
                   "(`min_steps`, `min_epochs`): freezing it too would leave the model nothing to train.")
        else:
            why = (f"but stop=False: {name} stays trainable so that training goes on (freezing it too would leave the "
                   "model nothing to train); no more checks. Pass stop=True to end the run here instead.")
        self.alert(step, "held_trainable", "info", f"Every component has converged, {why}", layer=name)

    def _statistic(self, active: list[str], step: int) -> Optional[Tensor]:
        comps = [self._components[n] for n in active]
        mean_abs = _local_mean_abs if getattr(self, "_sharded", False) else _full_mean_abs
        if self.criterion == "grad":
            grads = [c.weight.grad for c in comps]
            if all(g is not None for g in grads):
                return mean_abs(grads)  # type: ignore[arg-type]
            device = comps[0].weight.device
            present = [g for g in grads if g is not None]
            out = torch.full((len(comps),), float("nan"), device=device, dtype=torch.float32)  # as mean_abs
            if present:
                idx = torch.tensor([i for i, g in enumerate(grads) if g is not None], device=device)
                out = out.index_copy(0, idx, mean_abs(present))
            return out
        # criterion == "update"
        weights = [c.weight.detach() for c in comps]
        if getattr(self, "_sharded", False):
            return self._sharded_update(active, weights, step)
        if self._snapshot_step is None or any(n not in self._snapshot for n in active):
            self._snapshot = {n: w.clone() for n, w in zip(active, weights)}
            self._snapshot_step = step
            return None
        previous = [self._snapshot[n] for n in active]
        stat = mean_abs_update(weights, previous, steps=max(1, step - self._snapshot_step))
        from lightning_monitor._compat import foreach_copy_

        foreach_copy_(previous, weights)
        self._snapshot_step = step
        return stat

    def _sharded_update(self, active: list[str], weights: list[Tensor], step: int) -> Optional[Tensor]:
        """The update criterion on DTensor weights: snapshots of the local shards, this rank's part of each
        component's mean |weight change| (summed across ranks by the caller)."""
        if self._snapshot_step is None or any(n not in self._snapshot for n in active):
            self._snapshot = {n: local(w).clone() for n, w in zip(active, weights)}
            self._snapshot_step = step
            return None
        steps = max(1, step - self._snapshot_step)
        diffs = [local(w) - self._snapshot[n] for n, w in zip(active, weights)]
        stat = _scaled_parts(diffs, weights) / steps
        for n, w in zip(active, weights):
            self._snapshot[n].copy_(local(w))
        self._snapshot_step = step
        return stat

    def _move_state(self, device: torch.device, n: int) -> None:
        if self._ref_sum is None or self._ref_cnt is None or self._ref_sum.numel() != n:
            self._ref_sum = torch.zeros(n, device=device, dtype=torch.float32)
            self._ref_cnt = torch.zeros(n, device=device, dtype=torch.float32)
            self._n_ref_checks = 0
            self._smoothed = None
        elif self._ref_sum.device != device:
            self._ref_sum, self._ref_cnt = self._ref_sum.to(device), self._ref_cnt.to(device)
        if self._smoothed is not None and self._smoothed.device != device:
            self._smoothed = self._smoothed.to(device)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])

"""SpectralAlignmentMonitor: early warning of loss explosions from the sign diversity of spectral
alignment (Qiu et al., arXiv 2510.04202).

On every due step the monitor samples the input rows of each selected layer during the forward
pass, and in ``on_before_optimizer_step`` (weights not yet updated, so they are the weights that saw
those inputs) it computes per layer

* ``sigma``: the top singular value of ``W`` by warm-started power iteration (the singular vectors
  persist between checks and in the checkpoint);
* the alignments ``a_t = cos(x_t, v_1)`` of the sampled rows with the top right singular vector;
* ``sign_diversity`` ``D = 2 min(p, 1 - p)`` (``p``: fraction of positive ``a_t``) and ``mean_abs``.

Layers: ``nn.Linear`` (``W`` its weight, the rows its input's last dimension); Hugging Face ``Conv1D``
(GPT-2's projections, ``y = x @ W + b``: ``W`` is its weight transposed); ``nn.Conv2d`` with
``groups=1`` (``W`` its weight as the ``[C_out, C_in * kh * kw]`` matrix, the rows its input patches,
exactly what the convolution multiplies: ``y_l = W p_l + b`` for the patch ``p_l`` at output position
``l``; a few random examples are unfolded per check, only as many as hold ``max_rows`` patches);
``nn.MultiheadAttention`` (``W`` its packed q/k/v input projection ``in_proj_weight``, the rows its query: the
input of all three in self-attention, of the query's third in cross-attention) and its ``out_proj``, whose weight
the attention uses without calling it: on due steps the attention's calls are routed through ``out_proj`` (the same
product), so that its input is seen. Grouped and depthwise convolutions are left out: their weight is block
diagonal, one ``[C_out/g, C_in/g * k]`` matrix per group, with no single top singular direction over the layer's
input. A selected layer that does not run in a check's forward is named once in a ``layers_not_called`` warning
alert.

Rules (model level; every threshold is relative to the run's own history):

* **collapse.** A layer's baseline is the median of its ``D`` over the last ``baseline_window``
  checks outside a collapse; the first ``baseline_checks`` checks (after ``warmup_steps``) only build
  it. A layer is *eligible* when its baseline is at least ``min_baseline`` and its inputs at the check are not
  all ``>= 0``: layers whose inputs share a sign by nature (after GELU/ReLU) sit at ``D ~ 0`` in healthy
  training and never count (a ReLU-fed layer's early baseline, with ``v_1`` still random, can be high). The
  condition holds at a check when ``collapsed_fraction`` (the share of eligible layers with
  ``D <= collapse_threshold``) is at least ``warn_fraction``, or when ``diversity_ratio`` (the eligible
  layers' mean ``D`` over the mean of their baselines) is at most ``1 - max_drop``, provided the drop is beyond
  what sampling the rows explains: a layer's ``D`` from ``n`` rows has variance ``b (2 - b) / n`` about its
  baseline ``b``, and the eligible layers' summed drop ``sum(b - D)`` must exceed ``NOISE_Z`` (2) times the
  square root of the summed variances. With few rows a check (a batch of 8 samples gives 8 rows, so ``D``
  moves in steps of 0.25) the mean of three layers fell below 80% of its baseline by chance, three checks in
  a row, 2-4 times per healthy 3000-step run; with 256 rows the bar is a few hundredths. Held for
  ``patience`` consecutive checks it raises a warning, held for ``critical_patience`` (if set) a critical
  alert (which makes a DivergenceGuard act); it clears, with one info alert, once it has not held for
  ``patience`` consecutive checks (a condition that comes and goes at the threshold is said once, not at
  every return).
* **sigma_growth.** ``sigma_growth`` is the growth of the largest ``sigma_1`` over the monitored layers
  (those measured at both checks) per ``growth_window`` steps; at or above ``max_sigma_growth`` for ``patience`` consecutive checks it
  raises a ``sigma_growth`` alert (``sigma_growth_severity``, a warning by default), cleared as above. Coherent inputs
  make ``sigma_1`` grow step after step; in our benchmark this rule warned earliest on runs with
  LayerNorm (see ``docs/spectral_alignment.md``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from lightning_monitor._sharded import is_sharded
from lightning_monitor._args import check_bool, check_fraction, check_int, resolve_callable
from lightning_monitor.callbacks.base import Monitor, NothingToWatch, Streak, reading_weights
from lightning_monitor.functional.spectral import (
    MAX_BATCH_ELEMENTS,
    sign_diversity,
    spectral_alignment,
    spectral_alignments,
    top_singular_subspaces,
)
from lightning_monitor.probes.inputs import InputCapture
from lightning_monitor.probes.per_example.attention import route_out_proj
from lightning_monitor.selection import as_patterns, linear_types, select_modules, weight_matrix

__all__ = ["SpectralAlignmentMonitor", "find_output_head"]


def _module_at(model: nn.Module, name: str) -> Optional[nn.Module]:
    """The submodule of ``model`` named ``name`` now, or ``None`` where there is none."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None

#: prefix of the per-layer flag "inputs all >= 0 at this check", carried from compute to judge (never logged)
_ONE_SIGN = "\x00one_sign/"
#: per layer, the number of rows with an alignment (read on the host with the values; not logged)
_ROWS = "\x00rows/"
#: a check's top singular triple is iterated until its relative residual ``||W^T u - sigma v|| / sigma`` is at most
#: this (sigma then within 5e-7 relative; v within about 1e-3 / (1 - (s_2/s_1)^2) radians of the top singular vector)
CONVERGENCE_TOL = 1e-3
#: block iterations of a check at most (the warm ones included)
MAX_ITERATIONS = 100
#: a check's drop of sign diversity counts only beyond this many standard deviations of its sampling noise
NOISE_Z = 2.0

AUTO = "auto"


def find_output_head(model: nn.Module) -> Optional[str]:
    """Qualified name of the model's output head, by the rule used for the default selection.

    The head is the ``nn.Linear`` whose weight is shared with an ``nn.Embedding`` (tied input and
    output embeddings), else the last ``nn.Linear`` registered in the model (``named_modules`` order;
    ``lm_head`` in the example GPT, ``fc`` / ``classifier`` in most classifiers). ``None`` when the
    model has no ``nn.Linear``.
    """
    linears = [(n, m) for n, m in model.named_modules() if n and isinstance(m, nn.Linear)]
    if not linears:
        return None
    with reading_weights(model.modules()):
        embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        tied = [name for name, mod in linears if id(mod.weight) in embedding_weights]
    return tied[0] if tied else linears[-1][0]


class SpectralAlignmentMonitor(Monitor):
    """Sign diversity of the alignment between each layer's inputs and its weight's top singular
    vector; alerts when it collapses across the model.

    Args:
        every_n_steps: check every this many optimizer steps.
        warmup_steps: no check before this optimizer step.
        include: glob pattern(s) of qualified names of the layers to monitor (default: every ``nn.Linear``,
            Hugging Face ``Conv1D`` and ungrouped ``nn.Conv2d``).
        exclude: glob pattern(s) to leave out.
        head: the output head, left out of the selection unless named exactly in ``include``:
            ``"auto"`` (the rule of :func:`find_output_head`), a qualified module name, or ``None``
            to keep every ``nn.Linear``.
        max_rows: input rows (tokens / samples) sampled at random per layer and check.
        n_iter: block power iterations per check, warm-started from the previous check's basis (the
            first check runs ``COLD_BLOCK_ITERATIONS``, 30); a layer whose relative residual
            ``||W^T u - sigma v|| / sigma`` is then above ``CONVERGENCE_TOL`` (1e-3) iterates on, up to
            ``MAX_ITERATIONS`` (100), so a check's values are those of the converged triple.
        n_vectors: size of the block of right singular directions tracked per layer (its first
            column is ``v_1``); a block finds a new top direction that overtakes the old one in a
            few iterations, where a single vector needs many (see ``top_singular_subspace``).
        baseline_checks: checks that only build each layer's baseline (no alert before).
        baseline_window: the baseline is the median ``D`` of this many recent checks outside a collapse.
        min_baseline: a layer counts only if its baseline ``D`` is at least this.
        collapse_threshold: an eligible layer with ``D`` at or below this is collapsed.
        warn_fraction: ``collapsed_fraction`` at or above which the collapse condition holds.
        max_drop: the collapse condition also holds when ``diversity_ratio <= 1 - max_drop``.
        patience: consecutive checks a condition must hold before its (first) alert. Counted in checks:
            at ``every_n_steps=50``, ``patience=3`` is 150 steps.
        critical_patience: consecutive checks before the critical collapse alert (>= ``patience``);
            ``None`` (default): the collapse stays a warning. On matched controls (the same run with its
            learning rate capped before a divergence) the collapse fired as in the diverging runs: it
            follows the learning rate, so by default it does not make a DivergenceGuard act.
        growth_window: steps over which ``sigma_growth`` is expressed.
        max_sigma_growth: ``sigma_growth`` at or above which the sigma_growth condition holds
            (``None``: no such alert; ``sigma_growth`` is still logged).
        sigma_growth_severity: severity of the sigma_growth alert.
        escalate_on_growth: raise the critical collapse alert as soon as the collapse and the
            sigma_growth conditions have both held ``patience`` checks (two SA signals agreeing),
            without waiting for ``critical_patience`` (off by default, for the same reason).
        log_histograms: also send a histogram of each layer's alignments to TensorBoard.
        seed: seed of the row sampler (its own generator: the global RNG is not touched).
        row_mask: which positions of a layer's input are rows: ``"auto"`` (default) takes the batch's
            ``attention_mask`` (a mapping's ``(B, T)`` tensor: Hugging Face batches), so that padding positions are
            no rows; a callable ``batch -> (B, T) mask or None`` (or its dotted import path) for other batches;
            ``None``: every position. Read on due steps only, on the device; an input whose leading dimensions are
            not the mask's ``(B, T)`` (or ``(T, B)``) keeps every row.

    The monitor never stops or changes the run itself (it has no ``stop``): a DivergenceGuard acts on
    its critical alerts.

    Logged every check (``<layer>`` is the module's qualified name): ``sa/<layer>/sign_diversity``,
    ``sa/<layer>/mean_abs``, ``sa/<layer>/sigma``, ``sa/sign_diversity_mean``,
    ``sa/collapsed_fraction``, ``sa/diversity_ratio``, ``sa/sigma_max``, ``sa/sigma_growth``; with
    ``log_histograms`` the TensorBoard histogram ``sa/<layer>/alignment``.

    With several optimizers (a GAN) the check runs at the first optimizer step of a due step, over every
    selected layer of every network: each layer's statistics are its own, and the model-level rules
    count the layers of all networks together (narrow ``include`` to one network to judge it alone).

    A model with no such layer (or none left after ``include``/``exclude`` and the head) raises
    :class:`~lightning_monitor.callbacks.base.NothingToWatch` at setup, or, with
    ``idle_when_nothing_to_watch`` set (the preset sets it), says so in one warning alert and stays idle.

    Example::

        trainer = Trainer(callbacks=[SpectralAlignmentMonitor(every_n_steps=50), DivergenceGuard()])
    """

    name = "sa"

    def __init__(
        self,
        every_n_steps: int = 50,
        warmup_steps: int = 0,
        include: Optional[Union[str, Sequence[str]]] = None,
        exclude: Optional[Union[str, Sequence[str]]] = None,
        head: Optional[str] = AUTO,
        max_rows: int = 256,
        n_iter: int = 4,
        n_vectors: int = 4,
        baseline_checks: int = 10,
        baseline_window: int = 20,
        min_baseline: float = 0.3,
        collapse_threshold: float = 0.1,
        warn_fraction: float = 0.5,
        max_drop: float = 0.2,
        patience: int = 3,
        critical_patience: Optional[int] = None,
        growth_window: int = 25,
        max_sigma_growth: Optional[float] = 1.35,
        sigma_growth_severity: str = "warning",
        escalate_on_growth: bool = False,
        log_histograms: bool = False,
        seed: int = 0,
        row_mask: Union[str, None, Callable[[Any], Optional[Tensor]]] = AUTO,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, warmup_steps=warmup_steps)
        self.include = as_patterns(include, "include")
        self.exclude = as_patterns(exclude, "exclude")
        if head is not None and (not isinstance(head, str) or not head):
            raise TypeError(f"`head` must be 'auto', a module name or None, got {head!r}.")
        self.head = head
        self.max_rows = check_int("max_rows", max_rows, 1)
        self.row_mask = row_mask if isinstance(row_mask, str) and row_mask == AUTO else resolve_callable("row_mask", row_mask)
        self.n_iter = check_int("n_iter", n_iter, 1)
        self.n_vectors = check_int("n_vectors", n_vectors, 1)
        self.baseline_checks = check_int("baseline_checks", baseline_checks, 1)
        self.baseline_window = check_int("baseline_window", baseline_window, 1)
        self.min_baseline = check_fraction("min_baseline", min_baseline)
        self.collapse_threshold = check_fraction("collapse_threshold", collapse_threshold)
        if self.collapse_threshold >= self.min_baseline:
            raise ValueError(
                f"`collapse_threshold` ({collapse_threshold}) must be below `min_baseline` ({min_baseline}): "
                "a layer counts as collapsed only when its sign diversity falls below its usual level."
            )
        self.warn_fraction = check_fraction("warn_fraction", warn_fraction)
        if self.warn_fraction == 0.0:
            raise ValueError("`warn_fraction` must be > 0 (0 would alert on every check).")
        self.max_drop = check_fraction("max_drop", max_drop)
        if self.max_drop == 0.0:
            raise ValueError("`max_drop` must be > 0 (0 would alert on every check below the baseline).")
        self.growth_window = check_int("growth_window", growth_window, 1)
        if max_sigma_growth is not None and (
            isinstance(max_sigma_growth, bool) or not isinstance(max_sigma_growth, (int, float)) or not max_sigma_growth > 1.0
        ):
            raise ValueError(f"`max_sigma_growth` must be a number > 1 or None (no sigma_1 growth alert), got {max_sigma_growth!r}.")
        self.max_sigma_growth = None if max_sigma_growth is None else float(max_sigma_growth)
        if sigma_growth_severity not in ("info", "warning", "critical"):
            raise ValueError(f"`sigma_growth_severity` must be 'info', 'warning' or 'critical', got {sigma_growth_severity!r}.")
        self.sigma_growth_severity = sigma_growth_severity
        self.escalate_on_growth = check_bool("escalate_on_growth", escalate_on_growth)
        self.patience = check_int("patience", patience, 1)
        self.critical_patience = None if critical_patience is None else check_int("critical_patience", critical_patience, 1)
        if self.critical_patience is not None and self.critical_patience < self.patience:
            raise ValueError(
                f"`critical_patience` ({critical_patience}) must be >= `patience` ({patience}): the critical "
                "alert follows the warning."
            )
        self.log_histograms = check_bool("log_histograms", log_histograms)
        self.seed = seed

        self.layers: dict[str, nn.Module] = {}
        self._capture: Optional[InputCapture] = None
        self._reset_run_state()

    # ------------------------------------------------------------------ state
    def _state_key(self) -> str:
        return self._generate_state_key(
            every_n_steps=self.every_n_steps, warmup_steps=self.warmup_steps, include=self.include,
            exclude=self.exclude, head=self.head,
        )

    @property
    def _legacy_state_key(self) -> str:  # type: ignore[override]
        # the key of checkpoints written before ``head`` was part of it (Lightning's fallback key)
        return self._generate_state_key(
            every_n_steps=self.every_n_steps, warmup_steps=self.warmup_steps, include=self.include,
            exclude=self.exclude,
        )

    # each rank's own: the sign diversities come from the rank's own input rows (see docs/distributed.md)
    _rank_local = ("conditions", "history", "streak", "quiet")

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            vectors={k: v.detach().cpu() for k, v in self._vectors.items()},
            history={k: list(v) for k, v in self._history.items()},
            n_checks=self._n_checks,
            streak=self._streak.count,
            growth_streak=self._growth_streak.count,
            quiet=self._quiet.count,
            growth_quiet=self._growth_quiet.count,
            sigma_history=[[t, dict(sig)] for t, sig in self._sigma_history],
            sampler=self._capture.state_dict() if self._capture is not None else {},
            start_iterations=[[list(shape), n] for shape, n in self._start_iterations.items()],
        )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._vectors = {k: torch.as_tensor(v) for k, v in state_dict.get("vectors", {}).items()}
        self._history = {k: [float(x) for x in v] for k, v in state_dict.get("history", {}).items()}
        self._n_checks = int(state_dict.get("n_checks", 0))
        self._streak = Streak(state_dict.get("streak", 0))
        self._growth_streak = Streak(state_dict.get("growth_streak", 0))
        self._quiet = Streak(state_dict.get("quiet", 0))
        self._growth_quiet = Streak(state_dict.get("growth_quiet", 0))
        self._sigma_history = [(int(t), {k: float(v) for k, v in sig.items()}) for t, sig in state_dict.get("sigma_history", [])]
        # the warm iterations the next check of each weight shape starts with: a resumed check converges as the
        # uninterrupted one did (from the default count, its vector differed within the tolerance: D by a row or two)
        self._start_iterations = {tuple(int(d) for d in shape): int(n) for shape, n in state_dict.get("start_iterations", [])}
        self._sampler_state = state_dict.get("sampler", {})
        if self._capture is not None and self._sampler_state:
            self._capture.load_state_dict(self._sampler_state)

    def _reset_run_state(self) -> None:
        super()._reset_run_state()
        self._one_sign: set[str] = set()  # layers whose inputs at the last check were all >= 0
        # persistent state (state_dict)
        self._vectors: dict[str, Tensor] = {}
        # per weight shape, the warm iterations the next check starts with (see measure)
        self._start_iterations: dict[tuple[int, ...], int] = {}
        self._unconverged: list[str] = []  # the layers of the last check still short of CONVERGENCE_TOL at the cap
        self._unconverged_said: set[str] = set()
        self._history: dict[str, list[float]] = {}
        self._sigma_history: list[tuple[int, dict[str, float]]] = []
        self._n_checks = 0
        self._streak, self._growth_streak = Streak(), Streak()
        # consecutive checks without the condition: it clears after ``patience`` of them
        self._quiet, self._growth_quiet = Streak(), Streak()
        self._not_called: set[str] = set()  # selected layers reported as not called
        self._sampler_state: dict[str, Any] = {}
        self._alignments: dict[str, Tensor] = {}  # the check's alignments, from compute to judge

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _watchable(module: nn.Module) -> bool:
        if any(p.is_complex() for p in module.parameters()):
            return False  # the alignment is defined for real weights (a complex layer is left out)
        if isinstance(module, nn.Conv2d):
            return module.groups == 1
        if isinstance(module, nn.MultiheadAttention):
            return module._qkv_same_embed_dim and module.in_proj_weight is not None
        return isinstance(module, linear_types())

    def select_layers(self, model: nn.Module) -> dict[str, nn.Module]:
        """The layers this monitor watches in ``model`` (see ``include``/``exclude``/``head``): every
        ``nn.Linear``, Hugging Face ``Conv1D`` and ungrouped ``nn.Conv2d`` with real weights (a complex one is left out).

        Raises:
            NothingToWatch: (a ``ValueError``) the model has no such layer, or none is left.
        """
        if not any(self._watchable(m) for m in model.modules()):
            raise NothingToWatch(
                f"SpectralAlignmentMonitor: {type(model).__name__} has no nn.Linear layer (nor a Hugging Face "
                "Conv1D or an ungrouped nn.Conv2d) with real weights, and spectral alignment is defined for layers that "
                "multiply their input by a real weight matrix. Remove the monitor, or use it on a model with such layers."
            )
        types = linear_types() + (nn.Conv2d, nn.MultiheadAttention)
        selected = select_modules(model, self.include, self.exclude, types, owner="SpectralAlignmentMonitor")
        complex_ = [n for n, m in selected.items() if any(p.is_complex() for p in m.parameters())]
        selected = {n: m for n, m in selected.items() if self._watchable(m)}
        head = find_output_head(model) if self.head == AUTO else self.head
        if head is not None and head not in self.include:
            if self.head != AUTO and head not in dict(model.named_modules()):
                raise ValueError(
                    f"SpectralAlignmentMonitor: `head` {head!r} is not a module of {type(model).__name__}; "
                    "pass its qualified name, 'auto', or None."
                )
            selected.pop(head, None)
        if not selected:
            raise NothingToWatch(
                "SpectralAlignmentMonitor: no nn.Linear layer (nor Conv1D, ungrouped Conv2d) left to monitor after "
                f"`include`/`exclude` and leaving out the output head {head!r}"
                + (f" and the layers with complex weights ({', '.join(complex_[:4])}{'...' if len(complex_) > 4 else ''})"
                   if complex_ else "")
                + ". Widen `include`, or pass `head=None` to monitor the head too."
            )
        return selected

    def select(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_monitor._sharded import check_strategy, check_tensor_parallel

        check_strategy(trainer, "SpectralAlignmentMonitor", "a layer's weight matrix (its top singular vector) cannot be read from them")
        check_tensor_parallel(trainer, "SpectralAlignmentMonitor", "it aligns each layer's input rows")
        self.layers, self._capture = {}, None
        self.layers = self.select_layers(pl_module)
        # nn.MultiheadAttention multiplies by its out_proj's weight without calling out_proj: on due steps its calls
        # are routed through out_proj (route_out_proj), so that out_proj's input is seen
        self._routes = {n: m for n, m in pl_module.named_modules()
                        if n and isinstance(m, nn.MultiheadAttention) and n + ".out_proj" in self.layers}
        self._watched: list[str] = list(self.layers)  # the layers of the due step (those that train)
        self._capture = InputCapture(self.layers, max_rows=self.max_rows, seed=self.seed)
        if self._sampler_state:
            self._capture.load_state_dict(self._sampler_state)

    def release(self) -> None:
        super().release()
        if self._capture is not None:
            self._capture.release()
        self._unroute()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._capture is not None and self._capture.armed:  # each micro-batch of a due step: its own mask
            self._capture.row_mask = self._mask_of(batch)

    def _mask_of(self, batch: Any) -> Optional[Tensor]:
        """The batch's ``(B, T)`` mask of the positions that hold a token (see ``row_mask``), as bool; ``None``
        where there is none."""
        if self.row_mask is None:
            return None
        if callable(self.row_mask):
            mask = self.row_mask(batch)
        else:
            mask = batch.get("attention_mask") if isinstance(batch, Mapping) else getattr(batch, "attention_mask", None)
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            return None
        return mask.detach() != 0

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a validation run between the micro-batches of an armed step (`val_check_interval` inside an accumulation
        # window) is not the step's forward: its inputs were sampled with the training rows
        if self._capture is not None:
            self._capture.paused = True

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._capture is not None:
            self._capture.paused = False

    def _unroute(self) -> None:
        for handle in self.__dict__.pop("_route_handles", []):
            handle.remove()

    def arm(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> Optional[bool]:
        assert self._capture is not None
        if self._replaced(trainer, pl_module):
            return False
        # frozen layers are not watched (a LoRA model's base layers, a component GradientEarlyStopping froze): their
        # weights no longer train, so their alignment says nothing of the run's, and they would dilute the collapse
        # fractions; a layer named in `include` is watched frozen or not
        self._watched = [n for n, m in self.layers.items() if self.include or self._trains(m)]
        # every layer frozen (GradientEarlyStopping froze them all, with `stop=False`): said once, and when one trains again
        self.condition(
            step, "all_frozen", not self._watched and bool(self.layers), "info",
            f"Every layer SpectralAlignmentMonitor watches is frozen ({len(self.layers)} layers: a frozen backbone, "
            "adapters trained beside it, or GradientEarlyStopping froze them): nothing is measured until one trains "
            "again. Name layers in `include` to watch them frozen.",
            clear_message="A watched layer trains again: its spectral alignment is measured again.",
        )
        if not self._watched:
            return False
        self._capture.arm(self._watched)
        self._unroute()
        watched = set(self._watched)
        self._route_handles = [h for name, mha in getattr(self, "_routes", {}).items()
                               if name + ".out_proj" in watched for h in route_out_proj(mha)]

    def _replaced(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Select the layers again where one was replaced since (a hidden layer widened, a block stacked: a new module
        under the name); the replaced ones' state (singular vectors, alignment history, sigmas) is dropped, being of
        another weight. One lookup per watched layer, on due steps only; ``True`` when nothing is left to watch.
        Before, the replaced modules stayed watched: never called, said once as ``layers_not_called``, and the new
        layers went unmeasured."""
        changed = [name for name, layer in self.layers.items() if _module_at(pl_module, name) is not layer]
        if not changed:
            return False
        for name in changed:
            self._vectors.pop(name, None)
            self._history.pop(name, None)
            self._not_called.discard(name)
        self._sigma_history = [(t, {k: v for k, v in sig.items() if k not in changed}) for t, sig in self._sigma_history]
        self._capture.release()
        self._sampler_state = self._capture.state_dict()
        try:
            self.select(trainer, pl_module)
        except NothingToWatch as err:
            self.nothing_to_watch(trainer, str(err).removeprefix(f"{type(self).__name__}: "), training=True)
            return True
        return False

    @staticmethod
    def _trains(layer: nn.Module) -> bool:
        if isinstance(layer, nn.MultiheadAttention):
            return layer.in_proj_weight.requires_grad
        if parametrize.is_parametrized(layer, "weight"):  # from its parameters: the parametrization is not run
            return any(p.requires_grad for p in layer.parametrizations.weight.parameters())
        weight = getattr(layer, "weight", None)
        return not isinstance(weight, Tensor) or weight.requires_grad

    # ------------------------------------------------------------------ the check
    @torch.no_grad()
    def measure(self, rows: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Per-layer statistics on device (no host sync) and the alignments, from captured rows."""
        metrics: dict[str, Tensor] = {}
        alignments: dict[str, Tensor] = {}
        names = [n for n in self.layers if n in rows]  # layers that did not run this step are skipped
        with reading_weights(self.layers[n] for n in names):  # spectral_norm's vectors stay as the forward left them
            mats = {n: weight_matrix(self.layers[n]) for n in names}
        plain = [n for n in names if not is_sharded(mats[n])]
        # the warm iterations go on while a layer's relative residual is above CONVERGENCE_TOL (a weight that moved far
        # since the last check, written over by `copy_`, or whose top singular values are close: four iterations left
        # sigma 1-3% low and the sign diversity up to 0.2 off, logged as if exact)
        # the warm layers start from the iterations their shape's layers needed at the last check (one count per shape,
        # so that layers of one shape stay one batch): most then converge in their first round, and the rounds' own
        # cost (a Rayleigh-Ritz step and a host read each) is not paid again
        used: list[int] = []
        stuck: list[bool] = []
        shape = {n: tuple(mats[n].shape) for n in plain}
        found = dict(zip(plain, top_singular_subspaces(
            [mats[n] for n in plain], [self._vectors.get(n) for n in plain],
            n_iter=[self._start_iterations.get(shape[n], self.n_iter) for n in plain], n_vectors=self.n_vectors,
            tol=CONVERGENCE_TOL, max_iter=MAX_ITERATIONS, iterations=used, unconverged=stuck,
        )))
        # per weight shape (the layers iterated as one batch), what the slowest converged layer needed: next check's
        # start, or a little less when the first round was enough. A layer that reached the cap unconverged (top
        # singular values nearly equal) does not raise the others' start: it would have every layer run 100 iterations
        needed: dict[tuple[int, ...], int] = {}
        for n, ran, short in zip(plain, used, stuck):
            if n in self._vectors and not short:
                needed[shape[n]] = max(needed.get(shape[n], 0), ran)
        for key, ran in needed.items():
            start = self._start_iterations.get(key, self.n_iter)
            self._start_iterations[key] = max(self.n_iter, start - self.n_iter) if ran <= start else min(ran, MAX_ITERATIONS)
        self._unconverged = [n for n, short in zip(plain, stuck) if short]
        # FSDP2 (DTensor weights): each sharded layer is gathered alone (one all-gather of its weight, on due
        # steps only) and freed before the next, so the peak is one layer; the iteration then runs on the full
        # matrix, identical on every rank, exactly as unsharded. The gathers are collectives: every rank gathers the
        # same layers in the same order, whether or not the layer ran on this rank this step (a routed expert no token
        # of this rank reached: the ranks gathered different layers, and gloo aborted); only those that ran are measured
        absent = [n for n in self.layers if n not in rows]
        with reading_weights(self.layers[n] for n in absent):
            absent_mats = {n: weight_matrix(self.layers[n]) for n in absent}
        for n in self.layers:
            if n in absent_mats:
                if is_sharded(absent_mats[n]):
                    absent_mats[n].full_tensor()
                continue
            if n not in found:
                full = mats[n].full_tensor()
                short: list[bool] = []
                found[n] = top_singular_subspaces([full], [self._vectors.get(n)], n_iter=self.n_iter,
                                                  n_vectors=self.n_vectors, tol=CONVERGENCE_TOL,
                                                  max_iter=MAX_ITERATIONS, unconverged=short)[0]
                if short[0]:
                    self._unconverged.append(n)
                del full
        # layers whose rows have one shape, dtype and device are aligned as one batch (a small model's check
        # is dominated by kernel launches: a dozen per layer otherwise)
        groups: dict[tuple, list[str]] = {}
        per_layer: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
        for n in names:
            r = rows[n]
            groups.setdefault((tuple(r.shape), r.dtype, r.device), []).append(n)
        chunks = []
        for (shape, _, _), group in groups.items():  # a batch stacks at most MAX_BATCH_ELEMENTS row elements
            per = max(1, MAX_BATCH_ELEMENTS // max(1, math.prod(shape)))
            chunks += [(shape, group[i : i + per]) for i in range(0, len(group), per)]
        for shape, group in chunks:
            if len(group) == 1 or len(shape) != 2:
                batch = [spectral_alignment(rows[n], found[n][2]) for n in group]
                diversity = [sign_diversity(a) for a in batch]
                mean_abs = [a.abs().nanmean() for a in batch]
            else:
                stacked = spectral_alignments(torch.stack([rows[n] for n in group]),
                                              torch.stack([found[n][2] for n in group]))
                batch = list(stacked.unbind(0))
                diversity = list(sign_diversity(stacked, dim=-1).unbind(0))
                mean_abs = list(stacked.abs().nanmean(dim=-1).unbind(0))
            for n, a, d, m in zip(group, batch, diversity, mean_abs):
                per_layer[n] = (a, d, m)
        for n in names:  # in the layers' order
            sigma, _, _, basis = found[n]
            self._vectors[n] = basis
            alignments[n], metrics[self.key("sign_diversity", n)], metrics[self.key("mean_abs", n)] = per_layer[n]
            metrics[self.key("sigma", n)] = sigma
            # inputs of one sign (after a ReLU): their diversity falls to 0 by nature as v_1 turns to their mean, so
            # the layer never counts for a collapse (read on the host with the other values; not logged)
            metrics[_ONE_SIGN + n] = (rows[n].nan_to_num(nan=0.0).min() >= 0).float()  # NaN: a padding row
            metrics[_ROWS + n] = torch.isfinite(alignments[n]).sum().float()  # the rows with a sign (padding's have none)
        return metrics, alignments

    def compute(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> Optional[dict[str, Tensor]]:
        assert self._capture is not None
        rows = self._capture.take()
        self._unroute()
        # a layer replaced since this step was armed is not silent: the new one is selected at the next check
        silent = [n for n in self._watched if n not in rows and n not in self._not_called
                  and _module_at(pl_module, n) is self.layers[n]]
        if silent:  # said once per layer: a layer whose forward does not run has no input to align
            self._not_called.update(silent)
            self.alert(
                step, "layers_not_called", "warning",
                f"{len(silent)} selected layer(s) did not run in the training step's forward, so they have no "
                f"inputs to align and are left out of this check: {', '.join(silent[:8])}"
                f"{' ...' if len(silent) > 8 else ''}. (A layer whose weight is used without calling the "
                "layer is never seen; narrow `include`/`exclude` to silence this.)",
            )
        metrics, self._alignments = self.measure(rows)
        rows.clear()
        if not self._alignments:
            return None
        names = list(self._alignments)
        metrics[self.key("sign_diversity_mean")] = torch.stack([metrics[self.key("sign_diversity", n)] for n in names]).mean()
        metrics[self.key("sigma_max")] = torch.stack([metrics[self.key("sigma", n)] for n in names]).max()
        return metrics

    def judge(self, trainer: pl.Trainer, step: int, values: dict[str, float]) -> dict[str, float]:
        new = [n for n in self._unconverged if n not in self._unconverged_said]
        if new:  # said once per layer: its values are of a vector of the top subspace
            self._unconverged_said.update(new)
            self.alert(
                step, "unconverged", "info",
                f"The top singular vector of {len(new)} layer(s) did not converge in {MAX_ITERATIONS} iterations at this "
                f"check (relative residual above {CONVERGENCE_TOL:g}): {', '.join(new[:8])}{' ...' if len(new) > 8 else ''}. "
                "Their top singular values are nearly equal: sigma is within about the residual squared, but the sign "
                "diversity and mean |cos| are those of a vector of the top subspace, not of v_1 (which is ill-defined "
                "there). Said once per layer.",
                details={"layers": new},
            )
        for key in [k for k in values if k.startswith(_ONE_SIGN)]:
            name = key[len(_ONE_SIGN):]
            if values.pop(key) > 0.5:
                self._one_sign.add(name)
            else:
                self._one_sign.discard(name)
        names = list(self._alignments)
        diversity = {n: values[self.key("sign_diversity", n)] for n in names}
        sigma = {n: values[self.key("sigma", n)] for n in names}
        rows = {n: int(values.pop(_ROWS + n, self._alignments[n].numel())) for n in names}
        for stat, value in self._update_rule(step, diversity, sigma, rows).items():
            values[self.key(stat)] = value
        if self.log_histograms:
            for n, a in self._alignments.items():
                self.log_histogram(trainer, self.key("alignment", n), a[~a.isnan()], step)  # padding rows: NaN
        self._alignments = {}
        return values

    # ------------------------------------------------------------------ the rule
    def baseline(self, layer: str) -> Optional[float]:
        """Median sign diversity of ``layer`` over its recent checks outside a collapse (``None``
        before any)."""
        hist = self._history.get(layer)
        return statistics.median(hist) if hist else None

    def collapse_state(self, diversity: dict[str, float]) -> tuple[float, float, list[str], list[str]]:
        """``(collapsed_fraction, diversity_ratio, eligible layers, collapsed layers)`` for one check's
        ``D`` values against the current baselines (pure: changes nothing). ``diversity_ratio`` is the
        mean ``D`` of the eligible layers over the mean of their baselines (1 with none eligible)."""
        eligible, collapsed = [], []
        now, base = 0.0, 0.0
        for name, d in diversity.items():
            b = self.baseline(name)
            if b is None or b < self.min_baseline or name in self._one_sign:
                continue
            eligible.append(name)
            if not d > self.collapse_threshold:  # NaN counts as collapsed
                collapsed.append(name)
            now += d if d == d else 0.0
            base += b
        if not eligible:
            return 0.0, 1.0, eligible, collapsed
        return len(collapsed) / len(eligible), now / base, eligible, collapsed

    def beyond_noise(self, diversity: dict[str, float], eligible: list[str], rows: Optional[dict[str, int]]) -> bool:
        """Whether the eligible layers' summed drop from their baselines exceeds ``NOISE_Z`` standard deviations of
        what sampling ``rows[layer]`` rows alone moves it by (``D`` of ``n`` rows whose share of the minority sign is
        ``b / 2`` has variance ``b (2 - b) / n``). Without row counts (``None``) every drop counts."""
        if rows is None or not eligible:
            return True
        drop, variance = 0.0, 0.0
        for name in eligible:
            b, d = self.baseline(name) or 0.0, diversity[name]
            drop += b - (d if d == d else 0.0)
            variance += b * (2.0 - b) / max(1, rows.get(name, 1))
        return drop > NOISE_Z * math.sqrt(variance)

    def sigma_growth(self, step: int, sigma: dict[str, float]) -> float:
        """Growth of the largest top singular value over the monitored layers, ``sigma_max``, per
        ``growth_window`` steps, measured from the latest stored check at least ``growth_window`` steps
        back: ``(sigma_max(t) / sigma_max(t0)) ** (growth_window / (t - t0))``, both maxima over the layers
        measured at both checks (a layer that starts or stops being called between them is no growth); 1 while
        no check lies that far back. A non-finite ``sigma_1`` gives ``inf``."""
        far = [(t, sig) for t, sig in self._sigma_history if t <= step - self.growth_window]
        if not far:
            return 1.0
        t0, ref = far[-1]
        if not all(v == v and abs(v) != float("inf") for v in sigma.values()):
            return float("inf")
        both = [name for name in sigma if name in ref]
        if not both:
            return 1.0
        now = max(sigma[name] for name in both)
        before = max(ref[name] for name in both)
        if not before > 0:
            return 1.0
        return (now / before) ** (self.growth_window / (step - t0))

    def _describe(self, diversity: dict[str, float], fraction: float, ratio: float, eligible: list[str],
                  collapsed: list[str]) -> str:
        """The check in words, the criterion that holds first (the collapsed share, the drop of the mean)."""
        share = (f"{len(collapsed)}/{len(eligible)} layers whose inputs usually have mixed signs collapsed (sign "
                 f"diversity <= {self.collapse_threshold}; the condition holds from {self.warn_fraction:.0%} of them)")
        drop = (f"the mean sign diversity of those layers is at {ratio:.0%} of its baseline (the condition holds at "
                f"{1.0 - self.max_drop:.0%} or below)")
        mean_d = sum(diversity.values()) / len(diversity)
        parts = [share, drop] if fraction >= self.warn_fraction or ratio > 1.0 - self.max_drop else [drop, share]
        return f"{parts[0]}; {parts[1]}; mean over all layers {mean_d:.2f}"

    def _update_rule(self, step: int, diversity: dict[str, float], sigma: Optional[dict[str, float]] = None,
                     rows: Optional[dict[str, int]] = None) -> dict[str, float]:
        """Advance the alert rules by one check (``rows``: each layer's number of alignments at the check, for
        :meth:`beyond_noise`); returns the model-level values to log."""
        self._n_checks += 1
        building = self._n_checks <= self.baseline_checks
        growth = self.sigma_growth(step, sigma) if sigma else 1.0
        if sigma:
            self._sigma_history.append((step, dict(sigma)))
            keep = [i for i, (t, _) in enumerate(self._sigma_history) if t <= step - self.growth_window]
            if len(keep) > 1:
                del self._sigma_history[: keep[-1]]
        if building:
            fraction, ratio, eligible, collapsed = 0.0, 1.0, [], []
        else:
            fraction, ratio, eligible, collapsed = self.collapse_state(diversity)
        active = (not building and (fraction >= self.warn_fraction or ratio <= 1.0 - self.max_drop)
                  and self.beyond_noise(diversity, eligible, rows))
        if not active:
            for name, d in diversity.items():
                if d == d:
                    hist = self._history.setdefault(name, [])
                    hist.append(d)
                    del hist[: -self.baseline_window]
        out = {"collapsed_fraction": fraction, "diversity_ratio": ratio, "sigma_growth": growth}
        if building:
            return out
        streak = self._streak.update(active)
        self._quiet.update(not active)
        what = self._describe(diversity, fraction, ratio, eligible, collapsed)
        if self.max_sigma_growth is not None:
            self._growth_streak.update(growth >= self.max_sigma_growth)
            self._growth_quiet.update(growth < self.max_sigma_growth)
        both = self._streak >= self.patience and self._growth_streak >= self.patience
        critical = self.critical_patience is not None and self._streak >= self.critical_patience
        if critical or (self.escalate_on_growth and both):
            growing = f" while the top singular value grows {growth:.2f}x per {self.growth_window} steps" if both else ""
            self.condition(
                step, "collapse", True, "critical",
                f"Spectral alignment collapse for {streak} checks in a row{growing}: {what}. A loss explosion is "
                "likely: lower the learning rate or restore the last good checkpoint.",
                value=fraction, threshold=self.warn_fraction,
            )
        elif self._streak >= self.patience:
            self.condition(
                step, "collapse", True, "warning",
                f"Spectral alignment is collapsing ({streak} checks in a row): {what}. Inputs line up "
                "with each weight's top singular vector, which precedes loss explosions. Watch the loss; "
                "consider a lower learning rate.",
                value=fraction, threshold=self.warn_fraction,
            )
        elif not active and self._quiet >= self.patience:
            self.condition(
                step, "collapse", False, "warning", f"Sign diversity recovered: {what}.",
                value=fraction, threshold=self.warn_fraction,
            )
        if self.max_sigma_growth is not None:
            growing = growth >= self.max_sigma_growth
            if self._growth_streak >= self.patience:
                self.condition(
                    step, "sigma_growth", True, self.sigma_growth_severity,
                    f"The top singular value of a monitored weight grows {growth:.2f}x per {self.growth_window} "
                    f"steps (threshold {self.max_sigma_growth}) for {self._growth_streak.count} checks in a row: "
                    "weights are being pushed along one direction, as before a loss explosion.",
                    value=growth, threshold=self.max_sigma_growth,
                )
            elif not growing and self._growth_quiet >= self.patience:
                self.condition(
                    step, "sigma_growth", False, self.sigma_growth_severity,
                    f"Growth of the top singular values back to {growth:.2f}x per {self.growth_window} steps.",
                    value=growth, threshold=self.max_sigma_growth,
                )
        return out

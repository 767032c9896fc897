"""GradientWeightAlignmentMonitor: validation-free early stopping and mislabelled-sample detection.

Hoelzl, Rueckert, Kaissis, "Gradient-Weight Alignment as a Train-Time Proxy for Generalization in
Classification Tasks", NeurIPS 2025. The math lives in :mod:`lightning_monitor.functional.gwa`.
"""

from __future__ import annotations

import inspect
import itertools
import math
import os
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple, Optional, Union

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lightning_monitor.alerts import _tensorboard_writer, alerts_dir, writes_files
from lightning_monitor._sharded import full, global_norm, is_sharded
from lightning_monitor._values import publish, write_csv
from lightning_monitor._args import check_bool, check_fraction, check_int, deprecated_aliases, resolve_callable
from lightning_monitor._compat import backward_skipped, batches_per_epoch, steps_per_epoch
from lightning_monitor.callbacks.base import Monitor, NothingToWatch, reading_weights
from lightning_monitor.snapshot import Shared
from lightning_monitor.probes import call_args, in_dry_run
from lightning_monitor.functional.gwa import (
    GWA_OFFSET,
    PROPORTIONAL_TOLERANCE,
    ZERO_SUM_TOLERANCE,
    GWAMoments,
    SampleMeans,
    alignment_from_parts,
    head_gradient_agreement,
    head_gradient_fit,
    label_smoothing_fit,
    softmax_gradient_evidence,
    softmax_proportionality,
)

__all__ = ["GradientWeightAlignmentMonitor", "default_target_fn"]

SUSPECTS_FILENAME = "gwa_suspects.csv"
RUN_SUSPECTS_FILENAME = "gwa_suspects_run.csv"
_TARGET_KEYS = ("y", "target", "targets", "label", "labels", "target_values")  # the last: PatchTST, PatchTSMixer
_HIST_BINS = 100
_FLUSH_ELEMENTS = 1 << 20  # kept logit + W z elements before scoring (4 MiB in fp32)
_SNAPSHOT_STASHES = 8  # the guard's newest snapshots whose unfolded steps are held (see snapshot_state)
#: kept steps folded at once, whatever their size: with a small head (2 classes, batch 8) the element bound above took
#: 327,680 steps at the preset's cadence, and the kept steps, six tensors each, and every snapshot's list of them grew
#: all epoch long
_FLUSH_STEPS = 256
_MIN_SAMPLES = 4
#: the least weight an epoch's scores get in the run's per-sample means (an epoch with no negative score: its
#: scores still count, so a sample first scored then has a mean)
_RUN_WEIGHT_FLOOR = 1e-3
#: bimodal scores are taken for samples the model resists (noisy labels: a warning) when at least this share opposes
#: the weights; below it, the two groups are samples fit closely and less closely (said as info)
_BIMODAL_OPPOSED = 0.05
#: from this share of opposed samples on, a bimodal epoch's warning also names a model still near chance
_HALF_OPPOSED = 0.45
#: share of negative scores in the first scored epoch above which the targets likely do not match
_MISMATCH_FRACTION = 0.9
#: a best score above this many times the scores of both neighbouring epochs is an uncertain pick (a spike)
_SPIKE = 1.25
#: a pick whose share of negative scores is this much below the share when the window opened is uncertain
#: (the model stopped fighting a group of samples: with noisy labels, memorisation)
_MEMORISED_DROP = 0.1
#: ... provided the share had settled when the window opened: it moved by at most this much in the epoch before
_SETTLED = 0.02
#: a pick is uncertain when an epoch of the warm-up (after the first epoch) has a score more than this many times the
#: pick's, or bimodal scores with a positive mean ranking above it: the selection skips the warm-up, so its best epoch
#: may lie there (breast cancer at 40% noise: validation picks epochs 0-2, and the run memorises from then on)
_WARMUP_FACTOR = 2.0
#: a pick at which at least this share of the samples' gradients oppose the weights is uncertain (contested): the score
#: is then a small difference between two nearly equal groups pulling either way
_CONTESTED = 0.4
#: due steps on which the head's output gradient is looked for before the reading of the loss is left unchecked
_CHECK_TRIES = 3
#: a measured logit scale this close to 1, or a per-class bias this close to a constant, is none
_TRANSFORM_TOLERANCE = 1e-3
#: label smoothing read from the gradient below this is taken for none
_SMOOTHING_MIN = 1e-3
#: mean 1 - cosine between the gradient rows and the smoothed closed form at or below which the smoothing is exact (or
#: 16 squared machine epsilons of the gradient's dtype, if more)
_SMOOTHING_MISFIT = 1e-6
#: share of the judged rows whose gradient may differ from the closed form's for a reading to be adopted
_OFF_FRACTION = 0.1
#: share of the rows whose gradient is most negative at the target above which the targets are the loss's
_HIT_FRACTION = 0.95
#: below this share of rows whose gradient points at the target read, the loss trains other targets: GWA goes idle
_TRAINED_FRACTION = 0.5
#: Hugging Face causal LMs named otherwise than ``*ForCausalLM`` whose loss shifts the labels
_CAUSAL_LM_NAMES = ("GPT2LMHeadModel", "OpenAIGPTLMHeadModel", "CTRLLMHeadModel")


def _bin_counts(values: Tensor, bins: int, lo: float, hi: float) -> Tensor:
    """``torch.histc(values, bins, lo, hi)``: the counts of ``values`` in ``bins`` equal bins over ``[lo, hi]`` (values
    outside left out, ``hi`` in the last bin), in the dtype of ``values``, with histc's own bin arithmetic, so the same
    counts. ``histc`` has no deterministic CUDA kernel and raises under ``torch.use_deterministic_algorithms(True)``
    (``Trainer(deterministic=True)``); this adds whole numbers with ``index_add_``, the same in any order."""
    inside = (values >= lo) & (values <= hi)
    pos = torch.where(inside, ((values - lo) * bins / (hi - lo)).clamp(0, bins - 1), 0).long()
    return torch.zeros(bins, dtype=values.dtype, device=values.device).index_add_(0, pos, inside.to(values.dtype))


def _device_of(module: nn.Module) -> torch.device:
    """A module's device, from its first parameter or buffer: not ``next(module.parameters())``, whose StopIteration
    (a head holding its weight as a buffer) Lightning's loop takes for the end of the data when raised in a hook, nor
    ``module.weight``, which a parametrization (``spectral_norm``) computes, advancing its power iteration."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        return t.device
    return torch.device("cpu")


def _share(record: Optional[dict[str, Any]]) -> Optional[float]:
    """An epoch record's share of negative scores, or ``None``."""
    if not record or not record.get("count") or record.get("negative") is None:
        return None
    return float(record["negative"]) / float(record["count"])


def _softcapped_outputs(pl_module: nn.Module) -> dict[int, float]:
    """``id`` of the output layer -> its cap, for each Hugging Face model inside ``pl_module`` that feeds its loss
    ``c tanh(logits / c)`` (``config.final_logit_softcapping``: Gemma 2)."""
    out = {}
    for module in pl_module.modules():
        cap = getattr(getattr(module, "config", None), "final_logit_softcapping", None)
        get_output = getattr(module, "get_output_embeddings", None)
        if not isinstance(cap, (int, float)) or isinstance(cap, bool) or cap <= 0 or not callable(get_output):
            continue
        try:
            head = get_output()
        except Exception:  # a model whose output layer cannot be read: not detected
            continue
        if head is not None:
            out[id(head)] = float(cap)
    return out


def _computes_causal_lm_loss(module: nn.Module) -> bool:
    """Whether a Hugging Face model's ``forward`` computes its loss with ``self.loss_function`` and that resolves to
    the causal-LM loss, which shifts the labels (``BertLMHeadModel``, ``ReformerModelWithLMHead``: classes whose name
    does not say so, whose ``loss_type`` is unset and falls back to it). Read from the class's code and the loss's
    mapping, without asking the model (its ``loss_function`` property warns about an unset ``loss_type``)."""
    forward = getattr(type(module), "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    if code is None or "loss_function" not in code.co_names:
        return False
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return False
    own = module.__dict__.get("_loss_function")  # set by the user
    if own is not None:
        return own is ForCausalLMLoss
    return LOSS_MAPPING.get(getattr(module, "loss_type", None), ForCausalLMLoss) is ForCausalLMLoss


def _tensor_ids(obj: Any, out: set[int], depth: int = 0) -> set[int]:
    """The ids of the tensors in a module call's output (tensors, sequences, mappings such as a ``ModelOutput``)."""
    if isinstance(obj, Tensor):
        out.add(id(obj))
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for v in obj:
            _tensor_ids(v, out, depth + 1)
    elif depth < 4 and isinstance(obj, Mapping):
        for v in obj.values():
            _tensor_ids(v, out, depth + 1)
    return out


class _HeadWatch:
    """The hooks of one watched training step (see ``GradientWeightAlignmentMonitor._watch_heads``)."""

    def __init__(self, softcaps: Optional[dict[str, float]] = None) -> None:
        self.handles: list[Any] = []
        #: per candidate that feeds its loss ``c tanh(logits / c)`` (Gemma 2): the cap ``c``
        self.softcaps = softcaps or {}
        self.calls: dict[str, tuple[nn.Module, tuple[Any, ...], Any, int]] = {}  # first call: inputs, output, order
        self.returned: list[tuple[str, set[int]]] = []
        #: per candidate, on its device: how far its output's gradient is a softmax's (``softmax_gradient_evidence``)
        self.grads: dict[str, Tensor] = {}
        #: per candidate, the machine epsilon of its output gradient's dtype (the rounding the zero sums carry)
        self.eps: dict[str, float] = {}
        #: per candidate, on its device: how far its gradient's positive entries follow its softmax
        #: (``softmax_proportionality``): a head trained on class indices, not a layer behind LayerNorms
        self.proportional: dict[str, Tensor] = {}
        #: per candidate, which rows of its output the loss gave a gradient (see ``_weighted_rows``)
        self.weighted: dict[str, list[Optional[Tensor]]] = {}

    def call_hook(self, name: str) -> Callable[..., None]:
        @torch.compiler.disable
        def hook(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if in_dry_run() or name in self.calls or not torch.is_grad_enabled():
                # a call without autograd trains nothing (pseudo-labels made under `no_grad`, the first pass of a
                # reentrant checkpoint, whose recomputation in the backward is the call watched)
                return
            inputs = call_args(inputs, kwargs, module)
            self.calls[name] = (module, inputs, output, len(self.calls))
            if isinstance(output, Tensor) and output.requires_grad:
                self.weighted[name] = [None, None, None]
                features = inputs[0].detach() if inputs and isinstance(inputs[0], Tensor) else None

                def wz() -> Optional[Tensor]:  # W z in fp32, for the scores read from the gradient (one product)
                    if features is None:
                        return None
                    with reading_weights((module,)):  # a parametrized weight read without stepping its state
                        weight = getattr(module, "weight", None)
                    if not isinstance(weight, Tensor) or is_sharded(weight):
                        return None
                    with torch.no_grad(), torch.autocast(device_type=features.device.type, enabled=False):
                        return features.float() @ weight.detach().float().T

                output.register_hook(_weighted_rows(self.weighted[name], wz))
                logits = output.detach()
                cap = self.softcaps.get(name)
                # held weakly: the hook lives in the autograd graph, and this watch holds the graph's output in
                # ``calls``, a cycle through the graph that Python's collector cannot see (it outlived the fit)
                watch = weakref.ref(self)

                def grad_hook(grad: Tensor) -> None:
                    live = watch()
                    if live is None:
                        return
                    if grad.is_floating_point():
                        live.eps[name] = torch.finfo(grad.dtype).eps
                    z = logits
                    if cap is not None:
                        # the softmax is the capped logits': its gradient there is this one over the cap's slope
                        squashed = torch.tanh(logits.float() / cap)
                        z, grad = cap * squashed, grad.float() / (1.0 - squashed * squashed).clamp_min(1e-12)
                    live.grads[name] = softmax_gradient_evidence(grad, z, live.eps.get(name, 0.0))
                    live.proportional[name] = softmax_proportionality(grad, z)

                output.register_hook(grad_hook)
        return hook

    def returned_hook(self, name: str) -> Callable[..., None]:
        @torch.compiler.disable
        def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            if not in_dry_run():
                self.returned.append((name, _tensor_ids(output, set())))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def default_target_fn(batch: Any) -> Tensor:
    """Targets of a ``(x, y, ...)`` tuple/list batch, of a dict batch under one of the keys ``y``, ``target``,
    ``targets``, ``label``, ``labels``, ``target_values`` (PatchTST), or of another batch object (a dataclass ...)
    under an attribute of one of those names holding a tensor."""
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)) and len(batch) >= 2:
        return batch[1]
    if isinstance(batch, Mapping):
        for key in _TARGET_KEYS:
            if key in batch:
                return batch[key]
    elif not isinstance(batch, (Sequence, Tensor)):
        for key in _TARGET_KEYS:
            value = getattr(batch, key, None)
            if isinstance(value, Tensor):
                return value
    raise TypeError(
        f"GradientWeightAlignmentMonitor cannot find the targets in a batch of type {type(batch).__name__}: "
        f"the default takes batch[1] of a tuple/list, one of the keys {list(_TARGET_KEYS)} of a dict, or a "
        "tensor attribute of one of those names. Pass `target_fn=lambda batch: ...` returning the class targets."
    )


def _weighted_rows(holder: list[Optional[Tensor]],
                   wz: Optional[Union[Tensor, Callable[[], Tensor]]] = None) -> Callable[[Tensor], None]:
    """A tensor hook on the head's output: puts in ``holder[0]`` which rows of its gradient are not all 0 (flat, in the
    rows' order of the scores); over several backward passes through the output (`torch.autograd.grad` of a part of
    the loss after the backward), the rows any of them reached. With ``wz`` (the rows' ``W z``), also each row's
    ``g . W z`` and ``||g||`` from the first pass in ``holder[1]`` and ``holder[2]``: the score read from the gradient
    itself (``_Kept.weighted``); ``wz`` may be a function that makes it then (from the forward's features and the
    weights, which the backward has not changed yet)."""

    def hook(grad: Tensor) -> None:
        g = grad.detach()
        rows = g.ne(0).any(-1).reshape(-1)
        first = holder[0] is None
        holder[0] = rows if first else holder[0] | rows
        made = wz() if callable(wz) else wz
        if first and made is not None and g.shape == made.shape:
            g = g.to(made.dtype)
            holder[1] = (g * made).sum(-1).reshape(-1)
            holder[2] = torch.linalg.vector_norm(g, dim=-1).reshape(-1)

    return hook


#: a row whose softmax puts less than this on the other classes than its target may have a gradient rounded to 0 in
#: fp32 (exp underflows near 1e-38, and the loss divides by its rows): such a row is not taken for one the loss weighs 0
_SATURATED = 1e-20


def _unsaturated(logits: Tensor, targets: Tensor, ignore_index: Optional[int], scale: Optional[float] = None,
                 bias: Optional[Tensor] = None) -> Tensor:
    """Per row (flat), whether it has a target to score and a softmax far enough from its target that a loss weighing
    it would give it a gradient other than 0 (``_SATURATED``), in float64 from the logits (``[rows, C]``)."""
    z = logits.reshape(-1, logits.shape[-1]).double()
    if scale is not None:
        z = z * scale
    if bias is not None:
        z = z + bias.to(device=z.device, dtype=z.dtype)
    if targets.is_floating_point():  # soft targets: the largest gap between the softmax and the target
        gap = (torch.softmax(z, -1) - targets.reshape(z.shape).to(z.dtype)).abs().amax(-1)
        return gap >= _SATURATED
    t = targets.reshape(-1)
    valid = (t >= 0) & (t < z.shape[-1])
    if ignore_index is not None:
        valid &= t != ignore_index
    idx = t.clamp(0, z.shape[-1] - 1).unsqueeze(-1)
    # the mass on the other classes is at least exp(their largest logit - the target's): one max, no exponentials
    gap = z.scatter(-1, idx, -math.inf).amax(-1) - z.gather(-1, idx).squeeze(-1)
    return valid & (gap >= math.log(_SATURATED))


class _Kept(NamedTuple):
    """What one step keeps for its scores (see ``_on_head_forward``), scored with others by ``_flush``."""

    z_norm: Tensor  # ||z|| per row
    wz: Tensor  # W z (the logits less the bias)
    logits: Tensor
    targets: Tensor
    w_norm: Tensor  # ||W||_F of that step
    indices: Optional[Tensor]  # index_fn's sample indices, or None
    step: int  # the optimizer step whose batch it is (``trainer.global_step`` at its start)
    #: filled by the backward: per row, whether the loss gave it a gradient (``None`` until then, or with no backward);
    #: where asked, then each row's ``g . W z`` and ``||g||`` of its output gradient ``g`` (``_weighted_rows``)
    weighted: list[Optional[Tensor]]


class GradientWeightAlignmentMonitor(Monitor):
    r"""Gradient-weight alignment (GWA) of every training sample, a per-epoch generalisation score,
    early stopping on it, and the samples that fight the model.

    **Per step** (every due step, see ``every_n_steps``): a forward hook on the classifier head
    (the ``nn.Linear`` producing the logits) reads its input features ``z`` and logits from the
    step's own forward pass (no extra pass) and keeps the logits with ``W z = logits - bias``,
    ``||z||`` per sample and ``||W||_F`` of that step (three small kernels; the features themselves
    are not kept). Every 2^20 kept elements and at epoch end, on the
    device and without a host sync, each sample (each token for ``[B, T, C]`` logits) is scored by
    :math:`\gamma_i = \cos(-\nabla_W \ell_i, W)` (closed form, see
    :func:`~lightning_monitor.functional.gwa_scores`) and folded into float64 moments, a fixed-bin
    histogram, a count of negative scores and the ``suspects`` most negative samples.

    **Per epoch** (at the end of the last training batch, so before an end-of-epoch validation and
    its checkpoint): the moments are reduced across ranks, ``GWA = mean / (excess kurtosis + 1.2)``
    is computed and logged with one host transfer, and the epoch is judged:

    * the selection window opens after ``warmup_epochs`` (default ``warmup_fraction`` of
      ``max_epochs``); with ``finetune=True`` also only after GWA's first dip (a fall followed by a
      rise);
    * inside the window the epoch of maximal GWA is the predicted best epoch (``best_epoch``). An epoch whose
      scores are bimodal (``kurtosis + 1.2 <= 0``, GWA undefined) with a positive mean, and whose share of negative
      scores has settled (moved by at most 2 points since the epoch before), ranks above every defined score, the
      lowest kurtosis first: GWA grows without bound as the kurtosis falls to -1.2, and
      with noisy labels such epochs are the model fitting the clean samples while it still resists the
      flipped ones, before it memorises them (``benchmarks/gwa_validity.py``);
    * with ``stop=True`` training stops when the pick has not improved (by ``min_delta``, for scores) for
      ``patience`` windowed epochs (the decision is reduced across ranks).

    ``trainer.callback_metrics["gwa/selection"]`` (every rank) gets the epoch's place in that ranking as one
    number inside the window (``0.5 + atan(GWA) / pi`` in ``(0, 1)`` for a score, ``1 + (-1.2 - kurtosis) /
    0.8`` in ``[1, 2]`` for bimodal scores); outside it, or when the epoch is not ranked, it is left as it
    was: absent before the first windowed epoch, the last value after it (no placeholder value). So
    ``ModelCheckpoint(monitor="gwa/selection", mode="max")`` keeps the checkpoint of ``best_epoch`` (with validation
    inside the epochs, pass it ``save_on_train_epoch_end=True``: the key is set at each epoch's end), and
    ``EarlyStopping(monitor="gwa/selection", mode="max", strict=False)`` waits through the warm-up and
    stops like ``stop=True`` with ``min_delta=0``. ``callback_metrics["gwa/score"]``, masked the same way,
    is the paper's score alone (bimodal epochs never reach it). ``mask_warmup=False`` publishes both outside
    the window too. The other ``gwa/*`` values reach ``callback_metrics`` when they are logged. Loggers get
    only defined scores: GWA is undefined (never logged) for an epoch with fewer than 4 scored samples
    (warning) or a denominator ``<= 0``, i.e. bimodal scores (``bimodal`` alert).

    Args:
        head: qualified name of the ``nn.Linear`` producing the logits; default: the last
            ``nn.Linear`` with at least 2 outputs in ``named_modules()`` order.
        target_fn: ``batch -> targets``: integer classes ``[B]`` / ``[B, T]`` (``ignore_index``
            entries are skipped) or soft targets of the logits' shape. Default:
            :func:`default_target_fn`.
        index_fn: ``batch -> [B]`` integer sample indices (e.g. dataset indices); enables the
            suspects file ``gwa_suspects.csv`` in the log directory.
        suspects: how many of the most negative samples (tokens) to write per epoch.
        run_suspects: also write ``gwa_suspects_run.csv`` at each epoch end: the samples of the lowest mean score
            over the run so far, each epoch's scores weighted by the share of negative scores of the epoch before
            (steadier than one epoch's list; docs/gradient_weight_alignment.md). Needs ``index_fn``, one row of
            logits per sample and a training set with a length; three float64 per sample.
        stop: whether the monitor may stop the run: stop training on GWA (see above). Off by default: the
            monitor only logs and alerts.
        patience: windowed epochs without improvement before stopping. Counted in epochs, not checks:
            GWA is judged once per epoch.
        min_delta: improvement smaller than this does not count.
        warmup_fraction: fraction of the planned epochs (``max_epochs``, or ``max_steps`` in epochs)
            outside the selection window (paper: 10%). Under ``max_time`` the planned epochs are also those the
            time allows at the pace of the epochs trained when the first one ends (the fewer of the two), set
            then, the same on every rank, said in a ``warmup_planned`` info alert and kept in checkpoints.
        warmup_epochs: number of epochs outside the window; overrides ``warmup_fraction``.
        finetune: open the window only after GWA's first dip (fine-tuning a pre-trained model).
        mask_warmup: keep ``gwa/score`` and ``gwa/selection`` out of ``callback_metrics`` outside the window
            (loggers still get the score). ``False``: ``gwa/score`` is published at every epoch, and
            ``gwa/selection`` at 0 outside the window (ranked below every epoch of it, as the monitor ranks them).
        ignore_index: integer target that marks a sample (token) to skip.
        log_histograms: write a histogram of the epoch's scores to TensorBoard loggers. Deprecated alias:
            ``histogram``.
        every_n_steps: score the batches of every this many optimizer steps (1: all samples, the
            paper's setting; larger values estimate the epoch's score from a subsample).
        min_epoch_samples: when set, ``every_n_steps`` is lowered, once per fit after the first scored step (after
            the first epoch where its length is unknown before: an iterable without ``__len__``), so
            that an epoch scores at least about this many samples (its steps times the samples of a step, all
            ranks together, over ``every_n_steps``; never below 1): the epoch's kurtosis, which GWA divides by,
            is too noisy to mean anything on a few dozen samples (its standard error is about ``sqrt(24 / n)``).
            It is also lowered to the optimizer steps of an epoch where it is above them, so that every epoch
            has a scored step (epochs of 4 accumulated steps under the preset's 10 were mostly scored from none,
            and skipped). Said in one ``cadence`` info alert. ``None`` (default): ``every_n_steps`` as given.
            The preset passes 256.
        warmup_steps: score nothing before this optimizer step.
        shift_targets: targets ``[B, T]`` are the labels of a causal LM, which its loss shifts (the
            logits at position ``t`` predict the label at ``t + 1``): score against ``labels[:, 1:]``, the
            last position left out (``ignore_index``). ``None`` (default): shift when the model holds a
            Hugging Face causal LM (``*ForCausalLM``, ``GPT2LMHeadModel``, any class whose ``forward`` computes
            the causal-LM loss, e.g. ``BertLMHeadModel``) whose output layer is the head and the targets are the
            ``labels`` of a dict batch read by the default ``target_fn``.

    **Soft-capped logits.** A Hugging Face model with ``config.final_logit_softcapping = c`` (Gemma 2) trains on
    ``c tanh(logits / c)``: its head is scored through the cap (the softmax of the capped logits, the gradient
    damped by the cap's slope per class), exact against autograd.

    **The loss's own reading, checked on its gradient.** Once per fit, on the first scored step, the head's output
    gradient from the backward is compared with the one the scores assume (per row: ``p - y``, pointing to the
    target). A model whose loss shifts the labels itself without saying so (BLIP's text decoder) has its targets
    shifted (``targets_shifted``, info; only when ``shift_targets`` is ``None``); a loss that sees a scaled or
    biased copy of the head's outputs (Cohere's ``logit_scale``, Granite's ``logits_scaling``, the
    ``final_logits_bias`` of BART, Marian, Pegasus; a temperature of your own) is scored through the transform
    measured from the gradient (``logit_transform``, info); a loss that smooths its labels (``cross_entropy(...,
    label_smoothing=eps)``; near a uniform softmax it passes for a logit scale of ``1 / (1 - eps)``) is scored
    against the smoothed targets, ``eps`` measured (``label_smoothing``, info); what none of these explains (a z-loss,
    distillation's soft targets, class weights with label smoothing) makes each row's score read from the row's own
    output gradient from then on, ``cos(-g z^T, W)`` (``scores_from_gradient``, info; exact for any loss computed row
    by row). When in fewer than half of the rows the gradient points at
    the targets read, the loss trains other targets (a tuple batch whose ``batch[1]`` is an attention mask,
    sequence-first logits against batch-first labels, labels the loss shifts while ``shift_targets=False``) or
    ``head`` is not the layer that makes the logits (a tied head applied as ``x @ embedding.weight.T``): GWA then
    publishes no score and stays idle, said in one ``nothing_to_watch`` warning with what to pass. The transform is
    measured once per fit: one learned during training (a trained temperature) is not followed. One host sync, once.

    **Target mismatch.** When at least 90% of the scores of the first scored epoch are negative, a
    warning alert (``target_mismatch``) says that the targets most likely do not match the logits
    (unshifted causal-LM labels, the wrong head); when the check above found the targets to be the loss's, the
    warning is ``opposed_start`` instead: the head starts out predicting against them (a random-init head).

    A model without a classifier head (no ``nn.Linear`` with >= 2 outputs, ``head`` not given), or
    trained by several optimizers without an explicit ``head`` (a GAN's last layer is no classifier of
    the targets; checked when training starts), raises
    :class:`~lightning_monitor.callbacks.base.NothingToWatch` at setup, or, with
    ``idle_when_nothing_to_watch`` set (the preset sets it), says so in one warning alert and stays idle.
    With that flag set, so does a model whose first scored batch has targets that do not fit the head
    (an autoencoder's batch without targets, regression, multi-label or one-logit binary targets: no
    softmax classifier), decided on every rank together after that batch; without it, such targets raise.
    """

    name = "gwa"

    @deprecated_aliases(histogram="log_histograms")
    def __init__(
        self,
        head: Optional[str] = None,
        target_fn: Optional[Callable[[Any], Tensor]] = None,
        index_fn: Optional[Callable[[Any], Tensor]] = None,
        suspects: int = 100,
        stop: bool = False,
        patience: int = 5,
        min_delta: float = 0.0,
        warmup_fraction: float = 0.1,
        warmup_epochs: Optional[int] = None,
        finetune: bool = False,
        mask_warmup: bool = True,
        ignore_index: Optional[int] = -100,
        log_histograms: bool = True,
        every_n_steps: int = 1,
        warmup_steps: int = 0,
        shift_targets: Optional[bool] = None,
        run_suspects: bool = True,
        min_epoch_samples: Optional[int] = None,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, warmup_steps=warmup_steps)
        self._configured_every = self.every_n_steps
        self.min_epoch_samples = None if min_epoch_samples is None else check_int("min_epoch_samples",
                                                                                  min_epoch_samples, 1)
        if shift_targets is not None and not isinstance(shift_targets, bool):
            raise TypeError(f"`shift_targets` must be True, False or None (detect), got {shift_targets!r}.")
        if head is not None and (not isinstance(head, str) or not head):
            raise ValueError(f"`head` must be the qualified name of an nn.Linear module or None, got {head!r}.")
        # a callable, or its dotted import path (as LightningCLI YAML spells a function)
        target_fn, index_fn = resolve_callable("target_fn", target_fn), resolve_callable("index_fn", index_fn)
        if not (isinstance(min_delta, (int, float)) and min_delta >= 0):
            raise ValueError(f"`min_delta` must be a number >= 0, got {min_delta!r}.")
        self.head = head
        self.target_fn = target_fn or default_target_fn
        self.index_fn = index_fn
        self.suspects = check_int("suspects", suspects, 0)
        self.stop = check_bool("stop", stop)
        self.patience = check_int("patience", patience, 1)
        self.min_delta = float(min_delta)
        self.warmup_fraction = check_fraction("warmup_fraction", warmup_fraction, 0.0, 1.0, high_inclusive=False)
        self.warmup_epochs = None if warmup_epochs is None else check_int("warmup_epochs", warmup_epochs, 0)
        self.finetune = check_bool("finetune", finetune)
        self.mask_warmup = check_bool("mask_warmup", mask_warmup)
        self.ignore_index = ignore_index
        self.log_histograms = check_bool("log_histograms", log_histograms)
        self.shift_targets = shift_targets
        self.run_suspects = check_bool("run_suspects", run_suspects)

        self._reset_run_state()  # the selection state (saved in checkpoints)
        # the fit's state, set again by select and on_train_start
        self._head_name: Optional[str] = None
        self._head: Optional[nn.Linear] = None
        self._head_candidates: Optional[list[tuple[str, nn.Linear]]] = None
        self._head_watch: Optional[_HeadWatch] = None
        self._shift = bool(shift_targets)
        self._softcap: Optional[float] = None  # the model caps the head's logits (see _logit_softcap)
        self._reset_gradient_check()
        self._pending: Optional[tuple[Tensor, Optional[Tensor]]] = None  # the batch's targets and indices
        self._checked = False  # the targets were checked once (one host sync)
        self._said_unpaired = False  # a scored step's head rows could not be paired with its targets (said once)
        self._refusal: Optional[str] = None
        self._targets_settled = self._targets_tried = False
        self._warmup_resolved = 0
        self._planned_epochs: Optional[int] = None  # the epochs the warm-up fraction was taken of
        self._want_histogram = self.log_histograms
        self._stash_key = 0  # numbers the snapshots' unfolded steps (see snapshot_state)
        self._reset_epoch(None)

    @property
    def histogram(self) -> bool:
        """Deprecated: the attribute is :attr:`log_histograms`."""
        warnings.warn(
            "`GradientWeightAlignmentMonitor.histogram` is deprecated: use `.log_histograms`.", DeprecationWarning, stacklevel=2
        )
        return self.log_histograms

    # ------------------------------------------------------------------ identity / state
    def _state_key(self) -> str:  # the cadence as configured (min_epoch_samples may lower it during a fit)
        return self._generate_state_key(
            head=self.head, every_n_steps=self._configured_every, warmup_steps=self.warmup_steps, stop=self.stop
        )

    @property
    def _legacy_state_key(self) -> str:  # type: ignore[override]
        # the key of checkpoints written before warmup_steps was part of it (Lightning's fallback key)
        return self._generate_state_key(head=self.head, every_n_steps=self._configured_every, stop=self.stop)

    def _reset_run_state(self) -> None:
        super()._reset_run_state()
        if "_configured_every" in self.__dict__:  # a new run scores at the configured cadence until it is set again
            self.every_n_steps = self._configured_every
        self._scored_rows: Optional[int] = None  # the samples of the fit's first scored micro-batch (min_epoch_samples)
        self._batch_step = 0  # the optimizer step of the batch under way (trainer.global_step at its start)
        self._unsized_rows: Optional[int] = None  # those of an epoch of unknown length, until it ends (_set_cadence)
        self.history: list[dict[str, Any]] = []
        # said once the first batch's targets fit (a regression or multi-label run goes idle with one warning instead)
        self._pending_no_softmax: Optional[tuple[int, str]] = None
        self._drift_said = False  # the reading of the loss found off (scores_from_gradient), once per run
        #: the scores are read from the head output's gradient, row by row (the loss is not one the closed form reads)
        self._scores_from_gradient = False
        self._recheck_counts: Optional[tuple[Tensor, int, str]] = None  # _recheck's counts, read at the epoch's end
        self._recheck_epoch: Optional[int] = None  # the epoch of the last check of that reading
        self._recheck_step: Optional[int] = None  # and its step
        self._pending_several: Optional[tuple[int, str]] = None
        self._dropped: Optional[tuple[Optional[int], str]] = None  # the epoch whose kept batches were dropped, and why
        self._load_selection_state({})
        #: why the best epoch may be a poor pick (see :meth:`_uncertainty`), or None
        self.pick_uncertain: Optional[str] = None
        self.stopped_epoch: Optional[int] = None
        # a saved epoch to continue after a resume (see on_save_checkpoint)
        self._resume_open: Optional[dict[str, Any]] = None
        self._run: Optional[SampleMeans] = None  # this rank's per-sample sums over the run (run_suspects)
        self._run_saved: Optional[Any] = None  # those of a checkpoint, reduced over the ranks
        self._said_out_of_range = False  # targets_out_of_range, once per run
        self._said_unweighted = False  # unweighted_rows, once per run
        self._run_warned = False

    def _selection_state(self) -> dict[str, Any]:
        return dict(best_epoch=self.best_epoch, best_score=self.best_score, best_rank=self._best_rank, wait=self.wait,
                    dip_epoch=self.dip_epoch, timed_warmup=self._timed_warmup,
                    fell=self._fell, prev_score=self._prev_score, prev_epoch=self._prev_epoch,
                    uncertain_said=list(self._uncertain_said))

    def _load_selection_state(self, state: dict[str, Any]) -> None:
        """The best epoch and its score, the patience counter and the dip detection (``{}``: a fresh run's)."""
        self.best_epoch: Optional[int] = state.get("best_epoch")
        self.best_score: Optional[float] = state.get("best_score")
        rank = state.get("best_rank")
        if rank is None and self.best_score is not None:  # a checkpoint from before bimodal epochs were ranked
            rank = (0, self.best_score)
        self._best_rank: Optional[tuple[int, float]] = None if rank is None else (int(rank[0]), float(rank[1]))
        self.wait = int(state.get("wait", 0))
        self.dip_epoch: Optional[int] = state.get("dip_epoch")
        self._fell = bool(state.get("fell", False))
        self._prev_score: Optional[float] = state.get("prev_score")
        self._prev_epoch: Optional[int] = state.get("prev_epoch")
        # the reasons ("boundary", "warmup", "memorised", "spike", "contested") the uncertain_pick warnings of the run
        # have given
        self._uncertain_said: list[str] = list(state.get("uncertain_said", []))
        # the warm-up planned from the time budget (max_time) when the first epoch ended, None before (or without one)
        self._timed_warmup: Optional[int] = state.get("timed_warmup")

    def state_dict(self) -> dict[str, Any]:
        return self._state(history=[dict(h) for h in self.history])

    def _state(self, history: Sequence[dict[str, Any]]) -> dict[str, Any]:
        state = super().state_dict()
        state.update(history=history, stopped_epoch=self.stopped_epoch, **self._selection_state())
        # the cadence min_epoch_samples chose (once per fit): a resumed run scores at it from its first step, as the run
        # it continues did (it went back to the configured cadence until its first scored step, and an epoch resumed
        # at its end scored 192 samples against 256)
        state["cadence"] = self.every_n_steps if self._scored_rows == -1 else None
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # the epoch a checkpoint was saved in, continued by on_train_start if the resume lands in it
        self._resume_open = state_dict.get("open_epoch")
        self._run_saved = state_dict.get("run_suspects")
        self.history = [dict(h) for h in state_dict.get("history", [])]
        self._load_selection_state(state_dict)
        self.stopped_epoch = state_dict.get("stopped_epoch")
        cadence = state_dict.get("cadence")
        if cadence is not None:  # decided by the run saved (a state saved before the decision leaves it as it is now)
            self.every_n_steps, self._scored_rows, self._unsized_rows = int(cadence), -1, None

    def snapshot_state(self) -> dict[str, Any]:
        """The :meth:`state_dict` and this rank's scores of the epoch under way: a rollback takes the scores of the
        steps it undoes out of the epoch. The accumulators are copied by the snapshot; the steps kept but not yet
        folded into them stay on the device, held here by reference for the newest ``_SNAPSHOT_STASHES`` snapshots
        (folding them at every snapshot cost 1% of a small model's step: one fold per scored step instead of one per
        few dozen)."""
        # the per-epoch records, which never change once made, by reference (one shared tuple until the next record)
        key = (id(self.history), len(self.history), id(self.history[-1]) if self.history else None)
        cached = self.__dict__.get("_shared_history")
        if cached is None or cached[0] != key:
            cached = self._shared_history = (key, Shared(self.history))
        state = self._state(history=cached[1])
        if self.idle_reason is None and self._epoch_open is not None:
            self._stash_key += 1
            # the state before this step's update: its own batch's scores are not in it (they stay kept, unfolded,
            # until the update). Kept in, a rollback to this snapshot, which undoes the batch, kept its scores
            self._snapshot_stashes[self._stash_key] = [k for k in self._stash if k.step < self._batch_step]
            for old in [k for k in self._snapshot_stashes if k <= self._stash_key - _SNAPSHOT_STASHES]:
                del self._snapshot_stashes[old]
            state["epoch_scores"] = {
                "epoch": self._epoch_open, "finished": self._finished, "stash": self._stash_key,
                "tensors": [self._moments.state, self._negative, self._out_of_range, self._hist, self._minmax,
                            self._top],
            }
        return state

    def load_snapshot_state(self, state: dict[str, Any]) -> None:
        """A rollback (or a stop) to a snapshot of the epoch under way: the history, the selection and the epoch's
        scores go back to the snapshot's, so the undone steps' scores leave the epoch (they stayed in it, and fed
        ``gwa/score`` and the pick), and an epoch recorded at its last step before the rollback is recorded again,
        from the steps kept (it vanished from the history). To a snapshot of an earlier epoch: the epochs recorded
        since stay as they are (their later steps' scores in them), and the epoch under way, every step of which was
        undone, starts again empty."""
        saved = state.get("epoch_scores")
        if self.idle_reason is not None or self._epoch_open is None:
            return
        device = self._moments.state.device
        if saved is None or saved["epoch"] != self._epoch_open:
            self._reset_epoch(device, self._epoch_open)
            return
        self.load_state_dict(state)
        moments, negative, outside, hist, minmax, top = (t.to(device).clone() for t in saved["tensors"])
        self._moments.state, self._negative, self._out_of_range = moments, negative, outside
        self._hist, self._minmax, self._top = hist, minmax, top
        # the steps kept but not folded at the snapshot (lost where the snapshot is older than those held)
        self._stash = list(self._snapshot_stashes.get(saved.get("stash"), []))
        self._stashed = sum(2 * kept.logits.numel() for kept in self._stash)
        self._finished = bool(saved["finished"])

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """A checkpoint saved inside an epoch (or after an epoch cut short by the end of training) carries
        that epoch's accumulators, reduced over the ranks, so a resume into the same epoch scores all of
        it; every checkpoint carries the run-level suspects' sums, reduced too. Added here, not in
        :meth:`state_dict`: the guard's snapshots need none of it."""
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._head is None:
            return
        self._flush()
        saved = checkpoint.setdefault("callbacks", {}).setdefault(self.state_key, {})
        if self._run is not None:  # the run's per-sample sums, reduced over the ranks (every rank calls this)
            saved["run_suspects"] = self._run.saved(self._reduced_run(trainer)).cpu()
        if self._epoch_open is None or (self._finished and self._before_partial is None):
            return
        state, negative, lo, hi, hist, top = self._reduce(trainer)
        keep = top[0].argsort()[: self.suspects]
        saved["open_epoch"] = {
            "epoch": self._epoch_open, "moments": state, "negative": negative, "minmax": [lo, hi], "hist": hist,
            "top": top[:, keep], "recorded": self._finished, "before": self._before_partial,
        }

    def _continue_epoch(self, trainer: pl.Trainer, device: Optional[torch.device]) -> None:
        """Resumed inside the epoch a checkpoint was saved in: its accumulators continue (on rank 0, the
        others start from zero: the sums are reduced at the epoch's end), and a score recorded for the
        epoch cut short is replaced by the whole epoch's."""
        saved, self._resume_open = self._resume_open, None
        if saved is None or saved.get("epoch") != trainer.current_epoch:
            return
        if trainer.global_rank == 0:

            def restore(value: Any) -> Tensor:
                return torch.as_tensor(value, dtype=torch.float64).to(device)

            self._moments = GWAMoments.from_state(restore(saved["moments"]))
            self._negative = restore(saved["negative"]).reshape(())
            self._hist = restore(saved["hist"])
            self._minmax = restore(saved["minmax"])
            top = restore(saved["top"])
            self._top[:, : top.shape[1]] = top[:, : self._top.shape[1]]
        if saved.get("recorded"):
            if self.history and self.history[-1].get("epoch") == saved["epoch"]:
                self.history.pop()
            if saved.get("before") is not None:
                self._load_selection_state(saved["before"])

    # ------------------------------------------------------------------ setup
    def select(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_monitor._sharded import check_strategy, check_tensor_parallel

        self._head_name, self._head, self._pending = None, None, None
        self._said_frozen = False
        self._head_candidates: Optional[list[tuple[str, nn.Linear]]] = None
        self._head_watch: Optional[_HeadWatch] = None
        self._pool_mask: Optional[Tensor] = None  # the scored batch's attention mask (see _pooled_targets)
        check_strategy(trainer, "GradientWeightAlignmentMonitor", "the head's weight norm and W z cannot be read from them")
        check_tensor_parallel(trainer, "GradientWeightAlignmentMonitor", "it scores the head's input features and logits")
        self._head_name, self._head = self._find_head(pl_module)
        # no `head=`: the first training forward and backward tell which candidate's output the model returns and
        # which one's gradient is a softmax's (see _resolve_head); until then the last one registered stands
        candidates = self._candidates(pl_module) if self.head is None else []
        # one candidate too: its output gradient tells whether it is a softmax classifier at all (see _resolve_head)
        self._head_candidates = candidates or None
        self._other_heads: list[tuple[str, nn.Linear]] = []  # qualified too: tried if the targets fit another head
        self._shift = self._causal_lm_shift(pl_module) if self.shift_targets is None else self.shift_targets
        self._softcap = self._logit_softcap(pl_module)
        self._reset_gradient_check()
        self._checked = self._said_unpaired = False
        # idle_when_nothing_to_watch: why this rank's first scored batch did not fit the head (targets missing, of
        # another kind or shape), settled across the ranks at the end of that batch (see _settle_targets)
        self._refusal: Optional[str] = None
        self._targets_settled = self._targets_tried = False
        # the same on every rank (the loggers are), so the gathered layout agrees
        self._want_histogram = self.log_histograms and any(isinstance(lg, TensorBoardLogger) for lg in trainer.loggers)
        unbounded = (trainer.max_epochs is None or trainer.max_epochs < 0) and (trainer.max_steps is None or trainer.max_steps < 0)
        if self.warmup_epochs is None and self.warmup_fraction > 0 and unbounded and self._timer(trainer) is None:
            # a ValueError; the preset's monitor (idle_when_nothing_to_watch) says so and stays idle instead
            raise NothingToWatch(
                "it cannot take `warmup_fraction` of an unbounded run (none of max_epochs, max_steps and "
                "max_time is set): pass `warmup_epochs=` explicitly."
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.idle_reason is not None:
            return
        if self.head is None and self.refuse_several_optimizers(
            trainer,
            f" (a GAN's players, or one loss shared out over parameter groups as with Muon and AdamW), so the last "
            f"nn.Linear (`{self._head_name}`) need not be a classifier of the dataset's targets. Pass `head=` naming "
            "the classifier head to score it.",
        ):
            self._head = None
            return
        try:
            self._warmup_resolved = self._resolve_warmup(trainer)
        except NothingToWatch as err:  # raised again, or (the preset) the monitor stays idle
            self.nothing_to_watch(trainer, str(err))
            return
        if trainer.world_size > 1 and not self._even_epochs(trainer, pl_module):
            return
        self._check_score_consumers(trainer)
        if self.head is not None:  # otherwise said when the first step shows which layer is the head
            self._say_if_frozen(trainer.global_step)
        # the epoch training starts in: Lightning calls on_train_epoch_start for it only when it starts at its
        # first batch (not after a resume inside it)
        self._reset_epoch(pl_module.device, trainer.current_epoch)
        if self._resume_open is not None:
            self._continue_epoch(trainer, pl_module.device)
        self._start_run_suspects(trainer, pl_module.device)

    def _even_epochs(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Whether every rank's epoch has as many batches (one gather at the start of the fit). The scores of an
        epoch are gathered at its end; with epochs of different lengths (``use_distributed_sampler=False`` and
        shards of different sizes) that gather on one rank would meet the next step's gradient all-reduce on
        another, and the run would hang. Otherwise the monitor stops here (idle, or :class:`NothingToWatch`)."""
        mine = torch.tensor([float(trainer.num_training_batches)], dtype=torch.float64, device=pl_module.device)
        counts = [float(c) for c in trainer.strategy.all_gather(mine).reshape(-1).tolist()]
        if len(set(counts)) == 1:
            return True
        self.nothing_to_watch(trainer, (
            f"the ranks' epochs have different lengths ({', '.join(f'{c:g}' for c in counts)} batches): GWA scores "
            "whole epochs and reduces them across the ranks at each epoch's end, which would meet another rank "
            "still training and hang. Give every rank the same number of batches (Lightning's distributed sampler, "
            "`use_distributed_sampler=True`, does)."))
        return False

    def _check_score_consumers(self, trainer: pl.Trainer) -> None:
        """Warn about Lightning callbacks on ``gwa/score`` or ``gwa/selection`` that fail while the key has no value:
        it is absent from ``callback_metrics`` until the first selectable epoch (no placeholder), and set at the end of
        each training epoch, so a checkpoint saved after a validation inside an epoch fails before the first epoch's
        end, and carries the score of the epoch before it afterwards."""
        from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

        masked = self.mask_warmup and not self._in_window(trainer.current_epoch)
        within = self._validates_within_epochs(trainer)
        if not masked and not within:
            return
        keys = (self.key("score"), self.key("selection"))
        gap = f"epochs < {self._warmup_resolved}" + (" and until GWA's first dip" if self.finetune else "")
        for cb in trainer.callbacks:
            key = getattr(cb, "monitor", None)
            if key not in keys:
                continue
            if (within and isinstance(cb, ModelCheckpoint) and cb.save_top_k != 0
                    and getattr(cb, "_save_on_train_epoch_end", None) is not True):
                rank_zero_warn(
                    f"ModelCheckpoint(monitor={key!r}) saves after each validation, and validation runs within the "
                    "training epochs (`val_check_interval` below an epoch, or counted across epochs or in time), "
                    f"while `{key}` is set at the end of each training epoch: the first validation, before the first "
                    "epoch ends, raises (the key has no value yet), and later ones would checkpoint weights from "
                    "inside an epoch under the score of the epoch before. Pass "
                    f"`ModelCheckpoint(monitor={key!r}, mode='max', save_on_train_epoch_end=True)`: it then saves the "
                    "weights at each epoch's end, the ones scored"
                    + (" (and `warmup_epochs=0` or `mask_warmup=False`: the key has no value during the warm-up)."
                       if masked else ".")
                )
            elif not masked:
                continue
            elif isinstance(cb, EarlyStopping) and cb.strict:
                rank_zero_warn(
                    f"EarlyStopping(monitor={key!r}) with strict=True raises at its first check: `{key}` is not in "
                    f"trainer.callback_metrics during GWA's warm-up ({gap}). Pass `strict=False`: EarlyStopping "
                    "then waits for the first score and counts from there."
                )
            elif isinstance(cb, ModelCheckpoint) and cb.save_top_k != 0 and trainer.enable_validation:
                rank_zero_warn(
                    f"ModelCheckpoint(monitor={key!r}) with a validation loop raises after the first validation of "
                    f"GWA's warm-up ({gap}): Lightning requires the monitored key once a validation loop has run, "
                    f"and `{key}` has no value before the window opens. Without a validation loop it waits; with "
                    "one, pass `mask_warmup=False` (`gwa/selection` is then 0 for the warm-up epochs) or "
                    "`warmup_epochs=0`."
                )

    @staticmethod
    def _validates_within_epochs(trainer: pl.Trainer) -> bool:
        """Whether a validation may run before a training epoch ends: ``val_check_interval`` below an epoch, counted
        across epochs (``check_val_every_n_epoch=None``) or in time."""
        if not trainer.enable_validation:
            return False
        if getattr(trainer, "_val_check_time_interval", None) is not None or trainer.check_val_every_n_epoch is None:
            return True
        return trainer.val_check_batch < trainer.num_training_batches

    @staticmethod
    def _timer(trainer: pl.Trainer) -> Any:
        """Lightning's :class:`~lightning.pytorch.callbacks.Timer` of the run when it has a time limit (``max_time``),
        else ``None``."""
        from lightning.pytorch.callbacks import Timer

        timer = next((cb for cb in trainer.callbacks if isinstance(cb, Timer)), None)
        return timer if timer is not None and timer.time_remaining("train") is not None else None

    def _plan_by_time(self, trainer: pl.Trainer, epoch: int) -> None:
        """At the end of the run's first whole epoch under ``max_time``: the warm-up as ``warmup_fraction`` of the
        epochs the time allows at the pace so far (``epoch + 1`` epochs in the time elapsed), or of those planned by
        ``max_epochs`` / ``max_steps`` where fewer. Rank 0's clock decides for every rank (one broadcast), so the
        window, the pick and a stop agree. Before, a run bounded by ``max_time`` alone left GWA idle ("an unbounded
        run"), and one with a large ``max_epochs`` as well waited for a warm-up the time never reached."""
        timer = self._timer(trainer)
        elapsed = timer.time_elapsed("train") if timer is not None else 0.0
        remaining = timer.time_remaining("train") if timer is not None else None
        by_time = None
        if remaining is not None and elapsed > 0:
            by_time = max(epoch + 1, int((elapsed + remaining) / (elapsed / (epoch + 1))))
        if trainer.world_size > 1:
            by_time = trainer.strategy.broadcast(by_time, src=0)
        if by_time is None:
            return
        planned = by_time if self._planned_epochs is None else min(self._planned_epochs, by_time)
        warmup = max(1, int(math.ceil(self.warmup_fraction * planned - 1e-9)))
        self._planned_epochs, self._warmup_resolved, self._timed_warmup = planned, warmup, warmup
        self.alert(
            trainer.global_step, "warmup_planned", "info",
            f"The selection window opens at epoch {warmup}: the warm-up is {self.warmup_fraction:g} of the about "
            f"{planned} epochs this run makes" + (
                f" (the {by_time} that `max_time` allows at the pace of the first {epoch + 1} epoch(s))"
                if planned == by_time else f" (planned by `max_epochs` / `max_steps`; `max_time` allows {by_time})")
            + ". Pass `warmup_epochs=` to fix it.",
            value=float(warmup),
        )

    def _resolve_warmup(self, trainer: pl.Trainer) -> int:
        """``warmup_epochs``, else ``ceil(warmup_fraction * planned epochs)``; the planned epochs come
        from ``max_epochs``, or from ``max_steps`` and the optimizer steps per epoch. Under ``max_time``: 1 until
        the first epoch ends (:meth:`_plan_by_time`), or the warm-up planned then (a resume)."""
        if self.warmup_epochs is not None:
            return self.warmup_epochs
        if self.warmup_fraction == 0:
            return 0
        timed = self._timer(trainer) is not None
        if timed and self._timed_warmup is not None:  # planned by the time budget already (a resume)
            return self._timed_warmup
        epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs >= 0 else None
        if trainer.max_steps is not None and trainer.max_steps >= 0:
            batches = trainer.num_training_batches
            if math.isfinite(batches) and batches > 0:
                per_epoch = max(1, math.ceil(batches / trainer.accumulate_grad_batches))
                by_steps = math.ceil(trainer.max_steps / per_epoch)
                epochs = by_steps if epochs is None else min(epochs, by_steps)
        self._planned_epochs = epochs
        if timed:
            # the first epoch is outside the window whatever the plan (at least one epoch of warm-up); the plan is
            # made when it ends, from its pace (see _plan_by_time)
            return 1
        if epochs is None:
            raise NothingToWatch(  # a ValueError
                "it cannot tell the length of this run (max_steps with an iterable "
                "of unknown length): pass `warmup_epochs=` explicitly."
            )
        return int(math.ceil(self.warmup_fraction * epochs - 1e-9))

    def _causal_lm_shift(self, pl_module: pl.LightningModule) -> bool:
        """Whether the head is the output layer of a Hugging Face causal LM inside ``pl_module`` (one whose
        loss shifts the labels: ``loss_type == "ForCausalLM"``, a ``*ForCausalLM`` class, GPT-2's
        ``GPT2LMHeadModel``, any class whose ``forward`` computes the causal-LM loss ...)."""
        for module in pl_module.modules():
            name = type(module).__name__
            causal = getattr(module, "loss_type", None) == "ForCausalLM" or name.endswith("ForCausalLM") or (
                name in _CAUSAL_LM_NAMES or _computes_causal_lm_loss(module)
            )
            get_output = getattr(module, "get_output_embeddings", None)
            if not causal or not callable(get_output) or getattr(getattr(module, "config", None), "is_encoder_decoder", False):
                continue
            try:
                if get_output() is self._head:
                    return True
            except Exception:  # a model whose output layer cannot be read: not detected
                continue
        return False

    def _logit_softcap(self, pl_module: pl.LightningModule) -> Optional[float]:
        """The cap ``c`` of a Hugging Face model that feeds its loss ``c tanh(logits / c)`` of the scored head's output
        (``config.final_logit_softcapping``: Gemma 2), else ``None``."""
        return _softcapped_outputs(pl_module).get(id(self._head))

    def _find_head(self, pl_module: pl.LightningModule) -> tuple[str, nn.Linear]:
        modules = dict(pl_module.named_modules())
        if self.head is not None:
            module = modules.get(self.head)
            if module is None:
                linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
                raise ValueError(
                    f"`head={self.head!r}` names no module of {type(pl_module).__name__}; its nn.Linear "
                    f"modules are {linears[-8:]}."
                )
            if not isinstance(module, nn.Linear):
                raise ValueError(
                    f"`head={self.head!r}` is a {type(module).__name__}; GWA needs the nn.Linear that "
                    "produces the logits."
                )
            if module.out_features < 2:
                raise ValueError(
                    f"`head={self.head!r}` has {module.out_features} output; GWA needs a softmax head with "
                    ">= 2 classes (use a 2-output head with cross-entropy for binary tasks)."
                )
            return self.head, module
        candidates = self._candidates(pl_module)
        if not candidates:
            raise NothingToWatch(
                f"found no nn.Linear with >= 2 outputs in {type(pl_module).__name__}: GWA needs a linear "
                "classifier head producing softmax logits. Pass `head='<name>'` if it is there under a wrapper."
            )
        return candidates[-1]  # until the first training step's backward tells (see _resolve_head)

    @staticmethod
    def _candidates(pl_module: pl.LightningModule) -> list[tuple[str, nn.Linear]]:
        """The modules that may be the classifier head: every real ``nn.Linear`` with >= 2 outputs, in registration
        order (a complex one gives no softmax logits). Its parameters are read, not ``m.weight``: a parametrized weight
        (spectral_norm) would be computed, and spectral_norm's power iteration would step in training mode."""
        return [(n, m) for n, m in pl_module.named_modules()
                if isinstance(m, nn.Linear) and m.out_features >= 2 and not any(p.is_complex() for p in m.parameters())]

    # ------------------------------------------------------------------ which Linear is the head
    def _watch_heads(self, pl_module: pl.LightningModule) -> None:
        """For one training forward: note each candidate's first call (inputs, output) and, for every module that
        holds a candidate (the candidates too), which tensors its call returned (see :meth:`_resolve_head`)."""
        assert self._head_candidates is not None
        names = [n for n, _ in self._head_candidates]
        capped = _softcapped_outputs(pl_module)
        watch = _HeadWatch({n: capped[id(m)] for n, m in self._head_candidates if id(m) in capped})
        holders = {""} | {n[:i] for n in names for i in range(len(n)) if n[i] == "."}
        for name, module in pl_module.named_modules():
            if name in holders:
                watch.handles.append(module.register_forward_hook(watch.returned_hook(name)))
        for name, module in self._head_candidates:
            watch.handles.append(module.register_forward_hook(watch.call_hook(name), with_kwargs=True))
        self._head_watch = watch

    def _adopt_head(self, name: str, module: nn.Linear, pl_module: pl.LightningModule) -> bool:
        """Score ``module`` as the head from now on, with its own reading of the targets (a causal LM's shift, unless
        ``shift_targets`` is given) and its logits' softcap; whether the shift changed."""
        self._head_name, self._head = name, module
        shifted = self.shift_targets is None and self._causal_lm_shift(pl_module) != self._shift
        if shifted:
            self._shift = not self._shift
        self._softcap = self._logit_softcap(pl_module)
        return shifted

    def _resolve_head(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Choose the head among the candidates from the training step just watched (after its backward). GWA scores a
        softmax cross-entropy head, whose logits' gradient has rows that sum to 0 (softmax minus a distribution), and
        the logits are what the model hands to its loss. In that order of preference:

        1. the candidates whose output's gradient rows sum to 0 (within 1e-3 of its magnitude, and the rounding of the
           probabilities: ``softmax_gradient_evidence``) and whose output is returned by the outermost call that
           holds them (or that the training step calls itself);
        2. those so returned whose rows are all too confident to tell (probabilities one-hot to within the rounding:
           a fit resumed from a well-trained classifier);
        3. those whose gradient rows sum to 0;
        4. those whose output is so returned;
        5. the last one registered (the rule without a watched step), if it ran;

        and among several, the one called last. The gradients' sums are reduced over the ranks (one all-reduce, once),
        so every rank takes the same head. A classifier registered before an auxiliary projection (a contrastive or
        regulariser term), or inside a model beside a top-level adapter, had the wrong layer scored, silently. On a
        due step the chosen head's call is scored now, and its hook is armed for the step's further micro-batches."""
        watch, self._head_watch = self._head_watch, None
        if watch is None:
            return
        watch.remove()
        assert self._head_candidates is not None
        names = [n for n, _ in self._head_candidates]
        device = _device_of(self._head) if self._head is not None else pl_module.device
        # |row sums|, |grad| and rounding allowed of the judged rows, |grad| of every row, called, positive entries'
        # distance from the softmax's and their mass
        stats = torch.zeros(len(names), 7, dtype=torch.float64, device=device)
        for i, n in enumerate(names):
            if n in watch.calls:
                stats[i, 4] = 1.0
            if n in watch.grads:
                stats[i, :4] = watch.grads[n].to(device=device, dtype=torch.float64)
            if n in watch.proportional:
                stats[i, 5:] = watch.proportional[n].to(device=device, dtype=torch.float64)
        if trainer.world_size > 1:
            stats = trainer.strategy.reduce(stats, reduce_op="sum")
        rows = stats.tolist()  # once per fit
        called = [n for n, r in zip(names, rows) if r[4] > 0]
        if not called:  # no candidate ran in this step (on any rank): watched again at the next one
            return
        by_output = {id(out): name for name, (_, _, out, _) in watch.calls.items() if isinstance(out, Tensor)}
        holder_levels = [0 if h == "" else h.count(".") + 1 for h, _ in watch.returned]
        outermost: dict[str, int] = {}  # candidate -> the shallowest holder whose call returned its output
        for (_, ids), level in zip(watch.returned, holder_levels):
            for i in ids & by_output.keys():
                outermost[by_output[i]] = min(outermost.get(by_output[i], level), level)

        def returned_here(n: str) -> bool:
            # returned by the outermost call holding it (its own call, when the training step calls it directly)
            above = [lv for (h, _), lv in zip(watch.returned, holder_levels) if h == "" or n.startswith(h + ".")]
            return not above or outermost.get(n) == min(above)

        # what each rank saw of the calls (a head may run on some ranks only: an auxiliary task in some batches), made
        # the same on every rank (the largest over the ranks): each candidate's place in the call order and whether
        # the model returned its output, and the largest class target of the batch, so that every rank takes the
        # same head (one all-gather, once per fit)
        seen = torch.full((2 * len(names) + 1,), -1.0, dtype=torch.float64, device=device)
        for i, n in enumerate(names):
            if n in watch.calls:
                seen[i] = float(watch.calls[n][3])
                seen[len(names) + i] = float(returned_here(n))
        targets = self._pending[0] if self._pending is not None else None
        if targets is not None and not targets.is_floating_point() and targets.numel():
            kept = targets[targets != self.ignore_index] if self.ignore_index is not None else targets
            if kept.numel():
                seen[-1] = float(kept.max())
        if trainer.world_size > 1:
            seen = trainer.strategy.all_gather(seen).reshape(-1, seen.numel()).max(0).values
        seen_h = seen.tolist()
        at = {n: i for i, n in enumerate(names)}
        largest_target = seen_h[-1]

        def returned(n: str) -> bool:
            return seen_h[len(names) + at[n]] > 0

        # a softmax's output gradient rows sum to 0 up to the rounding of the gradient's dtype: each element is rounded
        # once, so the rows' |sums| stay under eps / 2 of the |gradient| (bf16: a real head measured 2.2e-3; a 1e-3
        # bound failed it, and a Linear feeding a LayerNorm, whose rows also sum to 0, was taken instead), plus the
        # rounding of the probabilities, which does not shrink with the gradient: the rows of a confident classifier
        # (a fit resumed from a well-trained one) are not judged, and a head whose rows all are is `unsure`
        softmax = {n for n, r in zip(names, rows)
                   if r[1] > 0 and r[0] <= max(ZERO_SUM_TOLERANCE, 2.0 * watch.eps.get(n, 0.0)) * r[1] + r[2]}
        unsure = {n for n, r in zip(names, rows) if r[1] == 0 < r[3]}
        # of those, the ones whose positive entries are the softmax's times the row's weight: a head on class indices.
        # A Linear whose output reaches the loss only through LayerNorms (a transformer's residual branch) has rows
        # summing to 0 too, and was taken for a second head (several_heads on healthy Perceiver runs)
        by_index = {n for n, r in zip(names, rows)
                    if n in softmax and r[6] > 0 and r[5] <= max(PROPORTIONAL_TOLERANCE, 8.0 * watch.eps.get(n, 0.0)) * r[6]}
        order = {n: seen_h[at[n]] for n in called}
        default = self._head_name
        tiers = [
            ([n for n in called if n in softmax and returned(n)], "its output's gradient is a softmax's and the model returns it"),
            ([n for n in called if n in unsure and returned(n)],
             "the model returns it, and its output's gradient rows are too confident (one-hot) to test for a softmax's"),
            ([n for n in called if n in softmax], "its output's gradient is a softmax's"),
            ([n for n in called if returned(n)], "its output is what the model's call returns"),
            ([default] if default in called else [], ""),
            (called, f"the last one called (`{default}`, the last registered, did not run)"),
        ]
        tier, (group, why) = next((i, t) for i, t in enumerate(tiers) if t[0])
        if len(group) > 1 and any(n in by_index for n in group):
            # several qualify: those trained on class indices are the heads, not layers behind LayerNorms
            group = [n for n in group if n in by_index]
        # a layer with fewer outputs than the batch's class targets need is not their head (an auxiliary classifier of
        # fewer classes), when another one of the tier can take them
        candidates = dict(self._head_candidates)
        fitting = [n for n in group if candidates[n].out_features > largest_target]
        group = fitting or group
        chosen = max(group, key=lambda n: order[n])
        module = candidates[chosen]
        call = watch.calls.get(chosen)
        self._head_candidates = None
        step = trainer.global_step
        had_gradient = any(r[3] > 0 for n, r in zip(names, rows) if n in called)
        # an overflowed step (fp16 under a loss scaler, which skips it) has inf/NaN output gradients: they pass no
        # softmax test, and a plain classifier was said to have no softmax head; the head is chosen as without the test
        readable = all(math.isfinite(v) for n, r in zip(names, rows) if n in called for v in r[:4])
        if had_gradient and readable and not softmax & set(called) and chosen not in unsure:
            # every loss that depends on the logits through a softmax gives gradient rows summing to 0 (a softmax does not
            # change when a constant is added to its logits): none of the candidates' does (one whose rows are all too
            # confident to tell is not blamed)
            message = (
                f"No nn.Linear's output gradient in the watched training step is a softmax's (rows summing to 0): "
                f"`{chosen}` is scored as the classifier head, but GWA's scores assume a softmax cross-entropy on its "
                "logits. A one-logit sigmoid head, a BCE loss, or a classifier that is not an nn.Linear (a tied "
                "`F.linear`, a 1x1 convolution) has none; the layer scored is then a hidden one and its scores mean "
                "nothing. Pass `head=` if it is the classifier (extra terms on its logits, such as a z-loss, break "
                "the zero sums).")
            if self._may_refuse():
                # the first scored batch's targets decide first: a regression or multi-label run goes idle with one
                # warning (nothing_to_watch), not this one too
                self._pending_no_softmax = (step, message)
            else:
                self.alert(step, "no_softmax_head", "warning", message)
        elif len(group) > 1 and all(n in softmax for n in group):
            # if the targets GWA reads turn out to be another's (an auxiliary head called last), the others are tried
            # (also where no output counts as returned: under DDP the training step runs inside the module's call)
            others = sorted((n for n in group if n != chosen), key=lambda n: -order[n])
            self._other_heads = [(n, candidates[n]) for n in others]
            message = (
                f"{len(group)} nn.Linear layers qualify as the classifier head (softmax gradients"
                f"{', returned by the model' if tier == 0 else ''}): {', '.join(f'`{n}`' for n in group)}; `{chosen}`, "
                "called last, is scored (another is tried if the targets turn out not to be its). Pass `head=` to "
                "score another.")
            if self._may_refuse():
                # said once the first scored batch's targets fit: a regression transformer's input embeddings, which
                # feed a LayerNorm (rows summing to 0 too), were named as heads before the monitor went idle
                self._pending_several = (step, message)
            else:
                self.alert(step, "several_heads", "warning", message)
        if chosen != default:
            if self._adopt_head(chosen, module, pl_module):
                self._pending = None  # this batch's targets were read for the other head: not scored
            rank_zero_info(f"GradientWeightAlignmentMonitor: classifier head `{chosen}` ({module}): {why}; "
                           f"not `{default}`, the last nn.Linear with >= 2 outputs registered.")
        else:
            rank_zero_info(f"GradientWeightAlignmentMonitor: classifier head `{chosen}` ({module}).")
        self._say_if_frozen(step)
        if self._armed_step == trainer.global_step and self._pending is not None and call is not None:
            self._on_head_forward(module, call[1], {}, call[2], weighted=watch.weighted.get(chosen))
            self.keep(module.register_forward_hook(self._on_head_forward, with_kwargs=True))  # the step's further micro-batches

    def _say_if_frozen(self, step: int, during: bool = False) -> None:
        """An info alert, once per fit, when the scored head's weight does not train (a LoRA fine-tune that leaves
        `lm_head` alone, a linear probe's frozen classifier, a component frozen mid-run): its scores are still exact,
        but read differently."""
        if self._head is None or self._said_frozen:
            return
        # its parameters, not `.weight`: reading a parametrized weight (spectral_norm) runs a power iteration, which
        # changes the run. Frozen when none but the bias trains (a LoRA adapter on a frozen weight moves the weight)
        if any(p.requires_grad for n, p in self._head.named_parameters() if not n.endswith("bias")):
            return
        self._said_frozen = True
        # the per-sample gradients are still the head's, but the weights they are compared with never move
        when = (f"was frozen during the run (found at the end of an epoch, step {step}: by GradientEarlyStopping or "
                "the training code); the epochs scored since are ranked beside those before it, when it trained"
                if during else "is frozen (its weight does not require a gradient)")
        self.alert(
            step, "frozen_head", "info",
            f"The classifier head `{self._head_name}` {when}: GWA compares each sample's gradient with weights that "
            "training does not change, so its score follows the features alone and the paper's reading of it (the "
            "head's own fit) does not apply. Pass `head=` to score a trained layer.")

    # ------------------------------------------------------------------ epoch accumulators
    def _reset_epoch(self, device: Optional[torch.device], epoch: Optional[int] = None) -> None:
        """Empty accumulators on ``device`` for the epoch ``epoch`` (``None``: no epoch open)."""
        self._moments = GWAMoments(device)
        self._negative = torch.zeros((), dtype=torch.float64, device=device)
        self._out_of_range = torch.zeros((), dtype=torch.float64, device=device)  # class targets outside [0, C)
        self._unweighted = torch.zeros((), dtype=torch.float64, device=device)  # rows with a target but no gradient
        self._hist = torch.zeros(_HIST_BINS, dtype=torch.float64, device=device)
        self._minmax = torch.tensor([math.inf, -math.inf], dtype=torch.float64, device=device)
        # suspects: score, index, position, target, predicted (float64 keeps integers exact)
        self._top = torch.full((5, self.suspects), math.nan, dtype=torch.float64, device=device)
        self._top[0].fill_(math.inf)
        self._stash: list[_Kept] = []  # the steps kept since the last _flush
        self._stashed = 0
        # the guard's snapshots of this epoch: their steps not folded yet, by reference (see snapshot_state)
        self._snapshot_stashes: dict[int, list[_Kept]] = {}
        self._finished = False
        self._epoch_open = epoch
        self._run_w: Optional[float] = None  # the weight of this epoch's scores in the run's means (_run_weight)
        # batches that trained / ran forward only (SWA's BatchNorm epoch): an epoch of the latter alone is no epoch
        self._trained = self._forward_only = False
        #: the selection state before a record of an epoch cut short (replaced if a resume continues it)
        self._before_partial: Optional[dict[str, Any]] = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.idle_reason is not None:
            return
        if self._epoch_open == trainer.current_epoch and not self._finished:
            return  # set up by on_train_start
        self._reset_epoch(pl_module.device, trainer.current_epoch)

    # ------------------------------------------------------------------ per step
    def arm(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> Optional[bool]:
        """A due step: the head's forward hook, until the step's optimizer step (the base releases it); while the
        head is being chosen, :meth:`_resolve_head` scores the chosen one's call instead. The unit scored is a
        batch (its targets are read at its start): a due step that a batch takes after its first (manual
        optimization) is not armed."""
        assert self._head is not None
        if step != trainer.global_step:
            return False
        if self._check_state == "pending":
            self._check_state, self._check_step = "armed", step
            self._recheck_epoch = trainer.current_epoch
        elif (self._check_state == "done" and not self._drift_said and self._recheck_epoch is not None
              and trainer.current_epoch > self._recheck_epoch):
            # the reading of the loss, checked again at the first due step of each later epoch (see _recheck)
            self._check_state, self._recheck_step = "recheck", step
            self._recheck_epoch = trainer.current_epoch
        if self._head_watch is None:
            self.keep(self._head.register_forward_hook(self._on_head_forward, with_kwargs=True))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if (self._head_candidates is not None and self._head_watch is None and self.idle_reason is None
                and self._head is not None):
            self._watch_heads(pl_module)
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)  # arms the hook on a due step
        self._batch_step = trainer.global_step
        if not self._trained:  # read until a batch of the epoch trains: after that it makes no difference
            if backward_skipped(trainer):
                self._forward_only = True
            else:
                self._trained = True
        if self._armed_step == trainer.global_step:  # every batch of a due step (micro-batches too) is scored
            self._targets_tried = True
            try:
                self._pending = self._batch_targets(batch)
            except (TypeError, ValueError) as err:
                if not self._may_refuse():
                    raise
                self._refusal = self._refusal or str(err)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._head_watch is not None and self.idle_reason is None:  # the step that chooses the head is through
            self._resolve_head(trainer, pl_module)
        if self._check_state == "armed" and self._check_step == trainer.global_step and self.idle_reason is None:
            self._check_gradient(trainer)
        elif self._check_state == "recheck" and self._recheck_step == trainer.global_step and self.idle_reason is None:
            self._recheck(trainer)
        # the hook stays for a head that runs only after a first optimizer step (manual optimization); a batch
        # whose head never runs is released by on_train_batch_end
        if self._pending is None:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)

    def _batch_targets(self, batch: Any) -> tuple[Tensor, Optional[Tensor]]:
        """The batch's targets (shifted for a causal LM) and sample indices, checked for their type."""
        targets = self.target_fn(batch)
        if not isinstance(targets, Tensor):
            raise TypeError(f"`target_fn` must return a Tensor of targets, got {type(targets).__name__}.")
        raw = targets
        if self._shift and not targets.is_floating_point() and targets.dim() >= 2 and (
            self.shift_targets or self._shift_measured or (
                self.target_fn is default_target_fn and isinstance(batch, Mapping) and "labels" in batch)
        ):
            # a causal LM's logits at position t predict the label at t + 1 (its loss shifts the labels);
            # the last position predicts nothing
            targets = self._shifted(targets)
        if self._check_state in ("armed", "recheck") and self._check_capture is None:
            self._check_raw = (raw, targets is not raw)  # the labels, and whether they were shifted
        # a sequence classifier that pools its per-token logits afterwards (a decoder-only model's `score` head: the
        # logits of the last real token are the sequence's): where that token is, from the attention mask
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        self._pool_mask = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None
        indices = None
        if self.index_fn is not None:
            indices = self.index_fn(batch)
            if not isinstance(indices, Tensor):
                raise TypeError(f"`index_fn` must return a Tensor of sample indices, got {type(indices).__name__}.")
        return targets, indices

    # never traced by torch.compile: it keeps Python state that changes every step (a traced hook would recompile
    # each step until dynamo gives up); the head's own forward stays compiled
    @torch.compiler.disable
    def _on_head_forward(self, module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
                         weighted: Optional[list[Optional[Tensor]]] = None) -> None:
        """Keep what the step's scores need: a few detached tensors, one or two small kernels. ``weighted``: the rows
        the loss weighs, read already (a call kept by the head's choice, after its backward)."""
        if in_dry_run():  # another monitor running the head on a batch of its own: not the step's forward
            return
        if not torch.is_grad_enabled():
            # a call that trains nothing (FixMatch's pseudo-labels made under `no_grad` on another batch, before the
            # trained call): scored, its logits were paired with the labelled batch's targets, and the epoch's mean
            # came out negative where the trained call's was positive, with no alert. The targets wait for the call
            # that trains (under a reentrant checkpoint, its recomputation in the backward)
            return
        inputs = call_args(inputs, kwargs, module)
        pending, self._pending = self._pending, None
        if pending is None or not inputs or not isinstance(output, Tensor):
            return
        targets, indices = pending
        out = output.detach()
        if out.dim() == 3 and targets.dim() == 1 and targets.shape[0] == out.shape[0] and not targets.is_floating_point():
            targets = self._pooled_targets(targets, out.shape[1])
        try:
            targets = self._conform_targets(targets, out)
        except ValueError as err:
            # fewer logits rows than class targets: the head ran on some of the batch's rows only (`head(h[y >= 0])`),
            # in the first batch scored too (where a missing label there ended the fit, or left the preset idle all run)
            rows = math.prod(out.shape[:-1])
            subset = not targets.is_floating_point() and rows < targets.numel()
            if self._may_refuse() and not subset:
                self._refusal = self._refusal or str(err)
                return
            if not self._checked and not subset:
                raise  # the first batch scored: a `target_fn` or `head` that does not fit the model
            # a batch whose head ran on some of its rows only (`head(h[y >= 0])` where a rare label is missing, one head
            # per task's rows), or a later one whose rows do not fit: its rows cannot be paired with the targets, so it
            # is not scored. Raised here, the error ended a healthy fit at the first such batch (step 28-42 with 0.3% of
            # labels missing)
            if not self._said_unpaired:
                self._said_unpaired = True
                self.alert(self._batch_step, "rows_unpaired", "warning",
                           f"The head `{self._head_name}` produced {rows} logits rows for {targets.numel()} targets at step "
                           f"{self._batch_step}" + (": it ran on some of the batch's rows only (`head(h[mask])`)" if subset
                                                    else "") +
                           ". This step is not scored, nor any later one whose head's rows cannot be paired with its "
                           "targets; pass a `target_fn` that returns the targets of the rows the head ran on to score them.")
            return
        z = inputs[0].detach()
        with reading_weights((module,)):  # a parametrized head (spectral_norm) is read as its forward used it
            w = module.weight.detach()
        sharded_head = is_sharded(w)  # FSDP2 resharded the head after its forward: read it from the shards
        if out.dtype == w.dtype == z.dtype and out.dtype in (torch.float32, torch.float64):
            # W z from the logits themselves (an nn.Linear: logits = W z + b)
            if module.bias is None:
                wz = out
            else:  # a sharded bias (FSDP2) is gathered: one vector of the class count
                wz = torch.sub(out, full(module.bias.detach()))
            # a sharded weight's norm: from the local shard and one all-reduce of one float, no gather
            w_norm = global_norm(w).to(w.dtype) if sharded_head else torch.linalg.vector_norm(w)
            z_norm = torch.linalg.vector_norm(z, dim=-1)  # the features enter the score only by their norm
        else:  # reduced precision (autocast): W z again in float32, with autocast off
            if sharded_head:  # W z needs the whole head: gathered on due steps only (see docs/distributed.md)
                w = full(w)
            with torch.autocast(device_type=z.device.type, enabled=False):
                w32 = w.float()
                z32 = z.float()
                wz = z32 @ w32.T
                w_norm = torch.linalg.vector_norm(w32)
                z_norm = torch.linalg.vector_norm(z32, dim=-1)
        if self._stash and self._stash[-1].targets.is_floating_point() != targets.is_floating_point():
            self._flush()
        read = weighted is not None
        weighted = weighted if read else [None, None, None]
        self._stash.append(_Kept(z_norm, wz, out, targets, w_norm, indices, self._batch_step, weighted))
        if output.requires_grad and not read:
            # which rows the loss weighs at all: a row of exactly 0 gradient (a mask or a sample weight of 0 multiplied
            # into per-row losses, padding left at a real class, a loss read at some positions only) trains nothing and
            # is not scored (unless its softmax saturated: see _unsaturated). From the scores' closed form alone they
            # were scored as trained: the masked-token idiom `(cross_entropy(..., reduction="none") * mask).sum() /
            # mask.sum()` gave a mean of the wrong sign. Until the reading of the loss is checked (at the first check,
            # and from a later epoch's check to that epoch's end, where it is judged), and once it was found inexact,
            # the rows' scores are also read from the gradient itself (two reductions): see _read_from_gradient
            asked = (self._scores_from_gradient or self._check_state != "done"
                     or self._recheck_counts is not None)
            output.register_hook(_weighted_rows(weighted, wz if asked else None))
        self._stashed += 2 * out.numel()
        if self._scored_rows is None and self.min_epoch_samples is not None:
            self._scored_rows = out.numel() // max(out.shape[-1], 1)
        raw, self._check_raw = self._check_raw, None
        if raw is not None and output.requires_grad and self._check_capture is None:
            self._capture_gradient(output, out, targets, raw)
        # until the check (and from a later epoch's check to its judgement at the epoch's end), kept: it may find they
        # were read the wrong way (within reason). This step's own batches stay
        # kept until its update: a snapshot of the guard taken before the update leaves them out (see snapshot_state)
        settled = self._check_state in ("done", "recheck") and self._recheck_counts is None
        if (self._stashed >= _FLUSH_ELEMENTS * (1 if settled else 8)
                or len(self._stash) >= _FLUSH_STEPS * (1 if settled else 8)):
            self._flush(before=self._batch_step)

    def _shifted(self, targets: Tensor) -> Tensor:
        """A causal LM's labels as its loss reads them: the logits at ``t`` predict the label at ``t + 1``."""
        fill = -100 if self.ignore_index is None else self.ignore_index
        return F.pad(targets[..., 1:], (0, 1), value=fill)

    # ------------------------------------------------------------------ the loss's reading, from its gradient
    def _reset_gradient_check(self) -> None:
        """Before a fit: the reading of the loss (shift, transform of the logits) is checked again."""
        self._check_state = "pending"  # -> "armed" on a due step -> "done" (or "pending" again: nothing captured)
        self._check_step: Optional[int] = None
        self._check_step_done: Optional[int] = None  # the step whose gradient the reading of the loss was taken from
        self._check_tries = 0
        #: the scored batch's targets as ``target_fn`` gave them, and whether GWA shifted them
        self._check_raw: Optional[tuple[Tensor, bool]] = None
        self._check_capture: Optional[tuple[Tensor, Tensor, Tensor, tuple[Tensor, bool]]] = None
        self._shift_measured = False
        self._logit_scale: Optional[float] = None
        self._logit_bias: Optional[Tensor] = None
        self._label_smoothing: Optional[float] = None
        self._targets_verified = False  # the targets are the loss's (most rows' gradients point at them)

    def _capture_gradient(self, output: Tensor, logits: Tensor, targets: Tensor, raw: tuple[Tensor, bool]) -> None:
        """Keep the gradient of the head's output (this micro-batch's) for :meth:`_check_gradient`."""
        # the monitor is held weakly: the hook lives in the autograd graph, which the collector cannot see into (held
        # strongly, the monitor, its trainer and model outlived the fit; see _HeadWatch.call_hook)
        monitor = weakref.ref(self)

        def hook(grad: Tensor) -> None:
            live = monitor()
            if live is not None and live._check_capture is None:
                live._check_capture = (grad.detach(), logits, targets, raw)
        output.register_hook(hook)

    def _check_gradient(self, trainer: pl.Trainer) -> None:
        """Compare the head's output gradient of this step with the one the scores assume (see the class docstring):
        measure the shift and the transform of the logits the loss reads, and say what neither explains. Every rank
        takes part (the counts and the fit are reduced), so every rank scores alike."""
        capture, self._check_capture = self._check_capture, None
        step = trainer.global_step
        c = self._head.out_features
        dev = _device_of(self._head)
        # [judged, off, targeted, hit] for the targets scored, [targeted, hit] for the other reading, the fit (scale
        # and epsilon of the gradient's dtype, times the rows fitted; the rows fitted), the label smoothing read on the
        # targets scored and on the other reading (each: times the rows fitted; the rows fitted; the epsilon of the
        # gradient's dtype times the rows fitted)
        counts = torch.zeros(17, dtype=torch.float64, device=dev)  # and the rows' logit spread, summed, and rows
        bias = torch.zeros(c, dtype=torch.float64, device=dev)
        mine = other = None  # this rank's gradient, logits and the two readings of its labels
        if capture is not None and capture[1].shape[-1] == c:
            grad, logits, targets, (raw, shifted) = capture
            if self.shift_targets is None and not raw.is_floating_point() and raw.dim() >= 2:
                try:
                    other = self._conform_targets(raw if shifted else self._shifted(raw), logits)
                except ValueError:  # that reading fits no row of these logits
                    other = None
            counts[:4] = head_gradient_agreement(grad, logits, targets, ignore_index=self.ignore_index,
                                                 softcap=self._softcap)
            if other is not None:
                counts[4:6] = head_gradient_agreement(grad, logits, other, ignore_index=self.ignore_index,
                                                      softcap=self._softcap)[2:]
            if not targets.is_floating_point():
                fit = head_gradient_fit(grad, logits, softcap=self._softcap)
                # only a fit the gradient follows exactly (to its rounding): an approximate one (logits averaged
                # with another head's, a distilled model's) is no transform of this head's outputs
                exact = fit.residual <= max(_TRANSFORM_TOLERANCE, 8 * torch.finfo(grad.dtype).eps)
                if fit.rows and math.isfinite(fit.scale) and exact:
                    counts[6], counts[7] = fit.rows * fit.scale, fit.rows
                    counts[8] = fit.rows * torch.finfo(grad.dtype).eps
                    if fit.bias is not None:
                        bias = fit.bias.to(dev) * fit.rows
                for at, reading in ((9, targets), (12, other)):
                    if reading is None:
                        continue
                    rows, smoothing = label_smoothing_fit(grad, logits, reading, softcap=self._softcap)
                    if rows and math.isfinite(smoothing):
                        counts[at: at + 3] = torch.tensor([rows * smoothing, rows, rows * torch.finfo(grad.dtype).eps])
            spread = logits.detach().reshape(-1, c).double().std(-1)
            counts[15], counts[16] = spread.sum(), spread.numel()
            mine = (grad, logits, targets, other, shifted)
        if trainer.world_size > 1:
            counts = trainer.strategy.reduce(counts, reduce_op="sum")
            bias = trainer.strategy.reduce(bias, reduce_op="sum")
        values = counts.tolist()  # once
        judged, off, targeted, hit, targeted_other, hit_other, scale_sum, fitted, eps_sum = values[:9]
        if targeted + judged == 0 and fitted == 0:  # no gradient reached the head on any rank: the next due step
            self._check_tries += 1
            self._check_state = "pending" if self._check_tries < _CHECK_TRIES else "done"
            return
        self._check_state = "done"
        self._check_step_done = step
        changed = shift_changed = False
        if targeted_other > 0 and hit < 0.5 * targeted and hit_other >= _HIT_FRACTION * targeted_other:
            # every rank read its labels the same way (the same rule on the same kind of batch)
            now_shifted = not (mine[4] if mine is not None else self._shift)
            self._shift, self._shift_measured, changed = now_shifted, True, True
            shift_changed = True
            hit, targeted = hit_other, targeted_other
            self.alert(
                step, "targets_shifted", "info",
                f"The gradient of `{self._head_name}`'s output points at the labels "
                f"{'shifted by one position' if now_shifted else 'as given'} in {hit_other:.0f} of "
                f"{targeted_other:.0f} rows: the model's loss reads them so, and GWA scores them so from now on "
                "(`shift_targets=` decides).",
            )
        self._targets_verified = targeted > 0 and hit >= _HIT_FRACTION * targeted
        if targeted > 0 and hit < _TRAINED_FRACTION * targeted and self._other_heads:
            # another layer qualified as the head too (softmax gradients, returned by the model): the targets read may
            # be its own (a main head called before an auxiliary one). It is scored instead, checked at the next due
            # step; what was kept was read for this one
            name, module = self._other_heads.pop(0)
            self.alert(
                step, "head_changed", "info",
                f"In {targeted - hit:.0f} of {targeted:.0f} rows the gradient of `{self._head_name}`'s output points at "
                f"another class than the targets GWA reads: they are not its targets. `{name}`, which qualified as the "
                "head too, is scored instead (its gradient is checked against the targets at the next due step). Pass "
                "`head=` to choose.",
            )
            self._drop_kept("they were read for another layer than the head")
            self._adopt_head(name, module, trainer.lightning_module)
            self._reset_gradient_check()
            return
        if targeted > 0 and hit < _TRAINED_FRACTION * targeted:
            # the loss trains other targets than those read (a tuple batch whose batch[1] is an attention mask,
            # sequence-first logits paired with batch-first labels), or `head` is not the layer whose outputs the loss
            # reads: the scores would be of nothing the run trains, so none is published (the same on every rank)
            self._stash, self._stashed = [], 0
            self.nothing_to_watch(
                trainer,
                f"in {targeted - hit:.0f} of {targeted:.0f} rows the gradient of `{self._head_name}`'s output points "
                "at another class than the targets GWA reads: the loss trains other targets (check `target_fn`: the "
                "default takes batch[1] of a tuple, e.g. an attention mask; sequence-first logits need targets in "
                "the same layout), or `head` is not the layer whose outputs the loss reads (a head applied as "
                "`x @ embedding.weight.T` is no module: pass `head=` naming the layer that makes the logits), or "
                "the model has no softmax classifier head at all (a one-output head trained with a sigmoid loss, as "
                "Electra's discriminator: GWA does not apply).",
                training=True,
            )
            return
        scored = None if mine is None else (mine[3] if self._shift_measured else mine[2])
        # the scale and per-class bias the fit measured, where either is more than its rounding
        transform: Optional[dict[str, Any]] = None
        if fitted > 0:
            scale, b, eps = scale_sum / fitted, bias / fitted, eps_sum / fitted
            spread = float(b.max() - b.min())
            has_bias = spread > max(_TRANSFORM_TOLERANCE, 16 * eps)
            # the slope's own error: the gradient's rounding (eps of its log) over the logits' spread within a row. In
            # bf16 on a small head near its init (logits 0.02 apart) that is several percent, and plain cross-entropy
            # was read as a scale of 0.93-1.11 (Bert, RoBERTa, DistilBERT sequence classifiers under bf16-mixed)
            sigma = values[15] / values[16] if values[16] > 0 else 0.0
            noise = 4 * eps / (sigma * math.sqrt(fitted)) if sigma > 0 else math.inf
            has_scale = scale > 0 and abs(scale - 1.0) > max(_TRANSFORM_TOLERANCE, 2 * eps, noise)
            if has_bias or has_scale:
                transform = {"logit_scale": scale if has_scale else None, "logit_bias": b if has_bias else None}
        # the smoothing read on the labels as scored from here (the other reading where they were just shifted)
        smoothing_sum, smoothing_rows, smoothing_eps = values[12:15] if shift_changed else values[9:12]
        smoothing = smoothing_sum / smoothing_rows if smoothing_rows > 0 else math.nan
        if _SMOOTHING_MIN < smoothing < 1.0:
            # the loss smooths its labels (cross_entropy's label_smoothing): near a uniform softmax that reads as a logit
            # scale of 1 / (1 - eps) (the transform fit would take it for one, and apply it all run); the reading
            # whose direction is nearer the gradients' is kept
            readings = [{"label_smoothing": smoothing}, {}] + ([transform] if transform else [])
            found = self._agreement(trainer, mine, scored, readings)
            (s_judged, s_off, s_misfit, _), others = found[0], found[1:]
            # exact to the gradient's rounding (a z-loss is explained better by some smoothing than by none, not
            # exactly), where the plain reading is not (two classes: every reading points the same way)
            tolerance = max(_SMOOTHING_MISFIT, 16 * (smoothing_eps / smoothing_rows) ** 2)
            exact = s_misfit <= tolerance < others[0][2]
            if exact and s_judged > 0 and s_off <= _OFF_FRACTION * s_judged and all(m > s_misfit for _, _, m, _ in others):
                self._label_smoothing, self._logit_scale, self._logit_bias = smoothing, None, None
                self.alert(
                    step, "label_smoothing", "info",
                    f"The loss smooths its labels (label smoothing {smoothing:.4g}), measured from the gradient of "
                    f"`{self._head_name}`'s output: GWA scores each sample against its smoothed target, "
                    f"(1 - {smoothing:.4g}) on its class and {smoothing:.4g} / {c} on every class.",
                    value=smoothing,
                )
                transform, changed = None, True  # no transform besides
        if transform is not None:
            judged_t, off_t, _, _ = self._agreement(trainer, mine, scored, [transform])[0]
            if judged_t > 0 and off_t <= _OFF_FRACTION * judged_t:  # scoring through it agrees with the gradients
                self._logit_scale = transform["logit_scale"]
                self._logit_bias = None if transform["logit_bias"] is None else transform["logit_bias"].to(torch.float32)
                changed = True
                said = " plus ".join(
                    [f"{scale:.4g} times the head's outputs" if self._logit_scale is not None else "the head's outputs"]
                    + ([f"a per-class bias (spread {spread:.3g})"] if self._logit_bias is not None else []))
                self.alert(
                    step, "logit_transform", "info",
                    f"The loss's softmax reads {said}, measured from the gradient of `{self._head_name}`'s output "
                    "(a model's logit scale, temperature or final logits bias): GWA's probabilities are taken of that.",
                    value=scale,
                )
        if changed:
            # the targets kept were read the other way: dropped. A transform alone keeps them: what is kept is the
            # head's own output, and the transform is applied when it is scored (``_flush``); dropping it cost a model
            # with a logit scale (Granite) its first epoch's scores, with a warning that blamed the cadence
            if shift_changed:
                self._drop_kept("their labels were read the other way")
        # the reading adopted, against the gradient: exact to its rounding, or the scores are read from the gradient
        judged_a, off_a, misfit, allowed = self._agreement(trainer, mine, scored, [self._reading()])[0]
        if judged_a > 0 and misfit > max(_SMOOTHING_MISFIT, allowed):
            self._read_from_gradient(
                step, judged_a, off_a,
                f"The gradient of `{self._head_name}`'s output is not the softmax cross-entropy's that GWA reads on its "
                f"targets (mean 1 - cosine {misfit:.2g}): the loss is another one (class weights with label smoothing, "
                "a z-loss or another term on the logits, distillation's soft targets, logits averaged with another "
                "head's ...).")

    def _recheck(self, trainer: pl.Trainer) -> None:
        """The reading of the loss adopted at the first check (a plain softmax cross-entropy, a logit scale or bias, a
        label smoothing), compared with the head's output gradient at the first due step of a later epoch. Near the
        random init's uniform softmax some readings cannot be told apart (a temperature with label smoothing reads as
        one logit scale; soft targets smoothed again read as the targets given), and the scores followed the wrong
        one all run without a word; once the softmax has sharpened they part. The counts stay on the device until the
        epoch's end (:meth:`_say_drift`), where a mean misfit above the reading's tolerance turns the scores to the
        gradient's own (``scores_from_gradient``, once per run)."""
        capture, self._check_capture = self._check_capture, None
        self._check_state = "done"
        reading = self._reading()
        counts = torch.zeros(4, dtype=torch.float64, device=_device_of(self._head))
        if capture is not None and capture[1].shape[-1] == self._head.out_features:
            grad, logits, targets, _ = capture
            found = head_gradient_agreement(grad, logits, targets, ignore_index=self.ignore_index,
                                            softcap=self._softcap, misfit=True, **reading)
            counts[:4] = found[[0, 1, 4, 5]].to(counts.device)  # judged, off, misfit, what rounding allows
        said = ", ".join(f"{k.replace('_', ' ')} {v:.4g}" for k, v in reading.items() if not isinstance(v, Tensor))
        self._recheck_counts = (counts, trainer.global_step, said or "on the targets as given")

    def _say_drift(self, trainer: pl.Trainer) -> None:
        """At an epoch's end (a collective where the epoch's sums are reduced anyway): the counts of :meth:`_recheck`,
        read, and said if the reading no longer fits."""
        pending, self._recheck_counts = self._recheck_counts, None
        if pending is None:
            return
        counts, step, said = pending
        if trainer.world_size > 1:
            counts = trainer.strategy.reduce(counts, reduce_op="sum")
        judged, off, misfit, allowed = counts.tolist()
        if judged > 0 and misfit > max(_SMOOTHING_MISFIT * judged, allowed) and not self._scores_from_gradient:
            self._read_from_gradient(
                trainer.global_step, judged, off,
                f"The gradient of `{self._head_name}`'s output at step {step} no longer fits the reading of the loss "
                f"taken at step {self._check_step_done} ({said}): near the start's uniform softmax the loss passed for "
                "it, and the sharper softmax of later steps parts them (a temperature with label smoothing, soft "
                "targets smoothed again, logits clamped ...). The epochs scored before step "
                f"{step} were read with it: their logged values stay as they are and may be off, as may a best "
                "epoch picked among them.")

    def _reading(self) -> dict[str, Any]:
        """The reading of the loss adopted (keyword arguments of :func:`head_gradient_agreement`)."""
        reading: dict[str, Any] = {}
        if self._label_smoothing is not None:
            reading["label_smoothing"] = self._label_smoothing
        if self._logit_scale is not None:
            reading["logit_scale"] = self._logit_scale
        if self._logit_bias is not None:
            reading["logit_bias"] = self._logit_bias
        return reading

    def _read_from_gradient(self, step: int, judged: float, off: float, why: str) -> None:
        """From now on, score each row from its own output gradient (the loss is not one the closed form reads
        exactly); said once (``scores_from_gradient``). The steps kept and not folded yet whose gradient was read are
        scored so too."""
        self._scores_from_gradient = self._drift_said = True
        self.alert(
            step, "scores_from_gradient", "info",
            f"{why} {off:.0f} of {judged:.0f} rows are off by more than 1e-3 in cosine. From here on each row's score "
            "is read from its own output gradient g, cos(-g z^T, W) (two reductions a scored step): exact for any "
            "loss computed row by row.",
            value=off / judged if judged else None,
        )

    def _agreement(self, trainer: pl.Trainer, mine: Optional[tuple[Any, ...]], targets: Optional[Tensor],
                   readings: list[dict[str, Any]]) -> list[tuple[float, float, float]]:
        """``(judged, off, mean misfit)`` of the gradients against each reading of the logits (keyword arguments of
        :func:`head_gradient_agreement`), over the rows of every rank (reduced: every rank decides alike)."""
        dev = _device_of(self._head)
        counts = torch.zeros(len(readings), 4, dtype=torch.float64, device=dev)
        if mine is not None and targets is not None:
            for i, reading in enumerate(readings):
                found = head_gradient_agreement(mine[0], mine[1], targets, ignore_index=self.ignore_index,
                                                softcap=self._softcap, misfit=True, **reading)
                counts[i] = found[[0, 1, 4, 5]].to(dev)
        if trainer.world_size > 1:
            counts = trainer.strategy.reduce(counts, reduce_op="sum")
        return [(j, o, m / j if j > 0 else math.inf, a / j if j > 0 else 0.0) for j, o, m, a in counts.tolist()]

    def _pooled_targets(self, targets: Tensor, length: int) -> Tensor:
        """One label per sequence for logits of every token (``[B, T, C]``): the label goes to the sequence's last
        real token (the last 1 of the batch's ``attention_mask``; the last position without one), the other tokens
        are ignored. That is the token a decoder-only sequence classifier (``LlamaForSequenceClassification``, GPT-2's,
        Qwen2's) pools: its logits are the sequence's."""
        fill = -100 if self.ignore_index is None else self.ignore_index
        out = torch.full((targets.shape[0], length), fill, dtype=targets.dtype, device=targets.device)
        mask = self._pool_mask
        if mask is not None and mask.shape == (targets.shape[0], length):
            last = (length - 1) - mask.to(targets.device).flip(-1).int().argmax(-1)
        else:
            last = torch.full((targets.shape[0],), length - 1, dtype=torch.long, device=targets.device)
        return out.scatter_(1, last.long().unsqueeze(1), targets.unsqueeze(1))

    def _conform_targets(self, targets: Tensor, logits: Tensor) -> Tensor:
        """Targets on the logits' device with their leading shape; checks once with one host sync."""
        if targets.device != logits.device:
            # to CUDA from the host a copy that does not wait has read its source on return; to MPS it may read it after
            # the source is freed, so there the copy waits
            targets = targets.to(logits.device, non_blocking=logits.device.type == "cuda")
        rows = logits.shape[:-1]
        if self._checked and targets.shape == rows and not targets.is_floating_point():
            return targets  # the common case, after the first batch
        if targets.is_floating_point():
            if targets.shape != logits.shape:
                # one real number per sample ([B] or [B, 1]): a regression's or a one-logit classifier's targets, whose
                # head (one output) is no candidate, so the layer named is a hidden one
                regression = targets.numel() == math.prod(rows)
                raise ValueError(
                    f"`target_fn` returned floating-point targets of shape {tuple(targets.shape)} for logits "
                    f"{tuple(logits.shape)} of head `{self._head_name}`: "
                    + ("one real number per sample (a regression's targets, or a one-logit binary classifier's): GWA "
                       f"scores a softmax classifier only, and `{self._head_name}` is a hidden layer (a one-output head "
                       "is no candidate)."
                       if regression else
                       "GWA needs integer class indices or soft targets (probabilities) of the logits' shape. Fix "
                       "`target_fn` (or `head`).")
                )
        elif targets.shape != rows:
            if targets.numel() != math.prod(rows):
                raise ValueError(
                    f"`target_fn` returned targets of shape {tuple(targets.shape)} but head `{self._head_name}` "
                    f"produced logits {tuple(logits.shape)}: one target per logits row is needed. Pass "
                    "`head=` (the layer producing the logits) or a `target_fn=` that returns a target per row (with "
                    "`ignore_index` for the rows without one)."
                )
            if targets.dim() == 2 and len(rows) == 2 and tuple(targets.shape) == tuple(rows)[::-1]:
                # sequence-first logits [T, B, C] against batch-first targets [B, T] (T != B): each row's own target
                # is the transpose's (a reshape would pair rows with other tokens' targets)
                targets = targets.transpose(0, 1)
            else:
                targets = targets.reshape(rows)
        if not self._checked:
            self._check_targets_once(targets, logits.shape[-1])
            self._checked = True
        return targets

    def _check_targets_once(self, targets: Tensor, num_classes: int) -> None:
        if targets.is_floating_point():
            if not bool(((targets >= 0).all() & ((targets.sum(-1) - 1).abs() < 1e-3).all()).item()):
                raise ValueError(
                    "`target_fn` returned floating-point targets that are not probabilities (non-negative, "
                    "rows summing to 1). GWA needs class indices or soft targets."
                )
            return
        t = targets.long()
        # a negative target is a sample the loss ignores with an index of its own (`ignore_index=-1`), counted and said
        # at the epoch's end (`targets_out_of_range`) as in any later batch: in the first batch it stopped the fit (or
        # left the preset's monitor idle). A class beyond the head's outputs is a wrong `target_fn` or `head`
        valid = t < num_classes
        if not bool(valid.all().item()):
            raise ValueError(
                f"`target_fn` returned class targets {t[~valid][:5].tolist()} outside [0, {num_classes}) for head "
                f"`{self._head_name}` (ignore_index={self.ignore_index}). Fix `target_fn`, `head` or `ignore_index`."
            )

    def _drop_kept(self, why: str) -> None:
        """Drop the batches kept since the last flush (read the wrong way); an epoch left with too few scores says
        why."""
        if self._stash:
            self._dropped = (self._epoch_open, why)
        self._stash, self._stashed = [], 0

    def _flush(self, before: Optional[int] = None) -> None:
        """Score the kept steps and fold them into the epoch accumulators (on device, no host sync); ``before``: only
        those of earlier steps than it (the others stay kept)."""
        if before is None:
            stash, self._stash, self._stashed = self._stash, [], 0
        else:
            stash = [k for k in self._stash if k.step < before]
            self._stash = [k for k in self._stash if k.step >= before]
            self._stashed = sum(2 * k.logits.numel() for k in self._stash)
        if not stash:
            return
        with torch.autocast(device_type=stash[0].logits.device.type, enabled=False):
            self._fold(stash)

    def _fold(self, stash: list[_Kept]) -> None:
        c = stash[0].logits.shape[-1]
        soft = stash[0].targets.is_floating_point()
        flat = all(e.logits.dim() == 2 for e in stash)  # [B, C] logits: rows already flat, no reshapes

        def cat(parts: Sequence[Tensor], *shape: int) -> Tensor:
            parts = parts if flat else [p.reshape(shape) for p in parts]
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        kept = _Kept(*zip(*stash))  # one tuple per field, over the steps
        z_norm, wz, logits = cat(kept.z_norm, -1), cat(kept.wz, -1, c), cat(kept.logits, -1, c)
        targets = cat(kept.targets, *((-1, c) if soft else (-1,)))
        w_norm = torch.stack(kept.w_norm)
        if len(stash) > 1:  # one ||W|| per row: each step's, repeated over its rows
            rows = [out.numel() // c for out in kept.logits]
            if rows.count(rows[0]) == len(rows):  # equal batches: no repeat tensor
                w_norm = w_norm.repeat_interleave(rows[0])
            else:
                w_norm = w_norm.repeat_interleave(torch.tensor(rows, device=w_norm.device), output_size=sum(rows))
        unweighted = None
        if any(e.weighted[0] is not None for e in stash):
            # rows with a target the loss gave no gradient: weighed 0 (a mask multiplied into per-row losses), unless
            # their softmax has saturated (a gradient rounded to 0: scored, the closed form is exact there)
            weighted = torch.cat([e.weighted[0] if e.weighted[0] is not None
                                  else torch.ones(e.logits.numel() // c, dtype=torch.bool, device=e.logits.device)
                                  for e in stash])
            unweighted = ~weighted & _unsaturated(logits, targets, self.ignore_index, self._logit_scale,
                                                  self._logit_bias)
            self._unweighted += unweighted.sum()

        def score(label_smoothing: Optional[float]) -> Tensor:
            scores = alignment_from_parts(
                None, wz, logits, targets, w_norm, ignore_index=self.ignore_index, feature_norm=z_norm,
                softcap=self._softcap, logit_scale=self._logit_scale, logit_bias=self._logit_bias,
                label_smoothing=label_smoothing,
            ).double()
            # rows the loss gave no gradient are not scored (NaN: left out of every statistic)
            return scores if unweighted is None else torch.where(unweighted, math.nan, scores)

        scores = score(self._label_smoothing)
        if self._scores_from_gradient and any(e.weighted[1] is not None for e in stash):
            # the loss is not one the closed form reads exactly: each row's score from its own output gradient g,
            # cos(-g z^T, W) = -(g . W z) / (||g|| ||z|| ||W||), where the backward gave it (the rows scored above)
            dot = torch.cat([e.weighted[1] if e.weighted[1] is not None
                             else torch.full((e.logits.numel() // c,), math.nan, device=e.logits.device)
                             for e in stash]).double()
            norm = torch.cat([e.weighted[2] if e.weighted[2] is not None
                              else torch.full((e.logits.numel() // c,), math.nan, device=e.logits.device)
                              for e in stash]).double()
            read = -dot / (norm * z_norm.double() * w_norm.double())
            scores = torch.where(torch.isfinite(scores) & torch.isfinite(read), read, scores)
        self._moments.update(scores)
        finite = torch.isfinite(scores)
        self._negative += (scores < 0).sum()
        if not soft:  # on the device; read at the epoch's end
            outside = (targets < 0) | (targets >= c)
            if self.ignore_index is not None:
                outside &= targets != self.ignore_index
            self._out_of_range += outside.sum()
        if self._want_histogram:
            self._hist += _bin_counts(torch.where(finite, scores, 2.0), _HIST_BINS, -1.0, 1.0)  # 2: out of range
            lo = torch.where(finite, scores, math.inf).min()
            hi = torch.where(finite, scores, -math.inf).max()
            self._minmax = torch.stack([torch.minimum(self._minmax[0], lo), torch.maximum(self._minmax[1], hi)])
        if self.suspects > 0 and all(i is not None for i in kept.indices):
            extra = self._suspect_columns(stash, logits, targets, soft)
            if self._label_smoothing is not None and not soft:
                # a suspect resists its own label. Against the smoothed target every confidently fitted sample scores
                # below 0 (-<p - t, Wz> = eps (mean logit - logit_y) < 0 when p is one-hot on y), and the lists held
                # clean, correctly predicted samples only (precision 0.12 at 20% flipped labels, 0.97 without
                # smoothing): ranked against the label itself (the score that is logged stays the loss's)
                scores = score(None)
                finite = torch.isfinite(scores)
            cols = torch.cat([torch.where(finite, scores, math.inf).unsqueeze(0), extra])
            merged = torch.cat([self._top, cols], dim=1)
            k = min(self.suspects, merged.shape[1])
            self._top = merged[:, merged[0].topk(k, largest=False).indices]
            if self._run is not None and flat:
                self._run.add(extra[0], scores, finite, self._run_weight())
            elif self._run is not None:
                # scores per token (a language model's): a sample's mean over the run would mix its tokens, so the
                # run-level list is not kept (each epoch's suspects file lists tokens); said once, no empty file
                self._run = None
                rank_zero_info(f"GradientWeightAlignmentMonitor: the head scores every token, so the suspects over the "
                               f"run ({RUN_SUSPECTS_FILENAME}, one mean per sample) are not kept; each epoch's "
                               "suspects file lists the tokens.")

    def _suspect_columns(self, stash: list[_Kept], logits: Tensor, targets: Tensor, soft: bool) -> Tensor:
        """``[4, N]`` float64: sample index, position (token) or -1, target (-1 if soft), predicted."""
        dev = logits.device
        # a head run sequence-first ([T, B, C], T != B: index_fn gave one index per column) lists its rows time-major
        first = [e.logits.dim() == 3 and e.indices.numel() != e.logits.shape[0] for e in stash]
        for e, seq in zip(stash, first):
            if e.indices.numel() != e.logits.shape[1 if seq else 0]:
                raise ValueError(
                    f"`index_fn` returned {e.indices.numel()} indices for a batch of {e.logits.shape[0]} samples: "
                    "one index per sample (row of the batch) is needed."
                )
        n = logits.shape[0]
        if all(e.logits.dim() == 2 for e in stash):  # one row per sample
            idx = torch.cat([e.indices.reshape(-1) for e in stash]).to(dev, torch.float64)
            pos = torch.full((n,), -1.0, dtype=torch.float64, device=dev)
        else:  # tokens: sample index repeated, position within the sample
            idx_parts, pos_parts = [], []
            for e, seq in zip(stash, first):
                ids = e.indices.to(dev).reshape(-1)
                b = ids.numel()
                per = e.logits.numel() // (b * e.logits.shape[-1])  # tokens per sample
                if seq:  # row t * B + b: sample b, position t
                    idx_parts.append(ids.repeat(per))
                    pos_parts.append(torch.arange(per, device=dev).repeat_interleave(b))
                else:
                    idx_parts.append(ids.repeat_interleave(per))
                    pos_parts.append(torch.arange(per, device=dev).repeat(b))
            idx = torch.cat(idx_parts).double()
            pos = torch.cat(pos_parts).double()
        tgt = torch.full((n,), -1.0, dtype=torch.float64, device=dev) if soft else targets.double()
        return torch.stack([idx, pos, tgt, logits.argmax(-1).double()])

    # ------------------------------------------------------------------ per epoch
    def _may_refuse(self) -> bool:
        """Whether targets that do not fit the head make the monitor idle instead of failing the fit: with
        ``idle_when_nothing_to_watch`` (the preset), until the first scored batch has been settled."""
        return self.idle_when_nothing_to_watch and not self._targets_settled

    def _settle_targets(self, trainer: pl.Trainer) -> None:
        """After the first scored batch (``idle_when_nothing_to_watch`` only): if any rank's targets did not fit
        the head (an autoencoder's batch without targets, regression or multi-label targets: no softmax
        classifier here), every rank goes idle together; the reduction is one collective per fit."""
        self._targets_settled = True
        refused = self._refusal is not None
        if trainer.world_size > 1:
            refused = self.decide(trainer, refused)
        pending, self._pending_no_softmax = self._pending_no_softmax, None
        several, self._pending_several = self._pending_several, None
        if refused:
            self._stash, self._stashed, self._pending = [], 0, None
            why = self._refusal or "another rank's targets did not fit it"
            self.nothing_to_watch(trainer, f"the batches' targets do not fit a softmax classifier on `{self._head_name}` "
                                           f"({why}). Pass `target_fn=` and `head=` if this model has one (an "
                                           "nn.Linear producing the logits: a convolutional head, as in "
                                           "segmentation models, is not scored).")
        else:
            if several is not None:
                self.alert(several[0], "several_heads", "warning", several[1])
            if pending is not None:
                self.alert(pending[0], "no_softmax_head", "warning", pending[1])
        self._refusal = None

    def _release_all(self) -> None:
        super()._release_all()
        if self._head_watch is not None:  # a fit that ended or failed inside the watched forward
            self._head_watch.remove()
            self._head_watch = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._head_watch is not None:  # no backward in this batch
            self._resolve_head(trainer, pl_module)
        if self.idle_reason is not None:
            return
        if self.idle_when_nothing_to_watch and not self._targets_settled and self._targets_tried:
            self._settle_targets(trainer)
            if self.idle_reason is not None:
                return
        if self._scored_rows is not None and self._scored_rows > 0:  # the fit's first scored step (-1 once decided)
            self._set_cadence(trainer)
        if self._pending is not None and pl_module.automatic_optimization and not outputs:
            # `training_step` returned None (the hook gets an empty dict): a batch skipped on purpose (Lightning runs no
            # backward and no step), before or after its forward; nothing of it is scored and there is nothing to say
            # (the head was blamed)
            self.release()
            self._pending = None
        if self._pending is not None:  # the head did not run in this batch's forward
            self.release()
            self._pending = None
            rank_zero_warn(
                f"GradientWeightAlignmentMonitor: head `{self._head_name}` was not called in a training step; "
                "nothing scored. Pass `head=` naming the layer that produces the logits."
            )
        # the hook's batch_idx is the loop's batch count in this epoch minus one (also after a mid-epoch resume)
        if trainer.is_last_batch or batch_idx + 1 >= trainer.num_training_batches:
            if self._unsized_rows is not None:  # the first epoch of unknown length has shown its length
                rows, self._unsized_rows = self._unsized_rows, None
                batches = batch_idx + 1
                if trainer.world_size > 1:  # rank 0's count for every rank: the cadences stay alike
                    batches = trainer.strategy.broadcast(batches, src=0)
                self._scored_rows = rows
                self._set_cadence(trainer, batches)
            self._finish_epoch(trainer, complete=True)

    def _set_cadence(self, trainer: pl.Trainer, batches: Optional[int] = None) -> None:
        """``min_epoch_samples``: lower ``every_n_steps`` (once per fit) so that an epoch scores about that many
        samples, from the first scored micro-batch's samples, the gradient accumulation and the ranks (each rank
        decides alike from its own first batch: the samplers give every rank batches of one size). An epoch of
        unknown length (an iterable without ``__len__``) is decided when the first one ends, from its ``batches``:
        before, the cadence stayed as given and an epoch of 16 batches was scored from one or two of them."""
        rows, self._scored_rows = self._scored_rows, -1  # decided once
        if rows is None or self.min_epoch_samples is None:
            return  # the cadence as given
        steps = steps_per_epoch(trainer, batches)
        if steps is None:
            self._unsized_rows = rows  # decided at the end of the first epoch, from its length
            return
        per_epoch = batches_per_epoch(trainer, batches) * rows * max(trainer.world_size, 1)
        # at most an epoch's steps apart: a cadence above them (the preset's 10 on epochs of 4 accumulated steps) left
        # most epochs without a scored step, whatever samples they held, and GWA skipped them
        every = max(1, min(self.every_n_steps, steps, per_epoch // self.min_epoch_samples))
        # an epoch too small for min_epoch_samples even when every step is scored (overfit_batches, a tiny data set)
        short = (f" Even so an epoch gives fewer samples than min_epoch_samples: each epoch's score rests on about "
                 f"{per_epoch}, and expect noisier scores and picks (and more of them called uncertain)."
                 if per_epoch < self.min_epoch_samples else "")
        if every >= self.every_n_steps:
            if short:
                self.alert(trainer.global_step, "cadence", "info",
                           f"An epoch holds about {per_epoch} samples ({steps} steps), scored at every "
                           f"{'step' if every == 1 else f'{every} steps'}.{short}", value=float(self.every_n_steps))
            return
        was, self.every_n_steps = self.every_n_steps, every
        why = (f"an epoch has only {steps} step{'s' if steps > 1 else ''}, so scoring every {was} steps would leave "
               "most epochs with no scored step" if every == steps < was
               else f"scoring every {was} steps would give about {per_epoch // was} an epoch, too few for the "
                    f"kurtosis GWA divides by (min_epoch_samples={self.min_epoch_samples})")
        self.alert(
            trainer.global_step, "cadence", "info",
            f"An epoch holds about {per_epoch} samples ({steps} steps): {why}; scoring every {every} "
            f"step{'s' if every > 1 else ''} from here.{short}",
            value=float(every),
        )

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.idle_reason is not None:
            return
        # reached without the epoch's last batch: training ended inside the epoch (max_steps, a stop)
        self._finish_epoch(trainer, complete=False)

    def _reduce(self, trainer: pl.Trainer) -> tuple[Tensor, float, float, float, Tensor, Tensor]:
        """The epoch's accumulators of every rank, on the host: moments, negatives, min, max, histogram and
        the suspects' columns (``[5, ranks * k]``). One gather, one host transfer."""
        k = self.suspects
        packed = torch.cat(
            [self._moments.state, self._negative.reshape(1), self._minmax, self._hist, self._top.reshape(-1)]
        )
        gathered = trainer.strategy.all_gather(packed) if trainer.world_size > 1 else packed
        rows = gathered.reshape(trainer.world_size, -1).to("cpu", torch.float64)
        state = GWAMoments.combine(rows[:, :5])
        negative = float(rows[:, 5].sum())
        lo, hi = float(rows[:, 6].min()), float(rows[:, 7].max())
        hist = rows[:, 8 : 8 + _HIST_BINS].sum(0)
        top = rows[:, 8 + _HIST_BINS :].reshape(rows.shape[0], 5, k).permute(1, 0, 2).reshape(5, -1)
        return state, negative, lo, hi, hist, top

    def _finish_epoch(self, trainer: pl.Trainer, complete: bool) -> None:
        if self._finished:
            return
        self._finished = True
        self.release()  # no scoring in a validation loop that follows
        # the check of the reading taken at this epoch's first due step, judged before its steps still kept are scored:
        # a reading found off has them scored from their gradient (read since that check)
        self._say_drift(trainer)
        self._flush()
        if self._forward_only and not self._trained:
            return  # nothing was trained (StochasticWeightAveraging's BatchNorm epoch): nothing to score or select
        epoch, step = trainer.current_epoch, trainer.global_step
        if (complete and self._timed_warmup is None and self.warmup_epochs is None and self.warmup_fraction > 0
                and self._timer(trainer) is not None):
            self._plan_by_time(trainer, epoch)
        self._say_if_frozen(step, during=True)  # the head frozen since (GradES): said once (the flag is every rank's)
        state, negative, lo, hi, hist, top = self._reduce(trainer)
        outside = int(self._out_of_range)
        if outside and not self._said_out_of_range:
            self._said_out_of_range = True
            self.alert(
                step, "targets_out_of_range", "warning",
                f"{outside} class target(s) of epoch {epoch} lie outside [0, {self._head.out_features}) and are not scored "
                f"(GWA's ignore_index is {self.ignore_index}): a loss with another ignore index (e.g. "
                "`cross_entropy(..., ignore_index=-1)`), or a step that leaves such samples out of its loss itself (unlabelled "
                "samples marked -1 in semi-supervised training), trains on the others. Pass that value as `ignore_index=` "
                "to the monitor.",
                value=float(outside),
            )
        unweighted = int(self._unweighted)
        if unweighted and not self._said_unweighted:
            self._said_unweighted = True
            self.alert(
                step, "unweighted_rows", "info",
                f"{unweighted} row(s) of epoch {epoch} had a target but no gradient from the loss (a mask or sample "
                "weights of 0 multiplied into per-row losses, or logits the loss does not read): they train nothing "
                "and are not scored. (Said once.)",
                value=float(unweighted),
            )
        stats = GWAMoments.from_state(state).compute(GWA_OFFSET, min_count=_MIN_SAMPLES)
        count = int(stats.count)
        score, mean, kurtosis = float(stats.score), float(stats.mean), float(stats.kurtosis)

        record: dict[str, Any] = {"epoch": epoch, "step": step, "count": count, "score": None, "eligible": False}
        if not complete:
            record["partial"] = True
            # a resume into this epoch replaces the record and the selection it made with the whole epoch's
            self._before_partial = self._selection_state()
        full = [h["count"] for h in self.history if not h.get("partial") and h.get("count", 0) >= _MIN_SAMPLES]
        # an epoch cut short on less than half of a whole epoch's samples is logged but not selected
        small = not complete and bool(full) and count < 0.5 * max(full)
        metrics: dict[str, float] = {}
        if count < _MIN_SAMPLES and not complete and full:
            pass  # the last epoch, cut short by `max_steps` before enough samples were scored: nothing to say
        elif count < _MIN_SAMPLES:
            rank_zero_warn(
                f"GradientWeightAlignmentMonitor: epoch {epoch} scored {count} < {_MIN_SAMPLES} samples; GWA "
                "skipped for this epoch " + (
                    f"(the batches scored before the check of the head's gradient were dropped: {self._dropped[1]})"
                    if self._dropped is not None and self._dropped[0] == epoch else
                    "(check `every_n_steps`, `warmup_steps` and the training data).")
            )
        else:
            metrics[self.key("mean")] = mean
            record.update(mean=mean, kurtosis=kurtosis if math.isfinite(kurtosis) else None)
            if math.isfinite(kurtosis):
                metrics[self.key("kurtosis")] = kurtosis
            metrics[self.key("negative")] = negative
            metrics[self.key("negative_fraction")] = negative / count
            first_scored = not any(h.get("count", 0) >= _MIN_SAMPLES for h in self.history)
            if first_scored and negative >= _MISMATCH_FRACTION * count and self._targets_verified:
                # the targets are the loss's (the gradients point at them): the head starts out against them
                self.alert(
                    step, "opposed_start", "warning",
                    f"{negative / count:.1%} of the {count} GWA scores of the first scored epoch ({epoch}) are "
                    "negative, with the targets the loss's own (its gradient points at them): the head starts out "
                    "predicting against them (a random-init or re-initialised head far from its targets). The scores "
                    "mean little until it fits them.",
                    value=negative / count, threshold=_MISMATCH_FRACTION,
                )
            elif first_scored and negative >= _MISMATCH_FRACTION * count:
                self.alert(
                    step, "target_mismatch", "warning",
                    f"{negative / count:.1%} of the {count} GWA scores of the first scored epoch ({epoch}) are "
                    "negative: nearly every sample's gradient points away from the head's weights, which "
                    "usually means the targets do not match the logits (e.g. a causal LM's labels not shifted "
                    "as its loss shifts them, or the wrong head). Check `target_fn`, `head` and "
                    "`shift_targets`; the score is not meaningful until then.",
                    value=negative / count, threshold=_MISMATCH_FRACTION,
                )
            opposed = negative / count if count else 0.0
            # two groups with one of them opposing the weights: samples the model resists (noisy labels); with (nearly)
            # none opposing, the groups are samples it fits well and samples it fits less well (a clean run that has
            # fit most of its data): said, but no warning
            resisted = opposed >= _BIMODAL_OPPOSED
            why = ("usually noisy labels that the model still resists while it fits the others" if resisted else
                   "no group resists the model: the two groups are samples it fits closely and samples it fits less "
                   "well (a model that has fit most of its data), not noisy labels")
            # two readings that are no sign of noisy labels, said as info: with label smoothing every sample fitted
            # with confidence is pushed back from its label (44-48% of a clean run's samples opposed), and in the
            # warm-up a model still learning resists the samples it has not fit yet (clean counting tasks at epoch 0)
            smoothed, early = self._label_smoothing is not None, not self._in_window(epoch)
            if resisted and smoothed:
                why = (f"the loss smooths its labels ({self._label_smoothing:.3g}), so every sample the model fits "
                       "with confidence is pushed back from its label and opposes the weights too: this need not be "
                       "noisy labels (the suspects are ranked against the labels themselves)")
            elif resisted and early:
                why += "; in the warm-up, also the samples a model still learning has not fit yet"
            elif opposed >= _HALF_OPPOSED:
                # a model still near chance (EfficientNet, WavLM, SEW, Longformer and SqueezeBert at their second epoch,
                # labels not noisy) splits its samples about evenly too
                why += ("; with about half of them opposed, also a model that has not fit its data yet (near chance): "
                        "compare the training loss with the loss of a guess")
            # what the selection makes of the epoch (_bimodal, _rank), said as it is: ranked above every score only
            # with a positive mean and a settled share of opposed samples, and only inside the window
            prev_share = _share(next((h for h in reversed(self.history) if h.get("count", 0) >= _MIN_SAMPLES), None))
            if early:
                place = "In the warm-up, the epoch is not part of the selection."
            elif mean <= 0:
                place = "With a mean of at most 0, the epoch is not ranked in the selection."
            elif self._bimodal(kurtosis, mean, opposed, prev_share) is not None:
                place = ("Such an epoch (a positive mean, a settled share of opposed samples) ranks above every defined "
                         "score in the selection, the most bimodal first.")
            elif prev_share is None:
                place = ("The epoch is not ranked in the selection: no earlier scored epoch shows whether its share of "
                         "opposed samples has settled.")
            else:
                place = (f"The epoch is not ranked in the selection: its share of opposed samples moved by "
                         f"{abs(opposed - prev_share) * 100:.1f} points since the epoch before (more than "
                         f"{_SETTLED * 100:.0f}: samples still being fitted, not a settled split).")
            self.condition(
                step, "bimodal", math.isfinite(kurtosis) and kurtosis + GWA_OFFSET <= 0,
                "warning" if resisted and not smoothed and not early else "info",
                f"GWA undefined at epoch {epoch}: the alignment scores are bimodal (excess kurtosis "
                f"{kurtosis:.3f} <= -{GWA_OFFSET}), so mean/(kurtosis + {GWA_OFFSET}) has no meaning; no "
                f"score logged. {opposed:.1%} of the samples oppose the weights: {why}. {place}",
                value=kurtosis, threshold=-GWA_OFFSET, clear_message=f"GWA scores unimodal again at epoch {epoch}.",
            )
            if math.isfinite(score):
                metrics[self.key("score")] = score
                record["score"] = score
        # bimodal scores with a positive mean: past the pole of mean / (kurtosis + 1.2), ranked above every score
        prev = next((h for h in reversed(self.history) if h.get("count", 0) >= _MIN_SAMPLES), None)
        bimodal = self._bimodal(kurtosis, mean, negative / count if count else None, _share(prev))
        eligible = False if small else self._select(epoch, record.get("score"), bimodal)
        record.update(eligible=eligible, negative=negative)
        ranked = record.get("score") is not None or bimodal is not None
        if ranked and not small and eligible:
            # callback_metrics only, masked like gwa/score: the epoch's place in the selection as one number, for
            # ModelCheckpoint and EarlyStopping (GWA itself is undefined for bimodal scores)
            publish(trainer, {self.key("selection"): self._selection_value(record.get("score"), kurtosis)})
        elif not small and not self.mask_warmup and not self._in_window(epoch):
            # outside the window, published (a checkpoint callback with a validation loop needs the key): 0, below every
            # epoch of the window, as the monitor ranks it. Published with its score's value, a warm-up epoch (whose
            # score is often the run's highest) was kept as the best checkpoint over GWA's own pick (epoch 0 against 3)
            publish(trainer, {self.key("selection"): 0.0})
        self.history.append(record)
        if self.best_epoch is not None:
            metrics[self.key("best_epoch")] = float(self.best_epoch)
            found = self._uncertainty()
            self.pick_uncertain = None if found is None else found[1]
            metrics[self.key("uncertain")] = float(found is not None)
            if found is not None and found[0] not in self._uncertain_said:
                if self._uncertain_said:  # uncertain for a reason not given yet: said again (once per reason)
                    self._conditions.pop(("uncertain_pick", None), None)
                self._uncertain_said.append(found[0])
            # during the run, info: the pick is re-checked every epoch, and an early pick of a few epochs' scores is
            # often uncertain for a while (raised on most short healthy runs, on and off); a warning when the fit
            # ends with it (on_train_end)
            self.condition(
                step, "uncertain_pick", self.pick_uncertain is not None, "info",
                f"GWA's best epoch so far ({self.best_epoch}) is uncertain: {self.pick_uncertain}. Check it against "
                "a validation metric before keeping its checkpoint.",
                value=self.best_score, clear_message=f"GWA's best epoch ({self.best_epoch}) no longer looks uncertain.",
            )
        if metrics:
            # loggers get every defined score; callback_metrics only a selectable one: outside the
            # window (with mask_warmup) the key is left as it was, absent before the first
            # selectable epoch and the last selectable score after it (no placeholder value)
            masked = (self.mask_warmup and not eligible) or small
            self.log_metrics(trainer, metrics, step, loggers_only=(self.key("score"),) if masked else ())
        if count >= _MIN_SAMPLES and self._want_histogram and trainer.global_rank == 0:
            self._write_histogram(trainer, hist, lo, hi, count, state, step)
        if self.suspects > 0 and self.index_fn is not None and trainer.global_rank == 0 and count > 0:
            self._write_suspects(trainer, top, epoch, step)
        if self._run is not None:
            self._write_run_suspects(trainer, epoch, step)
        if self.stop:
            if self.request_stop(
                trainer, step, self.best_epoch is not None and self.wait >= self.patience, "early_stop",
                f"GWA has not improved for {self.wait} epochs: stopping at epoch {epoch}. Predicted best epoch "
                f"{self.best_epoch} ({self._best_text()}); keep its checkpoint "
                '(ModelCheckpoint(monitor="gwa/selection", mode="max")).',
                value=self.best_score,
            ):
                self.stopped_epoch = epoch

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The fit ends with an uncertain pick that something acts on (``stop=True``, a ``ModelCheckpoint`` or
        ``EarlyStopping`` monitoring a ``gwa/`` metric): said as a warning, once (its reason was said as info when
        found). A pick nothing acts on stays said as info: the warning ended most short healthy runs (36 of 47 small
        Hugging Face models trained for 200 steps, where few epochs leave the selection little to go on), about a
        choice nobody made. ``pick_uncertain`` holds the reason either way."""
        if (self.idle_reason is None and self.best_epoch is not None and self.pick_uncertain is not None
                and self._pick_acted_on(trainer)):
            self.condition(
                trainer.global_step, "uncertain_pick", True, "warning",
                f"GWA's best epoch ({self.best_epoch}) at the end of training is uncertain: {self.pick_uncertain}. "
                "Check it against a validation metric before keeping its checkpoint.",
                value=self.best_score,
            )
        super().on_train_end(trainer, pl_module)

    def _pick_acted_on(self, trainer: pl.Trainer) -> bool:
        """Whether the best epoch decides something: GWA's own stop, or a callback monitoring one of its metrics."""
        prefix = self.key("")
        return self.stop or any(isinstance(getattr(cb, "monitor", None), str) and cb.monitor.startswith(prefix)
                                for cb in trainer.callbacks)

    def _best_text(self) -> str:
        """The best epoch's score in words: its GWA, or the kurtosis of its bimodal scores."""
        if self.best_score is not None or self._best_rank is None:
            return f"GWA {math.nan if self.best_score is None else self.best_score:.4g}"
        return f"bimodal scores, excess kurtosis {-self._best_rank[1]:.3f}"

    def _in_window(self, epoch: int) -> bool:
        """Whether ``epoch`` is inside the selection window (after the warm-up, and the first dip with ``finetune``)."""
        return epoch >= self._warmup_resolved and (not self.finetune or self.dip_epoch is not None)

    @staticmethod
    def _bimodal(kurtosis: Optional[float], mean: Optional[float], share: Optional[float] = None,
                 prev_share: Optional[float] = None, settled: bool = True) -> Optional[float]:
        """The excess kurtosis of bimodal scores with a positive mean, whose share of negative scores has settled (moved
        by at most :data:`_SETTLED` since the epoch before), else ``None``. Settled, the split is the fitted samples
        against those the model keeps resisting (flipped labels: ranked above every score, see :meth:`_rank`); still
        moving, it is the samples fitted so far against those not yet fitted, early in a clean run (a ViT's second
        epoch, 16% opposing and falling by 4-11 points an epoch, was picked at 0.77 validation accuracy against 1.0
        later): GWA undefined, not ranked. ``settled=False``: bimodal scores with a positive mean, whatever the share."""
        if kurtosis is None or mean is None or not math.isfinite(kurtosis):
            return None
        if settled and (share is None or prev_share is None or abs(share - prev_share) > _SETTLED):
            return None
        return kurtosis if kurtosis + GWA_OFFSET <= 0 and mean > 0 else None

    @staticmethod
    def _rank(score: Optional[float], bimodal_kurtosis: Optional[float]) -> Optional[tuple[int, float]]:
        """An epoch's place in the selection, compared as a tuple: ``(0, GWA)`` for a defined score; ``(1, -kurtosis)``
        for bimodal scores with a positive mean, whose GWA is undefined; ``None`` for neither. GWA grows without
        bound as the kurtosis falls to -1.2 (a positive mean): bimodal scores lie past that pole, so they rank above
        every defined score, the most bimodal (the clearest split of the samples into two groups) first. With noisy
        labels that split is the fitted samples against the flipped ones the model still resists (measured in
        ``benchmarks/gwa_validity.py``: at 40% noise such epochs precede the memorisation)."""
        if score is not None:
            return 0, score
        return None if bimodal_kurtosis is None else (1, -bimodal_kurtosis)

    @staticmethod
    def _selection_value(score: Optional[float], kurtosis: float) -> float:
        """:meth:`_rank` as one number, increasing with it: ``0.5 + atan(GWA) / pi`` in ``(0, 1)`` for a defined
        score, ``1 + (-1.2 - kurtosis) / 0.8`` in ``[1, 2]`` for bimodal scores (the excess kurtosis is at least -2)."""
        if score is not None:
            return 0.5 + math.atan(score) / math.pi
        return 1.0 + min(1.0, max(0.0, (-GWA_OFFSET - kurtosis) / (2.0 - GWA_OFFSET)))

    def _select(self, epoch: int, score: Optional[float], bimodal_kurtosis: Optional[float] = None) -> bool:
        """Update dip detection, the window, the best epoch and the patience counter. ``bimodal_kurtosis``: the
        excess kurtosis of bimodal scores with a positive mean (GWA undefined, see :meth:`_rank`), else ``None``.
        Returns whether the epoch took part in the selection."""
        if score is not None:
            if self._prev_score is not None:
                if score < self._prev_score:
                    self._fell = True
                elif score > self._prev_score and self._fell and self.dip_epoch is None:
                    self.dip_epoch = self._prev_epoch
            self._prev_score, self._prev_epoch = score, epoch
        if not self._in_window(epoch):
            return False
        rank, best = self._rank(score, bimodal_kurtosis), self._best_rank
        if rank is not None and (best is None or rank[0] > best[0]
                                 or (rank[0] == best[0] and rank[1] > best[1] + (self.min_delta if rank[0] == 0 else 0.0))):
            self.best_score, self.best_epoch, self.wait, self._best_rank = score, epoch, 0, rank
        elif self.best_epoch is not None:
            self.wait += 1
        return rank is not None

    def _uncertainty(self) -> Optional[tuple[str, str]]:
        """Why the current best epoch may be a poor pick, ``(kind, reason)``, or ``None``. Five patterns
        measured on settings the rules were not made on (``benchmarks/gwa_validity.py``, BENCHMARKS.md):
        ``boundary``, a pick at the first epoch of the window while the score was still falling into it (the
        true maximum sat inside the warm-up); ``warmup``, an epoch of the warm-up after the first with a score
        more than twice the pick's, or bimodal scores ranking above it; ``memorised``, a pick after the share of
        negative scores, settled when the window opened (it fell by at most 2 points in the epoch before), fell
        by more than 10 points
        (the model has fit a group of samples it kept fighting before: with noisy labels, memorisation, during
        which the score can keep rising while test accuracy falls); ``spike``, a one-epoch spike (a dip of the
        kurtosis) above 1.25x the scores on both sides; ``contested``, a pick at which at least 40% of the samples'
        gradients oppose the weights (labels near chance, e.g. a binary task with 40% of them wrong: the score is a
        small difference between two nearly equal groups, and its maximum wanders). The first that applies is
        given. Re-checked every epoch."""
        if self.best_epoch is None:
            return None
        scores = {h["epoch"]: h["score"] for h in self.history if h.get("score") is not None}
        best, epoch = self.best_score, self.best_epoch  # best: None for a pick of bimodal scores (no GWA)
        before = [(e, v) for e, v in sorted(scores.items()) if e < epoch]
        if best is not None and epoch == self._warmup_resolved and before and before[-1][1] > best:
            e, v = before[-1]
            return "boundary", (f"it is the first epoch after the warm-up and the score was still falling into it "
                                f"(epoch {e}: {v:.4g} against {best:.4g})")
        found = self._warmup_above()
        if found is not None:
            return "warmup", found
        shares = {h["epoch"]: h["negative"] / h["count"] for h in self.history
                  if h.get("negative") is not None and h.get("count", 0) >= _MIN_SAMPLES}
        start = self._warmup_resolved
        # the share had settled when the window opened (a group of samples kept resisting: with flipped labels, the
        # flipped ones), and has fallen since: those samples are being fit. A share still falling when the window
        # opened is the model learning (clean labels, a language model's tokens), not memorising; a share that rose
        # into the window is no learning either (wine at 20% noise: 16.0% then 19.8%, falling to 2.8% at a pick 9
        # points below validation's, unflagged while the share was read as unsettled either way)
        settled = start - 1 in shares and start in shares and shares[start - 1] - shares[start] <= _SETTLED
        if settled and epoch in shares and shares[start] - shares[epoch] > _MEMORISED_DROP:
            return "memorised", (
                f"the share of samples whose gradient opposes the weights fell from {shares[start]:.1%} when the "
                f"window opened (epoch {start}) to {shares[epoch]:.1%}: the model has since fit samples it fought "
                "before; with noisy labels that is memorisation, and the score can keep rising while test accuracy "
                "falls")
        prev, nxt = scores.get(epoch - 1), scores.get(epoch + 1)
        if best is not None and prev is not None and nxt is not None and prev > 0 and nxt > 0 and best > _SPIKE * max(prev, nxt):
            return "spike", (f"a one-epoch spike ({best:.4g} against {prev:.4g} and {nxt:.4g} on either side), "
                             "usually a passing dip of the scores' kurtosis")
        if epoch in shares and shares[epoch] >= _CONTESTED:
            return "contested", (
                f"{shares[epoch]:.1%} of the samples' gradients oppose the weights at that epoch: the score is a small "
                "difference between two nearly equal groups (labels near chance, or very noisy), and its maximum "
                "wanders from epoch to epoch")
        return None

    def _warmup_above(self) -> Optional[str]:
        """Why an epoch of the warm-up (after the run's first epoch, whose scores belong to the initial weights)
        outranks the pick by a clear margin, or ``None``: a defined score more than ``_WARMUP_FACTOR`` times the
        pick's (above 0 for a pick below 0), or bimodal scores with a positive mean, which rank above a defined
        pick (and above a bimodal one when more bimodal). The selection skips the warm-up, so the best epoch may
        lie there."""
        best = self._best_rank
        if best is None:
            return None
        for h in self.history:
            epoch = h["epoch"]
            if not 1 <= epoch < self._warmup_resolved or h.get("partial"):
                continue
            score = h.get("score")
            # any bimodal epoch of the warm-up, settled or not, makes the pick uncertain
            rank = self._rank(score, None if score is not None else self._bimodal(h.get("kurtosis"), h.get("mean"),
                                                                                   settled=False))
            if rank is None:
                continue
            if rank[0] == 0 and best[0] == 0 and rank[1] > best[1] + (_WARMUP_FACTOR - 1.0) * abs(best[1]):
                return (f"epoch {epoch} of the warm-up, which the selection skips, scored {rank[1]:.4g}, more than "
                        f"{_WARMUP_FACTOR:g}x the pick's {best[1]:.4g}: the best epoch may lie in the warm-up")
            if rank[0] == 1 and rank > best:
                return (f"the scores of epoch {epoch} of the warm-up, which the selection skips, were bimodal (excess "
                        f"kurtosis {-rank[1]:.3f}), which ranks above the pick: the best epoch may lie in the warm-up")
        return None

    def _write_histogram(
        self, trainer: pl.Trainer, hist: Tensor, lo: float, hi: float, count: int, state: Tensor, step: int
    ) -> None:
        n, mean, m2 = float(state[0]), float(state[1]), float(state[2])
        limits = torch.linspace(-1.0, 1.0, _HIST_BINS + 1)[1:].tolist()
        for logger in trainer.loggers:
            writer = _tensorboard_writer(logger)
            if writer is not None:
                writer.add_histogram_raw(
                    self.key("scores"), min=lo, max=hi, num=count, sum=n * mean, sum_squares=m2 + n * mean * mean,
                    bucket_limits=limits, bucket_counts=hist.tolist(), global_step=step,
                )

    def _write_suspects(self, trainer: pl.Trainer, top: Tensor, epoch: int, step: int) -> None:
        order = top[0].argsort()
        top = top[:, order]
        keep = torch.isfinite(top[0])
        top = top[:, keep][:, : self.suspects]
        rows = [
            (epoch, step, i, int(idx), "" if pos < 0 else int(pos), f"{s:.6g}", "" if tgt < 0 else int(tgt), int(pred))
            for i, (s, idx, pos, tgt, pred) in enumerate(top.T.tolist())
        ]
        header = ["epoch", "step", "order", "index", "position", "score", "target", "predicted"]
        if writes_files(trainer):
            write_csv(os.path.join(alerts_dir(trainer), SUSPECTS_FILENAME), header, rows, append=True)

    # ------------------------------------------------------------------ suspects over the run
    def _start_run_suspects(self, trainer: pl.Trainer, device: Optional[torch.device]) -> None:
        """Allocate the run's per-sample sums (or take those of a restored checkpoint: on rank 0 only, the
        other ranks start from zero, so that the sum over the ranks is the saved one)."""
        saved, self._run_saved, self._run = self._run_saved, None, None
        if not (self.run_suspects and self.suspects > 0 and self.index_fn is not None):
            return
        try:
            self._run = SampleMeans(len(trainer.train_dataloader.dataset), device)  # type: ignore[union-attr,arg-type]
        except (AttributeError, TypeError):
            rank_zero_info("GradientWeightAlignmentMonitor: the training set has no length, so the suspects over the "
                           f"run ({RUN_SUSPECTS_FILENAME}) are not kept; each epoch's are.")
            return
        if saved is not None and tuple(torch.as_tensor(saved).shape)[1:] != tuple(self._run.state.shape)[1:]:
            rank_zero_warn("GradientWeightAlignmentMonitor: the checkpoint's suspects over the run were kept for another "
                           "number of samples than this training set has: they start again from this epoch.")
        elif saved is not None and trainer.global_rank == 0:
            self._run.load(torch.as_tensor(saved, dtype=torch.float64))

    def _run_weight(self) -> float:
        """The weight of this epoch's scores in the run's per-sample means: the share of negative scores of the last
        epoch scored before it (1 for the first). An epoch in which the model still resisted many samples says more
        about which labels are wrong than one after it has memorised them: once flipped labels are fit, the share
        falls (breast cancer at 20% flipped: 0.2 to 0.02) and those epochs' scores, alike for every sample, count
        little. Where the share stays level (digits, moons) the weights are nearly equal: the plain mean. The
        same on every rank (the shares are reduced); a resume reads it from the history it restores."""
        if self._run_w is None:
            prev = next((h for h in reversed(self.history) if h.get("count", 0) >= _MIN_SAMPLES
                         and (self._epoch_open is None or h.get("epoch", -1) < self._epoch_open)), None)
            share = _share(prev)
            self._run_w = 1.0 if share is None else max(share, _RUN_WEIGHT_FLOOR)
        return self._run_w

    def _reduced_run(self, trainer: pl.Trainer) -> Tensor:
        """The run's :meth:`SampleMeans.packed` summed over the ranks (a collective: every rank calls it)."""
        assert self._run is not None
        packed = self._run.packed()
        return trainer.strategy.reduce(packed, reduce_op="sum") if trainer.world_size > 1 else packed

    def _write_run_suspects(self, trainer: pl.Trainer, epoch: int, step: int) -> None:
        """Rewrite ``gwa_suspects_run.csv`` with the ``suspects`` samples of the lowest mean score so far."""
        packed = self._reduced_run(trainer)
        if trainer.global_rank != 0:
            return
        mean, index, count = SampleMeans.lowest(packed, self.suspects)
        k = mean.numel()
        values = torch.cat([mean, index.double(), count, packed[-1:]]).cpu().tolist()  # the one host transfer
        if values[-1] and not self._run_warned:
            self._run_warned = True
            rank_zero_warn(f"GradientWeightAlignmentMonitor: {int(values[-1])} scores had an `index_fn` index outside "
                           f"[0, {self._run.state.shape[1]}) (the training set's length); they are left out of "
                           f"{RUN_SUSPECTS_FILENAME}.")
        rows = [(epoch, step, i, int(values[k + i]), f"{values[i]:.6g}", int(values[2 * k + i]))
                for i in range(k) if math.isfinite(values[i])]
        header = ["epoch", "step", "order", "index", "mean_score", "scored"]
        if writes_files(trainer):
            write_csv(os.path.join(alerts_dir(trainer), RUN_SUSPECTS_FILENAME), header, rows)

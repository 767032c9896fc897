"""Gradient-weight alignment (GWA): a validation-free generalisation signal.

Hoelzl, Rueckert, Kaissis, "Gradient-Weight Alignment as a Train-Time Proxy for Generalization in
Classification Tasks", NeurIPS 2025 (arXiv 2510.25480).

For a softmax classifier whose last layer is a linear map ``logits = W z + b`` (``W`` is ``[C, D]``,
the bias is left out), sample ``i`` with features ``z_i``, probabilities ``p_i = softmax(logits_i)``
and one-hot (or soft) target ``y_i`` has the *negative* per-sample gradient of the cross-entropy
with respect to ``W``

    g_i = -(p_i - y_i) z_i^T,

and its alignment with the weights is the cosine

    gamma_i = cos(g_i, W) = -(p_i - y_i)^T W z_i / (||p_i - y_i|| ||z_i|| ||W||_F)   in [-1, 1]

(``||g_i||_F = ||p_i - y_i|| ||z_i||`` because ``g_i`` has rank one, so no per-sample gradient is
ever formed). The score of a set of samples (an epoch) is

    GWA = mean(gamma) / (kurtosis(gamma) + 1.2)

with population (biased) moments and Fisher's (excess) kurtosis; 1.2 is minus the excess kurtosis
of a uniform distribution on [-1, 1]. The denominator is <= 0 only for strongly bimodal scores;
GWA is then undefined and these functions return NaN rather than a number of the wrong sign.

:class:`GWAMoments` accumulates count, mean and central moments 2..4 in float64 without keeping
the scores (Pebay's pairwise update, stable where raw power sums cancel), merges states across
processes, and gives the same number as :func:`gwa_aggregate` on all the scores at once.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

__all__ = [
    "GWA_OFFSET",
    "GWAMoments",
    "SampleMeans",
    "GWAStatistics",
    "alignment_from_parts",
    "gwa_aggregate",
    "gwa_scores",
    "gwa_statistics",
    "head_gradient_fit",
    "head_gradient_agreement",
    "label_smoothing_fit",
    "merge_moments",
    "softmax_gradient_evidence",
    "softmax_proportionality",
]

#: Offset added to the excess kurtosis: minus the excess kurtosis of U[-1, 1] (-6/5).
GWA_OFFSET = 1.2


class GWAStatistics(NamedTuple):
    """Epoch statistics of the alignment scores (0-dim float64 tensors).

    ``score`` is NaN when undefined: fewer than ``min_count`` scores, zero variance, or
    ``kurtosis + offset <= 0`` (bimodal scores). ``kurtosis`` is NaN without variance.
    """

    score: Tensor
    mean: Tensor
    kurtosis: Tensor
    count: Tensor


def _softmax(x: Tensor) -> Tensor:
    """Softmax over the last dim; spelled out for few classes on CPU, where ``torch.softmax`` over
    a short last dimension is several times slower."""
    if x.device.type == "cpu" and x.shape[-1] < 64:
        e = (x - x.amax(-1, keepdim=True)).exp()
        return e / e.sum(-1, keepdim=True)
    return torch.softmax(x, dim=-1)


def gwa_scores(
    features: Tensor,
    logits: Tensor,
    targets: Tensor,
    weight: Tensor,
    *,
    ignore_index: Optional[int] = -100,
    eps: float = 1e-12,
    softcap: Optional[float] = None,
    logit_scale: Optional[float] = None,
    logit_bias: Optional[Tensor] = None,
    label_smoothing: Optional[float] = None,
) -> Tensor:
    """Per-sample gradient-weight alignment ``gamma_i = cos(-grad_W loss_i, W)``, closed form.

    Args:
        features: inputs of the classifier head, ``[..., D]`` (``[B, D]``, or ``[B, T, D]`` when
            every token is a sample).
        logits: outputs of the head, ``[..., C]`` with ``C >= 2``, same leading shape as ``features``.
        targets: integer class indices with the leading shape (``[B]`` or ``[B, T]``), or soft
            targets (probabilities) of the logits' shape.
        weight: the head's weight ``[C, D]`` (bias excluded).
        ignore_index: integer targets equal to it get no score (NaN); ``None`` ignores nothing. Integer
            targets outside ``[0, C)`` get no score either (a loss's own ignore index).
        eps: floor of the norms (zero features or a soft target met exactly score 0).
        softcap: ``c`` when the loss sees ``c tanh(logits / c)`` rather than the logits (logit
            soft-capping); ``logits`` stay the head's outputs.
        logit_scale, logit_bias: the loss sees ``logit_scale * logits + logit_bias`` (``[C]``) rather than
            the logits (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``, BART's and Marian's
            ``final_logits_bias``); before ``softcap`` when both are given. ``logit_scale`` must be > 0.
        label_smoothing: ``eps`` in ``[0, 1)`` when the loss smooths integer targets (``cross_entropy(...,
            label_smoothing=eps)``): they are scored as ``(1 - eps) e_t + eps / C``.

    Returns:
        scores of the leading shape in ``[-1, 1]`` (float32, float64 for float64 inputs); NaN for
        ignored targets.

    Example:
        >>> z, W = torch.randn(4, 3), torch.randn(5, 3)
        >>> gwa_scores(z, z @ W.T, torch.tensor([0, 1, 2, 3]), W).shape
        torch.Size([4])
    """
    if features.shape[:-1] != logits.shape[:-1]:
        raise ValueError(
            f"`features` {tuple(features.shape)} and `logits` {tuple(logits.shape)} must share their "
            "leading (sample) dimensions."
        )
    if weight.ndim != 2 or weight.shape != (logits.shape[-1], features.shape[-1]):
        raise ValueError(
            f"`weight` must be [C, D] = {(logits.shape[-1], features.shape[-1])} for these features "
            f"and logits, got {tuple(weight.shape)}."
        )
    num_classes = logits.shape[-1]
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"`softcap` must be a positive number, got {softcap!r}.")
    if logit_scale is not None and not (isinstance(logit_scale, (int, float)) and math.isfinite(logit_scale)
                                        and logit_scale > 0):
        raise ValueError(f"`logit_scale` must be a positive number, got {logit_scale!r}.")
    if label_smoothing is not None and not (isinstance(label_smoothing, (int, float)) and 0.0 <= label_smoothing < 1.0):
        raise ValueError(f"`label_smoothing` must be a number in [0, 1), got {label_smoothing!r}.")
    if logit_bias is not None and tuple(logit_bias.shape) != (num_classes,):
        raise ValueError(f"`logit_bias` must be a vector of the {num_classes} classes, got {tuple(logit_bias.shape)}.")
    if num_classes < 2:
        raise ValueError(
            "GWA needs a softmax head with at least 2 outputs; a single-logit (sigmoid) head has no "
            "softmax gradient. Use a 2-output head with cross-entropy."
        )
    if targets.is_floating_point():
        if targets.shape != logits.shape:
            raise ValueError(
                f"Soft `targets` must have the logits' shape {tuple(logits.shape)}, got "
                f"{tuple(targets.shape)}."
            )
    elif targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"Integer `targets` must have the logits' leading shape {tuple(logits.shape[:-1])}, got "
            f"{tuple(targets.shape)}."
        )
    dtype = torch.promote_types(logits.dtype, torch.float32)  # fp16/bf16 -> fp32, fp64 stays
    with torch.autocast(device_type=features.device.type, enabled=False):  # W z in fp32 under autocast too
        z = features.detach().to(dtype)
        w = weight.detach().to(dtype)
        return alignment_from_parts(z, z @ w.T, logits, targets, w.norm(), ignore_index=ignore_index, eps=eps,
                                    softcap=softcap, logit_scale=logit_scale, logit_bias=logit_bias,
                                    label_smoothing=label_smoothing)


def _valid_targets(targets: Tensor, c: int, ignore_index: Optional[int]) -> tuple[Tensor, Tensor]:
    """Integer targets as indices (0 where not valid) and which are valid: in ``[0, c)`` and not ``ignore_index``."""
    t = targets.detach().long()
    valid = (t >= 0) & (t < c)
    if ignore_index is not None:
        valid &= t != ignore_index
    return torch.where(valid, t, torch.zeros_like(t)), valid


def _smoothed_residual(p: Tensor, t: Tensor, eps: float) -> Tensor:
    """``p - (1 - eps) e_t - eps / C`` for integer targets ``t`` (leading shape), without a one-hot."""
    r = p - eps / p.shape[-1]
    return r.scatter_add(-1, t.unsqueeze(-1), torch.full_like(r[..., :1], -(1.0 - eps)))


def alignment_from_parts(
    features: Optional[Tensor],
    wz: Tensor,
    logits: Tensor,
    targets: Tensor,
    weight_norm: Tensor,
    *,
    ignore_index: Optional[int] = -100,
    eps: float = 1e-12,
    feature_norm: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    logit_scale: Optional[float] = None,
    logit_bias: Optional[Tensor] = None,
    label_smoothing: Optional[float] = None,
) -> Tensor:
    """:func:`gwa_scores` from ``wz = W z`` (``logits - bias`` for an ``nn.Linear`` head) and
    ``||W||_F`` (a scalar, or one per row when rows come from different steps); no shape checks.
    Lets a caller keep a few cheap tensors per step and score many steps at once.

    The features enter only through their norms: pass ``feature_norm`` (``||z||`` per row, the
    logits' leading shape) instead of ``features`` (then ``None``) to keep ``[..]`` instead of
    ``[.., D]`` per sample.

    ``softcap``: the loss sees ``c tanh(logits / c)`` (logit soft-capping, Gemma 2's ``final_logit_softcapping``),
    so the head's per-sample gradient is ``((p - y) * (1 - tanh^2(logits / c))) z^T``, ``p`` the softmax of the
    capped logits: scored so (``logits`` is then the head's output, before the cap).

    ``logit_scale``, ``logit_bias``: the loss sees ``logit_scale * logits + logit_bias`` (before the cap): the head's
    per-sample gradient is ``logit_scale (p - y) z^T`` with ``p`` that transform's softmax, and a positive scale
    does not change its direction.

    ``label_smoothing``: ``eps`` when the loss trains integer targets smoothed as ``cross_entropy(...,
    label_smoothing=eps)`` does, ``y = (1 - eps) e_t + eps / C``: the per-sample gradient is ``(p - y) z^T``."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    if feature_norm is None:
        if features is None:
            raise ValueError("alignment_from_parts needs `features` or `feature_norm`.")
        z_norm = torch.linalg.vector_norm(features.detach().to(dtype), dim=-1)
    else:
        z_norm = feature_norm.detach().to(dtype)
    wz = wz.detach().to(dtype)
    logits = logits.detach().to(dtype)
    if logit_scale is not None:
        logits = logits * logit_scale
    if logit_bias is not None:
        logits = logits + logit_bias.detach().to(device=logits.device, dtype=dtype)
    slope: Optional[Tensor] = None
    if softcap is not None:
        squashed = torch.tanh(logits / softcap)
        logits, slope = softcap * squashed, 1.0 - squashed * squashed  # d(capped) / d(logits), per class
    valid = None
    if targets.is_floating_point():
        r = _softmax(logits) - targets.detach().to(dtype)
        if slope is not None:
            r = r * slope
        num = -(r * wz).sum(-1)
        r_norm = r.norm(dim=-1)
    elif label_smoothing:
        t, valid = _valid_targets(targets, logits.shape[-1], ignore_index)
        r = _smoothed_residual(_softmax(logits), t, label_smoothing)
        if slope is not None:
            r = r * slope
        num = -(r * wz).sum(-1)
        r_norm = r.norm(dim=-1)
    else:
        # ignored targets, and any outside [0, C) (a loss's own ignore index other than ``ignore_index``), get no score
        t, valid = _valid_targets(targets, logits.shape[-1], ignore_index)
        t = t.unsqueeze(-1)
        # The cosine does not change when p - y is scaled by 1 / (1 - p_y) > 0, which turns it into
        # (u, -1): u = softmax of the logits over the non-target classes. So
        #   gamma = ((Wz)_y - u^T W z) / (sqrt(||u||^2 + 1) ||z|| ||W||_F),
        # exact even when p_y rounds to 1 (no 1 - p_y cancellation, no underflow), no one-hot.
        u = _softmax(logits.scatter(-1, t, float("-inf")))
        wz_y = wz.gather(-1, t).squeeze(-1)
        if slope is None:
            num = wz_y - (u * wz).sum(-1)
            r_norm = ((u * u).sum(-1) + 1.0).sqrt()
        else:  # (u, -1) times the cap's slope per class
            s_y = slope.gather(-1, t).squeeze(-1)
            us = u * slope
            num = s_y * wz_y - (us * wz).sum(-1)
            r_norm = ((us * us).sum(-1) + s_y * s_y).sqrt()
    denom = (r_norm * z_norm).clamp_min(eps) * weight_norm.to(dtype).clamp_min(eps)
    scores = (num / denom).clamp(-1.0, 1.0)
    if valid is not None:
        scores = torch.where(valid, scores, torch.full_like(scores, float("nan")))
    return scores


#: a softmax gradient's rows sum to 0 within this share of their size (or 2 eps of the gradient's dtype, if larger)
ZERO_SUM_TOLERANCE = 1e-3
#: a cross-entropy on class indices: its gradient's positive entries within this share of the softmax's times the row's
#: weight (``softmax_proportionality``; or 8 machine epsilons of the gradient's dtype, if more)
PROPORTIONAL_TOLERANCE = 1e-2
#: the rounding of a softmax gradient row's sum from its probabilities, in units of ``eps s``
PROBABILITY_ROUNDING = 2.0


def softmax_gradient_evidence(grad: Tensor, logits: Tensor, eps: float) -> Tensor:
    r"""How far the gradient ``grad`` of ``logits`` (rows along the last dimension) is a softmax
    cross-entropy's, whose rows sum to 0: ``[A, J, R, T]`` (float64, on the device, no host sync), with

    * ``A = sum |sum_j g_ij|`` and ``J = sum ||g_i||_1`` over the *judged* rows,
    * ``R = sum 2 eps s_i`` over them: the rounding their sums may carry from the probabilities,
    * ``T = sum ||g_i||_1`` over every row.

    The rows are a softmax's when ``J > 0`` and ``A <= max(1e-3, 2 eps) J + R``.

    A softmax cross-entropy's row is ``g_i = s_i (p_i - t_i)`` (``s_i`` the row's weight in the loss, ``t_i`` a
    distribution), whose sum ``s_i (sum_j p_ij - 1)`` is 0 up to the rounding of the probabilities, each
    computed to ``eps`` relative and summing to 1: about ``eps s_i``, whatever the row's size. A confident row
    (``p_i`` one-hot to within ``eps``: a well-fit classifier, or a fit resumed from one) is then mostly or wholly
    rounding (``p_iy`` rounds to 1 and the row sum is its whole norm), and tells nothing. ``s_i`` is read from the
    row's positive entries, ``s_i p_ij`` where ``t_ij = 0``: ``s_i ~ sum_+ g_ij / sum_+ p_ij`` with ``p_i =
    softmax(logits_i)``; a row is judged when its rounding ``2 eps s_i`` is within the tolerance
    ``max(1e-3, 2 eps) ||g_i||_1`` (a float32 row whose probabilities are one-hot to within ``1.2e-4`` is not).
    Rows of other outputs (a hidden layer, a sigmoid head) have sums of the order of their norm, and are judged
    unless their ``softmax`` is one-hot to within that too. No judged row (``J = 0 < T``): the rows cannot tell.

    Example::

        >>> z = torch.tensor([[2.0, 0.0, -1.0], [30.0, 0.0, 0.0]], requires_grad=True)
        >>> torch.nn.functional.cross_entropy(z, torch.tensor([0, 0])).backward()
        >>> a, j, r, t = softmax_gradient_evidence(z.grad, z.detach(), torch.finfo(torch.float32).eps).tolist()
        >>> j < t and a <= 1e-3 * j + r  # the second row (p one-hot to 1e-13) is not judged
        True
    """
    g = grad.detach().float()
    total, l1 = g.sum(-1), g.abs().sum(-1)
    p_pos = torch.softmax(logits.detach().float(), -1).masked_fill_(g <= 0, 0.0).sum(-1)
    # 0 / 0 (a row without a positive entry: no softmax's): nothing allowed; x / 0: s unknown, not judged
    s = torch.nan_to_num((total + l1) / 2 / p_pos, nan=0.0, posinf=math.inf)
    allowance = PROBABILITY_ROUNDING * eps * s
    judged = (l1 > 0) & (allowance <= max(ZERO_SUM_TOLERANCE, 2.0 * eps) * l1)
    zero = torch.zeros((), dtype=torch.float64, device=g.device)
    return torch.stack([
        torch.where(judged, total.abs().double(), zero).sum(),
        torch.where(judged, l1.double(), zero).sum(),
        torch.where(judged, allowance.double(), zero).sum(),
        l1.double().sum(),
    ])


def softmax_proportionality(grad: Tensor, logits: Tensor) -> Tensor:
    r"""How far the positive entries of each gradient row follow the softmax of its logits: ``[D, P]`` (float64, on
    the device, no host sync), ``P`` the rows' positive mass ``sum_{g_ij > 0} g_ij`` and ``D = sum_i sum_{g_ij > 0}
    |g_ij - s_i p_ij|`` with ``s_i = sum_+ g_ij / sum_+ p_ij``.

    A cross-entropy on class indices has ``g_ij = s_i p_ij`` off the target (``D`` is rounding); other rows whose sums
    are 0 do not: the gradient reaching a hidden layer through LayerNorms (every path to the loss of a pre- or post-LN
    transformer's residual branch passes one, and a LayerNorm's input gradient sums to 0 over its features). Soft
    targets (label smoothing, distillation) are not proportional either: this tells class-index heads apart from
    hidden layers, not every head from them.

    Example::

        >>> z = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.1, 0.0]], requires_grad=True)
        >>> torch.nn.functional.cross_entropy(z, torch.tensor([0, 2])).backward()
        >>> d, p = softmax_proportionality(z.grad, z.detach()).tolist()
        >>> d <= 1e-6 * p
        True
    """
    g = grad.detach().float()
    pos = g > 0
    prob = torch.softmax(logits.detach().float(), -1)
    g_pos = torch.where(pos, g, torch.zeros_like(g))
    p_pos = torch.where(pos, prob, torch.zeros_like(prob))
    scale = g_pos.sum(-1, keepdim=True) / p_pos.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    dev = torch.where(pos, (g - scale * prob).abs(), torch.zeros_like(g)).sum(-1)
    return torch.stack([dev.double().sum(), g_pos.double().sum()])


def _batch_moments(scores: Tensor) -> Tensor:
    """``[count, mean, M2, M3, M4]`` (float64; ``M_k`` = sum of k-th central powers) of the finite
    entries of ``scores``, without a host sync."""
    s = scores.detach().reshape(-1).double()
    w = torch.isfinite(s).double()
    s = torch.where(w > 0, s, torch.zeros_like(s))
    n = w.sum()
    mean = (w * s).sum() / n.clamp_min(1.0)
    d = (s - mean) * w
    d2 = d * d
    return torch.stack([n, mean, d2.sum(), (d2 * d).sum(), (d2 * d2).sum()])


def merge_moments(a: Tensor, b: Tensor) -> Tensor:
    """Merge two ``[count, mean, M2, M3, M4]`` states (Pebay 2008, exact for the union)."""
    na, ma, m2a, m3a, m4a = a.unbind(-1)
    nb, mb, m2b, m3b, m4b = b.unbind(-1)
    n = na + nb
    nn = n.clamp_min(1.0)
    delta = mb - ma
    mean = ma + delta * nb / nn
    nab = na * nb
    m2 = m2a + m2b + delta**2 * nab / nn
    m3 = m3a + m3b + delta**3 * nab * (na - nb) / nn**2 + 3.0 * delta * (na * m2b - nb * m2a) / nn
    m4 = (
        m4a
        + m4b
        + delta**4 * nab * (na * na - nab + nb * nb) / nn**3
        + 6.0 * delta**2 * (na * na * m2b + nb * nb * m2a) / nn**2
        + 4.0 * delta * (na * m3b - nb * m3a) / nn
    )
    return torch.stack([n, mean, m2, m3, m4], dim=-1)


def _statistics_from_moments(state: Tensor, offset: float, min_count: int) -> GWAStatistics:
    n, mean, m2, _, m4 = state.unbind(-1)
    nan = torch.full_like(mean, float("nan"))
    var = m2 / n.clamp_min(1.0)
    has_var = (n >= 2) & (var > 0)
    kurtosis = torch.where(has_var, (m4 / n.clamp_min(1.0)) / var.clamp_min(1e-300) ** 2 - 3.0, nan)
    den = kurtosis + offset
    ok = has_var & (n >= min_count) & (den > 0)
    score = torch.where(ok, mean / torch.where(ok, den, torch.ones_like(den)), nan)
    mean = torch.where(n > 0, mean, nan)
    return GWAStatistics(score, mean, kurtosis, n)


def gwa_statistics(scores: Tensor, offset: float = GWA_OFFSET, min_count: int = 4) -> GWAStatistics:
    """GWA score, mean, excess kurtosis and count of the finite entries of ``scores`` (float64)."""
    return _statistics_from_moments(_batch_moments(scores), offset, min_count)


def gwa_aggregate(scores: Tensor, offset: float = GWA_OFFSET, min_count: int = 4) -> Tensor:
    """``mean(gamma) / (excess_kurtosis(gamma) + offset)`` over the finite entries of ``scores``.

    Population moments, Fisher kurtosis (``scipy.stats.kurtosis(x, fisher=True, bias=True)``).
    Returns a 0-dim float64 tensor, NaN when undefined (fewer than ``min_count`` scores, zero
    variance, or a denominator <= 0, which happens for bimodal scores).

    Example:
        >>> round(float(gwa_aggregate(torch.tensor([0.1, 0.2, 0.2, 0.3, 0.9]))), 4)
        0.2793
        >>> gwa_aggregate(torch.tensor([-0.5, -0.5, 0.5, 0.5]))  # bimodal: kurtosis -2
        tensor(nan, dtype=torch.float64)
    """
    return gwa_statistics(scores, offset, min_count).score


class GWAMoments:
    """Streaming count, mean and central moments 2..4 of alignment scores (float64, on device).

    ``update`` costs a few reductions and never syncs with the host; NaN scores are skipped.
    ``state`` is a ``[5]`` tensor ``[count, mean, M2, M3, M4]``; states of several processes
    (stacked ``[k, 5]``, e.g. from ``all_gather``) combine with :meth:`combine`.

    Example:
        >>> acc = GWAMoments()
        >>> for chunk in torch.rand(100).split(7):
        ...     acc.update(chunk)
        >>> int(acc.compute().count)
        100
    """

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.state = torch.zeros(5, dtype=torch.float64, device=device)
        self._empty = True

    @property
    def state(self) -> Tensor:
        """``[count, mean, M2, M3, M4]`` (float64)."""
        return self._state

    @state.setter
    def state(self, value: Tensor) -> None:
        self._state = value
        self._empty = False  # set from outside: always merge into it

    @classmethod
    def from_state(cls, state: Tensor) -> GWAMoments:
        """An accumulator holding ``state`` (``[5]``, e.g. one row of :meth:`combine`)."""
        acc = cls(state.device)
        acc.state = state.reshape(5).double()
        return acc

    def reset(self, device: Optional[torch.device] = None) -> None:
        self.state = torch.zeros(5, dtype=torch.float64, device=device or self.state.device)
        self._empty = True

    def update(self, scores: Tensor) -> None:
        """Add the finite entries of ``scores`` (any shape)."""
        batch = _batch_moments(scores.to(self.state.device))
        # into a fresh accumulator the batch's moments are the state (the merge would only round)
        self.state = batch if self._empty else merge_moments(self.state, batch)

    def merge(self, other: GWAMoments | Tensor) -> None:
        """Add the samples of another accumulator (or its ``state``)."""
        state = other.state if isinstance(other, GWAMoments) else other
        self.state = merge_moments(self.state, state.to(self.state))

    @staticmethod
    def combine(states: Tensor) -> Tensor:
        """One state from ``[k, 5]`` stacked states (e.g. one per process)."""
        states = states.reshape(-1, 5).double()
        out = states[0]
        for row in states[1:]:
            out = merge_moments(out, row)
        return out

    @property
    def count(self) -> Tensor:
        return self.state[0]

    def compute(self, offset: float = GWA_OFFSET, min_count: int = 4) -> GWAStatistics:
        """The statistics of every score added so far (see :func:`gwa_aggregate`)."""
        return _statistics_from_moments(self.state, offset, min_count)


class SampleMeans:
    """Each sample's score summed over a run with a weight per score, on the device: ``[3, n]`` float64 (weighted
    sums, weights, counts) for samples indexed ``0 .. n-1``, and a count of scores whose index lies outside that
    range. A sample's mean is its weighted mean (with weight 1 everywhere, the plain mean).

    :meth:`add` needs no host sync (an out-of-range index is counted apart, not dropped by a mask that would
    need its size); :meth:`packed` lays all out for one all-reduce (a sum over the ranks of their own
    ``SampleMeans`` is the run's); :meth:`lowest` ranks the samples by their mean.

    Example::

        >>> m = SampleMeans(3)
        >>> m.add(torch.tensor([0, 2, 2, 5]), torch.tensor([0.5, -1.0, 0.0, 1.0], dtype=torch.float64))
        >>> mean, index, count = SampleMeans.lowest(m.packed(), 2)
        >>> index.tolist(), mean.tolist(), count.tolist()
        ([2, 0], [-0.5, 0.5], [2.0, 1.0])
        >>> m.add(torch.tensor([2]), torch.tensor([1.0], dtype=torch.float64), weight=2.0)  # (-1 + 0 + 2) / 4
        >>> SampleMeans.lowest(m.packed(), 1)[0].tolist()
        [0.25]
    """

    def __init__(self, n: int, device: Optional[torch.device] = None) -> None:
        self.state = torch.zeros(3, n, dtype=torch.float64, device=device)
        self.outside = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, index: Tensor, scores: Tensor, valid: Optional[Tensor] = None, weight: float = 1.0) -> None:
        """Add ``scores`` (float64) to the samples ``index``, each with ``weight`` (> 0); ``valid`` (bool) leaves
        the others out."""
        idx = index.long()
        inside = (idx >= 0) & (idx < self.state.shape[1])
        valid = torch.ones_like(inside) if valid is None else valid
        ok = valid & inside
        safe = torch.where(ok, idx, torch.zeros_like(idx))
        self.state[0].index_add_(0, safe, torch.where(ok, scores, torch.zeros_like(scores)), alpha=weight)
        self.state[1].index_add_(0, safe, ok.double(), alpha=weight)
        self.state[2].index_add_(0, safe, ok.double())
        self.outside += (valid & ~inside).sum()

    def load(self, saved: Tensor) -> None:
        """Take the sums of :meth:`saved` (``[3, n]``), or of a ``[2, n]`` state (sums and counts: every weight 1)."""
        saved = saved.to(self.state.device, torch.float64)
        self.state.copy_(saved if saved.shape[0] == 3 else torch.stack([saved[0], saved[1], saved[1]]))

    def saved(self, packed: Tensor) -> Tensor:
        """The ``[3, n]`` sums of ``packed`` (:meth:`packed`, reduced over the ranks), for a checkpoint."""
        return packed[:-1].reshape(3, -1)

    def packed(self) -> Tensor:
        """``[3 n + 1]``: weighted sums, weights, counts, and the out-of-range count, for one reduction."""
        return torch.cat([self.state.reshape(-1), self.outside.reshape(1)])

    @staticmethod
    def lowest(packed: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(mean, index, count)`` of the ``k`` samples of the lowest (weighted) mean score in ``packed``; a sample
        never scored has the mean ``inf``."""
        sums, weights, counts = packed[:-1].reshape(3, -1)
        mean = torch.where(weights > 0, sums / weights.clamp_min(1e-300), torch.full_like(sums, math.inf))
        low, index = mean.topk(min(k, mean.numel()), largest=False)
        return low, index, counts[index]


class HeadGradientFit(NamedTuple):
    """What :func:`head_gradient_fit` read from a head's output gradient: the loss sees ``scale * logits + bias``."""

    rows: int  # rows fitted (0: nothing to fit; the rest is then meaningless)
    scale: float  # NaN when the logits do not vary enough to tell
    bias: Optional[Tensor]  # ``[C]`` float64, centred (0 where no entry was fitted); None: the fit needs none
    residual: float  # RMS of the fit's residual, in log units


def _masked_mean(v: Tensor, w: Tensor, dim: int) -> Tensor:
    return (v * w).sum(dim, keepdim=True) / w.sum(dim, keepdim=True).clamp_min(1.0)


def head_gradient_fit(
    grad: Tensor,
    logits: Tensor,
    targets: Optional[Tensor] = None,
    *,
    softcap: Optional[float] = None,
    max_rows: int = 256,
    bias_if_over: float = 1e-3,
) -> HeadGradientFit:
    r"""Which affine transform of a head's outputs its loss took the softmax cross-entropy of, read from the
    gradient of those outputs (one training step's; one host sync).

    A softmax cross-entropy on ``l = a o + b`` (``o`` the head's outputs, ``a > 0``, ``b`` a per-class bias) with a
    hard target ``y`` gives the output gradient row ``g_i = a s_i (p_i - e_y)``, ``p_i = softmax(l_i)``, so on every
    other class ``log g_ij = a o_ij + b_j + c_i`` exactly (``c_i`` the row's constant). The scale ``a`` is the slope of
    that relation within the rows; a per-class bias is fitted only when the rows alone leave a residual over
    ``bias_if_over`` (at least 4 machine epsilons of the gradient's dtype). On up to ``max_rows`` rows with a gradient; each row's target class (``targets``, else the
    row's most negative entry) and the entries that underflowed are left out. ``softcap``: the loss sees ``c tanh(o /
    c)`` rather than ``o`` (Gemma 2): the gradient is read through the cap.

    A small ``residual`` (a few machine epsilons of the gradient's dtype) says the loss is such a cross-entropy; a
    large one, that it is not (label smoothing, a z-loss, distillation's soft targets, a focal loss ...).

    Example::

        >>> o = torch.randn(6, 5, requires_grad=True)
        >>> torch.nn.functional.cross_entropy(0.25 * o, torch.tensor([0, 1, 2, 3, 4, 0])).backward()
        >>> fit = head_gradient_fit(o.grad, o.detach())
        >>> round(fit.scale, 4), fit.bias is None
        (0.25, True)
    """
    c = logits.shape[-1]
    if grad.is_floating_point():  # the logs carry the gradient's rounding
        bias_if_over = max(bias_if_over, 4 * torch.finfo(grad.dtype).eps)
    g = grad.detach().reshape(-1, c).double()
    o = logits.detach().reshape(-1, c).double()
    if softcap is not None:
        squashed = torch.tanh(o / softcap)
        o, g = softcap * squashed, g / (1.0 - squashed * squashed).clamp_min(1e-300)
    ok = torch.isfinite(g).all(-1) & torch.isfinite(o).all(-1) & (g.abs().sum(-1) > 0)
    t = None
    if targets is not None and not targets.is_floating_point():
        t = targets.detach().reshape(-1).long().to(g.device)
        ok &= (t >= 0) & (t < c)
    rows = ok.nonzero().squeeze(1)[:max_rows]  # one host sync
    if rows.numel() == 0:
        return HeadGradientFit(0, math.nan, None, math.nan)
    g, o = g[rows], o[rows]
    col = t[rows] if t is not None else g.argmin(-1)
    # entries below the gradient dtype's normal range (underflowed probabilities) carry no log
    floor = torch.finfo(grad.dtype).tiny if grad.is_floating_point() else 0.0
    w = (g > floor * 16).double().scatter_(1, col.unsqueeze(1), 0.0)
    w = w * (w.sum(1, keepdim=True) >= 2)  # a row needs two entries to show a slope
    y = torch.where(w > 0, g.clamp_min(1e-300).log(), torch.zeros_like(g))
    x = o * w

    def slope(xd: Tensor, yd: Tensor) -> float:
        den = (xd * xd * w).sum()
        return float((xd * yd * w).sum() / den) if float(den) > 0 else math.nan

    # rows alone: demean within rows
    xr, yr = x - _masked_mean(x, w, 1), y - _masked_mean(y, w, 1)
    a = slope(xr, yr)
    n = float(w.sum())
    if not math.isfinite(a) or n == 0:
        return HeadGradientFit(int(rows.numel()), math.nan, None, math.nan)
    res = (yr - a * xr) * w
    residual = math.sqrt(float((res * res).sum()) / n)
    if residual <= bias_if_over:
        return HeadGradientFit(int(rows.numel()), a, None, residual)
    # rows and classes: demean both ways (alternating; the mask is nearly complete, so a few passes settle)
    xd, yd = x.clone(), y.clone()
    for _ in range(12):
        xd = (xd - _masked_mean(xd, w, 1)) * w
        xd = (xd - _masked_mean(xd, w, 0)) * w
        yd = (yd - _masked_mean(yd, w, 1)) * w
        yd = (yd - _masked_mean(yd, w, 0)) * w
    a2 = slope(xd, yd)
    if not math.isfinite(a2):
        return HeadGradientFit(int(rows.numel()), a, None, residual)
    e = (y - a2 * o) * w
    b = torch.zeros(1, c, dtype=torch.float64, device=g.device)
    r = torch.zeros(e.shape[0], 1, dtype=torch.float64, device=g.device)
    for _ in range(12):
        r = _masked_mean(e - b, w, 1)
        b = _masked_mean(e - r, w, 0)
    res2 = (e - b - r) * w
    residual2 = math.sqrt(float((res2 * res2).sum()) / n)
    if not residual2 < residual:
        return HeadGradientFit(int(rows.numel()), a, None, residual)
    seen = w.sum(0) > 0
    b = b.squeeze(0)
    b = torch.where(seen, b - b[seen].mean(), torch.zeros_like(b))
    return HeadGradientFit(int(rows.numel()), a2, b, residual2)


def head_gradient_agreement(
    grad: Tensor,
    logits: Tensor,
    targets: Tensor,
    *,
    ignore_index: Optional[int] = -100,
    softcap: Optional[float] = None,
    logit_scale: Optional[float] = None,
    logit_bias: Optional[Tensor] = None,
    tolerance: Optional[float] = None,
    label_smoothing: Optional[float] = None,
    misfit: bool = False,
) -> Tensor:
    r"""How well the gradient ``grad`` of a head's outputs ``logits`` agrees with the one GWA's closed form assumes
    for ``targets`` (a softmax cross-entropy on ``logit_scale * logits + logit_bias``, capped by ``softcap``), per row:
    ``[judged, off, targeted, hit]`` (float64, on the device, no host sync), with

    * ``judged``: rows with a gradient and a valid target whose gradient is not mostly the rounding of a confident
      probability (``1 - p_y`` at least 32 machine epsilons of the gradient's dtype);
    * ``off``: those whose gradient's direction differs from the closed form's (cosine below ``1 - tolerance``;
      default ``max(1e-3, eps / 2)``);
    * ``targeted``: integer-target rows with a gradient and a valid target; ``hit``: those whose gradient is most
      negative at the target (a softmax cross-entropy's is negative only there): the targets are the loss's.

    Soft targets are judged on their direction only (``targeted = hit = 0``). ``label_smoothing``: integer targets
    smoothed as :func:`gwa_scores`'s. ``misfit``: a fifth entry, the sum of ``1 - cosine`` over the judged rows (how
    far the closed form's direction is from the gradient's, to compare readings of the same rows), and a sixth, the sum
    over them of what the gradient's rounding alone may make it: ``max(eps^2 / 16, (eps / ||r||_inf)^2)``, ``r`` the
    closed form's row (an entry rounded to its dtype moves the row by up to ``eps`` of its size; a confident row's
    ``p_y - 1`` is rounded to a unit of ``eps``, a large share of a small ``1 - p_y``). In bf16 a softmax
    cross-entropy's rows come out at a mean ``1 - cosine`` of 2-6e-7, class weights with label smoothing at 1e-3 to
    1e-2, against an allowance of about 1e-4."""
    c = logits.shape[-1]
    g = grad.detach().reshape(-1, c).double()
    o = logits.detach().reshape(-1, c).double()
    eps = torch.finfo(grad.dtype).eps if grad.is_floating_point() else 0.0
    tol = max(1e-3, eps / 2) if tolerance is None else tolerance
    if logit_scale is not None:
        o = o * logit_scale
    if logit_bias is not None:
        o = o + logit_bias.to(device=o.device, dtype=o.dtype)
    slope = None
    if softcap is not None:
        squashed = torch.tanh(o / softcap)
        o, slope = softcap * squashed, 1.0 - squashed * squashed
    p = torch.softmax(o, -1)
    has = torch.isfinite(g).all(-1) & torch.isfinite(o).all(-1) & (g.abs().sum(-1) > 0)
    zero = torch.zeros((), dtype=torch.float64, device=g.device)
    if targets.is_floating_point():
        r = p - targets.detach().reshape(-1, c).to(p)
        judged = has
        targeted = hit = zero
    else:
        t, valid = _valid_targets(targets.reshape(-1).to(g.device), c, ignore_index)
        ts = t.unsqueeze(1)
        r = (_smoothed_residual(p, ts.squeeze(1), label_smoothing) if label_smoothing
             else p - torch.zeros_like(p).scatter_(1, ts, 1.0))
        targeted_rows = has & valid
        judged = targeted_rows & (1.0 - p.gather(1, ts).squeeze(1) >= 32 * eps)
        targeted = targeted_rows.double().sum()
        hit = (targeted_rows & (g.argmin(-1) == t)).double().sum()
    if slope is not None:
        r = r * slope
    cos = (r * g).sum(-1) / (r.norm(dim=-1) * g.norm(dim=-1)).clamp_min(1e-300)
    off = judged & (cos < 1.0 - tol)
    out = [judged.double().sum(), off.double().sum(), targeted, hit]
    if misfit:
        out.append(torch.where(judged, 1.0 - cos, torch.zeros_like(cos)).sum())
        allowed = torch.clamp_min((eps / r.abs().amax(-1).clamp_min(1e-300)) ** 2, eps * eps / 16.0)
        out.append(torch.where(judged, allowed, torch.zeros_like(allowed)).sum())
    return torch.stack(out)


def label_smoothing_fit(grad: Tensor, logits: Tensor, targets: Tensor, *, softcap: Optional[float] = None,
                        max_rows: int = 256) -> tuple[int, float]:
    r"""The label smoothing ``eps`` a softmax cross-entropy on integer ``targets`` trained with, read from the gradient
    ``grad`` of the head's outputs ``logits`` (one host sync): ``(rows fitted, eps)``, ``eps`` NaN when no row fits.

    With smoothing the gradient row is ``s_i (p_i - (1 - eps) e_t - eps / C)``, ``s_i > 0`` the row's weight, that is
    ``s_i (q_i + eps d_i)`` with ``q_i = p_i - e_t`` and ``d_i = e_t - 1 / C``: linear in ``eps``. Whatever ``s_i``,
    the part of ``q_i + eps d_i`` across ``g_i`` must vanish, so ``eps`` is the least-squares solution of
    ``P_i (q_i + eps d_i) = 0`` over the rows (``P_i`` projects out ``g_i``; closed form). Near a uniform softmax (a
    head at its random init) smoothing moves the gradient as a logit scale of ``1 / (1 - eps)`` would, which
    :func:`head_gradient_fit` would read as such: compare the two readings' ``misfit``
    (:func:`head_gradient_agreement`) on the same rows.

    Example::

        >>> o = torch.randn(8, 5, requires_grad=True)
        >>> t = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
        >>> torch.nn.functional.cross_entropy(o, t, label_smoothing=0.1).backward()
        >>> rows, eps = label_smoothing_fit(o.grad, o.detach(), t)
        >>> rows, round(eps, 4)
        (8, 0.1)
    """
    c = logits.shape[-1]
    g = grad.detach().reshape(-1, c).double()
    o = logits.detach().reshape(-1, c).double()
    t = targets.detach().reshape(-1).long().to(g.device)
    slope = None
    if softcap is not None:
        squashed = torch.tanh(o / softcap)
        o, slope = softcap * squashed, 1.0 - squashed * squashed
    ok = torch.isfinite(g).all(-1) & torch.isfinite(o).all(-1) & (g.abs().sum(-1) > 0) & (t >= 0) & (t < c)
    rows = ok.nonzero().squeeze(1)[:max_rows]  # one host sync
    if rows.numel() == 0:
        return 0, math.nan
    g, o, t = g[rows], o[rows], t[rows].unsqueeze(1)
    onehot = torch.zeros_like(o).scatter_(1, t, 1.0)
    q, d = torch.softmax(o, -1) - onehot, onehot - 1.0 / c
    if slope is not None:
        slope = slope[rows]
        q, d = q * slope, d * slope
    u = g / g.norm(dim=-1, keepdim=True)
    pq = q - (q * u).sum(-1, keepdim=True) * u
    pd = d - (d * u).sum(-1, keepdim=True) * u
    den = float((pd * pd).sum())
    # two classes (every row is +-(1, -1) whatever eps): nothing to read
    eps = -float((pq * pd).sum()) / den if den > 1e-12 * rows.numel() else math.nan
    return int(rows.numel()), eps

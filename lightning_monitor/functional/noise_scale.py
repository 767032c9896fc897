"""Gradient noise scale: unbiased estimators from two batch sizes and their smoothing.

McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training", arXiv 1812.06162,
Appendix A. With ``G`` the true gradient and ``Sigma`` the per-example gradient covariance,
``B_simple = tr(Sigma) / |G|^2``. From the squared norms of gradients averaged over ``b_small`` and
``b_big`` examples (``b_small < b_big``):

    |G|^2     ~ (b_big |G_big|^2 - b_small |G_small|^2) / (b_big - b_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / b_small - 1 / b_big)

where ``|G_small|^2`` is the *mean* squared norm of the small-batch gradients. Both are unbiased but
noisy (either can be negative on one step), so the ratio is taken of separately smoothed numerator and
denominator, never of the per-step values, and only the final ratio is clamped.

Pure functions and a tiny state holder; no Lightning.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch
from torch import Tensor

__all__ = ["noise_scale_estimates", "b_simple", "BiasCorrectedEMA", "NoiseScaleEMA"]

Value = Union[Tensor, float]


def noise_scale_estimates(
    small_sq_norm: Value, big_sq_norm: Value, b_small: Value, b_big: Value
) -> tuple[Value, Value]:
    """Unbiased ``(|G|^2, tr(Sigma))`` from gradient squared norms at two batch sizes.

    Args:
        small_sq_norm: mean over the small batches of ``|G_small|^2`` (with per-example gradients,
            ``b_small = 1``: the mean of the per-example squared norms).
        big_sq_norm: ``|G_big|^2``, the squared norm of the gradient averaged over ``b_big`` examples.
        b_small, b_big: the batch sizes, ``0 < b_small < b_big``; either may be a tensor (sizes reduced across
            ranks, on the device), which is not checked here (that would wait for the device): the caller sees to it.

    >>> g2, tr = noise_scale_estimates(torch.tensor(11.0), torch.tensor(2.0), 1, 10)
    >>> float(g2), float(tr)  # (10 * 2 - 11) / 9, (11 - 2) / 0.9
    (1.0, 10.0)
    """
    if not isinstance(b_small, Tensor) and not isinstance(b_big, Tensor) and not (b_small > 0 and b_big > b_small):
        raise ValueError(
            f"noise_scale_estimates needs 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}: with a "
            "single batch size (e.g. batch size 1, or one rank without accumulation) there is no variance estimate."
        )
    g2 = (b_big * big_sq_norm - b_small * small_sq_norm) / (b_big - b_small)
    trace_sigma = (small_sq_norm - big_sq_norm) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace_sigma


def b_simple(trace_sigma: Value, g2: Value) -> Value:
    """``tr(Sigma) / |G|^2``, ``nan`` where ``|G|^2 <= 0`` (undefined), clamped at 0 from below."""
    if isinstance(trace_sigma, Tensor) or isinstance(g2, Tensor):
        tr = torch.as_tensor(trace_sigma)
        g = torch.as_tensor(g2, device=tr.device)
        out = (tr / g).clamp_min(0.0)
        return torch.where(g > 0, out, torch.full_like(out, float("nan")))
    if g2 <= 0:
        return float("nan")
    return max(trace_sigma / g2, 0.0)


class BiasCorrectedEMA:
    """Exponential moving average with Adam-style bias correction.

    ``m_k = beta m_{k-1} + (1 - beta) x_k``, ``value = m_k / (1 - beta^k)``: the first value is the first
    sample, not ``(1 - beta)`` times it. Works on floats and on tensors (kept on their device).
    """

    def __init__(self, beta: float = 0.9) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"`beta` must be in [0, 1), got {beta!r}.")
        self.beta = beta
        self.mean: Any = 0.0
        self.count = 0

    def update(self, x: Value) -> Value:
        self.mean = self.beta * self.mean + (1.0 - self.beta) * x
        self.count += 1
        return self.value

    @property
    def value(self) -> Optional[Value]:
        if self.count == 0:
            return None
        return self.mean / (1.0 - self.beta**self.count)

    def state_dict(self) -> dict[str, Any]:
        mean = self.mean.tolist() if isinstance(self.mean, Tensor) else self.mean
        return {"beta": self.beta, "mean": mean, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.beta = float(state["beta"])
        self.mean = state["mean"]
        self.count = int(state["count"])


class NoiseScaleEMA:
    """Smoothed ``|G|^2`` and ``tr(Sigma)`` (separately, bias-corrected) and their ratio ``B_simple``.

    >>> ema = NoiseScaleEMA(beta=0.5)
    >>> ema.update(g2=1.0, trace_sigma=30.0), ema.update(g2=3.0, trace_sigma=10.0)
    (True, True)
    >>> round(ema.b_simple, 4)  # (30 + 2 * 10) / (1 + 2 * 3): ratio of the smoothed values
    7.1429

    Steps whose estimates are not finite are ignored (:meth:`update` returns ``False``).

    **A change of scale restarts both averages.** Samples of ``tr(Sigma)`` more than ``restart_factor`` times its
    average, or less than its ``1 / restart_factor``, on ``persist`` consecutive updates (on the same side) come from
    gradients of another scale (the first steps from random init, where some examples' gradients are 1e4-1e8 times
    the later ones; weights changed on purpose): averaged in, the old samples would fix the ratio at their own for as
    long as their weight dominates (at ``beta=0.9``, about 100 checks for a factor of 1e5). The averages start again
    from those samples (:attr:`restarted` says so, until the next update). Fewer in a row are outliers (one batch the
    model already fits, with a ``tr(Sigma)`` 1000 times below the average; a spike): held out of the averages, and
    dropped at the next sample within range. On one such batch near convergence the averages were thrown away, and
    thrown away again at the next ordinary batch: 41 restarts in 300 checks, the smoothed ``tr(Sigma)`` jumping from
    41 to 0.34 and back to 84.

    >>> ema = NoiseScaleEMA(beta=0.9)
    >>> _ = ema.update(g2=5e4, trace_sigma=7e7), ema.update(g2=0.5, trace_sigma=2.0), ema.update(g2=0.5, trace_sigma=2.0)
    >>> ema.restarted, round(ema.b_simple, 1)  # held out: the first scale's ratio still
    (False, 1400.0)
    >>> _ = ema.update(g2=0.5, trace_sigma=2.0)
    >>> ema.restarted, round(ema.b_simple, 4)  # the third in a row: the averages hold the new scale only
    (True, 4.0)
    """

    def __init__(self, beta: float = 0.9, restart_factor: float = 100.0, persist: int = 3) -> None:
        if not restart_factor > 1.0:
            raise ValueError(f"`restart_factor` must be > 1, got {restart_factor!r}.")
        if isinstance(persist, bool) or not isinstance(persist, int) or persist < 1:
            raise ValueError(f"`persist` must be an integer >= 1, got {persist!r}.")
        self.g2 = BiasCorrectedEMA(beta)
        self.trace_sigma = BiasCorrectedEMA(beta)
        self.restart_factor = restart_factor
        self.persist = persist
        #: whether the last update restarted the averages (a change of scale)
        self.restarted = False
        #: samples out of range, in a row on one side, held out of the averages: ``(g2, trace_sigma, side)``
        self.held: list[tuple[float, float, int]] = []

    def update(self, g2: float, trace_sigma: float) -> bool:
        if not (math.isfinite(g2) and math.isfinite(trace_sigma)):
            return False
        mean = self.trace_sigma.value
        side = 0
        if self.count and mean is not None and mean > 0 and trace_sigma > 0:
            ratio = trace_sigma / mean
            side = 1 if ratio > self.restart_factor else -1 if ratio < 1.0 / self.restart_factor else 0
        self.restarted = False
        if side == 0:
            self.held = []
            self.g2.update(g2)
            self.trace_sigma.update(trace_sigma)
            return True
        if self.held and self.held[-1][2] != side:
            self.held = []
        self.held.append((g2, trace_sigma, side))
        if len(self.held) >= self.persist:
            self.restarted = True
            self.g2, self.trace_sigma = BiasCorrectedEMA(self.g2.beta), BiasCorrectedEMA(self.trace_sigma.beta)
            for held_g2, held_tr, _ in self.held:
                self.g2.update(held_g2)
                self.trace_sigma.update(held_tr)
            self.held = []
        return True

    @property
    def count(self) -> int:
        return self.g2.count

    @property
    def b_simple(self) -> float:
        """``nan`` before the first update or while the smoothed ``|G|^2 <= 0``."""
        if self.count == 0:
            return float("nan")
        return float(b_simple(float(self.trace_sigma.value), float(self.g2.value)))

    def state_dict(self) -> dict[str, Any]:
        return {"g2": self.g2.state_dict(), "trace_sigma": self.trace_sigma.state_dict(),
                "held": [list(h) for h in self.held]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.g2.load_state_dict(state["g2"])
        self.trace_sigma.load_state_dict(state["trace_sigma"])
        self.held = [(float(g), float(t), int(side)) for g, t, side in state.get("held", [])]

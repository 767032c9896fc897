"""Gradient noise scale estimators on linear regression, where tr(Sigma) and |G|^2 are known exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from lightning_monitor.functional import BiasCorrectedEMA, NoiseScaleEMA, b_simple, noise_scale_estimates
from lightning_monitor.probes.per_example import PerExampleGradNorms


def regression_truth(err: torch.Tensor, noise_std: float) -> tuple[float, float]:
    """For x ~ N(0, I_d), y = w*.x + eps, loss 0.5 (w.x - y)^2 and e = w - w*:
    g_i = x_i x_i^T e - x_i eps_i, G = e, E|g|^2 = (d + 2)|e|^2 + d s^2, so
    |G|^2 = |e|^2 and tr(Sigma) = (d + 1)|e|^2 + d s^2."""
    d = err.numel()
    e2 = float(err.pow(2).sum())
    return e2, (d + 1) * e2 + d * noise_std**2


def make_problem(d: int = 8, noise_std: float = 0.5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w_star = torch.randn(d, generator=gen)
    model = nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(w_star + 0.3 * torch.randn(d, generator=gen))
    err = model.weight.detach().reshape(-1) - w_star
    return model, w_star, err, gen


def sample(w_star: torch.Tensor, b: int, noise_std: float, gen: torch.Generator):
    x = torch.randn(b, w_star.numel(), generator=gen)
    y = x @ w_star + noise_std * torch.randn(b, generator=gen)
    return x, y


def test_estimates_formula_and_docstring_example() -> None:
    g2, tr = noise_scale_estimates(torch.tensor(11.0), torch.tensor(2.0), 1, 10)
    assert float(g2) == pytest.approx(1.0) and float(tr) == pytest.approx(10.0)
    g2, tr = noise_scale_estimates(5.0, 2.0, 4, 16)
    assert g2 == pytest.approx((16 * 2 - 4 * 5) / 12) and tr == pytest.approx(3.0 / (1 / 4 - 1 / 16))


@pytest.mark.parametrize("b_small,b_big", [(1, 1), (4, 2), (0, 3)])
def test_estimates_reject_equal_or_inverted_batches(b_small: int, b_big: int) -> None:
    with pytest.raises(ValueError, match="b_small < b_big"):
        noise_scale_estimates(1.0, 1.0, b_small, b_big)


def test_b_simple_clamps_and_undefined() -> None:
    assert b_simple(-3.0, 1.0) == 0.0
    assert math.isnan(b_simple(3.0, -1.0))
    t = b_simple(torch.tensor([3.0, -3.0, 3.0]), torch.tensor([1.5, 1.0, 0.0]))
    assert t[0] == 2.0 and t[1] == 0.0 and torch.isnan(t[2])


def test_bias_corrected_ema_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    xs = rng.normal(size=30)
    ema = BiasCorrectedEMA(0.8)
    m = 0.0
    for k, x in enumerate(xs, 1):
        ema.update(float(x))
        m = 0.8 * m + 0.2 * x
        assert ema.value == pytest.approx(m / (1 - 0.8**k))
    ema2 = BiasCorrectedEMA()
    ema2.load_state_dict(ema.state_dict())
    assert ema2.value == pytest.approx(ema.value) and ema2.count == 30
    first = BiasCorrectedEMA(0.99)
    assert first.update(torch.tensor(5.0)) == pytest.approx(5.0)  # no start-up bias toward 0
    with pytest.raises(ValueError, match="beta"):
        BiasCorrectedEMA(1.0)


def test_noise_scale_ema_smooths_numerator_and_denominator_separately() -> None:
    ema = NoiseScaleEMA(beta=0.5)
    assert math.isnan(ema.b_simple)
    ema.update(1.0, 30.0)
    ema.update(3.0, 10.0)
    assert ema.b_simple == pytest.approx((30 + 2 * 10) / (1 + 2 * 3))
    # a mean of per-step ratios would give something else
    assert ema.b_simple != pytest.approx((30 / 1 + 2 * 10 / 3) / 3)
    assert not ema.update(float("nan"), 1.0) and ema.count == 2


def test_unbiased_over_many_draws() -> None:
    """The mean of the per-step estimates converges to the closed-form truth (two batch sizes)."""
    d, s, b_small, k = 8, 0.5, 4, 8
    model, w_star, err, gen = make_problem(d, s)
    true_g2, true_tr = regression_truth(err, s)
    w = model.weight.detach().reshape(-1)
    g2s, trs = [], []
    for _ in range(400):
        x, y = sample(w_star, b_small * k, s, gen)
        per = x * (x @ w - y).unsqueeze(1)  # per-example gradients, (B, d)
        small = per.reshape(k, b_small, d).mean(1).pow(2).sum(1).mean()
        big = per.mean(0).pow(2).sum()
        g2, tr = noise_scale_estimates(small, big, b_small, b_small * k)
        g2s.append(float(g2))
        trs.append(float(tr))
    assert np.mean(g2s) == pytest.approx(true_g2, rel=0.05)
    assert np.mean(trs) == pytest.approx(true_tr, rel=0.05)


def test_smoothed_b_simple_within_5_percent_with_per_example_norms() -> None:
    """Closed-form check through the real pipeline: per-example norms from the probe (B_small = 1),
    the batch gradient from autograd (B_big = B), smoothed with the bias-corrected EMA."""
    d, s, batch = 8, 0.5, 64
    model, w_star, err, gen = make_problem(d, s, seed=1)
    true_g2, true_tr = regression_truth(err, s)
    truth = true_tr / true_g2
    ema = NoiseScaleEMA(beta=0.995)
    probe = PerExampleGradNorms(model, loss_reduction="mean")
    for _ in range(600):  # the weights stay fixed: the truth does not move
        x, y = sample(w_star, batch, s, gen)
        model.zero_grad()
        probe.reset()
        with probe:
            loss = 0.5 * (model(x).squeeze(1) - y).pow(2).mean()
            loss.backward()
        small = probe.squared_norms().mean()
        big = model.weight.grad.pow(2).sum()
        g2, tr = noise_scale_estimates(small, big, 1, batch)
        ema.update(float(g2), float(tr))
    assert ema.b_simple == pytest.approx(truth, rel=0.05)

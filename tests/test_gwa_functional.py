"""Oracle tests of the GWA math: per-sample autograd gradients (torch.func) and scipy moments."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from lightning_monitor.functional import (
    GWA_OFFSET,
    GWAMoments,
    alignment_from_parts,
    gwa_aggregate,
    gwa_scores,
    gwa_statistics,
)


def _autograd_alignment(z: torch.Tensor, y: torch.Tensor, head: torch.nn.Linear, ignore: int = -100,
                        softcap: float | None = None):
    """cos(-dL_i/dW, W) from torch.func per-sample gradients of the real cross-entropy (of the soft-capped logits
    ``c tanh(out / c)`` with ``softcap``)."""
    params = {k: v.detach() for k, v in head.named_parameters()}

    def loss(p, zi, yi):
        out = functional_call(head, p, (zi.unsqueeze(0),))
        if softcap is not None:
            out = softcap * torch.tanh(out / softcap)
        if yi.is_floating_point():
            return -(yi.unsqueeze(0) * F.log_softmax(out, -1)).sum()
        return F.cross_entropy(out, yi.unsqueeze(0), ignore_index=ignore)

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, z, y)["weight"]  # [N, C, D]
    g = -grads.double().flatten(1)
    w = head.weight.detach().double().flatten()
    return (g @ w) / (g.norm(dim=1) * w.norm())


@pytest.mark.parametrize("bias", [True, False])
def test_scores_match_per_sample_autograd(bias: bool) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 7, bias=bias)
    z = torch.randn(40, 16)
    y = torch.randint(0, 7, (40,))
    ours = gwa_scores(z, head(z), y, head.weight)
    oracle = _autograd_alignment(z, y, head)
    torch.testing.assert_close(ours.double(), oracle, atol=1e-5, rtol=0)
    assert ours.abs().max() <= 1.0
    # the sign convention matters: +grad would flip every score
    assert not torch.allclose(ours.double(), -oracle, atol=1e-3)


def test_scores_soft_targets_match_autograd() -> None:
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 5)
    z = torch.randn(30, 8)
    y = torch.softmax(3 * torch.randn(30, 5), -1)
    ours = gwa_scores(z, head(z), y, head.weight)
    torch.testing.assert_close(ours.double(), _autograd_alignment(z, y, head), atol=1e-5, rtol=0)
    # a one-hot soft target gives the same score as the integer target
    hard = torch.randint(0, 5, (30,))
    torch.testing.assert_close(
        gwa_scores(z, head(z), F.one_hot(hard, 5).float(), head.weight),
        gwa_scores(z, head(z), hard, head.weight),
        atol=1e-6,
        rtol=0,
    )


@pytest.mark.parametrize("soft", [False, True], ids=["class indices", "soft targets"])
def test_soft_capped_logits_match_per_sample_autograd(soft: bool) -> None:
    # Gemma 2's loss sees 30 tanh(logits / 30): where the logits reach the cap's range the head's gradient is damped
    # per class, and scores from the softmax of the raw logits were 8% (cap 30) to 2x (cap 2) off the true alignment
    torch.manual_seed(2)
    head = torch.nn.Linear(12, 9).double()  # in float64: near the cap, 1 - tanh^2 loses float32's digits
    with torch.no_grad():
        head.weight.mul_(25.0)  # logits up to about 40: well into the cap
    z = torch.randn(50, 12, dtype=torch.float64)
    y = torch.softmax(2 * torch.randn(50, 9, dtype=torch.float64), -1) if soft else torch.randint(0, 9, (50,))
    out = head(z)
    assert out.abs().max() > 30
    for cap in (30.0, 2.0):
        ours = gwa_scores(z, out, y, head.weight, softcap=cap)
        oracle = _autograd_alignment(z, y, head, softcap=cap)
        torch.testing.assert_close(ours, oracle, atol=1e-10, rtol=0)
        uncapped = gwa_scores(z, out, y, head.weight)
        assert (uncapped.double() - oracle).abs().max() > 1e-2  # the cap matters on these logits
    with pytest.raises(ValueError, match="softcap"):
        gwa_scores(z, out, y, head.weight, softcap=0.0)


def test_sequence_tokens_are_samples_and_ignored_targets_are_nan() -> None:
    torch.manual_seed(2)
    head = torch.nn.Linear(12, 9, bias=False)
    z = torch.randn(3, 5, 12)
    y = torch.randint(0, 9, (3, 5))
    y[0, :2] = -100
    y[2, 4] = -100
    ours = gwa_scores(z, head(z), y, head.weight)
    assert ours.shape == (3, 5)
    valid = y != -100
    assert torch.isnan(ours[~valid]).all() and torch.isfinite(ours[valid]).all()
    oracle = _autograd_alignment(z[valid], y[valid], head)
    torch.testing.assert_close(ours[valid].double(), oracle, atol=1e-5, rtol=0)


def test_confident_samples_keep_full_precision() -> None:
    # p_y within 1e-7 of 1: 1 - p_y cancels in float32; the oracle runs in float64
    torch.manual_seed(4)
    head = torch.nn.Linear(10, 6).double()
    z = torch.randn(50, 10, dtype=torch.float64)
    with torch.no_grad():
        head.weight.mul_(60.0)
    y = head(z).argmax(-1)
    logits = head(z)
    gap = (logits.max(-1).values - logits.topk(2, -1).values[:, 1]).detach()
    ok = gap < 25  # the float64 oracle itself loses 1 - p_y beyond that
    assert (gap[ok] > 16).sum() >= 5 and ok.sum() >= 25
    oracle = _autograd_alignment(z[ok], y[ok], head)
    ours = gwa_scores(z.float(), logits.float(), y, head.weight.float())
    torch.testing.assert_close(ours[ok].double(), oracle, atol=2e-5, rtol=0)
    # beyond the oracle's reach float32 still agrees with float64
    ours64 = gwa_scores(z, logits, y, head.weight).double()
    torch.testing.assert_close(ours.double(), ours64, atol=2e-5, rtol=0)


def test_saturated_and_degenerate_samples_are_finite() -> None:
    w = torch.eye(3, 4) * 200.0
    z = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    s = gwa_scores(z, z @ w.T, torch.tensor([0, 1]), w)
    # p_y == 1 in any float: the limit direction of p - y is still defined: (-1, 1/2, 1/2)
    expected = 1.0 / (1.5**0.5 * 3**0.5)
    torch.testing.assert_close(s, torch.tensor([expected, 0.0]))  # zero features score 0


def test_single_class_batch_is_finite() -> None:
    torch.manual_seed(3)
    head = torch.nn.Linear(6, 4)
    z = torch.randn(10, 6)
    y = torch.full((10,), 2)
    s = gwa_scores(z, head(z), y, head.weight)
    torch.testing.assert_close(s.double(), _autograd_alignment(z, y, head), atol=1e-5, rtol=0)


def test_scores_bad_input() -> None:
    z, w = torch.randn(4, 3), torch.randn(5, 3)
    with pytest.raises(ValueError, match="leading"):
        gwa_scores(z, torch.randn(3, 5), torch.zeros(4, dtype=torch.long), w)
    with pytest.raises(ValueError, match="weight"):
        gwa_scores(z, z @ w.T, torch.zeros(4, dtype=torch.long), w.T)
    with pytest.raises(ValueError, match="Integer `targets`"):
        gwa_scores(z, z @ w.T, torch.zeros(5, dtype=torch.long), w)
    with pytest.raises(ValueError, match="Soft `targets`"):
        gwa_scores(z, z @ w.T, torch.rand(4, 4), w)
    w1 = torch.randn(1, 3)
    with pytest.raises(ValueError, match="at least 2 outputs"):
        gwa_scores(z, z @ w1.T, torch.zeros(4, dtype=torch.long), w1)


def _scipy_gwa(x: np.ndarray) -> tuple[float, float, float]:
    x = np.asarray(x, dtype=np.float64)
    k = scipy.stats.kurtosis(x, fisher=True, bias=True)
    return float(np.mean(x) / (k + GWA_OFFSET)), float(np.mean(x)), float(k)


DRAWS = [
    lambda g: g.normal(0.1, 0.2, 500),
    lambda g: np.tanh(g.standard_t(3, 2000)) * 0.5,  # mass piled at +-0.5: denominator < 0
    lambda g: g.beta(2, 8, 777) * 2 - 1,
    lambda g: g.laplace(0.2, 0.1, 300).clip(-1, 1),
]


@pytest.mark.parametrize("draw", DRAWS)
def test_aggregate_matches_scipy(draw) -> None:
    x32 = torch.from_numpy(draw(np.random.default_rng(0))).float()
    x = x32.double().numpy()  # the float32-rounded values both sides see
    score, mean, kurt = _scipy_gwa(x)
    stats = gwa_statistics(x32)
    assert float(stats.mean) == pytest.approx(mean, rel=1e-9, abs=1e-12)
    assert float(stats.kurtosis) == pytest.approx(kurt, rel=1e-9, abs=1e-12)
    assert int(stats.count) == len(x)
    if kurt + GWA_OFFSET > 0:
        assert float(stats.score) == pytest.approx(score, rel=1e-9, abs=1e-12)
        assert float(gwa_aggregate(torch.from_numpy(x))) == pytest.approx(score, rel=1e-9)
    else:  # scipy's ratio has the wrong sign here: ours refuses it
        assert torch.isnan(stats.score)


def test_parametrised_draws_cover_both_signs_of_the_denominator() -> None:
    dens = [scipy.stats.kurtosis(d(np.random.default_rng(0)), bias=True) + GWA_OFFSET for d in DRAWS]
    assert min(dens) < 0 < max(dens), dens


def test_streaming_and_rank_merge_equal_one_shot() -> None:
    g = np.random.default_rng(1)
    x = torch.from_numpy(np.concatenate([g.normal(0.05, 0.1, 900), g.normal(-0.4, 0.05, 100)]))
    expected = _scipy_gwa(x.numpy())[0]
    acc = GWAMoments()
    for chunk in x.split(37):
        acc.update(chunk)
    assert float(acc.compute().score) == pytest.approx(expected, rel=1e-10)
    # four "ranks" with unequal shares, one of them empty, merged from stacked states
    shards = [x[:10], x[10:10], x[10:600], x[600:]]
    states = []
    for shard in shards:
        a = GWAMoments()
        a.update(shard)
        states.append(a.state)
    merged = GWAMoments.combine(torch.stack(states))
    out = GWAMoments()
    out.merge(merged)
    assert float(out.compute().score) == pytest.approx(expected, rel=1e-10)
    assert int(out.count) == len(x)


def test_streaming_is_stable_where_power_sums_cancel() -> None:
    # scores tightly packed far from zero: raw power sums lose the kurtosis, central updates keep it
    x = np.random.default_rng(2).normal(0.9, 1e-4, 20000)
    expected = _scipy_gwa(x)
    acc = GWAMoments()
    for chunk in torch.from_numpy(x).split(100):
        acc.update(chunk)
    stats = acc.compute()
    assert float(stats.kurtosis) == pytest.approx(expected[2], abs=1e-6)
    assert float(stats.score) == pytest.approx(expected[0], rel=1e-6)


def test_undefined_cases_are_nan_never_garbage() -> None:
    # bimodal: excess kurtosis -2, denominator -0.8 < 0
    bimodal = torch.tensor([-0.5, 0.5] * 50)
    assert scipy.stats.kurtosis(bimodal.numpy(), fisher=True, bias=True) + GWA_OFFSET < 0
    stats = gwa_statistics(bimodal)
    assert torch.isnan(stats.score) and torch.isfinite(stats.kurtosis)
    assert torch.isnan(gwa_aggregate(torch.tensor([0.1, 0.2, 0.9])))  # fewer than 4
    assert torch.isnan(gwa_aggregate(torch.full((10,), 0.3)))  # no variance
    assert torch.isnan(gwa_aggregate(torch.tensor([])))
    # NaN (ignored) scores are skipped, not propagated
    x = torch.tensor([0.1, float("nan"), 0.2, 0.2, 0.3, float("nan"), 0.9])
    assert float(gwa_aggregate(x)) == pytest.approx(_scipy_gwa(np.array([0.1, 0.2, 0.2, 0.3, 0.9]))[0], rel=1e-6)
    acc = GWAMoments()
    acc.update(x)
    assert int(acc.count) == 5


def test_docstring_examples() -> None:
    import doctest

    import lightning_monitor.functional.gwa as module

    result = doctest.testmod(module)
    assert result.attempted >= 3 and result.failed == 0


def test_scores_under_autocast_stay_float32() -> None:
    torch.manual_seed(7)
    head = torch.nn.Linear(16, 5)
    z = torch.randn(20, 16)
    y = torch.randint(0, 5, (20,))
    with torch.no_grad():
        logits = head(z)
    expected = gwa_scores(z, logits, y, head.weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = gwa_scores(z, logits, y, head.weight)
    assert inside.dtype == torch.float32
    torch.testing.assert_close(inside, expected)


def test_alignment_from_parts_with_feature_norms_matches_features() -> None:
    """The monitor keeps ||z|| per row instead of z: both inputs give the same scores as gwa_scores."""
    torch.manual_seed(11)
    z, w, b = torch.randn(37, 16), torch.randn(5, 16), torch.randn(5)
    logits = z @ w.T + b
    targets = torch.randint(0, 5, (37,))
    targets[3] = -100
    ref = gwa_scores(z, logits, targets, w)
    wz, w_norm = logits - b, torch.linalg.vector_norm(w)
    from_z = alignment_from_parts(z, wz, logits, targets, w_norm)
    from_norms = alignment_from_parts(None, wz, logits, targets, w_norm, feature_norm=z.norm(dim=-1))
    torch.testing.assert_close(from_z, ref, equal_nan=True)
    torch.testing.assert_close(from_norms, ref, equal_nan=True)
    assert torch.isnan(from_norms[3]) and torch.isfinite(from_norms[torch.arange(37) != 3]).all()
    with pytest.raises(ValueError, match="feature_norm"):
        alignment_from_parts(None, wz, logits, targets, w_norm)

"""The spectral-alignment math against independent oracles (full SVD, direct numpy formulas)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_monitor.functional import sign_diversity, spectral_alignment, top_singular_pair


def gapped_matrix(n_out: int, n_in: int, ratio: float, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Random orthogonal factors, singular values 1, ratio, ratio^1.1 ... (top gap s2/s1 = ratio)."""
    g = torch.Generator().manual_seed(seed)
    k = min(n_out, n_in)
    u, _ = torch.linalg.qr(torch.randn(n_out, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n_in, k, generator=g, dtype=torch.float64))
    s = torch.cat([torch.ones(1, dtype=torch.float64), ratio * torch.linspace(1.0, 0.1, k - 1, dtype=torch.float64)])
    return ((u * s) @ v.T).to(dtype)


def svd_top(w: torch.Tensor):
    u, s, vh = torch.linalg.svd(w.double().reshape(w.shape[0], -1))
    return s, u[:, 0], vh[0]


@pytest.mark.parametrize("shape", [(64, 64), (32, 200), (300, 48)])
@pytest.mark.parametrize("seed", [0, 1])
def test_cold_start_matches_svd(shape, seed):
    w = gapped_matrix(*shape, ratio=0.9, seed=seed) * 3.7
    sigma, u, v = top_singular_pair(w)
    s, u_ref, v_ref = svd_top(w)
    assert sigma.dtype == torch.float32 and u.shape == (shape[0],) and v.shape == (shape[1],)
    assert abs(float(sigma) - float(s[0])) / float(s[0]) < 1e-4
    assert abs(float(v.double() @ v_ref)) > 0.999
    assert abs(float(u.double() @ u_ref)) > 0.999
    # W v = sigma u
    torch.testing.assert_close(w @ v, sigma * u, atol=1e-4, rtol=1e-4)


def test_random_gaussian_layer_weight_matches_svd():
    """A plain Gaussian init plus a learnt-like rank-one spike (a realistic trained weight)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 128, generator=g) * 0.02
    w += 0.5 * torch.outer(torch.randn(256, generator=g), torch.randn(128, generator=g)) / 128
    sigma, u, v = top_singular_pair(w)
    s, u_ref, v_ref = svd_top(w)
    assert abs(float(v.double() @ v_ref)) > 0.999
    assert float(sigma) == pytest.approx(float(s[0]), rel=1e-4)


def test_warm_start_tracks_a_drifting_weight_in_few_iterations():
    w = gapped_matrix(128, 96, ratio=0.8, seed=4)
    _, _, v = top_singular_pair(w)
    g = torch.Generator().manual_seed(5)
    for _ in range(10):  # small training-like updates
        w = w + 0.01 * torch.randn(w.shape, generator=g) / w.shape[1] ** 0.5
        sigma, u, v = top_singular_pair(w, v0=v, n_iter=4)
        s, _, v_ref = svd_top(w)
        assert abs(float(v.double() @ v_ref)) > 0.999
        assert float(sigma) == pytest.approx(float(s[0]), rel=1e-4)


def test_warm_start_is_faster_to_converge_than_cold():
    w = gapped_matrix(200, 200, ratio=0.97, seed=6)
    s, _, v_ref = svd_top(w)
    _, _, v_cold = top_singular_pair(w, n_iter=3)
    _, _, v_warm = top_singular_pair(w, v0=v_ref.float() + 0.01 * torch.randn(200, generator=torch.Generator().manual_seed(0)), n_iter=3)
    assert abs(float(v_warm.double() @ v_ref)) > abs(float(v_cold.double() @ v_ref))
    assert abs(float(v_warm.double() @ v_ref)) > 0.999


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weight_is_computed_in_fp32(dtype):
    w = gapped_matrix(96, 64, ratio=0.7, seed=7).to(dtype)
    sigma, u, v = top_singular_pair(w)
    assert sigma.dtype == u.dtype == v.dtype == torch.float32
    s, _, v_ref = svd_top(w.float())  # oracle on the same (rounded) matrix
    assert abs(float(v.double() @ v_ref)) > 0.999
    assert float(sigma) == pytest.approx(float(s[0]), rel=1e-4)


def test_repeated_top_singular_value():
    """sigma_1 = sigma_2: any unit vector of the top singular subspace is an answer."""
    g = torch.Generator().manual_seed(8)
    u, _ = torch.linalg.qr(torch.randn(50, 50, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))
    s = torch.tensor([2.0, 2.0] + list(np.linspace(1.0, 0.1, 38)), dtype=torch.float64)
    w = ((u[:, :40] * s) @ v.T).float()
    sigma, uu, vv = top_singular_pair(w)
    assert float(sigma) == pytest.approx(2.0, rel=1e-5)
    top = v[:, :2].float()  # columns span the top right singular subspace
    assert float(torch.linalg.vector_norm(top.T @ vv)) > 0.999
    assert torch.isfinite(uu).all() and torch.isfinite(vv).all()


def test_zero_and_conv_weights():
    sigma, u, v = top_singular_pair(torch.zeros(8, 5))
    assert float(sigma) == 0.0 and torch.all(u == 0) and torch.isfinite(v).all()
    assert float(v.norm()) == pytest.approx(1.0)
    k = torch.randn(16, 3, 3, 3, generator=torch.Generator().manual_seed(9))  # conv kernel -> (16, 27)
    sigma, _, v = top_singular_pair(k)
    s, _, v_ref = svd_top(k)
    assert v.shape == (27,) and float(sigma) == pytest.approx(float(s[0]), rel=1e-3)


def test_warm_start_with_zero_vector_falls_back():
    w = gapped_matrix(30, 20, ratio=0.5, seed=10)
    sigma, _, v = top_singular_pair(w, v0=torch.zeros(20), n_iter=50)
    s, _, v_ref = svd_top(w)
    assert abs(float(v.double() @ v_ref)) > 0.999


def test_bad_arguments():
    with pytest.raises(ValueError, match="v0"):
        top_singular_pair(torch.randn(4, 3), v0=torch.randn(4))
    with pytest.raises(ValueError, match="n_iter"):
        top_singular_pair(torch.randn(4, 3), n_iter=0)
    with pytest.raises(ValueError, match="weight"):
        top_singular_pair(torch.randn(4))
    with pytest.raises(ValueError, match="inputs"):
        spectral_alignment(torch.randn(5, 3), torch.randn(4))


# ----------------------------------------------------------------------------- alignment
@pytest.mark.parametrize("shape", [(7, 12), (3, 5, 12), (2, 3, 4, 12)])
def test_alignment_matches_numpy_cosine(shape):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=g)
    v = torch.randn(12, generator=g) * 3.0  # not normalised on purpose
    a = spectral_alignment(x, v)
    assert a.shape == shape[:-1] and a.dtype == torch.float32
    xn, vn = x.numpy().astype(np.float64), v.numpy().astype(np.float64)
    ref = (xn @ vn) / (np.linalg.norm(xn, axis=-1) * np.linalg.norm(vn))
    np.testing.assert_allclose(a.numpy(), ref, atol=1e-6)


def test_batched_alignments_equal_one_layer_at_a_time():
    """``spectral_alignments`` (the monitor's batched path) against the per-layer function, itself checked
    against numpy above: random rows, a zero row, a non-finite row, a zero vector, an unnormalised vector."""
    from lightning_monitor.functional import spectral_alignments

    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 9, 6, generator=g)
    x[1, 3] = 0.0
    x[2, 4, 1] = float("inf")
    x[2, 5, 0] = float("nan")
    vs = torch.randn(4, 6, generator=g) * 2.5
    vs[3] = 0.0
    got = spectral_alignments(x, vs)
    want = torch.stack([spectral_alignment(x[i], vs[i]) for i in range(4)])
    assert got.shape == (4, 9) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, equal_nan=True, atol=1e-6, rtol=0)
    assert got[1, 3] == 0 and got[3].eq(0).all() and got[2, 4].isnan() and got[2, 5].isnan()
    assert torch.equal(sign_diversity(got, dim=-1), torch.stack([sign_diversity(w) for w in want]))
    for bad in ((torch.randn(9, 6), vs), (x, torch.randn(3, 6)), (x, torch.randn(4, 5))):
        with pytest.raises(ValueError, match="inputs"):
            spectral_alignments(*bad)


def test_alignment_of_zero_and_constant_inputs():
    v = torch.tensor([1.0, -2.0, 0.5])
    a = spectral_alignment(torch.zeros(4, 6, 3), v)
    assert torch.all(a == 0) and not torch.isnan(a).any()
    const = torch.tensor([0.3, 0.1, 0.2]).expand(10, 3)
    a = spectral_alignment(const, v)
    assert torch.allclose(a, a[0].expand(10))
    assert float(sign_diversity(a)) == 0.0  # constant inputs: one sign, collapsed
    # zero v also gives zeros
    assert torch.all(spectral_alignment(torch.randn(5, 3), torch.zeros(3)) == 0)


def test_alignment_bf16_inputs_computed_in_fp32():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(64, 32, generator=g)
    v = torch.randn(32, generator=g)
    a16 = spectral_alignment(x.to(torch.bfloat16), v)
    ref = spectral_alignment(x.to(torch.bfloat16).float(), v)
    assert a16.dtype == torch.float32
    torch.testing.assert_close(a16, ref)


def test_alignment_of_nonfinite_row_is_nan_and_others_unaffected():
    x = torch.tensor([[1.0, 0.0], [float("inf"), 1.0], [0.0, -1.0]])
    a = spectral_alignment(x, torch.tensor([1.0, 1.0]))
    assert torch.isnan(a[1]) and torch.isfinite(a[[0, 2]]).all()


def test_alignment_uses_top_singular_vector_of_layer():
    """Inputs on the +v1 side all have positive alignment; flipping v flips every sign."""
    w = gapped_matrix(16, 8, ratio=0.5, seed=13)
    _, _, v = top_singular_pair(w)
    g = torch.Generator().manual_seed(14)
    x = v * 2.0 + 0.1 * torch.randn(100, 8, generator=g)
    a = spectral_alignment(x, v)
    assert torch.all(a > 0.9)
    torch.testing.assert_close(spectral_alignment(x, -v), -a)


# ----------------------------------------------------------------------------- sign diversity
@pytest.mark.parametrize("seed", range(5))
def test_sign_diversity_matches_formula_and_is_sign_symmetric(seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(loc=rng.uniform(-1, 1), size=rng.integers(5, 200))
    p = np.mean(a > 0)
    expected = 2 * min(p, 1 - p)
    t = torch.tensor(a, dtype=torch.float32)
    assert float(sign_diversity(t)) == pytest.approx(expected, abs=1e-6)
    assert float(sign_diversity(-t)) == pytest.approx(expected, abs=1e-6)


def test_sign_diversity_extremes_zeros_and_dim():
    assert float(sign_diversity(torch.tensor([1.0, -1.0]))) == 1.0
    assert float(sign_diversity(torch.tensor([0.2, 0.3, 0.9]))) == 0.0
    assert float(sign_diversity(torch.zeros(10))) == 0.0  # nothing signed: no diversity, no NaN
    # zero entries and NaN are left out of p
    assert float(sign_diversity(torch.tensor([0.5, -0.5, 0.0, float("nan")]))) == 1.0
    a = torch.tensor([[1.0, -1.0, 1.0, -1.0], [1.0, 1.0, 1.0, -1.0]])
    torch.testing.assert_close(sign_diversity(a, dim=1), torch.tensor([1.0, 0.5]))


def test_functional_does_not_import_lightning():
    import subprocess
    import sys

    code = (
        "import sys; import lightning_monitor.functional.spectral as s; "
        "bad = [m for m in sys.modules if m.startswith(('lightning', 'pytorch_lightning')) and m != 'lightning_monitor' "
        "and not m.startswith('lightning_monitor')]; print(bad); assert not bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- block iteration
from lightning_monitor.functional import top_singular_subspace  # noqa: E402


@pytest.mark.parametrize("shape", [(64, 64), (40, 100), (120, 30)])
def test_subspace_cold_start_matches_svd(shape):
    w = gapped_matrix(*shape, ratio=0.95, seed=20)
    sigma, u, v, basis = top_singular_subspace(w, n_vectors=4)
    s, u_ref, v_ref = svd_top(w)
    assert basis.shape == (shape[1], 4)
    torch.testing.assert_close(basis.T @ basis, torch.eye(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(basis[:, 0], v)  # first column is v_1
    assert abs(float(v.double() @ v_ref)) > 0.999 and abs(float(u.double() @ u_ref)) > 0.999
    assert float(sigma) == pytest.approx(float(s[0]), rel=1e-5)


def test_subspace_finds_a_direction_that_overtakes_the_top_one():
    """Training can promote the second singular direction past the first between two checks: the
    warm-started block finds it in a few iterations, a single warm vector does not."""
    g = torch.Generator().manual_seed(21)
    u, _ = torch.linalg.qr(torch.randn(80, 80, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(60, 60, generator=g, dtype=torch.float64))
    s = torch.linspace(1.0, 0.1, 60, dtype=torch.float64)
    s_before = s.clone()
    s_before[0], s_before[1] = 1.0, 0.98
    s_after = s.clone()
    s_after[0], s_after[1] = 0.98, 1.0  # direction 2 now on top
    w0 = ((u[:, :60] * s_before) @ v.T).float()
    w1 = ((u[:, :60] * s_after) @ v.T).float()
    _, _, v_single = top_singular_pair(w0)
    _, _, _, basis = top_singular_subspace(w0, n_vectors=4)
    _, _, v_single = top_singular_pair(w1, v0=v_single, n_iter=4)
    sigma, _, v_block, _ = top_singular_subspace(w1, basis, n_iter=4)
    v_ref = v[:, 1]
    assert abs(float(v_block.double() @ v_ref)) > 0.999
    assert float(sigma) == pytest.approx(1.0, rel=1e-4)
    assert abs(float(v_single.double() @ v_ref)) < 0.9  # what a single vector gives in 4 iterations


def test_subspace_keeps_the_sign_of_the_previous_vector_and_handles_zero():
    w = gapped_matrix(30, 20, ratio=0.6, seed=22)
    _, _, v, basis = top_singular_subspace(w)
    _, _, v2, _ = top_singular_subspace(w, basis)
    assert float(v @ v2) > 0.999
    _, _, v3, _ = top_singular_subspace(w, -basis)
    assert float(v @ v3) < -0.999
    sigma, u, v, basis = top_singular_subspace(torch.zeros(5, 6))
    assert float(sigma) == 0 and torch.isfinite(v).all() and torch.all(u == 0)
    with pytest.raises(ValueError, match="basis0"):
        top_singular_subspace(w, torch.randn(7, 4))


def test_batched_subspaces_equal_one_at_a_time():
    from lightning_monitor.functional import top_singular_subspaces

    ws = [gapped_matrix(32, 16, 0.8, seed=30), gapped_matrix(32, 16, 0.7, seed=31), gapped_matrix(16, 48, 0.9, seed=32),
          gapped_matrix(32, 16, 0.6, seed=33).to(torch.bfloat16)]
    bases = [None, top_singular_subspace(ws[1] + 0.01)[3], None, None]
    batched = top_singular_subspaces(ws, bases, n_iter=4)
    for w, b, (sigma, u, v, basis) in zip(ws, bases, batched):
        s1, u1, v1, basis1 = top_singular_subspace(w, b, n_iter=4 if b is not None else None)
        torch.testing.assert_close(sigma, s1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, v1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(basis, basis1, rtol=1e-4, atol=1e-5)
        s_ref, _, v_ref = svd_top(w.float())
        assert abs(float(v.double() @ v_ref)) > 0.999
    with pytest.raises(ValueError, match="basis0"):
        top_singular_subspaces([ws[0]], [torch.randn(17, 4)], n_iter=2)


def test_warm_started_pair_survives_a_swap_of_the_top_two_singular_values():
    """The top two singular values swap between calls: the old v_1 is now exactly the second singular
    vector (a single warm vector would stay there, 1 - |cos| = 1 with the new v_1)."""
    g = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(50, 50, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))
    s = 0.5 * torch.linspace(1.0, 0.1, 40, dtype=torch.float64)
    before, after = s.clone(), s.clone()
    before[0], before[1] = 2.0, 1.0
    after[0], after[1] = 1.0, 2.0  # direction 2 now on top
    w0 = ((u[:, :40] * before) @ v.T).float()
    w1 = ((u[:, :40] * after) @ v.T).float()
    _, _, v_prev = top_singular_pair(w0)
    assert abs(float(v_prev.double() @ v[:, 0])) > 0.999
    sigma, u1, v1 = top_singular_pair(w1, v0=v_prev, n_iter=4)
    assert abs(float(v1.double() @ v[:, 1])) > 0.999
    assert float(sigma) == pytest.approx(2.0, rel=1e-4)
    torch.testing.assert_close((w1 @ v1).double(), float(sigma) * u1.double(), atol=1e-4, rtol=0)

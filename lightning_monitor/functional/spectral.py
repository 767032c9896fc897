"""Spectral alignment (SA): the top singular pair of a weight and the sign diversity of its inputs'
alignment with it.

Qiu, Wu, Tan, Wang, Yao, "Spectral Alignment as Predictor of Loss Explosion in Neural Network
Training", arXiv 2510.04202 (2025).

For a layer ``y = W x`` with ``W`` in ``R^{out x in}`` and SVD ``W = sum_i s_i u_i v_i^T``, the
alignment of an input row ``x_t`` is the cosine ``a_t = <x_t, v_1> / ||x_t||``. The sign of ``v_1`` is
arbitrary, so only sign-symmetric statistics of ``a`` mean anything; the headline one is the sign
diversity ``D = 2 min(p, 1 - p)`` with ``p`` the fraction of positive alignments (1: balanced signs,
0: every input on one side of ``v_1``). When all ``v_1^T x_t`` share a sign, the rank-one terms of the
weight gradient ``sum_t d_t x_t^T`` add up coherently along ``u_1 v_1^T`` and ``s_1`` grows step after
step; mixed signs cancel.

Everything here is pure tensor code: no Lightning, no hooks, no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch
from torch import Tensor

__all__ = ["top_singular_pair", "top_singular_subspace", "top_singular_subspaces", "spectral_alignment",
           "spectral_alignments", "sign_diversity"]

#: Power iterations used without a warm start (``v0=None``) and with one, unless told otherwise.
COLD_ITERATIONS = 100
WARM_ITERATIONS = 4
#: Block iterations without a warm start in :func:`top_singular_subspace` (the block converges faster).
COLD_BLOCK_ITERATIONS = 30
#: :func:`top_singular_subspaces` stacks at most this many weight elements per batch (64 MB in fp32).
MAX_BATCH_ELEMENTS = 1 << 24


def _as_matrix(weight: Tensor) -> Tensor:
    if not isinstance(weight, Tensor):
        raise TypeError(f"`weight` must be a torch.Tensor, got {type(weight).__name__}.")
    if weight.dim() < 2:
        raise ValueError(
            f"`weight` must have at least 2 dimensions (out_features, in_features, ...), got shape "
            f"{tuple(weight.shape)}."
        )
    if weight.is_complex():
        raise TypeError("`weight` must be real; complex weights are not supported.")
    # fp32 at least (bf16/fp16 weights are promoted; fp64 stays fp64)
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    return weight.detach().reshape(weight.shape[0], -1).to(dtype)


def _unit(x: Tensor, fallback: Tensor) -> Tensor:
    """``x / ||x||``, or ``fallback`` where ``x`` is zero or not finite (no host sync)."""
    norm = torch.linalg.vector_norm(x)
    ok = torch.isfinite(norm) & (norm > torch.finfo(x.dtype).tiny)
    return torch.where(ok, x / torch.where(ok, norm, torch.ones_like(norm)), fallback)


def _start_vector(n: int, dtype: torch.dtype, device: torch.device, k: Optional[int] = None) -> Tensor:
    # deterministic, independent of (and without consuming) the global RNG
    g = torch.Generator().manual_seed(0x5A)
    v = torch.randn(n if k is None else (n, k), generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    return v / torch.linalg.vector_norm(v, dim=0)


def _orthonormalize(basis: Tensor) -> Tensor:
    """Orthonormal columns spanning ``basis`` (Householder QR: orthonormal even when ``basis`` is rank
    deficient)."""
    return torch.linalg.qr(basis, mode="reduced").Q


def top_singular_pair(
    weight: Tensor, v0: Optional[Tensor] = None, n_iter: Optional[int] = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Largest singular value and its singular vectors by power iteration, ``W v = sigma u``.

    Iterates ``u <- W v / ||W v||``, ``v <- W^T u / ||W^T u||`` in fp32 (fp64 weights stay fp64), as
    :func:`torch.nn.utils.spectral_norm` does, starting from ``v0`` (a warm start: the ``v`` of the
    previous call) or from a fixed pseudo-random vector. The error in ``v`` shrinks by
    ``(s_2 / s_1)^2`` per iteration. With a repeated top singular value any unit vector of the top
    singular subspace is an answer; ``sigma`` is still exact.

    A warm start guards against the top two singular values swapping between calls (training promotes
    the second direction past the first: ``v0`` is then the new *second* singular vector, from which a
    single power iteration never moves): it iterates the two-vector block ``[v0, s]`` (``s`` the fixed
    start vector) and returns the best vector of its span, so the new top direction is found in
    ``n_iter`` iterations when the third singular value is well below the top two. When the top few
    singular values are all close, track a larger block across calls with :func:`top_singular_subspace`
    (what the monitor does).

    Args:
        weight: ``(out, in)`` matrix; more dimensions (a convolution kernel) are flattened to
            ``(out, -1)``. Any real dtype; computed in fp32.
        v0: warm start, shape ``(in,)``; need not be normalised. A zero or non-finite ``v0`` falls back
            to the fixed start vector.
        n_iter: power iterations; default ``WARM_ITERATIONS`` (4) with ``v0``, ``COLD_ITERATIONS``
            (100) without.

    Returns:
        ``(sigma, u, v)``: a 0-dim tensor, ``u`` of shape ``(out,)`` and ``v`` of shape ``(in,)``, unit
        norm, fp32, on ``weight``'s device, with ``W v = sigma u``. A zero weight gives ``sigma = 0``,
        ``u = 0`` and ``v`` the start vector. No host synchronisation.

    Example:
        >>> w = torch.diag(torch.tensor([3.0, 1.0]))
        >>> sigma, u, v = top_singular_pair(w)
        >>> round(float(sigma), 4), round(float(abs(v[0])), 4)
        (3.0, 1.0)
    """
    w = _as_matrix(weight)
    n_out, n_in = w.shape
    if n_iter is None:
        n_iter = WARM_ITERATIONS if v0 is not None else COLD_ITERATIONS
    if isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 1:
        raise ValueError(f"`n_iter` must be an integer >= 1, got {n_iter!r}.")
    start = _start_vector(n_in, w.dtype, w.device)
    if v0 is None:
        v = start
    else:
        if v0.shape != (n_in,):
            raise ValueError(
                f"`v0` must have shape ({n_in},) (the weight's in_features), got {tuple(v0.shape)}; pass "
                "the `v` returned by the previous call, or None."
            )
        v = _unit(v0.detach().to(dtype=w.dtype, device=w.device), start)
    zeros_out = torch.zeros(n_out, dtype=w.dtype, device=w.device)
    if v0 is not None and n_in > 1:
        # the guard against a swap of the top two singular values between calls: v0 is then (close to)
        # the new second direction, which a single vector never leaves. Iterate the block [v0, s] (s the
        # fixed start vector) and take the best unit vector of its span (Rayleigh-Ritz), as
        # top_singular_subspace does: a direction that overtook v0 is found when the third singular
        # value leaves room for n_iter iterations; the sign of v0 is kept.
        basis = _orthonormalize(torch.stack([v, start], dim=1))
        sigma, u, v, _ = _block_iteration(w[None], basis[None], v[None], n_iter)
        return sigma[0], u[0], v[0]
    for _ in range(n_iter):
        u = _unit(w @ v, zeros_out)
        v = _unit(u @ w, v)  # = W^T u, without a transposed BLAS call (much slower on CPU)
    wv = w @ v
    sigma = torch.linalg.vector_norm(wv)
    u = _unit(wv, zeros_out)
    return sigma, u, v


def top_singular_subspace(
    weight: Tensor, basis0: Optional[Tensor] = None, n_iter: Optional[int] = None, n_vectors: int = 4
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Top singular pair by block (subspace) iteration with a Rayleigh-Ritz step; the robust form of
    :func:`top_singular_pair` for a weight that changes between calls.

    Keeps an orthonormal basis ``V`` of ``n_vectors`` right singular directions, iterates
    ``V <- orth(W^T W V)``, then takes the best unit vector of ``span(V)``: the top eigenvector ``q`` of
    the ``k x k`` Gram matrix ``(W V)^T (W V)`` (by repeated squaring, so no eigensolver and no host
    sync), ``v = V q``, ``sigma = ||W v||``, ``u = W v / sigma``. The error shrinks by
    ``(s_{k+1} / s_1)^2`` per iteration instead of ``(s_2 / s_1)^2``: when training promotes a new
    direction past the old top one, it is already in the basis, and a few warm iterations find it.

    Args:
        weight: ``(out, in)`` (more dimensions are flattened to ``(out, -1)``); computed in fp32.
        basis0: ``(in, k)`` basis of the previous call (warm start), or ``(in,)`` a single vector, or
            ``None``.
        n_iter: iterations; default ``WARM_ITERATIONS`` (4) with ``basis0``, ``COLD_BLOCK_ITERATIONS`` (30)
            without.
        n_vectors: ``k``, the block size (at most ``in``); ignored when ``basis0`` is ``(in, k)``.

    Returns:
        ``(sigma, u, v, basis)``; pass ``basis`` back as ``basis0`` next time.
    """
    w = _as_matrix(weight)
    n_out, n_in = w.shape
    if isinstance(n_vectors, bool) or not isinstance(n_vectors, int) or n_vectors < 1:
        raise ValueError(f"`n_vectors` must be an integer >= 1, got {n_vectors!r}.")
    if n_iter is None:
        n_iter = WARM_ITERATIONS if basis0 is not None else COLD_BLOCK_ITERATIONS
    if isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 1:
        raise ValueError(f"`n_iter` must be an integer >= 1, got {n_iter!r}.")
    k = min(n_vectors, n_in)
    if basis0 is not None and basis0.dim() == 2:
        k = basis0.shape[1]
    if basis0 is None:
        basis = _start_vector(n_in, w.dtype, w.device, k)
        previous = None
    else:
        b = basis0.detach().to(dtype=w.dtype, device=w.device)
        if b.dim() == 1 and b.shape[0] == n_in:
            b = torch.cat([b[:, None], _start_vector(n_in, w.dtype, w.device, k)[:, 1:]], dim=1)
        if b.dim() != 2 or b.shape[0] != n_in:
            raise ValueError(
                f"`basis0` must have shape ({n_in}, k) or ({n_in},) (the weight's in_features), got "
                f"{tuple(basis0.shape)}; pass the `basis` returned by the previous call, or None."
            )
        b = torch.where(torch.isfinite(b), b, torch.zeros_like(b))
        previous = _unit(b[:, 0], torch.zeros_like(b[:, 0]))
        basis = _orthonormalize(b)
    sigma, u, v, basis = _block_iteration(w[None], basis[None], None if previous is None else previous[None], n_iter)
    return sigma[0], u[0], v[0], basis[0]


def _unit_rows(x: Tensor, fallback: Tensor) -> Tensor:
    """Each row of ``x`` (``(B, n)``) normalised, or the row of ``fallback`` where it is zero/non-finite."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    ok = torch.isfinite(norm) & (norm > torch.finfo(x.dtype).tiny)
    return torch.where(ok, x / torch.where(ok, norm, torch.ones_like(norm)), fallback)


def residuals(w: Tensor, sigma: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """``||W^T u - sigma v|| / sigma`` per matrix of the batch ``w`` ``(B, out, in)`` (0 where ``sigma`` is 0): how far
    ``(sigma, u, v)`` is from a singular triple. Where it is ``r``, ``sigma`` is low by about ``r^2 / 2`` relative at
    most, and ``v`` is within an angle of about ``r / (1 - (s_2 / s_1)^2)`` of the top singular vector."""
    tiny = torch.finfo(w.dtype).tiny
    wtu = (u[:, None, :] @ w)[:, 0, :]
    res = torch.linalg.vector_norm(wtu - sigma[:, None] * v, dim=-1)
    return torch.where(sigma > tiny, res / sigma.clamp_min(tiny), torch.zeros_like(res))


def _block_iteration(
    w: Tensor, basis: Tensor, previous: Optional[Tensor], n_iter: int, tol: Optional[float] = None,
    max_iter: Optional[int] = None, used: Optional[list[int]] = None, unconverged: Optional[list[bool]] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Batched core of :func:`top_singular_subspace`: ``w`` ``(B, out, in)``, ``basis`` ``(B, in, k)``
    orthonormal, ``previous`` ``(B, in)`` sign references or ``None``. Returns ``sigma (B,)``,
    ``u (B, out)``, ``v (B, in)`` and the rotated basis ``(B, in, k)`` whose first column is ``v``.

    ``tol``: after the ``n_iter`` iterations, while a matrix's :func:`residuals` exceeds ``tol``, that matrix iterates on
    in rounds of half the iterations so far (at least ``n_iter``), up to ``max_iter`` in all (one host read per round:
    which matrices are not converged); ``None``: exactly ``n_iter``, no host sync. ``used``: where given, extended with
    the iterations each matrix ran; ``unconverged``: with ``tol``, extended with whether each is still above it after
    ``max_iter`` (read only when the cap was reached).
    Each matrix is divided by its largest magnitude first (its products are its entries squared: a weight of entries
    near 1e-23 underflowed in fp32 and its sigma came out 0), and sigma multiplied back."""
    tiny = torch.finfo(w.dtype).tiny
    scale = w.abs().amax(dim=(1, 2)).clamp_min(tiny)
    w = w / scale[:, None, None]
    sigma, u, v, rotated = _rayleigh_ritz(w, _iterate(w, basis, n_iter), previous)
    done, each = n_iter, [n_iter] * w.shape[0]
    while tol is not None and max_iter is not None and done < max_iter:
        # only the matrices not converged yet iterate on (one host read a round: which they are)
        todo = (residuals(w, sigma, u, v) > tol).nonzero()[:, 0]
        if todo.numel() == 0:
            break
        rounds = min(max(n_iter, done // 2), max_iter - done)  # rounds of growing length: fewer checks and host reads
        sub, prev = w[todo], None if previous is None else previous[todo]
        parts = _rayleigh_ritz(sub, _iterate(sub, rotated[todo], rounds), prev)
        sigma, u, v, rotated = (t.index_copy(0, todo, p) for t, p in zip((sigma, u, v, rotated), parts))
        done += rounds
        for i in todo.tolist():
            each[i] = done
    if used is not None:
        used.extend(each)
    if unconverged is not None:
        if tol is not None and max_iter is not None and done >= max_iter:
            unconverged.extend((residuals(w, sigma, u, v) > tol).tolist())
        else:
            unconverged.extend([False] * w.shape[0])
    return sigma * scale, u, v, rotated


def _iterate(w: Tensor, basis: Tensor, n_iter: int) -> Tensor:
    """``n_iter`` block power iterations of the orthonormal bases ``basis`` (``(B, in, k)``) under ``w``."""
    for _ in range(n_iter):
        # W^T W V, written (W V)^T W: a transposed BLAS call is much slower on CPU
        basis = _orthonormalize(((w @ basis).transpose(1, 2) @ w).transpose(1, 2))
    return basis


def _rayleigh_ritz(w: Tensor, basis: Tensor, previous: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The best unit vector of each ``span(basis)`` for ``w`` (see :func:`_block_iteration`)."""
    n_batch, n_out, _ = w.shape
    k = basis.shape[-1]
    # Rayleigh-Ritz: top eigenvector of the k x k Gram matrix by repeated squaring (no eigensolver)
    wb = w @ basis
    gram = wb.transpose(1, 2) @ wb
    tiny = torch.finfo(w.dtype).tiny
    for i in range(12):
        # scaled to trace 1 (eigenvalues in [0, 1], the largest >= 1/k) before every third squaring: three
        # squarings keep the largest above k^-8, far from underflow, at a third of the scaling kernels
        if i % 3 == 0:
            gram = gram / torch.diagonal(gram, dim1=1, dim2=2).sum(-1).clamp_min(tiny)[:, None, None]
        gram = gram @ gram
    col = torch.argmax(torch.diagonal(gram, dim1=1, dim2=2), dim=-1)  # (B,)
    eye = torch.eye(k, dtype=w.dtype, device=w.device)
    q = torch.gather(gram, 2, col[:, None, None].expand(n_batch, k, 1))[..., 0]
    q = _unit_rows(q, eye[0].expand(n_batch, k))
    if previous is not None:  # keep the sign of the previous call's vector where it is defined
        flip = ((basis @ q[..., None])[..., 0] * previous).sum(-1, keepdim=True) < 0
        q = torch.where(flip, -q, q)
    v = (basis @ q[..., None])[..., 0]
    wv = (w @ v[..., None])[..., 0]
    sigma = torch.linalg.vector_norm(wv, dim=-1)
    u = _unit_rows(wv, torch.zeros(n_batch, n_out, dtype=w.dtype, device=w.device))
    # rotate the basis so that its first column is v (the sign reference of the next call)
    rot = _orthonormalize(torch.cat([q[..., None], eye[:, : k - 1].expand(n_batch, k, k - 1)], dim=2))
    rot = rot * torch.where((rot[:, :, 0] * q).sum(-1) < 0, -1.0, 1.0)[:, None, None]
    return sigma, u, v, basis @ rot


def top_singular_subspaces(
    weights: list[Tensor], bases0: list[Optional[Tensor]], n_iter: Union[int, Sequence[int]], n_vectors: int = 4,
    tol: Optional[float] = None, max_iter: Optional[int] = None, iterations: Optional[list[int]] = None,
    unconverged: Optional[list[bool]] = None,
) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """:func:`top_singular_subspace` of several weights, batched: weights of one shape, dtype and
    device whose ``basis0`` are all given (or all ``None``) run as one batch of matrix products
    (``max_batch_elements`` bounds the stacked copy). Same results as calling it one weight at a time.

    Args:
        weights: list of ``(out, in)`` weights.
        bases0: for each weight, its previous basis ``(in, k)`` or ``None``.
        n_iter: iterations for warm-started weights (cold ones run ``COLD_BLOCK_ITERATIONS``); one per weight, or
            one for all.
        n_vectors: block size for cold starts.
        tol, max_iter: iterate further the weights whose relative residual ``||W^T u - sigma v|| / sigma`` is above
            ``tol`` after the first ``n_iter`` (cold: ``COLD_BLOCK_ITERATIONS``) iterations, in rounds of half the
            iterations so far, up to ``max_iter`` iterations in all (at least the first round's); one host read per
            round. ``None`` (default): no check, no host sync.
        iterations: where given, filled with the iterations each weight ran (in the order of ``weights``).
        unconverged: where given (with ``tol``), filled with whether each weight's residual is still above ``tol`` after
            ``max_iter`` iterations (its top singular values nearly equal: sigma is close, ``v`` a vector of the top
            subspace).
    """
    if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol > 0):
        raise ValueError(f"`tol` must be a number > 0 or None, got {tol!r}.")
    if max_iter is not None and (isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1):
        raise ValueError(f"`max_iter` must be an integer >= 1 or None, got {max_iter!r}.")
    if len(weights) != len(bases0):
        raise ValueError("`weights` and `bases0` must have the same length.")
    mats = [_as_matrix(w) for w in weights]
    counts = [n_iter] * len(mats) if isinstance(n_iter, int) else list(n_iter)
    if len(counts) != len(mats):
        raise ValueError("`n_iter` must be one integer or one per weight.")
    groups: dict[tuple, list[int]] = {}
    for i, (w, b) in enumerate(zip(mats, bases0)):
        k = b.shape[-1] if b is not None and b.dim() == 2 else min(n_vectors, w.shape[1])
        groups.setdefault((tuple(w.shape), w.dtype, w.device, b is None, k, None if b is None else counts[i]),
                          []).append(i)
    out: list[Optional[tuple[Tensor, Tensor, Tensor, Tensor]]] = [None] * len(mats)
    ran = [0] * len(mats)
    stuck = [False] * len(mats)
    for (shape, dtype, device, cold, k, warm_iter), idx in groups.items():
        per = max(1, MAX_BATCH_ELEMENTS // (shape[0] * shape[1]))
        for start in range(0, len(idx), per):
            chunk = idx[start : start + per]
            w = torch.stack([mats[i] for i in chunk])
            if cold:
                basis = _start_vector(shape[1], dtype, device, k).expand(len(chunk), shape[1], k)
                previous = None
                iters = COLD_BLOCK_ITERATIONS
            else:
                b = torch.stack([bases0[i].detach().to(dtype=dtype, device=device) for i in chunk])  # type: ignore[union-attr]
                if b.shape[1] != shape[1]:
                    raise ValueError(
                        f"a `basis0` of shape {tuple(b.shape[1:])} does not fit a weight of shape {shape}; pass "
                        "the basis returned for that weight, or None."
                    )
                b = torch.where(torch.isfinite(b), b, torch.zeros_like(b))
                previous = _unit_rows(b[:, :, 0], torch.zeros_like(b[:, :, 0]))
                basis = _orthonormalize(b)
                iters = warm_iter
            cap = None if max_iter is None else max(max_iter, iters)
            used: list[int] = []
            short: list[bool] = []
            sigma, u, v, basis = _block_iteration(w, basis, previous, iters, tol, cap, used, short)
            for j, i in enumerate(chunk):
                ran[i], stuck[i] = used[j], short[j]
                out[i] = (sigma[j], u[j], v[j], basis[j])
    if iterations is not None:
        iterations[:] = ran
    if unconverged is not None:
        unconverged[:] = stuck
    return out  # type: ignore[return-value]


def spectral_alignment(inputs: Tensor, v: Tensor) -> Tensor:
    """Cosine of every input row with ``v``: ``a_t = <x_t, v> / (||x_t|| ||v||)``.

    Args:
        inputs: ``(..., in)``: any leading dimensions (batch, sequence, heads ...), any float dtype
            (computed in fp32).
        v: ``(in,)``, e.g. the top right singular vector of the layer's weight (any norm).

    Returns:
        fp32 tensor of shape ``inputs.shape[:-1]`` with values in ``[-1, 1]``. A zero row (or a zero
        ``v``) gives 0, never NaN; a row holding inf/NaN gives NaN.

    Example:
        >>> spectral_alignment(torch.tensor([[1.0, 0.0], [-2.0, 0.0], [0.0, 0.0]]), torch.tensor([1.0, 0.0]))
        tensor([ 1., -1.,  0.])
    """
    if inputs.dim() < 1 or v.dim() != 1 or inputs.shape[-1] != v.shape[0]:
        raise ValueError(
            f"`inputs` must have shape (..., {v.shape[0] if v.dim() == 1 else 'in'}) matching `v` of shape "
            f"(in,); got inputs {tuple(inputs.shape)} and v {tuple(v.shape)}."
        )
    dtype = torch.float64 if inputs.dtype == torch.float64 else torch.float32
    x = inputs.detach().to(dtype)
    vv = v.detach().to(dtype=dtype, device=x.device)
    vv = _unit(vv, torch.zeros_like(vv))
    return _cosines(x, x @ vv)


def _cosines(x: Tensor, dot: Tensor) -> Tensor:
    """``dot / ||x||`` over the last dimension of ``x`` (``dot``: each row's product with a unit vector), in fp32
    and ``[-1, 1]``: 0 for a zero row, NaN for a row holding inf/NaN."""
    norm = torch.linalg.vector_norm(x, dim=-1)
    positive = norm > 0
    out = torch.where(positive, dot / torch.where(positive, norm, torch.ones_like(norm)), torch.zeros_like(dot))
    # a non-finite row: norm is inf/nan -> keep it visible as NaN rather than a fake 0
    out = torch.where(torch.isfinite(norm), out, torch.full_like(out, float("nan")))
    return out.float().clamp(-1.0, 1.0)


def spectral_alignments(inputs: Tensor, vs: Tensor) -> Tensor:
    """:func:`spectral_alignment` of several layers at once: ``inputs`` ``(L, n, in)`` (layer ``l``'s rows),
    ``vs`` ``(L, in)`` (layer ``l``'s vector); returns ``(L, n)``. One set of kernels for the ``L`` layers
    instead of one per layer (on a small model the kernel launches, not the arithmetic, are the cost).
    The same values as calling :func:`spectral_alignment` per layer, up to float rounding."""
    if inputs.dim() != 3 or vs.dim() != 2 or inputs.shape[0] != vs.shape[0] or inputs.shape[-1] != vs.shape[-1]:
        raise ValueError(f"`inputs` must have shape (L, n, in) and `vs` shape (L, in); got {tuple(inputs.shape)} "
                         f"and {tuple(vs.shape)}.")
    dtype = torch.float64 if inputs.dtype == torch.float64 else torch.float32
    x = inputs.detach().to(dtype)
    vv = vs.detach().to(dtype=dtype, device=x.device)
    vv = _unit_rows(vv, torch.zeros_like(vv))
    return _cosines(x, (x @ vv[..., None])[..., 0])


def sign_diversity(alignment: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sign diversity ``D = 2 min(p, 1 - p)``, ``p`` the fraction of positive alignments.

    ``D`` is 1 when half the entries are positive and half negative, 0 when all share one sign. It is
    symmetric in the sign of the singular vector (``D(a) = D(-a)``). Entries that are exactly 0 (zero
    input rows) or NaN carry no sign and are left out of ``p``; with no signed entry at all, ``D = 0``.

    Args:
        alignment: any shape, e.g. the output of :func:`spectral_alignment`.
        dim: reduce along this dimension only; default: over every entry (a 0-dim result).

    Example:
        >>> sign_diversity(torch.tensor([0.3, -0.1, 0.2, 0.5]))
        tensor(0.5000)
    """
    a = alignment.detach()
    pos = (a > 0).float()
    neg = (a < 0).float()
    if dim is None:
        n_pos, n_neg = pos.sum(), neg.sum()
    else:
        n_pos, n_neg = pos.sum(dim), neg.sum(dim)
    total = n_pos + n_neg
    p = n_pos / total.clamp_min(1.0)
    d = 2.0 * torch.minimum(p, 1.0 - p)
    return torch.where(total > 0, d, torch.zeros_like(d))

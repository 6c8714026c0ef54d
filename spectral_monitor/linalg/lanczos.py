"""Batched block Lanczos with full reorthogonalisation: extreme eigenpairs and top singular triplets.

One Krylov process runs for every batch element at once (a batch of attention heads, of layers, or a single
Hessian). Each element stops on its own test; when most of a batch has converged the operator is restricted
to the rest, so finished elements stop costing products.

What ``converged`` means. A Ritz pair (θ, y) with residual r = ‖Op y − θ y‖ has an eigenvalue within r of θ
(the residual bound, for any symmetric operator). If that eigenvalue is the only one within δ of θ, it is
within r²/δ of θ (Kato–Temple). The solver takes δ as the distance from θ to the nearest *interval*
[θⱼ − rⱼ, θⱼ + rⱼ] of another Ritz pair, so an unresolved neighbour narrows the gap instead of widening it,
and asks for three things: min(r, r²/δ) within ``tol`` of the eigenvalue (of each wanted one with
``relative_to="each"``); the first Ritz pair past the wanted ones resolved (its residual at most half its
distance to them, or converged itself); and, with ``failure_probability`` p, a Krylov polynomial of high
enough degree that an eigenvalue δ or more above θ, had the space missed it, would have pulled a Ritz value
to it from a random start with probability 1 − p (the Kaniel–Paige–Saad bound, :func:`_krylov_certifies`).

When it can still fail. A Krylov method sees nothing of an eigenvector orthogonal to its start space: the
guarantee is over the random start, not over the operator. A Gaussian start has a component below p/√n
along a fixed eigenvector with probability about p·√(2/π); the degree test is sized for that. It covers an
unseen eigenvalue δ or more above θ; one closer than δ is excluded only by the Ritz intervals (an unsplit
cluster shows there as a wide interval next to θ, which shrinks δ, but nothing proves it must). The spread of
the spectrum in that test is the Ritz values' span (widened by the end residuals), which underestimates the
true spread until the far end has converged, so the test can be optimistic early. Without
``failure_probability`` only the first two tests apply: a cluster the space has not yet split (1% apart,
say) can then pass as one eigenvalue. Exactly repeated eigenvalues need a block at least as wide as the
multiplicity. Products are formed in the operator's dtype; in float32 a residual cannot fall much below
float32 rounding of the largest |θ|.

Warm starts. ``init_mode="prepend"``: previous Ritz vectors are put in front of a random block of the cold
width; the warm Krylov space contains the cold one at every iteration, so by the min-max principle its
extreme Ritz values are at least as accurate as a cold start's after the same number of iterations.
``init_mode="mix"``: each warm vector is added to a random start vector, so a single-vector Lanczos keeps
its width and every start vector keeps a random component along every eigenvector. Either way the answer
is accepted only by the same test as a cold one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from spectral_monitor.linalg.operators import (
    BatchedOperator,
    DenseOperator,
    GramOperator,
    as_operator,
    default_generator,
    gaussian,
    working_dtype,
)

Which = Literal["largest", "smallest"]
StopCriterion = Literal["residual", "eigenvalue"]
STOP_CRITERIA = ("residual", "eigenvalue")
RelativeTo = Literal["largest", "each"]
RELATIVE_TO = ("largest", "each")
InitMode = Literal["prepend", "mix"]
INIT_MODES = ("prepend", "mix")
INITIAL_BASIS_BLOCKS = 12
"""Blocks the Lanczos basis has room for before it grows: σ₁, σ₂ of softmax attention take 11–17."""
CERTAINTY = 0.01
"""The ``failure_probability`` the probes' solves certify their answers to: the chance, over the random
start, that an eigenvalue above a reported one was never seen (:func:`lanczos_eigsh`)."""
EACH_FLOOR = 1e-3
"""With ``relative_to="each"``, a wanted |θ| below this fraction of the largest is judged against the floor
instead: near zero, float32 rounding of the products, not θ, sets the scale an error can reach."""


@dataclass
class ConvergenceInfo:
    """How an iterative estimate converged, per batch element.

    ``iterations``: block iterations used; ``residual``: Ritz residual norms ‖Op y − θ y‖ of the returned
    pairs, relative to max |θ|; ``converged``: every returned pair passed the test of
    :func:`lanczos_eigsh`; ``products``: total
    operator-vector products spent on the whole batch (one block product of width b counts b per element).
    """

    iterations: Tensor
    residual: Tensor
    converged: Tensor
    products: int


@dataclass
class EigenResult:
    """Extreme eigenpairs of a batch of symmetric operators: ``values`` (B, k), ``vectors`` (B, n, k)."""

    values: Tensor
    vectors: Tensor
    info: ConvergenceInfo


@dataclass
class SingularResult:
    """Top singular triplets: ``values`` (B, k) descending, ``left`` (B, m, k), ``right`` (B, n, k); a side
    that was not asked for (``top_singular``'s ``return_vectors``) is ``None``."""

    values: Tensor
    left: Tensor | None
    right: Tensor | None
    info: ConvergenceInfo


def orthonormal_rows(
    block: Tensor, basis: Tensor | None, scale: Tensor, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Orthonormalise the rows of ``block`` (B, b, n) against the rows of ``basis`` (B, k, n) and each other;
    returns (Q, C), Q (B, b, n) with orthonormal rows and ``blockᵀ ≈ Qᵀ C``.

    A row that vanishes (the Krylov space became invariant, e.g. for a rank-one attention matrix) is
    replaced by a random direction orthogonal to everything so far; its coupling C is then exactly what the
    row carried, so the projected matrix stays exact.
    """
    n = block.shape[2]
    q, r = torch.linalg.qr(block.mT)
    q = q.mT.contiguous()
    tiny = r.diagonal(dim1=1, dim2=2).abs() <= 10 * n**0.5 * torch.finfo(block.dtype).eps * scale[:, None]
    if bool(tiny.any()):
        filler = gaussian(block.mT.shape, dtype=block.dtype, device=block.device, generator=generator).mT
        q = torch.where(tiny[:, :, None], filler, q)
        for _ in range(2):
            if basis is not None:
                q = torch.baddbmm(q, q @ basis.mT, basis, alpha=-1)
            q = torch.linalg.qr(q.mT).Q.mT.contiguous()
    return q, q @ block.mT


def reorthogonalise(block: Tensor, basis: Tensor) -> Tensor:
    """The rows of ``block`` (B, b, n) less their components along the orthonormal rows of ``basis``."""
    # Twice is enough (Kahan–Parlett): one classical Gram–Schmidt pass loses orthogonality in float32.
    for _ in range(2):
        block = torch.baddbmm(block, block @ basis.mT, basis, alpha=-1)
    return block


class GrowingRows:
    """Rows (B, k, n), block after block, in a buffer with room for more: appending copies only the new
    block. ``torch.cat`` copied the whole basis into a fresh allocation each time, 86 ms for the 17 blocks of
    64 Lanczos bases at n = 2048 against 4.5 ms for writing each block into room kept for it."""

    GROWTH = 1.5

    def __init__(self, first: Tensor, capacity: int) -> None:
        batch, count, n = first.shape
        self._buffer = first.new_empty((batch, max(capacity, count), n))
        self._buffer[:, :count] = first
        self._count = count

    @property
    def rows(self) -> Tensor:
        """The rows so far, (B, k, n): a view, valid until the next ``append`` or ``keep``."""
        return self._buffer[:, : self._count]

    @property
    def count(self) -> int:
        return self._count

    def append(self, block: Tensor) -> None:
        needed = self._count + block.shape[1]
        capacity = self._buffer.shape[1]
        if needed > capacity:
            batch, _, n = self._buffer.shape
            # An orthonormal basis of length-n rows never needs more than n of them.
            grown_capacity = max(needed, min(int(capacity * self.GROWTH), n))
            grown = self._buffer.new_empty((batch, grown_capacity, n))
            grown[:, : self._count] = self.rows
            self._buffer = grown
        self._buffer[:, self._count : needed] = block
        self._count = needed

    def keep(self, index: Tensor) -> None:
        """Drop every batch element but ``index`` (indices or a mask)."""
        # Only the rows so far are copied: indexing the whole buffer copied its spare room too, 114 ms of a
        # 0.32 s solve for 64 bases with room for 192 rows of 1024.
        rows = self.rows[index]
        kept = self._buffer.new_empty((rows.shape[0], *self._buffer.shape[1:]))
        kept[:, : self._count] = rows
        self._buffer = kept


def lanczos_eigsh(
    op: BatchedOperator | Tensor,
    k: int = 1,
    *,
    which: Which = "largest",
    block_size: int | None = None,
    tol: float = 1e-4,
    max_iters: int = 60,
    init: Tensor | None = None,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    criterion: StopCriterion = "residual",
    relative_to: RelativeTo = "largest",
    init_mode: InitMode = "prepend",
    failure_probability: float | None = None,
) -> EigenResult:
    """The ``k`` largest- (or smallest-) algebraic eigenpairs of a batch of symmetric operators.

    Block Lanczos with full reorthogonalisation. A batch element stops when every wanted Ritz pair meets
    ``tol`` by ``criterion`` and the space has resolved the Ritz pair past them (the module docstring says
    what that guarantees and assumes): ``"residual"``, the Ritz residual r (an eigenvalue lies within r of
    θ: a bound on the error, usually far above it); ``"eigenvalue"``, the Kato–Temple error min(r, r²/δ)
    with δ the gap to the nearest other Ritz interval. ``relative_to="largest"`` judges against max|θ|;
    ``"each"`` judges each wanted pair against its own |θᵢ| (floored at ``EACH_FLOOR`` · max|θ|, where float
    rounding of the products, not θ, sets the scale an error can reach). ``failure_probability`` adds the
    Kaniel–Paige–Saad degree test, which makes a cluster the space has not split, or a warm vector that is an
    eigenvector of a lower eigenvalue, cost products instead of accuracy.
    An element whose product is non-finite stops with NaN values, not converged. A ``block_size`` below
    ``k`` is allowed (single-vector Lanczos needs the fewest products when exact multiplicities are not
    expected). ``init`` (B, n, r) warm-starts from earlier vectors, as ``init_mode`` says. ``max_iters`` caps
    block iterations;
    ``info`` says what each element reached (``converged`` False where the cap came first).
    """
    op = op if isinstance(op, BatchedOperator) else DenseOperator(as_symmetric_tensor(op), symmetric=True)
    if not op.symmetric:
        raise ValueError("op must be symmetric (use top_singular for general matrices)")
    if which not in ("largest", "smallest"):
        raise ValueError(f"which must be 'largest' or 'smallest', got {which!r}")
    n, batch = op.cols, op.batch
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}] for operators of size {n}, got {k}")
    if tol <= 0:
        raise ValueError(f"tol must be positive, got {tol}")
    if max_iters < 1:
        raise ValueError(f"max_iters must be >= 1, got {max_iters}")
    if criterion not in STOP_CRITERIA:
        raise ValueError(f"criterion must be one of {STOP_CRITERIA}, got {criterion!r}")
    if relative_to not in RELATIVE_TO:
        raise ValueError(f"relative_to must be one of {RELATIVE_TO}, got {relative_to!r}")
    if init_mode not in INIT_MODES:
        raise ValueError(f"init_mode must be one of {INIT_MODES}, got {init_mode!r}")
    if failure_probability is not None and not 0 < failure_probability < 1:
        raise ValueError(f"failure_probability must be None or in (0, 1), got {failure_probability!r}")
    work = working_dtype(op.dtype, dtype)
    sign = 1.0 if which == "largest" else -1.0
    generator = generator if generator is not None else default_generator(op.device)
    width = min(block_size if block_size is not None else max(2 * k, 4), n)
    if width < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    warm_width = 0 if init is None or init_mode == "mix" else init.shape[-1]
    if (width + warm_width) * max_iters < k:
        raise ValueError(
            f"(block_size + warm vectors) * max_iters must be >= k={k}, "
            f"got ({width} + {warm_width}) * {max_iters}"
        )

    start = gaussian((batch, n, width), dtype=work, device=op.device, generator=generator)
    if init is not None:
        if init.ndim != 3 or init.shape[0] != batch or init.shape[1] != n:
            raise ValueError(f"init must have shape ({batch}, {n}, r), got {tuple(init.shape)}")
        warm = init.to(device=op.device, dtype=work)
        if init_mode == "prepend":
            start = torch.cat([warm[:, :, : max(0, n - width)], start], dim=2)
        else:
            start = _mixed_start(warm, start)

    # Blocks and the basis are kept as rows (B, b, n): a product with the transpose of a (B, n, k) basis
    # read it with a stride, and full reorthogonalisation, which reads the whole basis twice a block, took
    # 2–3× as long as it does on rows (64 bases of 1024 × 12–44 in float32). Operators see (B, n, b) views.
    def apply(active_op: BatchedOperator, rows: Tensor) -> Tensor:
        y = active_op.matmat(rows.mT.to(active_op.dtype)).to(work).mT.contiguous()
        return y if sign > 0 else -y

    values = torch.full((batch, k), float("nan"), dtype=work, device=op.device)
    vectors = torch.zeros((batch, n, k), dtype=work, device=op.device)
    residual = torch.full((batch, k), float("inf"), dtype=work, device=op.device)
    iterations = torch.zeros(batch, dtype=torch.long, device=op.device)
    converged = torch.zeros(batch, dtype=torch.bool, device=op.device)
    products = 0

    active = torch.arange(batch, device=op.device)
    settled = torch.zeros(batch, dtype=torch.bool, device=op.device)
    active_op = op
    scale = torch.zeros(batch, dtype=work, device=op.device)
    q, _ = orthonormal_rows(start.mT, None, torch.ones(batch, dtype=work, device=op.device), generator)
    basis = GrowingRows(q, min(n, q.shape[1] * min(max_iters, INITIAL_BASIS_BLOCKS)))
    previous: Tensor | None = None
    coupling: Tensor | None = None
    tridiagonal = torch.zeros((batch, 0, 0), dtype=work, device=op.device)

    for iteration in range(1, max_iters + 1):
        w = apply(active_op, q)
        products += q.shape[1] * active.numel()
        # A non-finite product (a NaN in a Hessian, a poisoned matrix) ends that element with NaN values;
        # zeroing its block keeps the batched small eigenproblems finite for the others.
        broken = ~torch.isfinite(w).flatten(1).all(dim=1) & ~settled
        if bool(broken.any()):
            w = torch.where(broken[:, None, None], torch.zeros_like(w), w)
            done = active[broken]
            residual[done] = float("nan")
            iterations[done] = iteration
            settled = settled | broken
            if bool(settled.all()):
                break
        scale = torch.maximum(scale, w.norm(dim=2).amax(dim=1))
        alpha = w @ q.mT
        alpha = (alpha + alpha.mT) / 2
        w = torch.baddbmm(w, alpha, q, alpha=-1)
        if previous is not None and coupling is not None:
            w = torch.baddbmm(w, coupling, previous, alpha=-1)
        w = reorthogonalise(w, basis.rows)
        room = n - basis.count
        if room >= w.shape[1]:
            next_q, next_coupling = orthonormal_rows(w, basis.rows, scale, generator)
        else:
            # The last block fits only ``room`` more directions; the residual lies in them (rank <= room).
            next_q = torch.linalg.svd(w.mT, full_matrices=False).U[:, :, : max(room, 0)].mT.contiguous()
            next_coupling = next_q @ w.mT

        size, width_now = tridiagonal.shape[1], q.shape[1]
        grown = torch.zeros(
            (active.numel(), size + width_now, size + width_now), dtype=work, device=op.device
        )
        grown[:, :size, :size] = tridiagonal
        grown[:, size:, size:] = alpha
        if coupling is not None:
            grown[:, size:, size - coupling.shape[2] : size] = coupling
            grown[:, size - coupling.shape[2] : size, size:] = coupling.transpose(1, 2)
        tridiagonal = grown
        if tridiagonal.shape[1] < k:  # a block narrower than k: not yet k Ritz values
            previous, q, coupling = q, next_q, next_coupling
            basis.append(next_q)
            continue

        theta, ritz = (t.to(work) for t in torch.linalg.eigh(tridiagonal.double()))
        wanted_theta = theta[:, -k:].flip(1)
        wanted_vectors = ritz[:, :, -k:].flip(2)
        every_residual = (next_coupling @ ritz[:, -width_now:, :]).norm(dim=1)
        res = every_residual[:, -k:].flip(1)
        magnitude = theta.abs().amax(dim=1).clamp_min(torch.finfo(work).tiny)
        relative = res / magnitude[:, None]
        judged_against = magnitude[:, None]
        if relative_to == "each":
            judged_against = torch.maximum(wanted_theta.abs(), EACH_FLOOR * judged_against)
        estimate = res if criterion == "residual" else _eigenvalue_error(theta, every_residual, k)
        error = estimate / judged_against
        exhausted = room <= 0
        resolved = _resolves_past_wanted(theta, every_residual, k, tol * judged_against[:, -1])
        if failure_probability is not None:
            resolved &= _krylov_certifies(
                theta, every_residual, k, tol * judged_against, iteration - 1, n, failure_probability
            )
        met = active_op.agreed((error <= tol).all(dim=1) & resolved)
        finishing = (met | exhausted | (iteration == max_iters)) & ~settled

        if bool(finishing.any()):
            done = active[finishing]
            values[done] = sign * wanted_theta[finishing]
            vectors[done] = basis.rows[finishing].mT @ wanted_vectors[finishing]
            residual[done] = relative[finishing]
            iterations[done] = iteration
            converged[done] = met[finishing] | exhausted
            settled = settled | finishing
        if bool(settled.all()):
            break

        previous, q, coupling = q, next_q, next_coupling
        basis.append(next_q)
        remaining = ~settled
        if bool(settled.any()):
            restricted = active_op.restrict(remaining.nonzero().squeeze(1))
            if restricted is not None:
                active_op = restricted
                active, previous, q, coupling = (
                    active[remaining],
                    previous[remaining],
                    q[remaining],
                    coupling[remaining],
                )
                basis.keep(remaining)
                tridiagonal, scale = tridiagonal[remaining], scale[remaining]
                settled = settled[remaining]

    info = ConvergenceInfo(iterations=iterations, residual=residual, converged=converged, products=products)
    return EigenResult(values=values, vectors=vectors, info=info)


def _mixed_start(warm: Tensor, fresh: Tensor) -> Tensor:
    """The start block (B, n, b) of a ``"mix"`` warm start: each column of ``fresh`` (random) normalised,
    plus the normalised warm vectors, warm vector j added to column j mod b."""
    unit = torch.finfo(fresh.dtype).tiny
    start = fresh / fresh.norm(dim=1, keepdim=True).clamp_min(unit)
    warm = warm / warm.norm(dim=1, keepdim=True).clamp_min(unit)
    for column in range(warm.shape[2]):
        start[:, :, column % start.shape[2]] += warm[:, :, column]
    return start


def _eigenvalue_error(theta: Tensor, residual: Tensor, k: int) -> Tensor:
    """min(r, r²/δ) for the top ``k`` of the ascending Ritz values ``theta`` (B, m), from the residuals of
    every Ritz pair ``residual`` (B, m); returned top first (B, k).

    δ is the gap from θᵢ to the nearest *interval* [θⱼ − rⱼ, θⱼ + rⱼ] of another Ritz pair (each holds an
    eigenvalue), not to θⱼ itself: a Ritz value still moving through a cluster has a wide interval, so it
    narrows the gap instead of making it look as wide as the distance between two unresolved values. A
    pair with no other Ritz value, or whose neighbour's interval reaches it, is judged by r alone.
    """
    distance = (theta[:, :, None] - theta[:, None, :]).abs() - residual[:, None, :]
    distance.diagonal(dim1=1, dim2=2).fill_(float("inf"))
    gap = distance.amin(dim=2).clamp_min(0)[:, -k:].flip(1)
    wanted = residual[:, -k:].flip(1)
    estimate = wanted.square() / gap.clamp_min(torch.finfo(theta.dtype).tiny)
    return torch.minimum(wanted, estimate)


def _krylov_certifies(
    theta: Tensor,
    residual: Tensor,
    k: int,
    tolerance: Tensor,
    degree: int,
    n: int,
    failure_probability: float,
) -> Tensor:
    """Whether a Krylov polynomial of ``degree`` from a random start would have shown, with probability
    1 − ``failure_probability``, an eigenvalue hidden above each wanted Ritz value θᵢ by its gap δᵢ (B,).

    The Kaniel–Paige–Saad bound: λ − θ ≤ S (tan φ₀ / T_d(1 + 2γ))² for the eigenvalue λ that the start
    vector makes an angle φ₀ with, γ = δ/S its gap relative to the spread S of the spectrum and T_d the
    Chebyshev polynomial of degree d. A random start (or a warm vector plus a random one, whose component
    along any fixed direction has the same density, twice the norm) has cos φ₀ ≥ p/√n with probability at
    least 1 − p·√(2/π), so tan φ₀ ≤ 2√n/p. The test asks T_d(1 + 2δᵢ/S) ≥ (2√n/p)·√(S/τᵢ): an eigenvalue
    δᵢ or more above θᵢ would then have pulled a Ritz value to within τᵢ (the tolerance) of it. δᵢ is the
    Kato–Temple gap the error bound used (to the nearest other Ritz interval), at least τᵢ; S is the span of
    the Ritz values widened by the end ones' residuals, which can only underestimate the true spread where
    the far end of the spectrum has not converged.
    """
    if theta.shape[1] <= k:
        return torch.zeros(theta.shape[0], dtype=torch.bool, device=theta.device)
    tiny = torch.finfo(theta.dtype).tiny
    wanted = theta[:, -k:].flip(1)
    spread = (theta[:, -1] - theta[:, 0] + residual[:, -1] + residual[:, 0])[:, None].clamp_min(tiny)
    distance = (wanted[:, :, None] - theta[:, None, :]).abs() - residual[:, None, :]
    own = torch.arange(theta.shape[1] - 1, theta.shape[1] - k - 1, -1, device=theta.device)
    distance[:, torch.arange(k, device=theta.device), own] = float("inf")
    gap = torch.maximum(distance.amin(dim=2), tolerance)
    needed = (2 * n**0.5 / failure_probability) * (spread / tolerance.clamp_min(tiny)).sqrt()
    reached = degree * torch.acosh(1 + 2 * gap / spread)
    return (reached >= torch.acosh(needed.clamp_min(1))).all(dim=1)


def _resolves_past_wanted(theta: Tensor, residual: Tensor, k: int, negligible: Tensor) -> Tensor:
    """Whether the Krylov space has resolved the first Ritz pair past the ``k`` wanted ones (B,): its
    residual is at most half its distance to the k-th wanted value, or ``negligible`` (B,) (it has converged
    itself, as an exactly repeated eigenvalue does).

    Without it a space whose wanted values converged first, a warm vector that is an eigenvector of the
    second eigenvalue, or a few steps that have not yet separated a cluster, would be accepted while the
    random part of the space still holds an unresolved value next to them: the one that would have moved
    above them.
    """
    if theta.shape[1] <= k:
        return torch.zeros(theta.shape[0], dtype=torch.bool, device=theta.device)
    below = theta[:, -k - 1]
    return residual[:, -k - 1] <= torch.maximum((theta[:, -k] - below) / 2, negligible)


def as_symmetric_tensor(matrices: Tensor) -> Tensor:
    if not isinstance(matrices, Tensor) or matrices.ndim != 3 or matrices.shape[1] != matrices.shape[2]:
        shape = tuple(matrices.shape) if isinstance(matrices, Tensor) else type(matrices).__name__
        raise ValueError(f"op must be a BatchedOperator or a (B, n, n) symmetric tensor, got {shape}")
    return matrices


def top_singular(
    matrices: BatchedOperator | Tensor,
    k: int = 1,
    *,
    block_size: int | None = None,
    tol: float = 1e-4,
    max_iters: int = 60,
    init: Tensor | None = None,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    return_vectors: bool | Literal["left", "right"] = True,
    criterion: StopCriterion = "residual",
    relative_to: RelativeTo = "largest",
    failure_probability: float | None = None,
) -> SingularResult:
    """The ``k`` largest singular triplets of a batch of (possibly rectangular) matrices ``(B, m, n)``.

    Block Lanczos on the Gram operator (AᵀA or AAᵀ, whichever is smaller); ``init`` holds earlier right
    singular vectors (B, n, r) for a warm start. Tolerance is on the Gram operator's Ritz residual, relative
    to σ₁² (``criterion``, ``relative_to`` and ``failure_probability`` as :func:`lanczos_eigsh` has them, on
    σᵢ²). ``return_vectors``
    says which singular vectors to return (``True``: both, as scipy's ``svds``):
    the Gram operator's own side comes free, the other costs one more product.
    """
    if return_vectors not in (True, False, "left", "right"):
        raise ValueError(f"return_vectors must be True, False, 'left' or 'right', got {return_vectors!r}")
    op = as_operator(matrices)
    gram = GramOperator(op)
    work = working_dtype(op.dtype, dtype)
    side_init = None
    if init is not None:
        side_init = init if gram.side == "right" else _other_side(op, init, work)
    result = lanczos_eigsh(
        gram,
        k,
        block_size=block_size,
        tol=tol,
        max_iters=max_iters,
        init=side_init,
        generator=generator,
        dtype=work,
        criterion=criterion,
        relative_to=relative_to,
        failure_probability=failure_probability,
    )
    sigma = result.values.clamp_min(0).sqrt()
    safe = torch.where(sigma > 0, sigma, torch.ones_like(sigma))[:, None, :]
    wants_left, wants_right = return_vectors in (True, "left"), return_vectors in (True, "right")
    left = right = None
    if gram.side == "right":
        right = result.vectors
        if wants_left:
            left = op.matmat(right.to(op.dtype)).to(work) / safe
    else:
        left = result.vectors
        if wants_right:
            right = op.rmatmat(left.to(op.dtype)).to(work) / safe
    return SingularResult(
        values=sigma,
        left=left if wants_left else None,
        right=right if wants_right else None,
        info=result.info,
    )


def _other_side(op: BatchedOperator, right: Tensor, work: torch.dtype) -> Tensor:
    """Left vectors from right ones (A v), for warm-starting the Gram operator on the smaller side."""
    return op.matmat(right.to(op.dtype)).to(work)

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
distance to them, or converged itself); and, with ``failure_probability`` p, that no eigenvalue the space
missed lies above the answer, except with probability p over the random start
(:func:`~spectral_monitor.linalg.lanczos_certificate.judge`). For the top value of a single-vector run
(one operator, one start vector) that is gap-free: the Krylov space's Christoffel function bounds the
start's component along every eigenvector τ₁ or more above θ₁
(:func:`~spectral_monitor.linalg.lanczos_certificate.hidden_component`), so λ_max ∈ [θ₁, θ₁ + τ₁] whatever
the rest of the spectrum, under an assumption on the products' rounding (below ``ROUNDING_FLOOR`` units of
the largest product). For the values below it, and for block runs, a Krylov polynomial of high enough
degree that an eigenvalue δ or more above θ would have pulled a Ritz value to it (the Kaniel–Paige–Saad
bound).

When it can still fail. A Krylov method sees nothing of an eigenvector orthogonal to its start space: the
guarantee is over the random start, not over the operator. A Gaussian start has a component below p/√(2n/π)
along a fixed eigenvector with probability at most p (a mixed warm start, half that;
:func:`~spectral_monitor.linalg.lanczos_certificate.start_certainty`); both tests are sized for that. The
degree test covers an unseen eigenvalue δ or more above θ; one closer than δ is excluded only by the Ritz
intervals (an unsplit cluster shows there as a wide interval next to θ, which shrinks δ, but nothing proves it
must). The spread of the spectrum in that test is the Ritz values' span (widened by the end residuals), which
underestimates the true spread until the far end has converged, so the test can be optimistic early. Without
``failure_probability`` only the first two tests apply: a cluster the space has not yet split (1% apart, say)
can then pass as one eigenvalue. Exactly repeated eigenvalues need a block at least as wide as the
multiplicity. Products are formed in the operator's dtype; in float32 a residual cannot fall much below
float32 rounding of the largest |θ|.

Warm starts. ``init_mode="prepend"``: previous Ritz vectors are put in front of a random block of the cold
width; the warm Krylov space contains the cold one at every iteration, so by the min-max principle its
extreme Ritz values are at least as accurate as a cold start's after the same number of iterations.
``init_mode="mix"``: each warm vector is added to a random start vector (those sharing one as a unit
vector along their sum), so a single-vector Lanczos keeps its width and every start vector keeps a random
component along every eigenvector (the certificate's threshold on it is halved, since the start's norm may
double). Either way the answer is accepted only by the same test as a cold one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from spectral_monitor.linalg.krylov_basis import BlockTridiagonal, GrowingRows, orthonormal_rows
from spectral_monitor.linalg.lanczos_certificate import (
    CERTAINTY,
    ROUNDING_FLOOR,
    LanczosRecurrence,
    StopCriterion,
    least_degree,
    start_certainty,
    stop_test,
)
from spectral_monitor.linalg.operators import (
    BatchedOperator,
    DenseOperator,
    GramOperator,
    as_operator,
    gaussian,
    working_dtype,
)

Which = Literal["largest", "smallest"]
STOP_CRITERIA = ("residual", "eigenvalue")
RelativeTo = Literal["largest", "each"]
RELATIVE_TO = ("largest", "each")
InitMode = Literal["prepend", "mix"]
INIT_MODES = ("prepend", "mix")
INITIAL_BASIS_BLOCKS = 12
"""Blocks the Lanczos basis has room for before it grows: about what σ₁, σ₂ of softmax attention take."""


@dataclass
class ConvergenceInfo:
    """How an iterative estimate converged, per batch element.

    Attributes:
        iterations: (B,) long, the block iterations each element used.
        residual: (B, k) Ritz residual norms ‖Op y − θ y‖ of the returned pairs, relative to max |θ|; NaN
            where a product was non-finite.
        converged: (B,) bool, every returned pair passed the test of :func:`lanczos_eigsh` (or the space
            was exhausted, which makes the answer exact).
        products: Operator-vector products spent on the whole batch (one block product of width b counts b
            per element).
        out_of_budget: (B,) bool, the element stopped before ``max_iters`` because the certificate needs a
            Krylov degree beyond it (not converged; its values are the best the space held); ``None`` where
            the solver does not say.

    Examples:
        >>> import torch
        >>> info = lanczos_eigsh(torch.eye(3)[None], generator=torch.Generator().manual_seed(0)).info
        >>> info.converged, info.out_of_budget, info.products
        (tensor([True]), tensor([False]), 3)
    """

    iterations: Tensor
    residual: Tensor
    converged: Tensor
    products: int
    out_of_budget: Tensor | None = None


@dataclass
class EigenResult:
    """Extreme eigenpairs of a batch of symmetric operators.

    Attributes:
        values: (B, k) eigenvalues, the most extreme first (descending for ``"largest"``, ascending for
            ``"smallest"``); NaN where a product was non-finite.
        vectors: (B, n, k) orthonormal eigenvectors, column i for ``values[:, i]`` (each up to sign).
        info: How each element converged.

    Examples:
        >>> import torch
        >>> matrix = torch.diag(torch.tensor([1.0, 3.0, 2.0]))[None]
        >>> result = lanczos_eigsh(matrix, generator=torch.Generator())
        >>> result.values.round(decimals=4), result.vectors[0, :, 0].abs().round(decimals=4)
        (tensor([[3.]]), tensor([0., 1., 0.]))
    """

    values: Tensor
    vectors: Tensor
    info: ConvergenceInfo


@dataclass
class SingularResult:
    """Top singular triplets of a batch of (B, m, n) matrices.

    Attributes:
        values: (B, k) singular values σ₁ ≥ … ≥ σₖ ≥ 0.
        left: (B, m, k) left singular vectors, or ``None`` where :func:`top_singular`'s ``return_vectors``
            did not ask for them.
        right: (B, n, k) right singular vectors, or ``None`` likewise. A pair's signs are arbitrary but
            consistent: A vᵢ = σᵢ uᵢ.
        info: How the Lanczos iteration on the Gram operator converged (its residuals relative to σ₁²).

    Examples:
        >>> import torch
        >>> result = top_singular(torch.full((1, 4, 4), 0.25), generator=torch.Generator().manual_seed(0))
        >>> result.values, result.right[0, :, 0].abs()
        (tensor([[1.]]), tensor([0.5000, 0.5000, 0.5000, 0.5000]))
    """

    values: Tensor
    left: Tensor | None
    right: Tensor | None
    info: ConvergenceInfo


def fresh_generator() -> torch.Generator:
    """A private CPU generator with a seed of its own (from the operating system), so a solver that was not
    given one starts from a new random block at every call and never consumes the user's global RNG stream.

    Returns:
        A new ``torch.Generator`` on the CPU, seeded.

    Examples:
        >>> import torch
        >>> state = torch.random.get_rng_state()
        >>> _ = torch.randn(2, generator=fresh_generator())
        >>> torch.equal(state, torch.random.get_rng_state())
        True
    """
    generator = torch.Generator()
    generator.seed()
    return generator


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
    failure_probability: float | None = CERTAINTY,
) -> EigenResult:
    """The ``k`` largest- (or smallest-) algebraic eigenpairs of a batch of symmetric operators.

    Block Lanczos with full reorthogonalisation. A batch element stops when every wanted Ritz pair meets
    ``tol`` by ``criterion`` and the space has resolved the Ritz pair past them (the module docstring says
    what that guarantees and assumes). An element whose product is non-finite stops with NaN values, not
    converged; ``info`` says what each element reached (``converged`` False where the cap came first).

    Args:
        op: A symmetric operator, or a (B, n, n) tensor taken to be symmetric (only its shape is checked).
        k: How many eigenpairs, in [1, n].
        which: ``"largest"`` or ``"smallest"`` algebraic eigenvalues (right for indefinite operators).
        block_size: The block width, at least 1 (at most n is used); ``None`` for max(2k, 4). A width below
            ``k`` is allowed: single-vector Lanczos needs the fewest products when exact multiplicities are
            not expected; exactly repeated eigenvalues need a width at least the multiplicity.
        tol: The relative tolerance, > 0.
        max_iters: The cap on block iterations, ≥ 1; (width + warm vectors) · ``max_iters`` must reach k.
        init: (B, n, r) earlier vectors to warm-start from, as ``init_mode`` says, or ``None``.
        generator: Draws the random start (and filler directions); ``None`` for :func:`fresh_generator`.
        dtype: The dtype of the basis and the results; ``None`` for the operator's (at least float32).
            Products are formed in the operator's own dtype.
        criterion: ``"residual"``: the Ritz residual r (an eigenvalue lies within r of θ: a bound on the
            error, usually far above it); ``"eigenvalue"``: the Kato–Temple error min(r, r²/δ), δ the gap to
            the nearest other Ritz interval.
        relative_to: ``"largest"`` judges every wanted pair against max|θ|; ``"each"`` against its own |θᵢ|
            (floored at ``EACH_FLOOR`` · max|θ|, where float rounding of the products, not θ, sets the scale
            an error can reach). Either way never below ``ROUNDING_FLOOR`` units of the operator dtype's
            rounding times the largest product norm seen.
        init_mode: ``"prepend"`` or ``"mix"`` (the module docstring says what each keeps).
        failure_probability: p in (0, 1) of the test that no eigenvalue above the answer was missed, which
            makes a cluster the space has not split, or a warm vector that is an eigenvector of a lower
            eigenvalue, cost products instead of accuracy; ``None`` for the first two tests only.

    Returns:
        The :class:`EigenResult`, values and vectors in ``dtype``.

    Raises:
        ValueError: ``op`` is neither an operator nor a (B, n, n) tensor, or is not symmetric; ``which``,
            ``criterion``, ``relative_to`` or ``init_mode`` is none of its choices; ``k``, ``tol``,
            ``max_iters``, ``block_size`` or ``failure_probability`` is out of range, or the budget cannot
            reach ``k``; ``init`` is not of shape (B, n, r).

    Examples:
        The two largest and the smallest eigenvalue of diag(1, …, 6):

        >>> import torch
        >>> matrix = torch.diag(torch.arange(1.0, 7.0, dtype=torch.float64))[None]
        >>> top = lanczos_eigsh(matrix, k=2, generator=torch.Generator().manual_seed(0))
        >>> top.values.round(decimals=6), top.info.converged
        (tensor([[6., 5.]], dtype=torch.float64), tensor([True]))
        >>> bottom = lanczos_eigsh(matrix, which="smallest", block_size=1, generator=torch.Generator())
        >>> bottom.values.round(decimals=6)
        tensor([[1.]], dtype=torch.float64)
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
    generator = generator if generator is not None else fresh_generator()
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

    rounding = torch.finfo(op.dtype if op.dtype.is_floating_point else work).eps
    mixed = init is not None and init_mode == "mix"
    certainty = None if failure_probability is None else start_certainty(n, failure_probability, mixed=mixed)
    if batch == 1 and start.shape[2] == 1:
        return _single_vector_lanczos(
            op,
            start[0, :, 0],
            k=k,
            sign=sign,
            tol=tol,
            max_iters=max_iters,
            generator=generator,
            criterion=criterion,
            relative_to=relative_to,
            certainty=certainty,
            rounding=rounding,
        )

    # Blocks and the basis are kept as rows (B, b, n): a product with the transpose of a (B, n, k) basis
    # read it with a stride, and full reorthogonalisation reads the whole basis twice a block, so rows keep
    # it contiguous. Operators see (B, n, b) views.
    def apply(active_op: BatchedOperator, rows: Tensor) -> Tensor:
        y = active_op.matmat(rows.mT.to(active_op.dtype)).to(work).mT.contiguous()
        return y if sign > 0 else -y

    values = torch.full((batch, k), float("nan"), dtype=work, device=op.device)
    vectors = torch.zeros((batch, n, k), dtype=work, device=op.device)
    residual = torch.full((batch, k), float("inf"), dtype=work, device=op.device)
    iterations = torch.zeros(batch, dtype=torch.long, device=op.device)
    converged = torch.zeros(batch, dtype=torch.bool, device=op.device)
    out_of_budget = torch.zeros(batch, dtype=torch.bool, device=op.device)
    products = 0

    active = torch.arange(batch, device=op.device)
    settled = torch.zeros(batch, dtype=torch.bool, device=op.device)
    active_op = op
    scale = torch.zeros(batch, dtype=work, device=op.device)
    q, _ = orthonormal_rows(start.mT, None, torch.ones(batch, dtype=work, device=op.device), generator)
    basis = GrowingRows(q, min(n, q.shape[1] * min(max_iters, INITIAL_BASIS_BLOCKS)))
    coupling: Tensor | None = None
    projected = BlockTridiagonal(batch, basis.capacity, work, op.device)
    undecided = torch.zeros(batch, dtype=torch.bool, device=op.device)
    # The certificate cannot pass below this degree (the gap is at most the spread and the tolerance at most
    # the spread), so the small eigenproblem is not solved before it.
    next_check = 1 if certainty is None else 1 + int(least_degree(certainty))

    for iteration in range(1, max_iters + 1):
        w = apply(active_op, q)
        products += q.shape[1] * active.numel()
        # A non-finite product (a NaN in a Hessian, a poisoned matrix) ends that element with NaN values;
        # zeroing its block, at every iteration it stays in the batch, keeps the batched small eigenproblems
        # finite for the others.
        norms = w.norm(dim=2).amax(dim=1)
        if not math.isfinite(float(norms.sum())):
            non_finite = ~torch.isfinite(norms)
            broken = non_finite & ~settled
            w = torch.where(non_finite[:, None, None], torch.zeros_like(w), w)
            norms = torch.where(non_finite, torch.zeros_like(norms), norms)
            done = active[broken]
            residual[done] = float("nan")
            iterations[done] = iteration
            settled = settled | broken
            if bool(settled.all()):
                break
        scale = torch.maximum(scale, norms)
        # Classical Gram–Schmidt against the whole basis, twice (Kahan–Parlett: one pass loses orthogonality
        # in float32): the current block is the basis's last rows, so the first pass's coefficients on it
        # are the diagonal block of the projected matrix, and the three-term recurrence's own subtractions
        # are part of the pass instead of a step before it.
        rows = basis.rows
        coefficients = w @ rows.mT
        alpha = coefficients[:, :, -q.shape[1] :]
        alpha = (alpha + alpha.mT) / 2
        w = torch.baddbmm(w, coefficients, rows, alpha=-1)
        w = torch.baddbmm(w, w @ rows.mT, rows, alpha=-1)
        room = n - basis.count
        if room >= w.shape[1]:
            next_q, next_coupling = orthonormal_rows(w, rows, scale, generator)
        else:
            # The last block fits only ``room`` more directions; the residual lies in them (rank <= room).
            next_q = torch.linalg.svd(w.mT, full_matrices=False).U[:, :, : max(room, 0)].mT.contiguous()
            next_coupling = next_q @ w.mT

        width_now = q.shape[1]
        projected.extend(alpha, coupling)
        tridiagonal = projected.matrix
        exhausted = room <= 0
        last = exhausted or iteration == max_iters
        if tridiagonal.shape[1] < k or (iteration < next_check and not last):
            # Not yet k Ritz values, or a degree the certificate cannot pass at: every party sharing the
            # operator still takes this iteration's (negative) decision, so collectives stay in step.
            active_op.agreed(undecided)
            q, coupling = next_q, next_coupling
            basis.append(next_q)
            continue

        theta, ritz = (t.to(work) for t in torch.linalg.eigh(tridiagonal.double()))
        wanted_theta = theta[:, -k:].flip(1)
        wanted_vectors = ritz[:, :, -k:].flip(2)
        every_residual = (next_coupling @ ritz[:, -width_now:, :]).norm(dim=1)
        test = stop_test(
            theta.detach().cpu().numpy(),
            every_residual.detach().cpu().numpy(),
            k=k,
            tol=tol,
            relative_to=relative_to,
            criterion=criterion,
            rounding=rounding,
            scale=scale.detach().cpu().numpy(),
            degree=iteration - 1,
            certainty=certainty,
            last=last,
        )
        if test.verdict is None:
            active_op.agreed(undecided)
            q, coupling = next_q, next_coupling
            basis.append(next_q)
            continue
        verdict_met = torch.from_numpy(test.verdict.met).to(op.device)
        least = torch.from_numpy(test.verdict.least_degree).to(op.device)
        # Every product exactly zero: the random start lies in the operator's null space, which for a
        # non-zero operator has probability zero.
        met = active_op.agreed(verdict_met | (scale == 0))
        # The budget is short only if it also cannot exhaust the space (which makes the answer exact).
        exhaustible = iteration + -(-room // max(next_q.shape[1], 1)) <= max_iters
        unreachable = ~met & (least > max_iters - 1) & (not exhausted and not exhaustible)
        finishing = (met | unreachable | last) & ~settled

        if bool(finishing.any()):
            done = active[finishing]
            values[done] = sign * wanted_theta[finishing]
            vectors[done] = basis.rows[finishing].mT @ wanted_vectors[finishing]
            residual[done] = torch.from_numpy(test.relative_residual).to(op.device)[finishing]
            iterations[done] = iteration
            converged[done] = met[finishing] | exhausted
            out_of_budget[done] = unreachable[finishing]
            settled = settled | finishing
        if bool(settled.all()):
            break
        if certainty is not None:
            waiting = least[~settled]
            next_check = iteration + 1
            if waiting.numel():
                next_check = max(next_check, 1 + int(waiting.min().ceil()))

        q, coupling = next_q, next_coupling
        basis.append(next_q)
        remaining = ~settled
        if bool(settled.any()):
            restricted = active_op.restrict(remaining.nonzero().squeeze(1))
            if restricted is not None:
                active_op = restricted
                active, q, coupling = active[remaining], q[remaining], coupling[remaining]
                basis.keep(remaining)
                projected.keep(remaining)
                scale, settled = scale[remaining], settled[remaining]
                undecided = undecided[remaining]

    info = ConvergenceInfo(
        iterations=iterations,
        residual=residual,
        converged=converged,
        products=products,
        out_of_budget=out_of_budget,
    )
    return EigenResult(values=values, vectors=vectors, info=info)


def _single_vector_lanczos(
    op: BatchedOperator,
    start: Tensor,
    *,
    k: int,
    sign: float,
    tol: float,
    max_iters: int,
    generator: torch.Generator,
    criterion: StopCriterion,
    relative_to: str,
    certainty: float | None,
    rounding: float,
) -> EigenResult:
    """:func:`lanczos_eigsh` for one operator and one start vector (n,): the same iteration, basis and stop
    test as the block loop there, with the three-term recurrence's scalars kept as Python floats and the
    small eigenproblem and its test in numpy. On a cheap operator (the Hessian of a small network) the block
    loop's bookkeeping on (1, 1, n) tensors would cost as much as the products; on the CPU the vectors are
    numpy views of the basis's storage as well, since a numpy call on a vector this short costs a fraction of
    a torch one."""
    n, work, device = op.cols, start.dtype, op.device
    as_array = _host_view if device.type == "cpu" else _same
    unit = torch.ones(1, dtype=work, device=device)
    first, _ = orthonormal_rows(start.view(1, 1, n), None, unit, generator)
    basis = GrowingRows(first, min(n, INITIAL_BASIS_BLOCKS))
    products, scale = 0, 0.0
    diagonal: list[float] = []
    off_diagonal: list[float] = []
    # Each stop decision goes to every party of the operator (op.agreed), refused ones included.
    decision = torch.zeros(1, dtype=torch.bool, device=device)
    # The projected tridiagonal matrix, written entry by entry into room that grows with the basis.
    tridiagonal = np.zeros((basis.capacity, basis.capacity))
    threshold_per_scale = 10 * n**0.5 * torch.finfo(work).eps
    # The start-component route of the certificate has no degree below which it must fail (a spectrum
    # concentrated on a few values lets it pass at once), so the test runs once there are k + 1 Ritz values.
    next_check = k + 1
    departures: list[float] = []
    # Every basis vector so far is a polynomial of the operator applied to the start: the gap-free route's
    # premise, tracked only where a certificate is asked for.
    polynomial = certainty is not None
    values = torch.full((1, k), float("nan"), dtype=work, device=device)
    vectors = torch.zeros((1, n, k), dtype=work, device=device)
    residual = torch.full((1, k), float("inf"), dtype=work, device=device)
    iterations, converged, out_of_budget = 0, False, False

    for iteration in range(1, max_iters + 1):
        basis_rows = basis.rows[0]
        product = op.matmat(basis_rows[-1].view(1, n, 1).to(op.dtype))[0, :, 0].to(work)
        rows, w = as_array(basis_rows), as_array(product if sign > 0 else -product)
        products += 1
        norm = _norm(w)
        if not math.isfinite(norm):  # a NaN in the operator: NaN values, not converged
            residual[:] = float("nan")
            iterations = iteration
            break
        scale = max(scale, norm)
        # Classical Gram–Schmidt against the whole basis, twice, as in the block loop; the first pass's
        # coefficient on the last row is the diagonal entry.
        coefficients = rows @ w
        diagonal.append(float(coefficients[-1]))
        size = len(diagonal)
        if size > tridiagonal.shape[0]:
            grown = np.zeros((basis.capacity, basis.capacity))
            grown[: size - 1, : size - 1] = tridiagonal[: size - 1, : size - 1]
            tridiagonal = grown
        tridiagonal[size - 1, size - 1] = diagonal[-1]
        if off_diagonal:
            tridiagonal[size - 1, size - 2] = tridiagonal[size - 2, size - 1] = off_diagonal[-1]
        w = w - rows.T @ coefficients
        correction = rows @ w
        w = w - rows.T @ correction
        if polynomial:
            # What the three-term recurrence does not record (coefficients on older rows, the second pass's,
            # the first pass's on the row before differing from its β), and the products' own rounding.
            older = coefficients[:-2]
            behind = float(coefficients[-2]) - off_diagonal[-1] if off_diagonal else 0.0
            departure = float(older @ older) + behind * behind + float(correction @ correction)
            departures.append(math.sqrt(departure) + ROUNDING_FLOOR * rounding * scale)
        room = n - basis.count
        coupling, next_row = 0.0, None
        if room > 0:
            coupling = _norm(w)
            if coupling > threshold_per_scale * scale:
                next_row = _tensor(w / coupling).view(1, 1, n)
            else:  # an invariant Krylov space: a random direction orthogonal to it, as in the block loop
                scales = torch.full((1,), scale, dtype=work, device=device)
                next_row, filler_coupling = orthonormal_rows(
                    _tensor(w).view(1, 1, n), basis_rows[None], scales, generator
                )
                coupling = float(filler_coupling)
                polynomial = False
        exhausted = room <= 0
        last = exhausted or iteration == max_iters
        if len(diagonal) < k or (iteration < next_check and not last):
            op.agreed(decision.fill_(False))
            basis.append(next_row)
            off_diagonal.append(coupling)
            continue

        theta, ritz = np.linalg.eigh(tridiagonal[:size, :size])
        recurrence = None
        if polynomial and coupling > 0:
            recurrence = LanczosRecurrence(
                np.array([diagonal]), np.array([[*off_diagonal, coupling]]), np.array([departures])
            )
        test = stop_test(
            theta[None],
            np.abs(coupling * ritz[-1])[None],
            k=k,
            tol=tol,
            relative_to=relative_to,
            criterion=criterion,
            rounding=rounding,
            scale=np.array([scale]),
            degree=iteration - 1,
            certainty=certainty,
            last=last,
            recurrence=recurrence,
        )
        verdict = test.verdict
        # Every product exactly zero: the random start lies in the operator's null space (probability zero).
        met_here = (verdict is not None and bool(verdict.met[0])) or scale == 0
        decision.fill_(met_here)
        met = bool(op.agreed(decision)[0])
        # The budget is short only if it also cannot exhaust the space (which makes the answer exact).
        least = 0.0 if verdict is None else float(verdict.least_degree[0])
        unreachable = not met and least > max_iters - 1 and not (exhausted or iteration + room <= max_iters)
        if met or unreachable or last:
            wanted = ritz[:, -k:][:, ::-1]
            values[0] = torch.from_numpy(sign * theta[-k:][::-1].copy())
            vectors[0] = basis_rows.mT @ torch.from_numpy(wanted.copy()).to(device=device, dtype=work)
            residual[0] = torch.from_numpy(test.relative_residual[0])
            iterations, converged, out_of_budget = iteration, met or exhausted, unreachable
            break
        if certainty is not None:
            next_check = max(iteration + 1, 1 + math.ceil(least))
        basis.append(next_row)
        off_diagonal.append(coupling)

    info = ConvergenceInfo(
        iterations=torch.tensor([iterations], device=device),
        residual=residual,
        converged=torch.tensor([converged], device=device),
        products=products,
        out_of_budget=torch.tensor([out_of_budget], device=device),
    )
    return EigenResult(values=values, vectors=vectors, info=info)


def _host_view(tensor: Tensor) -> np.ndarray:
    return tensor.detach().numpy()


def _same(tensor: Tensor) -> Tensor:
    return tensor


def _tensor(vector: np.ndarray | Tensor) -> Tensor:
    return torch.from_numpy(vector) if isinstance(vector, np.ndarray) else vector


def _norm(vector: np.ndarray | Tensor) -> float:
    """‖v‖₂ as a float: one dot product; where the sum of squares overflows, torch's norm, which scales."""
    norm = math.sqrt(float(vector @ vector))
    return norm if math.isfinite(norm) else float(torch.linalg.vector_norm(_tensor(vector)))


def _mixed_start(warm: Tensor, fresh: Tensor) -> Tensor:
    """The start block (B, n, b) of a ``"mix"`` warm start: each column of ``fresh`` (random) normalised,
    plus a unit vector along the sum of the normalised warm vectors dealt to it (warm vector j to column
    j mod b), so every start vector has norm at most 2, as the certificate's threshold assumes
    (:func:`~spectral_monitor.linalg.lanczos_certificate.start_certainty`)."""
    unit = torch.finfo(fresh.dtype).tiny
    start = fresh / fresh.norm(dim=1, keepdim=True).clamp_min(unit)
    warm = warm / warm.norm(dim=1, keepdim=True).clamp_min(unit)
    dealt = torch.zeros_like(start)
    for column in range(warm.shape[2]):
        dealt[:, :, column % start.shape[2]] += warm[:, :, column]
    return start + dealt / dealt.norm(dim=1, keepdim=True).clamp_min(unit)


def as_symmetric_tensor(matrices: Tensor) -> Tensor:
    """``matrices`` as :func:`lanczos_eigsh` takes a tensor: square matrices, taken to be symmetric.

    Args:
        matrices: (B, n, n) matrices; their symmetry is not checked.

    Returns:
        ``matrices`` itself.

    Raises:
        ValueError: ``matrices`` is not a tensor of shape (B, n, n).

    Examples:
        >>> import torch
        >>> as_symmetric_tensor(torch.eye(2)[None]).shape
        torch.Size([1, 2, 2])
    """
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

    Block Lanczos on the Gram operator (AᵀA or AAᵀ, whichever is smaller), its eigenvalues σᵢ². The
    Gram operator's own side of singular vectors comes free, the other costs one more product.

    Args:
        matrices: A (B, m, n) tensor, or an operator with both products (``matmat`` and ``rmatmat``).
        k: How many triplets, in [1, min(m, n)].
        block_size: As :func:`lanczos_eigsh` has it.
        tol: The tolerance on the Gram operator's Ritz residual, relative to σ₁² (as ``relative_to`` says).
        max_iters: The cap on block iterations.
        init: (B, n, r) earlier right singular vectors to warm-start from (prepended), or ``None``.
        generator: As :func:`lanczos_eigsh` has it.
        dtype: The dtype of the results; ``None`` for the operator's (at least float32).
        return_vectors: ``True`` for both sides (as scipy's ``svds``), ``"left"`` or ``"right"`` for one,
            ``False`` for none.
        criterion: As :func:`lanczos_eigsh` has it, on σᵢ².
        relative_to: As :func:`lanczos_eigsh` has it, on σᵢ².
        failure_probability: As :func:`lanczos_eigsh` has it; ``None`` (no degree test) by default here.

    Returns:
        The :class:`SingularResult`. Where σᵢ = 0 the column of the side computed by a product is that
        product (zero), not a unit vector.

    Raises:
        ValueError: ``return_vectors`` is none of its choices, and as :func:`lanczos_eigsh` raises.

    Examples:
        A 2 × 3 matrix with singular values 3 and 2:

        >>> import torch
        >>> matrix = torch.tensor([[[3.0, 0.0, 0.0], [0.0, 2.0, 0.0]]], dtype=torch.float64)
        >>> result = top_singular(matrix, k=2, return_vectors="right", generator=torch.Generator())
        >>> result.values.round(decimals=6), result.left is None, result.right.shape
        (tensor([[3., 2.]], dtype=torch.float64), True, torch.Size([1, 3, 2]))
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

"""The Krylov path of the attention metrics: σ₁, σ₂, |λ₂| and the rank sums of matrices known by products.

Block Lanczos on the Gram operator gives σ₁ and σ₂ (warm-started from a :class:`KrylovState`), a block
Arnoldi iteration on the deflated matrix riding in the same sweeps gives |λ₂|, and stochastic Lanczos
quadrature with the top pair deflated gives Σσ and Σσ log σ, hence the effective rank, with its standard
error. Each matrix is touched a few dozen times instead of being factorised. The operator is a dense batch
(:func:`~spectral_monitor.metrics.attention_metrics`) or blocked products from q and k
(:func:`~spectral_monitor.metrics.attention_metrics_from_qk`); the definitions the estimates converge to are
those of the exact path.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch
from torch import Tensor

from spectral_monitor.linalg import (
    BatchedOperator,
    GramOperator,
    ProjectedOperator,
    lanczos_eigsh,
    top_singular,
)
from spectral_monitor.linalg.draws import independent_seeds
from spectral_monitor.linalg.krylov_basis import GrowingRows, orthonormal_rows, reorthogonalise
from spectral_monitor.linalg.lanczos_certificate import EACH_FLOOR
from spectral_monitor.linalg.operators import Passenger, gaussian
from spectral_monitor.metrics._common import has_eigen_gap
from spectral_monitor.metrics.attention_rank_sums import rank_sums

__all__ = ["KrylovState", "krylov_spectral_metrics"]

SINGULAR_BLOCK = 4
"""Block width of the σ₁, σ₂ Lanczos. σ₂ of softmax attention sits at the edge of a dense bulk, where every
width needs about the same number of products to resolve it, so narrow blocks waste fewest products
(benchmarks/README.md, "Measurements behind the attention metrics' defaults")."""
ARNOLDI_WIDTH = 4
SINGULAR_TOL = 1e-3
"""Estimated error of each of σ₁², σ₂² relative to itself (``criterion="eigenvalue"``, ``relative_to="each"``
of :func:`~spectral_monitor.linalg.lanczos_eigsh`) at which a cold start stops. Judged against itself, the
small σ₂ of attention with a sink (σ₂² ≈ 2e-3 σ₁²) is resolved to its own accuracy, which a residual
relative to σ₁² would not do. From a cold start the estimate is pessimistic: the σ₂ it leaves is well
within the tolerance (benchmarks/README.md)."""
WARM_SINGULAR_TOL = 1e-4
"""The same, warm-started, where the estimate is optimistic: the random half of a warm block makes the Ritz
gap look wider than it is, so a looser tolerance stops after one block with σ₂ off by more than it
(benchmarks/README.md)."""
DEFLATED_TOL = 1e-4
"""The same for a σ₂ too small for the Gram operator (σ₂² under ``EACH_FLOOR`` of σ₁²), taken from the Gram
operator with σ₁'s direction projected out, without the degree test as σ₁, σ₂ themselves: within 3e-5 of
float64 on sink heads (σ₂/σ₁ near 1e-3) and near-uniform bidirectional attention at n = 512–2048, where
1e-3 left 1.5e-4 (benchmarks/README.md)."""
ARNOLDI_MAX_BLOCKS = 12
ARNOLDI_FIRST_CHECK = 6
ARNOLDI_CHECK_EVERY = 2
ARNOLDI_TOL = 3e-3
"""Change of the outermost Ritz modulus between checks at which |λ₂| is taken as converged (``eigen_gap``
is reported to 0.01): a tighter tolerance runs most matrices to ``ARNOLDI_MAX_BLOCKS`` for no reportable
gain (benchmarks/README.md)."""


@dataclass
class KrylovState:
    """Warm-start vectors of one stream of attention batches (e.g. one layer across logging steps).

    Pass the same object to successive :func:`~spectral_monitor.metrics.attention_metrics` (or
    :func:`~spectral_monitor.metrics.attention_metrics_from_qk`) calls; it is read and updated in place. A
    batch of another shape starts cold and replaces the vectors.

    Attributes:
        vectors: the top right singular vectors (B, m, 2) of the last batch, or ``None`` before the first.

    Examples:
        >>> import torch
        >>> from spectral_monitor.metrics import KrylovState, attention_metrics
        >>> state = KrylovState()
        >>> attn = torch.softmax(torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(0)), dim=-1)
        >>> first = attention_metrics(attn, method="krylov", include_rank_sums=False, state=state)
        >>> tuple(state.vectors.shape)
        (2, 64, 2)
    """

    vectors: Tensor | None = None


def krylov_spectral_metrics(
    operator: BatchedOperator,
    queries: Tensor,
    causal: bool,
    include_rank_sums: bool,
    frobenius_squared: Tensor,
    state: KrylovState | None,
    generator: torch.Generator | None,
    matrices: Tensor | None = None,
) -> dict[str, Tensor]:
    """σ₁, σ₂, eigen gap and (optionally) effective and threshold rank of a batch of attention operators.

    Args:
        operator: (B, n, m) row-stochastic matrices known through products only: a dense batch, or blocked
            products from q and k (:mod:`spectral_monitor.metrics.long_context`).
        queries: (B, n) bool, True = a valid query; the eigen gap's deflation weights only those rows.
        causal: the matrices are causal, so no eigen gap is measured (NaN).
        include_rank_sums: estimate the effective and threshold ranks (NaN otherwise).
        frobenius_squared: (B,) ‖A‖_F², from a pass over the matrices.
        state: warm-start vectors, read and updated in place; ``None`` starts cold and keeps nothing.
        generator: the source of every random draw; ``None`` = a private fixed-seed one.
        matrices: (B, n, m) the operator's matrices where it is a dense batch, else None: an element whose
            rank sums the quadrature cannot resolve is then factorised
            (:func:`~spectral_monitor.metrics.attention_rank_sums.rank_sums`).

    Returns:
        (B,) tensors ``sigma1``, ``sigma2``, ``eigen_gap``, ``effective_rank``, ``effective_rank_se`` and
        ``threshold_rank``, as :func:`~spectral_monitor.metrics.attention_metrics` defines them; and
        ``singular_values`` (B, min(n, m)) where the rank sums factorised every matrix.

    Examples:
        >>> import torch
        >>> from spectral_monitor.linalg.operators import DenseOperator
        >>> attention = torch.softmax(torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(0)), -1)
        >>> metrics = krylov_spectral_metrics(
        ...     DenseOperator(attention), torch.ones(2, 32, dtype=torch.bool), causal=False,
        ...     include_rank_sums=False, frobenius_squared=attention.square().sum(dim=(1, 2)), state=None,
        ...     generator=None,
        ... )
        >>> exact = torch.linalg.svdvals(attention.double())
        >>> bool(torch.allclose(metrics["sigma1"].double(), exact[:, 0], rtol=1e-3))
        True
        >>> bool(metrics["effective_rank"].isnan().all())  # rank sums not asked for
        True
    """
    # One generator per estimate, seeded from the caller's: how many random vectors one estimate draws (a
    # rank-one element needs filler directions) then cannot change another's draws for the other elements.
    singular_draws, arnoldi_draws, quadrature_draws = _independent_generators(generator, 3)
    warm = None
    if (
        state is not None
        and state.vectors is not None
        and state.vectors.shape[:2] == (operator.batch, operator.cols)
    ):
        warm = state.vectors
    # The Arnoldi iteration for |λ₂| rides in the Lanczos iteration's sweeps over A where the operator can
    # share them (a dense batch on the CPU), and finishes on its own products.
    arnoldi = None
    if has_eigen_gap(operator.rows, operator.cols, causal):
        arnoldi = Passenger(_second_eigenvalue_modulus(operator, queries, arnoldi_draws))
    top = top_singular(
        operator if arnoldi is None else operator.carrying(arnoldi),
        2,
        block_size=SINGULAR_BLOCK,
        tol=SINGULAR_TOL if warm is None else WARM_SINGULAR_TOL,
        init=warm,
        generator=singular_draws,
        return_vectors="right",
        criterion="eigenvalue",
        relative_to="each",
    )
    if warm is not None and not bool(top.values[frobenius_squared.isfinite()].isfinite().all()):
        # A warm start that gave NaN where the matrices are finite is retried cold, before anything reads it.
        top = top_singular(
            operator,
            2,
            block_size=SINGULAR_BLOCK,
            tol=SINGULAR_TOL,
            generator=singular_draws,
            return_vectors="right",
            criterion="eigenvalue",
            relative_to="each",
        )
    sigma, right = top.values, top.right
    unresolved = sigma[:, 1].square() < EACH_FLOOR * sigma[:, 0].square()
    if bool(unresolved.any()):
        sigma, right = sigma.clone(), right.clone()
        second, vector = _second_singular_deflated(
            operator, unresolved, sigma[:, 0], right[:, :, 0], singular_draws
        )
        sigma[unresolved, 1], right[unresolved, :, 1] = second, vector
    if state is not None:
        state.vectors = right
    metrics = {"sigma1": sigma[:, 0], "sigma2": sigma[:, 1]}
    if arnoldi is None:
        metrics["eigen_gap"] = torch.full_like(sigma[:, 0], float("nan"))
    else:
        metrics["eigen_gap"] = 1 - arnoldi.finish()
    nan = torch.full_like(sigma[:, 0], float("nan"))
    if include_rank_sums:
        metrics.update(
            rank_sums(operator, right, sigma, frobenius_squared, quadrature_draws, matrices=matrices)
        )
    else:
        metrics.update(effective_rank=nan, threshold_rank=nan, effective_rank_se=nan.clone())
    return metrics


def _second_singular_deflated(
    operator: BatchedOperator,
    elements: Tensor,
    sigma1: Tensor,
    first: Tensor,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """σ₂ and its right singular vector of the ``elements`` (B,) bool whose σ₂² the Gram solve could only
    resolve to ``EACH_FLOOR`` of σ₁² (an attention sink: σ₂/σ₁ near 1e-3), as the top eigenpair of the Gram
    operator with σ₁'s right vector ``first`` (B, n) projected out: P AᵀA P, P = I − v₁v₁ᵀ.

    On the Gram operator itself, float32 rounding of a product (about ε·σ₁²) is as large as σ₂², and the
    Ritz value read as σ₂² was noise, 10 times too small; projected, what σ₁'s direction contributes to a
    product's rounding is projected out with it, leaving about ε·σ₁σ₂, so σ₂ resolves to ``DEFLATED_TOL``.
    """
    index = elements.nonzero().squeeze(1)
    restricted = operator.restrict(index)
    base, rows = (operator, index) if restricted is None else (restricted, slice(None))
    gram = GramOperator(base)
    # The Gram operator's side: v₁ itself (AᵀA), or u₁ = A v₁ / σ₁ (AAᵀ, fewer rows than columns).
    chosen = (first if restricted is None else first[index])[:, :, None]
    if gram.side == "left":
        chosen = base.matmat(chosen)
    chosen = chosen / chosen.norm(dim=1, keepdim=True).clamp_min(torch.finfo(chosen.dtype).tiny)
    deflated = lanczos_eigsh(
        ProjectedOperator(gram, chosen), 1, block_size=SINGULAR_BLOCK, tol=DEFLATED_TOL, generator=generator,
        criterion="eigenvalue", relative_to="each", failure_probability=None,
    )  # fmt: skip
    second = deflated.values[rows, 0].clamp_min(0).sqrt()
    vector = deflated.vectors[rows, :, 0]
    if gram.side == "left":  # v₂ = Aᵀ u₂ / σ₂
        vector = base.rmatmat(deflated.vectors)[rows, :, 0]
        vector = vector / vector.norm(dim=1, keepdim=True).clamp_min(torch.finfo(vector.dtype).tiny)
    return second.to(sigma1.dtype), vector.to(first.dtype)


def _independent_generators(generator: torch.Generator | None, count: int) -> list[torch.Generator]:
    device = generator.device if generator is not None else torch.device("cpu")
    return [torch.Generator(device=device).manual_seed(seed) for seed in independent_seeds(generator, count)]


def _second_eigenvalue_modulus(
    operator: BatchedOperator, queries: Tensor, generator: torch.Generator
) -> Generator[tuple[BatchedOperator, Tensor], Tensor, Tensor]:
    """|λ₂| of row-stochastic A by block Arnoldi on the Wielandt deflation A − 1wᵀ (w = 1/n on valid rows),
    whose spectrum is A's with λ₁ = 1 replaced by 0; |λ₂| is then the outermost Ritz value's modulus.

    Narrow blocks, many of them: the Krylov degree is what resolves the outermost eigenvalue of a
    non-symmetric bulk, and a product with a narrow block streams A once as a wide one does
    (benchmarks/README.md). From block
    ``ARNOLDI_FIRST_CHECK`` on, an element is done when its outermost Ritz modulus moves less than
    ``ARNOLDI_TOL`` between checks ``ARNOLDI_CHECK_EVERY`` blocks apart.

    A :class:`~spectral_monitor.linalg.operators.Passenger`'s steps: it yields each product with A it needs.
    """
    batch, n, work, device = operator.batch, operator.rows, operator.dtype, operator.device
    ones = queries.to(work)
    weights = ones / ones.sum(dim=1, keepdim=True).clamp_min(1)
    width = min(ARNOLDI_WIDTH, n)
    max_blocks = max(1, min(ARNOLDI_MAX_BLOCKS, n // width))
    draw = gaussian((batch, n, width), dtype=work, device=device, generator=generator)
    scale = torch.ones(batch, dtype=work, device=device)
    first, _ = orthonormal_rows((draw * ones[:, :, None]).mT, None, scale, generator)
    moduli = torch.full((batch,), float("nan"), dtype=work, device=device)
    active = torch.arange(batch, device=device)
    previous: Tensor | None = None

    # The basis and its images are rows (B, k, n), as in lanczos_eigsh, which says why.
    def deflated(rows: Tensor, product: Tensor) -> Tensor:
        return (product - ones[:, :, None] * (weights[:, None, :] @ rows.mT)).mT.contiguous()

    basis = GrowingRows(first, width * max_blocks)
    images = GrowingRows(deflated(first, (yield operator, first.mT)), width * max_blocks)
    for blocks in range(1, max_blocks + 1):
        last = blocks == max_blocks
        due = blocks >= ARNOLDI_FIRST_CHECK and (blocks - ARNOLDI_FIRST_CHECK) % ARNOLDI_CHECK_EVERY == 0
        if due or last:
            outermost = torch.linalg.eigvals(basis.rows @ images.rows.mT).abs().amax(dim=1).to(work)
            finished = torch.full_like(outermost, last, dtype=torch.bool)
            if previous is not None:
                finished |= (outermost - previous).abs() <= ARNOLDI_TOL
            moduli[active[finished]] = outermost[finished]
            if bool(finished.all()):
                break
            previous = outermost
            going = (~finished).nonzero().squeeze(1)
            restricted = operator.restrict(going) if bool(finished.any()) else None
            if restricted is not None:
                operator = restricted
                basis.keep(going)
                images.keep(going)
                active, ones, weights, scale, previous = (
                    t[going] for t in (active, ones, weights, scale, previous)
                )
        known = basis.rows
        latest, _ = orthonormal_rows(reorthogonalise(images.rows[:, -width:], known), known, scale, generator)
        basis.append(latest)
        images.append(deflated(latest, (yield operator, latest.mT)))
    return moduli.clamp(max=1.0)

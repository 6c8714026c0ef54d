"""The rank sums of attention matrices known by products: Σσ and Σσ log σ, hence the effective rank and its
standard error, with the leading singular values known and the rest by stochastic Lanczos quadrature; where
the matrices themselves are at hand and the quadrature cannot reach its accuracy, by every singular value.

Gauss quadrature on AᵀA resolves the spectrum down to about λ₁/steps². Near-uniform attention (a freshly
initialised model's, and causal attention above all) keeps a fifth of Σσ in singular values below 1% of σ₁:
with only the top pair deflated the rules stop short of the truth and the probes' spread is wide, so no
number of rounds reaches the target, and the rounds read the effective rank low. Such attention is the
uniform matrix plus a perturbation of rank about the head dimension, so :func:`rank_sums` deflates the
leading Ritz pairs of a random subspace too, as many as their residuals allow
(:func:`_ritz_deflation`), and the quadrature is left a small tail it resolves in one round. The matrices,
when it has them, are factorised instead up to ``FACTORISE_FIRST_MAX_SIZE``, where that is about as cheap,
and where the quadrature still misses its target after ``FIRST_ROUNDS_BEFORE_EXACT`` rounds or float32
products cannot resolve the tail (``ROUNDING_MARGIN``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from spectral_monitor.linalg import BatchedOperator, GramOperator, lanczos_quadrature
from spectral_monitor.linalg.draws import independent_seeds
from spectral_monitor.linalg.operators import ProjectedOperator, gaussian, rademacher
from spectral_monitor.linalg.quadrature import QuadratureNodes
from spectral_monitor.metrics._common import (
    ENERGY_LEVEL,
    all_singular_values,
    effective_rank_from_singular_values,
    threshold_rank_from_singular_values,
)

__all__ = ["rank_sums"]

ERANK_QUADRATURE_RTOL = 0.004
"""Quadrature steps go on until the effective rank's estimated quadrature error is below this (relative)."""
EXTRAPOLATION_SAFETY = 2.0
"""The extrapolated effective rank's quadrature error is taken as this many times its last change: on
structured spectra (causal, attention sink, local band) the change alone underestimates the remaining
error."""
QUADRATURE_FIRST_CHECK = 8
QUADRATURE_CHECK_EVERY = 2
EXTRAPOLATION_LAG = 3
"""Checkpoints between the two whose rules are extrapolated (6 steps): further apart, their differences are
larger than rounding and the error ratio is steadier. Frequent checks with the pair this far apart freeze
elements early, and the mean freeze step is what the batch's products cost, since frozen elements leave it
(benchmarks/README.md)."""
ERANK_TARGET_RSE = 0.0075
"""Probe rounds continue until the effective rank's standard error is below this fraction of it."""
QUADRATURE_PROBES = 16
ROUND_SAFETY = 1.25
"""Probes a later round adds, as a multiple of what the jackknife standard error says are missing."""
QUADRATURE_MAX_ROUNDS = 12
QUADRATURE_MAX_STEPS = 64
FIRST_ROUNDS_BEFORE_EXACT = 2
"""Quadrature rounds a dense element gets before it is factorised instead (:func:`rank_sums`): trained-like
attention reaches the target in one or two, near-uniform attention in none of the twelve."""
DEFLATION_WIDTH = 64
"""Ritz pairs of the Gram operator, beyond the top pair, that the quadrature may deflate: a freshly
initialised model's near-uniform attention is about the uniform matrix plus a perturbation of rank up to the
head dimension (64 in most models), whose singular values carry most of Σσ below σ₁; deflated, the rest is a
small tail the quadrature resolves in one round of a dozen steps, where it otherwise ran two rounds of up to
64 steps and missed its target (benchmarks/README.md)."""
DEFLATION_OVERSAMPLING = 16
"""Columns drawn beyond ``DEFLATION_WIDTH`` for the subspace whose Ritz pairs are deflated."""
DEFLATION_POWER_STEPS = 2
"""Products with the deflated Gram operator that shape the random subspace before its Ritz pairs are taken:
with one, the pairs of near-uniform causal attention (whose spectrum decays smoothly, with no gap after the
head dimension) left the effective rank 0.7–1% high on average, with two unbiased (benchmarks/README.md)."""
DEFLATION_STEP = 16
"""Each element deflates a multiple of this many Ritz pairs, so the batch splits into few groups."""
ROUNDING_MARGIN = 30.0
"""The deflated operator's rounding in a product is about ε·σ₁σ₃ (P removes σ₁'s direction before the product,
so σ₁ enters once). Where the smallest deflated σ², the top of what the quadrature is left, is under this many
times that, the rounding shapes the rules and a dense element is factorised instead: on near-uniform
bidirectional heads (n = 768–2048, float32) the effective rank was within 1.6 standard errors of float64 at a
ratio of 60, and 2–22 standard errors off (up to 13%) at ratios of 8 and below (benchmarks/README.md)."""
DEFLATION_TOL = 1e-3
"""The deflated Ritz pairs' second-order change of Σσ, Σ ‖rᵢ‖²/√θᵢ, is kept below this fraction of σ₁ + σ₂."""
FACTORISE_FIRST_MAX_SIZE = 512
"""Up to this size (the smaller side) a dense batch's rank sums are factorised without any quadrature: there a
factorisation costs at most about 1.5× the quadrature's cheapest case (one round on trained-like attention)
and is exact, where the two rounds on near-uniform attention cost several factorisations
(benchmarks/README.md)."""


def rank_sums(
    operator: BatchedOperator,
    top_vectors: Tensor,
    sigma: Tensor,
    frobenius_squared: Tensor,
    generator: torch.Generator | None,
    matrices: Tensor | None = None,
) -> dict[str, Tensor]:
    """``effective_rank``, ``effective_rank_se`` and ``threshold_rank`` (B,) of the operator's matrices.

    Args:
        operator: (B, n, m) matrices known through products.
        top_vectors: (B, min side, 2) their top singular vectors on the Gram operator's side.
        sigma: (B, 2) their top two singular values.
        frobenius_squared: (B,) ‖A‖_F².
        generator: the source of the probes; None = a private fixed-seed one.
        matrices: (B, n, m) the matrices themselves where they are at hand (a dense batch), else None.

    Returns:
        The three metrics as :func:`~spectral_monitor.metrics.attention_metrics` defines them. Without
        ``matrices`` every element comes from the quadrature rounds (:func:`_quadrature_rank_sums`), with
        the Ritz pairs :func:`_ritz_deflation` finds deflated beside the top pair. With them, an element
        still above ``ERANK_TARGET_RSE`` after ``FIRST_ROUNDS_BEFORE_EXACT`` rounds, or whose tail is beneath
        the products' rounding (``ROUNDING_MARGIN``), is factorised instead (its standard error then 0): on
        such spectra further rounds cost more than the factorisation and stay biased (benchmarks/README.md).
        Up to ``FACTORISE_FIRST_MAX_SIZE`` every element of a dense batch is factorised at once, and its
        descending singular values are returned too (``singular_values``, (B, min(n, m))), for head
        diversity and the figures.

    Examples:
        A = ½I + ½·11ᵀ/8 has σ = (1, ½, …, ½): below the top pair the spectrum is flat, so the quadrature
        is exact whatever the probes, and exp(H(σ/Σσ)) = 7.715. The top pair comes from a factorisation here,
        from :func:`~spectral_monitor.linalg.top_singular` in the Krylov path.

        >>> import torch
        >>> from spectral_monitor.linalg.operators import DenseOperator
        >>> attention = (0.5 * torch.eye(8, dtype=torch.float64) + 0.5 / 8)[None]  # one (8, 8) matrix
        >>> _, sigma, vh = torch.linalg.svd(attention)
        >>> frobenius_squared = attention.square().sum(dim=(1, 2))
        >>> sums = rank_sums(DenseOperator(attention), vh[:, :2].mT, sigma[:, :2], frobenius_squared, None)
        >>> round(float(sums["effective_rank"]), 3), round(float(sums["effective_rank_se"]), 6)
        (7.715, 0.0)
    """
    if matrices is not None and min(operator.rows, operator.cols) <= FACTORISE_FIRST_MAX_SIZE:
        singular_values = all_singular_values(matrices)
        return {**_rank_sums_of(singular_values), "singular_values": singular_values}
    rounds = QUADRATURE_MAX_ROUNDS if matrices is None else FIRST_ROUNDS_BEFORE_EXACT
    metrics, beneath_rounding = _deflated_quadrature_rank_sums(
        operator,
        top_vectors,
        sigma,
        frobenius_squared,
        generator,
        rounds,
        skip_beneath_rounding=matrices is not None,
    )
    if matrices is None:
        return metrics
    above_target = metrics["effective_rank_se"] > ERANK_TARGET_RSE * metrics["effective_rank"]
    unresolved = (above_target | beneath_rounding).nonzero().flatten()
    if unresolved.numel() > 0:
        for name, values in _rank_sums_of(all_singular_values(matrices[unresolved])).items():
            metrics[name][unresolved] = values.to(metrics[name].dtype)
    return metrics


def _rank_sums_of(singular_values: Tensor) -> dict[str, Tensor]:
    """:func:`rank_sums`' three metrics from every singular value of each matrix (standard error 0)."""
    effective_rank = effective_rank_from_singular_values(singular_values)
    return {
        "effective_rank": effective_rank,
        "effective_rank_se": torch.zeros_like(effective_rank),
        "threshold_rank": threshold_rank_from_singular_values(singular_values),
    }


def _deflated_quadrature_rank_sums(
    operator: BatchedOperator,
    top_vectors: Tensor,
    sigma: Tensor,
    frobenius_squared: Tensor,
    generator: torch.Generator | None,
    rounds: int,
    *,
    skip_beneath_rounding: bool,
) -> tuple[dict[str, Tensor], Tensor]:
    """:func:`rank_sums` by quadrature, with as many of the Ritz pairs of :func:`_ritz_deflation` deflated
    beside the top pair as each element's residuals allow; and (B,) which elements leave the quadrature a
    tail beneath the products' rounding (``ROUNDING_MARGIN``), whose values are then NaN where
    ``skip_beneath_rounding`` (they are to be factorised) and the rounding-limited estimate where not.

    The elements deflating the same number of pairs share one call of :func:`_quadrature_rank_sums` on the
    operator restricted to them (all of them at the smallest number where it cannot be restricted). Each
    element's draws are its own: its subspace's start is its slice of one batch-wide draw, and its probes
    are its slices of batch-wide draws from a generator fixed by how many pairs it deflates.
    """
    gram = GramOperator(operator)
    top = (
        top_vectors
        if gram.side == "right"
        else operator.matmat(top_vectors) / sigma.clamp_min(1e-30)[:, None, :]
    )
    top, _ = torch.linalg.qr(top)
    device = generator.device if generator is not None else torch.device("cpu")
    subspace_seed, probe_seed = independent_seeds(generator, 2)
    ritz_vectors, ritz_sigma, usable = _ritz_deflation(
        gram, top, sigma, torch.Generator(device=device).manual_seed(subspace_seed)
    )
    batch = sigma.shape[0]
    beneath_rounding = torch.zeros(batch, dtype=torch.bool, device=sigma.device)
    if ritz_sigma.shape[1] > 0:
        last = ritz_sigma.gather(1, (usable - 1).clamp_min(0)[:, None]).squeeze(1)
        rounding = torch.finfo(gram.dtype).eps * sigma[:, 0] * ritz_sigma[:, 0]
        beneath_rounding = last.square() < ROUNDING_MARGIN * rounding
    estimated = ~(beneath_rounding & skip_beneath_rounding)  # the others are to be factorised
    groups = _restricted_groups(gram, usable, estimated)
    erank = sigma.new_full((batch,), float("nan"))
    standard_error = sigma.new_full((batch,), float("nan"))
    for count, members, restricted in groups:
        erank[members], standard_error[members] = _quadrature_rank_sums(
            restricted,
            torch.cat([top[members], ritz_vectors[members, :, :count]], dim=2),
            torch.cat([sigma[members], ritz_sigma[members, :count]], dim=1),
            frobenius_squared[members],
            torch.Generator(device=device).manual_seed(probe_seed + count),
            rounds,
            members,
            batch,
        )
    threshold = _threshold_rank_if_resolved(sigma, frobenius_squared)
    rank_cap = float(gram.cols)
    metrics = {
        "effective_rank": erank.clamp(1, rank_cap),
        "effective_rank_se": standard_error,
        "threshold_rank": threshold.clamp(1, rank_cap),
    }
    return metrics, beneath_rounding


def _restricted_groups(
    gram: GramOperator, usable: Tensor, estimated: Tensor
) -> list[tuple[int, Tensor, BatchedOperator]]:
    """(count, members, the operator restricted to them) for each number of Ritz pairs ``estimated``
    elements deflate; where ``gram`` cannot be restricted, one group of every element at the smallest
    count."""
    counts = usable[estimated].unique().tolist()
    groups = []
    for count in counts:
        members = (estimated & (usable == count)).nonzero().flatten()
        restricted = gram if members.numel() == usable.numel() else gram.restrict(members)
        if restricted is None:
            return [(counts[0], torch.arange(usable.numel(), device=usable.device), gram)]
        groups.append((count, members, restricted))
    return groups


def _ritz_deflation(
    gram: GramOperator, top: Tensor, sigma: Tensor, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """Ritz pairs of P M P (M the Gram operator, P = I − top topᵀ) on a random subspace, and how many of
    them each element may deflate: (B, side, w) vectors, (B, w) singular values √θ, (B,) counts, a multiple
    of ``DEFLATION_STEP`` up to w = ``DEFLATION_WIDTH`` (w = 0 where the side leaves no room for it). The
    subspace is ``DEFLATION_POWER_STEPS`` products of a Gaussian block of
    w + ``DEFLATION_OVERSAMPLING`` columns.

    Deflating a Ritz pair (θ, v) whose residual r = P M P v − θ v is not zero moves Σσ, to second order in
    the residuals, by about ‖r‖²/√θ: each element deflates the longest run of its leading pairs whose sum of
    those stays under ``DEFLATION_TOL`` of σ₁ + σ₂, which is a small part of the rank sums' target.
    """
    batch, side, known = top.shape
    width = min(DEFLATION_WIDTH, side - known - DEFLATION_OVERSAMPLING)
    width -= width % DEFLATION_STEP
    if width <= 0:
        empty = sigma.new_empty((batch, 0))
        return top.new_empty((batch, side, 0)), empty, torch.zeros(batch, dtype=torch.long, device=top.device)
    deflated = ProjectedOperator(gram, top.to(gram.dtype))
    start = gaussian(
        (batch, side, width + DEFLATION_OVERSAMPLING), dtype=top.dtype, device=top.device, generator=generator
    )
    basis = deflated.project(start.to(gram.dtype))
    for _ in range(DEFLATION_POWER_STEPS):
        basis, _ = torch.linalg.qr(deflated.matmat(basis.to(gram.dtype)).to(top.dtype))
    image = deflated.matmat(basis.to(gram.dtype)).to(top.dtype)
    rayleigh = (basis.mT @ image).double()
    theta, coefficients = torch.linalg.eigh((rayleigh + rayleigh.mT) / 2)
    theta, coefficients = theta.flip(-1)[:, :width], coefficients.flip(-1)[:, :, :width].to(top.dtype)
    vectors = basis @ coefficients
    residuals = (image @ coefficients - vectors * theta.to(top.dtype)[:, None, :]).norm(dim=1).double()
    theta = theta.clamp_min(0)
    moved = (residuals.square() / theta.sqrt().clamp_min(torch.finfo(theta.dtype).tiny)).cumsum(dim=1)
    allowed = DEFLATION_TOL * sigma.double().sum(dim=1, keepdim=True)
    usable = (moved <= allowed).sum(dim=1)
    return vectors, theta.sqrt().to(sigma.dtype), usable - usable % DEFLATION_STEP


def _quadrature_rank_sums(
    gram: BatchedOperator,
    deflate: Tensor,
    sigma: Tensor,
    frobenius_squared: Tensor,
    generator: torch.Generator,
    rounds: int,
    members: Tensor,
    full_batch: int,
) -> tuple[Tensor, Tensor]:
    """Effective rank and its standard error (B,): the deflated directions exactly, the rest of Σσ and
    Σσ log σ by stochastic Lanczos quadrature.

    ``gram`` is the Gram operator of the elements ``members`` of a batch of ``full_batch``, ``deflate``
    (B, side, k) orthonormal directions on its side that are Ritz vectors with singular values ``sigma``
    (B, k). The first round has ``QUADRATURE_PROBES`` probes; later rounds run for the elements whose
    standard error (sampling, by jackknife over probes, and quadrature, see :class:`_ExtrapolatedQuadrature`)
    is still above ``ERANK_TARGET_RSE`` of the estimate, with as many more probes as the sampling error says
    they need (:func:`_probes_still_needed`), until ``rounds`` rounds are spent.

    Each probe's zᵀ(PMP)z, the quadrature of f(x) = x and so exact, is a control variate with a known mean:
    tr(PMP) = ‖A‖_F² − Σσᵢ² over the deflated directions (they are Ritz vectors, so their Rayleigh quotients
    are the squared singular values found). It correlates with what a probe contributes to the effective
    rank, so regressing on it cuts the estimator's spread as more probes would (:func:`_controlled_erank`;
    benchmarks/README.md).
    """
    deflate, _ = torch.linalg.qr(deflate)
    known = (sigma.sum(dim=1), torch.special.xlogy(sigma, sigma).sum(dim=1))
    control_mean = (frobenius_squared.to(sigma.dtype) - sigma.square().sum(dim=1)).clamp_min(0)

    batch = sigma.shape[0]
    no_samples = sigma.new_empty((batch, 0))
    # per probe; NaN where an element sat a round out
    sums, entropy_sums, controls = no_samples, no_samples, no_samples
    quadrature_errors, rounds_taken = torch.zeros_like(known[0]), torch.zeros_like(known[0])
    pending = torch.arange(batch, device=sigma.device)
    width = QUADRATURE_PROBES
    for _ in range(rounds):
        # Later rounds run only for the elements still above the target, on the operator restricted to them.
        restricted = gram if pending.numel() == batch else gram.restrict(pending)
        if restricted is None:
            restricted, pending = gram, torch.arange(batch, device=sigma.device)
        tracker = _ExtrapolatedQuadrature(known[0][pending], known[1][pending])
        # Drawn for the whole batch and then selected, so an element's probes do not depend on which
        # others are in its group or still pending.
        probes = rademacher(
            (full_batch, gram.cols, QUADRATURE_PROBES),
            dtype=sigma.dtype,
            device=sigma.device,
            generator=generator,
        )[members[pending], :, :width]
        quadrature = lanczos_quadrature(
            restricted,
            num_probes=width,
            probes=probes,
            num_steps=QUADRATURE_MAX_STEPS,
            deflate=deflate[pending],
            until=tracker.converged,
            check_every=QUADRATURE_CHECK_EVERY,
            first_check=QUADRATURE_FIRST_CHECK,
            generator=generator,
        )
        _, per_probe, quadrature_error = tracker.finish(quadrature)
        round_samples = []
        for part in (*per_probe, (quadrature.weights * quadrature.nodes).sum(dim=-1)):
            samples = sigma.new_full((batch, width), float("nan"))
            samples[pending] = part.to(sigma.dtype)
            round_samples.append(samples)
        sums = torch.cat([sums, round_samples[0]], dim=1)
        entropy_sums = torch.cat([entropy_sums, round_samples[1]], dim=1)
        controls = torch.cat([controls, round_samples[2]], dim=1)
        quadrature_errors[pending] += quadrature_error
        rounds_taken[pending] += 1
        erank, sampling_error = _controlled_erank(sums, entropy_sums, controls, control_mean)
        quadrature_part = quadrature_errors / rounds_taken
        standard_error = torch.sqrt(sampling_error.square() + quadrature_part.square())
        pending = (standard_error > ERANK_TARGET_RSE * erank).nonzero().flatten()
        if pending.numel() == 0:
            break
        width = _probes_still_needed(
            sampling_error[pending],
            quadrature_part[pending],
            ERANK_TARGET_RSE * erank[pending],
            (~sums[pending].isnan()).sum(dim=1),
        )
    return erank, standard_error


def _probes_still_needed(
    sampling_error: Tensor, quadrature_error: Tensor, target: Tensor, probes_taken: Tensor
) -> int:
    """Probes of the next round: enough for the element that needs most, in steps of 4 up to a full round.

    A sampling error falls as 1/√probes, so p probes with error e reach the part of ``target`` that the
    quadrature error leaves, t, with p·(e/t)² in all; ``ROUND_SAFETY`` covers the jackknife's own spread. An
    element whose quadrature error alone exceeds the target gets a full round (more probes average it).
    """
    room = target.square() - quadrature_error.square()
    wanted = torch.where(
        room > 0,
        probes_taken * (sampling_error.square() / room.clamp_min(torch.finfo(room.dtype).tiny) - 1),
        torch.full_like(room, float(QUADRATURE_PROBES)),
    )
    most = float(wanted.amax()) * ROUND_SAFETY
    return int(min(QUADRATURE_PROBES, max(4, 4 * math.ceil(most / 4))))


class _ExtrapolatedQuadrature:
    """The effective rank of one round of probes, from the Gauss and Gauss–Radau rules extrapolated in steps.

    For √x-like functions Gauss over- and Gauss–Radau under-estimates, and both errors shrink like the same
    power of the step count m, set by the spectrum's behaviour near 0. Two checkpoints m' < m then give the
    ratio of the two errors, (G' − G)/(R − R'), and the value X = (G + ratio·R)/(1 + ratio) at which both
    rules would meet, long before the Gauss–Radau bracket narrows to the same accuracy
    (benchmarks/README.md). The quadrature error of the effective rank is taken as
    ``EXTRAPOLATION_SAFETY`` times the change of X between checkpoints; where the rules do not narrow
    monotonically (exact zero singular values, padded rows) X is the bracket's midpoint and the error its
    half-width as a uniform error, (G − R)/(2√3).
    """

    def __init__(self, known_sum: Tensor, known_entropy_sum: Tensor) -> None:
        self.known = (known_sum, known_entropy_sum)
        self.checkpoints: list[tuple[Tensor, Tensor]] = []  # (gauss (2, B), radau (2, B))
        self.previous_erank: Tensor | None = None
        self.steps_seen = 0
        batch = known_sum.shape[0]
        # Each element's result is frozen at the first checkpoint where it converged, so it does not depend
        # on how long the other elements of the batch kept the process going.
        self.frozen = torch.zeros(batch, dtype=torch.bool, device=known_sum.device)
        self.sums = known_sum.new_zeros((2, batch))
        self.error = known_sum.new_zeros(batch)
        self.per_probe: Tensor | None = None  # (2, B, probes): each probe's midpoint of its two rules

    def converged(self, quadrature: QuadratureNodes) -> Tensor:
        self._update(quadrature, finishing=False)
        return self.frozen

    def finish(self, quadrature: QuadratureNodes) -> tuple[Tensor, Tensor, Tensor]:
        """(Σσ and Σσ log σ (2, B), their per-probe samples (2, B, probes), the effective rank's quadrature
        error (B,)), each element's as of the checkpoint where it converged, else of the last step."""
        if self.steps_seen != quadrature.nodes.shape[-1]:
            self._update(quadrature, finishing=True)
        assert self.per_probe is not None
        # The per-probe samples are shifted by the extrapolation correction: the quadrature bias is common to
        # a round's probes, the spread between them is sampling error.
        shift = self.sums - self.per_probe.mean(dim=2)
        return self.sums, self.per_probe + shift[:, :, None], self.error

    def _update(self, quadrature: QuadratureNodes, *, finishing: bool) -> None:
        self.steps_seen = quadrature.nodes.shape[-1]
        gauss, radau = (
            torch.stack(
                [
                    known + _rule(quadrature, f, radau).mean(dim=1)
                    for known, f in zip(self.known, _SUMMANDS, strict=True)
                ]
            )
            for radau in (False, True)
        )
        midpoint = (gauss + radau) / 2
        bracket_error = (_erank(*gauss) - _erank(*radau)).abs() / (2 * math.sqrt(3))
        extrapolated, monotone = midpoint, torch.zeros_like(gauss[0], dtype=torch.bool)
        if len(self.checkpoints) >= EXTRAPOLATION_LAG:
            previous_gauss, previous_radau = self.checkpoints[-EXTRAPOLATION_LAG]
            gauss_step, radau_step, spread = previous_gauss - gauss, radau - previous_radau, gauss - radau
            narrowing = (gauss_step * spread > 0) & (radau_step * spread > 0)
            ratio = gauss_step / torch.where(narrowing, radau_step, torch.ones_like(radau_step))
            extrapolated = torch.where(narrowing, (gauss + ratio * radau) / (1 + ratio), midpoint)
            monotone = narrowing.all(dim=0)
        erank = _erank(*extrapolated)
        error = bracket_error
        if self.previous_erank is not None:
            change = EXTRAPOLATION_SAFETY * (erank - self.previous_erank).abs()
            error = torch.where(monotone, torch.minimum(change, bracket_error), bracket_error)
        self.checkpoints.append((gauss, radau))
        self.previous_erank = erank

        per_probe = torch.stack(
            [
                known[:, None] + _midpoint(quadrature, f)
                for known, f in zip(self.known, _SUMMANDS, strict=True)
            ]
        )
        if self.per_probe is None:
            self.per_probe = per_probe
        open_elements = ~self.frozen
        self.sums[:, open_elements] = extrapolated[:, open_elements]
        self.per_probe[:, open_elements] = per_probe[:, open_elements]
        self.error[open_elements] = error[open_elements]
        if not finishing:
            self.frozen |= error <= ERANK_QUADRATURE_RTOL * erank


def _sqrt(eigenvalues: Tensor) -> Tensor:
    return eigenvalues.clamp_min(0).sqrt()


def _half_sqrt_log(eigenvalues: Tensor) -> Tensor:
    # σ log σ written in λ = σ²: ½ √λ log λ.
    clamped = eigenvalues.clamp_min(0)
    return 0.5 * torch.special.xlogy(clamped.sqrt(), clamped)


_SUMMANDS = (_sqrt, _half_sqrt_log)


def _midpoint(quadrature: QuadratureNodes, f: Callable[[Tensor], Tensor]) -> Tensor:
    """Each probe's midpoint of the Gauss and Gauss–Radau rules for zᵀ f(M) z: (B, probes)."""
    return (_rule(quadrature, f, False) + _rule(quadrature, f, True)) / 2


def _rule(quadrature: QuadratureNodes, f: Callable[[Tensor], Tensor], radau: bool) -> Tensor:
    """Each probe's quadrature of zᵀ f(M) z, by the Gauss or the Gauss–Radau rule: (B, probes)."""
    nodes, weights = (
        (quadrature.radau_nodes, quadrature.radau_weights)
        if radau
        else (quadrature.nodes, quadrature.weights)
    )
    return (weights * f(nodes)).sum(dim=-1)


def _erank(singular_sum: Tensor, entropy_sum: Tensor) -> Tensor:
    """exp(−Σ pₖ log pₖ) with pₖ = σₖ/S, written as exp(log S − Σ σ log σ / S)."""
    safe = singular_sum.clamp_min(torch.finfo(singular_sum.dtype).tiny)
    return torch.exp(torch.log(safe) - entropy_sum / safe)


def _controlled_erank(
    sums: Tensor, entropy_sums: Tensor, controls: Tensor, control_mean: Tensor
) -> tuple[Tensor, Tensor]:
    """The effective rank exp(log S − E/S) from per-probe samples of S = Σσ and E = Σσ log σ, each mean
    corrected by its regression on the control variate T (per-probe samples, known mean ``control_mean``),
    and its standard error by leave-one-probe-out jackknife (the regression refitted each time).

    (B, probes) samples; NaN marks a probe an element did not take (it sat that round out). Where T does not
    vary (a rank-one matrix: PMP = 0) the plain means are used.
    """
    probes = sums.shape[1]
    taken = ~sums.isnan()
    every = _controlled_erank_on(sums, entropy_sums, controls, control_mean, taken)
    # Row l of the leave-out masks drops probe l; a probe the element never took gives no replicate.
    leave_out = taken[:, None, :] & ~torch.eye(probes, dtype=torch.bool, device=sums.device)
    replicates = _controlled_erank_on(
        *(samples[:, None, :] for samples in (sums, entropy_sums, controls)), control_mean[:, None], leave_out
    )
    replicates = torch.where(taken, replicates, torch.full_like(replicates, float("nan")))
    count = taken.sum(dim=1).to(sums.dtype)
    spread = (replicates - replicates.nanmean(dim=1, keepdim=True)).square().nansum(dim=1)
    return every, ((count - 1) / count * spread).sqrt()


def _controlled_erank_on(
    sums: Tensor, entropy_sums: Tensor, controls: Tensor, control_mean: Tensor, taken: Tensor
) -> Tensor:
    """:func:`_controlled_erank`'s estimate over the probes ``taken`` (broadcast against the samples)."""
    count = taken.sum(dim=-1).to(sums.dtype).clamp_min(1)

    def centred_and_mean(samples: Tensor) -> tuple[Tensor, Tensor]:
        kept = torch.where(taken, samples, torch.zeros_like(samples))
        mean = kept.sum(dim=-1) / count
        return torch.where(taken, samples - mean[..., None], torch.zeros_like(kept)), mean

    control_deviation, control_sample_mean = centred_and_mean(controls)
    variance = control_deviation.square().sum(dim=-1)
    safe_variance = torch.where(variance > 0, variance, torch.ones_like(variance))
    corrected = []
    for samples in (sums, entropy_sums):
        deviation, mean = centred_and_mean(samples)
        covariance = (deviation * control_deviation).sum(dim=-1)
        slope = torch.where(variance > 0, covariance / safe_variance, torch.zeros_like(covariance))
        corrected.append(mean - slope * (control_sample_mean - control_mean))
    return _erank(*corrected)


def _threshold_rank_if_resolved(sigma: Tensor, frobenius_squared: Tensor) -> Tensor:
    """Smallest k reaching 99% of ‖A‖_F² when the known top singular values reach it, else NaN.

    Read off a stochastic spectral density this count is ill-conditioned (the 99% level sits in the dense
    low end of the spectrum, where a few probes' estimates scatter widely), so the Krylov path reports it
    only where it is exact, which is the collapse regime that matters.
    """
    top_energy = sigma.square().cumsum(dim=1)
    reached = top_energy >= ENERGY_LEVEL * frobenius_squared[:, None]
    rank = (~reached).sum(dim=1).to(sigma.dtype) + 1
    return torch.where(reached[:, -1], rank, torch.full_like(rank, float("nan")))

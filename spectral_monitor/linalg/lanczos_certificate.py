"""The stop test of the Lanczos solvers: when a Ritz pair is an eigenpair to the tolerance, and when no
eigenvalue above it can have hidden from the random start (what ``converged`` guarantees,
:func:`~spectral_monitor.linalg.lanczos_eigsh`).

The test's few dozen operations on (B, m) values run in numpy, on the host: as torch operations on arrays this
small they would cost as much as a Hessian-vector product of a small network."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

StopCriterion = Literal["residual", "eigenvalue"]

CERTAINTY = 0.01
"""The ``failure_probability`` the probes' solves certify their answers to: the chance, over the random
start, that an eigenvalue above a reported one was never seen
(:func:`~spectral_monitor.linalg.lanczos_eigsh`)."""
ROUNDING_FLOOR = 10
"""A residual below this many units of rounding of the operator's dtype, times the largest product norm seen,
meets any tolerance: float rounding of the products, not the solver, sets the error there. The floor is an
absolute error, so it is kept small: on the float32 Gram products of attention a larger one would let σ₂ of
a matrix whose σ₂² is a few percent of σ₁² stop several times further off than its own tolerance."""
EACH_FLOOR = 1e-3
"""With ``relative_to="each"``, a wanted |θ| below this fraction of the largest is judged against the floor
instead: near zero, float32 rounding of the products, not θ, sets the scale an error can reach."""

DECISIVE = 1e200
"""A Christoffel function this large decides the start-component bound: the rest of the recurrence cannot
move it, and going on could overflow."""


@dataclass
class Verdict:
    """The stop test of one iteration, per batch element.

    Attributes:
        met: (B,) bool, every test of :func:`judge` passed.
        least_degree: (B,) a Krylov degree below which the degree test cannot pass, in the dtype of the Ritz
            values; 0 where it does not apply (no ``failure_probability``, error bounds not yet met) or has
            passed.

    Examples:
        >>> import numpy as np
        >>> Verdict(met=np.array([True]), least_degree=np.zeros(1)).met
        array([ True])
    """

    met: np.ndarray
    least_degree: np.ndarray


@dataclass
class StopTest:
    """What :func:`stop_test` found.

    Attributes:
        verdict: The :class:`Verdict`, or ``None`` where a cheap bound shows the full test of :func:`judge`
            could only fail and ask for no degree beyond the next (test 1 fails for every batch element, or
            the top value's :func:`gap_free_top` test does), so it was not run.
        relative_residual: (B, k) the wanted Ritz pairs' residuals relative to max |θ|, largest θ first.

    Examples:
        >>> import numpy as np
        >>> StopTest(verdict=None, relative_residual=np.array([[0.5]])).verdict is None
        True
    """

    verdict: Verdict | None
    relative_residual: np.ndarray


@dataclass
class LanczosRecurrence:
    """The three-term recurrence of a single-vector Lanczos run from a unit start q₀, which makes each basis
    vector a polynomial of the operator applied to the start: β_{i+1} q_{i+1} = (H − α_i) q_i − β_i q_{i−1}
    − f_i, so q_i = π_i(H) q₀ where f = 0. What the recurrence does not record (the Gram–Schmidt
    coefficients on older vectors, the second pass's, rounding of the products) is the departure f_i.

    Attributes:
        diagonal: (B, L) α₀ … α_{L−1}.
        off_diagonal: (B, L) β₁ … β_L, all positive; β_L couples the newest basis vector q_L.
        departure: (B, L) bounds on ‖f₀‖ … ‖f_{L−1}‖.

    Examples:
        >>> import numpy as np
        >>> chain = LanczosRecurrence(np.zeros((1, 1)), np.ones((1, 1)), np.zeros((1, 1)))
        >>> chain.diagonal.shape
        (1, 1)
    """

    diagonal: np.ndarray
    off_diagonal: np.ndarray
    departure: np.ndarray


def stop_test(
    theta: np.ndarray,
    residual: np.ndarray,
    *,
    k: int,
    tol: float,
    relative_to: str,
    criterion: StopCriterion,
    rounding: float,
    scale: np.ndarray,
    degree: int,
    certainty: float | None,
    last: bool,
    recurrence: LanczosRecurrence | None = None,
) -> StopTest:
    """The stop test of one Lanczos iteration: each wanted value's absolute tolerance, then :func:`judge`.

    The tolerance of a wanted value is ``tol`` of max |θ|, or of its own |θᵢ| with ``relative_to="each"``
    (floored at ``EACH_FLOOR`` of max |θ|), and never below ``ROUNDING_FLOOR`` · ``rounding`` · ``scale``.

    Args:
        theta: (B, m) the Ritz values, ascending.
        residual: (B, m) the residual norm of every Ritz pair, in the order of ``theta``.
        k: How many of the largest Ritz values are wanted.
        tol: The relative tolerance, > 0.
        relative_to: ``"largest"`` (against max |θ|) or ``"each"`` (against each wanted |θᵢ|).
        criterion: ``"residual"`` or ``"eigenvalue"``, the error bound of :func:`judge`'s test 1.
        rounding: The rounding unit ε of the operator's dtype.
        scale: (B,) the largest product norm seen so far.
        degree: The Krylov degree of the space (iterations less one).
        certainty: :func:`start_certainty` of the run's start, or ``None`` to skip the degree test.
        last: Whether this is the last iteration: the full test then runs even where it cannot pass.
        recurrence: As :func:`judge` takes it.

    Returns:
        The :class:`StopTest`; its ``verdict`` is ``None`` when this is not the ``last`` iteration and
        either :func:`beyond_tolerance` shows test 1 fails everywhere or, for the top value alone (k = 1)
        of a single-vector ``recurrence``, :func:`gap_free_top` fails everywhere while rounding's echo
        leaves it within reach (where it does not, the full test runs: its degree bound may stop the run).

    Examples:
        A top Ritz value 5 with residual 0.05 and the next Ritz value 3 below it: the Kato–Temple bound
        0.05²/3 is within 2·10⁻⁴ of 5, the residual itself is not.

        >>> import numpy as np
        >>> theta, residual = np.array([[1.0, 2.0, 5.0]]), np.array([[0.0, 0.0, 0.05]])
        >>> common = dict(k=1, tol=2e-4, relative_to="largest", rounding=1e-7, scale=np.array([5.0]))
        >>> more = dict(degree=5, certainty=None, last=False)
        >>> stop_test(theta, residual, criterion="eigenvalue", **common, **more).verdict.met
        array([ True])
        >>> test = stop_test(theta, residual, criterion="residual", **common, **more)
        >>> test.verdict is None, test.relative_residual
        (True, array([[0.01]]))
    """
    scale = scale.astype(theta.dtype)
    magnitude = np.maximum(np.abs(theta).max(axis=1), np.finfo(theta.dtype).tiny)
    wanted_residual = residual[:, -k:][:, ::-1]
    judged_against = np.repeat(magnitude[:, None], k, axis=1)
    if relative_to == "each":
        judged_against = np.maximum(np.abs(theta[:, -k:][:, ::-1]), EACH_FLOOR * judged_against)
    # Below float rounding of the products no residual can be asserted: that is the tolerance's floor.
    tolerance = np.maximum(tol * judged_against, (ROUNDING_FLOOR * rounding * scale)[:, None]).astype(
        theta.dtype
    )
    relative = wanted_residual / magnitude[:, None]
    if not last and k == 1 and recurrence is not None and certainty is not None:
        # Until the top value's gap-free test passes, the full test can only fail and ask for the next degree
        # (unless rounding's echo makes it hopeless, which the full test must see): a few scalar operations
        # tell that, where the full test costs as much as a product of a small network.
        certified, echo = gap_free_top(theta, residual, tolerance[:, 0], degree, certainty, recurrence)
        if not certified.any() and not (echo * certainty >= 1).any():
            return StopTest(None, relative)
    if not last and beyond_tolerance(theta, wanted_residual, tolerance, criterion):
        return StopTest(None, relative)
    verdict = judge(theta, residual, k, tolerance, criterion, degree, certainty, recurrence)
    return StopTest(verdict, relative)


@np.errstate(all="ignore")  # inf and NaN are values here, as in torch
def judge(
    theta: np.ndarray,
    residual: np.ndarray,
    k: int,
    tolerance: np.ndarray,
    criterion: StopCriterion,
    degree: int,
    certainty: float | None,
    recurrence: LanczosRecurrence | None = None,
) -> Verdict:
    """The stop test of :func:`~spectral_monitor.linalg.lanczos_eigsh` on the ascending Ritz values ``theta``
    (B, m) and the residuals of every Ritz pair ``residual`` (B, m), for the top ``k`` with absolute
    tolerances ``tolerance`` (B, k).

    Ritz values within the tolerance of a wanted one form its cluster: the answer is right to the tolerance
    whichever of them is on top, so the gaps below are measured to the nearest Ritz value outside it.

    1. The error bound: r, or with ``criterion="eigenvalue"`` min(r, r²/δ) with δ the gap from θᵢ to the
       nearest *interval* [θⱼ − rⱼ, θⱼ + rⱼ] outside its cluster (Kato–Temple; a Ritz value still moving
       narrows the gap instead of widening it), within the tolerance.
    2. The first Ritz pair below the k-th wanted one's cluster resolved: its residual at most half its
       distance to it, or within the tolerance.
    3. With a ``certainty`` C, the Kaniel–Paige–Saad degree test: T_d(1 + 2δᵢ/S) ≥ C·√(S/εᵢ), with δᵢ floored
       at τᵢ, S the span of the Ritz values widened by the end residuals, ε₁ = δ₁ for the top value and εᵢ =
       τᵢ below it. The random start has a component of at least 1/C along any fixed eigenvector except with
       probability p (:func:`start_certainty`), and a Krylov polynomial of degree d then pulls a Ritz value to
       within εᵢ of any eigenvalue δᵢ or more above θᵢ. For the top value that is a contradiction already at
       ε₁ = δ₁: the Chebyshev polynomial of degree d on [λ_min, θ₁] gives a vector of the space whose Rayleigh
       quotient exceeds θ₁, the largest Ritz value. Below the top the Ritz values above θᵢ enter the bound for
       the i-th one, and the stricter τᵢ leaves room for them. This excludes unseen eigenvalues δᵢ or more
       above θᵢ only: one hiding closer, between θᵢ and the next Ritz interval, is not ruled out.

       Given the ``recurrence`` of a single-vector run, the top value's test is gap-free instead: it passes
       where no eigenvalue τ₁ or more above θ₁ can have escaped, so λ_max ∈ [θ₁, θ₁ + τ₁] with probability
       1 − p. Either the degree test with δ₁ = ε₁ = τ₁ holds, or :func:`hidden_component` bounds the start's
       component along every eigenvector of eigenvalue θ₁ + τ₁ or more by 1/C, the same threshold read from
       the Krylov space itself: a bulk the polynomials stay small on costs few steps.

    Args:
        theta: (B, m) the Ritz values, ascending.
        residual: (B, m) the residual norm of every Ritz pair, in the order of ``theta``.
        k: How many of the largest Ritz values are wanted; with m ≤ k nothing is resolved below them and
            the test fails.
        tolerance: (B, k) absolute tolerances of the wanted values, largest θ first.
        criterion: ``"residual"`` (error bound r) or ``"eigenvalue"`` (min(r, r²/δ)).
        degree: d, the Krylov degree of the space.
        certainty: C of test 3, :func:`start_certainty` of the run's start, or ``None`` to skip the test.
        recurrence: The single-vector recurrence behind ``theta``, which makes the top value's test 3
            gap-free; ``None`` where the basis is not one start's polynomials (blocks, filler directions).

    Returns:
        The :class:`Verdict`; its ``least_degree`` is set where tests 1 and 2 pass and test 3 does not (for
        a top value with a ``recurrence``, the next degree, unless the component bound's rounding echo alone
        exceeds the threshold: how fast the bound falls cannot be told in advance).

    Examples:
        Ritz values 1, 2, 5, all exact, in a space of size 3: the degree test at p = 0.01 needs a degree of
        at least 3.68 for the gap of 3 below the top.

        >>> import numpy as np
        >>> theta, exact, tolerance = np.array([[1.0, 2.0, 5.0]]), np.zeros((1, 3)), np.full((1, 1), 1e-3)
        >>> judge(theta, exact, 1, tolerance, "residual", 2, None).met
        array([ True])
        >>> certainty = start_certainty(3, 0.01)
        >>> verdict = judge(theta, exact, 1, tolerance, "residual", 2, certainty)
        >>> verdict.met, round(verdict.least_degree.item(), 2)
        (array([False]), 3.68)
        >>> judge(theta, exact, 1, tolerance, "residual", 5, certainty).met
        array([ True])
    """
    tiny = np.finfo(theta.dtype).tiny
    batch, m = theta.shape
    wanted = theta[:, -k:][:, ::-1]
    wanted_residual = residual[:, -k:][:, ::-1]
    own = np.arange(m - 1, m - k - 1, -1)
    centre_distance = np.abs(wanted[:, :, None] - theta[:, None, :])
    outside = centre_distance > tolerance[:, :, None]
    outside[:, np.arange(k), own] = False
    inf = theta.dtype.type(np.inf)
    interval_gap = np.maximum(np.where(outside, centre_distance - residual[:, None, :], inf).min(axis=2), 0)

    error = wanted_residual
    if criterion == "eigenvalue":
        error = np.minimum(wanted_residual, np.square(wanted_residual) / np.maximum(interval_gap, tiny))
    met = (error <= tolerance).all(axis=1)

    below = theta[:, : m - k]
    past = below < (wanted[:, -1:] - tolerance[:, -1:])
    if m > k:
        index = np.where(past, np.arange(m - k), -1).max(axis=1)
        some = index >= 0
        elements, first = np.arange(batch), np.maximum(index, 0)
        distance = wanted[:, -1] - below[elements, first]
        resolved = residual[elements, first] <= np.maximum(distance / 2, tolerance[:, -1])
        met &= ~some | resolved
    else:
        met = np.zeros_like(met)
    least_degree = np.zeros(batch, dtype=theta.dtype)
    if certainty is None or m <= k or not met.any():  # test 3 decides nothing then
        return Verdict(met, least_degree)
    spread = widened_span(theta, residual)[:, None]
    gap = np.maximum(interval_gap, tolerance)
    if recurrence is not None:
        gap[:, 0] = tolerance[:, 0]  # gap-free: no eigenvalue τ₁ or more above θ₁ may hide
    pulled = np.maximum(pulled_within(gap, tolerance), tiny)
    needed = np.arccosh(np.maximum(certainty * np.sqrt(spread / pulled), 1))
    certified = degree * np.arccosh(1 + 2 * gap / spread) >= needed
    if recurrence is not None:
        certified[:, 0], echo = gap_free_top(theta, residual, tolerance[:, 0], degree, certainty, recurrence)
    # Once the error bounds are met the wanted values have converged; the Ritz values below them only rise
    # and the span only widens, so the gap to the next Ritz value's centre (plus the tolerance) and the span
    # of today's values bound the degree the test will ever need from below.
    centre_gap = np.where(outside, centre_distance, inf).min(axis=2) + tolerance
    if recurrence is not None:
        centre_gap[:, 0] = tolerance[:, 0]
    bare_spread = np.maximum((theta[:, -1] - theta[:, 0])[:, None], tiny)
    lower = np.arccosh(
        np.maximum(
            certainty * np.sqrt(bare_spread / np.maximum(pulled_within(centre_gap, tolerance), tiny)), 1
        )
    )
    least = lower / np.arccosh(1 + 2 * centre_gap / bare_spread)
    if recurrence is not None:
        # How fast the Christoffel function will grow cannot be told from the space so far (near the top Ritz
        # value, a zero of the newest polynomial, its last step says little), so the route is tried at the
        # next degree, unless rounding's echo alone exceeds the threshold once θ₁, and so μ, has settled
        # within its residual: the echo then only grows with the space.
        hopeless = (echo * certainty >= 1) & (wanted_residual[:, 0] <= tolerance[:, 0])
        least[:, 0] = np.where(hopeless, least[:, 0], degree + 1)
    certified = certified.all(axis=1)
    least = least.max(axis=1)
    least = np.where(np.isnan(least), 0.0, np.minimum(least, 2.0**31))
    least_degree = np.where(met & ~certified, least, least_degree).astype(theta.dtype)
    return Verdict(met & certified, least_degree)


def widened_span(theta: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """The span of the spectrum as the degree test takes it: the Ritz values' span widened by the end
    residuals (an eigenvalue lies within rᵢ of θᵢ), at least the smallest positive float.

    Args:
        theta: (B, m) the Ritz values, ascending.
        residual: (B, m) the residual norm of every Ritz pair, in the order of ``theta``.

    Returns:
        (B,) S = θ_max − θ_min + r_max + r_min.

    Examples:
        >>> import numpy as np
        >>> widened_span(np.array([[1.0, 2.0, 5.0]]), np.array([[0.25, 0.0, 0.5]]))
        array([4.75])
    """
    span = theta[:, -1] - theta[:, 0] + residual[:, -1] + residual[:, 0]
    return np.maximum(span, np.finfo(theta.dtype).tiny)


def gap_free_top(
    theta: np.ndarray,
    residual: np.ndarray,
    tolerance: np.ndarray,
    degree: int,
    certainty: float,
    recurrence: LanczosRecurrence,
) -> tuple[np.ndarray, np.ndarray]:
    """Test 3 of :func:`judge` for the top value of a single-vector run: no eigenvalue τ₁ or more above θ₁
    escaped the space, except with the probability p behind ``certainty``. Either the degree test with
    δ₁ = ε₁ = τ₁ holds, or :func:`hidden_component` bounds the start's component along every eigenvector of
    eigenvalue θ₁ + τ₁ or more by 1/``certainty``.

    Args:
        theta: (B, m) the Ritz values, ascending.
        residual: (B, m) the residual norm of every Ritz pair, in the order of ``theta``.
        tolerance: (B,) τ₁, the top value's absolute tolerance, positive.
        degree: d, the Krylov degree of the space.
        certainty: :func:`start_certainty`, the inverse of the least component the random start has along
            a fixed eigenvector except with probability p.
        recurrence: The single-vector recurrence behind ``theta``.

    Returns:
        ``(certified, echo)``, each (B,): whether the test passes, and the echo Ξ of :func:`hidden_component`
        (the part of its bound that does not fall as the space grows).

    Examples:
        Two Lanczos steps on diag(0, 0, 1) (as in :func:`hidden_component`): the top Ritz value 1 within 0.5.

        >>> import numpy as np
        >>> alpha, beta = np.array([[1 / 3, 2 / 3]]), np.array([[2**0.5 / 3, 1e-9]])
        >>> chain = LanczosRecurrence(alpha, beta, np.zeros((1, 2)))
        >>> theta, residual = np.array([[0.0, 1.0]]), np.array([[1e-9, 1e-9]])
        >>> certified, echo = gap_free_top(theta, residual, np.array([0.5]), 1, 100.0, chain)
        >>> certified, echo
        (array([ True]), array([0.]))
    """
    component, echo = hidden_component(recurrence, theta[:, -1] + tolerance)
    certified = component * certainty <= 1
    # Python floats: the batch is one run, where each numpy call would cost more than its arithmetic.
    spreads = widened_span(theta, residual).tolist()
    for element, (spread, tau) in enumerate(zip(spreads, tolerance.tolist(), strict=True)):
        if not certified[element] and tau > 0 and spread / tau >= 0:  # NaN fails both routes
            needed = math.acosh(max(certainty * math.sqrt(spread / tau), 1.0))
            certified[element] = degree * math.acosh(1 + 2 * tau / spread) >= needed
    return certified, echo


def hidden_component(recurrence: LanczosRecurrence, mu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The largest component the unit start q₀ can have along any eigenvector of eigenvalue μ or more, given
    the recurrence its basis grew by, with μ above every Ritz value (where the recurrence's polynomials πᵢ
    are positive and grow with μ).

    For a unit eigenvector u of eigenvalue λ ≥ μ, sᵢ = uᵀqᵢ = πᵢ(λ)·(c + ξᵢ) with c = uᵀq₀ and ξᵢ the
    departures' echo: |ξᵢ| ≤ Ξᵢ = Σ_{l<i} W_l/(β_{l+1}π_lπ_{l+1}), W_l = Σ_{m≤l} ‖f_m‖π_m (each departure
    propagated by reduction of order of the recurrence). The basis is orthonormal, so Σᵢ sᵢ² ≤ 1 (Bessel)
    and |c| ≤ Ξ + 1/√K with K = Σᵢ πᵢ(λ)², the Christoffel function of the Ritz values' quadrature: the
    sharpest bound the Krylov space can give, with no assumption on the rest of the spectrum. K only grows
    and Ξ only falls from μ up (past their zeros, πᵢ/π_l grows with λ for l < i), so the bound at μ holds
    for every eigenvalue above it. Bessel holds for every prefix q₀ … q_P of the basis too; the least of
    the prefixes' bounds is returned.

    Ξ is as sound as the departures: they hold the Gram–Schmidt coefficients the recurrence does not
    record, measured, and the products' own rounding, assumed below ``ROUNDING_FLOOR`` units of the
    largest product. It grows with the start's weight along the eigenvectors just below μ, over which
    rounding could carry part of the start to μ: in float32, with a tolerance of a few 1e-4 of the largest
    eigenvalue or less, it alone can exceed the threshold, and the bound then cannot pass however far the
    space grows.

    Args:
        recurrence: The :class:`LanczosRecurrence` of each batch element.
        mu: (B,) the eigenvalue from which on components are bounded, above every Ritz value.

    Returns:
        ``(bound, echo)``, each (B,): the bound on |c|, and Ξ of the whole basis, the part of it that does
        not fall as the space grows.

    Examples:
        Two Lanczos steps on diag(0, 0, 1) from q₀ = (1, 1, 1)/√3 (α = 1/3, 2/3; β₁ = √2/3, β₂ = 0 would
        end the space: here β₂ is taken tiny): no eigenvalue at 1.5 or more can have a large component.

        >>> import numpy as np
        >>> alpha, beta = np.array([[1 / 3, 2 / 3]]), np.array([[2**0.5 / 3, 1e-9]])
        >>> chain = LanczosRecurrence(alpha, beta, np.zeros((1, 2)))
        >>> bound, _ = hidden_component(chain, np.array([1.5]))
        >>> bool(bound[0] < 1e-8)
        True
    """
    bounds, echoes = [], []
    # Python floats: the recurrence is sequential and its batch is one run, where a numpy call per scalar
    # operation would cost more than the rest of the stop test.
    for alpha, beta, departure, point in zip(
        recurrence.diagonal.tolist(),
        recurrence.off_diagonal.tolist(),
        recurrence.departure.tolist(),
        mu.tolist(),
        strict=True,
    ):
        previous, current, coupling = 0.0, 1.0, 0.0
        christoffel, weighted, echo, bound = 1.0, 0.0, 0.0, 1.0
        for diagonal, off_diagonal, departed in zip(alpha, beta, departure, strict=True):
            weighted += departed * current
            following = ((point - diagonal) * current - coupling * previous) / off_diagonal
            if not following > 0:  # past the zeros the polynomials are positive: μ was not above them all
                bound = math.inf
                break
            echo += weighted / (off_diagonal * current * following)
            christoffel += following * following
            previous, current, coupling = current, following, off_diagonal
            bound = min(bound, echo + christoffel**-0.5)
            if christoffel > DECISIVE:  # past any threshold, and short of overflow
                break
        bounds.append(bound)
        echoes.append(echo)
    return np.array(bounds, dtype=mu.dtype), np.array(echoes, dtype=mu.dtype)


def pulled_within(gap: np.ndarray, tolerance: np.ndarray) -> np.ndarray:
    """How close (B, k) the degree test must pull a Ritz value to an unseen eigenvalue δᵢ or more above θᵢ.

    The top value needs only δ₁: a Ritz value pulled within δ₁ of an eigenvalue δ₁ or more above θ₁ would lie
    above θ₁, which is the largest. The values below it keep τᵢ: between θᵢ and an unseen eigenvalue above
    it lie the Ritz values above θᵢ, and the bound for the i-th Ritz value carries factors of their gaps that
    τᵢ leaves room for and δᵢ would not.

    Args:
        gap: (B, k) δᵢ, each wanted value's gap (floored at its tolerance), largest θ first.
        tolerance: (B, k) τᵢ, the absolute tolerances, in the same order.

    Returns:
        (B, k): δ₁ for the top value, τᵢ for the others.

    Examples:
        >>> import numpy as np
        >>> pulled_within(np.array([[3.0, 2.0]]), np.array([[0.1, 0.1]]))
        array([[3. , 0.1]])
    """
    return np.concatenate([gap[:, :1], tolerance[:, 1:]], axis=1)


@np.errstate(all="ignore")  # inf and NaN are values here, as in torch
def beyond_tolerance(
    theta: np.ndarray, wanted_residual: np.ndarray, tolerance: np.ndarray, criterion: StopCriterion
) -> bool:
    """Whether every batch element fails test 1 of :func:`judge` for certain, judged from bounds that cost a
    few operations instead of the whole test: the error bound min(r, r²/δ) is at least min(r, r²/S) with S
    the span of the Ritz values, since δ ≤ S whenever some Ritz value lies outside θᵢ's cluster, which it
    must when S > 2τᵢ.

    Args:
        theta: (B, m) the Ritz values, ascending.
        wanted_residual: (B, k) the wanted Ritz pairs' residuals, largest θ first.
        tolerance: (B, k) their absolute tolerances.
        criterion: ``"residual"`` or ``"eigenvalue"``, as in :func:`judge`.

    Returns:
        ``True`` only where the full test would fail test 1 for every batch element.

    Examples:
        >>> import numpy as np
        >>> theta, tolerance = np.array([[1.0, 2.0, 5.0]]), np.full((1, 1), 1e-3)
        >>> beyond_tolerance(theta, np.array([[0.1]]), tolerance, "eigenvalue")
        True
        >>> beyond_tolerance(theta, np.array([[0.01]]), tolerance, "eigenvalue")
        False
    """
    if criterion == "residual":
        return bool((wanted_residual > tolerance).any(axis=1).all())
    span = (theta[:, -1] - theta[:, 0])[:, None]
    least_error = np.minimum(
        wanted_residual, np.square(wanted_residual) / np.maximum(span, np.finfo(theta.dtype).tiny)
    )
    return bool(((least_error > tolerance) & (span > 2 * tolerance)).any(axis=1).all())


def start_certainty(n: int, failure_probability: float, *, mixed: bool = False) -> float:
    """C = 1/t, with t the component along a fixed unit vector u below which the random start of a Lanczos
    run falls with probability at most p: the threshold of :func:`judge`'s test 3.

    A Gaussian start g ∈ ℝⁿ has c = uᵀg/‖g‖ with c² ~ Beta(1/2, (n − 1)/2), so for n ≥ 3
    P(|c| < t) ≤ 2t/B(1/2, (n − 1)/2) ≤ t·√(2(n − 1)/π) (the density's factor (1 − c²)^((n−3)/2) is at most
    1, and Γ(x + ½)/Γ(x) ≤ √x, Wendel's inequality); for n = 2, P = (2/π)·asin t ≤ t. Either way
    t = p/√(2n/π) keeps P ≤ p. A mixed start, g/‖g‖ + w with w a unit vector drawn independently of g
    (``init_mode="mix"``), has norm at most 2 and component at least |c + uᵀw|/2; for n ≥ 3 the density of c
    is symmetric and non-increasing in |c|, so shifting it by uᵀw makes no interval around 0 likelier
    (Anderson's inequality) and t halves. For n = 2 that density is not unimodal: P(|c + a| < s) ≤ √s
    there, so t = p²/2 (for n = 1 one product exhausts the space, which makes any answer exact).

    Args:
        n: The operator's size, at least 1.
        failure_probability: p, in (0, 1).
        mixed: Whether the start is a random unit vector plus a warm unit vector.

    Returns:
        C, so that the start's component along any fixed eigenvector is at least 1/C except with
        probability p.

    Examples:
        >>> round(start_certainty(1000, 0.01), 1), round(start_certainty(1000, 0.01, mixed=True), 1)
        (2523.1, 5046.3)
    """
    if mixed and n <= 2:
        return 2 / failure_probability**2
    cold = math.sqrt(2 * n / math.pi) / failure_probability
    return 2 * cold if mixed else cold


def least_degree(certainty: float) -> float:
    """The degree below which the certificate of :func:`judge` fails whatever the spectrum: its gap is at
    most the span of the spectrum and its tolerance at most that span.

    Args:
        certainty: C of the degree test, :func:`start_certainty`.

    Returns:
        acosh(C) / acosh(3), a Krylov degree (not rounded).

    Examples:
        >>> round(least_degree(start_certainty(1000, 0.01)), 3)
        4.837
    """
    return math.acosh(certainty) / math.acosh(3)

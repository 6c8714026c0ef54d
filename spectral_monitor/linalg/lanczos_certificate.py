"""The stop test of the Lanczos solvers: when a Ritz pair is an eigenpair to the tolerance, and when no
eigenvalue above it can have hidden from the random start (what ``converged`` guarantees,
:func:`~spectral_monitor.linalg.lanczos_eigsh`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

StopCriterion = Literal["residual", "eigenvalue"]

CERTAINTY = 0.01
"""The ``failure_probability`` the probes' solves certify their answers to: the chance, over the random
start, that an eigenvalue above a reported one was never seen
(:func:`~spectral_monitor.linalg.lanczos_eigsh`)."""
ROUNDING_FLOOR = 10
"""A residual below this many units of rounding of the operator's dtype, times the largest product norm seen,
meets any tolerance: float rounding of the products, not the solver, sets the error there. Ten units, not
more: the floor is an absolute error, so on the float32 Gram products of attention a larger one lets σ₂ of
a matrix whose σ₂² is a few percent of σ₁² stop several times further off than its own tolerance."""
EACH_FLOOR = 1e-3
"""With ``relative_to="each"``, a wanted |θ| below this fraction of the largest is judged against the floor
instead: near zero, float32 rounding of the products, not θ, sets the scale an error can reach."""


@dataclass
class Verdict:
    """The stop test of one iteration, per batch element: ``met``, and ``least_degree``, a Krylov degree
    below which the certificate cannot pass (0 when it does not apply or has passed)."""

    met: Tensor
    least_degree: Tensor


@dataclass
class StopTest:
    """What :func:`stop_test` found: ``verdict`` (None where a cheap bound already fails test 1 everywhere,
    so the full test was not run), and the wanted Ritz pairs' residuals relative to max |θ|, (B, k)."""

    verdict: Verdict | None
    relative_residual: Tensor


def stop_test(
    theta: Tensor,
    residual: Tensor,
    *,
    k: int,
    tol: float,
    relative_to: str,
    criterion: StopCriterion,
    rounding: float,
    scale: Tensor,
    degree: int,
    n: int,
    failure_probability: float | None,
    last: bool,
) -> StopTest:
    """The stop test of one Lanczos iteration on the ascending Ritz values ``theta`` (B, m) and the residuals
    of every Ritz pair ``residual`` (B, m): each wanted value's tolerance (``tol`` of max |θ|, or of itself
    with ``relative_to="each"``, floored at ``EACH_FLOOR`` of max |θ|, and never below ``ROUNDING_FLOOR``
    units ``rounding`` of the operator's dtype times the largest product norm ``scale`` (B,) seen), then
    :func:`judge`, unless it cannot pass yet and this is not the ``last`` iteration."""
    magnitude = theta.abs().amax(dim=1).clamp_min(torch.finfo(theta.dtype).tiny)
    wanted_residual = residual[:, -k:].flip(1)
    judged_against = magnitude[:, None].expand(-1, k)
    if relative_to == "each":
        judged_against = torch.maximum(theta[:, -k:].flip(1).abs(), EACH_FLOOR * judged_against)
    # Below float rounding of the products no residual can be asserted: that is the tolerance's floor.
    tolerance = torch.maximum(tol * judged_against, (ROUNDING_FLOOR * rounding * scale)[:, None])
    relative = wanted_residual / magnitude[:, None]
    if not last and beyond_tolerance(theta, wanted_residual, tolerance, criterion):
        return StopTest(None, relative)
    verdict = judge(theta, residual, k, tolerance, criterion, degree, n, failure_probability)
    return StopTest(verdict, relative)


def judge(
    theta: Tensor,
    residual: Tensor,
    k: int,
    tolerance: Tensor,
    criterion: StopCriterion,
    degree: int,
    n: int,
    failure_probability: float | None,
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
    3. With ``failure_probability`` p, the Kaniel–Paige–Saad degree test: T_d(1 + 2δᵢ/S) ≥ (2√n/p)·√(S/εᵢ),
       with δᵢ floored at τᵢ, S the span of the Ritz values widened by the end residuals, ε₁ = δ₁ for the
       top value and εᵢ = τᵢ below it. A random start has a component above p/√n along any fixed
       eigenvector with probability 1 − p·√(2/π) (a warm vector added to it keeps that density, at twice the
       norm), and a Krylov polynomial of degree d then pulls a Ritz value to within εᵢ of any eigenvalue δᵢ
       or more above θᵢ. For the top value that is a contradiction already at ε₁ = δ₁: the Chebyshev
       polynomial of degree d on [λ_min, θ₁] gives a vector of the space whose Rayleigh quotient exceeds θ₁,
       the largest Ritz value. Below the top the Ritz values above θᵢ enter the bound for the i-th one, and
       the stricter τᵢ leaves room for them.
    """
    batch, m = theta.shape
    tiny = torch.finfo(theta.dtype).tiny
    wanted = theta[:, -k:].flip(1)
    wanted_residual = residual[:, -k:].flip(1)
    own = torch.arange(m - 1, m - k - 1, -1, device=theta.device)
    centre_distance = (wanted[:, :, None] - theta[:, None, :]).abs()
    outside = centre_distance > tolerance[:, :, None]
    outside[:, torch.arange(k, device=theta.device), own] = False
    inf = torch.tensor(float("inf"), dtype=theta.dtype, device=theta.device)
    interval_gap = torch.where(outside, centre_distance - residual[:, None, :], inf).amin(dim=2).clamp_min(0)

    error = wanted_residual
    if criterion == "eigenvalue":
        error = torch.minimum(wanted_residual, wanted_residual.square() / interval_gap.clamp_min(tiny))
    met = (error <= tolerance).all(dim=1)

    below = theta[:, : m - k]
    past = below < (wanted[:, -1:] - tolerance[:, -1:])
    if m > k:
        index = torch.where(past, torch.arange(m - k, device=theta.device), -1).amax(dim=1)
        some = index >= 0
        first = index.clamp_min(0)[:, None]
        distance = wanted[:, -1] - below.gather(1, first)[:, 0]
        resolved = residual.gather(1, first)[:, 0] <= torch.maximum(distance / 2, tolerance[:, -1])
        met &= ~some | resolved
    else:
        met = torch.zeros_like(met)
    least_degree = torch.zeros(batch, dtype=theta.dtype, device=theta.device)
    if failure_probability is None:
        return Verdict(met, least_degree)
    if m <= k:
        return Verdict(met, least_degree)
    spread = (theta[:, -1] - theta[:, 0] + residual[:, -1] + residual[:, 0])[:, None].clamp_min(tiny)
    certain = 2 * n**0.5 / failure_probability
    gap = torch.maximum(interval_gap, tolerance)
    pulled = pulled_within(gap, tolerance).clamp_min(tiny)
    needed = torch.acosh((certain * (spread / pulled).sqrt()).clamp_min(1))
    certified = (degree * torch.acosh(1 + 2 * gap / spread) >= needed).all(dim=1)
    # Once the error bounds are met the wanted values have converged; the Ritz values below them only rise
    # and the span only widens, so the gap to the next Ritz value's centre (plus the tolerance) and the span
    # of today's values bound the degree the test will ever need from below.
    centre_gap = torch.where(outside, centre_distance, inf).amin(dim=2) + tolerance
    bare_spread = (theta[:, -1] - theta[:, 0])[:, None].clamp_min(tiny)
    lower = torch.acosh(
        (certain * (bare_spread / pulled_within(centre_gap, tolerance).clamp_min(tiny)).sqrt()).clamp_min(1)
    )
    least = (lower / torch.acosh(1 + 2 * centre_gap / bare_spread)).amax(dim=1)
    least_degree = torch.where(met & ~certified, least, least_degree)
    return Verdict(met & certified, torch.nan_to_num(least_degree, nan=0.0, posinf=float(2**31)))


def pulled_within(gap: Tensor, tolerance: Tensor) -> Tensor:
    """How close (B, k) the degree test must pull a Ritz value to an unseen eigenvalue δᵢ or more above θᵢ.

    The top value needs only δ₁: a Ritz value pulled within δ₁ of an eigenvalue δ₁ or more above θ₁ would lie
    above θ₁, which is the largest. The values below it keep τᵢ: between θᵢ and an unseen eigenvalue above
    it lie the Ritz values above θᵢ, and the bound for the i-th Ritz value carries factors of their gaps that
    τᵢ leaves room for and δᵢ would not.
    """
    return torch.cat([gap[:, :1], tolerance[:, 1:]], dim=1)


def beyond_tolerance(
    theta: Tensor, wanted_residual: Tensor, tolerance: Tensor, criterion: StopCriterion
) -> bool:
    """Whether every batch element fails test 1 of :func:`judge` for certain, judged from bounds that cost a
    few operations instead of the whole test: the error bound min(r, r²/δ) is at least min(r, r²/S) with S
    the span of the Ritz values, since δ ≤ S whenever some Ritz value lies outside θᵢ's cluster, which it
    must when S > 2τᵢ."""
    if criterion == "residual":
        return bool((wanted_residual > tolerance).any(dim=1).all())
    span = (theta[:, -1] - theta[:, 0])[:, None]
    least_error = torch.minimum(
        wanted_residual, wanted_residual.square() / span.clamp_min(torch.finfo(theta.dtype).tiny)
    )
    return bool(((least_error > tolerance) & (span > 2 * tolerance)).any(dim=1).all())


def least_degree(n: int, failure_probability: float) -> float:
    """The degree below which the certificate of :func:`judge` fails whatever the spectrum: its gap is at
    most the span of the spectrum and its tolerance at most that span."""
    return math.acosh(2 * n**0.5 / failure_probability) / math.acosh(3)

"""The start-component bound of the gap-free certificate against the exact components of a start along the
eigenvectors of a diagonal operator, where every one of them is known."""

from __future__ import annotations

import numpy as np
import pytest

from spectral_monitor.linalg.lanczos_certificate import LanczosRecurrence, hidden_component, start_certainty


def lanczos_recurrence(
    spectrum: np.ndarray, start: np.ndarray, steps: int
) -> tuple[LanczosRecurrence, float]:
    """Single-vector Lanczos on diag(``spectrum``) in float64 with full reorthogonalisation; its recurrence
    (departures: what the reorthogonalisation removed, plus float64 rounding) and its top Ritz value."""
    basis = [start / np.linalg.norm(start)]
    alpha, beta, departure = [], [], []
    for _ in range(steps):
        w = spectrum * basis[-1]
        alpha.append(basis[-1] @ w)
        w = w - alpha[-1] * basis[-1] - (beta[-1] * basis[-2] if beta else 0)
        older = np.array(basis) @ w  # what the three-term recurrence left, removed twice
        w = w - np.array(basis).T @ older
        again = np.array(basis) @ w
        w = w - np.array(basis).T @ again
        departure.append(np.linalg.norm(older) + np.linalg.norm(again) + 1e-14)
        beta.append(np.linalg.norm(w))
        basis.append(w / beta[-1])
    tridiagonal = np.diag(alpha) + np.diag(beta[:-1], 1) + np.diag(beta[:-1], -1)
    recurrence = LanczosRecurrence(np.array([alpha]), np.array([beta]), np.array([departure]))
    return recurrence, float(np.linalg.eigvalsh(tridiagonal)[-1])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("steps", [4, 10, 25])
def test_the_bound_holds_for_every_eigenvector_at_or_above_mu(seed: int, steps: int) -> None:
    """Clusters just above a bulk, and a start whose components along the top are tiny: every true component
    at an eigenvalue μ or more stays within the bound, for μ from just above the top Ritz value up."""
    generator = np.random.default_rng(seed)
    n = 300
    bulk = generator.uniform(-0.3, 0.6, n - 6)
    top = 1 + generator.choice([1e-4, 1e-3, 1e-2], 6) * np.arange(6)
    spectrum = np.concatenate([top, bulk])
    start = generator.standard_normal(n)
    start[:6] *= generator.choice([1e-4, 1e-2, 1.0], 6)
    start /= np.linalg.norm(start)
    recurrence, theta = lanczos_recurrence(spectrum, start, steps)
    for offset in (1e-5, 1e-4, 1e-3, 1e-2, 0.1):
        mu = theta + offset
        bound, _ = hidden_component(recurrence, np.array([mu]))
        above = spectrum >= mu
        if above.any():
            assert np.abs(start[above]).max() <= bound[0], (offset, np.abs(start[above]).max(), bound[0])


def test_the_bound_falls_below_the_components_of_eigenvalues_the_space_has_resolved() -> None:
    """An isolated top over a bulk: after 30 steps nothing above the top Ritz value can have 1e-6 of the
    start, and with μ below an eigenvalue the start has weight on, no bound can say less than that weight."""
    n = 200
    spectrum = np.concatenate([[1.0], np.linspace(-0.3, 0.6, n - 1)])
    start = np.full(n, n**-0.5)
    recurrence, theta = lanczos_recurrence(spectrum, start, 30)
    bound, _ = hidden_component(recurrence, np.array([theta + 1e-4]))
    assert bound[0] < 1e-6
    shorter, theta = lanczos_recurrence(spectrum, start, 3)
    assert theta < 1.0
    bound, _ = hidden_component(shorter, np.array([theta + 1e-6]))
    assert bound[0] >= n**-0.5


@pytest.mark.parametrize("n", [2, 3, 10, 200])
@pytest.mark.parametrize("mixed", [False, True])
def test_a_random_start_falls_below_the_threshold_with_probability_at_most_p(n: int, mixed: bool) -> None:
    """The start's component along a fixed eigenvector u, sampled 400,000 times, is below 1/C no more often
    than p (with four standard errors of the sampling to spare); a mixed start is tried with the warm vector
    along u (its component shifted as far as it goes), against it, orthogonal to it and in between. Cold
    starts at n ≥ 3 meet at least 0.7·p: the threshold is not a loose constant (at n = 3, 0.72·p exactly)."""
    p, draws = 0.05, 400_000
    rng = np.random.default_rng(n)
    # A Gaussian start's first two coordinates and its squared norm (the rest of it: chi-squared, n − 2).
    first, second = rng.standard_normal(draws), rng.standard_normal(draws)
    rest = rng.chisquare(n - 2, draws) if n > 2 else np.zeros(draws)
    norm = np.sqrt(first**2 + second**2 + rest)
    along, across = first / norm, second / norm  # along u and along a unit vector orthogonal to it
    threshold = 1 / start_certainty(n, p, mixed=mixed)
    margin = 4 * (p * (1 - p) / draws) ** 0.5
    if not mixed:
        below = float(np.mean(np.abs(along) < threshold))
        assert below <= p + margin
        if n >= 3:
            assert below >= 0.7 * p
        return
    for warm_along in (1.0, -1.0, 0.0, 0.5**0.5, 0.2 / 1.04**0.5):
        warm_across = (1 - warm_along**2) ** 0.5
        # ‖g/‖g‖ + w‖² = 2 + 2·(g/‖g‖)ᵀw, w in the plane of u and the orthogonal unit vector
        start_norm = np.sqrt(np.maximum(2 + 2 * (along * warm_along + across * warm_across), 0))
        component = np.abs(along + warm_along) / np.maximum(start_norm, 1e-300)
        assert float(np.mean(component < threshold)) <= p + margin


def test_the_threshold_falls_as_the_root_of_n_with_p_and_halves_for_a_mixed_start() -> None:
    """C = √(2n/π)/p is the inverse of the threshold t: t falls as 1/√n, in proportion to p, and halves for a
    mixed start, except at n = 2, where a mixed start's component is bounded by p²/2."""
    assert start_certainty(1000, 0.01) == pytest.approx((2 * 1000 / np.pi) ** 0.5 / 0.01)
    assert start_certainty(4000, 0.01) == pytest.approx(2 * start_certainty(1000, 0.01))
    assert start_certainty(1000, 0.02) == pytest.approx(start_certainty(1000, 0.01) / 2)
    assert start_certainty(1000, 0.01, mixed=True) == pytest.approx(2 * start_certainty(1000, 0.01))
    assert start_certainty(2, 0.1, mixed=True) == pytest.approx(200)

"""Whole-spectrum summaries of a weight matrix: power-law tail α, energy (compressible) rank, the MP density.

Conventions follow WeightWatcher (Martin & Mahoney 2021) so numbers compare with it: the empirical spectral
density (ESD) is that of the eigenvalues λᵢ = σᵢ² of WᵀW (the smaller Gram matrix), and α is the maximum-
likelihood exponent of a continuous power law p(λ) ∝ λ^{−α} on [λ_min, ∞), with λ_min chosen among the
eigenvalues to minimise the Kolmogorov–Smirnov distance between the tail and the fit (Clauset, Shalizi &
Newman 2009; the ``powerlaw`` package and WeightWatcher's own fast fitter do the same).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from spectral_monitor.metrics._common import threshold_rank_from_singular_values

MIN_TAIL = 2
"""A candidate λ_min must leave at least this many eigenvalues in the tail."""
_KS_CHUNK = 256


def power_law_alpha(eigenvalues: Tensor) -> dict[str, Tensor]:
    """Power-law fit of the tail of ``eigenvalues``, WeightWatcher's convention (module docstring).

    Eigenvalues that are zero up to rounding (≤ k·ε·λ_max) are left out, as a rank-deficient matrix's are.
    For each candidate λ_min = λ_(i) (ascending, all but the largest), α_i = 1 + n_i / Σ_{j≥i} log(λ_j/λ_(i))
    with n_i the tail size, and D_i = max_{j≥i} |F_fit(λ_j) − (j − i)/n_i| with
    F_fit(λ) = 1 − (λ/λ_(i))^{1−α_i}. The fit kept is the candidate with the smallest D among those with
    α_i > 1 and at least ``MIN_TAIL`` eigenvalues in the tail.

    Args:
        eigenvalues: (k,) floating, the eigenvalues λᵢ = σᵢ² of WᵀW in any order; computed in float64.

    Returns:
        0-d float64 tensors by name: ``alpha`` (the fitted α), ``xmin`` (its λ_min), ``ks_distance`` (its D)
        and ``tail_size`` (its n_i, as a float). All NaN where fewer than ``MIN_TAIL`` eigenvalues are
        usable or no candidate fits.

    Raises:
        ValueError: ``eigenvalues`` is not a 1-D floating tensor, or holds a negative value.

    Examples:
        Eigenvalues at the quantiles of a Pareto law of exponent 3 give back α ≈ 3 over the whole spectrum:

        >>> import torch
        >>> quantiles = (torch.arange(200, dtype=torch.float64) + 0.5) / 200
        >>> fit = power_law_alpha((1 - quantiles) ** -0.5)
        >>> round(float(fit["alpha"]), 2), int(fit["tail_size"])
        (3.01, 200)
        >>> bool(power_law_alpha(torch.tensor([1.0]))["alpha"].isnan())  # one eigenvalue: no tail
        True
    """
    if not isinstance(eigenvalues, Tensor) or eigenvalues.ndim != 1 or not eigenvalues.is_floating_point():
        raise ValueError(f"eigenvalues must be a 1-D floating tensor, got {_describe(eigenvalues)}")
    values = eigenvalues.detach().to(torch.float64).sort().values
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=values.device)
    if values.numel() and bool((values < 0).any()):
        raise ValueError("eigenvalues must be >= 0 (they are σ² of a weight)")
    if values.numel():
        floor = values.numel() * torch.finfo(torch.float64).eps * values[-1]
        values = values[values > floor]
    k = values.numel()
    if k < MIN_TAIL:
        return {"alpha": nan, "xmin": nan, "ks_distance": nan, "tail_size": nan}

    logs = values.log()
    suffix_log_sums = logs.flip(0).cumsum(0).flip(0)
    candidates = torch.arange(k - 1, device=values.device)
    tail_sizes = (k - candidates).to(torch.float64)
    spread = suffix_log_sums[:-1] - tail_sizes * logs[:-1]
    alphas = 1 + tail_sizes / spread.clamp_min(torch.finfo(torch.float64).tiny)

    distances = torch.full((k - 1,), math.inf, dtype=torch.float64, device=values.device)
    index = torch.arange(k, device=values.device)
    for start in range(0, k - 1, _KS_CHUNK):
        rows = candidates[start : start + _KS_CHUNK]
        in_tail = index[None, :] >= rows[:, None]
        ratio = (logs[None, :] - logs[rows][:, None]).clamp_min(0)
        fitted = 1 - torch.exp((1 - alphas[rows])[:, None] * ratio)
        empirical = (index[None, :] - rows[:, None]).to(torch.float64) / tail_sizes[rows][:, None]
        gap = torch.where(in_tail, (fitted - empirical).abs(), torch.zeros_like(fitted))
        distances[start : start + _KS_CHUNK] = gap.amax(dim=1)
    usable = (alphas > 1) & (tail_sizes >= MIN_TAIL) & (spread > 0)
    distances = torch.where(usable, distances, torch.full_like(distances, math.inf))
    if not bool(usable.any()):
        return {"alpha": nan, "xmin": nan, "ks_distance": nan, "tail_size": nan}
    best = int(distances.argmin())
    return {
        "alpha": alphas[best],
        "xmin": values[best],
        "ks_distance": distances[best],
        "tail_size": tail_sizes[best],
    }


def energy_rank(singular_values: Tensor, level: float) -> Tensor:
    """Smallest k whose top singular values keep ``level`` of the energy: Σ_{i≤k} σᵢ² ≥ level·Σσᵢ².

    The rank a truncated SVD needs to keep that fraction of ‖W‖_F² (Eckart–Young: the discarded fraction is
    then the relative squared Frobenius error, at most 1 − level). The attention metrics' threshold rank is
    ``energy_rank(σ, 0.99)``.

    Args:
        singular_values: (..., k) floating, each row sorted descending.
        level: The fraction of Σσᵢ² to keep, in (0, 1].

    Returns:
        (...,) the rank k of each row, as a floating tensor.

    Raises:
        ValueError: ``level`` is not a number in (0, 1].

    Examples:
        σ = (3, 1, 1) has energies 9, 1, 1 of 11: the top value keeps 82%, the top two 91%.

        >>> import torch
        >>> sigma = torch.tensor([3.0, 1.0, 1.0])
        >>> int(energy_rank(sigma, 0.8)), int(energy_rank(sigma, 0.9)), int(energy_rank(sigma, 1.0))
        (1, 2, 3)
    """
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level <= 1:
        raise ValueError(f"level must be a fraction in (0, 1], got {level!r}")
    return threshold_rank_from_singular_values(singular_values, float(level))


def marchenko_pastur_density(eigenvalues: Tensor, rows: int, cols: int, variance: float) -> Tensor:
    """Limiting (Marchenko–Pastur) density of the eigenvalues of WᵀW, the min(N, M)-sided Gram matrix, for
    W N×M with iid entries of variance σ².

    With p = min(N, M), λ± = σ²(√N ± √M)²: ρ(λ) = √((λ₊ − λ)(λ − λ₋)) / (2π σ² p λ) on (λ₋, λ₊), zero
    outside, integrating to 1. The singular values then lie within σ(√N ± √M), the edge of
    :func:`~spectral_monitor.metrics.marchenko_pastur_edge`.

    Args:
        eigenvalues: Where to evaluate ρ: a tensor of any shape (the values λ, not σ).
        rows: N, the rows of W (≥ 1).
        cols: M, the columns of W (≥ 1).
        variance: σ², the variance of W's entries (> 0).

    Returns:
        Float64 ρ(λ) of ``eigenvalues``' shape.

    Raises:
        ValueError: ``rows`` or ``cols`` is below 1, or ``variance`` is not positive.

    Examples:
        A square W with σ² = 1/N: support [0, 4], ρ(λ) = √((4 − λ)λ) / (2πλ).

        >>> import torch
        >>> density = marchenko_pastur_density(torch.tensor([1.0, 2.0, 5.0]), 100, 100, 0.01)
        >>> [round(value, 4) for value in density.tolist()]
        [0.2757, 0.1592, 0.0]
    """
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be >= 1, got {rows!r}, {cols!r}")
    if not variance > 0:
        raise ValueError(f"variance must be > 0, got {variance!r}")
    small = min(rows, cols)
    lower = variance * (math.sqrt(rows) - math.sqrt(cols)) ** 2
    upper = variance * (math.sqrt(rows) + math.sqrt(cols)) ** 2
    x = eigenvalues.to(torch.float64)
    inside = (x > lower) & (x < upper)
    product = ((upper - x) * (x - lower)).clamp_min(0)
    density = product.sqrt() / (2 * math.pi * variance * small * x.clamp_min(torch.finfo(torch.float64).tiny))
    return torch.where(inside, density, torch.zeros_like(density))


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__

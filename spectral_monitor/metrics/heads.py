"""Head spectral diversity: how different the singular-value spectra of a layer's attention heads are.

Definition. Head h of a layer has attention A_h with singular values σ_{h,1} ≥ σ_{h,2} ≥ …; its normalised
spectrum is p_h = σ_h / Σσ_h, the distribution whose entropy defines the effective rank (Roy & Vetterli).
The distance between heads h and g is the Jensen–Shannon distance of p_h and p_g (spectra aligned by index),
in bits: it lies in [0, 1), 0 for identical spectra and approaching 1 for a
rank-one head against a flat spectrum over many singular values. It is a metric (Endres & Schindelin 2003).

A layer's ``head_diversity`` is the mean distance over its head pairs; the closest pairs are its most
redundant heads *spectrally*: two heads with the same spectrum have the same rank structure (both near rank
one, both spread out), not necessarily the same attention pattern. A permutation of the keys, for
instance, leaves a head's spectrum unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["head_diversity", "head_spectral_distances", "most_redundant_head_pairs"]


def head_spectral_distances(singular_values: Tensor) -> Tensor:
    """Jensen–Shannon distances (bits) between the normalised spectra of heads: (..., H, k) -> (..., H, H).

    Args:
        singular_values: Floating point (..., H, k), each head's singular values in any order (sorted here).

    Returns:
        Float64 (..., H, H) distances in [0, 1), symmetric with a zero diagonal. A head whose singular values
        are all zero has no spectrum: its row and column are NaN.

    Raises:
        ValueError: ``singular_values`` is not a floating-point tensor of at least 2 dimensions.

    Examples:
        Two heads of the same spectrum, and a rank-one head:

        >>> import torch
        >>> spectra = torch.tensor([[1.0, 1.0], [2.0, 2.0], [1.0, 0.0]])
        >>> head_spectral_distances(spectra).round(decimals=4)
        tensor([[0.0000, 0.0000, 0.5579],
                [0.0000, 0.0000, 0.5579],
                [0.5579, 0.5579, 0.0000]], dtype=torch.float64)
    """
    if not isinstance(singular_values, Tensor) or singular_values.ndim < 2:
        raise ValueError(
            "singular_values must be a tensor of shape (..., heads, k), got "
            f"{getattr(singular_values, 'shape', type(singular_values).__name__)}"
        )
    if not singular_values.is_floating_point():
        raise ValueError(f"singular_values must be floating point, got {singular_values.dtype}")
    sigma = singular_values.to(torch.float64).abs().sort(dim=-1, descending=True).values
    totals = sigma.sum(dim=-1, keepdim=True)
    p = sigma / torch.where(totals > 0, totals, torch.ones_like(totals))
    left, right = p[..., :, None, :], p[..., None, :, :]
    middle = (left + right) / 2
    divergence = 0.5 * (_kl_terms(left, middle) + _kl_terms(right, middle)).sum(dim=-1) / math.log(2)
    distances = divergence.clamp(0, 1).sqrt()
    empty = (totals[..., 0] <= 0) | ~torch.isfinite(totals[..., 0])
    missing = empty[..., :, None] | empty[..., None, :]
    return torch.where(missing, torch.full_like(distances, float("nan")), distances)


def head_diversity(distances: Tensor) -> dict[str, Tensor]:
    """The summaries of a layer's (..., H, H) head distances over pairs h < g.

    Args:
        distances: (..., H, H) distances of :func:`head_spectral_distances`.

    Returns:
        Tensors of shape ``distances.shape[:-2]`` by name: ``head_diversity``, the mean distance;
        ``head_diversity_min``, the closest pair's distance (its most redundant pair). NaN with fewer than
        two heads.

    Examples:
        >>> import torch
        >>> distances = torch.tensor([[0.0, 0.2, 0.6], [0.2, 0.0, 0.4], [0.6, 0.4, 0.0]])
        >>> {name: round(value.item(), 6) for name, value in head_diversity(distances).items()}
        {'head_diversity': 0.4, 'head_diversity_min': 0.2}
    """
    heads = distances.shape[-1]
    upper = torch.triu(torch.ones(heads, heads, dtype=torch.bool, device=distances.device), diagonal=1)
    pairs = distances[..., upper]
    if pairs.shape[-1] == 0:
        nan = torch.full(distances.shape[:-2], float("nan"), dtype=distances.dtype, device=distances.device)
        return {"head_diversity": nan, "head_diversity_min": nan.clone()}
    return {"head_diversity": pairs.nanmean(dim=-1), "head_diversity_min": _nanmin(pairs)}


def most_redundant_head_pairs(distances: Tensor, count: int = 3) -> list[tuple[int, int, float]]:
    """The ``count`` closest head pairs of one layer, closest first.

    Args:
        distances: One (H, H) matrix of :func:`head_spectral_distances`.
        count: How many pairs, at most; pairs at a NaN distance are left out.

    Returns:
        ``(h, g, distance)`` tuples with h < g.

    Raises:
        ValueError: ``distances`` is not one square matrix, or ``count`` is not a positive int.

    Examples:
        >>> import torch
        >>> distances = torch.tensor([[0.0, 0.2, 0.6], [0.2, 0.0, 0.4], [0.6, 0.4, 0.0]])
        >>> [(h, g, round(d, 6)) for h, g, d in most_redundant_head_pairs(distances, count=2)]
        [(0, 1, 0.2), (1, 2, 0.4)]
    """
    if distances.ndim != 2 or distances.shape[0] != distances.shape[1]:
        raise ValueError(f"distances must be one (heads, heads) matrix, got shape {tuple(distances.shape)}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    h, g = torch.triu_indices(distances.shape[0], distances.shape[0], offset=1, device=distances.device)
    values = distances[h, g]
    order = torch.argsort(torch.where(values.isnan(), torch.full_like(values, math.inf), values))
    return [(int(h[i]), int(g[i]), float(values[i])) for i in order[:count] if not values[i].isnan()]


def _kl_terms(p: Tensor, q: Tensor) -> Tensor:
    """p log(p/q) elementwise, 0 where p = 0."""
    return torch.special.xlogy(p, p) - torch.special.xlogy(p, q.clamp_min(torch.finfo(q.dtype).tiny))


def _nanmin(values: Tensor) -> Tensor:
    filled = torch.where(values.isnan(), torch.full_like(values, math.inf), values)
    smallest = filled.amin(dim=-1)
    return torch.where(torch.isinf(smallest), torch.full_like(smallest, float("nan")), smallest)

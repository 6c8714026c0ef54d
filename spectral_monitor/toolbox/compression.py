"""Low-rank compression of linear layers by truncated SVD ("compressible rank").

Eckart–Young: the best rank-r approximation of W in the Frobenius and spectral norms is its truncated SVD
W_r = U_r Σ_r V_rᵀ, with ‖W − W_r‖_F² = Σ_{i>r} σᵢ² and ‖W − W_r‖₂ = σ_{r+1}. A layer whose energy rank at
99% (:func:`~spectral_monitor.metrics.spectra.energy_rank`) is well below min(N, M) loses at most 1% of
‖W‖_F² when factorised at that rank, and the two factors hold r(N + M) numbers instead of NM.
"""

from __future__ import annotations

import torch
from torch import nn

from spectral_monitor.metrics.spectra import energy_rank

__all__ = ["low_rank_linear"]


@torch.no_grad()
def low_rank_linear(
    linear: nn.Linear, *, rank: int | None = None, energy: float | None = None
) -> nn.Sequential:
    """A new ``nn.Sequential(Linear(in, r, bias=False), Linear(r, out))`` computing x ↦ W_r x + b.

    The factors split Σ_r evenly (U_r Σ_r^½ and Σ_r^½ V_rᵀ), so their scales match; the bias is copied.
    ``linear`` is not modified. The SVD runs in float64; the factors take the layer's dtype and device.

    Args:
        linear: The layer to factorise.
        rank: r, with 1 ≤ r ≤ min(N, M).
        energy: A fraction in (0, 1]: r is the smallest rank keeping that share of ‖W‖_F². Exactly one of
            ``rank`` and ``energy`` is given.

    Returns:
        The two factors as an ``nn.Sequential``, W_r = U_r Σ_r V_rᵀ the best rank-r approximation of W.

    Raises:
        ValueError: ``linear`` is not an ``nn.Linear``, both or neither of ``rank`` and ``energy`` are given,
            or ``rank`` is out of range.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> layer = nn.Linear(8, 6, dtype=torch.float64)
        >>> with torch.no_grad():
        ...     _ = layer.weight.copy_(torch.outer(torch.arange(6.0), torch.ones(8)))
        >>> compressed = low_rank_linear(layer, rank=1)
        >>> x = torch.randn(3, 8, dtype=torch.float64)
        >>> torch.allclose(compressed(x), layer(x))
        True
    """
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"linear must be an nn.Linear, got {type(linear).__name__}")
    if (rank is None) == (energy is None):
        raise ValueError(f"pass exactly one of rank or energy, got rank={rank!r}, energy={energy!r}")
    if energy is not None and (
        isinstance(energy, bool) or not isinstance(energy, (int, float)) or not 0 < energy <= 1
    ):
        raise ValueError(f"energy must be a fraction in (0, 1], got {energy!r}")
    weight = linear.weight.detach()
    full_rank = min(weight.shape)
    u, sigma, vh = torch.linalg.svd(weight.to(torch.float64), full_matrices=False)
    if energy is not None:
        rank = int(energy_rank(sigma, energy))
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= full_rank:
        raise ValueError(f"rank must be an int in [1, {full_rank}] (min of the weight's sides), got {rank!r}")
    root = sigma[:rank].sqrt()
    with torch.random.fork_rng(devices=[]):  # their initialisers draw random numbers, all overwritten below
        down = nn.Linear(linear.in_features, rank, bias=False, device=weight.device, dtype=weight.dtype)
        has_bias = linear.bias is not None
        up = nn.Linear(rank, linear.out_features, bias=has_bias, device=weight.device, dtype=weight.dtype)
    down.weight.copy_(root[:, None] * vh[:rank])
    up.weight.copy_(u[:, :rank] * root[None, :])
    if linear.bias is not None:
        up.bias.copy_(linear.bias.detach())
    return nn.Sequential(down, up)

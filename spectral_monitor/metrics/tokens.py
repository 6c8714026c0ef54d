"""Token-collapse metrics of residual-stream states X (n tokens × d features), batched over leading dims."""

from __future__ import annotations

import torch
from torch import Tensor

from spectral_monitor.metrics._common import (
    all_singular_values,
    check_matrices,
    effective_rank_from_singular_values,
    flat_mask,
    nonfinite_matrices,
    scaled_where_needed,
    stable_rank,
    working_dtype_of,
)


def token_metrics(x: Tensor, *, token_mask: Tensor | None = None) -> dict[str, Tensor]:
    """Token similarity and rank of residual-stream states ``x`` (..., n, d).

    Exact (every singular value): sampled sequences are short enough. Where no token is real, or every real
    token is zero, there is nothing to measure: every metric is NaN and ``nonfinite`` False.

    Args:
        x: Floating-point states of n tokens × d features, batched over any leading dimensions.
        token_mask: Bool (..., n), True = real token; padded tokens are left out. None: every token is real.

    Returns:
        Tensors of shape ``x.shape[:-2]`` by name: ``cosine_similarity`` (mean over pairs i ≠ j of
        cos(xᵢ, xⱼ), Noci et al. 2022; NaN with fewer than 2 tokens), ``token_residual``
        (‖X − 1x̄ᵀ‖_F / ‖X‖_F, Dong et al. 2021), ``stable_rank`` (‖X‖_F²/σ₁²), ``effective_rank`` (Roy &
        Vetterli) and ``nonfinite`` (True where x had a NaN or inf; that element's metrics are NaN).

    Raises:
        ValueError: ``x`` is not a floating-point tensor of at least 2 dimensions, or ``token_mask`` does not
            match its leading shape.

    Examples:
        Four orthogonal tokens share no direction and span four:

        >>> import torch
        >>> m = token_metrics(torch.eye(4, dtype=torch.float64))
        >>> m["cosine_similarity"].item(), m["stable_rank"].item(), round(m["effective_rank"].item(), 6)
        (0.0, 4.0, 4.0)
    """
    x = check_matrices(x, "x")
    batch_shape, (n, d) = x.shape[:-2], x.shape[-2:]
    mask = flat_mask(token_mask, "token_mask", batch_shape, n, x.device)
    states = x.reshape(-1, n, d).to(working_dtype_of(x))
    frobenius = torch.linalg.matrix_norm(states)
    nonfinite = nonfinite_matrices(states, frobenius)
    every_token = bool(mask.all())
    if nonfinite.any() or not every_token:
        states = torch.where(nonfinite[:, None, None], torch.zeros_like(states), states) * mask[:, :, None]
        frobenius = torch.linalg.matrix_norm(states)
    # Every metric here is scale-invariant: scaled by a power of two (exact) where its norm is far from 1,
    # finite states near 1e19 cannot overflow the sums of squares.
    states, frobenius, _ = scaled_where_needed(states, frobenius)
    count = mask.sum(dim=1).to(states.dtype)

    norms = states.norm(dim=2, keepdim=True)
    unit = states / torch.where(norms > 0, norms, torch.ones_like(norms))
    pairs = count * (count - 1)
    cosine = unit.sum(dim=1).square().sum(dim=1) - unit.square().sum(dim=(1, 2))
    cosine = torch.where(pairs > 0, cosine / pairs.clamp_min(1), torch.full_like(cosine, float("nan")))

    mean = states.sum(dim=1) / count.clamp_min(1)[:, None]
    centred = states - (mean[:, None, :] if every_token else mask[:, :, None] * mean[:, None, :])
    residual = torch.linalg.matrix_norm(centred)
    residual = torch.where(
        frobenius > 0,
        residual / frobenius.clamp_min(torch.finfo(states.dtype).tiny),
        torch.full_like(frobenius, float("nan")),
    )

    singular_values = all_singular_values(states)
    metrics = {
        "cosine_similarity": cosine,
        "token_residual": residual,
        "stable_rank": stable_rank(frobenius.square(), singular_values[:, 0]),
        "effective_rank": effective_rank_from_singular_values(singular_values),
    }
    measurable = (frobenius > 0) | nonfinite
    for value in metrics.values():
        value[nonfinite | ~measurable] = float("nan")
    metrics["nonfinite"] = nonfinite
    return {name: value.reshape(batch_shape) for name, value in metrics.items()}

"""Weight-matrix spectra: spectral norm, stable rank, and the Marchenko–Pastur bulk edge and spikes."""

from __future__ import annotations

import torch
from torch import Tensor

from spectral_monitor.linalg import top_singular
from spectral_monitor.metrics._common import check_matrices, check_method, stable_rank, working_dtype_of

EXACT_MAX_SIZE = 512
"""``method="auto"`` takes the full SVD when the smaller side of the weight is at most this."""


def marchenko_pastur_edge(frobenius_squared: Tensor, rows: int, cols: int) -> Tensor:
    """Largest singular value of an iid N×M matrix of the same Frobenius norm: σ̂(√N + √M).

    Args:
        frobenius_squared: ‖W‖_F² of each weight, any shape.
        rows: N, the rows of each weight.
        cols: M, its columns.

    Returns:
        σ̂(√N + √M) with σ̂² = ‖W‖_F²/(NM), shaped like ``frobenius_squared``: the edge of the singular values
        of a random matrix with W's variance.

    Examples:
        >>> import torch
        >>> marchenko_pastur_edge(torch.tensor(16.0), 4, 4)
        tensor(4.)
    """
    sigma_hat = (frobenius_squared / (rows * cols)).sqrt()
    return sigma_hat * (rows**0.5 + cols**0.5)


def weight_metrics(
    w: Tensor, *, method: str = "auto", generator: torch.Generator | None = None
) -> dict[str, Tensor]:
    """Spectral summary of weights ``w`` (..., N, M).

    For a persistent warm-started estimate during training use :class:`spectral_monitor.probes.WeightProbe`.

    Args:
        w: Floating-point weights, batched over any leading dimensions.
        method: ``"exact"`` (every singular value), ``"krylov"`` (block Lanczos, σ₁ only) or ``"auto"``
            (exact up to ``EXACT_MAX_SIZE`` on the smaller side).
        generator: The random generator of the Krylov start, for a reproducible estimate.

    Returns:
        Tensors of shape ``w.shape[:-2]`` by name: ``spectral_norm`` σ₁, ``frobenius_norm``, ``stable_rank``
        ‖W‖_F²/σ₁²; on the exact path also ``mp_edge`` (:func:`marchenko_pastur_edge`) and ``mp_spikes``
        (#{σᵢ > mp_edge}, learned structure above the noise bulk).

    Raises:
        ValueError: ``w`` is not a floating-point tensor of at least 2 dimensions, or ``method`` is not one
            of the three.

    Examples:
        >>> import torch
        >>> m = weight_metrics(torch.diag(torch.tensor([3.0, 1.0], dtype=torch.float64)))
        >>> m["spectral_norm"].item(), round(m["stable_rank"].item(), 6)
        (3.0, 1.111111)
    """
    w = check_matrices(w, "w")
    method = check_method(method)
    batch_shape, (rows, cols) = w.shape[:-2], w.shape[-2:]
    matrices = w.reshape(-1, rows, cols).to(working_dtype_of(w))
    exact = method == "exact" or (method == "auto" and min(rows, cols) <= EXACT_MAX_SIZE)
    frobenius_squared = matrices.square().sum(dim=(1, 2))
    metrics: dict[str, Tensor] = {"frobenius_norm": frobenius_squared.sqrt()}
    if exact:
        singular_values = torch.linalg.svdvals(matrices)
        sigma1 = singular_values[:, 0]
        edge = marchenko_pastur_edge(frobenius_squared, rows, cols)
        metrics["mp_edge"] = edge
        metrics["mp_spikes"] = (singular_values > edge[:, None]).sum(dim=1).to(matrices.dtype)
    else:
        sigma1 = top_singular(matrices, 1, tol=1e-5, generator=generator, return_vectors=False).values[:, 0]
    metrics["spectral_norm"] = sigma1
    metrics["stable_rank"] = stable_rank(frobenius_squared, sigma1)
    return {name: value.reshape(batch_shape) for name, value in metrics.items()}

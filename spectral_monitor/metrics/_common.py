"""Shared pieces of the metric catalogue: input checks and the spectral summaries of singular values."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from spectral_monitor.linalg.host_lapack import gram_eigenvalues

METHODS = ("auto", "exact", "krylov")
"""How the spectral metrics are computed: every singular value, the Krylov engine, or whichever fits n."""
ENERGY_LEVEL = 0.99
"""Threshold rank keeps this fraction of the squared Frobenius norm (the threshold rank's definition)."""


_SCALE_EXPONENT_MARGIN = 8
_NORMAL_NORM_LOW, _NORMAL_NORM_HIGH = 2.0**-40, 2.0**40


def check_matrices(value: object, name: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise ValueError(
            f"{name} must be a torch.Tensor of shape (..., rows, cols), got {type(value).__name__}"
        )
    if value.ndim < 2:
        raise ValueError(
            f"{name} must have at least 2 dims (..., rows, cols), got shape {tuple(value.shape)}"
        )
    if not value.dtype.is_floating_point:
        raise ValueError(
            f"{name} must be a floating tensor (float16, bfloat16, float32, float64), got {value.dtype}"
        )
    if value.shape[-1] == 0 or value.shape[-2] == 0:
        raise ValueError(f"{name} must have non-empty rows and columns, got shape {tuple(value.shape)}")
    return value


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


def flat_mask(
    mask: Tensor | None, name: str, batch_shape: torch.Size, size: int, device: torch.device
) -> Tensor:
    """A bool mask broadcast to ``batch_shape + (size,)`` and flattened to (B, size); all True if None."""
    if mask is None:
        return torch.ones((max(batch_shape.numel(), 1), size), dtype=torch.bool, device=device)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise ValueError(
            f"{name} must be a bool tensor (True = keep), got "
            f"{mask.dtype if isinstance(mask, Tensor) else type(mask).__name__}"
        )
    try:
        full = torch.broadcast_to(mask.to(device), (*batch_shape, size))
    except RuntimeError as error:
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not broadcast to {(*batch_shape, size)}"
        ) from error
    return full.reshape(-1, size)


def nonfinite_matrices(matrices: Tensor, norms: Tensor | None = None) -> Tensor:
    """(B,) True where a matrix of a (B, n, m) batch holds a NaN or inf, read from its Frobenius norm
    ``norms`` (B,) (computed where not given).

    A NaN or inf entry makes the norm non-finite, and so can squares of large finite entries: only the
    matrices whose norm is not finite are checked entry by entry. A batched ``isfinite`` writes a mask of
    every entry and costs about 15 times the norm's one pass on the CPU.
    """
    if norms is None:
        norms = torch.linalg.matrix_norm(matrices)
    flagged = ~torch.isfinite(norms)
    for index in flagged.nonzero().flatten().tolist():
        flagged[index] = not bool(torch.isfinite(matrices[index]).all())
    return flagged


def power_of_two_exponents(matrices: Tensor) -> Tensor:
    """(B,) int exponents e with each matrix of a (B, n, m) batch times 2⁻ᵉ having its largest entry in
    [0.5, 1), within the normal range of the batch's dtype less 8 bits of exponent (2^±120 in float32,
    2^±1016 in float64); 0 for a zero or non-finite matrix.

    Sums of squares of finite float32 entries near 1e19 overflow (‖X‖_F, Gram matrices), of float64 entries
    near 1e154; of the scaled matrix they cannot. A power of two multiplies exactly, so a norm scaled back, or
    a scale-invariant ratio, is bit for bit what the unscaled matrix gives wherever that does not overflow or
    underflow.
    """
    # Two reductions: ``abs`` would first write a copy of every entry.
    largest = torch.maximum(matrices.amax(dim=(1, 2)), -matrices.amin(dim=(1, 2)))
    _, exponent = torch.frexp(largest)
    usable = largest.isfinite() & (largest > 0)
    largest_exponent = math.frexp(torch.finfo(matrices.dtype).max)[1] - _SCALE_EXPONENT_MARGIN
    return torch.where(usable, exponent.clamp(-largest_exponent, largest_exponent), 0)


def scaled_where_needed(matrices: Tensor, frobenius: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``matrices`` (B, n, m) with each one whose Frobenius norm ``frobenius`` (B,) lies outside
    [2⁻⁴⁰, 2⁴⁰] (or is not finite) divided by 2ᵉ, e from :func:`power_of_two_exponents`; the others as
    they are (e = 0).

    Within that range no sum of squares of the matrix can overflow, nor its largest entries' squares
    underflow, so scaling would change no result: a power of two multiplies exactly. Skipping it saves two
    reductions and a multiply over every entry in the common case.

    Returns:
        The matrices (``matrices`` itself when none is scaled, else a scaled copy), their Frobenius norms
        (``frobenius`` where none is scaled) and the exponents e, (B,) ints.
    """
    normal = frobenius.isfinite() & (frobenius >= _NORMAL_NORM_LOW) & (frobenius <= _NORMAL_NORM_HIGH)
    if bool(normal.all()):
        return matrices, frobenius, torch.zeros(frobenius.shape, dtype=torch.int32, device=frobenius.device)
    exponents = torch.where(normal, 0, power_of_two_exponents(matrices))
    scaled = matrices * powers_of_two(-exponents, matrices.dtype)[:, None, None]
    return scaled, torch.linalg.matrix_norm(scaled), exponents


def powers_of_two(exponents: Tensor, dtype: torch.dtype) -> Tensor:
    """2^``exponents`` in ``dtype``, exactly."""
    return torch.ldexp(torch.ones(exponents.shape, dtype=dtype, device=exponents.device), exponents)


def working_dtype_of(tensor: Tensor) -> torch.dtype:
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def all_singular_values(matrices: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Every singular value of each matrix of a (B, n, m) batch, descending, in ``dtype`` (None: the
    batch's).

    Lower precisions: the square roots of the eigenvalues of the smaller Gram matrix formed in float64, whose
    errors (≈ 1e-16 σ₁²) put each σᵢ within ~1e-8 σ₁ of the truth, closer than float32 ``svdvals`` rounds it
    (≈ 6e-8 σ₁ on the CPU; CUDA's float32 ``svdvals`` is further off) and faster on the many small matrices
    of the exact path. float64 batches use ``svdvals``.
    """
    dtype = matrices.dtype if dtype is None else dtype
    if matrices.dtype == torch.float64:
        return torch.linalg.svdvals(matrices).to(dtype)
    precise = matrices.double()
    if matrices.shape[1] > matrices.shape[2]:
        precise = precise.transpose(1, 2)
    return gram_eigenvalues(precise).flip(-1).clamp_min(0).sqrt().to(dtype)


def effective_rank_from_singular_values(singular_values: Tensor) -> Tensor:
    """Roy & Vetterli (2007): exp of the entropy of σ/Σσ; 0 for an all-zero matrix."""
    total = singular_values.sum(dim=-1, keepdim=True)
    p = singular_values / torch.where(total > 0, total, torch.ones_like(total))
    erank = torch.exp(-torch.special.xlogy(p, p).sum(dim=-1))
    return torch.where(total.squeeze(-1) > 0, erank, torch.zeros_like(erank))


def threshold_rank_from_singular_values(singular_values: Tensor, level: float = ENERGY_LEVEL) -> Tensor:
    """Smallest k with Σ_{i≤k} σᵢ² ≥ level · Σ σᵢ² (singular values sorted descending)."""
    energy = singular_values.square()
    cumulative = energy.cumsum(dim=-1)
    target = level * cumulative[..., -1:]
    # Relative slack so that an exactly-met level (identity: k/n = 0.99) is not lost to rounding.
    slack = 8 * torch.finfo(energy.dtype).eps * cumulative[..., -1:]
    reached = cumulative >= target - slack
    return (~reached).sum(dim=-1).to(singular_values.dtype) + 1


def has_eigen_gap(n: int, m: int, causal: bool) -> bool:
    """Whether (n, m) attention has an eigen gap to measure: square and bidirectional (a causal matrix is
    triangular, so its eigenvalues are its diagonal)."""
    return not causal and n == m


def stable_rank(frobenius_squared: Tensor, sigma1: Tensor) -> Tensor:
    """‖X‖_F² / σ₁²; NaN for the zero matrix (no direction to rank)."""
    return torch.where(
        sigma1 > 0,
        frobenius_squared / sigma1.square().clamp_min(torch.finfo(sigma1.dtype).tiny),
        torch.full_like(sigma1, float("nan")),
    )

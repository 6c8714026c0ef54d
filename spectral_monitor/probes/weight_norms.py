"""σ₁, ‖·‖_F and stable rank of many weight matrices at once, warm-started between calls, and ‖W_Q^hᵀ W_K^h‖₂.

The numerical side of :class:`~spectral_monitor.probes.weights.WeightProbe`: this module takes matrices
(:class:`NormTarget`), the probe decides which weights of a model they are and names the records.

σ₁ comes from the batched block Lanczos of :mod:`spectral_monitor.linalg`, warm-started like
``torch.nn.utils.parametrizations.spectral_norm``: each matrix keeps its top singular vector on its smaller
side (right for a tall matrix, left for a wide one, as it lies in memory: a square weight stored
transposed keeps its left one) between calls, so a call costs ``iterations_per_step`` block iterations, and
all matrices whose smaller sides agree run as one batch. A matrix seen for the first time, or whose shape
changed, starts cold and is solved to ``tol``; where that has not certified σ₁ within a few block iterations
and its smaller side is at most 768, the top eigenpair of its Gram matrix is computed densely instead (exact,
and its vector the next call's warm start). Freshly initialised weights are why: their top singular values
sit at the soft edge of a Marchenko–Pastur bulk, a few percent apart, and certifying the top one by Lanczos
took 16 to 60 block iterations on GPT-2's 384-wide layers (4 to 5 times the dense decomposition's time).
A matrix with a side of at most 32 (a head of width d_k ≤ 32, a small layer) gets its exact σ₁ instead, from
the top eigenvalue of its small Gram matrix (residual 0, no warm state): Krylov iteration buys nothing there.
The residual is ‖WᵀW v − σ₁² v‖ / σ₁² (or its WWᵀ form, whichever matrix is smaller): some singular value
lies within about half of it (relative) of the estimate. A cold start is certified to be σ₁ (the
Kaniel–Paige–Saad test of :func:`~spectral_monitor.linalg.lanczos_eigsh`, failure probability 1% over its
random start), or exact where the dense route took over (residual 0). A warm estimate runs a fixed
``iterations_per_step`` and is not certified (``docs/curvature.md`` says what a certified solve costs); its
error is bounded on one side: it never exceeds σ₁ (a Ritz value of the Gram matrix is at most its top
eigenvalue) and lies within its residual of some singular value, so after two singular values cross it can
follow the one that was on top, from below.

Every function works on detached float32 copies (float64 stays float64), each whose norm lies far from 1
scaled by a power of two so that no sum of squares overflows, and scales the norms back in float64: the
matrices given are never modified. A matrix holding NaN or inf has NaN norms.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from spectral_monitor.linalg import lanczos_eigsh
from spectral_monitor.linalg.lanczos_certificate import CERTAINTY
from spectral_monitor.linalg.operators import DenseOperator, GramOperator, StackedOperator, working_dtype
from spectral_monitor.metrics._common import (
    all_singular_values,
    nonfinite_matrices,
    powers_of_two,
    scaled_where_needed,
    stable_rank,
)
from spectral_monitor.probes.attention_weights import AttentionWeights, check_head_split

__all__ = [
    "NormEstimate",
    "NormTarget",
    "attention_query_key_norms",
    "estimate_spectral_norms",
    "full_spectra",
    "query_key_spectral_norms",
]

_COLD_START_MAX_ITERATIONS = 60  # once per matrix, so it may cost what converging to ``tol`` costs
# A cold matrix whose smaller side is at most _DENSE_COLD_MAX_SIZE gets _COLD_TRIAL_ITERATIONS block
# iterations to certify σ₁, then its Gram matrix's dense top eigenpair. Measured on random matrices (std 0.02,
# one thread, per matrix): 384 × 1536, 25 at once, a top singular value 3× the bulk's edge certifies within
# the trial (8 ms) and the bulk's soft edge took 73 ms to certify where trial and dense route take 24 ms;
# 768 × 3072, 160 ms against 106 ms; at 1024 × 4096 the trial and the dense route took longer (269 ms)
# than certifying (253 ms).
_COLD_TRIAL_ITERATIONS = 8
_DENSE_COLD_MAX_SIZE = 768
# A matrix with a side this short (a head's rows, a small layer) gets its exact σ₁ (eigvalsh): there a few
# block Krylov iterations already span the whole space, so iterating buys nothing.
_EXACT_MAX_SIZE = 32
# Bounds the float32 copies held at once (a 7B model's q, k, v and o of all layers would be 8 GiB); a single
# matrix larger than this is measured alone.
_MAX_BATCH_BYTES = 256 * 2**20


@dataclass
class NormTarget:
    """One matrix whose norms are estimated: a whole weight, or one head's rows of it.

    Attributes:
        layer: The name of the weight (``blocks.0.attn.q``).
        head: The head whose rows ``matrix`` holds, or ``None`` for the whole weight.
        matrix: A detached (out, in) view of the stored weight; it is only read.

    Examples:
        >>> import torch
        >>> NormTarget("blocks.0.attn.q", 2, torch.ones(4, 8)).key
        'blocks.0.attn.q/head_2'
    """

    layer: str
    head: int | None
    matrix: Tensor

    @property
    def key(self) -> str:
        """``layer``, or ``layer/head_h`` for a head: what estimates and warm vectors are keyed by."""
        return self.layer if self.head is None else f"{self.layer}/head_{self.head}"


@dataclass
class NormEstimate:
    """The norms of one matrix W, as floats.

    Attributes:
        spectral_norm: σ₁, the estimate (exact for a side of at most 32); NaN for a non-finite matrix.
        frobenius_norm: ‖W‖_F.
        stable_rank: ‖W‖_F² / σ₁²; NaN for a zero matrix.
        residual: ‖WᵀW v − σ₁² v‖ / σ₁² of the estimate (the smaller Gram matrix's form); 0 where σ₁ is exact.

    Examples:
        >>> NormEstimate(2.0, 2.0, 1.0, 0.0).stable_rank
        1.0
    """

    spectral_norm: float
    frobenius_norm: float
    stable_rank: float
    residual: float


def estimate_spectral_norms(
    targets: list[NormTarget],
    warm_vectors: Mapping[str, Tensor],
    *,
    iterations_per_step: int,
    tol: float,
    generator: torch.Generator,
) -> tuple[dict[str, NormEstimate], dict[str, Tensor]]:
    """σ₁, ‖·‖_F, stable rank and the residual of every target, warm-started from the last call's vectors.

    The Gram operator of a matrix is WᵀW or WWᵀ, whichever is smaller, and all matrices with Gram operators of
    one size go through one Lanczos run (``StackedOperator``): warm ones (a vector of ``warm_vectors`` under
    their key, of the Gram side's length) for ``iterations_per_step`` iterations, the others to ``tol``. A
    warm start that gives no finite σ₁ is retried cold. At most 256 MiB of copies wait for a run at once.

    Args:
        targets: The matrices, with distinct keys.
        warm_vectors: Each target's top singular vector on its smaller side, (side, 1), from the last call;
            only read.
        iterations_per_step: Block Lanczos iterations for a warm target.
        tol: Relative Ritz residual at which a run stops early.
        generator: The random starts' generator (advanced).

    Returns:
        The estimate of every target, and the new warm vectors: those of the targets solved by Lanczos with a
        finite σ₁, by key. Targets solved exactly, or holding NaN or inf, have none (they restart cold).

    Examples:
        >>> import torch
        >>> target = NormTarget("w", None, torch.ones(40, 40))
        >>> estimates, warm = estimate_spectral_norms(
        ...     [target], {}, iterations_per_step=2, tol=1e-3, generator=torch.Generator().manual_seed(0)
        ... )
        >>> estimate = estimates["w"]
        >>> round(estimate.spectral_norm, 4), round(estimate.stable_rank, 4), tuple(warm["w"].shape)
        (40.0, 1.0, (40, 1))
    """
    estimates: dict[str, NormEstimate] = {}
    vectors: dict[str, Tensor] = {}
    # (targets, their scaled copies, ‖·‖_F of those, the scales)
    waiting: list[tuple[list[NormTarget], Tensor, Tensor, Tensor]] = []
    waiting_bytes = 0
    for group in _batches(targets):
        matrices, frobenius, scale = _scaled_copy([_in_storage_order(target.matrix) for target in group])
        if min(matrices.shape[1:]) <= _EXACT_MAX_SIZE:
            sigma = _largest_singular_values(matrices, ~nonfinite_matrices(matrices, frobenius))
            estimates.update(_estimates_of(group, sigma, frobenius, torch.zeros_like(sigma), scale))
            continue
        size = matrices.numel() * matrices.element_size()
        if waiting and waiting_bytes + size > _MAX_BATCH_BYTES:
            estimates.update(_solve(waiting, warm_vectors, vectors, iterations_per_step, tol, generator))
            waiting, waiting_bytes = [], 0
        waiting.append((group, matrices, frobenius, scale))
        waiting_bytes += size
    if waiting:
        estimates.update(_solve(waiting, warm_vectors, vectors, iterations_per_step, tol, generator))
    return estimates, vectors


def full_spectra(targets: list[NormTarget]) -> dict[str, np.ndarray]:
    """Every singular value of each target's matrix: the square roots of the eigenvalues of its smaller Gram
    matrix, formed in float64 (each σᵢ within ~1e-8·σ₁, where float32 ``svdvals`` was ~2e-6·σ₁ off on
    GPT-2's weights, and twice as fast there).

    Args:
        targets: The matrices, with distinct keys.

    Returns:
        Each target's singular values, descending, as a float64 array, by key; all NaN for a matrix holding
        NaN or inf.

    Examples:
        >>> import torch
        >>> full_spectra([NormTarget("w", None, torch.diag(torch.tensor([1.0, 3.0, 2.0])))])["w"].tolist()
        [3.0, 2.0, 1.0]
    """
    spectra: dict[str, np.ndarray] = {}
    for group in _batches(targets):
        matrices = _stacked_copy([_in_storage_order(target.matrix) for target in group])
        values = matrices.new_full((len(group), min(matrices.shape[1:])), math.nan, dtype=torch.float64)
        finite = ~nonfinite_matrices(matrices)  # a non-finite matrix's spectrum stays NaN: eigvalsh raises
        if finite.any():
            values[finite] = all_singular_values(matrices[finite], torch.float64)
        values = values.cpu().numpy()
        spectra.update((target.key, spectrum) for target, spectrum in zip(group, values, strict=True))
    return spectra


def query_key_spectral_norms(
    query: Tensor, key: Tensor, num_heads: int, num_key_value_heads: int | None = None
) -> Tensor:
    """‖W_Q^hᵀ W_K^g‖₂ for every query head h (g its key head), exactly.

    Head h's logit between inputs x and y is (W_Q^h x)·(W_K^g y) = xᵀ (W_Q^hᵀ W_K^g) y, with
    g = h // (H / H_k). Its squared singular values are the eigenvalues of G_Q G_K, the d_k × d_k Gram
    matrices G = W Wᵀ of the two heads: with the Cholesky factor G_Q = L Lᵀ, ‖W_Q^hᵀ W_K^g‖₂² is the top
    eigenvalue of the symmetric Lᵀ G_K L, all in float64 (within ~1e-15 of the float64 SVD on GPT-2-sized
    heads, where the float32 QR route below was ~2e-7 off). A head whose G_Q is not positive definite (a
    rank-deficient W_Q^h) takes reduced QR factors W_Q^hᵀ = U_Q R_Q, W_K^gᵀ = U_K R_K instead: the
    singular values of R_Q R_Kᵀ. Nothing of size d_q × d_kv is formed.

    Args:
        query: (H·d_k, d_q), as ``nn.Linear`` stores it.
        key: (H_k·d_k, d_kv), as ``nn.Linear`` stores it.
        num_heads: H.
        num_key_value_heads: H_k, which must divide H (``None``: H).

    Returns:
        (H,) in ``query``'s dtype; NaN for a head whose rows of either projection hold NaN or inf.

    Raises:
        ValueError: If the rows do not split into the heads
            (:func:`~spectral_monitor.probes.attention_weights.check_head_split`).

    Examples:
        >>> import torch
        >>> query_key_spectral_norms(torch.eye(4), 3 * torch.eye(4), num_heads=2).tolist()
        [3.0, 3.0]
    """
    key_heads = num_heads if num_key_value_heads is None else num_key_value_heads
    check_head_split(query, key, None, num_heads, key_heads)
    head_dim = query.shape[0] // num_heads
    query_heads = query.reshape(num_heads, head_dim, -1).transpose(1, 2)
    key_heads_per_query = key.reshape(key_heads, head_dim, -1).transpose(1, 2)
    if key_heads != num_heads:
        key_heads_per_query = key_heads_per_query.repeat_interleave(num_heads // key_heads, dim=0)
    finite = ~(nonfinite_matrices(query_heads) | nonfinite_matrices(key_heads_per_query))  # QR raises on NaN
    if bool(finite.all()):
        return _largest_singular_values_of_products(query_heads, key_heads_per_query)
    norms = query.new_full((num_heads,), math.nan)
    if finite.any():
        norms[finite] = _largest_singular_values_of_products(query_heads[finite], key_heads_per_query[finite])
    return norms


def _largest_singular_values_of_products(left: Tensor, right: Tensor) -> Tensor:
    """σ₁(A Bᵀ) of each finite pair of a (batch, rows, k) stack ``left`` = A and ``right`` = B, in their dtype
    (:func:`query_key_spectral_norms` says how)."""
    rows = [factor.mT.double() for factor in (left, right)]  # contiguous where the heads are rows of a weight
    left_gram, right_gram = (factor @ factor.mT for factor in rows)
    cholesky, failed = torch.linalg.cholesky_ex(left_gram)
    values = torch.linalg.eigvalsh(cholesky.mT @ right_gram @ cholesky)[:, -1].clamp_min(0).sqrt()
    failed = failed != 0
    if failed.any():
        r_left = torch.linalg.qr(left[failed], mode="r").R
        r_right = torch.linalg.qr(right[failed], mode="r").R
        values[failed] = torch.linalg.svdvals(r_left @ r_right.transpose(1, 2))[:, 0].double()
    return values.to(left.dtype)


def attention_query_key_norms(weights: AttentionWeights) -> list[float]:
    """:func:`query_key_spectral_norms` of an attention module's projections, free of overflow.

    Computed on float64 copies of W_Q and W_K, where no product or sum of squares of float32 (or narrower)
    weights can overflow or underflow; float64 weights are first scaled by a power of two (exact), the norms
    scaled back.

    Args:
        weights: The module's projections; only read.

    Returns:
        ‖W_Q^hᵀ W_K^g‖₂ of each query head h, as floats.

    Examples:
        >>> import torch
        >>> weights = AttentionWeights(torch.eye(4), 1e30 * torch.eye(4), None, num_heads=2)
        >>> [f"{norm:.3g}" for norm in attention_query_key_norms(weights)]
        ['1e+30', '1e+30']
    """
    if torch.float64 not in (weights.query.dtype, weights.key.dtype):
        query, key = (
            weight.detach().to(torch.float64, memory_format=torch.contiguous_format)
            for weight in (weights.query, weights.key)
        )
        return query_key_spectral_norms(query, key, weights.num_heads, weights.key_value_heads).tolist()
    (query,), _, query_scale = _scaled_copy([weights.query])
    (key,), _, key_scale = _scaled_copy([weights.key])
    norms = query_key_spectral_norms(query, key, weights.num_heads, weights.key_value_heads)
    return (norms.double() * query_scale * key_scale).tolist()


def _solve(
    waiting: list[tuple[list[NormTarget], Tensor, Tensor, Tensor]],
    warm_vectors: Mapping[str, Tensor],
    vectors: dict[str, Tensor],
    iterations_per_step: int,
    tol: float,
    generator: torch.Generator,
) -> dict[str, NormEstimate]:
    """σ₁ of every finite matrix of ``waiting`` by one Lanczos run per Gram size and warmth; the new warm
    vectors go into ``vectors``. A matrix holding NaN or inf has no σ₁ (the solvers would raise): NaN, and it
    restarts cold."""
    sigma = [torch.full_like(frobenius, math.nan) for _, _, frobenius, _ in waiting]
    residual = [torch.full_like(frobenius, math.nan) for _, _, frobenius, _ in waiting]
    runs: dict[tuple[int, bool], dict[int, list[int]]] = {}  # (size, warm) -> item -> its elements
    for item, (group, matrices, frobenius, _) in enumerate(waiting):
        finite = (~nonfinite_matrices(matrices, frobenius)).tolist()
        size = min(matrices.shape[1:])
        for element, target in enumerate(group):
            if finite[element]:
                vector = warm_vectors.get(target.key)
                warm = vector is not None and vector.shape[0] == size
                runs.setdefault((size, warm), {}).setdefault(item, []).append(element)
    # Warm runs first: an element whose warm start gave no finite σ₁ is retried cold, before anything is
    # reported (a NaN here would read as a non-finite matrix).
    for warm_pass in (True, False):
        for (size, warm), members in list(runs.items()):
            if warm != warm_pass:
                continue
            order = [(item, element) for item, elements in members.items() for element in elements]
            operator = StackedOperator(
                [
                    GramOperator(DenseOperator(_rows(waiting[item][1], elements)))
                    for item, elements in members.items()
                ]
            )
            init = None
            if warm:
                init = torch.stack([warm_vectors[waiting[item][0][element].key] for item, element in order])
                init = init.to(device=operator.device, dtype=operator.dtype)
            dense_fallback = not warm and size <= _DENSE_COLD_MAX_SIZE
            cold_iterations = _COLD_TRIAL_ITERATIONS if dense_fallback else _COLD_START_MAX_ITERATIONS
            result = lanczos_eigsh(
                operator,
                1,
                tol=tol,
                max_iters=iterations_per_step if warm else cold_iterations,
                init=init,
                generator=generator,
                # A cold start is certified to be σ₁; a warm one runs its fixed iterations, a lower bound
                # on σ₁ within its residual of some singular value (the module docstring).
                failure_probability=None if warm else CERTAINTY,
            )
            values = result.values[:, 0].clamp_min(0).sqrt()
            usable = (values.isfinite() & result.vectors.isfinite().flatten(1).all(dim=1)).tolist()
            certified = result.info.converged.tolist()
            dense: dict[int, list[int]] = {}
            for position, (item, element) in enumerate(order):
                if warm and not usable[position]:
                    runs.setdefault((size, False), {}).setdefault(item, []).append(element)
                    continue
                if dense_fallback and not certified[position]:
                    dense.setdefault(item, []).append(element)
                    continue
                sigma[item][element] = values[position]
                residual[item][element] = result.info.residual[position, 0]
                vectors[waiting[item][0][element].key] = result.vectors[position].clone()
            for item, elements in dense.items():
                top_values, top_vectors = _top_singular_pairs(_rows(waiting[item][1], elements))
                for position, element in enumerate(elements):
                    sigma[item][element] = top_values[position]
                    residual[item][element] = 0.0
                    vectors[waiting[item][0][element].key] = top_vectors[position].clone()
    estimates: dict[str, NormEstimate] = {}
    for item, (group, _, frobenius, scale) in enumerate(waiting):
        estimates.update(_estimates_of(group, sigma[item], frobenius, residual[item], scale))
    return estimates


def _rows(matrices: Tensor, elements: list[int]) -> Tensor:
    """``matrices[elements]``, without copying the batch when that is all of it (the common case)."""
    return matrices if len(elements) == matrices.shape[0] else matrices[elements]


def _estimates_of(
    targets: list[NormTarget], sigma: Tensor, frobenius: Tensor, residual: Tensor, scale: Tensor
) -> dict[str, NormEstimate]:
    """The estimates of ``targets`` from σ₁ and ‖·‖_F of their copies scaled down by ``scale``: the norms
    are scaled back in float64, the stable rank is a ratio of the scaled ones."""
    ratio = stable_rank(frobenius.square(), sigma)
    columns = torch.stack(
        [sigma.double() * scale, frobenius.double() * scale, ratio.double(), residual.double()], dim=1
    )
    return {
        target.key: NormEstimate(*values) for target, values in zip(targets, columns.tolist(), strict=True)
    }


def _scaled_copy(matrices: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_stacked_copy` of ``matrices``, those whose ‖·‖_F lies far from 1 divided by the power of two
    that brings the largest entry into [0.5, 1)
    (:func:`~spectral_monitor.metrics._common.scaled_where_needed`: exact, and no sum of squares of a finite
    float32 weight overflows); their ‖·‖_F, and the powers as float64 (batch,). A non-finite matrix stays as
    it is."""
    stacked = _stacked_copy(matrices)
    stacked, frobenius, exponents = scaled_where_needed(stacked, torch.linalg.matrix_norm(stacked))
    return stacked, frobenius, powers_of_two(exponents, torch.float64)


def _stacked_copy(matrices: list[Tensor]) -> Tensor:
    """One float32 (float64 stays float64) batch, a copy: nothing measured can reach a parameter."""
    stacked = torch.stack([matrix.detach() for matrix in matrices])
    return stacked.to(working_dtype(stacked.dtype))


def _largest_singular_values(matrices: Tensor, finite: Tensor) -> Tensor:
    """σ₁ of each matrix of a (batch, rows, cols) stack, exactly; NaN where ``finite`` is False (a matrix
    holding NaN or inf).

    From the top eigenvalue of the smaller Gram matrix: squaring loses the small singular values, never σ₁
    (the rounding is relative to σ₁²), and on small head slices it is cheaper than ``svdvals``.
    """
    sigma = matrices.new_full(matrices.shape[:1], math.nan)
    if finite.any():
        sigma[finite] = torch.linalg.eigvalsh(_smaller_gram(matrices[finite]))[:, -1].clamp_min(0).sqrt()
    return sigma


def _top_singular_pairs(matrices: Tensor) -> tuple[Tensor, Tensor]:
    """σ₁ of each matrix of a finite (batch, rows, cols) stack and its singular vector on the smaller side
    ((batch, side, 1), unit length, the side the Lanczos runs' Gram operators act on), from the top eigenpair
    of the smaller Gram matrix: exact to rounding, relative to σ₁."""
    eigenvalues, eigenvectors = torch.linalg.eigh(_smaller_gram(matrices))
    return eigenvalues[:, -1].clamp_min(0).sqrt(), eigenvectors[:, :, -1:].contiguous()


def _smaller_gram(matrices: Tensor) -> Tensor:
    """WᵀW of each matrix of a (batch, rows, cols) stack, or WWᵀ where that is smaller, as
    :class:`~spectral_monitor.linalg.operators.GramOperator` chooses (WᵀW for a square matrix)."""
    return matrices.mT @ matrices if matrices.shape[2] <= matrices.shape[1] else matrices @ matrices.mT


def _batches(targets: list[NormTarget]) -> Iterator[list[NormTarget]]:
    """Targets of one shape (:func:`_in_storage_order`), dtype and device together, at most
    ``_MAX_BATCH_BYTES`` of copies per batch."""
    groups: dict[tuple[Any, ...], list[NormTarget]] = {}
    for target in targets:
        matrix = _in_storage_order(target.matrix)
        groups.setdefault((tuple(matrix.shape), matrix.dtype, matrix.device), []).append(target)
    for group in groups.values():
        matrix = group[0].matrix
        copy_bytes = matrix.numel() * torch.finfo(working_dtype(matrix.dtype)).bits // 8
        size = max(1, _MAX_BATCH_BYTES // copy_bytes)
        for start in range(0, len(group), size):
            yield group[start : start + size]


def _in_storage_order(matrix: Tensor) -> Tensor:
    """``matrix``, or its transpose where that is how it lies in memory (Hugging Face's ``Conv1D`` stores its
    weight as (in, out)): the same singular values and ‖·‖_F, and a copy that runs along rows instead of
    gathering columns, several times faster."""
    return matrix.mT if matrix.stride(-1) != 1 and matrix.stride(-2) == 1 else matrix

"""The CPU kernels of a dense batch's products (:class:`~spectral_monitor.linalg.operators.DenseOperator`).

Narrow products with large matrices are memory-bound, so these kernels arrange for A to be read once and in
the layout BLAS reads fastest: the Gram product AᵀA x in one sweep over the rows of A (another computation's
block riding along in the same sweep), narrow blocks stored column by column, and a restricted batch
multiplied in runs of consecutive matrices where it lies instead of copied.
"""

from __future__ import annotations

import torch
from torch import Tensor

GRAM_SWEEP_BYTES = 2 * 2**20
"""Bytes of A that a Gram sweep multiplies by both sides while they are in cache: the rows of a block of
``GRAM_SWEEP_GROUP`` matrices (whole matrices where that many are smaller)."""
GRAM_SWEEP_GROUP = 4
"""Matrices a sweep's block spans. Few matrices with many rows each keep each thread's share of a block in
its own L2 cache and make the products long enough to run at speed, where a block across the whole batch
with a few rows of each spills to the shared cache."""
GRAM_SWEEP_MIN_ROWS = 8
"""Fewer rows of each matrix per block make the sweep's products too small to run at speed (only matrices
of more than 16384 columns come below it at 4 matrices of 2 MiB)."""
GRAM_SWEEP_MAX_COLUMNS = 8
"""The widest x, and the widest riding block, a Gram sweep is used for: the Lanczos block for σ₁, σ₂ (4
columns, 6 on a warm start's first block) and the Arnoldi block of 4 riding along. Wider blocks gain
nothing reliable over two separate products."""


def gram_sweep(matrices: Tensor, x: Tensor, riding: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(AᵀA x, A ``riding``) in one sweep over the rows of A: Σ over blocks of rows A_bᵀ (A_b x).

    Each block (``GRAM_SWEEP_BYTES`` of the rows of ``GRAM_SWEEP_GROUP`` matrices, at least
    ``GRAM_SWEEP_MIN_ROWS`` rows) is multiplied by both sides while it is in cache; ``riding`` joins x in
    the first product of each block, so its product with A costs little more than x alone.

    Args:
        matrices: (B, m, n) A.
        x: (B, n, k) vectors.
        riding: (B, n, j) vectors to multiply by A in the same sweep, or ``None``.

    Returns:
        ``(AᵀA x, A riding)``, (B, n, k) and (B, m, j); the second has j = 0 without ``riding``.

    Examples:
        >>> import torch
        >>> a = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
        >>> gram, ridden = gram_sweep(a, torch.ones(1, 2, 1), torch.tensor([[[1.0], [0.0]]]))
        >>> gram.flatten(), ridden.flatten()
        (tensor([ 79., 100.]), tensor([1., 3., 5.]))
    """
    batch, rows, cols = matrices.shape
    width = x.shape[2]
    # Each block's first product is formed transposed, (A_b [x, riding])ᵀ, so its rows feed the second
    # product as they are, where A_b x would be copied transposed.
    both_rows = (x if riding is None else torch.cat([x, riding], dim=2)).transpose(1, 2).contiguous()
    matrix_bytes = rows * cols * matrices.element_size()
    group = max(GRAM_SWEEP_GROUP, GRAM_SWEEP_BYTES // matrix_bytes)
    rows_per_block = max(GRAM_SWEEP_MIN_ROWS, GRAM_SWEEP_BYTES // (group * cols * matrices.element_size()))
    transposed = x.new_zeros((batch, width, cols))
    ridden = x.new_empty((batch, both_rows.shape[1] - width, rows))
    for first in range(0, batch, group):
        elements = slice(first, first + group)
        multiplier, accumulated, their_rows = both_rows[elements], transposed[elements], ridden[elements]
        for start in range(0, rows, rows_per_block):
            block = matrices[elements, start : start + rows_per_block]
            product = torch.bmm(multiplier, block.transpose(1, 2))
            accumulated.baddbmm_(product[:, :width], block)
            their_rows[:, :, start : start + rows_per_block] = product[:, width:]
    return transposed.transpose(1, 2), ridden.transpose(1, 2)


def consecutive_runs(elements: list[int]) -> list[slice]:
    """``elements``, in their order, as slices of runs of consecutive indices.

    Args:
        elements: Indices, in any order.

    Returns:
        Slices with step ``None`` whose ranges, concatenated, are ``elements``.

    Examples:
        >>> consecutive_runs([0, 1, 2, 5, 6, 3])
        [slice(0, 3, None), slice(5, 7, None), slice(3, 4, None)]
    """
    runs: list[slice] = []
    for element in elements:
        if runs and runs[-1].stop == element:
            runs[-1] = slice(runs[-1].start, element + 1)
        else:
            runs.append(slice(element, element + 1))
    return runs


def column_major(x: Tensor) -> Tensor:
    """``x`` with each matrix stored column by column: CPU BLAS multiplies a large matrix by a narrow block
    (2–8 columns) several times faster in that layout.

    Args:
        x: (B, n, k) blocks.

    Returns:
        The same values, each (n, k) matrix with strides (1, n).

    Examples:
        >>> import torch
        >>> column_major(torch.zeros(2, 5, 3)).stride()
        (15, 1, 5)
    """
    return x.transpose(1, 2).contiguous().transpose(1, 2)

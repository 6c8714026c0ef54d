"""The Krylov basis the Lanczos solvers build: rows orthonormalised block by block (with random filler
directions where the space becomes invariant), kept in room that grows, and the projected block-tridiagonal
matrix beside them."""

from __future__ import annotations

import torch
from torch import Tensor

from spectral_monitor.linalg.operators import gaussian


def orthonormal_rows(
    block: Tensor, basis: Tensor | None, scale: Tensor, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Orthonormalise the rows of ``block``, filling vanished ones with directions orthogonal to ``basis``.

    ``block`` is expected to be orthogonal to ``basis`` already (the caller reorthogonalises it). A row that
    vanishes (the Krylov space became invariant, e.g. for a rank-one attention matrix) is replaced by a
    random direction orthogonal to ``basis`` and to the kept rows; its coupling in C is then exactly what
    the row carried, so the projected matrix stays exact.

    Args:
        block: (B, b, n) rows to orthonormalise.
        basis: (B, k, n) orthonormal rows a filler direction must be orthogonal to, or ``None``.
        scale: (B,) the norm a row is measured against: a row (or pivot) of norm at most
            10·√n·ε·``scale`` (ε the rounding unit of ``block``'s dtype) counts as vanished.
        generator: Draws the filler directions; untouched when no row vanishes.

    Returns:
        ``(Q, C)``: Q (B, b, n) with orthonormal rows, C (B, b, b) the couplings, ``Q @ block.mT``, so that
        ``blockᵀ = Qᵀ C`` up to rounding.

    Examples:
        One row is its own direction, and its norm the coupling:

        >>> import torch
        >>> unit, generator = torch.ones(1, dtype=torch.float64), torch.Generator().manual_seed(0)
        >>> row = torch.tensor([[[3.0, 4.0, 0.0]]], dtype=torch.float64)
        >>> q, c = orthonormal_rows(row, None, unit, generator)
        >>> q, c
        (tensor([[[0.6000, 0.8000, 0.0000]]], dtype=torch.float64), tensor([[[5.]]], dtype=torch.float64))

        Two parallel rows span one direction; the second row of Q is a random filler orthogonal to it:

        >>> block = torch.tensor([[[1.0, 0.0, 0.0], [2.0, 0.0, 0.0]]], dtype=torch.float64)
        >>> q, c = orthonormal_rows(block, None, unit, generator)
        >>> torch.allclose(q @ q.mT, torch.eye(2, dtype=torch.float64)), torch.allclose(q.mT @ c, block.mT)
        (True, True)
    """
    n = block.shape[2]
    threshold = 10 * n**0.5 * torch.finfo(block.dtype).eps * scale[:, None]
    if block.shape[1] == 1:  # one row: a norm, not a QR factorisation
        norm = block.norm(dim=2, keepdim=True)
        tiny = norm[:, :, 0] <= threshold
        if not bool(tiny.any()):
            return block / norm, norm  # the row's coupling to its own direction is its norm
        q = block / torch.where(tiny[:, :, None], torch.ones_like(norm), norm)
    else:
        q, r = torch.linalg.qr(block.mT)
        q = q.mT.contiguous()
        tiny = r.diagonal(dim1=1, dim2=2).abs() <= threshold
    if bool(tiny.any()):
        # A dependent row's Householder direction is arbitrary and the rows after it can lean on that
        # direction, so replacing it alone would drop part of the block: the block's span is taken from its
        # singular vectors instead (the kept ones first), and the fillers are orthogonalised after them.
        left, singular, _ = torch.linalg.svd(block.mT, full_matrices=False)
        kept = singular > threshold
        filler = gaussian(block.mT.shape, dtype=block.dtype, device=block.device, generator=generator)
        q = torch.where(kept[:, None, :], left, filler).mT
        for _ in range(2):
            if basis is not None:
                q = torch.where(kept[:, :, None], q, torch.baddbmm(q, q @ basis.mT, basis, alpha=-1))
            q = torch.linalg.qr(q.mT).Q.mT.contiguous()
    return q, q @ block.mT


def reorthogonalise(block: Tensor, basis: Tensor) -> Tensor:
    """The rows of ``block`` less their components along the orthonormal rows of ``basis``.

    Two passes of classical Gram–Schmidt: twice is enough (Kahan–Parlett), where one pass loses
    orthogonality in float32.

    Args:
        block: (B, b, n) rows to orthogonalise; not modified.
        basis: (B, k, n) orthonormal rows.

    Returns:
        (B, b, n) rows orthogonal to every row of ``basis``.

    Examples:
        >>> import torch
        >>> basis = torch.tensor([[[1.0, 0.0, 0.0]]])
        >>> reorthogonalise(torch.tensor([[[2.0, 3.0, 4.0]]]), basis)
        tensor([[[0., 3., 4.]]])
    """
    for _ in range(2):
        block = torch.baddbmm(block, block @ basis.mT, basis, alpha=-1)
    return block


class GrowingRows:
    """Rows (B, k, n), block after block, in a buffer with room for more: appending copies only the new
    block, where concatenating would copy the whole basis into a fresh allocation each time. When full, the
    room grows by ``GROWTH`` (never past n rows: an orthonormal basis of length-n rows has at most n).

    Args:
        first: (B, k₀, n) the first rows; copied.
        capacity: Rows of room to keep from the start (at least k₀).

    Examples:
        >>> import torch
        >>> basis = GrowingRows(torch.eye(3)[None, :1], capacity=1)
        >>> basis.append(torch.eye(3)[None, 1:])
        >>> basis.count, basis.capacity, tuple(basis.rows.shape)
        (3, 3, (1, 3, 3))
        >>> basis.keep(torch.tensor([0]))
        >>> basis.rows[0, 2]
        tensor([0., 0., 1.])
    """

    GROWTH = 1.5

    def __init__(self, first: Tensor, capacity: int) -> None:
        batch, count, n = first.shape
        self._buffer = first.new_empty((batch, max(capacity, count), n))
        self._buffer[:, :count] = first
        self._count = count

    @property
    def rows(self) -> Tensor:
        """The rows so far, (B, k, n): a view, valid until the next ``append`` or ``keep``."""
        return self._buffer[:, : self._count]

    @property
    def count(self) -> int:
        """The number of rows so far, k."""
        return self._count

    @property
    def capacity(self) -> int:
        """The rows the buffer has room for before it grows again."""
        return self._buffer.shape[1]

    def append(self, block: Tensor) -> None:
        """Write ``block`` after the rows so far, growing the room if it does not fit.

        Args:
            block: (B, b, n) rows to append; copied.
        """
        needed = self._count + block.shape[1]
        capacity = self._buffer.shape[1]
        if needed > capacity:
            batch, _, n = self._buffer.shape
            # An orthonormal basis of length-n rows never needs more than n of them.
            grown_capacity = max(needed, min(int(capacity * self.GROWTH), n))
            grown = self._buffer.new_empty((batch, grown_capacity, n))
            grown[:, : self._count] = self.rows
            self._buffer = grown
        self._buffer[:, self._count : needed] = block
        self._count = needed

    def keep(self, index: Tensor) -> None:
        """Drop every batch element but ``index``, keeping the room (only the rows so far are copied).

        Args:
            index: Indices (long) or a mask (bool, (B,)) of the batch elements to keep.
        """
        rows = self.rows[index]
        kept = self._buffer.new_empty((rows.shape[0], *self._buffer.shape[1:]))
        kept[:, : self._count] = rows
        self._buffer = kept


class BlockTridiagonal:
    """The projected matrix Qᵀ Op Q of a block Lanczos basis, (B, m, m), written block by block into room
    kept for it, so that a new block costs a copy of that block only.

    Args:
        batch: B, the number of matrices.
        capacity: m to keep room for before the buffer grows (by ``GrowingRows.GROWTH``).
        dtype: The matrices' dtype.
        device: The matrices' device.

    Examples:
        Two 1 × 1 diagonal blocks, 2 and 3, coupled by 1:

        >>> import torch
        >>> projected = BlockTridiagonal(1, 1, torch.float64, torch.device("cpu"))
        >>> projected.extend(torch.tensor([[[2.0]]], dtype=torch.float64), None)
        >>> one = torch.ones(1, 1, 1, dtype=torch.float64)
        >>> projected.extend(3 * one, one)
        >>> projected.matrix
        tensor([[[2., 1.],
                 [1., 3.]]], dtype=torch.float64)
    """

    def __init__(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self._buffer = torch.zeros((batch, capacity, capacity), dtype=dtype, device=device)
        self._size = 0

    @property
    def matrix(self) -> Tensor:
        """The matrix so far, (B, m, m): a view, valid until the next ``extend`` or ``keep``."""
        return self._buffer[:, : self._size, : self._size]

    def extend(self, diagonal: Tensor, coupling: Tensor | None) -> None:
        """Append a diagonal block, coupled to the last one; the transposed coupling goes above the diagonal.

        Args:
            diagonal: (B, b, b) the new diagonal block.
            coupling: (B, b, c) the new block's rows against the last block's c columns, or ``None`` for the
                first block.
        """
        size, width = self._size, diagonal.shape[1]
        if size + width > self._buffer.shape[1]:
            batch, capacity, _ = self._buffer.shape
            grown_capacity = max(size + width, int(capacity * GrowingRows.GROWTH))
            grown = self._buffer.new_zeros((batch, grown_capacity, grown_capacity))
            grown[:, :size, :size] = self.matrix
            self._buffer = grown
        self._buffer[:, size : size + width, size : size + width] = diagonal
        if coupling is not None:
            previous = coupling.shape[2]
            self._buffer[:, size : size + width, size - previous : size] = coupling
            self._buffer[:, size - previous : size, size : size + width] = coupling.mT
        self._size = size + width

    def keep(self, index: Tensor) -> None:
        """Drop every batch element but ``index``.

        Args:
            index: Indices (long) or a mask (bool, (B,)) of the batch elements to keep.
        """
        self._buffer = self._buffer[index]

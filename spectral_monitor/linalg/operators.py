"""Batched linear operators: "apply a batch of matrices (and their transposes) to a batch of vectors".

Every iterative method in :mod:`spectral_monitor.linalg` talks to matrices only through this interface, so a
dense batch of attention matrices, a blocked attention that is never materialised, a Hessian-vector product
and a Jacobian-vector product all plug in the same way.

The interface, :class:`BatchedOperator`, and the :class:`Passenger` whose products ride along on an
operator's sweeps are defined in :mod:`~spectral_monitor.linalg.operator_interface`; this module has the
operators themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from spectral_monitor.linalg.dense_kernels import (
    GRAM_SWEEP_MAX_COLUMNS,
    column_major,
    consecutive_runs,
    gram_sweep,
)
from spectral_monitor.linalg.draws import default_generator, gaussian, rademacher, working_dtype
from spectral_monitor.linalg.operator_interface import BatchedOperator, Passenger


class DenseOperator(BatchedOperator):
    """A dense batch of matrices ``(B, m, n)``.

    Products with the transpose are computed as (yᵀA)ᵀ, which reads A row by row as it is stored: a product
    with the transposed *view* Aᵀy would read it with a stride, and a contiguous copy of Aᵀ would double the
    memory held.

    ``gram_matmat`` forms AᵀA x for a narrow x (at most ``GRAM_SWEEP_MAX_COLUMNS``) in one sweep over A on
    the CPU (:func:`~spectral_monitor.linalg.dense_kernels.gram_sweep`), where two products read A twice.
    ``carrying`` lets another computation's products with A (a :class:`Passenger`: the Arnoldi iteration
    for |λ₂| beside the Lanczos iteration for σ₁, σ₂) ride in the same sweep, where a product of its own
    would read A once more. ``restrict`` copies nothing: the restricted operator multiplies the kept matrices
    where they are, one batched product per run of consecutive kept elements.

    Args:
        matrices: (B, m, n) matrices; kept, not copied.
        symmetric: Whether every matrix is symmetric (not checked).

    Attributes:
        matrices: The matrices, all B of them even after ``restrict`` (``elements`` says which are used).

    Raises:
        ValueError: ``matrices`` is not three-dimensional, or ``symmetric`` matrices are not square.

    Examples:
        >>> import torch
        >>> op = DenseOperator(torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]]).expand(3, 3, 2))
        >>> op.matmat(torch.ones(3, 2, 1))[0, :, 0], op.gram_matmat(torch.ones(3, 2, 1))[0, :, 0]
        (tensor([ 3.,  7., 11.]), tensor([ 79., 100.]))
        >>> op.restrict(torch.tensor([0, 2])).elements
        [0, 2]
    """

    def __init__(self, matrices: Tensor, symmetric: bool = False) -> None:
        if matrices.ndim != 3:
            raise ValueError(f"matrices must have shape (B, m, n), got {tuple(matrices.shape)}")
        super().__init__(*matrices.shape, matrices.dtype, matrices.device, symmetric)
        self.matrices = matrices
        self._runs = [slice(0, matrices.shape[0])]  # of the elements of ``matrices`` this operator is
        self._passenger: Passenger | None = None

    def matmat(self, x: Tensor) -> Tensor:
        """A x for each kept matrix.

        Args:
            x: (B, n, k) vectors.

        Returns:
            (B, m, k) products.
        """
        return self._per_run(x, lambda matrices, part: torch.bmm(matrices, column_major(part)))

    def rmatmat(self, y: Tensor) -> Tensor:
        """Aᵀ y for each kept matrix, as (yᵀA)ᵀ.

        Args:
            y: (B, m, k) vectors.

        Returns:
            (B, n, k) products.
        """
        if self.symmetric:
            return self.matmat(y)
        # yᵀ contiguous: bmm reads a transposed view of a narrow block at about half the speed.
        return self._per_run(
            y,
            lambda matrices, part: torch.bmm(part.transpose(1, 2).contiguous(), matrices).transpose(1, 2),
        )

    def gram_matmat(self, x: Tensor) -> Tensor:
        """AᵀA x: in one sweep over A on the CPU for x of at most ``GRAM_SWEEP_MAX_COLUMNS`` columns (a
        passenger's pending product with the same matrices served from the same sweep), else two products.

        Args:
            x: (B, n, k) vectors.

        Returns:
            (B, n, k) products.
        """
        if self.device.type != "cpu" or x.shape[2] > GRAM_SWEEP_MAX_COLUMNS:
            return super().gram_matmat(x)
        riding = self._riding_request()
        if riding is None:
            return self._per_run(x, lambda matrices, part: gram_sweep(matrices, part)[0])
        return self._gram_matmat_serving(x, *riding)

    def carrying(self, passenger: Passenger) -> DenseOperator:
        """This operator over the same elements, its Gram sweeps serving ``passenger``'s pending products
        with the same matrices (and at most ``GRAM_SWEEP_MAX_COLUMNS`` wide) as they go.

        Args:
            passenger: The computation whose products ride along.

        Returns:
            A new operator (this one is unchanged); its restrictions carry the passenger too.
        """
        carrier = self._over(self.elements)
        carrier._passenger = passenger
        return carrier

    def restrict(self, index: Tensor) -> DenseOperator:
        """The operator over the elements ``index`` of this one, multiplying them where they are.

        Args:
            index: Indices (long) or a mask (bool, (B,)) of the elements to keep.

        Returns:
            The restricted operator, carrying this one's passenger.
        """
        return self._over(torch.tensor(self.elements)[index.cpu()].tolist())

    @property
    def elements(self) -> list[int]:
        """The indices into ``matrices`` of this operator's batch elements, in order."""
        return [element for run in self._runs for element in range(run.start, run.stop)]

    def _over(self, elements: list[int]) -> DenseOperator:
        """An operator over ``matrices[elements]``, without copying them, carrying this one's passenger."""
        operator = DenseOperator.__new__(DenseOperator)
        BatchedOperator.__init__(
            operator, len(elements), self.rows, self.cols, self.dtype, self.device, self.symmetric
        )
        operator.matrices = self.matrices
        operator._runs = consecutive_runs(elements)
        operator._passenger = self._passenger
        return operator

    def _riding_request(self) -> tuple[DenseOperator, Tensor] | None:
        """The passenger's pending product if it can ride in this operator's Gram sweeps: a product with
        the same matrices, narrow enough to share the sweep."""
        request = None if self._passenger is None else self._passenger.pending
        if request is None:
            return None
        operator, block = request
        if (
            not isinstance(operator, DenseOperator)
            or operator.matrices is not self.matrices
            or block.shape[2] > GRAM_SWEEP_MAX_COLUMNS
        ):
            return None
        return operator, block

    def _gram_matmat_serving(self, x: Tensor, operator: DenseOperator, block: Tensor) -> Tensor:
        """AᵀA x, delivering ``operator``'s product with ``block`` to the passenger from the same sweeps:
        elements both want share one sweep, the others get their own product."""
        assert self._passenger is not None
        mine, theirs = self.elements, operator.elements
        my_position = {element: position for position, element in enumerate(mine)}
        their_position = {element: position for position, element in enumerate(theirs)}
        shared = [element for element in mine if element in their_position]
        gram = x.new_empty(x.shape)
        product = block.new_empty((block.shape[0], self.rows, block.shape[2]))

        def positions(elements: list[int], of: dict[int, int]) -> Tensor:
            return torch.tensor([of[element] for element in elements], dtype=torch.long, device=x.device)

        if shared:
            mine_shared, theirs_shared = positions(shared, my_position), positions(shared, their_position)
            width = x.shape[2]
            gram[mine_shared], product[theirs_shared] = self._over(shared)._per_run(
                torch.cat([x[mine_shared], block[theirs_shared]], dim=2),
                lambda matrices, part: gram_sweep(matrices, part[:, :, :width], part[:, :, width:]),
            )
        only_mine = [element for element in mine if element not in their_position]
        if only_mine:
            gram[positions(only_mine, my_position)] = self._over(only_mine)._per_run(
                x[positions(only_mine, my_position)], lambda matrices, part: gram_sweep(matrices, part)[0]
            )
        only_theirs = [element for element in theirs if element not in my_position]
        if only_theirs:
            at = positions(only_theirs, their_position)
            product[at] = operator._over(only_theirs).matmat(block[at])
        self._passenger.deliver(product)
        return gram

    def _per_run(self, x: Tensor, product: Callable[[Tensor, Tensor], Any]) -> Any:
        """``product(matrices, x)`` for this operator's elements, one call per run; a product may return a
        tensor or a tuple of them."""
        if len(self._runs) == 1:
            return product(self.matrices[self._runs[0]], x)
        parts = x.split([run.stop - run.start for run in self._runs])
        results = [product(self.matrices[run], part) for run, part in zip(self._runs, parts, strict=True)]
        if isinstance(results[0], tuple):
            return tuple(torch.cat(pieces) for pieces in zip(*results, strict=True))
        return torch.cat(results)


class FunctionOperator(BatchedOperator):
    """An operator given by functions, e.g. a Hessian-vector or Jacobian-vector product.

    Args:
        matmat: x (B, cols, k) -> A x (B, rows, k).
        batch: B.
        rows: m.
        cols: n.
        dtype: The dtype the functions take and return.
        device: The device they work on.
        rmatmat: y (B, rows, k) -> Aᵀ y (B, cols, k); required unless ``symmetric``.
        symmetric: Whether the maps are symmetric (``matmat`` then serves both products).

    Raises:
        ValueError: Neither ``symmetric`` nor an ``rmatmat``, or ``symmetric`` with ``rows != cols``.

    Examples:
        >>> import torch
        >>> op = FunctionOperator(lambda x: 3 * x, batch=1, rows=2, cols=2, dtype=torch.float32,
        ...     symmetric=True)
        >>> op.rmatmat(torch.ones(1, 2, 1)).flatten()
        tensor([3., 3.])
    """

    def __init__(
        self,
        matmat: Callable[[Tensor], Tensor],
        *,
        batch: int,
        rows: int,
        cols: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        rmatmat: Callable[[Tensor], Tensor] | None = None,
        symmetric: bool = False,
    ) -> None:
        super().__init__(batch, rows, cols, dtype, torch.device(device), symmetric)
        if not symmetric and rmatmat is None:
            raise ValueError("rmatmat is required for a non-symmetric FunctionOperator")
        self._matmat = matmat
        self._rmatmat = rmatmat

    def matmat(self, x: Tensor) -> Tensor:
        """The ``matmat`` function's product.

        Args:
            x: (B, n, k) vectors.

        Returns:
            (B, m, k) products.
        """
        return self._matmat(x)

    def rmatmat(self, y: Tensor) -> Tensor:
        """The ``rmatmat`` function's product (``matmat``'s where symmetric).

        Args:
            y: (B, m, k) vectors.

        Returns:
            (B, n, k) products.
        """
        if self.symmetric:
            return self._matmat(y)
        assert self._rmatmat is not None
        return self._rmatmat(y)


class GramOperator(BatchedOperator):
    """The symmetric positive semi-definite ``AᵀA`` (or ``AAᵀ`` when that is smaller) of an operator.

    Its eigenvalues are the squared singular values of ``A``; ``side`` says which singular vectors its
    eigenvectors are (``"right"`` for AᵀA, ``"left"`` for AAᵀ).

    Args:
        op: A, an operator with both products.

    Attributes:
        base: A.
        side: ``"right"`` (AᵀA, n ≤ m) or ``"left"`` (AAᵀ, n > m).

    Examples:
        >>> import torch
        >>> gram = GramOperator(DenseOperator(torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])))
        >>> gram.side, gram.rows, gram.matmat(torch.ones(1, 2, 1)).flatten()
        ('right', 2, tensor([ 79., 100.]))
    """

    def __init__(self, op: BatchedOperator) -> None:
        self.side = "right" if op.cols <= op.rows else "left"
        size = min(op.rows, op.cols)
        super().__init__(op.batch, size, size, op.dtype, op.device, symmetric=True)
        self.base = op

    def matmat(self, x: Tensor) -> Tensor:
        """AᵀA x (by the base's ``gram_matmat``) or AAᵀ x.

        Args:
            x: (B, s, k) vectors, s = min(m, n).

        Returns:
            (B, s, k) products.
        """
        if self.side == "right":
            return self.base.gram_matmat(x)
        return self.base.matmat(self.base.rmatmat(x))

    def restrict(self, index: Tensor) -> GramOperator | None:
        """The Gram operator of the base restricted to ``index``.

        Args:
            index: The elements to keep, as the base's ``restrict`` takes them.

        Returns:
            The restricted operator, or ``None`` where the base cannot be restricted.
        """
        base = self.base.restrict(index)
        return None if base is None else GramOperator(base)

    def agreed(self, flags: Tensor) -> Tensor:
        """The base's agreement on ``flags``.

        Args:
            flags: (B,) bool decisions.

        Returns:
            (B,) bool, as the base agrees them.
        """
        return self.base.agreed(flags)


class ProjectedOperator(BatchedOperator):
    """``P op P`` with ``P = I − UUᵀ`` for an orthonormal ``U`` of shape ``(B, n, r)``: ``op`` deflated.

    Used to remove directions already known exactly (top singular vectors) before a stochastic estimate,
    which removes their contribution to the estimator's variance.

    Args:
        op: A symmetric operator.
        basis: (B, n, r) U, orthonormal columns (not checked), on the operator's device and dtype.

    Attributes:
        base: ``op``.
        basis: U.

    Raises:
        ValueError: ``op`` is not symmetric.

    Examples:
        >>> import torch
        >>> identity = DenseOperator(torch.eye(3)[None], symmetric=True)
        >>> op = ProjectedOperator(identity, torch.eye(3)[None, :, :1])
        >>> op.matmat(torch.ones(1, 3, 1)).flatten()
        tensor([0., 1., 1.])
    """

    def __init__(self, op: BatchedOperator, basis: Tensor) -> None:
        if not op.symmetric:
            raise ValueError("ProjectedOperator needs a symmetric operator")
        super().__init__(op.batch, op.rows, op.cols, op.dtype, op.device, symmetric=True)
        self.base = op
        self.basis = basis

    def project(self, x: Tensor) -> Tensor:
        """P x = x − U Uᵀ x.

        Args:
            x: (B, n, k) vectors.

        Returns:
            (B, n, k) their components orthogonal to U.
        """
        return x - self.basis @ (self.basis.transpose(1, 2) @ x)

    def matmat(self, x: Tensor) -> Tensor:
        """P op P x.

        Args:
            x: (B, n, k) vectors.

        Returns:
            (B, n, k) products.
        """
        return self.project(self.base.matmat(self.project(x)))

    def restrict(self, index: Tensor) -> ProjectedOperator | None:
        """The projection of the base restricted to ``index``, with those elements' U.

        Args:
            index: The elements to keep, as the base's ``restrict`` takes them.

        Returns:
            The restricted operator, or ``None`` where the base cannot be restricted.
        """
        base = self.base.restrict(index)
        return None if base is None else ProjectedOperator(base, self.basis[index])

    def agreed(self, flags: Tensor) -> Tensor:
        """The base's agreement on ``flags``.

        Args:
            flags: (B,) bool decisions.

        Returns:
            (B,) bool, as the base agrees them.
        """
        return self.base.agreed(flags)


class StackedOperator(BatchedOperator):
    """Operators of one shape as one batch, their elements in order: one solver run where the elements cannot
    share a tensor (the Gram operators of weights of several shapes with the same smaller side).

    A solver's bookkeeping costs the same for a batch of 4 as of 40, and for small matrices it is most of a
    solve: one run over the stack costs it once.

    Args:
        operators: The operators, at least one, agreeing in rows, cols, dtype, device and symmetry; the
            stack's batch is the sum of theirs.

    Attributes:
        operators: The operators, as a list.

    Raises:
        ValueError: ``operators`` is empty or its operators disagree in shape, dtype, device or symmetry.

    Examples:
        >>> import torch
        >>> one, two = DenseOperator(torch.eye(2)[None]), DenseOperator(2 * torch.eye(2).expand(2, 2, 2))
        >>> stack = StackedOperator([one, two])
        >>> stack.batch, stack.matmat(torch.ones(3, 2, 1))[:, 0, 0]
        (3, tensor([1., 2., 2.]))
    """

    def __init__(self, operators: Sequence[BatchedOperator]) -> None:
        if not operators:
            raise ValueError("operators must hold at least one operator")
        first = operators[0]
        shape = (first.rows, first.cols, first.dtype, first.device, first.symmetric)
        for op in operators[1:]:
            if (op.rows, op.cols, op.dtype, op.device, op.symmetric) != shape:
                raise ValueError(
                    "operators must agree in rows, cols, dtype, device and symmetry; got "
                    f"{(op.rows, op.cols, op.dtype, op.device, op.symmetric)} after {shape}"
                )
        super().__init__(sum(op.batch for op in operators), *shape)
        self.operators = list(operators)

    def matmat(self, x: Tensor) -> Tensor:
        """Each operator's product with its own elements' part of ``x``.

        Args:
            x: (B, n, k) vectors.

        Returns:
            (B, m, k) products.
        """
        return self._each(x, lambda op, part: op.matmat(part))

    def rmatmat(self, y: Tensor) -> Tensor:
        """Each operator's transposed product with its own elements' part of ``y``.

        Args:
            y: (B, m, k) vectors.

        Returns:
            (B, n, k) products.
        """
        return self._each(y, lambda op, part: op.rmatmat(part))

    def gram_matmat(self, x: Tensor) -> Tensor:
        """Each operator's ``gram_matmat`` with its own elements' part of ``x``.

        Args:
            x: (B, n, k) vectors.

        Returns:
            (B, n, k) products.
        """
        return self._each(x, lambda op, part: op.gram_matmat(part))

    def restrict(self, index: Tensor) -> StackedOperator | None:
        """The elements ``index`` (ascending, as solvers pass them), each part restricted to its own.

        Args:
            index: Ascending indices (long) of the elements to keep.

        Returns:
            The stack of the restricted parts (whole parts kept as they are), or ``None`` where ``index`` is
            not ascending, is empty, or a part cannot be restricted.
        """
        index = index.cpu()
        if index.numel() > 1 and not bool((index[1:] > index[:-1]).all()):
            return None
        kept: list[BatchedOperator] = []
        start = 0
        for op in self.operators:
            local = index[(index >= start) & (index < start + op.batch)] - start
            start += op.batch
            if local.numel() == op.batch:
                kept.append(op)
            elif local.numel():
                restricted = op.restrict(local)
                if restricted is None:
                    return None
                kept.append(restricted)
        return StackedOperator(kept) if kept else None

    def agreed(self, flags: Tensor) -> Tensor:
        """``flags`` as every operator of the stack agrees them, one after the other.

        Args:
            flags: (B,) bool decisions.

        Returns:
            (B,) bool, agreed by each operator in turn.
        """
        for op in self.operators:
            flags = op.agreed(flags)
        return flags

    def _each(self, x: Tensor, product: Callable[[BatchedOperator, Tensor], Tensor]) -> Tensor:
        parts = x.split([op.batch for op in self.operators])
        return torch.cat([product(op, part) for op, part in zip(self.operators, parts, strict=True)])


def as_operator(matrices: Tensor | BatchedOperator) -> BatchedOperator:
    """An operator for a ``(B, m, n)`` tensor, or the operator itself.

    Args:
        matrices: A (B, m, n) tensor (taken as a non-symmetric :class:`DenseOperator`) or an operator.

    Returns:
        The operator.

    Raises:
        ValueError: ``matrices`` is neither a tensor nor an operator.

    Examples:
        >>> import torch
        >>> op = as_operator(torch.zeros(2, 3, 4))
        >>> type(op).__name__, op.batch, op.rows, op.cols, as_operator(op) is op
        ('DenseOperator', 2, 3, 4, True)
    """
    if isinstance(matrices, BatchedOperator):
        return matrices
    if not isinstance(matrices, Tensor):
        raise ValueError(f"expected a Tensor or BatchedOperator, got {type(matrices).__name__}")
    return DenseOperator(matrices)


__all__ = [
    "BatchedOperator",
    "DenseOperator",
    "FunctionOperator",
    "GramOperator",
    "Passenger",
    "ProjectedOperator",
    "StackedOperator",
    "as_operator",
    "working_dtype",
    "rademacher",
    "gaussian",
    "default_generator",
]

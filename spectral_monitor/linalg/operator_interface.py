"""The interface of a batched linear operator: "apply a batch of matrices (and their transposes) to a batch
of vectors", and the :class:`Passenger` whose products ride along on an operator's sweeps.

Shapes: an operator has ``batch`` (B), ``rows`` (m) and ``cols`` (n). ``matmat`` maps
``(B, n, k) -> (B, m, k)`` and ``rmatmat`` maps ``(B, m, k) -> (B, n, k)``. The operators themselves are in
:mod:`~spectral_monitor.linalg.operators`, which exports these names too.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch
from torch import Tensor


class BatchedOperator:
    """A batch of ``B`` linear maps R^cols -> R^rows, known only through products.

    A subclass implements ``matmat`` (and ``rmatmat`` unless symmetric); the rest has defaults a subclass
    may override where it can do better.

    Args:
        batch: B, the number of maps.
        rows: m, the length of a product.
        cols: n, the length of a vector the maps apply to.
        dtype: The dtype products are formed in.
        device: The device products are formed on.
        symmetric: Whether every map is symmetric (then ``rmatmat`` is ``matmat``).

    Raises:
        ValueError: ``symmetric`` with ``rows != cols``.

    Examples:
        >>> import torch
        >>> class Doubling(BatchedOperator):
        ...     def matmat(self, x):
        ...         return 2 * x
        >>> op = Doubling(1, 3, 3, torch.float32, "cpu", symmetric=True)
        >>> op.gram_matmat(torch.ones(1, 3, 1)).flatten(), op.restrict(torch.tensor([0]))
        (tensor([4., 4., 4.]), None)
    """

    def __init__(
        self,
        batch: int,
        rows: int,
        cols: int,
        dtype: torch.dtype,
        device: torch.device,
        symmetric: bool = False,
    ) -> None:
        if symmetric and rows != cols:
            raise ValueError(f"a symmetric operator must be square, got rows={rows}, cols={cols}")
        self.batch = batch
        self.rows = rows
        self.cols = cols
        self.dtype = dtype
        self.device = torch.device(device)
        self.symmetric = symmetric

    def matmat(self, x: Tensor) -> Tensor:
        """A x for each map.

        Args:
            x: (B, n, k) vectors.

        Returns:
            (B, m, k) products.

        Raises:
            NotImplementedError: Always, here: a subclass implements it.
        """
        raise NotImplementedError

    def rmatmat(self, y: Tensor) -> Tensor:
        """Aᵀ y for each map; ``matmat`` where the maps are symmetric.

        Args:
            y: (B, m, k) vectors.

        Returns:
            (B, n, k) products.

        Raises:
            NotImplementedError: The maps are not symmetric and the subclass has no transposed product.
        """
        if self.symmetric:
            return self.matmat(y)
        raise NotImplementedError(f"{type(self).__name__} does not implement transposed products")

    def gram_matmat(self, x: Tensor) -> Tensor:
        """``AᵀA x``: two products by default; an operator that can form both in one sweep over A (a blocked
        attention that recomputes each block of rows) overrides it.

        Args:
            x: (B, n, k) vectors.

        Returns:
            (B, n, k) products.
        """
        return self.rmatmat(self.matmat(x))

    def carrying(self, passenger: Passenger) -> BatchedOperator:
        """This operator, with ``passenger``'s products riding along on its sweeps over the matrices where it
        can share them; ``passenger.finish()`` serves whatever is left. Here there are no sweeps to share.

        Args:
            passenger: The computation whose products may ride along.

        Returns:
            An operator with the same products (here ``self``).
        """
        return self

    def restrict(self, index: Tensor) -> BatchedOperator | None:
        """The operator for the batch elements ``index`` only, or ``None`` if that is not cheaper.

        Solvers call this when most of a batch has converged, so the rest stops paying for finished work.

        Args:
            index: Ascending indices (long) or a mask (bool, (B,)) of the elements to keep.

        Returns:
            The restricted operator, or ``None`` (here always): the caller then keeps using this one.
        """
        return None

    def agreed(self, flags: Tensor) -> Tensor:
        """A solver's per-element stop decisions, as every party sharing this operator takes them.

        Solvers pass each data-dependent decision that changes how many products they spend through here.
        An operator whose products are collectives (a Hessian averaged over distributed ranks) must have every
        rank run the same number of products, so it returns the flags agreed across ranks; others return
        them unchanged.

        Args:
            flags: (B,) bool, one decision per batch element of this operator.

        Returns:
            (B,) bool, the decisions to act on (here ``flags`` itself).
        """
        return flags


class Passenger:
    """A computation that needs products with an operator one block at a time, so that they can ride along
    on another computation's sweeps over the same matrices
    (:meth:`BatchedOperator.carrying`).

    An operator that carries the passenger serves its ``pending`` request from a sweep (``deliver``); what no
    sweep carried, ``finish`` serves with the operators' own products.

    Args:
        steps: A generator that yields ``(operator, block)``, is sent ``operator.matmat(block)`` back, and
            returns its result. It is started at once, up to its first request.

    Attributes:
        pending: The request ``(operator, block)`` waiting for its product, or ``None`` once the
            computation has returned.

    Examples:
        >>> import torch
        >>> from spectral_monitor.linalg import DenseOperator
        >>> op = DenseOperator(torch.tensor([[[1.0, 2.0], [3.0, 4.0]]]))
        >>> def steps():
        ...     first = yield op, torch.ones(1, 2, 1)
        ...     second = yield op, first
        ...     return second.flatten()
        >>> passenger = Passenger(steps())
        >>> passenger.deliver(op.matmat(passenger.pending[1]))
        >>> passenger.finish()
        tensor([17., 37.])
    """

    def __init__(self, steps: Generator[tuple[BatchedOperator, Tensor], Tensor, Any]) -> None:
        self._steps = steps
        self._result: Any = None
        self.pending: tuple[BatchedOperator, Tensor] | None = None
        self._advance(None)

    def deliver(self, product: Tensor) -> None:
        """Hand the pending request its product and run the computation to its next request.

        Args:
            product: The product the pending request asked for, ``operator.matmat(block)``.

        Raises:
            RuntimeError: No request is pending.
        """
        if self.pending is None:
            raise RuntimeError("deliver called with no product pending")
        self._advance(product)

    def finish(self) -> Any:
        """Serve every request left with the operators' own products.

        Returns:
            The computation's result, what its generator returned.
        """
        while self.pending is not None:
            operator, block = self.pending
            self._advance(operator.matmat(block))
        return self._result

    def _advance(self, product: Tensor | None) -> None:
        try:
            self.pending = next(self._steps) if product is None else self._steps.send(product)
        except StopIteration as stop:
            self.pending, self._result = None, stop.value

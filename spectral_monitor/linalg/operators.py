"""Batched linear operators: "apply a batch of matrices (and their transposes) to a batch of vectors".

Every iterative method in :mod:`spectral_monitor.linalg` talks to matrices only through this interface, so a
dense batch of attention matrices, a blocked attention that is never materialised, a Hessian-vector product
and a Jacobian-vector product all plug in the same way.

Shapes: an operator has ``batch_shape`` (any leading dims, flattened to one batch dim ``B`` inside the
solvers), ``rows`` (m) and ``cols`` (n). ``matmat`` maps ``(B, n, k) -> (B, m, k)`` and ``rmatmat`` maps
``(B, m, k) -> (B, n, k)``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch
from torch import Tensor


class BatchedOperator:
    """A batch of ``B`` linear maps R^cols -> R^rows, known only through products."""

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
        raise NotImplementedError

    def rmatmat(self, y: Tensor) -> Tensor:
        if self.symmetric:
            return self.matmat(y)
        raise NotImplementedError(f"{type(self).__name__} does not implement transposed products")

    def gram_matmat(self, x: Tensor) -> Tensor:
        """``AᵀA x``: two products by default; an operator that can form both in one sweep over A (a blocked
        attention that recomputes each block of rows) overrides it."""
        return self.rmatmat(self.matmat(x))

    def carrying(self, passenger: Passenger) -> BatchedOperator:
        """This operator, with ``passenger``'s products riding along on its sweeps over the matrices where it
        can share them; ``passenger.finish()`` serves whatever is left. Here there are no sweeps to share."""
        return self

    def restrict(self, index: Tensor) -> BatchedOperator | None:
        """The operator for the batch elements ``index`` only, or ``None`` if that is not cheaper.

        Solvers call this when most of a batch has converged, so the rest stops paying for finished work.
        """
        return None

    def agreed(self, flags: Tensor) -> Tensor:
        """A solver's per-element stop decisions ``flags`` (bool, one per active batch element), as every
        party sharing this operator takes them.

        Solvers pass each data-dependent decision that changes how many products they spend through here.
        An operator whose products are collectives (a Hessian averaged over distributed ranks) must have every
        rank run the same number of products, so it returns the flags agreed across ranks; others return
        them unchanged.
        """
        return flags


class DenseOperator(BatchedOperator):
    """A dense batch of matrices ``(B, m, n)``.

    Products with the transpose are computed as (yᵀA)ᵀ, which reads A row by row as it is stored: a product
    with the transposed *view* Aᵀy reads it with a stride and cost 2–4× as much (measured on CPU), and a
    contiguous copy of Aᵀ would double the memory held.

    ``gram_matmat`` forms AᵀA x for a narrow x in one sweep over A on the CPU: Σ over blocks of rows of
    A_bᵀ (A_b x), each block (a few matrices' rows, ``GRAM_SWEEP_BYTES``) small enough that its second product
    reads it from cache. Memory-bound as narrow products are, that makes it 1.5–2× faster than two separate
    products (``GRAM_SWEEP_GROUP`` has the table).

    ``carrying`` lets another computation's products with A (a :class:`Passenger`: the Arnoldi iteration for
    |λ₂| beside the Lanczos iteration for σ₁, σ₂) ride in the same sweep: its block joins x in the first
    product of each block of rows, which costs little more than x alone, where a product of its own would read
    A once more (64 matrices of 1024², 4 + 4 columns: 27–30 ms against 21 + 14.6 ms apart, AVX-512 Xeon).

    ``restrict`` copies nothing: the restricted operator multiplies the kept matrices where they are, one
    batched product per run of consecutive kept elements (a copy of what is kept cost about a product each
    time, and held a second batch in memory: 1.9 GiB at peak for 64 matrices of 2048² instead of 0.6).
    """

    def __init__(self, matrices: Tensor, symmetric: bool = False) -> None:
        if matrices.ndim != 3:
            raise ValueError(f"matrices must have shape (B, m, n), got {tuple(matrices.shape)}")
        super().__init__(
            matrices.shape[0],
            matrices.shape[1],
            matrices.shape[2],
            matrices.dtype,
            matrices.device,
            symmetric,
        )
        self.matrices = matrices
        self._runs = [slice(0, matrices.shape[0])]  # of the elements of ``matrices`` this operator is
        self._passenger: Passenger | None = None

    def matmat(self, x: Tensor) -> Tensor:
        return self._per_run(x, lambda matrices, part: torch.bmm(matrices, _column_major(part)))

    def rmatmat(self, y: Tensor) -> Tensor:
        if self.symmetric:
            return self.matmat(y)
        # yᵀ contiguous: bmm reads a transposed view of a narrow block at half the speed (measured: 63 ms
        # against 31 ms for 64 products of 1024² with 4 columns).
        return self._per_run(
            y,
            lambda matrices, part: torch.bmm(part.transpose(1, 2).contiguous(), matrices).transpose(1, 2),
        )

    def gram_matmat(self, x: Tensor) -> Tensor:
        if self.device.type != "cpu" or x.shape[2] > GRAM_SWEEP_MAX_COLUMNS:
            return super().gram_matmat(x)
        riding = self._riding_request()
        if riding is None:
            return self._per_run(x, lambda matrices, part: _gram_sweep(matrices, part)[0])
        return self._gram_matmat_serving(x, *riding)

    def carrying(self, passenger: Passenger) -> DenseOperator:
        carrier = self._over(self.elements)
        carrier._passenger = passenger
        return carrier

    def restrict(self, index: Tensor) -> DenseOperator:
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
        operator._runs = _consecutive_runs(elements)
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
                lambda matrices, part: _gram_sweep(matrices, part[:, :, :width], part[:, :, width:]),
            )
        only_mine = [element for element in mine if element not in their_position]
        if only_mine:
            gram[positions(only_mine, my_position)] = self._over(only_mine)._per_run(
                x[positions(only_mine, my_position)], lambda matrices, part: _gram_sweep(matrices, part)[0]
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


GRAM_SWEEP_BYTES = 2 * 2**20
"""Bytes of A that a CPU Gram sweep multiplies by both sides while they are in cache: the rows of a block of
``GRAM_SWEEP_GROUP`` matrices (whole matrices where that many are smaller)."""
GRAM_SWEEP_GROUP = 4
"""Matrices a sweep's block spans. Few matrices with many rows each keep each thread's share of a block in
its own L2 and make the products long enough to run at speed; a block across the whole batch with a few
rows of each spilled to L3. Best time of 15 sweeps over 64 matrices, 2-core Xeon without AMX (2 MiB of L2
per core, 260 MiB of L3), blocks of 2 MiB, against blocks of 16 rows across the batch (the earlier layout)
and two separate products:

| n | columns | 1 matrix | 2 | 4 | 8 | 64 (16 rows) | two products |
|---:|---:|---:|---:|---:|---:|---:|---:|
| 1024 | 4 | 32.9 ms | 20.2 | 19.6 | 23.0 | 29.3 | 39.9 |
| 1024 | 8 | 35.9 | 25.9 | 25.9 | 25.1 | 33.1 | 44.0 |
| 2048 | 4 | 120 | 102 | 96.6 | 78.7 | 115 | 148 |
| 2048 | 8 | 141 | 99.4 | 117 | 119 | 146 | 182 |

At 16 columns no layout beat two products reliably (1024²: 46–72 ms by the sweep against 51 ms), so wider
blocks are not swept (``GRAM_SWEEP_MAX_COLUMNS``)."""
GRAM_SWEEP_MIN_ROWS = 8
"""Fewer rows of each matrix per block make the sweep's products too small to run at speed (only matrices
of more than 16384 columns come below it at 4 matrices of 2 MiB)."""
GRAM_SWEEP_MAX_COLUMNS = 8
"""The widest x, and the widest riding block, a Gram sweep is used for: the Lanczos block for σ₁, σ₂ (4
columns, 6 on a warm start's first block) and the Arnoldi block of 4 riding along."""


def _gram_sweep(matrices: Tensor, x: Tensor, riding: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(AᵀA x, A ``riding``) in one sweep over the rows of A; the second is empty without ``riding``."""
    batch, rows, cols = matrices.shape
    width = x.shape[2]
    # Each block's first product is formed transposed, (A_b [x, riding])ᵀ, so its rows feed the second
    # product as they are: 20.7 against 27.6 ms at 1024² with 4 columns, where A_b x was copied transposed
    # (an AVX-512/AMX Xeon, blocks of 16 rows across the batch).
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


def _consecutive_runs(elements: list[int]) -> list[slice]:
    """``elements``, in their order, as slices of runs of consecutive indices."""
    runs: list[slice] = []
    for element in elements:
        if runs and runs[-1].stop == element:
            runs[-1] = slice(runs[-1].start, element + 1)
        else:
            runs.append(slice(element, element + 1))
    return runs


def _column_major(x: Tensor) -> Tensor:
    """``x`` with each matrix stored column by column: CPU BLAS multiplies a large matrix by a narrow block
    (2–8 columns) about 3× faster in that layout (measured on 1024² float32 matrices)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


class Passenger:
    """A computation that needs products with an operator one block at a time, so that they can ride along
    on another computation's sweeps over the same matrices (:meth:`BatchedOperator.carrying`).

    ``steps`` is a generator that yields ``(operator, block)``, is sent ``operator.matmat(block)`` back, and
    returns its result; ``finish`` serves what no sweep carried and returns that result.
    """

    def __init__(self, steps: Generator[tuple[BatchedOperator, Tensor], Tensor, Any]) -> None:
        self._steps = steps
        self._result: Any = None
        self.pending: tuple[BatchedOperator, Tensor] | None = None
        self._advance(None)

    def deliver(self, product: Tensor) -> None:
        """The product the pending request asked for."""
        if self.pending is None:
            raise RuntimeError("deliver called with no product pending")
        self._advance(product)

    def finish(self) -> Any:
        """Serve every request left with the operators' own products; the computation's result."""
        while self.pending is not None:
            operator, block = self.pending
            self._advance(operator.matmat(block))
        return self._result

    def _advance(self, product: Tensor | None) -> None:
        try:
            self.pending = next(self._steps) if product is None else self._steps.send(product)
        except StopIteration as stop:
            self.pending, self._result = None, stop.value


class FunctionOperator(BatchedOperator):
    """An operator given by functions, e.g. a Hessian-vector or Jacobian-vector product.

    ``matmat(x)`` takes ``(B, cols, k)``; ``rmatmat`` is needed unless ``symmetric``.
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
        return self._matmat(x)

    def rmatmat(self, y: Tensor) -> Tensor:
        if self.symmetric:
            return self._matmat(y)
        assert self._rmatmat is not None
        return self._rmatmat(y)


class GramOperator(BatchedOperator):
    """The symmetric positive semi-definite ``AᵀA`` (or ``AAᵀ`` when that is smaller) of an operator.

    Its eigenvalues are the squared singular values of ``A``; ``side`` says which singular vectors its
    eigenvectors are (``"right"`` for AᵀA, ``"left"`` for AAᵀ).
    """

    def __init__(self, op: BatchedOperator) -> None:
        self.side = "right" if op.cols <= op.rows else "left"
        size = min(op.rows, op.cols)
        super().__init__(op.batch, size, size, op.dtype, op.device, symmetric=True)
        self.base = op

    def matmat(self, x: Tensor) -> Tensor:
        if self.side == "right":
            return self.base.gram_matmat(x)
        return self.base.matmat(self.base.rmatmat(x))

    def restrict(self, index: Tensor) -> GramOperator | None:
        base = self.base.restrict(index)
        return None if base is None else GramOperator(base)

    def agreed(self, flags: Tensor) -> Tensor:
        return self.base.agreed(flags)


class ProjectedOperator(BatchedOperator):
    """``P op P`` with ``P = I − UUᵀ`` for an orthonormal ``U`` of shape ``(B, n, r)``: ``op`` deflated.

    Used to remove directions already known exactly (top singular vectors) before a stochastic estimate,
    which removes their contribution to the estimator's variance.
    """

    def __init__(self, op: BatchedOperator, basis: Tensor) -> None:
        if not op.symmetric:
            raise ValueError("ProjectedOperator needs a symmetric operator")
        super().__init__(op.batch, op.rows, op.cols, op.dtype, op.device, symmetric=True)
        self.base = op
        self.basis = basis

    def project(self, x: Tensor) -> Tensor:
        return x - self.basis @ (self.basis.transpose(1, 2) @ x)

    def matmat(self, x: Tensor) -> Tensor:
        return self.project(self.base.matmat(self.project(x)))

    def restrict(self, index: Tensor) -> ProjectedOperator | None:
        base = self.base.restrict(index)
        return None if base is None else ProjectedOperator(base, self.basis[index])

    def agreed(self, flags: Tensor) -> Tensor:
        return self.base.agreed(flags)


class StackedOperator(BatchedOperator):
    """Operators of one shape as one batch, their elements in order: one solver run where the elements cannot
    share a tensor (the Gram operators of weights of several shapes with the same smaller side).

    A solver's bookkeeping costs the same for a batch of 4 as of 40, and for small matrices it is most of a
    solve: the demo model's 25 weights, in four shapes with a Gram side of 64, took 8.3 ms as four warm
    solves and 4.3 ms as one.
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
        return self._each(x, lambda op, part: op.matmat(part))

    def rmatmat(self, y: Tensor) -> Tensor:
        return self._each(y, lambda op, part: op.rmatmat(part))

    def gram_matmat(self, x: Tensor) -> Tensor:
        return self._each(x, lambda op, part: op.gram_matmat(part))

    def restrict(self, index: Tensor) -> StackedOperator | None:
        """The elements ``index`` (ascending, as solvers pass them), each part restricted to its own."""
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
        for op in self.operators:
            flags = op.agreed(flags)
        return flags

    def _each(self, x: Tensor, product: Callable[[BatchedOperator, Tensor], Tensor]) -> Tensor:
        parts = x.split([op.batch for op in self.operators])
        return torch.cat([product(op, part) for op, part in zip(self.operators, parts, strict=True)])


def as_operator(matrices: Tensor | BatchedOperator) -> BatchedOperator:
    """An operator for a ``(B, m, n)`` tensor, or the operator itself."""
    if isinstance(matrices, BatchedOperator):
        return matrices
    if not isinstance(matrices, Tensor):
        raise ValueError(f"expected a Tensor or BatchedOperator, got {type(matrices).__name__}")
    return DenseOperator(matrices)


def working_dtype(dtype: torch.dtype, requested: torch.dtype | None = None) -> torch.dtype:
    """The dtype iterative methods compute in: ``requested`` if given, else at least float32."""
    if requested is not None:
        if not requested.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {requested}")
        return requested
    if not dtype.is_floating_point:
        raise ValueError(f"expected a floating dtype, got {dtype}")
    return torch.float64 if dtype == torch.float64 else torch.float32


def rademacher(
    shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device, generator: torch.Generator | None
) -> Tensor:
    """±1 entries, drawn from ``generator`` (never the global RNG when a generator is given)."""
    bits = torch.randint(0, 2, shape, generator=generator, device=generator.device if generator else device)
    return bits.to(device=device, dtype=dtype) * 2 - 1


def gaussian(
    shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device, generator: torch.Generator | None
) -> Tensor:
    draw_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=draw_device, dtype=dtype).to(device)


def default_generator(device: torch.device, seed: int = 0) -> torch.Generator:
    """A private generator, so solvers never consume the user's global RNG stream."""
    return torch.Generator(device="cpu").manual_seed(seed)


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

"""Operators multiply like the matrices they stand for: a dense batch's one-sweep Gram product, and a stack
of operators that multiplies, restricts and rejects mismatches like the batch it stands for."""

from __future__ import annotations

import pytest
import torch

from spectral_monitor.linalg import dense_kernels, lanczos_eigsh, operators
from spectral_monitor.linalg.operators import DenseOperator, GramOperator, StackedOperator


@pytest.mark.parametrize(("group", "rows_per_block"), [(1, 1), (2, 3), (4, 10), (1, 64), (2, 1), (5, 4)])
def test_a_dense_gram_sweep_is_the_product_with_the_gram_matrix(
    monkeypatch: pytest.MonkeyPatch, group: int, rows_per_block: int
) -> None:
    """Groups of matrices and blocks of rows that do not divide the 5 matrices and their 10 rows (the last
    is short), one row, all rows, whole matrices; rectangular, restricted to scattered elements, and with a
    block riding along, whose products with A come back row by row."""
    matrices = torch.randn(5, 10, 7, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    monkeypatch.setattr(dense_kernels, "GRAM_SWEEP_GROUP", group)
    monkeypatch.setattr(dense_kernels, "GRAM_SWEEP_BYTES", rows_per_block * group * 7 * 8)
    monkeypatch.setattr(dense_kernels, "GRAM_SWEEP_MIN_ROWS", 1)
    block = torch.randn(5, 7, dense_kernels.GRAM_SWEEP_MAX_COLUMNS, dtype=torch.float64)
    expected = matrices.transpose(1, 2) @ matrices @ block
    dense = DenseOperator(matrices)
    torch.testing.assert_close(dense.gram_matmat(block), expected, rtol=1e-12, atol=1e-12)
    kept = torch.tensor([0, 2, 3])
    torch.testing.assert_close(
        dense.restrict(kept).gram_matmat(block[kept]), expected[kept], rtol=1e-12, atol=1e-12
    )
    riding = torch.randn(5, 7, 3, dtype=torch.float64)
    gram, ridden = dense_kernels.gram_sweep(matrices, block, riding)
    torch.testing.assert_close(gram, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ridden, matrices @ riding, rtol=1e-12, atol=1e-12)


def stack_of_three_shapes() -> tuple[StackedOperator, list[torch.Tensor]]:
    """Gram operators (side 6) of 2 + 3 + 1 float64 matrices of 6, 9 and 14 rows."""
    generator = torch.Generator().manual_seed(0)
    parts = [torch.randn(count, rows, 6, generator=generator, dtype=torch.float64) for count, rows in
             ((2, 6), (3, 9), (1, 14))]  # fmt: skip
    return StackedOperator([GramOperator(DenseOperator(part)) for part in parts]), parts


def test_products_are_those_of_each_element_in_order() -> None:
    stacked, parts = stack_of_three_shapes()
    grams = torch.cat([part.transpose(1, 2) @ part for part in parts])
    block = torch.randn(6, 6, 3, dtype=torch.float64)
    assert stacked.batch == 6
    torch.testing.assert_close(stacked.matmat(block), grams @ block, rtol=1e-12, atol=1e-12)


def test_a_restricted_stack_multiplies_only_the_kept_elements() -> None:
    stacked, parts = stack_of_three_shapes()
    grams = torch.cat([part.transpose(1, 2) @ part for part in parts])
    kept = torch.tensor([1, 3, 5])  # one of each part
    restricted = stacked.restrict(kept)
    assert restricted is not None and restricted.batch == 3
    block = torch.randn(3, 6, 2, dtype=torch.float64)
    torch.testing.assert_close(restricted.matmat(block), grams[kept] @ block, rtol=1e-12, atol=1e-12)
    assert stacked.restrict(torch.tensor([3, 1])) is None  # out of order: not cheaper, so not restricted


def test_one_lanczos_run_over_the_stack_finds_each_elements_top_eigenvalue() -> None:
    stacked, parts = stack_of_three_shapes()
    result = lanczos_eigsh(stacked, 1, tol=1e-10, generator=torch.Generator().manual_seed(1))
    expected = torch.cat([torch.linalg.svdvals(part)[:, 0] ** 2 for part in parts])
    torch.testing.assert_close(result.values[:, 0], expected, rtol=1e-8, atol=0)


def test_operators_of_different_shapes_cannot_be_stacked() -> None:
    square = GramOperator(DenseOperator(torch.randn(1, 6, 6)))
    other = GramOperator(DenseOperator(torch.randn(1, 7, 7)))
    with pytest.raises(ValueError, match="operators must agree in rows, cols"):
        StackedOperator([square, other])
    with pytest.raises(ValueError, match="operators must hold at least one"):
        StackedOperator([])


def test_a_passenger_rides_in_the_gram_sweeps_it_shares_and_gets_every_product_it_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three requests on overlapping element sets: the first shares two of its three elements with the sweep
    that carries it, the second all of them, the third is left to ``finish``. Only what no sweep shared is
    multiplied on its own."""
    generator = torch.Generator().manual_seed(3)
    matrices = torch.randn(5, 10, 7, generator=generator, dtype=torch.float64)  # rectangular: A x is 10 long
    dense = DenseOperator(matrices)
    requests = ([0, 1, 2], [1, 3, 4], [3])

    def steps():
        received = []
        for kept in requests:
            block = torch.randn(len(kept), 7, 3, generator=generator, dtype=torch.float64)
            product = yield dense.restrict(torch.tensor(kept)), block
            received.append((kept, block, product))
        return received

    own_products: list[int] = []
    plain_matmat = DenseOperator.matmat

    def counted_matmat(self: DenseOperator, x: torch.Tensor) -> torch.Tensor:
        own_products.append(self.batch)
        return plain_matmat(self, x)

    monkeypatch.setattr(DenseOperator, "matmat", counted_matmat)
    passenger = operators.Passenger(steps())
    carrier = dense.carrying(passenger)
    for kept in ([0, 2, 3], [0, 1, 2, 3, 4]):
        x = torch.randn(len(kept), 7, 4, generator=generator, dtype=torch.float64)
        expected = matrices[kept].transpose(1, 2) @ matrices[kept] @ x
        gram = carrier.restrict(torch.tensor(kept)).gram_matmat(x)
        torch.testing.assert_close(gram, expected, rtol=1e-12, atol=1e-12)
    assert passenger.pending is not None and passenger.pending[1].shape[0] == 1  # the third request
    received = passenger.finish()
    assert [kept for kept, _, _ in received] == list(requests)
    for kept, block, product in received:
        torch.testing.assert_close(product, matrices[kept] @ block, rtol=1e-12, atol=1e-12)
    assert own_products == [1, 1]  # element 1 of the first request, then the whole third
    with pytest.raises(RuntimeError, match="no product pending"):
        passenger.deliver(torch.zeros(1, 10, 3, dtype=torch.float64))


def test_an_operator_without_sweeps_leaves_its_passenger_to_finish() -> None:
    matrices = torch.randn(2, 6, 6, dtype=torch.float64)
    symmetric = GramOperator(DenseOperator(matrices))

    def steps():
        product = yield symmetric, torch.eye(6, dtype=torch.float64).expand(2, 6, 6)
        return product

    passenger = operators.Passenger(steps())
    assert symmetric.carrying(passenger) is symmetric
    torch.testing.assert_close(passenger.finish(), matrices.transpose(1, 2) @ matrices)

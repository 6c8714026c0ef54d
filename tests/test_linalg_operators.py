"""Operators multiply like the matrices they stand for: a dense batch's one-sweep Gram product, and a stack
of operators that multiplies, restricts and rejects mismatches like the batch it stands for."""

from __future__ import annotations

import pytest
import torch

from spectral_monitor.linalg import lanczos_eigsh, operators
from spectral_monitor.linalg.operators import DenseOperator, GramOperator, StackedOperator


@pytest.mark.parametrize("rows_per_block", [1, 3, 10, 64])
def test_a_dense_gram_sweep_is_the_product_with_the_gram_matrix(
    monkeypatch: pytest.MonkeyPatch, rows_per_block: int
) -> None:
    """Blocks of rows that do not divide the 10 rows (the last is short), one row, all rows; rectangular and
    restricted to scattered elements."""
    matrices = torch.randn(5, 10, 7, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    monkeypatch.setattr(operators, "GRAM_SWEEP_BYTES", rows_per_block * 5 * 7 * 8)
    block = torch.randn(5, 7, operators.GRAM_SWEEP_MAX_COLUMNS, dtype=torch.float64)
    expected = matrices.transpose(1, 2) @ matrices @ block
    dense = DenseOperator(matrices)
    torch.testing.assert_close(dense.gram_matmat(block), expected, rtol=1e-12, atol=1e-12)
    kept = torch.tensor([0, 2, 3])
    torch.testing.assert_close(
        dense.restrict(kept).gram_matmat(block[kept]), expected[kept], rtol=1e-12, atol=1e-12
    )


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

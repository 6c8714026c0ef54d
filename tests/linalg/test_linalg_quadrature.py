"""Stochastic Lanczos quadrature: an element that stops early keeps the rules of the step it stopped at."""

from __future__ import annotations

import pytest
import torch

from spectral_monitor.linalg import hutchinson_trace, hutchpp_trace, lanczos_quadrature
from spectral_monitor.linalg.operators import DenseOperator, FunctionOperator, GramOperator, rademacher

STEPS = 24
STOP_AT = (8, 12, 24, 16, 8)  # per batch element; 24 = never stopped early


def gram_of_softmax(batch: int, n: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.softmax(2 * torch.randn(batch, n, n, generator=generator, dtype=torch.float64), dim=-1)


def sqrt_rule(nodes: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (weights * nodes.clamp_min(0).sqrt()).sum(dim=-1)


@pytest.mark.parametrize("restrictable", [True, False], ids=["restricted", "products-go-on"])
def test_an_element_that_stops_keeps_the_rules_of_its_step(restrictable: bool) -> None:
    matrices = gram_of_softmax(len(STOP_AT), 96)
    gram = GramOperator(DenseOperator(matrices))
    op = (
        gram
        if restrictable
        else FunctionOperator(
            gram.matmat, batch=gram.batch, rows=gram.rows, cols=gram.cols, dtype=gram.dtype, symmetric=True
        )
    )
    probes = rademacher(
        (len(STOP_AT), 96, 6),
        dtype=torch.float64,
        device=torch.device("cpu"),
        generator=torch.Generator().manual_seed(1),
    )
    stop_at = torch.tensor(STOP_AT)
    seen_lengths = []

    def until(quadrature):
        seen_lengths.append(quadrature.nodes.shape[-1])
        return stop_at <= quadrature.nodes.shape[-1]

    early = lanczos_quadrature(op, num_probes=6, probes=probes, num_steps=STEPS, until=until, check_every=4)
    assert early.nodes.shape == (len(STOP_AT), 6, STEPS)
    assert seen_lengths == [8, 12, 16, 20]
    for element, steps in enumerate(STOP_AT):
        alone = lanczos_quadrature(
            GramOperator(DenseOperator(matrices[element : element + 1])),
            num_probes=6,
            probes=probes[element : element + 1],
            num_steps=steps,
        )
        torch.testing.assert_close(
            sqrt_rule(early.nodes[element], early.weights[element]),
            sqrt_rule(alone.nodes[0], alone.weights[0]),
            rtol=1e-12,
            atol=1e-12,
        )
        # Gauss–Radau solves a near-singular tridiagonal system: equal to what float64 lstsq resolves.
        torch.testing.assert_close(
            sqrt_rule(early.radau_nodes[element], early.radau_weights[element]),
            sqrt_rule(alone.radau_nodes[0], alone.radau_weights[0]),
            rtol=1e-5,
            atol=1e-9,
        )


def test_a_stopped_element_costs_no_more_products() -> None:
    matrices = gram_of_softmax(4, 64)
    products = []

    class Counted(DenseOperator):
        def matmat(self, x: torch.Tensor) -> torch.Tensor:
            products.append(x.shape[0])
            return super().matmat(x)

        def restrict(self, index: torch.Tensor) -> Counted:
            return Counted(self.matrices[index], symmetric=True)

    op = Counted(matrices.transpose(1, 2) @ matrices, symmetric=True)
    lanczos_quadrature(
        op,
        num_probes=4,
        num_steps=20,
        check_every=4,
        until=lambda quadrature: torch.tensor([True, False, False, True]),
    )
    assert products == [4] * 8 + [2] * 12  # two elements leave after the check at step 8


def test_trace_estimators_refuse_an_operator_without_a_trace_by_name() -> None:
    rectangular = DenseOperator(torch.ones(1, 3, 4))
    with pytest.raises(ValueError, match=r"op must be square to have a trace, got rows=3, cols=4"):
        hutchinson_trace(rectangular)
    with pytest.raises(ValueError, match="op must be symmetric"):
        hutchpp_trace(rectangular)

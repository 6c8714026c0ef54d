"""The exact eigen gap survives LAPACK failing to converge (``geev`` on a defective matrix, which happens for
rank-one sink heads in float64 on some CPUs): that matrix is decomposed in the other precision, and is
NaN (not measurable) only when both fail; the other matrices of the batch keep their exact value."""

from __future__ import annotations

import pytest
import torch

from spectral_monitor.metrics import attention_metrics

N = 16


def heads() -> torch.Tensor:
    sink = torch.full((N, N), 0.1 / (N - 1), dtype=torch.float64)
    sink[:, 0] = 0.9  # rank one: the eigenvalues are 1 and 0 (n - 1 times)
    uniform = torch.full((N, N), 1.0 / N, dtype=torch.float64)
    identity = torch.eye(N, dtype=torch.float64)  # eigenvalues all 1: gap 0
    return torch.stack([sink, uniform, identity])


def failing(dtypes: tuple[torch.dtype, ...]):
    eigvals = torch.linalg.eigvals

    def eigvals_failing_for(matrices: torch.Tensor) -> torch.Tensor:
        if matrices.dtype in dtypes:
            raise torch.linalg.LinAlgError("The algorithm failed to converge")
        return eigvals(matrices)

    return eigvals_failing_for


@pytest.mark.parametrize(
    ("dtypes", "expected"),
    [((), [1.0, 1.0, 0.0]), ((torch.float64,), [1.0, 1.0, 0.0]), ((torch.float64, torch.float32), None)],
    ids=["converges", "float64_fails", "both_fail"],
)
def test_the_eigen_gap_survives_lapack_failing_to_converge(
    monkeypatch: pytest.MonkeyPatch, dtypes: tuple[torch.dtype, ...], expected: list[float] | None
) -> None:
    monkeypatch.setattr(torch.linalg, "eigvals", failing(dtypes))
    gap = attention_metrics(heads(), method="exact")["eigen_gap"]
    if expected is None:
        assert torch.isnan(gap).all()
    else:
        assert gap.tolist() == pytest.approx(expected, abs=1e-6)

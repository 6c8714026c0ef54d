"""Gram eigenvalues by either LAPACK are the same numbers: numpy's route (taken where MKL would take its
generic path) runs at torch's thread count and gives the thread count back, and stays closed on Intel
processors, below its size and where a gradient is wanted."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from spectral_monitor.linalg import host_lapack
from spectral_monitor.linalg.host_lapack import HOST_LAPACK_MIN_ROWS, gram_eigenvalues


@pytest.fixture
def vendor(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Lets a test name the processor's vendor; the route's cached decision is forgotten before and after."""
    decision = host_lapack._openblas_thread_setters
    decision.cache_clear()
    yield monkeypatch
    decision.cache_clear()


def with_singular_values(singular_values: torch.Tensor, cols: int, seed: int) -> torch.Tensor:
    """A float64 (rows × cols) matrix U diag(s) Vᵀ with random orthonormal U, V and the given s."""
    generator = torch.Generator().manual_seed(seed)
    rows = singular_values.numel()
    left = torch.linalg.qr(torch.randn(rows, rows, generator=generator, dtype=torch.float64)).Q
    right = torch.linalg.qr(torch.randn(cols, rows, generator=generator, dtype=torch.float64)).Q
    return left @ torch.diag(singular_values) @ right.T


def recording_setter(calls: list[int], previous: int = 7):
    def setter(count: int) -> int:
        calls.append(count)
        return previous

    return setter


@pytest.mark.parametrize("rows", [8, HOST_LAPACK_MIN_ROWS, 300])
def test_the_eigenvalues_of_the_gram_matrix_are_the_squared_singular_values_by_either_route(
    vendor: pytest.MonkeyPatch, rows: int
) -> None:
    """s spread over 1e-3 … 10 (and one exact zero) in a rows × (rows + 50) matrix: both routes give s²,
    ascending, within 1e-12·σ₁² (float64 rounding of the product and of syevd, with room for another
    CPU's BLAS); numpy's is opened by naming a processor MKL serves generically, wherever numpy's OpenBLAS
    lets its thread count be set per call."""
    singular_values = torch.logspace(-3, 1, rows, dtype=torch.float64)
    singular_values[0] = 0.0
    matrices = torch.stack([with_singular_values(singular_values, rows + 50, seed) for seed in range(2)])
    expected = singular_values.square().expand(2, rows)
    vendor.setattr(host_lapack, "_cpu_vendor", lambda: "GenuineIntel")
    torch.testing.assert_close(gram_eigenvalues(matrices), expected, rtol=0, atol=1e-12 * expected.max())
    host_lapack._openblas_thread_setters.cache_clear()
    vendor.setattr(host_lapack, "_cpu_vendor", lambda: "AuthenticAMD")
    if not host_lapack._openblas_thread_setters():
        pytest.skip("torch without MKL, or numpy without an OpenBLAS whose thread count can be set per call")
    numpy_calls = []
    numpy_eigenvalues = np.linalg.eigvalsh
    vendor.setattr(
        host_lapack.np.linalg, "eigvalsh", lambda gram: numpy_calls.append(1) or numpy_eigenvalues(gram)
    )
    torch.testing.assert_close(gram_eigenvalues(matrices), expected, rtol=0, atol=1e-12 * expected.max())
    assert len(numpy_calls) == (rows >= HOST_LAPACK_MIN_ROWS)


def test_numpys_route_runs_at_torchs_thread_count_and_gives_the_count_back(
    vendor: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    vendor.setattr(host_lapack, "_openblas_thread_setters", lambda: (recording_setter(calls),))
    matrices = torch.randn(1, HOST_LAPACK_MIN_ROWS, 4, dtype=torch.float64)
    gram_eigenvalues(matrices)
    assert calls == [torch.get_num_threads(), 7]


@pytest.mark.parametrize("case", ["small", "gradient", "intel"])
def test_numpys_route_stays_closed_below_its_size_for_a_gradient_and_on_intel(
    vendor: pytest.MonkeyPatch, case: str
) -> None:
    """Each case would otherwise take the route (a setter stands ready): only torch runs, and a gradient
    flows back through it."""
    calls: list[int] = []
    if case == "intel":
        vendor.setattr(host_lapack, "_cpu_vendor", lambda: "GenuineIntel")
        assert host_lapack._openblas_thread_setters() == ()
        assert not host_lapack.numpy_route_open()
    else:
        vendor.setattr(host_lapack, "_openblas_thread_setters", lambda: (recording_setter(calls),))
        assert host_lapack.numpy_route_open()
    rows = HOST_LAPACK_MIN_ROWS - 1 if case == "small" else HOST_LAPACK_MIN_ROWS
    matrices = torch.randn(1, rows, 3, dtype=torch.float64, requires_grad=case == "gradient")
    values = gram_eigenvalues(matrices)
    assert calls == []
    if case == "gradient":
        values.sum().backward()
        torch.testing.assert_close(matrices.grad, 2 * matrices.detach(), rtol=1e-10, atol=1e-10)


def test_where_numpys_lapack_does_not_converge_torchs_answers(vendor: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    vendor.setattr(host_lapack, "_openblas_thread_setters", lambda: (recording_setter(calls),))

    def not_converging(matrices: object) -> None:
        raise np.linalg.LinAlgError("Eigenvalues did not converge")

    vendor.setattr(host_lapack.np.linalg, "eigvalsh", not_converging)
    matrices = torch.randn(2, HOST_LAPACK_MIN_ROWS, 5, dtype=torch.float64)
    expected = torch.linalg.eigvalsh(matrices @ matrices.mT)
    torch.testing.assert_close(gram_eigenvalues(matrices), expected, rtol=0, atol=0)
    assert calls == [torch.get_num_threads(), 7]

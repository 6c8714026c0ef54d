"""Shared test fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models and matrices gain nothing from intra-op threads; on a shared machine they only wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def rank_sums_by_quadrature(monkeypatch):
    """Dense batches' rank sums by the quadrature at every size, as matrices above
    ``FACTORISE_FIRST_MAX_SIZE`` and blockwise layers get them: small cases then test the estimator itself."""
    from spectral_monitor.metrics import attention_rank_sums

    monkeypatch.setattr(attention_rank_sums, "FACTORISE_FIRST_MAX_SIZE", 0)


@pytest.fixture
def deflated_pairs(monkeypatch) -> list[list[int]]:
    """How many Ritz pairs each element of each rank-sum call deflated, one list per call, in call order."""
    from spectral_monitor.metrics import attention_rank_sums

    calls: list[list[int]] = []
    ritz_deflation = attention_rank_sums._ritz_deflation

    def recorded(*args, **kwargs):
        result = ritz_deflation(*args, **kwargs)
        calls.append(result[2].tolist())
        return result

    monkeypatch.setattr(attention_rank_sums, "_ritz_deflation", recorded)
    return calls

"""Weights whose entries are finite float32 near 1e19 have finite norms: sums of squares of them overflow
float32 (‖W‖_F² ≈ 1e38 · N · M), so the probe scales each copy by a power of two first, exactly. Checked
against float64 on the Krylov path (48 × 40), the exact small path (8 × 8) and an attention module's q, k, v
and ‖W_Q^hᵀ W_K^h‖₂; through the plain loop, with ``stop_on=["non_finite"]``: no false alert; and the token
metrics of residual-stream states that large."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from spectral_monitor import Monitor
from spectral_monitor.alerts import AlertEvent
from spectral_monitor.metrics import token_metrics
from spectral_monitor.probes import WeightProbe

pytestmark = pytest.mark.usefixtures("one_thread")

LARGEST = 1e19


def huge_model(largest: float = LARGEST) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 40), nn.Linear(8, 8), nn.MultiheadAttention(48, 4))
    with torch.no_grad():
        for parameter in (model[0].weight, model[1].weight, model[2].in_proj_weight):
            parameter.mul_(largest / parameter.abs().max())
    return model


def by_name(probe: WeightProbe, metric: str) -> dict[str, float]:
    return {m.layer: m.value for m in probe.measure(0) if m.metric == metric and m.head is None}


def test_weights_near_1e19_have_the_norms_of_a_float64_computation() -> None:
    model = huge_model()
    probe = WeightProbe(model, per_head=False)
    spectral, frobenius = by_name(probe, "spectral_norm"), by_name(probe, "frobenius_norm")
    stable_rank = by_name(probe, "stable_rank")
    for layer, weight in probe.named_matrices():
        weight = weight.double()
        if layer != "2.out_proj":  # the weights made huge: unscaled, their float32 norm is inf
            assert not torch.linalg.matrix_norm(weight.float()).isfinite()
        assert spectral[layer] == pytest.approx(torch.linalg.matrix_norm(weight, ord=2).item(), rel=1e-3)
        assert frobenius[layer] == pytest.approx(torch.linalg.matrix_norm(weight).item(), rel=1e-6)
        assert 1 <= stable_rank[layer] <= min(weight.shape)
    query, key = model[2].in_proj_weight.detach().double()[:96].chunk(2)
    expected = max(
        torch.linalg.matrix_norm(q.T @ k, ord=2).item()
        for q, k in zip(query.chunk(4), key.chunk(4), strict=True)
    )
    assert by_name(probe, "qk_spectral_norm_max")["2"] == pytest.approx(expected, rel=1e-5)


def test_scaling_by_a_power_of_two_is_exact() -> None:
    ordinary = by_name(WeightProbe(huge_model(1.0)), "spectral_norm")
    scaled = by_name(WeightProbe(huge_model(2.0**40)), "spectral_norm")
    del ordinary["2.out_proj"], scaled["2.out_proj"]  # not scaled by huge_model
    assert scaled == {layer: value * 2.0**40 for layer, value in ordinary.items()}


def test_the_plain_loop_raises_no_non_finite_alert_on_huge_finite_weights(tmp_path: Path) -> None:
    model = huge_model()
    seen: list[AlertEvent] = []
    monitor = Monitor(
        model[0],
        tmp_path,
        every_n_steps=1,
        families=["weights"],
        stop_on=["non_finite"],
        on_alert=seen.append,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(2):
            with monitor.step(step):
                model[0](torch.ones(2, 48))
        monitor.close()
    assert seen == [] and not monitor.should_stop
    assert [str(w.message) for w in record if "SpectralMonitor" in str(w.message)] == []


def test_token_metrics_of_states_near_1e19_are_those_of_the_same_states_unscaled() -> None:
    states = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(0))
    ordinary = token_metrics(states)
    huge = token_metrics(states * 2.0**63)  # largest entry ≈ 2.6e19: ‖X‖_F² overflows float32 unscaled
    assert not torch.linalg.vector_norm(states * 2.0**63).square().isfinite()
    for name, values in ordinary.items():
        assert torch.equal(huge[name], values), name  # a power of two scales exactly: bit for bit


def test_token_metrics_and_weight_norms_of_tiny_values_are_those_of_the_same_values_unscaled() -> None:
    """Entries near 1e-30 have squares below float32's smallest normal: unscaled, their norms read 0."""
    states = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(0))
    ordinary = token_metrics(states)
    tiny = token_metrics(states * 2.0**-100)
    assert torch.linalg.vector_norm(states * 2.0**-100) == 0
    for name, values in ordinary.items():
        assert torch.equal(tiny[name], values), name
    model = huge_model(1.0)
    small = huge_model(2.0**-100)
    for metric in ("frobenius_norm", "spectral_norm"):
        expected = by_name(WeightProbe(model, per_head=False), metric)
        measured = by_name(WeightProbe(small, per_head=False), metric)
        for layer in ("0", "1"):
            assert measured[layer] == pytest.approx(expected[layer] * 2.0**-100, rel=1e-5), (metric, layer)


def test_only_matrices_whose_norm_lies_far_from_one_are_scaled() -> None:
    from spectral_monitor.metrics._common import scaled_where_needed

    matrices = torch.stack(
        [torch.full((3, 4), 0.5), torch.full((3, 4), 2.0**41), torch.full((3, 4), 2.0**-45)]
    )
    ordinary = matrices[:1]
    same, norms, exponents = scaled_where_needed(ordinary, torch.linalg.matrix_norm(ordinary))
    assert same is ordinary and exponents.tolist() == [0]  # in range: no copy, no pass over the entries
    scaled, norms, exponents = scaled_where_needed(matrices, torch.linalg.matrix_norm(matrices))
    assert exponents.tolist() == [0, 42, -44]
    assert scaled.amax(dim=(1, 2)).tolist() == [0.5, 0.5, 0.5]
    assert torch.equal(norms, torch.linalg.matrix_norm(scaled))

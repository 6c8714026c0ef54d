"""Head diversity of captured attention on data the metrics call non-finite or not measurable."""

from __future__ import annotations

import math

import pytest
import torch

from spectral_monitor.metrics import attention_metrics
from spectral_monitor.metrics.heads import head_spectral_distances
from spectral_monitor.probes import AttentionSample
from spectral_monitor.toolbox.head_diversity import (
    attention_spectra,
    head_diversity_records,
    layer_head_distances,
    spectrum_working_nbytes,
)


def softmax_attention(sequences: int, heads: int, n: int, seed: int = 0) -> torch.Tensor:
    logits = torch.randn(sequences, heads, n, n, generator=torch.Generator().manual_seed(seed))
    return logits.softmax(dim=-1)


def test_a_head_with_nan_attention_gets_nan_distances_and_the_others_are_measured() -> None:
    probs = softmax_attention(1, 3, 6)
    probs[0, 0, 2, 1] = math.nan
    sample = AttentionSample("layer", probs, None, None, causal=False, scale=1.0)

    distances = layer_head_distances(sample)  # no LinAlgError

    assert distances[0].isnan().all() and distances[:, 0].isnan().all()
    expected = head_spectral_distances(torch.linalg.svdvals(probs[0, 1:].double()))
    torch.testing.assert_close(distances[1:, 1:], expected, rtol=0, atol=1e-12)
    records, pairs = head_diversity_records(5, [sample])
    assert {record.metric for record in records} == {"head_diversity", "head_diversity_min"}
    assert all(math.isfinite(record.value) for record in records)  # the pair (1, 2) is measured
    assert pairs["layer"] == [(1, 2, float(expected[0, 1]))]


def test_nan_in_every_head_gives_nan_records_not_a_failure() -> None:
    probs = torch.full((2, 2, 4, 4), math.nan)
    records, pairs = head_diversity_records(0, [AttentionSample("layer", probs, None, None, False, 1.0)])
    assert len(records) == 2 and all(math.isnan(record.value) for record in records)
    assert pairs["layer"] == []


def test_padded_rows_holding_nan_are_left_out() -> None:
    probs = softmax_attention(1, 2, 5)
    reference = layer_head_distances(AttentionSample("layer", probs[:, :, :3], None, None, False, 1.0))
    padded = probs.clone()
    padded[0, :, 3:] = math.nan  # two padded queries, whose rows are not attention
    query_mask = torch.tensor([[True, True, True, False, False]])
    distances = layer_head_distances(AttentionSample("layer", padded, None, query_mask, False, 1.0))
    torch.testing.assert_close(distances, reference, rtol=0, atol=1e-12)


def test_the_metrics_singular_values_are_the_float64_spectra_head_diversity_reads() -> None:
    probs = softmax_attention(2, 3, 40)
    probs[1, 2, 5, 10] = math.nan
    query_mask = torch.ones(2, 40, dtype=torch.bool)
    query_mask[0, 30:] = False
    key_mask = torch.ones(2, 40, dtype=torch.bool)
    key_mask[1, :3] = False

    expected = attention_spectra(probs, query_mask, key_mask)
    assert expected[1, 2].isnan().all()
    # The Krylov path factorises its rank sums at this size and hands on the same values as the exact path.
    for method in ("exact", "krylov"):
        metrics = attention_metrics(
            probs,
            query_mask=query_mask[:, None, :],
            key_mask=key_mask[:, None, :],
            method=method,
            return_spectra=True,
        )
        torch.testing.assert_close(
            metrics["singular_values"].double(), expected, rtol=0, atol=1e-6, equal_nan=True
        )
    # Without the rank sums the Krylov path factorises nothing and has none.
    without_rank_sums = attention_metrics(
        probs, method="krylov", include_rank_sums=False, return_spectra=True
    )
    assert "singular_values" not in without_rank_sums


def test_the_spectrum_working_memory_grows_with_the_matrix_and_refuses_other_dtypes_by_name() -> None:
    sizes = [spectrum_working_nbytes(n, n, torch.float32) for n in (32, 64, 128)]
    assert sizes[2] - sizes[1] == pytest.approx(4 * (sizes[1] - sizes[0]), abs=4)  # n² copies
    assert spectrum_working_nbytes(64, 64, torch.float64) > sizes[1]
    with pytest.raises(ValueError, match=r"dtype must be one of .*float64.*got torch.float16"):
        spectrum_working_nbytes(64, 64, torch.float16)

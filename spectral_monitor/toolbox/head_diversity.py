"""Head spectral diversity of captured attention: per-layer records and the most redundant head pairs.

The distances are :func:`~spectral_monitor.metrics.heads.head_spectral_distances` (Jensen–Shannon distance
between normalised singular-value spectra, in bits), averaged over the sampled sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spectral_monitor.metrics.heads import head_diversity, head_spectral_distances, most_redundant_head_pairs
from spectral_monitor.probes import AttentionSample
from spectral_monitor.records import Measurement

__all__ = ["REDUNDANT_PAIRS", "head_diversity_records", "layer_head_distances", "redundant_pairs_markdown"]

REDUNDANT_PAIRS = 3
"""Pairs listed per layer in the text entry."""


@torch.no_grad()
def layer_head_distances(sample: AttentionSample) -> torch.Tensor:
    """(heads, heads) distances of one layer's heads, mean over its sequences (valid queries × keys only).

    A head whose attention holds NaN or inf in a sequence has no spectrum there: its distances are NaN for
    that sequence (NaN overall when it is non-finite in every sequence), as the metrics write non-finite
    data. Its matrix is not decomposed: an SVD of non-finite values fails to converge.
    """
    sequences, heads, queries, keys = sample.probs.shape
    # One float64 matrix at a time: the whole (S, H, n, n) batch in float64 was 128 MiB at n = 2048.
    singular_values = torch.full((sequences, heads, min(queries, keys)), torch.nan, dtype=torch.float64)
    for sequence in range(sequences):
        for head in range(heads):
            matrix = sample.probs[sequence, head].to(torch.float64)
            # Padded queries and unattendable keys are zeroed whatever they hold (a padded row may be NaN).
            if sample.query_mask is not None:
                matrix = torch.where(sample.query_mask[sequence, :, None], matrix, 0.0)
            if sample.key_mask is not None:
                matrix = torch.where(sample.key_mask[sequence, None, :], matrix, 0.0)
            if bool(matrix.isfinite().all()):
                singular_values[sequence, head] = torch.linalg.svdvals(matrix)
    return head_spectral_distances(singular_values).nanmean(dim=0)


def head_diversity_records(
    step: int, samples: Sequence[AttentionSample]
) -> tuple[list[Measurement], dict[str, list[tuple[int, int, float]]]]:
    """Family "attention" records ``head_diversity`` and ``head_diversity_min`` per layer, and each layer's
    ``REDUNDANT_PAIRS`` closest head pairs ``(h, g, distance)``. Layers with one head are left out."""
    records: list[Measurement] = []
    pairs: dict[str, list[tuple[int, int, float]]] = {}
    for sample in samples:
        if sample.probs.shape[1] < 2:
            continue
        distances = layer_head_distances(sample)
        for metric, value in head_diversity(distances).items():
            records.append(Measurement(step, "attention", metric, sample.layer, float(value)))
        pairs[sample.layer] = most_redundant_head_pairs(distances, REDUNDANT_PAIRS)
    return records, pairs


def redundant_pairs_markdown(step: int, pairs: dict[str, list[tuple[int, int, float]]]) -> str:
    """The closest head pairs of every layer as a markdown table."""
    lines = [
        f"Most redundant head pairs at step {step} (Jensen–Shannon distance of normalised attention spectra, "
        "bits; 0 = identical spectra)",
        "",
        "| layer | head pair | distance |",
        "|---|---|---:|",
    ]
    for layer, layer_pairs in pairs.items():
        lines += [f"| {layer} | {h}, {g} | {distance:.4f} |" for h, g, distance in layer_pairs]
    return "\n".join(lines)

"""Head spectral diversity of captured attention: per-layer records and the most redundant head pairs.

The distances are :func:`~spectral_monitor.metrics.heads.head_spectral_distances` (Jensen–Shannon distance
between normalised singular-value spectra, in bits), averaged over the sampled sequences.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from spectral_monitor.metrics.heads import head_diversity, head_spectral_distances, most_redundant_head_pairs
from spectral_monitor.probes import AttentionSample
from spectral_monitor.records import Measurement

__all__ = [
    "REDUNDANT_PAIRS",
    "SPECTRUM_DTYPES",
    "attention_spectra",
    "head_diversity_records",
    "layer_head_distances",
    "redundant_pairs_markdown",
    "spectra_diversity_records",
    "spectra_head_distances",
    "spectrum_working_nbytes",
]

REDUNDANT_PAIRS = 3
"""Pairs listed per layer in the text entry."""
SPECTRUM_DTYPES = (torch.float64, torch.float32)
"""The dtypes :func:`attention_spectra` may factorise in, most precise first: a caller within a memory budget
takes the first whose :func:`spectrum_working_nbytes` fits it."""
SPECTRUM_WORKING_COPIES = {torch.float64: 4.25, torch.float32: 2.25}
"""Memory of one matrix's spectrum in :func:`attention_spectra`, in units of the matrix's float32 size: its
copy in the dtype, ``svdvals``' own copy and workspace, and the finiteness screen (a quarter). Measured from
the peak resident set at n = 512 and 2048: ``svdvals`` of a float64 copy 4.0–4.2, of a float32 matrix itself
1.0 (so 2.0 with the copy)."""
SPECTRUM_CALL_NBYTES = 2**20
"""Memory of one spectrum that does not grow with the matrix (LAPACK's vectors, the output)."""


@torch.no_grad()
def attention_spectra(
    probs: Tensor,
    query_mask: Tensor | None = None,
    key_mask: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """The singular values of each (n, m) matrix of ``probs`` (S, H, n, m), valid queries × keys only:
    (S, H, min(n, m)) float64, descending, padded with zeros; NaN for a matrix holding NaN or inf.

    ``query_mask`` (S, n) and ``key_mask`` (S, m) are bool, True = valid. One matrix at a time, factorised
    in ``dtype``: a float64 ``svdvals`` of one matrix takes four times its float32 size (64 MiB at
    n = 2048), a float32 one about its size, for σ within ~1e-7 σ₁ rather than ~1e-15 σ₁.
    """
    sequences, heads, queries, keys = probs.shape
    spectra = torch.full((sequences, heads, min(queries, keys)), torch.nan, dtype=torch.float64)
    for sequence in range(sequences):
        for head in range(heads):
            matrix = probs[sequence, head].to(dtype, copy=True)
            # Padded queries and unattendable keys are zeroed whatever they hold (a padded row may be NaN).
            if query_mask is not None:
                matrix.masked_fill_(~query_mask[sequence, :, None], 0.0)
            if key_mask is not None:
                matrix.masked_fill_(~key_mask[sequence, None, :], 0.0)
            # A non-finite matrix is not decomposed: an SVD of non-finite values fails to converge.
            if bool(matrix.isfinite().all()):
                spectra[sequence, head] = torch.linalg.svdvals(matrix)
            del matrix
    return spectra


def spectrum_working_nbytes(queries: int, keys: int, dtype: torch.dtype) -> int:
    """Most memory :func:`attention_spectra` takes beyond its input, factorising (queries, keys) matrices in
    ``dtype`` (one matrix at a time, so whatever the batch)."""
    return int(SPECTRUM_WORKING_COPIES[dtype] * 4 * queries * keys) + SPECTRUM_CALL_NBYTES


def layer_head_distances(sample: AttentionSample) -> Tensor:
    """(heads, heads) distances of one layer's heads, mean over its sequences (valid queries × keys only).

    A head whose attention holds NaN or inf in a sequence has no spectrum there: its distances are NaN for
    that sequence (NaN overall when it is non-finite in every sequence), as the metrics write non-finite
    data.
    """
    return spectra_head_distances(attention_spectra(sample.probs, sample.query_mask, sample.key_mask))


def spectra_head_distances(spectra: Tensor) -> Tensor:
    """(heads, heads) distances of one layer's heads from their (S, H, k) spectra, mean over sequences."""
    return head_spectral_distances(spectra).nanmean(dim=0)


def head_diversity_records(
    step: int, samples: Sequence[AttentionSample]
) -> tuple[list[Measurement], dict[str, list[tuple[int, int, float]]]]:
    """Family "attention" records ``head_diversity`` and ``head_diversity_min`` per layer, and each layer's
    ``REDUNDANT_PAIRS`` closest head pairs ``(h, g, distance)``. Layers with one head are left out."""
    return spectra_diversity_records(
        step,
        {
            sample.layer: attention_spectra(sample.probs, sample.query_mask, sample.key_mask)
            for sample in samples
            if sample.probs.shape[1] > 1
        },
    )


def spectra_diversity_records(
    step: int, spectra: Mapping[str, Tensor]
) -> tuple[list[Measurement], dict[str, list[tuple[int, int, float]]]]:
    """:func:`head_diversity_records` from each layer's (S, H, k) spectra (:func:`attention_spectra`)."""
    records: list[Measurement] = []
    pairs: dict[str, list[tuple[int, int, float]]] = {}
    for layer, layer_spectra in spectra.items():
        if layer_spectra.shape[1] < 2:
            continue
        distances = spectra_head_distances(layer_spectra)
        for metric, value in head_diversity(distances).items():
            records.append(Measurement(step, "attention", metric, layer, float(value)))
        pairs[layer] = most_redundant_head_pairs(distances, REDUNDANT_PAIRS)
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

"""Head spectral diversity of captured attention: per-layer records and the most redundant head pairs.

The distances are :func:`~spectral_monitor.metrics.heads.head_spectral_distances` (Jensen–Shannon distance
between normalised singular-value spectra, in bits), averaged over the sampled sequences. The pipeline:
:func:`attention_spectra` factorises each head's (valid queries × keys) attention,
:func:`spectra_head_distances` turns a layer's spectra into its (H, H) distances,
:func:`spectra_diversity_records` into ``head_diversity`` records and closest pairs, and
:func:`redundant_pairs_markdown` writes those pairs as a table. :func:`head_diversity_records` and
:func:`layer_head_distances` run it from :class:`~spectral_monitor.probes.AttentionSample` s.
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
copy in the dtype (2 in float64, 1 in float32), ``svdvals``' own copy and workspace (as much again), and the
finiteness screen (a quarter)."""
SPECTRUM_CALL_NBYTES = 2**20
"""Memory of one spectrum that does not grow with the matrix (LAPACK's vectors, the output)."""


@torch.no_grad()
def attention_spectra(
    probs: Tensor,
    query_mask: Tensor | None = None,
    key_mask: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """The singular values of each (n, m) attention matrix of ``probs``, valid queries × keys only.

    Padded queries and unattendable keys are zeroed before the factorisation, whatever they hold, so they
    add no singular value. One matrix at a time, factorised in ``dtype``: a float64 ``svdvals`` of one
    matrix takes about four times its float32 size (64 MiB at n = m = 2048), a float32 one about twice, for
    σ within ~1e-7 σ₁ rather than ~1e-15 σ₁ (:func:`spectrum_working_nbytes`). ``probs`` is not modified.

    Args:
        probs: (S, H, n, m) attention probabilities, S sequences of H heads.
        query_mask: (S, n) bool, True = a valid query; None: every query is.
        key_mask: (S, m) bool, True = an attendable key; None: every key is.
        dtype: What each matrix is factorised in, one of ``SPECTRUM_DTYPES``.

    Returns:
        (S, H, min(n, m)) float64 singular values, descending (the zeroed rows and columns give zeros); a
        matrix holding NaN or inf is not decomposed and its row is NaN.

    Examples:
        Identity attention has a flat spectrum, uniform attention a rank-one one; masking out a query of the
        identity leaves one singular value:

        >>> import torch
        >>> probs = torch.stack([torch.eye(2), torch.full((2, 2), 0.5)])[None]  # (1, 2, 2, 2)
        >>> attention_spectra(probs).round(decimals=4)
        tensor([[[1., 1.],
                 [1., 0.]]], dtype=torch.float64)
        >>> attention_spectra(probs, query_mask=torch.tensor([[True, False]]))[0, 0].tolist()
        [1.0, 0.0]
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
    """Most memory :func:`attention_spectra` takes beyond its input, factorising (queries, keys) matrices.

    One matrix at a time, so the same whatever the number of sequences and heads:
    ``SPECTRUM_WORKING_COPIES[dtype]`` float32 copies of one matrix plus ``SPECTRUM_CALL_NBYTES``.

    Args:
        queries: Rows n of each attention matrix.
        keys: Columns m of each attention matrix.
        dtype: The factorisation's dtype, one of ``SPECTRUM_DTYPES``.

    Returns:
        Bytes.

    Raises:
        ValueError: ``dtype`` is not one of ``SPECTRUM_DTYPES``.

    Examples:
        A caller with a budget takes the most precise dtype that fits:

        >>> import torch
        >>> budget = 48 * 2**20
        >>> next(dtype for dtype in SPECTRUM_DTYPES if spectrum_working_nbytes(2048, 2048, dtype) <= budget)
        torch.float32
    """
    if dtype not in SPECTRUM_WORKING_COPIES:
        raise ValueError(f"dtype must be one of {SPECTRUM_DTYPES}, got {dtype}")
    return int(SPECTRUM_WORKING_COPIES[dtype] * 4 * queries * keys) + SPECTRUM_CALL_NBYTES


def layer_head_distances(sample: AttentionSample) -> Tensor:
    """(heads, heads) distances of one layer's heads, mean over its sequences (valid queries × keys only).

    A head whose attention holds NaN or inf in a sequence has no spectrum there: its distances are NaN for
    that sequence and the mean leaves that sequence out (NaN overall when it is non-finite in every
    sequence), as the metrics write non-finite data.

    Args:
        sample: One layer's captured attention; its masks select the valid queries and keys.

    Returns:
        (H, H) float64 Jensen–Shannon distances in bits, symmetric with a zero diagonal.

    Examples:
        Two identity heads have the same (flat) spectrum; a uniform head is rank one:

        >>> import torch
        >>> from spectral_monitor.probes import AttentionSample
        >>> probs = torch.stack([torch.eye(2), torch.eye(2), torch.full((2, 2), 0.5)])[None]
        >>> sample = AttentionSample("blocks.0.attn", probs, None, None, causal=False, scale=1.0)
        >>> layer_head_distances(sample).round(decimals=4)
        tensor([[0.0000, 0.0000, 0.5579],
                [0.0000, 0.0000, 0.5579],
                [0.5579, 0.5579, 0.0000]], dtype=torch.float64)
    """
    return spectra_head_distances(attention_spectra(sample.probs, sample.query_mask, sample.key_mask))


def spectra_head_distances(spectra: Tensor) -> Tensor:
    """(heads, heads) distances of one layer's heads from their spectra, mean over sequences.

    Args:
        spectra: (S, H, k) singular values of :func:`attention_spectra`; a NaN row (a non-finite head) is
            left out of the mean for its sequence.

    Returns:
        (H, H) float64 Jensen–Shannon distances in bits; NaN for a head without a spectrum in any sequence.

    Examples:
        >>> import torch
        >>> spectra = torch.tensor([[[1.0, 1.0], [1.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]])  # (2, 2, 2)
        >>> spectra_head_distances(spectra).round(decimals=4)
        tensor([[0.0000, 0.2790],
                [0.2790, 0.0000]], dtype=torch.float64)
    """
    return head_spectral_distances(spectra).nanmean(dim=0)


def head_diversity_records(
    step: int, samples: Sequence[AttentionSample]
) -> tuple[list[Measurement], dict[str, list[tuple[int, int, float]]]]:
    """The head-diversity records of captured layers, and each layer's closest head pairs.

    Args:
        step: The step the records are filed under.
        samples: Captured layers; layers with one head are left out.

    Returns:
        ``(records, pairs)`` as :func:`spectra_diversity_records` gives them: family "attention" records
        ``head_diversity`` (mean distance over head pairs) and ``head_diversity_min`` (the closest pair's)
        per layer, and each layer's ``REDUNDANT_PAIRS`` closest pairs ``(h, g, distance)``, closest first.

    Examples:
        >>> import torch
        >>> from spectral_monitor.probes import AttentionSample
        >>> probs = torch.stack([torch.eye(2), torch.eye(2), torch.full((2, 2), 0.5)])[None]
        >>> sample = AttentionSample("blocks.0.attn", probs, None, None, causal=False, scale=1.0)
        >>> records, pairs = head_diversity_records(7, [sample])
        >>> [(record.metric, round(record.value, 4)) for record in records]
        [('head_diversity', 0.3719), ('head_diversity_min', 0.0)]
        >>> [(h, g, round(distance, 4)) for h, g, distance in pairs["blocks.0.attn"]]
        [(0, 1, 0.0), (0, 2, 0.5579), (1, 2, 0.5579)]
    """
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
    """:func:`head_diversity_records` from each layer's spectra, already factorised.

    Args:
        step: The step the records are filed under.
        spectra: Each layer's (S, H, k) singular values (:func:`attention_spectra`) by layer name; layers
            with one head are left out.

    Returns:
        ``(records, pairs)``: family "attention" records ``head_diversity`` and ``head_diversity_min`` per
        layer, in the mapping's order, and each layer's ``REDUNDANT_PAIRS`` closest head pairs
        ``(h, g, distance)``, closest first, pairs at a NaN distance left out.

    Examples:
        >>> import torch
        >>> spectra = {"blocks.0.attn": torch.tensor([[[1.0, 1.0], [1.0, 0.0]]]), "lm": torch.ones(1, 1, 2)}
        >>> records, pairs = spectra_diversity_records(3, spectra)
        >>> [(record.metric, record.layer, round(record.value, 4)) for record in records]
        [('head_diversity', 'blocks.0.attn', 0.5579), ('head_diversity_min', 'blocks.0.attn', 0.5579)]
        >>> list(pairs)
        ['blocks.0.attn']
    """
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
    """The closest head pairs of every layer as a markdown table, one row per pair.

    Args:
        step: The step named in the table's caption.
        pairs: Each layer's ``(h, g, distance)`` pairs, as :func:`spectra_diversity_records` gives them.

    Returns:
        A caption line, a blank line and a table of layer, head pair and distance (4 decimals).

    Examples:
        >>> print(redundant_pairs_markdown(7, {"blocks.0.attn": [(0, 1, 0.0), (0, 2, 0.5579)]}))
        Most redundant head pairs at step 7 (Jensen–Shannon distance of normalised attention spectra,
        bits; 0 = identical spectra)
        <BLANKLINE>
        | layer | head pair | distance |
        |---|---|---:|
        | blocks.0.attn | 0, 1 | 0.0000 |
        | blocks.0.attn | 0, 2 | 0.5579 |
    """
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

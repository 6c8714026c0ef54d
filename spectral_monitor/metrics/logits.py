"""Logit metrics: the largest pre-softmax attention logit, and the size of a language model's output logits.

Attention logits that grow without bound drive attention entropy to zero and precede loss spikes
(Dehghani et al. 2023; Wortsman et al. 2023); Kimi K2's QK-Clip rescales the query and key weights of any
head whose largest logit passes a threshold. Output logits whose log-partition drifts from 0 are what the
z-loss of PaLM penalises (Wortsman et al. 2023 watch the same quantity).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from spectral_monitor.metrics._common import check_matrices, flat_mask

LOGIT_METRIC_NAMES = ("max_logit",)
"""The attention metrics that need the logits, not only the probabilities."""
OUTPUT_LOGIT_METRICS = ("max_logit", "log_partition")
"""The keys of :func:`output_logit_metrics`."""
SEQUENCE_MAXIMA = frozenset(LOGIT_METRIC_NAMES)
"""Metrics summarised over several sequences by their largest value, not their mean: a largest logit is a
bound on every logit seen."""


def max_attention_logit(
    logits: Tensor, *, key_mask: Tensor | None = None, query_mask: Tensor | None = None
) -> Tensor:
    """The largest logit over real queries × attendable keys of each matrix of ``logits``.

    ``logits`` are the scaled pre-softmax logits with every additive bias added (a float bias belongs to the
    logits) and ``-inf`` where a query may not attend a key (the mask and causal pattern applied); the masks
    leave out keys and padded queries on top of that.

    Args:
        logits: (..., n, m) floating logits, queries × keys.
        key_mask: (..., m) bool, True = attendable key; None = every key.
        query_mask: (..., n) bool, True = real query; None = every query.

    Returns:
        Shape ``logits.shape[:-2]``: the largest counted logit; NaN where no real query has an attendable key
        (nothing to measure), NaN where a counted logit is NaN.

    Examples:
        >>> import math, torch
        >>> logits = torch.tensor([[0.0, 2.0], [1.0, -math.inf]])
        >>> float(max_attention_logit(logits))
        2.0
        >>> float(max_attention_logit(logits, key_mask=torch.tensor([True, False])))  # second key out
        1.0
        >>> float(max_attention_logit(logits, query_mask=torch.tensor([False, False])))  # no real query
        nan
    """
    logits = check_matrices(logits, "logits")
    batch_shape, (n, m) = logits.shape[:-2], logits.shape[-2:]
    flat = logits.reshape(-1, n, m)
    if key_mask is None:
        row_maxima = flat.amax(dim=2)
    else:
        keys = flat_mask(key_mask, "key_mask", batch_shape, m, logits.device)
        # One matrix at a time: a masked copy of the whole batch would be one more n × m per matrix.
        row_maxima = torch.stack(
            [
                matrix.masked_fill(~open_keys, -math.inf).amax(dim=1)
                for matrix, open_keys in zip(flat, keys, strict=True)
            ]
        )
    queries = flat_mask(query_mask, "query_mask", batch_shape, n, logits.device)
    return max_over_real_queries(row_maxima, queries).reshape(batch_shape)


def max_over_real_queries(row_maxima: Tensor, queries: Tensor) -> Tensor:
    """The largest of the rows' largest logits over the real queries of each matrix.

    Args:
        row_maxima: (B, n) each row's largest logit, ``-inf`` for a row with no attendable key.
        queries: (B, n) bool, True = real query.

    Returns:
        (B,) the largest counted row maximum; NaN where no real query has an attendable key (every counted
        row maximum is ``-inf``).

    Examples:
        >>> import math, torch
        >>> row_maxima = torch.tensor([[2.0, 1.0], [-math.inf, -math.inf]])
        >>> max_over_real_queries(row_maxima, torch.tensor([[False, True], [True, True]]))
        tensor([1., nan])
    """
    counted = torch.where(queries, row_maxima, torch.full_like(row_maxima, -math.inf)).amax(dim=1)
    return counted.masked_fill(torch.isneginf(counted), math.nan)


def output_logit_metrics(logits: Tensor, *, token_mask: Tensor | None = None) -> dict[str, Tensor]:
    """The size of a language model's output logits over its real tokens, per sequence.

    - ``max_logit``: the largest logit over real tokens × the vocabulary;
    - ``log_partition``: the mean over real tokens of log Σ_v exp(logit_v), the quantity PaLM's z-loss
      pulls toward 0.

    Computed in float64 for float64 input, else float32.

    Args:
        logits: (..., n, V) floating, each token's logits over a vocabulary of V.
        token_mask: (..., n) bool, True = real token; None = every token.

    Returns:
        ``max_logit`` and ``log_partition``, each of shape ``logits.shape[:-2]``; NaN where a sequence has no
        real token.

    Examples:
        Zero logits over a vocabulary of 4 have log-partition log 4 at every token:

        >>> import torch
        >>> mask = torch.tensor([[True, True, False], [False, False, False]])
        >>> metrics = output_logit_metrics(torch.zeros(2, 3, 4), token_mask=mask)
        >>> metrics["max_logit"], metrics["log_partition"].round(decimals=4)
        (tensor([0., nan]), tensor([1.3863,    nan]))
    """
    logits = check_matrices(logits, "logits")
    batch_shape, (n, vocabulary) = logits.shape[:-2], logits.shape[-2:]
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    tokens = flat_mask(token_mask, "token_mask", batch_shape, n, logits.device)
    flat = logits.reshape(-1, n, vocabulary).to(work)
    log_partition = torch.logsumexp(flat, dim=2)
    row_maxima = flat.amax(dim=2)
    real = tokens.sum(dim=1)
    mean_log_partition = torch.where(tokens, log_partition, torch.zeros_like(log_partition)).sum(dim=1) / real
    return {
        "max_logit": max_over_real_queries(row_maxima, tokens).reshape(batch_shape),
        "log_partition": mean_log_partition.masked_fill(real == 0, math.nan).reshape(batch_shape),
    }

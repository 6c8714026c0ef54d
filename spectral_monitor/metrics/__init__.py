"""The metric catalogue as pure functions: tensors in, named tensors out.

The one definition of each metric lives here; nothing else in the package re-derives one.

Examples:
    Each attention metric is a key of what :func:`attention_metrics` returns, batched over leading dims:

    >>> import torch
    >>> from spectral_monitor.metrics import ATTENTION_METRICS, attention_metrics
    >>> metrics = attention_metrics(torch.eye(3).expand(2, 3, 3))
    >>> set(ATTENTION_METRICS) <= set(metrics), tuple(metrics["entropy"].shape)
    (True, (2,))
"""

from spectral_monitor.metrics._common import ENERGY_LEVEL, METHODS
from spectral_monitor.metrics.attention import METRIC_NAMES, attention_metrics
from spectral_monitor.metrics.attention_krylov import KrylovState
from spectral_monitor.metrics.logits import LOGIT_METRIC_NAMES as ATTENTION_LOGIT_METRICS
from spectral_monitor.metrics.logits import (
    OUTPUT_LOGIT_METRICS,
    SEQUENCE_MAXIMA,
    max_attention_logit,
    output_logit_metrics,
)
from spectral_monitor.metrics.long_context import attention_metrics_from_qk
from spectral_monitor.metrics.tokens import token_metrics
from spectral_monitor.metrics.weights import marchenko_pastur_edge, weight_metrics

ATTENTION_METRICS: tuple[str, ...] = METRIC_NAMES
"""The names of the attention metrics, each a key of what :func:`attention_metrics` returns."""

__all__ = [
    "ATTENTION_LOGIT_METRICS",
    "ATTENTION_METRICS",
    "ENERGY_LEVEL",
    "METHODS",
    "OUTPUT_LOGIT_METRICS",
    "SEQUENCE_MAXIMA",
    "KrylovState",
    "attention_metrics",
    "attention_metrics_from_qk",
    "max_attention_logit",
    "output_logit_metrics",
    "marchenko_pastur_edge",
    "token_metrics",
    "weight_metrics",
]

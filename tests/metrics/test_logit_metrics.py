"""The largest attention logit and the attention-sink masses: float64 references, closed forms, and masks.

``max_logit`` counts real queries × attendable keys only, with any additive float bias included; a padded
query or a masked key with a huge logit must change nothing. ``sink_mass`` is the largest column mean of A
over real queries, ``sink_mass_first`` the first real key's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.reference_metrics import (
    attention_reference,
    causal_uniform_attention,
    max_logit_reference,
    uniform_attention,
)
from torch import nn

from spectral_monitor.metrics import attention_metrics, attention_metrics_from_qk, max_attention_logit
from spectral_monitor.probes import AttentionCapture

N, M, D = 7, 9, 4


def qk(seed: int, n: int = N, m: int = M) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, D, generator=generator, dtype=torch.float64),
        torch.randn(m, D, generator=generator, dtype=torch.float64),
    )


def logits_of(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None = None, causal: bool = False):
    logits = q @ k.T / math.sqrt(D)
    if bias is not None:
        logits = logits + bias
    if causal:
        logits = logits.masked_fill(~torch.ones(logits.shape, dtype=torch.bool).tril(), -math.inf)
    return logits


def test_uniform_attention_puts_one_over_m_on_every_key() -> None:
    metrics = attention_metrics(torch.from_numpy(uniform_attention(5, 8)))
    assert float(metrics["sink_mass"]) == pytest.approx(1 / 8, abs=1e-15)
    assert float(metrics["sink_mass_first"]) == pytest.approx(1 / 8, abs=1e-15)


def test_every_query_on_one_key_column_is_a_sink_of_mass_one() -> None:
    attn = torch.zeros(6, 6, dtype=torch.float64)
    attn[:, 3] = 1.0
    metrics = attention_metrics(attn)
    assert float(metrics["sink_mass"]) == 1.0
    assert float(metrics["sink_mass_first"]) == 0.0


def test_causal_uniform_attention_sinks_on_the_first_key_with_the_harmonic_mean() -> None:
    # Column 0 receives 1/(i + 1) from every row i: its mean is H_n / n, the largest column.
    n = 10
    metrics = attention_metrics(torch.from_numpy(causal_uniform_attention(n)), causal=True)
    harmonic = sum(1 / (i + 1) for i in range(n))
    assert float(metrics["sink_mass"]) == pytest.approx(harmonic / n, rel=1e-14)
    assert float(metrics["sink_mass_first"]) == pytest.approx(harmonic / n, rel=1e-14)


def test_left_padding_moves_the_first_key_to_the_first_real_token() -> None:
    # Keys 0 and 1 are padding; the real first token (key 2) takes every real query's 0.6.
    attn = torch.zeros(5, 5, dtype=torch.float64)
    attn[2:, 2] = 0.6
    attn[2:, 3:] = 0.4 / 3
    attn[:2] = 0.2  # padded queries' rows: must not count
    real = torch.tensor([False, False, True, True, True])
    metrics = attention_metrics(attn, key_mask=real, query_mask=real)
    assert float(metrics["sink_mass_first"]) == pytest.approx(0.6, rel=1e-14)
    assert float(metrics["sink_mass"]) == pytest.approx(0.6, rel=1e-14)
    reference = attention_reference(attn.numpy(), key_mask=real.numpy(), query_mask=real.numpy())
    assert reference["sink_mass_first"] == pytest.approx(0.6, rel=1e-14)


@pytest.mark.parametrize("causal", [False, True])
def test_max_logit_matches_the_float64_reference_with_masks_and_a_bias(causal: bool) -> None:
    q, k = qk(1, N, N)
    generator = torch.Generator().manual_seed(2)
    bias = torch.randn(N, N, generator=generator, dtype=torch.float64)
    bias[0, 3] = -math.inf
    keys = torch.tensor([True] * (N - 2) + [False, False])
    queries = torch.tensor([True] * (N - 1) + [False])
    expected = max_logit_reference(
        q.numpy(), k.numpy(), scale=1 / math.sqrt(D), bias=bias.numpy(), key_mask=keys.numpy(),
        query_mask=queries.numpy(), causal=causal,
    )  # fmt: skip
    dense = max_attention_logit(logits_of(q, k, bias, causal), key_mask=keys, query_mask=queries)
    assert float(dense) == pytest.approx(expected, rel=1e-14)
    for method in ("exact", "krylov"):
        blocked = attention_metrics_from_qk(
            q, k, bias=bias, key_mask=keys, query_mask=queries, causal=causal, method=method, block_rows=3
        )
        assert float(blocked["max_logit"]) == pytest.approx(expected, rel=1e-12), method


def test_a_padded_query_with_huge_logits_does_not_count() -> None:
    q, k = qk(3)
    q[-1] = 1e4 * k[0]  # the padded query
    queries = torch.tensor([True] * (N - 1) + [False])
    expected = max_logit_reference(q.numpy(), k.numpy(), scale=1 / math.sqrt(D), query_mask=queries.numpy())
    assert expected < 100
    assert float(max_attention_logit(logits_of(q, k), query_mask=queries)) == pytest.approx(expected)
    blocked = attention_metrics_from_qk(q, k, query_mask=queries, method="krylov")
    assert float(blocked["max_logit"]) == pytest.approx(expected)


@pytest.mark.slow
def test_a_key_that_may_not_be_attended_does_not_count_however_large_its_logit() -> None:
    q, k = qk(4)
    k[2] = 1e4 * q[0]
    masked_by_bias = torch.zeros(N, M, dtype=torch.float64)
    masked_by_bias[:, 2] = -math.inf
    keys = torch.ones(M, dtype=torch.bool)
    keys[2] = False
    expected = max_logit_reference(q.numpy(), k.numpy(), scale=1 / math.sqrt(D), key_mask=keys.numpy())
    assert expected < 100
    assert float(max_attention_logit(logits_of(q, k, masked_by_bias))) == pytest.approx(expected)
    assert float(max_attention_logit(logits_of(q, k), key_mask=keys)) == pytest.approx(expected)
    for options in ({"bias": masked_by_bias}, {"key_mask": keys}):
        blocked = attention_metrics_from_qk(q, k, method="krylov", **options)
        assert float(blocked["max_logit"]) == pytest.approx(expected)


def test_an_additive_float_bias_belongs_to_the_logits() -> None:
    q, k = qk(5)
    bias = torch.zeros(N, M, dtype=torch.float64)
    bias[4, 6] = 50.0  # ALiBi-like: finite, so the key stays attendable and its bias counts
    expected = float((q[4] @ k[6]) / math.sqrt(D) + 50.0)
    assert float(max_attention_logit(logits_of(q, k, bias))) == pytest.approx(expected, rel=1e-14)
    blocked = attention_metrics_from_qk(q, k, bias=bias, method="krylov")
    assert float(blocked["max_logit"]) == pytest.approx(expected, rel=1e-12)


def test_nothing_to_measure_is_nan_and_not_minus_infinity() -> None:
    q, k = qk(6)
    no_query = torch.zeros(N, dtype=torch.bool)
    assert math.isnan(float(max_attention_logit(logits_of(q, k), query_mask=no_query)))
    assert math.isnan(float(attention_metrics_from_qk(q, k, query_mask=no_query)["max_logit"]))


class _BiasedAttention(nn.Module):
    """One SDPA call with an additive float mask (a bias with -inf where keys may not be attended)."""

    def __init__(self, bias: torch.Tensor) -> None:
        super().__init__()
        self.project = nn.Linear(D, 3 * D, bias=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x).unsqueeze(1).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias).squeeze(1)


def test_a_captured_call_measures_its_largest_logit_from_the_kernel_inputs() -> None:
    torch.manual_seed(0)
    bias = torch.randn(N, N)
    bias[:, 1] = -math.inf  # key 1 is never attended
    model = _BiasedAttention(bias)
    x = torch.randn(2, N, D)
    x[0, 1] = 100 * x[0, 1]  # huge logits on the masked key
    token_mask = torch.ones(2, N, dtype=torch.bool)
    token_mask[1, -2:] = False  # two padded queries in the second sequence
    with AttentionCapture(model, max_sequences=2).armed(token_mask) as recording:
        model(x)
    sample = recording.captured[0].sample()
    assert sample.max_logit is not None and sample.max_logit.shape == (2, 1)
    q, k, _ = model.project(x).detach().double().chunk(3, dim=-1)
    for sequence in range(2):
        expected = max_logit_reference(
            q[sequence].numpy(), k[sequence].numpy(), scale=1 / math.sqrt(D), bias=bias.double().numpy(),
            query_mask=token_mask[sequence].numpy(),
        )  # fmt: skip
        assert float(sample.max_logit[sequence, 0]) == pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(sample.probs.sum(dim=-1).numpy()[0, 0], 1.0, rtol=1e-6)

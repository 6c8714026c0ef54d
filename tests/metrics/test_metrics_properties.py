"""Properties the attention metrics have on every row-stochastic matrix, and how bad input is handled.

Hypothesis draws attention matrices of any shape and sharpness, with exact zeros, masks and causal
structure; each test states one inequality or invariance of the metric definitions and checks it on the
implementation's output. Below them: a non-finite batch element poisons only itself, and bad arguments
raise a ValueError that names them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from random import Random

import numpy as np
import pytest
import torch
from helpers.reference_metrics import (
    ATTENTION_METRICS,
    AttentionCase,
    attention_reference,
    one_intra_op_thread,
    query_key_logits,
    row_softmax,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spectral_monitor.metrics import attention_metrics, token_metrics, weight_metrics

# Derandomized so CI sees the same examples on every run; modest counts keep the file fast on 2 cores.
PROPERTIES = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
SLACK = 1e-9


@st.composite
def attention_matrices(
    draw: st.DrawFn,
    *,
    square: bool = False,
    causal: bool | None = None,
    masked: bool | None = None,
    size: int | None = None,
) -> AttentionCase:
    """One row-stochastic matrix, from nearly uniform to one-hot, optionally sparse, masked or causal.

    ``size`` fixes the number of queries; ``causal`` and ``masked`` of ``None`` let Hypothesis choose.
    Causal matrices are never masked, so every causal row keeps its own key and has i + 1 keys.
    """
    n = draw(st.integers(1, 9)) if size is None else size
    m = n if square else draw(st.integers(1, 9))
    causal = (n == m and draw(st.booleans())) if causal is None else causal
    masked = (not causal and draw(st.booleans())) if masked is None else masked
    sharpness = 10.0 ** draw(st.floats(-2.0, 2.5))
    sparsity = draw(st.sampled_from([0.0, 0.3, 0.8]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    key_mask = query_mask = None
    if masked:
        key_mask, query_mask = rng.random(m) < 0.7, rng.random(n) < 0.7
        key_mask[rng.integers(m)] = query_mask[rng.integers(n)] = True
    valid_keys = np.ones(m, bool) if key_mask is None else key_mask

    # Exact zeros: each row drops a random subset of its valid keys but keeps at least one.
    allowed = (rng.random((n, m)) >= sparsity) & valid_keys
    if causal:
        allowed = (allowed & np.tril(np.ones((n, m), bool))) | np.eye(n, dtype=bool)
    empty_rows = ~allowed.any(axis=1)
    allowed[empty_rows, rng.choice(np.flatnonzero(valid_keys), size=int(empty_rows.sum()))] = True

    logits = np.where(allowed, rng.standard_normal((n, m)) * sharpness, -np.inf)
    attn = row_softmax(logits)
    if masked:
        hidden = ~(query_mask[:, None] & key_mask[None, :])
        attn[hidden] = rng.uniform(0.0, 3.0, size=int(hidden.sum()))
    return AttentionCase("hypothesis", attn, key_mask=key_mask, query_mask=query_mask, causal=causal)


def measure(case: AttentionCase, **options) -> dict[str, float]:
    """``attention_metrics`` of one float64 matrix on the exact path, as Python floats."""
    result = attention_metrics(
        torch.from_numpy(case.attn),
        key_mask=None if case.key_mask is None else torch.from_numpy(case.key_mask),
        query_mask=None if case.query_mask is None else torch.from_numpy(case.query_mask),
        causal=case.causal,
        method="exact",
        **options,
    )
    return {name: float(value) for name, value in result.items()}


# --------------------------------------------------------------------------------------------------------
# Inequalities
# --------------------------------------------------------------------------------------------------------


@PROPERTIES
@given(attention_matrices())
def test_effective_and_stable_rank_lie_between_one_and_the_rank(case: AttentionCase) -> None:
    metrics = measure(case)
    rank = np.linalg.matrix_rank(case.submatrix())
    for name in ("effective_rank", "stable_rank"):
        assert 1 - SLACK <= metrics[name] <= rank * (1 + SLACK), name


@PROPERTIES
@given(attention_matrices())
def test_stable_rank_never_exceeds_effective_rank(case: AttentionCase) -> None:
    """With p = σ/Σσ: erank = exp H(p) ≥ exp H_∞(p) = 1/max p = Σσ/σ₁ ≥ Σσ²/σ₁² = stable rank.

    Shannon entropy bounds min-entropy from above, and σᵢ/σ₁ ≤ 1 gives (σᵢ/σ₁)² ≤ σᵢ/σ₁ term by term.
    """
    metrics = measure(case)
    assert metrics["stable_rank"] <= metrics["effective_rank"] * (1 + SLACK)


@PROPERTIES
@given(attention_matrices(square=True, masked=False))
def test_sigma1_of_square_row_stochastic_attention_is_at_least_one(case: AttentionCase) -> None:
    # A1 = 1, so ‖A‖₂ ≥ ‖A1‖/‖1‖ = 1.
    assert measure(case)["sigma1"] >= 1 - SLACK


@PROPERTIES
@given(attention_matrices())
def test_sigma1_is_bounded_by_the_row_and_column_sums(case: AttentionCase) -> None:
    # √(n/m) = ‖A1‖/‖1‖ ≤ σ₁ ≤ √(‖A‖₁‖A‖_∞) = √(max column sum), on the valid n×m submatrix.
    sub = case.submatrix()
    n, m = sub.shape
    sigma1 = measure(case)["sigma1"]
    assert math.sqrt(n / m) * (1 - SLACK) <= sigma1 <= math.sqrt(sub.sum(axis=0).max()) * (1 + SLACK)


@PROPERTIES
@given(attention_matrices(square=True, causal=False, masked=False))
def test_second_eigenvalue_is_bounded_by_the_dobrushin_coefficient(case: AttentionCase) -> None:
    metrics = measure(case)
    second_eigenvalue = 1 - metrics["eigen_gap"]
    assert second_eigenvalue <= metrics["dobrushin"] + SLACK


@PROPERTIES
@given(attention_matrices())
def test_normalised_entropy_lies_in_the_unit_interval(case: AttentionCase) -> None:
    entropy = measure(case)["entropy"]
    n, m = case.attn.shape
    keys = np.ones(m, bool) if case.key_mask is None else case.key_mask
    rows = np.flatnonzero(np.ones(n, bool) if case.query_mask is None else case.query_mask)
    keys_per_row = [keys[: i + 1].sum() if case.causal else keys.sum() for i in rows]
    if max(keys_per_row) < 2:
        assert math.isnan(entropy)
    else:
        assert -SLACK <= entropy <= 1 + SLACK


@PROPERTIES
@given(attention_matrices())
def test_normalised_metrics_lie_in_their_ranges(case: AttentionCase) -> None:
    metrics = measure(case)
    for name in ("spectral_gap", "rank_one_residual", "dobrushin", "effective_rank_ratio"):
        assert -SLACK <= metrics[name] <= 1 + SLACK, name
    assert metrics["effective_rank_ratio"] > 0
    rank = np.linalg.matrix_rank(case.submatrix())
    assert metrics["threshold_rank"] in range(1, rank + 1)
    n, m = case.attn.shape
    if n == m:
        assert -SLACK <= metrics["self_attention"] <= 1 + SLACK
        if not case.causal:
            assert -SLACK <= metrics["eigen_gap"] <= 1 + SLACK


# --------------------------------------------------------------------------------------------------------
# Agreement with the reference, and invariances
# --------------------------------------------------------------------------------------------------------


def assert_same_metrics(
    actual: dict[str, float], expected: dict[str, float], names=ATTENTION_METRICS, tolerance: float = 1e-10
) -> None:
    for name in names:
        if math.isnan(expected[name]):
            assert math.isnan(actual[name]), name
        else:
            assert actual[name] == pytest.approx(expected[name], rel=tolerance, abs=tolerance), name


@PROPERTIES
@given(attention_matrices())
def test_every_metric_matches_the_float64_reference_on_any_attention(case: AttentionCase) -> None:
    assert_same_metrics(measure(case), attention_reference(case.attn, **case.kwargs))


@PROPERTIES
@given(attention_matrices(square=True, causal=False), st.randoms(use_true_random=False))
def test_relabelling_the_tokens_changes_no_metric_but_which_comes_first(
    case: AttentionCase, shuffler: Random
) -> None:
    # P A Pᵀ (masks permuted alike) is the same attention over renamed tokens: same singular values,
    # eigenvalues, self-attention diagonal and rows.
    order = list(range(case.attn.shape[0]))
    shuffler.shuffle(order)
    relabelled = AttentionCase(
        "relabelled",
        case.attn[np.ix_(order, order)],
        key_mask=None if case.key_mask is None else case.key_mask[order],
        query_mask=None if case.query_mask is None else case.query_mask[order],
    )
    # Which token comes first is a position, not a label.
    names = [name for name in ATTENTION_METRICS if name != "sink_mass_first"]
    assert_same_metrics(measure(relabelled), measure(case), names)


@PROPERTIES
@given(attention_matrices(causal=False), st.randoms(use_true_random=False))
def test_reordering_the_keys_changes_no_metric_but_the_diagonal_ones_and_the_first_key(
    case: AttentionCase, shuffler: Random
) -> None:
    order = list(range(case.attn.shape[1]))
    shuffler.shuffle(order)
    reordered = AttentionCase(
        "reordered",
        case.attn[:, order],
        key_mask=None if case.key_mask is None else case.key_mask[order],
        query_mask=case.query_mask,
    )
    names = [
        name for name in ATTENTION_METRICS if name not in ("eigen_gap", "self_attention", "sink_mass_first")
    ]
    assert_same_metrics(measure(reordered), measure(case), names)


@PROPERTIES
@given(attention_matrices(masked=False, causal=False), st.integers(0, 2**32 - 1), st.booleans())
def test_masked_rows_and_columns_are_never_read(case: AttentionCase, seed: int, same_places: bool) -> None:
    # Scatter the matrix among garbage rows and columns; masking the garbage must give back its metrics.
    # A padded sequence keeps its tokens at the same places on both axes, so even the token-indexed
    # eigen gap and self-attention survive; arbitrary masks keep every other metric.
    rng = np.random.default_rng(seed)
    n, m = case.attn.shape
    padded_sequence = same_places and n == m
    rows = n + int(rng.integers(1, 4))
    cols = rows if padded_sequence else m + int(rng.integers(1, 4))
    query_mask = np.zeros(rows, bool)
    query_mask[np.sort(rng.choice(rows, n, replace=False))] = True
    key_mask = query_mask.copy() if padded_sequence else np.zeros(cols, bool)
    if not padded_sequence:
        key_mask[np.sort(rng.choice(cols, m, replace=False))] = True
    padded = rng.uniform(0.0, 5.0, size=(rows, cols))
    padded[np.ix_(query_mask, key_mask)] = case.attn
    embedded = AttentionCase("embedded", padded, key_mask=key_mask, query_mask=query_mask)
    names = (
        ATTENTION_METRICS
        if padded_sequence
        else [name for name in ATTENTION_METRICS if name not in ("eigen_gap", "self_attention")]
    )
    assert_same_metrics(measure(embedded), measure(case), names)


@PROPERTIES
@given(st.lists(attention_matrices(square=True, masked=False, causal=False, size=5), min_size=2, max_size=4))
def test_each_batch_element_is_measured_on_its_own(cases: list[AttentionCase]) -> None:
    batch = attention_metrics(torch.from_numpy(np.stack([case.attn for case in cases])), method="exact")
    for index, case in enumerate(cases):
        alone = measure(case)
        assert_same_metrics(
            {name: float(value[index]) for name, value in batch.items()}, alone, tolerance=1e-12
        )


# --------------------------------------------------------------------------------------------------------
# Non-finite input
# --------------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("rank_sums_by_quadrature")
@pytest.mark.parametrize("method", ["exact", "krylov"])
@pytest.mark.parametrize("bad_value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_nonfinite_entry_poisons_only_its_own_batch_element(method: str, bad_value: float) -> None:
    clean = torch.from_numpy(row_softmax(query_key_logits(np.random.default_rng(17), (4, 24, 24)))).float()
    poisoned = clean.clone()
    poisoned[2, 5, 7] = bad_value

    def run(attn: torch.Tensor) -> dict[str, torch.Tensor]:
        with one_intra_op_thread():
            return attention_metrics(attn, method=method, generator=torch.Generator().manual_seed(0))

    clean_result, poisoned_result = run(clean), run(poisoned)
    assert clean_result["nonfinite"].tolist() == [False] * 4
    assert poisoned_result["nonfinite"].tolist() == [False, False, True, False]
    healthy = [0, 1, 3]
    for name, value in poisoned_result.items():
        if name == "nonfinite":
            continue
        if value.is_floating_point():
            assert torch.isnan(value[2]), f"{name} of the poisoned element is {value[2]}"
        if method == "exact":
            assert torch.equal(value[healthy], clean_result[name][healthy]), name
        else:
            # Elements share Krylov iterations, so a healthy one may differ by float32 rounding; the
            # effective rank's step extrapolation divides differences of quadratures and amplifies it to
            # ~3e-5; its standard error (~1%), a jackknife of a regression on the control variate, moves by
            # up to 6e-3 of itself (measured), far inside its own sampling spread of ~18%.
            rtol = {"effective_rank": 1e-4, "effective_rank_ratio": 1e-4, "effective_rank_se": 1e-2}
            torch.testing.assert_close(
                value[healthy],
                clean_result[name][healthy],
                rtol=rtol.get(name, 1e-5),
                atol=1e-6,
                equal_nan=True,
                msg=name,
            )


# --------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------

SQUARE = torch.full((2, 3, 3), 1 / 3)


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: attention_metrics(torch.rand(5)), "attn"),
        (lambda: attention_metrics(torch.ones(3, 3, dtype=torch.int64)), "attn"),
        (lambda: attention_metrics(torch.ones(2, 0, 3, 3)), "attn"),
        (lambda: attention_metrics(SQUARE, key_mask=torch.ones(4, dtype=torch.bool)), "key_mask"),
        (lambda: attention_metrics(SQUARE, key_mask=torch.ones(3, 3, dtype=torch.bool)), "key_mask"),
        (lambda: attention_metrics(SQUARE, query_mask=torch.ones(2, dtype=torch.bool)), "query_mask"),
        (lambda: attention_metrics(SQUARE, method="svd"), "method"),
        (lambda: token_metrics(torch.rand(5)), "x"),
        (lambda: token_metrics(torch.ones(3, 4, dtype=torch.int32)), "x"),
        (lambda: token_metrics(torch.rand(3, 4), token_mask=torch.ones(5, dtype=torch.bool)), "token_mask"),
        (lambda: weight_metrics(torch.rand(5)), "w"),
        (lambda: weight_metrics(torch.ones(3, 4, dtype=torch.int64)), "w"),
        (lambda: weight_metrics(torch.rand(3, 4), method="power"), "method"),
    ],
    ids=[
        "attn_1d",
        "attn_integer",
        "attn_no_matrix",
        "key_mask_length",
        "key_mask_batch",
        "query_mask_length",
        "method",
        "x_1d",
        "x_integer",
        "token_mask_length",
        "w_1d",
        "w_integer",
        "weight_method",
    ],
)
def test_bad_input_raises_a_value_error_naming_the_argument(
    call: Callable[[], object], argument: str
) -> None:
    with pytest.raises(ValueError, match=rf"\b{argument}\b"):
        call()

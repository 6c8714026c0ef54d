"""The attention cost budget: which heads a logging step measures, what it writes of them, and that without
it a layer is measured as before."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from helpers.events import read_back, scalar_series

from spectral_monitor import Monitor, MonitorOptions
from spectral_monitor.core.attention_budget import (
    LEAST_MEASURED_RATIO,
    LayerBudget,
    layer_budget,
    matrix_cost,
    training_cost,
)
from spectral_monitor.core.attention_family import _layer_measurements, head_sample_standard_error
from spectral_monitor.core.attention_plan import AttentionPlan
from spectral_monitor.core.reports import Reports
from spectral_monitor.demo import DemoTransformer
from spectral_monitor.metrics import attention_metrics
from spectral_monitor.probes import AttentionCapture, CapturedAttention

SEQUENCES, HEADS, TOKENS, HEAD_DIM = 2, 6, 256, 16


def captured_layer(tokens: int = TOKENS, heads: int = HEADS, head_dim: int = HEAD_DIM) -> CapturedAttention:
    """One causal layer's captured q and k, with heads of different sharpness so their metrics differ."""
    generator = torch.Generator().manual_seed(0)
    sharpness = torch.linspace(0.2, 2.0, heads)[None, :, None, None]
    q = torch.randn(SEQUENCES, heads, tokens, head_dim, generator=generator) * sharpness
    k = torch.randn(SEQUENCES, heads, tokens, head_dim, generator=generator)
    return CapturedAttention("blocks.0.attention", q, k, None, True, head_dim**-0.5, None, None)


def plan(ratio: float) -> AttentionPlan:
    return AttentionPlan(MonitorOptions.from_keywords(attention_cost_ratio=ratio), Reports(strict=True))


def ratio_for(matrices: int, captured: CapturedAttention) -> float:
    """A ratio that affords exactly ``matrices`` of the layer's matrices on the exact path."""
    n, d = captured.q.shape[2], captured.q.shape[3]
    cost = matrix_cost(n, n, d, exact=True, blockwise=False, rank_sums=True, eigen_gap=False)
    return (matrices + 0.5) * cost / training_cost(captured.num_sequences, captured.num_heads, n, d)


@pytest.mark.parametrize("affordable_heads", [1, 2, 4, 5])
def test_the_heads_measured_rotate_so_every_head_is_measured_within_ceil_h_over_k_logging_steps(
    affordable_heads: int,
) -> None:
    captured = captured_layer()
    ratio = ratio_for(affordable_heads * SEQUENCES, captured)
    steps = math.ceil(HEADS / affordable_heads)
    budgets = [layer_budget(captured, ratio, t, method="auto", rank_sums=True) for t in range(steps)]
    assert all(len(budget.heads) == affordable_heads and budget.sequences == SEQUENCES for budget in budgets)
    assert all(len(set(budget.heads)) == affordable_heads for budget in budgets)
    assert set().union(*(budget.heads for budget in budgets)) == set(range(HEADS))
    # One step fewer leaves a head out: the rotation is as short as k heads a step allow.
    assert set().union(*(budget.heads for budget in budgets[:-1])) != set(range(HEADS))


def test_a_layer_over_the_budget_for_one_head_measures_one_head_of_fewer_sequences() -> None:
    captured = captured_layer()
    budget = layer_budget(captured, ratio_for(1, captured), 3, method="auto", rank_sums=True)
    assert (budget.heads, budget.sequences, budget.rank_sums) == ((3,), 1, True)
    tiny = layer_budget(captured, 1e-9, 0, method="auto", rank_sums=True)
    assert (len(tiny.heads), tiny.sequences) == (1, 1)


def test_at_4096_tokens_the_budget_is_kept_by_leaving_the_rank_sums_out() -> None:
    """GPT-2 small's shapes (12 heads of 64) at 4096 tokens: one matrix with the blockwise rank sums costs
    more than the standard preset allows a layer, so the rank sums go and the matrices measured fit it."""
    ratio = MonitorOptions().budget.attention_cost_ratio
    q = torch.zeros(SEQUENCES, 12, 4096, 64)
    captured = CapturedAttention("blocks.0.attention", q, q, None, True, 0.125, None, None)
    budget = layer_budget(captured, ratio, 0, method="auto", rank_sums=True)
    allowed = ratio * training_cost(SEQUENCES, 12, 4096, 64)
    assert matrix_cost(4096, 4096, 64, exact=False, blockwise=True, rank_sums=True, eigen_gap=False) > allowed
    assert not budget.rank_sums
    spent = (
        len(budget.heads)
        * budget.sequences
        * matrix_cost(4096, 4096, 64, exact=False, blockwise=True, rank_sums=False, eigen_gap=False)
    )
    assert 0 < spent <= allowed


@pytest.mark.parametrize(("tokens", "keeps_rank_sums"), [(512, True), (1024, False)])
def test_a_tight_budget_samples_heads_before_it_gives_up_the_rank_sums(
    tokens: int, keeps_rank_sums: bool
) -> None:
    """Bidirectional GPT-2-like heads (6 of 64) on the Krylov path, under the standard preset's budget, which
    affords no matrix with the rank sums at either length: at 512 tokens one such matrix costs less than the
    layer's training work, so one is measured with them; at 1024 it costs more, so they go."""
    ratio = MonitorOptions().budget.attention_cost_ratio
    q = torch.zeros(SEQUENCES, 6, tokens, 64)
    captured = CapturedAttention("encoder.0.attention", q, q, None, False, 0.125, None, None)
    with_rank_sums = matrix_cost(
        tokens, tokens, 64, exact=False, blockwise=False, rank_sums=True, eigen_gap=True
    )
    training = training_cost(SEQUENCES, 6, tokens, 64)
    assert with_rank_sums > ratio * training
    assert (with_rank_sums <= LEAST_MEASURED_RATIO * training) == keeps_rank_sums
    budget = layer_budget(captured, ratio, 0, method="auto", rank_sums=True)
    assert budget.rank_sums == keeps_rank_sums
    if keeps_rank_sums:
        assert (len(budget.heads), budget.sequences) == (1, 1)
    else:
        without = matrix_cost(
            tokens, tokens, 64, exact=False, blockwise=False, rank_sums=False, eigen_gap=True
        )
        assert 0 < len(budget.heads) * budget.sequences * without <= ratio * training


def test_the_sampled_heads_metrics_and_their_mean_equal_the_float64_reference_of_those_heads() -> None:
    captured = captured_layer()
    (measured,) = plan(ratio_for(2 * SEQUENCES, captured)).measure(
        [captured], 2**30, diversity=False, draw=False, logs_done=1
    )
    heads = list(measured.budget.heads)
    assert heads == [2, 3]
    probs = captured.sample().probs.double()[:, heads]
    reference = attention_metrics(probs, causal=True, method="exact")
    for name in ("entropy", "sigma1", "spectral_gap", "effective_rank", "rank_one_residual", "sink_mass"):
        assert measured.metrics[name].shape == (SEQUENCES, 2)
        torch.testing.assert_close(measured.metrics[name].double(), reference[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            measured.metrics[name].double().mean(dim=0).mean(), reference[name].mean(), rtol=1e-5, atol=1e-6
        )


def test_without_a_budget_every_head_is_measured_bit_for_bit_as_one_call_on_the_whole_layer() -> None:
    captured = captured_layer()
    (measured,) = plan(math.inf).measure([captured], 2**30, diversity=False, draw=False, logs_done=5)
    assert not measured.budget.sampled
    whole = attention_metrics(captured.sample().probs, causal=True)
    for name, values in whole.items():
        assert torch.equal(measured.metrics[name].nan_to_num(7.0), values.nan_to_num(7.0)), name


def test_the_standard_error_is_that_of_a_mean_drawn_without_replacement() -> None:
    values = torch.tensor([0.2, 0.5, 0.6], dtype=torch.float64)
    spread = math.sqrt(((values - values.mean()) ** 2).sum().item() / 2)
    assert head_sample_standard_error(values, 12) == pytest.approx(spread / math.sqrt(3) * math.sqrt(9 / 11))
    assert head_sample_standard_error(values, 3) == 0  # every head measured: the mean has no sampling error


def test_a_head_without_a_value_is_left_out_and_a_non_finite_one_is_written() -> None:
    """The threshold rank of a head the quadrature resolved in no sequence has no value: the layer's mean
    and spread are over the other heads and the head writes nothing, where a non-finite head writes NaN."""
    nan = float("nan")
    budget = LayerBudget(heads=(0, 1, 2), sequences=2, rank_sums=True, num_heads=3)
    per_head = {"threshold_rank": torch.tensor([nan, 3.0, 5.0], dtype=torch.float64)}
    layer, heads = _layer_measurements(
        7, "l", per_head, {"threshold_rank": torch.tensor([False, True, True])}, budget, False
    )
    assert [(r.metric, r.value) for r in layer] == [("threshold_rank", 4.0)]
    assert [(r.head, r.value) for r in heads] == [(1, 3.0), (2, 5.0)]
    layer, heads = _layer_measurements(
        7, "l", per_head, {"threshold_rank": torch.ones(3, dtype=torch.bool)}, budget, False
    )
    assert math.isnan(layer[0].value) and len(heads) == 3  # NaN from a broken head is the reading


def test_a_monitored_run_writes_the_heads_measured_and_the_means_standard_errors(tmp_path: Path) -> None:
    """A 256-token demo model under a budget of two heads of four: each logging step writes two heads'
    values under their own head numbers, rotating, with the layer means over them and their errors."""
    torch.manual_seed(0)
    model = DemoTransformer(vocab_size=16, d_model=32, n_layers=1, n_heads=4, seq_len=TOKENS, causal=True)
    tokens = torch.randint(16, (2, TOKENS), generator=torch.Generator().manual_seed(0))
    with AttentionCapture(model, max_sequences=2).armed() as recording, torch.no_grad():
        model(tokens)
    ratio = ratio_for(2 * SEQUENCES, recording.captured[0])
    with Monitor(model, tmp_path, every_n_steps=1, families=("attention",), per_head=True, strict=True,
                 attention_cost_ratio=ratio, preflight=False) as monitor:  # fmt: skip
        for step in range(2):
            with monitor.step(step, batch=tokens):
                model(tokens)
    series = scalar_series(read_back(tmp_path))
    layer = recording.captured[0].layer
    assert [value for _, value in series[f"attention/heads_measured/{layer}"]] == [2.0, 2.0]
    for step, heads in ((0, (0, 1)), (1, (2, 3))):
        per_head = {
            head: dict(series[f"attention/entropy/{layer}/head_{head}"]).get(step) for head in range(4)
        }
        assert {head for head, value in per_head.items() if value is not None} == set(heads)
        mean = dict(series[f"attention/entropy/{layer}"])[step]
        assert mean == pytest.approx(sum(per_head[head] for head in heads) / 2, rel=1e-6)
        error = dict(series[f"attention/entropy_head_se/{layer}"])[step]
        values = torch.tensor([per_head[head] for head in heads], dtype=torch.float64)
        assert error == pytest.approx(head_sample_standard_error(values, 4), rel=1e-6)
        assert error > 0


@pytest.mark.parametrize(("ratio", "spectra_kept"), [(1.0, False), (10.0, True), (math.inf, True)])
def test_off_the_exact_path_head_diversity_is_left_out_where_factorising_would_exceed_the_budget(
    ratio: float, spectra_kept: bool
) -> None:
    """Krylov path without the rank sums: 12 matrices of 3 units fit a budget of 39 units at ratio 1, but
    their 12 factorisations, 32 units each, need 384, which ratio 10 (390) allows."""
    captured = captured_layer()
    options = MonitorOptions.from_keywords(
        attention_cost_ratio=ratio, metric_method="krylov", attention_rank_sums=False
    )
    reports = Reports(strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (measured,) = AttentionPlan(options, reports).measure([captured], 2**30, diversity=True, draw=False)
    assert not measured.budget.sampled
    assert (measured.spectra is not None) == spectra_kept
    assert any("left out of head diversity" in str(warning.message) for warning in caught) != spectra_kept
    if spectra_kept:  # every singular value, as float64 factorises them
        reference = torch.linalg.svdvals(captured.sample().probs.double())
        torch.testing.assert_close(measured.spectra, reference, rtol=0, atol=1e-6)

"""The metric catalogue agrees with what the metric functions return, shows the default alert rules' own
thresholds on the metrics reference page, and answers which metric patterns the monitor can write."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spectral_monitor.alerts import default_rules, rules
from spectral_monitor.alerts.rules import AlertThreshold
from spectral_monitor.catalog import (
    CATALOG,
    DIAGNOSES,
    GROUPS,
    close_metric_names,
    diagnosis,
    group_of,
    is_known_metric,
    metric_info,
    metric_names,
    metrics_markdown,
)
from spectral_monitor.metrics import (
    ATTENTION_LOGIT_METRICS,
    ATTENTION_METRICS,
    attention_metrics,
    attention_metrics_from_qk,
    token_metrics,
    weight_metrics,
)
from spectral_monitor.metrics.heads import head_diversity
from spectral_monitor.toolbox.weight_spectra import SPECTRUM_METRICS

ROOT = Path(__file__).resolve().parent.parent


def names_of(family: str) -> set[str]:
    return {info.name for info in CATALOG if info.family == family}


def test_attention_entries_are_the_metric_functions_keys_head_diversity_and_logit_growth() -> None:
    measured = attention_metrics(torch.softmax(torch.randn(2, 8, 8, dtype=torch.float64), dim=-1))
    assert set(ATTENTION_METRICS) <= set(measured)
    from_qk = attention_metrics_from_qk(torch.randn(2, 8, 4), torch.randn(2, 8, 4))
    assert set(ATTENTION_METRICS) | set(ATTENTION_LOGIT_METRICS) <= set(from_qk)
    diversity = head_diversity(torch.rand(3, 3, dtype=torch.float64))
    between_steps = {"max_logit_growth"}
    cost_budget = {"heads_measured"}
    assert names_of("attention") == (
        set(ATTENTION_METRICS) | set(ATTENTION_LOGIT_METRICS) | set(diversity) | between_steps | cost_budget
    )


def test_token_and_weight_entries_are_the_metric_functions_keys() -> None:
    tokens = token_metrics(torch.randn(6, 4, dtype=torch.float64))
    assert names_of("tokens") == set(tokens) - {"nonfinite"}
    weights = weight_metrics(torch.randn(6, 4, dtype=torch.float64), method="exact")
    probe_only = {"spectral_norm_residual", "qk_spectral_norm", "qk_spectral_norm_max"}
    assert names_of("weights") == set(weights) - {"mp_edge", "mp_spikes"} | set(SPECTRUM_METRICS) | probe_only


def test_every_default_rule_condition_reads_a_metric_of_the_catalogue() -> None:
    catalogued = {info.full_name for info in CATALOG}
    for rule in default_rules():
        for condition in rule.conditions:
            assert condition.metric in catalogued, (rule.name, condition.metric)


def test_a_rule_s_threshold_is_what_the_catalogue_its_page_and_the_diagnoses_show(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The rule is the one definition: change its level and every reader follows.
    tightened = dataclasses.replace(
        rules.RANK_COLLAPSE,
        conditions=[
            dataclasses.replace(rules.RANK_COLLAPSE.conditions[0], threshold=0.0375, clear=0.0625),
            rules.RANK_COLLAPSE.conditions[1],
        ],
    )
    monkeypatch.setattr(rules, "RANK_COLLAPSE", tightened)
    info = metric_info("attention", "rank_one_residual")
    assert info.thresholds == (AlertThreshold("rank_collapse", "<=", 0.0375, 0.0625),)
    row = next(line for line in metrics_markdown().splitlines() if line.startswith("| `rank_one_residual`"))
    assert row.endswith("| `rank_collapse`: <= 0.0375 (clears > 0.0625) |")
    _, reads = diagnosis("rank_collapse")
    assert [(i.full_name, t.threshold) for i, t in reads] == [
        ("attention/rank_one_residual", 0.0375),
        ("attention/effective_rank_ratio", 0.01),
    ]


def test_the_diagnoses_are_the_default_rules_with_their_combination() -> None:
    assert [(d.rule, d.combine, d.any_head) for d in DIAGNOSES] == [
        (rule.name, rule.combine, rule.any_head) for rule in default_rules()
    ]
    assert [d.combine for d in DIAGNOSES][:2] == ["any", "all"]
    entry, reads = diagnosis("rank_collapse")
    assert entry.title == "Rank collapse"
    assert [info.full_name for info, _ in reads] == [
        "attention/rank_one_residual",
        "attention/effective_rank_ratio",
    ]


def test_a_diagnosis_of_a_rule_that_is_no_default_says_so_by_name() -> None:
    mine = dataclasses.replace(DIAGNOSES[0], rule="qk_growth", title="QK growth")
    for read in ("combine", "any_head"):
        with pytest.raises(
            ValueError, match=r"rule of the diagnosis 'QK growth' .*rank_collapse.*'qk_growth'"
        ):
            getattr(mine, read)


def test_head_aggregates_keep_the_worst_head_of_every_threshold_on_attention() -> None:
    # A layer-wide rule holds in every head when its worst head holds: _max for <=, _min for >=; a rule on
    # any head holds when the head nearest to it does: _max for >=.
    any_head = {entry.rule for entry in DIAGNOSES if entry.any_head}
    for info in CATALOG:
        for threshold in info.thresholds:
            if (
                info.family == "attention"
                and threshold.op != "nonfinite"
                and threshold.relative_to == "value"
            ):
                worst = (
                    {">=": "max", "<=": "min"} if threshold.rule in any_head else {">=": "min", "<=": "max"}
                )
                assert worst[threshold.op] in info.head_aggregates, info.full_name


def test_the_budget_of_attention_scalars_per_layer_fits_12_heads_in_30_tags() -> None:
    attention = [info for info in CATALOG if info.family == "attention"]
    per_layer = sum(1 + len(info.head_aggregates) for info in attention)
    assert per_layer <= 30
    assert per_layer == len([name for name in metric_names() if name.startswith("attention/")])


def test_lookup_names_aggregates_and_numbered_series() -> None:
    assert metric_info("attention", "entropy_min") is metric_info("attention", "entropy")
    assert metric_info("curvature", "hessian_eigenvalue_12").name == "hessian_eigenvalue_<k>"
    with pytest.raises(KeyError, match="did you mean attention/sigma1"):
        metric_info("attention", "sigma_1")
    with pytest.raises(KeyError):
        metric_info("attention", "sigma2_max")  # sigma2's spread is not written
    assert "attention/entropy_max" in metric_names()
    assert "attention/sigma2_max" not in metric_names()
    assert len(metric_names()) == len(set(metric_names()))


@pytest.mark.parametrize(
    ("pattern", "known"),
    [
        ("attention/entropy", True),
        ("attention/entropy_min", True),
        ("weights/*_norm", True),
        ("tokens/*", True),
        ("curvature/hessian_eigenvalue_3", True),
        ("curvature/hessian_eigenvalue_?", True),
        ("attention/entropy/blocks.0.attn", True),
        ("attention/entropy/*/head_*", True),
        ("attention/entropi", False),
        ("attention/dobrushin_max", False),
        ("weights/qk_norm", False),
        ("toolbox/*", False),
    ],
)
def test_is_known_metric_answers_for_fnmatch_patterns(pattern: str, known: bool) -> None:
    assert is_known_metric(pattern) is known


def test_close_names_suggest_what_was_meant() -> None:
    assert close_metric_names("attention/entropi")[0] == "attention/entropy"
    assert close_metric_names("tokens/cosine")[0] == "tokens/cosine_similarity"
    assert close_metric_names("nothing/like_this") == []


def test_groups_are_the_dashboard_order_and_unknown_metrics_fall_back_to_their_family() -> None:
    assert {info.group for info in CATALOG} == set(GROUPS)
    assert group_of("attention/entropy_max") == "Entropy"
    assert group_of("weights/new_metric") == "Weights"
    assert group_of("attention/new_metric") is None


def test_the_checked_in_metrics_page_is_the_generated_one() -> None:
    page = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    assert page == metrics_markdown(), (
        "run `python -m spectral_monitor.catalog` to regenerate docs/metrics.md"
    )


def test_the_catalogue_imports_neither_torch_nor_lightning() -> None:
    code = (
        "import sys, spectral_monitor.catalog; "
        "print(sorted(m for m in ('torch', 'pytorch_lightning', 'lightning') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT, timeout=60
    )
    assert result.stdout.strip() == "[]"

"""Alert rules on synthetic record streams: patience, hysteresis, resolution, scope, configuration, state.

Each default rule is driven through healthy, borderline ("between" its threshold and its clear level) and
broken readings, so the tests say exactly when an alert fires, stays open and resolves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial

import pytest
from jsonargparse import ArgumentParser

from spectral_monitor import SpectralMonitor
from spectral_monitor.alerts import (
    AlertConfig,
    AlertEngine,
    AlertEvent,
    Condition,
    Rule,
    default_rules,
    open_alerts_markdown,
    rules_from_config,
)
from spectral_monitor.records import Measurement
from spectral_monitor.sinks import diagnosis_layout

pytestmark = pytest.mark.usefixtures("one_thread")

HEADS = 4
LAYER = "blocks.0.attention"
NAN = math.nan


def heads(step: int, family: str, metric: str, value: float, layer: str = LAYER) -> list[Measurement]:
    return [Measurement(step, family, metric, layer, value, head=h) for h in range(HEADS)]


def one(step: int, family: str, metric: str, value: float, layer: str = "model") -> list[Measurement]:
    return [Measurement(step, family, metric, layer, value)]


def attention(entropy: float, eigen_gap: float, residual: float, ratio: float) -> Callable:
    def records(step: int) -> list[Measurement]:
        return [
            *heads(step, "attention", "entropy", entropy),
            *heads(step, "attention", "eigen_gap", eigen_gap),
            *heads(step, "attention", "rank_one_residual", residual),
            *heads(step, "attention", "effective_rank_ratio", ratio),
        ]

    return records


def tokens(cosine: float) -> Callable:
    return lambda step: [*one(step, "tokens", "cosine_similarity", cosine, "blocks.0"),
                         *one(step, "tokens", "token_residual", 0.9, "blocks.0")]  # fmt: skip


def scalar(family: str, metric: str, layer: str = "model") -> Callable[[float], Callable]:
    return lambda value: lambda step: one(step, family, metric, value, layer)


HEALTHY_ATTENTION = attention(0.8, 0.5, 0.6, 0.3)
# rule -> (healthy, between threshold and clear level, broken) record makers
CASES = {
    "rank_collapse": (HEALTHY_ATTENTION, attention(0.8, 0.5, 0.07, 0.3), attention(0.8, 0.5, 0.03, 0.3)),
    "uniform_attention": (HEALTHY_ATTENTION, attention(0.97, 0.97, 0.6, 0.3), attention(1.0, 0.99, 0.6, 0.3)),
    "entropy_collapse": (HEALTHY_ATTENTION, attention(0.08, 0.5, 0.6, 0.3), attention(0.02, 0.5, 0.6, 0.3)),
    "logit_growth": tuple(
        partial(heads, family="attention", metric="max_logit", value=v) for v in (8, 40, 60)
    ),
    "token_collapse": (tokens(0.1), tokens(0.92), tokens(0.97)),
    "edge_of_stability": tuple(scalar("curvature", "sharpness_ratio")(v) for v in (1.0, 1.3, 1.7)),
    "jacobian_explosion": tuple(
        scalar("jacobian", "jacobian_norm", "blocks.0")(v) for v in (1.0, 150.0, 250.0)
    ),
    "weight_runaway": tuple(
        scalar("weights", "spectral_norm", "blocks.0.mlp.0")(v) for v in (1.0, 17.0, 25.0)
    ),
    "non_finite": tuple(scalar("weights", "spectral_norm", "blocks.0.mlp.0")(v) for v in (1.0, 1.0, NAN)),
}
RULES = {rule.name: rule for rule in default_rules()}


def run(engine: AlertEngine, makers: list[Callable], first_step: int | None = None) -> list[tuple[int, str]]:
    """Evaluate one maker per step from ``first_step`` (default: the first step every rule evaluates, at
    least 1); (step, kind) of every event, in order."""
    if first_step is None:
        first_step = first_evaluated(*engine.rules)
    events = []
    for step, make in enumerate(makers, start=first_step):
        events += [(event.step, event.kind) for event in engine.evaluate(step, make(step))]
    return events


def first_evaluated(*rules: Rule) -> int:
    return max(1, *(rule.start_step for rule in rules))


def test_every_default_rule_has_a_case() -> None:
    assert set(CASES) == set(RULES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_rule_fires_on_its_patience_th_broken_evaluation_and_not_before(name: str) -> None:
    rule = RULES[name]
    healthy, _, broken = CASES[name]
    engine = AlertEngine([rule])
    events = run(engine, [healthy] * 3 + [broken] * rule.patience)
    assert events == [(first_evaluated(rule) + 2 + rule.patience, "fired")]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_condition_holding_1000_evaluations_fires_once_and_resolves_once(name: str) -> None:
    rule = RULES[name]
    healthy, between, broken = CASES[name]
    engine = AlertEngine([rule])
    events = run(engine, [healthy] * 2 + [broken] * 1000 + [between] * 5 + [healthy] * 3)
    # The borderline readings keep the alert open (hysteresis); the first healthy one resolves it.
    # non_finite has no borderline: its first finite reading (step 1003) resolves it.
    start = first_evaluated(rule) - 1
    resolved_at = start + (1003 if name == "non_finite" else 1008)
    assert events == [(start + 2 + rule.patience, "fired"), (resolved_at, "resolved")]
    assert engine.fired[name] == 1
    assert engine.open_counts()[name] == 0


@pytest.mark.parametrize("name", sorted(set(CASES) - {"entropy_collapse", "non_finite"}))
def test_a_borderline_reading_never_opens_an_alert(name: str) -> None:
    # entropy_collapse: a fall to the borderline level is itself a sharp drop against the running median;
    # non_finite has no borderline.
    healthy, between, _ = CASES[name]
    assert run(AlertEngine([RULES[name]]), [healthy] + [between] * 50) == []


@pytest.mark.parametrize("name", sorted(name for name, rule in RULES.items() if rule.patience > 1))
def test_broken_readings_that_never_last_patience_evaluations_never_fire(name: str) -> None:
    healthy, _, broken = CASES[name]
    assert run(AlertEngine([RULES[name]]), [healthy, broken] * 50) == []


def test_the_untrained_model_at_step_0_does_not_count_towards_patience() -> None:
    engine = AlertEngine([RULES["uniform_attention"]])
    broken = CASES["uniform_attention"][2]
    assert run(engine, [broken] * 3, first_step=0) == [(2, "fired")]


def test_the_sharpness_of_adams_first_steps_does_not_count_towards_patience() -> None:
    # Measured every step on a healthy tiny demo run with AdamW: ratio 1.5-4.1 on steps 1-4, then ~0.1.
    engine = AlertEngine([RULES["edge_of_stability"]])
    ratio = scalar("curvature", "sharpness_ratio")
    assert run(engine, [ratio(v) for v in (1.51, 4.12, 4.04, 3.79, 0.10, 0.11)], first_step=1) == []
    assert run(engine, [ratio(2.4)] * 4, first_step=9) == [(12, "fired")]  # step 9 does not count


def test_collapse_is_a_layer_finding_a_single_rank_one_head_is_shown_not_alarmed() -> None:
    engine = AlertEngine([RULES["rank_collapse"]])
    for step in range(1, 10):
        records = HEALTHY_ATTENTION(step)
        records[2 * HEADS] = dataclasses.replace(records[2 * HEADS], value=0.01)  # head 0 is rank one
        assert engine.evaluate(step, records) == []


def test_non_finite_fires_on_the_first_evaluation_with_one_broken_head() -> None:
    engine = AlertEngine([RULES["non_finite"]])
    records = heads(1, "attention", "entropy", 0.5)
    records[3] = dataclasses.replace(records[3], value=NAN)
    (event,) = engine.evaluate(1, records)
    assert (event.kind, event.severity, event.layer, event.heads) == ("fired", "critical", LAYER, "1/4")


def test_causal_layers_never_raise_uniform_attention() -> None:
    # Causal attention has no eigen_gap; uniform causal attention is the healthy demo's first 100 steps.
    engine = AlertEngine([RULES["uniform_attention"]])
    for step in range(1, 20):
        assert engine.evaluate(step, heads(step, "attention", "entropy", 1.0)) == []


def test_without_per_head_records_the_worst_head_aggregates_decide() -> None:
    engine = AlertEngine([RULES["uniform_attention"]])

    def layer(step: int, entropy_min: float) -> list[Measurement]:
        return [
            *one(step, "attention", "entropy", 1.0, LAYER),
            *one(step, "attention", "entropy_min", entropy_min, LAYER),
            *one(step, "attention", "eigen_gap", 0.99, LAYER),
            *one(step, "attention", "eigen_gap_min", 0.99, LAYER),
        ]

    assert run(engine, [lambda step: layer(step, 0.9)] * 5) == []  # one head is not uniform
    assert run(engine, [lambda step: layer(step, 0.99)] * 2, first_step=6) == [(7, "fired")]


def test_rules_ignore_families_that_were_not_measured() -> None:
    engine = AlertEngine(default_rules())
    for step in range(1, 10):
        assert engine.evaluate(step, tokens(0.1)(step)) == []
    assert engine.counter_records(9)[0].tag == "alerts/open/rank_collapse"


def uniform_attention_fired_with(layer_records: dict[str, float]) -> tuple[AlertEngine, AlertEvent]:
    """The uniform-attention alert fired at step 2 on LAYER's broken heads, with ``layer_records`` (metric ->
    value) of the layer beside them at each step."""
    engine = AlertEngine([RULES["uniform_attention"]])
    broken = CASES["uniform_attention"][2]

    def records(step: int) -> list[Measurement]:
        extra = [
            record
            for metric, value in layer_records.items()
            for record in one(step, "attention", metric, value, LAYER)
        ]
        return [*broken(step), *extra]

    engine.evaluate(1, records(1))
    (event,) = engine.evaluate(2, records(2))
    return engine, event


def test_the_message_says_where_what_against_what_and_the_remedy_with_the_current_n() -> None:
    engine, event = uniform_attention_fired_with({"effective_rank": 2.0, "effective_rank_ratio": 2.0 / 512})
    assert event.message() == (
        "SpectralMonitor warning uniform_attention at blocks.0.attention (4/4 heads), step 2: "
        "attention/entropy 1.000 >= 0.980 and attention/eigen_gap 0.990 >= 0.950 since step 1. "
        "Try: scale the attention logits by γ·log n "
        "(n=512, log n=6.24; logit_scaling='log_n' in the demo), or initialise W_Q and W_K larger: rows this "
        "flat over n keys give every query the same average"
    )
    table = open_alerts_markdown(engine.open_alerts, 2)
    assert "| uniform_attention | warning | blocks.0.attention (4/4 heads) | 1 | 2 |" in table


def test_a_layer_measured_on_some_heads_says_so_and_takes_n_from_its_keys() -> None:
    """Under a cost budget the effective rank (whence n came) may be left out and some heads unmeasured: the
    attention family's judged-only ``keys`` and ``heads`` records give n and the layer's head count."""
    _, event = uniform_attention_fired_with({"keys": 512, "heads": 12})
    assert event.where == "blocks.0.attention (4/4 measured of 12 heads)"
    assert "(n=512, log n=6.24; " in event.message()


def test_a_users_remedy_keeps_its_own_braces_and_fills_only_n_and_log_n() -> None:
    remedy = "set {config.scale} to 1/sqrt({n}) or {log_n}; a dict {'a': 1} and a stray { stay"
    rule = dataclasses.replace(RULES["uniform_attention"], remedy=remedy)
    broken = CASES["uniform_attention"][2]

    def with_length(step: int) -> list[Measurement]:
        return [*broken(step), *one(step, "attention", "effective_rank", 2.0, LAYER),
                *one(step, "attention", "effective_rank_ratio", 2.0 / 512, LAYER)]  # fmt: skip

    for records, filled in ((with_length, "1/sqrt(512) or 6.24"), (broken, "1/sqrt(n) or log n")):
        engine = AlertEngine([rule])
        engine.evaluate(1, records(1))
        (event,) = engine.evaluate(2, records(2))
        assert event.message().endswith(
            f"Try: set {{config.scale}} to {filled}; a dict {{'a': 1}} and a stray {{ stay"
        )


def test_the_message_names_the_condition_that_held_not_the_rules_first() -> None:
    engine = AlertEngine([RULES["rank_collapse"]])
    # The rank-one residual (the first condition) stays healthy; effective rank / n (the second) collapses.
    only_rank = attention(0.8, 0.5, 0.6, 0.004)
    engine.evaluate(1, only_rank(1))
    (fired,) = engine.evaluate(2, only_rank(2))
    assert (fired.metric, fired.value, fired.level) == ("attention/effective_rank_ratio", 0.004, 0.01)
    assert fired.also == ()
    assert "step 2: attention/effective_rank_ratio 0.004 <= 0.010 since step 1." in fired.message()
    assert "rank_one_residual" not in fired.message()
    # Its resolution speaks of the same condition, against its clear level.
    (resolved,) = engine.evaluate(3, HEALTHY_ATTENTION(3))
    assert resolved.comparison == "attention/effective_rank_ratio 0.300 > 0.020"


def test_when_several_conditions_hold_the_message_names_each_with_its_value_and_threshold() -> None:
    engine = AlertEngine([RULES["rank_collapse"]])
    both = attention(0.8, 0.5, 0.03, 0.004)
    engine.evaluate(1, both(1))
    (fired,) = engine.evaluate(2, both(2))
    assert fired.comparison == (
        "attention/rank_one_residual 0.030 <= 0.050 and attention/effective_rank_ratio 0.004 <= 0.010"
    )
    restored = AlertEngine([RULES["rank_collapse"]])
    restored.load_state_dict(engine.state_dict())
    assert restored.history == [fired]


def test_a_step_that_reads_another_family_does_not_resolve_an_alert_it_cannot_see() -> None:
    # non_finite reads tokens and Jacobians of the same block; the Jacobian probe runs on its own steps.
    engine = AlertEngine([RULES["non_finite"]])
    nan_tokens = one(1, "tokens", "token_residual", NAN, "blocks.0")
    assert [event.kind for event in engine.evaluate(1, nan_tokens)] == ["fired"]
    assert engine.evaluate(2, one(2, "jacobian", "jacobian_norm", 1.5, "blocks.0")) == []
    assert engine.open_counts()["non_finite"] == 1
    (resolved,) = engine.evaluate(3, one(3, "tokens", "token_residual", 0.9, "blocks.0"))
    assert resolved.comparison == "tokens/token_residual = 0.9"


def test_a_depth_condition_compares_each_layer_with_the_first_layer_of_the_same_step() -> None:
    rule = Rule("depth", [Condition("tokens/cosine_similarity", ">=", 0.5, clear=0.4, relative_to="depth")])

    def stream(*cosines: float) -> Callable:
        return lambda step: [
            Measurement(step, "tokens", "cosine_similarity", f"blocks.{i}", c) for i, c in enumerate(cosines)
        ]

    engine = AlertEngine([rule])
    # High but level across depth: no trend. Then the last block pulls 0.6 above the first.
    assert run(engine, [stream(0.7, 0.75, 0.8)] * 3) == []
    (fired,) = engine.evaluate(4, stream(0.1, 0.3, 0.7)(4))
    assert (fired.layer, fired.value) == ("blocks.2", pytest.approx(0.6))
    assert fired.comparison == "tokens/cosine_similarity − first layer 0.600 >= 0.500"
    assert "− its value at the first layer >= 0.5" in rule.describe()
    assert engine.evaluate(5, stream(0.1, 0.3, 0.55)(5)) == []  # 0.45: above the clear level, still open
    assert [e.kind for e in engine.evaluate(6, stream(0.1, 0.3, 0.45)(6))] == ["resolved"]


def test_relative_conditions_compare_with_the_first_value_of_each_layer() -> None:
    engine = AlertEngine([RULES["weight_runaway"]])
    make = scalar("weights", "spectral_norm", "w")
    # 30 is far above 20 in absolute terms but only 1.5x its own first value.
    assert run(engine, [make(30.0)] + [make(45.0)] * 5) == []
    assert run(engine, [make(700.0)] * 2, first_step=7) == [(8, "fired")]


def test_state_dict_carries_open_alerts_baselines_and_history_to_a_new_engine() -> None:
    rule = RULES["weight_runaway"]
    healthy, _, broken = CASES["weight_runaway"]
    engine = AlertEngine([rule])
    run(engine, [healthy] + [broken] * 3)
    resumed = AlertEngine([rule])
    resumed.load_state_dict(engine.state_dict())
    assert [event.kind for event in resumed.history] == ["fired"]
    assert run(resumed, [broken] * 3, first_step=5) == []  # still open, not fired again
    assert run(resumed, [healthy], first_step=8) == [(8, "resolved")]  # baseline 1.0 came along


def test_users_tune_disable_and_add_rules_in_code() -> None:
    mine = Rule("qk_growth", [Condition("weights/qk_spectral_norm", ">=", 5.0, relative_to="first")])
    config = AlertConfig(
        disable=["token_*"], tune={"rank_collapse": {"patience": 4, "attention/rank_one_residual": 0.1}},
        rules=[mine],
    )  # fmt: skip
    rules = {rule.name: rule for rule in rules_from_config(config)}
    assert "token_collapse" not in rules and rules["qk_growth"] is mine
    tuned = rules["rank_collapse"]
    assert tuned.patience == 4
    assert (tuned.conditions[0].threshold, tuned.conditions[0].clear) == (0.1, pytest.approx(0.15))
    assert [rule.name for rule in rules_from_config(AlertConfig(defaults=False, rules=[mine]))] == [
        "qk_growth"
    ]


def test_a_rule_reading_one_metric_twice_tunes_each_condition_by_its_reference() -> None:
    tune = {
        "entropy_collapse": {"attention/entropy@median": 0.2},
        "token_collapse": {"tokens/cosine_similarity": 0.97, "tokens/cosine_similarity@depth": 0.6},
    }
    rules = {rule.name: rule for rule in rules_from_config(AlertConfig(tune=tune))}
    absolute, against_median = rules["entropy_collapse"].conditions
    assert (absolute.threshold, absolute.clear) == (0.05, 0.1)
    assert (against_median.relative_to, against_median.threshold) == ("median", 0.2)
    assert against_median.clear == pytest.approx(0.4)
    cosine, _, depth = rules["token_collapse"].conditions
    assert (cosine.relative_to, cosine.threshold, cosine.clear) == ("value", 0.97, pytest.approx(0.92))
    assert (depth.relative_to, depth.threshold, depth.clear) == ("depth", 0.6, pytest.approx(0.5))


def test_lightning_cli_builds_the_alert_configuration_from_yaml() -> None:
    parser = ArgumentParser()
    parser.add_class_arguments(SpectralMonitor, "monitor")
    config = parser.parse_string(
        """
monitor:
  options:
    stop_on: [rank_collapse]
    alerts:
      disable: [token_collapse]
      tune:
        uniform_attention: {patience: 3}
      rules:
        - name: qk_growth
          conditions:
            - {metric: weights/qk_spectral_norm, op: ">=", threshold: 5.0, relative_to: first}
          patience: 2
"""
    )
    monitor = parser.instantiate(config).monitor
    rules = {rule.name: rule for rule in monitor._alerting.engine.rules}
    assert "token_collapse" not in rules
    assert rules["uniform_attention"].patience == 3
    assert rules["qk_growth"].conditions == [
        Condition("weights/qk_spectral_norm", ">=", 5.0, relative_to="first")
    ]
    assert monitor._alerting.stop_on == ("rank_collapse",)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Condition("entropy", ">="), "family/metric"),
        (lambda: Condition("attention/entropy", ">", 1.0), "op of attention/entropy"),
        (lambda: Condition("attention/entropy", ">=", 0.9, clear=0.95), "healthy side"),
        (lambda: Rule("r", [Condition("a/b")], patience=0), "patience of rule r"),
        (
            lambda: Rule("r", [Condition("a/b")], head_fraction=1.5),
            r"head_fraction of rule r must be in \(0, 1\]",
        ),
        (lambda: rules_from_config(AlertConfig(disable=["nope"])), "'nope' matches no rule"),
        (lambda: rules_from_config(AlertConfig(tune={"rank_collapse": {"bogus": 1}})), "key 'bogus'"),
        (
            lambda: rules_from_config(AlertConfig(tune={"entropy_collapse": {"attention/entropy@depth": 1}})),
            r"key 'attention/entropy@depth' is neither .* 'attention/entropy@median'",
        ),
        (
            lambda: AlertConfig(tune={"entropy_collapse": {"attention/entropy@mean": 1}}),
            "what follows '@' must be one of",
        ),
        (lambda: SpectralMonitor(stop_on=["rank_colapse"]), r"stop_on names rules \['rank_colapse'\]"),
        (lambda: SpectralMonitor(on_alert=3), "on_alert must be None or a callable"),
    ],
)
def test_bad_alert_arguments_are_refused_with_a_message_naming_them(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_the_dashboard_groups_charts_by_diagnosis_with_the_sharpness_margin() -> None:
    tags = [
        "attention/rank_one_residual/b0",
        "attention/entropy/b0",
        "attention/entropy/b0/head_1",
        "tokens/cosine_similarity/blocks.0",
        "jacobian/jacobian_norm/blocks.0",
        "curvature/sharpness/model",
        "curvature/sharpness_threshold/model",
        "weights/spectral_norm/w",
        "weights/qk_spectral_norm_max/w",
        "alerts/open/rank_collapse",
        "ntk/ntk_trace/model",
        "toolbox/something/model",
    ]
    layout = diagnosis_layout(tags)
    assert {category: set(charts) for category, charts in layout.items()} == {
        "Rank collapse": {"attention/rank_one_residual"},
        "Entropy": {"attention/entropy", "weights/qk_spectral_norm_max"},
        "Token collapse": {"tokens/cosine_similarity"},
        "Signal propagation": {"jacobian/jacobian_norm"},
        "Curvature": {"curvature/sharpness", "curvature/sharpness_threshold", "ntk/ntk_trace",
                      "sharpness vs its edge of stability"},
        "Weights": {"weights/spectral_norm"},
        "Alerts": {"alerts/open"},
        "toolbox": {"toolbox/something"},
    }  # fmt: skip
    assert layout["Curvature"]["sharpness vs its edge of stability"] == (
        "Margin",
        ("curvature/sharpness/model", "curvature/sharpness/model", "curvature/sharpness_threshold/model"),
    )
    assert "sharpness vs its edge of stability" not in diagnosis_layout(tags[:6])["Curvature"]


def test_the_layout_shows_first_the_charts_the_diagnoses_read_in_diagnosis_order() -> None:
    metrics = ("dobrushin", "entropy", "effective_rank_ratio_max", "eigen_gap_min", "rank_one_residual")
    tags = [f"attention/{metric}/blocks.0.attention" for metric in metrics]
    charts = list(diagnosis_layout(tags)["Rank collapse"])
    assert charts == ["attention/rank_one_residual", "attention/effective_rank_ratio_max",
                      "attention/eigen_gap_min", "attention/dobrushin"]  # fmt: skip


def test_values_flagged_not_converged_never_reach_a_rule() -> None:
    # The edge-of-stability rule, patience 1: a ratio of 3 fires it only where the solve converged.
    rule = Rule("edge", [Condition("curvature/sharpness_ratio", ">=", 1.5, clear=1.2)], patience=1)

    def events(converged: float) -> list:
        engine = AlertEngine([rule])
        records = [
            Measurement(7, "curvature", "sharpness_ratio", "model", 3.0),
            Measurement(7, "curvature", "converged", "model", converged),
            Measurement(7, "curvature", "converged", "mlp", 1.0),
        ]
        return [(event.step, event.kind) for event in engine.evaluate(7, records)]

    assert events(converged=1.0) == [(7, "fired")]
    assert events(converged=0.0) == []

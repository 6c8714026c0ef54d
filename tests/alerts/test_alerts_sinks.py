"""Attention sinks and the rank-collapse rule: a head whose every query sends most of its mass to one key is
rank one by design, not collapsed, and is left out of the layer's judgement; uniform attention still fires.

The records are those the monitor writes for real attention matrices: the metrics come from
:func:`spectral_monitor.metrics.attention_metrics` on closed-form matrices, one record per head.
"""

from __future__ import annotations

import pytest
import torch

from spectral_monitor.alerts import (
    AlertConfig,
    AlertEngine,
    Condition,
    Rule,
    default_rules,
    rules_from_config,
)
from spectral_monitor.alerts.rules import SINK_MASS
from spectral_monitor.metrics import attention_metrics
from spectral_monitor.records import Measurement

N = 64
LAYER = "blocks.0.attention"
RANK_COLLAPSE = next(rule for rule in default_rules() if rule.name == "rank_collapse")


def sink_head(mass: float, causal: bool = False) -> torch.Tensor:
    """Every query puts ``mass`` on key 0 and spreads the rest evenly over the other keys it may attend (a
    causal first query, with key 0 alone, puts all of it there)."""
    attendable = torch.ones(N, N, dtype=torch.bool)
    if causal:
        attendable = attendable.tril()
    others = attendable.clone()
    others[:, 0] = False
    count = others.sum(1, keepdim=True)
    attn = torch.where(others, (1 - mass) / count.clamp(min=1), 0.0).double()
    attn[:, 0] = torch.where(count[:, 0] > 0, mass, 1.0)
    return attn


def uniform_head() -> torch.Tensor:
    return torch.full((N, N), 1.0 / N, dtype=torch.float64)


def records_of(step: int, heads: list[torch.Tensor], causal: bool = False) -> list[Measurement]:
    """The per-head records the monitor writes for a layer whose heads are ``heads``."""
    metrics = attention_metrics(torch.stack(heads), causal=causal, method="exact")
    return [
        Measurement(step, "attention", name, LAYER, float(metrics[name][head]), head=head)
        for name in ("rank_one_residual", "effective_rank_ratio", "sink_mass", "entropy")
        for head in range(len(heads))
    ]


def fired_steps(rule: Rule, heads: list[torch.Tensor], causal: bool = False, steps: int = 4) -> list[int]:
    engine = AlertEngine([rule])
    return [
        event.step
        for step in range(1, steps + 1)
        for event in engine.evaluate(step, records_of(step, heads, causal))
        if event.kind == "fired"
    ]


def test_a_sink_head_is_rank_one_with_its_mass_on_key_zero() -> None:
    metrics = attention_metrics(sink_head(0.9)[None], method="exact")
    assert float(metrics["rank_one_residual"][0]) < 1e-12  # exactly 1āᵀ
    assert float(metrics["sink_mass"][0]) == pytest.approx(0.9)
    assert float(metrics["sink_mass_first"][0]) == pytest.approx(0.9)


@pytest.mark.parametrize("causal", [False, True])
def test_a_layer_of_healthy_sink_heads_raises_no_rank_collapse(causal: bool) -> None:
    heads = [sink_head(mass, causal) for mass in (0.96, 0.97, 0.98, 0.99)]
    metrics = attention_metrics(torch.stack(heads), causal=causal, method="exact")
    assert float(metrics["rank_one_residual"].max()) <= 0.05  # every head meets the collapse condition
    # The same rule without the sink exemption fires: the sink heads alone would raise it.
    without = Rule(**{**RANK_COLLAPSE.__dict__, "exempt": []})
    assert fired_steps(without, heads, causal) == [2]
    assert fired_steps(RANK_COLLAPSE, heads, causal) == []


def test_uniform_bidirectional_attention_still_fires() -> None:
    sink_mass = attention_metrics(uniform_head()[None], method="exact")["sink_mass"]
    assert float(sink_mass[0]) == pytest.approx(1 / N)
    assert fired_steps(RANK_COLLAPSE, [uniform_head()] * 4) == [2]


def test_a_sink_head_beside_collapsed_heads_does_not_hide_the_collapse() -> None:
    engine = AlertEngine([RANK_COLLAPSE])
    events = [
        event
        for step in (1, 2)
        for event in engine.evaluate(step, records_of(step, [uniform_head()] * 3 + [sink_head(0.9)]))
    ]
    assert [(event.step, event.heads) for event in events] == [(2, "3/3")]


def test_a_rank_one_head_spread_over_several_keys_is_no_sink_and_counts() -> None:
    spread = torch.zeros(N, N, dtype=torch.float64)
    spread[:, :4] = 0.25  # every query on the same 4 keys: rank one, largest column mean 0.25
    assert fired_steps(RANK_COLLAPSE, [spread] * 4) == [2]


def test_a_sink_mass_just_below_the_level_is_judged() -> None:
    assert fired_steps(RANK_COLLAPSE, [sink_head(SINK_MASS - 0.01)] * 4) == [2]


def test_the_sink_level_is_tuned_like_a_threshold_and_exempt_is_validated() -> None:
    (tuned,) = rules_from_config(
        AlertConfig(defaults=True, tune={"rank_collapse": {"attention/sink_mass": 0.95}}, disable=["[!r]*"])
    )
    assert tuned.exempt == [Condition("attention/sink_mass", ">=", 0.95)]
    assert fired_steps(tuned, [sink_head(0.9)] * 4) == [2]
    assert "attention/sink_mass >= 0.95" in tuned.describe()
    with pytest.raises(ValueError, match="exempt of rule r"):
        Rule("r", [Condition("a/b")], exempt=[Condition("a/c", relative_to="first")])
    with pytest.raises(ValueError, match="exempt of rule r"):
        Rule("r", [Condition("a/b")], exempt=Condition("a/c"))  # type: ignore[arg-type]


def test_an_alert_line_starts_on_a_line_of_its_own_under_a_progress_bar() -> None:
    """Lightning's tqdm bar redraws its line in place; a console line written straight after it runs on from
    the bar's text (as a plain StreamHandler's does), where the monitor's starts at the line's beginning."""
    import io
    import logging

    import tqdm

    from spectral_monitor.core.alerting import ConsoleHandler

    record = logging.LogRecord("spectral_monitor.alerts", logging.WARNING, "", 0, "an alert", None, None)

    def before_the_line(handler_type: type[logging.StreamHandler], bar_showing: bool) -> str:
        console = io.StringIO()
        bar = tqdm.tqdm(total=10, file=console, ascii=True) if bar_showing else None
        handler_type(console).emit(record)
        if bar is not None:
            bar.close()
        written = console.getvalue()
        return written[: written.index("an alert\n")]

    assert before_the_line(ConsoleHandler, bar_showing=True)[-1] in "\r\n"
    assert before_the_line(ConsoleHandler, bar_showing=False) == ""
    assert before_the_line(logging.StreamHandler, bar_showing=True).endswith("?it/s]")  # what it fixes

"""Alert rules: what to watch, in which units, for how long, and what to do about it.

A rule is plain data (dataclasses of plain types), so LightningCLI builds it from YAML as well as code.
It reads ``Measurement`` records by ``family/metric`` and knows nothing of how they were computed or where
alerts go; :class:`~spectral_monitor.alerts.engine.AlertEngine` evaluates rules on each logging step.

Thresholds are in the normalised units of the metrics (entropy / log n, effective rank / n, ...)
so a default holds at any sequence length. The defaults and the runs that calibrated them are listed in
:func:`default_rules`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spectral_monitor.validation import (
    check_bool,
    check_choice,
    check_int,
    check_mapping,
    check_metric_pattern,
    check_names,
    check_number,
)

__all__ = [
    "COMPARISONS",
    "RELATIVE_TO",
    "SCOPES",
    "SEVERITIES",
    "AlertConfig",
    "AlertThreshold",
    "Condition",
    "Rule",
    "default_rules",
    "default_thresholds",
    "rules_from_config",
]

COMPARISONS = (">=", "<=", "nonfinite")
"""``>=``/``<=`` compare with ``threshold``; ``nonfinite`` holds when the value is NaN or infinite."""
RELATIVE_TO = ("value", "first", "median", "depth")
"""What a condition compares: the value itself, the value over the first value seen for the same layer
(and head), the value over the running median of that layer's (and head's) previous values, or (``depth``)
the value minus the same metric's value at the first layer that reports it in the same evaluation (the
monitor writes blocks in forward order), a difference across depth; ``depth`` reads layer records only."""
SCOPES = ("layer", "head")
"""``layer``: one alert per layer, when at least ``head_fraction`` of its heads meet the condition (records
without heads count as one head). ``head``: one alert per head (per layer when the metric has no heads)."""
SEVERITIES = ("info", "warning", "critical")
ANY_HEAD_FRACTION = 0.01
"""A ``head_fraction`` at or below this asks for any one head (of up to 100)."""
MEDIAN_WINDOW = 8
"""Evaluations in the running median of ``relative_to="median"`` (older values are dropped)."""


@dataclass(frozen=True)
class Condition:
    """One test on one metric: ``value <op> threshold``, cleared past ``clear``.

    Args:
        metric: ``family/metric`` of the records read, an ``fnmatch`` pattern (``weights/*_norm``).
        op: one of :data:`COMPARISONS`.
        threshold: the level at which the condition starts to hold (unused by ``nonfinite``).
        clear: the level the value must get back past for an open alert to close (hysteresis); on the
            healthy side of ``threshold`` or equal to it. ``None``: ``threshold``.
        relative_to: one of :data:`RELATIVE_TO`; ``first`` and ``median`` make ``threshold`` a ratio,
            ``depth`` a difference.
        required: if False, a layer that does not report ``metric`` skips this condition instead of
            not being evaluated (``eigen_gap`` is written for bidirectional attention only).
    """

    metric: str
    op: str = ">="
    threshold: float = 0.0
    clear: float | None = None
    relative_to: str = "value"
    required: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or self.metric.count("/") < 1 or not all(self.metric.split("/")):
            raise ValueError(f"metric must be 'family/metric' (an fnmatch pattern), got {self.metric!r}")
        check_choice(f"op of {self.metric}", self.op, COMPARISONS)
        check_choice(f"relative_to of {self.metric}", self.relative_to, RELATIVE_TO)
        check_number(f"threshold of {self.metric}", self.threshold)
        check_bool(f"required of {self.metric}", self.required)
        if self.clear is not None:
            check_number(f"clear of {self.metric} (None or a number)", self.clear)
            if (self.op == ">=" and self.clear > self.threshold) or (
                self.op == "<=" and self.clear < self.threshold
            ):
                raise ValueError(
                    f"clear of {self.metric} ({self.clear}) must be on the healthy side of its threshold "
                    f"({self.op} {self.threshold}): {'<=' if self.op == '>=' else '>='} {self.threshold}"
                )

    @property
    def clear_level(self) -> float:
        return self.threshold if self.clear is None else self.clear

    def matches(self, family_metric: str) -> bool:
        return _name_matches(family_metric, self.metric)

    def holds(self, value: float, *, clearing: bool = False) -> bool:
        """Whether ``value`` (already relative, if the condition is) meets the condition; ``clearing``:
        against the clear level, the test an open alert keeps passing until it closes."""
        if self.op == "nonfinite":
            return not math.isfinite(value)
        level = self.clear_level if clearing else self.threshold
        return value >= level if self.op == ">=" else value <= level

    def describe(self) -> str:
        if self.op == "nonfinite":
            return f"{self.metric} is NaN or inf"
        if self.relative_to == "depth":
            return f"{self.metric} − its value at the first layer {self.op} {self.threshold:g}"
        unit = {"value": "", "first": " × its first value", "median": " × its running median"}[
            self.relative_to
        ]
        return f"{self.metric} {self.op} {self.threshold:g}{unit}"


@dataclass(frozen=True)
class Rule:
    """A named alert over metric streams.

    Args:
        name: the rule's name (``alerts/open/<name>`` in TensorBoard, ``stop_on`` entries).
        conditions: what it tests, combined by ``combine``.
        combine: ``any`` (one condition suffices) or ``all``.
        scope: one of :data:`SCOPES`.
        head_fraction: with ``scope="layer"``, the fraction of a layer's heads that must meet the conditions
            (1.0: every head). Per-head records are used when written; without them (``per_head=False``)
            a layer-wide condition is tested on the ``<metric>_max`` (``<=``) or ``<metric>_min`` (``>=``)
            aggregate, which is exact for ``head_fraction=1`` and a single condition.
        patience: consecutive evaluations a condition must hold before the alert fires.
        start_step: evaluations at earlier steps are ignored (the untrained model at step 0 can look
            collapsed without being broken).
        severity: one of :data:`SEVERITIES`.
        remedy: what to try, shown with the alert; ``{n}`` is replaced by the layer's attention length
            (effective_rank / effective_rank_ratio) when the records give it.
        layers: ``fnmatch`` patterns of the layers the rule applies to; ``None``: all.
        read_heads: read per-head records where they exist; False: the layer's own records only (a whole
            weight's norm rather than its heads' rows).
        exempt: conditions (on the values themselves, ``relative_to="value"``) that leave a head out of the
            judgement: a head meeting any of them neither meets the rule nor counts among the heads
            evaluated, and a layer whose every head is exempt is not judged (an open alert stays open).
            ``rank_collapse`` leaves out attention-sink heads this way.
    """

    name: str
    conditions: list[Condition]
    combine: str = "any"
    scope: str = "layer"
    head_fraction: float = 1.0
    patience: int = 1
    start_step: int = 0
    severity: str = "warning"
    remedy: str = ""
    layers: list[str] | None = None
    read_heads: bool = True
    exempt: list[Condition] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"name must be a non-empty string without '/', got {self.name!r}")
        conditions = self.conditions
        if isinstance(conditions, Condition) or not isinstance(conditions, Sequence) or not conditions:
            raise ValueError(f"conditions of rule {self.name} must be a non-empty list, got {conditions!r}")
        converted = [Condition(**c) if isinstance(c, dict) else c for c in conditions]
        if not all(isinstance(c, Condition) for c in converted):
            raise ValueError(f"conditions of rule {self.name} must be Condition objects, got {conditions!r}")
        object.__setattr__(self, "conditions", converted)
        if not any(c.required for c in converted):
            raise ValueError(f"rule {self.name} needs at least one condition with required=True")
        check_choice(f"combine of rule {self.name}", self.combine, ("any", "all"))
        check_choice(f"scope of rule {self.name}", self.scope, SCOPES)
        if not _is_number(self.head_fraction) or not 0 < self.head_fraction <= 1:
            raise ValueError(
                f"head_fraction of rule {self.name} must be in (0, 1], got {self.head_fraction!r}"
            )
        check_int(f"patience of rule {self.name}", self.patience, smallest=1)
        check_int(f"start_step of rule {self.name}", self.start_step, smallest=0)
        check_choice(f"severity of rule {self.name}", self.severity, SEVERITIES)
        if not isinstance(self.remedy, str):
            raise ValueError(f"remedy of rule {self.name} must be a string, got {self.remedy!r}")
        check_bool(f"read_heads of rule {self.name}", self.read_heads)
        if self.layers is not None:
            check_names(f"layers of rule {self.name}", self.layers, what="layer patterns (or None)")
        exempt = self.exempt
        if isinstance(exempt, (Condition, Mapping)) or not isinstance(exempt, Sequence):
            raise ValueError(f"exempt of rule {self.name} must be a list of conditions, got {exempt!r}")
        exempt = [Condition(**c) if isinstance(c, dict) else c for c in exempt]
        for condition in exempt:
            plain = isinstance(condition, Condition) and condition.relative_to == "value"
            if not plain or condition.op == "nonfinite":
                raise ValueError(
                    f"exempt of rule {self.name} must hold conditions comparing a value with a threshold "
                    f"(op '>=' or '<=', relative_to 'value'), got {condition!r}"
                )
        object.__setattr__(self, "exempt", exempt)

    @property
    def any_head(self) -> bool:
        """Whether one head of a layer suffices (``head_fraction`` <= :data:`ANY_HEAD_FRACTION`)."""
        return self.head_fraction <= ANY_HEAD_FRACTION

    @property
    def families(self) -> set[str]:
        return {condition.metric.split("/", 1)[0] for condition in self.conditions}

    def applies_to(self, layer: str) -> bool:
        return self.layers is None or any(_name_matches(layer, pattern) for pattern in self.layers)

    def describe(self) -> str:
        joined = f" {'or' if self.combine == 'any' else 'and'} ".join(c.describe() for c in self.conditions)
        if self.scope == "head":
            where = "per head"
        else:
            where = _heads_phrase(self.head_fraction) if self.read_heads else "per layer"
        if self.exempt:
            where += "; heads with " + " or ".join(c.describe() for c in self.exempt) + " left out"
        return f"{joined} ({where}; {self.patience} evaluation{'s' if self.patience > 1 else ''} in a row)"

    def tuned(self, changes: dict[str, Any]) -> Rule:
        """A copy with ``changes``: fields of this class, or ``family/metric`` of a condition (or of an
        ``exempt`` condition) -> its new threshold (its clear level moves with it, keeping its distance)."""
        fields = {f.name for f in dataclasses.fields(self)} - {"name", "conditions", "exempt"}
        conditions, exempt = list(self.conditions), list(self.exempt)
        plain = {}
        for key, value in changes.items():
            if key in fields:
                plain[key] = value
                continue
            matching = (
                (group, i) for group in (conditions, exempt) for i, c in enumerate(group) if c.metric == key
            )
            found = next(matching, None)
            if found is None:
                raise ValueError(
                    f"alerts.tune[{self.name!r}] key {key!r} is neither a rule field ({sorted(fields)}) nor "
                    f"a condition metric of the rule ({[c.metric for c in conditions + exempt]})"
                )
            if not _is_number(value):
                raise ValueError(f"alerts.tune[{self.name!r}][{key!r}] must be a number, got {value!r}")
            group, index = found
            old = group[index]
            clear = None if old.clear is None else old.clear + (value - old.threshold)
            group[index] = dataclasses.replace(old, threshold=float(value), clear=clear)
        return dataclasses.replace(self, conditions=conditions, exempt=exempt, **plain)


@dataclass
class AlertConfig:
    """Which rules run: the defaults, tuned, some disabled, plus the user's own (the ``alerts`` argument
    of ``SpectralMonitor``). In YAML::

        alerts:
          disable: [token_collapse]
          tune:
            rank_collapse: {patience: 5, attention/rank_one_residual: 0.02}
          rules:
            - name: qk_growth
              conditions: [{metric: weights/qk_spectral_norm, op: ">=", threshold: 20, relative_to: first}]
              patience: 2

    Args:
        defaults: start from :func:`default_rules` (False: only ``rules``).
        disable: names of rules (``fnmatch`` patterns) not to run.
        tune: rule name -> changes (see :meth:`Rule.tuned`).
        rules: rules of your own; one named like a default replaces it.
    """

    defaults: bool = True
    disable: list[str] = field(default_factory=list)
    tune: dict[str, dict[str, Any]] = field(default_factory=dict)
    rules: list[Rule] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_bool("defaults", self.defaults)
        self.disable = check_names("disable", self.disable, what="rule names (fnmatch patterns)")
        for name, changes in check_mapping("tune", self.tune).items():
            check_mapping(f"tune[{name!r}]", changes)
            for key in changes:
                if "/" in key:
                    check_metric_pattern(f"tune[{name!r}] key", key)
        is_list = isinstance(self.rules, Sequence) and not isinstance(self.rules, (str, bytes))
        if not is_list:
            raise ValueError(f"rules must be a list of Rule, got {self.rules!r}")
        own = [Rule(**rule) if isinstance(rule, Mapping) else rule for rule in self.rules]
        if not all(isinstance(rule, Rule) for rule in own):
            raise ValueError(f"rules must be a list of Rule, got {self.rules!r}")
        for rule in own:
            for condition in (*rule.conditions, *rule.exempt):
                check_metric_pattern(f"rules: the metric of rule {rule.name!r}", condition.metric)
        self.rules = own


def rules_from_config(config: AlertConfig | None) -> list[Rule]:
    """The rules ``config`` asks for (``None``: the defaults); ``ValueError`` names what does not exist."""
    config = AlertConfig() if config is None else config
    if not isinstance(config, AlertConfig):
        raise ValueError(f"alerts must be an AlertConfig or None, got {type(config).__name__}")
    by_name = {rule.name: rule for rule in default_rules()} if config.defaults else {}
    for rule in config.rules:
        by_name[rule.name] = rule
    for name, changes in config.tune.items():
        if name not in by_name:
            raise ValueError(f"alerts.tune names rule {name!r}; the rules are {sorted(by_name)}")
        by_name[name] = by_name[name].tuned(changes)
    for pattern in config.disable:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in by_name):
            raise ValueError(
                f"alerts.disable entry {pattern!r} matches no rule; the rules are {sorted(by_name)}"
            )
    return [
        rule
        for name, rule in by_name.items()
        if not any(fnmatch.fnmatchcase(name, pattern) for pattern in config.disable)
    ]


def default_rules() -> list[Rule]:
    """The default rules; each says why it reads what it reads and which runs set its levels."""
    return [RANK_COLLAPSE, UNIFORM_ATTENTION, ENTROPY_COLLAPSE, LOGIT_GROWTH, TOKEN_COLLAPSE,
            EDGE_OF_STABILITY, JACOBIAN_EXPLOSION, WEIGHT_RUNAWAY, NON_FINITE]  # fmt: skip


@dataclass(frozen=True)
class AlertThreshold:
    """One condition of a rule as the metrics reference and ``spectral-monitor report`` read it: the rule
    ``rule`` fires at ``threshold`` and an open alert clears past ``clear``; ``relative_to`` says what is
    compared (``first``/``median``: a ratio to the metric's first value / running median; ``depth``: the
    difference from the first layer at that step). ``threshold`` is None for ``op="nonfinite"``.

    Example:
        >>> [t.describe() for t in default_thresholds("attention/rank_one_residual")]
        ['`rank_collapse`: <= 0.05 (clears > 0.1)']
    """

    rule: str
    op: str
    threshold: float | None = None
    clear: float | None = None
    relative_to: str = "value"

    @classmethod
    def of(cls, rule: Rule, condition: Condition) -> AlertThreshold:
        """The threshold ``condition`` of ``rule`` sets.

        Args:
            rule: the rule holding the condition.
            condition: one of ``rule.conditions``.

        Returns:
            The condition's comparison, levels and reference, under the rule's name.
        """
        level = None if condition.op == "nonfinite" else condition.threshold
        return cls(rule.name, condition.op, level, condition.clear, condition.relative_to)

    def describe(self) -> str:
        """The threshold in words, as the metrics reference page shows it.

        Returns:
            ``"`rule`: <op> <threshold>[ unit] (clears <opposite op> <clear>)"``, or ``"`rule`: NaN or inf"``.
        """
        if self.op == "nonfinite":
            return f"`{self.rule}`: NaN or inf"
        unit = {"value": "", "first": " × its first value", "median": " × its running median",
                "depth": " above the first layer's"}[self.relative_to]  # fmt: skip
        text = f"`{self.rule}`: {self.op} {self.threshold:g}{unit}"
        return text if self.clear is None else f"{text} (clears {_OPPOSITE[self.op]} {self.clear:g})"


_OPPOSITE = {">=": "<", "<=": ">"}


def default_thresholds(metric: str) -> tuple[AlertThreshold, ...]:
    """The thresholds the default rules put on ``metric``: the one definition the metrics catalogue, its
    reference page and ``spectral-monitor report`` read.

    Args:
        metric: a ``family/metric`` name (``attention/entropy``).

    Returns:
        One :class:`AlertThreshold` per condition of :func:`default_rules` matching ``metric``, in rule order.

    Example:
        >>> [t.rule for t in default_thresholds("attention/entropy")][:2]
        ['uniform_attention', 'entropy_collapse']
    """
    return tuple(
        AlertThreshold.of(rule, condition)
        for rule in default_rules()
        for condition in rule.conditions
        if condition.matches(metric)
    )


def _heads_phrase(fraction: float) -> str:
    if fraction == 1:
        return "per layer, every head"
    return (
        "per layer, any head"
        if fraction <= ANY_HEAD_FRACTION
        else f"per layer, ≥ {fraction:.0%} of its heads"
    )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


LONG_CONTEXT_REMEDY = (
    "scale the attention logits by γ·log n (n={n}, log n={log_n}; logit_scaling='log_n' in the demo), or "
    "initialise W_Q and W_K larger: rows this flat over n keys give every query the same average"
)

SINK_MASS = 0.5
"""``sink_mass`` from which a rank-one head is an attention sink (most of its mass on one key column)."""

RANK_COLLAPSE = Rule(
    name="rank_collapse",
    conditions=[
        Condition("attention/rank_one_residual", "<=", 0.05, clear=0.1),
        Condition("attention/effective_rank_ratio", "<=", 0.01, clear=0.02),
    ],
    patience=2,
    start_step=1,
    remedy=LONG_CONTEXT_REMEDY,
    exempt=[Condition("attention/sink_mass", ">=", SINK_MASS)],
)
"""Every head of a layer rank one: all queries attend the same way (Dong et al. 2021), attention-sink heads
left out.

Per layer, not per head: an attention-sink head or a fixed positional head is rank one by design in healthy
models. A rank-one A = 1āᵀ gives every query the same mix ā of the values. When ā is spread over many keys
(uniform over n keys: its largest entry 1/n) the head averages the context away: that is the collapse. When
ā sits on one key the head copies that key's value into every position, the no-op an attention sink
implements in trained LMs (Xiao et al. 2023; Gu et al. 2024): rank one, not collapsed. ``sink_mass`` is the
largest column mean of A over the real queries, the largest entry of ā for a rank-one head, so a head with
``sink_mass`` >= 0.5 (most of every query's mass on one key) is left out of the judgement: the layer is
collapsed when every other head is rank one, and a layer of sink heads only is not judged. Under a causal
mask query i attends keys ≤ i only, so a causal head near rank one has ā on the first few keys: with most of
it on one key it is a first-token sink and left out. The uniform attention of long_context_collapse.yaml has
``sink_mass`` ≈ 1/512 + noise, far below 0.5. Skips step 0 and needs 2 evaluations in a row: an untrained
bidirectional model with small initial logits looks exactly like this (long_context_collapse.yaml and its
healthy twin alike have flat rows at step 0 until the logits grow). Calibrated on
configs/long_context_collapse.yaml (rank-one residual 0.024–0.044 in every head, effective rank / n
0.003–0.004, steps 0–74), against configs/long_context_logn.yaml (rank-one residual >= 0.64, effective
rank / n >= 0.18, steps 0–49) and configs/demo.yaml (causal: rank-one residual ≈ 0.77, effective rank / n
≈ 0.33)."""

UNIFORM_ATTENTION = Rule(
    name="uniform_attention",
    conditions=[
        Condition("attention/entropy", ">=", 0.98, clear=0.95),
        Condition("attention/eigen_gap", ">=", 0.95, clear=0.9),
    ],
    combine="all",
    patience=2,
    start_step=1,
    remedy=LONG_CONTEXT_REMEDY,
)
"""Every head of a bidirectional layer uniform: entropy / log n >= 0.98 and 1 − |λ₂| >= 0.95 (rank one).

Bidirectional only: ``eigen_gap`` is written for bidirectional attention alone, so a causal layer is never
judged. Causal uniform attention is a full-rank prefix mean (spectral gap ≈ 0.37 at n = 64, ≈ 0.3 at 512),
not a collapse, and it is how the healthy configs/demo.yaml starts: entropy >= 0.99 in every head of every
layer for its first 100 steps. An entropy-alone rule would fire on that healthy run. The gap is read as
``eigen_gap`` rather than the spectral gap because both go to 1 on uniform bidirectional attention but
only the eigen gap tells causal layers apart. Calibrated on configs/long_context_collapse.yaml (entropy
1.000, eigen gap >= 0.98 in every head, steps 0–74) and its γ·log n twin (entropy <= 0.957, eigen gap
<= 0.89, steps 0–49)."""

ENTROPY_COLLAPSE = Rule(
    name="entropy_collapse",
    conditions=[
        Condition("attention/entropy", "<=", 0.05, clear=0.1),
        Condition("attention/entropy", "<=", 0.3, clear=0.5, relative_to="median"),
    ],
    patience=2,
    remedy="QK-norm (normalise q and k before their dot product) or σReparam on W_Q, W_K (Zhai et al. 2023); "
    "a lower learning rate or a longer warm-up",
)
"""Every head of a layer puts almost all its mass on one key per query, or lost 70% of its entropy against
its own running median: the entropy collapse that precedes loss spikes (Zhai et al. 2023). Per layer:
single heads with near-zero entropy (previous-token heads, sinks) are normal. In the healthy
configs/demo.yaml (300 steps, every 25) every head stays >= 0.59 and never falls below 0.60 × its running
median."""

LOGIT_GROWTH = Rule(
    name="logit_growth",
    conditions=[Condition("attention/max_logit", ">=", 50.0, clear=30.0)],
    head_fraction=ANY_HEAD_FRACTION,
    patience=2,
    remedy="QK-norm (LayerNorm or RMSNorm on each head's q and k before their dot product; qk_norm in the "
    "demo), a lower learning rate or a longer warm-up, QK-Clip (rescale W_Q and W_K of a head whose largest "
    "logit passes a cap), or logit soft-capping (c·tanh(logit/c))",
)
"""A head's largest attention logit at 50 or more, twice in a row: softmax saturated far past any need.

Why 50 (logit units: scale·q·k + bias). A row whose top logit beats the other keys by a gap Δ leaves them
together at most (n − 1)·e^{−Δ} of its mass, so a row of n keys is one-hot once Δ ≈ log n + c. With
c = 16.6 (e^{−c} = 6e-8, float32's unit roundoff), a gap of 50 is one-hot to float32 for every n up to
e^{33} ≈ 2·10¹⁴ keys: no context length needs a logit this large, the softmax gradient of such rows
vanishes (nothing pulls the logit back), and in bf16 a logit of 50 is stored to steps of 0.25, coarser than
the differences that rank keys. Softmax reads differences only; the level reads as a gap against the keys
whose logits sit near 0 or below. Logits that large come from ‖W_Q‖‖W_K‖ growing without bound: the
attention-logit growth behind the loss divergence of Dehghani et al. 2023 and Wortsman et al. 2023.
Any head (QK-Clip acts per head too); patience 2 passes over a single outlier batch; clears below 30.

Calibrated on configs/logit_growth.yaml (AdamW, no weight decay, lr warmed up to 0.1 over 500 steps, every
10 steps): the largest logit reads 59 at step 79 and 73 at step 89, where the rule fires, 406 steps before
the loss first rises 1 nat over its best (step 495; above it for good from step 521). Its QK-norm twin
configs/logit_growth_qk_norm.yaml stays <= 19 over 600 steps and learns the task; the healthy
configs/demo.yaml (300 steps, every 25) stays <= 17.4."""

TOKEN_COLLAPSE = Rule(
    name="token_collapse",
    conditions=[
        Condition("tokens/cosine_similarity", ">=", 0.95, clear=0.9),
        Condition("tokens/token_residual", "<=", 0.05, clear=0.1),
        Condition("tokens/cosine_similarity", ">=", 0.5, clear=0.4, relative_to="depth"),
    ],
    patience=2,
    start_step=1,
    remedy="the tokens leaving this block are nearly identical (rank collapse of the residual stream, "
    "Noci et al. 2022): check the rank_collapse alerts of earlier layers; pre-LN, residual branches "
    "scaled by 1/√depth, or γ·log n logit scaling",
)
"""The residual stream of a block has (nearly) one direction: mean pairwise cosine >= 0.95 or token
residual <= 0.05 (Dong et al. 2021; Noci et al. 2022), or its tokens are collapsing with depth: the block's
cosine 0.5 or more above the first block's at the same step (the trend across depth; ``relative_to="depth"``).
In every run we measured (demo, both long-context configs) cosine stays <= 0.26 and the residual >= 0.85:
the residual connection keeps tokens apart even when attention is rank one, so the absolute conditions fire
only on a collapse deeper than attention's. Across depth the healthy configs/demo.yaml (300 steps, every 25)
has its last block's cosine at most 0.012 above its first block's (cosine falls with depth there) and the
long-context configs at most 0.06; a tiny 2-block demo model early in training (steps 0–60, every 5) reached
0.31, the largest healthy gap measured, so 0.5 leaves a margin. Broken, AdamW at lr 0.3 (100× the demo's)
on the tiny model: cosine 0.99–1.0 in both blocks from step 4 (the absolute condition fires at step 9; the
gap stays ≈ 0, the collapse being everywhere at once)."""

EDGE_OF_STABILITY = Rule(
    name="edge_of_stability",
    conditions=[Condition("curvature/sharpness_ratio", ">=", 1.5, clear=1.2)],
    patience=3,
    start_step=10,
    remedy="lower the learning rate (sharpness is past the optimizer's edge: 2/η for SGD, "
    "(2+2β₁)/((1−β₁)η) for Adam), or warm up longer",
)
"""Sharpness sustained at 1.5× the optimizer's edge of stability, 3 evaluations in a row, from step 10.
Training at the edge (ratio ≈ 1) is the normal regime of full-batch GD and Adam (Cohen et al. 2021, 2022);
staying well above it means the step size no longer fits the curvature and the loss is about to blow up.

Calibrated on real runs (curvature on; tests/test_alerts_runs.py). Healthy: full-batch GD at η = 0.55 on the
tanh regression of tests/test_curvature_callback.py sharpens from ratio 0.53 to the edge and stays there
(≤ 1.04 over 400 steps, every 20); configs/demo.yaml with AdamW (every 25, 300 steps) reads 0.07–1.06.
Broken: the same GD run with η raised 2.5× at step 100 reads 2.2–2.3 from the next evaluation (every 4
steps) and fires at step 111 while the loss is still below its step-99 value; it explodes 9 steps later and
goes NaN. GD started at η = 1.7–2.0 (ratio 1.6–1.9 at step 0) reads 4–10 by step 3 and overflows by
step 23. ``start_step=10``: Adam's preconditioned sharpness is 1.5–4.1× its edge on steps 1–4 of a healthy
tiny demo run measured every step (its v̂ holds a handful of gradients, and the momentum EMA behind the
(2+2β₁)/((1−β₁)η) edge needs ≈ 1/(1−β₁) = 10 steps to settle), then 0.10–0.18. The price: a GD run
already diverging within its first 10 steps is left to ``non_finite`` and the loss curve. A one-off
catapult (GD at η = 1.5: ratio 2.2 at steps 4–9, then oscillating 1.0–1.6 while the loss converges) does
not fire at every 5 steps."""

JACOBIAN_EXPLOSION = Rule(
    name="jacobian_explosion",
    conditions=[
        Condition("jacobian/jacobian_norm", ">=", 200.0, clear=100.0, relative_to="first"),
        Condition("jacobian/end_to_end_norm", ">=", 200.0, clear=100.0, relative_to="first"),
    ],
    patience=2,
    remedy="signal is exploding through this block: pre-LN, residual branches scaled down, a lower "
    "learning rate, or gradient clipping",
)
"""A block's (or the whole model's) input-output Jacobian norm 200× its first measured value, twice in a
row: the forward signal (and the backward gradient) amplifies.

Why 200× and not 10×: a pre-LN block reads its input through LayerNorm, which divides by the input's RMS,
so the first block's Jacobian scales with 1/RMS of the embeddings. In the healthy configs/demo.yaml
(GPT-2 init 0.02; every 25 steps, 300 steps) block 0's norm grows from 2.1 to 147 (70×) and the
end-to-end norm from 4.5 to 319 (71×) while the loss converges; later blocks grow at most 3.5×. A 10× rule
fired on that run at step 49. 200× is about three times the largest healthy growth measured. Broken:
AdamW at lr 0.3 (100× the demo's) on a tiny 2-block demo model: block 0 297× its first value at step 4,
900× at step 9 (up to 45,000×), end-to-end 285–770×; fires at step 9 (every 5 steps)."""

WEIGHT_RUNAWAY = Rule(
    name="weight_runaway",
    conditions=[Condition("weights/spectral_norm", ">=", 20.0, clear=15.0, relative_to="first")],
    patience=2,
    read_heads=False,
    remedy="this weight's largest singular value keeps growing: more weight decay, a lower learning rate, or "
    "σReparam / spectral normalisation of it",
)
"""A whole weight's spectral norm 20× its first measured value, twice in a row. Small initialisations
grow several-fold in healthy training: in configs/demo.yaml (300 steps, GPT-2 init 0.02) the output head
grew 9.4×, the MLP output projections up to 8.5×, attention projections up to 7.3×; 20× is twice the
largest healthy growth measured. A weight whose first norm is 0 (zero-initialised) is never judged."""

NON_FINITE = Rule(
    name="non_finite",
    conditions=[
        Condition(metric, "nonfinite", required=True)
        for metric in (
            "weights/spectral_norm",
            "weights/frobenius_norm",
            "attention/sigma1",
            "attention/entropy",
            "tokens/token_residual",
            "curvature/sharpness",
            "jacobian/jacobian_norm",
            "jacobian/end_to_end_norm",
        )
    ],
    head_fraction=0.01,
    severity="critical",
    remedy="a weight or activation is NaN/inf: lower the learning rate, clip gradients, or train in bf16 "
    "rather than fp16; the first layer reported is where it started",
)
"""Any NaN or inf in what the monitor saw (norms and entropies, which are finite for every finite input):
fires on the first evaluation (patience 1), critical. ``head_fraction=0.01``: one broken head is enough."""


@functools.lru_cache(maxsize=2**16)
def _name_matches(name: str, pattern: str) -> bool:
    # Every rule is matched against every record of every logging step: the same few thousand pairs again
    # and again (159k matches per step on the demo model cost 0.1 s uncached).
    return fnmatch.fnmatchcase(name, pattern)

"""Alert rules: what to watch, in which units, for how long, and what to do about it.

A rule is plain data (dataclasses of plain types), so LightningCLI builds it from YAML as well as code.
It reads ``Measurement`` records by ``family/metric`` and knows nothing of how they were computed or where
alerts go; :class:`~spectral_monitor.alerts.engine.AlertEngine` evaluates rules on each logging step.

Thresholds are in the normalised units of the metrics (entropy / log n, effective rank / n, ...)
so a default holds at any sequence length. The defaults are listed in :func:`default_rules`, each with why it
reads what it reads; the guide's alerts page gives the runs their levels were set on. What the catalogue and
``spectral-monitor report`` read of them, :class:`AlertThreshold` and :func:`default_thresholds`, lives in
:mod:`spectral_monitor.alerts.thresholds` and is imported here too.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spectral_monitor.alerts.thresholds import AlertThreshold, default_thresholds
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
"""How an alert is shown and counted, from least to most urgent."""
ANY_HEAD_FRACTION = 0.01
"""A ``head_fraction`` at or below this asks for any one head (of up to 100)."""
MEDIAN_WINDOW = 8
"""Evaluations in the running median of ``relative_to="median"`` (older values are dropped)."""


@dataclass(frozen=True)
class Condition:
    """One test on one metric: ``value <op> threshold``, cleared past ``clear``.

    Attributes:
        metric: ``family/metric`` of the records read, an ``fnmatch`` pattern (``weights/*_norm``).
        op: One of :data:`COMPARISONS`.
        threshold: The level at which the condition starts to hold (unused by ``nonfinite``).
        clear: The level the value must get back past for an open alert to close (hysteresis); on the
            healthy side of ``threshold`` or equal to it. ``None``: ``threshold``.
        relative_to: One of :data:`RELATIVE_TO`; ``first`` and ``median`` make ``threshold`` a ratio,
            ``depth`` a difference.
        required: If False, a layer that does not report ``metric`` skips this condition instead of
            not being evaluated (``eigen_gap`` is written for bidirectional attention only).

    Raises:
        ValueError: ``metric`` is not ``family/metric``, ``op`` or ``relative_to`` is unknown, a level is
            not a finite number, ``required`` is not a bool, or ``clear`` is on the failing side of
            ``threshold``.

    Examples:
        >>> condition = Condition("attention/entropy", "<=", 0.05, clear=0.1)
        >>> condition.holds(0.04), condition.holds(0.08), condition.holds(0.08, clearing=True)
        (True, False, True)
        >>> condition.describe()
        'attention/entropy <= 0.05'
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
        """The level an open alert must get back past to close: ``clear``, or ``threshold`` when None."""
        return self.threshold if self.clear is None else self.clear

    def matches(self, family_metric: str) -> bool:
        """Whether the condition reads the metric ``family_metric``.

        Args:
            family_metric: A metric's full name, ``family/metric``.

        Returns:
            True if ``family_metric`` matches the ``metric`` pattern (``fnmatch``, case-sensitive).
        """
        return _name_matches(family_metric, self.metric)

    def holds(self, value: float, *, clearing: bool = False) -> bool:
        """Whether ``value`` meets the condition.

        Args:
            value: The reading, already relative (ratio or difference) where ``relative_to`` asks for it.
            clearing: Test against the clear level instead of the threshold: the test an open alert keeps
                passing until it closes.

        Returns:
            For ``nonfinite``, whether ``value`` is NaN or ±inf; otherwise ``value >= level`` or
            ``value <= level`` (NaN never holds).
        """
        if self.op == "nonfinite":
            return not math.isfinite(value)
        level = self.clear_level if clearing else self.threshold
        return value >= level if self.op == ">=" else value <= level

    def describe(self) -> str:
        """The condition in words, as alerts and the rules' descriptions show it.

        Returns:
            ``"<metric> <op> <threshold>"`` with what the threshold is relative to, or
            ``"<metric> is NaN or inf"``.
        """
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

    Attributes:
        name: The rule's name (``alerts/open/<name>`` in TensorBoard, ``stop_on`` entries).
        conditions: What it tests, combined by ``combine``; mappings are read as :class:`Condition`.
        combine: ``any`` (one condition suffices) or ``all``.
        scope: One of :data:`SCOPES`.
        head_fraction: With ``scope="layer"``, the fraction of a layer's heads that must meet the conditions
            (1.0: every head). Per-head records are used when written; without them (``per_head=False``)
            a layer-wide condition is tested on the ``<metric>_max`` (``<=``) or ``<metric>_min`` (``>=``)
            aggregate, which is exact for ``head_fraction=1`` and a single condition.
        patience: Consecutive evaluations a condition must hold before the alert fires.
        start_step: Evaluations at earlier steps are ignored (the untrained model at step 0 can look
            collapsed without being broken).
        severity: One of :data:`SEVERITIES`.
        remedy: What to try, shown with the alert; ``{n}`` is replaced by the layer's attention length
            (effective_rank / effective_rank_ratio) when the records give it, ``{log_n}`` by its natural
            logarithm, and every other brace is kept as written.
        layers: ``fnmatch`` patterns of the layers the rule applies to; ``None``: all.
        read_heads: Read per-head records where they exist; False: the layer's own records only (a whole
            weight's norm rather than its heads' rows).
        exempt: Conditions (on the values themselves, ``relative_to="value"``) that leave a head out of the
            judgement: a head meeting any of them neither meets the rule nor counts among the heads
            evaluated, and a layer whose every head is exempt is not judged (an open alert stays open).
            ``rank_collapse`` leaves out attention-sink heads this way.

    Raises:
        ValueError: A field is out of its range: an empty name or one holding ``/``, no condition (or none
            ``required``), an unknown ``combine``, ``scope`` or ``severity``, ``head_fraction`` outside
            (0, 1], ``patience`` < 1, ``start_step`` < 0, or an ``exempt`` condition that is not a plain
            ``>=``/``<=`` on the value.

    Examples:
        >>> rule = Rule("qk_growth", [Condition("weights/qk_spectral_norm", ">=", 20, relative_to="first")])
        >>> rule.describe()
        'weights/qk_spectral_norm >= 20 × its first value (per layer, every head; 1 evaluation in a row)'
        >>> rule.tuned({"patience": 3}).patience, rule.families, rule.applies_to("blocks.0")
        (3, {'weights'}, True)
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
        """The metric families its conditions read (``exempt`` conditions aside)."""
        return {condition.metric.split("/", 1)[0] for condition in self.conditions}

    def applies_to(self, layer: str) -> bool:
        """Whether the rule judges the layer ``layer``.

        Args:
            layer: A layer's name, as the records give it (``blocks.0.attention``).

        Returns:
            True if ``layers`` is None or one of its patterns matches ``layer``.
        """
        return self.layers is None or any(_name_matches(layer, pattern) for pattern in self.layers)

    def describe(self) -> str:
        """The rule in words: its conditions, where they are judged, what is left out, and its patience.

        Returns:
            One line, as the metrics reference and ``spectral-monitor report`` show it.
        """
        joined = f" {'or' if self.combine == 'any' else 'and'} ".join(c.describe() for c in self.conditions)
        if self.scope == "head":
            where = "per head"
        else:
            where = _heads_phrase(self.head_fraction) if self.read_heads else "per layer"
        if self.exempt:
            where += "; heads with " + " or ".join(c.describe() for c in self.exempt) + " left out"
        return f"{joined} ({where}; {self.patience} evaluation{'s' if self.patience > 1 else ''} in a row)"

    def tuned(self, changes: dict[str, Any]) -> Rule:
        """A copy of the rule with ``changes`` made; the rule itself is frozen and left as it is.

        Args:
            changes: Field name (all but ``name``, ``conditions`` and ``exempt``) → its new value, or
                ``family/metric`` of a condition (or of an ``exempt`` condition), exactly as the condition
                writes it → its new threshold, its clear level moving with it, keeping their distance.
                ``family/metric`` alone changes the first condition with that metric;
                ``family/metric@relative_to`` the one with that metric and that ``relative_to``, where a
                rule reads one metric twice (``attention/entropy@median`` in ``entropy_collapse``).

        Returns:
            The new :class:`Rule`, checked as any rule is.

        Raises:
            ValueError: A key is neither a field nor a condition's metric, or a threshold is not a number.
        """
        fields = {f.name for f in dataclasses.fields(self)} - {"name", "conditions", "exempt"}
        conditions, exempt = list(self.conditions), list(self.exempt)
        plain = {}
        for key, value in changes.items():
            if key in fields:
                plain[key] = value
                continue
            metric, _, relative_to = key.partition("@")
            matching = (
                (group, i)
                for group in (conditions, exempt)
                for i, c in enumerate(group)
                if c.metric == metric and relative_to in ("", c.relative_to)
            )
            found = next(matching, None)
            if found is None:
                keys = [c.metric for c in conditions + exempt] + [
                    f"{c.metric}@{c.relative_to}" for c in conditions + exempt
                ]
                raise ValueError(
                    f"alerts.tune[{self.name!r}] key {key!r} is neither a rule field ({sorted(fields)}) nor "
                    f"a condition of the rule ({sorted(set(keys))})"
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
    """Which rules run: the defaults, tuned, some disabled, plus the user's own.

    The ``alerts`` argument of ``SpectralMonitor``; :func:`rules_from_config` turns it into rules. In YAML::

        alerts:
          disable: [token_collapse]
          tune:
            rank_collapse: {patience: 5, attention/rank_one_residual: 0.02}
          rules:
            - name: qk_growth
              conditions: [{metric: weights/qk_spectral_norm, op: ">=", threshold: 20, relative_to: first}]
              patience: 2

    Attributes:
        defaults: Start from :func:`default_rules` (False: only ``rules``).
        disable: Names of rules (``fnmatch`` patterns) not to run.
        tune: Rule name → changes (see :meth:`Rule.tuned`); metric keys must name catalogued metrics.
        rules: Rules of your own (mappings are read as :class:`Rule`); one named like a default replaces it.

    Raises:
        ValueError: A field has the wrong type, or a metric of ``tune`` or ``rules`` matches no metric the
            monitor writes.

    Examples:
        >>> config = AlertConfig(disable=["token_collapse"], tune={"rank_collapse": {"patience": 5}})
        >>> [rule.patience for rule in rules_from_config(config) if rule.name == "rank_collapse"]
        [5]
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
                    metric, at, relative_to = key.partition("@")
                    check_metric_pattern(f"tune[{name!r}] key", metric)
                    if at:
                        check_choice(
                            f"tune[{name!r}] key {key!r}: what follows '@'", relative_to, RELATIVE_TO
                        )
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
    """The rules ``config`` asks for, in order: the defaults first, then the user's own rules.

    A user's rule named like a default takes its place; ``tune`` is applied next, ``disable`` last.

    Args:
        config: What to run; None runs the defaults as they are.

    Returns:
        A new list of the rules to evaluate.

    Raises:
        ValueError: ``config`` is not an AlertConfig, ``tune`` names a rule that does not exist (or changes
            it wrongly, see :meth:`Rule.tuned`), or a ``disable`` pattern matches no rule.

    Examples:
        >>> [rule.name for rule in rules_from_config(AlertConfig(disable=["*_collapse", "edge_*"]))]
        ['uniform_attention', 'logit_growth', 'jacobian_explosion', 'weight_runaway', 'non_finite']
    """
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
    """The default rules, as the module-level constants define them (each says why it reads what it reads).

    Returns:
        A new list of :data:`RANK_COLLAPSE`, :data:`UNIFORM_ATTENTION`, :data:`ENTROPY_COLLAPSE`,
        :data:`LOGIT_GROWTH`, :data:`TOKEN_COLLAPSE`, :data:`EDGE_OF_STABILITY`, :data:`JACOBIAN_EXPLOSION`,
        :data:`WEIGHT_RUNAWAY` and :data:`NON_FINITE`, in that order.

    Examples:
        >>> [rule.name for rule in default_rules()][:3]
        ['rank_collapse', 'uniform_attention', 'entropy_collapse']
    """
    return [RANK_COLLAPSE, UNIFORM_ATTENTION, ENTROPY_COLLAPSE, LOGIT_GROWTH, TOKEN_COLLAPSE,
            EDGE_OF_STABILITY, JACOBIAN_EXPLOSION, WEIGHT_RUNAWAY, NON_FINITE]  # fmt: skip


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
"""Every head of a layer rank one: all queries attend the same way (Dong et al. 2021), attention-sink
heads left out.

Per layer, not per head: an attention-sink head or a fixed positional head is rank one by design. A
rank-one A = 1āᵀ gives every query the same mix ā of the values. When ā is spread over many keys (uniform
over n keys: its largest entry 1/n) the head averages the context away: that is the collapse. When ā sits
on one key the head copies that key's value into every position, the no-op an attention sink implements
(Xiao et al. 2023; Gu et al. 2024): rank one, not collapsed. ``sink_mass`` is the largest column mean of A
over the real queries, the largest entry of ā for a rank-one head, so a head with ``sink_mass`` ≥
:data:`SINK_MASS` is left out of the judgement: the layer is collapsed when every other head is rank one,
and a layer of sink heads only is not judged. Under a causal mask query i attends keys ≤ i only, so a
causal head near rank one has ā on the first few keys: with most of it on one key it is a first-token
sink, left out. Skips step 0 and needs 2 evaluations in a row: an untrained bidirectional model with small
initial logits has flat rows, exactly this picture, until its logits grow."""

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
"""Every head of a bidirectional layer uniform: entropy / log n ≥ 0.98 and 1 − |λ₂| ≥ 0.95 (rank one).

Bidirectional only: ``eigen_gap`` is written for bidirectional attention alone, so a causal layer is never
judged. Causal uniform attention is a full-rank prefix mean (spectral gap ≈ 0.37 at n = 64, ≈ 0.3 at 512),
not a collapse, and an untrained causal model starts near it: a rule on entropy alone would fire on healthy
causal runs. The gap is read as ``eigen_gap`` rather than the spectral gap because both go to 1 on uniform
bidirectional attention but only the eigen gap tells causal layers apart."""

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
"""Every head of a layer puts almost all its mass on one key per query (entropy / log n ≤ 0.05), or lost
70% of its entropy against its own running median: the entropy collapse that precedes loss spikes (Zhai
et al. 2023). Per layer: single heads with near-zero entropy (previous-token heads, sinks) are normal."""

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
Any head (QK-Clip acts per head too); patience 2 passes over a single outlier batch; clears below 30."""

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
"""The residual stream of a block has (nearly) one direction: mean pairwise cosine ≥ 0.95 or token
residual ≤ 0.05 (Dong et al. 2021; Noci et al. 2022), or its tokens are collapsing with depth: the block's
cosine 0.5 or more above the first block's at the same step (``relative_to="depth"``). The residual
connection keeps tokens apart even when attention is rank one, so the absolute conditions fire only on a
collapse deeper than attention's; the depth condition reads the trend across blocks, whatever the level
the first block sets."""

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
Patience 3 lets a one-off catapult (a few evaluations past the edge while the loss converges) pass.
``start_step=10``: Adam's edge (2+2β₁)/((1−β₁)η) assumes momentum in its steady state, ≈ 1/(1−β₁) = 10
steps, and while v̂ holds a handful of gradients the preconditioned sharpness reads past the edge in
healthy training. The price: a run already diverging within its first 10 steps is left to ``non_finite``
and the loss curve."""

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

The level is far above 10× because healthy growth is large: a pre-LN block reads its input through
LayerNorm, which divides by the input's RMS, so the first block's Jacobian scales with 1/RMS of the
embeddings and grows tens of times over as small initial embeddings grow."""

WEIGHT_RUNAWAY = Rule(
    name="weight_runaway",
    conditions=[Condition("weights/spectral_norm", ">=", 20.0, clear=15.0, relative_to="first")],
    patience=2,
    read_heads=False,
    remedy="this weight's largest singular value keeps growing: more weight decay, a lower learning rate, or "
    "σReparam / spectral normalisation of it",
)
"""A whole weight's spectral norm 20× its first measured value, twice in a row. Small initialisations
grow several-fold in healthy training; 20× leaves that room. A weight whose first norm is 0
(zero-initialised) is never judged."""

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
    # and again, so each answer is kept.
    return fnmatch.fnmatchcase(name, pattern)

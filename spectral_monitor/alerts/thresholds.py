"""The default rules' thresholds as their readers see them: one :class:`AlertThreshold` per condition.

The metrics catalogue (:mod:`spectral_monitor.catalog`), the metrics reference page, the verdicts of
:mod:`spectral_monitor.judging` and ``spectral-monitor report`` show each metric's alert levels. They read
them here, from the rules of :mod:`spectral_monitor.alerts.rules`, the one place a level is written. This
module imports the rules only when a threshold is asked for: the rules check their metric names against
the catalogue, which reads its thresholds from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spectral_monitor.alerts.rules import Condition, Rule

__all__ = ["AlertThreshold", "default_thresholds"]


@dataclass(frozen=True)
class AlertThreshold:
    """One condition of a rule as the metrics reference and ``spectral-monitor report`` read it.

    Attributes:
        rule: The name of the rule that fires at ``threshold``.
        op: One of :data:`~spectral_monitor.alerts.rules.COMPARISONS`.
        threshold: The level; None for ``op="nonfinite"``.
        clear: The level an open alert clears past; None: ``threshold``.
        relative_to: What is compared, one of :data:`~spectral_monitor.alerts.rules.RELATIVE_TO`
            (``first``/``median``: a ratio to the metric's first value / running median; ``depth``: the
            difference from the first layer at that step).

    Examples:
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
            rule: The rule holding the condition.
            condition: One of ``rule.conditions``.

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
        metric: A ``family/metric`` name (``attention/entropy``).

    Returns:
        One :class:`AlertThreshold` per condition of :func:`~spectral_monitor.alerts.rules.default_rules`
        matching ``metric``, in rule order.

    Examples:
        >>> [t.rule for t in default_thresholds("attention/entropy")][:2]
        ['uniform_attention', 'entropy_collapse']
    """
    from spectral_monitor.alerts import rules  # the rules check their metrics against the catalogue

    return tuple(
        AlertThreshold.of(rule, condition)
        for rule in rules.default_rules()
        for condition in rule.conditions
        if condition.matches(metric)
    )

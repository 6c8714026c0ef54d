"""What an alert says: :class:`AlertEvent`, one fired or resolved alert, and the :class:`Reading` s it names.

The :class:`~spectral_monitor.alerts.engine.AlertEngine` makes them; the console, TensorBoard, the
dashboard and checkpoints show or keep them. An event is plain data: :func:`dataclasses.asdict` writes it
and :meth:`AlertEvent.from_dict` reads it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FIRED", "RESOLVED", "AlertEvent", "Reading"]

FIRED = "fired"
"""The ``kind`` of an event raised when a rule's conditions have held for its ``patience``."""
RESOLVED = "resolved"
"""The ``kind`` of an event raised when an open alert's conditions no longer hold at their clear level."""


@dataclass(frozen=True)
class Reading:
    """What one condition of a rule read: ``metric`` gave ``value`` against ``level`` (``op``).

    Attributes:
        metric: The ``family/metric`` read.
        op: The condition's comparison, one of :data:`~spectral_monitor.alerts.rules.COMPARISONS`.
        value: What was read: the value itself, a ratio for ``relative_to`` ``first``/``median``, a
            difference for ``depth``.
        level: The threshold (fired) or the clear level (resolved) it was compared with.
        relative_to: One of :data:`~spectral_monitor.alerts.rules.RELATIVE_TO`.

    Examples:
        >>> Reading("attention/entropy", ">=", 1.0, 0.98).text()
        'attention/entropy 1.000 >= 0.980'
        >>> Reading("weights/spectral_norm", ">=", 12.5, 15.0, "first").text(RESOLVED)
        'weights/spectral_norm × first value 12.500 < 15.000'
    """

    metric: str
    op: str
    value: float
    level: float
    relative_to: str = "value"

    def text(self, kind: str = FIRED) -> str:
        """The reading as text, three significant decimals (scientific past 1000 or below 0.001).

        Args:
            kind: :data:`FIRED` shows the side that met the threshold (``value op level``);
                :data:`RESOLVED` the cleared side (``<`` for ``>=``, ``>`` for ``<=``).

        Returns:
            ``"<metric> [<reference> ]<value> <op> <level>"``, or ``"<metric> = <value>"`` for a
            ``nonfinite`` condition.
        """
        if self.op == "nonfinite":
            return f"{self.metric} = {self.value}"
        unit = {"value": "", "first": "× first value ", "median": "× running median ",
                "depth": "− first layer "}[self.relative_to]  # fmt: skip
        op = self.op if kind == FIRED else {">=": "<", "<=": ">"}[self.op]
        return f"{self.metric} {unit}{_number(self.value)} {op} {_number(self.level)}"


@dataclass(frozen=True)
class AlertEvent:
    """An alert that fired, or one that resolved (``kind``).

    For a layer, ``value`` is the value of the head nearest the threshold among those that met it (fired)
    or the median over heads (resolved).

    Attributes:
        rule: The rule's name.
        kind: :data:`FIRED` or :data:`RESOLVED`.
        step: The training step of the evaluation that raised it.
        layer: The layer (module name) judged.
        head: The head, for a per-head alert (``scope="head"``); None otherwise.
        severity: The rule's severity, one of :data:`~spectral_monitor.alerts.rules.SEVERITIES`.
        metric: The first condition of the rule that held (fired), or that had held when the alert fired
            (resolved): its ``family/metric``.
        op: That condition's comparison.
        value: What ``metric`` read (a ratio or difference for a relative condition).
        level: The threshold (fired) or the clear level (resolved).
        relative_to: What ``value`` is relative to.
        since: The first step of the streak that fired it.
        heads: ``"k/h"``: k of the layer's h judged heads met the conditions (``"k/h measured of H"`` where a
            cost budget measured h of its H heads); None for a per-head alert or a metric without heads.
        remedy: What to try, ``{n}`` filled in; "" for none.
        also: The readings of the rule's other conditions named, in the rule's order, so a rule of several
            conditions says which ones it was.

    Examples:
        >>> event = AlertEvent("rank_collapse", FIRED, step=20, layer="blocks.0.attention", head=None,
        ...     severity="warning", metric="attention/rank_one_residual", op="<=", value=0.03, level=0.05,
        ...     relative_to="value", since=10, heads="4/4")
        >>> event.where
        'blocks.0.attention (4/4 heads)'
        >>> event.message().split(", ")[1]
        'step 20: attention/rank_one_residual 0.030 <= 0.050 since step 10'
        >>> from dataclasses import asdict
        >>> AlertEvent.from_dict(asdict(event)) == event
        True
    """

    rule: str
    kind: str
    step: int
    layer: str
    head: int | None
    severity: str
    metric: str
    op: str
    value: float
    level: float
    relative_to: str
    since: int
    heads: str | None = None
    remedy: str = ""
    also: tuple[Reading, ...] = ()

    @property
    def where(self) -> str:
        """Where the alert is: the layer, with its head (``blocks.0 head 3``) or the heads that met it
        (``blocks.0 (4/4 heads)``)."""
        if self.head is not None:
            return f"{self.layer} head {self.head}"
        return self.layer if self.heads is None else f"{self.layer} ({self.heads} heads)"

    @property
    def readings(self) -> tuple[Reading, ...]:
        """Every condition named by this event, the first one (``metric``) first."""
        first = Reading(self.metric, self.op, self.value, self.level, self.relative_to)
        return (first, *self.also)

    @property
    def comparison(self) -> str:
        """``value op level`` of each condition named, as text: ``attention/entropy 1.000 >= 0.980``."""
        return " and ".join(reading.text(self.kind) for reading in self.readings)

    def message(self) -> str:
        """The event as one console line.

        Returns:
            Fired: ``"SpectralMonitor <severity> <rule> at <where>, step <step>: <comparison>[ since step
            <since>][. Try: <remedy>]"``. Resolved: ``"SpectralMonitor resolved <rule> at <where>, step
            <step> (open since step <since>): <comparison>"``.
        """
        if self.kind == RESOLVED:
            return (
                f"SpectralMonitor resolved {self.rule} at {self.where}, step {self.step} (open since step "
                f"{self.since}): {self.comparison}"
            )
        text = f"SpectralMonitor {self.severity} {self.rule} at {self.where}, step {self.step}: "
        text += self.comparison
        if self.since != self.step:
            text += f" since step {self.since}"
        return f"{text}. Try: {self.remedy}" if self.remedy else text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AlertEvent:
        """The event :func:`dataclasses.asdict` wrote as ``data``; nothing is checked here.

        Args:
            data: The event's fields by name; ``also`` as a sequence of mappings of :class:`Reading` fields.

        Returns:
            The event, its ``also`` a tuple of :class:`Reading`.
        """
        also = tuple(Reading(**reading) for reading in data.get("also", ()))
        return cls(**{**data, "also": also})


def _number(value: float) -> str:
    return f"{value:.3g}" if abs(value) >= 1000 or (value != 0 and abs(value) < 0.001) else f"{value:.3f}"

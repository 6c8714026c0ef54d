"""Evaluating alert rules on the records of each logging step: patience, hysteresis, fired and resolved.

:class:`AlertEngine` is given every record of a logging step and returns what changed: an
:class:`AlertEvent` of kind ``fired`` when a rule's condition has held for ``patience`` evaluations in a row,
and of kind ``resolved`` when an open alert's condition no longer holds at its clear level. Between the two,
an alert is open and nothing is reported again, however long it lasts. Its state (streaks, open alerts,
baselines of relative conditions, history) is plain data for a checkpoint. The events themselves are
defined in :mod:`spectral_monitor.alerts.events` and imported here too.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from spectral_monitor.alerts.events import FIRED, RESOLVED, AlertEvent, Reading
from spectral_monitor.alerts.rules import MEDIAN_WINDOW, Rule
from spectral_monitor.checkpoint_entries import StateEntries, checked_integer, checked_number
from spectral_monitor.records import Measurement

__all__ = ["HISTORY_LIMIT", "AlertEngine", "AlertEvent", "Reading"]

HISTORY_LIMIT = 1000
"""Events kept in the history (the most recent ones)."""


@dataclass
class _Subject:
    """One rule on one layer (or head): its streak and whether an alert is open."""

    streak: int = 0
    since: int = -1
    open: bool = False
    held: list[int] = field(default_factory=list)  # conditions (indices) that held when the alert fired


def _checked_subjects(value: Any) -> dict[tuple[str, str, int | None], _Subject]:
    """The rules' streaks from a checkpoint: ``[rule, layer, head, {streak, since, open, held}]`` each."""
    subjects = {}
    for rule, layer, head, subject in value:
        if not (isinstance(rule, str) and isinstance(layer, str)):
            raise TypeError(f"rule {rule!r} and layer {layer!r} are not both str")
        checked_integer(head, smallest=0, optional=True)
        subject = _Subject(**subject)
        checked_integer(subject.streak, smallest=0)
        checked_integer(subject.since, smallest=-1)
        if not isinstance(subject.open, bool) or not isinstance(subject.held, list):
            raise TypeError(f"open {subject.open!r} is not a bool or held {subject.held!r} not a list")
        for condition in subject.held:
            checked_integer(condition, smallest=0)
        subjects[(rule, layer, head)] = subject
    return subjects


def _checked_readings(value: Any) -> list[float]:
    if not isinstance(value, list):
        raise TypeError(f"a {type(value).__name__}, not a list")
    return [checked_number(reading) for reading in value]


def _checked_history(value: Any) -> list[AlertEvent]:
    """The alerts of a checkpoint's history, each with its step an int and its texts str."""
    if not isinstance(value, list):
        raise TypeError(f"a {type(value).__name__}, not a list")
    events = [AlertEvent.from_dict(event) for event in value]
    for event in events:
        checked_integer(event.step, smallest=0)
        checked_integer(event.since, smallest=-1)
        checked_integer(event.head, smallest=0, optional=True)
        texts = (event.rule, event.kind, event.layer, event.severity, event.metric, event.op, event.remedy)
        if not all(isinstance(text, str) for text in texts):
            raise TypeError(f"an alert's rule, kind, layer or texts are not all str: {event!r}")
        if not all(isinstance(number, (int, float)) for number in (event.value, event.level)):
            raise TypeError(f"an alert's value and level are not numbers: {event!r}")
    return events


@dataclass
class _Unit:
    """What one head (or a layer without heads) read for each condition of a rule."""

    values: dict[int, tuple[str, float]] = field(default_factory=dict)  # condition index -> (metric, value)
    exempt: bool = False  # met one of the rule's ``exempt`` conditions: left out of the judgement


class AlertEngine:
    """Evaluates ``rules`` on each logging step's records and keeps their state.

    Records of families no rule reads are ignored, and a rule whose metrics are absent (curvature not
    measured) is simply never evaluated. An iterative estimate that did not converge is never read: where a
    step's records hold ``family/converged/layer`` = 0 (the curvature and Jacobian probes write one per
    layer), that family's other records of that layer at that step are dropped before any rule sees them.

    Args:
        rules: The rules to evaluate, in the order their events are reported; names must be distinct.

    Attributes:
        rules: The rules, as a tuple.
        fired: Rule name → how many times it has fired since the start of the run (resolutions aside).
        history: The last :data:`HISTORY_LIMIT` events, oldest first.

    Raises:
        ValueError: Two rules share a name.

    Examples:
        >>> from spectral_monitor.alerts.rules import Condition, Rule
        >>> from spectral_monitor.records import Measurement
        >>> low = Rule("low", [Condition("attention/entropy", "<=", 0.05, clear=0.1)], patience=2)
        >>> engine = AlertEngine([low])
        >>> for step, value in [(0, 0.02), (10, 0.01), (20, 0.08), (30, 0.5)]:
        ...     records = [Measurement(step, "attention", "entropy", "blocks.0", value)]
        ...     for event in engine.evaluate(step, records):
        ...         print(event.step, event.kind, event.since)
        10 fired 0
        30 resolved 0
        >>> engine.open_counts(), engine.fired
        ({'low': 0}, {'low': 1})
    """

    def __init__(self, rules: Sequence[Rule]) -> None:
        names = [rule.name for rule in rules]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"rules must have distinct names; {duplicates} appear more than once")
        self.rules = tuple(rules)
        # (rule name, family/metric) -> indices of the rule's conditions that read it: every logging step
        # asks again for the same few hundred pairs, so each answer is kept.
        self._reading: dict[tuple[str, str], tuple[int, ...]] = {}
        self._relative_reads: dict[str, tuple[bool, bool]] = {}
        self._subjects: dict[tuple[str, str, int | None], _Subject] = {}
        self._first: dict[str, float] = {}
        self._recent: dict[str, list[float]] = {}
        self.fired: dict[str, int] = {rule.name: 0 for rule in self.rules}
        self.history: list[AlertEvent] = []

    @property
    def open_alerts(self) -> list[AlertEvent]:
        """The fired event of every alert still open, oldest first."""
        open_keys = {key for key, subject in self._subjects.items() if subject.open}
        latest: dict[tuple[str, str, int | None], AlertEvent] = {}
        for event in self.history:
            key = (event.rule, event.layer, event.head)
            if key in open_keys and event.kind == FIRED:
                latest[key] = event
        return sorted(latest.values(), key=lambda event: (event.step, event.rule, event.layer))

    def open_counts(self) -> dict[str, int]:
        """How many alerts of each rule are open now (one per layer, or per head for ``scope="head"``).

        Returns:
            Rule name → number of open alerts, 0 for a rule with none; every rule of :attr:`rules`.
        """
        counts = {rule.name: 0 for rule in self.rules}
        for (rule, _, _), subject in self._subjects.items():
            if subject.open and rule in counts:
                counts[rule] += 1
        return counts

    def evaluate(self, step: int, records: Iterable[Measurement]) -> list[AlertEvent]:
        """Advance every rule by one evaluation on ``records`` (one logging step).

        Rules with ``start_step`` past ``step`` are skipped; a layer (or head) that reads none of a rule's
        required conditions at this step leaves that rule's streak and open alert as they were. The first
        values and running medians of relative conditions are updated, and the events appended to
        :attr:`history`.

        Args:
            step: The training step the records were measured at.
            records: Every record of the logging step, of any family.

        Returns:
            The events this evaluation caused, fired and resolved, rule by rule in :attr:`rules` order.
        """
        records = _converged_only(list(records))
        relative = self._relative_values(records)
        lengths, heads = _attention_lengths(records), _attention_heads(records)
        events = []
        by_metric: dict[str, list[Measurement]] = {}
        for record in records:
            by_metric.setdefault(f"{record.family}/{record.metric}", []).append(record)
        for rule in self.rules:
            if step < rule.start_step:
                continue
            # Only the records some condition of the rule reads (and their head _min/_max aggregates, which
            # _worst_head_view reads): a few metrics among hundreds of tags.
            read = [
                record
                for family_metric, group in by_metric.items()
                if self.conditions_reading(rule, family_metric)
                or self.conditions_reading(rule, family_metric.removesuffix("_min").removesuffix("_max"))
                or any(exemption.matches(family_metric) for exemption in rule.exempt)
                for record in group
            ]
            units_of = _units_of(rule, read, relative, self.conditions_reading)
            for (layer, head), (units, are_heads) in units_of.items():
                events += self._advance(
                    rule, step, layer, head, units, are_heads, lengths.get(layer), heads.get(layer)
                )
        self.history = (self.history + events)[-HISTORY_LIMIT:]
        return events

    def conditions_reading(self, rule: Rule, family_metric: str) -> tuple[int, ...]:
        """Which of ``rule``'s conditions read ``family_metric`` (the answer is kept for the next step).

        Args:
            rule: One of :attr:`rules`.
            family_metric: A metric's full name, ``family/metric``.

        Returns:
            The indices into ``rule.conditions`` of the conditions whose metric pattern matches, ascending.
        """
        key = (rule.name, family_metric)
        indices = self._reading.get(key)
        if indices is None:
            indices = tuple(i for i, c in enumerate(rule.conditions) if c.matches(family_metric))
            self._reading[key] = indices
        return indices

    def counter_records(self, step: int, rules: Collection[str] | None = None) -> list[Measurement]:
        """The alert counters as records: ``alerts/open/<rule>`` and ``alerts/fired/<rule>`` (cumulative).

        Args:
            step: The step the records carry.
            rules: The names of the rules to report; None for every rule.

        Returns:
            Two :class:`~spectral_monitor.records.Measurement` s per rule (open, then fired), the rule's name
            as their ``layer``, in :attr:`rules` order.
        """
        open_counts = self.open_counts()
        return [
            record
            for rule in self.rules
            if rules is None or rule.name in rules
            for record in (
                Measurement(step, "alerts", "open", rule.name, float(open_counts[rule.name])),
                Measurement(step, "alerts", "fired", rule.name, float(self.fired[rule.name])),
            )
        ]

    def state_dict(self) -> dict[str, Any]:
        """The engine's state as plain data (lists, dicts, str, int, float, bool, None) for a checkpoint.

        Returns:
            ``subjects`` (each rule's streak and open alert per layer or head), ``first`` and ``recent``
            (the baselines of relative conditions, by tag), ``fired`` and ``history``: copies, not views.
        """
        return {
            "subjects": [[*key, asdict(subject)] for key, subject in self._subjects.items()],
            "first": dict(self._first),
            "recent": {tag: list(values) for tag, values in self._recent.items()},
            "fired": dict(self.fired),
            "history": [asdict(event) for event in self.history],
        }

    def load_state_dict(self, state: Mapping[str, Any] | StateEntries) -> list[str]:
        """Restore :meth:`state_dict`'s output, entry by entry: an entry of the wrong type, or a non-finite
        reading, is dropped and that part starts as in a new run. Nothing raises on a bad entry.

        Args:
            state: What :meth:`state_dict` returned, or the same read through the
                :class:`~spectral_monitor.checkpoint_entries.StateEntries` of a whole checkpoint (whose
                ``dropped`` list is then appended to).

        Returns:
            The entries dropped, each named with why (the session warns of them).
        """
        entries = state if isinstance(state, StateEntries) else StateEntries(state)
        self._subjects = entries.read("subjects", {}, _checked_subjects)
        self._first = entries.numbers("first")
        self._recent = entries.by_name("recent", _checked_readings)
        fired = entries.by_name("fired", lambda count: checked_integer(count, smallest=0))
        self.fired = {rule.name: 0 for rule in self.rules} | fired
        self.history = entries.read("history", [], _checked_history)
        return entries.dropped

    def _advance(
        self,
        rule: Rule,
        step: int,
        layer: str,
        head: int | None,
        units: list[_Unit],
        are_heads: bool,
        length: float | None,
        layer_heads: int | None,
    ) -> list[AlertEvent]:
        verdicts = [_verdict(rule, unit) for unit in units]
        evaluated = [
            (unit, verdict)
            for unit, verdict in zip(units, verdicts, strict=True)
            if verdict is not None and not unit.exempt
        ]
        if not evaluated:
            return []
        triggered = [unit for unit, (fires, _) in evaluated if fires]
        holding = [unit for unit, (_, holds) in evaluated if holds]
        needed = rule.head_fraction * len(evaluated) - 1e-9
        subject = self._subjects.setdefault((rule.name, layer, head), _Subject())
        if subject.open:
            read = [unit for unit, _ in evaluated]
            held = subject.held or list(range(len(rule.conditions)))  # a state saved before ``held``
            if len(holding) >= needed or not any(i in unit.values for unit in read for i in held):
                return []  # still holding, or nothing read of what raised it (another family's step)
            subject.open, subject.streak = False, 0
            readings = _readings(rule, read, held=held)
            return [self._event(rule, RESOLVED, step, layer, head, readings, subject.since, None, length)]
        if len(triggered) < needed or not triggered:
            subject.streak = 0
            return []
        subject.streak += 1
        if subject.streak == 1:
            subject.since = step
        if subject.streak < rule.patience:
            return []
        subject.open = True
        self.fired[rule.name] += 1
        readings = _readings(rule, triggered, held=None)
        subject.held = [index for index, _ in readings]
        heads = f"{len(triggered)}/{len(evaluated)}" if are_heads else None
        if heads is not None and layer_heads is not None and layer_heads > len(units):
            heads += f" measured of {layer_heads}"  # a cost budget measured some of the layer's heads
        return [self._event(rule, FIRED, step, layer, head, readings, subject.since, heads, length)]

    @staticmethod
    def _event(
        rule: Rule,
        kind: str,
        step: int,
        layer: str,
        head: int | None,
        readings: list[tuple[int, Reading]],
        since: int,
        heads: str | None,
        length: float | None,
    ) -> AlertEvent:
        first, *also = (reading for _, reading in readings)
        return AlertEvent(
            rule=rule.name,
            kind=kind,
            step=step,
            layer=layer,
            head=head,
            severity=rule.severity,
            metric=first.metric,
            op=first.op,
            value=first.value,
            level=first.level,
            relative_to=first.relative_to,
            since=since,
            heads=heads,
            remedy=_remedy(rule.remedy, length),
            also=tuple(also),
        )

    def _relative_values(self, records: list[Measurement]) -> dict[str, dict[str, float]]:
        """Each record's value over its first value and over its running median, and minus the first layer's
        value in these records (depth), by tag; updates the first values and medians."""
        ratios: dict[str, dict[str, float]] = {"first": {}, "median": {}, "depth": {}}
        first_layer: dict[str, float] = {}
        for record in records:
            family_metric = f"{record.family}/{record.metric}"
            across_depth, over_time = self._read_relatively(family_metric)
            if across_depth and record.head is None:
                baseline = first_layer.setdefault(family_metric, record.value)
                ratios["depth"][record.tag] = record.value - baseline
            if not over_time or not math.isfinite(record.value):
                continue
            tag = record.tag
            first = self._first.setdefault(tag, record.value)
            if first != 0:
                ratios["first"][tag] = record.value / first
            recent = self._recent.setdefault(tag, [])
            if recent:
                median = statistics.median(recent)
                if median != 0:
                    ratios["median"][tag] = record.value / median
            recent.append(record.value)
            del recent[:-MEDIAN_WINDOW]
        return ratios

    def _read_relatively(self, family_metric: str) -> tuple[bool, bool]:
        """Whether some condition reads ``family_metric`` relative to depth, and relative to its past."""
        kinds = self._relative_reads.get(family_metric)
        if kinds is None:
            conditions = [c for rule in self.rules for c in rule.conditions if c.matches(family_metric)]
            kinds = (
                any(c.relative_to == "depth" for c in conditions),
                any(c.relative_to in ("first", "median") for c in conditions),
            )
            self._relative_reads[family_metric] = kinds
        return kinds


CONVERGED_METRIC = "converged"


def _converged_only(records: list[Measurement]) -> list[Measurement]:
    """``records`` less those of each (family, layer) whose ``converged`` record says 0."""
    unconverged = {
        (record.family, record.layer)
        for record in records
        if record.metric == CONVERGED_METRIC and record.value == 0
    }
    if not unconverged:
        return records
    return [
        record
        for record in records
        if record.metric == CONVERGED_METRIC or (record.family, record.layer) not in unconverged
    ]


def _units_of(
    rule: Rule,
    records: list[Measurement],
    relative: dict[str, dict[str, float]],
    conditions_reading: Callable[[Rule, str], tuple[int, ...]],
) -> dict[tuple[str, int | None], tuple[list[_Unit], bool]]:
    """The units each subject of ``rule`` is judged on: (layer, head) -> (units, whether they are heads).

    A layer that wrote no per-head records is one unit, read from its aggregates (``_worst_head_view``).
    """
    by_layer: dict[str, dict[int | None, _Unit]] = {}
    for record in records:
        if not rule.applies_to(record.layer) or (record.head is not None and not rule.read_heads):
            continue
        family_metric = f"{record.family}/{record.metric}"
        if any(e.matches(family_metric) and e.holds(record.value) for e in rule.exempt):
            by_layer.setdefault(record.layer, {}).setdefault(record.head, _Unit()).exempt = True
        for index in conditions_reading(rule, family_metric):
            condition = rule.conditions[index]
            value = record.value
            if condition.relative_to != "value":
                value = relative[condition.relative_to].get(record.tag, math.nan)
            if condition.op != "nonfinite" and not math.isfinite(value):
                continue
            unit = by_layer.setdefault(record.layer, {}).setdefault(record.head, _Unit())
            previous = unit.values.get(index)
            if previous is None or (condition.holds(value) and not condition.holds(previous[1])):
                unit.values[index] = (family_metric, value)
    subjects: dict[tuple[str, int | None], tuple[list[_Unit], bool]] = {}
    for layer, units in by_layer.items():
        heads = {head: unit for head, unit in units.items() if head is not None}
        if rule.scope == "head":
            for head, unit in heads.items():
                subjects[layer, head] = ([unit], False)
        elif heads:
            subjects[layer, None] = (list(heads.values()), True)
        if not heads:
            subjects[layer, None] = ([_worst_head_view(rule, units[None], records, layer)], False)
    return subjects


def _worst_head_view(rule: Rule, unit: _Unit, records: list[Measurement], layer: str) -> _Unit:
    """A layer's unit with ``<metric>_max`` for ``<=`` and ``<metric>_min`` for ``>=`` where those exist:
    the worst head decides whether every head meets a condition; for a rule on any head
    (:attr:`Rule.any_head`) the other way round, the head nearest to meeting it decides."""
    aggregates = {
        f"{record.family}/{record.metric}": record
        for record in records
        if record.layer == layer and record.head is None
    }
    view = _Unit(dict(unit.values), unit.exempt)
    for index, (family_metric, _) in unit.values.items():
        condition = rule.conditions[index]
        suffix = ({">=": "_max", "<=": "_min"} if rule.any_head else {">=": "_min", "<=": "_max"}).get(
            condition.op
        )
        record = aggregates.get(family_metric + suffix) if suffix else None
        if record is None or condition.relative_to != "value" or not math.isfinite(record.value):
            continue
        view.values[index] = (family_metric, record.value)
    return view


def _verdict(rule: Rule, unit: _Unit) -> tuple[bool, bool] | None:
    """(meets the threshold, still meets the clear level) of one unit, or ``None`` if it cannot be judged."""
    present = [(c, unit.values[i][1]) for i, c in enumerate(rule.conditions) if i in unit.values]
    required_missing = any(c.required and i not in unit.values for i, c in enumerate(rule.conditions))
    if not any(c.required for c, _ in present) or (rule.combine == "all" and required_missing):
        return None
    combine = any if rule.combine == "any" else all
    return (
        combine(c.holds(value) for c, value in present),
        combine(c.holds(value, clearing=True) for c, value in present),
    )


def _readings(rule: Rule, units: list[_Unit], *, held: list[int] | None) -> list[tuple[int, Reading]]:
    """(condition index, reading) of the conditions an event names, in the rule's order.

    Fired (``held=None``): every condition that held in some unit, with the value nearest its threshold
    among the units that met it. Resolved: the conditions in ``held`` (those that raised the alert) that the
    units read, with their median over the units, against the clear level.
    """
    named = []
    for index, condition in enumerate(rule.conditions):
        values = [unit.values[index] for unit in units if index in unit.values]
        if not values or (held is not None and index not in held):
            continue
        metric = values[0][0]
        if condition.op == "nonfinite":
            broken = [(name, value) for name, value in values if not math.isfinite(value)]
            if held is None and not broken:
                continue
            metric, value = (broken or values)[0]
        elif held is None:
            met = [value for _, value in values if condition.holds(value)]
            if not met:
                continue
            value = min(met) if condition.op == ">=" else max(met)
        else:
            value = statistics.median(value for _, value in values)
        level = condition.threshold if held is None else condition.clear_level
        named.append((index, Reading(metric, condition.op, value, level, condition.relative_to)))
    if not named:
        raise AssertionError(f"rule {rule.name} was judged on units that read none of its conditions")
    return named


KEYS_METRIC = "keys"
"""A judged-only attention record (never written): the layer's number of keys n, for ``{n}``."""
HEADS_METRIC = "heads"
"""A judged-only attention record (never written): the layer's number of heads, of which a cost budget may
have measured fewer (an alert then says how many)."""


def _attention_lengths(records: list[Measurement]) -> dict[str, float]:
    """Each attention layer's number of keys n (for ``{n}``): its ``keys`` record, else
    effective_rank / effective_rank_ratio."""
    keys, ranks, ratios = {}, {}, {}
    for record in records:
        if record.family == "attention" and record.head is None:
            if record.metric == KEYS_METRIC:
                keys[record.layer] = record.value
            elif record.metric == "effective_rank":
                ranks[record.layer] = record.value
            elif record.metric == "effective_rank_ratio":
                ratios[record.layer] = record.value
    from_ranks = {
        layer: ranks[layer] / ratios[layer]
        for layer in ranks.keys() & ratios.keys()
        if math.isfinite(ranks[layer]) and math.isfinite(ratios[layer]) and ratios[layer] > 0
    }
    return from_ranks | keys


def _attention_heads(records: list[Measurement]) -> dict[str, int]:
    """Each attention layer's number of heads, from its ``heads`` record."""
    return {
        record.layer: int(record.value)
        for record in records
        if record.family == "attention" and record.head is None and record.metric == HEADS_METRIC
    }


_PLACEHOLDER = re.compile(r"\{(n|log_n)\}")


def _remedy(template: str, length: float | None) -> str:
    """``template`` with ``{n}`` and ``{log_n}`` filled in; any other brace is the user's text and stays."""
    if length is None:
        values = {"n": "n", "log_n": "log n"}
    else:
        n = round(length)
        values = {"n": str(n), "log_n": f"{math.log(n):.2f}" if n > 1 else "0"}
    return _PLACEHOLDER.sub(lambda match: values[match[1]], template)

"""The verdict of each diagnosis on a run, judged from the scalars the monitor wrote: the one implementation
that ``spectral-monitor report`` and the TensorBoard tab (:mod:`spectral_monitor.dashboard`) both call.

It reads plain arrays, ``family/metric -> layer -> (steps, values)`` (:data:`Series`), so it does not care
whether they came from TensorBoard's ``EventAccumulator`` (the report) or its data provider (the tab), and
imports neither torch nor a training framework. Each diagnosis of :data:`~spectral_monitor.catalog.DIAGNOSES`
is judged on each layer's latest reading against the catalogue's thresholds; the worst layer decides.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spectral_monitor.alerts.rules import MEDIAN_WINDOW, AlertThreshold
from spectral_monitor.catalog import DIAGNOSES, Diagnosis, MetricInfo, diagnosis

__all__ = [
    "HISTORY_METRICS",
    "HOW_TO_MEASURE",
    "MEDIAN_WINDOW",
    "NOT_FINITE",
    "NOT_MEASURED",
    "OP_WORDS",
    "VERDICTS",
    "AlertRow",
    "Series",
    "Verdict",
    "alert_rows",
    "diagnosis_series",
    "format_number",
    "judge",
    "natural_order",
    "overall_line",
    "relative_levels",
    "relative_phrase",
    "worst",
]

Series = Mapping[str, Mapping[str, tuple[np.ndarray, np.ndarray]]]
"""A run's scalars: ``family/metric`` -> layer -> (steps, values), each in step order."""

VERDICTS = ("healthy", "watch", "collapsed")
"""From best to worst: the latest reading is on the healthy side of the clear level, between the clear
level and the threshold, or past the threshold (where the alert rule fires once it lasts)."""
NOT_MEASURED = "not measured"
"""The verdict of a diagnosis none of whose metrics the run wrote."""
NOT_FINITE = "no finite reading"
"""The verdict of a diagnosis whose metrics the run wrote, but whose latest reading is NaN or inf in every
layer: the model went non-finite (the ``non_finite`` diagnosis says where), so nothing can be judged."""

HOW_TO_MEASURE = {
    "rank_collapse": "measured by default: keep 'attention' in SpectralMonitor(families=...)",
    "uniform_attention": "reads attention/eigen_gap, which only bidirectional (non-causal) attention layers "
    "write: a causal model is never judged on it",
    "entropy_collapse": "measured by default: keep 'attention' in SpectralMonitor(families=...)",
    "logit_growth": "measured by default: keep 'attention' in SpectralMonitor(families=...)",
    "token_collapse": "measured by default: keep 'tokens' in SpectralMonitor(families=...) "
    "(the 'light' preset leaves it out)",
    "edge_of_stability": "opt-in: SpectralMonitor(curvature=CurvatureOptions()) (or preset='full')",
    "jacobian_explosion": "opt-in: SpectralMonitor(jacobian=JacobianOptions())",
    "weight_runaway": "measured by default: keep 'weights' in SpectralMonitor(families=...)",
    "non_finite": "measured whenever attention, tokens, weights or curvature are",
}
"""For a diagnosis the run did not measure: what turns it on."""

HISTORY_METRICS = frozenset(
    info.full_name
    for entry in DIAGNOSES
    for info, threshold in diagnosis(entry.rule)[1]
    if threshold.relative_to in ("first", "median")
)
"""The series whose verdict reads more than their latest point (a first value, a running median); every
other series is judged on its latest point alone (and, for a ``depth`` threshold, the first layer's at the
same step)."""

_RELATIVE_WORDS = {
    "value": "",
    "first": " as a multiple of its first value",
    "median": f" as a multiple of its running median of up to {MEDIAN_WINDOW} readings",
    "depth": " minus the first layer's",
}
OP_WORDS = {">=": "at or above", "<=": "at or below"}
"""A threshold's comparison, in words."""


@dataclass(frozen=True)
class Verdict:
    """The verdict of one diagnosis on a run.

    Attributes:
        diagnosis: what is judged.
        verdict: one of :data:`VERDICTS`, or :data:`NOT_MEASURED`.
        layer: the layer that decided it (the worst one; among equals the nearest its threshold).
        reading: that layer's reading against the levels, in words.
        step: the step of that reading.
        layers: every layer at this verdict, worst first (empty when healthy or not measured).
        metric: the scalar series read (``family/metric``, a head aggregate where written).
        value: the reading compared with the levels (a ratio or difference for relative thresholds).
        collapsed_level: the level past which the verdict is collapsed.
        watch_level: the level past which it is watch (where an open alert clears).
        op: ``">="`` or ``"<="`` (``"nonfinite"`` for the NaN check).
        relative_to: what ``value`` is relative to (``value``, ``first``, ``median``, ``depth``).
        how_to_measure: for a diagnosis not measured, what turns it on.

    Examples:
        A verdict comes from :func:`judge`:

        >>> import numpy as np
        >>> entropy = {"attention/entropy": {"blocks.0.attn": (np.array([0, 10]), np.array([0.6, 0.02]))}}
        >>> verdict = judge(entropy)[2]
        >>> verdict.diagnosis.rule, verdict.verdict, verdict.layer, verdict.step
        ('entropy_collapse', 'collapsed', 'blocks.0.attn', 10)
    """

    diagnosis: Diagnosis
    verdict: str
    layer: str = ""
    reading: str = ""
    step: int | None = None
    layers: tuple[str, ...] = ()
    metric: str = ""
    value: float | None = None
    collapsed_level: float | None = None
    watch_level: float | None = None
    op: str = ""
    relative_to: str = "value"
    how_to_measure: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The verdict as JSON-ready data.

        Returns:
            The verdict's fields by name, the levels under ``"threshold"``, non-finite values as strings.
        """
        return {
            "title": self.diagnosis.title,
            "meaning": self.diagnosis.meaning,
            "verdict": self.verdict,
            "layer": self.layer,
            "layers": list(self.layers),
            "reading": self.reading,
            "step": self.step,
            "metric": self.metric,
            "value": _json_number(self.value),
            "threshold": {
                "op": self.op,
                "collapsed": self.collapsed_level,
                "watch": self.watch_level,
                "relative_to": self.relative_to,
            },
            "how_to_measure": self.how_to_measure,
        }


@dataclass(frozen=True)
class _Judged:
    """One condition judged on one layer's latest reading."""

    state: int  # index in VERDICTS
    margin: float  # how far from the threshold, relative to it: smaller = nearer firing
    text: str
    step: int
    metric: str
    value: float
    threshold: AlertThreshold = field(compare=False)


@dataclass(frozen=True)
class AlertRow:
    """One alert of the open-alerts table the monitor writes as text (``alerts/table``).

    Attributes:
        rule: The alert rule's name.
        severity: The rule's severity.
        where: The layer (or ``family/metric/layer`` series) it fired on.
        since: The first step of the streak that fired it.
        fired_at: The step it fired.
        reading: The reading that fired it, in words.
        remedy: What to try.

    Examples:
        Rows come from :func:`alert_rows`:

        >>> row = AlertRow("entropy_collapse", "warning", "blocks.0.attn", 10, 12, "entropy 0.02", "lower lr")
        >>> row.as_dict()["fired_at"]
        12
    """

    rule: str
    severity: str
    where: str
    since: int
    fired_at: int
    reading: str
    remedy: str

    def as_dict(self) -> dict[str, Any]:
        """The alert as JSON-ready data.

        Returns:
            The alert's fields by name.
        """
        return {
            "rule": self.rule,
            "severity": self.severity,
            "where": self.where,
            "since": self.since,
            "fired_at": self.fired_at,
            "reading": self.reading,
            "remedy": self.remedy,
        }


def alert_rows(tables: Sequence[str]) -> list[AlertRow]:
    """Every alert found in the open-alerts tables ``tables`` (markdown, in step order), each once, in the
    order they fired.

    Args:
        tables: the texts of ``alerts/table``.

    Returns:
        One :class:`AlertRow` per (rule, where, step it fired).

    Examples:
        >>> table = (
        ...     "| rule | severity | where | since | fired at | reading | remedy |\\n"
        ...     "|---|---|---|---|---|---|---|\\n"
        ...     "| entropy_collapse | warning | blocks.0.attn | 10 | 12 | entropy 0.02 | lower lr |"
        ... )
        >>> [(row.rule, row.where, row.fired_at) for row in alert_rows([table, table])]
        [('entropy_collapse', 'blocks.0.attn', 12)]
    """
    found: dict[tuple[str, str, int], AlertRow] = {}
    for table in tables:
        for line in table.splitlines():
            cells = [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
            if len(cells) != 7 or not cells[3].isdigit() or not cells[4].isdigit():
                continue
            row = AlertRow(cells[0], cells[1], cells[2], int(cells[3]), int(cells[4]), cells[5], cells[6])
            found.setdefault((row.rule, row.where, row.fired_at), row)
    return sorted(found.values(), key=lambda row: (row.fired_at, row.rule, natural_order(row.where)))


def judge(series: Series) -> list[Verdict]:
    """A verdict per diagnosis of :data:`~spectral_monitor.catalog.DIAGNOSES`, in that order.

    Each layer's latest reading is compared with the catalogue's thresholds: on attention the worst head
    decides (``_max`` for a ``<=`` threshold, ``_min`` for ``>=``, where written; the other way round for a
    diagnosis of any head); relative thresholds read the run's own first value, running median or first
    layer.

    Args:
        series: the run's scalars (:data:`Series`); per-head series are ignored.

    Returns:
        One :class:`Verdict` per diagnosis.

    Examples:
        >>> import numpy as np
        >>> entropy = {"attention/entropy": {"blocks.0.attn": (np.array([0, 10]), np.array([0.6, 0.02]))}}
        >>> [(verdict.diagnosis.rule, verdict.verdict) for verdict in judge(entropy)][2:4]
        [('entropy_collapse', 'collapsed'), ('logit_growth', 'not measured')]
    """
    return [_verdict(series, entry) for entry in DIAGNOSES]


def worst(judged: Sequence[Verdict]) -> Verdict | None:
    """The worst verdict of ``judged``, the first in diagnosis order among equals.

    Args:
        judged: The verdicts of :func:`judge`.

    Returns:
        The worst measured verdict, ``None`` when nothing was measured.

    Examples:
        >>> import numpy as np
        >>> entropy = {"attention/entropy": {"blocks.0.attn": (np.array([0, 10]), np.array([0.6, 0.02]))}}
        >>> worst(judge(entropy)).diagnosis.rule, worst(judge({}))
        ('entropy_collapse', None)
    """
    measured = [entry for entry in judged if entry.verdict in VERDICTS]
    if not measured:
        return None
    return max(measured, key=lambda entry: (VERDICTS.index(entry.verdict), -judged.index(entry)))


def overall_line(judged: Sequence[Verdict]) -> str:
    """One line saying how the run is.

    Args:
        judged: The verdicts of :func:`judge`.

    Returns:
        The worst verdict, its diagnosis and its layers, with the others at that verdict.

    Examples:
        >>> import numpy as np
        >>> entropy = {"attention/entropy": {"blocks.0.attn": (np.array([0, 10]), np.array([0.6, 0.02]))}}
        >>> overall_line(judge(entropy))
        'COLLAPSED: entropy collapse in blocks.0.attn'
    """
    top = worst(judged)
    if top is None:
        return "NOT MEASURED: the run holds none of the metrics the diagnoses read"
    if top.verdict == "healthy":
        measured = sum(entry.verdict in VERDICTS for entry in judged)
        return f"HEALTHY: every measured diagnosis ({measured} of {len(judged)}) is on the healthy side"
    others = [
        entry.diagnosis.title.lower() for entry in judged if entry.verdict == top.verdict and entry is not top
    ]
    also = f"; also {top.verdict}: {', '.join(others)}" if others else ""
    return f"{top.verdict.upper()}: {top.diagnosis.title.lower()} in {_layers_phrase(top.layers)}{also}"


def relative_phrase(relative_to: str) -> str:
    """What a threshold compares, in words.

    Args:
        relative_to: A threshold's ``relative_to``: ``"value"``, ``"first"``, ``"median"`` or ``"depth"``.

    Returns:
        The words to put after the metric's name (empty for a plain value).

    Raises:
        KeyError: ``relative_to`` is none of those.

    Examples:
        >>> relative_phrase("first")
        ' as a multiple of its first value'
    """
    return _RELATIVE_WORDS[relative_to]


def natural_order(layer: str) -> tuple[tuple[int, int | str], ...]:
    """A sort key putting ``blocks.2`` before ``blocks.10``.

    Args:
        layer: A layer name.

    Returns:
        The key, in which runs of digits compare as numbers.

    Examples:
        >>> sorted(["blocks.10", "blocks.2"], key=natural_order)
        ['blocks.2', 'blocks.10']
    """
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", layer) if part
    )


def _layers_phrase(layers: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(layers[:limit])
    return shown if len(layers) <= limit else f"{shown} and {len(layers) - limit} more layers"


def _verdict(series: Series, entry: Diagnosis) -> Verdict:
    _, reads = diagnosis(entry.rule)
    by_layer: dict[str, list[_Judged | None]] = {}
    for index, (info, threshold) in enumerate(reads):
        for layer, judged in _judged_layers(series, info, threshold, entry.any_head).items():
            by_layer.setdefault(layer, [None] * len(reads))[index] = judged
    decided = []
    for layer, judged in by_layer.items():
        present = [j for j in judged if j is not None]
        if entry.combine == "all":
            if len(present) < len(judged):
                continue  # every condition must hold: a layer missing one (causal eigen_gap) is not judged
            deciding = min(present, key=lambda j: (j.state, -j.margin))
        else:
            deciding = max(present, key=lambda j: (j.state, -j.margin))
        decided.append((layer, deciding))
    if not decided:
        return _not_finite(series, entry) or Verdict(
            entry, NOT_MEASURED, how_to_measure=HOW_TO_MEASURE.get(entry.rule, "")
        )
    ranked = sorted(decided, key=lambda item: (-item[1].state, item[1].margin, natural_order(item[0])))
    layer, top = ranked[0]
    if top.margin == math.inf:  # nothing to come near: every reading of a non-finite check is finite
        reading = f"every reading finite ({len(decided)} layers)"
        return Verdict(entry, VERDICTS[top.state], "", reading, top.step, op="nonfinite")
    threshold = top.threshold
    layers = tuple(name for name, judged in ranked if judged.state == top.state) if top.state else ()
    return Verdict(
        entry,
        VERDICTS[top.state],
        layer,
        top.text,
        top.step,
        layers=layers,
        metric=top.metric,
        value=top.value,
        collapsed_level=threshold.threshold,
        watch_level=threshold.clear if threshold.clear is not None else threshold.threshold,
        op=threshold.op,
        relative_to=threshold.relative_to,
    )


def _not_finite(series: Series, entry: Diagnosis) -> Verdict | None:
    """The :data:`NOT_FINITE` verdict of a diagnosis no layer could be judged on although its series were
    written, where their latest readings are NaN or inf; None where none is (nothing was written)."""
    names = [
        _series_name(info, threshold, entry.any_head, series) for info, threshold in diagnosis(entry.rule)[1]
    ]
    if entry.combine == "all" and not all(name in series for name in names):
        return None  # a condition the run never writes (a causal model's eigen_gap): not measured
    broken: dict[str, tuple[int, int]] = {}  # layer -> (first step of its non-finite tail, latest step)
    for name in names:
        for layer, (steps, values) in series.get(name, {}).items():
            if len(values) and not math.isfinite(float(values[-1])):
                finite = np.flatnonzero(np.isfinite(values))
                start = int(steps[finite[-1] + 1]) if finite.size else int(steps[0])
                broken.setdefault(layer, (start, int(steps[-1])))
        if broken:
            break
    if not broken:
        return None
    since = min(start for start, _ in broken.values())
    latest = max(step for _, step in broken.values())
    layers = tuple(sorted(broken, key=natural_order))
    reading = f"{name} is NaN or inf in {_layers_phrase(layers)} since step {since}: see non-finite values"
    return Verdict(entry, NOT_FINITE, layers[0], reading, latest, layers=layers, metric=name)


def _judged_layers(
    series: Series, info: MetricInfo, threshold: AlertThreshold, any_head: bool
) -> dict[str, _Judged]:
    """Each layer's latest reading of ``info`` judged against ``threshold`` (its worst head, or with
    ``any_head`` the head nearest to meeting it)."""
    name = _series_name(info, threshold, any_head, series)
    by_layer = series.get(name, {})
    judged = {}
    for layer, (steps, values) in by_layer.items():
        if not len(values):
            continue
        latest = float(values[-1])
        if threshold.op == "nonfinite":
            broken = not math.isfinite(latest)
            text = f"{name} is {format_number(latest)}" if broken else f"{name} finite"
            judged[layer] = _Judged(
                2 if broken else 0, 0.0 if broken else math.inf, text, int(steps[-1]), name, latest, threshold
            )
            continue
        value = _relative_value(threshold, by_layer, layer)
        if value is None or not math.isfinite(value):
            continue
        judged[layer] = _judge(name, value, threshold, int(steps[-1]))
    return judged


def diagnosis_series(entry: Diagnosis, available: Collection[str]) -> list[str]:
    """The ``family/metric`` series among ``available`` that ``entry`` is judged on, in catalogue order
    (the NaN check left out: it reads everything).

    Args:
        entry: one of :data:`~spectral_monitor.catalog.DIAGNOSES`.
        available: the ``family/metric`` names a run holds.

    Returns:
        The names read, each once.

    Examples:
        >>> from spectral_monitor.catalog import diagnosis
        >>> diagnosis_series(diagnosis("entropy_collapse")[0], ["attention/entropy", "attention/entropy_min"])
        ['attention/entropy']
    """
    names = [
        _series_name(info, threshold, entry.any_head, available)
        for info, threshold in diagnosis(entry.rule)[1]
        if threshold.op != "nonfinite"
    ]
    return [name for name in dict.fromkeys(names) if name in available]


def _series_name(
    info: MetricInfo, threshold: AlertThreshold, any_head: bool, available: Collection[str]
) -> str:
    """The series a threshold reads: the worst head's aggregate where written (``_max`` of a ``<=``
    condition, ``_min`` of a ``>=`` one; the other way round for a diagnosis of any head), else the mean."""
    aggregate = ({">=": "max", "<=": "min"} if any_head else {">=": "min", "<=": "max"}).get(threshold.op)
    aggregated = f"{info.full_name}_{aggregate}"
    if threshold.relative_to == "value" and aggregate in info.head_aggregates and aggregated in available:
        return aggregated
    return info.full_name


def relative_levels(
    threshold: AlertThreshold, by_layer: Mapping[str, tuple[np.ndarray, np.ndarray]], level: float
) -> dict[str, np.ndarray]:
    """Each layer's ``level`` of a relative ``threshold`` at each of its steps, on the metric's own scale,
    so that a layer's line crosses its own level where its verdict changes: ``level`` times its first finite
    reading (``first``), times the median of its previous finite readings, up to :data:`MEDIAN_WINDOW`, as
    the alert engine keeps them (``median``), or the first layer's reading at that step plus ``level``
    (``depth``). NaN where there is no baseline yet.

    Args:
        threshold: A threshold whose ``relative_to`` is ``first``, ``median`` or ``depth``.
        by_layer: The metric's series, layer -> (steps, values).
        level: The threshold's level or its clear level.

    Returns:
        layer -> levels, aligned with that layer's steps.

    Raises:
        ValueError: ``threshold`` is on the metric's own values (``relative_to="value"``).

    Examples:
        >>> import numpy as np
        >>> from spectral_monitor.catalog import diagnosis
        >>> (_, median), = diagnosis("entropy_collapse")[1][1:]  # entropy <= 0.3 x its running median
        >>> entropy = {"blocks.0": (np.arange(4), np.array([0.8, 0.6, 0.7, 0.1]))}
        >>> relative_levels(median, entropy, median.threshold)["blocks.0"].round(3).tolist()
        [nan, 0.24, 0.21, 0.21]
    """
    levels = {}
    for layer, (steps, values) in by_layer.items():
        finite = np.isfinite(values)
        if threshold.relative_to == "first":
            first = values[finite][0] if finite.any() else math.nan
            levels[layer] = np.full(len(values), level * first if first != 0 else math.nan)
        elif threshold.relative_to == "median":
            medians = _running_medians(values[finite])[np.cumsum(finite) - finite]
            levels[layer] = level * np.where(medians != 0, medians, math.nan)
        elif threshold.relative_to == "depth":
            first_steps, first_values = by_layer[min(by_layer, key=natural_order)]
            at = dict(zip(first_steps.tolist(), first_values.tolist(), strict=True))
            levels[layer] = np.array([at.get(step, math.nan) + level for step in steps.tolist()])
        else:
            raise ValueError(
                f"threshold.relative_to must be first, median or depth, got {threshold.relative_to!r}"
            )
    return levels


def _running_medians(readings: np.ndarray) -> np.ndarray:
    """Entry c: the median of the last :data:`MEDIAN_WINDOW` of the first c ``readings`` (fewer where c is
    smaller), NaN for c = 0; c runs to ``len(readings)``."""
    medians = np.full(len(readings) + 1, math.nan)
    for count in range(1, min(MEDIAN_WINDOW, len(readings) + 1)):
        medians[count] = np.median(readings[:count])
    if len(readings) >= MEDIAN_WINDOW:
        windows = np.lib.stride_tricks.sliding_window_view(readings, MEDIAN_WINDOW)
        medians[MEDIAN_WINDOW:] = np.median(windows, axis=1)
    return medians


def _relative_value(
    threshold: AlertThreshold, by_layer: Mapping[str, tuple[np.ndarray, np.ndarray]], layer: str
) -> float | None:
    """The latest value of ``layer`` as ``threshold`` compares it, ``None`` where it has no baseline."""
    steps, values = by_layer[layer]
    latest = float(values[-1])
    finite = values[np.isfinite(values)]
    if threshold.relative_to == "first":
        return latest / float(finite[0]) if finite.size and finite[0] != 0 else None
    if threshold.relative_to == "median":
        previous = values[:-1][np.isfinite(values[:-1])][-MEDIAN_WINDOW:]
        median = float(np.median(previous)) if previous.size else 0.0
        return latest / median if median != 0 else None
    if threshold.relative_to == "depth":
        first_layer = min(by_layer, key=natural_order)
        first_steps, first_values = by_layer[first_layer]
        at_step = first_values[first_steps == steps[-1]]
        return latest - float(at_step[-1]) if at_step.size else None
    return latest


def _judge(name: str, value: float, threshold: AlertThreshold, step: int) -> _Judged:
    level = threshold.threshold
    clear = threshold.clear if threshold.clear is not None else level
    holds = (lambda v, t: v >= t) if threshold.op == ">=" else (lambda v, t: v <= t)
    state = 2 if holds(value, level) else 1 if holds(value, clear) else 0
    margin = (value - level if threshold.op == "<=" else level - value) / max(abs(level), 1e-12)
    op = OP_WORDS[threshold.op]
    text = (
        f"{name}{relative_phrase(threshold.relative_to)} {format_number(value)} "
        f"(collapsed {op} {level:g}, watch {op} {clear:g})"
    )
    return _Judged(state, margin, text, step, name, value, threshold)


def format_number(value: float) -> str:
    """A number as the report writes it.

    Args:
        value: The number.

    Returns:
        Three decimals, or three significant digits in scientific notation when very large or small.

    Examples:
        >>> format_number(0.5), format_number(1234.5), format_number(float("nan"))
        ('0.500', '1.23e+03', 'nan')
    """
    if not math.isfinite(value):
        return str(value)
    return f"{value:.3g}" if abs(value) >= 1000 or (value != 0 and abs(value) < 0.001) else f"{value:.3f}"


def _json_number(value: float | None) -> float | str | None:
    return value if value is None or math.isfinite(value) else str(value)

"""The catalogue of every metric the monitor writes: what it means, its range, which way is healthy, what
collapse looks like, where it comes from, where the dashboard shows it and which alert thresholds read it.

The entries are :data:`CATALOG` and :data:`DIAGNOSES` (defined in :mod:`spectral_monitor.catalog_entries`,
re-exported here); this module answers questions about them: which entry a tag's ``family/metric`` names,
which names the monitor can write, which dashboard group and which diagnosis reads a metric. Plain data with
no dependency on torch or Lightning: the TensorBoard layout
(:func:`spectral_monitor.sinks.layout.diagnosis_layout`), ``spectral-monitor report``, the validation of
alert rules and the metrics reference page (``python -m spectral_monitor.catalog`` writes
``docs/metrics.md``) all read it. The definitions themselves live in :mod:`spectral_monitor.metrics` and
the probes; a scalar tag is ``family/metric/layer[/head_h]`` (``spectral_monitor.records.Measurement.tag``).
The alert thresholds are not copied here: each is defined once, by its rule in
:mod:`spectral_monitor.alerts.rules`, and :attr:`MetricInfo.thresholds` and :data:`DIAGNOSES` read them from
:func:`~spectral_monitor.alerts.default_rules`.

Per attention layer the monitor writes every metric's mean over heads, and ``<metric>_min`` /
``<metric>_max`` over heads only where :attr:`MetricInfo.head_aggregates` says the spread diagnoses
something; each head's own value as a scalar only with ``SpectralMonitor(per_head=True)``.
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import re
from pathlib import Path
from typing import TYPE_CHECKING

from spectral_monitor.catalog_entries import (
    _AGGREGATES,
    _HEAD_SAMPLE_ERROR,
    _NUMBERED,
    CATALOG,
    DIAGNOSES,
    FAMILY_GROUPS,
    GROUPS,
    HEALTHY_DIRECTIONS,
    Diagnosis,
    MetricInfo,
)

if TYPE_CHECKING:
    from spectral_monitor.alerts.rules import AlertThreshold

__all__ = [
    "CATALOG",
    "DIAGNOSES",
    "FAMILY_GROUPS",
    "GROUPS",
    "HEALTHY_DIRECTIONS",
    "Diagnosis",
    "MetricInfo",
    "close_metric_names",
    "diagnosis",
    "diagnosis_metrics",
    "group_of",
    "histogram_metrics",
    "is_known_metric",
    "layer_head_heatmap_metrics",
    "metric_info",
    "metric_names",
    "metrics_markdown",
]


def _numbered_regex(name: str) -> re.Pattern[str]:
    return re.compile(re.escape(name).replace(re.escape(_NUMBERED), "[1-9][0-9]*"))


_BY_NAME = {(info.family, info.name): info for info in CATALOG}
_NUMBERED_NAMES = [(info, _numbered_regex(info.name)) for info in CATALOG if _NUMBERED in info.name]


def metric_info(family: str, name: str) -> MetricInfo:
    """The entry of ``family/name``.

    A head aggregate (``entropy_min``) or a per-layer mean's standard error under head sampling
    (``entropy_head_se``) gives its metric's entry, a member of a numbered series
    (``hessian_eigenvalue_3``) the series' entry.

    Args:
        family: The first part of the tag (``attention``, ``tokens``, ...).
        name: The second part.

    Returns:
        The :class:`MetricInfo` of the metric.

    Raises:
        KeyError: The monitor does not write such a metric; the message names close names.

    Examples:
        >>> metric_info("attention", "entropy_min").name
        'entropy'
        >>> metric_info("curvature", "hessian_eigenvalue_3").name
        'hessian_eigenvalue_<k>'
        >>> try:
        ...     metric_info("attention", "entropie")
        ... except KeyError as error:
        ...     print(error.args[0])
        attention/entropie is not a metric spectral-monitor writes; did you mean attention/entropy,
        attention/entropy_min, attention/entropy_max?
    """
    info = _lookup(family, name)
    if info is None:
        suggestions = close_metric_names(f"{family}/{name}")
        hint = f"; did you mean {', '.join(suggestions)}?" if suggestions else ""
        raise KeyError(f"{family}/{name} is not a metric spectral-monitor writes{hint}")
    return info


def metric_names() -> list[str]:
    """Every ``family/metric`` name the monitor writes scalars under, head aggregates included.

    Returns:
        The names in catalogue order, each metric followed by its head aggregates; a numbered series once,
        as ``curvature/hessian_eigenvalue_<k>``.

    Examples:
        >>> metric_names()[:3]
        ['attention/entropy', 'attention/entropy_min', 'attention/entropy_max']
        >>> "curvature/hessian_eigenvalue_<k>" in metric_names()
        True
    """
    return [name for info in CATALOG for name in info.written_names]


def group_of(family_metric: str) -> str | None:
    """The dashboard group of a ``family/metric`` name, head aggregates included.

    Args:
        family_metric: ``family/metric``, as in a tag.

    Returns:
        One of :data:`GROUPS`: the entry's group, or for a name the catalogue does not list its family's
        group (:data:`FAMILY_GROUPS`); ``None`` where neither is known.

    Examples:
        >>> group_of("attention/entropy_max"), group_of("weights/new_metric")
        ('Entropy', 'Weights')
        >>> group_of("attention/new_metric") is None  # attention's metrics split between two groups
        True
    """
    family, _, name = family_metric.partition("/")
    info = _lookup(family, name)
    return FAMILY_GROUPS.get(family) if info is None else info.group


def diagnosis(rule: str) -> tuple[Diagnosis, list[tuple[MetricInfo, AlertThreshold]]]:
    """The diagnosis of a default rule and each condition it puts on the catalogue's metrics.

    Args:
        rule: The name of a default alert rule (one of :data:`DIAGNOSES`' rules).

    Returns:
        Its :class:`Diagnosis`, and each (metric entry, threshold) the rule reads, in catalogue order.

    Raises:
        KeyError: ``rule`` is not a default rule.

    Examples:
        >>> entry, reads = diagnosis("entropy_collapse")
        >>> entry.title, sorted({info.full_name for info, _ in reads})
        ('Entropy collapse', ['attention/entropy'])
    """
    found = next((entry for entry in DIAGNOSES if entry.rule == rule), None)
    if found is None:
        raise KeyError(f"{rule!r} is not a default rule; the diagnoses are {[d.rule for d in DIAGNOSES]}")
    return found, [(info, t) for info in CATALOG for t in info.thresholds if t.rule == rule]


def diagnosis_metrics() -> tuple[str, ...]:
    """The ``family/metric`` names the diagnoses read, head aggregates included.

    Returns:
        The names in the order of :data:`DIAGNOSES` (the order in which the dashboard shows them first),
        each once; the non-finite check, which reads every metric, adds none.

    Examples:
        >>> "attention/entropy" in diagnosis_metrics(), "attention/stable_rank" in diagnosis_metrics()
        (True, False)
    """
    return tuple(
        dict.fromkeys(
            name
            for entry in DIAGNOSES
            for info, threshold in diagnosis(entry.rule)[1]
            if threshold.op != "nonfinite"
            for name in info.written_names
        )
    )


def histogram_metrics(family: str) -> tuple[str, ...]:
    """The metrics of ``family`` whose per-head values are written as histograms.

    Args:
        family: The first part of the tags (``attention``, ...).

    Returns:
        Their names, in catalogue order; empty for a family without per-head histograms.

    Examples:
        >>> "entropy" in histogram_metrics("attention"), histogram_metrics("curvature")
        (True, ())
    """
    return tuple(info.name for info in CATALOG if info.family == family and info.histogram)


def layer_head_heatmap_metrics() -> tuple[str, ...]:
    """The attention metrics drawn as layer × head images on figure steps.

    Returns:
        Their names, in catalogue order.

    Examples:
        >>> "entropy" in layer_head_heatmap_metrics(), "sigma2" in layer_head_heatmap_metrics()
        (True, False)
    """
    return tuple(info.name for info in CATALOG if info.family == "attention" and info.heatmap)


def is_known_metric(pattern: str) -> bool:
    """Whether the monitor can write a scalar matching ``pattern``.

    Args:
        pattern: An ``fnmatch`` pattern over ``family/metric`` or ``family/metric/layer[/head_h]``; layers
            are the model's own, so any layer part matches.

    Returns:
        True where a name of :func:`metric_names` matches (a numbered series by any member).

    Examples:
        >>> is_known_metric("attention/entropy*/layers.0"), is_known_metric("curvature/hessian_eigenvalue_2")
        (True, True)
        >>> is_known_metric("attention/entropie")
        False
    """
    family_metric = "/".join(pattern.split("/")[:2])
    return any(_matches(name, family_metric) for name in metric_names())


def close_metric_names(pattern: str, limit: int = 3) -> list[str]:
    """The ``family/metric`` names close to ``pattern``, for a "did you mean".

    Args:
        pattern: A name or pattern; a layer part after ``family/metric`` is ignored.
        limit: The most names to return.

    Returns:
        Up to ``limit`` names of :func:`metric_names`, closest first (``difflib`` ratio at least 0.6).

    Examples:
        >>> close_metric_names("attention/entropie/layers.0", limit=1)
        ['attention/entropy']
    """
    family_metric = "/".join(pattern.split("/")[:2])
    return difflib.get_close_matches(family_metric, metric_names(), n=limit, cutoff=0.6)


def metrics_markdown() -> str:
    """The metrics reference page (``docs/metrics.md``), rendered from :data:`CATALOG` and :data:`DIAGNOSES`.

    Returns:
        The page as Markdown: a table per family, with each metric's default alert thresholds, and a table
        of the diagnoses.

    Examples:
        >>> page = metrics_markdown()
        >>> page.splitlines()[0], "## Diagnoses" in page
        ('# Metrics reference', True)
    """
    lines = [
        "# Metrics reference",
        "",
        "<!-- Generated by `python -m spectral_monitor.catalog` from spectral_monitor/catalog_entries.py; "
        "edit that, not this page. -->",
        "",
        "Every scalar the monitor writes is tagged `family/metric/layer[/head_h]`. A is one attention matrix "
        "(n queries × m keys, rows summing to 1 after masking), σ₁ ≥ σ₂ ≥ … its singular values; X the "
        "residual-stream states of one sequence (n × d); W a weight (N × M). The definitions are the "
        "functions of `spectral_monitor.metrics`; this page is generated from `spectral_monitor.catalog`, "
        "which the dashboard layout, `spectral-monitor report` and the alert rules read too.",
        "",
        "Per attention layer the monitor writes each metric's mean over heads; `<metric>_min` and "
        "`<metric>_max` over heads only where the spread diagnoses something (column *head spread*); each "
        "head's own value as a scalar only with `SpectralMonitor(per_head=True)`. Per-head detail is always "
        "in the histograms `<family>/<metric>_per_head/<layer>` and, on figure steps, the layer × head "
        "images `attention/figures/<metric>`.",
        "",
        "*Healthy*: which way the metric is healthy (`middle`: away from both ends; `steady`: slow change, "
        "its trend matters; `none`: a reading, not a judgement).",
    ]
    for family in dict.fromkeys(info.family for info in CATALOG):
        entries = [info for info in CATALOG if info.family == family]
        lines += ["", f"## {family}", "", f"Tags `{family}/<metric>/<layer>`, the layer being the "
                  f"{entries[0].layer}.", ""]  # fmt: skip
        lines += [
            "| metric | definition | range | healthy | trouble | reference | group | written | head spread "
            "| alert thresholds |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for info in entries:
            spread = ", ".join(f"`_{aggregate}`" for aggregate in info.head_aggregates)
            extras = [word for word, on in (("histogram", info.histogram), ("heatmap", info.heatmap)) if on]
            if extras:
                spread = "; ".join(filter(None, [spread, ", ".join(extras)]))
            cells = [
                f"`{info.name}`",
                f"{info.meaning}. *Accuracy*: {info.accuracy}" if info.accuracy else info.meaning,
                info.range,
                info.healthy,
                info.collapse,
                info.reference,
                info.group,
                info.written,
                spread,
                "; ".join(threshold.describe() for threshold in info.thresholds),
            ]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    lines += ["", "## Diagnoses", "", "What `spectral-monitor report` gives a verdict on, one per default "
              "alert rule: *collapsed* where the latest reading meets the threshold, *watch* where it is "
              "between the threshold and the clear level, *healthy* otherwise. On attention the worst head "
              "decides (`_max` of a `<=` condition, `_min` of a `>=` one); for a diagnosis of any head, the "
              "head nearest to firing (`_max` of a `>=` condition).", "",
              "| diagnosis | rule | reads | conditions combine |", "|---|---|---|---|"]  # fmt: skip
    for entry in DIAGNOSES:
        _, reads = diagnosis(entry.rule)
        read = "; ".join(
            f"`{info.full_name}` {threshold.describe().split(': ', 1)[1]}" for info, threshold in reads
        )
        lines.append(f"| {entry.title}: {entry.meaning} | `{entry.rule}` | {read} | {entry.combine} |")
    return "\n".join(lines) + "\n"


def _lookup(family: str, name: str) -> MetricInfo | None:
    info = _BY_NAME.get((family, name))
    if info is None and name.endswith(_HEAD_SAMPLE_ERROR):
        base = _BY_NAME.get((family, name.removesuffix(_HEAD_SAMPLE_ERROR)))
        if base is not None and base.per_head:
            return base
    if info is None:
        for aggregate in _AGGREGATES:
            base = _BY_NAME.get((family, name.removesuffix(f"_{aggregate}")))
            if base is not None and name.endswith(f"_{aggregate}") and aggregate in base.head_aggregates:
                return base
        info = next(
            (entry for entry, regex in _NUMBERED_NAMES if entry.family == family and regex.fullmatch(name)),
            None,
        )
    return info


def _matches(name: str, pattern: str) -> bool:
    if _NUMBERED not in name:
        return fnmatch.fnmatchcase(name, pattern)
    examples = (name, name.replace(_NUMBERED, "1"), name.replace(_NUMBERED, "12"))
    return any(fnmatch.fnmatchcase(example, pattern) for example in examples) or bool(
        _numbered_regex(name).fullmatch(pattern)
    )


def main(argv: list[str] | None = None) -> int:
    """Write the metrics reference page (default ``docs/metrics.md`` of the source checkout)."""
    parser = argparse.ArgumentParser(description="Write the metrics reference page from the catalogue.")
    default = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
    parser.add_argument("--out", type=Path, default=default, help="the page to write (default: %(default)s)")
    arguments = parser.parse_args(argv)
    arguments.out.write_text(metrics_markdown(), encoding="utf-8")
    print(f"wrote {arguments.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

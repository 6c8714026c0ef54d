"""The monitor's TensorBoard tab: a health summary per run and per-layer charts with their thresholds.

TensorBoard finds :class:`SpectralMonitorPlugin` through the ``tensorboard_plugins`` entry point and shows
its static ES-module frontend (``static/index.js``) in an iframe. The backend reads the runs through
TensorBoard's data provider, as TensorBoard's own Scalars tab does (sampled the same way: at most the
``scalars`` sampling hint, 1,000 by default, per series, always with the latest point), and judges them
with :mod:`spectral_monitor.judging`, the code ``spectral-monitor report`` runs. Only the series a verdict
reads the history of (:data:`~spectral_monitor.judging.HISTORY_METRICS`, the alert counters) are read
whole, the others' latest point alone, and a run is judged again only when its series move on. Routes,
under ``/data/plugin/spectral_monitor/``:

- ``verdicts``: ``{run: {rule: verdict}}``, each verdict as :meth:`~spectral_monitor.judging.Verdict.as_dict`
  with the alerts of that rule that fired (``alerts``: step, where, reading, remedy);
- ``summary``: ``{run: {overall, worst, verdicts, charts, more}}``: the overall line, the verdicts in
  diagnosis order, the charts to draw first (per diagnosis, the series it is judged on) and the other
  metrics of the run;
- ``chart?run=R&metric=family/metric``: one chart's per-layer series (at most :data:`CHART_POINTS` points
  each) with its thresholds; ``&layer=L`` gives that layer's per-head series instead.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tensorboard import context as tb_context
from tensorboard import plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from spectral_monitor.catalog import CATALOG, DIAGNOSES, diagnosis, metric_info
from spectral_monitor.judging import (
    HISTORY_METRICS,
    NOT_MEASURED,
    AlertRow,
    Verdict,
    alert_rows,
    diagnosis_series,
    judge,
    natural_order,
    overall_line,
    relative_levels,
    worst,
)

__all__ = ["CHART_POINTS", "PLUGIN_NAME", "SpectralMonitorPlugin"]

PLUGIN_NAME = "spectral_monitor"
"""The tab's name in TensorBoard, and the route prefix of its data."""
CHART_POINTS = 400
"""Points per layer of a chart: a chart is a few hundred pixels wide."""
SCALARS_PLUGIN = "scalars"
TEXT_PLUGIN = "text"
ALERT_TABLE_TAG = "alerts/table/text_summary"
DEFAULT_SCALAR_SAMPLES = 1000
"""What TensorBoard keeps of a scalar series unless ``--samples_per_plugin scalars=N`` says otherwise."""

_STATIC = Path(__file__).resolve().parent / "static"
_PER_HEAD = re.compile(r"^(.*)/head_(\d+)$")
_FAMILIES = frozenset(info.family for info in CATALOG)


class SpectralMonitorPlugin(base_plugin.TBPlugin):
    """The ``spectral_monitor`` tab of TensorBoard.

    Args:
        context: TensorBoard's ``TBContext``; its ``data_provider`` is read and its ``sampling_hints``
            (``--samples_per_plugin``) bound how many points of a series are read.

    Examples:
        TensorBoard makes the plugin from its entry point; without a data provider it has nothing to show:

        >>> from tensorboard.plugins import base_plugin
        >>> plugin = SpectralMonitorPlugin(base_plugin.TBContext(data_provider=None))
        >>> sorted(plugin.get_plugin_apps()), plugin.is_active()
        (['/chart', '/index.js', '/style.css', '/summary', '/verdicts'], False)
    """

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._data_provider = context.data_provider
        self._samples = (context.sampling_hints or {}).get(SCALARS_PLUGIN, DEFAULT_SCALAR_SAMPLES)
        # (experiment, run) -> (the judged series' last steps and times, what was judged from them)
        self._cache: dict[tuple[str, str], tuple[tuple, tuple]] = {}

    def get_plugin_apps(self) -> dict[str, Any]:
        """The tab's routes.

        Returns:
            Each route under ``/data/plugin/spectral_monitor`` → the WSGI application serving it.
        """
        return {
            "/index.js": self._serve_static,
            "/style.css": self._serve_static,
            "/verdicts": self._serve_verdicts,
            "/summary": self._serve_summary,
            "/chart": self._serve_chart,
        }

    def is_active(self) -> bool:
        """Whether TensorBoard shows the tab.

        Returns:
            Whether any run holds a scalar of the monitor's.
        """
        if self._data_provider is None:
            return False
        listing = self._data_provider.list_scalars(
            tb_context.RequestContext(), experiment_id="", plugin_name=SCALARS_PLUGIN
        )
        return any(monitor_metric(tag) for tags in listing.values() for tag in tags)

    def data_plugin_names(self) -> tuple[str, ...]:
        """The summary plugins whose data activates the tab.

        Returns:
            No plugin: the monitor writes plain scalars, and whether they are the monitor's is decided by
            :meth:`is_active`.
        """
        return ()

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        """How TensorBoard loads the tab.

        Returns:
            The ES module of the frontend and the tab's title.
        """
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="Spectral monitor")

    def run_verdicts(self, ctx: tb_context.RequestContext, experiment: str) -> dict[str, dict[str, Any]]:
        """Each run's verdicts, the ``verdicts`` route's answer.

        Args:
            ctx: The request's context.
            experiment: The experiment id (empty for a logdir).

        Returns:
            ``{run: {rule: verdict}}``, each verdict as :meth:`~spectral_monitor.judging.Verdict.as_dict`
            with the alerts of that rule that fired (``alerts``).
        """
        return {
            run: {
                entry.diagnosis.rule: {**entry.as_dict(), "alerts": alerts[entry.diagnosis.rule]}
                for entry in judged
            }
            for run, (judged, alerts, _) in self._judged_runs(ctx, experiment).items()
        }

    def run_summary(self, ctx: tb_context.RequestContext, experiment: str) -> dict[str, dict[str, Any]]:
        """Each run's summary, the ``summary`` route's answer.

        Args:
            ctx: The request's context.
            experiment: The experiment id (empty for a logdir).

        Returns:
            ``{run: {overall, worst, verdicts, charts, more}}``: the overall line, the worst verdict, the
            verdicts in diagnosis order, the charts to draw first (per diagnosis, the series it is judged
            on) and the run's other metrics.
        """
        summary = {}
        for run, (judged, alerts, metrics) in self._judged_runs(ctx, experiment).items():
            charts = [
                {"rule": entry.diagnosis.rule, "title": entry.diagnosis.title,
                 "metrics": diagnosis_series(entry.diagnosis, metrics)}
                for entry in judged
                if entry.verdict != NOT_MEASURED
            ]  # fmt: skip
            first = {name for chart in charts for name in chart["metrics"]}
            top = worst(judged)
            summary[run] = {
                "overall": overall_line(judged),
                "worst": NOT_MEASURED if top is None else top.verdict,
                "verdicts": [
                    {"rule": entry.diagnosis.rule, **entry.as_dict(), "alerts": alerts[entry.diagnosis.rule]}
                    for entry in judged
                ],
                "charts": [chart for chart in charts if chart["metrics"]],
                "more": sorted(metrics - first - {"alerts/open", "alerts/fired"}),
            }
        return summary

    def _judged_runs(
        self, ctx: tb_context.RequestContext, experiment: str
    ) -> dict[str, tuple[list[Verdict], dict[str, list[dict[str, Any]]], set[str]]]:
        """Each run's verdicts, the alerts of each rule, and the metrics it holds; a run whose judged series
        have not changed since the last request is not read again."""
        listing = self._monitor_tags(ctx, experiment)
        judged_runs, stale = {}, {}
        for run, tags in listing.items():
            judged = {tag: series for tag, series in tags.items() if _judged_metric(tag)}
            version = tuple(
                sorted((tag, series.max_step, series.max_wall_time) for tag, series in judged.items())
            )
            cached = self._cache.get((experiment, run))
            if cached is not None and cached[0] == version:
                judged_runs[run] = cached[1]
            else:
                stale[run] = (version, list(judged))
        if stale:
            # Only the series judged on their history are read whole; the others need their latest point.
            history = {run: [t for t in tags if _needs_history(t)] for run, (_, tags) in stale.items()}
            latest = {run: [t for t in tags if not _needs_history(t)] for run, (_, tags) in stale.items()}
            scalars = self._read(ctx, experiment, history, self._samples)
            for run, last in self._read_last(ctx, experiment, latest).items():
                scalars.setdefault(run, {}).update({tag: [datum] for tag, datum in last.items()})
            tables = self._alerts(ctx, experiment, list(stale))
            for run, (version, _) in stale.items():
                series = _series(scalars.get(run, {}))
                counted = _fired_steps(series.get("alerts/fired", {}))
                rows = tables.get(run, [])
                alerts = {entry.rule: _alerts_of(entry.rule, rows, counted) for entry in DIAGNOSES}
                metrics = {monitor_metric(tag) for tag in listing[run]} - {None}
                judged_runs[run] = (judge(series), alerts, metrics)
                self._cache[(experiment, run)] = (version, judged_runs[run])
        return {run: judged_runs[run] for run in sorted(judged_runs)}

    def chart(
        self, ctx: tb_context.RequestContext, experiment: str, run: str, metric: str, layer: str | None
    ) -> dict[str, Any]:
        """One chart of a run, the ``chart`` route's answer.

        Args:
            ctx: The request's context.
            experiment: The experiment id (empty for a logdir).
            run: The run.
            metric: The ``family/metric`` drawn.
            layer: ``None`` for one line per layer; a layer for one line per head of that layer.

        Returns:
            The run, the metric, its lines in natural layer order (steps and values, at most
            :data:`CHART_POINTS` points each), its alert thresholds and what it means.
        """
        tags = self._monitor_tags(ctx, experiment).get(run, {})
        if layer is None:
            wanted = [tag for tag in tags if monitor_metric(tag) == metric]
        else:
            prefix = f"{_per_head_metric(metric)}/{layer}/head_"
            wanted = [tag for tag in tags if tag.startswith(prefix) and tag[len(prefix) :].isdigit()]
        data = self._read(ctx, experiment, {run: wanted}, CHART_POINTS).get(run, {})
        start = len(metric if layer is None else _per_head_metric(metric)) + 1
        series = {
            tag[start:]: (
                np.array([d.step for d in points]),
                np.array([d.value for d in points], dtype=float),
            )
            for tag, points in data.items()
        }
        order = sorted(series, key=natural_order)
        return {
            "run": run,
            "metric": metric,
            "layer": layer,
            "lines": [
                {"name": name, "steps": series[name][0].tolist(), "values": _numbers(series[name][1])}
                for name in order
            ],
            "thresholds": _thresholds(metric, series),
            "meaning": _meaning(metric),
        }

    def _monitor_tags(
        self, ctx: tb_context.RequestContext, experiment: str
    ) -> dict[str, dict[str, provider.ScalarTimeSeries]]:
        """The scalars of the monitor's families of each run holding any of the monitor's metrics."""
        listing = self._data_provider.list_scalars(ctx, experiment_id=experiment, plugin_name=SCALARS_PLUGIN)
        runs = {
            run: {tag: series for tag, series in tags.items() if _monitor_family(tag)}
            for run, tags in listing.items()
        }
        return {run: tags for run, tags in runs.items() if any(monitor_metric(tag) for tag in tags)}

    def _read_last(
        self, ctx: tb_context.RequestContext, experiment: str, wanted: Mapping[str, Iterable[str]]
    ) -> dict[str, dict[str, provider.ScalarDatum]]:
        runs = [run for run, tags in wanted.items() if tags]
        tags = sorted({tag for run in runs for tag in wanted[run]})
        if not tags:
            return {}
        return self._data_provider.read_last_scalars(
            ctx,
            experiment_id=experiment,
            plugin_name=SCALARS_PLUGIN,
            run_tag_filter=provider.RunTagFilter(runs=runs, tags=tags),
        )

    def _read(
        self,
        ctx: tb_context.RequestContext,
        experiment: str,
        wanted: Mapping[str, Iterable[str]],
        points: int,
    ) -> dict[str, dict[str, list[provider.ScalarDatum]]]:
        runs = [run for run, tags in wanted.items() if tags]
        tags = sorted({tag for run in runs for tag in wanted[run]})
        if not tags:
            return {}
        return self._data_provider.read_scalars(
            ctx,
            experiment_id=experiment,
            plugin_name=SCALARS_PLUGIN,
            downsample=points,
            run_tag_filter=provider.RunTagFilter(runs=runs, tags=tags),
        )

    def _alerts(self, ctx: tb_context.RequestContext, experiment: str, runs: list[str]) -> dict[str, list]:
        """Each run's alerts found in the open-alerts tables TensorBoard kept."""
        if not runs:
            return {}
        tables = self._data_provider.read_tensors(
            ctx,
            experiment_id=experiment,
            plugin_name=TEXT_PLUGIN,
            downsample=DEFAULT_SCALAR_SAMPLES,
            run_tag_filter=provider.RunTagFilter(runs=runs, tags=[ALERT_TABLE_TAG]),
        )
        return {
            run: alert_rows([_text(datum.numpy) for datum in by_tag.get(ALERT_TABLE_TAG, [])])
            for run, by_tag in tables.items()
        }

    @wrappers.Request.application
    def _serve_static(self, request: wrappers.Request) -> wrappers.Response:
        name = request.path.rsplit("/", 1)[-1]
        mimetype = {"js": "text/javascript", "css": "text/css"}[name.rsplit(".", 1)[-1]]
        return http_util.Respond(request, (_STATIC / name).read_text(encoding="utf-8"), mimetype)

    @wrappers.Request.application
    def _serve_verdicts(self, request: wrappers.Request) -> wrappers.Response:
        ctx, experiment = plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)
        return _json(request, self.run_verdicts(ctx, experiment))

    @wrappers.Request.application
    def _serve_summary(self, request: wrappers.Request) -> wrappers.Response:
        ctx, experiment = plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)
        return _json(request, self.run_summary(ctx, experiment))

    @wrappers.Request.application
    def _serve_chart(self, request: wrappers.Request) -> wrappers.Response:
        run, metric = request.args.get("run"), request.args.get("metric")
        if run is None or metric is None:
            return http_util.Respond(request, "chart needs run= and metric=", "text/plain", code=400)
        ctx, experiment = plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)
        return _json(request, self.chart(ctx, experiment, run, metric, request.args.get("layer")))


@functools.lru_cache(maxsize=4096)
def monitor_metric(tag: str) -> str | None:
    """The ``family/metric`` of a per-layer scalar the monitor writes (``None`` for a per-head scalar or
    anything else)."""
    if _PER_HEAD.match(tag):
        return None
    family, _, rest = tag.partition("/")
    name, _, layer = rest.partition("/")
    if not layer or family not in _FAMILIES:
        return None
    try:
        metric_info(family, name)
    except KeyError:
        return None
    return f"{family}/{name}"


def _monitor_family(tag: str) -> bool:
    return tag.partition("/")[0] in _FAMILIES


@functools.lru_cache(maxsize=4096)
def _judged_metric(tag: str) -> bool:
    metric = monitor_metric(tag)
    if metric is None:
        return False
    read = {
        name for entry in DIAGNOSES for info, _ in diagnosis(entry.rule)[1] for name in info.written_names
    }
    return metric in read or metric == "alerts/fired"


def _needs_history(tag: str) -> bool:
    return monitor_metric(tag) in HISTORY_METRICS or monitor_metric(tag) == "alerts/fired"


def _series(data: Mapping[str, list[provider.ScalarDatum]]) -> dict[str, dict[str, tuple]]:
    series: dict[str, dict[str, tuple]] = {}
    for tag, points in data.items():
        family, name, layer = tag.split("/", 2)
        steps = np.fromiter((point.step for point in points), dtype=np.int64, count=len(points))
        values = np.fromiter((point.value for point in points), dtype=np.float64, count=len(points))
        series.setdefault(f"{family}/{name}", {})[layer] = (steps, values)
    return series


def _fired_steps(counters: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, list[int]]:
    """Each rule's steps where its ``alerts/fired`` counter went up (among the points TensorBoard kept)."""
    return {
        rule: [int(step) for step, new in zip(steps, np.diff(counts, prepend=0.0), strict=True) if new > 0]
        for rule, (steps, counts) in counters.items()
    }


def _alerts_of(rule: str, rows: list[AlertRow], counted: dict[str, list[int]]) -> list[dict[str, Any]]:
    """The alerts of ``rule`` from the alert tables TensorBoard kept; where none holds them (TensorBoard
    keeps a sample of 10 texts per tag), the steps its counter went up at, without layer or remedy."""
    named = [row.as_dict() for row in rows if row.rule == rule]
    if named:
        return named
    unnamed = {"severity": "", "where": "", "since": None, "reading": "", "remedy": ""}
    return [{"rule": rule, "fired_at": step, **unnamed} for step in counted.get(rule, [])]


def _thresholds(metric: str, series: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> list[dict[str, Any]]:
    """The alert thresholds on ``metric``: a level on its own scale (``relative_to`` ``value``), or, for one
    relative to a line's first value, running median or first layer, each line's own collapsed level at each
    of its steps (``levels``, by line name; :func:`~spectral_monitor.judging.relative_levels`)."""
    family, _, name = metric.partition("/")
    try:
        info = metric_info(family, name)
    except KeyError:
        return []
    thresholds = []
    for t in info.thresholds:
        if t.op not in (">=", "<="):
            continue
        entry = {
            "rule": t.rule,
            "op": t.op,
            "collapsed": t.threshold,
            "watch": t.clear if t.clear is not None else t.threshold,
            "relative_to": t.relative_to,
        }
        if t.relative_to != "value":
            if metric != info.full_name:
                continue  # a head aggregate (entropy_max): the relative reading is the mean's, not its own
            levels = relative_levels(t, series, t.threshold)
            entry["levels"] = {line: _numbers(values) for line, values in levels.items()}
        thresholds.append(entry)
    return thresholds


def _per_head_metric(metric: str) -> str:
    """The metric whose heads a layer's per-head lines draw: a head aggregate's (``entropy_max``) own."""
    family, _, name = metric.partition("/")
    try:
        info = metric_info(family, name)
    except KeyError:
        return metric
    aggregate = name.removeprefix(f"{info.name}_")
    return info.full_name if info.per_head and aggregate in info.head_aggregates else metric


def _meaning(metric: str) -> str:
    family, _, name = metric.partition("/")
    try:
        info = metric_info(family, name)
    except KeyError:
        return ""
    return f"{info.meaning}. Trouble: {info.collapse}" if info.collapse else info.meaning


def _text(array: np.ndarray) -> str:
    value = array.item() if array.ndim == 0 else array.flat[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _numbers(values: np.ndarray) -> list[float | str]:
    """Values as JSON takes them: non-finite ones as their names (``"nan"``), which the tab draws as gaps."""
    return [value if math.isfinite(value) else str(value) for value in values.tolist()]


def _json(request: wrappers.Request, body: Any) -> wrappers.Response:
    return http_util.Respond(request, json.dumps(body, allow_nan=False), "application/json")

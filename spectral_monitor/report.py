"""``spectral-monitor report``: a summary of a finished run read from its TensorBoard event files alone.

Neither torch nor Lightning nor any training code is imported: the scalars the monitor wrote
(``family/metric/layer[/head_h]``) and its alert counters and tables are read back as TensorBoard's loader
reads them, and past any damage to the files, each cut named (:mod:`spectral_monitor.eventfiles`), and
judged against :mod:`spectral_monitor.catalog`. Per run: a verdict per diagnosis
(healthy / watch / collapsed, with the layer and the reading that decided it), a per-layer table of the key
metrics (latest, min, trend), the alerts with their steps, PNG plots (each metric by layer over steps; a
layer × step heatmap of effective rank / n) and a Markdown summary embedding them.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from spectral_monitor.catalog import CATALOG, DIAGNOSES, AlertThreshold, Diagnosis, MetricInfo, diagnosis

__all__ = [
    "KEY_METRICS",
    "VERDICTS",
    "ReportError",
    "RunScalars",
    "TableRow",
    "Verdict",
    "find_runs",
    "layer_table",
    "verdicts",
    "write_report",
]

KEY_METRICS = tuple(info.full_name for info in CATALOG if info.key)
"""The metrics of the per-layer table (the catalogue's key metrics), where the run logged them."""
HEATMAP_METRIC = "attention/effective_rank_ratio"
ALERT_TEXT_TAG = "alerts/table/text_summary"
MONITOR_FAMILIES = tuple(dict.fromkeys(info.family for info in CATALOG))
VERDICTS = ("healthy", "watch", "collapsed")
"""From best to worst: the latest reading is on the healthy side of the clear level, between the clear
level and the threshold, or past the threshold (where the alert rule fires once it lasts)."""
NOT_MEASURED = "not measured"
MEDIAN_WINDOW = 8
"""Values in the running median of a ``median`` threshold, as the alert engine keeps them."""

_PER_HEAD = re.compile(r"/head_\d+$")
_UNSAFE_IN_FILE_NAMES = re.compile(r"[^A-Za-z0-9._-]")
_LONGEST_PLOT_NAME = 120
_AGGREGATE = re.compile(r"_(min|max)$")
_DPI = 100


class ReportError(ValueError):
    """The log directory cannot be reported on (missing, no event files, no monitor scalars)."""


@dataclass
class RunScalars:
    """The per-layer scalars of one run: (family/metric) -> layer -> (steps, values); alerts text by step;
    where its event files were cut (one line each)."""

    path: Path
    series: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    alert_tables: list[tuple[int, str]] = field(default_factory=list)
    cuts: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> RunScalars:
        """The run whose event files are in the directory ``path``, read in TensorBoard's order (by file
        name) and past any damage (:mod:`spectral_monitor.eventfiles`), each cut listed in ``cuts``."""
        from spectral_monitor.eventfiles import read_event_file  # protobuf: imported where used

        run = cls(path)
        series: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
        for file in sorted(entry for entry in path.iterdir() if "tfevents" in entry.name and entry.is_file()):
            try:
                read = read_event_file(file)
            except OSError as error:
                run.cuts.append(f"{file.name}: could not be read ({error.strerror or error}); skipped")
                continue
            run.cuts += [f"{file.name}: {cut.describe()}" for cut in read.cuts]
            for event in read.events:
                for value in event.summary.value:
                    parts = value.tag.split("/", 2)
                    if value.tag == ALERT_TEXT_TAG and value.tensor.string_val:
                        table = value.tensor.string_val[0].decode(errors="replace")
                        run.alert_tables.append((event.step, table))
                    elif value.HasField("simple_value") and _is_monitor_scalar(value.tag, parts):
                        by_layer = series.setdefault(f"{parts[0]}/{parts[1]}", {})
                        steps, values = by_layer.setdefault(parts[2], ([], []))
                        steps.append(event.step)
                        values.append(value.simple_value)
        run.series = {
            metric: {
                layer: (np.array(steps, dtype=np.int64), np.array(values, dtype=np.float64))
                for layer, (steps, values) in by_layer.items()
            }
            for metric, by_layer in series.items()
        }
        return run

    def alert_steps(self) -> dict[str, list[tuple[int, int]]]:
        """Each rule's (step, alerts fired at that step), from the increments of ``alerts/fired/<rule>``."""
        fired = {}
        for rule, (steps, counts) in self.series.get("alerts/fired", {}).items():
            increments = np.diff(counts, prepend=0.0)
            fired[rule] = [
                (int(step), int(new)) for step, new in zip(steps, increments, strict=True) if new > 0
            ]
        return fired


@dataclass(frozen=True)
class Verdict:
    """The verdict of one diagnosis on a run: ``verdict`` (one of :data:`VERDICTS`, or ``"not measured"``),
    the ``layer`` that decided it (the worst one; among equals the nearest its threshold) and the
    ``reading`` that decided it there, with its levels, at ``step``."""

    diagnosis: Diagnosis
    verdict: str
    layer: str = ""
    reading: str = ""
    step: int | None = None


@dataclass(frozen=True)
class _Judged:
    """One condition judged on one layer's latest reading."""

    state: int  # index in VERDICTS
    margin: float  # how far from the threshold, relative to it: smaller = nearer firing
    text: str
    step: int


@dataclass(frozen=True)
class TableRow:
    layer: str
    metric: str
    latest: float
    minimum: float
    first: float
    latest_step: int

    @property
    def trend(self) -> float:
        """Latest minus first value."""
        return self.latest - self.first


def _is_monitor_scalar(tag: str, parts: list[str]) -> bool:
    """Whether ``tag`` (split in ``parts``) is a per-layer scalar the monitor writes: family/metric/layer."""
    return len(parts) == 3 and parts[0] in MONITOR_FAMILIES and not _PER_HEAD.search(tag)


def find_runs(logdir: Path) -> list[Path]:
    """The directories under ``logdir`` (itself included) that hold TensorBoard event files, symbolic links
    to directories followed (a link back into the tree is read once)."""
    logdir = Path(logdir)
    if not logdir.exists():
        raise ReportError(f"LOGDIR {logdir} does not exist")
    if not logdir.is_dir():
        raise ReportError(f"LOGDIR {logdir} is not a directory")
    runs, seen = [], set()
    for folder, subfolders, files in os.walk(logdir, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            subfolders.clear()
            continue
        seen.add(real)
        if any(
            name.startswith("events.out.tfevents") and os.path.isfile(os.path.join(folder, name))
            for name in files
        ):
            runs.append(Path(folder))
    if not runs:
        raise ReportError(f"no TensorBoard event files (events.out.tfevents*) under {logdir}")
    return sorted(runs)


def layer_table(run: RunScalars) -> list[TableRow]:
    """Latest, min and first value of each key metric of each layer, in layer then metric order."""
    rows = []
    for metric in KEY_METRICS:
        for layer, (steps, values) in run.series.get(metric, {}).items():
            finite = values[np.isfinite(values)]
            rows.append(
                TableRow(
                    layer=layer,
                    metric=metric,
                    latest=float(values[-1]),
                    minimum=float(finite.min()) if finite.size else math.nan,
                    first=float(values[0]),
                    latest_step=int(steps[-1]),
                )
            )
    return sorted(rows, key=lambda row: (_natural_order(row.layer), KEY_METRICS.index(row.metric)))


def verdicts(run: RunScalars) -> list[Verdict]:
    """A verdict per diagnosis of :data:`~spectral_monitor.catalog.DIAGNOSES`, from each layer's latest
    readings against the catalogue's thresholds (the worst head of attention: ``_max`` for a ``<=``
    threshold, ``_min`` for ``>=``, where written, the other way round for a diagnosis of any head; relative
    thresholds against the run's own first value, running median or first layer)."""
    return [_verdict(run, entry) for entry in DIAGNOSES]


def write_report(logdir: Path, out: Path | None = None) -> list[Path]:
    """Read every run under ``logdir``, print its summary, write plots and ``report.md`` under ``out``
    (default ``<logdir>/report``, one folder per run); returns the Markdown files written."""
    logdir = Path(logdir)
    runs = find_runs(logdir)
    out = logdir / "report" if out is None else Path(out)
    written = []
    for path in runs:
        run = RunScalars.load(path)
        if not any(not metric.startswith("alerts/") for metric in run.series):
            print(f"{path}: no spectral-monitor scalars, skipped")
            continue
        name = path.relative_to(logdir).as_posix() if path != logdir else "."
        folder = out / name if name != "." else out
        folder.mkdir(parents=True, exist_ok=True)
        judged = verdicts(run)
        rows = layer_table(run)
        alerts = run.alert_steps()
        print(f"\n== {path}")
        for cut in run.cuts:
            print(f"damaged event file, {cut}")
        print(_text_verdicts(judged))
        print()
        print(_text_table(rows))
        print(_text_alerts(alerts))
        if convergence := _text_convergence(run):
            print(convergence)
        plots = _write_plots(run, folder)
        markdown = folder / "report.md"
        markdown.write_text(_markdown(path, judged, rows, alerts, run.alert_tables, plots, folder))
        print(f"report: {markdown} ({len(plots)} plots)")
        written.append(markdown)
    if not written:
        raise ReportError(f"the event files under {logdir} hold no spectral-monitor scalars")
    return written


def _verdict(run: RunScalars, entry: Diagnosis) -> Verdict:
    _, reads = diagnosis(entry.rule)
    by_layer: dict[str, list[_Judged | None]] = {}
    for index, (info, threshold) in enumerate(reads):
        for layer, judged in _judged_layers(run, info, threshold, entry.any_head).items():
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
        return Verdict(entry, NOT_MEASURED)
    layer, worst = max(decided, key=lambda item: (item[1].state, -item[1].margin, item[0]))
    if worst.margin == math.inf:  # nothing to come near: every reading of a non-finite check is finite
        return Verdict(
            entry, VERDICTS[worst.state], "", f"every reading finite ({len(decided)} layers)", worst.step
        )
    return Verdict(entry, VERDICTS[worst.state], layer, worst.text, worst.step)


def _judged_layers(
    run: RunScalars, info: MetricInfo, threshold: AlertThreshold, any_head: bool
) -> dict[str, _Judged]:
    """Each layer's latest reading of ``info`` judged against ``threshold`` (its worst head, or with
    ``any_head`` the head nearest to meeting it)."""
    name = info.full_name
    aggregate = ({">=": "max", "<=": "min"} if any_head else {">=": "min", "<=": "max"}).get(threshold.op)
    if (
        threshold.relative_to == "value"
        and aggregate in info.head_aggregates
        and f"{name}_{aggregate}" in run.series
    ):
        name = f"{name}_{aggregate}"
    by_layer = run.series.get(name, {})
    judged = {}
    for layer, (steps, values) in by_layer.items():
        if threshold.op == "nonfinite":
            broken = not math.isfinite(values[-1])
            text = f"{name} {_fmt(values[-1])}"
            judged[layer] = _Judged(2 if broken else 0, 0.0 if broken else math.inf, text, int(steps[-1]))
            continue
        value = _relative_value(threshold, by_layer, layer)
        if value is None or not math.isfinite(value):
            continue
        judged[layer] = _judge(name, value, threshold, int(steps[-1]))
    return judged


def _relative_value(
    threshold: AlertThreshold, by_layer: dict[str, tuple[np.ndarray, np.ndarray]], layer: str
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
        first_layer = min(by_layer, key=_natural_order)
        first_steps, first_values = by_layer[first_layer]
        at_step = first_values[first_steps == steps[-1]]
        return latest - float(at_step[-1]) if at_step.size else None
    return latest


def _judge(name: str, value: float, threshold: AlertThreshold, step: int) -> _Judged:
    level, clear = (
        threshold.threshold,
        threshold.clear if threshold.clear is not None else threshold.threshold,
    )
    holds = (lambda v, t: v >= t) if threshold.op == ">=" else (lambda v, t: v <= t)
    state = 2 if holds(value, level) else 1 if holds(value, clear) else 0
    margin = (value - level if threshold.op == "<=" else level - value) / max(abs(level), 1e-12)
    unit = {"value": "", "first": " × first", "median": " × running median", "depth": " − first layer"}
    text = (
        f"{name}{unit[threshold.relative_to]} {_fmt(value)} "
        f"(collapsed {threshold.op} {level:g}, watch {threshold.op} {clear:g})"
    )
    return _Judged(state, margin, text, step)


def _natural_order(layer: str) -> tuple[tuple[int, int | str], ...]:
    """``blocks.2`` before ``blocks.10``: digits compare as numbers."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", layer) if part
    )


def _text_verdicts(judged: Sequence[Verdict]) -> str:
    rows = [
        (entry.diagnosis.title, entry.verdict, entry.layer or "-", entry.reading or "-") for entry in judged
    ]
    return "verdicts (latest readings against the catalogue's thresholds):\n" + _aligned(
        ("diagnosis", "verdict", "layer", "reading"), rows, right=()
    )


def _text_table(rows: Sequence[TableRow]) -> str:
    cells = [
        (row.layer, row.metric, _fmt(row.latest), _fmt(row.minimum), _signed(row.trend), str(row.latest_step))
        for row in rows
    ]
    return _aligned(("layer", "metric", "latest", "min", "trend", "step"), cells, right=(2, 3, 4))


def _aligned(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int]) -> str:
    """A text table whose columns are as wide as their longest cell (long layer names included)."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            cell.rjust(width) if index in right else cell.ljust(width)
            for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(padded).rstrip()

    title = line(header)
    return "\n".join([title, "-" * len(title), *(line(row) for row in rows)])


def _text_alerts(alerts: dict[str, list[tuple[int, int]]]) -> str:
    fired = {rule: steps for rule, steps in alerts.items() if steps}
    if not alerts:
        return "alerts: none recorded (alerts off, or a run from before alerts)"
    if not fired:
        return f"alerts: none fired ({len(alerts)} rules watched)"
    lines = ["alerts fired:"]
    for rule, steps in sorted(fired.items()):
        total = sum(count for _, count in steps)
        at = ", ".join(f"{step}" if count == 1 else f"{step} (×{count})" for step, count in steps)
        lines.append(f"  {rule}: {total} at step{'s' if len(steps) > 1 else ''} {at}")
    return "\n".join(lines)


def _text_convergence(run: RunScalars) -> str:
    """How many curvature and Jacobian events (per family, over all layers) did not converge: their values
    are logged but no alert reads them."""
    counts = []
    for family in ("curvature", "jacobian"):
        flags = run.series.get(f"{family}/converged", {})
        if flags:
            values = np.concatenate([values for _, values in flags.values()])
            counts.append(f"{family} {int((values == 0).sum())} of {values.size}")
    return f"not converged: {', '.join(counts)}" if counts else ""


def _markdown(
    path: Path,
    judged: Sequence[Verdict],
    rows: Sequence[TableRow],
    alerts: dict[str, list[tuple[int, int]]],
    alert_tables: list[tuple[int, str]],
    plots: list[Path],
    folder: Path,
) -> str:
    lines = [f"# spectral-monitor report: `{path}`", "", "## Verdicts", ""]
    lines += ["| diagnosis | verdict | layer | reading | step |", "|---|---|---|---|---|"]
    lines += [
        f"| {entry.diagnosis.title} | {entry.verdict} | {entry.layer} | {entry.reading} | "
        f"{'' if entry.step is None else entry.step} |"
        for entry in judged
    ]
    lines += ["", "## Per-layer summary", ""]
    lines += [
        "| layer | metric | latest | min | trend (latest − first) | step |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {row.layer} | {row.metric} | {_fmt(row.latest)} | {_fmt(row.minimum)} | {_signed(row.trend)} | "
        f"{row.latest_step} |"
        for row in rows
    ]
    lines += ["", "## Alerts", "", _text_alerts(alerts).replace("\n  ", "\n- ")]
    if alert_tables:
        step, table = alert_tables[-1]
        lines += ["", f"Last alert table written (step {step}):", "", table]
    lines += ["", "## Plots", ""]
    lines += [f"![{plot.stem}]({plot.relative_to(folder).as_posix()})" for plot in plots]
    return "\n".join(lines) + "\n"


def _write_plots(run: RunScalars, folder: Path) -> list[Path]:
    plots_folder = folder / "plots"
    plots_folder.mkdir(exist_ok=True)
    plots = []
    heatmap = run.series.get(HEATMAP_METRIC)
    if heatmap:
        plots.append(
            _save(_layer_step_heatmap(HEATMAP_METRIC, heatmap), plots_folder / "heatmap_effective_rank.png")
        )
    for metric, by_layer in sorted(run.series.items()):
        if _AGGREGATE.search(metric):
            continue
        plots.append(_save(_metric_by_layer(metric, by_layer), plots_folder / _plot_file_name(metric)))
    return plots


def _metric_by_layer(metric: str, by_layer: dict[str, tuple[np.ndarray, np.ndarray]]) -> Figure:
    # Fixed margins rather than a layout engine: solving the constrained layout was half of each plot's time.
    figure = Figure(figsize=(6.4, 3.6), dpi=_DPI)
    figure.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.9)
    axes = figure.subplots()
    colors = matplotlib.colormaps["viridis"](np.linspace(0.0, 0.9, len(by_layer)))
    layers = sorted(by_layer.items(), key=lambda item: _natural_order(item[0]))
    for (layer, (steps, values)), color in zip(layers, colors, strict=True):
        axes.plot(steps, values, marker=".", color=color, label=layer)
    axes.set_xlabel("step")
    axes.set_title(metric)
    axes.grid(True, alpha=0.3)
    if len(by_layer) <= 12:
        axes.legend(fontsize="x-small")
    return figure


def _layer_step_heatmap(metric: str, by_layer: dict[str, tuple[np.ndarray, np.ndarray]]) -> Figure:
    layers = sorted(by_layer)
    steps = sorted({int(step) for steps, _ in by_layer.values() for step in steps})
    column = {step: index for index, step in enumerate(steps)}
    grid = np.full((len(layers), len(steps)), np.nan)
    for row, layer in enumerate(layers):
        layer_steps, values = by_layer[layer]
        for step, value in zip(layer_steps, values, strict=True):
            grid[row, column[int(step)]] = value
    figure = Figure(figsize=(7.2, 0.5 * len(layers) + 2.0), dpi=_DPI, layout="constrained")
    axes = figure.subplots()
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    image = axes.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto",
                        interpolation="nearest")  # fmt: skip
    ticks = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 10)).round().astype(int))
    axes.set_xticks(ticks, [str(steps[index]) for index in ticks])
    axes.set_yticks(range(len(layers)), layers)
    axes.set_xlabel("step")
    axes.set_title(f"{metric} (layer × step)")
    figure.colorbar(image, ax=axes)
    return figure


def _plot_file_name(metric: str) -> str:
    """``family__metric.png``: characters a file name cannot hold replaced, and a name too long for a file
    system (255 bytes) cut, with a hash of the whole name so that two cut names stay apart."""
    name = _UNSAFE_IN_FILE_NAMES.sub("_", metric.replace("/", "__"))
    if len(name) > _LONGEST_PLOT_NAME:
        name = f"{name[:_LONGEST_PLOT_NAME]}-{hashlib.sha1(metric.encode()).hexdigest()[:8]}"
    return f"{name}.png"


def _save(figure: Figure, path: Path) -> Path:
    FigureCanvasAgg(figure).print_png(str(path))
    figure.clear()
    return path


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    return f"{value:.3g}" if abs(value) >= 1000 or (value != 0 and abs(value) < 0.001) else f"{value:.3f}"


def _signed(value: float) -> str:
    return _fmt(value) if not math.isfinite(value) or value < 0 else "+" + _fmt(value)

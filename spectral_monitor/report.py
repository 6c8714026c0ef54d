"""``spectral-monitor report``: a summary of a finished run read from its TensorBoard event files alone.

Neither torch nor Lightning nor any training code is imported: the scalars the monitor wrote
(``family/metric/layer[/head_h]``) and its alert counters and tables are read back as TensorBoard's loader
reads them, past any damage to the files, each cut named (:mod:`spectral_monitor.eventfiles`), and judged by
:mod:`spectral_monitor.judging`, the same code the TensorBoard tab runs.
Per run, the verdict first: one overall line (the worst verdict, its diagnosis and layers), then a verdict
per diagnosis (healthy / watch / collapsed / not measured / no finite reading, with the layers and the
reading that decided it), the alerts that fired with their steps and layers, and the per-layer details
(latest, min, trend of the key metrics); under ``--out``, PNG plots (each metric by layer over steps with the
thresholds of the rules the run is judged on, relative ones as each layer's own level, and the spread over
heads; or past 12 layers as a layer × step heatmap; and the heatmap of effective rank / n) and a Markdown
summary embedding them.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import os
import re
import textwrap
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from spectral_monitor.alerts.thresholds import AlertThreshold
from spectral_monitor.catalog import CATALOG, metric_info
from spectral_monitor.judging import (
    MEDIAN_WINDOW,
    NOT_MEASURED,
    OP_WORDS,
    VERDICTS,
    AlertRow,
    Verdict,
    alert_rows,
    format_number,
    judge,
    natural_order,
    overall_line,
    relative_levels,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "KEY_METRICS",
    "MEDIAN_WINDOW",
    "NOT_MEASURED",
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
LEVEL_COLOURS = {"collapsed": "tab:red", "watch": "tab:orange"}

_PER_HEAD = re.compile(r"/head_\d+$")
_UNSAFE_IN_FILE_NAMES = re.compile(r"[^A-Za-z0-9._-]")
_LONGEST_PLOT_NAME = 120
_AGGREGATE = re.compile(r"_(min|max)$")
_RELATIVE_LEVELS = {
    "first": "× its first value",
    "median": "× its running median",
    "depth": "+ the first layer's",
}
"""A relative threshold's level in a plot's legend, short enough to leave the lines visible."""
_DPI = 100
_MARKED_POINTS = 200
"""Series up to this many readings are drawn with a marker at each; longer ones as a line only."""
_LINES_AT_MOST = 12
"""A metric of more layers is drawn as a layer × step heatmap: past a dozen, lines are told apart by neither
colour nor legend (the tab switches at the same count)."""
_PLOT_INCHES = (8.4, 3.6)
"""A line plot's usual size; taller or wider where its legend needs it."""
_PLOT_MARGINS_INCHES = (0.36, 0.5)
"""Above and below a line plot's axes: the title, the step axis."""
_AXES_EDGES_INCHES = (0.75, 6.13)
"""A line plot's axes' left and right edges, from the figure's left: the legend stands right of them."""
_LEGEND_CHARACTERS = 34
"""Legend entries longer than this wrap onto further lines (the legend stands beside the axes)."""
_ENVELOPE_BUCKETS = 125
"""Series longer than twice this are drawn through their envelope (:func:`_envelope`) in this many runs,
about one per four pixel columns of a plot's axes."""


class ReportError(ValueError):
    """The log directory cannot be reported on (missing, no event files, no monitor scalars).

    A ``ValueError``: the command line prints its message and exits with an error.

    Examples:
        >>> find_runs(Path("no/such/logdir"))
        Traceback (most recent call last):
        ...
        spectral_monitor.report.ReportError: LOGDIR no/such/logdir does not exist
    """


@dataclass
class RunScalars:
    """The per-layer scalars of one run, as :meth:`load` reads them from its event files.

    Attributes:
        path: The run's directory.
        series: ``family/metric`` → layer → (steps, values): int64 steps in the order written, float64
            values (NaN where a NaN was logged). Per-head tags are left out; head aggregates
            (``entropy_min``) are metrics of their own.
        alert_tables: (step, Markdown table) of each open-alerts table the run logged, in the order read.
        cuts: Where the event files were damaged or could not be read, one line each.

    Examples:
        >>> import numpy as np
        >>> fired = (np.array([0, 10, 20]), np.array([0.0, 2.0, 2.0]))
        >>> RunScalars(Path("run"), series={"alerts/fired": {"rank_collapse": fired}}).alert_steps()
        {'rank_collapse': [(10, 2)]}
    """

    path: Path
    series: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    alert_tables: list[tuple[int, str]] = field(default_factory=list)
    cuts: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> RunScalars:
        """The run whose event files are in the directory ``path``, read in TensorBoard's order (by file
        name) and past any damage (:mod:`spectral_monitor.eventfiles`), each cut listed in ``cuts``.

        Only the monitor's per-layer scalars (``family/metric/layer`` of a catalogued family) and its
        open-alerts tables are kept; a file that cannot be opened is skipped and named in ``cuts``.

        Args:
            path: A directory holding ``*tfevents*`` files (those of subdirectories are not read).

        Returns:
            The run's scalars.
        """
        from spectral_monitor.eventfiles import read_event_file  # protobuf: imported where used

        run = cls(path)
        series: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
        # A run repeats a few hundred tags over every step: each tag is classified once, not per value.
        destinations: dict[str, tuple[list[int], list[float]] | None] = {}
        for file in sorted(entry for entry in path.iterdir() if "tfevents" in entry.name and entry.is_file()):
            try:
                read = read_event_file(file)
            except OSError as error:
                run.cuts.append(f"{file.name}: could not be read ({error.strerror or error}); skipped")
                continue
            run.cuts += [f"{file.name}: {cut.describe()}" for cut in read.cuts]
            for event in read.events:
                step = event.step
                for value in event.summary.value:
                    tag = value.tag
                    if tag == ALERT_TEXT_TAG:
                        if value.tensor.string_val:
                            table = value.tensor.string_val[0].decode(errors="replace")
                            run.alert_tables.append((step, table))
                        continue
                    if tag in destinations:
                        destination = destinations[tag]
                    else:
                        parts = tag.split("/", 2)
                        destination = destinations[tag] = ([], []) if _is_monitor_scalar(tag, parts) else None
                    if destination is not None and value.HasField("simple_value"):
                        if not destination[0]:  # a series exists once it has a value
                            family, metric, layer = tag.split("/", 2)
                            series.setdefault(f"{family}/{metric}", {})[layer] = destination
                        destination[0].append(step)
                        destination[1].append(value.simple_value)
        run.series = {
            metric: {
                layer: (np.array(steps, dtype=np.int64), np.array(values, dtype=np.float64))
                for layer, (steps, values) in by_layer.items()
            }
            for metric, by_layer in series.items()
        }
        return run

    def alert_steps(self) -> dict[str, list[tuple[int, int]]]:
        """When each rule fired, from the increments of its cumulative counter ``alerts/fired/<rule>``.

        Returns:
            Rule name → (step, alerts fired at that step) for each step its counter rose; an empty list for
            a rule that never fired.
        """
        fired = {}
        for rule, (steps, counts) in self.series.get("alerts/fired", {}).items():
            increments = np.diff(counts, prepend=0.0)
            fired[rule] = [
                (int(step), int(new)) for step, new in zip(steps, increments, strict=True) if new > 0
            ]
        return fired


@dataclass(frozen=True)
class TableRow:
    """One line of the per-layer table: a key metric of a layer over the run.

    Attributes:
        layer: The layer (module name).
        metric: The ``family/metric``, one of :data:`KEY_METRICS`.
        latest: The last value logged (NaN if it was NaN).
        minimum: The smallest finite value; NaN when none was finite.
        first: The first value logged.
        latest_step: The step of ``latest``.

    Examples:
        >>> TableRow("blocks.0", "tokens/token_residual", 0.5, 0.4, 0.9, 100).trend
        -0.4
    """

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
    """The directories under ``logdir`` (itself included) that hold TensorBoard event files.

    Symbolic links to directories are followed; a directory reached twice (a link back into the tree) is
    read once.

    Args:
        logdir: The log directory.

    Returns:
        Each directory holding an ``events.out.tfevents*`` file, sorted.

    Raises:
        ReportError: ``logdir`` does not exist, is not a directory, or holds no event file.

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as logdir:
        ...     run = Path(logdir, "version_0")
        ...     run.mkdir()
        ...     _ = Path(run, "events.out.tfevents.0").write_bytes(b"")
        ...     [found.name for found in find_runs(Path(logdir))]
        ['version_0']
    """
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
    """Latest, min and first value of each key metric (:data:`KEY_METRICS`) of each layer.

    Args:
        run: The run's scalars.

    Returns:
        One row per (layer, key metric) the run logged, in natural layer order (``blocks.2`` before
        ``blocks.10``), then in :data:`KEY_METRICS` order.

    Examples:
        >>> import numpy as np
        >>> readings = (np.array([0, 10]), np.array([0.9, float("nan")]))
        >>> series = {"tokens/token_residual": {"blocks.0": readings}}
        >>> row = layer_table(RunScalars(Path("run"), series=series))[0]
        >>> row.first, row.minimum, row.latest_step
        (0.9, 0.9, 10)
    """
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
    return sorted(rows, key=lambda row: (natural_order(row.layer), KEY_METRICS.index(row.metric)))


def verdicts(run: RunScalars) -> list[Verdict]:
    """A verdict per diagnosis of :data:`~spectral_monitor.catalog.DIAGNOSES`, each layer's latest reading
    judged against the default rules' thresholds (:func:`spectral_monitor.judging.judge`).

    Args:
        run: The run's scalars.

    Returns:
        One :class:`~spectral_monitor.judging.Verdict` per diagnosis, in the catalogue's order; ``not
        measured`` where the run logged none of the metrics it reads.

    Examples:
        >>> import numpy as np
        >>> series = {"attention/rank_one_residual": {"blocks.0": (np.array([0, 10]), np.array([0.8, 0.01]))}}
        >>> [(v.diagnosis.title, v.verdict) for v in verdicts(RunScalars(Path("run"), series=series))][0]
        ('Rank collapse', 'collapsed')
    """
    return judge(run.series)


def write_report(logdir: Path, out: Path | None = None, *, processes: int = 1) -> list[Path]:
    """Read every run under ``logdir``, print its summary, and write its plots and ``report.md``.

    Each run gets a folder under ``out`` named by its path relative to ``logdir`` (``out`` itself for
    ``logdir``), created if needed; files already there are overwritten. A run without monitor scalars is
    named and skipped.

    Args:
        logdir: The log directory, searched as :func:`find_runs` does.
        out: Where the reports go; None for ``<logdir>/report``.
        processes: How many processes draw the plots. 1: this one. More: that many worker processes,
            started (``spawn``) while the events are read and given the series they draw; the same PNG
            files, in less wall time where there are cores to run them. A script that calls this with more
            than 1 needs Python's ``if __name__ == "__main__":`` guard, as ``multiprocessing`` does.

    Returns:
        The Markdown files written, one per run reported.

    Raises:
        ReportError: As :func:`find_runs` raises it, or no run holds monitor scalars.
        ValueError: ``processes`` is less than 1.

    Examples:
        The ``spectral-monitor report`` command, from Python:

        ```python
        from pathlib import Path
        from spectral_monitor.report import write_report

        for summary in write_report(Path("lightning_logs"), out=Path("reports")):
            print(summary)  # reports/version_0/report.md, next to reports/version_0/plots/*.png
        ```
    """
    if processes < 1:
        raise ValueError(f"processes must be at least 1 (1: draw the plots in this process), got {processes}")
    logdir = Path(logdir)
    runs = find_runs(logdir)
    out = logdir / "report" if out is None else Path(out)
    with _drawing_processes(processes) as drawers:
        return _write_reports(logdir, runs, out, drawers)


def _write_reports(logdir: Path, runs: list[Path], out: Path, drawers: _Drawers | None) -> list[Path]:
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
        fired = alert_rows([table for _, table in run.alert_tables])
        print(f"\n== {path}")
        print(overall_line(judged))
        print()
        for cut in run.cuts:
            print(f"damaged event file, {cut}")
        print(_text_verdicts(judged))
        print()
        print(_text_alerts(alerts, fired))
        print()
        print("per-layer details (key metrics):")
        print(_text_table(rows))
        if convergence := _text_convergence(run):
            print(convergence)
        plots = _write_plots(
            run, folder, {entry.diagnosis.rule for entry in judged if entry.verdict != NOT_MEASURED}, drawers
        )
        markdown = folder / "report.md"
        markdown.write_text(_markdown(path, judged, rows, alerts, fired, plots, folder))
        print(f"report: {markdown} ({len(plots)} plots)")
        written.append(markdown)
    if not written:
        raise ReportError(f"the event files under {logdir} hold no spectral-monitor scalars")
    return written


def _text_verdicts(judged: Sequence[Verdict]) -> str:
    rows = [_verdict_cells(entry) for entry in judged]
    return "verdicts (each layer's latest reading against the catalogue's thresholds):\n" + _aligned(
        ("diagnosis", "verdict", "layers", "reading"), rows, right=()
    )


def _verdict_cells(entry: Verdict) -> tuple[str, str, str, str]:
    """Diagnosis, verdict, layers and reading (or, not measured, how to measure it) of one verdict."""
    if entry.verdict == NOT_MEASURED:
        return entry.diagnosis.title, entry.verdict, "-", entry.how_to_measure or "-"
    layers = ", ".join(entry.layers) if entry.layers else f"nearest: {entry.layer}" if entry.layer else "-"
    return entry.diagnosis.title, entry.verdict, layers, entry.reading or "-"


def _text_table(rows: Sequence[TableRow]) -> str:
    cells = [
        (
            row.layer,
            row.metric,
            format_number(row.latest),
            format_number(row.minimum),
            _signed(row.trend),
            str(row.latest_step),
        )
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


def _text_alerts(alerts: dict[str, list[tuple[int, int]]], fired: Sequence[AlertRow]) -> str:
    """The alerts that fired: each with its step and layer from the alert tables, else (a run whose tables
    were not written) with its steps from the counters."""
    counted = {rule: steps for rule, steps in alerts.items() if steps}
    if not alerts and not fired:
        return "alerts: none recorded (alerts off, or a run from before alerts)"
    if not counted and not fired:
        return f"alerts: none fired ({len(alerts)} rules watched)"
    lines = ["alerts fired:"]
    named = {row.rule for row in fired}
    lines += [f"  {row.rule} at step {row.fired_at} in {row.where}: {row.reading}" for row in fired]
    for rule, steps in sorted(counted.items()):
        if rule in named:
            continue
        total = sum(count for _, count in steps)
        at = ", ".join(f"{step}" if count == 1 else f"{step} ({count} alerts)" for step, count in steps)
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
    fired: Sequence[AlertRow],
    plots: list[Path],
    folder: Path,
) -> str:
    lines = [f"# spectral-monitor report: `{path}`", "", f"**{overall_line(judged)}**", "", "## Verdicts", ""]
    lines += ["| diagnosis | verdict | layers | reading | step |", "|---|---|---|---|---|"]
    for entry in judged:
        title, verdict, layers, reading = _verdict_cells(entry)
        step = "" if entry.step is None else entry.step
        lines.append(f"| {title} | {verdict} | {layers} | {reading} | {step} |")
    lines += ["", "## Alerts", ""]
    if fired:
        lines += ["| rule | fired at step | where | reading | remedy |", "|---|---|---|---|---|"]
        lines += [
            f"| {row.rule} | {row.fired_at} | {row.where} | {row.reading} | {row.remedy} |" for row in fired
        ]
    else:
        lines.append(_text_alerts(alerts, fired).replace("\n  ", "\n- "))
    lines += ["", "## Per-layer details", ""]
    lines += [
        "| layer | metric | latest | min | trend (latest minus first) | step |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {row.layer} | {row.metric} | {format_number(row.latest)} | {format_number(row.minimum)} | "
        f"{_signed(row.trend)} | {row.latest_step} |"
        for row in rows
    ]
    lines += ["", "## Plots", ""]
    lines += [f"![{plot.stem}]({plot.relative_to(folder).as_posix()})" for plot in plots]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class _Plot:
    """One plot to draw: a metric's lines by layer, or its layer × step heatmap.

    Attributes:
        path: The PNG file.
        metric: ``family/metric``.
        by_layer: Its series, layer -> (steps, values).
        heatmap: Whether it is drawn as a heatmap.
        limits: A heatmap's colour limits; None: its own range.
        spread: A line plot's (lowest, highest) head aggregates, shaded.
    """

    path: Path
    metric: str
    by_layer: dict[str, tuple[np.ndarray, np.ndarray]]
    heatmap: bool
    limits: tuple[float, float] | None = None
    spread: tuple[Mapping[str, tuple[np.ndarray, np.ndarray]], ...] = ({}, {})

    @property
    def cost(self) -> float:
        """Its drawing time in line plots: a heatmap's is mostly its row labels, about one line plot's worth
        of text every 20 rows (2.9 for GPT-2's 37 weights, measured 2.8)."""
        return 1.0 + len(self.by_layer) / 20 if self.heatmap else 1.0


@dataclass(frozen=True)
class _Drawers:
    """Worker processes that draw plots, and how many."""

    pool: ProcessPoolExecutor
    count: int


@contextmanager
def _drawing_processes(processes: int) -> Iterator[_Drawers | None]:
    """``processes`` workers that draw plots, each started and importing matplotlib at once, while the caller
    reads the events; shut down on leaving. None for 1, or where no process can be started (a sandbox
    without subprocesses): the plots are then drawn in this process."""
    if processes == 1:
        yield None
        return
    pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))
    try:
        for _ in range(processes):
            pool.submit(_import_drawing)
    except (OSError, BrokenProcessPool):
        pool.shutdown(cancel_futures=True)
        yield None
        return
    try:
        yield _Drawers(pool, processes)
    finally:
        pool.shutdown(cancel_futures=True)


def _import_drawing() -> None:
    """Import what drawing a plot needs (about half a second), so that a worker does it while the events are
    read."""
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.figure  # noqa: F401


def _write_plots(
    run: RunScalars, folder: Path, judged_rules: set[str], drawers: _Drawers | None = None
) -> list[Path]:
    """Every metric's plot, with the levels of the rules in ``judged_rules`` (those the run is judged on: a
    causal model's entropy near 1 is not uniform attention), and the effective-rank heatmap; drawn by the
    ``drawers``, each a share of the plots, where given."""
    plots_folder = folder / "plots"
    plots_folder.mkdir(exist_ok=True)
    plots: list[_Plot] = []
    heatmap = run.series.get(HEATMAP_METRIC)
    if heatmap:
        plots.append(
            _Plot(plots_folder / "heatmap_effective_rank.png", HEATMAP_METRIC, heatmap, True, (0.0, 1.0))
        )
    for metric, by_layer in sorted(run.series.items()):
        if _AGGREGATE.search(metric):
            continue  # drawn as the range over heads on its mean's plot
        path = plots_folder / _plot_file_name(metric)
        if len(by_layer) > _LINES_AT_MOST:
            plots.append(_Plot(path, metric, by_layer, True))
        else:
            spread = (run.series.get(f"{metric}_min", {}), run.series.get(f"{metric}_max", {}))
            plots.append(_Plot(path, metric, by_layer, False, spread=spread))
    if drawers is None:
        return _draw_plots(plots, judged_rules)
    shares = _balanced_shares(plots, drawers.count)
    try:
        for future in [drawers.pool.submit(_draw_plots, share, judged_rules) for share in shares if share]:
            future.result()
    except BrokenProcessPool:  # a worker died (killed for memory, say): every plot drawn again here
        return _draw_plots(plots, judged_rules)
    return [plot.path for plot in plots]


def _balanced_shares(plots: list[_Plot], count: int) -> list[list[_Plot]]:
    """``plots`` dealt to ``count`` drawers, the costliest first, each to the drawer with the least to draw so
    far, so that every drawer finishes at about the same time."""
    shares: list[list[_Plot]] = [[] for _ in range(count)]
    loads = [0.0] * count
    for plot in sorted(plots, key=lambda plot: plot.cost, reverse=True):
        lightest = loads.index(min(loads))
        shares[lightest].append(plot)
        loads[lightest] += plot.cost
    return shares


def _draw_plots(plots: list[_Plot], judged_rules: set[str]) -> list[Path]:
    """Draw and save ``plots`` in order (a worker's share, or all of them), the line plots on one figure."""
    # One figure redrawn for every metric: its axes, ticks and text objects are made once, not per plot.
    figure = None
    for plot in plots:
        if plot.heatmap:
            many = _layer_step_heatmap(plot.metric, plot.by_layer, plot.limits)
            _save(many, plot.path)
            many.clear()
            continue
        figure = _metric_by_layer(plot.metric, plot.by_layer, judged_rules, figure, plot.spread)
        _save(figure, plot.path)
    return [plot.path for plot in plots]


def _metric_by_layer(
    metric: str,
    by_layer: dict[str, tuple[np.ndarray, np.ndarray]],
    judged_rules: set[str],
    figure: Figure | None = None,
    spread: tuple[Mapping[str, tuple[np.ndarray, np.ndarray]], ...] = ({}, {}),
) -> Figure:
    """The plot of ``metric``, each layer a line, with the thresholds of the rules in ``judged_rules``: drawn
    on ``figure`` (one this function drew before, its lines and legend replaced) or on a new one. Where
    ``spread`` holds a layer's smallest or largest head (``<metric>_min``, ``<metric>_max``, which verdicts
    read: the worst head), the range between them (or the mean) is shaded in the layer's colour."""
    import matplotlib

    if figure is None:
        figure = _metric_figure()
    (axes,) = figure.axes
    for artist in [*axes.lines, *axes.texts, *axes.collections]:
        artist.remove()
    axes.autoscale(enable=True)  # the limits the figure's last metric fixed
    if axes.get_legend() is not None:
        axes.get_legend().remove()
    colors = matplotlib.colormaps["viridis"](np.linspace(0.0, 0.9, len(by_layer)))
    layers = sorted(by_layer.items(), key=lambda item: natural_order(item[0]))
    pattern, names = _legend_names([layer for layer, _ in layers])
    lowest, highest = spread
    shaded = False
    for (layer, mean), color in zip(layers, colors, strict=True):
        # A metric with one aggregate (max_logit_max) shades from its mean to it.
        low, high = lowest.get(layer, mean), highest.get(layer, mean)
        if (layer in lowest or layer in highest) and np.array_equal(low[0], high[0]):
            steps, low, high = _band(low[0], low[1], high[1])
            axes.fill_between(
                steps, low, high, color=color, alpha=0.18, linewidth=0,
                label="_nolegend_" if shaded else "spread over heads, to the worst (shaded)",
            )  # fmt: skip
            shaded = True
    for (_, (steps, values)), color, name in zip(layers, colors, names, strict=True):
        if len(steps) <= _MARKED_POINTS:
            axes.plot(steps, values, marker=".", color=color, label=name)
        elif len(steps) <= 2 * _ENVELOPE_BUCKETS:
            axes.plot(steps, values, color=color, label=name)
        else:
            axes.plot(*_envelope(steps, values, _ENVELOPE_BUCKETS), color=color, label=name)
    for threshold in _plotted_thresholds(metric, judged_rules):
        watch = threshold.clear if threshold.clear is not None else threshold.threshold
        for verdict, level in (("collapsed", threshold.threshold), ("watch", watch)):
            axes.axhline(
                level,
                color=LEVEL_COLOURS[verdict],
                linestyle="--" if verdict == "collapsed" else ":",
                linewidth=1.0,
                label=f"{threshold.rule}: {verdict} {OP_WORDS[threshold.op]} {level:g}",
            )
    # Non-finite readings are gaps in the lines: marked on the step axis, so a run that went NaN shows where.
    broken = np.unique(np.concatenate([steps[~np.isfinite(values)] for _, (steps, values) in layers]))
    if broken.size:
        axes.plot(
            broken, np.zeros(broken.size), linestyle="none", marker="x", color="#d62728",
            transform=axes.get_xaxis_transform(), clip_on=False, label="NaN or inf",
        )  # fmt: skip
    # The limits of this metric's lines alone, not of the lines the figure held before; the steps of every
    # reading, finite or not.
    axes.relim()
    axes.autoscale_view()
    # Each layer's own collapsed level of a relative threshold, dashed in its colour, where it lies within
    # the limits (20 times a first value must not stretch them): its line crosses it where it collapses.
    bottom, top = axes.get_ylim()
    for threshold in _plotted_thresholds(metric, judged_rules, relative=True):
        levels = relative_levels(threshold, by_layer, threshold.threshold)
        label = (
            f"{threshold.rule}: collapsed {OP_WORDS[threshold.op]} {threshold.threshold:g} "
            f"{_RELATIVE_LEVELS[threshold.relative_to]} (dashed)"
        )
        for index, ((layer, (steps, _)), color) in enumerate(zip(layers, colors, strict=True)):
            shown = np.where((levels[layer] >= bottom) & (levels[layer] <= top), levels[layer], np.nan)
            axes.plot(
                steps, shown, color=color, linestyle="--", linewidth=0.9,
                label=label if index == 0 else "_nolegend_",
            )  # fmt: skip
    axes.set_ylim(bottom, top)
    every_step = np.concatenate([steps for _, (steps, _) in layers])
    if every_step.size and every_step.min() < every_step.max():
        margin = 0.02 * (every_step.max() - every_step.min())
        axes.set_xlim(every_step.min() - margin, every_step.max() + margin)
    if not any(np.isfinite(values).any() for _, (_, values) in layers):
        axes.text(0.5, 0.5, "no finite reading", transform=axes.transAxes, ha="center", va="center")
    # A title at a given height: placing it automatically measured every tick label at every draw.
    axes.set_title(metric, y=1.0, pad=6.0)
    # Beside the axes: a legend of a dozen layers and the rules' levels, placed over them, hid their lines.
    handles, labels = axes.get_legend_handles_labels()
    legend = axes.legend(
        handles, [textwrap.fill(label, _LEGEND_CHARACTERS) for label in labels], loc="upper left",
        bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize="x-small",
        title=pattern and textwrap.fill(pattern, _LEGEND_CHARACTERS), title_fontsize="x-small",
    )  # fmt: skip
    # As tall and as wide as the legend needs (a dozen layers and two rules' levels need more than the usual
    # height, a font of wider glyphs more width), the axes where they were.
    extent = legend.get_window_extent(figure.canvas.get_renderer())
    width = max(_PLOT_INCHES[0], extent.x1 / figure.dpi + 0.1)
    height = max(_PLOT_INCHES[1], _PLOT_MARGINS_INCHES[0] + extent.height / figure.dpi + 0.1)
    if (width, height) != tuple(figure.get_size_inches()):
        _size_plot(figure, width, height)
    return figure


def _size_plot(figure: Figure, width: float, height: float) -> None:
    """``figure`` made ``width`` × ``height`` inches, its axes at the same distances from its left, top and
    bottom edges and as wide as ever: what grows is the room beside and below them."""
    figure.set_size_inches(width, height)
    (left, right), (top, bottom) = _AXES_EDGES_INCHES, _PLOT_MARGINS_INCHES
    figure.subplots_adjust(
        left=left / width, right=right / width, top=1 - top / height, bottom=bottom / height
    )


def _legend_names(layers: list[str]) -> tuple[str | None, list[str]]:
    """The layers' names as a legend shows them: the dotted parts that every name starts or ends with go into
    a pattern, the legend's title (``transformer.h.*.attn``: names ``0`` … ``5``); each name keeps at least
    one part of its own. (None, the names) for a single layer or where no part is shared."""
    if len(layers) < 2:
        return None, layers
    parts = [layer.split(".") for layer in layers]
    shortest = min(len(split) for split in parts)
    head = 0
    while head < shortest - 1 and len({split[head] for split in parts}) == 1:
        head += 1
    tail = 0
    while head + tail < shortest - 1 and len({split[-1 - tail] for split in parts}) == 1:
        tail += 1
    if not head and not tail:
        return None, layers
    first = parts[0]
    pattern = ".".join([*first[:head], "*", *first[len(first) - tail :]])
    return pattern, [".".join(split[head : len(split) - tail]) for split in parts]


def _metric_figure() -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Fixed margins rather than a layout engine, which would be solved again at every plot drawn; room
    # beside the axes for the legend.
    figure = Figure(figsize=_PLOT_INCHES, dpi=_DPI)
    FigureCanvasAgg(figure)
    _size_plot(figure, *_PLOT_INCHES)
    axes = figure.subplots()
    axes.set_xlabel("step")
    axes.grid(True, alpha=0.3)
    return figure


def _band(steps: np.ndarray, low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The range between two series of the same steps, at a plot's resolution: a long one cut into about
    ``_ENVELOPE_BUCKETS`` runs, each kept as its lowest ``low`` and highest ``high`` at its first step."""
    if len(steps) <= 2 * _ENVELOPE_BUCKETS:
        return steps, low, high
    width = -(-len(steps) // _ENVELOPE_BUCKETS)
    runs = -(-len(steps) // width)
    padding = runs * width - len(steps)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a run of NaN only: a gap
        bottom = np.nanmin(np.pad(low, (0, padding), constant_values=np.nan).reshape(runs, width), axis=1)
        top = np.nanmax(np.pad(high, (0, padding), constant_values=np.nan).reshape(runs, width), axis=1)
    return steps[::width], bottom, top


def _envelope(steps: np.ndarray, values: np.ndarray, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """A long series cut into about ``buckets`` consecutive runs of readings, each kept as its lowest and
    highest finite reading in step order: the line through them keeps every spike and the series' range at
    a plot's resolution, at a fraction of the drawing. A run with no finite reading keeps its first, so a
    NaN stays a gap in the line."""
    width = -(-len(steps) // buckets)
    runs = -(-len(steps) // width)
    padding = runs * width - len(steps)
    grid = np.pad(values, (0, padding), constant_values=np.nan).reshape(runs, width)
    finite = np.isfinite(grid)
    lowest = np.where(finite, grid, np.inf).argmin(axis=1)
    highest = np.where(finite, grid, -np.inf).argmax(axis=1)
    kept = np.sort(np.stack([lowest, highest], axis=1), axis=1)
    kept[~finite.any(axis=1)] = 0
    indices = np.unique((np.arange(runs)[:, None] * width + kept).ravel())
    return steps[indices], values[indices]


def _plotted_thresholds(
    metric: str, judged_rules: set[str], *, relative: bool = False
) -> list[AlertThreshold]:
    """The thresholds of ``metric`` of the rules in ``judged_rules``: those on its own values, or with
    ``relative`` those relative to a layer's first value, running median or first layer."""
    family, _, name = metric.partition("/")
    try:
        info = metric_info(family, name)
    except KeyError:
        return []
    # A relative reading is the mean's (entropy as a multiple of its running median), not a head aggregate's.
    own = metric == info.full_name
    return [
        t
        for t in info.thresholds
        if t.op in (">=", "<=")
        and (t.relative_to != "value") == relative
        and (own or not relative)
        and t.rule in judged_rules
    ]


def _layer_step_heatmap(
    metric: str,
    by_layer: dict[str, tuple[np.ndarray, np.ndarray]],
    limits: tuple[float, float] | None = None,
) -> Figure:
    """``metric`` as a layer × step image, layers in model order, coloured over ``limits`` (None: from its
    smallest to its largest finite reading)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    layers = sorted(by_layer, key=natural_order)
    steps = np.unique(np.concatenate([by_layer[layer][0] for layer in layers]).astype(np.int64))
    grid = np.full((len(layers), len(steps)), np.nan)
    for row, layer in enumerate(layers):
        layer_steps, values = by_layer[layer]
        grid[row, np.searchsorted(steps, layer_steps.astype(np.int64))] = values
    # Half an inch a row, the whole at most 18 in; past 32 rows the labels shrink to their rows' height.
    height = min(2.0 + 0.5 * len(layers), 18.0)
    label_points = min(10.0, 0.7 * 72 * (height - 2.0) / len(layers))
    figure = Figure(figsize=(7.2, height), dpi=_DPI)
    axes = figure.subplots()
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    if limits is None:
        finite = grid[np.isfinite(grid)]
        limits = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    image = axes.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=limits[0], vmax=limits[1], aspect="auto",
                        interpolation="nearest")  # fmt: skip
    axes.set_yticks(range(len(layers)), layers, fontsize=label_points)
    axes.set_xlabel("step (grey: no reading, or NaN)")
    axes.set_title(f"{metric} (layer × step)")
    # Margins from the labels' widths, measured once: a layout engine measured every tick label again on
    # each of its passes, most of a heatmap's drawing.
    renderer = FigureCanvasAgg(figure).get_renderer()
    labels_width = max(label.get_window_extent(renderer).width for label in axes.get_yticklabels())
    inch = figure.dpi
    width_pixels, height_pixels = figure.get_size_inches() * inch
    left, right = min((labels_width + 0.15 * inch) / width_pixels, 0.6), 1 - 0.95 * inch / width_pixels
    bottom, top = 0.7 * inch / height_pixels, 1 - 0.45 * inch / height_pixels
    axes.set_position((left, bottom, right - left, top - bottom))
    bar = figure.add_axes(
        (right + 0.12 * inch / width_pixels, bottom, 0.15 * inch / width_pixels, top - bottom)
    )
    figure.colorbar(image, cax=bar)
    # Every k-th column, evenly (rounded positions of 10 ticks over 11–19 columns skip some and not others),
    # as many as the widest step fits with room between them.
    widest = Text(text=str(steps[-1] if steps.size else ""), figure=figure).get_window_extent(renderer).width
    fitting = max(2, min(10, int((right - left) * width_pixels / max(1.6 * widest, 1.0))))
    ticks = range(0, len(steps), -(-len(steps) // fitting))
    axes.set_xticks(ticks, [str(steps[index]) for index in ticks])
    return figure


def _plot_file_name(metric: str) -> str:
    """``family__metric.png``: characters a file name cannot hold replaced, and a name too long for a file
    system (255 bytes) cut, with a hash of the whole name so that two cut names stay apart."""
    name = _UNSAFE_IN_FILE_NAMES.sub("_", metric.replace("/", "__"))
    if len(name) > _LONGEST_PLOT_NAME:
        name = f"{name[:_LONGEST_PLOT_NAME]}-{hashlib.sha1(metric.encode()).hexdigest()[:8]}"
    return f"{name}.png"


def _save(figure: Figure, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = figure.canvas if isinstance(figure.canvas, FigureCanvasAgg) else FigureCanvasAgg(figure)
    # The fastest zlib level: the same pixels, in a larger file, for a fraction of the encoding time.
    canvas.print_png(str(path), pil_kwargs={"compress_level": 1})
    return path


def _signed(value: float) -> str:
    return format_number(value) if not math.isfinite(value) or value < 0 else "+" + format_number(value)

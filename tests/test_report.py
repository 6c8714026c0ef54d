"""``spectral-monitor report``: verdicts against the catalogue's thresholds on readings whose verdict is
known, aligned columns for long layer names, and a run that loads neither torch nor Lightning."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from spectral_monitor.alerts import default_rules
from spectral_monitor.judging import NOT_FINITE, overall_line
from spectral_monitor.report import NOT_MEASURED, RunScalars, verdicts

ROOT = Path(__file__).resolve().parent.parent
LONG = "model.transformer.h.11.attn.a_module_name_longer_than_any_column_width"

SERIES = {
    # Rank collapse: one layer past the threshold (collapsed), one between it and the clear level (watch).
    "attention/rank_one_residual_max": {"model.h.0.attn": [0.5, 0.04, 0.03], LONG: [0.5, 0.2, 0.08]},
    "attention/effective_rank_ratio_max": {"model.h.0.attn": [0.5, 0.4, 0.3], LONG: [0.5, 0.4, 0.3]},
    # Entropy collapse: the mean falls to 0.25 of its running median (collapsed <= 0.3).
    "attention/entropy": {"model.h.0.attn": [0.8, 0.8, 0.2], LONG: [0.8, 0.8, 0.8]},
    "attention/entropy_max": {"model.h.0.attn": [0.9, 0.9, 0.3], LONG: [0.9, 0.9, 0.9]},
    "attention/entropy_min": {"model.h.0.attn": [0.7, 0.7, 0.1], LONG: [0.7, 0.7, 0.7]},
    # Token collapse across depth: blocks.10 is 0.45 above blocks.0 (watch: >= 0.4, < 0.5); blocks.2 0.3.
    "tokens/cosine_similarity": {"blocks.0": [0.1, 0.1, 0.1], "blocks.2": [0.1, 0.2, 0.4],
                                 "blocks.10": [0.1, 0.3, 0.55]},
    "tokens/token_residual": {"blocks.0": [0.9, 0.9, 0.9], "blocks.2": [0.9, 0.9, 0.9],
                              "blocks.10": [0.9, 0.9, float("nan")]},
    # Weight runaway: 25 times its first value (collapsed >= 20).
    "weights/spectral_norm": {"head": [1.0, 5.0, 25.0], "embedding": [2.0, 2.0, 2.0]},
}  # fmt: skip
STEPS = [0, 49, 99]


def run_of(series: dict[str, dict[str, list[float]]]) -> RunScalars:
    run = RunScalars(Path("run"))
    for metric, by_layer in series.items():
        run.series[metric] = {
            layer: (np.array(STEPS), np.array(values, dtype=np.float64)) for layer, values in by_layer.items()
        }
    return run


def test_verdicts_name_the_worst_layer_and_its_reading_against_the_thresholds() -> None:
    judged = {entry.diagnosis.rule: entry for entry in verdicts(run_of(SERIES))}
    rank = judged["rank_collapse"]
    assert (rank.verdict, rank.layer, rank.step) == ("collapsed", "model.h.0.attn", 99)
    assert rank.reading == (
        "attention/rank_one_residual_max 0.030 (collapsed at or below 0.05, watch at or below 0.1)"
    )
    entropy = judged["entropy_collapse"]
    assert (entropy.verdict, entropy.layer) == ("collapsed", "model.h.0.attn")
    assert entropy.reading.startswith(
        "attention/entropy as a multiple of its running median of up to 8 readings 0.250 "
        "(collapsed at or below 0.3"
    )
    tokens = judged["token_collapse"]
    assert (tokens.verdict, tokens.layer) == ("watch", "blocks.10")
    assert tokens.reading.startswith(
        "tokens/cosine_similarity minus the first layer's 0.450 "
        "(collapsed at or above 0.5, watch at or above 0.4)"
    )
    assert (tokens.layers, tokens.value, tokens.collapsed_level, tokens.watch_level) == (
        ("blocks.10",),
        pytest.approx(0.45),
        0.5,
        0.4,
    )
    weights = judged["weight_runaway"]
    assert (weights.verdict, weights.layer) == ("collapsed", "head")
    assert weights.reading.startswith("weights/spectral_norm as a multiple of its first value 25.000")
    non_finite = judged["non_finite"]
    assert (non_finite.verdict, non_finite.layer) == ("collapsed", "blocks.10")
    # Causal attention writes no eigen_gap, so uniform attention (both conditions) cannot be judged.
    for rule in ("uniform_attention", "edge_of_stability", "jacobian_explosion"):
        assert judged[rule].verdict == NOT_MEASURED
    assert "CurvatureOptions" in judged["edge_of_stability"].how_to_measure
    assert "JacobianOptions" in judged["jacobian_explosion"].how_to_measure


def test_the_overall_line_names_the_worst_diagnosis_and_every_layer_at_that_verdict() -> None:
    two_layers = {
        "attention/rank_one_residual_max": {
            "blocks.2.attn": [0.5, 0.04],
            "blocks.10.attn": [0.5, 0.01],
            "blocks.0.attn": [0.5, 0.5],
        },
        "tokens/cosine_similarity": {"blocks.0": [0.1, 0.92]},
    }
    run = RunScalars(Path("run"))
    run.series = {metric: {layer: (np.array([0, 9]), np.array(values)) for layer, values in by_layer.items()}
                  for metric, by_layer in two_layers.items()}  # fmt: skip
    judged = verdicts(run)
    rank = next(entry for entry in judged if entry.diagnosis.rule == "rank_collapse")
    # The nearer past its threshold comes first; the healthy layer is not named.
    assert rank.layers == ("blocks.10.attn", "blocks.2.attn")
    assert overall_line(judged) == "COLLAPSED: rank collapse in blocks.10.attn, blocks.2.attn"
    healthy = RunScalars(Path("run"))
    healthy.series = {"attention/rank_one_residual_max": {"l": (np.array([0, 9]), np.array([0.5, 0.6]))}}
    assert overall_line(verdicts(healthy)).startswith("HEALTHY: every measured diagnosis")


def test_a_diagnosis_whose_readings_went_non_finite_says_so_not_how_to_measure_it() -> None:
    nan = float("nan")
    run = run_of({
        "attention/entropy": {"blocks.0.attn": [0.8, nan, nan], "blocks.1.attn": [0.8, 0.7, nan]},
        "tokens/cosine_similarity": {"blocks.0": [0.1, 0.1, 0.1], "blocks.1": [0.1, 0.2, nan]},
    })  # fmt: skip
    judged = {entry.diagnosis.rule: entry for entry in verdicts(run)}
    entropy = judged["entropy_collapse"]
    assert (entropy.verdict, entropy.layers, entropy.step) == (
        NOT_FINITE,
        ("blocks.0.attn", "blocks.1.attn"),
        99,
    )
    assert entropy.reading == (
        "attention/entropy is NaN or inf in blocks.0.attn, blocks.1.attn since step 49: see non-finite values"
    )
    assert judged["token_collapse"].verdict == "healthy"  # a finite layer is judged
    assert judged["uniform_attention"].verdict == NOT_MEASURED  # eigen_gap never written: causal
    assert judged["rank_collapse"].verdict == NOT_MEASURED
    assert judged["non_finite"].verdict == "collapsed"


def test_the_watch_band_lies_between_the_clear_level_and_the_threshold() -> None:
    def rank_verdict(residual: float) -> str:
        series = {"attention/rank_one_residual_max": {"l": [0.5, 0.5, residual]}}
        (rank,) = [entry for entry in verdicts(run_of(series)) if entry.diagnosis.rule == "rank_collapse"]
        return rank.verdict

    assert [rank_verdict(r) for r in (0.05, 0.0500001, 0.1, 0.1000001)] == [
        "collapsed",
        "watch",
        "watch",
        "healthy",
    ]


def test_the_worst_head_is_read_where_the_spread_is_written_else_the_mean() -> None:
    # Every head must be rank one: the _max decides; without it, the mean.
    spread = {"attention/rank_one_residual": {"l": [0.5, 0.5, 0.02]},
              "attention/rank_one_residual_max": {"l": [0.5, 0.5, 0.3]}}  # fmt: skip
    (rank,) = [entry for entry in verdicts(run_of(spread)) if entry.diagnosis.rule == "rank_collapse"]
    assert rank.verdict == "healthy"
    mean_only = {"attention/rank_one_residual": {"l": [0.5, 0.5, 0.02]}}
    (rank,) = [entry for entry in verdicts(run_of(mean_only)) if entry.diagnosis.rule == "rank_collapse"]
    assert (rank.verdict, rank.reading.split()[0]) == ("collapsed", "attention/rank_one_residual")


def write_events(logdir: Path, series: dict[str, dict[str, list[float]]] = SERIES) -> None:
    writer = SummaryWriter(str(logdir))
    for metric, by_layer in series.items():
        for layer, values in by_layer.items():
            for step, value in zip(STEPS, values, strict=True):
                writer.add_scalar(f"{metric}/{layer}", value, step)
    writer.close()


def test_report_prints_aligned_columns_and_loads_neither_torch_nor_lightning(tmp_path: Path) -> None:
    write_events(tmp_path / "logs")
    code = (
        "import sys; from spectral_monitor.cli import main; "
        f"status = main(['report', {str(tmp_path / 'logs')!r}, '--out', {str(tmp_path / 'out')!r}]); "
        "print('loaded:', [m for m in ('torch', 'pytorch_lightning', 'lightning') if m in sys.modules]); "
        "sys.exit(status)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout
    assert "loaded: []" in printed
    # The verdict leads: the overall line comes right after the run's heading, before any table.
    heading, overall = printed.strip().splitlines()[:2]
    assert heading.startswith("== ")
    assert overall.startswith("COLLAPSED: ") and "model.h.0.attn" in overall
    assert printed.index("verdicts") < printed.index("alerts") < printed.index("per-layer details")
    verdict_lines = printed.split("verdicts", 1)[1].splitlines()[1:]
    header, rule = verdict_lines[0], verdict_lines[1]
    assert set(rule) == {"-"}
    for title, verdict in (("Rank collapse", "collapsed"), ("Token collapse", "watch"),
                           ("Uniform attention", NOT_MEASURED)):  # fmt: skip
        (line,) = [line for line in verdict_lines if line.startswith(title)]
        assert line[header.index("verdict") :].startswith(verdict)

    table = printed[printed.index("\nlayer ") + 1 :].splitlines()
    table = table[: next(i for i, line in enumerate(table) if line.startswith("report:"))]
    header, rows = table[0], table[2:]
    assert any(row.startswith(LONG) for row in rows)
    metric_column = header.index("metric")
    latest_end = header.index("latest") + len("latest")
    for row in rows:
        assert row[metric_column - 2 : metric_column] == "  " and row[metric_column] != " ", row
        assert re.fullmatch(r"[+-]?[\d.e+-]+|nan", row[:latest_end].split()[-1]), row


@pytest.mark.parametrize("files", [False, True])
def test_report_on_a_logdir_without_monitor_scalars_is_an_error(tmp_path: Path, files: bool) -> None:
    if files:
        writer = SummaryWriter(str(tmp_path))
        writer.add_scalar("train/loss", 1.0, 0)
        writer.close()
    code = f"from spectral_monitor.cli import main; raise SystemExit(main(['report', {str(tmp_path)!r}]))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    assert result.returncode == 2
    assert "spectral-monitor report: error:" in result.stderr


EVERY_RULE = {rule.name for rule in default_rules()}


def test_a_plot_draws_the_collapsed_and_watch_levels_of_its_metric() -> None:
    from spectral_monitor.report import _metric_by_layer

    series = {"blocks.0": (np.array(STEPS), np.array([0.3, 0.2, 0.004]))}
    (axes,) = _metric_by_layer("attention/effective_rank_ratio_max", series, EVERY_RULE).axes
    levels = {
        line.get_label(): line.get_ydata()[0] for line in axes.get_lines() if line.get_label() != "blocks.0"
    }
    assert levels == {
        "rank_collapse: collapsed at or below 0.01": 0.01,
        "rank_collapse: watch at or below 0.02": 0.02,
    }
    (axes,) = _metric_by_layer("attention/dobrushin", series, EVERY_RULE).axes
    assert [line.get_label() for line in axes.get_lines()] == ["blocks.0"]  # no threshold: nothing drawn


def test_a_plot_draws_the_levels_of_the_rules_the_run_is_judged_on_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spectral_monitor import report as report_module

    # A causal model writes no eigen_gap: uniform attention is not judged, so its levels (entropy at or
    # above 0.95) would paint a healthy causal layer's entropy near 1 as collapsed.
    entropy = {"blocks.0": (np.array(STEPS), np.array([1.0, 0.99, 0.98]))}
    labels = [
        line.get_label()
        for line in report_module._metric_by_layer(
            "attention/entropy", entropy, EVERY_RULE - {"uniform_attention"}
        )
        .axes[0]
        .get_lines()
    ]
    assert labels == [
        "blocks.0",
        "entropy_collapse: collapsed at or below 0.05",
        "entropy_collapse: watch at or below 0.1",
        "entropy_collapse: collapsed at or below 0.3 × its running median (dashed)",
    ]
    drawn_with = []
    metric_by_layer = report_module._metric_by_layer
    monkeypatch.setattr(
        report_module,
        "_metric_by_layer",
        lambda metric, by_layer, rules, figure=None, spread=({}, {}): (
            drawn_with.append(rules) or metric_by_layer(metric, by_layer, rules, figure, spread)
        ),
    )
    write_events(tmp_path / "logs")  # SERIES: no eigen_gap, max_logit, curvature or Jacobian
    report_module.write_report(tmp_path / "logs", tmp_path / "out")
    judged = {"rank_collapse", "entropy_collapse", "token_collapse", "weight_runaway", "non_finite"}
    assert drawn_with and all(rules == judged for rules in drawn_with)


def test_a_plot_spans_every_step_and_marks_where_readings_went_non_finite() -> None:
    from spectral_monitor.report import _metric_by_layer

    nan = float("nan")
    series = {"blocks.0": (np.array(STEPS), np.array([0.8, nan, nan])),
              "blocks.1": (np.array(STEPS), np.array([0.8, 0.7, nan]))}  # fmt: skip
    (axes,) = _metric_by_layer("attention/entropy", series, EVERY_RULE).axes
    assert axes.get_xlim()[1] >= 99  # not cut at the last finite reading (step 49)
    (marks,) = [line for line in axes.get_lines() if line.get_label() == "NaN or inf"]
    assert list(marks.get_xdata()) == [49, 99]
    assert not axes.texts
    gone = {"blocks.0": (np.array(STEPS), np.full(3, nan))}
    (axes,) = _metric_by_layer("attention/entropy", gone, EVERY_RULE, axes.figure).axes
    assert [text.get_text() for text in axes.texts] == ["no finite reading"]
    assert axes.get_xlim()[0] <= 0 and axes.get_xlim()[1] >= 99


def test_relative_levels_follow_the_first_value_the_running_median_and_the_first_layer() -> None:
    from spectral_monitor.catalog import diagnosis
    from spectral_monitor.judging import relative_levels

    ((_, runaway),) = diagnosis("weight_runaway")[1]
    norms = {"head": (np.array([0, 1, 2]), np.array([float("nan"), 2.0, 50.0]))}
    assert relative_levels(runaway, norms, runaway.threshold)["head"].tolist() == [40.0, 40.0, 40.0]
    depth = next(t for _, t in diagnosis("token_collapse")[1] if t.relative_to == "depth")
    cosine = {
        "blocks.1": (np.array([0, 5]), np.array([0.3, 0.9])),
        "blocks.0": (np.array([0, 5]), np.array([0.1, 0.2])),
    }
    assert relative_levels(depth, cosine, depth.threshold)["blocks.1"] == pytest.approx([0.6, 0.7])
    median = next(t for _, t in diagnosis("entropy_collapse")[1] if t.relative_to == "median")
    # The engine's window: the previous finite readings, up to 8 of them.
    values = np.array([1.0, 2.0, 3.0, float("nan"), 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    levels = relative_levels(median, {"l": (np.arange(values.size), values)}, 1.0)["l"]
    assert np.isnan(levels[0]) and levels[1:4].tolist() == [1.0, 1.5, 2.0]
    assert levels[10] == np.median([2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])


def test_the_running_median_levels_of_a_long_run_with_gaps_are_each_readings_own() -> None:
    """Every step of a long series with NaN gaps and zeros against the median recomputed at that step from
    the previous finite readings, up to the engine's window."""
    from spectral_monitor.alerts.rules import MEDIAN_WINDOW
    from spectral_monitor.catalog import diagnosis
    from spectral_monitor.judging import relative_levels

    median = next(t for _, t in diagnosis("entropy_collapse")[1] if t.relative_to == "median")
    values = np.random.default_rng(0).random(500)
    values[np.random.default_rng(1).random(500) < 0.2] = np.nan
    values[[3, 40, 41, 42, 43, 44, 45, 46, 47]] = 0.0  # a zero median has no level
    levels = relative_levels(median, {"l": (np.arange(values.size), values)}, 0.3)["l"]
    for index, level in enumerate(levels):
        previous = values[:index][np.isfinite(values[:index])][-MEDIAN_WINDOW:]
        expected = 0.3 * np.median(previous) if previous.size and np.median(previous) != 0 else np.nan
        assert level == pytest.approx(expected, nan_ok=True), index


def test_a_plot_draws_each_layers_own_level_of_a_relative_threshold() -> None:
    from spectral_monitor.report import _metric_by_layer

    entropy = {"blocks.0": (np.array(STEPS), np.array([0.8, 0.8, 0.2])),
               "blocks.1": (np.array(STEPS), np.array([0.6, 0.6, 0.6]))}  # fmt: skip
    (axes,) = _metric_by_layer("attention/entropy", entropy, {"entropy_collapse"}).axes
    levels = [
        np.asarray(line.get_ydata(), dtype=float)
        for line in axes.get_lines()
        if line.get_linestyle() == "--" and len(line.get_ydata()) == 3
    ]
    np.testing.assert_allclose(levels[0], [np.nan, 0.24, 0.24])  # 0.3 x blocks.0's running median
    np.testing.assert_allclose(levels[1], [np.nan, 0.18, 0.18])
    assert levels[0][-1] > 0.2  # blocks.0's last reading is past its own level: collapsed, as judged
    (axes,) = _metric_by_layer("attention/entropy_max", entropy, {"entropy_collapse"}).axes
    assert not [line for line in axes.get_lines() if "running median" in line.get_label()]


def test_the_range_over_heads_a_verdict_reads_is_shaded_on_its_means_plot() -> None:
    """Rank collapse reads the worst head (rank_one_residual_max): the plot of the mean shades each layer's
    range over heads, whose edges are the _min and _max series."""
    from spectral_monitor.report import _metric_by_layer

    steps = np.array(STEPS)
    mean = {"blocks.0": (steps, np.array([0.5, 0.3, 0.2]))}
    lowest = {"blocks.0": (steps, np.array([0.4, 0.1, 0.03]))}
    highest = {"blocks.0": (steps, np.array([0.6, 0.5, 0.4]))}
    (axes,) = _metric_by_layer("attention/rank_one_residual", mean, EVERY_RULE, None, (lowest, highest)).axes
    (band,) = axes.collections
    assert band.get_label() == "spread over heads, to the worst (shaded)"
    vertices = band.get_paths()[0].vertices
    assert sorted(set(vertices[:, 1].round(6))) == [0.03, 0.1, 0.4, 0.5, 0.6]
    (axes,) = _metric_by_layer("attention/dobrushin", mean, EVERY_RULE, axes.figure).axes
    assert not axes.collections  # none for a metric without head aggregates; the last plot's is gone


def test_a_metric_of_more_than_a_dozen_layers_is_drawn_as_a_heatmap_over_its_own_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spectral_monitor import report as report_module

    norms = {
        f"blocks.{i}.mlp": [1.0 + i, 2.0 + i, 3.0 + i] for i in (10, 2, 0, 3, 1, 4, 5, 6, 7, 8, 9, 11, 12)
    }
    write_events(tmp_path / "logs", {**SERIES, "weights/spectral_norm": norms})
    heatmaps = {}
    layer_step_heatmap = report_module._layer_step_heatmap

    def drawn(metric, by_layer, limits=None):  # what the figure shows, read before it is saved and cleared
        figure = layer_step_heatmap(metric, by_layer, limits)
        axes = figure.axes[0]
        heatmaps[metric] = ([label.get_text() for label in axes.get_yticklabels()], axes.images[0].get_clim())
        return figure

    monkeypatch.setattr(report_module, "_layer_step_heatmap", drawn)
    report_module.write_report(tmp_path / "logs", tmp_path / "out")
    # Layers in model order (blocks.2 before blocks.10), the colours from the smallest reading to the largest.
    assert heatmaps["weights/spectral_norm"] == ([f"blocks.{i}.mlp" for i in range(13)], (1.0, 15.0))
    assert (tmp_path / "out" / "plots" / "weights__spectral_norm.png").stat().st_size > 0
    assert "attention/entropy" not in heatmaps  # two layers: lines


def test_plots_drawn_by_two_worker_processes_are_the_files_the_report_draws_alone(tmp_path: Path) -> None:
    from spectral_monitor.report import write_report

    norms = {f"blocks.{i}.mlp": [1.0 + i, 2.0 + i, 3.0 + i] for i in range(13)}  # a heatmap among the lines
    write_events(tmp_path / "logs", {**SERIES, "weights/spectral_norm": norms})
    (alone,) = write_report(tmp_path / "logs", tmp_path / "alone")
    (shared,) = write_report(tmp_path / "logs", tmp_path / "shared", processes=2)
    assert shared.read_text() == alone.read_text().replace("alone", "shared")
    plots = sorted(path.name for path in (tmp_path / "alone" / "plots").iterdir())
    assert len(plots) == 4 and plots == sorted(
        path.name for path in (tmp_path / "shared" / "plots").iterdir()
    )
    for name in plots:
        assert (tmp_path / "shared" / "plots" / name).read_bytes() == (
            tmp_path / "alone" / "plots" / name
        ).read_bytes(), name
    with pytest.raises(ValueError, match="processes must be at least 1"):
        write_report(tmp_path / "logs", tmp_path / "none", processes=0)


def test_plots_are_dealt_to_the_drawers_so_that_each_has_the_same_drawing_to_within_a_line_plot() -> None:
    from spectral_monitor.report import _balanced_shares, _Plot

    steps = np.arange(3)
    lines = [_Plot(Path(f"line{i}.png"), f"m/{i}", {"a": (steps, steps * 1.0)}, False) for i in range(22)]
    weights = {f"blocks.{i}.mlp": (steps, steps * 1.0) for i in range(37)}
    heatmaps = [_Plot(Path(f"heat{i}.png"), f"w/{i}", weights, True) for i in range(4)]
    # The report's order: a small heatmap first, the lines, the large heatmaps last (dealt in turn, the
    # first drawer would get three heatmaps of the five).
    plots = [_Plot(Path("rank.png"), "a/r", {"a": (steps, steps * 1.0)}, True), *lines, *heatmaps]
    for count in (2, 3):
        shares = _balanced_shares(plots, count)
        assert sorted(plot.path for share in shares for plot in share) == sorted(plot.path for plot in plots)
        loads = [sum(plot.cost for plot in share) for share in shares]
        assert max(loads) - min(loads) <= 1.0, loads


@pytest.mark.parametrize("failure", ["no process starts", "a worker dies"])
def test_plots_are_drawn_in_process_where_worker_processes_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    from spectral_monitor import report as report_module

    class FailingPool:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def submit(self, function: object, *args: object) -> Future:
            if failure == "no process starts":
                raise PermissionError(1, "Operation not permitted")
            future: Future = Future()
            if function is report_module._import_drawing:
                future.set_result(None)
            else:
                future.set_exception(BrokenProcessPool("A child process terminated abruptly"))
            return future

        def shutdown(self, cancel_futures: bool = False) -> None:
            pass

    write_events(tmp_path / "logs")
    (alone,) = report_module.write_report(tmp_path / "logs", tmp_path / "alone")
    monkeypatch.setattr(report_module, "ProcessPoolExecutor", FailingPool)
    (shared,) = report_module.write_report(tmp_path / "logs", tmp_path / "shared", processes=2)
    plots = sorted((tmp_path / "alone" / "plots").iterdir())
    assert plots and [path.name for path in plots] == sorted(
        p.name for p in (tmp_path / "shared" / "plots").iterdir()
    )
    for path in plots:
        assert (tmp_path / "shared" / "plots" / path.name).read_bytes() == path.read_bytes(), path.name


def test_a_heatmaps_step_ticks_are_evenly_spaced_columns() -> None:
    from spectral_monitor.report import _layer_step_heatmap

    steps = np.array([0, *range(9, 100, 10)])  # 11 logging steps: the first, then every tenth
    by_layer = {f"blocks.{i}": (steps, np.linspace(0, 1, steps.size)) for i in range(13)}
    (axes, _) = _layer_step_heatmap("weights/spectral_norm", by_layer).axes
    assert list(axes.get_xticks()) == [0, 2, 4, 6, 8, 10]
    assert [label.get_text() for label in axes.get_xticklabels()] == ["0", "19", "39", "59", "79", "99"]
    assert "grey" in axes.get_xlabel()


def test_a_heatmaps_labels_and_colour_bar_lie_inside_it_and_its_step_ticks_do_not_overlap() -> None:
    """37 weights of GPT-2 over 2,000 logging steps: the longest layer name, the colour bar's labels and
    every step label are drawn inside the figure, the step labels apart from each other."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from spectral_monitor.report import _layer_step_heatmap

    steps = np.arange(2000) * 50
    parts = ("attn.c_proj", "attn.q", "attn.k", "attn.v", "mlp.c_fc", "mlp.c_proj")
    names = ["lm_head"] + [f"transformer.h.{i}.{part}" for i in range(6) for part in parts]
    by_layer = {name: (steps, np.linspace(100, 300, steps.size)) for name in names}
    figure = _layer_step_heatmap("weights/stable_rank", by_layer)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    axes, bar = figure.axes
    inside = figure.bbox
    drawn = [*axes.get_yticklabels(), *bar.get_yticklabels(), *axes.get_xticklabels(), axes.title]
    for label in drawn:
        extent = label.get_window_extent(renderer)
        assert inside.x0 <= extent.x0 and extent.x1 <= inside.x1, label.get_text()
        assert inside.y0 <= extent.y0 and extent.y1 <= inside.y1, label.get_text()
    step_labels = sorted(
        (label.get_window_extent(renderer) for label in axes.get_xticklabels()), key=lambda e: e.x0
    )
    assert len(step_labels) >= 3
    assert all(left.x1 < right.x0 for left, right in itertools.pairwise(step_labels))
    assert axes.bbox.x1 < bar.bbox.x0  # the colour bar beside the image, not over it


def test_a_long_series_is_drawn_through_its_envelope_with_every_spike_and_gap() -> None:
    from spectral_monitor.report import _ENVELOPE_BUCKETS, _metric_by_layer

    steps = np.arange(2000) * 50
    values = 0.5 + 0.1 * np.sin(steps / 700.0)
    values[1234] = 0.97  # a one-reading spike
    values[1500] = 0.01
    values[300:340] = np.nan  # a stretch without finite readings
    (axes,) = _metric_by_layer("attention/dobrushin", {"blocks.0": (steps, values)}, EVERY_RULE).axes
    (line,) = [line for line in axes.get_lines() if line.get_label() == "blocks.0"]
    drawn_steps, drawn = np.asarray(line.get_xdata()), np.asarray(line.get_ydata())
    assert len(drawn) <= 2 * _ENVELOPE_BUCKETS
    assert (np.diff(drawn_steps) > 0).all()
    assert np.nanmax(drawn) == 0.97 and np.nanmin(drawn) == 0.01
    assert steps[1234] in drawn_steps and steps[1500] in drawn_steps
    assert np.isnan(drawn).any()  # the gap stays a gap
    # Each kept point is a reading of the series at its own step.
    index = drawn_steps // 50
    np.testing.assert_array_equal(drawn, values[index])


@pytest.mark.parametrize(
    ("layers", "pattern", "names"),
    [
        ([f"transformer.h.{i}.attn" for i in range(3)], "transformer.h.*.attn", ["0", "1", "2"]),
        (["blocks.0", "blocks.10"], "blocks.*", ["0", "10"]),
        (["encoder.a.mlp", "decoder.a.mlp"], "*.a.mlp", ["encoder", "decoder"]),
        (["a.b", "a.b.c"], "a.*", ["b", "b.c"]),  # every name keeps a part of its own
        (["head", "embedding"], None, ["head", "embedding"]),
        (["blocks.0.attn"], None, ["blocks.0.attn"]),  # one layer: its whole name
    ],
)
def test_a_legend_names_layers_by_what_sets_them_apart_under_the_pattern_they_share(
    layers: list[str], pattern: str | None, names: list[str]
) -> None:
    from spectral_monitor.report import _legend_names

    assert _legend_names(layers) == (pattern, names)


def test_the_legend_stands_beside_the_axes_inside_the_figure_however_many_entries_it_holds() -> None:
    from spectral_monitor.report import _AXES_EDGES_INCHES, _DPI, _PLOT_INCHES, _metric_by_layer

    steps = np.arange(0, 3000, 10)
    name = "model.a_module_name_longer_than_a_legend_line.h.{}.attn"  # a title that must wrap
    layers = {name.format(i): (steps, 0.5 + 0.3 * np.sin(steps / 300 + i)) for i in range(12)}
    low = {layer: (steps, values - 0.1) for layer, (steps, values) in layers.items()}
    high = {layer: (steps, values + 0.1) for layer, (steps, values) in layers.items()}
    figure = None
    wide = {glyph * 34: (steps, np.cos(steps)) for glyph in "WM"}  # lines of the widest glyphs
    # A dozen layers, their spread, two rules' levels and a relative level; wide names; a layer, no level.
    for by_layer, spread, metric in [
        (layers, (low, high), "attention/entropy"),
        (wide, ({}, {}), "attention/dobrushin"),
        ({"blocks.0": (steps, np.cos(steps))}, ({}, {}), "attention/dobrushin"),
    ]:
        figure = _metric_by_layer(metric, by_layer, EVERY_RULE, figure, spread)
        figure.canvas.draw()
        (axes,) = figure.axes
        legend = axes.get_legend().get_window_extent(figure.canvas.get_renderer())
        inside = figure.bbox
        assert inside.x0 <= legend.x0 and legend.x1 <= inside.x1 and inside.y0 <= legend.y0, metric
        assert legend.y1 <= inside.y1 and axes.bbox.x1 < legend.x0, metric
        edges = tuple(inches * _DPI for inches in _AXES_EDGES_INCHES)
        assert (axes.bbox.x0, axes.bbox.x1) == pytest.approx(edges), metric  # the axes stay put
    assert tuple(figure.get_size_inches()) == _PLOT_INCHES  # back to the usual size for a short legend


def test_a_figure_redrawn_for_another_metric_shows_that_metric_alone() -> None:
    from spectral_monitor.report import _metric_by_layer

    large = {
        "blocks.0": (np.array(STEPS), np.array([40.0, 55.0, 70.0])),
        "blocks.1": (np.array(STEPS), np.ones(3)),
    }
    small = {"blocks.0": (np.array(STEPS), np.array([0.3, 0.2, 0.004]))}
    redrawn = _metric_by_layer(
        "attention/effective_rank_ratio_max", small, EVERY_RULE, _metric_by_layer("x/y", large, EVERY_RULE)
    )
    fresh = _metric_by_layer("attention/effective_rank_ratio_max", small, EVERY_RULE)
    (axes,), (fresh_axes,) = redrawn.axes, fresh.axes
    assert [line.get_label() for line in axes.get_lines()] == [
        line.get_label() for line in fresh_axes.get_lines()
    ]
    assert axes.get_ylim() == fresh_axes.get_ylim() and axes.get_xlim() == fresh_axes.get_xlim()
    assert axes.get_title() == "attention/effective_rank_ratio_max"
    assert [text.get_text() for text in axes.get_legend().get_texts()] == [
        text.get_text() for text in fresh_axes.get_legend().get_texts()
    ]

"""The monitor's TensorBoard tab: a collapsing run is judged collapsed in its layer and a healthy one healthy,
with the verdicts of ``spectral-monitor report`` (one implementation); charts hold one line per layer and
the thresholds; a real TensorBoard serves it (both loaders) and headless Chromium renders it.

Runs are written through the monitor's own sink and alert engine, so the event files hold what a training
run would write (the alert tables included) in a fraction of a second.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.tensorboard_server import LOAD_TIMEOUT_S, poll, tensorboard_server
from tensorboard import context as tb_context
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.backend.event_processing.data_ingester import (
    DEFAULT_SIZE_GUIDANCE,
    DEFAULT_TENSOR_SIZE_GUIDANCE,
)
from tensorboard.backend.event_processing.data_provider import MultiplexerDataProvider
from tensorboard.plugins import base_plugin

from spectral_monitor.alerts import AlertEngine, default_rules, open_alerts_markdown
from spectral_monitor.core.alerting import ALERT_TEXT_TAG
from spectral_monitor.dashboard import SpectralMonitorPlugin
from spectral_monitor.dashboard.plugin import CHART_POINTS
from spectral_monitor.records import Measurement
from spectral_monitor.report import RunScalars, verdicts
from spectral_monitor.sinks import TensorBoardSink

ATTENTION = tuple(f"blocks.{index}.attention" for index in range(4))
BLOCKS = tuple(f"blocks.{index}" for index in range(4))
COLLAPSING_LAYER = "blocks.2.attention"
COLLAPSING, HEALTHY = "collapsing", "healthy"
STEPS = tuple(range(0, 50, 5))


def healthy_attention(step: int, layer: str) -> dict[str, float]:
    return {
        "effective_rank_ratio_max": 0.3,
        "effective_rank_ratio": 0.2,
        "rank_one_residual_max": 0.6,
        "entropy": 0.7,
        "entropy_max": 0.8,
        "entropy_min": 0.6,
        "max_logit_max": 4.0 + 0.01 * step,
    }


def write_run(
    logdir: Path,
    collapsing: bool,
    steps: tuple[int, ...] = STEPS,
    per_head: bool = False,
    collapsing_layers: tuple[str, ...] = (COLLAPSING_LAYER,),
) -> None:
    """A run of 4 attention layers and 4 blocks through the monitor's sink and alert engine; with
    ``collapsing``, every head of ``blocks.2.attention`` goes rank one from step 20."""
    engine = AlertEngine(default_rules())
    sink = TensorBoardSink(str(logdir))
    for index, step in enumerate(steps):
        records = [Measurement(step, "weights", "spectral_norm", "head", 2.0 + 0.001 * step)]
        heads = []  # the alert rules read each head; the sink writes them only with per_head
        for layer in ATTENTION:
            values = healthy_attention(step, layer)
            if collapsing and layer in collapsing_layers and step >= 20:
                values.update(effective_rank_ratio_max=0.004, effective_rank_ratio=0.003)
                values.update(rank_one_residual_max=0.03)
            records += [Measurement(step, "attention", name, layer, value) for name, value in values.items()]
            heads += [
                Measurement(step, "attention", "effective_rank_ratio", layer, value, head=head)
                for head, value in enumerate(
                    (values["effective_rank_ratio"], values["effective_rank_ratio_max"])
                )
            ]
        for block in BLOCKS:
            records += [Measurement(step, "tokens", "cosine_similarity", block, 0.2),
                        Measurement(step, "tokens", "token_residual", block, 0.9)]  # fmt: skip
        events = engine.evaluate(step, records + heads)
        sink.write_measurements(records + (heads if per_head else []) + engine.counter_records(step))
        if events or index == 0:
            sink.write_text(ALERT_TEXT_TAG, open_alerts_markdown(engine.open_alerts, step), step)
    sink.close()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    write_run(root / COLLAPSING, collapsing=True, per_head=True)
    write_run(root / HEALTHY, collapsing=False)
    return root


def loaded(logdir: Path) -> tuple[SpectralMonitorPlugin, plugin_event_multiplexer.EventMultiplexer]:
    """The plugin over the data provider TensorBoard's Python loader builds for ``logdir``, and the loader
    (``Reload()`` it to read what was written since)."""
    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        size_guidance=DEFAULT_SIZE_GUIDANCE, tensor_size_guidance=DEFAULT_TENSOR_SIZE_GUIDANCE
    )
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = MultiplexerDataProvider(multiplexer, str(logdir))
    return SpectralMonitorPlugin(
        base_plugin.TBContext(data_provider=provider, logdir=str(logdir))
    ), multiplexer


def plugin_on(logdir: Path) -> SpectralMonitorPlugin:
    return loaded(logdir)[0]


def request() -> tb_context.RequestContext:
    return tb_context.RequestContext()


def test_the_collapsing_run_is_collapsed_in_its_layer_and_the_healthy_run_healthy(logdir: Path) -> None:
    judged = plugin_on(logdir).run_verdicts(request(), "")
    assert set(judged) == {COLLAPSING, HEALTHY}
    rank = judged[COLLAPSING]["rank_collapse"]
    assert (rank["verdict"], rank["layers"], rank["step"]) == ("collapsed", [COLLAPSING_LAYER], 45)
    assert rank["metric"] == "attention/effective_rank_ratio_max"
    assert rank["value"] == pytest.approx(0.004)
    assert rank["threshold"] == {"op": "<=", "collapsed": 0.01, "watch": 0.02, "relative_to": "value"}
    # The rule fired (patience 2) at step 25 in that layer: the alert carries its remedy.
    (alert,) = rank["alerts"]
    assert (alert["fired_at"], alert["where"].split()[0]) == (25, COLLAPSING_LAYER)
    assert "γ·log n" in alert["remedy"]
    assert {rule: entry["verdict"] for rule, entry in judged[HEALTHY].items()} == {
        "rank_collapse": "healthy",
        "uniform_attention": "not measured",  # causal-like: no eigen_gap
        "entropy_collapse": "healthy",
        "logit_growth": "healthy",
        "token_collapse": "healthy",
        "edge_of_stability": "not measured",
        "jacobian_explosion": "not measured",
        "weight_runaway": "healthy",
        "non_finite": "healthy",
    }
    assert "CurvatureOptions" in judged[HEALTHY]["edge_of_stability"]["how_to_measure"]


def test_the_summary_leads_with_the_overall_line_and_charts_in_diagnosis_order(logdir: Path) -> None:
    summary = plugin_on(logdir).run_summary(request(), "")
    assert summary[COLLAPSING]["worst"] == "collapsed"
    assert summary[COLLAPSING]["overall"] == f"COLLAPSED: rank collapse in {COLLAPSING_LAYER}"
    assert summary[HEALTHY]["overall"].startswith("HEALTHY")
    charts = summary[COLLAPSING]["charts"]
    assert [chart["rule"] for chart in charts] == [
        "rank_collapse", "entropy_collapse", "logit_growth", "token_collapse", "weight_runaway"
    ]  # fmt: skip
    assert charts[0]["metrics"] == ["attention/rank_one_residual_max", "attention/effective_rank_ratio_max"]
    assert "attention/effective_rank_ratio" in summary[COLLAPSING]["more"]
    assert not any(name.startswith("alerts/") for name in summary[COLLAPSING]["more"])


def test_the_tab_and_the_report_give_the_same_verdicts(logdir: Path) -> None:
    served = plugin_on(logdir).run_verdicts(request(), "")
    for run in (COLLAPSING, HEALTHY):
        reported = {
            entry.diagnosis.rule: entry.as_dict() for entry in verdicts(RunScalars.load(logdir / run))
        }
        assert {
            rule: {k: v for k, v in entry.items() if k != "alerts"} for rule, entry in served[run].items()
        } == (reported)


def test_a_chart_has_a_line_per_layer_its_thresholds_and_per_head_lines_on_demand(logdir: Path) -> None:
    plugin = plugin_on(logdir)
    chart = plugin.chart(request(), "", COLLAPSING, "attention/effective_rank_ratio_max", None)
    assert [line["name"] for line in chart["lines"]] == list(ATTENTION)
    collapsing = chart["lines"][ATTENTION.index(COLLAPSING_LAYER)]
    assert collapsing["steps"] == list(STEPS)
    assert collapsing["values"][-1] == pytest.approx(0.004)
    assert chart["thresholds"] == [
        {"rule": "rank_collapse", "op": "<=", "collapsed": 0.01, "watch": 0.02, "relative_to": "value"}
    ]
    heads = plugin.chart(request(), "", COLLAPSING, "attention/effective_rank_ratio", COLLAPSING_LAYER)
    assert [line["name"] for line in heads["lines"]] == [
        f"{COLLAPSING_LAYER}/head_0",
        f"{COLLAPSING_LAYER}/head_1",
    ]
    assert heads["lines"][1]["values"][0] == pytest.approx(0.3)
    assert heads["lines"][1]["values"][-1] == pytest.approx(0.004)
    # A head aggregate's chart (what the diagnoses lead with) opens its metric's heads.
    of_the_maximum = plugin.chart(
        request(), "", COLLAPSING, "attention/effective_rank_ratio_max", COLLAPSING_LAYER
    )
    assert of_the_maximum["lines"] == heads["lines"]


def test_a_relative_threshold_gives_each_line_its_own_collapsed_level(logdir: Path) -> None:
    """Entropy collapse judges each layer against 0.3 times its running median: the chart carries that level
    per layer, so the line of a layer that falls crosses its own level; weight runaway (20 times the first
    value) likewise."""
    plugin = plugin_on(logdir)
    chart = plugin.chart(request(), "", HEALTHY, "attention/entropy", None)
    (relative,) = [t for t in chart["thresholds"] if t["relative_to"] == "median"]
    assert (relative["rule"], relative["op"], relative["collapsed"]) == ("entropy_collapse", "<=", 0.3)
    for line in chart["lines"]:  # a constant 0.7: the level is 0.21 from the second reading on
        levels = relative["levels"][line["name"]]
        assert levels[0] == "nan" and levels[1:] == pytest.approx([0.21] * (len(STEPS) - 1))
    norms = plugin.chart(request(), "", HEALTHY, "weights/spectral_norm", None)
    (first,) = [t for t in norms["thresholds"] if t["relative_to"] == "first"]
    assert first["levels"]["head"] == pytest.approx([20 * 2.0] * len(STEPS))


def test_the_tab_is_active_only_where_a_run_holds_the_monitors_scalars(logdir: Path, tmp_path: Path) -> None:
    assert plugin_on(logdir).is_active()
    sink = TensorBoardSink(str(tmp_path / "other"))
    sink.write_measurements([Measurement(0, "train", "loss", "model", 1.0)])
    sink.close()
    assert not plugin_on(tmp_path).is_active()
    assert plugin_on(tmp_path).run_verdicts(request(), "") == {}


def test_a_run_that_moves_on_is_judged_again_and_one_that_does_not_is_not_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_run(tmp_path / "run", collapsing=False)
    plugin, multiplexer = loaded(tmp_path)
    provider = plugin._data_provider
    reads = []
    read_scalars = provider.read_scalars
    monkeypatch.setattr(provider, "read_scalars", lambda *a, **k: reads.append(k) or read_scalars(*a, **k))
    assert plugin.run_verdicts(request(), "")["run"]["rank_collapse"]["verdict"] == "healthy"
    assert len(reads) == 1
    plugin.run_summary(request(), "")
    assert len(reads) == 1
    write_run(
        tmp_path / "run", collapsing=True, steps=tuple(range(50, 80, 5))
    )  # the run goes on, and collapses
    multiplexer.Reload()
    rank = plugin.run_verdicts(request(), "")["run"]["rank_collapse"]
    assert (rank["verdict"], rank["layers"], rank["step"]) == ("collapsed", [COLLAPSING_LAYER], 75)
    assert len(reads) == 2


@pytest.mark.slow
def test_a_long_run_is_read_as_tensorboard_keeps_it_with_its_latest_reading(tmp_path: Path) -> None:
    steps = tuple(range(1500))
    write_run(tmp_path / COLLAPSING, collapsing=True, steps=steps)
    plugin = plugin_on(tmp_path)
    rank = plugin.run_verdicts(request(), "")[COLLAPSING]["rank_collapse"]
    assert (rank["verdict"], rank["layers"], rank["step"]) == ("collapsed", [COLLAPSING_LAYER], 1499)
    chart = plugin.chart(request(), "", COLLAPSING, "attention/effective_rank_ratio_max", None)
    for line in chart["lines"]:
        assert len(line["steps"]) == CHART_POINTS and line["steps"][-1] == 1499


@pytest.mark.slow
def test_tensorboard_serves_the_tab_and_its_verdicts(logdir: Path, tmp_path: Path, load_fast: str) -> None:  # noqa: F811
    with tensorboard_server(logdir, load_fast, tmp_path / "tensorboard.log") as server:
        poll(
            lambda: server.get_json("/data/plugins_listing").get("spectral_monitor", {}).get("enabled"),
            LOAD_TIMEOUT_S,
            lambda: f"the tab is not enabled: {server.get_json('/data/plugins_listing')}",
        )
        listing = server.get_json("/data/plugins_listing")["spectral_monitor"]
        assert listing["loading_mechanism"] == {
            "type": "IFRAME",
            "module_path": "/data/plugin/spectral_monitor/index.js",
        }
        judged = poll(
            lambda: (
                (served := server.get_json("/data/plugin/spectral_monitor/verdicts")).get(HEALTHY) and served
            ),
            LOAD_TIMEOUT_S,
            lambda: "the runs did not load",
        )
        rank = judged[COLLAPSING]["rank_collapse"]
        assert (rank["verdict"], rank["layers"]) == ("collapsed", [COLLAPSING_LAYER])
        assert [alert["fired_at"] for alert in rank["alerts"]] == [25]
        assert judged[HEALTHY]["rank_collapse"]["verdict"] == "healthy"
        assert b"export async function render" in server.get("/data/plugin/spectral_monitor/index.js")
        assert b".badge.collapsed" in server.get("/data/plugin/spectral_monitor/style.css")


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("no Chromium on this machine (apt-get install -y chromium); CI installs it")
    return found


def rendered_tab(logdir: Path, run: str, tmp_path: Path) -> str:
    """The tab's DOM as headless Chromium renders it from a TensorBoard serving ``logdir``, once ``run`` is
    judged."""
    browser = chromium()
    with tensorboard_server(logdir, "false", tmp_path / "tensorboard.log") as server:
        poll(
            lambda: server.get_json("/data/plugin/spectral_monitor/verdicts").get(run),
            LOAD_TIMEOUT_S,
            lambda: "the runs did not load",
        )
        return subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", "--virtual-time-budget=20000",
             f"{server.base_url}/data/plugin_entry.html?name=spectral_monitor"],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout  # fmt: skip


@pytest.mark.slow
def test_headless_chromium_renders_the_collapsed_run_its_layer_and_its_verdict(
    logdir: Path, tmp_path: Path
) -> None:
    dom = rendered_tab(logdir, HEALTHY, tmp_path)
    overall = f"COLLAPSED: rank collapse in {COLLAPSING_LAYER}"
    assert f'data-run="{COLLAPSING}"' in dom and f'data-run="{HEALTHY}"' in dom
    assert overall in dom
    row = dom[dom.index('data-rule="rank_collapse"') :]
    row = row[: row.index("</tr>")]
    assert '<span class="badge collapsed">collapsed</span>' in row and COLLAPSING_LAYER in row
    # The collapsing run comes first, and its charts were drawn, one line per layer.
    assert dom.index(f'data-run="{COLLAPSING}"') < dom.index(f'data-run="{HEALTHY}"')
    assert dom.count(f'data-layer="{COLLAPSING_LAYER}"') >= 2
    charts = [chart.split("</svg>")[0] for chart in dom.split('class="chart"')[1:]]
    assert charts
    # Entropy collapse is relative to each layer's running median: a dashed level per layer, not a band.
    entropy = dom[dom.index('data-metric="attention/entropy"') :]
    entropy = entropy[: entropy.index('class="legend"')]
    levels = re.findall(r'class="level" data-layer="([^"]+)" data-rule="entropy_collapse"', entropy)
    assert levels == list(ATTENTION)
    caption = "entropy_collapse: dashed, each line's collapsed level (at or below 0.3 × its running median)"
    assert caption in entropy
    worst_head = dom[dom.index('data-metric="attention/entropy_max"') :]
    assert 'class="level"' not in worst_head[: worst_head.index('class="legend"')]  # the mean's, not its
    for chart in charts:
        if 'class="band-label"' in chart:  # over the lines, not under them
            assert chart.index('class="band-label"') > chart.rindex('class="line"')
        for anchor in ("end", "middle"):  # the value axis, then the step axis
            labels = re.findall(rf'text-anchor="{anchor}" class="tick">([^<]*)</text>', chart)
            _assert_round_ticks([float(label) for label in labels])


@pytest.mark.slow
def test_headless_chromium_says_a_rules_remedy_once_however_many_layers_it_fired_in(tmp_path: Path) -> None:
    write_run(tmp_path / "runs" / "every_layer", collapsing=True, collapsing_layers=ATTENTION)
    dom = rendered_tab(tmp_path / "runs", "every_layer", tmp_path)
    row = dom[dom.index('data-rule="rank_collapse"') :]
    row = row[: row.index("</tr>")]
    assert row.count("fired at step") == len(ATTENTION)
    assert row.count('class="remedy"') == 1


@pytest.mark.slow
def test_headless_chromium_draws_many_layers_as_a_heatmap_captioned_with_their_extreme_readings(
    tmp_path: Path,
) -> None:
    sink = TensorBoardSink(str(tmp_path / "runs" / "wide"))
    for step in STEPS:  # 13 weights: more layers than a line chart draws
        sink.write_measurements(
            [Measurement(step, "weights", "spectral_norm", f"blocks.{i}.mlp", 1 + i / 10 + step / 1000)
             for i in range(13)]
        )  # fmt: skip
    sink.close()
    dom = rendered_tab(tmp_path / "runs", "wide", tmp_path)
    card = dom[dom.index('data-metric="weights/spectral_norm"') :]
    card = card[: card.index("</svg>")]
    assert card.count('class="tick">blocks.') == 13  # a row per weight
    legend = dom[dom.index('data-metric="weights/spectral_norm"') :].split('class="legend"')[1]
    legend = legend[: legend.index("</div>")]
    assert legend.count('class="legend-item"') == 13 and 'class="swatch"' not in legend  # no line colours
    # The darkest and lightest readings themselves, not a padded axis's ends (a negative norm).
    assert "dark = 1.000, light = 2.245" in card


def _assert_round_ticks(values: list[float]) -> None:
    """At least two ticks, evenly spaced by 1, 2, 2.5 or 5 times a power of ten, each a multiple of it."""
    assert len(values) >= 2, values
    step = (values[-1] - values[0]) / (len(values) - 1)
    mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
    assert any(math.isclose(mantissa, m, rel_tol=1e-6) for m in (1, 2, 2.5, 5)), values
    for value, following in zip(values[:-1], values[1:], strict=True):
        assert math.isclose(following - value, step, rel_tol=1e-6), values
    assert all(math.isclose(value / step, round(value / step), abs_tol=1e-6) for value in values), values


@pytest.mark.slow
def test_the_tab_reads_the_runs_of_the_lightning_callback_the_plain_loop_and_the_trainer_callback(
    tmp_path: Path, one_thread: None
) -> None:
    pytest.importorskip("transformers")
    from helpers.huggingface_runs import BATCH, hf_train, trainer_gpt2, training_arguments
    from helpers.models import TinyEncoder
    from helpers.plain_loop_runs import train_in_a_plain_loop
    from helpers.reliability import fit, tensorboard_logger

    from spectral_monitor import SpectralMonitor
    from spectral_monitor.integrations.huggingface import SpectralMonitorCallback

    options = {"every_n_steps": 2, "figures_every_n_logs": 0}
    logdir = tmp_path / "runs"
    fit(TinyEncoder(), [SpectralMonitor(**options)], tensorboard_logger(logdir, "lightning"), max_steps=6)
    train_in_a_plain_loop(logdir / "plain_loop", **options)
    trainer_callback = SpectralMonitorCallback(log_dir=logdir / "huggingface", **options)
    hf_train(trainer_gpt2(), training_arguments(tmp_path / "hf"), trainer_callback, count=6 * BATCH)

    judged = plugin_on(logdir).run_verdicts(request(), "")
    assert set(judged) == {"lightning/version_0", "plain_loop", "huggingface"}
    for run, by_rule in judged.items():
        for rule in ("rank_collapse", "entropy_collapse", "token_collapse", "weight_runaway", "non_finite"):
            assert by_rule[rule]["verdict"] != "not measured", (run, rule)
        reported = {
            entry.diagnosis.rule: entry.as_dict() for entry in verdicts(RunScalars.load(logdir / run))
        }
        assert {
            rule: {k: v for k, v in entry.items() if k != "alerts"} for rule, entry in by_rule.items()
        } == (reported)
    assert judged["huggingface"]["rank_collapse"]["layer"].startswith("transformer.h.")

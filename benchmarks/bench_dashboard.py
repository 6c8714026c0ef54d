"""Benchmark: the response time of the TensorBoard tab's routes on a long, deep run.

A synthetic run of ``--steps`` logging steps × ``--layers`` layers is written through the monitor's own sink
with the default tag set of a causal model (25 attention scalars per attention layer, 4 token scalars per
block, 4 weight scalars for each of q, k, v and the output projection): 45 scalars per layer, 2,160 tags
and 4.3 million values at 2,000 × 48. The layer ``blocks.17.attention`` collapses (effective rank / n 0.004)
from the middle of the run.

Timed, interleaved over ``--rounds`` rounds, each the median of its repeats within a round:

- in process, over the data provider TensorBoard's Python loader builds: the tab's ``summary`` (every
  verdict and the chart list) on a first request and again on an unchanged run, and one ``chart`` (a line
  per layer); against, as the alternative,
  TensorBoard's Scalars plugin serving the same judged tags one by one (what the Scalars tab requests to
  draw them), and ``spectral-monitor report``'s reading of the event file and its verdicts;
- over HTTP, a ``tensorboard --logdir`` server with default flags (the Rust data server where installed):
  ``/data/plugin/spectral_monitor/summary`` and ``chart``, once the run has loaded (the summary after the
  first, so judged already: the figure of a page reload).

    python benchmarks/bench_dashboard.py --steps 2000 --layers 48 --rounds 3 [--cases http] [--logdir DIR]

``--logdir DIR`` keeps the synthetic run there (and reads it from there when it exists already);
``--cases`` picks the in-process cases, the HTTP ones, or both.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
from _common import describe_machine, markdown_table
from tensorboard import context as tb_context
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.backend.event_processing.data_ingester import (
    DEFAULT_SIZE_GUIDANCE,
    DEFAULT_TENSOR_SIZE_GUIDANCE,
)
from tensorboard.backend.event_processing.data_provider import MultiplexerDataProvider
from tensorboard.plugins import base_plugin
from tensorboard.plugins.scalar.scalars_plugin import ScalarsPlugin

from spectral_monitor.catalog import CATALOG
from spectral_monitor.dashboard import SpectralMonitorPlugin
from spectral_monitor.dashboard.plugin import monitor_metric
from spectral_monitor.records import Measurement
from spectral_monitor.report import RunScalars, verdicts
from spectral_monitor.sinks import TensorBoardSink

RUN = "deep"
ATTENTION = tuple(
    name
    for info in CATALOG
    if info.family == "attention" and not info.name.startswith(("head_diversity", "eigen_gap"))
    for name in info.written_names
)
TOKENS = ("tokens/cosine_similarity", "tokens/token_residual", "tokens/stable_rank", "tokens/effective_rank")
WEIGHTS = (
    "weights/spectral_norm",
    "weights/frobenius_norm",
    "weights/stable_rank",
    "weights/spectral_norm_residual",
)
COLLAPSING_LAYER = 17
CHART = "attention/effective_rank_ratio_max"


def write_run(folder: Path, steps: int, layers: int) -> int:
    """The synthetic run; returns how many scalars it holds."""
    rng = np.random.default_rng(0)
    names = [(metric, f"blocks.{layer}.attention") for layer in range(layers) for metric in ATTENTION]
    names += [(metric, f"blocks.{layer}") for layer in range(layers) for metric in TOKENS]
    names += [
        (metric, f"blocks.{layer}.attention.{weight}")
        for layer in range(layers)
        for weight in ("q", "k", "v", "out")
        for metric in WEIGHTS
    ]
    level = rng.uniform(0.2, 0.8, len(names))
    collapsing = np.array([layer == f"blocks.{COLLAPSING_LAYER}.attention" and "rank" in metric
                           for metric, layer in names])  # fmt: skip
    sink = TensorBoardSink(str(folder / RUN))
    for step in range(steps):
        values = level + 0.01 * rng.standard_normal(len(names))
        if step >= steps // 2:
            values[collapsing] = 0.004
        sink.write_measurements(
            Measurement(step, *metric.split("/"), layer, float(value))
            for (metric, layer), value in zip(names, values, strict=True)
        )
    sink.close()
    return steps * len(names)


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_process_cases(logdir: Path) -> tuple[dict[str, Callable[[], object]], float]:
    start = time.perf_counter()
    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        size_guidance=DEFAULT_SIZE_GUIDANCE, tensor_size_guidance=DEFAULT_TENSOR_SIZE_GUIDANCE
    )
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    load_seconds = time.perf_counter() - start
    provider = MultiplexerDataProvider(multiplexer, str(logdir))
    context = base_plugin.TBContext(data_provider=provider, logdir=str(logdir))
    plugin, scalars = SpectralMonitorPlugin(context), ScalarsPlugin(context)
    request = tb_context.RequestContext()
    summary = plugin.run_summary(request, "")[RUN]
    charted = {name for chart in summary["charts"] for name in chart["metrics"]}
    judged_tags = [tag for tag in scalars.index_impl(request, "")[RUN] if monitor_metric(tag) in charted]
    fresh = lambda: SpectralMonitorPlugin(context)  # noqa: E731  (a plugin with nothing judged yet)
    return {
        "tab: summary, first request": lambda: fresh().run_summary(request, ""),
        "tab: summary, run unchanged since": lambda: plugin.run_summary(request, ""),
        "tab: one chart, a line per layer": lambda: plugin.chart(request, "", RUN, CHART, None),
        f"Scalars plugin: the {len(judged_tags)} judged tags": lambda: [
            scalars.scalars_impl(request, tag, RUN, "", "json") for tag in judged_tags
        ],
        "report: read the event file and judge": lambda: verdicts(RunScalars.load(logdir / RUN)),
    }, load_seconds


def http_cases(logdir: Path, steps: int, rounds: int, repeats: int) -> list[tuple[str, float, float]]:
    """Median and spread over rounds of the tab's routes served by ``tensorboard --logdir``."""
    log = logdir.parent / "tensorboard.log"
    started = time.monotonic()
    with log.open("w") as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", f"--logdir={logdir}", "--host=127.0.0.1", "--port=0"],
            stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "http://127.0.0.1:" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        port = log.read_text().split("http://127.0.0.1:", 1)[1].split("/", 1)[0]
        base = f"http://127.0.0.1:{port}/data/plugin/spectral_monitor"
        query = urllib.parse.urlencode({"run": RUN, "metric": CHART})
        routes = {"HTTP: summary": f"{base}/summary", "HTTP: one chart": f"{base}/chart?{query}"}

        def get(url: str) -> bytes:
            with urllib.request.urlopen(url, timeout=120) as response:
                return response.read()

        # Loaded once the collapsing layer's verdict reads the run's last step.
        last_step = f'"step": {steps - 1}'.encode()
        loaded_by = time.monotonic() + 1800
        while last_step not in get(routes["HTTP: summary"]) and time.monotonic() < loaded_by:
            time.sleep(2)
        print(f"the server loaded and judged the run in {time.monotonic() - started:.1f} s", file=sys.stderr)
        times = {name: [median_seconds(lambda u=url: get(u), repeats) for _ in range(rounds)]
                 for name, url in routes.items()}  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=30)
    return [(name, statistics.median(t), max(t) - min(t)) for name, t in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", choices=["in-process", "http"], default=["in-process", "http"])
    parser.add_argument("--logdir", type=Path, default=None, help="where to keep the synthetic run")
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        logdir = arguments.logdir or Path(scratch) / "runs"
        values = arguments.steps * arguments.layers * (len(ATTENTION) + len(TOKENS) + 4 * len(WEIGHTS))
        if not (logdir / RUN).exists():
            start = time.perf_counter()
            write_run(logdir, arguments.steps, arguments.layers)
            print(f"wrote {values:,} scalars in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        rows, summary, notes = [], None, []
        if "in-process" in arguments.cases:
            cases, load_seconds = in_process_cases(logdir)
            notes.append(f"TensorBoard's Python loader read the run in {load_seconds:.1f} s.")
            times: dict[str, list[float]] = {name: [] for name in cases}
            for _ in range(arguments.rounds):  # interleaved: each round times every case once
                for name, call in cases.items():
                    times[name].append(median_seconds(call, arguments.repeats))
            summary = statistics.median(times["tab: summary, first request"])
            rows += [(name, statistics.median(t), max(t) - min(t)) for name, t in times.items()]
        if "http" in arguments.cases:
            rows += http_cases(logdir, arguments.steps, arguments.rounds, arguments.repeats)
    print(describe_machine())
    print()
    print(
        f"{arguments.steps} logging steps × {arguments.layers} layers, {values:,} scalars. {' '.join(notes)}"
    )
    print()
    headers = ["case", "median time (s)", "spread over rounds (s)"]
    cells = [[name, f"{median:.3f}", f"{spread:.3f}"] for name, median, spread in rows]
    if summary is not None:
        headers.append("time / tab summary (first request)")
        cells = [[*cell, f"{median / summary:.2f}"] for cell, (_, median, _) in zip(cells, rows, strict=True)]
    print(markdown_table(headers, cells))


if __name__ == "__main__":
    main()

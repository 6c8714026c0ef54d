"""A real TensorBoard server, on loopback, shows what the TensorBoard sink wrote: scalars with their values,
histograms, images, text and the Custom Scalars layout, including a layout rewritten while it runs.

Both of TensorBoard's loaders are checked: the Python one and the Rust data server (what
``--load_fast=auto`` picks when it is installed). The server runs as a child process so that it, and the
data server it starts, stop when the test ends.
"""

from __future__ import annotations

import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from helpers.tensorboard_server import LOAD_TIMEOUT_S, TensorBoardServer, poll, tensorboard_server
from torch.utils.tensorboard import SummaryWriter

from spectral_monitor.records import Distribution, Measurement
from spectral_monitor.sinks import TensorBoardSink, per_layer_layout, spectrum_figure

pytestmark = pytest.mark.slow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN = "run"
LAYERS = ("encoder.layers.0", "encoder.layers.1")


def attention_measurements() -> list[Measurement]:
    records = []
    for step in (0, 5, 10):
        for layer_index, layer in enumerate(LAYERS):
            records.append(
                Measurement(step, "attention", "entropy", layer, 0.9 - 0.01 * step - 0.1 * layer_index)
            )
            records.append(Measurement(step, "attention", "entropy", layer, 0.5, head=0))
            records.append(Measurement(step, "attention", "spectral_gap", layer, 0.25 + 0.01 * step))
    return records


def layout_charts(server: TensorBoardServer) -> set[tuple[str, str]]:
    layout = server.get_json("/data/plugin/custom_scalars/layout")
    return {
        (category["title"], chart["title"])
        for category in layout.get("category", [])
        for chart in category["chart"]
    }


def test_server_shows_what_the_sink_wrote_and_the_rewritten_layout(tmp_path: Path, load_fast: str) -> None:
    logdir = tmp_path / "logs"
    writer = SummaryWriter(log_dir=str(logdir / RUN))
    sink = TensorBoardSink(writer)
    records = attention_measurements()
    sink.write_measurements(records)
    singular_values = np.array([3.0, 2.0, 1.0, 0.5])
    sink.write_distributions(
        [Distribution(10, "weights", "singular_values", "encoder.layers.0", singular_values)]
    )
    sink.write_figure(
        "spectra/weights", spectrum_figure({"encoder.layers.0": singular_values}, "weights"), 10
    )
    sink.write_text("alerts", "**entropy collapse** in `encoder.layers.1`", 10)
    assert sink.write_layout(per_layer_layout(record.tag for record in records))
    sink.flush()

    try:
        with tensorboard_server(logdir, load_fast, tmp_path / "tensorboard.log") as server:
            first_charts = {("attention", "entropy"), ("attention", "spectral_gap")}
            poll(
                lambda: (
                    layout_charts(server) == first_charts
                    and server.get_json("/data/plugin/images/tags").get(RUN)
                ),
                LOAD_TIMEOUT_S,
                lambda: f"layout and images not loaded; layout charts: {layout_charts(server)}",
            )

            scalar_tags = set(server.get_json("/data/plugin/scalars/tags")[RUN])
            assert scalar_tags == {record.tag for record in records}
            entropy_tag = "attention/entropy/encoder.layers.1"
            served = server.get_json("/data/plugin/scalars/scalars", run=RUN, tag=entropy_tag)
            expected = [(r.step, float(np.float32(r.value))) for r in records if r.tag == entropy_tag]
            assert [(step, value) for _, step, value in served] == expected

            # The chart's regex, applied by TensorBoard itself, draws one line per layer and no head.
            [chart_regex] = per_layer_layout([entropy_tag])["attention"]["entropy"][1]
            lines = server.get_json("/data/plugin/custom_scalars/scalars", run=RUN, tag=chart_regex)
            assert lines["regex_valid"]
            assert set(lines["tag_to_events"]) == {f"attention/entropy/{layer}" for layer in LAYERS}

            histogram_tag = "weights/singular_values/encoder.layers.0"
            assert set(server.get_json("/data/plugin/histograms/tags")[RUN]) == {histogram_tag}
            [(_, step, buckets)] = server.get_json(
                "/data/plugin/histograms/histograms", run=RUN, tag=histogram_tag
            )
            assert step == 10
            assert sum(count for _, _, count in buckets) == pytest.approx(singular_values.size)

            assert set(server.get_json("/data/plugin/images/tags")[RUN]) == {"spectra/weights"}
            [image] = server.get_json("/data/plugin/images/images", run=RUN, tag="spectra/weights", sample=0)
            assert image["step"] == 10
            image_query = dict(urllib.parse.parse_qsl(image["query"]))
            png = server.get("/data/plugin/images/individualImage", **image_query)
            assert png.startswith(PNG_MAGIC)

            [text] = server.get_json("/data/plugin/text/text", run=RUN, tag="alerts/text_summary")
            assert text["step"] == 10
            assert "<strong>entropy collapse</strong>" in text["text"]

            # A metric that appears later brings a chart; the running server must switch to the new layout.
            later = [Measurement(15, "tokens", "cosine_similarity", layer, 0.3) for layer in LAYERS]
            sink.write_measurements(later)
            assert sink.write_layout(per_layer_layout(record.tag for record in later))
            sink.flush()
            every_chart = first_charts | {("tokens", "cosine_similarity")}
            poll(
                lambda: layout_charts(server) == every_chart,
                LOAD_TIMEOUT_S,
                lambda: f"rewritten layout not shown; layout charts: {layout_charts(server)}",
            )
    finally:
        writer.close()

"""A real TensorBoard server, on loopback, shows what the TensorBoard sink wrote: scalars with their values,
histograms, images, text and the Custom Scalars layout, including a layout rewritten while it runs.

Both of TensorBoard's loaders are checked: the Python one and the Rust data server (what
``--load_fast=auto`` picks when it is installed). The server runs as a child process so that it, and the
data server it starts, stop when the test ends.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from spectral_monitor.records import Distribution, Measurement
from spectral_monitor.sinks import TensorBoardSink, per_layer_layout, spectrum_figure

pytestmark = pytest.mark.slow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN = "run"
LAYERS = ("encoder.layers.0", "encoder.layers.1")
STARTUP_TIMEOUT_S = 20.0
LOAD_TIMEOUT_S = 15.0


class TensorBoardServer:
    """HTTP access to a TensorBoard server on 127.0.0.1."""

    def __init__(self, port: int) -> None:
        self.base_url = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: Any) -> bytes:
        url = f"{self.base_url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read()

    def get_json(self, path: str, **params: Any) -> Any:
        return json.loads(self.get(path, **params))


@contextmanager
def tensorboard_server(logdir: Path, load_fast: str, output: Path) -> Iterator[TensorBoardServer]:
    command = [
        sys.executable,
        "-m",
        "tensorboard.main",
        f"--logdir={logdir}",
        "--host=127.0.0.1",
        "--port=0",
        "--reload_interval=1",
        f"--load_fast={load_fast}",
    ]
    with output.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
    try:
        port = int(
            poll(
                lambda: _served_port(output.read_text()),
                STARTUP_TIMEOUT_S,
                lambda: f"TensorBoard did not report its URL; it said:\n{output.read_text()}",
                process=process,
            )
        )
        yield TensorBoardServer(port)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _served_port(server_output: str) -> str | None:
    match = re.search(r"TensorBoard \S+ at http://127\.0\.0\.1:(\d+)/", server_output)
    return match.group(1) if match else None


def poll(
    read: Callable[[], Any],
    timeout_s: float,
    describe_failure: Callable[[], str],
    process: subprocess.Popen | None = None,
) -> Any:
    """The first truthy value of ``read()``, tried every 0.2 s; fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            pytest.fail(f"TensorBoard exited with code {process.returncode}. {describe_failure()}")
        value = read()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"gave up after {timeout_s} s: {describe_failure()}")


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


@pytest.fixture(params=["false", "true"], ids=["python_loader", "rust_data_server"])
def load_fast(request: pytest.FixtureRequest) -> str:
    if request.param == "true":
        data_server = pytest.importorskip("tensorboard_data_server")
        if data_server.server_binary() is None:
            pytest.skip("the Rust data server has no binary for this platform")
    return request.param


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

"""Sinks write what they are given, where they are told, and say so when they cannot.

Event files are read back with TensorBoard's own ``EventAccumulator``; PNGs are decoded with Pillow.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import re
import threading
from functools import partial
from pathlib import Path

import matplotlib
import matplotlib.figure
import numpy as np
import pytest
from helpers.events import read_back as read_every_event
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image
from tensorboard.plugins.custom_scalar import layout_pb2
from torch.utils.tensorboard import SummaryWriter

from spectral_monitor.records import Distribution, Measurement
from spectral_monitor.sinks import (
    Capability,
    LoggerSink,
    LoggingSink,
    SinkError,
    TensorBoardSink,
    attention_heatmap_figure,
    layer_head_heatmap_figure,
    merged_layout,
    per_layer_layout,
    spectrum_figure,
    with_margin_chart,
)
from spectral_monitor.sinks.figures import (
    AttentionHeatmapImages,
    EsdDrawing,
    EsdImages,
    LayerHeadHeatmapImages,
    SpectrumImages,
    esd_drawing_figure,
)
from spectral_monitor.sinks.layout import MARGIN, MULTILINE, check_layout
from spectral_monitor.sinks.tensorboard import equal_width_histogram

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LAYOUT_TAG = "custom_scalars__config__"
STEPS = (0, 10, 20)
LAYERS = ("encoder.layers.0", "encoder.layers.1")
HEADS = (0, 1)


def entropy_at(step: int, layer_index: int, head: int | None) -> float:
    """A value that names its own coordinates, so a swapped step, layer or head shows up."""
    return 1.0 - 0.01 * step - 0.1 * layer_index - (0.0 if head is None else 0.001 * (head + 1))


def measurements() -> list[Measurement]:
    records = []
    for step in STEPS:
        for layer_index, layer in enumerate(LAYERS):
            records.append(
                Measurement(step, "attention", "entropy", layer, entropy_at(step, layer_index, None))
            )
            records.append(Measurement(step, "attention", "spectral_gap", layer, 0.5 + step / 100))
            for head in HEADS:
                value = entropy_at(step, layer_index, head)
                records.append(Measurement(step, "attention", "entropy", layer, value, head=head))
    return records


read_back = partial(read_every_event, purge_orphaned_data=True)  # as TensorBoard's viewer reads a run


@pytest.fixture
def writer(tmp_path: Path):
    summary_writer = SummaryWriter(log_dir=str(tmp_path))
    yield summary_writer
    summary_writer.close()


def test_scalars_read_back_with_exact_values_at_exact_steps(tmp_path: Path, writer: SummaryWriter) -> None:
    sink = TensorBoardSink(writer)
    records = measurements()
    sink.write_measurements(records)
    sink.flush()

    scalars = read_back(tmp_path)
    assert set(scalars.Tags()["scalars"]) == {record.tag for record in records}
    for tag in {record.tag for record in records}:
        # Event files hold float32: the value read back is the float32 rounding of the value written.
        expected = [(r.step, float(np.float32(r.value))) for r in records if r.tag == tag]
        assert [(event.step, event.value) for event in scalars.Scalars(tag)] == expected
    assert "attention/entropy/encoder.layers.1/head_1" in scalars.Tags()["scalars"]


def test_histograms_count_the_finite_values_and_skip_records_with_none(
    tmp_path: Path, writer: SummaryWriter
) -> None:
    singular_values = np.array([4.0, 2.0, 1.0, 0.5, 0.25])
    with_nan = np.array([0.9, np.nan, 0.7, 0.8])
    sink = TensorBoardSink(writer)
    sink.write_distributions(
        [
            Distribution(3, "weights", "singular_values", "encoder.layers.0.linear1", singular_values),
            Distribution(3, "attention", "entropy", "encoder.layers.0", with_nan),
            Distribution(3, "attention", "entropy", "encoder.layers.1", np.array([np.nan, np.inf])),
        ]
    )
    sink.flush()

    histograms = read_back(tmp_path)
    assert set(histograms.Tags()["histograms"]) == {
        "weights/singular_values/encoder.layers.0.linear1",
        "attention/entropy/encoder.layers.0",
    }
    (spectrum,) = histograms.Histograms("weights/singular_values/encoder.layers.0.linear1")
    assert spectrum.step == 3
    assert spectrum.histogram_value.num == 5
    assert sum(spectrum.histogram_value.bucket) == 5
    assert spectrum.histogram_value.sum == pytest.approx(7.75)
    assert (spectrum.histogram_value.min, spectrum.histogram_value.max) == (0.25, 4.0)
    (entropy,) = histograms.Histograms("attention/entropy/encoder.layers.0")
    assert entropy.histogram_value.num == 3
    assert entropy.histogram_value.sum == pytest.approx(2.4)


@pytest.mark.parametrize(
    "values",
    [
        np.random.default_rng(0).standard_normal(1000),
        np.random.default_rng(1).random(7) ** 3,
        np.full(5, 0.3),
        np.array([-2.0]),
        np.linspace(0.0, 3.0, 31),  # every inner edge hit exactly
        np.array([0.0, 1e-300, 1.0]),
    ],
    ids=["gaussian", "seven", "constant", "single", "on_edges", "tiny_spread"],
)
def test_the_equal_width_histogram_is_numpys(values: np.ndarray) -> None:
    counts, edges = equal_width_histogram(values, 30)
    expected_counts, expected_edges = np.histogram(values, bins=30)
    np.testing.assert_allclose(edges, expected_edges, rtol=1e-12, atol=0)
    assert counts.sum() == values.size
    # Rounding at an inner edge may move a value one bucket over; never further, never out of range.
    assert np.abs(np.cumsum(counts) - np.cumsum(expected_counts)).max() <= 1


def test_each_figure_kind_is_written_as_a_small_decodable_png(tmp_path: Path, writer: SummaryWriter) -> None:
    rng = np.random.default_rng(0)
    figures = {
        "spectra/attention": spectrum_figure(
            {f"layer{layer}/head_{head}": rng.random(32) ** 3 for layer in range(3) for head in range(4)},
            "attention spectra",
        ),
        "attention/map/layer0/head_0": attention_heatmap_figure(
            rng.dirichlet(np.ones(300), size=300), "layer0 head 0", key_padding_mask=np.arange(300) >= 280
        ),
        "attention/effective_rank_ratio": layer_head_heatmap_figure(
            rng.random((4, 8)), [f"layer{i}" for i in range(4)], "effective rank / n", vmin=0.0, vmax=1.0
        ),
    }
    sink = TensorBoardSink(writer)
    for tag, figure in figures.items():
        sink.write_figure(tag, figure, step=7)
    sink.flush()

    images = read_back(tmp_path)
    assert set(images.Tags()["images"]) == set(figures)
    for tag, figure in figures.items():
        (event,) = images.Images(tag)
        png = event.encoded_image_string
        assert event.step == 7
        assert png.startswith(PNG_MAGIC)
        assert 0 < len(png) < 100_000
        decoded = Image.open(io.BytesIO(png))
        decoded.load()
        expected_size = tuple(round(inches * figure.dpi) for inches in figure.get_size_inches())
        assert decoded.size == (event.width, event.height) == expected_size
        pixels = np.asarray(decoded.convert("RGB"))
        assert pixels.std() > 10, f"{tag} rendered as a blank image"


def _rendered(figure: matplotlib.figure.Figure) -> np.ndarray:
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.array(canvas.buffer_rgba())


def _attention(rng: np.random.Generator, n: int) -> np.ndarray:
    weights = rng.random((n, n)) ** 4
    return weights / weights.sum(axis=1, keepdims=True)


def _spectra(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {f"blocks.{layer}.attention": 1.5 * rng.random(n) ** 3 + 1e-3 for layer in range(3)}


def _esd(rng: np.random.Generator, n: int) -> EsdDrawing:
    """Eigenvalues over the same decades at one n (moved by 1% from draw to draw), decades that differ
    between n = 32 and 64; the law, the marks and the title move with the data."""
    eigenvalues = np.geomspace(1.5e-3, 0.8, n) * (64 / n) ** 3 * (1 + 0.01 * rng.random(n))
    scale = 1 + 0.01 * rng.random()
    return EsdDrawing(
        eigenvalues,
        0.5 * scale,
        lambda points: 0.2 * scale / points,
        2.0 + rng.random(),
        2e-2 * scale * (64 / n) ** 3,
        f"w ({n}×{2 * n}), α = {rng.random():.2f}",
    )


REDRAWN_KINDS = {
    # kind: (images class, arguments of one step from a generator and a size, the fresh figure of them)
    "spectrum": (
        SpectrumImages,
        lambda rng, n: (_spectra(rng, n), f"spectra of {n}"),
        spectrum_figure,
    ),
    "attention_heatmap": (
        AttentionHeatmapImages,
        lambda rng, n: (_attention(rng, n), f"head 0 of {n}", rng.random(n) > 0.8),
        attention_heatmap_figure,
    ),
    "layer_head_heatmap": (
        LayerHeadHeatmapImages,
        lambda rng, n: (rng.random((4, n // 8)), [f"blocks.{i}" for i in range(4)], f"ratio {n}", 0.0, 1.0),
        layer_head_heatmap_figure,
    ),
    "esd": (EsdImages, lambda rng, n: (_esd(rng, n),), esd_drawing_figure),
    "layer_head_heatmap_own_scale": (
        LayerHeadHeatmapImages,
        lambda rng, n: (
            np.where(rng.random((3, n // 8)) > 0.2, rng.random((3, n // 8)), np.nan),
            ["a", "b", "c"],
            "x",
        ),
        layer_head_heatmap_figure,
    ),
}


@pytest.mark.parametrize("kind", sorted(REDRAWN_KINDS))
def test_a_redrawn_figure_is_pixel_for_pixel_the_fresh_figure_of_the_same_data(kind: str) -> None:
    images_class, step_arguments, fresh_figure = REDRAWN_KINDS[kind]
    rng = np.random.default_rng(3)
    images = images_class()
    # Same size (redrawn over the kept background), then a new size (made anew), then redrawn again.
    for n in (64, 64, 32, 32):
        arguments = step_arguments(rng, n)
        image = images.image(*arguments)
        expected = _rendered(fresh_figure(*arguments))
        assert image.shape == expected.shape
        assert np.array_equal(image, expected), (
            f"{kind} at n={n}: {(image != expected).any(axis=2).sum()} pixels differ"
        )


def test_esd_figures_with_agreeing_axes_share_one_kept_figure_and_undrawn_ones_are_let_go() -> None:
    rng = np.random.default_rng(5)
    images = EsdImages()
    images.image(_esd(rng, 64))
    images.image(_esd(rng, 64))
    assert images.held == 1  # the same decades and density scale: one figure, redrawn
    images.image(_esd(rng, 32))  # eigenvalues 8 times larger: other decades, a figure of its own
    assert images.held == 2
    images.next_step()
    images.image(_esd(rng, 32))
    images.next_step()
    assert images.held == 1  # the 64s were not drawn in the last step


def test_write_image_rejects_what_is_not_an_rgb_or_rgba_byte_image(writer: SummaryWriter) -> None:
    sink = TensorBoardSink(writer)
    with pytest.raises(ValueError, match=r"image must be a non-empty \(height, width, 3 or 4\) uint8 array"):
        sink.write_image("attention/figures/spectrum", np.zeros((10, 10, 4)), step=1)
    with pytest.raises(ValueError, match="image must be"):
        sink.write_image("attention/figures/spectrum", np.zeros((10, 10), dtype=np.uint8), step=1)


def test_spectrum_figure_plots_sorted_singular_values_and_their_cumulative_energy() -> None:
    figure = spectrum_figure({"l0": np.array([1.0, 3.0, 0.0, 2.0])}, "spectrum")
    values_axes, energy_axes = figure.axes[:2]
    (values_line,) = values_axes.get_lines()
    np.testing.assert_array_equal(values_line.get_ydata(), [3.0, 2.0, 1.0, np.nan])
    assert values_axes.get_yscale() == "log"
    # Decades in plain text: six below σ₁ = 3 rounded up to the half decade 10^0.5.
    low, high = values_axes.get_ylim()
    labels = values_axes.get_yticklabels()
    shown = [label.get_text() for label in labels if low <= label.get_position()[1] <= high]
    assert shown == ["10⁻⁵", "10⁻⁴", "10⁻³", "10⁻²", "10⁻¹", "10⁰"]
    assert values_axes.yaxis.get_minorticklocs().size == 0
    energy_line, level_line = energy_axes.get_lines()
    np.testing.assert_allclose(energy_line.get_ydata(), np.array([9.0, 13.0, 14.0, 14.0]) / 14.0)
    assert list(level_line.get_ydata()) == [0.99, 0.99]


def test_large_attention_maps_are_shown_as_block_means_with_padding_grey() -> None:
    n = 256
    probs = np.zeros((n, n))
    probs[:, 0] = 1.0  # every query attends to the first key: an attention sink
    padding = np.arange(n) >= 250
    figure = attention_heatmap_figure(probs, "sink", key_padding_mask=padding)
    (image,) = figure.axes[0].get_images()
    shown = image.get_array()
    assert shown.shape == (128, 128)
    # Each 2×2 block of the first two keys averages one sink column and one empty one.
    np.testing.assert_allclose(shown[:, 0], 0.5)
    np.testing.assert_allclose(shown[:, 1:125], 0.0)
    assert shown.mask[:, 125:].all() and not shown.mask[:, :125].any()
    assert "2×2 blocks" in figure.axes[0].get_title()


def test_layer_head_heatmap_annotates_each_cell_with_its_value() -> None:
    values = np.array([[0.25, 0.5], [np.nan, 1.0]])
    figure = layer_head_heatmap_figure(values, ["l0", "l1"], "erank / n", vmin=0.0, vmax=1.0)
    axes = figure.axes[0]
    assert [text.get_text() for text in axes.texts] == ["0.25", "0.50", "–", "1.00"]
    assert [label.get_text() for label in axes.get_yticklabels()] == ["l0", "l1"]
    assert axes.get_images()[0].get_clim() == (0.0, 1.0)


def test_a_pyplot_figure_is_closed_once_written_and_the_backend_is_untouched(writer: SummaryWriter) -> None:
    backend = matplotlib.get_backend()
    pyplot = pytest.importorskip("matplotlib.pyplot")
    figure = pyplot.figure()
    figure.add_subplot().plot([0, 1], [1, 0])
    TensorBoardSink(writer).write_figure("user/figure", figure, step=0)
    assert not pyplot.fignum_exists(figure.number)
    assert matplotlib.get_backend() == backend


def test_text_reads_back_as_written(tmp_path: Path, writer: SummaryWriter) -> None:
    markdown = "**rank collapse** in `encoder.layers.1`: 4/4 heads with spectral gap > 0.99"
    TensorBoardSink(writer).write_text("alerts", markdown, step=42)
    writer.flush()

    (event,) = read_back(tmp_path).Tensors("alerts/text_summary")
    assert event.step == 42
    assert event.tensor_proto.string_val[0].decode() == markdown


def test_layout_is_rewritten_only_when_a_chart_appears_and_the_last_one_holds_every_chart(
    tmp_path: Path, writer: SummaryWriter
) -> None:
    sink = TensorBoardSink(writer)
    first = measurements()
    sink.write_measurements(first)
    assert sink.write_layout(per_layer_layout(record.tag for record in first))
    assert not sink.write_layout(per_layer_layout(record.tag for record in first))
    later = [Measurement(30, "tokens", "cosine_similarity", layer, 0.2) for layer in LAYERS]
    sink.write_measurements(later)
    # Only the new family is passed: the sink keeps the charts it has shown.
    assert sink.write_layout(per_layer_layout(record.tag for record in later))
    sink.flush()

    events = read_back(tmp_path)
    layouts = events.Tensors(LAYOUT_TAG)
    assert len(layouts) == 2
    newest = layout_pb2.Layout.FromString(layouts[-1].tensor_proto.string_val[0])
    charts = {
        (category.title, chart.title): list(chart.multiline.tag)
        for category in newest.category
        for chart in category.chart
    }
    assert set(charts) == {
        ("attention", "entropy"),
        ("attention", "spectral_gap"),
        ("tokens", "cosine_similarity"),
    }
    # Each chart draws exactly the per-layer tags of its metric, as the Custom Scalars plugin matches them.
    scalar_tags = events.Tags()["scalars"]
    for (family, metric), regexes in charts.items():
        drawn = {tag for tag in scalar_tags if any(re.match(regex, tag) for regex in regexes)}
        assert drawn == {f"{family}/{metric}/{layer}" for layer in LAYERS}


def test_per_layer_layout_has_one_chart_per_metric_and_ignores_per_head_only_metrics() -> None:
    tags = [
        "attention/entropy/blocks/0",
        "attention/entropy/blocks/0/head_3",
        "attention/entropy_min/blocks/1",
        "attention/sink_mass/blocks/0/head_1",
        "weights/spectral_norm/blocks.0.attn.in_proj",
    ]
    layout = per_layer_layout(tags)
    assert {family: set(charts) for family, charts in layout.items()} == {
        "attention": {"entropy", "entropy_min"},
        "weights": {"spectral_norm"},
    }
    kind, (regex,) = layout["attention"]["entropy"]
    assert kind == MULTILINE
    assert re.match(regex, "attention/entropy/blocks/0")
    assert re.match(regex, "attention/entropy/blocks/7")
    assert not re.match(regex, "attention/entropy/blocks/0/head_3")
    assert not re.match(regex, "attention/entropy_min/blocks/1")


def test_per_layer_layout_rejects_tags_without_family_metric_and_layer() -> None:
    with pytest.raises(ValueError, match="scalar_tags"):
        per_layer_layout(["attention/entropy"])


def test_margin_chart_joins_a_layout_without_changing_it() -> None:
    base = per_layer_layout(["curvature/sharpness/model"])
    layout = with_margin_chart(
        base,
        "curvature",
        "sharpness vs 2/lr",
        "curvature/sharpness/model",
        "curvature/zero",
        "curvature/2_over_lr",
    )
    assert layout["curvature"]["sharpness vs 2/lr"] == (
        MARGIN,
        ("curvature/sharpness/model", "curvature/zero", "curvature/2_over_lr"),
    )
    assert set(base["curvature"]) == {"sharpness"}
    assert merged_layout(base, layout) == layout
    check_layout(layout)
    with pytest.raises(ValueError, match="upper_tag"):
        with_margin_chart(base, "curvature", "x", "a", "b", "")


@pytest.mark.parametrize(
    "layout",
    [
        {"attention": {"entropy": ("Histogram", ("attention/.*",))}},
        {"attention": {"entropy": (MARGIN, ("a", "b"))}},
        {"attention": {"entropy": (MULTILINE, "attention/.*")}},
        {"attention": ["entropy"]},
    ],
)
def test_malformed_layout_is_refused_before_writing(writer: SummaryWriter, layout) -> None:
    with pytest.raises(ValueError, match="layout"):
        TensorBoardSink(writer).write_layout(layout)


class FakeLightningLogger:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int | None]] = []

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((dict(metrics), step))


def test_logger_sink_logs_one_dict_per_step_keyed_by_tag() -> None:
    logger = FakeLightningLogger()
    sink = LoggerSink(logger)
    sink.write_measurements(
        [
            Measurement(5, "attention", "entropy", "l0", 0.75),
            Measurement(6, "attention", "entropy", "l0", 0.5),
            Measurement(5, "attention", "entropy", "l0", 0.25, head=1),
        ]
    )
    assert logger.calls == [
        ({"attention/entropy/l0": 0.75, "attention/entropy/l0/head_1": 0.25}, 5),
        ({"attention/entropy/l0": 0.5}, 6),
    ]


def test_logger_sink_declares_scalars_only_and_drops_the_rest() -> None:
    logger = FakeLightningLogger()
    sink = LoggerSink(logger)
    assert sink.capabilities == {Capability.SCALARS}
    pyplot = pytest.importorskip("matplotlib.pyplot")
    figure = pyplot.figure()
    sink.write_figure("f", figure, 0)
    sink.write_distributions([Distribution(0, "attention", "entropy", "l0", np.ones(3))])
    sink.write_text("alerts", "x", 0)
    assert not sink.write_layout(per_layer_layout(["attention/entropy/l0"]))
    assert logger.calls == []
    assert not pyplot.fignum_exists(figure.number)
    assert TensorBoardSink(SummaryWriterStub()).capabilities == set(Capability)


def test_logger_sink_reports_a_failing_logger_as_sink_error() -> None:
    class FullDiskLogger:
        def log_metrics(self, metrics, step=None) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(SinkError, match="step 3") as raised:
        LoggerSink(FullDiskLogger()).write_measurements([Measurement(3, "attention", "entropy", "l0", 0.5)])
    assert isinstance(raised.value.__cause__, OSError)


def test_logging_sink_logs_text_at_its_level(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("spectral_monitor.test_sinks")
    sink = LoggingSink(logger, level=logging.WARNING)
    assert sink.capabilities == {Capability.TEXT}
    with caplog.at_level(logging.WARNING, logger=logger.name):
        sink.write_text("alerts", "entropy collapse in encoder.layers.1", step=12)
        sink.write_measurements([Measurement(12, "attention", "entropy", "l0", 0.1)])
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == "step 12 alerts: entropy collapse in encoder.layers.1"


@pytest.mark.parametrize(
    ("make", "argument"),
    [
        (lambda: TensorBoardSink(object()), "destination"),
        (lambda: LoggerSink(object()), "logger"),
        (lambda: LoggingSink(level="WARNING"), "level"),
        (lambda: TensorBoardSink(SummaryWriterStub()).write_text("", "x", 0), "tag"),
        (lambda: TensorBoardSink(SummaryWriterStub()).write_text("t", "x", -1), "step"),
        (lambda: spectrum_figure({}, "t"), "singular_values"),
        (lambda: spectrum_figure({"l0": np.array([1.0, -1.0])}, "t"), "singular_values"),
        (lambda: attention_heatmap_figure(np.ones(3), "t"), "probs"),
        (lambda: attention_heatmap_figure(np.ones((2, 3)), "t", np.array([1, 0, 0])), "key_padding_mask"),
        (lambda: layer_head_heatmap_figure(np.ones((2, 3)), ["l0"], "t"), "layer_names"),
        (lambda: layer_head_heatmap_figure(np.ones((2, 3)), ["l0", "l1"], "t", 1.0, 0.0), "vmin"),
    ],
)
def test_bad_input_names_the_argument(make, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        make()


class SummaryWriterStub:
    """Has every method a SummaryWriter has for the sink; each one fails as a full disk would."""

    def _fail(self, *args, **kwargs) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    add_scalar = add_histogram = add_image = add_text = add_custom_scalars = flush = _fail


@pytest.mark.parametrize(
    "write",
    [
        lambda sink: sink.write_measurements([Measurement(1, "attention", "entropy", "l0", 0.5)]),
        lambda sink: sink.write_distributions([Distribution(1, "attention", "entropy", "l0", np.ones(4))]),
        lambda sink: sink.write_figure("f", spectrum_figure({"l0": np.ones(3)}, "t"), 1),
        lambda sink: sink.write_text("alerts", "x", 1),
        lambda sink: sink.write_layout(per_layer_layout(["attention/entropy/l0"])),
        lambda sink: sink.flush(),
    ],
    ids=["scalars", "histograms", "figure", "text", "layout", "flush"],
)
def test_every_write_failure_is_a_sink_error_with_its_cause(write) -> None:
    with pytest.raises(SinkError, match="TensorBoard sink could not write") as raised:
        write(TensorBoardSink(SummaryWriterStub()))
    assert isinstance(raised.value.__cause__, OSError)
    assert raised.value.__cause__.errno == errno.ENOSPC


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to fill a disk")
def test_a_real_writer_on_a_full_disk_raises_sink_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The writer appends from a background thread, which dies of the error; collect it instead of
    # letting it be reported as an unhandled thread exception.
    thread_failures: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda failure: thread_failures.append(failure.exc_value))
    writer = SummaryWriter(log_dir=str(tmp_path))
    sink = TensorBoardSink(writer)
    (event_file,) = tmp_path.glob("events.out.tfevents.*")
    # TensorBoard's writer reopens its file by name for every append: the next append hits ENOSPC.
    event_file.unlink()
    event_file.symlink_to("/dev/full")

    sink.write_measurements([Measurement(1, "attention", "entropy", "l0", 0.5)])
    with pytest.raises(SinkError) as raised:
        sink.flush()
    assert isinstance(raised.value.__cause__, OSError)
    assert raised.value.__cause__.errno == errno.ENOSPC
    assert [failure.errno for failure in thread_failures] == [errno.ENOSPC]
    # The writer stays broken; every later write says so too.
    with pytest.raises(SinkError, match="text 'alerts' at step 2"):
        sink.write_text("alerts", "x", 2)

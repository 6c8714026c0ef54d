"""Measurements, histograms, figures, text and the Custom Scalars layout into TensorBoard event files."""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
import PIL.Image
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
from torch.utils.tensorboard import SummaryWriter

from spectral_monitor.records import Distribution, Measurement
from spectral_monitor.sinks.figures import release_figure
from spectral_monitor.sinks.layout import Layout, check_layout, merged_layout
from spectral_monitor.sinks.logger import Capability, Sink, SinkError, check_tag_and_step
from spectral_monitor.sinks.tfrecord import use_vectorised_checksums


class SummaryWriterLike(Protocol):
    """The part of ``torch.utils.tensorboard.SummaryWriter`` this sink uses (Lightning's
    ``TensorBoardLogger.experiment`` is one)."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any: ...

    def add_histogram(self, tag: str, values: np.ndarray, global_step: int | None = None) -> Any: ...

    def add_image(
        self, tag: str, img_tensor: np.ndarray, global_step: int | None = None, dataformats: str = "CHW"
    ) -> Any: ...

    def add_text(self, tag: str, text_string: str, global_step: int | None = None) -> Any: ...

    def add_custom_scalars(self, layout: Layout) -> Any: ...

    def flush(self) -> Any: ...


_WRITER_METHODS = ("add_scalar", "add_histogram", "add_image", "add_text", "add_custom_scalars", "flush")


class TensorBoardSink(Sink):
    """Writes every kind of output through a ``SummaryWriter``; the writer stays the caller's to close.

    Scalars are tagged ``Measurement.tag`` (``family/metric/layer[/head_h]``), so the Scalars tab groups
    by family and metric. Any failure of the writer (full disk, closed file) raises ``SinkError``.
    """

    capabilities = frozenset(Capability)

    def __init__(self, writer: SummaryWriterLike) -> None:
        missing = [name for name in _WRITER_METHODS if not callable(getattr(writer, name, None))]
        if missing:
            raise ValueError(
                f"writer must be a torch.utils.tensorboard.SummaryWriter or have its methods; "
                f"{type(writer).__name__} lacks {', '.join(missing)}"
            )
        self._writer = writer
        self._layout: Layout = {}

    def write_measurements(self, records: Iterable[Measurement]) -> None:
        """Each record as a scalar. Through a real ``SummaryWriter`` the scalars of one step go out as one
        event holding them all (as TensorFlow's merged summaries did): a logging step writes hundreds, and
        one event per scalar cost ~0.1 ms each."""
        records = list(records)
        for record in records:
            check_tag_and_step(record.tag, record.step)
        if not isinstance(self._writer, SummaryWriter):
            for record in records:
                with _failures_as_sink_error(f"scalar {record.tag!r} at step {record.step}"):
                    self._writer.add_scalar(record.tag, float(record.value), global_step=record.step)
            return
        self._write_one_event_per_step(
            (
                (record.step, Summary.Value(tag=record.tag, simple_value=float(record.value)))
                for record in records
            ),
            "scalars",
        )

    def write_distributions(self, records: Iterable[Distribution]) -> None:
        """Histograms of the finite values of each record; a record with none is skipped.

        Non-finite values have no bin; the matching scalars still show them. Through a real
        ``SummaryWriter`` the histograms of one step go out as one event, each with ``HISTOGRAM_BINS``
        equal-width buckets over its values (TensorBoard re-bins them for display anyway): ``add_histogram``
        with its 1549 default buckets cost ~0.6 ms per histogram, most of a logging step's writing.
        """
        finite_records = []
        for record in records:
            values = np.asarray(record.values, dtype=np.float64).ravel()
            finite = values[np.isfinite(values)]
            if finite.size:
                check_tag_and_step(record.tag, record.step)
                finite_records.append((record, finite))
        if not isinstance(self._writer, SummaryWriter):
            for record, finite in finite_records:
                with _failures_as_sink_error(f"histogram {record.tag!r} at step {record.step}"):
                    self._writer.add_histogram(record.tag, finite, global_step=record.step)
            return
        self._write_one_event_per_step(
            (
                (record.step, Summary.Value(tag=record.tag, histo=_histogram_proto(finite)))
                for record, finite in finite_records
            ),
            "histograms",
        )

    def _write_one_event_per_step(self, values: Iterable[tuple[int, Summary.Value]], what: str) -> None:
        """``(step, value)`` pairs as one event per step, straight to the real ``SummaryWriter``'s file.

        From then on every record of that file, Lightning's too, is checksummed by
        :mod:`spectral_monitor.sinks.tfrecord`: TensorBoard's pure-Python checksum of a logging step's events
        held the GIL for ≈ 20 ms.
        """
        by_step: dict[int, list[Summary.Value]] = {}
        for step, value in values:
            by_step.setdefault(step, []).append(value)
        for step, step_values in by_step.items():
            with _failures_as_sink_error(f"{len(step_values)} {what} at step {step}"):
                file_writer = self._writer._get_file_writer()
                use_vectorised_checksums(file_writer)
                file_writer.add_summary(Summary(value=step_values), step)

    def write_figure(self, tag: str, figure: Figure, step: int) -> None:
        """Render ``figure`` to an RGBA image under ``tag``, then release it (even if writing failed)."""
        try:
            check_tag_and_step(tag, step)
            if not isinstance(figure, Figure):
                raise ValueError(f"figure must be a matplotlib.figure.Figure; got {type(figure).__name__}")
            with _failures_as_sink_error(f"figure {tag!r} at step {step}"):
                canvas = FigureCanvasAgg(figure)
                canvas.draw()
                image = np.array(canvas.buffer_rgba())
            self.write_image(tag, image, step)
        finally:
            release_figure(figure)

    def write_image(self, tag: str, image: np.ndarray, step: int) -> None:
        """A rendered figure, (height, width, 3 or 4) uint8 RGB(A), as a PNG under ``tag``."""
        check_tag_and_step(tag, step)
        if (
            not isinstance(image, np.ndarray)
            or image.dtype != np.uint8
            or image.ndim != 3
            or image.shape[2] not in (3, 4)
            or 0 in image.shape
        ):
            shape = getattr(image, "shape", None)
            raise ValueError(
                f"image must be a non-empty (height, width, 3 or 4) uint8 array; got {type(image).__name__} "
                f"of shape {shape} and dtype {getattr(image, 'dtype', None)}"
            )
        if not isinstance(self._writer, SummaryWriter):
            with _failures_as_sink_error(f"image {tag!r} at step {step}"):
                self._writer.add_image(tag, image, global_step=step, dataformats="HWC")
            return
        if image.shape[2] == 4 and bool((image[:, :, 3] == 255).all()):
            image = image[:, :, :3]  # an opaque figure: a quarter less to encode
        with _failures_as_sink_error(f"image {tag!r} at step {step}"):
            value = Summary.Value(tag=tag, image=_png_proto(image))
        self._write_one_event_per_step([(step, value)], "images")

    def write_text(self, tag: str, markdown: str, step: int) -> None:
        """A markdown text entry; TensorBoard files it under ``<tag>/text_summary``."""
        check_tag_and_step(tag, step)
        with _failures_as_sink_error(f"text {tag!r} at step {step}"):
            self._writer.add_text(tag, markdown, global_step=step)

    def write_layout(self, layout: Layout) -> bool:
        """Add ``layout``'s charts to the Custom Scalars layout; write it only if a chart is new or changed.

        The layout written is the union of every layout given so far, so passing the charts of one step
        never hides charts shown before. ``add_custom_scalars`` writes every layout at step 0, and the
        Custom Scalars plugin shows the newest layout record of each run, with TensorBoard's Python loader
        and its Rust data server alike (tests/test_tensorboard_server.py checks both on a live server).
        Returns whether a layout was written.
        """
        check_layout(layout)
        merged = merged_layout(self._layout, layout)
        if merged == self._layout:
            return False
        with _failures_as_sink_error("the custom-scalars layout"):
            self._writer.add_custom_scalars(merged)
        self._layout = merged
        return True

    def flush(self) -> None:
        with _failures_as_sink_error("pending events (flush)"):
            self._writer.flush()


HISTOGRAM_BINS = 30


def _histogram_proto(values: np.ndarray) -> HistogramProto:
    """The histogram of finite ``values`` (at least one) as TensorBoard stores it: right bucket edges and
    counts, with an empty bucket below the first so its left edge is kept (as ``SummaryWriter`` writes)."""
    low, high = float(values.min()), float(values.max())
    counts, edges = equal_width_histogram(values, HISTOGRAM_BINS, low=low, high=high)
    return HistogramProto(
        min=low,
        max=high,
        num=float(values.size),
        sum=float(values.sum()),
        sum_squares=float(values @ values),
        bucket_limit=edges.tolist(),
        bucket=[0.0, *counts.tolist()],
    )


def equal_width_histogram(
    values: np.ndarray, bins: int, *, low: float | None = None, high: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``np.histogram(values, bins)`` for finite 1-D ``values``: counts and the ``bins + 1`` edges spanning
    them (a constant array gets the unit-wide range around its value, as numpy gives it). ``low`` and
    ``high``, when given, must be the values' min and max (a caller that has them saves a pass).

    The bucket index is computed directly: ``np.histogram``'s general path cost 0.08 ms per call, most of a
    logging step's 56 histograms on the demo model. A value within rounding of an inner edge may land in the
    neighbouring bucket from numpy's, which nothing displayed can show.
    """
    low = float(values.min()) if low is None else low
    high = float(values.max()) if high is None else high
    if low == high:
        low, high = low - 0.5, high + 0.5
    edges = low + (high - low) * (np.arange(bins + 1) / bins)
    edges[-1] = high
    index = ((values - low) * (bins / (high - low))).astype(np.intp)  # >= 0: no value is below low
    counts = np.bincount(np.minimum(index, bins - 1), minlength=bins)
    return counts, edges


def _png_proto(image: np.ndarray) -> Summary.Image:
    """``image`` (height, width, 3 or 4) uint8 as TensorBoard's image proto, PNG at zlib level 1.

    ``add_image`` encodes at PIL's default level 6: 11–17 ms for each of the demo's figures against 7–10 ms
    at level 1, for files within ±10% of the size (a redrawn figure itself takes 25–50 ms).
    """
    buffer = io.BytesIO()
    PIL.Image.fromarray(image).save(buffer, format="PNG", compress_level=1)
    height, width, channels = image.shape
    return Summary.Image(
        height=height, width=width, colorspace=channels, encoded_image_string=buffer.getvalue()
    )


@contextmanager
def _failures_as_sink_error(what: str) -> Iterator[None]:
    try:
        yield
    except Exception as error:
        raise SinkError(f"TensorBoard sink could not write {what}: {error!r}") from error

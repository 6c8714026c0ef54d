"""Measurements, histograms, figures, text and the Custom Scalars layout into TensorBoard event files."""

from __future__ import annotations

import errno
import io
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import PIL.Image
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import custom_scalars as custom_scalars_summary
from torch.utils.tensorboard.summary import text as text_summary

from spectral_monitor.records import Distribution, Measurement
from spectral_monitor.sinks.layout import Layout, check_layout, merged_layout
from spectral_monitor.sinks.logger import Capability, Sink, SinkError, check_tag_and_step
from spectral_monitor.sinks.redrawn import release_figure
from spectral_monitor.sinks.tfrecord import EventFile


class SummaryWriterLike(Protocol):
    """The part of ``torch.utils.tensorboard.SummaryWriter`` this sink uses (Lightning's
    ``TensorBoardLogger.experiment`` is one). What its methods return is ignored.

    Examples:
        >>> import tempfile
        >>> from torch.utils.tensorboard import SummaryWriter
        >>> with tempfile.TemporaryDirectory() as run:
        ...     writer: SummaryWriterLike = SummaryWriter(run)
        ...     TensorBoardSink(writer).write_text("notes", "a note", step=0)
        ...     writer.close()
    """

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any:
        """Write one scalar.

        Args:
            tag: The scalar's tag.
            scalar_value: Its value.
            global_step: The training step.

        Returns:
            Anything; ignored.
        """

    def add_histogram(self, tag: str, values: np.ndarray, global_step: int | None = None) -> Any:
        """Write the histogram of some values.

        Args:
            tag: The histogram's tag.
            values: The values, all finite.
            global_step: The training step.

        Returns:
            Anything; ignored.
        """

    def add_image(
        self, tag: str, img_tensor: np.ndarray, global_step: int | None = None, dataformats: str = "CHW"
    ) -> Any:
        """Write an image.

        Args:
            tag: The image's tag.
            img_tensor: The image, uint8.
            global_step: The training step.
            dataformats: The order of its axes; the sink gives ``"HWC"``.

        Returns:
            Anything; ignored.
        """

    def add_text(self, tag: str, text_string: str, global_step: int | None = None) -> Any:
        """Write a markdown text entry.

        Args:
            tag: The entry's tag.
            text_string: The markdown.
            global_step: The training step.

        Returns:
            Anything; ignored.
        """

    def add_custom_scalars(self, layout: Layout) -> Any:
        """Write the Custom Scalars layout.

        Args:
            layout: The layout, in the form of :data:`~spectral_monitor.sinks.layout.Layout`.

        Returns:
            Anything; ignored.
        """

    def flush(self) -> Any:
        """Write out what is pending.

        Returns:
            Anything; ignored.
        """


_WRITER_METHODS = ("add_scalar", "add_histogram", "add_image", "add_text", "add_custom_scalars", "flush")

MAX_RETRY_DELAY_STEPS = 1024
"""The longest back-off, in steps, between two attempts to write after failures in a row."""


@dataclass
class WriteLosses:
    """What a sink could not write; true once anything was lost.

    Attributes:
        counts: ``counts[kind][step]``: items of each kind (``"scalars"``, ``"images"``, ...) lost at
            each step.
        first_error: The first error met, or None.

    Examples:
        >>> losses = WriteLosses()
        >>> losses.add("scalars", 3, 10, OSError(28, "No space left on device"))
        >>> losses.add("scalars", 4, 10)
        >>> bool(losses), losses.describe()
        (True, "20 scalars at steps 3–4 (first error: ENOSPC: OSError(28, 'No space left on device'))")
    """

    counts: dict[str, dict[int, int]] = field(default_factory=dict)
    first_error: BaseException | None = None

    def add(self, kind: str, step: int, count: int, error: BaseException | None = None) -> None:
        """Count items lost.

        Args:
            kind: What they are (``"scalars"``, ``"histograms"``, ``"images"``, ``"texts"``, ``"layouts"``).
            step: The step they belong to.
            count: How many.
            error: Why, where an error said so; kept if it is the first.
        """
        by_step = self.counts.setdefault(kind, {})
        by_step[step] = by_step.get(step, 0) + count
        if self.first_error is None and error is not None:
            self.first_error = error

    def __bool__(self) -> bool:
        return bool(self.counts)

    def describe(self) -> str:
        """What was lost, in one line.

        Returns:
            Each kind's count and the steps it was lost at, then the first error.
        """
        parts = [
            f"{sum(by_step.values())} {kind} at steps {steps_phrase(sorted(by_step))}"
            for kind, by_step in self.counts.items()
        ]
        return "; ".join(parts) + f" (first error: {_described(self.first_error)})"


class TensorBoardSink(Sink):
    """Writes every kind of output to TensorBoard.

    Given a run directory (``str`` or path), the sink writes its own event file there
    (:class:`~spectral_monitor.sinks.tfrecord.EventFile`), beside the training framework's: TensorBoard shows
    both as one run, and nothing of the framework's writer is touched. A failure to write (no space, I/O
    error, permission) raises ``SinkError`` once; the sink then waits 1, 2, 4, ... steps (at most
    ``MAX_RETRY_DELAY_STEPS``) between attempts while they keep failing, and counts what it could not write
    in ``losses``, the skipped writes included.

    Given a ``SummaryWriter`` (or an object with its methods), it writes through it, and the writer stays the
    caller's to close. Any failure of the writer raises ``SinkError``.

    Scalars are tagged ``Measurement.tag`` (``family/metric/layer[/head_h]``), so the Scalars tab groups
    by family and metric.

    Args:
        destination: A run directory, or a ``SummaryWriter`` (:class:`SummaryWriterLike`).

    Attributes:
        losses: What could not be written to the sink's own event file (:class:`WriteLosses`).

    Raises:
        ValueError: ``destination`` is neither a path nor an object with the writer's methods.

    Examples:
        >>> import tempfile
        >>> from spectral_monitor.records import Measurement
        >>> from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        >>> with tempfile.TemporaryDirectory() as run:
        ...     sink = TensorBoardSink(run)
        ...     sink.write_measurements([Measurement(3, "attention", "entropy", "blocks.0.attn", 0.5)])
        ...     sink.close()
        ...     events = EventAccumulator(run)
        ...     _ = events.Reload()
        ...     [(scalar.step, scalar.value) for scalar in events.Scalars("attention/entropy/blocks.0.attn")]
        [(3, 0.5)]
    """

    capabilities = frozenset(Capability)

    def __init__(self, destination: SummaryWriterLike | str | os.PathLike[str]) -> None:
        self._events: EventFile | None = None
        if isinstance(destination, (str, os.PathLike)):
            self._events = EventFile(destination)
        else:
            missing = [name for name in _WRITER_METHODS if not callable(getattr(destination, name, None))]
            if missing:
                raise ValueError(
                    f"destination must be a run directory, a torch.utils.tensorboard.SummaryWriter or an "
                    f"object with its methods; {type(destination).__name__} lacks {', '.join(missing)}"
                )
        self._writer = destination
        self._layout: Layout = {}
        self.losses = WriteLosses()
        self._latest_step = 0
        self._failures_in_a_row = 0
        self._next_attempt_step = 0

    @property
    def log_dir(self) -> str | None:
        """The run directory of the sink's own event file; None when it writes through a writer."""
        return None if self._events is None else self._events.log_dir

    def close(self) -> None:
        """Close the sink's own event file (a writer given to it stays open)."""
        if self._events is not None:
            self._events.close()

    def write_measurements(self, records: Iterable[Measurement]) -> None:
        """Each record as a scalar.

        The scalars of one step go out as one event holding them all (as TensorFlow's merged summaries
        did): a logging step writes hundreds, and each event carries a header, a checksum and a write of
        its own.

        Args:
            records: The measurements, of one or more steps.

        Raises:
            ValueError: A record's tag is empty or its step negative.
            SinkError: Writing failed.
        """
        records = list(records)
        for record in records:
            check_tag_and_step(record.tag, record.step)
        if self._events is None and not isinstance(self._writer, SummaryWriter):
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

        Non-finite values have no bin; the matching scalars still show them. The histograms of one step go
        out as one event, each with ``HISTOGRAM_BINS`` equal-width buckets over its values (TensorBoard
        re-bins them for display anyway), far fewer than ``add_histogram``'s 1549 default buckets.

        Args:
            records: The distributions, of one or more steps.

        Raises:
            ValueError: A record's tag is empty or its step negative.
            SinkError: Writing failed.
        """
        finite_records = []
        for record in records:
            values = np.asarray(record.values, dtype=np.float64).ravel()
            finite = values[np.isfinite(values)]
            if finite.size:
                check_tag_and_step(record.tag, record.step)
                finite_records.append((record, finite))
        if self._events is None and not isinstance(self._writer, SummaryWriter):
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
        """``(step, value)`` pairs as one event per step."""
        by_step: dict[int, list[Summary.Value]] = {}
        for step, value in values:
            by_step.setdefault(step, []).append(value)
        for step, step_values in by_step.items():
            self._write_summary(Summary(value=step_values), step, what, len(step_values))

    def _write_summary(self, summary: Summary, step: int, what: str, count: int) -> bool:
        """``summary`` as one event at ``step``; whether it was written (False: skipped while backing off).

        ``what`` and ``count`` say what it holds, for ``losses`` and the error.
        """
        if self._events is None:
            with _failures_as_sink_error(f"{count} {what} at step {step}"):
                self._writer._get_file_writer().add_summary(summary, step)
            return True
        self._latest_step = max(self._latest_step, step)
        if self._latest_step < self._next_attempt_step:
            self.losses.add(what, self._latest_step, count)
            return False
        try:
            self._events.add_summary(summary, step)
        except Exception as error:
            self.losses.add(what, self._latest_step, count, error)
            self._failures_in_a_row += 1
            delay = min(2 ** (self._failures_in_a_row - 1), MAX_RETRY_DELAY_STEPS)
            self._next_attempt_step = self._latest_step + delay
            raise SinkError(
                f"TensorBoard sink could not write {count} {what} at step {step} to {self._events.log_dir}: "
                f"{_described(error)}; it tries again in {delay} step{'s' if delay > 1 else ''}"
            ) from error
        self._failures_in_a_row = 0
        return True

    def write_figure(self, tag: str, figure: Figure, step: int) -> None:
        """Render a figure to an RGBA image, then release it, even if writing failed.

        Args:
            tag: The image's tag.
            figure: The figure; the sink owns it from now on.
            step: The training step.

        Raises:
            ValueError: ``figure`` is not a matplotlib figure, the tag is empty or the step negative.
            SinkError: Rendering or writing failed.
        """
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
        """A rendered figure as a PNG.

        Args:
            tag: The image's tag.
            image: A (height, width, 3 or 4) uint8 RGB(A) array.
            step: The training step.

        Raises:
            ValueError: ``image`` is not such an array, the tag is empty or the step negative.
            SinkError: Writing failed.
        """
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
        if self._events is None and not isinstance(self._writer, SummaryWriter):
            with _failures_as_sink_error(f"image {tag!r} at step {step}"):
                self._writer.add_image(tag, image, global_step=step, dataformats="HWC")
            return
        if image.shape[2] == 4 and bool((image[:, :, 3] == 255).all()):
            image = image[:, :, :3]  # an opaque figure: a quarter less to encode
        with _failures_as_sink_error(f"image {tag!r} at step {step}"):
            value = Summary.Value(tag=tag, image=_png_proto(image))
        self._write_summary(Summary(value=[value]), step, "images", 1)

    def write_text(self, tag: str, markdown: str, step: int) -> None:
        """A markdown text entry; TensorBoard files it under ``<tag>/text_summary``.

        Args:
            tag: The entry's tag.
            markdown: The text.
            step: The training step.

        Raises:
            ValueError: The tag is empty or the step negative.
            SinkError: Writing failed.
        """
        check_tag_and_step(tag, step)
        if self._events is None:
            with _failures_as_sink_error(f"text {tag!r} at step {step}"):
                self._writer.add_text(tag, markdown, global_step=step)
            return
        self._write_summary(text_summary(tag, markdown), step, "texts", 1)

    def write_layout(self, layout: Layout) -> bool:
        """Add ``layout``'s charts to the Custom Scalars layout; write it only if a chart is new or changed.

        The layout written is the union of every layout given so far, so passing the charts of one step
        never hides charts shown before. ``add_custom_scalars`` writes every layout at step 0, and the
        Custom Scalars plugin shows the newest layout record of each run, with TensorBoard's Python loader
        and its Rust data server alike.

        Args:
            layout: The charts to add (:data:`~spectral_monitor.sinks.layout.Layout`).

        Returns:
            Whether a layout was written.

        Raises:
            ValueError: ``layout`` is not of that form.
            SinkError: Writing failed.
        """
        check_layout(layout)
        merged = merged_layout(self._layout, layout)
        if merged == self._layout:
            return False
        if self._events is None:
            with _failures_as_sink_error("the custom-scalars layout"):
                self._writer.add_custom_scalars(merged)
        elif not self._write_summary(custom_scalars_summary(merged), 0, "layouts", 1):
            return False
        self._layout = merged
        return True

    def flush(self) -> None:
        """Flush a given writer; the sink's own file writes each event out as it is written.

        Raises:
            SinkError: The writer's flush failed.
        """
        if self._events is None:
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
    """``np.histogram(values, bins)`` for finite 1-D values, by a direct bucket index.

    The bucket index is computed directly, without the fixed cost of ``np.histogram``'s general-purpose
    path, which a logging step would pay once per histogram (benchmarks/README.md). A value within rounding
    of an inner edge may land in the neighbouring bucket from numpy's, which nothing displayed can show.

    Args:
        values: Finite 1-D values, at least one.
        bins: The number of equal-width buckets.
        low: The values' minimum, where the caller has it (it saves a pass).
        high: The values' maximum, likewise.

    Returns:
        ``(counts, edges)``: the count of each bucket and the ``bins + 1`` edges spanning the values (a
        constant array gets the unit-wide range around its value, as numpy gives it).

    Examples:
        >>> import numpy as np
        >>> equal_width_histogram(np.array([0.0, 1.0, 1.0, 4.0]), 4)
        (array([1, 2, 0, 1]), array([0., 1., 2., 3., 4.]))
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

    ``add_image`` encodes at PIL's default level 6, which on the monitor's flat-coloured figures takes longer
    than level 1 for files of about the same size (benchmarks/README.md).
    """
    buffer = io.BytesIO()
    PIL.Image.fromarray(image).save(buffer, format="PNG", compress_level=1)
    height, width, channels = image.shape
    return Summary.Image(
        height=height, width=width, colorspace=channels, encoded_image_string=buffer.getvalue()
    )


def _described(error: BaseException) -> str:
    """``repr(error)``, preceded by its errno's name (``ENOSPC``) for an ``OSError`` that has one."""
    code = getattr(error, "errno", None)
    return f"{errno.errorcode[code]}: {error!r}" if code in errno.errorcode else repr(error)


def steps_phrase(steps: Sequence[int]) -> str:
    """Steps in words, runs of consecutive steps as ranges.

    Args:
        steps: The steps, in increasing order.

    Returns:
        The phrase.

    Examples:
        >>> steps_phrase([1, 2, 3, 7])
        '1–3, 7'
    """
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}–{run[-1]}" for run in runs)


@contextmanager
def _failures_as_sink_error(what: str) -> Iterator[None]:
    try:
        yield
    except Exception as error:
        raise SinkError(f"TensorBoard sink could not write {what}: {error!r}") from error

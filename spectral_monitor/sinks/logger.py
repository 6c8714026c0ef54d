"""What every sink promises, and the sinks for destinations other than TensorBoard.

A sink takes records (and finished figures) and writes them somewhere; it knows nothing of how they were
computed. Each sink declares in ``capabilities`` what it keeps and drops the rest without error, so the
caller can warn once about what is lost and skip drawing figures that no sink keeps. A failure while
writing something a sink keeps raises ``SinkError``: the caller reports it and training goes on.
"""

from __future__ import annotations

import enum
import logging
import numbers
from collections.abc import Iterable, Mapping
from typing import Protocol

import numpy as np
from matplotlib.figure import Figure

from spectral_monitor.records import Distribution, Measurement
from spectral_monitor.sinks.layout import Layout
from spectral_monitor.sinks.redrawn import release_figure


class SinkError(RuntimeError):
    """Writing to a sink failed (full disk, broken writer, a logger that raised); ``__cause__`` says why.

    Examples:
        >>> from spectral_monitor.records import Measurement
        >>> class Broken:
        ...     def log_metrics(self, metrics, step=None):
        ...         raise OSError("disk full")
        >>> try:
        ...     LoggerSink(Broken()).write_measurements([Measurement(3, "attention", "entropy", "a", 0.5)])
        ... except SinkError as error:
        ...     print(type(error.__cause__).__name__)
        OSError
    """


class Capability(enum.Enum):
    """A kind of output a sink can keep.

    Examples:
        >>> Capability.SCALARS in LoggingSink().capabilities, Capability.TEXT in LoggingSink().capabilities
        (False, True)
    """

    SCALARS = "scalars"
    HISTOGRAMS = "histograms"
    FIGURES = "figures"
    TEXT = "text"
    LAYOUT = "layout"


class Sink:
    """The interface of every sink. Each method here drops its input: a sink overrides the methods of
    the kinds it lists in ``capabilities``.

    ``write_figure`` takes ownership of the figure: it is released whether or not it was written.
    ``write_image`` takes a figure already rendered (``spectral_monitor.sinks.figures`` redraws kept figures
    into images); both belong to ``Capability.FIGURES``.

    Attributes:
        capabilities: The kinds of output the sink keeps.

    Examples:
        A sink overrides what it keeps:

        >>> class PrintedText(Sink):
        ...     capabilities = frozenset({Capability.TEXT})
        ...     def write_text(self, tag, markdown, step):
        ...         print(f"step {step} {tag}: {markdown}")
        >>> PrintedText().write_text("alerts/table", "no open alert", 3)
        step 3 alerts/table: no open alert
    """

    capabilities: frozenset[Capability] = frozenset()

    def write_measurements(self, records: Iterable[Measurement]) -> None:
        """Write scalar measurements.

        Args:
            records: The measurements, of one or more steps.

        Raises:
            SinkError: Writing failed, in a sink that keeps scalars.
        """

    def write_distributions(self, records: Iterable[Distribution]) -> None:
        """Write distributions as histograms.

        Args:
            records: The distributions, of one or more steps.

        Raises:
            SinkError: Writing failed, in a sink that keeps histograms.
        """

    def write_figure(self, tag: str, figure: Figure, step: int) -> None:
        """Write a rendered figure, then release it, written or not.

        Args:
            tag: The figure's tag.
            figure: The figure; the sink owns it from now on.
            step: The training step.

        Raises:
            SinkError: Writing failed, in a sink that keeps figures.
        """
        release_figure(figure)

    def write_image(self, tag: str, image: np.ndarray, step: int) -> None:
        """Write an already rendered figure.

        Args:
            tag: The image's tag.
            image: An (height, width, 3 or 4) uint8 RGB(A) array.
            step: The training step.

        Raises:
            SinkError: Writing failed, in a sink that keeps figures.
        """

    def write_text(self, tag: str, markdown: str, step: int) -> None:
        """Write a text entry.

        Args:
            tag: The entry's tag.
            markdown: The text, as markdown.
            step: The training step.

        Raises:
            SinkError: Writing failed, in a sink that keeps text.
        """

    def write_layout(self, layout: Layout) -> bool:
        """Write a custom-scalars layout.

        Args:
            layout: The layout (:data:`~spectral_monitor.sinks.layout.Layout`).

        Returns:
            Whether anything was written.

        Raises:
            SinkError: Writing failed, in a sink that keeps layouts.
        """
        return False

    def flush(self) -> None:
        """Make everything written so far durable.

        Raises:
            SinkError: Flushing failed.
        """

    def close(self) -> None:
        """Release what the sink opened itself; it writes nothing after this."""


class MetricsLogger(Protocol):
    """Anything with Lightning's ``Logger.log_metrics``: CSV, MLflow, W&B, ... loggers.

    Examples:
        >>> class Printed:
        ...     def log_metrics(self, metrics, step=None):
        ...         print(step, metrics)
        >>> logger: MetricsLogger = Printed()
        >>> logger.log_metrics({"attention/entropy/a": 0.5}, step=3)
        3 {'attention/entropy/a': 0.5}
    """

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log the scalars of one step.

        Args:
            metrics: Each scalar by name.
            step: The step they belong to.
        """


class LoggerSink(Sink):
    """Scalars to any Lightning-style logger, one ``log_metrics`` call per step, keyed by ``Measurement.tag``.

    Histograms, figures, text and layouts are dropped: ``capabilities`` says so. The logger keeps its own
    flushing schedule, so ``flush`` does nothing.

    Args:
        logger: Any logger with Lightning's ``log_metrics(metrics, step)``.

    Raises:
        ValueError: ``logger`` has no ``log_metrics`` method.

    Examples:
        >>> from spectral_monitor.records import Measurement
        >>> class Printed:
        ...     def log_metrics(self, metrics, step=None):
        ...         print(step, metrics)
        >>> entropy = Measurement(3, "attention", "entropy", "a", 0.5)
        >>> sigma1 = Measurement(3, "attention", "sigma1", "a", 2.0)
        >>> LoggerSink(Printed()).write_measurements([entropy, sigma1])
        3 {'attention/entropy/a': 0.5, 'attention/sigma1/a': 2.0}
    """

    capabilities = frozenset({Capability.SCALARS})

    def __init__(self, logger: MetricsLogger) -> None:
        if not callable(getattr(logger, "log_metrics", None)):
            raise ValueError(
                f"logger must have a log_metrics(metrics, step) method like Lightning's loggers; "
                f"got {type(logger).__name__}"
            )
        self._logger = logger

    def write_measurements(self, records: Iterable[Measurement]) -> None:
        """Log the measurements, one ``log_metrics`` call per step, keyed by ``Measurement.tag``.

        Args:
            records: The measurements, of one or more steps.

        Raises:
            SinkError: The logger raised; ``__cause__`` is what it raised.
        """
        metrics_by_step: dict[int, dict[str, float]] = {}
        for record in records:
            metrics_by_step.setdefault(record.step, {})[record.tag] = float(record.value)
        for step, metrics in metrics_by_step.items():
            try:
                self._logger.log_metrics(metrics, step=step)
            except Exception as error:
                raise SinkError(
                    f"{type(self._logger).__name__}.log_metrics failed at step {step}: {error!r}"
                ) from error


class LoggingSink(Sink):
    """Text entries (alerts, notes) as lines of Python ``logging``, at one level.

    Everything else is dropped. ``logging`` reports its own handler failures and never raises, so this
    sink never raises ``SinkError``.

    Args:
        logger: The logger; by default the ``spectral_monitor`` logger.
        level: The level of every line, such as ``logging.WARNING``.

    Raises:
        ValueError: ``logger`` is not a ``logging.Logger`` or ``level`` not an int.

    Examples:
        >>> import logging, sys
        >>> logger = logging.getLogger("spectral_monitor.example")
        >>> logger.addHandler(logging.StreamHandler(sys.stdout))
        >>> LoggingSink(logger, logging.WARNING).write_text("alerts/table", "entropy collapse", 3)
        step 3 alerts/table: entropy collapse
    """

    capabilities = frozenset({Capability.TEXT})

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        if logger is not None and not isinstance(logger, logging.Logger):
            raise ValueError(f"logger must be a logging.Logger or None; got {type(logger).__name__}")
        if not isinstance(level, int) or isinstance(level, bool):
            raise ValueError(f"level must be a logging level such as logging.WARNING; got {level!r}")
        self._logger = logger if logger is not None else logging.getLogger("spectral_monitor")
        self._level = level

    def write_text(self, tag: str, markdown: str, step: int) -> None:
        """Log one line: ``step <step> <tag>: <markdown>``.

        Args:
            tag: The entry's tag.
            markdown: The text.
            step: The training step.

        Raises:
            ValueError: ``tag`` is empty or ``step`` not a non-negative integer.
        """
        check_tag_and_step(tag, step)
        self._logger.log(self._level, "step %d %s: %s", step, tag, markdown)


def check_tag_and_step(tag: str, step: int) -> None:
    """Check the tag and step of something to write.

    Args:
        tag: Must be a non-empty string.
        step: Must be a non-negative integer.

    Raises:
        ValueError: One of them is not, naming which.

    Examples:
        >>> check_tag_and_step("attention/entropy/a", 3)
        >>> check_tag_and_step("attention/entropy/a", -1)
        Traceback (most recent call last):
        ValueError: step must be a non-negative integer; got -1
    """
    if type(step) is int and step >= 0 and type(tag) is str and tag:
        return  # every record of every logging step comes here; the ABC check below is the slow part
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"tag must be a non-empty string; got {tag!r}")
    if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative integer; got {step!r}")

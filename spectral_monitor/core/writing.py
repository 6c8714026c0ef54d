"""How a step's records reach the sinks: each output to the sinks that keep it, each failure reported once.

A sink knows nothing of how a record was measured; this module knows nothing of that either. It hands every
sink the step's measurements, and to a sink with the matching :class:`~spectral_monitor.sinks.Capability` its
distributions, dashboard layout, figures and texts. A figure is drawn only when some sink keeps figures.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from spectral_monitor.core.alerting import ALERT_TEXT_TAG
from spectral_monitor.core.family_protocol import LoggingStep
from spectral_monitor.core.reports import Reports
from spectral_monitor.sinks import Capability, Layout, Sink, diagnosis_layout

__all__ = ["StepWriter"]


class StepWriter:
    """Writes each step's records to the run's sinks.

    A sink's failure is reported (or raised, when strict) under the kind ``"writing to <sink type>"``, so a
    full disk is one problem whichever output meets it; a figure that fails to draw under
    ``"drawing figures"``. Unless strict, one sink's failure never keeps the others from their writes.

    Args:
        reports: where failures go.

    Examples:
        >>> from spectral_monitor.sinks import LoggingSink
        >>> import logging, sys
        >>> logger = logging.getLogger("spectral_monitor.example.writing")
        >>> logger.addHandler(logging.StreamHandler(sys.stdout))
        >>> StepWriter(Reports(strict=True)).write_texts([LoggingSink(logger, logging.WARNING)],
        ...                                              [("notes/run", "started")], step=0)
        step 0 notes/run: started
    """

    def __init__(self, reports: Reports) -> None:
        self._reports = reports
        # The layout of the last step's tags: steps mostly write the same tags, so it is derived again only
        # when they change.
        self._layout_of_tags: tuple[frozenset[str], Layout] = (frozenset(), {})

    def write(self, sinks: Sequence[Sink], progress: LoggingStep) -> None:
        """Every record of ``progress`` to every sink that keeps its kind, figures drawn on demand.

        Every sink gets the measurements; a sink with the matching capability the distributions, the
        dashboard layout of the step's tags (derived again only when the tags change), the alert text, the
        figures (each drawn when a sink keeping figures reaches it) and the step's texts.

        Args:
            sinks: the run's sinks, written in order.
            progress: what the step gathered.
        """
        layout = self._layout(progress)
        reports = self._reports
        for sink in sinks:
            kind = type(sink).__name__
            with reports.failures_of(f"writing to {kind}"):
                sink.write_measurements(progress.measurements)
                if Capability.HISTOGRAMS in sink.capabilities:
                    sink.write_distributions(progress.distributions)
                if Capability.LAYOUT in sink.capabilities and layout:
                    sink.write_layout(layout)
                if Capability.TEXT in sink.capabilities and progress.alert_text is not None:
                    sink.write_text(ALERT_TEXT_TAG, progress.alert_text, progress.step)
            if Capability.FIGURES in sink.capabilities:
                for tag, draw in progress.figures:
                    drawn = None
                    with reports.failures_of("drawing figures"):
                        drawn = draw()
                    if drawn is not None:
                        # A full disk is one fault whichever output meets it: reported with the others.
                        with reports.failures_of(f"writing to {kind}"):
                            if isinstance(drawn, Figure):
                                sink.write_figure(tag, drawn, progress.step)
                            else:
                                sink.write_image(tag, drawn, progress.step)
        self.write_texts(sinks, progress.texts, progress.step)

    def write_texts(self, sinks: Sequence[Sink], texts: Sequence[tuple[str, str]], step: int) -> None:
        """``(tag, markdown)`` texts filed under ``step`` to every sink that keeps text.

        Args:
            sinks: the run's sinks; those without ``Capability.TEXT`` are skipped.
            texts: ``(tag, markdown)`` pairs, written in order.
            step: the step they are filed under.
        """
        for sink in sinks:
            if Capability.TEXT not in sink.capabilities:
                continue
            # One kind with the steps' writes: an unwritable run directory is one problem, reported once.
            with self._reports.failures_of(f"writing to {type(sink).__name__}"):
                for tag, markdown in texts:
                    sink.write_text(tag, markdown, step)

    def _layout(self, progress: LoggingStep) -> Layout:
        tags = frozenset(record.tag for record in progress.measurements)
        if tags != self._layout_of_tags[0]:
            self._layout_of_tags = (tags, diagnosis_layout(tags) if tags else {})
        return self._layout_of_tags[1]

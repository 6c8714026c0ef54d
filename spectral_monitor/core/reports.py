"""How the monitor reports its own failures: once per kind, raised in strict mode, summed up at the end.

A failure inside the monitor never stops training unless ``strict``; what was lost is named in one warning
at the end of the run. Warnings come from the writing rank only.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from spectral_monitor.core.options import MonitorOptions
from spectral_monitor.distributed import global_rank
from spectral_monitor.sinks import Capability, Sink, steps_phrase


class Reports:
    """Reports each kind of problem once; with ``strict`` failures and problems raise instead.

    Every failure is also kept, by what failed and the step it failed at (``step``, set by the session), for
    the end-of-run report.

    Args:
        strict: whether a failure or a non-finite measurement raises instead of being reported once.

    Attributes:
        writes: whether this process warns (the writing rank only); True until the session says otherwise.
        step: the step that failures are filed under.
        failed_steps: what failed → the steps it failed at, ascending, each once; cleared by
            :meth:`end_of_run`.

    Examples:
        >>> import warnings
        >>> reports = Reports(strict=False)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     for reports.step in (3, 5):
        ...         with reports.failures_of("writing to LoggerSink"):
        ...             raise OSError("disk full")
        >>> len(caught), reports.failed_steps
        (1, {'writing to LoggerSink': [3, 5]})
    """

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.writes = True  # whether this process warns: the writing rank only
        self.step = 0
        self.failed_steps: dict[str, list[int]] = {}
        self._reported: set[str] = set()

    def once(self, kind: str, message: str) -> None:
        """A RuntimeWarning the first time ``kind`` is reported; later reports of ``kind`` are silent.

        Args:
            kind: What the problem is about; one warning per kind.
            message: The warning's text, without the ``SpectralMonitor:`` prefix and the final stop.
        """
        if kind not in self._reported:
            self._reported.add(kind)
            self.warn(f"SpectralMonitor: {message}.")

    def warn(self, message: str) -> None:
        """A RuntimeWarning, on the writing rank only.

        Args:
            message: the warning's whole text.
        """
        if self.writes:
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def end_of_run(self, sinks: Sequence[Sink]) -> None:
        """One warning listing every part that failed, at which steps, and what each sink could not write;
        nothing when nothing was lost. The failures are forgotten afterwards.

        Args:
            sinks: the run's sinks; a sink's ``losses``, where it has them, say what it could not write.
        """
        lines = [f"{what} failed at steps {steps_phrase(steps)}" for what, steps in self.failed_steps.items()]
        lines += [
            f"{type(sink).__name__} could not write {sink.losses.describe()}"
            for sink in sinks
            if getattr(sink, "losses", None)
        ]
        if lines:
            self.warn("SpectralMonitor: end of the run; lost to failures: " + "; ".join(lines) + ".")
        self.failed_steps = {}

    def problem(self, kind: str, message: str) -> None:
        """A measurement that came out wrong (non-finite): raised when strict, else reported once.

        Args:
            kind: what the problem is about; one warning per kind.
            message: what came out wrong, without the ``SpectralMonitor:`` prefix.

        Raises:
            FloatingPointError: when ``strict``.
        """
        if self.strict:
            raise FloatingPointError(f"SpectralMonitor: {message} (strict=True)")
        self.once(kind, f"{message}. Reported once")

    @contextmanager
    def failures_of(self, what: str) -> Iterator[None]:
        """Runs a step of the monitor; a failure is re-raised when strict, else reported once and skipped.

        A failure (any ``Exception``) is filed under ``what`` at the current :attr:`step` either way.

        Args:
            what: what the guarded code does (``"writing to TensorBoardSink"``); one warning per ``what``.

        Yields:
            Nothing: the guarded code runs in the ``with`` block.

        Raises:
            Exception: the guarded code's failure, re-raised as it is when ``strict``.
        """
        try:
            yield
        except Exception as error:
            steps = self.failed_steps.setdefault(what, [])
            if not steps or steps[-1] != self.step:
                steps.append(self.step)
            if self.strict:
                raise
            self.once(
                what,
                f"{what} failed with {error!r}; training goes on without it. Later failures of this kind "
                "are not reported (strict=True raises them)",
            )


def outputs_not_kept(options: MonitorOptions, sinks: Sequence[Sink]) -> list[str]:
    """What the options ask to write that none of ``sinks`` keeps, for the integration's one warning naming
    its loggers.

    The custom-scalars layout is always asked for; histograms when ``options.outputs.histograms``, figures
    when ``options.outputs.figures_every_n_logs``.

    Args:
        options: the monitor's options.
        sinks: the run's sinks.

    Returns:
        ``"the custom-scalars layout"``, ``"histograms"``, ``"figures"``: those asked for and kept by none of
        ``sinks``, in that order.

    Examples:
        >>> from spectral_monitor.sinks import LoggingSink
        >>> outputs_not_kept(MonitorOptions(), [LoggingSink()])
        ['the custom-scalars layout', 'histograms', 'figures']
    """
    wanted = {Capability.LAYOUT: "the custom-scalars layout"}
    if options.outputs.histograms:
        wanted[Capability.HISTOGRAMS] = "histograms"
    if options.outputs.figures_every_n_logs:
        wanted[Capability.FIGURES] = "figures"
    return [what for capability, what in wanted.items() if not kept_by(sinks, capability)]


def kept_by(sinks: Sequence[Sink], capability: Capability) -> bool:
    """Whether any of ``sinks`` keeps what ``capability`` names.

    Args:
        sinks: The run's sinks.
        capability: A kind of output beyond scalars.

    Returns:
        ``True`` when at least one sink declares ``capability``.

    Examples:
        >>> from spectral_monitor.sinks import LoggingSink
        >>> kept_by([LoggingSink()], Capability.TEXT), kept_by([LoggingSink()], Capability.FIGURES)
        (True, False)
    """
    return any(capability in sink.capabilities for sink in sinks)


def warn_of_dropped_entries(dropped: list[str]) -> None:
    """One RuntimeWarning, on global rank 0, naming every entry of a checkpoint that was dropped; nothing when
    none was.

    Args:
        dropped: a description of each dropped entry (what it was and why it could not be used).

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_of_dropped_entries(["alerts: not a mapping"])
        >>> str(caught[0].message).endswith("start cold, as in a new run: alerts: not a mapping")
        True
    """
    if dropped and global_rank() == 0:
        warnings.warn(
            "SpectralMonitor: the checkpoint's monitor state holds entries it cannot use; they were dropped "
            f"and those parts start cold, as in a new run: {'; '.join(dropped)}",
            RuntimeWarning,
            stacklevel=3,
        )

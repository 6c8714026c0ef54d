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
        """A RuntimeWarning, on the writing rank only."""
        if self.writes:
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def end_of_run(self, sinks: Sequence[Sink]) -> None:
        """One warning listing every part that failed, at which steps, and what each sink could not write;
        nothing when nothing was lost."""
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
        """A measurement that came out wrong (non-finite): raised when strict, else reported once."""
        if self.strict:
            raise FloatingPointError(f"SpectralMonitor: {message} (strict=True)")
        self.once(kind, f"{message}. Reported once")

    @contextmanager
    def failures_of(self, what: str) -> Iterator[None]:
        """Runs a step of the monitor; a failure is re-raised when strict, else reported once and skipped."""
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
    """What the options ask to write that none of ``sinks`` keeps (``"histograms"``, ``"figures"``, ...),
    for the integration's one warning naming its loggers."""
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
    """
    return any(capability in sink.capabilities for sink in sinks)


def warn_of_dropped_entries(dropped: list[str]) -> None:
    """One warning, on global rank 0, naming every entry of a checkpoint that was dropped."""
    if dropped and global_rank() == 0:
        warnings.warn(
            "SpectralMonitor: the checkpoint's monitor state holds entries it cannot use; they were dropped "
            f"and those parts start cold, as in a new run: {'; '.join(dropped)}",
            RuntimeWarning,
            stacklevel=3,
        )

"""The protocol a session drives its probe families by, :class:`ProbeFamily`, and what they share.

A family is everything the monitor does for one kind of measurement (:mod:`spectral_monitor.core.families`
holds the built-in ones). This module holds what every family is handed: the :class:`Run` it measures, at its
start, and the :class:`LoggingStep` it adds its records to; the base of a family that captures during the
forward, :class:`CaptureFamily`; and the rules the families share: which layers ``include``/``exclude``
select, and how a per-sequence metric is summed up over the sequences.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from spectral_monitor.checkpoint_entries import StateEntries
from spectral_monitor.core.options import MonitorOptions
from spectral_monitor.core.reports import Reports
from spectral_monitor.core.second_order import LossFn
from spectral_monitor.probes import SkippedCapture
from spectral_monitor.probes.wrappers import unwrapped_named_modules
from spectral_monitor.records import Distribution, Measurement
from spectral_monitor.sinks import Capability

__all__ = [
    "CaptureFamily",
    "LoggingStep",
    "ProbeFamily",
    "Run",
    "any_match",
    "layer_selected",
    "counted_sequences",
    "mean_over_sequences",
    "report_skipped",
    "warn_of_unmatched_patterns",
]

_EXAMPLE_NAMES = 8


@dataclass
class LoggingStep:
    """What one step has gathered so far for the alerts and the sinks; dropped once written.

    Attributes:
        step: the caller's step the records are filed under.
        logs_done: the logging steps before this one (the cadences in logging steps read it).
        figures_due: whether the figure cadence falls on this step.
        draw_figures: ``figures_due`` and some sink keeps figures.
        batch: the step's batch, for a compiled model's probe forward.
        token_mask: the batch's (batch, tokens) real tokens, by the ``token_mask`` option, or None.
        probed: whether the probe forward ran.
        measurements: the records written to the sinks and judged by the alerts.
        read_only: records judged by the alerts but not written (per-head values without ``per_head``).
        distributions: the histograms to write.
        figures: ``(tag, draw)``: ``draw()`` makes the figure (or an RGB(A) image) when a sink keeps figures.
        texts: ``(tag, markdown)`` text entries.
        alert_text: the open-alerts table, when it is to be written.

    Examples:
        >>> from spectral_monitor.records import Measurement
        >>> progress = LoggingStep(step=10, logs_done=2)
        >>> progress.measurements.append(Measurement(10, "weights", "spectral_norm", "fc", 1.5))
        >>> len(progress.measurements), progress.read_only, progress.alert_text
        (1, [], None)
    """

    step: int
    logs_done: int = 0
    figures_due: bool = False
    draw_figures: bool = False
    batch: Any = None
    token_mask: Tensor | None = None
    probed: bool = False
    measurements: list[Measurement] = field(default_factory=list)
    read_only: list[Measurement] = field(default_factory=list)
    distributions: list[Distribution] = field(default_factory=list)
    figures: list[tuple[str, Callable[[], Figure | np.ndarray]]] = field(default_factory=list)
    texts: list[tuple[str, str]] = field(default_factory=list)
    alert_text: str | None = None


@dataclass
class Run:
    """What a family is told of the run it measures, at :meth:`ProbeFamily.start`.

    Attributes:
        model: the module whose forward the training step calls.
        training_root: the outermost module trained (a DDP or FSDP wrapper of ``model``, or ``model``).
        kept: whether some sink of the run keeps an output of the given capability.
        default_loss: the loss the second-order probes use when the options give none.
        step_offset: how far the caller's steps run ahead of the optimizer steps the cadences count.
        texts: ``(tag, markdown)`` a family files at the start of the run, written under the first step begun.

    Examples:
        >>> from torch import nn
        >>> model = nn.Linear(2, 2)
        >>> run = Run(model, training_root=model, kept=lambda capability: capability is Capability.TEXT)
        >>> run.kept(Capability.TEXT), run.kept(Capability.FIGURES), run.texts
        (True, False, [])
    """

    model: nn.Module
    training_root: nn.Module
    kept: Callable[[Capability], bool]
    default_loss: LossFn | None = None
    step_offset: int = 0
    texts: list[tuple[str, str]] = field(default_factory=list)


class ProbeFamily:
    """One family of probes, as the session drives it on every rank.

    Per run, :meth:`start` and :meth:`close`. Per step, :meth:`before_step` (the family's own cadence, on
    every step). On a logging step, in order: :meth:`before_forward`; :meth:`arm` around the training forward
    (or a probe forward of a compiled model) and :meth:`disarm` after it, keeping what was recorded;
    :meth:`measure` at the step's end, under ``no_grad``. :meth:`discard` drops a step that was abandoned.
    :meth:`state_dict` gives the family's entries of the session's checkpoint state, by their top-level key,
    and :meth:`load_state_dict` reads them back. Every hook here does nothing: a family overrides those it
    takes part in.

    Args:
        options: the run's options.
        reports: where the family's failures and problems go (once per kind; raised in strict mode).

    Examples:
        A family that counts the logging steps it saw, as a record of its own:

        >>> class Counting(ProbeFamily):
        ...     def measure(self, progress):
        ...         progress.measurements.append(
        ...             Measurement(progress.step, "custom", "logs", "model", float(progress.logs_done + 1))
        ...         )
        >>> family = Counting(MonitorOptions(), Reports(strict=True))
        >>> progress = LoggingStep(step=10, logs_done=2)
        >>> family.measure(progress)
        >>> progress.measurements[0].tag, progress.measurements[0].value, family.captures
        ('custom/logs/model', 3.0, False)
    """

    def __init__(self, options: MonitorOptions, reports: Reports) -> None:
        self.options = options
        self.reports = reports

    @property
    def captures(self) -> bool:
        """Whether :meth:`arm` installs something on the model for this run."""
        return False

    def start(self, run: Run) -> None:
        """Begin a run on ``run.model``: find what to measure.

        Args:
            run: the run's model, training root, sinks' capabilities and start-of-run texts.
        """

    def before_step(self, progress: LoggingStep, batch: Any, optimizer: torch.optim.Optimizer | None) -> None:
        """Measure on the family's own cadence, before the forward of every step, into ``progress``.

        Args:
            progress: the step's records so far (of a logging step or not).
            batch: the step's batch.
            optimizer: the training optimizer, or None.
        """

    def before_forward(self, progress: LoggingStep) -> None:
        """On a logging step, measure what must be read before the forward changes it, into ``progress``.

        Args:
            progress: the logging step's records so far.
        """

    def arm(self, token_mask: Tensor | None, *, every_module: bool) -> None:
        """Install the capture.

        Args:
            token_mask: the batch's (batch, tokens) real tokens, or None (the forward's own masks are read).
            every_module: whether the forward is the probe forward of a compiled model.
        """

    def disarm(self) -> None:
        """Remove the capture, keeping what it recorded for :meth:`measure`."""

    def discard(self) -> None:
        """Remove the capture if armed and drop whatever was recorded."""

    def measure(self, progress: LoggingStep) -> None:
        """Turn what was recorded this logging step into records in ``progress``.

        Args:
            progress: the logging step's records so far.
        """

    def close(self) -> None:
        """End the run; what a checkpoint or the next run needs stays."""

    def state_dict(self) -> dict[str, Any]:
        """The family's entries of the session's checkpoint state.

        Returns:
            Top-level key → entry; none here.
        """
        return {}

    def load_state_dict(self, entries: StateEntries) -> None:
        """Read the family's entries back, each checked (a bad one is dropped into ``entries.dropped``).

        Args:
            entries: the session's checkpoint state.
        """


class CaptureFamily(ProbeFamily):
    """A family that records during the forward, through a capture armed around it, and measures what it
    recorded at the logging step's end.

    A subclass makes its capture in :meth:`start`, names it (``capture_name``, ``metrics_name``: how its
    failures are reported), and turns a recording into records in ``_measure(progress, recording)``;
    ``_recorded(recording)`` looks at a recording as the capture is disarmed. Arming, disarming and measuring
    each fail alone: a failure is reported once per kind (raised when strict) and the step goes on.

    Args:
        options: the run's options.
        reports: where the family's failures and problems go.

    Examples:
        ```python
        class HiddenNorms(CaptureFamily):
            capture_name, metrics_name = "hidden-state", "hidden-state norms"

            def start(self, run):
                self._capture = MyCapture(run.model)  # arm(token_mask, every_module=...), disarm(), is_armed

            def _measure(self, progress, recording):
                progress.measurements += [
                    Measurement(progress.step, "hidden", "norm", layer, float(states.norm()))
                    for layer, states in recording.items()
                ]
        ```
    """

    capture_name = ""
    metrics_name = ""

    def __init__(self, options: MonitorOptions, reports: Reports) -> None:
        super().__init__(options, reports)
        self._capture: Any = None
        self._recording: Any = None

    @property
    def captures(self) -> bool:
        """Whether the family made a capture for this run."""
        return self._capture is not None

    def arm(self, token_mask: Tensor | None, *, every_module: bool) -> None:
        """Arm the capture, if the family has one.

        Args:
            token_mask: the batch's (batch, tokens) real tokens, or None.
            every_module: whether the forward is the probe forward of a compiled model.
        """
        if self._capture is not None:
            with self.reports.failures_of(f"arming the {self.capture_name} capture"):
                self._capture.arm(token_mask, every_module=every_module)

    def disarm(self) -> None:
        """Disarm the capture, if armed, keeping its recording for :meth:`measure`."""
        if self._capture is not None and self._capture.is_armed:
            with self.reports.failures_of(f"disarming the {self.capture_name} capture"):
                self._recording = self._capture.disarm()
                self._recorded(self._recording)

    def discard(self) -> None:
        """Disarm the capture, if armed, and drop the recording."""
        if self._capture is not None and self._capture.is_armed:
            self._capture.disarm()
        self._recording = None

    def measure(self, progress: LoggingStep) -> None:
        """The kept recording turned into records in ``progress``, then dropped; nothing if none was kept.

        Args:
            progress: the logging step's records so far.
        """
        recording, self._recording = self._recording, None
        if recording is not None:
            with self.reports.failures_of(f"computing the {self.metrics_name}"):
                self._measure(progress, recording)

    def close(self) -> None:
        """Drop the capture and any recording."""
        self._capture = self._recording = None

    def _recorded(self, recording: Any) -> None:
        """What the capture held when disarmed, before it is measured."""

    def _measure(self, progress: LoggingStep, recording: Any) -> None:
        """``recording`` turned into records in ``progress``."""
        raise NotImplementedError


def layer_selected(options: MonitorOptions, layer: str) -> bool:
    """Whether the module named ``layer`` is measured by ``include``/``exclude``: ``WeightProbe``'s rule.

    Args:
        options: the run's options (``capture.include``, ``capture.exclude``).
        layer: a module's qualified name.

    Returns:
        True when ``include`` is None or some pattern of it matches, and no ``exclude`` pattern does.

    Examples:
        >>> from spectral_monitor.core.options import CaptureOptions
        >>> options = MonitorOptions(capture=CaptureOptions(include=["blocks.*"], exclude=["*.mlp"]))
        >>> [layer_selected(options, name) for name in ("blocks.0.attn", "blocks.0.mlp", "head")]
        [True, False, False]
    """
    if options.capture.include is not None and not any_match([layer], options.capture.include):
        return False
    return options.capture.exclude is None or not any_match([layer], options.capture.exclude)


def warn_of_unmatched_patterns(options: MonitorOptions, reports: Reports, model: nn.Module) -> None:
    """Once, where an ``include`` or ``exclude`` pattern matches no module of ``model``, with examples of
    its module names (at most eight, spread over the model).

    Args:
        options: the run's options (``capture.include``, ``capture.exclude``).
        reports: where the warning goes (``"unmatched patterns"``; raised in no mode).
        model: the model, read through any compile or DDP wrappers.

    Examples:
        >>> import warnings
        >>> from torch import nn
        >>> from spectral_monitor.core.options import CaptureOptions
        >>> options = MonitorOptions(capture=CaptureOptions(include=["block.*"]))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_of_unmatched_patterns(options, Reports(strict=False), nn.Sequential(nn.Linear(2, 2)))
        >>> str(caught[0].message).split(";")[0]
        "SpectralMonitor: include/exclude patterns ['block.*'] match no module of Sequential"
    """
    names = [name for name, _ in unwrapped_named_modules(model) if name]
    patterns = [*(options.capture.include or ()), *(options.capture.exclude or ())]
    unmatched = [pattern for pattern in patterns if not any_match(names, [pattern])]
    if unmatched:
        examples = names[:: max(1, len(names) // _EXAMPLE_NAMES)][:_EXAMPLE_NAMES]
        reports.once(
            "unmatched patterns",
            f"include/exclude patterns {unmatched} match no module of {type(model).__name__}; "
            f"its module names look like {examples}",
        )


def any_match(names: Sequence[str], patterns: Sequence[str]) -> bool:
    """Whether some name matches some shell-style pattern (``fnmatch``, case-sensitive).

    Args:
        names: qualified module names.
        patterns: ``fnmatch`` patterns.

    Returns:
        True when at least one name matches at least one pattern.

    Examples:
        >>> any_match(["blocks.0.attn", "head"], ["*.attn"]), any_match(["head"], ["*.attn"])
        (True, False)
    """
    return any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in patterns)


def report_skipped(reports: Reports, what: str, skipped: list[SkippedCapture]) -> None:
    """Once per distinct reason, with the layers it applied to the first time.

    Args:
        reports: where the warnings go (one kind per reason).
        what: what was captured, as the warning names it (``"attention"``, ``"residual stream"``).
        skipped: the layers a capture skipped or cut, each with why.

    Examples:
        >>> import warnings
        >>> skipped = [SkippedCapture("blocks.3.attn", "its heads could not be read")]
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     report_skipped(Reports(strict=False), "attention", skipped)
        >>> str(caught[0].message)
        'SpectralMonitor: not all of the attention was captured (blocks.3.attn): its heads could not be read.'
    """
    layers_by_reason: dict[str, list[str]] = {}
    for entry in skipped:
        layers_by_reason.setdefault(entry.reason, []).append(entry.layer)
    for reason, layers in layers_by_reason.items():
        reports.once(reason, f"not all of the {what} was captured ({', '.join(layers)}): {reason}")


def counted_sequences(values: Tensor, nonfinite: Tensor) -> Tensor:
    """Where a sequence's value counts (S, ...): it is defined, or its input was non-finite (then NaN is the
    reading). A NaN value of a finite sequence means "not defined there" (all padding, one token).

    Args:
        values: (S, ...) per-sequence values, NaN where not defined.
        nonfinite: (S, ...) bool, True where a sequence's input held NaN or inf.

    Returns:
        (S, ...) bool.

    Examples:
        >>> import torch
        >>> values = torch.tensor([1.0, float("nan"), float("nan")])
        >>> counted_sequences(values, torch.tensor([False, False, True])).tolist()
        [True, False, True]
    """
    return ~values.isnan() | nonfinite


def mean_over_sequences(values: Tensor, nonfinite: Tensor) -> Tensor | None:
    """The mean over the sequences (dim 0) of ``values`` defined for them, NaN where one was non-finite.

    A NaN value of a sequence that was not non-finite means "not defined there" (all padding, one token):
    it is left out of the mean rather than spreading.

    Args:
        values: (S, ...) per-sequence values, NaN where not defined.
        nonfinite: (S, ...) bool, True where a sequence's input held NaN or inf.

    Returns:
        The (...) mean over the sequences counted, NaN where none was counted or a non-finite one was; None
        where no sequence has a value anywhere (not measurable, not broken).

    Examples:
        >>> import torch
        >>> values = torch.tensor([[1.0, float("nan")], [3.0, float("nan")]])
        >>> mean_over_sequences(values, torch.tensor([[False, False], [False, True]])).tolist()
        [2.0, nan]
        >>> mean_over_sequences(torch.full((2, 2), float("nan")), torch.zeros(2, 2, dtype=torch.bool)) is None
        True
    """
    counted = counted_sequences(values, nonfinite)
    if not bool(counted.any()):
        return None
    return torch.where(counted, values, torch.zeros_like(values)).sum(dim=0) / counted.sum(dim=0)

"""The probe families a session drives, each behind one protocol, :class:`ProbeFamily`.

A family is everything the monitor does for one kind of measurement: the probe it installs on the model, when
it measures (its own cadence), how what it recorded becomes records, and the state a resumed run needs. The
session (:class:`~spectral_monitor.core.session.MonitorSession`) knows none of that: it keeps a list of
families and calls the same hooks on each, in order, as a step goes by. Every hook's default does nothing,
so a family implements the hooks it takes part in; a family whose measurement is off for a run stays inert.
"""

from __future__ import annotations

import fnmatch
import math
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
from spectral_monitor.core.schedule import Cadence
from spectral_monitor.core.second_order import OPT_IN_FAMILIES, LossFn, SecondOrderProbes
from spectral_monitor.distributed import full_parameters
from spectral_monitor.metrics import output_logit_metrics, token_metrics
from spectral_monitor.probes import (
    ResidualCapture,
    ResidualRecording,
    ResidualSample,
    SkippedCapture,
    WeightProbe,
)
from spectral_monitor.probes.output_logits import OutputLogitCapture, OutputLogitSample
from spectral_monitor.probes.wrappers import unwrapped_named_modules
from spectral_monitor.records import Distribution, Measurement
from spectral_monitor.sinks import Capability
from spectral_monitor.toolbox.preflight import architecture_preflight, preflight_markdown
from spectral_monitor.toolbox.weight_spectra import esd_figure, weight_spectra, weight_spectrum_measurements

__all__ = [
    "CaptureFamily",
    "LoggingStep",
    "OutputLogitFamily",
    "PreflightFamily",
    "ProbeFamily",
    "Run",
    "SecondOrderFamily",
    "TokenFamily",
    "WeightFamily",
    "any_match",
    "layer_selected",
    "mean_over_sequences",
    "report_skipped",
    "warn_of_unmatched_patterns",
]

_WEIGHT_NORMS = ("spectral_norm", "frobenius_norm")
_EXAMPLE_NAMES = 8


@dataclass
class LoggingStep:
    """What one step has gathered so far for the alerts and the sinks; dropped once written.

    ``logs_done`` counts the logging steps before this one (the cadences in logging steps read it);
    ``figures_due`` is the figure cadence, ``draw_figures`` that and a sink that keeps figures.
    """

    step: int
    logs_done: int = 0
    figures_due: bool = False
    draw_figures: bool = False
    batch: Any = None  # the step's batch, for a probe forward
    token_mask: Tensor | None = None  # its real tokens, by the token_mask option
    probed: bool = False  # whether the probe forward ran
    measurements: list[Measurement] = field(default_factory=list)
    read_only: list[Measurement] = field(default_factory=list)  # judged by the alerts, not written
    distributions: list[Distribution] = field(default_factory=list)
    figures: list[tuple[str, Callable[[], Figure | np.ndarray]]] = field(default_factory=list)
    texts: list[tuple[str, str]] = field(default_factory=list)  # (tag, markdown)
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
        texts: ``(tag, markdown)`` a family files at the start of the run, written when every family started.
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
    and :meth:`load_state_dict` reads them back.

    Args:
        options: the run's options.
        reports: where the family's failures and problems go (once per kind; raised in strict mode).
    """

    def __init__(self, options: MonitorOptions, reports: Reports) -> None:
        self.options = options
        self.reports = reports

    @property
    def captures(self) -> bool:
        """Whether :meth:`arm` installs something on the model for this run."""
        return False

    def start(self, run: Run) -> None:
        """Begin a run on ``run.model``: find what to measure."""

    def before_step(self, progress: LoggingStep, batch: Any, optimizer: torch.optim.Optimizer | None) -> None:
        """Measure on the family's own cadence, before the forward of every step, into ``progress``."""

    def before_forward(self, progress: LoggingStep) -> None:
        """On a logging step, measure what must be read before the forward changes it, into ``progress``."""

    def arm(self, token_mask: Tensor | None, *, every_module: bool) -> None:
        """Install the capture (``every_module``: the probe forward of a compiled model)."""

    def disarm(self) -> None:
        """Remove the capture, keeping what it recorded for :meth:`measure`."""

    def discard(self) -> None:
        """Remove the capture if armed and drop whatever was recorded."""

    def measure(self, progress: LoggingStep) -> None:
        """Turn what was recorded this logging step into records in ``progress``."""

    def close(self) -> None:
        """End the run; what a checkpoint or the next run needs stays."""

    def state_dict(self) -> dict[str, Any]:
        """The family's entries of the session's checkpoint state, by top-level key."""
        return {}

    def load_state_dict(self, entries: StateEntries) -> None:
        """Read the family's entries back, each checked (a bad one is dropped into ``entries.dropped``)."""


class PreflightFamily(ProbeFamily):
    """The architecture preflight (the ``preflight`` option): the model as built checked once a run, before
    training, each warning raised and the findings filed as the run's ``preflight`` text."""

    def start(self, run: Run) -> None:
        if not self.options.preflight:
            return
        with self.reports.failures_of("the architecture preflight"):
            context = self.options.preflight_context_length
            if context is None:
                seq_len = getattr(run.model, "hparams", {}).get("seq_len")
                context = seq_len if isinstance(seq_len, int) and seq_len >= 2 else None
            findings = architecture_preflight(
                run.model,
                context_length=context,
                attention_families=self.options.capture.attention_families,
            )
            for finding in findings:
                if finding.severity == "warning":
                    self.reports.warn(
                        f"SpectralMonitor preflight ({finding.check}, {finding.where}): {finding.message}."
                    )
            run.texts.append(("preflight", preflight_markdown(findings)))


class CaptureFamily(ProbeFamily):
    """A family that records during the forward, through a capture armed around it, and measures what it
    recorded at the logging step's end. A subclass makes its capture in :meth:`start`, names it
    (``capture_name``, ``metrics_name``: how its failures are reported), and turns a recording into records
    in :meth:`_measure`; :meth:`_recorded` looks at a recording as the capture is disarmed."""

    capture_name = ""
    metrics_name = ""

    def __init__(self, options: MonitorOptions, reports: Reports) -> None:
        super().__init__(options, reports)
        self._capture: Any = None
        self._recording: Any = None

    @property
    def captures(self) -> bool:
        return self._capture is not None

    def arm(self, token_mask: Tensor | None, *, every_module: bool) -> None:
        if self._capture is not None:
            with self.reports.failures_of(f"arming the {self.capture_name} capture"):
                self._capture.arm(token_mask, every_module=every_module)

    def disarm(self) -> None:
        if self._capture is not None and self._capture.is_armed:
            with self.reports.failures_of(f"disarming the {self.capture_name} capture"):
                self._recording = self._capture.disarm()
                self._recorded(self._recording)

    def discard(self) -> None:
        if self._capture is not None and self._capture.is_armed:
            self._capture.disarm()
        self._recording = None

    def measure(self, progress: LoggingStep) -> None:
        recording, self._recording = self._recording, None
        if recording is not None:
            with self.reports.failures_of(f"computing the {self.metrics_name}"):
                self._measure(progress, recording)

    def close(self) -> None:
        self._capture = self._recording = None

    def _recorded(self, recording: Any) -> None:
        """What the capture held when disarmed, before it is measured."""

    def _measure(self, progress: LoggingStep, recording: Any) -> None:
        """``recording`` turned into records in ``progress``."""
        raise NotImplementedError


class TokenFamily(CaptureFamily):
    """The residual stream: each transformer block's output captured during the forward, its token metrics
    measured at the step's end, blocks of one shape in one call."""

    capture_name = "residual-stream"
    metrics_name = "token metrics"

    def start(self, run: Run) -> None:
        if "tokens" in self.options.families:
            with self.reports.failures_of("finding the transformer blocks (tokens family)"):
                self._capture = ResidualCapture(
                    run.model,
                    max_sequences=self.options.capture.max_sequences,
                    strict=self.options.strict,
                    attention_families=self.options.capture.attention_families,
                )

    def _recorded(self, recording: ResidualRecording) -> None:
        report_skipped(self.reports, "residual stream", recording.skipped)

    def _measure(self, progress: LoggingStep, recording: ResidualRecording) -> None:
        samples = [sample for sample in recording.states if layer_selected(self.options, sample.layer)]
        # Blocks whose outputs share a shape are measured in one call (the metrics are per element).
        together: dict[tuple[Any, ...], list[ResidualSample]] = {}
        for sample in samples:
            kind = (sample.states.shape, sample.states.dtype, sample.states.device, sample.token_mask is None)
            together.setdefault(kind, []).append(sample)
        for group in together.values():
            masks = [sample.token_mask for sample in group]
            metrics = token_metrics(
                torch.stack([sample.states for sample in group]),
                token_mask=None if masks[0] is None else torch.stack(masks),
            )
            nonfinite = metrics.pop("nonfinite")
            for position, sample in enumerate(group):
                if nonfinite[position].any():
                    self.reports.problem(
                        "non-finite tokens",
                        f"non-finite tokens out of {sample.layer} at step {progress.step}: its output holds "
                        "NaN or inf, so its token metrics are written as NaN",
                    )
                for metric, values in metrics.items():
                    mean = mean_over_sequences(values[position], nonfinite[position])
                    if mean is not None:
                        progress.measurements.append(
                            Measurement(progress.step, "tokens", metric, sample.layer, float(mean))
                        )


class OutputLogitFamily(CaptureFamily):
    """The LM head's logits (the ``output_logits`` option): the largest and the log-partition function."""

    capture_name = "output-logit"
    metrics_name = "output-logit metrics"

    def start(self, run: Run) -> None:
        head = self.options.outputs.output_logits
        if head is not False:
            with self.reports.failures_of("finding the LM head (output_logits)"):
                self._capture = OutputLogitCapture(
                    run.model,
                    head if isinstance(head, str) else None,
                    self.options.capture.max_sequences,
                    attention_families=self.options.capture.attention_families,
                )

    def _measure(self, progress: LoggingStep, recording: OutputLogitSample) -> None:
        progress.measurements += _output_logit_measurements(progress.step, recording)


class _ParkedState:
    """The checkpoint state of a part that does not exist yet (loaded before :meth:`ProbeFamily.start`
    makes it) or any more (kept after :meth:`ProbeFamily.close` for a checkpoint or the next run)."""

    def __init__(self, key: str, part_type: type[WeightProbe] | type[SecondOrderProbes]) -> None:
        self.key = key
        self._part_type = part_type
        self.state: dict[str, Any] | None = None

    def apply_to(self, part: WeightProbe | SecondOrderProbes) -> None:
        if self.state is not None:
            part.load_state_dict(self.state)  # checked when parked
            self.state = None

    def state_dict(self, part: WeightProbe | SecondOrderProbes | None) -> dict[str, Any]:
        return {self.key: part.state_dict() if part is not None else self.state}

    def load_state_dict(self, entries: StateEntries, part: WeightProbe | SecondOrderProbes | None) -> None:
        if not entries.holds(self.key):
            return
        if part is None:
            self.state = self._part_type.usable_state(entries.nested(self.key))
        else:
            part.load_state_dict(entries.nested(self.key))


class WeightFamily(ProbeFamily):
    """The weights' norms and spectra, measured before the forward of a logging step (the parameters it
    uses), with the weight spectra on their own cadence; warm vectors kept in the checkpoint."""

    def __init__(self, options: MonitorOptions, reports: Reports) -> None:
        super().__init__(options, reports)
        self._spectra_cadence = Cadence.of_logs(options.outputs.weight_spectra_every_n_logs)
        self._parked = _ParkedState("weight_probe", WeightProbe)
        self._probe: WeightProbe | None = None
        self._run: Run | None = None

    def start(self, run: Run) -> None:
        self._run = run
        if "weights" in self.options.families:
            options = self.options
            self._probe = WeightProbe(
                run.model,
                include=options.capture.include,
                exclude=options.capture.exclude,
                per_head=options.outputs.per_head,
                attention_families=options.capture.attention_families,
                warn=self.reports.warn,
            )
            self._parked.apply_to(self._probe)

    def before_forward(self, progress: LoggingStep) -> None:
        probe, run = self._probe, self._run
        if probe is None or run is None:
            return
        # Every rank enters: gathering FSDP shards is a collective (spectral_monitor.distributed).
        with (
            self.reports.failures_of("measuring the weights"),
            torch.no_grad(),
            full_parameters(run.training_root),
        ):
            progress.measurements += self._checked(probe.measure(progress.step))
            if self.options.outputs.histograms and run.kept(Capability.HISTOGRAMS):
                progress.distributions += probe.distributions(
                    progress.step, full_spectrum=progress.figures_due
                )
        if self._spectra_cadence.due(progress.logs_done):
            with self.reports.failures_of("measuring the weight spectra"), torch.no_grad():
                capture = self.options.capture
                spectra = weight_spectra(
                    run.model,
                    include=capture.include,
                    exclude=capture.exclude,
                    attention_families=capture.attention_families,
                )
                progress.measurements += weight_spectrum_measurements(spectra, progress.step)
                if run.kept(Capability.FIGURES):
                    progress.figures += [
                        (
                            f"weights/figures/esd/{spectrum.layer}",
                            lambda spectrum=spectrum: esd_figure(spectrum),
                        )
                        for spectrum in spectra
                    ]

    def close(self) -> None:
        if self._probe is not None:
            self._parked.state = self._probe.state_dict()
        self._probe = self._run = None

    def state_dict(self) -> dict[str, Any]:
        return self._parked.state_dict(self._probe)

    def load_state_dict(self, entries: StateEntries) -> None:
        self._parked.load_state_dict(entries, self._probe)

    def _checked(self, measurements: list[Measurement]) -> list[Measurement]:
        # Norms only: a ratio such as the stable rank of an all-zero weight is NaN for a healthy model.
        broken = sorted(
            {
                record.layer
                for record in measurements
                if record.metric in _WEIGHT_NORMS and not math.isfinite(record.value)
            }
        )
        if broken:
            self.reports.problem(
                "non-finite weights",
                f"non-finite weights at step {measurements[0].step}: the measurements of {', '.join(broken)} "
                "are NaN or inf",
            )
        return measurements


class SecondOrderFamily(ProbeFamily):
    """The opt-in curvature, Jacobian and NTK probes, on their own cadence, on a probe batch
    (:class:`~spectral_monitor.core.second_order.SecondOrderProbes`)."""

    def __init__(self, options: MonitorOptions, reports: Reports) -> None:
        super().__init__(options, reports)
        self._parked = _ParkedState("second_order", SecondOrderProbes)
        self._probes: SecondOrderProbes | None = None
        self._model: nn.Module | None = None

    def start(self, run: Run) -> None:
        options = self.options
        self._model = run.model
        if any(family in options.families for family in OPT_IN_FAMILIES):
            self._probes = SecondOrderProbes(
                run.training_root,
                options.families,
                options.curvature,
                options.jacobian,
                options.ntk,
                options.probe_data,
                self.reports.failures_of,
                warn=self.reports.warn,
                default_loss=run.default_loss,
                step_offset=run.step_offset,
            )
            self._parked.apply_to(self._probes)

    def before_step(self, progress: LoggingStep, batch: Any, optimizer: torch.optim.Optimizer | None) -> None:
        if self._probes is None or self._model is None:
            return
        event = self._probes.measure_due(self._model, batch, progress.step, optimizer)
        broken = sorted({f"{m.family}/{m.metric}" for m in event.measurements if not math.isfinite(m.value)})
        if broken:
            self.reports.problem(
                "non-finite curvature",
                f"non-finite second-order measurements at step {progress.step}: {', '.join(broken)} are NaN "
                "or inf (the probe batch's loss or gradient is)",
            )
        progress.measurements += event.measurements
        progress.figures += event.figures

    def close(self) -> None:
        if self._probes is not None:
            state = self._probes.state_dict()
            # The last step tells a step's micro-batches apart within a run; a next run's steps are its own.
            state.pop("last_step", None)
            self._parked.state = state
        self._probes = self._model = None

    def state_dict(self) -> dict[str, Any]:
        return self._parked.state_dict(self._probes)

    def load_state_dict(self, entries: StateEntries) -> None:
        self._parked.load_state_dict(entries, self._probes)


def layer_selected(options: MonitorOptions, layer: str) -> bool:
    """Whether the module named ``layer`` is measured by ``include``/``exclude``: ``WeightProbe``'s rule."""
    if options.capture.include is not None and not any_match([layer], options.capture.include):
        return False
    return options.capture.exclude is None or not any_match([layer], options.capture.exclude)


def warn_of_unmatched_patterns(options: MonitorOptions, reports: Reports, model: nn.Module) -> None:
    """Once, where an ``include`` or ``exclude`` pattern matches no module of ``model``, with examples of
    its module names."""
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
    """Whether some name matches some shell-style pattern."""
    return any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in patterns)


def report_skipped(reports: Reports, what: str, skipped: list[SkippedCapture]) -> None:
    """Once per distinct reason, with the layers it applied to the first time."""
    layers_by_reason: dict[str, list[str]] = {}
    for entry in skipped:
        layers_by_reason.setdefault(entry.reason, []).append(entry.layer)
    for reason, layers in layers_by_reason.items():
        reports.once(reason, f"not all of the {what} was captured ({', '.join(layers)}): {reason}")


def mean_over_sequences(values: Tensor, nonfinite: Tensor) -> Tensor | None:
    """The mean over the sequences (dim 0) of ``values`` defined for them, NaN where one was non-finite;
    None where no sequence has a value: not measurable (all padding, one token) or not defined, not broken."""
    counted = ~values.isnan() | nonfinite
    if not bool(counted.any()):
        return None
    return torch.where(counted, values, torch.zeros_like(values)).sum(dim=0) / counted.sum(dim=0)


def _output_logit_measurements(step: int, sample: OutputLogitSample) -> list[Measurement]:
    """``outputs/max_logit/model`` (the largest over the sequences) and ``outputs/log_partition/model`` (the
    mean over the sequences' real tokens), where some sequence has a real token."""
    metrics = output_logit_metrics(sample.logits, token_mask=sample.token_mask)
    real = (
        torch.ones(sample.logits.shape[:2], dtype=torch.bool)
        if sample.token_mask is None
        else sample.token_mask
    )
    tokens = real.sum(dim=1).to(torch.float64).cpu()
    if not bool((tokens > 0).any()):
        return []
    counted = tokens > 0
    largest = metrics["max_logit"].double().cpu()[counted].max()
    # Each sequence's mean weighted by its real tokens: the mean over every real token of the sample.
    log_partition = (metrics["log_partition"].double().cpu()[counted] * tokens[counted]).sum() / tokens.sum()
    return [
        Measurement(step, "outputs", "max_logit", "model", float(largest)),
        Measurement(step, "outputs", "log_partition", "model", float(log_partition)),
    ]

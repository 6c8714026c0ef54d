"""The built-in probe families a session drives, each behind one protocol,
:class:`~spectral_monitor.core.family_protocol.ProbeFamily`.

A family is everything the monitor does for one kind of measurement: the probe it installs on the model, when
it measures (its own cadence), how what it recorded becomes records, and the state a resumed run needs. The
session (:class:`~spectral_monitor.core.session.MonitorSession`) knows none of that: it keeps a list of
families and calls the same hooks on each, in order, as a step goes by. Every hook's default does nothing,
so a family implements the hooks it takes part in; a family whose measurement is off for a run stays inert.
The protocol, what a run and a step hand a family, and the helpers families share are in
:mod:`spectral_monitor.core.family_protocol`, and are importable from here too. The attention family is in
:mod:`spectral_monitor.core.attention_family`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from spectral_monitor.checkpoint_entries import StateEntries
from spectral_monitor.core.family_protocol import (
    CaptureFamily,
    LoggingStep,
    ProbeFamily,
    Run,
    any_match,
    layer_selected,
    mean_over_sequences,
    report_skipped,
    warn_of_unmatched_patterns,
)
from spectral_monitor.core.options import MonitorOptions
from spectral_monitor.core.reports import Reports
from spectral_monitor.core.schedule import Cadence
from spectral_monitor.core.second_order import OPT_IN_FAMILIES, SecondOrderProbes
from spectral_monitor.distributed import full_parameters
from spectral_monitor.metrics import output_logit_metrics, token_metrics
from spectral_monitor.probes import ResidualCapture, ResidualRecording, ResidualSample, WeightProbe
from spectral_monitor.probes.output_logits import OutputLogitCapture, OutputLogitSample
from spectral_monitor.records import Measurement
from spectral_monitor.sinks import Capability
from spectral_monitor.sinks.figures import EsdImages
from spectral_monitor.toolbox.preflight import architecture_preflight, preflight_markdown
from spectral_monitor.toolbox.weight_spectra import esd_drawing, weight_spectra, weight_spectrum_measurements

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


class PreflightFamily(ProbeFamily):
    """The architecture preflight (the ``preflight`` option): the model as built checked once a run, before
    training, each warning raised and the findings filed as the run's ``preflight`` text.

    The preflight's context length is ``preflight_context_length``, else the model's ``hparams.seq_len``
    where it is an int of at least 2, else its logit-scale check is skipped.

    Args:
        options: the run's options.
        reports: where its warnings and failures go.

    Examples:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
        >>> run = Run(model, training_root=model, kept=lambda capability: False)
        >>> PreflightFamily(MonitorOptions(), Reports(strict=False)).start(run)
        >>> [tag for tag, _ in run.texts]
        ['preflight']
    """

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


class TokenFamily(CaptureFamily):
    """The residual stream: each transformer block's output captured during the forward, its token metrics
    measured at the step's end, blocks of one shape in one call.

    Each metric is written per block as its mean over the sampled sequences (``tokens/<metric>/<block>``);
    a block whose output holds NaN or inf is a problem (raised when strict) and its metrics are NaN.

    Args:
        options: the run's options; the family captures only with ``"tokens"`` among its families.
        reports: where its failures and problems go.

    Examples:
        ```python
        family = TokenFamily(MonitorOptions(families=["tokens"]), Reports(strict=False))
        family.start(Run(model, training_root=model, kept=lambda capability: False))
        family.arm(token_mask=None, every_module=False)
        model(batch)  # each block's output copied for the first max_sequences sequences
        family.disarm()
        progress = LoggingStep(step=10)
        family.measure(progress)  # tokens/cosine_similarity/<block>, ...
        ```
    """

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
                    block_patterns=self.options.capture.block_patterns,
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
    """The LM head's logits (the ``output_logits`` option): the largest and the log-partition function.

    ``outputs/max_logit/model`` is the largest logit over the sampled sequences' real tokens,
    ``outputs/log_partition/model`` the mean over those tokens of the log-sum-exp over the vocabulary;
    nothing is written when no sampled token is real.

    Args:
        options: the run's options; the family captures only when ``outputs.output_logits`` is not False.
        reports: where its failures go.

    Examples:
        ```python
        options = MonitorOptions(outputs=OutputOptions(output_logits="lm_head"))
        family = OutputLogitFamily(options, Reports(strict=False))
        family.start(Run(model, training_root=model, kept=lambda capability: False))
        family.arm(token_mask=None, every_module=False)
        model(batch)
        family.disarm()
        family.measure(progress)  # outputs/max_logit/model, outputs/log_partition/model
        ```
    """

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
    uses), with the weight spectra on their own cadence; warm vectors kept in the checkpoint.

    Every rank measures (gathering FSDP shards is a collective). A non-finite spectral or Frobenius norm is a
    problem (raised when strict). Histograms are added when ``histograms`` is on and a sink keeps them, with
    the full spectrum on figure steps; the weight spectra and their figures on every
    ``weight_spectra_every_n_logs``-th logging step. The warm vectors are kept past :meth:`close`, and a
    checkpoint loaded before :meth:`start` is applied there, under the key ``"weight_probe"``.

    Args:
        options: the run's options; the family measures only with ``"weights"`` among its families.
        reports: where its failures and problems go.

    Examples:
        ```python
        family = WeightFamily(MonitorOptions(families=["weights"]), Reports(strict=True))
        family.start(Run(model, training_root=model, kept=lambda capability: False))
        progress = LoggingStep(step=0)
        family.before_forward(progress)  # weights/spectral_norm/<layer>, weights/frobenius_norm/<layer>, ...
        ```
    """

    def __init__(self, options: MonitorOptions, reports: Reports) -> None:
        super().__init__(options, reports)
        self._spectra_cadence = Cadence.of_logs(options.outputs.weight_spectra_every_n_logs)
        self._parked = _ParkedState("weight_probe", WeightProbe)
        self._probe: WeightProbe | None = None
        self._run: Run | None = None
        # The ESD figures, kept from one weight-spectrum step to the next and redrawn while their axes hold (a
        # redraw costs a fraction of a new figure, and full draws one per weight).
        self._esd_images = EsdImages()

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
        spectra_due = self._spectra_cadence.due(progress.logs_done)
        histograms = self.options.outputs.histograms and run.kept(Capability.HISTOGRAMS)
        # The spectrum histograms and the weight spectra read the same decomposition when both are due.
        decompose = spectra_due or (histograms and progress.figures_due)
        singular_values = None
        # Every rank enters: gathering FSDP shards is a collective (spectral_monitor.distributed).
        with (
            self.reports.failures_of("measuring the weights"),
            torch.no_grad(),
            full_parameters(run.training_root),
        ):
            progress.measurements += self._checked(probe.measure(progress.step))
            singular_values = probe.singular_values() if decompose else None
            if histograms:
                progress.distributions += probe.distributions(
                    progress.step, singular_values=singular_values if progress.figures_due else None
                )
        if spectra_due:
            with self.reports.failures_of("measuring the weight spectra"), torch.no_grad():
                capture = self.options.capture
                spectra = weight_spectra(
                    run.model,
                    include=capture.include,
                    exclude=capture.exclude,
                    attention_families=capture.attention_families,
                    singular_values=singular_values,
                    warn=_said_by_the_weight_probe,
                )
                progress.measurements += weight_spectrum_measurements(spectra, progress.step)
                if run.kept(Capability.FIGURES):
                    self._esd_images.next_step()
                    progress.figures += [
                        (
                            f"weights/figures/esd/{spectrum.layer}",
                            lambda spectrum=spectrum, images=self._esd_images: images.image(
                                esd_drawing(spectrum)
                            ),
                        )
                        for spectrum in spectra
                    ]

    def close(self) -> None:
        if self._probe is not None:
            self._parked.state = self._probe.state_dict()
        self._probe = self._run = None
        self._esd_images = EsdImages()

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
    (:class:`~spectral_monitor.core.second_order.SecondOrderProbes`).

    They measure in :meth:`before_step`, on every step their cadence falls, logging step or not; a
    non-finite measurement is a problem (raised when strict). Their state (the probe batch, the warm vectors,
    the stretched cadence) is kept past :meth:`close` but for the last step, and a checkpoint loaded before
    :meth:`start` is applied there, under the key ``"second_order"``.

    Args:
        options: the run's options; the family measures only when an opt-in probe's options are given.
        reports: where its failures and problems go.

    Examples:
        >>> SecondOrderFamily(MonitorOptions(), Reports(strict=False)).state_dict()
        {'second_order': None}

        ```python
        options = MonitorOptions(curvature=CurvatureOptions(every_n_steps=100))
        family = SecondOrderFamily(options, Reports(strict=False))
        family.start(Run(model, training_root=model, kept=lambda capability: False, default_loss=loss))
        family.before_step(LoggingStep(step), batch, optimizer)  # curvature/sharpness/<space>, ... when due
        ```
    """

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
                strict=self.reports.strict,
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


def _said_by_the_weight_probe(message: str) -> None:
    """The weight spectra read the weights through a probe of their own, whose warnings (a fused q/k/v
    projection it cannot split) the weight family's probe has already given once."""

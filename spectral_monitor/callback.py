"""The Lightning callback that measures a transformer's attention, residual stream and weights as it trains.

``SpectralMonitor`` orchestrates; it does not compute. On a logging step it arms the probes
(``spectral_monitor.probes``) around the training forward, turns what they recorded into numbers with
``spectral_monitor.metrics`` and hands the records to sinks (``spectral_monitor.sinks``) made from the
trainer's loggers. Between logging steps nothing is installed on the model.

A logging step s is ``trainer.fit_loop.epoch_loop._batches_that_stepped`` when its batch starts: the step
under which Lightning files what ``self.log`` recorded for the same batch (``trainer.global_step`` has
already advanced by ``on_train_batch_end``). Its hooks:

- ``on_train_batch_start``: the weights are measured (the parameters this batch's forward uses), then the
  attention and residual captures are armed;
- the training forward runs untouched while the probes copy the first ``max_sequences`` sequences;
- ``on_before_backward``: the captures are disarmed, so the backward (and any activation recomputation)
  runs unobserved;
- ``on_train_batch_end``: metrics from the recordings under ``no_grad``, records written, recordings dropped.

Every rank measures, so a probe whose measurement takes part in a collective is entered by all ranks;
global rank 0 alone writes.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from matplotlib.figure import Figure
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from spectral_monitor.alerting import ALERT_TEXT_TAG, Alerting, AlertStep
from spectral_monitor.alerts import AlertConfig, AlertEvent
from spectral_monitor.metrics import ATTENTION_METRICS, KrylovState, attention_metrics, token_metrics
from spectral_monitor.metrics import METHODS as METRIC_METHODS
from spectral_monitor.probes import (
    AttentionCapture,
    AttentionRecording,
    AttentionSample,
    ResidualCapture,
    ResidualRecording,
    SkippedCapture,
    WeightProbe,
)
from spectral_monitor.records import Distribution, Measurement
from spectral_monitor.sinks import (
    Capability,
    LoggerSink,
    Sink,
    TensorBoardSink,
    attention_heatmap_figure,
    diagnosis_layout,
    layer_head_heatmap_figure,
    spectrum_figure,
)

__all__ = ["FAMILIES", "SpectralMonitor"]

FAMILIES = ("attention", "tokens", "weights")
"""What the monitor can observe: attention matrices, residual-stream tokens, weight matrices."""

_FIGURE_HEAD = 0
"""The head drawn in figures, in the first sampled sequence: always the same one, so the images of
successive steps show that head change."""

_EXAMPLE_NAMES = 8
_WEIGHT_NORMS = ("spectral_norm", "frobenius_norm")


class SpectralMonitor(Callback):
    """Measures attention, residual-stream and weight spectra on logging steps and writes them to loggers.

    Add it to a Trainer with a logger; a ``TensorBoardLogger`` receives everything, any other Lightning logger
    the scalars only::

        trainer = pl.Trainer(callbacks=[SpectralMonitor()], logger=TensorBoardLogger("runs"))

    Written on each logging step (tags ``family/metric/layer[/head_h]``, see ``Measurement.tag``):

    - ``attention/<metric>/<layer>``: each metric of ``spectral_monitor.metrics.attention_metrics``, the mean
      over heads, with ``<metric>_min`` and ``<metric>_max`` over heads, and per head when ``per_head``;
      histograms of the per-head values;
    - ``tokens/<metric>/<block>``: ``token_metrics`` of each transformer block's output;
    - ``weights/<metric>/<weight>``: what :class:`~spectral_monitor.probes.weights.WeightProbe` measures
      (spectral norm, stable rank, per-head ‖W_Q^hᵀ W_K^h‖₂, ...), with histograms of per-head values;
    - every ``figures_every_n_logs``-th logging step, histograms of every weight's singular values and
      figures: the singular values of the drawn head of each layer, the attention of that head in the first
      and last layer, and a layer × head map of ``effective_rank_ratio``;
    - a Custom Scalars layout grouped by diagnosis (rank collapse, entropy, token collapse, signal
      propagation, curvature, weights, alerts), one chart per metric with one line per layer;
    - alerts (:mod:`spectral_monitor.alerts`): each rule is evaluated on every logging step's records; an
      alert that fires or resolves is one line of the ``spectral_monitor.alerts`` logger on rank 0 and a
      call of ``on_alert``, and the markdown table of open alerts is written as text (``alerts/table``);
      ``alerts/open/<rule>`` and ``alerts/fired/<rule>`` count them on every logging step.

    Metrics a layer does not define (``eigen_gap`` of causal attention) are not written for it.

    Args:
        every_n_steps: measure when ``(step + 1) % every_n_steps == 0``, Lightning's own ``log_every_n_steps``
            rule, so with equal values both land on the same steps.
        families: which of ``"attention"``, ``"tokens"``, ``"weights"`` to measure.
        include: ``fnmatch`` patterns over qualified module names: an attention module, a block or a weight's
            module is measured if its name matches one (``"blocks.0*"``: the first block and everything in
            it). ``None``: everything.
        exclude: patterns of module names not to measure; applied after ``include``.
        max_sequences: sequences of the batch captured (the first ones: no random numbers drawn).
        memory_budget_mb: most memory the attention capture may hold; over it fewer sequences, then heads,
            then layers are kept, with a warning.
        per_head: also write each head's values as scalars: attention metrics, and the weight metrics of
            each head's rows of W_Q, W_K, W_V (histograms show the attention heads either way).
        histograms: write histograms of per-head values and of weight singular values.
        figures_every_n_logs: on every k-th logging step, starting with the first, draw the figures and write
            histograms of each weight's singular values (a full SVD of every weight); 0: never.
        metric_method: ``method`` of ``attention_metrics``: ``"auto"``, ``"exact"`` or ``"krylov"``.
        strict: raise failures of the monitor (a probe or sink raising, non-finite measurements) instead of
            warning once per kind and going on without them.
        log_first_step: also measure step 0, the model before any update.
        alerts: which alert rules run: ``None`` for :func:`~spectral_monitor.alerts.default_rules`, or an
            :class:`~spectral_monitor.alerts.AlertConfig` that disables, tunes or adds rules.
        on_alert: called on global rank 0 with each :class:`~spectral_monitor.alerts.AlertEvent`, fired
            and resolved (``event.kind``), after its console line.
        stop_on: names of rules whose firing stops training: every rank stops after the same step.

    Raises:
        ValueError: if an argument is out of range (the message names it).
        MisconfigurationException: at ``setup`` if the Trainer has no logger.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        families: Sequence[str] = FAMILIES,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        max_sequences: int = 2,
        memory_budget_mb: float = 256.0,
        per_head: bool = True,
        histograms: bool = True,
        figures_every_n_logs: int = 4,
        metric_method: str = "auto",
        strict: bool = False,
        log_first_step: bool = True,
        alerts: AlertConfig | None = None,
        on_alert: Callable[[AlertEvent], Any] | None = None,
        stop_on: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.every_n_steps = _checked_int("every_n_steps", every_n_steps, smallest=1)
        self.families = _checked_families(families)
        self.include = _checked_patterns("include", include)
        self.exclude = _checked_patterns("exclude", exclude)
        self.max_sequences = _checked_int("max_sequences", max_sequences, smallest=1)
        self.memory_budget_mb = _checked_budget(memory_budget_mb)
        self.per_head = _checked_bool("per_head", per_head)
        self.histograms = _checked_bool("histograms", histograms)
        self.figures_every_n_logs = _checked_int("figures_every_n_logs", figures_every_n_logs, smallest=0)
        if metric_method not in METRIC_METHODS:
            raise ValueError(f"metric_method must be one of {METRIC_METHODS}, got {metric_method!r}")
        self.metric_method = metric_method
        self.strict = _checked_bool("strict", strict)
        self.log_first_step = _checked_bool("log_first_step", log_first_step)
        self._alerting = Alerting(alerts, on_alert, stop_on)

        self._reports = _Reports(strict)
        self._sinks: list[Sink] = []
        self._attention_capture: AttentionCapture | None = None
        self._residual_capture: ResidualCapture | None = None
        self._weight_probe: WeightProbe | None = None
        self._parked_weight_state: dict[str, Any] | None = None  # the weight probe's, while there is none
        self._krylov_states: dict[str, KrylovState] = {}
        self._in_progress: _LoggingStep | None = None
        self._last_logged_step = -1
        self._logging_steps_done = 0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            every_n_steps=self.every_n_steps,
            families=list(self.families),
            include=self.include,
            exclude=self.exclude,
        )

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers:
            raise MisconfigurationException(
                "SpectralMonitor needs a logger to write to, but the Trainer has none (logger=False): "
                "pass logger=TensorBoardLogger(save_dir) for everything, or any Lightning logger for scalars."
            )
        self._sinks = _sinks_of(trainer.loggers) if trainer.is_global_zero else []
        if trainer.is_global_zero:
            self._warn_about_dropped_outputs(trainer.loggers)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Here rather than in `setup`: `configure_model` has built every layer and the strategy has moved it.
        self._warn_about_unmatched_patterns(pl_module)
        if "attention" in self.families:
            self._attention_capture = AttentionCapture(
                pl_module,
                max_sequences=self.max_sequences,
                max_bytes=int(self.memory_budget_mb * 2**20),
                strict=self.strict,
            )
        if "tokens" in self.families:
            with self._reports.failures_of("finding the transformer blocks (tokens family)"):
                self._residual_capture = ResidualCapture(pl_module, max_sequences=self.max_sequences)
        if "weights" in self.families:
            self._weight_probe = WeightProbe(
                pl_module, include=self.include, exclude=self.exclude, per_head=self.per_head
            )
            if self._parked_weight_state is not None:
                self._weight_probe.load_state_dict(self._parked_weight_state)
                self._parked_weight_state = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._abandon_step()  # a batch whose end hook never ran (its module hook returned -1)
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        if not self._is_logging_step(step):
            return
        self._last_logged_step = step
        costly = self._figures_due()
        progress = _LoggingStep(step, draw_figures=costly and self._kept(Capability.FIGURES))
        self._in_progress = progress
        if self._weight_probe is not None:
            with self._reports.failures_of("measuring the weights"), torch.no_grad():
                progress.measurements += self._checked_weights(self._weight_probe.measure(step))
                if self.histograms and self._kept(Capability.HISTOGRAMS):
                    progress.distributions += self._weight_probe.distributions(step, full_spectrum=costly)
        if self._attention_capture is not None:
            with self._reports.failures_of("arming the attention capture"):
                self._attention_capture.arm()
        if self._residual_capture is not None:
            with self._reports.failures_of("arming the residual-stream capture"):
                self._residual_capture.arm()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._disarm()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._disarm()  # no backward ran (manual optimisation, or training_step returned None)
        progress, self._in_progress = self._in_progress, None
        if progress is None:
            return
        with torch.no_grad():
            if progress.attention is not None:
                with self._reports.failures_of("computing the attention metrics"):
                    self._measure_attention(progress)
            if progress.residual is not None:
                with self._reports.failures_of("computing the token metrics"):
                    self._measure_tokens(progress)
        progress.attention = progress.residual = None  # the recordings are not kept past this step
        alerts = AlertStep()
        with self._reports.failures_of("evaluating the alerts"):
            alerts = self._alerting.evaluate(progress.step, progress.measurements, trainer.is_global_zero)
        self._alerting.stop_if_asked(trainer, alerts.stop)  # outside: every rank must enter the collective
        progress.measurements += alerts.records
        progress.alert_text = alerts.text
        self._write(progress)
        self._logging_steps_done += 1

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._abandon_step()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._abandon_step()
        if self._weight_probe is not None:  # its warm vectors stay, for a checkpoint or the next fit
            self._parked_weight_state = self._weight_probe.state_dict()
        self._attention_capture = self._residual_capture = self._weight_probe = None
        self._krylov_states.clear()
        self._sinks = []

    def state_dict(self) -> dict[str, Any]:
        weight_state = self._weight_probe.state_dict() if self._weight_probe else self._parked_weight_state
        return {
            "last_logged_step": self._last_logged_step,
            "logging_steps_done": self._logging_steps_done,
            "weight_probe": weight_state,
            "alerts": self._alerting.engine.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_logged_step = state_dict.get("last_logged_step", -1)
        self._logging_steps_done = state_dict.get("logging_steps_done", 0)
        self._alerting.engine.load_state_dict(state_dict.get("alerts", {}))
        weight_state = state_dict.get("weight_probe")
        if weight_state is None:
            return
        if self._weight_probe is None:
            self._parked_weight_state = weight_state  # loaded when on_fit_start makes the probe
        else:
            self._weight_probe.load_state_dict(weight_state)

    def _is_logging_step(self, step: int) -> bool:
        if step == self._last_logged_step:  # later micro-batches of an accumulated step
            return False
        return (step + 1) % self.every_n_steps == 0 or (self.log_first_step and step == 0)

    def _figures_due(self) -> bool:
        every = self.figures_every_n_logs
        return every > 0 and self._logging_steps_done % every == 0

    def _kept(self, capability: Capability) -> bool:
        return any(capability in sink.capabilities for sink in self._sinks)

    def _disarm(self) -> None:
        progress = self._in_progress
        if progress is None:
            return
        capture = self._attention_capture
        if capture is not None and capture.is_armed:
            with self._reports.failures_of("disarming the attention capture"):
                progress.attention = capture.disarm()
                self._report_skipped("attention", progress.attention.skipped)
        residual_capture = self._residual_capture
        if residual_capture is not None and residual_capture.is_armed:
            with self._reports.failures_of("disarming the residual-stream capture"):
                progress.residual = residual_capture.disarm()
                self._report_skipped("residual stream", progress.residual.skipped)

    def _abandon_step(self) -> None:
        for capture in (self._attention_capture, self._residual_capture):
            if capture is not None and capture.is_armed:
                capture.disarm()
        self._in_progress = None

    def _measure_attention(self, progress: _LoggingStep) -> None:
        recording = progress.attention
        write_histograms = self.histograms and self._kept(Capability.HISTOGRAMS)
        drawn_heads = []
        for captured in recording.captured:
            if not self._selected(captured.layer):
                continue
            sample = captured.sample()
            per_head = self._attention_per_head(progress.step, sample)
            progress.measurements += _layer_measurements(
                progress.step, "attention", sample.layer, per_head, self.per_head
            )
            if write_histograms:
                # "_per_head": a histogram tag equal to a scalar tag hides the scalar in TensorBoard's
                # default (fast) loader, which keeps one data class per tag.
                progress.distributions += [
                    Distribution(
                        progress.step, "attention", f"{metric}_per_head", sample.layer, head_values.numpy()
                    )
                    for metric, head_values in per_head.items()
                ]
            if progress.draw_figures and sample.probs[0, _FIGURE_HEAD].isfinite().all():
                drawn_heads.append(_DrawnHead.of(sample, per_head.get("effective_rank_ratio")))
        if drawn_heads:
            progress.figures += _attention_figures(progress.step, drawn_heads)

    def _attention_per_head(self, step: int, sample: AttentionSample) -> dict[str, Tensor]:
        """Each defined metric of one layer as (heads,) float64 on the CPU, averaged over the sequences."""
        heads = sample.probs.shape[1]
        metrics = attention_metrics(
            sample.probs,
            key_mask=_per_head(sample.key_mask, heads),
            query_mask=_per_head(sample.query_mask, heads),
            causal=sample.causal,
            method=self.metric_method,
            state=self._krylov_states.setdefault(sample.layer, KrylovState()),
        )
        nonfinite = metrics["nonfinite"]
        if nonfinite.any():
            self._reports.problem(
                "non-finite attention",
                f"non-finite attention in {sample.layer} at step {step}: its probabilities hold NaN or inf, "
                "so its metrics are written as NaN",
            )
        per_head = {}
        for metric in ATTENTION_METRICS:
            values = metrics[metric]
            if (values.isnan() & ~nonfinite).all():  # undefined for this layer, not broken
                continue
            per_head[metric] = values.mean(dim=0).to("cpu", torch.float64)
        return per_head

    def _measure_tokens(self, progress: _LoggingStep) -> None:
        for sample in progress.residual.states:
            if not self._selected(sample.layer):
                continue
            metrics = token_metrics(sample.states, token_mask=sample.token_mask)
            if metrics.pop("nonfinite").any():
                self._reports.problem(
                    "non-finite tokens",
                    f"non-finite tokens out of {sample.layer} at step {progress.step}: its output holds NaN "
                    "or inf, so its token metrics are written as NaN",
                )
            progress.measurements += [
                Measurement(progress.step, "tokens", metric, sample.layer, float(values.mean()))
                for metric, values in metrics.items()
            ]

    def _checked_weights(self, measurements: list[Measurement]) -> list[Measurement]:
        # Norms only: a ratio such as the stable rank of an all-zero weight is NaN for a healthy model.
        broken = sorted(
            {
                record.layer
                for record in measurements
                if record.metric in _WEIGHT_NORMS and not math.isfinite(record.value)
            }
        )
        if broken:
            self._reports.problem(
                "non-finite weights",
                f"non-finite weights at step {measurements[0].step}: the measurements of {', '.join(broken)} "
                "are NaN or inf",
            )
        return measurements

    def _write(self, progress: _LoggingStep) -> None:
        tags = [record.tag for record in progress.measurements]
        for sink in self._sinks:
            kind = type(sink).__name__
            with self._reports.failures_of(f"writing to {kind}"):
                sink.write_measurements(progress.measurements)
                if Capability.HISTOGRAMS in sink.capabilities:
                    sink.write_distributions(progress.distributions)
                if Capability.LAYOUT in sink.capabilities and tags:
                    sink.write_layout(diagnosis_layout(tags))
                if Capability.TEXT in sink.capabilities and progress.alert_text is not None:
                    sink.write_text(ALERT_TEXT_TAG, progress.alert_text, progress.step)
            if Capability.FIGURES in sink.capabilities:
                with self._reports.failures_of(f"drawing figures for {kind}"):
                    for tag, draw in progress.figures:
                        sink.write_figure(tag, draw(), progress.step)

    def _selected(self, layer: str) -> bool:
        """Whether the module named ``layer`` is measured: the same rule as ``WeightProbe``'s."""
        if self.include is not None and not _any_match([layer], self.include):
            return False
        return self.exclude is None or not _any_match([layer], self.exclude)

    def _report_skipped(self, what: str, skipped: list[SkippedCapture]) -> None:
        """Once per distinct reason, with the layers it applied to the first time."""
        layers_by_reason: dict[str, list[str]] = {}
        for entry in skipped:
            layers_by_reason.setdefault(entry.reason, []).append(entry.layer)
        for reason, layers in layers_by_reason.items():
            self._reports.once(reason, f"not all of the {what} was captured ({', '.join(layers)}): {reason}")

    def _warn_about_dropped_outputs(self, loggers: Sequence[pl.loggers.Logger]) -> None:
        wanted = {Capability.LAYOUT: "the custom-scalars layout"}
        if self.histograms:
            wanted[Capability.HISTOGRAMS] = "histograms"
        if self.figures_every_n_logs:
            wanted[Capability.FIGURES] = "figures"
        dropped = [what for capability, what in wanted.items() if not self._kept(capability)]
        if dropped:
            names = ", ".join(type(logger).__name__ for logger in loggers)
            rank_zero_warn(
                f"SpectralMonitor: {names} keeps scalars only; {', '.join(dropped)} need a TensorBoardLogger "
                "and are skipped.",
                category=RuntimeWarning,
            )

    def _warn_about_unmatched_patterns(self, model: nn.Module) -> None:
        names = [name for name, _ in model.named_modules() if name]
        patterns = [*(self.include or ()), *(self.exclude or ())]
        unmatched = [pattern for pattern in patterns if not _any_match(names, [pattern])]
        if unmatched:
            examples = names[:: max(1, len(names) // _EXAMPLE_NAMES)][:_EXAMPLE_NAMES]
            self._reports.once(
                "unmatched patterns",
                f"include/exclude patterns {unmatched} match no module of {type(model).__name__}; "
                f"its module names look like {examples}",
            )


@dataclass
class _LoggingStep:
    """What one logging step has gathered so far; dropped once written."""

    step: int
    draw_figures: bool
    attention: AttentionRecording | None = None
    residual: ResidualRecording | None = None
    measurements: list[Measurement] = field(default_factory=list)
    distributions: list[Distribution] = field(default_factory=list)
    figures: list[tuple[str, Callable[[], Figure]]] = field(default_factory=list)
    alert_text: str | None = None


@dataclass
class _DrawnHead:
    """What the figures need of one layer, kept after its attention probabilities are dropped."""

    layer: str
    attention: np.ndarray  # (real queries, keys) of head _FIGURE_HEAD in the first sequence
    key_padding: np.ndarray | None  # (keys,) True = no query may attend the key
    singular_values: np.ndarray  # of the attention restricted to real queries and attendable keys
    effective_rank_ratio: np.ndarray | None  # (heads,)

    @classmethod
    def of(cls, sample: AttentionSample, effective_rank_ratio: Tensor | None) -> _DrawnHead:
        attention = sample.probs[0, _FIGURE_HEAD]
        if sample.query_mask is not None:
            attention = attention[sample.query_mask[0]]
        attendable = attention
        key_padding = None
        if sample.key_mask is not None:
            attendable = attention[:, sample.key_mask[0]]
            key_padding = (~sample.key_mask[0]).cpu().numpy()
        return cls(
            layer=sample.layer,
            attention=attention.to("cpu", torch.float64).numpy(),
            key_padding=key_padding,
            singular_values=torch.linalg.svdvals(attendable.double()).cpu().numpy(),
            effective_rank_ratio=None if effective_rank_ratio is None else effective_rank_ratio.numpy(),
        )


def _attention_figures(step: int, heads: list[_DrawnHead]) -> list[tuple[str, Callable[[], Figure]]]:
    """(tag, draw) of each attention figure; drawing is deferred so each sink renders its own copy."""
    figures: list[tuple[str, Callable[[], Figure]]] = [
        (
            "attention/figures/spectrum",
            lambda: spectrum_figure(
                {head.layer: head.singular_values for head in heads},
                f"attention singular values, head {_FIGURE_HEAD} of sequence 0, step {step}",
            ),
        )
    ]
    for head in heads[:1] + heads[1:][-1:]:  # the first and the last layer
        figures.append(
            (
                f"attention/figures/heatmap/{head.layer}",
                lambda head=head: attention_heatmap_figure(
                    head.attention, f"{head.layer}, head {_FIGURE_HEAD}, step {step}", head.key_padding
                ),
            )
        )
    ratios = [head for head in heads if head.effective_rank_ratio is not None]
    if ratios:
        grid = np.full((len(ratios), max(head.effective_rank_ratio.size for head in ratios)), np.nan)
        for row, head in enumerate(ratios):
            grid[row, : head.effective_rank_ratio.size] = head.effective_rank_ratio
        figures.append(
            (
                "attention/figures/effective_rank_ratio",
                lambda: layer_head_heatmap_figure(
                    grid,
                    [head.layer for head in ratios],
                    f"effective rank / n, step {step}",
                    vmin=0.0,
                    vmax=1.0,
                ),
            )
        )
    return figures


def _layer_measurements(
    step: int, family: str, layer: str, per_head: dict[str, Tensor], with_heads: bool
) -> list[Measurement]:
    """The head mean, min and max of each metric of a layer, and each head's value if ``with_heads``."""
    records = []
    for metric, values in per_head.items():
        records += [
            Measurement(step, family, metric, layer, float(values.mean())),
            Measurement(step, family, f"{metric}_min", layer, float(values.amin())),
            Measurement(step, family, f"{metric}_max", layer, float(values.amax())),
        ]
        if with_heads:
            records += [
                Measurement(step, family, metric, layer, value, head=head)
                for head, value in enumerate(values.tolist())
            ]
    return records


class _Reports:
    """Reports each kind of problem once; with ``strict`` failures and problems raise instead."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self._reported: set[str] = set()

    def once(self, kind: str, message: str) -> None:
        if kind not in self._reported:
            self._reported.add(kind)
            rank_zero_warn(f"SpectralMonitor: {message}.", category=RuntimeWarning)

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
            if self.strict:
                raise
            self.once(
                what,
                f"{what} failed with {error!r}; training goes on without it. Later failures of this kind "
                "are not reported (strict=True raises them)",
            )


def _sinks_of(loggers: Sequence[pl.loggers.Logger]) -> list[Sink]:
    return [
        TensorBoardSink(logger.experiment) if _is_tensorboard(logger) else LoggerSink(logger)
        for logger in loggers
    ]


def _is_tensorboard(logger: object) -> bool:
    # By name too: lightning.pytorch's TensorBoardLogger is the same class under the other namespace.
    return isinstance(logger, TensorBoardLogger) or type(logger).__name__ == "TensorBoardLogger"


def _per_head(mask: Tensor | None, heads: int) -> Tensor | None:
    """A per-sequence (S, L) mask broadcast to (S, heads, L), the batch shape of the metrics' input."""
    return None if mask is None else mask[:, None, :].expand(-1, heads, -1)


def _any_match(names: Sequence[str], patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in patterns)


def _checked_int(name: str, value: int, *, smallest: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < smallest:
        raise ValueError(f"{name} must be an int >= {smallest}, got {value!r}")
    return value


def _checked_bool(name: str, value: bool) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _checked_budget(value: float) -> float:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (is_number and math.isfinite(value) and value > 0):
        raise ValueError(f"memory_budget_mb must be a positive number of megabytes, got {value!r}")
    return float(value)


def _checked_families(families: Sequence[str]) -> tuple[str, ...]:
    if isinstance(families, str) or not isinstance(families, Sequence) or not families:
        raise ValueError(f"families must be a non-empty list drawn from {list(FAMILIES)}, got {families!r}")
    unknown = [family for family in families if family not in FAMILIES]
    if unknown:
        raise ValueError(f"families must be drawn from {list(FAMILIES)}; {unknown} are not")
    return tuple(dict.fromkeys(families))


def _checked_patterns(name: str, patterns: Sequence[str] | None) -> list[str] | None:
    if patterns is None:
        return None
    if (
        isinstance(patterns, str)
        or not isinstance(patterns, Sequence)
        or not patterns
        or not all(isinstance(pattern, str) and pattern for pattern in patterns)
    ):
        raise ValueError(
            f"{name} must be None or a non-empty list of fnmatch patterns over module names "
            f"(e.g. ['blocks.0*']), got {patterns!r}"
        )
    return list(patterns)

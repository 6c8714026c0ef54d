"""The framework-free core of the monitor: one training run's logging-step pipeline, :class:`MonitorSession`.

An integration (the Lightning callback :class:`~spectral_monitor.SpectralMonitor`, a Hugging Face callback,
a plain loop) tells the session where the run is; the session does the rest. On a logging step it arms the
probes (``spectral_monitor.probes``) around the training forward, turns what they recorded into numbers with
``spectral_monitor.metrics``, evaluates the alerts (``spectral_monitor.alerts``) and hands the records to
the sinks (``spectral_monitor.sinks``) it was given. Between logging steps nothing is installed on the model.

Per step s (the step axis is the caller's: the step under which the training framework files its own
scalars of the same batch; the cadences count the optimizer steps taken before the batch, which is s where
the framework files a batch's scalars before its update (Lightning) and s - 1 where it files them after
(Hugging Face's ``global_step``): ``start(step_offset=1)``):

- :meth:`MonitorSession.begin_step` before the forward: the opt-in second-order probes run on their own
  cadence; on a logging step the weights are measured (the parameters this step's forward uses), then the
  attention, residual-stream and output-logit captures are armed;
- the training forward runs untouched while the probes copy the first ``max_sequences`` sequences;
- :meth:`MonitorSession.end_forward` before the backward: the captures are disarmed, so the backward (and any
  activation recomputation) runs unobserved (``start(disarm_after_forward=True)`` does it when the model's
  forward returns, for a framework with no hook between forward and backward);
- :meth:`MonitorSession.end_step`: metrics from the recordings under ``no_grad``, alerts, records written,
  recordings dropped; returns the ``stop_on`` rules that ask training to stop.

Every rank measures, so a probe whose measurement takes part in a collective is entered by all ranks (the
collectives, and the rules that keep ranks in step, are in ``spectral_monitor.distributed``); the writing
rank (global rank 0) alone writes, warns and calls ``on_alert``. Under FSDP the weights are gathered whole
for their measurement.

A compiled model (``torch.compile``, given compiled or found running compiled at the first logging step) is
never armed during the training forward: at :meth:`MonitorSession.end_forward` of a logging step the
captures are armed around a probe forward of the same model with compilation off, on the step's batch, in
eval mode under ``no_grad`` with every random stream restored (``spectral_monitor.probes.wrappers``).

Nothing here imports a training framework.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from spectral_monitor.catalog import CATALOG, histogram_metrics, layer_head_heatmap_metrics
from spectral_monitor.checkpoint_entries import StateEntries
from spectral_monitor.core.alerting import ALERT_TEXT_TAG, Alerting, AlertStep
from spectral_monitor.core.options import MonitorOptions
from spectral_monitor.core.reports import Reports, kept_by, outputs_not_kept, warn_of_dropped_entries
from spectral_monitor.core.schedule import Cadence
from spectral_monitor.core.second_order import OPT_IN_FAMILIES, LossFn, SecondOrderProbes
from spectral_monitor.distributed import full_parameters
from spectral_monitor.metrics import (
    ATTENTION_LOGIT_METRICS,
    ATTENTION_METRICS,
    SEQUENCE_MAXIMA,
    KrylovState,
    attention_metrics,
    output_logit_metrics,
    token_metrics,
)
from spectral_monitor.metrics.attention import uses_exact_path
from spectral_monitor.probes import (
    AttentionCapture,
    AttentionRecording,
    AttentionSample,
    CapturedAttention,
    ResidualCapture,
    ResidualRecording,
    ResidualSample,
    SkippedCapture,
    WeightProbe,
)
from spectral_monitor.probes.attention_records import DENSE_CALL_NBYTES
from spectral_monitor.probes.huggingface import attention_not_seen_advice
from spectral_monitor.probes.output_logits import OutputLogitCapture, OutputLogitSample
from spectral_monitor.probes.token_masks import checked_token_mask
from spectral_monitor.probes.wrappers import (
    compiled_module_names,
    forward_on_batch,
    probe_forward,
    unwrapped_named_modules,
)
from spectral_monitor.records import Distribution, Measurement
from spectral_monitor.sinks import (
    Capability,
    Layout,
    Sink,
    diagnosis_layout,
)
from spectral_monitor.sinks.figures import (
    AttentionBlocks,
    AttentionImages,
    DrawnHead,
    attention_block_means,
)
from spectral_monitor.toolbox.head_diversity import (
    SPECTRUM_DTYPES,
    attention_spectra,
    redundant_pairs_markdown,
    spectra_diversity_records,
    spectrum_working_nbytes,
)
from spectral_monitor.toolbox.preflight import architecture_preflight, preflight_markdown
from spectral_monitor.toolbox.weight_spectra import esd_figure, weight_spectra, weight_spectrum_measurements

__all__ = ["HEATMAP_METRICS", "HISTOGRAM_METRICS", "MonitorSession", "outputs_not_kept"]

HISTOGRAM_METRICS = histogram_metrics("attention")
"""The attention metrics whose per-head values are also written as a histogram (``<metric>_per_head``), as
the catalogue says: the diagnostic ones. A histogram of each metric cost more than the rest of a logging
step on the demo model (writing a TensorBoard histogram takes ~0.7 ms)."""

HEATMAP_METRICS = layer_head_heatmap_metrics()
"""The attention metrics drawn as a layer × head image (``attention/figures/<metric>``) on figure steps."""

_HEAD_AGGREGATES = {info.name: info.head_aggregates for info in CATALOG if info.family == "attention"}
"""Per attention metric, the aggregates over heads written per layer (``<metric>_min``/``_max``) besides
the mean: only where the catalogue says the spread over heads diagnoses something."""

_HEATMAP_TITLES = {
    "entropy": "entropy / log n",
    "rank_one_residual": "rank-one residual",
    "effective_rank_ratio": "effective rank / n",
}
"""Titles of the layer × head images, by metric (``HEATMAP_METRICS``; every one ranges over [0, 1])."""

_FIGURE_HEAD = 0
"""The head drawn in figures, in the first sampled sequence: always the same one, so the images of
successive steps show that head change."""

_EXAMPLE_NAMES = 8
_NO_ATTENTION_SEEN = (
    "the attention family is on, but the training forward made no attention-kernel call the monitor could "
    "see (F.scaled_dot_product_attention, F.multi_head_attention_forward, Hugging Face eager attention)"
)
_WEIGHT_NORMS = ("spectral_norm", "frobenius_norm")


class MonitorSession:
    """One monitored training run: arms the probes on logging steps, measures, judges, writes.

    Made from validated :class:`~spectral_monitor.core.options.MonitorOptions` (a ValueError names a
    ``stop_on`` rule that does not run); :meth:`state_dict` and :meth:`load_state_dict` work from then on,
    before and after a run, so a checkpoint loaded before training starts is applied when it does. A run is
    :meth:`start` … :meth:`close`; a session may run several times (a Lightning ``fit`` after another).

    What each caller does, per training step ``step`` (non-decreasing; repeated for the micro-batches of one
    optimizer step, which are measured once, at the first):

    1. ``session.begin_step(step, batch, optimizer=...)`` before the forward (every rank);
    2. the training forward;
    3. ``session.end_forward()`` before the backward (or ``start(disarm_after_forward=True)``);
    4. ``session.end_step()`` after the step (every rank): the ``stop_on`` rules asking to stop, if any.

    ``abandon()`` drops a step whose forward failed or whose end never came.
    """

    def __init__(self, options: MonitorOptions) -> None:
        self.options = options
        self.alerting = Alerting(options.alerts, options.on_alert, options.stop_on, options.families)
        self._reports = Reports(options.strict)
        self._logging_cadence = Cadence.of_steps(options.every_n_steps, first_step=options.log_first_step)
        self._figures_cadence = Cadence.of_logs(options.outputs.figures_every_n_logs)
        self._head_diversity_cadence = Cadence.of_logs(options.outputs.head_diversity_every_n_logs)
        self._weight_spectra_cadence = Cadence.of_logs(options.outputs.weight_spectra_every_n_logs)
        self._sinks: list[Sink] = []
        self._model: nn.Module | None = None
        self._request_stop: Callable[[], None] = _no_stop
        self._disarm_after_forward = False
        self._step_offset = 0
        self._training_root: nn.Module | None = None
        self._forward_return_hook: torch.utils.hooks.RemovableHandle | None = None
        # Measure by a probe forward (the model runs compiled), and the hook that finds a compiled forward
        # of a model given uncompiled.
        self._by_probe_forward = False
        self._compile_detector: torch.utils.hooks.RemovableHandle | None = None
        self._ran_compiled = False
        self._attention_capture: AttentionCapture | None = None
        self._residual_capture: ResidualCapture | None = None
        self._output_capture: OutputLogitCapture | None = None
        self._weight_probe: WeightProbe | None = None
        self._second_order: SecondOrderProbes | None = None
        # The checkpoint state of a stateful part (by its key) while the part does not exist: loaded before
        # start makes it, or kept after close for a checkpoint or the next run.
        self._parked_states: dict[str, dict[str, Any]] = {}
        self._krylov_states: dict[str, KrylovState] = {}
        self._previous_max_logit: dict[str, float] = {}
        self._attention_images = _attention_images()
        # The layout of the last step's tags: steps mostly write the same tags, and deriving it took ~3 ms.
        self._layout_of_tags: tuple[frozenset[str], Layout] = (frozenset(), {})
        self._in_progress: _LoggingStep | None = None
        self._last_logged_step = -1
        self._logging_steps_done = 0

    def start(
        self,
        model: nn.Module,
        sinks: Sequence[Sink],
        *,
        writes: bool = True,
        training_root: nn.Module | None = None,
        default_loss: LossFn | None = None,
        request_stop: Callable[[], None] | None = None,
        disarm_after_forward: bool = False,
        step: int = 0,
        step_offset: int = 0,
    ) -> None:
        """Begin a run: find what to measure on ``model`` and run the architecture preflight.

        Args:
            model: the module whose forward the training step calls and whose parts are measured (with
                Lightning, the LightningModule), with every layer built and on its device.
            sinks: where records go; empty on a rank that does not write.
            writes: whether this process writes, warns and calls ``on_alert``: global rank 0.
            training_root: the outermost module trained (a DDP or FSDP wrapper of ``model``): every rank
                gathers its sharded weights for their measurement, and the second-order probes refuse a
                sharded one. Default ``model``.
            default_loss: ``default_loss(model, batch) -> scalar`` for the second-order probes when
                ``ProbeDataOptions.loss_fn`` is not given (Lightning: the module's ``training_step``).
            request_stop: called on every rank, once a step, when a ``stop_on`` rule fired on any rank.
            disarm_after_forward: end each logging step's captures when ``model``'s forward returns (a
                one-shot forward hook), for a loop that cannot call :meth:`end_forward` before the backward.
            step: the step the run starts at (the preflight's text is filed under it).
            step_offset: how far the caller's steps run ahead of the optimizer steps taken before their
                batch, which the cadences count: 0 where a framework files a batch's scalars before its
                update (Lightning), 1 where it files them after it (Hugging Face's ``global_step``). With
                either, ``every_n_steps`` equal to the framework's logging interval measures the batches
                whose scalars the framework logs, on the same steps.
        """
        options = self.options
        self._model = model
        self._sinks = list(sinks)
        self._reports.writes = writes
        self._request_stop = request_stop or _no_stop
        self._disarm_after_forward = disarm_after_forward
        self._step_offset = step_offset
        self.alerting.stopping = False
        training_root = model if training_root is None else training_root
        self._warn_about_unmatched_patterns(model)
        if options.preflight:
            with self._reports.failures_of("the architecture preflight"):
                self._run_preflight(model, step)
        self._by_probe_forward = self._ran_compiled = False
        if compiled_module_names(model):
            self._measure_by_probe_forward("runs as torch.compile graphs")
        if "attention" in options.families:
            self._attention_capture = AttentionCapture(
                model,
                max_sequences=options.capture.max_sequences,
                max_bytes=int(options.budget.memory_budget_mb * 2**20),
                strict=options.strict,
            )
        if "tokens" in options.families:
            with self._reports.failures_of("finding the transformer blocks (tokens family)"):
                self._residual_capture = ResidualCapture(
                    model, max_sequences=options.capture.max_sequences, strict=options.strict
                )
        if options.outputs.output_logits is not False:
            with self._reports.failures_of("finding the LM head (output_logits)"):
                head = (
                    options.outputs.output_logits if isinstance(options.outputs.output_logits, str) else None
                )
                self._output_capture = OutputLogitCapture(model, head, options.capture.max_sequences)
        if "weights" in options.families:
            self._weight_probe = WeightProbe(
                model,
                include=options.capture.include,
                exclude=options.capture.exclude,
                per_head=options.outputs.per_head,
                warn=self._reports.warn,
            )
        self._training_root = training_root
        if any(family in options.families for family in OPT_IN_FAMILIES):
            self._second_order = SecondOrderProbes(
                training_root,
                options.families,
                options.curvature,
                options.jacobian,
                options.ntk,
                options.probe_data,
                self._reports.failures_of,
                warn=self._reports.warn,
                default_loss=default_loss,
                step_offset=step_offset,
            )
        for key, part in self._stateful_parts().items():
            if part is not None and key in self._parked_states:
                part.load_state_dict(self._parked_states.pop(key))  # checked when loaded

    def begin_step(self, step: int, batch: Any, *, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Before the training forward of ``step`` on ``batch``: whether it is a logging step.

        The second-order probes measure when their own cadence falls (``optimizer`` gives the curvature's
        edge of stability); their records are judged and written at once off a logging step. On a logging
        step the weights are measured and the captures armed, the token mask read from ``batch`` by the
        ``token_mask`` option. Call it on every rank.
        """
        self.abandon()  # a step whose end never came
        if self._model is None:
            raise RuntimeError("MonitorSession.begin_step was called before start")
        self._reports.step = step
        probed = _LoggingStep(step, False)
        if self._second_order is not None:
            event = self._second_order.measure_due(self._model, batch, step, optimizer)
            broken = sorted(
                {f"{m.family}/{m.metric}" for m in event.measurements if not math.isfinite(m.value)}
            )
            if broken:
                self._reports.problem(
                    "non-finite curvature",
                    f"non-finite second-order measurements at step {step}: {', '.join(broken)} are NaN or "
                    "inf (the probe batch's loss or gradient is)",
                )
            probed = _LoggingStep(step, False, measurements=event.measurements, figures=event.figures)
        if not self._is_logging_step(step):
            if probed.measurements:  # the opt-in probes' own cadence: their alerts cannot wait
                self._stop_if_asked(self._evaluate_alerts(probed))
                self._write(probed)
            return False
        self._last_logged_step = step
        options = self.options
        costly = self._figures_cadence.due(self._logging_steps_done)
        progress = _LoggingStep(step, draw_figures=costly and self._kept(Capability.FIGURES))
        progress.measurements += probed.measurements  # judged and written with the rest of this step
        progress.figures += probed.figures
        self._in_progress = progress
        if self._weight_probe is not None:
            # Every rank enters: gathering FSDP shards is a collective (spectral_monitor.distributed).
            with (
                self._reports.failures_of("measuring the weights"),
                torch.no_grad(),
                full_parameters(self._training_root),
            ):
                progress.measurements += self._checked_weights(self._weight_probe.measure(step))
                if options.outputs.histograms and self._kept(Capability.HISTOGRAMS):
                    progress.distributions += self._weight_probe.distributions(step, full_spectrum=costly)
            if self._weight_spectra_cadence.due(self._logging_steps_done):
                with self._reports.failures_of("measuring the weight spectra"), torch.no_grad():
                    self._measure_weight_spectra(progress, self._model)
        if options.capture.token_mask is not None:
            with self._reports.failures_of("reading the batch's token mask (token_mask)"):
                progress.token_mask = checked_token_mask(
                    options.capture.token_mask(batch), "the token_mask function's result"
                )
        progress.batch = batch
        if self._by_probe_forward:
            return True  # nothing on the model during the training forward: end_forward probes it
        self._arm_captures(progress.token_mask, every_module=False)
        if self._attention_capture or self._residual_capture or self._output_capture:
            self._compile_detector = self._model.register_forward_pre_hook(self._notice_compiled_forward)
        if self._disarm_after_forward:
            self._forward_return_hook = self._model.register_forward_hook(self._end_forward_on_return)
        return True

    def end_forward(self) -> None:
        """Disarm the captures, keeping what they recorded: call it after the forward, before the backward.
        A compiled model's probe forward runs here. Nothing happens off a logging step or when already
        disarmed."""
        self._remove_step_hooks()
        progress = self._in_progress
        if progress is None:
            return
        if self._ran_compiled and not self._by_probe_forward:
            self._disarm_captures()  # hooks traced into a compiled graph returned at once: nothing recorded
            self._measure_by_probe_forward("ran compiled (the forward went through a torch.compile wrapper)")
        if self._by_probe_forward and not progress.probed:
            progress.probed = True
            self._run_probe_forward(progress)
        capture = self._attention_capture
        if capture is not None and capture.is_armed:
            with self._reports.failures_of("disarming the attention capture"):
                progress.attention = capture.disarm()
                self._report_skipped("attention", progress.attention.skipped)
                if not progress.attention.captured and not progress.attention.skipped:
                    self._reports.once(
                        "no attention", f"{_NO_ATTENTION_SEEN}; {attention_not_seen_advice(capture.model)}"
                    )
        residual_capture = self._residual_capture
        if residual_capture is not None and residual_capture.is_armed:
            with self._reports.failures_of("disarming the residual-stream capture"):
                progress.residual = residual_capture.disarm()
                self._report_skipped("residual stream", progress.residual.skipped)
        output_capture = self._output_capture
        if output_capture is not None and output_capture.is_armed:
            with self._reports.failures_of("disarming the output-logit capture"):
                progress.outputs = output_capture.disarm()

    def end_step(self) -> list[str]:
        """After the step: metrics from the recordings under ``no_grad``, alerts evaluated, records written,
        recordings dropped. Returns the ``stop_on`` rules that fired on any rank (``request_stop`` has been
        called); empty off a logging step. Call it on every rank (stopping is decided in a collective)."""
        self.end_forward()  # no backward ran (manual optimisation, or no loss)
        progress, self._in_progress = self._in_progress, None
        if progress is None:
            return []
        with torch.no_grad():
            if progress.attention is not None:
                with self._reports.failures_of("computing the attention metrics"):
                    self._measure_attention(progress)
            if progress.residual is not None:
                with self._reports.failures_of("computing the token metrics"):
                    self._measure_tokens(progress)
            if progress.outputs is not None:
                with self._reports.failures_of("computing the output-logit metrics"):
                    progress.measurements += _output_logit_measurements(progress.step, progress.outputs)
        # The recordings are not kept past this step.
        progress.attention = progress.residual = progress.outputs = None
        stopping = self._stop_if_asked(self._evaluate_alerts(progress))
        self._write(progress)
        self._logging_steps_done += 1
        return stopping

    @contextmanager
    def failures_of(self, what: str) -> Iterator[None]:
        """Runs an integration's own part of a step (installing a hook, starting a run): a failure drops the
        step in progress and is raised when ``strict``, else reported once, like the session's own, and
        listed in the end-of-run report."""
        with self._reports.failures_of(what):
            try:
                yield
            except Exception:
                self.abandon()
                raise

    def abandon(self) -> None:
        """Drop the step in progress, if any: captures disarmed, recordings discarded, nothing written."""
        self._remove_step_hooks()
        self._disarm_captures()
        self._in_progress = None

    def close(self) -> None:
        """End the run: sinks closed, and one warning listing what failed and what the sinks could not write
        (the end-of-run report). Warm state stays for a checkpoint or the next :meth:`start`."""
        self.abandon()
        for sink in self._sinks:
            with self._reports.failures_of(f"closing {type(sink).__name__}"):
                sink.close()
        self._reports.end_of_run(self._sinks)
        # The weight probe's warm vectors, and the opt-in probes' batch and warm vectors, stay.
        for key, part in self._stateful_parts().items():
            if part is not None:
                self._parked_states[key] = part.state_dict()
        if "second_order" in self._parked_states:
            # The last step tells a step's micro-batches apart within a run; a next run's steps are its own.
            self._parked_states["second_order"].pop("last_step", None)
        self._attention_capture = self._residual_capture = self._weight_probe = self._second_order = None
        self._output_capture = self._model = None
        self._sinks = []  # the attention warm vectors stay too: small, and a checkpoint after fit keeps them
        self._attention_images = _attention_images()  # kept figures hold canvases: not past a run

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to measure, judge and write as this one would have gone on doing."""
        parts = {
            key: part.state_dict() if part is not None else self._parked_states.get(key)
            for key, part in self._stateful_parts().items()
        }
        return {
            "last_logged_step": self._last_logged_step,
            "logging_steps_done": self._logging_steps_done,
            **parts,
            "attention_krylov_vectors": {
                layer: state.vectors.detach().clone()
                for layer, state in self._krylov_states.items()
                if state.vectors is not None
            },
            "alerts": self.alerting.engine.state_dict(),
            "previous_max_logit": dict(self._previous_max_logit),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a key it lacks leaves that part as a new run starts it.

        Each entry is checked before it is used (:mod:`spectral_monitor.checkpoint_entries`): one of the wrong
        type, shape or dtype, or holding NaN or inf, is dropped and that part starts cold, with one warning
        naming every entry dropped. A checkpoint never stops the resume, and never raises an alert.
        """
        entries = StateEntries(state_dict)
        self._last_logged_step = entries.integer("last_logged_step", -1, smallest=-1)
        self._logging_steps_done = entries.integer("logging_steps_done", 0, smallest=0)
        self._krylov_states = {
            layer: KrylovState(vectors)
            for layer, vectors in entries.unit_vectors("attention_krylov_vectors", ndim=3).items()
        }
        self.alerting.engine.load_state_dict(entries.nested("alerts"))
        self._previous_max_logit = entries.numbers("previous_max_logit")
        for key, part in self._stateful_parts().items():
            if key not in entries or state_dict[key] is None:
                continue
            if part is None:  # loaded when start makes the part
                self._parked_states[key] = _PART_TYPES[key].usable_state(entries.nested(key))
            else:
                part.load_state_dict(entries.nested(key))
        warn_of_dropped_entries(entries.dropped)

    def _stateful_parts(self) -> dict[str, WeightProbe | SecondOrderProbes | None]:
        """The parts with checkpoint state of their own, by their key in :meth:`state_dict`."""
        return {"weight_probe": self._weight_probe, "second_order": self._second_order}

    def _end_forward_on_return(self, module: nn.Module, args: Any, output: Any) -> None:
        self.end_forward()

    def _remove_step_hooks(self) -> None:
        for handle in (self._forward_return_hook, self._compile_detector):
            if handle is not None:
                handle.remove()
        self._forward_return_hook = self._compile_detector = None

    def _arm_captures(self, token_mask: Tensor | None, *, every_module: bool) -> None:
        """Arm every capture the families ask for (``every_module``: for a forward with compilation off)."""
        if self._attention_capture is not None:
            with self._reports.failures_of("arming the attention capture"):
                self._attention_capture.arm(token_mask, every_module=every_module)
        if self._residual_capture is not None:
            with self._reports.failures_of("arming the residual-stream capture"):
                self._residual_capture.arm(token_mask, every_module=every_module)
        if self._output_capture is not None:
            with self._reports.failures_of("arming the output-logit capture"):
                self._output_capture.arm(token_mask, every_module=every_module)

    def _disarm_captures(self) -> None:
        """Disarm every armed capture, discarding what it recorded."""
        for capture in (self._attention_capture, self._residual_capture, self._output_capture):
            if capture is not None and capture.is_armed:
                capture.disarm()

    def _notice_compiled_forward(self, module: nn.Module, args: Any) -> None:
        # Dynamo traces this hook into a compiled graph with is_compiling() constant True: the assignment
        # is replayed after the graph, and nothing else is added to it.
        if torch.compiler.is_compiling():
            self._ran_compiled = True

    def _measure_by_probe_forward(self, how: str) -> None:
        """From now on, measure attention, tokens and output logits by a probe forward (the model ``how``)."""
        self._by_probe_forward = True
        if self._reports.writes:
            logging.getLogger("spectral_monitor").info(
                "SpectralMonitor: the model %s; nothing is installed on it during training forwards, and on "
                "logging steps attention, tokens and output logits are measured by a forward of the same "
                "modules run eagerly on the step's batch, in eval mode (no dropout) under no_grad.",
                how,
            )

    def _run_probe_forward(self, progress: _LoggingStep) -> None:
        """The captures armed around a forward of the model on the step's batch that the run does not see
        (``spectral_monitor.probes.wrappers.probe_forward``); end_forward disarms them."""
        with self._reports.failures_of("the probe forward of the compiled model"), probe_forward(self._model):
            self._arm_captures(progress.token_mask, every_module=True)
            try:
                forward_on_batch(self._model, progress.batch)
            except BaseException:
                self._disarm_captures()
                raise

    def _stop_if_asked(self, fired_here: list[str]) -> list[str]:
        # Outside any failure guard: every rank must enter the collective.
        rules = self.alerting.rules_stopping(self._reports.step, fired_here, self._reports.writes)
        if rules:
            self._request_stop()
        return rules

    def _evaluate_alerts(self, progress: _LoggingStep) -> list[str]:
        """The alerts' records and text added to ``progress``; returns the ``stop_on`` rules fired here."""
        alerts = AlertStep()
        with self._reports.failures_of("evaluating the alerts"):
            records = [*progress.measurements, *progress.read_only]
            alerts = self.alerting.evaluate(progress.step, records, self._reports.writes)
        progress.measurements += alerts.records
        progress.alert_text = alerts.text
        return alerts.stop

    def _is_logging_step(self, step: int) -> bool:
        if step == self._last_logged_step:  # later micro-batches of an accumulated step
            return False
        return self._logging_cadence.due(step - self._step_offset)

    def _kept(self, capability: Capability) -> bool:
        return kept_by(self._sinks, capability)

    def _measure_attention(self, progress: _LoggingStep) -> None:
        recording = progress.attention
        write_histograms = self.options.outputs.histograms and self._kept(Capability.HISTOGRAMS)
        diversity_due = self._head_diversity_cadence.due(self._logging_steps_done)
        # What the capture holds stays alive throughout; the rest of the budget is the working memory.
        room = int(self.options.budget.memory_budget_mb * 2**20) - sum(
            captured.held_nbytes() for captured in recording.captured
        )
        layers = [captured for captured in recording.captured if self._selected(captured.layer)]
        measured = self._attention_of_layers(
            layers, room, diversity=diversity_due, draw=progress.draw_figures
        )
        drawn_heads = []
        for captured, layer in zip(layers, measured, strict=True):
            per_head = self._head_means(progress.step, captured.layer, layer.metrics)
            layer_records, head_records = _layer_measurements(
                progress.step, "attention", captured.layer, per_head
            )
            progress.measurements += layer_records + self._max_logit_growth(
                progress.step, captured.layer, per_head
            )
            if self.options.outputs.per_head:
                progress.measurements += head_records
            else:
                progress.read_only += head_records
            if write_histograms:
                # "_per_head": a histogram tag equal to a scalar tag hides the scalar in TensorBoard's
                # default (fast) loader, which keeps one data class per tag.
                progress.distributions += [
                    Distribution(
                        progress.step, "attention", f"{metric}_per_head", captured.layer, head_values.numpy()
                    )
                    for metric, head_values in per_head.items()
                    if metric in HISTOGRAM_METRICS
                ]
            drawn = _drawn_head(captured.layer, layer, per_head)
            if drawn is not None:
                drawn_heads.append(drawn)
        if drawn_heads:
            progress.figures += self._attention_images.drawn(drawn_heads)
        if diversity_due:
            with self._reports.failures_of("measuring head diversity"):
                spectra = {
                    captured.layer: layer.spectra
                    for captured, layer in zip(layers, measured, strict=True)
                    if layer.spectra is not None
                }
                records, pairs = spectra_diversity_records(progress.step, spectra)
                progress.measurements += records
                if pairs:
                    progress.texts.append(
                        ("attention/redundant_heads", redundant_pairs_markdown(progress.step, pairs))
                    )

    def _measure_weight_spectra(self, progress: _LoggingStep, model: nn.Module) -> None:
        spectra = weight_spectra(
            model, include=self.options.capture.include, exclude=self.options.capture.exclude
        )
        progress.measurements += weight_spectrum_measurements(spectra, progress.step)
        if self._kept(Capability.FIGURES):
            progress.figures += [
                (f"weights/figures/esd/{spectrum.layer}", lambda spectrum=spectrum: esd_figure(spectrum))
                for spectrum in spectra
            ]

    def _run_preflight(self, model: nn.Module, step: int) -> None:
        context = self.options.preflight_context_length
        if context is None:
            seq_len = getattr(model, "hparams", {}).get("seq_len")
            context = seq_len if isinstance(seq_len, int) and seq_len >= 2 else None
        findings = architecture_preflight(model, context_length=context)
        for finding in findings:
            if finding.severity == "warning":
                self._reports.warn(
                    f"SpectralMonitor preflight ({finding.check}, {finding.where}): {finding.message}."
                )
        for sink in self._sinks:
            # One kind with the steps' writes: an unwritable run directory is one problem, reported once.
            with self._reports.failures_of(f"writing to {type(sink).__name__}"):
                sink.write_text("preflight", preflight_markdown(findings), step)

    def _attention_of_layers(
        self, layers: list[CapturedAttention], room: int, *, diversity: bool, draw: bool
    ) -> list[_LayerAttention]:
        """Each layer's metrics (S, H), with its spectra and the drawn head's heatmap where wanted, within
        ``room`` bytes of working memory.

        A layer is measured densely a chunk of matrices at a time (:meth:`CapturedAttention.chunks`), as many
        as fit ``room`` with their working memory (:func:`dense_working_nbytes`); where not even one fits, or
        from ``BLOCKWISE_MIN_TOKENS`` tokens, blockwise from q and k within ``room``, and it is left out of
        the figures and head diversity. Every chunk's tensors are released before the next is formed.
        Whole layers on the exact path with one shape, causality and masking are measured in one call when
        they fit together: there the elements are independent, and the demo's four layers took 12 ms in one
        call, 19 in four.
        """
        results: list[_LayerAttention | None] = [None] * len(layers)
        together: dict[tuple[Any, ...], list[int]] = {}
        for index, captured in enumerate(layers):
            n, m = captured.q.shape[2], captured.k.shape[2]
            exact = uses_exact_path(n, m, self.options.budget.metric_method, captured.causal)
            # Room is kept for the spectra (in float32 at least) when they are wanted, unless that leaves
            # not one matrix: the metrics come first.
            spectra_room = spectrum_working_nbytes(n, m, torch.float32) if diversity or draw else 0
            per_chunk = 0
            if not captured.measured_blockwise():
                per_chunk = captured.matrices_per_chunk(room - spectra_room, exact) or (
                    captured.matrices_per_chunk(room, exact)
                )
            matrices = captured.num_sequences * captured.num_heads
            if per_chunk == 0:
                results[index] = self._blockwise_attention(captured, room, exact)
            elif exact and per_chunk == matrices:
                kind = (captured.q.shape[1:3], captured.k.shape[2], captured.q.device, captured.causal)
                masks = tuple(
                    tensor is None for tensor in (captured.mask, captured.key_mask, captured.query_mask)
                )
                together.setdefault((*kind, *masks), []).append(index)
            else:
                state = None if exact else self._krylov_state(captured)
                results[index] = self._dense_attention(
                    [captured], captured.chunks(per_chunk), room, state, diversity, draw
                )[0]
        for indices in together.values():
            per_matrix = layers[indices[0]].dense_matrix_nbytes(exact=True)
            n, m = layers[indices[0]].q.shape[2], layers[indices[0]].k.shape[2]
            spectra_room = spectrum_working_nbytes(n, m, torch.float32) if diversity or draw else 0
            fitting = max(1, (room - spectra_room - DENSE_CALL_NBYTES) // per_matrix)
            group: list[int] = []
            for index in [*indices, None]:
                if (
                    index is not None
                    and sum(layers[i].num_sequences * layers[i].num_heads for i in [*group, index]) <= fitting
                ):
                    group.append(index)
                    continue
                members = [layers[i] for i in group]
                for i, result in zip(
                    group,
                    self._dense_attention(members, iter(members), room, None, diversity, draw),
                    strict=True,
                ):
                    results[i] = result
                group = [] if index is None else [index]
        return [result for result in results if result is not None]

    def _dense_attention(
        self,
        layers: list[CapturedAttention],
        chunks: Iterator[CapturedAttention],
        room: int,
        state: KrylovState | None,
        diversity: bool,
        draw: bool,
    ) -> list[_LayerAttention]:
        """The attention of ``layers`` measured densely: several whole layers of one kind in one call (the
        chunks are the layers), or one layer in ``chunks`` of its matrices, one call each, in order."""
        if len(layers) > 1:
            call = self._dense_call(list(chunks), room, None, diversity, draw)
            sizes = [layer.num_sequences for layer in layers]
            metrics = {name: values.split(sizes) for name, values in call.metrics.items()}
            spectra = None if call.spectra is None else call.spectra.split(sizes)
            return [
                _LayerAttention(
                    {name: split[position] for name, split in metrics.items()},
                    None if spectra is None else spectra[position],
                    call.drawn[position],
                )
                for position in range(len(layers))
            ]
        (layer,) = layers
        warm = None if state is None else state.vectors
        warm_fits = warm is not None and warm.shape[0] == layer.num_sequences * layer.num_heads
        calls, next_vectors, first = [], [], 0
        for chunk in chunks:
            count = chunk.num_sequences * chunk.num_heads
            chunk_state = None
            if state is not None:
                chunk_state = KrylovState(warm[first : first + count] if warm_fits else None)
            calls.append(self._dense_call([chunk], room, chunk_state, diversity, draw and first == 0))
            if chunk_state is not None:
                next_vectors.append(chunk_state.vectors)
            first += count
        if state is not None and all(vectors is not None for vectors in next_vectors):
            state.vectors = torch.cat(next_vectors)
        shape = (layer.num_sequences, layer.num_heads)
        metrics = {
            name: torch.cat([call.metrics[name].reshape(-1) for call in calls]).reshape(shape)
            for name in calls[0].metrics
        }
        spectra = None
        if all(call.spectra is not None for call in calls):
            spectra = torch.cat([call.spectra.flatten(0, 1) for call in calls]).unflatten(0, shape)
        return [_LayerAttention(metrics, spectra, calls[0].drawn[0])]

    def _dense_call(
        self,
        parts: list[CapturedAttention],
        room: int,
        state: KrylovState | None,
        diversity: bool,
        draw: bool,
    ) -> _DenseCall:
        """One ``attention_metrics`` call on ``parts`` (one kind), their probabilities formed into one
        buffer; then, within what the buffer leaves of ``room``, their spectra and each part's first
        matrix's heatmap. The call's tensors are released when it returns."""
        first = parts[0]
        heads, n, m = first.num_heads, first.q.shape[2], first.k.shape[2]
        sequences = [part.num_sequences for part in parts]
        probs = torch.empty((sum(sequences), heads, n, m), dtype=torch.float32, device=first.q.device)
        samples = [part.sample(out=block) for part, block in zip(parts, probs.split(sequences), strict=True)]
        key_mask = _concatenated([sample.key_mask for sample in samples])
        query_mask = _concatenated([sample.query_mask for sample in samples])
        metrics = attention_metrics(
            probs,
            key_mask=_per_head(key_mask, heads),
            query_mask=_per_head(query_mask, heads),
            causal=first.causal,
            attendable=_concatenated_patterns([sample.attendable for sample in samples], heads),
            method=self.options.budget.metric_method,
            include_rank_sums=self.options.budget.attention_rank_sums,
            state=state,
            return_spectra=diversity or draw,
        )
        # The exact path's singular values serve head diversity and the figures: nothing is factorised twice.
        computed_spectra = metrics.pop("singular_values", None)
        if all(sample.max_logit is not None for sample in samples):
            metrics["max_logit"] = torch.cat([sample.max_logit for sample in samples])
        call = _DenseCall(metrics, None, [None] * len(parts))
        if not (diversity or draw):
            return call
        dtype = torch.float64
        if computed_spectra is not None:
            call.spectra = computed_spectra.double().cpu()  # where attention_spectra puts them
        else:
            left = room - probs.numel() * probs.element_size() - DENSE_CALL_NBYTES
            dtype = next(
                (dtype for dtype in SPECTRUM_DTYPES if spectrum_working_nbytes(n, m, dtype) <= left), None
            )
            if dtype is None:
                self._reports.once(
                    "spectra over budget",
                    f"the memory budget ({self.options.budget.memory_budget_mb:g} MB) leaves no room for the "
                    f"singular values of {first.layer}'s {n}×{m} attention; it is left out of head diversity "
                    "and the figures",
                )
                return call
        if diversity and call.spectra is None:
            call.spectra = attention_spectra(probs, query_mask, key_mask, dtype)
        if draw:
            firsts = torch.tensor([0, *sequences[:-1]]).cumsum(0).tolist()
            call.drawn = [
                _drawn_attention(
                    sample,
                    attention_spectra(
                        sample.probs[:1, _FIGURE_HEAD : _FIGURE_HEAD + 1],
                        None if sample.query_mask is None else sample.query_mask[:1],
                        None if sample.key_mask is None else sample.key_mask[:1],
                        dtype,
                    )[0, 0]
                    if call.spectra is None
                    else call.spectra[position, _FIGURE_HEAD],
                )
                for sample, position in zip(samples, firsts, strict=True)
            ]
        return call

    def _max_logit_growth(self, step: int, layer: str, per_head: dict[str, Tensor]) -> list[Measurement]:
        """``max_logit_growth``: the layer's largest logit over the previous logging step's, written where
        both are measured and the previous one is positive (a ratio of logits of either sign says nothing)."""
        if "max_logit" not in per_head:
            return []
        current = float(per_head["max_logit"].amax())
        previous = self._previous_max_logit.get(layer)
        self._previous_max_logit[layer] = current
        if previous is None or not previous > 0 or not math.isfinite(previous):
            return []
        return [Measurement(step, "attention", "max_logit_growth", layer, current / previous)]

    def _blockwise_attention(self, captured: CapturedAttention, room: int, exact: bool) -> _LayerAttention:
        """One layer's metrics from q and k in blocks within ``room``; on the Krylov path where the exact
        one would form whole matrices beyond it."""
        method = self.options.budget.metric_method
        if exact and not captured.measured_blockwise():
            method = "krylov"
            self._reports.once(
                "exact over budget",
                f"the memory budget ({self.options.budget.memory_budget_mb:g} MB) is too small for the exact "
                f"measurement of one of {captured.layer}'s attention matrices "
                f"({captured.dense_matrix_nbytes(True) / 2**20:.0f} MiB); it is measured on the Krylov path "
                "from q and k",
            )
        return _LayerAttention(
            captured.blockwise_metrics(
                method=method,
                max_bytes=max(room, 2**20),
                include_rank_sums=self.options.budget.attention_rank_sums,
                state=self._krylov_state(captured),
            )
        )

    def _krylov_state(self, captured: CapturedAttention) -> KrylovState:
        """The layer's warm-start vectors, on the capture's device."""
        state = self._krylov_states.setdefault(captured.layer, KrylovState())
        if state.vectors is not None and state.vectors.device != captured.q.device:  # from a checkpoint
            state.vectors = state.vectors.to(captured.q.device)
        return state

    def _head_means(self, step: int, layer: str, metrics: dict[str, Tensor]) -> dict[str, Tensor]:
        nonfinite = metrics["nonfinite"]
        if nonfinite.any():
            self._reports.problem(
                "non-finite attention",
                f"non-finite attention in {layer} at step {step}: its probabilities hold NaN or inf "
                "(or its q and k do), so its metrics are written as NaN",
            )
        per_head = {}
        for metric in (*ATTENTION_METRICS, *ATTENTION_LOGIT_METRICS):
            if metric not in metrics:
                continue
            over_sequences = _max_over_sequences if metric in SEQUENCE_MAXIMA else _mean_over_sequences
            summary = over_sequences(metrics[metric], nonfinite)
            if summary is not None:
                per_head[metric] = summary.to("cpu", torch.float64)
        return per_head

    def _measure_tokens(self, progress: _LoggingStep) -> None:
        samples = [sample for sample in progress.residual.states if self._selected(sample.layer)]
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
                    self._reports.problem(
                        "non-finite tokens",
                        f"non-finite tokens out of {sample.layer} at step {progress.step}: its output holds "
                        "NaN or inf, so its token metrics are written as NaN",
                    )
                for metric, values in metrics.items():
                    mean = _mean_over_sequences(values[position], nonfinite[position])
                    if mean is not None:
                        progress.measurements.append(
                            Measurement(progress.step, "tokens", metric, sample.layer, float(mean))
                        )

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
        tags = frozenset(record.tag for record in progress.measurements)
        if tags != self._layout_of_tags[0]:
            self._layout_of_tags = (tags, diagnosis_layout(tags) if tags else {})
        layout = self._layout_of_tags[1]
        for sink in self._sinks:
            kind = type(sink).__name__
            with self._reports.failures_of(f"writing to {kind}"):
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
                    with self._reports.failures_of("drawing figures"):
                        drawn = draw()
                    if drawn is not None:
                        # A full disk is one fault whichever output meets it: reported with the others.
                        with self._reports.failures_of(f"writing to {kind}"):
                            if isinstance(drawn, Figure):
                                sink.write_figure(tag, drawn, progress.step)
                            else:
                                sink.write_image(tag, drawn, progress.step)
            with self._reports.failures_of(f"writing to {kind}"):
                for tag, markdown in progress.texts:
                    sink.write_text(tag, markdown, progress.step)

    def _selected(self, layer: str) -> bool:
        """Whether the module named ``layer`` is measured: the same rule as ``WeightProbe``'s."""
        if self.options.capture.include is not None and not _any_match([layer], self.options.capture.include):
            return False
        return self.options.capture.exclude is None or not _any_match([layer], self.options.capture.exclude)

    def _report_skipped(self, what: str, skipped: list[SkippedCapture]) -> None:
        """Once per distinct reason, with the layers it applied to the first time."""
        layers_by_reason: dict[str, list[str]] = {}
        for entry in skipped:
            layers_by_reason.setdefault(entry.reason, []).append(entry.layer)
        for reason, layers in layers_by_reason.items():
            self._reports.once(reason, f"not all of the {what} was captured ({', '.join(layers)}): {reason}")

    def _warn_about_unmatched_patterns(self, model: nn.Module) -> None:
        names = [name for name, _ in unwrapped_named_modules(model) if name]
        patterns = [*(self.options.capture.include or ()), *(self.options.capture.exclude or ())]
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
    outputs: OutputLogitSample | None = None
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
class _DrawnAttention:
    """What the figures draw of one layer's head ``_FIGURE_HEAD`` in its first sequence."""

    blocks: AttentionBlocks  # the heatmap's block means over real queries × keys, padding keys left out
    singular_values: np.ndarray  # of the attention restricted to real queries and attendable keys


@dataclass
class _DenseCall:
    """One dense ``attention_metrics`` call's results: metrics (S, H), spectra (S, H, k) where measured, and
    each part's drawn attention where drawn and drawable."""

    metrics: dict[str, Tensor]
    spectra: Tensor | None
    drawn: list[_DrawnAttention | None]


@dataclass
class _LayerAttention:
    """A layer's attention as measured: metrics (S, H); spectra (S, H, k) for head diversity and figures,
    None where the layer was measured blockwise or its spectra did not fit the memory budget."""

    metrics: dict[str, Tensor]
    spectra: Tensor | None = None
    drawn: _DrawnAttention | None = None


def _drawn_attention(sample: AttentionSample, singular_values: Tensor) -> _DrawnAttention | None:
    """Head ``_FIGURE_HEAD`` of the first sequence of ``sample``, with its ``singular_values``, reduced to
    what its figures draw; None when it cannot be drawn: no real query or no attendable key (all padding), or
    attention holding NaN or inf (its spectrum is NaN; written as such by the metrics)."""
    real_queries = sample.probs.shape[2] if sample.query_mask is None else int(sample.query_mask[0].sum())
    attendable_keys = sample.probs.shape[3] if sample.key_mask is None else int(sample.key_mask[0].sum())
    if min(real_queries, attendable_keys) == 0 or not bool(singular_values.isfinite().all()):
        return None
    # The block means read the float32 matrix in place, a few rows at a time (no float64 copy of it).
    attention = sample.probs[0, _FIGURE_HEAD].cpu().numpy()
    return _DrawnAttention(
        blocks=attention_block_means(
            attention,
            None if sample.key_mask is None else (~sample.key_mask[0]).cpu().numpy(),
            None if sample.query_mask is None else sample.query_mask[0].nonzero().flatten().cpu().numpy(),
        ),
        singular_values=singular_values[: min(real_queries, attendable_keys)].numpy(),
    )


def _drawn_head(layer: str, attention: _LayerAttention, per_head: dict[str, Tensor]) -> DrawnHead | None:
    """What the figures draw of a layer; None where it was not drawn (``_drawn_attention``)."""
    if attention.drawn is None:
        return None
    return DrawnHead(
        layer=layer,
        blocks=attention.drawn.blocks,
        singular_values=attention.drawn.singular_values,
        head_values={metric: per_head[metric].numpy() for metric in HEATMAP_METRICS if metric in per_head},
    )


def _attention_images() -> AttentionImages:
    """The run's attention figure cache, drawing the ``HEATMAP_METRICS`` images and head ``_FIGURE_HEAD``."""
    return AttentionImages(HEATMAP_METRICS, _HEATMAP_TITLES, _FIGURE_HEAD)


def _mean_over_sequences(values: Tensor, nonfinite: Tensor) -> Tensor | None:
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


def _max_over_sequences(values: Tensor, nonfinite: Tensor) -> Tensor | None:
    """The largest over the sequences (dim 0) of ``values`` defined for them, NaN where one was non-finite;
    None where no sequence has a value (as :func:`_mean_over_sequences`)."""
    counted = ~values.isnan() | nonfinite
    if not bool(counted.any()):
        return None
    # A non-finite sequence's value is NaN, which amax propagates.
    largest = torch.where(counted, values, torch.full_like(values, -math.inf)).amax(dim=0)
    return largest.masked_fill(~counted.any(dim=0), math.nan)


def _concatenated_patterns(patterns: list[Tensor | None], heads: int) -> Tensor | None:
    """The samples' attendable patterns (S, H or 1, n, m) joined along the sequences, one per head."""
    if patterns[0] is None:
        return None
    return torch.cat([pattern.expand(-1, heads, -1, -1) for pattern in patterns])


def _layer_measurements(
    step: int, family: str, layer: str, per_head: dict[str, Tensor]
) -> tuple[list[Measurement], list[Measurement]]:
    """A layer's records: the head mean of each metric with the aggregates of ``_HEAD_AGGREGATES``; and
    each head's value."""
    layer_records, head_records = [], []
    for metric, values in per_head.items():
        layer_records.append(Measurement(step, family, metric, layer, float(values.mean())))
        for aggregate in _HEAD_AGGREGATES.get(metric, ()):
            value = values.amin() if aggregate == "min" else values.amax()
            layer_records.append(Measurement(step, family, f"{metric}_{aggregate}", layer, float(value)))
        head_records += [
            Measurement(step, family, metric, layer, value, head=head)
            for head, value in enumerate(values.tolist())
        ]
    return layer_records, head_records


def _no_stop() -> None:
    return None


_PART_TYPES = {"weight_probe": WeightProbe, "second_order": SecondOrderProbes}
"""The type of each stateful part (:meth:`MonitorSession._stateful_parts`), whose ``usable_state`` checks
its checkpoint state while the part does not exist yet."""


def _concatenated(masks: list[Tensor | None]) -> Tensor | None:
    """The layers' masks as one, for measuring the layers in one call (all given or all None)."""
    return None if masks[0] is None else torch.cat(masks)


def _per_head(mask: Tensor | None, heads: int) -> Tensor | None:
    """A per-sequence (S, L) mask broadcast to (S, heads, L), the batch shape of the metrics' input."""
    return None if mask is None else mask[:, None, :].expand(-1, heads, -1)


def _any_match(names: Sequence[str], patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in patterns)

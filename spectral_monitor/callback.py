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

Every rank measures, so a probe whose measurement takes part in a collective is entered by all ranks (the
collectives, and the rules that keep ranks in step, are in ``spectral_monitor.distributed``); global rank 0
alone writes. Under FSDP the weights are gathered whole for their measurement. A model whose attention runs
inside torch.compile graphs gets one warning and no attention or token capture (see the README's "Scale").
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from spectral_monitor.alerting import ALERT_TEXT_TAG, Alerting, AlertStep
from spectral_monitor.alerts import AlertConfig, AlertEvent
from spectral_monitor.catalog import CATALOG, histogram_metrics, layer_head_heatmap_metrics
from spectral_monitor.curvature_monitor import (
    OPT_IN_FAMILIES,
    CurvatureOptions,
    JacobianOptions,
    NTKOptions,
    ProbeDataOptions,
    SecondOrderProbes,
)
from spectral_monitor.distributed import full_parameters
from spectral_monitor.lightning_namespaces import (
    CALLBACK_BASES,
    MisconfigurationException,
    TensorBoardLogger,
    pl,
    rank_zero_warn,
)
from spectral_monitor.metrics import (
    ATTENTION_LOGIT_METRICS,
    ATTENTION_METRICS,
    SEQUENCE_MAXIMA,
    KrylovState,
    attention_metrics,
    output_logit_metrics,
    token_metrics,
)
from spectral_monitor.metrics import METHODS as METRIC_METHODS
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
from spectral_monitor.probes.attention import DENSE_CALL_NBYTES
from spectral_monitor.probes.huggingface import attention_not_seen_advice
from spectral_monitor.probes.output_logits import OutputLogitCapture, OutputLogitSample
from spectral_monitor.probes.token_masks import checked_token_mask
from spectral_monitor.probes.wrappers import compiled_attention_regions, unwrapped_named_modules
from spectral_monitor.records import Distribution, Measurement
from spectral_monitor.sinks import (
    Capability,
    Layout,
    LoggerSink,
    Sink,
    TensorBoardSink,
    diagnosis_layout,
    steps_phrase,
)
from spectral_monitor.sinks.figures import (
    AttentionBlocks,
    AttentionHeatmapImages,
    LayerHeadHeatmapImages,
    SpectrumImages,
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
from spectral_monitor.validation import (
    check_bool,
    check_callable,
    check_choice,
    check_instance,
    check_int,
    check_names,
    check_number,
    check_patterns,
)

__all__ = ["FAMILIES", "SpectralMonitor"]

FAMILIES = ("attention", "tokens", "weights")
"""What the monitor can observe: attention matrices, residual-stream tokens, weight matrices."""
ALL_FAMILIES = (*FAMILIES, *OPT_IN_FAMILIES)

MIN_MEMORY_BUDGET_MB = 2**-10
"""The smallest ``memory_budget_mb`` (1 KiB): below it the attention capture has no byte to hold."""

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


class SpectralMonitor(*CALLBACK_BASES):
    """Measures attention, residual-stream and weight spectra on logging steps and writes them to loggers.

    Add it to a Trainer with a logger; a ``TensorBoardLogger`` receives everything, any other Lightning logger
    the scalars only::

        trainer = pl.Trainer(callbacks=[SpectralMonitor()], logger=TensorBoardLogger("runs"))

    It is a callback of ``pytorch_lightning`` and of ``lightning.pytorch``, Trainer and ``LightningCLI`` alike
    (it derives from the ``Callback`` of each installed namespace: ``spectral_monitor.lightning_namespaces``).

    Written on each logging step (tags ``family/metric/layer[/head_h]``, see ``Measurement.tag``):

    - ``attention/<metric>/<layer>``: each metric of ``spectral_monitor.metrics.attention_metrics``, the mean
      over heads; ``<metric>_min`` and ``<metric>_max`` over heads for the metrics whose spread diagnoses
      something (``spectral_monitor.catalog``: entropy, rank-one residual, effective rank / n, spectral gap;
      ``sigma1_max``, ``eigen_gap_min``), and per head only when ``per_head``; histograms of the per-head
      values of the metrics in ``HISTOGRAM_METRICS``; ``max_logit`` (each head's largest pre-softmax logit
      over the sampled sequences) with ``max_logit_max`` and ``max_logit_growth`` (the layer's largest over
      the previous logging step's);
    - ``tokens/<metric>/<block>``: ``token_metrics`` of each transformer block's output;
    - ``weights/<metric>/<weight>``: what :class:`~spectral_monitor.probes.weights.WeightProbe` measures
      (spectral norm, stable rank, per-head ‖W_Q^hᵀ W_K^h‖₂, ...), with histograms of per-head values;
    - every ``figures_every_n_logs``-th logging step, histograms of every weight's singular values and
      figures: the singular values of the drawn head of each layer, the attention of that head in the first
      and last layer, and a layer × head map of each metric in ``HEATMAP_METRICS``;
    - a Custom Scalars layout grouped by diagnosis (rank collapse, entropy, token collapse, signal
      propagation, curvature, weights, alerts), one chart per metric with one line per layer;
    - alerts (:mod:`spectral_monitor.alerts`): each rule is evaluated on every logging step's records; an
      alert that fires or resolves is one line of the ``spectral_monitor.alerts`` logger on rank 0 and a
      call of ``on_alert``, and the markdown table of open alerts is written as text (``alerts/table``);
      ``alerts/open/<rule>`` and ``alerts/fired/<rule>`` count them on every logging step.
    - opt-in, each on its own cadence (``spectral_monitor.curvature_monitor``): ``curvature/<metric>/model``
      (sharpness against the optimizer's edge of stability, top Hessian eigenvalues, trace, density figure),
      ``jacobian/<metric>/<block>`` (block Jacobian norms), ``ntk/<metric>/model`` (empirical NTK), with
      ``<family>/overhead_ms/model`` and ``overhead_percent`` (of the last training step).

    Metrics a layer does not define (``eigen_gap`` of causal attention) are not written for it.

    Args:
        every_n_steps: measure when ``(step + 1) % every_n_steps == 0``, Lightning's own ``log_every_n_steps``
            rule, so with equal values both land on the same steps.
        families: which of ``"attention"``, ``"tokens"``, ``"weights"`` to measure, and of the opt-in
            ``"curvature"``, ``"jacobian"``, ``"ntk"`` (each also turned on by passing its options).
        include: ``fnmatch`` patterns over qualified module names: an attention module, a block or a weight's
            module is measured if its name matches one (``"blocks.0*"``: the first block and everything in
            it). ``None``: everything.
        exclude: patterns of module names not to measure; applied after ``include``.
        max_sequences: sequences of the batch captured (the first ones: no random numbers drawn).
        memory_budget_mb: most memory (MiB: 2²⁰ bytes; at least 1/1024) a logging step's attention work
            adds at its peak: the q and k the capture holds from the forward, the probabilities formed from
            them, the metrics' working memory, the singular values for head diversity and the figures, and
            the drawn attention. Over it the capture keeps fewer sequences, then heads, then layers, with a
            warning, so that each layer's probabilities fit whole. Each layer is then measured a chunk of
            its matrices at a time, as many as fit what the capture leaves with their working memory (about
            8.5 times a float32 matrix on the exact path, 2.3–3.8 on the Krylov path); where not even one
            fits, or from ``BLOCKWISE_MIN_TOKENS`` (4096) tokens, from q and k in blocks within it
            (``attention_metrics_from_qk``, on the Krylov path where the exact one was asked for, with a
            warning), and the layer is left out of the figures and head diversity. Singular values are
            taken in float64 where that fits, else in float32 (σ within ~1e-7 σ₁), else the layer is left
            out of them with a warning. The heatmaps keep block means of at most 128 × 128. Not covered:
            the model's own forward and backward, the other families (tokens, weights and the opt-in
            probes), the figures' canvases kept between figure steps and their PNG encoding, and memory
            the allocator keeps after it is freed. With all of those, a logging step at n = 2048 (2 layers,
            2 sequences, 2 heads, figures and head diversity on) grew the resident set by at most 68.4 MiB
            with a 64 MB budget and 148.7 MiB with 256 MB (``tests/test_memory_budget.py``).
        per_head: also write each head's values as scalars: attention metrics, and the weight metrics of
            each head's rows of W_Q, W_K, W_V with their histograms. Off by default, so a 12-layer,
            12-head model writes 24 attention scalars per layer rather than 167; the alert rules read
            every head either way, and the attention histograms and layer × head images show them.
        histograms: write histograms of per-head values and of weight singular values.
        figures_every_n_logs: on every k-th logging step, starting with the first, draw the figures and write
            histograms of each weight's singular values (a full SVD of every weight); 0: never. The default,
            every 10th (every 500 steps at the default cadence), writes as many images as TensorBoard shows:
            it keeps 10 per tag unless started with ``--samples_per_plugin images=N``. The figures are kept
            and redrawn (``spectral_monitor.sinks.figures.RedrawnFigure``): on the demo model the first
            logging step, which draws each figure new, spends ~1 s in the monitor on a slow CPU core, and
            a later figure step redraws its four figures in ~0.1 s (their PNGs and the weights' full SVDs
            come on top).
        metric_method: ``method`` of ``attention_metrics``: ``"auto"``, ``"exact"`` or ``"krylov"``.
        attention_rank_sums: measure the attention's effective and threshold ranks, the members that need
            the whole spectrum. On the Krylov path (long sequences) their quadrature is most of the time: 64
            heads at n = 2048 took 14 s with them and 6 s without (``benchmarks/README.md``); near-uniform
            attention at n = 4096 about 100 s a head. False leaves them (and the effective-rank figure) out.
        strict: raise failures of the monitor (a probe or sink raising, non-finite measurements) instead of
            warning once per kind and going on without them.
        log_first_step: also measure step 0, the model before any update.
        curvature: options of the loss-Hessian probe (:class:`CurvatureOptions`); giving them turns it on.
        jacobian: options of the block-Jacobian probe (:class:`JacobianOptions`); giving them turns it on.
        ntk: options of the empirical-NTK probe (:class:`NTKOptions`); giving them turns it on.
        probe_data: the batch and loss those three probes use (:class:`ProbeDataOptions`).
        head_diversity_every_n_logs: on every k-th logging step, starting with the first, write
            ``attention/head_diversity/<layer>`` (mean Jensen–Shannon distance between the heads' normalised
            attention spectra, :mod:`spectral_monitor.metrics.heads`), ``head_diversity_min`` (the closest
            pair) and a text entry ``attention/redundant_heads`` listing each layer's closest head pairs
            (one ``svdvals`` per sampled head); 0: never.
        weight_spectra_every_n_logs: on every k-th logging step, starting with the first, a full SVD of every
            weight: ``weights/<metric>/<weight>`` for ``mp_edge``, ``mp_spikes``, ``alpha`` (power-law tail
            exponent of σ², WeightWatcher's convention), ``alpha_ks_distance``, ``energy_rank_90`` and
            ``energy_rank_99`` (compressible rank), and ESD-against-Marchenko–Pastur figures
            ``weights/figures/esd/<weight>``, with the "weights" family on; 0 (default): never.
        preflight: at fit start, run :func:`spectral_monitor.toolbox.preflight.architecture_preflight` once:
            warnings through ``rank_zero_warn``, every finding in the text entry ``preflight``.
        preflight_context_length: context length of the preflight's logit-scale check (None: the model's
            ``hparams.seq_len`` if it has one, else the check is skipped).
        alerts: which alert rules run: ``None`` for :func:`~spectral_monitor.alerts.default_rules`, or an
            :class:`~spectral_monitor.alerts.AlertConfig` that disables, tunes or adds rules.
        on_alert: called on global rank 0 with each :class:`~spectral_monitor.alerts.AlertEvent`, fired
            and resolved (``event.kind``), after its console line.
        stop_on: names of rules whose firing stops training: every rank stops after the same step.
        token_mask: a function of the training batch returning its (batch, tokens) token mask, True (or
            nonzero) = real token, or None. Needed only where the model's forward does not say which tokens
            are padding: a Hugging Face ``attention_mask`` and ``nn.Transformer``'s ``src_key_padding_mask``
            / ``tgt_key_padding_mask`` are read from the forward itself. Padded queries leave the attention
            metrics of every layer with that many queries, and padded tokens the token metrics.
        output_logits: also write ``outputs/max_logit/model`` (the largest output logit over the sampled
            sequences' real tokens) and ``outputs/log_partition/model`` (the mean over them of the
            log-sum-exp over the vocabulary, the z-loss quantity), from a forward hook on the LM head on
            logging steps. True: the head is ``get_output_embeddings()`` of a Hugging Face model, else the
            last ``nn.Linear`` with as many outputs as the first ``nn.Embedding`` has rows; a string names
            the head module. False (default): off.

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
        per_head: bool = False,
        histograms: bool = True,
        figures_every_n_logs: int = 10,
        metric_method: str = "auto",
        attention_rank_sums: bool = True,
        strict: bool = False,
        log_first_step: bool = True,
        curvature: CurvatureOptions | None = None,
        jacobian: JacobianOptions | None = None,
        ntk: NTKOptions | None = None,
        probe_data: ProbeDataOptions | None = None,
        head_diversity_every_n_logs: int = 4,
        weight_spectra_every_n_logs: int = 0,
        preflight: bool = True,
        preflight_context_length: int | None = None,
        alerts: AlertConfig | None = None,
        on_alert: Callable[[AlertEvent], Any] | None = None,
        stop_on: Sequence[str] = (),
        token_mask: Callable[[Any], Tensor | None] | None = None,
        output_logits: bool | str = False,
    ) -> None:
        super().__init__()
        self.every_n_steps = check_int("every_n_steps", every_n_steps, smallest=1)
        self.families = tuple(
            dict.fromkeys(check_names("families", families, allowed=ALL_FAMILIES, non_empty=True))
        )
        self.include = check_patterns("include", include)
        self.exclude = check_patterns("exclude", exclude)
        self.max_sequences = check_int("max_sequences", max_sequences, smallest=1)
        self.memory_budget_mb = check_number(
            "memory_budget_mb",
            memory_budget_mb,
            at_least=MIN_MEMORY_BUDGET_MB,
            unit="positive number of megabytes",
        )
        self.per_head = check_bool("per_head", per_head)
        if not isinstance(output_logits, (bool, str)) or output_logits == "":
            raise ValueError(
                f"output_logits must be True, False or the name of the LM head module, got {output_logits!r}"
            )
        self.output_logits = output_logits
        self.histograms = check_bool("histograms", histograms)
        self.figures_every_n_logs = check_int("figures_every_n_logs", figures_every_n_logs, smallest=0)
        self.metric_method = check_choice("metric_method", metric_method, METRIC_METHODS)
        self.attention_rank_sums = check_bool("attention_rank_sums", attention_rank_sums)
        self.strict = check_bool("strict", strict)
        self.log_first_step = check_bool("log_first_step", log_first_step)
        given = {"curvature": curvature, "jacobian": jacobian, "ntk": ntk}
        self.families += tuple(
            name for name, value in given.items() if value is not None and name not in self.families
        )
        self.curvature = check_instance("curvature", curvature, CurvatureOptions)
        self.jacobian = check_instance("jacobian", jacobian, JacobianOptions)
        self.ntk = check_instance("ntk", ntk, NTKOptions)
        self.probe_data = check_instance("probe_data", probe_data, ProbeDataOptions)
        self._second_order: SecondOrderProbes | None = None
        self.head_diversity_every_n_logs = check_int(
            "head_diversity_every_n_logs", head_diversity_every_n_logs, smallest=0
        )
        self.weight_spectra_every_n_logs = check_int(
            "weight_spectra_every_n_logs", weight_spectra_every_n_logs, smallest=0
        )
        self.preflight = check_bool("preflight", preflight)
        if preflight_context_length is not None:
            check_int("preflight_context_length", preflight_context_length, smallest=2)
        self.preflight_context_length = preflight_context_length
        self._alerting = Alerting(alerts, on_alert, stop_on, self.families)
        self.token_mask = check_callable(
            "token_mask", token_mask, "a function of the batch returning its token mask"
        )

        self._reports = _Reports(strict)
        self._sinks: list[Sink] = []
        self._attention_capture: AttentionCapture | None = None
        self._residual_capture: ResidualCapture | None = None
        self._output_capture: OutputLogitCapture | None = None
        self._weight_probe: WeightProbe | None = None
        # The checkpoint state of a stateful part (by its key) while the part does not exist: loaded before
        # on_fit_start makes it, or kept after teardown for a checkpoint or the next fit.
        self._parked_states: dict[str, dict[str, Any]] = {}
        self._krylov_states: dict[str, KrylovState] = {}
        self._previous_max_logit: dict[str, float] = {}
        self._attention_images = _AttentionImages()
        # The layout of the last step's tags: steps mostly write the same tags, and deriving it took ~3 ms.
        self._layout_of_tags: tuple[frozenset[str], Layout] = (frozenset(), {})
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
        if self.preflight:
            with self._reports.failures_of("the architecture preflight"):
                self._run_preflight(trainer, pl_module)
        captures = [family for family in ("attention", "tokens") if family in self.families]
        compiled = compiled_attention_regions(pl_module) if captures else []
        if compiled:
            self._reports.once("compiled", _uncaptured_under_compile(compiled, captures))
        if "attention" in self.families and not compiled:
            self._attention_capture = AttentionCapture(
                pl_module,
                max_sequences=self.max_sequences,
                max_bytes=int(self.memory_budget_mb * 2**20),
                strict=self.strict,
            )
        if "tokens" in self.families and not compiled:
            with self._reports.failures_of("finding the transformer blocks (tokens family)"):
                self._residual_capture = ResidualCapture(
                    pl_module, max_sequences=self.max_sequences, strict=self.strict
                )
        if self.output_logits is not False:
            with self._reports.failures_of("finding the LM head (output_logits)"):
                head = self.output_logits if isinstance(self.output_logits, str) else None
                self._output_capture = OutputLogitCapture(pl_module, head, self.max_sequences)
        if "weights" in self.families:
            self._weight_probe = WeightProbe(
                pl_module, include=self.include, exclude=self.exclude, per_head=self.per_head
            )
        if any(family in self.families for family in OPT_IN_FAMILIES):
            self._second_order = SecondOrderProbes(
                trainer.strategy.model,
                self.families,
                self.curvature,
                self.jacobian,
                self.ntk,
                self.probe_data,
                self._reports.failures_of,
            )
        for key, part in self._stateful_parts().items():
            if part is not None and key in self._parked_states:
                part.load_state_dict(self._parked_states.pop(key))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._abandon_step()  # a batch whose end hook never ran (its module hook returned -1)
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        self._reports.step = step
        probed = _LoggingStep(step, False)
        if self._second_order is not None:
            event = self._second_order.on_train_batch_start(trainer, pl_module, batch, batch_idx, step)
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
                self._evaluate_alerts(trainer, probed)
                self._write(probed)
            return
        self._last_logged_step = step
        costly = self._figures_due()
        progress = _LoggingStep(step, draw_figures=costly and self._kept(Capability.FIGURES))
        progress.measurements += probed.measurements  # judged and written with the rest of this step
        progress.figures += probed.figures
        self._in_progress = progress
        if self._weight_probe is not None:
            # Every rank enters: gathering FSDP shards is a collective (spectral_monitor.distributed).
            with (
                self._reports.failures_of("measuring the weights"),
                torch.no_grad(),
                full_parameters(trainer.strategy.model),
            ):
                progress.measurements += self._checked_weights(self._weight_probe.measure(step))
                if self.histograms and self._kept(Capability.HISTOGRAMS):
                    progress.distributions += self._weight_probe.distributions(step, full_spectrum=costly)
            if _due(self.weight_spectra_every_n_logs, self._logging_steps_done):
                with self._reports.failures_of("measuring the weight spectra"), torch.no_grad():
                    self._measure_weight_spectra(progress, pl_module)
        token_mask = None
        if self.token_mask is not None:
            with self._reports.failures_of("reading the batch's token mask (token_mask)"):
                token_mask = checked_token_mask(self.token_mask(batch), "the token_mask function's result")
        if self._attention_capture is not None:
            with self._reports.failures_of("arming the attention capture"):
                self._attention_capture.arm(token_mask)
        if self._residual_capture is not None:
            with self._reports.failures_of("arming the residual-stream capture"):
                self._residual_capture.arm(token_mask)
        if self._output_capture is not None:
            with self._reports.failures_of("arming the output-logit capture"):
                self._output_capture.arm(token_mask)

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
            if progress.outputs is not None:
                with self._reports.failures_of("computing the output-logit metrics"):
                    progress.measurements += _output_logit_measurements(progress.step, progress.outputs)
        # The recordings are not kept past this step.
        progress.attention = progress.residual = progress.outputs = None
        self._evaluate_alerts(trainer, progress)
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
        for sink in self._sinks:
            with self._reports.failures_of(f"closing {type(sink).__name__}"):
                sink.close()
        self._reports.end_of_run(self._sinks)
        # The weight probe's warm vectors, and the opt-in probes' batch and warm vectors, stay.
        for key, part in self._stateful_parts().items():
            if part is not None:
                self._parked_states[key] = part.state_dict()
        if "second_order" in self._parked_states:
            # The last step tells a step's micro-batches apart within a fit; a next fit's steps are its own.
            self._parked_states["second_order"].pop("last_step", None)
        self._attention_capture = self._residual_capture = self._weight_probe = self._second_order = None
        self._output_capture = None
        self._sinks = []  # the attention warm vectors stay too: small, and a checkpoint after fit keeps them
        self._attention_images = _AttentionImages()  # kept figures hold canvases: not past a fit

    def state_dict(self) -> dict[str, Any]:
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
            "alerts": self._alerting.engine.state_dict(),
            "previous_max_logit": dict(self._previous_max_logit),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_logged_step = state_dict.get("last_logged_step", -1)
        self._logging_steps_done = state_dict.get("logging_steps_done", 0)
        self._krylov_states = {
            layer: KrylovState(vectors.detach().clone())
            for layer, vectors in state_dict.get("attention_krylov_vectors", {}).items()
        }
        self._alerting.engine.load_state_dict(state_dict.get("alerts", {}))
        self._previous_max_logit = dict(state_dict.get("previous_max_logit", {}))
        for key, part in self._stateful_parts().items():
            state = state_dict.get(key)
            if state is None:
                continue
            if part is None:
                self._parked_states[key] = state  # loaded when on_fit_start makes the part
            else:
                part.load_state_dict(state)

    def _stateful_parts(self) -> dict[str, WeightProbe | SecondOrderProbes | None]:
        """The parts with checkpoint state of their own, by their key in :meth:`state_dict`."""
        return {"weight_probe": self._weight_probe, "second_order": self._second_order}

    def _evaluate_alerts(self, trainer: pl.Trainer, progress: _LoggingStep) -> None:
        alerts = AlertStep()
        with self._reports.failures_of("evaluating the alerts"):
            records = [*progress.measurements, *progress.read_only]
            alerts = self._alerting.evaluate(progress.step, records, trainer.is_global_zero)
        # Outside the failure guard: every rank must enter the collective.
        self._alerting.stop_if_asked(trainer, progress.step, alerts.stop)
        progress.measurements += alerts.records
        progress.alert_text = alerts.text

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

    def _abandon_step(self) -> None:
        for capture in (self._attention_capture, self._residual_capture, self._output_capture):
            if capture is not None and capture.is_armed:
                capture.disarm()
        self._in_progress = None

    def _measure_attention(self, progress: _LoggingStep) -> None:
        recording = progress.attention
        write_histograms = self.histograms and self._kept(Capability.HISTOGRAMS)
        diversity_due = _due(self.head_diversity_every_n_logs, self._logging_steps_done)
        # What the capture holds stays alive throughout; the rest of the budget is the working memory.
        room = int(self.memory_budget_mb * 2**20) - sum(
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
            if self.per_head:
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
            drawn = _DrawnHead.of(captured.layer, layer, per_head)
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

    def _measure_weight_spectra(self, progress: _LoggingStep, pl_module: pl.LightningModule) -> None:
        spectra = weight_spectra(pl_module, include=self.include, exclude=self.exclude)
        progress.measurements += weight_spectrum_measurements(spectra, progress.step)
        if self._kept(Capability.FIGURES):
            progress.figures += [
                (f"weights/figures/esd/{spectrum.layer}", lambda spectrum=spectrum: esd_figure(spectrum))
                for spectrum in spectra
            ]

    def _run_preflight(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        context = self.preflight_context_length
        if context is None:
            seq_len = getattr(pl_module, "hparams", {}).get("seq_len")
            context = seq_len if isinstance(seq_len, int) and seq_len >= 2 else None
        findings = architecture_preflight(pl_module, context_length=context)
        for finding in findings:
            if finding.severity == "warning":
                rank_zero_warn(
                    f"SpectralMonitor preflight ({finding.check}, {finding.where}): {finding.message}.",
                    category=RuntimeWarning,
                )
        for sink in self._sinks:
            with self._reports.failures_of(f"writing the preflight to {type(sink).__name__}"):
                sink.write_text("preflight", preflight_markdown(findings), trainer.global_step)

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
            exact = uses_exact_path(n, m, self.metric_method)
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
            method=self.metric_method,
            include_rank_sums=self.attention_rank_sums,
            state=state,
        )
        if all(sample.max_logit is not None for sample in samples):
            metrics["max_logit"] = torch.cat([sample.max_logit for sample in samples])
        call = _DenseCall(metrics, None, [None] * len(parts))
        if not (diversity or draw):
            return call
        left = room - probs.numel() * probs.element_size() - DENSE_CALL_NBYTES
        dtype = next(
            (dtype for dtype in SPECTRUM_DTYPES if spectrum_working_nbytes(n, m, dtype) <= left), None
        )
        if dtype is None:
            self._reports.once(
                "spectra over budget",
                f"the memory budget ({self.memory_budget_mb:g} MB) leaves no room for the singular values of "
                f"{first.layer}'s {n}×{m} attention; it is left out of head diversity and the figures",
            )
            return call
        if diversity:
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
        method = self.metric_method
        if exact and not captured.measured_blockwise():
            method = "krylov"
            self._reports.once(
                "exact over budget",
                f"the memory budget ({self.memory_budget_mb:g} MB) is too small for the exact measurement "
                f"of one of {captured.layer}'s attention matrices "
                f"({captured.dense_matrix_nbytes(True) / 2**20:.0f} MiB); it is measured on the Krylov path "
                "from q and k",
            )
        return _LayerAttention(
            captured.blockwise_metrics(
                method=method,
                max_bytes=max(room, 2**20),
                include_rank_sums=self.attention_rank_sums,
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
        names = [name for name, _ in unwrapped_named_modules(model) if name]
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
    outputs: OutputLogitSample | None = None
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


@dataclass
class _DrawnHead:
    """What the figures need of one layer, kept after its attention probabilities are dropped."""

    layer: str
    blocks: AttentionBlocks  # head _FIGURE_HEAD of the first sequence, as its heatmap draws it
    singular_values: np.ndarray  # of the attention restricted to real queries and attendable keys
    head_values: dict[str, np.ndarray]  # (heads,) of each HEATMAP_METRICS member the layer has

    @classmethod
    def of(cls, layer: str, attention: _LayerAttention, per_head: dict[str, Tensor]) -> _DrawnHead | None:
        """The drawn head of a layer; None where it was not drawn (``_drawn_attention``)."""
        if attention.drawn is None:
            return None
        return cls(
            layer=layer,
            blocks=attention.drawn.blocks,
            singular_values=attention.drawn.singular_values,
            head_values={
                metric: per_head[metric].numpy() for metric in HEATMAP_METRICS if metric in per_head
            },
        )


class _AttentionImages:
    """The attention figures, kept from one figure step to the next and redrawn with each one's data
    (:class:`~spectral_monitor.sinks.figures.RedrawnFigure`: ~30 ms a figure instead of ~200 ms)."""

    def __init__(self) -> None:
        self.spectrum = SpectrumImages()
        # By the drawn matrix's shape, for the shapes of the last figure step: layers of one shape share a
        # figure (a new heatmap figure costs ~120 ms, a redraw ~30 ms), and padded batches whose shapes
        # change from step to step cannot pile figures up.
        self.heatmaps: dict[tuple[int, ...], AttentionHeatmapImages] = {}
        self.layer_head = {metric: LayerHeadHeatmapImages() for metric in HEATMAP_METRICS}

    def drawn(self, heads: list[_DrawnHead]) -> list[tuple[str, Callable[[], np.ndarray]]]:
        """(tag, draw) of each attention image; drawing is deferred to the sinks that keep figures."""
        images: list[tuple[str, Callable[[], np.ndarray]]] = [
            (
                "attention/figures/spectrum",
                lambda: self.spectrum.image(
                    {head.layer: head.singular_values for head in heads},
                    f"attention singular values, head {_FIGURE_HEAD} of sequence 0",
                ),
            )
        ]
        drawn_heads = heads[:1] + heads[1:][-1:]  # the first and the last layer
        kept: dict[tuple[int, ...], AttentionHeatmapImages] = {}
        for head in drawn_heads:
            shape = head.blocks.shape
            kept[shape] = kept.get(shape) or self.heatmaps.get(shape) or AttentionHeatmapImages()
        self.heatmaps = kept
        for head in drawn_heads:
            heatmap = self.heatmaps[head.blocks.shape]
            images.append(
                (
                    f"attention/figures/heatmap/{head.layer}",
                    lambda head=head, heatmap=heatmap: heatmap.image_of_blocks(
                        head.blocks, f"{head.layer}, head {_FIGURE_HEAD}"
                    ),
                )
            )
        for metric, kept_figure in self.layer_head.items():
            measured = [head for head in heads if metric in head.head_values]
            if not measured:
                continue
            grid = np.full((len(measured), max(head.head_values[metric].size for head in measured)), np.nan)
            for row, head in enumerate(measured):
                grid[row, : head.head_values[metric].size] = head.head_values[metric]
            images.append(
                (
                    f"attention/figures/{metric}",
                    lambda grid=grid, measured=measured, metric=metric, kept_figure=kept_figure: (
                        kept_figure.image(
                            grid,
                            [head.layer for head in measured],
                            _HEATMAP_TITLES.get(metric, metric),
                            vmin=0.0,
                            vmax=1.0,
                        )
                    ),
                )
            )
        return images


def _uncaptured_under_compile(compiled: list[str], lost: list[str]) -> str:
    """The one warning for a model whose attention runs inside torch.compile graphs."""
    names = ", ".join(name or "the whole model" for name in compiled)
    return (
        f"{names} run{'s' if len(compiled) == 1 else ''} as torch.compile graphs with attention inside, so "
        f"{' and '.join(lost)} are not captured: arming the capture's hooks in a "
        "compiled graph recompiles it on every logging step (about 10 s each for a 2-layer model on a CPU). "
        "Weights are measured. To see attention and tokens, compile only modules without attention "
        "(e.g. `block.mlp = torch.compile(block.mlp)` for each block) or train this run uncompiled"
    )


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


class _Reports:
    """Reports each kind of problem once; with ``strict`` failures and problems raise instead.

    Every failure is also kept, by what failed and the step it failed at (``step``, set by the callback), for
    the end-of-run report.
    """

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.step = 0
        self.failed_steps: dict[str, list[int]] = {}
        self._reported: set[str] = set()

    def once(self, kind: str, message: str) -> None:
        if kind not in self._reported:
            self._reported.add(kind)
            rank_zero_warn(f"SpectralMonitor: {message}.", category=RuntimeWarning)

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
            rank_zero_warn(
                "SpectralMonitor: end of the run; lost to failures: " + "; ".join(lines) + ".",
                category=RuntimeWarning,
            )
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


def _due(every_n_logs: int, logging_steps_done: int) -> bool:
    """Whether a cadence of every k-th logging step (0: never), starting with the first, falls now."""
    return every_n_logs > 0 and logging_steps_done % every_n_logs == 0


def _sinks_of(loggers: Sequence[pl.loggers.Logger]) -> list[Sink]:
    """A sink per logger; a TensorBoard logger's run directory gets the monitor's own event file."""
    return [
        TensorBoardSink(logger.log_dir) if _is_tensorboard(logger) else LoggerSink(logger)
        for logger in loggers
    ]


def _is_tensorboard(logger: object) -> bool:
    # By name too: lightning.pytorch's TensorBoardLogger is the same class under the other namespace.
    return isinstance(logger, TensorBoardLogger) or type(logger).__name__ == "TensorBoardLogger"


def _concatenated(masks: list[Tensor | None]) -> Tensor | None:
    """The layers' masks as one, for measuring the layers in one call (all given or all None)."""
    return None if masks[0] is None else torch.cat(masks)


def _per_head(mask: Tensor | None, heads: int) -> Tensor | None:
    """A per-sequence (S, L) mask broadcast to (S, heads, L), the batch shape of the metrics' input."""
    return None if mask is None else mask[:, None, :].expand(-1, heads, -1)


def _any_match(names: Sequence[str], patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in patterns)

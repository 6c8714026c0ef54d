"""The Lightning callback: :class:`SpectralMonitor`, an adapter of Lightning's hooks to the framework-free
:class:`~spectral_monitor.core.MonitorSession`, which measures, judges and writes.

The callback turns the trainer's loggers into sinks, gives the session Lightning's step axis and its
training forward, and stops the trainer when the session says so. A logging step s is
``trainer.fit_loop.epoch_loop._batches_that_stepped`` when its batch starts: the step under which Lightning
files what ``self.log`` recorded for the same batch (``trainer.global_step`` has already advanced by
``on_train_batch_end``). Its hooks:

- ``on_train_batch_start``: ``begin_step`` (the weights measured, the captures armed; the second-order
  probes on their own cadence, with the LightningModule's ``training_step`` as their default loss and the
  first optimizer for the edge of stability);
- ``on_before_backward``: ``end_forward``, so the backward (and any activation recomputation) runs
  unobserved;
- ``on_train_batch_end``: ``end_step`` (metrics, alerts, records written); a ``stop_on`` rule that fired on
  any rank sets ``trainer.should_stop``;
- ``teardown``: ``close`` (sinks closed, the end-of-run report).

Every rank calls the session; global rank 0 alone writes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from spectral_monitor.alerts import AlertConfig, AlertEvent
from spectral_monitor.core import MonitorOptions, MonitorSession, outputs_not_kept
from spectral_monitor.core.second_order import CurvatureOptions, JacobianOptions, NTKOptions, ProbeDataOptions
from spectral_monitor.lightning.losses import lightning_module_loss
from spectral_monitor.lightning.namespaces import (
    CALLBACK_BASES,
    MisconfigurationException,
    TensorBoardLogger,
    pl,
    rank_zero_warn,
)
from spectral_monitor.sinks import LoggerSink, Sink, TensorBoardSink

if sys.version_info >= (3, 12):
    from typing import override
else:
    from typing_extensions import override

__all__ = ["SpectralMonitor"]

_OPTION_NAMES = frozenset(MonitorOptions.__dataclass_fields__)


class SpectralMonitor(*CALLBACK_BASES):
    """Measures attention, residual-stream and weight spectra on logging steps and writes them to loggers.

    Add it to a Trainer with a logger; a ``TensorBoardLogger`` receives everything, any other Lightning logger
    the scalars only::

        trainer = pl.Trainer(callbacks=[SpectralMonitor()], logger=TensorBoardLogger("runs"))

    It is a callback of ``pytorch_lightning`` and of ``lightning.pytorch``, Trainer and ``LightningCLI`` alike
    (it derives from the ``Callback`` of each installed namespace: ``spectral_monitor.lightning.namespaces``).

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
      call of ``on_alert``, and the markdown table of open alerts is written as text (``alerts/table``,
      also on the first logging step, so a healthy run says "No open alerts"); ``alerts/open/<rule>`` and
      ``alerts/fired/<rule>`` count them on every logging step, for the rules whose families are measured.
    - opt-in, each on its own cadence (``spectral_monitor.core.second_order``): ``curvature/<metric>/model``
      (sharpness against the optimizer's edge of stability, top Hessian eigenvalues, trace, density figure),
      ``jacobian/<metric>/<block>`` (block Jacobian norms), ``ntk/<metric>/model`` (empirical NTK), with
      ``<family>/overhead_ms/model`` and ``overhead_percent`` (of the last training step).

    Metrics a layer does not define (``eigen_gap`` of causal attention) are not written for it.

    Args:
        every_n_steps: measure when ``(step + 1) % every_n_steps == 0``, Lightning's own ``log_every_n_steps``
            rule, so with equal values both land on the same steps.
        families: which of ``"attention"``, ``"tokens"``, ``"weights"`` to measure (empty: none of them,
            where an opt-in probe's options are given). None: the preset's (standard: all three). The
            opt-in ``"curvature"``, ``"jacobian"`` and ``"ntk"`` are turned on by their options objects
            alone (``curvature=CurvatureOptions()``); naming one here is refused.
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
            12-head model writes 27 attention scalars per layer rather than 195; the alert rules read
            every head either way, and the attention histograms and layer × head images show them. None:
            the preset's (on only in ``"full"``).
        histograms: write histograms of per-head values and of weight singular values. None: the preset's
            (off only in ``"light"``).
        figures_every_n_logs: on every k-th logging step, starting with the first, draw the figures and write
            histograms of each weight's singular values (a full SVD of every weight); 0: never; None: the
            preset's (0 in ``"light"``, else 10). Every 10th (every 500 steps at the default cadence)
            writes as many images as TensorBoard shows: it keeps 10 per tag unless started with
            ``--samples_per_plugin images=N``. The figures are kept
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
            None: the preset's (``CurvatureOptions()`` in ``"full"``, else off).
        jacobian: options of the block-Jacobian probe (:class:`JacobianOptions`); giving them turns it on.
        ntk: options of the empirical-NTK probe (:class:`NTKOptions`); giving them turns it on.
        probe_data: the batch and loss those three probes use (:class:`ProbeDataOptions`).
        head_diversity_every_n_logs: on every k-th logging step, starting with the first, write
            ``attention/head_diversity/<layer>`` (mean Jensen–Shannon distance between the heads' normalised
            attention spectra, :mod:`spectral_monitor.metrics.heads`), ``head_diversity_min`` (the closest
            pair) and a text entry ``attention/redundant_heads`` listing each layer's closest head pairs
            (one ``svdvals`` per sampled head); 0: never; None: the preset's (0 in ``"light"``, 4 in
            ``"standard"``, 1 in ``"full"``).
        weight_spectra_every_n_logs: on every k-th logging step, starting with the first, a full SVD of every
            weight: ``weights/<metric>/<weight>`` for ``mp_edge``, ``mp_spikes``, ``alpha`` (power-law tail
            exponent of σ², WeightWatcher's convention), ``alpha_ks_distance``, ``energy_rank_90`` and
            ``energy_rank_99`` (compressible rank), and ESD-against-Marchenko–Pastur figures
            ``weights/figures/esd/<weight>``, with the "weights" family on; 0: never; None: the preset's (10
            in ``"full"``, else 0).
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
        preset: what the arguments left at None default to (``spectral_monitor.core.options.PRESETS``):
            ``"light"`` (attention and weight scalars: no tokens, histograms, figures or head diversity),
            ``"standard"`` (the defaults above), or ``"full"`` (also per-head scalars, head diversity on every
            logging step, weight spectra every 10th and the loss-Hessian probe). An argument given explicitly
            overrides it.

    Raises:
        ValueError: if an argument is out of range (the message names it).
        MisconfigurationException: at ``setup`` if the Trainer has no logger.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        families: Sequence[str] | None = None,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        max_sequences: int = 2,
        memory_budget_mb: float = 256.0,
        per_head: bool | None = None,
        histograms: bool | None = None,
        figures_every_n_logs: int | None = None,
        metric_method: str = "auto",
        attention_rank_sums: bool = True,
        strict: bool = False,
        log_first_step: bool = True,
        curvature: CurvatureOptions | None = None,
        jacobian: JacobianOptions | None = None,
        ntk: NTKOptions | None = None,
        probe_data: ProbeDataOptions | None = None,
        head_diversity_every_n_logs: int | None = None,
        weight_spectra_every_n_logs: int | None = None,
        preflight: bool = True,
        preflight_context_length: int | None = None,
        alerts: AlertConfig | None = None,
        on_alert: Callable[[AlertEvent], Any] | None = None,
        stop_on: Sequence[str] = (),
        token_mask: Callable[[Any], Tensor | None] | None = None,
        output_logits: bool | str = False,
        preset: str = "standard",
    ) -> None:
        super().__init__()
        self.options = MonitorOptions(
            every_n_steps=every_n_steps,
            families=families,
            include=include,
            exclude=exclude,
            max_sequences=max_sequences,
            memory_budget_mb=memory_budget_mb,
            per_head=per_head,
            histograms=histograms,
            figures_every_n_logs=figures_every_n_logs,
            metric_method=metric_method,
            attention_rank_sums=attention_rank_sums,
            strict=strict,
            log_first_step=log_first_step,
            curvature=curvature,
            jacobian=jacobian,
            ntk=ntk,
            probe_data=probe_data,
            head_diversity_every_n_logs=head_diversity_every_n_logs,
            weight_spectra_every_n_logs=weight_spectra_every_n_logs,
            preflight=preflight,
            preflight_context_length=preflight_context_length,
            alerts=alerts,
            on_alert=on_alert,
            stop_on=stop_on,
            token_mask=token_mask,
            output_logits=output_logits,
            preset=preset,
        )
        self._session = MonitorSession(self.options)
        self._alerting = self._session.alerting
        self._sinks: list[Sink] = []

    def __getattr__(self, name: str) -> Any:
        # The options read as the callback's own attributes (monitor.every_n_steps), as given validated.
        options = self.__dict__.get("options")
        if options is not None and name in _OPTION_NAMES:
            return getattr(options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            every_n_steps=self.options.every_n_steps,
            families=list(self.options.families),
            include=self.options.include,
            exclude=self.options.exclude,
        )

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers:
            raise MisconfigurationException(
                "SpectralMonitor needs a logger to write to, but the Trainer has none (logger=False): "
                "pass logger=TensorBoardLogger(save_dir) for everything, or any Lightning logger for scalars."
            )
        self._sinks = _sinks_of(trainer.loggers) if trainer.is_global_zero else []
        dropped = outputs_not_kept(self.options, self._sinks)
        if trainer.is_global_zero and dropped:
            names = ", ".join(type(logger).__name__ for logger in trainer.loggers)
            rank_zero_warn(
                f"SpectralMonitor: {names} keeps scalars only; {', '.join(dropped)} need a TensorBoardLogger "
                "and are skipped.",
                category=RuntimeWarning,
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Here rather than in `setup`: `configure_model` has built every layer and the strategy has moved it.
        self._session.start(
            pl_module,
            self._sinks,
            writes=trainer.is_global_zero,
            training_root=trainer.strategy.model,
            default_loss=lightning_module_loss,
            request_stop=lambda: setattr(trainer, "should_stop", True),
            step=trainer.global_step,
        )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self._session.begin_step(step, batch, optimizer=optimizer)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._session.end_forward()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._session.end_step()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._session.abandon()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._session.close()
        self._sinks = []

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._session.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._session.load_state_dict(state_dict)


def _sinks_of(loggers: Sequence[pl.loggers.Logger]) -> list[Sink]:
    """A sink per logger; a TensorBoard logger's run directory gets the monitor's own event file."""
    return [
        TensorBoardSink(logger.log_dir) if _is_tensorboard(logger) else LoggerSink(logger)
        for logger in loggers
    ]


def _is_tensorboard(logger: object) -> bool:
    # By name too: lightning.pytorch's TensorBoardLogger is the same class under the other namespace.
    return isinstance(logger, TensorBoardLogger) or type(logger).__name__ == "TensorBoardLogger"

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
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from spectral_monitor.core import MonitorOptions, MonitorSession, outputs_not_kept
from spectral_monitor.core.options import KEYWORD_GROUPS, options_of
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

    Its options are :class:`~spectral_monitor.core.MonitorOptions`, where each is documented: given whole,
    or as flat keywords (each a field of the options or of their groups), which
    :meth:`~spectral_monitor.core.MonitorOptions.from_keywords` maps onto them::

        SpectralMonitor(every_n_steps=10, families=["attention"], per_head=True)
        SpectralMonitor(options=MonitorOptions(every_n_steps=10, outputs=OutputOptions(per_head=True)))

    Under ``LightningCLI`` the options are a nested mapping (``configs/demo.yaml``)::

        callbacks:
          - class_path: spectral_monitor.SpectralMonitor
            init_args:
              options:
                every_n_steps: 25
                outputs: {figures_every_n_logs: 0}

    Args:
        options: the monitor's options; None: their defaults, or those the keywords give.
        **keywords: options as flat keywords (``every_n_steps=10``, ``max_sequences=1``,
            ``preset="light"``), when ``options`` is not given.

    Raises:
        ValueError: if an option is unknown or out of range (the message names it and what is allowed).
        MisconfigurationException: at ``setup`` if the Trainer has no logger.

    Examples:
        The options read as the callback's own attributes, as validated:

        >>> monitor = SpectralMonitor(every_n_steps=10, per_head=True)
        >>> monitor.every_n_steps, monitor.per_head, monitor.options.outputs.per_head
        (10, True, True)
        >>> all(isinstance(monitor, base) for base in CALLBACK_BASES)
        True
    """

    def __init__(self, options: MonitorOptions | None = None, **keywords: Any) -> None:
        super().__init__()
        self.options = options_of(options, keywords, owner="SpectralMonitor")
        self._session = MonitorSession(self.options)
        self._alerting = self._session.alerting
        self._sinks: list[Sink] = []

    def __getattr__(self, name: str) -> Any:
        # The options read as the callback's own attributes (monitor.max_sequences), as given validated.
        options = self.__dict__.get("options")
        if options is not None and name in KEYWORD_GROUPS:
            return options.keyword_value(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    @override
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint: the class name and the options that decide what
        the state holds (cadence, families, capture patterns), so two monitors of one Trainer keep apart."""
        return self._generate_state_key(
            every_n_steps=self.options.every_n_steps,
            families=list(self.options.families),
            include=self.options.capture.include,
            exclude=self.options.capture.exclude,
        )

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """For ``fit``: a sink per logger on global rank 0, with one warning naming the outputs that the
        loggers cannot keep (a logger other than ``TensorBoardLogger`` keeps scalars only).

        Args:
            trainer: The Trainer, whose loggers become the sinks.
            pl_module: The LightningModule, unused here (measured from ``on_fit_start``).
            stage: The Trainer's stage; anything but ``"fit"`` is ignored.

        Raises:
            MisconfigurationException: The Trainer has no logger (``logger=False``).
        """
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
        """Starts the session on ``pl_module``: its layers found, its training step the default loss of the
        second-order probes; global rank 0 writes.

        Args:
            trainer: The Trainer: its strategy's model (the outermost wrapper, for FSDP gathering) and its
                ``should_stop``.
            pl_module: The LightningModule, whose attention, residual stream and weights are measured.
        """
        # Here rather than in `setup`: `configure_model` has built every layer and the strategy has moved it.
        self._session.start(
            pl_module,
            self._sinks,
            writes=trainer.is_global_zero,
            training_root=trainer.strategy.model,
            default_loss=lightning_module_loss,
            request_stop=lambda: setattr(trainer, "should_stop", True),
        )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """``begin_step`` on the logging step of the batch: weights measured and captures armed when the
        cadence says so, the second-order probes on their own cadence.

        Args:
            trainer: The Trainer: the step axis (module docstring) and its first optimizer.
            pl_module: The LightningModule, unused here.
            batch: The batch, the probe batch of the second-order probes.
            batch_idx: Its index in the epoch, unused (the step axis counts across epochs).
        """
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self._session.begin_step(step, batch, optimizer=optimizer)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """``end_forward``: the captures stop, so the backward (and any recomputation) runs unobserved.

        Args:
            trainer: The Trainer, unused.
            pl_module: The LightningModule, unused.
            loss: The training loss, unused.
        """
        self._session.end_forward()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """``end_step``: metrics, alerts and records written; a ``stop_on`` rule that fired on any rank sets
        ``trainer.should_stop``.

        Args:
            trainer: The Trainer, unused (stopping goes through the callback given at ``on_fit_start``).
            pl_module: The LightningModule, unused.
            outputs: What ``training_step`` returned, unused.
            batch: The batch, unused.
            batch_idx: Its index in the epoch, unused.
        """
        self._session.end_step()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """``abandon``: the step in progress is dropped (captures disarmed, recordings discarded, nothing
        written), so a failed run leaves no hook on the model.

        Args:
            trainer: The Trainer, unused.
            pl_module: The LightningModule, unused.
            exception: What interrupted the run, unused (Lightning raises it again).
        """
        self._session.abandon()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """For ``fit``: ``close`` (sinks closed; one warning listing what failed or could not be written).

        Args:
            trainer: The Trainer, unused.
            pl_module: The LightningModule, unused.
            stage: The Trainer's stage; anything but ``"fit"`` is ignored.
        """
        if stage != "fit":
            return
        self._session.close()
        self._sinks = []

    @override
    def state_dict(self) -> dict[str, Any]:
        """The monitor's state, saved with each checkpoint under :attr:`state_key`.

        Returns:
            The session's state (warm iterative vectors, alert streams, cadence counters).
        """
        return self._session.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output when a fit resumes from a checkpoint.

        Args:
            state_dict: What :meth:`state_dict` returned.
        """
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

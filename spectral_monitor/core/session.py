"""The framework-free core of the monitor: one training run's logging-step pipeline, :class:`MonitorSession`.

An integration (the Lightning callback :class:`~spectral_monitor.SpectralMonitor`, a Hugging Face callback,
a plain loop) tells the session where the run is; the session does the rest. On a logging step it arms the
probes (``spectral_monitor.probes``) around the training forward, turns what they recorded into numbers with
``spectral_monitor.metrics``, evaluates the alerts (``spectral_monitor.alerts``) and hands the records to
the sinks (``spectral_monitor.sinks``) it was given. Between logging steps nothing is installed on the model.

What the caller does on each step is :class:`MonitorSession`'s to say. Every rank measures, so a probe whose
measurement takes part in a collective is entered by all ranks (``spectral_monitor.distributed``); the
writing rank (global rank 0) alone writes, warns and calls ``on_alert``. A compiled model is never armed
during the training forward: a probe forward measures it (:mod:`spectral_monitor.core.compiled`).

What each kind of measurement does is its probe family's (:mod:`spectral_monitor.core.families`): the
session keeps a list of them and calls the same hooks on each as a step goes by; the attention's memory
planning is :mod:`spectral_monitor.core.attention_plan`'s, writing :mod:`spectral_monitor.core.writing`'s and
failure reporting :mod:`spectral_monitor.core.reports`'. Nothing here imports a training framework.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import nn

from spectral_monitor.checkpoint_entries import StateEntries
from spectral_monitor.core.alerting import Alerting, AlertStep
from spectral_monitor.core.attention_family import HISTOGRAM_METRICS, AttentionFamily
from spectral_monitor.core.attention_plan import HEATMAP_METRICS
from spectral_monitor.core.compiled import CompiledForwards
from spectral_monitor.core.families import (
    LoggingStep,
    OutputLogitFamily,
    PreflightFamily,
    Run,
    SecondOrderFamily,
    TokenFamily,
    WeightFamily,
    warn_of_unmatched_patterns,
)
from spectral_monitor.core.options import MonitorOptions
from spectral_monitor.core.reports import Reports, kept_by, outputs_not_kept, warn_of_dropped_entries
from spectral_monitor.core.schedule import Cadence
from spectral_monitor.core.second_order import LossFn
from spectral_monitor.core.writing import StepWriter
from spectral_monitor.probes.token_masks import checked_token_mask
from spectral_monitor.probes.wrappers import forward_on_batch, probe_forward
from spectral_monitor.sinks import Capability, Sink

__all__ = ["HEATMAP_METRICS", "HISTOGRAM_METRICS", "MonitorSession", "outputs_not_kept"]

_FAMILIES = (
    PreflightFamily,
    SecondOrderFamily,
    WeightFamily,
    AttentionFamily,
    TokenFamily,
    OutputLogitFamily,
)
"""Every probe family, in the order a run meets them: the preflight at its start, the second-order probes
first in a step (their cadence is their own), the weights before the forward, then the captures."""


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

    Args:
        options: the run's options, validated.

    Raises:
        ValueError: a ``stop_on`` rule that cannot fire with the families on.

    Examples:
        >>> from spectral_monitor.core import MonitorOptions, MonitorSession
        >>> session = MonitorSession(MonitorOptions(families=["weights"], preflight=False))
        >>> model = torch.nn.Linear(4, 4)
        >>> session.start(model, sinks=[])
        >>> session.begin_step(0, batch=None)
        True
        >>> session.end_step()
        []
        >>> session.close()
    """

    def __init__(self, options: MonitorOptions) -> None:
        self.options = options
        self.alerting = Alerting(options.alerts, options.on_alert, options.stop_on, options.families)
        self._reports = Reports(options.strict)
        self._families = [family(options, self._reports) for family in _FAMILIES]
        self._writer = StepWriter(self._reports)
        self._logging_cadence = Cadence.of_steps(options.every_n_steps, first_step=options.log_first_step)
        self._figures_cadence = Cadence.of_logs(options.outputs.figures_every_n_logs)
        self._sinks: list[Sink] = []
        self._model: nn.Module | None = None
        self._request_stop: Callable[[], None] = _no_stop
        self._disarm_after_forward = False
        self._step_offset = 0
        self._forward_return_hook: torch.utils.hooks.RemovableHandle | None = None
        self._compiled = CompiledForwards()
        self._in_progress: LoggingStep | None = None
        self._last_logged_step = -1
        self._logged_before = -1
        self._texts_due: list[tuple[str, str]] = []  # the preflight's, until the first step begins
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
            step_offset: how far the caller's steps run ahead of the optimizer steps taken before their
                batch, which the cadences count: 0 where a framework files a batch's scalars before its
                update (Lightning), 1 where it files them after it (Hugging Face's ``global_step``). With
                either, ``every_n_steps`` equal to the framework's logging interval measures the batches
                whose scalars the framework logs, on the same steps.
        """
        self._model = model
        self._sinks = list(sinks)
        self._reports.writes = writes
        self._request_stop = request_stop or _no_stop
        self._disarm_after_forward = disarm_after_forward
        self._step_offset = step_offset
        self.alerting.stopping = False
        warn_of_unmatched_patterns(self.options, self._reports, model)
        self._compiled.start(model, writes=writes)
        run = Run(
            model,
            model if training_root is None else training_root,
            kept=partial(kept_by, self._sinks),
            default_loss=default_loss,
            step_offset=step_offset,
        )
        with _autocast_off():
            for family in self._families:
                family.start(run)
        # Filed under the first step begun: a resumed framework may not know its step before that.
        self._texts_due = list(run.texts)

    def begin_step(self, step: int, batch: Any, *, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Before the training forward of ``step`` on ``batch``: whether it is a logging step.

        The second-order probes measure when their own cadence falls (``optimizer`` gives the curvature's
        edge of stability); their records are judged and written at once off a logging step. The first
        step begun after :meth:`start` files the preflight's text. On a logging
        step the weights are measured and the captures armed, the token mask read from ``batch`` by the
        ``token_mask`` option. Call it on every rank.

        Args:
            step: the caller's step (non-decreasing; repeated for the micro-batches of one optimizer step).
            batch: the step's batch, for the token mask and a compiled model's probe forward.
            optimizer: the training optimizer, or None.

        Returns:
            Whether ``step`` is a logging step (False for a repeated step).

        Raises:
            RuntimeError: called before :meth:`start`.
        """
        self.abandon()  # a step whose end never came
        if self._model is None:
            raise RuntimeError("MonitorSession.begin_step was called before start")
        if self._texts_due:
            self._writer.write_texts(self._sinks, self._texts_due, step)
            self._texts_due = []
        with _autocast_off():
            return self._begin_step(step, batch, optimizer)

    def _begin_step(self, step: int, batch: Any, optimizer: torch.optim.Optimizer | None) -> bool:
        self._reports.step = step
        logging_step = self._is_logging_step(step)
        figures_due = logging_step and self._figures_cadence.due(self._logging_steps_done)
        progress = LoggingStep(
            step,
            logs_done=self._logging_steps_done,
            figures_due=figures_due,
            draw_figures=figures_due and kept_by(self._sinks, Capability.FIGURES),
        )
        for family in self._families:
            family.before_step(progress, batch, optimizer)
        if not logging_step:
            if progress.measurements:  # the opt-in probes' own cadence: their alerts cannot wait
                self._stop_if_asked(self._evaluate_alerts(progress))
                self._writer.write(self._sinks, progress)
            return False
        self._logged_before, self._last_logged_step = self._last_logged_step, step
        self._in_progress = progress
        for family in self._families:
            family.before_forward(progress)
        if self.options.capture.token_mask is not None:
            with self._reports.failures_of("reading the batch's token mask (token_mask)"):
                progress.token_mask = checked_token_mask(
                    self.options.capture.token_mask(batch), "the token_mask function's result"
                )
        progress.batch = batch
        if self._compiled.by_probe_forward:
            return True  # nothing on the model during the training forward: end_forward probes it
        self._arm(progress, every_module=False)
        if any(family.captures for family in self._families):
            self._compiled.watch(self._model)
        if self._disarm_after_forward:
            self._forward_return_hook = self._model.register_forward_hook(self._end_forward_on_return)
        return True

    def end_forward(self) -> None:
        """Disarm the captures, keeping what they recorded: call it after the forward, before the backward.
        A compiled model's probe forward runs here. Nothing happens off a logging step or when already
        disarmed."""
        ran_compiled = self._remove_step_hooks()
        progress = self._in_progress
        if progress is None:
            return
        if ran_compiled:
            self._discard_recordings()  # hooks traced into a compiled graph returned at once: none recorded
        if self._compiled.by_probe_forward and not progress.probed:
            progress.probed = True
            self._run_probe_forward(progress)
        for family in self._families:
            family.disarm()

    def end_step(self) -> list[str]:
        """After the step: metrics from the recordings under ``no_grad``, alerts evaluated, records written,
        recordings dropped. Call it on every rank (stopping is decided in a collective).

        Returns:
            The ``stop_on`` rules that fired on any rank (``request_stop`` has been called); empty off a
            logging step.
        """
        self.end_forward()  # no backward ran (manual optimisation, or no loss)
        progress, self._in_progress = self._in_progress, None
        if progress is None:
            return []
        with _autocast_off():
            with torch.no_grad():
                for family in self._families:
                    family.measure(progress)  # the recordings are not kept past this
            stopping = self._stop_if_asked(self._evaluate_alerts(progress))
            self._writer.write(self._sinks, progress)
        self._logging_steps_done += 1
        return stopping

    @contextmanager
    def failures_of(self, what: str) -> Iterator[None]:
        """Runs an integration's own part of a step (installing a hook, starting a run): a failure drops the
        step in progress and is raised when ``strict``, else reported once, like the session's own, and
        listed in the end-of-run report.

        Args:
            what: what the guarded code does, as the report names it.

        Yields:
            Nothing: the guarded code runs in the ``with`` block.

        Raises:
            Exception: the guarded code's failure, re-raised when ``strict``.
        """
        with self._reports.failures_of(what):
            try:
                yield
            except Exception:
                self.abandon()
                raise

    def abandon(self) -> None:
        """Drop the step in progress, if any: captures disarmed, recordings discarded, nothing written. A
        dropped step was not measured: begun again (a loop retrying it), it is a logging step again."""
        self._remove_step_hooks()
        self._discard_recordings()
        if self._in_progress is not None:
            self._last_logged_step = self._logged_before
        self._in_progress = None

    def close(self) -> None:
        """End the run: sinks closed, and one warning listing what failed and what the sinks could not write
        (the end-of-run report). Warm state stays for a checkpoint or the next :meth:`start`."""
        self.abandon()
        for sink in self._sinks:
            with self._reports.failures_of(f"closing {type(sink).__name__}"):
                sink.close()
        self._reports.end_of_run(self._sinks)
        for family in self._families:
            family.close()
        self._model = None
        self._sinks = []

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to measure, judge and write as this one would have gone on doing.

        Returns:
            The logging steps done, the alert engine's state and each family's entries, by top-level key.
        """
        state: dict[str, Any] = {
            "last_logged_step": self._last_logged_step,
            "logging_steps_done": self._logging_steps_done,
            "alerts": self.alerting.engine.state_dict(),
        }
        for family in self._families:
            state.update(family.state_dict())
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a key it lacks leaves that part as a new run starts it.

        Each entry is checked before it is used (:mod:`spectral_monitor.checkpoint_entries`): one of the wrong
        type, shape or dtype, or holding NaN or inf, is dropped and that part starts cold, with one warning
        naming every entry dropped. A checkpoint never stops the resume, and never raises an alert.

        Args:
            state_dict: what :meth:`state_dict` returned, in this process or in the run being resumed.
        """
        entries = StateEntries(state_dict)
        self._last_logged_step = entries.integer("last_logged_step", -1, smallest=-1)
        self._logging_steps_done = entries.integer("logging_steps_done", 0, smallest=0)
        self.alerting.engine.load_state_dict(entries.nested("alerts"))
        for family in self._families:
            family.load_state_dict(entries)
        warn_of_dropped_entries(entries.dropped)

    def _end_forward_on_return(self, module: nn.Module, args: Any, output: Any) -> None:
        self.end_forward()

    def _remove_step_hooks(self) -> bool:
        """Whether the forward they watched ran compiled (from then on, a probe forward measures)."""
        if self._forward_return_hook is not None:
            self._forward_return_hook.remove()
            self._forward_return_hook = None
        return self._compiled.unwatch(writes=self._reports.writes)

    def _arm(self, progress: LoggingStep, *, every_module: bool) -> None:
        for family in self._families:
            family.arm(progress.token_mask, every_module=every_module)

    def _discard_recordings(self) -> None:
        for family in self._families:
            family.discard()

    def _run_probe_forward(self, progress: LoggingStep) -> None:
        """The captures armed around a forward of the model on the step's batch that the run does not see
        (``spectral_monitor.probes.wrappers.probe_forward``); end_forward disarms them."""
        with self._reports.failures_of("the probe forward of the compiled model"), probe_forward(self._model):
            self._arm(progress, every_module=True)
            try:
                forward_on_batch(self._model, progress.batch)
            except BaseException:
                self._discard_recordings()
                raise

    def _stop_if_asked(self, fired_here: list[str]) -> list[str]:
        # Outside any failure guard: every rank must enter the collective.
        rules = self.alerting.rules_stopping(self._reports.step, fired_here, self._reports.writes)
        if rules:
            self._request_stop()
        return rules

    def _evaluate_alerts(self, progress: LoggingStep) -> list[str]:
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


def _no_stop() -> None:
    return None


_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")


def _autocast_off() -> AbstractContextManager[object]:
    """Autocast off while the monitor computes: a loop that runs its whole step under ``torch.autocast``, the
    monitor's block included, would otherwise have the float32 products of the weights' and the metrics'
    arithmetic made in half precision. The training forward, and a compiled model's probe forward, keep the
    loop's autocast. Outside autocast (every step of most runs) nothing is entered."""
    enabled = [device for device in _AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(device)]
    if not enabled:
        return nullcontext()
    stack = ExitStack()
    for device_type in enabled:
        stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack

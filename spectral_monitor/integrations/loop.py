"""The monitor in a plain PyTorch training loop: :class:`Monitor`, a ``with`` block around each forward.

::

    monitor = Monitor(model, logdir="runs/exp1", every_n_steps=50, optimizer=optimizer)
    for step, batch in enumerate(loader):
        with monitor.step(step, batch=batch):
            loss = loss_of(model, batch)  # the forward, observed on logging steps
        loss.backward()  # unobserved: the captures were disarmed when the block exited
        optimizer.step()
        optimizer.zero_grad()
        if monitor.should_stop:
            break
    monitor.close()

It is an adapter over the framework-free :class:`~spectral_monitor.core.MonitorSession`, as the Lightning
callback is: entering the block is ``begin_step`` (the weights measured, the captures armed), leaving it is
``end_forward`` then ``end_step`` (the captures disarmed, the metrics computed from what the forward
recorded, the alerts judged, the records written). Nothing here imports a training framework.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.tensorboard import SummaryWriter

from spectral_monitor.core import MonitorOptions, MonitorSession
from spectral_monitor.core.options import options_of
from spectral_monitor.core.second_order import OPT_IN_FAMILIES
from spectral_monitor.distributed import global_rank
from spectral_monitor.probes.wrappers import data_parallel_unwrapped
from spectral_monitor.sinks import TensorBoardSink
from spectral_monitor.validation import check_bool, check_callable, check_int

__all__ = ["Monitor"]

_LARGEST_STEP = 2**63 - 1
"""The largest step a TensorBoard event can store (``Event.step`` is a protobuf int64)."""


class Monitor:
    """Measures a model's attention, residual-stream and weight spectra in a plain PyTorch training loop
    and writes them, with the alerts, to a TensorBoard run directory.

    Wrap each step's forward in ``with monitor.step(step, batch=batch):``. On a logging step, entering the
    block measures the weights (the parameters this forward uses) and arms the captures; the forward runs
    untouched while they copy the first ``max_sequences`` sequences; leaving the block disarms them, so the
    backward after it runs unobserved, and computes the step's metrics, judges the alerts and writes the
    records at once. That needs nothing the backward or the optimizer step produce: the metrics are
    functions of the forward's recordings and of the weights measured on entry, so they are the numbers the
    Lightning callback writes for the same batch (it computes them after the optimizer step, from the same
    recordings), and :attr:`should_stop` is known before the optimizer step. Off a logging step the block
    costs a comparison: nothing is installed on the model.

    A compiled model (given as ``torch.compile(model)``, or given plain and called through a compiled
    wrapper) is never armed during the training forward: leaving the block on a logging step runs a probe
    forward of it on ``batch`` with compilation off, in eval mode under ``no_grad``, every random stream
    restored, and measures that (``docs/scale.md``).

    If the block raises, the step is dropped (captures disarmed, recordings discarded, nothing written)
    and the exception propagates as raised; the loop may retry the same step, which is then measured. A
    failure inside the monitor itself is reported once as a warning and training goes on, unless
    ``strict=True``. The monitor's own arithmetic runs with autocast off, inside a loop's ``torch.autocast``
    too.

    Also a context manager: ``with Monitor(...) as monitor:`` closes it at the end.

    Args:
        model: the module whose forward the block calls and whose parts are measured. A
            ``DistributedDataParallel`` or ``FullyShardedDataParallel`` wrapper is measured through the
            module it wraps (tags carry no ``module.`` prefix), and its sharded weights gathered for their
            measurement; so are those of a model sharded with FSDP2 (``fully_shard``), given as it is.
        logdir: the run directory the monitor writes its own event file into: a path, or a
            ``torch.utils.tensorboard.SummaryWriter`` (or the directory of one) whose run the records
            join, so TensorBoard shows the loop's own scalars and the monitor's as one run. The writer
            itself is not written through, and stays the caller's to close.
        optimizer: the training optimizer; the curvature probe reads its learning rate (and Adam's
            state) for the edge of stability. Not needed otherwise.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``, for the second-order probes (``curvature=``,
            ``jacobian=``, ``ntk=``, or ``preset="full"``), which are refused without it (or
            ``ProbeDataOptions(loss_fn=...)``): a plain loop's loss is not known to the monitor.
        writes: whether this process writes, warns and calls ``on_alert``. None: rank 0 of
            ``torch.distributed`` when a process group is initialised, else True. Every rank must enter
            every ``step`` block, on the same steps: some measurements are collectives.
        options: the monitor's options (:class:`~spectral_monitor.core.MonitorOptions`, where each is
            documented); None: their defaults, or those the keywords give.
        **keywords: options as flat keywords (``every_n_steps=50``, ``preset="light"``, ``stop_on=[...]``,
            ``curvature=CurvatureOptions()``, ...), when ``options`` is not given
            (:meth:`~spectral_monitor.core.MonitorOptions.from_keywords`).

    Raises:
        ValueError: if an argument or option is unknown or out of range (the message names it and what is
            allowed).

    Examples:
        >>> import os, tempfile, torch
        >>> from torch import nn
        >>> layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=32, batch_first=True)
        >>> model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        >>> with tempfile.TemporaryDirectory() as run:
        ...     with Monitor(model, run, every_n_steps=1) as monitor:
        ...         for step in range(2):
        ...             with monitor.step(step):
        ...                 loss = model(torch.randn(2, 5, 32)).square().mean()
        ...             loss.backward()
        ...     [name.endswith(".spectral_monitor") for name in os.listdir(run)], monitor.should_stop
        ([True], False)
    """

    def __init__(
        self,
        model: nn.Module,
        logdir: str | os.PathLike[str] | SummaryWriter,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
        writes: bool | None = None,
        options: MonitorOptions | None = None,
        **keywords: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__} {model!r}")
        self.logdir = _run_directory(logdir)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be None or a torch.optim.Optimizer, got {optimizer!r}")
        self.loss_fn = check_callable("loss_fn", loss_fn, "a function loss_fn(model, batch) -> scalar loss")
        self.writes = global_rank() == 0 if writes is None else check_bool("writes", writes)
        self.options = options_of(options, keywords, owner="Monitor")
        _check_a_loss_for_the_second_order_probes(self.options, loss_fn, keywords)
        self.optimizer = optimizer
        self.model = model
        self._measured = data_parallel_unwrapped(model)
        self._session = MonitorSession(self.options)
        self._started = False
        self._closed = False
        self._in_step = False
        self._previous_step: int | None = None
        self._stopping = False
        self._thread: int | None = None
        self._thread_lock = threading.Lock()

    @property
    def should_stop(self) -> bool:
        """Whether a ``stop_on`` rule has fired (on any rank): the loop should end after this step."""
        return self._stopping

    def step(self, step: int, *, batch: Any = None) -> _StepBlock:
        """The block around the forward of training step ``step`` on ``batch``: ``with monitor.step(step):``.

        Args:
            step: the loop's own step, on the axis of its other TensorBoard scalars (a
                ``SummaryWriter.add_scalar(..., global_step=step)`` of the same batch lands beside the
                monitor's); an int in [0, 2⁶³ − 1] (what an event file stores), never smaller than the step
                before. A step repeated is a further
                micro-batch of one optimizer step (gradient accumulation), measured once, at its first; a
                step repeated after its block raised is a retry, measured as if it came first.
            batch: the batch the forward takes. The ``token_mask`` option reads it; the second-order probes
                compute their loss on it (``loss_fn(model, batch)``) and need it; a compiled model is
                measured by a probe forward on it (``model(**batch)`` for a mapping, ``model(batch[0])`` for
                a tuple or list, ``model(batch)`` otherwise) and needs it. Else it may be left out.

        Returns:
            The block; entering it yields whether ``step`` is a logging step. A block never entered (the call
            without ``with``) measures nothing and warns when it is discarded.

        Raises:
            RuntimeError: on entering the block, if the monitor is closed, a ``step`` block is already open,
                or the call comes from a thread other than the one of the first ``step``.
            ValueError: on entering the block, if ``step`` is not an int >= 0 or goes back, or ``batch`` is
                missing where the second-order probes need it.
        """
        return _StepBlock(self, step, batch)

    def _begin(self, step: int, batch: Any) -> bool:
        self._check_step(step, batch)
        if not self._started:
            self._session.start(
                self._measured,
                [TensorBoardSink(self.logdir)] if self.writes else [],
                writes=self.writes,
                training_root=self.model,
                default_loss=self.loss_fn,
                request_stop=self._stop,
            )
            self._started = True
        self._previous_step = step
        self._in_step = True
        try:
            return self._session.begin_step(step, batch, optimizer=self.optimizer)
        except BaseException:
            self._end(succeeded=False)
            raise

    def _end(self, *, succeeded: bool) -> None:
        try:
            if succeeded:
                self._session.end_forward()
                self._session.end_step()
            else:
                self._session.abandon()
        finally:
            self._in_step = False

    def close(self) -> None:
        """End the run: the event file closed, and one warning listing what failed, if anything did. A
        second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._started:
            self._session.close()

    def state_dict(self) -> dict[str, Any]:
        """The monitor's state for the loop's checkpoint.

        Returns:
            Warm iterative vectors, alert streams and cadence counters, so a resumed run measures, judges
            and writes as this one would have gone on doing.
        """
        return self._session.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the monitor's state, before the first ``step`` of the resumed run.

        Args:
            state_dict: What :meth:`state_dict` returned.
        """
        self._session.load_state_dict(state_dict)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _stop(self) -> None:
        self._stopping = True

    def _check_step(self, step: object, batch: Any) -> None:
        if self._closed:
            raise RuntimeError("Monitor.step was called after Monitor.close")
        if self._in_step:
            raise RuntimeError("Monitor.step blocks cannot nest: a step block is already open")
        check_int("step", step, smallest=0, largest=_LARGEST_STEP)
        with self._thread_lock:
            self._thread = threading.get_ident() if self._thread is None else self._thread
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                "Monitor.step was called from a thread other than the one that first called it: a Monitor "
                "arms hooks on the model around each step, and two threads would interleave them; use one "
                "Monitor per thread, each on its own model"
            )
        if self._previous_step is not None and step < self._previous_step:
            raise ValueError(
                f"step must not go back: got {step} after {self._previous_step} (repeat a step for the "
                "micro-batches of one optimizer step)"
            )
        if batch is None and any(family in self.options.families for family in OPT_IN_FAMILIES):
            raise ValueError(
                "batch must be given to Monitor.step: the second-order probes compute a loss on it"
            )


class _StepBlock:
    """What :meth:`Monitor.step` returns: entering it begins the step, leaving it ends the step (or drops it,
    if the block raised). One that is never entered says so when it is discarded, as a coroutine never
    awaited does: ``monitor.step(step)`` without ``with`` would otherwise measure nothing in silence."""

    def __init__(self, monitor: Monitor, step: int, batch: Any) -> None:
        self._monitor, self._step, self._batch = monitor, step, batch
        self._entered = False

    def __enter__(self) -> bool:
        self._entered = True
        return self._monitor._begin(self._step, self._batch)

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self._monitor._end(succeeded=exc_type is None)

    def __del__(self) -> None:
        if not self._entered:
            warnings.warn(
                f"Monitor.step({self._step!r}) was called but its block was never entered, so nothing was "
                "measured: write `with monitor.step(step, batch=batch):` around the forward",
                RuntimeWarning,
                stacklevel=2,
            )


def _run_directory(logdir: object) -> str:
    """The run directory named by ``logdir``: a path, or a ``SummaryWriter``'s own."""
    if isinstance(logdir, SummaryWriter):
        return os.fspath(logdir.get_logdir())
    if isinstance(logdir, (str, os.PathLike)) and os.fspath(logdir):
        return os.fspath(logdir)
    raise ValueError(
        "logdir must be a run directory (a non-empty str or path) or a "
        f"torch.utils.tensorboard.SummaryWriter, got {logdir!r}"
    )


def _check_a_loss_for_the_second_order_probes(
    options: MonitorOptions, loss_fn: Callable[..., Tensor] | None, given: Mapping[str, Any]
) -> None:
    """A ValueError naming the option that turned a second-order probe on, and ``loss_fn``, when no loss is
    given for it."""
    turned_on = [family for family in OPT_IN_FAMILIES if family in options.families]
    if not turned_on or loss_fn is not None or options.probe_data.loss_fn is not None:
        return
    family = turned_on[0]
    if given.get(family) is not None or options.preset != "full":
        cause = f"{family}="
    else:
        cause = f"preset={options.preset!r}, which sets {family}="
    raise ValueError(
        f"{cause} turns on the {family} probe, which needs a loss: pass loss_fn=lambda model, batch: <scalar "
        f"loss> (or probe_data=ProbeDataOptions(loss_fn=...)), or leave {family} off"
    )

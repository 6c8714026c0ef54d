"""The Hugging Face ``transformers.Trainer`` callback: :class:`SpectralMonitorCallback`, an adapter of the
Trainer's events to the framework-free :class:`~spectral_monitor.core.MonitorSession`.

Importing this module imports ``transformers``; nothing else in the library does.

The Trainer has no event between a step's forward and its backward, and ``on_step_begin`` gets no batch, so
a logging step is armed from inside the forward:

- ``on_train_begin``: the run directory found (:func:`tensorboard_run_directory`), the session started with
  a TensorBoard sink there (world process zero only) and captures that end when the model's forward returns;
- ``on_step_begin`` (once per optimizer step): a one-shot forward pre-hook on the model; the first training
  forward of the step (the first micro-batch under gradient accumulation: the model in training mode,
  gradients enabled) removes it and calls ``begin_step`` with that forward's inputs as the batch, so the
  backward, the later micro-batches and any activation recomputation run unobserved. A forward in eval mode
  or without gradients before it (an ``evaluate()`` or a reference forward of another callback) passes
  unobserved and leaves the hook waiting;
- ``on_step_end`` (after the optimizer step): ``end_step`` (metrics, alerts, records written); a
  ``stop_on`` rule that fired sets ``control.should_training_stop``;
- ``on_save`` (after the Trainer wrote a checkpoint folder): the session's state (warm vectors, alert
  history, logging-step count) written into it as ``STATE_FILE_NAME``, by the processes that save
  checkpoints (``args.should_save``: the world process zero);
- ``on_train_end``: ``close``.

``TrainingArguments(torch_compile=True)``: the Trainer compiles the model inside itself, where the pre-hook
would run traced into the compiled graph (and adding and removing it each step would recompile it). The
callback then measures nothing, installs nothing on the model, and says so once with a warning naming the
ways that do measure a compiled model: a plain loop's ``Monitor`` or the Lightning callback, whose probe
forward runs the model eagerly on the step's batch.

Resuming (``trainer.train(resume_from_checkpoint=...)``): the Trainer's ``ExportableState`` keeps JSON only,
and a callback is not told which folder the run resumed from, so ``on_train_begin`` of a run that starts at
``global_step`` g > 0 reads the state file of ``args.resume_from_checkpoint`` when that names a folder, else
of ``args.output_dir/checkpoint-<g>`` (where ``resume_from_checkpoint=True`` and a path to the output
directory's own checkpoint resume from), on every process, through the session's ``load_state_dict``.
A resumed run whose checkpoint has no state file starts the monitor anew, with one warning (world process
zero).

The step axis is the Trainer's ``global_step``, which it advances before logging a step's scalars: the
records of the batch that starts at ``global_step == g`` are filed under g + 1, beside the Trainer's own
scalars of that batch, while the cadence counts g as the Lightning callback counts its batches (measured
when ``(g + 1) % every_n_steps == 0``, and g = 0 with ``log_first_step``). With ``every_n_steps`` equal to
``TrainingArguments.logging_steps`` the monitor's records and the Trainer's ``train/loss`` land on the same
steps.
"""

from __future__ import annotations

import glob
import os
import socket
import warnings
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
import transformers
from torch import Tensor, nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from spectral_monitor.core import MonitorOptions, MonitorSession
from spectral_monitor.core.options import options_of
from spectral_monitor.sinks import TensorBoardSink

__all__ = ["STATE_FILE_NAME", "SpectralMonitorCallback", "model_output_loss", "tensorboard_run_directory"]

COMPILED_BY_THE_TRAINER = (
    "SpectralMonitorCallback: TrainingArguments(torch_compile=True) compiles the model inside the Trainer, "
    "which gives callbacks no batch outside the compiled forward, so nothing is measured in this run and "
    "nothing is installed on the model. A compiled model is measured by spectral_monitor.Monitor in a plain "
    "loop or by the Lightning callback (an eager probe forward on each logging step's batch); or train with "
    "torch_compile=False."
)
"""The warning of a run whose Trainer compiles the model (world process zero, once a run)."""
_HF_STEP_OFFSET = 1
"""The Trainer files a batch's scalars under ``global_step`` after its update: one past the batch's index."""
STATE_FILE_NAME = "spectral_monitor.pt"
"""The monitor's state in a Trainer checkpoint folder (``torch.save`` of the session's ``state_dict``)."""


class SpectralMonitorCallback(transformers.TrainerCallback):
    """Measures attention, residual-stream and weight spectra in a ``transformers.Trainer`` and writes them
    into the Trainer's TensorBoard run, beside its own scalars::

        trainer = Trainer(model, args, train_dataset=data, callbacks=[SpectralMonitorCallback()])

    It writes the tags, figures, alerts and layout of :class:`~spectral_monitor.SpectralMonitor` (see there),
    on the Trainer's ``global_step`` (see the module's docstring for the step axis). Every process measures;
    the world process zero alone writes, warns and calls ``on_alert``. A ``stop_on`` rule that fires sets
    ``control.should_training_stop``: the Trainer stops after that step. Failures inside the monitor are
    reported once and training goes on, unless ``strict``.

    Its state (warm vectors, alert history, the logging-step count) is saved into every checkpoint folder
    the Trainer writes and restored when training resumes from one (see the module's docstring).

    The opt-in second-order probes (``curvature=``, ``jacobian=``, ``ntk=``) take their loss from
    :func:`model_output_loss` (``model(**batch).loss``) unless ``ProbeDataOptions(loss_fn=...)`` is given.

    Args:
        log_dir: the run directory the monitor's event file goes into. None: the Trainer's TensorBoard run,
            found as :func:`tensorboard_run_directory` says.
        options: the monitor's options (:class:`~spectral_monitor.core.MonitorOptions`, where each is
            documented); None: their defaults, or those the keywords give.
        **keywords: options as flat keywords (``every_n_steps=10``, ``preset="light"``,
            ``stop_on=["rank_collapse"]``, ...), when ``options`` is not given
            (:meth:`~spectral_monitor.core.MonitorOptions.from_keywords`).

    Raises:
        ValueError: if an option is unknown or out of range (the message names it and what is allowed), or
            ``log_dir`` is not a path.

    Examples:
        >>> monitor = SpectralMonitorCallback(every_n_steps=10, families=["attention"])
        >>> monitor.options.every_n_steps, monitor.options.families
        (10, ('attention',))

        In a Trainer whose ``logging_steps`` the monitor follows:

        ```python
        args = TrainingArguments("out", logging_steps=10, report_to=["tensorboard"])
        monitor = SpectralMonitorCallback(every_n_steps=10)
        trainer = Trainer(model, args, train_dataset=data, callbacks=[monitor])
        trainer.train()
        ```
    """

    def __init__(
        self,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        options: MonitorOptions | None = None,
        **keywords: Any,
    ) -> None:
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise ValueError(f"log_dir must be a directory path or None, got {type(log_dir).__name__}")
        self.options = options_of(options, keywords, owner="SpectralMonitorCallback")
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.run_directory: str | None = None
        """Where the monitor's event file of the current or last run went (world process zero)."""
        self._session = MonitorSession(self.options)
        self._arming_hook: torch.utils.hooks.RemovableHandle | None = None
        self._stop_requested = False
        self._compiled_by_trainer = False

    def on_train_begin(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """Starts the session on ``model``; world process zero writes to the run directory.

        A run that starts past step 0 (a resumed one) restores the monitor's state from the checkpoint's
        ``STATE_FILE_NAME`` (module docstring); a failure to start is reported, and each step then skipped.

        Args:
            args: The Trainer's arguments: where the run directory and the checkpoints are.
            state: The Trainer's state: ``global_step`` is the first step, ``is_world_process_zero`` who
                writes.
            control: The Trainer's control flags, unused.
            model: The model being trained, whose attention and weights are measured.
            **kwargs: The Trainer's other event arguments, unused.
        """
        self._stop_requested = False
        writes = state.is_world_process_zero
        self._compiled_by_trainer = bool(getattr(args, "torch_compile", False))
        if self._compiled_by_trainer:
            if writes:
                warnings.warn(COMPILED_BY_THE_TRAINER, RuntimeWarning, stacklevel=2)
            return
        # A session that did not start fails each step's start, which is then skipped.
        with self._session.failures_of("starting the monitor"):
            sinks = []
            if writes:
                self.run_directory = tensorboard_run_directory(args, self.log_dir)
                sinks = [TensorBoardSink(self.run_directory)]
            self._session.start(
                model,
                sinks,
                writes=writes,
                default_loss=model_output_loss,
                request_stop=self._ask_to_stop,
                disarm_after_forward=True,
                step_offset=_HF_STEP_OFFSET,
            )
        if state.global_step > 0:
            self._restore_from_checkpoint(args, state.global_step, writes)

    def on_step_begin(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        """Arms the step: a one-shot forward pre-hook on ``model`` calls ``begin_step`` on the step's first
        training forward, with that forward's inputs as the batch.

        Args:
            args: The Trainer's arguments, unused.
            state: The Trainer's state: the step is ``global_step + 1``.
            control: The Trainer's control flags, unused.
            model: The model whose next training forward (in training mode, gradients enabled) is measured.
            optimizer: The optimizer, for the edge of stability of the curvature probe; None: none.
            **kwargs: The Trainer's other event arguments, unused.
        """
        self._remove_arming_hook()
        if self._compiled_by_trainer:
            return
        step = state.global_step + _HF_STEP_OFFSET
        with self._session.failures_of("installing the monitor's forward pre-hook"):
            self._arming_hook = model.register_forward_pre_hook(
                partial(self._begin_step, step, optimizer), with_kwargs=True
            )

    def on_step_end(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> transformers.TrainerControl:
        """Ends the step: ``end_step`` (metrics, alerts, records written), after the optimizer step.

        Args:
            args: The Trainer's arguments, unused.
            state: The Trainer's state, unused.
            control: The Trainer's control flags; ``should_training_stop`` is set when a ``stop_on`` rule
                fired.
            **kwargs: The Trainer's other event arguments, unused.

        Returns:
            ``control``.
        """
        self._remove_arming_hook()  # a step whose forward did not go through the model
        if self._compiled_by_trainer:
            return control
        self._session.end_step()
        if self._stop_requested:
            control.should_training_stop = True
        return control

    def on_save(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Writes the session's :meth:`state_dict` into the checkpoint folder the Trainer has just written, as
        ``STATE_FILE_NAME``, on the processes that save (``args.should_save``).

        Args:
            args: The Trainer's arguments: ``output_dir`` and ``should_save``.
            state: The Trainer's state: the checkpoint is ``checkpoint-<global_step>``.
            control: The Trainer's control flags, unused.
            **kwargs: The Trainer's other event arguments, unused.
        """
        if not args.should_save:
            return
        with self._session.failures_of("saving the monitor's state into the checkpoint"):
            folder = _checkpoint_folder(args.output_dir, state.global_step)
            torch.save(self._session.state_dict(), os.path.join(folder, STATE_FILE_NAME))

    def state_dict(self) -> dict[str, Any]:
        """The monitor's state, as saved into each checkpoint folder.

        Returns:
            The session's state (warm iterative vectors, alert streams, cadence counters), ``torch.save``-able
            with ``weights_only`` loading.
        """
        return self._session.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output, before training starts or resumes.

        Args:
            state_dict: What :meth:`state_dict` returned.
        """
        self._session.load_state_dict(state_dict)

    def on_train_end(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Closes the session: sinks closed; one warning listing what failed or could not be written.

        Args:
            args: The Trainer's arguments, unused.
            state: The Trainer's state, unused.
            control: The Trainer's control flags, unused.
            **kwargs: The Trainer's other event arguments, unused.
        """
        self._remove_arming_hook()
        self._session.close()

    def _begin_step(
        self,
        step: int,
        optimizer: torch.optim.Optimizer | None,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # not the training forward: an evaluation or reference forward run before it
        self._remove_arming_hook()  # one forward a step: later micro-batches run unobserved
        batch = kwargs if kwargs else (args[0] if len(args) == 1 else args)
        with self._session.failures_of("starting a step of the monitor"):
            self._session.begin_step(step, batch, optimizer=optimizer)

    def _restore_from_checkpoint(self, args: transformers.TrainingArguments, step: int, writes: bool) -> None:
        named = getattr(args, "resume_from_checkpoint", None)
        folders = [named] if isinstance(named, str) and os.path.isdir(named) else []
        folders.append(_checkpoint_folder(args.output_dir, step))
        paths = [os.path.join(folder, STATE_FILE_NAME) for folder in folders]
        saved = next((path for path in paths if os.path.isfile(path)), None)
        if saved is None:
            if writes:
                warnings.warn(
                    f"SpectralMonitor: training resumed at step {step}, but no {STATE_FILE_NAME} is in "
                    f"{' or '.join(folders)}: the monitor's warm vectors and alert history start anew "
                    "(resuming from a folder outside output_dir? name it in "
                    "TrainingArguments(resume_from_checkpoint=...) too).",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        with self._session.failures_of("restoring the monitor's state from the checkpoint"):
            self._session.load_state_dict(torch.load(saved, map_location="cpu", weights_only=True))

    def _remove_arming_hook(self) -> None:
        if self._arming_hook is not None:
            self._arming_hook.remove()
            self._arming_hook = None

    def _ask_to_stop(self) -> None:
        self._stop_requested = True


def _checkpoint_folder(output_dir: str, step: int) -> str:
    """Where the Trainer writes the checkpoint of ``step``: ``output_dir/checkpoint-<step>``."""
    return os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")


def model_output_loss(model: nn.Module, batch: Any) -> Tensor:
    """The second-order probes' default loss in a Trainer: ``model(**batch).loss``.

    The Trainer's ``num_items_in_batch`` is left out of the keywords, so the loss is the batch's mean whatever
    the gradient accumulation.

    Args:
        model: The model; its output is a mapping or has a ``loss`` attribute (a ``ModelOutput``).
        batch: A mapping of the model's keyword arguments, labels included.

    Returns:
        The 0-d loss tensor, in the autograd graph.

    Raises:
        ValueError: ``batch`` is not a mapping, or the output holds no 0-d tensor ``loss`` (the message says
            to pass ``ProbeDataOptions(loss_fn=...)``).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> class Regression(nn.Module):
        ...     def forward(self, inputs, labels):
        ...         return {"loss": (inputs.sum(-1) - labels).square().mean()}
        >>> batch = {"inputs": torch.ones(2, 3), "labels": torch.tensor([3.0, 1.0]), "num_items_in_batch": 2}
        >>> model_output_loss(Regression(), batch)
        tensor(2.)
    """
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"the second-order probes' default loss is model(**batch).loss, but the batch is a "
            f"{type(batch).__name__}, not a mapping: pass ProbeDataOptions(loss_fn=...)"
        )
    output = model(**{name: value for name, value in batch.items() if name != "num_items_in_batch"})
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, Tensor) or loss.ndim != 0:
        raise ValueError(
            "model(**batch) returned no scalar loss for the second-order probes (does the batch hold "
            "labels?): pass ProbeDataOptions(loss_fn=...)"
        )
    return loss


def tensorboard_run_directory(args: transformers.TrainingArguments, log_dir: str | None = None) -> str:
    """The run directory of the Trainer's TensorBoard scalars, where the monitor writes, the first of:

    1. ``log_dir``, when given;
    2. ``args.logging_dir``, where ``TrainingArguments`` has one (``transformers`` 4.x);
    3. the environment variable ``TENSORBOARD_LOGGING_DIR`` (``transformers`` 5.x's ``TensorBoardCallback``
       writes there when it is set);
    4. with ``"tensorboard"`` in ``args.report_to``, the directory of the newest event file this process
       wrote under ``args.output_dir/runs``, the monitor's own files left out: the file name carries the
       host and the process id, and the
       ``TensorBoardCallback`` (a default callback, whose ``on_train_begin`` runs before the user's) has just
       made its writer there (``runs/<Mon DD_HH-MM-SS>_<host>``);
    5. a new ``args.output_dir/runs/<Mon DD_HH-MM-SS>_<host>``, the name ``TensorBoardCallback`` would use.

    Args:
        args: The Trainer's arguments: ``logging_dir`` (4.x), ``report_to`` and ``output_dir`` are read.
        log_dir: The callback's own ``log_dir``; None: found from ``args``.

    Returns:
        The directory path; it need not exist yet.

    Examples:
        >>> from types import SimpleNamespace
        >>> args = SimpleNamespace(logging_dir="out/logs", report_to=["tensorboard"], output_dir="out")
        >>> tensorboard_run_directory(args), tensorboard_run_directory(args, "monitor")
        ('out/logs', 'monitor')
    """
    if log_dir is not None:
        return log_dir
    logging_dir = getattr(args, "logging_dir", None)
    if logging_dir:
        return os.fspath(logging_dir)
    from_environment = os.environ.get("TENSORBOARD_LOGGING_DIR")
    if from_environment:
        return os.path.expanduser(from_environment)
    if "tensorboard" in (args.report_to or []):
        pattern = f"events.out.tfevents.*.{glob.escape(socket.gethostname())}.{os.getpid()}.*"
        written = glob.glob(os.path.join(glob.escape(args.output_dir), "runs", "**", pattern), recursive=True)
        written = [path for path in written if not path.endswith(".spectral_monitor")]  # the monitor's own
        if written:
            return os.path.dirname(max(written, key=lambda path: os.stat(path).st_mtime_ns))
    from transformers.integrations.integration_utils import default_logdir

    return os.path.join(args.output_dir, default_logdir())

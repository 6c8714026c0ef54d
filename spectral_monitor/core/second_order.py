"""The curvature, Jacobian and NTK probes during training: options, probe batch, loss closure, cadence.

:class:`~spectral_monitor.core.MonitorSession` holds one :class:`SecondOrderProbes` when a family among
``"curvature"``, ``"jacobian"``, ``"ntk"`` is on, and calls :meth:`SecondOrderProbes.measure_due` at every
step start: before the training forward, so the parameters measured are the ones this step uses. The numbers
come from :mod:`spectral_monitor.probes.curvature`, :mod:`~spectral_monitor.probes.jacobian` and
:mod:`~spectral_monitor.probes.ntk`; this module only decides when, on what batch, and with which loss.

The loss is ``ProbeDataOptions.loss_fn`` when given, else the integration's default: with Lightning the
LightningModule's own ``training_step`` on the probe batch, with ``self.log`` and ``self.log_dict`` turned
into no-ops for the call (:func:`spectral_monitor.lightning.losses.training_step_loss`), so the probe's loss
never reaches the logged metrics.

Under DDP the probes run on the unwrapped module (DDP does not support double backward through its
wrapper), and each rank's probe batch is its own shard (the batch its dataloader gave it):

- curvature: every Hessian-vector product is averaged over the ranks, so the sharpness, eigenvalues, trace
  and density are those of the mean loss over the global probe batch (all ranks' shards together), the
  same number on every rank; the Lanczos runs stop on the same iteration everywhere
  (:mod:`spectral_monitor.distributed`).
- jacobian and ntk: per rank, no collective. Each rank measures the Jacobians of one sequence and the
  kernel of the examples of its own probe batch; rank 0 writes its own, and the alert rules of each rank
  read its own. (A Jacobian is of one sequence, and an NTK of a fixed set of examples: averaging over
  ranks would measure nothing more meaningful.)

Under FSDP (or any sharded parameters) the three families are refused when training starts, naming DDP as
the alternative (:func:`~spectral_monitor.probes.curvature.check_unsharded`).

The options (:class:`CurvatureOptions`, :class:`JacobianOptions`, :class:`NTKOptions`,
:class:`ProbeDataOptions`) live in :mod:`spectral_monitor.core.second_order_options` and are re-exported here.

A checkpoint holds what a resumed run needs to go on measuring as the uninterrupted run would have: the
probe batches, the Jacobian warm vectors, the probes' generator and step counter
(:meth:`SecondOrderProbes.state_dict`, under ``"second_order"`` in the monitor's state). Every curvature
event starts cold (:func:`~spectral_monitor.probes.curvature.hessian_eigenvalues` says why), so no
parameter-sized vector is kept.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from matplotlib.figure import Figure
from torch import Tensor, nn

from spectral_monitor.checkpoint_entries import StateEntries
from spectral_monitor.core.curvature_budget import (
    StretchedCadence,
    estimate_curvature_memory,
    saved_activation_bytes,
)
from spectral_monitor.core.curvature_records import curvature_measurements
from spectral_monitor.core.probe_checkpoint import check_resumable, checked_list
from spectral_monitor.core.schedule import Cadence
from spectral_monitor.core.second_order_options import (
    WHOLE_MODEL,
    CurvatureOptions,
    JacobianOptions,
    NTKOptions,
    ProbeDataOptions,
)
from spectral_monitor.distributed import any_rank, global_rank
from spectral_monitor.probes._autodiff import probing
from spectral_monitor.probes.curvature import check_unsharded, measure_curvature
from spectral_monitor.probes.jacobian import END_TO_END, block_jacobian_norms
from spectral_monitor.probes.ntk import empirical_ntk
from spectral_monitor.probes.parameter_space import ParameterSpace
from spectral_monitor.records import Measurement
from spectral_monitor.sinks.figures import spectral_density_figure

__all__ = [
    "OPT_IN_FAMILIES",
    "CurvatureOptions",
    "JacobianOptions",
    "NTKOptions",
    "ProbeDataOptions",
    "LossFn",
    "SecondOrderProbes",
]

OPT_IN_FAMILIES = ("curvature", "jacobian", "ntk")
"""Families measured only when asked for: each costs several forward/backward passes per event."""

LossFn = Callable[[nn.Module, Any], Tensor]
"""``loss(module, batch)`` -> the scalar loss the probes differentiate."""


def _copy(batch: Any) -> Any:
    return apply_to_collection(batch, Tensor, lambda tensor: tensor.detach().clone())


def _example(batch: Any, index: int) -> Any:
    return apply_to_collection(batch, Tensor, lambda tensor: tensor[index : index + 1])


def _batch_size(batch: Any) -> int:
    sizes = []
    apply_to_collection(batch, Tensor, lambda tensor: sizes.append(tensor.shape[0]) if tensor.ndim else None)
    if not sizes:
        raise ValueError("the probe batch holds no tensor with a batch dimension")
    return min(sizes)


def _on_device(batch: Any, device: torch.device) -> Any:
    return apply_to_collection(batch, Tensor, lambda tensor: tensor.to(device))


@dataclass
class ProbeEvent:
    """What the opt-in probes measured at one step: records, and figures drawn only for sinks keeping them.

    Attributes:
        measurements: The records of the families measured, with their overheads.
        figures: ``(tag, draw)``: ``draw()`` makes the figure (a Hessian spectral density) when a sink keeps
            figures.

    Examples:
        >>> ProbeEvent().measurements
        []
    """

    measurements: list[Measurement] = field(default_factory=list)
    figures: list[tuple[str, Callable[[], Figure]]] = field(default_factory=list)


class SecondOrderProbes:
    """Runs the opt-in probes on their own cadences; keeps the probe batch and the warm-start vectors, and
    hands them to the monitor's checkpoint state (:meth:`state_dict`).

    Args:
        model: The outermost module trained (with Lightning ``trainer.strategy.model``); the probes
            themselves run on the module given to :meth:`measure_due`.
        families: The families asked for; those of ``OPT_IN_FAMILIES`` among them are run.
        curvature: The curvature probe's options (None where it is off).
        jacobian: The Jacobian probe's options (None where it is off).
        ntk: The NTK probe's options (None where it is off).
        data: What the probes compute their loss on.
        failures_of: ``failures_of(what)`` -> a context manager around each family's measurement and the
            checkpointing of the probe batch (the session's: a failure is reported once and skipped, or
            re-raised in strict mode).
        warn: How a one-time warning reaches the user.
        strict: Whether a probe refused for its memory raises (the ``ValueError`` of the warning's text)
            instead of being warned of.
        default_loss: ``default_loss(module, batch)``, the loss when ``data.loss_fn`` is not given (None:
            ``loss_fn`` is required).
        step_offset: How far the steps given to :meth:`measure_due` run ahead of the optimizer steps taken
            before their batch, which the cadences count (``MonitorSession.start``'s).

    Raises:
        ValueError: If ``model`` has sharded (FSDP) parameters (:func:`check_unsharded`, naming DDP).

    Examples:
        >>> import contextlib
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Linear(2, 1)
        >>> probes = SecondOrderProbes(
        ...     model,
        ...     ["curvature"],
        ...     CurvatureOptions(every_n_steps=1, max_products=4),
        ...     JacobianOptions(),
        ...     NTKOptions(),
        ...     ProbeDataOptions(loss_fn=lambda module, batch: module(batch).square().mean()),
        ...     failures_of=lambda what: contextlib.nullcontext(),
        ... )
        >>> event = probes.measure_due(model, torch.ones(4, 2), step=0, optimizer=None)
        >>> sorted(record.metric for record in event.measurements)  # doctest: +NORMALIZE_WHITESPACE
        ['converged', 'gradient_alignment', 'hessian_eigenvalue_1', 'hessian_products', 'overhead_ms',
         'sharpness']
    """

    def __init__(
        self,
        model: nn.Module,
        families: Sequence[str],
        curvature: CurvatureOptions | None,
        jacobian: JacobianOptions | None,
        ntk: NTKOptions | None,
        data: ProbeDataOptions,
        failures_of: Callable[[str], Any],
        warn: Callable[[str], None] = warnings.warn,
        strict: bool = False,
        default_loss: LossFn | None = None,
        step_offset: int = 0,
    ) -> None:
        self.families = [family for family in OPT_IN_FAMILIES if family in families]
        check_unsharded(model, f"SpectralMonitor's {'/'.join(self.families)} probes")
        self.curvature, self.jacobian, self.ntk, self.data = curvature, jacobian, ntk, data
        self._failures_of = failures_of
        self._warn = warn
        self._strict = strict
        self._default_loss = default_loss
        self._step_offset = step_offset
        self._device = next((parameter.device for parameter in model.parameters()), torch.device("cpu"))
        self._batches: list[Any] = []
        self._jacobian_warm: dict[str, Tensor] = {}
        self._jacobian_skipped_warned: set[str] = set()
        self._spaces: dict[str, ParameterSpace] | None = None
        self._last_step = -1
        self._last_start: float | None = None
        self._last_probe_seconds = 0.0
        self._step_seconds: float | None = None
        self._generator = torch.Generator().manual_seed(0)
        self._stretched = (
            None
            if curvature is None or curvature.max_overhead_percent is None
            else StretchedCadence(curvature.every_n_steps, curvature.max_overhead_percent)
        )
        self._memory_checked = False

    def measure_due(
        self, module: nn.Module, batch: Any, step: int, optimizer: torch.optim.Optimizer | None
    ) -> ProbeEvent:
        """Measure the families due at ``step`` on ``module``.

        A second call at the same step (a later micro-batch of an accumulated step) measures nothing. A
        family that fails is handled by ``failures_of`` and costs that family only.

        Args:
            module: The module the probes differentiate (under DDP the unwrapped one).
            batch: The step's training batch; the probe batch is taken from it as ``ProbeDataOptions`` says.
            step: The global step.
            optimizer: Sets the curvature's edge of stability; only read (None: none).

        Returns:
            The records (with each family's ``overhead_ms``, and ``overhead_percent`` once a step's time is
            known) and the figures of this step; empty when nothing was due.
        """
        now = time.perf_counter()
        if self._last_start is not None:
            self._step_seconds = now - self._last_start - self._last_probe_seconds
        self._last_start, self._last_probe_seconds = now, 0.0
        event = ProbeEvent()
        if step == self._last_step:  # a later micro-batch of an accumulated step
            return event
        if self._stretched is not None and self._step_seconds and self._last_step == step - 1:
            self._stretched.step_took(self._step_seconds)
        self._last_step = step
        if self._stretched is not None and (interval := self._stretched.decide()) is not None:
            event.measurements.append(Measurement(step, "curvature", "every_n_steps", WHOLE_MODEL, interval))
        if self.data.probe_batch == "averaged" and len(self._batches) < self.data.probe_batches:
            self._batches.append(_copy(batch))
        due = [family for family in self.families if self._due(family, step)]
        if not due:
            return event
        if self.data.probe_batch == "fixed" and not self._batches:
            self._batches.append(_copy(batch))
        batches = [batch] if self.data.probe_batch == "current" else self._batches
        for family in due:
            started, measured = time.perf_counter(), False
            with self._failures_of(f"measuring the {family} family"):
                getattr(self, f"_measure_{family}")(module, batches, step, event, optimizer)
                measured = True
            if family not in self.families:
                # Refused for the run before measuring anything: no event to time, nor a cadence to stretch.
                if family == "curvature":
                    self._stretched = None
                continue
            if not measured:  # failed, and reported: no reading whose cost an overhead record would be
                continue
            elapsed = time.perf_counter() - started
            if family == "curvature" and self._stretched is not None:
                self._stretched.measured(step, elapsed)
            event.measurements.append(Measurement(step, family, "overhead_ms", WHOLE_MODEL, 1000 * elapsed))
            if self._step_seconds:
                percent = 100 * elapsed / self._step_seconds
                event.measurements.append(Measurement(step, family, "overhead_percent", WHOLE_MODEL, percent))
        self._last_probe_seconds = time.perf_counter() - now
        return event

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to measure as this one would have gone on measuring.

        Returns:
            The probe batches, the Jacobian warm vectors, the generator's state, the global rank, the last
            step seen and the last training step's duration (for ``overhead_percent``), and with
            ``max_overhead_percent`` the last curvature event's step and the interval after it. A probe batch
            that cannot be checkpointed is left out, through ``failures_of``.
        """
        state: dict[str, Any] = {
            "last_step": self._last_step,
            "step_seconds": self._step_seconds,
            "generator": self._generator.get_state(),
            "rank": global_rank(),
            "probe_batches": [],
            "jacobian_warm": dict(self._jacobian_warm),
        }
        if self._stretched is not None:
            state["curvature_last_event"] = self._stretched.last_event
            state["curvature_interval"] = self._stretched.interval
        with self._failures_of("checkpointing the probe batch"):
            check_resumable(self._batches)
            state["probe_batches"] = list(self._batches)
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any] | StateEntries) -> list[str]:
        """Restore :meth:`state_dict`'s output, entry by entry (:meth:`usable_state`); a key it lacks (a
        checkpoint of an earlier version) leaves that part as a new run starts it.

        The probe batches go to the model's device (Lightning's ``torch.load`` puts a checkpoint's tensors on
        the CPU), as many as ``probe_data`` uses. Under DDP the checkpoint holds global rank 0's state, so
        another rank takes its own probe batch at its first event rather than rank 0's shard.

        Args:
            state_dict: What :meth:`state_dict` returned, or its entries already read from a checkpoint.

        Returns:
            The entries dropped, each named with why (the session warns of them).
        """
        entries = state_dict if isinstance(state_dict, StateEntries) else StateEntries(state_dict)
        state = self.usable_state(entries)
        self._last_step = state.get("last_step", self._last_step)
        self._step_seconds = state.get("step_seconds", self._step_seconds)
        if self._stretched is not None:
            self._stretched.last_event = state.get("curvature_last_event", self._stretched.last_event)
            self._stretched.interval = state.get("curvature_interval", self._stretched.interval)
        if "generator" in state:
            self._generator.set_state(state["generator"])
        if state.get("rank", 0) == global_rank():
            used = {"fixed": 1, "averaged": self.data.probe_batches, "current": 0}[self.data.probe_batch]
            self._batches = [_on_device(batch, self._device) for batch in state["probe_batches"][:used]]
        self._jacobian_warm = state["jacobian_warm"]
        self._spaces = None  # built at the first event, from the model as it is then
        return entries.dropped

    @staticmethod
    def usable_state(entries: StateEntries) -> dict[str, Any]:
        """The entries of a checkpoint's state that :meth:`load_state_dict` can use.

        Args:
            entries: The checkpoint's entries, checked one by one (types, shapes, finite values); the others
                are dropped, named in ``entries.dropped``.

        Returns:
            The usable entries by key; ``probe_batches``, ``jacobian_warm`` and ``rank``
            always (empty, or 0, where the checkpoint had none usable), the others where present.
        """
        state: dict[str, Any] = {
            "probe_batches": entries.read("probe_batches", [], checked_list),
            "jacobian_warm": entries.unit_vectors("jacobian_warm", ndim=2),
        }
        if "last_step" in entries:
            state["last_step"] = entries.integer("last_step", None, smallest=-1, optional=True)
        for key in ("curvature_last_event", "curvature_interval"):
            if key in entries:
                state[key] = entries.integer(key, None, smallest=0, optional=True)
        if "step_seconds" in entries:
            state["step_seconds"] = entries.number("step_seconds", None, optional=True)
        generator = entries.generator_state("generator")
        if generator is not None:
            state["generator"] = generator
        state["rank"] = entries.integer("rank", 0, smallest=0)
        return state

    def _due(self, family: str, step: int) -> bool:
        if not self._cadence(family).due(step - self._step_offset):
            return False
        return family != "curvature" or self._stretched is None or self._stretched.allows(step)

    def _cadence(self, family: str) -> Cadence:
        """``"linear"``: (step + 1) % every_n_steps == 0, and step 0; ``"log"``: also the steps with step + 1
        a power of two below ``every_n_steps``."""
        options = getattr(self, family)
        return Cadence.of_steps(options.every_n_steps, log_spaced=options.schedule == "log")

    def _loss_closure(self, module: nn.Module, batches: list[Any]) -> Callable[[], Tensor]:
        def loss() -> Tensor:
            total = sum(self._loss(module, batch) for batch in batches)
            return total / len(batches)

        return loss

    def _loss(self, module: nn.Module, batch: Any) -> Tensor:
        if self.data.loss_fn is not None:
            return self.data.loss_fn(module, batch)
        if self._default_loss is None:
            raise ValueError("the curvature, Jacobian and NTK probes need ProbeDataOptions(loss_fn=...) here")
        return self._default_loss(module, batch)

    def _measure_curvature(
        self,
        module: nn.Module,
        batches: list[Any],
        step: int,
        event: ProbeEvent,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        if self._spaces is None or not _spaces_still_current(self._spaces, module):
            # First use in this process, or the model changed under the probe (a block removed, a weight
            # replaced): measure it as it now is.
            self._spaces = self.curvature.spaces(module, self._warn)
        options = self.curvature
        if not self._memory_checked:
            self._memory_checked = True
            self._refuse_if_too_large(module, batches, optimizer)
            if "curvature" not in self.families:
                return
        for layer, space in self._spaces.items():
            estimate = measure_curvature(
                module,
                self._loss_closure(module, batches),
                space=space,
                top_k=options.top_k,
                min_eigenvalue=options.min_eigenvalue,
                trace_products=options.trace_products,
                density_probes=options.density_probes,
                density_steps=options.density_steps,
                optimizer=optimizer,
                max_products=options.max_products,
                tol=options.tol,
                mode=self.data.mode,
                method=options.method,
                generator=self._generator,
                average_over_ranks=True,
            )
            event.measurements += curvature_measurements(step, layer, estimate)
            if estimate.density is not None:
                nodes = estimate.density.nodes[0].cpu().numpy()
                weights = estimate.density.weights[0].cpu().numpy()
                title = f"Hessian spectral density ({layer}), step {step}"
                event.figures.append(
                    (
                        f"curvature/figures/density/{layer}",
                        lambda n=nodes, w=weights, t=title: spectral_density_figure(n, w, t),
                    )
                )

    def _refuse_if_too_large(
        self, module: nn.Module, batches: list[Any], optimizer: torch.optim.Optimizer | None
    ) -> None:
        """Turn the curvature family off when its estimated peak memory exceeds ``max_memory_ratio`` times a
        training step's, with a warning (strict: a ValueError) naming the estimate and the options that lower
        it. A refusal is the option's decision, not a failure: the end-of-run report does not list it."""
        options = self.curvature
        if options.max_memory_ratio is None or not self._spaces:
            return
        with probing(module, self.data.mode):
            activations = saved_activation_bytes(self._loss_closure(module, batches), module.parameters())
        sizes = [space.size for space in self._spaces.values()]
        memory = estimate_curvature_memory(module, sizes, options, optimizer, activations, len(batches))
        # Under DDP every rank measures or none does: the products are averaged over the ranks.
        if any_rank([memory.refused(options.max_memory_ratio)])[0]:
            self.families = [family for family in self.families if family != "curvature"]
            refusal = memory.refusal(options.max_memory_ratio, options.max_products)
            if self._strict:
                raise ValueError(refusal)
            self._warn(f"SpectralMonitor: {refusal}.")

    def _measure_jacobian(
        self,
        module: nn.Module,
        batches: list[Any],
        step: int,
        event: ProbeEvent,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        options = self.jacobian
        norms = block_jacobian_norms(
            module,
            lambda: self._loss(module, batches[0]),
            block_patterns=options.block_patterns,
            sequence=min(options.sequence, _batch_size(batches[0]) - 1),
            residual_branch=options.residual_branch,
            end_to_end=options.end_to_end,
            tol=options.tol,
            max_iters=options.max_iters,
            warm=self._jacobian_warm,
            mode=self.data.mode,
            generator=self._generator,
        )
        self._jacobian_warm = norms.warm
        for name, reason in norms.skipped.items():
            if name not in self._jacobian_skipped_warned:
                self._jacobian_skipped_warned.add(name)
                self._warn(f"SpectralMonitor: the Jacobian norm of {name!r} is not measured: {reason}")
        for layer, converged in norms.converged.items():
            event.measurements.append(Measurement(step, "jacobian", "converged", layer, float(converged)))
        for layer, value in norms.jacobian_norm.items():
            event.measurements.append(Measurement(step, "jacobian", "jacobian_norm", layer, value))
        for layer, value in norms.residual_branch_norm.items():
            event.measurements.append(Measurement(step, "jacobian", "residual_branch_norm", layer, value))
        if norms.end_to_end_norm is not None:
            event.measurements.append(
                Measurement(step, "jacobian", "end_to_end_norm", END_TO_END, norms.end_to_end_norm)
            )

    def _measure_ntk(
        self,
        module: nn.Module,
        batches: list[Any],
        step: int,
        event: ProbeEvent,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        batch = batches[0]
        if self.ntk.outputs_fn is not None:
            outputs_fn = lambda: self.ntk.outputs_fn(module, batch)  # noqa: E731
        else:
            count = min(self.ntk.examples, _batch_size(batch))
            outputs_fn = lambda: torch.stack([self._loss(module, _example(batch, i)) for i in range(count)])  # noqa: E731
        estimate = empirical_ntk(
            module, outputs_fn, max_bytes=int(self.ntk.max_megabytes * 2**20), mode=self.data.mode
        )
        for metric, value in (
            ("ntk_trace", estimate.trace),
            ("ntk_max_eigenvalue", estimate.max_eigenvalue),
            ("ntk_condition_number", estimate.condition_number),
            ("ntk_effective_rank", estimate.effective_rank),
        ):
            event.measurements.append(Measurement(step, "ntk", metric, WHOLE_MODEL, value))


def _spaces_still_current(spaces: dict[str, ParameterSpace], module: nn.Module) -> bool:
    shapes = {id(parameter): parameter.shape for parameter in module.parameters()}
    return all(
        shapes.get(id(parameter)) == parameter.shape
        for space in spaces.values()
        for parameter in space.parameters
    )

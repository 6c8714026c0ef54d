"""What the curvature probe may cost: its memory, bounded before the first event, and its time, by a cadence
that stretches to keep the probe's amortised share of training under a percentage.

Memory (:func:`estimate_curvature_memory`): an upper bound on the probe's peak from counts, against a
training step's peak from the same counts. Both hold the parameters and the optimizer state; a training step
adds the gradients and the activations its forward saves for the backward; the probe adds the gradient's
graph (built with ``create_graph`` and kept for every Hessian-vector product, about
:data:`GRAPH_PER_ACTIVATION` times the activations the forward of its batch saves) and parameter-sized
vectors: the Lanczos basis at the product budget (one vector per product, and while its buffer grows the old
buffer and the new one together), the Hutch++ sketch or the quadrature's bases when asked, the working
vectors of a product and of an iteration. The activations are
counted by one forward of the probe batch with a saved-tensors hook (each storage once, the parameters
left out), so no double backward is built to find out that it does not fit. ``docs/curvature.md`` compares
the estimate with measured peaks.

Time (:func:`stretched_interval`): after an event, the steps to the next one are at least
``100 · event seconds / (max_overhead_percent · training step seconds)``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from spectral_monitor.linalg.lanczos import INITIAL_BASIS_BLOCKS, GrowingRows
from spectral_monitor.linalg.operators import working_dtype

if TYPE_CHECKING:
    from spectral_monitor.core.second_order import CurvatureOptions

__all__ = [
    "ALWAYS_ALLOWED_BYTES",
    "GRAPH_PER_ACTIVATION",
    "WORKING_VECTORS",
    "STEP_WINDOW",
    "CurvatureMemory",
    "StretchedCadence",
    "estimate_curvature_memory",
    "lanczos_vectors",
    "saved_activation_bytes",
    "stretched_interval",
]

GRAPH_PER_ACTIVATION = 3.0
"""The gradient's kept graph, in units of the activations a forward saves: a bound on a held graph's resident
memory over the forward's saved tensors (``docs/curvature.md`` has the measured ratios)."""
WORKING_VECTORS = 20
"""Parameter-sized vectors a product and a Lanczos iteration hold beside the basis: about 6 for the product
(the cotangents, the products, their flat copies) and 12 for the iteration (the block, its orthogonalised
copies, the start, the Ritz vectors, the preconditioner and its scaled copies), and 2 to spare."""
STEP_WINDOW = 16
"""Training steps whose median duration the stretched cadence compares an event with."""
ALWAYS_ALLOWED_BYTES = 256 * 2**20
"""A probe estimated below this is never refused, whatever its ratio to a training step: a small model's
training step takes a few megabytes, and a basis of 128 of its vectors is no risk to any machine."""


@dataclass(frozen=True)
class CurvatureMemory:
    """The curvature probe's estimated peak (``probe_bytes``) against a training step's (``step_bytes``),
    with the parts that set it. Both are upper bounds in the sense of :mod:`this module
    <spectral_monitor.core.curvature_budget>`: a Lanczos run that converges before its budget holds fewer
    vectors.

    Attributes:
        probe_bytes: the probe's estimated peak, bytes.
        step_bytes: a training step's estimated peak, bytes.
        graph_bytes: the gradient's graph the probe keeps, bytes (part of ``probe_bytes``).
        vectors: the parameter-sized vectors the probe holds at once.
        vector_bytes: bytes of one vector over the largest parameter space.
        parameters: the size of the largest parameter space.

    Examples:
        >>> memory = CurvatureMemory(probe_bytes=3 * 2**30, step_bytes=2**30, graph_bytes=2**29, vectors=160,
        ...                          vector_bytes=2**24, parameters=2**22)
        >>> memory.refused(2.0), memory.refused(4.0), memory.refused(None)
        (True, False, False)
    """

    probe_bytes: int
    step_bytes: int
    graph_bytes: int
    vectors: int
    vector_bytes: int
    parameters: int

    def refused(self, max_ratio: float | None) -> bool:
        """Whether a probe allowed ``max_ratio`` times a training step's peak is refused (None: never).

        A probe under :data:`ALWAYS_ALLOWED_BYTES` is never refused.

        Args:
            max_ratio: the ``max_memory_ratio`` option, or None.

        Returns:
            Whether ``probe_bytes`` exceeds both ``max_ratio · step_bytes`` and :data:`ALWAYS_ALLOWED_BYTES`.
        """
        if max_ratio is None:
            return False
        return self.probe_bytes > max(max_ratio * self.step_bytes, ALWAYS_ALLOWED_BYTES)

    def refusal(self, max_ratio: float, max_products: int) -> str:
        """Why the probe is off, with the estimate and the options that lower it.

        Args:
            max_ratio: the ``max_memory_ratio`` that refused it.
            max_products: the ``max_products`` option, named as the first to lower.

        Returns:
            The message, without a final stop.
        """
        basis = _gib(self.vectors * self.vector_bytes)
        return (
            f"the curvature probe is off for this run: its peak memory is estimated at "
            f"{_gib(self.probe_bytes)} (up to {self.vectors} parameter-sized vectors of {self.parameters:,} "
            f"numbers, {basis}, and the gradient's graph of the probe batch, {_gib(self.graph_bytes)}), more "
            f"than max_memory_ratio={max_ratio:g} times a training step's {_gib(self.step_bytes)}. Lower "
            f"CurvatureOptions(max_products={max_products}) (the Lanczos basis holds a vector per product), "
            "measure parameter blocks instead of the whole model (CurvatureOptions(blocks=[...], "
            "whole_model=False)), give the probe fewer sequences (ProbeDataOptions(loss_fn=...) on a slice "
            "of the batch), or set CurvatureOptions(max_memory_ratio=None) to measure anyway"
        )


def _gib(count: int) -> str:
    return f"{count / 2**30:.2f} GiB"


def lanczos_vectors(max_products: int) -> int:
    """The most basis vectors a single-vector Lanczos run of ``max_products`` products holds at once: its
    basis buffer starts with room for :data:`~spectral_monitor.linalg.lanczos.INITIAL_BASIS_BLOCKS` and grows
    by :attr:`~spectral_monitor.linalg.lanczos.GrowingRows.GROWTH`, the old buffer and the new one both held
    while the rows are copied.

    Args:
        max_products: the run's product budget.

    Returns:
        The largest number of vectors held, at least ``max_products`` once the buffer has grown.

    Examples:
        >>> lanczos_vectors(8), lanczos_vectors(128)
        (8, 225)
    """
    capacity = min(max_products, INITIAL_BASIS_BLOCKS)
    most = capacity
    while capacity < max_products:
        grown = max(capacity + 1, int(capacity * GrowingRows.GROWTH))
        most = max(most, capacity + grown)
        capacity = grown
    return most


def saved_activation_bytes(loss_fn: Callable[[], Tensor], parameters: Iterable[Tensor]) -> int:
    """Bytes of the tensors one evaluation of ``loss_fn`` saves for its backward, each storage once and the
    ``parameters`` left out (they are resident anyway). The graph is freed on return.

    Args:
        loss_fn: the probe loss, evaluated once with grad enabled.
        parameters: tensors whose storages are not counted.

    Returns:
        The bytes of the distinct storages saved, those without a plain storage (sparse, nested) not counted.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> layer, x = nn.Linear(4, 2), torch.ones(3, 4)
        >>> saved_activation_bytes(lambda: layer(x).square().sum(), layer.parameters())  # x and the output
        72
    """
    resident = {parameter.untyped_storage().data_ptr() for parameter in parameters}
    storages: dict[int, int] = {}

    def count(tensor: Tensor) -> Tensor:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without a plain storage (sparse, nested)
            return tensor
        if storage.data_ptr() not in resident:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
        loss_fn()
    return sum(storages.values())


def estimate_curvature_memory(
    module: nn.Module,
    space_sizes: Sequence[int],
    options: CurvatureOptions,
    optimizer: torch.optim.Optimizer | None,
    activation_bytes: int,
    probe_batches: int = 1,
) -> CurvatureMemory:
    """The curvature probe's peak with ``options`` over the parameter spaces of ``space_sizes`` (measured one
    after another: the largest sets the peak), and a training step's, as in
    the module docstring.

    Args:
        module: the model; its parameters, gradients and their dtype are counted.
        space_sizes: the size of each parameter space measured.
        options: the curvature options (``top_k``, ``min_eigenvalue``, ``max_products``,
            ``trace_products``, ``density_probes``, ``density_steps``).
        optimizer: the training optimizer, whose state both peaks hold (before its first step, what it
            will hold). None: no state.
        activation_bytes: what the forward of the probe loss saves (:func:`saved_activation_bytes`).
        probe_batches: how many batches of the training step's size the probe loss runs over.

    Returns:
        The two peaks and the parts that set them.

    Examples:
        >>> from torch import nn
        >>> from spectral_monitor.core.second_order import CurvatureOptions
        >>> memory = estimate_curvature_memory(nn.Linear(4, 2), [10], CurvatureOptions(), None, 72)
        >>> memory.vectors, memory.vector_bytes, memory.refused(2.0)
        (246, 40, False)
    """
    parameters = list(module.parameters())
    parameter_bytes = sum(p.numel() * p.element_size() for p in parameters)
    gradient_bytes = sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)
    state_bytes = _optimizer_state_bytes(optimizer) if optimizer is not None else 0
    dtype = next((p.dtype for p in parameters if p.dtype.is_floating_point), torch.float32)
    itemsize = torch.empty((), dtype=working_dtype(dtype)).element_size()
    largest = max(space_sizes)
    top_k = options.top_k
    # The eigenvalue runs, the trace and the density run one after another: the widest of them sets the peak.
    held = max(
        lanczos_vectors(options.max_products) + top_k,
        options.trace_products,
        options.density_probes * (options.density_steps + 1),
    )
    vectors = held + WORKING_VECTORS
    graph_bytes = math.ceil(GRAPH_PER_ACTIVATION * activation_bytes)
    probe = parameter_bytes + state_bytes + graph_bytes + vectors * largest * itemsize
    step = parameter_bytes + gradient_bytes + state_bytes + activation_bytes // probe_batches
    return CurvatureMemory(
        probe_bytes=probe,
        step_bytes=step,
        graph_bytes=graph_bytes,
        vectors=vectors,
        vector_bytes=largest * itemsize,
        parameters=largest,
    )


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state (Adam's two moments, momentum buffers), or, before its
    first step, of what that state will be: two numbers per parameter for Adam and AdamW, one for RMSprop
    and SGD with momentum, none otherwise."""
    held = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, Tensor) and value.ndim > 0
    )
    if held:
        return held
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        per_parameter = 2
    elif isinstance(optimizer, torch.optim.RMSprop) or any(g.get("momentum") for g in optimizer.param_groups):
        per_parameter = 1
    else:
        per_parameter = 0
    return per_parameter * sum(
        p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"]
    )


class StretchedCadence:
    """When the next event may come, so that each event's time spread over the steps to the next one is at
    most ``max_overhead_percent`` of the training steps' time (:func:`stretched_interval`, with the median
    of the last :data:`STEP_WINDOW` training steps). The interval after an event is decided at the first
    step after the event (the first whose training step has been timed since).

    Args:
        every_n_steps: the options' cadence: the fewest steps between events.
        max_overhead_percent: the probe's most amortised share of training time, in percent.

    Attributes:
        last_event: the step of the last event, or None before the first.
        interval: the steps from the last event to the next one, once decided; else None.

    Examples:
        >>> cadence = StretchedCadence(every_n_steps=10, max_overhead_percent=10.0)
        >>> cadence.measured(100, seconds=2.0)
        >>> cadence.step_took(0.5)
        >>> cadence.decide(), cadence.allows(139), cadence.allows(140)
        (40, False, True)
    """

    def __init__(self, every_n_steps: int, max_overhead_percent: float) -> None:
        self.every_n_steps = every_n_steps
        self.max_overhead_percent = max_overhead_percent
        self.last_event: int | None = None
        self.interval: int | None = None
        self._event_seconds: float | None = None
        self._step_seconds: deque[float] = deque(maxlen=STEP_WINDOW)

    def step_took(self, seconds: float) -> None:
        """Record a training step's duration; the median of the last :data:`STEP_WINDOW` counts.

        Args:
            seconds: the training step's wall time.
        """
        self._step_seconds.append(seconds)

    def decide(self) -> int | None:
        """Decide the interval after the last event, when it can now be decided.

        Returns:
            The interval (also kept in :attr:`interval`); None when there was no event since the last
            decision or no training step has been timed.
        """
        if self._event_seconds is None or not self._step_seconds:
            return None
        self.interval = stretched_interval(
            self.every_n_steps,
            self._event_seconds,
            statistics.median(self._step_seconds),
            self.max_overhead_percent,
        )
        self._event_seconds = None
        return self.interval

    def allows(self, step: int) -> bool:
        """Whether an event due by the options' cadence at ``step`` is far enough from the last one.

        Args:
            step: the step of the event due.

        Returns:
            True before the first event, else whether ``step`` is at least the interval (``every_n_steps``
            while undecided) past the last event.
        """
        if self.last_event is None:
            return True
        # Undecided only when no training step was timed since the event (a resume in between).
        interval = self.interval if self.interval is not None else self.every_n_steps
        return step - self.last_event >= interval

    def measured(self, step: int, seconds: float) -> None:
        """Record an event; its interval is decided at the next :meth:`decide` after a timed step.

        Args:
            step: the event's step.
            seconds: the event's wall time.
        """
        self.last_event, self.interval, self._event_seconds = step, None, seconds


def stretched_interval(
    every_n_steps: int, event_seconds: float, step_seconds: float, max_overhead_percent: float
) -> int:
    """Steps from an event to the next one so that the event's time, spread over them, is at most
    ``max_overhead_percent`` of the training steps' time; never fewer than ``every_n_steps``.

    Args:
        every_n_steps: the fewest steps between events.
        event_seconds: the event's wall time.
        step_seconds: a training step's wall time.
        max_overhead_percent: the most share of training time, in percent.

    Returns:
        max(``every_n_steps``, ⌈100 · ``event_seconds`` / (``max_overhead_percent`` · ``step_seconds``)⌉).

    Examples:
        >>> stretched_interval(10, event_seconds=2.0, step_seconds=0.5, max_overhead_percent=10.0)
        40
        >>> stretched_interval(50, event_seconds=2.0, step_seconds=0.5, max_overhead_percent=10.0)
        50
    """
    needed = 100.0 * event_seconds / (max_overhead_percent * step_seconds)
    return max(every_n_steps, math.ceil(needed))

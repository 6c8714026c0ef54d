"""The options of the opt-in curvature, Jacobian and NTK probes: what they measure, how often, on what data.

Each is validated when made (a ValueError names the option and what it takes) and read by
:class:`~spectral_monitor.core.second_order.SecondOrderProbes`, which runs the probes during training;
:class:`~spectral_monitor.core.MonitorOptions` holds one of each. All four are re-exported by
:mod:`spectral_monitor.core.second_order` and the package root.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor, nn

from spectral_monitor.probes._autodiff import PROBE_MODES, ProbeMode
from spectral_monitor.probes.curvature import HESSIAN_METHODS, HessianMethod
from spectral_monitor.probes.ntk import MAX_EXAMPLES
from spectral_monitor.probes.parameter_space import BLOCK_PRESETS, ParameterSpace
from spectral_monitor.validation import (
    check_bool,
    check_callable,
    check_choice,
    check_int,
    check_mapping,
    check_names,
    check_number,
)

__all__ = ["CurvatureOptions", "JacobianOptions", "NTKOptions", "ProbeDataOptions"]

Schedule = Literal["linear", "log"]
ProbeBatch = Literal["fixed", "current", "averaged"]
WHOLE_MODEL = "model"
"""The layer of the measurements over the whole model: the Hessian over every trainable parameter, the
probes' overheads."""


def _check_cadence(every_n_steps: object, schedule: object) -> None:
    check_int("every_n_steps", every_n_steps, smallest=1)
    check_choice("schedule", schedule, ("linear", "log"))


@dataclass
class CurvatureOptions:
    """The loss-Hessian probe (family ``"curvature"``).

    Args:
        every_n_steps: measure at step 0 and when (step + 1) % every_n_steps == 0.
        schedule: ``"linear"``, or ``"log"``: also at steps 1, 3, 7, ... below ``every_n_steps``.
        top_k: largest algebraic eigenvalues written (``hessian_eigenvalue_1..k``).
        min_eigenvalue: also the most negative eigenvalue (``hessian_min_eigenvalue``).
        trace_products: Hessian-vector products for the Hutch++ trace (``hessian_trace``, ``_se``); 0: none.
        density_probes: probes of the stochastic Lanczos quadrature drawn as a spectral-density figure;
            0: none.
        density_steps: Lanczos steps per density probe.
        blocks: restrict the Hessian to parameter blocks as well: names of ``BLOCK_PRESETS`` (``query``,
            ``key``, ``value``, ``attention_output``, ``mlp``, ``embeddings``, ``norms``) or a mapping of
            block name to ``fnmatch`` patterns over parameter names. Each block is its own layer.
        whole_model: measure the Hessian over every trainable parameter (layer ``"model"``).
        max_products: Hessian-vector products each Lanczos run may spend per event.
        tol: eigenvalue error bound, relative to each eigenvalue itself, at which Lanczos stops (with the
            cluster past it resolved and the gap certified from the random start: ``docs/curvature.md``).
            Every event also writes ``converged`` (1 or 0) and ``hessian_products``; the alerts never read
            a layer's values at an event that did not converge.
        method: how Hessian-vector products are formed: ``"autograd"`` (a double backward through the
            gradient's kept graph) or ``"func"`` (``torch.func``).
        max_overhead_percent: stretch the cadence so that each event's time, spread over the steps to the
            next one, is at most this percentage of the training steps' time: the next event waits for the
            first step of the cadence at least 100 · event seconds / (max_overhead_percent · median step
            seconds) steps on, written as ``curvature/every_n_steps/model``. None: ``every_n_steps`` alone.
        max_memory_ratio: before the first event, estimate the probe's peak memory and a training step's
            (:mod:`spectral_monitor.core.curvature_budget`, from the parameter, optimizer-state and
            activation counts); when the probe's exceeds this many times the step's (and 256 MiB), the probe
            is off for the run, with a message naming the estimate and the options that lower it (strict
            mode raises it). None: never refused.

    Raises:
        ValueError: If an option is out of its range or of the wrong type, a block preset is unknown, or
            ``whole_model=False`` comes without ``blocks``.

    Examples:
        >>> from torch import nn
        >>> options = CurvatureOptions(every_n_steps=50, top_k=2, blocks=["query", "mlp"])
        >>> layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16)
        >>> {name: space.size for name, space in options.spaces(layer).items()}
        {'model': 600, 'query': 72, 'mlp': 280}
    """

    every_n_steps: int = 100
    schedule: Schedule = "linear"
    top_k: int = 1
    min_eigenvalue: bool = False
    trace_products: int = 0
    density_probes: int = 0
    density_steps: int = 30
    blocks: list[str] | dict[str, list[str]] | None = None
    whole_model: bool = True
    max_products: int = 128
    tol: float = 1e-3
    method: HessianMethod = "autograd"
    max_overhead_percent: float | None = None
    max_memory_ratio: float | None = None

    def __post_init__(self) -> None:
        _check_cadence(self.every_n_steps, self.schedule)
        check_int("top_k", self.top_k, smallest=1)
        check_bool("min_eigenvalue", self.min_eigenvalue)
        if isinstance(self.trace_products, bool) or self.trace_products != 0:
            check_int("trace_products (0: off)", self.trace_products, smallest=6)
        if isinstance(self.density_probes, bool) or self.density_probes != 0:
            check_int("density_probes (0: off)", self.density_probes, smallest=2)
        check_int("density_steps", self.density_steps, smallest=1)
        if isinstance(self.blocks, Mapping):
            for block, patterns in check_mapping("blocks", self.blocks).items():
                check_names(f"blocks[{block!r}]", patterns, non_empty=True)
        elif self.blocks is not None:
            check_names("blocks", self.blocks, allowed=sorted(BLOCK_PRESETS), non_empty=True)
        check_bool("whole_model", self.whole_model)
        if not self.whole_model and not self.blocks:
            raise ValueError("whole_model=False needs blocks to measure")
        check_int("max_products", self.max_products, smallest=max(2, self.top_k))
        check_number("tol", self.tol, above=0.0, below=1.0)
        check_choice("method", self.method, HESSIAN_METHODS)
        if self.max_overhead_percent is not None:
            check_number("max_overhead_percent", self.max_overhead_percent, above=0.0, unit="percentage")
        if self.max_memory_ratio is not None:
            check_number("max_memory_ratio", self.max_memory_ratio, above=0.0, unit="ratio")

    def spaces(
        self, module: nn.Module, warn: Callable[[str], None] = warnings.warn
    ) -> dict[str, ParameterSpace]:
        """The parameter space of each layer measured: ``"model"`` and each block.

        A block that cannot be formed on ``module`` (its patterns match no trainable parameter) costs that
        block only: one warning names it, and the others are measured.

        Args:
            module: The module whose parameters are chosen.
            warn: Receives the warning about a block that cannot be formed.

        Returns:
            ``{"model": ..., block: ...}``: ``"model"`` first with ``whole_model``, then the blocks in order.
        """
        spaces = {WHOLE_MODEL: ParameterSpace.of(module)} if self.whole_model else {}
        blocks = self.blocks or {}
        patterns = (
            blocks if isinstance(blocks, Mapping) else {name: list(BLOCK_PRESETS[name]) for name in blocks}
        )
        for name, block_patterns in patterns.items():
            try:
                spaces[name] = ParameterSpace.of(module, block_patterns)
            except ValueError as error:
                warn(
                    f"SpectralMonitor: curvature block {name!r} is not measured on {type(module).__name__}: "
                    f"{error}; the other layers of the curvature family are."
                )
        return spaces


@dataclass
class JacobianOptions:
    """The block-Jacobian probe (family ``"jacobian"``).

    Args:
        every_n_steps: as in :class:`CurvatureOptions`.
        schedule: as in :class:`CurvatureOptions`.
        block_patterns: ``fnmatch`` patterns naming the blocks (default: found automatically).
        sequence: which sequence of the probe batch the Jacobians are of.
        residual_branch: also ‖J − I‖₂ (``residual_branch_norm``).
        end_to_end: also the norm from the first block's input to the last block's output.
        max_iters: Lanczos iterations (of two products each way) per norm.
        tol: relative Ritz residual of the Gram operator at which Lanczos stops (with the gap to σ₂
            certified from the random start); each block writes ``converged`` (1 or 0), and the alerts
            never read a block's norms at an event that did not converge.

    Raises:
        ValueError: If an option is out of its range or of the wrong type.

    Examples:
        >>> options = JacobianOptions(every_n_steps=10, schedule="log", residual_branch=False)
        >>> options.end_to_end, options.max_iters
        (True, 40)
    """

    every_n_steps: int = 100
    schedule: Schedule = "linear"
    block_patterns: list[str] | None = None
    sequence: int = 0
    residual_branch: bool = True
    end_to_end: bool = True
    max_iters: int = 40
    tol: float = 1e-3

    def __post_init__(self) -> None:
        _check_cadence(self.every_n_steps, self.schedule)
        if self.block_patterns is not None:
            check_names("block_patterns", self.block_patterns)
        check_int("sequence", self.sequence, smallest=0)
        check_bool("residual_branch", self.residual_branch)
        check_bool("end_to_end", self.end_to_end)
        check_int("max_iters", self.max_iters, smallest=1)
        check_number("tol", self.tol, above=0.0, below=1.0)


@dataclass
class NTKOptions:
    """The empirical-NTK probe (family ``"ntk"``).

    Args:
        every_n_steps: as in :class:`CurvatureOptions`.
        schedule: as in :class:`CurvatureOptions`.
        examples: examples of the probe batch in the kernel (at most 64).
        max_megabytes: most memory the per-example gradients may take; beyond it the kernel is built a
            column at a time.
        outputs_fn: ``outputs_fn(module, batch) -> (N,)`` per-example outputs; default: the loss of
            ``training_step`` on each example of the batch alone.

    Raises:
        ValueError: If an option is out of its range or of the wrong type.

    Examples:
        >>> NTKOptions(examples=8).max_megabytes
        256.0
    """

    every_n_steps: int = 100
    schedule: Schedule = "linear"
    examples: int = 16
    max_megabytes: float = 256.0
    outputs_fn: Callable[[nn.Module, Any], Tensor] | None = None

    def __post_init__(self) -> None:
        _check_cadence(self.every_n_steps, self.schedule)
        check_int("examples", self.examples, smallest=1, largest=MAX_EXAMPLES)
        check_number("max_megabytes", self.max_megabytes, above=0.0, unit="positive number of megabytes")
        check_callable("outputs_fn", self.outputs_fn)


@dataclass
class ProbeDataOptions:
    """What the curvature, Jacobian and NTK probes compute their loss on.

    Args:
        probe_batch: ``"fixed"``: a copy of the batch of the first event, kept for the whole run (the
            curves then follow the model, not the data); ``"current"``: the batch of each event;
            ``"averaged"``: the mean loss over copies of the first ``probe_batches`` batches of the run.
        probe_batches: batches averaged with ``"averaged"``.
        loss_fn: ``loss_fn(module, batch) -> scalar`` instead of ``training_step`` (needed with manual
            optimisation).
        mode: the module's mode during probes: ``"eval"`` (deterministic; no dropout) or ``"train"``
            (dropout from a forked RNG stream; batch-norm statistics restored afterwards).

    Raises:
        ValueError: If an option is out of its range or of the wrong type.

    Examples:
        >>> options = ProbeDataOptions(probe_batch="averaged", probe_batches=2)
        >>> options.mode, options.loss_fn is None
        ('eval', True)
    """

    probe_batch: ProbeBatch = "fixed"
    probe_batches: int = 4
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None
    mode: ProbeMode = "eval"

    def __post_init__(self) -> None:
        check_choice("probe_batch", self.probe_batch, ("fixed", "current", "averaged"))
        check_int("probe_batches", self.probe_batches, smallest=1)
        check_callable("loss_fn", self.loss_fn)
        check_choice("mode", self.mode, PROBE_MODES)

"""The empirical neural tangent kernel of a model on a few examples.

K = J Jᵀ with J the Jacobian of per-example outputs f (N,) (per-example losses, or a scalar output per
example) with respect to the parameters: K_ij = ⟨∇f_i, ∇f_j⟩. When N × P numbers fit in ``max_bytes``, J is
formed by one batched backward; otherwise K is built a column at a time, K e_i = J (Jᵀ e_i), with Jᵀ e_i one
backward and J u one backward of a backward (the double-vjp identity) through the same kept graph, so only
one parameter-sized vector exists at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from spectral_monitor.metrics._common import effective_rank_from_singular_values
from spectral_monitor.probes._autodiff import ProbeMode, batched_grad, probing
from spectral_monitor.probes.curvature import ParameterSpace

__all__ = ["NTKEstimate", "empirical_ntk"]

MAX_EXAMPLES = 64


@dataclass
class NTKEstimate:
    """The empirical NTK and its summaries, as :func:`empirical_ntk` returns them.

    A kernel holding NaN or inf (a non-finite output or gradient) has NaN eigenvalues and summaries.

    Attributes:
        kernel: K, (N, N).
        eigenvalues: K's eigenvalues (N,), descending.
        trace: tr K.
        max_eigenvalue: λ_max.
        condition_number: λ_max/λ_min; inf when λ_min ≤ 0.
        effective_rank: Roy & Vetterli's effective rank of the eigenvalues.
        materialised: Whether J was formed (else K was built a column at a time).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> linear = nn.Linear(2, 1, bias=False)
        >>> ntk = empirical_ntk(linear, lambda: linear(torch.tensor([[1.0, 0.0], [1.0, 1.0]])).squeeze(-1))
        >>> ntk.eigenvalues.tolist() == sorted(ntk.eigenvalues.tolist(), reverse=True), ntk.trace
        (True, 3.0)
    """

    kernel: Tensor
    eigenvalues: Tensor
    trace: float
    max_eigenvalue: float
    condition_number: float
    effective_rank: float
    materialised: bool


def empirical_ntk(
    module: nn.Module,
    outputs_fn: Callable[[], Tensor],
    *,
    space: ParameterSpace | None = None,
    max_bytes: int = 256 * 2**20,
    mode: ProbeMode = "eval",
) -> NTKEstimate:
    """The empirical NTK of the per-example outputs ``outputs_fn()``.

    Runs in ``probing(module, mode)``.

    Args:
        module: The model.
        outputs_fn: Returns the per-example outputs, a (N,) tensor with N ≤ 64 (per-example losses, or a
            scalar output per example).
        space: The parameters the Jacobian is taken over; by default every trainable parameter.
        max_bytes: J is formed when its N × P numbers fit in this; otherwise K is built a column at a time.
        mode: ``"eval"`` or ``"train"``, the module's mode while probed.

    Returns:
        The (N, N) kernel and its eigenvalues and summaries.

    Raises:
        ValueError: ``outputs_fn`` does not return a (N,) tensor with 1 ≤ N ≤ 64.

    Examples:
        The kernel of a linear map on orthonormal inputs is the identity:

        >>> import torch
        >>> from torch import nn
        >>> linear = nn.Linear(3, 1, bias=False)
        >>> ntk = empirical_ntk(linear, lambda: linear(torch.eye(3)).squeeze(-1))
        >>> ntk.kernel
        tensor([[1., 0., 0.],
                [0., 1., 0.],
                [0., 0., 1.]])
        >>> ntk.trace, ntk.materialised
        (3.0, True)
    """
    space = space if space is not None else ParameterSpace.of(module)
    with probing(module, mode):
        outputs = outputs_fn()
        if not isinstance(outputs, Tensor) or outputs.ndim != 1 or not 1 <= outputs.shape[0] <= MAX_EXAMPLES:
            shape = tuple(outputs.shape) if isinstance(outputs, Tensor) else type(outputs).__name__
            raise ValueError(
                f"outputs_fn must return a (N,) tensor with 1 <= N <= {MAX_EXAMPLES}, got {shape}"
            )
        n = outputs.shape[0]
        identity = torch.eye(n, dtype=outputs.dtype, device=outputs.device)
        materialised = n * space.size * outputs.element_size() <= max_bytes
        if materialised:
            jacobian = space.flatten(batched_grad(outputs, space.parameters, [identity]))
            kernel = jacobian @ jacobian.T
        else:
            kernel = _kernel_by_columns(outputs, space)
        kernel = ((kernel + kernel.T) / 2).detach()
    if not bool(kernel.isfinite().all()):
        # eigh fails to converge on NaN; NaN summaries let the monitor write and report them as for any probe.
        eigenvalues = torch.full((n,), math.nan, dtype=torch.float64, device=kernel.device)
        return NTKEstimate(kernel, eigenvalues, math.nan, math.nan, math.nan, math.nan, materialised)
    eigenvalues = torch.linalg.eigvalsh(kernel.double()).flip(0)
    smallest = float(eigenvalues[-1])
    largest = float(eigenvalues[0])
    return NTKEstimate(
        kernel=kernel,
        eigenvalues=eigenvalues,
        trace=float(kernel.diagonal().sum()),
        max_eigenvalue=largest,
        condition_number=largest / smallest if smallest > 0 else float("inf"),
        effective_rank=float(effective_rank_from_singular_values(eigenvalues.clamp_min(0))),
        materialised=materialised,
    )


def _kernel_by_columns(outputs: Tensor, space: ParameterSpace) -> Tensor:
    """K e_i = J (Jᵀ e_i) for each i, holding one parameter-sized vector at a time."""
    n = outputs.shape[0]
    dummy = torch.zeros_like(outputs, requires_grad=True)
    transposed = torch.autograd.grad(outputs, space.parameters, dummy, create_graph=True, allow_unused=True)
    live = [i for i, t in enumerate(transposed) if t is not None and t.requires_grad]
    if not live:  # outputs that do not depend on these parameters
        return outputs.new_zeros((n, n)).detach()
    columns = []
    for i in range(n):
        unit = torch.zeros((1, n), dtype=outputs.dtype, device=outputs.device)
        unit[0, i] = 1
        row = space.unflatten(space.flatten(batched_grad(outputs, space.parameters, [unit])))
        (column,) = batched_grad([transposed[j] for j in live], [dummy], [row[j] for j in live])
        columns.append(column[0])
    return torch.stack(columns, dim=1)

"""Framework-free numerics on torch tensors and matrix-free operators.

Batched, warm-startable block Lanczos for extreme eigenpairs and singular triplets, stochastic Lanczos
quadrature for spectral sums, Hutchinson and Hutch++ traces. Nothing here knows about modules or Lightning.

Examples:
    The same operator, a batch of one diagonal matrix, through each estimator:

    >>> import torch
    >>> matrix = torch.diag(torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64))[None]
    >>> op = DenseOperator(matrix, symmetric=True)
    >>> lanczos_eigsh(op, k=2, generator=torch.Generator()).values.round(decimals=6)
    tensor([[9., 4.]], dtype=torch.float64)
    >>> top_singular(op, generator=torch.Generator()).values.round(decimals=6)
    tensor([[9.]], dtype=torch.float64)
    >>> hutchinson_trace(op).mean
    tensor([14.], dtype=torch.float64)
    >>> nuclear = {"nuclear": lambda x: x.clamp_min(0).sqrt()}
    >>> sums = spectral_sums(lanczos_quadrature(op, num_probes=2), nuclear)
    >>> round(sums["nuclear"].mean.item(), 6)
    6.0
"""

from spectral_monitor.linalg.lanczos import (
    ConvergenceInfo,
    EigenResult,
    SingularResult,
    lanczos_eigsh,
    top_singular,
)
from spectral_monitor.linalg.operators import (
    BatchedOperator,
    DenseOperator,
    FunctionOperator,
    GramOperator,
    ProjectedOperator,
    StackedOperator,
    as_operator,
)
from spectral_monitor.linalg.quadrature import (
    QuadratureNodes,
    TraceEstimate,
    hutchinson_trace,
    hutchpp_trace,
    lanczos_quadrature,
    spectral_sums,
)

__all__ = [
    "BatchedOperator",
    "ConvergenceInfo",
    "DenseOperator",
    "EigenResult",
    "FunctionOperator",
    "GramOperator",
    "ProjectedOperator",
    "StackedOperator",
    "QuadratureNodes",
    "SingularResult",
    "TraceEstimate",
    "as_operator",
    "hutchinson_trace",
    "hutchpp_trace",
    "lanczos_eigsh",
    "lanczos_quadrature",
    "spectral_sums",
    "top_singular",
]

"""Framework-free numerics on torch tensors and matrix-free operators.

Batched, warm-startable block Lanczos for extreme eigenpairs and singular triplets, stochastic Lanczos
quadrature for spectral sums, Hutchinson and Hutch++ traces. Nothing here knows about modules or Lightning.
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

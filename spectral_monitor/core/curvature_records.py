"""The ``curvature`` records of one curvature event, under the tag names agreed across the project."""

from __future__ import annotations

import math

from spectral_monitor.probes.curvature import CurvatureEstimate
from spectral_monitor.records import Measurement

__all__ = ["curvature_measurements"]


def curvature_measurements(step: int, layer: str, estimate: CurvatureEstimate) -> list[Measurement]:
    """The ``curvature`` records of one estimate, under the tag names agreed across the project.

    ``hessian_eigenvalue_{k}`` for each of the top-k eigenvalues (k from 1, descending),
    ``gradient_alignment``, ``converged`` (1.0 or 0.0), ``hessian_products`` and ``sharpness``; with an edge
    of stability ``sharpness_threshold`` and ``sharpness_ratio`` (sharpness / threshold); with a bottom
    eigenvalue ``hessian_min_eigenvalue``; with a trace ``hessian_trace`` and its standard error
    ``hessian_trace_se``. A NaN value (the sharpness before Adam's first step, a one-probe standard error) is
    left out, never written.

    Args:
        step: the global step the records are filed under.
        layer: the parameter space's name (the records' layer).
        estimate: what the curvature event measured.

    Returns:
        The records, in the order above, none of them NaN.

    Examples:
        >>> import torch
        >>> from spectral_monitor.probes.curvature import EdgeOfStability
        >>> estimate = CurvatureEstimate(
        ...     eigenvalues=torch.tensor([4.0, 1.0]), sharpness=4.0, edge=EdgeOfStability("sgd", 0.5, 4.0),
        ...     min_eigenvalue=None, trace=None, density=None, gradient_alignment=float("nan"), products=12,
        ...     converged=True,
        ... )
        >>> [(r.metric, r.value) for r in curvature_measurements(10, "model", estimate)]
        [('hessian_eigenvalue_1', 4.0), ('hessian_eigenvalue_2', 1.0), ('converged', 1.0),
         ('hessian_products', 12.0), ('sharpness', 4.0), ('sharpness_threshold', 4.0),
         ('sharpness_ratio', 1.0)]
    """
    records = [
        Measurement(step, "curvature", f"hessian_eigenvalue_{k + 1}", layer, float(value))
        for k, value in enumerate(estimate.eigenvalues.tolist())
    ]
    records.append(Measurement(step, "curvature", "gradient_alignment", layer, estimate.gradient_alignment))
    records.append(Measurement(step, "curvature", "converged", layer, float(estimate.converged)))
    records.append(Measurement(step, "curvature", "hessian_products", layer, float(estimate.products)))
    edge = estimate.edge
    records.append(Measurement(step, "curvature", "sharpness", layer, estimate.sharpness))
    if edge is not None:
        records.append(Measurement(step, "curvature", "sharpness_threshold", layer, edge.threshold))
        records.append(
            Measurement(step, "curvature", "sharpness_ratio", layer, estimate.sharpness / edge.threshold)
        )
    if estimate.min_eigenvalue is not None:
        records.append(
            Measurement(step, "curvature", "hessian_min_eigenvalue", layer, estimate.min_eigenvalue)
        )
    if estimate.trace is not None:
        records.append(Measurement(step, "curvature", "hessian_trace", layer, float(estimate.trace.mean[0])))
        records.append(
            Measurement(step, "curvature", "hessian_trace_se", layer, float(estimate.trace.stderr[0]))
        )
    return [record for record in records if not math.isnan(record.value)]

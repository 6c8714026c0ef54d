"""The ``curvature`` records of one curvature event, under the tag names agreed across the project."""

from __future__ import annotations

import math

from spectral_monitor.probes.curvature import CurvatureEstimate
from spectral_monitor.records import Measurement

__all__ = ["curvature_measurements"]


def curvature_measurements(step: int, layer: str, estimate: CurvatureEstimate) -> list[Measurement]:
    """The ``curvature`` records of one estimate (names agreed across the project)."""
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

"""The plain records that flow from probes to sinks.

Every sink and the report read the same records, so a number means the same thing wherever it appears.
A record knows nothing of how it was computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Measurement:
    """One scalar: ``value`` of ``metric`` for ``layer`` (and ``head``, if per head) at ``step``.

    ``family`` groups metrics by what was observed: ``"attention"``, ``"tokens"``, ``"weights"``, ...
    ``head`` is ``None`` for a per-layer value (a head aggregate is a metric of its own: ``entropy_min``).
    """

    step: int
    family: str
    metric: str
    layer: str
    value: float
    head: int | None = None

    @cached_property  # read by the alerts, the layout and every sink: ~2,000 times a demo logging step
    def tag(self) -> str:
        """The TensorBoard tag: grouped by family and metric first, so the Scalars tab reads by metric."""
        where = self.layer if self.head is None else f"{self.layer}/head_{self.head}"
        return f"{self.family}/{self.metric}/{where}"


@dataclass(frozen=True)
class Distribution:
    """A set of values drawn at one step (per-head values of a metric, or singular values), for histograms."""

    step: int
    family: str
    name: str
    layer: str
    values: np.ndarray = field(repr=False)

    @cached_property
    def tag(self) -> str:
        return f"{self.family}/{self.name}/{self.layer}"

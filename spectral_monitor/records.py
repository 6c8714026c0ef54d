"""The plain records that flow from probes to sinks.

Every sink and the report read the same records, so a number means the same thing wherever it appears.
A record knows nothing of how it was computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

__all__ = ["Distribution", "Measurement"]


@dataclass(frozen=True)
class Measurement:
    """One scalar: ``value`` of ``metric`` for ``layer`` (and ``head``, if per head) at ``step``.

    Attributes:
        step: The training step it was measured at.
        family: What was observed: ``"attention"``, ``"tokens"``, ``"weights"``, ...
        metric: The metric's name in the catalogue (``docs/metrics.md``).
        layer: The module's qualified name in the model.
        value: The measured value.
        head: The attention head, or None for a per-layer value (a head aggregate is a metric of its own:
            ``entropy_min``).

    Examples:
        >>> Measurement(step=10, family="attention", metric="entropy", layer="blocks.0.attn", value=0.7).tag
        'attention/entropy/blocks.0.attn'
        >>> Measurement(10, "attention", "entropy", "blocks.0.attn", 0.7, head=3).tag
        'attention/entropy/blocks.0.attn/head_3'
    """

    step: int
    family: str
    metric: str
    layer: str
    value: float
    head: int | None = None

    @cached_property  # read by the alerts, the layout and every sink
    def tag(self) -> str:
        """The TensorBoard tag: grouped by family and metric first, so the Scalars tab reads by metric."""
        where = self.layer if self.head is None else f"{self.layer}/head_{self.head}"
        return f"{self.family}/{self.metric}/{where}"


@dataclass(frozen=True)
class Distribution:
    """A set of values drawn at one step (per-head values of a metric, or singular values), for histograms.

    Attributes:
        step: The training step they were measured at.
        family: What was observed, as in :class:`Measurement`.
        name: The name of the set (a metric's name, or ``singular_values``).
        layer: The module's qualified name in the model.
        values: The values, a NumPy array of any shape.

    Examples:
        >>> import numpy as np
        >>> Distribution(10, "weights", "singular_values", "blocks.0.mlp", np.array([3.0, 1.0])).tag
        'weights/singular_values/blocks.0.mlp'
    """

    step: int
    family: str
    name: str
    layer: str
    values: np.ndarray = field(repr=False)

    @cached_property
    def tag(self) -> str:
        """The TensorBoard tag of the histogram: ``family/name/layer``."""
        return f"{self.family}/{self.name}/{self.layer}"

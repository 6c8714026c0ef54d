"""The monitor without a training framework: :class:`MonitorSession` runs one training run's logging steps
(arm the probes around a forward → measure → records → alerts → sinks) for any integration.

Nothing under this package imports Lightning or another training framework; the adapters
(:mod:`spectral_monitor.lightning`, :mod:`spectral_monitor.integrations`) turn a training loop's events into
:class:`MonitorSession` calls.

Examples:
    >>> options = MonitorOptions(preset="light", every_n_steps=10)
    >>> options.families, options.outputs.histograms
    (('attention', 'weights'), False)
"""

from spectral_monitor.core.options import (
    ALL_FAMILIES,
    FAMILIES,
    BudgetOptions,
    CaptureOptions,
    MonitorOptions,
    OutputOptions,
)
from spectral_monitor.core.reports import outputs_not_kept
from spectral_monitor.core.session import MonitorSession

__all__ = [
    "ALL_FAMILIES",
    "FAMILIES",
    "BudgetOptions",
    "CaptureOptions",
    "MonitorOptions",
    "MonitorSession",
    "OutputOptions",
    "outputs_not_kept",
]

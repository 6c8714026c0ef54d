"""spectral-monitor: watch the spectra of a transformer's attention, residual stream and weights as it trains.

Add :class:`SpectralMonitor` to a Lightning ``Trainer``; wrap the forward of a plain PyTorch loop in
:class:`Monitor`'s ``with monitor.step(step, batch=batch):``; drive a :class:`MonitorSession` from any other
training loop; or call the metric functions (:mod:`spectral_monitor.metrics`) and probes
(:mod:`spectral_monitor.probes`) directly, without a training framework. Everything a user configures is
importable from here:
``from spectral_monitor import SpectralMonitor, MonitorOptions, AlertConfig, CurvatureOptions``
(and ``AttentionFamilies``, what a monitor knows of attention-module families).

The names below are imported on first use, so the parts that need neither torch nor Lightning
(``spectral-monitor report``, :mod:`spectral_monitor.catalog`) start without loading them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spectral_monitor.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from spectral_monitor.alerts import AlertConfig, AlertEvent, Condition, Rule, default_rules
    from spectral_monitor.core import (
        BudgetOptions,
        CaptureOptions,
        MonitorOptions,
        MonitorSession,
        OutputOptions,
    )
    from spectral_monitor.core.second_order import (
        CurvatureOptions,
        JacobianOptions,
        NTKOptions,
        ProbeDataOptions,
    )
    from spectral_monitor.integrations.loop import Monitor
    from spectral_monitor.lightning import SpectralMonitor
    from spectral_monitor.metrics import attention_metrics, token_metrics, weight_metrics
    from spectral_monitor.probes import AttentionFamilies
    from spectral_monitor.records import Distribution, Measurement

__version__ = "0.1.0"

_HOMES = {
    "AlertConfig": "spectral_monitor.alerts",
    "AlertEvent": "spectral_monitor.alerts",
    "AttentionFamilies": "spectral_monitor.probes",
    "BudgetOptions": "spectral_monitor.core",
    "CaptureOptions": "spectral_monitor.core",
    "Condition": "spectral_monitor.alerts",
    "CurvatureOptions": "spectral_monitor.core.second_order",
    "Distribution": "spectral_monitor.records",
    "JacobianOptions": "spectral_monitor.core.second_order",
    "Measurement": "spectral_monitor.records",
    "Monitor": "spectral_monitor.integrations.loop",
    "MonitorOptions": "spectral_monitor.core",
    "MonitorSession": "spectral_monitor.core",
    "NTKOptions": "spectral_monitor.core.second_order",
    "OutputOptions": "spectral_monitor.core",
    "ProbeDataOptions": "spectral_monitor.core.second_order",
    "Rule": "spectral_monitor.alerts",
    "SpectralMonitor": "spectral_monitor.lightning",
    "attention_metrics": "spectral_monitor.metrics",
    "default_rules": "spectral_monitor.alerts",
    "token_metrics": "spectral_monitor.metrics",
    "weight_metrics": "spectral_monitor.metrics",
}

__all__ = [
    "AlertConfig",
    "AlertEvent",
    "AttentionFamilies",
    "BudgetOptions",
    "CaptureOptions",
    "Condition",
    "CurvatureOptions",
    "Distribution",
    "JacobianOptions",
    "Measurement",
    "Monitor",
    "MonitorOptions",
    "MonitorSession",
    "NTKOptions",
    "OutputOptions",
    "ProbeDataOptions",
    "Rule",
    "SpectralMonitor",
    "attention_metrics",
    "default_rules",
    "token_metrics",
    "weight_metrics",
]


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)

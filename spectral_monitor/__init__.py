"""spectral-monitor: watch the spectra of a transformer's attention, residual stream and weights as it trains.

Add :class:`SpectralMonitor` to a Lightning ``Trainer``; or call the metric functions
(:mod:`spectral_monitor.metrics`) and probes (:mod:`spectral_monitor.probes`) directly, without Lightning.

The names below are imported on first use, so the parts that need neither torch nor Lightning
(``spectral-monitor report``, :mod:`spectral_monitor.catalog`) start without loading them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spectral_monitor.callback import SpectralMonitor
    from spectral_monitor.metrics import attention_metrics, token_metrics, weight_metrics
    from spectral_monitor.records import Distribution, Measurement

__version__ = "0.1.0"

_HOMES = {
    "Distribution": "spectral_monitor.records",
    "Measurement": "spectral_monitor.records",
    "SpectralMonitor": "spectral_monitor.callback",
    "attention_metrics": "spectral_monitor.metrics",
    "token_metrics": "spectral_monitor.metrics",
    "weight_metrics": "spectral_monitor.metrics",
}

__all__ = [
    "Distribution",
    "Measurement",
    "SpectralMonitor",
    "attention_metrics",
    "token_metrics",
    "weight_metrics",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'spectral_monitor' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])

"""spectral-monitor: watch the spectra of a transformer's attention, residual stream and weights as it trains.

Add :class:`SpectralMonitor` to a Lightning ``Trainer``; or call the metric functions
(:mod:`spectral_monitor.metrics`) and probes (:mod:`spectral_monitor.probes`) directly, without Lightning.
"""

from spectral_monitor.callback import SpectralMonitor
from spectral_monitor.metrics import attention_metrics, token_metrics, weight_metrics
from spectral_monitor.records import Distribution, Measurement

__version__ = "0.1.0"

__all__ = [
    "Distribution",
    "Measurement",
    "SpectralMonitor",
    "attention_metrics",
    "token_metrics",
    "weight_metrics",
]

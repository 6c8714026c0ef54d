"""The Lightning integration: :class:`SpectralMonitor`, a callback of ``pytorch_lightning`` and of
``lightning.pytorch`` over the framework-free :mod:`spectral_monitor.core`; the default loss of the
second-order probes (:mod:`~spectral_monitor.lightning.losses`); the namespace shim
(:mod:`~spectral_monitor.lightning.namespaces`). The only package of the library that imports Lightning.

Examples:
    >>> from spectral_monitor import SpectralMonitor as top_level
    >>> top_level is SpectralMonitor
    True
"""

from spectral_monitor.lightning.callback import SpectralMonitor
from spectral_monitor.lightning.cli_values import register_cli_values

register_cli_values()

__all__ = ["SpectralMonitor"]

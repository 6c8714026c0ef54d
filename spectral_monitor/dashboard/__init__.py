"""The monitor's own TensorBoard tab (``spectral_monitor``), found by TensorBoard through the
``tensorboard_plugins`` entry point: see :mod:`spectral_monitor.dashboard.plugin`."""

from spectral_monitor.dashboard.plugin import PLUGIN_NAME, SpectralMonitorPlugin

__all__ = ["PLUGIN_NAME", "SpectralMonitorPlugin"]

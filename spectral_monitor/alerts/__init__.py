"""Alerts: rules over the monitor's metric streams, with patience and hysteresis (no Lightning here).

:class:`Rule` and :class:`Condition` say what to watch; :func:`default_rules` are the calibrated defaults;
:class:`AlertConfig` tunes, disables and adds rules (the ``alerts`` argument of ``SpectralMonitor``);
:class:`AlertEngine` turns each logging step's records into :class:`AlertEvent` s (fired, resolved).
"""

from spectral_monitor.alerts.engine import AlertEngine, AlertEvent
from spectral_monitor.alerts.rules import AlertConfig, Condition, Rule, default_rules, rules_from_config
from spectral_monitor.alerts.text import open_alerts_markdown

__all__ = [
    "AlertConfig",
    "AlertEngine",
    "AlertEvent",
    "Condition",
    "Rule",
    "default_rules",
    "open_alerts_markdown",
    "rules_from_config",
]

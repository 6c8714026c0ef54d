"""Alerts: rules over the monitor's metric streams, with patience and hysteresis (no Lightning here).

:class:`Rule` and :class:`Condition` say what to watch; :func:`default_rules` are the defaults;
:class:`AlertConfig` tunes, disables and adds rules (the ``alerts`` argument of ``SpectralMonitor``);
:class:`AlertEngine` turns each logging step's records into :class:`AlertEvent` s (fired, resolved);
:func:`open_alerts_markdown` lists the open ones. The rules live in :mod:`~spectral_monitor.alerts.rules`,
the thresholds their readers show in :mod:`~spectral_monitor.alerts.thresholds`, the engine in
:mod:`~spectral_monitor.alerts.engine` and its events in :mod:`~spectral_monitor.alerts.events`.

The names below are imported on first use, so what reads the rules alone (the metrics catalogue,
``spectral-monitor report``) loads neither torch nor the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spectral_monitor.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from spectral_monitor.alerts.engine import AlertEngine
    from spectral_monitor.alerts.events import AlertEvent
    from spectral_monitor.alerts.rules import AlertConfig, Condition, Rule, default_rules, rules_from_config
    from spectral_monitor.alerts.text import open_alerts_markdown

_HOMES = {
    "AlertConfig": "spectral_monitor.alerts.rules",
    "AlertEngine": "spectral_monitor.alerts.engine",
    "AlertEvent": "spectral_monitor.alerts.events",
    "Condition": "spectral_monitor.alerts.rules",
    "Rule": "spectral_monitor.alerts.rules",
    "default_rules": "spectral_monitor.alerts.rules",
    "open_alerts_markdown": "spectral_monitor.alerts.text",
    "rules_from_config": "spectral_monitor.alerts.rules",
}

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


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)

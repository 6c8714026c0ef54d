"""Alerts as text: the markdown table of open alerts written to TensorBoard."""

from __future__ import annotations

from collections.abc import Sequence

from spectral_monitor.alerts.engine import AlertEvent

__all__ = ["open_alerts_markdown"]


def open_alerts_markdown(open_alerts: Sequence[AlertEvent], step: int) -> str:
    """A markdown table of ``open_alerts`` (their fired events) as of ``step``."""
    if not open_alerts:
        # Written when the last alert resolves and on the first evaluation, so a healthy run has a status too.
        return f"No open alerts at step {step}. This table is rewritten whenever an alert fires or resolves."
    rows = [
        f"Open alerts at step {step}:",
        "",
        "| rule | severity | where | since step | fired at step | reading | remedy |",
        "|---|---|---|---|---|---|---|",
    ]
    rows += [
        f"| {alert.rule} | {alert.severity} | {_cell(alert.where)} | {alert.since} | {alert.step} | "
        f"{_cell(alert.comparison)} | {_cell(alert.remedy)} |"
        for alert in open_alerts
    ]
    return "\n".join(rows)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")

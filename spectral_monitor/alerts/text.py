"""Alerts as text: the markdown table of open alerts written to TensorBoard."""

from __future__ import annotations

from collections.abc import Sequence

from spectral_monitor.alerts.engine import AlertEvent

__all__ = ["open_alerts_markdown"]


def open_alerts_markdown(open_alerts: Sequence[AlertEvent], step: int) -> str:
    """The open alerts as a markdown table.

    Args:
        open_alerts: The fired events of the alerts still open.
        step: The step the table is written at.

    Returns:
        The table, or a line saying no alert is open.

    Examples:
        >>> from spectral_monitor.alerts.engine import AlertEvent
        >>> fired = AlertEvent("entropy_collapse", "fired", 12, "blocks.0.attn", None, "warning",
        ...                    "attention/entropy", "<=", 0.02, 0.3, "median", 10, heads="2/2")
        >>> print(open_alerts_markdown([fired], 12).splitlines()[-1])  # doctest: +ELLIPSIS
        | entropy_collapse | warning | blocks.0.attn (2/2 heads) | 10 | 12 | ... <= 0.300 |  |
        >>> open_alerts_markdown([], 3)
        'No open alerts at step 3. This table is rewritten whenever an alert fires or resolves.'
    """
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

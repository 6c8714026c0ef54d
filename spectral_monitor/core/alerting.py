"""What the monitor does with alerts during training: console lines, the user's callable, records and text
for the sinks, and the decision, taken by every rank together, to stop.

The rules and their evaluation live in :mod:`spectral_monitor.alerts`; this module acts on what they say.
It knows no training framework: stopping is asked of the integration through the callable it gives
:meth:`~spectral_monitor.core.MonitorSession.start` (Lightning sets ``trainer.should_stop``).
"""

from __future__ import annotations

import fnmatch
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from spectral_monitor.alerts import (
    AlertConfig,
    AlertEngine,
    AlertEvent,
    Rule,
    open_alerts_markdown,
    rules_from_config,
)
from spectral_monitor.distributed import any_rank
from spectral_monitor.records import Measurement
from spectral_monitor.validation import check_callable, check_names

__all__ = [
    "ALERT_TEXT_TAG",
    "AlertStep",
    "Alerting",
    "ConsoleHandler",
    "alert_logger",
    "can_fire",
    "console_line_above_progress_bars",
]

ALERT_TEXT_TAG = "alerts/table"
"""The TensorBoard text tag of the open-alerts table (shown as ``alerts/table/text_summary``)."""

_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.ERROR}


class ConsoleHandler(logging.StreamHandler):
    """A ``StreamHandler`` (stderr) whose lines start on a line of their own under a tqdm progress bar
    (Lightning's): written after the bar's text, an alert line would run on from it.

    Examples:
        >>> import io, logging
        >>> console = io.StringIO()
        >>> record = logging.LogRecord("a", logging.WARNING, "", 0, "an alert", None, None)
        >>> ConsoleHandler(console).emit(record)
        >>> console.getvalue()
        'an alert\\n'
    """

    def emit(self, record: logging.LogRecord) -> None:
        """Write ``record``, above the progress bars where one shows.

        Args:
            record: What is logged.
        """
        if not console_line_above_progress_bars(self.format(record), self.stream):
            super().emit(record)


def console_line_above_progress_bars(line: str, stream: TextIO) -> bool:
    """Write ``line`` to ``stream`` through ``tqdm.write`` where a tqdm progress bar is showing, which clears
    the bar, writes the line and draws the bar again below it.

    tqdm is only looked up where it is already imported: no bar can show otherwise.

    Args:
        line: The text, without a final newline.
        stream: Where to write it.

    Returns:
        Whether a bar was showing and the line was written; else nothing was written.

    Examples:
        >>> import io
        >>> console_line_above_progress_bars("a line", io.StringIO())  # no bar: the caller writes it
        False
    """
    tqdm = sys.modules.get("tqdm")
    if tqdm is None or not getattr(tqdm.tqdm, "_instances", None):
        return False
    tqdm.tqdm.write(line, file=stream)
    return True


def alert_logger() -> logging.Logger:
    """The ``spectral_monitor.alerts`` logger; given a console handler, as Lightning does for its own logger,
    when the application configured none, so alert lines (resolved ones at INFO included) are seen.

    Where neither the root logger nor this one has a handler, a ``StreamHandler`` (stderr) is added, the
    level set to INFO and propagation turned off; a configured application's logging is left as it is.

    Returns:
        The logger.

    Examples:
        >>> alert_logger().name
        'spectral_monitor.alerts'
    """
    logger = logging.getLogger("spectral_monitor.alerts")
    if not logging.getLogger().hasHandlers() and not logger.handlers:
        logger.addHandler(ConsoleHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


@dataclass
class AlertStep:
    """What one logging step's alerts add to the sinks' output (rank 0), and the ``stop_on`` rules that fired
    on this rank.

    Attributes:
        records: the ``alerts`` counter records (``open`` and ``fired`` per rule that can fire); empty off the
            writing rank.
        text: the open-alerts table (markdown) for :data:`ALERT_TEXT_TAG`, when an alert fired or resolved or
            the table was never written; else None.
        stop: the ``stop_on`` rules that fired on this rank's data at this step.

    Examples:
        >>> AlertStep(stop=["weight_runaway"])
        AlertStep(records=[], text=None, stop=['weight_runaway'])
    """

    records: list[Measurement] = field(default_factory=list)
    text: str | None = None
    stop: list[str] = field(default_factory=list)


def can_fire(rule: Rule, families: Sequence[str]) -> bool:
    """Whether ``rule`` is evaluated with ``families`` measured: the families its required conditions read
    are measured (any of them with ``combine="any"``, all of them with ``"all"``).

    A condition's family is the first part of its metric (``"attention/entropy"``: ``attention``); the
    ``alerts`` family is always measured.

    Args:
        rule: an alert rule.
        families: the families measured, as :attr:`MonitorOptions.families
            <spectral_monitor.core.MonitorOptions.families>` names them.

    Returns:
        Whether the rule can ever fire.

    Examples:
        >>> from spectral_monitor.alerts import default_rules
        >>> rules = {rule.name: rule for rule in default_rules()}
        >>> can_fire(rules["edge_of_stability"], ["attention", "weights"])
        False
        >>> can_fire(rules["weight_runaway"], ["attention", "weights"])
        True
    """
    read = [c.metric.split("/", 1)[0] for c in rule.conditions if c.required]
    measured = [any(fnmatch.fnmatchcase(on, family) for on in (*families, "alerts")) for family in read]
    return all(measured) if rule.combine == "all" else any(measured)


def check_stop_on(stop_on: object, rules: Sequence[Rule], families: Sequence[str]) -> list[str]:
    """``stop_on`` if it lists rules that run and can fire with ``families`` on: a rule fires only when the
    families its required conditions read are measured (any of them with ``combine="any"``, all of them
    with ``"all"``)."""
    by_name = {rule.name: rule for rule in rules}
    names = check_names("stop_on", stop_on, what="rule names")
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise ValueError(f"stop_on names rules {unknown} that do not run; the rules are {sorted(by_name)}")
    for name in names:
        rule = by_name[name]
        if not can_fire(rule, families):
            read = [c.metric.split("/", 1)[0] for c in rule.conditions if c.required]
            raise ValueError(
                f"stop_on names rule {name!r}, which reads {sorted(set(read))} and can never fire with the "
                f"families measured ({list(families)}): turn its family on (families=[...], or an opt-in "
                "probe's options) or take the rule out of stop_on"
            )
    return names


class Alerting:
    """Evaluates the alert rules on each logging step and acts on what fires or resolves.

    Every rank evaluates (each measures its own batch), so a ``stop_on`` decision is taken by all ranks in
    one collective; only the writing rank (global rank 0) logs, calls ``on_alert`` and returns output for the
    sinks.

    Args:
        config: which rules run: None for :func:`~spectral_monitor.alerts.default_rules`.
        on_alert: called on the writing rank with each fired or resolved event, after its console line; or
            None.
        stop_on: names of rules whose firing stops training.
        families: the families measured; a ``stop_on`` rule must be able to fire with them.

    Attributes:
        engine: the rules' state.
        counted: the rules that can fire with ``families``, whose counters are written.
        stopping: whether a stop was asked for in this run.

    Raises:
        ValueError: if ``on_alert`` is not callable, or ``stop_on`` names a rule that does not run or can
            never fire with ``families`` (from the validation it calls).

    Examples:
        >>> alerting = Alerting(None, None, stop_on=["weight_runaway"], families=["attention", "weights"])
        >>> alerting.evaluate(0, [], writes=False)
        AlertStep(records=[], text=None, stop=[])
        >>> alerting.rules_stopping(0, [], writes=False)
        []
    """

    def __init__(
        self,
        config: AlertConfig | None,
        on_alert: Callable[[AlertEvent], Any] | None,
        stop_on: Sequence[str],
        families: Sequence[str],
    ) -> None:
        self.engine = AlertEngine(rules_from_config(config))
        self.on_alert = check_callable("on_alert", on_alert, "a callable taking an AlertEvent")
        self.stop_on = tuple(check_stop_on(stop_on, self.engine.rules, families))
        self.stopping = False  # a stop was asked for in this run: the console says so once
        # Counters only for the rules that can fire: a rule whose probe is off would draw a flat zero.
        self.counted = tuple(rule.name for rule in self.engine.rules if can_fire(rule, families))
        self.status_written = False  # the open-alerts table is written once even when nothing ever fires

    def evaluate(self, step: int, measurements: Sequence[Measurement], writes: bool) -> AlertStep:
        """Advance the rules by one evaluation; log and hand over what changed (on the writing rank).

        On the writing rank each event is logged (a fired one at its severity's level, a resolved one at
        INFO) and given to ``on_alert``.

        Args:
            step: the logging step.
            measurements: the step's records, those judged only included.
            writes: whether this is the writing rank.

        Returns:
            The ``stop_on`` rules that fired here and, on the writing rank, the counter records and the
            open-alerts table when it changed (or was never written).
        """
        events = self.engine.evaluate(step, measurements)
        fired = {event.rule for event in events if event.kind == "fired"}
        stop = [rule for rule in self.stop_on if rule in fired]
        if not writes:
            return AlertStep(stop=stop)
        logger = alert_logger()
        for event in events:
            level = _LEVELS[event.severity] if event.kind == "fired" else logging.INFO
            logger.log(level, event.message())
            if self.on_alert is not None:
                self.on_alert(event)
        text = (
            open_alerts_markdown(self.engine.open_alerts, step) if events or not self.status_written else None
        )
        self.status_written = True
        return AlertStep(self.engine.counter_records(step, self.counted), text, stop)

    def rules_stopping(self, step: int, fired_here: Sequence[str], writes: bool) -> list[str]:
        """The ``stop_on`` rules that fired on any rank at this step; training stops after it on every rank
        when there is one.

        A collective when ``stop_on`` is set (one all-reduce of a flag per rule), entered by every rank on
        every step the alerts are evaluated, whatever its own rules did; the writing rank names the rules that
        fired, once per run, and whether they fired on its own data or only on another rank's (whose alert
        it does not log).

        Args:
            step: the logging step.
            fired_here: the ``stop_on`` rules that fired on this rank (:attr:`AlertStep.stop`).
            writes: whether this is the writing rank.

        Returns:
            The ``stop_on`` rules that fired on some rank, in ``stop_on``'s order; empty when none did or
            ``stop_on`` is empty.
        """
        if not self.stop_on:
            return []
        fired_anywhere = any_rank([rule in fired_here for rule in self.stop_on])
        rules = [rule for rule, fired in zip(self.stop_on, fired_anywhere, strict=True) if fired]
        if rules and writes and not self.stopping:
            elsewhere = [rule for rule in rules if rule not in fired_here]
            alert_logger().warning(
                "SpectralMonitor: stopping training after step %d: %s fired%s (stop_on=%s)",
                step,
                ", ".join(rules),
                f" ({', '.join(elsewhere)} on another rank's data)" if elsewhere else "",
                list(self.stop_on),
            )
        self.stopping = self.stopping or bool(rules)
        return rules

"""When the monitor measures: :class:`Cadence`, the one rule behind every cadence it has.

Counted in steps: the logging steps (``every_n_steps``, Lightning's ``log_every_n_steps`` rule) and each
second-order probe's own steps. Counted in logging steps: figures, head diversity and weight spectra
(``*_every_n_logs``, starting with the first logging step).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Cadence"]


@dataclass(frozen=True)
class Cadence:
    """Which counts 0, 1, 2, ... are due.

    Attributes:
        every: the period; 0: no count is due.
        ends_period: due where a period ends, ``(count + 1) % every == 0`` (steps ``every - 1``,
            ``2 every - 1``, ...); else where one starts, ``count % every == 0`` (0, ``every``, ...).
        first: count 0 is due too.
        log_spaced: also the counts with ``count + 1`` a power of two below ``every`` (0, 1, 3, 7, ...):
            dense early, where curvature changes fastest.

    Examples:
        >>> [step for step in range(12) if Cadence.of_steps(4).due(step)]
        [0, 3, 7, 11]
        >>> [log for log in range(7) if Cadence.of_logs(3).due(log)]
        [0, 3, 6]
        >>> [step for step in range(20) if Cadence.of_steps(16, log_spaced=True).due(step)]
        [0, 1, 3, 7, 15]
    """

    every: int
    ends_period: bool = True
    first: bool = True
    log_spaced: bool = False

    @classmethod
    def of_steps(cls, every_n_steps: int, *, first_step: bool = True, log_spaced: bool = False) -> Cadence:
        """The cadence of training steps: ``(step + 1) % every_n_steps == 0``.

        Args:
            every_n_steps: The period; 0: no step is due.
            first_step: Step 0 is due too.
            log_spaced: Also the steps with ``step + 1`` a power of two below the period.

        Returns:
            The cadence.
        """
        return cls(every_n_steps, ends_period=True, first=first_step, log_spaced=log_spaced)

    @classmethod
    def of_logs(cls, every_n_logs: int) -> Cadence:
        """The cadence of logging steps, counted from 0: every ``every_n_logs``-th, starting with the first.

        Args:
            every_n_logs: The period; 0: never.

        Returns:
            The cadence.
        """
        return cls(every_n_logs, ends_period=False)

    def due(self, count: int) -> bool:
        """Whether a count is due.

        Args:
            count: The step, or the logging step, counted from 0.

        Returns:
            Whether it is due.
        """
        if self.every <= 0:
            return False
        if (count + self.ends_period) % self.every == 0 or (self.first and count == 0):
            return True
        return self.log_spaced and count + 1 < self.every and (count + 1) & count == 0

"""The one interface every probe family presents to the step pipeline: :class:`Probe`.

A family (attention, residual stream, weights, weight spectra, output logits, second order) carries its own
cadence, what it installs on the model around a forward, and its measurement; the pipeline only iterates a
list of them. A probe knows ``nn.Module`` but not the training framework, and returns records
(:class:`~spectral_monitor.records.Measurement`) without knowing where they are written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from spectral_monitor.records import Measurement


class Probe:
    """Base class of a probe family: cadence, arming around a forward, measurement, state, release.

    Every method has a harmless default, so a family overrides only what it needs: a family that reads
    the parameters alone never arms, one with no warm state keeps the empty state.

    Invariant: :meth:`disarm` follows every :meth:`arm`, also when the forward raised, and leaves the
    model as it was before :meth:`arm`.

    Example::

        >>> class Counting(Probe):
        ...     name = "counting"
        ...     def __init__(self):
        ...         self.calls = 0
        ...     def measure(self, step, model):
        ...         self.calls += 1
        ...         return []
        >>> probe = Counting()
        >>> probe.due(3), probe.measure(3, nn.Linear(1, 1)), probe.calls
        (True, [], 1)
    """

    name: str = "probe"
    """The family's name: the key of its entry in the session's checkpoint state and in failure reports."""

    def due(self, step: int) -> bool:
        """Whether this family measures at ``step``.

        Args:
            step: Optimizer steps taken before the current batch.

        Returns:
            ``True`` on the family's own cadence; the default measures at every step it is asked about.
        """
        return True

    def arm(self, model: nn.Module) -> None:
        """Installs what the family records during the coming forward (hooks, wrappers).

        Args:
            model: The model whose training forward, or probe forward, follows.
        """

    def disarm(self) -> None:
        """Removes everything :meth:`arm` installed; a no-op when nothing is armed."""

    def measure(self, step: int, model: nn.Module) -> list[Measurement]:
        """Turns what was recorded (or the parameters) into records, and drops the recordings.

        Args:
            step: The step the records are filed under.
            model: The model measured.

        Returns:
            The family's records for ``step``; empty when it has nothing to say.
        """
        return []

    def state_dict(self) -> dict[str, Any]:
        """The family's warm state (iterates, running maxima) for a checkpoint.

        Returns:
            A mapping of plain values and tensors; empty for a stateless family.
        """
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned; keys it does not know are ignored.

        Args:
            state_dict: A mapping from :meth:`state_dict`, possibly of an older version.
        """

    def close(self) -> None:
        """Releases what the family holds at the end of the run; calls :meth:`disarm` by default."""
        self.disarm()
